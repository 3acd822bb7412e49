"""PNG plots with matplotlib's Agg back-end (the ``plot`` extra; absent matplotlib skips them).

Per-layer effective TFLOPS per implementation, speed-up over the baseline (cuDNN-best on a GPU),
workspace per implementation, and a roofline with the measured ceilings.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from convforge.bench.ceilings import Ceilings
from convforge.bench.runner import Row


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: list[Row], value: str) -> tuple[list[str], dict[str, list[float]]]:
    """Layer names in order and, per implementation, the value for each layer (NaN when missing)."""
    layers = list(dict.fromkeys(r.layer for r in rows))
    impls: dict[str, list[float]] = {}
    for r in rows:
        key = f"{r.impl} {r.precision} [{r.backend}]" if r.impl.startswith("convforge") else r.impl
        col = impls.setdefault(key, [float("nan")] * len(layers))
        v = getattr(r, value)
        col[layers.index(r.layer)] = float(v) if v is not None else float("nan")
    return layers, impls


def _bars(plt: Any, path: Path, layers: list[str], impls: dict[str, list[float]], ylabel: str,
          title: str, log: bool = False) -> None:
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(layers) * max(1, len(impls)) ** 0.5 + 3), 4.5))
    width = 0.8 / max(1, len(impls))
    for i, (name, vals) in enumerate(impls.items()):
        xs = [j + i * width - 0.4 + width / 2 for j in range(len(layers))]
        ax.bar(xs, vals, width, label=name)
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(layers, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("symlog")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _roofline(plt: Any, path: Path, rows: list[Row], ceilings: dict[str, Ceilings]) -> None:
    fig, ax = plt.subplots(figsize=(7, 5))
    pts = [r for r in rows if r.tflops and r.min_bytes]
    ais = [r.flops / r.min_bytes for r in pts] or [1.0]
    knees = [c.ffma_tflops * 1e3 / c.copy_gbs for c in ceilings.values() if c.copy_gbs]
    lo, hi = min(ais + knees) / 4, max(ais + knees) * 4
    for backend, c in ceilings.items():
        knee = c.ffma_tflops * 1e12 / (c.copy_gbs * 1e9) if c.copy_gbs else hi
        xs = [lo, min(max(knee, lo), hi), hi]
        ys = [min(c.ffma_tflops, x * c.copy_gbs / 1e3) for x in xs]
        ax.plot(xs, ys, "--", label=f"measured roof ({backend}): {c.ffma_tflops:.3g} TFLOPS, "
                                    f"{c.copy_gbs:.3g} GB/s")
    impls = list(dict.fromkeys(r.impl for r in pts))
    for impl in impls:
        sel = [r for r in pts if r.impl == impl]
        ax.scatter([r.flops / r.min_bytes for r in sel], [r.tflops for r in sel], s=14, label=impl)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity, FLOP per byte of x + w + y")
    ax.set_ylabel("effective TFLOPS")
    ax.set_title("roofline (effective TFLOPS may pass the roof for Winograd/FFT)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(out: Path, rows: list[Row], ceilings: dict[str, Ceilings]) -> list[Path]:
    """The four PNGs; returns their paths (empty when matplotlib is missing)."""
    if not available():
        return []
    plt = _pyplot()
    paths = [out / n for n in ("tflops.png", "speedup.png", "workspace.png", "roofline.png")]
    # cuDNN-best FP32 / TF32 stand for their algorithms
    main = [r for r in rows if not r.impl.startswith(("cudnn:", "cudnn-tf32:"))]
    layers, impls = _series(main, "tflops")
    _bars(plt, paths[0], layers, impls, "effective TFLOPS", "effective TFLOPS per layer")
    conv = [r for r in rows if r.impl.startswith("convforge")]
    base = ", ".join(dict.fromkeys(f"{r.precision}: {r.baseline_impl}" for r in conv if r.baseline_impl))
    layers, impls = _series(conv, "speedup")
    title = f"speed-up over each class's baseline ({base})" if base else "speed-up (no baseline available)"
    _bars(plt, paths[1], layers, impls, "baseline time / convforge time", title)
    layers, impls = _series(rows, "workspace_bytes")
    _bars(plt, paths[2], layers, impls, "workspace bytes", "workspace per implementation", log=True)
    _roofline(plt, paths[3], main, ceilings)
    return paths
