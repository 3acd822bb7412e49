"""``convforge bench --model ... --error-budget R``: the option's parsing and errors, and how the
rows, notes, summary, JSON and CSV carry the calibration (fake rows, no GPU). The calibrated run
itself is in tests/test_gpu_calibrate.py."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from convforge.apps.bench import models as M
from convforge.config import config
from helpers import run_main


@pytest.fixture(autouse=True)
def _restore_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(config, "precision", config.precision)
    monkeypatch.setattr(config, "max_error", config.max_error)
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")


@pytest.mark.parametrize(("value", "message"), [
    ("0", "--error-budget (0) must be a finite number > 0"),
    ("-2", "--error-budget (-2) must be a finite number > 0"),
    ("inf", "--error-budget (inf) must be"),
    ("two", "--error-budget ('two') must be a number such as 2"),
])
def test_bad_budgets_are_one_clear_error(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(["bench", "--model", "resnet50:32", f"--error-budget={value}"], capsys)
    assert rc == 2 and message in out and "Traceback" not in out, out


def test_budget_without_model_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(["bench", "--suite", "resnet", "--error-budget", "2"], capsys)
    assert rc == 2 and "--error-budget goes with --model" in out, out


def test_budget_reaches_the_runner_and_its_absence_changes_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    got: list[dict[str, Any]] = []
    monkeypatch.setattr(M, "run", lambda *a, **kw: got.append(kw) or 0)
    assert run_main(["bench", "--model", "resnet50:32", "--error-budget", "2"], capsys)[0] == 0
    assert got[-1]["error_budget"] == 2.0
    assert run_main(["bench", "--model", "resnet50:32"], capsys)[0] == 0
    assert "error_budget" not in got[-1]


def _fake_bench_model(calls: list[dict[str, Any]]) -> Any:
    """PyTorch and fused rows; the fused ones calibrated as bench_model does (budget_fields)."""
    cal = SimpleNamespace(tightened=[1, 2, 3], met=True, as_dict=lambda: {"bound": 2e-6, "tightened": [1, 2, 3]})

    def fake(name: str, batch: int, warmup: int, repeats: int, options: dict[str, Any], **kw: Any) -> list[Any]:
        calls.append(kw)
        rows = [dict(model=name, batch=batch, impl="pytorch_fp32", status="ok", time_ms=10.0, rel_err=1e-6,
                     ref_spread=0.5),
                dict(model=name, batch=batch, impl="convforge_fused", status="ok", time_ms=7.0, rel_err=1.8e-6,
                     ref_spread=0.5)]
        if kw.get("error_budget") is not None:
            M.budget_fields(rows[1], kw["error_budget"], cal)
        M.label(rows, options)
        return M.compare(rows)

    return fake


def test_rows_notes_json_and_csv_carry_the_budget(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(M, "bench_model", _fake_bench_model(calls))
    monkeypatch.setattr(M, "_check_models", lambda specs, console: [M.parse_model(s) for s in specs])
    monkeypatch.setattr(M, "environment", lambda: {"device": "fake H200"})
    console = Console(record=True, width=300)
    assert M.run(["resnet50:32"], str(tmp_path / "a"), 1, 2, console, {}, error_budget=2.0) == 0
    text = console.export_text()
    assert calls[-1]["error_budget"] == 2.0
    assert "convforge_fused (fp32) vs pytorch_fp32: 1.43x, err ratio 1.80 (error budget 2x: 3 layer(s) " \
           "tightened)" in text
    assert M.BUDGET_NOTE.format(r=2.0) in text and "seed 2" in text
    doc = json.loads((tmp_path / "a" / "models.json").read_text())
    fused = next(r for r in doc["rows"] if r["impl"] == "convforge_fused")
    assert doc["error_budget"] == 2.0
    assert (fused["error_budget"], fused["tightened"], fused["budget_met"]) == (2.0, 3, True)
    assert fused["calibration"]["bound"] == 2e-6
    with open(tmp_path / "a" / "models.csv") as f:
        got = list(csv.DictReader(f))
    assert tuple(got[0]) == M.FIELDS + M.BUDGET_FIELDS and got[1]["tightened"] == "3"

    console = Console(record=True, width=300)
    assert M.run(["resnet50:32"], str(tmp_path / "b"), 1, 2, console, {}) == 0  # without: as before
    assert "error_budget" not in calls[-1] and "error budget" not in console.export_text()
    assert "error_budget" not in json.loads((tmp_path / "b" / "models.json").read_text())
    with open(tmp_path / "b" / "models.csv") as f:
        assert tuple(next(csv.DictReader(f))) == M.FIELDS


def test_budget_fields_of_a_missed_or_failed_calibration() -> None:
    row: dict[str, Any] = dict(impl="convforge_fused")
    M.budget_fields(row, 2.0, SimpleNamespace(tightened=[1] * 40, met=False, as_dict=lambda: {}))
    assert (row["tightened"], row["budget_met"]) == (40, False)
    assert M._budget_text(row) == " (error budget 2x: 40 layer(s) tightened, NOT met on the calibration input)"
    row = dict(impl="convforge_fused")
    M.budget_fields(row, 1.5, RuntimeError("boom"))
    assert row == dict(impl="convforge_fused", error_budget=1.5)
    assert M._budget_text(row) == " (error budget 1.5x: calibration failed)"
