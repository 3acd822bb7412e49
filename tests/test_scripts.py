"""scripts/ holds what a user or maintainer runs by hand: each script says in its first lines what it
is for and is exercised here (its --help, a dry run, or a real run on the CPU) or by scripts/gpu-check.
A new script must get its row in SCRIPTS."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_main

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = ROOT / "scripts"
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}

# name -> how it is exercised: "help" (python --help here, skipped with the reason where a module it
# needs at import is missing), "bash" (bash -n here; it runs on the GPU machine), or the test that runs it.
SCRIPTS = {
    "benchmarks_md.py": "tests/test_bench.py::test_benchmarks_md_one_table_per_class",
    "gpu-ab": "bash", "gpu-amp": "bash", "gpu-check": "bash", "gpu-final": "bash", "gpu-multi": "bash",
    "gpu-ncu": "bash", "gpu-opencl-setup": "bash",
    "gpu_variants.py": "help (scripts/gpu-check runs it under compute-sanitizer and for its timings)",
    "host_cost.py": "help (scripts/gpu-final check runs it)",
    "lint": "bash (and .ci/run runs it)",
    "multi_compare.py": "help (scripts/gpu-multi runs it)",
    "ncu_layer.py": "help (scripts/gpu-ncu runs it)",
    "net_error_trace.py": "help (CUDA with torch: it compares with PyTorch FP32)",
    "train_profile.py": "help (CUDA with torch and torchvision: it profiles a training step)",
    "sass_loads.py": "help, and test_sass_loads_runs_on_the_cpu",
    "tc_sum_model.py": "help, and test_tc_sum_model_runs_on_the_cpu",
    "waves.py": "help, and test_waves_runs_on_the_cpu",
    "winograd_accuracy.py": "help (its table is docs/NOTES-winograd.md's; a run takes minutes on PoCL)",
}
NEEDS = {"host_cost.py": ("torch", "cupy")}  # modules a script imports at its top


def test_every_script_has_its_row() -> None:
    assert sorted(p.name for p in SCRIPTS_DIR.iterdir() if p.is_file()) == sorted(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_script_says_what_it_is_for(name: str) -> None:
    lines = (SCRIPTS_DIR / name).read_text().splitlines()
    body = lines[1:] if lines[0].startswith("#!") else lines
    first = body[0]
    assert first.startswith(('"""', "# ")) and len(first.strip('"# ')) > 20, f"{name}: {first!r}"


