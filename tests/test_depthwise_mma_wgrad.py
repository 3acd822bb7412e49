"""The tensor-core depthwise wgrad (kernels/tensorcore/sm80/depthwise_mma_wgrad.py) modelled on the CPU:
block after block, step after step, every staged word (the cp.async landing stages, the x row's pair arrays
and the dy ring), every lane's A / B registers
(placed by the PTX mma.m16n8k16 fragment layouts), the products, the partial filters and the slice sum,
all from the generator's own index expressions, against the float64 filter gradient; then the shared
banks a warp's loads touch, refusals, rank and the nvcc compile (no spills). The GPU tier
(tests/test_gpu_depthwise.py) runs it against float64 on the device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm80 import depthwise_mma_wgrad as dw
from convforge.kernels.tensorcore.sm90.cexpr import bind
from convforge.params import Params
from convforge.plan import DeviceInfo
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean

# N = 1 and odd, primes, asymmetric padding (cropping and widening the output), bands that do not divide
# the rows, rows over one 16-column strip, 1 x 7, 3 x 3 and 7 x 8 filters, stride 2, several channels a
# warp, several images a block, 2 and 3 landing stages
CASES = [
    ("N=3,C=16,H=11,W=13,K=16,R=7,S=7,pad=3,groups=16,dtype=fp16,layout=nhwc,pass=wgrad", Params(cb=8, wp=2, bh=4)),
    ("N=2,C=24,H=9,W=37,K=24,R=5,S=5,pad=2x1x3x1,groups=24,dtype=bf16,layout=nhwc,pass=wgrad",
     Params(cb=8, wp=4, bh=9)),
    ("N=1,C=8,H=5,W=17,K=8,R=3,S=3,pad=1,groups=8,dtype=fp16,layout=nhwc,pass=wgrad", Params(cb=8, wp=2, bh=2)),
    ("N=2,C=32,H=7,W=23,K=32,R=1,S=7,pad=0x0x3x3,groups=32,dtype=fp16,layout=nhwc,pass=wgrad",
     Params(cb=32, wp=8, bh=3)),
    ("N=1,C=16,H=6,W=19,K=16,R=7,S=8,pad=4x2x0x5,groups=16,dtype=fp16,layout=nhwc,pass=wgrad", None),
    ("N=2,C=16,H=13,W=41,K=16,R=5,S=5,stride=2,pad=2x1x2x2,groups=16,dtype=fp16,layout=nhwc,pass=wgrad",
     Params(cb=16, wp=4, bh=5)),
    ("N=1,C=8,H=10,W=9,K=8,R=3,S=3,stride=2,pad=1x0x0x1,groups=8,dtype=bf16,layout=nhwc,pass=wgrad",
     Params(cb=8, wp=2, bh=10, ls=3)),
    ("N=3,C=8,H=9,W=15,K=8,R=7,S=7,stride=2,pad=3,groups=8,dtype=fp16,layout=nhwc,pass=wgrad",
     Params(cb=8, wp=2, bh=4)),
    ("N=5,C=16,H=7,W=18,K=16,R=5,S=5,pad=2,groups=16,dtype=fp16,layout=nhwc,pass=wgrad",
     Params(cb=16, wp=4, bh=3, ni=2, ls=2)),
    ("N=2,C=16,H=9,W=37,K=16,R=7,S=7,pad=3,groups=16,dtype=bf16,layout=nhwc,pass=wgrad",
     Params(cb=16, wp=4, bh=5)),
]


def _geo(text: str, params: Params | None) -> dw.Geo:
    spec = ConvSpec.parse(text)
    v = get_variant("depthwise_mma_wgrad")
    assert v.applies(spec, NOMINAL_CUDA) is None, v.applies(spec, NOMINAL_CUDA)
    geo = dw.Geo.of(spec, params or v.default(spec, NOMINAL_CUDA))
    assert geo.problem() is None, geo.problem()
    return geo


def _half(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


def _reference(geo: dw.Geo, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """dw[c, r, s] = sum over n, p, q of dy[n, c, p, q] x[n, c, p + r - pt, q + s - pl] (NCHW, float64)."""
    s = geo.spec
    out = np.zeros((s.c, s.r, s.s))
    st = geo.st
    xp = np.zeros((s.n, s.c, st * s.p + s.r + s.h, st * s.q + s.s + s.w))
    xp[:, :, geo.pt: geo.pt + s.h, geo.pl: geo.pl + s.w] = x  # xp[.., a, b] = x[.., a - pt, b - pl]
    for r in range(s.r):
        for c in range(s.s):
            win = xp[:, :, r: r + st * s.p: st, c: c + st * s.q: st]
            out[:, r, c] = np.einsum("ncpq,ncpq->c", dy, win)
    return out


class _Block:
    """One block's shared words (pairs of values, NaN until written): landing stages (as halves), E/O arrays,
    the dy ring; its copies and transposes, all from the generator's lets."""

    def __init__(self, geo: dw.Geo, env: dict, x: np.ndarray, y: np.ndarray) -> None:
        self.geo, self.env, self.x, self.y = geo, env, x, y
        self.xsm = np.full((2 * geo.xbuf, 2), np.nan)
        self.ysm = np.full((geo.cb * geo.dc, 2), np.nan)
        self.land = np.full(2 * geo.ls * geo.stage, np.nan)

    def step(self, j: int) -> dict:
        return bind(self.geo.step_lets(), {**self.env, "j": j})

    def copies(self, j: int) -> None:
        """cp.async of step j into stage j % ls: 16 bytes (8 halves) a copy."""
        geo, se = self.geo, self.step(j)
        base = 2 * (j % geo.ls) * geo.stage
        if se["sx"]:
            for e in range(geo.spec.w * geo.octets):
                le = bind(geo.xcopy_lets(), {**se, "e": e})
                self.land[base + 2 * le["cd"]: base + 2 * le["cd"] + 8] = self.x[le["csrc"]: le["csrc"] + 8]
        if se["sy"]:
            for e in range(geo.spec.q * geo.octets):
                le = bind(geo.ycopy_lets(), {**se, "e": e})
                src = self.y[le["csrc"]: le["csrc"] + 8] if se["syok"] else np.zeros(8)
                self.land[base + 2 * le["cd"]: base + 2 * le["cd"] + 8] = src

    def _halves(self, j: int, word: int) -> np.ndarray:
        at = 2 * ((j % self.geo.ls) * self.geo.stage + word)
        return self.land[at: at + 8]

    def transpose(self, j: int) -> None:
        """Step j's landing stage into the E/O arrays of buffer j & 1 and the ring."""
        geo, se = self.geo, self.step(j)
        half = geo.cb // 2
        if se["sx"]:
            for e in range(geo.x_items):
                le = bind(geo.x_lets(), {**se, "e": e})
                pix = [self._halves(j, le["xl"] + v * half) if bind((dw.Let("ok", geo.x_ok(v)),), le)["ok"]
                       else np.zeros(8) for v in range(3 * geo.st)]
                for i in range(8):
                    for a in range(geo.na):
                        lo, hi = geo.pair(a)
                        self.xsm[(j & 1) * geo.xbuf + le["xd"] + i * geo.xc + a * geo.xo] = (pix[lo][i], pix[hi][i])
        if se["sy"]:
            for e in range(geo.y_items):
                le = bind(geo.y_lets(), {**se, "e": e})
                cols = [self._halves(j, le["yl"] + v * half) if le[f"yok{v}"] else np.zeros(8) for v in range(2)]
                for i in range(8):
                    self.ysm[le["yd"] + i * geo.dc] = (cols[0][i], cols[1][i])

    def fragments(self, h: int, j: int, ch: int, q: int) -> tuple[np.ndarray, np.ndarray]:
        """A (16 x 16) and B (16 x 8) as the warp's lanes hold them for input row h (step j), channel ch, strip q."""
        geo = self.geo
        a, b = np.zeros((16, 16)), np.zeros((16, 8))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            le = bind(geo.lane_lets(), {"h": h, "g": g, "t": t})
            ya = le["aw"] + ch * geo.dc + 8 * q
            assert ya % 2 == 0, "A's two words are one 8-byte load"
            if le["aok"]:
                a[g, 2 * t: 2 * t + 2], a[g, 2 * t + 8: 2 * t + 10] = self.ysm[ya], self.ysm[ya + 1]
            xb = (j & 1) * geo.xbuf + le["bw"] + ch * geo.xc + 8 * q
            b[2 * t: 2 * t + 2, g], b[2 * t + 8: 2 * t + 10, g] = self.xsm[xb], self.xsm[xb + 4]
        return a, b


