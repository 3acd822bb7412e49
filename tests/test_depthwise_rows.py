"""depthwise_rows / depthwise_rows_dgrad (NCHW rows in registers, depthwise_rows.py) on PoCL against the float64
reference with the output poisoned (NaN) first, on odd shapes: N=1, prime channel counts, multiplier 2, stride 2
and 4, asymmetric padding, dilation 2, 3x3 to 7x7, rows of 8-byte and 16-byte alignment, planes narrower than one
thread's chunk; bias / residual / activations and a concat's channel offset; float16, bfloat16 and float32.
Tolerances: the plans' own (1e-3 float16, 8e-3 bfloat16, 1e-5 float32; these measure 1.6-2.2e-4, 1.6-2.0e-3 and
6e-8 to 1.2e-7). Also what ``auto`` ranks where, and the refusals' messages."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.kernels import get_variant, select
from convforge.kernels.depthwise import fprop_stencil
from convforge.kernels.depthwise_rows import RowsTile, rows_default
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.spec import ConvSpec

ODD = [
    ConvSpec.make(1, 13, 11, 16, 13, 3, 3, 1, 1, groups=13),  # N=1, prime C, 16-byte half rows, odd height
    ConvSpec.make(2, 5, 17, 16, 10, 5, 5, 2, (2, 1, 0, 3), groups=5),  # 5x5 /2, asymmetric pad, K = 2C
    ConvSpec.make(1, 7, 9, 8, 7, 7, 7, 1, 3, groups=7),  # 7x7 on a plane of one thread's width
    ConvSpec.make(1, 3, 20, 24, 3, 3, 3, 1, 2, 2, groups=3),  # dilation 2, 8-byte half rows (24 = 3 x 8)
    ConvSpec.make(1, 3, 21, 32, 6, 3, 3, 4, (1, 0, 2, 1), groups=3),  # stride 4 > kernel, K = 2C, asym pad
    ConvSpec.make(3, 11, 12, 12, 11, 3, 3, 2, 1, groups=11),  # 12 columns: 8-byte rows, prime C, N=3
    ConvSpec.make(1, 2, 5, 4, 2, 3, 3, 1, (2, 0, 1, 2), groups=2),  # a 4-column plane, padding past the halo
]
DTYPES = ("float16", "bfloat16", "float32")
EPILOGUES = [Epilogue(), Epilogue(bias=True, residual=True, silu=True), Epilogue(bias=True, relu=True),
             Epilogue(residual=True, gelu=True), Epilogue(bias=True, hardswish=True)]


def _as(spec: ConvSpec, dtype: str, conv_pass: str) -> ConvSpec:
    return dataclasses.replace(spec, dtype=dtype, layout="nchw", conv_pass=conv_pass)


def _check(ocl, name: str, spec: ConvSpec, prm: Params, epi: Epilogue, seed: int) -> None:  # type: ignore[no-untyped-def]
    v = get_variant(name)
    res = check_plan(v.plan(spec, prm, ocl.device, epi), ocl, seed=seed)
    assert res.ok, f"{name} [{prm.short()}] {spec.short()}{epi.tag()}: {res}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_fprop_odd_shapes_on_pocl(ocl, dtype) -> None:
    """Every odd shape at the GPU default, with an epilogue in turn; one more sampled point every other shape."""
    v = get_variant("depthwise_rows")
    rng = random.Random(DTYPES.index(dtype))
    for i, base in enumerate(ODD):
        spec = _as(base, dtype, "fprop")
        assert v.applies(spec, NOMINAL_CUDA) is None, (spec.short(), v.applies(spec, NOMINAL_CUDA))
        epi = EPILOGUES[(i + DTYPES.index(dtype)) % len(EPILOGUES)]
        points = [v.default(spec, NOMINAL_CUDA)]
        if i % 2 == DTYPES.index(dtype) % 2:
            points.append(rng.choice(v.space(spec, NOMINAL_CUDA)[1:]))
        for prm in points:
            _check(ocl, "depthwise_rows", spec, prm, epi, seed=i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_dgrad_odd_shapes_on_pocl(ocl, dtype) -> None:
    """The stride-1, multiplier-1 shapes' dgrad (the rotated filter at padding eff - 1 - pad, negative where the
    forward padding passed the halo); the others are refused (phases and fan-in belong to depthwise_dgrad)."""
    v = get_variant("depthwise_rows_dgrad")
    ran = 0
    for i, base in enumerate(ODD):
        spec = _as(base, dtype, "dgrad")
        why = v.applies(spec, NOMINAL_CUDA)
        if base.stride != (1, 1) or base.k != base.c:
            assert why is not None and ("phase" in why or "multiplier" in why), (spec.short(), why)
            continue
        if spec.q % 4:  # dy rows of 5 (the 4-column plane's forward output): the tile's
            assert why is not None and "align" in why, (spec.short(), why)
            continue
        assert why is None, (spec.short(), why)
        for prm in [v.default(spec, NOMINAL_CUDA)] + v.space(spec, NOMINAL_CUDA)[1 + i % 3::9][:1]:
            _check(ocl, "depthwise_rows_dgrad", spec, prm, Epilogue(), seed=i)
            ran += 1
    assert ran >= 4


def test_rows_concat_offset_on_pocl(ocl) -> None:
    """A concat's channel offset: the layer writes channels 3..3+K of a wider tensor, the rest stays NaN."""
    from convforge.dtypes import to_storage
    from convforge.reference import conv2d_ref

    spec = _as(ConvSpec.make(2, 5, 9, 16, 5, 3, 3, 1, 1, groups=5), "float16", "fprop")
    epi = Epilogue(bias=True, k_total=spec.k + 6, k_offset=3)
    v = get_variant("depthwise_rows")
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), ocl.device, epi)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, spec.shape_of("x")).astype(np.float32)
    w = rng.uniform(-1, 1, spec.shape_of("w")).astype(np.float32)
    b = rng.uniform(-1, 1, spec.k).astype(np.float32)
    x, w, b = (to_storage(a, "float16").astype(np.float32) for a in (x, w, b))
    shape = (spec.n, spec.k + 6, spec.p, spec.q)
    y = np.full(shape, np.nan, np.float32)
    bufs = {"x": ocl.upload(to_storage(x, "float16")), "w": ocl.upload(to_storage(w, "float16")),
            "bias": ocl.upload(to_storage(b, "float16")), "y": ocl.upload(to_storage(y, "float16"))}
    ocl.executable(plan)(bufs)
    got = ocl.download(bufs["y"], shape, "float16")
    ref = conv2d_ref(x, w, spec, b)
    assert np.linalg.norm(got[:, 3:3 + spec.k] - ref) / np.linalg.norm(ref) < 1e-3
    assert np.isnan(got[:, :3]).all() and np.isnan(got[:, 3 + spec.k:]).all()


