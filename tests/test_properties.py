"""Property-based tests (hypothesis): every ``conv2d`` call either matches the float64 reference or
raises a ValueError/TypeError with a message; ``ConvSpec.parse`` and ``check_params`` never escape
with anything else. Tiny shapes and few examples: each distinct layer compiles on PoCL."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis not installed (pip install -e '.[dev]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from convforge import conv2d  # noqa: E402
from convforge.dtypes import HALF_TOLERANCE  # noqa: E402
from convforge.kernels import check_params, get_variant  # noqa: E402
from convforge.reference import conv2d_ref, rel_l2  # noqa: E402
from convforge.spec import ConvSpec  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
ALGOS = ["auto", "direct", "implicit_gemm", "winograd_fused_f2", "gemm1x1", "nosuch"]
BAD_TYPES = (ValueError, TypeError)


def _clear_error(err: BaseException) -> None:
    assert isinstance(err, BAD_TYPES), f"{type(err).__name__}: {err}"
    assert str(err).strip(), f"{type(err).__name__} without a message"


def _mostly(good, bad):  # type: ignore[no-untyped-def]
    """Valid values most of the time (bad ones on the largest draw, which hypothesis does not favour),
    so most examples get as far as running a kernel."""
    return st.integers(0, 19).flatmap(lambda i: bad if i == 19 else good)


dim = _mostly(st.integers(1, 3), st.integers(0, 0))
STRIDES = _mostly(st.sampled_from([1, 1, 2, (1, 2), [2, 1]]), st.sampled_from([0, -1, (1, 0), [], (1, 2, 3), 1.5]))
PADS = _mostly(st.sampled_from([0, 1, (1, 0), (0, 1, 2, 1), [1, 1]]),
               st.sampled_from([-1, (1, -1), [], (1, 2, 3), "1"]))


@st.composite
def conv_args(draw):  # type: ignore[no-untyped-def]
    n, c, k = draw(dim), draw(dim), draw(_mostly(st.integers(1, 5), st.integers(0, 0)))
    h, w = draw(_mostly(st.integers(3, 8), st.integers(0, 2))), draw(_mostly(st.integers(3, 8), st.integers(0, 2)))
    r, s = draw(_mostly(st.integers(1, 3), st.integers(0, 0))), draw(_mostly(st.integers(1, 3), st.integers(0, 0)))
    dtype = draw(_mostly(st.just(np.float32), st.sampled_from([np.float64, np.float16, np.int32])))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((k, draw(_mostly(st.just(c), st.just(c + 1))), r, s)).astype(dtype)
    view = draw(_mostly(st.just("plain"), st.sampled_from(["fortran", "strided", "transposed"])))
    if view == "fortran":
        x = np.asfortranarray(x)
    elif view == "strided":
        x = np.ascontiguousarray(np.repeat(x, 2, axis=3))[..., ::2]
    elif view == "transposed":
        x = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    bias = None
    if draw(st.booleans()):
        bias = rng.standard_normal(draw(_mostly(st.just(k), st.just(k + 1)))).astype(
            draw(_mostly(st.just(dtype), st.just(np.float32))))
    kw = dict(stride=draw(STRIDES), padding=draw(PADS), dilation=draw(_mostly(st.sampled_from([1, 1, 2]), STRIDES)),
              algo=draw(_mostly(st.sampled_from(ALGOS[:-1]), st.just("nosuch"))), relu=draw(st.booleans()))
    kind = draw(st.sampled_from(["none"] * 4 + ["default", "partial", "unknown", "bad value", "not a dict"]))
    return x, wt, bias, kw, kind


def _params(kind: str, spec: ConvSpec | None, algo: str, device):  # type: ignore[no-untyped-def]
    """A params argument of the drawn kind, built from the variant's default where one applies."""
    if kind == "none" or spec is None or algo in ("auto", "nosuch"):
        return None
    try:
        default = dict(get_variant(algo).default(spec, device))
    except Exception:  # noqa: BLE001 - the call below reports the problem
        return {"tk": 1}
    if kind == "default":
        return default
    if kind == "partial":
        return dict(list(default.items())[: max(0, len(default) - 1)])
    if kind == "unknown":
        return {**default, "bogus": 1}
    if kind == "bad value":
        return {**default, next(iter(default)): 100000} if default else {"x": 1}
    return [1, 2]


