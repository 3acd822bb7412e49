"""F.conv2d's contract in ``convforge.conv2d`` on NumPy (PoCL): unbatched inputs, string padding ('same'
with even dilated kernels, 'valid'), every padding mode, the dtype refusals, against the float64
reference on odd shapes with every buffer the back-end allocates poisoned with NaN; the argument
normalisation (``spec.conv_args``) alone; and, with CPU torch, the torch op's wrapper, ``ct.Conv2d``
and PyTorch's OpInfo samples through the normalisation (tests/test_gpu_dropin.py runs them on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest

import convforge
from convforge.reference import conv2d_ref, pad_ref, rel_l2
from convforge.spec import ConvSpec, conv_args, conv_padding

TOL = 1e-5


def _ref(x, w, b, stride, pad, dilation, groups=1, mode="zeros"):
    """The float64 answer: the padded input (pad_ref's index rules) convolved without padding."""
    x4 = x[None] if x.ndim == 3 else x
    xp = pad_ref(x4, pad, mode)
    spec = ConvSpec.from_shapes(xp.shape, w.shape, stride, 0, dilation, groups)
    y = conv2d_ref(xp, w, spec, b)
    return y[0] if x.ndim == 3 else y


CASES = [  # x shape, w shape, kwargs, the padding they mean
    ((3, 13, 11), (5, 3, 3, 3), dict(padding=1), (1, 1, 1, 1)),  # unbatched
    ((1, 3, 11, 7), (5, 3, 4, 2), dict(padding="same"), (1, 2, 0, 1)),  # even kernels: extra at bottom/right
    ((1, 2, 7, 9), (3, 2, 2, 3), dict(padding="same", dilation=2), (1, 1, 2, 2)),
    ((2, 3, 9, 7), (4, 3, 3, 2), dict(padding="valid", stride=2), (0, 0, 0, 0)),
    ((4, 11, 13), (4, 2, 3, 3), dict(padding="same", groups=2), (1, 1, 1, 1)),  # unbatched, grouped
]


@pytest.mark.parametrize("xs, ws, kw, pad", CASES, ids=lambda v: str(v))
def test_unbatched_and_string_padding_match_float64(poisoned, xs, ws, kw, pad):
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, xs).astype(np.float32)
    w = rng.uniform(-1, 1, ws).astype(np.float32)
    b = rng.uniform(-1, 1, ws[0]).astype(np.float32)
    y = convforge.conv2d(x, w, b, **kw)
    ref = _ref(x, w, b, kw.get("stride", 1), pad, kw.get("dilation", 1), kw.get("groups", 1))
    assert y.shape == ref.shape and not np.isnan(y).any()
    assert rel_l2(y, ref) < TOL


MODES = [  # mode, x shape, w shape, kwargs
    ("reflect", (1, 3, 7, 5), (4, 3, 3, 3), dict(padding=2)),
    ("replicate", (2, 2, 5, 7), (3, 2, 3, 2), dict(padding=(1, 3), stride=2)),
    ("circular", (3, 5, 7), (4, 3, 2, 2), dict(padding="same", dilation=2)),  # unbatched, even kernel
    ("reflect", (1, 2, 6, 6), (2, 2, 3, 3), dict(padding=(0, 1, 2, 0))),  # a 4-tuple
]


@pytest.mark.parametrize("mode, xs, ws, kw", MODES, ids=lambda v: str(v))
def test_padding_modes_match_float64(poisoned, mode, xs, ws, kw):
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, xs).astype(np.float32)
    w = rng.uniform(-1, 1, ws).astype(np.float32)
    y = convforge.conv2d(x, w, padding_mode=mode, **kw)
    st, dl = kw.get("stride", 1), kw.get("dilation", 1)
    pad = conv_padding(kw["padding"], ws[2:], st, dl)
    ref = _ref(x, w, None, st, pad, dl, mode=mode)
    assert y.shape == ref.shape and rel_l2(y, ref) < TOL


