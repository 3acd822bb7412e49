"""Issue 62, third round of reliability, and ``db merge`` (issue 64, point 4). One test (or more) per
case, each in a temporary folder:

1 a full disk never costs a database; 2 a new database appears whole to concurrent processes;
3 every input file is a regular file read up to a bound; 4 ``db import`` in one transaction, fast,
with progress; 5 ``auto`` keeps near-overflow answers finite; 6 imported and stored fields are
validated (a bad row is skipped, named); 7 one clear line instead of a traceback (deep JSON and
prototxt, ONNX external data, caffemodel batch norms, shape errors, unusable cache folders);
``db merge`` of several databases and exports.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from convforge.spec import ConvSpec
from convforge.tune.db import DatabaseError, Entry, TuningDB
from convforge.tune.dbfile import APPLICATION_ID, identify, read_head
from helpers import run_main
from test_db import _doc, _entry
from test_reliability import SPEC, _as_unprivileged, _cli, _db_with_entries, _names, _one_error

SRC = str(Path(__file__).parents[1] / "src")


def _spec(h: int) -> ConvSpec:
    return ConvSpec.make(1, 3, h, h, 5, 3, 3, 1, 1)


def _rows(path: Path) -> list[tuple[object, ...]]:
    """The results rows of a database, read without convforge (sorted)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return sorted(conn.execute("SELECT device, spec, variant, time_ms FROM results").fetchall())
    finally:
        conn.close()


def _no_aside(folder: Path) -> None:
    assert not [n for n in _names(folder) if ".bad-" in n], _names(folder)


