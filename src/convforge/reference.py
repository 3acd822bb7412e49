"""The float64 NumPy convolution, all three passes and grouped layers: the oracle for tests, the
checker and the tuner. Inputs of any dtype are taken at their exact values (a float16 input is
the float16 number), so a half-precision kernel is judged on the inputs it was given."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from convforge.spec import ConvSpec


def _checked(spec: ConvSpec, **arrays: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    for name, a in arrays.items():
        a64 = np.asarray(a, dtype=np.float64)
        if a64.shape != spec.shape_of(name):
            raise ValueError(f"reference: {name} has shape {a64.shape}, {spec.short()} needs "
                             f"{spec.shape_of(name)}")
        out[name] = a64
    return out


def _taps(spec: ConvSpec) -> Iterator[tuple[int, int, slice, slice]]:
    """(r, s, rows, cols): for each filter tap, the slices of the padded input it meets."""
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    for r in range(spec.r):
        for s in range(spec.s):
            y0, x0 = r * dh, s * dw
            yield r, s, slice(y0, y0 + sh * (spec.p - 1) + 1, sh), slice(x0, x0 + sw * (spec.q - 1) + 1, sw)


def _pad(spec: ConvSpec, x64: np.ndarray) -> np.ndarray:
    pt, pb, pl, pr = spec.pad
    return np.pad(x64, ((0, 0), (0, 0), (pt, pb), (pl, pr)))


def conv2d_ref(x: np.ndarray, w: np.ndarray, spec: ConvSpec,
               bias: np.ndarray | None = None, relu: bool = False) -> np.ndarray:
    """fprop: NCHW x KCRS -> NKPQ in float64, one tensordot per filter tap and group."""
    a = _checked(spec, x=x, w=w)
    xp, w64, g, cg, kg = _pad(spec, a["x"]), a["w"], spec.groups, spec.cg, spec.kg
    out = np.zeros(spec.y_shape, dtype=np.float64)
    for r, s, rows, cols in _taps(spec):
        win = xp[:, :, rows, cols]
        if g == 1:
            out += np.einsum("ncpq,kc->nkpq", win, w64[:, :, r, s], optimize=True)
            continue
        wg = w64[:, :, r, s].reshape(g, kg, cg)
        out += np.einsum("ngcpq,gkc->ngkpq", win.reshape(spec.n, g, cg, spec.p, spec.q), wg,
                         optimize=True).reshape(out.shape)
    if bias is not None:
        out += np.asarray(bias, dtype=np.float64)[None, :, None, None]
    if relu:
        out = np.maximum(out, 0.0)
    return out


def dgrad_ref(dy: np.ndarray, w: np.ndarray, spec: ConvSpec) -> np.ndarray:
    """dgrad (bprop): the gradient of the input, NKPQ x KCRS -> NCHW in float64 (the adjoint of
    :func:`conv2d_ref`: each tap scatters dy . w back onto the padded input, then the pad is cut)."""
    a = _checked(spec, y=dy, w=w)
    dy64, w64, g, cg, kg = a["y"], a["w"], spec.groups, spec.cg, spec.kg
    pt, pb, pl, pr = spec.pad
    dxp = np.zeros((spec.n, spec.c, spec.h + pt + pb, spec.w + pl + pr), dtype=np.float64)
    dyg = dy64.reshape(spec.n, g, kg, spec.p, spec.q)
    for r, s, rows, cols in _taps(spec):
        wg = w64[:, :, r, s].reshape(g, kg, cg)
        dxp[:, :, rows, cols] += np.einsum("ngkpq,gkc->ngcpq", dyg, wg, optimize=True).reshape(
            spec.n, spec.c, spec.p, spec.q)
    return dxp[:, :, pt:pt + spec.h, pl:pl + spec.w]


def wgrad_ref(x: np.ndarray, dy: np.ndarray, spec: ConvSpec) -> np.ndarray:
    """wgrad (update): the gradient of the filters, NCHW x NKPQ -> KCRS in float64 (a reduction
    over N, P and Q per tap)."""
    a = _checked(spec, x=x, y=dy)
    xp, g, cg, kg = _pad(spec, a["x"]), spec.groups, spec.cg, spec.kg
    dyg = a["y"].reshape(spec.n, g, kg, spec.p, spec.q)
    out = np.zeros(spec.w_shape, dtype=np.float64)
    for r, s, rows, cols in _taps(spec):
        win = xp[:, :, rows, cols].reshape(spec.n, g, cg, spec.p, spec.q)
        out[:, :, r, s] = np.einsum("ngcpq,ngkpq->gkc", win, dyg, optimize=True).reshape(spec.k, cg)
    return out


def conv_transpose2d_ref(x: np.ndarray, w: np.ndarray, stride: tuple[int, int] = (1, 1),
                         padding: tuple[int, int, int, int] = (0, 0, 0, 0), output_padding: tuple[int, int] = (0, 0),
                         groups: int = 1, dilation: tuple[int, int] = (1, 1),
                         bias: np.ndarray | None = None) -> np.ndarray:
    """PyTorch's conv_transpose2d in float64, written from its definition rather than as a dgrad:
    x (N, C_in, H, W), w (C_in, C_out/groups, R, S); input pixel (h, w) times tap (r, s) lands on
    output (h * sh - top + r * dh, w * sw - left + s * dw), outputs H_out = (H - 1) * sh - top -
    bottom + dh * (R - 1) + output_padding + 1 rows (likewise W_out)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n, cin, h, wd = x64.shape
    _, cog, r, s = w64.shape
    (sh, sw), (dh, dw), (pt, pb, pl, pr) = stride, dilation, padding
    full_h = (h - 1) * sh + dh * (r - 1) + 1 + output_padding[0]
    full_w = (wd - 1) * sw + dw * (s - 1) + 1 + output_padding[1]
    full = np.zeros((n, cog * groups, full_h, full_w), np.float64)
    cig = cin // groups
    xg = x64.reshape(n, groups, cig, h, wd)
    wg = w64.reshape(groups, cig, cog, r, s)
    for i in range(r):
        for j in range(s):
            part = np.einsum("ngchw,gco->ngohw", xg, wg[:, :, :, i, j], optimize=True)
            rows = slice(i * dh, i * dh + (h - 1) * sh + 1, sh)
            cols = slice(j * dw, j * dw + (wd - 1) * sw + 1, sw)
            full[:, :, rows, cols] += part.reshape(n, cog * groups, h, wd)
    out = full[:, :, pt:full_h - pb, pl:full_w - pr]
    if bias is not None:
        out = out + np.asarray(bias, np.float64)[None, :, None, None]
    return out


