"""``convforge bench --model`` precision classes and tuning, ``tune --model`` and ``run --net
--precision``: the logic on fake rows and stubs (no GPU), the command line's parsing and errors,
and a relaxed-class network run on PoCL."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from convforge.apps.bench import models as M
from convforge.cli import main as cli_main
from convforge.config import config
from helpers import run_main


@pytest.fixture(autouse=True)
def _restore_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """cli.main sets config.precision / max_error / db_path from the arguments: put them back afterwards."""
    monkeypatch.setattr(config, "precision", config.precision)
    monkeypatch.setattr(config, "max_error", config.max_error)
    monkeypatch.setattr(config, "autotune", config.autotune)
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")


def _row(impl: str, ms: float | None, err: float | None, model: str = "resnet50", batch: int = 32) -> dict[str, Any]:
    row: dict[str, Any] = dict(model=model, batch=batch, impl=impl, status="ok", ref_spread=0.5)
    if ms is not None:
        row["time_ms"] = ms
    if err is not None:
        row["rel_err"] = err
    return row


def _pytorch_rows(model: str = "resnet50", tf32_ms: float | None = 5.0) -> list[dict[str, Any]]:
    return [_row("pytorch_fp32", 10.0, 1e-6, model), _row("pytorch_fp32_graph", 9.5, 1e-6, model),
            _row("pytorch_tf32", tf32_ms, 5e-4 if tf32_ms else None, model),
            _row("torch_compile_fp32", 12.5, 1.1e-6, model)]


def _convforge_rows(model: str, fp32: tuple[float, float], relaxed: tuple[float, float]) -> list[dict[str, Any]]:
    a = [_row("convforge", *fp32, model), _row("convforge_graph", fp32[0] / 2, fp32[1], model)]
    b = [_row("convforge", *relaxed, model), _row("convforge_fused", relaxed[0] / 2, relaxed[1], model)]
    M.label(a, {"precision": "fp32"})
    M.label(b, {"precision": "relaxed"}, tuned=True)
    return a + b


def test_each_class_is_compared_with_its_own_baseline() -> None:
    torch_rows = _pytorch_rows()
    M.label(torch_rows, {"precision": "fp32"})
    rows = M.compare(torch_rows + _convforge_rows("resnet50", (8.0, 1.5e-6), (4.0, 2e-4)))
    by = {(r["impl"], r["precision"]): r for r in rows}
    assert [(r["precision"], r["baseline"]) for r in torch_rows] == [
        ("fp32", "pytorch_fp32"), ("fp32", "pytorch_fp32"), ("relaxed", "pytorch_tf32"), ("fp32", "pytorch_fp32")]
    assert by["pytorch_fp32", "fp32"]["speedup"] == 1.0
    assert by["pytorch_tf32", "relaxed"]["speedup"] == 1.0  # the relaxed class's own baseline
    assert by["torch_compile_fp32", "fp32"]["speedup"] == pytest.approx(0.8)
    fp32, relaxed = by["convforge", "fp32"], by["convforge", "relaxed"]
    assert (fp32["baseline"], fp32["speedup"], fp32["err_vs_pytorch"]) == ("pytorch_fp32", 1.25, pytest.approx(1.5))
    assert relaxed["baseline"] == "pytorch_tf32" and relaxed["tuned"] is True and "tuned" not in torch_rows[0]
    assert relaxed["speedup"] == 1.25 and relaxed["err_vs_pytorch"] == pytest.approx(0.4)  # 5.0/4.0, 2e-4/5e-4
    assert by["convforge_graph", "fp32"]["speedup"] == 2.5
    assert by["convforge_fused", "relaxed"]["speedup"] == 2.5


def test_rows_without_a_baseline_get_no_ratio_and_models_do_not_mix() -> None:
    a, b = _pytorch_rows("resnet50", tf32_ms=None), _pytorch_rows("vgg16")  # resnet50's TF32 run failed
    b[0]["time_ms"] = 20.0
    M.label(a + b, {})
    rows = M.compare(a + b + _convforge_rows("resnet50", (8.0, 1e-6), (4.0, 2e-4))
                     + _convforge_rows("vgg16", (8.0, 1e-6), (4.0, 2e-4)))
    r50 = [r for r in rows if r["model"] == "resnet50" and r["precision"] == "relaxed"]
    assert all("speedup" not in r and "err_vs_pytorch" not in r for r in r50)
    vgg = next(r for r in rows if r["model"] == "vgg16" and r["impl"] == "convforge" and r["precision"] == "fp32")
    assert vgg["speedup"] == 2.5  # its own model's pytorch_fp32 (20 ms), not resnet50's
    failed = dict(model="alexnet", batch=1, impl="-", status="torchvision is not installed")
    assert M.compare([failed]) == [failed]


def test_label_defaults_to_the_configured_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "precision", "relaxed")
    rows = [_row("convforge", 1.0, 1e-4)]
    M.label(rows, {})
    assert (rows[0]["precision"], rows[0]["baseline"], rows[0]["tuned"]) == ("relaxed", "pytorch_tf32", False)


def _fake_bench_model(calls: list[tuple[Any, ...]]) -> Any:
    def fake(name: str, batch: int, warmup: int, repeats: int, options: dict[str, Any], *,
             pytorch: bool = True, tune: bool = False) -> list[dict[str, Any]]:
        calls.append((name, batch, dict(options), pytorch, tune))
        prec = options["precision"]
        rows = _pytorch_rows(name) if pytorch else []
        rows += [_row("convforge", 4.0 if prec == "relaxed" else 8.0, 2e-4 if prec == "relaxed" else 1e-6, name)]
        M.label(rows, options, tune)
        return M.compare(rows)

    return fake


def test_both_classes_share_one_set_of_pytorch_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(M, "bench_model", _fake_bench_model(calls))
    rows = M.bench_classes("resnet50", 32, 1, 2, {"max_error": 1e-3}, ("fp32", "relaxed"), tune=True)
    assert calls == [("resnet50", 32, {"max_error": 1e-3, "precision": "fp32"}, True, True),
                     ("resnet50", 32, {"max_error": 1e-3, "precision": "relaxed"}, False, True)]
    assert [r["impl"] for r in rows].count("pytorch_tf32") == 1
    relaxed = next(r for r in rows if r["impl"] == "convforge" and r["precision"] == "relaxed")
    assert relaxed["speedup"] == 1.25  # compared after the classes were joined


def test_run_prints_the_classes_and_writes_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(M, "bench_model", _fake_bench_model([]))
    monkeypatch.setattr(M, "_check_models", lambda specs, console: [M.parse_model(s) for s in specs])
    monkeypatch.setattr(M, "environment", lambda: {"device": "fake H200"})
    console = Console(record=True, width=250)
    rc = M.run(["resnet50:32"], str(tmp_path), 1, 2, console, {}, classes=("fp32", "relaxed"), tune=True)
    text = console.export_text()
    assert rc == 0
    assert "fp32 and relaxed classes, tuned" in text and M.TUNED_NOTE in text and M.CLASS_NOTE in text
    assert "convforge (relaxed) vs pytorch_tf32: 1.25x, err ratio 0.40" in text
    assert "convforge (fp32) vs pytorch_fp32: 1.25x" in text
    doc = json.loads((tmp_path / "models.json").read_text())
    assert doc["classes"] == ["fp32", "relaxed"] and doc["tuned"] is True
    with open(tmp_path / "models.csv") as f:
        got = [(r["impl"], r["precision"], r["baseline"]) for r in csv.DictReader(f)]
    assert ("convforge", "relaxed", "pytorch_tf32") in got and ("convforge", "fp32", "pytorch_fp32") in got
    console = Console(record=True, width=250)
    M.run(["resnet50:32"], None, 1, 2, console, {})
    assert M.UNTUNED_NOTE in console.export_text()


def test_tuning_turns_autotune_on_and_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "autotune", False)
    with M.tuning(False):
        assert config.autotune is False
    with pytest.raises(RuntimeError, match="boom"), M.tuning(True):
        assert config.autotune is True
        raise RuntimeError("boom")
    assert config.autotune is False
    monkeypatch.setattr(config, "autotune", True)
    with M.tuning(True):
        pass
    assert config.autotune is True


def test_tuned_table_names_where_each_choice_came_from() -> None:
    from convforge import kernels
    from convforge.dispatch import Choice
    from convforge.params import Params
    from convforge.plan import Epilogue
    from convforge.spec import ConvSpec

    spec = ConvSpec.make(32, 64, 56, 56, 64, 3, 3, padding=1)
    seen = [(spec, Epilogue(bias=True, relu=True), "relaxed",
             Choice(kernels.get_variant("winograd_nonfused_f7"), Params(bk=64), 3e-5, "tuned")),
            (spec, Epilogue(), "relaxed", Choice(kernels.get_variant("direct"), Params(), 1e-7, "db"))]
    console = Console(record=True, width=250)
    console.print(M.tuned_table(seen, "t"))
    text = console.export_text()
    assert "bias_relu" in text and "winograd_nonfused_f7" in text and "tuned now" in text and "database" in text


# -- the command line ---------------------------------------------------------------------------
BAD = [
    (["bench", "--model", "resnet18", "--precision", "fp16"], "invalid choice: 'fp16'"),
    (["bench", "--tune", "--suite", "resnet"], "--tune goes with --model"),
    (["bench", "--tune"], "--tune goes with --model"),
    (["bench", "--model", "resnet18", "--suite", "resnet"], "--model cannot be combined with --suite"),
    (["bench", "--model", "resnet18", "--ablation", "im2win"], "--model cannot be combined with --ablation"),
    (["bench", "--model", "resnet9", "--tune"], "model ('resnet9') must be one of"),
    (["tune", "--model", "resnet9"], "model ('resnet9') must be one of"),
    (["tune", "--model", "resnet18:0"], "must be > 0"),
    (["tune", "--model", "resnet18:x"], "must be an int"),
    (["tune", "--model", "resnet18", "--suite", "resnet"], "--model cannot be combined with --suite"),
    (["tune", "--model", "resnet18", "--net", "alexnet"], "--model cannot be combined with --net"),
    (["tune", "--model", "resnet18", "--budget", "fast"], "budget ('fast') must be"),
    (["tune", "--model", "resnet18", "--force"], "(no --force)"),
    (["tune", "--model", "resnet18", "--backend", "opencl"], "--backend opencl does not apply"),
    (["tune", "--model", "resnet18", "--precision", "both"], "invalid choice: 'both'"),
    (["run", "--net", "alexnet", "--precision", "tf32"], "invalid choice: 'tf32'"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=lambda a: " ".join(a)[:50] if isinstance(a, list) else "")
def test_bad_new_options_are_one_clear_error(argv: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(argv, capsys)
    assert rc == 2 and message in out and "Traceback" not in out, out


def test_model_commands_without_a_cuda_device_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU tier runs these")
    try:
        import torchvision  # noqa: F401
    except ImportError:
        vision = False
    else:
        vision = True
    # without torch: PyTorch is asked for; with torch but no torchvision (a CPU torch alone): torchvision is
    want = "needs PyTorch" if torch is None else "torch sees none" if vision else "needs torchvision"
    for argv in (["tune", "--model", "resnet18"], ["bench", "--model", "resnet18:2", "--precision", "both", "--tune"]):
        rc, out = run_main(argv, capsys)
        assert rc == 2 and want in out, out


def test_bench_model_options_reach_the_runner(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    got: dict[str, Any] = {}

    def fake_run(specs: list[str], out: Any, warmup: Any, repeats: Any, console: Any, options: dict[str, Any],
                 classes: tuple[str, ...] = ("fp32",), tune: bool = False) -> int:
        got.update(specs=specs, options=options, classes=classes, tune=tune)
        return 0

    monkeypatch.setattr(M, "run", fake_run)
    assert run_main(["bench", "--model", "resnet50:32", "--model", "vgg16:16", "--precision", "both", "--tune",
                  "--max-error", "1e-4"], capsys)[0] == 0
    assert got == dict(specs=["resnet50:32", "vgg16:16"], options={"max_error": 1e-4},
                       classes=("fp32", "relaxed"), tune=True)
    assert run_main(["bench", "--model", "alexnet:64", "--precision", "relaxed"], capsys)[0] == 0
    assert (got["classes"], got["tune"], got["options"]) == (("relaxed",), False, {})
    monkeypatch.setattr(config, "precision", "relaxed")  # no --precision: the configured class
    assert run_main(["bench", "--model", "alexnet"], capsys)[0] == 0 and got["classes"] == ("relaxed",)


def test_tune_model_options_reach_the_tuner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from convforge.tune import Budget

    got: dict[str, Any] = {}

    def fake(specs: list[str], console: Any, budget: Any = None) -> int:
        got.update(specs=specs, budget=budget, precision=config.precision, db=config.db_path)
        return 0

    monkeypatch.setattr(M, "tune_models", fake)
    db = tmp_path / "models.sqlite"
    assert run_main(["tune", "--model", "resnet50:32", "--precision", "relaxed", "--budget", "3s,4",
                  "--db", str(db)], capsys)[0] == 0
    assert got == dict(specs=["resnet50:32"], budget=Budget(3.0, 4), precision="relaxed", db=db)


def test_forms_offer_fused_only_when_it_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install 'convforge[torch]')")
    import torch

    import convforge.torch as ct

    assert [name for name, _ in M.forms()][:1] == ["converted"]
    monkeypatch.setattr(ct, "fuse", lambda model, **options: ("fused:" + str(options["precision"]), None),
                        raising=False)
    forms = dict(M.forms())
    assert forms["fused"](torch.nn.Identity(), precision="relaxed") == "fused:relaxed"
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))  # on the CPU: left to PyTorch, converted in place
    assert forms["converted"](model, precision="relaxed") is model
    monkeypatch.delattr(ct, "fuse")
    assert [name for name, _ in M.forms()] == ["converted"]


# -- convforge run --net --precision ---------------------------------------------------------------
NET = """
input: "data" input_shape { dim: 1 dim: 6 dim: 13 dim: 11 }
layer { name: "a" type: "Convolution" bottom: "data" top: "a"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "ra" type: "ReLU" bottom: "a" top: "a" }
layer { name: "b" type: "Convolution" bottom: "a" top: "b"
        convolution_param { num_output: 5 kernel_size: 3 pad: 1 } }
