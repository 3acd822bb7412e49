"""Tensor-core convolutions: one wgmma generator for sm_90a, and the mma.sync kernels it leaves in place.

The generator (CUTLASS 3's sm90 collectives as a model; each fact in one file):

    cexpr      C integer expressions that Python evaluates too (the emulation runs the generator's own)
    isa        wgmma as data: math modes (TF32, 3xTF32, FP16, BF16), shapes, the accumulator layout
    smem       shared tiles: the 128-byte swizzle, matrix descriptors, the stage layout
    operands   the operand-iterator protocol (A: activation rows of an implicit GEMM, B: filters) and
               its fprop iterators; dgrad / wgrad are new iterators of the same protocol
    prep       the steps that bring operands into the generator's layouts (NCHW -> NHWC, KCRS -> KRSC,
               TF32 rounding, the 3xTF32 split)
    tiles      one tile configuration type and its pick / space
    schedule   persistent tiles over the SMs, raster order, split-K ranges
    mainloop   one stage ring: producer warpgroup (cp.async into mbarrier stages), consumer warpgroups
               (wgmma from shared memory), setmaxnreg
    epilogue   bias, residual, ReLU, channel offset, dtype rounding, NCHW stores, split-K partials and
               their deterministic reduce
    kernel     the composition: roles, barriers, the persistent loop
    variants   registered Variants (implicit GEMM per math mode)
    stem       stems (3-channel images) with A built in registers from input rows in shared memory
    winograd   non-fused Winograd F(2x2) / F(4x4) whose batched GEMM runs on the generator
    wgrad      wgrad as the forward convolution of a transposed problem (images as channels)
    dgrad      strided dgrad: one forward GEMM per stride phase, stored on the phase's sub-grid of dx

Kept beside it (they serve devices the generator cannot, compute capability 8.x, and stay where
measured results put them): ``mma_sync`` / ``mma_variants`` (mma.sync TF32 and 3xTF32 implicit GEMM,
1x1, non-fused Winograd), ``mma_pipe`` / ``mma_staged`` (the cp.async-staged mma.sync GEMM),
``wgmma_1x1`` (the first wgmma 1x1 GEMM, which reads NCHW x in place without a conversion pass).
"""

from __future__ import annotations

# isort: off
# Order matters: the training passes last. They import kernels.dgrad, whose stride-1 adapters wrap the
# forward variants registered by the modules before them (whichever package is imported first).
from convforge.kernels.tensorcore import (  # noqa: F401 - importing registers the variants
    mma_staged,
    mma_variants,
    stem,
    variants,
    wgmma_1x1,
    winograd,
)
from convforge.kernels.tensorcore import dgrad, wgrad  # noqa: F401
# isort: on
