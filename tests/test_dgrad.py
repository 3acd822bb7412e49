"""dgrad (bprop) variants: the stride-1 adapters over the forward families (``dgrad_<forward>``) and
the strided phase GEMM (``dgrad_strided_gemm``) on PoCL against the float64 reference (check_plan
poisons dx with NaN) on odd shapes and sampled tuning points; every CUDA source through nvcc sm_90
without spills; the filter transforms as weight steps; refusals; the untuned heuristic's picks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from conftest import NOMINAL_CUDA, NOMINAL_OPENCL_GPU
from convforge.backends.base import output_buffer, weight_steps
from convforge.check import check_plan, pass_inputs
from convforge.dtypes import from_storage, to_storage
from convforge.kernels import all_variants, get_variant, most_specialised
from convforge.kernels.dgrad import DgradTransposed, transposed_spec
from convforge.kernels.dgrad.interleave import Part, interleave_kernel, vector_width
from convforge.kernels.dgrad.strided import Axis
from convforge.kernels.dgrad.transposed import FORWARD, SUBSAMPLED, DgradSubsampled, subgrid_part, subsampled_spec
from convforge.params import Params
from convforge.plan import Epilogue, Launch, Plan
from convforge.reference import dgrad_ref, rel_l2
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, assert_sources_compile_clean, ptxas_reports, sample

# ODD_SPECS (N=1, primes, stride 2 and (1, 2) and 4 with sizes not divisible by the stride, dilation
# 2, asymmetric padding, 1x1, 11x11/4) plus: Winograd-sized stride-1 layers (several tiles, an edge),
# asymmetric padding that keeps the transposed padding >= 0, dilation with stride 2, 1x1 at stride 2
# (three phases of zeros), stride 3 with a phase no tap reaches (dilation 3), grouped layers, a 1x1
# layer deep enough for split-K.
OWN = [
    ConvSpec.make(2, 8, 13, 11, 12, 3, 3, 1, 1),
    ConvSpec.make(1, 16, 9, 10, 8, 3, 3, 1, (2, 0, 1, 2)),
    ConvSpec.make(2, 9, 15, 14, 10, 3, 3, 2, 2, 2),
    ConvSpec.make(1, 8, 13, 13, 12, 1, 1, 2),
    ConvSpec.make(1, 5, 16, 17, 6, 3, 3, 3, 3, 3),
    ConvSpec.make(1, 12, 10, 10, 20, 5, 3, 1, (2, 2, 1, 1), groups=4),
    ConvSpec.make(2, 6, 11, 9, 4, 3, 2, stride=(2, 3), padding=(1, 0, 2, 1), dilation=(1, 2), groups=2),
    ConvSpec.make(1, 6, 5, 5, 40, 1, 1),  # 1x1 with K >= 32: the transposed split-K 1x1
    # strided 1x1 (dgrad_sub_*): stride 3 x 2 with asymmetric padding (the sub-grid starts at row 1 and
    # column 1, its last rows past dx), stride 4 on a prime size, N=1
    ConvSpec.make(2, 7, 11, 13, 5, 1, 1, (3, 2), (2, 0, 1, 1)),
    ConvSpec.make(1, 5, 17, 17, 9, 1, 1, 4, (0, 3, 0, 0)),
    ConvSpec.make(1, 6, 9, 11, 40, 1, 1, 2, (1, 0, 0, 1)),  # K >= 32: the split-K sub-grid GEMM
    ConvSpec.make(1, 16, 1, 1, 16, 1, 1, 2, 1),  # no tap reaches dx (its one row is padding): dx all zeros
]
SPECS = [s.with_pass("dgrad") for s in ODD_SPECS + OWN]
DGRAD = [v.name for v in all_variants() if "dgrad" in v.passes]
ADAPTERS = [v.name for v in all_variants() if isinstance(v, DgradTransposed) and not isinstance(v, DgradSubsampled)]
SUBS = [v.name for v in all_variants() if isinstance(v, DgradSubsampled)]
MINE = ADAPTERS + SUBS + ["dgrad_strided_gemm"]  # dgrad_direct: test_backward; depthwise_dgrad: test_depthwise
OPENCL = [n for n in MINE if "opencl" in get_variant(n).backends]


def test_every_forward_variant_worth_it_has_its_adapter():
    """A forward variant renamed or moved by another change would silently lose its dgrad form."""
    missing = [f for f in FORWARD if f"dgrad_{f}" not in DGRAD]
    missing += [f for f in SUBSAMPLED if f"dgrad_sub_{f}" not in DGRAD]
    assert not missing, f"forward variants without a dgrad adapter (renamed?): {missing}"
    for name in ADAPTERS:
        v, f = get_variant(name), get_variant(name.removeprefix("dgrad_"))
        assert (v.family, v.precision, v.tolerance, v.exact, v.backends) == (
            f.family, f.precision, f.tolerance, f.exact, f.backends), name


# -- the transposed problem and the stride phases ---------------------------------------------------
def test_transposed_spec_is_the_forward_problem_of_dx():
    spec = ConvSpec.make(2, 6, 13, 11, 4, 5, 3, 1, (1, 3, 0, 2), (2, 1), groups=2, conv_pass="dgrad")
    t = transposed_spec(spec)
    assert isinstance(t, ConvSpec)
    assert (t.n, t.c, t.h, t.w, t.k, t.r, t.s, t.groups) == (2, 4, spec.p, spec.q, 6, 5, 3, 2)
    assert t.pad == (8 - 1, 8 - 3, 2, 0) and t.dilation == (2, 1) and t.conv_pass == "fprop"
    assert (t.p, t.q) == (spec.h, spec.w)
    assert "stride" in str(transposed_spec(ConvSpec.make(1, 2, 9, 9, 2, 3, 3, 2, conv_pass="dgrad")))
    why = transposed_spec(ConvSpec.make(1, 2, 9, 9, 2, 1, 1, 1, 1, conv_pass="dgrad"))
    assert isinstance(why, str) and "negative padding" in why


@pytest.mark.parametrize("taps, stride, dil, pad", list(itertools.product((1, 2, 3, 5, 11), (1, 2, 3, 4), (1, 2, 3),
                                                                            (0, 1, 2, 5))))
def test_stride_phases_partition_the_taps(taps, stride, dil, pad):
    """Every tap reaches exactly one phase, as the (r // step)-th of its taps, and reads the dy row
    that the definition h + pad - r*dil = p*stride gives."""
    a = Axis(size=23, out=9, taps=taps, stride=stride, dil=dil, pad=pad)
    assert sum(a.counts) == taps and a.firsts[0] == 0
    for ph in range(stride):
        for idx, r in enumerate(a.taps_of(ph)):
            assert r // a.step == idx
            for i in range(4):
                h = ph + i * stride
                assert (h + pad - r * dil) == (i + a.offset(ph, r)) * stride


# -- PoCL against the float64 reference ------------------------------------------------------------
@pytest.mark.parametrize("name", OPENCL)
def test_dgrad_variant_on_pocl(ocl, name):
    """The default on every spec the variant applies to, and sampled points: two on the first and
    the last of them for the strided GEMM, one on the first for the adapters (their kernels are the
    forward variants', which the forward tests sample on the odd shapes too)."""
    v = get_variant(name)
    ran = [s for s in SPECS if v.applies(s, ocl.device) is None]
    assert ran, f"{name} applies to none of the odd shapes"
    strided = name == "dgrad_strided_gemm"
    k = 2 if strided else 1
    for j, spec in enumerate(ran):
        edge = spec in (ran[0], ran[-1]) if strided else spec == ran[0]
        points = sample(v, spec, ocl.device, k=k, seed=j) if edge else [v.default(spec, ocl.device)]
        for i, params in enumerate(points):
            res = check_plan(v.plan(spec, params, ocl.device), ocl, seed=10 * j + i)
            assert res.ok, f"{name} [{params.short()}] {spec.short()}: {res}"


def test_weight_steps_run_apart(ocl):
    """The rotated filter and Winograd's U are weight steps: running them once ("weights") and then
    the rest on fresh dy gives dx of the new dy (what the torch FilterCache does per weight version)."""
    spec = ConvSpec.make(2, 8, 9, 9, 12, 3, 3, 1, 1, conv_pass="dgrad")
    for name in ("dgrad_winograd_nonfused_f2", "dgrad_strided_gemm"):
        v = get_variant(name)
        exe = ocl.executable(v.plan(spec, v.default(spec, ocl.device), ocl.device))
        rng = np.random.default_rng(5)
        first, second = pass_inputs(spec, rng), pass_inputs(spec, rng)
        bufs = {"w": ocl.upload(first["w"]), "y": ocl.upload(first["y"]),
                "x": ocl.upload(np.full(spec.x_shape, np.nan, np.float32))}
        exe(bufs, steps="weights")
        bufs["y"] = ocl.upload(second["y"])
        exe(bufs, steps="rest")
        ocl.synchronize()
        got = ocl.download(bufs["x"], spec.x_shape)
        assert rel_l2(got, dgrad_ref(second["y"], first["w"], spec)) < 1e-5, name


@pytest.mark.parametrize("name", ["dgrad_winograd_fused_f4", "dgrad_winograd_nonfused_f6"])
def test_winograd_dgrad_error_within_the_stated(ocl, name):
    """The adapters state the forward variant's expected error; measured on a ResNet-like layer it
    holds (the module docstring of kernels/dgrad/transposed.py has the table of the four layers)."""
    spec = ConvSpec.make(1, 128, 14, 14, 128, 3, 3, 1, 1, conv_pass="dgrad")
    v = get_variant(name)
    res = check_plan(v.plan(spec, v.default(spec, ocl.device), ocl.device), ocl, seed=0)
    assert res.ok and 0.2 * v.expected_error(spec) < res.rel_err <= v.expected_error(spec), f"{name}: {res}"


# -- weight steps, refusals ------------------------------------------------------------------------
@pytest.mark.parametrize("name, derived", [
    ("dgrad_winograd_fused_f4", {"w_rot", "fwd_wino_u"}),
    ("dgrad_winograd_nonfused_f4", {"w_rot", "fwd_wino_u"}),
    ("dgrad_im2win", {"w_rot", "fwd_wt"}),
    ("dgrad_implicit_gemm", {"w_rot"}),
    ("dgrad_implicit_gemm_precomp", {"w_rot", "fwd_tab"}),
    ("dgrad_strided_gemm", {"wph"}),
])
def test_filter_transforms_are_weight_steps(name, derived):
    """The rotation (or the phase packing) and the forward plan's own filter transform
    depend on the filters alone: weight_steps() classifies them so, and nothing reading dy."""
    spec = ConvSpec.make(4, 64, 14, 14, 32, 3, 3, 1, 1, conv_pass="dgrad")
    v = get_variant(name)
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    steps, names = weight_steps(plan)
    assert set(names) == derived
    assert 0 in steps and len(steps) == len(derived)
    reading_dy = [i for i, s in enumerate(plan.steps) if "y" in getattr(s, "args", ())]
    assert reading_dy and not set(reading_dy) & steps


def test_adapter_refusals():
    strided = ConvSpec.make(1, 4, 9, 9, 4, 3, 3, 2, 1, conv_pass="dgrad")
    v = get_variant("dgrad_implicit_gemm")
    assert "dgrad_strided_gemm runs strided layers" in (v.applies(strided, NOMINAL_CUDA) or "")
    big_pad = ConvSpec.make(1, 4, 9, 9, 4, 3, 3, 1, 3, conv_pass="dgrad")
    assert "negative padding" in (v.applies(big_pad, NOMINAL_CUDA) or "")
    three = ConvSpec.make(1, 4, 9, 9, 4, 3, 3, 1, 1, conv_pass="dgrad")
    why = get_variant("dgrad_gemm1x1").applies(three, NOMINAL_CUDA) or ""
    assert why.startswith("gemm1x1 on the transposed problem") and "only 1x1 filters" in why
    im2win = get_variant("dgrad_im2win")
    assert "does not take grouped" in (im2win.applies(OWN[5].with_pass("dgrad"), NOMINAL_CUDA) or "")
    assert v.grouped and v.applies(OWN[5].with_pass("dgrad"), NOMINAL_CUDA) is None  # grouped forward
    assert get_variant("dgrad_strided_gemm").applies(OWN[5].with_pass("dgrad"), NOMINAL_CUDA) is None
    fwd = ConvSpec.make(1, 4, 9, 9, 4, 3, 3, 1, 1)
    assert "does not compute fprop" in (v.applies(fwd, NOMINAL_CUDA) or "")
    for name in ("dgrad_implicit_gemm", "dgrad_strided_gemm"):
        w = get_variant(name)
        with pytest.raises(ValueError, match=f"unsupported epilogue: {name} writes a gradient"):
            w.plan(three, w.default(three, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(relu=True))


def test_precision_classes_follow_the_forward_variant():
    spec = ConvSpec.make(8, 64, 28, 28, 64, 3, 3, 1, 1, conv_pass="dgrad")
    for name, cls in (("dgrad_winograd_fused_f4", "fp32"), ("dgrad_winograd_nonfused_f6", "relaxed"),
                      ("dgrad_winograd_nonfused_f7", "relaxed"), ("dgrad_implicit_gemm_tf32", "relaxed"),
                      ("dgrad_implicit_gemm_3xtf32", "fp32"), ("dgrad_strided_gemm", "fp32")):
        v = get_variant(name)
        assert v.precision == cls, name
    f4, f4_fwd = get_variant("dgrad_winograd_fused_f4"), get_variant("winograd_fused_f4")
    assert f4.expected_error(spec) == f4_fwd.expected_error(spec.with_pass("fprop"))


# -- the untuned heuristic -------------------------------------------------------------------------
@pytest.mark.parametrize("layer, family, first", [
    # 3xFP16's dgrad_first (round 32): 3x3 of C, K >= 64 and 1x1 where dx has C >= 256
    ((32, 64, 56, 56, 64, 3, 3, 1, 1), "implicit_gemm", "dgrad_tc_implicit_gemm_3xf16"),
    ((32, 256, 14, 14, 256, 3, 3, 1, 1), "implicit_gemm", "dgrad_tc_implicit_gemm_3xf16"),
    ((32, 512, 7, 7, 512, 3, 3, 1, 1), "implicit_gemm", "dgrad_tc_implicit_gemm_3xf16"),
    ((32, 256, 56, 56, 64, 1, 1, 1, 0), "implicit_gemm", "dgrad_tc_implicit_gemm_3xf16"),
    ((32, 64, 56, 56, 256, 1, 1, 1, 0), "gemm1x1", "dgrad_gemm1x1"),  # dx of 64 channels: CUDA cores
    ((32, 1024, 14, 14, 256, 1, 1, 1, 0), "implicit_gemm", "dgrad_tc_implicit_gemm_3xf16"),
    ((32, 32, 28, 28, 32, 3, 3, 1, 1), "winograd", "dgrad_winograd_nonfused_f4"),  # 32 channels: below 3xFP16's rule
    ((32, 128, 56, 56, 128, 3, 3, 2, 1), "implicit_gemm", "dgrad_tc_strided_3xtf32"),  # sm_90: 3xTF32 phases
    ((32, 512, 28, 28, 1024, 1, 1, 2, 0), "implicit_gemm", "dgrad_tc_strided_3xtf32"),
    ((1, 3, 224, 224, 64, 7, 7, 2, 3), "direct", "dgrad_direct"),  # C=3: no GEMM tile
    ((32, 256, 28, 28, 256, 3, 3, 2, 1, 1, 8), "implicit_gemm", "dgrad_strided_gemm"),  # 32 channels a group
    ((32, 256, 28, 28, 256, 3, 3, 2, 1, 1, 32), "direct", "dgrad_direct"),  # 8 channels a group
])
def test_heuristic_picks_for_resnet_dgrad(layer, family, first):
    spec = ConvSpec.make(*layer, conv_pass="dgrad")
    v, params = most_specialised("auto", spec, NOMINAL_CUDA, precision="fp32")
    assert (v.family, v.name) == (family, first)
    assert v.plan(spec, params, NOMINAL_CUDA).spec == spec


@pytest.mark.parametrize("layer, first", [
    ((32, 512, 7, 7, 2048, 1, 1), "dgrad_tc_implicit_gemm_tf32"),  # dgrad_first: C >= 512, K >= 512
    ((32, 512, 28, 28, 128, 1, 1), "dgrad_tc_implicit_gemm_tf32"),  # C >= 512, N H W >= 16384
    ((32, 1024, 14, 14, 256, 1, 1), "dgrad_tc_implicit_gemm_tf32"),  # neither: the forward's order on 256 -> 1024
    ((32, 64, 56, 56, 256, 1, 1), "dgrad_gemm1x1_wgmma_tf32"),  # the forward's order on 256 -> 64 @ 56
    ((32, 128, 56, 56, 128, 3, 3, 2, 1), "dgrad_tc_strided_tf32"),
    ((32, 1024, 14, 14, 2048, 1, 1, 2), "dgrad_tc_strided_tf32"),  # above dgrad_sub_gemm1x1_wgmma_tf32
])
def test_heuristic_picks_for_resnet50_relaxed_dgrad(layer, first):
    spec = ConvSpec.make(*layer, conv_pass="dgrad")
    assert most_specialised("auto", spec, NOMINAL_CUDA, precision="relaxed")[0].name == first


# -- nvcc sm_90 ------------------------------------------------------------------------------------
COMPILE_SPECS = [ConvSpec.make(8, 128, 28, 28, 64, 3, 3, 1, 1, conv_pass="dgrad"),
                 ConvSpec.make(8, 256, 14, 14, 128, 1, 1, conv_pass="dgrad"),
                 ConvSpec.make(1, 256, 14, 14, 256, 3, 3, 1, 1, conv_pass="dgrad"),  # N=1: split-K
                 ConvSpec.make(1, 832, 7, 7, 256, 1, 1, conv_pass="dgrad"),
                 ConvSpec.make(3, 7, 13, 11, 5, 3, 3, 1, (0, 1, 1, 0), conv_pass="dgrad"),
                 ConvSpec.make(8, 128, 28, 28, 64, 3, 3, 1, 1, dtype="float16", conv_pass="dgrad"),
                 ConvSpec.make(8, 256, 14, 14, 128, 1, 1, dtype="bfloat16", conv_pass="dgrad"),
                 # grouped (8 groups of 16 -> 32 channels): the tensor-core grouped GEMM's adapters only
                 ConvSpec.make(8, 128, 14, 14, 256, 3, 3, 1, 1, groups=8, conv_pass="dgrad"),
                 ConvSpec.make(8, 128, 14, 14, 256, 3, 3, 1, 1, groups=8, dtype="float16", conv_pass="dgrad")]
# The forward variant's own default spills on the transposed odd problem (fprop N3 C5 12x10 -> K7
# 3x3 pad (2, 1, 1, 2): 255 registers, 24 B spilled): a defect of the forward kernel, not of the adapter.
FORWARD_SPILLS = {("dgrad_implicit_gemm_3xtf32", 4)}


ODD_COMPILE = 4  # the odd layer: asymmetric padding, prime channels (the transposed problem's own padding)
N1_COMPILE = (2, 3)  # N=1 layers: the split-K adapters' split


def _compile_cases() -> dict[str, list[int]]:
    """Each adapter's default on the first compile spec of each filter size and dtype it applies to, and on
    the odd layer; the N=1 layers for the split-K adapters only. The adapter's kernels are its forward
    variant's (compiled on many more shapes by that variant's own tests) on the transposed problem, so a
    second ResNet-like layer of the same filter size and dtype adds size constants only."""
    cases: dict[str, list[int]] = {}
    for n in ADAPTERS:
        v, compiled = get_variant(n), set()
        for i, s in enumerate(COMPILE_SPECS):
            if v.applies(s, NOMINAL_CUDA) is not None or (s.groups > 1) != ("grouped" in n):
                continue
            if i in N1_COMPILE and "splitk" not in n:
                continue
            key = (s.r, s.s, s.dtype, i in N1_COMPILE)
            if key in compiled and i != ODD_COMPILE and (n, i) not in FORWARD_SPILLS:
                continue
            compiled.add(key)
            cases.setdefault(n, []).append(i)
    return cases


COMPILE_CASES = _compile_cases()


def test_adapter_compiles_for_sm90(nvcc_ok):
    """Every adapter's default on the ResNet-like layers (3x3, 1x1; N=1 for the split-K ones; float16
    and bfloat16 for the half ones) and an odd one, those it applies to (COMPILE_CASES; test_every_
    adapter_has_a_compile_spec checks there is one), all through one nvcc run per target (helpers.
    ptxas_reports). A FORWARD_SPILLS case must still spill: once it does not, it leaves that set."""
    cases = [(name, i) for name, which in COMPILE_CASES.items() for i in which]
    assert set(ADAPTERS) <= {name for name, _ in cases}
    sources = []
    for name, i in cases:
        v = get_variant(name)
        sources.append(v.plan(COMPILE_SPECS[i], v.default(COMPILE_SPECS[i], NOMINAL_CUDA), NOMINAL_CUDA).source("cuda"))
    for (name, i), infos in zip(cases, ptxas_reports(sources), strict=True):
        assert infos, f"{name} on COMPILE_SPECS[{i}]: ptxas reported no kernel"
        spills = [info for info in infos if info.spill_stores or info.spill_loads]
        if (name, i) in FORWARD_SPILLS:
            assert spills, f"{name} on COMPILE_SPECS[{i}] no longer spills: take it out of FORWARD_SPILLS"
        else:
            assert not spills, f"{name} on COMPILE_SPECS[{i}] spills: {spills}"


def test_every_adapter_has_a_compile_spec():
    for name in ADAPTERS:
        assert any(get_variant(name).applies(s, NOMINAL_CUDA) is None for s in COMPILE_SPECS), name


STRIDED_COMPILE = [ConvSpec.make(32, 128, 56, 56, 128, 3, 3, 2, 1), ConvSpec.make(32, 256, 56, 56, 512, 1, 1, 2),
                   ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1), ODD_SPECS[4], OWN[6]]


def test_strided_compiles_for_sm90(nvcc_ok):
    """dgrad_strided_gemm's default and two seeded points of its space on each STRIDED_COMPILE layer,
    all through one nvcc run: no spills."""
    v = get_variant("dgrad_strided_gemm")
    assert_sources_compile_clean([(f"{v.name} [{params.short()}] {spec.short()}",  # one nvcc run
                                   v.plan(spec, params, NOMINAL_CUDA).source("cuda"))
                                  for spec in [s.with_pass("dgrad") for s in STRIDED_COMPILE]
                                  for params in sample(v, spec, NOMINAL_CUDA, k=2, seed=1)])


def test_strided_defaults_are_big_tiles_on_big_layers():
    v = get_variant("dgrad_strided_gemm")
    for layer in STRIDED_COMPILE[:3]:
        p = v.default(layer.with_pass("dgrad"), NOMINAL_CUDA)
        assert p.bm * p.bn >= 64 * 128 and p.va == 4 and p.db == 1, p.short()
    assert v.space(STRIDED_COMPILE[0].with_pass("dgrad"), NOMINAL_OPENCL_GPU)


@pytest.mark.parametrize("name", ADAPTERS)
def test_every_adapter_keeps_its_rotation_as_a_weight_step(name):
    """For every adapter (tensor-core ones included) the rotation is step 0 and a weight step, every
    step of the forward plan keeps its kernel and launch geometry, and only x (dx) is written of the
    conv buffers."""
    v = get_variant(name)
    spec = next(s for s in COMPILE_SPECS if v.applies(s, NOMINAL_CUDA) is None)
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    inner = v.fwd.plan(transposed_spec(spec), v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    steps, derived = weight_steps(plan)
    assert 0 in steps and "w_rot" in derived and plan.spec == spec
    assert plan.kernels[1:] == inner.kernels and len(plan.steps) == len(inner.steps) + 1
    for mine, theirs in zip(plan.steps[1:], inner.steps, strict=True):
        assert getattr(mine, "grid", None) == getattr(theirs, "grid", None)
    assert output_buffer(plan) == "x"


# -- strided 1x1 through the sub-grid, and the interleave pass --------------------------------------
def test_subsampled_spec_and_part_place_the_sub_grid():
    """The sub-grid problem is the stride-1 1x1 forward problem of dy's P x Q grid; its rows land on
    dx rows (h + pt) % sh == 0, row p at h = p * sh - pt."""
    spec = ConvSpec.make(2, 7, 11, 13, 5, 1, 1, (3, 2), (2, 0, 1, 1), conv_pass="dgrad")
    t = subsampled_spec(spec)
    assert isinstance(t, ConvSpec)
    assert (t.n, t.c, t.h, t.w, t.k) == (2, 5, spec.p, spec.q, 7)
    assert (t.stride, t.pad, t.conv_pass) == ((1, 1), (0,) * 4, "fprop")
    part = subgrid_part(spec)
    for h in range(spec.h):
        a, ph = divmod(h, 3)
        if ph == part.ph:
            assert (h + 2) % 3 == 0 and a + part.oh == (h + 2) // 3
    assert "1x1" in str(subsampled_spec(ConvSpec.make(1, 2, 9, 9, 2, 3, 3, 2, conv_pass="dgrad")))
    assert "stride 1" in str(subsampled_spec(ConvSpec.make(1, 2, 9, 9, 2, 1, 1, 1, conv_pass="dgrad")))


INTERLEAVE = [
    (ConvSpec.make(2, 3, 9, 7, 4, 3, 3, 2, 1), "float32", None),  # every phase, odd sizes: short last rows
    (ConvSpec.make(1, 2, 13, 10, 3, 1, 1, (3, 4), (2, 0, 1, 0)), "float32", "sub"),  # one phase, offsets
    (ConvSpec.make(1, 5, 8, 11, 3, 3, 3, (2, 3)), "float16", ((0, 0), (1, 2))),  # two of six phases, halves
    # vector forms (8 / 4 elements a thread): rows of 16 / 12 / 24, channels 8 / 4 / 16
    (ConvSpec.make(2, 8, 10, 16, 4, 4, 4, 2, 1), "float16", None),  # NCHW 8 a thread, the column phase fixed
    (ConvSpec.make(1, 4, 7, 12, 3, 3, 3, (2, 3)), "bfloat16", ((0, 0), (1, 1), (1, 2))),  # 4 a thread, 4 % 3
    (ConvSpec.make(1, 16, 24, 24, 3, 16, 16, 8, 4), "float32", ((0, 0), (3, 5), (7, 7))),  # stride 8, float4 x 2
]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("spec, dtype, which", INTERLEAVE, ids=lambda v: str(v))
def test_interleave_writes_every_dx_element_from_its_phase(ocl, spec, dtype, which, layout):
    """On PoCL, dx NaN-poisoned: each element is its phase buffer's value where the phase has one
    (offsets and bounds of :class:`Part`), zero everywhere else; channels-last dx and phase buffers
    (N x bh x bw x C) alike."""
    spec = ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "pass": "dgrad", "layout": layout})
    sh, sw = spec.stride
    if which == "sub":
        parts = [subgrid_part(spec)]
    else:
        keep = which or [(a, b) for a in range(sh) for b in range(sw)]
        parts = [Part(f"p{a}{b}", a, b, -(-(spec.h - a) // sh), -(-(spec.w - b) // sw)) for a, b in keep]
    kern, grid = interleave_kernel("il", spec, parts)
    run = spec.c if layout == "nhwc" else spec.w
    assert vector_width(spec) == (8 if run % 8 == 0 else 4 if run % 4 == 0 else 1)
    assert f"({vector_width(spec)} element" in kern.comment
    rng = np.random.default_rng(3)
    data = {p.buf: rng.uniform(-1, 1, (spec.n, spec.c, p.bh, p.bw)).astype(np.float32) for p in parts}
    if dtype != "float32":
        data = {k: from_storage(to_storage(v, dtype), dtype) for k, v in data.items()}
    want = np.zeros(spec.x_shape, np.float32)
    for p in parts:
        for h in range(p.ph, spec.h, sh):
            for w in range(p.pw, spec.w, sw):
                r, q = h // sh + p.oh, w // sw + p.ow
                if r < p.bh and q < p.bw:
                    want[:, :, h, w] = data[p.buf][:, :, r, q]
    steps = (Launch(kern.name, grid, kern.block, tuple(p.buf for p in parts) + ("x",)),)
    plan = Plan("il", "dgrad", spec, Params(), (kern,), steps, (), 0.0)
    lay = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1))) if layout == "nhwc" else (lambda a: a)
    bufs = {k: ocl.upload(to_storage(lay(v), dtype)) for k, v in data.items()}
    bufs["x"] = ocl.upload(to_storage(lay(np.full(spec.x_shape, np.nan, np.float32)), dtype))
    ocl.executable(plan)(bufs)
    ocl.synchronize()
    n, c, h, w = spec.x_shape
    got = ocl.download(bufs["x"], (n, h, w, c) if layout == "nhwc" else spec.x_shape, dtype)
    np.testing.assert_array_equal(got.transpose(0, 3, 1, 2) if layout == "nhwc" else got, want)


ZERO_PHASES = [(ConvSpec.make(2, 8, 16, 16, 4, 1, 1, 2), "float16"),  # 1x1 / 2: three empty phases, 8 a thread
               (ConvSpec.make(1, 4, 9, 12, 3, 1, 1, (2, 3)), "bfloat16"),  # five empty phases, 4 a thread, 4 % 3
               (ConvSpec.make(1, 3, 7, 9, 5, 2, 2, 4, 0), "float32"),  # 2x2 / 4: 12 of 16 empty, 1 a thread
               (ConvSpec.make(1, 16, 10, 8, 5, 1, 3, (3, 2), (0, 1, 0, 0)), "float32")]  # rows 1, 2 empty only


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("spec, dtype", ZERO_PHASES, ids=str)
def test_zero_phases_zero_every_element_no_tap_reaches(ocl, spec, dtype, layout):
    """The strided dgrad's zero step on PoCL, dx NaN-poisoned: every element of a phase no tap reaches
    is zero; in NHWC nothing else is written; in NCHW a vector may also zero its other elements (the
    phases' GEMMs run after it and write theirs)."""
    from convforge.kernels.tensorcore.sm90.dgrad import phases, zero_phases

    spec = ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "pass": "dgrad", "layout": layout})
    made = zero_phases("zp", spec)
    assert made is not None
    kern, grid = made
    empty = np.zeros(spec.x_shape, bool)
    for ph in phases(spec):
        if ph.empty:
            empty[:, :, ph.ah.ph::spec.stride[0], ph.aw.ph::spec.stride[1]] = True
    assert empty.any() and not empty.all()
    plan = Plan("zp", "dgrad", spec, Params(), (kern,), (Launch(kern.name, grid, kern.block, ("x",)),), (), 0.0)
    n, c, h, w = spec.x_shape
    to = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1))) if layout == "nhwc" else (lambda a: a)
    bufs = {"x": ocl.upload(to_storage(to(np.full(spec.x_shape, np.nan, np.float32)), dtype))}
    ocl.executable(plan)(bufs)
    ocl.synchronize()
    got = ocl.download(bufs["x"], (n, h, w, c) if layout == "nhwc" else spec.x_shape, dtype)
    got = got.transpose(0, 3, 1, 2) if layout == "nhwc" else got
    assert (got[empty] == 0).all()
    rest = got[~empty]
    assert np.isnan(rest).all() if layout == "nhwc" else (np.isnan(rest) | (rest == 0)).all()


