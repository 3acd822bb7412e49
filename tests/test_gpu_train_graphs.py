"""Training steps of a fused model replayed from CUDA graphs (torch/graphs.py) on the GPU: the same losses,
parameters, gradients and batch-norm statistics as the same fused model run eagerly, over AMP steps with a
GradScaler (an overflowing step skipped as eagerly), gradient accumulation, outputs kept across steps, two
forwards before one backward, a new batch size, and the fallbacks. GPU tier: skips without torch or CUDA."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="GPU tier of convforge.torch: torch not installed")
tv = pytest.importorskip("torchvision", reason="GPU tier: torchvision not installed")
F = torch.nn.functional
CL = torch.channels_last


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _pair(seed=0):
    """Two fused copies of one small ResNet-18 (channels_last, train mode)."""
    import convforge.torch as ct

    torch.manual_seed(seed)
    base = tv.models.resnet18(num_classes=10).to("cuda").to(memory_format=CL)
    return [ct.fuse(copy.deepcopy(base))[0].train() for _ in range(2)]


def _batch(n=8, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, 3, 64, 64, generator=g).to("cuda").contiguous(memory_format=CL)
    return x, torch.randint(0, 10, (n,), generator=g).to("cuda")


def _steps(m, x, t, graphs, monkeypatch, n=6, scale=2.0**12, dt=torch.float16):
    """n AMP steps (autocast, GradScaler, SGD momentum) with training graphs on or off: the losses."""
    from convforge.config import config

    monkeypatch.setattr(config, "train_graphs", graphs)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", init_scale=scale)
    losses = []
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dt):
            loss = F.cross_entropy(m(x), t)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss))
    return losses, scaler


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_graphed_steps_match_eager(gpu, monkeypatch, dt):
    from convforge.torch import graphs

    a, b = _pair()
    x, t = _batch()
    la, _ = _steps(a, x, t, True, monkeypatch, dt=dt)
    lb, _ = _steps(b, x, t, False, monkeypatch, dt=dt)
    assert list(graphs.status(a).values()) == ["captured"], graphs.status(a)
    assert graphs.status(b) == {}
    for i, (u, v) in enumerate(zip(la, lb)):
        assert abs(u - v) <= 1e-3 * abs(v), (i, la, lb)
    sa, sb = a.state_dict(), b.state_dict()
    for k in sb:
        if sb[k].is_floating_point():
            assert _rel(sa[k], sb[k]) <= 1e-3, k
        else:
            assert torch.equal(sa[k], sb[k]), k  # num_batches_tracked: one a step, replays included
    assert int(sa["bn1.num_batches_tracked"]) == 6


def test_overflow_is_skipped_as_eagerly(gpu, monkeypatch):
    """A scale that overflows FP16 after the capture: Inf reaches the gradients through the replay, the scaler
    skips those steps and lowers its scale exactly as for the eager model."""
    a, b = _pair(seed=3)
    x, t = _batch(seed=4)
    _steps(a, x, t, True, monkeypatch, n=3)
    _steps(b, x, t, False, monkeypatch, n=3)
    before = [p.detach().clone() for p in a.parameters()]
    _, sa = _steps(a, x, t, True, monkeypatch, n=2, scale=2.0**60)
    _, sb = _steps(b, x, t, False, monkeypatch, n=2, scale=2.0**60)
    assert sa.get_scale() == sb.get_scale() < 2.0**60
    assert all(torch.equal(p, q) for p, q in zip(before, a.parameters())), "a step with Inf gradients was taken"


def test_accumulation_kept_outputs_and_two_forwards(gpu, monkeypatch):
    """After the capture: two backward calls without zeroing add up; an output kept from one step is not
    overwritten by the next; two forwards before their backward (the second runs eagerly) give both
    gradients."""
    from convforge.config import config

    a, b = _pair(seed=5)
    x, t = _batch(seed=6)
    x2, t2 = _batch(seed=7)
    _steps(a, x, t, True, monkeypatch, n=3)
    _steps(b, x, t, False, monkeypatch, n=3)
    grads = []
    for m, on in ((a, True), (b, False)):
        monkeypatch.setattr(config, "train_graphs", on)
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):  # the captured key's
            y1 = m(x)
            kept = y1.detach().clone()
            F.cross_entropy(y1.float(), t).backward()
            y2 = m(x2)
            F.cross_entropy(y2.float(), t2).backward()
            assert torch.equal(y1.detach(), kept)
            y3, y4 = m(x), m(x2)  # two forwards, then both backward
            (F.cross_entropy(y3.float(), t) + F.cross_entropy(y4.float(), t2)).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for g, h in zip(*grads):
        assert _rel(g, h) <= 1e-3


def test_other_batch_size_and_eval_run_eagerly(gpu, monkeypatch):
    from convforge.torch import graphs

    a, b = _pair(seed=8)
    x, t = _batch(seed=9)
    small, ts = _batch(n=3, seed=10)
    _steps(a, x, t, True, monkeypatch, n=4)
    _steps(b, x, t, False, monkeypatch, n=4)
    la, _ = _steps(a, small, ts, True, monkeypatch, n=1)
    lb, _ = _steps(b, small, ts, False, monkeypatch, n=1)
    assert abs(la[0] - lb[0]) <= 1e-3 * abs(lb[0])
    assert sorted(graphs.status(a).values()) == ["captured", "eager (1 of 2)"]
    a.eval(), b.eval()
    with torch.no_grad():
        assert _rel(a(x), b(x)) <= 1e-3


def test_hooks_keep_a_model_eager(gpu, monkeypatch):
    """A forward hook would not run on a replay: the model stays eager while one is registered, captures once
    it is removed, and replays equal the eager twin's steps."""
    from convforge.torch import graphs

    a, b = _pair(seed=11)
    calls = []
    handle = a.fc.register_forward_hook(lambda *_: calls.append(1))  # a module the fused graph calls
    x, t = _batch(seed=12)
    la, _ = _steps(a, x, t, True, monkeypatch, n=4)
    assert len(calls) == 4 and graphs.status(a) == {}
    handle.remove()
    lb, _ = _steps(a, x, t, True, monkeypatch, n=4)
    assert list(graphs.status(a).values()) == ["captured"], graphs.status(a)
    lc, _ = _steps(b, x, t, False, monkeypatch, n=4)
    ld, _ = _steps(b, x, t, False, monkeypatch, n=4)
    assert all(abs(u - v) <= 1e-3 * abs(v) for u, v in zip(la + lb, lc + ld)), (la + lb, lc + ld)


