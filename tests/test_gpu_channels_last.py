"""GPU tier of channels-last mixed-precision training (skips without a CUDA device; torch parts also
without torch): the NHWC plans of every pass against float64 on odd layers, ``convforge.grad`` on
channels_last torch tensors in every dtype, and whole AMP steps (FP16 / BF16 autocast, channels_last,
GradScaler) of a converted model: gradients against float64 beside PyTorch AMP's own error, a
profile that names any cuDNN convolution, ``aten::convolution_backward`` or layout conversion that
still runs, and an overflowing scaled loss that must make the GradScaler skip the step as it does
for PyTorch's model.

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_channels_last.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest

from convforge.check import check_plan
from convforge.dtypes import HALF_TOLERANCE
from convforge.kernels import get_variant
from convforge.reference import dgrad_ref, rel_l2, wgrad_ref
from convforge.spec import ConvSpec

pytestmark = pytest.mark.gpu

# odd layers of each pass: N = 1, 3-channel stems, channels that are not whole 16-byte chunks, stride 2
# on sizes it does not divide, asymmetric padding, 1x1 / 2, dilation 2
LAYERS = [ConvSpec.make(1, 16, 14, 14, 24, 3, 3, 1, 1), ConvSpec.make(2, 24, 13, 17, 40, 3, 3, 2, (1, 0, 1, 2)),
          ConvSpec.make(3, 64, 15, 15, 128, 1, 1, 2), ConvSpec.make(2, 3, 31, 29, 16, 7, 7, 2, 3),
          ConvSpec.make(2, 13, 11, 11, 20, 3, 3, 1, 2, 2), ConvSpec.make(4, 64, 7, 7, 64, 1, 1)]
HALF_PASSES = ["dgrad_tc_implicit_gemm_half", "dgrad_tc_strided_half", "dgrad_sub_tc_implicit_gemm_half",
               "wgrad_tc_implicit_gemm_half"]
FLOAT_PASSES = ["dgrad_tc_implicit_gemm_3xtf32", "dgrad_tc_strided_3xtf32", "wgrad_tc_implicit_gemm_3xtf32",
                "dgrad_tc_implicit_gemm_tf32", "wgrad_tc_implicit_gemm_tf32"]


@pytest.mark.parametrize("name", HALF_PASSES + FLOAT_PASSES)
def test_nhwc_training_plans_against_float64(cuda, name):
    """Each NHWC pass plan on every layer it applies to, outputs NaN-poisoned, against float64 of the
    same inputs (check_plan lays the activations out channels-last)."""
    v = get_variant(name)
    conv_pass = "wgrad" if name.startswith("wgrad") else "dgrad"
    ran = 0
    for i, base in enumerate(LAYERS):
        for dtype in sorted(v.dtypes):
            spec = dataclasses.replace(base, dtype=dtype, conv_pass=conv_pass, layout="nhwc")
            if v.applies(spec, cuda.device):
                continue
            first = v.default(spec, cuda.device)
            # strided dgrad: the direct stores on dx's sub-grid (the NHWC default) and the phase buffers
            for prm in [first] + ([first.replace(il=1 - int(first["il"]))] if "il" in first else []):
                res = check_plan(v.plan(spec, prm, cuda.device), cuda, seed=i)
                assert res.ok, f"{name} [{prm.short()}] {spec.short()}: {res}"
            ran += 1
    assert ran, f"{name} applied to none of the layers"


# -- convforge.grad on channels_last torch tensors ---------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_grad_keeps_channels_last(gpu, dtype):
    """dgrad and wgrad of channels_last torch tensors: dx comes back channels_last, both within the
    dtype's tolerance of float64 (float32: the fp32 class's 5e-6), no NCHW copy on the way."""
    import torch

    import convforge.grad

    tdt = getattr(torch, dtype)
    tol = HALF_TOLERANCE.get(dtype, 5e-6)
    cl = torch.channels_last
    for i, spec in enumerate(LAYERS):
        g = torch.Generator(device="cuda").manual_seed(i)
        x, w, dy = (torch.randn(s, device="cuda", generator=g).to(tdt) for s in (spec.x_shape, spec.w_shape,
                                                                               spec.y_shape))
        x, dy = x.contiguous(memory_format=cl), dy.contiguous(memory_format=cl)
        kw = dict(stride=spec.stride, padding=spec.pad, dilation=spec.dilation)
        torch.full(spec.x_shape, float("nan"), device="cuda", dtype=tdt)  # poison the block dx lands in
        dx = convforge.grad.conv2d_input(spec.x_shape, w, dy, **kw)
        dw = convforge.grad.conv2d_weight(x, spec.w_shape, dy, **kw)
        assert dx.dtype == tdt and dw.dtype == tdt
        assert dx.is_contiguous(memory_format=cl) or spec.c == 1, spec.short()
        f64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
        want_dx = dgrad_ref(f64(dy), f64(w), dataclasses.replace(spec, conv_pass="dgrad"))
        want_dw = wgrad_ref(f64(x), f64(dy), dataclasses.replace(spec, conv_pass="wgrad"))
        assert rel_l2(f64(dx), want_dx) < tol, (spec.short(), rel_l2(f64(dx), want_dx))
        assert rel_l2(f64(dw), want_dw) < tol * (2 if dtype != "float32" else 1), (spec.short(),
                                                                                  rel_l2(f64(dw), want_dw))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_squeeze_excitation_convs_read_pooled_images_in_place(gpu, dtype):
    """A squeeze-excitation block's convs (1x1 on N x C x 1 x 1: 96 -> 8 -> 96, with bias) through the
    training op: NCHW and NHWC are one memory there, so NHWC plans read it in place (no layout step in
    the profile of forward + backward; float32's wgrad transposes for TF32's K-major operands in every
    layout), output, dx, dW and db within the dtype's tolerance of float64."""
    import torch

    import convforge.torch as ct

    tdt = getattr(torch, dtype)
    tol = HALF_TOLERANCE.get(dtype, 5e-6)
    g = torch.Generator(device="cuda").manual_seed(5)
    convs = [ct.Conv2d(96, 8, 1).cuda().to(tdt), ct.Conv2d(8, 96, 1).cuda().to(tdt)]
    x = torch.randn(64, 96, 1, 1, device="cuda", generator=g).to(tdt).requires_grad_()
    ref = [torch.nn.Conv2d(96, 8, 1).cuda().double(), torch.nn.Conv2d(8, 96, 1).cuda().double()]
    for mine, r in zip(convs, ref):
        r.load_state_dict({k: v.double() for k, v in mine.state_dict().items()})
    xr = x.detach().double().requires_grad_()
    gz = torch.randn(64, 96, 1, 1, device="cuda", generator=g).to(tdt)
    for _ in range(2):  # the second call: warm, as a training step runs
        x.grad = None
        for m in convs:
            m.zero_grad()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            z = convs[1](torch.nn.functional.silu(convs[0](x)))
            z.backward(gz)
            torch.cuda.synchronize()
    zr = ref[1](torch.nn.functional.silu(ref[0](xr)))
    zr.backward(gz.double())
    names = [e.key for e in prof.key_averages()]
    layout_steps = r"tc_x_nhwc|nchwToNhwc|nhwcToNchw"  # NCHW plans' activation steps
    if dtype != "float32":  # the half wgrad reads NHWC as it lies; TF32's wants K-major operands in any layout
        layout_steps += r"|wgrad_tc_implicit_gemm_\w+_(x|dy)$"
    assert not [k for k in names if re.search(layout_steps, k)], names
    pairs = [(z, zr), (x.grad, xr.grad)] + [(getattr(m, n).grad, getattr(r, n).grad) for m, r in zip(convs, ref)
                                            for n in ("weight", "bias")]
    for mine, want in pairs:
        err = rel_l2(mine.detach().double().cpu().numpy(), want.detach().cpu().numpy())
        assert err < tol * 2, err


