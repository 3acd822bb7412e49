"""``convforge.torch.train_ahead``: a training step's kernels compiled ahead. On the CPU: the
recording pass of a fused model in training mode computes what the model computes, moves no running
statistic, leaves every batch norm in training mode and the forwards as they were, and records no
CPU layer; the first-call hook stays quiet on CPU inputs and without gradients; each pass is predicted
with its own epilogue. On a GPU (tier ``gpu``): a fused ResNet-18's AMP step (and ConvNeXt-T's with its
MLP nodes) compiles ahead the programs its forward and backward then find built: its convs' forward,
dgrad and wgrad, its batch norms' and the blocks' statistics convs, the MLP's GEMMs and layer norms (none
built in the step, none built twice), a second call finds them listed and records nothing, and the
step's loss is the one without compiling ahead."""

from __future__ import annotations

import copy
import sys

import pytest

torch = pytest.importorskip("torch", reason="convforge.torch needs PyTorch (pip install 'convforge[torch]')")
import torch.nn.functional as F  # noqa: E402

from convforge.torch import fuse  # noqa: E402
from convforge.torch.train_ahead import compile_training_ahead, record_calls  # noqa: E402
from test_torch_prepare import _net  # noqa: E402

prep_mod = sys.modules["convforge.torch.prepare"]


