"""PNG plots with matplotlib's Agg back-end (the ``plot`` extra; absent matplotlib skips them).

Per-layer effective TFLOPS per implementation, speed-up over the baseline (cuDNN-best on a GPU),
workspace per implementation, and a roofline with the measured ceilings.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from convforge.apps.bench.ceilings import Ceilings
from convforge.apps.bench.runner import Row
from convforge.files import write_atomic_bytes


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
    write_atomic_bytes(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)


def _roofline(plt: Any, path: Path, rows: list[Row], ceilings: dict[str, Ceilings]) -> None:
    fig, ax = plt.subplots(figsize=(7, 5))
    pts = [r for r in rows if r.tflops and r.min_bytes]
    roofs = {b: c for b, c in ceilings.items() if c.ffma_tflops and c.copy_gbs}
    ais = [r.flops / r.min_bytes for r in pts] or [1.0]
    knees = [(c.ffma_tflops or 0.0) * 1e3 / c.copy_gbs for c in roofs.values()]
    lo, hi = min(ais + knees) / 4, max(ais + knees) * 4
    for backend, c in roofs.items():
        peak = c.ffma_tflops or 0.0
        knee = peak * 1e12 / (c.copy_gbs * 1e9)
        xs = [lo, min(max(knee, lo), hi), hi]
        ys = [min(peak, x * c.copy_gbs / 1e3) for x in xs]
        ax.plot(xs, ys, "--", label=f"measured roof ({backend}): {peak:.3g} TFLOPS, {c.copy_gbs:.3g} GB/s")
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
    write_atomic_bytes(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)


def _has(values: dict[str, list[float]]) -> bool:
    """Whether a series holds any number above zero (a plot of NaN and zero bars is empty)."""
    return any(v == v and v > 0 for col in values.values() for v in col)


def write_plots(out: Path, rows: list[Row], ceilings: dict[str, Ceilings]) -> list[Path]:
    """The PNGs that have something to show (tflops.png, speedup.png, workspace.png, roofline.png);
    returns their paths (empty when matplotlib is missing). :func:`skipped` says why one is not there."""
    if not available():
        return []
    plt = _pyplot()
    written = []
    # cuDNN-best FP32 / TF32 stand for their algorithms
    main = [r for r in rows if not r.impl.startswith(("cudnn:", "cudnn-tf32:"))]
    layers, impls = _series(main, "tflops")
    unit = "TFLOPS" if max((r.tflops for r in main if r.tflops), default=0.0) >= 1 else "GFLOP/s"
    if _has(impls):
        if unit != "TFLOPS":
            impls = {k: [v * 1e3 for v in col] for k, col in impls.items()}
        _bars(plt, out / "tflops.png", layers, impls, f"effective {unit}", f"effective {unit} per layer")
        written.append(out / "tflops.png")
    conv = [r for r in rows if r.impl.startswith("convforge")]
    layers, impls = _series(conv, "speedup")
    if _has(impls):
        base = ", ".join(dict.fromkeys(f"{r.precision}: {r.baseline_impl}" for r in conv if r.baseline_impl))
        _bars(plt, out / "speedup.png", layers, impls, "baseline time / convforge time",
              f"speed-up over each class's baseline ({base})")
        written.append(out / "speedup.png")
    layers, impls = _series(rows, "workspace_bytes")
    if _has(impls):
        _bars(plt, out / "workspace.png", layers, impls, "workspace bytes", "workspace per implementation", log=True)
        written.append(out / "workspace.png")
    if any(r.tflops and r.min_bytes for r in main) and any(c.ffma_tflops and c.copy_gbs for c in ceilings.values()):
        _roofline(plt, out / "roofline.png", main, ceilings)
        written.append(out / "roofline.png")
    return written


def skipped(rows: list[Row], ceilings: dict[str, Ceilings]) -> list[str]:
    """Why each plot :func:`write_plots` leaves out is not there, one phrase each."""
    conv = [r for r in rows if r.impl.startswith("convforge")]
    why = []
    if not any(r.tflops for r in rows):
        why.append("no tflops.png (nothing was timed)")
    if not any(r.speedup for r in conv):
        why.append("no speedup.png (no baseline timed these layers: --baseline, or PyTorch / NumPy absent)")
    if not any(r.workspace_bytes for r in rows):
        why.append("no workspace.png (no implementation used a workspace)")
    if not any(c.ffma_tflops and c.copy_gbs for c in ceilings.values()):
        why.append("no roofline.png (no FFMA ceiling: not measured on a CPU device)")
    elif not any(r.tflops and r.min_bytes for r in rows):
        why.append("no roofline.png (nothing was timed)")
    return why
