"""The float64 NumPy convolution: the oracle for tests, the checker and the tuner."""

from __future__ import annotations

import numpy as np

from convforge.spec import ConvSpec


def conv2d_ref(x: np.ndarray, w: np.ndarray, spec: ConvSpec,
               bias: np.ndarray | None = None, relu: bool = False) -> np.ndarray:
    """NCHW x KCRS -> NKPQ in float64, one tensordot per filter tap."""
    x64 = np.asarray(x, dtype=np.float64)
    w64 = np.asarray(w, dtype=np.float64)
    if x64.shape != spec.x_shape or w64.shape != spec.w_shape:
        raise ValueError(f"reference: shapes {x64.shape}, {w64.shape} do not match {spec.short()}")
    pt, pb, pl, pr = spec.pad
    xp = np.pad(x64, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    p, q = spec.p, spec.q
    out = np.zeros((spec.n, spec.k, p, q), dtype=np.float64)
    for r in range(spec.r):
        for s in range(spec.s):
            y0, x0 = r * dh, s * dw
            win = xp[:, :, y0:y0 + sh * (p - 1) + 1:sh, x0:x0 + sw * (q - 1) + 1:sw]
            out += np.einsum("ncpq,kc->nkpq", win, w64[:, :, r, s], optimize=True)
    if bias is not None:
        out += np.asarray(bias, dtype=np.float64)[None, :, None, None]
    if relu:
        out = np.maximum(out, 0.0)
    return out


def rel_l2(out: np.ndarray, ref: np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives NaN (never passes)."""
    diff = np.asarray(out, dtype=np.float64) - ref
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(diff))
    if den == 0.0:
        return num
    return num / den
