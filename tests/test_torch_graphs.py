"""torch/graphs.py's class mechanics on the CPU: a fused model keeps its results, its state_dict and its
training graphs through deepcopy, pickling (which recompiles the GraphModule) and recompile; ``without_graphs``
and ``graph_training`` undo and redo it; CPU calls never capture. The captures themselves are GPU-tested
(tests/test_gpu_train_graphs.py). Skips without torch."""

from __future__ import annotations

import copy
import io

import pytest

torch = pytest.importorskip("torch", reason="convforge.torch needs torch (not installed on CI)")
nn = torch.nn


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 4, 1), nn.Flatten(), nn.Linear(4 * 7 * 5, 3))


def test_fused_model_keeps_its_graphs_through_copies_and_pickling() -> None:
    import convforge.torch as ct
    from convforge.torch import graphs

    model = _net().eval()
    fused, _ = ct.fuse(model)
    assert isinstance(fused, graphs._GraphedCall) and isinstance(fused, torch.fx.GraphModule)
    assert list(fused.state_dict()) == list(model.state_dict())
    x = torch.randn(2, 3, 7, 5)
    with torch.no_grad():
        want = model(x)
        assert torch.allclose(fused(x), want, atol=1e-5)
        buf = io.BytesIO()
        torch.save(fused, buf)  # recompiles the GraphModule on its own class
        buf.seek(0)
        assert torch.allclose(torch.load(buf, weights_only=False)(x), want, atol=1e-5)  # (eager: a plain GraphModule)
        fused.recompile()
        for m in (fused, copy.deepcopy(fused), copy.deepcopy(copy.deepcopy(fused))):
            assert isinstance(m, graphs._GraphedCall)
            assert torch.allclose(m(x), want, atol=1e-5)
        plain = graphs.without_graphs(copy.deepcopy(fused))
        assert not isinstance(plain, graphs._GraphedCall) and isinstance(plain, torch.fx.GraphModule)
        assert torch.allclose(plain(x), want, atol=1e-5)
        assert graphs.graph_training(plain) is plain and isinstance(plain, graphs._GraphedCall)


def test_cpu_training_calls_stay_eager() -> None:
    import convforge.torch as ct
    from convforge.torch import graphs

    fused, _ = ct.fuse(_net())
    fused.train()
    x = torch.randn(2, 3, 7, 5)
    for _ in range(4):
        fused(x).sum().backward()
    assert graphs.status(fused) == {}
    other = graphs.graph_training(nn.Linear(4, 2))
    assert graphs.graph_training(other) is other and type(other).__name__ == "Linear"
    other(torch.randn(3, 4)).sum().backward()
    assert other.weight.grad is not None and graphs.status(other) == {}
