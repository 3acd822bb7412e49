"""GPU tier of the drop-in (skips the CUDA compute, visibly, without a CUDA device): PyTorch's own OpInfo
samples of ``nn.functional.conv2d`` and ``nn.functional.conv_transpose2d`` in float32, float16 and
bfloat16 through convforge (outputs through ``convforge.conv2d`` / ``convforge.conv_transpose2d``, which
raise where convforge refuses; gradients through the torch op's autograd: ``convforge.torch.conv2d`` /
``conv_transpose2d``), each against PyTorch's float64 computation on the same inputs, with the refused
and wrong counts reported and any of either failing the test; then ``ct.Conv2d`` with padding modes and
unbatched inputs, ``ct.ConvTranspose2d`` in training, and ``torch.compile(backend="convforge")`` on CUDA.

A gradient pass that the op hands to PyTorch (``ops._torch_input`` / ``_torch_weight`` / ``_torch_conv``:
no convforge variant for it, or a dtype the backward ops do not run yet) counts as refused. The bias
gradient of a half layer is PyTorch's reduction today and is not counted.

Run on the lent GPU: ``python -m pytest -q -s tests/test_gpu_dropin.py`` (needs ``expecttest`` for
torch's OpInfo database)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of the drop-in: torch not installed")
F = torch.nn.functional

OPS = ("nn.functional.conv2d", "nn.functional.conv_transpose2d")
DTYPES = ("float32", "float16", "bfloat16")
TOL = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}  # relative L2 against float64 (or 4x PyTorch's own)


def _samples(name: str, dtype: str, device: str) -> list[Any]:
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as err:  # torch's test suite needs expecttest
        pytest.skip(f"torch's OpInfo database does not import ({err}); pip install expecttest")
    op = next(o for o in op_db if o.name == name)
    return list(op.sample_inputs(device, getattr(torch, dtype), requires_grad=True))


def _kw(sample: Any) -> tuple[Any, Any, dict[str, Any]]:
    w = sample.args[0]
    bias = sample.args[1] if len(sample.args) > 1 else sample.kwargs.get("bias")
    return w, bias, {k: v for k, v in sample.kwargs.items() if k != "bias"}


def _normalised(name: str, x: Any, w: Any, kw: dict[str, Any]) -> tuple[int, ...]:
    """The output shape convforge's argument handling gives (raises where it refuses the arguments)."""
    from convforge.spec import ConvSpec, conv_args, transposed_geometry

    xb = tuple(x.shape) if x.dim() == 4 else (1, *x.shape)
    if name.endswith("transpose2d"):
        spec, _, _ = transposed_geometry(xb, tuple(w.shape), kw.get("stride", 1), kw.get("padding", 0),
                                         kw.get("output_padding", 0), kw.get("groups", 1), kw.get("dilation", 1))
        shape = spec.x_shape
    else:
        a = conv_args(tuple(x.shape), tuple(w.shape), kw.get("stride", 1), kw.get("padding", 0),
                      kw.get("dilation", 1))
        shape = ConvSpec.from_shapes(xb, tuple(w.shape), a.stride, a.pad, a.dilation, kw.get("groups", 1)).y_shape
    return shape if x.dim() == 4 else shape[1:]


def _rel(a: Any, ref: Any) -> float:
    den = ref.norm().item()
    num = (a.double() - ref).norm().item()
    return num / den if den else num


