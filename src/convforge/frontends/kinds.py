"""Which kind of array a call brings (NumPy, CuPy or torch), its CUDA device, its memory layout, and a
padded copy of it on its own device: decided from the array's type and attributes, without importing
a vendor library."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# The storage dtypes each kind of array brings (NumPy and CuPy have no bfloat16).
ARRAY_DTYPES = {"numpy": ("float32", "float16"), "cupy": ("float32", "float16"),
                "torch": ("float32", "float16", "bfloat16")}


def kind_of(a: Any, what: str) -> str:
    """'numpy', 'cupy' or 'torch' — decided without importing either vendor library."""
    mod = type(a).__module__.split(".")[0]
    if isinstance(a, np.ndarray):
        return "numpy"
    if mod == "cupy":
        return "cupy"
    if mod == "torch":
        if getattr(a, "device", None) is None or a.device.type != "cuda":
            raise ValueError(f"{what} is a torch tensor on {a.device}; convforge runs torch CUDA tensors "
                             "(use .numpy() for the OpenCL path)")
        return "torch"
    raise ValueError(f"{what} must be a NumPy array, CuPy array or torch CUDA tensor, got {type(a).__name__}")


def device_index(x: Any, kind: str) -> int | None:
    """The CUDA device of a CuPy array or torch tensor; None for a NumPy array."""
    if kind == "torch":
        return int(x.device.index or 0)
    if kind == "cupy":
        return int(x.data.device_id)
    return None


def is_channels_last(x: Any) -> bool:
    """A torch tensor NHWC plans read as it lies: in channels_last memory format (strides (H*W*C, 1, W*C,
    C), as ``.to(memory_format=torch.channels_last)`` makes them) and not also NCHW contiguous (C == 1:
    stays NCHW), or a contiguous batch of 1x1 images of several channels, whose NCHW and NHWC are one
    memory (a squeeze-excitation block's pooled input: read in place, no layout step). From the strides:
    no vendor library is imported."""
    n, c, h, w = x.shape
    if h == w == 1:
        return c > 1 and x.is_contiguous()
    return tuple(x.stride()) == (h * w * c, 1, w * c, c) and not x.is_contiguous()


def runner_maker(kind: str) -> Callable[..., Callable[..., Any]]:
    """``make(exe, device) -> run`` for device arrays of ``kind`` ("torch" | "cupy"): a compiled CUDA
    executable run on such arrays (frontends/torch_run.py, frontends/cupy_run.py)."""
    if kind == "torch":
        from convforge.frontends.torch_run import torch_runner

        return torch_runner
    from convforge.frontends.cupy_run import cupy_runner

    return cupy_runner


_NUMPY_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}
_TORCH_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def pad_copy(x: Any, pad: tuple[int, int, int, int], mode: str, kind: str | None = None) -> Any:
    """An NCHW array padded by (top, bottom, left, right) in nn.Conv2d's ``mode`` (zeros, reflect,
    replicate, circular), as a new array of its kind on its device (the pad sizes checked by
    ``spec.conv_args``)."""
    kind = kind or kind_of(x, "input")
    t, b, left, right = pad
    if kind == "torch":
        import torch.nn.functional as F  # a torch tensor is here: torch is loaded already

        return F.pad(x, (left, right, t, b), mode=_TORCH_MODES[mode])
    widths = ((0, 0), (0, 0), (t, b), (left, right))
    if kind == "cupy":
        import cupy

        return cupy.pad(x, widths, mode=_NUMPY_MODES[mode])
    return np.pad(x, widths, mode=_NUMPY_MODES[mode])  # type: ignore[call-overload]
