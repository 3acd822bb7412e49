"""Autotuning and the tuning database.

The choice of a variant for a call lives in :mod:`convforge.dispatch` (database first, then tuning
on first sight when ``config.autotune`` is on, then the heuristic); this package measures and stores.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from convforge import caches
from convforge.config import config
from convforge.tune.db import Entry, TuningDB
from convforge.tune.heuristic import heuristic_choice
from convforge.tune.tuner import Budget, TuneError, Tuner, TuneResult

__all__ = ["clear_choices", "open_db", "Budget", "Entry", "Tuner", "TuneError", "TuneResult",
           "TuningDB", "heuristic_choice", "AUTOTUNE_BUDGET"]

log = logging.getLogger("convforge.tune")
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
            try:
                missing = not write and not path.exists()
            except OSError:  # a folder above it may not be entered: TuningDB says so below
                missing = False
            if missing:
                return None  # not remembered: a later tuning run may create it
            try:
                _DBS[key] = TuningDB(path, readonly=not write)
            except Exception as err:  # noqa: BLE001 - no database is a slower choice, never a crash
                log.warning("tuning database %s unavailable (%s); using the heuristic", path, err)
                _DBS[key] = None
        return _DBS[key]


def _close_dbs() -> None:
    """Close the shared database handles; the next :func:`open_db` opens the file anew."""
    with _LOCK:
        for db in _DBS.values():
            if db is not None:
                db.close()
        _DBS.clear()


caches.register(_close_dbs, "tune: open databases", on=("databases",))


def clear_choices() -> None:
    """Forget cached choices and database handles (after the database changed underneath)."""
    caches.clear("choices", "databases")
