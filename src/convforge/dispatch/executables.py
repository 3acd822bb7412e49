"""Compiled, launch-ready executables for a choice, cached per device, variant, spec, parameters
and epilogue."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from convforge.dispatch.choice import choose
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.spec import ConvSpec

if TYPE_CHECKING:
    from convforge.backends.base import Backend, Executable

_EXECUTABLES: dict[tuple[Any, ...], Executable] = {}


def executable(spec: ConvSpec, backend: Backend, epilogue: Epilogue = Epilogue(), *, algo: str = "auto",
               precision: str | None = None, max_error: float | None = None,
               workspace_limit: int | None = None, params: Params | None = None) -> Executable:
    """The executable of :func:`choose`'s answer, compiled once per back-end."""
    ch = choose(spec, backend, epilogue, algo=algo, precision=precision, max_error=max_error,
                workspace_limit=workspace_limit, params=params)
    key = (backend.device.key(), ch.variant.name, spec, ch.params, epilogue)
    exe = _EXECUTABLES.get(key)
    if exe is None:
        exe = _EXECUTABLES[key] = backend.executable(ch.variant.plan(spec, ch.params, backend.device, epilogue))
    return exe


def clear_executables() -> None:
    _EXECUTABLES.clear()
