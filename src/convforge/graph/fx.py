"""PyTorch front-end (extra ``[torch]``): ``torch.fx`` tracing of an ``nn.Module`` into the IR.

Modules: Conv2d, Linear, BatchNorm2d, ReLU, LeakyReLU, ReLU6, SiLU, Hardswish, GELU (exact), Mish,
Sigmoid, Tanh, Hardsigmoid, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d(1), AdaptiveMaxPool2d(1),
LocalResponseNorm, Softmax, Flatten, Dropout, Identity; functions relu, silu, hardswish, gelu, mish,
sigmoid, tanh, add, cat, flatten, softmax (and the matching tensor methods).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from convforge.graph.ir import Graph, GraphError, Node, infer


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def from_module(module: Any, input_size: int, channels: int | None = None, batch: int = 1) -> Graph:
    """The IR of ``module`` (in eval mode) on a ``batch x channels x input_size x input_size`` input."""
    import torch
    import torch.fx

    module = module.eval()
    if channels is None:
        first = next((m for m in module.modules() if isinstance(m, torch.nn.Conv2d)), None)
        if first is None:
            raise GraphError("fx: give channels (the module has no Conv2d to read them from)")
        channels = int(first.in_channels)
    traced = torch.fx.symbolic_trace(module)
    mods = dict(traced.named_modules())
    graph = Graph(type(module).__name__, "", (batch, channels, input_size, input_size), [], [])
    names: dict[str, str] = {}
    for fxn in traced.graph.nodes:
        if fxn.op == "placeholder":
            graph.input = names[fxn.name] = fxn.name
            continue
        if fxn.op == "output":
            outs = fxn.args[0] if isinstance(fxn.args[0], (tuple, list)) else (fxn.args[0],)
            graph.outputs = [names[o.name] for o in outs]
            continue
        ins = [names[a.name] for a in _flat(fxn.args) if hasattr(a, "name") and a.name in names]
        node = Node(fxn.name, "", ins, fxn.name)
        if fxn.op == "call_module":
            _module(node, mods[fxn.target], graph, torch)
        else:
            _function(node, fxn, torch)
        if node.op == "identity":
            names[fxn.name] = ins[0]
            continue
        graph.nodes.append(node)
        names[fxn.name] = node.output
    infer(graph)
    return graph


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        out += _flat(a) if isinstance(a, (tuple, list)) else [a]
    return out


def _weights(graph: Graph, node: Node, **arrays: Any) -> None:
    for role, t in arrays.items():
        if t is None:
            continue
        key = f"{node.name}.{role}"
        graph.weights[key] = np.ascontiguousarray(t.detach().cpu().numpy(), dtype=np.float32)
        node.weights[role] = key


def _module(node: Node, m: Any, graph: Graph, torch: Any) -> None:
    nn = torch.nn
    where = f"node {node.name!r} ({type(m).__name__})"
    if isinstance(m, nn.Conv2d):
        if m.padding_mode != "zeros" or isinstance(m.padding, str):
            raise GraphError(f"{where}: padding_mode ({m.padding_mode!r}) and padding ({m.padding!r}) must be "
                             "'zeros' and numbers")
        ph, pw = _pair(m.padding)
        node.op = "conv"
        node.attrs = {"k": m.out_channels, "kernel": _pair(m.kernel_size), "stride": _pair(m.stride),
                      "pad": (ph, ph, pw, pw), "dilation": _pair(m.dilation), "group": m.groups}
        _weights(graph, node, w=m.weight, bias=m.bias)
    elif isinstance(m, nn.Linear):
        node.op, node.attrs = "fc", {"k": m.out_features}
        _weights(graph, node, w=m.weight, bias=m.bias)
    elif isinstance(m, nn.BatchNorm2d):
        node.op, node.attrs = "batchnorm", {"eps": float(m.eps)}
        _weights(graph, node, mean=m.running_mean, var=m.running_var, gamma=m.weight, beta=m.bias)
    elif isinstance(m, (nn.ReLU, nn.LeakyReLU, nn.ReLU6)):
        node.op = "relu"
        node.attrs = {"slope": float(getattr(m, "negative_slope", 0.0))}
        if isinstance(m, nn.ReLU6):
            node.attrs["clip"] = 6.0
    elif type(m) in _ACT_MODULES(nn):
        if isinstance(m, nn.GELU) and m.approximate != "none":
            raise GraphError(f"{where}: approximate ({m.approximate!r}) must be 'none' (the exact, erf GELU)")
        node.op, node.attrs = "act", {"fn": _ACT_MODULES(nn)[type(m)]}
        if node.attrs["fn"] == "hardsigmoid":  # PyTorch's: x / 6 + 1 / 2, clipped
            node.attrs.update(alpha=1 / 6, beta=0.5)
    elif isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
        ph, pw = _pair(m.padding)
        node.op = "pool"
        node.attrs = {"kind": "max" if isinstance(m, nn.MaxPool2d) else "avg", "kernel": _pair(m.kernel_size),
                      "stride": _pair(m.stride or m.kernel_size), "pad": (ph, ph, pw, pw),
                      "ceil": bool(m.ceil_mode), "count_pad": bool(getattr(m, "count_include_pad", True))}
    elif isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
        if _pair(m.output_size) != (1, 1):
            raise GraphError(f"{where}: output_size ({m.output_size}) must be 1")
        node.op = "pool"
        node.attrs = {"kind": "avg" if isinstance(m, nn.AdaptiveAvgPool2d) else "max", "global": True}
    elif isinstance(m, nn.LocalResponseNorm):
        node.op, node.attrs = "lrn", {"size": m.size, "alpha": m.alpha, "beta": m.beta, "k": m.k}
    elif isinstance(m, nn.Softmax):
        node.op = "softmax"
    elif isinstance(m, nn.Flatten):
        node.op = "flatten"
    elif isinstance(m, (nn.Dropout, nn.Identity)):
        node.op = "identity"
    else:
        raise GraphError(f"{where}: unsupported module {type(m).__name__}")


def _ACT_MODULES(nn: Any) -> dict[type, str]:
    """Activation modules -> the IR's act function (ir.ACT_FNS)."""
    return {nn.SiLU: "silu", nn.Hardswish: "hardswish", nn.GELU: "gelu", nn.Mish: "mish", nn.Sigmoid: "sigmoid",
            nn.Tanh: "tanh", nn.Hardsigmoid: "hardsigmoid"}


