"""wgrad (update) kernels: the implicit-GEMM and 1x1 GEMMs with split-K, the Winograd update
F(3x3, 2x2) / F(3x3, 4x4) and the bias gradient, on PoCL against the float64 reference
(NaN-poisoned outputs and workspace) on odd shapes and sampled tuning points, compiled for sm_90
without spills, run twice bit-identically; the transforms checked exactly in a NumPy model first."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan, pass_inputs
from convforge.config import config
from convforge.dtypes import to_storage
from convforge.kernels import get_variant, ranked
from convforge.kernels.wgrad import bias_grad_plan, bias_grad_space
from convforge.kernels.wgrad.common import pick_split, sum_error
from convforge.kernels.wgrad.winograd import update_transform
from convforge.kernels.winograd.matrices import winograd
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.reference import bias_grad_ref, rel_l2, wgrad_ref
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, assert_compiles_clean, assert_sources_compile_clean, sample

GEMMS = ["wgrad_implicit_gemm", "wgrad_gemm1x1"]
WINOGRAD = ["wgrad_winograd_f2", "wgrad_winograd_f4"]
VARIANTS = GEMMS + WINOGRAD
# Beyond ODD_SPECS: stride 4 and 2 with sizes the stride does not divide, dilation 2 with
# asymmetric padding, primes, grouped layers, 3x3 stride-1 layers whose outputs are not whole tiles.
WGRAD_SPECS = [s.with_pass("wgrad") for s in ODD_SPECS] + [
    ConvSpec.make(2, 3, 23, 18, 5, 3, 3, stride=4, padding=(1, 0, 2, 1), conv_pass="wgrad"),
    ConvSpec.make(1, 5, 13, 14, 3, 3, 2, stride=(2, 3), padding=(0, 2, 1, 0), dilation=2, conv_pass="wgrad"),
    ConvSpec.make(3, 7, 11, 13, 5, 3, 3, padding=(2, 0, 0, 1), conv_pass="wgrad"),
    ConvSpec.make(2, 8, 12, 12, 16, 3, 3, padding=1, conv_pass="wgrad"),
    ConvSpec.make(1, 13, 9, 10, 11, 1, 1, conv_pass="wgrad"),
    ConvSpec.make(2, 6, 11, 9, 4, 3, 2, stride=(2, 3), padding=(1, 0, 2, 1), dilation=(1, 2), groups=2,
                  conv_pass="wgrad"),
    ConvSpec.make(2, 8, 10, 10, 12, 1, 1, groups=4, conv_pass="wgrad"),
    ConvSpec.make(1, 6, 7, 7, 6, 3, 3, padding=1, groups=3, conv_pass="wgrad"),
]


def _ids(spec: ConvSpec) -> str:
    return spec.key()


def _applicable(name: str) -> list[ConvSpec]:
    v = get_variant(name)
    return [s for s in WGRAD_SPECS if v.applies(s, NOMINAL_CUDA) is None]


# -- the Winograd update's algebra, exactly ---------------------------------------------------
def _update_model(x: np.ndarray, dy: np.ndarray, spec: ConvSpec, m: int) -> np.ndarray:
    """dW by the Winograd update in float64 NumPy, tile by tile, with the matrices the kernels use."""
    at, g, bt = (np.array([[float(v) for v in row] for row in mat]) for mat in update_transform(m))
    a, (pt, _, pl, _) = m + 2, spec.pad
    th, tw = -(-spec.p // m), -(-spec.q // m)
    xp = np.zeros((spec.n, spec.c, th * m + 2, tw * m + 2))
    for iy in range(xp.shape[2]):
        for ix in range(xp.shape[3]):
            if 0 <= iy - pt < spec.h and 0 <= ix - pl < spec.w:
                xp[:, :, iy, ix] = x[:, :, iy - pt, ix - pl]
    dyp = np.zeros((spec.n, spec.k, th * m, tw * m))
    dyp[:, :, :spec.p, :spec.q] = dy
    acc = np.zeros((a, a, spec.k, spec.c))
    for ty in range(th):
        for tx in range(tw):
            v = np.einsum("ij,ncjl,kl->ncik", bt, xp[:, :, ty * m:ty * m + a, tx * m:tx * m + a], bt)
            u = np.einsum("ij,nkjl,ml->nkim", g, dyp[:, :, ty * m:ty * m + m, tx * m:tx * m + m], g)
            acc += np.einsum("nkab,ncab->abkc", u, v)
    return np.einsum("ri,ijkc,sj->kcrs", at, acc, at)


@pytest.mark.parametrize("m", [2, 4])
def test_update_transform_is_exact(m):
    """A^T (G g G^T * B^T d B) A over tiles equals the float64 wgrad on odd 3x3 shapes, and the
    rescaled matrices keep the product of F(3, m): A^T diag(1/s) and diag(s) G."""
    at, g, bt = update_transform(m)
    t = winograd(3, m)
    assert bt == t.BT and all(v.denominator == 1 for row in g for v in row)
    for i in range(m + 2):
        for j in range(m):
            for r in range(3):
                assert at[r][i] * g[i][j] == t.AT[r][i] * t.G[i][j]
    rng = np.random.default_rng(m)
    for spec in (ConvSpec.make(2, 3, 13, 11, 5, 3, 3, 1, (0, 1, 1, 0)), ConvSpec.make(1, 4, 9, 9, 2, 3, 3, 1, 1),
                 ConvSpec.make(2, 3, 8, 7, 4, 3, 3, 1, (2, 0, 0, 2))):
        x, dy = rng.uniform(-1, 1, spec.x_shape), rng.uniform(-1, 1, spec.y_shape)
        assert rel_l2(_update_model(x, dy, spec, m), wgrad_ref(x, dy, spec)) < 1e-13


def test_update_transform_fractions_sit_in_the_output_transform():
    at, g, _ = update_transform(4)
    assert [row[:1] for row in g] == [(1,), (1,), (1,), (1,), (1,), (0,)]
    assert at[0][0] == Fraction(1, 4) and at[0][3] == Fraction(-1, 24)


# -- every variant on PoCL -----------------------------------------------------------------
@pytest.mark.parametrize("name, spec", [(n, s) for n in VARIANTS for s in _applicable(n)],
                         ids=lambda x: x if isinstance(x, str) else _ids(x))
def test_variant_on_pocl(ocl, name, spec):
    """The default and sampled points of the PoCL space, NaN-poisoned output and workspace."""
    v = get_variant(name)
    assert v.applies(spec, ocl.device) is None
    for i, params in enumerate(sample(v, spec, ocl.device, k=1, seed=2)):
        res = check_plan(v.plan(spec, params, ocl.device), ocl, seed=10 + i)
        assert res.ok, f"{name} [{params.short()}] {spec.short()}: {res}"


SAMPLED = [ConvSpec.make(2, 8, 12, 12, 16, 3, 3, padding=1, conv_pass="wgrad"),
           ConvSpec.make(3, 7, 11, 13, 5, 3, 3, padding=(2, 0, 0, 1), conv_pass="wgrad"),
           ConvSpec.make(2, 12, 8, 8, 20, 1, 1, conv_pass="wgrad")]


@pytest.mark.parametrize("name", VARIANTS)
def test_gpu_space_sample_on_pocl(ocl, name):
    """Points of the GPU tuning space (big tiles, float4 loads, double buffering, deep splits) run on
    PoCL: the generated code is the same dialect."""
    v = get_variant(name)
    ran = 0
    for spec in SAMPLED:
        if v.applies(spec, NOMINAL_CUDA):
            continue
        for i, params in enumerate(sample(v, spec, NOMINAL_CUDA, k=2, seed=7)):
            params = params.replace(tb=64) if "tb" in params else params
            res = check_plan(v.plan(spec, params, ocl.device), ocl, seed=20 + i)
            assert res.ok, f"{name} [{params.short()}] {spec.short()}: {res}"
            ran += 1
    assert ran


@pytest.mark.parametrize("name", VARIANTS + ["wgrad_direct"])
def test_two_runs_are_bit_identical(ocl, name):
    """Split reductions summed in a fixed order: the same inputs give the same bits."""
    v = get_variant(name)
    spec = next(s for s in (SAMPLED[0], SAMPLED[2]) if v.applies(s, ocl.device) is None)
    params = v.default(spec, ocl.device)
    if "ks" in params:
        params = params.replace(ks=3)
    exe = ocl.executable(v.plan(spec, params, ocl.device))
    inputs = pass_inputs(spec, np.random.default_rng(5))
    outs = []
    for _ in range(2):
        bufs = {k: ocl.upload(to_storage(a, spec.dtype)) for k, a in inputs.items()}
        bufs["w"] = ocl.upload(np.full(spec.w_shape, np.nan, np.float32))
        exe(bufs)
        ocl.synchronize()
        outs.append(ocl.download(bufs["w"], spec.w_shape))
    assert not np.isnan(outs[0]).any()
    assert outs[0].tobytes() == outs[1].tobytes()


# -- split-K: the deterministic default, atomics only when allowed -------------------------------
@pytest.mark.parametrize("name, ks", [("wgrad_implicit_gemm", 5), ("wgrad_implicit_gemm", 32),
                                      ("wgrad_gemm1x1", 12), ("wgrad_winograd_f2", 2), ("wgrad_winograd_f2", 8),
                                      ("wgrad_winograd_f4", 16)])
def test_long_splits_on_pocl(ocl, name, ks):
    """Split counts that take each reduce path: summed by one thread, by runs of slices in a block
    (ks >= 8), and for Winograd inside the output transform (ks <= 2) or by the reduce kernel first."""
    v = get_variant(name)
    spec = next(s for s in (ConvSpec.make(3, 6, 20, 20, 10, 3, 3, 1, 1, conv_pass="wgrad"), SAMPLED[2])
                if v.applies(s, ocl.device) is None)
    plan = v.plan(spec, v.default(spec, ocl.device).replace(ks=ks), ocl.device)
    res = check_plan(plan, ocl, seed=ks)
    assert res.ok, f"{name} ks={ks}: {res}"


def test_atomics_only_when_the_user_allows_them(ocl, monkeypatch):
    v = get_variant("wgrad_implicit_gemm")
    spec = SAMPLED[1]
    assert config.deterministic
    assert not any(p.get("at") for p in v.space(spec, NOMINAL_CUDA))
    prm = v.default(spec, ocl.device).replace(ks=4, at=1)
    with pytest.raises(ValueError, match="not run-to-run deterministic.*CONVFORGE_DETERMINISTIC=0"):
        v.plan(spec, prm, ocl.device)
    monkeypatch.setattr(config, "deterministic", False)
    assert any(p.get("at") == 1 for p in v.space(spec, NOMINAL_CUDA))
    plan = v.plan(spec, prm, ocl.device)
    assert plan.workspace_bytes == 0 and "cf_atomic_add" in plan.source("opencl")
    res = check_plan(plan, ocl, seed=4)
    assert res.ok, res


def test_deterministic_setting_is_read_from_the_environment():
    from convforge.config import Config, ConfigError

    assert Config({}).deterministic is True
    assert Config({"CONVFORGE_DETERMINISTIC": "0"}).deterministic is False
    with pytest.raises(ConfigError, match="CONVFORGE_DETERMINISTIC"):
        _ = Config({"CONVFORGE_DETERMINISTIC": "maybe"}).deterministic


def test_split_defaults_fill_the_gpu_and_bound_the_running_sums():
    """ResNet 64@56² N32: 5 output tiles of 64 x 128 need ks >= 100 for two waves on 132 SMs;
    every default keeps a running sum within 8192 terms where it can."""
    for c, hw in ((64, 56), (128, 28), (256, 14), (512, 7)):
        spec = ConvSpec.make(32, c, hw, hw, c, 3, 3, 1, 1, conv_pass="wgrad")
        for name in VARIANTS[:1] + WINOGRAD:
            v = get_variant(name)
            p = v.default(spec, NOMINAL_CUDA)
            red = spec.n * spec.p * spec.q if name in GEMMS else v._t4(spec)  # noqa: SLF001
            assert red / p.ks <= 8192, (name, c, p.short())
            assert v.expected_error(spec) <= 5e-6, name
    assert pick_split(5, 128, 100352, NOMINAL_CUDA) >= 96
    assert sum_error(100_000) > 5e-6 > sum_error(100_000 // 16)


def test_bad_parameters_are_refused_by_name(ocl):
    spec = SAMPLED[0]
    v = get_variant("wgrad_implicit_gemm")
    with pytest.raises(ValueError, match="ks \\(0\\) must be in 1"):
        v.plan(spec, v.default(spec, ocl.device).replace(ks=0), ocl.device)
    with pytest.raises(ValueError, match="unsupported epilogue: wgrad_implicit_gemm writes a gradient"):
        v.plan(spec, v.default(spec, ocl.device), ocl.device, Epilogue(bias=True))
    w = get_variant("wgrad_winograd_f4")
    with pytest.raises(ValueError, match="tb \\(8\\) must be in 32"):
        w.plan(spec, w.default(spec, ocl.device).replace(tb=8), ocl.device)
    assert "3x3 filters only" in w.applies(SAMPLED[2], ocl.device)
    assert "stride 1" in w.applies(WGRAD_SPECS[2], ocl.device)
    assert "does not compute fprop" in w.applies(spec.with_pass("fprop"), ocl.device)
    assert "grouped" in w.applies(WGRAD_SPECS[-1], ocl.device)


# -- the precision rule on wgrad layers ----------------------------------------------------------
def test_tuner_admits_wgrad_candidates_by_the_fp32_rule(ocl, tmp_path):
    """A wgrad layer tuned on PoCL: every candidate judged on the whole batch, the winner's measured
    error within max(5e-6, 2 x the most accurate candidate's), the most accurate stored."""
    from convforge.tune.db import TuningDB
    from convforge.tune.tuner import Budget, Candidate, Tuner

    spec = ConvSpec.make(2, 6, 10, 10, 8, 3, 3, 1, 1, conv_pass="wgrad")
    tuner = Tuner(ocl, TuningDB(tmp_path / "t.sqlite"), budget=Budget(seconds=None, candidates=6), workers=2)
    res = tuner.tune(spec)
    ok = [c for c in res.candidates if c.status == "ok"]
    assert {c.variant.name for c in ok} >= {"wgrad_direct", "wgrad_implicit_gemm", "wgrad_winograd_f4"}
    least = min(c.error for c in ok)
    assert res.entry.min_error == least and res.entry.error <= max(5e-6, 2 * least)
    assert res.variant.name.startswith("wgrad_") and "wgrad" in res.entry.spec_json
    # 100k-term reductions: the most accurate candidate above 5e-6 widens the bound to twice its error
    fake = [Candidate(get_variant("wgrad_direct"), Params(), error=e, status="ok") for e in (8e-6, 1.5e-5, 2e-5)]
    assert tuner.bound(fake) == pytest.approx(1.6e-5)


# -- the heuristic's order -----------------------------------------------------------------
@pytest.mark.parametrize("spec, first", [
    # sm_90, fp32 class: 3xFP16 first on 3x3, deep 1x1 at <= 28² and 7x7 stems (tensorcore/sm90/wgrad.x3h_first)
    (ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1, conv_pass="wgrad"), "wgrad_tc_implicit_gemm_3xf16"),
    (ConvSpec.make(32, 256, 56, 56, 64, 1, 1, conv_pass="wgrad"), "wgrad_gemm1x1"),
    (ConvSpec.make(32, 256, 56, 56, 512, 1, 1, 2, conv_pass="wgrad"), "wgrad_implicit_gemm"),
    (ConvSpec.make(32, 1024, 14, 14, 256, 1, 1, conv_pass="wgrad"), "wgrad_tc_implicit_gemm_3xf16"),
    (ConvSpec.make(32, 3, 224, 224, 64, 7, 7, 2, 3, conv_pass="wgrad"), "wgrad_tc_implicit_gemm_3xf16"),
])
def test_untuned_choice_for_wgrad_specs(spec, first):
    order = [v.name for v in ranked("auto", spec, NOMINAL_CUDA)]
    assert order[0] == first and order[-1] == "wgrad_direct", order


