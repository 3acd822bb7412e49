"""Grouped and depthwise convolutions on the CPU tier: every grouped-capable variant on PoCL against
the float64 reference on odd shapes (groups 2, 3, C; a depthwise multiplier; stride 2 with odd
sizes; dilation 2; asymmetric padding; N=1; 5x5 and 7x7; sampled tuning points; bias, residual and
ReLU epilogues), nvcc sm_90 without spills, the refusals, ``conv2d(groups=)``, grouped graphs
through prototxt and ONNX, and the CLI and bench pieces."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge import api
from convforge.apps.bench import models, suites
from convforge.check import check_plan
from convforge.frontends import fast_path
from convforge.frontends.keys import torch_key
from convforge.kernels import get_variant, select
from convforge.plan import Epilogue
from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec
from helpers import assert_sources_compile_clean, run_main, sample

FULL = Epilogue(bias=True, relu=True, residual=True)

GROUPED = [  # groups 2 with everything odd, 3, a depthwise-shaped 5x5 with multiplier 2, grouped 1x1s
    ConvSpec.make(2, 6, 11, 9, 4, 3, 2, stride=(2, 3), padding=(1, 0, 2, 1), dilation=(1, 2), groups=2),
    ConvSpec.make(1, 9, 13, 13, 6, 3, 3, 1, 1, groups=3),
    ConvSpec.make(3, 5, 17, 19, 10, 5, 5, padding=2, dilation=2, groups=5),
    ConvSpec.make(1, 8, 12, 12, 16, 1, 1, groups=4),
    ConvSpec.make(2, 12, 9, 9, 12, 1, 1, stride=2, groups=3),
]
DEPTHWISE = [
    ConvSpec.make(1, 6, 13, 11, 6, 3, 3, 1, 1, groups=6),  # N=1, odd sizes
    ConvSpec.make(2, 5, 17, 16, 10, 5, 5, 2, (2, 1, 0, 3), groups=5),  # 5x5 /2, asymmetric pad, K = 2C
    ConvSpec.make(2, 4, 16, 16, 4, 7, 7, 1, 3, groups=4),  # 7x7 (16-byte loads: W % 4 == 0)
    ConvSpec.make(1, 3, 20, 24, 3, 3, 3, 1, 2, 2, groups=3),  # dilation 2
    ConvSpec.make(2, 7, 15, 13, 7, 3, 3, 2, 1, groups=7),  # stride 2, odd sizes
]
# the real layers the defaults are for (MobileNet-v2, ConvNeXt-T)
REAL = [ConvSpec.make(64, 96, 112, 112, 96, 3, 3, 2, 1, groups=96),
        ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144),
        ConvSpec.make(32, 96, 56, 56, 96, 7, 7, 1, 3, groups=96),
        ConvSpec.make(32, 192, 28, 28, 192, 7, 7, 1, 3, groups=192),
        ConvSpec.make(32, 384, 14, 14, 384, 7, 7, 1, 3, groups=384),
        ConvSpec.make(32, 768, 7, 7, 768, 7, 7, 1, 3, groups=768)]
GROUPED_FPROP = ("direct", "direct_smem", "implicit_gemm", "implicit_gemm_precomp", "gemm1x1")


def _ok(variant, spec, params, dev, ocl, epi=Epilogue(), seed=0):  # type: ignore[no-untyped-def]
    res = check_plan(variant.plan(spec, params, dev, epi), ocl, seed=seed)
    assert res.ok, f"{variant.name} [{params.short()}] {spec.short()}{epi.tag()}: {res}"


# -- kernels on PoCL -----------------------------------------------------------------------------
@pytest.mark.parametrize("spec", DEPTHWISE, ids=lambda s: s.key())
def test_depthwise_on_pocl(ocl, spec) -> None:
    v = get_variant("depthwise")
    assert v.applies(spec, ocl.device) is None
    for i, prm in enumerate(sample(v, spec, ocl.device, k=3, seed=spec.c)):
        _ok(v, spec, prm, ocl.device, ocl, FULL if i % 2 else Epilogue(), seed=i)
    # the GPU default (16-byte loads and stores where they align, several channels per block)
    gpu = v.default(spec, NOMINAL_CUDA)
    _ok(v, spec, gpu, ocl.device, ocl, Epilogue(bias=True, relu=True))



FLAT = [  # (layer, tile covering whole planes): flat loads of the block's consecutive source planes
    (ConvSpec.make(2, 7, 7, 7, 7, 5, 5, 1, 2, groups=7), (2, 4, 3, 4, 2)),  # G*H*W odd: scalar, last block 1 of 3
    (ConvSpec.make(2, 8, 14, 14, 16, 3, 3, 2, 1, groups=8), (2, 4, 4, 4, 2)),  # float4 span, stride 2, K = 2C
    (ConvSpec.make(3, 6, 7, 7, 6, 7, 7, 1, 3, groups=6), (2, 4, 4, 4, 2)),  # 7x7 on a 7x7 plane, bc 4 of 6
    (ConvSpec.make(1, 4, 12, 13, 4, 3, 3, 1, (0, 2, 1, 0), 2, groups=4), (4, 7, 2, 4, 2)),  # dilation 2, asym pad
    (ConvSpec.make(1, 3, 12, 16, 3, 3, 3, 1, (4, 0, 5, 1), 2, groups=3, conv_pass="dgrad"), (4, 6, 2, 4, 2)),  # crop
]


@pytest.mark.parametrize("spec, tile", FLAT, ids=lambda x: x.key() if isinstance(x, ConvSpec) else "")
def test_depthwise_flat_loads_on_pocl(ocl, spec, tile) -> None:
    """fl=1 (``Tile.flat_ok``: one tile a plane): the block's planes read as one contiguous span and
    scattered into the zero-filled padded tile, against float64 with the epilogue, beside fl=0."""
    from convforge.kernels.depthwise import Tile, dgrad_stencil, fprop_stencil
    from convforge.params import Params

    v = get_variant("depthwise_dgrad" if spec.conv_pass == "dgrad" else "depthwise")
    bq, bp, bc, tq, tp = tile
    for fl in (True, False):
        prm = Params(bq=bq, bp=bp, bc=bc, tq=tq, tp=tp, vec=False, fl=fl)
        st = dgrad_stencil(spec) if spec.conv_pass == "dgrad" else fprop_stencil(spec)
        assert Tile.of(st, prm).flat_ok and Tile.of(st, prm).problem(ocl.device) is None
        _ok(v, spec, prm, ocl.device, ocl, Epilogue() if spec.conv_pass == "dgrad" else FULL, seed=int(fl))
    assert "fl" in get_variant("depthwise").default(FLAT[1][0], NOMINAL_CUDA)  # the GPU default, one tile a plane


def test_depthwise_flat_loads_refused_where_tiles_split_a_plane() -> None:
    from convforge.params import Params

    v, spec = get_variant("depthwise"), REAL[1]  # 56x56 planes: several tiles a plane
    prm = v.default(spec, NOMINAL_CUDA)
    assert "fl" not in prm
    # the default's rule (measured): 5x5 and 7x7 on 7x7 planes take flat loads, 3x3 on 7x7 planes not
    assert v.default(ConvSpec.make(32, 1152, 7, 7, 1152, 5, 5, 1, 2, groups=1152), NOMINAL_CUDA).get("fl")
    assert "fl" not in v.default(ConvSpec.make(64, 960, 7, 7, 960, 3, 3, 1, 1, groups=960), NOMINAL_CUDA)
    with pytest.raises(ValueError, match="fl=1 needs one tile per output plane"):
        v.plan(spec, Params({**prm, "vec": False, "fl": True}), NOMINAL_CUDA)


def _nhwc(spec: ConvSpec) -> ConvSpec:
    return ConvSpec.make(*spec.x_shape, spec.k, spec.r, spec.s, spec.stride, spec.pad, spec.dilation,
                         spec.groups, layout="nhwc")


@pytest.mark.parametrize("spec", DEPTHWISE, ids=lambda s: s.key())
def test_depthwise_nhwc_on_pocl(ocl, spec) -> None:
    """Channels-last activations (x, y and the residual in NHWC memory; check_plan writes and reads
    them so): sampled points, the GPU default, bias + residual + ReLU."""
    v, s = get_variant("depthwise_nhwc"), _nhwc(spec)
    assert v.applies(s, ocl.device) is None and get_variant("depthwise").applies(s, ocl.device) is None
    for i, prm in enumerate(sample(v, s, ocl.device, k=2, seed=spec.c)):
        _ok(v, s, prm, ocl.device, ocl, FULL if i % 2 else Epilogue(), seed=i)
    _ok(v, s, v.default(s, NOMINAL_CUDA), ocl.device, ocl, FULL, seed=7)


def test_depthwise_nhwc_writes_at_a_channel_offset(ocl) -> None:
    """A concat written in place in NHWC: channel k of pixel (n, p, q) lands at k_offset + k of k_total."""
    spec = _nhwc(DEPTHWISE[1])
    v = get_variant("depthwise_nhwc")
    plan = v.plan(spec, v.default(spec, ocl.device), ocl.device, Epilogue(bias=True, k_total=spec.k + 5, k_offset=3))
    rng = np.random.default_rng(4)
    x = rng.uniform(-1, 1, spec.x_shape).astype(np.float32)
    w = rng.uniform(-1, 1, spec.w_shape).astype(np.float32)
    b = rng.uniform(-1, 1, spec.k).astype(np.float32)
    exe = ocl.executable(plan)
    out = np.full((spec.n, spec.p, spec.q, spec.k + 5), np.nan, np.float32)
    bufs = {"x": ocl.upload(np.ascontiguousarray(x.transpose(0, 2, 3, 1))), "w": ocl.upload(w),
            "bias": ocl.upload(b), "y": ocl.upload(out)}
    exe(bufs)
    got = ocl.download(bufs["y"], out.shape)
    ref = conv2d_ref(x, w, spec, b)
    assert rel_l2(got[..., 3:3 + spec.k].transpose(0, 3, 1, 2), ref) < 1e-6
    assert np.isnan(got[..., :3]).all() and np.isnan(got[..., 3 + spec.k:]).all()


def test_layout_is_part_of_the_spec() -> None:
    s = _nhwc(DEPTHWISE[0])
    assert s.key().endswith("_nhwc") and "nhwc" in s.short() and DEPTHWISE[0].key() + "_nhwc" == s.key()
    assert ConvSpec.parse("N=1,C=6,H=13,W=11,K=6,R=3,S=3,pad=1,groups=6,layout=channels_last") == s
    assert ConvSpec.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match=r"layout \('nwhc'\) must be one of nchw, nhwc"):
        ConvSpec.make(1, 2, 3, 3, 2, 1, 1, layout="nwhc")
    assert get_variant("direct").applies(_nhwc(GROUPED[1]), NOMINAL_CUDA) == \
        "direct does not read NHWC activations (only NCHW)"
    assert get_variant("depthwise_nhwc").applies(_nhwc(GROUPED[1]), NOMINAL_CUDA).startswith("only depthwise")
    assert get_variant("depthwise_nhwc").applies(DEPTHWISE[0], NOMINAL_CUDA) == \
        "depthwise_nhwc does not read NCHW activations (only NHWC)"
    assert [v.name for v in select("auto", _nhwc(REAL[2]), NOMINAL_CUDA)] == ["depthwise_nhwc", "depthwise"]

def test_depthwise_writes_at_a_channel_offset(ocl) -> None:
    """A concat written in place: the depthwise store honours k_total / k_offset."""
    spec = DEPTHWISE[2]
    v = get_variant("depthwise")
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), ocl.device, Epilogue(bias=True, k_total=7, k_offset=2))
    exe = ocl.executable(plan)
    rng = np.random.default_rng(0)
    x, w, b = (rng.uniform(-1, 1, s).astype(np.float32) for s in (spec.x_shape, spec.w_shape, (spec.k,)))
    y = np.full((spec.n, 7, spec.p, spec.q), np.nan, np.float32)
    bufs = {"x": ocl.upload(x), "w": ocl.upload(w), "bias": ocl.upload(b), "y": ocl.upload(y)}
    exe(bufs)
    got = ocl.download(bufs["y"], y.shape)
    assert rel_l2(got[:, 2:6], conv2d_ref(x, w, spec, b)) < 1e-6
    assert np.isnan(got[:, :2]).all() and np.isnan(got[:, 6:]).all()  # other channels untouched


@pytest.mark.parametrize("name", GROUPED_FPROP)
def test_grouped_variants_on_pocl(ocl, name) -> None:
    v = get_variant(name)
    ran = 0
    for j, spec in enumerate(GROUPED + DEPTHWISE[:2]):
        if v.applies(spec, ocl.device):
            continue
        k = 1 if v.family == "direct" else 0  # GEMM kernels compile slowly on PoCL: their default only
        for i, prm in enumerate(sample(v, spec, ocl.device, k=k, seed=j)):
            _ok(v, spec, prm, ocl.device, ocl, FULL if (i + j) % 2 else Epilogue(), seed=j)
            ran += 1
    assert ran >= (2 if name == "gemm1x1" else 4), f"{name} ran on {ran} grouped layers"


@pytest.mark.parametrize("conv_pass", ["dgrad", "wgrad"])
def test_depthwise_backward_on_pocl(ocl, conv_pass) -> None:
    v = get_variant(f"depthwise_{conv_pass}")
    ran = 0
    for j, spec in enumerate(DEPTHWISE):
        spec = spec.with_pass(conv_pass)
        why = v.applies(spec, ocl.device)
        if why:
            assert conv_pass == "dgrad" and spec.stride != (1, 1) and "stride 1" in why
            continue
        for i, prm in enumerate(sample(v, spec, ocl.device, k=2, seed=j)):
            _ok(v, spec, prm, ocl.device, ocl, seed=i)
            ran += 1
    assert ran >= 6


def test_depthwise_dgrad_crops_when_padding_exceeds_the_filter(ocl) -> None:
    """pad > eff - 1: the rotated filter's padding is negative (a crop)."""
    spec = ConvSpec.make(1, 3, 12, 16, 6, 3, 3, 1, (4, 0, 5, 1), 2, groups=3, conv_pass="dgrad")
    v = get_variant("depthwise_dgrad")
    for prm in sample(v, spec, ocl.device, k=2, seed=3) + [v.default(spec, NOMINAL_CUDA)]:
        _ok(v, spec, prm, ocl.device, ocl)


