"""Caffe front-end: a ``.prototxt`` net into the IR, weights from a ``.caffemodel`` or random.

Layer types: Input, Convolution, InnerProduct, Pooling, LRN, ReLU, Dropout, Softmax, Concat,
Eltwise (SUM), BatchNorm, Scale, Flatten. In-place layers (top == bottom) get fresh tensor names,
since IR tensors are written once.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from convforge.files import InputFileError, read_bounded
from convforge.graph.ir import Graph, GraphError, Node, check_weights, conv_group, infer, input_shape
from convforge.graph.prototxt import Message, one, parse


def load_prototxt(source: str | Path, weights: str | Path | None = None, seed: int = 0,
                  input_size: int | None = None, batch: int | None = None) -> Graph:
    """The IR of a Caffe net (a path or the text itself); ``weights`` a .caffemodel, else random."""
    if _is_path(source):
        try:
            data = read_bounded(source, "prototxt")
        except (OSError, InputFileError) as err:
            raise GraphError(f"prototxt: {err}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise GraphError(f"prototxt {source}: not UTF-8 text (byte {err.start}); is it a binary file?") from None
        net = parse(text, f"prototxt {source}")
    else:
        net = parse(str(source))
    try:
        graph = _translate(net, input_size, batch)
    except GraphError as err:
        raise _in_file(err, "prototxt", source if _is_path(source) else None) from None
    blobs = read_caffemodel(Path(weights)) if weights is not None else None
    try:
        fill_weights(graph, seed, blobs)
        check_weights(graph)
    except GraphError as err:
        where = ("caffemodel", weights) if weights is not None else ("prototxt", source if _is_path(source) else None)
        raise _in_file(err, *where) from None
    return graph


def _in_file(err: GraphError, kind: str, path: str | Path | None) -> GraphError:
    """``err`` with the file it came from in front (unless it names it already)."""
    text = str(err)
    if path is None or str(path) in text:
        return err
    return GraphError(f"{kind} {path}: {text.removeprefix(f'{kind}: ')}")


def _is_path(source: str | Path) -> bool:
    return isinstance(source, Path) or ("\n" not in source and source.endswith((".prototxt", ".pt")))


def _input(net: Message) -> tuple[str, list[int]]:
    if "input" in net:
        dims = net.get("input_dim") or (one(net, "input_shape") or {}).get("dim", [])
        return str(net["input"][0]), _dims(f"prototxt: input {net['input'][0]!r}", dims)
    for layer in net.get("layer", []):
        if one(layer, "type") in ("Input", "Data", "ImageData"):
            where = f"layer {one(layer, 'name')!r} ({one(layer, 'type')})"
            shape = one(_param(where, layer, "input_param"), "shape", {})
            return str(one(layer, "top")), _dims(where, shape.get("dim", []))
    raise GraphError("prototxt: no input (an 'input:' field or an Input layer)")


def _translate(net: Message, input_size: int | None, batch: int | None) -> Graph:
    name, dims = _input(net)
    if len(dims) != 4:
        raise GraphError(f"prototxt: input {name!r} dims ({dims}) must be 4 (N, C, H, W)")
    graph = Graph(str(one(net, "name", "net")), name, input_shape(dims, input_size, batch), [], [])
    current = {name: name}  # caffe blob -> IR tensor now holding it
    if "layers" in net and "layer" not in net:
        raise GraphError("prototxt: V1 'layers' are not supported (upgrade the net to 'layer')")
    for layer in net.get("layer", []):
        ltype = str(one(layer, "type"))
        if ltype in ("Input", "Data", "ImageData"):
            continue
        lname = str(one(layer, "name"))
        bottoms = [str(b) for b in layer.get("bottom", [])]
        tops = [str(t) for t in layer.get("top", [])]
        if len(tops) != 1:
            raise GraphError(f"layer {lname!r} ({ltype}): top ({tops}) must name one blob")
        for b in bottoms:
            if b not in current:
                raise GraphError(f"layer {lname!r} ({ltype}): bottom {b!r} is dangling")
        node = _node(lname, ltype, layer, [current[b] for b in bottoms])
        node.output = lname if tops[0] in current or tops[0] in bottoms else tops[0]
        if any(n.output == node.output for n in graph.nodes):
            node.output = f"{lname}#{len(graph.nodes)}"
        graph.nodes.append(node)
        current[tops[0]] = node.output
    consumed = {t for n in graph.nodes for t in n.inputs}
    graph.outputs = [n.output for n in graph.nodes if n.output not in consumed][-1:]
    _name_outputs_by_blob(graph, current)
    return graph


def _name_outputs_by_blob(graph: Graph, current: dict[str, str]) -> None:
    """An output written by an in-place layer (top == bottom) carries its blob's name, as Caffe
    declares it: the blob's earlier tensor (the first writer's) is renamed out of the way."""
    for blob, tensor in current.items():
        if tensor == blob or tensor not in graph.outputs or blob == graph.input:
            continue
        taken = {graph.input} | {n.output for n in graph.nodes}
        fresh = next(f"{blob}#{i}" for i in range(len(graph.nodes) + 1) if f"{blob}#{i}" not in taken)
        graph.rename(blob, fresh)
        graph.rename(tensor, blob)


def _dims(where: str, dims: list[Any]) -> list[int]:
    """Input dims, each a positive int."""
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise GraphError(f"{where}: dims ({dims}) must be positive ints")
    return list(dims)


def _int(where: str, p: Message, key: str, default: int | None, least: int) -> int:
    """Field ``key`` of ``p`` as an int >= ``least`` (``default`` when absent; None: required)."""
    v = one(p, key, default)
    if v is None:
        raise GraphError(f"{where}: {key} is missing, but it is required")
    if not isinstance(v, int) or isinstance(v, bool):
        raise GraphError(f"{where}: {key} ({v!r}) must be an int")
    if v < least:
        raise GraphError(f"{where}: {key} ({v}) must be >= {least}")
    return v


def _float(where: str, p: Message, key: str, default: float) -> float:
    """Field ``key`` of ``p`` as a finite float (``default`` when absent)."""
    v = one(p, key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v):
        raise GraphError(f"{where}: {key} ({v!r}) must be a finite number")
    return float(v)


def _param(where: str, layer: Message, key: str) -> Message:
    """Sub-message ``key`` of a layer (empty when absent)."""
    p = one(layer, key, {})
    if not isinstance(p, dict):
        raise GraphError(f"{where}: {key} ({p!r}) must be a message {{ ... }}")
    return p


def _pair(where: str, p: Message, key: str, default: int, least: int) -> tuple[int, int]:
    """Caffe's kernel_size/stride/pad: repeated (one or two values), or *_h/*_w, or one value."""
    if f"{key}_h" in p or f"{key}_w" in p:
        return _int(where, p, f"{key}_h", default, least), _int(where, p, f"{key}_w", default, least)
    field = key if key in p else f"{key}_size"
    vals = p.get(field) or [default]
    if len(vals) > 2:
        raise GraphError(f"{where}: {field} ({vals}) must be one or two values (2-D only)")
    h, w = (_int(where, {field: [v]}, field, default, least) for v in (vals[0], vals[-1]))
    return h, w


