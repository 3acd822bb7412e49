"""``convforge.torch.fuse`` on the CPU (torch present; skipped with a reason otherwise).

On CPU tensors a fused model runs the unfused PyTorch ops, so these tests check the rewrite: which
chains were fused and why others were not, outputs, running statistics and gradients against the
original model in eval and train mode, ``state_dict`` keys and tensors identical, parameters
shared, the original untouched, the fx fallback; the batch-norm fold and its cache; and the folded
path's wiring with a stand-in runner. The CUDA paths are in tests/test_torch_fuse_gpu.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: convforge.torch.fuse tests skipped")
nn, F = torch.nn, torch.nn.functional

import convforge.torch as ct  # noqa: E402
from convforge.torch import fused as fused_mod  # noqa: E402


class Every(nn.Module):
    """Every pattern fuse handles, and the ones it must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)  # shared by two chains
        self.c2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.twice = nn.Conv2d(8, 8, 1)  # output used twice: not fused
        self.c3 = nn.Conv2d(8, 8, 5, stride=2, padding=(2, 1))  # conv -> torch.relu
        self.c4, self.bn4 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)  # conv -> bn (train mode)
        self.c5 = nn.Conv2d(8, 8, 1)  # conv -> torch.add(other, conv) -> F.relu(inplace)
        self.c6, self.bn6 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)  # bn -> Tensor.add
        self.c7 = nn.Conv2d(8, 8, 3, padding=1)  # conv -> Tensor.relu_
        self.g = nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular")  # a padded copy, then a plain conv
        self.dw, self.bndw = nn.Conv2d(8, 16, 3, padding=1, groups=8), nn.BatchNorm2d(16)  # depthwise, m=2
        self.gc = nn.Conv2d(16, 8, 3, padding=1, groups=4)  # grouped -> relu
        self.c8, self.bn8 = nn.Conv2d(8, 8, 11, padding=5), nn.BatchNorm2d(8)  # conv -> bn -> relu (shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.c1(x)))
        identity = out
        out = self.bn2(self.c2(out))
        out += identity
        out = self.relu(out)
        t = self.twice(out)
        out = t + F.relu(t)
        out = torch.relu(self.c3(out))
        out = self.bn4(self.c4(out))
        out = F.relu(torch.add(out, self.c5(out)), inplace=True)
        out = self.bn6(self.c6(out)).add(out)
        out = self.c7(out).relu_()
        out = self.g(out)
        out = F.relu(self.bndw(self.dw(out)))
        out = torch.relu(self.gc(out))
        return self.relu(self.bn8(self.c8(out)))


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial batch-norm statistics and affine parameters (a fold of the identity proves nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                if m.affine:
                    m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                    m.bias.copy_(torch.randn(m.num_features, generator=g))
                m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    assert list(sa) == list(sb)
    assert all(sa[k] is sb[k] for k in sa), [k for k in sa if sa[k] is not sb[k]]


def test_every_pattern_is_fused_or_reported():
    model = _randomize(Every()).eval()
    fused, report = ct.fuse(model)
    assert report.fused == {"c1": "bn+relu", "c2": "bn+add+relu", "c3": "relu", "c4": "bn", "c5": "add+relu",
                            "c6": "bn+add", "c7": "relu", "dw": "bn+relu", "gc": "relu", "c8": "bn+relu"}, report.fused
    assert report.unfused == {"twice": "output used 2 times"}
    assert not report.left
    assert sorted(report.converted) == sorted([*report.fused, "twice", "g"])
    text = str(report)
    assert "10 fused" in text and "twice: not fused: output used 2 times" in text
    assert isinstance(fused.c2, ct.FusedConv2d) and fused.c2._cf_bn is fused.bn2
    assert type(fused.twice) is ct.Conv2d and type(fused.g) is ct.Conv2d
    calls = [n.target for n in fused.graph.nodes if n.op == "call_module"]
    assert "bn1" not in calls and "bn2" not in calls and "relu" not in calls
    # the original is untouched: same module types, still called by its own forward
    assert type(model.c2) is nn.Conv2d and not hasattr(model.c2, "_cf_bn")
    _same_state(fused, model)
    assert fused.c1.weight is model.c1.weight and fused.bn2.running_var is model.bn2.running_var
    assert fused.bn2 is not model.bn2  # a structural copy: train()/eval() of one leaves the other
    fused.train()
    assert not model.training and not model.bn2.training


@pytest.mark.parametrize("mode", ["eval", "train", "bn4 train"])
def test_every_pattern_matches_the_original(mode):
    """Outputs, running statistics and gradients equal the original's (CPU: the same PyTorch ops)."""
    model = _randomize(Every())
    model.train(mode == "train")
    if mode == "bn4 train":
        model.bn4.train()
    ref = copy.deepcopy(model)
    fused, _ = ct.fuse(model)
    _matches(model, ref, fused, torch.randn(2, 3, 13, 17, generator=torch.Generator().manual_seed(1)))


def _matches(model, ref, fused, x) -> None:
    """``fused`` (of ``model``) against ``ref`` (a copy of the original): outputs, every parameter's gradient,
    every buffer (running statistics updated once, as PyTorch does)."""
    want, got = ref(x), fused(x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5), name
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), name


