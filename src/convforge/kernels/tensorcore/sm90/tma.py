"""The TMA producer: one thread per block brings each stage in with the tensor memory accelerator.

Instead of 128 producer threads issuing 16-byte ``cp.async`` copies (each with its own gather
address and zero-fill predicate), one elected thread issues, per stage and per 128-byte atom of K,
one bulk tensor copy per operand part, and arms the stage's full barrier with the bytes they bring
(``mbarrier.arrive.expect_tx``). The copy engine writes the tile in the 128-byte swizzle the wgmma
descriptors read (``smem.Tile``: rows of 128 bytes, chunk ``c`` of row ``r`` at ``c ^ (r % 8)``, each
atom of K a block of its own), reads zeros outside the tensor, and writes through the async proxy,
so the consumers need no proxy fence.

* :class:`~convforge.kernels.tensorcore.sm90.operands.Im2colNhwc` (A of fprop): an **im2col** tensor map
  over the NHWC activations ``[N][H][W][Cp]``. A copy brings ``bm`` pixels ("pixels per column") of
  one atom of channels: from the tile's first output pixel, whose receptive field's corner is
  (n, p sh - pt, q sw - pl), on through the pixel bounding box (W first, then H, then the next
  image) in steps of the stride, each pixel read at the filter tap's offset (s dw, r dh). The box is
  the set of receptive-field corners: lower corner (-pl, -pt), upper corner (Q - 1) sw - pl - (W - 1)
  and (P - 1) sh - pt - (H - 1) (corners relative to the tensor's far edge), so exactly P x Q pixels
  per image are walked, in the GEMM's row order. Rows past M fall in image N and read zeros; so does
  a K tail past R S Cp (its channel coordinate Cp is out of bounds).
* :class:`~convforge.kernels.tensorcore.sm90.operands.DenseRows` (B): a **tiled** map, box (one atom of K,
  ``bn`` rows); rows past the matrix read zeros, and so do columns past its row length (a 1x1 layer's
  filters read in place, C not a whole stage).
* MN-major operands (``TileConfig.mn``): the same two maps with the roles of rows and K exchanged. A
  stage of :class:`~convforge.kernels.tensorcore.sm90.operands.MnIm2col` is, per block of 64 channels, one
  im2col copy of the stage's ``kb`` x 64 output pixels from pixel ``kt kb 64`` on at the tile's filter
  tap; a stage of :class:`~convforge.kernels.tensorcore.sm90.operands.MnRows` one tiled box of 64 columns
  by the stage's rows. The copies write the 128-byte swizzle with the reduction along the rows, which
  is the MN-major layout wgmma reads (smem.py).

With clusters of two blocks (``cl`` = 2, tiles.py) that share the A tile, each block copies half of
A's rows (a box of ``bm / 2`` rows from row ``crank bm / 2``) **multicast** to both blocks, at the
same shared offset in each, completing the full barrier at the same offset in each; B stays each
block's own. Every block's full barrier still expects the whole stage's bytes.

It applies where a box never straddles two filter taps (Cp a multiple of the tile's swizzle row: 32
TF32 or 64 half channels with the 128-byte swizzle, 16 / 32 with the 64-byte one, 8 / 16 with the
32-byte one, ``TileConfig.sa``; the map carries the swizzle), the corners fit the hardware's range
for 4-D maps ([-128, 127]), the strides are at most 8 and the tap offsets at most 255 (:func:`reason`).
:func:`model_column` is the traversal as the PTX ISA describes it, written independently of the
generator: tests/test_tensorcore_gen.py checks it against the gather the cp.async producer does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from convforge.codegen.dialect import TensorMap
from convforge.codegen.meta import Code
from convforge.kernels.tensorcore.sm90.cexpr import Let, emit_all
from convforge.kernels.tensorcore.sm90.isa import Math
from convforge.kernels.tensorcore.sm90.operands import (
    DenseRows,
    Geometry,
    Im2colNhwc,
    MnIm2col,
    MnPlanes,
    MnRows,
    Operand,
)
from convforge.kernels.tensorcore.sm90.smem import StageLayout
from convforge.kernels.tensorcore.sm90.tiles import TileConfig

CORNER = (-128, 127)  # pixel bounding-box corners of a 4-D im2col map (16 bits over 2 spatial dims)
MAX_STRIDE = 8  # traversal (element) strides
MAX_OFFSET = 255  # im2col offsets (the filter tap), unsigned
MAX_BOX = 256  # box extent per dimension


def storage(math: Math) -> str:
    """The storage dtype of an operand in ``math`` (TF32 operands are float32 bits)."""
    return {"tf32": "float32", "f16": "float16", "bf16": "bfloat16"}[math.ptx]


def corners(g: Geometry) -> tuple[tuple[int, int], tuple[int, int]]:
    """(lower, upper) corners of the pixel bounding box, W first (see the module docstring)."""
    lower = (-g.pad_left, -g.pad_top)
    upper = ((g.q - 1) * g.stride[1] - g.pad_left - (g.w - 1), (g.p - 1) * g.stride[0] - g.pad_top - (g.h - 1))
    return lower, upper


def reason(op: Operand, rows: int) -> str | None:
    """Why ``op`` (a tile of ``rows`` rows) cannot be brought by TMA, or None."""
    if rows > MAX_BOX:
        return f"a tile of {rows} rows exceeds the TMA box ({MAX_BOX})"
    if isinstance(op, MnRows):
        if op.ld * op.math.esize % 16:
            return f"rows of {op.ld} elements are not 16-byte multiples"
        return f"{op.cols} columns an image are not whole 64-element blocks" if op.images > 1 and op.cols % 64 else None
    if isinstance(op, MnPlanes):
        if op.qs % 64 or op.chans % op.tile.rows or op.q * op.math.esize % 16:
            return (f"sub-grid rows of {op.qs} pixels, {op.chans} channels and planes {op.q} wide: not whole 64-pixel "
                    f"blocks, {op.tile.rows}-row stages and 16-byte rows")
        return None
    if isinstance(op, MnIm2col):
        return _geometry_reason(op.geo, 64)
    if isinstance(op, DenseRows):
        if op.ld * op.math.esize % 16:
            return f"rows of {op.ld} elements are not 16-byte multiples"
        return None if op.batch_stride == 0 else "batched rows are copied by cp.async"
    if not isinstance(op, Im2colNhwc) or op.geo is None:
        return f"{type(op).__name__} operands are copied by cp.async"
    g, atom = op.geo, op.tile.width // op.math.esize
    if g.pitch or g.group_stride:
        return "a grouped gather (channels of a group within wider pixels) is brought by cp.async"
    if g.cp % atom:
        return (f"{g.cp} channels are not whole {atom}-element rows of a {op.tile.width}-byte swizzle (a box "
                "would straddle two taps)")
    return _geometry_reason(g, atom)


def _geometry_reason(g: Geometry | None, atom: int) -> str | None:
    """Why an im2col map cannot walk ``g``'s pixels in boxes of ``atom`` channels, or None."""
    if g is None:
        return "an im2col operand without its geometry"
    if g.cp % atom:
        return f"{g.cp} channels are not whole {atom}-element boxes"
    lower, upper = corners(g)
    if not all(CORNER[0] <= v <= CORNER[1] for v in lower + upper):
        return f"pixel box corners {lower}, {upper} outside {CORNER}"
    if max(g.stride) > MAX_STRIDE:
        return f"stride {g.stride} above {MAX_STRIDE}"
    if max((g.r - 1) * g.dilation[0], (g.s - 1) * g.dilation[1]) > MAX_OFFSET:
        return f"filter taps reach past an im2col offset of {MAX_OFFSET}"
    return None


