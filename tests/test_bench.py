"""convforge bench: suites, user files, ceilings, baselines without torch, and a PoCL run end to end."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from convforge.apps.bench import baselines, bench_command, ceilings, report, runner, suites
from convforge.apps.bench.baselines import BaselineResult
from convforge.apps.bench.runner import Row, attach_baseline
from convforge.apps.bench.timing import check_slice, rotation_sets
from convforge.plan import DeviceInfo
from convforge.spec import ConvSpec

TINY = [
    {"name": "tiny3x3", "N": 2, "C": 3, "H": 13, "W": 11, "K": 5, "R": 3, "S": 3, "stride": 1, "pad": 1},
    {"N": 1, "C": 4, "H": 9, "W": 9, "K": 3, "R": 1, "S": 1, "stride": [2, 1], "pad": [0, 0]},
]


# -- suites -------------------------------------------------------------------------------------
def test_builtin_sizes() -> None:
    assert [len(suites.load_suite(s)) for s in ("resnet", "boda", "mec")] == [16, 43, 12]



def test_vgg16_suite_is_the_networks_thirteen_convolutions():
    """The vgg16 suite: torchvision VGG-16's configuration D at N=16, each distinct 3x3 conv once with its
    count in the name ('x2': two such layers), 13 in all."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    convs, c, h = [], 3, 224
    for v in cfg:
        if v == "M":
            h //= 2
        else:
            convs.append((c, v, h))
            c = v
    layers = suites.load_suite("vgg16")
    count = {}
    for layer in layers:
        s = layer.spec
        assert (s.n, s.r, s.s, s.stride, s.pad) == (16, 3, 3, (1, 1), (1, 1, 1, 1)), layer.name
        count[(s.c, s.k, s.h)] = int(layer.name.rsplit(" x", 1)[1])
    assert sum(count.values()) == len(convs) == 13
    assert count == {shape: convs.count(shape) for shape in convs}

def test_resnet_shapes() -> None:
    specs = [layer.spec for layer in suites.load_suite("resnet")]
    got = {(s.n, s.c, s.h, s.k) for s in specs}
    want = {(n, c, hw, c) for n in (32, 64, 96, 128) for c, hw in ((64, 56), (128, 28), (256, 14), (512, 7))}
    assert got == want
    assert all((s.r, s.s, s.stride, s.pad) == (3, 3, (1, 1), (1, 1, 1, 1)) for s in specs)
    assert all((s.p, s.q) == (s.h, s.w) for s in specs)


def test_boda_shapes() -> None:
    layers = suites.load_suite("boda")
    specs = {layer.name: layer.spec for layer in layers}
    assert len(specs) == 43 and all(s.n == 5 for s in specs.values())
    assert len({s.key() for s in specs.values()}) == 43  # no duplicate operation
    c1 = specs["alexnet/conv1"]
    assert (c1.c, c1.h, c1.k, c1.r, c1.stride, c1.pad, c1.p) == (3, 227, 96, 11, (4, 4), (0,) * 4, 55)
    fc6 = specs["alexnet/fc6"]
    assert (fc6.h, fc6.r, fc6.k, fc6.pad, fc6.p) == (6, 6, 4096, (0,) * 4, 1)
    g1 = specs["googlenet/conv1_7x7_s2"]
    assert (g1.pad, g1.p) == ((3,) * 4, 112)
    kinds = {(s.r, s.c, s.h) for n, s in specs.items() if "inception" in n}
    assert {r for r, _, _ in kinds} == {1, 3, 5}
    assert (1, 832, 7) in kinds  # the 7x7x832 layers
    for s in specs.values():  # stride-1 odd kernels keep the size
        if s.stride == (1, 1) and s.r % 2 == 1:
            assert (s.p, s.q) == (s.h, s.w)


def test_mec_shapes() -> None:
    specs = {layer.name: layer.spec for layer in suites.load_suite("mec")}
    assert list(specs) == [f"cv{i}" for i in range(1, 13)]
    assert all(s.n == 128 and s.pad == (0,) * 4 for s in specs.values())
    assert (specs["cv2"].h, specs["cv2"].r, specs["cv2"].stride, specs["cv2"].p) == (231, 11, (4, 4), 56)
    assert (specs["cv12"].c, specs["cv12"].k, specs["cv12"].p) == (512, 512, 5)


def test_limit() -> None:
    assert [x.name for x in suites.load_suite("boda", 2)] == ["alexnet/conv1", "alexnet/conv2"]
    with pytest.raises(suites.SuiteError, match="limit"):
        suites.load_suite("boda", 0)


# -- user files ---------------------------------------------------------------------------------
def test_user_file_good(tmp_path: Path) -> None:
    f = tmp_path / "mine.json"
    rows = TINY + [{"N": 1, "C": 2, "H": 9, "W": 9, "K": 2, "R": 3, "S": 3, "stride": 1, "pad": 2,
                    "dilation": [2, 1]}]
    f.write_text(json.dumps(rows))
    layers = suites.load_suite(str(f))
    assert [x.name for x in layers] == ["tiny3x3", "layer2", "layer3"]
    assert layers[1].spec.stride == (2, 1) and layers[2].spec.dilation == (2, 1)
    assert layers[0].spec == ConvSpec.make(2, 3, 13, 11, 5, 3, 3, 1, 1)


