"""sm_90a tensor cores: one wgmma generator (CUTLASS 3's sm90 collectives as a model; each fact in one
file) and the variants it registers, with one wgmma kernel kept beside it.

The generator:

    cexpr      C integer expressions that Python evaluates too (the emulation runs the generator's own)
    isa        wgmma as data: math modes (TF32, 3xTF32, FP16, BF16), shapes, the accumulator layout
    smem       shared tiles: the 128-byte swizzle, matrix descriptors, the stage layout
    operands   the operand-iterator protocol (A: activation rows of an implicit GEMM, B: filters) and
               its fprop iterators; dgrad / wgrad are new iterators of the same protocol
    prep       the steps that bring operands into the generator's layouts (NCHW -> NHWC, KCRS -> KRSC,
               TF32 rounding, the 3xTF32 split)
    tiles      one tile configuration type and its pick / space
    schedule   persistent tiles over the SMs, raster order, split-K ranges
    tma        the TMA producer: tensor maps and their copies into the stage ring
    mainloop   one stage ring: producer warpgroup (cp.async into mbarrier stages), consumer warpgroups
               (wgmma from shared memory), setmaxnreg
    epilogue   bias, residual, ReLU, channel offset, dtype rounding, NCHW stores, split-K partials and
               their deterministic reduce
    kernel     the composition: roles, barriers, the persistent loop

What runs on it:

    variants   registered Variants (implicit GEMM per math mode)
    stem       stems (3-channel images) with A built in registers from input rows in shared memory
    winograd   non-fused Winograd F(2x2) / F(4x4) whose batched GEMM runs on the generator
    wgrad      wgrad as the forward convolution of a transposed problem (images as channels)
    wgrad_nhwc wgrad of channels-last half layers, x and dy as they lie (MN-major operands, no transposes)
    dgrad      strided dgrad: one forward GEMM per stride phase, stored on the phase's sub-grid of dx
    dgrad_grouped  strided dgrad of grouped half layers: each phase's GEMM batched over the (packed) groups
    dgrad_paired   strided dgrad with neighbouring column phases that read the same dy columns in one GEMM
                   (NCHW dx stored straight: no interleave; named only until a GPU has run it)
    gradrows   the masked gradient of a conv -> ReLU node written in the backward GEMMs' operand layouts

Outside the generator: ``wgmma_1x1``, the first wgmma 1x1 GEMM (its own pipeline, the generator's ``smem``
and ``isa`` facts), which reads NCHW x in place without a conversion pass; first only where that pays
(``variants.wgmma_1x1_leads``).
"""
