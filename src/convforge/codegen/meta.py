"""Metacode helpers: build readable kernel bodies from Python with the concrete sizes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Code:
    """An indented list of lines; ``with code.block("for (...)"):`` opens a brace."""

    def __init__(self, indent: int = 1) -> None:
        self.lines: list[str] = []
        self.level = indent

    def __call__(self, *lines: str) -> Code:
        for text in lines:
            for ln in text.split("\n"):
                self.lines.append("    " * self.level + ln if ln else "")
        return self

    @contextmanager
    def block(self, head: str) -> Iterator[Code]:
        self((head + " {").lstrip())
        self.level += 1
        try:
            yield self
        finally:
            self.level -= 1
            self("}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def fl(v: float) -> str:
    """A float literal that both C dialects read as float32."""
    if v == int(v) and abs(v) < 1e7:
        return f"{float(v):.1f}f"
    return f"{v!r}f"


def bounds(expr: str, lo: int, hi: int) -> str:
    """C condition lo <= expr < hi, with the unsigned-compare trick when lo is 0."""
    if lo == 0:
        return f"(unsigned)({expr}) < {hi}u"
    return f"({expr}) >= {lo} && ({expr}) < {hi}"


def halving_tree(code: Code, n: int, idx: str, add: Callable[[int], str]) -> None:
    """A sum over ``n`` threads (a power of 2) through shared memory in a fixed order: for half = n / 2 .. 1
    the threads whose ``idx`` is below half run ``add(half)`` (adding the value half further on), then a
    barrier; the sum lands at ``idx`` 0."""
    half = n // 2
    while half >= 1:
        code(f"if ({idx} < {half}) {add(half)}", "BARRIER();")
        half //= 2
