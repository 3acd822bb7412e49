"""The compiled network: a fixed launch list over preallocated buffers.

``compile(model, batch=..., backend=...)`` runs the passes, plans activation memory by liveness,
gets every conv (and fully connected layer, a 1x1 conv on a 1x1 image) from
``convforge.dispatch.executable`` -- the one dispatch path -- and builds the other operations from
:mod:`convforge.graph.ops` into one program. On CUDA the launch list is captured once into a CUDA
graph and replayed; on OpenCL it is enqueued in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from convforge import dispatch
from convforge.backends.base import Work, plan_work
from convforge.codegen.dialect import Storage
from convforge.codegen.render import render
from convforge.dtypes import to_storage
from convforge.graph import ops
from convforge.graph.ir import (
    Graph,
    Node,
    Tensor,
    channel_affine,
    conv_geometry,
    conv_group,
    conv_spec,
    infer,
    resize_table,
)
from convforge.plan import INT32_MAX, Epilogue, Launch, Prologue
from convforge.spec import ConvSpec, parse_dtype

log = logging.getLogger("convforge.graph")
ALIASES = ("flatten", "dropout", "reshape")  # views: the output is the input's buffer


@dataclass
class Step:
    """One entry of the launch list: a node's work, callable with no arguments."""

    node: str
    op: str
    variant: str
    run: Callable[[], None]
    flops: int = 0


@dataclass(frozen=True)
class _ConvCall:
    """A conv node as :meth:`Network._conv` chose it: what ``dispatch.executable`` is asked for."""

    node: Node
    spec: ConvSpec
    epilogue: Epilogue
    prologue: Prologue
    named: dict[str, Any]
    bufs: dict[str, Any]


@dataclass
class MemoryPlan:
    """Activation slots: tensor -> slot index, and each slot's size in bytes."""

    slot_of: dict[str, int] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(self.sizes)


def plan_memory(graph: Graph, shapes: dict[str, Tensor], into: dict[str, str] | None = None,
                itemsize: int = 4) -> MemoryPlan:
    """Assign activation tensors to reusable slots by liveness (best fit; an output never shares
    a slot with its node's inputs, so kernels need not be safe in place). ``into`` maps a conv's
    output to the concat tensor it is written into (placed when its first part is written);
    ``itemsize``: bytes per element of the activations' dtype."""
    into = into or {}
    inplace = set(into.values())
    root = {graph.input: graph.input}
    for node in graph.nodes:
        root[node.output] = (root[node.inputs[0]] if node.op in ALIASES else into.get(node.output, node.output))
    last: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for t in node.inputs:
            last[root[t]] = i
    for t in graph.outputs:
        last[root[t]] = len(graph.nodes)
    mp = MemoryPlan()
    free: list[int] = []

    def place(t: str) -> None:
        need = shapes[t].size * itemsize
        fits = [s for s in free if mp.sizes[s] >= need]
        slot = min(fits, key=lambda s: mp.sizes[s]) if fits else (max(free, key=lambda s: mp.sizes[s])
                                                                   if free else None)
        if slot is None:
            slot = len(mp.sizes)
            mp.sizes.append(need)
        else:
            free.remove(slot)
            mp.sizes[slot] = max(mp.sizes[slot], need)
        mp.slot_of[t] = slot

    place(graph.input)
    for i, node in enumerate(graph.nodes):
        r = root[node.output]
        if node.op not in ALIASES and r not in mp.slot_of and not (node.op == "concat" and r in inplace):
            place(r)
        for t in {root[t] for t in node.inputs}:
            if last.get(t) == i:
                free.append(mp.slot_of[t])
    for t, r in root.items():
        mp.slot_of[t] = mp.slot_of[r]
    return mp


def _check_op_widths(graph: Graph, shapes: dict[str, Tensor]) -> None:
    """The op kernels (ops.py) index with 32-bit ints: a tensor of a non-conv node past 2^31 - 1
    elements is refused before anything is allocated (a conv's width is its variant's business)."""
    for node in graph.nodes:
        if node.op in ("conv", "fc", "deconv") or node.op in ALIASES:
            continue
        for t in (*node.inputs, node.output):
            if shapes[t].size > INT32_MAX:
                raise ValueError(f"node {node.name!r} ({node.op}): needs 64-bit indexing: tensor {shapes[t]} has "
                                 f"{shapes[t].size} elements, more than the 2^31 - 1 its kernel addresses")


