"""The kernel dialect renders to both back-ends; features are refused where absent; the disk cache."""

from __future__ import annotations

import numpy as np
import pytest

from convforge.backends.cache import DiskCache, cache_key
from convforge.codegen.dialect import Buf, ConstBuf, Kernel, LocalBuf, Scalar
from convforge.codegen.render import render

BODY = """    SHARED float t[64];
    const int i = GROUP_ID(0) * GROUP_SIZE(0) + LOCAL_ID(0);
    t[LOCAL_ID(0)] = LDG(x + i);
    BARRIER();
    const float4 v = VLOAD4(0, x);
    y[i] = MAX(FMA(t[LOCAL_ID(0)], wc[0], v.x), 0.0f) * alpha;
"""


def _kernel(**kw) -> Kernel:
    args = (Buf("x"), ConstBuf("wc", 4), Buf("y", readonly=False), Scalar("alpha", "float"))
    return Kernel("k", args, BODY, (64, 1, 1), **kw)


def test_cuda_spelling():
    src = render([_kernel()], "cuda")
    for piece in ("__constant__ float wc[4];", '__global__ void __launch_bounds__(64)', "__shared__ float t[64]",
                  "blockIdx.x", "__syncthreads()", "__ldg(x + i)", "fmaxf(fmaf(", "const float alpha",
                  "(*(const float4*)((x) + 4 * (0)))"):
        assert piece in src, piece
    assert "wc," not in src.split("void")[1]  # the constant symbol is not a parameter


def test_min_blocks_launch_bound():
    """min_blocks becomes CUDA's second launch bound (a register cap); OpenCL has no spelling."""
    assert "__launch_bounds__(64, 2)" in render([_kernel(min_blocks=2)], "cuda")
    assert "reqd_work_group_size(64, 1, 1)" in render([_kernel(min_blocks=2)], "opencl")


def test_opencl_spelling():
    src = render([_kernel()], "opencl")
    for piece in ("__constant float* restrict wc", "reqd_work_group_size(64, 1, 1)", "__local float t[64]",
                  "get_group_id(0)", "barrier(CLK_LOCAL_MEM_FENCE)", "(*(x + i))", "fmax(mad(",
                  "vload4(0, x)"):
        assert piece in src, piece


ASYNC = """    SHARED float t[64];
    const U64 m = 5;
    COPY4_ASYNC(t + 4 * LOCAL_ID(0), x + 4 * LOCAL_ID(0));
    COPY1_ASYNC(t, 3, x, 7, m, 2);
    COPY_WAIT();
    BARRIER();
"""


def test_async_copy_spelling():
    """cp.async on sm_80+ (a plain copy below, and on OpenCL), 64-bit masks, immediate offsets."""
    k = Kernel("k", (Buf("x"),), ASYNC, (16, 1, 1))
    cuda = render([k], "cuda")
    for piece in ("cp.async.cg.shared.global [%0], [%1], 16;", "cp.async.ca.shared.global [%0+%4], [%1+%5], 4, z;",
                  "cp.async.wait_all;", "#if __CUDA_ARCH__ >= 800", "const unsigned long long m = 5;",
                  "cf_copy1_async(t, 3, x, 7, m, 2);", "cf_copy_wait();"):
        assert piece in cuda, piece
    ocl = render([k], "opencl")
    for piece in ("vstore4(vload4(0, x + 4 * ((int)get_local_id(0))), 0, t + 4 * ((int)get_local_id(0)))",
                  "((t)[3] = (((m) >> (2)) & 1ul) ? (x)[7] : 0.0f)", "const ulong m = 5;"):
        assert piece in ocl, piece
    assert "cp.async" not in render([_kernel()], "cuda")  # the helpers only where used


def test_opencl_runs_async_copies(ocl):
    """On OpenCL the copies are synchronous; masked-off elements read as 0."""
    from convforge.params import Params
    from convforge.plan import Launch, Plan
    from convforge.spec import ConvSpec

    body = """    SHARED float t[8];
    const U64 m = 0xB;  // elements 0, 1, 3 exist
    if (LOCAL_ID(0) == 0) {
        COPY4_ASYNC(t + 4, x + 4);
        COPY1_ASYNC(t, 0, x, 0, m, 0); COPY1_ASYNC(t, 1, x, 1, m, 1);
        COPY1_ASYNC(t, 2, x, 2, m, 2); COPY1_ASYNC(t, 3, x, 3, m, 3);
    }
    COPY_WAIT();
    BARRIER();
    y[LOCAL_ID(0)] = t[LOCAL_ID(0)];
"""
    k = Kernel("k", (Buf("x"), Buf("y", readonly=False)), body, (8, 1, 1))
    plan = Plan("k", "test", ConvSpec.make(1, 1, 2, 4, 1, 1, 1), Params(), (k,),
                (Launch("k", (1, 1, 1), (8, 1, 1), ("x", "y")),))
    x = np.arange(1, 9, dtype=np.float32)
    bufs = {"x": ocl.upload(x), "y": ocl.empty(32)}
    ocl.executable(plan)(bufs)
    np.testing.assert_array_equal(ocl.download(bufs["y"], (8,)), [1, 2, 0, 4, 5, 6, 7, 8])


