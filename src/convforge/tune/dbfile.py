"""What a file at the tuning database's path is, and the upgrade of older convforge schemas.

convforge only ever writes to a file it can recognise as its own: a SQLite database carrying
convforge's ``application_id`` (schema 2 on), or a schema-1 database (written before the
identity existed) recognised by its exact tables and columns. Everything else is refused.
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from convforge.files import not_regular

APPLICATION_ID = 0x43466F72  # "CFor"
SQLITE_MAGIC = b"SQLite format 3\x00"

# Schema 1 exactly as convforge <= 0.1.0 wrote it (no application_id then).
V1_COLUMNS = {
    "results": ["device", "backend", "version", "spec", "dtype", "epilogue", "variant", "params",
                "time_ms", "workspace", "error", "date", "spec_json", "heuristic_variant",
                "heuristic_params", "heuristic_ms", "candidates", "seconds"],
    "measurements": ["device", "backend", "version", "spec", "dtype", "epilogue", "variant", "params",
                     "time_ms", "error", "status", "date"],
}


@dataclass(frozen=True)
class FileKind:
    """What is at the path: ``kind`` is "missing", "empty", "ours" (with ``schema``) or "foreign"
    (with ``what``, a phrase naming it)."""

    kind: str
    schema: int = 0
    what: str = ""


def ro_uri(path: Path, immutable: bool = False) -> str:
    """SQLite URI opening ``path`` read-only (never creating it); ``immutable`` also takes no locks
    and creates no ``-shm`` beside it (only for a file nobody writes meanwhile)."""
    return f"file:{quote(str(path.resolve()))}?mode=ro" + ("&immutable=1" if immutable else "")


def read_head(path: Path, size: int | None = 100) -> bytes:
    """The first ``size`` bytes (all with None) of the regular file ``path``. Anything else (a
    FIFO, a device, a folder) is an OSError saying what it is, raised before a read could block:
    the file is opened non-blocking and checked by its descriptor."""
    what = not_regular(os.stat(path).st_mode)
    if what:
        raise IsADirectoryError(f"{path} is {what}") if what == "a directory" else OSError(f"{path} is {what}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        what = not_regular(os.fstat(fd).st_mode)  # swapped for a FIFO since the stat above
        if what:
            raise OSError(f"{path} is {what}")
        if size is not None:
            return os.read(fd, size)
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read()
    finally:
        os.close(fd)


def identify(path: Path) -> FileKind:
    """Classify ``path`` without writing anything to it or beside it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return FileKind("missing")
    except OSError as err:
        if err.errno == errno.EACCES:
            return FileKind("foreign", what=f"unreachable ({err.strerror}: a folder above it may not be entered)")
        return FileKind("foreign", what=f"unreadable ({err.strerror or err})")
    what = not_regular(mode)
    if what:
        return FileKind("foreign", what=what)
    try:
        head = read_head(path)
    except OSError as err:
        return FileKind("foreign", what=f"unreadable ({err.strerror or err})")
    if not head:
        return FileKind("empty")
    if not head.startswith(SQLITE_MAGIC):
        return FileKind("foreign", what=describe(head))
    wal = len(head) > 18 and head[18] == 2
    if len(head) == 100 and int.from_bytes(head[68:72], "big") == APPLICATION_ID:
        ours = FileKind("ours", schema=int.from_bytes(head[60:64], "big"))
        if wal and log_bytes(path) > 0:  # a newer schema may be in the log yet
            seen = _identify_sqlite(path, wal)
            return seen if seen.kind == "ours" else ours
        return ours
    return _identify_sqlite(path, wal)


def side(path: Path, suffix: str) -> Path:
    """SQLite's ``-wal`` / ``-shm`` file (or our ``.lock``) beside ``path``."""
    return path.with_name(path.name + suffix)


def log_bytes(path: Path) -> int:
    """The size of the write-ahead log beside ``path``, 0 where there is none, in one look: another
    process's last close checkpoints and removes the log, between an ``exists()`` and a ``stat()`` too."""
    try:
        return side(path, "-wal").stat().st_size
    except FileNotFoundError:
        return 0


def ro_connect(path: Path, wal: bool, **kw: Any) -> sqlite3.Connection:
    """A read-only connection to ``path`` that creates nothing beside it where it can: a WAL
    database with no write-ahead log (nothing beyond the main file to read) is opened immutable,
    so SQLite makes no ``-shm``; with a log and its ``-shm`` present, plainly read-only."""
    quiet = wal and log_bytes(path) == 0
    return sqlite3.connect(ro_uri(path, immutable=quiet), uri=True, **kw)


