"""Tensor-core convolutions, by the instruction they run on:

* ``sm90``: the wgmma generator for sm_90a and the variants it registers (plus the wgmma 1x1 GEMM beside it);
* ``sm80``: the mma.sync kernels (compute capability 8.x and up) that serve devices the generator cannot.
"""

from __future__ import annotations

# isort: off
# Order matters: the training passes last. They import kernels.dgrad, whose stride-1 adapters wrap the
# forward variants registered by the modules before them (whichever package is imported first).
from convforge.kernels.tensorcore.sm80 import mma_staged, mma_variants  # noqa: F401 - importing registers
from convforge.kernels.tensorcore.sm90 import stem, variants, wgmma_1x1, winograd  # noqa: F401
from convforge.kernels.tensorcore.sm90 import dgrad, wgrad  # noqa: F401
# isort: on