def with_tma(cfg: TileConfig, why: Callable[[TileConfig], str | None]) -> TileConfig:
    """``cfg`` with its operands by TMA (``tm`` = 1) in the widest swizzle of A that ``why`` (a
    variant's reason function) admits: 128 bytes, else 64 or 32 for channels that are not whole
    128-byte rows; ``cfg`` as it is where none can be addressed."""
    for sa in (128, 64, 32):
        c = dataclasses.replace(cfg, tm=1, sa=sa)
        if why(c) is None:
            return c
    return cfg


def pair_reason(a: Operand, b: Operand, bm: int, bn: int) -> str | None:
    """Why the GEMM operands A (tiles of ``bm`` rows) and B (``bn`` rows) cannot both come by TMA."""
    return reason(a, bm) or reason(b, bn)


def map_name(op: Operand, part: str, tag: str = "") -> str:
    """The kernel parameter of one part's map (``tag``: the job, in a kernel running several)."""
    return f"{op.name}{tag}_map" if part == "hi" else f"{op.name}{tag}_map_{part}"


def tensor_map(op: Operand, part: str, rows: int, tag: str = "") -> TensorMap:
    """The tensor map of one part of ``op`` for a tile of ``rows`` rows (see :func:`reason`), over the
    buffer ``op.buffer(part)``."""
    why = reason(op, rows)
    if why:
        raise ValueError(f"operand {op.name}: {why}")
    es, dtype, name = op.math.esize, storage(op.math), map_name(op, part, tag)
    atom, sw = op.tile.width // es, op.tile.width
    if isinstance(op, MnPlanes):  # [images][chans][p][q]: 64 pixels of one row by the stage's channels
        return TensorMap(name, "tiled", dtype, (op.q, op.p, op.chans, op.images),
                         (op.q * es, op.p * op.q * es, op.chans * op.p * op.q * es), (atom, 1, rows, 1),
                         source=op.buffer(part), swizzle=sw)
    if isinstance(op, MnRows) and op.images > 1:  # [images][kred][ld]: one image's rows a box
        return TensorMap(name, "tiled", dtype, (op.ld, op.kred, op.images), (op.ld * es, op.ld * op.kred * es),
                         (atom, rows, 1), source=op.buffer(part), swizzle=sw)
    if isinstance(op, MnRows):
        return TensorMap(name, "tiled", dtype, (op.ld, op.kred), (op.ld * es,), (atom, rows),
                         source=op.buffer(part), swizzle=sw)
    if isinstance(op, DenseRows):
        return TensorMap(name, "tiled", dtype, (op.ld, op.rows), (op.ld * es,), (atom, rows),
                         source=op.buffer(part), swizzle=sw)
    assert isinstance(op, (Im2colNhwc, MnIm2col)) and op.geo is not None
    g = op.geo
    lower, upper = corners(g)
    return TensorMap(name, "im2col", dtype, (g.cp, g.w, g.h, g.n), (g.cp * es, g.w * g.cp * es, g.h * g.w * g.cp * es),
                     (atom, rows), lower, upper, (g.stride[1], g.stride[0]), op.buffer(part), sw)


