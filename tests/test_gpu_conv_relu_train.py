"""GPU tier of conv -> ReLU in training on convforge's kernels (torch/conv_relu.py; skips without a CUDA
device or torch): the fused module's output and every gradient against float64 within the class of
PyTorch FP32's own error (odd shapes, stride 2, no bias, 1x1, 11x11/4, N=1), half layers and autocast regions
(NCHW and channels_last) within 2x PyTorch's own error of that precision, a VGG-like model's training
step through the node, the masked gradient's exact zeros, what it leaves to the unfused path, and the
masked gradient written straight into the tensor-core passes' operands (kernels/tensorcore/sm90/gradrows.py),
and the node in C++ (config.native_conv_relu; half, and float32 in both of its backward forms) bit for bit the
Python one.

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_conv_relu_train.py``.
"""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of training: torch not installed")
F = torch.nn.functional
FP32 = 5e-6

# (N, C, H, W, K, kernel, stride, padding, bias)
CASES = [(2, 5, 13, 11, 7, 3, 1, 1, True), (1, 3, 17, 17, 4, 3, 2, 1, True), (3, 8, 9, 9, 16, 1, 1, 0, False),
         (2, 3, 35, 35, 8, 11, 4, 2, True), (4, 16, 28, 28, 32, 3, 1, 1, True)]


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _block(case, seed=0):
    n, c, h, w, k, r, s, p, bias = case
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(c, k, r, s, p, bias=bias), torch.nn.ReLU()).cuda().train()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"_k{c[5]}s{c[6]}"
                         + ("" if c[8] else "_nobias"))
def test_conv_relu_matches_float64(gpu, case, monkeypatch):
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _block(case)
    ref32, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    fused, _ = ct.fuse(model)
    n, c, h, w = case[:4]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(n, c, h, w, device="cuda", generator=g).requires_grad_()
    z = fused(x)
    assert type(z.grad_fn).__name__ == "_ConvReluBackward", type(z.grad_fn).__name__  # float32: Python's node
    gz = torch.randn(z.shape, device="cuda", generator=g)
    z.backward(gz)
    got = {"z": z, "x": x.grad, **{name: p.grad for name, p in model.named_parameters()}}
    want = {}
    for tag, m, dt in (("32", ref32, torch.float32), ("64", ref64, torch.float64)):
        xx = x.detach().to(dt).requires_grad_()
        zz = m(xx)
        zz.backward(gz.to(dt))
        want[tag] = {"z": zz, "x": xx.grad, **{name: p.grad for name, p in m.named_parameters()}}
    for name, value in got.items():
        assert value is not None and torch.isfinite(value).all(), name
        mine, theirs = _rel(value, want["64"][name]), _rel(want["32"][name], want["64"][name])
        assert mine <= max(FP32, 2 * theirs), (name, mine, theirs)


def test_vgg_like_training_step_runs_through_the_node(gpu, monkeypatch):
    """fuse() of conv-ReLU-conv-ReLU-pool-conv-ReLU-pool-linear in training: every conv through the
    node, every parameter's gradient within the class of PyTorch FP32's error against float64, and
    config.train_bn off gives the op's path (the same gradients within the class)."""
    import convforge.torch as ct
    from convforge.config import config
    from convforge.torch import conv_relu as cr

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    calls = {"n": 0}
    real = cr.conv_relu

    def counted(*args):
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(cr, "conv_relu", counted)
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(16, 16, 3, padding=1),
                          nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 8 * 8, 10)).cuda().train()
    ref32, ref64, off = copy.deepcopy(model), copy.deepcopy(model).double(), copy.deepcopy(model)
    fused, _ = ct.fuse(model)
    fused_off, _ = ct.fuse(off)
    x = torch.randn(4, 3, 32, 32, device="cuda")
    target = torch.randint(0, 10, (4,), device="cuda")
    F.cross_entropy(fused(x), target).backward()
    assert calls["n"] == 3, calls
    F.cross_entropy(ref32(x), target).backward()
    F.cross_entropy(ref64(x.double()), target).backward()
    monkeypatch.setattr(config, "train_bn", False)
    F.cross_entropy(fused_off(x), target).backward()
    assert calls["n"] == 3  # off: the conv op, then PyTorch's ReLU
    for (name, p), p32, p64, q in zip(model.named_parameters(), ref32.parameters(), ref64.parameters(),
                                      off.parameters()):
        mine, theirs, op = _rel(p.grad, p64.grad), _rel(p32.grad, p64.grad), _rel(q.grad, p64.grad)
        assert mine <= max(FP32, 2 * theirs, 2 * op), (name, mine, theirs, op)


