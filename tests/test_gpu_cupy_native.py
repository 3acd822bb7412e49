"""GPU tier: the native fast path for CuPy arrays (backends/cupy_native.cpp).

Warm calls run in C (Python's path made to fail), every spelling of the arguments is kept apart,
results match the float64 reference with the output's memory poisoned first, in-place weight
updates are seen (the whole plan runs per call), and what the path cannot run (unaligned views,
non-contiguous arrays, another device than the current one) reaches Python's path and its errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec

pytestmark = pytest.mark.gpu

CALLS = [  # (spec, conv2d keyword arguments, algo): spellings the key must keep apart
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), dict(padding=1), "auto"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, (1, 1, 2, 2)), dict(padding=(1, 2)), "auto"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, (1, 2, 1, 2)), dict(padding=[1, 2, 1, 2]), "auto"),
    (ConvSpec.make(1, 3, 27, 29, 4, 11, 11, 4, (2, 1, 0, 3)), dict(stride=4, padding=(2, 1, 0, 3)), "auto"),
    (ConvSpec.make(3, 7, 9, 9, 5, 1, 1, 2), dict(stride=2), "auto"),
    (ConvSpec.make(1, 8, 8, 8, 8, 3, 3, 1, 1), dict(padding=1), "auto"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), dict(padding=1), "winograd_nonfused_f4"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), dict(padding=1, relu=True), "implicit_gemm"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), dict(padding=1, precision="relaxed"), "auto"),
    # TMA plans (the defaults here: whole 32-channel atoms), their tensor maps encoded by the native core
    (ConvSpec.make(2, 64, 14, 14, 64, 3, 3, 1, 1), dict(padding=1, precision="relaxed"), "tc_implicit_gemm_tf32"),
    (ConvSpec.make(3, 32, 13, 11, 40, 3, 3, 2, 1), dict(stride=2, padding=1), "tc_implicit_gemm_3xtf32"),
]


@pytest.fixture
def cupy_native(cuda):
    pytest.importorskip("cupy", reason="GPU tier of the CuPy path: CuPy not installed")
    from convforge.backends import native
    from convforge.config import config

    if not config.native:
        pytest.skip("native fast path off (CONVFORGE_NATIVE=0)")
    mod = native.load_cupy()
    assert mod is not None, "the CuPy native fast path did not build or set up on this CUDA machine: see the log"
    return mod


def _arrays(spec, seed=0, bias=True):
    import cupy as cp

    rng = np.random.default_rng(seed)
    x = cp.asarray(rng.standard_normal(spec.x_shape, dtype=np.float32))
    w = cp.asarray(rng.standard_normal(spec.w_shape, dtype=np.float32))
    b = cp.asarray(rng.standard_normal(spec.k, dtype=np.float32)) if bias else None
    return x, w, b


def _ref(x, w, spec, b=None):
    import cupy as cp

    return conv2d_ref(cp.asnumpy(x), cp.asnumpy(w), spec, None if b is None else cp.asnumpy(b))


def _poison(shape):
    """Leave a NaN-filled block of this size in CuPy's pool, where the next output lands."""
    import cupy as cp

    t = cp.full(shape, np.nan, dtype=cp.float32)
    del t


def test_warm_cupy_calls_never_enter_python(cupy_native, monkeypatch):
    import cupy as cp

    import convforge
    from convforge import api

    cases = []
    for i, (spec, kw, algo) in enumerate(CALLS):
        x, w, b = _arrays(spec, seed=i)
        convforge.conv2d(x, w, b, algo=algo, **kw)  # the slow path files it
        cases.append((spec, kw, algo, x, w, b))
    entries, runs = cupy_native.stats()["entries"], cupy_native.stats()["runs"]

    def fail(*args, **kwargs):
        raise AssertionError("a warm CuPy call reached Python's path")

    monkeypatch.setattr(api, "_KEYERS", {})
    monkeypatch.setattr(api, "_conv2d", fail)
    for spec, kw, algo, x, w, b in cases:
        want = _ref(x, w, spec, b)
        if kw.get("relu"):
            want = want.clip(min=0)
        _poison(spec.y_shape)
        y = convforge.conv2d(x, w, b, algo=algo, **kw)
        assert isinstance(y, cp.ndarray) and y.shape == spec.y_shape and y.flags.c_contiguous
        tol = 1e-3 if kw.get("precision") == "relaxed" else 1e-5
        assert rel_l2(cp.asnumpy(y), want) < tol, (spec.short(), kw, algo)
    assert cupy_native.stats()["runs"] == runs + len(cases)
    assert cupy_native.stats()["entries"] == entries


