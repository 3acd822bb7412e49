"""``fuse(model)``: convforge convs with the batch norm, residual add and ReLU after them folded in.

``torch.fx.symbolic_trace``-style tracing (nn.Conv2d subclasses are leaves) of a structural copy
of the model, then chains conv -> [BatchNorm2d] -> [add(other)] -> [ReLU] (at least one after the
conv; every intermediate used exactly once), and conv -> BatchNorm2d -> SiLU / HardSwish (``nn.SiLU``,
``nn.Hardswish``, ``F.silu``, ``F.hardswish``), become one call of a :class:`FusedConv2d` at the conv's
path (not after a padding-mode conv, whose padded copy precedes a plain ``Conv2d``; every
``nn.ConvTranspose2d`` becomes a ``ConvTranspose2d``, nothing fused after it). ReLU as ``nn.ReLU``
(shared modules too: nodes are matched, not modules), ``F.relu``, ``torch.relu(_)``, ``Tensor.relu(_)``;
add as ``+``, ``+=``, ``torch.add``, ``Tensor.add(_)`` with either operand order (alpha 1). Other eligible
convs become plain convforge ``Conv2d``s.

Then pre-activations: a ``BatchNorm2d`` [-> ReLU] whose output only convforge convs read (each as
its input, its module called once there; DenseNet's BN -> ReLU -> conv, a pre-activation ResNet's
BN -> ReLU read by a conv and its shortcut conv) becomes one :class:`PreActivation` node (a
module added at the root as ``_cf_preact_<batch norm path>``, holding no parameters or buffers)
and every reading conv a :class:`FusedConv2d` that folds it into its input load in eval inference
(``fused.py``); in training mode the node runs the batch norm once and the convs run plain.

Before all that, in a model fused in eval mode, sums of re-parameterisable branches over one input (two
convs or more, each with its batch norm, and an identity: RepVGG / ACNet-style blocks) [-> ReLU] become one
:class:`~convforge.torch.branches.BranchSum` call each, which runs them as one folded conv in eval inference
and as the branches in training (torch/branches.py).

Before the convs are swapped, every ``gate(fc2(act(fc1(avgpool(x))))) * x`` (torchvision's
``SqueezeExcitation``: ReLU or SiLU, sigmoid or hardsigmoid, each intermediate used once) becomes one
:class:`~convforge.torch.se.SqueezeExcite` call (torch/se.py: one autograd node, 3 launches forward and 4
backward), a module added at the root as ``_cf_se_<fc1's path>`` holding references to the five modules.

Then linear layers over channels-last activations (torch/linear.py): ``nn.Linear`` -> GELU, and
``nn.Linear`` -> permute(0, 3, 1, 2) -> layer scale * . -> [torchvision's stochastic depth] ->
+ residual (ConvNeXt's blocks) become one :class:`FusedLinear` call each at the linear's path, and every
``nn.MaxPool2d`` convforge's (torch/pool.py).

The result is a ``GraphModule`` whose module hierarchy mirrors the original's (every module a
shallow copy sharing its parameters and buffers, batch norms included), so ``state_dict()`` has
the same keys, in the same order, holding the same tensors; the original model is not changed.
Python control flow (``if self.training``) is fixed when the model is traced, as for any fx
trace, except in torchvision's ``StochasticDepth`` (EfficientNet, ConvNeXt...), kept a leaf so that it drops
paths in training however the model was when fused, and is the identity in eval. A model fx cannot trace
falls back to ``convert`` on a structural copy, said in the report.
"""

from __future__ import annotations

import copy
import operator
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node, Tracer

from convforge.torch.branches import Branch, BranchSum, branch_reason
from convforge.torch.fused import FusedConv2d, PreActivation
from convforge.torch.graphs import graph_training
from convforge.torch.layernorm import RowNorm
from convforge.torch.linear import FusedLinear
from convforge.torch.modules import OPTIONS, Conv2d, ConvertReport, ConvTranspose2d, static_reason, swapped
from convforge.torch.modules import convert as convert_in_place
from convforge.torch.pool import MaxPool2d
from convforge.torch.prepare import prepare_on_first_call
from convforge.torch.se import SqueezeExcite
from convforge.torch.se import kinds as se_kinds

