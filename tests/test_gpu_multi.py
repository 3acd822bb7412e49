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


# -- one process per GPU: DistributedDataParallel, tuning on every GPU (issue 33) -------------------------
# These run subprocesses (torchrun, the convforge CLI) with NCCL_NVLS_ENABLE=0 (the lent machines' rule:
# no NVLink multicast) and the working tree's convforge first on PYTHONPATH.
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parent / "src")
DDP_SCRIPT = HERE / "ddp_check.py"


def _env(tmp_path, **extra):
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "CONVFORGE_DB": str(tmp_path / "tuning.sqlite"), **extra}
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run(argv, env, timeout=900):
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(map(str, argv))}: exit {res.returncode}\n{res.stdout[-4000:]}\n" \
                                f"{res.stderr[-4000:]}"
    return res.stdout + res.stderr


def _torchrun(args, env, n=2):
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args], env)


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _close(a, b, tol, scale):
    """``a`` within ``tol`` of ``b`` relatively, or within 1e-6 of ``scale`` (the norm of the step's
    whole gradient): a gradient that is zero analytically (a conv bias before training-mode batch
    norm, which subtracts the batch mean) is FP32 rounding noise, ~1e-9, against float64's ~1e-18,
    and a relative error of noise against zero says nothing."""
    return float((a - b).norm()) <= tol * float(b.norm()) + 1e-6 * scale


def _flat(g, keys):
    return torch.cat([g[k].flatten() for k in keys])


@pytest.mark.serial  # every GPU, and timings compared: never beside other tests
@pytest.mark.parametrize("how", ["convert", "fuse", "fuse+noset", "convert+autotune"])
def test_ddp_gradients_equal_a_one_gpu_run(two, tmp_path, how):
    """A converted / fused model (training mode: FusedConv2d's unfused path, our conv forward and
    backward kernels) in DistributedDataParallel on two GPUs, 3 SGD steps: every step's averaged
    gradients on both ranks equal a one-GPU run's over the same two shards (each shard a forward of
    its own, as each rank's batch norm sees it) within FP32 tolerance, and the parameters after
    the steps too; the one-GPU run's first gradient strays from PyTorch's float64 model's at most 4x
    as far as PyTorch FP32's does (each parameter within 1e-3), later ones within 1e-2 (a ReLU
    tie), its weights after the steps within 1e-4 (all together: a bias that starts at 0 is as far
    off as its gradients); every executable,
    runner and cached filter transform of a rank is on its own GPU. ``+noset``: the ranks never
    call set_device (tensors on cuda:1 while device 0 is current); ``+autotune``: both ranks tune
    on first sight into one database at once (the reference then reads it)."""
    env = _env(tmp_path)
    _torchrun([str(DDP_SCRIPT), "--how", how, "--out", str(tmp_path)], env)
    _run([sys.executable, str(DDP_SCRIPT), "--how", how, "--out", str(tmp_path), "--reference"], env)
    want = torch.load(tmp_path / "reference.pt")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert want["checks"]["converted"] >= 5 and want["checks"]["n_runners"] > 0, want["checks"]
    for step, (ours, anchor, t32) in enumerate(zip(want["grads"], want["torch64"], want["torch32"], strict=True)):
        exact = _flat(anchor, anchor)
        e_ours, e_t32 = _rel(_flat(ours, anchor), exact), _rel(_flat(t32, anchor), exact)
        print(f"step {step}: gradients' error against float64: convforge {e_ours:.2e}, PyTorch FP32 {e_t32:.2e}")
        if step == 0:  # the same weights as the anchor: the whole gradient and each parameter's
            assert e_ours <= 4 * e_t32 + 1e-5, ("one GPU vs PyTorch float64", step, e_ours, e_t32)
            scale = float(_flat(anchor, anchor).norm())
            for name in anchor:
                assert _close(ours[name], anchor[name], 1e-3, scale), ("one GPU vs PyTorch float64", name,
                                                                       _rel(ours[name], anchor[name]))
        else:  # a ReLU at a tie (the block's residual sum within ~1e-6 of 0; H100: step 2, convert and
            # fuse untuned: 1.6e-3, every parameter upstream of that ReLU, none downstream) passes or
            # stops one element's gradient: a jump, not an error, that a bound at rounding level cannot allow
            assert e_ours <= 1e-2, ("one GPU vs PyTorch float64", step, e_ours, e_t32)
    names = list(want["params64"])  # the weights after the steps, all together: a tie moves them little
    assert _rel(_flat(want["params"], names), _flat(want["params64"], names)) < 1e-4, "weights vs float64"
    for rank, doc in enumerate(got):
        checks = doc["checks"]
        assert checks["executables"] == [rank] and checks["runners"] == [rank], checks
        assert checks["filters"] in ([], [rank]), checks
        assert checks["converted"] == want["checks"]["converted"], checks
        for step, (g, w) in enumerate(zip(doc["grads"], want["grads"], strict=True)):
            assert g.keys() == w.keys(), (rank, step)
            flat_g, flat_w = _flat(g, w), _flat(w, w)
            assert _rel(flat_g, flat_w) < 1e-5, (rank, step, _rel(flat_g, flat_w))
            for name in w:
                assert _close(g[name], w[name], 1e-4, float(flat_w.norm())), (rank, step, name,
                                                                              _rel(g[name], w[name]))
        for name, p in want["params"].items():
            assert _rel(doc["params"][name], p) < 1e-5, (rank, name)
    for g0, g1 in zip(got[0]["grads"], got[1]["grads"], strict=True):  # DDP hands both ranks the same average
        assert all(_rel(g0[k], g1[k]) < 1e-6 for k in g0)
    if "+autotune" in how:
        from convforge.tune.db import TuningDB

        entries = TuningDB(tmp_path / "tuning.sqlite").entries()
        assert entries and {e.device for e in entries} == {_backend_key(0)} == {_backend_key(1)}, entries