def test_half_numpy_unbatched_same(poisoned):
    rng = np.random.default_rng(9)
    x = rng.uniform(-1, 1, (3, 9, 7)).astype(np.float16)
    w = rng.uniform(-1, 1, (4, 3, 3, 3)).astype(np.float16)
    y = convforge.conv2d(x, w, padding="same", padding_mode="replicate")
    assert y.dtype == np.float16 and y.shape == (4, 9, 7)
    assert rel_l2(y, _ref(x, w, None, 1, (1, 1, 1, 1), 1, mode="replicate")) < 2e-3


# -- the normalisation alone ----------------------------------------------------------------------
def test_conv_args_same_matches_pytorch_rule():
    assert conv_padding("same", (4, 5), 1, (1, 3)) == (1, 2, 6, 6)
    assert conv_padding("same", (1, 2), 1, 1) == (0, 0, 0, 1)
    assert conv_padding("valid", (3, 3), 2, 1) == (0, 0, 0, 0)
    a = conv_args((3, 8, 8), (4, 3, 3, 3), 1, "same", 1, "reflect")
    assert a.unbatched and a.pad == (0, 0, 0, 0) and a.copy_pad == (1, 1, 1, 1) and a.mode == "reflect"
    a = conv_args((1, 3, 8, 8), (4, 3, 3, 3), 2, 1, 1, "zeros")
    assert not a.unbatched and a.pad == (1, 1, 1, 1) and a.copy_pad is None


@pytest.mark.parametrize("call, message", [
    (lambda x, w: convforge.conv2d(x, w, padding="same", stride=2), r"padding='same' is not supported for strided"),
    (lambda x, w: convforge.conv2d(x, w, padding="full"), r"padding \('full'\) must be 'same', 'valid'"),
    (lambda x, w: convforge.conv2d(x, w, padding=1, padding_mode="mirror"), r"padding_mode \('mirror'\) must be one"),
    (lambda x, w: convforge.conv2d(x, w, padding=8, padding_mode="reflect"),
     r"padding_mode='reflect' needs each padding \(8\) smaller than the input's H \(8\)"),
    (lambda x, w: convforge.conv2d(x, w, padding=9, padding_mode="circular"),
     r"padding_mode='circular' needs each padding \(9\) at most the input's H \(8\)"),
    (lambda x, w: convforge.conv2d(x[0, 0], w), r"input must have rank 4 \(N, C, H, W\) or 3 \(C, H, W\)"),
    (lambda x, w: convforge.conv2d(x.astype(np.float64), w.astype(np.float64)),
     r"^input dtype \(float64\) is not run by convforge; use torch.nn.functional.conv2d$"),
    (lambda x, w: convforge.conv2d(x.astype(np.complex64), w), r"input dtype \(complex64\) is not run by convforge"),
    (lambda x, w: convforge.conv2d(x[0].astype(np.float64), w, padding="same", padding_mode="reflect"),
     r"input dtype \(float64\) is not run by convforge"),
])
def test_bad_arguments_are_named(call, message):
    x = np.zeros((1, 3, 8, 8), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(ValueError, match=message):
        call(x, w)


# -- torch (CPU): the op's wrapper, ct.Conv2d, OpInfo samples through the normalisation ---------------
def _torch():
    return pytest.importorskip("torch", reason="convforge.torch: torch not installed")


def test_torch_op_wrapper_takes_the_whole_contract_and_its_gradients():
    """On CPU tensors the op computes with PyTorch's kernels: this checks the argument handling and
    the autograd plumbing (unbatched, 'same', padding modes) against F.conv2d / nn.Conv2d."""
    torch = _torch()
    import convforge.torch as ct

    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    for xs, ws, kw, mode in [((3, 9, 7), (4, 3, 4, 2), dict(padding="same"), "zeros"),
                             ((2, 3, 9, 7), (4, 3, 3, 3), dict(padding="valid", stride=2), "zeros"),
                             ((3, 7, 8), (4, 3, 3, 2), dict(padding="same", dilation=2), "reflect"),
                             ((1, 4, 6, 5), (4, 2, 3, 3), dict(padding=(1, 2), groups=2), "circular"),
                             ((1, 3, 5, 6), (2, 3, 3, 3), dict(padding=2), "replicate")]:
        x = torch.rand(xs, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.rand(ws, generator=g, dtype=torch.float64, requires_grad=True)
        m = torch.nn.Conv2d(xs[-3], ws[0], ws[2:], padding_mode=mode, bias=False, dtype=torch.float64, **kw)
        with torch.no_grad():
            m.weight.copy_(w)
        ref = m(x) if mode != "zeros" else F.conv2d(x, w, None, **kw)
        got = ct.conv2d(x, w, None, padding_mode=mode, **kw)
        assert got.shape == ref.shape and torch.allclose(got, ref)
        gref = torch.autograd.grad(ref.square().sum(), (x, m.weight if mode != "zeros" else w))
        ggot = torch.autograd.grad(got.square().sum(), (x, w))
        assert all(torch.allclose(a, b) for a, b in zip(ggot, gref))
        cm = ct.Conv2d.from_module(m)  # ct.Conv2d: PyTorch's forward on CPU, the same answer
        assert torch.allclose(cm(x), ref)


def test_fuse_swaps_padding_mode_and_transposed_convs():
    """fuse() (which swaps CPU models' convs: they run PyTorch's ops until moved to CUDA) swaps
    padding-mode convs for plain convforge Conv2ds (no chain fused after them) and ConvTranspose2d;
    the result computes what the model does."""
    torch = _torch()
    import convforge.torch as ct

    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
                          nn.Conv2d(4, 4, 2, padding="same", padding_mode="circular"),
                          nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1)).eval()
    fused, report = ct.fuse(model)
    assert not report.left and sorted(report.converted) == ["0", "2", "3"], str(report)
    assert "padding_mode='reflect'" in report.unfused["0"], str(report)
    mods = dict(fused.named_modules())
    assert type(mods["0"]) is ct.Conv2d and type(mods["2"]) is ct.Conv2d and type(mods["3"]) is ct.ConvTranspose2d
    x = torch.rand(2, 3, 7, 6)
    with torch.no_grad():
        assert torch.allclose(fused(x), model(x), atol=1e-6)
    cpu = nn.Sequential(nn.ConvTranspose2d(4, 2, 3)).cuda() if torch.cuda.is_available() else None
    if cpu is not None:
        assert ct.convert(cpu).converted == ["0"]


