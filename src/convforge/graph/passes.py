"""Graph passes, each a function Graph -> Graph that leaves its argument unchanged.

``optimize`` runs them in order: identity removal, batch norm folding, activation fusion,
residual fusion, concat in place.
Each is tested by running the graph through the float64 reference before and after.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from convforge.graph.ir import Graph, Node, infer

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
    from convforge.graph.runtime import channel_affine

    g = graph.copy()
    for node in list(g.nodes):
        prod = g.producer(node.inputs[0]) if node.op in ("batchnorm", "scale") else None
        if (prod is None or prod.op not in ("conv", "fc") or prod.attrs.get("relu")
                or len(prod.inputs) > 1 or _sole_consumer(g, prod.output) is not node):
            continue
        a, shift = channel_affine(g, node)
        w = np.asarray(g.weights[prod.weights["w"]], np.float64)
        b = g.weight(prod, "bias")
        b64 = np.zeros(w.shape[0]) if b is None else np.asarray(b, np.float64)
        wkey, bkey = f"{prod.name}.w+{node.name}", f"{prod.name}.bias+{node.name}"
        g.weights[wkey] = (w * a.reshape((-1,) + (1,) * (w.ndim - 1))).astype(np.float32)
        g.weights[bkey] = (b64 * a + shift).astype(np.float32)
        prod.weights = {"w": wkey, "bias": bkey}
        _drop(g, node, prod.output)
    return g


def fuse_relu(graph: Graph) -> Graph:
    """Fold a plain ReLU into the epilogue of the conv / fc / add / affine that produces its input
    (when the ReLU is that producer's only reader)."""
    g = graph.copy()
    for node in list(g.nodes):
        prod = g.producer(node.inputs[0]) if node.op == "relu" else None
        plain = node.attrs.get("slope", 0.0) == 0.0 and node.attrs.get("clip") is None
        if (prod is None or not plain or prod.op not in ("conv", "fc", "add", "batchnorm", "scale")
                or prod.attrs.get("relu") or _sole_consumer(g, prod.output) is not node):
            continue
        prod.attrs["relu"] = True
        _drop(g, node, prod.output)
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
            if (prod is not None and prod.op == "conv" and len(prod.inputs) == 1 and not prod.attrs.get("relu")
                    and _sole_consumer(g, mine) is node and order.get(other, -1) < order[mine]):
                prod.inputs.append(other)
                prod.attrs["relu"] = bool(node.attrs.get("relu"))
                _drop(g, node, prod.output)
                break
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


PASSES: tuple[Pass, ...] = (remove_identities, fold_batchnorm, fuse_relu, fuse_residual, concat_in_place)


def optimize(graph: Graph, passes: tuple[Pass, ...] = PASSES) -> Graph:
    """Run ``passes`` in order; the result is checked by shape inference."""
    for p in passes:
        graph = p(graph)
    infer(graph)
    return graph
