"""Named-dimension array descriptors.

A kernel argument declares its dimension names (``n:c:y:x``), sizes and strides. Binding an array
with other names or sizes is refused. Index expressions for generated code come from here, with the
sizes and strides either folded in as compile-time constants or read from run-time arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

INT32_MAX = 2**31 - 1  # the largest element offset 32-bit index arithmetic holds


def _contiguous(sizes: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(sizes):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class ArrayDesc:
    """An array with named dimensions; strides count elements, not bytes."""

    name: str
    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...] = field(default=())
    runtime: bool = False  # strides as run-time kernel arguments instead of constants

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.sizes):
            raise ValueError(f"{self.name}: {len(self.dims)} dims but {len(self.sizes)} sizes")
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"{self.name}: repeated dimension name in {':'.join(self.dims)}")
        if not self.strides:
            object.__setattr__(self, "strides", _contiguous(self.sizes))
        if len(self.strides) != len(self.sizes):
            raise ValueError(f"{self.name}: {len(self.strides)} strides for {len(self.sizes)} dims")

    @classmethod
    def of(cls, name: str, dims: str, sizes: Sequence[int], runtime: bool = False) -> ArrayDesc:
        """``ArrayDesc.of("x", "n:c:y:x", (1, 3, 13, 13))``: contiguous, in the order named."""
        return cls(name, tuple(dims.split(":")), tuple(int(s) for s in sizes), runtime=runtime)

    @property
    def layout(self) -> str:
        return ":".join(self.dims)

    @property
    def numel(self) -> int:
        total = 1
        for s in self.sizes:
            total *= s
        return total

    @property
    def nbytes(self) -> int:
        return 4 * self.numel

    def size(self, dim: str) -> int:
        return self.sizes[self._pos(dim)]

    def stride(self, dim: str) -> int:
        return self.strides[self._pos(dim)]

    def _pos(self, dim: str) -> int:
        try:
            return self.dims.index(dim)
        except ValueError:
            raise KeyError(f"{self.name} ({self.layout}) has no dimension {dim!r}") from None

    def check(self, dims: str | Sequence[str], shape: Sequence[int],
              strides: Sequence[int] | None = None) -> None:
        """Refuse an array whose names, sizes or element strides differ from this descriptor."""
        names = tuple(dims.split(":")) if isinstance(dims, str) else tuple(dims)
        if names != self.dims:
            raise ValueError(f"{self.name}: expected dimensions {self.layout}, got {':'.join(names)}")
        if tuple(shape) != self.sizes:
            raise ValueError(f"{self.name}: expected shape {self.sizes} ({self.layout}), "
                             f"got {tuple(shape)}")
        if strides is not None and tuple(strides) != self.strides:
            raise ValueError(f"{self.name}: expected element strides {self.strides}, "
                             f"got {tuple(strides)} (pass a contiguous array)")

    def stride_name(self, dim: str) -> str:
        return f"{self.name}_stride_{dim}"

    def stride_args(self) -> list[tuple[str, int]]:
        """(name, value) of the run-time stride arguments, empty for compile-time arrays."""
        if not self.runtime:
            return []
        return [(self.stride_name(d), st) for d, st in zip(self.dims, self.strides)]

    def index(self, **coords: str | int) -> str:
        """C expression of the flat offset of ``coords`` (dimension name -> expression).

        Dimensions not named are taken at 0. Compile-time strides are folded as literals. Where
        the offset can pass 2^31 - 1 (an array of more elements) it is computed in 64 bits: a term
        that can pass it alone has its coordinate cast to ``I64``, and so has the first term, so
        every addition after it is 64-bit too (see :meth:`wide`).
        """
        unknown = set(coords) - set(self.dims)
        if unknown:
            raise KeyError(f"{self.name} ({self.layout}) has no dimension(s) {sorted(unknown)}")
        named = [(d, st, sz) for d, st, sz in zip(self.dims, self.strides, self.sizes) if d in coords]
        whole = sum((sz - 1) * st for _, st, sz in named) > INT32_MAX
        terms: list[str] = []
        for d, st, sz in named:
            expr = coords[d]
            if isinstance(expr, int) and not self.runtime:
                off = expr * st
                if off:
                    terms.append(f"(I64){off}" if off > INT32_MAX or (whole and not terms) else str(off))
                continue
            expr = str(expr)
            if (whole and not terms) or (sz - 1) * st > INT32_MAX:
                expr = f"(I64)({expr})"
            if self.runtime:
                terms.append(f"({expr})*{self.stride_name(d)}")
            elif st == 1:
                terms.append(f"({expr})")
            else:
                terms.append(f"({expr})*{st}")
        return " + ".join(terms) if terms else "0"

    @property
    def wide(self) -> bool:
        """Some offset into this array passes 2^31 - 1: :meth:`index` writes 64-bit arithmetic."""
        return self.numel - 1 > INT32_MAX
