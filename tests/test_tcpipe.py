"""The staged TF32 tensor-core GEMM (kernels/tensorcore/sm80/mma_pipe.py) without a GPU: its lane arithmetic against
the PTX ISA's ldmatrix and mma.m16n8k8 .tf32 layouts (a warp-level emulation of one k step, every
operand layout), shared-memory bank groups, the cp.async copy positions, nvcc compiles of the new
variants (no spills, registers reported) and the SASS main loop (LDGSTS, LDSM, HMMA; instructions
per HMMA bounded); and the GPU tier against float64 with NaN-poisoned outputs.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

import numpy as np
import pytest

from conftest import NOMINAL_CUDA, NOMINAL_OPENCL_GPU
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm80.mma_pipe import (
    AsyncOperand,
    PipeLayout,
    _Copier,
    c_col,
    c_row,
    lane_i,
    lds1_const,
    lds1_off,
    ldsm_a_row,
    ldsm_b_row,
    pipe_ok,
    read_mode,
    smem_ld,
    smem_off,
)
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, ptxas_reports, sample, sass_reports
from test_tensorcore import doc_a, doc_b, doc_c, ev

NEW = ["gemm1x1_pipe_tf32", "implicit_gemm_nhwc_tf32", "winograd_nonfused_f2_pipe_tf32"]
RESNET = [ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1), ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1),
          ConvSpec.make(32, 512, 7, 7, 512, 3, 3, 1, 1), ConvSpec.make(32, 1024, 14, 14, 256, 1, 1),
          ConvSpec.make(32, 256, 56, 56, 128, 1, 1, 2)]


# -- ldmatrix / k-major fragment reads: one warp, one k step, emulated ---------------------------
def _ldsm(tile: np.ndarray, rows: list[int]) -> np.ndarray:
    """ldmatrix.x4 on a float32 shared tile (flat): lane 8q + r gives the word offset of row r of
    matrix q; lane l receives word l % 4 of row l / 4 of each matrix (PTX ISA, b16 8 x 8: each row
    16 bytes = 4 words). Returns regs[lane, q]."""
    out = np.empty((32, 4), tile.dtype)
    for lane, q in itertools.product(range(32), range(4)):
        out[lane, q] = tile[rows[8 * q + lane // 4] + lane % 4]
    return out


def _fragments(op: str, mode: str, tile: np.ndarray, ld: int, count: int, kk: int) -> np.ndarray:
    """regs[lane, f, r] of ``count`` A (op 'a', 4 regs) or B (2 regs) fragments at k step kk, read
    in ``mode`` with the generator's expressions from a tile at warp origin 0."""
    regs = np.empty((32, count, 4 if op == "a" else 2), tile.dtype)
    if mode == "lds1":
        for lane, f, r in itertools.product(range(32), range(count), range(regs.shape[2])):
            g, t = lane >> 2, lane & 3
            off = ev(lds1_off(op, ld, f, r, kk), g=g, t=t)
            assert off == t * ld + g + lds1_const(op, ld, f, r, kk)
            regs[lane, f, r] = tile[off]
        return regs
    if mode == "ldsm":
        ri, rk = ldsm_a_row() if op == "a" else ldsm_b_row()
        step = 1 if op == "a" else 2
        for f in range(0, count, step):
            rows = [ev(smem_off("k", ld, f"{16 * f if op == 'a' else 8 * f} + {ri}", f"{kk} + {rk}"), lane=lane)
                    for lane in range(32)]
            got = _ldsm(tile, rows)
            if op == "a":
                regs[:, f, :] = got
            else:
                regs[:, f, :], regs[:, f + 1, :] = got[:, :2], got[:, 2:]
        return regs
    per = 2 * count if op == "a" else count
    for lane, hh, j in itertools.product(range(32), (0, 1), range(per)):
        g, t = lane >> 2, lane & 3
        v = tile[ev(smem_off("i", ld, lane_i(j), f"{kk} + t + {4 * hh}"), g=g, t=t)]
        if op == "a":
            regs[lane, j >> 1, (j & 1) + 2 * hh] = v
        else:
            regs[lane, j, hh] = v
    return regs


