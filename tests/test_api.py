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
    (lambda x, w: (x.astype(np.float64), w), r"input dtype \(float64\) must be float32"),
    (lambda x, w: (x[0], w), r"input must have rank 4"),
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
    assert main(["show", "--spec", "N=1,C=3,H=13,W=13,K=8,R=3,S=3,pad=1", "--variant", "direct"]) == 0
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
