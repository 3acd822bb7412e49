"""GPU tier of grouped and depthwise convolutions (skips without a CUDA device; the torch parts
without torch, the model parts without torchvision).

- every grouped-capable variant's default on the ``grouped`` suite's layers (MobileNet-v2/v3,
  EfficientNet-B0, ShuffleNet-v2, ConvNeXt-T, ResNeXt-50, RegNetY-1.6GF) at a small batch, and what
  dispatch picks at the suite's own batch, against float64 with the output poisoned;
- the depthwise dgrad and wgrad kernels on the real layers;
- ``conv2d(groups=)`` with CuPy arrays and torch tensors: warm calls stay in C (Python's path made to
  fail), a default-groups call of grouped shapes is still refused, the op with ``groups`` and its
  gradient;
- torchvision's mobilenet_v2, resnext50_32x4d and convnext_tiny converted (``convert``) and fused
  (``fuse``) with every conv running convforge, outputs against a float64 run of the same model.

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_grouped.py`` (a few minutes: compiles).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from convforge.apps.bench.suites import load_suite
from convforge.apps.bench.timing import check_slice
from convforge.check import check_plan
from convforge.kernels import get_variant
from convforge.plan import Epilogue
from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec

pytestmark = pytest.mark.gpu

FPROP = ("depthwise", "direct", "direct_smem", "direct_shfl", "implicit_gemm", "implicit_gemm_precomp", "gemm1x1")
SUITE = [layer.spec for layer in load_suite("grouped")]
REAL = [ConvSpec.make(64, 96, 112, 112, 96, 3, 3, 2, 1, groups=96),
        ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144),
        ConvSpec.make(32, 96, 56, 56, 96, 7, 7, 1, 3, groups=96),
        ConvSpec.make(32, 192, 28, 28, 192, 7, 7, 1, 3, groups=192),
        ConvSpec.make(32, 384, 14, 14, 384, 7, 7, 1, 3, groups=384),
        ConvSpec.make(32, 768, 7, 7, 768, 7, 7, 1, 3, groups=768)]
FULL = Epilogue(bias=True, relu=True, residual=True)


# -- kernels ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FPROP)
def test_every_grouped_variant_on_the_suite(cuda, name) -> None:
    """Each variant's default on every other layer of the suite at N=2 (bias, residual and ReLU on
    every other one)."""
    v = get_variant(name)
    ran = 0
    for i, spec in enumerate(SUITE[::2]):
        spec = spec.with_batch(2)
        if v.applies(spec, cuda.device):
            continue
        epi = FULL if i % 2 else Epilogue()
        res = check_plan(v.plan(spec, v.default(spec, cuda.device), cuda.device, epi), cuda, seed=i)
        assert res.ok, f"{name} {spec.short()}{epi.tag()}: {res}"
        ran += 1
    assert ran > 0 or name == "gemm1x1"


TC_GROUPED = {"tc_grouped_half": ("float16", "bfloat16"), "tc_grouped_packed_half": ("float16", "bfloat16"),
              "tc_grouped_tf32": ("float32",),
              "tc_grouped_3xtf32": ("float32",), "dgrad_tc_grouped_half": ("float16", "bfloat16"),
              "dgrad_tc_grouped_3xtf32": ("float32",), "dgrad_tc_grouped_packed_half": ("float16", "bfloat16"),
              "wgrad_tc_grouped_half": ("float16", "bfloat16"),
              "wgrad_tc_grouped_3xtf32": ("float32",), "dgrad_tc_strided_grouped_half": ("float16", "bfloat16")}


@pytest.mark.parametrize("name", sorted(TC_GROUPED))
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_tensor_core_grouped_on_the_suite(cuda, name, layout) -> None:
    """tc_grouped_*, their stride-1 dgrad adapters, the strided grouped dgrad (dgrad_tc_strided_grouped_half)
    and wgrad_tc_grouped_* (named only until this passes and is timed): the default plan on every suite layer
    it takes (the forward and dgrad: groups of whole chunks), N=2, in each dtype and layout, bias + residual +
    ReLU on every other forward, against float64 with the output poisoned; 3xTF32 at the fp32 class's 5e-6."""
    import dataclasses

    v = get_variant(name)
    ran = 0
    for i, base in enumerate(SUITE):
        for dtype in TC_GROUPED[name]:
            spec = dataclasses.replace(base.with_batch(2), dtype=dtype, layout=layout,
                                       conv_pass=name.split("_")[0] if name[:5] in ("dgrad", "wgrad") else "fprop")
            if v.applies(spec, cuda.device):
                continue
            epi = FULL if i % 2 and spec.conv_pass == "fprop" else Epilogue()
            res = check_plan(v.plan(spec, v.default(spec, cuda.device), cuda.device, epi), cuda, seed=i)
            assert res.ok, f"{name} {spec.short()}{epi.tag()}: {res}"
            if "3x" in name:
                assert res.rel_err <= 5e-6, f"not FP32-grade: {spec.short()} {res.rel_err:.2e}"
            ran += 1
    assert ran > 0


