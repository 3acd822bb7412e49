"""The paired strided dgrad (tensorcore/sm90/dgrad_paired.py) on the CPU: which column phases pair, what it
refuses, every GEMM emulated through the generator's own expressions against the float64 input gradient
(NCHW and NHWC dx, odd sizes), its filter step on PoCL, its kernels compiled for sm_90a without spills,
its NCHW stores as whole rows of a dx channel's column phases (vectors). On the GPU:
tests/test_gpu_tensorcore.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.dtypes import rounded, to_storage
from convforge.kernels import get_variant, ranked, select
from convforge.kernels.dgrad.strided import axes
from convforge.kernels.tensorcore.sm90.dgrad import phase_axes
from convforge.kernels.tensorcore.sm90.dgrad_paired import paired_phases, runs
from convforge.kernels.tensorcore.sm90.isa import BF16, F16
from convforge.kernels.tensorcore.sm90.prep import padded_channels
from convforge.kernels.tensorcore.sm90.tiles import TileConfig
from convforge.params import Params
from convforge.plan import Launch, Plan
from convforge.reference import dgrad_ref
from convforge.spec import ConvSpec
from helpers import sass_reports
from test_tensorcore_gen import _nhwc, emulate_gemm

NAME = "dgrad_tc_paired_half"


def _spec(n, c, h, w, k, r, stride, pad, dtype="float16", layout="nchw", s=None) -> ConvSpec:
    return ConvSpec.make(n, c, h, w, k, r, s or r, stride, pad, dtype=dtype, layout=layout, conv_pass="dgrad")


@pytest.mark.parametrize("r, stride, pad, w, want", [
    (2, 2, 0, 256, [2]),            # UNet's 2x2/2: one GEMM for both column phases
    (4, 4, 0, 32, [4]),             # 4x4/4: four
    (6, 2, 2, 64, [2]),             # 6x6/2, padding 2: both phases read dy columns from -1
    (16, 8, 4, 224, [4, 4]),        # FCN-8s' 16x16/8: two runs (first offsets -1 and 0)
    (4, 2, 1, 64, [1, 1]),          # 4x4/2, padding 1 (DCGAN, SD-VAE): the phases read different columns
    (2, 2, 0, 255, [1, 1]),         # an odd width: the sub-grids differ in width
    (1, 2, 0, 56, [1])])            # 1x1/2: the second column phase has no tap
def test_runs_of_column_phases(r, stride, pad, w, want):
    spec = _spec(1, 8, w, w, 8, r, stride, pad)
    assert [len(run) for run in runs(phase_axes(axes(spec)[1]))] == want


def test_auto_takes_it_where_it_applies_and_refusals():
    v = get_variant(NAME)
    assert not v.named_only
    unet = _spec(4, 64, 256, 256, 128, 2, 2, 0)
    assert v.applies(unet, NOMINAL_CUDA) is None
    assert ranked("auto", unet, NOMINAL_CUDA)[0].name == NAME
    assert ranked("auto", _spec(1, 64, 32, 32, 64, 4, 2, 1), NOMINAL_CUDA)[0].name == "dgrad_tc_strided_half"
    assert [x.name for x in select(NAME, unet, NOMINAL_CUDA)] == [NAME]
    assert "read the same dy columns" in v.applies(_spec(1, 64, 32, 32, 64, 4, 2, 1), NOMINAL_CUDA)
    assert v.applies(_spec(1, 64, 32, 32, 64, 2, 1, 0), NOMINAL_CUDA) is not None  # stride 1
    assert v.applies(dataclasses.replace(unet, dtype="float32"), NOMINAL_CUDA) is not None
    with pytest.raises(ValueError, match="il"):
        v.plan(unet, v.default(unet, NOMINAL_CUDA).replace(il=1), NOMINAL_CUDA)
    assert all(p["il"] == 0 for p in v.space(unet, NOMINAL_CUDA))


MN_UNET = TileConfig(128, 128, 1, 4, 2, tm=1, mn=1)  # dy in place on UNet's layers (GPU tier: test_gpu_tensorcore)


def emulate_paired(spec: ConvSpec, math, cfg: TileConfig, seed: int = 0):
    """dx from every paired GEMM (dy NHWC with Kp channels, each GEMM's B from the layer's definition by its
    rows and taps, D through its Output): (dx NCHW, the float64 reference, writes per element)."""
    v = get_variant(NAME)
    assert v.applies(spec, NOMINAL_CUDA) is None, v.applies(spec, NOMINAL_CUDA)
    rng = np.random.default_rng(seed)
    dy = rounded(rng.uniform(-1, 1, spec.y_shape).astype(np.float32), spec.dtype).astype(np.float64)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), spec.dtype).astype(np.float64)
    kp = padded_channels(spec.k, math)
    dx, written = np.zeros(spec.x_shape).ravel(), np.zeros(int(np.prod(spec.x_shape)), int)
    for ph in paired_phases(spec):
        if ph.empty:
            continue
        a, b = v.operands(spec, ph, cfg)
        prob = v.job_problem(spec, ph)
        g = len(ph.cols)
        if cfg.mn:  # dy as it lies, B MN-major: [K][ld] with B[k, row] = the tap's filter
            assert prob.n == g * spec.c == b.cols and kp == spec.k
            m = np.full((spec.k, b.ld), np.nan)
            for i, col in enumerate(ph.cols):
                (r, s), = [(r, s) for r in ph.ah.taps for s in col.taps]
                m[:, np.arange(spec.c) * g + i] = w[:, :, r, s]
            data = {"a": {"hi": dy.ravel()}, "b": {"hi": np.nan_to_num(m, nan=1e30).ravel()}}
            y, wr = emulate_gemm(cfg, math, prob, a, b, data, dataclasses.replace(ph.output(spec), slab=dx.size,
                                                                                    epi=None))
            dx += y
            written += wr
            continue
        assert prob.n == g * spec.c == b.rows
        m = np.zeros((b.rows, b.ld))
        for i, col in enumerate(ph.cols):
            for t, (r, s) in enumerate((r, s) for r in ph.ah.taps for s in col.taps):
                rows = np.arange(spec.c) * g + i if spec.layout == "nchw" else i * spec.c + np.arange(spec.c)
                m[rows, t * kp:t * kp + spec.k] = w[:, :, r, s].T
        data = {"a": {"hi": _nhwc(dy, kp)}, "b": {"hi": m.ravel()}}
        out = dataclasses.replace(ph.output(spec), slab=dx.size, epi=None)
        y, wr = emulate_gemm(cfg, math, prob, a, b, data, out)
        dx += y
        written += wr
    n, c, h, ww = spec.x_shape
    back = (lambda x: x.reshape(n, h, ww, c).transpose(0, 3, 1, 2)) if spec.layout == "nhwc" else \
        (lambda x: x.reshape(n, c, h, ww))
    return back(dx), dgrad_ref(dy, w, spec), back(written)


CASES = [(_spec(2, 5, 14, 10, 7, 2, 2, 0), F16, TileConfig(64, 32, 1, 2, 1)),                   # UNet-like, odd C, K
         (_spec(1, 8, 10, 18, 16, 2, 2, 0, "bfloat16", "nhwc"), BF16, TileConfig(64, 32, 1, 2, 1)),
         (_spec(1, 3, 12, 8, 5, 4, 4, 0), F16, TileConfig(64, 32, 1, 2, 1)),                     # four phases a run
         (_spec(1, 6, 10, 12, 9, 6, 2, 2, "bfloat16"), BF16, TileConfig(64, 32, 1, 2, 1)),       # three taps a side
         (_spec(1, 3, 24, 16, 5, 16, 8, 4, "float16", "nhwc"), F16, TileConfig(64, 32, 1, 2, 1)),  # FCN-like runs
         # by TMA (K whole 64-element atoms), both layouts
         (_spec(2, 6, 10, 14, 64, 2, 2, 0), F16, TileConfig(64, 32, 1, 2, 1, tm=1)),
         (_spec(1, 24, 12, 10, 64, 4, 4, 0, "bfloat16", "nhwc"), BF16, TileConfig(64, 64, 1, 2, 1, tm=1)),
         # 3x2, padding 1 on the rows only: row phases of 1 and 2 taps, N = 3, asymmetric padding
         (_spec(3, 7, 9, 8, 6, 3, 2, (1, 1, 0, 0), "float16", "nchw", s=2), F16, TileConfig(64, 32, 1, 2, 1)),
         # mn=1: an NCHW dy read as it lies (MN-major tiles of one image's 64 pixels, K rows; a K tail past 64),
         # odd C (B's columns past g C never stored), two images' tiles; 4x4/4's runs of four
         (_spec(2, 5, 16, 16, 72, 2, 2, 0), F16, TileConfig(64, 64, 1, 2, 1, tm=1, mn=1)),
         (_spec(3, 40, 16, 32, 64, 2, 2, 0, "bfloat16"), BF16, TileConfig(128, 64, 1, 2, 2, tm=1, mn=1)),
         (_spec(1, 6, 32, 32, 16, 4, 4, 0), F16, TileConfig(64, 64, 1, 2, 1, tm=1, mn=1))]


@pytest.mark.parametrize("spec, math, cfg", CASES, ids=lambda v: v.short() if hasattr(v, "short") else None)
def test_emulated_paired_dgrad_equals_the_input_gradient(spec, math, cfg):
    """Every dx element written exactly once (no zero step here: every phase has a tap), equal to the float64
    input gradient of the same rounded operands."""
    assert not cfg.tm or get_variant(NAME).tma_reason(spec, cfg) is None  # TMA cases: the maps the plan would use
    got, ref, written = emulate_paired(spec, math, cfg)
    assert (written == 1).all(), np.unique(written)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def _run_pack(ocl, spec: ConvSpec, kern, grid, dsts: list[tuple[str, int, int]], w: np.ndarray):
    """The filter step on PoCL, each destination (rows x ld) NaN-poisoned; read back as float32."""
    kern = dataclasses.replace(kern, requires=frozenset())
    names = tuple(d for d, _, _ in dsts)
    plan = Plan("step", "test", spec, Params(), (kern,), (Launch(kern.name, grid, kern.block, ("w",) + names),), (),
                0.0)
    bufs = {"w": ocl.upload(to_storage(w, spec.dtype))}
    for d, ld, rows in dsts:
        bufs[d] = ocl.upload(to_storage(np.full((rows, ld), np.nan, np.float32), spec.dtype))
    ocl.executable(plan)(bufs)
    ocl.synchronize()
    return [ocl.download(bufs[d], (rows, ld), spec.dtype) for d, ld, rows in dsts]


@pytest.mark.parametrize("spec", [CASES[0][0], CASES[1][0], CASES[4][0]], ids=lambda s: s.short())
def test_paired_filters_on_pocl(ocl, spec):
    """The filter step writes each GEMM's B rows (c g + i in NCHW, i C + c in NHWC) with the phase's taps, zeros
    for k >= K and past the taps, every element of every destination."""
    v, cfg = get_variant(NAME), TileConfig(64, 32, 1, 2, 1)
    kp = v._kp(spec)
    packs = [(ph, v._ld(spec, ph, cfg), f"wph{ph.tag}") for ph in paired_phases(spec) if not ph.empty]
    kern, grid = v.pack_step(spec, packs)
    w = rounded(np.random.default_rng(4).uniform(-2, 2, spec.w_shape).astype(np.float32), spec.dtype)
    got = _run_pack(ocl, spec, kern, grid, [(d, ld, v._b_rows(spec, ph)) for ph, ld, d in packs], w)
    for (ph, ld, _), g in zip(packs, got, strict=True):
        want = np.zeros((v._b_rows(spec, ph), ld), np.float32)
        n = len(ph.cols)
        for i, col in enumerate(ph.cols):
            rows = np.arange(spec.c) * n + i if spec.layout == "nchw" else i * spec.c + np.arange(spec.c)
            for t, (r, s) in enumerate((r, s) for r in ph.ah.taps for s in col.taps):
                want[rows, t * kp:t * kp + spec.k] = w[:, :, r, s].T
        np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize("spec", [_spec(2, 5, 16, 16, 72, 2, 2, 0), _spec(1, 100, 32, 32, 40, 4, 4, 0, "bfloat16")],
                         ids=["2x2s2-odd-c", "4x4s4-two-c-tiles"])
def test_mn_filters_on_pocl(ocl, spec):
    """mn=1's filter step: each GEMM's B MN-major, row k of the tap holding column c g + i = w[k, c, r, s],
    written with c fastest; columns past g C (16-byte row padding) left as they were (NaN here)."""
    v, cfg = get_variant(NAME), TileConfig(64, 64, 1, 2, 1, tm=1, mn=1)
    assert v.mn_reason(spec) is None
    packs = [(ph, v._ld(spec, ph, cfg), f"wph{ph.tag}") for ph in paired_phases(spec) if not ph.empty]
    kern, grid = v.pack_step(spec, packs, cfg)
    w = rounded(np.random.default_rng(6).uniform(-2, 2, spec.w_shape).astype(np.float32), spec.dtype)
    got = _run_pack(ocl, spec, kern, grid, [(d, ld, spec.k) for _, ld, d in packs], w)
    for (ph, ld, _), g in zip(packs, got, strict=True):
        n = len(ph.cols)
        want = np.full((spec.k, ld), np.nan, np.float32)
        for i, col in enumerate(ph.cols):
            (r, s), = [(r, s) for r in ph.ah.taps for s in col.taps]
            want[:, np.arange(spec.c) * n + i] = w[:, :, r, s]
        np.testing.assert_array_equal(g, want)


def test_mn_refusals():
    """mn=1 only where each GEMM's A is dy itself, in NCHW, whole 64-pixel blocks of an image."""
    v = get_variant(NAME)
    assert "NCHW only" in v.mn_reason(_spec(2, 5, 16, 16, 72, 2, 2, 0, layout="nhwc"))
    assert "64-pixel" in v.mn_reason(_spec(2, 5, 14, 10, 72, 2, 2, 0))
    assert "16-byte" in v.mn_reason(_spec(2, 5, 16, 16, 7, 2, 2, 0))
    assert "one tap" in v.mn_reason(_spec(1, 6, 16, 16, 16, 6, 2, 2))
    with pytest.raises(ValueError, match="mn=1"):
        v.plan(_spec(2, 5, 14, 10, 72, 2, 2, 0), TileConfig(64, 64, 1, 2, 1, tm=1, mn=1).params().replace(il=0),
               NOMINAL_CUDA)


