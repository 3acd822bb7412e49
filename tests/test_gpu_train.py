"""GPU tier of training (skips without a CUDA device or torch): convforge.grad on torch tensors and
CuPy arrays, the op's backward through our kernels (Conv2d and FusedConv2d in training mode against
PyTorch's float64 gradients), torch.compile and CUDA-graph capture of a whole training step, a
small model's 50-step loss curve beside PyTorch's, and the per-pass cuDNN baselines of ``bench``.

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_train.py``. Outputs the API allocates are
taken from a caching-allocator block poisoned with NaN first, so a kernel that skips an element fails.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from convforge.reference import bias_grad_ref, dgrad_ref, rel_l2, wgrad_ref
from convforge.spec import ConvSpec

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of training: torch not installed")
F = torch.nn.functional

# odd shapes: stride 2 on sizes it does not divide, asymmetric padding, dilation, 1x1, 11x11/4, groups
SPECS = [ConvSpec.make(2, 3, 13, 17, 5, 3, 3, (1, 2), (1, 0, 2, 1)), ConvSpec.make(1, 16, 14, 14, 24, 3, 3, 1, 1),
         ConvSpec.make(3, 7, 9, 9, 5, 1, 1), ConvSpec.make(2, 8, 15, 13, 16, 3, 3, 2, 1),
         ConvSpec.make(1, 3, 27, 29, 4, 11, 11, 4, (2, 1, 0, 3)), ConvSpec.make(2, 5, 17, 19, 7, 5, 5, 1, 2, 2),
         ConvSpec.make(2, 8, 11, 11, 12, 3, 3, 2, 1, groups=4)]
FP32 = 5e-6  # the fp32 class's bound (or 2x the most accurate's where even that is above: PyTorch's here)


def _poison(shape):
    """Leave a NaN-filled block of this size in torch's cache, where the next output lands."""
    t = torch.full(shape, float("nan"), device="cuda")
    del t


def _np(t):
    return t.detach().cpu().numpy()


def _data(spec, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(s, device="cuda", generator=g) for s in (spec.x_shape, spec.w_shape, spec.y_shape))


def _args(spec):
    return dict(stride=spec.stride, padding=spec.pad, dilation=spec.dilation, groups=spec.groups)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_grad_api_on_torch_tensors_matches_float64(gpu, spec):
    from convforge import dispatch, grad

    x, w, dy = _data(spec)
    for i in range(3):  # the first call builds the runner, the others hit it
        scale = 1.0 + i
        _poison(spec.x_shape)
        dx = grad.conv2d_input(spec.x_shape, w, dy * scale, **_args(spec))
        _poison(spec.w_shape)
        dw = grad.conv2d_weight(x, spec.w_shape, dy * scale, **_args(spec))
        _poison((spec.k,))
        db = grad.conv2d_bias(dy * scale)
        assert isinstance(dx, torch.Tensor) and dx.device == x.device and tuple(dx.shape) == spec.x_shape
        dyn = _np(dy) * scale
        assert rel_l2(_np(dx), dgrad_ref(dyn, _np(w), spec.with_pass("dgrad"))) < 1e-5, i
        assert rel_l2(_np(dw), wgrad_ref(_np(x), dyn, spec.with_pass("wgrad"))) < 1e-5, i
        assert rel_l2(_np(db), bias_grad_ref(dyn)) < 1e-5, i
        if i == 0:
            n = len(dispatch.RUNNERS)
    assert len(dispatch.RUNNERS) == n  # warm calls: dictionary hits


