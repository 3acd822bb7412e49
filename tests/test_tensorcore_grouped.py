"""Grouped convolution on the wgmma generator (kernels/tensorcore/sm90/grouped.py), on the CPU: every
group's GEMM tile by tile through the generator's own expressions (test_tensorcore_gen.emulate_gemm)
against the float64 grouped convolution, the bias index of each group's columns, the plans compiled by
nvcc, and the rule that keeps a variant no GPU has run out of 'auto'."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.nvcc import sass_report
from convforge.dispatch.choice import is_fast, slow_reason
from convforge.dtypes import rounded
from convforge.kernels import get_variant, ranked, select
from convforge.kernels.tensorcore.sm90.cexpr import evaluate
from convforge.kernels.tensorcore.sm90.isa import BF16, F16, TF32, X3TF32
from convforge.kernels.tensorcore.sm90.tiles import TileConfig
from convforge.plan import Epilogue
from convforge.reference import conv2d_ref
from convforge.spec import ConvSpec
from helpers import ptxas_reports
from test_tensorcore_gen import DTYPE_OF, _krsc, _nhwc, _parts, _truncated, emulate_gemm, images_as_channels

NAMES = {"tf32": "tc_grouped_tf32", "3xtf32": "tc_grouped_3xtf32", "f16": "tc_grouped_half", "bf16": "tc_grouped_half"}

# odd grouped layers: N = 1, stride 2 with asymmetric padding, dilation, Kg not a multiple of 4, NCHW and NHWC
CASES = [(ConvSpec.make(2, 16, 7, 9, 24, 3, 3, 1, 1, groups=2, layout="nhwc"), F16, TileConfig(64, 32, 1, 2, 1)),
         (ConvSpec.make(1, 32, 9, 11, 20, 3, 3, 2, (1, 0, 2, 1), groups=4), BF16, TileConfig(64, 32, 1, 3, 1)),
         (ConvSpec.make(2, 12, 9, 8, 24, 3, 3, 1, 2, 2, groups=3, layout="nhwc"), TF32, TileConfig(128, 32, 1, 2, 2)),
         (ConvSpec.make(1, 8, 8, 7, 6, 3, 3, 2, 1, groups=2), X3TF32, TileConfig(128, 32, 1, 2, 2, pi=2))]


def emulate_grouped(spec: ConvSpec, math, cfg: TileConfig, seed: int = 0):
    """The grouped plan's GEMM: x as the kernel reads it (NHWC, C channels a pixel; TF32 read in place is
    truncated by the tensor cores), the filters as the weight step packs them (K x (R S Cg) rows of ld),
    D through the variant's own Output (group z at channels z Kg ..). Returns (y NCHW, reference,
    writes per element)."""
    variant = get_variant(NAMES[math.name])
    spec = dataclasses.replace(spec, dtype=DTYPE_OF[math.name])
    assert variant.applies(spec, NOMINAL_CUDA) is None, variant.applies(spec, NOMINAL_CUDA)
    rng = np.random.default_rng(seed)
    x = rounded(rng.uniform(-1, 1, spec.x_shape).astype(np.float32), spec.dtype).astype(np.float64)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), spec.dtype).astype(np.float64)
    in_place_tf32 = variant._in_place(spec) and math.name == "tf32"
    xs = {"hi": _truncated(x)} if in_place_tf32 else _parts(x, math)
    ws = _parts(w, math)
    ref = sum(conv2d_ref(xs[pa], ws[pb], spec) for pa, pb in math.products)
    prob = variant.problem(spec)
    a, b = variant._operands(spec, cfg)
    ld = variant._ld(spec, cfg)
    data = {"a": {p: _nhwc(xs[p], a.geo.px) for p in math.parts},
            "b": {p: _krsc(ws[p], spec.cg, ld) for p in math.parts}}
    out = dataclasses.replace(variant.output(spec), epi=None)
    y, written = emulate_gemm(cfg, math, prob, a, b, data, out, size=int(np.prod(spec.y_shape)))
    if spec.layout == "nhwc":
        shape = (spec.n, spec.p, spec.q, spec.k)
        return y.reshape(shape).transpose(0, 3, 1, 2), ref, written.reshape(shape).transpose(0, 3, 1, 2)
    return y.reshape(spec.y_shape), ref, written.reshape(spec.y_shape)


@pytest.mark.parametrize("spec, math, cfg", CASES, ids=lambda v: getattr(v, "name", None) or str(v))
def test_emulated_grouped_gemm_equals_the_grouped_convolution(spec, math, cfg):
    """Each group's tiles read only its own Cg input channels and filters and land on its own Kg output
    channels: the float64 grouped convolution of the same operand parts, every output written once."""
    assert not cfg.problems(math), cfg.problems(math)
    got, ref, written = emulate_grouped(spec, math, cfg)
    assert (written == 1).all(), np.unique(written)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_each_group_reads_the_bias_of_its_own_channels():
    """Column k of group z adds bias[z Kg + k] (the epilogue's bias index, evaluated as the kernel has it)."""
    spec = dataclasses.replace(CASES[0][0], dtype="float16")
    out = get_variant("tc_grouped_half").output(spec, Epilogue(bias=True))
    for z in range(spec.groups):
        for k in range(spec.kg):
            assert evaluate(out.bias_col("k", "z"), {"k": k, "z": z}) == z * spec.kg + k


def test_auto_takes_the_timed_grouped_forward_and_names_its_narrow_groups_slow():
    """tc_grouped_packed_half and tc_grouped_half (timed on an H200) are in 'auto', the packed form first
    where groups pack; the unpacked form's groups of fewer than 16 output channels count as slow
    (dispatch.is_fast, so a half layer goes to PyTorch); the half grouped dgrad / wgrad are in 'auto' too,
    slow below 32 channels a group; the untimed TF32 forms are reached by name only."""
    spec = ConvSpec.make(4, 64, 15, 13, 128, 3, 3, 1, 1, groups=4, dtype="float16", layout="nhwc")
    assert [v.name for v in ranked("auto", spec, NOMINAL_CUDA)] == ["tc_grouped_packed_half", "tc_grouped_half"]
    assert is_fast(get_variant("tc_grouped_half"), spec, NOMINAL_CUDA)
    narrow = dataclasses.replace(spec, groups=16)  # 8 output channels a group
    assert not is_fast(get_variant("tc_grouped_half"), narrow, NOMINAL_CUDA)
    assert "8 output channels" in slow_reason(narrow, NOMINAL_CUDA, get_variant("tc_grouped_half"))
    f32 = dataclasses.replace(spec, dtype="float32")
    assert all(not v.name.startswith("tc_grouped") for v in ranked("auto", f32, NOMINAL_CUDA))
    wide = dataclasses.replace(spec, groups=2)  # 32 -> 64 channels a group
    for name in ("dgrad_tc_grouped_half", "wgrad_tc_grouped_half"):
        back = dataclasses.replace(spec, conv_pass=name[:5])
        assert name in [v.name for v in ranked("auto", back, NOMINAL_CUDA)]
        assert not is_fast(get_variant(name), back, NOMINAL_CUDA)  # 16 channels a group
        assert is_fast(get_variant(name), dataclasses.replace(wide, conv_pass=name[:5]), NOMINAL_CUDA)
        assert [v.name for v in select(name, back, NOMINAL_CUDA)] == [name]
    for name in ("dgrad_tc_grouped_tf32", "wgrad_tc_grouped_tf32"):
        back = dataclasses.replace(f32, conv_pass=name[:5])
        assert name not in [v.name for v in ranked("auto", back, NOMINAL_CUDA)]


@pytest.mark.parametrize("why, spec", [
    ("whole 8-channel chunks", ConvSpec.make(2, 32, 8, 8, 32, 3, 3, 1, 1, groups=8, dtype="float16")),  # Cg 4
    ("groups > 1", ConvSpec.make(2, 32, 8, 8, 32, 3, 3, 1, 1, dtype="float16"))])
def test_grouped_refuses_what_it_cannot_read(why, spec):
    assert why in get_variant("tc_grouped_half").applies(spec, NOMINAL_CUDA)


def test_grouped_wgrad_plans_compile(nvcc_ok):
    """The default wgrad plan of a ResNeXt-style layer (32 groups of 4 channels, split over its 25,088-term
    reduction: the batched reduce included), half NHWC, bfloat16 NCHW and 3xTF32 NCHW, compiles for sm_90a
    without spills (one nvcc run for the three); the groups of 4 output channels take 16-column tiles
    (``narrow_tiles``: wgmma m64n16k16) in every math mode, 3xTF32's sums promoted every 2 stages (unpromoted,
    the H200 measured 2.2e-5 on 4-channel groups: truncating tensor-core sums)."""
    labels, sources = [], []
    for name, dtype, layout in [("wgrad_tc_grouped_half", "float16", "nhwc"),
                                ("wgrad_tc_grouped_half", "bfloat16", "nchw"),
                                ("wgrad_tc_grouped_3xtf32", "float32", "nchw")]:
        v = get_variant(name)
        spec = ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1, groups=32, dtype=dtype, layout=layout,
                             conv_pass="wgrad")
        prm = v.default(spec, NOMINAL_CUDA)
        plan = v.plan(spec, prm, NOMINAL_CUDA)
        assert prm["ks"] > 1 and plan.kernels[-1].name == f"{name}_reduce", (name, prm)
        assert prm["bn"] == 16 and ".m64n16k" in plan.source("cuda"), (name, prm)
        assert prm.get("pi", 0) == (2 if "3x" in name else 0), (name, prm)  # 3xTF32 promoted as wider tiles
        labels.append(f"{name} {spec.short()}")
        sources.append(plan.source("cuda"))
    for label, infos in zip(labels, ptxas_reports(sources), strict=True):
        assert infos and all(i.spill_stores == 0 for i in infos), (label, infos)


