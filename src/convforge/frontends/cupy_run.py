"""CuPy arrays: a compiled CUDA executable run on them (``run(x, w, bias) -> y`` and the backward passes'
``run(x, w, y) -> out``), on ``.data.ptr`` and CuPy's current stream, the output from CuPy's pool on
the arrays' device. CuPy arrays have no version counter: filter transforms run on every call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cupy as cp

from convforge.backends.base import CONV_BUFFERS, output_buffer
from convforge.backends.cuda import CudaExecutable, multi_gpu
from convforge.dtypes import storage_dtype


def cupy_runner(exe: CudaExecutable, device: int) -> Callable[..., Any]:
    """``run(x, w, bias) -> y`` for CuPy arrays: ``.data.ptr``, CuPy's current stream, output
    from CuPy's pool on the arrays' device."""
    if output_buffer(exe.plan) != "y":  # a backward pass (dgrad, wgrad) or the bias gradient
        return cupy_pass_runner(exe, device)
    current = cp.cuda.get_current_stream
    exe.reserve(int(current().ptr))
    shape, launch, dev = exe.plan.spec.y_shape, exe.launch_raw, cp.cuda.Device(device)
    multi = multi_gpu()
    ydt = storage_dtype(exe.plan.spec.dtype)  # float32 or float16 (CuPy has no bfloat16)

    def run(x: Any, w: Any, bias: Any = None, derived: Any = None) -> Any:
        xp, wp = x.data.ptr, w.data.ptr
        if xp & 15:
            x = x.copy()
            xp = x.data.ptr
        if wp & 15:
            w = w.copy()
            wp = w.data.ptr
        if multi:
            with dev:
                y = cp.empty(shape, ydt)
        else:
            y = cp.empty(shape, ydt)
        launch(xp, wp, y.data.ptr, 0 if bias is None else bias.data.ptr, current().ptr)
        return y

    return run


def cupy_pass_runner(exe: CudaExecutable, device: int) -> Callable[..., Any]:
    """``run(x, w, y) -> out`` for CuPy arrays, as :func:`torch_pass_runner` (the slot of the
    buffer the plan writes is None): output from CuPy's pool on the arrays' device, CuPy's current
    stream. CuPy arrays have no version counter: a dgrad plan's filter steps run on every call."""
    current = cp.cuda.get_current_stream
    exe.reserve(int(current().ptr))
    out_name = output_buffer(exe.plan)
    slot, shape, launch = CONV_BUFFERS.index(out_name), exe.plan.spec.shape_of(out_name), exe.launch_raw
    dev, multi = cp.cuda.Device(device), multi_gpu()

    def aligned(a: Any) -> tuple[Any, int]:
        if a.data.ptr & 15:
            a = a.copy()
        return a, int(a.data.ptr)

    def run(x: Any, w: Any, y: Any) -> Any:
        ptrs = [0, 0, 0, 0]
        held = [aligned(a) if a is not None else (None, 0) for a in (x, w, y)]  # copies live until the launch
        for i, (_a, p) in enumerate(held):
            ptrs[i] = p
        if multi:
            with dev:
                out = cp.empty(shape, cp.float32)
        else:
            out = cp.empty(shape, cp.float32)
        ptrs[slot] = int(out.data.ptr)
        launch(ptrs[0], ptrs[1], ptrs[2], ptrs[3], current().ptr)
        return out

    return run