# -- nvcc -----------------------------------------------------------------------------------------
def test_grouped_compiles_for_sm90(nvcc_ok) -> None:
    """Each grouped forward variant, direct_shfl and the depthwise ones on (up to) four of the grouped,
    depthwise and real layers it takes, NCHW or NHWC: the default, and a sampled point on the first and
    last; no spills (one nvcc run for all)."""
    sources = []
    for name in GROUPED_FPROP + ("direct_shfl", "depthwise", "depthwise_nhwc"):
        v = get_variant(name)
        candidates = GROUPED + DEPTHWISE[:3] + REAL[1:3]
        candidates += [_nhwc(c) for c in DEPTHWISE[:3] + REAL[1:3]]
        specs = [s for s in candidates if v.applies(s, NOMINAL_CUDA) is None]
        assert specs, f"{name} applies to no grouped spec"
        specs = specs[:4]
        for i, spec in enumerate(specs):  # a sampled point besides the default on the first and last
            for prm in sample(v, spec, NOMINAL_CUDA, k=int(i in (0, len(specs) - 1)), seed=i):
                plan = v.plan(spec, prm, NOMINAL_CUDA, FULL if i % 2 else Epilogue())
                sources.append((f"{name} [{prm.short()}] {spec.short()}", plan.source("cuda")))
    assert_sources_compile_clean(sources)  # one nvcc run