def test_grad_api_on_cupy_arrays_and_misaligned_views(gpu):
    import cupy as cp

    from convforge import grad

    spec = SPECS[3]
    x, w, dy = _data(spec)
    dys = torch.empty(dy.numel() + 1, device="cuda")[1:].view(spec.y_shape)  # 4 bytes off alignment
    dys.copy_(dy)
    want_dx = dgrad_ref(_np(dy), _np(w), spec.with_pass("dgrad"))
    want_dw = wgrad_ref(_np(x), _np(dy), spec.with_pass("wgrad"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), cp.cuda.ExternalStream(stream.cuda_stream):
        for g in (dy, dys):
            dx = grad.conv2d_input(spec.x_shape, cp.asarray(w), cp.asarray(g), **_args(spec))
            dw = grad.conv2d_weight(cp.asarray(x), spec.w_shape, cp.asarray(g), **_args(spec))
            db = grad.conv2d_bias(cp.asarray(g))
            assert isinstance(dx, cp.ndarray) and isinstance(dw, cp.ndarray) and isinstance(db, cp.ndarray)
            stream.synchronize()
            assert rel_l2(cp.asnumpy(dx), want_dx) < 1e-5 and rel_l2(cp.asnumpy(dw), want_dw) < 1e-5
            assert rel_l2(cp.asnumpy(db), bias_grad_ref(_np(dy))) < 1e-5
            torch_dx = grad.conv2d_input(spec.x_shape, w, g, **_args(spec))
            stream.synchronize()
            assert rel_l2(_np(torch_dx), want_dx) < 1e-5


def test_dgrad_filter_transforms_are_cached_per_weight_version(gpu, monkeypatch):
    """A dgrad plan with a filter-only step (a forward family serving dgrad through the rotated
    filter) transforms once per weight version with torch tensors."""
    from convforge import grad, kernels
    from convforge.backends.base import weight_steps
    from convforge.frontends import torch_run

    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1, conv_pass="dgrad")
    with_steps = [v for v in kernels.all_variants() if v.applies(spec, gpu.device) is None
                  and weight_steps(v.plan(spec, v.default(spec, gpu.device), gpu.device))[0]]
    if not with_steps:
        pytest.skip("no dgrad variant with a filter transform on this tree (the rotated-filter dgrad families)")
    calls = []
    real = torch_run.torch_transform
    monkeypatch.setattr(torch_run, "torch_transform", lambda exe, w, out=None: calls.append(1) or real(exe, w, out))
    x, w, dy = _data(spec)
    for v in with_steps:
        calls.clear()
        for _ in range(3):
            dx = grad.conv2d_input(spec.x_shape, w, dy, padding=1, algo=v.name)
        assert len(calls) == 1, v.name
        with torch.no_grad():
            w.mul_(-2.0)
        dx = grad.conv2d_input(spec.x_shape, w, dy, padding=1, algo=v.name)
        assert len(calls) == 2, v.name
        assert rel_l2(_np(dx), dgrad_ref(_np(dy), _np(w), spec)) < v.tolerance, v.name


def _count_ours(monkeypatch):
    """Count the calls of convforge.grad's three functions (what the op's backward kernels call)."""
    from convforge import grad

    return _count_calls(monkeypatch, grad, {"conv2d_input": "dgrad", "conv2d_weight": "wgrad", "conv2d_bias": "bias"})


def _count_calls(monkeypatch, module, names: dict[str, str]) -> dict[str, int]:
    """Count the calls of ``module``'s functions ``names`` (name -> tag), by tag."""
    seen = dict.fromkeys(names.values(), 0)
    for name, tag in names.items():
        real = getattr(module, name)

        def counted(*a, _real=real, _tag=tag, **k):
            seen[_tag] += 1
            return _real(*a, **k)

        monkeypatch.setattr(module, name, counted)
    return seen


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("spec", SPECS[:6], ids=lambda s: s.key())
def test_op_gradients_match_float64_within_the_class(gpu, spec, monkeypatch):
    """The convforge::conv2d op's gradients (what Conv2d trains with): x, w and bias from our
    kernels, against PyTorch's float64 gradients, within the fp32 class (5e-6, or 2x PyTorch FP32's
    own error where that is larger); asymmetric padding as PyTorch computes it on the padded input."""
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    seen = _count_ours(monkeypatch)
    x, w, gy = _data(spec, seed=1)
    b = torch.randn(spec.k, device="cuda")
    t, bo, le, ri = spec.pad

    def grads(dtype, ours):
        xs, ws, bs = (v.to(dtype).requires_grad_() for v in (x, w, b))
        if ours:
            y = ct.conv2d(xs, ws, bs, spec.stride, spec.pad, spec.dilation)
        else:
            y = F.conv2d(F.pad(xs, (le, ri, t, bo)), ws, bs, spec.stride, 0, spec.dilation)
        return torch.autograd.grad(y, (xs, ws, bs), gy.to(dtype))

    got, theirs, want = grads(torch.float32, True), grads(torch.float32, False), grads(torch.float64, False)
    assert seen == {"dgrad": 1, "wgrad": 1, "bias": 1}, seen
    for g, w32, w64, what in zip(got, theirs, want, "xwb"):
        bound = max(FP32, 2 * _rel(w32, w64))
        assert _rel(g, w64) <= bound, (what, _rel(g, w64), _rel(w32, w64))


