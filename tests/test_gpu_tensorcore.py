"""GPU tier of the wgmma generator (kernels/tensorcore/sm90/): every variant x dtype against float64.

Skips without a CUDA device of compute capability 9.0. One device call runs it all:
``python3 -m pytest -q tests/test_gpu_tensorcore.py`` (a few minutes on an H100/H200).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from convforge.check import check_plan, expected, pass_inputs
from convforge.dtypes import to_storage
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm90 import tma
from convforge.kernels.tensorcore.sm90.tiles import TileConfig
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.reference import rel_l2
from convforge.spec import ConvSpec
from helpers import ODD_SPECS

GEMMS = ("tc_implicit_gemm_tf32", "tc_implicit_gemm_3xtf32", "tc_implicit_gemm_half", "tc_implicit_gemm_3xf16",
         "tc_implicit_gemm_sf16")
WINOGRAD = ("tc_winograd_f2", "tc_winograd_f2_3xtf32", "tc_winograd_f4_3xtf32", "tc_winograd_f4")
EXTRA = [ConvSpec.make(2, 70, 9, 9, 36, 3, 3, 1, 1), ConvSpec.make(1, 4, 15, 15, 130, 3, 1, (1, 2), (1, 1, 0, 0)),
         ConvSpec.make(3, 37, 13, 7, 257, 3, 3, 1, (0, 1, 2, 1)), ConvSpec.make(2, 64, 7, 7, 96, 1, 1),
         ConvSpec.make(1, 3, 31, 29, 64, 7, 7, 2, 3)]
PLANAR_1X1 = [ConvSpec.make(3, 7, 4, 5, 67, 1, 1), ConvSpec.make(2, 130, 4, 2, 9, 1, 1),
              ConvSpec.make(32, 256, 56, 56, 64, 1, 1), ConvSpec.make(5, 33, 4, 6, 40, 1, 1)]
RESNET = [ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1),
          ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1), ConvSpec.make(32, 512, 7, 7, 512, 3, 3, 1, 1),
          ConvSpec.make(32, 1024, 14, 14, 256, 1, 1), ConvSpec.make(32, 3, 224, 224, 64, 7, 7, 2, 3)]
WGRAD = ("wgrad_tc_implicit_gemm_tf32", "wgrad_tc_implicit_gemm_3xtf32", "wgrad_tc_implicit_gemm_half",
         "wgrad_tc_gemm1x1_tf32", "wgrad_tc_gemm1x1_half", "wgrad_tc_implicit_gemm_3xf16")
DGRAD = ("dgrad_tc_strided_tf32", "dgrad_tc_strided_3xtf32", "dgrad_tc_strided_half", "dgrad_tc_strided_3xf16")
DTYPES = {"tc_implicit_gemm_half": ("float16", "bfloat16"), "tc_winograd_f2": ("float32", "float16", "bfloat16"),
          "tc_winograd_f4": ("float32", "float16", "bfloat16"),
          "wgrad_tc_implicit_gemm_half": ("float16", "bfloat16"), "wgrad_tc_gemm1x1_half": ("float16", "bfloat16"),
          "dgrad_tc_strided_half": ("float16", "bfloat16"), "dgrad_tc_paired_half": ("float16", "bfloat16")}
STRIDED = [ConvSpec.make(2, 6, 9, 7, 10, 1, 1, 2), ConvSpec.make(1, 9, 13, 11, 5, 3, 3, (2, 3), (1, 0, 2, 1)),
           ConvSpec.make(3, 5, 8, 8, 70, 3, 3, 2, 1), ConvSpec.make(32, 128, 56, 56, 128, 3, 3, 2, 1),
           ConvSpec.make(32, 256, 56, 56, 512, 1, 1, 2), ConvSpec.make(32, 512, 14, 14, 512, 3, 3, 2, 1),
           ConvSpec.make(1, 16, 1, 1, 16, 1, 1, 2, 1)]  # no tap reaches dx: zeros, no GEMM
# dgrad_tc_paired_half: 2x2/2 up-convolutions (odd sizes; UNet's widest, NCHW and
# NHWC), 6x6/2 with padding 2, an FCN-8s-like 16x16/8 head (two runs of four column phases)
PAIRED = [ConvSpec.make(2, 5, 14, 10, 7, 2, 2, 2, 0), ConvSpec.make(1, 8, 10, 18, 16, 2, 2, 2, 0, layout="nhwc"),
          ConvSpec.make(1, 6, 10, 12, 9, 6, 6, 2, 2), ConvSpec.make(1, 3, 24, 16, 5, 16, 16, 8, 4, layout="nhwc"),
          ConvSpec.make(4, 64, 256, 256, 128, 2, 2, 2, 0),
          ConvSpec.make(4, 64, 256, 256, 128, 2, 2, 2, 0, layout="nhwc")]


@pytest.fixture(scope="module")
def hopper(cuda):
    if cuda.device.cc != (9, 0):
        pytest.skip(f"GPU tier of the wgmma generator needs compute capability 9.0 ({cuda.device.name})")
    return cuda


def _as(spec: ConvSpec, dtype: str) -> ConvSpec:
    return ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype})


def _cases(names, specs):
    for name, spec in itertools.product(names, specs):
        for dtype in DTYPES.get(name, ("float32",)):
            yield name, _as(spec, dtype)


def _points(v, spec, dev, k=3):
    """The default and ``k`` other space points spread over the space (other widths, splits, stage
    counts, non-persistent grids)."""
    space = v.space(spec, dev)
    step = max(1, len(space) // (k + 1))
    return list(dict.fromkeys([space[0]] + space[step::step][:k]))


@pytest.mark.parametrize("name, spec", list(_cases(GEMMS + WINOGRAD, ODD_SPECS + EXTRA)), ids=str)
def test_odd_shapes_against_float64(hopper, name, spec):
    v = get_variant(name)
    if v.applies(spec, hopper.device):
        pytest.skip(v.applies(spec, hopper.device))
    for prm in _points(v, spec, hopper.device):
        res = check_plan(v.plan(spec, prm, hopper.device), hopper, seed=1)
        assert res.ok, f"{name} [{prm.short()}] {spec.short()}: {res}"


TRAINING = list(_cases(WGRAD, ODD_SPECS + EXTRA + RESNET + PLANAR_1X1)) + list(
    _cases(DGRAD, ODD_SPECS + EXTRA + STRIDED)) + list(_cases(("dgrad_tc_paired_half",), PAIRED))


@pytest.mark.parametrize("name, spec", TRAINING, ids=str)
def test_training_pass_against_float64(hopper, name, spec):
    """The backward passes on the generator (tensorcore/sm90/wgrad.py: the transposed forward problem and
    the in-place 1x1; tensorcore/sm90/dgrad.py: one GEMM per stride phase, interleaved or stored on dx's
    sub-grids): the default and three other
    space points on odd shapes (the default only on the big layers), NaN-poisoned outputs against the
    float64 gradient of the same inputs."""
    v = get_variant(name)
    spec = spec.with_pass(next(iter(v.passes)))
    if v.applies(spec, hopper.device):
        pytest.skip(v.applies(spec, hopper.device))
    points = _points(v, spec, hopper.device, k=3 if spec.flops < 4e9 else 0)
    if "il" in points[0]:  # strided dgrad: the phase buffers interleaved (default) and the direct stores
        points = list(dict.fromkeys(points + [points[0].replace(il=0)]))
    for prm in points:
        res = check_plan(v.plan(spec, prm, hopper.device), hopper, seed=2)
        assert res.ok, f"{name} [{prm.short()}] {spec.short()}: {res}"


# dgrad_tc_paired_half with an NCHW dy read as it lies (mn=1: MN-major 3-D tiled copies, B MN-major; its NCHW
# default where it applies): odd C, a K tail, several images; UNet's widest and narrowest up-convolutions; 4x4/4
PAIRED_MN = [(ConvSpec.make(2, 5, 16, 16, 72, 2, 2, 2, 0), TileConfig(64, 64, 1, 4, 1, tm=1, mn=1)),
             (ConvSpec.make(3, 40, 16, 32, 64, 2, 2, 2, 0), TileConfig(128, 64, 1, 4, 2, tm=1, mn=1)),
             (ConvSpec.make(1, 6, 32, 32, 16, 4, 4, 4, 0), TileConfig(64, 64, 1, 4, 1, tm=1, mn=1)),
             (ConvSpec.make(4, 64, 256, 256, 128, 2, 2, 2, 0), TileConfig(128, 128, 1, 4, 2, tm=1, mn=1)),
             (ConvSpec.make(4, 512, 32, 32, 1024, 2, 2, 2, 0), TileConfig(128, 128, 1, 4, 2, tm=1, mn=1))]


@pytest.mark.parametrize("spec, cfg", PAIRED_MN, ids=lambda v: v.short() if hasattr(v, "short") else None)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paired_dy_in_place_against_float64(hopper, spec, cfg, dtype):
    """The paired strided dgrad reading an NCHW dy in place (mn=1), NaN-poisoned dx against float64."""
    _strided_case(hopper, "dgrad_tc_paired_half", spec, dtype, cfg.params().replace(il=0))


def _strided_case(hopper, name: str, spec: ConvSpec, dtype: str, params) -> None:  # type: ignore[no-untyped-def]
    """Variant ``name``'s plan of ``params`` on the dgrad of ``spec`` in ``dtype`` (its forms' reasons
    none), NaN-poisoned dx against float64."""
    v = get_variant(name)
    spec = dataclasses.replace(spec, dtype=dtype, conv_pass="dgrad")
    cfg = TileConfig.of(Params({k: val for k, val in params.items() if k not in ("il", "jn")}))
    assert v.applies(spec, hopper.device) is None
    assert not params.get("mn") or v.mn_reason(spec) is None
    assert not params.get("jn") or v.jn_reason(spec, cfg) is None
    res = check_plan(v.plan(spec, params, hopper.device), hopper, seed=3)
    assert res.ok, f"{name} [{params.short()}] {spec.short()}: {res}"


# dgrad_tc_strided_half with its column phases joined in registers (jn=1, NCHW half dx, stored as pairs;
# the default where the phases' tiles fill the GPU): odd C and K by cp.async, DCGAN's 4x4/2 and SD-VAE-like
# widths by TMA, a 3x3/2 (ResNet's downsampling dgrad: phases of 1 and 2 taps), N = 3
JOINED = [(ConvSpec.make(2, 5, 16, 16, 72, 4, 4, 2, 1), TileConfig(64, 64, 1, 4, 1, ps=0)),
          (ConvSpec.make(3, 24, 14, 14, 40, 3, 3, 2, 1), TileConfig(64, 32, 1, 4, 1, ps=0)),
          (ConvSpec.make(16, 64, 32, 32, 128, 4, 4, 2, 1), TileConfig(128, 64, 1, 4, 2, ps=0, tm=1)),
          (ConvSpec.make(1, 128, 64, 64, 128, 4, 4, 2, 1), TileConfig(128, 128, 1, 4, 2, ps=0, tm=1)),
          (ConvSpec.make(2, 256, 28, 28, 128, 3, 3, 2, 1), TileConfig(128, 128, 1, 4, 2, ps=0, tm=1))]


@pytest.mark.parametrize("spec, cfg", JOINED, ids=lambda v: v.short() if hasattr(v, "short") else None)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_strided_joined_against_float64(hopper, spec, cfg, dtype):
    """The strided dgrad with column phases joined in registers (jn=1), NaN-poisoned dx against float64."""
    _strided_case(hopper, "dgrad_tc_strided_half", spec, dtype, cfg.params().replace(il=0, jn=1))


# dgrad_tc_strided_half reading an NCHW dy as it lies (mn=1: 4-D tiled TMA boxes of 64 pixels of a dy row at each
# tap's row offset, zeros outside; B MN-major), with and without the joined stores: r x 2 filters at stride 2, whose
# phases' column taps start on 16-byte boundaries (a 4x4/2 layer's do not: refused, the H200 faulted on them)
STRIDED_MN = [(dataclasses.replace(ConvSpec.make(1, 64, 128, 128, 64, 4, 2, 2, (1, 1, 0, 0)), layout="nchw"),
               TileConfig(128, 64, 1, 4, 2, ps=0, tm=1, mn=1)),
              (dataclasses.replace(ConvSpec.make(2, 32, 12, 128, 128, 3, 2, 2, (1, 1, 0, 0)), layout="nchw"),
               TileConfig(128, 64, 1, 4, 2, ps=0, tm=1, mn=1))]


@pytest.mark.parametrize("spec, cfg", STRIDED_MN, ids=lambda v: v.short() if hasattr(v, "short") else None)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("jn", [0, 1])
def test_strided_dy_in_place_against_float64(hopper, spec, cfg, dtype, jn):
    """The strided dgrad reading an NCHW dy in place (mn=1), NaN-poisoned dx against float64."""
    _strided_case(hopper, "dgrad_tc_strided_half", spec, dtype, cfg.params().replace(il=0, jn=jn))


EPILOGUES = [Epilogue(bias=True, relu=True), Epilogue(residual=True, relu=True), Epilogue(bias=True, k_total=80,
                                                                                          k_offset=9)]


@pytest.mark.parametrize("name, spec", list(_cases(GEMMS + WINOGRAD[:1], EXTRA[:3])), ids=str)
@pytest.mark.parametrize("epi", EPILOGUES, ids=lambda e: e.tag())
def test_epilogues(hopper, name, spec, epi):
    v = get_variant(name)
    if v.applies(spec, hopper.device) or (epi.residual and not v.residual_ok) or (epi.k_total and not v.offset_ok):
        pytest.skip("not applicable")
    if epi.k_total and epi.k_total < spec.k + epi.k_offset:
        epi = Epilogue(bias=True, k_total=spec.k + 20, k_offset=9)
    space = v.space(spec, hopper.device)
    split = next((p for p in space if p.get("ks", 1) > 1), None)
    for prm in [space[0]] + ([split] if split else []):
        plan = v.plan(spec, prm, hopper.device, epi)
        res = _check_offset(plan, hopper) if epi.k_total else check_plan(plan, hopper, seed=2)
        assert res[0] if epi.k_total else res.ok, f"{name} [{prm.short()}] {spec.short()}{epi.tag()}: {res}"


def _check_offset(plan, be):
    """(ok, error, untouched): the plan writes channels k_offset .. + K of an N x k_total x P x Q tensor
    poisoned with NaN; those equal float64, every other channel is still NaN."""
    spec, epi = plan.spec, plan.epilogue
    inputs = pass_inputs(spec, np.random.default_rng(7), epi)
    shape = (spec.n, epi.k_total, spec.p, spec.q)
    bufs = {k: be.upload(to_storage(a, spec.dtype)) for k, a in inputs.items()}
    bufs["y"] = be.upload(to_storage(np.full(shape, np.nan, np.float32), spec.dtype))
    be.executable(plan)(bufs)
    be.synchronize()
    out = be.download(bufs["y"], shape, spec.dtype)
    mine = out[:, epi.k_offset:epi.k_offset + spec.k]
    err = rel_l2(mine, expected(spec, inputs, epi))
    rest = np.delete(out, np.s_[epi.k_offset:epi.k_offset + spec.k], axis=1)
    return bool(err <= plan.tolerance and np.isnan(rest).all() and not np.isnan(mine).any()), err, int(
        np.isnan(rest).sum()), rest.size


@pytest.mark.parametrize("name, spec", list(_cases(GEMMS, RESNET)) + list(_cases(WINOGRAD, RESNET[:4])), ids=str)
def test_resnet_layers(hopper, name, spec):
    """Defaults on ResNet layers (the first 2 images checked), and 3xTF32 FP32-grade on each."""
    v = get_variant(name)
    if v.applies(spec, hopper.device):
        pytest.skip(v.applies(spec, hopper.device))
    res = check_plan(v.plan(spec, v.default(spec, hopper.device), hopper.device), hopper, seed=3, batch_slice=2)
    assert res.ok, f"{name} {spec.short()}: {res}"
    if "3xtf32" in name or "3xf16" in name:
        assert res.rel_err <= 5e-6, f"{name} not FP32-grade on {spec.short()}: {res.rel_err:.2e}"


X3H_SCALES = [(1e-30, 1e25), (3e20, 1e-12), (1.0, 0.0), (2.0**-120, 1.0)]


@pytest.mark.parametrize("name, spec", [("tc_implicit_gemm_3xf16", ConvSpec.make(2, 70, 9, 9, 36, 3, 3, 1, 1)),
                                        ("dgrad_tc_implicit_gemm_3xf16", ConvSpec.make(3, 37, 13, 7, 40, 3, 3, 1, 1)),
                                        ("wgrad_tc_implicit_gemm_3xf16", ConvSpec.make(5, 9, 13, 11, 24, 3, 3, 2, 1)),
                                        ("dgrad_tc_strided_3xf16", ConvSpec.make(3, 37, 13, 7, 40, 3, 3, 2, 1)),
                                        ("tc_implicit_gemm_sf16", ConvSpec.make(2, 70, 9, 9, 36, 3, 3, 1, 1))],
                         ids=str)
@pytest.mark.parametrize("scales", X3H_SCALES, ids=str)
def test_3xf16_scales_follow_the_data(hopper, name, spec, scales):
    """3xFP16 scales each operand by the power of two its maximum gives: operands 1e-30 and 1e25,
    3e20 and 1e-12, a zero operand, one at 2^-120 (past FP16's range every one) stay FP32-grade
    (<= 5e-6 against float64, NaN-poisoned output; all zeros exact; scaled FP16 TF32-grade, <= 5e-4,
    where TF32 measures 2-4e-4); a NaN or an infinity in the
    activation operand reaches the outputs it touches, as in FP32, and no others (the maximum skips
    them, so the other elements keep their scale)."""
    v = get_variant(name)
    spec = spec.with_pass(next(iter(v.passes)))
    plan = v.plan(spec, v.default(spec, hopper.device), hopper.device)
    inputs = pass_inputs(spec, np.random.default_rng(11), Epilogue())
    first, second = [k for k in ("x", "w", "y") if k in inputs and k != spec.output]
    inputs[first] = inputs[first] * scales[0]
    inputs[second] = inputs[second] * scales[1]
    got = _run_poisoned(plan, hopper, inputs)
    ref = expected(spec, inputs, Epilogue())
    if not np.abs(ref).max():
        assert not np.abs(got).max() and not np.isnan(got).any()
    else:
        bound = 5e-4 if name.endswith("sf16") else 5e-6
        assert rel_l2(got, ref) <= bound, f"{name} {scales}: {rel_l2(got, ref):.2e}"
    if scales == X3H_SCALES[0]:  # into the activation operand (a filter's NaN meets the padding's zeros)
        bad_in = "y" if spec.output == "x" else "x"
        other = second if bad_in == first else first
        for bad in (np.nan, np.inf):
            poisoned = dict(inputs)
            poisoned[bad_in] = inputs[bad_in].copy()
            poisoned[bad_in].flat[7] = bad
            out = _run_poisoned(plan, hopper, poisoned)
            one = np.zeros_like(inputs[bad_in])
            one.flat[7] = 1.0  # the outputs the element reaches: nonzero with every other operand positive
            reach = expected(spec, {bad_in: one, other: np.abs(inputs[other]) + 1.0}, Epilogue()) != 0
            assert np.isfinite(out[~reach]).all() and not np.isfinite(out[reach]).any()


def _run_poisoned(plan, be, inputs):
    """The plan's output on ``inputs`` (float32), written over NaN."""
    spec = plan.spec
    bufs = {k: be.upload(to_storage(a, spec.dtype)) for k, a in inputs.items() if k != spec.output}
    shape = {"y": spec.y_shape, "x": spec.x_shape, "w": spec.w_shape}[spec.output]
    bufs[spec.output] = be.upload(np.full(shape, np.nan, np.float32))
    be.executable(plan)(bufs)
    be.synchronize()
    return be.download(bufs[spec.output], shape, spec.dtype).astype(np.float64)


@pytest.mark.parametrize("prm", [Params(bm=128, bn=256, kb=1, st=3, cw=2, ks=1, ps=1),
                                 Params(bm=256, bn=128, kb=1, st=3, cw=2, ks=1, ps=0),
                                 Params(bm=64, bn=64, kb=2, st=4, cw=1, ks=3, ps=1),
                                 Params(bm=128, bn=96, kb=2, st=3, cw=1, ks=1, ps=1),
                                 Params(bm=128, bn=192, kb=1, st=4, cw=2, ks=1, ps=1)], ids=lambda p: p.short())
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tile_shapes(hopper, prm, dtype):
    spec = _as(ConvSpec.make(3, 96, 19, 17, 200, 3, 3, 1, 1), dtype)
    v = get_variant("tc_implicit_gemm_tf32" if dtype == "float32" else "tc_implicit_gemm_half")
    res = check_plan(v.plan(spec, prm, hopper.device, Epilogue(bias=True)), hopper, seed=4)
    assert res.ok, f"{prm.short()}: {res}"


def test_promotion_keeps_3xtf32_fp32_grade(hopper):
    """A 4608-term reduction: the unpromoted tensor-core sums drift (the mma.sync 3xTF32 measured 3.2e-5),
    promoted every 4 stages they stay FP32-grade."""
    spec = ConvSpec.make(4, 512, 14, 14, 128, 3, 3, 1, 1)
    v = get_variant("tc_implicit_gemm_3xtf32")
    prm = v.default(spec, hopper.device)
    err = check_plan(v.plan(spec, prm, hopper.device), hopper, seed=5).rel_err
    raw = check_plan(v.plan(spec, Params({k: x for k, x in prm.items() if k != "pi"}), hopper.device), hopper,
                     seed=5).rel_err
    print(f"3xTF32 C*R*S = 4608: promoted {err:.2e}, not promoted {raw:.2e}")
    assert err <= 5e-6


KR_POINTS = [("tc_implicit_gemm_3xf16", Params(bm=128, bn=128, kb=1, st=3, cw=2, ks=1, ps=1, tm=1, kr=1)),
             ("tc_implicit_gemm_3xf16", Params(bm=128, bn=64, kb=1, st=4, cw=2, ks=3, ps=1, kr=1)),
             ("tc_implicit_gemm_3xf16", Params(bm=64, bn=64, kb=2, st=3, cw=1, ks=1, ps=0, kr=1)),
             ("tc_implicit_gemm_3xf16", Params(bm=128, bn=128, kb=1, st=3, cw=2, ks=1, ps=1, tm=1, cl=2, kr=1)),
             ("tc_implicit_gemm_3xtf32", Params(bm=128, bn=128, kb=1, st=3, cw=2, ks=1, ps=1, tm=1, kr=1)),
             ("tc_implicit_gemm_3xtf32", Params(bm=128, bn=64, kb=1, st=4, cw=2, ks=2, ps=1, kr=1))]


KR_SPECS = [ConvSpec.make(3, 96, 19, 17, 256, 3, 3, 1, 1), ConvSpec.make(1, 37, 13, 7, 140, 3, 3, 2, (0, 1, 2, 1))]


@pytest.mark.parametrize("name, prm", KR_POINTS, ids=lambda p: getattr(p, "short", lambda: str(p))())
@pytest.mark.parametrize("spec", KR_SPECS, ids=str)
def test_restart_every_k_step_against_float64(hopper, name, prm, spec):
    """kr=1 (two wgmma register sets in turn, each k step's sums added into FP32): FP32-grade on odd
    shapes with TMA, cp.async, split-K, clusters and non-persistent grids, 3xFP16 and 3xTF32."""
    v = get_variant(name)
    cfg = TileConfig.of(prm)
    if cfg.tm:
        cfg = tma.with_tma(dataclasses.replace(cfg, tm=0, sa=128), lambda c: v.tma_reason(spec, c))
        if not cfg.tm:
            pytest.skip(f"{spec.short()}: its operands cannot come by TMA")
    prm = cfg.params()
    res = check_plan(v.plan(spec, prm, hopper.device, Epilogue(bias=True, relu=True)), hopper, seed=6)
    assert res.ok and res.rel_err <= 5e-6, f"{name} {prm.short()} {spec.short()}: {res}"


def _toward_zero(got: np.ndarray, ref: np.ndarray) -> float:
    """The error's mean component toward zero, over the mean magnitude (the bias a network compounds)."""
    return float(-np.mean((got - ref) * np.sign(ref)) / np.mean(np.abs(ref)))


@pytest.mark.parametrize("spec", [ConvSpec.make(8, 512, 14, 14, 128, 3, 3, 1, 1),
                                  ConvSpec.make(32, 1024, 6, 6, 256, 1, 1)], ids=str)
def test_restart_every_k_step_cuts_the_bias(hopper, spec):
    """3xFP16's error toward zero (the tensor core's truncating sums; scripts/tc_sum_model.py) on
    reductions of 4608 and 1024 terms: restarted every k step at most half of what promotion every 2
    stages leaves, and the relative error FP32-grade both ways."""
    v = get_variant("tc_implicit_gemm_3xf16")
    inputs = pass_inputs(spec, np.random.default_rng(12), Epilogue())
    ref = expected(spec, inputs, Epilogue())
    prm = v.default(spec, hopper.device)
    out = {}
    for label, p in (("kr", prm), ("pi2", Params({**{k: x for k, x in prm.items() if k != "kr"}, "pi": 2}))):
        got = _run_poisoned(v.plan(spec, p, hopper.device), hopper, inputs)
        out[label] = (rel_l2(got, ref), _toward_zero(got, ref))
    print(f"{spec.short()}: " + ", ".join(f"{k} err {e:.2e} bias {b:+.2e}" for k, (e, b) in out.items()))
    assert prm.get("kr") == 1 and max(e for e, _ in out.values()) <= 5e-6
    assert abs(out["kr"][1]) <= 0.5 * abs(out["pi2"][1]), out


def _cl(spec: ConvSpec, dtype: str = "float32") -> ConvSpec:
    return ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "layout": "nhwc"})


