"""Honest CPU benchmarks: the NumPy baseline (im2col + BLAS, float32) against float64 on odd shapes
of every pass, `bench` without PyTorch comparing with it, no "% peak" from the CPU's meaningless FFMA
figure, speeds in GFLOP/s where TFLOPS would round to 0, and no empty plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from convforge.apps.bench import baselines, ceilings, numpy_conv, plots, report
from convforge.apps.bench.runner import Row, attach_baseline
from convforge.apps.bench.timing import Timing
from convforge.reference import rel_l2
from convforge.spec import ConvSpec

ODD = ["N=1,C=3,H=13,W=11,K=5,R=3,S=3,pad=1",
       "N=2,C=6,H=9,W=7,K=4,R=3,S=2,stride=2,pad=0x1x2x0,groups=2",
       "N=1,C=4,H=10,W=10,K=4,R=3,S=3,groups=4,dilation=2,pad=2",
       "N=3,C=5,H=7,W=7,K=7,R=1,S=1",
       "N=1,C=2,H=5,W=13,K=3,R=5,S=1,stride=3x1,pad=2x0"]


@pytest.mark.parametrize("text", ODD)
@pytest.mark.parametrize("conv_pass", ["fprop", "dgrad", "wgrad"])
def test_numpy_baseline_matches_float64(text: str, conv_pass: str) -> None:
    spec = ConvSpec.parse(text).with_pass(conv_pass)
    a, b = numpy_conv.pass_inputs(spec, seed=3)
    out = numpy_conv.pass_fn(spec)(a, b)
    ref = numpy_conv.reference(spec, a, b)
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert rel_l2(out, ref) < 1e-5


def test_numpy_baseline_row_and_class() -> None:
    """The numpy kind gives one timed FP32 row with its error; both classes compare with it (a CPU
    has no TF32); half layers say there is none."""
    spec = ConvSpec.parse(ODD[0])
    res = baselines.run("numpy", spec, Timing(1, 2, 1), False)
    assert len(res) == 1 and res[0].impl == "numpy" and res[0].time_ms and res[0].time_ms > 0
    assert res[0].rel_err is not None and res[0].rel_err < 1e-5 and "np.matmul" in res[0].algo
    assert baselines.for_class(res, "fp32") == res[0] == baselines.for_class(res, "relaxed")
    assert baselines.unavailable("numpy", "opencl") is None
    half = baselines.run("numpy", ConvSpec.parse(ODD[0] + ",dtype=fp16"), Timing(1, 2, 1), False)
    assert half[0].time_ms is None and "no float16 baseline" in half[0].status


def _row(name: str, tflops: float | None, speedup: float | None = None, impl: str = "convforge:auto",
         ws: int | None = 0, peak: float | None = None) -> Row:
    spec = ConvSpec.parse(ODD[0])
    return Row(name, 1, impl, "opencl", "direct(x)", "fp32", 1.0, tflops=tflops, pct_peak=peak, speedup=speedup,
               workspace_bytes=ws, ok=True, flops=spec.flops, min_bytes=1000, spec=spec.to_dict())


def test_speeds_read_in_gflops_below_one_tflops() -> None:
    assert report.speed_unit([_row("a", 0.0004), _row("b", 0.02)])[0] == "GFLOP/s"
    assert report.speed_unit([_row("a", 0.5), _row("b", 3.0)])[0] == "TFLOPS"
    console = Console(width=250, record=True)
    console.print(report.layer_table([_row("a", 0.000412)], "t"))
    text = console.export_text()
    assert "GFLOP/s" in text and "0.412" in text and "TFLOPS" not in text
    assert "% peak" not in text  # no row has a peak: the column is not there


def test_no_ffma_peak_on_a_cpu_device(ocl) -> None:  # type: ignore[no-untyped-def]
    """PoCL's FFMA kernel read 0.0004 TFLOPS and layers then reached 197 % of it: not measured on a
    CPU device, so no row gets a "% peak"."""
    if ocl.device.is_gpu:
        pytest.skip("an OpenCL GPU: its FFMA ceiling is measured")
    c = ceilings.measure(ocl, quick=True)
    assert c.ffma_tflops is None and "not measured" in str(c)


def test_no_empty_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install 'convforge[plot]')")
    ceil = {"opencl": ceilings.Ceilings(None, 20.0)}
    rows = [_row("a", 0.001), _row("b", 0.002)]  # no baseline: no speed-up; no workspace; no FFMA roof
    paths = plots.write_plots(tmp_path, rows, ceil)
    assert [p.name for p in paths] == ["tflops.png"]
    why = " ".join(plots.skipped(rows, ceil))
    assert "no speedup.png (no baseline timed" in why and "no roofline.png (no FFMA ceiling" in why
    assert "no workspace.png" in why
    base = baselines.BaselineResult("numpy", "im2col", "fp32", 2.0, 0, 1e-7)
    attach_baseline(rows, base)
    names = [p.name for p in plots.write_plots(tmp_path, rows, ceil)]
    assert names == ["tflops.png", "speedup.png"] and not plots.skipped(rows, ceil)[0].startswith("no speedup")


def test_bench_without_torch_compares_with_numpy(ocl, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from convforge.cli import main

    monkeypatch.setattr(baselines, "torch_available", lambda: False)
    suite = tmp_path / "tiny.json"
    suite.write_text(json.dumps([{"name": "odd", "N": 1, "C": 3, "H": 11, "W": 9, "K": 5, "R": 3, "S": 3,
                                  "stride": 1, "pad": 1}]))
    out = tmp_path / "out"
    rc = main(["bench", "--suite", str(suite), "--backend", "opencl", "--algo", "direct", "--out", str(out),
               "--quick-ceilings", "--repeats", "2", "--warmup", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "fp32 class vs numpy" in text and "GFLOP/s" in text and "% peak" not in text, text
    doc = json.loads((out / "results.json").read_text())
    ours = [r for r in doc["rows"] if r["impl"].startswith("convforge")]
    assert ours and all(r["baseline_impl"] == "numpy" and r["speedup"] and r["pct_peak"] is None for r in ours)
    assert all(r["baseline_error"] < 1e-5 for r in ours)
    if plots.available():
        assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
