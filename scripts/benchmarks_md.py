"""Markdown tables for docs/BENCHMARKS.md from `convforge bench --out DIR` results.

    python scripts/benchmarks_md.py DIR [DIR ...] > tables.md

One table per results directory and precision class, titled with the class and its baseline
(fp32: cuDNN-best FP32; relaxed: cuDNN-best TF32). Per layer: effective TFLOPS of each convforge
implementation run, the best of them, the class's baseline (TFLOPS and algorithm), the speed-up,
PyTorch's pick in the class (FP32 or TF32), workspace, and the best's relative error beside the
baseline's with their ratio; then the geometric means. Every number comes from the JSON; nothing is
typed in. Results written before precision classes existed are labelled by their measured errors.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

FP32_BOUND = 5e-6  # convforge.config.PRECISIONS["fp32"]
NAMES = {"cudnn-best": "cuDNN-best FP32", "cudnn-best-tf32": "cuDNN-best TF32"}
PICK = {"fp32": "torch-pick", "relaxed": "torch-tf32"}  # PyTorch's own pick in each class


def _geo(vals: list[float]) -> float:
    vals = [v for v in vals if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _e(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def _classes(data: dict[str, Any], ours: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(precision field of the rows, class named in titles, note). Old results (no "precisions" key)
    ran under the old default, which admitted errors up to 1e-3: relaxed, unless every measured error
    is FP32-grade."""
    if "precisions" in data:
        return [(p, p, "") for p in data["precisions"]]
    errs = [r.get("rel_err") for r in ours]
    fp32 = bool(errs) and all(e is not None and e <= FP32_BOUND for e in errs)
    note = (" (by its measured errors" if fp32 else " (old default, errors up to 1e-3") + \
        ", run before precision classes)"
    return [(ours[0]["precision"] if ours else "fp32", "fp32" if fp32 else "relaxed", note)]


def _cells(name: str, by: dict[str, dict[str, Any]], impls: list[str], cls: str,
           acc: dict[str, list[float]]) -> list[str]:
    """One layer's cells; appends its speed-ups and error ratio to ``acc``."""
    ours = [by[i] for i in impls if i in by]
    good = [r for r in ours if r.get("ok") and r.get("time_ms")]
    acc["fails"].append(len(ours) - len(good))
    best = min(good, key=lambda r: r["time_ms"]) if good else None
    base = by.get(best.get("baseline_impl") or "") if best else None
    pick = by.get(PICK.get(cls, ""))
    cells = [name] + ["-" if not by.get(i) or not by[i].get("time_ms") else
                      f"{by[i]['tflops']:.1f}" + ("" if by[i].get("ok") else " FAIL") for i in impls]
    cells.append(f"{best['tflops']:.1f} `{best['algo'].split('(')[0]}`" if best else "-")
    cells.append(f"{base['tflops']:.1f} ({base['algo']})" if base and base.get("tflops") else "-")
    s = base["time_ms"] / best["time_ms"] if best and base and base.get("time_ms") else None
    sp = pick["time_ms"] / best["time_ms"] if best and pick and pick.get("time_ms") else None
    berr = base.get("rel_err") if base else None
    ratio = best["rel_err"] / berr if best and best.get("rel_err") is not None and berr else None
    for key, v in (("speed", s), ("pick", sp), ("ratio", ratio)):
        acc[key] += [v] if v else []
    acc["err"] += [best["rel_err"]] if best and best.get("rel_err") is not None else []
    cells += [f"{s:.2f}×" if s else "-", f"{pick['tflops']:.1f}" if pick and pick.get("tflops") else "-",
              f"{sp:.2f}×" if sp else "-", _mib(best.get("workspace_bytes")) if best else "-",
              _e(best.get("rel_err")) if best else "-", _e(berr), f"{ratio:.2f}" if ratio else "-"]
    return cells


def class_table(data: dict[str, Any], field: str, cls: str, note: str = "") -> str:
    """The table of the rows of precision ``field`` (class ``cls``) of one results file."""
    env, rows = data["env"], data["rows"]
    ours = [r for r in rows if r["impl"].startswith("convforge:") and r.get("precision", "fp32") == field]
    layers: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["impl"].startswith("convforge:") and r.get("precision", "fp32") != field:
            continue
        layers.setdefault(r["layer"], {})[r["impl"]] = r
    impls = list(dict.fromkeys(r["impl"] for r in ours))
    bases = sorted({r["baseline_impl"] for r in ours if r.get("baseline_impl")})
    base_name = ", ".join(NAMES.get(b, b) for b in bases) or "no baseline"
    pick_name = "PyTorch TF32 pick" if cls == "relaxed" else "PyTorch FP32 pick"
    ceil = data.get("ceilings", {}).get("cuda", {})
    out = [f"### {data['suite']} — {cls} class{note} vs {base_name} — {env.get('device')} "
           f"({env.get('time', '')[:10]})", "",
           f"torch {env.get('torch')}, cuDNN {env.get('cudnn')}, CuPy {env.get('cupy')}, driver {env.get('driver')}; "
           f"measured FFMA {ceil.get('ffma_tflops', float('nan')):.1f} TFLOPS, "
           f"copy {ceil.get('copy_gbs', float('nan')) / 1000:.2f} TB/s.", ""]
    head = ["layer"] + [i.split(":", 1)[1] for i in impls] + [
        "best convforge", base_name, "speed-up", pick_name, "vs pick", "workspace MiB", "convforge err",
        "baseline err", "err ratio"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    acc: dict[str, list[float]] = {"speed": [], "pick": [], "ratio": [], "err": [], "fails": []}
    for name, by in layers.items():
        out.append("| " + " | ".join(_cells(name, by, impls, cls, acc)) + " |")
    worst = f"{max(acc['err']):.1e}" if acc["err"] else "-"
    out += ["", f"{cls} class: geometric-mean speed-up of the best convforge variant **{_geo(acc['speed']):.2f}×** "
            f"over {base_name}, geometric-mean error ratio **{_geo(acc['ratio']):.2f}** (convforge error / "
            f"baseline error; largest convforge error {worst}), {_geo(acc['pick']):.2f}× over the {pick_name} "
            f"({len(acc['speed'])} layers; {int(sum(acc['fails']))} convforge runs failed their check or did "
            "not run).", ""]
    return "\n".join(out)


def table(path: Path) -> str:
    """Every precision class's table of the results in directory ``path``."""
    data = json.loads((path / "results.json").read_text())
    ours = [r for r in data["rows"] if r["impl"].startswith("convforge:")]
    return "\n".join(class_table(data, *c) for c in _classes(data, ours))


def main() -> int:
    for arg in sys.argv[1:]:
        print(table(Path(arg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
