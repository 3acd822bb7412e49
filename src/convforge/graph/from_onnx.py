"""ONNX front-end (extra ``[onnx]``): a model into the IR, initializers as weights (opset 13+).

Ops: Conv, Gemm, MatMul (by an initializer), Relu, LeakyRelu, Clip, MaxPool, AveragePool,
GlobalAveragePool, GlobalMaxPool, LRN, BatchNormalization, Add, Concat, Softmax (over channels),
Flatten, Reshape (to N x -1), Dropout, Identity. A node missing a required input or attribute,
or asking for what the runtime does not compute, is refused with a GraphError naming it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from convforge.files import InputFileError, read_bounded
from convforge.graph.ir import Graph, GraphError, Node, Tensor, check_weights, infer, input_shape

# Per op type: the fewest and most inputs (optional ones may be left empty, "") and the
# attributes ONNX requires. The first ``fewest`` inputs must be given.
_SPEC: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "Conv": (2, 3, ()), "Gemm": (2, 3, ()), "MatMul": (2, 2, ()), "Relu": (1, 1, ()),
    "LeakyRelu": (1, 1, ()), "Clip": (1, 3, ()), "MaxPool": (1, 1, ("kernel_shape",)),
    "AveragePool": (1, 1, ("kernel_shape",)), "GlobalAveragePool": (1, 1, ()),
    "GlobalMaxPool": (1, 1, ()), "LRN": (1, 1, ("size",)), "BatchNormalization": (5, 5, ()),
    "Add": (2, 2, ()), "Sum": (1, 2**31, ()), "Concat": (1, 2**31, ("axis",)), "Softmax": (1, 1, ()),
    "Flatten": (1, 1, ()), "Reshape": (2, 2, ()), "Dropout": (1, 3, ()), "Identity": (1, 1, ()),
}


def load_onnx(model: Any, input_size: int | None = None, batch: int | None = None) -> Graph:
    """The IR of an ONNX ModelProto (or a path to one). A symbolic height or width needs
    ``input_size``; a symbolic batch is 1 unless ``batch`` is given."""
    model, what = _read(model)
    try:
        return _translate(model, what, input_size, batch)
    except GraphError as err:  # the file in front, where it is one and the message does not name it
        if what == "the model" or what in str(err):
            raise
        raise GraphError(f"onnx: {what}: {str(err).removeprefix('onnx: ')}") from None


def _translate(model: Any, what: str, input_size: int | None, batch: int | None) -> Graph:
    """The IR of a read ModelProto (``what`` names it in errors)."""
    import onnx
    from onnx import numpy_helper

    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < 13:
        raise GraphError(f"onnx: {what}: opset ({opset}) must be 13 or later")
    g = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    real = [i for i in g.input if i.name not in inits]
    if len(real) != 1:
        raise GraphError(f"onnx: the graph must have one input, it has {[i.name for i in real]}")
    graph = Graph(g.name or "onnx", real[0].name, _input_dims(real[0], input_size, batch), [], [])
    shapes = _infer_so_far(graph)
    alias: dict[str, str] = {}
    for i, op in enumerate(g.node):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in op.attribute}
        name = op.name or f"{op.op_type}_{i}"
        _check_node(f"node {name!r} ({op.op_type})", op, attrs)
        ins = [alias.get(t, t) for t in op.input]  # "" stays: an optional input left out
        if op.op_type in ("Dropout", "Identity"):
            alias[op.output[0]] = ins[0]
            continue
        try:
            node = _node(name, op.op_type, attrs, ins, inits, graph, shapes)
            node.output = op.output[0]
            graph.nodes.append(node)
            shapes = _infer_so_far(graph)
        except GraphError as err:  # name the node's ONNX tensors: a shape error names the IR's weight keys
            raise GraphError(f"{err} (ONNX node {name!r} reads {', '.join(repr(t) for t in op.input if t)})") from None
    graph.outputs = _declared_outputs(graph, [o.name for o in g.output], alias)
    infer(graph)
    check_weights(graph)
    return graph


def _declared_outputs(graph: Graph, names: list[str], alias: dict[str, str]) -> list[str]:
    """The graph outputs under their declared names. An output that an Identity or Dropout made
    an alias of another tensor gives that tensor its name where it can (a node's output that no
    other declared output names); otherwise an identity node (a view at run time) writes it."""
    for name in names:
        src = alias.get(name, name)
        if src == name:
            continue
        shared = [o for o in names if o != name and alias.get(o, o) == src]
        if graph.producer(src) is not None and not shared and src not in names:
            graph.rename(src, name)
            alias = {k: (name if v == src else v) for k, v in alias.items()}
        else:
            graph.nodes.append(Node(f"{name}/identity", "dropout", [src], name))
    return names


def _read(model: Any) -> tuple[Any, str]:
    """(ModelProto, how to name it in errors) from a ModelProto or a path; a file that is not an
    ONNX model is a GraphError naming it. A path is read as a regular file of at most
    ``files.LIMITS["ONNX model"]``, and its external data only from files in the model's folder."""
    import onnx
    from google.protobuf.message import DecodeError

    what = "the model"
    if isinstance(model, (str, Path)):
        what = str(model)
        try:
            data = read_bounded(model, "ONNX model")
        except (OSError, InputFileError) as err:
            raise GraphError(f"onnx: {err}") from None
        try:
            model = onnx.load_model_from_string(data)
        except (DecodeError, RuntimeError, ValueError) as err:
            raise GraphError(f"onnx: {what} is not an ONNX model ({err})") from None
        for tensor in _tensors(model.graph):
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                _load_external(tensor, Path(what))
    elif not isinstance(model, onnx.ModelProto):
        raise TypeError(f"model ({type(model).__name__}) must be an onnx.ModelProto or a path to one")
    else:
        for tensor in _tensors(model.graph):
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                raise GraphError(f"onnx: tensor {tensor.name!r} keeps its data in an external file: give "
                                 "the model's path, so its data is read from the model's folder")
    if not model.HasField("graph"):
        raise GraphError(f"onnx: {what} holds no ONNX model (no graph)")
    return model, what


