"""GPU tier of training batch norm on convforge's kernels (torch/batchnorm.py; skips without a CUDA device
or torch): ``bn_act`` against float64 (outputs, running statistics, every gradient) within the class of
PyTorch FP32's own error, odd shapes, bit-identical reruns, the fused ResNet's training path through it,
its fallbacks to PyTorch's modules.

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_train_bn.py``.
"""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of training: torch not installed")
F = torch.nn.functional
FP32 = 5e-6

# (N, C, H, W, residual, relu, affine, track): H*W odd (scalar loads) and multiples of 4 (float4), N=1,
# a ResNet-50 stage-1 block at N=32 (channels split over slices), batch norm alone, no affine, no running stats
CASES = [(32, 64, 56, 56, True, True, True, True), (1, 3, 7, 7, False, True, True, True),
         (2, 5, 9, 11, True, False, True, True), (3, 7, 13, 13, False, False, True, True),
         (4, 8, 6, 6, True, True, False, True), (2, 16, 28, 28, False, True, True, False),
         (8, 2048, 7, 7, True, True, True, True)]


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _module(c, affine, track, seed):
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
    return bn


def _pytorch(bn, y, res, relu, mask=None):
    """PyTorch's modules; ``mask``: the ReLU's decisions to take (ours: a pre-activation within a rounding of 0
    flips sign between float32 and float64, and one flipped element's gradient outweighs the tolerance at
    millions of elements, so the references follow the candidate's decisions at the threshold)."""
    z = bn(y)
    if res is not None:
        z = z + res
    if not relu:
        return z
    return torch.relu(z) if mask is None else z * mask.to(z.dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:4])) + "".join(
    t for t, on in zip(("_res", "_relu", "", ""), c[4:6]) if on) + ("" if c[6] else "_noaffine")
    + ("" if c[7] else "_notrack"))
def test_bn_act_matches_float64(gpu, case):
    from convforge.torch import batchnorm as bt

    n, c, h, w, residual, relu, affine, track = case
    ours = _module(c, affine, track, 0)
    ref32, ref64 = copy.deepcopy(ours), copy.deepcopy(ours).double()
    g = torch.Generator(device="cuda").manual_seed(1)
    y = (torch.randn(n, c, h, w, device="cuda", generator=g) * 2 + 0.7).requires_grad_()
    res = torch.randn(n, c, h, w, device="cuda", generator=g).requires_grad_() if residual else None
    gz = torch.randn(n, c, h, w, device="cuda", generator=g)
    assert bt.takes(ours, y, res)
    torch.full((n, c, h, w), float("nan"), device="cuda")  # a poisoned block where the outputs land
    z = bt.bn_act(y, ours, res, relu)
    z.backward(gz)
    got = {"z": z, "y": y.grad, **({"res": res.grad} if residual else {})}
    if affine:
        got.update(weight=ours.weight.grad, bias=ours.bias.grad)
    grads = {}
    for name, m, dt in (("32", ref32, torch.float32), ("64", ref64, torch.float64)):
        yy = y.detach().to(dt).requires_grad_()
        rr = res.detach().to(dt).requires_grad_() if residual else None
        zz = _pytorch(m, yy, rr, relu, (z > 0).detach())
        zz.backward(gz.to(dt))
        grads[name] = {"z": zz, "y": yy.grad, **({"res": rr.grad} if residual else {})}
        if affine:
            grads[name].update(weight=m.weight.grad, bias=m.bias.grad)
    for key, value in got.items():
        mine, theirs = _rel(value, grads["64"][key]), _rel(grads["32"][key], grads["64"][key])
        assert mine <= max(FP32, 2 * theirs), (key, mine, theirs)
    if track:
        for buf in ("running_mean", "running_var"):
            mine, theirs = getattr(ours, buf), getattr(ref64, buf)
            assert _rel(mine, theirs) <= FP32, (buf, _rel(mine, theirs))
        assert int(ours.num_batches_tracked) == int(ref64.num_batches_tracked) == 1