def _node(lname: str, ltype: str, layer: Message, ins: list[str]) -> Node:
    node = Node(lname, "", ins, lname)
    where = f"layer {lname!r} ({ltype})"
    if ltype == "Convolution":
        p = _param(where, layer, "convolution_param")
        ph, pw = _pair(where, p, "pad", 0, 0)
        node.op = "conv"
        node.attrs = {"k": _int(where, p, "num_output", None, 1), "kernel": _pair(where, p, "kernel", 1, 1),
                      "stride": _pair(where, p, "stride", 1, 1), "pad": (ph, ph, pw, pw),
                      "dilation": _pair(where, p, "dilation", 1, 1), "group": _int(where, p, "group", 1, 1)}
        node.weights = {"w": f"{lname}.w"}
        if one(p, "bias_term", True):
            node.weights["bias"] = f"{lname}.bias"
    elif ltype == "InnerProduct":
        p = _param(where, layer, "inner_product_param")
        node.op, node.attrs, node.weights = "fc", {"k": _int(where, p, "num_output", None, 1)}, {"w": f"{lname}.w"}
        if one(p, "bias_term", True):
            node.weights["bias"] = f"{lname}.bias"
    elif ltype == "Pooling":
        p = _param(where, layer, "pooling_param")
        kind = str(one(p, "pool", "MAX"))
        if kind not in ("MAX", "AVE"):
            raise GraphError(f"layer {lname!r} (Pooling): pool ({kind!r}) must be MAX or AVE")
        ph, pw = _pair(where, p, "pad", 0, 0)
        node.op = "pool"
        node.attrs = {"kind": "max" if kind == "MAX" else "avg", "kernel": _pair(where, p, "kernel", 1, 1),
                      "stride": _pair(where, p, "stride", 1, 1), "pad": (ph, ph, pw, pw), "ceil": True,
                      "global": bool(one(p, "global_pooling", False)), "count_pad": True}
    elif ltype == "LRN":
        p = _param(where, layer, "lrn_param")
        if str(one(p, "norm_region", "ACROSS_CHANNELS")) != "ACROSS_CHANNELS":
            raise GraphError(f"layer {lname!r} (LRN): norm_region ({one(p, 'norm_region')!r}) must be ACROSS_CHANNELS")
        node.op = "lrn"
        node.attrs = {"size": _int(where, p, "local_size", 5, 1), "alpha": _float(where, p, "alpha", 1.0),
                      "beta": _float(where, p, "beta", 0.75), "k": _float(where, p, "k", 1.0)}
    elif ltype in ("ReLU", "ReLU6"):
        p = _param(where, layer, "relu_param")
        node.op, node.attrs = "relu", {"slope": _float(where, p, "negative_slope", 0.0)}
        if ltype == "ReLU6":
            node.attrs["clip"] = 6.0
    elif ltype == "Eltwise":
        p = _param(where, layer, "eltwise_param")
        if str(one(p, "operation", "SUM")) != "SUM" or p.get("coeff"):
            raise GraphError(f"layer {lname!r} (Eltwise): only operation SUM without coeff is supported")
        node.op = "add"
    elif ltype == "Concat":
        p = _param(where, layer, "concat_param")
        node.op, node.attrs = "concat", {"axis": _int(where, p, "axis", 1, -4)}
    elif ltype == "BatchNorm":
        p = _param(where, layer, "batch_norm_param")
        node.op, node.attrs = "batchnorm", {"eps": _float(where, p, "eps", 1e-5)}
        node.weights = {"mean": f"{lname}.mean", "var": f"{lname}.var"}
    elif ltype == "Scale":
        p = _param(where, layer, "scale_param")
        node.op, node.weights = "scale", {"gamma": f"{lname}.gamma"}
        if one(p, "bias_term", False):
            node.weights["beta"] = f"{lname}.beta"
    elif ltype in ("Softmax", "Dropout", "Flatten"):
        p = _param(where, layer, f"{ltype.lower()}_param")
        if _int(where, p, "axis", 1, -4) != 1:
            raise GraphError(f"{where}: axis ({one(p, 'axis')}) must be 1 (the channels)")
        if _int(where, p, "end_axis", -1, -4) != -1:
            raise GraphError(f"{where}: end_axis ({one(p, 'end_axis')}) must be -1 (flatten to N x -1)")
        node.op = ltype.lower()
    else:
        raise GraphError(f"layer {lname!r}: unknown layer type {ltype!r}")
    return node


