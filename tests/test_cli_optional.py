"""Every command and option that touches an optional package, run with that package absent: one
``error:`` line naming what to install and exit status 2 where the option needs it, a note naming
the install where the package only adds something (a baseline, plots), never a traceback.

A package is made absent by ``sys.modules[name] = None`` (its import then fails as if it were not
installed), together with the convforge modules that import it at their top (already imported by
other tests in this process) and the cached back-end instances. So these tests mean the same on
this machine (no torch, no CuPy) and on a GPU machine that has every package.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

import convforge.backends
from convforge.cli import build_parser
from convforge.config import config
from convforge.spec import ConvSpec
from helpers import run_main

SPEC = "N=1,C=3,H=9,W=9,K=4,R=3,S=3,pad=1"
SRC = str(Path(__file__).parents[1] / "src")

# What "absent" hides for each optional package: the package and the convforge modules that
# import it at module level.
HIDES = {"torch": ("torch", "torchvision", "convforge.torch"), "torchvision": ("torchvision",),
         "cupy": ("cupy", "cupyx", "convforge.backends.cuda"),
         "pyopencl": ("pyopencl", "convforge.backends.opencl"), "onnx": ("onnx",), "matplotlib": ("matplotlib",)}
TORCH = "--model needs PyTorch: pip install 'convforge[torch]'"
CUPY = "backend 'cuda' needs CuPy"
PYOPENCL = "backend 'opencl' needs pyopencl"
ONNX = "--net FILE.onnx needs onnx: pip install 'convforge[onnx]'"
INSTALL = {"cupy": "pip install 'convforge[cuda]'", "pyopencl": "pip install 'convforge[opencl]'"}


@pytest.fixture(autouse=True)
def _restore_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """cli.main sets config.precision / max_error from the arguments: put them back afterwards."""
    for name in ("precision", "max_error", "autotune"):
        monkeypatch.setattr(config, name, getattr(config, name))
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")


@pytest.fixture
def absent(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """``absent("torch", ...)``: those packages cannot be imported for the rest of the test."""
    monkeypatch.setattr(convforge.backends, "_INSTANCES", {})

    def hide(*packages: str) -> None:
        for pkg in packages:
            for name in HIDES[pkg]:
                monkeypatch.setitem(sys.modules, name, None)

    return hide


def one_error_line(out: str, message: str) -> None:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out
    assert "Traceback" not in out


# (packages made absent, argv, the message): each needs the package, so exit 2 and one line.
NEEDS = [
    (("torch",), ["tune", "--model", "resnet18"], TORCH),
    (("torch",), ["tune", "--model", "resnet50:32", "--precision", "relaxed", "--budget", "3s,4"], TORCH),
    (("torch",), ["bench", "--model", "resnet18"], TORCH),
    (("torch",), ["bench", "--model", "resnet50:32", "--model", "vgg16:16", "--precision", "both", "--tune",
                  "--error-budget", "2", "--max-error", "1e-4"], TORCH),
    (("cupy",), ["bench", "--suite", "mec", "--limit", "1", "--backend", "cuda"], CUPY),
    (("cupy",), ["bench", "--suite", "mec", "--limit", "1", "--compare-backends"], CUPY),
    (("cupy",), ["bench", "--suite", "mec", "--ablation", "im2win", "--backend", "cuda"], CUPY),
    (("cupy",), ["tune", "--spec", SPEC, "--backend", "cuda"], CUPY),
    (("cupy",), ["tune", "--net", "nin", "--backend", "cuda"], CUPY),
    (("cupy",), ["run", "--net", "nin", "--backend", "cuda"], CUPY),
    (("pyopencl",), ["bench", "--suite", "mec", "--limit", "1", "--backend", "opencl"], PYOPENCL),
    (("pyopencl", "cupy"), ["bench", "--suite", "mec", "--limit", "1"], PYOPENCL),  # the default back-end
    (("pyopencl",), ["tune", "--spec", SPEC, "--backend", "opencl"], PYOPENCL),
    (("pyopencl", "cupy"), ["tune", "--spec", SPEC], PYOPENCL),
    (("pyopencl",), ["tune", "--net", "nin", "--backend", "opencl"], PYOPENCL),
    (("pyopencl",), ["run", "--net", "nin", "--backend", "opencl", "--no-torch"], PYOPENCL),
    (("pyopencl", "cupy"), ["run", "--net", "nin"], PYOPENCL),
    (("onnx",), ["run", "--net", "model.onnx", "--backend", "opencl", "--no-torch"], ONNX),
    (("onnx",), ["tune", "--net", "model.onnx", "--backend", "opencl"], ONNX),
]


@pytest.mark.parametrize(("packages", "argv", "message"), NEEDS,
                         ids=lambda a: " ".join(a)[:60] if isinstance(a, (list, tuple)) else "")
def test_an_option_that_needs_a_missing_package_is_one_error_line(
        packages: tuple[str, ...], argv: list[str], message: str, absent, tmp_path: Path,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    absent(*packages)
    monkeypatch.chdir(tmp_path)  # model.onnx: a path that need not exist (the package is checked first)
    monkeypatch.setenv("CONVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    rc, out = run_main(argv, capsys)
    assert rc == 2, out
    one_error_line(out, message)
    pkg = "cupy" if message == CUPY else "pyopencl" if message == PYOPENCL else None
    if pkg:
        assert INSTALL[pkg] in out, out


def test_model_options_name_torchvision_when_only_it_is_missing(absent, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    absent("torchvision")
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # torch "installed", torchvision not
    for argv in (["tune", "--model", "resnet18"], ["bench", "--model", "resnet18:2"]):
        rc, out = run_main(argv, capsys)
        assert rc == 2, out
        one_error_line(out, "--model needs torchvision: pip install 'convforge[torch]'")


def test_a_model_name_is_checked_before_torch_is_needed(absent, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    absent("torch")
    for argv in (["tune", "--model", "resnet9"], ["bench", "--model", "resnet9"]):
        rc, out = run_main(argv, capsys)
        assert rc == 2, out
        one_error_line(out, "model ('resnet9') must be one of")


# Commands that need no optional package: they still run, and say what is missing where they list it.
RUNS = [
    (("cupy", "pyopencl", "torch"), ["devices"], ["CuPy not installed (pip install 'convforge[cuda]')",
                                                  "PyOpenCL not installed (pip install 'convforge[opencl]')"]),
    (("cupy",), ["algos", "--spec", SPEC, "--backend", "cuda"], ["nominal sm_90"]),
    (("pyopencl",), ["algos", "--spec", SPEC, "--backend", "opencl"], ["nominal OpenCL GPU"]),
    (("cupy", "pyopencl"), ["show", "--spec", SPEC, "--variant", "direct", "--backend", "both"],
     ["===== cuda =====", "===== opencl ====="]),
]


@pytest.mark.parametrize(("packages", "argv", "wants"), RUNS,
                         ids=lambda a: " ".join(a)[:60] if isinstance(a, (list, tuple)) else "")
def test_commands_that_need_no_optional_package_run_without_them(
        packages: tuple[str, ...], argv: list[str], wants: list[str], absent,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    absent(*packages)
    monkeypatch.setenv("COLUMNS", "200")  # the devices table on one line per row
    rc, out = run_main(argv, capsys)
    assert rc == 0, out
    for want in wants:
        assert want in out, out


def test_db_runs_without_any_optional_package(absent, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from convforge.tune.db import TuningDB

    db = str(tmp_path / "t.sqlite")
    TuningDB(Path(db))  # an empty database of convforge's
    absent(*HIDES)
    for argv in (["db", "--db", db, "list"], ["db", "--db", db, "export", str(tmp_path / "e.json")],
                 ["db", "--db", db, "clear"]):
        rc, out = run_main(argv, capsys)
        assert rc == 0 and "Traceback" not in out, (argv, out)


def test_every_subcommand_is_walked_here() -> None:
    """A new subcommand must get its rows above (what it does without each optional package)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    walked = {argv[0] for _, argv, _ in NEEDS + RUNS} | {"db"}
    assert set(sub.choices) == walked  # type: ignore[arg-type]


