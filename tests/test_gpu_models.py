"""GPU tier of ``bench --model`` precision classes and tuning, ``tune --model`` and the TF32
baseline of ``run --net`` (skips without a CUDA device, torch or torchvision).

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_models.py`` (a few minutes: ResNet-18 N=1
is tuned in both classes with a 2-candidate budget into a temporary database).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from convforge import tune
from convforge.config import config
from convforge.tune import Budget
from convforge.tune.db import TuningDB

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of bench --model: torch not installed")


@pytest.fixture
def gpu(cuda: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A CUDA device, a temporary tuning database and a small autotune budget."""
    if not torch.cuda.is_available():
        pytest.skip("GPU tier: torch sees no CUDA device")
    monkeypatch.setattr(config, "db_path", tmp_path / "models.sqlite")
    monkeypatch.setattr(config, "autotune", False)
    monkeypatch.setattr(config, "precision", "fp32")
    monkeypatch.setattr("convforge.tune.AUTOTUNE_BUDGET", Budget(None, 2))
    tune.clear_choices()
    yield cuda
    tune.clear_choices()


@pytest.fixture
def models_gpu(gpu: Any) -> Any:
    """``gpu``, and torchvision for the models."""
    pytest.importorskip("torchvision", reason="GPU tier of bench --model: torchvision not installed")
    return gpu


def test_bench_both_classes_tuned(models_gpu: Any) -> None:
    """One set of PyTorch rows; convforge rows of each class against that class's baseline, every
    layer tuned into the database in both classes, outputs within their class's accuracy."""
    from convforge.apps.bench import models as M

    rows = M.bench_classes("resnet18", 1, 1, 3, {}, ("fp32", "relaxed"), tune=True)
    assert [r["impl"] for r in rows].count("pytorch_tf32") == 1, rows
    assert all(r["status"].startswith("ok") for r in rows), [(r["impl"], r["status"]) for r in rows]
    ours = {(r["impl"], r["precision"]): r for r in rows if r["impl"].startswith("convforge")}
    assert {("convforge", "fp32"), ("convforge", "relaxed"), ("convforge_graph", "relaxed")} <= set(ours)
    base = {r["impl"]: r for r in rows if not r["impl"].startswith("convforge")}
    for (impl, prec), r in ours.items():
        want = base["pytorch_tf32" if prec == "relaxed" else "pytorch_fp32"]
        assert r["baseline"] == want["impl"] and r["tuned"] is True
        assert r["speedup"] == pytest.approx(want["time_ms"] / r["time_ms"])
        assert r["err_vs_pytorch"] == pytest.approx(r["rel_err"] / want["rel_err"])
        assert r["rel_err"] < (2e-3 if prec == "relaxed" else 2e-5), (impl, prec, r["rel_err"])
    db = TuningDB(config.tuning_db)
    classes = {e.precision for e in db.entries()}
    assert classes == {"fp32", "relaxed"}, classes
    assert config.autotune is False  # restored


def test_tune_model_then_everything_comes_from_the_database(models_gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from convforge.apps.bench import models as M

    monkeypatch.setattr(config, "precision", "relaxed")
    console = Console(record=True, width=250)
    assert M.tune_models(["resnet18:1"], console, Budget(None, 2)) == 0
    first = console.export_text()
    assert "tuned now" in first and "relaxed" in first
    n = len(TuningDB(config.tuning_db).entries(precision="relaxed"))
    assert n >= 10  # ResNet-18's distinct convs (and their epilogues)
    console = Console(record=True, width=250)
    assert M.tune_models(["resnet18:1"], console, Budget(None, 2)) == 0
    assert "tuned now" not in console.export_text()
    assert len(TuningDB(config.tuning_db).entries(precision="relaxed")) == n


def test_torch_baseline_tf32_and_restores_the_switches(gpu: Any) -> None:
    import numpy as np

    from convforge.apps.run.torch_baseline import run_torch
    from convforge.graph.caffe import load_shipped
    from convforge.graph.reference import run_reference
    from convforge.reference import rel_l2

    g = load_shipped("nin", input_size=128, seed=1)
    g.outputs = [g.producer(g.outputs[0]).inputs[0]]
    x = np.random.default_rng(0).standard_normal((1, 3, 128, 128)).astype(np.float32)
    want = run_reference(g, x)[g.outputs[0]]
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = rel_l2(run_torch(g, x, repeats=2).output, want)
    tf32 = rel_l2(run_torch(g, x, repeats=2, tf32=True).output, want)
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert fp32 < 1e-5 and 1e-5 < tf32 < 5e-3, (fp32, tf32)