def test_depthwise_defaults_compile_clean_on_real_layers(nvcc_ok) -> None:
    """MobileNet-v2 and ConvNeXt-T layers (REAL): the untuned default and every pass compile without
    spills (one nvcc run for all the layers and passes)."""
    sources = []
    for spec in REAL:
        for name, p in (("depthwise", "fprop"), ("depthwise_dgrad", "dgrad"), ("depthwise_wgrad", "wgrad"),
                        ("depthwise_nhwc", "nhwc")):
            v = get_variant(name)
            s = _nhwc(spec) if p == "nhwc" else spec.with_pass(p)
            p = "fprop" if p == "nhwc" else p
            if v.applies(s, NOMINAL_CUDA) is None:
                plan = v.plan(s, v.default(s, NOMINAL_CUDA), NOMINAL_CUDA,
                              Epilogue(bias=True, relu=True) if p == "fprop" else Epilogue())
                sources.append((f"{name} {s.short()}", plan.source("cuda")))
    assert_sources_compile_clean(sources)


# -- choices and refusals -----------------------------------------------------------------------
def test_heuristic_picks_the_depthwise_family() -> None:
    """The shared-memory tile, or depthwise_rows where rows align and the filter is 3x3 (5x5 at a stride)."""
    for spec in DEPTHWISE + REAL:
        rows = get_variant("depthwise_rows").applies(spec, NOMINAL_CUDA) is None and (
            spec.r * spec.s <= 9 or (spec.r * spec.s <= 25 and spec.stride != (1, 1)))
        assert select("auto", spec, NOMINAL_CUDA)[0].name == ("depthwise_rows" if rows else "depthwise"), spec.short()
        assert select("auto", spec.with_pass("wgrad"), NOMINAL_CUDA)[0].name == "depthwise_wgrad"
    assert select("auto", REAL[1].with_pass("dgrad"), NOMINAL_CUDA)[0].name == "depthwise_rows_dgrad"  # 3x3 rows
    assert select("auto", REAL[2].with_pass("dgrad"), NOMINAL_CUDA)[0].name == "depthwise_dgrad"  # 7x7: the tile
    assert select("auto", REAL[0].with_pass("dgrad"), NOMINAL_CUDA)[0].name == "depthwise_dgrad"  # stride 2: phases