def _image(geo: dw.Geo, env: dict, x: np.ndarray, y: np.ndarray, acc: dict) -> None:
    """Image env["n"] of a block, step by step in the kernel's order; the products summed into ``acc``."""
    blk = _Block(geo, env, x, y)
    steps = env["rows"] + geo.spec.r - 1
    for k in range(min(geo.ls, steps)):
        blk.copies(k)
    blk.transpose(0)
    for j in range(steps):
        if j + geo.ls < steps:
            blk.copies(j + geo.ls)
        if j + 1 < steps:
            blk.transpose(j + 1)
        se = blk.step(j)
        if se["sx"]:
            for ch in range(geo.cb):
                for q in range(geo.tq):
                    a, b = blk.fragments(se["sv"], j, ch, q)
                    with np.errstate(invalid="ignore"):
                        acc[ch] += a @ b  # A's rows R.. may be unwritten (NaN): D's are never stored


def _model(geo: dw.Geo, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The partial filters (slices x C x R x S, NaN where never written) as the kernel writes them."""
    s = geo.spec
    part = np.full(geo.slices * s.c * s.r * s.s, np.nan)
    for bid in range(geo.blocks):
        head = bind(geo.head_lets(), {"bid": bid})
        acc = {ch: np.zeros((16, 8)) for ch in range(geo.cb)}
        for n in range(head["n0"], min(head["n0"] + geo.ni, s.n)):
            _image(geo, {**head, "n": n}, x, y, acc)
        for warp in range(geo.wp):
            for c in range(geo.cw):
                cl = warp + geo.wp * c
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for k in range(2):
                        le = bind(geo.store_lets(), {**head, "cl": cl, "g": g, "t": t, "k": k})
                        if le["sok"]:
                            assert np.isnan(part[le["sd"]]), "a partial written twice"
                            part[le["sd"]] = acc[cl][g, 2 * t + k]
    return part.reshape(geo.slices, s.c, s.r, s.s)


@pytest.mark.parametrize("text, params", CASES, ids=[c[0] for c in CASES])
def test_block_model_equals_the_filter_gradient(text, params):
    """Every partial filter written exactly once, their fixed-order sum within FP16 rounding of float64."""
    geo = _geo(text, params)
    s, rng = geo.spec, np.random.default_rng(11)
    x = _half(rng.standard_normal((s.n, s.c, s.h, s.w)))
    dy = _half(rng.standard_normal((s.n, s.c, s.p, s.q)))
    part = _model(geo, x.transpose(0, 2, 3, 1).reshape(-1), dy.transpose(0, 2, 3, 1).reshape(-1))
    assert not np.isnan(part).any(), f"{int(np.isnan(part).sum())} partial sums never written"
    got, ref = part.sum(axis=0), _reference(geo, x, dy)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-12, f"relative L2 {err:.2e}"  # float64 products of half values: exact up to summation order


@pytest.mark.parametrize("text, params", CASES[:2] + [
    ("N=64,C=96,H=56,W=56,K=96,R=7,S=7,pad=3,groups=96,dtype=fp16,layout=nhwc,pass=wgrad", None),
    ("N=64,C=192,H=28,W=28,K=192,R=7,S=7,pad=3,groups=192,dtype=fp16,layout=nhwc,pass=wgrad", None),
    ("N=64,C=480,H=14,W=14,K=480,R=5,S=5,pad=2,groups=480,dtype=fp16,layout=nhwc,pass=wgrad", None),
    ("N=64,C=96,H=112,W=112,K=96,R=3,S=3,stride=2,pad=1,groups=96,dtype=fp16,layout=nhwc,pass=wgrad", None),
    CASES[5]])
def test_product_loads_meet_no_bank_twice(text, params):
    """A's 8-byte loads (per half-warp) and B's two 4-byte loads (per warp) of every row slot and strip
    touch each of the 32 banks with at most one distinct word."""
    geo = _geo(text, params)
    for h in range(8):
        lanes = [bind(geo.lane_lets(), {"h": h, "g": ln >> 2, "t": ln & 3}) for ln in range(32)]
        for j in range(geo.tq):
            for half in (range(16), range(16, 32)):
                words = {lanes[ln]["aw"] + 8 * j + d for ln in half for d in (0, 1)}
                assert len({w % 32 for w in words}) == len(words), ("A", h, j)
            for off in (0, 4):
                words = {lanes[ln]["bw"] + 8 * j + off for ln in range(32)}
                assert len({w % 32 for w in words}) == len(words), ("B", h, j, off)


def test_refusals_rank_and_errors():
    v = get_variant("depthwise_mma_wgrad")
    base = ConvSpec.parse("N=8,C=96,H=28,W=28,K=96,R=7,S=7,pad=3,groups=96,dtype=fp16,layout=nhwc,pass=wgrad")
    assert v.applies(base, NOMINAL_CUDA) is None
    for first in (base, dataclasses.replace(base, r=5, s=5, pad=(2, 2, 2, 2))):
        assert v.rank(first, NOMINAL_CUDA) > get_variant("depthwise_wgrad").rank(first, NOMINAL_CUDA), first.short()
    for other in (dataclasses.replace(base, r=3, s=3, pad=(1, 1, 1, 1)),
                  dataclasses.replace(base, r=5, s=5, pad=(2, 2, 2, 2), h=7, w=7),
                  dataclasses.replace(base, h=7, w=7), dataclasses.replace(base, stride=(2, 2))):
        assert v.rank(other, NOMINAL_CUDA) < get_variant("depthwise_wgrad").rank(other, NOMINAL_CUDA), other.short()
    assert "stride 1 or 2" in v.applies(dataclasses.replace(base, stride=(3, 3)), NOMINAL_CUDA)
    assert "stride 1 or 2" in v.applies(dataclasses.replace(base, stride=(1, 2)), NOMINAL_CUDA)
    assert "at most 7 rows" in v.applies(dataclasses.replace(base, r=9, s=9, pad=(4, 4, 4, 4)), NOMINAL_CUDA)
    assert "multiple of 8" in v.applies(dataclasses.replace(base, c=36, k=36, groups=36), NOMINAL_CUDA)
    assert "K == groups == C" in v.applies(dataclasses.replace(base, k=192), NOMINAL_CUDA)
    assert "NCHW" in v.applies(dataclasses.replace(base, layout="nchw"), NOMINAL_CUDA)
    assert "float32" in v.applies(dataclasses.replace(base, dtype="float32"), NOMINAL_CUDA)
    assert "8.0" in v.applies(base, DeviceInfo("cuda", "nominal sm_75", cc=(7, 5), units=40))
    assert "cuda" in v.applies(base, DeviceInfo("opencl", "cpu"))
    with pytest.raises(ValueError, match=r"cb \(12\) must be a multiple of 8"):
        v.plan(base, Params(cb=12, wp=4, bh=8), NOMINAL_CUDA)
    with pytest.raises(ValueError, match=r"wp \(3\) must be 1..16, divide cb \(16\)"):
        v.plan(base, Params(cb=16, wp=3, bh=8), NOMINAL_CUDA)


SUITE = ["N=64,C=96,H=56,W=56,K=96,R=7,S=7,pad=3,groups=96",
         "N=64,C=768,H=7,W=7,K=768,R=7,S=7,pad=3,groups=768",
         "N=64,C=240,H=28,W=28,K=240,R=5,S=5,pad=2,groups=240",
         "N=64,C=144,H=56,W=56,K=144,R=3,S=3,pad=1,groups=144",
         "N=1,C=40,H=112,W=112,K=40,R=7,S=7,pad=3,groups=40",
         "N=64,C=96,H=112,W=112,K=96,R=3,S=3,stride=2,pad=1,groups=96",
         "N=64,C=72,H=56,W=56,K=72,R=5,S=5,stride=2,pad=2,groups=72"]


def test_defaults_compile_without_spills():
    """ConvNeXt's, EfficientNet's and MobileNet's layers, both half dtypes, every default and a few of the
    space's points compile for sm_90 with no spill."""
    from convforge.codegen.render import render
    v, sources = get_variant("depthwise_mma_wgrad"), []
    for text in SUITE:
        for dtype in ("fp16", "bf16"):
            spec = ConvSpec.parse(f"{text},dtype={dtype},layout=nhwc,pass=wgrad")
            space = v.space(spec, NOMINAL_CUDA)
            for p in space[:1] + ([] if dtype == "bf16" else space[1::max(1, len(space) // 3)]):
                plan = v.plan(spec, p, NOMINAL_CUDA)
                sources.append((f"{spec.short()} {p.short()}", render(list(plan.kernels), "cuda")))
    assert_sources_compile_clean(sources)


@pytest.mark.parametrize("count, threads", [(112, 128), (128, 128), (200, 128), (72, 64), (5, 32)])
def test_a_steps_items_loop_takes_each_item_once(count, threads):
    """The unrolled item loop (``_items``) as written, run for every thread: the items it visits partition
    0..count-1 (the block model above takes the same partition by construction)."""
    code = dw.Code()
    with dw._items(code, count, threads):
        code("SEEN(e);")
    text = code.text()
    looped = "for (int u = 0; u < " in text
    trips = int(text.split("u < ")[1].split(";")[0]) if looped else 1
    guarded = f"if (e < {count})" in text
    assert guarded == (count % threads != 0)
    assert f"const int e = tid + u * {threads};" in text if looped else "const int e = tid;" in text
    seen = [tid + u * threads for tid in range(threads) for u in range(trips)
            if not guarded or tid + u * threads < count]
    assert sorted(seen) == list(range(count))
