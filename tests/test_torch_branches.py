"""Re-parameterised branches folded by ``fuse()`` (torch/branches.py) on the CPU: which sums fold, that the
folded model computes what the original did (eval, in float32 against the original's float64 run), refolds
after a running statistic changes, keeps the state_dict, and runs the branches in training. The CUDA run of
the folded conv is tests/test_torch_fuse_gpu.py's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: convforge.torch branch folding tests skipped")
nn = torch.nn

import convforge.torch as ct  # noqa: E402
from convforge.torch.branches import BranchSum, fold  # noqa: E402


class Rep(nn.Module):
    """A RepVGG block: 3x3 + BN, 1x1 + BN and (same channels, stride 1) a BN identity, summed, ReLU."""

    def __init__(self, c: int, k: int, stride: int = 1, groups: int = 1, ident: bool = True) -> None:
        super().__init__()
        self.dense = nn.Sequential(nn.Conv2d(c, k, 3, stride, 1, groups=groups, bias=False), nn.BatchNorm2d(k))
        self.one = nn.Sequential(nn.Conv2d(c, k, 1, stride, 0, groups=groups, bias=False), nn.BatchNorm2d(k))
        self.ident = nn.BatchNorm2d(c) if ident and c == k and stride == 1 else None
        self.act = nn.ReLU()

    def forward(self, x):  # type: ignore[no-untyped-def]
        y = self.dense(x) + self.one(x)
        if self.ident is not None:
            y = y + self.ident(x)
        return self.act(y)


class Acnet(nn.Module):
    """ACNet-style: 5x5 with bias, 3x3 + BN and the bare identity, no activation after (odd order)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(c, c, 5, 1, 2)
        self.b = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x + (self.b(x) + self.a(x))


def _randomised(m: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            with torch.no_grad():
                mod.running_mean.uniform_(-1, 1)
                mod.running_var.uniform_(0.5, 2.0)
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-1, 1)
    return m


def _model() -> nn.Module:
    return _randomised(nn.Sequential(Rep(8, 16, 2), Rep(16, 16), Rep(16, 16, groups=4), Rep(16, 24, ident=False),
                                     Acnet(24))).eval()


def _rel(a, b) -> float:  # type: ignore[no-untyped-def]
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_eval_model_folds_every_block_and_matches_the_original():
    m = _model()
    f, report = ct.fuse(m)
    sums = [mod for mod in f.modules() if isinstance(mod, BranchSum)]
    assert sorted(s.ops() for s in sums) == sorted(["3x3(bn)+1x1(bn)+relu", "3x3(bn)+1x1(bn)+id(bn)+relu",
                                                    "3x3(bn)+1x1(bn)+id(bn)+relu", "3x3(bn)+1x1(bn)+relu",
                                                    "id+3x3(bn)+5x5"])
    assert sum(v.startswith("branches(") for v in report.fused.values()) == 5
    assert [n.op for n in f.graph.nodes].count("call_module") == 5  # one call a block
    assert list(f.state_dict()) == list(m.state_dict())
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(f.state_dict().values(), m.state_dict().values(),
                                                            strict=True))
    x = torch.randn(2, 8, 15, 13)
    want = m.double()(x.double())
    m.float()
    with torch.no_grad():
        for _ in range(2):  # the first call prepares, the second runs the folded convs
            assert _rel(f(x), want) < 1e-5
    assert all(s._cf_conv is not None for s in sums)


def test_fold_is_the_sum_of_the_branches_in_float64():
    block = _randomised(Rep(16, 16, groups=4)).eval().double()
    branches = [(block.dense[0], block.dense[1]), (block.one[0], block.one[1]), (None, block.ident)]
    w, b = fold(branches)
    x = torch.randn(3, 16, 9, 7, dtype=torch.float64)
    with torch.no_grad():
        want = block.dense(x) + block.one(x) + block.ident(x)
        got = torch.nn.functional.conv2d(x, w, b, 1, 1, groups=4)
    assert _rel(got, want) < 1e-12


def test_a_changed_running_statistic_is_folded_again():
    m = _model()
    f, _ = ct.fuse(m)
    x = torch.randn(1, 8, 11, 11)
    with torch.no_grad():
        f(x), f(x)
        m[1].ident.running_mean.add_(0.5)  # in place: the BranchSum sees a new version
        assert _rel(f(x), m(x)) < 1e-5


def test_training_runs_the_branches_and_trains_them():
    m = _model()
    f, _ = ct.fuse(m)
    f.train()
    m.train()
    x = torch.randn(4, 8, 9, 9)
    y = f(x)
    assert _rel(y, m(x)) < 1e-6  # the branches as defined: batch statistics
    y.square().mean().backward()
    assert m[1].dense[0].weight.grad is not None and m[1].one[0].weight.grad.abs().sum() > 0


def test_a_model_fused_for_training_keeps_its_chains():
    m = _model().train()
    f, report = ct.fuse(m)
    assert not any(isinstance(mod, BranchSum) for mod in f.modules())
    assert not any(v.startswith("branches(") for v in report.fused.values())


class _Odd(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        s2 = 2 if kind == "stride" else 1
        self.a = nn.Conv2d(8, 8, 3, 1, 1, dilation=1)
        self.b = nn.Conv2d(8, 8, 3, s2, 1, dilation=2 if kind == "dilation" else 1)
        if kind == "dilation":
            self.b.padding = (2, 2)
        if kind == "even":
            self.b = nn.Conv2d(8, 8, 2, 1, 1)
        self.kind = kind

    def forward(self, x):  # type: ignore[no-untyped-def]
        if self.kind == "deep":
            return self.a(x) + self.b(self.a(x))
        if self.kind == "shared":
            return self.a(x) + self.a(x)
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("kind", ["stride", "dilation", "deep", "shared"])
def test_what_does_not_fold_stays(kind):
    """Branches of different strides, a dilated branch, a branch with a conv before it, or one module
    called twice: not folded, and the model still computes what it did."""
    m = _Odd(kind).eval()
    f, _ = ct.fuse(m)
    assert not any(isinstance(mod, BranchSum) for mod in f.modules())
    if kind != "stride":  # (stride 2 against 1: the sum itself is ill-shaped)
        x = torch.randn(1, 8, 10, 10)
        with torch.no_grad():
            assert _rel(f(x), m(x)) < 1e-6
