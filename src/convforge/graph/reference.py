"""The float64 NumPy executor of the IR, op by op: the oracle of every network test."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from convforge.graph.ir import Graph, Node, conv_geometry, conv_group, infer, pool_out
from convforge.reference import conv2d_ref
from convforge.spec import ConvSpec

Arr = np.ndarray


def run_reference(graph: Graph, x: Arr) -> dict[str, Arr]:
    """Run ``graph`` on ``x`` in float64; returns every output tensor by name."""
    shapes = infer(graph)
    if tuple(x.shape) != shapes[graph.input].shape:
        raise ValueError(f"input shape {tuple(x.shape)} does not match the graph's {shapes[graph.input]}")
    vals: dict[str, Arr] = {graph.input: np.asarray(x, dtype=np.float64)}
    for node in graph.nodes:
        vals[node.output] = _OPS[node.op](graph, node, [vals[t] for t in node.inputs])
    return {t: vals[t] for t in graph.outputs}


def _w(graph: Graph, node: Node, role: str) -> Arr | None:
    w = graph.weight(node, role)
    return None if w is None else np.asarray(w, dtype=np.float64)


def _act(node: Node, y: Arr) -> Arr:
    return np.maximum(y, 0.0) if node.attrs.get("relu") else y


def _conv(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    (r, s), st, pad, dil = conv_geometry(node)
    x = ins[0]
    w = _w(graph, node, "w")
    assert w is not None
    n, c, h, wd = (int(v) for v in x.shape)
    spec = ConvSpec(n, c, h, wd, int(w.shape[0]), r, s, st, pad, dil, groups=conv_group(node))
    y = conv2d_ref(x, w, spec, _w(graph, node, "bias"))
    if len(ins) == 2:
        y = y + ins[1]
    return _act(node, y)


def _fc(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    x = ins[0].reshape(ins[0].shape[0], -1)
    w = _w(graph, node, "w")
    assert w is not None
    y = x @ w.T
    b = _w(graph, node, "bias")
    return _act(node, y + b if b is not None else y)


def _pool(graph: Graph, node: Node, ins: list[Arr]) -> Arr:
    x = ins[0]
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
    """Across channels: x / (k + alpha/size * sum of x^2 over ``size`` channels)^beta."""
    x = ins[0]
    size = int(node.attrs.get("size", 5))
    alpha, beta, k = (float(node.attrs.get(a, d)) for a, d in (("alpha", 1e-4), ("beta", 0.75), ("k", 1.0)))
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


_OPS: dict[str, Callable[[Graph, Node, list[Arr]], Arr]] = {
    "conv": _conv, "fc": _fc, "pool": _pool, "lrn": _lrn, "relu": _relu, "batchnorm": _batchnorm,
    "scale": _scale, "softmax": _softmax,
    "add": lambda g, n, ins: _act(n, sum(ins[1:], ins[0])),
    "concat": lambda g, n, ins: np.concatenate(ins, axis=1),
    "flatten": lambda g, n, ins: ins[0].reshape(ins[0].shape[0], -1),
    "dropout": lambda g, n, ins: ins[0],
}
