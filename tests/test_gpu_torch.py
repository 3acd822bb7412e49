"""GPU tier of convforge.torch and the per-call fast path (skips without a CUDA device or torch).

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_torch.py`` (and scripts/host_cost.py for
the per-call host cost). Every result is checked against a float64 reference; outputs are taken
from a caching-allocator block poisoned with NaN first, so a kernel that skips an element fails.
"""

from __future__ import annotations

import itertools
import logging

import pytest

from convforge import dispatch
from convforge.backends.base import DeviceMemoryError
from convforge.kernels import all_variants
from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of convforge.torch: torch not installed")
F = torch.nn.functional

SPECS = [ConvSpec.make(2, 3, 13, 17, 5, 3, 3, (1, 2), (1, 0, 2, 1)), ConvSpec.make(1, 16, 14, 14, 24, 3, 3, 1, 1),
         ConvSpec.make(3, 7, 9, 9, 5, 1, 1), ConvSpec.make(1, 3, 27, 29, 4, 11, 11, 4, (2, 1, 0, 3))]


def _poison(shape):
    """Leave a NaN-filled block of this size in torch's cache, where the next output lands."""
    t = torch.full(shape, float("nan"), device="cuda")
    del t


def _ref(x, w, spec, b=None):
    bias = None if b is None else b.detach().cpu().numpy()
    return conv2d_ref(x.detach().cpu().numpy(), w.detach().cpu().numpy(), spec, bias)


def _tensors(spec, bias=True, requires_grad=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(spec.x_shape, device="cuda", generator=g)
    w = torch.randn(spec.w_shape, device="cuda", generator=g, requires_grad=requires_grad)
    b = torch.randn(spec.k, device="cuda", generator=g, requires_grad=requires_grad) if bias else None
    return x, w, b


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
@pytest.mark.parametrize("mode", ["plain", "requires_grad", "no_grad", "inference_mode"])
def test_conv2d_torch_tensors_every_mode(gpu, spec, mode):
    import contextlib

    import convforge

    x, w, b = _tensors(spec, requires_grad=mode != "plain")
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, contextlib.nullcontext)
    with ctx():
        for i in range(3):  # the first call builds the runner, the others hit it
            _poison(spec.y_shape)
            y = convforge.conv2d(x * (i + 1) if i else x, w, b, stride=spec.stride, padding=spec.pad)
            assert rel_l2(y.cpu().numpy(), _ref(x * (i + 1) if i else x, w, spec, b)) < 1e-5, (mode, i)


def test_warm_calls_hit_the_runner_cache(gpu):
    import convforge

    spec = SPECS[1]
    x, w, b = _tensors(spec)
    convforge.conv2d(x, w, b, padding=1)
    n = len(dispatch.RUNNERS)
    for _ in range(5):
        convforge.conv2d(x, w, b, padding=1)
    assert len(dispatch.RUNNERS) == n
    convforge.conv2d(x, w, None, padding=1)  # no bias: another signature
    assert len(dispatch.RUNNERS) == n + 1


NAMED = [("direct", {}), ("direct", {"tex": True, "ldg": False}), ("direct", {"wconst": True}),
         ("implicit_gemm", {}), ("implicit_gemm_precomp", {}), ("im2col_gemm", {}), ("im2col_cublas", {}),
         ("im2win", {}), ("winograd_nonfused_f4", {}), ("winograd_fused_f2", {})]