@pytest.mark.parametrize("spec", SUITE, ids=lambda s: s.key())
def test_dispatch_choice_at_the_suite_batch(cuda, spec) -> None:
    """What conv2d runs for the layer at its real batch (the first images checked)."""
    from convforge import dispatch

    ch = dispatch.choose(spec, cuda, Epilogue(bias=True))
    if spec.depthwise:
        assert ch.variant.family == "depthwise", ch.variant.name
    plan = ch.variant.plan(spec, ch.params, cuda.device, Epilogue(bias=True))
    res = check_plan(plan, cuda, seed=1, batch_slice=check_slice(spec) or 4)
    assert res.ok, f"{plan.describe()} {spec.short()}: {res}"


@pytest.mark.parametrize("spec", REAL, ids=lambda s: s.key())
def test_depthwise_tuning_space_sample_on_real_layers(cuda, spec) -> None:
    import random

    v = get_variant("depthwise")
    space = v.space(spec, cuda.device)
    for prm in random.Random(spec.c).sample(space, min(6, len(space))):
        res = check_plan(v.plan(spec, prm, cuda.device, Epilogue(bias=True, relu=True)), cuda, seed=2,
                         batch_slice=2)
        assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


@pytest.mark.parametrize("conv_pass", ["dgrad", "wgrad"])
def test_depthwise_backward_on_real_layers(cuda, conv_pass) -> None:
    v = get_variant(f"depthwise_{conv_pass}")
    for spec in REAL:
        spec = spec.with_batch(4).with_pass(conv_pass)
        if v.applies(spec, cuda.device):
            assert spec.stride != (1, 1)
            continue
        for prm in [v.default(spec, cuda.device)] + v.space(spec, cuda.device)[1:3]:
            res = check_plan(v.plan(spec, prm, cuda.device), cuda, seed=3)
            assert res.ok, f"{v.name} [{prm.short()}] {spec.short()}: {res}"


# wgrad_grouped_mma (narrow groups' wgrad on mma.sync from NHWC tiles): the CPU model's odd shapes and
# ResNeXt-50's narrow layers (groups of 4, 8, 16; stride 1 and 2) at N = 4, FP16 and BF16
NARROW_WGRAD = [ConvSpec.make(1, 16, 7, 9, 16, 3, 3, 1, 1, groups=4),
                ConvSpec.make(3, 32, 11, 13, 32, 3, 3, 1, 1, groups=4),
                ConvSpec.make(2, 48, 9, 10, 48, 3, 3, 2, 1, groups=6),
                ConvSpec.make(2, 32, 13, 11, 32, 3, 3, 2, (1, 0, 0, 1), groups=2),
                ConvSpec.make(1, 32, 6, 7, 32, 5, 5, 1, (2, 1, 3, 1), groups=4),
                ConvSpec.make(2, 16, 5, 17, 16, 1, 7, 1, (0, 0, 3, 3), groups=2),
                ConvSpec.make(4, 128, 56, 56, 128, 3, 3, 1, 1, groups=32),
                ConvSpec.make(4, 256, 56, 56, 256, 3, 3, 2, 1, groups=32),
                ConvSpec.make(4, 256, 28, 28, 256, 3, 3, 1, 1, groups=32),
                ConvSpec.make(4, 512, 28, 28, 512, 3, 3, 2, 1, groups=32),
                ConvSpec.make(4, 512, 14, 14, 512, 3, 3, 1, 1, groups=32),
                ConvSpec.make(2, 16, 9, 11, 16, 3, 3, 1, 1, groups=8),  # groups of 2
                ConvSpec.make(3, 48, 9, 7, 48, 3, 3, 2, 1, groups=2),  # of 24
                ConvSpec.make(4, 336, 14, 14, 336, 3, 3, 1, 1, groups=14),  # RegNetY-1.6GF's
                ConvSpec.make(4, 1024, 14, 14, 1024, 3, 3, 2, 1, groups=32),  # of 32
                ConvSpec.make(4, 104, 28, 28, 104, 3, 3, 1, 1, groups=13)]  # RegNetY-400MF's (8 channels a block)


