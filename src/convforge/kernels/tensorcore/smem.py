"""Shared-memory tiles of the generator: the 128-byte swizzle, wgmma matrix descriptors, stage layout.

Facts from the PTX ISA (wgmma, "matrix descriptor" and "shared memory matrix layout"), encoded once:

* A K-major operand tile with the 128-byte swizzle is a stack of 8-row x 128-byte atoms: row r at
  byte 128 r, its 16-byte chunk c stored at position c ^ (r % 8) (address bits [4:6] ^= [7:9]); the
  atom must start 1024-byte aligned. More K than 128 bytes: further column blocks ("atoms" here) of
  the whole tile, each rows x 128 bytes, one after the other.
* The 64-bit descriptor: start address >> 4 in bits 0-13, leading byte offset >> 4 in 16-29 (unused
  by swizzled K-major layouts; 1 as CUTLASS sets it), stride byte offset >> 4 in 32-45 (1024: from one
  8-row group to the next), base offset in 49-51 (0: atoms 1024-aligned), layout in 62-63 (1 = 128B).
* A k step (32 bytes of K) reads from start + 32 kk within the row, its unswizzled position: the
  hardware swizzles the whole address, so advancing the start address by 32 bytes is the k step.

:func:`model_address` is the hardware's read as the ISA documents it, written independently of
:meth:`Tile.chunk_offset` (the copies' write); tests/test_tensorcore_gen.py checks that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from convforge.kernels.tensorcore.isa import KSTEP_BYTES, ROW_BYTES

ALIGN = 1024  # a swizzle atom's alignment
SBO = 8 * ROW_BYTES  # bytes between 8-row groups
LBO = 16  # leading byte offset field (ignored for swizzled K-major; CUTLASS writes 1 = 16 bytes)
MODE_128B = 1
MAX_SHARED = 227 * 1024  # a block's shared memory on sm_90 (opt-in)


def desc_high() -> int:
    """Descriptor bits above the start address: LBO, SBO, base offset 0, the 128-byte swizzle."""
    return ((LBO >> 4) << 16) | ((SBO >> 4) << 32) | (MODE_128B << 62)


@dataclass(frozen=True)
class Tile:
    """One K-major operand part of one stage: ``rows`` (a multiple of 8) x ``atoms`` 128-byte rows of K."""

    rows: int
    atoms: int

    def __post_init__(self) -> None:
        if self.rows % 8 or self.rows <= 0 or self.atoms not in (1, 2, 4):
            raise ValueError(f"tile of {self.rows} rows x {self.atoms} atoms: rows a multiple of 8, atoms 1, 2 or 4")

    @property
    def nbytes(self) -> int:
        return self.rows * self.atoms * ROW_BYTES

    @property
    def chunks_per_row(self) -> int:
        return self.atoms * ROW_BYTES // 16

    def chunk_offset(self, r: str, c: str) -> str:
        """Byte offset in the tile of 16-byte chunk ``c`` (0 .. 8 atoms - 1) of row ``r`` (C expressions)."""
        return (f"(((({c}) >> 3) * {self.rows * ROW_BYTES}) + ({r}) * {ROW_BYTES} + "
                f"(((({c}) & 7) ^ (({r}) & 7)) << 4))")

    def step_offset(self, kk: int) -> int:
        """Start-address advance of k step ``kk`` (0 .. 4 atoms - 1): its atom, then 32 bytes per step."""
        per = ROW_BYTES // KSTEP_BYTES
        return (kk // per) * self.rows * ROW_BYTES + (kk % per) * KSTEP_BYTES

    @property
    def steps(self) -> int:
        return self.atoms * ROW_BYTES // KSTEP_BYTES


def model_address(desc: int, r: int, kbyte: int) -> int:
    """Shared byte address wgmma reads for row ``r``, byte ``kbyte`` (< 32) of K of the operand that
    ``desc`` describes: the ISA's canonical K-major 128-byte-swizzle layout."""
    assert desc >> 62 == MODE_128B, "only the 128-byte swizzle is modelled"
    assert 0 <= kbyte < KSTEP_BYTES
    start = (desc & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    lin = start + (r // 8) * sbo + (r % 8) * ROW_BYTES + kbyte
    return lin ^ (((lin >> 7) & 7) << 4)


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage: the A parts (each ``a``), then the B parts (each ``b``), 1024-aligned."""

    a: Tile
    b: Tile
    parts: tuple[str, ...] = ("hi",)

    def __post_init__(self) -> None:
        if self.a.atoms != self.b.atoms:
            raise ValueError("A and B tiles of a stage must hold the same K")

    def offset(self, operand: str, part: str) -> int:
        """Byte offset of ``operand`` ('a' or 'b') ``part`` in the stage."""
        i = self.parts.index(part)
        if operand == "a":
            return i * self.a.nbytes
        return len(self.parts) * self.a.nbytes + i * self.b.nbytes

    @property
    def nbytes(self) -> int:
        return len(self.parts) * (self.a.nbytes + self.b.nbytes)

    def tile(self, operand: str) -> Tile:
        return self.a if operand == "a" else self.b