@pytest.mark.parametrize("name,extra", NAMED, ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_fast_and_view_paths_per_variant(gpu, name, extra, kind):
    """Launch-only plans take the raw cuLaunchKernel path; Gemm / constant / texture plans the view
    path; both on a non-default stream, misaligned views included."""
    import cupy as cp

    import convforge

    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    v = next(v for v in all_variants() if v.name == name)
    if v.applies(spec, gpu.device):
        pytest.skip(f"{name}: {v.applies(spec, gpu.device)}")
    prm = v.default(spec, gpu.device).replace(**extra) if extra else None
    x, w, b = _tensors(spec)
    xs = torch.empty(x.numel() + 1, device="cuda")[1:].view(spec.x_shape)  # 4 bytes off alignment
    xs.copy_(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for xin in (x, xs, x):
            _poison(spec.y_shape)
            if kind == "torch":
                y = convforge.conv2d(xin, w, b, padding=1, algo=name, params=prm)
            else:
                with cp.cuda.ExternalStream(stream.cuda_stream):
                    y = convforge.conv2d(cp.asarray(xin), cp.asarray(w), cp.asarray(b), padding=1, algo=name,
                                         params=prm)
                    y = torch.as_tensor(y, device="cuda")
            stream.synchronize()
            assert rel_l2(y.cpu().numpy(), _ref(x, w, spec, b)) < v.tolerance, name


def test_conv2d_module_training_matches_pytorch_and_learns(gpu, monkeypatch):
    import convforge.torch as ct

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # PyTorch's side in FP32 too
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 16, 3, stride=2, padding="valid"), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 8, (2, 3), padding="same"), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(8, 4)).cuda()
    ours = torch.nn.Sequential(*[m for m in __import__("copy").deepcopy(ref)])
    report = ct.convert(ours)
    assert len(report.converted) == 3 and not report.left, report
    x = torch.randn(8, 3, 17, 17, device="cuda")
    target = torch.randint(0, 4, (8,), device="cuda")
    for model in (ref, ours):
        F.cross_entropy(model(x), target).backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    opt = torch.optim.Adam(ours.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = F.cross_entropy(ours(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_filter_transform_runs_once_per_weight_version(gpu, monkeypatch):
    from convforge.frontends import torch_run
    from convforge.torch import modules, native

    calls = []
    real = torch_run.torch_transform
    monkeypatch.setattr(torch_run, "torch_transform", lambda exe, w, out=None: calls.append(1) or real(exe, w, out))
    mod = native.load()  # warm layers run there (its own count), starting from Python's filters
    base = mod.stats()["transforms"] if mod is not None else 0

    def transforms():
        return len(calls) + (mod.stats()["transforms"] - base if mod is not None else 0)

    m = modules.Conv2d(16, 24, 3, padding=1, algo="winograd_nonfused_f4").cuda()
    x = torch.randn(2, 16, 14, 14, device="cuda")
    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    with torch.inference_mode():
        for _ in range(4):
            y = m(x)
    assert transforms() == 1
    assert rel_l2(y.cpu().numpy(), _ref(x, m.weight, spec, m.bias)) < 1e-5
    with torch.no_grad():
        m.weight.mul_(-2.0)  # in place: _version moves
        y = m(x)
    assert transforms() == 2
    assert rel_l2(y.cpu().numpy(), _ref(x, m.weight, spec, m.bias)) < 1e-5


@pytest.mark.parametrize("kind", ["conv_fp32", "transposed_fp16"])
def test_channels_last_filters_are_transformed_once_per_version(gpu, monkeypatch, kind):
    """A channels_last model's filters (``model.to(memory_format=torch.channels_last)``) are not KCRS:
    the modules keep one KCRS copy per weight version (``modules.kernel_operand``), so the filter
    transforms behind it run once, not at every call (they ran per call before: a new copy each time)."""
    from convforge.frontends import torch_run
    from convforge.torch import modules, native

    calls = []
    real = torch_run.torch_transform
    monkeypatch.setattr(torch_run, "torch_transform", lambda exe, w, out=None: calls.append(1) or real(exe, w, out))
    mod = native.load()
    base = mod.stats()["transforms"] if mod is not None else 0

    def transforms():
        return len(calls) + (mod.stats()["transforms"] - base if mod is not None else 0)

    cl = torch.channels_last
    if kind == "conv_fp32":
        m = modules.Conv2d(16, 24, 3, padding=1, algo="winograd_nonfused_f4").cuda().to(memory_format=cl)
        x = torch.randn(2, 16, 14, 14, device="cuda").to(memory_format=cl)
        ref = lambda: F.conv2d(x.double(), m.weight.double(), m.bias.double(), padding=1)  # noqa: E731
    else:
        m = modules.ConvTranspose2d(64, 32, 4, stride=2, padding=1, algo="dgrad_tc_strided_half").cuda().half()
        m = m.to(memory_format=cl)
        x = torch.randn(2, 64, 9, 11, device="cuda", dtype=torch.float16).to(memory_format=cl)
        ref = lambda: F.conv_transpose2d(x.double(), m.weight.double(), m.bias.double(), stride=2,  # noqa: E731
                                         padding=1)
    assert not m.weight.is_contiguous()
    tol = 1e-5 if kind == "conv_fp32" else 2e-3
    with torch.inference_mode():
        for _ in range(4):
            _poison((2, 24, 14, 14) if kind == "conv_fp32" else (2, 32, 18, 11))  # the output's bytes
            y = m(x)
    assert transforms() == 1
    with torch.no_grad():
        assert rel_l2(y.double().cpu().numpy(), ref().cpu().numpy()) < tol
        m.weight.mul_(-2.0)
        y = m(x)
        assert transforms() == 2
        assert rel_l2(y.double().cpu().numpy(), ref().cpu().numpy()) < tol


def _model():
    import convforge.torch as ct

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 8, 1)).cuda().eval()
    ref = __import__("copy").deepcopy(model).double()
    ct.convert(model)
    return model, ref


def test_cuda_graph_capture_and_replay(gpu, capture_graph):
    model, ref = _model()
    static_x = torch.randn(4, 3, 20, 20, device="cuda")
    with torch.no_grad():
        graph, static_y = capture_graph(lambda: model(static_x))
        for seed in range(3):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            static_x.copy_(torch.randn(4, 3, 20, 20, device="cuda", generator=gen))
            graph.replay()
            want = ref(static_x.double())
            err = float((static_y.double() - want).norm() / want.norm())
            assert err < 1e-5, (seed, err)


def test_torch_compile_runs_without_graph_breaks(gpu):
    model, ref = _model()
    x = torch.randn(2, 3, 16, 16, device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        y = compiled(x)
    want = ref(x.double())
    assert float((y.double() - want).norm() / want.norm()) < 1e-5
    reduce = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            y = reduce(x)
    assert float((y.double() - want).norm() / want.norm()) < 1e-5


@pytest.mark.serial
def test_device_memory_exhausted(gpu, monkeypatch, caplog):
    """Memory filled on purpose: a named algorithm whose workspace does not fit raises an error
    naming bytes asked and free; 'auto' (forced to that variant first) falls back and logs."""
    import cupy as cp

    import convforge
    from convforge.dispatch import executables

    dispatch.clear_executables()
    cp.get_default_memory_pool().free_all_blocks()
    spec = ConvSpec.make(8, 256, 56, 56, 64, 3, 3, 1, 1)  # im2col workspace: 231 MB
    x, w, _ = _tensors(spec, bias=False)
    im2col = next(v for v in all_variants() if v.name == "im2col_gemm")
    assert im2col.workspace_bytes(spec, im2col.default(spec, gpu.device)) > 200 << 20
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    hog = torch.empty(free - (160 << 20), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(DeviceMemoryError, match=r"asked for \d+ bytes of device memory, \d+ bytes free"):
            convforge.conv2d(x, w, padding=1, algo="im2col_gemm")
        real = executables.choose

        def prefer_im2col(spec_, backend, epilogue, **kw):
            if kw.get("workspace_limit") is None and kw.get("algo") == "auto":
                return dispatch.Choice(im2col, im2col.default(spec_, backend.device), None, "test")
            return real(spec_, backend, epilogue, **kw)

        monkeypatch.setattr(executables, "choose", prefer_im2col)
        with caplog.at_level(logging.WARNING, logger="convforge"):
            y = convforge.conv2d(x, w, padding=1)
            convforge.conv2d(x, w, padding=1)
        assert sum("falls back" in r.getMessage() for r in caplog.records) == 1
    finally:
        del hog
        dispatch.clear_executables()
        torch.cuda.empty_cache()
    one = ConvSpec.make(1, 256, 56, 56, 64, 3, 3, 1, 1)
    assert rel_l2(y[:1].cpu().numpy(), conv2d_ref(x[:1].cpu().numpy(), w.cpu().numpy(), one)) < 2e-5


def test_capture_before_first_use_is_refused_clearly(gpu):
    import convforge

    dispatch.clear_executables()
    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    x, w, _ = _tensors(spec, bias=False)
    from convforge.backends import get_backend

    dispatch.executable(spec, get_backend("cuda", 0), algo="winograd_nonfused_f4")  # compiled, no workspace yet
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="during CUDA-graph capture"):
        with torch.cuda.graph(graph):
            convforge.conv2d(x, w, padding=1, algo="winograd_nonfused_f4")


def test_launches_from_a_thread_where_no_context_is_current(gpu):
    """A thread that never made a CUDA context current (autograd's backward threads can be such):
    the executable's and RawLaunches' launches make the device's context current there instead of
    failing with CUDA_ERROR_INVALID_CONTEXT (round 30's flaky tier failure), and compute the layer."""
    import threading

    from convforge.backends import cuda, get_backend

    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    x, w, _ = _tensors(spec, bias=False)
    exe = dispatch.executable(spec, get_backend("cuda", 0), algo="implicit_gemm")
    exe.reserve(0)
    y = torch.full(spec.y_shape, float("nan"), device="cuda")
    torch.cuda.synchronize()
    seen: dict[str, object] = {}

    def work() -> None:
        try:
            seen["before"] = cuda._driver().current_context()
            exe.launch_raw(x.data_ptr(), w.data_ptr(), y.data_ptr(), 0, 0)
            seen["after"] = cuda._driver().current_context()
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            seen["error"] = err

    t = threading.Thread(target=work)
    t.start()
    t.join()
    torch.cuda.synchronize()
    assert "error" not in seen, seen
    assert seen["before"] == 0 and seen["after"] == exe.context, seen  # the test could fail: none was current
    want = conv2d_ref(x.double().cpu().numpy(), w.double().cpu().numpy(), spec)
    assert rel_l2(y.cpu().numpy(), want) < 1e-5


@pytest.mark.parametrize("path", ["native", "python"])
def test_conv2d_caches_filters_per_weight_version(gpu, monkeypatch, path):
    """convforge.conv2d with torch tensors: the filter transform runs once per weight version (warm
    calls launch only the rest), an in-place update re-runs it, a new weight tensor gets its own;
    a CUDA graph captured through conv2d holds the whole plan and sees later weight updates. Both
    fast paths: the native one (its own filter cache, started from the slow path's, counted by
    ``stats``) and Python's."""
    import convforge
    from convforge.frontends import fast_path, torch_run
    from convforge.torch import native

    calls = []
    real = torch_run.torch_transform
    monkeypatch.setattr(torch_run, "torch_transform", lambda exe, w, out=None: calls.append(1) or real(exe, w, out))
    mod = native.load()
    if path == "native" and mod is None:
        pytest.skip("native fast path off (CONVFORGE_NATIVE=0)")
    if path == "python":
        monkeypatch.setattr(fast_path, "RUN", None)

    def transforms():  # Python's transforms (the slow path's first), plus the native path's own
        return len(calls) + (mod.stats()["transforms"] - base if mod is not None else 0)

    base = mod.stats()["transforms"] if mod is not None else 0
    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    x, w, b = _tensors(spec, requires_grad=True)
    algo = "winograd_nonfused_f4"

    def check(y, weights):
        assert rel_l2(y.detach().cpu().numpy(), _ref(x, weights, spec, b)) < 1e-5

    with torch.no_grad():
        for _ in range(3):  # the slow path transforms, files its filters with the native path too
            _poison(spec.y_shape)
            check(convforge.conv2d(x, w, b, padding=1, algo=algo), w)
        assert transforms() == 1
        w.mul_(-0.5)  # in place: _version moves
        check(convforge.conv2d(x, w, b, padding=1, algo=algo), w)
        assert transforms() == 2
        w2 = torch.randn_like(w)
        check(convforge.conv2d(x, w2, b, padding=1, algo=algo), w2)
        check(convforge.conv2d(x, w, b, padding=1, algo=algo), w)
        assert transforms() == 3
        with torch.inference_mode():  # w is a normal tensor: its version is still tracked
            check(convforge.conv2d(x, w, b, padding=1, algo=algo), w)
        assert transforms() == 3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = convforge.conv2d(x, w, b, padding=1, algo=algo)
        w.mul_(3.0)
        graph.replay()
        check(static_y, w)  # the transform is in the graph
        with torch.inference_mode():  # an inference tensor has no version: the whole plan, no caching
            wi = w.clone()
            for _ in range(2):
                check(convforge.conv2d(x, wi, b, padding=1, algo=algo), wi)
        assert transforms() == 3


@pytest.fixture
def native_mod(gpu):
    from convforge.config import config
    from convforge.torch import native

    if not config.native:
        pytest.skip("native fast path off (CONVFORGE_NATIVE=0)")
    mod = native.load()
    assert mod is not None, "the native fast path did not build or load on this CUDA machine: see the log"
    return mod


NATIVE_CALLS = [  # (spec, conv2d keyword arguments, algo): spellings the key must keep apart
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), dict(padding=1), "auto"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, (1, 1, 2, 2)), dict(padding=(1, 2)), "auto"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, (1, 2, 1, 2)), dict(padding=(1, 2, 1, 2)), "auto"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, (1, 2, 1, 2)), dict(padding=[1, 2, 1, 2]), "auto"),
    (ConvSpec.make(1, 3, 27, 29, 4, 11, 11, 4, (2, 1, 0, 3)), dict(stride=4, padding=(2, 1, 0, 3)), "auto"),
    (ConvSpec.make(1, 3, 27, 29, 4, 11, 11, 4, (2, 1, 0, 3)), dict(stride=(4, 4), padding=(2, 1, 0, 3)), "auto"),
    (ConvSpec.make(3, 7, 9, 9, 5, 1, 1, 2), dict(stride=2), "auto"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), dict(padding=1), "winograd_nonfused_f4"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), dict(padding=1, relu=True), "implicit_gemm"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), dict(padding=1, precision="relaxed"), "auto"),
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), dict(padding=1, max_error=1e-6), "auto"),
    # TMA plans (whole 32-channel atoms: the defaults bring the operands by tensor maps, which the
    # native core encodes per buffer address): NCHW x converted into the workspace, a strided layer
    (ConvSpec.make(2, 64, 14, 14, 64, 3, 3, 1, 1), dict(padding=1, precision="relaxed"), "tc_implicit_gemm_tf32"),
    (ConvSpec.make(3, 32, 13, 11, 40, 3, 3, 2, 1), dict(stride=2, padding=1), "tc_implicit_gemm_3xtf32"),
]