def box_rows(op: Operand, ops: list[Operand], cfg: TileConfig) -> int:
    """Rows one copy of ``op`` brings: its tile's, or with clusters A's share (A, ``ops[0]``, is the
    operand the blocks of a cluster share and multicast)."""
    return op.tile.rows // cfg.cl if cfg.cl > 1 and op is ops[0] else op.tile.rows


def first_row(op: Operand, rows: int) -> str:
    """The first row of the tile ``op``'s copies start from: the tile's (``r{name}0``), or, for a
    shared operand brought in shares of ``rows`` < its tile's, this block's share's."""
    return f"r{op.name}0" if rows == op.tile.rows else f"(r{op.name}0 + crank * {rows})"


def tile_lets(op: Operand, rows: int | None = None) -> list[Let]:
    """Per tile: where the im2col column starts (the corner of the first output pixel of the rows
    this block copies: the tile's, or its share's, ``rows`` each); MN-major im2col: per block a of 64
    rows its filter tap (offsets os, or; rows past R S Cp keep the last tap: never stored) and channel."""
    if isinstance(op, MnIm2col):
        g, n, out = op.geo, op.name, []
        assert g is not None
        for a in range(op.tile.atoms):
            out += [Let(f"{n}_rs{a}", f"min((r{n}0 + {64 * a}) / {g.cp}, {g.r * g.s - 1})"),
                    Let(f"{n}_c{a}", f"((r{n}0 + {64 * a}) % {g.cp})"),
                    Let(f"{n}_os{a}", f"({n}_rs{a} % {g.s} * {g.dilation[1]})"),
                    Let(f"{n}_or{a}", f"({n}_rs{a} / {g.s} * {g.dilation[0]})")]
        return out
    if not isinstance(op, Im2colNhwc):
        return []
    g, n = op.geo, op.name
    assert g is not None
    r0 = first_row(op, op.tile.rows if rows is None else rows)
    return [Let(f"{n}_t", f"({r0} % {g.p * g.q})"), Let(f"{n}_n0", f"({r0} / {g.p * g.q})"),
            Let(f"{n}_h0", f"({n}_t / {g.q} * {g.stride[0]} - {g.pad_top})"),
            Let(f"{n}_w0", f"({n}_t % {g.q} * {g.stride[1]} - {g.pad_left})")]