def _mma_doc(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """D (lane, 4) = A.B for fragments in the PTX ISA's layouts (a (32, 4), b (32, 2))."""
    A, B = np.zeros((16, 8)), np.zeros((8, 8))
    for lane in range(32):
        for r in range(4):
            A[doc_a(lane, r)] = a[lane, r]
        for r in range(2):
            B[doc_b(lane, r)] = b[lane, r]
    D = A @ B
    return np.array([[D[doc_c(lane, r)] for r in range(4)] for lane in range(32)])


@pytest.mark.parametrize("a_fast, b_fast", [("k", "k"), ("k", "i"), ("i", "i"), ("i", "k")])
@pytest.mark.parametrize("fm, fn", [(4, 8), (2, 4), (4, 4)])
@pytest.mark.parametrize("rounded", [False, True])
def test_warp_step_emulation_matches_a_product(a_fast, b_fast, fm, fn, rounded):
    """Tiles in shared memory as the copies lay them out, fragments read by the generated lane
    arithmetic (ldmatrix or float4 reads), documented mma layouts, accumulators placed by c_row /
    c_col: the warp tile equals A.B for this k step, every (row, column) written once."""
    rng = np.random.default_rng(fm * 10 + fn)
    wtm, wtn, bk = 16 * fm, 8 * fn, 16
    A, B = rng.standard_normal((wtm, bk)), rng.standard_normal((bk, wtn))
    tiles = {}
    for nm, fast, bi, mat in (("a", a_fast, wtm, A), ("b", b_fast, wtn, B.T)):
        ld = smem_ld(fast, bi, bk)
        tile = np.full((bi if fast == "k" else bk) * ld, np.nan)
        for i, k in itertools.product(range(bi), range(bk)):
            tile[ev(smem_off(fast, ld, str(i), str(k)))] = mat[i, k]
        tiles[nm] = (tile, ld)
    C = np.full((wtm, wtn), np.nan)
    acc = np.zeros((32, fm, fn, 4))
    ma, mb = read_mode(a_fast, rounded), read_mode(b_fast, rounded)
    for kk in (0, 8):
        a = _fragments("a", ma, *tiles["a"], fm, kk)
        b = _fragments("b", mb, *tiles["b"], fn, kk)
        for i, j in itertools.product(range(fm), range(fn)):
            acc[:, i, j] += _mma_doc(a[:, i], b[:, j])
    for lane, i, j, r in itertools.product(range(32), range(fm), range(fn), range(4)):
        env = {"g": lane >> 2, "t": lane & 3}
        row, col = ev(c_row(ma, i, r >> 1), **env), ev(c_col(mb, j, r & 1), **env)
        assert np.isnan(C[row, col]), f"({row}, {col}) written twice"
        C[row, col] = acc[lane, i, j, r]
    np.testing.assert_allclose(C, A @ B, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bk", [16, 32])
@pytest.mark.parametrize("op", ["a", "b"])
def test_ldmatrix_rows_hit_distinct_bank_groups(op, bk):
    """Each 8 x 8 matrix of an ldmatrix.x4 (8 row addresses of 16 bytes) covers all 8 16-byte bank
    groups of a 128-byte line: no conflict in the padded i-major tile."""
    ld = smem_ld("k", 128, bk)
    ri, rk = ldsm_a_row() if op == "a" else ldsm_b_row()
    for kk, f in itertools.product(range(0, bk, 8), range(4)):
        addr = [ev(smem_off("k", ld, f"{16 * f} + {ri}", f"{kk} + {rk}"), lane=lane) for lane in range(32)]
        assert all(a % 4 == 0 for a in addr), "ldmatrix rows must be 16-byte aligned"
        for q in range(4):
            groups = {(a // 4) % 8 for a in addr[8 * q:8 * q + 8]}
            assert len(groups) == 8, f"matrix {q}: {len(groups)} bank groups"


@pytest.mark.parametrize("bi", [64, 128, 256])
def test_kmajor_float4_reads_are_conflict_free(bi):
    """The float4 reads of a k-major tile: each quarter warp (one LDS.128 phase) covers 8 distinct
    16-byte bank groups, for both k rows and every 32-wide block of values."""
    ld = smem_ld("i", bi, 16)
    for hh, j in itertools.product((0, 1), (0, 4)):
        addr = [ev(smem_off("i", ld, lane_i(j), f"t + {4 * hh}"), g=lane >> 2, t=lane & 3) for lane in range(32)]
        assert all(a % 4 == 0 for a in addr)
        for ph in range(4):
            assert len({(a // 4) % 8 for a in addr[8 * ph:8 * ph + 8]}) == 8, f"phase {ph}"


@pytest.mark.parametrize("op, count", [("a", 4), ("b", 8)])
@pytest.mark.parametrize("bi", [64, 128])
def test_kmajor_scalar_reads_are_conflict_free(op, count, bi):
    """The 32-bit reads of a rounded k-major tile ("lds1"): 32 lanes, 32 distinct banks."""
    ld = smem_ld("i", bi, 16)
    for f, r, kk in itertools.product(range(count), range(4 if op == "a" else 2), (0, 8)):
        banks = {ev(lds1_off(op, ld, f, r, kk), g=lane >> 2, t=lane & 3) % 32 for lane in range(32)}
        assert len(banks) == 32, f"{op} f{f} r{r}: {len(banks)} banks"


@pytest.mark.parametrize("fast, vec, bi, bk, threads", [("k", 4, 128, 32, 128), ("k", 1, 64, 16, 128),
                                                        ("i", 4, 128, 16, 128), ("i", 1, 128, 32, 256),
                                                        ("k", 4, 64, 32, 256), ("i", 4, 64, 16, 256)])
def test_copies_cover_the_tile_once(fast, vec, bi, bk, threads):
    """Every (i, k) of a bi x bk slice is copied by exactly one (thread, slot), to its shared offset."""
    op = AsyncOperand(src=lambda t, k: ([], "p", ""), fast=fast, vec=vec)
    assert op.kind == (fast, vec, False)
    cp = _Copier("a", op, 10**6, bi, bk, threads, "0", 0)
    seen = Counter()
    for tid, (di, dk) in itertools.product(range(threads), cp.steps):
        i0, k0 = ev(cp.i0, tid=tid) + di, ev(cp.k0, tid=tid) + dk
        for e in range(vec):
            i, k = (i0, k0 + e) if fast == "k" else (i0 + e, k0)
            seen[(i, k)] += 1
            off = di * cp.ld + dk if fast == "k" else dk * cp.ld + di
            base = ev(smem_off(fast, cp.ld, str(i0 - di), str(k0 - dk)))
            assert base + off + e == ev(smem_off(fast, cp.ld, str(i), str(k)))
    assert seen == Counter({(i, k): 1 for i in range(bi) for k in range(bk)})


def test_pipe_ok_rejects_bad_tiles():
    p = Params(bm=128, bn=128, bk=32, wm=2, wn=2, st=3)
    kk, ki, kr = ("k", 4, True), ("i", 4, False), ("i", 4, True)
    assert pipe_ok(p, kk, kk) and pipe_ok(p, kk, ki)
    assert not pipe_ok(p.replace(bk=8), kk, kk)
    assert not pipe_ok(p.replace(st=1), kk, kk)
    assert not pipe_ok(p.replace(bn=96, wn=2), kk, ki)  # fn = 6: no float4 lane mapping
    assert pipe_ok(p.replace(bn=96), kk, kr)  # scalar reads of a rounded operand: any fn
    assert not pipe_ok(p.replace(st=5), kk, kk)  # 5 stages of 128 x 128 x 32: > 113 KB
    assert PipeLayout(128, 128, 32, 2, 2, 3).fm == 4


def test_bad_params_name_the_problem():
    v = get_variant("implicit_gemm_nhwc_tf32")
    p = v.default(RESNET[0], NOMINAL_CUDA)
    with pytest.raises(ValueError, match="staged tensor-core GEMM parameters"):
        v.plan(RESNET[0], p.replace(bk=8), NOMINAL_CUDA)
    with pytest.raises(ValueError, match="unknown parameters"):
        v.plan(RESNET[0], p.replace(tm=4), NOMINAL_CUDA)


@pytest.mark.parametrize("name", NEW)
def test_cuda_only_and_relaxed(name):
    v = get_variant(name)
    spec = RESNET[3] if "1x1" in name else RESNET[0]
    assert v.applies(spec, NOMINAL_OPENCL_GPU)
    assert v.precision == "relaxed" and v.expected_error(spec) < v.tolerance <= 1e-3
    with pytest.raises(ValueError, match="ldmatrix|cp.async|MMA"):
        v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA).source("opencl")


@pytest.mark.parametrize("text", ["CP_ASYNC16(a, p, 16u)", "CP_ASYNC_WAIT(1)", "LDMATRIX_X4(a, b, c, d, s)",
                                  "LDS_F4(s)", "LDS_F1(s)", "TF32_RHA(x)", "SMEM_U32(p)"])
def test_opencl_refuses_each_staged_primitive(text):
    from convforge.codegen.render import OpenCLRenderer

    with pytest.raises(ValueError, match="OpenCL renderer refuses"):
        OpenCLRenderer().expand(text)


def test_rank_puts_the_staged_winograd_first_only_where_measured():
    v = get_variant("winograd_nonfused_f2_pipe_tf32")
    f7 = get_variant("winograd_nonfused_f7")
    assert v.rank(RESNET[2], NOMINAL_CUDA) > f7.rank(RESNET[2], NOMINAL_CUDA)
    assert v.rank(RESNET[0], NOMINAL_CUDA) < f7.rank(RESNET[0], NOMINAL_CUDA)


# -- nvcc and SASS ------------------------------------------------------------------------------
def _specs(name: str) -> list[ConvSpec]:
    odd = ODD_SPECS + [ConvSpec.make(1, 37, 13, 7, 70, 3, 3, 1, (0, 1, 2, 1)),
                       ConvSpec.make(3, 12, 17, 13, 5, 1, 1, 2, 1)]
    return [s for s in RESNET + odd if not get_variant(name).applies(s, NOMINAL_CUDA)]


def test_compiles_without_spills(nvcc_ok):
    """For every NEW variant: the default on every ResNet and odd layer the variant takes, and a sampled
    point of the tuning space on every other ResNet layer it takes (the odd shapes' boundary code is the
    default's); one nvcc run for all."""
    plans = []
    for name in NEW:
        v = get_variant(name)
        resnet = 0
        assert _specs(name), name
        for spec in _specs(name):
            k = 1 if spec in RESNET and resnet % 2 == 0 else 0
            resnet += spec in RESNET
            for i, p in enumerate(sample(v, spec, NOMINAL_CUDA, k=k, seed=3)):
                epi = Epilogue(bias=True, relu=True) if i == 0 else Epilogue()
                plans.append((name, spec, p, v.plan(spec, p, NOMINAL_CUDA, epi)))
    for (name, spec, p, _), infos in zip(plans, ptxas_reports([plan.source("cuda") for *_, plan in plans]),
                                         strict=True):
        assert infos, f"{name} {spec.short()} [{p.short()}]: ptxas reported no kernel"
        for info in infos:
            print(f"{name} {spec.short()} [{p.short()}] {info.kernel}: {info.registers} registers")
            assert info.spill_stores == info.spill_loads == info.stack == 0, f"{name} [{p.short()}] {info}"


def loop_mix(sass: str) -> Counter[str]:
    """Opcode counts (first component) of the GEMM kernel's largest loop in ``sass``."""
    from convforge.codegen.sass import instructions

    ins = next(i for k, i in instructions(sass).items() if k.endswith(("_gemm", "tcgemm")))
    spans = [(int(m.group(1), 16), a) for a, op, arg in ins if op.startswith("BRA")
             for m in [re.search(r"0x([0-9a-f]+)", arg)] if m and int(m.group(1), 16) < a]
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    return Counter(op.split(".")[0] for a, op, _ in ins if lo <= a <= hi)


# Measured (nvcc 13, sm_90): NHWC 128 x 128 x 32 2.52 instructions per HMMA, 128 x 64 x 32 3.09;
# 1x1 128 x 128 x 32 2.62 (a quarter of it the raw activations' rounding), 128 x 64 x 32 3.17;
# Winograd F(2x2) GEMM (32-bit fragment reads) 128 x 128 x 32 3.12, x 16 3.23. The register-staged
# generator (kernels/tensorcore/sm80/mma_sync.py) runs 8-12.
SASS_CASES = [("implicit_gemm_nhwc_tf32", RESNET[0], (128, 128, 32, 2, 2, 3), 2.7),
              ("implicit_gemm_nhwc_tf32", RESNET[0], (128, 64, 32, 2, 2, 3), 3.3),
              ("gemm1x1_pipe_tf32", RESNET[3], (128, 128, 32, 2, 2, 3), 2.8),
              ("gemm1x1_pipe_tf32", RESNET[3], (128, 64, 32, 2, 2, 3), 3.3),
              ("winograd_nonfused_f2_pipe_tf32", RESNET[0], (128, 128, 32, 2, 2, 3), 3.3),
              ("winograd_nonfused_f2_pipe_tf32", RESNET[0], (128, 128, 16, 2, 2, 4), 3.4)]


def test_sass_main_loop(nvcc_ok):
    """For each SASS_CASES tile (one nvcc + cuobjdump run for all, helpers.sass_reports): the main loop
    is cp.async (LDGSTS), ldmatrix (LDSM) and HMMA.1688.F32.TF32, no local memory, and at most
    ``bound`` instructions per HMMA."""
    from convforge.codegen.nvcc import cuobjdump_path

    if cuobjdump_path() is None:
        pytest.skip("cuobjdump/nvdisasm not found: SASS checks skipped")
    cases = []
    for name, spec, tile, bound in SASS_CASES:
        v = get_variant(name)
        p = v.default(spec, NOMINAL_CUDA).replace(**dict(zip(("bm", "bn", "bk", "wm", "wn", "st"), tile, strict=True)))
        cases.append((name, p, tile, bound, v.plan(spec, p, NOMINAL_CUDA).source("cuda")))
    for (name, p, tile, bound, _), (_, sass) in zip(cases, sass_reports([c[-1] for c in cases]), strict=True):
        label = f"{name} [{p.short()}]"
        mix = loop_mix(sass)
        lay = PipeLayout(*tile)
        assert mix["HMMA"] == lay.fm * lay.fn * p.bk // 8, label
        assert mix["LDGSTS"] > 0 and (mix["LDSM"] > 0 or "winograd" in name), label
        assert not (mix["LDL"] or mix["STL"] or mix["LDG"]), label
        per = sum(mix.values()) / mix["HMMA"]
        print(f"{label}: {sum(mix.values())} instructions, {per:.2f} per HMMA: {dict(mix.most_common(8))}")
        assert per <= bound, label


# -- GPU tier ---------------------------------------------------------------------------------
GPU_SPECS = ODD_SPECS + [ConvSpec.make(2, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec.make(3, 512, 7, 7, 512, 3, 3, 1, 1),
                         ConvSpec.make(5, 832, 7, 7, 128, 1, 1), ConvSpec.make(3, 256, 14, 14, 1024, 1, 1, 2),
                         ConvSpec.make(1, 37, 13, 7, 70, 3, 3, 1, (0, 1, 2, 1)),
                         ConvSpec.make(1, 36, 13, 7, 70, 3, 3, 2, (0, 1, 2, 1)),
                         ConvSpec.make(2, 132, 9, 11, 131, 3, 3, 1, 1),
                         ConvSpec.make(3, 12, 17, 13, 5, 1, 1, 2, 1), ConvSpec.make(1, 20, 7, 9, 33, 1, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.key())
@pytest.mark.parametrize("name", NEW)
def test_staged_variant_on_gpu(cuda, name, spec):
    """Default (bias + ReLU) and sampled points against float64, NaN-poisoned outputs."""
    from convforge.check import check_plan

    v = get_variant(name)
    why = v.applies(spec, cuda.device)
    if why:
        pytest.skip(f"{name}: {why}")
    for i, p in enumerate(sample(v, spec, cuda.device, k=3, seed=11)):
        epi = Epilogue(bias=True, relu=True) if i == 0 else Epilogue()
        res = check_plan(v.plan(spec, p, cuda.device, epi), cuda, seed=i, batch_slice=2)
        print(f"{name} {spec.short()} [{p.short()}]: {res}")
        assert res.ok, f"{name} [{p.short()}] {spec.short()}: {res}"
