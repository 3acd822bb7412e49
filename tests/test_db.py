"""The tuning database's file handling: only its own files, read-only opening, the schema-1 upgrade
(on a committed database written by schema-1 code) and validated imports."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from convforge.config import config
from convforge.kernels import get_variant
from convforge.spec import ConvSpec
from convforge.tune import clear_choices, open_db
from convforge.tune.db import SCHEMA_VERSION, DatabaseError, Entry, NoDatabase, TuningDB, now
from convforge.tune.dbfile import APPLICATION_ID, identify

FIXTURE = Path(__file__).parent / "fixtures" / "tuning-v1.sqlite"
SPEC = ConvSpec.make(1, 3, 13, 13, 5, 3, 3, 1, 1)


def foreign_files(folder: Path) -> dict[str, Path]:
    """A text file, a NumPy file and another application's SQLite database."""
    text = folder / "notes.txt"
    text.write_text("my notes\n" * 50)
    npy = folder / "weights.npy"
    np.save(npy, np.arange(100, dtype=np.float32))
    other = folder / "app.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE results (id INTEGER, value TEXT)")
    conn.execute("INSERT INTO results VALUES (1, 'theirs')")
    conn.commit()
    conn.close()
    return {"text": text, "npy": npy, "sqlite": other}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("readonly", [False, True])
def test_foreign_files_refused_byte_for_byte(tmp_path: Path, readonly: bool) -> None:
    files = foreign_files(tmp_path)
    before = snapshot(tmp_path)
    for what, path in files.items():
        with pytest.raises(DatabaseError) as err:
            TuningDB(path, readonly=readonly)
        msg = str(err.value)
        assert str(path) in msg and "\n" not in msg
        assert {"text": "text file", "npy": "NumPy", "sqlite": "another application"}[what] in msg
    assert snapshot(tmp_path) == before  # unchanged, nothing renamed, nothing created beside


