"""--pass on algos, show, tune and bench (the CLI in process, PoCL), and the training bench's
comparison and files on fake rows (no GPU)."""

from __future__ import annotations

import csv
import json
import math

import pytest

from helpers import run_main

SPEC = "N=2,C=3,H=11,W=9,K=4,R=3,S=3,stride=2,pad=1"


def test_algos_lists_the_variants_of_each_pass(ocl, capsys):
    rc, out = run_main(["algos", "--spec", SPEC, "--backend", "opencl", "--pass", "bprop"], capsys)
    assert rc == 0, out
    assert "dgrad" in out.splitlines()[0] and "+ dgrad_direct" in out and "+ direct " not in out
    only_wgrad = out.split("compute only wgrad: ")[1].split("\n")[0].split(", ")  # registration order
    assert "compute only fprop" in out and {"depthwise_wgrad", "wgrad_direct"} <= set(only_wgrad)
    rc, out = run_main(["algos", "--spec", SPEC, "--backend", "opencl", "--pass", "all"], capsys)
    heads = [line for line in out.splitlines() if line.startswith("N2 ")]
    assert rc == 0 and [h.split("  (")[0].split()[-1] for h in heads] == ["fprop", "dgrad", "wgrad"], out
    rc, out = run_main(["algos", "--spec", SPEC + ",pass=wgrad", "--backend", "opencl"], capsys)
    assert rc == 0 and "+ wgrad_direct" in out and "+ dgrad_direct" not in out


@pytest.mark.parametrize("argv, message", [
    (["algos", "--spec", SPEC, "--pass", "backward"],
     r"pass \('backward'\) must be one of fprop, dgrad, wgrad \(or all\)"),
    (["show", "--spec", SPEC, "--pass", "all", "--backend", "opencl"], r"pass \('all'\) must be one of"),
    (["show", "--spec", SPEC, "--pass", "dgrad", "--bias", "--backend", "opencl"],
     r"error: unsupported epilogue: dgrad_direct writes a gradient"),
    (["show", "--spec", SPEC, "--pass", "wgrad", "--variant", "im2win", "--backend", "opencl"],
     r"im2win does not compute wgrad"),
    (["tune", "--spec", SPEC, "--pass", "dgrad", "--bias"], r"--bias and --relu are fprop epilogues"),
    (["tune", "--net", "alexnet", "--pass", "dgrad"], r"--pass applies only with --suite / --spec"),
    (["bench", "--model", "resnet18", "--pass", "dgrad"], r"--model cannot be combined with --pass"),
    (["bench", "--suite", "resnet", "--train"], r"--train goes with --model"),
    (["bench", "--suite", "mec", "--ablation", "im2win", "--pass", "wgrad"], r"--ablation .* does not go with --pass"),
])
def test_pass_options_refuse_what_does_not_fit(argv, message, capsys):
    import re

    rc, out = run_main(argv, capsys)
    assert rc == 2 and re.search(message, out), out


def test_show_prints_the_pass_kernel(ocl, capsys):
    rc, out = run_main(["show", "--spec", SPEC, "--pass", "update", "--backend", "opencl"], capsys)
    assert rc == 0 and "wgrad_direct" in out and "__kernel" in out and " wgrad" in out.splitlines()[1], out
    rc, out = run_main(["show", "--spec", SPEC, "--pass", "dgrad", "--variant", "dgrad_direct", "--params", "bw=16",
                        "--backend", "cuda"], capsys)
    assert rc == 0 and "__global__" in out and "bw=16" in out, out


def test_tune_all_passes_then_the_database_says_which(ocl, tmp_path, capsys):
    dbp = str(tmp_path / "t.sqlite")
    rc, out = run_main(["tune", "--spec", SPEC, "--pass", "all", "--budget", "1", "--db", dbp, "--backend",
                        "opencl", "--bias"], capsys)
    assert rc == 0, out
    assert "spec1:dgrad" in out and "spec1:wgrad" in out and "3 layer(s) tuned" in out
    from convforge.tune import TuningDB

    got = {(e.spec.rsplit("_", 1)[-1], e.epilogue) for e in TuningDB(dbp).entries()}
    assert got == {("float32", "bias"), ("dgrad", "none"), ("wgrad", "none")}  # the epilogue is fprop's only
    rc, out = run_main(["db", "--db", dbp, "list", "--pass", "fprop"], capsys)
    assert rc == 0 and "1 entries" in out and "fprop" in out


