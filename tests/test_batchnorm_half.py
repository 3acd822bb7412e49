"""Training batch norm kernels (kernels/batchnorm.py) in float16 / bfloat16 and channels-last on PoCL.

Every (activation dtype x ReLU x residual x affine x running statistics) combination, the two layouts
taking them in turns (each layout every combination in some dtype), against a float64 reference of the
same stored inputs (the half values, widened), every output poisoned with NaN first; odd shapes (C prime,
H*W odd, N = 1, H*W = 1, a ragged channel tile); one kernel a pass and the rows split over two blocks; Inf
and NaN reaching what PyTorch's kernels let them reach; the CUDA source compiled by nvcc without spills.

Tolerances (relative L2 against float64 of the same inputs): what is stored in a half dtype is judged at
``dtypes.HALF_TOLERANCE`` (float16 1e-3, bfloat16 8e-3: about 3.5x the u / sqrt(3) that rounding the
output alone costs; the sums and the finalize are float32, far below), what is stored in float32 (the
statistics, float32 parameters' gradients and running statistics) at 1e-5, as the float32 kernels.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from conftest import NOMINAL_CUDA, NOMINAL_OPENCL_GPU
from convforge.codegen.render import render
from convforge.dtypes import HALF_TOLERANCE, rounded
from convforge.kernels.batchnorm import DTYPES, LAYOUTS, PARTIAL_ROWS, ST, BnTrain, bn_program, host_run, slices
from convforge.plan import DeviceInfo
from convforge.reference import batchnorm_train_backward_ref, batchnorm_train_ref, rel_l2


def tol(dtype: str) -> float:
    return HALF_TOLERANCE.get(dtype, 1e-5)


# (N, C, H*W): C prime and H*W odd (scalar loads in both layouts), N = 1 with 4-vectors in both, H*W = 1,
# C a multiple of 4 with H*W odd (NCHW scalar, NHWC 4-vectors)
SHAPES = [(2, 5, 9), (1, 8, 12), (6, 7, 1), (3, 12, 5)]


def _combos() -> list[tuple[BnTrain, int]]:
    """Every dtype x relu x residual x affine x track, the two layouts taking the 16 flag combinations in
    turns (each dtype runs 8 in each layout; each layout runs every combination, in some dtype: the
    layout changes the indexing and vector widths, the flags the arithmetic), each case with a shape of
    SHAPES in turn (every shape in every dtype and layout, and with every relu x residual); the rows
    split over 2 blocks for the affine, tracking ones (every dtype and layout sees both forms, the split
    one on every shape), one block per channel (tile) otherwise; the parameters in the half dtype every
    other half case (in both layouts, with and without the split)."""
    out = []
    for i, (dtype, relu, residual, affine, track) in enumerate(
            itertools.product(DTYPES, (True, False), (True, False), (True, False), (True, False))):
        j = i % 16  # the flags' combination
        layout = LAYOUTS[(DTYPES.index(dtype) + j + j // 4) % 2]
        n, c, hw = SHAPES[(2 * i + i // 4 + i // 2) % len(SHAPES)]
        pdtype = dtype if dtype != "float32" and (i + i // 8) % 2 else "float32"
        bn = BnTrain(n, c, hw, relu, residual, affine, track, momentum=0.2 if i % 3 else 0.1,
                     dtype=dtype, pdtype=pdtype, layout=layout)
        out.append((bn, 2 if affine and track else 1))
    return out


def _ids(case: tuple[BnTrain, int]) -> str:
    bn, sp = case
    return (f"{bn.n}x{bn.c}x{bn.hw}{bn.tag()}{'' if bn.affine else '_noaffine'}{'' if bn.track else '_notrack'}"
            f"{'_split' if sp > 1 else ''}")


def _lay(bn: BnTrain, a: np.ndarray) -> np.ndarray:
    """An (N, C, H*W) array in the kernels' layout."""
    return np.ascontiguousarray(a.transpose(0, 2, 1)) if bn.nhwc else a


def _unlay(bn: BnTrain, a: np.ndarray) -> np.ndarray:
    """A kernel's activation-sized output as (N, C, H*W, 1) for the reference."""
    return (a.transpose(0, 2, 1) if bn.nhwc else a)[..., None]


