"""mma.sync tensor cores (compute capability 8.x and up): the kernels that serve devices the sm_90a
generator (``kernels.tensorcore.sm90``) cannot, and stay where measured results put them.

    mma_sync      the mma.sync TF32 / 3xTF32 GEMM generator on register-staged tiles
    mma_variants  its registered Variants: implicit GEMM, 1x1, non-fused Winograd
    mma_pipe      the cp.async-staged mma.sync GEMM (a stage ring in shared memory)
    mma_staged    its registered Variants: 1x1 and Winograd F(2x2)
    depthwise_mma / depthwise_mma_wgrad   depthwise layers on mma.sync (Toeplitz / Hankel blocks), half
    grouped_mma_wgrad                     narrow groups' wgrad from NHWC tiles by ldmatrix.trans, half
"""
