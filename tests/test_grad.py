"""convforge.grad (dgrad, wgrad and the bias gradient in PyTorch's convention) on NumPy through PoCL:
results against the float64 reference on odd shapes with every buffer the API allocates poisoned
with NaN, bad input named, the choice through dispatch (the tuning database's dgrad entry first),
and, with torch installed, the torch op's backward wired to these kernels (CPU tensors standing in
for CUDA ones). The CUDA paths are in tests/test_gpu_train.py."""

from __future__ import annotations

import numpy as np
import pytest

from convforge import dispatch, grad
from convforge.config import config
from convforge.reference import bias_grad_ref, dgrad_ref, rel_l2, wgrad_ref
from convforge.spec import ConvSpec
from helpers import ODD_SPECS

SPECS = ODD_SPECS + [
    ConvSpec.make(2, 6, 11, 9, 4, 3, 3, 2, 1, groups=2),  # grouped, stride 2
    ConvSpec.make(1, 4, 13, 13, 4, 3, 3, 1, 1, groups=4),  # depthwise
    ConvSpec.make(2, 3, 10, 10, 5, 3, 3, 4, (2, 0, 1, 1), 2),  # stride 4 (sizes not divisible), dilation 2
]


def _data(spec, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, spec.x_shape).astype(np.float32)
    w = rng.uniform(-1, 1, spec.w_shape).astype(np.float32)
    dy = rng.uniform(-1, 1, spec.y_shape).astype(np.float32)
    return x, w, dy


def _args(spec):
    return dict(stride=spec.stride, padding=spec.pad, dilation=spec.dilation, groups=spec.groups)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_both_passes_match_float64_with_poisoned_outputs(poisoned, spec):
    x, w, dy = _data(spec)
    dx = grad.conv2d_input(spec.x_shape, w, dy, **_args(spec))
    dw = grad.conv2d_weight(x, spec.w_shape, dy, **_args(spec))
    assert isinstance(dx, np.ndarray) and dx.shape == spec.x_shape and dx.dtype == np.float32
    assert isinstance(dw, np.ndarray) and dw.shape == spec.w_shape and dw.dtype == np.float32
    assert not np.isnan(dx).any() and not np.isnan(dw).any()
    assert rel_l2(dx, dgrad_ref(dy, w, spec.with_pass("dgrad"))) < 1e-5
    assert rel_l2(dw, wgrad_ref(x, dy, spec.with_pass("wgrad"))) < 1e-5


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 7, 13, 11), (3, 5, 1, 71), (1, 300, 2, 3)])
def test_bias_gradient_matches_float64(poisoned, shape):
    dy = np.random.default_rng(1).uniform(-1, 1, shape).astype(np.float32)
    db = grad.conv2d_bias(dy)
    assert db.shape == (shape[1],) and not np.isnan(db).any()
    assert rel_l2(db, bias_grad_ref(dy)) < 1e-5


@pytest.mark.parametrize("shape,sp", [((1, 1, 1, 1), 1), ((2, 7, 13, 11), 1), ((2, 7, 13, 11), 3), ((3, 5, 4, 7), 2),
                                      ((1, 3, 16, 16), 5)])
def test_relu_masked_bias_gradient_matches_float64(poisoned, shape, sp):
    """The conv -> ReLU node's backward kernel: dy masked by z > 0 (exact zeros masked too, as
    threshold_backward does) written to gm, and its per-channel sums; odd H*W (scalar loads), H*W a
    multiple of 4 (float4), a channel split over slices; outputs poisoned."""
    from convforge.kernels.wgrad import bias_grad_plan
    from convforge.params import Params

    rng = np.random.default_rng(3)
    dy = rng.uniform(-1, 1, shape).astype(np.float32)
    z = np.maximum(rng.uniform(-1, 1, shape), 0).astype(np.float32)  # a ReLU's output: half exact zeros
    n, k, p, q = shape
    spec = ConvSpec.make(n, 1, p, q, k, 1, 1, conv_pass="wgrad")
    plan = bias_grad_plan(spec, poisoned.device, Params(bt=64, sp=min(sp, n * p * q)), relu=True)
    exe = poisoned.executable(plan)
    bufs = {"y": poisoned.upload(dy), "z": poisoned.upload(z), "gm": poisoned.empty(dy.nbytes),
            "bias": poisoned.empty(4 * k)}
    exe(bufs)
    gm, db = poisoned.download(bufs["gm"], shape), poisoned.download(bufs["bias"], (k,))
    want = np.where(z > 0, dy.astype(np.float64), 0.0)
    assert not np.isnan(gm).any() and not np.isnan(db).any()
    assert np.array_equal(gm, want.astype(np.float32))  # the mask moves values, no arithmetic
    assert rel_l2(db, want.sum(axis=(0, 2, 3))) < 1e-5


