"""Progress of the long phases of a cold start: compiling a network's or a model's kernels, and others.

A :class:`Phase` says what it does, how many steps it has and how far it is, through the standard
``logging`` module (logger "convforge", level INFO: silent unless the user turns logging on, e.g.
``logging.basicConfig(level=logging.INFO)``) and through the listeners an application adds with
:func:`listen` (the command line draws progress bars with them). A phase that ends within
:data:`EVERY_S` seconds says nothing in the log; one that runs longer logs a line then (what it does,
how far it is), at most one more every :data:`EVERY_S` seconds as it advances, and one when it ends.
Phases are made only on cold paths (a compile, a calibration), never on a warm call; with logging
off and no listener a phase costs a few attribute writes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("convforge")
EVERY_S = 2.0  # a phase shorter than this is not logged; then at most one line this often
# (phase, event): "start", "advance", "slow" (it has run EVERY_S seconds: the log said so) and "end"
Listener = Callable[["Phase", str], None]
_LISTENERS: list[Listener] = []


class Phase:
    """One long step of work: ``what`` it does (e.g. "compiling GoogLeNet's kernels"), ``total``
    steps (None: unknown) of ``unit`` (e.g. "programs"). Call :meth:`advance` as steps finish (from
    any thread) and :meth:`end` when done (or use it as a context manager)."""

    def __init__(self, what: str, total: int | None = None, unit: str = "") -> None:
        self.what, self.total, self.unit = what, total, unit
        self.done = 0
        self.started = time.perf_counter()
        self.ended: float | None = None
        self.slow = False  # has run EVERY_S seconds (and said so)
        self._lock = threading.Lock()
        self._last = self.started
        self._timer: threading.Timer | None = None
        self._tell("start")
        if _LISTENERS or log.isEnabledFor(logging.INFO):
            self._timer = threading.Timer(EVERY_S, self._went_slow)
            self._timer.daemon = True
            self._timer.start()

    @property
    def seconds(self) -> float:
        return (self.ended or time.perf_counter()) - self.started

    def status(self) -> str:
        """'what: 12/51 programs, 8.3 s'."""
        of = "" if self.total is None else f"{self.done}/{self.total} {self.unit}".rstrip() + ", "
        return f"{self.what}: {of}{self.seconds:.1f} s"

    def _went_slow(self) -> None:
        with self._lock:
            if self.ended is not None:
                return
            self.slow = True
            self._last = time.perf_counter()
        log.info("convforge: %s", self.status())
        self._tell("slow")

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            now = time.perf_counter()
            due = self.slow and now - self._last >= EVERY_S
            if due:
                self._last = now
        if due:
            log.info("convforge: %s", self.status())
        self._tell("advance")

    def end(self) -> None:
        with self._lock:
            if self.ended is not None:
                return
            self.ended = time.perf_counter()
        if self._timer is not None:
            self._timer.cancel()
        if self.slow:
            done = f"{self.done} {self.unit} " if self.unit and self.done else ""
            log.info("convforge: %s: done, %sin %.1f s", self.what, done, self.seconds)
        self._tell("end")

    def _tell(self, event: str) -> None:
        for listener in list(_LISTENERS):
            try:
                listener(self, event)
            except Exception:  # noqa: BLE001 - a display's trouble never stops the work
                log.debug("convforge: a progress listener failed", exc_info=True)

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end()


@contextmanager
def listen(listener: Listener) -> Iterator[None]:
    """Tell ``listener`` of every phase's events while the block runs."""
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)
