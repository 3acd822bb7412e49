"""A model's training forward and backward replayed from CUDA graphs (``fuse()``'s models by default).

Why: a CNN's training step on an H200 is often host-bound. ConvNeXt-T's AMP step at N64 takes about 35 ms
of host work for about 24 ms of GPU work on either side (PyTorch's operators and autograd nodes, 10-40 us
each), so faster kernels cannot show; ResNet-50's GPU idles while the host restarts after GradScaler's
synchronising check. Replaying the model's forward and backward as two captured graphs leaves the host
two launches, the loss, the scaler and the optimizer.

How: :func:`graph_training` gives a module's class a ``__call__`` that, in training mode with gradients on
and CUDA tensor arguments only, keys the call by the arguments' shapes, strides and dtypes, the autocast
state, the trainable parameters (address, dtype) and the buffers' addresses. A key's first calls run
eagerly; once two of them have started their backward, the next call captures the forward and then its
backward into one memory pool (``torch.cuda.graph``, capture errors local to this thread, autocast's
weight cache off inside) and replays them from then on: the arguments copied into the captured inputs, one
forward replay, the outputs cloned; in the backward the incoming gradients copied in, one replay, the
parameters' gradients cloned (so ``.grad`` never aliases a captured buffer: accumulation over several
backward calls adds as eager autograd does). Batch-norm statistics, ``num_batches_tracked`` and random
draws (stochastic depth, dropout: PyTorch's generator advances its offset each replay) happen in the
replay as in eager.

What stays eager, every result the same as without graphs: eval mode, ``no_grad``, keyword arguments,
non-CUDA or non-tensor arguments, outputs other than a tensor or a tuple/list of tensors, a model with
forward hooks (they would not run on replay), a key beyond the first ``MAX_KEYS`` of a model, a call made
while an earlier replay's backward is still pending (its captured activations would be overwritten), a
call inside someone else's capture, tracing or ``torch.compile``, and a key whose capture failed (said
once, with the reason, in :func:`status` and the log). A replayed output's backward after a later replay
raises instead of returning stale gradients; so does differentiating it twice (``create_graph``).
``CONVFORGE_TRAIN_GRAPHS=0`` (``config.train_graphs``) turns it off.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.func
import torch.fx

from convforge.config import config

__all__ = ["MAX_KEYS", "graph_training", "status", "without_graphs"]

MAX_KEYS = 2  # captured keys a model keeps (each holds a memory pool as large as a step's activations)
EAGER_CALLS = 2  # eager calls of a key whose backward started before the key is captured

log = logging.getLogger(__name__)


@dataclass
class _Captured:
    """One key's graphs and the tensors they read and write."""

    fwd: Any
    bwd: Any
    inputs: list[torch.Tensor]  # the captured forward reads these (the call's arguments are copied in)
    outputs: list[torch.Tensor]  # the captured forward's outputs (cloned out each replay)
    wants_grad: list[bool]  # per output: it has a gradient
    grad_outputs: list[torch.Tensor]  # the captured backward reads these (the incoming gradients)
    grads: list[torch.Tensor | None]  # the captured backward's gradients: inputs needing one, then params
    grad_slots: list[int]  # per entry of ``grads``: its position among the call's inputs + params
    kind: Any  # what the model returns: torch.Tensor, tuple or list
    generation: int = 0  # replays so far: a backward checks it ran after its own forward
    pending: Any = None  # weakref to the token of the replay whose backward has not run


@dataclass
class _Key:
    seen: int = 0  # eager calls whose backward started
    failed: str | None = None
    captured: _Captured | None = None


@dataclass
class _State:
    keys: dict[Any, _Key] = field(default_factory=dict)


_STATES: weakref.WeakKeyDictionary[torch.nn.Module, _State] = weakref.WeakKeyDictionary()
_CLASSES: dict[type, type] = {}


class _GraphedCall:
    """The mixin :func:`graph_training` puts in front of a module's class."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m: Any = self
        # the class's own call; a GraphModule's (fx's wrapper, which a deepcopy re-creates in front of this
        # class and which would call back here) is nn.Module's
        call = (torch.nn.Module.__call__.__get__(m) if isinstance(m, torch.fx.GraphModule)
                else super(_GraphedCall, m).__call__)  # type: ignore[misc]
        if kwargs or not _eligible(m, args):
            return call(*args, **kwargs)
        return _call(m, args, call)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (and, outside a GraphModule, copied) as the module's own class: the subclass is made at run
        time and could not be found by name when loading; the copy runs eagerly."""
        if isinstance(self, torch.fx.GraphModule):
            return super().__reduce_ex__(protocol)  # fx's own reduction
        base = next(b for b in type(self).__mro__[1:] if not issubclass(b, _GraphedCall))
        return _rebuilt, (base, self.__getstate__())