CHANNELS_LAST = [ConvSpec.make(1, 5, 13, 7, 12, 1, 1), ConvSpec.make(2, 24, 9, 11, 37, 1, 1),
                 ConvSpec.make(2, 96, 14, 14, 384, 1, 1), ConvSpec.make(2, 384, 7, 9, 96, 1, 1),
                 ConvSpec.make(1, 16, 15, 13, 40, 3, 3, 2, (1, 0, 0, 1)), ConvSpec.make(2, 64, 9, 9, 64, 3, 3, 1, 1)]
CL_EPILOGUES = [Epilogue(bias=True, gelu=True), Epilogue(bias=True, residual=True), Epilogue(residual=True, relu=True)]


@pytest.mark.parametrize("name, spec", [(n, _cl(s, d)) for n, s in itertools.product(GEMMS, CHANNELS_LAST)
                                        for d in DTYPES.get(n, ("float32",))], ids=str)
@pytest.mark.parametrize("epi", CL_EPILOGUES, ids=lambda e: e.tag())
def test_channels_last_against_float64(hopper, name, spec, epi):
    """NHWC in and out (linear layers: 1x1; and 3x3 / strided ones) with GELU, residual and ReLU
    epilogues; the default point and a split-K one; C and K not multiples of 4 included."""
    v = get_variant(name)
    if v.applies(spec, hopper.device):
        pytest.skip(v.applies(spec, hopper.device))
    space = v.space(spec, hopper.device)
    split = next((p for p in space if p.get("ks", 1) > 1), None)
    for prm in [v.default(spec, hopper.device)] + ([split] if split else []):
        res = check_plan(v.plan(spec, prm, hopper.device, epi), hopper, seed=6)
        assert res.ok, f"{name} [{prm.short()}] {spec.short()}{epi.tag()}: {res}"
        if "3xtf32" in name:
            assert res.rel_err <= 5e-6, f"not FP32-grade: {res.rel_err:.2e}"