@pytest.mark.parametrize("name", OPS)
def test_every_opinfo_sample_runs_right(name, monkeypatch):
    """Every sample in every dtype: enumerated and normalised anywhere; on CUDA, output and gradients
    against float64, refused and wrong counted and reported."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total = 0
    for dtype in DTYPES:
        for s in _samples(name, dtype, device):
            w, bias, kw = _kw(s)
            ref = getattr(F, name.rsplit(".", 1)[1])(s.input.detach(), w.detach(), None if bias is None else
                                                      bias.detach(), **kw)
            assert tuple(ref.shape) == _normalised(name, s.input, w, kw), (name, dtype, s)
            total += 1
    if device != "cuda":
        pytest.skip(f"GPU tier: {total} OpInfo samples of {name} enumerated and normalised on CPU; "
                    "their CUDA compute needs a CUDA device")
    from convforge.torch import ops

    handed: Counter[str] = Counter()
    for fn in ("_torch_input", "_torch_weight", "_torch_conv"):
        real = getattr(ops, fn)
        monkeypatch.setattr(ops, fn, lambda *a, _r=real, _n=fn, **k: (handed.update([_n]), _r(*a, **k))[1])
    tally: Counter[str] = Counter()
    problems: list[str] = []
    for dtype in DTYPES:
        for i, s in enumerate(_samples(name, dtype, "cuda")):
            for what, verdict in _check(name, dtype, s, handed):
                tally[f"{what} {verdict.split(':')[0]}"] += 1
                if verdict != "right":
                    problems.append(f"{name} {dtype} sample {i} {what}: {verdict}")
    print(f"\n{name}: {dict(sorted(tally.items()))}")
    for line in problems:
        print("  " + line)
    refused = sum(v for k, v in tally.items() if k.endswith("refused"))
    wrong = sum(v for k, v in tally.items() if k.endswith("wrong"))
    assert refused == 0 and wrong == 0, f"{refused} refused, {wrong} wrong:\n" + "\n".join(problems)


def _check(name: str, dtype: str, s: Any, handed: Counter[str]) -> list[tuple[str, str]]:
    """[(output | grad x | grad w | grad bias, right | refused: why | wrong: error)] for one sample."""
    import convforge
    import convforge.torch as ct

    transposed = name.endswith("transpose2d")
    w, bias, kw = _kw(s)
    x = s.input
    ours_api = convforge.conv_transpose2d if transposed else convforge.conv2d
    ours_op = ct.conv_transpose2d if transposed else ct.conv2d
    theirs = F.conv_transpose2d if transposed else F.conv2d
    leaves = [t for t in (x, w, bias) if t is not None]
    ref64 = theirs(x.detach().double().requires_grad_(), w.detach().double().requires_grad_(),
                   None if bias is None else bias.detach().double().requires_grad_(), **kw)
    torch_err = _rel(theirs(x.detach(), w.detach(), None if bias is None else bias.detach(), **kw), ref64.detach())
    tol = max(TOL[dtype], 4 * torch_err)
    out: list[tuple[str, str]] = []
    try:
        y = ours_api(x.detach(), w.detach(), None if bias is None else bias.detach(), **kw)
        err = _rel(y, ref64.detach())
        out.append(("output", "right" if err <= tol else f"wrong: {err:.2e} > {tol:.1e}"))
    except ValueError as why:
        out.append(("output", f"refused: {why}"))
    gy = torch.randn_like(ref64)
    ins64 = [t.detach().double().requires_grad_() for t in leaves]
    args64 = ins64 + ([None] if bias is None else [])
    grads64 = torch.autograd.grad(theirs(*args64, **kw), ins64, gy)
    before = sum(handed.values())
    try:
        yo = ours_op(x, w, bias, **kw)
        grads = torch.autograd.grad(yo, leaves, gy.to(yo.dtype))
    except ValueError as why:
        return out + [("gradients", f"refused: {why}")]
    fell_back = sum(handed.values()) > before
    for label, g, g64 in zip(("grad x", "grad w", "grad bias"), grads, grads64):
        err = _rel(g, g64)
        if fell_back and label != "grad bias":
            out.append((label, "refused: a pass ran on PyTorch's kernels"))
        else:
            out.append((label, "right" if err <= max(tol, 1e-5) else f"wrong: {err:.2e}"))
    return out


# -- modules, autocast, compile -----------------------------------------------------------------------
def test_conv2d_module_padding_modes_and_unbatched_match_float64(gpu):
    import convforge.torch as ct

    torch.manual_seed(0)
    for mode in ("zeros", "reflect", "replicate", "circular"):
        m = torch.nn.Conv2d(5, 7, (4, 3), padding="same", dilation=(1, 2), padding_mode=mode).cuda()
        cm = ct.Conv2d.from_module(m)
        for shape in ((2, 5, 13, 11), (5, 9, 12)):
            x = torch.randn(shape, device="cuda", requires_grad=True)
            m64 = torch.nn.Conv2d(5, 7, (4, 3), padding="same", dilation=(1, 2), padding_mode=mode).cuda().double()
            m64.load_state_dict(m.state_dict())
            x64 = x.detach().double().requires_grad_()
            y, y64 = cm(x), m64(x64)
            assert y.shape == y64.shape and _rel(y, y64.detach()) < 1e-5, (mode, shape)
            gy = torch.randn_like(y)
            gx, gw = torch.autograd.grad(y, (x, m.weight), gy)
            gx64, gw64 = torch.autograd.grad(y64, (x64, m64.weight), gy.double())
            assert _rel(gx, gx64) < 1e-5 and _rel(gw, gw64) < 1e-5, (mode, shape)
            with torch.no_grad():
                assert _rel(cm(x), y64.detach()) < 1e-5  # eager inference: the prepared runner or native


def test_conv_transpose2d_module_trains_like_pytorch(gpu):
    import convforge.torch as ct

    torch.manual_seed(1)
    for args in ((16, 8, 4, 2, 1), (8, 6, 3, 2, 1, 1, 2), (32, 16, 2, 2, 0)):
        m = torch.nn.ConvTranspose2d(*args[:5], output_padding=args[5] if len(args) > 5 else 0,
                                     groups=args[6] if len(args) > 6 else 1).cuda()
        ref = torch.nn.ConvTranspose2d(*args[:5], output_padding=args[5] if len(args) > 5 else 0,
                                       groups=args[6] if len(args) > 6 else 1).cuda().double()
        ref.load_state_dict(m.state_dict())
        cm = ct.ConvTranspose2d.from_module(m)
        x = torch.randn(3, args[0], 7, 9, device="cuda", requires_grad=True)
        x64 = x.detach().double().requires_grad_()
        y, y64 = cm(x), ref(x64)
        assert _rel(y, y64.detach()) < 1e-5
        gy = torch.randn_like(y)
        got = torch.autograd.grad(y, (x, m.weight, m.bias), gy)
        want = torch.autograd.grad(y64, (x64, ref.weight, ref.bias), gy.double())
        assert all(_rel(a, b) < 1e-5 for a, b in zip(got, want)), args
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yh = cm(x)
        assert yh.dtype == torch.bfloat16 and _rel(yh, y64.detach()) < 2e-2


def _transpose_call(x0, w0, b0, grads, geo):
    """y and the gradients in ``grads`` ("x", "w", "b") of one conv_transpose2d call on copies of the operands."""
    import convforge.torch as ct

    x = x0.clone(memory_format=torch.preserve_format).requires_grad_("x" in grads)
    w = w0.clone().requires_grad_("w" in grads)
    b = None if b0 is None else b0.clone().requires_grad_("b" in grads)
    y = ct.conv_transpose2d(x, w, b, *geo)
    inputs = [t for name, t in (("x", x), ("w", w), ("b", b)) if name in grads and t is not None]
    gy = torch.randn(y.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(6))
    return [y, *torch.autograd.grad(y, inputs, gy.to(y.dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("grads", ["x w b", "w", "x b"])
def test_conv_transpose2d_native_node_equals_the_python_node(gpu, monkeypatch, dtype, grads):
    """native_nodes.inc's TransposeNode (the module loaded: it takes the call, its counter moves) against
    transposed._ConvTransposeFn (the module withheld): y and each gradient asked for bit for bit; stride 2
    with output padding and groups, N=1 with a prime width, channels_last input, no bias."""
    from convforge.frontends import fast_path

    module = fast_path.torch_module()
    if module is None:
        pytest.skip("the native module did not build on this machine (its log says why)")
    g = torch.Generator(device="cuda").manual_seed(5)
    # (x shape, w shape, bias, stride, padding, output_padding, groups, dilation, channels_last)
    layers = [((3, 16, 7, 9), (16, 8, 4, 4), True, 2, 1, 0, 1, 1, False),
              ((2, 12, 5, 6), (12, 3, 3, 3), True, 2, 1, 1, 2, 1, False),
              ((1, 8, 11, 13), (8, 8, 3, 3), False, 1, 2, 0, 1, 2, False),
              ((4, 32, 8, 8), (32, 16, 2, 2), True, 2, 0, 0, 1, 1, True)]
    for xs, ws, has_bias, stride, pad, opad, groups, dil, cl in layers:
        x0 = torch.randn(xs, device="cuda", generator=g).to(dtype)
        if cl:
            x0 = x0.contiguous(memory_format=torch.channels_last)
        w0 = (torch.randn(ws, device="cuda", generator=g) * 0.1).to(dtype)
        b0 = torch.randn(ws[1] * groups, device="cuda", generator=g).to(dtype) if has_bias else None

        before = module.stats()["transpose_runs"]
        args = (x0, w0, b0, grads, (stride, pad, opad, groups, dil))
        got = _transpose_call(*args)
        assert module.stats()["transpose_runs"] - before == 1, "the C++ node did not take the call"
        with monkeypatch.context() as m:
            m.setattr(fast_path, "TORCH", None)
            want = _transpose_call(*args)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b), (xs, ws, i)


def test_torch_compile_backend_on_cuda_matches_eager(gpu):
    from convforge.torch import compile_backend

    compile_backend.register()
    torch._dynamo.reset()
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
                              torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1, padding_mode="reflect"),
                              torch.nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1)).cuda()
    x = torch.randn(4, 3, 16, 16, device="cuda")
    net.eval()
    with torch.no_grad():
        ref = net(x)
        got = torch.compile(net, backend="convforge")(x)
    assert _rel(got, ref) < 1e-5
    torch._dynamo.reset()
    net.train()
    xr = x.clone().requires_grad_()
    out = torch.compile(net, backend="convforge")(xr)
    out.square().sum().backward()
    assert xr.grad is not None and torch.isfinite(xr.grad).all()
