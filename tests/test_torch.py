"""convforge.torch and the device fast path, CPU side: what can be checked without a GPU.

- the split of a Plan into filter-only steps (run once per weight version) and the rest, run on
  the OpenCL device: "weights" then "rest" equals the whole plan, and "rest" really reuses the
  transformed filters it was given;
- ``import convforge`` imports neither torch nor cupy;
- with torch installed (skipped with a reason otherwise): the ``convforge::conv2d`` op's CPU
  kernel, fake impl and autograd formula against PyTorch (asymmetric padding included),
  torch.compile without graph breaks, ``Conv2d``'s constructor / state_dict, and ``convert``'s
  report. The CUDA paths are in tests/test_gpu_torch.py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from convforge.backends.base import weight_steps
from convforge.kernels import all_variants
from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec

SPEC = ConvSpec.make(2, 5, 11, 13, 7, 3, 3, 1, (1, 0, 2, 1))


@pytest.mark.parametrize("name,reads_w", [("winograd_nonfused_f2", True), ("im2win", True),
                                          ("implicit_gemm_precomp", False)])
def test_filter_steps_run_once_and_are_reused(ocl, name, reads_w):
    """Filter transforms (Winograd U, packed im2win filters) and constant tables (the offsets of
    implicit_gemm_precomp, which then reads w itself) run in "weights" only."""
    v = next(v for v in all_variants() if v.name == name)
    if v.applies(SPEC, ocl.device):
        pytest.skip(f"{name}: {v.applies(SPEC, ocl.device)}")
    plan = v.plan(SPEC, v.default(SPEC, ocl.device), ocl.device)
    exe = ocl.executable(plan)
    steps, derived = weight_steps(plan)
    assert steps and derived, f"{name}: no filter-only step found in {plan.steps}"
    assert not {"x", "y", "bias"} & set(derived)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SPEC.x_shape).astype(np.float32)
    w1 = rng.standard_normal(SPEC.w_shape).astype(np.float32)
    w2 = rng.standard_normal(SPEC.w_shape).astype(np.float32)
    sizes = dict(plan.workspace)
    own = {n: ocl.empty(sizes[n]) for n in derived}
    exe({"w": ocl.upload(w1), **own}, steps="weights")
    y = ocl.upload(np.full(SPEC.y_shape, np.nan, np.float32))
    # "rest" with the other weights bound: the result must still be w1's (the transform is not redone)
    exe({"x": ocl.upload(x), "w": ocl.upload(w2), "y": y, **own}, steps="rest")
    got = ocl.download(y, SPEC.y_shape)
    used, other = (w1, w2) if reads_w else (w2, w1)
    err = rel_l2(got, conv2d_ref(x, used, SPEC))
    assert err < plan.tolerance, f"{name}: rel L2 {err} with cached filters"
    assert rel_l2(got, conv2d_ref(x, other, SPEC)) > 0.1


def test_weight_steps_leave_plain_plans_alone():
    v = next(v for v in all_variants() if v.name == "direct")
    from conftest import NOMINAL_CUDA

    plan = v.plan(SPEC, v.default(SPEC, NOMINAL_CUDA), NOMINAL_CUDA)
    assert weight_steps(plan) == (frozenset(), ())


def test_import_convforge_imports_no_vendor_library():
    code = ("import sys, convforge, convforge.api, convforge.dispatch; "
            "bad = [m for m in ('torch', 'cupy') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# -- with torch --------------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch", reason="torch not installed: convforge.torch tests skipped")


@pytest.mark.parametrize("pad", [(1, 1, 2, 2), (1, 0, 2, 1), (0, 3, 0, 0)])
def test_op_forward_and_gradients_match_pytorch(pad):
    torch = _torch()
    import torch.nn.functional as F

    import convforge.torch as ct

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 11, 13, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    y = ct.conv2d(x, w, b, stride=(2, 1), padding=pad, dilation=(1, 2))
    t, bo, le, ri = pad
    ref = F.conv2d(F.pad(x, (le, ri, t, bo)), w, b, (2, 1), 0, (1, 2))
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(y, (x, w, b), gy)
    want = torch.autograd.grad(ref, (x, w, b), gy)
    for got, exp, what in zip(grads, want, "xwb"):
        torch.testing.assert_close(got, exp, msg=f"gradient of {what}")


def test_op_fake_impl_and_compile_without_graph_breaks():
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    import convforge.torch as ct

    with FakeTensorMode():
        y = ct.conv2d(torch.empty(3, 4, 17, 19), torch.empty(8, 4, 5, 3), None, 2, (2, 1, 0, 3))
    assert tuple(y.shape) == ConvSpec.make(3, 4, 17, 19, 8, 5, 3, 2, (2, 1, 0, 3)).y_shape

    def f(x, w):
        return torch.relu(ct.conv2d(x, w, None, 1, 1)).sum()

    x, w = torch.randn(1, 2, 7, 7, requires_grad=True), torch.randn(3, 2, 3, 3, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break is an error
    loss = compiled(x, w)
    loss.backward()
    torch.testing.assert_close(loss, f(x, w))
    assert w.grad is not None and x.grad is not None


def test_conv2d_module_is_a_drop_in():
    torch = _torch()
    import convforge.torch as ct

    ref = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=True)
    ours = ct.Conv2d(4, 6, 3, stride=2, padding=1, bias=True, precision="fp32")
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4, 9, 9)
    torch.testing.assert_close(ours(x), ref(x))  # CPU input: PyTorch's forward
    with pytest.raises(ValueError, match="precision"):
        ct.Conv2d(4, 6, 3, precision="tf16")
    same = ct.Conv2d(2, 2, (4, 3), padding="same", dilation=(1, 2))
    from convforge.torch.modules import padding_quad

    assert padding_quad(same) == (1, 2, 2, 2)


def test_convert_swaps_in_place_and_reports_what_it_left():
    torch = _torch()
    import convforge.torch as ct

    class Odd(torch.nn.Conv2d):
        pass

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, groups=2), torch.nn.Conv2d(8, 4, 3, padding_mode="reflect"),
                                Odd(4, 4, 1), torch.nn.Conv2d(4, 4, 1).double())
    report = ct.convert(model)
    text = str(report)
    assert "reflect" not in report.left["3"] and "Odd" in report.left["4"] and "float64" in report.left["5"]
    assert "cpu" in report.left["0"] and "cpu" in report.left["2"]  # CPU parameters: left, and said why
    assert "left to PyTorch" in text
    with pytest.raises(TypeError, match="allowed"):
        ct.convert(model, algoo="direct")


def test_convert_runs_grouped_layers_on_cuda():
    """Grouped and depthwise layers are convforge's once the model is on a CUDA device."""
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: convert() leaves CPU parameters to PyTorch")
    import convforge.torch as ct

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, groups=2),
                                torch.nn.Conv2d(8, 8, 3, groups=8)).cuda()
    report = ct.convert(model)
    assert report.converted == ["0", "1", "2"] and not report.left, str(report)