_ADDS_F = {operator.add: False, operator.iadd: True, torch.add: False}
_ADDS_M = {"add": False, "add_": True}
_RELUS_F = (F.relu, F.relu_, torch.relu, torch.relu_)
_ACTS_M = {torch.nn.SiLU: "silu", torch.nn.Hardswish: "hardswish"}
_ACTS_F = {F.silu: "silu", F.hardswish: "hardswish"}


def _is_stochastic_depth_module(m: Any) -> bool:
    """torchvision's ``StochasticDepth`` (its forward reads ``self.training``: traced through, the mode at
    fuse time would stick)."""
    cls = type(m)
    return cls.__name__ == "StochasticDepth" and cls.__module__.startswith("torchvision.")


class _Tracer(Tracer):
    """fx's tracer with every nn.Conv2d and nn.ConvTranspose2d (convforge's included) and torchvision's
    StochasticDepth kept as a leaf."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return (isinstance(m, torch.nn.Conv2d | torch.nn.ConvTranspose2d) or _is_stochastic_depth_module(m)
                or super().is_leaf_module(m, module_qualified_name))


def convert(model: torch.nn.Module, **options: Any) -> ConvertReport:
    """``convforge.torch.convert``: :func:`convforge.torch.modules.convert` (every eligible conv of
    ``model`` swapped in place), and the model's first eval forward on CUDA prepares its layers'
    kernels several at a time (:func:`~convforge.torch.prepare.prepare_on_first_call`)."""
    report = convert_in_place(model, **options)
    if report.converted:
        prepare_on_first_call(model)
    return report



def fuse(model: torch.nn.Module, **options: Any) -> tuple[torch.nn.Module, ConvertReport]:
    """The fused model (a GraphModule; ``model`` itself is unchanged) and the report of what was
    converted, fused, and left to PyTorch with the reason. ``options`` as ``convert``'s."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"fuse() got unknown option(s) {unknown}; allowed: {', '.join(OPTIONS)}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fuse() takes a torch.nn.Module, not {type(model).__name__}")
    root = mirror(model)
    try:
        graph = _Tracer().trace(root)
    except Exception as err:  # noqa: BLE001 - any tracing failure means: no fusion, convert instead
        report = convert(root, **options)  # (armed for its first call)
        first = (str(err).splitlines() or [""])[0][:200]
        report.unfused[""] = (f"torch.fx cannot trace the model ({type(err).__name__}: {first}); "
                              "convert() swapped its convs without fusion")
        return graph_training(root), report
    for node in graph.nodes:  # a forward annotated under `from __future__ import annotations` gives
        if isinstance(node.type, str):  # strings, which fx keeps as globals that do not pickle
            node.type = None
    report = ConvertReport()
    _fold_branch_sums(graph, root, report, options)
    _fold_excitations(graph, root, report)
    _rewrite(graph, root, report, options)
    _fold_preactivations(graph, root, report)
    _fuse_linears(graph, root, report, options)
    _swap_row_norms(graph, root, report)
    _swap_pools(graph, root, report)
    gm = _graph_module(root, graph, type(model).__name__)
    prepare_on_first_call(gm)
    return graph_training(gm), report


def mirror(model: torch.nn.Module) -> torch.nn.Module:
    """A structural copy: every module object copied (attribute dicts and sets copied, so changes
    to one hierarchy do not reach the other), parameters, buffers and hooks shared. A module
    registered at several paths stays one module."""
    memo: dict[int, torch.nn.Module] = {}

    def copy_of(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        new = m.__class__.__new__(m.__class__)
        memo[id(m)] = new
        new.__dict__.update({k: copy.copy(v) if isinstance(v, dict | set) else v for k, v in m.__dict__.items()})
        new.__dict__["_modules"] = {k: None if c is None else copy_of(c) for k, c in m._modules.items()}
        return new

    return copy_of(model)


def _rewrite(graph: Graph, root: torch.nn.Module, report: ConvertReport, options: dict[str, Any]) -> None:
    """Swap every eligible conv (in ``root``) and fold the chains after them (in ``graph``)."""
    modules = dict(root.named_modules(remove_duplicate=False))
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(modules.get(str(node.target)),
                                                      torch.nn.Conv2d | torch.nn.ConvTranspose2d):
            continue
        name = str(node.target)
        conv = modules[name]
        why = _left_reason(conv)
        if why is not None:
            report.left[name] = why
            continue
        if isinstance(conv, torch.nn.ConvTranspose2d):  # converted, nothing fused after it
            parent, _, attr = name.rpartition(".")
            setattr(root.get_submodule(parent) if parent else root, attr, swapped(conv, **options))
            report.converted.append(name)
            continue
        chain, why = _chain(node, modules, calls[node.target])
        if chain is not None and conv.padding_mode != "zeros":  # FusedConv2d pads with zeros only
            chain, why = None, f"padding_mode={conv.padding_mode!r}: the padded copy runs before a plain conv"
        if chain is None:
            new: torch.nn.Module = Conv2d.from_module(conv, **options)
            if why:
                report.unfused[name] = why
        else:
            nodes, bn, res, relu, act = chain
            new = FusedConv2d.from_conv(conv, bn, res is not None, relu, act, **options)
            _replace(graph, nodes, res)
            report.fused[name] = new.fused_ops()  # type: ignore[operator]
        parent, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, attr, new)
        report.converted.append(name)
    graph.lint()


