"""Direct convolution: every variant on PoCL against the float64 reference, CUDA compile checks."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.kernels import get_variant
from convforge.plan import Epilogue
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, assert_sources_compile_clean, sample

OCL_VARIANTS = ["direct", "direct_smem"]


@pytest.mark.parametrize("spec", ODD_SPECS, ids=lambda s: s.key())
@pytest.mark.parametrize("name", OCL_VARIANTS)
def test_variant_on_pocl(ocl, name, spec):
    v = get_variant(name)
    if v.applies(spec, ocl.device):
        pytest.skip(f"{name}: {v.applies(spec, ocl.device)}")
    seed = zlib.crc32(spec.key().encode()) % 1000  # the same points on every run (hash() is salted per process)
    for i, params in enumerate(sample(v, spec, ocl.device, k=2, seed=seed)):
        res = check_plan(v.plan(spec, params, ocl.device), ocl, seed=i)
        assert res.ok, f"{name} [{params.short()}] {spec.short()}: {res}"


def test_runtime_strides(ocl):
    """With rt=True the strides are kernel arguments, and the result is the same."""
    spec = ODD_SPECS[2]
    v = get_variant("direct")
    plan = v.plan(spec, v.default(spec, ocl.device).replace(rt=True), ocl.device)
    assert "const int x_stride_c" in plan.source("opencl")
    assert check_plan(plan, ocl).ok


def test_epilogue_bias_relu(ocl):
    spec = ODD_SPECS[1]
    v = get_variant("direct")
    res = check_plan(v.plan(spec, v.default(spec, ocl.device), ocl.device, Epilogue(True, True)), ocl)
    assert res.ok, str(res)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), c=st.integers(1, 6), h=st.integers(1, 20), w=st.integers(1, 20),
       k=st.integers(1, 9), r=st.integers(1, 5), s=st.integers(1, 5), sh=st.integers(1, 4),
       sw=st.integers(1, 4), pad=st.tuples(*[st.integers(0, 2)] * 4), dh=st.integers(1, 2))
def test_random_specs(ocl, n, c, h, w, k, r, s, sh, sw, pad, dh):
    try:
        spec = ConvSpec.make(n, c, h, w, k, r, s, (sh, sw), pad, (dh, 1))
    except ValueError:
        return  # the kernel does not fit this input; ConvSpec's own tests cover the message
    v = get_variant("direct_smem")
    res = check_plan(v.plan(spec, v.default(spec, ocl.device), ocl.device), ocl)
    assert res.ok, f"{spec.short()}: {res}"


def test_checker_catches_unwritten_outputs(ocl):
    """A plan whose grid misses the last rows must fail with unwritten outputs reported."""
    import dataclasses

    spec = ConvSpec.make(1, 2, 13, 13, 3, 3, 3, 1, 1)
    v = get_variant("direct")
    plan = v.plan(spec, v.default(spec, ocl.device), ocl.device)
    launch = plan.steps[0]
    short = dataclasses.replace(launch, grid=(launch.grid[0], launch.grid[1] - 1, launch.grid[2]))
    res = check_plan(dataclasses.replace(plan, steps=(short,)), ocl)
    assert not res.ok and res.unwritten > 0 and "never written" in str(res)


CUDA_SPECS = [ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec.make(128, 3, 227, 227, 96, 11, 11, 4, 0),
              ConvSpec.make(5, 832, 7, 7, 128, 1, 1), ODD_SPECS[3]]


CUDA_VARIANTS = ["direct", "direct_smem", "direct_shfl"]


def test_cuda_compiles_without_spills(nvcc_ok):
    """Each variant's default on each layer it takes, and a sampled point of the tuning space on every
    other layer, the variants taking the layers in turns (each layer sampled for some variant); one
    nvcc run for all (helpers.assert_sources_compile_clean)."""
    sources, sampled = [], set()
    for name in CUDA_VARIANTS:
        v = get_variant(name)
        for spec in CUDA_SPECS:
            if v.applies(spec, NOMINAL_CUDA):
                continue
            k = int((CUDA_SPECS.index(spec) + CUDA_VARIANTS.index(name)) % 2 == 0)
            points = sample(v, spec, NOMINAL_CUDA, k=k)
            if len(points) > 1:
                sampled.add(spec)
            sources += [(f"{name} [{params.short()}] {spec.short()}", v.plan(spec, params, NOMINAL_CUDA).source("cuda"))
                        for params in points]
    assert sampled == set(CUDA_SPECS)
    assert_sources_compile_clean(sources)


def test_cuda_input_paths_compile(nvcc_ok):
    """direct's texture, register-tile and constant-filter input paths compile without spills on the
    odd layer (one nvcc run); the texture path is CUDA only."""
    spec = CUDA_SPECS[3]
    v = get_variant("direct")
    extras = [dict(tex=True, ldg=False), dict(rt=True, tk=4), dict(wconst=True)]
    assert_sources_compile_clean([(str(extra), v.plan(spec, v.default(spec, NOMINAL_CUDA).replace(**extra),
                                                      NOMINAL_CUDA).source("cuda")) for extra in extras])
    with pytest.raises(ValueError, match="lacks features"):
        v.plan(spec, v.default(spec, NOMINAL_CUDA).replace(**extras[0]), NOMINAL_CUDA).source("opencl")


def test_constant_filters_refused_when_too_big():
    spec = CUDA_SPECS[0]  # 64x64x3x3 filters: 147 KB > 64 KB of constant memory
    v = get_variant("direct")
    with pytest.raises(ValueError, match="constant memory"):
        v.plan(spec, v.default(spec, NOMINAL_CUDA).replace(wconst=True), NOMINAL_CUDA)
