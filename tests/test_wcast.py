"""A training block's filter casts (kernels/wcast.py) on PoCL: the forward rounds a float32 master weight (KCRS
or channels-last KRSC) to KCRS halves with the same bits as NumPy's rounding (PyTorch's ``Tensor.to``), the
backward widens KCRS halves into the master's memory order exactly; outputs poisoned first, Inf and NaN pass.
The CUDA source compiled by nvcc (no spills)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from convforge.dtypes import rounded, to_storage
from convforge.kernels.wcast import WCast, host_run, source

CASES = [
    WCast(5, 3, 3, 3),  # primes, KCRS master: 4 elements a thread where the count allows (135: one each)
    WCast(5, 3, 3, 3, cl=True),  # channels-last master: KRSC <-> KCRS
    WCast(8, 4, 1, 1, "bfloat16", cl=True),  # 1x1: the same order either way, 4 a thread
    WCast(7, 1, 3, 3, cl=True),  # one input channel (depthwise-like): the same order
    WCast(3, 5, 7, 7, "bfloat16", cl=True),  # a stem's 7x7
    WCast(2, 3, 11, 11, cl=True),  # 11x11
    WCast(1, 1, 1, 1),
    WCast(6, 4, 3, 5, "bfloat16"),  # asymmetric filters, 4 a thread
]


def _ids(wc: WCast) -> str:
    return wc.tag()


@pytest.mark.parametrize("wc", CASES, ids=_ids)
def test_casts_match_numpy_bit_for_bit(ocl, wc: WCast) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(wc.n)
    w = (rng.standard_normal((wc.k, wc.c, wc.r, wc.s)) * 3).astype(np.float32)
    w.flat[0], w.flat[-1] = np.inf, np.nan
    master = w.transpose(0, 2, 3, 1) if wc.cl else w  # the master's memory order
    got = host_run(ocl, wc, "forward", master).reshape(w.shape)
    np.testing.assert_array_equal(got, rounded(w, wc.dtype))  # NaN == NaN for assert_array_equal
    gwh = rounded((rng.standard_normal(w.shape) * 5).astype(np.float32), wc.dtype)
    gwh.flat[-1] = -np.inf
    back = host_run(ocl, wc, "backward", to_storage(gwh, wc.dtype))
    want = gwh.transpose(0, 2, 3, 1) if wc.cl else gwh
    np.testing.assert_array_equal(back, np.ascontiguousarray(want).ravel())


def test_bad_filters_name_the_problem() -> None:
    base = WCast(4, 3, 3, 3)
    for change, words in ((dict(k=0), r"every size >= 1"), (dict(dtype="float32"), "dtype")):
        with pytest.raises(ValueError, match=words):
            dataclasses.replace(base, **change)


def test_cuda_source_compiles_without_spills(nvcc_ok) -> None:  # type: ignore[no-untyped-def]
    from helpers import ptxas_reports

    casts = [WCast(256, 256, 3, 3, cl=True), WCast(2048, 512, 1, 1, "bfloat16"), WCast(64, 3, 7, 7, cl=True)]
    for infos in ptxas_reports([source(wc, "cuda") for wc in casts]):
        assert len(infos) == 2 and all(i.spill_stores == 0 and i.spill_loads == 0 for i in infos), infos


def test_one_source_serves_every_shape_of_a_form() -> None:
    """The sizes come from the dims buffer: a network's filter shapes share one compiled program a form."""
    assert source(WCast(64, 64, 3, 3, cl=True), "cuda") == source(WCast(5, 3, 7, 7, cl=True), "cuda")
    assert source(WCast(64, 64, 1, 1), "cuda") == source(WCast(2048, 512, 1, 1), "cuda")
    assert source(WCast(64, 64, 3, 3, cl=True), "cuda") != source(WCast(64, 64, 3, 3), "cuda")