@pytest.mark.parametrize("name", sorted(n for n, how in SCRIPTS.items() if how.startswith("bash")))
def test_shell_scripts_parse(name: str) -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPTS_DIR / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", sorted(n for n, how in SCRIPTS.items() if how.startswith("help")))
def test_python_scripts_answer_help(name: str) -> None:
    for module in NEEDS.get(name, ()):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{name} imports {module} at its top; not installed here (the GPU machine runs it)")
    proc = subprocess.run([sys.executable, str(SCRIPTS_DIR / name), "--help"], capture_output=True, text=True,
                          env=ENV, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stdout + proc.stderr


def test_sass_loads_runs_on_the_cpu(nvcc_ok: bool) -> None:
    from convforge.codegen.nvcc import cuobjdump_path

    if cuobjdump_path() is None:
        if os.environ.get("CI"):
            pytest.fail("cuobjdump/nvdisasm missing on CI: the test extras install their wheels")
        pytest.skip("cuobjdump/nvdisasm not found: scripts/sass_loads.py cannot disassemble")
    proc = subprocess.run([sys.executable, str(SCRIPTS_DIR / "sass_loads.py"), "--spec",
                           "N=1,C=8,H=9,W=9,K=8,R=3,S=3,pad=1", "--variant", "direct"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0 and "regs" in proc.stdout, proc.stdout + proc.stderr


def test_waves_runs_on_the_cpu(nvcc_ok: bool, tmp_path: Path) -> None:
    """scripts/waves.py on a two-layer depthwise suite: the wgrad default's grid fills one wave, and the
    whole-lanes block of 288 threads is counted at 2 an SM (its 96 registers: 18 warps in four quarters)."""
    suite = tmp_path / "dw.json"
    suite.write_text(json.dumps([{"name": "dw144", "N": 64, "C": 144, "H": 56, "W": 56, "K": 144, "R": 3, "S": 3,
                                  "stride": 1, "pad": 1, "groups": 144}]))
    proc = subprocess.run([sys.executable, str(SCRIPTS_DIR / "waves.py"), "--suite", str(suite), "--pass", "wgrad",
                           "--dtype", "fp16", "--layout", "nhwc"], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wgrad_depthwise 96 regs x 288: 264 blocks, 2 an SM, 1.00 waves" in proc.stdout, proc.stdout
    squeezed = subprocess.run([sys.executable, str(SCRIPTS_DIR / "waves.py"), "--suite", str(suite), "--pass", "wgrad",
                               "--dtype", "fp16", "--layout", "nchw", "--params", "bt=256,mb=8"],
                              capture_output=True, text=True, env=ENV, timeout=300)  # a bound of 32 registers
    spilled = re.search(r"wgrad_depthwise 32 regs \(spills \d+ B\) x 256: ", squeezed.stdout)
    assert spilled, squeezed.stdout + squeezed.stderr


# -- convforge bench --sweep (what scripts/gpu_wino_sweep.py did, and scripts/gpu-ab runs) -------------
TINY = [{"name": "t1", "N": 1, "C": 5, "H": 9, "W": 7, "K": 6, "R": 3, "S": 3, "stride": 1, "pad": 1},
        {"name": "t2", "N": 2, "C": 3, "H": 11, "W": 13, "K": 4, "R": 3, "S": 3, "stride": 1, "pad": [0, 1]}]


def _suite(tmp_path: Path) -> str:
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(TINY))
    return str(f)


def test_sweep_times_the_first_points_of_each_space(ocl, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from convforge import kernels

    out = tmp_path / "out"
    rc, text = run_main(["bench", "--suite", _suite(tmp_path), "--backend", "opencl", "--sweep", "--algo", "direct",
                         "--algo", "winograd_nonfused_f2", "--sweep-limit", "2", "--out", str(out)], capsys)
    assert rc == 0, text
    doc = json.loads((out / "sweep.json").read_text())
    rows = doc["rows"]
    for layer in TINY:
        spec = next(r["spec"] for r in rows if r["layer"] == layer["name"])
        mine = [r for r in rows if r["layer"] == layer["name"]]
        for name in ("direct", "winograd_nonfused_f2"):
            v = kernels.get_variant(name)
            pts = [r["params"] for r in mine if r["variant"] == name]
            assert len(pts) == 2, (spec, name, pts)
            want = [json.loads(p.to_json()) for p in v.space(_spec(layer), ocl.device)[:2]]
            assert pts == want
        assert all(r["status"] == "ok" and r["rel_err"] < 1e-5 and r["time_ms"] > 0 for r in mine), mine
        assert sum(r["fastest"] for r in mine) == 1
    assert set(doc["fastest"]) == {f"{t['name']}|{v}" for t in TINY for v in ("direct", "winograd_nonfused_f2")}
    assert "8 point(s) timed, 0 failed" in text


def _spec(layer: dict[str, object]):  # type: ignore[no-untyped-def]
    from convforge.apps.bench.suites import parse_row

    return parse_row(layer, "test").spec


def test_sweep_mods_time_the_default_and_its_changes(ocl, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from convforge import kernels

    out = tmp_path / "out"
    rc, text = run_main(["bench", "--suite", _suite(tmp_path), "--limit", "1", "--backend", "opencl", "--sweep",
                         "--algo", "direct", "--sweep-mods", "default;tk=2;tp=2,tq=1", "--out", str(out)], capsys)
    assert rc == 0, text
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    default = kernels.get_variant("direct").default(_spec(TINY[0]), ocl.device)
    got = [r["params"] for r in rows]
    assert got[0] == json.loads(default.to_json()) and len(got) == 3
    assert got[1] == {**got[0], "tk": 2} and got[2] == {**got[0], "tp": 2, "tq": 1}


def test_sweep_points_time_each_layers_own_changes(ocl, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--sweep-points FILE: each named layer's default and its own mods (named as --pass names it, or by
    the suite's name); the layers it does not name are skipped."""
    from convforge import kernels
    from convforge.apps.bench.suites import parse_row

    dw = [{"name": n, "N": 1, "C": 6, "H": h, "W": 7, "K": 6, "R": 3, "S": 3, "stride": 1, "pad": 1, "groups": 6}
          for n, h in (("d1", 9), ("d2", 11), ("d3", 5))]
    suite, pts, out = tmp_path / "dw.json", tmp_path / "points.json", tmp_path / "out"
    suite.write_text(json.dumps(dw))
    pts.write_text(json.dumps({"d2:wgrad": ["ns=2", "default", "bt=64,ns=1"], "d3": ["ns=3"]}))
    rc, text = run_main(["bench", "--suite", str(suite), "--backend", "opencl", "--sweep", "--pass", "wgrad",
                         "--dtype", "fp16", "--algo", "depthwise_wgrad", "--sweep-points", str(pts),
                         "--out", str(out)], capsys)
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert rc == 0 and [r["layer"] for r in rows] == ["d2:wgrad"] * 3 + ["d3:wgrad"] * 2, text
    v = kernels.get_variant("depthwise_wgrad")
    spec = parse_row(dw[1], "test").spec.with_pass("wgrad")
    default = json.loads(v.default(dataclasses.replace(spec, dtype="float16"), ocl.device).to_json())
    assert [r["params"] for r in rows[:3]] == [default, {**default, "ns": 2}, {**default, "bt": 64, "ns": 1}]
    assert rows[4]["params"]["ns"] == 3 and all(r["status"] == "ok" for r in rows), rows


@pytest.mark.parametrize(("doc", "message"), [
    ({"t9": ["ns=2"]}, "--sweep-points names layers the suite does not have: 't9'"),
    (["ns=2"], "must be a JSON object from layer name to a non-empty list"),
    ({"t1": []}, "must be a JSON object from layer name to a non-empty list"),
    ({"t1": ["tk"]}, "layer 't1': --sweep-mods ('tk')"),
], ids=["unknown-layer", "not-an-object", "empty-list", "bad-mod"])
def test_bad_sweep_points_are_one_clear_error(doc: object, message: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pts = tmp_path / "points.json"
    pts.write_text(json.dumps(doc))
    rc, out = run_main(["bench", "--suite", _suite(tmp_path), "--backend", "opencl", "--sweep", "--algo", "direct",
                        "--sweep-points", str(pts)], capsys)
    assert rc == 2 and message in out and "Traceback" not in out, out


def test_sweep_takes_the_dtype(ocl, tmp_path: Path,  # type: ignore[no-untyped-def]
                              capsys: pytest.CaptureFixture[str]) -> None:
    """--dtype fp16 sweeps the half layers (round 27: the sweep ignored it and found no half variant)."""
    out = tmp_path / "out"
    rc, text = run_main(["bench", "--suite", _suite(tmp_path), "--limit", "1", "--backend", "opencl", "--sweep",
                         "--algo", "direct", "--dtype", "fp16", "--sweep-mods", "default", "--out", str(out)], capsys)
    assert rc == 0, text
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert rows and all("float16" in r["spec"] and r["status"] == "ok" for r in rows), rows


def test_sweep_takes_an_epilogue(ocl, tmp_path: Path,  # type: ignore[no-untyped-def]
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--sweep-epilogue: every point runs with bias + residual + ReLU, checked against float64 with them (a
    fused block's layer, as the residual-prefetch A/B timed it)."""
    out = tmp_path / "out"
    rc, text = run_main(["bench", "--suite", _suite(tmp_path), "--limit", "1", "--backend", "opencl", "--sweep",
                         "--algo", "direct", "--sweep-mods", "default;tk=2", "--sweep-epilogue", "bias,residual,relu",
                         "--out", str(out)], capsys)
    assert rc == 0, text
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["status"] == "ok" and r["rel_err"] < 1e-5 for r in rows), rows
    assert "epilogue bias,residual,relu" in text


BAD_SWEEPS = [
    (["--sweep"], "--sweep needs --algo"),
    (["--sweep", "--algo", "auto"], "--sweep needs --algo"),
    (["--sweep", "--algo", "direct", "--baseline", "torch"], "--sweep cannot be combined with --baseline"),
    (["--sweep", "--algo", "direct", "--compare-backends"], "--sweep cannot be combined with --compare-backends"),
    (["--sweep", "--algo", "direct", "--sweep-limit", "0"], "--sweep-limit (0) must be >= 1"),
    (["--sweep", "--algo", "direct", "--sweep-limit", "2", "--sweep-mods", "tk=2"], "exclude each other"),
    (["--sweep", "--algo", "direct", "--sweep-mods", "tk=2", "--sweep-points", "p.json"], "exclude each other"),
    (["--sweep", "--algo", "direct", "--sweep-points", "/nonexistent/p.json"], "--sweep-points (/nonexistent/p.json)"),
    (["--sweep-points", "p.json"], "--sweep-points goes with --sweep"),
    (["--sweep", "--algo", "direct", "--sweep-mods", ";"], "names no change"),
    (["--sweep", "--algo", "direct", "--sweep-mods", "tk"], "--sweep-mods ('tk')"),
    (["--sweep-limit", "3"], "--sweep-limit goes with --sweep"),
    (["--sweep-mods", "tk=2"], "--sweep-mods goes with --sweep"),
    (["--sweep-epilogue", "relu"], "--sweep-epilogue goes with --sweep"),
    (["--sweep", "--algo", "direct", "--sweep-epilogue", "relu,tanh"],
     "--sweep-epilogue ('relu,tanh'): unknown 'tanh'"),
    (["--sweep", "--algo", "direct", "--sweep-epilogue", "relu,silu"], "one activation at most"),
    (["--sweep", "--algo", "nosuchvariant"], "--algo ('nosuchvariant') must be a variant or family"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_SWEEPS, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_bad_sweeps_are_one_clear_error(extra: list[str], message: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(["bench", "--suite", _suite(tmp_path), *extra], capsys)
    assert rc == 2 and message in out and "Traceback" not in out, out


def test_sweep_model_clash(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(["bench", "--model", "resnet18", "--sweep", "--algo", "direct"], capsys)
    assert rc == 2 and "--sweep cannot be combined with --model" in out, out


def test_tc_sum_model_runs_on_the_cpu() -> None:
    """The truncating-sum model on a small problem: one FP32 row and four 3xFP16 schemes, each with a
    relative L2 error under 1e-5."""
    proc = subprocess.run([sys.executable, str(SCRIPTS_DIR / "tc_sum_model.py"), "--rows", "64", "--k", "96"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    errs = [float(line.split("rel L2 ")[1].split()[0]) for line in proc.stdout.splitlines() if "rel L2" in line]
    assert len(errs) == 5 and all(0 < e < 1e-5 for e in errs), proc.stdout
