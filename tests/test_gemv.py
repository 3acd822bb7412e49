"""gemv_stream (fully-connected layers at small batches as a weight stream) on PoCL against the
float64 reference, its ranking beside the GEMM paths, and its CUDA source through nvcc."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.kernels import get_variant, ranked
from convforge.plan import DeviceInfo, Epilogue
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean, sample

V = get_variant("gemv_stream")

# N = 1 and primes, C*R*S not a multiple of 4 (element loads) and one that is, K not a multiple of the
# rows a block takes, a full 11x11 window, a pass shorter than the block (C*R*S < threads) and longer
SPECS = [ConvSpec.make(1, 13, 1, 1, 7, 1, 1), ConvSpec.make(3, 5, 11, 11, 11, 11, 11),
         ConvSpec.make(5, 64, 3, 3, 37, 3, 3), ConvSpec.make(7, 1031, 1, 1, 5, 1, 1),
         ConvSpec.make(16, 96, 1, 1, 9, 1, 1), ConvSpec.make(2, 40, 3, 3, 13, 3, 3)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_weight_stream_matches_the_reference(ocl, spec):
    """The default and up to three sampled points, the plain store and bias + residual + ReLU taking
    the points in turns (each layer runs both; the epilogue changes the stores, the point the tiling)."""
    assert V.applies(spec, ocl.device) is None
    epilogues = (Epilogue(), Epilogue(bias=True, relu=True, residual=True))
    for i, params in enumerate(sample(V, spec, ocl.device, k=3, seed=1)):
        epi = epilogues[(i + SPECS.index(spec)) % 2]
        res = check_plan(V.plan(spec, params, ocl.device, epi), ocl, seed=2)
        assert res.ok, f"{params.short()} {epi.tag()}: {res}"


def test_every_point_of_the_space_on_one_layer(ocl):
    spec = ConvSpec.make(3, 300, 1, 1, 11, 1, 1)
    space = V.space(spec, ocl.device)
    assert len(space) >= 6 and len(set(space)) == len(space)
    for params in space:
        res = check_plan(V.plan(spec, params, ocl.device), ocl, seed=4)
        assert res.ok, f"{params.short()}: {res}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_storage(ocl, dtype):
    spec = ConvSpec.make(5, 256, 2, 2, 19, 2, 2, dtype=dtype)
    res = check_plan(V.plan(spec, V.default(spec, ocl.device), ocl.device, Epilogue(bias=True)), ocl, seed=6)
    assert res.ok, res


def test_channel_offset_writes_into_a_concat(ocl):
    """k_total / k_offset: the layer writes channels 3..3+K of a wider output, the rest untouched."""
    spec = ConvSpec.make(2, 24, 1, 1, 5, 1, 1)
    epi = Epilogue(k_total=11, k_offset=3)
    plan = V.plan(spec, V.default(spec, ocl.device), ocl.device, epi)
    exe = ocl.executable(plan)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 24, 1, 1), dtype=np.float32)
    w = rng.standard_normal((5, 24, 1, 1), dtype=np.float32)
    y = np.full((2, 11, 1, 1), np.nan, np.float32)
    bufs = {"x": ocl.upload(x), "w": ocl.upload(w), "y": ocl.upload(y)}
    exe(bufs)
    got = ocl.download(bufs["y"], y.shape, "float32")
    ref = np.einsum("nc,kc->nk", x[:, :, 0, 0].astype(np.float64), w[:, :, 0, 0].astype(np.float64))
    assert np.allclose(got[:, 3:8, 0, 0], ref, rtol=1e-5, atol=1e-5)
    assert np.isnan(got[:, :3]).all() and np.isnan(got[:, 8:]).all()


def test_the_same_inputs_give_the_same_bits(ocl):
    """The block's sum runs in a fixed order: two runs agree bit for bit."""
    spec = ConvSpec.make(5, 2048, 1, 1, 33, 1, 1)
    exe = ocl.executable(V.plan(spec, V.default(spec, ocl.device), ocl.device))
    rng = np.random.default_rng(1)
    arrays = {"x": rng.standard_normal(spec.x_shape, dtype=np.float32),
              "w": rng.standard_normal(spec.w_shape, dtype=np.float32)}
    outs = []
    for _ in range(2):
        bufs = {k: ocl.upload(a) for k, a in arrays.items()} | {"y": ocl.upload(np.zeros(spec.y_shape, np.float32))}
        exe(bufs)
        outs.append(ocl.download(bufs["y"], spec.y_shape, "float32"))
    assert np.array_equal(outs[0], outs[1])