def _inputs(bn: BnTrain, rng: np.random.Generator, offset: float = 0.5) -> dict[str, np.ndarray]:
    """Inputs as float32 arrays holding values of their buffers' dtypes (NCHW (N, C, H*W))."""
    shape = (bn.n, bn.c, bn.hw)
    arrays = {"y": rounded(offset + 1.5 * rng.standard_normal(shape), bn.dtype)}
    if bn.residual:
        arrays["res"] = rounded(rng.standard_normal(shape), bn.dtype)
    p = bn.pdtype
    if bn.affine:
        arrays["gamma"] = rounded(1 + 0.3 * rng.standard_normal(bn.c), p)
        arrays["beta"] = rounded(0.2 * rng.standard_normal(bn.c), p)
    if bn.track:
        arrays["rmean"] = rounded(rng.standard_normal(bn.c), p)
        arrays["rvar"] = rounded(1 + rng.random(bn.c), p)
        arrays["nbt"] = np.array([41], np.int64)
    return arrays


def _forward(ocl, bn: BnTrain, arrays: dict[str, np.ndarray], prog) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    given = {k: _lay(bn, v) if k in ("y", "res") else v for k, v in arrays.items()}
    return host_run(ocl, bn, "forward", given, prog)


def _partial_sums(y: np.ndarray, bounds: list[int]) -> np.ndarray:
    """What a conv's epilogue would hand the statistics (kernels/batchnorm.py PARTIAL_ROWS), in float32:
    each channel's N*H*W values cut at ``bounds``, each piece's sums about its own first value."""
    n, c, hw = y.shape
    flat = y.transpose(1, 0, 2).reshape(c, n * hw)
    rows = np.zeros((len(PARTIAL_ROWS), len(bounds) - 1, c), np.float32)
    for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        d = flat[:, lo:hi] - flat[:, lo:lo + 1]
        rows[0, j], rows[1, j], rows[2, j], rows[3, j] = d.sum(axis=1), (d * d).sum(axis=1), flat[:, lo], hi - lo
    return rows.reshape(-1)


def _check(ocl, bn: BnTrain, sp: int | None, seed: int, offset: float = 0.5,  # type: ignore[no-untyped-def]
           device: DeviceInfo | None = None, bounds: list[int] | None = None, gamma_scale: float = 1.0) -> None:
    rng = np.random.default_rng(seed)
    arrays = _inputs(bn, rng, offset)
    if "gamma" in arrays and gamma_scale != 1.0:
        arrays["gamma"] = rounded(arrays["gamma"] * gamma_scale, bn.pdtype)
    partials = None if bounds is None else len(bounds) - 1
    prog = bn_program(bn, device or ocl.device, sp, partials)
    if bounds is not None:
        arrays["part"] = _partial_sums(arrays["y"], bounds)
    out = _forward(ocl, bn, arrays, prog)
    y4 = arrays["y"][..., None]
    ref = batchnorm_train_ref(y4, arrays.get("gamma"), arrays.get("beta"), bn.eps,
                              arrays["res"][..., None] if bn.residual else None, bn.relu, bn.act)
    z = _unlay(bn, out["z"])
    assert rel_l2(z, ref["z"]) < tol(bn.dtype), ("z", rel_l2(z, ref["z"]))
    st = out["st"][:len(ST) * bn.c].reshape(len(ST), bn.c).astype(np.float64)
    assert rel_l2(st[0] + st[1], ref["mean"]) < 1e-5 and rel_l2(st[2], 1 / np.sqrt(ref["var"] + bn.eps)) < 1e-5
    if bn.track:
        want_m = (1 - bn.momentum) * arrays["rmean"] + bn.momentum * ref["mean"]
        want_v = (1 - bn.momentum) * arrays["rvar"] + bn.momentum * ref["var_unbiased"]
        errs = rel_l2(out["rmean"], want_m), rel_l2(out["rvar"], want_v)
        assert max(errs) < tol(bn.pdtype), ("running statistics", errs)
        assert out["nbt"].tolist() == [42]
    # backward, the ReLU's mask taken from the kernels' own z (a float64 z could round the other way)
    gz = rounded(rng.standard_normal((bn.n, bn.c, bn.hw)), bn.dtype)
    got = host_run(ocl, bn, "backward", {"gz": _lay(bn, gz), "y": _lay(bn, arrays["y"]), "z": out["z"],
                                         "st": out["st"]}, prog)
    want = batchnorm_train_backward_ref(gz[..., None], y4, arrays.get("gamma"), bn.eps, z, bn.relu,
                                        arrays.get("beta"), bn.act)
    dy = _unlay(bn, got["dy"])
    assert rel_l2(dy, want["dy"]) < tol(bn.dtype), ("dy", rel_l2(dy, want["dy"]))
    if bn.affine:
        dg = got["dg"].reshape(2, bn.c)
        errs = rel_l2(dg[0], want["dgamma"]), rel_l2(dg[1], want["dbeta"])
        assert max(errs) < tol(bn.pdtype), ("dgamma, dbeta", errs)
    if bn.relu and bn.residual:
        assert rel_l2(_unlay(bn, got["gm"]), want["dres"]) == 0.0  # the masked dz, exact
    if len(prog.backward) == 2:  # split: the tiles' tickets back at 0 (NaN after them: the padding)
        tickets = got["st"][len(ST) * bn.c:]
        assert tickets.size and not tickets[~np.isnan(tickets)].view(np.uint32).any()