# -- 1. a full disk ------------------------------------------------------------------------------
def _limit_file_size(size: int):  # type: ignore[no-untyped-def]
    """A preexec_fn: files this child writes may not grow past ``size`` bytes (a full disk, as
    SQLite sees one: its -shm, its log and its file cannot grow)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


@pytest.mark.parametrize("command", ["import", "clear", "list"])
def test_full_disk_at_opening_leaves_the_database_alone(tmp_path: Path, command: str) -> None:
    path = tmp_path / "t.sqlite"
    _db_with_entries(path).close()
    before, rows = path.read_bytes(), _rows(path)
    big = tmp_path / "big.json"
    big.write_text(json.dumps(_doc(*(asdict(_entry(_spec(h))) for h in range(20, 60)))))
    argv = ["db", "--db", str(path), command] + ([str(big)] if command == "import" else [])
    res = subprocess.run([sys.executable, "-m", "convforge.cli", *argv], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": SRC}, preexec_fn=_limit_file_size(len(before)))
    if command == "list":  # reading needs SQLite's -shm, which cannot grow: said, not a traceback
        assert res.returncode in (0, 2) and "Traceback" not in res.stderr, res.stderr
    else:
        _one_error(res, "disk I/O error")
        assert "left as it is" in res.stderr, res.stderr
    assert path.read_bytes() == before and _rows(path) == rows
    _no_aside(tmp_path)


def _full_after_open(monkeypatch, path: Path) -> None:  # type: ignore[no-untyped-def]
    """Connections to ``path`` opened from now on cannot grow the database past its current size:
    SQLite raises SQLITE_FULL ("database or disk is full") on a real file."""
    real = sqlite3.connect

    def connect(target, *args, **kw):  # type: ignore[no-untyped-def]
        conn = real(target, *args, **kw)
        if str(target) == str(path):
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)


def _fill(path: Path) -> None:
    """Entries added to ``path`` until its pages are full (SQLITE_FULL under max_page_count), so
    that any further row needs a page it cannot have."""
    db = TuningDB(path)
    db.conn.execute(f"PRAGMA max_page_count = {db.conn.execute('PRAGMA page_count').fetchone()[0]}")
    h = 101
    with pytest.raises(sqlite3.OperationalError, match="full"):
        while h < 10_000:
            db.put(_entry(_spec(h)))
            h += 2
    db.close()


def test_full_disk_during_import_stores_nothing(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.sqlite"
    _db_with_entries(path).close()
    rows = _rows(path)
    big = tmp_path / "big.json"
    big.write_text(json.dumps(_doc(*(asdict(_entry(_spec(h))) for h in range(20, 220)))))
    _full_after_open(monkeypatch, path)
    rc, out = run_main(["db", "--db", str(path), "import", str(big)], capsys)
    assert rc == 2 and out.count("error:") == 1 and "database or disk is full" in out, out
    assert "Traceback" not in out
    monkeypatch.undo()
    assert _rows(path) == rows  # one transaction: all or nothing
    _no_aside(tmp_path)


def test_full_disk_during_tune_is_an_error_and_keeps_the_database(ocl, tmp_path: Path, monkeypatch,  # type: ignore[no-untyped-def]
                                                                 capsys) -> None:
    path = tmp_path / "t.sqlite"
    _db_with_entries(path).close()
    _fill(path)
    rows = _rows(path)
    _full_after_open(monkeypatch, path)
    rc, out = run_main(["tune", "--db", str(path), "--spec", "N=1,C=3,H=13,W=13,K=5,R=3,S=3,pad=1", "--backend",
                        "opencl", "--force", "--budget", "1"], capsys)
    assert rc == 1 and out.count("error:") == 1 and "database or disk is full" in out, out
    assert "Traceback" not in out
    monkeypatch.undo()
    assert _rows(path) == rows
    _no_aside(tmp_path)


def test_only_a_failed_integrity_check_sets_a_database_aside(tmp_path: Path) -> None:
    from convforge.tune.db import is_damage

    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = 13  # type: ignore[attr-defined]
    io = sqlite3.OperationalError("disk I/O error")
    io.sqlite_errorcode = 10 | (4 << 8)  # type: ignore[attr-defined]  # SQLITE_IOERR_WRITE
    corrupt = sqlite3.DatabaseError("database disk image is malformed")
    corrupt.sqlite_errorcode = 11  # type: ignore[attr-defined]
    assert not is_damage(full) and not is_damage(io) and is_damage(corrupt)
    bad = tmp_path / "bad.sqlite"
    _db_with_entries(bad, 40).close()
    data = bad.read_bytes()
    bad.write_bytes(data[:4096 + 8] + b"\xff" * 300 + data[4096 + 308:])  # a table page: integrity check fails
    with pytest.warns(RuntimeWarning, match="moved to"):
        TuningDB(bad).close()
    assert any(".bad-" in n for n in _names(tmp_path))


# -- 2. a new database, created by several processes at once -------------------------------------
def test_a_new_database_carries_its_identity_in_the_file_itself(tmp_path: Path) -> None:
    """The file appears whole: its own header names it convforge's while the creator still holds it
    open (before, the identity lived in the write-ahead log until the creator closed it, and a
    process reading the file in between could see the tables without it)."""
    path = tmp_path / "new.sqlite"
    db = TuningDB(path)
    try:
        head = read_head(path)
        assert int.from_bytes(head[68:72], "big") == APPLICATION_ID and int.from_bytes(head[60:64], "big") == 2
        assert identify(path).kind == "ours"
    finally:
        db.close()
    assert not [n for n in _names(tmp_path) if n.endswith(".new")]  # no temporary left


def _open_and_put(path: str, start: float, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    while time.time() < start:
        pass
    try:
        db = TuningDB(path)
        db.put(_entry(_spec(13), time_ms=0.5 + os.getpid() % 7 / 10))
        db.close()
        out.put("ok")
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put(f"{type(err).__name__}: {err}")


def test_processes_creating_one_database_all_see_it_whole(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    for round_ in range(4):
        path = str(tmp_path / f"t{round_}.sqlite")
        out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
        start = time.time() + 1.0
        procs = [ctx.Process(target=_open_and_put, args=(path, start, out)) for _ in range(5)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        got = [out.get(timeout=10) for _ in procs]
        assert got == ["ok"] * len(procs), got
        assert identify(Path(path)).kind == "ours" and len(TuningDB(path, readonly=True).entries()) == 1


def test_a_log_removed_while_it_is_looked_at_is_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's last close checkpoints the write-ahead log into the file and removes it: between
    an exists() and a stat(), or while identify() copies it aside, the log may vanish. Then there is no
    log (the file holds everything): no FileNotFoundError (before: one in five processes creating one
    database under load)."""
    from convforge.tune import dbfile

    path = tmp_path / "db.sqlite"
    TuningDB(path).close()
    assert dbfile.log_bytes(path) == 0
    (tmp_path / "db.sqlite-wal").write_bytes(b"\0" * 4096)  # a log, no -shm: identify() copies both aside
    real = shutil.copyfile

    def vanishing(src: object, dst: object) -> object:
        if str(src).endswith("-wal"):
            os.unlink(str(src))
            raise FileNotFoundError(2, "No such file or directory", str(src))
        return real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(dbfile.shutil, "copyfile", vanishing)
    assert identify(path).kind == "ours"