def _identify_sqlite(path: Path, wal: bool) -> FileKind:
    """A SQLite file whose header lacks our application_id: ours with the change still in the WAL,
    schema 1 of ours, a blank database, or foreign. Read without creating anything beside it: a
    WAL database whose log lacks its ``-shm`` is inspected in a temporary copy."""
    if wal and log_bytes(path) and not side(path, "-shm").exists():
        with tempfile.TemporaryDirectory(prefix="convforge-inspect-") as tmp:
            copy = Path(tmp) / "db"
            shutil.copyfile(path, copy)
            try:
                shutil.copyfile(side(path, "-wal"), side(copy, "-wal"))
            except FileNotFoundError:  # checkpointed into the main file and removed meanwhile: read that
                return _inspect_sqlite(path, wal)
            return _inspect_sqlite(copy, wal)
    return _inspect_sqlite(path, wal)


def _inspect_sqlite(path: Path, wal: bool) -> FileKind:
    try:
        conn = ro_connect(path, wal)
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if app_id == APPLICATION_ID:
                return FileKind("ours", schema=version)
            tables = {name: [c[1] for c in conn.execute(f"PRAGMA table_info({name!r})")]
                      for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                                  "AND substr(name, 1, 7) != 'sqlite_'")}
        finally:
            conn.close()
    except sqlite3.DatabaseError as err:
        return FileKind("foreign", what=f"an unreadable SQLite file ({err}), not recognisably convforge's")
    if app_id:
        return FileKind("foreign", what=f"a SQLite database of another application (application_id {app_id:#x})")
    if not tables and version == 0:
        return FileKind("empty")
    if tables == V1_COLUMNS and version == 1:
        return FileKind("ours", schema=1)
    names = ", ".join(sorted(tables)) or "none"
    return FileKind("foreign", what=f"a SQLite database of another application (tables: {names})")


def describe(head: bytes) -> str:
    """A phrase naming what a non-SQLite file is, from its first bytes."""
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy array file, not a SQLite database"
    if head.startswith(b"PK\x03\x04"):
        return "a ZIP archive (a .npz, a PyTorch model, ...), not a SQLite database"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip file, not a SQLite database"
    if head.startswith(b"\x80") and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle, not a SQLite database"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # not merely a character cut at the end of the sample
            return "a binary file that is not a SQLite database"
    if b"\x00" in head:
        return "a binary file that is not a SQLite database"
    return "a text file, not a SQLite database"


# -- schema 2 -------------------------------------------------------------------------------
SCHEMA_VERSION = 2
KEY_FIELDS = ("device", "backend", "spec", "dtype", "epilogue", "precision")
SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    device TEXT NOT NULL, backend TEXT NOT NULL, spec TEXT NOT NULL, dtype TEXT NOT NULL,
    epilogue TEXT NOT NULL, precision TEXT NOT NULL, version TEXT NOT NULL,
    variant TEXT NOT NULL, params TEXT NOT NULL, time_ms REAL NOT NULL, workspace INTEGER NOT NULL,
    error REAL NOT NULL, min_error REAL, date TEXT NOT NULL, spec_json TEXT NOT NULL DEFAULT '{}',
    heuristic_variant TEXT NOT NULL DEFAULT '', heuristic_params TEXT NOT NULL DEFAULT '{}',
    heuristic_ms REAL, candidates INTEGER NOT NULL DEFAULT 0, seconds REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (device, backend, spec, dtype, epilogue, precision));
CREATE TABLE IF NOT EXISTS measurements (
    device TEXT NOT NULL, backend TEXT NOT NULL, spec TEXT NOT NULL, dtype TEXT NOT NULL,
    epilogue TEXT NOT NULL, precision TEXT NOT NULL, version TEXT NOT NULL, variant TEXT NOT NULL,
    params TEXT NOT NULL, time_ms REAL, error REAL, status TEXT NOT NULL, date TEXT NOT NULL,
    PRIMARY KEY (device, backend, spec, dtype, epilogue, precision, variant, params));
CREATE TABLE IF NOT EXISTS not_carried (
    date TEXT NOT NULL, entry TEXT NOT NULL, reason TEXT NOT NULL);