def test_convert_shares_parameters_when_it_swaps():
    torch = _torch()
    import convforge.torch as ct

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1))
    old = model[0].weight
    new = ct.Conv2d.from_module(model[0], precision="relaxed")
    assert new.weight is old and new.precision == "relaxed" and new.static_weights
    assert not ct.Conv2d.from_module(model[0], static_weights=False).static_weights
    with pytest.raises(ValueError, match="static_weights"):
        ct.Conv2d.from_module(model[0], static_weights="yes")
    assert new.state_dict().keys() == model[0].state_dict().keys()


# -- the raw launch path, with the CUDA driver and CuPy replaced by recorders ----------------------

def _stubbed_cuda_module(monkeypatch):
    """backends/cuda.py loaded under another name against a stub ``cupy`` (the real module, if any,
    is left alone), with a driver that records launches instead of making them."""
    import contextlib
    import importlib.util
    import types

    import convforge.backends as backends_pkg

    oom = type("OutOfMemoryError", (Exception,), {})
    stub = types.ModuleType("cupy")
    stub.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    stub.cuda = types.SimpleNamespace(memory=types.SimpleNamespace(OutOfMemoryError=oom),
                                      Device=lambda i: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", stub)
    path = f"{backends_pkg.__path__[0]}/cuda.py"
    spec = importlib.util.spec_from_file_location("convforge_cuda_stubbed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls = []

    class Driver:
        multi_gpu = False

        def launch(self, *args):
            calls.append(args)
            return 0

        def current_context(self):
            return 0

        def needs_push(self, context):
            return False

    mod._DRIVER = Driver()
    mod.capturing = lambda stream: stream == 666
    return mod, calls, oom


class _FakeBackend:
    name, device_id = "cuda", 0

    def __init__(self, device, oom=None):
        self.device, self.oom = device, oom

    def program(self, source):
        return None

    def function(self, program, kernel):
        return types_ns(ptr=hash(kernel.name) & 0xFFFF)

    def empty(self, nbytes):
        if self.oom:
            raise self.oom()
        return types_ns(data=types_ns(ptr=0x70000000 + nbytes), nbytes=nbytes)

    def free_bytes(self):
        return 12345


def types_ns(**kw):
    import types

    return types.SimpleNamespace(**kw)


@pytest.mark.parametrize("name", ["winograd_nonfused_f4", "implicit_gemm", "direct"])
def test_native_program_matches_the_prepared_buffers(monkeypatch, name):
    """CudaExecutable.native_program, which native.cpp launches from, describes exactly the
    cuLaunchKernel calls that launch_raw makes from its prepared ctypes buffers: per step list the
    same functions, grids, blocks and shared bytes, and per argument the same bytes once native.cpp's
    rule fills the slots (0: x, w, y, bias, res, then the derived buffers; 1: a fixed pointer; 2: a
    fixed 32-bit value)."""
    import ctypes

    from conftest import NOMINAL_CUDA

    mod, calls, _ = _stubbed_cuda_module(monkeypatch)
    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    v = next(v for v in all_variants() if v.name == name)
    exe = mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA))
    assert exe.fast
    exe.reserve(0)
    runs = dict(zip(("all", "rest", "weights"), exe.native_program()[:3]))
    y_shape, ws_derived, offsets, floats, _, name_, keep = exe.native_program()[3:]
    assert y_shape == spec.y_shape and keep is exe and len(ws_derived) == len(offsets) == len(exe.derived)
    assert floats == exe.derived_bytes // 4 and name_ == exe.plan.describe()
    x, w, y, bias, base = 0x1000, 0x2000, 0x3000, 0x4000, 0x90000000
    for mode in ("all", "rest", "weights") if exe.derived else ("all",):
        derived = [base + off for off in offsets] if mode != "all" else list(ws_derived)
        slots = [x, w, y, bias, 0, *derived]
        calls.clear()
        exe.launch_raw(x, w, y, bias, 77, base if mode != "all" else 0, mode)
        assert len(calls) == len(runs[mode]) > 0
        for (fn, gx, gy, gz, bx, by, bz, shared, _stream, params, _extra), launch in zip(calls, runs[mode]):
            assert launch[:8] == (fn, gx, gy, gz, bx, by, bz, shared)
            cells = (ctypes.c_void_p * len(launch[8])).from_address(params)
            for i, (kind, value) in enumerate(launch[8]):
                if kind == 2:
                    assert ctypes.c_uint32.from_address(cells[i]).value == value & 0xFFFFFFFF
                else:
                    want = slots[value] if kind == 0 else value
                    assert ctypes.c_uint64.from_address(cells[i]).value == want, (mode, i, kind)


