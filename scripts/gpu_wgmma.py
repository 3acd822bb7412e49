"""GPU check of the wgmma 1x1 GEMM (H100/H200): correctness against float64, then timings.

``--check SW``: odd shapes and a few ResNet 1x1 layers, several points with swizzle mode SW (0 or
128; with 128 also the staged epilogue ep=smem and, stride 1 without padding, the direct x path
xl=direct), NaN-poisoned outputs and workspaces (one process per mode: a faulting kernel kills its
CUDA context); exits 1 on any failure. ``--time LAYER``: a ResNet-50 1x1 layer, N=32: wgmma points
of both x paths and both epilogues (the call with the weights cached; transposed points also the
transpose alone) and gemm1x1_tf32's default; ``--baselines``: cuDNN-best TF32 on all.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys

import numpy as np

from convforge.backends import get_backend
from convforge.check import check_plan, random_inputs
from convforge.kernels import get_variant
from convforge.params import Params
from convforge.spec import ConvSpec

NAME = "gemm1x1_wgmma_tf32"
ODD = [ConvSpec.make(1, 7, 13, 13, 5, 1, 1), ConvSpec.make(3, 70, 11, 13, 67, 1, 1),
       ConvSpec.make(2, 33, 15, 17, 130, 1, 1, 2, (1, 0, 0, 2)), ConvSpec.make(1, 64, 7, 7, 300, 1, 1)]
BIG = [ConvSpec.make(2, 1024, 14, 14, 256, 1, 1), ConvSpec.make(1, 512, 7, 7, 2048, 1, 1)]
LAYERS = {"1024->256 @14": ConvSpec.make(32, 1024, 14, 14, 256, 1, 1),
          "256->64 @56": ConvSpec.make(32, 256, 56, 56, 64, 1, 1),
          "512->2048 @7": ConvSpec.make(32, 512, 7, 7, 2048, 1, 1),
          "64->256 @56": ConvSpec.make(32, 64, 56, 56, 256, 1, 1)}


def check_points(sw: int, spec: ConvSpec) -> list[Params]:
    """Transposed points of swizzle mode SW, and for sw=128 the staged epilogue and (stride 1,
    no padding) the direct x path: the new code paths must fail here if they are wrong."""
    pts = [Params(bn=128, wg=2, st=4, sw=sw), Params(bn=64, wg=1, st=3, sw=sw),
           Params(bn=256, wg=1, st=5, sw=sw), Params(bn=192, wg=2, st=3, sw=sw)]
    if sw == 128:
        pts += [Params(bn=128, wg=2, st=4, sw=128, ep="smem"), Params(bn=96, wg=1, st=3, sw=128, ep="smem")]
        if spec.stride == (1, 1) and spec.pad == (0, 0, 0, 0):
            pts += [Params(bn=128, wg=2, st=4, sw=128, xl="direct", ep="smem"),
                    Params(bn=256, wg=1, st=4, sw=128, xl="direct", ep="smem"),
                    Params(bn=64, wg=1, st=3, sw=128, xl="direct", ep="regs"),
                    Params(bn=192, wg=1, st=5, sw=128, xl="direct", ep="regs")]
    return pts


def check(sw: int) -> int:
    from convforge.plan import Epilogue

    be = get_backend("cuda")
    v = get_variant(NAME)
    bad = 0
    for spec in ODD + BIG:
        pts = check_points(sw, spec)
        for i, p in enumerate(pts if spec in ODD else pts[:1] + pts[4:]):
            epi = Epilogue(bias=True, relu=True) if i % 2 == 0 else Epilogue()
            try:
                res = check_plan(v.plan(spec, p, be.device, epi), be, seed=i, batch_slice=2)
                line = f"{res}"
                bad += not res.ok
            except Exception as err:  # noqa: BLE001 - report, then stop: the context may be gone
                print(f"check sw={sw} {spec.short():40s} [{p.short()}] ERROR {type(err).__name__}: {str(err)[:300]}")
                return 1
            print(f"check sw={sw} {spec.short():40s} [{p.short()}] {line}", flush=True)
    print(f"check sw={sw}: {'FAILED' if bad else 'all ok'} ({bad} bad)")
    return int(bad > 0)


def _ms(be, fn, reps: int = 30) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    return statistics.median(be.time_ms(fn, reps))


def time_layer(label: str) -> None:
    """One layer: gemm1x1_tf32's default, then wgmma points of both x paths (xl) and both
    epilogues (ep), each row printed when measured; transposed rows split off the transpose."""
    be = get_backend("cuda")
    spec = LAYERS[label]
    wg, tc = get_variant(NAME), get_variant("gemm1x1_tf32")
    x, w, _ = random_inputs(spec, np.random.default_rng(0))
    bufs = {"x": be.upload(x), "w": be.upload(w), "y": be.empty(4 * spec.n * spec.k * spec.p * spec.q)}
    tplan = tc.plan(spec, tc.default(spec, be.device), be.device)
    _row(label, spec, f"gemm1x1_tf32 [{tplan.params.short()}]", _ms(be, lambda e=be.executable(tplan): e(bufs)))
    space = wg.space(spec, be.device)
    extra = [Params(bn=b, wg=g, st=s, sw=128, xl=xl, ep=ep) for (b, g, s), xl, ep in itertools.product(
        ((128, 2, 4), (128, 1, 4), (256, 1, 4), (256, 2, 3), (192, 1, 4)), ("direct", "transposed"), ("smem", "regs"))]
    for p in list(dict.fromkeys(space[:4] + [q for q in extra if q in space])):
        plan = wg.plan(spec, p, be.device)
        exe = be.executable(plan)
        exe(bufs)  # fills wt
        be.synchronize()
        whole = _ms(be, lambda e=exe: e(bufs, "rest"))
        split = "  (GEMM only: x read in place)"
        if p.xl == "transposed":
            xexe = be.executable(dataclasses.replace(plan, steps=(plan.steps[1],)))
            xt = _ms(be, lambda e=xexe: e(bufs))
            split = f"  (transpose {xt * 1e3:5.1f} us, GEMM {(whole - xt) * 1e3:5.1f} us)"
        be.synchronize()
        _row(label, spec, f"{NAME} [{p.short()}]", whole, split)


def _row(label: str, spec: ConvSpec, name: str, ms: float, extra: str = "") -> None:
    print(f"time {label:14s} {name:50s} {ms * 1e3:8.1f} us {spec.flops / ms / 1e9:6.1f} TFLOPS{extra}", flush=True)


def baselines_all() -> None:
    """cuDNN-best TF32 (every legacy algorithm with default math, and PyTorch's TF32 pick)."""
    from convforge.bench import baselines
    from convforge.bench.timing import Timing

    for label, spec in LAYERS.items():
        res = baselines.run("cudnn", spec, Timing(3, 25, 1), True, classes=("relaxed",))
        best = baselines.best_tf32(res)
        if best is not None and best.time_ms is not None:
            _row(label, spec, f"cuDNN-best TF32 ({best.algo})", best.time_ms)
        for r in res:
            if r.impl == "torch-tf32" and r.time_ms:
                _row(label, spec, "torch TF32 pick", r.time_ms)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", type=int, choices=(0, 128))
    ap.add_argument("--time", type=int, choices=range(len(LAYERS)), help="index into LAYERS")
    ap.add_argument("--baselines", action="store_true")
    args = ap.parse_args()
    if args.check is not None:
        return check(args.check)
    if args.time is not None:
        time_layer(list(LAYERS)[args.time])
    if args.baselines:
        baselines_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