def test_grouped_plans_compile(nvcc_ok):
    """The default plan of a ResNeXt-style grouped 3x3 layer (32 groups of 8 channels) and its steps, in
    each variant, dtype and layout below with an epilogue, compile for sm_90a without spills (one nvcc
    run for all); the GEMM is one launch over the groups."""
    labels, sources = [], []
    for name, dtype, layout, epi in [("tc_grouped_half", "float16", "nhwc", Epilogue(bias=True, relu=True)),
                                     ("tc_grouped_half", "bfloat16", "nchw", Epilogue(residual=True, silu=True)),
                                     ("tc_grouped_tf32", "float32", "nhwc", Epilogue(bias=True, residual=True)),
                                     ("tc_grouped_3xtf32", "float32", "nchw", Epilogue(bias=True, relu=True))]:
        v = get_variant(name)
        spec = ConvSpec.make(8, 256, 14, 14, 256, 3, 3, 1, 1, groups=32, dtype=dtype, layout=layout)
        plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, epi)
        assert [k.name for k in plan.kernels].count(f"{name}_gemm") == 1, name
        labels.append(f"{name} {spec.short()}")
        sources.append(plan.source("cuda"))
    for label, infos in zip(labels, ptxas_reports(sources), strict=True):
        assert infos and all(i.spill_stores == 0 for i in infos), (label, infos)