def _fold_branch_sums(graph: Graph, root: torch.nn.Module, report: ConvertReport,
                      options: dict[str, Any]) -> None:
    """Replace every sum of re-parameterisable branches over one input [-> ReLU] (torch/branches.py) with
    one :class:`BranchSum` call (a module added at the root as ``_cf_branches_<first conv's path>``), the
    branches' convs swapped for convforge ``Conv2d``s (what BranchSum runs in training). Only for a model
    fused in eval mode: a model fused for training keeps its conv -> batch norm chains (one node each)."""
    if root.training:
        return
    modules = dict(root.named_modules(remove_duplicate=False))
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    for node in reversed(list(graph.nodes)):
        if node.graph is not graph or _residual_operands(node) is None:
            continue  # erased by an earlier fold, or not an add
        if any(_residual_operands(u) is not None and len(node.users) == 1 for u in node.users):
            continue  # an inner add of a larger sum: its root takes it
        found = _branch_sum(node, modules, calls)
        if found is None:
            continue
        x, branches, inner = found
        if _preactivated(x, modules):
            continue  # _fold_preactivations folds its batch norm [and ReLU] into the branches' convs
        users = list(node.users)
        last = users[0] if len(users) == 1 and _is_relu(users[0], node, modules) else node
        names = [str(n.target) for n in inner if n.op == "call_module"
                 and isinstance(modules.get(str(n.target)), torch.nn.Conv2d)]
        path = "_cf_branches_" + names[0].replace(".", "_")
        swaps = {}
        for name in names:
            swaps[id(modules[name])] = new_conv = Conv2d.from_module(modules[name], **options)
            parent, _, attr = name.rpartition(".")
            setattr(root.get_submodule(parent) if parent else root, attr, new_conv)
        branches = [(None if c is None else swaps[id(c)], bn) for c, bn in branches]
        module = BranchSum(branches, last is not node, options).train(False)  # the model's mode (eval)
        root.add_module(path, module)
        with graph.inserting_before(last):
            new = graph.call_module(path, (x,))
        new.meta = dict(last.meta)
        last.replace_all_uses_with(new)
        for n in sorted(inner + [node] + ([last] if last is not node else []), key=_order(graph), reverse=True):
            graph.erase_node(n)
        report.converted += names
        report.fused[names[0]] = f"branches({module.ops()})"
    graph.lint()


def _preactivated(x: Node, modules: dict[str, Any]) -> bool:
    """Whether the branches' input ``x`` is a BatchNorm2d [-> ReLU] read only by convs (a pre-activation
    unit: one BN -> ReLU read by a conv and its shortcut conv): :func:`_fold_preactivations` folds it into
    their input loads, which costs no pass over x, where one folded conv of the branches would leave the batch
    norm and the ReLU to run as passes of their own."""
    bn = x
    if x.args and isinstance(x.args[0], Node) and _is_relu(x, x.args[0], modules):
        bn = x.args[0]
        if len(bn.users) != 1:
            return False
    if bn.op != "call_module" or type(modules.get(str(bn.target))) is not torch.nn.BatchNorm2d:
        return False
    return all(u.op == "call_module" and isinstance(modules.get(str(u.target)), torch.nn.Conv2d) for u in x.users)


def _order(graph: Graph) -> Any:
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index[n]


