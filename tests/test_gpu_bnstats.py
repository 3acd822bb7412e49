"""GPU tier of the batch-norm statistics in the wgmma NHWC epilogue (``TcImplicitGemm.plan_stats``): on odd
layers and tile points, y against float64 as every forward, and ``bnpart`` against the sums of the y the
kernel stored (each partial about its first row, the row count exact); then ``bn_program(partials=P)`` on
the GPU turns them into the batch mean and variance of y. Skips without a CUDA device of compute capability
9.0. The index model and the compile checks are in tests/test_tensorcore_bnstats.py."""

from __future__ import annotations

import numpy as np
import pytest

from convforge.check import expected, from_layout, in_layout, pass_inputs, stored_shape
from convforge.dtypes import to_storage
from convforge.kernels import get_variant
from convforge.kernels.batchnorm import PARTIAL_ROWS, ST, BnTrain, bn_program, host_run
from convforge.kernels.tensorcore.sm90.tiles import TileConfig
from convforge.reference import rel_l2
from convforge.spec import ConvSpec
from test_tensorcore_bnstats import POINTS, SPECS, _config, _model_partials

BIG = [ConvSpec.make(32, 64, 56, 56, 64, 1, 1, dtype="float16", layout="nhwc"),
       ConvSpec.make(16, 256, 14, 14, 256, 3, 3, 1, 1, dtype="bfloat16", layout="nhwc")]


@pytest.fixture(scope="module")
def hopper(cuda):  # type: ignore[no-untyped-def]
    if cuda.device.cc != (9, 0):
        pytest.skip(f"the wgmma generator needs compute capability 9.0 ({cuda.device.name})")
    return cuda


def _run(be, spec: ConvSpec, params):  # type: ignore[no-untyped-def]
    """(y as (M, K) rows, bnpart (4, P, K), inputs) of one run, outputs poisoned with NaN first."""
    v = get_variant("tc_implicit_gemm_half")
    plan, p = v.plan_stats(spec, params, be.device)
    inputs = pass_inputs(spec, np.random.default_rng(3))
    exe = be.executable(plan)
    for buf, (_, nbytes) in zip(exe.workspace().values(), plan.workspace):
        be.fill(buf, float("nan"), nbytes)
    bufs = {name: be.upload(to_storage(in_layout(spec, name, a), spec.dtype)) for name, a in inputs.items()}
    bufs["y"] = be.upload(to_storage(np.full(spec.shape_of("y"), np.nan, np.float32), spec.dtype))
    bufs["bnpart"] = be.upload(np.full(len(PARTIAL_ROWS) * p * spec.k, np.nan, np.float32))
    exe(bufs)
    be.synchronize()
    y = from_layout(spec, "y", be.download(bufs["y"], stored_shape(spec, "y"), spec.dtype))
    part = be.download(bufs["bnpart"], (len(PARTIAL_ROWS), p, spec.k), "float32")
    return y, part, inputs, plan


CASES = [(s, pt) for s in SPECS for pt in POINTS] + [(s, None) for s in BIG]


@pytest.mark.parametrize("spec, point", CASES, ids=str)
def test_partials_are_the_stored_outputs_sums(hopper, spec: ConvSpec, point) -> None:  # type: ignore[no-untyped-def]
    v = get_variant("tc_implicit_gemm_half")
    params = v.default(spec, hopper.device) if point is None else _config(v, spec, hopper.device, point)
    try:
        y, part, inputs, plan = _run(hopper, spec, params)
    except ValueError as err:  # a point this layer's tile cannot take (shared memory): said, not hidden
        pytest.skip(f"{params}: {err}")
    assert rel_l2(y, expected(spec, inputs)) < plan.tolerance
    rows = y.transpose(0, 2, 3, 1).reshape(-1, spec.k)  # NHWC: row m = pixel
    want = _model_partials(rows, TileConfig.of(plan.params).wm)
    assert not np.isnan(part).any()
    np.testing.assert_array_equal(part[2], want[2])  # the shifts: each partial's first stored row
    np.testing.assert_array_equal(part[3], want[3])  # the counts
    scale = np.sqrt(np.maximum(want[1], 1e-30) * want[3])
    assert np.abs(part[0] - want[0]).max() <= 1e-5 * scale.max() + 1e-6
    np.testing.assert_allclose(part[1], want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS + BIG, ids=str)
