"""GPU tier of half precision (skips without a CUDA device; torch tests also without torch).

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_half.py``. Every result is checked against
float64 on the same half inputs (plans at dtypes.HALF_TOLERANCE: 1e-3 float16, 8e-3 bfloat16; whole
models against PyTorch's own error in the same dtype); outputs land in blocks poisoned with NaN.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from convforge.check import check_plan
from convforge.dtypes import HALF_TOLERANCE
from convforge.kernels import all_variants
from convforge.plan import Epilogue
from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec

pytestmark = pytest.mark.gpu
HALF = ("float16", "bfloat16")
SPECS = [ConvSpec.make(2, 3, 13, 17, 5, 3, 3, (1, 2), (1, 0, 2, 1)), ConvSpec.make(2, 64, 28, 28, 64, 3, 3, 1, 1),
         ConvSpec.make(3, 64, 14, 14, 128, 1, 1), ConvSpec.make(1, 3, 27, 29, 4, 11, 11, 4, (2, 1, 0, 3)),
         ConvSpec.make(1, 512, 7, 7, 512, 3, 3, 1, 1),
         # a split-K 1x1 (deep, small image) and a fully connected layer (the filter covers the input)
         ConvSpec.make(2, 512, 7, 7, 128, 1, 1), ConvSpec.make(4, 64, 7, 7, 100, 7, 7)]
# the CUDA-core families (the tensor-core variants have tests/test_tensorcore_gen.py's GPU tier)
HALF_NAMES = [v.name for v in all_variants() if set(HALF) <= v.dtypes and "float32" in v.dtypes and "cuda" in v.backends
              and v.family in ("direct", "im2col", "implicit_gemm", "gemm1x1") and "fprop" in v.passes]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", HALF_NAMES)
def test_half_variant_on_gpu(cuda, name: str, dtype: str) -> None:
    v = next(v for v in all_variants() if v.name == name)
    ran = 0
    for i, base in enumerate(SPECS):
        spec = dataclasses.replace(base, dtype=dtype)
        if v.applies(spec, cuda.device):
            continue
        epi = Epilogue(True, True, v.residual_ok) if i % 2 else Epilogue()
        res = check_plan(v.plan(spec, v.default(spec, cuda.device), cuda.device, epi), cuda, seed=i)
        assert res.ok, f"{name} {spec.short()}{epi.tag()}: {res}"
        ran += 1
    assert ran


# -- conv2d with CuPy and torch arrays -----------------------------------------------------------
def _ref(x, w, b, spec: ConvSpec) -> np.ndarray:
    y = conv2d_ref(x.astype(np.float64), w.astype(np.float64), spec)
    return y if b is None else y + b.astype(np.float64)[None, :, None, None]


@pytest.mark.parametrize("algo", ["auto", "direct", "implicit_gemm", "implicit_gemm_precomp"])
def test_conv2d_cupy_float16(cuda, algo: str) -> None:
    import cupy as cp

    import convforge

    spec = SPECS[1]
    rng = np.random.default_rng(0)
    x, w, b = (rng.uniform(-1, 1, s).astype(np.float16) for s in (spec.x_shape, spec.w_shape, (spec.k,)))
    for _ in range(3):  # the first call builds the runner, the others take the fast path
        y = convforge.conv2d(cp.asarray(x), cp.asarray(w), cp.asarray(b), padding=1, algo=algo)
        assert isinstance(y, cp.ndarray) and y.dtype == cp.float16
        assert rel_l2(cp.asnumpy(y).astype(np.float32), _ref(x, w, b, spec)) < HALF_TOLERANCE["float16"]


@pytest.mark.parametrize("dtype", HALF)
def test_tuning_a_layer_with_an_odd_count_of_half_outputs(cuda, dtype: str) -> None:
    """N5 K383 13x13 stores 323,635 halves: the tuner's output buffer, once rounded down to whole
    4-byte words, failed every candidate's bound check by 2 bytes; now each candidate is judged."""
    from convforge.tune.tuner import Budget, Tuner

    spec = ConvSpec.make(5, 257, 13, 13, 383, 3, 3, 1, 1, dtype=dtype)
    assert spec.n * spec.k * spec.p * spec.q % 2 == 1
    res = Tuner(cuda, None, Budget(None, 6), precision="relaxed").tune(spec)
    assert not [c.status for c in res.candidates if "bound" in c.status]
    assert res.entry.error < HALF_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("spec", SPECS[:4], ids=lambda s: s.key())