@pytest.mark.parametrize("spec, run, unit", [(_spec(4, 64, 256, 256, 128, 2, 2, 0), True, 8),
                                             (_spec(2, 5, 14, 10, 7, 2, 2, 0), False, 2),
                                             (_spec(1, 3, 24, 16, 5, 16, 8, 4), False, 4)],
                         ids=["unet-rows-of-8", "odd-pairs", "fcn-runs-of-4"])
def test_nchw_stores_are_vectors(spec, run, unit):
    """NCHW dx: a dx channel's g column phases stored together; 4 rows of 2x2/2 as one run of 8 halves
    (16 bytes) where the sub-grid's rows hold whole quads, else each row's g values (4 or 8 bytes)."""
    v = get_variant(NAME)
    outs = [ph.output(spec) for ph in v._phases(spec) if not ph.empty]
    assert outs and all(o.pairs and o.pair_units() == (run, unit) for o in outs)
    src = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA).source("cuda")
    store = {8: "*(uint4*)(x + ", 4: "*(uint2*)(x + ", 2: "*(unsigned*)(x + "}[unit]
    assert store in src and "x[o0] =" not in src


def test_paired_plans_compile_without_spills(nvcc_ok):
    """UNet's widest up-convolution (N4, 128 -> 64 at 256²) at the default in NCHW FP16 and NHWC BF16,
    FCN-8s' head, and the UNet layer with dy read in place (mn=1, 3-D tiled copies): sm_90a without
    spills, HGMMA in the GEMM's SASS."""
    v = get_variant(NAME)
    specs = [_spec(4, 64, 256, 256, 128, 2, 2, 0), _spec(4, 64, 256, 256, 128, 2, 2, 0, "bfloat16", "nhwc"),
             _spec(8, 21, 224, 224, 21, 16, 8, 4), _spec(4, 64, 256, 256, 128, 2, 2, 0)]
    params = [v.default(s, NOMINAL_CUDA) for s in specs[:3]] + [MN_UNET.params().replace(il=0)]
    sources = [v.plan(s, p, NOMINAL_CUDA).source("cuda") for s, p in zip(specs, params, strict=True)]
    assert "cp.async.bulk.tensor.3d" in sources[3] and "_dy(" not in sources[3]
    for spec, (infos, sass) in zip(specs, sass_reports(sources), strict=True):
        assert infos and all(i.spill_stores == 0 and i.spill_loads == 0 for i in infos), (spec.short(), infos)
        assert "HGMMA" in sass, spec.short()