def test_features_refused_where_absent():
    k = Kernel("k", (Buf("x"),), "float v = SHFL(1.0f, 0);", (32, 1, 1), frozenset({"shuffle"}))
    assert "__shfl_sync" in render([k], "cuda")
    with pytest.raises(ValueError, match=r"opencl back-end lacks features \['shuffle'\]"):
        render([k], "opencl")
    with pytest.raises(ValueError, match="backend"):
        render([k], "metal")


def test_launch_sized_shared_memory():
    k = Kernel("k", (Buf("x"), LocalBuf("smem", 65536)), "smem[0] = x[0];", (32, 1, 1))
    assert "extern __shared__ __align__(16) float smem[];" in render([k], "cuda")
    assert "__local float* restrict smem" in render([k], "opencl")


def test_opencl_runs_the_dialect(ocl):
    from convforge.codegen.dialect import Buf
    from convforge.params import Params
    from convforge.plan import Launch, Plan
    from convforge.spec import ConvSpec

    spec = ConvSpec.make(1, 1, 4, 4, 1, 1, 1)
    k = Kernel("scale", (Buf("x"), Buf("y", readonly=False), Scalar("a", "float")),
               "    const int i = GROUP_ID(0) * GROUP_SIZE(0) + LOCAL_ID(0);\n"
               "    if (i < 16) y[i] = FMA(x[i], a, 1.0f);\n", (8, 1, 1))
    plan = Plan("scale", "test", spec, Params(), (k,), (Launch("scale", (2, 1, 1), (8, 1, 1), ("x", "y", 2.0)),))
    x = np.arange(16, dtype=np.float32)
    bufs = {"x": ocl.upload(x), "y": ocl.empty(64)}
    ocl.executable(plan)(bufs)
    np.testing.assert_array_equal(ocl.download(bufs["y"], (16,)), 2 * x + 1)


def test_disk_cache_is_atomic_and_detects_corruption(tmp_path):
    cache = DiskCache(tmp_path)
    key = cache_key("src", "opts", "nvrtc-13.0", "H200", "580", "0.1.0")
    assert key != cache_key("src", "opts", "nvrtc-13.0", "H100", "580", "0.1.0")
    assert cache.get(key) is None
    cache.put(key, b"binary")
    assert cache.get(key) == b"binary"
    assert not list(tmp_path.glob(".tmp-*")), "temporary files must be renamed into place"
    path = tmp_path / f"{key}.bin"
    path.write_bytes(path.read_bytes()[:-2] + b"XX")  # corrupt payload
    assert cache.get(key) is None and not path.exists()


def test_opencl_program_comes_back_from_disk(ocl, tmp_path, monkeypatch):
    from convforge.backends.opencl import OpenCLBackend

    k = Kernel("one", (Buf("y", readonly=False),), "    y[0] = 1.0f;\n", (1, 1, 1))
    src = render([k], "opencl")
    be = OpenCLBackend()
    be.disk = DiskCache(tmp_path)
    be.keeps_binaries = True  # what a GPU driver's back-end does; PoCL's own cache is tested below
    be.program(src)
    assert len(list(tmp_path.glob("*.bin"))) == 1
    be2 = OpenCLBackend()
    be2.disk = DiskCache(tmp_path)
    calls = []
    monkeypatch.setattr(be2, "build", lambda s: calls.append(s))
    assert be2.program(src) is not None and not calls, "second back-end should load the cached binary"


def test_pocl_programs_are_not_kept_as_binaries(ocl, tmp_path):
    """PoCL compiles every kernel again for a binary and keeps its own cache by source: we keep none."""
    from convforge.backends.opencl import OpenCLBackend

    be = OpenCLBackend()
    if "portable computing language" not in be.cl_device.platform.name.lower():
        pytest.skip(f"not PoCL: {be.cl_device.platform.name}")
    be.disk = DiskCache(tmp_path)
    k = Kernel("one", (Buf("y", readonly=False),), "    y[0] = 2.0f;\n", (1, 1, 1))
    assert be.program(render([k], "opencl")) is not None
    assert not be.keeps_binaries and not list(tmp_path.glob("*.bin"))


def test_too_small_buffer_is_refused(ocl):
    from convforge.kernels import get_variant
    from convforge.spec import ConvSpec

    spec = ConvSpec.make(1, 2, 9, 9, 3, 3, 3)
    v = get_variant("direct")
    exe = ocl.executable(v.plan(spec, v.default(spec, ocl.device), ocl.device))
    bufs = {"x": ocl.empty(4 * 2 * 9 * 9), "w": ocl.empty(4 * 3 * 2 * 9), "y": ocl.empty(4 * 3 * 7 * 6)}
    with pytest.raises(ValueError, match=r"y \(n:k:p:q\) needs 588 bytes"):
        exe(bufs)


def test_clusters_are_cuda_sm90_only():
    """Kernel.cluster > 1: CUDA declares the cluster shape and gets the cluster helpers; OpenCL,
    which has no thread-block clusters, refuses the kernel by name."""
    body = "    const int r = CLUSTER_RANK();\n    CLUSTER_SYNC();\n    y[CLUSTER_ID() * NUM_CLUSTERS() + r] = 0.0f;\n"
    k = Kernel("kc", (Buf("y", readonly=False),), body, (64, 1, 1), cluster=2)
    src = render([k], "cuda")
    assert "__cluster_dims__(2, 1, 1)" in src and "%%cluster_ctarank" in src and "barrier.cluster.wait" in src
    assert "__cluster_dims__" not in render([_kernel()], "cuda")
    with pytest.raises(ValueError, match="kc.*clusters"):
        render([k], "opencl")
