"""The float64 NumPy executor of the IR, op by op: the oracle of every network test.

``run_reference(graph, x, dtype=np.float32)`` is the same executor in plain float32: every op's
output rounded to float32, convolutions and fully connected layers as float32 sums of products (one
BLAS SGEMM per filter tap and group, taps summed in float32). It stands in for what an FP32
framework (PyTorch FP32) gives on a network without torch: calibration's reference error. With
``tf32=True`` the operands of those products are first rounded to TF32 (10 explicit mantissa
bits, to nearest, as tensor cores take FP32 operands): PyTorch TF32's stand-in (the relaxed class).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from convforge.check import gelu_ref, hardswish_ref, mish_ref, sigmoid_ref, silu_ref
from convforge.graph.ir import (
    Graph,
    Node,
    conv_geometry,
    conv_group,
    deconv_out,
    infer,
    lrn_params,
    pool_out,
    resize_table,
)
from convforge.reference import activate_ref, conv2d_ref
from convforge.spec import ConvSpec

Arr = np.ndarray


def run_reference(graph: Graph, x: Arr, dtype: type = np.float64, tf32: bool = False) -> dict[str, Arr]:
    """Run ``graph`` on ``x`` in float64 (or plain float32, optionally with TF32 products: module
    docstring); returns every output tensor by name."""
    shapes = infer(graph)
    if tuple(x.shape) != shapes[graph.input].shape:
        raise ValueError(f"input shape {tuple(x.shape)} does not match the graph's {shapes[graph.input]}")
    if dtype not in (np.float64, np.float32):
        raise ValueError(f"dtype ({dtype!r}) must be numpy.float64 or numpy.float32")
    vals: dict[str, Arr] = {graph.input: np.asarray(x, dtype=dtype)}
    for node in graph.nodes:
        ins = [vals[t] for t in node.inputs]
        if dtype == np.float32 and node.op in _OPS32:
            vals[node.output] = _OPS32[node.op](graph, node, ins, tf32)
        else:
            vals[node.output] = np.asarray(_OPS[node.op](graph, node, ins), dtype=dtype)
    return {t: vals[t] for t in graph.outputs}


def _w(graph: Graph, node: Node, role: str) -> Arr | None:
    w = graph.weight(node, role)
    return None if w is None else np.asarray(w, dtype=np.float64)


def _act(node: Node, y: Arr) -> Arr:
    """A node's fused activation: ReLU, or a conv / fc epilogue's ``act``."""
    if node.attrs.get("act"):
        return act_ref(node.attrs["act"], y, node.attrs)
    return np.maximum(y, 0.0) if node.attrs.get("relu") else y


def _act32(node: Node, y: Arr) -> Arr:
    """:func:`_act` on float32 values, rounded to float32."""
    if node.attrs.get("act"):
        return act_ref(node.attrs["act"], y, node.attrs).astype(np.float32)
    return np.maximum(y, np.float32(0)) if node.attrs.get("relu") else y


def act_ref(fn: str, x: Arr, attrs: dict) -> Arr:
    """An ``act`` node's function ``fn`` (ir.ACT_FNS) of ``x`` in float64 (NaN stays NaN)."""
    x = np.asarray(x, np.float64)
    if fn == "sigmoid":
        return sigmoid_ref(x)
    if fn == "silu":
        return silu_ref(x)
    if fn == "hardswish":
        return hardswish_ref(x)
    if fn == "gelu":
        return gelu_ref(x)
    if fn == "mish":
        return mish_ref(x)
    if fn == "softplus":
        with np.errstate(over="ignore"):
            return np.log1p(np.exp(x))
    if fn == "hardsigmoid":
        return np.clip(float(attrs.get("alpha", 0.2)) * x + float(attrs.get("beta", 0.5)), 0.0, 1.0)
    if fn == "tanh":
        return np.tanh(x)
    lo, hi = attrs.get("lo"), attrs.get("hi")
    return np.clip(x, -np.inf if lo is None else float(lo), np.inf if hi is None else float(hi))


