"""Tensor-core (TF32) GEMMs without a GPU: the generated fragment index arithmetic against the PTX
ISA's documented mma.m16n8k8 .tf32 layouts, a lane-by-lane CPU emulation of the generated
algorithm (shared-tile stores, fragment loads, mma, accumulator stores) against float64, nvcc
compiles of every new variant (no spills), the OpenCL refusal; and the GPU tier against float64.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from conftest import NOMINAL_CUDA, NOMINAL_OPENCL_GPU
from convforge.codegen.nvcc import ptxas_report
from convforge.codegen.render import OpenCLRenderer
from convforge.config import PRECISIONS
from convforge.kernels import get_variant
from convforge.kernels.sgemm import Operand
from convforge.kernels.tensorcore.sm80.mma_sync import (
    A_FRAG,
    B_FRAG,
    C_FRAG,
    TcLayout,
    _TcLoader,
    c_coords,
    frag_addr,
    smem_addr,
    smem_ld,
    tc_ok,
)
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, ptxas_reports, sample, sass_reports

NEW = ["implicit_gemm_tf32", "implicit_gemm_3xtf32", "implicit_gemm_precomp_tf32", "gemm1x1_tf32", "gemm1x1_3xtf32",
       "winograd_nonfused_f2_tf32", "winograd_nonfused_f4_3xtf32", "winograd_nonfused_f6_3xtf32"]
RESNET = [ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1), ConvSpec.make(32, 512, 7, 7, 512, 3, 3, 1, 1),
          ConvSpec.make(32, 256, 14, 14, 1024, 1, 1), ConvSpec.make(32, 1024, 14, 14, 512, 1, 1, 2)]


def ev(expr: str, **env: int) -> int:
    """Evaluate a generated C integer expression (non-negative operands) in Python."""
    return int(eval(expr.replace("/", "//"), {"min": min, "max": max}, env))  # noqa: S307


# -- the PTX ISA's layouts, transcribed independently of the generator -----------------------
def doc_a(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of a_i: row groupID (+8 for a1, a3), col threadID_in_group (+4 for a2, a3)."""
    g, t = lane >> 2, lane % 4
    return g + 8 * (i % 2), t + 4 * (i // 2)


def doc_b(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of b_i: row threadID_in_group (+4 for b1), col groupID."""
    g, t = lane >> 2, lane % 4
    return t + 4 * i, g


def doc_c(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of c_i: row groupID (+8 for c2, c3), col 2 threadID_in_group + (i & 1)."""
    g, t = lane >> 2, lane % 4
    return g + 8 * (i // 2), 2 * t + i % 2


def tf32(a: np.ndarray) -> np.ndarray:
    """cvt.rna.tf32.f32: round to 10 mantissa bits, ties away from zero (finite inputs)."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("frag, doc, shape", [(A_FRAG, doc_a, (16, 8)), (B_FRAG, doc_b, (8, 8)),
                                              (C_FRAG, doc_c, (16, 8))], ids=["A", "B", "C"])
def test_fragment_expressions_match_the_ptx_layout(frag, doc, shape):
    seen = np.zeros(shape, int)
    for lane, (i, (row, col)) in itertools.product(range(32), enumerate(frag)):
        got = ev(row, g=lane >> 2, t=lane & 3), ev(col, g=lane >> 2, t=lane & 3)
        assert got == doc(lane, i), f"lane {lane} reg {i}: generator {got}, PTX {doc(lane, i)}"
        seen[got] += 1
    assert (seen == 1).all(), "the fragment must cover the matrix exactly once"


def test_tf32_model_rounds_to_nearest_ties_away():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)
    assert tf32(np.float32(one + ulp * 0.5)) == one + ulp  # a tie rounds away from zero
    assert tf32(np.float32(-(one + ulp * 0.5))) == -(one + ulp)
    assert tf32(np.float32(one + ulp * 0.49)) == one
    assert tf32(np.float32(3.0)) == 3.0


@pytest.mark.parametrize("fast, bi, bk", [("k", 64, 16), ("k", 128, 32), ("i", 64, 16), ("i", 128, 32),
                                          ("i", 96, 16)])
@pytest.mark.parametrize("operand", ["a", "b"])
def test_fragment_addresses_decode_and_are_bank_conflict_free(operand, fast, bi, bk):
    """Each fragment read lands on the documented element of its shared tile, and the 32 lanes of
    one read hit 32 distinct banks (the padded layouts)."""
    ld = smem_ld(fast, bi, bk)
    count, regs, doc = (bi // 16, 4, doc_a) if operand == "a" else (bi // 8, 2, doc_b)
    for f, r, kk in itertools.product(range(count), range(regs), range(0, bk, 8)):
        banks = set()
        for lane in range(32):
            addr = ev(frag_addr(operand, fast, ld, f, r, kk), g=lane >> 2, t=lane & 3, wm0=0, wn0=0)
            i, k = divmod(addr, ld) if fast == "k" else divmod(addr, ld)[::-1]
            row, col = doc(lane, r)
            want = (16 * f + row, kk + col) if operand == "a" else (8 * f + col, kk + row)
            assert (i, k) == want, f"{operand} f{f} r{r} k{kk} lane {lane}"
            banks.add(addr % 32)
        assert len(banks) == 32, f"{operand} fragment read has bank conflicts ({len(banks)} banks)"


# -- lane-level emulation of the generated algorithm ---------------------------------------
def _operand(fast: str, v: int, grouped: bool) -> Operand:
    nothing = lambda *a: []  # noqa: E731 - positions are what the emulation needs, not code
    if grouped:
        return Operand(load=nothing, fast="i", kprep=nothing, kload=nothing)
    return Operand(load=nothing, fast=fast, vload=nothing if v == 4 else None)


def _stash(ld: _TcLoader, mat: np.ndarray, origin: int, k0: int, kend: int, rounded: bool,
           threads: int) -> np.ndarray:
    """Shared tile as the generated loads + stash leave it: each thread's slots at the
    generator's positions (rows past the edge clamped, k past the end zero), at smem_addr."""
    size = mat.shape[0]
    tile = np.full(ld.tile, np.nan, np.float32)
    fast, v = ld.op.fast, ld.v
    last = max(size - (v if fast == "i" else 1), 0)
    for tid, (i_e, k_e) in itertools.product(range(threads), ld.pos):
        i, k = ev(i_e, tid=tid), ev(k_e, tid=tid)
        base = min(origin + i, last)
        addr = ev(smem_addr(fast, ld.ld, i_e, k_e), tid=tid)
        for e in range(v):
            ii, kk = (base + e, k) if fast == "i" else (base, k + e)
            val = mat[ii, k0 + kk] if k0 + k < kend else np.float32(0)
            assert np.isnan(tile[addr + e]), "two threads store one shared element"
            tile[addr + e] = tf32(val) if rounded else val
    return tile


def _mma(a: np.ndarray, b: np.ndarray, x3: bool) -> np.ndarray:
    """One m16n8k8 product in float64 (hardware adds in FP32; the bound below allows for it)."""
    if not x3:
        return a.astype(np.float64) @ b.astype(np.float64)
    ah, bh = tf32(a), tf32(b)
    al, bl = tf32(a - ah), tf32(b - bh)
    f = lambda x, y: x.astype(np.float64) @ y.astype(np.float64)  # noqa: E731
    return f(al, bh) + f(ah, bl) + f(ah, bh)


def emulate(A: np.ndarray, B: np.ndarray, p: Params, a_fast: str, b_fast: str, x3: bool,
            grouped_b: bool = False) -> np.ndarray:
    """C = A.B computed the way the generated kernel does, block by block, warp by warp, lane by
    lane; operands are passed as (i, k) matrices (B transposed)."""
    (M, K), N = A.shape, B.shape[0]
    lay = TcLayout(p.bm, p.bn, p.bk, p.wm, p.wn)
    ga = _TcLoader("a", _operand(a_fast, p.va, False), M, p.bm, p.bk, p.va, lay.threads, "m0", "As", not x3)
    gb = _TcLoader("b", _operand(b_fast, p.vb, grouped_b), N, p.bn, p.bk, p.vb, lay.threads, "n0", "Bs",
                   not x3)
    C = np.full((M, N), np.nan)
    for m0, n0 in itertools.product(range(0, M, p.bm), range(0, N, p.bn)):
        acc = np.zeros((lay.wm * lay.wn, lay.fm, lay.fn, 16, 8))
        for k0 in range(0, K, p.bk):
            sa = _stash(ga, A, m0, k0, K, not x3, lay.threads)
            sb = _stash(gb, B, n0, k0, K, not x3, lay.threads)
            for w, kk in itertools.product(range(lay.wm * lay.wn), range(0, p.bk, 8)):
                env = dict(wm0=(w // p.wn) * lay.wtm, wn0=(w % p.wn) * lay.wtn)
                fa = np.zeros((lay.fm, 16, 8), np.float32)
                fb = np.zeros((lay.fn, 8, 8), np.float32)
                for lane in range(32):
                    gt = dict(g=lane >> 2, t=lane & 3, **env)
                    for f, r in itertools.product(range(lay.fm), range(4)):
                        fa[f][doc_a(lane, r)] = sa[ev(frag_addr("a", a_fast, ga.ld, f, r, kk), **gt)]
                    for f, r in itertools.product(range(lay.fn), range(2)):
                        fb[f][doc_b(lane, r)] = sb[ev(frag_addr("b", b_fast, gb.ld, f, r, kk), **gt)]
                assert not np.isnan(fa).any() and not np.isnan(fb).any(), "fragment read unwritten shared memory"
                for i, j in itertools.product(range(lay.fm), range(lay.fn)):
                    acc[w, i, j] += _mma(fa[i], fb[j], x3)
        for w, lane, i, j, r in itertools.product(range(lay.wm * lay.wn), range(32), range(lay.fm),
                                                  range(lay.fn), range(4)):
            env = dict(m0=m0, n0=n0, wm0=(w // p.wn) * lay.wtm, wn0=(w % p.wn) * lay.wtn,
                       g=lane >> 2, t=lane & 3)
            m, n = (ev(e, **env) for e in c_coords(i, j, r))
            if m < M and n < N:
                assert np.isnan(C[m, n]), "two lanes store one output"
                C[m, n] = acc[(w, i, j) + doc_c(lane, r)]
    return C


EMU = [  # (M, N, K, params, a_fast, b_fast, grouped B)
    (37, 53, 45, Params(bm=32, bn=32, bk=16, wm=1, wn=2, va=1, vb=1), "k", "i", True),
    (37, 53, 45, Params(bm=32, bn=32, bk=16, wm=1, wn=2, va=1, vb=1), "k", "i", False),
    (70, 68, 48, Params(bm=64, bn=64, bk=32, wm=2, wn=2, va=4, vb=4), "k", "i", False),
    (36, 68, 40, Params(bm=32, bn=64, bk=16, wm=1, wn=2, va=4, vb=4), "i", "i", False),  # vload: M % 4 == 0
]


@pytest.mark.parametrize("x3", [False, True], ids=["tf32", "3xtf32"])
@pytest.mark.parametrize("case", EMU, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[3].short().replace(' ', ',')}"
                         f"-{c[4]}{c[5]}{'-grouped' if c[6] else ''}")
def test_emulated_kernel_matches_float64(case, x3):
    M, N, K, p, a_fast, b_fast, grouped = case
    assert tc_ok(p, True, True, a_fast, b_fast)
    rng = np.random.default_rng(1)
    A = rng.uniform(-1, 1, (M, K)).astype(np.float32)
    Bt = rng.uniform(-1, 1, (N, K)).astype(np.float32)
    C = emulate(A, Bt, p, a_fast, b_fast, x3, grouped)
    assert not np.isnan(C).any(), "an output was never stored"
    exact = A.astype(np.float64) @ Bt.astype(np.float64).T
    err = np.linalg.norm(C - exact) / np.linalg.norm(exact)
    if x3:
        assert err < 2e-6, f"3xTF32 emulation error {err:.2e}"
    else:
        model = tf32(A).astype(np.float64) @ tf32(Bt).astype(np.float64).T
        assert np.linalg.norm(C - model) / np.linalg.norm(model) < 1e-12
        assert 2e-5 < err < 1e-3, f"TF32 emulation error {err:.2e} (rounding must show, within 1e-3)"


# -- accuracy statements ---------------------------------------------------------------------
def _winograd_model_error(m: int, x3: bool, seed: int = 0) -> float:
    """Relative L2 error of F(m x m, 3 x 3) when only U and V are rounded (TF32 or 3xTF32 split)."""
    from convforge.kernels.winograd.matrices import winograd

    t = winograd(m, 3)
    AT, G, BT = (np.asarray(t.as_float(n)) for n in ("AT", "G", "BT"))
    rng = np.random.default_rng(seed)
    d = rng.uniform(-1, 1, (64, 4, m + 2, m + 2))
    g = rng.uniform(-1, 1, (4, 64, 3, 3)).astype(np.float32).astype(np.float64)
    U = np.einsum("ij,kcjl,ml->kcim", G, g, G).astype(np.float32)
    V = np.einsum("ij,ctjl,ml->ctim", BT, d.astype(np.float32).astype(np.float64), BT).astype(np.float32)
    prod = lambda u, v: np.einsum("kcij,ctij->ktij", u.astype(np.float64), v.astype(np.float64))  # noqa: E731
    exact = prod(U, V)
    if x3:
        uh, vh = tf32(U), tf32(V)
        got = prod(tf32(U - uh), vh) + prod(uh, tf32(V - vh)) + prod(uh, vh)
    else:
        got = prod(tf32(U), tf32(V))
    y, yx = (np.einsum("ij,ktjl,ml->ktim", AT, x, AT) for x in (exact, got))
    return float(np.linalg.norm(yx - y) / np.linalg.norm(y))


def test_tf32_winograd_error_by_tile_size():
    """Why only F(2x2) takes plain TF32: the output transform amplifies the rounding of U and V."""
    assert _winograd_model_error(2, False) < 1e-3
    assert _winograd_model_error(4, False) > 1e-3 and _winograd_model_error(6, False) > 1e-3
    assert _winograd_model_error(4, True) < 2e-6 and _winograd_model_error(6, True) < 4e-6


@pytest.mark.parametrize("name", NEW)
def test_stated_accuracy_fits_the_class(name):
    v = get_variant(name)
    spec = RESNET[0] if "winograd" in name or "implicit" in name else RESNET[2]
    assert v.expected_error(spec) <= PRECISIONS[v.precision]
    assert v.tolerance >= 1.5 * v.expected_error(spec)
    if "3x" not in name:
        assert v.precision == "relaxed", "one TF32 product is never FP32-grade"


# -- applicability and the OpenCL refusal ------------------------------------------------------
@pytest.mark.parametrize("name", NEW)
def test_applies_only_on_cuda_sm80(name):
    v = get_variant(name)
    spec = ConvSpec.make(2, 8, 12, 12, 16, 1, 1) if "1x1" in name else ConvSpec.make(2, 8, 12, 12, 16, 3, 3, 1, 1)
    assert v.applies(spec, NOMINAL_CUDA) is None
    assert "cuda" in v.applies(spec, NOMINAL_OPENCL_GPU).lower()
    assert "8.0" in v.applies(spec, DeviceInfo("cuda", "T4", cc=(7, 5)))
    assert "compute capability" in v.applies(spec, DeviceInfo("cuda", "unknown"))


def test_opencl_renderer_refuses_tensor_core_primitives():
    v = get_variant("implicit_gemm_tf32")
    spec = ConvSpec.make(2, 8, 12, 12, 16, 3, 3, 1, 1)
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    with pytest.raises(ValueError, match=r"lacks features \['mma_tf32'\].*mma.sync"):
        plan.source("opencl")
    with pytest.raises(ValueError, match="refuses MMA_TF32_16x8x8: tensor-core mma.sync"):
        OpenCLRenderer().expand("MMA_TF32_16x8x8(d0, d1, d2, d3, a0, a1, a2, a3, b0, b1);")
    with pytest.raises(ValueError, match="refuses CVT_TF32"):
        OpenCLRenderer().expand("x = CVT_TF32(y);")


def test_generated_source_uses_the_checked_expressions():
    """The kernel reads fragments at exactly the frag_addr expressions the tests above check."""
    v = get_variant("implicit_gemm_tf32")
    spec = RESNET[0]
    p = v.default(spec, NOMINAL_CUDA)
    src = v.plan(spec, p, NOMINAL_CUDA).source("cuda")
    lay = TcLayout(p.bm, p.bn, p.bk, p.wm, p.wn)
    for f, r in itertools.product(range(lay.fm), range(4)):
        assert f"Ab[{frag_addr('a', 'k', smem_ld('k', p.bm, p.bk), f, r, 8)}]" in src
    for f, r in itertools.product(range(lay.fn), range(2)):
        assert f"Bb[{frag_addr('b', 'i', smem_ld('i', p.bn, p.bk), f, r, 8)}]" in src
    assert src.count("cf_mma_tf32(") == 1 + lay.fm * lay.fn * p.bk // 8  # the helper, then the calls
    assert "cvt.rna.tf32.f32" in src and "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in src


# -- nvcc ---------------------------------------------------------------------------------------
def _compile_specs(name: str) -> list[ConvSpec]:
    if "1x1" in name:
        return [RESNET[2], RESNET[3], ODD_SPECS[5]]
    return [RESNET[0], RESNET[1], ODD_SPECS[1], ODD_SPECS[3]]


def test_compiles_without_spills(nvcc_ok):
    """For every NEW variant: the default on the ResNet and odd layers, and a sampled point of the
    tuning space on every other ResNet layer the variant takes (the odd shapes' boundary code is the
    default's); one nvcc run for all."""
    plans = []
    for name in NEW:
        v = get_variant(name)
        resnet, before = 0, len(plans)
        for spec in _compile_specs(name):
            if v.applies(spec, NOMINAL_CUDA):
                continue
            k = 1 if spec in RESNET and resnet % 2 == 0 else 0
            resnet += spec in RESNET
            for i, p in enumerate(sample(v, spec, NOMINAL_CUDA, k=k, seed=5)):
                epi = Epilogue(bias=True, relu=True) if i == 0 else Epilogue()
                plans.append((name, spec, p, v.plan(spec, p, NOMINAL_CUDA, epi)))
        assert len(plans) > before, name
    for (name, spec, p, _), infos in zip(plans, ptxas_reports([plan.source("cuda") for *_, plan in plans]),
                                         strict=True):
        assert infos, f"{name} {spec.short()} [{p.short()}]: ptxas reported no kernel"
        for info in infos:
            print(f"{name} {spec.short()} [{p.short()}] {info.kernel}: {info.registers} registers, "
                  f"{info.shared} B shared")
            assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack == 0, (
                f"{name} [{p.short()}] {info.kernel} spills: {info}")


# -- GPU tier ---------------------------------------------------------------------------------
GPU_SPECS = ODD_SPECS + [ConvSpec.make(2, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec.make(3, 512, 7, 7, 512, 3, 3, 1, 1),
                         ConvSpec.make(5, 832, 7, 7, 128, 1, 1), ConvSpec.make(3, 256, 14, 14, 1024, 1, 1, 2),
                         ConvSpec.make(1, 37, 13, 7, 70, 3, 3, 1, (0, 1, 2, 1)),
                         ConvSpec.make(1, 3, 17, 13, 5, 1, 1, 2, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.key())
@pytest.mark.parametrize("name", NEW)
def test_tensor_core_variant_on_gpu(cuda, name, spec):
    """Default (with bias + ReLU) and sampled points against float64, NaN-poisoned outputs."""
    from convforge.check import check_plan

    v = get_variant(name)
    why = v.applies(spec, cuda.device)
    if why:
        pytest.skip(f"{name}: {why}")
    for i, p in enumerate(sample(v, spec, cuda.device, k=2, seed=11)):
        epi = Epilogue(bias=True, relu=True) if i == 0 else Epilogue()
        res = check_plan(v.plan(spec, p, cuda.device, epi), cuda, seed=i, batch_slice=2)
        print(f"{name} {spec.short()} [{p.short()}]: {res}")
        assert res.ok, f"{name} [{p.short()}] {spec.short()}: {res}"


def test_launch_sized_shared_tiles(nvcc_ok):
    """Tiles past 48 KB of shared memory (128 x 256) take one launch-sized buffer; the 3xTF32
    space leaves out what the register model says would spill (128 x 128 x 32)."""
    spec = RESNET[0]
    v = get_variant("implicit_gemm_tf32")
    p = v.default(spec, NOMINAL_CUDA).replace(bm=128, bn=256, bk=16, wm=2, wn=4)
    assert p in v.space(spec, NOMINAL_CUDA)
    plan = v.plan(spec, p, NOMINAL_CUDA)
    (kern,) = plan.kernels
    assert kern.local_buf() is not None and kern.local_buf().nbytes > 48 * 1024
    src = plan.source("cuda")
    assert "extern __shared__ __align__(16) float tc_smem[];" in src
    (info,) = ptxas_report(src)
    assert info.spill_stores == 0 and info.spill_loads == 0, info
    x3 = get_variant("implicit_gemm_3xtf32")
    assert not [q for q in x3.space(spec, NOMINAL_CUDA) if (q.bm, q.bn, q.bk, q.wm, q.wn) == (128, 128, 32, 2, 2)]


SASS_CASES = [("implicit_gemm_tf32", RESNET[0]), ("implicit_gemm_3xtf32", RESNET[0]),
              ("implicit_gemm_precomp_tf32", RESNET[0]),
              ("gemm1x1_tf32", RESNET[2]), ("winograd_nonfused_f2_tf32", RESNET[0]),
              ("winograd_nonfused_f4_3xtf32", RESNET[1])]


def test_sass_main_loop(nvcc_ok):
    """For each SASS_CASES default (one nvcc + cuobjdump run for all, helpers.sass_reports): the main
    loop holds fm x fn x bk/8 HMMA.1688.F32.TF32 (x3 for 3xTF32), nothing touches local memory, and the
    register prefetch (LDG) issues before the last tenth of the HMMAs."""
    from convforge.codegen.nvcc import cuobjdump_path
    from convforge.codegen.sass import instructions

    if cuobjdump_path() is None:
        pytest.skip("cuobjdump/nvdisasm not found: SASS checks skipped")
    cases = [(name, spec, get_variant(name).default(spec, NOMINAL_CUDA)) for name, spec in SASS_CASES]
    reports = sass_reports([get_variant(name).plan(spec, p, NOMINAL_CUDA).source("cuda") for name, spec, p in cases])
    for (name, spec, p), (_, sass) in zip(cases, reports, strict=True):
        label = f"{name} {spec.short()} [{p.short()}]"
        ins = next(i for k, i in instructions(sass).items() if "gemm" in k)
        assert not [op for _, op, _ in ins if op.startswith(("LDL", "STL"))], f"{label}: local memory in the GEMM"
        spans = [(int(m.group(1), 16), a) for a, op, arg in ins if op.startswith("BRA")
                 for m in [__import__("re").search(r"0x([0-9a-f]+)", arg)] if m and int(m.group(1), 16) < a]
        lo, hi = max(spans, key=lambda s: s[1] - s[0])
        body = [op for a, op, _ in ins if lo <= a <= hi]
        hmma = [i for i, op in enumerate(body) if op.startswith("HMMA")]
        assert all(body[i] == "HMMA.1688.F32.TF32" for i in hmma), label
        lay = TcLayout(p.bm, p.bn, p.bk, p.wm, p.wn)
        assert len(hmma) == lay.fm * lay.fn * p.bk // 8 * (3 if "3x" in name else 1), label
        ldg = [i for i, op in enumerate(body) if op.startswith("LDG")]
        assert ldg and max(sum(h < i for h in hmma) for i in ldg) <= 0.9 * len(hmma), f"{label}: prefetch sunk late"
        print(f"{label}: loop of {len(body)} instructions, {len(hmma)} HMMA, {len(ldg)} LDG")
