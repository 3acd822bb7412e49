"""Channels-last (NHWC) training passes on the wgmma generator, on the CPU tier.

What the CPU can check: the layout steps that feed the GEMMs (NHWC -> the batch-as-channels rows of
wgrad, NHWC rows padded to whole chunks for dgrad; halves and TF32 read dy in place where its channels are
whole 16-byte chunks, as the forward reads x) run on PoCL in half storage against NumPy, bit for
bit; the NHWC plans of every training pass are composed without NCHW transposes and compile for
sm_90a without spills with HGMMA in their GEMMs. The values of whole plans are the GPU tier's
(tests/test_gpu_channels_last.py).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.dtypes import to_storage
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm90 import prep
from convforge.kernels.tensorcore.sm90.isa import math_for
from convforge.params import Params
from convforge.plan import Launch, Plan
from convforge.spec import ConvSpec
from helpers import sass_reports


def _on_pocl(ocl, kern, grid, src_name, src, dst_shape, dtype):
    """Run one layout step (its tensor-core feature tags dropped: half storage is a copy of bits) with
    the destination NaN-poisoned; the destination as float32."""
    kern = dataclasses.replace(kern, requires=frozenset())
    spec = ConvSpec.make(1, 1, 1, 1, 1, 1, 1)
    plan = Plan("step", "test", spec, Params(), (kern,), (Launch(kern.name, grid, kern.block, (src_name, "dst")),),
                (), 0.0)
    bufs = {src_name: ocl.upload(to_storage(src, dtype)),
            "dst": ocl.upload(to_storage(np.full(dst_shape, np.nan, np.float32), dtype))}
    ocl.executable(plan)(bufs)
    ocl.synchronize()
    return ocl.download(bufs["dst"], dst_shape, dtype)


@pytest.mark.parametrize("n, c, hw, cp", [(3, 5, 7, 8), (1, 37, 2, 8), (33, 40, 3, 40), (2, 3, 50, 8), (70, 6, 5, 72)])
def test_nhwc_to_batch_rows_on_pocl(ocl, n, c, hw, cp):
    """wgrad's operand of a channels-last tensor: dst[ch][p][n] = src[n][p][ch], zeros for n >= N up
    to the padded batch (odd tiles: a batch and channels past one 32-wide tile, N = 1, a 3-channel stem
    whose pixels straddle the tiles; odd runs by halves, even ones by words)."""
    rng = np.random.default_rng(n * 100 + c)
    src = rng.uniform(-2, 2, (n, hw, c)).astype(np.float16).astype(np.float32)
    kern, grid = prep.nhwc_to_batch_rows("t", "x", n, c, hw, cp, math_for("float16"), "float16", "dst", "test")
    got = _on_pocl(ocl, kern, grid, "x", src, (c, hw, cp), "float16")
    want = np.zeros((c, hw, cp), np.float32)
    want[:, :, :n] = src.transpose(2, 1, 0)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("pixels, chans, cp", [(7, 3, 8), (11, 13, 16)])
def test_rows_from_nhwc_pads_channels_on_pocl(ocl, pixels, chans, cp):
    rng = np.random.default_rng(pixels)
    src = rng.uniform(-2, 2, (pixels, chans)).astype(np.float16).astype(np.float32)
    kern, grid = prep.rows_from_nhwc("t", "y", chans, pixels, cp, math_for("float16"), "float16", "dst")
    got = _on_pocl(ocl, kern, grid, "y", src, (pixels, cp), "float16")
    want = np.zeros((pixels, cp), np.float32)
    want[:, :chans] = src
    np.testing.assert_array_equal(got, want)


def _cl(spec: ConvSpec, dtype: str, conv_pass: str) -> ConvSpec:
    return dataclasses.replace(spec, dtype=dtype, conv_pass=conv_pass, layout="nhwc")


# (variant, layer) of every training pass a channels-last ResNet step takes, half and float32
PASSES = [
    ("dgrad_tc_implicit_gemm_half", _cl(ConvSpec.make(8, 64, 14, 14, 64, 3, 3, 1, 1), "float16", "dgrad")),
    ("dgrad_tc_implicit_gemm_half", _cl(ConvSpec.make(8, 256, 7, 7, 64, 1, 1), "bfloat16", "dgrad")),
    ("dgrad_tc_strided_half", _cl(ConvSpec.make(8, 64, 15, 15, 128, 3, 3, 2, 1), "float16", "dgrad")),
    ("dgrad_tc_strided_half", _cl(ConvSpec.make(4, 24, 13, 13, 20, 3, 3, 2, 1), "bfloat16", "dgrad")),  # K padded
    ("dgrad_sub_tc_implicit_gemm_half", _cl(ConvSpec.make(8, 64, 14, 14, 128, 1, 1, 2), "float16", "dgrad")),
    ("wgrad_tc_implicit_gemm_half", _cl(ConvSpec.make(8, 64, 14, 14, 64, 3, 3, 1, 1), "float16", "wgrad")),
    ("wgrad_tc_implicit_gemm_half", _cl(ConvSpec.make(5, 3, 29, 29, 16, 7, 7, 2, 3), "bfloat16", "wgrad")),  # a stem
    ("wgrad_tc_implicit_gemm_half", _cl(ConvSpec.make(8, 256, 7, 7, 64, 1, 1), "float16", "wgrad")),
    ("dgrad_tc_implicit_gemm_3xtf32", _cl(ConvSpec.make(8, 64, 14, 14, 64, 3, 3, 1, 1), "float32", "dgrad")),
    ("dgrad_tc_strided_tf32", _cl(ConvSpec.make(8, 64, 15, 15, 64, 3, 3, 2, 1), "float32", "dgrad")),
    ("wgrad_tc_implicit_gemm_3xtf32", _cl(ConvSpec.make(8, 64, 14, 14, 64, 3, 3, 1, 1), "float32", "wgrad")),
]


@pytest.mark.parametrize("name, spec", PASSES, ids=str)
def test_channels_last_passes_plan_without_nchw_steps(name, spec):
    """Each pass takes NHWC activations as they lie: no NCHW transpose (tc_x_nhwc, planes_to_rows of
    NCHW planes), dy read in place where its channels are whole half chunks, the strided dgrad's phases
    stored on dx's sub-grid or through their buffers, the NHWC variants' layouts as the pass needs."""
    v = get_variant(name)
    assert v.applies(spec, NOMINAL_CUDA) is None, v.applies(spec, NOMINAL_CUDA)
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    names = [k.name for k in plan.kernels]
    assert "tc_x_nhwc" not in names
    src = plan.source("cuda")
    if spec.conv_pass == "wgrad":
        assert f"{name}_x" in names and f"{name}_dy" in names and "N H W C ->" in src
    if name.startswith("dgrad_tc_strided"):
        in_place = "3x" not in name and spec.k % (4 if spec.dtype == "float32" else 8) == 0  # halves, TF32
        assert (f"{name}_dy" in names) != in_place
        # stored straight on dx's sub-grid by default (no phase buffers, no interleave pass); the
        # space holds the buffered form too
        assert v.default(spec, NOMINAL_CUDA)["il"] == 0
        assert {p["il"] for p in v.space(spec, NOMINAL_CUDA)} == {0, 1}
        for il in (0, 1):
            names = [k.name for k in v.plan(spec, v.default(spec, NOMINAL_CUDA).replace(il=il), NOMINAL_CUDA).kernels]
            assert (f"{name}_interleave" in names) == bool(il), names


def test_planar_wgrad_keeps_to_nchw():
    """wgrad_tc_gemm1x1_* reads channel planes: it refuses a channels-last layer (the transposing
    path takes it)."""
    spec = _cl(ConvSpec.make(8, 256, 8, 8, 64, 1, 1), "float16", "wgrad")
    assert "NHWC" in (get_variant("wgrad_tc_gemm1x1_half").applies(spec, NOMINAL_CUDA) or "")
    assert get_variant("wgrad_tc_implicit_gemm_half").applies(spec, NOMINAL_CUDA) is None


def test_channels_last_passes_compile_without_spills(nvcc_ok):
    """PASSES 0, 2, 4, 6 and 9 at their defaults: no spills, HGMMA in the GEMM (one nvcc + cuobjdump run
    for the five, helpers.sass_reports)."""
    cases = [PASSES[0], PASSES[2], PASSES[4], PASSES[6], PASSES[9]]
    reports = sass_reports([(v := get_variant(name)).plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
                            .source("cuda") for name, spec in cases])
    for (name, spec), (infos, sass) in zip(cases, reports, strict=True):
        assert infos, (name, spec.short())
        for info in infos:
            assert info.spill_stores == 0 and info.spill_loads == 0, (name, spec.short(), info)
        gemm = [k for k in re.split(r"\n\s+Function : ", sass) if k.split("\n")[0].endswith("_gemm")]
        assert gemm and "HGMMA" in gemm[0], (name, spec.short())
