"""``convforge bench --sweep``: every point of a variant's tuning space on every layer of a suite.

For each layer and each variant the ``--algo`` options name (a variant, or the applicable variants of a
family), the first ``--sweep-limit`` points of its space (or, with ``--sweep-mods``, its default and the
default changed by each mod; ``default`` alone: the default; with ``--sweep-points FILE``, each layer's own mods,
a JSON object from layer name to a list of mod strings) are compiled in parallel, with the epilogue
``--sweep-epilogue`` names (none by default), checked against the float64 reference and timed by the tuner's
own measurement (``Tuner.measure_many``: the whole plan, every launch, inside the timed call). One row per
point: time, effective TFLOPS, relative error, parameters, status; the fastest point of each layer is marked,
and ``--out`` writes ``sweep.json`` (every point, and the fastest point of each layer and variant). Nothing is
stored in the tuning database. This is how a generator change is explored and A/B-tested on a GPU
(``scripts/gpu-ab``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from convforge.apps.bench.suites import Layer, SuiteError
from convforge.backends.base import Backend
from convforge.files import write_atomic
from convforge.params import Params
from convforge.plan import Epilogue, Variant
from convforge.spec import ConvSpec


def check_sweep_args(args: argparse.Namespace) -> None:
    """The options a sweep needs and the ones it cannot take: SuiteError naming the option."""
    if not args.sweep:
        for flag, value in (("--sweep-limit", args.sweep_limit), ("--sweep-mods", args.sweep_mods),
                            ("--sweep-points", args.sweep_points), ("--sweep-epilogue", args.sweep_epilogue)):
            if value is not None:
                raise SuiteError(f"{flag} goes with --sweep")
        return
    clash = [flag for flag, val in (("--model", args.model), ("--ablation", args.ablation),
                                    ("--compare-backends", args.compare_backends),
                                    ("--baseline", args.baseline not in (None, "none"))) if val]
    if clash:
        raise SuiteError(f"--sweep cannot be combined with {', '.join(clash)} (it times convforge's points only)")
    if not args.algo or "auto" in args.algo:
        raise SuiteError("--sweep needs --algo: the variant(s) or family whose space to time ('auto' would "
                         "time every variant's whole space)")
    from convforge import kernels

    known = {v.name for v in kernels.all_variants()} | set(kernels.FAMILIES)
    unknown = [a for a in args.algo if a not in known]
    if unknown:
        raise SuiteError(f"--algo ({', '.join(map(repr, unknown))}) must be a variant or family: "
                         f"{', '.join(sorted(known))}")
    if args.suite is None:
        raise SuiteError("--suite is required (a built-in name or a JSON file)")
    if args.sweep_limit is not None and args.sweep_limit < 1:
        raise SuiteError(f"--sweep-limit ({args.sweep_limit}) must be >= 1")
    given = [flag for flag, val in (("--sweep-limit", args.sweep_limit), ("--sweep-mods", args.sweep_mods),
                                    ("--sweep-points", args.sweep_points)) if val is not None]
    if len(given) > 1:
        raise SuiteError(f"{' and '.join(given)} exclude each other (limit: the space's first points; mods: the "
                         "default and its changes; points: each layer's own changes)")
    mods(args.sweep_mods)  # parsed now: a bad mod, points file or epilogue is refused before anything compiles
    layer_mods(args.sweep_points)
    epilogue(args.sweep_epilogue)


EPILOGUE_PARTS = ("bias", "residual", "relu", "gelu", "silu", "hardswish", "mish")


def epilogue(text: str | None) -> Epilogue:
    """``'bias,residual,relu'`` -> that Epilogue (None or ``none``: no epilogue)."""
    if text is None or text.strip() == "none":
        return Epilogue()
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in EPILOGUE_PARTS]
    if bad or not parts:
        raise SuiteError(f"--sweep-epilogue ({text!r}): {'unknown ' + ', '.join(map(repr, bad)) if bad else 'empty'}"
                         f"; give a comma-separated list of {', '.join(EPILOGUE_PARTS)}, or none")
    try:
        return Epilogue(**{p: True for p in parts})
    except ValueError as err:
        raise SuiteError(f"--sweep-epilogue ({text!r}): {err}") from None


def mods(text: str | None) -> list[Params]:
    """``'k=v,k=v;k=v'`` -> one Params per ``;``-separated change of the default (``default``: no
    change, so ``--sweep-mods default`` times each variant's default alone)."""
    if text is None:
        return []
    out = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        try:
            out.append(Params() if part == "default" else Params.parse(part))
        except ValueError as err:
            raise SuiteError(f"--sweep-mods ({part!r}): {err}") from None
    if not out:
        raise SuiteError(f"--sweep-mods ({text!r}) names no change: give 'k=v,k=v;k=v' or 'default'")
    return out


def layer_mods(path: str | None) -> dict[str, list[Params]]:
    """``--sweep-points FILE``: a JSON object from layer name to a list of ``'k=v,k=v'`` mods (``default``
    allowed) -> each layer's changes of the default; SuiteError naming the file and the entry at fault."""
    if path is None:
        return {}
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SuiteError(f"--sweep-points ({path}): {err}") from None
    if not isinstance(doc, dict) or not all(isinstance(v, list) and v and all(isinstance(m, str) for m in v)
                                            for v in doc.values()):
        raise SuiteError(f"--sweep-points ({path}) must be a JSON object from layer name to a non-empty list of "
                         "'k=v,k=v' mods")
    out = {}
    for name, changes in doc.items():
        try:
            out[name] = mods(";".join(changes))
        except SuiteError as err:
            raise SuiteError(f"--sweep-points ({path}), layer {name!r}: {err}") from None
    return out


def _base(name: str) -> str:
    """A suite layer's name without the ``:dgrad`` / ``:wgrad`` that ``--pass`` adds."""
    return name.rsplit(":", 1)[0] if name.endswith((":dgrad", ":wgrad")) else name


def _own(name: str, per_layer: dict[str, list[Params]]) -> list[Params] | None:
    """The ``--sweep-points`` mods of layer ``name`` (by its full name, else its suite name), or None."""
    return per_layer.get(name, per_layer.get(_base(name)))


def points(variant: Variant, spec: ConvSpec, backend: Backend, limit: int | None,
           changes: list[Params]) -> list[Params]:
    """The first ``limit`` points of the space, or the default and the default changed by each mod."""
    dev = backend.device
    if not changes:
        space = variant.space(spec, dev)
        return list(space if limit is None else space[:limit])
    default = variant.default(spec, dev)
    out = [default]
    for change in changes:
        prm = Params(dict(default), **dict(change))
        if prm not in out:
            out.append(prm)
    return out


def variants(algos: list[str], spec: ConvSpec, backend: Backend, precision: str) -> list[Variant]:
    """The variants the ``--algo`` options name that apply to ``spec`` on ``backend``, each once."""
    from convforge import kernels

    seen: dict[str, Variant] = {}
    for algo in algos:
        for v in kernels.select(algo, spec, backend.device, precision=precision):
            if backend.name in v.backends:
                seen.setdefault(v.name, v)
    return list(seen.values())


def run_sweep(args: argparse.Namespace, layers: list[Layer], backend: Backend, precision: str,
              console: Console) -> int:
    """Time the points, print one table per layer, write ``sweep.json`` with ``--out``; 1 when a
    point failed (it scores infinity and the others still run), 2 when no point applied anywhere."""
    from convforge.apps.options import phase_bars
    from convforge.progress import Phase
    from convforge.tune.tuner import Tuner

    tuner = Tuner(backend, seed=args.seed, repeats=args.repeats)
    changes = mods(args.sweep_mods)
    per_layer = layer_mods(args.sweep_points)
    names = {layer.name for layer in layers} | {_base(layer.name) for layer in layers}
    unknown = sorted(set(per_layer) - names)
    if unknown:
        raise SuiteError(f"--sweep-points names layers the suite does not have: {', '.join(map(repr, unknown))}")
    if per_layer:
        layers = [layer for layer in layers if _own(layer.name, per_layer) is not None]
    rows: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    with phase_bars(console), Phase("sweeping the layers' tuning spaces", len(layers), "layers") as phase:
        for layer in layers:
            own = _own(layer.name, per_layer)
            rows += _sweep_layer(tuner, layer, args, backend, precision, changes if own is None else own, best,
                                 console)
            phase.advance()
    if not rows:
        print("error: no --algo variant applies to any layer of the suite", file=sys.stderr)
        return 2
    failed = [r for r in rows if r["status"] != "ok"]
    console.print(f"{len(rows)} point(s) timed, {len(failed)} failed", markup=False)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"device": backend.device.name, "backend": backend.name, "suite": args.suite, "rows": rows,
               "fastest": {k: r["params"] for k, r in best.items()}}
        write_atomic(out / "sweep.json", json.dumps(doc, indent=1) + "\n")
        console.print(f"wrote {out}/sweep.json", markup=False)
    return 1 if failed else 0