def test_conv2d_module_trains_through_our_kernels(gpu, monkeypatch):
    """Conv2d in training mode (stride 2, 'same' padding, no bias) calls our backward for every
    layer and gives PyTorch FP32's gradients."""
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    seen = _count_ours(monkeypatch)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 16, 3, stride=2, bias=False), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 8, (2, 3), padding="same"), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(8, 4)).cuda()
    ours = copy.deepcopy(ref)
    assert len(ct.convert(ours).converted) == 3
    x = torch.randn(8, 3, 17, 17, device="cuda", requires_grad=True)
    target = torch.randint(0, 4, (8,), device="cuda")
    F.cross_entropy(ours(x), target).backward()
    gx = x.grad.clone()
    x.grad = None
    F.cross_entropy(ref(x), target).backward()
    assert seen == {"dgrad": 3, "wgrad": 3, "bias": 2}, seen
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-6)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_grouped_backward_ops_match_float64(gpu):
    """The backward ops take groups (the op derives them from the shapes): dgrad and wgrad of a
    grouped and a depthwise layer through torch.ops.convforge.*."""
    from convforge.torch import ops

    for spec in (SPECS[6], ConvSpec.make(2, 8, 13, 13, 8, 3, 3, 1, 1, groups=8)):
        x, w, dy = _data(spec)
        args = (list(spec.stride), list(spec.pad), list(spec.dilation), spec.groups, "auto", None, None)
        _poison(spec.x_shape)
        dx = ops.INPUT_OP(list(spec.x_shape), w, dy, *args)
        _poison(spec.w_shape)
        dw = ops.WEIGHT_OP(x, list(spec.w_shape), dy, *args)
        assert rel_l2(_np(dx), dgrad_ref(_np(dy), _np(w), spec.with_pass("dgrad"))) < 1e-5
        assert rel_l2(_np(dw), wgrad_ref(_np(x), _np(dy), spec.with_pass("wgrad"))) < 1e-5


def _small_model(seed=0, bn=True):
    torch.manual_seed(seed)
    layers = [torch.nn.Conv2d(3, 16, 3, padding=1, bias=not bn)]
    layers += [torch.nn.BatchNorm2d(16)] if bn else []
    layers += [torch.nn.ReLU(), torch.nn.Conv2d(16, 24, 3, stride=2, padding=1, bias=not bn)]
    layers += [torch.nn.BatchNorm2d(24)] if bn else []
    layers += [torch.nn.ReLU(), torch.nn.Conv2d(24, 24, 3, padding=1), torch.nn.ReLU(),
               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(24, 10)]
    return torch.nn.Sequential(*layers).cuda().train()


