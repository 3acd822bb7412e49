"""``bench --model --first-call`` without a GPU: the child processes' answers assembled into rows, the
table titled and labelled for the first forward and for the first AMP training step (``--train --amp``),
and a failing child reported as a failed row. The children themselves run on the GPU machine
(tests/test_gpu_first_call.py)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from rich.console import Console

from convforge.apps.bench import first_call


def _answer(monkeypatch: pytest.MonkeyPatch, stdout: str, rc: int = 0) -> list[list[str]]:
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, rc, stdout, "RuntimeError: no CUDA device\n")

    monkeypatch.setattr(first_call.subprocess, "run", fake_run)
    return calls


def test_a_child_answers_its_times(monkeypatch: pytest.MonkeyPatch) -> None:
    times = {"fuse_s": 0.5, "first_s": 9.25, "second_s": 0.03, "pytorch_first_s": 2.0, "import_s": 3.0,
             "phases": ["compiling: 40 programs, 6.10 s"]}
    calls = _answer(monkeypatch, "noise\n" + json.dumps(times) + "\n")
    row = first_call._child("resnet50", 128, "train-fp16", "nhwc", "/tmp/c")
    assert row == {"status": "ok", **times}
    assert calls[0][-4:] == ["resnet50", "128", "train-fp16", "nhwc"]


def test_a_failing_child_is_a_failed_row(monkeypatch: pytest.MonkeyPatch) -> None:
    _answer(monkeypatch, "", rc=1)
    row = first_call._child("resnet50", 8, "float16", "nhwc", "/tmp/c")
    assert row["status"].startswith("failed (exit 1)") and "no CUDA device" in row["status"]


@pytest.mark.parametrize("train, says", [(False, "first forward"), (True, "first AMP training step")])
def test_the_table_names_what_was_timed(train: bool, says: str) -> None:
    rows = [{"model": "resnet50", "batch": 128, "dtype": "train-fp16" if train else "float16", "layout": "nhwc",
             "cache": cache, "status": "ok", "fuse_s": 0.4, "first_s": first, "second_s": 0.03,
             "pytorch_first_s": 2.0, "import_s": 3.0} for cache, first in (("cold", 12.5), ("warm", 1.25))]
    console = Console(record=True, width=200)
    console.print(first_call._table(rows, train))
    text = console.export_text()
    assert says in text and "12.50" in text and "1.25" in text
    assert ("first step" in text) == train and ("first fwd" in text) != train
