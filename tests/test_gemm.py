"""GEMM family: the SGEMM generator, im2col, implicit GEMM, im2win and 1x1 on PoCL against the
float64 reference; workspace figures; library-GEMM plumbing; CUDA compile checks (no spills)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.backends.base import Backend
from convforge.check import check_plan
from convforge.codegen.dialect import Buf
from convforge.kernels import get_variant
from convforge.kernels.sgemm import (
    GemmShape,
    Operand,
    Store,
    gemm_block,
    gemm_default,
    gemm_grid,
    gemm_kernel,
    gemm_space,
)
from convforge.params import Params
from convforge.plan import Epilogue, Gemm, Launch, Plan
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, assert_compiles_clean, assert_sources_compile_clean, sample

GENERAL = ["im2col_gemm", "implicit_gemm", "implicit_gemm_precomp", "im2win"]
POINTWISE = ["gemm1x1", "gemm1x1_splitk"]
# N=1/C=1/K=1 3x3, asymmetric pad, stride 2 on a prime height, dilation 2, 11x11/4 asymmetric.
GENERAL_SPECS = [ODD_SPECS[0], ODD_SPECS[2], ODD_SPECS[3], ODD_SPECS[4]]
POINTWISE_SPECS = [ConvSpec.make(2, 40, 7, 7, 13, 1, 1),
                   ConvSpec.make(1, 36, 9, 10, 5, 1, 1, 2, (0, 1, 1, 0))]


# -- the SGEMM generator on its own -----------------------------------------------------------
def _plain_gemm(shape: GemmShape, p: Params) -> Plan:
    m, n, k, ks = shape.m, shape.n, shape.k, shape.ksplit
    a = Operand(load=lambda t, kk, d: [f"{d} = A[bz * {m * k} + {t}_i * {k} + {kk}];"], fast="k",
                vload=(lambda t, kk, d: [f"{d} = VLOAD4(0, A + bz * {m * k} + {t}_i * {k} + {kk});"])
                if k % 4 == 0 else None)
    b = Operand(load=lambda t, kk, d: [f"{d} = B[bz * {k * n} + ({kk}) * {n} + {t}_i];"], fast="i",
                vload=(lambda t, kk, d: [f"{d} = VLOAD4(0, B + bz * {k * n} + ({kk}) * {n} + {t}_i);"])
                if n % 4 == 0 else None)
    c = Store(put=lambda mm, t, v: [f"C[(bz * {ks} + kz) * {m * n} + ({mm}) * {n} + {t}_i] = {v};"])
    kern = gemm_kernel("g", shape, p, a, b, c, (Buf("A"), Buf("B"), Buf("C", readonly=False)))
    launch = Launch("g", gemm_grid(shape, p), gemm_block(p), ("A", "B", "C"))
    return Plan("sgemm", "test", ConvSpec.make(1, 1, 1, 1, 1, 1, 1), p, (kern,), (launch,))


@pytest.mark.parametrize("shape,params", [
    (GemmShape(13, 71, 29), None),
    (GemmShape(67, 129, 37, batch=3), Params(bm=32, bn=64, bk=16, tm=4, tn=8, va=1, vb=1, pf=1, db=1)),
    (GemmShape(40, 36, 100, ksplit=3), Params(bm=64, bn=32, bk=8, tm=8, tn=4, va=1, vb=4, pf=0, db=0)),
    (GemmShape(33, 20, 52, ksplit=5), Params(bm=32, bn=32, bk=16, tm=4, tn=4, va=4, vb=4, pf=1, db=1)),
], ids=["default", "batched-db", "splitk-plain", "splitk-vec"])
def test_sgemm_generator(ocl, shape, params):
    p = params or gemm_default(shape.m, shape.n, shape.k, ocl.device, False, shape.n % 4 == 0)
    plan = _plain_gemm(shape, p)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((shape.batch, shape.m, shape.k)).astype(np.float32)
    b = rng.standard_normal((shape.batch, shape.k, shape.n)).astype(np.float32)
    cbuf = ocl.upload(np.full((shape.batch * shape.ksplit, shape.m, shape.n), np.nan, np.float32))
    ocl.executable(plan)({"A": ocl.upload(a), "B": ocl.upload(b), "C": cbuf})
    ocl.synchronize()
    got = ocl.download(cbuf, (shape.batch, shape.ksplit, shape.m, shape.n)).sum(axis=1)
    ref = np.einsum("bmk,bkn->bmn", a.astype(np.float64), b.astype(np.float64))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5


def test_sgemm_space_is_valid():
    space = gemm_space(128, 4096, 576, NOMINAL_CUDA)
    assert space[0] == Params(bm=128, bn=128, bk=8, tm=8, tn=8, va=4, vb=4, pf=1, db=1)
    assert len(space) == len(set(space)) > 50
    with pytest.raises(ValueError, match="invalid"):
        _plain_gemm(GemmShape(64, 64, 64), Params(bm=64, bn=64, bk=8, tm=4, tn=4, va=4, vb=4,
                                                  pf=1, db=1))


@pytest.mark.parametrize("pipe", [(0, 0), (1, 0), (1, 1)], ids=["plain", "prefetch", "double-buffer"])
@pytest.mark.parametrize("ksplit", [1, 3])
def test_sgemm_two_level_sums(ocl, pipe, ksplit):
    """kc: every kc reduction elements the running sums join the chunk totals; a K (1001) that
    neither kc nor the splits divide, in every pipeline, NaN-poisoned output."""
    p = Params(bm=32, bn=32, bk=8, tm=4, tn=4, va=1, vb=1, pf=pipe[0], db=pipe[1], kc=32)
    shape = GemmShape(37, 45, 1001, ksplit=ksplit)
    plan = _plain_gemm(shape, p)
    assert "s0_0 += c0_0" in plan.kernels[0].body and "kc0 += 4" in plan.kernels[0].body
    rng = np.random.default_rng(4)
    a = rng.standard_normal((1, shape.m, shape.k)).astype(np.float32)
    b = rng.standard_normal((1, shape.k, shape.n)).astype(np.float32)
    cbuf = ocl.upload(np.full((ksplit, shape.m, shape.n), np.nan, np.float32))
    ocl.executable(plan)({"A": ocl.upload(a), "B": ocl.upload(b), "C": cbuf})
    ocl.synchronize()
    got = ocl.download(cbuf, (ksplit, shape.m, shape.n)).sum(axis=0)
    ref = a[0].astype(np.float64) @ b[0].astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-6


def test_sgemm_chunks_cut_the_error_of_long_sums(ocl):
    """A 16384-long reduction of post-ReLU activations by random weights (VGG's fc6 is 25088):
    one running FP32 sum per output against chunks of 128, each against float64."""
    shape = GemmShape(16, 32, 16384)
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((1, shape.m, shape.k)) / 128).astype(np.float32)
    b = np.maximum(rng.standard_normal((1, shape.k, shape.n)), 0).astype(np.float32)
    ref = a[0].astype(np.float64) @ b[0].astype(np.float64)
    errs = {}
    for kc in (0, 128):
        p = Params(bm=16, bn=32, bk=8, tm=4, tn=4, va=1, vb=1, pf=1, db=1, kc=kc)
        cbuf = ocl.upload(np.full((1, shape.m, shape.n), np.nan, np.float32))
        ocl.executable(_plain_gemm(shape, p))({"A": ocl.upload(a), "B": ocl.upload(b), "C": cbuf})
        ocl.synchronize()
        got = ocl.download(cbuf, (shape.m, shape.n))
        errs[kc] = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert errs[128] < 0.5 * errs[0], errs


def test_long_reductions_sum_in_chunks_by_default():
    """4 x 4 micro-tiles (fully-connected layers) chunk by default from K = 512; larger ones (whose
    chunk totals cost 32-64 registers) do not, and each default's twin is second."""
    fc = gemm_space(32, 32, 25088, NOMINAL_CUDA)
    assert fc[0].get("kc") == 128 and fc[1] == fc[0].replace(kc=0)
    assert all(p.get("kc") == 128 for p in fc[2:] if p.tm * p.tn <= 16)
    assert not any("kc" in p for p in fc[2:] if p.tm * p.tn > 16)
    conv = gemm_space(128, 4096, 1152, NOMINAL_CUDA)
    assert "kc" not in conv[0] and conv[1] == conv[0].replace(kc=128)
    assert "kc" not in gemm_space(64, 64, 256, NOMINAL_CUDA)[0]
    with pytest.raises(ValueError, match=r"kc \(12\) must be 0 or a multiple of bk \(8\)"):
        _plain_gemm(GemmShape(64, 64, 64), Params(bm=32, bn=32, bk=8, tm=4, tn=4, va=1, vb=1, pf=1, db=1, kc=12))


# -- convolution variants on PoCL -------------------------------------------------------------
def _check(ocl: Any, name: str, spec: ConvSpec, params: Params, epi: Epilogue = Epilogue()) -> None:
    v = get_variant(name)
    plan = v.plan(spec, params, ocl.device, epi)
    assert plan.workspace_bytes == v.workspace_bytes(spec, params)
    res = check_plan(plan, ocl, seed=3)
    assert res.ok, f"{name} [{params.short()}] {spec.short()}: {res}"


@pytest.mark.parametrize("spec", GENERAL_SPECS, ids=lambda s: s.key())
@pytest.mark.parametrize("name", GENERAL)
def test_general_variant_default(ocl, name, spec):
    v = get_variant(name)
    assert v.applies(spec, ocl.device) is None
    _check(ocl, name, spec, v.default(spec, ocl.device))


@pytest.mark.parametrize("name", GENERAL)
def test_general_variant_sampled(ocl, name):
    spec = ODD_SPECS[1]
    v = get_variant(name)
    for params in sample(v, spec, ocl.device, k=1, seed=7)[1:]:
        _check(ocl, name, spec, params, Epilogue(bias=True, relu=True))


@pytest.mark.parametrize("spec", POINTWISE_SPECS, ids=lambda s: s.key())
@pytest.mark.parametrize("name", POINTWISE)
def test_pointwise(ocl, name, spec):
    v = get_variant(name)
    assert v.applies(spec, ocl.device) is None
    params = sample(v, spec, ocl.device, k=1, seed=2)[-1]
    _check(ocl, name, spec, params, Epilogue(bias=True, relu=spec.stride == (2, 2)))


# 5x5 dilation 2 (N3); 11x11/4 asymmetric pad; N=1 prime C and H, stride 2, asymmetric pad;
# 3x3 on a prime image whose C*R*S (333) no split divides (a float4 chunk per split end)
SPLITK_SPECS = [ODD_SPECS[3], ODD_SPECS[4], ConvSpec.make(1, 13, 17, 19, 11, 3, 3, 2, (1, 0, 1, 0)),
                ConvSpec.make(1, 37, 7, 7, 5, 3, 3, 1, 1)]


@pytest.mark.parametrize("spec", SPLITK_SPECS, ids=lambda s: s.key())
def test_implicit_splitk(ocl, spec):
    """implicit_gemm_splitk: the default, a sampled point and the most slices, bias + ReLU in the
    reduce pass; each slice's partial sums land in the workspace (NaN-poisoned output)."""
    v = get_variant("implicit_gemm_splitk")
    assert v.applies(spec, ocl.device) is None
    points = sample(v, spec, ocl.device, k=1, seed=5)
    most = max(v.space(spec, ocl.device), key=lambda p: p.ks)
    for params in [*points, most]:
        _check(ocl, "implicit_gemm_splitk", spec, params, Epilogue(bias=True, relu=True))


def test_implicit_splitk_applies_where_tiles_are_few():
    """On a 132-SM GPU: ResNet-18's stride-2 3x3 layers at N=1 (4-26 tiles), not at N=32, not
    for short reductions; the default gives every SM about a block."""
    v = get_variant("implicit_gemm_splitk")
    s2 = ConvSpec.make(1, 128, 28, 28, 256, 3, 3, 2, 1)
    assert v.applies(s2, NOMINAL_CUDA) is None
    p = v.default(s2, NOMINAL_CUDA)
    assert p.ks > 1 and 4 * v._tiles(s2, NOMINAL_CUDA) * p.ks >= 3 * NOMINAL_CUDA.units
    assert "tiles" in (v.applies(ConvSpec.make(32, 128, 28, 28, 256, 3, 3, 2, 1), NOMINAL_CUDA) or "")
    assert ">= 256" in (v.applies(ConvSpec.make(1, 16, 28, 28, 64, 3, 3, 2, 1), NOMINAL_CUDA) or "")
    assert ">= 32" in (v.applies(ODD_SPECS[0], NOMINAL_CUDA) or "")


def test_pointwise_refuses_3x3(ocl):
    assert "1x1" in (get_variant("gemm1x1").applies(ODD_SPECS[1], ocl.device) or "")


def test_im2win_ablation_points(ocl):
    """Micro-kernel off (one output per thread) and prefetch/double buffer off stay correct."""
    spec = ODD_SPECS[1]
    v = get_variant("im2win")
    space = v.space(spec, ocl.device)
    off = [p for p in space if p.tm == 1 and p.tn == 1]
    assert len(off) == 2 and any(not p.pf for p in space) and any(p.va == 1 for p in space)
    _check(ocl, "im2win", spec, off[1])


# -- workspace ------------------------------------------------------------------------------
MEC = {"cv1": ConvSpec.make(128, 3, 227, 227, 96, 11, 11, 4), "cv3": ConvSpec.make(128, 3, 227, 227, 64, 7, 7, 2),
       "cv8": ConvSpec.make(128, 64, 112, 112, 128, 3, 3), "cv10": ConvSpec.make(128, 128, 28, 28, 128, 3, 3),
       "cv12": ConvSpec.make(128, 512, 7, 7, 512, 3, 3)}


@pytest.mark.parametrize("layer", sorted(MEC))
def test_im2win_workspace_below_im2col(layer):
    spec = MEC[layer]
    win = get_variant("im2win").workspace_bytes(spec, Params())
    col = get_variant("im2col_gemm").workspace_bytes(spec, Params())
    assert win < col, f"{layer}: im2win {win} >= im2col {col}"


def test_workspace_figures():
    spec = ConvSpec.make(5, 832, 7, 7, 128, 1, 1)
    assert get_variant("implicit_gemm").workspace_bytes(spec, Params()) == 0
    assert get_variant("gemm1x1").workspace_bytes(spec, Params()) == 0
    assert get_variant("implicit_gemm_precomp").workspace_bytes(spec, Params()) == 8 * 832
    v = get_variant("gemm1x1_splitk")
    p = v.default(spec, NOMINAL_CUDA)
    assert p.ks > 1 and v.workspace_bytes(spec, p) == 4 * p.ks * 5 * 128 * 49
    assert get_variant("im2col_cublas").workspace_bytes(spec, Params()) == 4 * 832 * 5 * 49


# -- the library GEMM path (cuBLAS), exercised up to the back-end call ------------------------
class _FakeBackend(Backend):
    """Records launches and GEMM steps; compiles nothing."""

    name = "cuda"
    device = NOMINAL_CUDA

    def __init__(self) -> None:
        self._programs, self.calls = {}, []
        self.disk = type("NoDisk", (), {"get": lambda *a: None, "put": lambda *a: None})()

    def compile_options(self): return []
    def compiler_version(self): return "fake"
    def build(self, source): return object(), None
    def load_binary(self, blob): return None
    def function(self, program, kernel): return kernel.name
    def empty(self, nbytes): return f"buf{nbytes}"
    def upload(self, array): return array
    def download(self, buf, shape): return buf
    def fill(self, buf, value, nbytes): self.calls.append(("fill", buf))
    def nbytes(self, buf): return 1 << 40  # fake buffers are names: any size passes
    def launch(self, program, fn, kernel, step, args): self.calls.append(("launch", fn, args))
    def gemm(self, step, a, b, c): self.calls.append(("gemm", step, a, b, c))
    def synchronize(self): pass
    def time_ms(self, fn, repeats): return [0.0] * repeats


def test_im2col_cublas_plan_reaches_backend_gemm(ocl):
    spec = ConvSpec.make(2, 3, 13, 11, 5, 3, 3, 1, (0, 1, 1, 0))
    v = get_variant("im2col_cublas")
    assert v.applies(spec, ocl.device) is not None  # CUDA only
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(bias=True))
    be = _FakeBackend()
    be.executable(plan)({"x": "X", "w": "W", "y": "Y", "bias": "B"})
    kinds = [c[0] for c in be.calls]
    assert kinds == ["launch", "gemm", "launch"]
    step = be.calls[1][1]
    pq, crs = spec.p * spec.q, 27
    assert isinstance(step, Gemm) and be.calls[1][2:] == ("W", f"buf{4 * crs * pq * 2}", "Y")
    assert (step.m, step.n, step.k, step.batch, step.stride_a, step.stride_b, step.stride_c) == (
        5, pq, crs, 2, 0, crs * pq, 5 * pq)
    with pytest.raises(NotImplementedError):
        ocl.gemm(step, None, None, None)