def test_grouped_refusals() -> None:
    plain = ConvSpec.make(1, 8, 9, 9, 8, 3, 3, 1, 1)
    assert "only depthwise" in (get_variant("depthwise").applies(plain, NOMINAL_CUDA) or "")
    assert "only depthwise" in (get_variant("depthwise").applies(GROUPED[1], NOMINAL_CUDA) or "")
    for name in ("implicit_gemm_splitk", "gemm1x1_splitk", "im2col_gemm", "winograd_nonfused_f2", "gemm_fc"):
        assert "does not take grouped layers" in (get_variant(name).applies(GROUPED[3], NOMINAL_CUDA) or ""), name
    v = get_variant("depthwise")
    spec = DEPTHWISE[0]  # W = 11: no 16-byte loads
    with pytest.raises(ValueError, match=r"depthwise: vec=1 needs W % 4 == 0"):
        v.plan(spec, v.default(spec, NOMINAL_CUDA).replace(vec=True), NOMINAL_CUDA)
    with pytest.raises(ValueError, match=r"bq \* bp \* bc \(2048\) threads"):
        v.plan(spec, v.default(spec, NOMINAL_CUDA).replace(bq=32, bp=8, bc=8), NOMINAL_CUDA)
    wg = get_variant("depthwise_wgrad")
    with pytest.raises(ValueError, match=r"ns \(0\) must be 1\.\."):
        wg.plan(spec.with_pass("wgrad"), wg.default(spec.with_pass("wgrad"), NOMINAL_CUDA).replace(ns=0),
                NOMINAL_CUDA)
    with pytest.raises(ValueError, match="unsupported epilogue: depthwise_dgrad writes a gradient"):
        get_variant("depthwise_dgrad").plan(spec.with_pass("dgrad"), _default_of("depthwise_dgrad", spec, "dgrad"),
                                            NOMINAL_CUDA, Epilogue(bias=True))


