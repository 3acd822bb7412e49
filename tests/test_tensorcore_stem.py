"""The stem kernels (kernels/tensorcore/sm90/stem.py) modelled on the CPU: every A register and every B element
wgmma reads, emulated from the generator's own index expressions, against the convolution's im2col
definition; shapes, refusals and the nvcc compile (no spills). The GPU tier runs them against float64."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm90 import stem
from convforge.kernels.tensorcore.sm90.cexpr import bind, evaluate
from convforge.kernels.tensorcore.sm90.isa import M
from convforge.kernels.tensorcore.sm90.smem import model_address
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean


def _spec(text: str) -> ConvSpec:
    return ConvSpec.parse(text)


# (spec, params or None for the default): odd sizes, both layouts, stride 1 (odd sw C: the second copy),
# 2 and 4, asymmetric padding, dilation along H, Q past one 64-pixel block, bands not dividing P
CASES = [
    ("N=2,C=3,H=23,W=21,K=16,R=7,S=7,stride=2,pad=3,dtype=fp16", None),
    ("N=1,C=3,H=19,W=70,K=24,R=3,S=3,dtype=fp16,layout=nhwc", Params(bp=3, wg=2, ns=1)),
    ("N=2,C=3,H=31,W=29,K=32,R=11,S=11,stride=4,dtype=bf16,layout=nhwc", Params(bp=2, wg=1, ns=2)),
    ("N=1,C=1,H=13,W=150,K=8,R=5,S=5,pad=1x2x0x3,dtype=fp16", Params(bp=4, wg=2, ns=1)),
    ("N=1,C=2,H=17,W=15,K=16,R=3,S=3,dilation=2x1,pad=2,dtype=fp16,layout=nhwc", Params(bp=2, wg=1, ns=1)),
    ("N=1,C=3,H=21,W=67,K=16,R=7,S=7,stride=2,pad=3", None),
    ("N=1,C=3,H=11,W=11,K=8,R=3,S=3,pad=1,layout=nhwc", Params(bp=5, wg=2, ns=1)),
]


def _geo(text: str, params: Params | None) -> tuple[stem.StemGeo, ConvSpec]:
    spec = _spec(text)
    v = get_variant("tc_stem_direct_tf32" if spec.dtype == "float32" else "tc_stem_direct_half")
    assert v.applies(spec, NOMINAL_CUDA) is None, v.applies(spec, NOMINAL_CUDA)
    p = params or v.default(spec, NOMINAL_CUDA)
    return v.geo(spec, p), spec


def _strip(geo: stem.StemGeo, xflat: np.ndarray, n: int, p0: int) -> np.ndarray:
    out = np.zeros(geo.sr * geo.rs)
    for e in range(out.size):
        env = bind(stem.strip_lets(geo), {"e": e, "n": n, "p0": p0})
        out[e] = xflat[env["src"]] if env["ok"] else 0.0
    return out


def _b_smem(geo: stem.StemGeo, wflat: np.ndarray, gy: int) -> dict[int, float]:
    """The block's filters in shared memory, byte address -> element, as the filter step and the
    block's chunk copy write them."""
    total = geo.ns * geo.spec.r * geo.ks * geo.kn * geo.ke
    wt = np.zeros(total)
    for e in range(total):
        env = bind(stem.wt_lets(geo), {"e": e})
        wt[e] = wflat[env["src"]] if env["ok"] else 0.0
    es, per = geo.math.esize, 16 // geo.math.esize
    smem: dict[int, float] = {}
    for e in range(geo.spec.r * geo.ks * geo.kn * 2):
        env = bind(stem.wcopy_lets(geo), {"e": e, "gy": gy})
        assert env["gsrc"] % 16 == 0 and env["sdst"] % 16 == 0
        for m in range(per):
            assert env["sdst"] + es * m not in smem
            smem[env["sdst"] + es * m] = wt[env["gsrc"] // es + m]
    return smem


@pytest.mark.parametrize("text, params", CASES, ids=[c[0] for c in CASES])
def test_registers_and_b_tiles_hold_the_im2col(text, params):
    """Every lane's A registers (masked past S C) and every B element wgmma reads equal the layer's
    im2col operands, for every unit of every band (first and last image, each channel block)."""
    geo, spec = _geo(text, params)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(spec.x_shape)
    w = rng.standard_normal(spec.w_shape)
    xflat = (x.transpose(0, 2, 3, 1) if spec.layout == "nhwc" else x).ravel()
    (sh, sw), (dh, _), (pt, _, pl, _) = spec.stride, spec.dilation, spec.pad
    xp = np.zeros((spec.n, spec.c, spec.h + 2 * spec.r * dh + 8 * sh, (geo.mb * M) * sw + spec.s + spec.w + 8))
    xp[:, :, pt:pt + spec.h, pl:pl + spec.w] = x
    es, epr = geo.math.esize, geo.epr
    for gy in range(geo.ns):
        bsm = _b_smem(geo, w.ravel(), gy)
        for r in range(spec.r):  # B: row nn (channel gy Kn + nn), k = i KE + kk of tap r
            for i in range(geo.ks):
                desc = (geo.btile.desc_high | (geo.woff >> 4)) + ((r * geo.ks + i) * geo.kn * stem.BWIDTH >> 4)
                for nn in range(geo.kn):
                    for kk in range(geo.ke):
                        k = i * geo.ke + kk
                        want = w[gy * geo.kn + nn, k % spec.c, r, k // spec.c] if k < geo.sc else 0.0
                        assert bsm[model_address(desc, nn, kk * es)] == want, (r, i, nn, kk)
    for n in sorted({0, spec.n - 1}):
        for band in range(geo.bands):
            p0 = band * geo.bp
            strip = _strip(geo, xflat, n, p0)
            copy2 = np.append(strip[1:], np.nan)
            units = min(geo.bp, spec.p - p0) * geo.mb
            for u in range(units):
                for wq in range(4):
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        env = bind(stem.unit_lets(geo) + stem.a_lets(geo),
                                   {"u": u, "p0": p0, "wq": wq, "g": g, "t": t})
                        for r in range(spec.r):
                            for i in range(geo.ks):
                                for xr in range(4):
                                    byte = env["abyte"] + es * (env["uoff"] + stem.a_delta(geo, r, i, xr))
                                    assert byte % 4 == 0, "a 32-bit shared load must be aligned"
                                    src, at = (copy2, byte - geo.copy2) if geo.dual and byte >= geo.copy2 else \
                                        (strip, byte)
                                    q = env["q0"] + 16 * wq + g + 8 * (xr & 1)
                                    for el in range(epr):
                                        k = i * geo.ke + (xr >> 1) * (geo.ke // 2) + epr * t + el
                                        got = src[at // es + el] if k < geo.sc else 0.0  # the mask
                                        if q >= spec.q:
                                            continue  # a pixel past the row: computed, never stored
                                        want = xp[n, k % spec.c, env["p"] * sh + r * dh,
                                                  q * sw + k // spec.c] if k < geo.sc else 0.0
                                        assert got == want, (n, p0, u, wq, lane, r, i, xr, el)


def test_masks_match_the_reduction_length():
    """The last k step's per-lane masks keep exactly the elements with k < S C."""
    for text, params in CASES:
        geo, _ = _geo(text, params)
        for t in range(4):
            for half in (0, 1):
                expr = stem.mask_expr(geo, half).replace("0xffffffffu", "4294967295").replace("0xffffu", "65535")
                expr = expr.replace("0u", "0")
                mask = _ternary(expr, t)
                k0 = (geo.ks - 1) * geo.ke + half * (geo.ke // 2) + geo.epr * t
                keep = [k0 + el < geo.sc for el in range(geo.epr)]
                want = sum((0xFFFF if geo.epr == 2 else 0xFFFFFFFF) << (16 * el) for el in range(geo.epr) if keep[el])
                assert mask == want, (text, t, half)


def _ternary(expr: str, t: int) -> int:
    """Evaluate the mask's nested C ternary (a ? b : c ? d : e) for lane column ``t``."""
    body = expr.strip()[1:-1]
    cond, rest = body.split(" ? ", 1)
    yes, no = rest.split(" : ", 1)
    if evaluate(cond, {"t": t}):
        return int(yes)
    return _ternary(f"({no})", t) if "?" in no else int(no)


def test_shapes_and_refusals():
    v = get_variant("tc_stem_direct_half")
    cv3 = _spec("N=128,C=3,H=227,W=227,K=64,R=7,S=7,stride=2,dtype=fp16,layout=nhwc")
    geo = v.geo(cv3, v.default(cv3, NOMINAL_CUDA))
    assert (geo.bp, geo.wg, geo.ns) == (8, 2, 1) and not geo.dual
    assert geo.ks == 2 and geo.sr == (geo.bp - 1) * 2 + 7
    cv7 = _spec("N=128,C=3,H=224,W=224,K=64,R=3,S=3,dtype=fp16,layout=nhwc")
    assert v.geo(cv7, v.default(cv7, NOMINAL_CUDA)).dual
    cv1 = _spec("N=128,C=3,H=227,W=227,K=96,R=11,S=11,stride=4,dtype=fp16,layout=nhwc")
    assert v.default(cv1, NOMINAL_CUDA)["ns"] == 1  # one block loads all 96 channels' filters
    assert v.default(_spec("N=32,C=3,H=224,W=224,K=64,R=7,S=7,stride=2,pad=3,dtype=fp16"), NOMINAL_CUDA)["bp"] == 4
    assert "chunk" in v.applies(_spec("N=1,C=8,H=9,W=9,K=8,R=3,S=3,dtype=fp16"), NOMINAL_CUDA)
    assert "multiple of 8" in v.applies(_spec("N=1,C=3,H=9,W=9,K=12,R=3,S=3,dtype=fp16"), NOMINAL_CUDA)
    assert "contiguous" in v.applies(_spec("N=1,C=3,H=9,W=9,K=8,R=3,S=3,dilation=2,dtype=fp16"), NOMINAL_CUDA)
    assert "sm_90a" in v.applies(cv3, dataclasses.replace(NOMINAL_CUDA, cc=(8, 0)))
    assert "float32" in get_variant("tc_stem_direct_tf32").applies(_spec("N=1,C=3,H=9,W=9,K=8,R=3,S=3,dtype=fp16"),
                                                                   NOMINAL_CUDA)
    with pytest.raises(ValueError, match="residual"):
        v.plan(cv3, v.default(cv3, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(residual=True))
    with pytest.raises(ValueError, match="multiple of 8"):
        v.plan(cv3, Params(bp=8, wg=2, ns=3), NOMINAL_CUDA)
    small = DeviceInfo("cuda", "small", cc=(9, 0), shared_optin_bytes=48 * 1024, units=8)
    assert all(v.geo(cv1, p).shared_bytes <= 48 * 1024 for p in v.space(cv1, small))


COMPILED = [("N=128,C=3,H=227,W=227,K=64,R=7,S=7,stride=2,dtype=fp16,layout=nhwc", Epilogue()),
            ("N=128,C=3,H=227,W=227,K=96,R=11,S=11,stride=4,dtype=bf16,layout=nhwc", Epilogue(bias=True, relu=True)),
            ("N=128,C=3,H=224,W=224,K=64,R=3,S=3,pad=1,dtype=fp16", Epilogue(bias=True)),
            ("N=32,C=3,H=224,W=224,K=64,R=7,S=7,stride=2,pad=3", Epilogue(bias=True, gelu=True))]


def test_stems_compile_without_spills(nvcc_ok):
    """The first three points of the space on each COMPILED stem, with its epilogue: no spills (one
    nvcc run for all)."""
    sources: dict[str, str] = {}  # points that render the same source on a layer compile once
    for text, epi in COMPILED:
        spec = _spec(text)
        v = get_variant("tc_stem_direct_tf32" if spec.dtype == "float32" else "tc_stem_direct_half")
        for p in v.space(spec, NOMINAL_CUDA)[:3]:
            sources.setdefault(v.plan(spec, p, NOMINAL_CUDA, epi).source("cuda"), f"{text} [{p.short()}]")
    assert_sources_compile_clean([(label, src) for src, label in sources.items()])


def test_rank_first_where_bands_share_the_filter_loads():
    """First on stems of at least 4 output rows (N P) an SM; below the implicit GEMM under that (each
    block loads the whole filter bank: AlexNet's conv1 at N5 ran slower than the implicit GEMM)."""
    from convforge.kernels import ranked

    alex5 = _spec("N=5,C=3,H=227,W=227,K=96,R=11,S=11,stride=4")
    goog5 = _spec("N=5,C=3,H=224,W=224,K=64,R=7,S=7,stride=2,pad=3")
    assert ranked("auto", alex5, NOMINAL_CUDA, precision="relaxed")[0].name == "tc_implicit_gemm_tf32"
    assert ranked("auto", goog5, NOMINAL_CUDA, precision="relaxed")[0].name == "tc_stem_direct_tf32"
    r50 = _spec("N=32,C=3,H=224,W=224,K=64,R=7,S=7,stride=2,pad=3,dtype=fp16")
    assert ranked("auto", r50, NOMINAL_CUDA)[0].name == "tc_stem_direct_half"


def test_stems_suite_is_what_the_direct_stems_serve():
    """The built-in ``stems`` suite: ten 3-channel first layers, each served by the direct stems in half
    precision (channels-last) and TF32; ResNet-50's at batch 1 ranked below the implicit GEMM."""
    from convforge.apps.bench.suites import load_suite

    layers = load_suite("stems")
    assert len(layers) == 10 and all(la.spec.c == 3 for la in layers)
    half, tf32 = get_variant("tc_stem_direct_half"), get_variant("tc_stem_direct_tf32")
    for la in layers:
        cl = dataclasses.replace(la.spec, dtype="float16", layout="nhwc")
        assert half.applies(cl, NOMINAL_CUDA) is None and tf32.applies(la.spec, NOMINAL_CUDA) is None, la.name
    n1 = layers[-1].spec
    assert n1.n == 1 and tf32.rank(n1, NOMINAL_CUDA) < get_variant("tc_implicit_gemm_tf32").rank(n1, NOMINAL_CUDA)