def test_reruns_are_bit_identical(gpu):
    from convforge.torch import batchnorm as bt

    bn = _module(64, True, True, 0)
    y = torch.randn(16, 64, 28, 28, device="cuda", requires_grad=True)
    outs = []
    for _ in range(2):
        y.grad = None
        z = bt.bn_act(y, bn, None, True)
        z.backward(torch.ones_like(z))
        outs.append((z.detach().clone(), y.grad.clone(), bn.weight.grad.clone()))
        bn.weight.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_running_statistics_update_bumps_their_versions(gpu):
    """A fold cached by (address, version) in eval mode must see the training step's update."""
    from convforge.torch import batchnorm as bt

    bn = _module(8, True, True, 0)
    versions = (bn.running_mean._version, bn.running_var._version)
    bt.bn_act(torch.randn(2, 8, 5, 5, device="cuda"), bn, None, True)
    assert bn.running_mean._version > versions[0] and bn.running_var._version > versions[1]


def _resnet():
    tv = pytest.importorskip("torchvision", reason="GPU tier: torchvision not installed")
    torch.manual_seed(0)
    return tv.models.resnet18(num_classes=10).cuda().train()


def test_fused_resnet_trains_through_our_batch_norm(gpu, monkeypatch):
    """fuse(resnet18) in training mode: every batch norm through bn_act (the residual adds and ReLUs with
    them), every parameter's gradient and running statistic within the class of PyTorch FP32's error
    against float64, then eval mode (folded, with the updated statistics) agrees with PyTorch's."""
    import convforge.torch as ct
    from convforge.config import config
    from convforge.torch import batchnorm as bt

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    calls = {"n": 0, "res": 0}
    real = bt.bn_act

    def counted(y, bn, res=None, relu=True, act=""):
        calls["n"] += 1
        calls["res"] += res is not None
        return real(y, bn, res, relu, act)

    monkeypatch.setattr(bt, "bn_act", counted)
    model = _resnet()
    ref32, ref64, off = copy.deepcopy(model), copy.deepcopy(model).double(), copy.deepcopy(model)
    fused, _ = ct.fuse(model)
    fused_off, _ = ct.fuse(off)  # our convolutions, PyTorch's batch norms: the error our convs alone give
    x = torch.randn(4, 3, 64, 64, device="cuda")
    target = torch.randint(0, 10, (4,), device="cuda")
    F.cross_entropy(fused(x), target).backward()
    n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in ref32.modules())
    assert calls == {"n": n_bn, "res": 8}, calls  # resnet18: 20 batch norms, 8 residual adds
    F.cross_entropy(ref32(x), target).backward()
    F.cross_entropy(ref64(x.double()), target).backward()
    monkeypatch.setattr(config, "train_bn", False)
    F.cross_entropy(fused_off(x), target).backward()
    assert calls["n"] == n_bn  # off: PyTorch's modules
    # bound: the class's, or 2x the larger of PyTorch FP32's error and our convolutions' with PyTorch's
    # batch norms (a gradient deep in the network carries every later layer's dgrad error)
    for (name, p), p32, p64, q in zip(model.named_parameters(), ref32.parameters(), ref64.parameters(),
                                      off.parameters()):
        mine, theirs, convs = _rel(p.grad, p64.grad), _rel(p32.grad, p64.grad), _rel(q.grad, p64.grad)
        assert mine <= max(FP32, 2 * theirs, 2 * convs), (name, mine, theirs, convs)
    for (name, b), b64 in zip(model.named_buffers(), ref64.buffers()):
        if "running" in name:
            assert _rel(b, b64) <= FP32, (name, _rel(b, b64))
    fused.eval()
    ref32.load_state_dict(model.state_dict())
    ref32.eval()
    with torch.no_grad():
        want, got = ref32(x), fused(x)
    assert _rel(got, want) <= 1e-5


