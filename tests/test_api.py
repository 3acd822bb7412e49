"""The public API on NumPy (PoCL), its errors, and the CLI's show/algos/devices."""

from __future__ import annotations

import numpy as np
import pytest

import convforge
from convforge.cli import main
from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec


def test_conv2d_numpy_matches_reference(ocl):
    rng = np.random.default_rng(7)
    x = rng.uniform(-1, 1, (1, 3, 13, 11)).astype(np.float32)
    w = rng.uniform(-1, 1, (5, 3, 3, 3)).astype(np.float32)
    b = rng.uniform(-1, 1, (5,)).astype(np.float32)
    y = convforge.conv2d(x, w, b, stride=2, padding=(0, 1, 1, 0), algo="direct")
    spec = ConvSpec.make(1, 3, 13, 11, 5, 3, 3, 2, (0, 1, 1, 0))
    assert isinstance(y, np.ndarray) and y.shape == spec.y_shape
    assert rel_l2(y, conv2d_ref(x, w, spec, b)) < 1e-5
    y2 = convforge.conv2d(x, w, b, stride=2, padding=(0, 1, 1, 0), relu=True, algo="direct_smem")
    assert rel_l2(y2, conv2d_ref(x, w, spec, b, relu=True)) < 1e-5


@pytest.mark.parametrize("mutate, message", [
    (lambda x, w: (x.astype(np.float64), w), r"input dtype \(float64\) is not run by convforge; use torch"),
    (lambda x, w: (x.astype(np.int32), w), r"input dtype \(int32\) must be one of float32, float16"),
    (lambda x, w: (x[0, 0], w), r"input must have rank 4"),
    (lambda x, w: (x, w[:, :2]), r"channel mismatch: input has C=3, weights have C=2"),
    (lambda x, w: (x.transpose(0, 1, 3, 2), w), r"unsupported layout"),
    (lambda x, w: (x.tolist(), w), r"input must be a NumPy array, CuPy array or torch CUDA tensor"),
])
def test_bad_input_errors(mutate, message):
    x = np.zeros((1, 3, 8, 8), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    xx, ww = mutate(x, w)
    with pytest.raises(ValueError, match=message):
        convforge.conv2d(xx, ww)


def test_bad_arguments_errors(ocl):
    x = np.zeros((1, 3, 8, 8), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(ValueError, match=r"padding \(-1\) must be >= 0"):
        convforge.conv2d(x, w, padding=-1)
    with pytest.raises(ValueError, match=r"algo \('fft'\) is not a family or variant"):
        convforge.conv2d(x, w, algo="fft")
    with pytest.raises(ValueError, match=r"bias has 3 entries, weights have K=4"):
        convforge.conv2d(x, w, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"no 'direct_shfl' variant applies.*runs only on \['cuda'\]"):
        convforge.conv2d(x, w, algo="direct_shfl")


def test_algorithms_lists_variants(ocl):
    names = convforge.algorithms(ConvSpec.make(1, 3, 8, 8, 4, 3, 3), backend="opencl")
    assert "direct" in names and "direct_shfl" not in names
    assert convforge.__version__


def test_cli_show_prints_both_backends(capsys):
    spec = "N=1,C=3,H=13,W=13,K=8,R=3,S=3,pad=1"
    assert main(["show", "--spec", spec, "--variant", "direct", "--backend", "both"]) == 0
    out = capsys.readouterr().out
    assert "===== cuda =====" in out and "===== opencl =====" in out
    assert "__global__" in out and "__kernel" in out


def test_cli_errors_are_clean(capsys):
    assert main(["show", "--spec", "N=1,C=3,H=13,W=13,K=8,R=3,S=3,pad=-1"]) == 2
    assert "padding (-1) must be >= 0" in capsys.readouterr().err


def test_cli_devices_and_algos(ocl, capsys):
    assert main(["devices"]) == 0
    assert "opencl" in capsys.readouterr().out
    assert main(["algos", "--spec", "N=1,C=3,H=13,W=13,K=8,R=3,S=3", "--backend", "opencl"]) == 0
    assert "direct" in capsys.readouterr().out


def test_precision_policy(capsys):
    """'auto' and families keep to the precision class (default fp32: F(4x4) and below) and to
    max_error on stated errors; a named variant always runs; bad limits are clean errors."""
    from conftest import NOMINAL_CUDA
    from convforge import kernels
    from convforge.config import config, parse_max_error

    spec = ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1)
    assert config.precision == "fp32" and config.max_error is None
    names = [v.name for v in kernels.select("auto", spec, NOMINAL_CUDA)]
    assert "winograd_nonfused_f4" in names and "winograd_nonfused_f7" not in names
    assert "precision class" in kernels.reasons("auto", spec, NOMINAL_CUDA)["winograd_nonfused_f6"]
    saved = config.precision, config.max_error
    try:
        config.precision = "relaxed"
        assert "winograd_nonfused_f7" in [v.name for v in kernels.select("auto", spec, NOMINAL_CUDA)]
        config.precision, config.max_error = "fp32", 1e-6
        names = [v.name for v in kernels.select("winograd", spec, NOMINAL_CUDA)]
        assert "winograd_nonfused_f2" in names and "winograd_nonfused_f4" not in names
        assert [v.name for v in kernels.select("winograd_nonfused_f7", spec, NOMINAL_CUDA)] == [
            "winograd_nonfused_f7"]
    finally:
        config.precision, config.max_error = saved
    assert main(["algos", "--spec", "N=1,C=8,H=14,W=14,K=8,R=3,S=3,pad=1", "--max-error", "1e-6"]) == 0
    out = capsys.readouterr().out
    assert "~ winograd_nonfused_f4" in out and "stated error 3.5e-06 > max_error 1e-06" in out
    config.precision, config.max_error = saved
    with pytest.raises(ValueError, match=r"max_error \(-1\) must be > 0"):
        parse_max_error("-1")
    with pytest.raises(ValueError, match=r"max_error \('tight'\) must be a number"):
        parse_max_error("tight")
    with pytest.raises(SystemExit):
        main(["algos", "--spec", "N=1,C=8,H=14,W=14,K=8,R=3,S=3", "--max-error", "0"])
    assert "max_error (0) must be > 0" in capsys.readouterr().err


def test_tuning_key_keeps_accuracy_limits_apart(ocl):
    from convforge.config import config
    from convforge.tune import Tuner
    from convforge.tune.heuristic import NO_EPILOGUE

    spec = ConvSpec.make(1, 8, 14, 14, 8, 3, 3, 1, 1)
    tuner = Tuner(ocl)
    default_key = tuner.key(spec, NO_EPILOGUE)
    saved = config.max_error
    try:
        config.max_error = 1e-5
        strict_key = tuner.key(spec, NO_EPILOGUE)
    finally:
        config.max_error = saved
    assert default_key != strict_key and "max_error=1e-05" in strict_key[-1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(relu="no"), r"relu \('no'\) must be True or False"),
    (dict(relu=1), r"relu \(1\) must be True or False"),
    (dict(max_error=True), r"max_error \(True\) must be a number > 0"),
    (dict(max_error="1e-3"), r"max_error \('1e-3'\) must be a number > 0"),
    (dict(workspace_limit="1"), r"workspace_limit \('1'\) must be an int"),
    (dict(workspace_limit=True), r"workspace_limit \(True\) must be an int"),
    (dict(workspace_limit=1.5), r"workspace_limit \(1.5\) must be an int"),
    (dict(workspace_limit=-1), r"workspace_limit \(-1\) must be >= 0"),
    (dict(precision=["fp32"]), r"precision \(\['fp32'\]\) must be one of fp32, relaxed"),
    (dict(stride=1.5), r"stride \(1.5\) must be an int or a pair of ints"),
    (dict(stride=None), r"stride \(None\) must be an int or a pair of ints"),
    (dict(stride=(True, 2)), r"stride \(\(True, 2\)\) must be .* not a bool"),
    (dict(padding=True), r"padding \(True\) must be .* not a bool"),
    (dict(padding=(True, 0)), r"padding \(\(True, 0\)\) must be .* not a bool"),
    (dict(padding=1.5), r"padding \(1.5\) must be an int"),
])
def test_bad_options_name_argument_and_value(kwargs, message):
    """Checked before any device work: relu="no" must not switch ReLU on, max_error=True must not
    read as 1.0, nor True as padding 1 (it would be pasted into the kernel source)."""
    x = np.zeros((1, 3, 8, 8), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(ValueError, match=message):
        convforge.conv2d(x, w, **kwargs)


def test_spec_memo_does_not_take_bools_for_ints():
    """api._spec remembers specs by argument; True == 1 as a key, so a bool must not find the
    spec filed for 1."""
    from convforge import api

    assert api._spec((1, 3, 8, 8), (4, 3, 3, 3), 1, 1, 1).pad == (1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"padding \(True\) must be"):
        api._spec((1, 3, 8, 8), (4, 3, 3, 3), 1, True, 1)
    with pytest.raises(ValueError, match=r"stride \(1.0\) must be"):
        api._spec((1, 3, 8, 8), (4, 3, 3, 3), 1.0, 1, 1)
    assert api._spec((1, 3, 8, 8), (4, 3, 3, 3), np.int64(2), 1, 1).stride == (2, 2)


def test_fast_path_key_keeps_relu_kinds_apart():
    """A warm relu=True runner must not answer relu=1 (or "yes"), which the slow path refuses."""
    from convforge.frontends.keys import torch_key

    class Fake:  # the attributes the torch key reads
        shape, dtype, device = (1, 3, 8, 8), "float32", "cuda:0"

        def is_contiguous(self) -> bool:
            return True

    x = Fake()

    def key(relu):
        return torch_key(x, x, None, 1, 0, 1, "auto", None, None, relu, None, None, None)

    assert key(True) == key(True) and key(False) != key(True)
    assert key(1) != key(True) and key(0) != key(False) and key(np.True_) != key(True)
    assert key("yes") != key(True)


def test_numpy_integer_geometry_runs(ocl):
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (1, 2, 9, 9)).astype(np.float32)
    w = rng.uniform(-1, 1, (3, 2, 3, 3)).astype(np.float32)
    y = convforge.conv2d(x, w, stride=np.int64(2), padding=np.int64(1), algo="direct",
                         relu=np.True_, workspace_limit=np.int64(0))
    spec = ConvSpec.make(1, 2, 9, 9, 3, 3, 3, 2, 1)
    assert rel_l2(y, conv2d_ref(x, w, spec, relu=True)) < 1e-5


