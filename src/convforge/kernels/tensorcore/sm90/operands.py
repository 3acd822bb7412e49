"""Operand iterators: what the producer warpgroup copies into each stage.

The protocol (:class:`Operand`): an implicit GEMM D (M x N) = A (M x Kred) . B (N x Kred)^T with both
operands K-major. An iterator owns one of them; for every stage it names, per producer thread, a list
of 16-byte copies (:class:`Copy`: shared byte offset in its tile, source element offset, predicate),
from bindings (:class:`~convforge.kernels.tensorcore.sm90.cexpr.Let`) at three levels:

* ``thread_lets``: per producer thread (``tid`` 0..127), once;
* ``tile_lets``: per output tile (``ra0`` / ``rb0``: the tile's first row of A / B; ``bz``: the batch);
* ``stage_lets``: per stage (``kt``: the index of the K block, 0 .. Kred / stage elements).

The mainloop prints them as C; the emulation evaluates the same strings. Every iterator here maps
thread ``tid`` to chunk ``tid % 8`` of rows ``tid / 8 + 16 i`` (and chunk 8 a + tid % 8 of each
further 128-byte atom a): 8 consecutive threads fill one 128-byte row of the swizzled tile, one
conflict-free quarter-warp store, and read 128 contiguous bytes where the source row is contiguous.
Rows past the operand's end are clamped to its last row (finite data; their results are never stored).

fprop: A = :class:`Im2colNhwc` (output pixels x (r, s, c) of NHWC activations, any stride, dilation,
padding), B = :class:`DenseRows` (filters packed K x (r, s, c)). Winograd's batched GEMM: both
:class:`DenseRows` (V[e]: tiles x C, U[e]: K x C). wgrad (tensorcore/sm90/wgrad.py) is the forward
convolution of a transposed problem, so the same two serve it (A: im2col rows (c, r, s) of x with
the images as channels, B: dy rows); a stride-1 unpadded 1x1 layer's wgrad reads x and dy as they
lie, as :class:`PlanarRows` (rows = channels, reduction along the pixels of each image). dgrad of
stride 1 is the forward convolution of dy with rotated filters (kernels/dgrad/transposed.py). The TMA
producer (tensorcore/sm90/tma.py, ``tm=1``) brings DenseRows and Im2colNhwc operands by tensor maps
instead of these copies where their channels are whole 128-byte atoms.

MN-major operands (16-bit types, TMA only; ``TileConfig.mn``): the reduction runs over the rows of a
channels-last tensor, the M or N index along its channels. :class:`MnRows` reads a row-major matrix
(dy = [N P Q][K]: column k, reduction row), :class:`MnIm2col` the pixels of one filter tap of NHWC
activations (x: row (tap, c) of D, reduction over the output pixels). wgrad of channels-last layers
(tensorcore/sm90/wgrad_nhwc.py) multiplies the two as they lie.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from convforge.codegen.dialect import Buf
from convforge.kernels.tensorcore.sm90.cexpr import Let
from convforge.kernels.tensorcore.sm90.isa import Math
from convforge.kernels.tensorcore.sm90.smem import Tile

THREADS = 128  # the producer warpgroup


@dataclass(frozen=True)
class Copy:
    """One 16-byte cp.async: shared byte offset in the operand's tile, source element offset in the
    part's buffer, and the predicate (empty: always) under which it reads (else it zero-fills)."""

    smem: str
    src: str
    pred: str = ""


