"""Squeeze-and-excitation as one node (torch/se.py, kernels/se.py) on the GPU: forward and every gradient
against float64 beside PyTorch's own (autocast) run of the same modules, fuse() finding torchvision's SE
blocks, an overflowing scaled loss reaching the weight gradients, and the fallbacks. GPU tier: skips
without torch or a CUDA device."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="GPU tier of convforge.torch: torch not installed")
F = torch.nn.functional

CL = torch.channels_last


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _se(c, s, act, gate, seed):
    tv = pytest.importorskip("torchvision", reason="GPU tier: torchvision not installed")
    torch.manual_seed(seed)
    acts = {"relu": torch.nn.ReLU, "silu": torch.nn.SiLU}
    gates = {"sigmoid": torch.nn.Sigmoid, "hardsigmoid": torch.nn.Hardsigmoid}
    return tv.ops.SqueezeExcitation(c, s, activation=acts[act], scale_activation=gates[gate]).cuda()


def _node(m):
    from convforge.torch.se import SqueezeExcite

    return SqueezeExcite(m.avgpool, m.fc1, m.activation, m.fc2, m.scale_activation)


def _run(fn, x, gy, params, autocast):
    """y and the gradients of x and ``params`` (fresh)."""
    x = x.detach().clone().requires_grad_(True)
    for p in params:
        p.grad = None
    dt = autocast if isinstance(autocast, torch.dtype) else torch.float16
    with torch.autocast("cuda", dt, enabled=bool(autocast)):
        y = fn(x)
    y.backward(gy.to(y.dtype))
    return [y, x.grad, *(p.grad for p in params)]


# (N, C, H, W, S, act, gate, x dtype, autocast): autocast FP16 / BF16 over float32 master weights, float32,
# a .half() model; odd C (one channel a thread), N=1, a 1x1 plane, EfficientNet's first SE's shape; each
# channels-last and NCHW
CASES = [
    (8, 96, 28, 28, 4, "silu", "sigmoid", torch.float16, True),
    (4, 120, 14, 14, 32, "relu", "hardsigmoid", torch.bfloat16, torch.bfloat16),
    (2, 37, 9, 11, 9, "relu", "sigmoid", torch.float32, False),
    (1, 64, 7, 7, 300, "silu", "sigmoid", torch.float16, False),  # .half(); S past the block's threads
    (3, 24, 1, 1, 6, "silu", "hardsigmoid", torch.float16, True),
    (16, 32, 112, 112, 8, "silu", "sigmoid", torch.float16, True),
]


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("n,c,h,w,s,act,gate,dtype,autocast", CASES)
def test_node_against_float64_beside_pytorch(gpu, n, c, h, w, s, act, gate, dtype, autocast, layout):
    """y, gx and the four parameter gradients of the node and of PyTorch's run of the same modules, each
    against float64: ours within a small multiple of PyTorch's error (it keeps float32 where autocast
    rounds to half), x poisoned nowhere: every output is checked finite."""
    m = _se(c, s, act, gate, seed=c + s)
    if dtype != torch.float32 and not autocast:
        m = m.half()
    node, m64 = _node(m), copy.deepcopy(m).double()
    g = torch.Generator(device="cuda").manual_seed(n * c)
    fmt = CL if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(n, c, h, w, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    gy = torch.randn(n, c, h, w, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    dt = autocast if isinstance(autocast, torch.dtype) else torch.float16
    with torch.autocast("cuda", dt, enabled=bool(autocast)):  # where it decides: inside the region
        assert node.layer(x, m.fc1.weight, m.fc2.weight) is not None  # the kernels take it
    params = [m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias]
    ours = _run(node, x, gy, params, autocast)
    theirs = _run(m, x, gy, params, autocast)
    ref = _run(m64, x.double(), gy.double(), list(m64.parameters()), False)
    names = ["y", "gx", "gw1", "gb1", "gw2", "gb2"]
    for name, a, b, r in zip(names, ours, theirs, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
        if name in ("y", "gx"):
            assert a.is_contiguous(memory_format=fmt), name  # the input's layout kept
        assert torch.isfinite(a).all(), name
        mine, pt = _rel(a, r), _rel(b, r)
        floor = 1e-5 if dtype == torch.float32 else 4e-3
        assert mine <= max(2 * pt, floor), (name, mine, pt)


def test_runs_are_bit_identical(gpu):
    m = _se(96, 24, "silu", "sigmoid", seed=1)
    node = _node(m)
    x = torch.randn(8, 96, 20, 20, device="cuda").half().contiguous(memory_format=CL)
    gy = torch.randn_like(x)
    a = _run(node, x, gy, list(m.parameters()), True)
    b = _run(node, x, gy, list(m.parameters()), True)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("n,c,h,w,s,act,gate,dtype,autocast", CASES[:5])
def test_native_node_equals_the_python_node(gpu, monkeypatch, n, c, h, w, s, act, gate, dtype, autocast, layout):
    """native_layers.inc's node (the module loaded: every call takes it, its counter moves) against the Python node
    (the native module withheld): y and every gradient bit for bit, in training and in a no-grad forward."""
    from convforge.frontends import fast_path

    module = fast_path.torch_module()
    if module is None:
        pytest.skip("the native module did not build on this machine (its log says why)")
    m = _se(c, s, act, gate, seed=c + s)
    if dtype != torch.float32 and not autocast:
        m = m.half()
    node = _node(m)
    g = torch.Generator(device="cuda").manual_seed(n * c + 1)
    fmt = CL if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(n, c, h, w, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    gy = torch.randn(n, c, h, w, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    params = [m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias]
    dt = autocast if isinstance(autocast, torch.dtype) else torch.float16

    def both():
        with torch.no_grad(), torch.autocast("cuda", dt, enabled=bool(autocast)):
            y0 = node(x)
        return [y0, *_run(node, x, gy, params, autocast)]

    before = module.stats()["se_runs"]
    ours = both()
    assert module.stats()["se_runs"] - before == 2, "the C++ node did not take the calls"
    monkeypatch.setattr(fast_path, "TORCH", None)
    theirs = both()
    assert module.stats()["se_runs"] - before == 2
    for name, a, b in zip(["y no grad", "y", "gx", "gw1", "gb1", "gw2", "gb2"], ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), name
        assert torch.isfinite(a).all() and torch.equal(a, b), name


def test_overflowing_loss_reaches_the_weight_gradients_and_grad_scaler_skips(gpu):
    """A scaled loss that overflows: Inf in the output gradient reaches every parameter's gradient, so a
    GradScaler skips the step (the weights unchanged) and backs its scale off, as with PyTorch's modules."""
    m = _se(64, 16, "silu", "sigmoid", seed=2)
    node = _node(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    before = [p.detach().clone() for p in m.parameters()]
    x = torch.randn(4, 64, 8, 8, device="cuda").half().contiguous(memory_format=CL)
    x[0, 3, 2, 2] = 6e4  # near float16's largest: the scaled loss overflows
    with torch.autocast("cuda", torch.float16):
        loss = node(x).float().pow(2).sum()
    scaler.scale(loss).backward()
    assert all(not torch.isfinite(p.grad).all() for p in m.parameters())
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before, strict=True))
    assert scaler.get_scale() < 2.0**16