def test_input_size_disambiguates_the_stride(poisoned):
    """With stride 2, inputs of 13 and 14 rows both give 7 output rows: input_size decides."""
    rng = np.random.default_rng(2)
    w = rng.uniform(-1, 1, (4, 3, 3, 3)).astype(np.float32)
    dy = rng.uniform(-1, 1, (2, 4, 7, 7)).astype(np.float32)
    for size in ((2, 3, 13, 13), (2, 3, 14, 14), (2, 3, 13, 14)):
        spec = ConvSpec.make(*size, 4, 3, 3, 2, 1, conv_pass="dgrad")
        dx = grad.conv2d_input(size, w, dy, stride=2, padding=1)
        assert dx.shape == size and rel_l2(dx, dgrad_ref(dy, w, spec)) < 1e-5


def test_named_algorithms_and_the_dispatch_choice(ocl):
    spec = ConvSpec.make(2, 3, 11, 9, 4, 3, 3, 1, 1)
    x, w, dy = _data(spec)
    want = dgrad_ref(dy, w, spec.with_pass("dgrad"))
    for algo in ("auto", "direct", "dgrad_direct"):
        assert rel_l2(grad.conv2d_input(spec.x_shape, w, dy, padding=1, algo=algo), want) < 1e-5
    prm = {"bw": 16, "bh": 8}
    assert rel_l2(grad.conv2d_input(spec.x_shape, w, dy, padding=1, algo="dgrad_direct", params=prm), want) < 1e-5
    ch = dispatch.choose(spec.with_pass("wgrad"), ocl)
    assert "wgrad" in ch.variant.passes and ch.source == "heuristic"


@pytest.mark.parametrize("call, message", [
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11), w, dy, padding=1), r"input_size \(\(2, 3, 11\)\) must be 4"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, True), w, dy, padding=1), r"input_size .* must be 4 positive"),
    (lambda x, w, dy: grad.conv2d_input("2,3,11,9", w, dy, padding=1), r"input_size \('2,3,11,9'\) must be 4"),
    (lambda x, w, dy: grad.conv2d_input((2, 5, 11, 9), w, dy, padding=1),
     r"input_size \(2, 5, 11, 9\) and weight shape \(4, 3, 3, 3\): channel mismatch"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, 9), w, dy, padding=0),
     r"grad_output has shape \(2, 4, 11, 9\), but .* give an output of shape \(2, 4, 9, 7\)"),
    (lambda x, w, dy: grad.conv2d_input((1, 3, 11, 9), w, dy, padding=1), r"grad_output has shape"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, 9), w, dy, padding=-1), r"padding \(-1\) must be >= 0"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, 9), w, dy, padding=1, groups=2),
     r"channel mismatch|groups \(2\) must divide"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, 9), w.astype(np.float64), dy, padding=1),
     r"weight dtype \(float64\) is not run by convforge; use torch.nn.grad.conv2d_input"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, 9), w, dy[0], padding=1), r"grad_output must have rank 4"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, 9), w, dy.tolist(), padding=1),
     r"grad_output must be a NumPy array"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, 9), w, dy.transpose(0, 1, 3, 2).copy().transpose(0, 1, 3, 2),
                                        padding=1), r"grad_output has an unsupported layout"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, 9), w, dy, padding=1, precision="fp16"),
     r"precision \('fp16'\) must be one of"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, 9), w, dy, padding=1, algo="gemm1x1"),
     r"no 'gemm1x1' variant applies .*only 1x1 filters"),
    (lambda x, w, dy: grad.conv2d_input((2, 3, 11, 9), w, dy, padding=1, algo="dgrad_direct", params={"bq": 1}),
     r"params for dgrad_direct: missing bh, bw; unknown bq"),
    (lambda x, w, dy: grad.conv2d_weight(x, (4, 3, 3), dy, padding=1), r"weight_size \(\(4, 3, 3\)\) must be 4"),
    (lambda x, w, dy: grad.conv2d_weight(x, (4, 2, 3, 3), dy, padding=1),
     r"weight_size \(4, 2, 3, 3\) and input shape \(2, 3, 11, 9\): channel mismatch"),
    (lambda x, w, dy: grad.conv2d_weight(x, (5, 3, 3, 3), dy, padding=1), r"grad_output has shape \(2, 4, 11, 9\)"),
    (lambda x, w, dy: grad.conv2d_weight(x[:, :, :, :5], (4, 3, 3, 3), dy, padding=1),
     r"grad_output has shape \(2, 4, 11, 9\), but .* \(2, 4, 11, 5\)"),
    (lambda x, w, dy: grad.conv2d_weight(x, (4, 3, 3, 3), dy, stride=0, padding=1), r"stride .* must be positive"),
    (lambda x, w, dy: grad.conv2d_bias(dy[0]), r"grad_output must have rank 4"),
    (lambda x, w, dy: grad.conv2d_bias(dy.astype(np.float16)), r"grad_output dtype \(float16\) must be float32"),
])
def test_bad_input_is_named(ocl, call, message):
    spec = ConvSpec.make(2, 3, 11, 9, 4, 3, 3, 1, 1)
    x, w, dy = _data(spec)
    with pytest.raises(ValueError, match=message):
        call(x, w, dy)