def _residual_operands(node: Node) -> tuple[Node, Node] | None:
    """The two operands of an out-of-place add (alpha 1), or None."""
    if not ((node.op == "call_function" and node.target in (operator.add, torch.add))
            or (node.op == "call_method" and node.target == "add")):
        return None
    if len(node.args) != 2 or set(node.kwargs) - {"alpha"} or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    return (a, b) if isinstance(a, Node) and isinstance(b, Node) else None


def _branch_sum(root: Node, modules: dict[str, Any],
                calls: Counter[Any]) -> tuple[Node, list[Branch], list[Node]] | None:
    """(input x, branches, the nodes they and the inner adds are) when ``root`` sums branches of one
    input that fold into one conv (torch/branches.py), else None. Every intermediate is read once,
    every module called once."""
    leaves, inner, stack = [], [], [root]
    while stack:
        n = stack.pop()
        ops = _residual_operands(n)
        if ops is not None and (n is root or len(n.users) == 1):
            if n is not root:
                inner.append(n)
            stack += [ops[1], ops[0]]
        else:
            leaves.append(n)

    def module(n: Node, kind: type) -> Any:
        m = modules.get(str(n.target)) if n.op == "call_module" else None
        ok = m is not None and type(m) in ((torch.nn.Conv2d, Conv2d) if kind is torch.nn.Conv2d else (kind,))
        return m if ok and calls[n.target] == 1 and len(n.args) == 1 and not n.kwargs else None

    parts: list[tuple[Node, Branch, list[Node]]] = []
    for leaf in leaves:
        bn = module(leaf, torch.nn.BatchNorm2d)
        src = leaf.args[0] if bn is not None else leaf
        conv = module(src, torch.nn.Conv2d) if isinstance(src, Node) else None
        if conv is not None and (bn is None or len(src.users) == 1) and _left_reason(conv) is None:  # type: ignore[union-attr]
            parts.append((src.args[0], (conv, bn),  # type: ignore[union-attr]
                          [src] + ([leaf] if bn is not None else [])))
        elif bn is not None:
            parts.append((src, (None, bn), [leaf]))  # type: ignore[arg-type]
        else:
            parts.append((leaf, (None, None), []))
    xs = {p[0] for p in parts if p[1][0] is not None}
    if len(xs) != 1:
        return None
    x = xs.pop()
    if any(p[0] is not x for p in parts) or any(len(n.users) != 1 for p in parts for n in p[2]):
        return None
    branches = [p[1] for p in parts]
    if branch_reason(branches) is not None:
        return None
    return x, branches, [n for p in parts for n in p[2]] + inner


def _fold_excitations(graph: Graph, root: torch.nn.Module, report: ConvertReport) -> None:
    """Replace every ``gate(fc2(act(fc1(avgpool(x))))) * x`` (torchvision's SqueezeExcitation: each
    intermediate used once) with one :class:`~convforge.torch.se.SqueezeExcite` call (a module added at the
    root as ``_cf_se_<fc1's path>``, holding references to the five modules, which stay where they are)."""
    modules = dict(root.named_modules(remove_duplicate=False))
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (operator.mul, torch.mul) or len(node.args) != 2 \
                or node.kwargs:
            continue
        for gate, x in (node.args, node.args[::-1]):
            chain = _excitation(gate, x, modules)
            if chain is None:
                continue
            path = "_cf_se_" + str(chain[1].target).replace(".", "_")
            while hasattr(root, path):
                path += "_"
            root.add_module(path, SqueezeExcite(*(modules[str(n.target)] for n in chain)))
            with graph.inserting_before(node):
                new = graph.call_module(path, (x,))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            for n in reversed(chain):
                graph.erase_node(n)
            report.excitations[str(chain[1].target)] = f"se({getattr(root, path).act}, {getattr(root, path).gate})"
            break
    graph.lint()


def _excitation(gate: Any, x: Any, modules: dict[str, Any]) -> list[Node] | None:
    """[pool, fc1, act, fc2, gate] call nodes ending at ``gate`` and starting from ``x``, each used once,
    that :func:`convforge.torch.se.kinds` takes; None otherwise."""
    chain: list[Node] = []
    node = gate
    for _ in range(5):
        if not isinstance(node, Node) or node.op != "call_module" or len(node.args) != 1 or node.kwargs \
                or len(node.users) != 1:
            return None
        chain.append(node)
        node = node.args[0]
    if node is not x:
        return None
    chain.reverse()
    return chain if se_kinds(*(modules.get(str(n.target)) for n in chain)) is not None else None


