"""``conv_transpose2d`` for torch tensors, differentiable, on convforge's ops (``convforge.transposed``
says why a transposed conv is a dgrad).

Forward: ``convforge::conv2d_input`` (the dgrad of the forward layer whose input is this conv's output,
grad_output = x), the bias added after. Backward (one autograd node): the gradient of x through
``convforge::conv2d`` (the forward conv of grad_output with w), of w through ``convforge::conv2d_weight``
(the forward layer's wgrad, grad_output as its input and x as its grad_output), of the bias through
``convforge::conv2d_bias``; with the native module loaded that node is native_nodes.inc's
``TransposeNode`` (the same ops in the same order, no Python in its backward), else ``_ConvTransposeFn``.
Every op has a fake implementation, so torch.compile traces it, and each is PyTorch's computation on CPU
tensors and where no convforge variant runs the pass (logged once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from convforge.frontends import fast_path
from convforge.spec import transposed_geometry
from convforge.torch.ops import BIAS_OP, INPUT_OP, OP, WEIGHT_OP

_GRAD_ENABLED = torch.is_grad_enabled


class _ConvTransposeFn(torch.autograd.Function):
    """conv_transpose2d's autograd node over the forward layer's geometry (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Any, w: Any, bias: Any, size: list[int], stride: list[int], padding: list[int],
                dilation: list[int], groups: int, algo: str, precision: str | None, max_error: float | None) -> Any:
        y = _forward(x, w, bias, size, stride, padding, dilation, groups, algo, precision, max_error)
        ctx.save_for_backward(x, w)
        ctx.conv = (stride, padding, dilation, groups, bias is not None, algo, precision, max_error)
        return y

    @staticmethod
    def backward(ctx: Any, gy: Any) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        stride, padding, dilation, groups, has_bias, algo, precision, max_error = ctx.conv
        gy = gy.contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = OP(gy, w, None, stride, padding, dilation, algo, precision, max_error, groups)
        if ctx.needs_input_grad[1]:
            gw = WEIGHT_OP(gy, list(w.shape), x, stride, padding, dilation, groups, algo, precision, max_error)
        if has_bias and ctx.needs_input_grad[2]:
            gb = BIAS_OP(gy)
        return gx, gw, gb, None, None, None, None, None, None, None, None


def _forward(x: Any, w: Any, bias: Any, size: list[int], stride: list[int], padding: list[int],
             dilation: list[int], groups: int, algo: str, precision: str | None, max_error: float | None) -> Any:
    y = INPUT_OP(size, w, x, stride, padding, dilation, groups, algo, precision, max_error)
    return y if bias is None else y + bias.view(1, -1, 1, 1)


def conv_transpose2d(x: Any, w: Any, bias: Any = None, stride: int | Sequence[int] = 1,
                     padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0, groups: int = 1,
                     dilation: int | Sequence[int] = 1, algo: str = "auto", precision: str | None = None,
                     max_error: float | None = None) -> Any:
    """``F.conv_transpose2d`` (x (N, C_in, H, W) or unbatched (C_in, H, W), w (C_in, C_out/groups, R, S))
    on convforge's ops, differentiable in x, w and bias; ``algo``, ``precision`` and ``max_error`` choose
    the variants of every pass as the conv2d op's do."""
    unbatched = x.dim() == 3
    xb = x.unsqueeze(0) if unbatched else x
    spec, eh, ew = transposed_geometry(tuple(xb.shape), tuple(w.shape), stride, padding, output_padding, groups,
                                       dilation)
    if eh or ew:  # output_padding past what the forward layer's padding absorbs: zero rows / columns of x
        xb = F.pad(xb, (0, ew, 0, eh))
    call = (xb, w, bias, list(spec.x_shape), list(spec.stride), list(spec.pad), list(spec.dilation), spec.groups,
            algo, precision, max_error)
    if _GRAD_ENABLED() and (xb.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
        module = fast_path.torch_module() if xb.is_cuda else None
        y = None if module is None else module.conv_transpose(*call)  # native_nodes.inc's TransposeNode
        if y is None:
            y = _ConvTransposeFn.apply(*call)
    else:
        y = _forward(*call)
    return y.squeeze(0) if unbatched else y