@pytest.mark.parametrize("spec, why", [
    (ConvSpec.make(1, 4, 14, 14, 4, 3, 3, 1, 1, groups=4, dtype="float16"), "must align to 8 or 4 elements"),
    (ConvSpec.make(1, 4, 16, 16, 4, 3, 3, 1, 1, groups=4, dtype="float16", layout="nhwc"), "only NCHW"),
    (ConvSpec.make(1, 4, 16, 16, 4, 9, 9, 1, 4, groups=4, dtype="float16"), "more than 49 taps"),
    (ConvSpec.make(1, 4, 16, 16, 8, 3, 3, 1, 1, groups=4, dtype="float16", conv_pass="dgrad"), "multiplier"),
    (ConvSpec.make(1, 4, 16, 16, 4, 3, 3, 2, 1, groups=4, dtype="float16", conv_pass="dgrad"), "by phase"),
    (ConvSpec.make(1, 4, 16, 16, 4, 3, 3, 1, 1, groups=2, dtype="float16"), "only depthwise"),
], ids=["14-columns", "nhwc", "9x9", "dgrad-m2", "dgrad-stride2", "grouped"])
def test_rows_refusals_name_the_problem(spec, why) -> None:
    name = "depthwise_rows_dgrad" if spec.conv_pass == "dgrad" else "depthwise_rows"
    got = get_variant(name).applies(spec, NOMINAL_CUDA)
    assert got is not None and why in got, got