def test_raw_launch_rewrites_only_the_pointer_slots(monkeypatch):
    import ctypes

    from conftest import NOMINAL_CUDA
    from convforge.codegen.dialect import LocalBuf, Scalar

    mod, calls, _ = _stubbed_cuda_module(monkeypatch)
    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    v = next(v for v in all_variants() if v.name == "winograd_nonfused_f4")
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    exe = mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), plan)
    assert exe.fast and exe.derived == ("wino_u",)
    exe.reserve(0)
    ws = exe.workspace()
    for mode, base in (("all", 0), ("rest", 0x90000000), ("weights", 0x90000000)):
        for ptrs in ((0x1000, 0x2000, 0x3000, 0), (0x1100, 0x2200, 0x3300, 0)):  # slots rewritten per call
            calls.clear()
            exe.launch_raw(*ptrs, 77, base, mode)
            bound = dict(zip(("x", "w", "y", "bias"), ptrs))
            bound.update({n: (base + exe.derived_offsets[n]) if base else ws[n].data.ptr for n in exe.derived})
            steps = [s for i, s in enumerate(plan.steps)
                     if mode == "all" or (i in exe.weight_steps) == (mode == "weights")]
            assert len(calls) == len(steps) and steps
            for (fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra), step in zip(calls, steps):
                kernel = exe.kernels[step.kernel]
                assert fn == hash(kernel.name) & 0xFFFF  # the CUfunction of this step's kernel
                assert (gx, gy, gz) == step.grid and (bx, by, bz) == step.block and stream == 77
                lb = kernel.local_buf()
                assert shared == (lb.nbytes if lb else 0) and extra == 0
                args = [a for a in kernel.args if not isinstance(a, LocalBuf)]
                cells = (ctypes.c_void_p * len(args)).from_address(params)
                for i, (arg, ref) in enumerate(zip(args, step.args)):
                    if isinstance(arg, Scalar):
                        ctype = ctypes.c_int32 if arg.ctype == "int" else ctypes.c_float
                        assert ctype.from_address(cells[i]).value == pytest.approx(ref)
                    else:
                        want = bound.get(ref) or ws[ref].data.ptr
                        assert ctypes.c_uint64.from_address(cells[i]).value == want, (mode, ref)


