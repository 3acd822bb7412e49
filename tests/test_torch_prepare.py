"""``convforge.torch.prepare``: a converted or fused model's kernels compiled on several threads before
its first forward. On the CPU: the recording pass computes what the model computes and leaves the
model as it was; a model in training mode is refused by name; the first-call hook that ``fuse`` and
``convert`` arm stays quiet on CPU inputs and in training, survives deepcopy; a fused model pickles.
On a GPU (tier ``gpu``): every layer's runner is built by ``prepare``, so the first forward compiles
nothing and gives the same values, and a model's first eval forward runs ``prepare`` by itself, once."""

from __future__ import annotations

import copy
import io
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="convforge.torch needs PyTorch (pip install 'convforge[torch]')")
from torch import nn  # noqa: E402

from convforge.torch import convert, fuse, prepare  # noqa: E402

prep_mod = sys.modules["convforge.torch.prepare"]  # the module (convforge.torch.prepare is also the function)


class Net(nn.Module):
    """conv-BN-ReLU, a residual block, a pre-activation (BN-ReLU read by a conv), a grouped conv."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.pre = nn.BatchNorm2d(8)
        self.c3 = nn.Conv2d(8, 6, 1)
        self.dw = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)) + y)
        return self.dw(self.c3(torch.relu(self.pre(y))))


def _net(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    m = Net()
    for bn in (m.b1, m.b2, m.pre):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    return m.to(device).eval()


def test_recording_leaves_the_model_as_it_was() -> None:
    fused, _ = fuse(_net())
    x = torch.randn(2, 3, 11, 9)
    with torch.no_grad():
        before = fused(x)
    state = {k: v.clone() for k, v in fused.state_dict().items()}
    assert prepare(fused, x) == 0  # CPU tensors: convforge runs none of these layers
    with torch.no_grad():
        assert torch.equal(fused(x), before)
    assert all(torch.equal(state[k], v) for k, v in fused.state_dict().items())
    assert not any("forward" in vars(m) for m in fused.modules())


def test_a_training_model_is_refused_by_name() -> None:
    fused, _ = fuse(_net().train())
    with pytest.raises(ValueError, match=r"batch norm .* is in training mode .* call model.eval\(\) first"):
        prepare(fused, torch.randn(1, 3, 8, 8))
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        prepare(lambda x: x, torch.randn(1))  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["fuse", "convert"])
def test_prepare_builds_every_layer_before_the_first_forward(gpu, how: str, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from convforge.backends.base import Backend

    ref = _net("cuda")
    model = fuse(_net("cuda"))[0] if how == "fuse" else _converted()
    x = torch.randn(2, 3, 19, 17, device="cuda")
    t0 = time.perf_counter()
    built = prepare(model, x)
    prep_s = time.perf_counter() - t0
    assert built >= 4
    compiled: list[str] = []
    real = Backend.program

    def counting(self, source):  # type: ignore[no-untyped-def]
        if self._key(source) not in self._programs:
            compiled.append(source[:80])
        return real(self, source)

    monkeypatch.setattr(Backend, "program", counting)
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = model(x)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        want = ref(x)
    assert not compiled, f"the first forward compiled {len(compiled)} program(s) after prepare: {compiled}"
    assert torch.allclose(y, want, rtol=1e-4, atol=1e-4)
    print(f"prepare {prep_s:.2f} s ({built} layers), first forward {first_s * 1e3:.1f} ms")


def _converted() -> nn.Module:
    m = _net("cuda")
    convert(m)
    return m


def _counting_prepare(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = prep_mod.prepare

    def counted(model, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(id(model))
        return real(model, *a, **k)

    monkeypatch.setattr(prep_mod, "prepare", counted)
    return calls


def test_the_first_call_hook_is_quiet_on_cpu_and_in_training(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_prepare(monkeypatch)
    model = fuse(_net())[0]  # (convert swaps only CUDA layers: its hook is tested on the GPU)
    assert model.__dict__.get("_cf_prepare_pending") is True
    x = torch.randn(1, 3, 7, 5)
    with torch.no_grad():
        model(x)  # CPU tensors: nothing to prepare
        model.train()
        model(x)  # training: nothing to prepare (it moves the running statistics)
        want = model.eval()(x)
    assert calls == [] and model.__dict__["_cf_prepare_pending"] is True
    buf = io.BytesIO()  # the net's forward is annotated under `from __future__ import annotations`
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.allclose(loaded(x), want, rtol=1e-6, atol=1e-6)
        for m in (copy.deepcopy(model), copy.deepcopy(copy.deepcopy(model))):
            assert m.__dict__.get("_cf_prepare_pending") is True
            assert torch.allclose(m(x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["fuse", "convert"])
def test_the_first_eval_forward_prepares_itself_once(gpu, how: str, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    calls = _counting_prepare(monkeypatch)
    ref = _net("cuda")
    model = fuse(_net("cuda"))[0] if how == "fuse" else _converted()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 19, 17, device="cuda")
    with torch.no_grad():
        y = model(x)
        model(x)
        twin(x)
        want = ref(x)
    assert calls == [id(model), id(twin)]
    assert torch.allclose(y, want, rtol=1e-4, atol=1e-4)
    if how == "convert":  # a converted model pickles whole (the hook is a module-level function)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        with torch.no_grad():
            assert torch.allclose(loaded(x), want, rtol=1e-4, atol=1e-4)