def test_native_warm_calls_never_enter_python(native_mod, monkeypatch):
    """After the slow path files a call, the same call (every spelling of its arguments in
    NATIVE_CALLS) runs in C++: with Python's whole path made to fail, results still match the
    float64 reference; the op's CUDA kernel never falls back to Python either."""
    import convforge
    from convforge import api
    from convforge.torch import conv2d as op_conv2d

    cases = []
    for i, (spec, kw, algo) in enumerate(NATIVE_CALLS):
        x, w, b = _tensors(spec, seed=i)
        with torch.no_grad():
            convforge.conv2d(x, w, b, algo=algo, **kw)  # the slow path files it
            if "relu" not in kw:  # the op has no ReLU
                op_conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, algo=algo, precision=kw.get("precision"),
                          max_error=kw.get("max_error"))
        cases.append((spec, kw, algo, x, w, b))
    entries = native_mod.stats()["entries"]

    def fail(*args, **kwargs):
        raise AssertionError("a warm call reached Python's path")

    monkeypatch.setattr(api, "_KEYERS", {})
    monkeypatch.setattr(api, "_conv2d", fail)
    fallbacks = native_mod.stats()["op_fallbacks"]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            for spec, kw, algo, x, w, b in cases:
                want = _ref(x, w, spec, b)
                if kw.get("relu"):
                    want = want.clip(min=0)
                _poison(spec.y_shape)
                y = convforge.conv2d(x, w, b, algo=algo, **kw)
                tol = 1e-3 if kw.get("precision") == "relaxed" else 1e-5
                assert rel_l2(y.cpu().numpy(), want) < tol, (spec.short(), kw, algo)
                if "relu" not in kw:
                    _poison(spec.y_shape)
                    y = op_conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, algo=algo,
                                  precision=kw.get("precision"), max_error=kw.get("max_error"))
                    assert rel_l2(y.cpu().numpy(), want) < tol, ("op", spec.short(), kw, algo)
    assert native_mod.stats()["op_fallbacks"] == fallbacks
    assert native_mod.stats()["entries"] == entries