def test_fused_conv2d_training_gradients_match_float64(gpu, monkeypatch):
    """FusedConv2d in training mode (our conv, PyTorch's batch norm and ReLU): every parameter's
    gradient against float64, within the class of PyTorch FP32's own error."""
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    seen = _count_ours(monkeypatch)
    model = _small_model()
    ref32, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    fused, report = ct.fuse(model)
    assert report.fused, report
    x = torch.randn(8, 3, 17, 15, device="cuda")
    target = torch.randint(0, 10, (8,), device="cuda")
    F.cross_entropy(fused(x), target).backward()
    F.cross_entropy(ref32(x), target).backward()
    F.cross_entropy(ref64(x.double()), target).backward()
    assert seen["dgrad"] == 2 and seen["wgrad"] == 3, seen  # the first conv needs no input gradient
    for (name, p), p32, p64 in zip(model.named_parameters(), ref32.parameters(), ref64.parameters()):
        bound = max(FP32, 2 * _rel(p32.grad, p64.grad))
        assert _rel(p.grad, p64.grad) <= bound, (name, _rel(p.grad, p64.grad), _rel(p32.grad, p64.grad))


def test_torch_compile_of_a_training_step(gpu, monkeypatch):
    """torch.compile (inductor) of a converted model's forward + loss + backward, fullgraph: the
    backward graph runs our dgrad / wgrad / bias ops; gradients equal PyTorch FP32's eager ones."""
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _small_model(1, bn=False)
    eager = copy.deepcopy(model)  # PyTorch's own convolutions
    ct.convert(model)
    x = torch.randn(4, 3, 16, 16, device="cuda")
    target = torch.randint(0, 10, (4,), device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    seen = _count_ours(monkeypatch)
    pytorch = _count_pytorch_backward(monkeypatch)
    for step in range(2):
        model.zero_grad()
        eager.zero_grad()
        before, runs = dict(seen), _native_pass_runs()
        loss = F.cross_entropy(compiled(x), target)
        loss.backward()
        want = F.cross_entropy(eager(x), target)
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
        python = {k: seen[k] - before[k] for k in seen}
        if step == 0:  # first calls: Python's path (which files them with native.cpp)
            assert python == {"dgrad": 2, "wgrad": 3, "bias": 3}, python
        else:  # three convs (the first needs no dgrad), each through our kernels: Python's or filed in C++
            assert python["dgrad"] + python["wgrad"] + _native_pass_runs() - runs == 5 and python["bias"] == 3, \
                (python, _native_pass_runs() - runs)
    assert pytorch == {"dgrad": 0, "wgrad": 0}, pytorch


def _native_pass_runs() -> int:
    """Backward calls native.cpp ran itself (0 without the native module)."""
    from convforge.torch import ops

    return int(ops.NATIVE.stats().get("pass_runs", 0)) if ops.NATIVE is not None else 0


def _count_pytorch_backward(monkeypatch):
    """Count the backward calls the op handed to PyTorch's kernels."""
    from convforge.torch import ops

    return _count_calls(monkeypatch, ops, {"_torch_input": "dgrad", "_torch_weight": "wgrad"})


@pytest.mark.parametrize("how", ["convert", "fuse"])
def test_cuda_graph_capture_of_a_whole_training_step(gpu, monkeypatch, how):
    """A converted (or fused: batch norm and ReLU on our training kernels) model's training step
    (forward, loss, backward, SGD with momentum) captured in one CUDA graph after warm-up on a side
    stream; replays on new data track an eager copy stepped on the same data, running statistics too."""
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _small_model(2)
    eager = copy.deepcopy(model)
    if how == "convert":
        ct.convert(model)
        ct.convert(eager)
    else:
        model, _ = ct.fuse(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    eopt = torch.optim.SGD(eager.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [(torch.randn(8, 3, 16, 16, device="cuda", generator=gen),
                torch.randint(0, 10, (8,), device="cuda", generator=gen)) for _ in range(6)]
    static_x, static_t = batches[0][0].clone(), batches[0][1].clone()

    def step(m, o, x, t):
        o.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x), t)
        loss.backward()
        o.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, t in batches[:3]:  # warm-up: runners, workspace, momentum buffers
            static_x.copy_(x)
            static_t.copy_(t)
            step(model, opt, static_x, static_t)
    torch.cuda.current_stream().wait_stream(side)
    for x, t in batches[:3]:
        step(eager, eopt, x, t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_x, static_t)
    for x, t in batches[3:]:
        static_x.copy_(x)
        static_t.copy_(t)
        graph.replay()
        want = step(eager, eopt, x, t)
        torch.testing.assert_close(static_loss, want, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5, msg=name)


def test_loss_curve_matches_pytorch_within_noise(gpu, monkeypatch):
    """50 SGD steps on one fixed batch from the same weights: the converted and the fused model's
    loss curves stay within the run-to-run noise of FP32 training (PyTorch FP32 against float64
    and against itself with other algorithms), and the loss goes down."""
    import convforge.torch as ct
    from convforge.apps.bench import training

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _small_model(3)
    x = torch.randn(16, 3, 24, 24, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    target = torch.randint(0, 10, (16,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    lr = 0.02  # the loss falls by a tenth in 50 steps; rounding differences stay ~1e-7 (measured on CPU)
    pytorch = training.loss_curve(training.step_fn(copy.deepcopy(model), x, target, lr))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    other = training.loss_curve(training.step_fn(copy.deepcopy(model), x, target, lr))
    f64 = training.loss_curve(training.step_fn(copy.deepcopy(model).double(), x.double(), target, lr))
    noise = max(training.deviation(pytorch, f64), training.deviation(other, pytorch))
    conv = copy.deepcopy(model)
    ct.convert(conv)
    fused, _ = ct.fuse(copy.deepcopy(model))
    for name, m in (("converted", conv), ("fused", fused)):
        curve = training.loss_curve(training.step_fn(m, x, target, lr))
        assert curve[-1] < 0.95 * curve[0], (name, curve)
        dev = training.deviation(curve, pytorch)
        assert dev <= max(training.NOISE_SLACK * noise, training.NOISE_FLOOR), (name, dev, noise)


@pytest.mark.parametrize("conv_pass", ["dgrad", "wgrad"])
def test_cudnn_baselines_of_each_backward_pass(gpu, conv_pass):
    """bench's baselines for a backward pass: PyTorch's pick through convolution_backward and every
    legacy BWD_DATA / BWD_FILTER algorithm in FMA math, each with its error against float64 of the
    same pass; cuDNN-best FP32 is the fastest of them."""
    from convforge.apps.bench import baselines
    from convforge.apps.bench.timing import Timing

    spec = ConvSpec.make(4, 32, 14, 14, 32, 3, 3, 1, 1, conv_pass=conv_pass)
    res = baselines.run("cudnn", spec, Timing(1, 3, 1), True, ("fp32", "relaxed"))
    by = {r.impl: r for r in res}
    prefix = "cudnn:BWD_DATA_" if conv_pass == "dgrad" else "cudnn:BWD_FILTER_"
    legacy = [r for r in res if r.impl.startswith(prefix)]
    assert len(legacy) == 6, [r.impl for r in res]
    ran = [r for r in legacy if r.time_ms is not None]
    # every row's error is measured; a row cuDNN itself gets wrong is never cuDNN-best (baselines.plausible)
    assert ran and all(r.rel_err is not None for r in ran) and any(r.rel_err < 1e-5 for r in ran), ran
    assert by["cudnn-best"].rel_err < 1e-4, by["cudnn-best"]
    assert by["torch-pick"].time_ms and by["torch-pick"].rel_err < 1e-5
    best = by["cudnn-best"]
    assert best.time_ms == min(r.time_ms for r in res if r.time_ms and r.precision == "fp32"
                               and (r.impl in ("torch-pick", "torch-pick-cl") or r.impl.startswith("cudnn:")))
    assert "cudnn-best-tf32" in by and "torch-fp16-cl" not in by


def test_bench_suite_pass_all_on_cuda(gpu, tmp_path):
    """``convforge bench --pass all`` on CUDA: every pass checked, timed and compared with cuDNN-best
    of that pass."""
    import json

    from convforge.cli import main

    suite = tmp_path / "s.json"
    suite.write_text(json.dumps([{"name": "l", "N": 4, "C": 32, "H": 14, "W": 14, "K": 32, "R": 3, "S": 3,
                                  "stride": 1, "pad": 1}]))
    assert main(["bench", "--suite", str(suite), "--pass", "all", "--repeats", "3", "--quick-ceilings",
                 "--out", str(tmp_path / "o")]) == 0
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    ours = [r for r in doc["rows"] if r["impl"].startswith("convforge")]
    assert {r["layer"] for r in ours} == {"l", "l:dgrad", "l:wgrad"}
    assert all(r["ok"] and r["baseline_impl"] == "cudnn-best" and r["speedup"] for r in ours), ours
    assert set(doc["summary"]) == {"fp32", "fp32/dgrad", "fp32/wgrad"}


def test_bench_train_rows(gpu, tmp_path):
    """``bench --model resnet18:2 --train``'s rows: every implementation timed, loss curves of STEPS
    steps, the convforge curves within the noise."""
    pytest.importorskip("torchvision", reason="torchvision not installed: bench --train needs it")
    from convforge.apps.bench import training

    rows = training.compare(training.bench_train("resnet18", 2, 1, 3, {}))
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"pytorch_fp32", "pytorch_tf32", "convforge", "convforge_fused", "pytorch_fp32_nobench",
                       "pytorch_fp64"}
    for impl in ("pytorch_fp32", "pytorch_tf32", "convforge", "convforge_fused"):
        r = by[impl]
        assert r["status"] == "ok" and r["time_ms"] > 0 and len(r["loss_curve"]) == training.STEPS, r
        assert r["graph_status"] == "ok" and r["graph_ms"] > 0, r  # the whole step captured and replayed
    for impl in ("convforge", "convforge_fused"):
        assert by[impl]["speedup"] > 0 and by[impl]["within_noise"], by[impl]
        assert by[impl]["graph_speedup"] > 0, by[impl]
    training.write(tmp_path, {}, [], ("fp32",), False, rows)
    assert (tmp_path / "train_losses.csv").read_text().count("\n") == training.STEPS + 1


def test_bench_amp_rows(gpu):
    """``bench --model resnet18:4 --train --amp fp16``'s rows: the five steps timed in interleaved rounds (PyTorch
    AMP eager and from CUDA graphs, convert(), fuse() with its graphs and eager), each with its first step, peak
    memory and a loss curve of STEPS steps within PyTorch AMP's noise; the two noise references beside them."""
    pytest.importorskip("torchvision", reason="torchvision not installed: bench --train needs it")
    from convforge.apps.bench import training_amp

    rows = training_amp.bench_amp("resnet18", 4, "fp16", 1, 5, {})
    by = {r["impl"]: r for r in rows}
    steps = ("pytorch_amp", "pytorch_amp_graphs", "convforge_amp", "convforge_fused_amp", "convforge_fused_eager")
    assert set(by) == {*steps, "pytorch_amp_nobench", "pytorch_fp32"}
    for impl in steps:
        r = by[impl]
        assert r["status"] == "ok" and r["time_ms"] > 0 and r["peak_gib"] > 0 and r["first_step_s"] > 0, r
        assert len(r["loss_curve"]) == training_amp.STEPS and r["speedup"] > 0, r
    assert all(by[impl]["within_noise"] for impl in steps[1:]), rows


def test_numpy_inputs_are_unchanged_by_gpu_runs(gpu, ocl):
    """The NumPy path still runs on OpenCL when CUDA is present (nothing of the device path leaks in)."""
    from convforge import grad

    spec = SPECS[0]
    rng = np.random.default_rng(0)
    w = rng.standard_normal(spec.w_shape).astype(np.float32)
    dy = rng.standard_normal(spec.y_shape).astype(np.float32)
    dx = grad.conv2d_input(spec.x_shape, w, dy, **_args(spec))
    assert isinstance(dx, np.ndarray) and rel_l2(dx, dgrad_ref(dy, w, spec.with_pass("dgrad"))) < 1e-5
