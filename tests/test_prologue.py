"""Pre-activation prologues (``Prologue``: batch norm -> ReLU folded into the conv's input load):
every variant that takes one, on PoCL against the float64 reference on the activated input
(NaN-poisoned output; odd shapes with padding, stride 2, groups, dilation), its CUDA source
through nvcc without spills, the refusals of the others, dispatch's choice, and one snapshot."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge import dispatch, kernels
from convforge.check import check_plan, expected, pass_inputs
from convforge.plan import Epilogue, Prologue
from convforge.reference import activate_ref, conv2d_ref
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean

FULL, AFFINE, RELU = Prologue(True, True), Prologue(affine=True), Prologue(relu=True)
# padding (asymmetric), stride 2, 1x1 with and without padding, grouped, dilated, a channel count
# that is no multiple of the Winograd channel block
SPECS = [ConvSpec.make(2, 5, 11, 13, 7, 3, 3, padding=(1, 0, 2, 1)),
         ConvSpec.make(1, 6, 17, 15, 5, 3, 3, stride=2, padding=1),
         ConvSpec.make(2, 9, 7, 9, 6, 1, 1),
         ConvSpec.make(1, 40, 5, 7, 6, 1, 1, stride=2, padding=1),
         ConvSpec.make(2, 6, 9, 9, 4, 3, 3, padding=1, groups=2),
         ConvSpec.make(1, 3, 13, 13, 4, 3, 3, padding=2, dilation=2)]
TAKING = sorted(v.name for v in kernels.all_variants() if v.prologue_ok)
POCL = [n for n in TAKING if "opencl" in kernels.get_variant(n).backends]


def test_the_families_densenet_needs_take_a_prologue() -> None:
    """1x1 (gemm1x1, split-K), 3x3 (direct, implicit GEMM, Winograd fused and non-fused: what
    ``auto`` picks on DenseNet-121's layers in the fp32 class, on sm_90 and on PoCL)."""
    assert {"gemm1x1", "gemm1x1_splitk", "implicit_gemm", "implicit_gemm_precomp", "implicit_gemm_splitk",
            "direct", "direct_smem", "direct_shfl", "im2col_gemm", "winograd_fused_f2", "winograd_fused_f4",
            "winograd_nonfused_f2", "winograd_nonfused_f4"} <= set(TAKING)


@pytest.mark.parametrize("name", POCL)
def test_every_prologue_variant_on_odd_shapes(ocl: Any, name: str) -> None:
    v = kernels.get_variant(name)
    ran = 0
    for i, spec in enumerate(SPECS):
        if v.applies(spec, ocl.device):
            continue
        pro, epi = [(FULL, Epilogue(bias=True, relu=True)), (AFFINE, Epilogue(residual=True)),
                    (RELU, Epilogue(bias=True))][i % 3]
        if epi.residual and not v.residual_ok:
            epi = Epilogue(bias=True)
        res = check_plan(v.plan_for(spec, v.default(spec, ocl.device), ocl.device, epi, pro), ocl, seed=i)
        assert res.ok, f"{name} {spec.short()} {pro}: {res}"
        ran += 1
    assert ran, f"{name} applies to none of the odd shapes"


@pytest.mark.parametrize("name, spec, select, mods", [
    # the split (thread per row/column) input transform of the non-fused family, own and shared GEMM
    ("winograd_nonfused_f4", SPECS[0], {}, dict(xi=1, xo=1)),
    ("winograd_nonfused_f2", SPECS[0], dict(gemm="sgemm"), dict(xi=1, xo=1)),
    # the fused kernel split over channels (its channel index starts at cb0), and its raw input
    # windows copied asynchronously to shared memory (ci=1: activated after, under the window's mask)
    ("winograd_fused_f2", ConvSpec.make(1, 23, 8, 8, 6, 3, 3, padding=1), dict(ks=2), {}),
    ("winograd_fused_f2", SPECS[0], dict(ci=1), {}),
    ("winograd_fused_f4", ConvSpec.make(1, 7, 9, 10, 5, 3, 3, padding=(0, 1, 1, 0)), dict(ci=1), {}),
    ("implicit_gemm_precomp", SPECS[1], {}, {}),
])
def test_prologue_on_other_paths(ocl: Any, name: str, spec: ConvSpec, select: dict[str, Any],
                                 mods: dict[str, Any]) -> None:
    """The first point of the space with ``select``, changed by ``mods`` (points the CPU space
    leaves out)."""
    v = kernels.get_variant(name)
    dev = ocl.device
    prm = next(p for p in v.space(spec, dev) if all(p.get(k) == val for k, val in select.items()))
    res = check_plan(v.plan_for(spec, prm.replace(**mods), dev, Epilogue(bias=True), FULL), ocl, seed=5)
    assert res.ok, res


def test_a_plan_that_ignores_its_prologue_fails_the_check(ocl: Any) -> None:
    """The check can fail: a plain plan labelled with a prologue is compared with the activated
    input's answer and misses it."""
    v, spec = kernels.get_variant("implicit_gemm"), SPECS[0]
    plain = v.plan(spec, v.default(spec, ocl.device), ocl.device)
    lied = dataclasses.replace(plain, prologue=FULL)
    assert check_plan(plain, ocl, seed=1).ok
    assert not check_plan(lied, ocl, seed=1).ok


def test_padding_stays_zero_in_the_reference() -> None:
    """expected() convolves the activated input with zero padding: a shift that would make
    max(shift, 0) > 0 in the padding does not reach the border outputs."""
    spec = ConvSpec.make(1, 1, 3, 3, 1, 3, 3, padding=1)
    inputs = {"x": np.zeros(spec.x_shape, np.float32), "w": np.ones(spec.w_shape, np.float32),
              "pscale": np.ones(1, np.float32), "pshift": np.ones(1, np.float32)}
    out = expected(spec, inputs, prologue=FULL)
    assert out[0, 0, 0, 0] == 4.0 and out[0, 0, 1, 1] == 9.0  # corner: 4 in-bounds taps of value 1
    act = activate_ref(inputs["x"], inputs["pscale"], inputs["pshift"], relu=True)
    np.testing.assert_array_equal(out, conv2d_ref(act, inputs["w"], spec))


def test_pass_inputs_draw_scale_and_shift_only_for_an_affine_prologue() -> None:
    spec = SPECS[0]
    rng = np.random.default_rng(0)
    assert "pscale" not in pass_inputs(spec, rng, prologue=RELU)
    got = pass_inputs(spec, rng, prologue=AFFINE)
    assert got["pscale"].shape == got["pshift"].shape == (spec.c,)
    assert (np.abs(got["pscale"]) >= 0.5).all()


# DenseNet-121's 3x3 layers (128 -> 32 at 56, 28, 14 and 7) and two of its 1x1 layers, at N=32
DENSE = [ConvSpec.make(32, 128, hw, hw, 32, 3, 3, padding=1) for hw in (56, 28, 14, 7)] + \
    [ConvSpec.make(32, 256, 56, 56, 128, 1, 1), ConvSpec.make(32, 992, 7, 7, 128, 1, 1)]


def test_cuda_prologue_sources_compile_without_spills(nvcc_ok: bool) -> None:
    """The default point of every prologue variant on DenseNet's layers (sm_90, ptxas; one nvcc run for
    all): on the first and the last layer it plans, and on each other layer whose default differs from
    those already compiled (the same point on another of these sizes changes only constants). Some
    tuning points of the fused Winograd kernel already at 255 registers do spill with a prologue (F(4x4)
    with bc=4: 200-270 bytes; F(2x2) 64-tile ones: 8-16 bytes): slower, not wrong."""
    sources = []
    for name in ["direct", "direct_shfl", "winograd_fused_f2", "winograd_fused_f4", "winograd_nonfused_f2",
                 "winograd_nonfused_f4", "gemm1x1", "winograd_nonfused_f4_3xtf32", "implicit_gemm"]:
        v = kernels.get_variant(name)
        layers = [spec for spec in DENSE if not v.applies(spec, NOMINAL_CUDA)]
        seen: set[object] = set()
        before = len(sources)
        for spec in layers:
            prm = v.default(spec, NOMINAL_CUDA)
            if prm in seen and spec is not layers[-1]:
                continue
            seen.add(prm)
            src = v.plan_for(spec, prm, NOMINAL_CUDA, Epilogue(bias=True, relu=True), FULL).source("cuda")
            assert "pscale" in src, name
            sources.append((f"{name} {spec.short()}", src))
        assert len(sources) > before, name
    assert_sources_compile_clean(sources)  # one nvcc run


def test_variants_without_a_prologue_path_refuse_with_the_reason(ocl: Any) -> None:
    spec = SPECS[0]
    for name in ("im2win", "winograd_nonfused_f2_pipe_tf32", "tc_implicit_gemm_tf32", "gemm1x1_wgmma_tf32"):
        v = kernels.get_variant(name)
        assert not v.prologue_ok
        assert "prologue" in (v.takes_prologue(spec, FULL) or "")
        with pytest.raises(ValueError, match="unsupported prologue"):
            v.plan_for(spec, v.default(spec, NOMINAL_CUDA if "cuda" in v.backends and len(v.backends) == 1
                                       else ocl.device), NOMINAL_CUDA, Epilogue(), FULL)
    # a forward-only fold: the backward passes never take one
    gemm = kernels.get_variant("implicit_gemm")
    assert "forward" in (gemm.takes_prologue(spec.with_pass("dgrad"), FULL) or "")
    # a plan without a prologue is the plain plan
    v = kernels.get_variant("winograd_fused_f2")
    assert v.plan_for(spec, v.default(spec, ocl.device), ocl.device).prologue == Prologue()


def test_a_prologue_is_declared_by_the_class_whose_plan_runs() -> None:
    """A subclass that writes its own plan() takes no prologue unless it says so (plan.py's
    __init_subclass__): an inherited flag never vouches for a plan that was not written for it."""
    for v in kernels.all_variants():
        owner = next(c for c in type(v).__mro__ if "plan" in c.__dict__)
        assert v.prologue_ok == owner.__dict__.get("prologue_ok", False), v.name

    from convforge.kernels.gemm import ImplicitGemm

    class Own(ImplicitGemm):
        def plan(self, spec, params, device, epilogue=Epilogue()):  # type: ignore[no-untyped-def, override]
            return super().plan(spec, params, device, epilogue)

    class Inherits(ImplicitGemm):
        pass

    assert not Own.prologue_ok and Inherits.prologue_ok


def test_dispatch_picks_a_variant_that_takes_the_prologue(ocl: Any) -> None:
    spec = ConvSpec.make(2, 5, 11, 13, 7, 3, 3, padding=(1, 0, 2, 1))
    dispatch.clear_choices()
    im2win = kernels.get_variant("im2win")
    named = dict(algo="im2win", params=im2win.default(spec, ocl.device))
    assert dispatch.choose(spec, ocl, Epilogue(bias=True), **named).source == "named"
    with pytest.raises(ValueError, match="im2win cannot run .* prologue"):
        dispatch.choose(spec, ocl, Epilogue(bias=True), prologue=FULL, **named)
    ch = dispatch.choose(spec, ocl, Epilogue(bias=True, relu=True), prologue=FULL)
    assert ch.variant.takes_prologue(spec, FULL) is None
    exe = dispatch.executable(spec, ocl, Epilogue(bias=True, relu=True), prologue=FULL)
    assert exe.plan.prologue == FULL
    assert check_plan(exe.plan, ocl, seed=2, exe=exe).ok
    # a family without a prologue path falls back to another variant of the family, or says so
    with pytest.raises(ValueError, match="no 'im2win' variant runs .* prologue"):
        dispatch.choose(spec, ocl, Epilogue(), algo="im2win", prologue=RELU)


def test_a_nan_input_stays_nan_through_the_prologue_relu(ocl: Any) -> None:
    """RELU keeps NaN (as PyTorch's batch norm -> ReLU -> conv does): an activated NaN reaches the
    outputs whose window holds it, never a silent 0."""
    from convforge.dtypes import to_storage

    spec = ConvSpec.make(1, 2, 7, 7, 3, 3, 3, padding=1)
    for name in ("direct", "implicit_gemm", "winograd_fused_f2"):
        v = kernels.get_variant(name)
        exe = ocl.executable(v.plan_for(spec, v.default(spec, ocl.device), ocl.device, Epilogue(), FULL))
        x = np.ones(spec.x_shape, np.float32)
        x[0, 1, 3, 3] = np.nan
        bufs = {"x": ocl.upload(to_storage(x, spec.dtype)), "w": ocl.upload(np.ones(spec.w_shape, np.float32)),
                "y": ocl.upload(np.zeros(spec.y_shape, np.float32)),
                "pscale": ocl.upload(np.ones(2, np.float32)), "pshift": ocl.upload(np.zeros(2, np.float32))}
        exe(bufs)
        ocl.synchronize()
        y = ocl.download(bufs["y"], spec.y_shape)
        assert np.isnan(y[0, :, 2:5, 2:5]).all() and not np.isnan(y[0, :, 0, 0]).any(), name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prologue_on_half_storage(ocl: Any, dtype: str) -> None:
    """Half inputs (FP32 arithmetic): the prologue's scale and shift stay float32 buffers."""
    for name, spec in (("direct", SPECS[1]), ("implicit_gemm", SPECS[0]), ("gemm1x1", SPECS[3])):
        v = kernels.get_variant(name)
        hs = dataclasses.replace(spec, dtype=dtype)
        assert v.applies(hs, ocl.device) is None, name
        res = check_plan(v.plan_for(hs, v.default(hs, ocl.device), ocl.device, Epilogue(bias=True), FULL), ocl, seed=4)
        assert res.ok, f"{name} {dtype}: {res}"