def stage_lets(op: Operand) -> list[Let]:
    """Per stage and atom a: the K position; for im2col its tap (r s: offsets or, os) and channel (a K
    tail past R S Cp reads channel Cp or beyond: out of bounds, zeros). MN-major: the stage's first
    reduction row (MnRows) or output pixel (MnIm2col: its image and receptive-field corner)."""
    if isinstance(op, MnRows):
        return [Let(f"{op.name}_p", f"(kt * {op.tile.rows})")]
    if isinstance(op, MnPlanes):  # the stage's tap and first channel, the tap's offsets
        n = op.name
        return [Let(f"{n}_p", f"(kt * {op.tile.rows})"), Let(f"{n}_t", f"({n}_p / {op.chans})"),
                Let(f"{n}_k", f"({n}_p % {op.chans})"),
                Let(f"{n}_oh", f"({op.first_h} + {n}_t / {op.taps_w} * {op.delta_h})"),
                Let(f"{n}_ow", f"({op.first_w} + {n}_t % {op.taps_w} * {op.delta_w})")]
    if isinstance(op, MnIm2col):
        g, n = op.geo, op.name
        assert g is not None
        return [Let(f"{n}_p", f"(kt * {op.tile.rows})"), Let(f"{n}_t", f"({n}_p % {g.p * g.q})"),
                Let(f"{n}_n0", f"({n}_p / {g.p * g.q})"),
                Let(f"{n}_h0", f"({n}_t / {g.q} * {g.stride[0]} - {g.pad_top})"),
                Let(f"{n}_w0", f"({n}_t % {g.q} * {g.stride[1]} - {g.pad_left})")]
    n, e, per = op.name, op.tile.kbytes // op.math.esize, op.tile.width // op.math.esize
    out = []
    for a in range(op.tile.atoms):
        out.append(Let(f"{n}_k{a}", f"(kt * {e} + {a * per})"))
        if isinstance(op, Im2colNhwc):
            g = op.geo
            assert g is not None
            rs = g.r * g.s
            out += [Let(f"{n}_rs{a}", f"min({n}_k{a} / {g.cp}, {rs})"),
                    Let(f"{n}_c{a}", f"({n}_k{a} - {n}_rs{a} * {g.cp} + ({n}_rs{a} >= {rs}) * {g.cp})"),
                    Let(f"{n}_or{a}", f"({n}_rs{a} % {rs} / {g.s} * {g.dilation[0]})"),
                    Let(f"{n}_os{a}", f"({n}_rs{a} % {rs} % {g.s} * {g.dilation[1]})")]
    return out


@dataclass(frozen=True)
class TmaCopy:
    """One bulk tensor copy: shared byte offset from the stage base (``shift``: a C expression added,
    a cluster block's share), its map, the coordinates (innermost first) and, for im2col, the tap
    offsets (W, H): C expressions of the stage bindings; ``mask``: the blocks of the cluster it is
    multicast to (0: this block only)."""

    dst: int
    map: TensorMap
    part: str
    coords: tuple[str, ...]
    offsets: tuple[str, ...] = ()
    shift: str = ""
    mask: int = 0

    def statement(self) -> str:
        dst = f"sst + {self.dst}u" + (f" + {self.shift}" if self.shift else "")
        mc, tail = ("_MC", f", {self.mask}") if self.mask else ("", "")
        if self.offsets:
            return f"TMA_IM2COL_4D{mc}({dst}, {self.map.name}, {', '.join(self.coords + self.offsets)}, fb{tail});"
        if len(self.coords) in (3, 4):
            assert not self.mask, "a 3-D or 4-D tiled copy is not multicast"
            return f"TMA_TILE_{len(self.coords)}D({dst}, {self.map.name}, {', '.join(self.coords)}, fb);"
        return f"TMA_TILE_2D{mc}({dst}, {self.map.name}, {', '.join(self.coords)}, fb{tail});"