def test_refusals_name_the_reason():
    assert "fully connected" in V.applies(ConvSpec.make(5, 64, 3, 3, 8, 1, 1), NOMINAL_CUDA)
    assert "fully connected" in V.applies(ConvSpec.make(5, 64, 3, 3, 8, 3, 3, 1, 1), NOMINAL_CUDA)  # padded
    assert "N (17)" in V.applies(ConvSpec.make(17, 64, 1, 1, 8, 1, 1), NOMINAL_CUDA)
    nhwc = ConvSpec.make(5, 64, 3, 3, 8, 3, 3, layout="nhwc")
    assert "NHWC" in V.applies(nhwc, NOMINAL_CUDA)
    assert V.applies(dataclasses.replace(nhwc, h=1, w=1, r=1, s=1), NOMINAL_CUDA) is None
    with pytest.raises(ValueError, match="rw"):
        V.plan(ConvSpec.make(16, 64, 1, 1, 8, 1, 1), V.default(ConvSpec.make(5, 64, 1, 1, 8, 1, 1), NOMINAL_CUDA)
               .replace(rw=4), NOMINAL_CUDA)


@pytest.mark.parametrize("precision", ["fp32", "relaxed"])
def test_first_on_gpus_up_to_sixteen_images(precision):
    """Boda's AlexNet fc6 / fc7 / fc8 at N5 and VGG-16's at N1, N8 and N16 rank the weight stream first
    in both classes on a GPU (round 34, H100: 78-100 % of the copy bandwidth at N 1-8; at N16 0.043 ms
    against the GEMM paths' 0.065 / 0.141); on a CPU device it ranks last; past N16 it does not apply."""
    cpu = DeviceInfo("opencl", "a CPU", is_gpu=False)
    for n in (1, 5, 8, 16):
        for spec in (ConvSpec.make(n, 256, 6, 6, 4096, 6, 6), ConvSpec.make(n, 4096, 1, 1, 1000, 1, 1)):
            assert ranked("auto", spec, NOMINAL_CUDA, precision=precision)[0].name == "gemv_stream"
            assert V.rank(spec, cpu) == 1
    assert V.applies(ConvSpec.make(17, 4096, 1, 1, 4096, 1, 1), NOMINAL_CUDA) is not None


def test_half_storage_leads_up_to_eight_images():
    """FP16 (round 34): 1.3-3.8x cuDNN-best FP16 at N 1-5, 0.58x at N16, where the tensor cores lead."""
    for n, first in ((1, True), (5, True), (8, True), (9, False), (16, False)):
        spec = ConvSpec.make(n, 4096, 1, 1, 4096, 1, 1, dtype="float16")
        assert (ranked("auto", spec, NOMINAL_CUDA)[0].name == "gemv_stream") is first, n


def test_cuda_compiles_without_spills(nvcc_ok):
    """The first four points of the space on fc7 at N=5 and N=16 and VGG fc6 at N=1, with bias + ReLU:
    no spills (one nvcc run for all)."""
    assert_sources_compile_clean([
        (f"{spec.short()} [{params.short()}]",
         V.plan(spec, params, NOMINAL_CUDA, Epilogue(bias=True, relu=True)).source("cuda"))
        for spec in [ConvSpec.make(5, 4096, 1, 1, 4096, 1, 1), ConvSpec.make(1, 512, 7, 7, 4096, 7, 7),
                     ConvSpec.make(16, 4096, 1, 1, 4096, 1, 1)]
        for params in V.space(spec, NOMINAL_CUDA)[:4]])