def test_bench_pass_all_on_pocl(ocl, tmp_path, capsys):
    suite = tmp_path / "s.json"
    suite.write_text(json.dumps([{"name": "odd", "N": 2, "C": 3, "H": 11, "W": 9, "K": 4, "R": 3, "S": 3,
                                  "stride": 2, "pad": 1}]))
    out_dir = tmp_path / "out"
    rc, out = run_main(["bench", "--suite", str(suite), "--backend", "opencl", "--baseline", "none", "--pass", "all",
                        "--quick-ceilings", "--repeats", "2", "--warmup", "1", "--out", str(out_dir)], capsys)
    assert rc == 0, out
    doc = json.loads((out_dir / "results.json").read_text())
    rows = {r["layer"]: r for r in doc["rows"]}
    assert set(rows) == {"odd", "odd:dgrad", "odd:wgrad"}
    assert rows["odd:dgrad"]["spec"]["pass"] == "dgrad" and rows["odd:dgrad"]["algo"].startswith("dgrad_")
    assert rows["odd:wgrad"]["spec"]["pass"] == "wgrad" and rows["odd:wgrad"]["algo"].startswith("wgrad_")
    for r in rows.values():
        assert r["ok"] is True and r["rel_err"] < 1e-5 and r["time_ms"] > 0
        assert r["flops"] == rows["odd"]["flops"]  # the forward formula for every pass
    assert set(doc["summary"]) == {"fp32", "fp32/dgrad", "fp32/wgrad"}
    assert doc["summary"]["fp32/wgrad"]["pass"] == "wgrad"
    with (out_dir / "results.csv").open() as fh:
        assert sorted(r["pass"] for r in csv.DictReader(fh)) == ["dgrad", "fprop", "wgrad"]
    assert "fp32 class vs no baseline available, dgrad:" in out


def test_bench_pass_rows_get_their_pass_baseline(ocl, capsys, tmp_path):
    """With PyTorch on the CPU as the baseline (torch installed), each pass is compared with
    PyTorch's computation of that pass, its error against float64 of the same pass."""
    pytest.importorskip("torch", reason="torch not installed: the PyTorch CPU baseline is not available")
    from convforge.apps.bench import baselines
    from convforge.apps.bench.timing import Timing
    from convforge.spec import ConvSpec

    spec = ConvSpec.parse(SPEC)
    for p in ("dgrad", "wgrad"):
        res = baselines.run("torch", spec.with_pass(p), Timing(1, 2, 1), False)
        assert len(res) == 1 and res[0].time_ms and res[0].rel_err is not None and res[0].rel_err < 1e-6, res


def test_training_comparison_and_files(tmp_path):
    """Speed-ups against each class's baseline, loss deviations against PyTorch FP32's curve, the
    noise from the no-benchmark run, and the three files."""
    from convforge.apps.bench import training

    base = [2.0, 1.5, 1.2]

    def row(impl, prec, ms, curve, **kw):
        return dict(model="m", batch=2, impl=impl, precision=prec, baseline={"fp32": "pytorch_fp32",
                    "relaxed": "pytorch_tf32"}[prec], time_ms=ms, loss_curve=curve, status="ok", **kw)

    rows = [row("pytorch_fp32", "fp32", 10.0, base), row("pytorch_tf32", "relaxed", 5.0, [2.0, 1.5, 1.21]),
            row("convforge", "fp32", 5.0, [2.0, 1.5, 1.2000001]), row("convforge_fused", "fp32", 4.0, [2.0, 1.6, 1.3]),
            row("convforge", "relaxed", 4.0, [2.0, 1.5, 1.2]),
            dict(model="m", batch=2, impl="pytorch_fp32_nobench", precision="fp32", baseline="pytorch_fp32",
                 loss_curve=[2.0, 1.5, 1.200001], status="ok")]
    training.compare(rows)
    by = {(r["impl"], r["precision"]): r for r in rows}
    assert by[("convforge", "fp32")]["speedup"] == 2.0 and by[("convforge", "relaxed")]["speedup"] == 1.25
    assert by[("convforge", "fp32")]["within_noise"] is True
    assert by[("convforge_fused", "fp32")]["within_noise"] is False
    assert by[("convforge_fused", "fp32")]["loss_dev"] == pytest.approx(0.1 / 1.2)
    assert math.isclose(by[("convforge", "fp32")]["loss_noise"], 1e-6 / 1.2, rel_tol=1e-3)
    assert training.deviation([1.0, float("nan")], [1.0, 1.0]) == math.inf
    # a memorised batch's tail: differences over 1 % of the first loss where the loss fell below it
    assert training.deviation([8.0, 1.0e-4, 1.5e-4], [8.0, 1.2e-4, 1.0e-4]) == pytest.approx(5e-5 / 0.08)
    assert training.deviation([8.0, 4.4], [8.0, 4.0]) == pytest.approx(0.1)
    training.write(tmp_path, {"device": "x"}, ["note"], ("fp32", "relaxed"), False, rows)
    doc = json.loads((tmp_path / "train.json").read_text())
    assert doc["steps"] == training.STEPS and len(doc["rows"]) == 6 and doc["rows"][0]["loss_curve"] == base
    with (tmp_path / "train.csv").open() as fh:
        lines = list(csv.DictReader(fh))
    assert len(lines) == 6 and lines[2]["within_noise"] == "True"
    with (tmp_path / "train_losses.csv").open() as fh:
        table = list(csv.reader(fh))
    assert table[0][0] == "step" and len(table) == 4 and len(table[0]) == 7 and table[1][0] == "1"