def test_the_combinations_cover_every_dtype_layout_and_flag() -> None:
    """What _combos promises: every dtype with every flag combination, every layout with every flag
    combination and every shape, the split form in every dtype and layout."""
    cases = _combos()
    flags = [(bn.relu, bn.residual, bn.affine, bn.track) for bn, _ in cases]
    assert len({(bn.dtype, f) for (bn, _), f in zip(cases, flags)}) == len(DTYPES) * 16 == len(cases)
    assert len({(bn.layout, f) for (bn, _), f in zip(cases, flags)}) == len(LAYOUTS) * 16
    assert len({(bn.dtype, bn.layout, (bn.n, bn.c, bn.hw)) for bn, _ in cases}) == len(DTYPES) * len(LAYOUTS) * 4
    assert len({(bn.dtype, bn.layout) for bn, sp in cases if sp > 1}) == len(DTYPES) * len(LAYOUTS)


@pytest.mark.parametrize("case", _combos(), ids=_ids)
def test_every_combination_against_float64(ocl, case) -> None:  # type: ignore[no-untyped-def]
    bn, sp = case
    _check(ocl, bn, sp, seed=sum(map(ord, _ids(case))))


@pytest.mark.parametrize("sp", [1, 2], ids=["one-kernel", "split"])
@pytest.mark.parametrize("bn", [BnTrain(2, 37, 3, residual=True, dtype="bfloat16", layout="nhwc"),
                                BnTrain(1, 132, 3, relu=True, dtype="float16", pdtype="float16", layout="nhwc")],
                         ids=["C37-bf16", "C132-f16"])
def test_a_ragged_channel_tile(ocl, bn: BnTrain, sp: int) -> None:  # type: ignore[no-untyped-def]
    """C / v channel vectors not a multiple of the tile's 32 threads: the last tile's extra threads read
    nothing, write nothing and still meet the barriers."""
    _check(ocl, bn, sp, seed=5)


@pytest.mark.parametrize("bn, sp", [(BnTrain(2, 37, 30, residual=True, dtype="bfloat16", layout="nhwc"), 45),
                                    (BnTrain(3, 12, 20, dtype="float16", layout="nhwc"), 60)],
                         ids=["C37-bf16-45-slabs", "C12-f16-60-slabs"])
def test_many_slabs_finalize_in_groups(ocl, bn: BnTrain, sp: int) -> None:  # type: ignore[no-untyped-def]
    """The backward's two-level finalize over channels_last tiles, ragged (C = 37) and 4-vectors."""
    _check(ocl, bn, sp, seed=9)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_mean_far_from_zero_keeps_the_variance(ocl, layout: str) -> None:  # type: ignore[no-untyped-def]
    """float16 values about 300 (an ulp of 0.25) with a spread of 1.5: the shifted sums keep the variance."""
    _check(ocl, BnTrain(2, 4, 36, dtype="float16", layout=layout), 1, seed=7, offset=300.0)