def test_linear_of_convnext_stays_fp32_grade(hopper):
    """ConvNeXt-T stage 4's second linear (3072 terms) as 3xTF32 with promotion: FP32-grade."""
    spec = _cl(ConvSpec.make(2, 3072, 7, 7, 768, 1, 1))
    v = get_variant("tc_implicit_gemm_3xtf32")
    res = check_plan(v.plan(spec, v.default(spec, hopper.device), hopper.device, Epilogue(bias=True, residual=True)),
                     hopper, seed=8)
    print(f"3xTF32 linear 3072 -> 768: {res.rel_err:.2e}")
    assert res.ok and res.rel_err <= 5e-6, res


# -- the TMA producer (tm=1, tensorcore/sm90/tma.py) -----------------------------------------------------
TMA = [ConvSpec.make(2, 64, 13, 11, 96, 3, 3, 2, 1), ConvSpec.make(1, 64, 9, 10, 40, 3, 3, 1, (0, 1, 2, 1)),
       ConvSpec.make(3, 32, 11, 9, 24, 3, 3, 1, 2, 2), ConvSpec.make(1, 128, 23, 21, 36, 5, 5, 4, (2, 1, 0, 3)),
       ConvSpec.make(2, 128, 7, 7, 72, 1, 1, 2), ConvSpec.make(5, 64, 17, 13, 257, 3, 3, 1, 1),
       ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1),
       ConvSpec.make(32, 256, 56, 56, 512, 1, 1, 2)]