def test_emulated_grouped_dgrad_is_the_transposed_grouped_convolution():
    """dgrad_tc_grouped_half (stride 1) runs the forward on the transposed problem: dy as the input, each
    group's filters transposed (C and K swapped within the group) and rotated, as dgrad_rotate writes
    them. Emulated through the forward's GEMM, that equals the float64 input gradient."""
    from convforge.kernels.dgrad.transposed import transposed_spec
    from convforge.reference import dgrad_ref

    spec = ConvSpec.make(2, 16, 7, 6, 32, 3, 3, 1, (1, 0, 2, 1), groups=2, dtype="float16", conv_pass="dgrad",
                         layout="nhwc")
    assert get_variant("dgrad_tc_grouped_half").applies(spec, NOMINAL_CUDA) is None
    t = transposed_spec(spec)
    assert not isinstance(t, str) and t.groups == spec.groups and (t.c, t.k) == (spec.k, spec.c)
    rng = np.random.default_rng(4)
    dy = rounded(rng.uniform(-1, 1, spec.y_shape).astype(np.float32), "float16").astype(np.float64)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), "float16").astype(np.float64)
    g, kg, cg = spec.groups, spec.kg, spec.cg
    w_rot = np.empty(t.w_shape)  # w'[g cg + c, kk, R-1-r, S-1-s] = w[g kg + kk, c, r, s]
    for z in range(g):
        w_rot[z * cg:(z + 1) * cg] = w[z * kg:(z + 1) * kg].transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]
    v, cfg = get_variant("tc_grouped_half"), TileConfig(64, 32, 1, 2, 1)
    a, b = v._operands(t, cfg)
    ld = v._ld(t, cfg)
    data = {"a": {"hi": _nhwc(dy, a.geo.px)}, "b": {"hi": _krsc(w_rot, t.cg, ld)}}
    out = dataclasses.replace(v.output(t), epi=None)
    y, written = emulate_gemm(cfg, F16, v.problem(t), a, b, data, out, size=int(np.prod(t.y_shape)))
    got = y.reshape(t.n, t.p, t.q, t.k).transpose(0, 3, 1, 2)
    assert (written == 1).all()
    np.testing.assert_allclose(got, dgrad_ref(dy, w, spec), rtol=1e-10, atol=1e-10)


