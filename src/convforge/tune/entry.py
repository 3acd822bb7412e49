"""One tuned layer as the tuning database stores and exports it (:class:`Entry`), and the constants an
export and its validation share: the database (``db``) and the import checks (``validate``) both read
them from here, so neither imports the other's module for them."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass

from convforge.tune.dbfile import KEY_FIELDS

EXPORT_FORMAT = "convforge-tuning"
MIN_TIME_MS = 1e-4  # 0.1 us: no kernel launch is faster; an imported claim below it is implausible


def now() -> str:
    """The time now, UTC, to the second (ISO 8601): an entry's date."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Entry:
    """One tuned layer: the key (``KEY_FIELDS``) and what was chosen, with the heuristic for comparison.
    ``error`` is the chosen candidate's measured error, ``min_error`` the smallest any candidate
    measured on the layer (None when unknown)."""

    device: str
    backend: str
    version: str
    spec: str
    dtype: str
    epilogue: str
    variant: str
    params: str  # Params.to_json()
    time_ms: float
    workspace: int
    error: float
    date: str
    spec_json: str = "{}"
    heuristic_variant: str = ""
    heuristic_params: str = "{}"
    heuristic_ms: float | None = None
    candidates: int = 0
    seconds: float = 0.0
    precision: str = "fp32"
    min_error: float | None = None

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(getattr(self, f) for f in KEY_FIELDS)

    @property
    def speedup(self) -> float | None:
        """Heuristic time over tuned time (None when the heuristic was not measured)."""
        if not self.heuristic_ms or not self.time_ms:
            return None
        return self.heuristic_ms / self.time_ms
