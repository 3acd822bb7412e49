"""Shared fixtures: the OpenCL back-end (PoCL on CI), the CUDA back-end (GPU tier), nominal devices."""

from __future__ import annotations

import os

import pytest

from convforge.plan import DeviceInfo

# PoCL compiles each kernel's work-group function through LLVM's -O3 pipeline when it first runs, and
# on a cold cache (CI: a fresh machine) that is most of the suite's time: a third as long without the
# optimiser. The tests check what the kernels compute, on shapes too small for speed to matter; set
# POCL_EXTRA_BUILD_FLAGS (even to "") to test the optimised build.
os.environ.setdefault("POCL_EXTRA_BUILD_FLAGS", "-cl-opt-disable")

NOMINAL_CUDA = DeviceInfo("cuda", "nominal sm_90", cc=(9, 0), shared_optin_bytes=227 * 1024, units=132)
NOMINAL_OPENCL_GPU = DeviceInfo("opencl", "nominal OpenCL GPU", units=132)


@pytest.fixture(scope="session")
def ocl():
    """The OpenCL back-end. On CI a missing device is an error, never a silent skip."""
    from convforge.backends import get_backend, opencl_available

    if not opencl_available():
        if os.environ.get("CI"):
            pytest.fail("no OpenCL device on CI: is pyopencl[pocl] installed?")
        pytest.skip("no OpenCL device (pip install 'convforge[opencl]')")
    return get_backend("opencl")


@pytest.fixture
def poisoned(ocl, monkeypatch):
    """Every buffer the back-end allocates from now on starts as NaN (outputs, workspace)."""
    real = ocl.empty

    def empty(nbytes):
        buf = real(nbytes)
        ocl.fill(buf, float("nan"), max(nbytes, 4))
        return buf

    monkeypatch.setattr(ocl, "empty", empty)
    return ocl


@pytest.fixture(scope="session")
def cuda():
    """The CUDA back-end; GPU-tier tests skip with this reason when there is no CUDA device."""
    from convforge.backends import cuda_available, get_backend

    if not cuda_available():
        pytest.skip("GPU tier: no CUDA device (run scripts/gpu-check on a GPU machine)")
    return get_backend("cuda")


@pytest.fixture
def gpu(cuda):
    """The CUDA back-end, for tests of convforge.torch: skips unless torch sees a CUDA device too."""
    torch = pytest.importorskip("torch", reason="GPU tier of convforge.torch: torch not installed")
    if not torch.cuda.is_available():
        pytest.skip("GPU tier: torch sees no CUDA device")
    return cuda


@pytest.fixture(scope="session")
def nvcc_ok():
    from convforge.codegen.nvcc import nvcc_path

    if nvcc_path() is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc missing on CI: the CUDA compile tier cannot run")
        pytest.skip("nvcc not on PATH: CUDA compile checks skipped")
    return True


@pytest.fixture
def capture_graph():
    """``capture_graph(fn)`` -> (graph, output): ``fn()`` run three times on a side stream first
    (runners, workspace and transformed filters made outside the capture), then one call captured
    in a CUDA graph on the current stream. Call under ``torch.no_grad()``, on the device to capture on."""
    import torch

    def capture(fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out

    return capture
