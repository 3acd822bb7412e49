"""The tensor-core narrow-group wgrad (kernels/tensorcore/sm80/grouped_mma_wgrad.py) modelled on the CPU:
block after block, its cp.async copies into 16-byte shared units (NaN until written), every lane's
ldmatrix.trans row addresses and the fragments they give (the PTX m8n8 .trans and mma.m16n8k16 layouts),
the products, the fixed-order sum of the warps and the partial filters, all from the generator's own index
expressions, against the float64 filter gradient; then the banks of a warp's ldmatrix rows, refusals and
the nvcc compile (no spills). The GPU tier (tests/test_gpu_grouped.py) runs it against float64 on the
device."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.render import render
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm80 import grouped_mma_wgrad as gm
from convforge.kernels.tensorcore.sm90.cexpr import bind
from convforge.params import Params
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean

V = get_variant("wgrad_grouped_mma")

# N = 1 and odd, groups of 4, 8 and 16, primes, asymmetric padding, bands that do not divide the rows
# (chunks wrapping rows, a last chunk past the band), stride 2 with even and odd widths, 1x1, 3x3, 5x5
# and 1x7 filters (an odd tap count: the last pair's second tap past the end), several warps a pair,
# several images a block
CASES = [
    ("N=1,C=16,H=7,W=9,K=16,R=3,S=3,pad=1,groups=4,dtype=fp16,layout=nhwc,pass=wgrad", None),
    ("N=3,C=32,H=11,W=13,K=32,R=3,S=3,pad=1,groups=4,dtype=fp16,layout=nhwc,pass=wgrad", Params(cb=32, wp=8, bp=4)),
    ("N=2,C=48,H=9,W=10,K=48,R=3,S=3,stride=2,pad=1,groups=6,dtype=bf16,layout=nhwc,pass=wgrad",
     Params(cb=16, wp=4, bp=2, ni=2)),
    ("N=5,C=16,H=9,W=9,K=16,R=3,S=3,pad=1,groups=4,dtype=fp16,layout=nhwc,pass=wgrad", Params(cb=16, wp=2, bp=5, ni=4)),
    ("N=2,C=32,H=13,W=11,K=32,R=3,S=3,stride=2,pad=1x0x0x1,groups=2,dtype=fp16,layout=nhwc,pass=wgrad",
     Params(cb=32, wp=8, bp=3)),
    ("N=1,C=32,H=6,W=7,K=32,R=5,S=5,pad=2x1x3x1,groups=4,dtype=fp16,layout=nhwc,pass=wgrad", Params(cb=16, wp=2, bp=2)),
    ("N=2,C=16,H=5,W=17,K=16,R=1,S=7,pad=0x0x3x3,groups=2,dtype=bf16,layout=nhwc,pass=wgrad", None),
    ("N=1,C=24,H=8,W=8,K=24,R=1,S=1,groups=6,dtype=fp16,layout=nhwc,pass=wgrad", Params(cb=8, wp=1, bp=8)),
    ("N=2,C=16,H=9,W=11,K=16,R=3,S=3,pad=1,groups=8,dtype=fp16,layout=nhwc,pass=wgrad", None),  # groups of 2
    ("N=3,C=48,H=9,W=7,K=48,R=3,S=3,stride=2,pad=1,groups=2,dtype=bf16,layout=nhwc,pass=wgrad", None),  # of 24
    ("N=2,C=64,H=7,W=9,K=64,R=3,S=3,pad=1,groups=2,dtype=fp16,layout=nhwc,pass=wgrad",
     Params(cb=32, wp=16, bp=4, ni=2)),
]


def _geo(text: str, params: Params | None) -> gm.Geo:
    spec = ConvSpec.parse(text)
    assert V.applies(spec, NOMINAL_CUDA) is None, V.applies(spec, NOMINAL_CUDA)
    geo = gm.Geo.of(spec, params or V.default(spec, NOMINAL_CUDA))
    assert geo.problem() is None, geo.problem()
    return geo


def _reference(s: ConvSpec, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """dw[k, c, r, s] (float64) of NCHW x and dy."""
    st, (pt, _, pl, _) = s.stride[0], s.pad
    xp = np.zeros((s.n, s.c, st * s.p + s.r + s.h, st * s.q + s.s + s.w))
    xp[:, :, pt: pt + s.h, pl: pl + s.w] = x
    out = np.zeros((s.k, s.cg, s.r, s.s))
    for g in range(s.groups):
        xs, ks = slice(g * s.cg, (g + 1) * s.cg), slice(g * s.kg, (g + 1) * s.kg)
        for r in range(s.r):
            for c in range(s.s):
                win = xp[:, xs, r: r + st * s.p: st, c: c + st * s.q: st]
                out[ks, :, r, c] = np.einsum("nkpq,ncpq->kc", dy[:, ks], win)
    return out


def _ldsm(units: np.ndarray, addrs: list[int], count: int) -> list[np.ndarray]:
    """ldmatrix .trans of ``count`` 8 x 8 matrices: matrix q's rows at lanes 8q..8q+7's unit addresses; as
    the rows themselves (lane (g, t) then holds rows 2t, 2t + 1 of column g)."""
    for a in addrs[: 8 * count]:
        assert 0 <= a < len(units), f"ldmatrix row {a} outside shared memory"
    return [np.stack([units[addrs[8 * q + r]] for r in range(8)]) for q in range(count)]


def _block(geo: gm.Geo, bid: int, x: np.ndarray, y: np.ndarray, part: np.ndarray) -> None:
    s = geo.spec
    head = bind(geo.head_lets(), {"bid": bid})
    units = np.full((geo.smem // 16, 8), np.nan)
    units[geo.zrow] = 0.0
    d = {w: [np.zeros((16, 8)) for _ in range(geo.tp)] for w in range(geo.wp)}
    for n in range(head["n0"], min(head["n0"] + geo.ni, s.n)):
        env = {**head, "n": n, "bsel": (n - head["n0"]) % geo.nbuf}
        for e in range(geo.x_items):
            c = bind(geo.xcopy_lets(), {**env, "e": e})
            units[c["cd"]] = x[c["csrc"]: c["csrc"] + 8] if c["cok"] else 0.0
        for e in range(geo.y_items):
            c = bind(geo.ycopy_lets(), {**env, "e": e})
            units[c["cd"]] = y[c["csrc"]: c["csrc"] + 8] if c["cok"] else 0.0
        for warp in range(geo.wp):
            lanes = [bind(geo.tap_lets(), bind(geo.warp_lets(), {"warp": warp, "lane": ln})) for ln in range(32)]
            kc = lanes[0]["wr"]
            while kc * 16 < head["npx"]:
                ch = [bind(geo.chunk_lets(), {**env, **le, "kc": kc}) for le in lanes]
                nb = _ldsm(units, [c["yu"] for c in ch], 2)
                b = np.concatenate(nb)  # B[k][n] = matrix k // 8's row k % 8
                for i in range(geo.tp):
                    m = _ldsm(units, [c["xb"] + c[f"to{i}"] if c["kin"] else geo.zrow for c in ch], 4)
                    a = np.zeros((16, 16))  # A[m][k] = matrix (m >= 8) + 2 (k >= 8), row k % 8, column m % 8
                    for q in range(4):
                        a[8 * (q & 1): 8 * (q & 1) + 8, 8 * (q >> 1): 8 * (q >> 1) + 8] = m[q].T
                    with np.errstate(invalid="ignore"):
                        d[warp][i] += a @ b
                kc += geo.reps
    red = np.full(geo.smem // 4, np.nan)
    for warp in range(geo.wp):
        for i in range(geo.tp):
            for ln in range(32):
                g, t = ln >> 2, ln & 3
                for j in range(4):
                    red[(warp * geo.tp * 4 + 4 * i + j) * 32 + ln] = d[warp][i][g + 8 * (j >> 1), 2 * t + (j & 1)]
    for e in range(geo.rs):
        c = bind(geo.sum_lets(), {**head, "e": e})
        if c["sok"]:
            assert np.isnan(part[c["sd"]]), "a partial written twice"
            part[c["sd"]] = sum(red[c["rd"] + r * geo.rs] for r in range(geo.reps))


@pytest.mark.parametrize("text, params", CASES, ids=[c[0] for c in CASES])
def test_block_model_equals_the_filter_gradient(text, params):
    """Every partial filter element written once, their fixed-order sum within float64 rounding of the
    float64 gradient of the same half values (no NaN of unwritten shared memory reaches a kept sum)."""
    geo = _geo(text, params)
    s, rng = geo.spec, np.random.default_rng(5)
    x = rng.standard_normal((s.n, s.c, s.h, s.w)).astype(np.float16).astype(np.float64)
    dy = rng.standard_normal((s.n, s.k, s.p, s.q)).astype(np.float16).astype(np.float64)
    total = s.k * s.cg * s.r * s.s
    part = np.full(geo.slices * total, np.nan)
    for bid in range(geo.blocks):
        _block(geo, bid, x.transpose(0, 2, 3, 1).reshape(-1), dy.transpose(0, 2, 3, 1).reshape(-1), part)
    assert not np.isnan(part).any(), f"{int(np.isnan(part).sum())} partial sums never written"
    got = part.reshape(geo.slices, s.k, s.cg, s.r, s.s).sum(axis=0)
    ref = _reference(s, x, dy)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-12, f"relative L2 {err:.2e}"


@pytest.mark.parametrize("text", [
    CASES[1][0], "N=1,C=32,H=20,W=41,K=32,R=3,S=3,stride=2,pad=1,groups=4,dtype=fp16,layout=nhwc,pass=wgrad",
                                  "N=2,C=32,H=20,W=40,K=32,R=3,S=3,pad=1,groups=8,dtype=fp16,layout=nhwc,pass=wgrad"])
def test_a_warps_ldmatrix_rows_meet_no_bank_twice_within_a_row(text):
    """Each A matrix whose 8 pixels lie in one output row reads 8 distinct 16-byte bank groups at every tap
    (stride 2 too: the column phases apart); matrices that wrap a row may meet one twice."""
    geo = _geo(text, None)
    env = {**bind(geo.head_lets(), {"bid": 0}), "n": 0, "bsel": 0}
    checked = 0
    for kc in range(geo.chunks):
        for ln0 in range(0, 32, 8):
            rows, groups = set(), {i: set() for i in range(geo.tp)}
            for ln in range(ln0, ln0 + 8):
                le = bind(geo.tap_lets(), bind(geo.warp_lets(), {"warp": 0, "lane": ln}))
                c = bind(geo.chunk_lets(), {**env, **le, "kc": kc})
                rows.add(c["apr"] if c["kin"] else -1)
                for i in range(geo.tp):
                    groups[i].add((c["xb"] + c[f"to{i}"]) % 8)
            if len(rows) == 1 and -1 not in rows:
                checked += 1
                for i, g in groups.items():
                    assert len(g) == 8, f"chunk {kc} matrix {ln0 // 8} tap pair {i}: banks {sorted(g)}"
    assert checked


def test_refusals():
    for text, why in [("N=1,C=96,H=8,W=8,K=96,R=3,S=3,pad=1,groups=2,dtype=fp16,layout=nhwc,pass=wgrad", "groups of"),
                      ("N=1,C=32,H=8,W=8,K=32,R=3,S=3,pad=1,groups=8,dtype=fp32,layout=nhwc,pass=wgrad", "float"),
                      ("N=1,C=32,H=8,W=8,K=32,R=3,S=3,pad=1,groups=8,dtype=fp16,pass=wgrad", "NHWC"),
                      ("N=1,C=32,H=9,W=9,K=32,R=3,S=3,stride=3,groups=8,dtype=fp16,layout=nhwc,pass=wgrad", "stride"),
                      ("N=1,C=32,H=8,W=8,K=32,R=7,S=7,pad=3,groups=8,dtype=fp16,layout=nhwc,pass=wgrad", "taps")]:
        spec = ConvSpec.parse(text)
        got = V.applies(spec, NOMINAL_CUDA)
        assert got and why.lower() in got.lower(), (text, got)


def test_compiles_without_spills():
    """ResNeXt-50's three narrow layers' defaults (stride 1 and 2, FP16 and BF16), a 5x5 and sampled points
    of a space, in one nvcc run."""
    sources = []
    for text in ["N=32,C=128,H=56,W=56,K=128,R=3,S=3,pad=1,groups=32,dtype=fp16,layout=nhwc,pass=wgrad",
                 "N=32,C=256,H=56,W=56,K=256,R=3,S=3,stride=2,pad=1,groups=32,dtype=fp16,layout=nhwc,pass=wgrad",
                 "N=32,C=512,H=28,W=28,K=512,R=3,S=3,stride=2,pad=1,groups=32,dtype=bf16,layout=nhwc,pass=wgrad",
                 "N=32,C=336,H=14,W=14,K=336,R=3,S=3,pad=1,groups=14,dtype=fp16,layout=nhwc,pass=wgrad",
                 "N=32,C=1024,H=14,W=14,K=1024,R=3,S=3,stride=2,pad=1,groups=32,dtype=fp16,layout=nhwc,pass=wgrad",
                 CASES[4][0]]:
        spec = ConvSpec.parse(text)
        space = V.space(spec, NOMINAL_CUDA)
        for p in space[:1] + space[1::max(1, len(space) // 2)]:
            plan = V.plan(spec, p, NOMINAL_CUDA)
            sources.append((f"{spec.short()} {p.short()}", render(list(plan.kernels), "cuda")))
    for label, info in zip((lb for lb, _ in sources), assert_sources_compile_clean(sources), strict=True):
        assert all(i.registers <= 128 for i in info), (label, info)