class Operand(Protocol):
    """An operand iterator (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def tile(self) -> Tile: ...

    @property
    def math(self) -> Math: ...

    def buffer(self, part: str) -> str: ...

    def args(self) -> tuple[Buf, ...]: ...

    def scale_args(self) -> tuple[Buf, ...]: ...

    def thread_lets(self) -> list[Let]: ...

    def tile_lets(self) -> list[Let]: ...

    def stage_lets(self) -> list[Let]: ...

    def copies(self) -> list[Copy]: ...

    @property
    def per_thread(self) -> int: ...

    def row_lets(self, i: int) -> list[Let]: ...

    def row_copies(self, i: int) -> list[Copy]: ...


@dataclass(frozen=True)
class _Rows:
    """The shared thread mapping: chunk ``j`` = tid % 8 of rows ``rb`` + 16 i, per atom a."""

    name: str  # prefix of this operand's variables ("a", "b")
    tile: Tile
    math: Math
    buf: str  # global buffer (parts: ``{buf}`` for hi, ``{buf}_lo`` for lo)

    @property
    def per_thread(self) -> int:
        """Rows a producer thread copies (each of ``tile.atoms`` chunks)."""
        return self.tile.rows // (THREADS // 8)

    def buffer(self, part: str) -> str:
        return self.buf if part == "hi" else f"{self.buf}_{part}"

    def args(self) -> tuple[Buf, ...]:
        """The parts' buffers, then (a scaled math mode) the inverse scale the prep step wrote."""
        return tuple(Buf(self.buffer(p), self.math.ctype) for p in self.math.parts) + self.scale_args()

    def scale_args(self) -> tuple[Buf, ...]:
        return (Buf(f"{self.buf}_s", "float"),) if self.math.scaled else ()

    def thread_lets(self) -> list[Let]:
        if self.tile.width != 128:
            raise ValueError(f"operand {self.name}: a {self.tile.width}-byte-swizzled tile is brought by TMA only "
                             "(the cp.async mapping fills 128-byte rows)")
        n = self.name
        return [Let(f"{n}_j", "(tid & 7)"), Let(f"{n}_rb", "(tid >> 3)"),
                Let(f"{n}_so", self.tile.chunk_offset(f"{n}_rb", f"{n}_j"))]

    def row(self, i: int) -> str:
        """Row of copy ``i`` in the operand (``r{name}0``: the tile's first row, from the schedule)."""
        return f"(r{self.name}0 + {self.name}_rb + {16 * i})"

    def kpos(self, a: int) -> str:
        """First K element of this thread's chunk in atom ``a`` of stage ``kt``."""
        return f"(kt * {self.math.elems(self.tile.atoms)} + ({8 * a} + {self.name}_j) * {self.math.chunk_elems})"

    def row_lets(self, i: int) -> list[Let]:
        """The per-tile bindings of the thread's row ``i``."""
        raise NotImplementedError

    def row_copies(self, i: int) -> list[Copy]:
        """The copies of the thread's row ``i`` (every atom), given the stage bindings."""
        raise NotImplementedError

    def tile_lets(self) -> list[Let]:
        return [let for i in range(self.per_thread) for let in self.row_lets(i)]

    def copies(self) -> list[Copy]:
        return [cp for i in range(self.per_thread) for cp in self.row_copies(i)]

    def smem(self, i: int, a: int) -> str:
        """The copy's shared offset: the thread's chunk of row rb, 16 i rows and a atoms on (the
        swizzle depends on the row modulo 8 only, so these are constant steps)."""
        step = a * self.tile.rows * 128 + 16 * i * 128
        return f"({self.name}_so + {step})"


@dataclass(frozen=True)
class DenseRows(_Rows):
    """Rows of a K-major matrix: element (row, k) of batch bz at bz * batch_stride + row * ld + k;
    ``rows`` rows, K elements valid below ``kred`` (copies past it zero-fill unless the rows are
    padded with zeros up to a whole stage: ``padded``)."""

    rows: int = 0
    ld: int = 0
    kred: int = 0
    batch_stride: int = 0
    padded: bool = False

    def row_lets(self, i: int) -> list[Let]:
        base = f"bz * {self.batch_stride} + " if self.batch_stride else ""
        return [Let(f"{self.name}_r{i}", f"({base}min({self.row(i)}, {self.rows - 1}) * {self.ld})")]

    def stage_lets(self) -> list[Let]:
        return [Let(f"{self.name}_k{a}", self.kpos(a)) for a in range(self.tile.atoms)]

    def row_copies(self, i: int) -> list[Copy]:
        n, tail = self.name, self.kred % self.math.elems(self.tile.atoms) and not self.padded
        return [Copy(self.smem(i, a), f"({n}_r{i} + {n}_k{a})", f"{n}_k{a} < {self.kred}" if tail else "")
                for a in range(self.tile.atoms)]


