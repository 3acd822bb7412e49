"""Squeeze-and-excitation training kernels (kernels/se.py) on PoCL against float64, every output poisoned with
NaN first; the CUDA source compiled by nvcc (no spills)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.render import render
from convforge.dtypes import rounded
from convforge.kernels.se import SeTrain, se_program, slices
from convforge.kernels.se import host_run as se_run
from convforge.reference import rel_l2

CASES = [
    SeTrain(2, 8, 25, 3),  # float4 channels, ReLU, sigmoid
    SeTrain(1, 7, 11, 5, act="silu"),  # N=1, odd C: one channel a thread; SiLU (EfficientNet)
    SeTrain(3, 12, 9, 4, gate="hardsigmoid"),  # MobileNet-v3's gate
    SeTrain(2, 40, 49, 10, act="silu", dtype="float16"),  # autocast: half activations, float32 master weights
    SeTrain(2, 36, 16, 9, dtype="bfloat16", gate="hardsigmoid"),
    SeTrain(2, 20, 13, 70, act="silu", dtype="float16", pdtype="float16"),  # a .half() model; S > the block
    # NCHW: planes of 4-pixel vectors, odd planes (one pixel a thread), a 1x1 plane, several channels a block
    SeTrain(2, 6, 36, 3, act="silu", dtype="float16", layout="nchw"),
    SeTrain(3, 5, 35, 2, gate="hardsigmoid", layout="nchw"),
    SeTrain(2, 9, 1, 4, dtype="bfloat16", layout="nchw"),
    SeTrain(1, 12, 7 * 7, 5, act="silu", layout="nchw"),
]


def _ids(se: SeTrain) -> str:
    return se.tag()


def _act(u: np.ndarray, act: str) -> np.ndarray:
    return u / (1 + np.exp(-u)) if act == "silu" else np.maximum(u, 0)


def _dact(u: np.ndarray, act: str) -> np.ndarray:
    if act == "relu":
        return (u > 0).astype(np.float64)
    s = 1 / (1 + np.exp(-u))
    return s * (1 + u * (1 - s))


def _gate(a: np.ndarray, gate: str) -> np.ndarray:
    return 1 / (1 + np.exp(-a)) if gate == "sigmoid" else np.clip(a + 3, 0, 6) / 6


def _dgate(a: np.ndarray, gate: str) -> np.ndarray:
    if gate == "sigmoid":
        g = 1 / (1 + np.exp(-a))
        return g * (1 - g)
    return ((a > -3) & (a < 3)) / 6.0


def reference(se: SeTrain, x: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray,
              gy: np.ndarray) -> dict[str, np.ndarray]:
    """float64: y and every gradient, x and gy as (N, H*W, C)."""
    x, gy = x.astype(np.float64), gy.astype(np.float64)
    w1, b1, w2, b2 = (t.astype(np.float64) for t in (w1, b1, w2, b2))
    p = x.mean(axis=1)  # N x C
    u = p @ w1.T + b1  # N x S
    h = _act(u, se.act)
    a = h @ w2.T + b2  # N x C
    g = _gate(a, se.gate)
    y = x * g[:, None, :]
    gs = (gy * x).sum(axis=1)
    ga = gs * _dgate(a, se.gate)
    gu = (ga @ w2) * _dact(u, se.act)
    gp = (gu @ w1) / se.hw
    gx = gy * g[:, None, :] + gp[:, None, :]
    return {"y": y, "gx": gx, "gw1": gu.T @ p, "gb1": gu.sum(0), "gw2": ga.T @ h, "gb2": ga.sum(0)}


def _inputs(se: SeTrain, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shape = (se.n, se.hw, se.c)
    arrays = {"x": rounded(rng.standard_normal(shape).astype(np.float32), se.dtype),
              "gy": rounded(rng.standard_normal(shape).astype(np.float32), se.dtype)}
    arrays["w1"] = rounded((rng.standard_normal((se.s, se.c)) / np.sqrt(se.c)).astype(np.float32), se.pdtype)
    arrays["w2"] = rounded((rng.standard_normal((se.c, se.s)) / np.sqrt(se.s)).astype(np.float32), se.pdtype)
    arrays["b1"] = rounded((0.1 * rng.standard_normal(se.s)).astype(np.float32), se.pdtype)
    arrays["b2"] = rounded((0.1 * rng.standard_normal(se.c)).astype(np.float32), se.pdtype)
    return arrays


def _run(ocl, se: SeTrain, arrays: dict[str, np.ndarray], sp: int | None) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    """Forward and backward; x, gy in and y, gx out as (N, H*W, C) whatever the layer's layout."""
    prog = se_program(se, ocl.device, sp)

    def lay(a: np.ndarray) -> np.ndarray:
        return a if se.nhwc else a.transpose(0, 2, 1)

    acts = {k: lay(arrays[k]) for k in ("x", "gy")}
    fwd = se_run(ocl, se, "forward", {"x": acts["x"], **{k: arrays[k] for k in ("w1", "b1", "w2", "b2")}}, prog)
    bwd = se_run(ocl, se, "backward", {**acts, **{k: arrays[k] for k in ("w1", "w2")}, "sv": fwd["sv"]}, prog)
    out = {**fwd, **bwd}
    for k in ("y", "gx"):
        out[k] = out[k] if se.nhwc else out[k].reshape(se.n, se.c, se.hw).transpose(0, 2, 1)
    return out


