"""PyTorch drop-in: ``Conv2d`` (an ``nn.Conv2d`` that runs convforge's kernels), ``ConvTranspose2d``
(an ``nn.ConvTranspose2d`` on convforge's dgrad kernels: ``conv_transpose2d``), ``convert(model)``,
``fuse(model)`` (convs with the batch norm, residual add and ReLU after them folded into one
kernel plan: ``FusedConv2d``; linear layers over channels-last activations with their GELU, or
layer scale and residual add: ``FusedLinear``, ConvNeXt's MLPs) and the ``convforge::conv2d``
operator (torch.compile and CUDA-graph safe, with autograd), and ``calibrate(model, reference,
example)`` (a per-network error budget: the fewest layers set to a tight max_error that bring
the output error within budget x PyTorch's), and ``prepare(model, example)`` (every layer's
kernels compiled on several threads before the first forward).

Imported only when torch is installed (torch stays an optional extra): ``import convforge`` never
imports this package.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without torch
    raise ImportError("convforge.torch needs PyTorch: pip install torch") from err

from convforge.torch.fuse import convert, fuse
from convforge.torch.fused import FusedConv2d
from convforge.torch.linear import FusedLinear
from convforge.torch.model_calibration import CalibrationReport, calibrate
from convforge.torch.modules import Conv2d, ConvertReport, ConvTranspose2d
from convforge.torch.ops import conv2d, output_shape
from convforge.torch.prepare import prepare
from convforge.torch.transposed import conv_transpose2d

__all__ = ["CalibrationReport", "Conv2d", "ConvTranspose2d", "ConvertReport", "FusedConv2d", "FusedLinear",
           "calibrate", "convert", "conv2d", "conv_transpose2d", "fuse", "output_shape", "prepare"]
