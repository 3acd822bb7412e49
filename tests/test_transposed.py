"""Transposed convolutions on NumPy (PoCL): ``convforge.conv_transpose2d`` (our dgrad kernels) and its two
gradients against the float64 reference written from conv_transpose2d's definition
(``reference.conv_transpose2d_ref``) on odd shapes (N=1, primes, stride 2 and 3, output_padding,
groups, dilation, unbatched), every buffer the back-end allocates poisoned with NaN; the geometry
against PyTorch's; bad input named; the torch function and module on CPU tensors (PyTorch's kernels
under the ops: the plumbing and the gradients). tests/test_gpu_dropin.py runs them on CUDA."""

from __future__ import annotations

import numpy as np
import pytest

import convforge
from convforge import transposed
from convforge.reference import conv_transpose2d_ref, rel_l2, wgrad_ref
from convforge.spec import transposed_geometry, transposed_problem

TOL = 1e-5


# x shape, w shape (C_in, C_out/groups, R, S), stride, padding, output_padding, groups, dilation
CASES = [
    ((1, 5, 7, 3), (5, 3, 3, 3), 2, 1, 1, 1, 1),  # N=1, primes, stride 2 with output_padding
    ((2, 4, 5, 6), (4, 3, 4, 4), 2, 1, 0, 1, 1),  # DCGAN's 4x4/2
    ((1, 6, 3, 5), (6, 2, 3, 2), (3, 2), (1, 0), (2, 1), 2, 1),  # stride 3, groups, output_padding 2
    ((2, 3, 4, 4), (3, 2, 2, 3), 1, 0, 1, 1, 2),  # stride 1, dilation 2, output_padding < dilation
    ((4, 5, 5), (4, 4, 2, 2), 2, 0, 0, 1, 1),  # unbatched UNet up-conv 2x2/2
    ((1, 2, 4, 4), (2, 1, 3, 3), 1, 0, 1, 2, 2),  # extra: output_padding past the padding (zeros appended)
]


def _data(xs, ws, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, xs).astype(np.float32)
    w = rng.uniform(-1, 1, ws).astype(np.float32)
    return x, w


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _quad(p):
    ph, pw = _pair(p)
    return (ph, ph, pw, pw)


@pytest.mark.parametrize("xs, ws, st, pad, op, g, dl", CASES, ids=lambda v: str(v))
def test_conv_transpose2d_matches_float64(poisoned, xs, ws, st, pad, op, g, dl):
    x, w = _data(xs, ws)
    b = np.random.default_rng(1).uniform(-1, 1, ws[1] * g).astype(np.float32)
    y = convforge.conv_transpose2d(x, w, b, st, pad, op, g, dl)
    x4 = x[None] if x.ndim == 3 else x
    ref = conv_transpose2d_ref(x4, w, _pair(st), _quad(pad), _pair(op), g, _pair(dl), b)
    ref = ref[0] if x.ndim == 3 else ref
    assert isinstance(y, np.ndarray) and y.shape == ref.shape and y.dtype == np.float32
    assert not np.isnan(y).any() and rel_l2(y, ref) < TOL


@pytest.mark.parametrize("xs, ws, st, pad, op, g, dl", [c for c in CASES if len(c[0]) == 4],
                         ids=lambda v: str(v))
def test_both_gradients_match_float64(poisoned, xs, ws, st, pad, op, g, dl):
    """The gradient of x is the forward conv of grad_output, of w the forward layer's wgrad with the
    roles swapped; both against the float64 adjoint of the reference (the transposed conv's own
    definition: <conv_transpose(x, w), gy> = <x, dx> = <w, dw>)."""
    x, w = _data(xs, ws)
    spec, _, _ = transposed_geometry(xs, ws, st, pad, op, g, dl)
    gy = np.random.default_rng(2).uniform(-1, 1, spec.x_shape).astype(np.float32)
    dx = transposed.conv_transpose2d_input(xs, w, gy, st, pad, op, g, dl)
    dw = transposed.conv_transpose2d_weight(x, ws, gy, st, pad, op, g, dl)
    assert dx.shape == xs and dw.shape == ws and not np.isnan(dx).any() and not np.isnan(dw).any()
    ref_dx, ref_dw = _adjoint_grads(x, w, gy, st, pad, op, g, dl)
    assert rel_l2(dx, ref_dx) < TOL and rel_l2(dw, ref_dw) < TOL