# -- 3. bounded reads of regular files -------------------------------------------------------------
def test_read_bounded_refuses_devices_fifos_and_oversize_files(tmp_path: Path) -> None:
    from convforge.files import InputFileError, read_bounded

    with pytest.raises(InputFileError, match="/dev/zero is a character device"):
        read_bounded("/dev/zero", "suite")
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match="is a FIFO"):
        read_bounded(fifo, "suite")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 5000)
    with pytest.raises(InputFileError, match=r"big.json is 4.883 KiB; convforge reads at most 4 KiB of a suite"):
        read_bounded(big, "suite", limit=4096)
    status = read_bounded("/proc/self/status", "suite", limit=1 << 20)  # reports 0 bytes, holds more
    assert status.startswith(b"Name:")
    with pytest.raises(InputFileError, match="larger than 16 bytes"):
        read_bounded("/proc/self/status", "suite", limit=16)
    with pytest.raises(FileNotFoundError, match="cannot read .*missing"):
        read_bounded(tmp_path / "missing", "suite")


@pytest.mark.parametrize("suite", ["/dev/zero", "FIFO", "/proc/self/status"])
def test_tune_suite_that_is_no_regular_json_file(tmp_path: Path, suite: str) -> None:
    if suite == "FIFO":
        suite = str(tmp_path / "suite.fifo")
        os.mkfifo(suite)
    res = _cli(["tune", "--db", str(tmp_path / "t.sqlite"), "--suite", suite, "--backend", "opencl"], timeout=60)
    _one_error(res, suite)
    assert ("not valid JSON" in res.stderr) == suite.startswith("/proc")
    assert not (tmp_path / "t.sqlite").exists()


def test_weights_prototxt_and_onnx_fifos_do_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "w.fifo"
    os.mkfifo(fifo)
    res = _cli(["run", "--net", "nin", "--weights", str(fifo), "--backend", "opencl"], timeout=60)
    _one_error(res, f"caffemodel: {fifo} is a FIFO")
    for name, load in (("net.prototxt", "from convforge.graph.caffe import load_prototxt as load"),
                       ("m.onnx", "from convforge.graph.from_onnx import load_onnx as load")):
        os.mkfifo(tmp_path / name)
        code = f"{load}\ntry:\n    load({str(tmp_path / name)!r})\nexcept ValueError as err:\n    print(err)"
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": SRC})
        assert f"{name} is a FIFO" in res.stdout, (res.stdout, res.stderr[-2000:])