WGRAD = {"tf32": "wgrad_tc_grouped_tf32", "3xtf32": "wgrad_tc_grouped_3xtf32", "f16": "wgrad_tc_grouped_half",
         "bf16": "wgrad_tc_grouped_half"}
# Cg of 2 and 4 too (wgrad's channels are its images), N = 1 and 5, stride 2 with asymmetric padding
WGRAD_CASES = [(ConvSpec.make(5, 8, 7, 9, 6, 3, 3, 1, 1, groups=2), TF32, TileConfig(128, 32, 1, 2, 2, ks=3)),
               (ConvSpec.make(1, 12, 9, 8, 8, 3, 3, 2, (1, 0, 2, 1), groups=4, layout="nhwc"), F16,
                TileConfig(64, 32, 1, 2, 1)),
               (ConvSpec.make(3, 6, 8, 7, 9, 3, 3, 1, 1, groups=3), BF16, TileConfig(64, 32, 2, 2, 1, ks=2)),
               (ConvSpec.make(2, 8, 6, 6, 8, 1, 1, groups=2), X3TF32, TileConfig(128, 32, 1, 2, 2, pi=2)),
               # 16-column tiles (narrow_tiles): groups of 4 output channels, split; of 16, two consumers
               (ConvSpec.make(2, 16, 7, 9, 16, 3, 3, 1, 1, groups=4, layout="nhwc"), F16, TileConfig(64, 16, 1, 2, 1)),
               (ConvSpec.make(1, 32, 9, 8, 32, 3, 3, 2, (1, 0, 2, 1), groups=8, layout="nhwc"), F16,
                TileConfig(64, 16, 1, 2, 1, ks=2)),
               (ConvSpec.make(2, 32, 5, 6, 32, 3, 3, 1, 1, groups=2), BF16, TileConfig(128, 16, 1, 2, 2)),
               (ConvSpec.make(1, 16, 5, 7, 16, 3, 3, 1, 1, groups=4), X3TF32, TileConfig(128, 16, 1, 2, 2, pi=2))]