layer { name: "gp" type: "Pooling" bottom: "b" top: "gp" pooling_param { pool: AVE global_pooling: true } }
"""


def test_run_net_relaxed_on_pocl(ocl: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--precision relaxed reaches every conv of the network: a relaxed-class database entry (F(7x7),
    stored for the plain epilogue) serves the fused bias + ReLU conv "a" only in a relaxed run; the
    table and the JSON say the class, and the output is still checked against float64."""
    from convforge import kernels, tune
    from convforge.apps.run.run_command import SUMMARY_HEADER
    from convforge.plan import Epilogue
    from convforge.spec import ConvSpec
    from convforge.tune import Tuner
    from convforge.tune.db import KEY_FIELDS, Entry, TuningDB, now

    spec = ConvSpec.make(1, 6, 13, 11, 8, 3, 3, padding=1)
    f7 = kernels.get_variant("winograd_nonfused_f7")
    db = TuningDB(config.tuning_db)
    key = dict(zip(KEY_FIELDS, Tuner(ocl, db).key(spec, Epilogue(), "relaxed"), strict=True))
    db.put(Entry(**key, version="test", variant=f7.name, params=f7.default(spec, ocl.device).to_json(),
                 time_ms=1.0, workspace=0, error=1e-5, date=now()))
    db.close()
    path = tmp_path / "small.prototxt"
    path.write_text(NET)
    results = {}
    tune.clear_choices()
    try:
        for prec in ("relaxed", "fp32"):
            assert cli_main(["run", "--net", str(path), "--backend", "opencl", "--repeats", "2", "--precision", prec,
                         "--out", str(tmp_path / prec)]) == 0
            name = "run-small-n1-opencl" + ("-relaxed" if prec == "relaxed" else "") + ".json"
            results[prec] = (capsys.readouterr().out, json.loads((tmp_path / prec / name).read_text()))
    finally:
        tune.clear_choices()
    out, res = results["relaxed"]
    steps = {r["layer"]: r["variant"] for r in res["layers"]}
    assert steps["a"].startswith("winograd_nonfused_f7"), steps
    assert "relaxed class: per step" in out and res["precision"] == "relaxed"
    assert "logits error vs float64 (relaxed class): convforge" in out and "PyTorch TF32 n/a (not run)" in out
    assert res["summary"].startswith("| small | 1 | opencl | relaxed | ")
    assert res["summary"].count("|") == SUMMARY_HEADER.count("|") and res["logits_error"] < 1e-3
    out, res = results["fp32"]
    assert "fp32 class: per step" in out and res["precision"] == "fp32" and res["logits_error"] < 1e-5
    assert not any(r["variant"].startswith("winograd_nonfused_f7") for r in res["layers"])