# -- whole AMP steps ----------------------------------------------------------------------------------
def _block_model():
    """A small residual network with every layer kind of a ResNet step: a 7x7/2 stem, 3x3 convs, a
    strided 3x3 and a 1x1/2 shortcut, batch norm, ReLU, pooling, a classifier."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else None)

        def forward(self, x):
            y = self.b2(self.c2(self.b1(self.c1(x)).relu()))
            return (y + (x if self.down is None else self.down(x))).relu()

    return nn.Sequential(nn.Conv2d(3, 32, 7, 2, 3, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1), Block(32, 32, 1), Block(32, 64, 2), Block(64, 128, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


def _step(model, x, t, dtype, scaler):
    import torch

    with torch.autocast("cuda", dtype=dtype):
        loss = torch.nn.functional.cross_entropy(model(x), t)
    scaler.scale(loss).backward()
    return loss


# cuDNN's convolution kernels and layout conversions (not cuBLAS's xmma GEMMs of the classifier)
_CUDNN_CONV = re.compile(r"xmma_(fprop|dgrad|wgrad)|cudnn|implicit_convolve|convolve_sgemm|conv2d_grouped|"
                         r"nchwToNhwc|nhwcToNchw|aten::convolution_backward|aten::_convolution")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("how", ["convert", "fuse"])
def test_amp_step_runs_on_our_kernels(gpu, dtype, how, caplog):
    """One AMP step (autocast + GradScaler, model and input channels_last) of the converted / fused
    model: every conv gradient within 2x PyTorch AMP's error against a float64 run of the same step
    (and below the dtype's bound), and the step's profile has no cuDNN convolution kernel, no
    ``aten::convolution_backward`` / ``aten::cudnn_convolution`` and no layout conversion kernel; the
    fused model's batch norm is ours too (convert() keeps PyTorch's modules)."""
    import logging

    import torch

    import convforge.torch as ct

    caplog.set_level(logging.WARNING, logger="convforge")
    torch.manual_seed(0)
    tdt = getattr(torch, dtype)
    cl = torch.channels_last
    base = _block_model().cuda().to(memory_format=cl)
    x = torch.randn(8, 3, 64, 64, device="cuda").contiguous(memory_format=cl)
    t = torch.randint(0, 10, (8,), device="cuda")
    ref = copy.deepcopy(base).double()
    torch.nn.functional.cross_entropy(ref(x.double()), t).backward()
    theirs, src = copy.deepcopy(base), copy.deepcopy(base)  # the converted / fused model shares src's parameters
    ours = ct.fuse(src)[0] if how == "fuse" else (ct.convert(src), src)[1]
    for m in (theirs, ours):
        _step(m, x, t, tdt, torch.amp.GradScaler("cuda", enabled=dtype == "float16", init_scale=1.0))
    torch.cuda.synchronize()
    names = [n for n, p in base.named_parameters() if p.dim() == 4]
    r, a, b = (dict(m.named_parameters()) for m in (ref, theirs, src))
    for n in names:
        want = r[n].grad.double().cpu().numpy()
        err_theirs = rel_l2(a[n].grad.double().cpu().numpy(), want)
        assert b[n].grad is not None, f"{n}: no gradient in the {how}ed model"
        err_ours = rel_l2(b[n].grad.double().cpu().numpy(), want)
        assert err_ours <= max(2 * err_theirs, HALF_TOLERANCE[dtype]), (n, err_ours, err_theirs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        _step(ours, x, t, tdt, torch.amp.GradScaler("cuda", enabled=dtype == "float16"))
        torch.cuda.synchronize()
    events = {e.key for e in prof.key_averages()}
    bn = re.compile(r"batch_?norm|bn_fw|bn_bw")  # convert() keeps PyTorch's batch norm by design
    bad = sorted(e for e in events if _CUDNN_CONV.search(e) and not (how == "convert" and bn.search(e)))
    assert not bad, f"{how}: PyTorch / cuDNN convolution or layout kernels in the AMP step: {bad}"
    copies = [r.getMessage() for r in caplog.records if "between layout copies" in r.getMessage()]
    assert not copies, copies  # every layer on NHWC plans, none between NCHW copies
    fell = [r.getMessage() for r in caplog.records if "PyTorch" in r.getMessage() and r.name == "convforge"]
    assert not fell, fell


def test_grad_scaler_skips_an_overflowing_step_as_pytorch_does(gpu):
    """A loss scaled past FP16's range: Inf / NaN reach every gradient through our backward kernels, the
    GradScaler finds them, skips the optimizer step (parameters unchanged) and halves its scale, as it
    does for PyTorch's own model; the next step with a sane scale updates."""
    import torch

    import convforge.torch as ct

    torch.manual_seed(1)
    cl = torch.channels_last
    base = _block_model().cuda().to(memory_format=cl)
    x = torch.randn(4, 3, 32, 32, device="cuda").contiguous(memory_format=cl) * 1e3
    t = torch.randint(0, 10, (4,), device="cuda")
    mine = copy.deepcopy(base)
    ct.convert(mine)
    for which, model in (("PyTorch's", copy.deepcopy(base)), ("the converted", mine)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 60)
        before = [p.detach().clone() for p in model.parameters()]
        _step(model, x, t, torch.float16, scaler)
        scaler.step(opt)
        scaler.update()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        assert not finite, f"{which} model: every gradient finite under a loss scaled to overflow"
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), \
            f"{which} model: step not skipped"
        assert scaler.get_scale() == 2.0 ** 59
        opt.zero_grad()
        scaler = torch.amp.GradScaler("cuda", init_scale=1.0)
        _step(model, x / 1e3, t, torch.float16, scaler)
        scaler.step(opt)
        scaler.update()
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), which