@pytest.mark.parametrize("name, spec", list(_cases(GEMMS, TMA)), ids=str)
def test_tma_against_float64(hopper, name, spec):
    """Every TMA point of the space's head on layers whose channels are whole atoms: odd geometry
    (stride 2 and 4 past the edge, asymmetric padding, dilation, K and M tails, split-K) and ResNet
    layers (first 2 images checked); one executable run twice on fresh buffers (the tensor maps are
    re-encoded for the new addresses)."""
    v = get_variant(name)
    if v.applies(spec, hopper.device):
        pytest.skip(v.applies(spec, hopper.device))
    why = v.tma_reason(spec, TileConfig.of(v.default(spec, hopper.device)))
    assert why is None, why  # 32 half channels: the 64-byte swizzle
    points = [p for p in v.space(spec, hopper.device)[:16] if p.get("tm")]
    assert points, f"no TMA point for {spec.short()}"
    big = spec.n >= 32
    for prm in points[:2 if big else 4]:
        plan = v.plan(spec, prm, hopper.device, Epilogue(bias=True, relu=True))
        exe = hopper.executable(plan)
        for seed in (4, 5):
            res = check_plan(plan, hopper, seed=seed, exe=exe, batch_slice=2 if big else None)
            assert res.ok, f"{name} [{prm.short()}] {spec.short()} seed {seed}: {res}"


