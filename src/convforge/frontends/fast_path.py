"""The native fast paths as the API sees them: C++ modules (``torch/native.cpp`` for torch tensors,
``backends/cupy_native.cpp`` for CuPy arrays) that run a warm ``conv2d`` call without entering Python.

Each is loaded with the first call of its kind (its loader, ``torch/native.py`` or
``backends/native.py``, only builds it and answers it) and installed here: it clears its table
whenever the configuration or the executables change, and ``convforge.conv2d`` becomes the chain of
the modules' C entries (``wrap``) around Python's conv2d (the torch one outermost, since a CuPy call
costs it one failed type check), so a warm call never enters Python and a miss is looked up once in
each. ``api.py`` says, as it is imported, which function they wrap and how the chain becomes
``convforge.conv2d`` (:func:`serve`). The slow path files each validated call with its kind's module
(:func:`file_native`, :func:`file_cupy_native`, :func:`file_native_pass`).

``RUN`` (the torch module's ``run``: the output of a filed call, else None) and ``RUN_RES`` (the same
for a FusedConv2d plan that adds the residual) are what Python's conv2d and the torch modules ask
where the C entry is not installed."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from convforge import caches

log = logging.getLogger("convforge")

TORCH: Any = None  # the torch module (native.cpp), once loaded
RUN: Callable[..., Any] | None = None
RUN_RES: Callable[..., Any] | None = None  # a FusedConv2d plan that adds the residual
CUPY: Any = None  # the CuPy module (cupy_native.cpp), once loaded
_TORCH_TRIED = False
_CUPY_TRIED = False
_FRONTS: list[Any] = []  # installed native modules, innermost first
_CONV2D: dict[str, Callable[..., Any]] = {}  # api.py's: "python" (what the C entries wrap), "install"

# conv2d's defaults as native_core.h's C entry assumes them (``wrap``), checked before it takes over
NATIVE_DEFAULTS = (None, 1, 0, 1, "auto", None, None, False, None, None, None, 1)


def serve(python_conv2d: Callable[..., Any], install: Callable[[Callable[..., Any]], None]) -> None:
    """``api.py``'s conv2d, as it is imported: ``python_conv2d`` is the function the C entries wrap,
    ``install(front)`` makes a chain of them ``convforge.conv2d``."""
    _CONV2D.update(python=python_conv2d, install=install)
    if _FRONTS:
        _wrap()


def set_native(module: Any) -> None:
    """Route warm torch calls through ``module`` (native.cpp), from now on."""
    global TORCH, RUN, RUN_RES
    TORCH, RUN, RUN_RES = module, module.run, module.run_res


def install_native(module: Any) -> None:
    """Make ``module``'s C entry part of ``convforge.conv2d`` and clear its table whenever the
    configuration or the executables change. Where conv2d's defaults are not the ones the C entry
    assumes, only Python's conv2d asks the torch module (:func:`set_native`) and a warning says so."""
    if module in _FRONTS or caches.is_registered(module.clear):  # installed once: its table registered once
        return
    caches.register(module.clear, f"native fast path: {getattr(module, '__name__', module)}",
                    on=("executables", "settings"))
    python = _CONV2D.get("python")
    if python is not None and not _fits(python):  # later keywords (padding_mode) go to Python
        log.warning("convforge: conv2d's defaults differ from native_core.h's: its C entry is not installed")
        return
    _FRONTS.append(module)
    _FRONTS.sort(key=lambda m: m is TORCH)  # torch's last: outermost
    _wrap()


def _fits(python_conv2d: Callable[..., Any]) -> bool:
    """Whether conv2d's defaults are the ones native_core.h's C entry assumes."""
    params = list(inspect.signature(python_conv2d).parameters.values())[2:2 + len(NATIVE_DEFAULTS)]
    return tuple(p.default for p in params) == NATIVE_DEFAULTS


def _wrap() -> None:
    """The installed modules' C entries around Python's conv2d made ``convforge.conv2d`` (once
    ``api.py`` has said how: :func:`serve`)."""
    if not _CONV2D:
        return
    front: Any = _CONV2D["python"]
    for m in _FRONTS:
        front = m.wrap(front)
    _CONV2D["install"](front)


def load_torch() -> ModuleType | None:
    """The torch module (``torch/native.py`` builds it; None where it cannot run), installed the
    first time: Python's conv2d asks it, and its C entry becomes part of ``convforge.conv2d``."""
    from convforge.torch import native

    module = native.load()
    if module is not None and module is not TORCH:
        set_native(module)
        install_native(module)
    return module


def torch_module() -> Any:
    """The torch module, loaded on the first ask in the process (as :func:`file_native` loads it), or None:
    what a node of its own asks (torch/se.py), where no conv may have run before it."""
    global _TORCH_TRIED
    if not _TORCH_TRIED:
        _TORCH_TRIED = True
        load_torch()
    return TORCH


def file_native(run: Any, call: tuple[Any, ...], residual: bool = False) -> None:
    """File a validated torch call (conv2d's 14 arguments; ``run``, the runner that just ran it)
    with the native fast path (built on the first torch call), with the filters the runner
    transformed for its weights, if any (so the native path does not transform them again: a
    transform during CUDA-graph warm-up would allocate in the graph's pool). ``residual``: the
    plan adds a residual (FusedConv2d), found by ``run_res`` under its own key."""
    global _TORCH_TRIED
    if not _TORCH_TRIED:
        _TORCH_TRIED = True
        load_torch()
    if TORCH is None or getattr(run, "copies", False) or not run.exe.native:
        return  # a runner between layout copies is Python's; the C++ path takes the plans' own layouts
    w = call[1]
    held = run.filters.entry(w, w.data_ptr()) if run.filters is not None else None
    TORCH.register(*call, run.exe.native_program(), None if held is None else (w, *held), residual)


def file_native_pass(module: Any, run: Any, args: tuple[Any, ...], out_shape: tuple[int, ...]) -> bool:
    """File a validated backward op's call (native.cpp ``register_pass``'s first 11 arguments;
    ``run``, the pass runner that just ran it) with the native kernel, dgrad with the filters the
    runner transformed for its weights; False where the executable is not one the core launches."""
    exe = getattr(run, "exe", None)
    if module is None or exe is None or not exe.native or getattr(run, "copies", False):
        return False  # a runner between layout copies is Python's: its program reads NCHW
    held = None
    if args[0] == 1 and getattr(run, "filters", None) is not None:
        a = args[2]
        entry = run.filters.entry(a, a.data_ptr())
        held = None if entry is None else (a, *entry)
    return bool(module.register_pass(*args, exe.native_program(), held, out_shape))


def file_cupy_native(run: Any, call: tuple[Any, ...]) -> None:
    """File a validated CuPy call with the CuPy native fast path (built on the first CuPy call)."""
    global _CUPY_TRIED, CUPY
    if not _CUPY_TRIED:
        _CUPY_TRIED = True
        from convforge.backends import native

        CUPY = native.load_cupy()
        if CUPY is not None:
            install_native(CUPY)  # the loader builds it; the front-end installs it
    if CUPY is not None and run.exe.native:
        CUPY.register(*call, run.exe.native_program())