# -- CUDA compile checks --------------------------------------------------------------------
CUDA_SPECS = [ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec.make(128, 3, 227, 227, 96, 11, 11, 4)]


def test_cuda_compiles_without_spills(nvcc_ok):
    """The defaults compile for sm_90 without spills (one nvcc run for all): the general variants and
    im2col_cublas with bias + ReLU on a ResNet 3x3 and the AlexNet 11x11/4 layer, the pointwise ones on
    a 1x1 layer, implicit_gemm_splitk with bias + ReLU on two N=1 stride-2 layers."""
    cases = [(name, spec, Epilogue(True, True)) for name in GENERAL + ["im2col_cublas"] for spec in CUDA_SPECS]
    cases += [(name, ConvSpec.make(5, 832, 7, 7, 128, 1, 1), Epilogue()) for name in POINTWISE]
    cases += [("implicit_gemm_splitk", ConvSpec.make(1, c, hw, hw, 2 * c, 3, 3, 2, 1), Epilogue(True, True))
              for c, hw in ((128, 28), (256, 14))]
    sources = []
    for name, spec, epi in cases:
        v = get_variant(name)
        assert v.applies(spec, NOMINAL_CUDA) is None, (name, spec)
        sources.append((f"{name} {spec.short()}", v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, epi)
                        .source("cuda")))
    assert_sources_compile_clean(sources)


