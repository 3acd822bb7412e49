"""depthwise_wgrad's streamed form (``sc``: ring rows of input in shared memory, next rows in flight) on
PoCL against the float64 reference with dw and the partial filters poisoned (NaN) first: N=1, channel
blocks past C (24 channels in blocks of 16), stride 2 and 4, asymmetric padding, dilation 2, 5x5 and
7x7 with the filter rows split over threads (7 rows in 3 groups: a guard), bands that do not divide the
plane, two rows a step (input rows shared by both), two and four channels a thread, strips of 3 columns
(the padded rows' odd divisor); float16, bfloat16 and float32 storage. Then its refusals, the defaults and
sweep points of real layers (valid plans), and nvcc on those defaults (registers, no spills).

Tolerances: the plan's (half: dtypes.HALF_TOLERANCE, float32: the variant's 1e-5).
"""

from __future__ import annotations

import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.codegen.render import render
from convforge.kernels import get_variant
from convforge.kernels.depthwise_wgrad_stream import Stream, stream_default, stream_space
from convforge.params import Params
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean

V = get_variant("depthwise_wgrad")


def _wg(spec: ConvSpec, dtype: str) -> ConvSpec:
    return ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "layout": "nhwc", "pass": "wgrad"})


CASES = [
    (ConvSpec.make(1, 16, 11, 9, 16, 3, 3, 1, 1, groups=16), Params(sc=16, sq=4, sb=4, sv=4, sr=2, ns=2)),
    (ConvSpec.make(2, 24, 13, 17, 24, 5, 5, 2, (2, 1, 0, 3), groups=24), Params(sc=16, sq=2, sg=5, sb=3, sr=2, ns=3)),
    (ConvSpec.make(1, 8, 20, 24, 8, 3, 3, 1, 2, 2, groups=8), Params(sc=8, sq=4, sb=7, sr=2, ns=1)),
    (ConvSpec.make(3, 32, 9, 8, 32, 7, 7, 1, 3, groups=32), Params(sc=32, sq=2, sg=3, sb=9, sv=4, ns=2)),
    (ConvSpec.make(1, 8, 21, 17, 8, 3, 3, 4, (1, 0, 2, 1), groups=8), Params(sc=8, sq=3, sb=2, ns=1)),
    # stream_pick's set on ConvNeXt-like 7x7 planes of 7 and 14 rows: two rows a step, one filter row a thread
    (ConvSpec.make(1, 32, 7, 7, 32, 7, 7, 1, 3, groups=32), Params(sc=32, sq=8, sg=7, sb=7, sr=2, ns=1)),
    (ConvSpec.make(2, 32, 14, 14, 32, 7, 7, 1, 3, groups=32), Params(sc=32, sq=8, sg=7, sb=14, sr=2, ns=2)),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("spec, prm", CASES, ids=lambda v: v.short() if hasattr(v, "short") else None)
def test_streamed_wgrad_against_float64(poisoned, spec, prm, dtype):
    s = _wg(spec, dtype)
    assert Stream.of(s, prm).problem(poisoned.device) is None
    res = check_plan(V.plan(s, prm, poisoned.device), poisoned, seed=5)
    assert res.ok, f"[{prm.short()}] {s.short()}: {res}"


def test_refusals():
    base = ConvSpec.make(1, 16, 8, 8, 16, 3, 3, 1, 1, groups=16)
    prm = Params(sc=8, sq=4, sb=4, ns=1)
    for spec, what in [(ConvSpec.from_dict({**_wg(base, "float16").to_dict(), "layout": "nchw"}), "NHWC"),
                       (_wg(ConvSpec.make(1, 12, 8, 8, 12, 3, 3, 1, 1, groups=12), "float16"), "multiple of 8"),
                       (_wg(ConvSpec.make(1, 16, 8, 8, 32, 3, 3, 1, 1, groups=16), "float16"), "multiplier-1")]:
        with pytest.raises(ValueError, match=what):
            V.plan(spec, prm, NOMINAL_CUDA)
    s = _wg(base, "float16")
    for bad, what in [(prm.replace(sc=12), "multiple of 8"), (prm.replace(sg=4), "sg"), (prm.replace(sr=3), "sr"),
                      (prm.replace(ns=9), "ns"), (prm.replace(sc=256, sq=1), "shared memory|threads"),
                      (prm.replace(sv=3), "sv")]:
        with pytest.raises(ValueError, match=what):
            V.plan(s, bad, NOMINAL_CUDA)


REAL = ["N=64,C=144,H=56,W=56,K=144,R=3,S=3,pad=1", "N=64,C=96,H=112,W=112,K=96,R=3,S=3,pad=1,stride=2",
        "N=32,C=96,H=56,W=56,K=96,R=7,S=7,pad=3", "N=32,C=768,H=7,W=7,K=768,R=7,S=7,pad=3",
        "N=64,C=480,H=14,W=14,K=480,R=5,S=5,pad=2", "N=64,C=32,H=112,W=112,K=32,R=3,S=3,pad=1"]


def _real(text: str, dtype: str = "float16") -> ConvSpec:
    c = text.split("C=")[1].split(",")[0]
    return ConvSpec.parse(f"{text},groups={c},pass=wgrad,layout=nhwc,dtype={dtype}")


@pytest.mark.parametrize("text", REAL)
def test_defaults_and_sweep_points_plan(text):
    spec = _real(text)
    prm = stream_default(spec, NOMINAL_CUDA)
    assert prm is not None
    space = stream_space(spec, NOMINAL_CUDA)
    assert space[0] == prm and len(space) > 4
    for p in space:
        V.plan(spec, p, NOMINAL_CUDA)  # raises on an invalid point


def test_the_variant_space_holds_the_streamed_points():
    spec = _wg(ConvSpec.make(2, 16, 12, 12, 16, 3, 3, 1, 1, groups=16), "float16")
    assert set(stream_space(spec, NOMINAL_CUDA)) <= set(V.space(spec, NOMINAL_CUDA))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_variant_default_streams_small_7x7_planes_only(dtype):
    for text, streamed in [("N=32,C=384,H=14,W=14,K=384,R=7,S=7,pad=3", True),
                           ("N=32,C=768,H=7,W=7,K=768,R=7,S=7,pad=3", True),
                           ("N=32,C=192,H=28,W=28,K=192,R=7,S=7,pad=3", False),
                           ("N=64,C=144,H=56,W=56,K=144,R=3,S=3,pad=1", False)]:
        prm = V.default(_real(text, dtype), NOMINAL_CUDA)
        assert ("sc" in prm) == streamed, (text, prm)
    assert "sc" not in V.default(_real("N=32,C=384,H=14,W=14,K=384,R=7,S=7,pad=3", "float32"), NOMINAL_CUDA)


def test_streamed_defaults_compile_without_spills(nvcc_ok):
    sources = []
    for text in REAL:
        for dtype in ("float16", "bfloat16"):
            spec = _real(text, dtype)
            prm = stream_default(spec, NOMINAL_CUDA)
            sources.append((f"{text} {dtype} {prm.short()}", render(list(V.plan(spec, prm, NOMINAL_CUDA).kernels),
                                                                     "cuda")))
    assert_sources_compile_clean(sources)
