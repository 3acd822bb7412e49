"""Batch-norm statistics in the wgmma generator's NHWC epilogue (``TcImplicitGemm.plan_stats``,
sm90/epilogue.py): which thread adds which output value into which partial, evaluated from the very
expressions the kernel has (every stored value of the layer in exactly one partial, a partial's rows
those of one consumer warpgroup's tile, its shift that tile's first row); the partials' layout as
``bn_program(partials=P)`` reads it, fed with a NumPy model of the kernel's sums on PoCL; the plans'
refusals; nvcc compiles (sm_90a, no spills). The GPU run is tests/test_gpu_bnstats.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from convforge.kernels import get_variant
from convforge.kernels.batchnorm import PARTIAL_ROWS
from convforge.kernels.tensorcore.sm90.cexpr import bind
from convforge.kernels.tensorcore.sm90.epilogue import (
    COLS,
    H8,
    h8_items,
    h8_lets,
    partials,
    rowmajor_chunks,
    rowmajor_lets,
)
from convforge.kernels.tensorcore.sm90.tiles import TileConfig
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.spec import ConvSpec

NAME = "tc_implicit_gemm_half"
# odd row counts (M = N P Q not a multiple of a tile), K past the last 32-column chunk, stride 2, N = 1
SPECS = [ConvSpec.make(1, 24, 9, 11, 40, 3, 3, 1, 1, dtype="float16", layout="nhwc"),
         ConvSpec.make(3, 16, 13, 7, 72, 1, 1, 2, 0, dtype="bfloat16", layout="nhwc"),
         ConvSpec.make(2, 64, 15, 15, 96, 3, 3, 1, (0, 1, 2, 1), dtype="float16", layout="nhwc")]
POINTS = [dict(bm=128, bn=64, cw=2, pp=1), dict(bm=128, bn=64, cw=2, pp=0), dict(bm=256, bn=128, cw=2, pp=0),
          dict(bm=64, bn=64, cw=1, pp=0), dict(bm=128, bn=128, cw=2, pp=1, eh=0), dict(bm=128, bn=96, cw=2, pp=0)]


def _config(v, spec, dev, point):  # type: ignore[no-untyped-def]
    base = v.default(spec, dev)
    return Params({**dict(base), **point, "ks": 1})


def _owners(spec: ConvSpec, cfg: TileConfig) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(row m, column k) -> (partial j, the adding thread's quad, its chunk) over every tile and consumer
    warpgroup, as the kernel's row-major epilogue runs them (rowmajor_lets evaluated per thread)."""
    prob = get_variant(NAME).problem(spec)
    tm, tn, wm = -(-prob.m // cfg.bm), -(-prob.n // cfg.bn), cfg.wm
    out: dict[tuple[int, int], tuple[int, int, int]] = {}
    for mb in range(tm):
        for nb in range(tn):
            rows = [mb * cfg.bm] if cfg.pp else [mb * cfg.bm + c * 64 * wm for c in range(cfg.cw)]
            for row0 in rows:
                if row0 >= prob.m:
                    continue  # an empty warpgroup writes no partial (its row0 >= M guard)
                if cfg.eh and cfg.bn % H8 == 0 and prob.n % 8 == 0:  # the half-staged epilogue
                    _h8_owners(out, prob.m, prob.n, wm, row0, nb * cfg.bn, cfg.bn)
                    continue
                for ch, items, quads in rowmajor_chunks(wm, cfg.bn):
                    assert quads == 8, "statistics need whole 32-column chunks"
                    for ct in range(128):
                        sq = ct & 7
                        for item in items:
                            env = bind(rowmajor_lets(wm, item, quads), {"ct": ct})
                            assert env[f"eq{item}"] == sq  # one quad a thread, every item
                            m, k0 = row0 + env[f"er{item}"], nb * cfg.bn + COLS * ch + 4 * sq
                            for i in range(4):
                                if m < prob.m and k0 + i < prob.n:
                                    assert (m, k0 + i) not in out, (m, k0 + i)
                                    out[(m, k0 + i)] = (row0 // (64 * wm), sq, ch)
    return out


def _h8_owners(out: dict[tuple[int, int], tuple[int, int, int]], m_total: int, n_total: int, wm: int, row0: int,
               col0: int, bn: int) -> None:
    """_owners for one warpgroup tile of the half-staged epilogue: a thread's octet sq = ct % 8 of each
    64-column chunk (h8_lets), its rows those the float path gives the thread of quad sq (same order)."""
    for ch in range(bn // H8):
        for ct in range(128):
            sq = ct & 7
            for item in range(h8_items(wm)):
                env = bind(h8_lets(item), {"ct": ct})
                assert env[f"eo{item}"] == sq and env[f"er{item}"] == ct // 8 + 16 * item
                m, k0 = row0 + env[f"er{item}"], col0 + H8 * ch + 8 * sq
                for i in range(8):
                    if m < m_total and k0 + i < n_total:
                        assert (m, k0 + i) not in out, (m, k0 + i)
                        out[(m, k0 + i)] = (row0 // (64 * wm), sq, ch)


@pytest.mark.parametrize("point", POINTS, ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_every_value_in_one_partial_of_its_warpgroups_rows(spec: ConvSpec, point) -> None:  # type: ignore[no-untyped-def]
    from conftest import NOMINAL_CUDA

    v = get_variant(NAME)
    cfg = TileConfig.of(_config(v, spec, NOMINAL_CUDA, point))
    prob = v.problem(spec)
    owners = _owners(spec, cfg)
    assert len(owners) == prob.m * prob.n  # every stored value, once
    p = partials(prob.m, cfg.wm)
    for (m, _k), (j, _sq, _ch) in owners.items():
        assert j == m // (64 * cfg.wm) < p  # partial j: rows [64 wm j, 64 wm (j + 1))


def _model_partials(y: np.ndarray, wm: int) -> np.ndarray:
    """The kernel's partial sums of an (M, K) output in float32 (4, P, K): about each piece's first row."""
    m, k = y.shape
    p = partials(m, wm)
    out = np.zeros((len(PARTIAL_ROWS), p, k), np.float32)
    for j in range(p):
        rows = y[64 * wm * j:64 * wm * (j + 1)].astype(np.float32)
        d = rows - rows[0]
        out[0, j], out[1, j] = d.sum(0, dtype=np.float32), (d * d).sum(0, dtype=np.float32)
        out[2, j], out[3, j] = rows[0], len(rows)
    return out


def test_partials_layout_is_what_the_batch_norm_finalizes(ocl) -> None:  # type: ignore[no-untyped-def]
    """The NumPy model of the epilogue's partials, about each piece's own first row, around a mean of 300:
    bn_program(partials=P) on PoCL finalizes them into the batch statistics of y (float64 reference)."""
    from convforge.dtypes import rounded
    from convforge.kernels.batchnorm import ST, BnTrain, bn_program, host_run

    n, hw, c, wm = 3, 70, 12, 1
    bn = BnTrain(n, c, hw, relu=False, dtype="float16", layout="nhwc")
    y = rounded(300.0 + np.random.default_rng(5).standard_normal((n, hw, c)), "float16")  # NHWC rows
    part = _model_partials(y.reshape(n * hw, c), wm)
    prog = bn_program(bn, ocl.device, 1, partials=part.shape[1])
    ones, zeros = np.ones(c, np.float32), np.zeros(c, np.float32)
    got = host_run(ocl, bn, "forward", {"y": y.reshape(-1), "gamma": ones, "beta": zeros, "rmean": zeros.copy(),
                                        "rvar": ones.copy(), "nbt": np.zeros(1, np.int64),
                                        "part": part.reshape(-1)}, prog)
    st = got["st"][:len(ST) * c].reshape(len(ST), c).astype(np.float64)
    y64 = y.reshape(n * hw, c).astype(np.float64)
    np.testing.assert_allclose(st[ST.index("k0")] + st[ST.index("dm")], y64.mean(0), rtol=1e-7)
    np.testing.assert_allclose(1.0 / st[ST.index("inv")] ** 2 - bn.eps, y64.var(0), rtol=1e-3)


def test_plan_stats_writes_bnpart_and_refuses_what_it_cannot() -> None:
    from conftest import NOMINAL_CUDA

    v = get_variant(NAME)
    spec = SPECS[0]
    prm = Params({**dict(v.default(spec, NOMINAL_CUDA)), "ks": 2})
    plan, p = v.plan_stats(spec, prm, NOMINAL_CUDA)
    assert plan.params["ks"] == 1 and "bnpart" in plan.steps[-1].args  # unsplit: the GEMM's epilogue writes them
    assert p == partials(spec.n * spec.p * spec.q, TileConfig.of(plan.params).wm)
    with pytest.raises(ValueError, match="NHWC forward"):
        v.plan_stats(dataclasses.replace(spec, layout="nchw"), prm, NOMINAL_CUDA)
    with pytest.raises(ValueError, match="plain output"):
        v._plan(spec, prm.replace(ks=1), NOMINAL_CUDA, Epilogue(relu=True), stats=True)


def test_stats_plans_compile_without_spills(nvcc_ok) -> None:  # type: ignore[no-untyped-def]
    """A ResNet-50 layer at its default tile and an odd layer at the widest tile compile for sm_90a
    without spills (the sums, the shifts and the column's reduction add registers to the epilogue)."""
    from conftest import NOMINAL_CUDA
    from convforge.codegen.nvcc import ptxas_report

    v = get_variant(NAME)
    big = ConvSpec.make(128, 256, 14, 14, 256, 3, 3, 1, 1, dtype="float16", layout="nhwc")
    plans = [v.plan_stats(big, v.default(big, NOMINAL_CUDA), NOMINAL_CUDA)[0],
             v.plan_stats(SPECS[1], _config(v, SPECS[1], NOMINAL_CUDA, {**POINTS[2], "st": 3}), NOMINAL_CUDA)[0]]
    for plan in plans:
        infos = ptxas_report(plan.source("cuda"))
        gemm = [i for i in infos if i.kernel.endswith("_gemm")]
        assert gemm and all(i.spill_stores == 0 and i.spill_loads == 0 for i in gemm), (plan.params, infos)


def test_the_kernels_partial_index_and_row_count_are_the_models() -> None:
    """The generated source's partial index and row count, evaluated for every consumer of every tile
    (ra0 = mb bm, consumer c; C's integer division on non-negative values), are the model's:
    j = row0 / 64 wm and min(M - row0, 64 wm) rows."""
    import re

    from conftest import NOMINAL_CUDA

    v = get_variant(NAME)
    spec = SPECS[2]
    for point in POINTS[:2]:
        prm = _config(v, spec, NOMINAL_CUDA, point)
        cfg, m = TileConfig.of(prm), v.problem(spec).m
        src = v.plan_stats(spec, prm, NOMINAL_CUDA)[0].source("cuda")
        found = re.search(r"pj = (.+?), nrows = (min\(.+?\));", src)
        assert found, "no partial index in the source"
        pj, nrows = (e.replace("/", "//") for e in found.groups())
        for mb in range(-(-m // cfg.bm)):
            for c in range(1 if cfg.pp else cfg.cw):
                row0 = mb * cfg.bm + (0 if cfg.pp else c * 64 * cfg.wm)
                if row0 < m:  # the store's guard
                    env = {"ra0": mb * cfg.bm, "c": c, "min": min}
                    assert eval(pj, env) == row0 // (64 * cfg.wm)  # noqa: S307 - the kernel's own expression
                    assert eval(nrows, env) == min(m - row0, 64 * cfg.wm)  # noqa: S307


def test_the_block_passes_the_partials_through_the_conv_residual_slot() -> None:
    """native.cpp's block hands the statistics plan the batch norm's partial-sum scratch in the conv's
    "res" slot: the plan's "bnpart" renamed there, nothing else changed; a plan with a residual refused."""
    pytest.importorskip("torch", reason="torch not installed: convforge.torch's filing helpers skipped")
    from conftest import NOMINAL_CUDA
    from convforge.torch.batchnorm import partials_in_res

    v = get_variant(NAME)
    plan, _ = v.plan_stats(SPECS[0], v.default(SPECS[0], NOMINAL_CUDA), NOMINAL_CUDA)
    moved = partials_in_res(plan)
    before = [s.args for s in plan.steps]
    after = [s.args for s in moved.steps]
    assert [tuple("res" if a == "bnpart" else a for a in args) for args in before] == after
    assert "bnpart" not in str(after) and "res" in after[-1] and moved.kernels == plan.kernels
    with pytest.raises(ValueError, match="residual"):
        partials_in_res(dataclasses.replace(plan, epilogue=Epilogue(residual=True)))
