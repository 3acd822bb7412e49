"""Tuning parameters as small immutable, hashable values (Triton's configs, as values)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any


class Params(Mapping[str, Any]):
    """A frozen mapping of parameter name to int/bool/str value; hashable and JSON-friendly."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None, **kw: Any) -> None:
        merged = dict(items or {})
        merged.update(kw)
        for key, val in merged.items():
            if not isinstance(val, (int, bool, str, float)):
                raise ValueError(f"parameter {key} ({val!r}) must be int, bool, float or str")
        self._items: tuple[tuple[str, Any], ...] = tuple(sorted(merged.items()))

    def __getitem__(self, key: str) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Params) and self._items == other._items

    def __repr__(self) -> str:
        return "Params(" + ", ".join(f"{k}={v!r}" for k, v in self._items) + ")"

    def replace(self, **kw: Any) -> Params:
        return Params(dict(self._items), **kw)

    def short(self) -> str:
        """Compact text such as ``tp=2 tq=4 smem=1``."""
        return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self._items)

    def to_json(self) -> str:
        return json.dumps(dict(self._items), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Params:
        return cls(json.loads(text))

    @classmethod
    def parse(cls, text: str) -> Params:
        """``"tp=2,tq=4,smem=true"`` -> Params; ints and booleans are recognised. An item without
        a name or without ``=`` is a ValueError quoting it."""
        out: dict[str, Any] = {}
        for item in text.replace(" ", ",").split(","):
            if not item:
                continue
            key, eq, val = item.partition("=")
            if not eq or not key:
                raise ValueError(f"params item {item!r} must be NAME=VALUE (e.g. tp=2)")
            low = val.lower()
            if low in ("true", "false"):
                out[key] = low == "true"
            else:
                try:
                    out[key] = int(val)
                except ValueError:
                    out[key] = val
        return cls(out)