def _adjoint_grads(x, w, gy, st, pad, op, g, dl):
    """dL/dx and dL/dw of L = <conv_transpose2d_ref(x, w), gy> in float64: the reference is linear in
    each, so each gradient entry is L of a unit input (small shapes only)."""
    args = (_pair(st), _quad(pad), _pair(op), g, _pair(dl))
    gy64 = gy.astype(np.float64)
    dx = np.zeros(x.shape)
    for i in np.ndindex(*x.shape[1:]):  # one image at a time: the batch entries are independent
        e = np.zeros((1, *x.shape[1:]))
        e[(0, *i)] = 1.0
        dx[(slice(None), *i)] = np.einsum("nchw,chw->n", gy64, conv_transpose2d_ref(e, w, *args)[0])
    dw = np.zeros(w.shape)
    for i in np.ndindex(*w.shape):
        e = np.zeros(w.shape)
        e[i] = 1.0
        dw[i] = float((conv_transpose2d_ref(x, e, *args) * gy64).sum())
    return dx, dw


def test_weight_gradient_is_the_swapped_wgrad():
    """conv_transpose2d_weight's spec is the forward layer's wgrad: check it with wgrad_ref directly
    (the oracle the backward kernels are held to), no device."""
    spec, _, _ = transposed_geometry((2, 4, 5, 6), (4, 3, 4, 4), 2, 1, 0, 1, 1)
    x, w = _data((2, 4, 5, 6), (4, 3, 4, 4))
    gy = np.random.default_rng(3).uniform(-1, 1, spec.x_shape)
    _, dw = _adjoint_grads(x, w, gy, 2, 1, 0, 1, 1)
    assert rel_l2(wgrad_ref(gy, x, spec.with_pass("wgrad")), dw) < 1e-12


def test_half_numpy(poisoned):
    x, w = _data((1, 4, 5, 5), (4, 3, 3, 3))
    xh, wh = x.astype(np.float16), w.astype(np.float16)
    y = convforge.conv_transpose2d(xh, wh, padding=1)  # stride 1: the half dgrad adapters
    assert y.dtype == np.float16
    assert rel_l2(y, conv_transpose2d_ref(xh, wh, padding=(1, 1, 1, 1))) < 2e-3


@pytest.mark.parametrize("call, message", [
    (lambda x, w: convforge.conv_transpose2d(x, w, output_padding=2, stride=2), r"output_padding \(2\) must be"),
    (lambda x, w: convforge.conv_transpose2d(x, w[:2]), r"channel mismatch: input has C=4, weights have C_in=2"),
    (lambda x, w: convforge.conv_transpose2d(x, w, groups=3), r"groups \(3\) must divide C_in \(4\)"),
    (lambda x, w: convforge.conv_transpose2d(x, w, padding=5), r"conv_transpose2d's output would be empty"),
    (lambda x, w: convforge.conv_transpose2d(x.astype(np.float64), w.astype(np.float64)),
     r"^input dtype \(float64\) is not run by convforge; use torch.nn.functional.conv_transpose2d$"),
    (lambda x, w: convforge.conv_transpose2d(x[0, 0], w), r"input must have rank 4 \(N, C, H, W\) or 3"),
    (lambda x, w: convforge.conv_transpose2d(x, w, np.zeros(4, np.float32)), r"bias has 4 entries"),
    (lambda x, w: convforge.conv_transpose2d(x.tolist(), w), r"input must be a NumPy array"),
])
def test_bad_input_is_named(call, message):
    x, w = _data((1, 4, 3, 3), (4, 3, 3, 3))
    with pytest.raises(ValueError, match=message):
        call(x, w)


def test_geometry_is_remembered_for_plain_arguments_only():
    """A warm call's geometry is one dictionary hit for ints and tuples of ints (torch.Size is one);
    a bool, a float or a list takes the validating path every time, so True never passes for 1."""
    args = ((2, 7, 5, 6), (7, 3, 4, 4), (2, 2), 1, 0, 1, 1)
    first = transposed_geometry(*args)
    assert transposed_geometry(*args) is first and first == transposed_problem(*args)
    assert transposed_geometry([2, 7, 5, 6], [7, 3, 4, 4], [2, 2], 1, 0, 1, 1) == first
    for bad in (dict(stride=True), dict(stride=(2, True)), dict(groups=1.0), dict(dilation=(1.0, 1))):
        kw = dict(stride=(2, 2), padding=1, output_padding=0, groups=1, dilation=1) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            transposed_geometry((2, 7, 5, 6), (7, 3, 4, 4), *kw.values())


