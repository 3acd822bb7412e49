"""Every sub-command with malformed arguments, bad environment values and foreign files at the
database path: one ``error:`` line (or argparse's usage message), exit status 2, no traceback, and
files that are not convforge's left byte-for-byte unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convforge.config import Config, ConfigError, config
from convforge.tune.db import TuningDB
from helpers import run_main

SPEC = "N=1,C=3,H=9,W=9,K=4,R=3,S=3,pad=1"
SRC = str(Path(__file__).parents[1] / "src")
A_FILE = __file__  # a file where an output folder is expected
OCL = ["--backend", "opencl", "--no-torch"]
BENCH = ["bench", "--suite", "mec", "--limit", "1", "--backend", "opencl", "--baseline", "none"]


MALFORMED = [
    ["algos", "--spec", "N=1,C=3,H=9,W=9,K=4,R=3,S=3,strde=2"],
    ["algos", "--spec", "N=1,C=3,H=9,W=9"],
    ["algos", "--spec", "N=1,C=3,H=x,W=9,K=4,R=3,S=3"],
    ["algos", "--spec", SPEC, "--max-error", "abc"],
    ["algos", "--spec", SPEC, "--max-error", "-1"],
    ["algos", "--spec", "N=1,C=3,H=2,W=2,K=4,R=3,S=3"],
    ["show", "--spec", SPEC, "--variant", "nosuch", "--backend", "opencl"],
    ["show", "--spec", SPEC, "--params", "bogus=1", "--backend", "opencl"],
    ["show", "--spec", SPEC, "--params", "tk=100000", "--backend", "opencl"],
    ["show", "--spec", "N=0,C=3,H=9,W=9,K=4,R=3,S=3", "--backend", "opencl"],
    ["show", "--spec", SPEC, "--backend", "metal"],
    ["tune", "--spec", "N=1,C=3,H=9,W=9,K=4,R=3,S=3,dilaton=2"],
    ["tune", "--budget", "fast", "--spec", SPEC],
    ["tune", "--limit", "many"],
    ["tune"],
    ["bench", "--limit", "x"],
    ["bench", "--suite", "nosuchsuite", "--backend", "opencl", "--baseline", "none"],
    ["db", "frobnicate"],
    ["db", "list", "--spec", "N=1"],
    ["db", "show", "--spec", "N=1,C=3,H=9,W=9,K=4,R=3,S=3,bogus=1"],
    ["devices", "--bogus"],
    ["run", "--net", "nosuchnet", "--backend", "opencl", "--no-torch"],
    ["run", "--net", "alexnet", "--batch", "0", "--backend", "opencl", "--no-torch"],
    ["run", "--net", "alexnet", "--batch", "x"],
    ["run", "--net", "alexnet", "--input-size", "-3", "--backend", "opencl", "--no-torch"],
    ["run", "--net", "alexnet", "--repeats", "0", "--backend", "opencl", "--no-torch"],
    ["run", "--net", "alexnet", "--workspace-limit", "-1", "--backend", "opencl", "--no-torch"],
    ["run"],
    ["tune", "--net", "nosuchnet", "--batch", "1", "--backend", "opencl"],
    ["bench", "--model", "nosuchmodel"],
    ["algos", "--spec", SPEC, "--precision", "fp16"],
    ["tune", "--spec", SPEC, "--precision", "exact"],
    ["db", "import"],
    ["db", "export"],
    ["nosuchcommand"],
    [],
]


# Numbers out of range, contradictory options, unusable output folders, buffers over the device's
# limit: refused before any work (no compile, no model run), with a message naming the option.
REFUSED = [
    (["run", "--net", "alexnet", "--workspace-limit", "inf", *OCL], "--workspace-limit (inf) must be a finite"),
    (["run", "--net", "alexnet", "--workspace-limit", "nan", *OCL], "--workspace-limit (nan) must be a finite"),
    (["run", "--net", "alexnet", "--out", A_FILE, *OCL], f"--out ({A_FILE}) is a file"),
    (["run", "--net", "alexnet", "--out", f"{A_FILE}/sub", *OCL], f"{A_FILE} is a file, not a folder"),
    (["run", "--net", "nin", "--repeats", "1", "--batch", "100000000", *OCL], "needs 64-bit indexing: tensor"),
    (["run", "--net", "nin", "--repeats", "1", "--input-size", "100000", *OCL], "needs 64-bit indexing: tensor"),
    (["tune", "--spec", SPEC, "--spec", SPEC, "--limit", "-1"], "--limit (-1) must be >= 1"),
    (["tune", "--spec", SPEC, "--limit", "0"], "--limit (0) must be >= 1"),
    (["tune", "--spec", SPEC, "--workers", "0"], "--workers (0) must be >= 1"),
    (["tune", "--spec", SPEC, "--workers", "-2"], "--workers (-2) must be >= 1"),
    (["tune", "--spec", SPEC, "--budget", "0"], "--budget ('0') must be > 0"),
    (["tune", "--spec", SPEC, "--budget", "0s"], "--budget ('0s') must be > 0"),
    (["tune", "--spec", SPEC, "--budget", "1s,2,3"], "--budget ('1s,2,3') gives a candidate count twice"),
    (["tune", "--spec", SPEC, "--budget", "1s,2s"], "--budget ('1s,2s') gives a time twice"),
    (["tune", "--net", "nin", "--batch", "0", "--backend", "opencl"], "--batch (0) must be >= 1"),
    (["tune", "--net", "nin", "--spec", SPEC, "--backend", "opencl"], "--net cannot be combined with --spec"),
    (["tune", "--net", "nin", "--suite", "mec", "--backend", "opencl"], "--net cannot be combined with --suite"),
    (["tune", "--net", "nin", "--limit", "2", "--backend", "opencl"], "--limit applies only with --suite / --spec"),
    (["tune", "--spec", SPEC, "--batch", "4"], "--batch applies only with --net"),
    (["tune", "--spec", SPEC, "--bias", "--net", "nin"], "--net cannot be combined with --spec"),
    (["tune", "--net", "nin", "--relu"], "--relu applies only with --suite / --spec"),
    (["tune", "--model", "resnet18", "--workers", "2"], "--workers applies only with --suite / --spec or --net"),
    (["tune", "--spec", SPEC, "--report", A_FILE], f"--report ({A_FILE}) is a file"),
    ([*BENCH, "--repeats", "0"], "--repeats (0) must be >= 1"),
    ([*BENCH, "--repeats", "-3"], "--repeats (-3) must be >= 1"),
    ([*BENCH, "--warmup", "-1"], "--warmup (-1) must be >= 0"),
    ([*BENCH, "--batch-slice", "0"], "--batch-slice (0) must be >= 1"),
    ([*BENCH, "--out", A_FILE], f"--out ({A_FILE}) is a file"),
    (["bench", "--model", "resnet18", "--repeats", "0"], "--repeats (0) must be >= 1"),
    (["bench", "--model", "resnet18", "--limit", "2"], "--model cannot be combined with --limit"),
    (["bench", "--model", "resnet18", "--first-call", "--train"], "add --amp fp16|bf16"),
    (["bench", "--model", "resnet18", "--first-call", "--tune"], "it does not go with --tune"),
]


@pytest.mark.parametrize("argv,says", REFUSED, ids=lambda a: " ".join(a)[:50] if isinstance(a, list) else "")
def test_refused_before_any_work(argv: list[str], says: str, capsys, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")
    rc, out = run_main(argv, capsys)
    assert rc == 2 and "Traceback" not in out and out.count("error:") == 1 and says in out, out


def test_buffer_over_the_device_limit_is_one_line(ocl, capsys, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A batch whose activations pass what the OpenCL device allocates at once (but not 2^31
    elements): refused before any compile, naming CL_DEVICE_MAX_MEM_ALLOC_SIZE."""
    per_image = 96 * 54 * 54  # NiN's largest activation (conv1) per image at 224 x 224
    batch = int(ocl.cl_device.max_mem_alloc_size) // (4 * per_image) + 1
    if batch * per_image > 2**31 - 1:
        pytest.skip(f"{ocl.device.name} allocates 8 GiB or more at once: a batch past it needs 64-bit indexing")
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")
    rc, out = run_main(["run", "--net", "nin", "--repeats", "1", "--batch", str(batch), *OCL], capsys)
    assert rc == 2 and "Traceback" not in out and out.count("error:") == 1, out
    assert "CL_DEVICE_MAX_MEM_ALLOC_SIZE" in out, out