class Acts(nn.Module):
    """conv -> batch norm -> SiLU / HardSwish as EfficientNet's and MobileNet-v3's blocks write them, and
    the neighbours fuse must leave alone (an activation without a batch norm or after an add)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1, self.silu = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU(True)
        self.dw, self.bndw = nn.Conv2d(8, 8, 5, stride=2, padding=2, groups=8, bias=False), nn.BatchNorm2d(8)
        self.c2, self.bn2, self.hs = nn.Conv2d(8, 12, 1, bias=False), nn.BatchNorm2d(12), nn.Hardswish()
        self.c3 = nn.Conv2d(12, 12, 3, padding=1)  # conv -> SiLU, no batch norm: the SiLU stays
        self.c4, self.bn4 = nn.Conv2d(12, 12, 3, padding=1, bias=False), nn.BatchNorm2d(12)  # bn -> add -> SiLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.silu(self.bn1(self.c1(x)))
        out = F.silu(self.bndw(self.dw(out)), inplace=True)
        out = self.hs(self.bn2(self.c2(out)))
        out = F.hardswish(out + 0)  # not after a conv chain's batch norm
        out = F.silu(self.c3(out))
        return F.silu(self.bn4(self.c4(out)) + out)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_silu_and_hardswish_after_batch_norm_are_fused_and_match(mode):
    """conv -> BN -> SiLU / HardSwish (module, F., inplace) fuse as "bn+silu" / "bn+hardswish"; the others
    keep their activation outside; outputs, gradients and running statistics as the original's (CPU)."""
    model = _randomize(Acts()).train(mode == "train")
    ref = copy.deepcopy(model)
    fused, report = ct.fuse(model)
    assert report.fused == {"c1": "bn+silu", "dw": "bn+silu", "c2": "bn+hardswish", "c4": "bn+add"}, report.fused
    assert fused.c1._cf_act == "silu" and not fused.c1._cf_relu
    _matches(model, ref, fused, torch.randn(2, 3, 11, 13, generator=torch.Generator().manual_seed(3)))


def test_an_activation_is_refused_where_the_fused_module_cannot_apply_it():
    with pytest.raises(ValueError, match="act .'gelu'. must be one of"):
        ct.FusedConv2d.from_conv(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), act="gelu")
    with pytest.raises(ValueError, match="after a batch norm without residual or ReLU"):
        ct.FusedConv2d.from_conv(nn.Conv2d(3, 4, 3), None, act="silu")


