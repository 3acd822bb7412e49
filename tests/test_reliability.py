"""Issue 34, second round of reliability: nothing overwritten, nothing left behind, nothing blocking,
no silent wrong answer. One test (or more) per case of the issue, each in a temporary folder:

1 db export onto the database it reads / onto existing files; 2 another program's WAL database;
3 FIFOs at the database path and as import input; 7 read-only files and folders; 8 corrupt and
truncated databases; 9 ``params`` with 0/1 for switches; 10 imports that break the class rule or
carry bad fields; 11 the rest (prototxt batch, tune without CuPy, db filters, a closed pipe).
Cases 4 and 5 (index width, non-finite values) are in test_index_width.py and test_nonfinite.py,
case 6 (output names) in test_graph_outputs.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from convforge.config import config
from convforge.tune import clear_choices, open_db
from convforge.tune.db import DatabaseError, TuningDB
from convforge.tune.dbfile import identify
from helpers import run_main

SRC = str(Path(__file__).parents[1] / "src")
SPEC = "N=1,C=3,H=9,W=9,K=4,R=3,S=3,pad=1"


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.is_fifo()}


def _db_with_entries(path: Path, count: int = 3) -> TuningDB:
    from convforge.spec import ConvSpec
    from test_db import _entry

    db = TuningDB(path)
    for h in range(13, 13 + 2 * count, 2):
        db.put(_entry(ConvSpec.make(1, 3, h, h, 5, 3, 3, 1, 1)))
    return db


def _cli(args: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process: a command that would block fails the test by its timeout."""
    full = {**os.environ, "PYTHONPATH": SRC, **env}
    return subprocess.run([sys.executable, "-m", "convforge.cli", *args], capture_output=True, text=True,
                          env=full, timeout=timeout)