def test_tma_stores_keep_the_same_y_and_partials(hopper, spec: ConvSpec) -> None:  # type: ignore[no-untyped-def]
    """es=1 (the half-staged chunks stored by TMA, the statistics read from the staging meanwhile): y and
    every partial bit for bit those of the 16-byte stores (eh=1) on the same inputs."""
    v = get_variant("tc_implicit_gemm_half")
    base = v.default(spec, hopper.device).replace(ks=1)
    try:
        y0, p0, _, _ = _run(hopper, spec, base)
        y1, p1, _, _ = _run(hopper, spec, base.replace(es=1))
    except ValueError as err:  # an output the TMA stores cannot address: said, not hidden
        pytest.skip(f"{base}: {err}")
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(p1, p0)


def test_the_batch_norm_finalizes_the_epilogues_partials(hopper) -> None:  # type: ignore[no-untyped-def]
    """conv (statistics in its epilogue) -> bn_program(partials=P) on the GPU: mean and variance of y."""
    spec = BIG[0]
    v = get_variant("tc_implicit_gemm_half")
    y, part, _, _ = _run(hopper, spec, v.default(spec, hopper.device))
    rows = y.transpose(0, 2, 3, 1).reshape(-1, spec.k).astype(np.float64)
    bn = BnTrain(spec.n, spec.k, spec.p * spec.q, relu=False, dtype=spec.dtype, layout="nhwc")
    prog = bn_program(bn, hopper.device, partials=part.shape[1])
    c = spec.k
    ones, zeros = np.ones(c, np.float32), np.zeros(c, np.float32)
    got = host_run(hopper, bn, "forward", {"y": rows.astype(np.float32).reshape(-1), "gamma": ones, "beta": zeros,
                                           "rmean": zeros.copy(), "rvar": ones.copy(), "nbt": np.zeros(1, np.int64),
                                           "part": part.reshape(-1)}, prog)
    st = got["st"][:len(ST) * c].reshape(len(ST), c).astype(np.float64)
    np.testing.assert_allclose(st[ST.index("k0")] + st[ST.index("dm")], rows.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(1.0 / st[ST.index("inv")] ** 2 - bn.eps, rows.var(0), rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_fused_block_trains_with_the_statistics_in_its_conv(hopper, monkeypatch, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """``config.bn_stats``: fused conv -> batch norm -> ReLU blocks under autocast, channels_last, run their
    native nodes with the statistics conv (a handle filed with P partials) and match PyTorch's modules:
    output, the input's and weights' gradients, the running statistics (the half dtype's tolerance). Two
    blocks whose batch norms match (64 channels of 19x23 each) behind different convs (1x1, 3x3): each runs
    its own conv (one handle per conv, not per batch-norm shape)."""
    import copy

    import torch

    import convforge.torch as ct
    from convforge.config import config
    from convforge.frontends import fast_path
    from convforge.torch import batchnorm as bn_train

    monkeypatch.setattr(config, "bn_stats", True)
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    model = torch.nn.Sequential(torch.nn.Conv2d(32, 64, 1, bias=False), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
                                torch.nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64),
                                torch.nn.ReLU()).cuda().to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    fused, _ = ct.fuse(copy.deepcopy(model).train(), algo="tc_implicit_gemm_half")  # a variant with plan_stats
    fused.train()
    ref.train()
    x = (torch.randn(6, 32, 19, 23, device="cuda") + 0.5).contiguous(memory_format=torch.channels_last)
    before = set(bn_train._HANDLES)
    native = fast_path.load_torch()
    runs = native.stats()["block_runs"]
    outs = []
    for mod in (ref, fused):
        for _ in range(3):  # the first call files the block, the next ones run it
            xi = x.clone().requires_grad_(True)
            mod.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dt):
                y = mod(xi)
            y.float().square().sum().backward()
        bns = [m for m in mod.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        convs = [m for m in mod.modules() if isinstance(m, torch.nn.Conv2d)]
        outs.append((y.float(), xi.grad.float(), *(c.weight.grad.float() for c in convs),
                     *(t for bn in bns for t in (bn.weight.grad, bn.running_mean, bn.running_var))))
    assert len(set(bn_train._HANDLES) - before) == 2, "not one statistics handle per block"
    assert native.stats()["block_runs"] - runs == 4, "the blocks' calls 2 and 3 did not run the native node"
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    names = ("y", "dx", "dw1", "dw2", "dgamma1", "rmean1", "rvar1", "dgamma2", "rmean2", "rvar2")
    for name, got, want in zip(names, outs[1], outs[0], strict=True):
        err = ((got - want).norm() / want.norm()).item()
        assert err < tol, (name, err)
