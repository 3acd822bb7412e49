"""Measured ceilings: FP32 FFMA throughput and device copy bandwidth, and on CUDA the tensor cores'.

The first two are generated kernels in the dialect, wrapped in Plans and run through the back-end like
any convolution, so "% of peak" is against what this device does today, not a datasheet. On a CPU
device (PoCL) the FFMA kernel measures PoCL's code for a GPU-shaped kernel, not the CPU (it read
0.0004 TFLOPS, and layers then reached "197 % of peak"), so it is not measured there and no row
has a "% peak". The
tensor-core ceilings (FP16, BF16, TF32: a large cuBLAS GEMM through torch.matmul, FP32 accumulation)
are measured once per run where torch sees the GPU (``baselines.tensor_core_peaks``).
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from convforge.backends.base import Backend
from convforge.codegen.dialect import Buf, Kernel, Scalar
from convforge.codegen.meta import Code
from convforge.params import Params
from convforge.plan import Launch, Plan
from convforge.spec import ConvSpec

_CHAINS = 8  # independent FMA chains per thread: enough to cover FMA latency on a GPU
_UNROLL = 8  # FMAs of each chain per loop trip
_DUMMY = ConvSpec(1, 1, 1, 1, 1, 1, 1)  # Plans carry a spec; the ceiling kernels ignore it


@dataclass(frozen=True)
class Ceilings:
    """Measured FP32 FMA throughput (TFLOPS; None: not measured, CPU devices) and copy bandwidth
    (GB/s, read + write)."""

    ffma_tflops: float | None
    copy_gbs: float
    ffma_threads: int = 0
    copy_bytes: int = 0
    # tensor-core GEMM TFLOPS by math: "float16", "bfloat16", "tf32" (empty: not measured here)
    tc_tflops: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def tc_peak(self, dtype: str, precision: str = "fp32") -> float | None:
        """The tensor-core ceiling a row is measured against: its half dtype's, TF32's for a float32
        row of the relaxed class; None for FP32 math (the FFMA ceiling) or when not measured."""
        key = dtype if dtype != "float32" else ("tf32" if precision == "relaxed" else "")
        return self.tc_tflops.get(key)

    def __str__(self) -> str:
        tc = ", ".join(f"{k.replace('float16', 'FP16').replace('bfloat16', 'BF16').upper()} {v:.4g}"
                       for k, v in self.tc_tflops.items())
        ffma = (f"measured FP32 FFMA {self.ffma_tflops:.4g} TFLOPS" if self.ffma_tflops else
                "FP32 FFMA not measured (a CPU device: its generated kernel says nothing of the CPU's peak)")
        return (f"{ffma}, copy bandwidth {self.copy_gbs:.4g} GB/s (read + write)"
                + (f", tensor-core GEMM (cuBLAS, FP32 accumulation) {tc} TFLOPS" if tc else ""))


def ffma_kernel(iters: int, block: int) -> Kernel:
    """Register-only FMA chains: ``iters`` trips of CHAINS x UNROLL dependent-in-chain FMAs."""
    code = Code()
    code(f"const int tid = GROUP_ID(0) * {block} + LOCAL_ID(0);")
    for j in range(_CHAINS):
        code(f"float a{j} = seed + (float)(tid + {j});")
    with code.block(f"for (int i = 0; i < {iters}; ++i)"):
        for _ in range(_UNROLL):
            code(" ".join(f"a{j} = FMA(a{j}, m, c);" for j in range(_CHAINS)))
    code("y[tid] = " + " + ".join(f"a{j}" for j in range(_CHAINS)) + ";  // keeps the chains alive")
    return Kernel("ceiling_ffma", (Buf("y", readonly=False), Scalar("seed", "float"),
                                   Scalar("m", "float"), Scalar("c", "float")),
                  code.text(), (block, 1, 1), comment=f"FFMA ceiling: {iters} x {_CHAINS * _UNROLL} FMAs")


def copy_kernel(block: int, per_thread: int) -> Kernel:
    """float4 copy, ``per_thread`` float4 per thread, block-strided so accesses coalesce."""
    code = Code()
    code(f"const int base = GROUP_ID(0) * {block * per_thread} + LOCAL_ID(0);")
    for i in range(per_thread):
        code(f"VSTORE4(VLOAD4(base + {i * block}, x), base + {i * block}, y);")
    return Kernel("ceiling_copy", (Buf("x"), Buf("y", readonly=False)), code.text(), (block, 1, 1),
                  comment="copy-bandwidth ceiling")


def _plan(name: str, kernel: Kernel, grid: int, args: tuple[Any, ...]) -> Plan:
    launch = Launch(kernel.name, (grid, 1, 1), kernel.block, args)
    return Plan(name, "ceiling", _DUMMY, Params(), (kernel,), (launch,))


def _median_ms(be: Backend, run: Any, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    be.synchronize()
    return statistics.median(be.time_ms(run, repeats))


def measure_ffma(be: Backend, warmup: int = 2, repeats: int = 5,
                 blocks: int | None = None, iters: int | None = None) -> tuple[float, int]:
    """(TFLOPS, threads) of the FFMA kernel; sizes scale with the device unless given."""
    gpu = be.device.is_gpu
    block = 256 if gpu else 64
    blocks = blocks or (be.device.units * (16 if gpu else 4))
    iters = iters or (4096 if gpu else 256)
    threads = block * blocks
    exe = be.executable(_plan("ceiling_ffma", ffma_kernel(iters, block), blocks,
                              ("y", 1.0, 0.999, 1e-3)))
    bufs = {"y": be.empty(4 * threads)}
    ms = _median_ms(be, lambda: exe(bufs), warmup, repeats)
    flops = 2.0 * threads * iters * _CHAINS * _UNROLL
    return flops / (ms * 1e-3) / 1e12, threads


def measure_copy(be: Backend, warmup: int = 2, repeats: int = 5,
                 nbytes: int | None = None, sets: int = 1) -> tuple[float, int]:
    """(GB/s counting read + write, bytes copied) of the float4 copy kernel. ``sets`` > 1 cycles
    through that many buffer pairs, as a small layer's timing cycles its inputs (timing.rotation_sets),
    so a copy of a layer's own bytes is timed from DRAM too: the ceiling a launch of that size reaches."""
    gpu = be.device.is_gpu
    block, per = (256, 4) if gpu else (64, 4)
    chunk = 16 * block * per
    want = nbytes or ((512 << 20) if gpu else (16 << 20))  # GPU: far beyond L2
    blocks = max(1, want // chunk)
    size = blocks * chunk
    exe = be.executable(_plan("ceiling_copy", copy_kernel(block, per), blocks, ("x", "y")))
    bufs = [{"x": be.upload(np.ones(size // 4, dtype=np.float32)), "y": be.empty(size)}
            for _ in range(max(1, sets))]
    turn = itertools.cycle(bufs)
    ms = _median_ms(be, lambda: exe(next(turn)), warmup, repeats)
    return 2.0 * size / (ms * 1e-3) / 1e9, size


def measure(be: Backend, quick: bool = False) -> Ceilings:
    """Every ceiling; ``quick`` uses tiny sizes (tests, CPU smoke runs). The FFMA one on GPUs only
    (module docstring), the tensor-core ones only on the CUDA back-end where torch sees a GPU."""
    tf: float | None = None
    threads = 0
    if quick:
        if be.device.is_gpu:
            tf, threads = measure_ffma(be, 1, 3, blocks=2, iters=16)
        gbs, size = measure_copy(be, 1, 3, nbytes=1 << 20)
    else:
        if be.device.is_gpu:
            tf, threads = measure_ffma(be)
        gbs, size = measure_copy(be)
    tc: dict[str, float] = {}
    if be.name == "cuda":
        from convforge.apps.bench.baselines import tensor_core_peaks

        tc = tensor_core_peaks(quick)
    return Ceilings(tf, gbs, threads, size, tc)