@dataclass(frozen=True)
class PlanarRows(_Rows):
    """Rows of a planar tensor read along its planes, the reduction running over (image, position in
    the plane): element (row, t), t = n ``plane`` + j, of batch bz at bz * batch_stride + n * ``image`` +
    row * ``plane`` + j. NCHW activations as they lie are this with rows = channels (wgrad of a
    stride-1 unpadded 1x1 layer: x and dy both, no transposing step). ``plane`` is a whole number of
    chunks, so no chunk straddles two images; copies past ``kred`` (N plane) zero-fill."""

    rows: int = 0
    plane: int = 0
    image: int = 0
    kred: int = 0
    batch_stride: int = 0

    def row_lets(self, i: int) -> list[Let]:
        base = f"bz * {self.batch_stride} + " if self.batch_stride else ""
        return [Let(f"{self.name}_r{i}", f"({base}min({self.row(i)}, {self.rows - 1}) * {self.plane})")]

    def stage_lets(self) -> list[Let]:
        n, out = self.name, []
        for a in range(self.tile.atoms):
            out += [Let(f"{n}_k{a}", self.kpos(a)),
                    Let(f"{n}_o{a}", f"({n}_k{a} / {self.plane} * {self.image} + {n}_k{a} % {self.plane})")]
        return out

    def row_copies(self, i: int) -> list[Copy]:
        n, tail = self.name, self.kred % self.math.elems(self.tile.atoms)
        return [Copy(self.smem(i, a), f"({n}_r{i} + {n}_o{a})", f"{n}_k{a} < {self.kred}" if tail else "")
                for a in range(self.tile.atoms)]


@dataclass(frozen=True)
class Geometry:
    """The convolution an :class:`Im2colNhwc` gathers for: NHWC activations of ``cp`` channels (a
    multiple of the chunk), output pixels P x Q per image, N images. A grouped convolution reads
    ``cp`` channels of pixels ``pitch`` channels apart, those of batch (group) bz from channel
    bz ``group_stride`` on (``pitch`` 0: the pixels are ``cp`` channels, ungrouped)."""

    n: int
    h: int
    w: int
    cp: int
    p: int
    q: int
    r: int
    s: int
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pad_top: int
    pad_left: int
    padded: bool  # some tap of some output pixel falls outside the image
    pitch: int = 0
    group_stride: int = 0

    @property
    def px(self) -> int:
        """Elements from one pixel to the next."""
        return self.pitch or self.cp

    @property
    def m(self) -> int:
        return self.n * self.p * self.q

    @property
    def kred(self) -> int:
        return self.r * self.s * self.cp


@dataclass(frozen=True)
class Im2colNhwc(_Rows):
    """A of fprop: row m = output pixel (n, oh, ow), column k = (r, s, c) with c fastest; the chunk at
    k reads channels c .. c + chunk of input pixel (oh sh - pt + r dh, ow sw - pl + s dw), zero outside
    the image (padding) and past R S C (the last stage's tail). Without padding every tap of a valid
    pixel is inside the image and the copies carry no predicate but the tail's."""

    geo: Geometry | None = None

    def row_lets(self, i: int) -> list[Let]:
        g, n = self.geo, self.name
        assert g is not None
        group = f"bz * {g.group_stride} + " if g.group_stride else ""
        return [Let(f"{n}_m{i}", f"min({self.row(i)}, {g.m - 1})"),
                Let(f"{n}_x{i}", f"({n}_m{i} % {g.p * g.q})"),
                Let(f"{n}_h{i}", f"({n}_x{i} / {g.q} * {g.stride[0]} - {g.pad_top})"),
                Let(f"{n}_w{i}", f"({n}_x{i} % {g.q} * {g.stride[1]} - {g.pad_left})"),
                Let(f"{n}_b{i}", f"{group}(({n}_m{i} / {g.p * g.q} * {g.h} + {n}_h{i}) * {g.w} + {n}_w{i}) * {g.px}")]

    def stage_lets(self) -> list[Let]:
        g, n = self.geo, self.name
        assert g is not None
        out: list[Let] = []
        for a in range(self.tile.atoms):
            out += [Let(f"{n}_k{a}", self.kpos(a)),
                    Let(f"{n}_rs{a}", f"({n}_k{a} / {g.cp})"),
                    Let(f"{n}_dy{a}", f"({n}_rs{a} / {g.s} * {g.dilation[0]})"),
                    Let(f"{n}_dx{a}", f"({n}_rs{a} % {g.s} * {g.dilation[1]})"),
                    Let(f"{n}_o{a}", f"(({n}_dy{a} * {g.w} + {n}_dx{a}) * {g.px} + {n}_k{a} % {g.cp})")]
        return out

    def row_copies(self, i: int) -> list[Copy]:
        g, n = self.geo, self.name
        assert g is not None
        tail = g.kred % self.math.elems(self.tile.atoms) != 0
        out = []
        for a in range(self.tile.atoms):
            conds = []
            if g.padded:  # one unsigned compare per axis: negative coordinates wrap past the bound
                conds += [f"(unsigned)({n}_h{i} + {n}_dy{a}) < {g.h}u", f"(unsigned)({n}_w{i} + {n}_dx{a}) < {g.w}u"]
            if tail:
                conds.append(f"{n}_rs{a} < {g.r * g.s}")
            out.append(Copy(self.smem(i, a), f"({n}_b{i} + {n}_o{a})", " && ".join(conds)))
        return out