def test_native_entries_go_with_a_configuration_change(native_mod):
    """Changing a setting or clearing the executables empties the native table (its keys assume
    the settings in force when the slow path filed them)."""
    import convforge
    from convforge.config import config

    spec = ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1)
    x, w, b = _tensors(spec)
    convforge.conv2d(x, w, b, padding=1)
    assert native_mod.stats()["entries"] >= 1
    saved = config.max_error
    config.max_error = 1e-6
    try:
        assert native_mod.stats()["entries"] == 0
        y = convforge.conv2d(x, w, b, padding=1)
        assert rel_l2(y.cpu().numpy(), _ref(x, w, spec, b)) < 1e-5
        assert native_mod.stats()["entries"] == 1
    finally:
        config.max_error = saved
    convforge.conv2d(x, w, b, padding=1)
    dispatch.clear_executables()
    assert native_mod.stats()["entries"] == 0


def test_native_off_by_environment():
    """CONVFORGE_NATIVE=0: no native module, the op's kernels are Python's, calls still right."""
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("GPU tier: torch sees no CUDA device")
    code = ("import torch, convforge, convforge.torch as ct\n"
            "from convforge.frontends import fast_path\n"
            "x = torch.randn(1, 8, 8, 8, device='cuda'); w = torch.randn(8, 8, 3, 3, device='cuda')\n"
            "y = [convforge.conv2d(x, w, padding=1) for _ in range(2)][-1]\n"
            "z = ct.conv2d(x, w, None, 1, 1)\n"
            "want = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)\n"
            "assert fast_path.TORCH is None\n"
            "print(float((y.double() - want).norm() / want.norm()), float((z.double() - want).norm() / want.norm()))\n")
    import os

    env = dict(os.environ, CONVFORGE_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(float(v) < 1e-5 for v in out.stdout.split()), out.stdout


@pytest.mark.parametrize("static_weights", [True, False])
def test_graph_replay_after_in_place_weight_update(gpu, static_weights, capture_graph):
    """convert(static_weights=...): False records the filter transforms in the graph (a replay sees
    in-place updates at once); True replays the filters made before capture, and one eager forward
    after the update re-transforms into the same buffers, which the replay then reads."""
    import copy

    import convforge.torch as ct

    torch.manual_seed(2)
    base = torch.nn.Sequential(torch.nn.Conv2d(16, 24, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(24, 8, 3, padding=1)).cuda().eval()
    model = copy.deepcopy(base)
    ct.convert(model, algo="winograd_nonfused_f4", static_weights=static_weights)
    x = torch.randn(2, 16, 14, 14, device="cuda")

    def err(y):
        want = copy.deepcopy(model).double()(x.double())
        return float((y.double() - want).norm() / want.norm())

    with torch.no_grad():
        graph, static_y = capture_graph(lambda: model(x))
        graph.replay()
        assert err(static_y) < 1e-5
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d):
                m.weight.mul_(-1.5)
        if static_weights:
            model(x)  # the eager forward that refreshes the hoisted filters
        graph.replay()
        assert err(static_y) < 1e-5


def test_native_entry_keeps_conv2d_signature_and_errors(native_mod):
    """Once the native path loads, convforge.conv2d is its C entry: same signature and docstring,
    keyword and positional spellings run (checked against the reference), and what it does not
    run (bad input, unknown keywords) reaches the Python function and its errors."""
    import inspect

    import convforge
    from convforge import api

    entry = convforge.conv2d
    assert entry is api.conv2d and entry.__wrapped__ is not entry
    assert inspect.signature(entry) == inspect.signature(entry.__wrapped__)
    assert entry.__doc__ == entry.__wrapped__.__doc__
    spec = ConvSpec.make(1, 8, 9, 11, 8, 3, 3, 2, 1)
    x, w, b = _tensors(spec)
    want = _ref(x, w, spec, b)
    for _ in range(2):  # the first call files it, the second runs in C
        for y in (entry(x, w, b, 2, 1), entry(x=x, w=w, bias=b, stride=2, padding=1),
                  entry(x, w, b, stride=2, padding=1, dilation=1, algo="auto", backend="cuda", relu=False)):
            assert rel_l2(y.cpu().numpy(), want) < 1e-5
    with pytest.raises(TypeError, match="unexpected keyword"):
        entry(x, w, b, strides=2)
    with pytest.raises(ValueError, match="padding"):
        entry(x, w, b, 2, -1)
    with pytest.raises(ValueError, match="same kind"):
        entry(x, w.cpu().numpy(), b, 2, 1)


@pytest.mark.parametrize("spec, algo", [
    (ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), "auto"),  # dgrad with a cached filter transform
    (ConvSpec.make(3, 8, 13, 11, 12, 3, 3, 2, (1, 0, 1, 1)), "auto"),  # strided, asymmetric padding
    (ConvSpec.make(2, 64, 14, 14, 64, 3, 3, 1, 1), "tc_implicit_gemm_tf32"),  # tensor maps in the core
], ids=lambda v: getattr(v, "key", lambda: v)())
def test_backward_ops_run_in_cpp_once_filed(native_mod, spec, algo):
    """The backward ops' CUDA kernels are native.cpp's: the first backward files each pass's call
    (checked there against Python's result), later ones run it in C++ (no fallback to Python), and
    the gradients stay PyTorch's (float64) through in-place weight updates (dgrad's cached filters
    follow the version) and two weight tensors alternating."""
    from convforge.torch import conv2d as op_conv2d

    relaxed = algo.startswith("tc_")
    tol = 2e-3 if relaxed else 1e-4
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(spec.x_shape, device="cuda", generator=g, requires_grad=True)
    ws = [torch.randn(spec.w_shape, device="cuda", generator=g, requires_grad=True) for _ in range(2)]
    gy = torch.randn(spec.y_shape, device="cuda", generator=g)

    def step(w):
        x.grad = w.grad = None
        y = op_conv2d(x, w, None, spec.stride, spec.pad, spec.dilation, algo=algo,
                      precision="relaxed" if relaxed else None)
        y.backward(gy)
        xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        t, b, left, right = spec.pad
        ref = torch.nn.functional.conv2d(torch.nn.functional.pad(xd, (left, right, t, b)), wd, None, spec.stride, 0,
                                         spec.dilation)
        ref.backward(gy.double())
        for got, want in ((x.grad, xd.grad), (w.grad, wd.grad)):
            assert float((got.double() - want).norm() / want.norm()) < tol

    step(ws[0])  # cold: Python's kernels run and file both passes
    entries, misses = native_mod.stats()["entries"], native_mod.stats()["op_fallbacks"]
    for i in range(5):
        step(ws[i % 2])
        with torch.no_grad():
            ws[0].mul_(0.9)  # a new version: dgrad's filters are transformed again
    assert native_mod.stats()["op_fallbacks"] == misses, "warm calls went to Python"  # ws[1] shares the entries
    assert native_mod.stats()["entries"] >= entries