def _fold_preactivations(graph: Graph, root: torch.nn.Module, report: ConvertReport) -> None:
    """Fold every BatchNorm2d [-> ReLU] that only convforge convs read into those convs (module
    docstring), after ``_rewrite`` swapped the convs."""
    modules = dict(root.named_modules(remove_duplicate=False))
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    for node in list(graph.nodes):
        bn = modules.get(str(node.target)) if node.op == "call_module" else None
        if type(bn) is not torch.nn.BatchNorm2d or len(node.args) != 1 or node.kwargs:
            continue
        users = list(node.users)
        relu = users[0] if len(users) == 1 and _is_relu(users[0], node, modules) else None
        last = relu if relu is not None else node
        readers = list(last.users)
        if not readers or not all(_reads_raw(r, last, modules, calls, bn) for r in readers):
            continue
        path = "_cf_preact_" + str(node.target).replace(".", "_")
        while hasattr(root, path):
            path += "_"
        root.add_module(path, PreActivation(bn, relu is not None))
        with graph.inserting_before(node):
            new = graph.call_module(path, (node.args[0],))
        new.meta = dict(last.meta)
        last.replace_all_uses_with(new)
        for n in (relu, node):
            if n is not None:
                graph.erase_node(n)
        for r in readers:
            name = str(r.target)
            conv = modules[name]
            if not isinstance(conv, FusedConv2d):
                conv = FusedConv2d.from_conv(conv, algo=conv.algo, precision=conv.precision, max_error=conv.max_error,
                                             static_weights=conv.static_weights)
                parent, _, attr = name.rpartition(".")
                setattr(root.get_submodule(parent) if parent else root, attr, conv)
                modules[name] = conv
            conv.set_prologue(getattr(root, path))
            report.fused[name] = conv.fused_ops()
    graph.lint()


def _reads_raw(node: Node, src: Node, modules: dict[str, Any], calls: Counter[Any], bn: Any) -> bool:
    """Whether ``node`` is a convforge conv, its module called once, reading ``src`` as its input
    only (not as the residual of a fused add) with no prologue yet, over bn's channels."""
    m = modules.get(str(node.target)) if node.op == "call_module" else None
    if not isinstance(m, Conv2d) or calls[node.target] != 1 or not node.args or node.args[0] is not src:
        return False
    others = list(node.args[1:]) + list(node.kwargs.values())
    return (src not in others and getattr(m, "_cf_pre", None) is None and m.in_channels == bn.num_features
            and m.padding_mode == "zeros")


def _left_reason(m: torch.nn.Conv2d | torch.nn.ConvTranspose2d) -> str | None:
    """Why convforge never runs this conv (the device does not matter: CPU models fuse, and run
    PyTorch's ops until moved to CUDA)."""
    if isinstance(m, torch.nn.ConvTranspose2d):
        if type(m) not in (torch.nn.ConvTranspose2d, ConvTranspose2d):
            return f"a subclass of nn.ConvTranspose2d ({type(m).__name__}) whose forward may differ"
    elif type(m) not in (torch.nn.Conv2d, Conv2d):
        return f"a subclass of nn.Conv2d ({type(m).__name__}) whose forward may differ"
    return static_reason(m, on_cuda=False)


Chain = tuple[list[Node], Any, Node | None, bool, str]


def _chain(conv: Node, modules: dict[str, Any], calls: int) -> tuple[Chain | None, str | None]:
    """(nodes conv [bn] [add] [relu | silu | hardswish], bn module, residual node, relu, "silu" / "hardswish"
    / "") after ``conv``, or (None, why not: None when nothing fusable follows). SiLU and HardSwish only
    right after a batch norm (EfficientNet's and MobileNet-v3's conv -> BN -> activation)."""
    users = list(conv.users)
    if len(users) > 1:
        return None, f"output used {len(users)} times"
    if calls > 1:
        return None, f"module called {calls} times"
    if len(conv.args) != 1 or conv.kwargs or not users:
        return None, None
    nodes, bn, res, relu, act = [conv], None, None, False, ""
    nxt: Node | None = users[0]
    if nxt is not None and _is_bn(nxt, conv, modules):
        bn = modules[str(nxt.target)]
        nodes.append(nxt)
        nxt = _only_user(nxt)
    if nxt is not None:
        res = _residual(nxt, nodes[-1])
        if res is not None:
            nodes.append(nxt)
            nxt = _only_user(nxt)
    if nxt is not None and _is_relu(nxt, nodes[-1], modules):
        relu = True
        nodes.append(nxt)
    elif nxt is not None and bn is not None and res is None:
        act = _activation(nxt, nodes[-1], modules)
        if act:
            nodes.append(nxt)
    if len(nodes) == 1:
        return None, None
    return (nodes, bn, res, relu, act), None


