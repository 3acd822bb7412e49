"""The depthwise family in float16 / bfloat16 storage (FP32 arithmetic), NCHW and NHWC, every pass, on
PoCL against the float64 reference with the output poisoned (NaN) first, on odd shapes: N=1, prime
channel counts (13, 59), multiplier 2, stride 2 and 4, asymmetric padding, dilation 2, 3x3 to 7x7 and
the large filters' tiled form (13x13, 31x31) on small planes; bias / residual / ReLU / GELU / SiLU
epilogues; strided dgrad by phase; the NHWC wgrad and the tiled wgrad.

Tolerances: relative L2 against float64 of the same half inputs, the plan's own (dtypes.HALF_TOLERANCE:
1e-3 float16, 8e-3 bfloat16, about twice the rounding of the output alone, u / sqrt(3): these layers
measure 1.8-2.4e-4 and 1.5-2.2e-3); float32 plans of the new forms at the variants' 1e-5 (they measure
7e-8 to 3e-7).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.kernels import get_variant, select
from convforge.kernels.depthwise import REG_TAPS, Tile, dgrad_stencil, fprop_stencil, phases_of
from convforge.plan import Epilogue
from convforge.spec import ConvSpec

HALF = ("float16", "bfloat16")
PASS_VARIANT = {"fprop": "depthwise", "dgrad": "depthwise_dgrad", "wgrad": "depthwise_wgrad"}
ODD = [
    ConvSpec.make(1, 13, 11, 9, 13, 3, 3, 1, 1, groups=13),  # N=1, prime C, odd sizes
    ConvSpec.make(2, 5, 17, 16, 10, 5, 5, 2, (2, 1, 0, 3), groups=5),  # 5x5 /2, asymmetric pad, K = 2C
    ConvSpec.make(1, 59, 9, 8, 59, 7, 7, 1, 3, groups=59),  # prime 59, 7x7, W = 8 (16-byte half rows)
    ConvSpec.make(1, 3, 20, 24, 3, 3, 3, 1, 2, 2, groups=3),  # dilation 2
    ConvSpec.make(1, 3, 21, 17, 6, 3, 3, 4, (1, 0, 2, 1), groups=3),  # stride 4 > kernel, K = 2C, asym pad
    ConvSpec.make(1, 2, 18, 20, 2, 13, 13, 1, 6, groups=2),  # the tiled form (13x13)
    ConvSpec.make(1, 2, 17, 19, 4, 13, 13, 2, (6, 5, 6, 7), groups=2),  # tiled, stride 2, K = 2C, asym pad
    ConvSpec.make(1, 2, 19, 21, 2, 31, 31, 1, 15, groups=2),  # 31x31 (RepLKNet) on a small plane
]
EPILOGUES = [Epilogue(), Epilogue(bias=True, residual=True, silu=True), Epilogue(bias=True, relu=True),
             Epilogue(residual=True, gelu=True)]


def _as(spec: ConvSpec, dtype: str, layout: str, conv_pass: str) -> ConvSpec:
    return ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "layout": layout, "pass": conv_pass})


def _check(ocl, spec: ConvSpec, prm, epi: Epilogue, seed: int, name: str | None = None) -> None:  # type: ignore[no-untyped-def]
    v = get_variant(name or PASS_VARIANT[spec.conv_pass])
    res = check_plan(v.plan(spec, prm, ocl.device, epi), ocl, seed=seed)
    assert res.ok, f"{v.name} [{prm.short()}] {spec.short()}{epi.tag()}: {res}"


def _points(spec: ConvSpec, i: int, device) -> list:  # type: ignore[no-untyped-def]
    """One point a layer, alternating the GPU default (16-byte loads, several outputs a thread) and the
    CPU default (one output a thread), so each form runs on every shape class without doubling the
    PoCL compile time."""
    v = get_variant(PASS_VARIANT[spec.conv_pass])
    return [v.default(spec, NOMINAL_CUDA if i % 2 == 0 else device)]


# -- every (pass, dtype, layout) on PoCL ------------------------------------------------------------
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("conv_pass", ["fprop", "dgrad", "wgrad"])
def test_half_depthwise_every_pass_on_pocl(ocl, conv_pass, dtype, layout) -> None:
    """Each pass runs every odd shape in both half dtypes and both layouts, the four (dtype, layout)
    pairs taking the shapes in turns: float16 and bfloat16 differ only in their loads, stores and
    conversions, so a shape runs as (float16, NCHW) and (bfloat16, NHWC), or as (bfloat16, NCHW) and
    (float16, NHWC); each pair gets half the shapes, both default forms and, in fprop, two of the
    four epilogues (each dtype all four)."""
    v = get_variant(PASS_VARIANT[conv_pass])
    turn = (HALF.index(dtype) + ("nchw", "nhwc").index(layout)) % 2
    ran = 0
    for i, base in enumerate(ODD):
        spec = _as(base, dtype, layout, conv_pass)
        assert v.applies(spec, ocl.device) is None, (spec.short(), v.applies(spec, ocl.device))
        if i % 2 != turn:
            continue
        epi = EPILOGUES[i % len(EPILOGUES)] if conv_pass == "fprop" else Epilogue()
        for prm in _points(spec, i // 2, ocl.device):  # i // 2: both forms among a pair's shapes
            _check(ocl, spec, prm, epi, seed=i)
            ran += 1
    assert ran == len(ODD) // 2


@pytest.mark.parametrize("conv_pass", ["fprop", "dgrad", "wgrad"])
def test_float32_new_forms_on_pocl(ocl, conv_pass) -> None:
    """float32 through the forms this file adds: NHWC tiles (every pass), strided dgrad by phase and
    the tiled form of large filters (NCHW)."""
    for i, base in enumerate(ODD):
        for layout in ("nhwc", "nchw"):
            spec = _as(base, "float32", layout, conv_pass)
            new = layout == "nhwc" or base.r * base.s > REG_TAPS or (conv_pass == "dgrad" and base.stride != (1, 1))
            if not new or (layout == "nchw" and i % 2):
                continue
            epi = Epilogue(bias=True, residual=True, relu=True) if conv_pass == "fprop" and i % 2 else Epilogue()
            for prm in _points(spec, i + (layout == "nhwc"), ocl.device):
                _check(ocl, spec, prm, epi, seed=i)


@pytest.mark.parametrize("dtype", HALF)
def test_half_depthwise_sampled_tiles_on_pocl(ocl, dtype) -> None:
    """Random points of the spaces (any tile, vec / fl / tq=8 / NHWC bc) on three layers."""
    import random

    rng = random.Random(7)
    for j, (base, layout, conv_pass) in enumerate([(ODD[1], "nchw", "fprop"), (ODD[2], "nhwc", "dgrad"),
                                                   (ODD[4], "nchw", "dgrad"), (ODD[0], "nhwc", "fprop")]):
        spec = _as(base, dtype, layout, conv_pass)
        v = get_variant(PASS_VARIANT[conv_pass])
        space = v.space(spec, NOMINAL_CUDA)
        for prm in rng.sample(space, min(2, len(space))):
            _check(ocl, spec, prm, Epilogue(bias=True) if conv_pass == "fprop" else Epilogue(), seed=j)


@pytest.mark.parametrize("dtype", HALF)
def test_depthwise_nhwc_half_channel_vectors_on_pocl(ocl, dtype) -> None:
    """depthwise_nhwc with cv = 4 or 8 channels a thread (8- and 16-byte loads and stores), its GPU
    default, and a concat offset that keeps the vectors aligned."""
    from convforge.params import Params

    v = get_variant("depthwise_nhwc")
    for i, (base, cv) in enumerate([(ConvSpec.make(2, 16, 9, 7, 16, 3, 3, 1, 1, groups=16), 8),
                                    (ConvSpec.make(1, 8, 11, 10, 8, 5, 5, 2, (2, 1, 1, 2), groups=8), 4),
                                    (ConvSpec.make(1, 24, 7, 9, 24, 3, 3, 1, 1, 2, groups=24), 4)]):
        spec = _as(base, dtype, "nhwc", "fprop")
        prm = Params(bc=2, bt=4, tq=2, tp=1, cv=cv)
        _check(ocl, spec, prm, EPILOGUES[i + 1], seed=i, name="depthwise_nhwc")
        _check(ocl, spec, v.default(spec, NOMINAL_CUDA), Epilogue(bias=True, silu=True), seed=i,
               name="depthwise_nhwc")
    with pytest.raises(ValueError, match="cv=4 needs multiplier 1"):
        spec = _as(ODD[1], dtype, "nhwc", "fprop")  # K = 2C
        v.plan(spec, Params(bc=2, bt=4, tq=2, tp=1, cv=4), NOMINAL_CUDA)


@pytest.mark.parametrize("conv_pass", ["fprop", "dgrad"])
def test_nhwc_channel_blocks_fastest_and_skewed_tiles_on_pocl(ocl, conv_pass) -> None:
    """cf=1 (NHWC blocks numbered channel blocks fastest) on the GPU default tiles, and the skewed 8-channel
    chunks (bc 16, 32 and 64: skew 16, 8 and 4) with both block orders: 3x3, 5x5 /2 with asymmetric padding
    (dgrad by phase), 7x7, odd planes, several channel blocks, the last one partly idle."""
    from convforge.params import Params

    specs = [ConvSpec.make(2, 48, 13, 11, 48, 3, 3, 1, 1, groups=48),
             ConvSpec.make(1, 40, 17, 17, 40, 5, 5, 2, (2, 1, 1, 2), groups=40),
             ConvSpec.make(3, 72, 9, 14, 72, 7, 7, 1, 3, groups=72)]
    for i, (base, bc) in enumerate(zip(specs, (16, 32, 64), strict=True)):
        spec = _as(base, HALF[i % 2], "nhwc", conv_pass)
        v = get_variant(PASS_VARIANT[conv_pass])
        default = v.default(spec, NOMINAL_CUDA)
        prm = Params(**{**dict(default.items()), "bc": bc, "bq": 2, "bp": 2, "cf": i % 2 == 0})
        st = fprop_stencil(spec) if conv_pass == "fprop" else dgrad_stencil(spec)
        t = Tile.of(st, prm)
        assert t.skew == {16: 16, 32: 8, 64: 4}[bc] and t.problem(NOMINAL_CUDA) is None, t.skew
        _check(ocl, spec, Params(**{**dict(default.items()), "cf": True}), Epilogue(), seed=i)
        _check(ocl, spec, prm, Epilogue(bias=True, silu=True) if conv_pass == "fprop" else Epilogue(), seed=i + 3)
    nchw = _as(specs[0], "float16", "nchw", "fprop")
    v = get_variant("depthwise")
    with pytest.raises(ValueError, match="cf=1"):
        v.plan(nchw, Params(**{**dict(v.default(nchw, NOMINAL_CUDA).items()), "cf": True}), NOMINAL_CUDA)


@pytest.mark.parametrize("dtype", HALF)
def test_half_flat_loads_on_pocl(ocl, dtype) -> None:
    """fl=1 on half storage: the block's planes as one span of 16-byte (8 halves) or 8-byte (4) loads,
    and scalar where the span does not align."""
    from convforge.params import Params

    for i, (base, unit) in enumerate([(ConvSpec.make(2, 8, 14, 14, 8, 5, 5, 1, 2, groups=8), 8),
                                      (ConvSpec.make(1, 3, 10, 10, 6, 3, 3, 1, 1, groups=3), 4),
                                      (ConvSpec.make(1, 3, 9, 9, 3, 3, 3, 1, 1, groups=3), 1)]):
        spec = _as(base, dtype, "nchw", "fprop")
        prm = Params(bq=4, bp=7 if i == 0 else 5, bc=2 if i == 0 else 1, tq=4, tp=2, vec=False, fl=True)
        t = Tile.of(fprop_stencil(spec), prm)
        assert t.flat_ok and t.flat_unit == unit and t.problem(NOMINAL_CUDA) is None
        _check(ocl, spec, prm, Epilogue(bias=True, gelu=True), seed=i)


def test_half_vector_store_paths_on_pocl(ocl) -> None:
    """NCHW rows of 8 halves (one 16-byte load and store: vw = 8, tq = 8) and of 4 (8 bytes) with
    a residual and SiLU, beside a row width that allows neither."""
    from convforge.params import Params

    for i, (base, prm) in enumerate([
            (ConvSpec.make(1, 3, 10, 16, 3, 3, 3, 1, 1, groups=3), Params(bq=2, bp=5, bc=2, tq=8, tp=2, vec=True)),
            (ConvSpec.make(1, 3, 10, 12, 3, 3, 3, 1, 1, groups=3), Params(bq=3, bp=5, bc=2, tq=4, tp=2, vec=True)),
            (ConvSpec.make(1, 3, 10, 13, 3, 3, 3, 1, 1, groups=3), Params(bq=2, bp=5, bc=2, tq=8, tp=2, vec=False))]):
        spec = _as(base, "float16", "nchw", "fprop")
        t = Tile.of(fprop_stencil(spec), prm)
        assert t.vw == (8 if i == 0 else 4) and t.problem(NOMINAL_CUDA) is None
        _check(ocl, spec, prm, Epilogue(bias=True, residual=True, silu=True), seed=i)
        src = get_variant("depthwise").plan(spec, prm, NOMINAL_CUDA).source("cuda")
        assert ("cf_ld8h(" in src and "cf_st8h(" in src) == (i == 0)


# -- the forms' bookkeeping (no device) -------------------------------------------------------------
@pytest.mark.parametrize("stride, pad, taps, dil", [(2, 1, 3, 1), (4, 1, 3, 1), (2, 3, 7, 1), (3, 2, 5, 2),
                                                    (2, 6, 13, 1), (1, 15, 31, 1)])
def test_phase_taps_cover_every_tap_once(stride, pad, taps, dil) -> None:
    """Each (dx row, filter tap) pair that the scatter form of dgrad sums (dx row ih gets
    dy[(ih + pad - r*dil) / stride] * w[r] where that divides) appears once in the phase tables."""
    spec = ConvSpec.make(1, 2, 23, 23, 2, taps, taps, stride, pad, dil, groups=2)
    ph = phases_of(spec)
    lo = ph.lo[0]
    for ih in range(spec.h):
        a, u = ih % stride, ih // stride
        want = {(r, (ih + pad - r * dil) // stride) for r in range(taps) if (ih + pad - r * dil) % stride == 0}
        got = {(r, u + off + lo) for r, off in ph.rows[a]}
        assert got == want
    assert all(0 <= off < ph.win[0] for taps_ in ph.rows for _, off in taps_)


def test_stencil_forms_are_chosen_by_stride_and_size() -> None:
    small, big = ODD[0], ODD[5]
    assert dgrad_stencil(small.with_pass("dgrad")).flip and dgrad_stencil(small.with_pass("dgrad")).phases is None
    assert dgrad_stencil(ODD[1].with_pass("dgrad")).phases is not None  # stride 2: phases
    assert dgrad_stencil(big.with_pass("dgrad")).phases is not None  # large filters: phases, taps in shared memory
    assert fprop_stencil(big).big and not fprop_stencil(small).big
    nhwc = Tile.of(fprop_stencil(_as(small, "float16", "nhwc", "fprop")), get_variant("depthwise").default(
        _as(small, "float16", "nhwc", "fprop"), NOMINAL_CUDA))
    assert nhwc.plane % 32 == 4 if nhwc.vread else nhwc.plane % 2 == 1  # lanes (channels) in distinct banks


def test_auto_picks_the_depthwise_family_for_half_layers() -> None:
    """Every pass, dtype and layout of a depthwise layer (large filters and strides too) is served by
    the depthwise family; NHWC float32 forward keeps depthwise_nhwc first (measured), NHWC half the
    shared-memory tile with 16-byte channel loads."""
    for base, dtype, layout, conv_pass in itertools.product(ODD, HALF + ("float32",), ("nchw", "nhwc"),
                                                            ("fprop", "dgrad", "wgrad")):
        spec = _as(base, dtype, layout, conv_pass)
        first = select("auto", spec, NOMINAL_CUDA)[0]
        assert first.family == "depthwise", (spec.short(), first.name)
        if conv_pass == "fprop" and layout == "nhwc" and base.r * base.s <= REG_TAPS:
            assert first.name == ("depthwise_nhwc" if dtype == "float32" else "depthwise"), spec.short()


def test_auto_takes_depthwise_nhwc_for_strided_3x3_on_large_half_planes() -> None:
    """NHWC half 3x3 at stride 2 over input planes of >= 56 rows: depthwise_nhwc first (the H200 A/B of the
    thirty-eighth session); stride 1, 5x5 and smaller planes keep the tile first, float32 depthwise_nhwc."""
    cases = [(ConvSpec.make(64, 96, 112, 112, 96, 3, 3, 2, 1, groups=96), "depthwise_nhwc"),
             (ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 2, 1, groups=144), "depthwise_nhwc"),
             (ConvSpec.make(64, 192, 28, 28, 192, 3, 3, 2, 1, groups=192), "depthwise"),
             (ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144), "depthwise"),
             (ConvSpec.make(64, 72, 56, 56, 72, 5, 5, 2, 2, groups=72), "depthwise")]
    for base, want in cases:
        for dtype in HALF:
            assert select("auto", _as(base, dtype, "nhwc", "fprop"), NOMINAL_CUDA)[0].name == want, base.short()
        assert select("auto", _as(base, "float32", "nhwc", "fprop"), NOMINAL_CUDA)[0].name == "depthwise_nhwc"
        assert select("auto", _as(base, "float16", "nchw", "fprop"), NOMINAL_CUDA)[0].name != "depthwise_nhwc"


@pytest.mark.parametrize("dtype", HALF)
def test_depthwise_nhwc_default_on_a_strided_large_plane_on_pocl(ocl, dtype) -> None:
    """The default depthwise_nhwc takes on a half strided 3x3 plane of >= 56 rows (now auto's first), odd
    sizes and asymmetric padding, with a bias + SiLU and a residual epilogue, against float64."""
    spec = _as(ConvSpec.make(1, 24, 57, 58, 24, 3, 3, 2, (1, 0, 1, 1), groups=24), dtype, "nhwc", "fprop")
    assert select("auto", spec, NOMINAL_CUDA)[0].name == "depthwise_nhwc"
    prm = get_variant("depthwise_nhwc").default(spec, NOMINAL_CUDA)
    _check(ocl, spec, prm, Epilogue(bias=True, silu=True), seed=3, name="depthwise_nhwc")
    _check(ocl, spec, prm, EPILOGUES[1], seed=4, name="depthwise_nhwc")


def test_depthwise_refusals_name_the_problem() -> None:
    from convforge.params import Params

    v = get_variant("depthwise")
    spec = _as(ODD[0], "float16", "nhwc", "fprop")
    with pytest.raises(ValueError, match="vec=1 reads NCHW rows"):
        v.plan(spec, Params(bq=2, bp=2, bc=8, tq=4, tp=1, vec=True), NOMINAL_CUDA)
    with pytest.raises(ValueError, match=r"bq, bp, bc, tq and tp must be >= 1"):
        v.plan(spec, Params(bq=0, bp=2, bc=8, tq=4, tp=1, vec=False), NOMINAL_CUDA)
    dg = get_variant("depthwise_dgrad")
    spec = _as(ODD[4], "float16", "nchw", "dgrad")  # stride 4: 16 dx pixels a super-pixel
    with pytest.raises(ValueError, match=r"super-pixels of 4 x 4 \(64\) outputs per thread must be <= 32"):
        dg.plan(spec, Params(bq=2, bp=2, bc=1, tq=2, tp=2, vec=False), NOMINAL_CUDA)
    with pytest.raises(ValueError, match="writes a gradient"):
        dg.plan(spec, dg.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(silu=True))


def test_silu_epilogue_is_one_activation() -> None:
    epi = Epilogue(bias=True, silu=True)
    assert epi.tag() == "_bias_silu" and epi.activation == "silu" and epi.plain() == epi
    assert epi.activate("v") == "SILU(v)" and Epilogue(relu=True).activate("v") == "RELU(v)"
    with pytest.raises(ValueError, match="unsupported epilogue: GELU and SiLU together"):
        Epilogue(gelu=True, silu=True)
    from convforge.codegen.dialect import Buf, Kernel
    from convforge.codegen.render import render

    k = Kernel("act", (Buf("y", readonly=False),), "y[0] = SILU(y[0]);", (1, 1, 1))
    assert "v / (1.0f + expf(-v))" in render([k], "cuda") and "v / (1.0f + exp(-v))" in render([k], "opencl")


# -- no silent fallback: slow_reason ---------------------------------------------------------------
def test_slow_reason_names_half_layers_without_a_fast_variant(monkeypatch) -> None:
    """On CUDA half layers: None where a tensor-core or memory-bound variant serves the layer, else one
    line naming the CUDA-core candidates; float32 and other back-ends are not judged."""
    from convforge.dispatch import choice, is_fast, slow_reason
    from convforge.plan import DeviceInfo

    grouped = ConvSpec.make(32, 448, 28, 28, 448, 3, 3, 1, 1, groups=8, dtype="float16")
    dense = ConvSpec.make(8, 64, 14, 14, 64, 3, 3, 1, 1, dtype="bfloat16")
    assert slow_reason(dense, NOMINAL_CUDA) is None  # the tensor-core GEMMs serve it
    assert is_fast(get_variant("tc_implicit_gemm_half"), dense, NOMINAL_CUDA)
    assert not is_fast(get_variant("implicit_gemm"), grouped, NOMINAL_CUDA)
    why = slow_reason(grouped, NOMINAL_CUDA, get_variant("implicit_gemm"))
    assert why is not None and why.startswith("implicit_gemm runs the float16 layer N32 C448 28x28") and "g8" in why
    slow = [get_variant("implicit_gemm"), get_variant("direct_smem")]
    monkeypatch.setattr(choice.kernels, "ranked", lambda *a, **k: slow)
    why = slow_reason(grouped, NOMINAL_CUDA)
    assert why is not None and why.startswith("no fast variant serves the float16 layer") and \
        "(implicit_gemm, direct_smem)" in why
    monkeypatch.setattr(choice.kernels, "ranked", lambda *a, **k: [])
    assert (slow_reason(grouped, NOMINAL_CUDA) or "").startswith("no variant runs the float16 layer")
    monkeypatch.undo()
    for base, layout, conv_pass in itertools.product(ODD[:3] + ODD[5:6], ("nchw", "nhwc"), ("fprop", "dgrad", "wgrad")):
        assert slow_reason(_as(base, "bfloat16", layout, conv_pass), NOMINAL_CUDA) is None  # depthwise: memory-bound
    assert slow_reason(dataclasses.replace(grouped, dtype="float32"), NOMINAL_CUDA) is None
    ocl = DeviceInfo("opencl", "nominal OpenCL GPU", units=132)
    assert slow_reason(grouped, ocl) is None


# -- the bench suites ---------------------------------------------------------------------------------
def test_depthwise_and_grouped_conv_suites() -> None:
    from convforge.apps.bench.suites import BUILTIN, load_suite

    assert {"depthwise", "grouped_conv"} <= set(BUILTIN)
    dw = {x.name: x.spec for x in load_suite("depthwise")}
    assert len(dw) == 55 and all(s.depthwise for s in dw.values())
    big = dw["replknet31b dw31x31 128@56 x2"]
    assert (big.n, big.r, big.pad, big.p) == (32, 31, (15, 15, 15, 15), 56)
    slak = dw["slak_t dw51x5 96@56 x3"]
    assert (slak.r, slak.s, slak.pad, slak.p, slak.q) == (51, 5, (25, 25, 2, 2), 56, 56)
    for spec in dw.values():  # every layer, every pass and layout, in half storage: the depthwise family
        for layout, conv_pass in itertools.product(("nchw", "nhwc"), ("fprop", "dgrad", "wgrad")):
            first = select("auto", _as(spec, "float16", layout, conv_pass), NOMINAL_CUDA)[0]
            assert first.family == "depthwise", (spec.short(), layout, conv_pass, first.name)
    gc = {x.name: x.spec for x in load_suite("grouped_conv")}
    assert len(gc) == 72 and not any(s.depthwise for s in gc.values()) and all(s.groups > 1 for s in gc.values())
    assert {4, 8, 16, 24, 32, 56, 64, 112} <= {s.cg for s in gc.values()}  # group widths 4..112 (and 1x1 ones)
    issue = gc["regnet_y_8gf gw56 3x3 448@28 x3"]  # issue 59's grouped layer
    assert (issue.n, issue.c, issue.h, issue.groups, issue.cg) == (32, 448, 28, 8, 56)
    assert gc["regnet_y_400mf gw8 3x3 440@7 x5"].groups == 55 and gc["resnext101_32x8d g32 3x3 2048@7 x2"].cg == 64
    assert gc["shufflenet_v1_g8 1x1 96->360@28"].kg == 45


@pytest.mark.parametrize("dtype", HALF + ("float32",))
def test_sixteen_byte_storage_tokens_round_trip_on_pocl(ocl, dtype) -> None:
    """Storage.vload8 / vstore8 (VLOAD8_* / VSTORE8_*: one 16-byte access of 8 halves on CUDA, two
    8-byte ones on OpenCL) move 8 stored values exactly."""
    import numpy as np

    from convforge.codegen.dialect import Kernel, Storage
    from convforge.codegen.render import render
    from convforge.dtypes import rounded, to_storage
    from convforge.plan import Launch

    st = Storage(dtype)
    body = "\n".join(["const int i = LOCAL_ID(0);", "float4 lo, hi;", f"{st.vload8('lo', 'hi', 'i', 'x')};",
                      f"{st.vstore8('lo', 'hi', 'i', 'y')};"])
    k = Kernel("copy8", (st.buf("x"), st.buf("y", False)), body, (4, 1, 1))
    prog = ocl.program(render([k], "opencl"))
    vals = rounded(np.random.default_rng(1).uniform(-3, 3, 32).astype(np.float32), dtype)
    bufs = [ocl.upload(to_storage(vals, dtype)), ocl.upload(to_storage(np.zeros(32, np.float32), dtype))]
    ocl.launch(prog, ocl.function(prog, k), k, Launch("copy8", (1, 1, 1), (4, 1, 1), ()), bufs)
    ocl.synchronize()
    assert np.array_equal(ocl.download(bufs[1], (32,), dtype), vals)
    cuda = render([k], "cuda")
    assert ("cf_ld8" in cuda and "uint4" in cuda) == (dtype != "float32")


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_half_depthwise_writes_at_a_channel_offset(ocl, layout) -> None:
    """A concat written in place (k_total / k_offset) in float16, NCHW and NHWC: channel k lands at
    k_offset + k of k_total, the other channels stay poisoned."""
    import numpy as np

    from convforge.dtypes import rounded, to_storage
    from convforge.reference import conv2d_ref, rel_l2

    spec = _as(ODD[1], "float16", layout, "fprop")  # K = 2C = 10
    v = get_variant("depthwise")
    kt = spec.k + 5
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), ocl.device, Epilogue(bias=True, k_total=kt, k_offset=3))
    rng = np.random.default_rng(4)
    x, w, b = (rounded(rng.uniform(-1, 1, s).astype(np.float32), "float16")
               for s in (spec.x_shape, spec.w_shape, (spec.k,)))
    nhwc = layout == "nhwc"
    shape = (spec.n, spec.p, spec.q, kt) if nhwc else (spec.n, kt, spec.p, spec.q)
    bufs = {"x": ocl.upload(to_storage(x.transpose(0, 2, 3, 1) if nhwc else x, "float16")),
            "w": ocl.upload(to_storage(w, "float16")), "bias": ocl.upload(to_storage(b, "float16")),
            "y": ocl.upload(to_storage(np.full(shape, np.nan, np.float32), "float16"))}
    ocl.executable(plan)(bufs)
    got = ocl.download(bufs["y"], shape, "float16")
    got = got.transpose(0, 3, 1, 2) if nhwc else got
    assert rel_l2(got[:, 3:3 + spec.k], conv2d_ref(x, w, spec, b)) < 1e-3
    assert np.isnan(got[:, :3]).all() and np.isnan(got[:, 3 + spec.k:]).all()


def test_half_nchw_3x3_on_large_planes_counts_itself_slow() -> None:
    """Depthwise.slow_on: half NCHW forwards of up to 3x3 taps on planes of 56 x 56 and more (measured below
    cuDNN) go to PyTorch (slow_reason names why); channels-last, float32, 5x5 and larger filters, smaller
    planes and the other passes stay ours."""
    from convforge.dispatch import is_fast, slow_reason

    v = get_variant("depthwise")
    mbv2 = ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 2, 1, groups=144, dtype="float16")  # 144@56/2
    why = slow_reason(mbv2, NOMINAL_CUDA, v)
    assert not is_fast(v, mbv2, NOMINAL_CUDA) and why is not None and "3x3 filters on 56x56 NCHW half planes" in why
    assert slow_reason(dataclasses.replace(mbv2, stride=(1, 1), h=112, w=112, dtype="bfloat16"), NOMINAL_CUDA, v)
    changes = (dict(layout="nhwc"), dict(dtype="float32"), dict(h=28, w=28), dict(h=55, w=57),
               dict(r=5, s=5, pad=(2, 2, 2, 2)), dict(r=7, s=7, pad=(3,) * 4), dict(r=3, s=5, pad=(1, 1, 2, 2)))
    for kept in (dataclasses.replace(mbv2, **change) for change in changes):
        assert is_fast(v, kept, NOMINAL_CUDA) and slow_reason(kept, NOMINAL_CUDA, v) is None, kept.short()
    assert slow_reason(dataclasses.replace(mbv2, r=1, s=3, pad=(0, 0, 1, 1)), NOMINAL_CUDA, v)  # 3 taps: small


@pytest.mark.parametrize("base, tq", [
    (ConvSpec.make(64, 192, 28, 28, 192, 3, 3, 2, 1, groups=192), 2),  # 14 super-pixel columns: 4 is ragged
    (ConvSpec.make(64, 576, 14, 14, 576, 3, 3, 2, 1, groups=576), 1),  # 7 columns
    (ConvSpec.make(64, 672, 14, 14, 672, 5, 5, 2, 2, groups=672), 1),
    (ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 2, 1, groups=144), 4),  # 28 columns: whole rows of 4 stay
], ids=["192@28/2", "576@14/2", "5x5-672@14/2", "144@56/2"])
def test_ragged_nchw_half_phases_take_narrow_rows(base, tq) -> None:
    """NCHW half strided dgrad whose super-pixel columns do not split into whole rows of 4: 2 a thread
    (1 under 8 columns); H200: 192@28/2 0.0627 -> 0.0132 ms, 576@14/2 0.0557 -> 0.0137. NHWC keeps its
    tiles."""
    v = get_variant("depthwise_dgrad")
    assert v.default(_as(base, "float16", "nchw", "dgrad"), NOMINAL_CUDA).tq == tq
    assert v.default(_as(base, "float16", "nhwc", "dgrad"), NOMINAL_CUDA).tq == 4  # channel vectors: no ragged rows


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("base", [ConvSpec.make(1, 7, 23, 27, 7, 3, 3, 2, (1, 0, 1, 0), groups=7),
                                  ConvSpec.make(2, 5, 13, 14, 10, 5, 5, 2, 2, groups=5)], ids=["3x3-prime", "5x5-K2C"])
def test_ragged_nchw_half_phases_on_pocl(ocl, base, dtype) -> None:
    """The narrow-row GPU default of ragged strided dgrad (N = 1 and 2, prime sizes, asymmetric padding,
    K = 2C) against float64 on PoCL, output poisoned."""
    spec = _as(base, dtype, "nchw", "dgrad")
    prm = get_variant("depthwise_dgrad").default(spec, NOMINAL_CUDA)
    assert prm.tq in (1, 2), prm
    _check(ocl, spec, prm, Epilogue(), seed=5)


@pytest.mark.parametrize("base, tq", [
    (ConvSpec.make(64, 96, 112, 112, 96, 3, 3, 2, 1, groups=96), 2),  # 56 outputs a row: 2 a thread
    (ConvSpec.make(64, 64, 112, 112, 64, 3, 3, 2, 1, groups=64), 2),
    (ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 2, 1, groups=144), 4),  # 28 outputs a row: 4 stay
    (ConvSpec.make(64, 32, 112, 112, 32, 3, 3, 1, 1, groups=32), 4),  # stride 1: 4 stay
], ids=["96@112/2", "64@112/2", "144@56/2", "32@112"])
def test_nhwc_half_strided_wide_rows_take_two_outputs(base, tq) -> None:
    """NHWC half forwards at stride 2 on rows of 56 outputs and more: 2 outputs a thread (H200: 96@112/2
    0.0791 -> 0.0739 ms, 64@112/2 0.0551 -> 0.0517); float32 and narrower rows keep theirs."""
    v = get_variant("depthwise")
    for dtype in HALF:
        prm = v.default(_as(base, dtype, "nhwc", "fprop"), NOMINAL_CUDA)
        assert prm.tq == tq, prm.short()
    assert v.default(_as(base, "float32", "nhwc", "fprop"), NOMINAL_CUDA).tq == 4