def fill_weights(graph: Graph, seed: int = 0, blobs: dict[str, list[np.ndarray]] | None = None) -> None:
    """Weights for every node: from Caffe blobs by layer name when given, else random (He scaled),
    each batch norm's statistics then measured on a random image so that it normalises what it is
    given (``graph.reference.calibrate_batchnorm``)."""
    rng = np.random.default_rng(seed)
    shapes = infer_weight_shapes(graph)
    for node in graph.nodes:
        have = blobs.get(node.name) if blobs is not None else None
        if blobs is not None and node.weights and have is None:
            raise GraphError(f"layer {node.name!r}: no blobs in the caffemodel")
        for i, (role, key) in enumerate(node.weights.items()):
            shape = shapes[key]
            if have is not None:
                arr = _from_blob(node, role, have, i, shape)
            elif role == "w":
                fan_in = max(1, int(np.prod(shape[1:])))
                arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / fan_in))
            elif role == "var":
                arr = rng.uniform(0.5, 1.5, shape)
            elif role == "gamma":
                arr = rng.uniform(0.5, 1.5, shape)
            else:
                arr = rng.standard_normal(shape) * 0.1
            graph.weights[key] = np.ascontiguousarray(arr, dtype=np.float32)
    if blobs is None:
        from convforge.graph.reference import calibrate_batchnorm

        calibrate_batchnorm(graph, seed)


def _from_blob(node: Node, role: str, blobs: list[np.ndarray], i: int, shape: tuple[int, ...]) -> np.ndarray:
    if node.op == "batchnorm":  # Caffe: mean, var, scale factor (divide both by it)
        sizes = [b.size for b in blobs]
        if len(blobs) < 2 or any(b.size != int(np.prod(shape)) for b in blobs[:2]):
            raise GraphError(f"layer {node.name!r} (BatchNorm): the caffemodel has {len(blobs)} blob(s) of "
                             f"{sizes} values; a BatchNorm layer has mean and variance of {int(np.prod(shape))} "
                             "values each, then a scale factor")
        factor = float(blobs[2][0]) if len(blobs) > 2 and blobs[2].size else 1.0
        factor = 1.0 / factor if factor != 0 else 0.0
        return blobs[i].reshape(shape) * factor
    if i >= len(blobs) or blobs[i].size != int(np.prod(shape)):
        raise GraphError(f"layer {node.name!r}: caffemodel blob {i} ({role}) has "
                         f"{blobs[i].size if i < len(blobs) else 0} values, expected shape {shape}")
    return blobs[i].reshape(shape)