def _default_of(name: str, spec: ConvSpec, conv_pass: str):  # type: ignore[no-untyped-def]
    s = spec.with_pass(conv_pass)
    return get_variant(name).default(s, NOMINAL_CUDA)


# -- conv2d(groups=) ------------------------------------------------------------------------------
def test_conv2d_groups_on_opencl(ocl) -> None:
    rng = np.random.default_rng(4)
    for spec in (DEPTHWISE[1], GROUPED[1]):
        x = rng.uniform(-1, 1, spec.x_shape).astype(np.float32)
        w = rng.uniform(-1, 1, spec.w_shape).astype(np.float32)
        b = rng.uniform(-1, 1, spec.k).astype(np.float32)
        y = api.conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, relu=True, groups=spec.groups)
        assert rel_l2(y, conv2d_ref(x, w, spec, b, relu=True)) < 1e-6


@pytest.mark.parametrize("groups, match", [
    (0, r"groups \(0\) must be a positive int"), (True, r"groups \(True\) must be a positive int"),
    (2.0, r"groups \(2.0\) must be a positive int"), (4, r"groups \(4\) must divide C \(6\)"),
    (1, r"channel mismatch: input has C=6, weights have C=1, expected 6; a grouped layer needs groups=6"),
    (3, r"channel mismatch: input has C=6, weights have C=1, expected 2 \(C/groups with groups=3\)"),
])
def test_conv2d_groups_errors(ocl, groups, match) -> None:
    x, w = np.zeros((1, 6, 5, 5), np.float32), np.zeros((6, 1, 3, 3), np.float32)
    with pytest.raises(ValueError, match=match):
        api.conv2d(x, w, groups=groups)