@pytest.mark.parametrize("base", NARROW_WGRAD, ids=lambda b: b.short())
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_grouped_mma_wgrad_against_float64(cuda, dtype, base) -> None:
    """The default and two sampled points of the space, dw and the partials poisoned, against float64."""
    import random

    v = get_variant("wgrad_grouped_mma")
    spec = ConvSpec.make(base.n, base.c, base.h, base.w, base.k, base.r, base.s, base.stride, base.pad,
                         groups=base.groups, dtype=dtype, layout="nhwc").with_pass("wgrad")
    assert v.applies(spec, cuda.device) is None, (spec.short(), v.applies(spec, cuda.device))
    space = v.space(spec, cuda.device)
    for i, prm in enumerate(space[:1] + random.Random(spec.c).sample(space[1:], min(2, len(space) - 1))):
        res = check_plan(v.plan(spec, prm, cuda.device), cuda, seed=i)
        assert res.ok, f"{v.name} [{prm.short()}] {spec.short()}: {res}"


# -- conv2d(groups=) with device arrays ---------------------------------------------------------
CALLS = [ConvSpec.make(2, 32, 28, 28, 32, 3, 3, 1, 1, groups=32),
         ConvSpec.make(2, 16, 15, 13, 32, 5, 5, 2, 2, groups=16),
         ConvSpec.make(2, 64, 14, 14, 64, 3, 3, 1, 1, groups=8),
         ConvSpec.make(2, 48, 9, 9, 24, 1, 1, groups=4)]


def test_cupy_grouped_warm_calls_stay_in_c(cuda, monkeypatch) -> None:
    cp = pytest.importorskip("cupy", reason="GPU tier of the CuPy path: CuPy not installed")
    import convforge
    from convforge import api
    from convforge.backends import native
    from convforge.config import config

    mod = native.load_cupy() if config.native else None
    rng = np.random.default_rng(0)
    cases = []
    for spec in CALLS:
        x, w, b = (cp.asarray(rng.standard_normal(s, dtype=np.float32))
                   for s in (spec.x_shape, spec.w_shape, (spec.k,)))
        y = convforge.conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, groups=spec.groups)
        want = conv2d_ref(cp.asnumpy(x), cp.asnumpy(w), spec, cp.asnumpy(b))
        assert rel_l2(cp.asnumpy(y), want) < 1e-5, spec.short()
        cases.append((spec, x, w, b, want))
    with pytest.raises(ValueError, match="a grouped layer needs groups="):
        convforge.conv2d(cases[0][1], cases[0][2], cases[0][3], 1, 1)  # groups left at 1: refused, never run
    if mod is None:
        pytest.skip("native fast path off: the warm-call part needs it")
    runs = mod.stats()["runs"]
    monkeypatch.setattr(api, "_KEYERS", {})
    monkeypatch.setattr(api, "_conv2d", lambda *a, **k: (_ for _ in ()).throw(AssertionError("reached Python")))
    for spec, x, w, b, want in cases:
        y = convforge.conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, groups=spec.groups)
        assert rel_l2(cp.asnumpy(y), want) < 1e-5, spec.short()
    assert mod.stats()["runs"] == runs + len(cases)


@pytest.fixture
def torch_gpu(gpu):  # type: ignore[no-untyped-def]
    import torch

    return torch


def test_torch_grouped_warm_calls_and_the_op(torch_gpu, monkeypatch) -> None:
    torch = torch_gpu
    import convforge
    from convforge import api
    from convforge.config import config
    from convforge.torch import conv2d as op_conv2d
    from convforge.torch import native

    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for spec in CALLS:
        x, w, b = (torch.randn(s, device="cuda", generator=g) for s in (spec.x_shape, spec.w_shape, (spec.k,)))
        want = conv2d_ref(x.cpu().numpy(), w.cpu().numpy(), spec, b.cpu().numpy())
        with torch.no_grad():
            for _ in range(2):
                y = convforge.conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, groups=spec.groups)
                assert rel_l2(y.cpu().numpy(), want) < 1e-5, spec.short()
                y = op_conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, groups=spec.groups)
                assert rel_l2(y.cpu().numpy(), want) < 1e-5, ("op", spec.short())
        cases.append((spec, x, w, b, want))
    with pytest.raises(ValueError, match="a grouped layer needs groups="):
        convforge.conv2d(cases[0][1], cases[0][2], cases[0][3], 1, 1)
    mod = native.load() if config.native else None
    if mod is None:
        pytest.skip("native fast path off: the warm-call part needs it")
    fallbacks = mod.stats()["op_fallbacks"]
    monkeypatch.setattr(api, "_KEYERS", {})
    monkeypatch.setattr(api, "_conv2d", lambda *a, **k: (_ for _ in ()).throw(AssertionError("reached Python")))
    with torch.no_grad():
        for spec, x, w, b, want in cases:
            y = convforge.conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, groups=spec.groups)
            assert rel_l2(y.cpu().numpy(), want) < 1e-5
            y = op_conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, groups=spec.groups)
            assert rel_l2(y.cpu().numpy(), want) < 1e-5
    assert mod.stats()["op_fallbacks"] == fallbacks


