"""The graph IR: typed nodes over tensors with named dimensions and inferred shapes.

A :class:`Graph` holds one input, nodes in topological order, named outputs and the weights
(float32 NumPy arrays by name). Every activation is a float32 NCHW (``n:c:y:x``) or
NC (``n:c``) tensor. :func:`infer` checks the graph and gives every tensor its shape; a malformed
graph is refused with an error naming the node, the field and the value.

Ops and their attributes (beyond Caffe's conv / fc / pool / lrn / relu / batchnorm / scale / add /
concat / softmax / flatten / dropout):

* ``act``: an elementwise activation ``fn`` (:data:`ACT_FNS`): sigmoid, silu, hardswish,
  hardsigmoid (``alpha``, ``beta``), clip (``lo``, ``hi``; None: unbounded), tanh, gelu (exact);
* ``binary``: ``fn`` (add, sub, mul, div) of two tensors, or of one tensor and the constant weight
  ``b`` (``swap``: the constant is the left operand), broadcast as NumPy does (rank kept, the batch
  never broadcast);
* ``resize``: to ``size`` (P, Q) by ``mode`` nearest / linear, ONNX's ``coord`` transformation with
  ``scale`` (the factors it divides by) and ``nearest`` rounding (:func:`resize_table`);
* ``pad``: ``pad`` (top, bottom, left, right) by ``mode`` constant (``value``), reflect or edge;
* ``deconv``: the transposed convolution (ONNX ConvTranspose): weights ``w`` (C, K/group, R, S) and
  ``bias``, ``kernel`` / ``stride`` / ``pad`` / ``dilation`` / ``group`` as the conv whose input
  gradient it is, and ``out_pad`` (extra rows and columns at the bottom and right);
* ``reshape``: a view of the same elements as (N,) + ``shape`` (one or three per-image dims).

A conv or fc node may carry ``act`` (:data:`EPILOGUE_ACTS`): an activation folded into its epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convforge.spec import ConvSpec

OPS = ("conv", "fc", "pool", "lrn", "relu", "batchnorm", "scale", "add", "concat", "softmax",
       "flatten", "dropout", "act", "binary", "resize", "pad", "deconv", "reshape")

# Weights each op needs (by role), and which of them are optional.
WEIGHTS: dict[str, tuple[str, ...]] = {
    "conv": ("w", "bias", "pscale", "pshift"), "fc": ("w", "bias"), "batchnorm": ("mean", "var", "gamma", "beta"),
    "scale": ("gamma", "beta"), "deconv": ("w", "bias"), "binary": ("b",),
}
OPTIONAL = {"bias", "gamma", "beta", "pscale", "pshift", "b"}  # pscale, pshift: a conv's prologue (both or none)

ACT_FNS = ("sigmoid", "silu", "hardswish", "hardsigmoid", "clip", "tanh", "gelu", "mish", "softplus")  # an act's fn
EPILOGUE_ACTS = ("silu", "hardswish", "gelu", "mish")  # a conv / fc epilogue's (attrs["act"]) besides ReLU
BINARY_FNS = ("add", "sub", "mul", "div")
RESIZE_MODES = ("nearest", "linear")
COORD_MODES = ("asymmetric", "half_pixel", "pytorch_half_pixel", "align_corners")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
PAD_MODES = ("constant", "reflect", "edge")


class GraphError(ValueError):
    """A malformed graph: the message names the node, the field and the value."""


@dataclass(frozen=True)
class Tensor:
    """A named float32 tensor: dimension names (``n:c:y:x`` or ``n:c``) and sizes."""

    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    def layout(self) -> str:
        return ":".join(self.dims)

    def __str__(self) -> str:
        return f"{self.name}[{' '.join(f'{d}={s}' for d, s in zip(self.dims, self.shape))}]"


@dataclass
class Node:
    """One operation: ``op`` over input tensor names into one output tensor.

    ``weights`` maps a role ("w", "bias", "mean", ...) to a key of :attr:`Graph.weights`; ``attrs``
    hold the op's settings (kernel, stride, pad, ...). ``fused`` records what passes folded in
    (``relu``, ``residual``) so the runtime can pick the matching epilogue. A conv's prologue (a
    pre-activation folded into its input load, ``passes.fold_preactivation``): the weights
    ``pscale`` and ``pshift`` (C each) and the attribute ``pre_relu``; the conv then computes the
    padded convolution of ``max(pscale[c] * x + pshift[c], 0)`` (padding stays zero).
    """

    name: str
    op: str
    inputs: list[str]
    output: str
    attrs: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, str] = field(default_factory=dict)

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)


@dataclass
class Graph:
    """Nodes in execution order, one NCHW input, named outputs and the weights."""

    name: str
    input: str
    input_shape: tuple[int, int, int, int]  # n, c, y, x
    nodes: list[Node]
    outputs: list[str]
    weights: dict[str, np.ndarray] = field(default_factory=dict)

    def copy(self) -> Graph:
        """A copy whose node list and nodes can be rewritten (weights shared until replaced)."""
        nodes = [Node(n.name, n.op, list(n.inputs), n.output, dict(n.attrs), dict(n.weights))
                 for n in self.nodes]
        return Graph(self.name, self.input, self.input_shape, nodes, list(self.outputs), dict(self.weights))

    def with_batch(self, batch: int) -> Graph:
        g = self.copy()
        g.input_shape = (batch,) + tuple(self.input_shape[1:])  # type: ignore[assignment]
        return g

    def rename(self, old: str, new: str) -> None:
        """Tensor ``old`` is called ``new`` from now on: by its producer, its readers and the outputs."""
        for n in self.nodes:
            if n.output == old:
                n.output = new
            n.inputs = [new if t == old else t for t in n.inputs]
        self.outputs = [new if t == old else t for t in self.outputs]

    def producer(self, tensor: str) -> Node | None:
        for n in self.nodes:
            if n.output == tensor:
                return n
        return None

    def consumers(self, tensor: str) -> list[Node]:
        return [n for n in self.nodes if tensor in n.inputs]

    def weight(self, node: Node, role: str) -> np.ndarray | None:
        key = node.weights.get(role)
        return None if key is None else self.weights[key]

    def summary(self) -> str:
        shapes = infer(self)
        lines = [f"graph {self.name}: input {shapes[self.input]}"]
        for n in self.nodes:
            lines.append(f"  {n.name:24s} {n.op:10s} -> {shapes[n.output]}")
        return "\n".join(lines)


def input_shape(dims: list[int], input_size: int | None, batch: int | None) -> tuple[int, int, int, int]:
    """An NCHW input shape from a front-end's dims, with a square ``input_size`` and ``batch``
    overriding the description's (the front-ends' common option)."""
    n, c, h, w = dims
    if input_size is not None:
        h = w = input_size
    return (batch if batch is not None else n, c, h, w)


def _ints(node: Node, key: str, default: Any, count: int) -> tuple[int, ...]:
    """An int or tuple attribute as ``count`` non-negative ints, or a GraphError naming it."""
    v = node.attrs.get(key, default)
    vals = (v,) * count if isinstance(v, int) else tuple(v)
    if len(vals) != count or not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
        raise GraphError(f"node {node.name!r} ({node.op}): {key} ({v!r}) must be an int or {count} ints")
    if any(x < 0 for x in vals):
        raise GraphError(f"node {node.name!r} ({node.op}): {key} ({v!r}) must be >= 0")
    return vals


def lrn_params(attrs: dict[str, Any]) -> tuple[int, float, float, float]:
    """(size, alpha, beta, k) of an LRN node's attributes (or a pool's fused ``lrn``), with Caffe's
    defaults: y = x / (k + alpha/size * sum of x^2 over ``size`` channels)^beta."""
    size = int(attrs.get("size", 5))
    alpha, beta, k = (float(attrs.get(a, d)) for a, d in (("alpha", 1e-4), ("beta", 0.75), ("k", 1.0)))
    return size, alpha, beta, k


def conv_geometry(node: Node) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int, int, int],
                                        tuple[int, int]]:
    """(kernel, stride, pad (top, bottom, left, right), dilation) of a conv or pool node."""
    kernel = _ints(node, "kernel", 1, 2)
    stride = _ints(node, "stride", 1, 2)
    pad = _ints(node, "pad", 0, 4)
    dil = _ints(node, "dilation", 1, 2)
    for key, vals in (("kernel", kernel), ("stride", stride), ("dilation", dil)):
        if min(vals) < 1:
            raise GraphError(f"node {node.name!r} ({node.op}): {key} ({vals}) must be >= 1")
    return (kernel[0], kernel[1]), (stride[0], stride[1]), (pad[0], pad[1], pad[2], pad[3]), (dil[0], dil[1])


def conv_group(node: Node) -> int:
    """A conv node's ``group`` attribute (Caffe's and ONNX's name; 1 when absent), checked."""
    g = node.attrs.get("group", 1)
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise GraphError(f"node {node.name!r} ({node.op}): group ({g!r}) must be a positive int")
    return g