def _tiny_model(monkeypatch, torch):
    """The training benches' model "tiny" (conv, batch norm, ReLU, pool, linear) and its fixed batch of 12x12
    images, in place of torchvision's models and their batches."""
    from convforge.apps.bench import models, training

    def build(name):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                   torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                   torch.nn.Linear(8, 10)).eval()

    def batch(name, n):
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, 3, 12, 12, generator=g), torch.randint(0, 10, (n,), generator=g)

    monkeypatch.setattr(models, "build", build)
    monkeypatch.setitem(models.MODELS, "tiny", 12)
    monkeypatch.setattr(training, "_batch", batch)


def test_training_bench_flow_on_cpu(monkeypatch, tmp_path):
    """bench_train's rows end to end with a tiny model on CPU tensors (torch installed; CUDA events
    and the batch replaced): every implementation and both curve rows run, the relaxed class's rows
    join the fp32 class's PyTorch rows, and the comparison fills speed-ups and loss deviations."""
    torch = pytest.importorskip("torch", reason="torch not installed: the training bench is not tested")
    from convforge.apps.bench import training


    _tiny_model(monkeypatch, torch)
    monkeypatch.setattr(training, "_samples", lambda step, n: [(step(), 2.0)[1] for _ in range(n)])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(training, "STEPS", 8)
    rows = training.bench_train("tiny", 4, 1, 2, {})
    rows += training.bench_train("tiny", 4, 1, 2, {"precision": "relaxed"}, pytorch=False)
    training.compare(rows)
    by = {(r["impl"], r["precision"]): r for r in rows}
    assert set(by) == {("pytorch_fp32", "fp32"), ("pytorch_tf32", "relaxed"), ("convforge", "fp32"),
                       ("convforge_fused", "fp32"), ("convforge", "relaxed"), ("convforge_fused", "relaxed"),
                       ("pytorch_fp32_nobench", "fp32"), ("pytorch_fp64", "fp32")}
    assert all(r["status"] == "ok" and len(r["loss_curve"]) == training.STEPS for r in rows), rows
    assert by[("convforge", "relaxed")]["baseline"] == "pytorch_tf32" and by[("convforge", "fp32")]["speedup"] == 1.0
    assert by[("convforge", "fp32")]["within_noise"] is True and by[("pytorch_fp64", "fp32")]["loss_dev"] < 1e-5
    training.write(tmp_path, {}, [], ("fp32", "relaxed"), False, rows)
    assert json.loads((tmp_path / "train.json").read_text())["rows"][0]["impl"] == "pytorch_fp32"


def test_amp_training_bench_flow_on_cpu(monkeypatch):
    """bench_amp's rows end to end with a tiny model on CPU tensors (torch installed; CUDA events, memory
    counters and the batch replaced; autocast on "cuda" is off without CUDA): the five timed rows are timed in
    interleaved rounds, each has its first step, peak memory and a loss curve; the curve-only rows join and the
    comparison fills speed-ups."""
    torch = pytest.importorskip("torch", reason="torch not installed: the AMP training bench is not tested")
    import warnings

    from convforge.apps.bench import training, training_amp


    timed: list[int] = []

    def samples(step, n):
        timed.append(id(step))
        return [(step(), 2.0)[1] for _ in range(n)]

    _tiny_model(monkeypatch, torch)
    monkeypatch.setattr(training, "_samples", samples)
    for name, value in (("synchronize", None), ("memory_allocated", 0), ("max_memory_allocated", 2**30),
                        ("reset_peak_memory_stats", None), ("memory_snapshot", [])):
        monkeypatch.setattr(torch.cuda, name, lambda value=value: value)
    monkeypatch.setattr(training_amp, "STEPS", 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast / GradScaler asked for CUDA on a machine without it
        rows = training_amp.compare(training_amp.bench_amp("tiny", 4, "fp16", 1, 6, {}))
    by = {r["impl"]: r for r in rows}
    impls = ("pytorch_amp", "pytorch_amp_graphs", "convforge_amp", "convforge_fused_amp", "convforge_fused_eager")
    assert set(by) == {*impls, "pytorch_amp_nobench", "pytorch_fp32"}
    assert all(r["status"] == "ok" and len(r["loss_curve"]) == 4 for r in rows), rows
    timed_rows = [by[i] for i in impls]
    assert all(r["peak_gib"] == 1.0 and r["first_step_s"] >= 0 and r["time_ms"] == 2.0 and r["speedup"] == 1.0
               for r in timed_rows), timed_rows
    assert len(timed) == 5 * training.ROUNDS and len(set(timed[:5])) == 5 and timed[5] == timed[1]  # rotated