"""


def create_schema(conn: sqlite3.Connection) -> None:
    """Schema 2's tables and identity, inside the caller's transaction."""
    for stmt in filter(str.strip, SCHEMA.split(";")):
        conn.execute(stmt)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


# -- schema 1 -> 2 ----------------------------------------------------------------------------
def v1_precision(epilogue: str, error: float | None) -> tuple[str, str, str | None]:
    """(epilogue, precision, why not carried) of a schema-1 epilogue key and measured error: a
    ``|max_error=E`` suffix (or a ``|fp32``/``|relaxed`` one) names the class; otherwise the error
    decides: fp32 up to 5e-6, relaxed up to 1e-3, beyond that the entry is not carried over."""
    from convforge.config import PRECISIONS

    base, *tags = epilogue.split("|")
    for tag in tags:
        if tag.startswith("max_error="):
            try:
                return base, f"max_error={float(tag.split('=', 1)[1]):g}", None
            except ValueError:
                return base, "", f"unreadable precision tag {tag!r}"
    for tag in tags:
        if tag in PRECISIONS:
            return base, tag, None
    if error is None or error != error:
        return base, "", "no measured error"
    for name, bound in sorted(PRECISIONS.items(), key=lambda kv: kv[1]):
        if error <= bound:
            return base, name, None
    worst = max(PRECISIONS.values())
    return base, "", f"measured error {error:.1e} exceeds every precision class (at most {worst:g})"


def migrate_v1(conn: sqlite3.Connection, date: str) -> list[str]:
    """Move a schema-1 database's entries to schema 2 in one transaction; returns one line per entry
    not carried over (also kept in the table ``not_carried``)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("ALTER TABLE results RENAME TO results_v1")
        conn.execute("ALTER TABLE measurements RENAME TO measurements_v1")
        create_schema(conn)
        dropped, carried = _carry_results(conn)
        _carry_measurements(conn, carried)
        conn.execute("DROP TABLE results_v1")
        conn.execute("DROP TABLE measurements_v1")
        conn.executemany("INSERT INTO not_carried VALUES (?, ?, ?)",
                         [(date, entry, reason) for entry, reason in dropped])
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return [f"{entry}: {reason}" for entry, reason in dropped]


def _carry_results(conn: sqlite3.Connection) -> tuple[list[tuple[str, str]], dict[tuple[str, ...], str]]:
    cols = V1_COLUMNS["results"]
    rows = [dict(zip(cols, r, strict=True)) for r in
            conn.execute(f"SELECT {', '.join(cols)} FROM results_v1 ORDER BY date DESC, version DESC")]
    dropped: list[tuple[str, str]] = []
    kept: dict[tuple[str, ...], dict[str, object]] = {}
    carried: dict[tuple[str, ...], str] = {}  # v1 key -> precision, for the measurements
    for r in rows:
        label = f"{r['backend']} {r['spec']} {r['epilogue']} {r['variant']} (version {r['version']}, {r['date']})"
        epi, prec, why = v1_precision(str(r["epilogue"]), _num(r["error"]))
        if why:
            dropped.append((label, why))
            continue
        key = (r["device"], r["backend"], r["spec"], r["dtype"], epi, prec)
        if key in kept:
            newer = kept[key]
            dropped.append((label, f"superseded by the entry of {newer['date']} (version {newer['version']})"))
            continue
        kept[key] = {**r, "epilogue": epi, "precision": prec, "min_error": _min_error(conn, r)}
        carried[tuple(str(r[k]) for k in ("device", "backend", "version", "spec", "dtype", "epilogue"))] = prec
    out = ["device", "backend", "spec", "dtype", "epilogue", "precision", "version", "variant", "params",
           "time_ms", "workspace", "error", "min_error", "date", "spec_json", "heuristic_variant",
           "heuristic_params", "heuristic_ms", "candidates", "seconds"]
    conn.executemany(f"INSERT INTO results ({', '.join(out)}) VALUES ({', '.join('?' for _ in out)})",
                     [tuple(v[c] for c in out) for v in kept.values()])
    return dropped, carried


def _min_error(conn: sqlite3.Connection, r: dict[str, object]) -> float | None:
    """The smallest error any candidate measured on the entry's layer (None when none was kept)."""
    keys = ("device", "backend", "version", "spec", "dtype", "epilogue")
    row = conn.execute("SELECT MIN(error) FROM measurements_v1 WHERE status = 'ok' AND error IS NOT NULL AND "
                       + " AND ".join(f"{k} = ?" for k in keys), tuple(r[k] for k in keys)).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def _carry_measurements(conn: sqlite3.Connection, carried: dict[tuple[str, ...], str]) -> None:
    cols = V1_COLUMNS["measurements"]
    rows = []
    for r in conn.execute(f"SELECT {', '.join(cols)} FROM measurements_v1 ORDER BY date DESC"):
        d = dict(zip(cols, r, strict=True))
        prec = carried.get(tuple(str(d[k]) for k in cols[:6]))
        if prec is not None:
            rows.append((d["device"], d["backend"], d["spec"], d["dtype"], str(d["epilogue"]).split("|")[0],
                         prec, d["version"], d["variant"], d["params"], d["time_ms"], d["error"], d["status"],
                         d["date"]))
    conn.executemany("INSERT OR IGNORE INTO measurements VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) else None
