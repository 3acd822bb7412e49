"""Shared-memory tiles of the generator: the 128-, 64- and 32-byte swizzles, wgmma matrix descriptors,
stage layout.

Facts from the PTX ISA (wgmma, "matrix descriptor" and "shared memory matrix layout"), encoded once:

* A K-major operand tile with the W-byte swizzle (W = 128, 64 or 32: the tile's ``width``) is a stack
  of 8-row x W-byte atoms: row r at byte W r, its 16-byte chunk c stored at position
  c ^ ((W r >> 7) % (W / 16)) (address bits [4:4+b) ^= [7:7+b), b = log2(W / 16): 128 B: c ^ (r % 8),
  64 B: c ^ ((r >> 1) % 4), 32 B: c ^ ((r >> 2) % 2)); the atom must start 8 W-byte aligned. More K
  than W bytes: further column blocks ("atoms" here) of the whole tile, each rows x W bytes, one
  after the other. The copy engine writes the same patterns (``CU_TENSOR_MAP_SWIZZLE_128B / 64B / 32B``,
  an inner box of W bytes). A narrower swizzle serves operands whose channels are not whole 128-byte
  rows (wgrad's x' at a batch of 16: 64 bytes of TF32), so that TMA can still bring them.
* The 64-bit descriptor: start address >> 4 in bits 0-13, leading byte offset >> 4 in 16-29 (unused
  by swizzled K-major layouts; 1 as CUTLASS sets it), stride byte offset >> 4 in 32-45 (8 W: from one
  8-row group to the next), base offset in 49-51 (0: atoms aligned), layout in 62-63 (1 = 128B,
  2 = 64B, 3 = 32B).
* A k step (32 bytes of K) reads from start + 32 kk within the row, its unswizzled position: the
  hardware swizzles the whole address, so advancing the start address by 32 bytes is the k step
  (a 32-byte row is one k step: the next step is the next column block).
* An MN-major tile (16-bit types only; wgmma's transpose immediates 1) in the 128-byte swizzle: its rows
  are K (``rows`` K elements), each row 64 elements of M or N; ``atoms`` blocks of 64 MN elements, each
  ``rows`` x 128 bytes, one after the other. CUTLASS's canonical form in 16-byte units is
  ((8, m), (8, k)) : ((1, LBO), (8, SBO)): the leading byte offset is the step from one 64-element MN
  block to the next (``rows`` x 128 here), the stride byte offset from 8 K rows to the next (1024). A
  k step (16 K rows) advances the start address by 16 rows (2048 bytes). The copy engine writes these
  tiles as it writes K-major ones: a box of 64 channels (128 bytes) by ``rows`` pixels per block.

:func:`model_address` is the hardware's read as the ISA documents it, written independently of
:meth:`Tile.chunk_offset` (the copies' write); tests/test_tensorcore_gen.py checks that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from convforge.kernels.tensorcore.sm90.isa import KSTEP_BYTES, ROW_BYTES

ALIGN = 1024  # a 128-byte swizzle atom's alignment (the narrower ones need less)
SBO = 8 * ROW_BYTES  # bytes between 8-row groups of a 128-byte-swizzled tile
LBO = 16  # leading byte offset field (ignored for swizzled K-major; CUTLASS writes 1 = 16 bytes)
MODE_128B = 1
MODES = {128: 1, 64: 2, 32: 3}  # swizzle width (row bytes) -> descriptor layout type
WIDTHS = {v: k for k, v in MODES.items()}
MAX_SHARED = 227 * 1024  # a block's shared memory on sm_90 (opt-in)


def desc_high(width: int = ROW_BYTES) -> int:
    """Descriptor bits above the start address: LBO, SBO (8 rows of ``width`` bytes), base offset 0,
    the ``width``-byte swizzle."""
    return ((LBO >> 4) << 16) | ((8 * width >> 4) << 32) | (MODES[width] << 62)


def swizzled(row: int, chunk: int, width: int) -> int:
    """Where 16-byte chunk ``chunk`` of row ``row`` of a ``width``-byte-swizzled atom stack is stored
    (its chunk position in the row): the pattern both the copies and the copy engine write."""
    return chunk ^ ((row * width >> 7) % (width // 16))


# The interleaved (unswizzled) K-major layout, layout type 0: "core matrices" of 8 rows x 16 bytes stored
# contiguously (128 bytes each), K-adjacent core matrices LBO bytes apart, 8-row groups SBO bytes apart.
# Only gemm1x1_wgmma_tf32 can use it (``sw=0``, off its tuning space: its wgmma reads conflict).
CORE_BYTES = 128  # one core matrix: 8 rows x 16 bytes
CORE_LBO = CORE_BYTES  # K-adjacent core matrices of a row group are stored one after the other


def desc_high_interleaved() -> int:
    """Descriptor bits above the start address of an interleaved tile of 128-byte rows: LBO, SBO,
    base offset 0, layout type 0 (no swizzle)."""
    return ((CORE_LBO >> 4) << 16) | ((SBO >> 4) << 32)


def interleaved_offset(r: str, c: str) -> str:
    """C expression: byte offset of 16-byte chunk ``c`` of row ``r`` in an interleaved tile."""
    return f"((({r}) >> 3) * {SBO} + ({c}) * {CORE_LBO} + ((({r}) & 7) << 4))"


def model_address_interleaved(desc: int, r: int, k: int) -> int:
    """Shared byte address wgmma reads for row ``r``, 4-byte element ``k`` (< 8) of an interleaved
    K-major tile: the ISA's canonical no-swizzle layout, read from the descriptor's LBO and SBO."""
    assert desc >> 62 == 0 and 0 <= k < 8
    start = (desc & 0x3FFF) << 4
    lbo, sbo = ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
    return start + (r // 8) * sbo + (k // 4) * lbo + (r % 8) * 16 + (k % 4) * 4


MN_STEP_ROWS = 16  # K rows of one k step of an MN-major (16-bit) tile


@dataclass(frozen=True)
class Tile:
    """One operand part of one stage. K-major (``major`` "k"): ``rows`` (a multiple of 8) x ``atoms``
    column blocks of ``width``-byte swizzled rows of K (128 unless an operand's channels ask for
    less). MN-major ("mn", 16-bit types): ``rows`` K elements x ``atoms`` blocks of 64 MN elements, each
    a 128-byte-swizzled block of ``rows`` rows (see the module docstring)."""

    rows: int
    atoms: int
    width: int = ROW_BYTES
    major: str = "k"

    def __post_init__(self) -> None:
        if self.major == "mn":
            if self.rows % MN_STEP_ROWS or self.rows <= 0 or not 1 <= self.atoms <= 4 or self.width != ROW_BYTES:
                raise ValueError(f"MN-major tile of {self.rows} K rows x {self.atoms} blocks: K rows a multiple of "
                                 f"{MN_STEP_ROWS}, 1 to 4 blocks of 64, the 128-byte swizzle")
            return
        if self.major != "k":
            raise ValueError(f"tile major {self.major!r} is not 'k' or 'mn'")
        if self.rows % 8 or self.rows <= 0 or self.atoms not in (1, 2, 4, 8):
            raise ValueError(f"tile of {self.rows} rows x {self.atoms} atoms: rows a multiple of 8, atoms 1, 2, 4 "
                             "or 8")
        if self.width not in MODES:
            raise ValueError(f"a {self.width}-byte swizzle is not one of {sorted(MODES)}")

    @property
    def mn(self) -> bool:
        return self.major == "mn"

    @property
    def kspan(self) -> int:
        """Bytes of K a stage holds per M or N index (A's and B's must agree): a K-major row's, or an
        MN-major tile's K rows of 2-byte elements."""
        return 2 * self.rows if self.mn else self.kbytes

    def block_offset(self, mi: int) -> int:
        """Byte offset of the ``mi``-th block of 64 M (or N) indices: 64 rows on (K-major), or the
        ``mi``-th 64-element block (MN-major)."""
        return mi * self.rows * self.width if self.mn else 64 * self.width * mi

    @property
    def nbytes(self) -> int:
        return self.rows * self.kbytes

    @property
    def kbytes(self) -> int:
        """Bytes of K per row of the whole tile (every atom)."""
        return self.atoms * self.width

    @property
    def chunks_per_row(self) -> int:
        return self.kbytes // 16

    def chunk_offset(self, r: str, c: str) -> str:
        """Byte offset in the tile of 16-byte chunk ``c`` (0 .. chunks_per_row - 1) of row ``r`` (C
        expressions; :func:`swizzled`)."""
        per = self.width // 16
        rin = {128: f"({r})", 64: f"(({r}) >> 1)", 32: f"(({r}) >> 2)"}[self.width]
        return (f"(((({c}) >> {per.bit_length() - 1}) * {self.rows * self.width}) + ({r}) * {self.width} + "
                f"(((({c}) & {per - 1}) ^ ({rin} & {per - 1})) << 4))")

    def step_offset(self, kk: int) -> int:
        """Start-address advance of k step ``kk`` (0 .. steps - 1): its atom, then 32 bytes per step
        (MN-major: 16 K rows per step)."""
        if self.mn:
            return kk * MN_STEP_ROWS * self.width
        per = self.width // KSTEP_BYTES
        return (kk // per) * self.rows * self.width + (kk % per) * KSTEP_BYTES

    @property
    def steps(self) -> int:
        return self.rows // MN_STEP_ROWS if self.mn else self.kbytes // KSTEP_BYTES

    @property
    def desc_high(self) -> int:
        """The descriptor bits above the start address for this tile's swizzle (MN-major: the leading
        byte offset steps from one 64-element block to the next)."""
        if self.mn:
            return (((self.rows * self.width) >> 4) << 16) | ((8 * self.width >> 4) << 32) | (MODE_128B << 62)
        return desc_high(self.width)


def model_address(desc: int, r: int, kbyte: int) -> int:
    """Shared byte address wgmma reads for row ``r``, byte ``kbyte`` (< 32) of K of the operand that
    ``desc`` describes: the ISA's canonical K-major swizzled layouts (128, 64 or 32 bytes: address
    bits [4:4+b) ^= [7:7+b) over 8-row atoms of rows that wide)."""
    width = WIDTHS[desc >> 62]
    assert 0 <= kbyte < KSTEP_BYTES
    start = (desc & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    lin = start + (r // 8) * sbo + (r % 8) * width + kbyte
    return lin ^ (((lin >> 7) & (width // 16 - 1)) << 4)


def model_address_mn(desc: int, mn: int, k: int, esize: int = 2) -> int:
    """Shared byte address wgmma reads for element (``mn``, ``k``) of an MN-major 128-byte-swizzled
    operand (k < 16 within the step): CUTLASS's canonical ((8, m), (8, k)) : ((1, LBO), (8, SBO)) in
    16-byte units, elements within a 16-byte unit contiguous, then the 128-byte swizzle."""
    assert desc >> 62 == MODE_128B and esize == 2 and 0 <= k < MN_STEP_ROWS
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    lin = start + (mn // 64) * lbo + (mn % 64) * esize + (k // 8) * sbo + (k % 8) * ROW_BYTES
    return lin ^ (((lin >> 7) & 7) << 4)


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage: the A parts (each ``a``), then the B parts (each ``b``), 1024-aligned."""

    a: Tile
    b: Tile
    parts: tuple[str, ...] = ("hi",)

    def __post_init__(self) -> None:
        if self.a.kspan != self.b.kspan or self.a.major != self.b.major:
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
