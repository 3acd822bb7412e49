"""The tensor-core plans' NCHW -> rows operand steps (``prep.planes_to_rows``) on PoCL: the 16-bit form
(64 x 64 tiles, two channels a 32-bit store) and the 32 x 32 one (an odd row length here; float32's
TF32 rounding is CUDA-only: the GPU tier runs it), every
element of the destination written (NaN-poisoned before), zeros in the padded channels, planes that are
not whole tiles (odd, prime, one pixel) and channel counts past one tile."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from convforge.dtypes import to_storage
from convforge.kernels.tensorcore.sm90 import prep
from convforge.kernels.tensorcore.sm90.isa import BF16, F16
from convforge.params import Params
from convforge.plan import Launch, Plan
from convforge.spec import ConvSpec

MATH = {"float16": F16, "bfloat16": BF16}


def _run(ocl, dtype: str, count: int, chans: int, plane: int, cp: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(the NCHW source, the rows the step wrote, the kernel's source) for ``count`` images."""
    math = MATH[dtype]
    kern, grid = prep.planes_to_rows("t_rows", "x", f"(n * {chans} + ci) * {plane} + p", count, chans, plane, cp,
                                     math, dtype, "xh", "test")
    kern = dataclasses.replace(kern, requires=frozenset())
    spec = ConvSpec.make(count, chans, 1, plane, 1, 1, 1, 1, 0, dtype=dtype)
    plan = Plan("step", "test", spec, Params(), (kern,), (Launch(kern.name, grid, kern.block, ("x", "xh")),), (),
                0.0)
    x = (np.random.default_rng(plane + cp).integers(-127, 128, (count, chans, plane)) / 16).astype(np.float32)
    bufs = {"x": ocl.upload(to_storage(x, dtype)),
            "xh": ocl.upload(to_storage(np.full((count, plane, cp), np.nan, np.float32), dtype))}
    ocl.executable(plan)(bufs)
    ocl.synchronize()
    return x, ocl.download(bufs["xh"], (count, plane, cp), dtype), kern.body


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("count, chans, plane, cp", [(2, 5, 63, 8), (1, 70, 130, 72), (3, 64, 1, 64),
                                                     (1, 129, 97, 136), (2, 5, 63, 9)])
def test_planes_to_rows_on_pocl(ocl, dtype: str, count: int, chans: int, plane: int, cp: int) -> None:
    x, got, source = _run(ocl, dtype, count, chans, plane, cp)
    want = np.zeros((count, plane, cp), np.float32)
    want[:, :, :chans] = x.transpose(0, 2, 1)
    np.testing.assert_array_equal(got, want)
    assert ("unsigned int*" in source) == (cp % 2 == 0)  # the 16-bit form (paired stores), else 32 x 32


def test_half_planes_to_rows_compiles_without_spills(nvcc_ok) -> None:
    """The 16-bit form for sm_90: every load in flight at once must still fit the registers."""
    from convforge.codegen.render import render
    from helpers import assert_sources_compile_clean

    sources = []
    for math, dtype in ((F16, "float16"), (BF16, "bfloat16")):
        kern, _ = prep.planes_to_rows("t_rows", "x", "(n * 70 + ci) * 130 + p", 2, 70, 130, 72, math, dtype, "xh",
                                      "test")
        sources.append((dtype, render([kern], "cuda")))
    reports = assert_sources_compile_clean(sources)
    assert all(info.registers <= 64 for infos in reports for info in infos), reports