def test_errors_line_puts_both_errors_side_by_side() -> None:
    from convforge.apps.run.run_command import errors_line

    line = errors_line({"precision": "relaxed", "logits_error": 2e-4, "torch_logits_error": 5e-4})
    assert line == "logits error vs float64 (relaxed class): convforge 2.00e-04 | PyTorch TF32 5.00e-04 | ratio 0.40"
    assert "PyTorch FP32 1.00e-06" in errors_line({"logits_error": 1e-6, "torch_logits_error": 1e-6})
    nan = float("nan")  # float16 logits that overflowed on both sides: said so, never 'ratio nan'
    line = errors_line({"logits_error": nan, "torch_logits_error": nan, "dtype": "float16"})
    assert "ratio n/a: the logits are not finite" in line and "65504" in line and "ratio nan" not in line


def test_torch_baseline_math_switches() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'convforge[torch]')")
    from convforge.graph.torch_reference import set_math

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    try:
        set_math(torch, True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        set_math(torch, False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.benchmark
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = saved


def test_tuning_tunes_each_layer_with_its_epilogue_on_pocl(ocl: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``--tune`` and ``tune --model`` rely on, through conv2d on PoCL: inside ``tuning(True)`` a
    first call tunes its layer with its real epilogue into the database in the asked class, and
    ``cached()`` lists it; afterwards (autotune restored) the stored entry serves."""
    import numpy as np

    import convforge
    from convforge.dispatch.choice import cached
    from convforge.tune import Budget
    from convforge.tune.db import TuningDB

    monkeypatch.setattr("convforge.tune.AUTOTUNE_BUDGET", Budget(None, 2))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 11, 13)).astype(np.float32)
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    with M.tuning(True):
        y = convforge.conv2d(x, w, b, padding=1, relu=True, precision="relaxed")
        seen = cached()
    assert config.autotune is False and np.isfinite(y).all()
    ((spec, epi, prec, ch),) = seen
    assert (spec.c, spec.k, epi.tag(), prec, ch.source) == (3, 5, "_bias_relu", "relaxed", "tuned")
    (entry,) = TuningDB(config.tuning_db).entries()
    assert (entry.epilogue, entry.precision, entry.variant) == ("bias_relu", "relaxed", ch.variant.name)
    from convforge import dispatch

    again = dispatch.choose(spec, ocl, epi, precision="relaxed")
    assert (again.variant, again.params, again.source) == (ch.variant, ch.params, "db")


def test_time_rounds_interleaves_and_drops_a_failing_step(monkeypatch):
    """The training benches time their implementations in interleaved rounds, the order rotated each round,
    each one's setup before each of its turns; a step that raises leaves the rounds with its exception."""
    from convforge.apps.bench import training

    calls: list[str] = []

    def samples(step, n):
        return [step() for _ in range(n)]

    def stepper(name, ms, fail_at=None):
        def step():
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError(f"{name} broke")
            return ms
        return step

    setups: list[str] = []
    monkeypatch.setattr(training, "_samples", samples)
    steps = {name: (stepper(name, ms, fail), lambda name=name: setups.append(name))
             for name, ms, fail in (("a", 3.0, None), ("b", 1.0, None), ("c", 2.0, 4))}
    out = training.time_rounds(steps, warmup=1, repeats=6, rounds=3)
    assert out["a"] == 3.0 and out["b"] == 1.0
    assert isinstance(out["c"], RuntimeError) and "c broke" in str(out["c"])
    # warm-up a b c; round 0: a a b b c c; round 1, rotated by one: b b c (its 4th call raises) a a;
    # round 2, c gone: a a b b
    assert calls == ["a", "b", "c", "a", "a", "b", "b", "c", "c", "b", "b", "c", "a", "a", "a", "a", "b", "b"]
    assert setups[:3] == ["a", "b", "c"] and setups.count("c") == 3
