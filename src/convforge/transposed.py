"""Transposed convolutions in PyTorch's argument order and semantics, run as the dgrad of a forward layer.

``conv_transpose2d(x, w, bias, stride, padding, output_padding, groups, dilation)`` with x (N, C_in, H,
W) or unbatched (C_in, H, W) and w (C_in, C_out/groups, R, S) is the gradient of the input of the
forward layer whose input is the transposed conv's output (N, C_out, H_out, W_out), whose KCRS
filters are w (K = C_in) and whose grad_output is x (``spec.transposed_geometry``). So it runs on
``convforge.grad.conv2d_input``: dispatch chooses among the dgrad variants of that (spec, dtype) as
for any dgrad: the stride-1 adapters of the forward families (Winograd, implicit GEMM, tensor cores),
the strided phase decomposition (``dgrad_strided_gemm``, ``dgrad_tc_strided_*``: one dense GEMM per
stride phase, never a zero-stuffed input) and ``dgrad_direct``. The bias is added after the plan
(dgrad plans write a plain gradient). Where output_padding exceeds what the forward layer's bottom /
right padding can absorb (output_padding - padding >= stride, possible only with dilation), x is
read with zero rows / columns appended (a copy).

Its gradients are the other two passes with the roles renamed:
``conv_transpose2d_input`` (the gradient of x) is the forward conv of grad_output with w (fprop),
``conv_transpose2d_weight`` (the gradient of w) is the forward layer's wgrad with grad_output as its
input and x as its grad_output. The bias's is grad_output summed over N, H and W
(``convforge.grad.conv2d_bias``).

NumPy arrays run on OpenCL and come back as NumPy; CuPy arrays and torch CUDA tensors on CUDA, as
the same type on the same device (gradients through autograd: ``convforge.torch.conv_transpose2d``
and ``ConvTranspose2d``). float64 and complex arrays are refused, naming PyTorch's op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from convforge import api, grad
from convforge.frontends.checks import check_array, check_layout, same_dtype
from convforge.frontends.kinds import kind_of, pad_copy
from convforge.params import Params
from convforge.spec import ConvSpec, transposed_geometry

__all__ = ["conv_transpose2d", "conv_transpose2d_input", "conv_transpose2d_weight", "transposed_problem"]

_OP = "torch.nn.functional.conv_transpose2d"


def transposed_problem(x: Any, w: Any, stride: Any = 1, padding: Any = 0, output_padding: Any = 0, groups: Any = 1,
                       dilation: Any = 1) -> tuple[ConvSpec, int, int]:
    """(the dgrad spec, extra rows, extra columns) of conv_transpose2d on these arrays (batched, checked
    kinds and dtypes): ``spec.transposed_geometry`` with the arrays' dtype."""
    kind = kind_of(x, "input")
    if kind_of(w, "weights") != kind:
        raise ValueError("input and weights must be the same kind of array")
    dtype = check_array(x, "input", 4, kind, _OP)
    same_dtype(dtype, check_array(w, "weights", 4, kind, _OP), "weights")
    spec, eh, ew = transposed_geometry(tuple(x.shape), tuple(w.shape), stride, padding, output_padding, groups,
                                       dilation)
    return dataclasses.replace(spec, dtype=dtype), eh, ew


def _batched(x: Any, what: str) -> tuple[Any, bool]:
    """``x`` as a batch (a (C, H, W) array as a batch of one) and whether it was unbatched."""
    rank = len(getattr(x, "shape", ()))
    if rank == 3:
        return x[None], True
    if rank != 4:
        raise ValueError(f"{what} must have rank 4 (N, C, H, W) or 3 (C, H, W), got shape "
                         f"{tuple(getattr(x, 'shape', ()))}")
    return x, False