def test_fold_matches_batch_norm_in_float64():
    conv = nn.Conv2d(5, 7, 3, padding=1).double()
    for affine in (True, False):
        bn = _randomize(nn.BatchNorm2d(7, eps=1e-3, affine=affine)).double().eval()
        with torch.no_grad():
            bn.running_mean.normal_()
        w, b = fused_mod.fold_bn(conv.weight, conv.bias, bn)
        assert w.dtype == b.dtype == torch.float32 and w.is_contiguous()
        x = torch.randn(2, 5, 9, 11, dtype=torch.float64)
        want = bn(conv(x))
        got = F.conv2d(x, w.double(), b.double(), padding=1)
        assert ((got - want).norm() / want.norm()) < 1e-6
    w, b = fused_mod.fold_bn(conv.weight, None, bn)
    assert torch.allclose(F.conv2d(x, w.double(), b.double(), padding=1), bn(F.conv2d(x, conv.weight, padding=1)),
                          atol=1e-5)


def test_fold_is_cached_per_version_and_refolds_in_place(monkeypatch):
    model = _randomize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
    fused, _ = ct.fuse(model)
    m = fused.get_submodule("0")
    monkeypatch.setattr(fused_mod, "_CAPTURING", lambda: False)  # CPU torch cannot ask
    folds = []
    real = fused_mod.fold_bn
    monkeypatch.setattr(fused_mod, "fold_bn", lambda *a: folds.append(1) or real(*a))
    w1, b1 = m._fold()
    w2, b2 = m._fold()
    assert w1 is w2 and b1 is b2 and len(folds) == 1
    with torch.no_grad():
        model[1].running_var.mul_(4.0)  # shared with the fused model's batch norm
    w3, b3 = m._fold()
    assert w3 is w1 and b3 is b1 and len(folds) == 2  # re-folded into the same tensors
    want, _ = real(m.weight, m.bias, m._cf_bn)
    assert torch.equal(w3, want)
    with torch.no_grad():
        m.weight.add_(1.0)
    m._fold()
    assert len(folds) == 3
    with torch.inference_mode():
        w4, _ = m._fold()
    assert len(folds) == 3 and not w4.is_inference()


def test_sources_are_what_getattr_answers():
    """The fold's six source tensors, read from the modules' own tables, are the objects getattr
    answers: with and without conv bias, affine or not, with and without running statistics, and
    for a weight that is a plain attribute (the hook-based weight norm: not in ``_parameters``,
    getattr finds it). An in-place update of any of them changes the fold key."""
    cases = [(True, True, True), (False, True, True), (True, False, True), (True, True, False)]
    for bias, affine, stats in cases:
        conv, bn = nn.Conv2d(3, 4, 3, bias=bias), nn.BatchNorm2d(4, affine=affine, track_running_stats=stats)
        m = ct.FusedConv2d.from_conv(conv, bn)
        want = (conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var)
        got = fused_mod._sources(m)
        assert all(g is t for g, t in zip(got, want, strict=True)), (bias, affine, stats)
        key = fused_mod._fold_key(got, bn)
        for t in got:
            if t is not None:
                with torch.no_grad():
                    t.add_(1.0)
                assert fused_mod._fold_key(fused_mod._sources(m), bn) != key
                key = fused_mod._fold_key(fused_mod._sources(m), bn)
    conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the hook-based weight norm is deprecated
        torch.nn.utils.weight_norm(conv)  # weight: a plain attribute its forward pre-hook sets
    m = ct.FusedConv2d.from_conv(conv, bn)
    m(torch.randn(1, 3, 5, 5))  # the hook computes the weight
    assert "weight" not in m._parameters and fused_mod._sources(m)[0] is m.__dict__["weight"]
    assert fused_mod._sources(ct.FusedConv2d.from_conv(nn.Conv2d(3, 4, 3)))[2:] == (None,) * 4


class _FakeRun:
    """Stands in for a device runner: PyTorch's conv with the plan's epilogue, on CPU tensors."""

    filters = None

    def __init__(self, m: nn.Conv2d, relu: bool, residual: bool) -> None:
        self.m, self.relu, self.residual, self.calls = m, relu, residual, []

    def __call__(self, x, w, b, derived=None, res=None):
        self.calls.append((w, b, res))
        assert (res is not None) == self.residual
        y = F.conv2d(x, w, b, self.m.stride, self.m.padding)
        y = y + res if res is not None else y
        return torch.relu(y) if self.relu else y