def test_conv2d_torch_half(gpu, spec: ConvSpec, dtype: str) -> None:
    """float16 and bfloat16 torch tensors in, the same dtype out, three calls (the warm ones take the
    Python fast path: the C++ ones take float32 only), interleaved with float32 calls of the same
    shapes, which must still be float32 and right."""
    import torch

    import convforge

    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    x32 = torch.rand(spec.x_shape, device="cuda", generator=g) * 2 - 1
    w32 = torch.rand(spec.w_shape, device="cuda", generator=g) * 2 - 1
    b32 = torch.rand(spec.k, device="cuda", generator=g) * 2 - 1
    x, w, b = x32.to(tdt), w32.to(tdt), b32.to(tdt)
    want = _ref(*(t.float().cpu().numpy() for t in (x, w, b)), spec)
    for _ in range(3):
        torch.full(spec.y_shape, float("nan"), device="cuda", dtype=tdt)
        y = convforge.conv2d(x, w, b, stride=spec.stride, padding=spec.pad, relu=False)
        assert y.dtype == tdt and tuple(y.shape) == spec.y_shape
        assert rel_l2(y.float().cpu().numpy(), want) < HALF_TOLERANCE[dtype]
        y32 = convforge.conv2d(x32, w32, b32, stride=spec.stride, padding=spec.pad)
        assert y32.dtype == torch.float32
        assert rel_l2(y32.cpu().numpy(), _ref(*(t.cpu().numpy() for t in (x32, w32, b32)), spec)) < 1e-5