@pytest.mark.parametrize("shape", [dict(n=1, c=8, h=8, w=8, k=8, r=3, s=3, padding=1),
                                   dict(n=2, c=3, h=32, w=32, k=16, r=5, s=5, padding=(2, 1, 0, 2)),
                                   dict(n=1, c=5, h=13, w=11, k=7, r=3, s=3, stride=2, padding=1)])
def test_filters_per_call_make_a_tiny_layer_one_launch(shape, tmp_path, monkeypatch):
    """Where the caller transforms filters on every call (CuPy arrays), 'auto' gives a tiny layer
    a plan of one launch and no filter-only step; a layer above TINY_MACS, or a caller that keeps
    its filters (torch), keeps the heuristic's first choice."""
    from conftest import NOMINAL_CUDA
    from convforge import dispatch
    from convforge.backends.base import weight_steps
    from convforge.config import config
    from convforge.dispatch.choice import TINY_MACS
    from convforge.plan import Epilogue

    class FakeBackend:
        name = "cuda"
        device = NOMINAL_CUDA

    monkeypatch.setattr(config, "db_path", tmp_path / "none.sqlite")
    monkeypatch.setattr(config, "autotune", False)
    be, epi = FakeBackend(), Epilogue(bias=True, relu=True)
    spec = ConvSpec.make(**shape)
    assert spec.flops // 2 <= TINY_MACS
    kept = dispatch.choose(spec, be, epi)  # type: ignore[arg-type]
    once = dispatch.choose(spec, be, epi, filters_per_call=True)  # type: ignore[arg-type]
    plan = once.variant.plan(spec, once.params, NOMINAL_CUDA, epi)
    assert len(plan.steps) == 1 and not weight_steps(plan)[0], once.variant.name
    if spec.r == 3 and spec.stride == (1, 1):  # the heuristic's own choice there transforms filters
        assert weight_steps(kept.variant.plan(spec, kept.params, NOMINAL_CUDA, epi))[0], kept.variant.name
    big = ConvSpec.make(1, 64, 56, 56, 64, 3, 3, 1, 1)
    assert big.flops // 2 > TINY_MACS
    assert (dispatch.choose(big, be, epi, filters_per_call=True).variant  # type: ignore[arg-type]
            == dispatch.choose(big, be, epi).variant)  # type: ignore[arg-type]
    dispatch.clear_choices()


