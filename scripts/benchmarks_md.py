"""Markdown tables for docs/BENCHMARKS.md from `convforge bench --out DIR` results.

    python scripts/benchmarks_md.py DIR [DIR ...] > tables.md

Per layer: effective TFLOPS of each convforge implementation run, the best of them, cuDNN-best (time and
algorithm), the speed-up, PyTorch's FP32 pick, workspace and the relative error of the best; then the
geometric means. Every number comes from the JSON; nothing is typed in.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _geo(vals: list[float]) -> float:
    vals = [v for v in vals if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def table(path: Path) -> str:
    data = json.loads((path / "results.json").read_text())
    env, rows = data["env"], data["rows"]
    layers: dict[str, dict[str, dict]] = {}
    for r in rows:
        layers.setdefault(r["layer"], {})[r["impl"]] = r
    impls = sorted({r["impl"] for r in rows if r["impl"].startswith("convforge:")})
    ceil = data.get("ceilings", {}).get("cuda", {})
    out = [f"### {data['suite']} — {env.get('device')} ({env.get('time', '')[:10]})", "",
           f"torch {env.get('torch')}, cuDNN {env.get('cudnn')}, CuPy {env.get('cupy')}, driver {env.get('driver')}; "
           f"measured FFMA {ceil.get('ffma_tflops', float('nan')):.1f} TFLOPS, "
           f"copy {ceil.get('copy_gbs', float('nan')) / 1000:.2f} TB/s.", ""]
    head = ["layer"] + [i.split(":", 1)[1] for i in impls] + [
        "best convforge", "cuDNN-best", "speed-up", "PyTorch pick", "vs pick", "workspace MiB", "rel err"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    speed, vs_pick, fails = [], [], 0
    for name, by in layers.items():
        ours = [by[i] for i in impls if i in by]
        good = [r for r in ours if r.get("ok") and r.get("time_ms")]
        fails += len(ours) - len(good)
        best = min(good, key=lambda r: r["time_ms"]) if good else None
        base, pick = by.get("cudnn-best"), by.get("torch-pick")
        cells = [name]
        for i in impls:
            r = by.get(i)
            cells.append("-" if not r or not r.get("time_ms") else
                         f"{r['tflops']:.1f}" + ("" if r.get("ok") else " FAIL"))
        if best:
            cells.append(f"{best['tflops']:.1f} `{best['algo'].split('(')[0]}`")
        else:
            cells.append("-")
        cells.append(f"{base['tflops']:.1f} ({base['algo']})" if base and base.get("tflops") else "-")
        s = base["time_ms"] / best["time_ms"] if best and base and base.get("time_ms") else None
        sp = pick["time_ms"] / best["time_ms"] if best and pick and pick.get("time_ms") else None
        speed += [s] if s else []
        vs_pick += [sp] if sp else []
        cells += [f"{s:.2f}×" if s else "-", f"{pick['tflops']:.1f}" if pick and pick.get("tflops") else "-",
                  f"{sp:.2f}×" if sp else "-", _mib(best.get("workspace_bytes")) if best else "-",
                  f"{best['rel_err']:.1e}" if best else "-"]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"Geometric-mean speed-up of the best convforge variant: **{_geo(speed):.2f}×** over cuDNN-best, "
            f"{_geo(vs_pick):.2f}× over PyTorch's FP32 pick ({len(speed)} layers; "
            f"{fails} convforge runs failed their check or did not run).", ""]
    return "\n".join(out)


def main() -> int:
    for arg in sys.argv[1:]:
        print(table(Path(arg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