def _one_error(res: subprocess.CompletedProcess[str], says: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr and res.stderr.startswith("error:"), res.stderr
    assert res.stderr.count("\n") == 1 and says in res.stderr, res.stderr


# -- 1. db export ------------------------------------------------------------------------------
def test_export_never_writes_onto_the_database_it_reads(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "D.sqlite"
    _db_with_entries(path).close()
    before = path.read_bytes()
    for target in (path, tmp_path / "D.sqlite-wal", tmp_path / "." / "D.sqlite"):
        for force in ([], ["--force"]):
            rc, out = run_main(["db", "--db", str(path), "export", str(target), *force], capsys)
            assert rc == 2 and "it is the tuning database being read" in out and "exported" not in out, out
    assert path.read_bytes() == before and identify(path).kind == "ours"
    link = tmp_path / "link.json"
    link.symlink_to(path)
    rc, out = run_main(["db", "--db", str(path), "export", str(link), "--force"], capsys)
    assert rc == 2 and "it is the tuning database being read" in out, out
    rc, out = run_main(["db", "--db", str(path), "list"], capsys)
    assert rc == 0 and "3 entries" in out, out


def test_export_refuses_an_existing_file_unless_forced(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from test_db import foreign_files

    path = tmp_path / "D.sqlite"
    _db_with_entries(path).close()
    (tmp_path / "other").mkdir()
    files = foreign_files(tmp_path / "other")
    before = _snapshot(tmp_path / "other")
    for target in files.values():
        rc, out = run_main(["db", "--db", str(path), "export", str(target)], capsys)
        assert rc == 2 and f"{target} exists" in out and "--force" in out and out.count("error:") == 1, out
    assert _snapshot(tmp_path / "other") == before
    rc, out = run_main(["db", "--db", str(path), "export", str(files["text"]), "--force"], capsys)
    assert rc == 0 and "exported 3 entries" in out, out
    assert len(json.loads(files["text"].read_text())["entries"]) == 3
    rc, out = run_main(["db", "--db", str(path), "export", str(tmp_path / "new.json")], capsys)
    assert rc == 0 and (tmp_path / "new.json").exists(), out


# -- 2. another program's database in WAL mode ---------------------------------------------------
def _wal_app(path: Path, keep_log: bool = False) -> sqlite3.Connection | None:
    """Another program's SQLite database in WAL mode; ``keep_log``: a connection stays open with
    a committed change still in the log (``-wal`` and ``-shm`` beside it)."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (1)")
    conn.commit()
    if not keep_log:
        conn.close()
        return None
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("INSERT INTO t VALUES (2)")
    conn.commit()
    return conn


def test_foreign_wal_database_gets_nothing_beside_it(ocl, capsys, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from convforge import conv2d

    path = tmp_path / "app.sqlite"
    _wal_app(path)
    before = _snapshot(tmp_path)
    for argv in (["db", "--db", str(path), "list"], ["db", "--db", str(path), "export", "-"],
                 ["db", "--db", str(path), "clear"], ["tune", "--db", str(path), "--spec", SPEC,
                                                       "--backend", "opencl"]):
        rc, out = run_main(argv, capsys)
        assert rc == 2 and "another application (tables: t)" in out, out
        assert _snapshot(tmp_path) == before, argv
    monkeypatch.setattr(config, "db_path", path)
    for autotune in (False, True):
        monkeypatch.setattr(config, "autotune", autotune)
        clear_choices()
        try:
            conv2d(np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32))
        finally:
            clear_choices()
        assert _snapshot(tmp_path) == before
    assert _names(tmp_path) == ["app.sqlite"]


def test_foreign_wal_log_without_its_shm_is_read_in_a_copy(tmp_path: Path) -> None:
    """A log whose -shm is gone (deleted, or another host's): inspected in a temporary copy."""
    path = tmp_path / "app.sqlite"
    conn = _wal_app(path, keep_log=True)
    assert conn is not None
    shutil.copyfile(path, tmp_path / "copy.sqlite")
    shutil.copyfile(tmp_path / "app.sqlite-wal", tmp_path / "copy.sqlite-wal")
    conn.close()
    copy = tmp_path / "copy.sqlite"
    (tmp_path / "app.sqlite").unlink()
    before = _snapshot(tmp_path)
    assert identify(copy).kind == "foreign" and "tables: t" in identify(copy).what
    for readonly in (True, False):
        with pytest.raises(DatabaseError, match="another application"):
            TuningDB(copy, readonly=readonly)
    assert _snapshot(tmp_path) == before and _names(tmp_path) == ["copy.sqlite", "copy.sqlite-wal"]


def test_foreign_wal_database_in_use_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "app.sqlite"
    conn = _wal_app(path, keep_log=True)
    assert conn is not None
    names = _names(tmp_path)
    assert names == ["app.sqlite", "app.sqlite-shm", "app.sqlite-wal"]
    for readonly in (True, False):
        with pytest.raises(DatabaseError, match="another application"):
            TuningDB(path, readonly=readonly)
    assert _names(tmp_path) == names
    assert [r[0] for r in conn.execute("SELECT x FROM t")] == [1, 2]
    conn.close()


# -- 3. FIFOs and other files that are not regular -----------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifo_at_the_database_path_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "db.fifo"
    os.mkfifo(fifo)
    env = {"CONVFORGE_CACHE_DIR": str(tmp_path / "cache")}
    for argv in (["db", "--db", str(fifo), "list"], ["db", "--db", str(fifo), "clear"],
                 ["db", "--db", str(fifo), "export", "-"],
                 ["tune", "--db", str(fifo), "--spec", SPEC, "--backend", "opencl"]):
        _one_error(_cli(argv, timeout=60, **env), "is a FIFO (named pipe), not a regular file")
    code = ("import numpy as np, convforge; a = np.ones((1, 1, 3, 3), np.float32); "
            "print(convforge.conv2d(a, a).shape)")
    for auto in ("0", "1"):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": SRC, "CONVFORGE_DB": str(fifo),
                                  "CONVFORGE_AUTOTUNE": auto, **env})
        assert res.returncode == 0 and "(1, 1, 1, 1)" in res.stdout, res.stderr[-2000:]
        assert "is a FIFO" in res.stderr  # logged once; the heuristic ran
    # nothing beside the FIFO but the program cache (none on PoCL, which keeps its own)
    names = _names(tmp_path)
    assert names in (["db.fifo"], ["cache", "db.fifo"]), names
    assert "cache" not in names or _names(tmp_path / "cache") in ([], ["programs"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifo_as_import_input_or_export_target(tmp_path: Path) -> None:
    db = tmp_path / "t.sqlite"
    _db_with_entries(db).close()
    names = _names(tmp_path)
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    _one_error(_cli(["db", "--db", str(db), "import", str(fifo)], timeout=60),
               f"cannot import {fifo}: {fifo} is a FIFO (named pipe), not a regular file")
    _one_error(_cli(["db", "--db", str(tmp_path / "new.sqlite"), "import", str(fifo)], timeout=60), "is a FIFO")
    _one_error(_cli(["db", "--db", str(db), "export", str(fifo), "--force"], timeout=60), "is a FIFO")
    assert _names(tmp_path) == sorted(names + ["in.fifo"])  # no new.sqlite, no lock, no temporary


def test_folder_or_device_as_database_or_import_input(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    db = tmp_path / "t.sqlite"
    _db_with_entries(db).close()
    rc, out = run_main(["db", "--db", str(db), "import", str(tmp_path)], capsys)
    assert rc == 2 and "is a directory" in out and "Traceback" not in out, out
    if os.path.exists("/dev/null"):  # a device reads as empty here; a terminal or /dev/zero would never end
        _one_error(_cli(["db", "--db", str(db), "import", "/dev/null"], timeout=60),
                   "character device, not a regular file")
        for argv in (["list"], ["clear"]):
            _one_error(_cli(["db", "--db", "/dev/null", *argv], timeout=60), "character device")


# -- 7. read-only database files and folders -----------------------------------------------------
def _as_unprivileged() -> list[str] | None:
    """A command prefix that runs without root's power to write anything: none needed for a
    normal user; for root (containers, CI images) a user namespace (``unshare --user``), where
    root's files keep their permission bits. None when neither works."""
    if os.geteuid() != 0:
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    try:
        ok = subprocess.run([unshare, "--user", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [unshare, "--user"] if ok else None


def _cli_unprivileged(prefix: list[str], args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    cache = tmp / "cache"
    cache.mkdir(exist_ok=True)
    cache.chmod(0o777)
    env = {**os.environ, "PYTHONPATH": SRC, "CONVFORGE_CACHE_DIR": str(cache)}
    return subprocess.run([*prefix, sys.executable, "-m", "convforge.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_read_only_database_file_and_folder(tmp_path: Path) -> None:
    prefix = _as_unprivileged()
    if prefix is None:
        pytest.skip("running as root without user namespaces: file permissions cannot make a file read-only")
    ro_file, ro_dir = tmp_path / "a", tmp_path / "b"
    ro_file.mkdir()
    ro_dir.mkdir()
    for folder in (ro_file, ro_dir):
        _db_with_entries(folder / "D.sqlite").close()
        (folder / "D.sqlite.lock").unlink()
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"format": "convforge-tuning", "schema": 2, "entries": []}))
    (ro_file / "D.sqlite").chmod(0o444)
    ro_dir.chmod(0o555)
    try:
        for folder, why in ((ro_file, "is read-only (no write permission)"), (ro_dir, "is read-only; SQLite")):
            db = str(folder / "D.sqlite")
            for argv in (["db", "--db", db, "clear"], ["db", "--db", db, "import", str(src)],
                         ["tune", "--db", db, "--spec", SPEC, "--backend", "opencl"]):
                res = _cli_unprivileged(prefix, argv, tmp_path)
                _one_error(res, why)
            for argv in (["db", "--db", db, "list"], ["db", "--db", db, "export", "-"]):
                res = _cli_unprivileged(prefix, argv, tmp_path)
                assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
                assert "3 entries" in res.stdout or res.stdout.count('"variant"') == 3, res.stdout
            assert _names(folder) == ["D.sqlite"]  # no -wal, -shm or .lock beside it
        res = _cli_unprivileged(prefix, ["db", "--db", str(ro_dir / "new.sqlite"), "import", str(src)], tmp_path)
        _one_error(res, "is read-only")
        assert _names(ro_dir) == ["D.sqlite"]
    finally:
        ro_dir.chmod(0o755)


# -- 8. corrupt and truncated databases ----------------------------------------------------------
def test_corrupt_or_truncated_database_is_named_as_such(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    good = tmp_path / "good.sqlite"
    _db_with_entries(good, 40).close()
    data = good.read_bytes()
    trunc, corrupt = tmp_path / "trunc.sqlite", tmp_path / "corrupt.sqlite"
    trunc.write_bytes(data[: len(data) // 2])
    corrupt.write_bytes(data[:4096 + 8] + b"\xff" * 300 + data[4096 + 308:])
    for path in (trunc, corrupt):
        before = path.read_bytes()
        for argv in (["list"], ["show"], ["export", "-"], ["export", str(tmp_path / "out.json")]):
            rc, out = run_main(["db", "--db", str(path), *argv], capsys)
            assert rc == 2 and "Traceback" not in out and out.count("error:") == 1, out
            assert f"tuning database {path} is corrupt or truncated" in out, out
        assert path.read_bytes() == before and not (tmp_path / "out.json").exists()


# -- 9. conv2d(params=...) takes the spellings its messages use ----------------------------------
def test_params_switches_take_0_and_1(ocl) -> None:
    from convforge import conv2d
    from convforge.kernels import check_params, get_variant
    from convforge.spec import ConvSpec

    x = np.random.default_rng(0).standard_normal((1, 3, 9, 9)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32)
    spec = ConvSpec.from_shapes(x.shape, w.shape, padding=1)
    direct = get_variant("direct")
    default = direct.default(spec, ocl.device)
    with pytest.raises(ValueError) as info:
        conv2d(x, w, padding=1, algo="direct", params={"ldg": 0})  # incomplete: the message shows the default
    shown = str(info.value).split("its default here is ")[1].rstrip(")")
    prm = dict(kv.split("=") for kv in shown.split())
    got = conv2d(x, w, padding=1, algo="direct", params={k: int(v) for k, v in prm.items()})
    want = conv2d(x, w, padding=1, algo="direct", params=dict(default))
    assert np.array_equal(got, want)
    assert check_params(direct, spec, ocl.device, {**default, "ldg": 1, "wconst": 0})["ldg"] is True
    with pytest.raises(ValueError, match=r"ldg \(2\) must be true or false \(or 1 / 0\)"):
        check_params(direct, spec, ocl.device, {**default, "ldg": 2})


# -- 10. imports: the class rule and every stored field ------------------------------------------
def test_import_applies_the_class_rule_and_checks_every_field(tmp_path: Path) -> None:
    from test_db import _entry

    good = asdict(_entry())
    bad = {
        "fp32 entry at 5e-4": ({**good, "error": 5e-4}, "exceeds what precision 'fp32' admits"),
        "fp32 beyond 2x the best": ({**good, "error": 2e-5, "min_error": 8e-6}, "exceeds what precision"),
        "relaxed beyond 1e-3": ({**good, "precision": "relaxed", "error": 2e-3}, "'relaxed' admits"),
        "max_error bound": ({**good, "precision": "max_error=1e-05", "error": 3e-5}, "'max_error=1e-05' admits"),
        "min_error above error": ({**good, "error": 1e-6, "min_error": 2e-6}, "min_error (2e-06)"),
        "negative min_error": ({**good, "min_error": -1.0}, "min_error (-1.0)"),
        "no error": ({k: v for k, v in good.items() if k != "error"}, "lacks error"),
        "yesterday": ({**good, "date": "yesterday"}, "date ('yesterday') must be an ISO 8601"),
        "future": ({**good, "date": "2999-01-01T00:00:00+00:00"}, "lies in the future"),
        "empty device": ({**good, "device": ""}, "device ('') must name a device"),
        "blank device": ({**good, "device": "  "}, "must name a device"),
        "other back-end's device": ({**good, "device": "opencl|x||"}, "is a opencl device, but backend is 'cuda'"),
        "dtype": ({**good, "dtype": "float16"}, "dtype ('float16') does not match the layer's ('float32')"),
    }
    admitted = [{**good, "error": 9e-6, "min_error": 5e-6}, {**good, "precision": "relaxed", "error": 5e-4}]
    db = TuningDB(tmp_path / "t.sqlite")
    rep = db.import_json({"format": "convforge-tuning", "schema": 2,
                          "entries": [*admitted, *(item for item, _ in bad.values())]}, only_if_faster=False)
    assert len(rep.stored) == 2 and len(rep.rejected) == len(bad), rep.rejected
    for (_label, why), (name, (_, needle)) in zip(rep.rejected, bad.items(), strict=True):
        assert needle in why, (name, why)
    dup = [why for _, why in rep.rejected if "dtype" in why][0]
    assert "'float16'" in dup and "'float32'" in dup
    assert {e.precision for e in db.entries()} == {"fp32", "relaxed"}


@pytest.mark.parametrize("schema, says", [(99, "newer than this convforge reads (2)"), ("2", "must be an int"),
                                          (0, "must be an int from 1 to 2"), (True, "must be an int")])
def test_import_refuses_a_document_of_another_schema(capsys, tmp_path: Path, schema: object, says: str) -> None:  # type: ignore[no-untyped-def]
    from test_db import _entry

    src = tmp_path / "in.json"
    src.write_text(json.dumps({"format": "convforge-tuning", "schema": schema, "entries": [asdict(_entry())]}))
    db = tmp_path / "t.sqlite"
    rc, out = run_main(["db", "--db", str(db), "import", str(src)], capsys)
    assert rc == 2 and says in out and out.count("error:") == 1 and "Traceback" not in out, out
    assert _names(tmp_path) == ["in.json"]  # the document is refused before the database is touched


# -- 11. the rest ----------------------------------------------------------------------------
def test_prototxt_batch_is_used_or_said(ocl, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A declared batch is run unless --batch says otherwise; a batch that does not fit is one error."""
    from convforge.graph.build import compile as compile_net

    text = ('name: "b"\ninput: "data"\ninput_dim: {n}\ninput_dim: 3\ninput_dim: 9\ninput_dim: 9\n'
            'layer {{ name: "c1" type: "Convolution" bottom: "data" top: "c1" '
            'convolution_param {{ num_output: 4 kernel_size: 3 }} }}\n')
    small, big = tmp_path / "small.prototxt", tmp_path / "big.prototxt"
    small.write_text(text.format(n=3))
    big.write_text(text.format(n=100_000_000))
    assert compile_net(str(small), backend="opencl").shapes["data"].shape[0] == 3
    assert compile_net(str(small), batch=2, backend="opencl").shapes["data"].shape[0] == 2
    rc, out = run_main(["run", "--net", str(small), "--backend", "opencl", "--no-torch", "--repeats", "1"], capsys)
    assert rc == 0 and "| small | 3 | opencl |" in out and "b: batch 3 (declared by the description" in out, out
    rc, out = run_main(["run", "--net", str(big), "--backend", "opencl", "--no-torch", "--repeats", "1"], capsys)
    assert rc == 2 and "Traceback" not in out and out.count("error:") == 1 and "use a smaller batch" in out, out
    rc, out = run_main(["run", "--net", str(big), "--batch", "1", "--backend", "opencl", "--no-torch",
                        "--repeats", "1"], capsys)
    assert rc == 0 and "| big | 1 | opencl |" in out, out


def test_tune_cuda_without_cupy_leaves_nothing(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['cupy'] = None; from convforge.cli import main; "
            f"sys.exit(main(['tune', '--db', {str(tmp_path / 't.sqlite')!r}, '--spec', {SPEC!r}, "
            "'--backend', 'cuda']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": SRC, "CONVFORGE_CACHE_DIR": str(tmp_path / "cache")})
    _one_error(res, "backend 'cuda' needs CuPy")
    assert not (tmp_path / "t.sqlite").exists() and not (tmp_path / "t.sqlite.lock").exists()


def test_db_filters_are_checked(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "D.sqlite"
    _db_with_entries(path).close()
    for argv in (["clear", "--backend", "vulkan"], ["list", "--backend", "metal"], ["export", "-", "--backend", "x"]):
        rc, out = run_main(["db", "--db", str(path), *argv], capsys)
        assert rc == 2 and "invalid choice" in out and "deleted" not in out, out
    rc, out = run_main(["db", "--db", str(path), "list", "--variant", "nosuch"], capsys)
    assert rc == 2 and "unknown variant 'nosuch'" in out, out
    rc, out = run_main(["db", "--db", str(path), "list"], capsys)
    assert rc == 0 and "3 entries" in out


def test_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """``convforge algos ... | head -1``: the reader leaves early; no error, no traceback."""
    env = {**os.environ, "PYTHONPATH": SRC, "CONVFORGE_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "convforge.cli", "algos", "--spec", SPEC],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert first.startswith(b"N1 C3") and "Broken pipe" not in err and "Traceback" not in err, err
    assert rc in (0, 141), rc


def test_open_db_on_a_truncated_file_uses_the_heuristic(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """conv2d's lookups (open_db) on a corrupt file: a warning and the heuristic, nothing written."""
    path = tmp_path / "t.sqlite"
    _db_with_entries(path, 40).close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    (tmp_path / "t.sqlite.lock").unlink()
    before = _snapshot(tmp_path)
    clear_choices()
    monkeypatch.setattr(config, "db_path", path)
    try:
        assert open_db() is None
    finally:
        clear_choices()
    assert _snapshot(tmp_path) == before


def test_opencl_skips_a_device_that_cannot_build_and_names_each_when_none_can(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """PyPI's PoCL bundles an LLVM that refuses CPUs it does not know ("unknown target CPU 'generic'"
    on AMD Zen 5): the back-end takes the first device that builds a trivial kernel, and when none
    does, says which refused and what to do instead of failing every kernel later."""
    cl_mod = pytest.importorskip("convforge.backends.opencl")
    devices = [d for p in cl_mod.cl.get_platforms() for d in p.get_devices()]
    if not devices:
        pytest.skip("no OpenCL device")
    working = [d for d in devices if cl_mod.build_refusal(d) is None]
    if not working:
        pytest.fail("no OpenCL device on this machine builds a kernel: " + cl_mod._HINT)
    first = working[0]
    refuse_first = lambda d: "error: unknown target CPU 'generic'" if d == first else None  # noqa: E731
    monkeypatch.setattr(cl_mod, "build_refusal", refuse_first)
    if len(working) > 1:
        assert cl_mod._pick("") == working[1]
    monkeypatch.setattr(cl_mod, "build_refusal", lambda d: "error: unknown target CPU 'generic'")
    with pytest.raises(RuntimeError, match=r"no OpenCL device builds a kernel .*unknown target CPU.*pocl-opencl-icd"):
        cl_mod._pick("")