def _only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_bn(node: Node, src: Node, modules: dict[str, Any]) -> bool:
    m = modules.get(str(node.target)) if node.op == "call_module" else None
    if m is None or type(m) is not torch.nn.BatchNorm2d:  # a subclass may change what it computes
        return False
    conv = modules[str(src.target)]
    return node.args == (src,) and not node.kwargs and m.num_features == conv.out_channels


def _residual(node: Node, src: Node) -> Node | None:
    """The other operand when ``node`` adds a tensor to ``src`` (alpha 1, no out=); an in-place
    add into the other operand only when nothing else reads it (the fused module does not write it)."""
    if node.op == "call_function" and node.target in _ADDS_F:
        inplace = _ADDS_F[node.target]  # type: ignore[index]
    elif node.op == "call_method" and node.target in _ADDS_M:
        inplace = _ADDS_M[str(node.target)]
    else:
        return None
    if len(node.args) != 2 or set(node.kwargs) - {"alpha"} or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    if a is src and isinstance(b, Node) and b is not src:
        return b
    if b is src and isinstance(a, Node) and a is not src and (not inplace or len(a.users) == 1):
        return a
    return None


def _is_relu(node: Node, src: Node, modules: dict[str, Any]) -> bool:
    if not node.args or node.args[0] is not src:
        return False
    extra = list(node.args[1:]) + [v for k, v in node.kwargs.items() if k == "inplace"]
    if len(extra) != len(node.args) - 1 + len(node.kwargs) or any(not isinstance(v, bool) for v in extra):
        return False  # only the inplace flag may come along
    if node.op == "call_module":
        return type(modules.get(str(node.target))) is torch.nn.ReLU and len(node.args) == 1 and not node.kwargs
    if node.op == "call_function":
        return node.target in _RELUS_F
    return node.op == "call_method" and node.target in ("relu", "relu_") and len(extra) == 0


def _activation(node: Node, src: Node, modules: dict[str, Any]) -> str:
    """"silu" / "hardswish" when ``node`` applies that activation to ``src`` alone (``nn.SiLU`` /
    ``nn.Hardswish`` modules, ``F.silu`` / ``F.hardswish``, an ``inplace`` flag allowed), else ""."""
    if node.args[:1] != (src,) or len(node.args) > 2 or set(node.kwargs) - {"inplace"}:
        return ""
    if any(not isinstance(v, bool) for v in (*node.args[1:], *node.kwargs.values())):
        return ""
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        return _ACTS_M.get(type(modules.get(str(node.target))), "")
    if node.op == "call_function":
        return _ACTS_F.get(node.target, "")  # type: ignore[arg-type]
    return ""


def _replace(graph: Graph, nodes: list[Node], res: Node | None) -> None:
    """One call of the conv's module (now fused) in place of the chain."""
    conv, last = nodes[0], nodes[-1]
    with graph.inserting_before(last):
        new = graph.call_module(str(conv.target), (conv.args[0],) + ((res,) if res is not None else ()))
    new.meta = dict(last.meta)
    last.replace_all_uses_with(new)
    for n in reversed(nodes):
        graph.erase_node(n)


def _swap_pools(graph: Graph, root: torch.nn.Module, report: ConvertReport) -> None:
    """Swap every ``nn.MaxPool2d`` (the class itself, without ``return_indices``) for convforge's
    (torch/pool.py: one pass each way where PyTorch's backward scatters through int64 indices)."""
    modules = dict(root.named_modules(remove_duplicate=False))
    for node in graph.nodes:
        m = modules.get(str(node.target)) if node.op == "call_module" else None
        if not isinstance(m, torch.nn.MaxPool2d) or type(m) is not torch.nn.MaxPool2d or m.return_indices:
            continue
        name = str(node.target)
        if name in report.pools:  # one module called at several places: swapped once
            continue
        parent, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, attr, MaxPool2d.from_module(m))
        report.pools.append(name)