# Channels that are not whole 128-byte rows, brought by TMA in the 64- or 32-byte swizzle (TileConfig.sa):
# forward layers of 16 / 48 / 5 channels, wgrad at a batch of 16 and 48 (x' has the batch as channels:
# VGG-16's N=16), strided dgrad of 48 filters (dy's channels); the expected swizzle per dtype is asserted,
# so a fall back to cp.async fails.
NARROW = [("tc_implicit_gemm_tf32", ConvSpec.make(2, 16, 13, 11, 40, 3, 3, 1, 1), 64),
          ("tc_implicit_gemm_tf32", ConvSpec.make(3, 48, 9, 10, 70, 3, 3, 2, (0, 1, 2, 1)), 64),
          ("tc_implicit_gemm_tf32", ConvSpec.make(1, 5, 15, 13, 24, 5, 5, 1, 2), 32),
          ("tc_implicit_gemm_3xtf32", ConvSpec.make(2, 16, 13, 11, 40, 3, 3, 1, 1), 64),
          ("tc_implicit_gemm_half", _as(ConvSpec.make(2, 16, 13, 11, 40, 3, 3, 1, 1), "float16"), 32),
          ("tc_implicit_gemm_half", _as(ConvSpec.make(3, 96, 9, 10, 70, 3, 3, 2, 1), "bfloat16"), 64),
          ("wgrad_tc_implicit_gemm_tf32", ConvSpec.make(16, 64, 28, 28, 64, 3, 3, 1, 1), 64),
          ("wgrad_tc_implicit_gemm_tf32", ConvSpec.make(16, 5, 9, 7, 6, 3, 3, 2, (0, 1, 1, 0)), 64),
          ("wgrad_tc_implicit_gemm_tf32", ConvSpec.make(48, 3, 8, 8, 5, 3, 3, 1, 1), 64),
          ("wgrad_tc_implicit_gemm_tf32", ConvSpec.make(16, 128, 56, 56, 128, 3, 3, 1, 1), 64),
          ("wgrad_tc_implicit_gemm_3xtf32", ConvSpec.make(16, 9, 7, 9, 40, 3, 3, 1, 1), 64),
          ("wgrad_tc_implicit_gemm_half", _as(ConvSpec.make(16, 6, 9, 7, 33, 3, 3, 1, (1, 0, 0, 1)), "bfloat16"), 32),
          ("wgrad_tc_implicit_gemm_half", _as(ConvSpec.make(32, 64, 14, 14, 64, 3, 3, 2, 1), "float16"), 64),
          ("dgrad_tc_strided_tf32", ConvSpec.make(2, 40, 11, 9, 48, 3, 3, 2, 1), 64)]