def pool_out(size: int, k: int, st: int, p0: int, p1: int, ceil: bool) -> int:
    """Pooled extent; Caffe's ceil mode, with the last window starting inside the image (Caffe
    trims only when padded, leaving an empty last window when the stride exceeds the kernel)."""
    span = size + p0 + p1 - k
    out = (-(-span // st) if ceil else span // st) + 1
    if ceil and (out - 1) * st >= size + p0:
        out -= 1
    return out


def deconv_out(size: int, k: int, st: int, p0: int, p1: int, dil: int, extra: int) -> int:
    """Output extent of a transposed convolution (ONNX ConvTranspose, PyTorch conv_transpose2d): the
    input extent of the conv whose input gradient it is, ``extra`` (output_padding) rows added."""
    return (size - 1) * st - p0 - p1 + (k - 1) * dil + 1 + extra


def resize_table(size: int, out: int, scale: float, mode: str, coord: str, nearest: str) -> np.ndarray:
    """Per output index along one axis, (first source index, second source index, weight of the
    second) in float64, as ONNX Resize defines them: the output coordinate mapped back by ``coord``
    with ``scale`` (the factor the output extent is the input's), then the nearest source by
    ``nearest`` rounding, or the two neighbours and the fraction (``mode`` linear); sources clamped
    to the input (edge values)."""
    y = np.arange(out, dtype=np.float64)
    length = scale * size
    if coord == "align_corners":
        x = np.zeros(out) if length == 1 else y * (size - 1) / (length - 1)
    elif coord == "asymmetric":
        x = y / scale
    elif coord == "pytorch_half_pixel" and length == 1:
        x = np.full(out, -0.5)
    else:  # half_pixel, pytorch_half_pixel
        x = (y + 0.5) / scale - 0.5
    lo = np.floor(x)
    frac = x - lo
    if mode == "linear":
        first, second, weight = lo, lo + 1, frac
    else:
        up = {"round_prefer_floor": frac > 0.5, "round_prefer_ceil": frac >= 0.5, "floor": np.zeros(out, bool),
              "ceil": frac > 0}[nearest]
        first = second = lo + up
        weight = np.zeros(out)
    return np.stack([np.clip(first, 0, size - 1), np.clip(second, 0, size - 1), weight], axis=1)


def broadcast(where: str, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The NumPy broadcast of shapes ``a`` and ``b`` of equal rank, else a GraphError."""
    if len(a) != len(b) or any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
        raise GraphError(f"{where}: shapes {a} and {b} do not broadcast (equal ranks, each dim equal or 1)")
    return tuple(max(x, y) for x, y in zip(a, b))


def _weight_shape(graph: Graph, node: Node, role: str, want: tuple[int, ...]) -> None:
    key = node.weights.get(role)
    if key is None:
        if role in OPTIONAL:
            return
        raise GraphError(f"node {node.name!r} ({node.op}): weights.{role} is missing")
    if key not in graph.weights:
        raise GraphError(f"node {node.name!r} ({node.op}): weights.{role} ({key!r}) is not in the weights")
    got = tuple(graph.weights[key].shape)
    if got != want:
        raise GraphError(f"node {node.name!r} ({node.op}): weights.{role} has shape {got}, expected {want} "
                         f"(weight {key!r})")


def check_weights(graph: Graph) -> None:
    """A GraphError naming the node and weight when a weight holds NaN or Inf, or a batch norm's
    variance is negative (it would take the square root of a negative number: NaN outputs)."""
    for node in graph.nodes:
        for role, key in node.weights.items():
            arr = graph.weights.get(key)
            if arr is None or not np.issubdtype(arr.dtype, np.floating):
                continue
            bad = int(np.count_nonzero(~np.isfinite(arr)))
            if bad:
                raise GraphError(f"node {node.name!r} ({node.op}): weights.{role} ({key!r}) holds {bad} NaN or "
                                 "infinite value(s)")
            if node.op == "batchnorm" and role == "var" and arr.size and float(arr.min()) < 0:
                raise GraphError(f"node {node.name!r} ({node.op}): the variance ({key!r}) has "
                                 f"{int(np.count_nonzero(arr < 0))} negative value(s), the smallest "
                                 f"{float(arr.min()):g}; a batch norm's variance is >= 0")


def _check_act(node: Node, where: str) -> None:
    """A conv / fc node's epilogue activation: ReLU or one of EPILOGUE_ACTS, not both."""
    act = node.attrs.get("act")
    if act is not None and (act not in EPILOGUE_ACTS or node.attrs.get("relu")):
        raise GraphError(f"{where}: act ({act!r}) must be one of {', '.join(EPILOGUE_ACTS)}, and not with relu")


def _infer_node(graph: Graph, node: Node, ins: list[Tensor]) -> Tensor:
    """The output tensor of ``node`` given its input tensors."""
    x = ins[0]
    where = f"node {node.name!r} ({node.op})"
    if node.op in ("conv", "pool", "lrn") and len(x.dims) != 4:
        raise GraphError(f"{where}: input {x.name!r} is {x.layout()}, expected n:c:y:x")
    if node.op == "conv":
        (r, s), st, pad, dil = conv_geometry(node)
        k = node.attrs.get("k")
        if not isinstance(k, int) or k < 1:
            raise GraphError(f"{where}: k ({k!r}) must be a positive int")
        n, c, h, w = x.shape
        g = conv_group(node)
        if c % g or k % g:
            raise GraphError(f"{where}: group ({g}) must divide the input channels ({c}) and k ({k})")
        er, es = (r - 1) * dil[0] + 1, (s - 1) * dil[1] + 1
        p = (h + pad[0] + pad[1] - er) // st[0] + 1
        q = (w + pad[2] + pad[3] - es) // st[1] + 1
        if p < 1 or q < 1:
            raise GraphError(f"{where}: kernel ({r}x{s}) is larger than the padded input {x}")
        _weight_shape(graph, node, "w", (k, c // g, r, s))
        _weight_shape(graph, node, "bias", (k,))
        if ("pscale" in node.weights) != ("pshift" in node.weights):
            raise GraphError(f"{where}: a prologue needs both weights.pscale and weights.pshift")
        _weight_shape(graph, node, "pscale", (c,))
        _weight_shape(graph, node, "pshift", (c,))
        _check_act(node, where)
        out = Tensor(node.output, ("n", "c", "y", "x"), (n, k, p, q))
        if len(ins) == 2 and ins[1].shape != out.shape:
            raise GraphError(f"{where}: residual input {ins[1]} does not match the output {out}")
        return out
    if node.op == "fc":
        k = node.attrs.get("k")
        if not isinstance(k, int) or k < 1:
            raise GraphError(f"{where}: k ({k!r}) must be a positive int")
        fan = x.size // x.shape[0]
        _weight_shape(graph, node, "w", (k, fan))
        _weight_shape(graph, node, "bias", (k,))
        _check_act(node, where)
        return Tensor(node.output, ("n", "c"), (x.shape[0], k))
    if node.op == "pool":
        kind = node.attrs.get("kind", "max")
        if kind not in ("max", "avg"):
            raise GraphError(f"{where}: kind ({kind!r}) must be 'max' or 'avg'")
        n, c, h, w = x.shape
        if node.attrs.get("global"):
            return Tensor(node.output, x.dims, (n, c, 1, 1))
        (r, s), st, pad, _ = conv_geometry(node)
        if max(pad[:2]) >= r or max(pad[2:]) >= s:
            raise GraphError(f"{where}: pad {pad} must be smaller than the kernel ({r}x{s}) on each side, "
                             "else a window can lie wholly in the padding")
        ceil = bool(node.attrs.get("ceil", False))
        p, q = pool_out(h, r, st[0], pad[0], pad[1], ceil), pool_out(w, s, st[1], pad[2], pad[3], ceil)
        if p < 1 or q < 1 or r > h + pad[0] + pad[1] or s > w + pad[2] + pad[3]:
            raise GraphError(f"{where}: kernel ({r}x{s}) is larger than the padded input {x}")
        return Tensor(node.output, x.dims, (n, c, p, q))
    if node.op in ("batchnorm", "scale"):
        c = x.shape[1]
        for role in WEIGHTS[node.op]:
            _weight_shape(graph, node, role, (c,))
        return Tensor(node.output, x.dims, x.shape)
    if node.op == "add":
        for other in ins[1:]:
            if other.shape != x.shape:
                raise GraphError(f"{where}: input {other} does not match {x}")
        return Tensor(node.output, x.dims, x.shape)
    if node.op == "concat":
        axis = node.attrs.get("axis", 1)
        if axis != 1:
            raise GraphError(f"{where}: axis ({axis!r}) must be 1 (channels)")
        for other in ins[1:]:
            if len(other.shape) != len(x.shape) or other.shape[:1] + other.shape[2:] != x.shape[:1] + x.shape[2:]:
                raise GraphError(f"{where}: input {other} does not match {x} outside the channels")
        return Tensor(node.output, x.dims, (x.shape[0], sum(t.shape[1] for t in ins)) + x.shape[2:])
    if node.op == "flatten":
        return Tensor(node.output, ("n", "c"), (x.shape[0], x.size // x.shape[0]))
    if node.op in ("relu", "lrn", "softmax", "dropout"):
        if node.op == "lrn" and int(node.attrs.get("size", 5)) % 2 != 1:
            raise GraphError(f"{where}: size ({node.attrs.get('size')!r}) must be odd")
        return Tensor(node.output, x.dims, x.shape)
    return _infer_onnx_op(graph, node, ins, where)


def _choice(node: Node, key: str, allowed: tuple[str, ...], default: str | None = None) -> str:
    v = node.attrs.get(key, default)
    if v not in allowed:
        raise GraphError(f"node {node.name!r} ({node.op}): {key} ({v!r}) must be one of {', '.join(allowed)}")
    return str(v)


def _infer_onnx_op(graph: Graph, node: Node, ins: list[Tensor], where: str) -> Tensor:
    """The output of the ops that modern CNNs' ONNX exports brought: act, binary, resize, pad,
    deconv, reshape (module docstring)."""
    x = ins[0]
    if node.op in ("resize", "pad", "deconv") and len(x.dims) != 4:
        raise GraphError(f"{where}: input {x.name!r} is {x.layout()}, expected n:c:y:x")
    if node.op == "act":
        _choice(node, "fn", ACT_FNS)
        return Tensor(node.output, x.dims, x.shape)
    if node.op == "binary":
        _choice(node, "fn", BINARY_FNS)
        b = graph.weight(node, "b")
        if (len(ins) == 2) == (b is not None):
            raise GraphError(f"{where}: a binary op takes two tensors, or one and the constant weights.b")
        other = ins[1].shape if b is None else tuple(b.shape)
        if b is not None and other[:1] != (1,):
            raise GraphError(f"{where}: weights.b has shape {other}: a constant is never per image (batch dim 1)")
        if b is None and other[0] != x.shape[0]:
            raise GraphError(f"{where}: inputs {x} and {ins[1]} differ in the batch")
        out = broadcast(where, x.shape, other)
        return Tensor(node.output, x.dims, out)
    if node.op == "resize":
        _choice(node, "mode", RESIZE_MODES)
        _choice(node, "coord", COORD_MODES)
        _choice(node, "nearest", NEAREST_MODES, "round_prefer_floor")
        size = _ints(node, "size", (0, 0), 2)
        scale = node.attrs.get("scale")
        if min(size) < 1 or not isinstance(scale, tuple) or len(scale) != 2 or not all(
                isinstance(v, float) and v > 0 for v in scale):
            raise GraphError(f"{where}: size ({size}) must be >= 1 and scale ({scale!r}) 2 floats > 0")
        return Tensor(node.output, x.dims, x.shape[:2] + size)
    if node.op == "pad":
        mode = _choice(node, "mode", PAD_MODES, "constant")
        pt, pb, pl, pr = _ints(node, "pad", 0, 4)
        h, w = x.shape[2:]
        if mode == "reflect" and (max(pt, pb) >= h or max(pl, pr) >= w):
            raise GraphError(f"{where}: reflect pad {(pt, pb, pl, pr)} must be smaller than the input {x}")
        return Tensor(node.output, x.dims, (x.shape[0], x.shape[1], h + pt + pb, w + pl + pr))
    if node.op == "deconv":
        return _infer_deconv(graph, node, x, where)
    if node.op == "reshape":
        shape = tuple(node.attrs.get("shape", ()))
        if len(shape) not in (1, 3) or not all(isinstance(v, int) and v >= 1 for v in shape) or \
                int(np.prod(shape)) != x.size // x.shape[0]:
            raise GraphError(f"{where}: shape ({shape!r}) must be 1 or 3 positive ints holding the "
                             f"{x.size // x.shape[0]} values of an image of {x}")
        return Tensor(node.output, ("n", "c", "y", "x")[:len(shape) + 1], (x.shape[0],) + shape)
    raise GraphError(f"{where}: unknown op {node.op!r}; known: {', '.join(OPS)}")


def _infer_deconv(graph: Graph, node: Node, x: Tensor, where: str) -> Tensor:
    """A transposed convolution's output (``deconv_out``), its weights checked."""
    (r, s), st, pad, dil = conv_geometry(node)
    k = node.attrs.get("k")
    if not isinstance(k, int) or k < 1:
        raise GraphError(f"{where}: k ({k!r}) must be a positive int")
    n, c, h, w = x.shape
    g = conv_group(node)
    if c % g or k % g:
        raise GraphError(f"{where}: group ({g}) must divide the input channels ({c}) and k ({k})")
    oh, ow = _ints(node, "out_pad", 0, 2)
    if oh >= st[0] or ow >= st[1]:
        raise GraphError(f"{where}: out_pad ({(oh, ow)}) must be smaller than the stride ({st})")
    p = deconv_out(h, r, st[0], pad[0], pad[1], dil[0], oh)
    q = deconv_out(w, s, st[1], pad[2], pad[3], dil[1], ow)
    if p < 1 or q < 1:
        raise GraphError(f"{where}: pad {pad} leaves no output of the transposed convolution of {x}")
    _weight_shape(graph, node, "w", (c, k // g, r, s))
    _weight_shape(graph, node, "bias", (k,))
    return Tensor(node.output, x.dims, (n, k, p, q))


_ARITY = {"add": (2, 99), "concat": (1, 99), "conv": (1, 2), "binary": (1, 2)}  # conv: + fused residual


def infer_node(graph: Graph, node: Node, shapes: dict[str, Tensor]) -> Tensor:
    """The output tensor of ``node`` given the tensors before it (``shapes``), its op, arity,
    inputs and weights checked; a GraphError names what is wrong."""
    if node.op not in OPS:
        raise GraphError(f"node {node.name!r}: unknown op {node.op!r}; known: {', '.join(OPS)}")
    lo, hi = _ARITY.get(node.op, (1, 1))
    if not lo <= len(node.inputs) <= hi:
        raise GraphError(f"node {node.name!r} ({node.op}): inputs ({node.inputs}) must number "
                         f"{lo}" + (f" to {hi}" if hi != lo and hi < 99 else " or more" if hi != lo else ""))
    for t in node.inputs:
        if t not in shapes:
            raise GraphError(f"node {node.name!r} ({node.op}): input {t!r} is dangling "
                             "(no earlier node or graph input produces it)")
    if node.output in shapes:
        raise GraphError(f"node {node.name!r} ({node.op}): output {node.output!r} is already produced "
                         "(tensors are written once)")
    return _infer_node(graph, node, [shapes[t] for t in node.inputs])


def infer(graph: Graph) -> dict[str, Tensor]:
    """Every tensor of ``graph`` with its dimensions and shape; a malformed graph raises GraphError."""
    if len(graph.input_shape) != 4 or any(not isinstance(v, int) or v < 1 for v in graph.input_shape):
        raise GraphError(f"graph {graph.name!r}: input_shape ({graph.input_shape!r}) must be 4 positive ints")
    shapes = {graph.input: Tensor(graph.input, ("n", "c", "y", "x"), tuple(graph.input_shape))}
    seen: set[str] = set()
    for node in graph.nodes:
        if node.name in seen:
            raise GraphError(f"node {node.name!r}: name is used twice")
        seen.add(node.name)
        shapes[node.output] = infer_node(graph, node, shapes)
    if not graph.outputs:
        raise GraphError(f"graph {graph.name!r}: outputs is empty")
    for t in graph.outputs:
        if t not in shapes:
            raise GraphError(f"graph {graph.name!r}: output {t!r} is not produced by any node")
    return shapes


def conv_spec(node: Node, x: Tensor, dtype: str = "float32") -> ConvSpec:
    """The ConvSpec of a conv node, or of a fully connected node as a 1x1 conv on a 1x1 image,
    stored as ``dtype``."""
    n = x.shape[0]
    k = int(node.attrs["k"])
    if node.op == "fc":
        return ConvSpec(n, x.size // n, 1, 1, k, 1, 1, dtype=dtype)
    (r, s), st, pad, dil = conv_geometry(node)
    return ConvSpec(n, x.shape[1], x.shape[2], x.shape[3], k, r, s, st, pad, dil, dtype=dtype, groups=conv_group(node))


def channel_affine(graph: Graph, node: Node) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (scale, shift) of a batchnorm or scale node, computed in float64."""
    def get(role: str, default: float, c: int) -> np.ndarray:
        w = graph.weight(node, role)
        return np.full(c, default) if w is None else np.asarray(w, np.float64)

    c = graph.weights[next(iter(node.weights.values()))].shape[0]
    gamma, beta = get("gamma", 1.0, c), get("beta", 0.0, c)
    if node.op == "scale":
        return gamma, beta
    a = gamma / np.sqrt(get("var", 1.0, c) + float(node.attrs.get("eps", 1e-5)))
    return a, beta - get("mean", 0.0, c) * a
