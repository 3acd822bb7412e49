"""Feedback during long work and fast first calls: progress phases in the log (only when they take
long) and on the command line, a network's programs compiled ahead on several threads, and a second
process finding them in the on-disk caches; `run` on a CPU device compares with NumPy and gives no
CUDA advice without a CUDA device; `devices` says what PoCL is for."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from convforge import progress
from convforge.config import config
from helpers import run_main

SRC = str(Path(__file__).parents[1] / "src")
SMALL = """
input: "data" input_shape { dim: 1 dim: 5 dim: 11 dim: 9 }
layer { name: "a" type: "Convolution" bottom: "data" top: "a"
        convolution_param { num_output: 7 kernel_size: 3 pad: 1 } }
layer { name: "ra" type: "ReLU" bottom: "a" top: "a" }
layer { name: "p" type: "Pooling" bottom: "a" top: "p" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
"""


@pytest.fixture(autouse=True)
def _own_db(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("precision", "max_error", "autotune"):
        monkeypatch.setattr(config, name, getattr(config, name))
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")


def test_a_short_phase_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="convforge")
    with progress.Phase("compiling something quick", 3, "programs") as phase:
        phase.advance(3)
    assert not caplog.records and phase.done == 3 and not phase.slow


def test_a_long_phase_says_what_and_how_far(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "EVERY_S", 0.01)
    caplog.set_level(logging.INFO, logger="convforge")
    events: list[str] = []
    with progress.listen(lambda phase, event: events.append(event)):
        with progress.Phase("compiling GoogLeNet's kernels", 4, "programs") as phase:
            time.sleep(0.2)
            phase.advance()
            time.sleep(0.05)
            phase.advance(3)
    text = [r.getMessage() for r in caplog.records if r.name == "convforge"]
    assert text[0].startswith("convforge: compiling GoogLeNet's kernels: 0/4 programs, "), text
    assert any("4/4 programs" in t for t in text) or any("1/4 programs" in t for t in text), text
    assert text[-1].startswith("convforge: compiling GoogLeNet's kernels: done, 4 programs in "), text
    assert events[0] == "start" and "slow" in events and events[-1] == "end" and events.count("advance") == 2
    assert progress._LISTENERS == []


def test_no_phase_work_without_logging_or_listeners(monkeypatch: pytest.MonkeyPatch) -> None:
    """With logging off and nobody listening a phase starts no timer thread (a first call's cost)."""
    monkeypatch.setattr(progress.log, "level", logging.WARNING)
    monkeypatch.setattr(progress.log, "disabled", False)
    if progress.log.isEnabledFor(logging.INFO):
        pytest.skip("the root logger is at INFO in this session")
    phase = progress.Phase("x")
    assert phase._timer is None
    phase.end()


def _small(tmp_path: Path) -> Path:
    path = tmp_path / "small.prototxt"
    path.write_text(SMALL)
    return path


def test_network_compile_is_one_logged_phase(ocl, tmp_path: Path, caplog: pytest.LogCaptureFixture,  # type: ignore[no-untyped-def]
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from convforge.graph.build import compile
    from convforge.graph.reference import run_reference
    from convforge.reference import rel_l2

    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="convforge")
    net = compile(str(_small(tmp_path)), backend="opencl", error_budget=0, seed=3)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "compiling net's kernels (" in text and "programs" in text, text
    x = np.random.default_rng(1).standard_normal(net.shapes[net.graph.input].shape).astype(np.float32)
    out = net(x)
    ref = run_reference(net.graph, x)
    assert rel_l2(out[net.graph.outputs[0]], ref[net.graph.outputs[0]]) < 1e-5


BUILD = """
import json, sys
import numpy as np
from convforge.graph.build import compile
net = compile(sys.argv[1], backend=sys.argv[2], error_budget=0, seed=5)
x = np.random.default_rng(2).standard_normal(net.shapes[net.graph.input].shape).astype(np.float32)
print(json.dumps({"compiled": net.compiled_ahead, "out": net(x)[net.graph.outputs[0]].ravel()[:20].tolist()}))
"""


def _two_processes(tmp_path: Path, backend: str) -> list[dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": SRC, "CONVFORGE_CACHE_DIR": str(tmp_path / "cf"),
           "POCL_CACHE_DIR": str(tmp_path / "pocl")}
    net = str(_small(tmp_path))
    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", BUILD, net, backend], capture_output=True, text=True, env=env,
                             timeout=900)
        assert res.returncode == 0, res.stderr
        runs.append(json.loads(res.stdout.splitlines()[-1]))
    return runs


def test_a_second_process_finds_the_programs_compiled(ocl, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A cold build compiles the network's programs ahead (PoCL: in side contexts, into its kernel
    cache); a new process with the same caches compiles none and computes the same values."""
    runs = _two_processes(tmp_path, "opencl")
    assert runs[0]["compiled"] >= 2 and runs[1]["compiled"] == 0, runs  # type: ignore[operator]
    assert runs[0]["out"] == runs[1]["out"]


@pytest.mark.gpu
def test_a_second_process_finds_the_cubins(cuda, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """CUDA: the cold build compiles its programs on several threads (NVRTC) into the disk cache; a
    new process loads them all (compiles none) and computes the same values."""
    runs = _two_processes(tmp_path, "cuda")
    assert runs[0]["compiled"] >= 2 and runs[1]["compiled"] == 0, runs  # type: ignore[operator]
    assert runs[0]["out"] == runs[1]["out"]


def test_run_on_a_cpu_device_compares_with_numpy(ocl, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a CUDA device: no `--backend cuda` advice, a NumPy float32 baseline with its time
    and error, speeds in GFLOP/s with decimals, and the long phases said as they end."""
    import convforge.backends
    from convforge.apps.run import run_command

    monkeypatch.setattr(convforge.backends, "cuda_available", lambda: False)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    rc, out = run_main(["run", "--net", str(_small(tmp_path)), "--backend", "opencl", "--repeats", "2",
                        "--error-budget", "0", "--out", str(tmp_path / "o")], capsys)
    assert rc == 0, out
    assert "--backend cuda" not in out and "there is no CUDA device here" in out, out
    assert "NumPy" in out and "relative error vs the float64 reference" in out, out
    assert "timing each step alone: done, 2 steps in" in out and "checking against the float64 reference" in out, out
    res = json.loads(next((tmp_path / "o").glob("run-*.json")).read_text())
    assert res["numpy_ms"] > 0 and res["numpy_logits_error"] < 1e-5
    gflops = run_command.gflops
    assert gflops(0.4123) == "0.412" and gflops(12.34) == "12.3" and gflops(4321.0) == "4321"


def test_devices_says_what_pocl_is_for(ocl, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    rc, out = run_main(["devices"], capsys)
    text = " ".join(out.split())
    assert rc == 0
    if not ocl.device.is_gpu:
        assert "correctness back-end" in text and "correctness," in text, text


def test_first_calls_say_how_many_kernels_they_compiled(ocl, caplog: pytest.LogCaptureFixture,  # type: ignore[no-untyped-def]
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's first forward compiles layer after layer: the log says how far it is (here every
    compile, EVERY_S being 0), naming the latest."""
    from convforge import dispatch
    from convforge.spec import ConvSpec

    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="convforge")
    spec = ConvSpec.parse("N=1,C=3,H=7,W=5,K=2,R=3,S=3,pad=1")
    dispatch.clear_executables()
    dispatch.executable(spec, ocl, algo="direct")
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "first calls: 1 kernel program(s) compiled in" in text and f"for {spec.short()}" in text, text


def test_deferred_compiles_load_cached_programs_and_defer_the_rest(ocl) -> None:  # type: ignore[no-untyped-def]
    """``prepare``'s first pass: inside ``deferring_compiles`` a program some cache holds loads as
    usual and one none holds raises CompileDeferred (naming it) instead of compiling; outside, it
    compiles."""
    import uuid

    from convforge.backends.base import CompileDeferred, deferring_compiles

    cached = "__kernel void cf_defer_a(__global float* x) { x[0] = 1.0f; }"
    fresh = f"// {uuid.uuid4()}\n__kernel void cf_defer_b(__global float* x) {{ x[0] = 2.0f; }}"
    ocl.program(cached)
    with deferring_compiles():
        assert ocl.program(cached) is not None
        with pytest.raises(CompileDeferred) as info:
            ocl.program(fresh)
    assert info.value.source == fresh and info.value.backend is ocl
    assert ocl.program(fresh) is not None
