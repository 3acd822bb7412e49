"""The tensor-core depthwise kernels (kernels/tensorcore/sm80/depthwise_mma.py) modelled on the CPU: one
block after another, every strip element, table word, A / B register of every lane (placed by the PTX
mma.m16n8k16 fragment layouts), accumulator, staging slot and store, all from the generator's own
index expressions, against the float64 correlation; then shapes, refusals, ranks and the nvcc compile
(no spills). The GPU tier (tests/test_gpu_depthwise.py) runs them against float64 on the device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm80 import depthwise_mma as dm
from convforge.kernels.tensorcore.sm90.cexpr import bind
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean

# odd sizes: N past one 8-image chunk and not a multiple of it, primes, asymmetric padding, bands that do
# not divide the rows, planes over one 16-column tile (several Toeplitz offsets), both layouts, dgrad
# with padding past R - 1 (negative correlation padding: dy rows cropped)
CASES = [
    ("N=3,C=4,H=11,W=13,K=4,R=9,S=7,pad=4x3x2x5,groups=4,dtype=fp16,layout=nhwc", Params(cg=2, nt=8, bp=4, wp=3)),
    ("N=9,C=2,H=7,W=19,K=2,R=5,S=11,pad=2x2x5x5,groups=2,dtype=fp16", Params(cg=1, nt=16, bp=7, wp=4)),
    ("N=2,C=8,H=5,W=37,K=8,R=3,S=17,pad=1x1x8x8,groups=8,dtype=fp16,layout=nhwc", None),
    ("N=1,C=4,H=13,W=6,K=4,R=13,S=13,pad=6,groups=4,dtype=fp16,pass=dgrad,layout=nhwc", Params(cg=4, nt=8, bp=5, wp=2)),
    ("N=5,C=3,H=17,W=17,K=3,R=11,S=11,pad=1x3x0x2,groups=3,dtype=fp16,pass=dgrad", Params(cg=1, nt=8, bp=6, wp=4)),
    ("N=2,C=2,H=9,W=33,K=2,R=3,S=5,pad=4x4x4x4,groups=2,dtype=fp16,pass=dgrad", Params(cg=2, nt=8, bp=9, wp=1)),
]


def _geo(text: str, params: Params | None) -> dm.Geo:
    spec = ConvSpec.parse(text)
    v = get_variant("depthwise_mma_dgrad" if spec.conv_pass == "dgrad" else "depthwise_mma")
    assert v.applies(spec, NOMINAL_CUDA) is None, v.applies(spec, NOMINAL_CUDA)
    geo = dm.Geo.of(spec, params or v.default(spec, NOMINAL_CUDA))
    assert geo.problem() is None, geo.problem()
    return geo


def _half(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


def _reference(geo: dm.Geo, src: np.ndarray, w: np.ndarray) -> np.ndarray:
    """dst[n, c, p, q] = sum src[n, c, p + r - pt, q + s - pl] wf[c, r, s] in float64 (NCHW arrays)."""
    s = geo.spec
    wf = w[:, 0, ::-1, ::-1] if geo.dgrad else w[:, 0]
    out = np.zeros((s.n, s.c, geo.ho, geo.wo))
    for r in range(s.r):
        for c in range(s.s):
            for p in range(geo.ho):
                h = p + r - geo.pt
                if not 0 <= h < geo.hi:
                    continue
                q = np.arange(geo.wo)
                v = q + c - geo.pl
                ok = (v >= 0) & (v < geo.wi)
                out[:, :, p, q[ok]] += src[:, :, h, v[ok]] * wf[None, :, r, c, None]
    return out


def _fragments(geo: dm.Geo, env: dict, tab: np.ndarray, xs: np.ndarray, d: int, j: int,
               nc: int) -> tuple[np.ndarray, np.ndarray]:
    """A (16 x 16) and B (16 x 8) as the 32 lanes' registers hold them (mma.m16n8k16 row.col)."""
    a, b = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        le = bind(geo.a_lets(d), {**env, "g": g, "t": t})
        ao = le[f"ao{dm._tag(d)}"]
        words = {k: tab[env["trow"] + o] for k, o in (("a0", ao), ("a1", ao - 8), ("a2", ao + 8), ("a3", ao))}
        for name, (row, col) in {"a0": (g, 2 * t), "a1": (g + 8, 2 * t), "a2": (g, 2 * t + 8),
                                 "a3": (g + 8, 2 * t + 8)}.items():
            a[row, col], a[row, col + 1] = words[name]
        word = bind((dm.Let("bw", geo.b_word(j, nc)),), {"g": g, "t": t})["bw"]
        base = env["xrow"]
        for reg, k0 in ((0, 2 * t), (4, 2 * t + 8)):
            b[k0, g], b[k0 + 1, g] = xs[base + 2 * (word + reg)], xs[base + 2 * (word + reg) + 1]
    return a, b


