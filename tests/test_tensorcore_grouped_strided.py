"""Strided dgrad of grouped half layers on the wgmma generator (kernels/tensorcore/sm90/dgrad_grouped.py), on the
CPU: every phase's batched GEMM tile by tile through the generator's own expressions (test_tensorcore_gen.
emulate_gemm) against the float64 input gradient, the block-diagonal phase filters' step on PoCL, the plans
compiled by nvcc, what ``applies`` refuses, and that ``auto`` never takes the variant (no GPU has run it)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.dtypes import rounded, to_storage
from convforge.kernels import get_variant, ranked, select
from convforge.kernels.tensorcore.sm90.dgrad import _pack_tiles, phases
from convforge.kernels.tensorcore.sm90.dgrad_grouped import pack
from convforge.kernels.tensorcore.sm90.isa import BF16, F16
from convforge.kernels.tensorcore.sm90.tiles import TileConfig
from convforge.params import Params
from convforge.plan import Launch, Plan
from convforge.reference import dgrad_ref
from convforge.spec import ConvSpec
from helpers import sass_reports
from test_tensorcore_gen import DTYPE_OF, _nhwc, _phase_mask, emulate_gemm

NAME = "dgrad_tc_strided_grouped_half"


def _dgrad(n, c, h, w, k, r, stride, pad, groups, layout="nchw", dil=1) -> ConvSpec:
    return ConvSpec.make(n, c, h, w, k, r, r, stride, pad, dil, groups=groups, layout=layout, conv_pass="dgrad")


# odd grouped layers: N = 1, prime sizes, stride 2 and 4 (and (4, 2)), asymmetric padding, dilation, groups of
# 8, 16, 32 and 64 channels (packed 8, 4, 2 and 1 to a GEMM group), Cg != Kg, a 1x1 layer with empty phases
CASES = [
    (_dgrad(1, 64, 13, 11, 64, 3, 2, (1, 0, 2, 1), 8, "nhwc"), F16, TileConfig(64, 64, 1, 2, 1), False),   # Cg 8
    (_dgrad(2, 64, 7, 9, 64, 3, 2, 1, 4), BF16, TileConfig(64, 32, 1, 2, 1), True),                     # Cg 16
    (_dgrad(1, 128, 11, 7, 128, 3, 2, 1, 4, "nhwc"), BF16, TileConfig(64, 64, 1, 3, 1), True),          # Cg 32
    (_dgrad(1, 128, 13, 13, 128, 3, 4, (2, 1, 0, 3), 2, "nhwc"), F16, TileConfig(64, 64, 2, 2, 1), False),  # Cg 64
    (_dgrad(1, 32, 17, 13, 32, 5, (4, 2), (3, 1, 2, 2), 4, dil=2), F16, TileConfig(64, 32, 1, 2, 1), False),
    (_dgrad(1, 48, 11, 13, 24, 3, 2, (0, 2, 1, 0), 3, "nhwc"), BF16, TileConfig(64, 64, 1, 2, 1), False),  # 16 <- 8
    (_dgrad(2, 32, 9, 7, 32, 1, 2, 0, 2), F16, TileConfig(64, 32, 1, 2, 1), False),          # 1x1: 3 empty phases
    (_dgrad(1, 32, 9, 11, 32, 3, 2, 1, 8, "nhwc"), BF16, TileConfig(64, 32, 1, 2, 1), True),  # Cg 4, packed 8: 32
]


def block_diagonal_phase(w: np.ndarray, spec: ConvSpec, taps: list[tuple[int, int]], ld: int) -> np.ndarray:
    """A phase's B as the filter step should write it, built from the layer's definition: dx channel c of group z
    (packed group z / P, place b = z % P in it) holds at tap t the filters w[z Kg + j, c % Cg, r_t, s_t] at
    t P Kg + b Kg + j, zeros elsewhere."""
    p, cg, kg = pack(spec), spec.cg, spec.kg
    out = np.zeros((spec.c, ld))
    for z in range(spec.groups):
        b = z % p
        for t, (r, s) in enumerate(taps):
            col = t * p * kg + b * kg
            out[z * cg:(z + 1) * cg, col:col + kg] = w[z * kg:(z + 1) * kg, :, r, s].T
    return out


def _nchw(flat: np.ndarray, spec: ConvSpec) -> np.ndarray:
    """A flat dx in the layer's layout as NCHW."""
    n, c, h, w = spec.x_shape
    return flat.reshape(n, h, w, c).transpose(0, 3, 1, 2) if spec.layout == "nhwc" else flat.reshape(n, c, h, w)


