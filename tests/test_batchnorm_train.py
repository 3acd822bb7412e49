"""Training batch norm [+ residual] [-> ReLU] kernels (kernels/batchnorm.py) on PoCL against float64,
outputs poisoned with NaN first; the CUDA source compiled by nvcc (registers, no spills)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.render import render
from convforge.kernels.batchnorm import ST, BnTrain, bn_program, host_run, slices
from convforge.plan import DeviceInfo
from convforge.reference import batchnorm_train_backward_ref, batchnorm_train_ref, rel_l2

TOL = 1e-5  # relative L2 against float64, every output
CASES = [
    BnTrain(2, 3, 35),  # odd H*W (5x7): scalar loads
    BnTrain(1, 5, 16, residual=True),  # N=1, float4 loads, add + ReLU
    BnTrain(3, 2, 4, relu=False, residual=True),  # add, no ReLU
    BnTrain(2, 7, 13, relu=False),  # the downsample branch: batch norm alone
    BnTrain(2, 4, 9, affine=False, track=False),  # no gamma / beta, no running statistics
    BnTrain(1, 3, 11 * 11, momentum=0.3, eps=1e-3),
]


def _ids(bn: BnTrain) -> str:
    return f"{bn.n}x{bn.c}x{bn.hw}{bn.tag()}{'' if bn.affine else '_noaffine'}{'' if bn.track else '_notrack'}"


def _inputs(bn: BnTrain, rng: np.random.Generator, offset: float = 0.5) -> dict[str, np.ndarray]:
    shape = (bn.n, bn.c, bn.hw, 1)
    arrays = {"y": (offset + rng.standard_normal(shape)).astype(np.float32)}
    if bn.residual:
        arrays["res"] = rng.standard_normal(shape).astype(np.float32)
    if bn.affine:
        arrays["gamma"] = (1 + 0.3 * rng.standard_normal(bn.c)).astype(np.float32)
        arrays["beta"] = (0.2 * rng.standard_normal(bn.c)).astype(np.float32)
    if bn.track:
        arrays["rmean"] = rng.standard_normal(bn.c).astype(np.float32)
        arrays["rvar"] = (1 + rng.random(bn.c)).astype(np.float32)
        arrays["nbt"] = np.array([41], np.int64)
    return arrays


def _check(ocl, bn: BnTrain, seed: int, offset: float = 0.5, device: DeviceInfo | None = None,  # type: ignore[no-untyped-def]
           sp: int | None = None) -> None:
    rng = np.random.default_rng(seed)
    arrays = _inputs(bn, rng, offset)
    prog = bn_program(bn, device or ocl.device, sp)
    assert len(prog.forward) == (1 if (sp or slices(bn, device or ocl.device)) == 1 else 3)
    out = host_run(ocl, bn, "forward", dict(arrays), prog)
    ref = batchnorm_train_ref(arrays["y"], arrays.get("gamma"), arrays.get("beta"), bn.eps, arrays.get("res"),
                              bn.relu, bn.act)
    assert rel_l2(out["z"], ref["z"]) < TOL, rel_l2(out["z"], ref["z"])
    st = out["st"][:len(ST) * bn.c].reshape(len(ST), bn.c).astype(np.float64)
    assert rel_l2(st[0] + st[1], ref["mean"]) < TOL
    assert rel_l2(st[2], 1 / np.sqrt(ref["var"] + bn.eps)) < TOL
    if bn.track:
        want_m = (1 - bn.momentum) * arrays["rmean"] + bn.momentum * ref["mean"]
        want_v = (1 - bn.momentum) * arrays["rvar"] + bn.momentum * ref["var_unbiased"]
        assert rel_l2(out["rmean"], want_m) < TOL and rel_l2(out["rvar"], want_v) < TOL
        assert out["nbt"].tolist() == [42]
    # backward, the ReLU's mask taken from the kernels' own z (a float64 z could round the other way)
    gz = rng.standard_normal(out["z"].shape).astype(np.float32)
    back = {"gz": gz, "y": arrays["y"], "z": out["z"], "st": out["st"]}
    got = host_run(ocl, bn, "backward", back, prog)
    want = batchnorm_train_backward_ref(gz, arrays["y"], arrays.get("gamma"), bn.eps, out["z"], bn.relu,
                                        arrays.get("beta"), bn.act)
    assert rel_l2(got["dy"], want["dy"]) < TOL, rel_l2(got["dy"], want["dy"])
    if bn.affine:
        dg = got["dg"].reshape(2, bn.c)
        assert rel_l2(dg[0], want["dgamma"]) < TOL and rel_l2(dg[1], want["dbeta"]) < TOL, (dg, want)
    if bn.relu and bn.residual:
        assert rel_l2(got["gm"], want["dres"]) < TOL
    if len(prog.backward) == 2:  # split: the reduction's last block finalized, its tickets are 0 again
        tickets = got["st"][len(ST) * bn.c:]  # (after them: padding, still the NaN it was poisoned with),
        assert not tickets[~np.isnan(tickets)].view(np.uint32).any()  # so a second backward (a retained
        again = host_run(ocl, bn, "backward", {**back, "st": got["st"]}, prog)  # graph) gives the same bits
        assert np.array_equal(again["dy"], got["dy"], equal_nan=True)


@pytest.mark.parametrize("sp", [1, 2], ids=["one-kernel", "split"])
@pytest.mark.parametrize("bn", CASES, ids=_ids)
def test_against_float64(ocl, bn: BnTrain, sp: int) -> None:  # type: ignore[no-untyped-def]
    """Both forms: one block per channel (one kernel a pass) and each channel over two blocks."""
    _check(ocl, bn, seed=sum(map(ord, _ids(bn))), sp=sp)


@pytest.mark.parametrize("bn, sp", [(BnTrain(2, 3, 35), 40), (BnTrain(1, 5, 64, residual=True), 33)],
                         ids=["C3-40-slices", "C5-res-33-slices"])
def test_many_slices_finalize_in_groups(ocl, bn: BnTrain, sp: int) -> None:  # type: ignore[no-untyped-def]
    """Past 32 slices the backward's last blocks sum in two levels (groups of about sqrt(slices), the last
    group shorter): each group's last block, then the tile's."""
    _check(ocl, bn, seed=3, sp=sp)


def test_a_mean_far_from_zero_keeps_the_variance(ocl) -> None:  # type: ignore[no-untyped-def]
    """Mean 1000, spread 1: E[y^2] - E[y]^2 in float32 would lose the variance; the shifted sums do not."""
    _check(ocl, BnTrain(2, 3, 64), seed=7, offset=1000.0)


def test_channels_split_over_slices(ocl) -> None:  # type: ignore[no-untyped-def]
    """A GPU-sized device splits each channel over several blocks; the slices add in order."""
    gpu_like = dataclasses.replace(ocl.device, is_gpu=True, units=64, max_threads=max(ocl.device.max_threads, 256))
    bn = BnTrain(2, 3, 8192, residual=True)
    assert slices(bn, gpu_like) == 2
    _check(ocl, bn, seed=3, device=gpu_like)


def test_bad_shapes_name_the_problem(ocl) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        BnTrain(1, 4, 1)
    with pytest.raises(ValueError, match="momentum"):
        BnTrain(2, 4, 4, momentum=1.5)
    with pytest.raises(ValueError, match=r"slices per channel \(0\)"):
        bn_program(BnTrain(2, 4, 4), ocl.device, sp=0)


def test_cuda_source_compiles_without_spills(nvcc_ok) -> None:  # type: ignore[no-untyped-def]
    from helpers import ptxas_reports

    # one kernel a pass, and the split form the device would pick (3 a pass); one nvcc run for all
    progs = [bn_program(bn, NOMINAL_CUDA, sp) for bn in (BnTrain(32, 256, 56 * 56, residual=True),
                                                         BnTrain(32, 2048, 49), BnTrain(512, 256, 128 * 128))
             for sp in (1, None)]
    for prog, infos in zip(progs, ptxas_reports([render(list(p.kernels), "cuda", "bn") for p in progs]), strict=True):
        assert len(infos) == len(prog.kernels) and all(i.spill_stores == 0 and i.spill_loads == 0
                                                       for i in infos), infos


def test_the_switch_is_read_from_the_environment() -> None:
    """CONVFORGE_TRAIN_BN: on unless 0; a bad value is a clear problem, not a crash."""
    from convforge.config import Config

    assert Config({}).train_bn is True and Config({"CONVFORGE_TRAIN_BN": "0"}).train_bn is False
    assert any("CONVFORGE_TRAIN_BN" in p for p in Config({"CONVFORGE_TRAIN_BN": "maybe"}).problems())


def test_native_slots_name_every_buffer_in_the_order_of_native_cpp() -> None:
    """BN_SLOTS numbers every buffer a forward or backward kernel takes, in the order of native.cpp's enum
    BnSlot (whose BlockNode fills the slots by those numbers): a buffer missing or a reordering fails."""
    import re
    from pathlib import Path

    import convforge
    from convforge.kernels.batchnorm import BN_SLOTS

    folder = Path(convforge.__file__).parent / "torch"  # native.cpp and the files it includes; no torch import
    source = "\n".join(p.read_text() for p in [folder / "native.cpp", *sorted(folder.glob("native_*.inc"))])
    enum = re.search(r"enum BnSlot \{([^}]*)\}", source)
    assert enum is not None
    names = [v.strip() for v in enum.group(1).split(",")]
    assert names[-1] == "kBnSlots" and len(names) - 1 == len(BN_SLOTS)
    for name, i in BN_SLOTS.items():
        assert names[i].lower() == "k" + name.lower(), (name, names[i])
    for bn in CASES:
        prog = bn_program(bn, NOMINAL_CUDA)
        kernels = {k.name: k for k in prog.kernels}
        for step in prog.forward + prog.backward:
            assert {str(a) for a in step.args} <= set(BN_SLOTS), step
            assert {a.name for a in kernels[step.kernel].args} <= set(BN_SLOTS)


def test_assigning_a_switch_keeps_the_native_table() -> None:
    """config.native_block is read on every call and keys nothing, config.bn_stats keys a block's filing (not
    a conv's): assigning either calls no listener (the native table keeps its programs, so an A/B in one
    process compares warm paths); precision does."""
    from convforge.config import Config

    cfg = Config({})
    calls: list[int] = []
    cfg.on_change(lambda: calls.append(1))
    cfg.native_block = False
    cfg.bn_stats = True
    assert calls == []
    cfg.precision = "relaxed"
    assert calls == [1]
