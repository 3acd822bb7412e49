"""Winograd convolution: exact transform matrices, the non-fused pipeline and the fused kernel.

Importing this package registers its variants (kernels.REGISTRATION_ORDER lists its modules).
"""

from convforge.kernels.winograd import fused, matrices, nonfused  # noqa: F401
