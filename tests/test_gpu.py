"""GPU tier: every CUDA variant on the device against the float64 reference, torch/CuPy interop.

Skipped (with the reason shown) where there is no CUDA device; scripts/gpu-check runs it on the lent GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from convforge.check import check_plan
from convforge.kernels import all_variants
from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, sample

pytestmark = pytest.mark.gpu

GPU_SPECS = ODD_SPECS + [ConvSpec.make(2, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec.make(3, 512, 7, 7, 512, 3, 3, 1, 1),
                         ConvSpec.make(5, 832, 7, 7, 128, 1, 1), ConvSpec.make(2, 3, 227, 227, 96, 11, 11, 4, 0),
                         ConvSpec.make(1, 96, 24, 24, 256, 5, 5, 1, 2), ConvSpec.make(5, 256, 6, 6, 512, 6, 6)]
NAMES = [v.name for v in all_variants() if "cuda" in v.backends]


@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.key())
@pytest.mark.parametrize("name", NAMES)
def test_variant_on_gpu(cuda, name, spec):
    v = next(v for v in all_variants() if v.name == name)
    why = v.applies(spec, cuda.device)
    if why:
        pytest.skip(f"{name}: {why}")
    for i, params in enumerate(sample(v, spec, cuda.device, k=2, seed=3)):
        res = check_plan(v.plan(spec, params, cuda.device), cuda, seed=i, batch_slice=2)
        assert res.ok, f"{name} [{params.short()}] {spec.short()}: {res}"


RESIDUAL_NAMES = [v.name for v in all_variants() if "cuda" in v.backends and v.residual_ok]


@pytest.mark.parametrize("name", RESIDUAL_NAMES)
def test_residual_epilogue_on_gpu(cuda, name):
    """conv + bias + residual + ReLU (a ResNet block's second conv) on every variant that states a
    residual store path, on odd shapes and two sampled points each; the residual drawn afresh."""
    from convforge.plan import Epilogue

    v = next(v for v in all_variants() if v.name == name)
    epi = Epilogue(bias=True, relu=True, residual=True)
    ran = 0
    extra = [ConvSpec.make(1, 64, 14, 14, 64, 3, 3, 1, 1), ConvSpec.make(1, 257, 3, 3, 13, 1, 1),  # deep 1x1: split-K
             ConvSpec.make(2, 37, 5, 5, 11, 5, 5),  # the filter covers the input: gemm_fc
             ConvSpec.make(2, 24, 13, 17, 24, 3, 3, 2, 1, groups=24),  # depthwise
             ConvSpec.make(1, 16, 28, 28, 16, 5, 5, 1, 2, groups=16)]
    dtype = next(d for d in ("float32", "float16", "bfloat16") if d in v.dtypes)  # half-only variants in half
    layout = "nchw" if "nchw" in v.layouts else sorted(v.layouts)[0]  # depthwise_nhwc reads channels-last only
    for spec in (dataclasses.replace(s, dtype=dtype, layout=layout) for s in ODD_SPECS + extra):
        if v.applies(spec, cuda.device):
            continue
        for i, params in enumerate(sample(v, spec, cuda.device, k=2, seed=5)):
            res = check_plan(v.plan(spec, params, cuda.device, epi), cuda, seed=20 + i)
            assert res.ok, f"{name} [{params.short()}] {spec.short()}: {res}"
            ran += 1
    assert ran, f"{name} applies to none of the shapes"


def test_torch_tensors_in_and_out(cuda):
    import torch

    import convforge

    x = torch.rand(2, 3, 13, 17, device="cuda") - 0.5
    w = torch.rand(5, 3, 3, 3, device="cuda") - 0.5
    b = torch.rand(5, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = convforge.conv2d(x, w, b, padding=(1, 0, 2, 1), stride=(1, 2))
    stream.synchronize()
    assert isinstance(y, torch.Tensor) and y.device == x.device
    spec = ConvSpec.make(2, 3, 13, 17, 5, 3, 3, (1, 2), (1, 0, 2, 1))
    ref = conv2d_ref(x.cpu().numpy(), w.cpu().numpy(), spec, b.cpu().numpy())
    assert rel_l2(y.cpu().numpy(), ref) < 1e-5


@pytest.mark.parametrize("algo", ["auto", "gemm1x1", "implicit_gemm", "winograd_nonfused_f4"])
def test_misaligned_views_are_read_correctly(cuda, algo):
    """Contiguous views 4 bytes into a buffer (not 16-byte aligned) as input and weights: the
    float4 loads of the GEMM kernels need an aligned copy, taken by the back-end."""
    import torch

    import convforge

    r = 1 if algo == "gemm1x1" else 3
    base_x = torch.rand(2 * 8 * 12 * 12 + 1, device="cuda") - 0.5
    base_w = torch.rand(16 * 8 * r * r + 1, device="cuda") - 0.5
    x = base_x[1:].view(2, 8, 12, 12)
    w = base_w[1:].view(16, 8, r, r)
    assert x.data_ptr() % 16 and w.data_ptr() % 16
    y = convforge.conv2d(x, w, padding=r // 2, algo=algo)
    ref = conv2d_ref(x.cpu().numpy(), w.cpu().numpy(), ConvSpec.make(2, 8, 12, 12, 16, r, r, 1, r // 2))
    assert rel_l2(y.cpu().numpy(), ref) < 5e-5


def test_cupy_arrays_in_and_out(cuda):
    import cupy as cp

    import convforge

    rng = np.random.default_rng(0)
    xh = rng.uniform(-1, 1, (1, 4, 11, 11)).astype(np.float32)
    wh = rng.uniform(-1, 1, (3, 4, 5, 5)).astype(np.float32)
    for algo in ("direct", "direct_smem", "direct_shfl"):
        y = convforge.conv2d(cp.asarray(xh), cp.asarray(wh), padding=2, algo=algo)
        assert isinstance(y, cp.ndarray)
        assert rel_l2(cp.asnumpy(y), conv2d_ref(xh, wh, ConvSpec.make(1, 4, 11, 11, 3, 5, 5, 1, 2))) < 1e-5


@pytest.mark.parametrize("spec", GPU_SPECS[:5], ids=lambda s: s.key())
@pytest.mark.parametrize("extra", [dict(tex=True, ldg=False), dict(rt=True, tk=4), dict(wconst=True)])
def test_direct_input_paths_on_gpu(cuda, spec, extra):
    """Texture-object reads, run-time strides and constant-memory filters, each against the reference."""
    v = next(v for v in all_variants() if v.name == "direct")
    if extra.get("wconst") and 4 * spec.k * spec.c * spec.r * spec.s > 65536:
        pytest.skip("filters larger than constant memory")
    res = check_plan(v.plan(spec, v.default(spec, cuda.device).replace(**extra), cuda.device), cuda)
    assert res.ok, f"direct {extra} {spec.short()}: {res}"
