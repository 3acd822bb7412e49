"""Layer norm over rows (kernels/layernorm.py) on PoCL against float64, forward and backward, every output
poisoned with NaN first; the CUDA source compiled by nvcc (no spills)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.render import render
from convforge.dtypes import rounded
from convforge.kernels.layernorm import LayerNormGrad, LayerNormRows, grad_host_run, grad_program, kernel, launch
from convforge.kernels.layernorm import host_run as ln_run
from convforge.reference import rel_l2

CASES = [
    LayerNormRows(7, 96, 1e-6),  # ConvNeXt-T's first stage: float4 rows, a group of 4 threads
    LayerNormRows(1, 13, 1e-5),  # one row, odd C: one value a load
    LayerNormRows(33, 768, 1e-6, "float16", "float16", "float32"),  # autocast: half in and out, float32 params
    LayerNormRows(5, 384, 1e-6, "float16", "float32", "float32"),  # half in, float32 out
    LayerNormRows(6, 100, 1e-6, "bfloat16", "bfloat16", "bfloat16"),  # a .bfloat16() model: 25 vectors, 4 threads
    LayerNormRows(3, 4100, 1e-5),  # past 1,024 vectors: 256 threads a row, the last vectors partial
    LayerNormRows(4, 50, 0.0, affine=False),  # no gamma / beta
    LayerNormRows(2, 1001, 1e-5, "float16", "float16", "float16"),  # odd C past a group of 32 values a thread
]


def _tol(ln: LayerNormRows) -> float:
    """Rounding the output once: 2^-11 / 2^-8 relative for float16 / bfloat16; float32 sums of C terms."""
    return {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}[ln.out]


def _inputs(ln: LayerNormRows, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = rounded((3.0 + 2.0 * rng.standard_normal((ln.rows, ln.c))).astype(np.float32), ln.dtype)  # mean far from 0
    gamma = rounded((1 + 0.3 * rng.standard_normal(ln.c)).astype(np.float32), ln.pdtype)
    beta = rounded((0.2 * rng.standard_normal(ln.c)).astype(np.float32), ln.pdtype)
    return x, gamma, beta


def reference(ln: LayerNormRows, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    mean = x.mean(axis=1, keepdims=True)
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=1, keepdims=True) + ln.eps)
    return y * gamma.astype(np.float64) + beta.astype(np.float64) if ln.affine else y


@pytest.mark.parametrize("ln", CASES, ids=LayerNormRows.tag)
def test_against_float64(ocl, ln: LayerNormRows) -> None:  # type: ignore[no-untyped-def]
    x, gamma, beta = _inputs(ln, np.random.default_rng(ln.c + ln.rows))
    got = ln_run(ocl, ln, x, gamma, beta)
    assert not np.isnan(got).any(), "an output was never written"
    want = reference(ln, x, gamma, beta)
    assert rel_l2(got, want) < _tol(ln), rel_l2(got, want)


def test_a_row_of_inf_stays_in_its_row(ocl) -> None:  # type: ignore[no-untyped-def]
    ln = LayerNormRows(4, 24, 1e-6)
    x, gamma, beta = _inputs(ln, np.random.default_rng(1))
    x[2, 5] = np.inf
    got = ln_run(ocl, ln, x, gamma, beta)
    assert np.isnan(got[2]).all() and np.isfinite(np.delete(got, 2, axis=0)).all()


def test_groups_and_refusals() -> None:
    assert LayerNormRows(1, 96).g == 4 and LayerNormRows(1, 768).g == 32 and LayerNormRows(1, 13).g == 1
    assert launch(LayerNormRows(1000, 96), NOMINAL_CUDA)[1].grid == (16, 1, 1)  # 64 rows a 256-thread block
    with pytest.raises(ValueError, match=r"C \(9000\) must be at most"):
        LayerNormRows(2, 9000)
    with pytest.raises(ValueError, match=r"output dtype \(float64\)"):
        LayerNormRows(2, 8, out="float64")
    with pytest.raises(ValueError, match=r"rows \(0\)"):
        LayerNormRows(0, 8)


def test_cuda_source_compiles_without_spills(nvcc_ok) -> None:  # type: ignore[no-untyped-def]
    from helpers import ptxas_reports

    grads = [LayerNormGrad(64 * 56 * 56, 96, "float16", "float16"), LayerNormGrad(64 * 49, 768, "bfloat16", "bfloat16"),
             LayerNormGrad(100, 4096), LayerNormGrad(10, 2047, "float16", "float32")]
    progs = [grad_program(lg, NOMINAL_CUDA) for lg in grads]
    reports = ptxas_reports([render(list(p.kernels), "cuda", "lnb") for p in progs])
    assert all(len(r) == len(p.kernels) and all(i.spill_stores == 0 and i.spill_loads == 0 for i in r)
               for r, p in zip(reports, progs, strict=True)), reports

    lns = [LayerNormRows(32 * 56 * 56, 96, 1e-6, "float16", "float16"), LayerNormRows(64 * 49, 768, 1e-6, "bfloat16",
                                                                                       "bfloat16"),
           LayerNormRows(100, 8192), LayerNormRows(10, 2047, 1e-5, "float16", "float32")]
    infos = ptxas_reports([render([kernel(ln, max(ln.g, 256))], "cuda", "ln") for ln in lns])
    assert len(infos) == len(lns) and all(len(r) == 1 and r[0].spill_stores == 0 and r[0].spill_loads == 0
                                          for r in infos), infos


# (forward, backward dtypes): the backward of a forward with statistics, gy in the forward's output dtype
GRAD_CASES = [
    (LayerNormRows(9, 96, 1e-6, stats=True), LayerNormGrad(9, 96)),
    (LayerNormRows(37, 24, 1e-6, "float16", "float16", stats=True), LayerNormGrad(37, 24, "float16", "float16")),
    (LayerNormRows(150, 13, 1e-5, stats=True), LayerNormGrad(150, 13)),  # odd C: one value a load; 3 blocks' rows
    (LayerNormRows(11, 200, 1e-6, "bfloat16", "bfloat16", "bfloat16", stats=True),
     LayerNormGrad(11, 200, "bfloat16", "bfloat16", "bfloat16")),  # a .bfloat16() model: bf16 parameters
    (LayerNormRows(70, 20, 1e-5, affine=False, stats=True), LayerNormGrad(70, 20, affine=False)),
    (LayerNormRows(3, 1028, 1e-6, "float16", "float16", stats=True), LayerNormGrad(3, 1028, "float16", "float16")),
]


def grad_reference(x: np.ndarray, gy: np.ndarray, gamma: np.ndarray | None, eps: float) -> dict[str, np.ndarray]:
    x, gy = x.astype(np.float64), gy.astype(np.float64)
    mean = x.mean(axis=1, keepdims=True)
    inv = 1 / np.sqrt(((x - mean) ** 2).mean(axis=1, keepdims=True) + eps)
    xh = (x - mean) * inv
    gxh = gy * (gamma.astype(np.float64) if gamma is not None else 1.0)
    gx = inv * (gxh - gxh.mean(axis=1, keepdims=True) - xh * (gxh * xh).mean(axis=1, keepdims=True))
    return {"gx": gx, "ggamma": (gy * xh).sum(axis=0), "gbeta": gy.sum(axis=0)}


@pytest.mark.parametrize("blocks", [None, 2])
@pytest.mark.parametrize("fwd,lg", GRAD_CASES, ids=lambda c: c.tag())
def test_backward_against_float64(ocl, fwd: LayerNormRows, lg: LayerNormGrad, blocks: int | None) -> None:  # type: ignore[no-untyped-def]
    """The forward's statistics (against float64's mean and 1/std), then gx, dgamma and dbeta from them."""
    rng = np.random.default_rng(lg.c * 7 + lg.rows)
    x, gamma, beta = _inputs(fwd, rng)
    gy = rounded(rng.standard_normal((lg.rows, lg.c)).astype(np.float32), lg.gdtype)
    _, st = ln_run(ocl, fwd, x, gamma, beta)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=1)
    assert rel_l2(st[:, 0], mean) < 1e-6
    assert rel_l2(st[:, 1], 1 / np.sqrt(((x64 - mean[:, None]) ** 2).mean(axis=1) + fwd.eps)) < 1e-6
    most = -(-lg.rows // (min(64, ocl.device.max_threads) // lg.g)) if lg.g <= 64 else lg.rows
    got = grad_host_run(ocl, lg, x, gy, st, gamma if lg.affine else None, None if blocks is None else min(blocks, most))
    want = grad_reference(x, gy, gamma if lg.affine else None, fwd.eps)
    for name, g in got.items():
        assert not np.isnan(g).any(), name
        tol = {"gx": {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}[lg.dtype]}.get(
            name, {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}[lg.pdtype])
        assert rel_l2(g.reshape(want[name].shape), want[name]) < tol, (name, rel_l2(g, want[name]))


def test_backward_is_bit_identical_and_inf_reaches_the_parameters(ocl) -> None:  # type: ignore[no-untyped-def]
    fwd = LayerNormRows(150, 16, 1e-6, "float16", "float16", stats=True)
    lg = LayerNormGrad(150, 16, "float16", "float16")
    rng = np.random.default_rng(5)
    x, gamma, beta = _inputs(fwd, rng)
    gy = rounded(rng.standard_normal((150, 16)).astype(np.float32), "float16")
    _, st = ln_run(ocl, fwd, x, gamma, beta)
    a, b = grad_host_run(ocl, lg, x, gy, st, gamma, 2), grad_host_run(ocl, lg, x, gy, st, gamma, 2)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    gy[4, 3] = np.inf  # an overflowing scaled loss: GradScaler must see it in every gradient
    bad = grad_host_run(ocl, lg, x, gy, st, gamma, 2)
    assert not np.isfinite(bad["gx"][4]).all() and np.isfinite(np.delete(bad["gx"], 4, axis=0)).all()
    assert not np.isfinite(bad["ggamma"][3]) and not np.isfinite(bad["gbeta"][3])


def test_backward_refusals() -> None:
    with pytest.raises(ValueError, match=r"C \(5000\) must be at most 4096 in the backward"):
        LayerNormGrad(2, 5000)
    with pytest.raises(ValueError, match=r"blocks \(9\) must be in 1..1"):  # 2 rows: one group of 32
        grad_program(LayerNormGrad(2, 96), NOMINAL_CUDA, blocks=9)
    assert grad_program(LayerNormGrad(64 * 56 * 56, 96), NOMINAL_CUDA).launches[0].grid == (528, 1, 1)
