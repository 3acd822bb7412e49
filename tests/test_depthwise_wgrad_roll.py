"""depthwise_wgrad's rolled form (``rb``: bands of output rows walked one row a step, the input rows in a
ring of registers, loads one or two steps ahead) on PoCL against the float64 reference with dw and the
partial filters poisoned (NaN) first: N=1, channel blocks past K (24 channels in lanes of 16), stride 2
and 4, asymmetric padding, dilation 2, 5x5, bands that do not divide the plane (and bands of one row),
strips past Q, two and four channels a thread, one and two steps ahead; float16, bfloat16 and float32
storage. Then its refusals, the space on real layers (valid plans), where the default takes it, and nvcc
on those defaults (registers, no spills).

Tolerances: the plan's (half: dtypes.HALF_TOLERANCE, float32: the variant's 1e-5).
"""

from __future__ import annotations

import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.codegen.render import render
from convforge.kernels import get_variant
from convforge.kernels.depthwise_wgrad_roll import Roll, roll_default, roll_pick, roll_space
from convforge.params import Params
from convforge.plan import DeviceInfo
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean

V = get_variant("depthwise_wgrad")


def _wg(spec: ConvSpec, dtype: str) -> ConvSpec:
    return ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "layout": "nhwc", "pass": "wgrad"})