def _fuse_linears(graph: Graph, root: torch.nn.Module, report: ConvertReport, options: dict[str, Any]) -> None:
    """Swap ``nn.Linear`` -> GELU, and ``nn.Linear`` -> permute(0, 3, 1, 2) -> layer scale * . ->
    [stochastic depth] -> + residual (ConvNeXt's blocks), for one :class:`FusedLinear` call
    (every intermediate used once, the linear module called once)."""
    modules = dict(root.named_modules(remove_duplicate=False))
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    for node in list(graph.nodes):
        lin = modules.get(str(node.target)) if node.op == "call_module" else None
        if type(lin) is not torch.nn.Linear or calls[node.target] != 1 or len(node.args) != 1 or node.kwargs:
            continue
        nxt = _only_user(node)
        if nxt is None:
            continue
        if _is_gelu(nxt, node, modules):
            norm = _lone_layer_norm(node, lin, modules, calls)
            new = FusedLinear.from_linear(lin, gelu=True, norm=norm, **options)
            _replace(graph, [node, nxt], None)
        else:
            found = _scaled_residual(nxt, node, root)
            if found is None:
                continue
            nodes, scale, res, drop = found
            new = FusedLinear.from_linear(lin, nchw=True, scale=scale, residual=True, drop=drop, **options)
            getter = next(a for a in nodes[1].args if isinstance(a, Node) and a.op == "get_attr")
            _replace(graph, [node, *nodes], res)
            if not getter.users:
                graph.erase_node(getter)
        name = str(node.target)
        parent, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, attr, new)
        report.linears[name] = new.fused_ops()
    graph.lint()