def test_fallbacks_run_the_modules(gpu):
    """Input of other strides, a CPU model: the original modules' result, bit for bit."""
    m = _se(32, 8, "relu", "sigmoid", seed=3)
    node = _node(m)
    x = torch.randn(2, 32, 6, 12, device="cuda")[..., ::2]  # every other column: neither layout
    assert node.layer(x, m.fc1.weight, m.fc2.weight) is None
    assert torch.equal(node(x), m(x))
    cpu = _node(copy.deepcopy(m).cpu())
    xc = torch.randn(2, 32, 6, 6)
    assert torch.equal(cpu(xc), cpu.reference(xc))


@pytest.mark.parametrize("name,count", [("efficientnet_b0", 16), ("mobilenet_v3_large", 8),
                                        ("regnet_y_400mf", 16)])
def test_fuse_makes_every_se_block_one_node(gpu, name, count):
    """fuse() finds torchvision's SE blocks (SiLU / sigmoid, ReLU / hardsigmoid, ReLU / sigmoid), the state_dict
    is unchanged, and a channels_last FP16 autocast training step matches the unfused model's."""
    import convforge.torch as ct

    tv = pytest.importorskip("torchvision", reason="GPU tier: torchvision not installed")
    torch.manual_seed(0)
    kw = {"dropout": 0.0} if not name.startswith("regnet") else {}
    if name.startswith("efficientnet"):
        kw["stochastic_depth_prob"] = 0.0
    model = getattr(tv.models, name)(num_classes=10, **kw).cuda().train().to(memory_format=CL)
    amp, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    fused, report = ct.fuse(model)
    assert len(report.excitations) == count, report.excitations
    assert list(fused.state_dict()) == list(model.state_dict())
    x = torch.randn(4, 3, 64, 64, device="cuda").contiguous(memory_format=CL)
    target = torch.randint(0, 10, (4,), device="cuda")
    losses = []
    for mod in (fused, amp):
        with torch.autocast("cuda", torch.float16):
            loss = F.cross_entropy(mod(x), target)
        loss.backward()
        losses.append(float(loss))
    loss64 = F.cross_entropy(ref64(x.double()), target)
    loss64.backward()
    assert abs(losses[0] - float(loss64)) <= max(2 * abs(losses[1] - float(loss64)), 1e-2), (losses, float(loss64))
    for path in report.excitations:  # every SE's first layer: our gradient against float64 beside PyTorch AMP's
        mine, theirs, g64 = (m.get_submodule(path).weight.grad for m in (model, amp, ref64))
        assert _rel(mine, g64) <= max(3 * _rel(theirs, g64), 1e-2), (path, _rel(mine, g64), _rel(theirs, g64))


def test_training_ahead_compiles_the_se_programs(gpu, monkeypatch, tmp_path):
    """The first training step's recording (torch/train_ahead.py) notes each SE node's layer under autocast,
    and compiling ahead leaves the very program the node's first call builds in the back-end."""
    import sys

    import convforge.torch as ct
    from convforge.backends import get_backend
    from convforge.torch import se
    from convforge.torch.train_ahead import compile_training_ahead, record_calls

    tv = pytest.importorskip("torchvision", reason="GPU tier: torchvision not installed")
    torch.manual_seed(0)
    model = tv.models.mobilenet_v3_large(num_classes=10).cuda().train().to(memory_format=CL)
    fused, report = ct.fuse(model)
    x = torch.randn(2, 3, 64, 64, device="cuda").contiguous(memory_format=CL)
    ta = sys.modules["convforge.torch.train_ahead"]  # a manifest no earlier run left: else nothing is loaded
    monkeypatch.setattr(ta, "_manifest", lambda m, a, k: tmp_path / "manifest.json")
    noted: list = []
    with torch.autocast("cuda", torch.float16):
        record_calls(fused, (x,), {}, noted)
        compile_training_ahead(fused, x)
    assert len(noted) >= 4 and all(layer.dtype == "float16" and layer.pdtype == "float32" for layer, _ in noted)
    be = get_backend("cuda", 0)
    for layer, dev in noted:
        assert be._key(se.program_work(layer, dev).source) in be._programs, layer
