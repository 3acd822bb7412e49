"""Storage dtypes on the host: float32, float16 and bfloat16 (NumPy has no bfloat16, so its values
travel as uint16 bit patterns, the upper half of the float32 with round-to-nearest-even).

Kernels accumulate in float32 whatever the storage; the reference computes in float64 on the exact
stored values, so a half-precision kernel is judged on the inputs it was given.
"""

from __future__ import annotations

import numpy as np

from convforge.spec import DTYPES


def storage_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype that holds ``dtype`` on the host and in device buffers."""
    return np.dtype({"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype])


def to_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` (any real array) stored as ``dtype``: float32, float16, or bfloat16 bits in uint16."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype ({dtype!r}) must be one of {', '.join(DTYPES)}")
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest, ties to even
        return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)
    return np.ascontiguousarray(a, dtype=storage_dtype(dtype))


def from_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values as float32 (exact: every float16 and bfloat16 is a float32)."""
    if dtype == "bfloat16":
        return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, dtype=np.float32)


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` rounded to ``dtype``'s values, as float32."""
    return from_storage(to_storage(a, dtype), dtype)


def nan_bits(dtype: str) -> np.ndarray:
    """One NaN of ``dtype`` as its storage scalar (what poisoned outputs are filled with)."""
    return to_storage(np.array([np.nan], np.float32), dtype)


# The relative L2 error that rounding the output to a half dtype alone costs is about u / sqrt(3)
# (unit roundoff u = 2^-11 for float16, 2^-8 for bfloat16) plus the rounded inputs' share: a plan
# storing half is checked at about 2u (FP32 accumulation keeps the arithmetic's share far below).
HALF_TOLERANCE = {"float16": 1e-3, "bfloat16": 8e-3}


# The typical relative L2 error of rounding outputs to the dtype, u / sqrt(3): what a half plan's
# stated error cannot be below (a max_error under it admits no half variant).
HALF_ROUNDING = {"float16": 2.0**-11 / 3**0.5, "bfloat16": 2.0**-8 / 3**0.5}


def dtype_tolerance(dtype: str) -> float:
    """The least check tolerance of a plan that stores ``dtype`` (0 for float32: its variant's own)."""
    return HALF_TOLERANCE.get(dtype, 0.0)


def host_dtype(array: np.ndarray) -> np.dtype:
    """The dtype an uploaded array keeps: float16 and uint16 (bfloat16 bits) as they are, else float32."""
    dt = np.asarray(array).dtype
    return dt if dt in (np.dtype(np.float16), np.dtype(np.uint16)) else np.dtype(np.float32)