@pytest.mark.parametrize("bad, match", [
    ({"N": 1, "C": 1, "H": 5, "W": 5, "K": 1, "R": 3, "S": 3, "stride": 1}, "missing key.*pad"),
    ({"N": 1, "C": 1, "H": 5, "W": 5, "K": 1, "R": 3, "S": 3, "stride": 1, "pad": [1, 1, 1]}, "'pad'"),
    ({"N": "1", "C": 1, "H": 5, "W": 5, "K": 1, "R": 3, "S": 3, "stride": 1, "pad": 0}, "'N'"),
    ({"N": 1, "C": 1, "H": 2, "W": 2, "K": 1, "R": 5, "S": 5, "stride": 1, "pad": 0}, "larger than"),
    ({"N": 1, "C": 1, "H": 5, "W": 5, "K": 1, "R": 3, "S": 3, "stride": 1, "pad": 0, "bias": 1}, "unknown"),
    ({"N": 0, "C": 1, "H": 5, "W": 5, "K": 1, "R": 3, "S": 3, "stride": 1, "pad": 0}, "N"),
    ([1, 2, 3], "JSON object"),
])
def test_user_file_bad_row_named(tmp_path: Path, bad: object, match: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(json.dumps([TINY[0], bad]))
    with pytest.raises(suites.SuiteError, match=match) as info:
        suites.load_suite(str(f))
    assert "row #2" in str(info.value) and "bad.json" in str(info.value)


def test_user_file_not_json(tmp_path: Path) -> None:
    f = tmp_path / "broken.json"
    f.write_text("[{")
    with pytest.raises(suites.SuiteError, match="not valid JSON"):
        suites.load_suite(str(f))
    with pytest.raises(suites.SuiteError, match="cannot read"):
        suites.load_suite(str(tmp_path / "missing.json"))


# -- timing rules, baselines, report pieces ----------------------------------------------------------
def test_rotation_and_slice() -> None:
    gpu = DeviceInfo("cuda", "g", l2_bytes=50 << 20)
    small = ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1)
    big = ConvSpec.make(128, 64, 56, 56, 64, 3, 3, 1, 1)
    assert rotation_sets(small, gpu) > 1 and rotation_sets(big, gpu) == 1
    assert rotation_sets(small, DeviceInfo("opencl", "cpu", is_gpu=False)) == 1
    assert check_slice(ConvSpec.make(2, 3, 13, 13, 5, 3, 3)) is None
    assert 1 <= (check_slice(big) or 0) < big.n


def test_baselines_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(baselines, "torch_available", lambda: False)
    assert "not installed" in (baselines.unavailable("torch", "opencl") or "")
    assert "not installed" in (baselines.unavailable("cudnn", "cuda") or "")
    spec = ConvSpec.make(1, 1, 5, 5, 1, 3, 3)
    from convforge.apps.bench.timing import Timing

    assert baselines.run("cudnn", spec, Timing(), True) == []
    assert baselines.primary([]) is None and baselines.best_fp32([]) is None
    assert baselines.versions() == {"torch": "", "cudnn": ""}


def test_cudnn_best_and_speedup() -> None:
    res = [baselines.BaselineResult("torch-pick", "pick", "fp32", 2.0),
           baselines.BaselineResult("cudnn:FFT_TILING", "FFT_TILING", "fp32", 1.0, 4096),
           baselines.BaselineResult("cudnn:WINOGRAD", "WINOGRAD", "fp32", None, status="NOT_SUPPORTED"),
           baselines.BaselineResult("torch-fp16-cl", "pick", "fp16", 0.1)]
    best = baselines.best_fp32(res)
    assert best is not None and (best.impl, best.algo, best.time_ms) == ("cudnn-best", "FFT_TILING", 1.0)
    rows = [Row("l", 1, "convforge:auto", "opencl", "direct(x)", "fp32", 0.5, ok=False, rel_err=1.0)]
    attach_baseline(rows, best)
    assert rows[0].speedup == pytest.approx(2.0)
    console = Console(width=200, record=True)
    console.print(report.layer_table(rows))
    text = console.export_text()
    assert "FAIL" in text and "FFT_TILING" in text and "[opencl]" in text


