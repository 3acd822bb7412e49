"""Winograd: exact transform identities, float32 transform error, every variant on PoCL on odd
shapes (default + sampled parameters), and a CUDA compile of each default with 0 spills."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.codegen.nvcc import PtxasInfo
from convforge.kernels import get_variant
from convforge.kernels.winograd.matrices import Matrix, matmul, transpose, winograd
from convforge.kernels.winograd.tiles import Geometry
from convforge.params import Params
from convforge.plan import DeviceInfo, Plan
from convforge.spec import ConvSpec
from helpers import covering, ptxas_reports

SIZES = [(2, 3), (4, 3), (6, 3), (7, 3), (2, 5), (3, 2), (4, 5)]
# float32 transform error bounds per F(m, r), about 10x what the 1-D/2-D error test measures
F32_BOUND = {(2, 3): 1e-6, (4, 3): 5e-6, (6, 3): 5e-5, (7, 3): 3e-4, (2, 5): 5e-6, (3, 2): 1e-6,
             (4, 5): 1e-4}


def _rand_frac(rng: random.Random, shape: tuple[int, int]) -> Matrix:
    return tuple(tuple(Fraction(rng.randint(-9, 9), rng.randint(1, 5)) for _ in range(shape[1]))
                 for _ in range(shape[0]))


def _hadamard(a: Matrix, b: Matrix) -> Matrix:
    return tuple(tuple(x * y for x, y in zip(ra, rb)) for ra, rb in zip(a, b))


def _corr2d(d: Matrix, g: Matrix, m: int) -> Matrix:
    r = len(g)
    return tuple(tuple(sum((d[i + a][j + b] * g[a][b] for a in range(r) for b in range(r)),
                           Fraction(0)) for j in range(m)) for i in range(m))


@pytest.mark.parametrize("m,r", SIZES)
def test_identity_1d_exact(m: int, r: int) -> None:
    t = winograd(m, r)
    rng = random.Random(m * 10 + r)
    for _ in range(5):
        d = _rand_frac(rng, (t.alpha, 1))
        g = _rand_frac(rng, (r, 1))
        y = matmul(t.AT, _hadamard(matmul(t.G, g), matmul(t.BT, d)))
        want = tuple((sum((d[i + j][0] * g[j][0] for j in range(r)), Fraction(0)),)
                     for i in range(m))
        assert y == want


@pytest.mark.parametrize("m,r", SIZES)
def test_paired_output_sums_equal_plain_rows(m: int, r: int) -> None:
    """paired_lincombs (A^T's columns at +-p share one sum or difference) computes every row of
    A^T exactly as the plain linear combination does, and saves terms where points pair up."""
    import re

    from convforge.kernels.winograd.matrices import lincomb, paired_lincombs

    t = winograd(m, r)
    names = [f"c{i}" for i in range(t.alpha)]
    pre, rows = paired_lincombs(t.AT, names, "p")
    rng = random.Random(m * 7 + r)
    env = {nm: float(rng.uniform(-1, 1)) for nm in names}

    def value(expr: str) -> float:
        return float(eval(re.sub(r"(\d+\.\d*(?:e-?\d+)?)f", r"\1", expr), {}, env))  # noqa: S307

    for stmt in pre:
        lhs, rhs = stmt.removeprefix("const float ").rstrip(";").split(" = ")
        env[lhs] = value(rhs)
    for row, expr in zip(t.AT, rows):
        want = value(lincomb(row, names))
        assert value(expr) == pytest.approx(want, rel=1e-12, abs=1e-12), (row, expr)
    plain = sum(sum(1 for c in row if c) for row in t.AT)  # terms, i.e. multiply-adds
    paired = sum(len(re.findall(r"\b[cp][sd]?\d+\b", expr)) for expr in rows) + len(pre)
    assert paired <= plain
    if t.m >= 6:  # +-1, +-2 and +-1/2 pair up over many rows
        assert paired < 0.8 * plain


@pytest.mark.parametrize("m,r", SIZES)
def test_identity_2d_exact(m: int, r: int) -> None:
    t = winograd(m, r)
    rng = random.Random(m * 100 + r)
    d = _rand_frac(rng, (t.alpha, t.alpha))
    g = _rand_frac(rng, (r, r))
    u = matmul(matmul(t.G, g), transpose(t.G))
    v = matmul(matmul(t.BT, d), transpose(t.BT))
    y = matmul(matmul(t.AT, _hadamard(u, v)), transpose(t.AT))
    assert y == _corr2d(d, g, m)


def test_input_transform_is_integer() -> None:
    for m, r in SIZES:
        assert all(v.denominator == 1 for row in winograd(m, r).BT for v in row)


@pytest.mark.parametrize("m,r", SIZES)
def test_float32_error(m: int, r: int) -> None:
    """2-D tiles through float32 transforms vs float64 direct correlation, relative L2."""
    t = winograd(m, r)
    at, g_, bt = (t.as_float(n, "float32") for n in ("AT", "G", "BT"))
    rng = np.random.default_rng(0)
    d = rng.uniform(-1, 1, (256, t.alpha, t.alpha)).astype(np.float32)
    g = rng.uniform(-1, 1, (256, r, r)).astype(np.float32)
    u = g_ @ g @ g_.T
    v = bt @ d @ bt.T
    y = at @ (u * v) @ at.T
    ref = np.zeros((256, m, m))
    for a in range(r):
        for b in range(r):
            ref += d[:, a:a + m, b:b + m].astype(np.float64) * g[:, a:a + 1, b:b + 1]
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < F32_BOUND[(m, r)], err


def test_points_validated() -> None:
    with pytest.raises(ValueError):
        winograd(2, 3, (Fraction(0), Fraction(0), Fraction(1)))
    with pytest.raises(ValueError):
        winograd(6, 3, (Fraction(0), Fraction(1)))


# -- kernels on PoCL ---------------------------------------------------------------------------

ODD = [
    ConvSpec.make(1, 1, 13, 13, 1, 3, 3, padding=1),
    ConvSpec.make(3, 5, 7, 11, 9, 3, 3, padding=(0, 1, 1, 0)),
    ConvSpec.make(2, 17, 13, 7, 70, 3, 3, padding=1),
    ConvSpec.make(1, 9, 5, 5, 3, 3, 3, padding=0),
]
VARIANTS = ["winograd_nonfused_f2", "winograd_nonfused_f4", "winograd_nonfused_f6",
            "winograd_nonfused_f7", "winograd_fused_f2", "winograd_fused_f4"]


@pytest.fixture(scope="module")
def backend():  # type: ignore[no-untyped-def]
    from convforge.backends import get_backend, opencl_available

    if not opencl_available():
        pytest.skip("no OpenCL device")
    return get_backend("opencl")


def _check(backend, name: str, spec: ConvSpec, params=None) -> None:  # type: ignore[no-untyped-def]
    from convforge.check import check_plan

    v = get_variant(name)
    assert v.applies(spec, backend.device) is None
    prm = params if params is not None else v.default(spec, backend.device)
    res = check_plan(v.plan(spec, prm, backend.device), backend, seed=1)
    assert res.ok, f"{name} {prm.short()} {spec.short()}: {res}"


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("spec", ODD, ids=lambda s: s.key())
def test_default_on_odd_shapes(backend, name: str, spec: ConvSpec) -> None:  # type: ignore[no-untyped-def]
    _check(backend, name, spec)


@pytest.mark.parametrize("name", VARIANTS)
def test_sampled_params(backend, name: str) -> None:  # type: ignore[no-untyped-def]
    spec = ConvSpec.make(2, 10, 9, 6, 13, 3, 3, padding=(1, 0, 0, 1))
    v = get_variant(name)
    space = v.space(spec, backend.device)[1:]
    for prm in random.Random(7).sample(space, min(2, len(space))):
        _check(backend, name, spec, prm)


@pytest.mark.parametrize("m", [2, 4])
def test_fused_async_copies_on_odd_shapes(backend, m: int) -> None:  # type: ignore[no-untyped-def]
    """The cp.async points (ca: transformed filters, ci: raw input windows through a per-thread
    shared area) on the odd shapes, taking turns: the ca point on C = K = 1 and on partial C / K
    tiles, the ci-only point on asymmetric padding and on no padding; and ci split over channels."""
    name = f"winograd_fused_f{m}"
    v = get_variant(name)
    for j, spec in enumerate(ODD):
        pts = [p for p in v.space(spec, backend.device) if ("ca" in p or "ci" in p) and "ks" not in p]
        ca, ci = (next(p for p in pts if "ca" in p), next(p for p in pts if "ci" in p and "ca" not in p))
        _check(backend, name, spec, (ca, ci)[j % 2])
    prm = next(p for p in v.space(SPLIT_SPEC, backend.device) if "ci" in p)
    _check(backend, name, SPLIT_SPEC, prm.replace(ks=3))


def test_fused_async_points_on_gpus() -> None:
    """GPU spaces offer ca/ci points after the register-staged ones; their CUDA uses cp.async."""
    for m in (2, 4):
        v = get_variant(f"winograd_fused_f{m}")
        space = v.space(RESNET[1], NOMINAL_CUDA)
        assert "ca" not in space[0] and "ci" not in space[0]
        prm = next(p for p in space if "ci" in p and "ca" in p)
        src = v.plan(RESNET[1], prm, NOMINAL_CUDA).source("cuda")
        assert src.count("cf_copy1_async(") >= (m + 2) ** 2 and "cf_copy4_async(" in src


def test_nonfused_other_filters(backend) -> None:  # type: ignore[no-untyped-def]
    _check(backend, "winograd_nonfused_f2", ConvSpec.make(1, 3, 11, 8, 4, 5, 5, padding=2))
    _check(backend, "winograd_nonfused_f2", ConvSpec.make(2, 4, 9, 10, 3, 2, 3))
    _check(backend, "winograd_nonfused_f4", ConvSpec.make(1, 2, 7, 9, 5, 1, 3, padding=(0, 0, 1, 1)))


SGEMM_ODD = [
    ConvSpec.make(1, 13, 11, 9, 7, 3, 3, padding=(0, 1, 1, 0)),  # N=1, odd C/K, asymmetric pad
    ConvSpec.make(2, 37, 9, 10, 71, 3, 3, padding=1),  # C, K across several partial tiles
    ConvSpec.make(1, 6, 12, 9, 8, 5, 5, padding=(2, 1, 2, 0)),  # 5x5 (F(4x4, 5x5): alpha 8)
]


@pytest.mark.parametrize("m", [2, 4])
def test_nonfused_sgemm_on_odd_shapes(backend, m: int) -> None:  # type: ignore[no-untyped-def]
    """The batched GEMM from kernels/sgemm.py (gemm=sgemm): the CPU point on odd shapes, and a
    GPU-style point (float4 loads of U and V, prefetch + double buffer) where K, T % 4 == 0."""
    name = f"winograd_nonfused_f{m}"
    v = get_variant(name)
    for spec in SGEMM_ODD:
        prm = v.sgemm_default(spec, backend.device)
        assert prm["gemm"] == "sgemm"
        _check(backend, name, spec, prm)
    spec = ConvSpec.make(2, 20, 8, 8, 36, 3, 3, padding=1)
    vec = Params(bm=32, bn=32, bk=8, tm=4, tn=4, va=4, vb=4, pf=1, db=1, gemm="sgemm", tb=64)
    assert vec in v.space(spec, backend.device)
    _check(backend, name, spec, vec)


@pytest.mark.parametrize("m", [2, 4])
def test_nonfused_split_gemm_on_odd_shapes(backend, m: int) -> None:  # type: ignore[no-untyped-def]
    """The batched GEMM split over channels (ks slices of M, summed by the output transform),
    even and uneven splits, bias + ReLU; M and the output NaN-poisoned by check_plan."""
    from convforge.plan import Epilogue

    name = f"winograd_nonfused_f{m}"
    v = get_variant(name)
    for spec, ks in ((SGEMM_ODD[1], 3), (SGEMM_ODD[0], 2)):
        prm = v.sgemm_default(spec, backend.device).replace(ks=ks)
        plan = v.plan(spec, prm, backend.device, Epilogue(bias=True, relu=True))
        g = 4 * (m + 2) ** 2 * spec.k * (spec.n * -(-spec.p // m) * -(-spec.q // m))
        assert dict(plan.workspace)["wino_m"] == ks * g and plan.steps[2].grid[2] == ks * (m + 2) ** 2
        res = check_plan(plan, backend, seed=3)
        assert res.ok, f"{prm.short()} {spec.short()}: {res}"


@pytest.mark.parametrize("m", [2, 4, 7])
def test_nonfused_staged_output_on_odd_shapes(backend, m: int) -> None:  # type: ignore[no-untyped-def]
    """Output tiles stored through shared memory (so=1) and directly (so=0) on odd shapes: partial
    tiles on the right and bottom edges, a last block with threads past the end, bias + ReLU
    from the per-tile filter index, and a split GEMM's slices summed first."""
    from convforge.plan import Epilogue

    v = get_variant(f"winograd_nonfused_f{m}")
    specs = ODD[:3]  # SGEMM_ODD[1] (partial C / K tiles, as ODD[2]) takes the split GEMM below
    epis = (Epilogue(), Epilogue(bias=True, relu=True))
    for k, spec in enumerate(specs):
        for so in (0, 1):  # each store path on every shape, with and without the epilogue in turn
            prm = v.default(spec, backend.device).replace(so=so)
            epi = epis[(k + so) % 2]
            res = check_plan(v.plan(spec, prm, backend.device, epi), backend, seed=5)
            assert res.ok, f"so={so} {epi} {spec.short()}: {res}"
    prm = v.sgemm_default(SGEMM_ODD[1], backend.device).replace(ks=2, so=1)
    res = check_plan(v.plan(SGEMM_ODD[1], prm, backend.device), backend, seed=6)
    assert res.ok, res


@pytest.mark.parametrize("m", [2, 4, 7])
def test_nonfused_half_filters_on_odd_shapes(backend, m: int) -> None:  # type: ignore[no-untyped-def]
    """hf=1: the filter kernel writes H = G_h g only and the GEMM's A loads finish U = H G_w^T.
    Odd shapes, 5x5 and 3x2 filters (r != s), a channel split, bias + ReLU, and float4 A loads;
    the workspace holds alpha_h * s floats per filter instead of alpha^2. The plain point and the
    split + staged + bias / ReLU one take the shapes in turns, swapped from one tile size to the
    next: each on some shapes of every tile size, each shape with both over the tile sizes."""
    from convforge.plan import Epilogue

    v = get_variant(f"winograd_nonfused_f{m}")
    # SGEMM_ODD's first two shapes (asymmetric pad, partial C / K tiles) repeat ODD[1] and ODD[2] here
    specs = ODD[1:3] + SGEMM_ODD[2:] + [ConvSpec.make(2, 7, 9, 10, 5, 3, 2, padding=1)]
    vec = Params(bm=32, bn=32, bk=8, tm=4, tn=4, va=4, vb=4, pf=1, db=1, gemm="sgemm", tb=64, hf=1)
    checked = 0
    turn = [2, 4, 7].index(m)
    for k, spec in enumerate([sp for sp in specs if v.applies(sp, backend.device) is None]):
        prm = v.sgemm_default(spec, backend.device).replace(hf=1)
        pts = ((prm, Epilogue()), (prm.replace(ks=2, so=1), Epilogue(bias=True, relu=True)))
        for p, epi in pts[(k + turn) % 2:][:1]:
            plan = v.plan(spec, p, backend.device, epi)
            g = Geometry(spec, m)
            assert dict(plan.workspace)["wino_u"] == 4 * g.ah * spec.s * spec.c * spec.k
            res = check_plan(plan, backend, seed=7)
            assert res.ok, f"{p.short()} {spec.short()}: {res}"
            checked += 1
    spec = ConvSpec.make(2, 20, 8, 8, 36, 3, 3, padding=1)  # K and T multiples of 4: float4 loads
    res = check_plan(v.plan(spec, vec, backend.device), backend, seed=8)
    assert res.ok, res
    assert checked >= (3 if m == 7 else 4)  # F(7x7) takes no 5x5 filter
    with pytest.raises(ValueError, match="hf=1 .* needs gemm='sgemm'"):
        v.plan(spec, v.own_default(spec, backend.device).replace(hf=1), backend.device)


@pytest.mark.parametrize("m", [2, 4, 7])
def test_nonfused_split_transforms_on_odd_shapes(backend, m: int) -> None:  # type: ignore[no-untyped-def]
    """xi / xo (split.py): a thread per row/column of a tile, 32 tiles per block. Odd shapes with
    partial tiles and a last block past the end, 5x5 and 3x2 filters (alpha_h != alpha_w),
    a channel split summed in the output pass, bias + ReLU through the staged stores. Both split
    transforms together on every shape; one of them beside the other's per-thread form (xi alone,
    xo alone: the workspaces they hand over) in turns over the shapes. Both together with bias + ReLU
    and both over a channel split take the shapes of at least two channels in turns, swapped from
    one tile size to the next."""
    from convforge.plan import Epilogue

    v = get_variant(f"winograd_nonfused_f{m}")
    # SGEMM_ODD's first two shapes (asymmetric pad, partial C / K tiles) repeat ODD[1] and ODD[2] here
    specs = ODD[:3] + SGEMM_ODD[2:] + [ConvSpec.make(2, 7, 9, 10, 5, 3, 2, padding=1)]
    checked = 0
    for k, spec in enumerate([sp for sp in specs if v.applies(sp, backend.device) is None]):
        base = v.default(spec, backend.device)
        pts = [(base.replace(xi=1), Epilogue()) if k % 2 == 0 else (base.replace(xo=1), Epilogue(bias=True)),
               (base.replace(xi=1, xo=1), Epilogue(bias=True, relu=True))]
        if spec.c >= 2 and (k + [2, 4, 7].index(m)) % 2:
            pts[1] = (v.sgemm_default(spec, backend.device).replace(ks=2, xi=1, xo=1), Epilogue())
        for prm, epi in pts:
            res = check_plan(v.plan(spec, prm, backend.device, epi), backend, seed=9)
            assert res.ok, f"{prm.short()} {epi} {spec.short()}: {res}"
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("m", [6, 7])
def test_nonfused_l2_order_and_block_tiles_on_odd_shapes(backend, m: int) -> None:  # type: ignore[no-untyped-def]
    """lo=1 (tile-major transforms, the GEMM's blocks last tiles first, every batch of a tile
    block together) and xt (16 / 64 tiles per transform block), with GPU defaults run on PoCL:
    partial tiles, several M and N blocks of the GEMM, a channel split, bias + ReLU; and the
    96-column GEMM tile (8 x 12 per thread) over a partial last block. The two shapes take the four
    points in turns, swapped between F(6x6) and F(7x7): each point on each shape once."""
    from convforge.plan import Epilogue

    v = get_variant(f"winograd_nonfused_f{m}")
    specs = [ConvSpec.make(3, 9, 40, 38, 70, 3, 3, padding=(1, 1, 0, 2)),  # 2 x 2 GEMM blocks
             ConvSpec.make(1, 5, 23, 17, 7, 3, 3, padding=(1, 0, 2, 1))]
    checked = 0
    mods = ((dict(lo=1), Epilogue()), (dict(lo=1, xt=16, ks=2), Epilogue(bias=True)),
            (dict(xt=64), Epilogue(bias=True, relu=True)), (dict(lo=1, xt=64, hf=1), Epilogue()))
    for j, spec in enumerate(specs):
        base = v.default(spec, NOMINAL_CUDA)
        for mod, epi in mods[(j + m) % 2::2]:
            prm = base.replace(**mod)
            res = check_plan(v.plan(spec, prm, backend.device, epi), backend, seed=5)
            assert res.ok, f"{prm.short()} {epi} {spec.short()}: {res}"
            checked += 1
    wide = ConvSpec.make(2, 12, 30, 30, 20, 3, 3, padding=1)  # 2 * 25 tiles (F(6)) / 2 * 25 (F(7))
    tile = Params(bm=32, bn=96, bk=16, tm=4, tn=12, va=1, vb=1, pf=1, db=1, gemm="sgemm", tb=128)
    res = check_plan(v.plan(wide, tile.replace(xi=1, xo=1, lo=1), backend.device), backend, seed=5)
    assert res.ok, res
    assert checked == 4
    with pytest.raises(ValueError, match="lo=1 .* needs xi=1, xo=1"):
        v.plan(wide, tile.replace(lo=1, xi=0, xo=1), NOMINAL_CUDA)
    with pytest.raises(ValueError, match="xt \\(24\\) must be one of"):
        v.plan(wide, tile.replace(xi=1, xo=1, xt=24), NOMINAL_CUDA)


def test_f7_gemm_tile_default_rule() -> None:
    """F(7x7) GPU defaults (H200, round 7): the 64 x 64 x 16 GEMM tile unsplit from 64 GEMM
    columns up, the 64 x 96 tile in 2 channel slices for a multiple of 96 columns that is not
    one of 64 (512@7² N96), the generator's choice with the wave model's split and hf + lo below
    64 columns; the space leads with xt=16 and lo flipped for <= 128 columns, and the other
    tiles early; every GPU space point keeps the default's transform choices."""
    f7 = get_variant("winograd_nonfused_f7")
    def layer(n: int, c: int, hw: int) -> ConvSpec:
        return ConvSpec.make(n, c, hw, hw, c, 3, 3, padding=1)

    for n, c, hw in ((32, 64, 56), (128, 128, 28), (64, 256, 14), (128, 512, 7)):
        d = f7.default(layer(n, c, hw), NOMINAL_CUDA)
        assert (d.bm, d.bn, d.bk, d.tm, d.tn, d.get("ks", 1)) == (64, 64, 16, 8, 8, 1), (n, c, hw)
        assert d.get("xi") == d.get("xo") == 1 and "lo" not in d and "hf" not in d
    d96 = f7.default(layer(96, 512, 7), NOMINAL_CUDA)
    assert (d96.bm, d96.bn, d96.tn, d96.get("ks")) == (64, 96, 12, 2)
    small = layer(32, 512, 7)
    d32 = f7.default(small, NOMINAL_CUDA)
    assert d32.get("hf") == d32.get("lo") == 1 and d32.bn == 32
    space = f7.space(small, NOMINAL_CUDA)
    assert space[2] == d32.replace(xt=16) and "lo" not in space[3]
    assert not any("lo" in p or "xt" in p for p in f7.space(layer(128, 64, 56), NOMINAL_CUDA)[:3])
    lead = f7.space(layer(96, 512, 7), NOMINAL_CUDA)[:f7.space_lead]
    assert any(p.bn == 64 and p.bk == 16 for p in lead) and any(p.bn == 128 for p in lead)
    space = f7.space(layer(64, 128, 28), NOMINAL_CUDA)
    assert space[1].get("xo") == 0 and space[1].get("so") == 1  # the one point without them
    for p in space[2:]:
        assert p.get("gemm", "own") == "own" or (p.get("xi") == p.get("xo") == 1 and p.pf == p.db == 1)


def test_half_filters_default_rule() -> None:
    """GPU defaults take hf=1 for alpha >= 8 with at most 64 GEMM columns (ResNet 512@7² N32 and
    N64 under F(7x7)), never for F(4x4) or larger grids; the space offers it with each split."""
    small, big = (ConvSpec.make(n, 512, 7, 7, 512, 3, 3, padding=1) for n in (32, 128))
    f7, f4 = get_variant("winograd_nonfused_f7"), get_variant("winograd_nonfused_f4")
    assert f7.default(small, NOMINAL_CUDA).get("hf") == 1
    assert f7.default(big, NOMINAL_CUDA).get("hf", 0) == 0
    assert f4.default(small, NOMINAL_CUDA).get("hf", 0) == 0
    space = f7.space(small, NOMINAL_CUDA)
    assert {p.get("ks", 1) for p in space[:8] if p.get("hf")} == {1, 2, 3, 4}
    assert any(not p.get("hf") for p in space[:10])
    wide = ConvSpec.make(64, 256, 14, 14, 256, 3, 3, padding=1)  # 256 GEMM columns
    assert not any(p.get("hf") for p in f7.space(wide, NOMINAL_CUDA))
    cpu = DeviceInfo("opencl", "cpu", is_gpu=False)
    assert not any(p.get("hf") for p in f7.space(small, cpu))


def test_staged_output_default_rule() -> None:
    """so=1 by default unless each tile row is one vector store (m = 2 or 4 and Q % m == 0); the
    space offers the other choice second; a block whose staging exceeds 48 KB is refused."""
    for m, q, so in ((4, 56, 0), (4, 14, 1), (4, 7, 1), (2, 28, 0), (2, 7, 1)):
        v = get_variant(f"winograd_nonfused_f{m}")
        spec = ConvSpec.make(32, 64, q, q, 64, 3, 3, padding=1)
        space = v.space(spec, NOMINAL_CUDA)
        assert space[0].get("so", 0) == so and space[1].get("so", 0) == 1 - so, (m, q)
        assert space[0].get("xo", 0) == 0 and any(p.get("xo") for p in space[:10])
    for m, q in ((7, 56), (6, 28)):  # alpha >= 8: split transforms (staged inside), then so=1
        v = get_variant(f"winograd_nonfused_f{m}")
        space = v.space(ConvSpec.make(32, 64, q, q, 64, 3, 3, padding=1), NOMINAL_CUDA)
        assert space[0].get("xi") == space[0].get("xo") == 1 and "so" not in space[0], (m, q)
        assert space[1].get("xo") == 0 and space[1].get("so") == 1, (m, q)
    v, spec = get_variant("winograd_nonfused_f7"), RESNET[1]
    with pytest.raises(ValueError, match="so=1 .*shared memory"):
        v.plan(spec, v.default(spec, NOMINAL_CUDA).replace(tb=512, xo=0, so=1), NOMINAL_CUDA)


def test_nonfused_split_default_by_wave_model() -> None:
    """Small grids (ResNet 512@7² N32: 144 GEMM blocks for 264 slots) get a channel split by
    default; big ones (N128) and CPUs do not; a split needs the sgemm path."""
    v = get_variant("winograd_nonfused_f4")
    small, big = (ConvSpec.make(n, 512, 7, 7, 512, 3, 3, padding=1) for n in (32, 128))
    assert v.default(small, NOMINAL_CUDA)["ks"] == 3
    assert "ks" not in v.default(big, NOMINAL_CUDA)
    assert any(p.get("ks") == 2 for p in v.space(big, NOMINAL_CUDA)[:6])
    cpu = DeviceInfo("opencl", "cpu", is_gpu=False)
    assert "ks" not in v.default(small, cpu)
    with pytest.raises(ValueError, match="ks=2 needs gemm='sgemm'"):
        v.plan(small, v.own_default(small, NOMINAL_CUDA).replace(ks=2), NOMINAL_CUDA)


def test_nonfused_space_offers_both_gemms() -> None:
    dev = NOMINAL_CUDA
    v = get_variant("winograd_nonfused_f4")
    spec = RESNET[0]
    space = v.space(spec, dev)
    assert space[0].get("gemm") == "sgemm"  # GPU default: the shared generator (faster on the H200)
    assert v.own_default(spec, dev) in space
    kinds = {p.get("gemm", "own") for p in space}
    assert kinds == {"own", "sgemm"}
    assert v.sgemm_default(spec, dev) in space
    names = {k.name for k in v.plan(spec, v.sgemm_default(spec, dev), dev).kernels}
    assert "wino_batched_sgemm" in names and "wino_batched_gemm" not in names


def test_epilogue(backend) -> None:  # type: ignore[no-untyped-def]
    from convforge.check import check_plan
    from convforge.plan import Epilogue

    spec = ConvSpec.make(2, 6, 9, 9, 5, 3, 3, padding=1)
    for name in ("winograd_nonfused_f2", "winograd_fused_f2"):
        v = get_variant(name)
        plan = v.plan(spec, v.default(spec, backend.device), backend.device,
                      Epilogue(bias=True, relu=True))
        assert check_plan(plan, backend, seed=2).ok


def test_applies_reasons() -> None:
    dev = DeviceInfo(backend="opencl", name="cpu", is_gpu=False, shared_optin_bytes=1 << 20)
    fused = get_variant("winograd_fused_f2")
    assert "stride" in (fused.applies(ConvSpec.make(1, 3, 9, 9, 4, 3, 3, stride=2), dev) or "")
    assert "dilation" in (fused.applies(ConvSpec.make(1, 3, 9, 9, 4, 3, 3, dilation=2), dev) or "")
    assert "3x3" in (fused.applies(ConvSpec.make(1, 3, 9, 9, 4, 5, 5), dev) or "")
    nf4 = get_variant("winograd_nonfused_f4")
    assert "alpha" in (nf4.applies(ConvSpec.make(1, 3, 19, 19, 4, 7, 7), dev) or "")
    assert nf4.applies(ConvSpec.make(1, 3, 19, 19, 4, 5, 5), dev) is None
    nf7 = get_variant("winograd_nonfused_f7")
    assert "alpha 11 > 9" in (nf7.applies(ConvSpec.make(1, 3, 19, 19, 4, 5, 5), dev) or "")


def test_tolerance_grows_with_alpha() -> None:
    """One stated tolerance per tile size (alpha), from the accuracy table; F(7x7) the loosest."""
    from convforge.kernels.winograd.nonfused import tolerance

    tols = [tolerance(m, 3, 3) for m in (2, 4, 6, 7)]
    assert tols == sorted(tols) and tols[0] == 1e-5 and tols[-1] == 5e-4
    assert [get_variant(f"winograd_nonfused_f{m}").tolerance for m in (2, 4, 6, 7)] == tols


def test_workspace_reported() -> None:
    dev = DeviceInfo(backend="cuda", name="H200", cc=(9, 0), shared_optin_bytes=227 * 1024)
    spec = ConvSpec.make(32, 64, 56, 56, 64, 3, 3, padding=1)
    nf = get_variant("winograd_nonfused_f2")
    plan = nf.plan(spec, nf.default(spec, dev), dev)
    tiles = 32 * 28 * 28
    assert dict(plan.workspace) == {"wino_u": 4 * 16 * 64 * 64, "wino_v": 4 * 16 * 64 * tiles,
                                    "wino_m": 4 * 16 * 64 * tiles}
    fu = get_variant("winograd_fused_f4")
    prm = fu.default(spec, dev)
    plan = fu.plan(spec, prm, dev)  # raw 3x3 taps, blocked (fl=1): 9 floats per filter
    assert plan.workspace_bytes == 4 * 9 * 64 * 64 and len(plan.steps) == 2
    plan = fu.plan(spec, prm.replace(fl=0, groups=6), dev)  # transformed: alpha^2 = 36
    assert plan.workspace_bytes == 4 * 36 * 64 * 64


# -- CUDA compile --------------------------------------------------------------------------------

def _assert_ptxas_clean(*plans: Plan) -> list[list[PtxasInfo]]:
    """Every kernel of each plan compiles (sm_90) with no spill and at most 255 registers (one nvcc
    run for all: helpers.ptxas_reports); the plans' reports."""
    reports = ptxas_reports([plan.source("cuda") for plan in plans])
    for plan, infos in zip(plans, reports, strict=True):
        assert {i.kernel for i in infos} == {k.name for k in plan.kernels}
        for info in infos:
            assert info.spill_stores == 0 and info.spill_loads == 0, (plan.params.short(), info)
            assert info.registers <= 255
    return reports


RESNET = [ConvSpec.make(32, 64, 56, 56, 64, 3, 3, padding=1),
          ConvSpec.make(128, 512, 7, 7, 512, 3, 3, padding=1)]


@pytest.mark.usefixtures("nvcc_ok")  # skips without nvcc, fails on CI
def test_cuda_compiles_without_spills() -> None:
    """Every winograd variant's default on the first ResNet layer (one nvcc run for all)."""
    dev = NOMINAL_CUDA
    spec = RESNET[0]
    _assert_ptxas_clean(*[(v := get_variant(name)).plan(spec, v.default(spec, dev), dev) for name in VARIANTS])


@pytest.mark.usefixtures("nvcc_ok")  # skips without nvcc, fails on CI
def test_two_block_points_fit_their_register_cap() -> None:
    """Fused points (F(2x2) and F(4x4)) with mb=2 (__launch_bounds__(threads, 2)) compile with no spill
    and within two blocks' share of the 64K-register file: the claim they are offered on. The two ResNet
    layers offer the same points (their registers do not depend on the layer's sizes) and take them in
    turns: each point compiled once, each layer with half of them (one nvcc run for all)."""
    dev = NOMINAL_CUDA
    plans = []
    for m in (2, 4):
        v = get_variant(f"winograd_fused_f{m}")
        for spec in RESNET:
            points = [p for p in v.space(spec, dev) if p.get("mb")]
            assert points, f"no two-block point offered (F({m}x{m}), {spec.short()})"
            assert points == [p for p in v.space(RESNET[1 - RESNET.index(spec)], dev) if p.get("mb")]
            plans += [v.plan(spec, p, dev) for p in points[RESNET.index(spec)::2]]
    for plan, infos in zip(plans, _assert_ptxas_clean(*plans), strict=True):
        assert "__launch_bounds__(" in plan.source("cuda") and ", 2)" in plan.source("cuda")
        info = next(i for i in infos if i.kernel == "wino_fused")
        threads = next(k.threads for k in plan.kernels if k.name == "wino_fused")
        assert info.registers <= 65536 // (2 * threads), (plan.params.short(), info)


SGEMM_COMPILE = [RESNET[0], ConvSpec.make(5, 832, 7, 7, 384, 3, 3, padding=1)]


@pytest.mark.usefixtures("nvcc_ok")  # skips without nvcc, fails on CI
def test_nonfused_sgemm_compiles_without_spills() -> None:
    """For each tile size (F(2x2), F(4x4), F(6x6), F(7x7)): the sgemm path's default point on both
    layers; and the default with the other output store (so), with a 3-way channel split, the other
    filter form (hf), the other transforms (xi / xo), and for F(6x6) / F(7x7) the 96-column tile, the L2
    order and the transform blocks: every kernel of the plan compiles with 0 spills (one nvcc run for
    all). The two layers take those changed points in turns, swapped from one tile size to the next:
    each compiled once per tile size, on each layer for some tile sizes (the layer changes the default's
    tile and the size constants, the change the code path)."""
    dev = NOMINAL_CUDA
    plans = []
    for m in (2, 4, 6, 7):
        v = get_variant(f"winograd_nonfused_f{m}")
        for spec in SGEMM_COMPILE:
            first = v.default(spec, dev)
            changed = [first.replace(so=1 - first.get("so", 0)), first.replace(ks=3),
                       first.replace(hf=1 - first.get("hf", 0)),
                       first.replace(xi=1 - first.get("xi", 0), xo=1 - first.get("xo", 0), lo=0)]
            if m >= 6:  # the 96-column tile (8 x 12 accumulators), the L2 order and the transform blocks
                vb = 4 if Geometry(spec, m).tiles % 4 == 0 else 1
                n96 = Params(bm=64, bn=96, bk=8, tm=8, tn=12, va=4, vb=vb, pf=1, db=1, gemm="sgemm", tb=128)
                changed += [n96.replace(xi=1, xo=1, ks=2), first.replace(xi=1, xo=1, lo=1, xt=64),
                            first.replace(xi=1, xo=1, xt=16)]
            turn = (SGEMM_COMPILE.index(spec) + [2, 4, 6, 7].index(m)) % 2
            plans += [v.plan(spec, prm, dev) for prm in [v.sgemm_default(spec, dev), *changed[turn::2]]]
    _assert_ptxas_clean(*plans)


@pytest.mark.usefixtures("nvcc_ok")  # skips without nvcc, fails on CI
def test_fused_space_without_spills() -> None:
    """The GPU tuning points of the fused kernels (F(2x2), F(4x4)) compile with 0 spills (ptxas, sm_90;
    one nvcc run for both): every combination of the code-path switches fl, ca, ci at its first
    (largest) tile, and every value of each tile parameter (the space is tiles x switches;
    helpers.covering). The two-block (mb) and split-C (ks) points are each compiled by
    test_two_block_points_fit_their_register_cap and test_fused_split_c_without_spills (all of them, on
    ResNet layers), not here again."""
    dev = NOMINAL_CUDA
    spec = ConvSpec.make(32, 128, 28, 28, 128, 3, 3, padding=1)
    cases = []
    for name in ["winograd_fused_f2", "winograd_fused_f4"]:
        v = get_variant(name)
        space = v.space(spec, dev)
        assert space[0]["fl"] == 1 and len(space) >= 8
        assert any("mb" in p for p in space) and any("ks" in p for p in space)
        cases += [(name, v, p) for p in covering([p for p in space if "mb" not in p and "ks" not in p],
                                                 ("fl", "ca", "ci"))]
    for (name, _, prm), infos in zip(cases, ptxas_reports([v.plan(spec, p, dev).source("cuda") for _, v, p in cases]),
                                     strict=True):
        for info in infos:
            assert info.spill_stores == 0 and info.spill_loads == 0, (name, prm.short(), info)


# -- split-C (ks): channel slices over grid z, partial outputs reduced with the epilogue -----------

SPLIT_SPEC = ConvSpec.make(1, 37, 13, 7, 70, 3, 3, padding=(0, 1, 2, 1))  # C=37: edge stage


@pytest.mark.parametrize("m,cases", [
    (2, [(0, 2), (0, 3), (1, 3)]),  # bc=4: 10 stages as 5+5 and 3+3+4 (odd cb0); bc=3: 4+4+5
    (4, [(0, 2), (3, 3)]),  # bc=2: 19 stages as 9+10; bc=3: 13 as 4+4+5
])
def test_fused_split_c_on_odd_shapes(backend, m: int, cases) -> None:  # type: ignore[no-untyped-def]
    """ks slices, even and uneven, the last holding the predicated edge stage; bias + ReLU in
    the reduce kernel; output and workspace NaN-poisoned by check_plan."""
    from convforge.check import check_plan
    from convforge.plan import Epilogue

    v = get_variant(f"winograd_fused_f{m}")
    space = v.space(SPLIT_SPEC, backend.device)
    assert "ks" not in space[0] and any("ks" in p for p in space)
    for idx, ks in cases:
        prm = space[idx].replace(ks=ks)
        plan = v.plan(SPLIT_SPEC, prm, backend.device, Epilogue(bias=True, relu=True))
        assert [k.name for k in plan.kernels][-1] == "wino_fused_reduce" and len(plan.steps) == 3
        res = check_plan(plan, backend, seed=4)
        assert res.ok, f"{prm.short()}: {res}"


def test_fused_split_c_space_and_workspace() -> None:
    """Split points come after every unsplit point (defaults unchanged), only where the unsplit
    grid is under 3 blocks per SM; the workspace holds ks partial outputs."""
    dev = NOMINAL_CUDA
    small, big = (ConvSpec.make(n, 512, 7, 7, 512, 3, 3, padding=1) for n in (32, 128))
    for m in (2, 4):
        v = get_variant(f"winograd_fused_f{m}")
        space = v.space(small, dev)
        first = next(i for i, p in enumerate(space) if "ks" in p)
        assert all("ks" in p for p in space[first:]) and "ks" not in v.default(small, dev)
        assert {p["ks"] for p in space[first:]} == {2, 4, 8}
        assert not any("ks" in p for p in v.space(big, dev))
        prm = space[first]
        plan = v.plan(small, prm, dev)
        part = 4 * prm["ks"] * small.n * small.k * small.p * small.q
        assert dict(plan.workspace)["wino_part"] == part
        assert v.workspace_bytes(small, prm) == plan.workspace_bytes
        assert plan.steps[1].grid[2] == prm["ks"]
    with pytest.raises(ValueError):  # more slices than channel stages
        v.plan(small, v.default(small, dev).replace(ks=65), dev)


@pytest.mark.usefixtures("nvcc_ok")  # skips without nvcc, fails on CI
def test_fused_split_c_without_spills() -> None:
    """The split-C GPU points of a small-grid ResNet layer (even slices), F(2x2) and F(4x4), compile
    with 0 spills, the reduce kernel included (one nvcc run for both). The slice count (ks) changes only
    constants (the stages a slice, the reduce's number of terms), so each tile compiles with two of its
    ks values, one on the ResNet layer and one on a C = 200 layer where that offers it (uneven slices:
    the predicated edge stage), the values rotated over the tiles so that every ks is compiled."""
    dev = NOMINAL_CUDA
    even, uneven = (ConvSpec.make(32, 512, 7, 7, 512, 3, 3, padding=1),
                    ConvSpec.make(32, 200, 7, 7, 512, 3, 3, padding=(1, 0, 1, 1)))
    all_cases = []
    for name in ["winograd_fused_f2", "winograd_fused_f4"]:
        v = get_variant(name)
        points = [p for p in v.space(even, dev) if "ks" in p]
        offered = [p for p in v.space(uneven, dev) if "ks" in p]
        assert len(points) >= 6 and offered and all(p in points for p in offered)
        tiles: dict[object, list[Params]] = {}
        for p in points:
            tiles.setdefault(p.replace(ks=0), []).append(p)
        cases = []
        for t, same in enumerate(tiles.values()):
            a, b = same[t % len(same)], same[(t + 1) % len(same)]
            cases += [(even, a), (uneven if b in offered else even, b)]
        assert any(spec is uneven for spec, _ in cases), name
        assert {p["ks"] for _, p in cases} == {p["ks"] for p in points}, name
        all_cases += [(name, v, s, p) for s, p in cases]
    for (name, _, _, prm), infos in zip(all_cases, ptxas_reports([v.plan(s, p, dev).source("cuda")
                                                                   for _, v, s, p in all_cases]), strict=True):
        for info in infos:
            assert info.spill_stores == 0 and info.spill_loads == 0, (name, prm.short(), info)
            assert info.registers <= 255


@pytest.mark.parametrize("m", [2, 4])
def test_fused_points_for_opencl_gpus(backend, m) -> None:  # type: ignore[no-untyped-def]
    """NVIDIA's OpenCL gives 48 KB of local memory: the fused kernels still have a point that fits,
    and it computes the right thing (run here on PoCL with the GPU-sized tiles)."""
    from conftest import NOMINAL_OPENCL_GPU
    from convforge.check import check_plan

    spec = ConvSpec.make(1, 37, 13, 7, 70, 3, 3, 1, (0, 1, 1, 0))
    v = get_variant(f"winograd_fused_f{m}")
    assert v.applies(spec, NOMINAL_OPENCL_GPU) is None
    params = v.default(spec, NOMINAL_OPENCL_GPU)
    res = check_plan(v.plan(spec, params, backend.device), backend)
    assert res.ok, f"{params.short()}: {res}"


RESIDUAL_ODD = [
    ConvSpec.make(3, 5, 7, 11, 9, 3, 3, padding=(0, 1, 1, 0)),  # partial tiles right and bottom
    ConvSpec.make(1, 6, 7, 8, 5, 3, 3, padding=1),  # N=1, Q=8: the float2 / float4 row stores
]


@pytest.mark.parametrize("m", [2, 4, 7])
def test_nonfused_residual_on_every_store_path(backend, m: int) -> None:  # type: ignore[no-untyped-def]
    """conv + bias + residual + ReLU (a ResNet block's second conv) through each store path of
    the non-fused output transform: per thread (so=0, vector rows where Q allows), block-staged
    (so=1), split transforms (xi/xo) and a split GEMM summed first (ks=2), on odd shapes; the
    residual drawn afresh and the output NaN-poisoned by check_plan."""
    from convforge.plan import Epilogue

    v = get_variant(f"winograd_nonfused_f{m}")
    epi = Epilogue(bias=True, relu=True, residual=True)
    a, b = RESIDUAL_ODD
    cases = [(a, v.default(a, backend.device).replace(so=0)), (b, v.default(b, backend.device).replace(so=0)),
             (a, v.default(a, backend.device).replace(so=1)), (b, v.default(b, backend.device).replace(xi=1, xo=1)),
             (SGEMM_ODD[0], v.sgemm_default(SGEMM_ODD[0], backend.device).replace(ks=2, so=1))]
    for spec, prm in cases:
        plan = v.plan(spec, prm, backend.device, epi)
        assert plan.epilogue.residual and "res" in plan.steps[-1].args
        res = check_plan(plan, backend, seed=11)
        assert res.ok, f"{prm.short()} {spec.short()}: {res}"


@pytest.mark.parametrize("m", [2, 4])
def test_fused_residual_with_and_without_split(backend, m: int) -> None:  # type: ignore[no-untyped-def]
    """The fused kernel's own stores (residual + ReLU) and, with ks slices, the reduce kernel's."""
    from convforge.plan import Epilogue

    v = get_variant(f"winograd_fused_f{m}")
    epi = Epilogue(bias=True, relu=True, residual=True)
    for spec in RESIDUAL_ODD:
        res = check_plan(v.plan(spec, v.default(spec, backend.device), backend.device, epi), backend, seed=12)
        assert res.ok, f"{spec.short()}: {res}"
    prm = v.space(SPLIT_SPEC, backend.device)[0].replace(ks=2)
    plan = v.plan(SPLIT_SPEC, prm, backend.device, epi)
    assert [k.name for k in plan.kernels][-1] == "wino_fused_reduce" and "res" in plan.steps[-1].args
    res = check_plan(plan, backend, seed=13)
    assert res.ok, f"{prm.short()}: {res}"
