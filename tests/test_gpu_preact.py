"""GPU tier of pre-activation fusion in ``convforge.torch.fuse`` (BN -> ReLU -> conv folded into the
conv's input load; skips without a CUDA device or torch).

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_preact.py``. A DenseNet-like block (dense
layers: concat -> BN -> ReLU -> 1x1 -> BN -> ReLU -> 3x3; a transition: BN -> ReLU -> 1x1 -> pool)
and a pre-activation ResNet unit (one BN -> ReLU read by a 3x3 stride-2 conv and its 1x1 shortcut):
on CPU tensors everything runs as the original did; eval inference folds every pre-activation
(no batch norm module runs) and matches a float64 run of the original; training runs them unfused
and matches PyTorch's outputs, gradients and running
statistics (the shared batch norm updated once); eval with gradients runs them unfused too; CUDA
graphs replay them; torchvision's DenseNet-121 folds all 61 of its BN -> ReLU -> conv chains.
"""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of pre-activation fusion: torch not installed")
nn, F = torch.nn, torch.nn.functional


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int = 8) -> None:
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, 16, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(16), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(16, growth, 3, padding=1, bias=False)

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(feats, 1)
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))


class PreactNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 12, 3, padding=1)
        self.l1, self.l2 = DenseLayer(12), DenseLayer(20)
        self.tnorm, self.tconv = nn.BatchNorm2d(28), nn.Conv2d(28, 14, 1, bias=False)
        self.unorm = nn.BatchNorm2d(14)
        self.uconv = nn.Conv2d(14, 10, 3, stride=2, padding=1)
        self.ushort = nn.Conv2d(14, 10, 1, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [self.stem(x)]
        feats.append(self.l1(feats))
        feats.append(self.l2(feats))
        t = F.avg_pool2d(self.tconv(F.relu(self.tnorm(torch.cat(feats, 1)))), 2)
        a = F.relu(self.unorm(t))
        return self.uconv(a) + self.ushort(a)


PRE_CONVS = {"l1.conv1", "l2.conv1", "tconv", "uconv", "ushort"}


def _model(seed: int = 0, device: str = "cuda") -> nn.Module:
    torch.manual_seed(seed)
    model = PreactNet()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(-1.5, 1.5)  # negative scales too
                m.bias.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 1.5)
    return model.to(device)


def _err(y: torch.Tensor, model: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    assert not torch.isnan(y).any()
    return float((y.double() - want).norm() / want.norm())


def _tolerance(fused: nn.Module) -> float:
    import convforge.torch as ct

    tol = 0.0
    for m in fused.modules():
        if isinstance(m, ct.FusedConv2d):
            for k, v in m._cf_cache.items():
                if k[0] == "fused" and v is not None:
                    tol = max(tol, v[0].exe.plan.tolerance)
    assert tol > 0, "no convforge plan ran"
    return 4 * tol


@pytest.mark.parametrize("train", [False, True])
def test_cpu_tensors_run_the_original_computation(train):
    """No GPU needed: on CPU tensors every fused conv runs unfused, the pre-activation nodes pass
    through (eval: each conv applies the batch norm and ReLU) or run them once (training)."""
    import convforge.torch as ct

    model = _model(5, "cpu").train(train)
    ref = copy.deepcopy(model)
    fused, report = ct.fuse(model)
    assert {n for n, ops in report.fused.items() if ops.startswith("pre(")} == PRE_CONVS
    x = torch.randn(2, 3, 9, 10)
    torch.testing.assert_close(fused(x), ref(x), rtol=1e-5, atol=1e-5)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-6, atol=1e-6, msg=name)  # statistics updated once


def test_fuse_reports_every_prologue(gpu):
    import convforge.torch as ct
    from convforge.torch.fused import PreActivation

    fused, report = ct.fuse(_model().eval())
    pre = {name for name, ops in report.fused.items() if ops.startswith("pre(")}
    assert pre == PRE_CONVS, report
    assert report.fused["l1.conv1"] == "pre(bn+relu)+bn+relu" and report.fused["tconv"] == "pre(bn+relu)"
    assert len([m for m in fused.modules() if isinstance(m, PreActivation)]) == 4  # unorm: one node, two convs
    assert set(fused.state_dict()) == set(_model().state_dict())