class Network:
    """A graph compiled for one back-end and batch: call it with an NCHW float32 batch.

    ``dtype`` (float32, float16, bfloat16) is how activations and conv weights (and biases) are
    stored through every op; arithmetic is float32, per-channel affine parameters stay float32.
    ``max_errors``: a bound on the error of the variant chosen for each named conv / fc node
    (``dispatch.choose``'s ``max_error``; the others keep the precision class's choice):
    calibration's per-layer tightening (``convforge.graph.network_calibration``)."""

    def __init__(self, graph: Graph, backend: Any, capture: bool = True,
                 workspace_limit: int | None = None, dtype: str = "float32",
                 max_errors: dict[str, float] | None = None) -> None:
        self.graph, self.backend, self.workspace_limit = graph, backend, workspace_limit
        self.dtype = parse_dtype(dtype)
        self.st = Storage(self.dtype)
        self.max_errors = dict(max_errors or {})
        self.calibration: Any = None  # the CalibrationReport of a calibrated build (convforge.compile)
        self.shapes = infer(graph)
        _check_op_widths(graph, self.shapes)
        self.into = self._concats_in_place()
        self.memory = plan_memory(graph, self.shapes, {t: c for t, (c, _) in self.into.items()},
                                  self.st.itemsize)
        self.slots = [backend.empty(max(n, 4)) for n in self.memory.sizes]
        self.weights: dict[str, Any] = {}
        self.steps: list[Step] = []
        self._kernels: list[tuple[str, str, ops.OpLaunch]] = []
        self._execs: list[Any] = []
        self._order: list[str] = []  # step names in launch order
        self.transformed_bytes = 0  # filters transformed once at build (Winograd U, packed weights)
        self._convs: list[tuple[Any, dict[str, Any]]] = []  # (executable, the buffers its layer binds)
        self._pending: list[_ConvCall] = []  # convs chosen, not yet compiled
        self.compiled_ahead = 0  # programs this build compiled (the others came from a cache)
        self.arena: list[Any] = []  # the scratch workspace every conv shares, one buffer per rank
        for node in graph.nodes:
            self._build(node)
        self._compile_ahead()
        for call in self._pending:
            self._conv_executable(call)
        self._bind_workspaces()
        self._link_kernels()
        self.run_eager()  # compile, allocate workspaces: nothing of that happens in a capture
        backend.synchronize()
        # the captured graph's replay, or None: enqueue in order (no bound method on self: a network
        # holds device memory, and a reference cycle would keep it until the garbage collector runs)
        self._replay: Callable[[], None] | None = None
        self.captured = False
        if capture:
            self.capture()

    def capture(self) -> bool:
        """Capture the launch list into a CUDA graph (CUDA only; once): replays then launch it.
        Whether the network replays a captured graph now."""
        if self.captured or self.backend.name != "cuda":
            return self.captured
        try:
            self._replay, self.captured = self.backend.capture(self.run_eager), True
        except Exception as err:  # noqa: BLE001 - a launch that cannot be captured: enqueue in order
            log.warning("CUDA graph capture failed (%s); the network enqueues its launches instead", err)
        self.backend.synchronize()
        return self.captured

    def choice(self, node: Node, max_error: float | None = None) -> Any:
        """dispatch's choice for a conv/fc node with its plain epilogue (bias, ReLU) and prologue,
        under ``max_error`` (default: the node's bound in ``max_errors``, if any)."""
        spec = conv_spec(node, self.shapes[node.inputs[0]], self.dtype)
        bound = self.max_errors.get(node.name) if max_error is None else max_error
        return dispatch.choose(spec, self.backend, epilogue_of(node), workspace_limit=self.workspace_limit,
                               max_error=bound, prologue=prologue_of(node))

    def _concats_in_place(self) -> dict[str, tuple[str, int]]:
        """conv output -> (concat tensor, channel offset) for the concats the passes marked, where
        every producer's chosen variant writes at a channel offset; the others keep their copies."""
        out: dict[str, tuple[str, int]] = {}
        for node in self.graph.nodes:
            if node.op != "concat" or not node.attrs.get("in_place"):
                continue
            prods = [self.graph.producer(t) for t in node.inputs]
            if all(p is not None and self.choice(p).variant.offset_ok for p in prods):
                off = 0
                for t in node.inputs:
                    out[t] = (node.output, off)
                    off += self.shapes[t].shape[1]
        return out

    # -- buffers --------------------------------------------------------------------------------
    def buf(self, tensor: str) -> Any:
        return self.slots[self.memory.slot_of[tensor]]

    def _weight(self, key: str, array: np.ndarray | None = None, dtype: str = "float32") -> Any:
        """A weight on the device, stored as ``dtype`` (conv filters and biases: the network's)."""
        if key not in self.weights:
            arr = self.graph.weights[key] if array is None else array
            self.weights[key] = self.backend.upload(to_storage(np.asarray(arr, dtype=np.float32), dtype))
        return self.weights[key]

    @property
    def weight_bytes(self) -> int:
        return sum(self.backend.nbytes(b) for b in self.weights.values())

    @property
    def arena_bytes(self) -> int:
        """The shared scratch workspace (the largest need of any conv, rank by rank)."""
        return sum(self.backend.nbytes(b) for b in self.arena)

    @property
    def workspace_bytes(self) -> int:
        """Conv workspaces: the shared arena plus any an executable holds itself (none when the
        network supplies them all; counted once per executable shared by layers of one shape)."""
        unique = {id(e): e for e in self._execs}.values()
        return self.arena_bytes + sum(e.own_bytes for e in unique)

    @property
    def peak_bytes(self) -> int:
        """Device memory the network holds: activations, weights, transformed filters, workspaces."""
        return self.memory.bytes + self.weight_bytes + self.transformed_bytes + self.workspace_bytes

    # -- building -------------------------------------------------------------------------------
    def _build(self, node: Node) -> None:
        x = self.shapes[node.inputs[0]]
        if node.op in ALIASES:
            return
        if node.op in ("conv", "fc"):
            self._conv(node, x)
            return
        if node.op in ("act", "binary", "resize", "pad", "deconv"):
            self._build_onnx_op(node, x)
            return
        src, dst, st = node.inputs[0], node.output, self.st
        y = self.shapes[dst]
        if node.op == "pool":
            self._kernel(node, ops.pool(node, x, y, src, dst, st))
        elif node.op == "lrn":
            self._kernel(node, ops.lrn(node, x, src, dst, st))
        elif node.op == "relu":
            self._kernel(node, ops.activation(node, x, src, dst, st))
        elif node.op == "softmax":
            self._kernel(node, ops.softmax(node, x, src, dst, st))
        elif node.op == "add":
            self._kernel(node, ops.add(node, x, list(node.inputs), dst, bool(node.attrs.get("relu")), st))
        elif node.op in ("batchnorm", "scale"):
            a, b = channel_affine(self.graph, node)
            self._weight(f"{node.name}.a", a)
            self._weight(f"{node.name}.b", b)
            self._kernel(node, ops.affine(node, x, src, dst, f"{node.name}.a", f"{node.name}.b",
                                          bool(node.attrs.get("relu")), st))
        elif node.op == "concat" and node.inputs[0] in self.into:
            return  # its producers wrote their channels in place
        elif node.op == "concat":
            off = 0
            for part, t in enumerate(node.inputs):
                self._kernel(node, ops.copy_into(node, self.shapes[t], y.shape[1], off, t, dst, part, st))
                off += self.shapes[t].shape[1]
        else:
            raise ValueError(f"node {node.name!r}: the runtime has no kernel for op {node.op!r}")

    def _build_onnx_op(self, node: Node, x: Tensor) -> None:
        """The ops of modern CNNs' ONNX exports (ir.py): act, binary, resize, pad, deconv."""
        src, dst, st = node.inputs[0], node.output, self.st
        y = self.shapes[dst]
        if node.op == "act":
            self._kernel(node, ops.unary(node, x, src, dst, st))
        elif node.op == "binary":
            const = len(node.inputs) == 1
            other = tuple(self.graph.weights[node.weights["b"]].shape) if const else self.shapes[node.inputs[1]].shape
            srcs = (src, node.weights["b"] if const else node.inputs[1])
            if const:
                self._weight(node.weights["b"])
            self._kernel(node, ops.binary(node, x, other, y, srcs, dst, const, st))
        elif node.op == "resize":
            keys = (f"{node.name}.rows", f"{node.name}.cols")
            for key, axis in zip(keys, (2, 3), strict=True):
                self._weight(key, resize_table(x.shape[axis], y.shape[axis], node.attrs["scale"][axis - 2],
                                               node.attrs["mode"], node.attrs["coord"],
                                               node.attrs.get("nearest", "round_prefer_floor")))
            self._kernel(node, ops.resize(node, x, y, src, dst, *keys, st))
        elif node.op == "pad":
            self._kernel(node, ops.pad(node, x, y, src, dst, st))
        else:
            self._deconv(node, x, y)

    def _deconv(self, node: Node, x: Tensor, y: Tensor) -> None:
        """A transposed convolution through dispatch's dgrad pass: the input gradient of the conv
        whose input has the transposed output's shape (``deconv_spec``), the deconv's input in that
        pass's dy buffer "y", its output in dx "x"; bias and ReLU after it in one affine kernel."""
        spec = deconv_spec(node, x, y, self.dtype)
        bufs = {"y": self.buf(node.inputs[0]), "w": self._weight(node.weights["w"], dtype=self.dtype),
                "x": self.buf(node.output)}
        try:
            exe = dispatch.executable(spec, self.backend, Epilogue(), workspace_limit=self.workspace_limit)
        except ValueError as err:
            raise ValueError(f"node {node.name!r} (deconv: a transposed convolution as the dgrad of "
                             f"{spec.short()}): {err}") from None
        self._execs.append(exe)
        self._convs.append((exe, bufs))
        self._order.append(node.name)
        self.steps.append(Step(node.name, node.op, exe.plan.describe(), _conv_call(exe, bufs), spec.flops))
        relu = bool(node.attrs.get("relu"))
        if "bias" in node.weights or relu:
            b = self.graph.weights[node.weights["bias"]] if "bias" in node.weights else np.zeros(y.shape[1])
            one, shift = f"{node.name}.one", f"{node.name}.shift"
            self._weight(one, np.ones(y.shape[1]))
            self._weight(shift, b)
            tail = Node(node.name + "+bias", "scale", [node.output], node.output, {"relu": relu})
            self._kernel(tail, ops.affine(tail, y, node.output, node.output, one, shift, relu, self.st))

    def _kernel(self, node: Node, launch: ops.OpLaunch) -> None:
        if node.name not in self._order:
            self._order.append(node.name)
        self._kernels.append((node.name, "lrn+pool" if node.attrs.get("lrn") else node.op, launch))

    def _conv(self, node: Node, x: Tensor) -> None:
        """A conv or fc through dispatch; a fused residual needs a variant with a residual store
        path (``Variant.residual_ok``), else the conv runs plain and a separate add follows. The
        choice is made here; the executable after :meth:`_compile_ahead` (``_conv_executable``)."""
        spec = conv_spec(node, x, self.dtype)
        has_bias = "bias" in node.weights
        relu = bool(node.attrs.get("relu"))
        bufs = {"x": self.buf(node.inputs[0]), "w": self._weight(node.weights["w"], dtype=self.dtype),
                "y": self.buf(node.output)}
        if has_bias:
            bufs["bias"] = self._weight(node.weights["bias"], dtype=self.dtype)
        pro = prologue_of(node)  # its scale and shift stay float32, as a batch norm's parameters do
        bufs.update({name: self._weight(node.weights[name]) for name in pro.buffers()})
        residual = node.inputs[1] if len(node.inputs) > 1 else None
        plain = epilogue_of(node)
        choice = self.choice(node)
        named: dict[str, Any] = dict(algo=choice.variant.name, params=choice.params, prologue=pro)
        if node.output in self.into:
            concat, off = self.into[node.output]
            epi = replace(plain, k_total=self.shapes[concat].shape[1], k_offset=off)
        elif residual is not None and choice.variant.residual_ok:
            epi = replace(plain, residual=True)
            bufs["res"] = self.buf(residual)
        else:
            epi = plain if residual is None else Epilogue(bias=has_bias)
            named = dict(workspace_limit=self.workspace_limit, max_error=self.max_errors.get(node.name), prologue=pro)
        dispatch.choose(spec, self.backend, epi, **named)  # chosen here, on this thread (it may tune)
        self._order.append(node.name)
        self._pending.append(_ConvCall(node, spec, epi, pro, named, bufs))
        if residual is not None and not epi.residual:
            y = self.shapes[node.output]
            add = Node(node.name + "+add", "add", [node.output, residual], node.output, {"relu": relu})
            self._kernel(add, ops.add(add, y, [node.output, residual], node.output, relu, self.st))

    def _conv_executable(self, call: _ConvCall) -> None:
        """The compiled executable of a conv chosen by :meth:`_conv`, and its step."""
        exe = dispatch.executable(call.spec, self.backend, call.epilogue, **call.named)
        self._execs.append(exe)
        self._convs.append((exe, call.bufs))
        self.steps.append(Step(call.node.name, call.node.op, exe.plan.describe() + call.prologue.tag()
                               + call.epilogue.tag(), _conv_call(exe, call.bufs), call.spec.flops))

    def _compile_ahead(self) -> None:
        """Every program the network runs -- each conv's plan and the operations' program --
        compiled at once on several threads (``Backend.compile_ahead``), before the executables
        are made one by one: those then find them built."""
        be = self.backend
        work = []
        for call in self._pending:
            ch = dispatch.choose(call.spec, be, call.epilogue, **call.named)
            try:
                plan = ch.variant.plan_for(call.spec, ch.params, be.device, call.epilogue, call.prologue)
            except ValueError:  # said when its executable is made
                continue
            work.append(plan_work(plan, be.name, {name: be.nbytes(buf) for name, buf in call.bufs.items()}))
        ops_work = self._ops_work()
        if ops_work is not None:
            work.append(ops_work)
        self.compiled_ahead = be.compile_ahead(work, f"{self.graph.name}'s kernels")

    def _ops_work(self) -> Work | None:
        """The operations' program (:meth:`_link_kernels`) with its launches and buffer sizes."""
        if not self._kernels:
            return None
        kernels = tuple({k.kernel.name: k.kernel for _, _, k in self._kernels}.values())
        launches = tuple(Launch(ol.kernel.name, ol.grid, ol.kernel.block, ol.args) for _, _, ol in self._kernels)
        sizes = {a: self.backend.nbytes(self.weights[a]) if a in self.weights else
                 self.memory.sizes[self.memory.slot_of[a]] for _, _, ol in self._kernels for a in ol.args}
        return Work(self._ops_source(kernels), kernels, launches, tuple(sizes.items()))

    def _ops_source(self, kernels: tuple[Any, ...] | list[Any]) -> str:
        return render(list(kernels), self.backend.name, f"{self.graph.name} operations")

    def _bind_workspaces(self) -> None:
        """Give every conv its workspace, then run the weight-only steps once.

        The launch list runs in order on one stream, so a conv's scratch workspace is dead once
        its launches are done: one arena serves every layer. A plan's scratch buffers are ranked
        by size and the arena holds one buffer per rank, sized to the largest need at that rank,
        so it costs about the largest single layer's workspace, not the sum over layers (buffers
        rather than offsets into one allocation: back-ends need no sub-buffer views). The filter-
        derived buffers (Winograd U, packed weights) live for the whole run: each layer gets its
        own, filled here by the plan's weight steps (``transformed_bytes``).

        The runtime sets no workspace budget of its own (the fastest variant is kept): the
        arena already costs only the largest layer's need. Where that one layer is huge (im2col,
        non-fused Winograd F2 on a big layer), pass ``workspace_limit`` (bytes) to
        :func:`compile` (``convforge run --workspace-limit MIB``): dispatch then picks, per layer,
        only variants whose whole workspace (scratch and filter transforms) fits, so the network
        holds at most weights + activations + transformed filters + ``limit``.
        """
        ranks: list[int] = []
        scratch_of: list[list[str]] = []
        for exe, _ in self._convs:
            sizes = dict(exe.plan.workspace)
            names = sorted((n for n in sizes if n not in exe.derived), key=lambda n: -sizes[n])
            for i, name in enumerate(names):
                if i == len(ranks):
                    ranks.append(0)
                ranks[i] = max(ranks[i], sizes[name])
            scratch_of.append(names)
        self.arena = [self.backend.empty(max(n, 4)) for n in ranks]
        for (exe, bufs), names in zip(self._convs, scratch_of, strict=True):
            bufs.update({name: self.arena[i] for i, name in enumerate(names)})
            if not exe.weight_steps:
                continue
            sizes = dict(exe.plan.workspace)
            for name in exe.derived:  # the workspace only the weight steps write: this layer's own
                bufs[name] = self.backend.empty(sizes[name])
                self.transformed_bytes += self.backend.nbytes(bufs[name])
            exe(bufs, "weights")

    def _link_kernels(self) -> None:
        """Compile every non-conv kernel in one program and put its launches in graph order."""
        if not self._kernels:
            return
        kernels = list({k.kernel.name: k.kernel for _, _, k in self._kernels}.values())
        be = self.backend
        program = be.program(self._ops_source(kernels))
        by_node: dict[str, list[Callable[[], None]]] = {}
        for name, _, ol in self._kernels:
            fn = be.function(program, ol.kernel)
            step = Launch(ol.kernel.name, ol.grid, ol.kernel.block, ol.args)
            args = [self.weights[a] if a in self.weights else self.buf(a) for a in ol.args]
            by_node.setdefault(name, []).append(_launcher(be, program, fn, ol.kernel, step, args))
        steps = {s.node: s for s in self.steps}
        for name, op, _ in self._kernels:
            if name not in steps:
                steps[name] = Step(name, op, "graph_op", _sequence(by_node[name]))
        self.steps = [steps[name] for name in self._order]

    # -- running --------------------------------------------------------------------------------
    def run_eager(self) -> None:
        """Enqueue every launch in order (the replay's content)."""
        for step in self.steps:
            step.run()

    def replay(self) -> None:
        """The captured launch list (CUDA graph) or the in-order enqueue (OpenCL)."""
        if self._replay is None:
            self.run_eager()
        else:
            self._replay()

    def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """Run on a host batch (rounded to the network's dtype); returns every graph output as
        float32 NumPy (holding values of the dtype)."""
        want = self.shapes[self.graph.input].shape
        x = np.ascontiguousarray(x, dtype=np.float32)
        if tuple(x.shape) != want:
            raise ValueError(f"input shape {tuple(x.shape)} does not match the network's {want}")
        self.backend.synchronize()
        self.backend.write(self.buf(self.graph.input), to_storage(x, self.dtype))
        self.replay()
        self.backend.synchronize()
        return {t: self.backend.download(self.buf(t), self.shapes[t].shape, self.dtype) for t in self.graph.outputs}

    def profile(self, repeats: int = 5, warmup: bool = True,
                on_step: Callable[[], None] | None = None) -> list[tuple[Step, float]]:
        """Each step timed alone with device events (a separate pass, not the replay): median ms,
        after one untimed run of the step (``warmup``); ``on_step`` is called as each is done."""
        _check_repeats(repeats)
        out = []
        for step in self.steps:
            if warmup:
                step.run()
            times = self.backend.time_ms(step.run, repeats)
            out.append((step, float(np.median(times))))
            if on_step is not None:
                on_step()
        return out

    def time_ms(self, repeats: int = 10, warmup: bool = True) -> float:
        """Median device time of one replay of the whole network, after one untimed (``warmup``)."""
        _check_repeats(repeats)
        if warmup:
            self.replay()
        return float(np.median(self.backend.time_ms(self.replay, repeats)))


