"""The wgmma generator (kernels/tensorcore/sm90/) without a GPU.

* The ISA tables against the PTX ISA's (math modes, accumulator fragment), descriptor fields, the
  swizzle the copies write against the hardware's documented read (smem.model_address).
* The operand iterators: every (row, chunk) of a tile written once per stage, quarter-warps
  conflict-free.
* A NumPy emulation of whole tiles: the producer's copies (the iterators' own C expressions,
  evaluated), the swizzled shared stage, the descriptors each wgmma of each consumer reads, the
  accumulator fragment, the epilogue's staging and its stores (the same expressions) -- equal to the
  GEMM of the same operands on odd shapes, for every math mode, split-K, both stage widths.
* The stage ring's barrier protocol under random interleavings of producer and consumers.
* The epilogue staging: conflict-free, every accumulator once; half rounding emulated (the stated
  errors of the half variant).
* nvcc sm_90a: every variant compiles without spills, HGMMA in SASS, setmaxnreg where asked.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import re

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.nvcc import ptxas_report
from convforge.codegen.render import ARCH_SPECIFIC_MARK, render
from convforge.dtypes import rounded
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm90 import epilogue, schedule, tiles, tma
from convforge.kernels.tensorcore.sm90.cexpr import bind, evaluate
from convforge.kernels.tensorcore.sm90.epilogue import (
    H8,
    Output,
    chunks,
    es_reason,
    h8_items,
    h8_lets,
    h8_reason,
    h8_slot,
    readout_lets,
    rowmajor_chunks,
    rowmajor_lets,
    stage_write,
    staging_ld,
    swizzled,
)
from convforge.kernels.tensorcore.sm90.isa import ACC, BF16, F16, MATHS, SF16, TF32, X3F16, X3TF32, math_for
from convforge.kernels.tensorcore.sm90.mainloop import consumer_rows, wgmma_issue
from convforge.kernels.tensorcore.sm90.operands import DenseRows, Geometry, Im2colNhwc
from convforge.kernels.tensorcore.sm90.prep import padded_channels
from convforge.kernels.tensorcore.sm90.smem import SBO, Tile, desc_high, model_address, model_address_mn
from convforge.kernels.tensorcore.sm90.smem import swizzled as swizzled_chunk
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue
from convforge.reference import conv2d_ref, dgrad_ref, rel_l2, wgrad_ref
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean, ptxas_reports, sass_reports

VARIANTS = ("tc_implicit_gemm_tf32", "tc_implicit_gemm_3xtf32", "tc_implicit_gemm_half")
ODD = [ConvSpec.make(1, 3, 13, 11, 5, 3, 3, 1, (0, 1, 1, 0)),
       ConvSpec.make(2, 7, 9, 9, 67, 1, 1),
       ConvSpec.make(1, 5, 17, 19, 7, 5, 5, 2, 2, 2),
       ConvSpec.make(1, 3, 27, 29, 4, 11, 11, 4, (2, 1, 0, 3)),
       ConvSpec.make(2, 70, 9, 9, 36, 3, 3, 1, 1),
       ConvSpec.make(1, 4, 15, 15, 130, 3, 1, (1, 2), (1, 1, 0, 0))]


# -- ISA tables ----------------------------------------------------------------------------------
def doc_acc(w: int, lane: int, i: int) -> tuple[int, int]:
    """PTX ISA, wgmma .m64nNk* .f32 D fragment: warp w owns rows 16w..16w+15; register i: row
    groupID (+8 when i % 4 >= 2), column 8 (i // 4) + 2 threadID_in_group + (i % 2)."""
    return 16 * w + (lane >> 2) + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2


@pytest.mark.parametrize("n", [8, 64, 136, 256])
def test_accumulator_layout(n):
    seen = np.zeros((64, n), int)
    for w, lane, i in itertools.product(range(4), range(32), range(n // 2)):
        got = ACC.coords(w, lane, i)
        assert got == doc_acc(w, lane, i)
        assert (evaluate(ACC.row_expr(i), {"wq": w, "g": lane >> 2}),
                evaluate(ACC.col_expr(i), {"t": lane & 3})) == got
        seen[got] += 1
    assert (seen == 1).all()


def test_math_modes():
    """k x element size = 32 bytes (a quarter of a swizzle row) in every mode; TF32 k8 on 4-byte floats,
    FP16/BF16 k16 on 2-byte halves; 3xTF32 stores hi and lo and multiplies lo.hi, hi.lo, hi.hi."""
    assert (TF32.k, TF32.esize, F16.k, F16.esize, BF16.k, BF16.esize) == (8, 4, 16, 2, 16, 2)
    assert X3TF32.parts == ("hi", "lo") and set(X3TF32.products) == {("lo", "hi"), ("hi", "lo"), ("hi", "hi")}
    assert all(m.k * m.esize == 32 for m in MATHS.values())
    assert math_for("float32") is TF32 and math_for("float32", True) is X3TF32
    assert math_for("float16") is F16 and math_for("bfloat16") is BF16
    with pytest.raises(ValueError, match="3xTF32 is a float32"):
        math_for("float16", True)


def test_descriptor_fields():
    d = desc_high() | (0x2400 >> 4)
    assert d & 0x3FFF == 0x240 and ((d >> 16) & 0x3FFF) == 1
    assert ((d >> 32) & 0x3FFF) << 4 == SBO == 1024 and (d >> 49) & 7 == 0 and d >> 62 == 1


def test_narrow_swizzle_descriptors():
    """64- and 32-byte swizzles: layout type 2 / 3, 8 rows of 64 / 32 bytes between row groups; the
    pattern (smem.swizzled) is the address XOR the copy engine applies (bits [4:4+b) ^= [7:7+b))."""
    for width, mode in ((64, 2), (32, 3)):
        d = desc_high(width)
        assert d >> 62 == mode and ((d >> 32) & 0x3FFF) << 4 == 8 * width and ((d >> 16) & 0x3FFF) == 1
        for r, c in itertools.product(range(16), range(width // 16)):
            lin = r * width + 16 * c
            assert 16 * swizzled_chunk(r, c, width) + r * width == lin ^ (((lin >> 7) & (width // 16 - 1)) << 4)


@pytest.mark.parametrize("rows, atoms, width", [(r, a, 128) for r, a in itertools.product([64, 128, 256], [1, 2])]
                         + [(64, 2, 64), (128, 4, 64), (64, 4, 32), (128, 8, 32)])
def test_hardware_reads_what_the_copies_wrote(rows, atoms, width):
    """Every k step of a tile: byte b (< 32) of row r as wgmma reads it through the descriptor
    (start advanced by Tile.step_offset) is where a copy put K byte 32 kk + b of that row."""
    tile = Tile(rows, atoms, width)
    for base, kk in itertools.product((0, 1024 * 37), range(tile.steps)):
        d = (desc_high(width) | (base >> 4)) + (tile.step_offset(kk) >> 4)
        for r, b in itertools.product(range(rows), range(0, 32, 4)):
            kbyte = 32 * kk + b
            wrote = base + evaluate(tile.chunk_offset("r", "c"), {"r": r, "c": kbyte // 16}) + kbyte % 16
            assert model_address(d, r, b) == wrote, (r, kk, b)


def _iterators(math, rows, atoms):
    geo = Geometry(2, 9, 9, 8, 9, 9, 3, 3, (1, 1), (1, 1), 1, 1, True)
    return [Im2colNhwc("a", Tile(rows, atoms), math, "xh", geo=geo),
            DenseRows("b", Tile(rows, atoms), math, "wt", rows=rows, ld=64 * atoms, kred=64 * atoms)]


@pytest.mark.parametrize("rows, atoms, math", list(itertools.product([64, 128, 256], [1, 2], [TF32, F16])))
def test_copies_cover_the_tile_once_conflict_free(rows, atoms, math):
    """Per stage: every (row, chunk) of the tile written exactly once by the 128 producer threads;
    each copy instruction's 8 consecutive threads write 8 different 16-byte bank groups."""
    for op in _iterators(math, rows, atoms):
        seen = {}
        for tid in range(128):
            env = bind(op.thread_lets(), {"tid": tid})
            for cp in op.copies():
                off = evaluate(cp.smem, env)
                assert off % 16 == 0 and off not in seen
                seen[off] = tid
        expect = {evaluate(Tile(rows, atoms).chunk_offset("r", "c"), {"r": r, "c": c})
                  for r in range(rows) for c in range(8 * atoms)}
        assert set(seen) == expect
        for i, cp in enumerate(op.copies()):
            for q0 in range(0, 128, 8):
                offs = [evaluate(cp.smem, bind(op.thread_lets(), {"tid": q})) for q in range(q0, q0 + 8)]
                assert len({o % 128 // 16 for o in offs}) == 8, f"bank conflict in copy {i}, threads {q0}.."


# -- the whole-tile emulation ---------------------------------------------------------------------
def _operands(spec: ConvSpec, math, rng):
    """x (NHWC, padded channels) and w (K x ld) as the prep steps make them, per part, as float64; and
    the reference: the sum over the math's products of conv(x part, w part)."""
    cp = padded_channels(spec.c, math)
    dt = DTYPE_OF[math.name]
    x = rounded(rng.uniform(-1, 1, spec.x_shape).astype(np.float32), dt).astype(np.float64)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), dt).astype(np.float64)
    xs, ws = _parts(x, math), _parts(w, math)
    ref = sum(conv2d_ref(xs[pa], ws[pb], spec) for pa, pb in math.products)
    return xs, ws, ref, cp


def _tf32(a):
    m, e = np.frexp(a)
    return np.ldexp(np.round(m * 2**11) / 2**11, e)


def _nhwc(x, cp):
    n, c, h, w = x.shape
    out = np.zeros((n, h, w, cp))
    out[..., :c] = x.transpose(0, 2, 3, 1)
    return out.ravel()


def _krsc(w, cp, ld):
    k, c, r, s = w.shape
    out = np.zeros((k, r, s, cp))
    out[..., :c] = w.transpose(0, 2, 3, 1)
    flat = np.zeros((k, ld))
    flat[:, :r * s * cp] = out.reshape(k, -1)
    return flat.ravel()


def emulate(spec: ConvSpec, math, cfg: TileConfig, seed: int = 0, tile_ids=None):
    """Run tiles of a conv plan's GEMM through the generator's expressions; returns (got, ref, written):
    the planar output (NCHW, raw sums; split-K slabs summed), the float64 reference and how often
    each output was written. An unsplit 16-bit NHWC layer stores into one slab of its own dtype (the
    half-staged epilogue where ``cfg.eh`` and the output allow it; the values stay unrounded here)."""
    rng = np.random.default_rng(seed)
    xs, ws, ref, cp = _operands(spec, math, rng)
    prob = Problem(spec.n * spec.p * spec.q, spec.k, spec.r * spec.s * cp)
    ld = -(-prob.kred // math.elems(cfg.kb)) * math.elems(cfg.kb)
    geo = Geometry(spec.n, spec.h, spec.w, cp, spec.p, spec.q, spec.r, spec.s, spec.stride, spec.dilation,
                   spec.pad[0], spec.pad[2], any(spec.pad))
    a = Im2colNhwc("a", cfg.a_tile(), math, "xh", geo=geo)
    b = DenseRows("b", cfg.b_tile(), math, "wt", rows=spec.k, ld=ld, kred=prob.kred, padded=True)
    data = {"a": {p: _nhwc(xs[p], cp) for p in math.parts}, "b": {p: _krsc(ws[p], cp, ld) for p in math.parts}}
    nhwc = spec.layout == "nhwc"  # y row-major: (N P Q) x K
    out = Output("y", prob.m, prob.n, 1 if nhwc else spec.p * spec.q, slab=prob.m * prob.n, epi=None)
    if nhwc and cfg.ks == 1 and spec.dtype != "float32":
        out = Output("y", prob.m, prob.n, 1, dtype=spec.dtype)
    y, written = emulate_gemm(cfg, math, prob, a, b, data, out, tile_ids)
    shape = (spec.n, spec.p, spec.q, spec.k) if nhwc else spec.y_shape
    got = y.reshape(cfg.ks, -1).sum(0).reshape(shape)
    written = written.reshape(cfg.ks, -1).sum(0).reshape(shape)
    if nhwc:
        got, written = got.transpose(0, 3, 1, 2), written.transpose(0, 3, 1, 2)
    return got, ref, written


def emulate_gemm(cfg, math, prob, a, b, data, out, tile_ids=None, size=None):
    """The tiles of one GEMM launch: producer copies into a byte-addressed stage, every consumer's
    wgmma through its descriptors, the epilogue into ``out``'s planar offsets. Returns (y, written)
    over ks * batch slabs (or ``size`` elements: slabs that interleave, a grouped conv's)."""
    y = np.zeros(size or (cfg.ks * prob.batch * out.slab if out.slab else prob.m * out.kt))
    written = np.zeros(y.size, int)
    stage = cfg.stage(math)
    sbase = 1024 * 3
    total = cfg.work(prob)
    units = range(total) if tile_ids is None else [t % total for t in tile_ids]
    # a unit of work per cluster; each block of the cluster (rank r) takes its tile of it
    for tile, rank in itertools.product(units, range(cfg.cl)):
        peers = [bind(schedule.tile_lets(cfg, math, prob), {"tile": tile, "crank": r}) for r in range(cfg.cl)]
        tl = peers[rank]
        acc = np.zeros((cfg.bm, cfg.bn))
        for kt in range(tl["kbeg"], tl["kend"]):
            smem = np.full((sbase + stage.nbytes) // math.esize, np.nan)
            if cfg.tm:
                _tma_fill(smem, sbase, stage, math, (a, b), data, tl, kt, cfg, peers)
            for op in (a, b) if not cfg.tm else ():
                for tid in range(128):
                    env = bind(op.stage_lets(), {**bind(op.tile_lets(), {**bind(op.thread_lets(), {"tid": tid}),
                                                                          **tl}), "kt": kt})
                    for part, cp_ in itertools.product(math.parts, op.copies()):
                        at = (sbase + stage.offset(op.name, part) + evaluate(cp_.smem, env)) // math.esize
                        n = math.chunk_elems
                        if not cp_.pred or evaluate(cp_.pred, env):
                            src = evaluate(cp_.src, env)
                            smem[at:at + n] = data[op.name][part][src:src + n]
                        else:
                            smem[at:at + n] = 0.0
            for c, (mi, a_off, b_off) in itertools.product(range(cfg.groups), wgmma_issue(cfg, math)):
                da = stage.a.desc_high | ((sbase + c * consumer_rows(cfg) + a_off) >> 4)
                db = stage.b.desc_high | ((sbase + b_off) >> 4)
                ta = _read(smem, da, 64, math.esize, stage.a.mn)
                tb = _read(smem, db, cfg.bn, math.esize, stage.b.mn)
                r0 = c * 64 * cfg.wm + 64 * mi
                acc[r0:r0 + 64] += ta @ tb.T
        _epilogue(acc, cfg, out, tl, y, written)
    return y, written


def _tma_fill(smem, sbase, stage, math, ops, data, tl, kt, cfg=None, peers=()):
    """One stage as the TMA producer fills it: each copy's coordinates evaluated from the generator's
    expressions, its box from the PTX ISA's traversal (tma.model_column / model_tiled), written in the
    128-byte swizzle the copy engine applies (chunk j of shared row i at j ^ (i % 8), rows counted
    from the 1024-byte-aligned atom). With clusters: this block's B, and the shares of A that every
    block of the cluster (tile bindings ``peers``, by rank) multicasts to it."""
    ops = list(ops)
    clustered = cfg is not None and cfg.cl > 1
    sources = [(ops[0], p) for p in peers] + [(ops[1], tl)] if clustered else [(op, tl) for op in ops]
    for op, env_tl in sources:
        rows = tma.box_rows(op, ops, cfg) if cfg is not None else None
        env = bind(tma.stage_lets(op), {**bind(tma.tile_lets(op, rows), dict(env_tl)), "kt": kt})
        for cp_ in tma.copies(op, stage, math.parts, "", rows, cfg.cl if cfg is not None else 1):
            if clustered and op is ops[0]:
                assert cp_.mask == (1 << cfg.cl) - 1, "A's shares go to every block of the cluster"
            shift = evaluate(cp_.shift, env) if cp_.shift else 0
            src = data[op.name][cp_.part]
            coords = [evaluate(e, env) for e in cp_.coords]
            if cp_.offsets:
                box = tma.model_column(src.reshape(cp_.map.dims[::-1]), cp_.map, *coords,
                                       *[evaluate(e, env) for e in cp_.offsets])
            else:
                box = tma.model_tiled(src.reshape(cp_.map.dims[::-1]), cp_.map, *coords)
            per, width = 16 // math.esize, cp_.map.swizzle
            assert box.shape[1] * math.esize == width, "a box row is one swizzled row"
            for i, j in itertools.product(range(box.shape[0]), range(box.shape[1] // per)):
                row = i + shift // width
                at = (sbase + cp_.dst + width * row + 16 * swizzled_chunk(row, j, width)) // math.esize
                assert np.isnan(smem[at:at + per]).all(), "two copies write one place of a stage"
                smem[at:at + per] = box[i, per * j:per * (j + 1)]


def _read(smem, desc, rows, esize, mn=False):
    """The rows x k operand one wgmma reads through ``desc`` (k = 32 bytes / esize; ``mn``: an
    MN-major operand, rows = its M or N index)."""
    return smem[_read_index(desc, rows, esize, mn)]


@functools.cache
def _read_index(desc, rows, esize, mn=False):
    """The smem element each (row, element) of that operand comes from: a function of the descriptor
    alone, so worked out once per descriptor rather than once per k-step of every tile."""
    k = 32 // esize
    if mn:
        return np.array([[model_address_mn(desc, r, e) // esize for e in range(k)] for r in range(rows)])
    return np.array([[model_address(desc, r, e * esize) // esize for e in range(k)] for r in range(rows)])


def _epilogue(acc, cfg, out, tl, y, written):
    """Accumulators by the fragment layout -> staging (stage_write) -> read-out (readout_lets) -> the
    planar offsets of ``out`` (raw values): what emit_consumer_epilogue does, per warpgroup."""
    if cfg.es:
        assert es_reason(out, cfg.bn, cfg.wm) is None, es_reason(out, cfg.bn, cfg.wm)
        _es_epilogue(acc, cfg, out, tl, y, written)
        return
    if cfg.eh and h8_reason(out, cfg.bn, cfg.wm) is None:
        _h8_epilogue(acc, cfg, out, tl, y, written)
        return
    if out.rowmajor:
        _rowmajor_epilogue(acc, cfg, out, tl, y, written)
        return
    ld = staging_ld(cfg.wm)
    for c in range(cfg.groups):
        for ch, items in chunks(cfg.wm, cfg.bn):
            st = _staged(acc, cfg, c, epilogue.COLS * ld, (ld, ch, False))
            for ct, item in itertools.product(range(128), items):
                ec, er = _readout(cfg.wm, item, ct)
                k = tl["rb0"] + epilogue.COLS * ch + ec
                m = tl["ra0"] + c * 64 * cfg.wm + er
                if k >= out.n:
                    continue
                for q in range(4):
                    if m + q < out.m:
                        v = st[ec * ld + er + q]
                        assert not np.isnan(v), "read-out of an unstaged value"
                        o = evaluate(out.offset("m", "k", "z"), {"m": m + q, "k": k, "z": tl["zs"]})
                        y[o] += v
                        written[o] += 1


def _staged(acc, cfg, c, size, write):
    """Column group c's accumulators placed where ``stage_write(*write)`` stages them (``write``: ld,
    column chunk, rowmajor; NaN elsewhere)."""
    at, rows, cols = _stage_map(cfg.wm, cfg.bn, size, *write)
    st = np.full(size, np.nan)
    st[at] = acc[c * 64 * cfg.wm + rows, cols]
    return st


@functools.cache
def _stage_map(wm, bn, size, ld, ch, rowmajor):
    """(staging slot, accumulator row in the column group, column) of every accumulator that
    stage_write places in chunk ``ch``, by evaluating its expressions per (warp, lane, register); no
    two land on one slot. The same for every tile of a config: worked out once."""
    seen = np.zeros(size, bool)
    at, rows, cols = [], [], []
    for wq, lane, mi, i in itertools.product(range(4), range(32), range(wm), range(bn // 2)):
        w = stage_write(ld, mi, i, ch, rowmajor=rowmajor)
        if w is None:
            continue
        row, col = ACC.coords(wq, lane, i)
        slot = evaluate(w[0], {"wq": wq, "g": lane >> 2, "t": lane & 3})
        assert not seen[slot], "two accumulators staged at one place"
        seen[slot] = True
        at.append(slot)
        rows.append(64 * mi + row)
        cols.append(col)
    return np.array(at, int), np.array(rows, int), np.array(cols, int)


@functools.cache
def _readout(wm, item, ct):
    """(column, row) in the staging of read-out item ``item`` of consumer thread ``ct``."""
    env = bind(readout_lets(wm, item), {"ct": ct})
    return env[f"ec{item}"], env[f"er{item}"]


def _rowmajor_epilogue(acc, cfg, out, tl, y, written):
    """The row-major (NHWC) epilogue: rows staged through ``swizzled`` slots, float4 runs of 4 columns
    read out by rowmajor_lets and stored at ``out``'s offsets."""
    for c in range(cfg.groups):
        for ch, items, quads in rowmajor_chunks(cfg.wm, cfg.bn):
            st = _staged(acc, cfg, c, 64 * cfg.wm * epilogue.COLS, (0, ch, True))
            for ct, item in itertools.product(range(128), items):
                if ct + 128 * item >= 64 * cfg.wm * quads:
                    continue
                env = bind(rowmajor_lets(cfg.wm, item, quads), {"ct": ct})
                eq, er = env[f"eq{item}"], env[f"er{item}"]
                at = evaluate(swizzled("r", "4 * q"), {"r": er, "q": eq})
                k = tl["rb0"] + epilogue.COLS * ch + 4 * eq
                m = tl["ra0"] + c * 64 * cfg.wm + er
                for q in range(4):
                    if m < out.m and k + q < out.n:
                        v = st[at + q]
                        assert not np.isnan(v), "read-out of an unstaged value"
                        o = evaluate(out.offset("m", "k", "z"), {"m": m, "k": k + q, "z": tl["zs"]})
                        y[o] += v
                        written[o] += 1


@functools.cache
def _h8_map(wm, bn):
    """Per chunk: {staging word: (accumulator row in the warpgroup's tile, column)} of the pair's first
    column, by evaluating h8_slot per (warp, lane, register); no two pairs on one word."""
    maps = [{} for _ in range(bn // H8)]
    for wq, lane, mi, i in itertools.product(range(4), range(32), range(wm), range(bn // 2)):
        w = h8_slot(mi, i)
        if w is None:
            continue
        row, col = ACC.coords(wq, lane, i)
        assert ACC.coords(wq, lane, i + 1) == (row, col + 1), "a staged word is one row's two columns"
        slot = evaluate(w[0], {"wq": wq, "g": lane >> 2, "t": lane & 3})
        assert slot not in maps[w[1]], "two pairs staged at one word"
        maps[w[1]][slot] = (64 * mi + row, col)
    return maps


def _h8_epilogue(acc, cfg, out, tl, y, written):
    """The half-staged epilogue: accumulator pairs into words (h8_slot), each thread's item a row's 8
    columns read as 4 words (h8_lets) and stored as one run at ``out``'s offset."""
    for c in range(cfg.groups):
        for ch, words in enumerate(_h8_map(cfg.wm, cfg.bn)):
            assert len(words) == 64 * cfg.wm * H8 // 2, "every word of the chunk staged"
            for ct, item in itertools.product(range(128), range(h8_items(cfg.wm))):
                env = bind(h8_lets(item), {"ct": ct})
                er, eo = env[f"er{item}"], env[f"eo{item}"]
                k, m = tl["rb0"] + H8 * ch + 8 * eo, tl["ra0"] + c * 64 * cfg.wm + er
                if m >= out.m or k >= out.n:
                    continue
                o = evaluate(out.offset("m", "k", "z"), {"m": m, "k": k, "z": tl["zs"]})
                for w in range(4):
                    row, col = words[er * 32 + ((eo ^ (er & 7)) << 2) + w]
                    assert (row, col) == (er, H8 * ch + 8 * eo + 2 * w), "a word read as another's columns"
                    for h in (0, 1):
                        y[o + 2 * w + h] += acc[c * 64 * cfg.wm + row, col + h]
                        written[o + 2 * w + h] += 1


def _es_epilogue(acc, cfg, out, tl, y, written):
    """The half-staged chunks stored by TMA (es=1): the staged words (h8_slot) read back as the copy engine
    reads a 128-byte-swizzled box of 64 columns by the consumer's rows (smem.swizzled: chunk j of row r at
    j ^ r % 8), stored at the map's coordinates (column, row), nothing past M rows or n columns."""
    smap = epilogue.store_map(out, cfg.wm)
    assert smap.box == (H8, 64 * cfg.wm) and smap.dims == (out.n, out.m) and smap.swizzle == 128
    for c in range(cfg.groups):
        row0 = tl["ra0"] + c * 64 * cfg.wm
        for ch, words in enumerate(_h8_map(cfg.wm, cfg.bn)):
            col0 = tl["rb0"] + H8 * ch
            for r, col in itertools.product(range(64 * cfg.wm), range(H8)):
                at = r * 128 + 16 * swizzled_chunk(r, col // 8, 128) + 2 * (col % 8)  # the box element's byte
                row, first = words[at // 4]
                assert (row, first + (at % 4) // 2) == (r, H8 * ch + col), "the box reads another element than staged"
                m, k = row0 + r, col0 + col
                if m < out.m and k < out.n:
                    o = evaluate(out.offset("m", "k", "z"), {"m": m, "k": k, "z": tl["zs"]})
                    y[o] += acc[c * 64 * cfg.wm + row, first + (at % 4) // 2]
                    written[o] += 1


def _cl(spec):
    return ConvSpec.from_dict({**spec.to_dict(), "layout": "nhwc"})


CASES = [(ODD[0], TF32, TileConfig(128, 64, 1, 3, 2)),
         (ODD[1], F16, TileConfig(64, 96, 1, 2, 1)),
         (ODD[2], BF16, TileConfig(128, 32, 2, 2, 1, ks=2)),
         (ODD[3], TF32, TileConfig(256, 32, 1, 2, 2, ks=3)),
         (ODD[4], X3TF32, TileConfig(128, 64, 1, 2, 2, pi=2)),
         (ODD[5], F16, TileConfig(128, 160, 2, 2, 2)),
         (_cl(ODD[1]), X3TF32, TileConfig(128, 64, 1, 2, 2, pi=2)),  # channels-last: y row-major
         (_cl(ODD[4]), F16, TileConfig(64, 96, 1, 2, 1, ks=2)),
         (_cl(ConvSpec.make(3, 24, 5, 7, 40, 1, 1)), TF32, TileConfig(128, 64, 2, 2, 1)),  # a linear layer
         # ping-pong (pp=1): each consumer a whole tile, 64 or 128 rows, split-K, NCHW and row-major stores
         (ODD[0], TF32, TileConfig(128, 64, 1, 3, 2, pp=1)),
         (ODD[3], F16, TileConfig(64, 32, 1, 2, 2, ks=3, pp=1)),
         (_cl(ODD[1]), X3TF32, TileConfig(128, 64, 1, 2, 2, pi=2, pp=1)),
         # 3xFP16: two 2-byte parts a stage, split-K, promotion every stage, channels-last
         (ODD[4], X3F16, TileConfig(128, 64, 1, 2, 2, pi=2)),
         (ODD[3], X3F16, TileConfig(128, 32, 1, 2, 2, ks=3, pi=1)),
         (_cl(ODD[1]), X3F16, TileConfig(128, 96, 1, 2, 2, pi=2)),
         # scaled FP16 (the relaxed class): one 2-byte part, ping-pong, split-K, channels-last
         (ODD[4], SF16, TileConfig(128, 64, 1, 2, 2)),
         (ODD[3], SF16, TileConfig(64, 32, 1, 2, 2, ks=3, pp=1)),
         (_cl(ODD[1]), SF16, TileConfig(128, 96, 1, 2, 2)),
         # 16-bit NHWC output staged as halves (eh=1, the default): a partial last N tile of 8 columns,
         # a partial last M tile, ping-pong with 128 rows a consumer, 192 columns; eh=0 the float staging
         (ConvSpec.make(2, 24, 9, 11, 72, 3, 3, 1, 1, dtype="float16", layout="nhwc"), F16,
          TileConfig(128, 64, 1, 2, 2)),
         (ConvSpec.make(1, 16, 13, 7, 136, 1, 1, dtype="bfloat16", layout="nhwc"), BF16,
          TileConfig(128, 128, 1, 2, 2, pp=1)),
         (ConvSpec.make(3, 8, 5, 7, 200, 3, 3, 2, (0, 1, 1, 0), dtype="float16", layout="nhwc"), F16,
          TileConfig(128, 192, 1, 2, 2)),
         (ConvSpec.make(2, 24, 9, 11, 72, 3, 3, 1, 1, dtype="float16", layout="nhwc"), F16,
          TileConfig(128, 64, 1, 2, 2, eh=0)),
         # the same chunks stored by TMA (es=1): M and K tails, ping-pong, two chunks a tile
         (ConvSpec.make(2, 24, 9, 11, 72, 3, 3, 1, 1, dtype="float16", layout="nhwc"), F16,
          TileConfig(128, 64, 1, 2, 2, es=1)),
         (ConvSpec.make(1, 16, 13, 7, 136, 1, 1, dtype="bfloat16", layout="nhwc"), BF16,
          TileConfig(128, 128, 1, 2, 2, pp=1, es=1))]


@pytest.mark.parametrize("spec, math, cfg", CASES, ids=lambda v: getattr(v, "name", None) or str(v))
def test_emulated_tiles_equal_the_gemm(spec, math, cfg):
    """Every tile of the GEMM through the generator's expressions equals the convolution of the same
    operand parts (float64), every output written once per split slice."""
    assert not cfg.problems(math), cfg.problems(math)
    got, ref, written = emulate(spec, math, cfg)
    assert (written == cfg.ks).all(), f"outputs written {np.unique(written)} times, want {cfg.ks}"
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


# The TMA producer (tm=1): layers whose channels are whole atoms (32 TF32 / 64 half channels), odd
# geometry otherwise: stride 2 with a partial last tile of pixels, asymmetric padding, dilation, a K
# tail inside a stage (kb=2), stride 4 past the image edge, split-K, two parts (3xTF32).
TMA_CASES = [(ConvSpec.make(2, 64, 13, 11, 96, 3, 3, 2, 1), F16, TileConfig(128, 64, 1, 2, 2, tm=1)),
             (ConvSpec.make(1, 64, 9, 10, 40, 3, 3, 1, (0, 1, 2, 1)), BF16, TileConfig(64, 64, 2, 2, 1, tm=1)),
             (ConvSpec.make(3, 32, 11, 9, 24, 3, 3, 1, 2, 2), TF32, TileConfig(128, 32, 2, 2, 2, ks=2, tm=1)),
             (ConvSpec.make(1, 32, 23, 21, 36, 5, 5, 4, (2, 1, 0, 3)), X3TF32, TileConfig(128, 64, 1, 2, 2, pi=2,
                                                                                          tm=1)),
             (ConvSpec.make(2, 128, 7, 7, 72, 1, 1, 2), F16, TileConfig(256, 96, 2, 2, 2, tm=1)),
             (ConvSpec.make(1, 64, 23, 21, 36, 5, 5, 4, (2, 1, 0, 3)), X3F16, TileConfig(128, 64, 1, 2, 2, pi=2,
                                                                                         tm=1)),
             (ConvSpec.make(2, 64, 13, 11, 96, 3, 3, 2, 1), X3F16, TileConfig(128, 64, 1, 2, 2, pi=2, tm=1, cl=2))]


# Clusters of two blocks multicasting A (cl=2): a partial last N tile, split-K, stride 4 with a partial
# last M tile, two parts (3xTF32), a 1x1.
TMA_CASES += [(ConvSpec.make(2, 64, 13, 11, 96, 3, 3, 2, 1), F16, TileConfig(128, 64, 1, 2, 2, tm=1, cl=2)),
              (ConvSpec.make(3, 32, 11, 9, 100, 3, 3, 1, 2, 2), TF32, TileConfig(128, 32, 2, 2, 2, ks=2, tm=1, cl=2)),
              (ConvSpec.make(1, 32, 23, 21, 36, 5, 5, 4, (2, 1, 0, 3)), X3TF32,
               TileConfig(128, 64, 1, 2, 2, pi=2, tm=1, cl=2)),
              (ConvSpec.make(2, 128, 7, 7, 200, 1, 1), BF16, TileConfig(64, 64, 2, 2, 1, tm=1, cl=2)),
              # ping-pong by TMA, also with A in the 64-byte swizzle
              (ConvSpec.make(2, 64, 13, 11, 96, 3, 3, 2, 1), F16, TileConfig(128, 128, 1, 3, 2, tm=1, pp=1)),
              (ConvSpec.make(3, 48, 11, 9, 40, 3, 3, 1, 1), TF32, TileConfig(128, 64, 1, 3, 2, tm=1, sa=64, pp=1))]


def test_clusters_need_tma_and_whole_pairs_of_n_tiles():
    """cl=2 only with TMA, and only where the N tiles pair up (no block of a cluster wholly past the
    matrix); the variants offer it in their spaces, never as the default."""
    assert any("cl (2)" in w for w in TileConfig(128, 64, cl=2).problems(TF32))
    assert not TileConfig(128, 64, tm=1, cl=2).problems(TF32, Problem(1000, 128, 288))
    assert any("N-tile groups" in w for w in TileConfig(128, 64, tm=1, cl=2).problems(TF32, Problem(1000, 160, 288)))
    v = get_variant("tc_implicit_gemm_half")
    spec = ConvSpec.make(32, 64, 56, 56, 256, 3, 3, 1, 1, dtype="float16")
    space = v.space(spec, NOMINAL_CUDA)
    assert v.default(spec, NOMINAL_CUDA).get("cl", 1) == 1 and space[0].get("tm") == 1
    assert space[0].get("pp") == 1 and space[1] == dataclasses.replace(TileConfig.of(space[0]), pp=0).params()
    assert space[2] == dataclasses.replace(TileConfig.of(space[1]), cl=2).params()
    narrow = ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1, dtype="float16")  # one N tile: no pair
    assert not any(p.get("cl") == 2 for p in v.space(narrow, NOMINAL_CUDA))


def test_pingpong_is_the_default_where_the_tile_allows_it_and_the_tiles_cover_the_sms():
    """Half precision and TF32 take ping-pong consumers by default where bm is 64 or 128 (one
    consumer holds a whole tile) and there are at least as many tiles as SMs; 3xTF32 keeps shared
    tiles; a 256-row tile keeps them too, and so does a layer of fewer tiles than SMs; the space
    offers each early TMA point with and without."""
    half = get_variant("tc_implicit_gemm_half")
    spec = ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1, dtype="float16")
    d = TileConfig.of(half.default(spec, NOMINAL_CUDA))
    assert d.pp == 1 and d.bm in (64, 128) and not d.problems(F16)
    assert tiles.pingpong(TileConfig(256, 64, tm=1), F16) == TileConfig(256, 64, tm=1)
    assert tiles.pingpong(TileConfig(128, 64, tm=1), TF32).pp == 1
    assert tiles.pingpong(TileConfig(128, 64, tm=1), X3TF32).pp == 0
    assert tiles.pingpong(TileConfig(128, 64), F16).pp == 0  # cp.async: not timed with pp
    few, many = Problem(1568, 512, 4608), Problem(4704, 512, 4608)  # 512@7 N32 / N96: 104 / 296 tiles of 128 x 64
    assert tiles.pingpong(TileConfig(128, 64, tm=1), TF32, few, units=132).pp == 0
    assert tiles.pingpong(TileConfig(128, 64, tm=1), TF32, many, units=132).pp == 1
    f32 = ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1)
    assert get_variant("tc_implicit_gemm_tf32").default(f32, NOMINAL_CUDA).get("pp") == 1
    assert not get_variant("tc_implicit_gemm_3xtf32").default(f32, NOMINAL_CUDA).get("pp")
    small = ConvSpec.make(32, 512, 7, 7, 512, 3, 3, 1, 1, dtype="float16")  # 104 tiles on 132 SMs
    assert not half.default(small, NOMINAL_CUDA).get("pp")
    space = [TileConfig.of(p) for p in half.space(spec, NOMINAL_CUDA)]
    assert any(c.pp for c in space) and any(not c.pp and c.tm for c in space)
    assert all(not c.problems(F16) for c in space if c.pp)


def test_tf32_prefers_fewer_waves_of_wider_tiles():
    """TF32's wave model (tiles.TF32_EFFICIENCY, rounds 30-31): 512@7 N96 takes one wave of 128 x 192
    shared tiles of 4 stages (round 31), N128 two waves of 128 x 128 with ping-pong, not 3 of 128 x 64;
    N32 keeps 128 x 64 (one wave either way); 3xTF32 keeps its table."""
    tf32, x3 = get_variant("tc_implicit_gemm_tf32"), get_variant("tc_implicit_gemm_3xtf32")
    n96, n32 = ConvSpec.make(96, 512, 7, 7, 512, 3, 3, 1, 1), ConvSpec.make(32, 512, 7, 7, 512, 3, 3, 1, 1)
    d = TileConfig.of(tf32.default(n96, NOMINAL_CUDA))
    assert (d.bm, d.bn, d.pp, d.st) == (128, 192, 0, 4)
    d = TileConfig.of(tf32.default(ConvSpec.make(128, 512, 7, 7, 512, 3, 3, 1, 1), NOMINAL_CUDA))
    assert (d.bm, d.bn, d.pp) == (128, 128, 1)
    assert TileConfig.of(tf32.default(n32, NOMINAL_CUDA)).bn == 64
    assert TileConfig.of(x3.default(n96, NOMINAL_CUDA)).bn == 64


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_takes_one_wave_of_128x192_where_128x128_takes_two(dtype):
    """Half precision's wave model (round 34): 512@7 N96 runs 111 shared 128 x 192 tiles of 4 stages in one
    wave (FP16 0.054 -> 0.043 ms), N64 / N128 and 256@14 keep 128 x 128 (two waves of 192 lost 1.4-2.3x)."""
    half = get_variant("tc_implicit_gemm_half")

    def tile(n: int, c: int, hw: int) -> TileConfig:
        return TileConfig.of(half.default(ConvSpec.make(n, c, hw, hw, c, 3, 3, 1, 1, dtype=dtype, layout="nhwc"),
                                          NOMINAL_CUDA))

    d = tile(96, 512, 7)
    assert (d.bm, d.bn, d.pp, d.st) == (128, 192, 0, 4)
    assert not d.problems(F16)
    assert all(tile(n, c, hw).bn == 128 for n, c, hw in ((64, 512, 7), (128, 512, 7), (96, 256, 14), (128, 256, 14)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_runs_short_single_n_tile_layers_as_deep_pingpong(dtype):
    """Round 34 (tiles.deep_pingpong): where half precision's wave model picks 256 x 64, one tile spans every
    output channel and a tile takes at most 16 k steps, the default is 128 x 64 ping-pong tiles of 8 stages
    (ResNet 64@56² 2.5-6.6 % faster); 49 k steps (MEC cv4, 7x7) and several N tiles (192 channels) keep 256 x 64."""
    half = get_variant("tc_implicit_gemm_half")

    def cfg(n: int, c: int, hw: int, k: int, r: int) -> TileConfig:
        spec = ConvSpec.make(n, c, hw, hw, k, r, r, 1, r // 2, dtype=dtype, layout="nhwc")
        return TileConfig.of(half.default(spec, NOMINAL_CUDA))

    deep = cfg(128, 64, 56, 64, 3)
    assert (deep.bm, deep.bn, deep.pp, deep.st) == (128, 64, 1, tiles.PP_DEEP_STAGES) and deep.tm
    assert not deep.problems(F16 if dtype == "float16" else BF16)
    assert (cfg(32, 64, 56, 64, 1).bm, cfg(16, 64, 224, 64, 3).bm) == (128, 128)
    for kept in (cfg(128, 64, 224, 64, 7), cfg(32, 192, 17, 192, 3)):
        assert (kept.bm, kept.bn, kept.pp) == (256, 64, 0)


def test_deep_pingpong_compiles_without_spills(nvcc_ok):
    half = get_variant("tc_implicit_gemm_half")
    spec = ConvSpec.make(128, 64, 56, 56, 64, 3, 3, 1, 1, dtype="float16", layout="nhwc")
    plan = half.plan(spec, half.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    for info in ptxas_report(plan.source("cuda")):
        assert info.spill_stores == 0 and info.spill_loads == 0, info


@pytest.mark.parametrize("spec, math, cfg", TMA_CASES, ids=lambda v: getattr(v, "name", None) or str(v))
def test_emulated_tma_tiles_equal_the_gemm(spec, math, cfg):
    """The TMA producer's copies, evaluated from the generator's expressions and run through the
    PTX ISA's im2col traversal and tiled boxes, give every tile's GEMM exactly."""
    assert not cfg.problems(math), cfg.problems(math)
    got, ref, written = emulate(spec, math, cfg)
    assert (written == cfg.ks).all()
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_tma_refuses_what_it_cannot_address():
    """Channels that are not whole atoms (an atom would straddle two taps), corners past the 4-D
    range, strides past 8 and batched rows stay with cp.async; the variant names the reason."""
    v = get_variant("tc_implicit_gemm_half")
    half = lambda s: ConvSpec.from_dict({**s.to_dict(), "dtype": "float16"})  # noqa: E731
    cfg = TileConfig(128, 64, tm=1)
    assert v.tma_reason(half(ConvSpec.make(1, 64, 9, 9, 8, 3, 3, 1, 1)), cfg) is None
    assert "straddle" in v.tma_reason(half(ConvSpec.make(1, 40, 9, 9, 8, 3, 3, 1, 1)), cfg)
    assert "corners" in v.tma_reason(half(ConvSpec.make(1, 64, 300, 9, 8, 3, 3, 1, 140)), cfg)
    assert "stride" in v.tma_reason(half(ConvSpec.make(1, 64, 99, 99, 8, 3, 3, 9, 1)), cfg)
    with pytest.raises(ValueError, match="tm=1"):
        v.plan(half(ConvSpec.make(1, 40, 9, 9, 8, 3, 3, 1, 1)), cfg.params(), NOMINAL_CUDA)
    assert "batched" in tma.reason(DenseRows("b", Tile(64, 1), F16, "u", rows=8, ld=64, kred=64, batch_stride=512), 64)
    space = v.space(half(ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1)), NOMINAL_CUDA)
    assert space[0] == v.default(half(ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1)), NOMINAL_CUDA)  # deep ping-pong
    assert space[1].get("tm") == 1 and space[2] == dataclasses.replace(TileConfig.of(space[1]), tm=0).params()
    assert not any(p.get("tm") for p in v.space(half(ConvSpec.make(1, 40, 9, 9, 8, 3, 3, 1, 1)), NOMINAL_CUDA))


def test_tma_corners_walk_exactly_the_output_pixels():
    """The pixel bounding box holds P x Q receptive-field corners per image, in the GEMM's row order."""
    for spec in [s for s, _, _ in TMA_CASES]:
        math = math_for(spec.dtype)
        g = Geometry(spec.n, spec.h, spec.w, 64, spec.p, spec.q, spec.r, spec.s, spec.stride, spec.dilation,
                     spec.pad[0], spec.pad[2], True)
        tm = tma.tensor_map(Im2colNhwc("a", Tile(256, 1), math, "xh", geo=g), "hi", 256)
        x = np.arange(spec.n * spec.h * spec.w, dtype=np.float64).reshape(spec.n, spec.h, spec.w, 1) + 1
        col = tma.model_column(x, dataclasses.replace(tm, box=(1, spec.n * spec.p * spec.q + 3)), 0,
                               -spec.pad[2], -spec.pad[0], 0, spec.dilation[1], spec.dilation[0])
        n, p, q = np.unravel_index(np.arange(spec.n * spec.p * spec.q), (spec.n, spec.p, spec.q))
        hh = p * spec.stride[0] - spec.pad[0] + spec.dilation[0]
        ww = q * spec.stride[1] - spec.pad[2] + spec.dilation[1]
        inside = (hh >= 0) & (hh < spec.h) & (ww >= 0) & (ww < spec.w)
        want = np.where(inside, x[n, np.clip(hh, 0, spec.h - 1), np.clip(ww, 0, spec.w - 1), 0], 0)
        np.testing.assert_array_equal(col[:-3, 0], want)
        assert not col[-3:].any()  # past the last image: zeros


DTYPE_OF = {"tf32": "float32", "3xtf32": "float32", "3xf16": "float32", "sf16": "float32", "f16": "float16",
            "bf16": "bfloat16"}


def _parts(a, math):
    """``a`` as the math mode's operand parts (float64; TF32 rounded to nearest, 3xTF32 hi and lo;
    3xFP16 hi and lo in float16, scaled FP16 hi alone, unscaled: values in (-1, 1) need no scale to stay
    normal)."""
    if math.name == "sf16":
        return {"hi": a.astype(np.float16).astype(np.float64)}
    if math.name == "3xf16":
        hi = a.astype(np.float16).astype(np.float64)
        return {"hi": hi, "lo": (a - hi).astype(np.float16).astype(np.float64)}
    if math.name not in ("tf32", "3xtf32"):
        return {"hi": a}
    out = {"hi": _tf32(a)}
    if math.name == "3xtf32":
        out["lo"] = _tf32(a - out["hi"])
    return out


def _truncated(a):
    """What the tensor cores read of a float as TF32: its top 19 bits (10 mantissa bits, truncated)."""
    return (a.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def images_as_channels(t, cp):
    """[N][C][H][W] -> [C][H][W][cp] (wgrad's x' and dy': images as channels, padded to cp), flat."""
    out = np.zeros(t.shape[1:] + (cp,))
    out[..., :t.shape[0]] = t.transpose(1, 2, 3, 0)
    return out.ravel()


def emulate_wgrad(spec: ConvSpec, math, cfg: TileConfig, seed: int = 0, planar: bool = False):
    """The wgrad plan's GEMM (tensorcore/sm90/wgrad.py) through the generator's expressions, operands laid
    out as its transposing steps write them (x' = [C][H][W][Np], dy' = [K][P Q Np]), or, ``planar``
    (the 1x1 variants), x and dy as they lie (TF32: truncated by the tensor cores); every split
    slice stored through dW's strided K C R S offsets into a slab of its own. Returns (dW, reference,
    writes per element)."""
    family = "gemm1x1" if planar else "implicit_gemm"
    variant = get_variant({"tf32": f"wgrad_tc_{family}_tf32", "3xtf32": f"wgrad_tc_{family}_3xtf32",
                           "3xf16": f"wgrad_tc_{family}_3xf16"}.get(math.name, f"wgrad_tc_{family}_half"))
    dt = DTYPE_OF[math.name]
    spec = spec.with_pass("wgrad") if dt == "float32" else ConvSpec.from_dict({**spec.to_dict(), "dtype": dt,
                                                                               "pass": "wgrad"})
    assert variant.applies(spec, NOMINAL_CUDA) is None, variant.applies(spec, NOMINAL_CUDA)
    rng = np.random.default_rng(seed)
    x = rounded(rng.uniform(-1, 1, spec.x_shape).astype(np.float32), dt).astype(np.float64)
    dy = rounded(rng.uniform(-1, 1, spec.y_shape).astype(np.float32), dt).astype(np.float64)
    if planar:
        xs, ds = ({"hi": _truncated(x)}, {"hi": _truncated(dy)}) if dt == "float32" else ({"hi": x}, {"hi": dy})
    else:
        xs, ds = _parts(x, math), _parts(dy, math)
    ref = sum(wgrad_ref(xs[pa], ds[pb], spec) for pa, pb in math.products)
    prob = variant.problem(spec)
    cp = prob.kred // (spec.p * spec.q)
    a, b = variant.operands(spec, cfg)

    lay = np.ravel if planar else functools.partial(images_as_channels, cp=cp)
    source = {"x": xs, "xt": xs, "y": ds, "dyt": ds}  # the buffer each operand reads
    data = {op.name: {p: lay(source[op.buf][p]) for p in math.parts} for op in (a, b)}
    out = dataclasses.replace(variant.output(spec), slab=prob.m * prob.n, epi=None)
    y, written = emulate_gemm(cfg, math, prob, a, b, data, out)
    got = y.reshape(cfg.ks, -1).sum(0).reshape(spec.w_shape)
    return got, ref, written.reshape(cfg.ks, -1).sum(0).reshape(spec.w_shape)


WGRAD_CASES = [(ODD[0], TF32, TileConfig(128, 32, 1, 2, 2, ks=3)),      # asymmetric padding, N=1, K=5
               (ODD[1], X3TF32, TileConfig(128, 96, 1, 2, 2, pi=2)),     # 1x1, 67 filters
               (ODD[2], BF16, TileConfig(64, 32, 2, 2, 1, ks=2)),        # stride 2, dilation 2, 5x5
               (ODD[3], F16, TileConfig(128, 32, 1, 2, 1, ks=4)),        # 11x11 / 4, (2, 1, 0, 3) padding
               (ConvSpec.make(5, 3, 7, 9, 6, 3, 3, (2, 1), 1), TF32, TileConfig(64, 32, 2, 3, 1)),  # N=5
               # TMA (the batch whole atoms): padding, split; stride 2 as the transposed problem's dilation
               (ConvSpec.make(32, 5, 9, 7, 6, 3, 3, 1, (0, 1, 1, 0)), TF32, TileConfig(128, 32, 1, 2, 2, ks=3, tm=1)),
               (ConvSpec.make(64, 3, 8, 8, 5, 3, 3, 2, (1, 0, 1, 1)), F16, TileConfig(64, 32, 2, 2, 1, tm=1)),
               # clusters of two multicasting x' rows: 4 N tiles (the last partial), split
               (ConvSpec.make(32, 16, 9, 7, 100, 3, 3, 1, (0, 1, 1, 0)), TF32,
                TileConfig(128, 32, 1, 2, 2, ks=2, tm=1, cl=2)),
               (ConvSpec.make(64, 8, 8, 8, 64, 3, 3, 2, 1), F16, TileConfig(64, 32, 2, 2, 1, tm=1, cl=2)),
               # a batch of 16 mod 32 (TF32) / 32 mod 64 and 16 (half): x' by TMA in the 64- / 32-byte swizzle
               (ConvSpec.make(16, 5, 9, 7, 6, 3, 3, 1, (0, 1, 1, 0)), TF32,
                TileConfig(128, 32, 1, 2, 2, ks=3, tm=1, sa=64)),
               (ConvSpec.make(48, 3, 8, 8, 5, 3, 3, 2, (1, 0, 1, 1)), TF32, TileConfig(64, 32, 2, 3, 1, tm=1, sa=64)),
               (ConvSpec.make(16, 9, 7, 9, 40, 3, 3, 1, 1), X3TF32, TileConfig(128, 64, 1, 2, 2, pi=2, tm=1, sa=64)),
               (ConvSpec.make(32, 4, 8, 8, 5, 3, 3, 2, 1), F16, TileConfig(64, 32, 2, 2, 1, tm=1, sa=64)),
               (ConvSpec.make(16, 6, 9, 7, 33, 3, 3, 1, (1, 0, 0, 1)), BF16,
                TileConfig(128, 32, 1, 2, 2, ks=2, tm=1, sa=32)),
               (ConvSpec.make(16, 16, 9, 7, 100, 3, 3, 1, (0, 1, 1, 0)), TF32,
                TileConfig(128, 32, 1, 2, 2, ks=2, tm=1, cl=2, sa=64)),
               # 3xFP16: cp.async with N = 5 padded to 8; a batch of 32 by TMA in the 64-byte swizzle, split
               (ODD[0], X3F16, TileConfig(128, 32, 1, 2, 2, ks=3, pi=2)),
               (ConvSpec.make(32, 9, 7, 9, 40, 3, 3, 2, 1), X3F16, TileConfig(128, 64, 1, 2, 2, ks=2, pi=2, tm=1,
                                                                               sa=64))]


@pytest.mark.parametrize("spec, math, cfg", WGRAD_CASES, ids=lambda v: getattr(v, "name", None) or str(v))
def test_emulated_wgrad_equals_the_filter_gradient(spec, math, cfg):
    """wgrad as the transposed forward problem: every tile of its GEMM, through the generator's own
    expressions and the strided K C R S store, equals the float64 filter gradient of the same operand
    parts; every dW element written once per split slice."""
    assert not cfg.problems(math), cfg.problems(math)
    got, ref, written = emulate_wgrad(spec, math, cfg)
    assert (written == cfg.ks).all(), f"dW elements written {np.unique(written)} times, want {cfg.ks}"
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


WGRAD_1X1 = [(ConvSpec.make(3, 7, 4, 5, 67, 1, 1), TF32, TileConfig(128, 96, 1, 2, 2, ks=3)),   # 3 images of 20
             (ConvSpec.make(2, 130, 4, 2, 9, 1, 1), F16, TileConfig(64, 32, 2, 2, 1)),          # 8-pixel planes
             (ConvSpec.make(5, 33, 4, 6, 40, 1, 1), BF16, TileConfig(128, 64, 1, 3, 2, ks=2))]  # K > C: dY . X^T


@pytest.mark.parametrize("spec, math, cfg", WGRAD_1X1, ids=lambda v: getattr(v, "name", None) or str(v))
def test_emulated_planar_wgrad_of_1x1_layers(spec, math, cfg):
    """The 1x1 wgrad reading x and dy as they lie (PlanarRows: chunks along each image's plane, the
    reduction over images and pixels, its tail zero-filled): equal to the filter gradient of what
    the tensor cores read, every element written once per slice."""
    got, ref, written = emulate_wgrad(spec, math, cfg, planar=True)
    assert (written == cfg.ks).all()
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_truncated_tf32_wgrad_error_matches_the_stated_one():
    """TF32 read from float bits truncates both operands: the 1x1 wgrad's stated error is what that
    gives on a deep reduction (cuDNN's TF32 wgrad measures the same 6.9e-4)."""
    from convforge.kernels.tensorcore.sm90.wgrad import TRUNCATED_EXPECTED, TRUNCATED_TOLERANCE

    rng = np.random.default_rng(1)
    x, dy = rng.uniform(-1, 1, (96, 8192)), rng.uniform(-1, 1, (64, 8192))
    x, dy = x.astype(np.float32).astype(np.float64), dy.astype(np.float32).astype(np.float64)
    err = rel_l2(_truncated(dy) @ _truncated(x).T, dy @ x.T)
    assert 0.8 * TRUNCATED_EXPECTED < err < 1.2 * TRUNCATED_EXPECTED and err < TRUNCATED_TOLERANCE / 2, err


def emulate_strided_dgrad(spec: ConvSpec, math, cfg: TileConfig, seed: int = 0, il: bool = False):
    """Every phase GEMM of the strided dgrad plan (tensorcore/sm90/dgrad.py) through the generator's
    expressions: dy as its conversion step writes it (NHWC, Kp channels), each phase's filters as its
    packing step writes them, D stored through the phase's pixel map into dx (``il``: stored compact
    through the phase buffer's Output, then placed by its interleave Part: row a, column b of the
    buffer at dx pixel (ph + sh a, pw + sw b)). Returns (dx, reference, writes per element, mask of
    the phases no tap reaches). A channels-last ``spec`` stores into NHWC dx (and phase buffers); the
    result is returned as NCHW."""
    from convforge.kernels.tensorcore.sm90.dgrad import phases

    variant = get_variant({"tf32": "dgrad_tc_strided_tf32", "3xtf32": "dgrad_tc_strided_3xtf32",
                           "3xf16": "dgrad_tc_strided_3xf16"}.get(math.name, "dgrad_tc_strided_half"))
    dt = DTYPE_OF[math.name]
    spec = ConvSpec.from_dict({**spec.to_dict(), "dtype": dt, "pass": "dgrad"})
    nhwc = spec.layout == "nhwc"
    assert variant.applies(spec, NOMINAL_CUDA) is None, variant.applies(spec, NOMINAL_CUDA)
    rng = np.random.default_rng(seed)
    dy = rounded(rng.uniform(-1, 1, spec.y_shape).astype(np.float32), dt).astype(np.float64)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), dt).astype(np.float64)
    ds, ws = _parts(dy, math), _parts(w, math)
    ref = sum(dgrad_ref(ds[pa], ws[pb], spec) for pa, pb in math.products)
    kp = padded_channels(spec.k, math)
    dx, written = np.zeros(spec.x_shape).ravel(), np.zeros(int(np.prod(spec.x_shape)), int)
    empty = np.zeros(spec.x_shape, bool)
    for ph in phases(spec):
        if ph.empty:
            empty[:, :, ph.ah.ph::spec.stride[0], ph.aw.ph::spec.stride[1]] = True
            continue
        a, b = variant.operands(spec, ph, cfg)
        prob = ph.problem(spec, kp)
        taps = [(r, t) for r in ph.ah.taps for t in ph.aw.taps]
        packed = {}
        for p in math.parts:
            m = np.zeros((spec.c, b.ld))
            for i, (r, t) in enumerate(taps):
                m[:, i * kp:i * kp + spec.k] = ws[p][:, :, r, t].T
            packed[p] = m.ravel()
        data = {"a": {p: _nhwc(ds[p], kp) for p in math.parts}, "b": packed}
        if not il:
            out = dataclasses.replace(ph.output(spec), slab=dx.size, epi=None)
            y, wr = emulate_gemm(cfg, math, prob, a, b, data, out)
            dx += y
            written += wr
            continue
        part = ph.part()
        out = dataclasses.replace(ph.compact(spec), slab=part.elements(spec), epi=None)
        y, wr = emulate_gemm(cfg, math, prob, a, b, data, out)
        assert (wr == 1).all(), "every element of a phase buffer written once"
        y = y.reshape(spec.n, part.bh, part.bw, spec.c).transpose(0, 3, 1, 2) if nhwc else y
        sub = np.zeros(spec.x_shape)
        sub[:, :, part.ph::spec.stride[0], part.pw::spec.stride[1]] = y.reshape(spec.n, spec.c, part.bh, part.bw)
        mask = _phase_mask(spec, part)  # the interleave places each buffer element once
        dx += _as_layout(sub, nhwc).ravel()
        written += _as_layout(mask, nhwc).ravel()
    n, c, h, w = spec.x_shape
    back = (lambda a: a.reshape(n, h, w, c).transpose(0, 3, 1, 2)) if nhwc else (lambda a: a.reshape(n, c, h, w))
    return back(dx), ref, back(written), empty


def _as_layout(a: np.ndarray, nhwc: bool) -> np.ndarray:
    """An NCHW array in the layout dx lies in."""
    return a.transpose(0, 2, 3, 1) if nhwc else a


DGRAD_STRIDED = [(ODD[2], TF32, TileConfig(128, 32, 1, 2, 2)),                # 5x5 / 2, dilation 2
                 (ODD[3], X3TF32, TileConfig(128, 32, 1, 2, 2, pi=2)),         # 11x11 / 4, (2, 1, 0, 3)
                 (ConvSpec.make(2, 6, 9, 7, 10, 1, 1, 2), F16, TileConfig(64, 32, 2, 2, 1)),  # 1x1 / 2: 3 empty phases
                 (ConvSpec.make(1, 9, 13, 11, 5, 3, 3, (2, 3), (1, 0, 2, 1)), BF16, TileConfig(64, 32, 1, 3, 1)),
                 (ConvSpec.make(3, 5, 8, 8, 70, 3, 3, 2, 1), TF32, TileConfig(128, 64, 2, 2, 2)),  # K = 70: 2 atoms
                 # TMA (K whole atoms): every phase's maps, the phases in one kernel
                 (ConvSpec.make(2, 6, 9, 7, 64, 3, 3, 2, 1), F16, TileConfig(64, 32, 1, 2, 1, tm=1)),
                 (ConvSpec.make(1, 5, 11, 13, 32, 5, 5, (2, 3), (2, 1, 0, 2)), X3TF32,
                  TileConfig(128, 32, 2, 2, 2, pi=2, tm=1)),
                 # 3xFP16: six phases with K = 5 padded to 8; by TMA with K whole 64-element atoms
                 (ConvSpec.make(1, 9, 13, 11, 5, 3, 3, (2, 3), (1, 0, 2, 1)), X3F16,
                  TileConfig(128, 32, 1, 2, 2, pi=2)),
                 (ConvSpec.make(2, 6, 9, 7, 64, 3, 3, 2, 1), X3F16, TileConfig(128, 32, 1, 2, 2, pi=1, tm=1)),
                 # channels-last dx: the direct stores put whole pixel rows on dx's sub-grid
                 (ConvSpec.make(2, 16, 10, 9, 24, 4, 4, 2, 1, layout="nhwc"), F16, TileConfig(64, 32, 1, 2, 1)),
                 (ConvSpec.make(1, 7, 13, 11, 5, 3, 3, (2, 3), (1, 0, 2, 1), layout="nhwc"), BF16,
                  TileConfig(64, 32, 1, 3, 1)),
                 (ConvSpec.make(3, 12, 8, 8, 32, 2, 2, 2, 0, layout="nhwc"), TF32, TileConfig(128, 32, 1, 2, 2, tm=1))]


def _phase_mask(spec: ConvSpec, part) -> np.ndarray:
    m = np.zeros(spec.x_shape, bool)
    m[:, :, part.ph::spec.stride[0], part.pw::spec.stride[1]] = True
    return m


@pytest.mark.parametrize("spec, math, cfg, il", [(*case, i % 2 == 1) for i, case in enumerate(DGRAD_STRIDED)],
                         ids=lambda v: {False: "direct", True: "interleaved"}.get(v) if isinstance(v, bool)
                         else getattr(v, "name", None) or str(v))
def test_emulated_strided_dgrad_equals_the_input_gradient(spec, math, cfg, il):
    """Strided dgrad, one forward GEMM per stride phase on the generator: every phase's tiles through
    its own expressions, stored by the pixel map onto the phase's sub-grid, equal the float64 input
    gradient of the same operand parts; every dx element written once, but for the phases no tap
    reaches (the zero step's). The direct and interleaved (il) stores take the cases in turns (TMA,
    3xFP16 and channels-last dx cases are neighbours there): each store meets TF32, 3xTF32, FP16,
    BF16 and 3xFP16, TMA, channels-last dx, an empty phase or stride (2, 3) with asymmetric padding."""
    assert not cfg.problems(math), cfg.problems(math)
    got, ref, written, empty = emulate_strided_dgrad(spec, math, cfg, il=il)
    assert (written[~empty] == 1).all() and (written[empty] == 0).all(), np.unique(written)
    assert (ref[empty] == 0).all()
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_wgrad_reduce_writes_every_filter_element_once():
    """The split-K reduce of the wgrad plan: partial element e (planar, images C, columns K, planes
    R S) lands on dW's K C R S offset of the same (row, column), each element exactly once."""
    spec = ODD[2].with_pass("wgrad")
    out = get_variant("wgrad_tc_implicit_gemm_tf32").output(spec)
    part = Output("part", out.m, out.n, out.pq, slab=out.m * out.n, epi=None)
    seen = np.zeros(out.m * out.n, int)
    for e in range(out.m * out.n):
        m, k = e // (out.pq * out.n) * out.pq + e % out.pq, e // out.pq % out.n
        assert evaluate(part.offset("m", "k", "0"), {"m": m, "k": k}) == e
        o = evaluate(out.offset("m", "k", "0"), {"m": m, "k": k})
        c, rs = divmod(m, spec.r * spec.s)
        assert o == (k * spec.c + c) * spec.r * spec.s + rs
        seen[o] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize("math, cfg", [(TF32, TileConfig(128, 64, 1, 2, 2, ks=2)), (F16, TileConfig(64, 32, 2, 2, 1)),
                                       (X3TF32, TileConfig(128, 96, 1, 2, 2, pi=1))],
                         ids=lambda v: getattr(v, "name", v))
def test_emulated_batched_gemm_of_winograd(math, cfg):
    """The Winograd GEMM's operands (DenseRows over a batch: V[e] tiles x Cp, U[e] K x Cp, channel tail
    zero-filled) and its M output slabs [z][e][k][t]: equal to the batched products, each written once."""
    from convforge.kernels.tensorcore.sm90.winograd import TcWinograd

    rng = np.random.default_rng(3)
    spec = ConvSpec.make(2, 37, 11, 9, 67, 3, 3, 1, 1)
    v = TcWinograd(2, math.name == "3xtf32", frozenset({"float32"}), "relaxed", 0)
    prob = v.problem(spec)
    cp, t, e = prob.kred, prob.m, prob.batch
    parts = {p: rng.uniform(-1, 1, (2, e, t + spec.k, cp)) for p in math.parts}
    for arr in parts.values():
        arr[..., spec.c:] = 0.0  # padding channels, as the transforms write them
    a = DenseRows("a", Tile(cfg.bm, cfg.kb), math, "wv", rows=t, ld=cp, kred=cp, batch_stride=t * cp)
    b = DenseRows("b", Tile(cfg.bn, cfg.kb), math, "wu", rows=spec.k, ld=cp, kred=cp, batch_stride=spec.k * cp)
    data = {"a": {p: parts[p][0, :, :t].ravel() for p in math.parts},
            "b": {p: parts[p][1, :, :spec.k].ravel() for p in math.parts}}
    out = Output("wm", t, spec.k, t, slab=spec.k * t, epi=None)
    y, written = emulate_gemm(cfg, math, prob, a, b, data, out)
    got = y.reshape(cfg.ks, e, spec.k, t).sum(0)
    ref = sum(np.einsum("etc,ekc->ekt", parts[pa][0, :, :t], parts[pb][1, :, :spec.k]) for pa, pb in math.products)
    assert (written.reshape(cfg.ks, -1).sum(0) == cfg.ks).all()
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


# -- the barrier protocol ----------------------------------------------------------------------------
class _Mbarrier:
    """mbarrier: a phase completes when its expected arrivals have arrived; try_wait.parity(p) passes
    when the phase of parity p has completed (the current phase's parity differs from p)."""

    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def passes(self, parity):
        return (self.phase & 1) != parity


@pytest.mark.parametrize("st, cw, seed", [(2, 1, 0), (3, 2, 1), (4, 2, 2), (6, 1, 3)])
def test_stage_ring_protocol(st, cw, seed):
    """Producer and consumer threads stepping in random order through the emitted protocol (producer:
    wait empty[s] with parity ^ 1, fill, arrive full[s]; consumer: wait full[s] with the parity, read,
    release the previous stage after the next group, the last at the end of the tile): no stage is
    overwritten before every consumer read it, none read before it was filled, nobody deadlocks."""
    rng = random.Random(seed)
    iters = [5, 1, 7, 2]  # k blocks of 4 tiles
    total = sum(iters)
    full = [_Mbarrier(1) for _ in range(st)]  # one arrival stands for the producer warpgroup's 128
    empty = [_Mbarrier(cw) for _ in range(st)]
    filled = [None] * st  # which iteration a stage holds
    reads = [set() for _ in range(st)]

    def producer():
        stage, phase, i = 0, 0, 0
        while i < total:
            while not empty[stage].passes(phase ^ 1):
                yield
            assert filled[stage] is None or reads[stage] == set(range(cw)), "stage overwritten before it was read"
            filled[stage], reads[stage] = i, set()
            full[stage].arrive()
            i += 1
            stage, phase = (0, phase ^ 1) if stage + 1 == st else (stage + 1, phase)
            yield

    def consumer(c):
        stage, phase, pstage, i = 0, 0, 0, 0
        for n in iters:
            for kt in range(n):
                while not full[stage].passes(phase):
                    yield
                assert filled[stage] == i, "stage read before it was filled"
                reads[stage].add(c)
                if kt > 0:
                    empty[pstage].arrive()
                pstage, i = stage, i + 1
                stage, phase = (0, phase ^ 1) if stage + 1 == st else (stage + 1, phase)
                yield
            empty[pstage].arrive()
            yield

    _interleave(rng, [producer()] + [consumer(c) for c in range(cw)], 100000)


@pytest.mark.parametrize("st, seed", [(2, 0), (3, 1), (4, 2), (6, 3)])
def test_pingpong_stage_ring_protocol(st, seed):
    """pp=1: the producer fills the stages of a block's tiles in order; consumer c takes the tiles
    with lt % 2 == c and steps over the other's stages by the emitted arithmetic (stage + k blocks,
    phase flipped per wrap), releasing only its own (one warpgroup's arrivals free a stage), and
    waits on its tile's stages only once the other has waited on all of its previous tile's (the
    turn barriers): every stage is read by the consumer of its tile after it was filled and before
    it is refilled, no deadlock, tiles of uneven length (split-K slices) included. Without the turn
    barriers a consumer two ring rounds ahead passes a parity wait on a stale stage (this test
    failed so before they were added)."""
    rng = random.Random(seed)
    iters = [5, 1, 7, 2, 4, 4, 1]  # k blocks of 7 tiles
    total = sum(iters)
    owner = [j % 2 for j, n in enumerate(iters) for _ in range(n)]  # which consumer reads iteration i
    full = [_Mbarrier(1) for _ in range(st)]
    empty = [_Mbarrier(1) for _ in range(st)]  # one warpgroup's release frees a stage
    filled = [None] * st
    read = [True] * st
    turn = [_Mbarrier(1), _Mbarrier(1)]  # one arrival stands for a warpgroup's 128

    def producer():
        stage, phase, i = 0, 0, 0
        while i < total:
            while not empty[stage].passes(phase ^ 1):
                yield
            assert read[stage], "stage overwritten before its consumer read it"
            filled[stage], read[stage] = i, False
            full[stage].arrive()
            i += 1
            stage, phase = (0, phase ^ 1) if stage + 1 == st else (stage + 1, phase)
            yield

    def consumer(c):
        stage, phase, pstage, i, own = 0, 0, 0, 0, 0
        for lt, n in enumerate(iters):
            if lt % 2 != c:  # mainloop.py: s2 = stage + (kend - kbeg); phase ^= (s2 / st) & 1; stage = s2 % st
                s2 = stage + n
                phase ^= (s2 // st) & 1
                stage, i = s2 % st, i + n
                continue
            while not turn[c].passes((own & 1) ^ (c == 0)):
                yield
            for kt in range(n):
                while not full[stage].passes(phase):
                    yield
                assert filled[stage] == i and owner[i] == c, "stage read before it was filled, or by the other"
                read[stage] = True
                if kt > 0:
                    empty[pstage].arrive()
                pstage, i = stage, i + 1
                stage, phase = (0, phase ^ 1) if stage + 1 == st else (stage + 1, phase)
                yield
            turn[1 - c].arrive()
            own += 1
            empty[pstage].arrive()
            yield

    _interleave(rng, [producer(), consumer(0), consumer(1)], 100000)


def _interleave(rng, roles, steps):
    """Step the role generators in random order until all end; none left over means no deadlock."""
    live = list(roles)
    for _ in range(steps):
        if not live:
            break
        role = rng.choice(live)
        try:
            next(role)
        except StopIteration:
            live.remove(role)
    assert not live, "deadlock"


@pytest.mark.parametrize("st, cw, seed", [(2, 1, 0), (3, 2, 1), (4, 2, 2), (6, 1, 3)])
def test_cluster_stage_ring_protocol(st, cw, seed):
    """Clusters of two (cl=2): each block's producer waits on its own empty[s], then writes its share
    of A into stage s of BOTH blocks and its B into its own; a block's full[s] completes once its own
    producer armed it and all three pieces landed. The consumers release a stage with one arrival per
    warpgroup on every block's empty[s] (the generator's Ring.releases): no stage of either block is
    overwritten before all its consumers read it, none read before all pieces landed, no deadlock."""
    from convforge.kernels.tensorcore.sm90.mainloop import Ring

    cfg = TileConfig(128, 64, 1, st, cw, tm=1, cl=2)
    assert not cfg.problems(TF32)
    rng = random.Random(seed)
    iters = [5, 1, 7, 2]
    total, blocks = sum(iters), range(cfg.cl)
    full = [[_Mbarrier(1) for _ in range(st)] for _ in blocks]  # the producer's arrive.expect_tx
    empty = [[_Mbarrier(Ring(cfg, TF32).releases) for _ in range(st)] for _ in blocks]
    pieces = [[set() for _ in range(st)] for _ in blocks]  # what landed in each stage of each block
    armed = [[False] * st for _ in blocks]
    filled = [[None] * st for _ in blocks]
    reads = [[set() for _ in range(st)] for _ in blocks]

    def land(b, s, piece, i):
        if filled[b][s] != i:  # the first piece of a new fill: every consumer must have read the last
            assert filled[b][s] is None or reads[b][s] == set(range(cw)), "stage overwritten before it was read"
            assert filled[b][s] is None or len(pieces[b][s]) == 3, "a new fill before the last one landed"
            filled[b][s], reads[b][s], pieces[b][s] = i, set(), set()
        pieces[b][s].add(piece)
        if armed[b][s] and len(pieces[b][s]) == 3:  # two shares of A and B: the transaction bytes complete
            armed[b][s] = False
            full[b][s].arrive()

    def producer(b):
        stage, phase, i = 0, 0, 0
        while i < total:
            while not empty[b][stage].passes(phase ^ 1):
                yield
            armed[b][stage] = True  # expect_tx: the arrival counts once the bytes are in
            for peer in blocks:
                land(peer, stage, ("a", b), i)
                yield
            land(b, stage, ("b", b), i)
            i += 1
            stage, phase = (0, phase ^ 1) if stage + 1 == st else (stage + 1, phase)
            yield

    def consumer(b, c):
        stage, phase, pstage, i = 0, 0, 0, 0

        def release(s):
            for peer in blocks:  # thread 0 locally, thread 1 on the peer
                empty[peer][s].arrive()

        for n in iters:
            for kt in range(n):
                while not full[b][stage].passes(phase):
                    yield
                assert filled[b][stage] == i and len(pieces[b][stage]) == 3, "stage read before it was filled"
                reads[b][stage].add(c)
                if kt > 0:
                    release(pstage)
                pstage, i = stage, i + 1
                stage, phase = (0, phase ^ 1) if stage + 1 == st else (stage + 1, phase)
                yield
            release(pstage)
            yield

    _interleave(rng, [producer(b) for b in blocks] + [consumer(b, c) for b in blocks for c in range(cw)], 200000)


# -- the epilogue -------------------------------------------------------------------------------------
@pytest.mark.parametrize("wm, bn", [(1, 64), (2, 128), (1, 256), (2, 96)])
def test_staging_conflict_free_and_complete(wm, bn):
    """Per chunk: every staged slot written once by the warpgroup, each warp's 32 scalar stores on 32
    banks; every thread's float4 read-out 16-byte aligned, each quarter-warp 128 contiguous bytes."""
    ld = staging_ld(wm)
    for ch, items in chunks(wm, bn):
        seen = set()
        for mi, i in itertools.product(range(wm), range(bn // 2)):
            w = stage_write(ld, mi, i, ch)
            if w is None:
                continue
            for wq in range(4):
                offs = [evaluate(w[0], {"wq": wq, "g": lane >> 2, "t": lane & 3}) for lane in range(32)]
                assert len({o % 32 for o in offs}) == 32, f"bank conflict staging register {i}"
                assert not seen & set(offs)
                seen |= set(offs)
        cols = min(epilogue.COLS, bn - epilogue.COLS * ch)
        assert seen == {col * ld + r for col in range(cols) for r in range(64 * wm)}
        for item in items:
            at = [bind(readout_lets(wm, item), {"ct": ct}) for ct in range(128)]
            offs = [e[f"ec{item}"] * ld + e[f"er{item}"] for e in at]
            assert all(o % 4 == 0 for o in offs)
            for q0 in range(0, 128, 8):
                quarter = sorted(offs[q0:q0 + 8])
                assert quarter == list(range(quarter[0], quarter[0] + 32, 4))


@pytest.mark.parametrize("wm, bn", [(1, 64), (2, 128), (1, 256), (2, 192)])
def test_half_staging_conflict_free_and_coalesced(wm, bn):
    """Half staging (eh=1): each warp's 32 word writes on 32 banks; 8 consecutive threads' 16-byte
    read-outs one staged row's 128 bytes (a permutation of its 8 octets) and 128 contiguous output bytes."""
    for ch in range(bn // H8):
        for mi, i in itertools.product(range(wm), range(0, bn // 2, 2)):
            w = h8_slot(mi, i)
            if w is None or w[1] != ch:
                continue
            for wq in range(4):
                offs = [evaluate(w[0], {"wq": wq, "g": lane >> 2, "t": lane & 3}) for lane in range(32)]
                assert len({o % 32 for o in offs}) == 32, f"bank conflict staging pair {i}"
        for item in range(h8_items(wm)):
            envs = [bind(h8_lets(item), {"ct": ct}) for ct in range(128)]
            for q0 in range(0, 128, 8):
                rows = {e[f"er{item}"] for e in envs[q0:q0 + 8]}
                octets = sorted((e[f"eo{item}"] ^ (e[f"er{item}"] & 7)) for e in envs[q0:q0 + 8])
                assert len(rows) == 1 and octets == list(range(8))
                assert [e[f"eo{item}"] for e in envs[q0:q0 + 8]] == list(range(8))


def test_half_staging_only_where_rounding_first_is_exact():
    """h8_reason: fp32, split slabs, columns not in runs of 8 or a tile not of whole 64-column chunks keep
    the float staging; a bias, a residual (beside at most 64 accumulators a thread) and an activation are
    applied in registers before the one rounding."""
    base = Output("y", 100, 64, 1, dtype="float16")
    assert h8_reason(base, 128) is None and h8_reason(dataclasses.replace(base, dtype="bfloat16"), 64) is None
    assert h8_reason(dataclasses.replace(base, epi=Epilogue(relu=True)), 64) is None
    assert h8_reason(dataclasses.replace(base, epi=Epilogue(bias=True, gelu=True)), 64) is None
    res = dataclasses.replace(base, epi=Epilogue(bias=True, residual=True, relu=True))
    assert h8_reason(res, 64, 2) is None and h8_reason(res, 128, 1) is None
    assert "spill" in h8_reason(res, 128, 2)  # 128 accumulators a thread: the float path reads it after staging
    assert h8_reason(dataclasses.replace(base, dtype="float32"), 64)
    assert h8_reason(dataclasses.replace(base, slab=6400), 64)
    assert "runs of 8" in h8_reason(dataclasses.replace(base, n=60), 64)
    assert "64-column" in h8_reason(base, 96)


@pytest.mark.parametrize("wm, bn", [(1, 64), (2, 128), (1, 256), (2, 96), (1, 32)])
def test_rowmajor_staging_complete_and_coalesced(wm, bn):
    """Row-major (NHWC) staging: every slot of a chunk written once, each warp's 32 scalar stores at
    most 2 to a bank; every read-out a 16-byte aligned float4 holding its 4 columns in order, 8
    consecutive threads one row's 128 contiguous bytes of staging and of output."""
    for ch, items, quads in rowmajor_chunks(wm, bn):
        seen = set()
        for mi, i in itertools.product(range(wm), range(bn // 2)):
            w = stage_write(0, mi, i, ch, rowmajor=True)
            if w is None:
                continue
            for wq in range(4):
                offs = [evaluate(w[0], {"wq": wq, "g": lane >> 2, "t": lane & 3}) for lane in range(32)]
                assert max(np.bincount([o % 32 for o in offs])) <= 2, f"bank conflicts staging register {i}"
                assert not seen & set(offs)
                seen |= set(offs)
        cols = 4 * quads
        assert seen == {evaluate(swizzled("r", "c"), {"r": r, "c": col})
                        for r in range(64 * wm) for col in range(cols)}
        for item in items:
            envs = [bind(rowmajor_lets(wm, item, quads), {"ct": ct}) for ct in range(128)]
            for e in envs:
                at = evaluate(swizzled("r", "4 * q"), {"r": e[f"er{item}"], "q": e[f"eq{item}"]})
                assert at % 4 == 0
                assert [evaluate(swizzled("r", "c"), {"r": e[f"er{item}"], "c": 4 * e[f"eq{item}"] + j})
                        for j in range(4)] == [at + j for j in range(4)]
            if quads == 8:
                for q0 in range(0, 128, 8):
                    rows = {e[f"er{item}"] for e in envs[q0:q0 + 8]}
                    assert len(rows) == 1 and sorted(e[f"eq{item}"] for e in envs[q0:q0 + 8]) == list(range(8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_output_rounding_matches_stated_error(dtype):
    """NumPy emulation of the half variant's only rounding (products exact, sums FP32, one rounding
    at the store) on a ResNet-like layer: its relative L2 error is what the variant states (within
    30 %) and far below its check's tolerance."""
    from convforge.kernels.tensorcore.sm90.variants import HALF_EXPECTED, HALF_TOLERANCE

    spec = ConvSpec.make(2, 64, 12, 12, 32, 3, 3, 1, 1, dtype=dtype)
    rng = np.random.default_rng(0)
    x = rounded(rng.uniform(-1, 1, spec.x_shape).astype(np.float32), dtype)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), dtype)
    exact = conv2d_ref(x.astype(np.float64), w.astype(np.float64), spec)
    err = rel_l2(rounded(exact.astype(np.float32), dtype), exact)
    assert 0.7 * HALF_EXPECTED[dtype] < err < 1.3 * HALF_EXPECTED[dtype], err
    assert err < HALF_TOLERANCE[dtype] / 4


def _round(kind, a):
    return {"tf32": _tf32, "f16": lambda v: v.astype(np.float16).astype(np.float64),
            "bf16": lambda v: rounded(v.astype(np.float32), "bfloat16").astype(np.float64),
            "exact": lambda v: v}[kind](a)


def winograd_error(spec: ConvSpec, m: int, operands: str, seed: int = 0) -> float:
    """Relative L2 error of non-fused F(m x m, 3 x 3) with U and V rounded to ``operands`` (everything
    else exact) and the output rounded to the spec's dtype: the roundings the tensor-core variants add."""
    from convforge.kernels.winograd.matrices import winograd

    rng = np.random.default_rng(seed)
    x = rounded(rng.uniform(-1, 1, spec.x_shape).astype(np.float32), spec.dtype).astype(np.float64)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), spec.dtype).astype(np.float64)
    t = winograd(m, 3)
    at, g, bt, a = t.as_float("AT"), t.as_float("G"), t.as_float("BT"), m + 2
    th, tw = -(-spec.p // m), -(-spec.q // m)
    xp = np.zeros((spec.n, spec.c, th * m + 2, tw * m + 2))
    xp[:, :, 1:1 + spec.h, 1:1 + spec.w] = x
    u = _round(operands, np.einsum("ij,kcjl,ml->kcim", g, w, g))
    d = np.stack([np.stack([xp[:, :, i * m:i * m + a, j * m:j * m + a] for j in range(tw)], 2) for i in range(th)], 2)
    v = _round(operands, np.einsum("ij,nctsjl,ml->nctsim", bt, d, bt))
    y = np.einsum("ij,nktsjl,ml->nktsim", at, np.einsum("kcim,nctsim->nktsim", u, v), at)
    y = y.transpose(0, 1, 2, 4, 3, 5).reshape(spec.n, spec.k, th * m, tw * m)[:, :, :spec.p, :spec.q]
    out = rounded(y.astype(np.float32), spec.dtype).astype(np.float64) if spec.dtype != "float32" else y
    return rel_l2(out, conv2d_ref(x, w, spec))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("m", [2, 4])
def test_winograd_stated_errors_match_the_rounding_emulation(dtype, m):
    """tc_winograd_f2 and _f4 state per dtype what the emulation of their roundings gives (within
    30 %), half their check's tolerance at most: TF32 operands for float32 and bfloat16 layers,
    FP16 for float16; BF16 operands would be 2.5x worse (F(2x2)) and 7x worse (F(4x4)), so they are
    not used."""
    from convforge.kernels.tensorcore.sm90.winograd import TOLERANCE

    spec = ConvSpec.make(2, 64, 20, 20, 32, 3, 3, 1, 1, dtype=dtype)
    v = get_variant(f"tc_winograd_f{m}")
    err = winograd_error(spec, m, {"tf32": "tf32", "f16": "f16"}[v.math(spec).name])
    assert 0.7 * v.expected_error(spec) < err < 1.3 * v.expected_error(spec), err
    assert v.expected_error(spec) <= TOLERANCE[m, dtype] / 2
    if dtype == "bfloat16":
        assert winograd_error(spec, m, "bf16") > 2 * err


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_winograd_f4_is_admitted_by_class(dtype):
    """F(4x4) with one product states 3.1-3.5e-3: the relaxed class refuses it on float32 and
    float16 layers before it is tried (its bound there is 1e-3), tries it on bfloat16 layers (bound
    2x the layer's most accurate, about 3.4e-3: the measurement decides), a max_error of 5e-3 admits
    it everywhere, the fp32 class nowhere; F(2x2) stays in the relaxed class on every dtype."""
    from convforge.kernels import accurate_enough, select
    from convforge.tune.tuner import Tuner

    class Nominal:  # pool() reads only the device
        name, device = "cuda", NOMINAL_CUDA

    spec = ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1, dtype=dtype)
    f4, f2 = get_variant("tc_winograd_f4"), get_variant("tc_winograd_f2")
    why = accurate_enough(f4, spec, "relaxed")
    assert (why is None) == (dtype == "bfloat16"), why
    if why:
        assert "relaxed class" in why and dtype in why
    assert accurate_enough(f2, spec, "relaxed") is None
    assert accurate_enough(f4, spec, "relaxed", 5e-3) is None
    assert accurate_enough(f4, spec, "fp32") is not None
    names = lambda vs: {v.name for v in vs}  # noqa: E731
    pool = lambda **kw: names(Tuner(Nominal(), **kw).pool(spec))  # type: ignore[arg-type]  # noqa: E731
    assert ("tc_winograd_f4" in pool(precision="relaxed")) == (dtype == "bfloat16")
    assert "tc_winograd_f2" in pool(precision="relaxed")
    assert "tc_winograd_f4" in pool(max_error=5e-3)
    assert names(select("tc_winograd_f4", spec, NOMINAL_CUDA, precision="fp32")) == {"tc_winograd_f4"}  # named


# -- tiles, variants, compiles ----------------------------------------------------------------------
def test_tile_problems_name_the_parameter():
    assert any("bn" in p for p in TileConfig(128, 40).problems(TF32))
    assert any("shared memory" in p for p in TileConfig(256, 256, 2, 8, 2).problems(X3TF32))
    assert any("pi" in p for p in TileConfig(128, 64, pi=2).problems(F16))
    assert any("empty" in p for p in TileConfig(128, 64, ks=4).problems(TF32, Problem(100, 64, 96)))
    assert any("sa (64)" in p and "tm=1" in p for p in TileConfig(128, 64, sa=64).problems(TF32))
    assert any("sa (48)" in p for p in TileConfig(128, 64, tm=1, sa=48).problems(TF32))
    assert not TileConfig(128, 64, 2, tm=1, sa=32).problems(F16)
    assert TileConfig.of(TileConfig(128, 64, tm=1, sa=64).params()).sa == 64
    with pytest.raises(ValueError, match="TMA only"):
        _iterators(TF32, 64, 1)[0].__class__("a", Tile(64, 2, 64), TF32, "xh", geo=_iterators(TF32, 64, 1)[0].geo
                                             ).thread_lets()
    with pytest.raises(ValueError, match="unknown tensor-core tile parameters"):
        TileConfig.of(Params(bm=128, bn=64, zz=1))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("spec", ODD[:3] + [ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1)], ids=str)
def test_space_points_are_valid(name, spec):
    v = get_variant(name)
    spec = spec if name != "tc_implicit_gemm_half" else ConvSpec.from_dict({**spec.to_dict(), "dtype": "float16"})
    space = v.space(spec, NOMINAL_CUDA)
    assert space[0] == v.default(spec, NOMINAL_CUDA) and len(space) == len(set(space))
    prob = v.problem(spec)
    for p in space:
        assert not TileConfig.of(p).problems(v.math(spec), prob), p


def test_variants_refuse_other_devices_passes_and_dtypes():
    spec = ConvSpec.make(1, 8, 9, 9, 8, 3, 3, 1, 1)
    ampere = DeviceInfo("cuda", "A100", cc=(8, 0), shared_optin_bytes=163 * 1024, units=108)
    for name in VARIANTS:
        v = get_variant(name)
        s = spec if name != "tc_implicit_gemm_half" else ConvSpec.from_dict({**spec.to_dict(), "dtype": "bfloat16"})
        assert v.applies(s, NOMINAL_CUDA) is None
        assert "compute capability 9.0" in v.applies(s, ampere)
        assert "cuda" in v.applies(s, DeviceInfo("opencl", "cpu"))
        assert "dgrad" in v.applies(s.with_pass("dgrad"), NOMINAL_CUDA)
    assert "float16" in get_variant("tc_implicit_gemm_tf32").applies(
        ConvSpec.from_dict({**spec.to_dict(), "dtype": "float16"}), NOMINAL_CUDA)
    assert "float32" in get_variant("tc_implicit_gemm_half").applies(spec, NOMINAL_CUDA)


def test_opencl_refuses_the_generator():
    v = get_variant("tc_implicit_gemm_tf32")
    spec = ConvSpec.make(1, 8, 9, 9, 8, 3, 3, 1, 1)
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    with pytest.raises(ValueError, match="wgmma"):
        render(list(plan.kernels), "opencl")
    assert ARCH_SPECIFIC_MARK in plan.source("cuda")


def _spec_of(name, spec, dtype="float16"):
    half = name in ("tc_implicit_gemm_half", "tc_stem_gemm_half")
    return ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype}) if half else spec


COMPILE = [("tc_implicit_gemm_tf32", ODD[0], None), ("tc_implicit_gemm_tf32", ODD[3], None),
           ("tc_implicit_gemm_3xtf32", ODD[4], None), ("tc_implicit_gemm_half", ODD[5], None),
           ("tc_implicit_gemm_tf32", ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1),
            Params(bm=128, bn=256, kb=1, st=3, cw=2, ks=1, ps=1)),
           ("tc_implicit_gemm_half", ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1),
            Params(bm=256, bn=128, kb=1, st=4, cw=2, ks=1, ps=1)),
           ("tc_implicit_gemm_3xtf32", ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1), None),
           ("tc_implicit_gemm_tf32", ConvSpec.make(8, 256, 14, 14, 512, 1, 1), Params(bm=128, bn=128, kb=2, st=3,
                                                                                      cw=1, ks=1, ps=0)),
           ("tc_stem_gemm_half", ConvSpec.make(128, 3, 227, 227, 64, 7, 7, 2), None),  # MEC cv3
           ("tc_stem_gemm_half", ConvSpec.make(128, 3, 227, 227, 96, 11, 11, 4), None),  # AlexNet conv1
           ("tc_stem_gemm_tf32", ConvSpec.make(32, 3, 224, 224, 64, 7, 7, 2, 3), None),  # ResNet-50 conv1
           # kr=1: three sets of 64 accumulators with the one-thread TMA producer (NIN cccp4), and 3xTF32's
           ("tc_implicit_gemm_3xf16", ConvSpec.make(32, 1024, 6, 6, 1024, 1, 1), None),
           ("tc_implicit_gemm_3xtf32", ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1),
            Params(bm=128, bn=128, kb=1, st=3, cw=2, ks=1, ps=1, tm=1, kr=1))]


def _no_spills(label, infos):
    assert infos, f"{label}: ptxas reported no kernel"
    for info in infos:
        assert info.spill_stores == 0 and info.spill_loads == 0, (label, info)


def _gemms(name, sass):
    """The SASS sections of the kernels named ``name``_gemm*."""
    return [k for k in re.split(r"\n\s+Function : ", sass) if k.startswith(f"{name}_gemm")]


def test_compiles_for_sm90a_without_spills_hgmma_in_sass(nvcc_ok):
    """Each COMPILE case, through one nvcc run (helpers.sass_reports), nvcc -arch=sm_90a: no spill in
    any kernel; the GEMM's SASS has HGMMA (a whole number of stages' worth: ptxas peels or unrolls short
    K loops) and no HMMA; setmaxnreg where the tile trades registers."""
    cases, sources = [], []
    for name, spec, params in COMPILE:
        v = get_variant(name)
        spec = _spec_of(name, spec)
        prm = params or v.default(spec, NOMINAL_CUDA)
        cases.append((f"{name} {spec.short()} [{prm.short()}]", name, v, spec, prm))
        sources.append(v.plan(spec, prm, NOMINAL_CUDA, Epilogue(bias=True, relu=True)).source("cuda"))
    for (label, name, v, spec, prm), (infos, sass) in zip(cases, sass_reports(sources), strict=True):
        _no_spills(label, infos)
        gemm = _gemms(name, sass)
        assert gemm, f"{label}: no GEMM kernel in the SASS"
        ops = re.findall(r"\b(HGMMA|HMMA|FFMA|SETMAXNREG|USETMAXREG)\b", gemm[0])
        cfg, math = TileConfig.of(prm), v.math(spec)
        per_stage = len(wgmma_issue(cfg, math))
        assert ops.count("HGMMA") >= per_stage and ops.count("HGMMA") % per_stage == 0, (label, ops.count("HGMMA"))
        assert "HMMA" not in ops, label
        assert ("USETMAXREG" in ops) == (cfg.regs() is not None), label


def test_tma_plans_compile_without_spills_tensor_copies_in_sass(nvcc_ok):
    """tm=1 (the default on a stride-2 layer), in float16, bfloat16, TF32 and 3xTF32, through one nvcc
    run: no spill; the GEMM's SASS issues tensor copies (UTMALDG) and HGMMA, no cp.async (LDGSTS)."""
    cases, sources = [], []
    for name, dtype in [("tc_implicit_gemm_half", "float16"), ("tc_implicit_gemm_half", "bfloat16"),
                        ("tc_implicit_gemm_tf32", "float32"), ("tc_implicit_gemm_3xtf32", "float32")]:
        v = get_variant(name)
        spec = ConvSpec.from_dict({**ConvSpec.make(4, 64, 15, 13, 96, 3, 3, 2, 1).to_dict(), "dtype": dtype})
        prm = v.default(spec, NOMINAL_CUDA)
        assert prm.get("tm") == 1, (name, dtype)
        cases.append((name, f"{name} {dtype}"))
        sources.append(v.plan(spec, prm, NOMINAL_CUDA, Epilogue(bias=True, relu=True)).source("cuda"))
    for (name, label), (infos, sass) in zip(cases, sass_reports(sources), strict=True):
        _no_spills(label, infos)
        gemm = _gemms(name, sass)[0]
        assert "UTMALDG" in gemm and "HGMMA" in gemm and "LDGSTS" not in gemm, label


def test_tma_store_plans_compile_without_spills_tensor_stores_in_sass(nvcc_ok):
    """es=1 (TMA stores of the half-staged chunks) on a ResNet 1x1 layer at its default tile (128 accumulators
    a thread), with bias and ReLU, at a 64-column tile with a residual, and its statistics plan: no spill;
    the GEMM's SASS stores by tensor copies (UTMASTG), no 16-byte global stores (STG.E.128)."""
    v = get_variant("tc_implicit_gemm_half")
    spec = ConvSpec.make(32, 64, 56, 56, 256, 1, 1, dtype="float16", layout="nhwc")
    prm = v.default(spec, NOMINAL_CUDA).replace(es=1)
    plans = [v.plan(spec, prm, NOMINAL_CUDA, Epilogue(bias=True, relu=True)),
             v.plan(spec, prm.replace(bn=64), NOMINAL_CUDA, Epilogue(bias=True, residual=True, relu=True)),
             v.plan_stats(spec, prm, NOMINAL_CUDA)[0]]
    for i, (infos, sass) in enumerate(sass_reports([p.source("cuda") for p in plans])):
        _no_spills(f"es=1 plan {i}", infos)
        gemm = _gemms("tc_implicit_gemm_half", sass)[0]
        assert "UTMASTG" in gemm and "HGMMA" in gemm and "STG.E.128" not in gemm, i


def test_tma_stores_refuse_what_a_box_cannot_address():
    """es=1 needs a plain M x n row-major output: a strided dgrad's phases, a concat's channel offset, a split
    reduction's slabs and a residual beside 128 accumulators a thread are refused by name."""
    v = get_variant("tc_implicit_gemm_half")
    spec = ConvSpec.make(2, 64, 14, 14, 128, 3, 3, 1, 1, dtype="float16", layout="nhwc")
    prm = v.default(spec, NOMINAL_CUDA).replace(es=1, ks=1)
    v.plan(spec, prm, NOMINAL_CUDA)  # a plain output: taken
    with pytest.raises(ValueError, match="es=1: TMA stores take a plain"):
        v.plan(spec, prm, NOMINAL_CUDA, Epilogue(k_total=256, k_offset=64))
    with pytest.raises(ValueError, match="es=1: half staging takes one slab"):
        v.plan(spec, prm.replace(ks=2), NOMINAL_CUDA)
    with pytest.raises(ValueError, match="es=1: a residual"):
        v.plan(spec, prm.replace(bn=128, pp=1), NOMINAL_CUDA, Epilogue(residual=True))
    d = get_variant("dgrad_tc_strided_half")
    ds = ConvSpec.from_dict({**ConvSpec.make(2, 128, 14, 13, 64, 3, 3, 2, 1).to_dict(), "dtype": "float16",
                             "layout": "nhwc", "pass": "dgrad"})
    with pytest.raises(ValueError, match="es=1"):
        d.plan(ds, d.default(ds, NOMINAL_CUDA).replace(es=1), NOMINAL_CUDA)
    assert not any(p.get("es") for p in v.space(spec, NOMINAL_CUDA)), "not in the tuner's space until GPU-timed"


def test_cluster_plans_compile_multicast_copies_in_sass(nvcc_ok):
    """cl=2 in float16, TF32 and 3xTF32, through one nvcc run: a kernel of clusters of two
    (__cluster_dims__), no spill; the GEMM multicasts A's share (a multicast tensor copy), arrives on its
    peer's barriers (remote shared-memory arrive) and meets it at cluster barriers; HGMMA, no cp.async."""
    cases, sources = [], []
    for name, dtype in [("tc_implicit_gemm_half", "float16"), ("tc_implicit_gemm_tf32", "float32"),
                        ("tc_implicit_gemm_3xtf32", "float32")]:
        v = get_variant(name)
        spec = ConvSpec.from_dict({**ConvSpec.make(4, 64, 15, 13, 96, 3, 3, 2, 1).to_dict(), "dtype": dtype})
        prm = dataclasses.replace(TileConfig.of(v.default(spec, NOMINAL_CUDA)), cl=2, pp=0).params()
        assert prm.get("tm") == 1 and prm.get("cl") == 2
        plan = v.plan(spec, prm, NOMINAL_CUDA, Epilogue(bias=True, relu=True))
        src = plan.source("cuda")
        assert "__cluster_dims__(2, 1, 1)" in src and ".multicast::cluster" in src
        gemm_launch = [st for st in plan.steps if st.kernel.endswith("_gemm")][0]
        assert gemm_launch.grid[0] % 2 == 0
        cases.append((name, f"{name} {dtype}"))
        sources.append(src)
    for (name, label), (infos, sass) in zip(cases, sass_reports(sources), strict=True):
        _no_spills(label, infos)
        gemm = _gemms(name, sass)[0]
        assert "UTMALDG" in gemm and "HGMMA" in gemm and "LDGSTS" not in gemm, label
        assert re.search(r"UTMALDG\S*MULTICAST|MULTICAST\S*UTMALDG", gemm), f"{label}: no multicast tensor copy"
        assert "UCGABAR" in gemm or "CGABAR" in gemm or "BAR.ARV" in gemm or "SYNCS" in gemm, label


TRAINING_TMA = [
    ("wgrad_tc_implicit_gemm_tf32", ConvSpec.make(32, 64, 28, 28, 128, 3, 3, 1, 1, conv_pass="wgrad"), 128),
    ("wgrad_tc_implicit_gemm_half", ConvSpec.make(64, 64, 14, 14, 64, 3, 3, 2, 1, dtype="float16", conv_pass="wgrad"),
     128),
    ("dgrad_tc_strided_half", ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 2, 1, dtype="bfloat16", conv_pass="dgrad"),
     128),
    ("dgrad_tc_strided_3xtf32", ConvSpec.make(8, 64, 15, 15, 64, 1, 1, 2, conv_pass="dgrad"), 128),
    # a batch of 16 (VGG-16's): x' in the 64-byte swizzle (TF32), the 32-byte one (half); 48 channels forward
    ("wgrad_tc_implicit_gemm_tf32", ConvSpec.make(16, 64, 28, 28, 128, 3, 3, 1, 1, conv_pass="wgrad"), 64),
    ("wgrad_tc_implicit_gemm_half", ConvSpec.make(16, 64, 14, 14, 64, 3, 3, 1, 1, dtype="float16", conv_pass="wgrad"),
     32),
    ("tc_implicit_gemm_tf32", ConvSpec.make(8, 48, 28, 28, 64, 3, 3, 1, 1), 64)]


def test_training_pass_tma_plans_compile(nvcc_ok):
    """wgrad (the batch as channels: whole 128-byte rows, or 64- / 32-byte ones at a batch of 16),
    strided dgrad (every phase's maps in one kernel) and a 48-channel forward layer by TMA (the
    TRAINING_TMA cases, through one nvcc run): the default in the widest swizzle the channels allow,
    no spill, tensor copies and HGMMA, no cp.async in the GEMM."""
    cases, sources = [], []
    for name, spec, sa in TRAINING_TMA:
        v = get_variant(name)
        prm = v.default(spec, NOMINAL_CUDA)
        assert prm.get("tm") == 1, v.tma_reason(spec, TileConfig.of(Params({k: x for k, x in prm.items()
                                                                             if k != "il"})))
        assert prm.get("sa", 128) == sa, (name, spec)
        cases.append((name, f"{name} {spec.short()}"))
        sources.append(v.plan(spec, prm, NOMINAL_CUDA).source("cuda"))
    for (name, label), (infos, sass) in zip(cases, sass_reports(sources), strict=True):
        _no_spills(label, infos)
        gemm = _gemms(name, sass)[0]
        assert "UTMALDG" in gemm and "HGMMA" in gemm and "LDGSTS" not in gemm, label


PINGPONG = [
    ("tc_implicit_gemm_half", ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1, dtype="float16", layout="nhwc"),
     Params(bm=128, bn=128, cw=2, kb=1, ks=1, ps=1, st=6, tm=1, pp=1)),
    ("tc_implicit_gemm_tf32", ConvSpec.make(8, 64, 28, 28, 96, 3, 3, 2, 1),
     Params(bm=128, bn=64, cw=2, kb=1, ks=2, ps=1, st=4, pp=1)),
    ("tc_implicit_gemm_3xtf32", ConvSpec.make(8, 48, 14, 14, 64, 3, 3, 1, 1),
     Params(bm=64, bn=64, cw=2, kb=1, ks=1, ps=1, st=4, pi=2, tm=1, sa=64, pp=1))]


def test_pingpong_plans_compile(nvcc_ok):
    """pp=1 (the PINGPONG cases, through one nvcc run): each consumer a whole tile (128 accumulators a
    thread for 128 x 128), the turn barriers and the skip over the other's stages: no spill, HGMMA, the
    TMA copies where asked."""
    cases, sources = [], []
    for name, spec, prm in PINGPONG:
        src = get_variant(name).plan(spec, prm, NOMINAL_CUDA, Epilogue(bias=True, relu=True)).source("cuda")
        assert "lt++ & 1" in src and src.count("mbarrier.init") >= 2 * prm["st"] + 2, name
        cases.append((name, prm, f"{name} {spec.short()} [{prm.short()}]"))
        sources.append(src)
    for (name, prm, label), (infos, sass) in zip(cases, sass_reports(sources), strict=True):
        _no_spills(label, infos)
        gemm = _gemms(name, sass)[0]
        assert "HGMMA" in gemm and (("UTMALDG" in gemm) == bool(prm.get("tm"))), label


def test_3xtf32_points_compile_with_promotion(nvcc_ok):
    v = get_variant("tc_implicit_gemm_3xtf32")
    spec = ConvSpec.make(4, 64, 28, 28, 128, 3, 3, 1, 1)
    points = (Params(bm=128, bn=128, kb=1, st=3, cw=2, ks=1, ps=1, pi=4),
              Params(bm=128, bn=64, kb=2, st=2, cw=1, ks=1, ps=1, pi=2))
    assert_sources_compile_clean([(f"[{p.short()}]", v.plan(spec, p, NOMINAL_CUDA).source("cuda"))  # one nvcc run
                                  for p in points])


LINEAR = [("tc_implicit_gemm_3xtf32", _cl(ConvSpec.make(32, 96, 56, 56, 384, 1, 1)), Epilogue(bias=True, gelu=True)),
          ("tc_implicit_gemm_tf32", _cl(ConvSpec.make(32, 384, 56, 56, 96, 1, 1)), Epilogue(bias=True, residual=True)),
          ("tc_implicit_gemm_half", _cl(ConvSpec.make(8, 64, 14, 14, 256, 1, 1)), Epilogue(bias=True, gelu=True))]


def test_channels_last_plans_compile_and_read_in_place(nvcc_ok):
    """Channels-last layers (ConvNeXt's linear layers as 1x1 convs, the LINEAR cases, through one nvcc
    run): the per-element step for 3xTF32's split only (TF32 and halves of whole chunks: the GEMM reads
    x), HGMMA without spills, the GELU helper where asked."""
    labels, sources = [], []
    for name, spec, epi in LINEAR:
        v = get_variant(name)
        spec = _spec_of(name, spec)
        plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, epi)
        names = [k.name for k in plan.kernels]
        assert ("tc_x_from_nhwc" in names) == ("3xtf32" in name) and "tc_x_nhwc" not in names, name
        src = plan.source("cuda")
        assert ("cf_gelu" in src) == epi.gelu, name
        labels.append(f"{name} {spec.short()}")
        sources.append(src)
    for label, (infos, sass) in zip(labels, sass_reports(sources), strict=True):
        _no_spills(label, infos)
        assert "HGMMA" in sass, label


WGRAD_COMPILE = [("wgrad_tc_implicit_gemm_tf32", ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1), "float32"),
                 ("wgrad_tc_implicit_gemm_tf32", ConvSpec.make(32, 512, 7, 7, 512, 3, 3, 1, 1), "float32"),
                 ("wgrad_tc_implicit_gemm_3xtf32", ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1), "float32"),
                 ("wgrad_tc_implicit_gemm_half", ConvSpec.make(32, 256, 56, 56, 128, 1, 1, 2), "float16"),
                 ("wgrad_tc_implicit_gemm_half", ODD[3], "bfloat16"),
                 ("wgrad_tc_gemm1x1_tf32", ConvSpec.make(32, 256, 56, 56, 64, 1, 1), "float32"),
                 ("wgrad_tc_gemm1x1_half", ConvSpec.make(32, 1024, 14, 14, 256, 1, 1), "float16")]


def test_wgrad_plans_compile_without_spills_hgmma_in_sass(nvcc_ok):
    """The wgrad plans' defaults on the WGRAD_COMPILE layers (the transposing steps, the GEMM, the
    split-K reduce), through one nvcc run: no spills, HGMMA in the GEMM's SASS; a split where the GEMM
    alone would leave SMs idle and the reduction gives slices of at least 4 stages."""
    cases, sources = [], []
    for name, spec, dtype in WGRAD_COMPILE:
        v = get_variant(name)
        spec = ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "pass": "wgrad"})
        prm = v.default(spec, NOMINAL_CUDA)
        cfg = TileConfig.of(prm)
        prob = v.problem(spec)
        tiles_ = -(-prob.m // cfg.bm) * -(-prob.n // cfg.bn)
        assert cfg.ks > 1 or 2 * tiles_ > NOMINAL_CUDA.units or cfg.k_blocks(v.math(spec), prob) < 8, (name, prm)
        plan = v.plan(spec, prm, NOMINAL_CUDA)
        steps = ([] if "gemm1x1" in name else ["x", "dy"]) + ["gemm"] + (["reduce"] if cfg.ks > 1 else [])
        assert [k.name.rsplit("_", 1)[-1] for k in plan.kernels] == steps, name
        cases.append((name, f"{name} {spec.short()}"))
        sources.append(plan.source("cuda"))
    for (name, label), (infos, sass) in zip(cases, sass_reports(sources), strict=True):
        _no_spills(label, infos)
        gemm = _gemms(name, sass)
        assert gemm and "HGMMA" in gemm[0] and "HMMA" not in gemm[0], label


DGRAD_COMPILE = [("dgrad_tc_strided_tf32", ConvSpec.make(32, 128, 56, 56, 128, 3, 3, 2, 1), "float32"),
                 ("dgrad_tc_strided_tf32", ConvSpec.make(32, 256, 56, 56, 512, 1, 1, 2), "float32"),
                 ("dgrad_tc_strided_3xtf32", ConvSpec.make(32, 512, 14, 14, 512, 3, 3, 2, 1), "float32"),
                 ("dgrad_tc_strided_half", ConvSpec.make(32, 1024, 14, 14, 2048, 1, 1, 2), "float16"),
                 ("dgrad_tc_strided_half", ODD[3], "bfloat16")]


def test_strided_dgrad_plans_compile_without_spills_hgmma_in_sass(nvcc_ok):
    """The strided dgrad plans' defaults on the DGRAD_COMPILE layers (dy's conversion, per phase the
    filter packing and the GEMM, the zero step where a phase has no tap), through one nvcc run: no
    spills, HGMMA in every phase GEMM's SASS."""
    cases, sources = [], []
    for name, spec, dtype in DGRAD_COMPILE:
        v = get_variant(name)
        spec = ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "pass": "dgrad"})
        plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
        cases.append((name, plan, f"{name} {spec.short()}"))
        sources.append(plan.source("cuda"))
    for (name, plan, label), (infos, sass) in zip(cases, sass_reports(sources), strict=True):
        _no_spills(label, infos)
        gemms = _gemms(name, sass)
        assert len(gemms) == sum(k.name.startswith(f"{name}_gemm") for k in plan.kernels) >= 1, label
        assert all("HGMMA" in g and "HMMA" not in g for g in gemms), label


@pytest.mark.parametrize("ps", [1, 0])
def test_job_heads_deal_every_tile_of_every_job_once_round_robin(ps):
    """A kernel running several GEMMs in turn (strided dgrad's phases): over the blocks of its grid,
    the loop heads visit each tile of each job exactly once, and (persistent) block b takes the
    tiles b, b + G, ... of the whole sequence, so the blocks' loads differ by one tile at most."""
    import re

    from convforge.kernels.tensorcore.sm90.kernel import jobs_grid
    from convforge.kernels.tensorcore.sm90.schedule import job_heads

    cfg = TileConfig(128, 64, ps=ps)
    probs = [Problem(128 * t, 64, 256) for t in (7, 3, 12, 1)]
    grid = jobs_grid(cfg, probs, units=5)
    assert grid == (5 if ps else 12)
    heads = job_heads(cfg, probs)
    seen = [[0] * cfg.tiles(p) for p in probs]
    load = [0] * grid
    for b in range(grid):
        for j, head in enumerate(heads):
            first, end, _ = re.fullmatch(r"for \(int tile = (.+); tile < (\d+); tile \+= (NUM_GROUPS\(0\))\)",
                                         head).groups()
            env = {"b": b, "G": grid}
            t = evaluate(first.replace("GROUP_ID(0)", "b").replace("NUM_GROUPS(0)", "G"), env)
            while t < int(end):
                seen[j][t] += 1
                load[b] += 1
                if ps:
                    assert (sum(cfg.tiles(p) for p in probs[:j]) + t) % grid == b
                t += grid
    assert all(n == 1 for job in seen for n in job), seen
    if ps:
        assert max(load) - min(load) <= 1, load


def test_strided_dgrad_where_no_tap_reaches_dx_plans_no_gemm(nvcc_ok):
    """A 1x1 stride-2 layer of one padded pixel, in TF32 and 3xTF32: every phase is empty, dx is zeros.
    The plan has its default and space (the tile picked for a nominal problem), no filter packing or
    GEMM, and writes dx by the interleave (or the zero step, il=0); its sources compile (one nvcc run)."""
    spec = ConvSpec.make(1, 16, 1, 1, 16, 1, 1, 2, 1, conv_pass="dgrad")
    sources = []
    for name in ["dgrad_tc_strided_tf32", "dgrad_tc_strided_3xtf32"]:
        v = get_variant(name)
        assert v.applies(spec, NOMINAL_CUDA) is None and v.space(spec, NOMINAL_CUDA)
        for il, last in ((1, "_interleave"), (0, "_zero")):
            plan = v.plan(spec, v.default(spec, NOMINAL_CUDA).replace(il=il), NOMINAL_CUDA)
            names = [k.name for k in plan.kernels]
            assert not any("_gemm" in n or n.endswith("_w") for n in names) and names[-1] == name + last, names
            sources.append((f"{name} il={il}", plan.source("cuda")))
    for (label, _), infos in zip(sources, ptxas_reports([src for _, src in sources]), strict=True):
        assert infos, label


def test_naming_a_cluster_where_none_can_run_says_why():
    """``cl`` and ``tm`` may be named on any layer of the generator's variants (they are optional
    parameters); where they cannot run, plan() names the reason instead of calling them unknown."""
    from convforge.kernels import check_params

    v = get_variant("tc_implicit_gemm_half")
    spec = ConvSpec.make(4, 64, 15, 13, 64, 3, 3, 2, 1, dtype="float16")  # one N tile: no pair
    prm = check_params(v, spec, NOMINAL_CUDA, {**v.default(spec, NOMINAL_CUDA), "cl": 2, "ks": 1})
    with pytest.raises(ValueError, match="N-tile groups"):
        v.plan(spec, prm, NOMINAL_CUDA)
    prm = check_params(v, spec, NOMINAL_CUDA, {**v.default(spec, NOMINAL_CUDA), "cl": 3})
    with pytest.raises(ValueError, match=r"cl \(3\) must be 1, or 2"):
        v.plan(spec, prm, NOMINAL_CUDA)


def test_unrolled_tap_loop_gives_each_copy_its_own_im2col_offsets(nvcc_ok):
    """A 4x4 filter over 2-atom channels, one tap a stage (kb=2), unsplit: nvcc unrolls the producer's
    loop and folds every copy's im2col offsets to constants. In the PTX, the copies' (W, H) offsets, in issue order, are
    each tap's (s, r), once per atom. With 16-bit "h" operands nvcc 13.0 gave the second copy of a
    stage the first's W offset as its H offset (round 26: 0.65 relative error on an H100)."""
    from convforge.codegen.nvcc import ptx_text

    v = get_variant("tc_implicit_gemm_tf32")
    spec = ConvSpec.make(1, 64, 16, 15, 3, 4, 4, 1, 1)
    prm = Params(bm=128, bn=64, cw=1, kb=2, ks=1, ps=1, st=3, tm=1)
    ptx = ptx_text(v.plan(spec, prm, NOMINAL_CUDA).source("cuda"))
    consts = {m[0]: int(m[1]) for m in re.findall(r"mov\.u32\s+(%r\d+), (\d+);", ptx)}
    copies = re.findall(r"cvt\.u16\.u32 ow, (%r\d+); cvt\.u16\.u32 oh, (%r\d+);[^\n]*\.im2col\.", ptx)
    got = [(consts.get(w), consts.get(h)) for w, h in copies]
    assert got == [(t % 4, t // 4) for t in range(16) for _ in range(2)], got


# Stems with the filter columns folded into channels (TcStemGemm): 7x7/2 and 11x11/4 on 3 channels with
# odd sizes, asymmetric padding (top and left folded apart), dilation 2, N=1, channels-last input.
STEM_CASES = [(ConvSpec.make(2, 3, 19, 17, 8, 7, 7, 2, (3, 2, 3, 1), dtype="float16"), F16,
               TileConfig(128, 64, 1, 2, 2)),
              (ConvSpec.make(1, 3, 35, 37, 12, 11, 11, 4, (2, 0, 1, 2), dtype="float16"), F16,
               TileConfig(64, 96, 1, 2, 1)),
              (ConvSpec.make(2, 1, 13, 14, 16, 5, 5, 1, 2, 2, dtype="bfloat16"), BF16, TileConfig(128, 32, 2, 2, 1)),
              (ConvSpec.make(3, 3, 23, 21, 20, 7, 7, 2, 3), TF32, TileConfig(128, 64, 1, 2, 2, ks=2)),
              (ConvSpec.make(2, 2, 11, 13, 8, 3, 5, 1, (1, 1, 2, 2), 1, layout="nhwc", dtype="float16"), F16,
               TileConfig(64, 64, 1, 2, 1))]


def _folded(spec, xs, ws, cp, ld):
    """x' and w' as tc_x_fold and tc_w_fold write them: the kernels' own index expressions evaluated per
    element (prep.fold_source / wfold_source), per math part."""
    from convforge.kernels.tensorcore.sm90.prep import fold_source, wfold_source

    lets, ok, at = fold_source(spec, cp)
    xf = {}
    for part, x in xs.items():
        flat = (x.transpose(0, 2, 3, 1) if spec.layout == "nhwc" else x).ravel()
        out = np.full(spec.n * spec.h * spec.q * cp, np.nan)
        for e in range(out.size):
            env = {"e": e}
            for name, expr in lets:
                env[name] = evaluate(expr, env)
            out[e] = flat[evaluate(at, env)] if evaluate(ok, env) else 0.0
        xf[part] = out
    wf = {}
    for part, w in ws.items():
        flat, out = w.ravel(), np.full(spec.k * ld, np.nan)
        for e in range(spec.k * cp):
            env = {"e": e}
            for name, expr in wfold_source(spec, cp, ld):
                env[name] = evaluate(expr, env)
            for r in range(spec.r):
                out[env["o"] + r * cp] = flat[env["src"] + r * spec.s] if env["ok"] else 0.0
            out[env["k"] * ld + spec.r * cp + env["cj"]:(env["k"] + 1) * ld:cp] = 0.0  # the row's tail
        assert not np.isnan(out).any(), "a filter element no thread wrote"
        wf[part] = out
    return xf, wf


@pytest.mark.parametrize("spec, math, cfg", STEM_CASES, ids=lambda v: getattr(v, "name", None) or str(v))
def test_emulated_stem_fold_equals_the_convolution(spec, math, cfg):
    """The folded stem end to end in emulation: x' and w' from the fold kernels' expressions, the GEMM's
    tiles through the generator over the variant's own operands (R x 1 over Q columns of S C channels),
    equal to the layer's convolution of the same operand parts; every output written once per slice."""
    v = get_variant("tc_stem_gemm_tf32" if spec.dtype == "float32" else "tc_stem_gemm_half")
    assert v.applies(spec, NOMINAL_CUDA) is None, v.applies(spec, NOMINAL_CUDA)
    assert not cfg.problems(math), cfg.problems(math)
    rng = np.random.default_rng(4)
    xs, ws, ref, _ = _operands(spec, math, rng)
    a, b = v._operands(spec, cfg)
    cp, ld, prob = a.geo.cp, b.ld, v.problem(spec)
    assert prob.kred == spec.r * cp < spec.r * spec.s * padded_channels(spec.c, math)  # the point of the fold
    xf, wf = _folded(spec, xs, ws, cp, ld)
    nhwc = spec.layout == "nhwc"
    out = Output("y", prob.m, prob.n, 1 if nhwc else spec.p * spec.q, slab=prob.m * prob.n, epi=None)
    y, written = emulate_gemm(cfg, math, prob, dataclasses.replace(a, buf="xh"), b, {"a": xf, "b": wf}, out)
    shape = (spec.n, spec.p, spec.q, spec.k) if nhwc else spec.y_shape
    got, written = y.reshape(cfg.ks, -1).sum(0).reshape(shape), written.reshape(cfg.ks, -1).sum(0).reshape(shape)
    if nhwc:
        got, written = got.transpose(0, 3, 1, 2), written.transpose(0, 3, 1, 2)
    assert (written == cfg.ks).all()
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_stem_fold_applies_only_where_it_saves_reduction():
    half = get_variant("tc_stem_gemm_half")
    tf32 = get_variant("tc_stem_gemm_tf32")
    stem = ConvSpec.make(32, 3, 224, 224, 64, 7, 7, 2, 3, dtype="float16")
    assert half.applies(stem, NOMINAL_CUDA) is None
    assert half.problem(stem).kred == 7 * 24  # against 7 * 7 * 8 padded
    assert "chunks" in half.applies(ConvSpec.make(2, 8, 9, 9, 4, 3, 3, dtype="float16"), NOMINAL_CUDA)
    assert "not a stem" in half.applies(ConvSpec.make(2, 7, 13, 13, 4, 11, 11, dtype="float16"), NOMINAL_CUDA)
    assert "saves no padding" in tf32.applies(ConvSpec.make(2, 3, 9, 9, 4, 3, 3, 1, 1), NOMINAL_CUDA)
    assert "chunks" in tf32.applies(ConvSpec.make(2, 3, 9, 9, 4, 1, 1), NOMINAL_CUDA)  # S = 1
    f32 = ConvSpec.from_dict({**stem.to_dict(), "dtype": "float32"})
    assert tf32.rank(f32, NOMINAL_CUDA) < get_variant("tc_implicit_gemm_tf32").rank(f32, NOMINAL_CUDA)  # unmeasured
    assert half.rank(stem, NOMINAL_CUDA) > get_variant("tc_implicit_gemm_half").rank(stem, NOMINAL_CUDA)  # measured
    from convforge.kernels import ranked

    # the direct stem (tensorcore/sm90/stem.py, measured faster on every stem) first, then the fold
    assert [v.name for v in ranked("auto", stem, NOMINAL_CUDA)[:2]] == ["tc_stem_direct_half", "tc_stem_gemm_half"]


# -- 3xFP16's power-of-two scale, the CUDA function itself compiled for the host -----------------------
def _x3h_scale_on_host(values):
    """cf_x3h_scale as codegen/render.py writes it, compiled by the host C compiler (the CUDA bit casts
    spelled with memcpy), applied to ``values``: [(scale, inverse)]."""
    import re
    import shutil
    import subprocess
    import tempfile

    from convforge.codegen import render

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no host C compiler to run cf_x3h_scale on the CPU")
    fn = re.search(r"__device__ __forceinline__ float cf_x3h_scale\(.*?\n}", render._CUDA_TC, re.S)
    assert fn, "cf_x3h_scale not found in the sm_90 helpers"
    body = (fn.group(0).replace("__device__ __forceinline__", "static")
            .replace("__float_as_int(m)", "f2i(m)").replace("__int_as_float(", "i2f("))
    src = ("#include <stdio.h>\n#include <string.h>\n#include <stdlib.h>\n"
           "static int f2i(float f) { int i; memcpy(&i, &f, 4); return i; }\n"
           "static float i2f(int i) { float f; memcpy(&f, &i, 4); return f; }\n"
           "static int min(int a, int b) { return a < b ? a : b; }\n" + body +
           "\nint main(int argc, char** argv) { for (int j = 1; j < argc; ++j) { float m = strtof(argv[j], 0);"
           " printf(\"%a %a\\n\", (double)cf_x3h_scale(m, 0), (double)cf_x3h_scale(m, 1)); } return 0; }\n")
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/s.c", "w") as f:
            f.write(src)
        subprocess.run([cc, "-O1", "-o", f"{d}/s", f"{d}/s.c"], check=True, capture_output=True)
        out = subprocess.run([f"{d}/s", *map(repr, values)], check=True, capture_output=True, text=True).stdout
    return [tuple(map(float.fromhex, line.split())) for line in out.split("\n") if line]


def test_x3h_scale_puts_the_maximum_in_fp16s_top_binade():
    """Every finite maximum m > 0 (fp32's normal range, its subnormals, the edges) gets a power of two
    s with m s in [2^14, 2^15) where that is representable (s <= 2^126 else, m tiny), and its exact
    reciprocal; zero gets 2^126, infinity and NaN 1: their elements reach the products unscaled."""
    ms = [1.0, 0.75, 3.0e-7, 1.0e-30, 6.5e4, 3.4e38, 2.0**-126, 1.0e-40, 1.5 * 2.0**14, 2.0**15 - 1]
    got = _x3h_scale_on_host(ms + [0.0, float("inf"), float("nan")])
    for m, (sc, inv) in zip(ms, got, strict=False):
        assert sc * inv == 1.0 and np.log2(sc) == int(np.log2(sc)), (m, sc, inv)
        if m >= 2.0**-112:
            assert 2.0**14 <= m * sc < 2.0**15, (m, sc)
        else:
            assert sc == 2.0**126, (m, sc)
    assert got[-3][0] == 2.0**126 and got[-2] == (1.0, 1.0) and got[-1] == (1.0, 1.0)


# -- kr: the wgmma sums restarted every k step ---------------------------------------------------------------------
def _consumer_events(body: str) -> list[tuple[str, str]]:
    """The consumer's k loop and what follows it to the epilogue, as (event, register set) in order:
    ("z" / "acc", set) a wgmma starting / adding into a set, ("commit", ""), ("wait", n), ("add", set)."""
    loop = body[body.rindex("for (int kt = kbeg", 0, body.index("WGMMA_Z(")):]
    loop = loop[:loop.index("osc")] if "osc" in loop else loop
    out = []
    for m in re.finditer(r"(WGMMA_Z|WGMMA|WGMMA_COMMIT|WGMMA_WAIT)\(([^;]*)\);|f0_0 \+= (\w)0_0;", loop):
        if m.group(3):
            out.append(("add", m.group(3)))
        elif m.group(1) in ("WGMMA", "WGMMA_Z"):
            out.append(("z" if m.group(1) == "WGMMA_Z" else "acc", m.group(2).split(",")[5].strip()[0]))
        else:
            out.append(("commit", "") if m.group(1) == "WGMMA_COMMIT" else ("wait", m.group(2).split(",")[0]))
    return out


@pytest.mark.parametrize("math, cfg", [(X3F16, TileConfig(128, 128, 1, 3, 2, tm=1, kr=1)),
                                       (X3TF32, TileConfig(128, 64, 2, 2, 2, ks=2, kr=1)),
                                       (X3F16, TileConfig(64, 64, 1, 4, 1, kr=1))], ids=str)
def test_restart_adds_every_k_step_once_after_its_wgmma_is_done(math, cfg):
    """kr=1, modelled over three trips of the consumer's k loop and the tile's end: each k step is one
    wgmma group whose first product starts a register set from zero (scale-d 0) and whose others add
    into it; the sets alternate; a set is added into the FP32 sums exactly once, only after a
    wait_group has retired its group, and never written again before that add."""
    v = get_variant("tc_implicit_gemm_3xf16" if math is X3F16 else "tc_implicit_gemm_3xtf32")
    spec = ConvSpec.make(2, 64, 9, 9, 130, 3, 3, 1, 1)
    gemm = [k for k in v.plan(spec, cfg.params(), NOMINAL_CUDA).kernels if k.name.endswith("_gemm")][0]
    events = _consumer_events(gemm.body)
    loop_end = next(i for i, (e, n) in enumerate(events) if e == "wait" and n == "0")
    trips = events[:loop_end] * 3 + events[loop_end:]
    groups, pending, owner, added = [], [], {}, set()  # groups: set written; owner: set -> its last group
    for ev, arg in trips:
        if ev == "z":
            last = owner.get(arg)
            assert last is None or last in added, f"set {arg} restarted before group {last} was added"
            groups.append(arg)
            owner[arg] = len(groups) - 1
        elif ev == "acc":
            assert owner.get(arg) == len(groups) - 1, "a product added into another group's set"
        elif ev == "commit":
            pending.append(len(groups) - 1)
        elif ev == "wait":
            del pending[:max(len(pending) - int(arg), 0)]
        else:  # add
            g = owner.get(arg)
            if g is None:
                continue  # the tile's first k step adds the other set's zeros
            assert g not in pending, f"group {g} added before it retired"
            assert g not in added, f"group {g} added twice"
            added.add(g)
    steps = cfg.stage(math).a.steps
    assert len(groups) == 3 * steps and added == set(range(len(groups)))
    assert groups == ["d", "e"] * (len(groups) // 2)


def test_restart_tiles_and_defaults():
    """kr is a split-mode setting exclusive with pi; three sets of 64 accumulators need the TMA
    producer's registers (setmaxnreg 40 / 232); 3xFP16's default restarts on the layers of
    variants.x3h_restart and keeps the promotion elsewhere; the parameter round-trips."""
    prob = Problem(4096, 256, 2304)
    assert any("kr" in w for w in TileConfig(128, 128, tm=1, kr=1).problems(TF32))
    assert any("kr" in w for w in TileConfig(128, 128, tm=1, pi=2, kr=1).problems(X3F16))
    assert any("TMA" in w for w in TileConfig(128, 128, kr=1).problems(X3F16, prob))
    big = TileConfig(128, 128, st=3, tm=1, kr=1)
    assert not big.problems(X3F16, prob) and big.regs() == (tiles.TMA_PRODUCER_REGS, tiles.KR_CONSUMER_REGS)
    assert TileConfig.of(big.params()) == big and big.params()["kr"] == 1
    assert tiles.restarted(TileConfig(128, 128, st=3, tm=1, pi=2), X3F16, prob).kr == 1
    assert tiles.restarted(TileConfig(128, 128, st=3, pi=2), X3F16, prob).pi == 2  # cp.async: no room
    assert tiles.restarted(TileConfig(128, 128, st=3, tm=1, pi=2), X3TF32, prob).kr == 0
    v = get_variant("tc_implicit_gemm_3xf16")
    for spec, kr in ((ConvSpec.make(32, 1024, 6, 6, 1024, 1, 1), 1),
                     (ConvSpec.make(32, 256, 13, 13, 384, 3, 3, 1, 1), 1),
                     (ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1), 0),
                     (ConvSpec.make(32, 96, 54, 54, 96, 1, 1), 0)):
        assert v.default(spec, NOMINAL_CUDA).get("kr", 0) == kr, spec.short()
    assert any(p.get("kr") == 1 for p in v.space(ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1), NOMINAL_CUDA))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_gemms_of_at_most_16_columns_take_16_column_tiles(dtype):
    """tiles.narrow: a layer writing at most 16 channels (RGB out, a segmentation head, DCGAN's last
    transposed layer as its dgrad) takes 16-column tiles in half precision; 17 channels and TF32 keep the
    wave model's tile; the space offers 16 columns only to GEMMs of at most 32."""
    fwd, tf32 = get_variant("tc_implicit_gemm_half"), get_variant("tc_implicit_gemm_tf32")
    strided = get_variant("dgrad_tc_strided_half")

    def bn(variant, spec) -> int:
        assert variant.applies(spec, NOMINAL_CUDA) is None, variant.applies(spec, NOMINAL_CUDA)
        return int(variant.default(spec, NOMINAL_CUDA)["bn"])

    for k, layout in ((3, "nchw"), (2, "nhwc"), (16, "nhwc"), (13, "nchw")):
        assert bn(fwd, ConvSpec.make(8, 64, 64, 64, k, 3, 3, 1, 1, dtype=dtype, layout=layout)) == 16
    assert bn(fwd, ConvSpec.make(8, 64, 64, 64, 17, 3, 3, 1, 1, dtype=dtype, layout="nhwc")) >= 32
    assert bn(tf32, ConvSpec.make(8, 64, 64, 64, 3, 3, 3, 1, 1, layout="nhwc")) >= 32
    dcgan_last = ConvSpec.make(128, 3, 64, 64, 64, 4, 4, 2, 1, dtype=dtype, conv_pass="dgrad")
    assert bn(strided, dcgan_last) == 16
    narrow_space = {TileConfig.of(p).bn for p in fwd.space(ConvSpec.make(8, 64, 64, 64, 24, 3, 3, 1, 1, dtype=dtype),
                                                           NOMINAL_CUDA)}
    wide_space = {TileConfig.of(p).bn for p in fwd.space(ConvSpec.make(8, 64, 64, 64, 64, 3, 3, 1, 1, dtype=dtype),
                                                         NOMINAL_CUDA)}
    assert 16 in narrow_space and 16 not in wide_space


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_16_column_tiles_compile_without_spills(nvcc_ok, layout):
    """The plain store and the bias + residual + activation epilogue of a 16-column tile (a 3-channel head)."""
    fwd = get_variant("tc_implicit_gemm_half")
    spec = ConvSpec.make(8, 64, 128, 128, 3, 3, 3, 1, 1, dtype="float16", layout=layout)
    params = fwd.default(spec, NOMINAL_CUDA)
    assert TileConfig.of(params).bn == 16
    for epi in (Epilogue(), Epilogue(bias=True, residual=True, silu=True)):
        for info in ptxas_report(fwd.plan(spec, params, NOMINAL_CUDA, epi).source("cuda")):
            assert info.spill_stores == 0 and info.spill_loads == 0, info


IN_PLACE_FILTERS = [  # (variant, spec, dtype): 16-bit 1x1 layers whose K x C filters the GEMM reads as they lie
    ("tc_implicit_gemm_half", ConvSpec.make(32, 64, 56, 56, 256, 1, 1, layout="nhwc"), "float16"),  # TMA
    ("tc_implicit_gemm_half", ConvSpec.make(32, 1024, 14, 14, 2048, 1, 1, 2, layout="nhwc"), "bfloat16"),
    ("tc_implicit_gemm_half", ConvSpec.make(16, 24, 28, 28, 144, 1, 1, layout="nhwc"), "float16"),  # cp.async tail
    ("tc_implicit_gemm_half", ConvSpec.make(5, 40, 13, 11, 12, 1, 1, layout="nchw"), "float16"),
    ("dgrad_tc_implicit_gemm_half", ConvSpec.make(32, 256, 28, 28, 64, 1, 1, conv_pass="dgrad", layout="nhwc"),
     "float16"),
]


def test_1x1_half_filters_read_in_place_without_a_filter_step(nvcc_ok):
    """A 16-bit 1x1 layer of whole 16-byte channel chunks: no ``tc_w_krsc`` step and no packed-filter
    workspace, B = the K x C filters themselves (row length C, not padded: copies past C zero-fill); the
    stride-1 dgrad keeps its rotation only. Layers that still need the step keep it: 3x3, C not whole
    chunks, TF32 (the step rounds), the packed grouped GEMM (block-diagonal filters). Every in-place plan
    compiles without spills."""
    labels, sources = [], []
    for name, spec, dtype in IN_PLACE_FILTERS:
        v = get_variant(name)
        spec = dataclasses.replace(spec, dtype=dtype)
        plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
        names = [k.name for k in plan.kernels]
        assert "tc_w_krsc" not in names, (name, names)
        assert ("dgrad_rotate" in names) == name.startswith("dgrad"), (name, names)
        assert not any(n.endswith("wt") for n, _ in plan.workspace), plan.workspace
        gemm = plan.steps[-1]
        assert ("w_rot" if name.startswith("dgrad") else "w") in gemm.args, gemm.args
        labels.append(f"{name} {spec.short()}")
        sources.append(plan.source("cuda"))
    kept = [("tc_implicit_gemm_half", ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1, layout="nhwc"), "float16"),
            ("tc_implicit_gemm_half", ConvSpec.make(32, 12, 28, 28, 64, 1, 1, layout="nhwc"), "float16"),
            ("tc_implicit_gemm_tf32", ConvSpec.make(32, 64, 56, 56, 256, 1, 1, layout="nhwc"), "float32"),
            ("tc_grouped_packed_half", ConvSpec.make(32, 128, 28, 28, 128, 1, 1, groups=32, layout="nhwc"),
             "float16")]
    for name, spec, dtype in kept:
        v = get_variant(name)
        spec = dataclasses.replace(spec, dtype=dtype)
        plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
        assert "tc_w_krsc" in [k.name for k in plan.kernels], (name, spec.short())
    for label, infos in zip(labels, ptxas_reports(sources), strict=True):
        _no_spills(label, infos)


def test_a_residual_takes_the_tile_that_stages_halves():
    """``epilogue_params``: a residual comes by ``rs=1`` (prefetched into registers before the main loop): on
    the ping-pong tile (128 accumulators a thread, no room for the residual's 64 registers) it takes the same
    tile without ping-pong (64 + 32); a split-K slab keeps its parameters; no residual keeps the parameters;
    the dgrad adapter asks its forward."""
    half = get_variant("tc_implicit_gemm_half")
    spec = ConvSpec.make(128, 64, 56, 56, 256, 1, 1, layout="nhwc", dtype="float16")
    prm = half.default(spec, NOMINAL_CUDA)
    cfg = TileConfig.of(prm)
    assert cfg.pp == 1 and cfg.wm * cfg.bn // 2 + epilogue.rs_registers(cfg.wm, cfg.bn) > epilogue.RS_REGS
    assert half.epilogue_params(spec, prm, Epilogue(bias=True)) == prm
    staged = TileConfig.of(half.epilogue_params(spec, prm, Epilogue(residual=True)))
    assert staged == dataclasses.replace(cfg, pp=0, rs=1)
    deep = ConvSpec.make(128, 512, 28, 28, 256, 1, 1, layout="nhwc", dtype="float16")
    split = half.default(deep, NOMINAL_CUDA).replace(ks=2)
    assert half.epilogue_params(deep, split, Epilogue(residual=True)) == split
    dgrad = get_variant("dgrad_tc_implicit_gemm_half")
    ds = ConvSpec.make(128, 256, 56, 56, 64, 1, 1, conv_pass="dgrad", layout="nhwc", dtype="float16")
    dprm = dgrad.default(ds, NOMINAL_CUDA)
    assert TileConfig.of(dgrad.epilogue_params(ds, dprm, Epilogue(residual=True))) == dataclasses.replace(
        TileConfig.of(dprm), pp=0, rs=1)


def test_heuristic_choice_prefetches_a_residual():
    """dispatch's heuristic choice (no tuning) of a 16-bit channels-last forward with a residual in its
    epilogue takes the variant's ``epilogue_params`` (rs=1, the tile without ping-pong), as the inference
    blocks' conv3 runs; without a residual, or in float32, the default stays."""
    from convforge import dispatch

    class FakeBackend:
        name = "cuda"
        device = NOMINAL_CUDA

    be = FakeBackend()
    spec = ConvSpec.make(128, 64, 56, 56, 256, 1, 1, layout="nhwc", dtype="float16")
    plain = dispatch.choose(spec, be, Epilogue(bias=True, relu=True))
    res = dispatch.choose(spec, be, Epilogue(bias=True, residual=True, relu=True))
    assert plain.variant is res.variant and plain.params.get("pp") == 1
    assert TileConfig.of(res.params) == dataclasses.replace(TileConfig.of(plain.params), pp=0, rs=1)
    f32 = dataclasses.replace(spec, dtype="float32")
    a, b = (dispatch.choose(f32, be, e) for e in (Epilogue(), Epilogue(residual=True)))
    assert a.params == b.params and not b.params.get("rs")


@pytest.mark.parametrize("wm, bn", [(1, 64), (1, 128), (2, 128), (1, 192), (2, 256)])
def test_staged_residual_lands_on_its_pairs_words(wm, bn):
    """``rs=1``: the residual's chunk loaded as the store phase reads it (h8_lets, the swizzled octet slot of
    ``_h8_stage_residual``) puts every element on the word h8_slot gives its accumulator pair: each pair reads
    its own row's and columns' residual, and every word of the chunk is loaded once."""
    for ch, words in enumerate(_h8_map(wm, bn)):
        staged = {}
        for ct, item in itertools.product(range(128), range(h8_items(wm))):
            env = bind(h8_lets(item), {"ct": ct})
            er, eo = env[f"er{item}"], env[f"eo{item}"]
            for q in range(4):
                slot = er * 32 + ((eo ^ (er & 7)) << 2) + q
                assert slot not in staged, "a word loaded twice"
                staged[slot] = (er, H8 * ch + 8 * eo + 2 * q)
        assert set(staged) == set(words)
        for slot, pair in words.items():
            assert staged[slot] == pair, (ch, slot, staged[slot], pair)


def test_staged_residual_plans_compile_and_refuse_by_name(nvcc_ok):
    """``rs=1`` on the tile of two consumers sharing each tile (64 accumulators a thread and the residual's 32
    registers), forward (residual + ReLU, bias + residual) and dgrad: no spills, the residual's 16-byte loads in
    the SASS; refused by name without a residual, with eh=0 and on the ping-pong tile (128 accumulators)."""
    half, dgrad = get_variant("tc_implicit_gemm_half"), get_variant("dgrad_tc_implicit_gemm_half")
    fs = ConvSpec.make(32, 64, 56, 56, 256, 1, 1, layout="nhwc", dtype="bfloat16")
    ds = ConvSpec.make(32, 512, 28, 28, 128, 1, 1, conv_pass="dgrad", layout="nhwc", dtype="float16")
    fp = half.default(fs, NOMINAL_CUDA).replace(rs=1, pp=0)
    dp = dgrad.default(ds, NOMINAL_CUDA).replace(rs=1, pp=0)
    plans = [half.plan(fs, fp, NOMINAL_CUDA, Epilogue(residual=True, relu=True)),
             half.plan(fs, fp, NOMINAL_CUDA, Epilogue(bias=True, residual=True)),
             dgrad.plan(ds, dp, NOMINAL_CUDA, Epilogue(residual=True))]
    for plan, (infos, sass) in zip(plans, sass_reports([p.source("cuda") for p in plans]), strict=True):
        _no_spills(f"rs=1 {plan.variant} {plan.params.short()}", infos)
        assert "LDG.E.128" in sass, plan.params.short()
    with pytest.raises(ValueError, match="rs=1 stages a residual"):
        half.plan(fs, fp, NOMINAL_CUDA, Epilogue())
    with pytest.raises(ValueError, match="rs"):
        half.plan(fs, fp.replace(eh=0), NOMINAL_CUDA, Epilogue(residual=True))
    with pytest.raises(ValueError, match="registers a thread through the main loop"):
        half.plan(fs, fp.replace(pp=1), NOMINAL_CUDA, Epilogue(residual=True))
