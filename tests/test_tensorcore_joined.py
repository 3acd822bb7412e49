"""dgrad_tc_strided_half with its column phases joined in registers (``jn=1``): on an NCHW half dx at
column stride 2, block b takes tile b of phase (ph, 0), holds it as packed halves, then tile b of
(ph, 1), and stores both as each dx row's pairs: no phase buffers, no interleave pass.

CPU checks: the joined Output puts every element where each phase's own sub-grid Output would; the
joined staging is the paired layout (channel c's phases at columns 2 c, 2 c + 1), every slot once;
the jobs, emulated with the parked tile rounded, give the float64 input gradient with every dx element
written once; the refusals; the GEMM compiles without spills. The GPU tier
(tests/test_gpu_tensorcore.py ``-k joined``) runs the plans against float64.

``mn=1`` on the same variant (by params only: not yet run on a GPU): the NCHW dy read as it lies, each
phase's A a 4-D tiled TMA box of 64 pixels of one dy row at the tap's offset (``MnPlanes``: zeros
outside the plane), B the filters MN-major; emulated here with and without the joined stores.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.render import render
from convforge.dtypes import rounded
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm90 import epilogue
from convforge.kernels.tensorcore.sm90.cexpr import evaluate
from convforge.kernels.tensorcore.sm90.dgrad import phases
from convforge.kernels.tensorcore.sm90.isa import ACC, BF16, F16
from convforge.kernels.tensorcore.sm90.prep import padded_channels
from convforge.kernels.tensorcore.sm90.tiles import TileConfig
from convforge.reference import dgrad_ref
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean
from test_tensorcore_gen import _nhwc, emulate_gemm

NAME = "dgrad_tc_strided_half"


def _spec(n, c, h, w, k, r, pad, dtype="float16", layout="nchw") -> ConvSpec:
    return dataclasses.replace(ConvSpec.make(n, c, h, w, k, r, r, 2, pad, dtype=dtype, layout=layout),
                               conv_pass="dgrad")


def _params(cfg: TileConfig):
    return cfg.params().replace(il=0, jn=1)


CASES = [(_spec(2, 5, 12, 10, 7, 4, 1), F16, TileConfig(64, 32, 1, 2, 1, ps=0)),          # DCGAN-like, odd C, K
         (_spec(3, 6, 8, 14, 9, 3, 1, "bfloat16"), BF16, TileConfig(64, 64, 1, 2, 1, ps=0)),  # 3x3/2: 1 and 2 taps
         (_spec(1, 40, 16, 16, 64, 4, 1), F16, TileConfig(128, 32, 1, 2, 2, ps=0, tm=1))]   # by TMA, 2 consumers


@pytest.mark.parametrize("spec, math, cfg", CASES[:2], ids=lambda v: v.short() if hasattr(v, "short") else None)
def test_joined_output_maps_each_phase_where_its_own_would(spec, math, cfg):
    v = get_variant(NAME)
    for ph0, ph1 in zip(phases(spec)[::2], phases(spec)[1::2], strict=True):
        joined = v.store(spec, ph1, False, True)
        assert joined.joined and joined.pairs and v.store(spec, ph0, False, True).park
        own = [ph0.output(spec), ph1.output(spec)]
        for m, c, i in itertools.product(range(0, joined.m, 7), range(spec.c), range(2)):
            env = {"m": m, "z": 0}
            assert evaluate(joined.offset("m", "k", "z"), {**env, "k": 2 * c + i}) == \
                evaluate(own[i].offset("m", "k", "z"), {**env, "k": c})


@pytest.mark.parametrize("bn", [32, 64, 128])
def test_joined_staging_is_the_paired_layout(bn):
    """Every accumulator of both phases lands once in its chunk, at column 2 (channel - 16 ch) + phase
    and its fragment row: the paired read-out (``_pair_items``) then reads channel c's two phases."""
    ld = epilogue.staging_ld(1)
    for ch, _ in epilogue.chunks(1, 2 * bn):
        seen = set()
        for wq, lane, i, phase in itertools.product(range(4), range(32), range(bn // 2), range(2)):
            slot = epilogue.joined_write(ld, 0, i, ch, phase)
            env = {"wq": wq, "g": lane >> 2, "t": lane & 3}
            row, col = ACC.coords(wq, lane, i)
            if col // 16 != ch:
                assert slot is None
                continue
            at = evaluate(slot, env)
            assert (at // ld, at % ld) == (2 * (col - 16 * ch) + phase, row) and at not in seen
            seen.add(at)
        assert len(seen) == 64 * min(32, 2 * bn - 32 * ch)


def emulate_joined(spec: ConvSpec, math, cfg: TileConfig, seed: int = 0, joined: bool = True):
    """dx from the plan's jobs: each phase's GEMM (dy NHWC, or NCHW as it lies with ``cfg.mn``; B from the
    layer's definition) stored by its own sub-grid Output, column phase 0's values rounded to the dtype
    first where ``joined`` (its parked halves)."""
    v = get_variant(NAME)
    assert not joined or v.jn_reason(spec, cfg) is None, v.jn_reason(spec, cfg)
    rng = np.random.default_rng(seed)
    dy = rounded(rng.uniform(-1, 1, spec.y_shape).astype(np.float32), spec.dtype).astype(np.float64)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), spec.dtype).astype(np.float64)
    kp = padded_channels(spec.k, math)
    dx, written = np.zeros(int(np.prod(spec.x_shape))), np.zeros(int(np.prod(spec.x_shape)), int)
    for ph in phases(spec):
        a, b = v.operands(spec, ph, cfg)
        if cfg.mn:  # B [taps K][ld]: row t K + k, column c
            m = np.full((len(ph.taps()) * spec.k, b.ld), 1e30)
            for t, (r, s) in enumerate(ph.taps()):
                m[t * spec.k:(t + 1) * spec.k, :spec.c] = w[:, :, r, s]
            data = {"a": {"hi": dy.ravel()}, "b": {"hi": m.ravel()}}
        else:
            m = np.zeros((b.rows, b.ld))
            for t, (r, s) in enumerate(ph.taps()):
                m[:, t * kp:t * kp + spec.k] = w[:, :, r, s].T
            data = {"a": {"hi": _nhwc(dy, kp)}, "b": {"hi": m.ravel()}}
        out = dataclasses.replace(ph.output(spec), slab=dx.size, epi=None)
        y, wr = emulate_gemm(cfg, math, v.job_problem(spec, ph), a, b, data, out)
        if joined and ph.aw.ph == 0:
            y = rounded(y.astype(np.float32), spec.dtype).astype(np.float64)
        dx += y
        written += wr
    return dx.reshape(spec.x_shape), dgrad_ref(dy, w, spec), written


@pytest.mark.parametrize("spec, math, cfg", CASES, ids=lambda v: v.short() if hasattr(v, "short") else None)
def test_emulated_joined_dgrad_equals_the_input_gradient(spec, math, cfg):
    v = get_variant(NAME)
    plan = v.plan(spec, _params(cfg), NOMINAL_CUDA)
    names = [k.name for k in plan.kernels]
    assert not any("interleave" in n or "zero" in n for n in names)
    assert not any(name.startswith("dph") for name, _ in plan.workspace)
    gemm = next(k for k in plan.kernels if k.name.endswith("_gemm"))
    assert "pk0_0 = " in gemm.body and gemm.body.count("TC_PACK") >= cfg.bn // 4
    dx, ref, written = emulate_joined(spec, math, cfg)
    assert (written == 1).all()
    err = np.linalg.norm(dx - ref) / np.linalg.norm(ref)
    assert err < 2e-3, err  # the parked halves' rounding; the tiles' sums are exact


def _spec_x2(n, c, h, w, k, r, dtype="float16") -> ConvSpec:
    """An NCHW dgrad of an r x 2 filter at stride 2, rows padded by 1: every phase's one column tap reads dy
    at column offset 0 (mn=1's TMA boxes need 16-byte aligned column starts)."""
    return dataclasses.replace(ConvSpec.make(n, c, h, w, k, r, 2, 2, (1, 1, 0, 0), dtype=dtype, layout="nchw"),
                               conv_pass="dgrad")


MN_CASES = [(_spec_x2(1, 8, 4, 128, 64, 4), F16, TileConfig(64, 64, 1, 2, 1, ps=0, tm=1, mn=1)),  # 4x2/2, dy 2 x 64
            (_spec_x2(2, 5, 6, 128, 64, 3, "bfloat16"), BF16, TileConfig(64, 64, 1, 2, 1, ps=0, tm=1, mn=1))]


@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.parametrize("spec, math, cfg", MN_CASES, ids=lambda v: v.short() if hasattr(v, "short") else None)
def test_emulated_dy_in_place(spec, math, cfg, joined):
    """``mn=1``: no dy step in the plan, every phase's A a 4-D box per tap (rows above and below the plane
    and columns past its edges zero-filled), dx equal to float64, every element written once."""
    v = get_variant(NAME)
    assert v.mn_reason(spec) is None and v.tma_reason(spec, cfg) is None
    plan = v.plan(spec, cfg.params().replace(il=0, jn=int(joined)), NOMINAL_CUDA)
    assert not any(k.name.endswith("_dy") for k in plan.kernels) and "dyh" not in dict(plan.workspace)
    gemm = next(k for k in plan.kernels if k.name.endswith("_gemm"))
    assert "TMA_TILE_4D(" in gemm.body
    dx, ref, written = emulate_joined(spec, math, cfg, joined=joined)
    assert (written == 1).all()
    err = np.linalg.norm(dx - ref) / np.linalg.norm(ref)
    assert err < (2e-3 if joined else 1e-12), err


def test_mn_refusals():
    v = get_variant(NAME)
    spec = MN_CASES[0][0]
    assert "NCHW" in v.mn_reason(dataclasses.replace(spec, layout="nhwc"))
    assert "K (40)" in v.mn_reason(dataclasses.replace(spec, k=40))
    assert "64-pixel" in v.mn_reason(_spec_x2(1, 8, 4, 96, 64, 4))
    assert "16-byte" in v.mn_reason(_spec(1, 8, 4, 128, 64, 4, 1))  # 4x4/2: taps one column apart
    assert "16-bit" in get_variant("dgrad_tc_strided_3xtf32").mn_reason(dataclasses.replace(spec, dtype="float32"))
    with pytest.raises(ValueError, match="mn"):
        v.plan(dataclasses.replace(spec, k=40), MN_CASES[0][2].params().replace(il=0), NOMINAL_CUDA)


def test_refusals():
    v = get_variant(NAME)
    spec, cfg = CASES[0][0], CASES[0][2]
    with pytest.raises(ValueError, match="il"):
        v.plan(spec, _params(cfg).replace(il=1), NOMINAL_CUDA)
    with pytest.raises(ValueError, match="jn"):
        v.plan(spec, _params(cfg).replace(jn=2), NOMINAL_CUDA)
    assert "NCHW" in v.jn_reason(dataclasses.replace(spec, layout="nhwc"), cfg)
    assert "ps=0" in v.jn_reason(spec, dataclasses.replace(cfg, ps=1))
    assert "64-row" in v.jn_reason(spec, TileConfig(256, 64, 1, 2, 2, ps=0))
    assert "sub-grids differ" in v.jn_reason(_spec(1, 5, 12, 11, 7, 4, 1), cfg)  # odd width
    assert "column stride" in v.jn_reason(dataclasses.replace(spec, stride=(2, 4)), cfg)
    assert "paired" in get_variant("dgrad_tc_paired_half").jn_reason(spec, cfg)
    assert "16-bit" in get_variant("dgrad_tc_strided_3xtf32").jn_reason(dataclasses.replace(spec, dtype="float32"),
                                                                         cfg)


def test_joined_gemms_compile_without_spills(nvcc_ok):
    """DCGAN 128@16 and SD-VAE 512@64's layers (FP16, BF16) with 128 x 128 and 128 x 64 tiles; a 4x2/2 layer
    as wide as SD-VAE's with dy read in place (mn=1, four stages)."""
    v, sources = get_variant(NAME), []
    sdvae = "N=1,C=512,H=128,W=128,K=512"
    for text, dtype, cfg in list(itertools.product(
            ["N=128,C=64,H=32,W=32,K=128", sdvae], ["float16", "bfloat16"],
            [TileConfig(128, 128, 1, 4, 2, ps=0, tm=1), TileConfig(128, 64, 1, 6, 2, ps=0, tm=1)])) + \
            [("4x2", "float16", TileConfig(128, 128, 1, 4, 2, ps=0, tm=1, mn=1))]:
        spec = _spec_x2(1, 512, 128, 128, 512, 4) if text == "4x2" else \
            ConvSpec.parse(f"{text},R=4,S=4,stride=2,pad=1,pass=dgrad,layout=nchw,dtype={dtype}")
        plan = v.plan(spec, _params(cfg), NOMINAL_CUDA)
        sources.append((f"{text} {dtype} {cfg.params().short()}",
                        render([k for k in plan.kernels if k.name.endswith("_gemm")], "cuda")))
    assert_sources_compile_clean(sources)
