"""The command line's options and help: numbers refused by the option that names them, errors on
stderr, a description on every sub-command, help that matches the code (the registry's suites,
what --pass does by default, what a --spec may say), options of a command accepted after its
sub-command, and -h that still lists a command's options when a package it needs is missing."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from convforge.cli import build_parser
from convforge.config import config
from helpers import run_main

SPEC = "N=1,C=3,H=9,W=9,K=4,R=3,S=3,pad=1"
SRC = str(Path(__file__).parents[1] / "src")


@pytest.fixture(autouse=True)
def _own_db(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("precision", "max_error", "autotune"):
        monkeypatch.setattr(config, name, getattr(config, name))
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")


def _subparsers(parser: argparse.ArgumentParser, path: str = "convforge"):  # type: ignore[no-untyped-def]
    """(command path, parser) of every sub-command at any depth."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield f"{path} {name}", child
                yield from _subparsers(child, f"{path} {name}")


@pytest.mark.parametrize("argv", [
    ["run", "--net", "nin", "--seed", "-1", "--backend", "opencl", "--no-torch"],
    ["bench", "--suite", "mec", "--limit", "1", "--backend", "opencl", "--seed", "-1"],
    ["tune", "--spec", SPEC, "--seed", "-1"],
    ["run", "--net", "nin", "--seed", "x"],
])
def test_a_negative_seed_is_refused_naming_the_option(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(argv, capsys)
    assert rc == 2 and "Traceback" not in out, out
    assert "argument --seed: must be an integer >= 0" in out and "expected non-negative integer" not in out, out


@pytest.mark.parametrize("value", ["-1", "0"])
def test_report_sets_below_one_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(["tune", "--spec", SPEC, "--report-sets", value], capsys)
    assert rc == 2 and f"argument --report-sets: must be an integer >= 1, not {value}" in out, out


@pytest.mark.parametrize("argv", [
    ["bench", "--suite", "nosuchsuite", "--backend", "opencl", "--baseline", "none"],
    ["bench", "--suite", "mec", "--limit", "1", "--train", "--backend", "opencl"],
])
def test_bench_errors_go_to_stderr(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from convforge.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 2 and "error:" not in out.out, out.out
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err


def test_every_subcommand_has_a_description() -> None:
    missing = [path for path, p in _subparsers(build_parser()) if not p.description]
    assert not missing, f"no description: {missing}"
    help_text = build_parser()._subparsers._group_actions[0].choices["db"].format_help()  # type: ignore[union-attr]
    assert "tuning database" in help_text.split("positional arguments")[0]


def _help(*argv: str) -> str:
    parser = build_parser()
    for path, p in _subparsers(parser):
        if path == " ".join(("convforge", *argv)):
            return " ".join(p.format_help().split())
    raise AssertionError(f"no sub-command {argv}")


def test_tune_suite_help_lists_every_registered_suite() -> None:
    from convforge.apps.bench.suites import BUILTIN

    text = _help("tune")
    assert all(name in text for name in BUILTIN), text


@pytest.mark.parametrize("command", ["list", "show"])
def test_db_pass_help_says_one_default(command: str) -> None:
    text = _help("db", command)
    assert "default: every pass" in text and "else fprop" not in text, text


@pytest.mark.parametrize("command", ["algos", "show", "tune"])
def test_spec_help_names_groups_dilation_and_layout(command: str) -> None:
    text = _help(command)
    assert all(word in text for word in ("groups=", "dilation", "layout=", "dtype=", "pass=")), text


def test_db_options_may_follow_the_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "other.sqlite"
    assert run_main(["tune", "--spec", SPEC, "--db", str(db), "--budget", "2", "--backend", "opencl"], capsys)[0] == 0
    outs = []
    for argv in (["db", "--db", str(db), "list"], ["db", "list", "--db", str(db)]):
        rc, out = run_main(argv, capsys)
        assert rc == 0 and db.name in out, (argv, out)
        outs.append(out)
    assert outs[0] == outs[1]
    args = build_parser().parse_args(["db", "--db", "a.sqlite", "list"])
    assert str(args.db) == "a.sqlite"  # the sub-command's copy does not reset it


HIDDEN_HELP = """
import contextlib, io, sys
sys.modules[{module!r}] = None
from convforge.cli import build_parser, main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        build_parser().parse_args([{command!r}, "-h"])
    except SystemExit:
        pass
print(out.getvalue())
print("RC", main([{command!r}] + {run!r}))
"""


@pytest.mark.parametrize(("module", "command", "run"), [
    ("rich", "tune", ["--spec", "N=1,C=3,H=9,W=9,K=4,R=3,S=3"]),
    ("rich", "bench", ["--suite", "mec"]),
    ("rich", "db", ["list"]),
    ("rich", "run", ["--net", "nin"]),  # its module imports rich only when it runs: -h needs no note
])
def test_help_lists_the_options_when_a_package_is_missing(module: str, command: str, run: list[str],
                                                          tmp_path: Path) -> None:
    """A command whose module cannot import a package still lists its options under -h and says what
    to install; running it is one error line (a fresh interpreter: the package hidden from the start)."""
    code = HIDDEN_HELP.format(module=module, command=command, run=run)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": SRC, "CONVFORGE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    text = " ".join(res.stdout.split())
    assert "Traceback" not in res.stderr, res.stderr
    if command != "run":
        assert f"Not available here: convforge {command} needs {module}" in text, text
    assert f"needs {module}" in res.stderr, res.stderr
    options = [line for line in res.stdout.splitlines() if line.startswith("  --")]
    assert len(options) >= (1 if command == "db" else 5), res.stdout
    assert "RC 2" in res.stdout and res.stderr.count("error:") == 1, (res.stdout, res.stderr)


def test_algos_and_show_default_to_the_backend_run_uses(ocl, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Without a CUDA device `run` and `bench` use OpenCL: so do `algos` and `show` by default."""
    import convforge.backends

    monkeypatch.setattr(convforge.backends, "cuda_available", lambda: False)
    rc, out = run_main(["algos", "--spec", SPEC], capsys)
    assert rc == 0 and f"on {ocl.device.name}" in out.splitlines()[0] and "sm_90" not in out, out
    rc, out = run_main(["show", "--spec", SPEC], capsys)
    assert rc == 0 and "===== opencl =====" in out and "===== cuda =====" not in out, out
    rc, out = run_main(["show", "--spec", SPEC, "--backend", "both"], capsys)
    assert rc == 0 and "===== opencl =====" in out and "===== cuda =====" in out, out