def test_masked_gradient_and_bias_sum_are_exact_where_masked(gpu):
    """The kernel alone: gm equals gz where z > 0 and is 0 elsewhere, bit for bit; the bias sum within
    float32 summation error of float64's; reruns bit-identical (a fixed reduction order)."""
    from convforge.torch.conv_relu import _masked_grad

    g = torch.Generator(device="cuda").manual_seed(2)
    for shape in ((2, 7, 13, 11), (16, 64, 56, 56), (1, 3, 1, 1)):
        z = torch.relu(torch.randn(shape, device="cuda", generator=g))
        gz = torch.randn(shape, device="cuda", generator=g)
        gm, gb = _masked_grad(gz, z)
        want = torch.where(z > 0, gz, torch.zeros_like(gz))
        assert torch.equal(gm, want)
        assert _rel(gb, want.double().sum(dim=(0, 2, 3))) <= 1e-6
        gm2, gb2 = _masked_grad(gz, z)
        assert torch.equal(gm2, gm) and torch.equal(gb2, gb)


# odd images, N = 1, stride 2, 1x1 without bias, a VGG-sized layer; channels in multiples of 8 (half tiles)
HALF_CASES = [(2, 8, 13, 11, 16, 3, 1, 1, True), (1, 16, 17, 17, 8, 3, 2, 1, True), (3, 8, 9, 9, 16, 1, 1, 0, False),
              (16, 32, 28, 28, 64, 3, 1, 1, True)]


