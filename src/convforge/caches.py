"""The library's caches, registered in one place: each module that keeps a table derived from
choices, compiled code or settings registers how to empty it, and on which event.

Events (what makes a table stale):

- ``choices``: which variant runs a layer may have changed (the tuning database was written);
- ``databases``: open tuning-database handles must be reopened (the file changed underneath);
- ``executables``: compiled executables and the per-call runners built on them are forgotten;
- ``settings``: a setting of :data:`convforge.config` was assigned (tables keyed on settings
  implicitly, such as the native fast path's).

:func:`convforge.dispatch.clear_choices`, :func:`convforge.dispatch.clear_executables` and
:func:`convforge.tune.clear_choices` clear their events here; every assignment of a setting clears
``settings``; :func:`clear` without an event empties every registered cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from convforge.config import config

EVENTS = ("choices", "databases", "executables", "settings")


@dataclass(frozen=True)
class Cache:
    """One registered cache: its name (for :func:`registered`), how to empty it, and the events
    on which it is emptied."""

    name: str
    clear: Callable[[], object]
    on: tuple[str, ...]


_CACHES: list[Cache] = []
_LOCK = threading.Lock()


def register(clear_fn: Callable[[], object], name: str, on: tuple[str, ...] = ("executables",)) -> None:
    """Empty a cache by calling ``clear_fn()`` on each event of ``on``. Registering the same
    ``clear_fn`` again changes nothing (modules that register lazily may ask more than once)."""
    bad = [e for e in on if e not in EVENTS]
    if bad or not on:
        raise ValueError(f"cache {name!r}: events ({', '.join(bad) or 'none'}) must be among {', '.join(EVENTS)}")
    with _LOCK:
        if not is_registered(clear_fn):
            _CACHES.append(Cache(name, clear_fn, tuple(on)))


def is_registered(clear_fn: Callable[[], object]) -> bool:
    """Whether ``clear_fn`` empties a registered cache."""
    return any(c.clear == clear_fn for c in _CACHES)


def clear(*events: str) -> None:
    """Empty the caches registered on ``events``, event by event in the order given, each event's
    caches in the order they were registered; without events, every cache once."""
    bad = [e for e in events if e not in EVENTS]
    if bad:
        raise ValueError(f"events ({', '.join(bad)}) must be among {', '.join(EVENTS)}")
    caches = list(_CACHES)
    if not events:
        for cache in caches:
            cache.clear()
        return
    for event in events:
        for cache in caches:
            if event in cache.on:
                cache.clear()


def registered(event: str | None = None) -> list[str]:
    """The names of the caches registered (on ``event``), in the order they were registered."""
    return [c.name for c in _CACHES if event is None or event in c.on]


config.on_change(lambda: clear("settings"))