@pytest.mark.parametrize("spec, math, cfg", WGRAD_CASES, ids=lambda v: getattr(v, "name", None) or str(v))
def test_emulated_grouped_wgrad_equals_the_filter_gradient(spec, math, cfg):
    """wgrad_tc_grouped_*: each group's GEMM over its images of x' = [C][H][W][Np] and its rows of
    dy' = [K][P Q Np] (as the transposing steps write them), stored through dW's strided K Cg R S offsets
    (split slices in slabs of their own), equals the float64 filter gradient; every element once a slice."""
    from convforge.reference import wgrad_ref

    v = get_variant(WGRAD[math.name])
    spec = dataclasses.replace(spec, dtype=DTYPE_OF[math.name], conv_pass="wgrad")
    assert v.applies(spec, NOMINAL_CUDA) is None, v.applies(spec, NOMINAL_CUDA)
    assert not cfg.problems(math, v.problem(spec)), cfg.problems(math, v.problem(spec))
    rng = np.random.default_rng(2)
    x = rounded(rng.uniform(-1, 1, spec.x_shape).astype(np.float32), spec.dtype).astype(np.float64)
    dy = rounded(rng.uniform(-1, 1, spec.y_shape).astype(np.float32), spec.dtype).astype(np.float64)
    xs, ds = _parts(x, math), _parts(dy, math)
    ref = sum(wgrad_ref(xs[pa], ds[pb], spec) for pa, pb in math.products)
    prob = v.problem(spec)
    cp = prob.kred // (spec.p * spec.q)
    a, b = v.operands(spec, cfg)

    data = {"a": {p: images_as_channels(xs[p], cp) for p in math.parts},
            "b": {p: images_as_channels(ds[p], cp) for p in math.parts}}
    out = dataclasses.replace(v.output(spec), epi=None)
    size = int(np.prod(spec.w_shape))
    y, written = emulate_gemm(cfg, math, prob, a, b, data, out, size=cfg.ks * size)
    got = y.reshape(cfg.ks, -1).sum(0).reshape(spec.w_shape)
    assert (written.reshape(cfg.ks, -1) == 1).all(), np.unique(written)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_grouped_wgrad_reduce_sums_each_groups_slices_into_its_filters():
    """The batched split-K reduce (epilogue.reduce_lines, the kernel's own strings): element e of the
    partials (group bz's planar (m, k) from bz m n on, slice z at e + z total) lands on dW's
    ((bz Kg + k) Cg + c) R S + r s, each filter element exactly once."""
    from convforge.kernels.tensorcore.sm90.epilogue import reduce_lines

    spec = ConvSpec.make(2, 12, 9, 8, 8, 3, 3, 1, 1, groups=4, conv_pass="wgrad")
    v = get_variant("wgrad_tc_grouped_tf32")
    out, prob = v.output(spec), v.problem(spec)
    total, rs = prob.batch * prob.m * prob.n, spec.r * spec.s
    lines = reduce_lines(out, 3, total, prob.batch)
    assert lines[3:5] == [f"s += part[e + {total}];", f"s += part[e + {2 * total}];"]
    seen = np.zeros(total, int)
    for e in range(total):
        env = {"e": e}
        for line in lines[:2]:
            for decl in line.removeprefix("const int ").rstrip(";").split(", "):
                name, expr = decl.split(" = ", 1)
                env[name] = evaluate(expr, env)
        o = evaluate(lines[5].removeprefix("const int o = ").rstrip(";"), env)
        c, r_s = divmod(env["m"], rs)
        assert o == ((env["bz"] * spec.kg + env["k"]) * spec.cg + c) * rs + r_s
        seen[o] += 1
    assert (seen == 1).all()


# -- narrow groups packed block-diagonally (tc_grouped_packed_half) ------------------------------------------------
def _block_diagonal(w: np.ndarray, groups: int, p: int) -> np.ndarray:
    """K x Cg x R x S filters as the packed GEMM's K x (P Cg) x R x S: row k's channels at (k / Kg % P) Cg."""
    k, cg = w.shape[:2]
    kg = k // groups
    out = np.zeros((k, p * cg) + w.shape[2:])
    for row in range(k):
        b = row // kg % p
        out[row, b * cg:(b + 1) * cg] = w[row]
    return out