def _tol(se: SeTrain, name: str) -> float:
    """float32 everywhere: 1e-5; half activations round y and gx once (2^-9 / 2^-8 relative); half weights
    round the weight gradients once too."""
    if name in ("y", "gx"):
        return {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}[se.dtype]
    return 1e-5 if se.pdtype == "float32" else {"float16": 1e-3, "bfloat16": 8e-3}[se.pdtype]


@pytest.mark.parametrize("sp", [None, 3])
@pytest.mark.parametrize("se", CASES, ids=_ids)
def test_against_float64(ocl, se: SeTrain, sp: int | None) -> None:  # type: ignore[no-untyped-def]
    """Forward and backward on fresh inputs (one slice a sample on the CPU device, and 3: the slices' sums
    added in the mlp), against float64 by relative L2."""
    arrays = _inputs(se, np.random.default_rng(len(se.tag()) + (sp or 0)))
    out = _run(ocl, se, arrays, sp if sp is None else min(sp, se.hw))
    ref = reference(se, *(arrays[k] for k in ("x", "w1", "b1", "w2", "b2", "gy")))
    for name, want in ref.items():
        got = np.ascontiguousarray(out[name]).reshape(want.shape)
        assert not np.isnan(got).any(), name
        assert rel_l2(got, want) < _tol(se, name), (name, rel_l2(got, want))


def test_runs_are_bit_identical_and_inf_reaches_every_gradient(ocl) -> None:  # type: ignore[no-untyped-def]
    """Fixed-order sums: a second run gives the same bits; an overflowing (scaled) output gradient reaches
    the weight gradients and gx as Inf / NaN, as a GradScaler needs to see."""
    se = SeTrain(2, 8, 30, 4, act="silu", dtype="float16")
    arrays = _inputs(se, np.random.default_rng(3))
    a, b = _run(ocl, se, arrays, 3), _run(ocl, se, arrays, 3)
    for name in ("y", "gx", "gw1", "gb1", "gw2", "gb2"):
        np.testing.assert_array_equal(a[name], b[name])
    arrays["gy"] = arrays["gy"].copy()
    arrays["gy"][1, 7, 2] = np.inf
    bad = _run(ocl, se, arrays, 3)
    for name in ("gx", "gw1", "gb1", "gw2", "gb2"):
        assert not np.isfinite(bad[name]).all(), name


def test_bad_layers_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"S \(0\)"):
        SeTrain(2, 8, 4, 0)
    with pytest.raises(ValueError, match=r"S \(5000\) must be at most"):
        SeTrain(2, 8, 4, 5000)
    with pytest.raises(ValueError, match="layout"):
        SeTrain(2, 8, 4, 2, layout="nhcw")
    with pytest.raises(ValueError, match="gate"):
        SeTrain(2, 8, 4, 2, gate="tanh")
    with pytest.raises(ValueError, match="weights'"):
        SeTrain(2, 8, 4, 2, dtype="float16", pdtype="bfloat16")
    with pytest.raises(ValueError, match=r"slices \(0\)"):
        se_program(SeTrain(2, 8, 4, 2), NOMINAL_CUDA, sp=0)


def test_slices_fill_the_gpu() -> None:
    """EfficientNet-B0 N128's first SE (32 channels at 112 x 112): several slices a sample on 132 SMs; a
    7 x 7 plane one; NCHW planes split where there are few of them."""
    assert slices(SeTrain(128, 32, 112 * 112, 8), NOMINAL_CUDA) > 1
    assert slices(SeTrain(128, 1152, 49, 48), NOMINAL_CUDA) == 1
    assert slices(SeTrain(2, 32, 112 * 112, 8, layout="nchw"), NOMINAL_CUDA) > 1  # a block a plane: few planes


def test_cuda_source_compiles_without_spills(nvcc_ok) -> None:  # type: ignore[no-untyped-def]
    from helpers import ptxas_reports

    progs = [se_program(se, NOMINAL_CUDA) for se in (SeTrain(128, 96, 112 * 112, 4, "silu", dtype="float16"),
                                                     SeTrain(64, 480, 14 * 14, 20, "silu", dtype="float16",
                                                             layout="nchw"),
                                                     SeTrain(32, 40, 7 * 7, 10, layout="nchw"),
                                                     SeTrain(128, 1152, 49, 48, "silu", dtype="bfloat16"),
                                                     SeTrain(64, 120, 28 * 28, 32, gate="hardsigmoid",
                                                             dtype="float16"))]
    for prog, infos in zip(progs, ptxas_reports([render(list(p.kernels), "cuda", "se") for p in progs]), strict=True):
        assert len(infos) == len(prog.kernels) and all(i.spill_stores == 0 and i.spill_loads == 0
                                                       for i in infos), infos
