"""``prepare(model, example)``: compile a converted or fused model's kernels, several at a time, before
its first forward.

The first eager forward of a model from ``convert`` or ``fuse`` compiles each layer's kernels as it
reaches the layer, one after the other. ``prepare`` runs the model once on an example input with
PyTorch's own convolutions in place of convforge's (each convforge layer records the input it gets;
nothing of convforge's is compiled or run), then builds every layer's runner for those inputs: one
after another on this thread where the programs are in a cache (a warm process: Python work, which
threads would only make contend), and for the others their programs first, on a pool of threads
(NVRTC releases the GIL while it compiles); reported as a ``convforge.progress`` phase (the
"convforge" logger, INFO). The first real forward on inputs of
the same shapes finds each layer's runner built. It prepares eager inference (``model.eval()``,
no gradients); a training step's backward kernels are compiled ahead by
:func:`~convforge.torch.train_ahead.compile_training_ahead`.

``fuse`` and ``convert`` arm :func:`prepare_on_first_call` on the model they answer, so a user's
first eager inference forward prepares itself without knowing of ``prepare`` (and, under
``config.train_ahead``, the first training forward compiles the step's backward kernels ahead).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from convforge.backends.base import CompileDeferred, deferring_compiles
from convforge.config import config
from convforge.progress import Phase
from convforge.torch.modules import Conv2d, compute_dtype, padding_quad, reads_nhwc

log = logging.getLogger("convforge")
_F32 = torch.float32


def prepare(model: torch.nn.Module, *example: Any, workers: int | None = None, **example_kwargs: Any) -> int:
    """Compile the kernels ``model``'s first forward on ``example`` (its positional and keyword
    arguments) will run, on ``workers`` threads (default: the CPUs, at most 16; 1 while
    ``config.autotune`` is on, so tuning times one candidate at a time). Returns how many layer
    runners were built. Layers convforge does not run on these inputs (CPU tensors, training,
    other dtypes) are skipped; anything a layer cannot prepare is left for its first call."""
    from convforge.backends.base import compile_workers
    from convforge.config import config

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare() takes a torch.nn.Module, not {type(model).__name__}")
    model.__dict__[_PENDING] = False  # prepared now: its first call need not (and the run below must not)
    training = _training_batch_norm(model)
    if training:
        raise ValueError(f"prepare() prepares inference, and batch norm {training!r} is in training mode (its "
                         "running statistics would move): call model.eval() first; training compiles its "
                         "kernels on its first step")
    jobs = _record(model, example, example_kwargs)
    if not jobs:
        return 0
    n = 1 if config.autotune else max(1, min(workers or compile_workers(), len(jobs)))
    name = type(model).__name__
    with Phase(f"compiling {name}'s kernels ({n} thread{'s' if n > 1 else ''})", len(jobs), "layers") as phase:
        later = _build_cached(jobs, phase) if n > 1 else jobs
        if later:
            _compile(later, n)
        for job in later:
            _run(job)
            phase.advance()
    return len(jobs)


def _run(job: Callable[[], Any]) -> None:
    try:
        job()
    except Exception as err:  # noqa: BLE001 - the layer's first call builds it again and says why
        log.debug("convforge: preparing a layer failed (%s); its first call builds it", err)


def _build_cached(jobs: list[Callable[[], Any]], phase: Phase) -> list[Callable[[], Any]]:
    """Build, one after another on this thread, every layer whose programs some cache holds (a warm
    process: Python work, which threads would only make contend); the jobs that stopped at a
    program to compile, with that program (``_compile``'s work)."""
    later: list[Callable[[], Any]] = []
    with deferring_compiles():
        for job in jobs:
            try:
                job()
            except CompileDeferred as d:
                later.append(_Deferred(job, d.backend, d.source))
                continue
            except Exception as err:  # noqa: BLE001 - as _run
                log.debug("convforge: preparing a layer failed (%s); its first call builds it", err)
            phase.advance()
    return later


class _Deferred:
    """A job that stopped at ``source``: called, it runs the job again (the program then compiled)."""

    def __init__(self, job: Callable[[], Any], backend: Any, source: str) -> None:
        self.job, self.backend, self.source = job, backend, source

    def __call__(self) -> Any:
        return self.job()


def _compile(jobs: list[Callable[[], Any]], n: int) -> None:
    """The programs the deferred ``jobs`` stopped at, compiled on ``n`` threads (NVRTC releases the
    GIL); a job without one (no deferral) has nothing to compile here."""
    sources = {(id(j.backend), j.source): j for j in jobs if isinstance(j, _Deferred)}

    def build(j: _Deferred) -> None:
        try:
            j.backend.program(j.source)
        except Exception as err:  # noqa: BLE001 - the job, run next, compiles it again and reports it
            log.debug("convforge: compiling a layer's program ahead failed (%s)", err)

    with ThreadPoolExecutor(min(n, len(sources)) or 1, thread_name_prefix="convforge-prepare") as pool:
        list(pool.map(build, sources.values()))


_PENDING = "_cf_prepare_pending"
_TRAIN_PENDING = "_cf_train_ahead_pending"


def prepare_on_first_call(model: torch.nn.Module) -> None:
    """Have ``model``'s first forward in eval mode on CUDA tensors run :func:`prepare` on that call's
    inputs before it runs, and its first forward in training mode with gradients enabled run
    ``compile_training_ahead`` (a forward pre-hook; later calls pay one attribute check). A copy of the
    model (``copy.deepcopy``) prepares on its own first call; the hook is a module-level function, so
    the model still pickles."""
    model.__dict__[_PENDING] = True
    model.__dict__[_TRAIN_PENDING] = True
    if _prepare_hook not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_prepare_hook, with_kwargs=True)
    again = getattr(model, "_deepcopy_hooks", None)  # a GraphModule's deepcopy drops forward hooks and
    if isinstance(again, list) and prepare_on_first_call not in again:  # calls these on the copy
        again.append(prepare_on_first_call)


