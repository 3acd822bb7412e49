"""Check and time every point of the fused Winograd space on a few ResNet layers (GPU machine).

Default: a table (layer, variant, point, ms, effective TFLOPS, rel err), every launch of the plan
inside the timed call, best point per layer marked. ``--one LAYER VARIANT INDEX``: run that point
once with no check (for ``ncu -k regex:wino_fused``).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from convforge.backends import get_backend
from convforge.check import random_inputs
from convforge.kernels import get_variant
from convforge.plan import Epilogue
from convforge.spec import ConvSpec
from convforge.tune.tuner import Tuner

LAYERS = {f"res{c}@{h} N{n}": ConvSpec.make(n, c, h, h, c, 3, 3, 1, 1)
          for n in (32, 64, 96, 128) for c, h in ((64, 56), (128, 28), (256, 14), (512, 7))}
LAYERS["tiny"] = ConvSpec.make(1, 5, 9, 7, 6, 3, 3, 1, 1)
VARIANTS = ("winograd_fused_f2", "winograd_fused_f4")


def _bufs(be, spec: ConvSpec) -> dict:  # type: ignore[no-untyped-def]
    x, w, _ = random_inputs(spec, np.random.default_rng(0))
    return {"x": be.upload(x), "w": be.upload(w), "y": be.empty(4 * spec.n * spec.k * spec.p * spec.q)}


def sweep(be, labels: list[str], variants: list[str], limit: int) -> int:  # type: ignore[no-untyped-def]
    """Every point compiled in parallel, checked and timed by the tuner's own measurement."""
    bad, tuner = 0, Tuner(be)
    for label in labels:
        spec = LAYERS[label]
        points = [(get_variant(n), prm) for n in variants
                  for prm in get_variant(n).space(spec, be.device)[:limit]]
        cands = tuner.measure_many(spec, Epilogue(), points)
        best = min(c.time_ms for c in cands)
        for c in cands:
            ok = c.status == "ok"
            bad += not ok
            mark = " *" if ok and c.time_ms == best else ""
            err = f"{c.error:8.1e}" if c.error is not None else "       -"
            tf = f"{spec.flops / c.time_ms / 1e9:6.1f}" if ok else "     -"
            print(f"{label:16s} {c.variant.name:18s} {c.time_ms:8.4f} {tf} {err} "
                  f"{c.params.short()}{mark}{'' if ok else ' ' + c.status[:120]}", flush=True)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="res64@56 N32,res256@14 N32,res512@7 N32,res512@7 N128")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--limit", type=int, default=99, help="first LIMIT points of each space")
    ap.add_argument("--one", nargs=3, metavar=("LAYER", "VARIANT", "INDEX"))
    ap.add_argument("--backend", default="cuda")
    args = ap.parse_args()
    be = get_backend(args.backend)
    if args.one:
        spec = LAYERS[args.one[0]]
        v = get_variant(args.one[1])
        prm = v.space(spec, be.device)[int(args.one[2])]
        exe = be.executable(v.plan(spec, prm, be.device))
        bufs = _bufs(be, spec)
        exe(bufs)
        be.synchronize()
        print(f"{args.one[0]} {v.name} {prm.short()}")
        return 0
    return 1 if sweep(be, args.layers.split(","), args.variants.split(","), args.limit) else 0


if __name__ == "__main__":
    sys.exit(main())
