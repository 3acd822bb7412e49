"""Check and time every point of the fused Winograd space on a few ResNet layers (GPU machine).

Default: a table (layer, variant, point, ms, effective TFLOPS, rel err), every launch of the plan
inside the timed call, best point per layer marked. ``--one LAYER VARIANT INDEX|best``: run that point
(best: the sweep's fastest, from $OUT/sweep-best.json; ``default+k=v,...``: the default changed) once
with no check (for ``ncu -k regex:wino_fused``). ``--mods 'k=v;k=v,k=v'``: time each variant's default
and the default changed by each mod, instead of the space.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from convforge.backends import get_backend
from convforge.check import random_inputs
from convforge.kernels import get_variant
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.spec import ConvSpec
from convforge.tune.tuner import Tuner

LAYERS = {f"res{c}@{h} N{n}": ConvSpec.make(n, c, h, h, c, 3, 3, 1, 1)
          for n in (32, 64, 96, 128) for c, h in ((64, 56), (128, 28), (256, 14), (512, 7))}
LAYERS["tiny"] = ConvSpec.make(1, 5, 9, 7, 6, 3, 3, 1, 1)
VARIANTS = ("winograd_fused_f2", "winograd_fused_f4")
BEST_FILE = os.environ.get("OUT", "/tmp") + "/sweep-best.json"
BEST: dict[str, str] = {}


def _bufs(be, spec: ConvSpec) -> dict:  # type: ignore[no-untyped-def]
    x, w, _ = random_inputs(spec, np.random.default_rng(0))
    return {"x": be.upload(x), "w": be.upload(w), "y": be.empty(4 * spec.n * spec.k * spec.p * spec.q)}


def _point(v, spec: ConvSpec, device, which: str) -> Params:  # type: ignore[no-untyped-def]
    """``default``, ``best`` (from the last sweep), a space index, or ``default+k=v,...``."""
    if which.startswith("default"):
        prm = v.default(spec, device)
        return prm.replace(**Params.parse(which[8:])) if which[7:8] == "+" else prm
    if which == "best":
        return Params.from_json(json.load(open(BEST_FILE))[f"{_label(spec)}|{v.name}"])
    return v.space(spec, device)[int(which)]


def _spec(label: str) -> ConvSpec:
    """A named layer (``res512@7 N128``) or any layer spec (``N=5,C=64,H=28,...``)."""
    return LAYERS[label] if label in LAYERS else ConvSpec.parse(label)


def _split(labels: str) -> list[str]:
    return labels.split(";") if ";" in labels or "=" in labels else labels.split(",")


def _label(spec: ConvSpec) -> str:
    return next((k for k, s in LAYERS.items() if s == spec), spec.short())


def sweep(be, labels: list[str], variants: list[str], limit: int,  # type: ignore[no-untyped-def]
          mods: list[str]) -> int:
    """Every point compiled in parallel, checked and timed by the tuner's own measurement.
    With ``mods``: each variant's default and the default changed by each mod instead."""
    bad, tuner = 0, Tuner(be)
    for label in labels:
        spec = _spec(label)
        points = [(get_variant(n), prm) for n in variants
                  for prm in get_variant(n).space(spec, be.device)[:limit]] if not mods else \
            list(dict.fromkeys((get_variant(n), _point(get_variant(n), spec, be.device, m))
                               for n in variants for m in ["default"] + [f"default+{x}" for x in mods]))
        cands = tuner.measure_many(spec, Epilogue(), points)
        best = min(c.time_ms for c in cands)
        for n in variants:  # the fastest point of each variant, for --one LAYER VARIANT best
            mine = [c for c in cands if c.variant.name == n and c.status == "ok"]
            if mine:
                BEST[f"{label}|{n}"] = min(mine, key=lambda c: c.time_ms).params.to_json()
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
    ap.add_argument("--layers", default="res64@56 N32,res256@14 N32,res512@7 N32,res512@7 N128",
                    help="names from LAYERS (comma-separated) or layer specs (';'-separated)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--limit", type=int, default=99, help="first LIMIT points of each space")
    ap.add_argument("--mods", default="", help="'k=v,k=v;k=v': time default+mod points only")
    ap.add_argument("--one", nargs=3, metavar=("LAYER", "VARIANT", "INDEX"),
                    help="INDEX: a space index, default, best or default+k=v,...")
    ap.add_argument("--backend", default="cuda")
    args = ap.parse_args()
    be = get_backend(args.backend)
    if args.one:
        spec = _spec(args.one[0])
        v = get_variant(args.one[1])
        prm = _point(v, spec, be.device, args.one[2])
        exe = be.executable(v.plan(spec, prm, be.device))
        bufs = _bufs(be, spec)
        exe(bufs)
        be.synchronize()
        print(f"{args.one[0]} {v.name} {prm.short()}")
        return 0
    mods = [m for m in args.mods.split(";") if m]
    bad = sweep(be, _split(args.layers), args.variants.split(","), args.limit, mods)
    with open(BEST_FILE, "w") as f:
        json.dump(BEST, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