PACKED = [(ConvSpec.make(2, 32, 7, 6, 32, 3, 3, 1, 1, groups=8, layout="nhwc"), F16, TileConfig(64, 32, 1, 2, 1)),
          (ConvSpec.make(1, 128, 9, 8, 128, 3, 3, 2, (1, 0, 2, 1), groups=16), BF16, TileConfig(128, 64, 1, 2, 2)),
          (ConvSpec.make(3, 96, 5, 5, 48, 1, 1, groups=12, layout="nhwc"), F16, TileConfig(64, 64, 1, 2, 1))]


@pytest.mark.parametrize("spec, math, cfg", PACKED, ids=lambda v: getattr(v, "name", None) or str(v))
def test_emulated_packed_groups_equal_the_grouped_convolution(spec, math, cfg):
    """ResNeXt-style narrow groups (4 and 8 channels; 12 groups of 8 -> 4 in 1x1) packed P to a GEMM group
    with block-diagonal filters: every tile through the generator's expressions equals the float64 grouped
    convolution, every output written once."""
    from convforge.kernels.tensorcore.sm90.grouped import pack_factor

    variant = get_variant("tc_grouped_packed_half")
    spec = dataclasses.replace(spec, dtype=DTYPE_OF[math.name])
    assert variant.applies(spec, NOMINAL_CUDA) is None, variant.applies(spec, NOMINAL_CUDA)
    p = pack_factor(spec)
    assert p >= 2 and not cfg.problems(math)
    rng = np.random.default_rng(7)
    x = rounded(rng.uniform(-1, 1, spec.x_shape).astype(np.float32), spec.dtype).astype(np.float64)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), spec.dtype).astype(np.float64)
    ref = conv2d_ref(x, w, spec)
    prob, (a, b) = variant.problem(spec), variant._operands(spec, cfg)
    ld = variant._ld(spec, cfg)
    data = {"a": {"hi": _nhwc(x, a.geo.px)}, "b": {"hi": _krsc(_block_diagonal(w, spec.groups, p), p * spec.cg, ld)}}
    out = dataclasses.replace(variant.output(spec), epi=None)
    y, written = emulate_gemm(cfg, math, prob, a, b, data, out, size=int(np.prod(spec.y_shape)))
    shape = (spec.n, spec.p, spec.q, spec.k) if spec.layout == "nhwc" else spec.y_shape
    y, written = y.reshape(shape), written.reshape(shape)
    if spec.layout == "nhwc":
        y, written = y.transpose(0, 3, 1, 2), written.transpose(0, 3, 1, 2)
    assert (written == 1).all(), np.unique(written)
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-10)