# -- the GPU defaults' tiles, on PoCL --------------------------------------------------------
@pytest.mark.parametrize("name,spec,params", [
    ("implicit_gemm", ConvSpec.make(2, 3, 23, 23, 96, 5, 5, 2),
     Params(bm=96, bn=128, bk=24, tm=8, tn=8, va=1, vb=1, pf=1, db=1)),
    ("implicit_gemm", ConvSpec.make(2, 8, 13, 11, 70, 3, 3),
     Params(bm=128, bn=64, bk=16, tm=8, tn=8, va=4, vb=1, pf=1, db=1)),
    ("gemm1x1_splitk", ConvSpec.make(5, 64, 1, 1, 70, 1, 1),
     Params(bm=64, bn=16, bk=16, tm=4, tn=4, va=4, vb=1, pf=1, db=1, ks=4)),
], ids=["96x128x24", "128x64x16", "fc-64x16-splitk"])
def test_gpu_default_tiles_on_pocl(ocl, name, spec, params):
    _check(ocl, name, spec, params)


def test_gpu_defaults_for_mec_and_fc():
    """The measured-best tiles are what the defaults pick on a 132-SM GPU."""
    cv1, cv8 = MEC["cv1"], MEC["cv8"]
    assert get_variant("implicit_gemm").default(cv1, NOMINAL_CUDA).bm == 96
    p = get_variant("implicit_gemm").default(cv8, NOMINAL_CUDA)
    assert (p.bm, p.bn, p.bk) == (128, 64, 16)
    fc = ConvSpec.make(5, 4096, 1, 1, 4096, 1, 1)
    p = get_variant("gemm1x1_splitk").default(fc, NOMINAL_CUDA)
    assert p.bn == 16 and p.ks > 1