def test_grouped_op_gradients_match_pytorch(torch_gpu) -> None:
    torch = torch_gpu
    import torch.nn.functional as F

    from convforge.torch import conv2d as op_conv2d

    for spec in CALLS[:3]:
        g = torch.Generator(device="cuda").manual_seed(spec.c)
        x, w, b = (torch.randn(s, device="cuda", generator=g, requires_grad=True)
                   for s in (spec.x_shape, spec.w_shape, (spec.k,)))
        y = op_conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, groups=spec.groups)
        gy = torch.randn_like(y)
        got = torch.autograd.grad(y, (x, w, b), gy)
        xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
        yd = F.conv2d(xd, wd, bd, spec.stride, (spec.pad[0], spec.pad[2]), spec.dilation, spec.groups)
        want = torch.autograd.grad(yd, (xd, wd, bd), gy.double())
        assert rel_l2(y.detach().cpu().numpy(), yd.detach().cpu().numpy()) < 1e-5
        for a, e in zip(got, want):
            assert rel_l2(a.cpu().numpy(), e.cpu().numpy()) < 1e-5, spec.short()


def _nhwc(spec: ConvSpec) -> ConvSpec:
    return ConvSpec.make(*spec.x_shape, spec.k, spec.r, spec.s, spec.stride, spec.pad, spec.dilation,
                         spec.groups, layout="nhwc")


@pytest.mark.parametrize("spec", REAL, ids=lambda s: s.key())
def test_depthwise_nhwc_on_real_layers(cuda, spec) -> None:
    """depthwise_nhwc's default and two sampled points on MobileNet-v2 and ConvNeXt-T layers in
    NHWC memory (a slice of the batch checked), bias + residual + ReLU on one of them."""
    from helpers import sample

    v, s = get_variant("depthwise_nhwc"), _nhwc(spec.with_batch(4))
    for i, prm in enumerate(sample(v, s, cuda.device, k=2, seed=spec.c)):
        res = check_plan(v.plan(s, prm, cuda.device, FULL if i == 1 else Epilogue()), cuda, seed=i)
        assert res.ok, f"{prm.short()} {s.short()}: {res}"


def test_channels_last_depthwise_reads_in_place(torch_gpu) -> None:
    """conv2d and a converted Conv2d on a channels_last input of a depthwise layer: depthwise_nhwc,
    a channels_last output, float64-exact to fp32; a later NCHW call of the same shape and a
    strided view of it are not confused with it (the fast-path keys tell them apart)."""
    torch = torch_gpu
    import convforge
    import convforge.torch as ct

    spec = REAL[2].with_batch(2)
    g = torch.Generator(device="cuda").manual_seed(3)
    x, w, b = (torch.randn(s, device="cuda", generator=g) for s in (spec.x_shape, spec.w_shape, (spec.k,)))
    want = conv2d_ref(x.cpu().numpy(), w.cpu().numpy(), spec, b.cpu().numpy())
    xc = x.to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(spec.c, spec.k, spec.r, padding=3, groups=spec.groups).cuda()
    with torch.no_grad():
        conv.weight.copy_(w)
        conv.bias.copy_(b)
    conv = ct.Conv2d.from_module(conv)
    with torch.no_grad():
        for _ in range(2):
            for inp in (xc, x, xc[:, :, :, :]):
                y = convforge.conv2d(inp, w, b, 1, 3, groups=spec.groups)
                assert rel_l2(y.cpu().numpy(), want) < 1e-6
                assert y.is_contiguous(memory_format=torch.channels_last) == (inp is not x)
                ym = conv(inp)
                assert rel_l2(ym.cpu().numpy(), want) < 1e-6
                assert ym.is_contiguous(memory_format=torch.channels_last) == (inp is not x)
        with pytest.raises(ValueError, match="unsupported layout"):
            convforge.conv2d(x.transpose(2, 3), w, b, 1, 3, groups=spec.groups)