def test_rows_bad_params_are_refused() -> None:
    """plan() names the variant and the problem: too many outputs, a window past the registers, no threads."""
    spec = ConvSpec.make(2, 8, 56, 56, 8, 3, 3, 1, 1, groups=8, dtype="float16")
    v = get_variant("depthwise_rows")
    for prm, why in ((Params(tq=8, tp=8, bt=128), "outputs a thread must be <= 32"),
                     (Params(tq=16, tp=2, bt=0), "must be >= 1"),
                     (Params(tq=3, tp=2, bt=128), "must align")):
        with pytest.raises(ValueError, match=why):
            v.plan(spec, prm, NOMINAL_CUDA)
    spec7 = dataclasses.replace(spec, r=7, s=7, pad=(3, 3, 3, 3))
    with pytest.raises(ValueError, match="floats"):
        v.plan(spec7, Params(tq=16, tp=2, bt=128), NOMINAL_CUDA)


@pytest.mark.parametrize("base, rows", [
    (ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144), True),  # MobileNet-v2, both passes
    (ConvSpec.make(64, 96, 112, 112, 96, 3, 3, 2, 1, groups=96), True),  # strided: fprop only
    (ConvSpec.make(64, 192, 28, 28, 192, 3, 3, 1, 1, groups=192), True),  # 8-byte rows
    (ConvSpec.make(64, 72, 56, 56, 72, 5, 5, 2, 2, groups=72), True),  # 5x5 at a stride
    (ConvSpec.make(64, 240, 28, 28, 240, 5, 5, 1, 2, groups=240), False),  # 5x5 stride 1: the tile
    (ConvSpec.make(32, 96, 56, 56, 96, 7, 7, 1, 3, groups=96), False),  # 7x7: the tile
    (ConvSpec.make(64, 384, 14, 14, 384, 3, 3, 1, 1, groups=384), False),  # 14 columns: rows do not align
])
def test_auto_ranks_rows_where_measured_faster(base, rows) -> None:
    """auto's first pick on NCHW layers: depthwise_rows where the H200 measured it faster than the shared-memory
    tile (half and float32), the tile elsewhere; NHWC never rows."""
    for dtype in ("float16", "bfloat16", "float32"):
        for conv_pass in ("fprop", "dgrad"):
            spec = _as(base, dtype, conv_pass)
            first = select("auto", spec, NOMINAL_CUDA)[0].name
            want = rows and (conv_pass == "fprop" or base.stride == (1, 1))
            assert first.startswith("depthwise_rows") == want, (spec.short(), first)
    nhwc = dataclasses.replace(base, dtype="float16", layout="nhwc")
    assert not select("auto", nhwc, NOMINAL_CUDA)[0].name.startswith("depthwise_rows"), nhwc.short()


def test_auto_keeps_the_tile_first_on_a_cpu(ocl) -> None:
    """PoCL's CPU device: the tile (one output a work-item there) stays first; rows were timed on a GPU only."""
    spec = ConvSpec.make(2, 16, 56, 56, 16, 3, 3, 1, 1, groups=16)
    assert not ocl.device.is_gpu
    assert select("auto", spec, ocl.device)[0].name == "depthwise"
    assert get_variant("depthwise_rows").applies(spec, ocl.device) is None


def test_rows_default_keeps_to_two_rows_and_the_registers() -> None:
    """The default: one 16-byte vector a row where rows align to 16 bytes (8 outputs at stride 1, 4 at stride 2),
    8 bytes otherwise, 2 output rows, within the default register budget."""
    cases = [(ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144), 8),
             (ConvSpec.make(64, 96, 112, 112, 96, 3, 3, 2, 1, groups=96), 4),
             (ConvSpec.make(64, 192, 28, 28, 192, 3, 3, 1, 1, groups=192), 4),
             (ConvSpec.make(64, 72, 56, 56, 72, 5, 5, 2, 2, groups=72), 4)]
    for base, tq in cases:
        st = fprop_stencil(dataclasses.replace(base, dtype="float16"))
        prm = rows_default(st, NOMINAL_CUDA)
        assert (prm.tq, prm.tp, prm.bt) == (tq, 2, 128), (base.short(), prm.short())
        assert RowsTile.of(st, prm).problem(NOMINAL_CUDA, regs=120) is None
