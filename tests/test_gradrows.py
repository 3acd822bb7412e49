"""The masked gradient written in the backward GEMMs' operand layouts (kernels/tensorcore/sm90/gradrows.py):
the layouts and the bias on PoCL against float64 (every destination poisoned with NaN first, so a pad
left unwritten fails), the plans' prep steps found and dropped, the CUDA source compiled by nvcc."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.render import render
from convforge.kernels import get_variant
from convforge.kernels.tensorcore.sm90.gradrows import Rows, images_per_block, masked_rows, prepared
from convforge.kernels.tensorcore.sm90.isa import TF32, X3TF32
from convforge.reference import rel_l2
from convforge.spec import ConvSpec

# (N, K, P*Q, xh width or None, dy' width or None)
CASES = [
    (16, 64, 49, 64, 16),  # VGG-like: whole tiles of images, 7x7
    (3, 5, 37, 8, 4),  # odd everything, both pads
    (1, 7, 121, 8, None),  # N = 1, dgrad only (the weights need no gradient)
    (2, 3, 33, None, 4),  # wgrad only (the input needs no gradient)
    (17, 9, 65, 12, 20),  # two blocks of images, the second partial
    (5, 40, 1, 40, 8),  # a single pixel
]


def _run(ocl, n: int, k: int, pq: int, xh: Rows | None, dyt: Rows | None, seed: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal((n, k, pq)).astype(np.float32)
    z = np.maximum(rng.standard_normal((n, k, pq)), 0).astype(np.float32)  # a ReLU's output: zeros and positives
    kernels, launches, part_bytes = masked_rows(n, k, pq, xh, dyt)
    program = ocl.program(render(list(kernels), "opencl", "grad rows"))
    sizes = {"bpart": part_bytes, "bias": 4 * k}
    if xh is not None:
        sizes[xh.name] = 4 * n * pq * xh.width
    if dyt is not None:
        sizes[dyt.name] = 4 * k * pq * dyt.width
    bufs = {"y": ocl.upload(dy), "z": ocl.upload(z)}
    for name, nbytes in sizes.items():
        bufs[name] = ocl.empty(nbytes)
        ocl.fill(bufs[name], float("nan"), nbytes)
    by_name = {kk.name: kk for kk in kernels}
    for step in launches:
        kern = by_name[step.kernel]
        ocl.launch(program, ocl.function(program, kern), kern, step, [bufs[str(a)] for a in step.args])
    ocl.synchronize()
    out = {name: ocl.download(bufs[name], (sizes[name] // 4,)) for name in sizes}
    return dy, z, out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:3])) + f"_xh{c[3]}_dyt{c[4]}")
def test_layouts_and_bias_against_float64(ocl, case) -> None:  # type: ignore[no-untyped-def]
    n, k, pq, xw, dw = case
    xh = Rows("fwd_xh", None, xw) if xw else None
    dyt = Rows("dyt", None, dw) if dw else None
    dy, z, out = _run(ocl, n, k, pq, xh, dyt, seed=n * 1000 + k)
    gm = np.where(z > 0, dy, 0).astype(np.float64)
    if xh is not None:  # [N][PQ][Kp], zero channels past K
        want = np.zeros((n, pq, xh.width))
        want[:, :, :k] = gm.transpose(0, 2, 1)
        assert np.array_equal(out["fwd_xh"].reshape(want.shape), want)
    if dyt is not None:  # [K][PQ][Np], zero images past N
        want = np.zeros((k, pq, dyt.width))
        want[:, :, :n] = gm.transpose(1, 2, 0)
        assert np.array_equal(out["dyt"].reshape(want.shape), want)
    err = rel_l2(out["bias"], gm.sum(axis=(0, 2)))
    assert err < 1e-6, err


def test_the_bias_is_deterministic(ocl) -> None:  # type: ignore[no-untyped-def]
    runs = [_run(ocl, 9, 6, 200, Rows("fwd_xh", None, 8), Rows("dyt", None, 12), seed=5)[2]["bias"] for _ in range(2)]
    assert np.array_equal(runs[0], runs[1])


def test_bad_destinations_are_refused() -> None:
    with pytest.raises(ValueError, match="no destination"):
        masked_rows(2, 3, 4, None, None)
    with pytest.raises(ValueError, match="narrower"):
        masked_rows(2, 8, 4, Rows("xh", None, 4), None)
    with pytest.raises(ValueError, match="narrower"):
        masked_rows(5, 8, 4, None, Rows("dyt", None, 4))


def test_images_per_block() -> None:
    assert [images_per_block(c) for c in (1, 2, 3, 4, 5, 16, 17, 48)] == [1, 2, 4, 4, 8, 16, 16, 16]


def _plan(name: str, spec: ConvSpec):  # type: ignore[no-untyped-def]
    v = get_variant(name)
    assert v.applies(spec, NOMINAL_CUDA) is None, v.applies(spec, NOMINAL_CUDA)
    return v.plan_for(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)


@pytest.mark.parametrize("n", [16, 5])
@pytest.mark.parametrize("x3", [False, True], ids=["tf32", "3xtf32"])
def test_the_prep_steps_are_found_and_dropped(n: int, x3: bool) -> None:
    """dgrad's tc_x_nhwc and wgrad's <variant>_dy: found, dropped (no step reads "y" after), their
    destination's name, math and width those the GEMMs read."""
    math, tag = (X3TF32, "3xtf32") if x3 else (TF32, "tf32")
    spec = ConvSpec.make(n, 64, 28, 28, 130, 3, 3, padding=1)  # K = 130: xh padded to 132 channels
    d = _plan(f"dgrad_tc_implicit_gemm_{tag}", spec.with_pass("dgrad"))
    pd = prepared(d, "tc_x_nhwc", n * 28 * 28)
    assert pd is not None and pd.rows == Rows("fwd_xh", math, 132)
    assert len(pd.plan.steps) == len(d.steps) - 1 and "tc_x_nhwc" not in {kk.name for kk in pd.plan.kernels}
    w = _plan(f"wgrad_tc_implicit_gemm_{tag}", spec.with_pass("wgrad"))
    pw = prepared(w, f"wgrad_tc_implicit_gemm_{tag}_dy", 130 * 28 * 28)
    assert pw is not None and pw.rows == Rows("dyt", math, 16 if n == 16 else 8)
    for p in (pd, pw):
        assert not any("y" in getattr(s, "args", ()) for s in p.plan.steps)
        assert {b.name for b in p.rows.buffers()} <= dict(p.plan.workspace).keys()
    assert prepared(w, "tc_x_nhwc", 130 * 28 * 28) is None  # wgrad has no such step