def _check_repeats(repeats: int) -> None:
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats ({repeats!r}) must be an int >= 1")


def _conv_call(exe: Any, bufs: dict[str, Any]) -> Callable[[], None]:
    """The launches of one conv on its layer's buffers (bound later by ``_bind_workspaces``);
    its weight-only steps ran at build time."""
    steps = "rest" if exe.weight_steps else "all"

    def run() -> None:
        exe(bufs, steps)

    return run


def _launcher(be: Any, program: Any, fn: Any, kernel: Any, step: Launch, args: list[Any]) -> Callable[[], None]:
    def run() -> None:
        be.launch(program, fn, kernel, step, args)

    return run


def _sequence(calls: list[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for call in calls:
            call()

    return run


def epilogue_of(node: Node) -> Epilogue:
    """The plain epilogue of a conv / fc node: its bias and its fused activation (ReLU, or
    ``attrs["act"]``: SiLU, HardSwish, GELU, Mish), as the tuning database keys it."""
    act = node.attrs.get("act")
    return Epilogue(bias="bias" in node.weights, relu=bool(node.attrs.get("relu")), silu=act == "silu",
                    hardswish=act == "hardswish", gelu=act == "gelu", mish=act == "mish")


def deconv_spec(node: Node, x: Tensor, y: Tensor, dtype: str = "float32") -> ConvSpec:
    """The dgrad problem of a deconv node (ONNX ConvTranspose) with input ``x`` and output ``y``: the
    conv of ``y``'s shape into ``x``'s, whose filters (C_out = x's channels, C_in / group, R, S) are
    the deconv's own, as ``convforge.grad.conv2d_input`` poses it."""
    (r, s), st, pad, dil = conv_geometry(node)
    n, k, _, _ = x.shape
    _, c, h, w = y.shape
    return ConvSpec(n, c, h, w, k, r, s, st, pad, dil, dtype=dtype, groups=conv_group(node), conv_pass="dgrad")


def prologue_of(node: Node) -> Prologue:
    """The prologue a conv node's plan applies (``passes.fold_preactivation``), or none."""
    return Prologue(affine="pscale" in node.weights, relu=bool(node.attrs.get("pre_relu")))