def test_conv2d_groups_must_divide_k(ocl) -> None:
    with pytest.raises(ValueError, match=r"groups \(2\) must divide both C \(4\) and K \(3\)"):
        api.conv2d(np.zeros((1, 4, 5, 5), np.float32), np.zeros((3, 2, 3, 3), np.float32), groups=2)


def test_native_defaults_follow_conv2d() -> None:
    """native_core.h's C entry takes conv2d's first 14 arguments with these defaults, groups last; the
    keywords after them (padding_mode) are not its: a call naming one goes to Python's function."""
    for fn in (api.python_conv2d, api._PYTHON_CONV2D):
        params = list(inspect.signature(fn).parameters.values())
        assert params[13].name == "groups" and tuple(p.default for p in params[2:14]) == fast_path.NATIVE_DEFAULTS
        assert [p.name for p in params[14:]] == ["padding_mode"]
    core = (Path(api.__file__).parent / "backends" / "native_core.h").read_text()
    assert "constexpr int kArgs = 14;" in core and '"max_error", "groups"}' in core
    assert "defaults[13] = one;" in core


def test_fast_path_keys_tell_groups_apart() -> None:
    """A default-groups call of grouped shapes never finds a grouped call's runner (Python refuses it)."""
    class Arr:
        shape, dtype, is_contiguous, device = (1, 6, 5, 5), "float32", lambda self: True, "cuda:0"

    a = Arr()
    keys = {torch_key(a, a, None, 1, 0, 1, "auto", None, None, False, None, None, None, g) for g in (1, 6)}
    assert len(keys) == 2


# -- graphs ---------------------------------------------------------------------------------------
GROUPED_NET = """
name: "grouped"
input: "data"
input_dim: 2 input_dim: 6 input_dim: 13 input_dim: 11
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
        convolution_param { num_output: 12 kernel_size: 3 pad: 1 group: 3 } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "dw" type: "Convolution" bottom: "c1" top: "dw"
        convolution_param { num_output: 12 kernel_size: 5 pad: 2 group: 12 } }
layer { name: "sum" type: "Eltwise" bottom: "dw" bottom: "c1" top: "sum" }
layer { name: "r2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "dw2" type: "Convolution" bottom: "sum" top: "dw2"
        convolution_param { num_output: 24 kernel_size: 3 stride: 2 pad: 1 group: 12 } }
layer { name: "pw" type: "Convolution" bottom: "dw2" top: "pw"
        convolution_param { num_output: 8 kernel_size: 1 group: 4 } }
"""


def test_grouped_prototxt_compiles_against_float64(ocl) -> None:
    from convforge.graph.build import compile
    from convforge.graph.caffe import load_prototxt
    from convforge.graph.ir import infer
    from convforge.graph.reference import run_reference

    g = load_prototxt(GROUPED_NET, seed=5)
    shapes = infer(g)
    assert shapes["dw2"].shape == (2, 24, 7, 6) and g.weights["c1.w"].shape == (12, 2, 3, 3)
    assert g.weights["dw.w"].shape == (12, 1, 5, 5) and g.weights["pw.w"].shape == (8, 6, 1, 1)
    x = np.random.default_rng(1).standard_normal(g.input_shape).astype(np.float32)
    for passes in (False, True):
        net = compile(g, batch=2, backend="opencl", passes=passes)
        got = net(x)["pw"]
        assert rel_l2(got, run_reference(g, x)["pw"]) < 2e-5, passes
    assert any(s.variant.startswith("depthwise(") for s in net.steps)


def test_grouped_ir_errors() -> None:
    from convforge.graph.caffe import load_prototxt
    from convforge.graph.ir import GraphError

    with pytest.raises(GraphError, match=r"node 'c1' \(conv\): group \(5\) must divide the input channels \(6\)"):
        load_prototxt(GROUPED_NET.replace("group: 3", "group: 5"))
    with pytest.raises(GraphError, match=r"group \(0\) must be >= 1|group .* must be"):
        load_prototxt(GROUPED_NET.replace("group: 3", "group: 0"))