def _activated(graph: Graph, node: Node, x: Arr) -> Arr:
    """A conv's input with its prologue (pre-activation) applied, in float64."""
    if "pscale" not in node.weights and not node.attrs.get("pre_relu"):
        return x
    return activate_ref(x, _w(graph, node, "pscale"), _w(graph, node, "pshift"), bool(node.attrs.get("pre_relu")))


def _conv_spec(graph: Graph, node: Node, x: Arr) -> ConvSpec:
    (r, s), st, pad, dil = conv_geometry(node)
    n, c, h, wd = (int(v) for v in x.shape)
    return ConvSpec(n, c, h, wd, int(node.attrs["k"]), r, s, st, pad, dil, groups=conv_group(node))


def _conv(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    x = _activated(graph, node, ins[0])
    w = _w(graph, node, "w")
    assert w is not None
    y = conv2d_ref(x, w, _conv_spec(graph, node, x), _w(graph, node, "bias"))
    if len(ins) == 2:
        y = y + ins[1]
    return _act(node, y)


def tf32_round(a: Arr) -> Arr:
    """float32 values rounded to TF32 (10 explicit mantissa bits; to nearest, ties away from zero),
    still stored as float32."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _conv32(graph: Graph, node: Node, ins: list[Arr], tf32: bool = False) -> Arr:
    """The conv in plain float32: per filter tap and group a float32 GEMM, summed in float32
    (``tf32``: its operands rounded to TF32 first)."""
    x = _activated(graph, node, ins[0]).astype(np.float32)
    spec = _conv_spec(graph, node, x)
    w = graph.weights[node.weights["w"]].astype(np.float32)
    if tf32:
        x, w = tf32_round(x), tf32_round(w)
    pt, pb, pl, pr = spec.pad
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    (sh, sw), (dh, dw), g = spec.stride, spec.dilation, spec.groups
    out = np.zeros((spec.n, g, spec.kg, spec.p, spec.q), np.float32)
    for r in range(spec.r):
        for s in range(spec.s):
            win = xp[:, :, r * dh:r * dh + sh * (spec.p - 1) + 1:sh, s * dw:s * dw + sw * (spec.q - 1) + 1:sw]
            out += np.einsum("ngcpq,gkc->ngkpq", win.reshape(spec.n, g, spec.cg, spec.p, spec.q),
                             w[:, :, r, s].reshape(g, spec.kg, spec.cg), optimize=True)
    y = out.reshape(spec.y_shape)
    b = graph.weight(node, "bias")
    if b is not None:
        y = y + b.astype(np.float32)[None, :, None, None]
    if len(ins) == 2:
        y = y + ins[1]
    return _act32(node, y)


def _fc32(graph: Graph, node: Node, ins: list[Arr], tf32: bool = False) -> Arr:
    x = ins[0].reshape(ins[0].shape[0], -1).astype(np.float32)
    w = graph.weights[node.weights["w"]].astype(np.float32)
    if tf32:
        x, w = tf32_round(x), tf32_round(w)
    y = x @ w.T
    b = graph.weight(node, "bias")
    y = y + b.astype(np.float32) if b is not None else y
    return _act32(node, y)


def _fc(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    x = ins[0].reshape(ins[0].shape[0], -1)
    w = _w(graph, node, "w")
    assert w is not None
    y = x @ w.T
    b = _w(graph, node, "bias")
    return _act(node, y + b if b is not None else y)


def _pool(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    x = _lrn_of(node.attrs["lrn"], ins[0]) if node.attrs.get("lrn") else ins[0]  # fuse_lrn_pool
    n, c, h, w = x.shape
    max_pool = node.attrs.get("kind", "max") == "max"
    if node.attrs.get("global"):
        return (x.max(axis=(2, 3)) if max_pool else x.mean(axis=(2, 3)))[:, :, None, None]
    (kr, ks), (sh, sw), (pt, pb, pl, pr), _ = conv_geometry(node)
    ceil = bool(node.attrs.get("ceil", False))
    p, q = pool_out(h, kr, sh, pt, pb, ceil), pool_out(w, ks, sw, pl, pr, ceil)
    count_pad = bool(node.attrs.get("count_pad", True))
    out = np.empty((n, c, p, q))
    for i in range(p):
        y0 = i * sh - pt
        y1 = min(y0 + kr, h + pb)
        for j in range(q):
            x0 = j * sw - pl
            x1 = min(x0 + ks, w + pr)
            win = x[:, :, max(y0, 0):min(y1, h), max(x0, 0):min(x1, w)]
            if max_pool:
                out[:, :, i, j] = win.max(axis=(2, 3))
            else:
                cnt = (y1 - y0) * (x1 - x0) if count_pad else win.shape[2] * win.shape[3]
                out[:, :, i, j] = win.sum(axis=(2, 3)) / cnt
    return out


def _lrn(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    return _lrn_of(node.attrs, ins[0])


def _lrn_of(attrs: dict, x: Arr) -> Arr:
    """Across channels: x / (k + alpha/size * sum of x^2 over ``size`` channels)^beta."""
    size, alpha, beta, k = lrn_params(attrs)
    sq = np.pad(x * x, ((0, 0), (size // 2, size // 2), (0, 0), (0, 0)))
    acc = sum(sq[:, i:i + x.shape[1]] for i in range(size))
    return x / (k + alpha / size * acc) ** beta


def _relu(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    x = ins[0]
    y = np.where(x > 0, x, x * float(node.attrs.get("slope", 0.0)))
    clip = node.attrs.get("clip")
    return np.minimum(y, float(clip)) if clip is not None else y


def _chan(v: Arr | None, like: Arr, default: float) -> Arr:
    if v is None:
        v = np.full(like.shape[1], default)
    return v.reshape((1, -1) + (1,) * (like.ndim - 2))


def _batchnorm(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    x = ins[0]
    mean, var = _w(graph, node, "mean"), _w(graph, node, "var")
    eps = float(node.attrs.get("eps", 1e-5))
    xhat = (x - _chan(mean, x, 0.0)) / np.sqrt(_chan(var, x, 1.0) + eps)
    return _chan(_w(graph, node, "gamma"), x, 1.0) * xhat + _chan(_w(graph, node, "beta"), x, 0.0)


def _scale(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    x = ins[0]
    return _act(node, _chan(_w(graph, node, "gamma"), x, 1.0) * x + _chan(_w(graph, node, "beta"), x, 0.0))


def _softmax(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    x = ins[0]
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _binary(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    a = ins[0]
    b = ins[1] if len(ins) == 2 else _w(graph, node, "b")
    assert b is not None
    if node.attrs.get("swap"):
        a, b = b, a
    fn = node.attrs["fn"]
    with np.errstate(divide="ignore", invalid="ignore"):
        return {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[fn](a, b)


def _resize(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    """Separable: along H, then W, each by its table (ir.resize_table)."""
    x = ins[0]
    (p, q), (sh, sw) = node.attrs["size"], node.attrs["scale"]
    mode, coord, near = node.attrs["mode"], node.attrs["coord"], node.attrs.get("nearest", "round_prefer_floor")
    out = x
    for axis, size, scale in ((2, p, sh), (3, q, sw)):
        t = resize_table(out.shape[axis], size, scale, mode, coord, near)
        i0, i1 = t[:, 0].astype(int), t[:, 1].astype(int)
        wshape = (1,) * axis + (size,) + (1,) * (3 - axis)
        w1 = t[:, 2].reshape(wshape)
        out = np.take(out, i0, axis=axis) * (1.0 - w1) + np.take(out, i1, axis=axis) * w1
    return out


def _pad(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    pt, pb, pl, pr = conv_geometry(node)[2]
    mode = node.attrs.get("mode", "constant")
    widths = ((0, 0), (0, 0), (pt, pb), (pl, pr))
    if mode == "constant":
        return np.pad(ins[0], widths, constant_values=float(node.attrs.get("value", 0.0)))
    return np.pad(ins[0], widths, mode=mode)


def _deconv(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    """The transposed convolution as its definition: every input value times the filter, scattered
    at stride ``stride`` (dilated taps), then the padding cropped (independent of the dgrad kernels)."""
    x = ins[0]
    w = _w(graph, node, "w")
    assert w is not None
    (r, s), (sh, sw), (pt, pb, pl, pr), (dh, dw) = conv_geometry(node)
    g = conv_group(node)
    oh, ow = (int(v) for v in node.attrs.get("out_pad", (0, 0)))
    n, c, h, wd = x.shape
    k = int(node.attrs["k"])
    cg, kg = c // g, k // g
    full_h, full_w = (h - 1) * sh + (r - 1) * dh + 1 + oh, (wd - 1) * sw + (s - 1) * dw + 1 + ow
    full = np.zeros((n, k, full_h, full_w))
    xg = x.reshape(n, g, cg, h, wd)
    wg = w.reshape(g, cg, kg, r, s)
    for i in range(r):
        for j in range(s):
            tap = np.einsum("ngchw,gck->ngkhw", xg, wg[:, :, :, i, j]).reshape(n, k, h, wd)
            full[:, :, i * dh:i * dh + (h - 1) * sh + 1:sh, j * dw:j * dw + (wd - 1) * sw + 1:sw] += tap
    p = deconv_out(h, r, sh, pt, pb, dh, oh)
    q = deconv_out(wd, s, sw, pl, pr, dw, ow)
    y = full[:, :, pt:pt + p, pl:pl + q]
    b = _w(graph, node, "bias")
    y = y + b.reshape(1, -1, 1, 1) if b is not None else y
    return _act(node, y)


_OPS: dict[str, Callable[[Graph, Node, list[Arr]], Arr]] = {
    "conv": _conv, "fc": _fc, "pool": _pool, "lrn": _lrn, "relu": _relu, "batchnorm": _batchnorm,
    "scale": _scale, "softmax": _softmax,
    "add": lambda g, n, ins: _act(n, sum(ins[1:], ins[0])),
    "concat": lambda g, n, ins: np.concatenate(ins, axis=1),
    "flatten": lambda g, n, ins: ins[0].reshape(ins[0].shape[0], -1),
    "dropout": lambda g, n, ins: ins[0],
    "act": lambda g, n, ins: act_ref(n.attrs["fn"], ins[0], n.attrs),
    "binary": _binary, "resize": _resize, "pad": _pad, "deconv": _deconv,
    "reshape": lambda g, n, ins: ins[0].reshape((ins[0].shape[0],) + tuple(n.attrs["shape"])),
}
_OPS32: dict[str, Callable[[Graph, Node, list[Arr], bool], Arr]] = {"conv": _conv32, "fc": _fc32}


RESIDUAL_GAIN = 0.3  # what a residual branch's last batch norm scales its output to (calibrate_batchnorm)
MIN_CALIBRATION_VALUES = 64  # values per channel each batch norm's statistics are measured over, at least ...
MAX_CALIBRATION_IMAGES = 32  # ... from at most this many random images


def calibrate_batchnorm(graph: Graph, seed: int = 0, residual_gain: float = RESIDUAL_GAIN) -> int:
    """Set every batch norm's mean and variance to the per-channel statistics of what reaches it
    when random images (N(0, 1), ``seed``) run through ``graph`` in float32, in order, each batch
    norm normalising its real input before the next is measured: random weights that keep the
    signal's scale through a deep residual net, as trained ones do (with He-scaled filters and
    made-up statistics ResNet-50's activations grow to ~6e4 by res5c, past float16's range). As
    many images as give every statistic :data:`MIN_CALIBRATION_VALUES` values per channel (one at
    224 x 224 gave res5's 7 x 7 planes 49; at 64 x 64 their 2 x 2 planes gave 4, variances near zero
    and gains that amplified BF16 storage rounding to a 127 % logits error), at most
    :data:`MAX_CALIBRATION_IMAGES`.

    The last batch norm of each residual branch (:func:`residual_branch_norms`) normalises to a
    standard deviation of ``residual_gain`` instead of 1, as trained ResNets' small last scale
    factors do (Goyal et al. 2017 start them at zero): with unit branches a random ResNet-50 is
    chaotic (at 224 x 224 a 1e-3 change of its input moves the logits by 3e-2, so every
    implementation's half-precision rounding is amplified 30-fold); with 0.3, by 2.5e-3. Only up
    to the last batch norm runs. Returns how many were set."""
    if not 0 < residual_gain <= 1:
        raise ValueError(f"residual_gain ({residual_gain}) must be in (0, 1]")
    last = max((i for i, n in enumerate(graph.nodes) if n.op == "batchnorm"), default=-1)
    if last < 0:
        return 0
    branch = residual_branch_norms(graph)
    probe = graph.with_batch(1)
    probe.nodes = probe.nodes[:last + 1]
    probe.outputs = [probe.nodes[-1].output]
    shapes = infer(probe)  # the batch-1 shapes are valid (a GraphError names the node otherwise)
    pixels = min(int(np.prod(shapes[n.inputs[0]].shape[2:])) for n in probe.nodes if n.op == "batchnorm")
    probe = probe.with_batch(min(MAX_CALIBRATION_IMAGES, -(-MIN_CALIBRATION_VALUES // max(pixels, 1))))
    x = np.random.default_rng(seed).standard_normal(probe.input_shape).astype(np.float32)
    vals: dict[str, Arr] = {graph.input: x}
    for node in probe.nodes:
        ins = [vals[t] for t in node.inputs]
        if node.op == "batchnorm":
            axes = (0,) + tuple(range(2, ins[0].ndim))
            var = ins[0].var(axis=axes) / (residual_gain ** 2 if node.name in branch else 1.0)
            for role, stat in (("mean", ins[0].mean(axis=axes)), ("var", var)):
                key = node.weights.get(role)
                if key is not None:
                    graph.weights[key] = np.ascontiguousarray(stat, dtype=np.float32)
        if node.op in _OPS32:
            vals[node.output] = _OPS32[node.op](graph, node, ins, False)
        else:
            vals[node.output] = np.asarray(_OPS[node.op](graph, node, ins), dtype=np.float32)
    return sum(n.op == "batchnorm" for n in probe.nodes)


def residual_branch_norms(graph: Graph) -> set[str]:
    """Names of the batch norms that end a residual branch: for every add, the batch norm that
    produces (through scale nodes only) its input with the most convolutions behind it, the
    branch's rather than the shortcut's (identity or one projection)."""
    depth = {graph.input: 0}
    for node in graph.nodes:
        depth[node.output] = max((depth.get(t, 0) for t in node.inputs), default=0) + (node.op == "conv")
    out: set[str] = set()
    for node in graph.nodes:
        if node.op != "add" or len(node.inputs) < 2:
            continue
        deep = max(node.inputs, key=lambda t: depth.get(t, 0))
        if sum(depth.get(t, 0) == depth.get(deep, 0) for t in node.inputs) > 1:
            continue  # no deeper input: not a residual branch beside a shortcut
        producer = graph.producer(deep)
        while producer is not None and producer.op == "scale":
            producer = graph.producer(producer.inputs[0])
        if producer is not None and producer.op == "batchnorm":
            out.add(producer.name)
    return out