@pytest.mark.parametrize("name,res_in_plan", [("c1", False), ("c2", False), ("c2", True), ("c3", False)])
def test_folded_path_takes_the_native_route(monkeypatch, name, res_in_plan):
    """A plan without the residual is conv2d's plan for the folded weights: the module asks the
    native fast path's ``run`` with conv2d's 14 arguments (ReLU in them only when no add follows);
    a plan that adds the residual asks ``run_res`` with them (ReLU: after the add) and the
    residual. On a miss the Python runner runs and the call is filed (the residual plan as such);
    on a hit nothing runs in Python; a capture with static weights never asks. Stand-ins: no CUDA."""
    from convforge.frontends import fast_path

    model = _randomize(Every()).eval()
    fused, _ = ct.fuse(model)
    m = getattr(fused, name)
    residual = m._cf_residual
    run = _FakeRun(m, relu=m._cf_relu and (res_in_plan or not residual), residual=res_in_plan)
    asked, filed, hits, given = [], [], [], []

    def native(*call):
        asked.append(call[:14])  # conv2d's 14 arguments, then the residual for run_res
        given.append(call[14:])
        if not filed:
            return None
        x, w, b, stride, pad, dil = call[:6]
        y = F.conv2d(F.pad(x, (pad[2], pad[3], pad[0], pad[1])), w, b, stride, 0, dil)
        y = y + call[14] if len(call) == 15 else y
        hits.append(1)
        return torch.relu(y) if call[9] else y

    capturing = [False]
    monkeypatch.setattr(fused_mod, "_CAPTURING", lambda: capturing[0])
    monkeypatch.setattr(fast_path, "RUN_RES" if res_in_plan else "RUN", native)
    monkeypatch.setattr(fast_path, "RUN" if res_in_plan else "RUN_RES", None)  # never asked
    monkeypatch.setattr(fast_path, "file_native", lambda r, call, residual=False: filed.append((r, call, residual)))
    monkeypatch.setattr(ct.FusedConv2d, "_folds", lambda self, x, res, src: True)
    x = torch.randn(2, m.in_channels, 13, 17)
    with torch.no_grad():
        y_shape = m.unfused(x).shape
        res = torch.randn(y_shape) if residual else None
        monkeypatch.setattr(ct.FusedConv2d, "_fused_runner", lambda self, x: (run, res_in_plan, tuple(y_shape)))
        want = m.unfused(x, res)
        outs = [m(x, res) for _ in range(2)]
        capturing[0] = True
        outs.append(m(x, res))
    for got in outs:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    w, b = m._fold() if m._cf_bn is not None else (m.weight, m.bias)
    call = asked[0]
    assert call[1] is w and call[2] is b and call[3:9] == (m.stride, fused_mod.padding_quad(m), m.dilation,
                                                            m.algo, None, None)
    assert call[9] == (m._cf_relu and (res_in_plan or not residual)) and call[10:] == (None, m.precision,
                                                                                        m.max_error, m.groups)
    assert all(g == ((res,) if res_in_plan else ()) for g in given)
    assert len(asked) == 2 and len(filed) == 1 and filed[0][0] is run and filed[0][1][1:] == call[1:]
    assert filed[0][2] == res_in_plan  # a residual plan is filed under its own key
    assert hits == [1] and len(run.calls) == 2  # the miss, then the capture (static weights: Python)


