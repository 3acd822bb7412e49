"""Issue 34, case 5: NaN, +Inf and near-overflow inputs, every family on PoCL (CUDA-only variants
on the GPU tier). What the float64 reference says is asserted, and what each family gives:

* the accurate families (direct, im2col / implicit GEMM / 1x1 / fc / split-K, im2win; ``exact``)
  give exactly the reference's NaN, +Inf and -Inf outputs, and +Inf where the answer overflows;
* Winograd mixes the (m+2) x (m+2) input tile in its transforms: a NaN or Inf reaches every
  output of the m x m tiles whose input tile holds it (an Inf mostly as NaN: Inf - Inf), never
  beyond those tiles; an overflowing answer comes out NaN or Inf, never finite; F(2x2) and
  F(4x4) stay finite and accurate up to |y| = 0.3 FLT_MAX here, F(6x6) and F(7x7) overflow earlier
  (docs/NOTES-winograd.md, "Non-finite and near-overflow inputs").
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from convforge.kernels import all_variants
from convforge.plan import Variant
from convforge.reference import conv2d_ref
from convforge.spec import ConvSpec

FMAX = float(np.finfo(np.float32).max)
SPECS = {  # a 3x3 layer, a 1x1 one with C >= 32 (split-K), a filter covering the input (gemm_fc)
    "3x3": ConvSpec.make(1, 4, 12, 12, 8, 3, 3, 1, 1),
    "1x1": ConvSpec.make(2, 40, 6, 6, 8, 1, 1),
    "fc": ConvSpec.make(2, 3, 5, 5, 8, 5, 5),
}


def bad_pixel(spec: ConvSpec) -> tuple[int, int, int, int]:
    """The poisoned input pixel (n, c, y, x): (0, 1, 5, 6) where the layer has it (the issue's counts)."""
    return (0, 1, min(5, spec.h - 1), min(6, spec.w - 1))


_TARGET = {"overflow": 2.0, "near 0.3": 0.3, "near 1/400": 1 / 400}  # the largest |answer| / FLT_MAX
# Measured: the largest |answer| / FLT_MAX that Winograd keeps finite on positive data (16 channels),
# by tile size alpha = m + r - 1 (3x3: F(2x2), F(4x4), F(6x6), F(7x7)); other alphas: not stated.
FINITE_UP_TO = {4: 0.98, 6: 0.59, 8: 1 / 18, 9: 1 / 296}


def _inputs(spec: ConvSpec, case: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    if case in ("nan", "inf"):
        x = rng.uniform(-1, 1, spec.x_shape).astype(np.float32)
        w = rng.uniform(-1, 1, spec.w_shape).astype(np.float32)
        x[bad_pixel(spec)] = np.nan if case == "nan" else np.inf
        return x, w
    # positive data, scaled so the largest answer is 2x FLT_MAX ("overflow") or a fraction of it
    x = rng.uniform(0.5, 1, spec.x_shape).astype(np.float32)
    w = rng.uniform(0.5, 1, spec.w_shape).astype(np.float32)
    top = float(np.abs(conv2d_ref(x, w, spec)).max())
    target = _TARGET[case] * FMAX
    return (x * np.float32(target / top)).astype(np.float32), w


def reference(x: np.ndarray, w: np.ndarray, spec: ConvSpec) -> np.ndarray:
    """The float64 reference rounded to float32 (an answer past FLT_MAX is +-Inf there)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return conv2d_ref(x, w, spec).astype(np.float32)


def touched_tiles(spec: ConvSpec, m: int, bad: np.ndarray) -> np.ndarray:
    """Outputs of every m x m output tile whose (m+2) x (m+2) input tile holds a pixel of ``bad``
    (an N x C x H x W mask), for every output channel: where Winograd may spread it."""
    out = np.zeros(spec.y_shape, bool)
    span = m + spec.r - 1
    for n, _, y0, x0 in zip(*np.nonzero(bad), strict=True):
        for tp in range(-(-spec.p // m)):
            for tq in range(-(-spec.q // m)):
                r0, c0 = tp * m - spec.pad[0], tq * m - spec.pad[2]
                if r0 <= y0 < r0 + span and c0 <= x0 < c0 + span:
                    out[n, :, tp * m:tp * m + m, tq * m:tq * m + m] = True
    return out


def check_family(v: Variant, spec: ConvSpec, case: str, x: np.ndarray, w: np.ndarray, got: np.ndarray) -> None:
    """The behaviour the module docstring states for ``v``'s family, asserted on one output."""
    ref = reference(x, w, spec)
    fin = np.isfinite(got) & np.isfinite(ref)
    got64, ref64 = got[fin].astype(np.float64), ref[fin].astype(np.float64)
    err = float(np.linalg.norm(got64 - ref64) / max(float(np.linalg.norm(ref64)), 1e-300))
    if v.exact:
        for test in (np.isnan, np.isposinf, np.isneginf):
            assert np.array_equal(test(got), test(ref)), (v.name, case, test.__name__)
        assert err < 1e-5, (v.name, case, err)
        return
    bad_out = ~np.isfinite(ref)
    assert np.all(~np.isfinite(got[bad_out])), (v.name, case, "a non-finite answer came out finite")
    m = getattr(v, "m", None)
    if v.family != "winograd" or m is None:  # TF32 / 3xTF32 GEMMs: no spreading beyond the reference's
        spread = bad_out
    elif case in ("nan", "inf"):
        spread = touched_tiles(spec, m, ~np.isfinite(x))
    else:  # overflow: anywhere; near FP32's range: where the tile size's range is passed
        passed = case == "overflow" or _TARGET[case] > FINITE_UP_TO.get(m + max(spec.r, spec.s) - 1, 0.0)
        spread = np.ones_like(bad_out) if passed else np.zeros_like(bad_out)
    assert not np.any(~np.isfinite(got) & ~spread), (v.name, case, "non-finite outside the input's tiles")
    assert err < 20 * v.tolerance, (v.name, case, err)


def _variants(device, spec: ConvSpec) -> list[Variant]:  # type: ignore[no-untyped-def]
    return [v for v in all_variants() if device.backend in v.backends and v.applies(spec, device) is None]


CASES = ("nan", "inf", "overflow", "near 0.3", "near 1/400")


def test_reference_says(ocl) -> None:
    """The oracle itself: NaN and +-Inf exactly at the receptive field of the bad pixel, +Inf where
    the answer passes FLT_MAX, finite below it."""
    spec = SPECS["3x3"]
    for case in CASES:
        x, w = _inputs(spec, case)
        ref = reference(x, w, spec)
        field = np.zeros(spec.y_shape, bool)
        _, _, y0, x0 = bad_pixel(spec)
        field[0, :, y0 - 1:y0 + 2, x0 - 1:x0 + 2] = True  # 3x3, pad 1: the outputs around the pixel
        if case == "nan":
            assert np.array_equal(np.isnan(ref), field) and np.isnan(ref).sum() == 72
        elif case == "inf":
            assert np.array_equal(np.isinf(ref), field) and not np.isnan(ref).any()
            assert np.isposinf(ref).any() and np.isneginf(ref).any()  # w of both signs
        elif case == "overflow":
            assert np.isposinf(ref).sum() > ref.size // 2 and not np.isnan(ref).any()
        else:
            target = 0.3 if case == "near 0.3" else 1 / 400
            assert np.isfinite(ref).all() and np.isclose(np.abs(ref).max(), target * FMAX, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layer", list(SPECS))
def test_every_family_on_nonfinite_inputs(ocl, layer: str, case: str) -> None:
    from convforge import conv2d

    spec = SPECS[layer]
    x, w = _inputs(spec, case)
    ran = []
    for v in _variants(ocl.device, spec):
        got = conv2d(x, w, padding=spec.pad, algo=v.name)
        check_family(v, spec, case, x, w, got)
        ran.append(v.name)
    want = {"3x3": {"direct", "implicit_gemm", "im2col_gemm", "im2win", "winograd_fused_f2", "winograd_nonfused_f4"},
            "1x1": {"gemm1x1", "gemm1x1_splitk"}, "fc": {"gemm_fc"}}[layer]
    assert want <= set(ran), ran


def test_winograd_pins(ocl) -> None:
    """The counts behind docs/NOTES-winograd.md: one NaN, one +Inf and an overflowing answer."""
    from convforge import conv2d

    spec = SPECS["3x3"]
    seen: dict[str, dict[str, tuple[int, int]]] = {}
    for case in ("nan", "inf", "overflow", "near 0.3"):
        x, w = _inputs(spec, case)
        for name in ("winograd_fused_f2", "winograd_nonfused_f2", "winograd_fused_f4", "winograd_nonfused_f4",
                     "winograd_nonfused_f6", "winograd_nonfused_f7"):
            got = conv2d(x, w, padding=1, algo=name)
            seen.setdefault(name, {})[case] = (int(np.isnan(got).sum()), int(np.isinf(got).sum()))
    for f in ("fused", "nonfused"):
        assert seen[f"winograd_{f}_f2"]["nan"] == (72, 0)  # F(2x2)'s transforms keep the receptive field
        assert seen[f"winograd_{f}_f4"]["nan"] == (128, 0)  # one 4x4 tile x 8 channels
        nan2, inf2 = seen[f"winograd_{f}_f2"]["inf"]
        assert nan2 > 0 and nan2 + inf2 >= 72  # Inf - Inf inside the tile: NaN where the reference has Inf
        assert seen[f"winograd_{f}_f4"]["inf"][0] == 128
        assert seen[f"winograd_{f}_f4"]["overflow"][0] > 0  # NaN where the answer is +Inf
        assert seen[f"winograd_{f}_f2"]["near 0.3"] == seen[f"winograd_{f}_f4"]["near 0.3"] == (0, 0)
    for name in ("winograd_nonfused_f6", "winograd_nonfused_f7"):  # relaxed class: overflow below 0.3 FLT_MAX
        assert sum(seen[name]["near 0.3"]) > 0, seen[name]


def test_fused_relu_keeps_nan(ocl) -> None:
    """A NaN through conv + bias + ReLU (one epilogue) stays NaN, as in the reference and PyTorch."""
    from convforge import conv2d

    spec = SPECS["3x3"]
    x, w = _inputs(spec, "nan")
    b = np.zeros(spec.k, np.float32)
    ref = np.maximum(reference(x, w, spec), 0)
    for name in ("direct", "direct_smem", "implicit_gemm", "im2win", "winograd_fused_f2", "winograd_nonfused_f2"):
        got = conv2d(x, w, b, padding=1, algo=name, relu=True)
        assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(got).sum() == 72, name
        assert (got[~np.isnan(got)] >= 0).all(), name


@pytest.mark.parametrize("case", CASES)
def test_cuda_variants_on_nonfinite_inputs(cuda, case: str) -> None:
    """GPU tier: every CUDA variant (direct_shfl, cuBLAS, TF32 and 3xTF32 included) under the same
    rules: accurate families exactly as the reference, the others never beyond their tiles."""
    cp = pytest.importorskip("cupy", reason="GPU tier needs CuPy")
    from convforge import conv2d

    for spec in SPECS.values():
        x, w = _inputs(spec, case)
        for v in _variants(cuda.device, spec):
            got = cp.asnumpy(conv2d(cp.asarray(x), cp.asarray(w), padding=spec.pad, algo=v.name))
            check_family(v, spec, case, x, w, got)