def test_tuned_dgrad_entry_is_what_dispatch_then_runs(ocl, tmp_path, monkeypatch, capsys):
    """tune --pass dgrad stores a dgrad entry (its key carries the pass); dispatch then takes it for
    conv2d_input and the result is right; export/import carries it (spec_json names the pass)."""
    from convforge.tune import TuningDB, clear_choices
    from helpers import run_main

    dbp = tmp_path / "t.sqlite"
    text = "N=2,C=3,H=11,W=9,K=4,R=3,S=3,stride=2,pad=1"
    rc, out = run_main(["tune", "--spec", text, "--pass", "dgrad", "--budget", "2", "--db", str(dbp),
                        "--backend", "opencl"], capsys)
    assert rc == 0, out
    entries = TuningDB(dbp).entries()
    assert len(entries) == 1 and entries[0].spec.endswith("_dgrad") and entries[0].epilogue == "none"
    rc, out = run_main(["db", "--db", str(dbp), "list"], capsys)
    assert rc == 0 and "dgrad" in out, out
    rc, out = run_main(["db", "--db", str(dbp), "list", "--pass", "wgrad"], capsys)
    assert rc == 0 and "0 entries" in out, out
    rc, out = run_main(["db", "--db", str(dbp), "show", "--pass", "dgrad"], capsys)
    assert rc == 0 and '"pass": "dgrad"' in out, out
    monkeypatch.setattr(config, "db_path", dbp)
    clear_choices()
    try:
        spec = ConvSpec.parse(text).with_pass("dgrad")
        ch = dispatch.choose(spec, ocl)
        assert ch.source == "db" and ch.variant.name == entries[0].variant and ch.error == entries[0].error
        assert dispatch.choose(spec.with_pass("wgrad"), ocl).source == "heuristic"  # no wgrad entry
        _, w, _ = _data(spec)
        dy = np.random.default_rng(3).uniform(-1, 1, spec.y_shape).astype(np.float32)
        dx = grad.conv2d_input(spec.x_shape, w, dy, stride=2, padding=1)
        assert rel_l2(dx, dgrad_ref(dy, w, spec)) < 1e-5
    finally:
        clear_choices()
    exp = tmp_path / "exp.json"
    assert run_main(["db", "--db", str(dbp), "export", str(exp)], capsys)[0] == 0
    other = tmp_path / "other.sqlite"
    rc, out = run_main(["db", "--db", str(other), "import", str(exp)], capsys)
    assert rc == 0 and "imported 1 entries" in out, out
    assert TuningDB(other).entries()[0].spec == entries[0].spec


