"""GPU tier of max pooling on convforge's kernels (torch/pool.py; skips without a CUDA device or torch): the
forward and the input gradient against float64 and against PyTorch's ``max_pool2d`` (the same maxima, the
gradient on the same inputs), every dtype and layout, ceil mode, odd planes, ties and NaN; ``fuse()``
swapping ResNet's pool and a fused ResNet-18 AMP step through it.

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_maxpool.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of max pooling: torch not installed")
F = torch.nn.functional

# (N, C, H, W, kernel, stride, padding, ceil): ResNet's stem pool at N=32, odd planes, N=1, ceil mode, an
# asymmetric window and stride, stride 4, windows that overlap 9 deep
GEOMETRIES = [(32, 64, 112, 112, 3, 2, 1, False), (2, 5, 13, 11, 3, 2, 1, False), (1, 3, 7, 9, 2, 2, 0, False),
              (3, 6, 10, 9, 3, 2, 0, True), (2, 4, 9, 11, (3, 2), (1, 2), 1, False), (2, 3, 17, 19, 5, 4, 2, False),
              (1, 8, 12, 12, 3, 1, 1, False)]
DTYPES = ["float32", "float16", "bfloat16"]


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("GPU tier: no CUDA device")
    return torch.device("cuda")


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _poison(shape, dtype):
    """Leave NaN in the caching allocator's next block of this size, so an element the kernels skip shows."""
    torch.full(shape, float("nan"), dtype=dtype, device="cuda")


@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_against_float64_and_pytorch(cuda, geo, dtype, channels_last) -> None:
    from convforge.torch.pool import MaxPool2d

    n, c, h, w, k, s, p, ceil = geo
    dt = getattr(torch, dtype)
    ref_mod = torch.nn.MaxPool2d(k, s, p, ceil_mode=ceil)
    ours = MaxPool2d.from_module(ref_mod)
    torch.manual_seed(sum(map(hash, map(str, geo))) % 1000)
    x = torch.randn(n, c, h, w, device=cuda).to(dt)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    y_pt = ref_mod(x)
    _poison(y_pt.shape, dt)
    y = ours(x)
    assert y.stride() == y_pt.stride() and y.dtype == dt
    assert torch.equal(y, y_pt)  # a maximum is one of the inputs, and PyTorch picks the same one
    x64 = x.detach().double().requires_grad_(True)
    y64 = ref_mod(x64)
    assert torch.equal(y.double(), y64)
    gy = torch.randn_like(y_pt)
    (gx_pt,) = torch.autograd.grad(y_pt, x, gy)
    _poison(x.shape, dt)
    (gx,) = torch.autograd.grad(y, x, gy)
    (gx64,) = torch.autograd.grad(y64, x64, gy.double())
    assert gx.stride() == x.stride() and not gx.isnan().any()
    tol = 1e-6 if dtype == "float32" else 8e-3
    mine, theirs = _rel(gx, gx64), _rel(gx_pt, gx64)
    assert mine < tol and mine <= 1.01 * theirs + 1e-7, (mine, theirs)


@pytest.mark.parametrize("geo", [GEOMETRIES[0], GEOMETRIES[4]], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_native_node_equals_the_python_node(cuda, monkeypatch, geo, dtype, channels_last) -> None:
    """native_layers.inc's node (the module loaded: it takes the calls, its counter moves) against the Python
    node (the module withheld): y and gx bit for bit, in training and in a no-grad forward."""
    from convforge.frontends import fast_path
    from convforge.torch.pool import MaxPool2d

    module = fast_path.torch_module()
    if module is None:
        pytest.skip("the native module did not build on this machine (its log says why)")
    n, c, h, w, k, s, p, ceil = geo
    ours = MaxPool2d.from_module(torch.nn.MaxPool2d(k, s, p, ceil_mode=ceil))
    x = torch.randn(n, c, h, w, device=cuda).to(getattr(torch, dtype))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    gy = torch.randn_like(ours(x))

    def both():
        with torch.no_grad():
            y0 = ours(x)
        xx = x.detach().requires_grad_(True)
        y = ours(xx)
        (gx,) = torch.autograd.grad(y, xx, gy)
        return [y0, y, gx]

    before = module.stats()["pool_runs"]
    got = both()
    assert module.stats()["pool_runs"] - before == 2, "the C++ node did not take the calls"
    monkeypatch.setattr(fast_path, "TORCH", None)
    want = both()
    for name, a, b in zip(["y no grad", "y", "gx"], got, want, strict=True):
        assert a.stride() == b.stride() and torch.equal(a, b), name


@pytest.mark.parametrize("channels_last", [False, True])
def test_ties_and_nan_land_where_pytorchs_do(cuda, channels_last) -> None:
    from convforge.torch.pool import MaxPool2d

    torch.manual_seed(3)
    x = torch.randint(-2, 3, (4, 8, 15, 15), device=cuda).float()  # many equal maxima
    x[0, 0, 3, 3] = x[1, 2, 5, 6] = x[1, 2, 6, 5] = float("nan")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    m = torch.nn.MaxPool2d(3, 2, 1)
    y_pt, y = m(x), MaxPool2d.from_module(m)(x)
    assert torch.equal(y.nan_to_num(7.0), y_pt.nan_to_num(7.0))
    gy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, gy)[0], torch.autograd.grad(y_pt, x, gy)[0],
                               rtol=1e-6, atol=1e-6)