# -- 4. db import: one transaction, a progress bar, fast -----------------------------------------
def test_import_of_20000_entries_is_one_fast_transaction(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """20,000 entries of a fleet: 2,000 devices x 10 layers. All stored in one transaction, the
    progress callback followed to the end; the time is printed (the report states it)."""
    base = [asdict(_entry(_spec(h))) for h in range(13, 33, 2)]
    items = [{**e, "device": f"cuda|NVIDIA H200 #{d}", "time_ms": 0.5 + d / 1e4} for d in range(2000) for e in base]
    src = tmp_path / "fleet.json"
    src.write_text(json.dumps(_doc(*items)))
    db = TuningDB(tmp_path / "t.sqlite")
    writes = []
    real = TuningDB._write

    def counted(self):  # type: ignore[no-untyped-def]
        writes.append(1)
        return real(self)

    monkeypatch.setattr(TuningDB, "_write", counted)
    seen: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    rep = db.import_json(src, on_progress=lambda done, total: seen.append((done, total)))
    seconds = time.perf_counter() - t0
    print(f"imported {len(items)} entries in {seconds:.2f} s: {len(items) / seconds:.0f} entries/s")
    assert len(rep.stored) == len(items) and not rep.rejected and len(writes) == 1
    assert seen[-1] == (len(items), len(items)) and len(seen) > 10
    assert len(db.entries()) == len(items)
    assert seconds < 60  # generous: about 2 s here (10,000 entries per second) on a loaded 2-core machine
    rep = db.import_json(src)  # again: every entry is there already, as fast
    assert len(rep.kept) == len(items) and not rep.stored


def test_import_prints_a_bounded_report(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    items = [asdict(_entry(_spec(13), device=f"cuda|gpu {d}")) for d in range(60)] + [{"bogus": 1}] * 3
    src = tmp_path / "in.json"
    src.write_text(json.dumps(_doc(*items)))
    rc, out = run_main(["db", "--db", str(tmp_path / "t.sqlite"), "import", str(src)], capsys)
    assert rc == 1 and "... and 40 more" in out and out.count("rejected entry") == 3, out
    assert "imported 60 entries" in out


# -- 5. auto near FP32's range -------------------------------------------------------------------
def test_auto_keeps_a_finite_answer_finite_near_overflow(ocl) -> None:
    """Inputs in [1.6e37, 3.2e37], positive filters, 3 channels: some answers pass FLT_MAX (+Inf,
    as the reference's), the rest are finite. Winograd F(2x2), which 'auto' picks on ordinary data,
    shares its intermediates across a 2x2 output tile: a neighbour's overflow turns finite answers
    (from 0.4 FLT_MAX) into Inf. 'auto' now sees the range and runs an exact family."""
    import convforge
    from convforge import dispatch
    from convforge.dispatch.choice import needs_finite_exact
    from convforge.plan import Epilogue
    from convforge.reference import conv2d_ref

    rng = np.random.default_rng(0)
    x = rng.uniform(1.6e37, 3.2e37, (1, 3, 9, 9)).astype(np.float32)
    w = rng.uniform(0.0, 1.0, (4, 3, 3, 3)).astype(np.float32)
    spec = ConvSpec.make(1, 3, 9, 9, 4, 3, 3, 1, 1)
    fmax = float(np.finfo(np.float32).max)
    picked = dispatch.choose(spec, ocl).variant
    assert picked.family == "winograd"
    ref = conv2d_ref(x.astype(np.float64), w.astype(np.float64), spec)
    finite = np.abs(ref) < fmax
    assert 0 < finite.sum() < ref.size
    wino = convforge.conv2d(x, w, padding=1, algo=picked.name)  # a named variant runs as named
    assert (~np.isfinite(wino) & finite).sum() > 10
    got = convforge.conv2d(x, w, padding=1)
    assert np.isfinite(got[finite]).all() and np.isposinf(got[~finite]).all()
    assert np.abs(got[finite] - ref[finite]).max() < 1e-6 * fmax
    ordinary = rng.standard_normal((1, 3, 9, 9)).astype(np.float32)
    assert not needs_finite_exact(spec, ocl, Epilogue(), ordinary, w)  # ordinary data: the fast family stays
    assert needs_finite_exact(spec, ocl, Epilogue(), x, w)


def test_the_finite_exact_setting_keeps_auto_off_winograd_for_every_array_kind(ocl, monkeypatch) -> None:
    """CONVFORGE_FINITE_EXACT (config.finite_exact): 'auto' runs an exact family without reading the
    arrays (the switch for torch and CuPy tensors, which are not read on the host); off, Winograd stays."""
    from convforge import dispatch
    from convforge.config import Config, config

    spec = ConvSpec.make(1, 3, 9, 9, 4, 3, 3, 1, 1)
    assert Config({}).finite_exact is False and Config({"CONVFORGE_FINITE_EXACT": "1"}).finite_exact is True
    assert dispatch.choose(spec, ocl).variant.family == "winograd"
    monkeypatch.setattr(config, "finite_exact", True)
    assert dispatch.choose(spec, ocl).variant.family != "winograd"


def test_overflow_factors_and_thresholds() -> None:
    """The factors the docstring's table states (3x3 filters) and what they decide."""
    from conftest import NOMINAL_CUDA
    from convforge.dispatch.choice import growth, may_overflow
    from convforge.kernels import get_variant

    spec = ConvSpec.make(1, 64, 56, 56, 64, 3, 3, 1, 1)
    want = {"winograd_fused_f2": (64, 4), "winograd_fused_f4": (2304, 100), "winograd_nonfused_f6": (4579, 2500),
            "winograd_nonfused_f7": (74598, 62500)}
    for name, (prod, inp) in want.items():
        got = growth(get_variant(name), spec)
        assert got is not None and round(got[0]) == prod and round(got[1]) == inp, (name, got)
    assert growth(get_variant("implicit_gemm"), spec) is None and growth(get_variant("direct"), spec) is None
    f2 = get_variant("winograd_fused_f2")
    assert f2.applies(spec, NOMINAL_CUDA) is None
    assert not may_overflow(f2, spec, 1e6, 1e6) and may_overflow(f2, spec, 3e35, 1.0)
    assert may_overflow(f2, spec, float("nan"), 1.0) and may_overflow(f2, spec, float("inf"), 1.0)


def test_algo_that_is_not_a_string_is_one_clear_error(ocl) -> None:
    import convforge

    x = np.ones((1, 2, 5, 5), np.float32)
    w = np.ones((3, 2, 3, 3), np.float32)
    for algo in (["direct"], {"direct": 1}, 3):
        with pytest.raises(TypeError, match=r"algo \(.*\) must be a string: 'auto', a family"):
            convforge.conv2d(x, w, algo=algo)  # type: ignore[arg-type]


# -- 6. fields validated on import and on read ------------------------------------------------------
def test_import_refuses_values_no_measurement_produces(tmp_path: Path) -> None:
    good = asdict(_entry())
    bad = {
        "negative heuristic time": ({**good, "heuristic_ms": -1.0}, "heuristic_ms (-1.0) must be >= 0"),
        "huge time": ({**good, "time_ms": 1e300}, "time_ms (1e+300) is implausible"),
        "escape codes": ({**good, "version": "0.1\x1b[2J"}, "version ('0.1\\x1b[2J') holds control characters"),
        "huge device": ({**good, "device": "cuda|" + "x" * 1_000_000}, "longer than 256 characters"),
        "params text": ({**good, "params": "not json"}, "params ('not json') is not JSON"),
        "time text": ({**good, "time_ms": "fast"}, "time_ms ('fast') must be a finite number"),
        "negative seconds": ({**good, "seconds": -3.0}, "seconds (-3.0) must be >= 0"),
    }
    db = TuningDB(tmp_path / "t.sqlite")
    rep = db.import_json(_doc(good, *(b for b, _ in bad.values())))
    assert len(rep.stored) == 1 and len(rep.rejected) == len(bad)
    for (_label, why), (name, (_item, needle)) in zip(rep.rejected, bad.items()):
        assert needle in why and len(why) < 400, (name, why)


def _corrupt_rows(path: Path) -> None:
    """Rows no tuner writes, put in by hand: non-JSON params, text in time_ms, a negative time,
    an escape code in the version, a huge device name."""
    conn = sqlite3.connect(path)
    base = asdict(_entry(_spec(41)))
    cols = list(base)
    edits = [{"params": "not json", "spec": "a"}, {"time_ms": "fast", "spec": "b"}, {"time_ms": -1.0, "spec": "c"},
             {"version": "\x1b[31mred", "spec": "d"}, {"device": "cuda|" + "x" * 100_000, "spec": "e"}]
    for edit in edits:
        row = {**base, **edit}
        conn.execute(f"INSERT INTO results ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                     [row[c] for c in cols])
    conn.commit()
    conn.close()


def test_bad_rows_are_skipped_with_a_warning_naming_them(tmp_path: Path, capsys, caplog) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.sqlite"
    _db_with_entries(path).close()
    _corrupt_rows(path)
    with caplog.at_level("WARNING", logger="convforge.tune"):
        rc, out = run_main(["db", "--db", str(path), "list"], capsys)
    assert rc == 0 and "3 entries" in out and "Traceback" not in out, out
    said = "\n".join(r.getMessage() for r in caplog.records)
    for needle in ("params ('not json') is not JSON", "time_ms ('fast') must be a finite number",
                   "time_ms (-1.0) must be >= 0", "holds control characters", "longer than 256 characters"):
        assert needle in said, needle
    assert "\x1b" not in said
    for argv in (["show"], ["export", "-"]):
        rc, out = run_main(["db", "--db", str(path), *argv], capsys)
        assert rc == 0 and "Traceback" not in out, out
    db = TuningDB(path)
    key = asdict(_entry(_spec(41)))
    assert db.get(key["device"], "cuda", "a", key["dtype"], "none", "fp32") is None
    rep = db.import_json(_doc(asdict(replace(_entry(_spec(41)), spec="b"))))  # over a row whose time is text
    assert len(rep.rejected) == 1  # its spec does not match its spec_json: rejected, nothing crashed


def test_results_table_without_min_error_is_migrated(tmp_path: Path, capsys, caplog) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.sqlite"
    _db_with_entries(path).close()
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE results DROP COLUMN min_error")
    conn.commit()
    conn.close()
    rc, out = run_main(["db", "--db", str(path), "list"], capsys)  # read-only: read as NULL
    assert rc == 0 and "3 entries" in out, out
    with caplog.at_level("WARNING", logger="convforge.tune"):
        db = TuningDB(path)
    assert "added the column(s) min_error" in caplog.text
    assert len(db.entries()) == 3 and db.put(_entry(_spec(51), min_error=1e-7))
    db.close()
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE results DROP COLUMN variant")
    conn.commit()
    conn.close()
    rc, out = run_main(["db", "--db", str(path), "list"], capsys)
    assert rc == 2 and "lacks the column(s) variant" in out and "Traceback" not in out, out


# -- 7. one line instead of a traceback ------------------------------------------------------------
def test_json_nested_100000_deep(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    rc, out = run_main(["db", "--db", str(tmp_path / "t.sqlite"), "import", str(deep)], capsys)
    assert rc == 2 and "nested deeper" in out and out.count("\n") == 1 and "Traceback" not in out, out
    rc, out = run_main(["tune", "--db", str(tmp_path / "t.sqlite"), "--suite", str(deep)], capsys)
    assert rc == 2 and "nested deeper" in out and "Traceback" not in out, out
    assert not (tmp_path / "t.sqlite").exists()


def test_prototxt_nested_deeply() -> None:
    from convforge.graph.caffe import load_prototxt
    from convforge.graph.prototxt import PrototxtError

    with pytest.raises(PrototxtError, match="nested deeper than 100 levels"):
        load_prototxt("a { " * 100_000 + "}" * 100_000 + "\n")


def _onnx_with_external(folder: Path) -> Path:
    """A one-conv ONNX model whose weight lies in ``w.bin`` beside it."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    w = np.arange(4 * 3 * 9, dtype=np.float32).reshape(4, 3, 3, 3) / 100
    graph = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["y"], name="conv", pads=[1, 1, 1, 1])], "t",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = folder / "m.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="w.bin",
                    size_threshold=0)
    return path


def _relocate(path: Path, location: str) -> None:
    import onnx

    model = onnx.load_model(str(path), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    path.write_bytes(model.SerializeToString())


def test_onnx_external_data_only_from_the_models_folder(tmp_path: Path) -> None:
    from convforge.graph.from_onnx import load_onnx
    from convforge.graph.ir import GraphError

    folder = tmp_path / "model"
    folder.mkdir()
    path = _onnx_with_external(folder)
    g = load_onnx(str(path))
    assert np.allclose(g.weights["conv.w"].ravel(), np.arange(108, dtype=np.float32) / 100)
    outside = tmp_path / "secret.bin"
    shutil.copy(folder / "w.bin", outside)
    (folder / "link.bin").symlink_to(outside)
    (folder / "proc.bin").symlink_to("/proc/self/environ")
    cases = {"gone.bin": "is missing", str(outside): "is an absolute path", "../secret.bin": "with '..'",
             "link.bin": "symbolic link", "proc.bin": "symbolic link", "/proc/self/environ": "absolute path"}
    for location, says in cases.items():
        _relocate(path, location)
        with pytest.raises(GraphError) as err:
            load_onnx(str(path))
        msg = str(err.value)
        assert says in msg and "m.onnx" in msg and "'W'" in msg and "\n" not in msg, (location, msg)
    proto = __import__("onnx").load_model(str(path), load_external_data=False)
    with pytest.raises(GraphError, match="give the model's path"):
        load_onnx(proto)


def _varint(v: int) -> bytes:
    out = b""
    while True:
        b, v = v & 0x7F, v >> 7
        out += bytes([b | (0x80 if v else 0)])
        if not v:
            return out


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _caffemodel(path: Path, layers: dict[str, list[np.ndarray]]) -> None:
    body = b"".join(_ld(100, _ld(1, name.encode()) + b"".join(_ld(7, _ld(5, np.asarray(b, "<f4").tobytes()))
                                                                for b in blobs)) for name, blobs in layers.items())
    path.write_bytes(_ld(1, b"net") + body)


NET = ('name: "t" input: "data" input_shape { dim: 1 dim: 3 dim: 8 dim: 8 }\n'
       'layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" '
       'convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }\n'
       'layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }\n')


@pytest.mark.parametrize("bn, says", [
    ([np.zeros(4)], r"layer 'bn' \(BatchNorm\): the caffemodel has 1 blob\(s\)"),
    ([np.zeros(4), -np.ones(4), np.ones(1)], r"node 'bn' \(batchnorm\): the variance .* 4 negative value"),
    ([np.zeros(4), np.ones(3), np.ones(1)], r"the caffemodel has 3 blob\(s\) of \[4, 3, 1\] values"),
])
def test_caffemodel_batchnorm_blobs(tmp_path: Path, bn: list[np.ndarray], says: str) -> None:
    from convforge.graph.caffe import load_prototxt
    from convforge.graph.ir import GraphError

    weights = tmp_path / "m.caffemodel"
    _caffemodel(weights, {"conv": [np.ones(108), np.zeros(4)], "bn": bn})
    with pytest.raises(GraphError, match=says) as err:
        load_prototxt(NET, weights=weights)
    assert str(weights) in str(err.value)


def test_shape_errors_name_the_tensor_the_layer_and_the_file(tmp_path: Path) -> None:
    from convforge.graph.caffe import load_prototxt
    from convforge.graph.ir import GraphError

    weights = tmp_path / "m.caffemodel"
    _caffemodel(weights, {"conv": [np.ones(100), np.zeros(4)], "bn": [np.zeros(4), np.ones(4), np.ones(1)]})
    with pytest.raises(GraphError, match=rf"caffemodel {weights}: layer 'conv': caffemodel blob 0 \(w\) has 100"):
        load_prototxt(NET, weights=weights)
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from convforge.graph.from_onnx import load_onnx

    graph = helper.make_graph([helper.make_node("Conv", ["x", "W5"], ["y"], name="conv1", pads=[1, 1, 1, 1])], "t",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones((4, 5, 3, 3), np.float32), "W5")])
    path = tmp_path / "bad.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    with pytest.raises(GraphError) as err:
        load_onnx(str(path))
    msg = str(err.value)
    assert "bad.onnx" in msg and "'conv1'" in msg and "'W5'" in msg and "(4, 5, 3, 3)" in msg, msg


def test_onnx_batchnorm_with_negative_variance(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    from onnx import helper

    from convforge.graph.build import load_model
    from convforge.graph.ir import GraphError
    from test_graph_errors import _model

    inits = {"g": np.ones(3, np.float32), "b": np.zeros(3, np.float32), "m": np.zeros(3, np.float32),
             "v": np.array([1.0, -0.5, 2.0], np.float32)}
    node = helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["y"], name="bn")
    with pytest.raises(GraphError, match=r"node 'bn' \(batchnorm\): the variance .* 1 negative value\(s\), the "
                                         r"smallest -0.5"):
        load_model(_model(node, inits=inits))


def _unprivileged_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "CONVFORGE_CACHE_DIR",
                                                            "POCL_CACHE_DIR", "CONVFORGE_DB")}
    return {**env, "HOME": str(home), "PYTHONPATH": SRC}


CONV = ("import numpy as np, convforge; a = np.ones((1, 2, 5, 5), np.float32); "
        "print(convforge.conv2d(a, np.ones((3, 2, 3, 3), np.float32)).shape)")


def test_unwritable_or_untraversable_home(tmp_path: Path) -> None:
    prefix = _as_unprivileged()
    if prefix is None:
        pytest.skip("running as root without user namespaces: file permissions cannot make a folder read-only")
    ro, closed = tmp_path / "ro", tmp_path / "closed"
    ro.mkdir()
    closed.mkdir()
    try:
        ro.chmod(0o555)
        closed.chmod(0o000)
        for home in (ro, closed / "home"):
            env = _unprivileged_env(home)
            run = lambda argv, env=env: subprocess.run([*prefix, sys.executable, *argv], capture_output=True,  # noqa: E731
                                              text=True, env=env, timeout=300)
            res = run(["-m", "convforge.cli", "devices"])
            assert res.returncode == 0 and "opencl" in res.stdout and "Traceback" not in res.stderr, res.stderr
            assert "PoCL and PyOpenCL cache in" in res.stderr
            res = run(["-c", CONV])
            assert res.returncode == 0 and "(1, 3, 3, 3)" in res.stdout, res.stderr
            assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr
            res = run(["-m", "convforge.cli", "tune", "--spec", SPEC, "--backend", "opencl", "--budget", "1"])
            assert res.returncode == 2 and "Traceback" not in res.stderr and "Errno" not in res.stderr, res.stderr
            assert res.stderr.count("error:") == 1 and "tuning database" in res.stderr, res.stderr
    finally:
        closed.chmod(0o755)
        ro.chmod(0o755)


def test_a_4000_character_cache_path(tmp_path: Path) -> None:
    long = tmp_path.joinpath(*["d" * 200] * 19)
    assert len(str(long)) > 3800
    res = _cli(["tune", "--spec", SPEC, "--backend", "opencl", "--budget", "1"], timeout=300,
               CONVFORGE_CACHE_DIR=str(long), CONVFORGE_DB="")
    _one_error(res, "SQLite opens paths of at most 512")
    res = subprocess.run([sys.executable, "-c", CONV], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": SRC, "CONVFORGE_CACHE_DIR": str(long),
                              "CONVFORGE_AUTOTUNE": "1", "CONVFORGE_DB": ""})
    assert res.returncode == 0 and "(1, 3, 3, 3)" in res.stdout and "Traceback" not in res.stderr, res.stderr
    assert "at most 512" in res.stderr


def test_devices_says_when_opencl_offers_none(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("pyopencl")
    from convforge.backends import opencl

    monkeypatch.setattr(opencl, "list_devices", lambda: [])
    rc, out = run_main(["devices"], capsys)
    assert rc == 0 and "no OpenCL device" in out, out


# -- db merge (issue 64, point 4) -------------------------------------------------------------------
def test_merge_keeps_the_fastest_entry_per_layer_and_device(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    a, b, c = tmp_path / "a.sqlite", tmp_path / "b.sqlite", tmp_path / "c.sqlite"
    h200, a100 = "cuda|NVIDIA H200", "cuda|NVIDIA A100"
    da, db_ = TuningDB(a), TuningDB(b)
    da.put(_entry(_spec(13), device=h200, time_ms=0.5))
    da.put(_entry(_spec(15), device=h200, time_ms=0.3))
    db_.put(_entry(_spec(13), device=h200, time_ms=0.4))  # faster: wins
    db_.put(_entry(_spec(15), device=h200, time_ms=0.9))  # slower: a's stays
    db_.put(_entry(_spec(13), device=a100, time_ms=2.0))  # another device model: kept beside
    da.close()
    db_.close()
    export = tmp_path / "e.json"
    export.write_text(json.dumps(_doc(asdict(_entry(_spec(17), device=a100, time_ms=1.0)),
                                      {**asdict(_entry(_spec(19), device=a100)), "time_ms": -1})))
    TuningDB(c).put(_entry(_spec(13), device=a100, time_ms=1.5))  # C exists: its faster entry stays
    rc, out = run_main(["db", "merge", str(a), str(b), str(export), "--into", str(c)], capsys)
    assert rc == 1 and "1 rejected" in out and "time_ms (-1) must be >= 0" in out, out
    got = {(e.device, e.spec): e.time_ms for e in TuningDB(c, readonly=True).entries()}
    assert got == {(h200, _spec(13).key()): 0.4, (h200, _spec(15).key()): 0.3, (a100, _spec(13).key()): 1.5,
                   (a100, _spec(17).key()): 1.0}
    rc, out = run_main(["db", "merge", str(a), "--into", str(tmp_path / "new.sqlite")], capsys)
    assert rc == 0 and len(TuningDB(tmp_path / "new.sqlite", readonly=True).entries()) == 2, out


def test_merge_refuses_missing_corrupt_or_foreign_inputs_before_writing(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    a = tmp_path / "a.sqlite"
    _db_with_entries(a).close()
    corrupt = tmp_path / "corrupt.sqlite"
    _db_with_entries(corrupt, 40).close()
    data = corrupt.read_bytes()
    corrupt.write_bytes(data[:4096 + 8] + b"\xff" * 300 + data[4096 + 308:])
    npy = tmp_path / "w.npy"
    np.save(npy, np.zeros(3))
    c = tmp_path / "c.sqlite"
    for bad, says in ((tmp_path / "gone.sqlite", "no such file"), (corrupt, "corrupt or truncated"),
                      (npy, "NumPy array file")):
        rc, out = run_main(["db", "merge", str(a), str(bad), "--into", str(c)], capsys)
        assert rc == 2 and says in out and out.count("error:") == 1 and "Traceback" not in out, out
        assert not c.exists()
    rc, out = run_main(["db", "--db", str(a), "merge", str(a), "--into", str(c)], capsys)
    assert rc == 2 and "--into" in out


def test_merge_on_a_full_disk_leaves_the_target_as_it_was(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    a, c = tmp_path / "a.sqlite", tmp_path / "c.sqlite"
    db = TuningDB(a)
    for h in range(13, 213, 2):
        db.put(_entry(_spec(h)))
    db.close()
    _db_with_entries(c).close()
    rows = _rows(c)
    _full_after_open(monkeypatch, c)
    rc, out = run_main(["db", "merge", str(a), "--into", str(c)], capsys)
    assert rc == 2 and "database or disk is full" in out and out.count("error:") == 1, out
    monkeypatch.undo()
    assert _rows(c) == rows
    _no_aside(tmp_path)


def test_entry_rows_round_trip_through_validation() -> None:
    """What the tuner stores passes the read-side validation (nothing it writes is ever skipped)."""
    from convforge.tune.validate import row_problem

    e = replace(_entry(), heuristic_ms=0.7, heuristic_variant="direct", candidates=4, seconds=1.5, min_error=1e-8)
    assert row_problem(asdict(e)) is None
    assert Entry(**asdict(e)) == e
    with pytest.raises(DatabaseError):
        TuningDB("/nonexistent-folder/x.sqlite")


def test_result_files_are_written_whole_or_not_at_all(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Bench and run results (JSON, CSV, plots) go through a temporary file renamed into place: a
    writer that fails half-way leaves the previous file as it was and no temporary file beside it."""
    from convforge.files import csv_text, write_atomic, write_atomic_bytes

    path = write_atomic(tmp_path / "out" / "results.json", '{"rows": [1]}\n')
    assert path.read_text() == '{"rows": [1]}\n'

    def half(f) -> None:  # type: ignore[no-untyped-def]
        f.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic_bytes(path, half)
    assert path.read_text() == '{"rows": [1]}\n'
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.json"]
    assert csv_text(["a", "b"], [{"a": 1, "b": 2, "c": 3}]).splitlines() == ["a,b", "1,2"]
