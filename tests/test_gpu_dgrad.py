"""GPU tier of dgrad: every dgrad variant with a CUDA form (the tensor-core adapters included) on the
device against the float64 reference, on odd shapes and real ResNet layers, sampled tuning points;
and dx against PyTorch's own gradient. Skipped (with the reason shown) without a CUDA device:
scripts/gpu-check runs it; `convforge bench --pass dgrad` times the variants against cuDNN-best."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from convforge.check import check_plan
from convforge.kernels import get_variant
from convforge.reference import dgrad_ref, rel_l2
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, sample
from test_dgrad import MINE, OWN

pytestmark = pytest.mark.gpu

REAL = [ConvSpec.make(2, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec.make(3, 512, 7, 7, 512, 3, 3, 1, 1),
        ConvSpec.make(2, 128, 56, 56, 128, 3, 3, 2, 1), ConvSpec.make(2, 256, 56, 56, 512, 1, 1, 2),
        ConvSpec.make(5, 1024, 14, 14, 256, 1, 1), ConvSpec.make(1, 256, 14, 14, 256, 3, 3, 1, 1),
        ConvSpec.make(2, 3, 227, 227, 96, 11, 11, 4, 0), ConvSpec.make(1, 832, 7, 7, 256, 1, 1),  # split-K
        ConvSpec.make(1, 512, 14, 14, 1024, 1, 1, 2)]  # 1x1/2, N=1: the split-K sub-grid GEMM
HALF = [dataclasses.replace(s, dtype=d) for s in (ODD_SPECS[1], OWN[0], REAL[0], REAL[4], REAL[3], OWN[8])
        for d in ("float16", "bfloat16")]
GROUPED = [ConvSpec.make(2, 64, 14, 14, 64, 3, 3, 1, 1, groups=8),  # the tensor-core grouped forms (ResNeXt-like)
           ConvSpec.make(1, 256, 7, 7, 256, 3, 3, 1, (1, 0, 2, 1), groups=8, dtype="float16"),
           ConvSpec.make(3, 128, 13, 11, 128, 3, 3, 1, 1, groups=4, dtype="bfloat16")]
GPU_SPECS = [s.with_pass("dgrad") for s in ODD_SPECS + OWN + REAL + HALF + GROUPED]
NAMES = [n for n in MINE if "cuda" in get_variant(n).backends]


@pytest.mark.parametrize("name", NAMES)
def test_dgrad_variant_on_gpu(cuda, name):
    """The default and two sampled points on every shape the variant applies to."""
    v = get_variant(name)
    ran = 0
    for j, spec in enumerate(GPU_SPECS):
        if v.applies(spec, cuda.device):
            continue
        for i, params in enumerate(sample(v, spec, cuda.device, k=2, seed=3 + j)):
            res = check_plan(v.plan(spec, params, cuda.device), cuda, seed=i, batch_slice=2)
            assert res.ok, f"{name} [{params.short()}] {spec.short()}: {res}"
            ran += 1
    assert ran, f"{name} applies to none of the GPU shapes"


@pytest.mark.parametrize("layer", [(4, 64, 28, 28, 64, 3, 3, 1, 1), (4, 128, 28, 28, 256, 3, 3, 2, 1),
                                   (4, 256, 14, 14, 512, 1, 1, 2, 0)])
def test_dgrad_matches_torch(gpu, layer):
    """dx of the untuned pick beside PyTorch's FP32 autograd gradient (TF32 off), both against float64."""
    import torch

    from convforge.kernels import most_specialised

    spec = ConvSpec.make(*layer, conv_pass="dgrad")
    v, params = most_specialised("auto", spec, gpu.device, precision="fp32")
    rng = np.random.default_rng(0)
    dy = rng.uniform(-1, 1, spec.y_shape).astype(np.float32)
    w = rng.uniform(-1, 1, spec.w_shape).astype(np.float32)
    exe = gpu.executable(v.plan(spec, params, gpu.device))
    bufs = {"y": gpu.upload(dy), "w": gpu.upload(w), "x": gpu.upload(np.zeros(spec.x_shape, np.float32))}
    exe(bufs)
    gpu.synchronize()
    ours = gpu.download(bufs["x"], spec.x_shape)
    torch.backends.cudnn.allow_tf32 = False
    x = torch.zeros(spec.x_shape, device="cuda", requires_grad=True)
    y = torch.nn.functional.conv2d(x, torch.from_numpy(w).cuda(), stride=spec.stride,
                                   padding=(spec.pad[0], spec.pad[2]), dilation=spec.dilation)
    y.backward(torch.from_numpy(dy).cuda())
    theirs = x.grad.cpu().numpy()
    ref = dgrad_ref(dy, w, spec)
    ours_err, theirs_err = rel_l2(ours, ref), rel_l2(theirs, ref)
    print(f"{spec.short()}: {v.name} {ours_err:.2e}, PyTorch {theirs_err:.2e}")
    assert ours_err <= max(5e-6, 4 * theirs_err)
