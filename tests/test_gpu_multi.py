"""GPU tier, two devices: every torch and CuPy path on the second GPU while the first stays current.

The common PyTorch pattern is ``model.to("cuda:1")`` without ``torch.cuda.set_device``: the
tensors live on device 1 while device 0 stays current. Every path must then run on device 1's
context and current stream, allocate there, leave device 0 current and keep per-device entries
apart. Skips (with the reason) unless torch sees two CUDA devices: run on a lent two-GPU machine,
``python -m pytest -q tests/test_gpu_multi.py``. Results are checked against the float64
reference, outputs taken from a block poisoned with NaN.
"""

from __future__ import annotations

import pytest

from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier, two devices: torch not installed")
nn = torch.nn

# a 3x3 layer (a plan with a filter transform where Winograd wins), a prime-sized strided one with
# asymmetric padding, and a 1x1
SPECS = [ConvSpec.make(1, 16, 14, 14, 24, 3, 3, 1, 1), ConvSpec.make(2, 3, 13, 17, 5, 3, 3, (1, 2), (1, 0, 2, 1)),
         ConvSpec.make(3, 7, 9, 9, 5, 1, 1)]


@pytest.fixture
def two(gpu):
    """The second device's torch.device; skips with the count unless torch sees two."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"GPU tier, two devices: torch sees {n} CUDA device(s)")
    torch.cuda.set_device(0)
    return torch.device("cuda", 1)


def _poison(shape, dev):
    t = torch.full(shape, float("nan"), device=dev)
    del t


def _err(y, x, w, spec, b):
    want = conv2d_ref(x.detach().cpu().numpy(), w.detach().cpu().numpy(), spec,
                      None if b is None else b.detach().cpu().numpy())
    return rel_l2(y.detach().cpu().numpy(), want)


def _tensors(spec, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    return (torch.randn(spec.x_shape, device=dev, generator=g), torch.randn(spec.w_shape, device=dev, generator=g),
            torch.randn(spec.k, device=dev, generator=g))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_conv2d_torch_on_the_second_device_while_the_first_is_current(two, spec):
    import convforge
    from convforge.torch import native

    x, w, b = _tensors(spec, two)
    x0, w0, b0 = (t.to("cuda:0") for t in (x, w, b))
    for i in range(4):  # cold, then warm (the native path where built), devices interleaved
        for xs, ws, bs, dev in ((x, w, b, two), (x0, w0, b0, torch.device("cuda", 0))):
            _poison(spec.y_shape, dev)
            y = convforge.conv2d(xs * (i + 1), ws, bs, stride=spec.stride, padding=spec.pad)
            assert y.device == dev and torch.cuda.current_device() == 0
            assert _err(y, xs * (i + 1), ws, spec, bs) < 1e-5, (dev, i)
    nat = native.load()
    if nat is not None:  # one entry per device
        before = nat.stats()["entries"]
        convforge.conv2d(x, w, b, stride=spec.stride, padding=spec.pad)
        convforge.conv2d(x0, w0, b0, stride=spec.stride, padding=spec.pad)
        assert nat.stats()["entries"] == before


def test_weight_update_on_the_second_device_reaches_the_cached_filters(two):
    import convforge

    spec = SPECS[0]
    x, w, b = _tensors(spec, two)
    with torch.no_grad():
        for i in range(3):
            if i:
                w.mul_(1.5)  # in place: a new version, the filters are transformed again
            _poison(spec.y_shape, two)
            y = convforge.conv2d(x, w, b, padding=1)
            assert _err(y, x, w, spec, b) < 1e-5, i


def test_cupy_arrays_on_the_second_device(two):
    cp = pytest.importorskip("cupy", reason="CuPy not installed")
    import convforge

    spec = SPECS[1]
    with cp.cuda.Device(1):
        rng = cp.random.default_rng(0)
        x = rng.standard_normal(spec.x_shape, dtype=cp.float32)
        w = rng.standard_normal(spec.w_shape, dtype=cp.float32)
        for _ in range(3):
            y = convforge.conv2d(x, w, stride=spec.stride, padding=spec.pad)
            assert y.device.id == 1
            assert rel_l2(cp.asnumpy(y), conv2d_ref(cp.asnumpy(x), cp.asnumpy(w), spec)) < 1e-5
    assert cp.cuda.runtime.getDevice() == 0


def test_device_mismatch_is_a_clear_error(two):
    import convforge

    spec = SPECS[2]
    x, w, b = _tensors(spec, two)
    with pytest.raises(ValueError, match="device"):
        convforge.conv2d(x, w.to("cuda:0"), b)
    with pytest.raises(ValueError, match="device"):
        convforge.conv2d(x, w, b.to("cuda:0"))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 1)).eval()


@pytest.mark.parametrize("how", ["convert", "fuse", "op"])
def test_models_on_the_second_device(two, how):
    import convforge.torch as ct

    model = _net()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    ref = _net().double()
    ref.load_state_dict(model.state_dict())
    model.to(two)  # convert after moving: convforge runs CUDA parameters
    if how == "fuse":
        run, report = ct.fuse(model)
        assert {"0", "3"} <= set(report.fused) and not report.left, report
    else:
        report = ct.convert(model)
        assert len(report.converted) == 3 and not report.left, report
        run = torch.compile(model, fullgraph=True) if how == "op" else model
    x = torch.randn(2, 3, 19, 23, device=two)
    with torch.no_grad():
        for _ in range(3):
            _poison((2, 8, 10, 12), two)
            y = run(x)
            assert y.device == two and torch.cuda.current_device() == 0
            want = ref(x.double().cpu())
            assert float((y.double().cpu() - want).norm() / want.norm()) < 1e-5


def test_cuda_graph_capture_on_the_second_device(two, capture_graph):
    import convforge.torch as ct

    model = _net()
    ref = _net().double()
    ref.load_state_dict(model.state_dict())
    assert len(ct.convert(model.to(two)).converted) == 3
    static_x = torch.randn(2, 3, 16, 16, device=two)
    with torch.no_grad(), torch.cuda.device(1):
        graph, static_y = capture_graph(lambda: model(static_x))
        for seed in range(2):
            static_x.copy_(torch.randn(2, 3, 16, 16, device=two, generator=torch.Generator(two).manual_seed(seed)))
            graph.replay()
            torch.cuda.synchronize(two)
            want = ref(static_x.double().cpu())
            assert float((static_y.double().cpu() - want).norm() / want.norm()) < 1e-5, seed