def test_emulated_packed_dgrad_is_the_transposed_grouped_convolution():
    """dgrad_tc_grouped_packed_half (stride 1): the packed forward on the transposed problem, its
    block-diagonal filters built from the rotated ones (dgrad_rotate, then the packed filter step):
    equals the float64 input gradient, every dx element written once. In 'auto' (timed), never slow."""
    from convforge.kernels.dgrad.transposed import transposed_spec
    from convforge.kernels.tensorcore.sm90.grouped import pack_factor
    from convforge.reference import dgrad_ref

    spec = ConvSpec.make(2, 32, 7, 6, 64, 3, 3, 1, (1, 0, 2, 1), groups=8, dtype="float16", conv_pass="dgrad",
                         layout="nhwc")
    dv = get_variant("dgrad_tc_grouped_packed_half")
    assert not dv.named_only and dv.applies(spec, NOMINAL_CUDA) is None and dv.slow_on(spec) is None
    assert [v.name for v in ranked("auto", spec, NOMINAL_CUDA)][0] == "dgrad_tc_grouped_packed_half"
    t = transposed_spec(spec)
    assert not isinstance(t, str)
    rng = np.random.default_rng(6)
    dy = rounded(rng.uniform(-1, 1, spec.y_shape).astype(np.float32), "float16").astype(np.float64)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), "float16").astype(np.float64)
    g, kg, cg = spec.groups, spec.kg, spec.cg
    w_rot = np.empty(t.w_shape)
    for z in range(g):
        w_rot[z * cg:(z + 1) * cg] = w[z * kg:(z + 1) * kg].transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]
    v, cfg = get_variant("tc_grouped_packed_half"), TileConfig(64, 64, 1, 2, 1)
    p = pack_factor(t)
    assert p >= 2
    a, b = v._operands(t, cfg)
    ld = v._ld(t, cfg)
    data = {"a": {"hi": _nhwc(dy, a.geo.px)}, "b": {"hi": _krsc(_block_diagonal(w_rot, t.groups, p), p * t.cg, ld)}}
    out = dataclasses.replace(v.output(t), epi=None)
    y, written = emulate_gemm(cfg, F16, v.problem(t), a, b, data, out, size=int(np.prod(t.y_shape)))
    got = y.reshape(t.n, t.p, t.q, t.k).transpose(0, 3, 1, 2)
    assert (written == 1).all()
    np.testing.assert_allclose(got, dgrad_ref(dy, w, spec), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("groups, cg, kg, r", [(8, 4, 4, 3), (16, 8, 8, 3), (12, 8, 4, 1)])
def test_block_diagonal_filter_step_on_pocl(ocl, groups, cg, kg, r):
    """The packed variant's filter step (prep.w_krsc with ``block``) writes each row's Cg channels at its
    group's place in the packed row and zeros elsewhere (the output poisoned first)."""
    from convforge.kernels.tensorcore.sm90 import prep
    from convforge.kernels.tensorcore.sm90.grouped import pack_factor
    from test_channels_last_train import _on_pocl

    spec = ConvSpec.make(1, groups * cg, 5, 5, groups * kg, r, r, groups=groups, dtype="float16")
    p = pack_factor(spec)
    g = dataclasses.replace(spec, groups=groups // p)
    ld = (r * r * g.cg + 63) // 64 * 64
    kern, grid = prep.w_krsc(dataclasses.replace(g, c=g.cg, groups=1), F16, g.cg, ld, block=(kg, cg))
    w = np.random.default_rng(groups).uniform(-2, 2, spec.w_shape).astype(np.float16).astype(np.float32)
    got = _on_pocl(ocl, kern, grid, "w", w, (spec.k, ld), "float16")
    want = _krsc(_block_diagonal(w.astype(np.float64), groups, p), g.cg, ld).reshape(spec.k, ld)
    np.testing.assert_array_equal(got, want)


def test_packed_plans_compile(nvcc_ok):
    """ResNeXt-50's first-stage grouped 3x3 (32 groups of 4, packed 16 to a group) compiles for sm_90a
    without spills; ``auto`` takes the packed variant ahead of the unpacked form (timed on a GPU)."""
    v = get_variant("tc_grouped_packed_half")
    spec = ConvSpec.make(8, 128, 28, 28, 128, 3, 3, 1, 1, groups=32, dtype="float16", layout="nhwc")
    assert not v.named_only and v.applies(spec, NOMINAL_CUDA) is None
    names = [x.name for x in ranked("auto", spec, NOMINAL_CUDA)]
    assert names[0] == "tc_grouped_packed_half", names
    infos, _ = sass_report(v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(bias=True, relu=True))
                           .source("cuda"))
    assert infos and all(i.spill_stores == 0 for i in infos), infos


def test_variants_that_say_tensor_cores_plan_on_tensor_cores():
    """``Variant.tensor_cores`` lets dispatch.is_fast skip building a plan: every variant that sets it
    plans each layer it applies to (dense, 1x1, strided, grouped, depthwise; each pass; each dtype) with
    kernels on tensor cores, and at least one such plan was checked per variant."""
    from convforge.dispatch.choice import TENSOR_CORE_FEATURES
    from convforge.kernels import all_variants

    layers = [ConvSpec.make(2, 16, 9, 9, 24, 3, 3, 1, 1), ConvSpec.make(2, 32, 7, 7, 64, 1, 1),
              ConvSpec.make(1, 16, 11, 11, 32, 3, 3, 2, 1), ConvSpec.make(2, 64, 9, 9, 128, 3, 3, 1, 1, groups=2),
              ConvSpec.make(2, 32, 8, 8, 32, 3, 3, 1, 1, groups=32), ConvSpec.make(2, 3, 32, 32, 64, 7, 7, 2, 3),
              ConvSpec.make(2, 64, 10, 10, 128, 3, 3, 2, 1, groups=2),
              ConvSpec.make(2, 64, 9, 9, 64, 3, 3, 1, 1, groups=8), ConvSpec.make(2, 64, 8, 8, 128, 1, 1, 2, 0),
              ConvSpec.make(4, 256, 16, 16, 512, 1, 1),
              ConvSpec.make(2, 32, 8, 8, 64, 2, 2, 2, 0)]  # 2x2/2 (an up-convolution's dgrad: the paired form)
    checked: dict[str, int] = {}
    for v in all_variants():
        if not v.tensor_cores:
            continue
        checked[v.name] = 0
        for base in layers:
            for dtype, layout, conv_pass in [(d, lay, p) for d in ("float32", "float16", "bfloat16")
                                             for lay in ("nchw", "nhwc") for p in ("fprop", "dgrad", "wgrad")]:
                spec = dataclasses.replace(base, dtype=dtype, layout=layout, conv_pass=conv_pass)
                if v.applies(spec, NOMINAL_CUDA) is not None:
                    continue
                plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
                assert plan.requires & TENSOR_CORE_FEATURES, (v.name, spec.short())
                checked[v.name] += 1
    assert checked and not [n for n, c in checked.items() if c == 0], checked


@pytest.mark.parametrize("shape, slow", [
    ((32, 512, 56, 56, 512, 3, 3, 2, 1, 32), True),  # ResNeXt-101 512g32@56/2: 0.79x on the H200
    ((64, 64, 112, 112, 64, 3, 3, 2, 1, 4), True),  # RegNetY-800MF 64@112/2: 0.77x
    ((64, 144, 56, 56, 144, 3, 3, 2, 1, 9), True),  # RegNetY-800MF 144@56/2: 0.75x
    ((64, 320, 28, 28, 320, 3, 3, 2, 1, 20), False),  # the same groups on 28 rows: 1.21x
    ((32, 256, 56, 56, 256, 3, 3, 2, 1, 32), False),  # groups of 8 at stride 2: 1.07x
    ((32, 512, 28, 28, 512, 3, 3, 1, 1, 32), False),  # stride 1
], ids=["512g32@56/2", "64@112/2", "144@56/2", "320@28/2", "256g32@56/2", "512g32@28"])
def test_packed_forward_hands_back_the_strided_layers_measured_slow(shape, slow):
    """tc_grouped_packed_half counts itself slow (convforge.torch hands the layer to PyTorch) on groups of 16
    channels at stride 2 on planes of >= 56 rows, measured below cuDNN-best FP16, and only there; it is
    what auto runs on each of these layers."""
    n, c, h, w, k, r, s, stride, pad, groups = shape
    spec = ConvSpec.make(n, c, h, w, k, r, s, stride, pad, groups=groups, dtype="float16", layout="nhwc")
    v = get_variant("tc_grouped_packed_half")
    assert [x.name for x in ranked("auto", spec, NOMINAL_CUDA)][0] == v.name
    assert bool(v.slow_on(spec)) == slow, v.slow_on(spec)
    assert get_variant("dgrad_tc_grouped_packed_half").slow_on(spec.with_pass("dgrad")) is None
