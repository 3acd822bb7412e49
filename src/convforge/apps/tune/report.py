"""Boda's comparison for a suite: autotuned per layer vs the heuristic vs the single best fixed
parameter setting (per variant: the parameter set with the best geometric mean over the layers
where the variant applies), as report.json and report.png."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convforge.files import write_atomic, write_atomic_bytes
from convforge.params import Params
from convforge.plan import Epilogue, Variant
from convforge.spec import ConvSpec
from convforge.tune.heuristic import NO_EPILOGUE
from convforge.tune.tuner import Tuner, TuneResult


@dataclass(frozen=True)
class Fixed:
    """One variant's best fixed parameter set and its time on each layer it applies to."""

    variant: str
    params: Params
    times: dict[str, float]  # layer name -> ms
    geomean_ratio: float  # geometric mean of fixed time / tuned time over those layers


def _geomean(values: Sequence[float]) -> float:
    vals = [v for v in values if v > 0]
    if not vals or any(math.isinf(v) for v in vals):
        return math.inf
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _known_times(tuner: Tuner, res: TuneResult) -> dict[tuple[str, Params], float]:
    """Every correct time measured for a layer (this run's candidates or the database's record)."""
    out: dict[tuple[str, Params], float] = {}
    items = [c.measurement() for c in res.candidates]
    if not items and tuner.db is not None:
        items = tuner.db.measurements(res.entry.key)
    for m in items:
        if m.status == "ok" and m.time_ms is not None:
            out[(m.variant, Params.from_json(m.params))] = float(m.time_ms)
    out.setdefault((res.entry.variant, Params.from_json(res.entry.params)), res.entry.time_ms)
    return out


def fixed_settings(tuner: Tuner, layers: Sequence[tuple[str, ConvSpec]], results: dict[str, TuneResult],
                   variants: Sequence[Variant], per_variant: int = 3,
                   epi: Epilogue = NO_EPILOGUE) -> dict[str, Fixed]:
    """For each variant, measure its ``per_variant`` most frequently best parameter sets on every
    layer where it applies, and keep the set with the best geometric mean (None if none runs on all)."""
    known = {name: _known_times(tuner, res) for name, res in results.items()}
    dev = tuner.backend.device
    where = {v.name: [(n, s) for n, s in layers if n in results and v.applies(s, dev) is None]
             for v in variants}
    pick: dict[str, list[Params]] = {}
    for v in variants:
        wins: Counter[Params] = Counter()
        for name, _ in where[v.name]:
            mine = {p: t for (vn, p), t in known[name].items() if vn == v.name}
            if mine:
                wins[min(mine, key=lambda p: mine[p])] += 1
        pick[v.name] = [p for p, _ in wins.most_common(per_variant)]
    for name, spec in layers:  # layer-outer: one set of inputs and reference per layer
        todo = [(v, p) for v in variants if (name, spec) in where[v.name] for p in pick[v.name]
                if (v.name, p) not in known[name]]
        for cand in tuner.measure_many(spec, epi, todo):
            known[name][(cand.variant.name, cand.params)] = cand.time_ms
    out: dict[str, Fixed] = {}
    for v in variants:
        best: Fixed | None = None
        for prm in pick[v.name]:
            times = {n: known[n].get((v.name, prm), math.inf) for n, _ in where[v.name]}
            ratio = _geomean([t / results[n].entry.time_ms for n, t in times.items()])
            if math.isfinite(ratio) and (best is None or ratio < best.geomean_ratio):
                best = Fixed(v.name, prm, times, ratio)
        if best is not None:
            out[v.name] = best
    return out


def build_report(tuner: Tuner, layers: Sequence[tuple[str, ConvSpec]], results: dict[str, TuneResult],
                 variants: Sequence[Variant], per_variant: int = 3) -> dict[str, Any]:
    """The report as a JSON-ready document."""
    fixed = fixed_settings(tuner, layers, results, variants, per_variant)
    rows: list[dict[str, Any]] = []
    for name, spec in layers:
        res = results.get(name)
        if res is None:
            continue
        e = res.entry
        fx = [(f.times[name], f.variant, f.params) for f in fixed.values() if name in f.times]
        fbest = min(fx, key=lambda t: t[0]) if fx else None
        rows.append({
            "layer": name, "spec": spec.to_dict(), "gflop": spec.flops / 1e9,
            "tuned": {"variant": e.variant, "params": json.loads(e.params), "ms": e.time_ms},
            "heuristic": {"variant": e.heuristic_variant, "params": json.loads(e.heuristic_params),
                          "ms": e.heuristic_ms},
            "fixed": None if fbest is None else {"variant": fbest[1], "params": dict(fbest[2]),
                                                 "ms": fbest[0]},
            "speedup_vs_heuristic": e.speedup,
            "speedup_vs_fixed": None if fbest is None else fbest[0] / e.time_ms,
        })
    dev = tuner.backend.device
    return {
        "device": dev.name, "device_key": dev.key(), "backend": tuner.backend.name,
        "budget": str(tuner.budget),
        "layers": rows,
        "fixed_per_variant": {k: {"params": dict(f.params), "geomean_fixed_over_tuned": f.geomean_ratio,
                                  "layers": len(f.times)} for k, f in fixed.items()},
        "geomean_speedup_vs_heuristic": _geomean([r["speedup_vs_heuristic"] for r in rows
                                                  if r["speedup_vs_heuristic"]]),
        "geomean_speedup_vs_fixed": _geomean([r["speedup_vs_fixed"] for r in rows if r["speedup_vs_fixed"]]),
    }


def write_report(folder: str | Path, doc: dict[str, Any]) -> list[Path]:
    """report.json, and report.png when matplotlib is installed; returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "report.json"]
    write_atomic(written[0], json.dumps(_clean(doc), indent=1, default=_jsonable))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    rows = doc["layers"]
    names = [r["layer"] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(rows) + 2), 4.5))
    width = 0.4
    heur = [r["speedup_vs_heuristic"] or float("nan") for r in rows]
    fixd = [r["speedup_vs_fixed"] or float("nan") for r in rows]
    ax.bar([x - width / 2 for x in xs], heur, width, label="autotuned vs heuristic")
    ax.bar([x + width / 2 for x in xs], fixd, width, label="autotuned vs best fixed setting")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speed-up (×)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=90, fontsize=7)
    ax.set_title(f"{doc['device']} ({doc['backend']}): autotuned vs heuristic vs fixed parameters")
    ax.legend()
    fig.tight_layout()
    png = folder / "report.png"
    write_atomic_bytes(png, lambda f: fig.savefig(f, dpi=120, format="png"))
    plt.close(fig)
    return written + [png]


def _clean(obj: Any) -> Any:
    """Infinities and NaNs become null (JSON has no spelling for them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Params):
        return dict(obj)
    raise TypeError(type(obj).__name__)