@dataclass(frozen=True)
class _MnMajor(_Rows):
    """An MN-major operand: brought by TMA only (tensorcore/sm90/tma.py), a stage of ``tile.rows``
    reduction rows by ``tile.atoms`` blocks of 64 elements."""

    def thread_lets(self) -> list[Let]:
        raise ValueError(f"operand {self.name}: MN-major operands are brought by TMA only (tm=1)")

    def row_lets(self, i: int) -> list[Let]:
        raise ValueError(f"operand {self.name}: MN-major operands are brought by TMA only (tm=1)")

    def stage_lets(self) -> list[Let]:
        raise ValueError(f"operand {self.name}: MN-major operands are brought by TMA only (tm=1)")

    def row_copies(self, i: int) -> list[Copy]:
        raise ValueError(f"operand {self.name}: MN-major operands are brought by TMA only (tm=1)")


@dataclass(frozen=True)
class MnRows(_MnMajor):
    """A row-major matrix [``kred`` rows][``ld``] whose columns are this operand's M or N index (the
    first ``cols`` of each row) and whose rows are the reduction: dy = [N P Q][K] of a channels-last
    layer. Rows past ``kred`` and columns past ``cols`` read zeros (the copy engine's bounds).
    ``images`` > 1: that many such matrices one after another, the M or N index running over each
    one's ``cols`` columns in turn (an NCHW tensor [N][K][P Q]: index n P Q + pq, reduction over K;
    ``cols`` a multiple of 64, so no block of 64 straddles two images)."""

    cols: int = 0
    ld: int = 0
    kred: int = 0
    images: int = 1


@dataclass(frozen=True)
class MnPlanes(_MnMajor):
    """An NCHW tensor [``images``][``chans``][``p``][``q``] read as one strided dgrad phase's A, MN-major:
    M index n ps qs + i qs + j (pixel (i, j) of the phase's ps x qs sub-grid of image n), reduction index
    t chans + k (tap t = th taps_w + tw outer), element [n][k][i + oh][j + ow] with oh = first_h + th
    delta_h, ow = first_w + tw delta_w, zeros outside the plane (the copy engine's bounds). ``qs`` a
    multiple of 64 (a block of 64 M indices in one sub-grid row), ``chans`` of the stage's rows (a stage
    in one tap)."""

    images: int = 1
    chans: int = 0
    p: int = 0
    q: int = 0
    ps: int = 0
    qs: int = 0
    first_h: int = 0
    first_w: int = 0
    delta_h: int = 1
    delta_w: int = 1
    taps_w: int = 1


@dataclass(frozen=True)
class MnIm2col(_MnMajor):
    """The pixels of NHWC activations ``geo`` under its filter taps: row m = (tap, c) of D with c fastest
    (each block of 64 rows lies in one tap: ``geo.cp`` a multiple of 64), reduction index = output pixel
    (n, oh, ow) reading input pixel (oh sh - pt + r dh, ow sw - pl + s dw), zeros outside the image and
    past the last image."""

    geo: Geometry | None = None
