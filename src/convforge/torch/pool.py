"""Max pooling on convforge's kernels (``kernels/maxpool.py``): what ``fuse()`` puts in place of an
``nn.MaxPool2d``.

PyTorch's ``max_pool2d`` keeps int64 indices and scatters the gradient back; its channels-last backward
took 0.91 ms of a fused ResNet-50 N128 FP16 AMP step on an H200 (docs/NOTES-training.md). Here the
forward keeps one byte per output (which tap of the window was the maximum) and the backward gathers each
input's gradient from its windows: one pass each, deterministic, the same maxima and the same gradients
(PyTorch's choice among equal maxima and NaN). float32, float16 and bfloat16, NCHW or channels_last,
the output in the input's memory format; anything else (dilation, ``return_indices``, other strides or
dtypes, CPU tensors, ``torch.compile`` tracing, a channels-last view off a 16-byte boundary) runs PyTorch's
``max_pool2d``. With the native module loaded the node is native_layers.inc's (the same launches from C++, no
Python in its forward or backward: ``register_pool`` files each layer's program on its first call), else
``_MaxPool``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from convforge.backends import get_backend
from convforge.frontends import fast_path
from convforge.kernels.maxpool import PoolProgram, PoolTrain, lanes, pool_program, title
from convforge.torch.batchnorm import layout

_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_PROGRAMS: dict[tuple[Any, ...], tuple[PoolTrain, Any, Any]] = {}  # (layer, device) -> (layer, launcher, stream query)
_HANDLES: dict[tuple[Any, ...], int] = {}  # (layer, device) -> native.cpp's register_pool handle
POOL_SLOTS = {"x": 0, "y": 1, "ix": 2, "gy": 3, "gx": 4}  # the kernels' buffers as native_layers.inc's PoolSlot


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def layer_of(m: torch.nn.MaxPool2d, x: torch.Tensor) -> PoolTrain | None:
    """The kernels' description of ``m`` on ``x``, or None where PyTorch runs it (module docstring)."""
    lay = layout(x)
    if (lay is None or not x.is_cuda or x.dim() != 4 or x.dtype not in _NAMES or m.return_indices
            or _pair(m.dilation) != (1, 1) or torch.compiler.is_compiling() or x.numel() == 0):
        return None
    (kh, kw), (ph, pw) = _pair(m.kernel_size), _pair(m.padding)
    sh, sw = _pair(m.stride if m.stride is not None else m.kernel_size)
    n, c, h, w = x.shape
    try:
        pt = PoolTrain(n, c, h, w, kh, kw, sh, sw, ph, pw, bool(m.ceil_mode), _NAMES[x.dtype], lay)
    except ValueError:  # a window PyTorch refuses or has no byte for: its own error or result
        return None
    return None if _misaligned(pt, x) else pt


def _misaligned(pt: PoolTrain, t: torch.Tensor) -> bool:
    """Whether ``t`` (a view at an odd storage offset) is off the 16-byte boundary the channel-vector
    kernels' loads need (``kernels.maxpool.lanes``)."""
    return lanes(pt) > 1 and t.data_ptr() % 16 != 0


def _program(pt: PoolTrain, device: int) -> tuple[PoolTrain, Any, Any]:
    """(layer, launcher on raw pointers, torch's raw-stream query), compiled once per process."""
    hit = _PROGRAMS.get((pt, device))
    if hit is None:
        from convforge.backends.cuda import RawLaunches
        from convforge.frontends.torch_run import torch_stream_queries

        prog: PoolProgram = pool_program(pt)
        run = RawLaunches(get_backend("cuda", device), prog.kernels,  # type: ignore[arg-type]
                          {"forward": prog.forward, "backward": prog.backward}, title(pt))
        hit = _PROGRAMS[(pt, device)] = (pt, run, torch_stream_queries()[0])
    return hit


def _file(module: Any, prog: tuple[PoolTrain, Any, Any], device: int) -> int:
    """The layer's program filed with native.cpp (``register_pool``) once: its handle."""
    pt, run, _ = prog
    handle = _HANDLES[(pt, device)] = int(module.register_pool(
        run.native_program(POOL_SLOTS, "forward", "backward"), pt.n, pt.c, pt.h, pt.w, pt.p, pt.q, pt.y_size,
        pt.dtype, pt.layout == "nhwc", lanes(pt) > 1))
    return handle


def _format(pt: PoolTrain) -> torch.memory_format:
    return torch.channels_last if pt.layout == "nhwc" else torch.contiguous_format


class _MaxPool(torch.autograd.Function):
    """The autograd node: saves the window taps (one byte an output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, prog: tuple[PoolTrain, Any, Any]) -> torch.Tensor:  # type: ignore[override]
        pt, run, stream_of = prog
        y = torch.empty((pt.n, pt.c, pt.p, pt.q), dtype=x.dtype, device=x.device, memory_format=_format(pt))
        ix = torch.empty(pt.y_size, dtype=torch.uint8, device=x.device)
        run("forward", {"x": x.data_ptr(), "y": y.data_ptr(), "ix": ix.data_ptr()}, stream_of(x.device.index or 0))
        ctx.prog = prog
        ctx.save_for_backward(ix)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        pt, run, stream_of = ctx.prog
        (ix,) = ctx.saved_tensors
        gy = gy.contiguous(memory_format=_format(pt))
        if _misaligned(pt, gy):  # a view at an odd offset: the vector loads need a 16-byte boundary
            gy = gy.clone(memory_format=_format(pt))
        gx = torch.empty((pt.n, pt.c, pt.h, pt.w), dtype=gy.dtype, device=gy.device, memory_format=_format(pt))
        run("backward", {"gy": gy.data_ptr(), "ix": ix.data_ptr(), "gx": gx.data_ptr()},
            stream_of(gy.device.index or 0))
        return gx, None


class MaxPool2d(torch.nn.MaxPool2d):
    """An ``nn.MaxPool2d`` on convforge's kernels where :func:`layer_of` takes the call, PyTorch's
    elsewhere; the same attributes, no parameters."""

    @classmethod
    def from_module(cls, m: torch.nn.MaxPool2d) -> MaxPool2d:
        new = cls.__new__(cls)
        new.__dict__.update(m.__dict__)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pt = layer_of(self, x)
        if pt is None:
            return super().forward(x)
        prog = _program(pt, x.device.index or 0)
        module = fast_path.torch_module()
        if module is not None:  # native_layers.inc's node: the same launches from C++
            handle = _HANDLES.get((pt, x.device.index or 0))
            if handle is None:
                handle = _file(module, prog, x.device.index or 0)
            y = module.pool(x, handle)
            if y is not None:
                return y  # type: ignore[no-any-return]
        if torch.is_grad_enabled() and x.requires_grad:
            return _MaxPool.apply(x, prog)  # type: ignore[no-any-return]
        with torch.no_grad():
            return _MaxPool.forward(_NoCtx(), x, prog)


class _NoCtx:
    """A stand-in context for a forward without autograd (nothing is saved)."""

    def save_for_backward(self, *tensors: Any) -> None:
        pass
