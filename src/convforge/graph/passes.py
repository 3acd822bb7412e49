"""Graph passes, each a function Graph -> Graph that leaves its argument unchanged.

``optimize`` runs them in order: identity removal, zero padding into the convs after it, constant
bias adds into the conv / fc before them, batch norm folding, gated activations (x * sigmoid(x):
SiLU; x * hardsigmoid(x): HardSwish), activation fusion, pre-activation folding, residual fusion,
LRN into the pool after it, concat in place.
Each is tested by running the graph through the float64 reference before and after.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from convforge.graph.ir import EPILOGUE_ACTS, Graph, Node, conv_geometry, conv_group, infer

Pass = Callable[[Graph], Graph]


def _replace_uses(graph: Graph, old: str, new: str) -> None:
    for n in graph.nodes:
        n.inputs = [new if t == old else t for t in n.inputs]
    graph.outputs = [new if t == old else t for t in graph.outputs]


def _sole_consumer(graph: Graph, tensor: str) -> Node | None:
    """The one node reading ``tensor`` when it is not also a graph output, else None."""
    users = graph.consumers(tensor)
    if len(users) != 1 or tensor in graph.outputs:
        return None
    return users[0]


def _can_take_name(graph: Graph, tensor: str) -> bool:
    """``tensor`` may be renamed: a node's output that is not itself a declared graph output."""
    return graph.producer(tensor) is not None and tensor not in graph.outputs


def _drop(graph: Graph, node: Node, replacement: str) -> None:
    """Remove ``node``, its readers reading ``replacement`` instead. When ``node`` writes a declared
    graph output, ``replacement`` takes that name instead, so the outputs keep their names (the
    callers make sure it can: ``_can_take_name``)."""
    graph.nodes.remove(node)
    if node.output in graph.outputs:
        graph.rename(replacement, node.output)
    else:
        _replace_uses(graph, node.output, replacement)


def remove_identities(graph: Graph) -> Graph:
    """Drop dropout (identity at inference) and single-input concats; one that writes a graph
    output stays (a view at run time) when its input cannot take the output's name."""
    g = graph.copy()
    for node in list(g.nodes):
        if node.op == "dropout" or (node.op == "concat" and len(node.inputs) == 1):
            if node.output not in g.outputs or _can_take_name(g, node.inputs[0]):
                _drop(g, node, node.inputs[0])
    return g


def fold_batchnorm(graph: Graph) -> Graph:
    """Fold batchnorm / scale nodes that follow a conv or fc (and are its only reader) into the
    producer's weights and bias: w' = w * a[k], b' = b * a[k] + shift[k], in float64."""
    from convforge.graph.ir import channel_affine

    g = graph.copy()
    for node in list(g.nodes):
        prod = g.producer(node.inputs[0]) if node.op in ("batchnorm", "scale") else None
        if (prod is None or prod.op not in ("conv", "fc", "deconv") or _activated(prod)
                or len(prod.inputs) > 1 or _sole_consumer(g, prod.output) is not node):
            continue
        a, shift = channel_affine(g, node)
        w = np.asarray(g.weights[prod.weights["w"]], np.float64)
        b = g.weight(prod, "bias")
        b64 = np.zeros(a.shape[0]) if b is None else np.asarray(b, np.float64)
        wkey, bkey = f"{prod.name}.w+{node.name}", f"{prod.name}.bias+{node.name}"
        g.weights[wkey] = _scale_outputs(prod, w, a).astype(np.float32)
        g.weights[bkey] = (b64 * a + shift).astype(np.float32)
        prod.weights = {"w": wkey, "bias": bkey}
        _drop(g, node, prod.output)
    return g


def _activated(node: Node) -> bool:
    """``node`` applies an activation to what it writes (a fused ReLU or epilogue act)."""
    return bool(node.attrs.get("relu") or node.attrs.get("act"))