def test_interleave_refuses_a_phase_twice_or_outside_the_stride():
    spec = ConvSpec.make(1, 2, 9, 9, 2, 3, 3, 2, 1, conv_pass="dgrad")
    with pytest.raises(ValueError, match="two buffers"):
        interleave_kernel("il", spec, [Part("a", 0, 0, 5, 5), Part("b", 0, 0, 5, 5)])
    with pytest.raises(ValueError, match="outside stride"):
        interleave_kernel("il", spec, [Part("a", 2, 0, 5, 5)])


SUB_COMPILE = [ConvSpec.make(32, 256, 56, 56, 512, 1, 1, 2, conv_pass="dgrad"),
               ConvSpec.make(32, 1024, 14, 14, 2048, 1, 1, 2, conv_pass="dgrad"),
               ConvSpec.make(8, 256, 28, 28, 512, 1, 1, 2, dtype="float16", conv_pass="dgrad"),
               ConvSpec.make(3, 7, 13, 11, 5, 1, 1, (3, 2), (2, 0, 1, 1), conv_pass="dgrad"),
               ConvSpec.make(1, 512, 14, 14, 1024, 1, 1, 2, conv_pass="dgrad")]  # N=1: split-K
# gemm1x1's own default spills 4 B in float16 on the sub-grid problem N8 C512 14x14 -> K256 (its forward
# kernel's defect, as FORWARD_SPILLS): compiled here in float32 only.
SUB_SPILLS = {("dgrad_sub_gemm1x1", "float16")}