def test_native_autograd_node_matches_the_python_one(native_mod):
    """CONVFORGE_NATIVE_AUTOGRAD's C++ node (set_native_autograd): the op's gradients through it equal
    those through Python's _Conv2dFn bit for bit (the same backward ops run), with a bias and
    without, a strided layer, a parameter that needs no gradient, and a second backward of a retained
    graph; its grad_fn is not Python's."""
    from convforge.torch import conv2d as op_conv2d

    specs = [ConvSpec.make(2, 16, 14, 14, 24, 3, 3, 1, 1), ConvSpec.make(3, 8, 13, 11, 12, 3, 3, 2, (1, 0, 1, 1))]

    def grads(spec, native, bias, need_w=True, seed=0):
        native_mod.set_native_autograd(native)
        try:
            x, w, b = _tensors(spec, bias=bias, seed=seed)
            x.requires_grad_(True)
            w.requires_grad_(need_w)
            if b is not None:
                b.requires_grad_(True)
            y = op_conv2d(x, w, b, spec.stride, spec.pad, spec.dilation)
            name = type(y.grad_fn).__name__
            gy = torch.randn(y.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + 1))
            y.backward(gy, retain_graph=True)
            first = [t.grad.clone() for t in (x, w, b) if t is not None and t.grad is not None]
            y.backward(gy)  # the retained graph: the gradients add up
            return name, first, [t.grad for t in (x, w, b) if t is not None and t.grad is not None]
        finally:
            from convforge.config import config

            native_mod.set_native_autograd(bool(config.native_autograd))  # the default again

    for spec, bias, need_w in itertools.product(specs, (True, False), (True, False)):
        n_name, n_first, n_twice = grads(spec, True, bias, need_w)
        p_name, p_first, p_twice = grads(spec, False, bias, need_w)
        assert "Conv2dFn" in p_name and "Conv2dFn" not in n_name, (p_name, n_name)
        assert len(n_first) == len(p_first) == 1 + need_w + bias
        for a, b in zip(n_first + n_twice, p_first + p_twice, strict=True):
            assert torch.equal(a, b), (spec.short(), bias, need_w)