def test_workspace_is_refused_under_capture_and_out_of_memory_is_named(monkeypatch):
    from conftest import NOMINAL_CUDA
    from convforge.backends.base import DeviceMemoryError

    mod, _, oom = _stubbed_cuda_module(monkeypatch)
    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    v = next(v for v in all_variants() if v.name == "winograd_nonfused_f4")
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    with pytest.raises(RuntimeError, match="during CUDA-graph capture"):
        mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), plan).reserve(666)
    with pytest.raises(DeviceMemoryError, match=rf"asked for {plan.workspace_bytes} bytes.*12345 bytes free"):
        mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA, oom), plan).reserve(0)


def test_bench_model_weights_are_signal_preserving_and_reproducible():
    """bench --model re-draws weights (Kaiming normal, identity batch norm) from a fixed seed: a deep
    stack keeps an input-dependent output, and two draws are identical; a constant output is
    flagged by a spread of 0."""
    torch = _torch()
    from convforge.apps.bench import models as M

    nn = torch.nn

    def make():
        m = nn.Sequential(*[m for _ in range(12) for m in (nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                                                         nn.ReLU())], nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
        for layer in m.modules():  # torchvision GoogLeNet's init, which made its outputs degenerate
            if isinstance(layer, nn.Conv2d | nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.01)
        return m.double().eval()

    x = torch.randn(3, 8, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    degenerate = make()
    with torch.no_grad():
        assert M.spread(degenerate, x, degenerate(x)) < M.MIN_SPREAD
        a, b = make(), make()
        M.reinit(a, M.SEED)
        M.reinit(b, M.SEED)
        for pa, pb in zip(a.state_dict().values(), b.state_dict().values()):
            assert torch.equal(pa, pb)
        assert M.spread(a, x, a(x)) > 0.1
        assert M.spread(a, x[:1], a(x[:1])) > 0.1  # N=1: against a second random input


class _FakeWeight:
    """What FilterCache reads of a torch tensor: ``_version`` (a shared counter) and weak references."""

    def __init__(self, address, counter=None):
        self.address, self.counter = address, counter if counter is not None else [0]

    def data_ptr(self):
        return self.address

    @property
    def _version(self):
        return self.counter[0]

    def bump(self):  # an in-place update (optimizer step, copy_, mul_ under no_grad)
        self.counter[0] += 1


class _InferenceWeight:
    @property
    def _version(self):
        raise RuntimeError("Inference tensors do not track version counter.")


def test_filter_cache_invalidates_on_in_place_updates_and_freed_tensors():
    """conv2d's per-weight filter cache (torch CUDA tensors cannot run here: the key logic on fakes):
    a hit needs the same address, a live tensor and the same version; an in-place update re-runs
    the transform into the same buffer; a freed tensor's entry goes (a new tensor at that address
    is transformed afresh); inference tensors, CuPy-like arrays and capture never cache."""
    import gc

    from convforge.backends.base import FilterCache

    made, capture = [], [False]

    def transform(w, out):
        made.append((None, out))  # never the weight itself: the cache must see it freed
        return out if out is not None else object()

    cache = FilterCache(transform, lambda: capture[0])
    w = _FakeWeight(0x1000)
    first = cache.get(w, 0x1000)
    assert first is not None and len(made) == 1 and made[-1][1] is None
    assert cache.get(w, 0x1000) is first and len(made) == 1  # warm: no transform
    view = _FakeWeight(0x1000, w.counter)  # w.detach(): same storage, same counter, another object
    assert cache.get(view, 0x1000) is first and len(made) == 1
    w.bump()
    assert cache.get(w, 0x1000) is first and len(made) == 2 and made[-1][1] is first  # same buffer, new filters
    assert cache.get(w, 0x1000) is first and len(made) == 2
    other = _FakeWeight(0x2000)
    assert cache.get(other, 0x2000) is not first and len(made) == 3 and len(cache) == 2
    del view
    del w
    gc.collect()
    assert len(cache) == 1  # the freed weight's entry went with it
    reused = _FakeWeight(0x1000)  # a new tensor at the freed address, version 0 like the old one was
    assert cache.get(reused, 0x1000) is not None and len(made) == 4 and made[-1][1] is None
    assert cache.get(_InferenceWeight(), 0x3000) is None and len(made) == 4
    assert cache.get(object(), 0x3000) is None and len(made) == 4  # no version counter (CuPy)
    capture[0] = True
    fresh = _FakeWeight(0x4000)
    assert cache.get(fresh, 0x4000) is None and len(made) == 4  # under capture: the whole plan runs
    assert cache.get(reused, 0x1000) is not None  # a hit needs no transform, so capture may use it
    capture[0] = False
    assert cache.get(fresh, 0x4000) is not None and len(made) == 5
    other.address = 0x5000  # other.data = ...: moved, no version bump, still alive
    squatter = _FakeWeight(0x2000)  # a new tensor at other's old address, version 0 as other's entry
    assert cache.get(squatter, 0x2000) is not None and len(made) == 6  # not other's filters


def test_torch_runner_launches_only_the_rest_while_weights_are_unchanged(monkeypatch):
    """torch_runner's wiring, with the CUDA driver recorded and CPU torch tensors standing in for
    CUDA ones (only data_ptr, _version and new_empty are used): the first call transforms, warm
    calls launch only the "rest" steps on the cached buffer, an in-place update transforms again
    into the same buffer, and under capture the whole plan launches."""
    torch = _torch()
    from conftest import NOMINAL_CUDA
    from convforge.frontends import torch_run

    mod, calls, _ = _stubbed_cuda_module(monkeypatch)
    capture = [False]
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 77, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: capture[0], raising=False)
    made = []

    def fake_transform(exe, w, out=None):
        made.append(out)
        return out if out is not None else torch.empty(exe.derived_bytes // 4)

    monkeypatch.setattr(torch_run, "torch_transform", fake_transform)
    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    v = next(v for v in all_variants() if v.name == "winograd_nonfused_f4")
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    exe = mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), plan)
    rest = len(plan.steps) - len(exe.weight_steps)
    assert exe.weight_steps and rest
    run = torch_run.torch_runner(exe, 0)
    x, w = torch.randn(spec.x_shape), torch.randn(spec.w_shape, requires_grad=True)
    for i in range(3):
        calls.clear()
        y = run(x, w)
        assert tuple(y.shape) == spec.y_shape and len(calls) == rest and len(made) == 1, i
    packed = run.filters._entries[w.data_ptr()][2]
    with torch.no_grad():
        w.mul_(2.0)
    calls.clear()
    run(x, w)
    assert len(made) == 2 and made[-1] is packed and len(calls) == rest
    capture[0] = True
    calls.clear()
    run(x, w)
    assert len(calls) == len(plan.steps) and len(made) == 2  # the graph holds the transform too


