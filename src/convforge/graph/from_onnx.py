"""ONNX front-end (extra ``[onnx]``): a model into the IR, initializers as weights (opset 13+).

Ops: Conv, Gemm, MatMul (by an initializer), Relu, LeakyRelu, Clip, MaxPool, AveragePool,
GlobalAveragePool, GlobalMaxPool, LRN, BatchNormalization, Add, Concat, Softmax, Flatten,
Reshape (to N x -1), Dropout, Identity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from convforge.graph.ir import Graph, GraphError, Node, infer, input_shape


def load_onnx(model: Any, input_size: int | None = None, batch: int | None = None) -> Graph:
    """The IR of an ONNX ModelProto (or a path to one)."""
    import onnx
    from onnx import numpy_helper

    if isinstance(model, (str, Path)):
        model = onnx.load(str(model))
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < 13:
        raise GraphError(f"onnx: opset ({opset}) must be 13 or later")
    g = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    real = [i for i in g.input if i.name not in inits]
    if len(real) != 1:
        raise GraphError(f"onnx: the graph must have one input, it has {[i.name for i in real]}")
    dims = [d.dim_value if d.HasField("dim_value") else 1 for d in real[0].type.tensor_type.shape.dim]
    if len(dims) != 4:
        raise GraphError(f"onnx: input {real[0].name!r} has rank {len(dims)}, expected 4 (N, C, H, W)")
    graph = Graph(g.name or "onnx", real[0].name, input_shape(dims, input_size, batch), [], [])
    alias: dict[str, str] = {}
    for i, op in enumerate(g.node):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in op.attribute}
        name = op.name or f"{op.op_type}_{i}"
        ins = [alias.get(t, t) for t in op.input if t]
        if op.op_type in ("Dropout", "Identity"):
            alias[op.output[0]] = ins[0]
            continue
        node = _node(name, op.op_type, attrs, ins, inits, graph)
        node.output = op.output[0]
        graph.nodes.append(node)
        _shapes_so_far(graph)
    graph.outputs = [alias.get(o.name, o.name) for o in g.output]
    infer(graph)
    return graph


def _shapes_so_far(graph: Graph) -> None:
    graph.outputs = [graph.nodes[-1].output]
    infer(graph)


def _weight(graph: Graph, inits: dict[str, np.ndarray], node: Node, role: str, tensor: str,
            transform: Any = None) -> None:
    if tensor not in inits:
        raise GraphError(f"node {node.name!r} ({node.op}): {role} ({tensor!r}) must be an initializer")
    arr = inits[tensor] if transform is None else transform(inits[tensor])
    key = f"{node.name}.{role}"
    graph.weights[key] = np.ascontiguousarray(arr, dtype=np.float32)
    node.weights[role] = key


def _pads(attrs: dict[str, Any], where: str) -> tuple[int, int, int, int]:
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise GraphError(f"{where}: auto_pad ({attrs['auto_pad']!r}) is not supported; give pads")
    t, left, b, r = attrs.get("pads", [0, 0, 0, 0])
    return (int(t), int(b), int(left), int(r))


def _node(name: str, kind: str, attrs: dict[str, Any], ins: list[str], inits: dict[str, np.ndarray],
          graph: Graph) -> Node:
    where = f"node {name!r} ({kind})"
    acts = [t for t in ins if t not in inits]
    node = Node(name, "", acts[:1], name)
    if kind == "Conv":
        if attrs.get("group", 1) != 1:
            raise GraphError(f"{where}: group ({attrs['group']}) must be 1")
        w = inits.get(ins[1])
        if w is None:
            raise GraphError(f"{where}: W ({ins[1]!r}) must be an initializer")
        node.op = "conv"
        node.attrs = {"k": int(w.shape[0]), "kernel": tuple(int(v) for v in w.shape[2:]),
                      "stride": tuple(attrs.get("strides", (1, 1))), "pad": _pads(attrs, where),
                      "dilation": tuple(attrs.get("dilations", (1, 1)))}
        _weight(graph, inits, node, "w", ins[1])
        if len(ins) > 2:
            _weight(graph, inits, node, "bias", ins[2])
    elif kind in ("Gemm", "MatMul"):
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            raise GraphError(f"{where}: only transA=0, alpha=1, beta=1 are supported")
        w = inits.get(ins[1])
        if w is None:
            raise GraphError(f"{where}: B ({ins[1]!r}) must be an initializer")
        trans = kind == "Gemm" and attrs.get("transB", 0)
        node.op, node.attrs = "fc", {"k": int(w.shape[0] if trans else w.shape[1])}
        _weight(graph, inits, node, "w", ins[1], None if trans else np.transpose)
        if len(ins) > 2:
            _weight(graph, inits, node, "bias", ins[2], np.ravel)
    elif kind in ("Relu", "LeakyRelu"):
        node.op, node.attrs = "relu", {"slope": float(attrs.get("alpha", 0.01)) if kind == "LeakyRelu" else 0.0}
    elif kind == "Clip":
        lo = float(inits[ins[1]]) if len(ins) > 1 and ins[1] in inits else None
        hi = float(inits[ins[2]]) if len(ins) > 2 and ins[2] in inits else None
        if lo != 0.0:
            raise GraphError(f"{where}: min ({lo}) must be 0 (a clipped ReLU)")
        node.op, node.attrs = "relu", {"slope": 0.0, "clip": hi}
    elif kind in ("MaxPool", "AveragePool"):
        if attrs.get("dilations", [1, 1]) != [1, 1] and "dilations" in attrs:
            raise GraphError(f"{where}: dilations ({attrs['dilations']}) are not supported")
        node.op = "pool"
        node.attrs = {"kind": "max" if kind == "MaxPool" else "avg", "kernel": tuple(attrs["kernel_shape"]),
                      "stride": tuple(attrs.get("strides", (1, 1))), "pad": _pads(attrs, where),
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
        node.op, node.inputs, node.attrs = "concat", acts, {"axis": int(attrs.get("axis", 1))}
    elif kind == "Softmax":
        axis = int(attrs.get("axis", -1))
        node.op = "softmax"
        if axis not in (1, -1):
            raise GraphError(f"{where}: axis ({axis}) must be 1 (channels)")
    elif kind in ("Flatten", "Reshape"):
        if kind == "Flatten" and int(attrs.get("axis", 1)) != 1:
            raise GraphError(f"{where}: axis ({attrs['axis']}) must be 1")
        if kind == "Reshape":
            shape = [int(v) for v in inits.get(ins[1], np.array([]))]
            if len(shape) != 2 or shape[1] != -1 and shape[0] not in (0, -1, graph.input_shape[0]):
                raise GraphError(f"{where}: shape ({shape}) must flatten to (N, -1)")
        node.op = "flatten"
    else:
        raise GraphError(f"{where}: unknown ONNX op type {kind!r}")
    return node