def _tensors(graph: Any) -> Iterator[Any]:
    """Every TensorProto of ``graph``: initializers and node attributes, through subgraphs."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def _load_external(tensor: Any, model_path: Path) -> None:
    """Read ``tensor``'s external data into it (raw_data): only from a regular file inside the
    model's folder, named by a relative path without ``..`` and without symbolic links, of the
    tensor's exact size; a GraphError naming the tensor, the file and the model otherwise."""
    import onnx

    info = {e.key: e.value for e in tensor.external_data}
    where = f"onnx: {model_path}: tensor {tensor.name!r}"
    location = info.get("location", "")
    folder = model_path.parent
    if not location:
        raise GraphError(f"{where}: its external data names no file (no 'location')")
    rel = Path(location)
    if rel.is_absolute() or rel.drive or location.startswith(("/", "\\")):
        raise GraphError(f"{where}: its external data file {location!r} is an absolute path; convforge reads "
                         f"external data only from files in the model's folder ({folder})")
    if ".." in rel.parts:
        raise GraphError(f"{where}: its external data file {location!r} leads out of the model's folder "
                         f"({folder}) with '..'; convforge reads external data only from files in that folder")
    step = folder
    for part in rel.parts:
        step = step / part
        if step.is_symlink():
            raise GraphError(f"{where}: its external data file {location!r} goes through a symbolic link "
                             f"({step}); convforge reads external data only from files in the model's folder")
    if not step.exists():
        raise GraphError(f"{where}: its external data file {step} is missing (it must lie beside the model)")
    if not os.path.realpath(step).startswith(os.path.join(os.path.realpath(folder), "")):
        raise GraphError(f"{where}: its external data file {location!r} lies outside the model's folder ({folder})")
    if any(d < 0 for d in tensor.dims):
        raise GraphError(f"{where}: dims ({list(tensor.dims)}) must be >= 0")
    try:
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise GraphError(f"{where}: external data offset / length ({info.get('offset')!r}, "
                         f"{info.get('length')!r}) must be integers") from None
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        raise GraphError(f"{where}: its data type ({tensor.data_type}) cannot be read from external data") from None
    need = int(np.prod(tensor.dims, dtype=np.int64)) * itemsize
    if offset < 0 or (length is not None and length != need):
        raise GraphError(f"{where}: external data at offset {offset} with length {length} does not hold its "
                         f"{list(tensor.dims)} values ({need} bytes)")
    try:
        data = read_bounded(step, "ONNX external data", offset=offset, length=need)
    except (OSError, InputFileError) as err:
        raise GraphError(f"{where}: external data: {err}") from None
    tensor.raw_data = data
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT


def _input_dims(value: Any, input_size: int | None, batch: int | None) -> tuple[int, int, int, int]:
    """The NCHW input shape: fixed dims as given, a symbolic batch 1, a symbolic H or W only
    with ``input_size`` (a guess would silently shrink every tensor)."""
    dims = value.type.tensor_type.shape.dim
    if len(dims) != 4:
        raise GraphError(f"onnx: input {value.name!r} has rank {len(dims)}, expected 4 (N, C, H, W)")
    fixed = [int(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else None for d in dims]
    label = [d.dim_param or "?" if v is None else str(v) for d, v in zip(dims, fixed)]
    if fixed[1] is None:
        raise GraphError(f"onnx: input {value.name!r} ({', '.join(label)}): the channel count must be fixed")
    if input_size is None and None in fixed[2:]:
        raise GraphError(f"onnx: input {value.name!r} ({', '.join(label)}) has a symbolic height or width: "
                         "give the input size (input_size=..., --input-size)")
    n, c, h, w = (1 if v is None else v for v in fixed)
    return input_shape([n, c, h, w], input_size, batch)


def _infer_so_far(graph: Graph) -> dict[str, Tensor]:
    """The tensors of the nodes added so far (their last one the output)."""
    graph.outputs = [graph.nodes[-1].output if graph.nodes else graph.input]
    return infer(graph)


def _check_node(where: str, op: Any, attrs: dict[str, Any]) -> None:
    """A supported op type with its required inputs, attributes and an output, else a GraphError."""
    if op.op_type not in _SPEC:
        raise GraphError(f"{where}: unknown ONNX op type {op.op_type!r}")
    fewest, most, required = _SPEC[op.op_type]
    if not fewest <= len(op.input) <= most:
        want = f"{fewest}" if fewest == most else f"{fewest} or more" if most == 2**31 else f"{fewest} to {most}"
        raise GraphError(f"{where}: inputs ({list(op.input)}) must number {want}")
    empty = [i for i, t in enumerate(op.input[:fewest]) if not t]
    if empty:
        raise GraphError(f"{where}: input {empty[0]} is empty, but it is required")
    for key in required:
        if key not in attrs:
            raise GraphError(f"{where}: attribute {key!r} is missing, but it is required")
    if not op.output or not op.output[0]:
        raise GraphError(f"{where}: has no output")


def _ints(attrs: dict[str, Any], key: str, count: int, default: tuple[int, ...], where: str) -> tuple[int, ...]:
    """An ints attribute of exactly ``count`` values (``default`` when absent)."""
    vals = attrs.get(key, default)
    if not isinstance(vals, (list, tuple)) or len(vals) != count:
        raise GraphError(f"{where}: {key} ({vals!r}) must be {count} ints (2-D only)")
    return tuple(int(v) for v in vals)


def _pads(attrs: dict[str, Any], where: str) -> tuple[int, int, int, int]:
    """ONNX pads (top, left, bottom, right) as the IR's (top, bottom, left, right)."""
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise GraphError(f"{where}: auto_pad ({attrs['auto_pad']!r}) is not supported; give pads")
    t, left, b, r = _ints(attrs, "pads", 4, (0, 0, 0, 0), where)
    return (t, b, left, r)


def _weight(graph: Graph, inits: dict[str, np.ndarray], node: Node, role: str, tensor: str,
            transform: Any = None) -> None:
    if tensor not in inits:
        raise GraphError(f"node {node.name!r} ({node.op}): {role} ({tensor!r}) must be an initializer")
    arr = inits[tensor] if transform is None else transform(inits[tensor])
    key = f"{node.name}.{role}"
    graph.weights[key] = np.ascontiguousarray(arr, dtype=np.float32)
    node.weights[role] = key


def _init(inits: dict[str, np.ndarray], tensor: str, role: str, ndim: int, where: str) -> np.ndarray:
    """Initializer ``tensor`` of rank ``ndim`` (a weight the runtime needs as a constant)."""
    arr = inits.get(tensor)
    if arr is None:
        raise GraphError(f"{where}: {role} ({tensor!r}) must be an initializer")
    if arr.ndim != ndim:
        raise GraphError(f"{where}: {role} ({tensor!r}) has shape {arr.shape}, expected {ndim}-D")
    return arr


def _axis(attrs: dict[str, Any], default: int, x: Tensor) -> int:
    """Attribute ``axis`` made non-negative against the rank of ``x``."""
    axis = int(attrs.get("axis", default))
    return axis + len(x.shape) if axis < 0 else axis


def _node(name: str, kind: str, attrs: dict[str, Any], ins: list[str], inits: dict[str, np.ndarray],
          graph: Graph, shapes: dict[str, Tensor]) -> Node:
    where = f"node {name!r} ({kind})"
    acts = [t for t in ins if t and t not in inits]
    if not acts:
        raise GraphError(f"{where}: no input is a tensor (constants are not folded)")
    if acts[0] not in shapes:
        raise GraphError(f"{where}: input {acts[0]!r} is dangling (no earlier node or graph input produces it)")
    x = shapes[acts[0]]
    node = Node(name, "", acts[:1], name)
    if kind == "Conv":
        w = _init(inits, ins[1], "W", 4, where)
        if "kernel_shape" in attrs and _ints(attrs, "kernel_shape", 2, (), where) != w.shape[2:]:
            raise GraphError(f"{where}: kernel_shape ({attrs['kernel_shape']}) does not match W {w.shape}")
        node.op = "conv"
        node.attrs = {"k": int(w.shape[0]), "kernel": tuple(int(v) for v in w.shape[2:]),
                      "stride": _ints(attrs, "strides", 2, (1, 1), where), "pad": _pads(attrs, where),
                      "dilation": _ints(attrs, "dilations", 2, (1, 1), where), "group": int(attrs.get("group", 1))}
        _weight(graph, inits, node, "w", ins[1])
        if len(ins) > 2 and ins[2]:
            _weight(graph, inits, node, "bias", ins[2])
    elif kind in ("Gemm", "MatMul"):
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            raise GraphError(f"{where}: only transA=0, alpha=1, beta=1 are supported")
        w = _init(inits, ins[1], "B", 2, where)
        trans = kind == "Gemm" and attrs.get("transB", 0)
        node.op, node.attrs = "fc", {"k": int(w.shape[0] if trans else w.shape[1])}
        _weight(graph, inits, node, "w", ins[1], None if trans else np.transpose)
        if len(ins) > 2 and ins[2]:
            _weight(graph, inits, node, "bias", ins[2], np.ravel)
    elif kind in ("Relu", "LeakyRelu"):
        node.op, node.attrs = "relu", {"slope": float(attrs.get("alpha", 0.01)) if kind == "LeakyRelu" else 0.0}
    elif kind == "Clip":
        lo, hi = (float(inits[t]) if t in inits else None for t in (ins + ["", ""])[1:3])
        if lo != 0.0:
            raise GraphError(f"{where}: min ({lo}) must be 0 (a clipped ReLU)")
        node.op, node.attrs = "relu", {"slope": 0.0, "clip": hi}
    elif kind in ("MaxPool", "AveragePool"):
        if _ints(attrs, "dilations", 2, (1, 1), where) != (1, 1):
            raise GraphError(f"{where}: dilations ({attrs['dilations']}) are not supported")
        node.op = "pool"
        node.attrs = {"kind": "max" if kind == "MaxPool" else "avg",
                      "kernel": _ints(attrs, "kernel_shape", 2, (), where),
                      "stride": _ints(attrs, "strides", 2, (1, 1), where), "pad": _pads(attrs, where),
                      "ceil": bool(attrs.get("ceil_mode", 0)), "count_pad": bool(attrs.get("count_include_pad", 0))}
    elif kind in ("GlobalAveragePool", "GlobalMaxPool"):
        node.op, node.attrs = "pool", {"kind": "avg" if "Average" in kind else "max", "global": True}
    elif kind == "LRN":
        node.op = "lrn"
        node.attrs = {"size": int(attrs["size"]), "alpha": float(attrs.get("alpha", 1e-4)),
                      "beta": float(attrs.get("beta", 0.75)), "k": float(attrs.get("bias", 1.0))}
    elif kind == "BatchNormalization":
        node.op, node.attrs = "batchnorm", {"eps": float(attrs.get("epsilon", 1e-5))}
        for role, t in zip(("gamma", "beta", "mean", "var"), ins[1:5], strict=True):
            _weight(graph, inits, node, role, t)
    elif kind in ("Add", "Sum"):
        if len(acts) != len(ins):
            raise GraphError(f"{where}: adding an initializer is not supported (only tensors)")
        node.op, node.inputs = "add", acts
    elif kind == "Concat":
        node.op, node.inputs, node.attrs = "concat", acts, {"axis": int(attrs["axis"])}
    elif kind == "Softmax":
        if _axis(attrs, -1, x) != 1:
            raise GraphError(f"{where}: axis ({attrs.get('axis', -1)}) of the {len(x.shape)}-D input {x} must be "
                             "the channels (axis 1, or -1 of a 2-D input): softmax runs over channels only")
        node.op = "softmax"
    elif kind in ("Flatten", "Reshape"):
        if kind == "Flatten" and _axis(attrs, 1, x) != 1:
            raise GraphError(f"{where}: axis ({attrs['axis']}) must be 1")
        if kind == "Reshape":
            _flattens(where, _init(inits, ins[1], "shape", 1, where), x, bool(attrs.get("allowzero", 0)))
        node.op = "flatten"
    return node


def _flattens(where: str, shape: np.ndarray, x: Tensor, allowzero: bool) -> None:
    """Refuse a Reshape target other than (N, -1) of ``x``: the runtime only flattens."""
    n, rest = x.shape[0], x.size // x.shape[0]
    s = [int(v) for v in shape]
    keep = (0,) if not allowzero else ()  # 0 copies the input's dim unless allowzero
    if len(s) != 2 or s[0] not in (-1, n, *keep) or s[1] not in (-1, rest) or s == [-1, -1]:
        raise GraphError(f"{where}: shape ({s}) must flatten the input {x} to ({n}, {rest}) "
                         f"(e.g. [{n}, -1]); other reshapes are not supported")