FC_SPECS = [ConvSpec.make(2, 5, 6, 6, 7, 6, 6), ConvSpec.make(1, 40, 3, 3, 13, 3, 3, 2)]


@pytest.mark.parametrize("spec", FC_SPECS, ids=lambda s: s.key())
def test_full_window_runs_as_pointwise(ocl, spec):
    """A filter covering the whole input (fc6) runs through the 1x1 path on the rewritten spec."""
    v = get_variant("gemm_fc")
    assert v.applies(spec, ocl.device) is None
    for params in v.space(spec, ocl.device)[:3]:
        plan = v.plan(spec, params, ocl.device)
        assert plan.spec == spec and plan.variant == "gemm_fc"
        res = check_plan(plan, ocl)
        assert res.ok, f"{params.short()}: {res}"
    assert "does not cover" in v.applies(ConvSpec.make(1, 3, 8, 8, 4, 3, 3, 1, 1), ocl.device)


def test_full_window_compiles(nvcc_ok):
    spec = ConvSpec.make(5, 256, 6, 6, 4096, 6, 6)  # AlexNet fc6 at batch 5
    v = get_variant("gemm_fc")
    assert_compiles_clean(v, spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)


def test_thin_fully_connected_layers_split_or_take_tensor_cores():
    """On a 132-SM GPU a long reduction whose plain tiles leave few threads per SM splits K even
    when the tiles alone fill the SMs (VGG-16 fc6 at N=32: 128 blocks of 64 threads), into 64x32
    tiles and enough slices for ~1024 threads per SM; at batch 128 3xTF32 ranks first (AlexNet)."""
    from convforge.kernels import ranked

    fc6 = ConvSpec.make(32, 25088, 1, 1, 4096, 1, 1)
    split = get_variant("gemm1x1_splitk")
    assert split.applies(fc6, NOMINAL_CUDA) is None
    p = split.default(fc6, NOMINAL_CUDA)
    assert (p.bm, p.bn, p.ks, p.get("kc")) == (64, 32, 16, 128)
    assert ranked("auto", fc6, NOMINAL_CUDA, None, precision="fp32")[0].name == "gemm1x1_splitk"
    short = ConvSpec.make(32, 1024, 14, 14, 256, 1, 1)  # a 1x1 conv: tiles enough, reduction short
    assert "tiles" in (split.applies(short, NOMINAL_CUDA) or "")
    big_batch = ConvSpec.make(128, 9216, 1, 1, 4096, 1, 1)
    assert ranked("auto", big_batch, NOMINAL_CUDA, None, precision="fp32")[0].name == "tc_implicit_gemm_3xtf32"
    assert ranked("auto", big_batch, NOMINAL_CUDA, None, precision="fp32", max_error=5e-7)[0].exact