def test_depthwise_wgrad_leaves_the_gemm_last():
    """One channel per group: a GEMM tile of one row is idle; wgrad_direct (or a depthwise kernel)
    ranks above wgrad_implicit_gemm."""
    spec = ConvSpec.make(8, 32, 28, 28, 32, 3, 3, 1, 1, groups=32, conv_pass="wgrad")
    order = [v.name for v in ranked("auto", spec, NOMINAL_CUDA)]
    assert order[-1] == "wgrad_implicit_gemm" and "wgrad_direct" in order, order


# -- nvcc sm_90 -----------------------------------------------------------------------------
RESNET = [ConvSpec.make(32, c, hw, hw, c, 3, 3, 1, 1, conv_pass="wgrad") for c, hw in ((64, 56), (512, 7))]
COMPILE_SPECS = RESNET + [ConvSpec.make(32, 256, 56, 56, 64, 1, 1, conv_pass="wgrad"),
                          ConvSpec.make(32, 256, 56, 56, 512, 1, 1, 2, conv_pass="wgrad"),
                          WGRAD_SPECS[4], WGRAD_SPECS[8], WGRAD_SPECS[12]]


def test_cuda_sources_compile_without_spills(nvcc_ok):
    """For every variant: the default on every layer the variant takes, and a sampled point of the
    tuning space on every other one of them (one nvcc run for all)."""
    sources = []
    for name in VARIANTS:
        v = get_variant(name)
        specs = [spec for spec in COMPILE_SPECS if not v.applies(spec, NOMINAL_CUDA)]
        mine = [(f"{name} [{params.short()}] {spec.short()}", v.plan(spec, params, NOMINAL_CUDA).source("cuda"))
                for i, spec in enumerate(specs) for params in sample(v, spec, NOMINAL_CUDA, k=1 - i % 2, seed=11)]
        assert len(mine) >= 2, name
        sources += mine
    assert_sources_compile_clean(sources)  # one nvcc run