def _backend_key(device):
    from convforge.backends import get_backend

    return get_backend("cuda", device).device.key()


def test_tuner_on_the_second_device_while_the_first_is_current(two):
    """The tuner's own launches, fills, events and downloads (the back-end's dict path) on cuda:1
    while device 0 is current: every candidate runs and is checked there."""
    from convforge.backends import get_backend
    from convforge.tune import Budget, Tuner

    be = get_backend("cuda", 1)
    res = Tuner(be, None, Budget(None, 4), seed=0).tune(SPECS[1])
    ok = [c for c in res.candidates if c.status == "ok"]
    assert ok and len(ok) == len(res.candidates), [(c.describe(), c.status) for c in res.candidates]
    assert torch.cuda.current_device() == 0
    assert get_backend("cuda") is get_backend("cuda", 0) and get_backend("cuda", "1") is be
    with torch.cuda.device(1):  # None follows the current device
        from convforge.backends.cuda import current_device

        if current_device() == 1:  # CuPy and torch share the runtime's current device here
            assert get_backend("cuda") is be


TUNE_SPECS = ["N=8,C=64,H=28,W=28,K=64,R=3,S=3,pad=1", "N=8,C=128,H=14,W=14,K=256,R=1,S=1,stride=2",
              "N=8,C=32,H=56,W=56,K=32,R=3,S=3,pad=1", "N=4,C=3,H=113,W=113,K=16,R=7,S=7,stride=2,pad=3",
              "N=8,C=256,H=7,W=7,K=256,R=3,S=3,pad=1", "N=2,C=17,H=31,W=29,K=13,R=5,S=5,pad=2"]