@pytest.mark.parametrize("mode", ["half", "autocast"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("case", HALF_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"_k{c[5]}s{c[6]}")
def test_half_and_autocast_take_the_node(gpu, case, mode, dtype, layout):
    """A half model, or a float32 one in an autocast region, trains conv -> ReLU through the node (NCHW
    and channels_last, which the output and the input's gradient keep): output and every gradient
    against float64 within 2x the error of PyTorch's own run of the same precision (autocast or half)."""
    import convforge.torch as ct

    dt = getattr(torch, dtype)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model = _block(case).to(memory_format=fmt)
    ref64 = copy.deepcopy(model).double()
    theirs_m = copy.deepcopy(model)
    if mode == "half":
        model, theirs_m = model.to(dt), theirs_m.to(dt)
    fused, _ = ct.fuse(model)
    n, c, h, w = case[:4]
    g = torch.Generator(device="cuda").manual_seed(3)
    x0 = torch.randn(n, c, h, w, device="cuda", generator=g).contiguous(memory_format=fmt)
    gz = torch.randn(fused(x0.to(dt)).shape, device="cuda", generator=g) if mode == "half" else None

    def run(m, x):
        x = x.detach().requires_grad_()
        with torch.autocast("cuda", dtype=dt, enabled=mode == "autocast"):
            z = m(x)
        z.backward((gz if gz is not None else torch.ones_like(z)).to(z.dtype))
        return z, x.grad, {name: p.grad for name, p in m.named_parameters()}

    xin = x0.to(dt) if mode == "half" else x0
    z, gx, grads = run(fused, xin)
    # Python's node where the call filed the program, the C++ one (config.native_conv_relu, on by default)
    # where an earlier call had: the gz-shaped call above, or another case of the same conv in this process
    assert type(z.grad_fn).__name__ in ("_ConvReluBackward", "CppFunction"), type(z.grad_fn).__name__
    assert z.dtype == dt and z.is_contiguous(memory_format=fmt) and gx.is_contiguous(memory_format=fmt)
    z_t, gx_t, grads_t = run(theirs_m, xin)
    ones = gz is None
    x64 = x0.double().requires_grad_()
    z64 = ref64(x64)
    z64.backward(torch.ones_like(z64) if ones else gz.double())
    want = {"z": z64, "x": x64.grad, **{name: p.grad for name, p in ref64.named_parameters()}}
    got = {"z": z, "x": gx, **grads}
    theirs = {"z": z_t, "x": gx_t, **grads_t}
    for name, value in got.items():
        assert value is not None and torch.isfinite(value).all(), name
        mine, ref = _rel(value, want[name]), _rel(theirs[name], want[name])
        assert mine <= max(1e-3 if dtype == "float16" else 8e-3, 2 * ref), (name, mine, ref)


@pytest.mark.parametrize("mode", ["half", "autocast"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("case", HALF_CASES[:3], ids=lambda c: "x".join(map(str, c[:5])) + f"_k{c[5]}s{c[6]}")
def test_native_half_node_equals_pythons(gpu, monkeypatch, case, mode, dtype, layout):
    """config.native_conv_relu: a warm half call runs native.cpp's ConvReluNode (its counter moves, the
    grad_fn is the C++ node's), and its output and every gradient are bit for bit the Python node's (the same
    kernels and ops in the same order), in both layouts, half and autocast, with and without bias."""
    import convforge.torch as ct
    from convforge.config import config
    from convforge.frontends import fast_path

    dt = getattr(torch, dtype)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model = _block(case).to(memory_format=fmt)
    if mode == "half":
        model = model.to(dt)
    g = torch.Generator(device="cuda").manual_seed(5)
    x0 = torch.randn(*case[:4], device="cuda", generator=g).contiguous(memory_format=fmt)
    xin = x0.to(dt) if mode == "half" else x0

    def step(native):
        monkeypatch.setattr(config, "native_conv_relu", native)
        fused, _ = ct.fuse(copy.deepcopy(model))
        for _ in range(2):  # the first call files the program; the second is warm
            fused.zero_grad(set_to_none=True)
            x = xin.detach().requires_grad_()
            with torch.autocast("cuda", dtype=dt, enabled=mode == "autocast"):
                z = fused(x)
            z.backward(torch.linspace(-1, 1, z.numel(), device="cuda").reshape(z.shape).to(z.dtype))
        return z, type(z.grad_fn).__name__, x.grad, {n: p.grad for n, p in fused.named_parameters()}

    z_py, fn_py, gx_py, grads_py = step(False)
    before = fast_path.TORCH.stats()["relu_runs"] if fast_path.TORCH is not None else 0
    z_c, fn_c, gx_c, grads_c = step(True)
    assert fast_path.TORCH is not None and fast_path.TORCH.stats()["relu_runs"] > before
    assert fn_py == "_ConvReluBackward" and fn_c != fn_py, (fn_py, fn_c)
    assert torch.equal(z_c, z_py) and torch.equal(gx_c, gx_py) and gx_c.is_contiguous(memory_format=fmt)
    assert grads_c.keys() == grads_py.keys()
    for name, value in grads_c.items():
        assert value is not None and torch.equal(value, grads_py[name]), name


F32_NATIVE_CASES = [CASES[0], CASES[2], (16, 32, 28, 28, 64, 3, 1, 1, True), (2, 16, 17, 17, 24, 3, 2, 1, True)]


@pytest.mark.parametrize("precision", [None, "relaxed"])
@pytest.mark.parametrize("case", F32_NATIVE_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"_k{c[5]}s{c[6]}"
                         + ("" if c[8] else "_nobias"))
def test_native_float32_node_equals_pythons(gpu, monkeypatch, case, precision):
    """config.native_conv_relu, float32: a layer's first call runs the Python node, whose backward files the
    form it took (register_relu_back: the one-kernel masked gradient and the ops, or the gradient rows and both
    passes' programs, as fp32-class and relaxed plans choose); the warm calls run native.cpp's ConvReluNode (its
    counter moves, its grad_fn the C++ node's) and their output and every gradient are bit for bit the Python
    node's, with the input's gradient asked and not."""
    import convforge.torch as ct
    from convforge.config import config
    from convforge.frontends import fast_path

    model = _block(case, seed=2)
    g = torch.Generator(device="cuda").manual_seed(6)
    x0 = torch.randn(*case[:4], device="cuda", generator=g)
    kw = {} if precision is None else {"precision": precision}

    def step(native):
        monkeypatch.setattr(config, "native_conv_relu", native)
        fused, _ = ct.fuse(copy.deepcopy(model), **kw)
        out = []
        for need_x in (True, True, False):  # the first call files; then warm, with and without x's gradient
            fused.zero_grad(set_to_none=True)
            x = x0.detach().requires_grad_(need_x)
            z = fused(x)
            z.backward(torch.linspace(-1, 1, z.numel(), device="cuda").reshape(z.shape))
            out.append((z, type(z.grad_fn).__name__, x.grad, {n: p.grad for n, p in fused.named_parameters()}))
        return out

    py = step(False)
    before = fast_path.TORCH.stats()["relu_runs"] if fast_path.TORCH is not None else 0
    cc = step(True)
    assert fast_path.TORCH is not None and fast_path.TORCH.stats()["relu_runs"] - before == 2
    for i, ((z_p, fn_p, gx_p, gp), (z_c, fn_c, gx_c, gc)) in enumerate(zip(py, cc, strict=True)):
        assert fn_p == "_ConvReluBackward" and (fn_c == fn_p) == (i == 0), (i, fn_p, fn_c)
        assert torch.equal(z_c, z_p), i
        assert (gx_c is None) == (gx_p is None) == (i == 2), i
        assert gx_c is None or torch.equal(gx_c, gx_p), i
        assert gc.keys() == gp.keys()
        for name, value in gc.items():
            assert value is not None and torch.equal(value, gp[name]), (i, name)


@pytest.mark.parametrize("why", ["config off", "no grad", "frozen weights"])
def test_what_it_leaves_to_the_unfused_path(gpu, monkeypatch, why):
    """Not the node: config.train_bn off, no grad mode, frozen filters; the output still PyTorch's
    within the class."""
    import convforge.torch as ct
    from convforge.config import config

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _block(CASES[0])
    ref = copy.deepcopy(model)
    fused, _ = ct.fuse(model)
    x = torch.randn(2, 5, 13, 11, device="cuda", requires_grad=True)
    if why == "config off":
        monkeypatch.setattr(config, "train_bn", False)
    if why == "frozen weights":
        for p in fused.parameters():
            p.requires_grad_(False)
    if why == "no grad":
        with torch.no_grad():
            z = fused(x)
        assert z.grad_fn is None
    else:
        z = fused(x)
        assert z.grad_fn is not None and type(z.grad_fn).__name__ != "_ConvReluBackward", why
    with torch.no_grad():
        want = ref(x)
    assert _rel(z, want) <= 1e-5, why


# (N, C, H, W, K, stride): VGG-like, odd everything (Np and Kp padded), N = 1, strided (dgrad_tc_strided_*)
ROWS_CASES = [(16, 64, 28, 28, 128, 1), (3, 5, 13, 11, 7, 1), (1, 8, 9, 9, 16, 1), (2, 16, 17, 17, 24, 2)]


@pytest.mark.parametrize("tag", ["tf32", "3xtf32"])
@pytest.mark.parametrize("case", ROWS_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"_s{c[5]}")
def test_rows_backward_equals_the_passes_on_the_masked_gradient(gpu, tag, case):
    """kernels/tensorcore/sm90/gradrows.py through conv_relu.rows_from_plans, every workspace poisoned with
    NaN first: dx and dW bit-identical to the same plans run by convforge.grad on the masked gradient
    (the same operands in the same layouts), within the math's class of float64's; the bias within
    float32 summation error of float64's."""
    from convforge import grad as cf_grad
    from convforge.backends import get_backend
    from convforge.kernels import get_variant
    from convforge.spec import ConvSpec
    from convforge.torch.conv_relu import _masked_grad, rows_from_plans

    n, c, h, w, k, st = case
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(n, c, h, w, device="cuda", generator=g)
    wt = 0.2 * torch.randn(k, c, 3, 3, device="cuda", generator=g)
    spec = ConvSpec.make(n, c, h, w, k, 3, 3, stride=st, padding=1)
    z = torch.relu(torch.randn(spec.y_shape, device="cuda", generator=g))
    gz = torch.randn(spec.y_shape, device="cuda", generator=g)
    be = get_backend("cuda", 0)
    names = (f"dgrad_tc_{'implicit_gemm' if st == 1 else 'strided'}_{tag}", f"wgrad_tc_implicit_gemm_{tag}")
    plans, params = [], []
    for name, sp in zip(names, (spec.with_pass("dgrad"), spec.with_pass("wgrad"))):
        v = get_variant(name)
        assert v.applies(sp, be.device) is None, v.applies(sp, be.device)
        params.append(v.default(sp, be.device))
        plans.append(v.plan_for(sp, params[-1], be.device))
    rows = rows_from_plans(plans[0], plans[1], tuple(spec.y_shape), 0)
    assert rows is not None
    for exe in (rows.exe_d, rows.exe_w):
        for buf in exe.workspace().values():
            be.fill(buf, float("nan"), be.nbytes(buf))
    gx, gw, gb = rows(gz, x, wt, z)
    gm, _ = _masked_grad(gz, z)
    want_x = cf_grad.conv2d_input(list(x.shape), wt, gm, st, 1, algo=names[0], params=params[0])
    want_w = cf_grad.conv2d_weight(x, list(wt.shape), gm, st, 1, algo=names[1], params=params[1])
    assert torch.equal(gx, want_x) and torch.equal(gw, want_w)
    ref_x = torch.nn.grad.conv2d_input(x.shape, wt.double(), gm.double(), st, 1)
    ref_w = torch.nn.grad.conv2d_weight(x.double(), wt.shape, gm.double(), st, 1)
    tol = 2e-3 if tag == "tf32" else 5e-6
    assert _rel(gx, ref_x) <= tol and _rel(gw, ref_w) <= tol, (_rel(gx, ref_x), _rel(gw, ref_w))
    assert _rel(gb, gm.double().sum(dim=(0, 2, 3))) <= 1e-6


def test_relaxed_vgg_block_takes_the_rows_path(gpu, monkeypatch):
    """fuse(precision="relaxed") of a VGG-like block: the backward goes through _RowsBackward (both
    passes tensor-core plans), and its gradients equal config.grad_rows off's (the masked gradient in
    NCHW, then the passes' own transposes) bit for bit, the bias's within summation order."""
    import convforge.torch as ct
    from convforge.config import config
    from convforge.torch import conv_relu as cr

    torch.manual_seed(4)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                          nn.ReLU()).cuda().train()
    other = copy.deepcopy(model)
    x = torch.randn(16, 32, 28, 28, device="cuda", requires_grad=True)
    gz = torch.randn(16, 64, 28, 28, device="cuda")
    grads = []
    for on, m in ((True, model), (False, other)):
        monkeypatch.setattr(config, "grad_rows", on)
        cr._ROWS.clear()
        fused, _ = ct.fuse(m, precision="relaxed")
        x.grad = None
        fused(x).backward(gz)
        assert (sum(r is not None for r in cr._ROWS.values()) == 2) == on, cr._ROWS
        grads.append([x.grad.clone()] + [p.grad for p in m.parameters()])
    for i, (a, b) in enumerate(zip(*grads)):
        assert torch.equal(a, b) if a.dim() > 1 else _rel(a, b.double()) <= 1e-6, i