def test_a_dgrad_entry_with_an_epilogue_is_rejected_on_import(tmp_path):
    import dataclasses
    import json

    from convforge.tune import TuningDB
    from convforge.tune.db import EXPORT_FORMAT, Entry, now

    spec = ConvSpec.make(1, 4, 9, 9, 6, 3, 3, 1, 1, groups=2, conv_pass="dgrad")  # spec_json: groups and pass
    entry = Entry("opencl|dev|x|1", "opencl", "0", spec.key(), "float32", "bias", "dgrad_direct",
                  json.dumps({"bw": 8, "bh": 4}), 0.01, 0, 1e-7, now(),
                  spec_json=json.dumps(spec.to_dict(), sort_keys=True))
    good = dataclasses.replace(entry, epilogue="none")
    doc = {"format": EXPORT_FORMAT, "entries": [dataclasses.asdict(entry), dataclasses.asdict(good)]}
    rep = TuningDB(tmp_path / "x.sqlite").import_json(doc)
    assert len(rep.stored) == 1 and rep.stored[0].epilogue == "none" and rep.stored[0].spec.endswith("_g2_dgrad")
    assert "unsupported epilogue" in rep.rejected[0][1]
    wrong = dataclasses.replace(good, spec_json=json.dumps(spec.with_pass("wgrad").to_dict()))
    rep = TuningDB(tmp_path / "y.sqlite").import_json({"format": EXPORT_FORMAT, "entries": [dataclasses.asdict(wrong)]})
    assert not rep.stored and "does not match its spec_json" in rep.rejected[0][1]


# -- the torch op's backward on these kernels (torch installed; CPU tensors through PoCL) ----------

def _numpy_grad(calls):
    """A stand-in for convforge.grad taking CPU torch tensors: converts to NumPy, runs the real
    kernels on OpenCL, converts back, and records the algo each call asked for."""
    import types

    import torch

    def conv2d_input(size, w, gy, stride, padding, dilation, groups, algo, precision, max_error):
        calls.append(("dgrad", algo, groups))
        return torch.from_numpy(grad.conv2d_input(size, w.numpy(), gy.numpy(), stride, padding, dilation, groups,
                                                  algo, precision, max_error))

    def conv2d_weight(x, size, gy, stride, padding, dilation, groups, algo, precision, max_error):
        calls.append(("wgrad", algo, groups))
        return torch.from_numpy(grad.conv2d_weight(x.numpy(), size, gy.numpy(), stride, padding, dilation, groups,
                                                   algo, precision, max_error))

    def conv2d_bias(gy):
        calls.append(("bias", None, None))
        return torch.from_numpy(grad.conv2d_bias(gy.numpy()))

    return types.SimpleNamespace(conv2d_input=conv2d_input, conv2d_weight=conv2d_weight, conv2d_bias=conv2d_bias)


@pytest.mark.parametrize("pad,stride", [((1, 1, 1, 1), (1, 1)), ((1, 0, 2, 1), (2, 1)), ((0, 3, 0, 0), (2, 2))])
def test_op_backward_runs_our_kernels(ocl, monkeypatch, pad, stride):
    """The op's autograd backward calls the dgrad, wgrad and bias ops with the layer's arguments
    (groups from the shapes, the forward's algo and precision); their CUDA kernels, run here on CPU
    tensors through PoCL, give PyTorch's float64 gradients."""
    torch = pytest.importorskip("torch", reason="torch not installed: the op's backward wiring is not tested")
    import torch.nn.functional as F

    import convforge.torch as ct
    from convforge.torch import ops

    calls: list[tuple] = []
    monkeypatch.setattr(ops, "cf_grad", _numpy_grad(calls))
    monkeypatch.setattr(ops, "INPUT_OP", ops._input_cuda)
    monkeypatch.setattr(ops, "WEIGHT_OP", ops._weight_cuda)
    monkeypatch.setattr(ops, "BIAS_OP", ops._bias_cuda)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 11, 13, generator=g, requires_grad=True)
    w = torch.randn(5, 3, 3, 3, generator=g, requires_grad=True)
    b = torch.randn(5, generator=g, requires_grad=True)
    y = ct.conv2d(x, w, b, stride=stride, padding=pad, dilation=(1, 2), algo="direct")
    gy = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, (x, w, b), gy)
    t, bo, le, ri = pad
    x64, w64, b64 = (v.detach().double().requires_grad_() for v in (x, w, b))
    ref = F.conv2d(F.pad(x64, (le, ri, t, bo)), w64, b64, stride, 0, (1, 2))
    want = torch.autograd.grad(ref, (x64, w64, b64), gy.double())
    for a, e, what in zip(got, want, "xwb"):
        err = float((a.double() - e).norm() / e.norm())
        assert err < 1e-5, f"gradient of {what}: rel L2 {err}"
    # 'direct' names a forward family: the backward ops ask it first (direct's dgrad/wgrad variants)
    assert [c[0] for c in calls] == ["dgrad", "wgrad", "bias"] and calls[0][1:] == ("direct", 1)