def test_grouped_onnx_compiles_against_float64(ocl, tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install 'convforge[onnx]')")
    from onnx import TensorProto, helper, numpy_helper

    from convforge.graph.build import compile
    from convforge.graph.from_onnx import load_onnx
    from convforge.graph.reference import run_reference

    rng = np.random.default_rng(3)
    init = lambda name, *shape: numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="dw", pads=[2, 1, 1, 2], strides=[2, 2],
                              group=4),
             helper.make_node("Relu", ["c1"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="grouped", pads=[1, 1, 1, 1], group=2)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 15, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, 8, 7])],
                              [init("w1", 8, 1, 5, 5), init("b1", 8), init("w2", 6, 4, 3, 3)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    path = tmp_path / "g.onnx"
    path.write_bytes(model.SerializeToString())
    g = load_onnx(model, batch=2)
    assert g.nodes[0].attrs["group"] == 4
    x = np.random.default_rng(1).standard_normal(g.input_shape).astype(np.float32)
    got = compile(str(path), batch=2, backend="opencl")(x)["y"]
    assert rel_l2(got, run_reference(g, x)["y"]) < 2e-5


# -- CLI, suites, bench --------------------------------------------------------------------------
def test_cli_algos_and_show_grouped(capsys) -> None:  # type: ignore[no-untyped-def]
    rc, out = run_main(["algos", "--spec", "N=2,C=8,H=13,W=13,K=16,R=3,S=3,pad=1,groups=8"], capsys)
    assert rc == 0 and " g8 " in out and "+ depthwise" in out
    assert "implicit_gemm_splitk       not applicable: implicit_gemm_splitk does not take grouped layers" in out
    rc, out = run_main(["show", "--spec", "N=1,C=4,H=9,W=9,K=4,R=7,S=7,pad=3,groups=4", "--variant", "depthwise",
                        "--backend", "cuda"], capsys)
    assert rc == 0 and "conv_depthwise" in out and "g4" in out


def test_grouped_suite() -> None:
    layers = suites.load_suite("grouped")
    assert len(layers) == 60 and len({x.name for x in layers}) == 60
    assert all(x.spec.groups > 1 for x in layers)
    by = {x.name: x.spec for x in layers}
    mb = by["mobilenet_v2 dw3x3 96@112/2"]
    assert (mb.n, mb.c, mb.h, mb.stride, mb.p, mb.depthwise) == (64, 96, 112, (2, 2), 56, True)
    cn = by["convnext_tiny dw7x7 96@56 x3"]
    assert (cn.n, cn.r, cn.pad, cn.p) == (32, 7, (3, 3, 3, 3), 56)
    rx = by["resnext50_32x4d g32 3x3 1024@14/2"]
    assert (rx.groups, rx.cg, rx.p) == (32, 32, 7)
    assert by["regnet_y_1_6gf g37 3x3 888@7"].cg == 24
    counts = {m: sum(int(n.rsplit(" x", 1)[1]) if " x" in n else 1 for n in by if n.startswith(m))
              for m in ("mobilenet_v2", "convnext_tiny", "resnext50", "regnet")}
    assert counts == {"mobilenet_v2": 17, "convnext_tiny": 18, "resnext50": 16, "regnet": 27}  # issue 35's counts


def test_suite_file_groups_errors(tmp_path: Path) -> None:
    row = {"N": 1, "C": 4, "H": 9, "W": 9, "K": 4, "R": 3, "S": 3, "stride": 1, "pad": 1}
    f = tmp_path / "g.json"
    f.write_text(json.dumps([{**row, "groups": 3}]))
    with pytest.raises(suites.SuiteError, match=r"row #1: groups \(3\) must divide both C \(4\) and K \(4\)"):
        suites.load_suite(str(f))
    f.write_text(json.dumps([{**row, "groups": "4"}]))
    with pytest.raises(suites.SuiteError, match=r"row #1: 'groups' \('4'\) must be an int"):
        suites.load_suite(str(f))


def test_bench_grouped_prints_bandwidth(ocl, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "dw.json"
    f.write_text(json.dumps([{"name": "dw5", "N": 2, "C": 8, "H": 16, "W": 16, "K": 8, "R": 5, "S": 5,
                              "stride": 1, "pad": 2, "groups": 8}]))
    out = tmp_path / "out"
    rc, text = run_main(["bench", "--suite", str(f), "--backend", "opencl", "--baseline", "none", "--out", str(out),
                         "--quick-ceilings", "--repeats", "2", "--warmup", "1"], capsys)
    assert rc == 0, text
    assert "GB/s" in text and "% copy" in text and "depthwise" in text and "of the device copy" in text
    assert "own bytes" in text and "of a copy of each layer's own bytes" in text
    row = json.loads((out / "results.json").read_text())["rows"][0]
    assert row["ok"] and row["spec"]["groups"] == 8 and row["min_bytes"] == 4 * (2 * 8 * 256 * 2 + 8 * 25)
    assert row["gbs"] > 0 and row["pct_copy"] > 0 and row["pct_copy_same"] > 0
    # the same layer in NHWC memory: depthwise_nhwc, checked in that layout; a non-depthwise layer is refused
    rc, text = run_main(["bench", "--suite", str(f), "--layout", "nhwc", "--backend", "opencl", "--baseline", "none",
                         "--out", str(out), "--quick-ceilings", "--repeats", "2", "--warmup", "1"], capsys)
    assert rc == 0, text
    row = json.loads((out / "results.json").read_text())["rows"][0]
    assert row["ok"] and row["spec"]["layout"] == "nhwc" and row["algo"].startswith("depthwise_nhwc"), row
    rc, text = run_main(["bench", "--suite", "resnet", "--layout", "nhwc", "--backend", "opencl"], capsys)
    assert rc != 0 and "no opencl variant reads any layer" in text and "in NHWC" in text, text
    # a suite of both: the depthwise layer runs, the other is named and left out
    f.write_text(json.dumps([json.loads(f.read_text())[0], {"name": "plain", "N": 2, "C": 8, "H": 16, "W": 16,
                                                           "K": 8, "R": 3, "S": 3, "stride": 1, "pad": 1}]))
    rc, text = run_main(["bench", "--suite", str(f), "--layout", "nhwc", "--backend", "opencl", "--baseline", "none",
                         "--out", str(out), "--quick-ceilings", "--repeats", "2", "--warmup", "1"], capsys)
    assert rc == 0 and "no opencl variant reads layer plain" in text and "left out" in text, text
    assert [r["layer"] for r in json.loads((out / "results.json").read_text())["rows"]] == ["dw5"]


def test_bench_models_know_the_modern_cnns() -> None:
    for name in ("resnext50_32x4d", "regnet_y_1_6gf", "mobilenet_v2", "mobilenet_v3_large", "convnext_tiny",
                 "densenet121", "efficientnet_b0", "shufflenet_v2_x1_0"):
        assert models.parse_model(f"{name}:32") == (name, 32)


def test_tuning_db_keys_and_imports_grouped_entries(tmp_path: Path) -> None:
    """The database key carries groups (spec.key()), and an export of a depthwise entry imports back."""
    from dataclasses import asdict

    from convforge.tune.db import Entry, TuningDB, now

    spec = DEPTHWISE[1]
    assert spec.key().endswith("_g5")
    prm = get_variant("depthwise").default(spec, NOMINAL_CUDA)
    entry = Entry(device="cuda|nominal", backend="cuda", version="0.1.0", spec=spec.key(), dtype=spec.dtype,
                  epilogue="none", variant="depthwise", params=prm.to_json(), time_ms=0.05, workspace=0, error=1e-7,
                  date=now(), spec_json=json.dumps(spec.to_dict(), sort_keys=True))
    db = TuningDB(tmp_path / "t.sqlite")
    rep = db.import_json({"format": "convforge-tuning", "schema": 2, "entries": [asdict(entry)]})
    assert len(rep.stored) == 1, rep.rejected
    wrong = {**asdict(entry), "spec_json": json.dumps({**spec.to_dict(), "groups": 1}, sort_keys=True)}
    rep = db.import_json({"format": "convforge-tuning", "schema": 2, "entries": [wrong]})
    assert not rep.stored and "does not match its spec_json" in rep.rejected[0][1]
