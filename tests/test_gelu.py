"""The GELU epilogue (ConvNeXt's MLP: linear -> GELU) on every OpenCL variant that plans fprop, and
the float64 reference it is checked against."""

from __future__ import annotations

import math

import numpy as np
import pytest

from convforge.check import check_plan, gelu_ref
from convforge.kernels import all_variants
from convforge.plan import Epilogue
from convforge.spec import ConvSpec

SPEC = ConvSpec.make(2, 5, 9, 11, 7, 3, 3, 1, (1, 0, 0, 1))


def test_gelu_reference_values():
    """x * Phi(x): 0 at 0, ~x for large x, ~0 for very negative x, Phi(1) = 0.8413447; NaN stays NaN."""
    got = gelu_ref(np.array([0.0, 1.0, -1.0, 8.0, -8.0, np.nan]))
    np.testing.assert_allclose(got[:5], [0.0, 0.8413447460685429, -0.15865525393145707, 8.0, 0.0], atol=1e-12)
    assert math.isnan(got[5])


def test_epilogue_rejects_two_activations():
    with pytest.raises(ValueError, match="ReLU and GELU together"):
        Epilogue(relu=True, gelu=True)
    assert Epilogue(bias=True, gelu=True).tag() == "_bias_gelu"
    assert Epilogue(bias=True, residual=True, gelu=True).plain() == Epilogue(bias=True, gelu=True)


@pytest.mark.parametrize("epi", [Epilogue(bias=True, gelu=True), Epilogue(residual=True, gelu=True)],
                         ids=["bias_gelu", "res_gelu"])
def test_gelu_epilogue_on_every_opencl_variant(ocl, epi):
    """bias / residual then GELU, against the float64 reference, on each variant that plans the layer.
    Every such variant renders GELU in both epilogues (checked); on PoCL each runs GELU once: a variant
    with a residual store path runs the epilogue that test_onnx_kernels.test_epilogue_on_every_opencl_
    variant does not run it with on this layer (there, by the variant's order, bias + SiLU at even
    positions, residual + HardSwish at odd ones; here residual + GELU at even positions, bias + GELU at
    odd ones), so between the two tests every variant runs its bias and its residual store path; a
    variant without one runs bias + GELU."""
    turn = int(not epi.residual)
    ran = []
    for k, v in enumerate(all_variants()):
        if v.applies(SPEC, ocl.device) or (epi.residual and not v.residual_ok):
            continue
        try:
            plan = v.plan(SPEC, v.default(SPEC, ocl.device), ocl.device, epi)
        except ValueError as err:  # a variant without a store path for this epilogue says so
            assert "unsupported epilogue" in str(err), f"{v.name}: {err}"
            continue
        assert "cf_gelu" in plan.source("opencl"), v.name
        if v.residual_ok and k % 2 != turn:
            continue
        res = check_plan(plan, ocl, seed=3)
        assert res.ok, f"{v.name}: {res}"
        ran.append(v.name)
    assert len(ran) >= 3, ran


@pytest.mark.gpu
def test_gelu_epilogue_on_every_cuda_variant(cuda):
    """The same on the GPU: every CUDA variant (tensor-core ones included) that plans the layer."""
    epi, ran = Epilogue(bias=True, gelu=True), []
    for v in all_variants():
        spec = SPEC if "float32" in v.dtypes else ConvSpec.from_dict({**SPEC.to_dict(), "dtype": sorted(v.dtypes)[0]})
        if "nchw" not in v.layouts or v.applies(spec, cuda.device):
            continue
        try:
            plan = v.plan(spec, v.default(spec, cuda.device), cuda.device, epi)
        except ValueError as err:
            assert "unsupported epilogue" in str(err), f"{v.name}: {err}"
            continue
        res = check_plan(plan, cuda, seed=3)
        assert res.ok, f"{v.name}: {res}"
        ran.append(v.name)
    assert len(ran) >= 10, ran
