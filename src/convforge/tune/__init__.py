"""Autotuning, variant selection and the tuning database.

``choose`` is what ``conv2d(..., algo="auto")`` calls: the database's choice when it has one, else
(with ``config.autotune``) tune now and store, else Boda's heuristic. Answers are cached in memory,
so a warm call is one dictionary lookup.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convforge.config import config
from convforge.kernels import accurate_enough
from convforge.params import Params
from convforge.plan import Epilogue, Variant
from convforge.spec import ConvSpec
from convforge.tune.db import Entry, TuningDB
from convforge.tune.heuristic import NO_EPILOGUE, heuristic_choice
from convforge.tune.tuner import Budget, TuneError, Tuner, TuneResult, measure_dispatch

if TYPE_CHECKING:
    from convforge.backends.base import Backend

__all__ = ["choose", "clear_choices", "open_db", "Budget", "Entry", "Tuner", "TuneError", "TuneResult",
           "TuningDB", "heuristic_choice", "measure_dispatch"]

log = logging.getLogger("convforge.tune")
_CHOICES: dict[tuple[Any, ...], tuple[Variant, Params]] = {}
_DBS: dict[tuple[Path, bool], TuningDB | None] = {}
_LOCK = threading.Lock()
AUTOTUNE_BUDGET = Budget()  # effort of tuning on first sight (config.autotune); may be changed


def open_db(path: Path | None = None, write: bool = False) -> TuningDB | None:
    """The shared database at ``path`` (default ``config.tuning_db``), read-only unless ``write``;
    None when there is none (a lookup creates nothing) or it cannot be used (logged once)."""
    path = Path(path or config.tuning_db)
    with _LOCK:
        key = (path, write)
        if key not in _DBS:
            if not write and not path.exists():
                return None  # not remembered: a later tuning run may create it
            try:
                _DBS[key] = TuningDB(path, readonly=not write)
            except Exception as err:  # noqa: BLE001 - no database is a slower choice, never a crash
                log.warning("tuning database %s unavailable (%s); using the heuristic", path, err)
                _DBS[key] = None
        return _DBS[key]


def clear_choices() -> None:
    """Forget cached choices and database handles (after the database changed underneath)."""
    with _LOCK:
        _CHOICES.clear()
        for db in _DBS.values():
            if db is not None:
                db.close()
        _DBS.clear()


def choose(spec: ConvSpec, backend: Backend, epilogue: Epilogue = NO_EPILOGUE,
           workspace_limit: int | None = None) -> tuple[Variant, Params]:
    """(variant, params) for ``spec`` on ``backend``: database, else tune (if enabled), else heuristic."""
    key = (backend, spec, epilogue, workspace_limit, config.autotune, config.db_path, config.cache_dir,
           config.max_error, config.precision)
    hit = _CHOICES.get(key)
    if hit is None:
        hit = _choose_slow(spec, backend, epilogue, workspace_limit)
        _CHOICES[key] = hit
    return hit


def _choose_slow(spec: ConvSpec, backend: Backend, epi: Epilogue,
                 workspace_limit: int | None) -> tuple[Variant, Params]:
    db = open_db(write=config.autotune)
    tuner = Tuner(backend, db, AUTOTUNE_BUDGET)
    if db is not None:
        try:
            entry = tuner.lookup(spec, epi)
        except Exception as err:  # noqa: BLE001
            log.warning("tuning database lookup failed (%s); using the heuristic", err)
            entry = None
        if entry is not None:
            variant = tuner._known(entry)
            fits = workspace_limit is None or entry.workspace <= workspace_limit
            if (variant is not None and fits and variant.applies(spec, backend.device) is None
                    and accurate_enough(variant, spec) is None):
                params = Params.from_json(entry.params)
                try:  # an entry from an older generator may name parameters it no longer takes
                    variant.plan(spec, params, backend.device, epi)
                    return variant, params
                except Exception as err:  # noqa: BLE001 - a stale entry is a slower choice, never a crash
                    log.warning("stored choice %s [%s] no longer plans (%s); using the heuristic",
                                variant.name, params.short(), err)
    if config.autotune:
        try:
            return tuner.tune(spec, epi, workspace_limit, force=True).choice
        except TuneError as err:
            log.warning("autotuning failed, using the heuristic: %s", err)
    return heuristic_choice(spec, backend.device, workspace_limit)