def _prepare_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    training = module.training
    if training and not (module.__dict__.get(_TRAIN_PENDING) and torch.is_grad_enabled() and config.train_ahead):
        return
    if not training and not module.__dict__.get(_PENDING):
        return
    if (torch.jit.is_tracing() or torch.compiler.is_compiling()
            or not any(isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
            or torch.cuda.is_current_stream_capturing()):
        return
    if training:
        _train_ahead(module, args, kwargs)
        return
    module.__dict__[_PENDING] = False
    try:
        prepare(module, *args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the forward itself builds each layer and reports a real problem
        log.debug("convforge: preparing %s on its first call failed (%s)", type(module).__name__, err)


def _train_ahead(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The hook's training half: the first training step's backward kernels compiled ahead, once."""
    from convforge.torch.train_ahead import compile_training_ahead

    module.__dict__[_TRAIN_PENDING] = False
    try:
        compile_training_ahead(module, *args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the step itself compiles each kernel and reports a real problem
        log.debug("convforge: compiling %s's backward kernels ahead failed (%s)", type(module).__name__, err)


def _training_batch_norm(model: torch.nn.Module) -> str | None:
    """The name of a batch norm in training mode that ``model`` runs (its own, or one a fused
    layer references), or None."""
    bn_type = torch.nn.modules.batchnorm._BatchNorm
    for name, m in model.named_modules():
        pre = getattr(m, "_cf_pre", None)
        refs = [m, getattr(m, "_cf_bn", None), getattr(m, "bn", None), getattr(pre, "bn", None)]
        for bn in refs:
            if isinstance(bn, bn_type) and bn.training:
                return (name or "<model>") if bn is m else f"{name or '<model>'}'s batch norm"
    return None


def _record(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            wrap: Callable[[Conv2d, Any], Any] | None = None,
            excite: Callable[[Any, torch.Tensor], None] | None = None,
            linear: Callable[[Any, torch.Tensor, Any], None] | None = None) -> list[Callable[[], Any]]:
    """Run ``model`` with PyTorch's convolutions under no_grad, each convforge layer's call turned into
    a job that builds what its first real call will need; the model's own forwards are restored.
    ``wrap(layer, recorder)``: the forward the layer runs instead of its recorder (train_ahead.py);
    ``excite(layer, x)``: told of each squeeze-and-excitation call (its kernels' layer) instead of making its job;
    ``linear(layer, x, res)``: told of each ``FusedLinear`` call, which then runs PyTorch's operations (a training
    step's recording: the inference programs it would build otherwise are not the step's)."""
    from convforge.torch.fused import FusedConv2d
    from convforge.torch.linear import FusedLinear
    from convforge.torch.se import SqueezeExcite

    jobs: dict[tuple[Any, ...], Callable[[], Any]] = {}
    patched: list[tuple[torch.nn.Module, Any]] = []
    try:
        for m in model.modules():
            if isinstance(m, Conv2d):
                patched.append((m, m.__dict__.get("forward")))
                rec = _fused_recorder(m, jobs) if isinstance(m, FusedConv2d) else _conv_recorder(m, jobs)
                m.forward = rec if wrap is None else wrap(m, rec)  # type: ignore[method-assign]
            elif isinstance(m, SqueezeExcite):
                patched.append((m, m.__dict__.get("forward")))
                m.forward = _se_recorder(m, jobs, excite)  # type: ignore[method-assign]
            elif isinstance(m, FusedLinear) and linear is not None:
                patched.append((m, m.__dict__.get("forward")))
                m.forward = _linear_recorder(m, linear)  # type: ignore[method-assign]
        with torch.no_grad(), _quiet_hooks(model):
            model(*args, **kwargs)
    finally:
        for m, own in patched:
            if own is None:
                del m.forward
            else:
                m.forward = own  # type: ignore[method-assign]
    return list(jobs.values())


_POST_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


@contextlib.contextmanager
def _quiet_hooks(model: torch.nn.Module) -> Iterator[None]:
    """The modules' forward (post) hooks held back while the recording runs: a user's hook that collects
    features or counts calls never sees the recording's extra forward. Pre-hooks stay (weight_norm and
    the like compute the weights in one)."""
    held = [(m, name, getattr(m, name)) for m in model.modules() for name in _POST_HOOKS
            if getattr(m, name, None)]
    for m, name, _ in held:
        setattr(m, name, type(getattr(m, name))())
    try:
        yield
    finally:
        for m, name, hooks in held:
            setattr(m, name, hooks)


def _linear_recorder(m: Any, linear: Callable[[Any, torch.Tensor, Any], None]) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor, res: Any = None) -> torch.Tensor:
        linear(m, x, res)
        return m.unfused(x, res)  # type: ignore[no-any-return]

    return forward


def _stand_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor with ``x``'s shape and device and ``dtype`` holding one element (zero strides): what a
    layer's runner is built from (shape, dtype, device), without keeping the activation."""
    return torch.empty_strided(tuple(x.shape), (0,) * x.dim(), dtype=dtype, device=x.device)


def _conv_job(m: Conv2d, x: torch.Tensor, jobs: dict[tuple[Any, ...], Callable[[], Any]]) -> None:
    """The job of a ``Conv2d`` call of ``x`` (its eager inference path, modules.py ``_forward``)."""
    w = m.weight
    dt = compute_dtype(x, w)
    if (dt is None or not x.is_cuda or x.dim() != 4 or not w.is_cuda or m.padding_mode != "zeros"
            or (m.bias is not None and m.bias.dtype != w.dtype)):
        return
    nhwc = x.dtype == _F32 and reads_nhwc(m, x)
    key = (id(m), tuple(x.shape), dt, x.device, nhwc)
    if key in jobs:
        return
    stand, pad, dev = _stand_in(x, dt), padding_quad(m), x.device

    def job() -> None:
        with torch.cuda.device(dev):
            if not nhwc or m._prepared(stand, pad, "nhwc") is None:
                m._prepared(stand, pad)

    jobs[key] = job


def _se_recorder(m: Any, jobs: dict[tuple[Any, ...], Callable[[], Any]],
                 excite: Callable[[Any, torch.Tensor], None] | None) -> Callable[..., torch.Tensor]:
    """A squeeze-and-excitation node's call (torch/se.py): its program's job (or ``excite``), the output as
    the original modules compute it."""
    from convforge.torch import se

    def forward(x: torch.Tensor) -> torch.Tensor:
        layer = m.layer(x, m._cf_mods[1].weight, m._cf_mods[3].weight)
        if layer is not None and excite is not None:
            excite(layer, x)
        elif layer is not None and ("se", layer, x.device) not in jobs:
            dev = x.device.index or 0
            jobs[("se", layer, x.device)] = lambda: se.program_of(layer, dev)
        return m.reference(x)  # type: ignore[no-any-return]

    return forward


def _conv_recorder(m: Conv2d, jobs: dict[tuple[Any, ...], Callable[[], Any]]) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        _conv_job(m, x, jobs)
        return torch.nn.Conv2d.forward(m, x)

    return forward


def _fused_recorder(m: Any, jobs: dict[tuple[Any, ...], Callable[[], Any]]) -> Callable[..., torch.Tensor]:
    """A FusedConv2d's call: the folded path's job where its forward would fold (fused.py), else
    the plain conv's; the output as the original modules compute it."""
    from convforge.torch.fused import _pre_folds, _sources

    def forward(x: torch.Tensor, res: Any = None) -> torch.Tensor:
        pre = m._cf_pre
        through = pre is None or pre.passes_through()
        src = _sources(m)
        if through and m._folds(x, res, src) and (pre is None or _pre_folds(pre)):
            _fused_job(m, x, src, jobs)
        else:  # the unfused path: the conv alone, on the activated input (same shape and dtype)
            _conv_job(m, x, jobs)
        if pre is not None and through:
            x = pre.activate(x)
        y = torch.nn.Conv2d.forward(m, x)
        if m._cf_bn is not None:
            y = m._cf_bn(y)
        if res is not None:
            y = y + res
        return torch.relu(y) if m._cf_relu else y

    return forward


def _fused_job(m: Any, x: torch.Tensor, src: tuple[Any, ...], jobs: dict[tuple[Any, ...], Callable[[], Any]]) -> None:
    dt = compute_dtype(x, src[0])
    if dt is None:
        return
    nhwc = x.dtype == dt and reads_nhwc(m, x)
    key = ("fused", id(m), tuple(x.shape), dt, x.device, nhwc)
    if key in jobs:
        return
    stand, dev = _stand_in(x, dt), x.device

    def job() -> None:
        with torch.cuda.device(dev):
            if not nhwc or m._fused_runner(stand, "nhwc") is None:
                m._fused_runner(stand)

    jobs[key] = job
