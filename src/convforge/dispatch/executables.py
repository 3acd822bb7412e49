"""Compiled, launch-ready executables for a choice, and the per-call fast path.

``executable`` caches the compiled Executable per back-end instance (one per device), variant,
spec, parameters and epilogue. ``runner`` builds, once per distinct call signature, a closure that
runs a validated device call on raw pointers (frontends/torch_run.py ``torch_runner``,
frontends/cupy_run.py ``cupy_runner``) and files it in ``RUNNERS`` under a key of cheap attributes
(frontends/keys.py: types, shapes, dtypes, devices, contiguity, the keyword arguments, the
configuration's precision settings) that ``conv2d`` computes per call: a warm call is a dictionary
hit and a launch. A key is made only of what the slow path validated, so a hit needs no further
checking.

The first call of a layer compiles its program; one that takes long says so through
``convforge.progress`` (the "convforge" logger, INFO).

Device memory: when the workspace of the chosen variant cannot be allocated, ``auto`` falls back
to the best variant whose workspace fits in what is free (less the output's size) and logs it once;
an explicitly named algorithm (or explicit ``params``) raises ``DeviceMemoryError`` naming the bytes
asked for and the bytes free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from convforge import caches
from convforge.backends.base import DeviceMemoryError
from convforge.dispatch.choice import choose
from convforge.params import Params
from convforge.plan import Epilogue, Prologue
from convforge.progress import Phase
from convforge.spec import ConvSpec

if TYPE_CHECKING:
    from convforge.backends.base import Backend, Executable

log = logging.getLogger("convforge")

_EXECUTABLES: dict[tuple[Any, ...], Executable] = {}
RUNNERS: dict[tuple[Any, ...], Callable[..., Any]] = {}
caches.register(_EXECUTABLES.clear, "dispatch: compiled executables")
caches.register(RUNNERS.clear, "dispatch: per-call runners")
_LOGGED: set[tuple[Any, ...]] = set()


def executable(spec: ConvSpec, backend: Backend, epilogue: Epilogue = Epilogue(), *, algo: str = "auto",
               precision: str | None = None, max_error: float | None = None,
               workspace_limit: int | None = None, params: Params | None = None,
               filters_per_call: bool = False, prologue: Prologue = Prologue(),
               finite_exact: bool = False) -> Executable:
    """The executable of :func:`choose`'s answer, compiled once per back-end (device); with a
    ``prologue`` its plan also reads the buffers "pscale" and "pshift" (when affine)."""
    ch = choose(spec, backend, epilogue, algo=algo, precision=precision, max_error=max_error,
                workspace_limit=workspace_limit, params=params, filters_per_call=filters_per_call,
                prologue=prologue, finite_exact=finite_exact)
    key = (backend, backend.device.key(), ch.variant.name, spec, ch.params, epilogue, prologue)
    exe = _EXECUTABLES.get(key)
    if exe is None:  # a first call: said in the log when it takes long (convforge.progress)
        what = f"{ch.variant.name} [{ch.params.short()}] for {spec.short()}"
        start = time.perf_counter()
        with Phase(f"compiling {what}"):
            plan = ch.variant.plan_for(spec, ch.params, backend.device, epilogue, prologue)
            exe = _EXECUTABLES[key] = backend.executable(plan)
        _compiled(what, start)
    return exe


_STREAK = {"count": 0, "start": 0.0, "end": 0.0, "said": 0.0}  # first-call compiles one after another


def _compiled(what: str, start: float) -> None:
    """Count a first call's compile in the current streak (compiles less than EVERY_S apart: a
    model's first forward, a network built layer by layer) and, at most every EVERY_S seconds once
    the streak has run that long, log how far it is."""
    from convforge.progress import EVERY_S

    now = time.perf_counter()
    st = _STREAK
    if start - st["end"] > EVERY_S:
        st.update(count=0, start=start, said=start)
    st["count"] += 1
    st["end"] = now
    if now - st["said"] >= EVERY_S:
        st["said"] = now
        log.info("convforge: first calls: %d kernel program(s) compiled in %.1f s, the latest %s", st["count"],
                 now - st["start"], what)


def runner(key: tuple[Any, ...] | None, spec: ConvSpec, backend: Backend, epilogue: Epilogue, kind: str,
           device: int, *, algo: str = "auto", precision: str | None = None, max_error: float | None = None,
           workspace_limit: int | None = None, params: Params | None = None,
           prologue: Prologue = Prologue()) -> Callable[..., Any]:
    """``run(x, w, bias, derived=None) -> y`` for validated ``kind`` ("torch" | "cupy") arrays on
    CUDA device ``device``, remembered under ``key`` (None: not remembered); for a dgrad or wgrad
    ``spec``, ``run(x, w, y) -> out`` with the slot of the buffer it writes None
    (frontends/torch_run.py ``torch_pass_runner``)."""
    from convforge.frontends.kinds import runner_maker

    make = runner_maker(kind)
    # CuPy arrays have no version counter: their filters are transformed on every call
    kw: dict[str, Any] = dict(algo=algo, precision=precision, max_error=max_error, params=params,
                              filters_per_call=kind == "cupy", prologue=prologue)
    exe = executable(spec, backend, epilogue, workspace_limit=workspace_limit, **kw)
    try:
        run = make(exe, device)
    except DeviceMemoryError as err:
        if algo != "auto" or params is not None:
            raise
        exe = _fallback(err, exe, spec, backend, epilogue, workspace_limit, kw)
        run = make(exe, device)
    run.exe = exe  # type: ignore[attr-defined]  # the torch package's filter transforms use it
    if key is not None:
        RUNNERS[key] = run
    return run


def layout_runner(key: tuple[Any, ...] | None, spec: ConvSpec, backend: Backend, epilogue: Epilogue, device: int,
                  **kw: Any) -> Callable[..., Any]:
    """:func:`runner` for a torch call whose activations lie channels-last: the NHWC plans where some
    variant reads them (``spec`` with ``layout="nhwc"``), else, once logged, the NCHW runner between
    layout copies (``frontends/torch_run.py`` ``torch_layout_copies``); remembered under ``key``."""
    import dataclasses

    from convforge.frontends.torch_run import torch_layout_copies

    try:
        return runner(key, dataclasses.replace(spec, layout="nhwc"), backend, epilogue, "torch", device, **kw)
    except ValueError as err:
        why = err
    run = runner(None, spec, backend, epilogue, "torch", device, **kw)  # NCHW: its own error if it fails too
    tag = ("layout", spec)
    if tag not in _LOGGED:
        _LOGGED.add(tag)
        log.warning("convforge: %s in channels_last runs in NCHW between layout copies: %s", spec.short(), why)
    wrapped = torch_layout_copies(run, spec.conv_pass)
    if key is not None:
        RUNNERS[key] = wrapped
    return wrapped


def _fallback(err: DeviceMemoryError, exe: Executable, spec: ConvSpec, backend: Backend, epilogue: Epilogue,
              workspace_limit: int | None, kw: dict[str, Any]) -> Executable:
    """The best variant whose workspace fits in the free memory less the output, logged once."""
    shape = spec.shape_of(spec.output)  # the output the runner allocates: y, x (dgrad) or w (wgrad)
    out_bytes = spec.itemsize * shape[0] * shape[1] * shape[2] * shape[3]
    limit = max(0, err.free - out_bytes - (8 << 20))  # a margin for the allocator's rounding
    if workspace_limit is not None:
        limit = min(limit, workspace_limit)
    try:
        smaller = executable(spec, backend, epilogue, workspace_limit=limit, **kw)
    except ValueError:
        raise err from None
    if smaller.plan.workspace_bytes >= exe.plan.workspace_bytes:
        raise err
    tag = (backend, spec, exe.plan.variant, smaller.plan.variant)
    if tag not in _LOGGED:
        _LOGGED.add(tag)
        log.warning("convforge: %s; %s falls back to %s (workspace %d bytes) on %s", err,
                    exe.plan.describe(), smaller.plan.describe(), smaller.plan.workspace_bytes, spec.short())
    return smaller


def clear_executables() -> None:
    """Forget compiled executables, the per-call runners built on them and every other table
    registered on them (:mod:`convforge.caches`, event ``executables``)."""
    caches.clear("executables")