def pad_ref(x: np.ndarray, pad: tuple[int, int, int, int], mode: str) -> np.ndarray:
    """``x`` (..., H, W) padded by (top, bottom, left, right) as nn.Conv2d's ``padding_mode`` pads,
    in float64, by each mode's index rule: zeros; reflect (about the edge, edge not repeated);
    replicate (the edge repeated); circular (wrapped)."""
    x64 = np.asarray(x, np.float64)
    if mode == "zeros":
        return np.pad(x64, [(0, 0)] * (x64.ndim - 2) + [(pad[0], pad[1]), (pad[2], pad[3])])

    def source(i: int, size: int) -> int:
        if mode == "circular":
            return i % size
        if mode == "replicate":
            return min(max(i, 0), size - 1)
        period = 2 * (size - 1)  # reflect
        k = abs(i) % period if period else 0
        return k if k < size else period - k

    h, w = x64.shape[-2:]
    rows = [source(i, h) for i in range(-pad[0], h + pad[1])]
    cols = [source(j, w) for j in range(-pad[2], w + pad[3])]
    return x64[..., rows, :][..., cols]


def activate_ref(x: np.ndarray, scale: np.ndarray | None = None, shift: np.ndarray | None = None,
                 relu: bool = False) -> np.ndarray:
    """A prologue's activation of an NCHW input in float64: ``max(scale[c] * x + shift[c], 0)``
    (the affine part when ``scale`` and ``shift`` are given, the max when ``relu``). Convolving
    the result with padding is what a plan with that Prologue computes (padding stays zero)."""
    out = np.asarray(x, dtype=np.float64)
    if scale is not None and shift is not None:
        shape = (1, -1) + (1,) * (out.ndim - 2)
        out = out * np.asarray(scale, np.float64).reshape(shape) + np.asarray(shift, np.float64).reshape(shape)
    return np.maximum(out, 0.0) if relu else out


