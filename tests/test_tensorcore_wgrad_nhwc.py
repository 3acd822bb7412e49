"""wgrad of channels-last half layers with MN-major operands (kernels/tensorcore/sm90/wgrad_nhwc.py), on
the CPU: the MN-major shared layout the copies write against the hardware's documented read, every tile
of the GEMM through the generator's own expressions (test_tensorcore_gen.emulate_gemm: TMA boxes by the
PTX ISA's traversal, wgmma reads through the descriptors) against the float64 filter gradient, the plans
compiled by nvcc (HGMMA in SASS, no spills)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.dtypes import rounded
from convforge.kernels import get_variant, ranked
from convforge.kernels.tensorcore.sm90.isa import BF16, F16
from convforge.kernels.tensorcore.sm90.smem import Tile, model_address_mn
from convforge.kernels.tensorcore.sm90.tiles import TileConfig
from convforge.reference import wgrad_ref
from convforge.spec import ConvSpec
from helpers import sass_reports
from test_tensorcore_gen import emulate_gemm

NAME = "wgrad_tc_nhwc_half"


def _half(spec: ConvSpec, dtype: str) -> ConvSpec:
    return ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "pass": "wgrad", "layout": "nhwc"})


@pytest.mark.parametrize("rows, blocks", [(64, 1), (64, 2), (128, 2), (16, 4)])
def test_mn_major_read_is_what_the_copies_wrote(rows, blocks):
    """Element (mn, k) of every k step, read through the MN-major descriptor (CUTLASS's canonical
    form), is where a 128-byte-swizzled box of rows = K, 64 MN elements a row, put it."""
    tile, base = Tile(rows, blocks, major="mn"), 4096
    for kk, mn, k in itertools.product(range(tile.steps), range(64 * blocks), range(16)):
        desc = tile.desc_high | ((base + tile.step_offset(kk)) >> 4)
        row = 16 * kk + k  # the copy's shared row (a pixel), block mn // 64, element mn % 64 of it
        lin = base + (mn // 64) * rows * 128 + row * 128 + (mn % 64) * 2
        wrote = lin ^ ((row % 8) << 4)
        assert model_address_mn(desc, mn, k) == wrote, (kk, mn, k)


# odd layers: N = 1 and 3, stride 2 and 4 with asymmetric padding, dilation, 11x11, K not a tile multiple,
# several taps per tile row, a pixel tail in the last stage
CASES = [(ConvSpec.make(2, 64, 7, 7, 24, 3, 3, 1, 1), F16, TileConfig(64, 64, 1, 3, 1, ks=2, tm=1, mn=1)),
         # 128-row tiles over two taps of a 64-channel layer, the last tile past R S C; 256 rows over four
         (ConvSpec.make(2, 64, 7, 6, 24, 3, 3, 1, 1), BF16, TileConfig(128, 64, 1, 3, 2, ks=2, tm=1, mn=1)),
         (ConvSpec.make(1, 64, 6, 5, 16, 3, 3, 1, (1, 0, 0, 1)), F16, TileConfig(256, 64, 1, 2, 2, tm=1, mn=1)),
         (ConvSpec.make(3, 128, 9, 11, 40, 3, 3, 2, (1, 0, 2, 1)), BF16,
          TileConfig(128, 64, 1, 2, 2, ks=3, tm=1, mn=1)),
         (ConvSpec.make(1, 64, 5, 7, 136, 1, 1), F16, TileConfig(64, 128, 2, 2, 1, tm=1, mn=1)),
         (ConvSpec.make(2, 64, 13, 13, 64, 5, 5, 1, 3, 2), BF16, TileConfig(64, 64, 1, 2, 1, tm=1, mn=1)),
         (ConvSpec.make(1, 64, 31, 29, 16, 11, 11, 4, (2, 1, 0, 3)), F16,
          TileConfig(64, 64, 1, 2, 1, ks=2, tm=1, mn=1)),
         (ConvSpec.make(2, 128, 9, 9, 64, 1, 1, 2), F16, TileConfig(128, 64, 1, 2, 2, tm=1, mn=1)),
         # 1x1 layers of C not a multiple of 64 (x as [N H W][C] rows): 96 on 128-row tiles, 24 below one block
         (ConvSpec.make(3, 96, 5, 7, 40, 1, 1), F16, TileConfig(128, 64, 1, 2, 2, ks=2, tm=1, mn=1)),
         (ConvSpec.make(1, 24, 9, 7, 16, 1, 1), BF16, TileConfig(64, 64, 1, 2, 1, tm=1, mn=1)),
         # three 64-column blocks of B (bn 192) over K = 200
         (ConvSpec.make(1, 64, 5, 6, 200, 3, 3, 1, 1), BF16, TileConfig(128, 192, 1, 2, 2, tm=1, mn=1))]


def emulate_wgrad_nhwc(spec: ConvSpec, math, cfg: TileConfig, seed: int = 0):
    """The plan's GEMM with x and dy channels-last as they lie; every split slice into a slab of its own.
    Returns (dW, float64 reference, writes per element)."""
    variant = get_variant(NAME)
    dt = "float16" if math is F16 else "bfloat16"
    spec = _half(spec, dt)
    assert variant.applies(spec, NOMINAL_CUDA) is None, variant.applies(spec, NOMINAL_CUDA)
    rng = np.random.default_rng(seed)
    x = rounded(rng.uniform(-1, 1, spec.x_shape).astype(np.float32), dt).astype(np.float64)
    dy = rounded(rng.uniform(-1, 1, spec.y_shape).astype(np.float32), dt).astype(np.float64)
    prob = variant.problem(spec)
    a, b = variant.operands(spec, cfg)
    data = {"a": {"hi": x.transpose(0, 2, 3, 1).ravel()}, "b": {"hi": dy.transpose(0, 2, 3, 1).ravel()}}
    out = dataclasses.replace(variant.output(spec), slab=prob.m * prob.n, epi=None)
    y, written = emulate_gemm(cfg, math, prob, a, b, data, out)
    got = y.reshape(cfg.ks, -1).sum(0).reshape(spec.w_shape)
    return got, wgrad_ref(x, dy, spec), written.reshape(cfg.ks, -1).sum(0).reshape(spec.w_shape)


@pytest.mark.parametrize("spec, math, cfg", CASES, ids=lambda v: getattr(v, "name", None) or str(v))
def test_emulated_tiles_equal_the_filter_gradient(spec, math, cfg):
    """Every tile, through the generator's expressions and dW's K C R S store, equals the float64
    filter gradient of the rounded operands; every dW element written once per split slice."""
    assert not cfg.problems(math), cfg.problems(math)
    got, ref, written = emulate_wgrad_nhwc(spec, math, cfg)
    assert (written == cfg.ks).all(), f"dW elements written {np.unique(written)} times, want {cfg.ks}"
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_refusals_say_why():
    """NCHW, channels not whole 64-channel boxes, K not whole 16-byte rows, grouped layers, float32."""
    v = get_variant(NAME)
    base = ConvSpec.make(2, 64, 8, 8, 32, 3, 3, 1, 1)
    assert "NCHW" in v.applies(ConvSpec.from_dict({**_half(base, "float16").to_dict(), "layout": "nchw"}),
                               NOMINAL_CUDA)
    assert "64-channel" in v.applies(_half(ConvSpec.make(2, 96, 8, 8, 32, 3, 3, 1, 1), "float16"), NOMINAL_CUDA)
    assert "64-channel" in v.applies(_half(ConvSpec.make(2, 96, 8, 8, 32, 1, 1, 2), "float16"), NOMINAL_CUDA)
    assert v.applies(_half(ConvSpec.make(2, 96, 8, 8, 32, 1, 1), "float16"), NOMINAL_CUDA) is None
    assert "16-byte rows of x" in v.applies(_half(ConvSpec.make(2, 36, 8, 8, 32, 1, 1), "float16"), NOMINAL_CUDA)
    assert "16-byte" in v.applies(_half(ConvSpec.make(2, 64, 8, 8, 36, 3, 3, 1, 1), "float16"), NOMINAL_CUDA)
    assert "grouped" in v.applies(_half(ConvSpec.make(2, 128, 8, 8, 128, 3, 3, 1, 1, groups=2), "float16"),
                                  NOMINAL_CUDA)
    assert v.applies(base.with_pass("wgrad"), NOMINAL_CUDA)
    with pytest.raises(ValueError, match="MN-major"):
        v.plan(_half(base, "float16"), TileConfig(128, 64, 1, 3, 2, tm=1).params(), NOMINAL_CUDA)


def test_ranked_first_for_channels_last_half_wgrad():
    """First for channels-last half wgrad, except 3x3 filters on 7x7 output images (the transposed path)."""
    spec = _half(ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1), "bfloat16")
    assert ranked("auto", spec, NOMINAL_CUDA)[0].name == NAME
    assert ranked("auto", _half(ConvSpec.make(32, 512, 7, 7, 512, 1, 1), "float16"), NOMINAL_CUDA)[0].name == NAME
    small = _half(ConvSpec.make(32, 512, 7, 7, 512, 3, 3, 1, 1), "float16")
    assert ranked("auto", small, NOMINAL_CUDA)[0].name == "wgrad_tc_implicit_gemm_half"


COMPILE_LAYERS = [ConvSpec.make(128, 256, 56, 56, 64, 1, 1),
                  ConvSpec.make(128, 64, 56, 56, 64, 3, 3, 1, 1),
                  ConvSpec.make(128, 512, 28, 28, 1024, 1, 1, 2),
                  ConvSpec.make(3, 128, 9, 11, 40, 3, 3, 2, (1, 0, 2, 1)),
                  ConvSpec.make(64, 240, 28, 28, 40, 1, 1)]


def test_plans_compile_without_spills_hgmma_in_sass(nvcc_ok):
    """The default of each space and its second or third point, in turns over the COMPILE_LAYERS,
    compile for sm_90a without spills (the reduce kernel of a split plan too; one nvcc run for all):
    HGMMA and tensor copies in SASS. The first three points of these spaces are 64x64, 128x64 and
    128x128 tiles, split or not: in turns, each tile is still compiled split and unsplit, every layer
    with its default."""
    v = get_variant(NAME)
    cases = []
    for turn, layer in enumerate(COMPILE_LAYERS):
        spec = _half(layer, "float16")
        space = v.space(spec, NOMINAL_CUDA)
        cases += [(f"{spec.short()} [{prm.short()}]", v.plan(spec, prm, NOMINAL_CUDA).source("cuda"))
                  for prm in (space[0], space[1 + turn % 2])]
    for (label, _), (infos, sass) in zip(cases, sass_reports([src for _, src in cases]), strict=True):
        assert infos and all(i.spill_stores == 0 for i in infos), (label, infos)
        assert "HGMMA" in sass and "UTMALDG" in sass, label