def test_convnext_with_stochastic_depth_trains_graphed(gpu, monkeypatch):
    """ConvNeXt blocks (depthwise conv, layer norm, MLP, layer scale, stochastic depth) captured: the losses
    stay finite and close to the eager copy's over the steps (the random paths drawn are the same stream)."""
    import convforge.torch as ct
    from convforge.torch import graphs

    torch.manual_seed(13)
    base = tv.models.convnext_tiny(num_classes=10, stochastic_depth_prob=0.2).to("cuda").to(memory_format=CL)
    a, b = (ct.fuse(copy.deepcopy(base))[0].train() for _ in range(2))
    x, t = _batch(n=4, seed=14)
    torch.manual_seed(15)
    la, _ = _steps(a, x, t, True, monkeypatch, n=5)
    torch.manual_seed(15)
    lb, _ = _steps(b, x, t, False, monkeypatch, n=5)
    assert list(graphs.status(a).values()) == ["captured"], graphs.status(a)
    assert all(abs(u - v) <= 2e-2 * abs(v) for u, v in zip(la, lb)), (la, lb)


class _ReadsTheHost(torch.nn.Module):
    """A forward that reads a value on the host (illegal in a capture) and draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = torch.nn.Linear(16, 4), torch.nn.Dropout(0.2)

    def forward(self, x):
        scale = 1.0 + 0.0 * float(x.abs().sum())
        return self.drop(self.fc(x)) * scale


def test_a_failed_capture_leaves_the_process_working(gpu):
    """The capture fails (a host read inside the forward): the model runs eagerly from then on, the failure is
    in ``status``, and PyTorch's random generator still draws (a capture that raised leaves it in capture
    mode unless repaired)."""
    from convforge.torch import graphs

    m = graphs.graph_training(_ReadsTheHost().to("cuda").train())
    x = torch.randn(8, 16, device="cuda")
    for _ in range(4):
        m(x).sum().backward()
    state = list(graphs.status(m).values())
    assert len(state) == 1 and state[0].startswith("failed:"), state
    assert torch.rand(4, device="cuda").isfinite().all()
    m(x).sum().backward()