def test_geometry_matches_pytorch_output_sizes():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(0)
    for _ in range(200):
        h, w, r, s = (int(v) for v in rng.integers(1, 6, 4))
        st, dl = tuple(int(v) for v in rng.integers(1, 4, 2)), tuple(int(v) for v in rng.integers(1, 4, 2))
        pad, op = tuple(int(v) for v in rng.integers(0, 3, 2)), tuple(int(v) for v in rng.integers(0, 3, 2))
        x, wt = torch.zeros(1, 2, h, w), torch.zeros(2, 3, r, s)
        try:
            ref = F.conv_transpose2d(x, wt, None, st, pad, op, 1, dl)
            assert 0 not in ref.shape  # an empty output: refused below, as a ConvSpec has no empty sides
        except (RuntimeError, AssertionError):
            with pytest.raises(ValueError):
                transposed_geometry(x.shape, wt.shape, st, pad, op, 1, dl)
            continue
        spec, _, _ = transposed_geometry(x.shape, wt.shape, st, pad, op, 1, dl)
        assert spec.x_shape == tuple(ref.shape)


# -- torch on CPU: the function, its gradients, the module ------------------------------------------
def test_torch_function_and_module_match_pytorch_with_gradients():
    torch = pytest.importorskip("torch")
    import convforge.torch as ct

    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    for xs, ws, st, pad, op, groups, dl in CASES:
        x = torch.rand(xs, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.rand(ws, generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.rand(ws[1] * groups, generator=g, dtype=torch.float64, requires_grad=True)
        ref = F.conv_transpose2d(x, w, b, st, pad, op, groups, dl)
        got = ct.conv_transpose2d(x, w, b, st, pad, op, groups, dl)
        assert got.shape == ref.shape and torch.allclose(got, ref)
        gy = torch.rand(ref.shape, generator=g, dtype=torch.float64)
        for a, e in zip(torch.autograd.grad(got, (x, w, b), gy), torch.autograd.grad(ref, (x, w, b), gy)):
            assert torch.allclose(a, e)
    m = torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, groups=2)
    cm = ct.ConvTranspose2d.from_module(m, algo="auto")
    x = torch.rand(1, 4, 5, 5)
    assert torch.equal(cm(x, output_size=[10, 10]), m(x, output_size=[10, 10]))
    assert cm.weight is m.weight and "algo='auto'" in repr(cm)


# -- the bench: the decoder suite and the dgrad baseline ----------------------------------------------
def test_decoder_suite_rows_are_transposed_layers():
    from convforge.apps.bench.suites import SuiteError, load_suite, parse_row

    layers = load_suite("decoder")
    assert len(layers) >= 10 and all(la.spec.conv_pass == "dgrad" for la in layers)
    up = next(la for la in layers if la.name == "sdvae_up512_64").spec
    assert up.x_shape == (1, 512, 128, 128) and up.y_shape == (1, 512, 64, 64)  # output, input of the up-conv
    row = {"transposed": True, "N": 1, "C": 4, "H": 5, "W": 5, "K": 6, "R": 3, "S": 3, "stride": 2, "pad": 1,
           "output_padding": 1, "groups": 2}
    assert parse_row(row, "r").spec.x_shape == (1, 6, 10, 10)
    with pytest.raises(SuiteError, match="'output_padding' goes with"):
        parse_row({**row, "transposed": False}, "r")
    with pytest.raises(SuiteError, match="output_padding .* must be"):
        parse_row({**row, "output_padding": 2}, "r")


def test_dgrad_baseline_is_conv_transpose2d():
    """bench's dgrad baseline (F.conv_transpose2d, output_padding restoring the rows a stride leaves
    unread) computes the input gradient (checked against the float64 dgrad reference)."""
    torch = pytest.importorskip("torch")
    from convforge.apps.bench.baselines import pass_fn
    from convforge.reference import dgrad_ref
    from convforge.spec import ConvSpec

    for spec in (ConvSpec.make(2, 4, 13, 10, 6, 3, 3, (2, 3), 1, groups=2, conv_pass="dgrad"),
                 ConvSpec.make(1, 3, 9, 9, 5, 4, 4, 2, 1, 2, conv_pass="dgrad")):
        dy = torch.rand(spec.y_shape, dtype=torch.float64)
        w = torch.rand(spec.w_shape, dtype=torch.float64)
        got = pass_fn(spec)(dy, w)
        assert rel_l2(got.numpy(), dgrad_ref(dy.numpy(), w.numpy(), spec)) < 1e-12
