"""GPU tier of linear fusion (torch/linear.py; skips without a CUDA device or torch): ``FusedLinear``
runs the tensor-core generator's channels-last 1x1 plans (sm_90) with GELU, the folded layer scale
and the residual in the epilogue, against float64 runs of the original operations (outputs land in
caching-allocator blocks poisoned with NaN first). Run on the lent GPU:
``python -m pytest -q tests/test_torch_linear_gpu.py``."""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of linear fusion: torch not installed")
nn, F = torch.nn, torch.nn.functional

from test_torch_linear import Block  # noqa: E402


def _poison(shape, dtype=torch.float32):
    t = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    del t


def _rel(got, want):
    assert not torch.isnan(got).any(), "NaN in the output: an element was never written"
    return float((got.double() - want).norm() / want.norm())


def _ran(m) -> list:
    """The plans a FusedLinear's runners hold (none: it ran PyTorch's operations)."""
    return [r.exe.plan for r in m._cf_cache.values() if r is not None]


@pytest.fixture
def hopper(gpu):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the channels-last tensor-core plans need sm_90")
    return gpu


CASES = [((1, 13, 7, 5), 12, torch.float32, "fp32"), ((2, 9, 11, 24), 37, torch.float32, "fp32"),
         ((3, 8, 8, 96), 384, torch.float32, "relaxed"), ((2, 5, 7, 64), 40, torch.float16, "fp32"),
         ((2, 6, 6, 32), 64, torch.bfloat16, "fp32")]


@pytest.mark.parametrize("shape, k, dtype, precision", CASES, ids=str)
def test_linear_gelu_against_float64(hopper, shape, k, dtype, precision):
    """Linear -> GELU on odd shapes (N=1, primes, C not a multiple of 4, K not a multiple of 4: the
    scalar stores) in each class and dtype, within the plan's stated tolerance."""
    from convforge.torch.linear import FusedLinear

    torch.manual_seed(1)
    lin = nn.Linear(shape[-1], k).cuda().to(dtype)
    m = FusedLinear.from_linear(lin, gelu=True, precision=precision)
    x = (torch.rand(shape, device="cuda") - 0.5).to(dtype)
    _poison((shape[0] * shape[1] * shape[2] * k + 4096,), dtype)
    with torch.no_grad():
        y = m(x)
    plans = _ran(m)
    assert plans and plans[0].spec.layout == "nhwc" and plans[0].epilogue.gelu, "convforge did not run the layer"
    want = F.gelu(F.linear(x.double(), lin.weight.double(), lin.bias.double()))
    assert y.shape == want.shape and y.dtype == dtype and y.is_contiguous()
    assert _rel(y, want) < plans[0].tolerance, plans[0].describe()


