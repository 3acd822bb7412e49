"""Reports: the header, the per-layer table of each precision class (rich), the per-class summary, the
back-end comparison, results.json and results.csv."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from convforge.apps.bench.baselines import BASELINE_NAMES, HALF_BASELINE_NAMES
from convforge.apps.bench.ceilings import Ceilings
from convforge.apps.bench.runner import Row
from convforge.files import csv_text, write_atomic

CSV_FIELDS = ("layer", "index", "pass", "impl", "backend", "algo", "precision", "time_ms", "tflops", "pct_peak",
              "workspace_bytes", "rel_err", "ok", "status", "baseline_impl", "baseline_algo",
              "baseline_ms", "speedup", "baseline_error", "error_ratio", "flops", "min_bytes", "gbs",
              "pct_copy", "pct_copy_same", "chosen_by", "N", "C", "H", "W", "K", "R", "S", "stride", "pad",
              "dilation", "groups", "dtype", "pct_tc")
ENV_FIELDS = ("device", "driver", "platform", "convforge", "torch", "cudnn", "cupy", "pyopencl", "numpy")


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _bytes(v: int | None) -> str:
    if v is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= scale:
            return f"{v / scale:.1f} {unit}"
    return f"{v} B"


def speed_unit(rows: Iterable[Row]) -> tuple[str, float, str]:
    """(column title, factor from TFLOPS, format) for the speeds of ``rows``: TFLOPS where some
    row reaches 1, else GFLOP/s (a CPU device's layers would read 0.0004 TFLOPS)."""
    top = max((r.tflops for r in rows if r.tflops), default=0.0)
    return ("TFLOPS", 1.0, ".4g") if top >= 1 else ("GFLOP/s", 1e3, ".3g")


def _speed(r: Row, unit: tuple[str, float, str]) -> str:
    return _num(None if r.tflops is None else r.tflops * unit[1], unit[2])


def print_header(console: Console, env: dict[str, Any], suite: str, nlayers: int) -> None:
    console.print(f"[bold]convforge bench[/] suite [cyan]{suite}[/] ({nlayers} layers)")
    console.print(f"device: {env['device']}  driver: {env['driver'] or '-'}  ({env.get('platform') or '-'})")
    console.print(f"torch: {env.get('torch') or 'not installed'}  cuDNN: {env.get('cudnn') or '-'}  "
                  f"cupy: {env.get('cupy') or '-'}  pyopencl: {env.get('pyopencl') or '-'}  "
                  f"convforge {env['convforge']}")


def print_ceilings(console: Console, ceilings: dict[str, Ceilings]) -> None:
    for backend, c in ceilings.items():
        console.print(f"ceilings ({backend}): {c}")


def _convforge(rows: list[Row], precision: str | None = None) -> list[Row]:
    return [r for r in rows if r.impl.startswith("convforge") and precision in (None, r.precision)]


def classes(rows: list[Row]) -> list[str]:
    """The precision classes of the convforge rows, in the order they were run."""
    return list(dict.fromkeys(r.precision for r in _convforge(rows)))


def class_title(precision: str, rows: list[Row], what: str = "") -> str:
    """'fp32 class vs cuDNN-best FP32 (cudnn-best) — what': every table names its class and baseline."""
    ours = _convforge(rows, precision)
    impls = sorted({r.baseline_impl for r in ours if r.baseline_impl})
    half = [HALF_BASELINE_NAMES[i] for i in impls if i in HALF_BASELINE_NAMES]
    base = ", ".join(half) if half else BASELINE_NAMES.get(precision, "?") if any(
        i.startswith("cudnn-best") for i in impls) else (", ".join(impls) or "no baseline available")
    dtypes = sorted({_dtype(r) for r in ours} - {"float32"})
    return f"{precision} class{''.join(f', {d}' for d in dtypes)} vs {base}" + (f" — {what}" if what else "")


def _dtype(r: Row) -> str:
    return str(r.spec.get("dtype", "float32"))


def grouped_rows(rows: list[Row]) -> bool:
    """Whether any row is a grouped (or depthwise) layer: memory-bound, so its tables show bandwidth."""
    return any(r.spec.get("groups", 1) > 1 for r in rows)


def layer_table(rows: list[Row], title: str = "", precision: str | None = None) -> Table:
    """One line per layer x convforge implementation of ``precision``'s class (all classes when None),
    with the class's baseline beside it: time, speed-up, both measured errors and their ratio; for
    grouped and depthwise layers also the achieved GB/s (input + filters + output once) and its share
    of the measured device-copy bandwidth and of a copy of the layer's own bytes, and the baseline's
    GB/s. "% TC peak" only where some row has a tensor-core ceiling."""
    t = Table(title=title or None, show_lines=False)
    memory = grouped_rows(rows)
    mine = _convforge(rows, precision)
    tc = any(r.pct_tc is not None for r in mine)
    peak = any(r.pct_peak is not None for r in mine)  # none on CPU devices (ceilings.py)
    unit = speed_unit(mine)
    cols = [("layer", "left"), ("class", "left"), ("convforge variant", "left"), ("time ms", "right"),
            (unit[0], "right")] + ([("% peak", "right")] if peak else []) + ([("% TC peak", "right")] if tc else [])
    cols += [("GB/s", "right"), ("% copy", "right"), ("% copy of own bytes", "right"),
             ("baseline GB/s", "right")] if memory else []
    cols += [("baseline ms", "right"), ("baseline algo", "left"), ("speed-up", "right"), ("workspace", "right"),
             ("rel err", "right"), ("baseline err", "right"), ("err ratio", "right"), ("check", "left")]
    for col, just in cols:
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in mine:
        check = "ok" if r.ok else ("[red]FAIL[/]" if r.ok is False else "-")
        if r.status.startswith("error"):
            check = f"[red]{escape(r.status[:60])}[/]"
        variant = r.algo if len(r.algo) < 72 else r.algo[:69] + "..."
        base = escape(f"{r.baseline_impl}: {r.baseline_algo}") if r.baseline_impl else "none available"
        cls = r.precision + ("" if _dtype(r) == "float32" else f" {_dtype(r)}")
        cells = [escape(r.layer), cls, escape(f"{variant} [{r.backend}]"), _num(r.time_ms, ".3f"), _speed(r, unit)]
        cells += ([_num(r.pct_peak, ".1f")] if peak else []) + ([_num(r.pct_tc, ".1f")] if tc else [])
        if memory:
            base_gbs = r.min_bytes / (r.baseline_ms * 1e-3) / 1e9 if r.baseline_ms and r.min_bytes else None
            cells += [_num(r.gbs, ".0f"), _num(r.pct_copy, ".1f"), _num(r.pct_copy_same, ".1f"), _num(base_gbs, ".0f")]
        cells += [_num(r.baseline_ms, ".3f"), base, _num(r.speedup, ".2f"), _bytes(r.workspace_bytes),
                  _num(r.rel_err, ".1e"), _num(r.baseline_error, ".1e"), _num(r.error_ratio, ".2f"), check]
        t.add_row(*cells)
    return t


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive values (None when there are none)."""
    vals = [v for v in values if v is not None and v > 0 and not math.isinf(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def _stats(rows: list[Row]) -> dict[str, Any]:
    speed = [r.speedup for r in rows if r.speedup]
    ratio = [r.error_ratio for r in rows if r.error_ratio]
    return {"speedup_geomean": geomean(speed), "error_ratio_geomean": geomean(ratio),
            "n_speedup": len(speed), "n_error_ratio": len(ratio),
            "gbs_geomean": geomean(r.gbs for r in rows), "pct_copy_geomean": geomean(r.pct_copy for r in rows),
            "pct_copy_same_geomean": geomean(r.pct_copy_same for r in rows),
            "max_rel_err": max((r.rel_err for r in rows if r.rel_err is not None), default=None)}


def _best_per_layer(rows: list[Row]) -> list[Row]:
    """The fastest passing convforge row of each layer (over algorithms and back-ends)."""
    best: dict[int, Row] = {}
    for r in rows:
        if r.ok and r.time_ms and (r.index not in best or r.time_ms < (best[r.index].time_ms or 0.0)):
            best[r.index] = r
    return list(best.values())


def row_pass(r: Row) -> str:
    """The pass a row measured (fprop unless its spec names another)."""
    return str(r.spec.get("pass", "fprop"))


def _class_passes(rows: list[Row]) -> list[tuple[str, str, str]]:
    """(summary key, class, pass) in run order: the key is the class alone for fprop, "class/pass"
    for dgrad and wgrad (a suite run with ``--pass all`` is summarised per pass)."""
    seen = dict.fromkeys((r.precision, row_pass(r)) for r in _convforge(rows))
    return [(p if cp == "fprop" else f"{p}/{cp}", p, cp) for p, cp in seen]


def summary(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Per class and pass, over the fastest passing convforge row of each layer: geometric-mean
    speed-up and error ratio against the class's baseline (of that pass), how many layers each
    covers, the largest error, failures; ``by_impl`` the same per implementation and back-end
    (results.json's ``summary``, keyed by class, or "class/pass" for dgrad and wgrad)."""
    out: dict[str, dict[str, Any]] = {}
    for key, prec, conv_pass in _class_passes(rows):
        ours = [r for r in _convforge(rows, prec) if row_pass(r) == conv_pass]
        best = _best_per_layer(ours)
        impls = list(dict.fromkeys(f"{r.impl} [{r.backend}]" for r in ours))
        out[key] = {"pass": conv_pass, "precision": prec,
                    "baseline": ", ".join(sorted({r.baseline_impl for r in best if r.baseline_impl})),
                     **_stats(best), "layers": len({r.index for r in ours}),
                     "failed": sum(1 for r in ours if not r.ok),
                     "by_impl": {i: _stats([r for r in ours if r.ok and f"{r.impl} [{r.backend}]" == i])
                                 for i in impls}}
    return out


def _line(head: str, s: dict[str, Any], memory: bool = False) -> str:
    sp, er = s["speedup_geomean"], s["error_ratio_geomean"]
    bw = (f", geometric-mean bandwidth {s['gbs_geomean']:.0f} GB/s ({_num(s['pct_copy_geomean'], '.1f')} % of the "
          f"device copy, {_num(s.get('pct_copy_same_geomean'), '.1f')} % of a copy of each layer's own bytes)"
          ) if memory and s.get("gbs_geomean") else ""
    return (f"{head}: geometric-mean speed-up {_num(sp, '.2f')}{'x' if sp else ''} over {s['n_speedup']} "
            f"layer(s), geometric-mean error ratio {_num(er, '.2f')} over {s['n_error_ratio']} "
            f"(convforge error / baseline error), largest convforge error {_num(s['max_rel_err'], '.1e')}{bw}")


def summary_lines(rows: list[Row]) -> list[str]:
    """Per class: 'fp32 class vs cuDNN-best FP32: geometric-mean speed-up 1.07x over 16 layer(s),
    geometric-mean error ratio 1.70 over 16 (...)' for the fastest convforge row of each layer, then
    one indented line per implementation when several ran, and the failures."""
    lines = []
    memory = grouped_rows(rows)
    for s in summary(rows).values():
        prec = s["precision"]
        head = class_title(prec, rows) + ("" if s["pass"] == "fprop" else f", {s['pass']}")
        lines.append(_line(head, s, memory))
        if len(s["by_impl"]) > 1:
            lines += [_line(f"  {impl}", st, memory) for impl, st in s["by_impl"].items()]
        if s["failed"]:
            what = f"{prec}-class" + ("" if s["pass"] == "fprop" else f" {s['pass']}")
            lines.append(f"  {s['failed']} {what} convforge row(s) failed their check or did not run")
    return lines


def baseline_table(rows: list[Row]) -> Table:
    """Every baseline implementation (cuDNN algorithms with their status, other precisions labelled)."""
    t = Table(title="baselines")
    memory = grouped_rows(rows)
    unit = speed_unit(r for r in rows if not r.impl.startswith("convforge"))
    for col in ("layer", "impl", "algo", "precision", "time ms", unit[0], "% TC peak") + (
            ("GB/s", "% copy", "% copy of own bytes") if memory else ()) + ("workspace", "rel err", "status"):
        t.add_column(col)
    for r in rows:
        if r.impl.startswith("convforge"):
            continue
        bw = [_num(r.gbs, ".0f"), _num(r.pct_copy, ".1f"), _num(r.pct_copy_same, ".1f")] if memory else []
        t.add_row(escape(r.layer), escape(r.impl), escape(r.algo), r.precision, _num(r.time_ms, ".3f"),
                  _speed(r, unit), _num(r.pct_tc, ".1f"), *bw,
                  _bytes(r.workspace_bytes), _num(r.rel_err, ".1e"), escape(r.status[:50]))
    return t


def compare_table(rows: list[Row]) -> Table:
    """CUDA vs OpenCL on one GPU: the same generated source through both, side by side."""
    t = Table(title="CUDA vs OpenCL (same generated kernels)")
    for col in ("layer", "variant", "cuda ms", "opencl ms", "opencl / cuda"):
        t.add_column(col)
    by: dict[tuple[str, str], dict[str, Row]] = {}
    for r in _convforge(rows):
        by.setdefault((r.layer, f"{r.impl} ({r.precision})"), {})[r.backend] = r
    for (layer, impl), d in by.items():
        cu, oc = d.get("cuda"), d.get("opencl")
        ratio = (oc.time_ms / cu.time_ms) if cu and oc and cu.time_ms and oc.time_ms else None
        variant = " / ".join(sorted({r.algo for r in d.values()}))
        t.add_row(escape(layer), escape(f"{impl}: {variant}"), _num(cu.time_ms if cu else None, ".3f"),
                  _num(oc.time_ms if oc else None, ".3f"), _num(ratio, ".2f"))
    return t


def write_json(path: Path, env: dict[str, Any], ceilings: dict[str, Ceilings], suite: str,
               rows: list[Row], notes: list[str]) -> None:
    doc = {"suite": suite, "env": env, "ceilings": {k: c.to_dict() for k, c in ceilings.items()},
           "notes": notes, "precisions": classes(rows), "summary": summary(rows),
           "rows": [r.to_dict() for r in rows]}
    write_atomic(path, json.dumps(doc, indent=1, default=str) + "\n")


def write_csv(path: Path, env: dict[str, Any], rows: list[Row]) -> None:
    """One line per layer x implementation, with the device, driver and library versions on each."""
    fields = list(CSV_FIELDS) + list(ENV_FIELDS)
    lines = []
    for r in rows:
        d = r.to_dict()
        spec = d.pop("spec")
        d.update({k: spec.get(k, "") for k in ("N", "C", "H", "W", "K", "R", "S")})
        d["groups"] = spec.get("groups", 1)
        d.update({k: "x".join(map(str, spec.get(k, []))) for k in ("stride", "pad", "dilation")})
        d["dtype"] = spec.get("dtype", "float32")
        d["pass"] = spec.get("pass", "fprop")
        d.update({k: env.get(k, "") for k in ENV_FIELDS})
        lines.append({k: d.get(k, "") for k in fields})
    write_atomic(path, csv_text(fields, lines))