@pytest.mark.parametrize("why", ["momentum None", "strides", "config off", "eval", "subclass", "inference"])
def test_what_it_leaves_to_pytorch(gpu, monkeypatch, why):
    from convforge.config import config
    from convforge.torch import batchnorm as bt

    bn = _module(8, True, True, 0)
    y = torch.randn(2, 8, 6, 6, device="cuda")
    if why == "momentum None":
        bn.momentum = None
    elif why == "strides":  # neither NCHW nor channels_last (those are taken: tests/test_gpu_bn_half.py)
        y = y.transpose(2, 3)
    elif why == "config off":
        monkeypatch.setattr(config, "train_bn", False)
    elif why == "subclass":
        class Mine(torch.nn.BatchNorm2d):
            pass

        bn = Mine(8).cuda().train()
    elif why == "inference":
        with torch.inference_mode():
            assert not bt.takes(bn, y)
        assert bt.takes(bn, y)
        return
    else:
        bn.eval()
    assert not bt.takes(bn, y)


# (N, C, K, H, W, kernel, stride, dilation, residual, relu, affine, track): native.cpp's BlockNode against
# the two Python nodes it replaces (the op's and _BnAct) on the same kernels: N=1, prime channels and sizes,
# stride 2, dilation 2, 1x1, with and without the residual, ReLU, affine parameters and running statistics
BLOCKS = [(1, 3, 5, 7, 7, 3, 1, 1, False, True, True, True), (2, 16, 32, 9, 11, 3, 2, 1, True, True, True, True),
          (4, 64, 64, 14, 14, 1, 1, 1, True, True, True, True), (3, 8, 24, 13, 13, 3, 1, 2, False, False, True, True),
          (2, 32, 16, 10, 10, 3, 1, 1, True, False, False, True), (2, 12, 20, 8, 8, 1, 2, 1, False, True, True, False)]