def conv_transpose2d(x: Any, w: Any, bias: Any = None, stride: int | Sequence[int] = 1,
                     padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0, groups: int = 1,
                     dilation: int | Sequence[int] = 1, algo: str = "auto", precision: str | None = None,
                     max_error: float | None = None, backend: str | None = None,
                     workspace_limit: int | None = None, params: Params | dict[str, Any] | None = None) -> Any:
    """PyTorch's ``F.conv_transpose2d`` on convforge's dgrad kernels (module docstring): x (N, C_in, H,
    W) or (C_in, H, W), w (C_in, C_out/groups, R, S), an optional bias of C_out; padding an int,
    (h, w) or (top, bottom, left, right). ``algo``, ``precision``, ``max_error``,
    ``workspace_limit`` and ``params`` choose the dgrad variant as they choose conv2d's."""
    kind_of(x, "input")  # the kind first: a list or a CPU tensor is named as such
    xb, unbatched = _batched(x, "input")
    spec, eh, ew = transposed_problem(xb, w, stride, padding, output_padding, groups, dilation)
    kind = kind_of(xb, "input")
    if bias is not None:
        if kind_of(bias, "bias") != kind:
            raise ValueError("bias must be the same kind of array as the input")
        same_dtype(spec.dtype, check_array(bias, "bias", 1, kind, _OP), "bias")
        if bias.shape[0] != spec.c:
            raise ValueError(f"bias has {bias.shape[0]} entries, the output has C_out={spec.c}")
    check_layout(xb, "input", 4)
    if eh or ew:
        xb = pad_copy(xb, (0, eh, 0, ew), "zeros", kind)
    y = grad.conv2d_input(spec.x_shape, w, xb, spec.stride, spec.pad, spec.dilation, spec.groups, algo, precision,
                          max_error, backend, workspace_limit, params)
    if bias is not None:
        y += bias.reshape(1, -1, 1, 1)
    return y[0] if unbatched else y


def conv_transpose2d_input(input_size: Sequence[int], w: Any, grad_output: Any, stride: int | Sequence[int] = 1,
                           padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0,
                           groups: int = 1, dilation: int | Sequence[int] = 1, algo: str = "auto",
                           precision: str | None = None, max_error: float | None = None,
                           backend: str | None = None) -> Any:
    """The gradient of conv_transpose2d's input of size ``input_size`` (N, C_in, H, W): the forward
    conv of ``grad_output`` (N, C_out, H_out, W_out) with ``w``, an array of ``input_size``."""
    spec, eh, ew = transposed_geometry(tuple(input_size), tuple(w.shape), stride, padding, output_padding, groups,
                                       dilation)
    if tuple(grad_output.shape) != spec.x_shape:
        raise ValueError(f"grad_output has shape {tuple(grad_output.shape)}, but conv_transpose2d of an input of "
                         f"size {tuple(input_size)} gives {spec.x_shape}")
    gx = api.conv2d(grad_output, w, None, spec.stride, spec.pad, spec.dilation, algo, backend, None, False, None,
                    precision, max_error, spec.groups)
    return _crop(gx, spec.p - eh, spec.q - ew) if eh or ew else gx


def conv_transpose2d_weight(x: Any, weight_size: Sequence[int], grad_output: Any, stride: int | Sequence[int] = 1,
                            padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0,
                            groups: int = 1, dilation: int | Sequence[int] = 1, algo: str = "auto",
                            precision: str | None = None, max_error: float | None = None,
                            backend: str | None = None) -> Any:
    """The gradient of conv_transpose2d's weights of size ``weight_size`` (C_in, C_out/groups, R, S):
    the forward layer's wgrad with ``grad_output`` as its input and ``x`` as its grad_output."""
    spec, eh, ew = transposed_geometry(tuple(x.shape), tuple(weight_size), stride, padding, output_padding, groups,
                                       dilation)
    if tuple(grad_output.shape) != spec.x_shape:
        raise ValueError(f"grad_output has shape {tuple(grad_output.shape)}, but conv_transpose2d of x "
                         f"{tuple(x.shape)} gives {spec.x_shape}")
    if eh or ew:
        x = pad_copy(x, (0, eh, 0, ew), "zeros")
    return grad.conv2d_weight(grad_output, spec.w_shape, x, spec.stride, spec.pad, spec.dilation, spec.groups, algo,
                              precision, max_error, backend)


def _crop(a: Any, h: int, w: int) -> Any:
    """The first h rows and w columns of an NCHW array, as a contiguous array of its kind."""
    part = a[:, :, :h, :w]
    return part.contiguous() if kind_of(a, "array") == "torch" else part.copy()