def test_backward_ops_retry_auto_then_fall_back_to_pytorch(ocl, monkeypatch, caplog):
    """A forward variant name that does not compute dgrad is retried as auto; a layer nothing
    computes goes to PyTorch's computation, logged once; groups reach the kernels."""
    torch = pytest.importorskip("torch", reason="torch not installed: the op's backward wiring is not tested")
    from convforge.torch import ops

    calls: list[tuple] = []
    monkeypatch.setattr(ops, "cf_grad", _numpy_grad(calls))
    spec = ConvSpec.make(2, 6, 9, 9, 4, 3, 3, 1, 1, groups=2)
    x, w, dy = (torch.from_numpy(a) for a in _data(spec))
    args = ([1, 1], [1, 1, 1, 1], [1, 1], 2)
    dx = ops._input_cuda(list(spec.x_shape), w, dy, *args, "winograd_fused_f2", None, None)
    assert [c[1] for c in calls] == ["winograd_fused_f2", "auto"] and calls[-1][2] == 2
    assert rel_l2(dx.numpy(), dgrad_ref(dy.numpy(), w.numpy(), spec.with_pass("dgrad"))) < 1e-5
    dw = ops._weight_cuda(x, list(spec.w_shape), dy, *args, "auto", None, None)
    assert rel_l2(dw.numpy(), wgrad_ref(x.numpy(), dy.numpy(), spec.with_pass("wgrad"))) < 1e-5

    def refuse(*a, **k):
        raise ValueError("no 'auto' variant applies (test)")

    monkeypatch.setattr(ops.cf_grad, "conv2d_input", refuse)
    with caplog.at_level("WARNING", logger="convforge"):
        for _ in range(2):
            dx2 = ops._input_cuda(list(spec.x_shape), w, dy, *args, "auto", None, None)
    assert rel_l2(dx2.numpy(), dgrad_ref(dy.numpy(), w.numpy(), spec.with_pass("dgrad"))) < 1e-5
    assert sum("PyTorch computes the dgrad" in r.message for r in caplog.records) == 1


