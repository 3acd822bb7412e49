"""Check and time the wgrad (update) variants on ResNet layers against PyTorch's cuDNN wgrad (GPU machine).

    PYTHONPATH=src:tests python scripts/gpu_wgrad.py [--n 32] [--layers res64@56,...] [--space 12]
        [--mods 'ks=8;bk=16'] [--json $OUT/wgrad.json]

Per layer: every wgrad variant's default (and ``--space`` more points of each space, or each default
changed by each ``--mods`` entry), compiled in parallel, checked against the float64 reference on
the whole batch and timed by the tuner's own measurement (every launch of the plan inside the
timed call); then PyTorch's pick (aten.convolution_backward, weight gradient only, cudnn.benchmark
on, TF32 off) timed with CUDA events, median of 50, and its error against the same reference.
The table ends with each layer's best convforge point within the fp32 class (error <= 5e-6 or
<= 2x the most accurate point's) and its speed-up over PyTorch's pick.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

from convforge.backends import get_backend
from convforge.check import expected, pass_inputs
from convforge.kernels import all_variants, get_variant
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.reference import rel_l2
from convforge.spec import ConvSpec
from convforge.tune.tuner import Tuner

LAYERS = {"res64@56": (64, 56, 56, 64, 3, 1, 1), "res128@28": (128, 28, 28, 128, 3, 1, 1),
          "res256@14": (256, 14, 14, 256, 3, 1, 1), "res512@7": (512, 7, 7, 512, 3, 1, 1),
          "1x1 256>64@56": (256, 56, 56, 64, 1, 1, 0), "1x1 64>256@56": (64, 56, 56, 256, 1, 1, 0),
          "1x1/2 256>512@56": (256, 56, 56, 512, 1, 2, 0), "3x3/2 64>128@56": (64, 56, 56, 128, 3, 2, 1)}


def _spec(label: str, n: int) -> ConvSpec:
    if label in LAYERS:
        c, h, w, k, r, st, pd = LAYERS[label]
        return ConvSpec.make(n, c, h, w, k, r, r, st, pd, conv_pass="wgrad")
    return ConvSpec.parse(label).with_pass("wgrad")


def torch_wgrad(spec: ConvSpec, inputs: dict[str, np.ndarray], ref: np.ndarray) -> tuple[float, float]:
    """(median ms, rel error) of PyTorch's weight gradient (cuDNN, TF32 off)."""
    import torch

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.from_numpy(inputs["x"]).cuda()
    dy = torch.from_numpy(inputs["y"]).cuda()
    w = torch.empty(spec.w_shape, device="cuda")
    pt, pb, pl, pr = spec.pad
    if pt != pb or pl != pr:
        return float("nan"), float("nan")

    def run() -> torch.Tensor:
        return torch.ops.aten.convolution_backward(dy, x, w, None, list(spec.stride), [pt, pl], list(spec.dilation),
                                                   False, [0, 0], spec.groups, [False, True, False])[1]

    for _ in range(5):
        out = run()
    torch.cuda.synchronize()
    times = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), rel_l2(out.cpu().numpy(), ref)


def bias_row(be, spec: ConvSpec, label: str) -> str:  # type: ignore[no-untyped-def]
    """The bias gradient's time and error beside PyTorch's dy.sum((0, 2, 3))."""
    import torch

    from convforge.kernels.wgrad import bias_grad_plan
    from convforge.reference import bias_grad_ref

    dy = np.random.default_rng(1).uniform(-1, 1, spec.y_shape).astype(np.float32)
    plan = bias_grad_plan(spec, be.device)
    exe = be.executable(plan)
    bufs = {"y": be.upload(dy), "bias": be.empty(4 * spec.k)}
    exe(bufs)
    be.synchronize()
    err = rel_l2(be.download(bufs["bias"], (spec.k,)), bias_grad_ref(dy))
    ms = statistics.median(be.time_ms(lambda: exe(bufs), 50))
    t = torch.from_numpy(dy).cuda()
    for _ in range(3):
        t.sum((0, 2, 3))
    times = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t.sum((0, 2, 3))
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return (f"{label:18s} bias_grad [{plan.params.short()}] {ms:.4f} ms err {err:.1e} | torch sum "
            f"{statistics.median(times):.4f} ms")