def emulate(spec: ConvSpec, math, cfg: TileConfig, il: bool, seed: int = 0):
    """Every phase's batched GEMM of the plan: dy NHWC (K channels, as read in place or converted), each phase's
    block-diagonal filters, D through the variant's own Output (dx's sub-grid, or the phase buffer placed by its
    interleave Part). Returns (dx NCHW, reference, writes per element, mask of the phases no tap reaches)."""
    v = get_variant(NAME)
    spec = dataclasses.replace(spec, dtype=DTYPE_OF[math.name])
    assert v.applies(spec, NOMINAL_CUDA) is None, v.applies(spec, NOMINAL_CUDA)
    nhwc = spec.layout == "nhwc"
    rng = np.random.default_rng(seed)
    dy = rounded(rng.uniform(-1, 1, spec.y_shape).astype(np.float32), spec.dtype).astype(np.float64)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), spec.dtype).astype(np.float64)
    n, c, h, wd = spec.x_shape
    dx, written, empty = np.zeros((n, c, h, wd)), np.zeros((n, c, h, wd), int), np.zeros((n, c, h, wd), bool)
    for ph in phases(spec):
        if ph.empty:
            empty[:, :, ph.ah.ph::spec.stride[0], ph.aw.ph::spec.stride[1]] = True
            continue
        a, b = v.operands(spec, ph, cfg)
        prob = v.job_problem(spec, ph)
        assert not cfg.problems(math, prob), cfg.problems(math, prob)
        taps = [(r, s) for r in ph.ah.taps for s in ph.aw.taps]
        data = {"a": {"hi": _nhwc(dy, spec.k)}, "b": {"hi": block_diagonal_phase(w, spec, taps, b.ld).ravel()}}
        out = dataclasses.replace(v.store(spec, ph, il), epi=None)
        if not il:
            y, wr = emulate_gemm(cfg, math, prob, a, b, data, out, size=dx.size)
            dx += _nchw(y, spec)
            written += _nchw(wr, spec)
            continue
        part = ph.part()
        y, wr = emulate_gemm(cfg, math, prob, a, b, data, out, size=part.elements(spec))
        assert (wr == 1).all(), "every element of a phase buffer written once"
        y = y.reshape(n, part.bh, part.bw, c).transpose(0, 3, 1, 2) if nhwc else y.reshape(n, c, part.bh, part.bw)
        dx[:, :, part.ph::spec.stride[0], part.pw::spec.stride[1]] += y
        written += _phase_mask(spec, part)  # the interleave places each buffer element once
    return dx, dgrad_ref(dy, w, spec), written, empty


def _id(v) -> str:
    if isinstance(v, bool):
        return "interleaved" if v else "direct"
    return v.short() if isinstance(v, ConvSpec) else getattr(v, "name", None) or v.params().short()


@pytest.mark.parametrize("spec, math, cfg, il", CASES, ids=_id)
def test_emulated_grouped_strided_dgrad_equals_the_input_gradient(spec, math, cfg, il):
    """Each phase's GEMM group reads only its own groups' dy channels and block-diagonal filters and lands on its
    own dx channels of the phase's sub-grid: the float64 input gradient, every dx element written once but for
    the phases no tap reaches (the zero step's, which never see a write)."""
    got, ref, written, empty = emulate(spec, math, cfg, il)
    assert (written[~empty] == 1).all() and (written[empty] == 0).all(), np.unique(written)
    assert (ref[empty] == 0).all()
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_groups_pack_into_64_columns():
    """ResNeXt's stride-2 grouped layers (32 groups of 8, 16, 32 channels) pack 8, 4 and 2 groups to a GEMM group
    of 64 dx channels; 64-channel groups and prime group counts stay unpacked."""
    assert [pack(_dgrad(32, 32 * cg, 28, 28, 32 * cg, 3, 2, 1, 32)) for cg in (8, 16, 32, 64)] == [8, 4, 2, 1]
    assert pack(_dgrad(2, 120, 28, 28, 120, 3, 2, 1, 5)) == 1  # RegNet: 5 groups of 24


