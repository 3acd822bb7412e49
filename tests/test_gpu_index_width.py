"""GPU tier, issue 34 case 4: layers with more than 2^31 elements in x or in y run through
``conv2d(algo="auto")`` on CuPy arrays and give the float64 reference's answer on images on both
sides of the 2^31 boundary (the 32-bit offsets of old wrapped from image 32 on).

Needs about 22 GB of device memory (an 80 GB H100 holds it); skipped with the reason elsewhere.
Run: ``python -m pytest -q -rs tests/test_gpu_index_width.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from convforge.plan import INT32_MAX
from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec

pytestmark = pytest.mark.gpu

LAYERS = {
    # 17 GB input, auto picked direct_smem (issue 34): offsets of x pass 2^31 from image 32 on.
    "x past 2^31": ConvSpec.make(64, 256, 512, 512, 64, 3, 3, 1, 1),
    # 10.7 GB output from a 268 MB input: offsets of y pass 2^31 from image 26 on.
    "y past 2^31": ConvSpec.make(32, 8, 512, 512, 320, 3, 3, 1, 1),
}
TOL = 1e-5


def _boundary(per_image: int) -> int:
    """The first image whose offsets pass 2^31 - 1."""
    return INT32_MAX // per_image + 1


def _images(spec: ConvSpec) -> list[int]:
    per = max(spec.c * spec.h * spec.w, spec.k * spec.p * spec.q)
    b = _boundary(per)
    return sorted({0, b - 1, b, min(b + 1, spec.n - 1), spec.n - 1})


def _need_memory(cp, spec: ConvSpec, outputs: int = 1) -> None:  # type: ignore[no-untyped-def]
    need = 4 * (spec.n * spec.c * spec.h * spec.w + outputs * spec.n * spec.k * spec.p * spec.q) + (1 << 30)
    free = int(cp.cuda.runtime.memGetInfo()[0]) + int(cp.get_default_memory_pool().free_bytes())
    if need > free:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB free")


def _references(cp, x, w, spec: ConvSpec) -> dict[int, np.ndarray]:  # type: ignore[no-untyped-def]
    """The float64 reference of each checked image, computed once for every variant."""
    wh = cp.asnumpy(w)
    one = ConvSpec(1, spec.c, spec.h, spec.w, spec.k, spec.r, spec.s, spec.stride, spec.pad, spec.dilation)
    return {n: conv2d_ref(cp.asnumpy(x[n:n + 1]), wh, one) for n in _images(spec)}


def _check(cp, y, refs: dict[int, np.ndarray], what: str) -> None:  # type: ignore[no-untyped-def]
    for n, ref in refs.items():
        got = cp.asnumpy(y[n:n + 1])
        err = rel_l2(got, ref)
        assert not np.isnan(got).any() and err < TOL, f"{what}, image {n}: relative error {err:.2e}"


@pytest.mark.serial  # 17-22 GB of device memory: never beside the parallel workers
@pytest.mark.parametrize("case", list(LAYERS))
def test_layer_past_2_31_elements_through_auto(cuda, case: str) -> None:
    cp = pytest.importorskip("cupy", reason="GPU tier needs CuPy")
    import convforge
    from convforge import dispatch
    from convforge.plan import Epilogue

    spec = LAYERS[case]
    assert max(spec.n * spec.c * spec.h * spec.w, spec.n * spec.k * spec.p * spec.q) > INT32_MAX
    _need_memory(cp, spec)
    choice = dispatch.choose(spec, cuda, Epilogue())
    plan = choice.variant.plan(spec, choice.params, cuda.device)
    assert choice.variant.family == "direct" and plan.index_bits == 64, (choice.variant.name, plan.index_bits)
    rng = cp.random.default_rng(0)
    x = rng.standard_normal(spec.x_shape, dtype=cp.float32)
    w = (rng.standard_normal(spec.w_shape, dtype=cp.float32) / np.sqrt(spec.c * spec.r * spec.s)).astype(cp.float32)
    y = convforge.conv2d(x, w, padding=1, algo="auto")
    cp.cuda.Device().synchronize()
    assert isinstance(y, cp.ndarray) and y.shape == spec.y_shape
    refs = _references(cp, x, w, spec)
    _check(cp, y, refs, f"auto ({choice.variant.name})")
    del y
    for name in ("direct", "direct_smem", "direct_shfl"):  # every direct variant, named
        if name == choice.variant.name:
            continue
        y = convforge.conv2d(x, w, padding=1, algo=name)
        cp.cuda.Device().synchronize()
        _check(cp, y, refs, name)
        del y
    for name in ("implicit_gemm", "winograd"):  # 32-bit families: a clear refusal, not a wrong answer
        with pytest.raises(ValueError, match="needs 64-bit indexing"):
            convforge.conv2d(x, w, padding=1, algo=name)
