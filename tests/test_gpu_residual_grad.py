"""GPU tier of a block's input gradient summed with a later block's residual gradient in one dgrad
(torch/residual_grad.py, native.cpp ``PairToken``; skips without a CUDA device or torch): a fused stack of
ResNet bottlenecks under FP16 / BF16 autocast with channels_last activations trains with its first blocks'
dgrads adding the last blocks' residual gradients (``config.residual_grad``, on by default, switched on
here whatever the environment says; the native counter moves), the input's and every
parameter's gradient against float64 within 2x the error of PyTorch's own autocast run, and close to the same
model with the pairing off; a backward that asks for one weight only (the first block's backward never runs)
leaves nothing behind, and two backwards over a retained graph sum as autograd's. A bottleneck with a
downsample (stride 1 and 2) pairs its first block's dgrad with the downsample block's input gradient.

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_residual_grad.py``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of training: torch not installed")
tv = pytest.importorskip("torchvision", reason="GPU tier of training: torchvision not installed")

N, C, WIDTH, HW = 4, 256, 64, 14  # two identity bottlenecks of ResNet-50's first stage, on a 14 x 14 image


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _model(seed=0, stride=0):
    """Two bottlenecks after a conv -> BN -> ReLU stem; ``stride`` 1 or 2: the first has a downsample (its
    conv2 and downsample at that stride, a stage's first bottleneck), whose input gradient pairs too."""
    torch.manual_seed(seed)
    from torchvision.models.resnet import Bottleneck

    stem, first = C, Bottleneck(C, WIDTH)
    if stride:
        stem = WIDTH
        down = torch.nn.Sequential(torch.nn.Conv2d(stem, C, 1, stride, bias=False), torch.nn.BatchNorm2d(C))
        first = Bottleneck(stem, WIDTH, stride, down)
    body = torch.nn.Sequential(torch.nn.Conv2d(16, stem, 1, bias=False), torch.nn.BatchNorm2d(stem),
                               torch.nn.ReLU(), first, Bottleneck(C, WIDTH))
    for m in body.modules():  # non-trivial batch-norm affines: every gradient term matters
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
            torch.nn.init.uniform_(m.bias, -0.2, 0.2)
    return body.cuda().train().to(memory_format=torch.channels_last)


def _step(m, x, gz, dt):
    """One forward and backward under autocast: (input gradient, parameter gradients by name)."""
    xx = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=dt) if dt != torch.float64 else contextlib.nullcontext():
        z = m(xx)
    z.backward(gz.to(z.dtype))
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    return xx.grad.detach(), grads


@pytest.fixture
def paired(monkeypatch):
    """config.residual_grad (on by default) and the native module's switch on for the test, then restored."""
    from convforge.config import config
    from convforge.torch import native

    module = native.load()
    assert module is not None, "the native fast path did not build on this GPU machine"
    prev = bool(config.residual_grad)
    monkeypatch.setattr(config, "residual_grad", True)
    module.set_residual_grad(True)
    yield module
    module.set_residual_grad(prev)


@pytest.mark.parametrize("dt,stride", [(torch.float16, 0), (torch.bfloat16, 0), (torch.float16, 1),
                                       (torch.float16, 2), (torch.bfloat16, 2)],
                         ids=["fp16", "bf16", "fp16-downsample", "fp16-downsample/2", "bf16-downsample/2"])
def test_paired_dgrad_sums_both_gradients(gpu, paired, dt, stride):
    import convforge.torch as ct

    module = paired
    model = _model(stride=stride)
    ref64, theirs = copy.deepcopy(model).double(), copy.deepcopy(model)
    fused, _ = ct.fuse(copy.deepcopy(model))
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(N, 16, HW, HW, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    out = HW // max(stride, 1)
    gz = torch.randn(N, C, out, out, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    for _ in range(2):  # the first call files every block and attaches the pairs' dgrads; the second is warm
        _step(fused, x, gz, dt)
    before = module.stats()["pair_runs"]
    gx, grads = _step(fused, x, gz, dt)
    runs = module.stats()["pair_runs"] - before
    assert runs == 2, f"the two bottlenecks' first blocks paired {runs} times, not 2"
    try:
        module.set_residual_grad(False)
        gx_off, grads_off = _step(fused, x, gz, dt)
    finally:
        module.set_residual_grad(True)
    assert module.stats()["pair_runs"] - before == 2  # off: autograd adds
    gx_t, grads_t = _step(theirs, x, gz, dt)
    gx64, grads64 = _step(ref64, x.double(), gz.double(), torch.float64)
    got, unpaired, pytorch = {"x": gx, **grads}, {"x": gx_off, **grads_off}, {"x": gx_t, **grads_t}
    want = {"x": gx64, **grads64}
    floor = 2e-3 if dt == torch.float16 else 1.6e-2
    for name, value in got.items():
        assert torch.isfinite(value).all(), name
        mine, ref = _rel(value, want[name]), _rel(pytorch[name], want[name])
        assert mine <= max(floor, 2 * ref), (name, mine, ref)
        assert _rel(value, unpaired[name]) <= floor, (name, _rel(value, unpaired[name]))


def test_partial_and_retained_backwards(gpu, paired):
    """torch.autograd.grad of the last conv's weight alone runs the last blocks' backward, not the first
    blocks': what they left is never taken, and the next full backward is right. Two backwards over one
    retained graph: the second runs unpaired (the first block ran already), the sum is autograd's."""
    import convforge.torch as ct

    model = _model(1)
    fused, _ = ct.fuse(model)
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(N, 16, HW, HW, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    gz = torch.randn(N, C, HW, HW, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    for _ in range(2):
        _step(fused, x, gz, torch.float16)
    one, _ = _step(fused, x, gz, torch.float16)
    last = [m for m in fused.modules() if isinstance(m, torch.nn.Conv2d)][-1].weight
    xx = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.float16):
        z = fused(xx)
    (gw,) = torch.autograd.grad(z, [last], gz.half(), retain_graph=True)
    assert torch.isfinite(gw).all() and xx.grad is None
    z.backward(gz.half(), retain_graph=True)
    first = xx.grad.clone()
    z.backward(gz.half())
    assert _rel(first, one) <= 1e-6, _rel(first, one)  # the stale gradient of the partial backward not added
    assert _rel(xx.grad, 2 * one) <= 2e-3, _rel(xx.grad, 2 * one)
    fused.zero_grad(set_to_none=True)
