"""ONNX op handlers: each op type of :data:`SUPPORTED_OPS` into IR nodes (graph/ir.py).

A handler gets the node's :class:`Ctx` (its attributes, inputs, the constants folded so far and the
tensors' shapes) and returns the IR nodes that compute it, the last one writing the ONNX output; an
empty list makes the output an alias of the input (a view: a no-op Reshape, Flatten of a 2-D tensor).
What the runtime does not compute is refused with a GraphError naming the node and the value.
docs/ONNX.md lists the ops and their limits for users.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convforge.graph.ir import Graph, GraphError, Node, Tensor

# Per op type: the fewest and most inputs (optional ones may be left empty, "") and the
# attributes ONNX requires. The first ``fewest`` inputs must be given.
SPEC: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "Conv": (2, 3, ()), "ConvTranspose": (2, 3, ()), "Gemm": (2, 3, ()), "MatMul": (2, 2, ()),
    "Relu": (1, 1, ()), "LeakyRelu": (1, 1, ()), "Clip": (1, 3, ()), "Sigmoid": (1, 1, ()), "Tanh": (1, 1, ()),
    "HardSigmoid": (1, 1, ()), "HardSwish": (1, 1, ()), "Swish": (1, 1, ()), "Gelu": (1, 1, ()),
    "Mish": (1, 1, ()), "Softplus": (1, 1, ()),
    "MaxPool": (1, 1, ("kernel_shape",)), "AveragePool": (1, 1, ("kernel_shape",)), "GlobalAveragePool": (1, 1, ()),
    "GlobalMaxPool": (1, 1, ()),
    "ReduceMean": (1, 2, ()), "ReduceMax": (1, 2, ()), "LRN": (1, 1, ("size",)), "BatchNormalization": (5, 5, ()),
    "Add": (2, 2, ()), "Sub": (2, 2, ()), "Mul": (2, 2, ()), "Div": (2, 2, ()), "Sum": (1, 2**31, ()),
    "Concat": (1, 2**31, ("axis",)), "Softmax": (1, 1, ()), "Flatten": (1, 1, ()), "Reshape": (2, 2, ()),
    "Squeeze": (1, 2, ()), "Unsqueeze": (1, 2, ()), "Resize": (1, 4, ()), "Upsample": (1, 2, ()),
    "Pad": (1, 4, ()), "Dropout": (1, 3, ()), "Identity": (1, 1, ()),
}
SUPPORTED_OPS: tuple[str, ...] = tuple(sorted(SPEC))
"""The ONNX op types the front-end reads (besides any op whose inputs are all constants, which is
evaluated at load time: Constant, Shape, Gather, Cast, ...). The one list: docs/ONNX.md and the
error for an unknown op name these."""


@dataclass
class Ctx:
    """One ONNX node being translated: its IR name, op type, attributes and inputs (aliases
    resolved, "" for an optional input left out), with the graph, the constants and the shapes."""

    graph: Graph
    consts: dict[str, np.ndarray]
    shapes: dict[str, Tensor]
    name: str
    kind: str
    attrs: dict[str, Any]
    ins: list[str]
    out: str
    nodes: list[Node] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"node {self.name!r} ({self.kind})"

    def fail(self, what: str) -> GraphError:
        return GraphError(f"{self.where}: {what}")

    def tensors(self) -> list[str]:
        """The inputs that are activations (not constants), in order."""
        return [t for t in self.ins if t and t not in self.consts]

    @property
    def x(self) -> Tensor:
        """The first activation input's tensor."""
        acts = self.tensors()
        if not acts:
            raise self.fail("no input is a tensor")
        if acts[0] not in self.shapes:
            raise self.fail(f"input {acts[0]!r} is dangling (no earlier node or graph input produces it)")
        return self.shapes[acts[0]]

    def const(self, i: int, role: str, ndim: int | None = None) -> np.ndarray:
        """Input ``i`` as a constant (an initializer or computed from constants only)."""
        t = self.ins[i] if i < len(self.ins) else ""
        if t not in self.consts:
            raise self.fail(f"{role} ({t!r}) must be a constant (an initializer, or computed from constants only)")
        arr = self.consts[t]
        if ndim is not None and arr.ndim != ndim:
            raise self.fail(f"{role} ({t!r}) has shape {arr.shape}, expected {ndim}-D")
        return arr

    def opt_const(self, i: int, role: str) -> np.ndarray | None:
        """Optional input ``i`` as a constant, None when left out."""
        return self.const(i, role) if i < len(self.ins) and self.ins[i] else None

    def node(self, op: str, inputs: list[str], attrs: dict[str, Any] | None = None, part: str = "") -> Node:
        """A new IR node (``part``: a step before the last, its output named after it)."""
        name = f"{self.name}/{part}" if part else self.name
        node = Node(name, op, inputs, f"{self.out}/{part}" if part else self.out, dict(attrs or {}))
        self.nodes.append(node)
        return node

    def weight(self, node: Node, role: str, arr: np.ndarray) -> None:
        key = f"{node.name}.{role}"
        self.graph.weights[key] = np.array(arr, dtype=np.float32, order="C")  # a writable copy
        node.weights[role] = key

    def ints(self, key: str, count: int, default: tuple[int, ...]) -> tuple[int, ...]:
        """An ints attribute of exactly ``count`` values (``default`` when absent)."""
        vals = self.attrs.get(key, default)
        if not isinstance(vals, (list, tuple)) or len(vals) != count:
            raise self.fail(f"{key} ({vals!r}) must be {count} ints (2-D only)")
        return tuple(int(v) for v in vals)

    def text(self, key: str, default: str) -> str:
        v = self.attrs.get(key, default)
        return v.decode() if isinstance(v, bytes) else str(v)

    def axis(self, default: int, x: Tensor) -> int:
        """Attribute ``axis`` made non-negative against the rank of ``x``."""
        axis = int(self.attrs.get("axis", default))
        return axis + len(x.shape) if axis < 0 else axis