def test_no_vendor_import() -> None:
    """Importing bench must import neither torch nor pyopencl (CUDA machines lack pyopencl)."""
    code = ("import sys, convforge.apps.bench.bench_command, convforge.apps.bench.runner, convforge.apps.bench.plots; "
            "bad = [m for m in ('torch', 'pyopencl', 'cupy') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- PoCL --------------------------------------------------------------------------------------
def test_ceilings_opencl(ocl) -> None:  # type: ignore[no-untyped-def]
    c = ceilings.measure(ocl, quick=True)
    assert c.copy_gbs > 0 and c.copy_bytes > 0 and "FFMA" in str(c)
    # a CPU device's FFMA kernel measures PoCL's code, not the CPU: not measured there (ceilings.py)
    assert (c.ffma_tflops is None) == (not ocl.device.is_gpu) and (c.ffma_tflops or 1) > 0


def test_bench_pocl_end_to_end(ocl, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from convforge.cli import main

    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(TINY))
    out = tmp_path / "out"
    rc = main(["bench", "--suite", str(f), "--backend", "opencl", "--algo", "direct", "--algo", "auto",
               "--baseline", "none", "--out", str(out), "--quick-ceilings", "--repeats", "2", "--warmup", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "no baseline" in text and "ceilings (opencl)" in text and "tiny3x3" in text
    doc = json.loads((out / "results.json").read_text())
    assert doc["env"]["device"] and (doc["ceilings"]["opencl"]["ffma_tflops"] or 1) > 0
    rows = doc["rows"]
    assert {r["layer"] for r in rows} == {"tiny3x3", "layer2"}
    for r in rows:
        assert r["ok"] is True and r["rel_err"] < 1e-5 and r["time_ms"] > 0 and r["tflops"] > 0
    with (out / "results.csv").open() as fh:
        lines = list(csv.DictReader(fh))
    assert len(lines) == len(rows) and all(x["device"] == doc["env"]["device"] for x in lines)
    assert all(x["rel_err"] for x in lines)
    assert (out / "tflops.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "speedup.png").exists() and "no speedup.png (no baseline timed" in text  # --baseline none


def test_bench_ablation_im2win_pocl(ocl, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """--ablation im2win: one checked, timed row per layer x configuration, in the table and JSON."""
    from convforge.cli import main

    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(TINY))
    out = tmp_path / "abl"
    rc = main(["bench", "--ablation", "im2win", "--suite", str(f), "--limit", "1", "--backend",
               "opencl", "--out", str(out), "--quick-ceilings", "--repeats", "1", "--warmup", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "im2win ablation" in text and "no micro-kernel" in text
    rows = json.loads((out / "results.json").read_text())["rows"]
    labels = [r["algo"].split(":")[0] for r in rows]
    assert labels == ["all on", "no prefetch/double buffer", "no vector loads", "no micro-kernel"]
    for r in rows:
        assert r["layer"] == "tiny3x3" and r["ok"] is True and r["time_ms"] > 0
    assert "pf=0" in rows[1]["algo"] and "va=1" in rows[2]["algo"] and "tm=1" in rows[3]["algo"]


def test_bench_bad_suite_message(capsys: pytest.CaptureFixture[str]) -> None:
    from convforge.cli import main

    assert main(["bench", "--suite", "nosuch.json", "--backend", "opencl"]) == 2
    assert "nosuch.json" in capsys.readouterr().err


def test_reports_and_plots_with_baselines(tmp_path: Path) -> None:
    """JSON, CSV and all four plots from synthetic GPU-like rows (cuDNN algorithms, other precisions)."""
    from convforge.apps.bench import plots

    spec = ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1)
    base = baselines.BaselineResult("cudnn-best", "FFT_TILING", "fp32", 1.0, 1 << 20, 1e-6)
    rows = []
    for i, name in enumerate(("a", "b")):
        conv = Row(name, i + 1, "convforge:auto", "cuda", "winograd(x)", "fp32", 0.8, workspace_bytes=1 << 22,
                   rel_err=1e-6, ok=True, flops=spec.flops, min_bytes=1 << 24, spec=spec.to_dict())
        attach_baseline([conv], base)
        rows.append(conv)
        for impl, prec, ms in (("cudnn-best", "fp32", 1.0), ("cudnn:GEMM", "fp32", 3.0),
                               ("torch-tf32", "tf32", 0.5), ("cudnn:DIRECT", "fp32", None)):
            rows.append(Row(name, i + 1, impl, "torch", impl, prec, ms, workspace_bytes=0,
                            flops=spec.flops, min_bytes=1 << 24, spec=spec.to_dict()))
    for r in rows:
        if r.time_ms:
            r.tflops = r.flops / (r.time_ms * 1e-3) / 1e12
    ceil = {"cuda": ceilings.Ceilings(60.0, 4000.0)}
    env = {"device": "NVIDIA H200", "driver": "13000", "convforge": "0.1.0", "torch": "2.11", "cudnn": "91900"}
    report.write_json(tmp_path / "results.json", env, ceil, "resnet", rows, [])
    report.write_csv(tmp_path / "results.csv", env, rows)
    with (tmp_path / "results.csv").open() as fh:
        lines = list(csv.DictReader(fh))
    assert len(lines) == 10 and lines[0]["cudnn"] == "91900" and lines[0]["speedup"] == "1.25"
    paths = plots.write_plots(tmp_path, rows, ceil)
    assert [p.name for p in paths] == ["tflops.png", "speedup.png", "workspace.png", "roofline.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    console = Console(width=220, record=True)
    console.print(report.baseline_table(rows))
    assert "tf32" in console.export_text()


# -- precision classes: each against its own baseline ---------------------------------------------------
def test_precision_option_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    from convforge.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["bench", "--suite", "resnet"]).precision_classes is None
    assert parse(["bench", "--suite", "resnet", "--precision", "both"]).precision_classes == "both"
    assert parse(["bench", "--suite", "resnet", "--precision", "relaxed"]).precision_classes == "relaxed"
    with pytest.raises(SystemExit):
        parse(["bench", "--suite", "resnet", "--precision", "tf32"])
    assert bench_command.precisions("both") == ("fp32", "relaxed")
    assert bench_command.precisions("relaxed") == ("relaxed",)
    from convforge.config import config

    assert bench_command.precisions(None) == ("fp32",)  # the default class
    monkeypatch.setattr(config, "precision", "relaxed")  # CONVFORGE_PRECISION=relaxed
    assert bench_command.precisions(None) == ("relaxed",)


def test_error_ratio_and_attach() -> None:
    assert runner.error_ratio(3e-6, 1.5e-6) == pytest.approx(2.0)
    assert runner.error_ratio(None, 1e-6) is None and runner.error_ratio(1e-6, None) is None
    assert runner.error_ratio(1e-6, 0.0) is None  # no ratio to an exact baseline
    rows = [Row("l", 1, "convforge:auto", "cuda", "w", "relaxed", 0.5, rel_err=4e-5),
            Row("l", 1, "convforge:direct", "cuda", "d", "relaxed", 2.0, rel_err=None)]
    attach_baseline(rows, BaselineResult("cudnn-best-tf32", "IMPLICIT_GEMM", "tf32", 1.0, 0, 2e-4))
    assert (rows[0].baseline_error, rows[0].error_ratio, rows[0].speedup) == (2e-4, pytest.approx(0.2), 2.0)
    assert rows[1].baseline_error == 2e-4 and rows[1].error_ratio is None
    assert rows[1].speedup == pytest.approx(0.5)


def _gpu_results() -> list[BaselineResult]:
    """A GPU layer's baseline results: FP32 (FMA) and TF32 (default math) cuDNN rows, context rows."""
    r = BaselineResult
    return [r("torch-pick", "pick", "fp32", 2.0, 0, 1e-6),
            r("cudnn:FFT_TILING", "FFT_TILING", "fp32", 1.0, 4096, 3e-7),
            r("cudnn:WINOGRAD", "WINOGRAD", "fp32", None, status="NOT_SUPPORTED"),
            r("im2col+cublas", "torch, cuDNN off", "fp32", 0.9, 0, 1e-6),  # context, no candidate
            r("torch-tf32", "pick, TF32", "tf32", 0.6, 0, 2.6e-4),
            r("cudnn-tf32:IMPLICIT_PRECOMP_GEMM", "IMPLICIT_PRECOMP_GEMM", "tf32", 0.4, 1024, 2.5e-4),
            r("cudnn-tf32:FFT_TILING", "FFT_TILING", "tf32", 1.1, 4096, 3e-7),
            r("torch-fp16-cl", "pick", "fp16", 0.1, 0, 3e-4)]  # context, in no class


def test_best_per_class() -> None:
    res = _gpu_results()
    fp32, tf32 = baselines.best_fp32(res), baselines.best_tf32(res)
    assert fp32 == BaselineResult("cudnn-best", "FFT_TILING", "fp32", 1.0, 4096, 3e-7)
    assert tf32 == BaselineResult("cudnn-best-tf32", "IMPLICIT_PRECOMP_GEMM", "tf32", 0.4, 1024, 2.5e-4)
    # PyTorch's TF32 pick wins when it is the fastest; FP32 rows are never TF32 candidates
    faster = [BaselineResult("torch-tf32", "pick", "tf32", 0.3, 0, 2e-4)] + res
    assert baselines.best_tf32(faster) == BaselineResult("cudnn-best-tf32", "pick", "tf32", 0.3, 0, 2e-4)
    only_fp32 = [r for r in res if not r.impl.startswith("cudnn-tf32:")]
    assert baselines.best_tf32(only_fp32) is None  # no default-math cuDNN rows: no cuDNN-best TF32


def test_for_class_picks_each_class_baseline() -> None:
    res = _gpu_results()
    with_best = [b for b in (baselines.best_fp32(res), baselines.best_tf32(res)) if b] + res
    fp32, relaxed = baselines.for_class(with_best, "fp32"), baselines.for_class(with_best, "relaxed")
    assert fp32 is not None and (fp32.impl, fp32.precision, fp32.time_ms) == ("cudnn-best", "fp32", 1.0)
    assert relaxed is not None and (relaxed.impl, relaxed.precision) == ("cudnn-best-tf32", "tf32")
    assert relaxed.time_ms == 0.4 and baselines.primary(with_best) == fp32
    # --baseline torch on a GPU: PyTorch's own picks, TF32 for the relaxed class
    picks = [r for r in res if not r.impl.startswith("cudnn")]
    assert baselines.for_class(picks, "fp32").impl == "torch-pick"  # type: ignore[union-attr]
    assert baselines.for_class(picks, "relaxed").impl == "torch-tf32"  # type: ignore[union-attr]
    # a TF32 run that failed leaves the relaxed class without a baseline, never with the FP32 one
    failed = [BaselineResult("torch-tf32", "pick", "tf32", None, status="failed")] + picks[:1]
    assert baselines.for_class(failed, "relaxed") is None
    # PyTorch on a CPU has no TF32: both classes compare with its FP32 result
    cpu = [BaselineResult("torch-cpu", "torch CPU", "fp32", 30.0, 0, 9e-8)]
    assert baselines.for_class(cpu, "relaxed") == baselines.for_class(cpu, "fp32") == cpu[0]
    assert baselines.for_class([], "relaxed") is None
    with pytest.raises(ValueError, match="precision"):
        baselines.for_class(res, "tf32")


def test_runner_routes_the_choice_through_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' and named algorithms go to convforge.dispatch with the row's class."""
    from convforge import dispatch
    from convforge.dispatch import Choice
    from convforge.kernels import get_variant
    from convforge.params import Params

    seen = []

    def fake(spec: ConvSpec, be: object, epilogue: object = None, **kw: object) -> Choice:
        seen.append(kw)
        return Choice(get_variant("direct"), Params(), 1e-7, "db")

    monkeypatch.setattr(dispatch, "choose", fake)
    spec = ConvSpec.make(1, 4, 9, 9, 4, 3, 3, padding=1)
    variant, _params, how = runner.choose("auto", spec, object(), "relaxed")  # type: ignore[arg-type]
    assert (variant.name, how) == ("direct", "db")
    runner.choose("winograd", spec, object())  # type: ignore[arg-type]
    assert seen == [{"algo": "auto", "precision": "relaxed"}, {"algo": "winograd", "precision": "fp32"}]


class _NominalBackend:
    """Only what dispatch's choice reads: a name and a DeviceInfo (no device needed)."""

    def __init__(self, device: DeviceInfo) -> None:
        self.name, self.device = device.backend, device


def test_relaxed_heuristic_picks_big_winograd_on_gpu_resnet(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """No tuned entry (an empty database): on a nominal H100-class device (sm_90) the relaxed class
    takes the wgmma implicit GEMM on the ResNet layers, in scaled FP16 since round 33 (every layer of the
    suite is >= 7 GFLOP; H100: 1.47x cuDNN-best TF32, TF32 1.22x); on an Ampere-class device (no
    wgmma) Winograd F(6x6)/F(7x7) (the staged TF32 F(2x2) on 7x7 images). The fp32 class keeps to
    fp32-class variants."""
    from conftest import NOMINAL_CUDA
    from convforge import dispatch
    from convforge.config import config

    monkeypatch.setattr(config, "db_path", tmp_path / "empty.sqlite")
    monkeypatch.setattr(config, "autotune", False)
    monkeypatch.setattr(config, "max_error", None)
    ampere = DeviceInfo("cuda", "nominal sm_80", cc=(8, 0), shared_optin_bytes=163 * 1024, units=108)
    for dev in (NOMINAL_CUDA, ampere):
        dispatch.clear_choices()
        be = _NominalBackend(dev)
        # the suite's four shapes at its smallest and largest batch (N 64 and 96 repeat them in between)
        for layer in (x for x in suites.load_suite("resnet") if x.spec.n in (32, 128)):
            relaxed = dispatch.choose(layer.spec, be, precision="relaxed")  # type: ignore[arg-type]
            assert relaxed.source == "heuristic", layer.name
            # the staged TF32 F(2x2) leads there (tensorcore/sm80/mma_staged.py)
            small = layer.spec.p * layer.spec.q <= 100
            want = ("tc_implicit_gemm_sf16",) if dev.cc == (9, 0) else ("_f2_pipe_tf32",) if small else ("_f6", "_f7")
            assert relaxed.variant.name.endswith(want), (dev.name, layer.name, relaxed.variant.name)
            assert relaxed.variant.precision == "relaxed"
            fp32 = dispatch.choose(layer.spec, be, precision="fp32")  # type: ignore[arg-type]
            assert fp32.variant.precision == "fp32", (layer.name, fp32.variant.name)
    dispatch.clear_choices()


def test_bench_layer_gives_each_class_its_baseline(ocl, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Both classes on PoCL with GPU-like baseline results: fp32 rows against cuDNN-best FP32, relaxed
    rows against cuDNN-best TF32, each with both errors and their ratio; baselines run once, for both."""
    calls = []

    def fake_run(kind: str, spec: ConvSpec, timing: object, on_gpu: bool,
                 classes: tuple[str, ...] = ("fp32",)) -> list[BaselineResult]:
        calls.append(classes)
        res = _gpu_results()
        return [b for b in (baselines.best_fp32(res), baselines.best_tf32(res)) if b] + res

    monkeypatch.setattr(baselines, "run", fake_run)
    layer = suites.parse_row(TINY[0], "test")
    cfg = runner.BenchConfig(("auto",), "cudnn", 1, 1, None, 0, ("fp32", "relaxed"))
    rows = runner.bench_layer(layer, 1, [ocl], cfg, {}, False)
    assert calls == [("fp32", "relaxed")]
    ours = [r for r in rows if r.impl.startswith("convforge")]
    assert [r.precision for r in ours] == ["fp32", "relaxed"]
    for r, (impl, err) in zip(ours, (("cudnn-best", 3e-7), ("cudnn-best-tf32", 2.5e-4))):
        assert r.ok and r.baseline_impl == impl and r.baseline_error == err
        assert r.rel_err is not None and r.error_ratio == pytest.approx(r.rel_err / err)
    assert {r.impl for r in rows if not r.impl.startswith("convforge")} >= {"cudnn-best", "cudnn-best-tf32"}


def test_reports_carry_class_and_errors(tmp_path: Path) -> None:
    """Titles name class and baseline; JSON/CSV carry precision, baseline_error, error_ratio; the
    per-class summary is the geometric mean of speed-ups and error ratios."""
    rows = []
    for prec, base, errs in (("fp32", ("cudnn-best", "fp32", 1e-6), (2e-6, 8e-6)),
                             ("relaxed", ("cudnn-best-tf32", "tf32", 2e-4), (5e-5, 2e-4))):
        ref = BaselineResult(base[0], "ALGO", base[1], 1.0, 0, base[2])
        for i, (err, ms) in enumerate(zip(errs, (0.5, 2.0))):
            row = Row(f"l{i}", i + 1, "convforge:auto", "cuda", "v", prec, ms, rel_err=err, ok=True,
                      spec=ConvSpec.make(1, 4, 9, 9, 4, 3, 3).to_dict())
            attach_baseline([row], ref)
            rows.append(row)
    slow = Row("l0", 1, "convforge:direct", "cuda", "d", "fp32", 4.0, rel_err=1e-7, ok=True)
    attach_baseline([slow], BaselineResult("cudnn-best", "ALGO", "fp32", 1.0, 0, 1e-6))
    failed = Row("l1", 2, "convforge:direct", "cuda", "-", "fp32", None, ok=False, status="error: x")
    rows = rows[:2] + [slow, failed] + rows[2:]
    s = report.summary(rows)
    assert list(s) == ["fp32", "relaxed"]
    assert s["fp32"]["layers"] == 2 and s["fp32"]["failed"] == 1 and s["fp32"]["n_speedup"] == 2
    assert s["fp32"]["by_impl"]["convforge:direct [cuda]"]["speedup_geomean"] == pytest.approx(0.25)
    assert s["fp32"]["speedup_geomean"] == pytest.approx(1.0)  # 2x and 0.5x
    assert s["fp32"]["error_ratio_geomean"] == pytest.approx(4.0)  # 2 and 8
    assert s["relaxed"]["error_ratio_geomean"] == pytest.approx(0.5)  # 0.25 and 1
    assert s["relaxed"]["baseline"] == "cudnn-best-tf32"
    lines = report.summary_lines(rows)
    assert lines[0].startswith("fp32 class vs cuDNN-best FP32") and "error ratio 4.00" in lines[0]
    assert lines[1].startswith("  convforge:auto [cuda]") and lines[2].startswith("  convforge:direct [cuda]")
    assert "speed-up 0.25x over 1 layer(s)" in lines[2] and "1 fp32-class convforge row(s) failed" in lines[3]
    assert lines[4].startswith("relaxed class vs cuDNN-best TF32") and "speed-up 1.00x" in lines[4]
    assert len(lines) == 5
    console = Console(width=250, record=True)
    console.print(report.layer_table(rows, report.class_title("relaxed", rows, "suite"), "relaxed"))
    text = console.export_text()
    assert "relaxed class vs cuDNN-best TF32 — suite" in text and "baseline err" in text
    assert "fp32 " not in text and "0.25" in text  # only the class's rows, the error ratio shown
    report.write_json(tmp_path / "results.json", {"device": "d"}, {}, "s", rows, [])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["precisions"] == ["fp32", "relaxed"] and doc["summary"]["fp32"]["error_ratio_geomean"] > 3.9
    assert doc["rows"][4]["precision"] == "relaxed" and doc["rows"][4]["baseline_error"] == 2e-4
    report.write_csv(tmp_path / "results.csv", {"device": "d"}, rows)
    with (tmp_path / "results.csv").open() as fh:
        lines_csv = list(csv.DictReader(fh))
    assert [x["precision"] for x in lines_csv] == ["fp32"] * 4 + ["relaxed"] * 2
    assert float(lines_csv[0]["error_ratio"]) == pytest.approx(2.0)
    assert float(lines_csv[5]["baseline_error"]) == pytest.approx(2e-4)


@pytest.mark.parametrize("baseline", ["none", "torch"])
def test_bench_precision_both_pocl(ocl, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
                                   monkeypatch: pytest.MonkeyPatch, baseline: str) -> None:
    """`bench --precision both` on PoCL runs both classes, labels every table and row, and writes
    the per-class summary; --baseline torch works without torch (this machine, CI)."""
    from convforge.cli import main

    monkeypatch.setattr(baselines, "torch_available", lambda: False)
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(TINY[:1]))
    out = tmp_path / "out"
    rc = main(["bench", "--suite", str(f), "--backend", "opencl", "--precision", "both", "--baseline", baseline,
               "--out", str(out), "--quick-ceilings", "--repeats", "1", "--warmup", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "fp32 class vs no baseline available" in text and "relaxed class vs no baseline available" in text
    assert ("not installed" if baseline == "torch" else "no baseline requested") in text
    doc = json.loads((out / "results.json").read_text())
    assert doc["precisions"] == ["fp32", "relaxed"] and set(doc["summary"]) == {"fp32", "relaxed"}
    rows = doc["rows"]
    assert [r["precision"] for r in rows] == ["fp32", "relaxed"]
    for r in rows:
        assert r["ok"] is True and r["rel_err"] < 1e-3 and r["time_ms"] > 0
        assert r["baseline_error"] is None and r["error_ratio"] is None
    with (out / "results.csv").open() as fh:
        assert [x["precision"] for x in csv.DictReader(fh)] == ["fp32", "relaxed"]


def test_bench_torch_cpu_baseline_both_classes(ocl, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """With PyTorch installed (CPU): both classes compare with torch-cpu, error ratio filled."""
    pytest.importorskip("torch", reason="PyTorch is not installed: the CPU baseline cannot run")
    from convforge.cli import main

    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(TINY[:1]))
    out = tmp_path / "out"
    rc = main(["bench", "--suite", str(f), "--backend", "opencl", "--precision", "both", "--baseline", "torch",
               "--out", str(out), "--quick-ceilings", "--repeats", "1", "--warmup", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = json.loads((out / "results.json").read_text())["rows"]
    ours = [r for r in rows if r["impl"].startswith("convforge")]
    assert [r["precision"] for r in ours] == ["fp32", "relaxed"]
    for r in ours:
        assert r["baseline_impl"] == "torch-cpu" and 0 < r["baseline_error"] < 1e-5
        assert r["error_ratio"] == pytest.approx(r["rel_err"] / r["baseline_error"])
    assert "fp32 class vs torch-cpu" in text and "geometric-mean error ratio" in text


def test_torch_flags_restored() -> None:
    """Baselines never leave TF32, cudnn.benchmark or cudnn.enabled changed, errors included."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    switches = baselines._tf32_switches(torch)
    before = [getattr(obj, attr) for obj, attr, _on, _off in switches]
    flags = (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark)
    with pytest.raises(RuntimeError, match="boom"), baselines.torch_flags() as set_flags:
        set_flags(tf32=True, enabled=False, benchmark=not flags[1])
        assert [getattr(o, a) for o, a, _on, _off in switches] == [on for _o, _a, on, _off in switches]
        assert torch.backends.cudnn.enabled is False
        set_flags(tf32=False)
        assert [getattr(o, a) for o, a, _on, _off in switches] == [off for _o, _a, _on, off in switches]
        raise RuntimeError("boom")
    assert [getattr(obj, attr) for obj, attr, _on, _off in switches] == before
    assert (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark) == flags


def _benchmarks_md():  # type: ignore[no-untyped-def]
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "benchmarks_md.py"
    spec = importlib.util.spec_from_file_location("benchmarks_md", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmarks_md_one_table_per_class(tmp_path: Path) -> None:
    """scripts/benchmarks_md.py: every title names the class and its baseline, errors side by side;
    results from before precision classes are labelled by their measured errors."""
    md = _benchmarks_md()
    spec = ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1)
    res = _gpu_results()
    best = {"fp32": baselines.best_fp32(res), "relaxed": baselines.best_tf32(res)}
    rows = []
    for prec, (algo, ms, err) in (("fp32", ("winograd_nonfused_f4(x)", 0.8, 1.5e-6)),
                                  ("relaxed", ("winograd_nonfused_f7(x)", 0.5, 5e-5))):
        row = Row("a", 1, "convforge:auto", "cuda", algo, prec, ms, rel_err=err, ok=True, flops=spec.flops,
                  workspace_bytes=1 << 20, spec=spec.to_dict())
        attach_baseline([row], best[prec])
        rows.append(row)
    for b in [best["fp32"], best["relaxed"]] + res:
        assert b is not None
        rows += runner.baseline_rows(suites.Layer("a", spec), 1, [b], None)
    for r in rows:
        r.tflops = r.flops / (r.time_ms * 1e-3) / 1e12 if r.time_ms else None
    report.write_json(tmp_path / "results.json", {"device": "NVIDIA H200", "time": "2026-11-23"}, {},
                      "resnet", rows, [])
    text = md.table(tmp_path)
    titles = [line for line in text.splitlines() if line.startswith("###")]
    assert titles == ["### resnet — fp32 class vs cuDNN-best FP32 — NVIDIA H200 (2026-11-23)",
                      "### resnet — relaxed class vs cuDNN-best TF32 — NVIDIA H200 (2026-11-23)"]
    fp32_row, relaxed_row = [line for line in text.splitlines() if line.startswith("| a |")]
    assert "(FFT_TILING)" in fp32_row and "1.25×" in fp32_row and "| 1.5e-06 | 3.0e-07 | 5.00 |" in fp32_row
    assert "(IMPLICIT_PRECOMP_GEMM)" in relaxed_row and "0.80×" in relaxed_row
    assert "| 5.0e-05 | 2.5e-04 | 0.20 |" in relaxed_row and "1.20×" in relaxed_row  # vs torch-tf32 0.6 ms
    assert "relaxed class: geometric-mean speed-up of the best convforge variant **0.80×**" in text
    assert "error ratio **5.00**" in text and "error ratio **0.20**" in text
    # results written before precision classes: no "precisions" key, class told by measured errors
    doc = json.loads((tmp_path / "results.json").read_text())
    del doc["precisions"]
    doc["rows"] = [r for r in doc["rows"] if r["precision"] != "relaxed"]
    (tmp_path / "results.json").write_text(json.dumps(doc))
    assert "fp32 class (by its measured errors" in md.table(tmp_path)
    doc["rows"][0]["rel_err"] = 3e-5
    (tmp_path / "results.json").write_text(json.dumps(doc))
    assert "relaxed class (old default, errors up to 1e-3" in md.table(tmp_path)


def test_tf32_override_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    assert baselines.tf32_note("cudnn", ("fp32", "relaxed")) is None
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    assert "without TF32" in (baselines.tf32_note("cudnn", ("relaxed",)) or "")
    assert baselines.tf32_note("cudnn", ("fp32",)) is None and baselines.tf32_note("none", ("relaxed",)) is None


# -- GPU tier (skips here: no CUDA device) -------------------------------------------------------------
def test_gpu_cudnn_baselines_per_class(cuda) -> None:  # type: ignore[no-untyped-def]
    """On a GPU with PyTorch and cuDNN: FMA-math rows make cuDNN-best FP32, default-math rows
    cuDNN-best TF32; both have times and errors; no torch flag is left changed."""
    torch = pytest.importorskip("torch", reason="GPU tier: PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("GPU tier: PyTorch sees no CUDA device")
    from convforge.apps.bench.timing import Timing

    spec = ConvSpec.make(8, 64, 28, 28, 64, 3, 3, 1, 1)
    switches = baselines._tf32_switches(torch)
    before = ([getattr(o, a) for o, a, _on, _off in switches],
              torch.backends.cudnn.benchmark, torch.backends.cudnn.enabled)
    res = baselines.run("cudnn", spec, Timing(1, 3, 1), True, ("fp32", "relaxed"))
    after = ([getattr(o, a) for o, a, _on, _off in switches],
             torch.backends.cudnn.benchmark, torch.backends.cudnn.enabled)
    assert after == before
    by = {r.impl: r for r in res}
    fp32, tf32 = by["cudnn-best"], by["cudnn-best-tf32"]
    assert fp32.precision == "fp32" and tf32.precision == "tf32"
    assert fp32.time_ms and tf32.time_ms and fp32.rel_err is not None and tf32.rel_err is not None
    assert fp32.rel_err < 5e-6  # FMA math: FP32-grade
    tf32_rows = [r for r in res if r.impl.startswith("cudnn-tf32:")]
    assert len(tf32_rows) == 8 and all(r.precision == "tf32" for r in tf32_rows)
    assert len([r for r in res if r.impl.startswith("cudnn:")]) == 8
    assert baselines.for_class(res, "relaxed") == tf32 and baselines.for_class(res, "fp32") == fp32
    assert tf32.time_ms <= (by["torch-tf32"].time_ms or float("inf"))  # the best of, PyTorch's pick included
    assert fp32.time_ms <= (by["torch-pick"].time_ms or float("inf"))


def test_error_text_in_square_brackets_is_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Error messages are not rich markup: '[h, w]' survives (it used to print as 'an  pair')."""
    from convforge.cli import main

    f = tmp_path / "dil.json"
    f.write_text(json.dumps([{**TINY[0], "dilation": [1, 1, 1]}]))
    assert main(["bench", "--suite", str(f), "--backend", "opencl", "--baseline", "none"]) == 2
    out = capsys.readouterr().err
    assert "must be an int or an [h, w] pair of ints" in out, out


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_non_utf8_suite_file_is_named(tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from convforge.cli import main

    f = tmp_path / "junk.bin"
    f.write_bytes(b"\xec\x00\xff\xfe junk")
    with pytest.raises(suites.SuiteError, match="junk.bin: not a UTF-8 text file"):
        suites.load_suite(str(f))
    assert main([command, "--suite", str(f), "--backend", "opencl"]) == 2
    out = capsys.readouterr()
    assert "junk.bin: not a UTF-8 text file" in out.out + out.err and "Traceback" not in out.out + out.err


def test_a_wrong_baseline_row_is_never_cudnn_best():
    """A cuDNN row whose error says it computed something else (seen: a legacy BWD_DATA algorithm at
    1.17 on the H200) or NaN is left out of cuDNN-best, however fast."""
    from convforge.apps.bench.baselines import BaselineResult, best_fp32, best_tf32

    rows = [BaselineResult("torch-pick", "pick", "fp32", 2.0, 0, 4e-7),
            BaselineResult("cudnn:FAST_WRONG", "FAST_WRONG", "fp32", 0.5, 0, 1.17),
            BaselineResult("cudnn:NAN", "NAN", "fp32", 0.4, 0, float("nan")),
            BaselineResult("cudnn:OK", "OK", "fp32", 1.0, 0, 1.5e-5),
            BaselineResult("cudnn-tf32:WRONG", "WRONG", "tf32", 0.1, 0, 0.5),
            BaselineResult("cudnn-tf32:OK", "OK", "tf32", 0.3, 0, 2.6e-4)]
    best = best_fp32(rows)
    assert best is not None and best.algo == "OK" and best.time_ms == 1.0
    tf32 = best_tf32(rows)
    assert tf32 is not None and tf32.algo == "OK" and tf32.time_ms == 0.3


def test_each_side_is_timed_as_the_fastest_of_two_passes():
    """run_timed (convforge's rows) takes the fastest pass's median, as the cuDNN baselines do: a pass
    slowed as a whole (clocks, a neighbour) is charged to neither side; each pass warms up first."""
    from convforge.apps.bench.timing import PASSES, Timing, run_timed

    calls, passes = [], iter([[0.05] * 5, [0.02, 0.021, 0.5, 0.02, 0.02]])

    def timer(fn, repeats):  # type: ignore[no-untyped-def]
        assert repeats == 5
        return next(passes)

    got = run_timed(lambda: calls.append(1), lambda: None, timer, Timing(warmup=3, repeats=5))
    assert PASSES == 2 and got == 0.02 and len(calls) == 3 * PASSES