@pytest.mark.parametrize("name, spec, sa", NARROW, ids=str)
def test_narrow_swizzle_tma_against_float64(hopper, name, spec, sa):
    """The default (TMA in the expected swizzle) and the space's other narrow-swizzle TMA points
    (clusters of two among them where the space has them), NaN-poisoned, against float64; one
    executable run on two sets of fresh buffers."""
    v = get_variant(name)
    spec = spec.with_pass(next(iter(v.passes))) if spec.conv_pass not in v.passes else spec
    assert v.applies(spec, hopper.device) is None, v.applies(spec, hopper.device)
    first = v.default(spec, hopper.device)
    assert first.get("tm") == 1 and first.get("sa", 128) == sa, first
    points = [first] + [p for p in v.space(spec, hopper.device)[1:24] if p.get("sa", 128) == sa][:3]
    for prm in points:
        plan = v.plan(spec, prm, hopper.device)
        exe = hopper.executable(plan)
        for seed in (7, 8):
            res = check_plan(plan, hopper, seed=seed, exe=exe)
            assert res.ok, f"{name} [{prm.short()}] {spec.short()} seed {seed}: {res}"


# Ping-pong consumers (pp=1): each warpgroup a whole tile, the block's tiles in turn, turn barriers
# between them. Layers with many tiles a block (so both consumers work and the ring wraps between
# them), split-K, odd edges, every dtype, TMA and cp.async points of the space.
PINGPONG = [ConvSpec.make(5, 64, 17, 13, 257, 3, 3, 1, 1), ConvSpec.make(3, 37, 13, 7, 257, 3, 3, 1, (0, 1, 2, 1)),
            ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1)]


@pytest.mark.parametrize("name, spec", list(_cases(GEMMS, PINGPONG)), ids=str)
def test_pingpong_against_float64(hopper, name, spec):
    """The first space points that take ping-pong, with pp=1 (and the first again on a grid of 3
    blocks, so that each takes many tiles in turn), NaN-poisoned, against float64, on two sets of
    fresh buffers."""
    v = get_variant(name)
    if v.applies(spec, hopper.device):
        pytest.skip(v.applies(spec, hopper.device))
    math, prob = v.math(spec), v.problem(spec)
    pongs = [dataclasses.replace(TileConfig.of(p), pp=1) for p in v.space(spec, hopper.device)[:12]]
    points = list(dict.fromkeys(c.params() for c in pongs if not c.problems(math, prob, v.limit(hopper.device))))[:2]
    assert points, f"no ping-pong point for {spec.short()}"
    few = dataclasses.replace(hopper.device, units=3)  # a grid of 3 blocks: each takes many tiles in turn
    for prm, dev in [(p, hopper.device) for p in points] + [(points[0], few)]:
        plan = v.plan(spec, prm, dev, Epilogue(bias=True, relu=True))
        if dev is few:
            assert max(st.grid[0] for st in plan.steps if st.kernel.endswith("_gemm")) == 3
        exe = hopper.executable(plan)
        for seed in (9, 10):
            res = check_plan(plan, hopper, seed=seed, exe=exe, batch_slice=2 if spec.n >= 32 else None)
            assert res.ok, f"{name} [{prm.short()}] {spec.short()} seed {seed}: {res}"


# one tap a stage (kb = 2 over 2-atom channels), the tap loop fully unrolled: nvcc 13.0 gave a copy the
# previous copy's 16-bit im2col offset register ({1, 1} for {1, 0}; round 26), so every offset of
# a 4x4 filter is exercised, in both GEMM kinds the generator runs it in
UNROLLED = [("tc_implicit_gemm_tf32", ConvSpec.make(1, 64, 16, 15, 3, 4, 4, 1, 1)),
            ("tc_implicit_gemm_half", _as(ConvSpec.make(1, 128, 16, 15, 8, 4, 4, 1, 1), "float16")),
            ("dgrad_tc_strided_tf32", ConvSpec.make(1, 3, 31, 29, 64, 7, 7, 2, 3).with_pass("dgrad")),
            ("dgrad_tc_strided_tf32", ConvSpec.make(1, 3, 30, 30, 64, 8, 8, 2, 3).with_pass("dgrad"))]


@pytest.mark.parametrize("name, spec", UNROLLED, ids=str)
@pytest.mark.parametrize("kb", [1, 2])
def test_tma_offsets_of_an_unrolled_tap_loop(hopper, name, spec, kb):
    """TMA copies whose im2col offsets the compiler sees as constants of an unrolled loop: one
    consumer warpgroup, unsplit, kb atoms a stage, against float64."""
    v = get_variant(name)
    prm = Params(bm=128, bn=64, cw=1, kb=kb, ks=1, ps=1, st=3, tm=1)
    if name.startswith("dgrad"):
        prm = prm.replace(il=1)
    res = check_plan(v.plan(spec, prm, hopper.device), hopper, seed=6)
    assert res.ok, f"{name} [{prm.short()}] {spec.short()}: {res}"


def test_tma_through_torch_fast_path(hopper):
    """conv2d on torch tensors with a TMA point: the parameter arrays' tensor maps follow x and the
    weights from call to call (new tensors, new addresses), output equal to PyTorch's within FP16's
    rounding."""
    torch = pytest.importorskip("torch")
    import convforge as cf

    prm = Params(bm=128, bn=64, kb=1, st=4, cw=2, ks=1, ps=1, tm=1)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(3, 64, 19, 17, device="cuda", generator=g).half()
        w = torch.randn(96, 64, 3, 3, device="cuda", generator=g).half()
        y = cf.conv2d(x, w, stride=2, padding=1, algo="tc_implicit_gemm_half", params=prm)
        ref = torch.nn.functional.conv2d(x.double(), w.double(), stride=2, padding=1)
        err = float((y.double() - ref).norm() / ref.norm())
        assert err < 2e-3, (seed, err)


