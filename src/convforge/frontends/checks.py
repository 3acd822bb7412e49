"""The checks of a first call: an array's rank, dtype and memory layout, and conv2d's scalar options.
Bad input is one ValueError naming the argument and the value."""

from __future__ import annotations

import numbers
import operator
from typing import Any

import numpy as np

from convforge.config import parse_precision
from convforge.frontends.kinds import ARRAY_DTYPES

# dtypes PyTorch's CUDA convolutions take that convforge does not run: refused, naming PyTorch's op
REFUSED_DTYPES = ("float64", "complex32", "complex64", "complex128", "chalf", "cfloat", "cdouble")


def check_array(a: Any, what: str, rank: int, kind: str | None = None,
                op: str = "torch.nn.functional.conv2d") -> str:
    """The array's dtype name, after checking its rank and that ``kind`` arrays of it run (None:
    float32 only, for callers whose plans are float32: the backward passes of grad.py). float64
    and complex arrays are refused with PyTorch's ``op`` named as the way to run them (never cast)."""
    if isinstance(a, np.ndarray) and a.ndim == rank and a.dtype == np.float32:
        return "float32"  # the common case, quickly
    if len(a.shape) != rank:
        raise ValueError(f"{what} must have rank {rank}, got shape {tuple(a.shape)}")
    dtype = str(a.dtype).replace("torch.", "")
    if dtype in REFUSED_DTYPES:
        raise ValueError(f"{what} dtype ({dtype}) is not run by convforge; use {op}")
    allowed = ARRAY_DTYPES[kind] if kind is not None else ("float32",)
    if dtype not in allowed:
        raise ValueError(f"{what} dtype ({dtype}) must be {'one of ' if len(allowed) > 1 else ''}"
                         f"{', '.join(allowed)}" + (f" for {kind} arrays" if kind else ""))
    return dtype


def same_dtype(dtype: str, other: str, what: str) -> None:
    """ValueError unless ``what``'s dtype ``other`` is the input's ``dtype``."""
    if other != dtype:
        raise ValueError(f"{what} dtype ({other}) must equal the input's ({dtype}): input, weights and "
                         "bias share one dtype")


def check_layout(a: Any, what: str, rank: int) -> None:
    """ValueError unless ``a`` is contiguous (C order), naming its strides."""
    if isinstance(a, np.ndarray) and a.flags.c_contiguous:
        return
    contiguous = (a.flags["C_CONTIGUOUS"] if hasattr(a, "flags") and not callable(a.flags)
                  else a.is_contiguous())
    if not contiguous:
        layout = "NCHW" if rank == 4 else "1-D"
        strides = a.stride() if callable(getattr(a, "stride", None)) else a.strides  # torch: stride(), in elements
        raise ValueError(f"{what} has an unsupported layout (strides {tuple(strides)}): "
                         f"pass a contiguous {layout} array")


def check_options(relu: Any, workspace_limit: Any, precision: Any, max_error: Any) -> tuple[bool, int | None]:
    """Check conv2d's scalar options; ``relu`` and ``workspace_limit`` as bool and int. A
    ValueError names the option and the value: ``relu="no"`` must not switch ReLU on, nor
    ``max_error=True`` read as 1.0."""
    if not isinstance(relu, bool | np.bool_):
        raise ValueError(f"relu ({relu!r}) must be True or False")
    if workspace_limit is not None:
        if isinstance(workspace_limit, bool | np.bool_) or not isinstance(workspace_limit, numbers.Integral):
            raise ValueError(f"workspace_limit ({workspace_limit!r}) must be an int (bytes) or None")
        if workspace_limit < 0:
            raise ValueError(f"workspace_limit ({workspace_limit}) must be >= 0")
        workspace_limit = operator.index(workspace_limit)
    if precision is not None:
        parse_precision(precision)
    if max_error is not None and (isinstance(max_error, bool | np.bool_) or not isinstance(max_error, numbers.Real)
                                  or not float(max_error) > 0):
        raise ValueError(f"max_error ({max_error!r}) must be a number > 0")
    return bool(relu), workspace_limit
