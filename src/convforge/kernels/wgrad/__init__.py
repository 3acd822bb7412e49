"""wgrad (update): the gradient of a convolution's filters, dw[k, c, r, s] = sum over n, p, q of
x[n, c, p*sh + r*dh - pt, q*sw + s*dw - pl] . dy[n, k, p, q] (buffers keep their forward names:
reads "x" and "y" = dy, writes "w" = dw); and the bias gradient beside it.

* direct.py    ``wgrad_direct``: the exact baseline, one block per filter element.
* gemm.py      ``wgrad_implicit_gemm`` (any layer) and ``wgrad_gemm1x1`` (stride-1 unpadded 1x1):
               K x CRS x NPQ GEMMs by the shared SGEMM generator, split-K with a fixed-order reduce.
* winograd.py  ``wgrad_winograd_f2`` / ``_f4``: the Winograd update F(3x3, 2x2) / F(3x3, 4x4).
* bias.py      :func:`bias_grad_plan`: db = dy summed over N, P, Q (a Plan reading "y", writing "bias").
* common.py    split-K choice, reduce kernels, the atomicAdd option (config.deterministic), accuracy.

Importing this package registers its variants (kernels.REGISTRATION_ORDER lists its modules).
"""

from convforge.kernels.wgrad import direct, gemm, winograd  # noqa: F401
from convforge.kernels.wgrad.bias import bias_grad_default, bias_grad_plan, bias_grad_space

__all__ = ["bias_grad_default", "bias_grad_plan", "bias_grad_space"]
