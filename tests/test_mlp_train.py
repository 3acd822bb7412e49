"""The ConvNeXt MLP training nodes' autograd (torch/mlp_train.py) on the CPU in float64: the device pieces
(the layer-norm kernels, the GEMM) replaced by float64 references, so the nodes' own wiring (views, the
scale's and stochastic depth's gradients, the bias sums, the dtypes handed back) is checked against
PyTorch's unfused operations through autograd. The kernels themselves: tests/test_layernorm.py (PoCL);
the nodes on the GPU: tests/test_torch_linear_gpu.py. Skips without torch."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="convforge.torch tests: torch not installed")
nn, F = torch.nn, torch.nn.functional

from test_torch_linear import Block  # noqa: E402


def _train_rows(x, w, b, eps, out):
    mean = x.mean(-1, keepdim=True)
    inv = torch.rsqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
    y = (x - mean) * inv
    y = y * w + b if w is not None else y
    st = torch.cat([mean.reshape(-1, 1), inv.reshape(-1, 1)], 1)
    return y.to(out), st


def _grad_rows(x, gy, st, w):
    c = x.shape[-1]
    mean, inv = st[:, 0].reshape(*x.shape[:-1], 1), st[:, 1].reshape(*x.shape[:-1], 1)
    xh = (x - mean) * inv
    gxh = gy * w if w is not None else gy
    gx = inv * (gxh - gxh.mean(-1, keepdim=True) - xh * (gxh * xh).mean(-1, keepdim=True))
    flat = (gy.reshape(-1, c), xh.reshape(-1, c))
    return gx, (flat[0] * flat[1]).sum(0), flat[0].sum(0)


@pytest.fixture
def on_cpu(monkeypatch):
    """The nodes on CPU float64 tensors: their dtype rule answers float64, the GEMM and the layer norm are
    float64 references; the backward ops' CPU kernels are PyTorch's convolution backward."""
    from convforge.config import config
    from convforge.torch import layernorm, mlp_train

    monkeypatch.setattr(config, "mlp_train", True)
    monkeypatch.setattr(mlp_train, "_dtype", lambda m, x, res: torch.float64)
    monkeypatch.setattr(mlp_train, "_gemm", lambda a, w, b: (F.conv2d(a.permute(0, 3, 1, 2),
                                                                      w.reshape(*w.shape, 1, 1), b), None))
    monkeypatch.setattr(layernorm, "train_rows", _train_rows)
    monkeypatch.setattr(layernorm, "grad_rows", _grad_rows)
    monkeypatch.setattr(layernorm, "usable", lambda norm, c: True)
    return mlp_train


def _grads(model, x):
    x = x.detach().clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    y = model(x)
    torch.manual_seed(11)
    gy = torch.randn_like(y)
    y.backward(gy)
    return [y, x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("drop", [0.0, 0.5])
def test_nodes_match_pytorchs_operations_in_float64(on_cpu, monkeypatch, drop):
    """Two ConvNeXt blocks (one with stochastic depth's per-sample noise): y, gx and every parameter's
    gradient through the nodes equal PyTorch's unfused operations' to float64 rounding, the nodes taking
    every call."""
    import convforge.torch as ct
    from convforge.torch.linear import FusedLinear

    torch.manual_seed(0)
    model = nn.Sequential(DepthBlock(16, drop), DepthBlock(16, drop)).double().train()
    fused, report = ct.fuse(model)
    assert set(report.linears.values()) >= {"norm+gelu"}
    x = torch.randn(4, 16, 5, 6, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    torch.manual_seed(3)
    theirs = _grads(model, x)
    calls = []
    real = on_cpu.run
    monkeypatch.setattr(on_cpu, "run", lambda m, x, res: calls.append(m) or real(m, x, res))

    def refuse(*_a, **_k):
        raise AssertionError("a FusedLinear took PyTorch's operations")

    monkeypatch.setattr(FusedLinear, "unfused", refuse)
    torch.manual_seed(3)  # the same stochastic-depth draws
    ours = _grads(fused, x)
    assert len(calls) == 4
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


class DepthBlock(Block):
    """Block with torchvision's StochasticDepth between the layer scale and the residual add (p = 0: none)."""

    def __init__(self, c: int, p: float) -> None:
        super().__init__(c)
        tv = pytest.importorskip("torchvision", reason="torchvision not installed")
        self.sd = tv.ops.StochasticDepth(p, "row") if p else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = self.fc2(self.act(self.fc1(y))).permute(0, 3, 1, 2)
        y = self.layer_scale * y
        return (self.sd(y) if self.sd is not None else y) + x


@pytest.mark.parametrize("on", [True, False])
def test_cpu_calls_and_the_switch_off_take_pytorchs_path(monkeypatch, on):
    """On CPU tensors (config.mlp_train on: the default) or with the switch off, training runs PyTorch's
    operations: the fused blocks' gradients equal the model's bit for bit."""
    import convforge.torch as ct
    from convforge.config import Config, config
    from convforge.torch import mlp_train

    assert Config({}).mlp_train is True
    monkeypatch.setattr(config, "mlp_train", on)
    torch.manual_seed(1)
    model = nn.Sequential(Block(8)).train()
    fused, _ = ct.fuse(copy.deepcopy(model))
    x = torch.randn(2, 8, 5, 5)
    for a, b in zip(_grads(fused, x), _grads(model, x), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fc1 = fused.get_submodule("0.fc1")
    assert mlp_train.node_of(fc1, x.permute(0, 2, 3, 1), None) is None  # CPU: not the nodes' call