@pytest.mark.parametrize("res_in_plan", [True, False])
def test_folded_path_wiring(monkeypatch, res_in_plan):
    """The folded path (a stand-in runner: no CUDA here) runs the folded weights and bias, puts
    the residual in the plan or adds it after, and matches the original model."""
    model = _randomize(Every()).eval()
    fused, _ = ct.fuse(model)
    m = fused.c2
    run = _FakeRun(m, relu=res_in_plan, residual=res_in_plan)
    monkeypatch.setattr(fused_mod, "_CAPTURING", lambda: False)  # CPU torch cannot ask
    monkeypatch.setattr(ct.FusedConv2d, "_folds", lambda self, x, res, src: True)
    monkeypatch.setattr(ct.FusedConv2d, "_fused_runner", lambda self, x: (run, res_in_plan, (2, 8, 13, 17)))
    from convforge.frontends import fast_path  # the native route misses, files nothing (the stand-in has no exe)

    monkeypatch.setattr(fast_path, "RUN", lambda *a: None)
    monkeypatch.setattr(fast_path, "RUN_RES", lambda *a: None)
    monkeypatch.setattr(fast_path, "file_native", lambda *a, **k: None)
    x, res = torch.randn(2, 8, 13, 17), torch.randn(2, 8, 13, 17)
    with torch.no_grad():
        got = m(x, res)
        want = torch.relu(model.bn2(model.c2(x)) + res)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    w, b, r = run.calls[-1]
    assert w is m._fold()[0] and b is m._fold()[1] and (r is res) == res_in_plan
    with torch.no_grad():
        m(x, torch.randn(1, 8, 1, 1))  # a broadcasting add: the unfused path
    assert len(run.calls) == 1


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.c(x))
        return y if y.sum() > 0 else -y  # data-dependent control flow


def test_untraceable_model_falls_back_to_convert():
    model = _Untraceable().eval()
    fused, report = ct.fuse(model, algo="direct")
    assert "cannot trace" in report.unfused[""] and "convert()" in report.unfused[""]
    assert "<model>: not fused: torch.fx cannot trace" in str(report)
    _same_state(fused, model)
    assert type(model.c) is nn.Conv2d and fused is not model
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(fused(x), model(x))


def test_bad_options_are_refused():
    with pytest.raises(TypeError, match="unknown option"):
        ct.fuse(Every(), precison="fp32")
    with pytest.raises(ValueError, match="precision"):
        ct.fuse(Every(), precision="fp16")
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        ct.fuse("resnet50")


@pytest.mark.parametrize("name,size,train", [("resnet18", 64, False), ("resnet18", 64, True),
                                             ("resnet50", 64, False), ("googlenet", 96, False),
                                             ("inception_v3", 299, False)])
def test_torchvision_models(name, size, train):
    tv = pytest.importorskip("torchvision", reason="torchvision not installed: fuse on its models skipped")
    kw = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
    torch.manual_seed(0)
    model = _randomize(getattr(tv.models, name)(weights=None, **kw)).train(train)
    ref = copy.deepcopy(model)
    fused, report = ct.fuse(model)
    assert not report.left and not report.unfused and report.fused, report
    if name.startswith("resnet"):
        assert report.fused["layer1.0.conv2" if name == "resnet18" else "layer1.0.conv3"] == "bn+add+relu"
    else:
        assert set(report.fused.values()) == {"bn+relu"}
    _same_state(fused, model)
    x = torch.randn(2 if train else 1, 3, size, size, generator=torch.Generator().manual_seed(2))
    with torch.set_grad_enabled(train):
        want, got = ref(x), fused(x)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    if train:
        got.sum().backward()
        want.sum().backward()
        g1, g2 = model.layer1[0].conv2.weight.grad, ref.layer1[0].conv2.weight.grad
        assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,size", [("efficientnet_b0", 64), ("convnext_tiny", 64)])
def test_stochastic_depth_follows_the_mode_after_an_eval_fuse(name, size):
    """A model fused in eval (as the bench and most users do) and then trained drops paths as the
    original does in training: torchvision's StochasticDepth stays a module that reads its mode at each
    call (traced through, ``training=False`` stuck and training silently lost its regularisation)."""
    tv = pytest.importorskip("torchvision", reason="torchvision not installed: fuse on its models skipped")
    torch.manual_seed(0)
    model = getattr(tv.models, name)(weights=None, stochastic_depth_prob=0.5).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("layer_scale"):
                p.uniform_(0.1, 1.0)
    ref = copy.deepcopy(model)
    fused, _ = ct.fuse(model)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(fused(x), ref(x), rtol=1e-4, atol=1e-5)  # eval: the identity
        fused.train()
        ref.train()
        torch.manual_seed(7)
        want = ref(x)
        torch.manual_seed(7)
        got = fused(x)
        torch.manual_seed(8)
        other = fused(x)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(other, got, rtol=1e-3, atol=1e-4)  # paths were dropped, by the seed