def _scale_outputs(node: Node, w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Filters ``w`` of a conv / fc / deconv with output channel k scaled by ``a[k]`` (a deconv's
    filters are (C, K/group, R, S): output channel k is group k // (K/group)'s column k % (K/group))."""
    if node.op != "deconv":
        return w * a.reshape((-1,) + (1,) * (w.ndim - 1))
    g = conv_group(node)
    c, kg = w.shape[0], w.shape[1]
    return (w.reshape(g, c // g, kg, *w.shape[2:]) * a.reshape(g, 1, kg, 1, 1)).reshape(w.shape)


def fold_pad(graph: Graph) -> Graph:
    """Fold a constant zero pad into the padding of the convs that read it, when every reader is a
    conv taking it as its input (no prologue yet): the padded tensor is never written."""
    g = graph.copy()
    for node in list(g.nodes):
        if node.op != "pad" or node.attrs.get("mode", "constant") != "constant" or node.attrs.get("value", 0.0):
            continue
        users = g.consumers(node.output)
        if node.output in g.outputs or not users or not all(
                u.op == "conv" and u.inputs == [node.output] and "pscale" not in u.weights
                and not u.attrs.get("pre_relu") for u in users):
            continue
        extra = conv_geometry(node)[2]
        for u in users:
            u.attrs["pad"] = tuple(p + e for p, e in zip(conv_geometry(u)[2], extra, strict=True))
            u.inputs = [node.inputs[0]]
        g.nodes.remove(node)
    return g


def _channel_constant(graph: Graph, node: Node, k: int) -> np.ndarray | None:
    """The constant of a one-input binary add / sub as K per-channel values (a scalar or one
    value per channel, broadcast over the rest), else None."""
    b = graph.weight(node, "b")
    if b is None or node.attrs.get("fn") not in ("add", "sub") or (node.attrs["fn"] == "sub"
                                                                   and node.attrs.get("swap")):
        return None
    shape = b.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or (len(shape) > 1 and shape[1] not in (1, k)):
        return None
    vals = np.broadcast_to(np.asarray(b, np.float64).reshape(-1), (k,))
    return -vals if node.attrs["fn"] == "sub" else vals


def fold_bias(graph: Graph) -> Graph:
    """Fold a per-channel constant add (or subtract) into the bias of the conv / fc / deconv before
    it (its only reader, no activation yet): MatMul + Add bias as ONNX writes a linear layer."""
    g = graph.copy()
    shapes = infer(graph)
    for node in list(g.nodes):
        prod = g.producer(node.inputs[0]) if node.op == "binary" and len(node.inputs) == 1 else None
        if (prod is None or prod.op not in ("conv", "fc", "deconv") or _activated(prod) or len(prod.inputs) > 1
                or _sole_consumer(g, prod.output) is not node
                or shapes[node.output].shape != shapes[prod.output].shape):
            continue
        k = shapes[prod.output].shape[1]
        vals = _channel_constant(g, node, k)
        if vals is None:
            continue
        b = g.weight(prod, "bias")
        key = f"{prod.name}.bias+{node.name}"
        g.weights[key] = ((np.zeros(k) if b is None else np.asarray(b, np.float64)) + vals).astype(np.float32)
        prod.weights["bias"] = key
        _drop(g, node, prod.output)
    return g


def _gate_of(g: Graph, node: Node | None) -> tuple[str, str, list[Node]] | None:
    """(activation, its input, the gate's nodes) that x * node(...) is, for a gate ``node``: sigmoid(x)
    gives SiLU, hardsigmoid(x) with alpha 1/6 and beta 1/2 HardSwish, tanh(softplus(x)) Mish (as exports
    below opset 18 write it); None for anything else."""
    if node is None or node.op != "act":
        return None
    fn = node.attrs["fn"]
    if fn == "sigmoid":
        return "silu", node.inputs[0], [node]
    if (fn == "hardsigmoid" and abs(float(node.attrs.get("alpha", 0.2)) - 1 / 6) < 1e-6
            and float(node.attrs.get("beta", 0.5)) == 0.5):
        return "hardswish", node.inputs[0], [node]
    inner = g.producer(node.inputs[0]) if fn == "tanh" else None
    if inner is not None and inner.op == "act" and inner.attrs["fn"] == "softplus":
        return "mish", inner.inputs[0], [node, inner]
    return None


def fuse_gate(graph: Graph) -> Graph:
    """x * sigmoid(x) -> SiLU, x * hardsigmoid(x) -> HardSwish and x * tanh(softplus(x)) -> Mish (as
    exports write them): the multiply becomes the activation of x, the gate's nodes dropped when
    nothing else reads them."""
    g = graph.copy()
    for node in list(g.nodes):
        if node.op != "binary" or node.attrs.get("fn") != "mul" or len(node.inputs) != 2:
            continue
        for x, gate_out in (node.inputs, node.inputs[::-1]):
            found = _gate_of(g, g.producer(gate_out))
            if found is None or found[1] != x:
                continue
            fn, _, gate_nodes = found
            reader, dropped = node, []
            for gn in gate_nodes:  # outermost first: each dropped only when its one reader goes too
                if _sole_consumer(g, gn.output) is not reader:
                    break
                dropped.append(gn)
                reader = gn
            for gn in dropped:
                g.nodes.remove(gn)
            node.op, node.inputs, node.attrs = "act", [x], {"fn": fn}
            break
    return g


def fuse_relu(graph: Graph) -> Graph:
    """Fold a plain ReLU into the epilogue of the conv / fc / add / affine / deconv that produces
    its input, and a SiLU or HardSwish act (``EPILOGUE_ACTS``) into a conv's or fc's (when the
    activation is that producer's only reader)."""
    g = graph.copy()
    for node in list(g.nodes):
        prod = g.producer(node.inputs[0]) if node.op in ("relu", "act") else None
        if node.op == "relu":
            ok = node.attrs.get("slope", 0.0) == 0.0 and node.attrs.get("clip") is None
            takers: tuple[str, ...] = ("conv", "fc", "add", "batchnorm", "scale", "deconv")
        else:
            ok, takers = node.attrs.get("fn") in EPILOGUE_ACTS, ("conv", "fc")
        if (prod is None or not ok or prod.op not in takers or _activated(prod)
                or _sole_consumer(g, prod.output) is not node):
            continue
        if node.op == "relu":
            prod.attrs["relu"] = True
        else:
            prod.attrs["act"] = node.attrs["fn"]
        _drop(g, node, prod.output)
    return g


def _prologue_readers(graph: Graph, node: Node) -> list[Node] | None:
    """The convs that may fold ``node`` (a batchnorm / scale / plain ReLU) into their input load:
    every reader of its output, each a conv reading it as its input (not as a residual) with no
    prologue yet; None when something else reads it (or it is a graph output)."""
    if node.output in graph.outputs:
        return None
    users = graph.consumers(node.output)
    ok = users and all(u.op == "conv" and u.inputs[0] == node.output and node.output not in u.inputs[1:]
                       and "pscale" not in u.weights and not u.attrs.get("pre_relu") for u in users)
    return users if ok else None


def _pre_affine(graph: Graph, node: Node) -> tuple[np.ndarray | None, np.ndarray | None, bool, list[Node]]:
    """(scale, shift, relu, nodes folded) of the pre-activation ending at ``node``: a plain ReLU
    alone, or a batchnorm / scale (its fused ReLU too), composed with a batchnorm / scale before it
    that has no ReLU and no other reader (Caffe's BatchNorm + Scale), in float64."""
    from convforge.graph.ir import channel_affine

    if node.op == "relu":
        return None, None, True, [node]
    a, b = channel_affine(graph, node)
    nodes = [node]
    prev = graph.producer(node.inputs[0])
    while (prev is not None and prev.op in ("batchnorm", "scale") and not prev.attrs.get("relu")
           and _sole_consumer(graph, prev.output) is nodes[-1]):
        pa, pb = channel_affine(graph, prev)
        a, b = a * pa, a * pb + b
        nodes.append(prev)
        prev = graph.producer(prev.inputs[0])
    return a, b, bool(node.attrs.get("relu")), nodes


def fold_preactivation(graph: Graph) -> Graph:
    """Fold a pre-activation (batch norm / scale, with its fused ReLU, or a plain ReLU the passes
    before could not fold into its producer) into the input load of every conv that reads it: the
    convs then read the tensor before it and apply ``max(pscale[c] * x + pshift[c], 0)`` to the
    in-bounds values (a prologue: DenseNet's BN -> ReLU -> conv, pre-activation ResNets). Only when
    every reader is such a conv (each folds it; the activated tensor is then never written)."""
    g = graph.copy()
    shapes = infer(graph)
    for node in list(g.nodes):
        plain_relu = node.op == "relu" and node.attrs.get("slope", 0.0) == 0.0 and node.attrs.get("clip") is None
        if node not in g.nodes or not (plain_relu or node.op in ("batchnorm", "scale")):
            continue
        users = _prologue_readers(g, node)
        if users is None or len(shapes[node.inputs[0]].shape) != 4:
            continue
        a, b, relu, nodes = _pre_affine(g, node)
        src = nodes[-1].inputs[0]
        if a is not None and b is not None:
            g.weights[f"{node.name}.pscale"] = a.astype(np.float32)
            g.weights[f"{node.name}.pshift"] = b.astype(np.float32)
        for u in users:
            u.inputs[0] = src
            u.attrs["pre_relu"] = relu
            if a is not None:
                u.weights.update(pscale=f"{node.name}.pscale", pshift=f"{node.name}.pshift")
        for n in nodes:
            g.nodes.remove(n)
    return g


def fuse_residual(graph: Graph) -> Graph:
    """Fold a two-input add into the epilogue of the conv producing one input (its only reader),
    the other input becoming the conv's residual (``res``) and the add's ReLU the conv's. The
    runtime falls back to a separate add when the chosen variant lacks a residual store path."""
    g = graph.copy()
    order = {n.output: i for i, n in enumerate(g.nodes)}
    for node in list(g.nodes):
        if node.op != "add" or len(node.inputs) != 2:
            continue
        for mine, other in (node.inputs, node.inputs[::-1]):
            prod = g.producer(mine)
            if (prod is not None and prod.op == "conv" and len(prod.inputs) == 1 and not _activated(prod)
                    and _sole_consumer(g, mine) is node and order.get(other, -1) < order[mine]):
                prod.inputs.append(other)
                prod.attrs["relu"] = bool(node.attrs.get("relu"))
                _drop(g, node, prod.output)
                break
    return g


def fuse_lrn_pool(graph: Graph) -> Graph:
    """Fold an LRN whose only reader is a (non-global) pool into that pool: the pool normalises
    what it reads (``attrs["lrn"]``) and the normalised tensor is never written (AlexNet's and
    GoogLeNet's norm -> pool: the LRN's output is 4x the pool's)."""
    g = graph.copy()
    for node in list(g.nodes):
        if node.op != "lrn":
            continue
        pool = _sole_consumer(g, node.output)
        if pool is None or pool.op != "pool" or pool.attrs.get("global") or pool.attrs.get("lrn"):
            continue
        pool.attrs["lrn"] = {a: node.attrs[a] for a in ("size", "alpha", "beta", "k") if a in node.attrs}
        pool.inputs[0] = node.inputs[0]
        g.nodes.remove(node)
    return g


def concat_in_place(graph: Graph) -> Graph:
    """Mark channel concats whose inputs all come from convs read by nothing else: each conv can
    write at its channel offset of the concat's tensor (no copy). The runtime keeps the copy when
    a chosen variant has no channel-offset store path (``Variant.offset_ok``)."""
    g = graph.copy()
    for node in g.nodes:
        if node.op != "concat" or len(set(node.inputs)) != len(node.inputs):
            continue
        prods = [g.producer(t) for t in node.inputs]
        if all(p is not None and p.op == "conv" and len(p.inputs) == 1 and _sole_consumer(g, t) is node
               for p, t in zip(prods, node.inputs, strict=True)):
            node.attrs["in_place"] = True
    return g


PASSES: tuple[Pass, ...] = (remove_identities, fold_pad, fold_bias, fold_batchnorm, fuse_gate, fuse_relu,
                            fold_preactivation, fuse_residual, fuse_lrn_pool, concat_in_place)


def optimize(graph: Graph, passes: tuple[Pass, ...] = PASSES) -> Graph:
    """Run ``passes`` in order; the result is checked by shape inference."""
    for p in passes:
        graph = p(graph)
    infer(graph)
    return graph
