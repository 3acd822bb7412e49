"""``fuse`` of linear layers over channels-last activations (torch/linear.py) on the CPU: which
chains become one ``FusedLinear`` call, outputs equal to the original model's (on CPU tensors the
module runs the original operations), ``state_dict`` unchanged, and the chains it must leave alone.
The CUDA path (tensor-core plans in NHWC) is in tests/test_torch_linear_gpu.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: convforge.torch linear fusion tests skipped")
nn, F = torch.nn, torch.nn.functional

import convforge.torch as ct  # noqa: E402
from convforge.torch.linear import FusedLinear  # noqa: E402


class Block(nn.Module):
    """ConvNeXt's block: 7x7 depthwise -> permute -> LayerNorm -> Linear -> GELU -> Linear -> permute
    -> layer scale -> (stochastic depth) -> + input."""

    def __init__(self, c: int = 8, functional_gelu: bool = False) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.act = nn.GELU()
        self.functional_gelu = functional_gelu
        self.layer_scale = nn.Parameter(torch.rand(c, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = self.fc1(y)
        y = F.gelu(y) if self.functional_gelu else self.act(y)
        y = self.fc2(y).permute(0, 3, 1, 2)
        return self.layer_scale * y + x


class Leave(nn.Module):
    """Chains fuse must not touch: tanh-approximate GELU, a linear read twice, a scale of the wrong
    shape, a linear module called twice."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.s = nn.Parameter(torch.rand(1, c, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.a(x), approximate="tanh")
        z = self.b(y)
        z = z + F.gelu(z)  # read twice
        w = self.s * self.c(z).permute(0, 3, 1, 2) + x.permute(0, 3, 1, 2)  # scale (1, C, 1, 1)
        return w.permute(0, 2, 3, 1) + F.gelu(self.c(x))  # self.c called twice


@pytest.mark.parametrize("functional", [False, True])
def test_convnext_block_fuses_both_linears(functional):
    torch.manual_seed(0)
    model = nn.Sequential(Block(8, functional), Block(8, functional)).eval()
    fused, report = ct.fuse(model)
    assert report.linears == {"0.fc1": "norm+gelu", "0.fc2": "permute+scale+add", "1.fc1": "norm+gelu",
                              "1.fc2": "permute+scale+add"}
    assert not [n for n in fused.graph.nodes if n.op == "call_module" and n.target.endswith("norm")]  # folded
    assert "linear layer(s) fused" in str(report)
    assert isinstance(fused.get_submodule("0.fc1"), FusedLinear)
    assert fused.state_dict().keys() == model.state_dict().keys()
    assert all(a.data_ptr() == b.data_ptr()
               for a, b in zip(fused.state_dict().values(), model.state_dict().values(), strict=True))
    ops = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert torch.mul not in ops and F.gelu not in ops and not any(getattr(o, "__name__", "") == "mul" for o in ops)
    x = torch.randn(2, 8, 5, 7)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=0, atol=0)
    fused.train()
    x.requires_grad_(True)
    fused(x).sum().backward()
    assert fused.get_submodule("0.fc1").weight.grad is not None  # shared with the original model
    assert model[0].layer_scale.grad is not None


def test_torchvision_convnext_tail_with_stochastic_depth():
    torchvision = pytest.importorskip("torchvision", reason="torchvision not installed")
    torch.manual_seed(0)
    model = torchvision.models.convnext_tiny(stochastic_depth_prob=0.2).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_scale"):
                p.uniform_(0.1, 1.0)
    fused, report = ct.fuse(model)
    assert len(report.linears) == 36
    assert sorted(set(report.linears.values())) == ["norm+gelu", "permute+scale+stochastic_depth+add"]
    assert len(report.norms) == 5 and "layer norm(s) on convforge's kernel" in str(report)  # LayerNorm2d's
    assert fused.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=0, atol=0)


def test_leaves_what_it_cannot_fold():
    torch.manual_seed(0)
    model = Leave().eval()
    fused, report = ct.fuse(model)
    assert report.linears == {}
    x = torch.randn(2, 3, 4, 8)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=0, atol=0)


def test_from_linear_refuses_gelu_with_the_tail():
    with pytest.raises(ValueError, match="either GELU or"):
        FusedLinear.from_linear(nn.Linear(4, 4), gelu=True, residual=True)
    with pytest.raises(ValueError, match="precision"):
        FusedLinear.from_linear(nn.Linear(4, 4), gelu=True, precision="fast")


class SharedNorm(nn.Module):
    """A layer norm read twice: it stays PyTorch's, the linear after it still fuses with its GELU."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(c), nn.Linear(c, 2 * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return F.gelu(self.fc(y)).sum(-1) + y.sum(-1)


def test_a_norm_read_twice_is_not_folded():
    torch.manual_seed(0)
    model = SharedNorm().eval()
    fused, report = ct.fuse(model)
    assert report.linears == {"fc": "gelu"}
    x = torch.randn(2, 3, 4, 8)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="nn.LayerNorm over the linear's 8 input features"):
        FusedLinear.from_linear(nn.Linear(8, 4), gelu=True, norm=nn.LayerNorm(4))


@pytest.mark.parametrize("name", ["swin_t", "vit_b_16"])
def test_transformer_mlps_fold_their_norms_and_compute_the_same(name):
    """torchvision's Swin-T and ViT-B/16: each block's LayerNorm -> Linear -> GELU folds ("norm+gelu"), and the
    fused model computes exactly what the model does on the CPU (PyTorch's operations there)."""
    torchvision = pytest.importorskip("torchvision", reason="torchvision not installed")
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    fused, report = ct.fuse(model)
    assert list(report.linears.values()).count("norm+gelu") == 12
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=0, atol=0)