def test_rows_split_over_slabs_on_a_gpu_sized_device(ocl) -> None:  # type: ignore[no-untyped-def]
    """A GPU-sized device splits the N*H*W rows of a channel tile over several blocks (256 threads each);
    the slabs add in order."""
    gpu_like = dataclasses.replace(ocl.device, is_gpu=True, units=64, max_threads=max(ocl.device.max_threads, 256))
    bn = BnTrain(2, 8, 1024, residual=True, dtype="bfloat16", layout="nhwc")
    assert slices(bn, gpu_like) == 2
    _check(ocl, bn, None, seed=3, device=gpu_like)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_inf_in_dz_makes_its_channels_gradients_non_finite(ocl, layout: str) -> None:  # type: ignore[no-untyped-def]
    """A GradScaler finds an overflow by the gradients turning Inf / NaN: one Inf in dz must reach every
    dy of its channel and its dgamma and dbeta (as PyTorch's batch norm backward), and nothing else."""
    bn = BnTrain(2, 4, 6, relu=False, dtype="float16", layout=layout)
    rng = np.random.default_rng(11)
    arrays = _inputs(bn, rng)
    prog = bn_program(bn, ocl.device, 1)
    out = _forward(ocl, bn, arrays, prog)
    gz = rounded(rng.standard_normal((bn.n, bn.c, bn.hw)), bn.dtype)
    gz[1, 2, 3] = np.inf
    got = host_run(ocl, bn, "backward", {"gz": _lay(bn, gz), "y": _lay(bn, arrays["y"]), "z": out["z"],
                                         "st": out["st"]}, prog)
    dy, dg = _unlay(bn, got["dy"]), got["dg"].reshape(2, bn.c)
    assert not np.isfinite(dy[:, 2]).any() and not np.isfinite(dg[:, 2]).any()
    others = [0, 1, 3]
    assert np.isfinite(dy[:, others]).all() and np.isfinite(dg[:, others]).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_in_y_reaches_its_channels_output_and_running_statistics(ocl, layout: str) -> None:  # type: ignore[no-untyped-def]
    """A NaN activation makes its channel's batch statistics NaN: z (through the ReLU, which keeps NaN)
    and the running mean and variance (the variance's clamp at 0 keeps NaN), as PyTorch's."""
    bn = BnTrain(2, 5, 6, residual=True, dtype="bfloat16", layout=layout)
    arrays = _inputs(bn, np.random.default_rng(12))
    arrays["y"][1, 3, 4] = np.nan
    out = _forward(ocl, bn, arrays, bn_program(bn, ocl.device, 1))
    z = _unlay(bn, out["z"])
    assert np.isnan(z[:, 3]).all() and np.isnan(out["rmean"][3]) and np.isnan(out["rvar"][3])
    others = [0, 1, 2, 4]
    assert np.isfinite(z[:, others]).all() and np.isfinite(out["rvar"][others]).all()


@pytest.mark.parametrize("bn", [BnTrain(3, 5, 7, residual=True), BnTrain(3, 12, 7, dtype="float16", layout="nhwc")],
                         ids=["nchw-f32", "nhwc-f16"])
def test_statistics_from_another_kernels_partial_sums(ocl, bn: BnTrain) -> None:  # type: ignore[no-untyped-def]
    """The forward started from partial sums another kernel wrote (a conv's epilogue: bn_program's
    ``partials``): four pieces of uneven sizes, each about its own shift, around a mean of 200 (sums
    about 0 would cancel there); two kernels, y never read for the statistics; the backward as usual."""
    prog = bn_program(bn, ocl.device, 1, partials=4)
    assert len(prog.forward) == 2 and not any("y" in step.args for step in prog.forward[:1])
    _check(ocl, bn, 1, seed=9, offset=200.0, bounds=[0, 4, 9, 17, 21])


def test_thousands_of_partial_sums_on_a_gpu_shaped_finalize(ocl) -> None:  # type: ignore[no-untyped-def]
    """The finalize of a GPU program (kernels/batchnorm._partial_threads: 1024-thread blocks, 4 channels a
    block past 1024 partials) run on PoCL: 1,300 pieces of uneven sizes (ResNet-50 N128 hands 3,136)."""
    bn = BnTrain(2, 12, 1500, dtype="float16", layout="nhwc")
    prog = bn_program(bn, NOMINAL_OPENCL_GPU, 1, partials=1300)
    assert prog.forward[0].block == (1024, 1, 1)
    cuts = np.sort(np.random.default_rng(4).choice(np.arange(1, bn.m), 1299, replace=False))
    _check(ocl, bn, 1, seed=10, offset=200.0, device=NOMINAL_OPENCL_GPU, bounds=[0, *cuts.tolist(), bn.m])


def _act_cases() -> list[tuple[BnTrain, int]]:
    """SiLU and HardSwish after the batch norm (EfficientNet's, MobileNet-v3's blocks) in every dtype and
    layout, one kernel a pass and split in turn, the parameters in the half dtype in one of each; shapes
    of SHAPES in turn."""
    out = []
    for i, (act, dtype, layout) in enumerate(itertools.product(("silu", "hardswish"), DTYPES, LAYOUTS)):
        n, c, hw = SHAPES[i % len(SHAPES)]
        pdtype = dtype if dtype != "float32" and i % 3 == 0 else "float32"
        out.append((BnTrain(n, c, hw, relu=False, dtype=dtype, pdtype=pdtype, layout=layout, act=act), 1 + i % 2))
    return out


