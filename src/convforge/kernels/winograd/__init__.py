"""Winograd convolution: exact transform matrices, the non-fused pipeline and the fused kernel.

Importing this package registers its variants (the kernels package imports it automatically).
"""

from convforge.kernels.winograd import fused, matrices, nonfused  # noqa: F401
