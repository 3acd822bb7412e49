"""The backward passes' exact baselines (dgrad_direct, wgrad_direct) on PoCL against the float64
reference on odd and grouped shapes, compiled for sm_90 without spills; and every variant refusing
the passes, dtypes and groups it does not serve."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.kernels import all_variants, get_variant
from convforge.plan import Epilogue
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, assert_sources_compile_clean

GROUPED = [
    ConvSpec.make(2, 6, 11, 9, 4, 3, 2, stride=(2, 3), padding=(1, 0, 2, 1), dilation=(1, 2), groups=2),
    ConvSpec.make(3, 5, 17, 19, 5, 5, 5, padding=2, dilation=2, groups=5),
    ConvSpec.make(1, 8, 13, 13, 16, 3, 3, stride=2, padding=1, groups=8),
]


@pytest.mark.parametrize("spec", ODD_SPECS + GROUPED, ids=lambda s: s.key())
@pytest.mark.parametrize("conv_pass", ["dgrad", "wgrad"])
def test_baseline_on_pocl(ocl, conv_pass, spec):
    """The space's first point on every shape, and its second on every other shape (in turns over the
    two passes, each shape running both points in one of them)."""
    v = get_variant(f"{conv_pass}_direct")
    both = ((ODD_SPECS + GROUPED).index(spec) + ("dgrad", "wgrad").index(conv_pass)) % 2 == 0
    spec = spec.with_pass(conv_pass)
    assert v.applies(spec, ocl.device) is None
    for i, params in enumerate(v.space(spec, ocl.device)[:2 if both else 1]):
        res = check_plan(v.plan(spec, params, ocl.device), ocl, seed=i)
        assert res.ok, f"{v.name} [{params.short()}] {spec.short()}: {res}"


def test_baseline_compiles_for_sm90(nvcc_ok):
    """dgrad_direct and wgrad_direct on the 11x11/4 odd layer and a grouped one: no spills (one nvcc
    run for the four)."""
    sources = []
    for conv_pass in ("dgrad", "wgrad"):
        v = get_variant(f"{conv_pass}_direct")
        for spec in (ODD_SPECS[4], GROUPED[0]):
            spec = spec.with_pass(conv_pass)
            sources.append((f"{v.name} {spec.short()}", v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
                            .source("cuda")))
    assert_sources_compile_clean(sources)


def test_backward_plans_refuse_an_epilogue(ocl):
    spec = ODD_SPECS[0].with_pass("dgrad")
    v = get_variant("dgrad_direct")
    with pytest.raises(ValueError, match="unsupported epilogue: dgrad_direct writes a gradient"):
        v.plan(spec, v.default(spec, ocl.device), ocl.device, Epilogue(bias=True))


def test_every_variant_refuses_what_it_does_not_serve():
    """applies() names the pass, dtype or groups a variant does not serve, whether or not the
    subclass's own applies() calls super()."""
    base = ODD_SPECS[1]
    for v in all_variants():
        for changed in (dataclasses.replace(base, conv_pass=p) for p in ("fprop", "dgrad", "wgrad")):
            why = v.applies(changed, NOMINAL_CUDA)
            if changed.conv_pass not in v.passes:
                assert why and f"does not compute {changed.conv_pass}" in why, v.name
        half = dataclasses.replace(base, dtype="float16", conv_pass=sorted(v.passes)[0])
        if "float16" not in v.dtypes:
            assert "does not take float16" in (v.applies(half, NOMINAL_CUDA) or ""), v.name
        dtype = "float32" if "float32" in v.dtypes else sorted(v.dtypes)[0]  # one it takes (half-only variants)
        grouped = ConvSpec.make(1, 4, 9, 9, 4, 3, 3, padding=1, groups=2, conv_pass=sorted(v.passes)[0], dtype=dtype)
        if not v.grouped:
            assert "does not take grouped layers" in (v.applies(grouped, NOMINAL_CUDA) or ""), v.name