def breakdown(be, spec: ConvSpec, label: str, v, prm: Params) -> str:  # type: ignore[no-untyped-def]
    """Time of each step of a plan: the plan cut after step i, timed, minus the cut after i - 1."""
    import dataclasses

    plan = v.plan(spec, prm, be.device)
    inputs = pass_inputs(spec, np.random.default_rng(0))
    bufs = {k: be.upload(a) for k, a in inputs.items()}
    bufs["w"] = be.empty(4 * int(np.prod(spec.w_shape)))
    prev, parts = 0.0, []
    for i in range(1, len(plan.steps) + 1):
        exe = be.executable(dataclasses.replace(plan, steps=plan.steps[:i]))
        exe(bufs)
        be.synchronize()
        ms = statistics.median(be.time_ms(lambda exe=exe: exe(bufs), 30))
        step = plan.steps[i - 1]
        parts.append(f"{getattr(step, 'kernel', type(step).__name__)} {1000 * (ms - prev):.1f}")
        prev = ms
    return f"{label:18s} {v.name}: {prev:.4f} ms = " + " + ".join(parts) + " us"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--variants", default=",".join(v.name for v in all_variants() if "wgrad" in v.passes))
    ap.add_argument("--space", type=int, default=0, help="also time this many more points of each space")
    ap.add_argument("--mods", default="", help="';'-separated changes of each default, e.g. 'ks=8;bk=16'")
    ap.add_argument("--json", default="")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--bias", action="store_true", help="also time bias_grad_plan against dy.sum((0, 2, 3))")
    ap.add_argument("--breakdown", action="store_true", help="also time each step of every default plan")
    args = ap.parse_args()
    be = get_backend("cuda")
    tuner = Tuner(be)
    rows, summary = [], []
    for label in args.layers.split(","):
        spec = _spec(label, args.n)
        points = []
        for name in args.variants.split(","):
            v = get_variant(name)
            if v.applies(spec, be.device):
                continue
            d = v.default(spec, be.device)
            points.append((v, d))
            for mod in filter(None, args.mods.split(";")):
                if all(k in d or k in ("ks", "at") for k in Params.parse(mod)):
                    points.append((v, d.replace(**Params.parse(mod))))
            points += [(v, p) for p in v.space(spec, be.device)[1:1 + args.space]]
        points = list(dict.fromkeys(points))
        cands = tuner.measure_many(spec, Epilogue(), points)
        gflop = spec.flops / 1e9
        tms, terr = float("nan"), float("nan")
        if not args.no_torch:
            inputs = pass_inputs(spec, np.random.default_rng(tuner.seed))
            tms, terr = torch_wgrad(spec, inputs, expected(spec, inputs))
        ok = [c for c in cands if c.status == "ok"]
        for c in cands:
            row = dict(layer=label, n=spec.n, variant=c.variant.name, params=c.params.short(), status=c.status,
                       ms=c.time_ms, tflops=gflop / c.time_ms if c.status == "ok" else 0.0, err=c.error,
                       torch_ms=tms, torch_err=terr)
            rows.append(row)
            print(f"{label:18s} {c.variant.name:22s} {c.time_ms:8.4f} ms {row['tflops']:6.1f} TF "
                  f"err {c.error if c.error is not None else float('nan'):.1e} [{c.params.short()}] "
                  f"{'' if c.status == 'ok' else c.status[:60]}", flush=True)
        if ok:
            least = min(c.error for c in ok if c.error is not None)
            fp32 = [c for c in ok if c.error is not None and c.error <= max(5e-6, 2 * least)]
            best = min(fp32, key=lambda c: c.time_ms)
            summary.append(f"{label:18s} N{spec.n}: best {best.variant.name} {best.time_ms:.4f} ms "
                           f"({gflop / best.time_ms:.1f} TF, err {best.error:.1e}) | torch {tms:.4f} ms "
                           f"({gflop / tms:.1f} TF, err {terr:.1e}) | x{tms / best.time_ms:.2f}")
        if args.bias:
            summary.append(bias_row(be, spec, label))
        if args.breakdown:
            summary += [breakdown(be, spec, label, v, prm) for v, prm in points if prm == v.default(spec, be.device)]
    print("\n".join(["", "== summary (fp32 class)"] + summary))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