def _chosen_like(one_db, many_db, slack=1.10, floor_ms=0.005):
    """Each layer's choice in ``many_db`` is one ``one_db``'s search measured too, within ``slack``
    of that search's winner plus ``floor_ms`` (and the other way round): the same choice given the
    same measurements, up to timing noise between two runs. The floor is the launch jitter of a
    layer of ~10 us, timed on the path conv2d takes (host launch work included): the first
    two-GPU run measured a 12.6 us winner's rival at 16.2 us in one process and as the winner in
    the other."""
    from convforge.tune.db import TuningDB

    one, many = TuningDB(one_db), TuningDB(many_db)
    a, b = {e.key: e for e in one.entries()}, {e.key: e for e in many.entries()}
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    for key in a:
        for x, y, db_x in ((a[key], b[key], one), (b[key], a[key], many)):
            times = {(m.variant, m.params): m.time_ms for m in db_x.measurements(key) if m.time_ms}
            t = times.get((y.variant, y.params))
            assert t is not None, (key, y.variant, y.params, "not measured by the other run")
            assert t <= slack * x.time_ms + floor_ms, (key, x.variant, x.time_ms, y.variant, t)


def _per_worker(out):
    """{worker: layers it tuned} from the parent's "layers per worker:" line."""
    import re

    line = next(ln for ln in out.splitlines() if ln.startswith("layers per worker:"))
    return {k: int(v) for k, v in re.findall(r"(cuda:\d+) (\d+)", line)}


@pytest.mark.serial  # every GPU, and timings compared: never beside other tests
def test_tune_devices_all_chooses_as_one_gpu(two, tmp_path):
    """``tune --devices all`` on two GPUs: both workers tune, every layer lands once in the shared
    database, and the choices are the one-GPU run's (given the same measurements)."""
    specs = [a for s in TUNE_SPECS for a in ("--spec", s)]
    cli = [sys.executable, "-m", "convforge.cli", "tune", *specs, "--budget", "10", "--backend", "cuda"]
    env = _env(tmp_path)
    _run([*cli, "--db", str(tmp_path / "one.sqlite"), "--device", "0"], env)
    out = _run([*cli, "--db", str(tmp_path / "many.sqlite"), "--devices", "all"], env)
    per = _per_worker(out)
    assert set(per) == {"cuda:0", "cuda:1"} and min(per.values()) > 0, out
    assert f"{len(TUNE_SPECS)} layer(s) tuned, 0 from the database, 0 failed" in out, out
    _chosen_like(tmp_path / "one.sqlite", tmp_path / "many.sqlite")


@pytest.mark.serial  # every GPU, and timings compared: never beside other tests
def test_tune_under_torchrun_shares_the_layers(two, tmp_path):
    """``torchrun --nproc-per-node 2 -m convforge.cli tune ...``: each rank tunes its share on its
    GPU into the shared database (one host), rank 0 prints every layer; the choices are the
    one-GPU run's."""
    specs = [a for s in TUNE_SPECS for a in ("--spec", s)]
    args = ["-m", "convforge.cli", "tune", *specs, "--budget", "10", "--backend", "cuda"]
    env = _env(tmp_path)
    _run([sys.executable, *args, "--db", str(tmp_path / "one.sqlite"), "--device", "0"], env)
    out = _torchrun([*args, "--db", str(tmp_path / "many.sqlite")], env)
    assert "rank 0 of 2" in out and "rank 1 of 2" in out, out
    assert f"{len(TUNE_SPECS)} layer(s) tuned, 0 from the database, 0 failed" in out, out
    _chosen_like(tmp_path / "one.sqlite", tmp_path / "many.sqlite")


@pytest.mark.serial  # every GPU, and timings compared: never beside other tests
def test_tune_model_on_every_gpu_leaves_nothing_to_the_last_pass(two, tmp_path):
    """``tune --model resnet18:2 --devices all``: the discovered layers are tuned on both GPUs; the
    closing one-process run finds every one in the database (none tuned there, none left to the
    heuristic), so the discovery saw what dispatch asks for."""
    pytest.importorskip("torchvision", reason="tune --model needs torchvision")
    out = _run([sys.executable, "-m", "convforge.cli", "tune", "--model", "resnet18:2", "--budget", "3",
                "--devices", "all", "--db", str(tmp_path / "m.sqlite")], _env(tmp_path))
    per = _per_worker(out)
    assert set(per) == {"cuda:0", "cuda:1"} and min(per.values()) > 0, out
    assert "tuned now" not in out and "heuristic" not in out.split("layers per worker:")[1], out
