"""GPU tier of ``convforge.torch.fuse`` (skips without a CUDA device or torch).

Run on the lent GPU: ``python -m pytest -q tests/test_torch_fuse_gpu.py``. Outputs are checked
against a float64 run of the original model (outputs land in caching-allocator blocks poisoned
with NaN first); eval inference must take the folded path (batch norms not called, one plan per
conv, no fold and no filter transform on warm calls); training matches PyTorch's outputs,
gradients and running statistics; CUDA graphs capture and replay, and see in-place updates.
"""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of convforge.torch.fuse: torch not installed")
nn, F = torch.nn, torch.nn.functional


class Block(nn.Module):
    """A ResNet basic block plus a strided 5x5 conv -> ReLU and an 11x11 conv -> BN: every chain."""

    def __init__(self, c: int = 16, full: bool = True) -> None:
        super().__init__()
        self.full = full  # False: the basic block alone (3x3 stride-1 convs: every family runs them)
        self.c1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.c3 = nn.Conv2d(c, c, 5, stride=2, padding=(2, 1))
        self.c4, self.bn4 = nn.Conv2d(c, 8, 11, padding=5), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.c1(x)))
        out = self.bn2(self.c2(out))
        out += x
        out = self.relu(out)
        if not self.full:
            return out
        out = F.relu(self.c3(out))
        return self.bn4(self.c4(out))


def _model(seed: int = 0, full: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), Block(16, full))
    if full:
        model.extend([nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)])
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 1.5)
    return model.cuda()