def _run_pack_on_pocl(ocl, spec: ConvSpec, kern, grid, dsts: list[tuple[str, int]], w: np.ndarray):
    """The filter step on PoCL, its destinations NaN-poisoned; each destination (C x ld) as float32."""
    kern = dataclasses.replace(kern, requires=frozenset())
    names = tuple(d for d, _ in dsts)
    plan = Plan("step", "test", spec, Params(), (kern,), (Launch(kern.name, grid, kern.block, ("w",) + names),), (),
                0.0)
    bufs = {"w": ocl.upload(to_storage(w, spec.dtype))}
    for d, ld in dsts:
        bufs[d] = ocl.upload(to_storage(np.full((spec.c, ld), np.nan, np.float32), spec.dtype))
    ocl.executable(plan)(bufs)
    ocl.synchronize()
    return [ocl.download(bufs[d], (spec.c, ld), spec.dtype) for d, ld in dsts]


@pytest.mark.parametrize("spec", [CASES[0][0], CASES[5][0], CASES[3][0]], ids=lambda s: s.short())
def test_block_diagonal_phase_filters_on_pocl(ocl, spec):
    """The variant's filter step (dgrad.pack_phases with ``block``) writes every phase's block-diagonal filters
    exactly as the emulation's B (each row's Kg filters at its group's place in the packed group, zeros
    elsewhere and past the taps), every element of each destination written."""
    spec = dataclasses.replace(spec, dtype="float16")
    v, cfg = get_variant(NAME), TileConfig(64, 64, 1, 2, 1)
    packs = [(ph, v._ld(spec, ph, cfg), f"wph{ph.tag}") for ph in phases(spec) if not ph.empty]
    kern, grid = v.pack_step(spec, packs)
    w = np.random.default_rng(3).uniform(-2, 2, spec.w_shape).astype(np.float16).astype(np.float32)
    got = _run_pack_on_pocl(ocl, spec, kern, grid, [(d, ld) for _, ld, d in packs], w)
    for (ph, ld, _), g in zip(packs, got, strict=True):
        taps = [(r, s) for r in ph.ah.taps for s in ph.aw.taps]
        np.testing.assert_array_equal(g, block_diagonal_phase(w.astype(np.float64), spec, taps, ld))


@pytest.mark.parametrize("why, spec", [
    ("groups > 1", _dgrad(2, 32, 9, 9, 32, 3, 2, 1, 1)),
    ("stride 1", _dgrad(2, 64, 9, 9, 64, 3, 1, 1, 4)),
    ("depthwise", _dgrad(2, 32, 9, 9, 32, 3, 2, 1, 32)),
    ("not whole 8-channel chunks", _dgrad(2, 12, 9, 9, 12, 3, 2, 1, 3)),     # 3 groups of 4: no pack makes 8
    ("not whole 8-channel chunks", _dgrad(2, 60, 9, 9, 60, 3, 2, 1, 5)),     # 5 groups of 12
    ("float16", dataclasses.replace(_dgrad(2, 64, 9, 9, 64, 3, 2, 1, 4), dtype="float32"))])
def test_grouped_strided_dgrad_refuses_what_it_cannot_run(why, spec):
    if spec.dtype == "float32":
        assert get_variant(NAME).applies(spec, NOMINAL_CUDA) is not None
        return
    spec = dataclasses.replace(spec, dtype="float16")
    assert why in (get_variant(NAME).applies(spec, NOMINAL_CUDA) or ""), get_variant(NAME).applies(spec, NOMINAL_CUDA)


RESNEXT = [_dgrad(32, 256, 56, 56, 256, 3, 2, 1, 32), _dgrad(32, 512, 28, 28, 512, 3, 2, 1, 32),
           _dgrad(32, 1024, 14, 14, 1024, 3, 2, 1, 32)]


def test_auto_takes_it_on_resnext_strided_layers():
    """In 'auto' (1.72-1.80x cuDNN-best FP16 on the H200): the only half dgrad of ResNeXt's stride-2 grouped
    layers, so auto ranks it first there."""
    v = get_variant(NAME)
    assert not v.named_only and v.grouped
    for spec in RESNEXT:
        for dtype, layout in (("float16", "nhwc"), ("bfloat16", "nchw")):
            s = dataclasses.replace(spec, dtype=dtype, layout=layout)
            assert v.applies(s, NOMINAL_CUDA) is None
            assert [x.name for x in ranked("auto", s, NOMINAL_CUDA)][:1] == [NAME]
            assert [x.name for x in select(NAME, s, NOMINAL_CUDA)] == [NAME]