def test_tma_through_the_native_fast_path(hopper, monkeypatch):
    """Warm torch calls of a TMA plan (the default here) run in C++ (torch/native.cpp), which encodes
    the tensor maps itself: two weights alternating (each its own packed filters: the filter map
    moves), fresh x every call, with Python's path made to fail once both are filed; outputs equal
    float64 within TF32's rounding."""
    torch = pytest.importorskip("torch")
    import convforge as cf
    from convforge import api
    from convforge.config import config
    from convforge.torch import native

    if not config.native:
        pytest.skip("native fast path off (CONVFORGE_NATIVE=0)")
    nat = native.load()
    assert nat is not None, "the native fast path did not build on this CUDA machine: see the log"
    spec = ConvSpec.make(3, 64, 13, 11, 96, 3, 3, 2, 1)
    v = get_variant("tc_implicit_gemm_tf32")
    assert v.default(spec, hopper.device).get("tm") == 1
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(spec.w_shape, device="cuda", generator=g) for _ in range(2)]

    def call(i):
        x = torch.randn(spec.x_shape, device="cuda", generator=g)
        y = cf.conv2d(x, ws[i % 2], stride=2, padding=1, algo="tc_implicit_gemm_tf32", precision="relaxed")
        ref = torch.nn.functional.conv2d(x.double(), ws[i % 2].double(), stride=2, padding=1)
        return float((y.double() - ref).norm() / ref.norm())

    with torch.no_grad():
        assert max(call(i) for i in range(2)) < 1e-3  # cold: the slow path files both weights' calls
        entries = nat.stats()["entries"]
        assert entries >= 1
        monkeypatch.setattr(api, "_KEYERS", {})
        monkeypatch.setattr(api, "_conv2d", lambda *a, **k: pytest.fail("a warm TMA call reached Python's path"))
        errs = [call(i) for i in range(2, 8)]
    assert max(errs) < 1e-3, errs
    assert nat.stats()["entries"] == entries


# Stems: filter columns folded into channels (tensorcore/sm90/variants.py TcStemGemm) and A built from input rows
# (tensorcore/sm90/stem.py TcStemDirect): odd sizes, asymmetric padding, dilation, N=1, C of 1 to 3, 11x11/4,
# channels-last input; and the real stems.
STEMS = [ConvSpec.make(2, 3, 19, 17, 8, 7, 7, 2, (3, 2, 3, 1)),
         ConvSpec.make(1, 3, 35, 37, 12, 11, 11, 4, (2, 0, 1, 2)), ConvSpec.make(2, 1, 13, 14, 16, 5, 5, 1, 2, 2),
         ConvSpec.make(3, 2, 23, 21, 70, 3, 5, 1, (1, 1, 2, 2))]
BIG_STEMS = [ConvSpec.make(128, 3, 227, 227, 64, 7, 7, 2), ConvSpec.make(32, 3, 224, 224, 64, 7, 7, 2, 3),
             ConvSpec.make(16, 3, 224, 224, 64, 3, 3, 1, 1)]
STEM_DTYPES = {"tc_stem_gemm_half": ("float16", "bfloat16"), "tc_stem_gemm_tf32": ("float32",),
               "tc_stem_direct_half": ("float16", "bfloat16"), "tc_stem_direct_tf32": ("float32",),
               "tc_stem_gemm_3xf16": ("float32",)}
# the direct stems' own cases: sw C odd (the strip's second copy) over two 64-pixel blocks, N=1; 11x11/4 at
# 96 channels in two channel blocks (their default); a band that does not divide P
DIRECT_STEMS = [ConvSpec.make(1, 3, 20, 70, 16, 3, 3, 1, 1), ConvSpec.make(2, 3, 67, 61, 96, 11, 11, 4, 2),
                ConvSpec.make(3, 3, 41, 37, 24, 7, 7, 2, (3, 2, 1, 3))]


@pytest.mark.parametrize("name, spec", [(n, _as(s, d)) for n, dts in STEM_DTYPES.items() for d in dts
                                        for s in STEMS + DIRECT_STEMS + [_cl(STEMS[3], "float32")]
                                        + [_cl(s, d) for s in DIRECT_STEMS]], ids=str)
def test_stems_against_float64(hopper, name, spec):
    """The default and another space point with bias and ReLU, NaN-poisoned outputs against float64."""
    epi = Epilogue(bias=True, relu=True)
    v = get_variant(name)
    if v.applies(spec, hopper.device):
        pytest.skip(v.applies(spec, hopper.device))
    for prm in _points(v, spec, hopper.device, k=1):
        res = check_plan(v.plan(spec, prm, hopper.device, epi), hopper, seed=7)
        assert res.ok, f"{name} [{prm.short()}] {spec.short()}{epi.tag()}: {res}"


@pytest.mark.parametrize("name, spec", [(n, _as(s, d)) for n in STEM_DTYPES for s in BIG_STEMS
                                        for d in STEM_DTYPES[n][:1]], ids=str)
def test_big_stems(hopper, name, spec):
    """MEC cv3 (N128, 227², 7x7/2), ResNet-50's conv1, VGG-16's conv1_1: the default point."""
    v = get_variant(name)
    if v.applies(spec, hopper.device):
        pytest.skip(v.applies(spec, hopper.device))
    res = check_plan(v.plan(spec, v.default(spec, hopper.device), hopper.device), hopper, seed=8, batch_slice=2)
    assert res.ok, f"{name} {spec.short()}: {res}"


# 64 x 256 ping-pong tiles where half-precision A takes a narrow swizzle and K is whole 256s (tiles.narrow_wide):
# MEC cv5's shape at a smaller batch (channels-last and NCHW), and 160 channels (320-byte rows)
NARROW_WIDE = [ConvSpec.make(24, 96, 24, 24, 256, 5, 5, dtype="float16", layout="nhwc"),
               ConvSpec.make(16, 96, 27, 27, 256, 5, 5, 1, 2, dtype="bfloat16"),
               ConvSpec.make(32, 160, 14, 14, 512, 3, 3, 1, 1, dtype="float16", layout="nhwc")]


@pytest.mark.parametrize("spec", NARROW_WIDE, ids=str)
def test_narrow_wide_defaults_against_float64(hopper, spec):
    v = get_variant("tc_implicit_gemm_half")
    prm = v.default(spec, hopper.device)
    assert (prm["bm"], prm["bn"], prm.get("pp")) == (64, 256, 1), prm
    res = check_plan(v.plan(spec, prm, hopper.device, Epilogue(bias=True, relu=True)), hopper, seed=9,
                     batch_slice=3)
    assert res.ok, f"{prm.short()} {spec.short()}: {res}"


# -- the half-staged epilogue (eh=1, epilogue.h8_reason): the same stored values as the float staging ----
HALF_STAGED = [ConvSpec.make(2, 24, 9, 11, 72, 3, 3, 1, 1), ConvSpec.make(3, 64, 13, 7, 200, 1, 1),
               ConvSpec.make(1, 64, 15, 13, 128, 3, 3, 2, (1, 0, 0, 1)), ConvSpec.make(8, 256, 14, 14, 1024, 1, 1)]