def test_atomic_source_compiles_for_sm90(nvcc_ok, monkeypatch):
    monkeypatch.setattr(config, "deterministic", False)
    v = get_variant("wgrad_implicit_gemm")
    spec = RESNET[0]
    assert_compiles_clean(v, spec, v.default(spec, NOMINAL_CUDA).replace(at=1), NOMINAL_CUDA)


# -- the bias gradient ------------------------------------------------------------------------
BIAS_SPECS = [ConvSpec.make(3, 4, 9, 7, 5, 3, 3, 1, 0), ConvSpec.make(2, 3, 12, 12, 6, 3, 3, 1, 1),
              ConvSpec.make(1, 2, 40, 37, 3, 1, 1), ConvSpec.make(4, 3, 50, 50, 5, 1, 1),
              ConvSpec.make(5, 2, 41, 43, 3, 1, 1)]


def _bias_grad(ocl, spec: ConvSpec, params: Params | None, dy: np.ndarray) -> np.ndarray:
    plan = bias_grad_plan(spec, ocl.device, params)
    exe = ocl.executable(plan)
    for buf, (_, nbytes) in zip(exe.workspace().values(), plan.workspace, strict=True):
        ocl.fill(buf, float("nan"), nbytes)
    bufs = {"y": ocl.upload(dy), "bias": ocl.upload(np.full(spec.k, np.nan, np.float32))}
    exe(bufs)
    ocl.synchronize()
    return ocl.download(bufs["bias"], (spec.k,))