def _model(geo: dm.Geo, src_flat: np.ndarray, w_flat: np.ndarray, epi: Epilogue, bias: np.ndarray,
           res_flat: np.ndarray) -> np.ndarray:
    """dst (flat, in the layer's layout) as the kernel writes it, NaN where it writes nothing."""
    s = geo.spec
    dst = np.full(s.n * s.c * geo.ho * geo.wo, np.nan)
    for bid in range(geo.blocks):
        env = bind(geo.head_lets(), {"bid": bid})
        xs = np.full(geo.cg * geo.xplane, np.nan)
        for e in range(geo.cg * geo.hb * geo.nt * geo.vp):
            x = bind(geo.strip_lets(), {**env, "e": e})
            assert np.isnan(xs[x["xd"]]), "two strip elements land on one half"
            xs[x["xd"]] = src_flat[x["xsrc"]] if x["xok"] else 0.0
        tab = np.zeros((geo.cg * s.r * geo.tl, 2))
        for e in range(len(tab)):
            x = bind(geo.table_lets(), {**env, "e": e})
            tab[e] = (w_flat[x["wlo"]] if x["tlok"] else 0.0, w_flat[x["whi"]] if x["thok"] else 0.0)
        ys = np.full(geo.cg * geo.nt * geo.bp * geo.wo, np.nan)
        for u in range(geo.cg * env["pe"]):
            ue = bind(geo.unit_lets(), {**env, "u": u})
            acc = {(i, nc): np.zeros((16, 8)) for i in range(geo.tq) for nc in range(geo.nt // 8)}
            for h in range(ue["hs"], ue["he"]):
                re_ = bind(geo.row_lets(), {**ue, "h": h})
                for j in range(geo.tv):
                    for nc in range(geo.nt // 8):
                        for i in range(geo.tq):
                            if j - i in geo.ds:
                                a, b = _fragments(geo, re_, tab, xs, j - i, j, nc)
                                acc[i, nc] += a @ b
            for (i, nc), dmat in acc.items():
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for k, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                        c = bind(geo.c_lets(i, nc), {**ue, "g": g, "t": t, "k": k})
                        if c["cok"]:
                            v = dmat[row, col]
                            if epi.bias:
                                v += bias[env["c0"] + ue["cgi"]]
                            if epi.residual:
                                v += res_flat[c["cd"]]
                            if epi.silu:
                                v = v / (1 + np.exp(-v))
                            assert np.isnan(ys[c["cy"]]), "two outputs staged in one slot"
                            ys[c["cy"]] = np.float16(v)
        run = geo.cg if geo.nhwc else 1
        items = eval(geo.items.replace("pe", str(env["pe"])))  # noqa: S307 - the generator's product of ints
        for e in range(items):
            x = bind(geo.store_lets(), {**env, "e": e})
            if x["sok"]:
                assert np.all(np.isnan(dst[x["sd"]: x["sd"] + run])), "an output written twice"
                dst[x["sd"]: x["sd"] + run] = ys[x["sy"]: x["sy"] + run]
    return dst


def _flat(a: np.ndarray, nhwc: bool) -> np.ndarray:
    return (a.transpose(0, 2, 3, 1) if nhwc else a).reshape(-1)


@pytest.mark.parametrize("text, params", CASES, ids=[c[0] for c in CASES])
def test_block_model_equals_the_correlation(text, params):
    """Every output, written exactly once from the generator's index expressions, within FP16 rounding
    of the float64 correlation (bias, residual and SiLU on the forward)."""
    geo = _geo(text, params)
    s, rng = geo.spec, np.random.default_rng(7)
    src = _half(rng.standard_normal((s.n, s.c, geo.hi, geo.wi)))
    w = _half(rng.standard_normal((s.c, 1, s.r, s.s)) / np.sqrt(s.r * s.s))
    epi = Epilogue() if geo.dgrad else Epilogue(bias=True, residual=True, silu=True)
    bias = _half(rng.standard_normal(s.c))
    res = _half(rng.standard_normal((s.n, s.c, geo.ho, geo.wo)))
    got = _model(geo, _flat(src, geo.nhwc), w.reshape(-1), epi, bias, _flat(res, geo.nhwc))
    ref = _reference(geo, src, w)
    if not geo.dgrad:
        ref = ref + bias[None, :, None, None] + res
        ref = ref / (1 + np.exp(-ref))
    ref = _flat(ref, geo.nhwc)
    assert not np.isnan(got).any(), f"{int(np.isnan(got).sum())} outputs never written"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-3, f"relative L2 {err:.2e}"


def test_a_table_spans_every_offset():
    """The three words a lane reads for every Toeplitz offset d lie inside its filter row's table."""
    for text, params in CASES:
        geo = _geo(text, params)
        for d in geo.ds:
            for lane in range(32):
                ao = bind(geo.a_lets(d), {"g": lane >> 2, "t": lane & 3})[f"ao{dm._tag(d)}"]
                assert 0 <= ao - 8 and ao + 8 < geo.tl, (text, d, lane, ao)


def test_refusals_and_rank():
    v, dg = get_variant("depthwise_mma"), get_variant("depthwise_mma_dgrad")
    big = ConvSpec.make(4, 64, 14, 14, 64, 27, 27, 1, 13, groups=64, dtype="float16", layout="nhwc")
    assert v.applies(big, NOMINAL_CUDA) is None
    assert v.rank(big, NOMINAL_CUDA) > get_variant("depthwise").rank(big, NOMINAL_CUDA)
    small = dataclasses.replace(big, r=3, s=3, pad=(1, 1, 1, 1))
    assert v.rank(small, NOMINAL_CUDA) < get_variant("depthwise").rank(small, NOMINAL_CUDA)
    assert "stride 1" in v.applies(dataclasses.replace(big, stride=(2, 2)), NOMINAL_CUDA)
    assert "K == groups == C" in v.applies(dataclasses.replace(big, k=128), NOMINAL_CUDA)
    assert "float32" in v.applies(dataclasses.replace(big, dtype="float32"), NOMINAL_CUDA)
    ampere = DeviceInfo("cuda", "nominal sm_75", cc=(7, 5), units=40)
    assert "8.0" in v.applies(big, ampere)
    assert "cuda" in v.applies(big, DeviceInfo("opencl", "cpu"))
    assert dg.applies(dataclasses.replace(big, conv_pass="dgrad"), NOMINAL_CUDA) is None
    with pytest.raises(ValueError, match="plain data gradient"):
        dg.plan(dataclasses.replace(big, conv_pass="dgrad"), dg.default(big, NOMINAL_CUDA), NOMINAL_CUDA,
                Epilogue(relu=True))
    with pytest.raises(ValueError, match="cg must be 1, 2, 4 or 8"):
        v.plan(big, Params(cg=3, nt=8, bp=4, wp=4), NOMINAL_CUDA)
    with pytest.raises(ValueError, match=r"cg \(8\) must divide the channels \(60\)"):
        v.plan(dataclasses.replace(big, c=60, k=60, groups=60), Params(cg=8, nt=8, bp=4, wp=4), NOMINAL_CUDA)


SUITE = [ConvSpec.make(32, 128, 56, 56, 128, 31, 31, 1, 15, groups=128),
         ConvSpec.make(32, 256, 28, 28, 256, 29, 29, 1, 14, groups=256),
         ConvSpec.make(32, 512, 14, 14, 512, 27, 27, 1, 13, groups=512),
         ConvSpec.make(32, 1024, 7, 7, 1024, 13, 13, 1, 6, groups=1024),
         ConvSpec.make(32, 96, 56, 56, 96, 51, 5, 1, (25, 2), groups=96)]


def test_defaults_compile_without_spills():
    """RepLKNet's and SLaK's layers, both layouts, both half dtypes, fprop (bias + residual + GELU) and
    dgrad: every default compiles for sm_90 with no spill, within two blocks an SM where one fits."""
    sources = []
    from convforge.codegen.render import render
    for base in SUITE:
        for layout in ("nchw", "nhwc"):
            for dtype, cp in (("float16", "fprop"), ("bfloat16", "dgrad")):
                spec = dataclasses.replace(base, dtype=dtype, layout=layout, conv_pass=cp)
                v = get_variant("depthwise_mma_dgrad" if cp == "dgrad" else "depthwise_mma")
                p = v.default(spec, NOMINAL_CUDA)
                assert dm.Geo.of(spec, p).smem <= dm._BUDGET, (spec.short(), p.short())
                epi = Epilogue(bias=True, residual=True, gelu=True) if cp == "fprop" else Epilogue()
                plan = v.plan(spec, p, NOMINAL_CUDA, epi)
                sources.append((f"{spec.short()} {p.short()}", render(list(plan.kernels), "cuda")))
    big = dataclasses.replace(SUITE[0], dtype="float16", layout="nchw")  # the most accumulators, 16 warps
    plan = get_variant("depthwise_mma").plan(big, Params(cg=1, nt=16, bp=8, wp=16), NOMINAL_CUDA)
    sources.append(("16 warps", render(list(plan.kernels), "cuda")))
    assert_sources_compile_clean(sources)