def test_backward_ops_fake_impls_and_compile_of_a_training_step():
    """The backward ops trace (fake impls) and a compiled training step through the op runs its
    backward through them (CPU kernels: PyTorch's), matching eager."""
    torch = pytest.importorskip("torch", reason="torch not installed: convforge.torch tests skipped")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import convforge.torch as ct
    from convforge.torch import ops

    with FakeTensorMode():
        gy, w, x = torch.empty(2, 8, 5, 4), torch.empty(8, 2, 3, 3), torch.empty(2, 4, 11, 9)
        assert tuple(ops.INPUT_OP([2, 4, 11, 9], w, gy, [2, 2], [1, 1, 1, 1], [1, 1], 2, "auto", None, None).shape) \
            == (2, 4, 11, 9)
        assert tuple(ops.WEIGHT_OP(x, [8, 2, 3, 3], gy, [2, 2], [1, 1, 1, 1], [1, 1], 2, "auto", None,
                                   None).shape) == (8, 2, 3, 3)
        assert tuple(ops.BIAS_OP(gy).shape) == (8,)

    import copy

    eager_conv = ct.Conv2d(2, 3, 3, padding=1)
    comp_conv = copy.deepcopy(eager_conv)

    def make_step(conv):
        opt = torch.optim.SGD(conv.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            loss = torch.relu(ct.conv2d(x, conv.weight, conv.bias, 1, (1, 0, 1, 1))).square().mean()
            loss.backward()
            opt.step()
            return loss

        return step

    x = torch.randn(2, 2, 7, 6)
    compiled = torch.compile(make_step(comp_conv), backend="aot_eager")
    eager = make_step(eager_conv)
    for _ in range(2):
        torch.testing.assert_close(compiled(x).detach(), eager(x).detach())
    for p, want in zip(comp_conv.parameters(), eager_conv.parameters()):
        torch.testing.assert_close(p.grad, want.grad)
        torch.testing.assert_close(p.detach(), want.detach())


@pytest.mark.parametrize("what", ["dgrad", "wgrad", "bias"])
def test_pass_runner_fills_the_pointer_slots_of_its_pass(monkeypatch, what):
    """torch_runner of a dgrad, wgrad or bias-gradient plan (CUDA driver recorded, CPU torch tensors
    standing in for CUDA ones): the output has the shape of the buffer the plan writes, its address
    and the inputs' go to the kernel's x / w / y / bias arguments, and nothing is cached for the
    filters of a plan that has no filter step."""
    import ctypes

    torch = pytest.importorskip("torch", reason="torch not installed: the torch runner is not tested")
    from conftest import NOMINAL_CUDA
    from convforge.codegen.dialect import LocalBuf
    from convforge.frontends import torch_run
    from convforge.kernels import get_variant
    from convforge.kernels.wgrad import bias_grad_plan
    from test_torch import _FakeBackend, _stubbed_cuda_module

    mod, calls, _ = _stubbed_cuda_module(monkeypatch)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 77, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    spec = ConvSpec.make(2, 6, 11, 9, 4, 3, 3, 2, 1, groups=2, conv_pass="wgrad" if what == "bias" else what)
    if what == "bias":
        plan = bias_grad_plan(spec, NOMINAL_CUDA)
    else:
        v = get_variant(f"{what}_direct")
        plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    exe = mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), plan)
    run = torch_run.torch_runner(exe, 0)
    assert run.filters is None
    x, w, dy = (torch.randn(s) for s in (spec.x_shape, spec.w_shape, spec.y_shape))
    args = {"dgrad": (None, w, dy), "wgrad": (x, None, dy), "bias": (None, None, dy)}[what]
    out = run(*args)
    name = {"dgrad": "x", "wgrad": "w", "bias": "bias"}[what]
    assert tuple(out.shape) == spec.shape_of(name) and out.dtype == dy.dtype
    bound = {"x": x.data_ptr(), "w": w.data_ptr(), "y": dy.data_ptr(), name: out.data_ptr()}
    assert len(calls) == len(plan.steps) == 1
    step, kernel = plan.steps[0], plan.kernels[0]
    assert len([a for a in kernel.args if not isinstance(a, LocalBuf)]) == len(step.args)  # buffers only
    cells = (ctypes.c_void_p * len(step.args)).from_address(calls[0][9])
    for i, ref in enumerate(step.args):
        assert ctypes.c_uint64.from_address(cells[i]).value == bound[ref], (what, ref)


def test_bias_gradient_kernel_compiles_clean_for_sm90(nvcc_ok):
    from conftest import NOMINAL_CUDA
    from convforge.kernels.wgrad import bias_grad_plan
    from helpers import assert_sources_compile_clean

    sources = []
    for shape, relu in (((2, 7, 13, 11), False), ((32, 512, 7, 7), False), ((2, 7, 13, 11), True),
                        ((16, 64, 224, 224), True), ((1100, 64, 176, 176), True)):  # the last past 2^31 elements
        n, k, p, q = shape
        plan = bias_grad_plan(ConvSpec.make(n, 1, p, q, k, 1, 1, conv_pass="wgrad"), NOMINAL_CUDA, relu=relu)
        src = plan.source("cuda")
        assert ("long long" in src) == (n * k * p * q > 2**31 - 1)
        sources.append((f"{shape} relu={relu}", src))
    assert_sources_compile_clean(sources)  # one nvcc run