Handler = Callable[[Ctx], None]


# -- padding --------------------------------------------------------------------------------------

def _pads(c: Ctx, hw: tuple[int, ...], kernel: tuple[int, ...], strides: tuple[int, ...],
          dil: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The IR's (top, bottom, left, right) from ONNX ``pads`` (top, left, bottom, right) or
    ``auto_pad``: SAME_UPPER / SAME_LOWER pad to ceil(in / stride) outputs, the odd one at the end
    (UPPER) or the start (LOWER); VALID none."""
    mode = c.text("auto_pad", "NOTSET")
    if mode == "NOTSET":
        t, left, b, r = c.ints("pads", 4, (0, 0, 0, 0))
        return (t, b, left, r)
    if mode == "VALID":
        return (0, 0, 0, 0)
    if mode not in ("SAME_UPPER", "SAME_LOWER"):
        raise c.fail(f"auto_pad ({mode!r}) must be NOTSET, SAME_UPPER, SAME_LOWER or VALID")
    out: list[int] = []
    for size, k, st, d in zip(hw, kernel, strides, dil, strict=True):
        total = max(0, (-(-size // st) - 1) * st + (k - 1) * d + 1 - size)
        lo = total // 2 if mode == "SAME_UPPER" else total - total // 2
        out += [lo, total - lo]
    return (out[0], out[1], out[2], out[3])


# -- convolutions and linear layers ----------------------------------------------------------------

def conv(c: Ctx) -> None:
    x = c.x
    w = c.const(1, "W", 4)
    kernel = tuple(int(v) for v in w.shape[2:])
    if "kernel_shape" in c.attrs and c.ints("kernel_shape", 2, ()) != kernel:
        raise c.fail(f"kernel_shape ({c.attrs['kernel_shape']}) does not match W {w.shape}")
    st, dil = c.ints("strides", 2, (1, 1)), c.ints("dilations", 2, (1, 1))
    node = c.node("conv", [x.name], {"k": int(w.shape[0]), "kernel": kernel, "stride": st,
                                     "pad": _pads(c, x.shape[2:], kernel, st, dil), "dilation": dil,
                                     "group": int(c.attrs.get("group", 1))})
    c.weight(node, "w", w)
    b = c.opt_const(2, "B")
    if b is not None:
        c.weight(node, "bias", b.ravel())


def conv_transpose(c: Ctx) -> None:
    """ConvTranspose as the IR's deconv: pads from ``pads``, or from ``output_shape`` / SAME
    auto_pad as ONNX derives them (the total padding split, its odd one at the start unless
    SAME_UPPER)."""
    x = c.x
    if len(x.shape) != 4:
        raise c.fail(f"input {x} must be n:c:y:x")
    w = c.const(1, "W", 4)
    kernel = tuple(int(v) for v in w.shape[2:])
    if "kernel_shape" in c.attrs and c.ints("kernel_shape", 2, ()) != kernel:
        raise c.fail(f"kernel_shape ({c.attrs['kernel_shape']}) does not match W {w.shape}")
    st, dil = c.ints("strides", 2, (1, 1)), c.ints("dilations", 2, (1, 1))
    extra = c.ints("output_padding", 2, (0, 0))
    group = int(c.attrs.get("group", 1))
    mode = c.text("auto_pad", "NOTSET")
    if "output_shape" in c.attrs or mode in ("SAME_UPPER", "SAME_LOWER"):
        if "pads" in c.attrs:
            raise c.fail("give pads or output_shape / SAME auto_pad, not both")
        shape = [int(v) for v in c.attrs.get("output_shape", [s * t for s, t in zip(x.shape[2:], st)])][-2:]
        pads = []
        for size, k, s, d, e, o in zip(x.shape[2:], kernel, st, dil, extra, shape, strict=True):
            total = s * (size - 1) + e + (k - 1) * d + 1 - o
            if total < 0:
                raise c.fail(f"output_shape ({shape}) is larger than the transposed convolution's output")
            lo = total // 2 if mode == "SAME_UPPER" else total - total // 2
            pads += [lo, total - lo]
        pad = (pads[0], pads[1], pads[2], pads[3])
    elif mode in ("NOTSET", "VALID"):
        pad = (0, 0, 0, 0) if mode == "VALID" else _pads(c, x.shape[2:], kernel, st, dil)
    else:
        raise c.fail(f"auto_pad ({mode!r}) must be NOTSET, SAME_UPPER, SAME_LOWER or VALID")
    node = c.node("deconv", [x.name], {"k": int(w.shape[1]) * group, "kernel": kernel, "stride": st, "pad": pad,
                                       "dilation": dil, "group": group, "out_pad": extra})
    c.weight(node, "w", w)
    b = c.opt_const(2, "B")
    if b is not None:
        c.weight(node, "bias", b.ravel())


def gemm(c: Ctx) -> None:
    """Gemm (A x B' + C) and MatMul (of a 2-D tensor by a constant) as the IR's fc."""
    x = c.x
    if c.attrs.get("transA", 0) or c.attrs.get("alpha", 1.0) != 1.0 or c.attrs.get("beta", 1.0) != 1.0:
        raise c.fail("only transA=0, alpha=1, beta=1 are supported")
    if c.kind == "MatMul" and (len(x.shape) != 2 or c.ins[0] != x.name):
        raise c.fail(f"only a 2-D tensor (this is {x}) times a constant is supported (a linear layer)")
    w = c.const(1, "B", 2)
    trans = c.kind == "Gemm" and c.attrs.get("transB", 0)
    k = int(w.shape[0] if trans else w.shape[1])
    node = c.node("fc", [x.name], {"k": k})
    c.weight(node, "w", w if trans else w.T)
    b = c.opt_const(2, "C")
    if b is not None:
        if b.size not in (1, k):
            raise c.fail(f"C has shape {b.shape}: only a bias of {k} values (or one) is supported")
        c.weight(node, "bias", np.broadcast_to(b.ravel(), (k,)))


# -- elementwise ------------------------------------------------------------------------------------

def relu(c: Ctx) -> None:
    c.node("relu", [c.x.name], {"slope": float(c.attrs.get("alpha", 0.01)) if c.kind == "LeakyRelu" else 0.0})


def clip(c: Ctx) -> None:
    """Clip with min 0 is a (clipped) ReLU (ReLU6 with max 6); other bounds an act clip."""
    bounds = []
    for i, key in ((1, "min"), (2, "max")):
        v = c.opt_const(i, key)
        bounds.append(float(v) if v is not None else (float(c.attrs[key]) if key in c.attrs else None))
    lo, hi = bounds
    if lo == 0.0:
        c.node("relu", [c.x.name], {"slope": 0.0, "clip": hi})
    else:
        c.node("act", [c.x.name], {"fn": "clip", "lo": lo, "hi": hi})


def activation(c: Ctx) -> None:
    """Sigmoid, Tanh, HardSigmoid, HardSwish, Mish (opset 18), Softplus; Swish (opset 24) of alpha 1 (SiLU);
    Gelu (opset 20), the exact form."""
    if c.kind == "Swish" and float(c.attrs.get("alpha", 1.0)) != 1.0:
        raise c.fail(f"alpha ({c.attrs['alpha']}) must be 1 (SiLU)")
    if c.kind == "Gelu" and c.text("approximate", "none") != "none":
        raise c.fail(f"approximate ({c.text('approximate', '')!r}) must be none (the exact, erf GELU)")
    fn = {"Sigmoid": "sigmoid", "Tanh": "tanh", "HardSigmoid": "hardsigmoid", "HardSwish": "hardswish",
          "Swish": "silu", "Gelu": "gelu", "Mish": "mish", "Softplus": "softplus"}[c.kind]
    attrs: dict[str, Any] = {"fn": fn}
    if fn == "hardsigmoid":
        attrs.update(alpha=float(c.attrs.get("alpha", 0.2)), beta=float(c.attrs.get("beta", 0.5)))
    c.node("act", [c.x.name], attrs)


def arithmetic(c: Ctx) -> None:
    """Add / Sum of equal tensors: the IR's add (fused into convs as a residual); otherwise a
    broadcasting binary op of two tensors or of a tensor and a constant."""
    acts = c.tensors()
    x = c.x
    if len(c.ins) == 1:  # a Sum of one tensor: that tensor
        return
    fn = {"Add": "add", "Sum": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}[c.kind]
    if fn == "add" and len(acts) == len(c.ins) and all(c.shapes[t].shape == x.shape for t in acts):
        c.node("add", acts)
        return
    if len(c.ins) != 2:
        raise c.fail(f"inputs ({c.ins}) must be tensors of one shape, or two operands")
    if len(acts) == 2:
        other = c.shapes[acts[1]]
        if len(other.shape) != len(x.shape):
            raise c.fail(f"inputs {x} and {other} must have the same rank")
        c.node("binary", acts, {"fn": fn})
        return
    swap = c.ins[0] != x.name
    b = np.asarray(c.consts[c.ins[0 if swap else 1]], np.float64)
    if b.ndim > len(x.shape):
        raise c.fail(f"constant of shape {b.shape} has a higher rank than the tensor {x}")
    node = c.node("binary", [x.name], {"fn": fn, "swap": swap})
    c.weight(node, "b", b.reshape((1,) * (len(x.shape) - b.ndim) + b.shape))


# -- pooling and reductions ---------------------------------------------------------------------------

def pool(c: Ctx) -> None:
    x = c.x
    if len(c.attrs.get("dilations", [1, 1])) == 2 and c.ints("dilations", 2, (1, 1)) != (1, 1):
        raise c.fail(f"dilations ({c.attrs['dilations']}) are not supported")
    if len(x.shape) != 4:
        raise c.fail(f"input {x} must be n:c:y:x")
    kernel, st = c.ints("kernel_shape", 2, ()), c.ints("strides", 2, (1, 1))
    c.node("pool", [x.name], {"kind": "max" if c.kind == "MaxPool" else "avg", "kernel": kernel, "stride": st,
                              "pad": _pads(c, x.shape[2:], kernel, st, (1, 1)),
                              "ceil": bool(c.attrs.get("ceil_mode", 0)),
                              "count_pad": bool(c.attrs.get("count_include_pad", 0))})


def global_pool(c: Ctx) -> None:
    c.node("pool", [c.x.name], {"kind": "avg" if "Average" in c.kind else "max", "global": True})


def reduce(c: Ctx) -> None:
    """ReduceMean / ReduceMax over H and W: a global pool (then a flatten without keepdims)."""
    x = c.x
    axes_in = c.opt_const(1, "axes")
    axes = [int(a) for a in (axes_in if axes_in is not None else c.attrs.get("axes", []))]
    if sorted(a % len(x.shape) for a in axes) != [2, 3] or len(x.shape) != 4:
        raise c.fail(f"axes ({axes or 'all'}) of {x} must be the height and width (2, 3): "
                     "only spatial reductions are supported")
    kind = "avg" if c.kind == "ReduceMean" else "max"
    if c.attrs.get("keepdims", 1):
        c.node("pool", [x.name], {"kind": kind, "global": True})
        return
    first = c.node("pool", [x.name], {"kind": kind, "global": True}, part="pool")
    c.node("flatten", [first.output])


# -- shapes -----------------------------------------------------------------------------------------------

def view(c: Ctx, target: list[int], x: Tensor, asked: list[int] | None = None) -> None:
    """A reshape of ``x`` to ``target`` (no copy): nothing when it keeps the shape, a flatten to
    (N, -1), or a 4-D view keeping the batch; anything else refused (naming ``asked``, the shape
    as the model gave it)."""
    n, rest = x.shape[0], x.size // x.shape[0]
    if tuple(target) == x.shape:
        return
    if len(target) == 2 and target[0] == n and target[1] == rest:
        c.node("flatten", [x.name])
    elif len(target) == 4 and target[0] == n and math.prod(target) == x.size:
        c.node("reshape", [x.name], {"shape": tuple(target[1:])})
    else:
        raise c.fail(f"shape ({asked or target}) must flatten the input {x} to ({n}, {rest}) (e.g. [{n}, -1]) "
                     "or be a 4-D view keeping the batch; other reshapes are not supported")


def reshape(c: Ctx) -> None:
    x = c.x
    shape = [int(v) for v in c.const(1, "shape", 1)]
    allowzero = bool(c.attrs.get("allowzero", 0))
    target = [x.shape[i] if v == 0 and not allowzero and i < len(x.shape) else v for i, v in enumerate(shape)]
    if target.count(-1) == 1:
        known = math.prod(v for v in target if v != -1)
        target[target.index(-1)] = x.size // known if known and x.size % known == 0 else -1
    if -1 in target or math.prod(target) != x.size or any(v < 1 for v in target):
        target = []  # refused by view, naming the shape
    view(c, target, x, shape)


def flatten(c: Ctx) -> None:
    x = c.x
    if c.axis(1, x) != 1:
        raise c.fail(f"axis ({c.attrs['axis']}) must be 1")
    view(c, [x.shape[0], x.size // x.shape[0]], x)


def squeeze(c: Ctx) -> None:
    """Squeeze / Unsqueeze as views (e.g. (N, C, 1, 1) <-> (N, C))."""
    x = c.x
    given = c.opt_const(1, "axes")
    axes = [int(a) for a in (given if given is not None else c.attrs.get("axes", []))]
    shape = list(x.shape)
    if c.kind == "Squeeze":
        drop = {a % len(shape) for a in axes} if axes else {i for i, v in enumerate(shape) if v == 1}
        if any(shape[a] != 1 for a in drop):
            raise c.fail(f"axes ({axes}) of {x} are not all 1")
        target = [v for i, v in enumerate(shape) if i not in drop]
    else:
        rank = len(shape) + len(axes)
        target = shape[:]
        for a in sorted(a % rank for a in axes):
            target.insert(a, 1)
    view(c, target, x)


def concat(c: Ctx) -> None:
    acts = c.tensors()
    if len(acts) != len(c.ins):
        raise c.fail("concatenating a constant is not supported (only tensors)")
    c.node("concat", acts, {"axis": c.axis(1, c.x)})


def softmax(c: Ctx) -> None:
    x = c.x
    if c.axis(-1, x) != 1:
        raise c.fail(f"axis ({c.attrs.get('axis', -1)}) of the {len(x.shape)}-D input {x} must be the channels "
                     "(axis 1, or -1 of a 2-D input): softmax runs over channels only")
    c.node("softmax", [x.name])


# -- resize and pad --------------------------------------------------------------------------------------------

_COORDS = ("asymmetric", "half_pixel", "pytorch_half_pixel", "align_corners")


def resize(c: Ctx) -> None:
    """Resize (and the older Upsample: asymmetric, nearest rounding down) of H and W, nearest or
    linear, by constant ``scales`` or ``sizes``."""
    x = c.x
    if len(x.shape) != 4:
        raise c.fail(f"input {x} must be n:c:y:x")
    mode = c.text("mode", "nearest")
    mode = "linear" if mode == "bilinear" else mode
    if c.kind == "Upsample":
        coord, nearest = "asymmetric", "floor"
        scales = c.opt_const(1, "scales")
        scales = np.asarray(c.attrs["scales"] if scales is None and "scales" in c.attrs else scales)
        sizes = None
    else:
        coord, nearest = c.text("coordinate_transformation_mode", "half_pixel"), c.text("nearest_mode",
                                                                                           "round_prefer_floor")
        scales, sizes = c.opt_const(2, "scales"), c.opt_const(3, "sizes")
        if scales is not None and scales.size == 0:
            scales = None
    if mode not in ("nearest", "linear"):
        raise c.fail(f"mode ({mode!r}) must be nearest or linear (cubic is not supported)")
    if coord not in _COORDS:
        raise c.fail(f"coordinate_transformation_mode ({coord!r}) must be one of {', '.join(_COORDS)}")
    if c.attrs.get("exclude_outside", 0) and mode == "nearest":
        raise c.fail("exclude_outside=1 is not supported with nearest")
    if c.text("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise c.fail(f"keep_aspect_ratio_policy ({c.text('keep_aspect_ratio_policy', '')!r}) must be stretch")
    (p, q), (sh, sw) = _resize_extent(c, x, scales, sizes)
    if c.attrs.get("antialias", 0) and min(sh, sw) < 1:
        raise c.fail("antialias=1 when downsampling is not supported")
    c.node("resize", [x.name], {"mode": mode, "coord": coord, "nearest": nearest, "size": (p, q), "scale": (sh, sw)})


def _resize_extent(c: Ctx, x: Tensor, scales: Any, sizes: Any) -> tuple[tuple[int, int], tuple[float, float]]:
    """((P, Q), (scale H, scale W)) of a resize: from ``sizes`` (the scale then output / input) or
    ``scales`` (the output floor(input * scale)), on N, C, H, W (or ``axes``)."""
    if (scales is None) == (sizes is None):
        raise c.fail("give one of scales and sizes")
    vals = [float(v) for v in np.asarray(sizes if scales is None else scales).ravel()]
    axes = [int(a) % 4 for a in c.attrs.get("axes", range(4))]
    if len(vals) != len(axes):
        raise c.fail(f"{'sizes' if scales is None else 'scales'} ({vals}) must have one value per axis {axes}")
    full = dict(zip(axes, vals, strict=True))
    if scales is None:
        ext = [int(full.get(i, x.shape[i])) for i in range(4)]
        if ext[:2] != list(x.shape[:2]) or min(ext) < 1:
            raise c.fail(f"sizes ({vals}) must keep the batch and channels of {x} and be >= 1")
        return (ext[2], ext[3]), (ext[2] / x.shape[2], ext[3] / x.shape[3])
    sc = [full.get(i, 1.0) for i in range(4)]
    if sc[:2] != [1.0, 1.0] or min(sc) <= 0:
        raise c.fail(f"scales ({vals}) must be 1 on the batch and channels and > 0")
    p, q = int(sc[2] * x.shape[2]), int(sc[3] * x.shape[3])
    if min(p, q) < 1:
        raise c.fail(f"scales ({vals}) leave no output of {x}")
    return (p, q), (sc[2], sc[3])


def pad(c: Ctx) -> None:
    """Pad of H and W by non-negative amounts, constant (any value), reflect or edge."""
    x = c.x
    if len(x.shape) != 4:
        raise c.fail(f"input {x} must be n:c:y:x")
    given = c.opt_const(1, "pads")
    pads = [int(v) for v in (given if given is not None else c.attrs.get("pads", []))]
    axes_in = c.opt_const(3, "axes")
    axes = [int(a) % 4 for a in axes_in] if axes_in is not None else list(range(4))
    if len(pads) != 2 * len(axes):
        raise c.fail(f"pads ({pads}) must hold a begin and an end for each axis {axes}")
    begin, end = dict(zip(axes, pads[:len(axes)], strict=True)), dict(zip(axes, pads[len(axes):], strict=True))
    if any(begin.get(a, 0) or end.get(a, 0) for a in (0, 1)) or min(pads, default=0) < 0:
        raise c.fail(f"pads ({pads}) must be >= 0 and pad only the height and width")
    mode = c.text("mode", "constant")
    if mode not in ("constant", "reflect", "edge"):
        raise c.fail(f"mode ({mode!r}) must be constant, reflect or edge")
    value = c.opt_const(2, "constant_value")
    c.node("pad", [x.name], {"pad": (begin.get(2, 0), end.get(2, 0), begin.get(3, 0), end.get(3, 0)),
                             "mode": mode, "value": float(value) if value is not None and value.size else 0.0})


# -- the rest -------------------------------------------------------------------------------------------------

def lrn(c: Ctx) -> None:
    c.node("lrn", [c.x.name], {"size": int(c.attrs["size"]), "alpha": float(c.attrs.get("alpha", 1e-4)),
                               "beta": float(c.attrs.get("beta", 0.75)), "k": float(c.attrs.get("bias", 1.0))})


def batchnorm(c: Ctx) -> None:
    if c.attrs.get("training_mode", 0):
        raise c.fail("training_mode=1 is not supported (inference only)")
    node = c.node("batchnorm", [c.x.name], {"eps": float(c.attrs.get("epsilon", 1e-5))})
    for i, role in enumerate(("gamma", "beta", "mean", "var"), start=1):
        c.weight(node, role, c.const(i, role))


HANDLERS: dict[str, Handler] = {
    "Conv": conv, "ConvTranspose": conv_transpose, "Gemm": gemm, "MatMul": gemm, "Relu": relu, "LeakyRelu": relu,
    "Clip": clip, "Sigmoid": activation, "Tanh": activation, "HardSigmoid": activation, "HardSwish": activation,
    "Mish": activation, "Softplus": activation,
    "Swish": activation, "Gelu": activation,
    "MaxPool": pool, "AveragePool": pool, "GlobalAveragePool": global_pool, "GlobalMaxPool": global_pool,
    "ReduceMean": reduce, "ReduceMax": reduce, "LRN": lrn, "BatchNormalization": batchnorm,
    "Add": arithmetic, "Sub": arithmetic, "Mul": arithmetic, "Div": arithmetic, "Sum": arithmetic,
    "Concat": concat, "Softmax": softmax, "Flatten": flatten, "Reshape": reshape, "Squeeze": squeeze,
    "Unsqueeze": squeeze, "Resize": resize, "Upsample": resize, "Pad": pad,
}
assert set(HANDLERS) | {"Dropout", "Identity"} == set(SPEC)
