"""GPU tier of the depthwise family in float16 / bfloat16, NCHW and NHWC, every pass (skips without a
CUDA device; written without one, so never run yet when first committed).

- what ``auto`` picks for every layer of the ``depthwise`` suite (MobileNet-v2/v3, EfficientNet-B0,
  ShuffleNet-v2, ConvNeXt-T, RepLKNet-31B, SLaK-T) at N=2, against float64 of the same half inputs with
  the output poisoned, bias + residual + SiLU on the forward pass;
- random points of the tuning spaces on real layers at N=4;
- achieved bandwidth of the defaults on real layers at their own batch, printed beside a copy of the
  layer's own bytes (``-s`` shows the table), with a loose floor that only a pathological kernel misses.

Run on the lent GPU: ``python -m pytest -q -s tests/test_gpu_depthwise.py``.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from convforge import dispatch
from convforge.apps.bench.suites import load_suite
from convforge.check import check_plan
from convforge.dtypes import to_storage
from convforge.kernels import get_variant
from convforge.plan import Epilogue
from convforge.spec import ConvSpec

pytestmark = pytest.mark.gpu

HALF = ("float16", "bfloat16")
SUITE = [layer.spec for layer in load_suite("depthwise")]
PASS_VARIANT = {"fprop": "depthwise", "dgrad": "depthwise_dgrad", "wgrad": "depthwise_wgrad"}
REAL = [ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144),
        ConvSpec.make(64, 96, 112, 112, 96, 3, 3, 2, 1, groups=96),
        ConvSpec.make(64, 480, 14, 14, 480, 5, 5, 1, 2, groups=480),
        ConvSpec.make(32, 96, 56, 56, 96, 7, 7, 1, 3, groups=96),
        ConvSpec.make(32, 768, 7, 7, 768, 7, 7, 1, 3, groups=768)]


def _as(spec: ConvSpec, dtype: str, layout: str, conv_pass: str) -> ConvSpec:
    return dataclasses.replace(spec, dtype=dtype, layout=layout, conv_pass=conv_pass)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("conv_pass", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("i", range(len(SUITE)))
def test_auto_on_the_depthwise_suite(cuda, i, conv_pass, dtype, layout) -> None:
    """One case a layer, so that workers share the suite's large-filter layers (their float64 references
    are the slow part)."""
    epi = Epilogue(bias=True, residual=True, silu=True) if conv_pass == "fprop" else Epilogue()
    spec = _as(SUITE[i].with_batch(2), dtype, layout, conv_pass)
    ch = dispatch.choose(spec, cuda, epi)
    assert ch.variant.family == "depthwise", (spec.short(), ch.variant.name)
    why = dispatch.slow_reason(spec, cuda.device, ch.variant, ch.params)  # None but where measured slow:
    assert why is None or (conv_pass == "fprop" and layout == "nchw" and ch.variant.slow_on(spec)), why  # still runs
    res = check_plan(ch.variant.plan(spec, ch.params, cuda.device, epi), cuda, seed=i)
    assert res.ok, f"{ch.variant.name} [{ch.params.short()}] {spec.short()}{epi.tag()}: {res}"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("conv_pass", ["fprop", "dgrad", "wgrad"])
def test_sampled_spaces_on_real_layers(cuda, conv_pass, dtype) -> None:
    v = get_variant(PASS_VARIANT[conv_pass])
    for layout in ("nchw", "nhwc"):
        for spec in REAL:
            spec = _as(spec.with_batch(4), dtype, layout, conv_pass)
            space = v.space(spec, cuda.device)
            for prm in random.Random(spec.c).sample(space, min(4, len(space))):
                res = check_plan(v.plan(spec, prm, cuda.device), cuda, seed=2)
                assert res.ok, f"{v.name} [{prm.short()}] {spec.short()}: {res}"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("conv_pass", ["fprop", "dgrad"])
def test_rows_spaces_on_real_layers(cuda, conv_pass, dtype) -> None:
    """depthwise_rows (NCHW rows in registers): random points of its space on the real layers it takes
    (stride-1 dgrad only), N = 4, bias + residual + SiLU on the forward pass, against float64."""
    v = get_variant("depthwise_rows" if conv_pass == "fprop" else "depthwise_rows_dgrad")
    epi = Epilogue(bias=True, residual=True, silu=True) if conv_pass == "fprop" else Epilogue()
    ran = 0
    for base in REAL + [ConvSpec.make(4, 32, 112, 112, 32, 3, 3, 1, 1, groups=32),
                        ConvSpec.make(4, 72, 56, 56, 72, 5, 5, 2, 2, groups=72)]:
        spec = _as(base.with_batch(4), dtype, "nchw", conv_pass)
        if v.applies(spec, cuda.device):
            continue
        space = v.space(spec, cuda.device)
        for prm in [space[0]] + random.Random(spec.c).sample(space, min(3, len(space))):
            res = check_plan(v.plan(spec, prm, cuda.device, epi), cuda, seed=3)
            assert res.ok, f"{v.name} [{prm.short()}] {spec.short()}: {res}"
            ran += 1
    assert ran >= 8


def _time_default(cuda, spec: ConvSpec) -> float:  # type: ignore[no-untyped-def]
    """Median ms of the default plan of ``spec`` on fresh buffers (two sets, alternated)."""
    ch = dispatch.choose(spec, cuda)
    plan = ch.variant.plan(spec, ch.params, cuda.device)
    exe = cuda.executable(plan)
    rng = np.random.default_rng(0)
    sets = []
    for _ in range(2):
        bufs = {name: cuda.upload(to_storage(rng.uniform(-1, 1, spec.shape_of(name)).astype(np.float32), spec.dtype))
                for name in ("x", "w", "y")}
        sets.append(bufs)
    for bufs in sets:
        exe(bufs)
    cuda.synchronize()
    turn = iter(sets * 50)
    return float(np.median(cuda.time_ms(lambda: exe(next(turn)), 40)))


@pytest.mark.parametrize("base", REAL, ids=lambda s: f"{s.c}@{s.h}_{s.r}x{s.s}s{s.stride[0]}_n{s.n}")
def test_bandwidth_of_the_defaults(cuda, base: ConvSpec) -> None:
    """GB/s (input + filter + output, each once) of auto's pick on a real layer in each pass, dtype and
    layout, beside a copy of the same bytes; printed, and a floor of 20 % of that copy (the target is
    70 %: what falls under 20 % is a pathology, not a tuning matter). One case a layer: workers share them."""
    from convforge.apps.bench.ceilings import measure_copy
    from convforge.apps.bench.timing import layer_bytes

    rows, slow = [], []
    same = measure_copy(cuda, 3, 10, nbytes=max(1, layer_bytes(_as(base, "float16", "nchw", "fprop")) // 2))[0]
    for dtype, layout, conv_pass in ((d, lay, p) for d in HALF for lay in ("nchw", "nhwc")
                                     for p in ("fprop", "dgrad", "wgrad")):
        spec = _as(base, dtype, layout, conv_pass)
        ms = _time_default(cuda, spec)
        gbs = layer_bytes(spec) / (ms * 1e-3) / 1e9
        rows.append(f"{spec.short():80s} {ms:8.4f} ms {gbs:7.0f} GB/s {100 * gbs / same:5.1f} % of a copy")
        if gbs < 0.2 * same:
            slow.append(rows[-1])
    print("\n" + "\n".join(rows))
    assert not slow, "below 20 % of a copy of the layer's bytes:\n" + "\n".join(slow)


# depthwise_mma (tensor cores, Toeplitz blocks): odd shapes (N = 1 and past an 8-image chunk, primes,
# asymmetric padding, planes over one 16-column tile, padding past R - 1 in dgrad) and the large-kernel
# suite's layers at N = 1 (their float64 references are the slow part)
MMA_ODD = [ConvSpec.make(1, 8, 13, 29, 8, 13, 13, 1, (6, 5, 7, 6), groups=8),
           ConvSpec.make(11, 6, 17, 17, 6, 11, 9, 1, (1, 3, 0, 2), groups=6),
           ConvSpec.make(3, 16, 9, 45, 16, 5, 17, 1, (6, 6, 8, 9), groups=16)]
MMA_LARGE = [layer.spec.with_batch(1) for layer in
             load_suite(str(Path(__file__).parent.parent / "docs/results/suite-depthwise-large-2026-11-29.json"))]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("conv_pass", ["fprop", "dgrad"])
def test_depthwise_mma_against_float64(cuda, conv_pass, dtype, layout) -> None:
    """The default and three sampled points of the space on the odd shapes, the default on the suite's
    layers, output poisoned, against float64 of the same half inputs; the forward with bias + residual
    + GELU."""
    v = get_variant("depthwise_mma_dgrad" if conv_pass == "dgrad" else "depthwise_mma")
    epi = Epilogue(bias=True, residual=True, gelu=True) if conv_pass == "fprop" else Epilogue()
    for base in MMA_ODD + MMA_LARGE:
        spec = _as(base, dtype, layout, conv_pass)
        assert v.applies(spec, cuda.device) is None, (spec.short(), v.applies(spec, cuda.device))
        space = v.space(spec, cuda.device)
        more = 3 if base in MMA_ODD else 0
        points = [space[0]] + random.Random(spec.c + spec.r).sample(space[1:], min(more, len(space) - 1))
        for i, prm in enumerate(points):
            res = check_plan(v.plan(spec, prm, cuda.device, epi), cuda, seed=i)
            assert res.ok, f"{v.name} [{prm.short()}] {spec.short()}{epi.tag()}: {res}"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("base", REAL, ids=lambda s: s.short())
def test_streamed_wgrad_on_real_layers(cuda, base: ConvSpec, dtype: str) -> None:
    """depthwise_wgrad's streamed form (sc): the default and three sweep points at N=4 (every band and
    slice path), dw and the partial filters poisoned, against float64."""
    from convforge.kernels.depthwise_wgrad_stream import stream_space

    spec = _as(dataclasses.replace(base, n=4), dtype, "nhwc", "wgrad")
    v = get_variant("depthwise_wgrad")
    space = stream_space(spec, cuda.device)
    for prm in space[:1] + random.Random(3).sample(space[1:], min(3, len(space) - 1)):
        res = check_plan(v.plan(spec, prm, cuda.device), cuda, seed=4)
        assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


ROLL_REAL = [ConvSpec.make(64, 192, 28, 28, 192, 3, 3, 1, 1, groups=192),
             ConvSpec.make(64, 192, 28, 28, 192, 3, 3, 2, 1, groups=192),
             ConvSpec.make(64, 576, 14, 14, 576, 3, 3, 2, 1, groups=576),
             ConvSpec.make(64, 960, 7, 7, 960, 3, 3, 1, 1, groups=960), REAL[0]]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("base", ROLL_REAL, ids=lambda s: s.short())
def test_rolled_wgrad_on_real_layers(cuda, base: ConvSpec, dtype: str) -> None:
    """depthwise_wgrad's rolled form (rb): its pick (where it has one) and three points of its space at N=4
    (bands, loads ahead, both lane widths), dw and the partial filters poisoned, against float64."""
    from convforge.kernels.depthwise_wgrad_roll import roll_pick, roll_space

    spec = _as(dataclasses.replace(base, n=4), dtype, "nhwc", "wgrad")
    v = get_variant("depthwise_wgrad")
    space = roll_space(spec, cuda.device)
    picked = [p for p in (roll_pick(spec, cuda.device),) if p is not None]
    for prm in picked + random.Random(5).sample(space, min(3, len(space))):
        res = check_plan(v.plan(spec, prm, cuda.device), cuda, seed=6)
        assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


# depthwise_mma_wgrad (tensor cores, x's row a Hankel block): odd shapes (N = 1, primes, asymmetric
# padding, 1 x 7 and 7 x 8 filters, stride 2, bands that do not divide the rows) and the real layers at N = 4
MMA_WGRAD_ODD = [ConvSpec.make(3, 16, 11, 13, 16, 7, 7, 1, 3, groups=16),
                 ConvSpec.make(1, 24, 9, 37, 24, 5, 5, 1, (2, 1, 3, 1), groups=24),
                 ConvSpec.make(2, 32, 7, 23, 32, 1, 7, 1, (0, 0, 3, 3), groups=32),
                 ConvSpec.make(1, 8, 5, 17, 8, 3, 3, 1, 1, groups=8),
                 ConvSpec.make(5, 16, 6, 19, 16, 7, 8, 1, (4, 2, 0, 5), groups=16),
                 ConvSpec.make(2, 16, 13, 41, 16, 5, 5, 2, (2, 1, 2, 2), groups=16),
                 ConvSpec.make(1, 8, 10, 9, 8, 3, 3, 2, (1, 0, 0, 1), groups=8)]


@pytest.mark.parametrize("base", MMA_WGRAD_ODD + [dataclasses.replace(b, n=4) for b in REAL], ids=lambda b: b.short())
@pytest.mark.parametrize("dtype", HALF)
def test_depthwise_mma_wgrad_against_float64(cuda, dtype, base) -> None:
    """The default and three sampled points of the space (every band, warp and channel-block path), dw
    and the partial filters poisoned, against float64 of the same half inputs."""
    v = get_variant("depthwise_mma_wgrad")
    spec = _as(base, dtype, "nhwc", "wgrad")
    assert v.applies(spec, cuda.device) is None, (spec.short(), v.applies(spec, cuda.device))
    space = v.space(spec, cuda.device)
    for i, prm in enumerate(space[:1] + random.Random(spec.c + spec.r).sample(space[1:], min(3, len(space) - 1))):
        res = check_plan(v.plan(spec, prm, cuda.device), cuda, seed=i)
        assert res.ok, f"{v.name} [{prm.short()}] {spec.short()}: {res}"