def test_a_runner_cache_hit_files_the_call_again(monkeypatch):
    """A native miss that ``python_conv2d`` answers from the runner cache files the call with the native
    fast path again: the native table drops every entry when a setting is assigned, the runner cache
    keeps its runners, and a call that only ran its runner stayed on Python's path for good (a fused
    model's blocks then never ran natively: ResNet-50's AMP step 16 -> 31 ms after one setting changed)."""
    from convforge import api
    from convforge.dispatch import RUNNERS
    from convforge.frontends import fast_path
    from convforge.frontends.keys import torch_key

    class Tensor:  # what torch_key reads of a torch tensor
        dtype, device = "float16", "cuda:0"

        def __init__(self, shape: tuple[int, ...]) -> None:
            self.shape = shape

        def is_contiguous(self) -> bool:
            return True

    x, w = Tensor((2, 8, 5, 5)), Tensor((4, 8, 3, 3))
    call = (x, w, None, 1, 1, 1, "auto", None, None, False, None, None, None, 1)
    ran: list[tuple[object, ...]] = []
    filed: list[tuple[object, ...]] = []

    def run(*a: object) -> str:
        ran.append(a)
        return "y"

    monkeypatch.setitem(api._KEYERS, Tensor, torch_key)
    monkeypatch.setitem(RUNNERS, torch_key(*call), run)
    monkeypatch.setattr(fast_path, "file_native", lambda r, c, residual=False: filed.append((r, c)))
    assert api.python_conv2d(x, w, None, 1, 1) == "y"
    assert api.python_conv2d(x, w, None, 1, 1) == "y"
    assert ran == [(x, w, None)] * 2 and filed == [(run, call)] * 2


