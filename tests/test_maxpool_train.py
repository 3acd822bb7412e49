"""Training max pool kernels (kernels/maxpool.py) on PoCL against float64 with PyTorch's choice of maximum,
outputs poisoned first; the CUDA source compiled by nvcc (no spills)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from convforge.dtypes import rounded
from convforge.kernels.maxpool import PoolTrain, host_run, pool_out, source
from convforge.reference import maxpool_backward_ref, maxpool_ref, rel_l2

CASES = [
    PoolTrain(2, 3, 11, 13, 3, 3, 2, 2, 1, 1),  # ResNet's stem pool on odd planes
    PoolTrain(1, 5, 7, 5, 2, 2, 2, 2),  # N=1, primes, no padding (the last row and column unread)
    PoolTrain(2, 4, 10, 9, 3, 3, 2, 2, 0, 0, ceil=True),  # ceil mode: a clipped last window
    PoolTrain(1, 2, 9, 11, 3, 2, 1, 2, 1, 1),  # asymmetric window and stride
    PoolTrain(2, 3, 17, 19, 5, 5, 4, 4, 2, 2),  # stride 4, windows barely overlapping
    PoolTrain(3, 6, 8, 8, 3, 3, 2, 2, 1, 1, dtype="float16", layout="nhwc"),
    PoolTrain(2, 7, 13, 11, 3, 3, 2, 2, 1, 1, ceil=True, dtype="bfloat16", layout="nhwc"),
    PoolTrain(1, 3, 12, 12, 3, 3, 1, 1, 1, 1, dtype="float16"),  # stride 1: every input in 9 windows
    # channels-last vectors (kernels/maxpool.lanes): 8 halves, 4 floats, 4 halves where C is not whole 8s
    PoolTrain(2, 16, 11, 13, 3, 3, 2, 2, 1, 1, dtype="float16", layout="nhwc"),
    PoolTrain(1, 12, 10, 9, 3, 3, 2, 2, 0, 0, ceil=True, dtype="bfloat16", layout="nhwc"),
    PoolTrain(3, 8, 9, 7, 2, 2, 2, 2, dtype="float32", layout="nhwc"),
    PoolTrain(1, 8, 12, 12, 3, 3, 1, 1, 1, 1, dtype="float16", layout="nhwc"),  # 9 windows an input, vectors
    PoolTrain(2, 8, 17, 19, 5, 5, 4, 4, 2, 2, dtype="bfloat16", layout="nhwc"),
    PoolTrain(1, 4, 13, 12, 6, 5, 1, 1, 3, 2, dtype="float32", layout="nhwc"),  # 30 taps, 30 windows: loops
    PoolTrain(1, 3, 13, 12, 6, 5, 3, 2, 3, 2),  # the forward's loop, NCHW
]


def _ids(pt: PoolTrain) -> str:
    return pt.tag().replace(" ", "_")


def _to_layout(a: np.ndarray, pt: PoolTrain) -> np.ndarray:
    return a.transpose(0, 2, 3, 1) if pt.layout == "nhwc" else a


def _from_layout(flat: np.ndarray, pt: PoolTrain, rows: int, cols: int) -> np.ndarray:
    if pt.layout == "nhwc":
        return flat.reshape(pt.n, rows, cols, pt.c).transpose(0, 3, 1, 2)
    return flat.reshape(pt.n, pt.c, rows, cols)


def _check(ocl, pt: PoolTrain, x: np.ndarray, seed: int) -> None:  # type: ignore[no-untyped-def]
    geo = dict(k=(pt.kh, pt.kw), stride=(pt.sh, pt.sw), pad=(pt.ph, pt.pw))
    x = rounded(x, pt.dtype)
    y_ref, tap_ref = maxpool_ref(x, out=(pt.p, pt.q), **geo)
    fwd = host_run(ocl, pt, "forward", {"x": _to_layout(x, pt)})
    y, tap = _from_layout(fwd["y"], pt, pt.p, pt.q), _from_layout(fwd["ix"], pt, pt.p, pt.q)
    np.testing.assert_array_equal(y, y_ref.astype(np.float32))  # a maximum is one of the inputs: exact
    np.testing.assert_array_equal(tap, tap_ref)
    gy = np.random.default_rng(seed).standard_normal((pt.n, pt.c, pt.p, pt.q)).astype(np.float32)
    gy = rounded(gy, pt.dtype)
    bwd = host_run(ocl, pt, "backward", {"gy": _to_layout(gy, pt), "ix": fwd["ix"]})
    gx = _from_layout(bwd["gx"], pt, pt.h, pt.w)
    ref = maxpool_backward_ref(gy, tap_ref, x.shape, **geo)
    tol = 1e-6 if pt.dtype == "float32" else 8e-3  # the sums rounded once to the storage dtype
    assert not np.isnan(gx).any() and rel_l2(gx, ref) < tol, rel_l2(gx, ref)


@pytest.mark.parametrize("pt", CASES, ids=_ids)
def test_against_float64(ocl, pt: PoolTrain) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(len(_ids(pt)))
    _check(ocl, pt, rng.standard_normal((pt.n, pt.c, pt.h, pt.w)).astype(np.float32), seed=1)


@pytest.mark.parametrize("layout, c, dtype", [("nchw", 3, "float32"), ("nhwc", 3, "float32"),
                                              ("nhwc", 8, "float16"), ("nhwc", 4, "float32")])
def test_ties_nan_and_infinity_follow_pytorch(ocl, layout: str, c: int, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """Equal maxima give the gradient to the first, a NaN wins (the last of several), a window of -inf
    keeps its first in-image tap: PyTorch's choices, so the gradient lands where its would (one channel
    a thread, and channels-last vectors)."""
    pt = PoolTrain(2, c, 9, 9, 3, 3, 2, 2, 1, 1, layout=layout, dtype=dtype)
    rng = np.random.default_rng(5)
    x = rng.integers(-2, 3, (pt.n, pt.c, pt.h, pt.w)).astype(np.float32)  # many ties
    x[0, 0, :4, :4] = -np.inf
    x[1, 1, 3, 3] = x[1, 1, 4, 4] = np.nan
    geo = dict(k=(3, 3), stride=(2, 2), pad=(1, 1))
    y_ref, tap_ref = maxpool_ref(x, out=(pt.p, pt.q), **geo)
    fwd = host_run(ocl, pt, "forward", {"x": _to_layout(x, pt)})
    np.testing.assert_array_equal(_from_layout(fwd["ix"], pt, pt.p, pt.q), tap_ref)
    np.testing.assert_array_equal(_from_layout(fwd["y"], pt, pt.p, pt.q), y_ref.astype(np.float32))
    assert tap_ref[0, 0, 0, 0] == 4 and tap_ref[1, 1, 2, 2] == 4  # -inf: first in-image tap; NaNs 0, 4: last


def test_output_size_is_pytorchs() -> None:
    assert pool_out(112, 3, 2, 1, False) == 56
    assert pool_out(10, 3, 2, 0, True) == 5 and pool_out(10, 3, 2, 0, False) == 4
    assert pool_out(5, 2, 2, 1, True) == 3  # the last window starts inside the right padding: dropped


def test_bad_layers_name_the_problem() -> None:
    base = PoolTrain(1, 1, 8, 8, 3, 3, 2, 2, 1, 1)
    for change, words in ((dict(ph=2), "padding"), (dict(kh=16, kw=16, ph=0, pw=0), "255 taps"),
                          (dict(layout="hwcn"), "layout"), (dict(dtype="float64"), "float64"),
                          (dict(h=1, ph=0), "no 3x3 window"), (dict(sh=0), r"sh \(0\)")):
        with pytest.raises(ValueError, match=words):
            dataclasses.replace(base, **change)


def test_cuda_source_compiles_without_spills(nvcc_ok) -> None:  # type: ignore[no-untyped-def]
    from helpers import ptxas_reports

    layers = [PoolTrain(128, 64, 112, 112, 3, 3, 2, 2, 1, 1, dtype="float16", layout="nhwc"),
              PoolTrain(4096, 64, 112, 112, 3, 3, 2, 2, 1, 1, dtype="bfloat16")]  # past 2^31 elements: 64-bit offsets
    assert "const int e =" in source(layers[0], "cuda") and "const int e =" not in source(layers[1], "cuda")
    for infos in ptxas_reports([source(pt, "cuda") for pt in layers]):
        assert len(infos) == 2 and all(i.spill_stores == 0 and i.spill_loads == 0 for i in infos), infos
