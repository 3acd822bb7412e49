"""The Hopper wgmma 1x1 GEMM without a GPU: the shared-memory layouts the copies write against a
model of how the hardware reads a matrix descriptor (PTX ISA canonical K-major layouts), the
accumulator layout, a NumPy emulation of one block's slices through those layouts, nvcc sm_90a
compiles (no spills, one HGMMA per k step), the OpenCL refusal, where the variant applies; and the
GPU tier against float64.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.backends.base import weight_steps
from convforge.codegen.render import ARCH_SPECIFIC_MARK, render
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm90.smem import SBO
from convforge.kernels.tensorcore.sm90.wgmma_1x1 import (
    ACC,
    BK,
    C_PAD,
    LBO,
    ROW_BYTES,
    XDirect,
    acc_coords,
    chunk_offset,
    copy_coords,
    desc_high,
    direct_coords,
    direct_units,
    k_step_bytes,
    model_address,
    stage_bytes,
    staged_c_bytes,
    staged_offset,
    wg_default,
    wg_ok,
    x_column,
)
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue
from convforge.spec import ConvSpec
from helpers import ptxas_reports, sass_reports

NAME = "gemm1x1_wgmma_tf32"
LAYER = ConvSpec.make(32, 1024, 14, 14, 256, 1, 1)  # GEMM 256 x 6272 x 1024 (ResNet-50 stage 3)
ODD = [ConvSpec.make(1, 7, 13, 13, 5, 1, 1), ConvSpec.make(3, 70, 11, 13, 67, 1, 1),
       ConvSpec.make(2, 33, 15, 17, 130, 1, 1, 2, (1, 0, 0, 2)), ConvSpec.make(1, 64, 7, 7, 300, 1, 1)]
POINTS = [Params(bn=128, wg=2, st=4, sw=128), Params(bn=256, wg=1, st=3, sw=128),
          Params(bn=64, wg=1, st=6, sw=0), Params(bn=192, wg=2, st=3, sw=0), Params(bn=96, wg=1, st=5, sw=128)]
DIRECT = [Params(bn=128, wg=2, st=4, sw=128, xl="direct", ep="smem"), Params(bn=256, wg=1, st=4, sw=128, xl="direct"),
          Params(bn=64, wg=1, st=3, sw=128, xl="direct", ep="smem"), Params(bn=192, wg=1, st=5, sw=128, xl="direct"),
          Params(bn=256, wg=2, st=3, sw=128, xl="direct", ep="smem")]
STAGED = [Params(bn=128, wg=2, st=4, sw=128, ep="smem"), Params(bn=96, wg=1, st=3, sw=128, ep="smem")]


def ev(expr: str, **env: int) -> int:
    return int(eval(expr.replace("/", "//"), {}, env))  # noqa: S307


def desc_for(start: int, sw: int) -> int:
    """The descriptor the generated code builds for a tile at shared byte address ``start``."""
    return desc_high(sw) | (start >> 4)


@pytest.mark.parametrize("sw", [0, 128])
def test_descriptor_fields(sw):
    d = desc_for(0x2400, sw)
    assert d & 0x3FFF == 0x240 and (d >> 14) & 3 == 0
    assert ((d >> 16) & 0x3FFF) << 4 == LBO[sw] and ((d >> 32) & 0x3FFF) << 4 == SBO == 1024
    assert (d >> 49) & 7 == 0 and d >> 62 == (1 if sw == 128 else 0)


@pytest.mark.parametrize("sw, rows", itertools.product([0, 128], [64, 128, 256]))
def test_hardware_reads_what_the_copies_wrote(sw, rows):
    """For every k step: element (r, k) as the hardware reads it through the descriptor (start
    advanced by k_step_bytes) is where the copies put (r, 8 kk + k)."""
    for base, kk in itertools.product((0, 1024 * 37), range(BK // 8)):
        d = desc_for(base, sw) + (k_step_bytes(sw, kk) >> 4)
        for r, k in itertools.product(range(rows), range(8)):
            c = (8 * kk + k) // 4
            wrote = base + ev(chunk_offset(sw, "r", "c"), r=r, c=c) + 4 * (k % 4)
            assert model_address(d, r, k) == wrote, (sw, r, kk, k)


@pytest.mark.parametrize("sw, threads, rows", itertools.product([0, 128], [128, 256], [64, 128, 192, 256]))
def test_copies_cover_the_tile_once_conflict_free(sw, threads, rows):
    """Every (row, chunk) once; copy it of a thread is row0 + it * threads / 8 of the same chunk
    (what the generator's constant steps assume); each quarter-warp stores 128 distinct bytes."""
    if rows * 8 % threads:
        pytest.skip("not a valid tile for this block")
    seen = set()
    for tid in range(threads):
        r0, c0 = (ev(e, q=tid) for e in copy_coords(sw, "q"))
        for it in range(rows * 8 // threads):
            r, c = (ev(e, q=tid + it * threads) for e in copy_coords(sw, "q"))
            assert (r, c) == (r0 + it * threads // 8, c0)
            seen.add((r, c))
    assert seen == set(itertools.product(range(rows), range(8)))
    for q0 in range(0, rows * 8, 8):
        offs = [ev(chunk_offset(sw, "r", "c"), r=r, c=c) for r, c in
                ((ev(e, q=q) for e in copy_coords(sw, "q")) for q in range(q0, q0 + 8))]
        assert len({o % 128 for o in offs}) == 8, f"bank conflict in copies {q0}.."


def doc_acc(w: int, lane: int, i: int) -> tuple[int, int]:
    """PTX ISA, wgmma .m64nNk8 .f32 D fragment: warp w owns rows 16w..16w+15; for register i, row
    groupID (+8 when i % 4 >= 2), column 8 (i // 4) + 2 threadID_in_group + (i % 2)."""
    return 16 * w + (lane >> 2) + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2


@pytest.mark.parametrize("n", [8, 64, 256])
def test_accumulator_layout(n):
    seen = np.zeros((64, n), int)
    for w, lane, i in itertools.product(range(4), range(32), range(n // 2)):
        got = acc_coords(w, lane, i)
        assert got == doc_acc(w, lane, i)
        seen[got] += 1
    assert (seen == 1).all()
    assert len(ACC) == 4


@pytest.mark.parametrize("p", POINTS, ids=lambda p: p.short())
def test_emulated_block_matches_numpy(p):
    """One block, two slices, through the generator's layouts: copies into a byte-addressed shared
    array (stage by stage), operands read back through the descriptors of each warpgroup and k
    step, accumulators placed by the documented layout: equals A . B^T."""
    rng = np.random.default_rng(0)
    bm, threads = 64 * p.wg, 128 * p.wg
    a, b = rng.standard_normal((bm, 2 * BK)), rng.standard_normal((p.bn, 2 * BK))
    smem = np.full(p.st * stage_bytes(p) // 4, np.nan)
    acc = np.zeros((bm, p.bn))
    for kt in range(2):
        stage = kt % p.st * stage_bytes(p)
        for src, rows, base in ((a, bm, 0), (b, p.bn, bm * ROW_BYTES)):
            for q in range(rows * 8):
                r, c = (ev(e, q=q) for e in copy_coords(p.sw, "q"))
                at = (stage + base + ev(chunk_offset(p.sw, "r", "c"), r=r, c=c)) // 4
                smem[at:at + 4] = src[r, kt * BK + 4 * c: kt * BK + 4 * c + 4]
        for wgi, kk in itertools.product(range(p.wg), range(BK // 8)):
            off = k_step_bytes(p.sw, kk) >> 4
            da = desc_for(stage + wgi * 64 * ROW_BYTES, p.sw) + off
            db = desc_for(stage + bm * ROW_BYTES, p.sw) + off
            ta = np.array([[smem[model_address(da, r, k) // 4] for k in range(8)] for r in range(64)])
            tb = np.array([[smem[model_address(db, r, k) // 4] for k in range(8)] for r in range(p.bn)])
            acc[64 * wgi:64 * wgi + 64] += ta @ tb.T
    np.testing.assert_allclose(acc, a @ b.T, rtol=1e-12, atol=1e-12)
    assert threads == 128 * p.wg


def direct_threads(p):
    """(warp, lane, unit, B-tile row of the unit's pixel 0, channel quad) of every thread's units."""
    nwarps = 4 * p.wg
    for w, lane, u in itertools.product(range(nwarps), range(32), range(direct_units(p))):
        row, cq = (ev(e, warp=w, lane=lane) for e in direct_coords(nwarps, u))
        yield w, lane, u, row, cq


@pytest.mark.parametrize("p", DIRECT, ids=lambda p: p.short())
def test_direct_units_cover_the_tile_loads_coalesced_stores_conflict_free(p):
    """xl=direct: the units (4 pixels x 4 channels) cover the B tile once; each warp-wide float4
    load (unit u, channel j) reads 4 channels x 32 consecutive pixels from a multiple of 32
    (4 whole 128-byte lines); each 16-byte shared store (unit u, pixel i), 8 lanes at a time,
    hits 8 different 16-byte bank groups (the generator's own offset expressions)."""
    seen = []
    loads, stores = {}, {}
    for w, lane, u, row, cq in direct_threads(p):
        seen += [(row + i, cq) for i in range(4)]
        loads.setdefault((w, u, cq), []).append(row)
        for i in range(4):
            off = ev(chunk_offset(128, "r", "c"), r=row + i, c=cq)
            assert off == ev(chunk_offset(128, f"{row} + {i}", f"{cq}"))
            stores.setdefault((w, u, i, lane // 8), []).append(off % 128)
    assert sorted(seen) == sorted(itertools.product(range(p.bn), range(8)))
    assert len(seen) == len(set(seen))
    for (w, u, cq), rows in loads.items():
        assert len(rows) == 8 and sorted(rows) == list(range(min(rows), min(rows) + 32, 4)), (w, u, cq)
        assert min(rows) % 32 == 0
    assert {len({*cqs}) for cqs in ({cq for (w2, u2, cq) in loads if (w2, u2) == (w, u)}
                                    for (w, u, _) in loads)} == {4}
    for key, offs in stores.items():
        assert sorted(offs) == list(range(0, 128, 16)), f"bank conflict in store {key}: {offs}"


def direct_map(p, xd: XDirect, n0: int) -> list[tuple[int, int, int]]:
    """(x offset of channel 0, channel quad, shared float offset of channel 0) of every pixel
    of every unit of the block at column n0, from the generator's expressions."""
    vec = xd.hw % 4 == 0
    out = []
    for _, _, _, row, cq in direct_threads(p):
        col0 = ev(x_column(xd, "col", vec), col=n0 + row) if vec else None
        for i in range(4):
            src = col0 + i if vec else ev(x_column(xd, "col", vec), col=n0 + row + i)
            out.append((src, cq, ev(chunk_offset(128, "r", "c"), r=row + i, c=cq) // 4))
    return out


def emulate_direct_b(p, x, mapping, kt: int, c: int) -> np.ndarray:
    """The B tile (bn x 32) as the direct path's threads build it in shared memory (clamped
    column offsets, channel guard, swizzled store offsets); NaN where nothing was written."""
    flat, hw = x.ravel(), x.shape[2]
    smem = np.full(p.bn * BK, np.nan)
    for src, cq, at in mapping:
        for j in range(4):
            ch = kt * BK + 4 * cq + j
            assert np.isnan(smem[at + j])
            smem[at + j] = flat[src + ch * hw] if ch < c else 0.0
    return smem


@pytest.mark.parametrize("p", DIRECT, ids=lambda p: p.short())
@pytest.mark.parametrize("shape", [(3, 70, 143), (2, 36, 120), (1, 64, 196)], ids=str)
def test_emulated_direct_block_matches_numpy(p, shape):
    """Blocks of the direct path (first, middle, last), every slice and block column: x (N, C, H*W) through the
    threads' loads and stores into the swizzled tile, read back by wgmma's descriptor model,
    times A: equals W . X[:, block columns] on every valid column (H*W not a multiple of 4 takes
    the scalar loads; C not a multiple of 32 the channel guard; the last block the clamping)."""
    rng = np.random.default_rng(1)
    n_img, c, hw = shape
    x = rng.standard_normal(shape)
    npix, cp = n_img * hw, -(-c // BK) * BK
    cols = x.transpose(0, 2, 1).reshape(npix, c)  # B: column j = (image j // hw, pixel j % hw)
    a = rng.standard_normal((64, cp))
    a[:, c:] = 0.0  # wt is zero past C
    blocks = range(0, npix, p.bn)
    for n0 in dict.fromkeys([blocks[0], blocks[len(blocks) // 2], blocks[-1]]):  # first, middle, the tail
        acc = np.zeros((64, p.bn))
        mapping = direct_map(p, XDirect(c, hw, npix), n0)
        for kt in range(cp // BK):
            smem = emulate_direct_b(p, x, mapping, kt, c)
            for kk in range(BK // 8):
                db = desc_for(0, 128) + (k_step_bytes(128, kk) >> 4)
                tb = np.array([[smem[model_address(db, r, k) // 4] for k in range(8)] for r in range(p.bn)])
                acc += a[:, kt * BK + 8 * kk: kt * BK + 8 * kk + 8] @ tb.T
        valid = min(p.bn, npix - n0)
        np.testing.assert_allclose(acc[:, :valid], a[:, :c] @ cols[n0:n0 + valid].T, rtol=1e-10, atol=1e-10)
        assert np.isfinite(acc).all()


@pytest.mark.parametrize("p", DIRECT + POINTS[:2], ids=lambda p: p.short())
def test_staged_epilogue_tile_and_banks(p):
    """ep=smem: the accumulators' float2 writes (generator's offsets) put every C element of the
    block once where the read-out (row e / (bn/4), float4 q) expects it, each half-warp's 16
    float2 writes hit 32 different banks, and the tile fits in the stages it reuses."""
    ld, bm = p.bn + C_PAD, 64 * p.wg
    assert staged_c_bytes(p) == 4 * bm * ld <= p.st * stage_bytes(p)
    tile = {}
    for w, lane in itertools.product(range(4 * p.wg), range(32)):
        env = {"wgi": w // 4, "wq": w % 4, "g": lane >> 2, "t": lane & 3}
        for j, h in itertools.product(range(p.bn // 8), range(2)):
            off = ev(staged_offset(ld, j, h), **env)
            for k in range(2):
                row, col = acc_coords(w % 4, lane, 4 * j + 2 * h + k)
                assert (off + k) not in tile
                tile[off + k] = (64 * (w // 4) + row, col)
    quads = p.bn // 4  # read-out: float4 e is row e // quads, columns 4 (e % quads) ..
    readout = {(e // quads) * ld + 4 * (e % quads) + k: (e // quads, 4 * (e % quads) + k)
               for e in range(bm * quads) for k in range(4)}
    assert readout == tile
    for w, j, h, half in itertools.product(range(4 * p.wg), range(p.bn // 8), range(2), range(2)):
        banks = []
        for lane in range(16 * half, 16 * half + 16):
            off = ev(staged_offset(ld, j, h), wgi=w // 4, wq=w % 4, g=lane >> 2, t=lane & 3)
            banks += [off % 32, (off + 1) % 32]
        assert sorted(banks) == list(range(32)), (w, j, h, half)


def test_space_is_valid_and_default_first():
    v = get_variant(NAME)
    space = v.space(LAYER, NOMINAL_CUDA)
    assert space[0] == v.default(LAYER, NOMINAL_CUDA) == Params(bn=128, wg=2, st=4, sw=128, xl="direct", ep="smem")
    assert all(wg_ok(p) for p in space) and len(space) == len(set(space))
    assert {p.xl for p in space} == {"direct", "transposed"} and {p.ep for p in space} == {"smem", "regs"}
    strided = ODD[2]
    assert {p.xl for p in v.space(strided, NOMINAL_CUDA)} == {"transposed"}
    assert v.default(strided, NOMINAL_CUDA).xl == "transposed"
    with pytest.raises(ValueError, match="xl=direct needs stride 1 and no padding"):
        v.plan(strided, DIRECT[0], NOMINAL_CUDA)
    assert not wg_ok(Params(bn=64, wg=2, st=4, sw=128, xl="direct")), "half a unit per thread"
    assert not wg_ok(Params(bn=128, wg=1, st=4, sw=0, xl="direct")), "direct stores swizzled tiles only"
    assert wg_ok(Params(bn=128, wg=2, st=4, sw=128)), "points stored before xl read the transposed copy"
    assert not wg_ok(Params(bn=256, wg=2, st=6, sw=128)), "over 227 KB of shared memory"
    with pytest.raises(ValueError, match="unknown parameters"):
        v.plan(LAYER, Params(bn=128, wg=2, st=4, sw=128, bm=64), NOMINAL_CUDA)


def test_applies_only_on_sm90():
    v = get_variant(NAME)
    assert v.applies(LAYER, NOMINAL_CUDA) is None
    assert v.precision == "relaxed" and not v.exact
    assert "9.0" in v.applies(LAYER, DeviceInfo("cuda", "A100", cc=(8, 0)))
    assert "9.0" in v.applies(LAYER, DeviceInfo("cuda", "B200", cc=(10, 0)))
    assert v.applies(LAYER, DeviceInfo("opencl", "pocl")) is not None
    assert v.applies(ConvSpec.make(1, 8, 9, 9, 8, 3, 3), NOMINAL_CUDA) == "only 1x1 filters"


def test_offered_in_the_relaxed_class_only_and_ranked():
    """auto in the relaxed class puts wgmma before the mma.sync 1x1 GEMM where x is read in
    place (xl=direct: 256->64 @56², 64->256 @56², no transpose) or C, K >= 256, and after it on
    a strided 1x1 with C < 256 (the transpose pass stays there); fp32 never offers it."""
    from convforge.kernels import select

    def names(spec, precision):
        return [v.name for v in select("auto", spec, NOMINAL_CUDA, precision=precision)]

    for spec in (LAYER, ConvSpec.make(32, 256, 56, 56, 64, 1, 1), ConvSpec.make(32, 64, 56, 56, 256, 1, 1)):
        got = names(spec, "relaxed")
        assert got.index(NAME) < got.index("gemm1x1_tf32"), spec.short()
    strided = names(ConvSpec.make(32, 128, 28, 28, 512, 1, 1, 2), "relaxed")
    assert strided.index(NAME) > strided.index("gemm1x1_tf32")
    assert NAME not in names(LAYER, "fp32")
    assert all(p.sw == 128 for p in get_variant(NAME).space(LAYER, NOMINAL_CUDA))


@pytest.mark.parametrize("layer, first", [
    ((5, 4096, 1, 1, 4096, 1, 1), "gemv_stream"),  # Boda's AlexNet fc7 at N5: a weight stream
    ((5, 4096, 1, 1, 1000, 1, 1), "gemv_stream"),  # fc8
    ((5, 256, 6, 6, 4096, 6, 6), "gemv_stream"),  # fc6, the full-window form
    ((2, 1024, 2, 2, 512, 1, 1), "gemm1x1_splitk"),  # 8 pixels of 2x2 maps: not fully connected
    ((32, 4096, 1, 1, 4096, 1, 1), "tc_implicit_gemm_tf32"),  # 32 pixels: a wgmma tile pays (the generator's)
    ((1, 1024, 7, 7, 256, 1, 1), "tc_implicit_gemm_tf32"),  # batch 1, 49 pixels
    ((32, 256, 56, 56, 64, 1, 1), NAME),  # C >= K on 56 x 56: x read in place leads (wgmma_1x1_leads)
    ((32, 64, 56, 56, 256, 1, 1), "tc_implicit_gemm_tf32"),  # K > C
])
def test_a_handful_of_pixels_goes_to_the_split_k_gemms(layer, first):
    """Relaxed class on sm_90: float32 layers of at most FEW_PIXELS output pixels rank the wgmma
    paths below the CUDA-core split-K GEMMs (isa.few_pixels), and fully-connected ones below the
    weight stream (gemv_stream); wider ones keep them first, gemm1x1_wgmma_tf32 where it measured
    ahead of the generator (variants.wgmma_1x1_leads), the generator elsewhere."""
    from convforge.kernels import most_specialised

    spec = ConvSpec.make(*layer)
    assert most_specialised("auto", spec, NOMINAL_CUDA, precision="relaxed")[0].name == first


def test_opencl_refuses_with_reason():
    plan = get_variant(NAME).plan(LAYER, Params(bn=128, wg=2, st=4, sw=128), NOMINAL_CUDA)
    with pytest.raises(ValueError, match="wgmma"):
        render(list(plan.kernels), "opencl")
    from convforge.codegen.render import OpenCLRenderer

    with pytest.raises(ValueError, match="sm_90a"):
        OpenCLRenderer().expand("WGMMA_FENCE();")


def test_plan_steps_and_weight_step():
    """Weights rounded once per weight version (the only filter step), x transposed per call,
    the marker that asks for sm_90a on the GEMM's source."""
    spec = ODD[2]
    plan = get_variant(NAME).plan(spec, Params(bn=64, wg=1, st=3, sw=0), NOMINAL_CUDA,
                                  Epilogue(bias=True, relu=True))
    steps, derived = weight_steps(plan)
    assert steps == frozenset({0}) and derived == ("wt",)
    assert ARCH_SPECIFIC_MARK in plan.source("cuda")
    assert (spec.k, spec.n * spec.p * spec.q) == (130, 160)
    assert dict(plan.workspace) == {"wt": 4 * 192 * 64, "xt": 4 * 192 * 64}  # whole tiles, C to 64


def test_direct_plan_has_no_transpose():
    """xl=direct: the weight step and the GEMM only, the GEMM reads x, no xt workspace."""
    spec = ODD[1]
    plan = get_variant(NAME).plan(spec, DIRECT[0], NOMINAL_CUDA, Epilogue(bias=True))
    assert [s.args[:2] for s in plan.steps] == [("w", "wt"), ("wt", "x")]
    assert dict(plan.workspace) == {"wt": 4 * 128 * 96}
    assert weight_steps(plan) == (frozenset({0}), ("wt",))
    assert "_xt" not in plan.source("cuda") and "CVT_TF32(xr0_3.w)" in plan.kernels[-1].body  # rounded here


@pytest.mark.parametrize("n", [1, 169, 429, 6272, 100352])
def test_workspace_holds_every_row_the_copies_read(n):
    """The last block's copies read rows up to its tile's end (unclamped): the workspaces hold
    them for every point (bn 192 on 100352 columns reads 64 rows past 392 x 256)."""
    spec = ConvSpec.make(n, 40, 1, 1, 67, 1, 1)
    v = get_variant(NAME)
    for p in v.space(spec, NOMINAL_CUDA):
        plan = v.plan(spec, p, NOMINAL_CUDA)
        gx, gy, _ = plan.steps[-1].grid
        cp = 64
        ws = dict(plan.workspace)
        assert ws.get("xt", 4 * gx * p.bn * cp) >= 4 * gx * p.bn * cp, p.short()
        assert ws["wt"] >= 4 * gy * 64 * p.wg * cp and ("xt" in ws) == (p.xl == "transposed"), p.short()
        assert v.workspace_bytes(spec, p) == sum(ws.values())


def test_compile_options_arch_specific():
    pytest.importorskip("cupy", reason="the CUDA back-end module needs CuPy")
    from convforge.backends.cuda import CudaBackend

    be = object.__new__(CudaBackend)
    be.arch = "sm_90"
    assert "--gpu-architecture=sm_90a" in be.compile_options(True)
    assert "--gpu-architecture=sm_90" in be.compile_options()


CASES = ([(LAYER, p) for p in POINTS + DIRECT + STAGED] + [(s, Params(bn=128, wg=2, st=4, sw=128)) for s in ODD[2:]]
         + [(ConvSpec.make(32, 64, 56, 56, 256, 1, 1), DIRECT[1]), (ODD[1], DIRECT[4]), (ODD[3], DIRECT[0])])


def test_nvcc_sm90a_no_spills(nvcc_ok):
    """Every CASES point, nvcc -arch=sm_90a (asked for by the source; one nvcc run for all,
    helpers.sass_reports): no spill, the rolled main loop holds bk / 8 = 4 HGMMA of m64n{bn}k8 TF32
    (no serialisation fallback, no local memory); xl=direct: the GEMM's only global loads are x's, 16
    bytes wide where H*W allows it, 4 per unit and slice (two slices before the loop, one in it), and
    its 16-byte shared stores are the B tile's."""
    from convforge.codegen.nvcc import cuobjdump_path

    sources = []
    for spec, p in CASES:
        epi = Epilogue(relu=True) if p.get("xl") == "direct" else Epilogue(bias=True, relu=True)  # LDG: x only
        sources.append(get_variant(NAME).plan(spec, p, NOMINAL_CUDA, epi).source("cuda"))
    if cuobjdump_path() is None:
        reports = [(infos, None) for infos in ptxas_reports(sources)]
    else:
        reports = list(sass_reports(sources))
    for (spec, p), (infos, sass) in zip(CASES, reports, strict=True):
        label = f"{spec.short()} [{p.short()}]"
        assert infos, label
        if sass is not None:
            ops = [ln.split()[1] for ln in sass.splitlines() if "HGMMA" in ln]
            assert len(ops) == 4 and set(ops) == {f"HGMMA.64x{p.bn}x8.F32.TF32"}, (label, ops)
            assert "LDL" not in sass and "STL" not in sass, label
            gemm = sass.split("Function : ")
            gemm_sass = next(f for f in gemm if f.startswith(f"{NAME}_gemm"))
            if p.get("xl") == "direct":  # x: 4 loads per unit and slice
                ld = [ln for ln in gemm_sass.splitlines() if re.search(r"\bLDG\.", ln)]
                wide = spec.h * spec.w % 4 == 0
                nk = -(-spec.c // BK)
                copies = min(nk, 2) + (nk > 2)  # slices 0, 1 before the loop; kt + 2 in it (dead when nk <= 2)
                assert len(ld) == copies * 4 * direct_units(p) * (1 if wide else 4), (label, len(ld), ld[:3])
                assert all(".128" in ln for ln in ld) == wide, (label, ld[:3])
                assert gemm_sass.count("STS.128") == (1 + (nk > 1)) * 4 * direct_units(p), label
                assert "_xt" not in sass, f"{label}: no transpose kernel left"
        for info in infos:
            assert info.spill_stores == 0 and info.spill_loads == 0, (label, info)
        print(p.short(), [(i.kernel, i.registers) for i in infos])


# -- GPU tier -----------------------------------------------------------------------------------
GPU_SPECS = ODD + [ConvSpec.make(2, 1024, 14, 14, 256, 1, 1), ConvSpec.make(1, 256, 56, 56, 64, 1, 1),
                   ConvSpec.make(2, 512, 7, 7, 2048, 1, 1), ConvSpec.make(2, 36, 12, 10, 67, 1, 1),
                   ConvSpec.make(1, 64, 56, 56, 256, 1, 1)]


@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.key())
def test_gpu_wgmma_against_float64(cuda, spec):
    """The first few space points, POINTS and (stride 1, no padding) the xl=direct points, with
    bias + ReLU on the default, NaN-poisoned output and workspace, against float64 at the TF32
    tolerance."""
    from convforge.check import check_plan

    v = get_variant(NAME)
    why = v.applies(spec, cuda.device)
    if why:
        pytest.skip(f"{NAME}: {why}")
    direct = spec.stride == (1, 1) and spec.pad == (0,) * 4
    pts = v.space(spec, cuda.device)[:6] + POINTS + STAGED + (DIRECT if direct else [])
    assert any(p.get("xl") == "direct" for p in pts) == direct
    for i, p in enumerate(dict.fromkeys(pts)):
        epi = Epilogue(bias=True, relu=True) if i == 0 else Epilogue()
        res = check_plan(v.plan(spec, p, cuda.device, epi), cuda, seed=i, batch_slice=2)
        assert res.ok, f"{NAME} [{p.short()}] {spec.short()}: {res}"


def test_one_warpgroup_where_two_leave_most_sms_idle():
    """Round 34 (wg_default with the device's SMs): NIN's cccp7 / cccp8 at N5 give 16 blocks of two
    warpgroups for 132 SMs, so they take one a block (H100: 0.031 -> 0.027 ms); ResNet-50's 1x1 layers at
    N32 keep two; without a unit count the rule is the old one (two where M fills them)."""
    v = get_variant(NAME)
    for k in (1000, 1024):
        assert v.default(ConvSpec.make(5, 1024, 6, 6, k, 1, 1), NOMINAL_CUDA).wg == 1
    assert v.default(LAYER, NOMINAL_CUDA).wg == 2
    assert wg_default(1000, 180).wg == 2
