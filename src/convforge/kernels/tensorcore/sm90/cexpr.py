"""Integer C expressions that Python evaluates too.

The generator writes its index arithmetic (which thread copies which chunk from where to where, where
an accumulator is staged and stored) as strings in a small C subset: integers, ``+ - * / % << >> & |
^``, comparisons, ``&& || !``, ``min``, ``max``, ``(unsigned)(...)`` and parentheses. The CUDA source
prints them; the NumPy emulation of a block (tests/test_tensorcore_gen.py) evaluates the very same
strings, so the model checks the code that runs and not a second description of it. Divisions and
remainders only ever see non-negative operands (C truncates, Python floors: they agree there);
:func:`evaluate` checks that.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from convforge.codegen.meta import Code

_LOGIC = ((re.compile(r"&&"), " and "), (re.compile(r"\|\|"), " or "), (re.compile(r"!(?!=)"), " not "))
_DIV = re.compile(r"(?<![/])/(?![/])")


class _Int(int):
    """An int whose / and % refuse negative operands (where C and Python would disagree)."""

    def _check(self, other: Any) -> None:
        if self < 0 or int(other) <= 0:
            raise ValueError(f"C division of {int(self)} by {int(other)}: operands must be >= 0 and > 0")

    def __floordiv__(self, other: Any) -> _Int:
        self._check(other)
        return _Int(int(self) // int(other))

    def __mod__(self, other: Any) -> _Int:
        self._check(other)
        return _Int(int(self) % int(other))

    def __add__(self, other: Any) -> _Int:
        return _Int(int(self) + int(other))

    __radd__ = __add__

    def __sub__(self, other: Any) -> _Int:
        return _Int(int(self) - int(other))

    def __rsub__(self, other: Any) -> _Int:
        return _Int(int(other) - int(self))

    def __mul__(self, other: Any) -> _Int:
        return _Int(int(self) * int(other))

    __rmul__ = __mul__

    def __rfloordiv__(self, other: Any) -> _Int:
        return _Int(other).__floordiv__(self)

    def __rmod__(self, other: Any) -> _Int:
        return _Int(other).__mod__(self)


_NUM = re.compile(r"\b(\d+)u?\b")


def _u32(v: int) -> int:
    """C's (unsigned) cast: a negative int wraps to a large value."""
    return int(v) % 2**32


@lru_cache(maxsize=4096)
def _compiled(expr: str) -> Any:
    if re.search(r"\(unsigned\)(?!\()", expr):
        raise ValueError(f"write (unsigned)(...) with parentheses in generator expressions: {expr}")
    text = expr.replace("(unsigned)(", "_u32(").replace("(int)", "")
    for pat, rep in _LOGIC:
        text = pat.sub(rep, text)
    text = _DIV.sub("//", text)
    text = _NUM.sub(r"_Int(\1)", text)
    return compile(text, "<cexpr>", "eval")


def evaluate(expr: str, env: Mapping[str, int]) -> int:
    """The value of C expression ``expr`` with the variables of ``env`` (ints)."""
    code = _compiled(expr)
    scope: dict[str, Any] = {k: _Int(env[k]) for k in code.co_names if k in env}  # only the names it reads
    scope.update(_Int=_Int, _u32=_u32, min=min, max=max)
    return int(eval(code, {"__builtins__": {}}, scope))  # noqa: S307 - our own strings


@dataclass(frozen=True)
class Let:
    """``const int name = expr;`` in C, and the same binding in the emulation."""

    name: str
    expr: str
    ctype: str = "int"

    def emit(self, code: Code) -> None:
        code(f"const {self.ctype} {self.name} = {self.expr};")


def emit_all(code: Code, lets: Iterable[Let]) -> None:
    for let in lets:
        let.emit(code)


def bind(lets: Iterable[Let], env: dict[str, int]) -> dict[str, int]:
    """``env`` extended by ``lets`` in order (each may use the ones before)."""
    out = dict(env)
    for let in lets:
        out[let.name] = evaluate(let.expr, out)
    return out