def _block(case, seed):
    from convforge.torch.fused import FusedConv2d

    n, c, k, h, w, r, s, d, residual, relu, affine, track = case
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(c, k, r, s, padding=d * (r // 2), dilation=d, bias=False).cuda()
    return FusedConv2d.from_conv(conv, _module(k, affine, track, seed), residual=residual, relu=relu)


# how a block's training call runs: float32; an FP16 / BF16 autocast region on a channels_last input (the
# float32 master weight, KCRS or channels_last as model.to(memory_format=...) leaves it, cast by BlockNode and
# its gradient cast back there, by Python's Conv2d on the other side); a .half() model on NCHW input
MODES = [("fp32", None, None, False), ("amp16_nhwc", torch.float16, None, True),
         ("ampbf16_nhwc", torch.bfloat16, None, True), ("amp16_nhwc_clw", torch.float16, None, "weights"),
         ("half_nchw", None, torch.float16, False)]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m[0])
@pytest.mark.parametrize("case", BLOCKS, ids=lambda c: "x".join(map(str, c[:5])) + f"_r{c[5]}s{c[6]}d{c[7]}"
                         + "".join(t for t, on in zip(("_res", "_relu", "", ""), c[8:]) if on)
                         + ("" if c[10] else "_noaffine") + ("" if c[11] else "_notrack"))
def test_native_block_is_bit_identical_to_the_python_nodes(gpu, monkeypatch, case, mode):
    """Four training steps of one conv -> batch norm [-> + res] [-> ReLU] block, the weights updated in
    place between them (the cached filters must follow their versions): with native.cpp's BlockNode (from
    the second call on, once the first has filed it) and without it (the op's node and _BnAct), every
    output, gradient, running statistic and batch count bit-identical, and BlockNode really ran; in float32,
    under FP16 / BF16 autocast with channels_last activations (gradients of the float32 master weights), and
    in a half model. Under autocast the master is cast by the block's attached casts, and its gradient comes
    back in the parameter's layout."""
    import contextlib

    from convforge.config import config
    from convforge.torch import native

    # The statistics epilogue (config.bn_stats, on by default) sums in its own order: tests/test_gpu_bnstats.py
    monkeypatch.setattr(config, "bn_stats", False)
    module = native.load()
    assert module is not None, "the native fast path did not build on this GPU machine"
    n, c, k, h, w, r, s, d, residual, relu, affine, track = case
    _, amp, half, nhwc = mode
    on, off = _block(case, 0), _block(case, 0)
    if half is not None:  # the batch norm is a reference, not a submodule: converted as a model's would be
        for m in (on, off):
            m.to(half)
            m._cf_bn.to(half)
    if nhwc == "weights":  # channels_last parameters too
        for m in (on, off):
            m.to(memory_format=torch.channels_last)
    act = half or amp or torch.float32  # the activations' dtype
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(3)
    before, casts = module.stats()["block_runs"], module.stats()["cast_runs"]
    for step in range(4):
        x = torch.randn(n, c, h, w, device="cuda", generator=g).to(half or torch.float32, memory_format=fmt)
        p, q = (h + 2 * d * (r // 2) - d * (r - 1) - 1) // s + 1, (w + 2 * d * (r // 2) - d * (r - 1) - 1) // s + 1
        res = torch.randn(n, k, p, q, device="cuda", generator=g).to(act, memory_format=fmt) if residual else None
        gz = torch.randn(n, k, p, q, device="cuda", generator=g).to(act, memory_format=fmt)
        outs = []
        for m, native_block in ((on, True), (off, False)):
            monkeypatch.setattr(config, "native_block", native_block)
            xx = x.clone().requires_grad_()
            rr = res.clone().requires_grad_() if residual else None
            ctx = torch.autocast("cuda", amp) if amp is not None else contextlib.nullcontext()
            with ctx:
                z = m(xx, rr)
            assert torch.isfinite(z).all() and z.dtype == act and z.is_contiguous(memory_format=fmt)
            if native_block and step and amp is not None:  # the master weight is the node's own input
                assert [type(f).__name__ for f, _ in z.grad_fn.next_functions if f][1] == "AccumulateGrad"
            z.backward(gz)
            assert m.weight.grad.dtype == m.weight.dtype  # float32 master weights under autocast
            # in the parameter's layout (the strides of sizes above 1, as AccumulateGrad compares them): no copy after
            assert [st for st, sz in zip(m.weight.grad.stride(), m.weight.shape) if sz > 1] == \
                [st for st, sz in zip(m.weight.stride(), m.weight.shape) if sz > 1]
            got = [z.detach(), xx.grad, m.weight.grad] + ([rr.grad] if residual else [])
            bn = m._cf_bn
            if affine:
                got += [bn.weight.grad, bn.bias.grad]
            if track:
                got += [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]
            outs.append(got)
            with torch.no_grad():  # an SGD step: new weight versions for the next call
                for t in [m.weight] + ([bn.weight, bn.bias] if affine else []):
                    t.sub_(0.1 * t.grad)
                    t.grad = None
        for i, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), (step, i, float((a.double() - b.double()).abs().max()))
    assert module.stats()["block_runs"] - before == 3  # calls 2-4; the first filed it
    if amp is not None:  # the float32 master cast by the block's own casts (torch/filter_casts.py), not Tensor.to
        assert module.stats()["cast_runs"] - casts == 3


@pytest.mark.parametrize("amp", [None, torch.float16, torch.bfloat16], ids=["fp32", "amp16", "ampbf16"])
def test_native_block_steps_a_fused_resnet_bit_identically(gpu, monkeypatch, amp):
    """Three SGD steps of fuse(resnet18) at N=3 with native.cpp's BlockNode and without: the same losses,
    parameters and running statistics bit for bit (every batch norm of a ResNet is in such a block; the
    first step files them); in float32 and as an AMP step (autocast, channels_last, a GradScaler). Its
    agreement with float64 is test_fused_resnet_trains_through_our_batch_norm's."""
    import contextlib

    import convforge.torch as ct
    from convforge.config import config
    from convforge.torch import native

    # The statistics epilogue (config.bn_stats, on by default) sums in its own order: tests/test_gpu_bnstats.py
    monkeypatch.setattr(config, "bn_stats", False)
    module = native.load()
    assert module is not None, "the native fast path did not build on this GPU machine"
    model = _resnet()
    fmt = torch.contiguous_format if amp is None else torch.channels_last
    model = model.to(memory_format=fmt)
    fused = {True: ct.fuse(copy.deepcopy(model))[0], False: ct.fuse(copy.deepcopy(model))[0]}
    x = torch.randn(3, 3, 64, 64, device="cuda").to(memory_format=fmt)
    target = torch.randint(0, 10, (3,), device="cuda")
    losses: dict[bool, list[float]] = {True: [], False: []}
    scalers = {b: torch.amp.GradScaler("cuda", enabled=amp is torch.float16) for b in fused}
    before = module.stats()["block_runs"]
    for _ in range(3):
        for native_block, m in fused.items():
            monkeypatch.setattr(config, "native_block", native_block)
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            with torch.autocast("cuda", amp) if amp is not None else contextlib.nullcontext():
                loss = F.cross_entropy(m(x), target)
            scalers[native_block].scale(loss).backward()
            scalers[native_block].step(opt)
            scalers[native_block].update()
            opt.zero_grad(set_to_none=True)
            losses[native_block].append(float(loss))
    assert losses[True] == losses[False]
    for a, b in zip(fused[True].state_dict().values(), fused[False].state_dict().values()):
        assert torch.equal(a, b)
    assert module.stats()["block_runs"] - before >= 2 * 19  # resnet18's 20 blocks but the stem, steps 2 and 3


def test_blocks_run_natively_again_after_a_setting_is_assigned(gpu, monkeypatch):
    """Assigning a setting empties the native table (caches.py, event "settings"); the next call of each conv
    files it again from Python's path, so a fused model's blocks run in C++ again from the step after. They
    did not: a miss answered from the runner cache was never filed (a second fused ResNet-50 in one process,
    after a setting was assigned, ran every block on Python's path)."""
    import convforge.torch as ct
    from convforge.config import config
    from convforge.torch import native

    module = native.load()
    assert module is not None, "the native fast path did not build on this GPU machine"
    monkeypatch.setattr(config, "train_graphs", False)  # every step runs the nodes (a replay would not count)
    fused = ct.fuse(_resnet().to(memory_format=torch.channels_last))[0]
    x = torch.randn(3, 3, 64, 64, device="cuda").to(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (3,), device="cuda")
    opt = torch.optim.SGD(fused.parameters(), lr=0.05)

    def step() -> None:
        with torch.autocast("cuda", torch.float16):
            loss = F.cross_entropy(fused(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    monkeypatch.setattr(config, "max_error", config.max_error)  # an assignment, the value unchanged
    assert module.stats()["entries"] == 0
    step()  # files every conv again
    before = module.stats()["block_runs"]
    for _ in range(2):
        step()
    assert module.stats()["block_runs"] - before >= 2 * 19  # resnet18's 20 blocks but the stem


def test_native_block_under_create_graph_is_differentiable_once(gpu, monkeypatch):
    """backward(create_graph=True) through BlockNode gives the Python nodes' first-order gradients bit for
    bit; differentiating them again raises naming the block (the Python nodes raise too), never a silent
    zero."""
    from convforge.config import config
    from convforge.torch import native

    module = native.load()
    assert module is not None, "the native fast path did not build on this GPU machine"
    case = BLOCKS[1]  # residual + ReLU, stride 2
    n, c, k, h, w = case[:5]
    x = torch.randn(n, c, h, w, device="cuda")
    res = torch.randn(n, k, 5, 6, device="cuda")
    firsts = []
    for native_block in (True, False):
        monkeypatch.setattr(config, "native_block", native_block)
        m = _block(case, 0)
        m(x, res).sum().backward()  # the first call files the block
        before = module.stats()["block_runs"]
        xx = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(m(xx, res).square().sum(), xx, create_graph=True)
        assert module.stats()["block_runs"] - before == int(native_block)
        firsts.append(gx.detach())
        assert gx.requires_grad
        # native: BlockNode's own error; Python's: conv2d_input has no derivative (or _BnAct's error)
        with pytest.raises(RuntimeError, match="differentiate twice" if native_block else ""):
            gx.sum().backward()
    assert torch.equal(*firsts)
