"""Tensor-core convolutions, by the instruction they run on:

* ``sm90``: the wgmma generator for sm_90a and the variants it registers (plus the wgmma 1x1 GEMM beside it);
* ``sm80``: the mma.sync kernels (compute capability 8.x and up) that serve devices the generator cannot.
"""

from __future__ import annotations