def copies(op: Operand, stage: StageLayout, parts: tuple[str, ...], tag: str = "", rows: int | None = None,
           cl: int = 1) -> list[TmaCopy]:
    """The bulk tensor copies of ``op`` in one stage, every part and atom: the whole tile, or (``rows``
    below the tile's, clusters of ``cl`` blocks) this block's share, multicast to every block."""
    n, out = op.name, []
    tile = stage.tile(n)
    rows = tile.rows if rows is None else rows
    share = rows < tile.rows
    shift, mask = (f"crank * {rows * tile.width}u", (1 << cl) - 1) if share else ("", 0)
    for part in parts:
        m = tensor_map(op, part, rows, tag)
        for a in range(op.tile.atoms):
            dst = stage.offset(n, part) + a * tile.rows * tile.width
            if isinstance(op, MnIm2col):  # block a: its 64 channels of the stage's pixels at its tap
                coords = (f"{n}_c{a}", f"{n}_w0", f"{n}_h0", f"{n}_n0")
                out.append(TmaCopy(dst, m, part, coords, (f"{n}_os{a}", f"{n}_or{a}")))
            elif isinstance(op, MnPlanes):  # block a: 64 pixels of one sub-grid row at the stage's tap
                col, plane = f"(r{n}0 + {64 * a})", op.ps * op.qs
                coords = (f"({col} % {op.qs} + {n}_ow)", f"({col} % {plane} / {op.qs} + {n}_oh)", f"{n}_k",
                          f"({col} / {plane})")
                out.append(TmaCopy(dst, m, part, coords))
            elif isinstance(op, MnRows) and op.images > 1:  # block a: its image's columns of the stage's rows
                col = f"(r{n}0 + {64 * a})"
                out.append(TmaCopy(dst, m, part, (f"({col} % {op.cols})", f"{n}_p", f"({col} / {op.cols})")))
            elif isinstance(op, MnRows):  # block a: columns r0 + 64 a of the stage's rows
                out.append(TmaCopy(dst, m, part, (f"(r{n}0 + {64 * a})", f"{n}_p")))
            elif isinstance(op, Im2colNhwc):
                coords = (f"{n}_c{a}", f"{n}_w0", f"{n}_h0", f"{n}_n0")
                out.append(TmaCopy(dst, m, part, coords, (f"{n}_os{a}", f"{n}_or{a}"), shift, mask))
            else:
                out.append(TmaCopy(dst, m, part, (f"{n}_k{a}", first_row(op, rows)), (), shift, mask))
    return out


def emit_stage(code: Code, ops: list[Operand], stage: StageLayout, parts: tuple[str, ...], tag: str = "",
               cfg: TileConfig | None = None) -> None:
    """One stage's copies (at shared address ``sst``, full barrier ``fb``), the barrier armed with
    the whole stage's bytes first (with clusters: this block's copies and its peers' share of A)."""
    code(f"MBAR_EXPECT_TX(fb, {stage.nbytes}u);")
    for op in ops:
        emit_all(code, stage_lets(op))
    cl = cfg.cl if cfg is not None else 1
    for op in ops:
        rows = box_rows(op, ops, cfg) if cfg is not None else None
        code(*(c.statement() for c in copies(op, stage, parts, tag, rows, cl)))


def model_tiled(x: np.ndarray, tmap: TensorMap, *coords: int) -> np.ndarray:
    """What a tiled copy brings: the box at ``coords`` (innermost first) of ``x`` (its dimensions
    outermost first), zeros outside, as rows of ``box[0]`` elements (a 3-D box of one image: its
    ``box[1]`` rows)."""
    out = np.zeros(tuple(tmap.box[::-1]), x.dtype)
    for idx in np.ndindex(*out.shape):
        at = tuple(c + i for c, i in zip(coords[::-1], idx, strict=True))
        if all(0 <= v < d for v, d in zip(at, x.shape, strict=True)):
            out[idx] = x[at]
    return out.reshape(-1, tmap.box[0])


def model_column(x: np.ndarray, tmap: TensorMap, c: int, w: int, h: int, n: int, ow: int, oh: int) -> np.ndarray:
    """What an im2col copy brings, as the PTX ISA describes the traversal: ``box[1]`` pixels from
    (n, h, w) on, W fastest in steps of the traversal stride while inside the bounding box
    [lower, extent - 1 + upper], then the next row from the lower corner, then the next image; each
    pixel's channels c .. c + box[0] read at (h + oh, w + ow), zeros outside ``x`` ([N][H][W][C])."""
    nn, hh, ww, cc = x.shape
    (lw, lh), (uw, uh), (sw, sh) = tmap.lower, tmap.upper, tmap.traversal
    out = np.zeros((tmap.box[1], tmap.box[0]), x.dtype)
    for i in range(tmap.box[1]):
        yy, xx = h + oh, w + ow
        if 0 <= n < nn and 0 <= yy < hh and 0 <= xx < ww:
            for j in range(tmap.box[0]):
                if 0 <= c + j < cc:
                    out[i, j] = x[n, yy, xx, c + j]
        w += sw
        if w > ww - 1 + uw:
            w, h = lw, h + sh
            if h > hh - 1 + uh:
                h, n = lh, n + 1
    return out
