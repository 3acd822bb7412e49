"""``torch.compile(model, backend="convforge")`` with CPU torch: the backend found through the package entry
point (group ``torch_dynamo_backends``) without importing convforge, the captured graph's convs and chains
rewritten, outputs and gradients equal to eager (on CPU the ops compute with PyTorch's kernels, so this
checks the graph plumbing; tests/test_gpu_dropin.py runs it on CUDA)."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch", reason="convforge.torch: torch not installed")
nn = torch.nn

ENTRY_POINT = "convforge = convforge.torch.compile_backend:convforge_backend"


def test_the_entry_point_registers_the_backend(tmp_path):
    """In a fresh process with a dist-info declaring the entry point as pyproject.toml does, dynamo
    finds the backend by name without convforge imported first."""
    import os
    import subprocess

    info = tmp_path / "convforge_ep-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: convforge-ep\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[torch_dynamo_backends]\n{ENTRY_POINT}\n")
    code = ("import sys, torch\n"
            "assert not any(m.startswith('convforge') for m in sys.modules)\n"
            "assert 'convforge' in torch._dynamo.list_backends()\n"
            "fn = torch._dynamo.lookup_backend('convforge')\n"
            "print(fn.__module__, fn.__name__)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["convforge.torch.compile_backend", "convforge_backend"]


class Net(nn.Module):
    """conv -> bn -> relu, conv('same') + identity -> relu, a reflect-padded conv, an up-conv."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding="same")
        self.c3 = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
        self.up = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.c1(x)))
        y = torch.relu(self.c2(y) + y)
        return self.up(self.c3(y))


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = Net()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2.0)
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-1, 1)
    return m


@pytest.fixture
def counts(monkeypatch):
    """What each compiled graph's rewrite did, in order."""
    from convforge.torch import compile_backend as cb

    cb.register()
    seen: list[dict[str, int]] = []
    real = cb.rewrite

    def spy(gm, **kw):
        seen.append(real(gm, **kw))
        return seen[-1]

    monkeypatch.setattr(cb, "rewrite", spy)
    torch._dynamo.reset()
    yield seen
    torch._dynamo.reset()


@pytest.mark.parametrize("inductor", [False, True], ids=["eager", "inductor"])
def test_inference_graph_is_fused_and_matches_eager(counts, inductor):
    m = _net().eval()
    x = torch.randn(2, 3, 9, 7)
    with torch.no_grad():
        got = torch.compile(m, backend="convforge", options={"inductor": inductor})(x)
        ref = m(x)
    assert counts == [{"conv2d": 3, "conv_transpose2d": 1, "fused": 2}]
    assert got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("inductor", [False, True], ids=["eager", "inductor"])
def test_training_graph_matches_eager_with_gradients(counts, inductor):
    m = _net(1).train()
    ref_m = _net(1).train()
    x = torch.randn(2, 3, 8, 8)
    out = torch.compile(m, backend="convforge", options={"inductor": inductor})(x)
    ref = ref_m(x)
    assert counts and all(c["fused"] == 0 for c in counts) and counts[0]["conv2d"] == 3
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref_m.parameters()):
        scale = q.grad.abs().max().item() or 1.0
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * scale, name
    assert torch.allclose(m.bn.running_mean, ref_m.bn.running_mean)


def test_unknown_option_is_named(counts):
    with pytest.raises(Exception, match=r"unknown option\(s\) \['fusion'\]"):
        torch.compile(_net(), backend="convforge", options={"fusion": True})(torch.randn(1, 3, 8, 8))
