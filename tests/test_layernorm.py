"""Layer norm over rows (kernels/layernorm.py) on PoCL against float64, the output poisoned with NaN first;
the CUDA source compiled by nvcc (no spills)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.render import render
from convforge.dtypes import rounded
from convforge.kernels.layernorm import LayerNormRows, kernel, launch
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

    lns = [LayerNormRows(32 * 56 * 56, 96, 1e-6, "float16", "float16"), LayerNormRows(64 * 49, 768, 1e-6, "bfloat16",
                                                                                       "bfloat16"),
           LayerNormRows(100, 8192), LayerNormRows(10, 2047, 1e-5, "float16", "float32")]
    infos = ptxas_reports([render([kernel(ln, max(ln.g, 256))], "cuda", "ln") for ln in lns])
    assert len(infos) == len(lns) and all(len(r) == 1 and r[0].spill_stores == 0 and r[0].spill_loads == 0
                                          for r in infos), infos
