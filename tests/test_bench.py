"""convforge bench: suites, user files, ceilings, baselines without torch, and a PoCL run end to end."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from convforge.bench import baselines, ceilings, report, suites
from convforge.bench.runner import Row, attach_baseline
from convforge.bench.timing import check_slice, rotation_sets
from convforge.plan import DeviceInfo
from convforge.spec import ConvSpec

TINY = [
    {"name": "tiny3x3", "N": 2, "C": 3, "H": 13, "W": 11, "K": 5, "R": 3, "S": 3, "stride": 1, "pad": 1},
    {"N": 1, "C": 4, "H": 9, "W": 9, "K": 3, "R": 1, "S": 1, "stride": [2, 1], "pad": [0, 0]},
]


# -- suites -------------------------------------------------------------------------------------
def test_builtin_sizes() -> None:
    assert [len(suites.load_suite(s)) for s in ("resnet", "boda", "mec")] == [16, 43, 12]


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
    from convforge.bench.timing import Timing

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
    code = ("import sys, convforge.bench.command, convforge.bench.runner, convforge.bench.plots; "
            "bad = [m for m in ('torch', 'pyopencl', 'cupy') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- PoCL --------------------------------------------------------------------------------------
def test_ceilings_opencl(ocl) -> None:  # type: ignore[no-untyped-def]
    c = ceilings.measure(ocl, quick=True)
    assert c.ffma_tflops > 0 and c.copy_gbs > 0 and c.copy_bytes > 0
    assert "FFMA" in str(c)


def test_bench_pocl_end_to_end(ocl, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from convforge.cli import main

    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(TINY))
    out = tmp_path / "out"
    rc = main(["bench", "--suite", str(f), "--backend", "opencl", "--algo", "direct", "--algo", "auto",
               "--out", str(out), "--quick-ceilings", "--repeats", "2", "--warmup", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "no baseline" in text and "ceilings (opencl)" in text and "tiny3x3" in text
    doc = json.loads((out / "results.json").read_text())
    assert doc["env"]["device"] and doc["ceilings"]["opencl"]["ffma_tflops"] > 0
    rows = doc["rows"]
    assert {r["layer"] for r in rows} == {"tiny3x3", "layer2"}
    for r in rows:
        assert r["ok"] is True and r["rel_err"] < 1e-5 and r["time_ms"] > 0 and r["tflops"] > 0
    with (out / "results.csv").open() as fh:
        lines = list(csv.DictReader(fh))
    assert len(lines) == len(rows) and all(x["device"] == doc["env"]["device"] for x in lines)
    assert all(x["rel_err"] for x in lines)
    for png in ("tflops.png", "speedup.png", "workspace.png", "roofline.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


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
    assert "nosuch.json" in capsys.readouterr().out


def test_reports_and_plots_with_baselines(tmp_path: Path) -> None:
    """JSON, CSV and all four plots from synthetic GPU-like rows (cuDNN algorithms, other precisions)."""
    from convforge.bench import plots

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
