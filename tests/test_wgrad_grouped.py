"""wgrad_grouped (narrow groups' wgrad on CUDA cores, NHWC, lanes of input channels): against float64 on
PoCL with the output and workspace poisoned, on small odd grouped layers in every dtype; its refusals; and
its defaults on ResNeXt-50's grouped layers through nvcc (no spill). Speed is the GPU's to measure (the
variant is reached by name until then)."""

from __future__ import annotations

import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.kernels import get_variant, ranked
from convforge.params import Params
from convforge.spec import ConvSpec
from helpers import assert_compiles_clean

V = get_variant("wgrad_grouped")


def _as(spec: ConvSpec, dtype: str) -> ConvSpec:
    return ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "layout": "nhwc", "pass": "wgrad"})


# (layer, parameters): groups of 2 to 8 channels, K = 2C, stride 2 with asymmetric padding, dilation 2,
# N = 1, primes; lanes of 8, 4, 2 and 1 channels; slices (ns > 1) and trees of several chunks (128+ threads)
CASES = [
    (ConvSpec.make(2, 16, 9, 11, 16, 3, 3, 1, 1, groups=4), Params(cw=4, bl=8, bs=4, tq=4, tp=2, ns=3)),
    (ConvSpec.make(1, 16, 13, 10, 32, 3, 3, 2, (2, 1, 0, 3), groups=2), Params(cw=8, bl=16, bs=8, tq=2, tp=2, ns=2)),
    (ConvSpec.make(1, 12, 11, 7, 12, 3, 3, 1, 2, 2, groups=2), Params(cw=2, bl=8, bs=4, tq=2, tp=1, ns=1)),
    (ConvSpec.make(3, 6, 7, 13, 9, 5, 3, 1, (2, 2, 1, 1), groups=3), Params(cw=1, bl=16, bs=16, tq=2, tp=2, ns=5)),
    (ConvSpec.make(1, 8, 17, 5, 8, 7, 1, 1, (3, 3, 0, 0), groups=2), Params(cw=4, bl=4, bs=32, tq=1, tp=4, ns=1)),
]
IDS = ["g4-ns3", "k2c-stride2-cw8", "dilation2-cw2", "cw1-5x3-256threads", "7x1-4-chunks"]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_against_float64_on_pocl(ocl, case, dtype) -> None:
    base, prm = CASES[case]
    spec = _as(base, dtype)
    res = check_plan(V.plan(spec, prm, ocl.device), ocl, seed=11)
    assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_pocl_default(ocl, case) -> None:
    """The CPU device's own default (slices for its compute units)."""
    spec = _as(CASES[case][0], "float16")
    prm = V.default(spec, ocl.device)
    res = check_plan(V.plan(spec, prm, ocl.device), ocl, seed=13)
    assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


def test_refusals() -> None:
    dense = _as(ConvSpec.make(1, 8, 8, 8, 8, 3, 3, 1, 1), "float16")
    depthwise = _as(ConvSpec.make(1, 8, 8, 8, 8, 3, 3, 1, 1, groups=8), "float16")
    assert "grouped" in (V.applies(dense, NOMINAL_CUDA) or "")
    assert "depthwise" in (V.applies(depthwise, NOMINAL_CUDA) or "")
    big = _as(ConvSpec.make(1, 8, 16, 16, 8, 11, 11, 1, 5, groups=2), "float16")
    assert "registers" in (V.applies(big, NOMINAL_CUDA) or "")
    nchw = ConvSpec.from_dict({**CASES[0][0].to_dict(), "dtype": "float16", "pass": "wgrad"})
    assert "NHWC" in (V.applies(nchw, NOMINAL_CUDA) or "")
    spec = _as(CASES[0][0], "float16")
    with pytest.raises(ValueError, match="cw"):
        V.plan(spec, Params(cw=3, bl=8, bs=4, tq=2, tp=1, ns=1), NOMINAL_CUDA)
    with pytest.raises(ValueError, match="ns"):
        V.plan(spec, Params(cw=4, bl=8, bs=4, tq=2, tp=1, ns=10_000), NOMINAL_CUDA)


def test_reached_by_name_only() -> None:
    """Not in 'auto' until a GPU has timed it."""
    spec = _as(ConvSpec.make(32, 128, 56, 56, 128, 3, 3, 1, 1, groups=32), "float16")
    assert V.named_only and V.applies(spec, NOMINAL_CUDA) is None
    assert V.name not in [v.name for v in ranked("auto", spec, NOMINAL_CUDA)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("base", [ConvSpec.make(32, 128, 56, 56, 128, 3, 3, 1, 1, groups=32),
                                  ConvSpec.make(32, 256, 56, 56, 256, 3, 3, 2, 1, groups=32),
                                  ConvSpec.make(32, 512, 14, 14, 512, 3, 3, 1, 1, groups=32)],
                         ids=["128@56-g4", "256@56-s2-g8", "512@14-g16"])
def test_resnext_defaults_compile_clean(nvcc_ok, base, dtype) -> None:
    spec = _as(base, dtype)
    assert_compiles_clean(V, spec, V.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