def test_convnext_blocks_fused_match_float64_and_capture(hopper, monkeypatch):
    """Two ConvNeXt blocks: every linear runs convforge's plan (the unfused path is never taken), the
    output is within the fp32 class of float64, and a CUDA graph capture replays it."""
    from convforge.torch.linear import FusedLinear

    torch.manual_seed(0)
    model = nn.Sequential(Block(32), Block(32)).cuda().eval()
    fused, report = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    assert len(report.linears) == 4

    def refuse(*_a, **_k):
        raise AssertionError("a fused linear took PyTorch's path")

    monkeypatch.setattr(FusedLinear, "unfused", refuse)
    x = torch.randn(2, 32, 11, 13, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
        y = fused(x)
        assert _rel(y, want) < 1e-5
        static = x.clone()
        fused(static)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fused(static)
        static.copy_(x * 0.5)
        g.replay()
        torch.testing.assert_close(out, fused(x * 0.5), rtol=1e-6, atol=1e-6)


def test_layer_scale_update_is_seen(hopper):
    """The folded weights follow in-place updates of the layer scale, the weights and the bias."""
    torch.manual_seed(2)
    model = Block(16).cuda().eval()
    fused, _ = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    x = torch.randn(1, 16, 9, 9, device="cuda")
    with torch.no_grad():
        fused(x)
        model.layer_scale.mul_(-2.0)
        model.fc2.bias.add_(1.0)
        model.fc2.weight.mul_(0.5)
        assert _rel(fused(x), copy.deepcopy(model).double()(x.double())) < 1e-5


def _convnext_tiny():
    """torchvision's ConvNeXt-T on the GPU in eval mode, its layer scales drawn from [0.1, 1) (not the 1e-6 they
    start at: the blocks' branches count in the output)."""
    torchvision = pytest.importorskip("torchvision", reason="torchvision not installed")
    torch.manual_seed(0)
    model = torchvision.models.convnext_tiny().cuda().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_scale"):
                p.uniform_(0.1, 1.0)
    return model


def test_torchvision_convnext_tiny(hopper):
    model = _convnext_tiny()
    fused, report = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    assert len(report.linears) == 36
    x = torch.randn(2, 3, 96, 96, device="cuda")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
        err = _rel(fused(x), want)
        base = _rel(model(x), want)
    assert err < 4 * base + 1e-6, (err, base)
    assert all(_ran(m) for m in fused.modules() if m.__class__.__name__ == "FusedLinear")


def _amp_error(model, x, dt, want):
    """(output, its error against ``want``) of ``model`` under CUDA autocast ``dt``."""
    with torch.autocast("cuda", dt):
        y = model(x)
    return y, _rel(y, want)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", ["channels_last", "nchw"])
def test_convnext_blocks_under_autocast(hopper, monkeypatch, dt, fmt):
    """A float32 model's ConvNeXt blocks inside autocast: every linear (and its folded layer norm) runs
    convforge's kernels in the region's dtype, the output has the dtype PyTorch's operations give (float32:
    the float32 layer scale promotes), and its error against float64 stays within 1.2x PyTorch autocast's."""
    from convforge.torch.linear import FusedLinear

    torch.manual_seed(3)
    model = nn.Sequential(Block(48), Block(48)).cuda().eval()
    fused, report = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    assert set(report.linears.values()) == {"norm+gelu", "permute+scale+add"}

    def refuse(*_a, **_k):
        raise AssertionError("a fused linear took PyTorch's path")

    x = torch.randn(3, 48, 13, 11, device="cuda")
    if fmt == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
        theirs, base = _amp_error(model, x, dt, want)
        _poison((3 * 13 * 11 * 48 * 4 + 4096,), dt)
        monkeypatch.setattr(FusedLinear, "unfused", refuse)
        ours, err = _amp_error(fused, x, dt, want)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert err <= 1.2 * base + 1e-4, (err, base)


def test_layer_norm_kernel_against_float64(hopper):
    """torch/layernorm.py on half and float32 rows (ConvNeXt-T's widths and an odd one), half output from
    float32 parameters as under autocast, the output poisoned first."""
    from convforge.torch.layernorm import norm_rows

    for c, xdt, out in ((96, torch.float16, torch.float16), (768, torch.bfloat16, torch.bfloat16),
                        (37, torch.float32, torch.float32), (384, torch.float16, torch.float32)):
        torch.manual_seed(c)
        norm = nn.LayerNorm(c, eps=1e-6).cuda()
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.2, 0.2)
        x = (2 + torch.randn(4, 9, 7, c, device="cuda")).to(xdt)
        _poison((4 * 9 * 7 * c + 4096,), out)
        with torch.no_grad():
            y = norm_rows(x, norm, out)
            want = F.layer_norm(x.double(), (c,), norm.weight.double(), norm.bias.double(), 1e-6)
        assert y is not None and y.dtype == out
        tol = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out]
        assert _rel(y, want) < tol, (c, xdt, out, _rel(y, want))


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16], ids=str)
def test_torchvision_convnext_tiny_under_autocast(hopper, monkeypatch, dt):
    """The whole model inside autocast, channels-last: every linear and every layer norm (the blocks' folded
    into their first linear, LayerNorm2d's on their own) on convforge's kernels, within 1.2x PyTorch
    autocast's error against float64."""
    model = _convnext_tiny()
    fused, report = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    assert len(report.norms) == 5  # the stem's, three downsampling layers', the head's
    x = torch.randn(2, 3, 96, 96, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
        theirs, base = _amp_error(model, x, dt, want)

        def refuse(*_a, **_k):
            raise AssertionError("PyTorch's layer norm ran")

        monkeypatch.setattr(F, "layer_norm", refuse)
        ours, err = _amp_error(fused, x, dt, want)
    assert ours.dtype == theirs.dtype
    assert err <= 1.2 * base + 1e-4, (err, base)
    lin = [m for m in fused.modules() if m.__class__.__name__ == "FusedLinear"]
    assert len(lin) == 36 and all(_ran(m) for m in lin)


class NormMlp(nn.Module):
    """LayerNorm -> Linear -> GELU over channels-last rows: one FusedLinear ("norm+gelu")."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(c, eps=1e-6), nn.Linear(c, 4 * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(self.norm(x)))


def test_a_trace_records_pytorchs_operations(hopper):
    """torch.jit.trace (what an ONNX export runs) of a fused model on the GPU, after a warm call kept its
    decision: the norm and the linear are PyTorch's operations in the trace, which computes what the model does."""
    torch.manual_seed(4)
    model = NormMlp().cuda().eval()
    fused, report = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    assert report.linears == {"fc": "norm+gelu"}
    x = torch.randn(2, 5, 7, 16, device="cuda")
    with torch.no_grad():
        fused(x)
        assert _ran(fused.get_submodule("fc"))
        traced = torch.jit.trace(fused, x)
        kinds = {n.kind() for n in traced.inlined_graph.nodes()}
        assert {"aten::layer_norm", "aten::linear", "aten::gelu"} <= kinds, kinds
        torch.testing.assert_close(traced(x * 2), model(x * 2), rtol=1e-5, atol=1e-5)


def test_kept_decisions_follow_the_kind_of_call(hopper):
    """A warm call's decision serves only calls of its kind: the autocast dtype switching back and forth, a
    float32 call outside autocast, then a call that needs gradients (PyTorch's differentiable operations)."""
    torch.manual_seed(6)
    model = nn.Sequential(Block(32)).cuda().eval()
    fused, _ = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    x = torch.randn(2, 32, 9, 9, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
        for dt in (torch.float16, torch.bfloat16, torch.float16, None):
            with torch.autocast("cuda", dt or torch.float16, enabled=dt is not None):
                ours, theirs = fused(x), model(x)
            assert ours.dtype == theirs.dtype, (dt, ours.dtype, theirs.dtype)
            assert _rel(ours, want) <= 1.2 * _rel(theirs, want) + (1e-5 if dt is None else 1e-4), dt
    x.requires_grad_(True)
    with torch.autocast("cuda", torch.float16):
        fused(x).float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert model[0].fc1.weight.grad is not None


def _train_grads(model, x, gy, dt):
    """y, gx and every parameter's gradient of one AMP step's backward (autocast ``dt``), or float64."""
    x = x.detach().clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    with torch.autocast("cuda", dt or torch.float16, enabled=dt is not None):
        y = model(x)
    y.backward(gy.to(y.dtype))
    return [y, x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16], ids=str)
def test_mlp_training_nodes_against_float64(hopper, monkeypatch, dt):
    """config.mlp_train (torch/mlp_train.py): two ConvNeXt blocks in training under autocast, channels-last: the
    nodes take every FusedLinear call, and y, gx and every parameter's gradient (float32 master weights) stay
    within 2x PyTorch AMP's error against float64, with PyTorch's dtypes."""
    from convforge.config import config
    from convforge.torch.linear import FusedLinear

    torch.manual_seed(7)
    model = nn.Sequential(Block(48), Block(48)).cuda().train()
    fused, _ = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    ref = copy.deepcopy(model).double()
    x = torch.randn(4, 48, 14, 12, device="cuda").contiguous(memory_format=torch.channels_last)
    gy = torch.randn(4, 48, 14, 12, device="cuda").contiguous(memory_format=torch.channels_last)
    want = _train_grads(ref, x.double(), gy.double(), None)
    theirs = _train_grads(model, x, gy, dt)
    monkeypatch.setattr(config, "mlp_train", True)

    def refuse(*_a, **_k):
        raise AssertionError("a FusedLinear took PyTorch's operations")

    monkeypatch.setattr(FusedLinear, "unfused", refuse)
    ours = _train_grads(fused, x, gy, dt)
    names = ["y", "gx", *(n for n, _ in model.named_parameters())]
    for name, a, b, r in zip(names, ours, theirs, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
        assert torch.isfinite(a).all(), name
        assert _rel(a, r) <= max(2 * _rel(b, r), 2e-3), (name, _rel(a, r), _rel(b, r))


def test_mlp_training_nodes_pass_an_overflow_to_the_scaler(hopper, monkeypatch):
    """An overflowing scaled loss through the nodes: Inf / NaN reach the MLP's weight gradients, so GradScaler
    skips the step (weights unchanged) as it does for PyTorch's operations."""
    from convforge.config import config

    monkeypatch.setattr(config, "mlp_train", True)
    torch.manual_seed(8)
    model = nn.Sequential(Block(32)).cuda().train()
    fused, _ = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(2, 32, 9, 9, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda", torch.float16):
        loss = fused(x).float().sum() * 1e38  # the scaled loss overflows to Inf
    scaler.scale(loss).backward()
    assert not torch.isfinite(model[0].fc1.weight.grad).all() and not torch.isfinite(model[0].fc2.weight.grad).all()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert scaler.get_scale() < 2.0**16


class _Withheld(dict):
    """mlp_train's handle table with nothing filed and nothing kept: every call runs the Python nodes."""

    def get(self, key, default=None):
        return None

    def __contains__(self, key):
        return True


def _cn_block(c):
    tv = pytest.importorskip("torchvision", reason="torchvision's ConvNeXt block")
    return tv.models.convnext.CNBlock(c, 0.5, 0.4)  # layer scale 0.5, stochastic depth p = 0.4


@pytest.mark.parametrize("case", ["fp16-autocast", "bf16-autocast-stochastic-depth", "fp16-model"])
def test_native_mlp_nodes_equal_the_python_nodes(hopper, monkeypatch, case):
    """native_mlp.inc's C++ nodes against the Python nodes that file them (torch/mlp_train.py), two fused ConvNeXt
    blocks in training, channels-last: a shape's first call runs Python and files it, the next ones run C++ (the
    module's counter moves by the four nodes a step); y, gx and every gradient equal, bit for bit, those of the
    same step with the native path withheld (the same random draws of stochastic depth)."""
    from convforge.config import config
    from convforge.torch import mlp_train, native

    module = native.load()
    if module is None:
        pytest.skip("the native module did not build on this machine (its log says why)")
    monkeypatch.setattr(config, "mlp_train", True)
    torch.manual_seed(12)
    blocks = [_cn_block(48), _cn_block(48)] if "stochastic" in case else [Block(48), Block(48)]
    model = nn.Sequential(*blocks).cuda().train()
    dt = torch.bfloat16 if case.startswith("bf16") else torch.float16
    auto = "autocast" in case
    if not auto:
        model = model.to(dt)
    fused, _ = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    x = torch.randn(3, 48, 13, 11, device="cuda").contiguous(memory_format=torch.channels_last)
    gy = torch.randn(3, 48, 13, 11, device="cuda").contiguous(memory_format=torch.channels_last)
    if not auto:
        x, gy = x.to(dt), gy.to(dt)

    def step():
        torch.manual_seed(5)  # stochastic depth's draws
        return _train_grads(fused, x, gy, dt if auto else None)

    step()  # files the four call shapes
    before = module.stats()["mlp_runs"]
    ours = step()
    assert module.stats()["mlp_runs"] - before == 4, "the C++ nodes did not take the warm calls"
    monkeypatch.setattr(mlp_train, "_HANDLES", _Withheld())
    theirs = step()
    assert module.stats()["mlp_runs"] - before == 4, "the withheld step reached the C++ nodes"
    names = ["y", "gx", *(n for n, _ in model.named_parameters())]
    for name, a, b in zip(names, ours, theirs, strict=True):
        assert a is not None and b is not None, name
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), name
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), (name, float((a.double() - b.double()).abs().max()))


def test_swin_mlp_norms_fold_and_stay_within_pytorchs_error(hopper):
    """Swin-T's MLPs (LayerNorm -> Linear -> GELU over (N, H, W, C) windows) fold as ConvNeXt's do: under FP16
    autocast the fused model stays within 1.2x PyTorch autocast's error against float64, with its dtype."""
    torchvision = pytest.importorskip("torchvision", reason="torchvision not installed")
    torch.manual_seed(0)
    model = torchvision.models.swin_t().cuda().eval()
    fused, report = __import__("convforge.torch", fromlist=["fuse"]).fuse(model)
    assert list(report.linears.values()).count("norm+gelu") == 12
    x = torch.randn(2, 3, 224, 224, device="cuda")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
        theirs, base = _amp_error(model, x, torch.float16, want)
        ours, err = _amp_error(fused, x, torch.float16, want)
    assert ours.dtype == theirs.dtype
    assert err <= 1.2 * base + 1e-4, (err, base)
    assert any(_ran(m) for m in fused.modules() if m.__class__.__name__ == "FusedLinear")