# -- what an optional package only adds: a note naming the install, the command goes on -------------
def test_the_pytorch_baseline_of_a_suite_names_the_install(absent) -> None:  # type: ignore[no-untyped-def]
    from convforge.apps.bench import baselines

    absent("torch")
    for kind in ("torch", "cudnn"):
        why = baselines.unavailable(kind, "opencl")
        assert why is not None and "pip install 'convforge[torch]'" in why
    assert baselines.run("torch", ConvSpec.parse(SPEC), None, False) == []  # type: ignore[arg-type]


def test_run_names_the_install_of_its_pytorch_comparison(absent) -> None:  # type: ignore[no-untyped-def]
    from rich.console import Console

    from convforge.apps.run import run_command

    absent("torch")
    res: dict[str, object] = {}
    run_command._torch(Console(record=True), None, None, 1.0, 0, 1, None, res)  # type: ignore[arg-type]
    assert "pip install 'convforge[torch]', or --no-torch" in str(res["torch"]), res


def test_bench_out_without_matplotlib_writes_results_and_names_the_plot_install(
        absent, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from rich.console import Console

    from convforge.apps.bench import bench_command

    absent("matplotlib")
    console = Console(record=True, width=200)
    bench_command._write(tmp_path, {"device": "test"}, {}, "tiny", [], [], console)
    assert (tmp_path / "results.json").exists() and (tmp_path / "results.csv").exists()
    assert not list(tmp_path.glob("*.png"))
    assert "no plots (pip install 'convforge[plot]')" in console.export_text()


def test_tune_report_without_matplotlib_writes_its_json(absent, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from convforge.apps.tune.report import write_report

    absent("matplotlib")
    assert write_report(tmp_path, {"layers": []}) == [tmp_path / "report.json"]


# -- the safety net and a fresh interpreter ---------------------------------------------------------
def test_an_unchecked_optional_import_is_still_one_error_line(absent, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from convforge.apps.run import run_command

    def uses_onnx(args: object) -> int:
        import onnx  # noqa: F401

        return 0

    absent("onnx")
    monkeypatch.setattr(run_command, "main", uses_onnx)
    rc, out = run_main(["run", "--net", "nin"], capsys)
    assert rc == 2, out
    one_error_line(out, "this command needs onnx: pip install 'convforge[onnx]'")

    def broken(args: object) -> int:
        import convforge_no_such_module  # type: ignore[import-not-found]  # noqa: F401

        return 0

    monkeypatch.setattr(run_command, "main", broken)  # not an optional package: a bug, so a traceback
    with pytest.raises(ModuleNotFoundError):
        run_main(["run", "--net", "nin"], capsys)


FRESH = """
import json, sys
for name in {hide!r}:
    sys.modules[name] = None
from convforge.cli import main
out = []
for argv in {argvs!r}:
    out.append(main(argv))
print(json.dumps(out))
"""


def test_a_fresh_interpreter_without_optional_packages(tmp_path: Path) -> None:
    """No module imported beforehand by other tests: the real import chain of each command."""
    hide = [n for names in HIDES.values() for n in names]
    argvs = [["tune", "--model", "resnet18"], ["bench", "--model", "resnet18"], ["run", "--net", "x.onnx"],
             ["tune", "--spec", SPEC, "--backend", "cuda"], ["algos", "--spec", SPEC]]
    env = {"PYTHONPATH": SRC, "CONVFORGE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", FRESH.format(hide=hide, argvs=argvs)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == [2, 2, 2, 2, 0], proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text
    for want in (TORCH, "--net FILE.onnx needs onnx", CUPY):
        assert want in text, text