def _rebuilt(cls: Any, state: Any) -> Any:
    """A module of class ``cls`` with ``state`` (what :meth:`_GraphedCall.__reduce_ex__` pickles)."""
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def graph_training(module: torch.nn.Module) -> torch.nn.Module:
    """Have ``module``'s training calls replay CUDA graphs (module docstring); returns ``module``, whose
    class becomes a subclass of its own (parameters, buffers and ``state_dict`` unchanged). A deepcopy of a
    GraphModule (``fuse()``'s) replays too (capturing its own graphs); a pickle of either, and a copy of
    another module, runs eagerly."""
    cls = type(module)
    if issubclass(cls, _GraphedCall):
        return module
    if isinstance(module, torch.fx.GraphModule):
        # fx gives each GraphModule a class of its own and its recompile() (pickling calls it) writes forward and
        # __call__ on the instance's class: a layer under the mixin, qualified as fx qualifies its own (so that a
        # deepcopy puts its new one under the mixin too), takes those writes
        mixed = type(cls.__name__, (_GraphedCall, cls), {"__module__": cls.__module__})
        own = type(cls.__name__, (mixed,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        module.__class__ = own
        return module
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = _CLASSES[cls] = type(cls.__name__, (_GraphedCall, cls), {"__module__": cls.__module__})
    module.__class__ = sub
    return module


def without_graphs(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` back on its own class (every call eager, its captured graphs dropped); returns it."""
    cls = type(module)
    if issubclass(cls, _GraphedCall):
        module.__class__ = next(b for b in cls.__mro__[1:] if not issubclass(b, _GraphedCall))
        _STATES.pop(module, None)
    return module


def status(module: torch.nn.Module) -> dict[str, str]:
    """Each key's state: ``eager (n of EAGER_CALLS)``, ``captured``, or ``failed: reason``."""
    state = _STATES.get(module)
    if state is None:
        return {}
    return {repr(k): ("captured" if v.captured else f"failed: {v.failed}" if v.failed else
                      f"eager ({v.seen} of {EAGER_CALLS})") for k, v in state.keys.items()}


def _eligible(m: torch.nn.Module, args: tuple[Any, ...]) -> bool:
    if not (m.training and args and config.train_graphs and torch.is_grad_enabled()):
        return False
    if not all(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        return False
    return not (torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing())


def _scan(m: torch.nn.Module) -> tuple[list[torch.Tensor], tuple[int, ...], bool]:
    """One walk over the modules: the trainable parameters (``parameters()``'s order), the buffers' addresses
    (a replay writes batch-norm statistics where they were at the capture), and whether any module has a
    hook a replay would skip (our one-time pre-hook excepted)."""
    from convforge.torch.prepare import _prepare_hook

    params: list[torch.Tensor] = []
    buffers: list[int] = []
    seen: set[int] = set()
    hooked = False
    for sub in m.modules():
        for p in sub._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                if p.requires_grad:
                    params.append(p)
        buffers.extend(b.data_ptr() for b in sub._buffers.values() if b is not None)
        if sub._forward_hooks or sub._backward_hooks or sub._backward_pre_hooks or (
                sub._forward_pre_hooks and any(h is not _prepare_hook for h in sub._forward_pre_hooks.values())):
            hooked = True
    g = torch.nn.modules.module
    hooked = hooked or bool(g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks)
    return params, tuple(buffers), hooked


def _key(args: tuple[torch.Tensor, ...], params: list[torch.Tensor], buffers: tuple[int, ...]) -> Any:
    dev = args[0].device
    return (tuple((a.shape, a.stride(), a.dtype, a.device, a.requires_grad) for a in args),
            torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type),
            tuple((p.data_ptr(), p.dtype) for p in params), buffers)


def _call(m: torch.nn.Module, args: tuple[torch.Tensor, ...], eager: Any) -> Any:
    params, buffers, hooked = _scan(m)
    if hooked:
        return eager(*args)  # hooks run (a later call without them may capture)
    state = _STATES.get(m)
    if state is None:
        state = _STATES[m] = _State()
    key = _key(args, params, buffers)
    entry = state.keys.get(key)
    if entry is None:
        if len(state.keys) >= MAX_KEYS:
            return eager(*args)
        entry = state.keys[key] = _Key()
    cap = entry.captured
    if cap is not None:
        if cap.pending is not None and cap.pending() is not None:
            return eager(*args)  # an earlier replay's backward still needs the captured activations
        return _replay(cap, args, params)
    if entry.failed is not None or entry.seen < EAGER_CALLS:
        out = eager(*args)
        if entry.failed is None and _flat(out) is None:
            entry.failed = f"the model returns {type(out).__name__}, not a tensor or a tuple or list of tensors"
        elif entry.failed is None:
            _count_backward(out, entry)
        return out
    try:
        entry.captured = _capture(m, args, params)
    except Exception as err:  # noqa: BLE001 - a model that cannot be captured runs eagerly, said once
        _after_failed_capture(args[0].device)
        entry.failed = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
        log.warning("convforge: training graphs off for %s %s: %s", type(m).__name__,
                    [tuple(a.shape) for a in args], entry.failed)
        return eager(*args)
    return _replay(entry.captured, args, params)


def _after_failed_capture(device: torch.device) -> None:
    """Leave the device as before a capture that raised: its work drained (a capture invalidated mid-way
    reports on the next call) and PyTorch's random generator out of capture mode (a capture that ends in
    an error leaves it there, and every later random draw would fail: an empty capture ends it)."""
    with torch.cuda.device(device):
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001, S110 - the error the capture raised, reported again
            pass
        empty = torch.cuda.CUDAGraph()
        with torch.cuda.graph(empty):
            pass
        del empty


def _count_backward(out: Any, entry: _Key) -> None:
    """Count ``out``'s backward once it starts (a hook on its first output that needs a gradient)."""
    for t in _flat(out) or []:
        if t.requires_grad:
            def seen(grad: torch.Tensor) -> None:
                entry.seen += 1

            t.register_hook(seen)
            return


def _flat(out: Any) -> list[torch.Tensor] | None:
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) in (tuple, list) and out and all(isinstance(t, torch.Tensor) for t in out):
        return list(out)
    return None


def _capture(m: torch.nn.Module, args: tuple[torch.Tensor, ...], params: list[torch.Tensor]) -> _Captured:
    """The forward and backward of one call captured (nothing runs: the caller replays them)."""
    inputs = [torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device).copy_(a)
              .requires_grad_(a.requires_grad) for a in args]
    # The capture reads the parameters through new leaves on their storage: a parameter's own gradient
    # accumulator, kept alive from an eager step (by the last loss a caller holds), belongs to the stream
    # of that step, and autograd would make the capture wait on it, which ends the capture.
    name_of = {id(p): n for n, p in m.named_parameters()}
    names = [name_of[id(p)] for p in params]
    leaves = [p.detach().requires_grad_(True) for p in params]
    dev = args[0].device
    fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    autocast = torch.is_autocast_enabled(dev.type)
    with torch.cuda.device(dev):
        with torch.cuda.graph(fwd, capture_error_mode="thread_local"):
            with torch.autocast(dev.type, dtype=torch.get_autocast_dtype(dev.type), enabled=autocast,
                                cache_enabled=False):
                out = torch.func.functional_call(m, dict(zip(names, leaves)), tuple(inputs))
        flat = _flat(out)
        if flat is None:
            raise TypeError(f"the model returns {type(out).__name__}, not a tensor or a tuple of tensors")
        wants = [t.requires_grad for t in flat]
        diff = [t for t in flat if t.requires_grad]
        if not diff:
            raise RuntimeError("no output needs a gradient")
        grad_outputs = [torch.empty_like(t) for t in diff]
        needs = [a for a in inputs if a.requires_grad] + leaves
        slots = [i for i, a in enumerate(inputs) if a.requires_grad] + [len(inputs) + i for i in range(len(params))]
        with torch.cuda.graph(bwd, pool=fwd.pool(), capture_error_mode="thread_local"):
            grads = torch.autograd.grad(diff, needs, grad_outputs, allow_unused=True)
    kind = torch.Tensor if isinstance(out, torch.Tensor) else type(out)
    return _Captured(fwd, bwd, inputs, [t.detach() for t in flat], wants, grad_outputs, list(grads), slots, kind)


class _Token:
    """Alive while a replay's autograd node is: the next replay waits for its backward or its end."""


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cap: _Captured, n_args: int, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        for dst, src in zip(cap.inputs, tensors[:n_args]):
            dst.copy_(src)
        cap.fwd.replay()
        cap.generation += 1
        ctx.cap, ctx.generation, ctx.n_in = cap, cap.generation, len(tensors)
        ctx.token = _Token()
        cap.pending = weakref.ref(ctx.token)
        outs = tuple(t.clone() for t in cap.outputs)
        ctx.mark_non_differentiable(*[o for o, w in zip(outs, cap.wants_grad) if not w])
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grad_outs: torch.Tensor | None) -> Any:
        cap: _Captured = ctx.cap
        if cap.generation != ctx.generation:
            raise RuntimeError("convforge: this output's CUDA graph was replayed by a later call before its "
                               "backward (retain_graph over two steps); set CONVFORGE_TRAIN_GRAPHS=0 for that")
        diff = [g for g, w in zip(grad_outs, cap.wants_grad) if w]
        for dst, g in zip(cap.grad_outputs, diff):
            if g is None:
                dst.zero_()
            else:
                dst.copy_(g)
        cap.bwd.replay()
        cap.pending = None
        have = [g for g in cap.grads if g is not None]
        copies = iter(torch._foreach_mul(have, 1.0) if have else [])  # no .grad may alias a captured buffer
        result: list[torch.Tensor | None] = [None] * ctx.n_in
        for slot, g in zip(cap.grad_slots, cap.grads):
            result[slot] = next(copies) if g is not None else None
        return (None, None, *result)


def _replay(cap: _Captured, args: tuple[torch.Tensor, ...], params: list[torch.Tensor]) -> Any:
    outs = _Replay.apply(cap, len(args), *args, *params)
    return outs[0] if cap.kind is torch.Tensor else cap.kind(outs)
