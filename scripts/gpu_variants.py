"""Check and time every registered CUDA variant's default on a few layers (GPU machine; run by scripts/gpu-check).

--sanitize: tiny shapes, one run each (for compute-sanitizer). Otherwise: a table of median
times and effective TFLOPS, every transform of each plan inside the timed call. --points N times
the first N points of each variant's space (tile configurations), --dtype runs the layers in
float16 or bfloat16, --layers keeps the layers whose label contains one of its words, --passes
names the passes (--sanitize: all three, so every dgrad and wgrad variant runs under memcheck too),
--params times named points beside the default (';'-separated, e.g. 'bm=256,bn=128,cw=2,kb=1,st=4,tm=1'
for tile shapes the space orders last), each filled from the default where it names fewer parameters.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from convforge.backends import get_backend
from convforge.check import check_plan, pass_inputs
from convforge.dtypes import to_storage
from convforge.kernels import all_variants
from convforge.params import Params
from convforge.plan import DeviceInfo, Variant
from convforge.spec import ConvSpec

TINY = [ConvSpec.make(1, 3, 13, 11, 5, 3, 3, 1, (0, 1, 1, 0)), ConvSpec.make(2, 8, 9, 9, 4, 1, 1),
        ConvSpec.make(1, 2, 27, 27, 3, 11, 11, 4, 1),
        ConvSpec.make(1, 37, 13, 7, 70, 3, 3, 1, (0, 1, 2, 1)),  # C=37: split-C with an edge stage
        ConvSpec.make(2, 70, 9, 9, 36, 3, 3, 1, 1),  # C=70: the non-fused split GEMM (ks 2)
        ConvSpec.make(2, 6, 11, 9, 6, 3, 3, 2, (1, 0, 1, 1), groups=3),  # grouped, stride 2, asymmetric pad
        ConvSpec.make(2, 8, 13, 11, 16, 3, 3, 1, 1, groups=8),  # depthwise, multiplier 2
        ConvSpec.make(2, 8, 13, 11, 8, 7, 7, 1, 3, groups=8, layout="nhwc"),  # channels-last depthwise 7x7
        ConvSpec.make(1, 5, 12, 12, 5, 3, 3, 2, 1, groups=5, layout="nhwc"),
        ConvSpec.make(20, 4100, 1, 1, 37, 1, 1),  # fully connected, thin: split-K, sums in chunks of 128
        ConvSpec.make(1, 3, 29, 30, 3, 7, 7, 1, 3, groups=3),  # 7x7 depthwise, 4 output rows a thread
        ConvSpec.make(2, 40, 9, 11, 36, 1, 1, 2, (1, 0, 0, 1)),  # 1x1 / 2: dgrad_sub_*, one phase interleaved
        # channels-last, K in runs of 8: the half-staged epilogue's 16-byte stores (M and K tails, stride 2)
        ConvSpec.make(2, 24, 9, 11, 72, 3, 3, 1, 1, layout="nhwc"),
        ConvSpec.make(2, 64, 14, 13, 64, 3, 3, 2, 1, layout="nhwc")]
LAYERS = {
    "resnet64@56 N32": ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1),
    "resnet128@28 N32": ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1),
    "resnet256@14 N32": ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1),
    "resnet512@7 N32": ConvSpec.make(32, 512, 7, 7, 512, 3, 3, 1, 1),
    "mec cv8 N128": ConvSpec.make(128, 64, 112, 112, 128, 3, 3),
    "mec cv10 N128": ConvSpec.make(128, 128, 28, 28, 128, 3, 3),
    "mec cv1 N128": ConvSpec.make(128, 3, 227, 227, 96, 11, 11, 4, 0),
    "r50 1x1 1024>256@14": ConvSpec.make(32, 1024, 14, 14, 256, 1, 1),
    "r50 1x1 64>256@56": ConvSpec.make(32, 64, 56, 56, 256, 1, 1),
    "boda 1x1 832@7 N5": ConvSpec.make(5, 832, 7, 7, 256, 1, 1),
    "boda 1x1 256@27 N5": ConvSpec.make(5, 256, 27, 27, 256, 1, 1),
    "boda 3x3 160@14 N5": ConvSpec.make(5, 160, 14, 14, 320, 3, 3, 1, 1),
    "boda 5x5 32@28 N5": ConvSpec.make(5, 32, 28, 28, 96, 5, 5, 1, 2),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sanitize", action="store_true",
                    help="tiny shapes, one checked run each, no timing (under compute-sanitizer)")
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--points", type=int, default=1, help="time the first N points of each space")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--layers", default="", help="comma-separated words; keep layers whose label has one")
    ap.add_argument("--params", default="", help="';'-separated points to time too, e.g. 'bm=256,bn=128,st=4'")
    ap.add_argument("--passes", default=None,
                    help="comma-separated passes (fprop, dgrad, wgrad); default fprop, all three with --sanitize")
    args = ap.parse_args()
    passes = (args.passes or ("fprop,dgrad,wgrad" if args.sanitize else "fprop")).split(",")
    be = get_backend("cuda")
    only = set(filter(None, args.only.split(",")))
    variants = [v for v in all_variants() if "cuda" in v.backends and (not only or v.name in only)]
    specs = {s.key(): s for s in TINY} if args.sanitize else LAYERS
    words = list(filter(None, args.layers.split(",")))
    specs = {k: ConvSpec.from_dict({**s.to_dict(), "dtype": args.dtype}) for k, s in specs.items()
             if not words or any(w in k for w in words)}
    bad = 0
    print(f"{'layer':20s} {'variant':26s} {'ms':>9s} {'TFLOPS':>7s} {'rel err':>9s}  params")
    for label, spec in ((f"{k}{'' if p == 'fprop' else ' ' + p}", s.with_pass(p))
                        for k, s in specs.items() for p in passes):
        for v in variants:
            if v.applies(spec, be.device):
                continue
            for prm in _points(v, spec, be.device, args.sanitize, args.points, args.params):
                bad += _run(be, label, spec, v, prm, args.sanitize)
    return 1 if bad else 0


def _points(v: Variant, spec: ConvSpec, dev: DeviceInfo, sanitize: bool, n: int = 1, named: str = "") -> list[Params]:
    """The default (and the next n - 1 points of the space); under --sanitize also the first point of
    each staging kind of the Winograd spaces (fused: cp.async filters / inputs, split-C, two-block
    register cap; non-fused: the split GEMM) and of the tensor-core generator (split-K, one tile per
    block, two atoms of K per stage, clusters of two), not defaults."""
    pts = [v.default(spec, dev)]
    if n > 1:
        pts += [p for p in v.space(spec, dev)[:n] if p not in pts]
    for text in filter(None, named.split(";")):
        p = pts[0].replace(**Params.parse(text))
        if p not in pts:
            pts.append(p)
    if sanitize and v.name.startswith("tc_"):
        space = v.space(spec, dev)
        for pred in (lambda p: p.get("ks", 1) > 1, lambda p: p.get("ps") == 0, lambda p: p.get("kb") == 2,
                     lambda p: p.get("cl") == 2):
            hit = next((p for p in space if pred(p)), None)
            if hit is not None and hit not in pts:
                pts.append(hit)
    if sanitize and v.name.startswith("winograd_"):
        space = v.space(spec, dev)
        for keys in (("ca",), ("ci",), ("ca", "ci"), ("ks",), ("mb",)):
            hit = next((p for p in space if all(k in p for k in keys)), None)
            if hit is not None and hit not in pts:
                pts.append(hit)
    return pts


def _run(be, label: str, spec: ConvSpec, v: Variant, prm: Params, sanitize: bool) -> int:  # type: ignore[no-untyped-def]
    """Check (and unless sanitizing, time) one point; 1 when it failed."""
    try:
        plan = v.plan(spec, prm, be.device)
        exe = be.executable(plan)
        res = check_plan(plan, be, exe=exe, batch_slice=1)
    except Exception as err:  # noqa: BLE001 - report and go on to the next variant
        print(f"{label[:20]:20s} {v.name:26s} ERROR {type(err).__name__}: {str(err)[:200]}")
        return 1
    if sanitize:
        print(f"{label[:20]:20s} {v.name:26s} {res}  {prm.short()}")
        return int(not res.ok)
    inputs = pass_inputs(spec, np.random.default_rng(0))
    bufs = {k: be.upload(to_storage(a, spec.dtype)) for k, a in inputs.items()}
    bufs[spec.output] = be.empty(spec.itemsize * int(np.prod(spec.shape_of(spec.output))))
    for _ in range(3):
        exe(bufs)
    ms = statistics.median(be.time_ms(lambda: exe(bufs), 15))
    print(f"{label[:20]:20s} {v.name:26s} {ms:9.3f} {spec.flops / ms / 1e9:7.1f} "
          f"{res.rel_err:9.2e}{'' if res.ok else ' FAIL'}  {prm.short()}")
    return int(not res.ok)


if __name__ == "__main__":
    sys.exit(main())
