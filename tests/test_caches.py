"""convforge.caches: the one registry of the library's caches and the events that empty them."""

from __future__ import annotations

import pytest

from convforge import caches, dispatch, tune
from convforge.config import config


@pytest.fixture
def table():  # type: ignore[no-untyped-def]
    """A cache registered on executables and settings for the test, taken out afterwards."""
    t = {"k": 1}
    caches.register(t.clear, "test: a table", on=("executables", "settings"))
    yield t
    caches._CACHES[:] = [c for c in caches._CACHES if c.clear != t.clear]


def test_the_library_registers_its_caches() -> None:
    import convforge.grad  # noqa: F401  (registers its table on import)

    names = caches.registered()
    for name in ("dispatch: choices", "dispatch: compiled executables", "dispatch: per-call runners",
                 "tune: open databases", "grad: bias-gradient executables"):
        assert name in names, names
    assert caches.registered("choices") == ["dispatch: choices"]


def test_events_empty_what_is_registered_on_them(table: dict[str, int]) -> None:
    caches.clear("choices", "databases")
    assert table == {"k": 1}
    dispatch.clear_choices()
    tune.clear_choices()
    assert table == {"k": 1}
    dispatch.clear_executables()
    assert table == {}
    table["k"] = 2
    config.precision = config.precision  # any assignment of a setting
    assert table == {}
    table["k"] = 3
    caches.clear()
    assert table == {}


def test_registering_twice_keeps_one_entry(table: dict[str, int]) -> None:
    before = len(caches.registered())
    caches.register(table.clear, "test: again")
    assert len(caches.registered()) == before and "test: again" not in caches.registered()
    assert caches.is_registered(table.clear)


def test_unknown_events_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"events \(later\) must be among choices, databases"):
        caches.register(dict().clear, "test: bad", on=("later",))
    with pytest.raises(ValueError, match=r"events \(none\)"):
        caches.register(dict().clear, "test: bad", on=())
    with pytest.raises(ValueError, match=r"events \(sometime\)"):
        caches.clear("sometime")
