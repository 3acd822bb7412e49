"""The tuning database: SQLite (WAL) holding the best variant and parameters per device, back-end,
convforge version, layer, dtype and epilogue, plus every candidate measured (for reports).

Several processes may tune at once: writes are short ``BEGIN IMMEDIATE`` transactions under a busy
timeout. A corrupt or older-format file is moved aside (renamed with a timestamp) and rebuilt with a
warning; opening the database never raises because of what is on disk.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import sqlite3
import threading
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
EXPORT_FORMAT = "convforge-tuning"
BUSY_TIMEOUT_S = 60.0
KEY_FIELDS = ("device", "backend", "version", "spec", "dtype", "epilogue")

log = logging.getLogger("convforge.tune")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    device TEXT NOT NULL, backend TEXT NOT NULL, version TEXT NOT NULL, spec TEXT NOT NULL,
    dtype TEXT NOT NULL, epilogue TEXT NOT NULL,
    variant TEXT NOT NULL, params TEXT NOT NULL, time_ms REAL NOT NULL, workspace INTEGER NOT NULL,
    error REAL NOT NULL, date TEXT NOT NULL, spec_json TEXT NOT NULL DEFAULT '{}',
    heuristic_variant TEXT NOT NULL DEFAULT '', heuristic_params TEXT NOT NULL DEFAULT '{}',
    heuristic_ms REAL, candidates INTEGER NOT NULL DEFAULT 0, seconds REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (device, backend, version, spec, dtype, epilogue));
CREATE TABLE IF NOT EXISTS measurements (
    device TEXT NOT NULL, backend TEXT NOT NULL, version TEXT NOT NULL, spec TEXT NOT NULL,
    dtype TEXT NOT NULL, epilogue TEXT NOT NULL, variant TEXT NOT NULL, params TEXT NOT NULL,
    time_ms REAL, error REAL, status TEXT NOT NULL, date TEXT NOT NULL,
    PRIMARY KEY (device, backend, version, spec, dtype, epilogue, variant, params));
"""


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Entry:
    """One tuned layer: the key (first six fields) and what was chosen, with the heuristic for comparison."""

    device: str
    backend: str
    version: str
    spec: str
    dtype: str
    epilogue: str
    variant: str
    params: str  # Params.to_json()
    time_ms: float
    workspace: int
    error: float
    date: str
    spec_json: str = "{}"
    heuristic_variant: str = ""
    heuristic_params: str = "{}"
    heuristic_ms: float | None = None
    candidates: int = 0
    seconds: float = 0.0

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(getattr(self, f) for f in KEY_FIELDS)

    @property
    def speedup(self) -> float | None:
        """Heuristic time over tuned time (None when the heuristic was not measured)."""
        if not self.heuristic_ms or not self.time_ms:
            return None
        return self.heuristic_ms / self.time_ms

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Entry:
        names = {f.name for f in fields(cls)}
        missing = [k for k in KEY_FIELDS + ("variant", "params", "time_ms") if k not in d]
        if missing:
            raise ValueError(f"tuning entry lacks {', '.join(missing)}")
        vals = {k: v for k, v in d.items() if k in names}
        vals.setdefault("workspace", 0)
        vals.setdefault("error", 0.0)
        vals.setdefault("date", now())
        if not isinstance(vals["params"], str):
            vals["params"] = json.dumps(vals["params"], sort_keys=True)
        return cls(**vals)


@dataclass(frozen=True)
class Measurement:
    """One candidate's outcome: time (inf/None when it failed) and the reason when it did."""

    variant: str
    params: str
    time_ms: float | None
    error: float | None
    status: str  # "ok" or the reason it scored infinity


_ENTRY_COLS = [f.name for f in fields(Entry)]