def bias_grad_ref(dy: np.ndarray) -> np.ndarray:
    """The gradient of a per-channel bias: dy summed over N, P and Q, in float64."""
    return np.asarray(dy, dtype=np.float64).sum(axis=(0, 2, 3))


def pass_ref(spec: ConvSpec, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The float64 output of ``spec``'s pass from its named inputs (x, w, y, bias; no epilogue
    beyond bias for fprop)."""
    if spec.conv_pass == "dgrad":
        return dgrad_ref(inputs["y"], inputs["w"], spec)
    if spec.conv_pass == "wgrad":
        return wgrad_ref(inputs["x"], inputs["y"], spec)
    return conv2d_ref(inputs["x"], inputs["w"], spec, inputs.get("bias"))


def _act64(z: np.ndarray, act: str) -> np.ndarray:
    """SiLU or HardSwish in float64 (``act`` "silu" / "hardswish"; "" passes z)."""
    if act == "silu":
        return z / (1.0 + np.exp(-z))
    if act == "hardswish":
        return z * np.clip(z + 3.0, 0.0, 6.0) / 6.0
    return z


def _dact64(z: np.ndarray, act: str) -> np.ndarray:
    """The derivative of :func:`_act64` at z (HardSwish's as PyTorch's backward takes it: v / 3 + 1/2 on
    [-3, 3])."""
    if act == "silu":
        s = 1.0 / (1.0 + np.exp(-z))
        return s * (1.0 + z * (1.0 - s))
    if act == "hardswish":
        return np.where(z < -3.0, 0.0, np.where(z <= 3.0, z / 3.0 + 0.5, 1.0))
    return np.ones_like(z)


def batchnorm_train_ref(y: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None, eps: float,
                        res: np.ndarray | None = None, relu: bool = True, act: str = "") -> dict[str, np.ndarray]:
    """Training batch norm over (N, H, W) per channel [+ res] [-> ReLU | SiLU | HardSwish (``act``)] in
    float64: z, the batch mean and biased variance, and the unbiased variance the running statistics
    take."""
    y64 = np.asarray(y, np.float64)
    mean = y64.mean(axis=(0, 2, 3))
    var = y64.var(axis=(0, 2, 3))
    m = y64.shape[0] * y64.shape[2] * y64.shape[3]
    xhat = (y64 - mean[None, :, None, None]) / np.sqrt(var + eps)[None, :, None, None]
    g = np.ones_like(mean) if gamma is None else np.asarray(gamma, np.float64)
    b = np.zeros_like(mean) if beta is None else np.asarray(beta, np.float64)
    z = xhat * g[None, :, None, None] + b[None, :, None, None]
    if res is not None:
        z = z + np.asarray(res, np.float64)
    if relu:
        z = np.maximum(z, 0.0)
    z = _act64(z, act)
    return {"z": z, "mean": mean, "var": var, "var_unbiased": var * m / (m - 1), "xhat": xhat}


def batchnorm_train_backward_ref(gz: np.ndarray, y: np.ndarray, gamma: np.ndarray | None, eps: float,
                                 z: np.ndarray | None = None, relu: bool = True, beta: np.ndarray | None = None,
                                 act: str = "") -> dict[str, np.ndarray]:
    """The gradients of :func:`batchnorm_train_ref` in float64, given dz and (with a ReLU) the
    forward's z: dy, the residual's gradient (the masked dz), dgamma and dbeta. With ``act`` (no
    residual) dz passes the activation's derivative at the pre-activation (``beta`` needed)."""
    fwd = batchnorm_train_ref(y, gamma, None, eps, relu=False)
    g = np.asarray(gz, np.float64)
    if relu:
        assert z is not None, "the ReLU's mask comes from z"
        g = np.where(np.asarray(z) > 0, g, 0.0)
    if act:
        gam = np.ones(fwd["mean"].shape) if gamma is None else np.asarray(gamma, np.float64)
        bet = np.zeros(fwd["mean"].shape) if beta is None else np.asarray(beta, np.float64)
        g = g * _dact64(fwd["xhat"] * gam[None, :, None, None] + bet[None, :, None, None], act)
    xhat = fwd["xhat"]
    m = xhat.shape[0] * xhat.shape[2] * xhat.shape[3]
    dbeta = g.sum(axis=(0, 2, 3))
    dgamma = (g * xhat).sum(axis=(0, 2, 3))
    gam = np.ones_like(dbeta) if gamma is None else np.asarray(gamma, np.float64)
    scale = gam / np.sqrt(fwd["var"] + eps)
    dy = scale[None, :, None, None] * (g - dbeta[None, :, None, None] / m - xhat * dgamma[None, :, None, None] / m)
    return {"dy": dy, "dres": g, "dgamma": dgamma, "dbeta": dbeta}