def test_the_strided_dgrad_prep_is_found() -> None:
    """dgrad_tc_strided_*'s <variant>_dy writes dy in xh's layout [N][P Q][Kp] too."""
    spec = ConvSpec.make(3, 64, 29, 29, 30, 3, 3, stride=2, padding=1).with_pass("dgrad")
    plan = _plan("dgrad_tc_strided_tf32", spec)
    pd = prepared(plan, "dgrad_tc_strided_tf32_dy", 3 * spec.p * spec.q)
    assert pd is not None and pd.rows == Rows("dyh", TF32, 32)
    assert not any("y" in getattr(s, "args", ()) for s in pd.plan.steps)


def test_a_plan_whose_gradient_is_read_elsewhere_is_not_taken() -> None:
    """wgrad_tc_gemm1x1 reads dy as it lies: no prep step, nothing to take."""
    spec = ConvSpec.make(16, 64, 28, 28, 128, 1, 1).with_pass("wgrad")
    assert prepared(_plan("wgrad_tc_gemm1x1_tf32", spec), "wgrad_tc_gemm1x1_tf32_dy", 128 * 28 * 28) is None


def test_cuda_source_compiles_without_spills(nvcc_ok) -> None:  # type: ignore[no-untyped-def]
    from helpers import ptxas_reports

    sources = []
    for n, k, pq, math in ((16, 64, 224 * 224, TF32), (16, 512, 14 * 14, X3TF32), (64, 1024, 224 * 224, TF32)):
        kernels, _, _ = masked_rows(n, k, pq, Rows("fwd_xh", math, k), Rows("dyt", math, n))
        source = render(list(kernels), "cuda", "grad rows")
        if n * k * pq > 2**31 - 1:
            assert "long long" in source  # 64-bit offsets past 2^31 - 1 elements
        sources.append(source)
    for infos in ptxas_reports(sources):  # one nvcc run
        assert len(infos) == 2 and all(i.spill_stores == 0 == i.spill_loads for i in infos), infos