def test_subsampled_plan_compiles_and_keeps_its_shape(nvcc_ok):
    """Each dgrad_sub_* default on the ResNet-50 1x1/2 layers it applies to: the rotation (a weight
    step), the forward plan of the sub-grid problem with dy as its input, the interleave last (the
    only step writing dx); nvcc sm_90 without spills (all of SUBS through one nvcc run)."""
    sources = []
    for name in SUBS:
        v = get_variant(name)
        specs = [s for s in SUB_COMPILE if v.applies(s, NOMINAL_CUDA) is None]
        assert specs, name
        for spec in specs:
            plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
            inner = v.fwd.plan(subsampled_spec(spec), v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
            steps, derived = weight_steps(plan)
            assert 0 in steps and "w_rot" in derived and output_buffer(plan) == "x", (name, spec)
            assert plan.kernels[1:-1] == inner.kernels and plan.steps[-1].args == ("dx_sub", "x"), (name, spec)
            assert all("x" not in getattr(s, "args", ()) for s in plan.steps[:-1]), (name, spec)
            if (name, spec.dtype) not in SUB_SPILLS:
                sources.append((f"{name} {spec.short()}", plan.source("cuda")))
    assert_sources_compile_clean(sources)  # one nvcc run


def test_many_phases_keep_their_tensor_maps_within_the_parameter_limit():
    """FCN-8s' 16x16 / 8 up-sampling: 64 phases. Their TMA maps would take 33,280 bytes of kernel
    parameters (CUDA allows 32,764: NVRTC refused it); the variant falls back to cp.async operands
    there, and a kernel over the limit is refused when it is made, not by the compiler."""
    from convforge.codegen.dialect import PARAM_BYTES_LIMIT, Buf, Kernel, TensorMap, param_bytes

    spec = ConvSpec(n=8, c=21, h=224, w=224, k=21, r=16, s=16, stride=(8, 8), pad=(4, 4, 4, 4), conv_pass="dgrad")
    for name in ("dgrad_tc_strided_3xtf32", "dgrad_tc_strided_3xf16", "dgrad_tc_strided_tf32"):
        v = get_variant(name)
        assert v.applies(spec, NOMINAL_CUDA) is None, name
        for params in [v.default(spec, NOMINAL_CUDA), *v.space(spec, NOMINAL_CUDA)[:6]]:
            plan = v.plan(spec, params, NOMINAL_CUDA)
            assert all(param_bytes(k.args) <= PARAM_BYTES_LIMIT for k in plan.kernels), (name, params.short())
    tmap = TensorMap("m", "tiled", "float32", (64, 64), (256,), (32, 32))
    assert param_bytes((Buf("x"), tmap, Buf("y"))) == 64 + 128 + 8
    with pytest.raises(ValueError, match=r"kernel k: its 300 parameters take \d+ bytes, over the 32764"):
        Kernel("k", tuple(TensorMap(f"m{i}", "tiled", "float32", (64, 64), (256,), (32, 32)) for i in range(300)),
               "", (128, 1, 1))


# -- a residual added to dx (a training block's two gradients of one input: torch/residual_grad.py) --------
RES_SPECS = [ConvSpec.make(2, 8, 9, 7, 12, 3, 3, 1, 1, conv_pass="dgrad"),  # odd planes
             ConvSpec.make(1, 16, 5, 5, 8, 1, 1, conv_pass="dgrad"),  # N = 1, 1x1
             ConvSpec.make(3, 5, 11, 13, 7, 3, 3, 1, (2, 0, 1, 1), conv_pass="dgrad")]  # asymmetric padding


RES_CASES = [(n, s) for s in RES_SPECS
             for n in ("dgrad_implicit_gemm", "dgrad_direct_smem", "dgrad_winograd_nonfused_f2")
             if s.r == 3 or "winograd" not in n]  # Winograd: 3x3 only


@pytest.mark.parametrize(("name", "spec"), RES_CASES, ids=lambda c: c if isinstance(c, str) else c.short())
def test_adapter_adds_a_residual_to_dx_on_pocl(ocl, name, spec):
    """``Epilogue(residual=True)`` on a stride-1 adapter whose forward stores a residual: dx + res against the
    float64 reference (check_plan draws res shaped as dx, in dx's layout, and poisons dx first)."""
    v = get_variant(name)
    assert v.applies(spec, ocl.device) is None, v.applies(spec, ocl.device)
    plan = v.plan(spec, v.default(spec, ocl.device), ocl.device, Epilogue(residual=True))
    assert "res" in plan.steps[-1].args
    res = check_plan(plan, ocl, seed=3)
    assert res.ok, f"{name} {spec.short()}: {res}"


def test_adapter_residual_refusals_and_the_tensor_core_form_compiles(nvcc_ok):
    """Only a residual is taken (a bias or an activation names itself), only where the forward stores one; the
    tensor-core half form with the residual (ResNet-50's 1x1 conv1 dgrad, NHWC) compiles without spills."""
    spec = ConvSpec.make(32, 256, 28, 28, 64, 1, 1, conv_pass="dgrad", layout="nhwc", dtype="float16")
    v = get_variant("dgrad_tc_implicit_gemm_half")
    with pytest.raises(ValueError, match="unsupported epilogue"):
        v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(bias=True))
    with pytest.raises(ValueError, match="unsupported epilogue"):
        v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(residual=True, relu=True))
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(residual=True))
    assert plan.steps[-1].args[-1] == "res" and plan.epilogue.residual
    for info in ptxas_reports([plan.source("cuda")])[0]:
        assert info.spill_stores == 0 and info.spill_loads == 0, info