def test_resnet50_fused_amp_step_profile(gpu, monkeypatch):
    """Issue 58's check: one fused AMP step of ResNet-50 (channels_last, FP16 autocast, GradScaler)
    runs no cuDNN convolution or batch-norm kernel, no ``aten::convolution_backward`` and no NCHW <->
    NHWC conversion; the offending kernels are named when it fails. Eager (training graphs off), then a step
    replayed from the training graphs (torch/graphs.py), whose kernels the capture took from the same code."""
    import torch

    torchvision = pytest.importorskip("torchvision", reason="ResNet-50 profile: torchvision not installed")
    import convforge.torch as ct
    from convforge.config import config
    from convforge.torch import graphs

    cl = torch.channels_last
    model = torchvision.models.resnet50().cuda().to(memory_format=cl)
    fused = ct.fuse(model)[0]
    x = torch.randn(8, 3, 224, 224, device="cuda").contiguous(memory_format=cl)
    t = torch.randint(0, 1000, (8,), device="cuda")
    bn = re.compile(r"batch_norm|bn_fw|bn_bw|cudnn_batch_norm")
    for replayed in (False, True):
        monkeypatch.setattr(config, "train_graphs", replayed)
        for _ in range(3 if replayed else 2):  # compile and file (and capture) outside the profile
            _step(fused, x, t, torch.float16, torch.amp.GradScaler("cuda"))
        torch.cuda.synchronize()
        assert list(graphs.status(fused).values()) == (["captured"] if replayed else [])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            _step(fused, x, t, torch.float16, torch.amp.GradScaler("cuda"))
            torch.cuda.synchronize()
        events = {e.key for e in prof.key_averages()}
        bad = sorted(e for e in events if _CUDNN_CONV.search(e) or bn.search(e))
        assert not bad, f"PyTorch / cuDNN kernels left in the fused AMP step (replayed: {replayed}): {bad}"
        if replayed and not any("bn_train" in e or "implicit_gemm" in e for e in events):
            pytest.skip("the profiler named no kernel inside the replayed CUDA graphs (the eager step was checked)")