@pytest.mark.parametrize("algo", ["auto", "implicit_gemm", "direct"])
def test_eval_folds_every_pre_activation_and_matches_float64(gpu, algo, monkeypatch):
    import convforge.torch as ct
    from convforge.torch import fused as fused_mod

    model = _model(1).eval()
    fused, _ = ct.fuse(model, algo=algo)
    x = torch.randn(3, 3, 13, 11, device="cuda")
    with torch.no_grad():
        ct.prepare(fused, x)  # what the first call would do first: a recording pass with PyTorch's convs
    calls = []
    for name, m in model.named_modules():
        if isinstance(m, nn.BatchNorm2d):
            m.register_forward_hook(lambda *a, n=name: calls.append(n))
    with torch.no_grad():
        y = fused(x)
    assert not calls  # every batch norm folded: before the convs (prologue) or after (epilogue)
    for name, m in fused.named_modules():
        if name in PRE_CONVS:
            run = next(v for k, v in m._cf_cache.items() if k[0] == "fused")[0]
            assert run.exe.plan.prologue.affine and run.exe.plan.prologue.relu, name
    assert _err(y, model, x) < _tolerance(fused)
    folds = []
    real = fused_mod.fold_affine
    monkeypatch.setattr(fused_mod, "fold_affine", lambda bn: folds.append(1) or real(bn))
    with torch.no_grad():
        assert torch.equal(fused(x), y)
        assert not folds  # warm: the prologue's scale and shift are cached per version
        model.unorm.running_var.mul_(2.0)  # an in-place update: the next call re-folds
        y3 = fused(x)
    assert len(folds) == 2  # uconv and ushort each fold the one batch norm they read
    assert _err(y3, model, x) < _tolerance(fused)


def test_training_runs_unfused_and_matches_pytorch(gpu, monkeypatch):
    """The shared pre-activation (unorm, read by two convs) runs once: its running statistics
    match PyTorch's after a step."""
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _model(2).train()
    ref = copy.deepcopy(model)
    fused, _ = ct.fuse(model)
    x = torch.randn(4, 3, 12, 12, device="cuda")
    y, want = fused(x), ref(x)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    y.square().mean().backward()
    want.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5, msg=name)
    fused.eval()
    model.eval()
    with torch.no_grad():
        assert _err(fused(x), model, x) < _tolerance(fused)


def test_eval_with_gradients_runs_unfused(gpu, monkeypatch):
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # PyTorch's reference in FP32, as ours
    model = _model(3).eval()
    ref = copy.deepcopy(model)
    fused, _ = ct.fuse(model)
    x = torch.randn(2, 3, 10, 10, device="cuda", requires_grad=True)
    y, want = fused(x), ref(x)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    y.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(model.unorm.weight.grad, ref.unorm.weight.grad, rtol=1e-3, atol=1e-5)


def test_cuda_graph_replays_the_prologues(gpu, capture_graph):
    import convforge.torch as ct

    model = _model(4).eval()
    fused, _ = ct.fuse(model)
    x = torch.randn(2, 3, 16, 16, device="cuda")
    with torch.no_grad():
        graph, static_y = capture_graph(lambda: fused(x))
        tol = _tolerance(fused)
        x.copy_(torch.randn(x.shape, device="cuda"))
        graph.replay()
        assert _err(static_y, model, x) < tol
        model.l2.norm1.running_mean.add_(0.5)
        fused(x)  # one eager forward re-folds into the same buffers (static_weights=True)
        graph.replay()
        assert _err(static_y, model, x) < tol


def test_torchvision_densenet121(gpu, monkeypatch):
    tv = pytest.importorskip("torchvision", reason="torchvision not installed")
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = tv.models.densenet121(weights=None).cuda().eval()
    fused, report = ct.fuse(model)
    pre = [name for name, ops in report.fused.items() if ops.startswith("pre(")]
    assert not report.left and len(report.converted) == 120 and len(pre) == 61, report
    x = torch.randn(2, 3, 64, 64, device="cuda")
    with torch.no_grad():
        y, pt = fused(x), model(x)
        want = copy.deepcopy(model).double()(x.double())
    err, err_pt = (float((t.double() - want).norm() / want.norm()) for t in (y, pt))
    assert err < _tolerance(fused), (err, err_pt)
    print(f"densenet121: fused rel err {err:.2e}, PyTorch FP32 {err_pt:.2e}")
