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
    buf = io.BytesIO()
    torch.save(other, buf)  # its class made at run time: pickled as nn.Linear
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is nn.Linear and torch.equal(loaded.weight, other.weight)
    assert type(copy.deepcopy(other)) is nn.Linear


_CAPTURING: list[int] = []


class _Rerun:
    """A stand-in for a captured graph on the CPU: replay() runs the recorded computation again into the same
    buffers (what a CUDA graph's replay does with the kernels it captured)."""

    def __init__(self, run) -> None:
        self.replay = run


def _cpu_capture(m, args, params):
    """graphs._capture's result without CUDA: static inputs, outputs, incoming gradients and parameter gradients,
    the forward and backward re-run from them on every replay."""
    from convforge.torch import graphs

    inputs = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    names = {id(p): n for n, p in m.named_parameters()}
    leaves = [p.detach().requires_grad_(True) for p in params]

    def forward():  # inside a capture the model's own calls are eager (graphs._eligible: the stream captures)
        _CAPTURING.append(1)
        try:
            return torch.func.functional_call(m, {names[id(p)]: q for p, q in zip(params, leaves)}, tuple(inputs))
        finally:
            _CAPTURING.pop()

    out = forward().detach()
    grad_out = torch.empty_like(out)
    grads = [torch.empty_like(p) for p in params]

    def fwd():
        with torch.no_grad():
            out.copy_(forward())

    def bwd():
        with torch.enable_grad():
            for g, new in zip(grads, torch.autograd.grad(forward(), leaves, grad_out)):
                g.copy_(new)

    return graphs._Captured(_Rerun(fwd), _Rerun(bwd), inputs, [out], [True], [grad_out], list(grads),
                            [len(inputs) + i for i in range(len(params))], torch.Tensor)


def test_replays_give_eager_gradients_and_keep_their_results(monkeypatch) -> None:
    """The replay plumbing (graphs._call, _Replay) with a CPU stand-in for the capture: after two eager steps
    the third call replays; outputs and gradients equal eager autograd's; an output kept from one replay is not
    changed by the next; gradients accumulate over two backward calls; a second forward before the first's
    backward runs eagerly; a second backward (retain_graph) after a later replay raises."""
    from convforge.torch import graphs

    monkeypatch.setattr(graphs, "_eligible", lambda m, args: m.training and torch.is_grad_enabled() and not _CAPTURING)
    monkeypatch.setattr(graphs, "_capture", _cpu_capture)
    torch.manual_seed(1)
    m = graphs.graph_training(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)))
    twin = copy.deepcopy(graphs.without_graphs(copy.deepcopy(m)))
    xs = [torch.randn(4, 6) for _ in range(4)]
    for i, x in enumerate(xs[:3]):
        for net in (m, twin):
            net.zero_grad(set_to_none=True)
            net(x).square().sum().backward()
        assert all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(m.parameters(), twin.parameters()))
        assert list(graphs.status(m).values()) == (["captured"] if i == 2 else [f"eager ({i + 1} of 2)"])
    kept = m(xs[0])
    first = kept.detach().clone()
    m.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    kept.sum().backward()
    m(xs[1]).sum().backward()  # accumulates into the same .grad
    assert torch.equal(kept.detach(), first)
    twin(xs[0]).sum().backward()
    twin(xs[1]).sum().backward()
    assert all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(m.parameters(), twin.parameters()))
    y1, y2 = m(xs[2]), m(xs[3])  # the second runs eagerly: the first's backward is pending
    assert type(y1.grad_fn).__name__ != type(y2.grad_fn).__name__
    (y1.sum() + y2.sum()).backward()
    old = m(xs[0])
    assert type(old.grad_fn).__name__ == type(y1.grad_fn).__name__  # a replay again
    old.sum().backward(retain_graph=True)
    m(xs[1])  # a later replay overwrites what old's graph would read
    with pytest.raises(RuntimeError, match="replayed by a later call"):
        old.sum().backward()