def test_slow_half_layers_are_handed_to_pytorch_and_reported(gpu, caplog):
    """Issue 59's "no silent fallback": under autocast a pass of a grouped layer no tensor-core or
    memory-bound variant serves goes to PyTorch (logged once, listed in the report, the result PyTorch's
    own): the filter gradient of a 7x7 layer of groups of 8 channels (wgrad_tc_grouped_half's ``slow_on``;
    wgrad_grouped_mma takes 3x3 and 5x5 groups of 4 to 16). Its forward (the packed grouped GEMM) and dgrad,
    the depthwise and the dense layers stay ours."""
    import logging

    import torch

    import convforge.torch as ct

    caplog.set_level(logging.WARNING, logger="convforge")
    cl = torch.channels_last
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 7, 1, 3, groups=8, bias=False),
                                torch.nn.Conv2d(64, 64, 3, 1, 1, groups=64, bias=False),
                                torch.nn.Conv2d(64, 32, 1, bias=False)).cuda().to(memory_format=cl)
    ref = copy.deepcopy(model)
    report = ct.convert(model)
    x = torch.randn(16, 64, 29, 29, device="cuda").contiguous(memory_format=cl)  # past ops.HAND_BACK_FLOPS
    with torch.autocast("cuda", dtype=torch.float16):
        got, want = model(x), ref(x)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    got.float().square().mean().backward()
    want.float().square().mean().backward()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        err = float((a.grad.double() - b.grad.double()).norm() / b.grad.double().norm())
        assert err < 1e-2, err
    mine = {k: v for k, v in report.handed_back.items() if "C64 29x29" in k}
    assert [k.split()[0] for k in mine] == ["wgrad"] and " 7x7 " in next(iter(mine)), mine
    assert "handed to PyTorch at run time" in str(report)