def _opinfo_samples(name, dtype):
    torch = _torch()
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as err:  # torch's test suite needs expecttest (and, for some modules, more)
        pytest.skip(f"torch's OpInfo database does not import ({err}); pip install expecttest")
    ops = [o for o in op_db if o.name == name]
    assert ops, f"no OpInfo named {name}"
    return list(ops[0].sample_inputs("cpu", getattr(torch, dtype), requires_grad=True))


@pytest.mark.parametrize("name", ["nn.functional.conv2d", "nn.functional.conv_transpose2d"])
def test_every_opinfo_sample_is_accepted_by_the_normalisation(name):
    """Every OpInfo sample's arguments pass the argument handling (rank, string padding, groups,
    output_padding) and give PyTorch's output shape, without the CUDA compute (CPU torch)."""
    torch = _torch()
    from convforge.spec import transposed_geometry

    for s in _opinfo_samples(name, "float32"):
        w, bias = s.args[0], s.args[1] if len(s.args) > 1 else None
        kw = dict(s.kwargs)
        x = s.input
        if name.endswith("conv2d") and "transpose" not in name:
            ref = torch.nn.functional.conv2d(x, w, bias, **kw)
            a = conv_args(tuple(x.shape), tuple(w.shape), kw.get("stride", 1), kw.get("padding", 0),
                          kw.get("dilation", 1))
            xb = x if x.dim() == 4 else x[None]
            spec = ConvSpec.from_shapes(tuple(xb.shape), tuple(w.shape), a.stride, a.pad, a.dilation,
                                        kw.get("groups", 1))
            shape = spec.y_shape[1:] if a.unbatched else spec.y_shape
        else:
            ref = torch.nn.functional.conv_transpose2d(x, w, bias, **kw)
            xb = x if x.dim() == 4 else x[None]
            spec, _, _ = transposed_geometry(tuple(xb.shape), tuple(w.shape), kw.get("stride", 1),
                                             kw.get("padding", 0), kw.get("output_padding", 0),
                                             kw.get("groups", 1), kw.get("dilation", 1))
            shape = spec.x_shape[1:] if x.dim() == 3 else spec.x_shape
        assert tuple(ref.shape) == tuple(shape), (s, shape)