def test_recording_a_training_model_leaves_it_as_it_was() -> None:
    fused = fuse(_net())[0].train()
    x = torch.randn(2, 3, 11, 9)
    state = {k: v.clone() for k, v in fused.state_dict().items()}
    bench = torch.backends.cudnn.benchmark
    assert record_calls(fused, (x,), {}) == []  # CPU tensors: convforge runs none of these layers
    assert torch.backends.cudnn.benchmark == bench
    assert all(torch.equal(state[k], v) for k, v in fused.state_dict().items())  # no running statistic moved
    bns = [m for m in fused.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert bns and all(bn.training for bn in bns)
    assert not any("forward" in m.__dict__ for m in fused.modules())
    want = copy.deepcopy(fused)
    torch.testing.assert_close(fused(x), want(x), rtol=0, atol=0)


def test_recording_draws_no_random_number_the_step_would_draw() -> None:
    """A dropout in the recording forward leaves the generator where it was: the step draws the masks it
    would have drawn without compiling ahead."""
    net = torch.nn.Sequential(_net(), torch.nn.Dropout(0.5))
    fused = fuse(net)[0].train()
    x = torch.randn(2, 3, 11, 9)
    before = torch.get_rng_state()
    record_calls(fused, (x,), {})
    assert torch.equal(torch.get_rng_state(), before)


def test_recording_calls_no_forward_hook_of_the_model() -> None:
    """A user's forward hook (a feature collector, a call counter) never sees the recording's forward, and
    is back in place after it; a pre-hook (weight_norm computes its weight in one) still runs."""
    fused = fuse(_net())[0].train()
    seen: list[str] = []
    mods = [m for m in fused.modules() if m is not fused]
    handles = [mods[0].register_forward_hook(lambda *_: seen.append("post")),
               mods[0].register_forward_hook(lambda *a, **k: seen.append("kw"), with_kwargs=True),
               fused.register_forward_hook(lambda *_: seen.append("model"), always_call=True),
               mods[0].register_forward_pre_hook(lambda *_: seen.append("pre"))]
    x = torch.randn(2, 3, 11, 9)
    record_calls(fused, (x,), {})
    assert seen == ["pre"]
    fused(x)
    assert sorted(seen[1:]) == ["kw", "model", "post", "pre"]
    for h in handles:
        h.remove()


def test_a_pre_activation_batch_norm_is_predicted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A conv that folds a training pre-activation (BN -> ReLU -> conv, DenseNet's) notes the batch norm's input,
    and the prediction adds that batch norm's program by bn_act's call key, once for calls of one key (DenseNet's
    first step compiled 58 of them one after another before)."""
    from convforge.torch import batchnorm as bn_train
    from convforge.torch import train_ahead

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.BatchNorm2d(8),
                              torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1))
    fused = fuse(net)[0].train()
    mods = dict(fused.named_modules())
    conv = mods["4"]
    bn = conv._cf_pre.bn
    x = torch.randn(2, 8, 5, 7).contiguous(memory_format=torch.channels_last)
    assert train_ahead._pre_of(conv, x, {id(bn)}) == (bn, True, torch.float32, "nhwc")
    assert train_ahead._pre_of(conv, x, set()) is None  # a batch norm that does not train: nothing
    assert train_ahead._pre_of(mods["0"], x, {id(bn)}) is None  # no pre-activation
    monkeypatch.setattr(bn_train, "program_work", lambda key: ("work", key))
    call = train_ahead.LayerCall((2, 8, 5, 7), (4, 8, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1, torch.float32, True, 0,
                                 True, "auto", None, None, pre=(bn, True, torch.float32, "nhwc"))
    seen: set = set()
    key = bn_train.key_of(bn, (2, 8, 5, 7), torch.float32, "nhwc", False, True, 0)
    assert train_ahead._pre_work(call, seen) == [("work", key)]
    assert train_ahead._pre_work(call, seen) == []


def test_the_hook_is_quiet_on_cpu_and_without_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []
    monkeypatch.setattr(prep_mod, "_train_ahead", lambda m, a, k: ran.append(id(m)))
    monkeypatch.setattr(prep_mod.config, "train_ahead", True)
    fused = fuse(_net())[0].train()
    x = torch.randn(2, 3, 11, 9)
    fused(x)  # CPU tensors
    with torch.no_grad():
        fused(x)
    assert ran == [] and fused.__dict__.get("_cf_train_ahead_pending") is True


@pytest.mark.gpu
@pytest.mark.parametrize("arch, dtype", [("resnet18", torch.float16), ("convnext_tiny", torch.bfloat16)])
def test_step_programs_are_built_ahead(gpu, monkeypatch: pytest.MonkeyPatch, tmp_path, arch,  # type: ignore[no-untyped-def]
                                       dtype) -> None:
    """ConvNeXt-T with its MLP on convforge's nodes (config.mlp_train): their GEMMs' and layer norms' programs
    predicted too; its stochastic depth draws the same masks on both sides (the recording draws none)."""
    import torchvision

    from convforge.backends import get_backend
    from convforge.backends.cache import DiskCache
    from convforge.config import config

    monkeypatch.setattr(config, "mlp_train", True)
    torch.manual_seed(0)
    cl = torch.channels_last
    model = getattr(torchvision.models, arch)(num_classes=10).cuda().to(memory_format=cl)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 3, 64, 64, device="cuda").contiguous(memory_format=cl)
    target = torch.randint(0, 10, (4,), device="cuda")
    be = get_backend("cuda", 0)
    # a cold cache, on disk and in this process: programs an earlier test or run left would be found, not built
    monkeypatch.setattr(be, "disk", DiskCache(tmp_path / "programs"))
    monkeypatch.setattr(be, "_programs", {})
    built: list[str] = []
    real = type(be).build

    def counted(self, source):  # type: ignore[no-untyped-def]
        built.append(source)
        return real(self, source)

    monkeypatch.setattr(type(be), "build", counted)
    ta = sys.modules["convforge.torch.train_ahead"]
    manifest = tmp_path / "manifest.json"
    monkeypatch.setattr(ta, "_manifest", lambda m, a, k: manifest)  # not one an earlier run left in the cache
    recorded: list[int] = []
    real_record = ta.record_calls
    monkeypatch.setattr(ta, "record_calls", lambda *a: recorded.append(1) or real_record(*a))
    fused = fuse(model)[0].train()
    fused.__dict__["_cf_train_ahead_pending"] = False  # compiled ahead by hand below, not by the hook
    with torch.autocast("cuda", dtype=dtype):
        n = compile_training_ahead(fused, x)
        assert manifest.is_file() and recorded == [1]
        assert compile_training_ahead(fused, x) == 0 and recorded == [1]  # listed and cached: nothing recorded
    ahead = set(built)
    assert n > 0 and len(ahead) >= n, (n, len(ahead))
    built.clear()
    losses = []
    for m in (fused, fuse(ref)[0].train()):
        m.__dict__["_cf_train_ahead_pending"] = False
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=dtype):
            loss = F.cross_entropy(m(x), target)
        loss.backward()
        losses.append(float(loss))
        if m is fused:
            assert not ahead & set(built), "a program compiled ahead was built again in the step"
            missed = [src.splitlines()[0] for src in built]
            assert not missed, f"the step built {len(missed)} programs train_ahead did not predict: {missed[:8]}"
    assert losses[0] == losses[1]


def test_each_pass_is_predicted_with_its_own_epilogue(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward's program with the epilogue its training call runs (a bias; bias and ReLU for a conv ->
    ReLU node; a fused block's conv without a bias only), dgrad and wgrad with none."""
    from convforge.plan import Epilogue

    ta = sys.modules["convforge.torch.train_ahead"]
    asked: list[tuple[str, object]] = []
    monkeypatch.setattr(ta, "_pass_work", lambda call, p, epi=None: asked.append((p, epi)))
    monkeypatch.setattr(ta, "_block_work", lambda call, seen: [])
    base = dict(x_shape=(2, 8, 9, 9), w_shape=(16, 8, 3, 3), stride=(1, 1), pad=(1, 1, 1, 1), dilation=(1, 1),
                groups=1, dtype=torch.float16, channels_last=True, device=0, needs_dgrad=True, algo="auto",
                precision=None, max_error=None)
    cases = [(dict(has_bias=True, relu_node=True), Epilogue(True, True)),
             (dict(has_bias=True), Epilogue(True, False)),
             (dict(), Epilogue()),
             (dict(block=("m", "bn", False, True)), Epilogue()),
             (dict(has_bias=True, block=("m", "bn", False, True)), None)]
    for extra, fwd in cases:
        asked.clear()
        ta._call_work(ta.LayerCall(**base, **extra), set())
        want = ([("fprop", fwd)] if fwd is not None else []) + [("dgrad", None), ("wgrad", None)]
        assert asked == want, (extra, asked)