HALF_STAGED_EPILOGUES = [Epilogue(), Epilogue(relu=True), Epilogue(bias=True, silu=True),
                         Epilogue(bias=True, residual=True, relu=True), Epilogue(residual=True)]


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("spec", HALF_STAGED, ids=str)
@pytest.mark.parametrize("epi", HALF_STAGED_EPILOGUES, ids=lambda e: e.tag() or "plain")
def test_half_staging_stores_what_the_float_staging_stores(hopper, spec, epi, dtype):
    """NHWC forwards (M and K tails, stride 2, a ResNet 1x1) at the default tile and at 64- and 128-column
    tiles with and without ping-pong: eh=1 and eh=0 both within tolerance of float64, and equal errors on
    the same inputs (the same values stored: one rounding of the same float operations); es=1 (the chunks
    stored by TMA) where the output allows, equal too."""
    v, spec = get_variant("tc_implicit_gemm_half"), _cl(spec, dtype)
    base = v.default(spec, hopper.device)
    points = [base] + [base.replace(**m) for m in (dict(bn=64, pp=1), dict(bn=128, pp=0), dict(bn=64, pp=0))]
    for prm in dict.fromkeys(points):
        if TileConfig.of(prm).problems(v.math(spec), v.problem(spec), v.limit(hopper.device)):
            continue
        half, flt = (check_plan(v.plan(spec, p, hopper.device, epi), hopper, seed=9) for p in (prm, prm.replace(eh=0)))
        assert half.ok and flt.ok, f"[{prm.short()}] {spec.short()}{epi.tag()}: eh=1 {half}, eh=0 {flt}"
        assert half.rel_err == flt.rel_err, f"[{prm.short()}] {spec.short()}{epi.tag()}: {half} != {flt}"
        try:  # the same chunks stored by TMA (es=1) where the output is one plain matrix
            plan = v.plan(spec, prm.replace(es=1, ks=1), hopper.device, epi)
        except ValueError:
            continue
        tma_res = check_plan(plan, hopper, seed=9)
        assert tma_res.ok and (prm.get("ks", 1) > 1 or tma_res.rel_err == flt.rel_err), \
            f"[{prm.short()} es=1] {spec.short()}{epi.tag()}: {tma_res} / eh=0 {flt}"


@pytest.mark.parametrize("name, spec", [("dgrad_tc_implicit_gemm_half", ConvSpec.make(3, 200, 9, 7, 64, 3, 3, 1, 1)),
                                        ("dgrad_tc_implicit_gemm_half", ConvSpec.make(16, 256, 28, 28, 128, 1, 1)),
                                        ("dgrad_tc_strided_half", ConvSpec.make(2, 128, 14, 13, 64, 3, 3, 2, 1)),
                                        ("dgrad_tc_strided_half", ConvSpec.make(4, 512, 14, 14, 256, 1, 1, 2))],
                         ids=str)
def test_half_staged_dgrad_equals_the_float_staging(hopper, name, spec):
    """The NHWC dgrads (the transposed forward; the strided one's phases onto dx rows) stage halves too."""
    v = get_variant(name)
    spec = ConvSpec.from_dict({**spec.to_dict(), "dtype": "float16", "layout": "nhwc", "pass": "dgrad"})
    if v.applies(spec, hopper.device):
        pytest.skip(v.applies(spec, hopper.device))
    prm = v.default(spec, hopper.device)
    half, flt = (check_plan(v.plan(spec, p, hopper.device), hopper, seed=4) for p in (prm, prm.replace(eh=0)))
    assert half.ok and flt.ok and half.rel_err == flt.rel_err, f"[{prm.short()}] {spec.short()}: {half} / {flt}"


RES_DGRAD = [ConvSpec.make(3, 200, 9, 7, 64, 3, 3, 1, 1), ConvSpec.make(16, 256, 28, 28, 64, 1, 1),
             ConvSpec.make(1, 1024, 14, 14, 256, 1, 1), ConvSpec.make(5, 64, 13, 11, 64, 3, 3, 1, 1)]


@pytest.mark.parametrize("spec", RES_DGRAD, ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dgrad_adds_a_residual(hopper, spec, dtype):
    """The stride-1 half dgrad with ``Epilogue(residual=True)`` (a training block's input gradient and a later
    block's residual gradient in one pass: torch/residual_grad.py): dx + res against float64 within the
    plan's tolerance, at the tile ``epilogue_params`` gives (the residual prefetched into registers before the
    main loop, rs=1) and with rs=0, eh=0 (the float staging), and the same stored values both ways."""
    v = get_variant("dgrad_tc_implicit_gemm_half")
    spec = ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "layout": "nhwc", "pass": "dgrad"})
    assert v.applies(spec, hopper.device) is None, v.applies(spec, hopper.device)
    epi = Epilogue(residual=True)
    prm = v.epilogue_params(spec, v.default(spec, hopper.device), epi)  # what torch/fused.py plans
    flat = prm.replace(rs=0, eh=0)
    half, flt = (check_plan(v.plan(spec, p, hopper.device, epi), hopper, seed=6) for p in (prm, flat))
    assert half.ok and flt.ok and half.rel_err == flt.rel_err, f"[{prm.short()}] {spec.short()}: {half} / {flt}"


RES_FWD = [ConvSpec.make(32, 64, 13, 11, 200, 3, 3, 1, 1), ConvSpec.make(16, 64, 28, 28, 256, 1, 1),
           ConvSpec.make(1, 256, 14, 14, 1024, 1, 1), ConvSpec.make(16, 64, 57, 55, 72, 3, 3, 2, 1)]


@pytest.mark.parametrize("spec", RES_FWD, ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_forward_prefetches_a_residual(hopper, spec, dtype):
    """A half channels-last forward with bias + residual + ReLU (a folded inference block's conv3) at the
    parameters dispatch's heuristic gives it (``epilogue_params``: rs=1, the residual prefetched into
    registers before the main loop) against float64, and the same stored values as the float staging (rs=0,
    eh=0); odd shapes: N=1, a stride-2 3x3 on odd planes, channels that are not whole tiles."""
    v = get_variant("tc_implicit_gemm_half")
    spec = ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "layout": "nhwc"})
    assert v.applies(spec, hopper.device) is None, v.applies(spec, hopper.device)
    epi = Epilogue(bias=True, residual=True, relu=True)
    prm = v.epilogue_params(spec, v.default(spec, hopper.device), epi)
    assert prm.get("rs") == 1, prm.short()
    half, flt = (check_plan(v.plan(spec, p, hopper.device, epi), hopper, seed=8)
                 for p in (prm, prm.replace(rs=0, eh=0)))
    assert half.ok and flt.ok and half.rel_err == flt.rel_err, f"[{prm.short()}] {spec.short()}: {half} / {flt}"