def _swap_row_norms(graph: Graph, root: torch.nn.Module, report: ConvertReport) -> None:
    """Each ``F.layer_norm(x, (C,), weight, bias, eps)`` whose weight and bias are attributes of modules
    (torchvision's ``LayerNorm2d``) becomes a call of a :class:`RowNorm` added to the root as
    ``_cf_norm_<weight's path>``."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is F.layer_norm):
            continue
        given = dict(zip(names, node.args, strict=False))  # fx records weight, bias and eps as keywords
        if len(node.args) > len(names) or set(given) & set(node.kwargs) or set(node.kwargs) - set(names):
            continue
        given.update(node.kwargs)
        x, shape, w, b, eps = (given.get(k, 1e-5 if k == "eps" else None) for k in names)
        if not isinstance(x, Node):
            continue
        if not (isinstance(shape, list | tuple) and len(shape) == 1 and isinstance(shape[0], int)
                and isinstance(eps, float) and isinstance(w, Node) and isinstance(b, Node)
                and w.op == "get_attr" and b.op == "get_attr"):
            continue
        refs = []
        for t in (w, b):
            owner_path, _, attr = str(t.target).rpartition(".")
            refs.append((root.get_submodule(owner_path) if owner_path else root, attr))
        path = "_cf_norm_" + str(w.target).replace(".", "_")
        root.add_module(path, RowNorm(shape[0], refs[0], refs[1], eps))
        with graph.inserting_before(node):
            new = graph.call_module(path, (x,))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for t in (w, b):
            if not t.users:
                graph.erase_node(t)
        report.norms.append(str(w.target).rpartition(".")[0])
    graph.lint()


def _lone_layer_norm(node: Node, lin: torch.nn.Linear, modules: dict[str, Any], calls: Counter[Any]) -> Any:
    """The ``nn.LayerNorm`` over ``lin``'s input features whose output only ``node`` reads, taken out of the
    graph (``node`` reads its input instead; the module stays where the model has it), or None."""
    src = node.args[0]
    if not (isinstance(src, Node) and src.op == "call_module" and len(src.args) == 1 and not src.kwargs
            and len(src.users) == 1 and calls[src.target] == 1 and isinstance(src.args[0], Node)):
        return None
    norm = modules.get(str(src.target))
    if norm is None or type(norm) is not torch.nn.LayerNorm or tuple(norm.normalized_shape) != (lin.in_features,):
        return None
    node.args = (src.args[0],)
    graph = node.graph
    graph.erase_node(src)
    return norm


def _is_gelu(node: Node, src: Node, modules: dict[str, Any]) -> bool:
    """``nn.GELU()`` or ``F.gelu`` (the exact form) of ``src``."""
    if node.args != (src,):
        return False
    if node.op == "call_module":
        m = modules.get(str(node.target))
        return isinstance(m, torch.nn.GELU) and type(m) is torch.nn.GELU and m.approximate == "none" and not node.kwargs
    return (node.op == "call_function" and node.target is F.gelu
            and set(node.kwargs) <= {"approximate"} and node.kwargs.get("approximate", "none") == "none")


def _scaled_residual(node: Node, src: Node, root: torch.nn.Module) -> tuple[list[Node], Any, Node, Any] | None:
    """(nodes permute, mul [, stochastic depth], add; (owner, attribute) of the scale; the residual; the
    StochasticDepth module or None) when ``node`` starts ConvNeXt's tail after ``src``, else None."""
    dims = list(node.args[1:]) if node.op == "call_method" else (list(node.args[1:]) or [None])
    if len(dims) == 1 and isinstance(dims[0], list | tuple):
        dims = list(dims[0])
    if not (node.target in ("permute", torch.permute) and node.args[0] is src and dims == [0, 3, 1, 2]
            and not node.kwargs):
        return None
    mul = _only_user(node)
    if mul is None or mul.op != "call_function" or mul.target not in (operator.mul, torch.mul) or mul.kwargs:
        return None
    other = [a for a in mul.args if a is not node]
    if len(mul.args) != 2 or len(other) != 1 or not isinstance(other[0], Node) or other[0].op != "get_attr":
        return None
    owner_path, _, attr = str(other[0].target).rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    scale = getattr(owner, attr, None)
    if not isinstance(scale, torch.Tensor) or scale.dim() != 3 or tuple(scale.shape[1:]) != (1, 1):
        return None
    nodes, last, drop = [node, mul], mul, None
    nxt = _only_user(mul)
    if nxt is not None and _is_eval_stochastic_depth(nxt, mul):
        nodes.append(nxt)
        last, nxt = nxt, _only_user(nxt)
    elif nxt is not None and nxt.op == "call_module" and nxt.args == (mul,) and not nxt.kwargs:
        drop = root.get_submodule(str(nxt.target))
        if not _is_stochastic_depth_module(drop):
            return None
        nodes.append(nxt)
        last, nxt = nxt, _only_user(nxt)
    res = _residual(nxt, last) if nxt is not None else None
    if res is None:
        return None
    return [*nodes, nxt], (owner, attr), res, drop  # type: ignore[list-item]


def _is_eval_stochastic_depth(node: Node, src: Node) -> bool:
    """torchvision's ``stochastic_depth(x, p, mode, training=False)`` called as a function: the identity."""
    fn = node.target
    if node.op != "call_function" or getattr(fn, "__name__", "") != "stochastic_depth":
        return False
    if not getattr(fn, "__module__", "").startswith("torchvision."):
        return False
    args = list(node.args) + [node.kwargs.get(k) for k in ("p", "mode", "training") if k in node.kwargs]
    return len(args) == 4 and args[0] is src and args[3] is False


def _graph_module(root: torch.nn.Module, graph: Graph, class_name: str) -> GraphModule:
    """A GraphModule over ``graph`` whose hierarchy is ``root``'s, every module kept (GraphModule
    alone keeps only those the graph calls, so a folded batch norm would leave state_dict)."""
    gm = GraphModule(root, graph, class_name)
    attrs = {str(n.target): _fetch(gm, str(n.target)) for n in graph.nodes if n.op == "get_attr"}
    gm._modules.clear()
    gm._modules.update(root._modules)
    gm.__dict__["_parameters"] = copy.copy(root._parameters)
    gm.__dict__["_buffers"] = copy.copy(root._buffers)
    gm.__dict__["_non_persistent_buffers_set"] = set(root._non_persistent_buffers_set)
    for target, value in attrs.items():  # constants fx made (``_tensor_constant0``) and the like
        if _fetch(gm, target) is None:
            owner, _, attr = target.rpartition(".")
            setattr(gm.get_submodule(owner) if owner else gm, attr, value)
    return gm


def _fetch(m: Any, target: str) -> Any:
    for part in target.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m
