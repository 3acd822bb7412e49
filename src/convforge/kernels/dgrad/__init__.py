"""dgrad (bprop): the gradient of a convolution's input, dx = conv^T(dy, w).

Three ways, one module each, and the pass they share:

* :mod:`.baseline` -- ``dgrad_direct``, the exact baseline: any stride, dilation, padding, groups;
* :mod:`.transposed` -- every forward family serves stride-1 dgrad: the forward convolution of dy
  with the filter rotated by 180 degrees and C/K swapped (padding eff-1-p), one adapter variant
  ``dgrad_<forward name>`` per forward variant worth it;
* :mod:`.strided` -- ``dgrad_strided_gemm``, an implicit GEMM (NHW x C x KRS) that splits the taps
  into stride phases, one dense sub-GEMM per phase in one launch, so it never multiplies the zeros
  of a zero-stuffed dy (CUTLASS's strided dgrad); stride 1 is its one-phase case;
* :mod:`.interleave` -- the pass that writes dx once, in order, from compact per-phase buffers (zeros
  where no phase reaches), used by the wgmma strided dgrad (kernels/tensorcore/sm90/dgrad.py) and by
  ``dgrad_sub_<1x1 forward>`` (:mod:`.transposed`: a strided 1x1 layer as the stride-1 1x1 dgrad of
  dy's P x Q grid, read in place).
"""

from __future__ import annotations

from convforge.kernels.dgrad.baseline import DgradDirect, no_epilogue
from convforge.kernels.dgrad.strided import DgradStridedGemm
from convforge.kernels.dgrad.transposed import DgradTransposed, transposed_spec

__all__ = ["DgradDirect", "DgradStridedGemm", "DgradTransposed", "no_epilogue", "transposed_spec"]
