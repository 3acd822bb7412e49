"""GPU tier of training batch norm in float16 / bfloat16 and channels_last (torch/batchnorm.py; skips without a
CUDA device or torch): ``bn_act`` against PyTorch's ``BatchNorm2d`` [+ add] [-> ReLU] in float64 and against
PyTorch's own half result, NCHW and channels_last, float32 master parameters (as under autocast) and a
``.half()`` module; Inf reaching the gradients (a GradScaler skips the step, as with PyTorch's); bit-identical
reruns; a fused ResNet's AMP step with every batch norm ours.

Bound, per output (z, every gradient, running mean and variance): our relative L2 error against float64 of
the same inputs at most 1.2x PyTorch's half result's, or one unit roundoff of the dtype the output is stored
in (float16 2^-11, bfloat16 2^-8; 5e-6 for float32), whichever is larger: rounding an output alone costs up
to half a unit, so near that floor the ratio of two correct results is noise.

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_bn_half.py``.
"""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of training: torch not installed")
F = torch.nn.functional
FLOOR = {torch.float32: 5e-6, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
RATIO = 1.2

# (N, C, H, W, residual, relu, affine, track): a ResNet stage-1 block (rows split over blocks), N=1 with C=3
# (scalar loads), odd H*W, batch norm alone, no affine, no running statistics, C=2048 at 7x7, C=132 (a ragged
# channel tile in channels_last), H*W = 1
CASES = [(32, 64, 28, 28, True, True, True, True), (1, 3, 7, 7, False, True, True, True),
         (2, 5, 9, 11, True, False, True, True), (3, 7, 13, 13, False, False, True, True),
         (4, 8, 6, 6, True, True, False, True), (2, 16, 28, 28, False, True, True, False),
         (8, 2048, 7, 7, True, True, True, True), (4, 132, 5, 5, True, True, True, True),
         (16, 24, 1, 1, False, True, True, True)]
DTYPES = [torch.float16, torch.bfloat16]
FORMATS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _module(c, affine, track, seed, dtype=torch.float32):
    torch.manual_seed(seed)
    bn = torch.nn.BatchNorm2d(c, affine=affine, track_running_stats=track, momentum=0.2).cuda().train()
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    if track:
        with torch.no_grad():
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    return bn.to(dtype)


ACTS = {"silu": F.silu, "hardswish": F.hardswish}


def _pytorch(bn, y, res, relu, act=""):
    z = bn(y)
    if res is not None:
        z = z + res
    return torch.relu(z) if relu else ACTS[act](z) if act else z


def _run(bn, y, res, gz, relu, ours, act=""):
    """z, the gradients and the running statistics of one training call (ours: bn_act)."""
    from convforge.torch import batchnorm as bt

    yy = y.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    rr = res.detach().clone(memory_format=torch.preserve_format).requires_grad_() if res is not None else None
    if ours:
        assert bt.takes(bn, yy, rr)
        torch.full(y.shape, float("nan"), device="cuda", dtype=y.dtype)  # a poisoned block where outputs land
        z = bt.bn_act(yy, bn, rr, relu, act)
    else:
        z = _pytorch(bn, yy, rr, relu, act)
    z.backward(gz)
    out = {"z": z, "y": yy.grad, **({"res": rr.grad} if rr is not None else {})}
    if bn.affine:
        out.update(weight=bn.weight.grad, bias=bn.bias.grad)
    if bn.track_running_stats:
        out.update(running_mean=bn.running_mean, running_var=bn.running_var)
    return out


def _case_id(c):
    return ("x".join(map(str, c[:4])) + "".join(t for t, on in zip(("_res", "_relu"), c[4:6]) if on)
            + ("" if c[6] else "_noaffine") + ("" if c[7] else "_notrack"))


@pytest.mark.parametrize("params", ["float32", "half"], ids=["fp32-params", "half-params"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bn_act_in_half_against_float64_and_pytorch(gpu, case, dtype, fmt, params):
    n, c, h, w, residual, relu, affine, track = case
    pdt = torch.float32 if params == "float32" else dtype
    ours = _module(c, affine, track, 0, pdt)
    theirs, ref64 = copy.deepcopy(ours), copy.deepcopy(ours).double()
    g = torch.Generator(device="cuda").manual_seed(1)
    mf = FORMATS[fmt]

    def act(scale=1.0, shift=0.0):
        return (torch.randn(n, c, h, w, device="cuda", generator=g) * scale + shift).to(dtype).contiguous(
            memory_format=mf)

    y, gz = act(2.0, 0.7), act()
    res = act() if residual else None
    got = _run(ours, y, res, gz, relu, True)
    half = _run(theirs, y, res, gz, relu, False)
    want = _run(ref64, y.double(), None if res is None else res.double(), gz.double(), relu, False)
    for key, value in got.items():
        assert value.dtype == half[key].dtype, (key, value.dtype, half[key].dtype)
        mine, pt = _rel(value, want[key]), _rel(half[key], want[key])
        assert mine <= max(RATIO * pt, FLOOR[value.dtype]), (key, mine, pt)
    for key in ("z", "y", "res"):  # the activation's memory format, never a layout copy
        if key in got and c > 1 and h * w > 1:
            assert got[key].is_contiguous(memory_format=mf), key
    if track:
        assert int(ours.num_batches_tracked) == int(ref64.num_batches_tracked) == 1


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_autocast_keeps_float32_parameters_and_returns_half(gpu, fmt):
    """Under autocast a float32 BatchNorm2d given float16 activations (a conv's output) returns float16 in
    their memory format, float32 gradients of gamma and beta, float32 running statistics, as PyTorch's."""
    from convforge.torch import batchnorm as bt

    bn = _module(32, True, True, 0)
    ref = copy.deepcopy(bn)
    x = torch.randn(4, 16, 12, 12, device="cuda").contiguous(memory_format=FORMATS[fmt])
    conv = torch.nn.Conv2d(16, 32, 3, padding=1, bias=False).cuda().to(memory_format=FORMATS[fmt])
    with torch.autocast("cuda", torch.float16):
        y = conv(x)
        assert y.dtype == torch.float16 and bt.takes(bn, y)
        z = bt.bn_act(y, bn, None, True)
        zr = torch.relu(ref(y))
    assert z.dtype == zr.dtype == torch.float16 and z.stride() == zr.stride()
    z.float().sum().backward(retain_graph=True)  # the conv's graph is shared by both sides
    zr.float().sum().backward()
    assert bn.weight.grad.dtype == torch.float32 and bn.running_mean.dtype == torch.float32
    assert _rel(z, zr) <= 2.0**-10 and _rel(bn.running_var, ref.running_var) <= 1e-5
    assert _rel(bn.weight.grad, ref.weight.grad) <= 1e-2  # ReLU masks of two half results


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_inf_in_dz_makes_the_gradients_non_finite(gpu, fmt):
    from convforge.torch import batchnorm as bt

    for ours in (True, False):
        bn = _module(8, True, True, 0)
        y = torch.randn(2, 8, 6, 6, device="cuda").half().contiguous(memory_format=FORMATS[fmt]).requires_grad_()
        z = bt.bn_act(y, bn, None, False) if ours else bn(y)
        gz = torch.randn_like(z)
        gz[1, 3, 2, 4] = float("inf")
        z.backward(gz)
        assert not torch.isfinite(y.grad[:, 3]).any(), ours
        assert not torch.isfinite(bn.weight.grad[3]) and not torch.isfinite(bn.bias.grad[3]), ours
        assert torch.isfinite(bn.weight.grad[:3]).all(), ours


def test_grad_scaler_skips_an_overflowing_step_as_with_pytorch(gpu):
    """A scaled loss that overflows float16 in dz: our gradients turn non-finite, so GradScaler skips the
    step (parameters unchanged) and lowers its scale, exactly as it does over PyTorch's batch norm."""
    from convforge.torch import batchnorm as bt

    y = torch.randn(4, 16, 8, 8, device="cuda").half().contiguous(memory_format=torch.channels_last)
    for ours in (True, False):
        bn = _module(16, True, True, 0)
        before = [p.detach().clone() for p in bn.parameters()]
        opt = torch.optim.SGD(bn.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
        with torch.autocast("cuda", torch.float16):
            z = bt.bn_act(y, bn, None, True) if ours else torch.relu(bn(y))
            loss = z.float().sum() * 1e6  # x 2^16: past float16's 65504 in dz
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() < 2.0**16, ours
        assert all(torch.equal(a, b) for a, b in zip(before, bn.parameters())), ours


def test_reruns_are_bit_identical(gpu):
    from convforge.torch import batchnorm as bt

    bn = _module(64, True, True, 0)
    y = torch.randn(16, 64, 28, 28, device="cuda").bfloat16().contiguous(memory_format=torch.channels_last)
    res = torch.randn_like(y)
    outs = []
    for _ in range(2):
        yy = y.clone().requires_grad_()
        z = bt.bn_act(yy, bn, res, True)
        z.backward(torch.ones_like(z))
        outs.append((z.detach().clone(), yy.grad.clone(), bn.weight.grad.clone()))
        bn.weight.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("why", ["float64", "strides", "residual layout", "residual dtype", "params fp16 of bf16",
                                 "params mixed"])
def test_what_it_leaves_to_pytorch(gpu, why):
    from convforge.torch import batchnorm as bt

    bn = _module(8, True, True, 0)
    y = torch.randn(2, 8, 6, 6, device="cuda").half()
    res = None
    if why == "float64":
        y, bn = y.double(), bn.double()
    elif why == "strides":
        y = y.transpose(2, 3)
    elif why == "residual layout":
        res = torch.randn_like(y).contiguous(memory_format=torch.channels_last)
    elif why == "residual dtype":
        res = torch.randn_like(y).float()
    elif why == "params fp16 of bf16":
        y, bn = y.bfloat16(), bn.half()
    else:
        bn._buffers["running_mean"] = bn.running_mean.half()
    assert not bt.takes(bn, y, res)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_bn_silu_and_hardswish_in_half_against_float64_and_pytorch(gpu, act, dtype, fmt):
    """batch norm -> SiLU / HardSwish (EfficientNet's, MobileNet-v3's blocks) as one node: z, dy, dgamma,
    dbeta and the running statistics within the bound of PyTorch's BatchNorm2d + F.silu / F.hardswish in
    the same dtype, both against float64; two shapes (rows split over blocks, a ragged channel tile)."""
    for n, c, h, w in ((32, 96, 28, 28), (4, 132, 5, 5)):
        ours = _module(c, True, True, 0)
        with torch.no_grad():
            ours.weight.uniform_(1.0, 3.0)  # pre-activations past HardSwish's +-3
        theirs, ref64 = copy.deepcopy(ours), copy.deepcopy(ours).double()
        g = torch.Generator(device="cuda").manual_seed(2)
        y = (torch.randn(n, c, h, w, device="cuda", generator=g) * 2 + 0.3).to(dtype).contiguous(
            memory_format=FORMATS[fmt])
        gz = torch.randn(n, c, h, w, device="cuda", generator=g).to(dtype).contiguous(memory_format=FORMATS[fmt])
        got = _run(ours, y, None, gz, False, True, act)
        half = _run(theirs, y, None, gz, False, False, act)
        want = _run(ref64, y.double(), None, gz.double(), False, False, act)
        for key, value in got.items():
            mine, pt = _rel(value, want[key]), _rel(half[key], want[key])
            assert mine <= max(RATIO * pt, FLOOR[value.dtype]), (act, (n, c, h, w), key, mine, pt)
        assert got["z"].is_contiguous(memory_format=FORMATS[fmt]) and got["y"].is_contiguous(
            memory_format=FORMATS[fmt])


def _amp_steps(fused, amp, ref64, x, target):
    """One forward + backward of ``fused`` and ``amp`` under float16 autocast and of ``ref64`` in float64 on
    (x, target): ([fused's loss, amp's loss], the float64 loss); the gradients stay in the parameters."""
    losses = []
    for m in (fused, amp):
        with torch.autocast("cuda", torch.float16):
            loss = F.cross_entropy(m(x), target)
        loss.backward()
        losses.append(float(loss))
    loss64 = F.cross_entropy(ref64(x.double()), target)
    loss64.backward()
    return losses, float(loss64)


@pytest.mark.parametrize("name", ["efficientnet_b0", "mobilenet_v3_large"])
def test_fused_silu_and_hardswish_models_amp_step(gpu, monkeypatch, name):
    """fuse(EfficientNet-B0 / MobileNet-v3-L), one autocast float16 channels_last step: every conv -> BN ->
    SiLU / HardSwish block runs its activation inside our batch norm node (the C++ block from the second
    step), the loss and every parameter's gradient near PyTorch AMP's, both against float64 (dropout and
    stochastic depth off: the three runs see one network)."""
    import convforge.torch as ct
    from convforge.torch import batchnorm as bt

    tv = pytest.importorskip("torchvision", reason="GPU tier: torchvision not installed")
    acts: dict[str, int] = {}
    real = bt.bn_act

    def counted(y, bn, res=None, relu=True, act=""):
        acts[act] = acts.get(act, 0) + 1
        return real(y, bn, res, relu, act)

    monkeypatch.setattr(bt, "bn_act", counted)
    torch.manual_seed(0)
    kw = {"stochastic_depth_prob": 0.0, "dropout": 0.0} if name.startswith("efficientnet") else {"dropout": 0.0}
    model = getattr(tv.models, name)(num_classes=10, **kw).cuda().train().to(memory_format=torch.channels_last)
    amp, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    fused, report = ct.fuse(model)
    want_act = "silu" if name.startswith("efficientnet") else "hardswish"
    assert sum(v.endswith("+" + want_act) for v in report.fused.values()) >= 10, report.fused
    x = torch.randn(4, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)
    losses, loss64 = _amp_steps(fused, amp, ref64, x, torch.randint(0, 10, (4,), device="cuda"))
    assert acts.get(want_act, 0) >= 10, acts
    assert abs(losses[0] - loss64) <= max(2 * abs(losses[1] - loss64), 1e-2)
    grads = [(p.grad, q.grad, p64.grad) for p, q, p64 in zip(model.parameters(), amp.parameters(), ref64.parameters())]
    whole = [_rel(torch.cat([g[i].double().flatten() for g in grads]), torch.cat([g[2].flatten() for g in grads]))
             for i in (0, 1)]
    assert whole[0] <= max(1.5 * whole[1], 1e-2), whole  # the whole gradient
    for (pname, _), (mine, theirs, g64) in zip(model.named_parameters(), grads):
        # one small parameter's (an SE block's bias: 2-6e-2 on both sides) within a few times PyTorch's
        assert _rel(mine, g64) <= max(3 * _rel(theirs, g64), 1e-1), (pname, _rel(mine, g64), _rel(theirs, g64))


def test_fused_resnet_amp_step_runs_every_batch_norm_ours(gpu, monkeypatch):
    """fuse(resnet18), one autocast float16 step: every batch norm through bn_act (half activations,
    float32 parameters), the loss and every parameter's gradient near PyTorch AMP's, both against float64."""
    import convforge.torch as ct
    from convforge.torch import batchnorm as bt

    tv = pytest.importorskip("torchvision", reason="GPU tier: torchvision not installed")
    calls = {"n": 0, "half": 0}
    real = bt.bn_act

    def counted(y, bn, res=None, relu=True, act=""):
        calls["n"] += 1
        calls["half"] += y.dtype == torch.float16
        return real(y, bn, res, relu, act)

    monkeypatch.setattr(bt, "bn_act", counted)
    torch.manual_seed(0)
    model = tv.models.resnet18(num_classes=10).cuda().train()
    amp, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    fused, _ = ct.fuse(model)
    losses, loss64 = _amp_steps(fused, amp, ref64, torch.randn(4, 3, 64, 64, device="cuda"),
                                torch.randint(0, 10, (4,), device="cuda"))
    n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in amp.modules())
    assert calls == {"n": n_bn, "half": n_bn}, calls
    assert abs(losses[0] - loss64) <= max(2 * abs(losses[1] - loss64), 1e-2)
    for (name, p), q, p64 in zip(model.named_parameters(), amp.parameters(), ref64.parameters()):
        mine, theirs = _rel(p.grad, p64.grad), _rel(q.grad, p64.grad)
        assert mine <= max(2 * theirs, 1e-2), (name, mine, theirs)


def _node_call(bn, y, res, gz, relu, act, grads):
    """One training call of bn_act with the inputs in ``grads`` ("y", "res", "weight", "bias") requiring
    gradients: z, those gradients, the running statistics and the batch count."""
    from convforge.torch import batchnorm as bt

    yy = y.detach().clone(memory_format=torch.preserve_format).requires_grad_("y" in grads)
    rr = None if res is None else res.detach().clone(memory_format=torch.preserve_format).requires_grad_(
        "res" in grads)
    for name in ("weight", "bias"):
        if getattr(bn, name) is not None:
            getattr(bn, name).requires_grad_(name in grads)
    z = bt.bn_act(yy, bn, rr, relu, act)
    inputs = [t for name, t in (("y", yy), ("res", rr), ("weight", bn.weight), ("bias", bn.bias))
              if name in grads and t is not None]
    got = list(torch.autograd.grad(z, inputs, gz)) if inputs else []
    return [z, *got, *(t for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked) if t is not None)]


# (N, C, H, W, residual, relu, affine, track, act, the inputs requiring gradients)
NODE_CASES = [(4, 64, 14, 14, False, True, True, True, "", "y weight bias"),  # a pre-activation
              (1, 3, 7, 7, False, False, True, True, "", "y weight bias"),
              (2, 5, 9, 11, True, True, True, True, "", "y res weight bias"),
              (2, 5, 9, 11, True, False, True, True, "", "res bias"),  # the edge count without y's gradient
              (3, 7, 13, 13, True, True, False, True, "", "res"),  # no affine: res's edge after y's
              (4, 132, 5, 5, False, True, True, False, "", "weight"),  # no running statistics
              (8, 16, 6, 6, False, False, True, True, "silu", "y bias"),
              (16, 24, 1, 1, False, False, True, True, "hardswish", "y weight")]


@pytest.mark.parametrize("params", ["float32", "same"], ids=["fp32-params", "same-params"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", NODE_CASES, ids=lambda c: _case_id(c[:8]) + (f"_{c[8]}" if c[8] else "")
                         + "_" + c[9].replace(" ", "-"))
def test_native_node_equals_the_python_node(gpu, monkeypatch, case, dtype, fmt, params):
    """native_nodes.inc's BnNode (the module loaded: it takes the call, its counter moves) against
    batchnorm._BnAct (the module withheld): z, every gradient asked for, the running statistics and the
    batch count bit for bit, including calls where only some inputs need a gradient (the node numbers its
    gradient edges over the tensors given, not the arguments)."""
    from convforge.frontends import fast_path

    module = fast_path.torch_module()
    if module is None:
        pytest.skip("the native module did not build on this machine (its log says why)")
    n, c, h, w, residual, relu, affine, track, act, grads = case
    if params == "same" and dtype == torch.float32:
        pytest.skip("float32 activations: the parameters are float32 in both forms (the fp32-params case)")
    pdt = torch.float32 if params == "float32" else dtype
    g = torch.Generator(device="cuda").manual_seed(4)
    mf = FORMATS[fmt]

    def act_like(scale=1.0, shift=0.0):
        return (torch.randn(n, c, h, w, device="cuda", generator=g) * scale + shift).to(dtype).contiguous(
            memory_format=mf)

    y, gz = act_like(2.0, 0.7), act_like()
    res = act_like() if residual else None
    before = module.stats()["bn_runs"]
    got = _node_call(_module(c, affine, track, 0, pdt), y, res, gz, relu, act, grads.split())
    assert module.stats()["bn_runs"] - before == 1, "the C++ node did not take the call"
    monkeypatch.setattr(fast_path, "TORCH", None)
    want = _node_call(_module(c, affine, track, 0, pdt), y, res, gz, relu, act, grads.split())
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b), i


def test_native_node_refuses_a_second_differentiation(gpu):
    """BnNode's gradients are differentiable once, as _BnAct's (once_differentiable): a double backward
    raises naming the batch norm instead of a silent zero."""
    from convforge.frontends import fast_path
    from convforge.torch import batchnorm as bt

    if fast_path.torch_module() is None:
        pytest.skip("the native module did not build on this machine (its log says why)")
    bn = _module(8, True, True, 0)
    y = torch.randn(2, 8, 6, 6, device="cuda").half().requires_grad_()
    z = bt.bn_act(y, bn, None, True)
    (gy,) = torch.autograd.grad(z.float().pow(2).sum(), y, create_graph=True)
    with pytest.raises(RuntimeError, match="batch norm"):
        gy.float().sum().backward()
