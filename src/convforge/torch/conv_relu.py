"""conv [+ bias] -> ReLU in training on convforge's kernels, for blocks without batch norm (VGG, AlexNet).

PyTorch runs such a block as the convolution, ``relu`` (a pass over the output) and, backward,
``threshold_backward`` (a pass over the gradient) then the bias sum (another). Here the forward conv
applies bias and ReLU in its epilogue, and backward one kernel (``kernels/wgrad/bias.py`` with
``relu``) masks the gradient by the saved output's sign, writes the masked gradient for the layer's
dgrad and wgrad and sums it for the bias: two passes over the activation fewer, and two launches.
``FusedConv2d`` (conv -> ReLU, no batch norm, no residual) takes it in training where :func:`takes`
says so; anything else (half or autocast, ``torch.compile`` tracing, ``config.train_bn`` off, a layer
no convforge variant runs) keeps the unfused path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from convforge import api
from convforge.backends import get_backend
from convforge.config import config
from convforge.spec import ConvSpec

_F32 = torch.float32
_PROGRAMS: dict[tuple[int, int, int, int], tuple[Any, int, Any]] = {}  # (n, k, pq, device) -> (launcher, slices,
# torch's raw-stream query)


def takes(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, padding_mode: str) -> bool:
    """Whether :func:`conv_relu` may run this training call: CUDA float32 4-D input and filters (and
    bias) on one device, zero padding, outside autocast and torch.compile tracing, ``config.train_bn``."""
    if not (config.train_bn and padding_mode == "zeros" and isinstance(x, torch.Tensor) and x.is_cuda
            and x.dtype == _F32 and x.dim() == 4 and w.dtype == _F32 and w.device == x.device):
        return False
    if b is not None and not (b.dtype == _F32 and b.device == x.device):
        return False
    return not (torch.is_autocast_enabled() or torch.compiler.is_compiling())


def conv_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, conv: tuple[Any, ...]) -> torch.Tensor | None:
    """relu(conv2d(x, w, b)) with convforge's backward (module docstring); ``conv``: (stride, padding
    quad, dilation, algo, precision, max_error, groups) as lists and values. None where no convforge
    variant runs the layer with ``algo`` "auto" (the caller then runs its unfused path, whose op
    logs the fallback once); such a layer is remembered and not tried again."""
    tag = (tuple(x.shape), tuple(w.shape), x.device, *map(_frozen, conv))
    if tag in _REFUSED:
        return None
    try:
        return _ConvRelu.apply(x, w, b, conv)  # type: ignore[no-any-return]
    except ValueError:
        if conv[3] != "auto":
            raise
        _REFUSED.add(tag)
        return None


_REFUSED: set[tuple[Any, ...]] = set()


def _frozen(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _forward_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, conv: tuple[Any, ...]) -> Any:
    """The conv with bias and ReLU in its epilogue: the native fast path when warm, else Python's."""
    stride, pad, dil, algo, precision, max_error, groups = conv
    call = (x, w, b, tuple(stride), tuple(pad), tuple(dil), algo, None, None, True, None, precision, max_error,
            groups)
    native = api._NATIVE_RUN
    z = None if native is None else native(*call)
    return api.python_conv2d(*call) if z is None else z


class _ConvRelu(torch.autograd.Function):
    """Saves x, w and the output z (its sign is the ReLU's mask); backward: the masked gradient and
    bias sum in one kernel, then ``convforge::conv2d_input`` / ``conv2d_weight`` on the masked gradient
    (each chosen per layer, pass and class by dispatch, as ``convforge::conv2d``'s own backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,  # type: ignore[override]
                conv: tuple[Any, ...]) -> torch.Tensor:
        z = _forward_conv(x.contiguous(), w.contiguous(), b, conv)
        ctx.save_for_backward(x, w, z)
        ctx.conv, ctx.has_bias = conv, b is not None
        return z  # type: ignore[no-any-return]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gz: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        from convforge.torch.ops import INPUT_OP, WEIGHT_OP

        x, w, z = ctx.saved_tensors
        stride, pad, dil, algo, precision, max_error, groups = ctx.conv
        gm, gb = _masked_grad(gz, z)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = INPUT_OP(list(x.shape), w, gm, stride, pad, dil, groups, algo, precision, max_error)
        if ctx.needs_input_grad[1]:
            gw = WEIGHT_OP(x, list(w.shape), gm, stride, pad, dil, groups, algo, precision, max_error)
        return gx, gw, gb if ctx.has_bias and ctx.needs_input_grad[2] else None, None


def _masked_grad(gz: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gz where z > 0 else 0, its sum per channel): one kernel (two where a channel is split)."""
    if not gz.is_contiguous() or gz.data_ptr() % 16:
        gz = gz.clone(memory_format=torch.contiguous_format)
    n, k, p, q = z.shape
    run, sp, stream_of = _program(n, k, p * q, z.device.index or 0)
    gm = torch.empty_like(z)
    ws = z.new_empty(k * (1 + sp))  # the bias gradient, then the slices' partial sums
    at = ws.data_ptr()
    run("backward", {"y": gz.data_ptr(), "z": z.data_ptr(), "gm": gm.data_ptr(), "bias": at, "bpart": at + 4 * k},
        stream_of(z.device.index or 0))
    return gm, ws[:k]


def _program(n: int, k: int, pq: int, device: int) -> tuple[Any, int, Any]:
    """(launcher on raw pointers, slices per channel, torch's raw-stream query) of the masked bias
    gradient of an (n, k, pq) activation, compiled once per process."""
    hit = _PROGRAMS.get((n, k, pq, device))
    if hit is not None:
        return hit
    from convforge.backends.cuda import RawLaunches, torch_stream_queries
    from convforge.kernels.wgrad import bias_grad_plan
    from convforge.plan import Launch

    be = get_backend("cuda", device)
    plan = bias_grad_plan(ConvSpec.make(n, 1, 1, pq, k, 1, 1, conv_pass="wgrad"), be.device, relu=True)
    steps = tuple(s for s in plan.steps if isinstance(s, Launch))  # the plan has launches only
    run = RawLaunches(be, plan.kernels, {"backward": steps},  # type: ignore[arg-type]
                      f"conv -> ReLU backward {n}x{k}x{pq}")
    hit = _PROGRAMS[(n, k, pq, device)] = (run, int(plan.params.get("sp", 1)), torch_stream_queries()[0])
    return hit