def test_grouped_strided_dgrad_plans_compile_without_spills(nvcc_ok):
    """ResNeXt-50's stride-2 grouped 3x3 dgrads (and RegNetY's 5 groups of 24, unpacked) at their defaults (dy's
    conversion on NCHW, the filter step, the phases' GEMM, the interleave on NCHW): sm_90a without spills, HGMMA
    in the GEMM's SASS (one nvcc + cuobjdump run for the four, helpers.sass_reports)."""
    v = get_variant(NAME)
    specs = [dataclasses.replace(spec, dtype=dtype, layout=layout)
             for spec, dtype, layout in [(RESNEXT[0], "float16", "nhwc"), (RESNEXT[1], "bfloat16", "nchw"),
                                         (RESNEXT[2], "float16", "nhwc"),
                                         (_dgrad(32, 120, 56, 56, 120, 3, 2, 1, 5), "bfloat16", "nhwc")]]
    reports = sass_reports([v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA).source("cuda") for spec in specs])
    for spec, (infos, sass) in zip(specs, reports, strict=True):
        assert infos, spec.short()
        for info in infos:
            assert info.spill_stores == 0 and info.spill_loads == 0, (spec.short(), info)
        gemms = [k for k in re.split(r"\n\s+Function : ", sass) if k.startswith(f"{NAME}_gemm")]
        assert len(gemms) == 1 and "HGMMA" in gemms[0] and "HMMA" not in gemms[0], spec.short()


@pytest.mark.parametrize("spec", [ConvSpec.make(2, 6, 11, 9, 5, 3, 3, 2, 1, dtype="float16", conv_pass="dgrad"),
                                  ConvSpec.make(1, 3, 40, 48, 3, 16, 16, 8, 4, dtype="bfloat16", conv_pass="dgrad"),
                                  ConvSpec.make(1, 50, 13, 11, 37, 3, 3, 2, 1, dtype="float16", conv_pass="dgrad"),
                                  ConvSpec.make(1, 3, 45, 45, 5, 20, 20, 5, 2, dtype="float16", conv_pass="dgrad")],
                         ids=["3x3s2-fp16", "16x16s8-bf16", "2x2-tiles", "20x20s5-tap-chunks"])
def test_phase_filters_on_pocl(ocl, spec):
    """The plain strided dgrad's filter step (dgrad.pack_phases, shared tiles of 32 k x ct c x the taps):
    each phase's B is its taps of w, k fastest, zeros for k >= K (K padded to a chunk) and past the taps
    up to ld; every element of every destination written (4 phases of 4 / 2 / 2 / 1 taps; stride 8's 64
    phases of 2 x 2; 50 x 37 channels over 2 x 2 tiles; 400 taps, more than one tile holds, in chunks)."""
    v, cfg = get_variant("dgrad_tc_strided_half"), TileConfig(64, 32, 1, 2, 1)
    kp = v._kp(spec)
    packs = [(ph, v._ld(spec, ph, cfg), f"wph{ph.tag}") for ph in phases(spec) if not ph.empty]
    assert kp > spec.k and len(packs) == spec.stride[0] * spec.stride[1]
    kern, grid = v.pack_step(spec, packs)
    ct, tc = _pack_tiles(spec)
    assert grid == (-(-kp // 32), -(-spec.c // ct), 1) and (tc < spec.r * spec.s) == (spec.r == 20)
    assert (grid[0] > 1 and grid[1] > 1) == (spec.c == 50)
    w = np.random.default_rng(5).uniform(-2, 2, spec.w_shape).astype(np.float32)
    w = rounded(w, spec.dtype)
    got = _run_pack_on_pocl(ocl, spec, kern, grid, [(d, ld) for _, ld, d in packs], w)
    for (ph, ld, _), g in zip(packs, got, strict=True):
        want = np.zeros((spec.c, ld), np.float32)
        for t, (r, s) in enumerate((r, s) for r in ph.ah.taps for s in ph.aw.taps):
            want[:, t * kp:t * kp + spec.k] = w[:, :, r, s].T
        np.testing.assert_array_equal(g, want)
