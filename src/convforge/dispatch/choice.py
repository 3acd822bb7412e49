"""Which variant and parameters run a spec: the tuning database's entry for the precision class,
else autotuning (``config.autotune``), else Boda's heuristic over the variants the class admits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from convforge import kernels
from convforge.config import config
from convforge.params import Params
from convforge.plan import Epilogue, Variant
from convforge.spec import ConvSpec

if TYPE_CHECKING:
    from convforge.backends.base import Backend

_CHOICES: dict[tuple[Any, ...], Choice] = {}


@dataclass(frozen=True)
class Choice:
    """A variant and its parameters, with the error it was admitted on and where it came from."""

    variant: Variant
    params: Params
    error: float | None = None  # measured (tuned entries) or None (stated only)
    source: str = "heuristic"  # "db", "tuned", "heuristic" or "named"


def choose(spec: ConvSpec, backend: Backend, epilogue: Epilogue = Epilogue(), *, algo: str = "auto",
           precision: str | None = None, max_error: float | None = None,
           workspace_limit: int | None = None, params: Params | None = None) -> Choice:
    """The (variant, params) that runs ``spec`` on ``backend`` (cached per argument set)."""
    key = (backend, spec, epilogue, algo, precision or config.precision,
           max_error if max_error is not None else config.max_error, workspace_limit, params,
           config.autotune, config.db_path, config.cache_dir)
    hit = _CHOICES.get(key)
    if hit is None:
        hit = _CHOICES[key] = _choose_slow(spec, backend, epilogue, algo, workspace_limit, params)
    return hit


def _choose_slow(spec: ConvSpec, backend: Backend, epi: Epilogue, algo: str,
                 workspace_limit: int | None, params: Params | None) -> Choice:
    if algo == "auto" and params is None:
        from convforge import tune

        variant, prm = tune.choose(spec, backend, epi, workspace_limit)
        return Choice(variant, prm, None, "db")
    variant, prm = kernels.most_specialised(algo, spec, backend.device, workspace_limit, params)
    return Choice(variant, prm, None, "named" if algo != "auto" else "heuristic")


def clear_choices() -> None:
    """Forget cached choices (after the database or the configuration changed)."""
    _CHOICES.clear()