@pytest.mark.parametrize("spec", BIAS_SPECS, ids=_ids)
def test_bias_grad_on_pocl(ocl, spec):
    rng = np.random.default_rng(1)
    dy = rng.uniform(-1, 1, spec.y_shape).astype(np.float32)
    pts = [None] + [p for p in bias_grad_space(spec, NOMINAL_CUDA) if p.bt <= 256][:3] + [Params(bt=32, sp=3)]
    for p in pts:
        got = _bias_grad(ocl, spec, p, dy)
        assert rel_l2(got, bias_grad_ref(dy)) < 1e-6, p
        assert got.tobytes() == _bias_grad(ocl, spec, p, dy).tobytes()


def test_bias_grad_plan_names_its_buffers_and_refuses_bad_params(ocl, nvcc_ok):
    spec = ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1, conv_pass="wgrad")
    plan = bias_grad_plan(spec, NOMINAL_CUDA)
    assert plan.params.sp > 1 and {a for st in plan.steps for a in st.args} == {"y", "bias", "bpart"}
    from convforge.codegen.nvcc import ptxas_report

    assert all(i.spill_stores == 0 for i in ptxas_report(plan.source("cuda")))
    with pytest.raises(ValueError, match="bt \\(100\\) must be a power of two"):
        bias_grad_plan(spec, ocl.device, Params(bt=100, sp=1))
    with pytest.raises(ValueError, match="only float32"):
        bias_grad_plan(dataclasses.replace(spec, dtype="float16"), ocl.device)


def test_native_autograd_setting_is_on_by_default_and_named_when_bad() -> None:
    """CONVFORGE_NATIVE_AUTOGRAD: the C++ autograd node is the default (it ran the GPU tier's training
    tests); 0 keeps Python's node."""
    from convforge.config import Config, ConfigError

    assert Config({}).native_autograd is True and Config({"CONVFORGE_NATIVE_AUTOGRAD": "0"}).native_autograd is False
    with pytest.raises(ConfigError, match="CONVFORGE_NATIVE_AUTOGRAD"):
        _ = Config({"CONVFORGE_NATIVE_AUTOGRAD": "sometimes"}).native_autograd
