"""Maintainer script (GPU machine): check and time the staged TF32 tensor-core variants (issue 16).

1. Correctness: every staged variant (kernels/tensorcore/mma_staged.py) at its default and a few space points,
   on odd shapes and the timed layers, against float64 with NaN-poisoned outputs and workspace.
2. Timing: the staged variants (the first points of their space, best reported), the register-staged
   TF32 variants they replace (defaults) and cuDNN TF32 (torch F.conv2d, allow_tf32, benchmark on):
   median microseconds of the whole call (filter steps included; "rest" = without the steps that
   depend on the weights alone) and effective TFLOPS, on ResNet 64@56, 128@28, 256@14, 512@7 N32
   (3x3) and the 1x1 C1024 -> K256 @14 N32.

    PYTHONPATH=src:tests python scripts/tc_check.py [--check-only | --time-only] [--points N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import numpy as np

from convforge.backends import get_backend
from convforge.check import check_plan, random_inputs
from convforge.kernels import get_variant
from convforge.plan import Epilogue
from convforge.spec import ConvSpec

STAGED = ["implicit_gemm_nhwc_tf32", "gemm1x1_pipe_tf32", "winograd_nonfused_f2_pipe_tf32"]
OLD = ["implicit_gemm_tf32", "gemm1x1_tf32", "winograd_nonfused_f2_tf32", "winograd_nonfused_f7"]
LAYERS = {
    "res64@56": ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1),
    "res128@28": ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1),
    "res256@14": ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1),
    "res512@7": ConvSpec.make(32, 512, 7, 7, 512, 3, 3, 1, 1),
    "1x1 1024->256@14": ConvSpec.make(32, 1024, 14, 14, 256, 1, 1),
}
ODD = [ConvSpec.make(1, 1, 13, 13, 1, 3, 3, 1, 1), ConvSpec.make(2, 3, 13, 11, 5, 3, 3, 1, (0, 1, 1, 0)),
       ConvSpec.make(1, 2, 71, 13, 3, 3, 3, 2, 1), ConvSpec.make(3, 5, 17, 19, 7, 5, 5, 1, 2, 2),
       ConvSpec.make(1, 3, 27, 29, 4, 11, 11, 4, (2, 1, 0, 3)), ConvSpec.make(2, 7, 9, 9, 3, 1, 1, 1, 0),
       ConvSpec.make(1, 37, 13, 7, 70, 3, 3, 1, (0, 1, 2, 1)), ConvSpec.make(2, 132, 9, 11, 131, 3, 3, 2, 1),
       ConvSpec.make(3, 256, 14, 14, 1024, 1, 1, 2), ConvSpec.make(3, 12, 17, 13, 5, 1, 1, 2, 1),
       ConvSpec.make(5, 832, 7, 7, 128, 1, 1), ConvSpec.make(1, 20, 7, 9, 33, 1, 1)]


def check(be: Any, points: int) -> int:
    """Every staged variant on ODD and LAYERS: default (bias + ReLU; residual on the second point)."""
    bad = 0
    for spec in ODD + list(LAYERS.values()):
        for name in STAGED:
            v = get_variant(name)
            if v.applies(spec, be.device):
                continue
            pts = v.space(spec, be.device)[:points]
            for i, p in enumerate(pts):
                epi = Epilogue(bias=True, relu=True) if i == 0 else Epilogue()
                try:
                    res = check_plan(v.plan(spec, p, be.device, epi), be, seed=i, batch_slice=2)
                    ok, text = res.ok, str(res)
                except Exception as err:  # noqa: BLE001 - report and go on
                    ok, text = False, f"ERROR {type(err).__name__}: {str(err)[:160]}"
                bad += not ok
                print(f"check {name:24s} {spec.short()[:48]:48s} [{p.short()}] {text}", flush=True)
            bad += check_residual(be, v, spec) if v.residual_ok else 0
    print(f"check: {bad} failures", flush=True)
    return bad


def check_residual(be: Any, v: Any, spec: ConvSpec) -> int:
    """conv + bias + residual + ReLU at the default point against float64; 1 on failure."""
    from convforge.reference import conv2d_ref

    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(spec.x_shape), rng.standard_normal(spec.w_shape)
    b, res = rng.standard_normal(spec.k), rng.standard_normal(spec.y_shape)
    want = np.maximum(conv2d_ref(x, w, spec, b) + res, 0.0)
    exe = be.executable(v.plan(spec, v.default(spec, be.device), be.device,
                               Epilogue(bias=True, relu=True, residual=True)))
    bufs = {"x": be.upload(x), "w": be.upload(w), "bias": be.upload(b), "res": be.upload(res),
            "y": be.upload(np.full(spec.y_shape, np.nan, np.float32))}
    exe(bufs)
    be.synchronize()
    got = be.download(bufs["y"], spec.y_shape)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    ok = err < v.tolerance and not np.isnan(got).any()
    print(f"check {v.name:24s} {spec.short()[:48]:48s} residual+bias+relu rel {err:.2e}{'' if ok else ' FAIL'}")
    return int(not ok)


def _time(be: Any, exe: Any, bufs: dict[str, Any], steps: str = "all") -> float:
    for _ in range(3):
        exe(bufs, steps)
    return statistics.median(be.time_ms(lambda: exe(bufs, steps), 20)) * 1e3


def time_variants(be: Any, label: str, spec: ConvSpec, points: int) -> None:
    x, w, _ = random_inputs(spec, np.random.default_rng(0))
    bufs = {"x": be.upload(x), "w": be.upload(w), "y": be.empty(4 * spec.n * spec.k * spec.p * spec.q)}
    for name in STAGED + OLD:
        v = get_variant(name)
        if v.applies(spec, be.device):
            continue
        pts = v.space(spec, be.device)[:points] if name in STAGED else [v.default(spec, be.device)]
        rows = []
        for p in pts:
            plan = v.plan(spec, p, be.device)
            exe = be.executable(plan)
            res = check_plan(plan, be, exe=exe, batch_slice=1)
            rows.append((_time(be, exe, bufs), _time(be, exe, bufs, "rest"), res, p))
        us, rest, res, p = min(rows, key=lambda r: r[0])
        print(f"{label:17s} {name:27s} {us:8.1f} {rest:8.1f} {spec.flops / us / 1e6:7.1f} "
              f"{res.rel_err:9.2e}{'' if res.ok else ' FAIL'}  [{p.short()}] best of {len(rows)}", flush=True)


def time_cudnn(label: str, spec: ConvSpec) -> None:
    import torch
    import torch.nn.functional as F

    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    x = torch.randn(spec.n, spec.c, spec.h, spec.w, device="cuda")
    w = torch.randn(spec.k, spec.c, spec.r, spec.s, device="cuda")
    pad = spec.pad
    xp = F.pad(x, (pad[2], pad[3], pad[0], pad[1])) if pad[0] != pad[1] or pad[2] != pad[3] else x
    kw = dict(stride=spec.stride, dilation=spec.dilation, padding=0 if xp is not x else (pad[0], pad[2]))
    y = F.conv2d(xp, w, **kw)
    ref = F.conv2d(xp[:1].double(), w.double(), **kw)
    err = float((y[:1].double() - ref).norm() / ref.norm())
    for _ in range(5):
        F.conv2d(xp, w, **kw)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        F.conv2d(xp, w, **kw)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    us = statistics.median(times)
    print(f"{label:17s} {'cuDNN TF32 (torch)':27s} {us:8.1f} {'':8s} {spec.flops / us / 1e6:7.1f} "
          f"{err:9.2e}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--time-only", action="store_true")
    ap.add_argument("--points", type=int, default=4, help="space points timed per staged variant")
    ap.add_argument("--check-points", type=int, default=3, help="space points checked per staged variant")
    args = ap.parse_args()
    be = get_backend("cuda")
    print(f"device: {be.device.name}", flush=True)
    bad = 0 if args.time_only else check(be, args.check_points)
    if not args.check_only:
        print(f"{'layer':17s} {'variant':27s} {'us':>8s} {'rest us':>8s} {'TFLOPS':>7s} {'rel err':>9s}")
        for label, spec in LAYERS.items():
            time_variants(be, label, spec, args.points)
            try:
                time_cudnn(label, spec)
            except Exception as err:  # noqa: BLE001 - torch missing or failing: the rest stands
                print(f"{label:17s} cuDNN: {type(err).__name__}: {err}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