def test_in_place_weight_updates_are_seen(cupy_native):
    """A CuPy array has no version counter: every call runs the plan's filter transform too."""
    import cupy as cp

    import convforge

    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    x, w, b = _arrays(spec, seed=5)
    for algo in ("winograd_nonfused_f4", "winograd_fused_f2", "auto"):
        for scale in (1.0, -0.5, 3.0):
            w *= scale
            _poison(spec.y_shape)
            y = convforge.conv2d(x, w, b, padding=1, algo=algo)
            assert rel_l2(cp.asnumpy(y), _ref(x, w, spec, b)) < 1e-5, (algo, scale)


def test_current_stream_is_used(cupy_native):
    import cupy as cp

    import convforge

    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    x, w, b = _arrays(spec, seed=6)
    convforge.conv2d(x, w, b, padding=1)
    runs = cupy_native.stats()["runs"]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x2 = x * 2  # enqueued on the stream: the conv must follow it there
        y = convforge.conv2d(x2, w, b, padding=1)
    stream.synchronize()
    assert cupy_native.stats()["runs"] == runs + 1
    assert rel_l2(cp.asnumpy(y), _ref(x2, w, spec, b)) < 1e-5


def test_what_the_path_cannot_run_goes_to_python(cupy_native):
    """Unaligned views are copied by Python's path; non-contiguous arrays and bad arguments get
    Python's errors; none of them is run (or filed) in C."""
    import cupy as cp

    import convforge

    spec = ConvSpec.make(2, 8, 12, 12, 16, 3, 3, 1, 1)
    x, w, _ = _arrays(spec, seed=7, bias=False)
    convforge.conv2d(x, w, padding=1)
    runs = cupy_native.stats()["runs"]
    base = cp.concatenate([cp.zeros(1, cp.float32), x.ravel()])
    xu = base[1:].reshape(spec.x_shape)
    assert xu.data.ptr % 16
    for _ in range(2):
        y = convforge.conv2d(xu, w, padding=1)
        assert rel_l2(cp.asnumpy(y), _ref(x, w, spec)) < 1e-5
    assert cupy_native.stats()["runs"] == runs
    with pytest.raises(ValueError, match="layout"):
        convforge.conv2d(cp.asfortranarray(x), w, padding=1)
    with pytest.raises(ValueError, match="padding"):
        convforge.conv2d(x, w, padding=-1)
    with pytest.raises(ValueError, match="dtype"):
        convforge.conv2d(x.astype(cp.float64), w.astype(cp.float64), padding=1)
    assert cupy_native.stats()["runs"] == runs


def test_a_tiny_layer_is_one_launch(cupy_native):
    """Filters transformed per call would double a tiny layer's launches: 'auto' picks a one-step plan."""
    import convforge
    from convforge import api
    from convforge.dispatch import RUNNERS

    spec = ConvSpec.make(1, 8, 8, 8, 8, 3, 3, 1, 1)
    x, w, b = _arrays(spec, seed=8)
    convforge.conv2d(x, w, b, padding=1)
    key = api._KEYERS[type(x)](x, w, b, 1, 1, 1, "auto", None, None, False, None, None, None)
    assert len(RUNNERS[key].exe.plan.steps) == 1