def test_conv2d_torch_dtype_mix_is_an_error(gpu) -> None:
    import torch

    import convforge

    x = torch.ones(1, 2, 5, 5, device="cuda", dtype=torch.float16)
    w = torch.ones(3, 2, 3, 3, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weights dtype \(bfloat16\) must equal the input's \(float16\)"):
        convforge.conv2d(x, w)
    with pytest.raises(ValueError, match=r"input dtype \(float64\)"):
        convforge.conv2d(x.double(), w.double())


# -- convforge.torch: .half() / .bfloat16() models and autocast regions ------------------------
def _resnet18():
    tv = pytest.importorskip("torchvision", reason="torchvision not installed")
    from convforge.apps.bench.models import reinit

    model = tv.models.resnet18(weights=None)
    reinit(model, 0)
    return model.cuda().eval()


def _errors(model, dtype: str, mode: str):
    """(our error, PyTorch's error) of ``model`` run in ``dtype`` by ``mode`` (converted, fused,
    autocast_converted, autocast_fused) against float64 on the same rounded input."""
    import torch

    import convforge.torch as ct

    tdt = getattr(torch, dtype)
    x = torch.randn(2, 3, 64, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(tdt)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
        autocast = mode.startswith("autocast")
        theirs_model = model if autocast else copy.deepcopy(model).to(tdt)
        mine = copy.deepcopy(model) if autocast else copy.deepcopy(model).to(tdt)
        if mode.endswith("fused"):
            mine, report = ct.fuse(mine)
        else:
            report = ct.convert(mine)
        assert report.converted and not report.left, str(report)
        xin = x.float() if autocast else x
        with torch.autocast("cuda", dtype=tdt, enabled=autocast):
            theirs = theirs_model(xin)
            for _ in range(2):  # the second call is warm
                ours = mine(xin)
        assert ours.dtype == theirs.dtype
        return (float((ours.double() - want).norm() / want.norm()),
                float((theirs.double() - want).norm() / want.norm()))


@pytest.mark.parametrize("mode", ["converted", "fused", "autocast_converted", "autocast_fused"])
@pytest.mark.parametrize("dtype", HALF)
def test_half_resnet18_within_twice_pytorchs_error(gpu, dtype: str, mode: str) -> None:
    ours, theirs = _errors(_resnet18(), dtype, mode)
    assert ours <= 2 * theirs, f"{mode} {dtype}: ours {ours:.2e}, PyTorch {theirs:.2e}"


def test_autocast_runs_our_kernels_and_casts_filters_once(gpu, monkeypatch) -> None:
    """Inside autocast a float32 Conv2d runs convforge in float16 (its output is float16), and its
    cast filters are made once per weight version."""
    import torch

    import convforge.torch as ct

    conv = ct.Conv2d(8, 16, 3, padding=1).cuda().eval()
    x = torch.randn(2, 8, 12, 12, device="cuda")
    casts = []
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: casts.append(1) or real(self, *a, **k))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        ys = [conv(x) for _ in range(3)]
    assert all(y.dtype == torch.float16 for y in ys)
    assert len(casts) == 3 + 2  # the input every call; weight and bias once
    with torch.no_grad():
        conv.weight.mul_(2)  # a new version: cast again
        with torch.autocast("cuda", dtype=torch.float16):
            y2 = conv(x)
    want = torch.nn.functional.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    assert float((y2.double() - want).norm() / want.norm()) < 2 * HALF_TOLERANCE["float16"]


# -- the graph runtime on CUDA ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["googlenet", "resnet50"])
@pytest.mark.parametrize("dtype", HALF)
def test_network_half_on_cuda(cuda, dtype: str, name: str) -> None:
    """GoogLeNet and ResNet-50 (random weights, 96 x 96) stored in the dtype, logits against the
    float64 executor on the same rounded input: within 2x PyTorch's error in the same dtype (its
    .half() / .bfloat16() eager run of the same graph), or 4x the per-layer tolerance where that is
    larger. The yardstick follows the network's own sensitivity to rounding: with unit residual
    branches a random ResNet-50 was chaotic (0.17 FP16 error on both sides at 96 x 96, round 26);
    the shipped weights now scale the branches down (graph.reference.RESIDUAL_GAIN)."""
    torch_reference = pytest.importorskip("convforge.graph.torch_reference")
    pytest.importorskip("torch", reason="the yardstick is PyTorch's error in the same dtype")
    from convforge.dtypes import rounded
    from convforge.graph.build import compile, load_model
    from convforge.graph.reference import run_reference

    g = load_model(name, input_size=96)
    logits = g.producer(g.outputs[0]).inputs[0]  # before the softmax
    g.outputs = [logits]
    net = compile(g, batch=2, backend="cuda", dtype=dtype)
    x = np.random.default_rng(0).standard_normal(net.shapes[g.input].shape).astype(np.float32)
    out = net(x)
    x1 = rounded(x, dtype)[:1]
    ref = run_reference(g.with_batch(1), x1)[logits]
    theirs = torch_reference.forward_fn(g.with_batch(1), x1, "cuda", dtype)().float().cpu().numpy()
    ours, yardstick = rel_l2(out[logits][:1], ref), rel_l2(theirs, ref)
    assert ours < max(4 * HALF_TOLERANCE[dtype], 2 * yardstick), (name, ours, yardstick)


# -- bench: the half baselines and the tensor-core ceilings ----------------------------------------
@pytest.mark.parametrize("dtype", HALF)
def test_half_baselines_and_tensor_core_ceilings(gpu, dtype: str) -> None:
    from convforge.apps.bench import baselines
    from convforge.apps.bench.timing import Timing

    spec = dataclasses.replace(SPECS[1], dtype=dtype)
    res = baselines.run("cudnn", spec, Timing(1, 3, 1), True)
    best = res[0]
    assert best.impl == baselines.HALF_BEST[dtype] and best.time_ms and best.rel_err is not None
    assert best.rel_err < HALF_TOLERANCE[dtype]
    assert any(r.impl.startswith(f"cudnn-{baselines.HALF_TAGS[dtype]}-nhwc:") and r.time_ms for r in res)
    chosen = baselines.for_class(res, "fp32", dtype)
    assert chosen is not None and chosen.impl == best.impl and baselines.for_class(res, "relaxed", dtype) == chosen
    peaks = baselines.tensor_core_peaks(quick=True)
    assert set(peaks) == {"float16", "bfloat16", "tf32"} and all(v > 1 for v in peaks.values())