def test_op_autograd_kernel_calls_the_backend_kernel_directly(monkeypatch):
    """no_grad and grad calls of the op reach its backend kernel without a second trip through the
    dispatcher; fake tensors still take the dispatcher's way (the fake impl answers)."""
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    import convforge.torch as ct
    from convforge.torch import ops

    if ops.NATIVE is not None:
        pytest.skip("the op's Autograd kernel is native.cpp's on this machine (tests/test_gpu_torch.py covers it)")
    calls = []
    real = ops._DIRECT[torch._C.DispatchKey.CPU]
    monkeypatch.setitem(ops._DIRECT, torch._C.DispatchKey.CPU, lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3, requires_grad=True)
    with torch.no_grad():
        y = ct.conv2d(x, w, None, 1, 1)
    y2 = ct.conv2d(x, w, None, 1, 1)
    y2.sum().backward()
    assert calls == [1, 1] and torch.equal(y, y2.detach()) and w.grad is not None
    with FakeTensorMode():
        fy = ct.conv2d(torch.empty(1, 2, 5, 5), torch.empty(3, 2, 3, 3), None, 1, 1)
    assert tuple(fy.shape) == (1, 3, 5, 5) and calls == [1, 1]


def test_residual_pointer_reaches_the_epilogue_slot(monkeypatch):
    """launch_raw/torch_runner with a residual (CPU tensors standing in, driver recorded): the
    plan's ``res`` argument gets the residual's address; a residual that is not contiguous is made
    so; a missing residual, a wrong shape, or a residual given to a plan without one is refused."""
    import ctypes

    torch = _torch()
    from conftest import NOMINAL_CUDA
    from convforge.codegen.dialect import LocalBuf
    from convforge.frontends import torch_run
    from convforge.plan import Epilogue

    mod, calls, _ = _stubbed_cuda_module(monkeypatch)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 77, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    spec = ConvSpec.make(2, 16, 14, 14, 24, 1, 1)
    v = next(v for v in all_variants() if v.name == "implicit_gemm")
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(True, True, residual=True))
    exe = mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), plan)
    assert exe.fast and not exe.weight_steps
    run = torch_run.torch_runner(exe, 0)
    x, w, b = torch.randn(spec.x_shape), torch.randn(spec.w_shape), torch.randn(spec.k)

    def res_cells():
        out = []
        for (_, *_rest, params, _extra), step in zip(calls, plan.steps):
            args = [a for a in exe.kernels[step.kernel].args if not isinstance(a, LocalBuf)]
            cells = (ctypes.c_void_p * len(args)).from_address(params)
            out += [ctypes.c_uint64.from_address(cells[i]).value for i, ref in enumerate(step.args) if ref == "res"]
        return out

    res = torch.randn(spec.y_shape)
    run(x, w, b, None, res)
    assert res_cells() == [res.data_ptr()] * len(res_cells()) and res_cells()
    calls.clear()
    strided = torch.randn(spec.y_shape[::-1]).permute(3, 2, 1, 0)
    run(x, w, b, None, strided)
    got = res_cells()
    assert got and strided.data_ptr() not in got  # a contiguous copy was passed
    with pytest.raises(ValueError, match="pass res"):
        run(x, w, b)
    with pytest.raises(ValueError, match="must equal the output's shape"):
        run(x, w, b, None, torch.randn(1, *spec.y_shape[1:]))
    plain = mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), v.plan(spec, v.default(spec, NOMINAL_CUDA),
                                                                  NOMINAL_CUDA, Epilogue(True)))
    with pytest.raises(ValueError, match="adds no residual"):
        torch_run.torch_runner(plain, 0)(x, w, b, None, res)