class TuningDB:
    """A tuning database at ``path``; one connection shared by the threads of this process."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(self.path):
            self.conn = self._open_checked()

    # -- opening, validation, recovery ----------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        return conn

    def _open_checked(self) -> sqlite3.Connection:
        conn = self._connect()
        try:
            problem = _validate(conn)
            if problem is None:
                _init(conn)
                return conn
        except sqlite3.DatabaseError as err:
            problem = f"unreadable ({err})"
        conn.close()
        aside = self._move_aside()
        msg = f"tuning database {self.path} is {problem}; moved to {aside.name} and rebuilt"
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        conn = self._connect()
        _init(conn)
        return conn

    def _move_aside(self) -> Path:
        stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S%f")
        aside = self.path.with_name(f"{self.path.name}.bad-{stamp}")
        os.replace(self.path, aside)
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                os.replace(side, aside.with_name(aside.name + suffix))
        return aside

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A short write transaction, taken at once so concurrent writers queue on the busy timeout."""
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    # -- results --------------------------------------------------------------------------
    def get(self, device: str, backend: str, version: str, spec: str, dtype: str,
            epilogue: str) -> Entry | None:
        where = " AND ".join(f"{k} = ?" for k in KEY_FIELDS)
        with self._lock:
            row = self.conn.execute(f"SELECT {', '.join(_ENTRY_COLS)} FROM results WHERE {where}",
                                    (device, backend, version, spec, dtype, epilogue)).fetchone()
        return Entry(*row) if row else None

    def put(self, entry: Entry, only_if_faster: bool = False) -> bool:
        """Store ``entry`` (replacing its key); with ``only_if_faster`` keep a faster existing one."""
        cols = ", ".join(_ENTRY_COLS)
        marks = ", ".join("?" for _ in _ENTRY_COLS)
        vals = tuple(getattr(entry, c) for c in _ENTRY_COLS)
        with self._write() as conn:
            if only_if_faster:
                where = " AND ".join(f"{k} = ?" for k in KEY_FIELDS)
                row = conn.execute(f"SELECT time_ms FROM results WHERE {where}", entry.key).fetchone()
                if row is not None and row[0] <= entry.time_ms:
                    return False
            conn.execute(f"INSERT OR REPLACE INTO results ({cols}) VALUES ({marks})", vals)
        return True

    def entries(self, **match: str) -> list[Entry]:
        """Every entry whose key fields equal the given values (all entries without arguments)."""
        bad = set(match) - set(KEY_FIELDS) - {"variant"}
        if bad:
            raise ValueError(f"cannot filter on {sorted(bad)}; use {KEY_FIELDS}")
        where = " AND ".join(f"{k} = ?" for k in match) or "1"
        with self._lock:
            rows = self.conn.execute(
                f"SELECT {', '.join(_ENTRY_COLS)} FROM results WHERE {where} "
                "ORDER BY device, backend, spec, epilogue", tuple(match.values())).fetchall()
        return [Entry(*r) for r in rows]

    def clear(self, **match: str) -> int:
        """Delete matching entries and their measurements; returns the number of entries deleted."""
        where = " AND ".join(f"{k} = ?" for k in match) or "1"
        with self._write() as conn:
            n = conn.execute(f"DELETE FROM results WHERE {where}", tuple(match.values())).rowcount
            if "variant" not in match:
                conn.execute(f"DELETE FROM measurements WHERE {where}", tuple(match.values()))
        return int(n)

    # -- measurements ---------------------------------------------------------------------
    def add_measurements(self, key: tuple[str, ...], items: list[Measurement]) -> None:
        rows = [key + (m.variant, m.params, _finite(m.time_ms), _finite(m.error), m.status, now())
                for m in items]
        with self._write() as conn:
            conn.executemany("INSERT OR REPLACE INTO measurements VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)

    def measurements(self, key: tuple[str, ...]) -> list[Measurement]:
        where = " AND ".join(f"{k} = ?" for k in KEY_FIELDS)
        with self._lock:
            rows = self.conn.execute(
                f"SELECT variant, params, time_ms, error, status FROM measurements WHERE {where}",
                key).fetchall()
        return [Measurement(*r) for r in rows]

    # -- sharing between machines ---------------------------------------------------------
    def export_json(self, path: str | os.PathLike[str] | None = None, **match: str) -> dict[str, Any]:
        """The matching entries as a JSON document; written to ``path`` when given."""
        doc = {"format": EXPORT_FORMAT, "schema": SCHEMA_VERSION, "exported": now(),
               "entries": [asdict(e) for e in self.entries(**match)]}
        if path is not None:
            tmp = Path(str(path) + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
            os.replace(tmp, path)
        return doc

    def import_json(self, source: str | os.PathLike[str] | dict[str, Any],
                    only_if_faster: bool = True) -> int:
        """Merge entries from an export (file or document); returns how many were stored."""
        doc = source if isinstance(source, dict) else json.loads(Path(source).read_text())
        if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
            raise ValueError(f"not a convforge tuning export (format must be {EXPORT_FORMAT!r})")
        stored = 0
        for item in doc.get("entries", []):
            stored += self.put(Entry.from_dict(item), only_if_faster=only_if_faster)
        return stored


def _finite(v: float | None) -> float | None:
    return None if v is None or v != v or v in (float("inf"), float("-inf")) else float(v)


def _validate(conn: sqlite3.Connection) -> str | None:
    """None when the file is a usable database of this schema (or empty), otherwise what is wrong."""
    check = conn.execute("PRAGMA quick_check").fetchone()
    if not check or check[0] != "ok":
        return f"corrupt (integrity check: {check[0] if check else 'no answer'})"
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if version == 0 and not tables:
        return None  # a new, empty file
    if version != SCHEMA_VERSION:
        return f"in an older or unknown format (schema {version}, this convforge reads {SCHEMA_VERSION})"
    if not {"results", "measurements"} <= tables:
        return "missing its tables"
    return None


def _init(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("BEGIN IMMEDIATE")
    try:
        for stmt in filter(str.strip, _SCHEMA.split(";")):
            conn.execute(stmt)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An advisory lock beside the database, so only one process checks and repairs it at a time."""
    lock_path = path.with_name(path.name + ".lock")
    try:
        import fcntl
    except ImportError:  # Windows: SQLite's own locking is all we have
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
