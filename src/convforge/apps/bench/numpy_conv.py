"""The CPU baseline without PyTorch: im2col and NumPy's BLAS matmul in float32, every pass and grouped layers.

On a machine with no GPU and no PyTorch, convforge runs on an OpenCL CPU device (PoCL), a correctness
back-end; a figure without a CPU library beside it would say nothing about speed. This is what a NumPy
user would write: the input unrolled once (one strided copy per filter tap), then one float32 GEMM per
group through ``np.matmul`` (OpenBLAS or whatever NumPy links), timed by wall clock as the PyTorch CPU
baseline is (warm-up outside the timed calls, median of the repeats).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from convforge.spec import ConvSpec


def _padded(spec: ConvSpec, x: np.ndarray) -> np.ndarray:
    t, b, left, right = spec.pad
    return np.pad(x, ((0, 0), (0, 0), (t, b), (left, right)))


def _tap(spec: ConvSpec, r: int, s: int) -> tuple[slice, slice]:
    """The rows and columns of the padded input that filter tap (r, s) reads, one per output pixel."""
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    return (slice(r * dh, r * dh + sh * (spec.p - 1) + 1, sh), slice(s * dw, s * dw + sw * (spec.q - 1) + 1, sw))


def im2col(spec: ConvSpec, x: np.ndarray) -> np.ndarray:
    """(G, C/G * R * S, N * P * Q) float32 columns of an NCHW input."""
    g, cg = spec.groups, spec.c // spec.groups
    xp = _padded(spec, np.asarray(x, np.float32))
    cols = np.empty((g, cg, spec.r, spec.s, spec.n, spec.p, spec.q), np.float32)
    for r in range(spec.r):
        for s in range(spec.s):
            rows, columns = _tap(spec, r, s)
            win = xp[:, :, rows, columns].reshape(spec.n, g, cg, spec.p, spec.q)
            cols[:, :, r, s] = win.transpose(1, 2, 0, 3, 4)
    return cols.reshape(g, cg * spec.r * spec.s, spec.n * spec.p * spec.q)


def _per_group(spec: ConvSpec, a: np.ndarray) -> np.ndarray:
    """NKPQ -> (G, K/G, N * P * Q)."""
    g = spec.groups
    return np.ascontiguousarray(a.reshape(spec.n, g, spec.k // g, spec.p * spec.q).transpose(1, 2, 0, 3)).reshape(
        g, spec.k // g, spec.n * spec.p * spec.q)


def fprop(spec: ConvSpec, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y (NKPQ) = conv(x, w) in float32."""
    g = spec.groups
    wg = np.asarray(w, np.float32).reshape(g, spec.k // g, -1)
    y = np.matmul(wg, im2col(spec, x))  # (G, K/G, NPQ)
    return np.ascontiguousarray(y.reshape(g, spec.k // g, spec.n, spec.p, spec.q).transpose(2, 0, 1, 3, 4)).reshape(
        spec.y_shape)


def wgrad(spec: ConvSpec, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """dw (KCRS) from x and dy in float32."""
    dw = np.matmul(_per_group(spec, np.asarray(dy, np.float32)), im2col(spec, x).transpose(0, 2, 1))
    return dw.reshape(spec.w_shape)


def dgrad(spec: ConvSpec, dy: np.ndarray, w: np.ndarray) -> np.ndarray:
    """dx (NCHW) from dy and w in float32: the columns' gradient, then scattered back tap by tap."""
    g, cg = spec.groups, spec.c // spec.groups
    wg = np.asarray(w, np.float32).reshape(g, spec.k // g, -1)
    dcols = np.matmul(wg.transpose(0, 2, 1), _per_group(spec, np.asarray(dy, np.float32)))
    dcols = dcols.reshape(g, cg, spec.r, spec.s, spec.n, spec.p, spec.q)
    t, b, left, right = spec.pad
    dxp = np.zeros((spec.n, spec.c, spec.h + t + b, spec.w + left + right), np.float32)
    for r in range(spec.r):
        for s in range(spec.s):
            rows, columns = _tap(spec, r, s)
            dxp[:, :, rows, columns] += dcols[:, :, r, s].transpose(2, 0, 1, 3, 4).reshape(
                spec.n, spec.c, spec.p, spec.q)
    return dxp[:, :, t:t + spec.h, left:left + spec.w]


def pass_fn(spec: ConvSpec) -> Any:
    """The float32 computation of ``spec``'s pass from its two inputs (fprop: x, w; dgrad: dy, w; wgrad: x, dy)."""
    return {"fprop": lambda a, b: fprop(spec, a, b), "dgrad": lambda a, b: dgrad(spec, a, b),
            "wgrad": lambda a, b: wgrad(spec, a, b)}[spec.conv_pass]


def pass_inputs(spec: ConvSpec, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Uniform(-1, 1) float32 inputs of the pass, in :func:`pass_fn`'s order."""
    rng = np.random.default_rng(seed)
    shapes = {"fprop": (spec.x_shape, spec.w_shape), "dgrad": (spec.y_shape, spec.w_shape),
              "wgrad": (spec.x_shape, spec.y_shape)}[spec.conv_pass]
    a, b = (rng.uniform(-1, 1, s).astype(np.float32) for s in shapes)
    return a, b


def reference(spec: ConvSpec, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The float64 answer of the pass (convforge.reference)."""
    from convforge.reference import conv2d_ref, dgrad_ref, wgrad_ref

    if spec.conv_pass == "fprop":
        return conv2d_ref(a, b, spec)
    return dgrad_ref(a, b, spec) if spec.conv_pass == "dgrad" else wgrad_ref(a, b, spec)


def blas_name() -> str:
    """The BLAS NumPy links, where NumPy says (1.26 and later), else ''."""
    try:
        cfg: Any = getattr(np.__config__, "CONFIG", None)
        return str(cfg["Build Dependencies"]["blas"]["name"])
    except (AttributeError, KeyError, TypeError):
        return ""


def time_ms(fn: Any, warmup: int, repeats: int) -> float:
    """Median wall-clock milliseconds of ``fn()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))