def test_fast_path_with_weights_of_another_kind_gives_the_clear_error(monkeypatch):
    """Once torch calls have a fast-path keyer, a call whose weights (or bias) are not torch
    tensors must reach the validating slow path (ValueError naming the problem), not fail
    inside the key with an AttributeError."""
    torch = _torch()
    import convforge
    from convforge import api
    from convforge.frontends.keys import torch_key

    monkeypatch.setitem(api._KEYERS, torch.Tensor, torch_key)
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError):
        convforge.conv2d(x, np.ones((4, 3, 3, 3), np.float32))
    with pytest.raises(ValueError):
        convforge.conv2d(x, torch.ones(4, 3, 3, 3), np.ones(4, np.float32))


def test_a_native_miss_is_looked_up_once(monkeypatch):
    """conv2d asks the native fast path once; ``python_conv2d`` (what native.cpp's C entry and the
    op's CUDA kernel call after their own lookup missed) has conv2d's signature and never asks
    again, so a miss (CuPy arrays, cold calls) pays one lookup. The op's CUDA kernel, called here
    on CPU tensors, reaches its PyTorch fallback without asking."""
    import inspect

    torch = _torch()
    import torch.nn.functional as F

    from convforge import api
    from convforge.frontends import fast_path
    from convforge.torch import ops

    assert inspect.signature(api.python_conv2d) == inspect.signature(api.conv2d)
    asked: list[int] = []
    ran: list[int] = []
    monkeypatch.setattr(fast_path, "RUN", lambda *a: asked.append(len(a)))
    # conv2d's Python body stands in for a device run (numpy arrays need OpenCL, absent on the GPU tier)
    real = api._conv2d
    monkeypatch.setattr(api, "_conv2d", lambda *a: ran.append(len(a)) or "ran" if isinstance(a[0], np.ndarray)
                        else real(*a))
    g = np.random.default_rng(3)
    x = g.standard_normal((1, 3, 7, 9)).astype(np.float32)
    w = g.standard_normal((4, 3, 3, 3)).astype(np.float32)
    conv = getattr(api.conv2d, "__wrapped__", api.conv2d)  # Python's conv2d (native.cpp's C entry asks in C)
    assert conv(x, w, padding=1) == "ran" and asked == [14] and len(ran) == 1
    assert api.python_conv2d(x, w, padding=1) == "ran" and asked == [14] and len(ran) == 2
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    y = ops._cuda(xt, wt, None, [1, 1], [1, 1, 1, 1], [1, 1], "auto", None, None)
    torch.testing.assert_close(y, F.conv2d(xt, wt, None, 1, 1))
    assert asked == [14]