@SETTINGS
@given(conv_args())
def test_conv2d_matches_reference_or_raises_clearly(ocl, args) -> None:  # type: ignore[no-untyped-def]
    x, wt, bias, kw, kind = args
    try:
        spec = ConvSpec.from_shapes(x.shape, wt.shape, kw["stride"], kw["padding"], kw["dilation"])
    except Exception:  # noqa: BLE001 - conv2d must raise for it too
        spec = None
    params = _params(kind, spec, kw["algo"], ocl.device)
    try:
        y = conv2d(x, wt, bias, params=params, **kw)
    except Exception as err:  # noqa: BLE001 - judged below
        _clear_error(err)
        hypothesis.event(f"error: {type(err).__name__}: {str(err)[:40]}")
        return
    hypothesis.event("ran and compared")
    assert spec is not None and x.dtype in (np.float32, np.float16) and x.flags.c_contiguous, "accepted a bad call"
    assert wt.dtype == x.dtype and (bias is None or bias.dtype == x.dtype) and y.dtype == x.dtype, "mixed dtypes"
    ref = conv2d_ref(x.astype(np.float64), wt.astype(np.float64), spec)
    if bias is not None:
        ref = ref + bias.astype(np.float64)[None, :, None, None]
    if kw["relu"]:
        ref = np.maximum(ref, 0.0)
    assert y.shape == ref.shape and np.all(np.isfinite(y))
    tol = 1e-4 if x.dtype == np.float32 else HALF_TOLERANCE["float16"]  # half: output rounding, FP32 sums
    assert rel_l2(y.astype(np.float64), ref) <= tol, (kw, params, rel_l2(y.astype(np.float64), ref))


SPEC_KEYS = ["N", "C", "H", "W", "K", "R", "S", "n", "stride", "pad", "dilation", "strde", "padding", "", "x"]
spec_items = st.tuples(st.sampled_from(SPEC_KEYS), st.sampled_from(["=", "", "=="]),
                       st.one_of(st.integers(-2, 9).map(str), st.sampled_from(["1x2", "1x0x1x0", "a", "", "2x"])))


@settings(max_examples=300, deadline=None, database=None)
@given(st.one_of(st.lists(spec_items, max_size=12).map(lambda xs: ",".join(k + e + v for k, e, v in xs)),
                 st.text(max_size=40)))
def test_spec_parse_never_escapes(text: str) -> None:
    try:
        spec = ConvSpec.parse(text)
    except Exception as err:  # noqa: BLE001
        _clear_error(err)
        return
    assert spec.n > 0 and ConvSpec.parse(text) == spec


@settings(max_examples=150, deadline=None, database=None)
@given(st.sampled_from(["direct", "implicit_gemm", "winograd_fused_f2", "winograd_nonfused_f4"]),
       st.dictionaries(st.sampled_from(["tk", "tp", "bq", "bk", "bm", "bogus", "gemm", "ldg"]),
                       st.one_of(st.integers(-5, 10**6), st.booleans(), st.text(max_size=3), st.floats()),
                       max_size=6))
def test_check_params_never_escapes(name: str, params: dict) -> None:  # type: ignore[type-arg]
    from conftest import NOMINAL_CUDA

    spec = ConvSpec.make(1, 4, 9, 9, 8, 3, 3, 1, 1)
    variant = get_variant(name)
    try:
        prm = check_params(variant, spec, NOMINAL_CUDA, params)
    except Exception as err:  # noqa: BLE001
        _clear_error(err)
        msg = str(err)
        assert variant.name in msg or "params" in msg
        return
    assert set(prm) == set(variant.default(spec, NOMINAL_CUDA))


def test_params_must_be_a_mapping() -> None:
    import numpy as np

    import convforge

    x, w = np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32)
    with pytest.raises(TypeError, match=r"params \(\[1, 2\]\) must be a dict"):
        convforge.conv2d(x, w, params=[1, 2])


def test_params_may_name_a_space_points_optional_keys() -> None:
    """Some space points carry keys the default lacks (direct's tex on CUDA): they are accepted."""
    from conftest import NOMINAL_CUDA
    from convforge import kernels
    from convforge.spec import ConvSpec

    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    v = kernels.get_variant("direct")
    prm = v.default(spec, NOMINAL_CUDA).replace(tex=True, ldg=False)
    assert kernels.check_params(v, spec, NOMINAL_CUDA, prm)["tex"] is True
    with pytest.raises(ValueError, match="unknown bogus"):
        kernels.check_params(v, spec, NOMINAL_CUDA, prm.replace(bogus=1))