@pytest.mark.parametrize("argv", MALFORMED, ids=lambda a: " ".join(a)[:40] or "none")
def test_malformed_arguments(argv: list[str], capsys, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")
    rc, out = run_main(argv, capsys)
    assert rc == 2, out
    assert "Traceback" not in out and ("error:" in out or "usage:" in out), out


def test_cuda_backend_without_cupy(capsys, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """--backend cuda where CuPy does not import: one error line that says what to install."""
    from convforge import backends

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now raises ImportError
    monkeypatch.delitem(sys.modules, "convforge.backends.cuda", raising=False)
    monkeypatch.setattr(backends, "_INSTANCES", {})
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")
    rc, out = run_main(["run", "--net", "nin", "--input-size", "64", "--backend", "cuda", "--no-torch"], capsys)
    assert rc == 2 and "Traceback" not in out, out
    assert "backend 'cuda' needs CuPy" in out and "convforge[cuda]" in out, out


def test_db_commands_on_missing_and_bad_files(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "none.sqlite")
    for argv in (["db", "--db", db, "list"], ["db", "--db", db, "show"], ["db", "--db", db, "export", "-"]):
        rc, out = run_main(argv, capsys)
        assert rc == 2 and "no tuning database at" in out and "run convforge tune" in out
    assert list(tmp_path.iterdir()) == []
    rc, out = run_main(["db", "--db", str(tmp_path / "nofolder" / "t.sqlite"), "clear"], capsys)
    assert rc == 2 and "does not exist" in out
    bad = tmp_path / "bad.json"
    for text in ("{not json", json.dumps({"format": "convforge-tuning", "entries": [1, "x"]}),
                 json.dumps({"format": "convforge-tuning", "entries": [{"time_ms": "1"}]})):
        bad.write_text(text)
        rc, out = run_main(["db", "--db", str(tmp_path / "t.sqlite"), "import", str(bad)], capsys)
        assert rc in (1, 2) and "Traceback" not in out and ("error" in out or "rejected" in out), out
    rc, out = run_main(["db", "--db", str(tmp_path / "t.sqlite"), "import", str(tmp_path / "nofile.json")], capsys)
    assert rc == 2 and "Traceback" not in out


def test_db_clear_without_a_database_creates_nothing(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Like ``db list``: there is no database, so nothing to clear; no empty database or lock file made."""
    db = str(tmp_path / "none.sqlite")
    rc, out = run_main(["db", "--db", db, "clear"], capsys)
    assert rc == 2 and f"no tuning database at {db}" in out and "nothing to clear" in out, out
    rc, out = run_main(["db", "--db", db, "clear", "--backend", "opencl"], capsys)
    assert rc == 2 and "nothing to clear" in out, out
    assert list(tmp_path.iterdir()) == []


def test_db_export_to_a_folder_leaves_no_temporary(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "t.sqlite")
    TuningDB(db)
    (tmp_path / "adir").mkdir()
    before = sorted(tmp_path.iterdir())
    for target, why in ((tmp_path / "adir", "it is a folder"), (tmp_path / "no" / "x.json", "does not exist")):
        rc, out = run_main(["db", "--db", db, "export", str(target)], capsys)
        assert rc == 2 and f"error: cannot write {target}: " in out and why in out and ".tmp" not in out, out
    assert sorted(tmp_path.iterdir()) == before


def test_cache_dir_that_is_a_file(tmp_path: Path, ocl) -> None:  # type: ignore[no-untyped-def]
    """CONVFORGE_CACHE_DIR naming a file: one error line naming the variable and the path."""
    cache = tmp_path / "x.bin"
    cache.write_bytes(b"x")
    for db in (str(tmp_path / "t.sqlite"), ""):  # the database elsewhere, or in the cache folder
        res = _cli(["tune", "--spec", SPEC, "--backend", "opencl"], CONVFORGE_CACHE_DIR=str(cache), CONVFORGE_DB=db)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.startswith("error:") and res.stderr.count("\n") == 1, res.stderr
        assert "CONVFORGE_CACHE_DIR" in res.stderr and f"{cache} is a file" in res.stderr, res.stderr
    code = "import numpy as np, convforge; a = np.ones((1, 1, 3, 3), np.float32); convforge.conv2d(a, a)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": SRC, "CONVFORGE_CACHE_DIR": str(cache),
                              "CONVFORGE_DB": str(tmp_path / "t.sqlite")})
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and last.startswith("NotADirectoryError: cannot write the compiled-program cache")
    assert "CONVFORGE_CACHE_DIR" in last and f"{cache} is a file" in last, res.stderr
    assert cache.read_bytes() == b"x"


def test_db_import_dry_run_stores_nothing(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import asdict

    from test_db import _entry

    db = tmp_path / "t.sqlite"
    src = tmp_path / "in.json"
    good = asdict(_entry())
    src.write_text(json.dumps({"format": "convforge-tuning", "entries": [good, {**good, "time_ms": "x"}]}))
    TuningDB(db)  # creates the database
    rc, out = run_main(["db", "--db", str(db), "import", "--dry-run", str(src)], capsys)
    assert rc == 1 and "would store 1 entries" in out and "rejected" in out and "time_ms ('x')" in out
    rc, out = run_main(["db", "--db", str(db), "list"], capsys)
    assert rc == 0 and "0 entries" in out
    rc, out = run_main(["db", "--db", str(db), "import", str(src)], capsys)
    assert rc == 1 and "imported 1 entries" in out
    rc, out = run_main(["db", "--db", str(db), "show"], capsys)
    assert rc == 0 and '"error": 1e-07' in out and '"precision": "fp32"' in out


def _foreign(folder: Path) -> list[Path]:
    from test_db import foreign_files

    return list(foreign_files(folder).values())


COMMANDS = [["db", "list"], ["db", "show"], ["db", "export", "-"], ["db", "clear"], ["tune", "--spec", SPEC]]


def test_db_flag_on_foreign_files_leaves_them_unchanged(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from test_db import snapshot

    paths = _foreign(tmp_path)
    before = snapshot(tmp_path)
    for path in paths:
        for cmd in COMMANDS:
            argv = [cmd[0], "--db", str(path), *cmd[1:]] if cmd[0] == "db" else [*cmd, "--db", str(path)]
            rc, out = run_main(argv, capsys)
            assert rc == 2 and str(path) in out and "Traceback" not in out, out
    assert snapshot(tmp_path) == before


def _cli(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": SRC, **env}
    return subprocess.run([sys.executable, "-m", "convforge.cli", *args], capture_output=True, text=True,
                          env=full, timeout=120)


def test_convforge_db_env_on_foreign_files_leaves_them_unchanged(tmp_path: Path) -> None:
    from test_db import snapshot

    (tmp_path / "files").mkdir()
    paths = _foreign(tmp_path / "files")
    before = snapshot(tmp_path / "files")
    for path in paths:
        res = _cli(["db", "list"], CONVFORGE_DB=str(path), CONVFORGE_CACHE_DIR=str(tmp_path / "cache"))
        assert res.returncode == 2 and "Traceback" not in res.stderr + res.stdout
        assert res.stderr.startswith("error:") and str(path) in res.stderr
    assert snapshot(tmp_path / "files") == before


@pytest.mark.parametrize("var,value", [("CONVFORGE_MAX_ERROR", "abc"), ("CONVFORGE_AUTOTUNE", "maybe"),
                                       ("CONVFORGE_PRECISION", "fp16"), ("CONVFORGE_DISK_CACHE", "sometimes"),
                                       ("CONVFORGE_OPENCL_DEVICE", "gpu0")])
def test_bad_environment_is_one_error_line(var: str, value: str, tmp_path: Path) -> None:
    res = _cli(["algos", "--spec", SPEC, "--backend", "cuda"], **{var: value},
               CONVFORGE_CACHE_DIR=str(tmp_path))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error:") and var in res.stderr


def test_bad_environment_at_the_api() -> None:
    cfg = Config({"CONVFORGE_MAX_ERROR": "abc", "CONVFORGE_AUTOTUNE": "maybe"})
    with pytest.raises(ConfigError, match="CONVFORGE_MAX_ERROR.*'abc'.*must be a number"):
        _ = cfg.max_error
    with pytest.raises(ConfigError, match="CONVFORGE_AUTOTUNE"):
        cfg.validate()
    assert cfg.precision == "fp32"
    cfg.max_error, cfg.autotune = None, True  # assigning clears the problem
    cfg.validate()
    assert Config({"CONVFORGE_AUTOTUNE": "Yes"}).autotune is True
    assert Config({"CONVFORGE_AUTOTUNE": "off"}).autotune is False


def test_out_of_device_memory_is_one_line(capsys, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A DeviceMemoryError (or CuPy's OutOfMemoryError, also a MemoryError) from a command: one
    error line naming the bytes asked for and free, exit status 1, no traceback."""
    from convforge.apps.run import run_command
    from convforge.backends.base import DeviceMemoryError

    def too_big(args):  # type: ignore[no-untyped-def]
        raise DeviceMemoryError("workspace of implicit_gemm on N=512", 8 << 30, 1 << 30)

    monkeypatch.setattr(run_command, "main", too_big)
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")
    rc, out = run_main(["run", "--net", "nin"], capsys)
    assert rc == 1 and "Traceback" not in out, out
    assert "error: out of memory: workspace of implicit_gemm on N=512: asked for 8589934592 bytes" in out, out