def _act_function(t: Any, torch: Any) -> str | None:
    """The IR's act function of a torch function or tensor method ``t``, or None."""
    F = torch.nn.functional
    table = {F.silu: "silu", F.hardswish: "hardswish", F.mish: "mish", torch.sigmoid: "sigmoid",
             torch.tanh: "tanh", "sigmoid": "sigmoid", "tanh": "tanh"}
    try:
        return table.get(t)
    except TypeError:  # an unhashable target
        return None


def _function(node: Node, fxn: Any, torch: Any) -> None:
    F = torch.nn.functional
    t = fxn.target
    where = f"node {node.name!r} ({getattr(t, '__name__', t)})"
    act = _act_function(t, torch)
    if t in (torch.relu, F.relu, "relu"):
        node.op = "relu"
    elif act is not None or t is F.gelu:
        if t is F.gelu and fxn.kwargs.get("approximate", "none") != "none":
            raise GraphError(f"{where}: approximate must be 'none' (the exact, erf GELU)")
        node.op, node.attrs = "act", {"fn": act or "gelu"}
    elif t in (operator.add, torch.add, "add"):
        node.op = "add"
        if len(node.inputs) != 2:
            raise GraphError(f"{where}: add must take two tensors")
    elif t is torch.cat:
        dim = fxn.kwargs.get("dim", fxn.args[1] if len(fxn.args) > 1 else 0)
        if dim != 1:
            raise GraphError(f"{where}: dim ({dim}) must be 1")
        node.op = "concat"
    elif t in (torch.flatten, "flatten"):
        node.op = "flatten"
    elif t in (torch.softmax, F.softmax, "softmax"):
        node.op = "softmax"
    elif t in (F.dropout, "contiguous"):
        node.op = "identity"
    else:
        raise GraphError(f"{where}: unsupported {fxn.op} {t!r}")