def infer_weight_shapes(graph: Graph) -> dict[str, tuple[int, ...]]:
    """The shape each weight key must have, from the node settings and the inferred input shapes."""
    out: dict[str, tuple[int, ...]] = {}
    probe = graph.copy()
    probe.nodes = []
    probe.outputs = [graph.input]
    shapes = infer(probe)
    for node in graph.nodes:
        x = shapes[node.inputs[0]] if node.inputs and node.inputs[0] in shapes else None
        if x is None:
            raise GraphError(f"node {node.name!r} ({node.op}): input {node.inputs[0]!r} is dangling")
        k = int(node.attrs.get("k") or 0)
        for role, key in node.weights.items():
            if node.op == "conv":
                kr, ks = (int(v) for v in node.attrs.get("kernel", (1, 1)))
                g = conv_group(node)
                out[key] = (k, x.shape[1] // g if x.shape[1] % g == 0 else x.shape[1], kr, ks) if role == "w" else (k,)
            elif node.op == "fc":
                out[key] = (k, x.size // x.shape[0]) if role == "w" else (k,)
            else:
                out[key] = (x.shape[1],)
        for key, shape in out.items():
            if key in node.weights.values() and key not in probe.weights:
                probe.weights[key] = np.zeros(shape, dtype=np.float32)
        probe.nodes.append(node)
        probe.outputs = [node.output]
        shapes = infer(probe)
    return out


# -- .caffemodel: a minimal protobuf binary reader (NetParameter.layer -> blobs) --------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message; length-delimited values as bytes."""
    out, pos = [], 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        num, wire = tag >> 3, tag & 7
        val: Any
        if wire == 0:
            val, pos = _varint(buf, pos)
        elif wire == 1:
            val, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            val, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            val, pos = buf[pos:pos + 4], pos + 4
        else:
            raise GraphError(f"caffemodel: unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise GraphError(f"caffemodel: field {num} runs past the end (truncated)")
        out.append((num, wire, val))
    return out


def _blob(buf: bytes) -> np.ndarray:
    """BlobProto: data (5, packed or not), double_data (8)."""
    data: list[np.ndarray] = []
    for num, wire, val in _fields(buf):
        if num == 5:
            data.append(np.frombuffer(val, "<f4") if wire == 2 else np.array(struct.unpack("<f", val), "<f4"))
        elif num == 8:
            data.append(np.frombuffer(val, "<f8").astype(np.float32) if wire == 2
                        else np.array(struct.unpack("<d", val), np.float32))
    return np.concatenate(data) if data else np.zeros(0, np.float32)


def read_caffemodel(path: Path) -> dict[str, list[np.ndarray]]:
    """Blobs of each layer by name, from a binary NetParameter (layer = 100; V1 layers = 2); a file
    that is not one is a GraphError naming it."""
    try:
        data = read_bounded(path, "caffemodel")
    except (OSError, InputFileError) as err:
        raise GraphError(f"caffemodel: {err}") from None
    try:
        return _layers(data)
    except (GraphError, IndexError, UnicodeDecodeError, ValueError, struct.error) as err:
        raise GraphError(f"caffemodel {path}: not a Caffe NetParameter ({err})") from None


def _layers(buf: bytes) -> dict[str, list[np.ndarray]]:
    out: dict[str, list[np.ndarray]] = {}
    for num, wire, val in _fields(buf):
        if wire != 2 or num not in (100, 2):
            continue
        name_field, blob_field = (1, 7) if num == 100 else (4, 6)
        name, blobs = "", []
        for n2, w2, v2 in _fields(val):
            if n2 == name_field and w2 == 2:
                name = v2.decode()
            elif n2 == blob_field and w2 == 2:
                blobs.append(_blob(v2))
        if blobs:
            out[name] = blobs
    return out


def load_shipped(name: str, seed: int = 0, input_size: int | None = None, batch: int | None = None,
                 weights: str | Path | None = None) -> Graph:
    """The IR of shipped model ``name`` (``convforge.models.NAMES``) with random weights (``seed``) or a
    ``.caffemodel``."""
    from convforge import models

    return load_prototxt(models.prototxt(name), weights=weights, seed=seed, input_size=input_size, batch=batch)