def maxpool_ref(x: np.ndarray, k: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int],
                out: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Max pooling of NCHW ``x`` in float64 as PyTorch's ``max_pool2d`` picks (dilation 1): the first of
    equal maxima, the last NaN, a window of -inf its first in-image tap; ``out`` the pooled (P, Q).
    Returns y and each maximum's tap in its window (r * kw + s)."""
    x64 = np.asarray(x, np.float64)
    n, c, h, w = x64.shape
    (kh, kw), (sh, sw), (ph, pw), (p, q) = k, stride, pad, out
    y, tap = np.empty((n, c, p, q)), np.empty((n, c, p, q), np.int64)
    for i in range(p):
        for j in range(q):
            h0, w0 = i * sh - ph, j * sw - pw
            hs, he, ws, we = max(h0, 0), min(h0 + kh, h), max(w0, 0), min(w0 + kw, w)
            m, best = x64[:, :, hs, ws].copy(), np.full((n, c), (hs - h0) * kw + (ws - w0))
            for hh in range(hs, he):
                for ww in range(ws, we):
                    v = x64[:, :, hh, ww]
                    take = (v > m) | np.isnan(v)
                    m, best = np.where(take, v, m), np.where(take, (hh - h0) * kw + (ww - w0), best)
            y[:, :, i, j], tap[:, :, i, j] = m, best
    return y, tap


def maxpool_backward_ref(gy: np.ndarray, tap: np.ndarray, x_shape: tuple[int, ...], k: tuple[int, int],
                         stride: tuple[int, int], pad: tuple[int, int]) -> np.ndarray:
    """The gradient of :func:`maxpool_ref`'s input: each window's gradient added to its maximum's tap."""
    gx = np.zeros(x_shape)
    _, _, p, q = np.shape(gy)
    kw, (sh, sw), (ph, pw) = k[1], stride, pad
    nn, cc = np.meshgrid(np.arange(x_shape[0]), np.arange(x_shape[1]), indexing="ij")
    for i in range(p):
        for j in range(q):
            t = tap[:, :, i, j]
            rows, cols = i * sh - ph + t // kw, j * sw - pw + t % kw
            np.add.at(gx, (nn, cc, rows, cols), np.asarray(gy, np.float64)[:, :, i, j])
    return gx


def rel_l2(out: np.ndarray, ref: np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives NaN (never passes)."""
    diff = np.asarray(out, dtype=np.float64) - ref
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(diff))
    if den == 0.0:
        return num
    return num / den