def _err(y: torch.Tensor, model: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    assert not torch.isnan(y).any()
    return float((y.double() - want).norm() / want.norm())


def _poison(shape):
    t = torch.full(shape, float("nan"), device="cuda")
    del t


def _fused_modules(fused: nn.Module) -> list:
    import convforge.torch as ct

    return [m for m in fused.modules() if isinstance(m, ct.FusedConv2d)]


def _tolerance(model: nn.Module) -> float:
    """The largest stated tolerance of the plans convforge's convs in ``model`` ran, times 4 (a
    few layers in a row)."""
    import convforge.torch as ct

    tol = 0.0
    for m in model.modules():
        if isinstance(m, ct.Conv2d):
            for key, v in m._cf_cache.items():
                if v is None:
                    continue
                # runners: "fused" entries' first item, or the entry itself; "fold" holds folded weights and
                # "block" a training block's native filing (FusedConv2d._file_block)
                run = v[0] if key[0] == "fused" else None if key[0] in ("fold", "block") else v
                if run is not None:
                    tol = max(tol, run.exe.plan.tolerance)
    assert tol > 0, "no convforge plan ran"
    return 4 * tol


@pytest.mark.parametrize("algo", ["auto", "implicit_gemm", "winograd"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_eval_takes_the_folded_path_and_matches_float64(gpu, algo, mode, monkeypatch):
    """implicit_gemm and Winograd add the residual in their epilogue; warm calls, the residual
    plans included, run in C; the tolerance is the largest stated tolerance of the chosen plans."""
    import convforge.torch as ct
    from convforge import kernels
    from convforge.frontends import torch_run
    from convforge.torch import fused as fused_mod
    from convforge.torch import native

    model = _model(0, full=algo != "winograd").eval()  # Winograd runs only the 3x3 stride-1 convs
    fused, report = ct.fuse(model, algo=algo)
    assert report.fused["1.c2"] == "bn+add+relu" and not report.left
    x = torch.randn(3, 3, 13, 17, device="cuda")
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with ctx:
        ct.prepare(fused, x)  # what the first call would do first: a recording pass with PyTorch's convs
    bn_calls = []
    for m in fused.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.register_forward_hook(lambda *a: bn_calls.append(1))
    with ctx:
        _poison((3, 16, 13, 17))
        y = fused(x)
    assert not bn_calls  # folded: no batch-norm kernel ran
    for m in _fused_modules(fused):
        entries = [v for k, v in m._cf_cache.items() if k[0] == "fused"]
        assert len(entries) == 1 and entries[0] is not None, m
        run, res_in_plan, _ = entries[0]
        if m._cf_residual:  # in the plan exactly when the chosen variant has a residual store path
            residual_ok = kernels.get_variant(run.exe.plan.variant).residual_ok
            assert res_in_plan == run.exe.plan.epilogue.residual == residual_ok
            assert residual_ok or algo == "auto"
    tol = _tolerance(fused)
    assert _err(y, model, x) < tol, (algo, tol)
    folds, transforms, python_runs = [], [], []
    real_fold, real_transform = fused_mod.fold_bn, torch_run.torch_transform
    real_python = ct.FusedConv2d._run_python
    monkeypatch.setattr(fused_mod, "fold_bn", lambda *a: folds.append(1) or real_fold(*a))
    monkeypatch.setattr(torch_run, "torch_transform", lambda *a: transforms.append(1) or real_transform(*a))
    monkeypatch.setattr(ct.FusedConv2d, "_run_python",
                        lambda self, *a: python_runs.append(self) or real_python(self, *a))
    mod = native.load()
    before = mod.stats()["transforms"] if mod is not None else 0
    with ctx:
        y2 = fused(x)
    assert not folds and not transforms and torch.equal(y, y2)  # warm: no fold, no filter transform
    if mod is not None:  # warm plans, with the residual or without, ran in C, without a transform there either
        assert mod.stats()["transforms"] == before
        assert not python_runs


def test_a_residual_module_called_without_its_residual_runs_as_unfused(gpu):
    """conv -> bn -> ReLU, as the unfused path (and the original module alone) computes it: the
    folded path is not taken, whether or not the plan would add the residual."""
    import convforge.torch as ct

    for algo in ("implicit_gemm", "winograd"):
        model = _model(0, full=algo != "winograd").eval()
        fused, _ = ct.fuse(model, algo=algo)
        m = next(mm for mm in _fused_modules(fused) if mm._cf_residual)
        x = torch.randn(2, m.in_channels, 13, 17, device="cuda")
        with torch.no_grad():
            torch.testing.assert_close(m(x), m.unfused(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo", ["implicit_gemm", "winograd"])
def test_residual_plans_run_in_c_and_refuse_what_does_not_fit(gpu, algo, monkeypatch):
    """A warm plan that adds the residual runs from C (``run_res``, one entry under its own key);
    a residual that is an unaligned view or not contiguous takes Python's path, another residual
    of the right shape stays in C; every output matches the unfused module."""
    import convforge.torch as ct
    from convforge.torch import native

    mod = native.load()
    if mod is None:
        pytest.fail("the native fast path did not build on the GPU machine")
    model = _model(0, full=algo != "winograd").eval()
    fused, _ = ct.fuse(model, algo=algo)
    m = next(mm for mm in _fused_modules(fused) if mm._cf_residual)
    x = torch.randn(2, m.in_channels, 13, 17, device="cuda")
    python_runs = []
    real_python = ct.FusedConv2d._run_python
    monkeypatch.setattr(ct.FusedConv2d, "_run_python",
                        lambda self, *a: python_runs.append(1) or real_python(self, *a))
    with torch.no_grad():
        res = torch.randn(m.unfused(x).shape, device="cuda")
        want = m.unfused(x, res)
        entries = mod.stats()["entries"]
        torch.testing.assert_close(m(x, res), want, rtol=1e-4, atol=1e-4)  # cold: Python's path, filed
        assert python_runs == [1] and mod.stats()["entries"] == entries + 1
        torch.testing.assert_close(m(x, res), want, rtol=1e-4, atol=1e-4)
        assert python_runs == [1]  # warm: in C
        flat = torch.randn(res.numel() + 1, device="cuda")
        odd = flat[1:].view(res.shape)  # 4 bytes past an allocation: not 16-byte aligned
        odd.copy_(res)
        torch.testing.assert_close(m(x, odd), want, rtol=1e-4, atol=1e-4)
        assert python_runs == [1, 1]
        strided = res.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, not contiguous
        torch.testing.assert_close(m(x, strided), want, rtol=1e-4, atol=1e-4)
        assert python_runs == [1, 1, 1]
        other = torch.randn_like(res)
        torch.testing.assert_close(m(x, other), m.unfused(x, other), rtol=1e-4, atol=1e-4)
        assert python_runs == [1, 1, 1]  # another residual of the right shape: C
        assert mod.stats()["entries"] == entries + 1


def test_training_matches_pytorch(gpu, monkeypatch):
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _model(1).train()
    ref = copy.deepcopy(model)
    fused, _ = ct.fuse(model)
    x = torch.randn(4, 3, 15, 15, device="cuda")
    target = torch.randint(0, 5, (4,), device="cuda")
    y, want = fused(x), ref(x)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    F.cross_entropy(y, target).backward()
    F.cross_entropy(want, target).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5, msg=name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = F.cross_entropy(fused(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    fused.eval()  # the trained weights and statistics, folded
    model.eval()
    with torch.no_grad():
        assert _err(fused(x), model, x) < _tolerance(fused)


@pytest.mark.parametrize("static_weights", [True, False])
def test_cuda_graph_capture_replay_and_in_place_updates(gpu, static_weights, capture_graph):
    """Replays match float64; after an in-place update of a conv weight and a batch norm's
    statistics, static_weights=False replays see it at once, True after one eager forward (which
    re-folds into the same buffers)."""
    import convforge.torch as ct

    model = _model(2).eval()
    fused, _ = ct.fuse(model, static_weights=static_weights)
    x = torch.randn(2, 3, 16, 16, device="cuda")
    with torch.no_grad():
        graph, static_y = capture_graph(lambda: fused(x))
        tol = _tolerance(fused)
        for seed in range(2):
            x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
            graph.replay()
            assert _err(static_y, model, x) < tol, seed
        model[1].c2.weight.mul_(-1.5)
        model[1].bn1.running_var.mul_(3.0)
        if static_weights:
            eager = fused(x)
            assert _err(eager, model, x) < tol  # re-folded
        graph.replay()
        assert _err(static_y, model, x) < tol


@pytest.mark.parametrize("name,batch,size", [("resnet18", 2, 64), ("resnet50", 2, 64)])
def test_torchvision_resnets(gpu, name, batch, size, monkeypatch):
    tv = pytest.importorskip("torchvision", reason="torchvision not installed")
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = getattr(tv.models, name)(weights=None).cuda().eval()
    fused, report = ct.fuse(model)
    assert not report.left and not report.unfused
    x = torch.randn(batch, 3, size, size, device="cuda")
    with torch.no_grad():
        y = fused(x)
        pt = model(x)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    err, err_pt = (float((t.double() - want).norm() / want.norm()) for t in (y, pt))
    assert err < _tolerance(fused), (err, err_pt)
    print(f"{name}: fused rel err {err:.2e}, PyTorch FP32 {err_pt:.2e}")


@pytest.mark.parametrize("autocast", [False, True])
def test_folded_branches_run_one_convforge_conv_a_block(gpu, autocast):
    """RepVGG / ACNet-style blocks (tests/test_torch_branches.py's model) fused in eval on CUDA: each block's
    BranchSum runs its one folded FusedConv2d (the branches' convs never called), channels_last, FP32 and
    under FP16 autocast, against the original model in float64."""
    import convforge.torch as ct
    from convforge.torch.branches import BranchSum
    from test_torch_branches import _model

    m = _model().cuda().to(memory_format=torch.channels_last)
    f, report = ct.fuse(m)
    sums = [mod for mod in f.modules() if isinstance(mod, BranchSum)]
    assert len(sums) == 5, report.fused
    x = torch.randn(4, 8, 31, 29, device="cuda").contiguous(memory_format=torch.channels_last)
    want = copy.deepcopy(m).double()(x.double())
    for s in sums:  # the branches' own convs must not run once folded
        for conv, _ in s._cf_branches:
            if conv is not None:
                conv.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(AssertionError("a branch ran")))
    with torch.no_grad(), torch.autocast("cuda", torch.float16, enabled=autocast):
        for _ in range(2):
            y = f(x)
    err = float((y.double() - want).norm() / want.norm())
    assert err < (3e-3 if autocast else 1e-5), err
    assert all(s._cf_conv is not None and s._cf_conv._cf_cache for s in sums)