def test_kernel_operand_copies_channels_last_filters_once_per_version(monkeypatch):
    """A channels_last (or half-cast) model's filters reach the kernels KCRS: one copy per weight
    version in inference (so the filter transforms behind it are filed once, not per call), a
    differentiable copy per call in training, the parameter itself when it already is KCRS."""
    torch = _torch()
    from convforge.torch import modules
    from convforge.torch.modules import kernel_operand

    monkeypatch.setattr(modules, "_CAPTURING", lambda: False)  # CPU tensors: no CUDA stream to ask
    cache: dict = {}
    w = torch.nn.Parameter(torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last))
    plain = torch.randn(8, 4, 3, 3)
    assert kernel_operand(cache, plain, torch.float32) is plain
    with torch.no_grad():
        first = kernel_operand(cache, w, torch.float32)
        assert first.is_contiguous() and torch.equal(first, w) and first.data_ptr() != w.data_ptr()
        assert kernel_operand(cache, w, torch.float32) is first  # filed: no copy a call
        w.mul_(2)  # an optimizer step: a new version
        second = kernel_operand(cache, w, torch.float32)
        assert second is not first and torch.equal(second, w)
        half = kernel_operand(cache, w, torch.float16)
        assert half.dtype == torch.float16 and half.is_contiguous() and kernel_operand(cache, w, torch.float16) is half
    with torch.inference_mode():  # the copy made there is a normal tensor (the filter caches need its version)
        w.mul_(0.5)
        third = kernel_operand(cache, w, torch.float32)
    assert not third.is_inference() and third._version >= 0 and torch.equal(third, w)
    trained = kernel_operand(cache, w, torch.float32)  # grad enabled and w requires it: differentiable
    assert trained.is_contiguous() and trained.grad_fn is not None
    trained.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    b = torch.randn(8)
    assert kernel_operand(cache, b, torch.float32) is b
    assert kernel_operand(cache, b, torch.float16).dtype == torch.float16
