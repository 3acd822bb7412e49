"""ONNX front-end (extra ``[onnx]``): a model into the IR, initializers as weights (opset 13+).

The ops read are :data:`SUPPORTED_OPS` (graph/onnx_ops.py, one handler each; docs/ONNX.md says
what each supports): what ``torch.onnx.export`` writes for classic and modern CNNs (EfficientNet,
MobileNet-v3, YOLO-style detectors, UNets). A node whose inputs are all constants (Constant, Shape
of a tensor whose shape is known, Gather, Cast, Concat of shapes, ...) is evaluated at load time by
``onnx.reference`` and its outputs become constants. A node missing a required input or attribute,
or asking for what the runtime does not compute, is refused with a GraphError naming it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from convforge.files import InputFileError, read_bounded
from convforge.graph import onnx_ops
from convforge.graph.ir import Graph, GraphError, Node, Tensor, check_weights, infer, infer_node, input_shape
from convforge.graph.onnx_ops import SUPPORTED_OPS

__all__ = ["SUPPORTED_OPS", "load_onnx"]

_SPEC = onnx_ops.SPEC


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
    consts = dict(inits)
    for i, op in enumerate(g.node):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in op.attribute}
        name = op.name or f"{op.op_type}_{i}"
        ins = [alias.get(t, t) for t in op.input]  # "" stays: an optional input left out
        if _fold(op, attrs, ins, consts, shapes, opset):
            continue
        _check_node(f"node {name!r} ({op.op_type})", op, attrs)
        if op.op_type in ("Dropout", "Identity"):
            alias[op.output[0]] = ins[0]
            continue
        ctx = onnx_ops.Ctx(graph, consts, shapes, name, op.op_type, attrs, ins, op.output[0])
        try:
            onnx_ops.HANDLERS[op.op_type](ctx)
        except GraphError as err:  # name the node's ONNX tensors: a shape error names the IR's weight keys
            raise GraphError(f"{err} (ONNX node {name!r} reads {', '.join(repr(t) for t in op.input if t)})") from None
        if not ctx.nodes:  # a view that changes nothing
            alias[op.output[0]] = ctx.x.name
        for node in ctx.nodes:
            try:
                shapes[node.output] = infer_node(graph, node, shapes)
            except GraphError as err:
                raise GraphError(f"{err} (ONNX node {name!r} reads "
                                 f"{', '.join(repr(t) for t in op.input if t)})") from None
            graph.nodes.append(node)
    names = [o.name for o in g.output]
    for name in names:
        if alias.get(name, name) in consts:
            raise GraphError(f"onnx: output {name!r} is a constant (computed from initializers only)")
    graph.outputs = _declared_outputs(graph, names, alias)
    infer(graph)
    check_weights(graph)
    return graph


def _fold(op: Any, attrs: dict[str, Any], ins: list[str], consts: dict[str, np.ndarray],
          shapes: dict[str, Tensor], opset: int) -> bool:
    """Evaluate ``op`` at load time when it computes constants (every input a constant, a Constant,
    or the Shape / Size of a tensor whose shape is known), its outputs then constants; False when it
    computes on activations."""
    given = [t for t in ins if t]
    if op.op_type in ("Shape", "Size") and given and given[0] in shapes:
        shape = np.array(shapes[given[0]].shape, np.int64)
        if op.op_type == "Size":
            consts[op.output[0]] = np.array(shape.prod(), np.int64)
        else:
            n = len(shape)
            start, end = int(attrs.get("start", 0)), int(attrs.get("end", n))
            consts[op.output[0]] = shape[start % n if start < 0 else start:end % n if end < 0 else end]
        return True
    if op.op_type != "Constant" and (not given or not all(t in consts for t in given)):
        return False
    from onnx.reference import ReferenceEvaluator

    where = f"node {op.name or op.op_type!r} ({op.op_type})"
    try:
        feeds = {t: consts[t] for t in given}
        node = _renamed(op, ins)
        outs = ReferenceEvaluator(node, opsets={"": opset}).run(None, feeds)
    except Exception as err:  # noqa: BLE001 - whatever onnx.reference cannot evaluate is refused by name
        raise GraphError(f"{where}: its inputs are constants, but evaluating it failed ({err})") from None
    for name, value in zip(op.output, outs, strict=False):
        if name:
            consts[name] = np.asarray(value)
    return True


def _renamed(op: Any, ins: list[str]) -> Any:
    """A copy of NodeProto ``op`` reading ``ins`` (aliases resolved)."""
    node = type(op)()
    node.CopyFrom(op)
    del node.input[:]
    node.input.extend(ins)
    return node


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
        raise GraphError(f"{where}: unknown ONNX op type {op.op_type!r}; supported: "
                         f"{', '.join(SUPPORTED_OPS)} (and any op whose inputs are all constants)")
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
