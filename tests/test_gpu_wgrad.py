"""GPU tier of the wgrad (update) kernels: every wgrad variant (its default and sampled points of the
GPU space) and the bias gradient on real layers against the float64 reference, NaN-poisoned
outputs, and the fp32 class's bound on the defaults' measured error. Skips without a CUDA device.

    python -m pytest -q tests/test_gpu_wgrad.py
"""

from __future__ import annotations

import numpy as np
import pytest

from convforge.check import check_plan
from convforge.kernels import all_variants, get_variant
from convforge.kernels.wgrad import bias_grad_plan
from convforge.reference import bias_grad_ref, rel_l2
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, sample

pytestmark = pytest.mark.gpu

LAYERS = [ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1),
          ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1), ConvSpec.make(32, 512, 7, 7, 512, 3, 3, 1, 1),
          ConvSpec.make(32, 256, 56, 56, 64, 1, 1), ConvSpec.make(32, 256, 56, 56, 512, 1, 1, 2),
          ConvSpec.make(32, 64, 56, 56, 128, 3, 3, 2, 1), ConvSpec.make(8, 3, 224, 224, 64, 7, 7, 2, 3),
          ConvSpec.make(16, 32, 28, 28, 32, 3, 3, 1, 1, groups=32)]
SPECS = [s.with_pass("wgrad") for s in LAYERS + ODD_SPECS]
NAMES = [v.name for v in all_variants() if "wgrad" in v.passes and "cuda" in v.backends]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
@pytest.mark.parametrize("name", NAMES)
def test_wgrad_variant_on_gpu(cuda, name, spec):
    v = get_variant(name)
    why = v.applies(spec, cuda.device)
    if why:
        pytest.skip(f"{name}: {why}")
    big = spec.flops > 4e9
    for i, params in enumerate(sample(v, spec, cuda.device, k=1 if big else 2, seed=3)):
        res = check_plan(v.plan(spec, params, cuda.device), cuda, seed=i)
        assert res.ok, f"{name} [{params.short()}] {spec.short()}: {res}"
        if i == 0 and v.precision == "fp32":  # the default: what 'auto' runs untuned
            assert res.rel_err <= 5e-6, f"{name} default {spec.short()}: {res.rel_err:.2e} is not fp32-grade"


@pytest.mark.parametrize("spec", [LAYERS[0], LAYERS[3], ODD_SPECS[1]], ids=lambda s: s.key())
def test_bias_grad_on_gpu(cuda, spec):
    rng = np.random.default_rng(0)
    dy = rng.uniform(-1, 1, spec.y_shape).astype(np.float32)
    plan = bias_grad_plan(spec, cuda.device)
    exe = cuda.executable(plan)
    bufs = {"y": cuda.upload(dy), "bias": cuda.upload(np.full(spec.k, np.nan, np.float32))}
    exe(bufs)
    cuda.synchronize()
    got = cuda.download(bufs["bias"], (spec.k,))
    assert rel_l2(got, bias_grad_ref(dy)) < 1e-6