def _sweep_layer(tuner: Any, layer: Layer, args: argparse.Namespace, backend: Backend, precision: str,
                 changes: list[Params], best: dict[str, dict[str, Any]],
                 console: Console) -> list[dict[str, Any]]:
    """One layer's points, checked and timed, printed as a table; ``best`` keeps each variant's fastest."""
    chosen = variants(args.algo, layer.spec, backend, precision)
    pts = [(v, p) for v in chosen for p in points(v, layer.spec, backend, args.sweep_limit, changes)]
    if not pts:
        console.print(f"{escape(layer.name)}: no --algo variant applies on {backend.name}", markup=False)
        return []
    cands = tuner.measure_many(layer.spec, epilogue(args.sweep_epilogue), pts)
    mine = [_row(layer, c) for c in cands]
    fastest = min((r["time_ms"] for r in mine if r["status"] == "ok"), default=None)
    for r in mine:
        r["fastest"] = r["status"] == "ok" and r["time_ms"] == fastest
        key = f"{layer.name}|{r['variant']}"
        if r["status"] == "ok" and (key not in best or r["time_ms"] < best[key]["time_ms"]):
            best[key] = r
    epi = "" if args.sweep_epilogue is None else f", epilogue {args.sweep_epilogue}"
    console.print(table(mine, f"{layer.name} ({layer.spec.short()}{epi}) on {backend.device.name}"))
    return mine


def _row(layer: Layer, cand: Any) -> dict[str, Any]:
    ok = cand.status == "ok"
    return {"layer": layer.name, "spec": layer.spec.short(), "variant": cand.variant.name,
            "params": json.loads(cand.params.to_json()), "point": cand.params.short(),
            "time_ms": cand.time_ms if ok else None, "tflops": layer.spec.flops / cand.time_ms / 1e9 if ok else None,
            "rel_err": cand.error, "status": cand.status}


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=escape(title))
    tera = max((r["tflops"] or 0.0 for r in rows), default=0.0) >= 1  # else GFLOP/s: a CPU device's points
    speed = "TFLOPS" if tera else "GFLOP/s"
    for col in ("variant", "point", "ms", speed, "rel err", "status"):
        t.add_column(col, justify="right" if col in ("ms", speed, "rel err") else "left")
    for r in rows:
        ms = "-" if r["time_ms"] is None else f"{r['time_ms']:.4f}" + (" *" if r["fastest"] else "")
        tf = "-" if r["tflops"] is None else f"{r['tflops'] * (1 if tera else 1e3):.3g}"
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        t.add_row(r["variant"], escape(r["point"]), ms, tf, err, escape(str(r["status"])[:120]))
    return t