@pytest.mark.parametrize("autocast", [False, True])
def test_converted_depthwise_warm_calls_stay_in_c(torch_gpu, monkeypatch, autocast) -> None:
    """A converted Conv2d whose plan has no filter step (depthwise, channels_last; FP32 and under FP16
    autocast) is filed with the native fast path on its first call: warm calls never reach the Python
    runner (made to fail), and stay right."""
    torch = torch_gpu
    import convforge.torch as ct
    from convforge.config import config
    from convforge.torch import modules, native

    if not config.native or native.load() is None:
        pytest.skip("native fast path off: nothing to check")
    spec = REAL[2].with_batch(2)
    g = torch.Generator(device="cuda").manual_seed(5)
    x, w, b = (torch.randn(s, device="cuda", generator=g) for s in (spec.x_shape, spec.w_shape, (spec.k,)))
    conv = torch.nn.Conv2d(spec.c, spec.k, spec.r, padding=3, groups=spec.groups).cuda()
    with torch.no_grad():
        conv.weight.copy_(w)
        conv.bias.copy_(b)
    conv = ct.Conv2d.from_module(conv)
    xc = x.to(memory_format=torch.channels_last)
    dt = torch.float16 if autocast else torch.float32
    cast = (lambda t: t.to(dt).double()) if autocast else (lambda t: t)
    want = conv2d_ref(cast(x).cpu().numpy(), cast(w).cpu().numpy(), spec, cast(b).cpu().numpy())
    tol = 2e-3 if autocast else 1e-6

    def call() -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cuda", torch.float16, enabled=autocast):
            return conv(xc)
    assert rel_l2(call().float().cpu().numpy(), want) < tol  # files the plan
    monkeypatch.setattr(modules.Conv2d, "_prepared", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("a warm call reached the Python runner")))
    for _ in range(2):
        y = call()
        assert y.dtype == dt and rel_l2(y.float().cpu().numpy(), want) < tol



# -- torchvision models -------------------------------------------------------------------------
@pytest.fixture
def vision(torch_gpu):  # type: ignore[no-untyped-def]
    pytest.importorskip("torchvision", reason="GPU tier of converted models: torchvision not installed")
    return torch_gpu


@pytest.mark.parametrize("name", ["mobilenet_v2", "resnext50_32x4d", "convnext_tiny"])
@pytest.mark.parametrize("how", ["convert", "fuse"])
def test_converted_model_runs_every_conv(vision, name, how) -> None:
    """Every conv of the model runs convforge (none left to PyTorch, no layer falling back), and the
    output is within fp32-class accuracy of a float64 run of the same weights (PyTorch FP32's error
    printed beside it)."""
    torch = vision
    import convforge.torch as ct
    from convforge.apps.bench import models
    from convforge.torch import ops

    model = models.build(name)
    assert not isinstance(model, str), model
    from convforge.apps.bench.baselines import torch_flags

    x = torch.randn(2, 3, 224, 224, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad(), torch_flags() as set_flags:
        set_flags(tf32=False)  # PyTorch FP32 for the printed baseline error (its other ops too)
        ref = copy.deepcopy(model).double()(x.double())
        theirs = model(x)
        if how == "convert":
            ours_model = copy.deepcopy(model)
            report = ct.convert(ours_model)
        else:
            ours_model, report = ct.fuse(model)
        fell_back = set(ops._FELL_BACK)
        out = ours_model(x)
        out = ours_model(x)  # warm: the native path where it is built
    convs = [m for m in ours_model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert report.left == {}, report.left
    assert convs and all(isinstance(m, ct.Conv2d) for m in convs)
    assert any(m.groups > 1 for m in convs)
    assert ops._FELL_BACK == fell_back, ops._FELL_BACK - fell_back
    for m in convs:  # each layer's runner exists (None: no convforge variant ran it)
        assert all(v is not None for k, v in m._cf_cache.items() if k != ("fold",)), m
    err, base = (rel_l2(t.double().cpu().numpy(), ref.cpu().numpy()) for t in (out, theirs))
    print(f"{name} {how}: convforge {err:.2e}, PyTorch FP32 {base:.2e}")
    assert err < 2e-5, (name, how, err, base)