CASES = [
    (ConvSpec.make(1, 16, 11, 9, 16, 3, 3, 1, 1, groups=16), Params(bc=8, bs=4, cv=2, tq=4, rb=4, ns=2)),
    (ConvSpec.make(2, 24, 13, 17, 24, 5, 5, 2, (2, 1, 0, 3), groups=24),
     Params(bc=4, bs=8, cv=2, tq=1, rb=3, ns=3)),
    (ConvSpec.make(1, 8, 20, 24, 8, 3, 3, 1, 2, 2, groups=8), Params(bc=4, bs=8, cv=2, tq=2, rb=7, pd=2, ns=1)),
    (ConvSpec.make(1, 8, 21, 17, 8, 3, 3, 4, (1, 0, 2, 1), groups=8), Params(bc=4, bs=8, cv=2, tq=1, rb=2, ns=2)),
    (ConvSpec.make(3, 24, 9, 8, 24, 3, 3, 1, 1, groups=24), Params(bc=8, bs=4, cv=2, tq=4, rb=1, ns=1)),
    (ConvSpec.make(2, 48, 14, 14, 48, 3, 3, 2, 1, groups=48), Params(bc=16, bs=2, cv=2, tq=2, rb=16, pd=2, ns=4)),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("spec, prm", CASES, ids=lambda v: v.short() if hasattr(v, "short") else None)
def test_rolled_wgrad_against_float64(poisoned, spec, prm, dtype):
    s = _wg(spec, dtype)
    assert Roll.of(s, prm).problem(poisoned.device) is None
    res = check_plan(V.plan(s, prm, poisoned.device), poisoned, seed=7)
    assert res.ok, f"[{prm.short()}] {s.short()}: {res}"


def test_refusals():
    base = ConvSpec.make(1, 16, 8, 8, 16, 3, 3, 1, 1, groups=16)
    prm = Params(bc=8, bs=4, cv=2, tq=4, rb=4, ns=1)
    for spec, p, what in [
            (ConvSpec.from_dict({**_wg(base, "float16").to_dict(), "layout": "nchw"}), prm, "NHWC"),
            (_wg(ConvSpec.make(1, 16, 8, 8, 32, 3, 3, 1, 1, groups=16), "float16"), prm, "multiplier 1"),
            (_wg(ConvSpec.make(1, 18, 8, 8, 18, 3, 3, 1, 1, groups=18), "float16"), prm.replace(cv=4), "divide K"),
            (_wg(base, "float16"), prm.replace(bs=3), "power of two"),
            (_wg(base, "float16"), prm.replace(pd=3), "pd"),
            (_wg(base, "float16"), prm.replace(tq=8, cv=4), "registers"),
            (_wg(base, "float16"), prm.replace(ns=1000), "ns")]:
        with pytest.raises(ValueError, match=what):
            V.plan(spec, p, NOMINAL_CUDA)


REAL = ["N=64,C=32,H=112,W=112,K=32,R=3,S=3,pad=1", "N=64,C=96,H=112,W=112,K=96,R=3,S=3,stride=2,pad=1",
        "N=64,C=144,H=56,W=56,K=144,R=3,S=3,pad=1", "N=64,C=144,H=56,W=56,K=144,R=3,S=3,stride=2,pad=1",
        "N=64,C=192,H=28,W=28,K=192,R=3,S=3,pad=1", "N=64,C=576,H=14,W=14,K=576,R=3,S=3,pad=1",
        "N=64,C=960,H=7,W=7,K=960,R=3,S=3,pad=1"]


def _real(text: str, dtype: str) -> ConvSpec:
    return _wg(ConvSpec.parse(text + ",groups=" + text.split("C=")[1].split(",")[0]), dtype)


@pytest.mark.parametrize("text", REAL)
def test_space_points_plan(text):
    spec = _real(text, "float16")
    pts = roll_space(spec, NOMINAL_CUDA)
    assert len(pts) >= 6, pts
    space = V.space(spec, NOMINAL_CUDA)
    for prm in pts:
        assert prm in space
        rl = Roll.of(spec, prm)
        assert rl.problem(NOMINAL_CUDA) is None and rl.mb >= 1
        assert 1 <= prm.ns <= rl.items
        V.plan(spec, prm, NOMINAL_CUDA)


def test_lanes_take_every_channel_where_warps_are_whole():
    rl = Roll.of(_real(REAL[2], "float16"), roll_default(_real(REAL[2], "float16"), NOMINAL_CUDA))
    assert (rl.bc, rl.bt, rl.channels) == (72, 4, 144)
    rl = Roll.of(_real(REAL[0], "float16"), roll_default(_real(REAL[0], "float16"), NOMINAL_CUDA))
    assert (rl.bc, rl.channels) == (16, 32)


def test_picks_compile_without_spills(nvcc_ok):
    """roll_pick's points (MobileNet-v2's layers of <= 14 output rows, a narrow 14x14 layer) in both half
    dtypes: ptxas under the named launch bound, no spills."""
    sources = []
    more = ["N=64,C=192,H=28,W=28,K=192,R=3,S=3,stride=2,pad=1", "N=32,C=64,H=14,W=14,K=64,R=3,S=3,pad=1",
            "N=64,C=576,H=14,W=14,K=576,R=3,S=3,stride=2,pad=1"]
    for text in REAL[4:] + more:
        for dtype in ("float16", "bfloat16"):
            spec = _real(text, dtype)
            prm = roll_pick(spec, NOMINAL_CUDA)
            if prm is None:
                assert spec.p > 14, text
                continue
            assert prm == V.default(spec, NOMINAL_CUDA)
            source = render(list(V.plan(spec, prm, NOMINAL_CUDA).kernels), "cuda")
            sources.append((f"{text} {dtype} {prm.short()}", source))
    assert len(sources) == 10
    assert_sources_compile_clean(sources)


def test_pick_only_on_small_planes_of_gpus():
    """3x3 at stride <= 2 on output planes of <= 14 rows, half storage, GPU only; the blocked form elsewhere."""
    for text, want in [(REAL[2], False), (REAL[4], False), (REAL[5], True), (REAL[6], True),
                       ("N=8,C=64,H=56,W=56,K=64,R=3,S=3,stride=4,pad=1", False),
                       ("N=64,C=480,H=14,W=14,K=480,R=5,S=5,pad=2", False)]:
        spec = _real(text, "float16")
        assert (roll_pick(spec, NOMINAL_CUDA) is not None) == want, text
        assert ("rb" in V.default(spec, NOMINAL_CUDA)) == want, text
    assert roll_pick(_real(REAL[5], "float32"), NOMINAL_CUDA) is None
    assert roll_pick(_real(REAL[5], "float16"), DeviceInfo("opencl", "pocl", is_gpu=False)) is None
    wide = Roll.of(_real(REAL[5], "float16"), roll_pick(_real(REAL[5], "float16"), NOMINAL_CUDA))
    narrow = Roll.of(_real(REAL[5], "bfloat16"), roll_pick(_real(REAL[5], "bfloat16"), NOMINAL_CUDA))
    assert (wide.tq, wide.pd, wide.rb, wide.threads) == (4, 2, 14, 128) and narrow.tq == 2