class _Strided:
    """The shape, strides and contiguity a torch tensor reports (no torch on CI)."""

    def __init__(self, shape: tuple[int, ...], strides: tuple[int, ...], contiguous: bool) -> None:
        self.shape, self._strides, self._contiguous = shape, strides, contiguous

    def stride(self) -> tuple[int, ...]:
        return self._strides

    def is_contiguous(self) -> bool:
        return self._contiguous


@pytest.mark.parametrize("shape,strides,contiguous,want", [
    ((2, 8, 5, 3), (120, 1, 24, 8), False, True),  # channels_last
    ((2, 8, 5, 3), (120, 15, 3, 1), True, False),  # NCHW
    ((2, 1, 5, 3), (15, 1, 3, 1), True, False),  # C == 1: NCHW and NHWC at once, counted NCHW
    ((2, 8, 1, 1), (8, 1, 1, 1), True, True),  # 1x1 images: one memory, read in place by NHWC plans
    ((2, 8, 1, 1), (8, 1, 8, 8), True, True),  # the same, as channels_last strides it
    ((2, 8, 1, 1), (16, 2, 1, 1), False, False),  # every other channel: neither
    ((2, 1, 1, 1), (1, 1, 1, 1), True, False)])
def test_which_torch_tensors_nhwc_plans_read_in_place(shape, strides, contiguous, want):
    """frontends.kinds.is_channels_last (torch/ops.channels_last and native.cpp's nhwc keep its rule)."""
    from convforge.frontends.kinds import is_channels_last

    assert is_channels_last(_Strided(shape, strides, contiguous)) is want