def test_open_db_with_foreign_file_is_none_and_untouched(tmp_path: Path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    files = foreign_files(tmp_path)
    before = snapshot(tmp_path)
    for path in files.values():
        clear_choices()
        monkeypatch.setattr(config, "db_path", path)
        assert open_db() is None and open_db(write=True) is None
    clear_choices()
    assert snapshot(tmp_path) == before


def test_readonly_missing_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "none.sqlite"
    with pytest.raises(NoDatabase, match="no tuning database at .*run convforge tune"):
        TuningDB(path, readonly=True)
    with pytest.raises(FileNotFoundError):
        TuningDB(path, readonly=True)
    assert open_db(path) is None
    assert list(tmp_path.iterdir()) == []


def test_conv2d_lookup_creates_no_database(ocl, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from convforge import conv2d

    monkeypatch.setattr(config, "db_path", tmp_path / "tuning.sqlite")
    monkeypatch.setattr(config, "autotune", False)
    clear_choices()
    try:
        conv2d(np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32))
    finally:
        clear_choices()
    assert list(tmp_path.iterdir()) == []


def test_readonly_refuses_writes(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "t.sqlite")
    db.put(_entry())
    db.close()
    ro = TuningDB(tmp_path / "t.sqlite", readonly=True)
    assert len(ro.entries()) == 1
    with pytest.raises(DatabaseError, match="read-only"):
        ro.put(_entry())
    with pytest.raises(DatabaseError, match="read-only"):
        ro.clear()


def test_explicit_folder_must_exist(tmp_path: Path) -> None:
    with pytest.raises(DatabaseError, match="does not exist"):
        TuningDB(tmp_path / "missing" / "t.sqlite")
    assert list(tmp_path.iterdir()) == []


def test_default_cache_folder_is_created(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(config, "cache_dir", tmp_path / "cache" / "convforge")
    db = TuningDB(config.cache_dir / "tuning.sqlite")
    assert db.path.exists()


def test_identity(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "t.sqlite")
    app, ver = (db.conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("application_id", "user_version"))
    assert (app, ver) == (APPLICATION_ID, SCHEMA_VERSION) == (0x43466F72, 2)
    assert identify(db.path).kind == "ours"


def test_newer_schema_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite"
    TuningDB(path).conn.execute("PRAGMA user_version = 3")
    before = path.read_bytes()
    for readonly in (False, True):
        with pytest.raises(DatabaseError, match="newer convforge"):
            TuningDB(path, readonly=readonly)
    assert path.read_bytes() == before


# -- the schema-1 fixture -------------------------------------------------------------------
CLASSES = {("cuda", "none"): ("fp32", "direct", 3e-6), ("cuda", "bias_relu"): ("max_error=5e-05",
           "winograd_nonfused_f4", 4e-5), ("cuda", "relu"): ("relaxed", "winograd_nonfused_f7", 5e-5),
           ("opencl", "none"): ("fp32", "direct", 3e-6)}


def _check_migrated(db: TuningDB) -> None:
    got = {(e.backend, e.epilogue): (e.precision, e.variant, e.error) for e in db.entries()}
    assert got == CLASSES
    reasons = "\n".join(db.not_carried)
    assert len(db.not_carried) == 2
    assert "bias winograd_nonfused_f7" in reasons and "exceeds every precision class" in reasons
    assert "implicit_gemm (version 0.0.9" in reasons and "superseded" in reasons
    direct = db.entries(backend="cuda", epilogue="none")[0]
    assert direct.min_error == 3e-6 and direct.version == "0.1.0"  # min_error from the v1 measurements
    assert {m.variant for m in db.measurements(direct.key)} == {"direct", "winograd_nonfused_f7"}


def test_v1_fixture_migrates_in_place(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "tuning.sqlite"
    shutil.copy(FIXTURE, path)
    original = path.read_bytes()
    assert identify(path).schema == 1
    with caplog.at_level("WARNING", logger="convforge.tune"):
        db = TuningDB(path)
    _check_migrated(db)
    assert "upgraded to schema 2" in caplog.text and "not carried over" in caplog.text
    backups = list(tmp_path.glob("tuning.sqlite.v1-backup-*"))
    assert len(backups) == 1 and identify(backups[0]).schema == 1
    assert {(r[0], r[1]) for r in sqlite3.connect(backups[0]).execute("SELECT backend, epilogue FROM results")} \
        == {(r[0], r[1]) for r in sqlite3.connect(FIXTURE).execute("SELECT backend, epilogue FROM results")}
    assert original == FIXTURE.read_bytes()
    db.close()
    again = TuningDB(path, readonly=True)  # the log of what was not carried stays in the file
    assert again.not_carried == [] and len(again.not_carried_log()) == 2
    assert len(again.entries()) == 4


def test_v1_fixture_readonly_reads_through_memory(tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite"
    shutil.copy(FIXTURE, path)
    before = snapshot(tmp_path)
    _check_migrated(TuningDB(path, readonly=True))
    assert snapshot(tmp_path) == before


def test_v1_fixture_serves_lookups(tmp_path: Path) -> None:
    """After the upgrade the tuner finds the fp32 entry under today's key."""
    from convforge.plan import Epilogue
    from convforge.tune.tuner import Budget, Tuner

    path = tmp_path / "tuning.sqlite"
    shutil.copy(FIXTURE, path)
    db = TuningDB(path)
    cuda_entry = db.entries(backend="cuda", epilogue="none")[0]

    from conftest import NOMINAL_CUDA

    class FakeBackend:  # the fixture's CUDA entries were tuned on NOMINAL_CUDA
        name = "cuda"
        device = NOMINAL_CUDA

    assert cuda_entry.device == NOMINAL_CUDA.key()
    tuner = Tuner(FakeBackend(), db, Budget(None, 1))  # type: ignore[arg-type]
    assert tuner.lookup(SPEC, Epilogue(), "fp32") == cuda_entry
    assert tuner.lookup(SPEC, Epilogue(), "relaxed") is None
    assert tuner.key(SPEC, Epilogue(True, True), "max_error=5e-05") in {e.key for e in db.entries()}


# -- imports -----------------------------------------------------------------------------
def _entry(spec: ConvSpec = SPEC, **kw: object) -> Entry:
    from conftest import NOMINAL_CUDA

    prm = get_variant("direct").default(spec, NOMINAL_CUDA)
    base = dict(device="cuda|nominal", backend="cuda", version="0.1.0", spec=spec.key(), dtype=spec.dtype,
                epilogue="none", variant="direct", params=prm.to_json(), time_ms=0.5, workspace=0, error=1e-7,
                date=now(), spec_json=json.dumps(spec.to_dict(), sort_keys=True))
    base.update(kw)
    return Entry(**base)  # type: ignore[arg-type]


def _doc(*items: object) -> dict[str, object]:
    return {"format": "convforge-tuning", "schema": 2, "entries": list(items)}


def test_import_rejects_bad_entries_with_reasons(tmp_path: Path) -> None:
    from dataclasses import asdict

    good = asdict(_entry())
    bad = {
        "bogus params": {**good, "params": {"tile_k": 100000, "bogus": 1}},
        "huge value": {**good, "params": {**json.loads(good["params"]), "tk": 100000}},
        "string time": {**good, "time_ms": "fast"},
        "implausible time": {**good, "time_ms": 1e-9},
        "unknown variant": {**good, "variant": "magic"},
        "not an object": [1, 2, 3],
        "no spec_json": {**good, "spec_json": "{}"},
        "wrong backend": {**good, "backend": "metal"},
        "bad precision": {**good, "precision": "fp8"},
    }
    db = TuningDB(tmp_path / "t.sqlite")
    rep = db.import_json(_doc(good, *bad.values()))
    assert len(rep.stored) == 1 and len(rep.rejected) == len(bad)
    text = "\n".join(f"{label}: {why}" for label, why in rep.rejected)
    for needle in ("missing", "bogus", "tk (100000)", "time_ms ('fast')", "implausible", "unknown variant",
                   "JSON object", "spec_json", "backend ('metal')", "precision ('fp8')"):
        assert needle in text, needle
    assert len(db.entries()) == 1


def test_import_dry_run_and_v1_exports(tmp_path: Path) -> None:
    from dataclasses import asdict

    v1 = {k: v for k, v in asdict(_entry(error=5e-5)).items() if k not in ("precision", "min_error")}
    db = TuningDB(tmp_path / "t.sqlite")
    rep = db.import_json(_doc(v1, {**v1, "epilogue": "relu|max_error=5e-05"}), dry_run=True)
    assert [(e.epilogue, e.precision) for e in rep.stored] == [("none", "relaxed"), ("relu", "max_error=5e-05")]
    assert db.entries() == []


@pytest.mark.parametrize("text", ["not json", "[]", '{"format": "other"}',
                                  '{"format": "convforge-tuning", "entries": 5}'])
def test_malformed_document_is_one_error(tmp_path: Path, text: str) -> None:
    src = tmp_path / "in.json"
    src.write_text(text)
    with pytest.raises(ValueError):
        TuningDB(tmp_path / "t.sqlite").import_json(src)


def test_export_to_a_folder_or_missing_folder_names_the_target(tmp_path: Path) -> None:
    """The error names the file asked for (never a temporary), and no temporary file is left."""
    db = TuningDB(tmp_path / "t.sqlite")
    db.put(_entry())
    (tmp_path / "adir").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(IsADirectoryError, match=f"{tmp_path / 'adir'}: it is a folder") as info:
        db.export_json(tmp_path / "adir")
    assert ".tmp" not in str(info.value)
    with pytest.raises(FileNotFoundError, match="folder .*nofolder does not exist") as info:
        db.export_json(tmp_path / "nofolder" / "x.json")
    assert ".tmp" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    db.export_json(tmp_path / "out.json")
    assert json.loads((tmp_path / "out.json").read_text())["entries"][0]["variant"] == _entry().variant
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["out.json"])


def test_export_failing_midway_leaves_no_temporary(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import os

    db = TuningDB(tmp_path / "t.sqlite")
    before = sorted(p.name for p in tmp_path.iterdir())

    def fail(src: object, dst: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(PermissionError, match=f"cannot write {tmp_path / 'x.json'}: Permission denied"):
        db.export_json(tmp_path / "x.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_default_cache_folder_that_is_a_file(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """CONVFORGE_CACHE_DIR naming a file: a DatabaseError naming the folder and the variable."""
    cache = tmp_path / "cache.bin"
    cache.write_bytes(b"x")
    monkeypatch.setattr(config, "cache_dir", cache)
    with pytest.raises(DatabaseError, match=f"database .*: {cache} is a file, not a folder .*CONVFORGE_CACHE_DIR"):
        TuningDB(cache / "tuning.sqlite")
    assert cache.read_bytes() == b"x"