@pytest.mark.parametrize("case", _act_cases(), ids=_ids)
def test_silu_and_hardswish_against_float64(ocl, case) -> None:  # type: ignore[no-untyped-def]
    """z = act(batch norm(y)) and the backward through the activation's derivative at the pre-activation
    the kernel recomputes from y, against float64; gamma tripled so the pre-activations reach HardSwish's
    three pieces (below -3, the ramp, above 3) and SiLU's tails."""
    bn, sp = case
    _check(ocl, bn, sp, seed=sum(map(ord, _ids(case))), gamma_scale=3.0)


def test_bad_settings_name_the_problem() -> None:
    with pytest.raises(ValueError, match="activation \\('gelu'\\) must be one of"):
        BnTrain(2, 4, 4, relu=False, act="gelu")
    with pytest.raises(ValueError, match="without ReLU or residual"):
        BnTrain(2, 4, 4, act="silu")
    with pytest.raises(ValueError, match="must be one of float32"):
        BnTrain(2, 4, 4, dtype="float64")
    with pytest.raises(ValueError, match=r"parameters' \(float16\) float32 or the same"):
        BnTrain(2, 4, 4, dtype="bfloat16", pdtype="float16")
    with pytest.raises(ValueError, match="layout"):
        BnTrain(2, 4, 4, layout="chwn")


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_sources_compile_without_spills(nvcc_ok, dtype: str, layout: str) -> None:  # type: ignore[no-untyped-def]
    """Five shapes (a ResNet stage-1 block with its residual, 2048 channels of 7x7, a prime channel
    count, EfficientNet's SiLU and MobileNet-v3's HardSwish blocks): every form of the program compiles
    for sm_90 without spills. float16 and bfloat16 change only the loads, stores and conversions, so the
    two take the shapes in turns, swapped between the layouts: each shape compiles in each layout and each
    dtype. The parameters' dtype (float32 master or the activations' half, which changes only their
    loads) alternates over the shapes, both covered in each dtype and each layout."""
    from helpers import ptxas_reports

    shapes = [dict(n=32, c=256, hw=56 * 56, residual=True), dict(n=32, c=2048, hw=49), dict(n=8, c=37, hw=9),
              dict(n=64, c=144, hw=56 * 56, relu=False, act="silu"), dict(n=16, c=120, hw=28 * 28, relu=False,
                                                                          act="hardswish")]
    turn = (DTYPES[1:].index(dtype) + LAYOUTS.index(layout)) % 2
    progs = []
    for i, shape in enumerate(shapes):
        if i % 2 != turn:
            continue
        for pdtype in (("float32", dtype)[i % 2],):
            bn = BnTrain(**shape, dtype=dtype, pdtype=pdtype, layout=layout)  # type: ignore[arg-type]
            # one kernel a pass, the split form the device would pick, statistics from 64 partial sums
            progs += [(bn, bn_program(bn, NOMINAL_CUDA, sp, partials)) for sp, partials in ((1, None), (None, None),
                                                                                             (None, 64))]
    reports = ptxas_reports([render(list(prog.kernels), "cuda", "bn") for _, prog in progs])  # one nvcc run
    for (bn, prog), infos in zip(progs, reports, strict=True):
        assert len(infos) == len(prog.kernels) and all(i.spill_stores == 0 and i.spill_loads == 0
                                                       for i in infos), (bn, infos)


def test_the_torch_side_reads_layout_and_parameter_dtypes() -> None:
    """torch/batchnorm.py's rules, on CPU tensors (takes() itself wants CUDA): NCHW-contiguous or
    channels_last (a tensor that is both is NCHW: the same memory), other strides refused; the module's
    parameters and running statistics all float32 (master parameters with half activations, as under
    autocast) or all the activations' half dtype, anything else refused."""
    torch = pytest.importorskip("torch", reason="torch not installed")
    from convforge.torch.batchnorm import _param_dtype, layout

    y = torch.zeros(2, 8, 5, 5, dtype=torch.float16)
    assert layout(y) == "nchw" and layout(y.contiguous(memory_format=torch.channels_last)) == "nhwc"
    assert layout(torch.zeros(2, 8, 1, 1).contiguous(memory_format=torch.channels_last)) == "nchw"
    assert layout(y.transpose(2, 3)) is None
    bn = torch.nn.BatchNorm2d(8)
    assert _param_dtype(bn, y) == torch.float32 and _param_dtype(bn.half(), y) == torch.float16
    assert _param_dtype(bn.bfloat16(), y) is None  # bfloat16 parameters with float16 activations
    bn = torch.nn.BatchNorm2d(8)
    bn._buffers["running_var"] = bn.running_var.half()
    assert _param_dtype(bn, y) is None  # mixed
    assert _param_dtype(torch.nn.BatchNorm2d(8, affine=False, track_running_stats=False), y) == torch.float32