def test_a_window_of_minus_infinity_keeps_its_first_tap_in_both_layouts(cuda) -> None:
    """PyTorch's NCHW kernel gives such a window's gradient to its first in-image input; its channels-last
    kernel to the plane's input (0, 0), inside the window or not. Ours follow the NCHW kernel in both layouts."""
    from convforge.torch.pool import MaxPool2d

    torch.manual_seed(4)
    x = torch.randn(2, 3, 9, 9, device=cuda)
    x[1, 2, :5, :5] = float("-inf")
    m = torch.nn.MaxPool2d(3, 2, 1)
    grads = []
    for t in (x, x.contiguous(memory_format=torch.channels_last)):
        t = t.clone().requires_grad_(True)
        y = MaxPool2d.from_module(m)(t)
        gy = torch.ones_like(y)
        grads.append(torch.autograd.grad(y, t, gy)[0])
    x0 = x.clone().requires_grad_(True)
    y_pt = m(x0)
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[0], torch.autograd.grad(y_pt, x0, torch.ones_like(y_pt))[0])


def test_falls_back_where_the_kernels_do_not_run(cuda) -> None:
    from convforge.torch.pool import MaxPool2d, layer_of

    x = torch.randn(2, 3, 9, 9, device=cuda)
    assert layer_of(torch.nn.MaxPool2d(3, 2, 1, dilation=2), x) is None
    assert layer_of(torch.nn.MaxPool2d(3, 2, 1, return_indices=True), x) is None
    assert layer_of(torch.nn.MaxPool2d(3, 2, 1), x.double()) is None
    assert layer_of(torch.nn.MaxPool2d(3, 2, 1), x[:, :, ::2]) is None  # other strides
    assert layer_of(torch.nn.MaxPool2d(3, 2, 1), x.cpu()) is None
    m = MaxPool2d.from_module(torch.nn.MaxPool2d(3, 2, 1, dilation=2))
    assert torch.equal(m(x), F.max_pool2d(x, 3, 2, 1, dilation=2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_off_a_16_byte_boundary(cuda, dtype) -> None:
    """The channel-vector kernels read 16 bytes at a time: a channels-last input viewed at an odd storage
    offset goes to PyTorch, a gradient at an odd offset is copied first; both sides agree with PyTorch."""
    from convforge.torch.pool import MaxPool2d, layer_of

    dt = getattr(torch, dtype)
    n, c, h, w = 2, 16, 9, 11
    flat = torch.randn(1 + n * h * w * c, device=cuda).to(dt)
    x = flat[1:].view(n, h, w, c).permute(0, 3, 1, 2).requires_grad_()  # channels_last, 2 or 4 bytes off
    assert x.is_contiguous(memory_format=torch.channels_last) and x.data_ptr() % 16
    m = MaxPool2d.from_module(torch.nn.MaxPool2d(3, 2, 1))
    assert layer_of(m, x) is None and layer_of(m, x.detach().clone(memory_format=torch.channels_last)) is not None
    y = m(x)
    ref = F.max_pool2d(x.detach(), 3, 2, 1)
    assert torch.equal(y, ref)
    xa = x.detach().clone(memory_format=torch.channels_last).requires_grad_()
    ya = m(xa)
    gflat = torch.randn(1 + ya.numel(), device=cuda).to(dt)
    gy = gflat[1:].view(n, ya.shape[2], ya.shape[3], c).permute(0, 3, 1, 2)
    assert gy.data_ptr() % 16
    ya.backward(gy)
    xr = x.detach().clone().requires_grad_()
    F.max_pool2d(xr, 3, 2, 1).backward(gy)
    assert torch.equal(ya.detach(), ref) and _rel(xa.grad, xr.grad) <= (1e-6 if dtype == "float32" else 1e-2)


def test_fuse_swaps_resnets_pool(cuda) -> None:
    """fuse() puts convforge's pool in ResNet's place (the fused AMP step against float64, through it:
    test_gpu_bn_half.py::test_fused_resnet_amp_step_runs_every_batch_norm_ours)."""
    import torchvision

    import convforge.torch as ct
    from convforge.torch.pool import MaxPool2d

    model = torchvision.models.resnet18(num_classes=10).cuda().train()
    fused, report = ct.fuse(model)
    assert report.pools == ["maxpool"] and type(fused.maxpool) is MaxPool2d and type(model.maxpool) is not MaxPool2d
    assert "1 max pool(s) on convforge's kernels" in str(report)
