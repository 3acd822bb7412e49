"""The tuning database: SQLite (WAL) holding the best variant and parameters per device, back-end,
layer, dtype, epilogue and precision class (with the convforge version that tuned it and the errors
measured), plus every candidate measured (for reports). See docs/DISK.md.

convforge writes only to a database it recognises as its own (``dbfile.identify``): anything else at
the path is refused with a :class:`DatabaseError`, never renamed or written. A convforge database of
an older schema is upgraded in place (after a copy beside it); one failing its integrity check is
moved aside and rebuilt. Several processes may tune at once: writes are short ``BEGIN IMMEDIATE``
transactions under a busy timeout.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import math
import os
import sqlite3
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from convforge.tune.dbfile import (
    APPLICATION_ID,
    KEY_FIELDS,
    SCHEMA_VERSION,
    create_schema,
    identify,
    migrate_v1,
    not_regular,
    ro_uri,
    side,
)
from convforge.tune.entry import EXPORT_FORMAT, Entry, now

BUSY_TIMEOUT_S = 60.0

log = logging.getLogger("convforge.tune")


class DatabaseError(ValueError):
    """The file at the database path cannot be used (it is not ours, or is missing)."""


class NoDatabase(DatabaseError, FileNotFoundError):
    """There is no tuning database at the path (read-only opening)."""


@dataclass(frozen=True)
class Measurement:
    """One candidate's outcome: time (inf/None when it failed) and the reason when it did."""

    variant: str
    params: str
    time_ms: float | None
    error: float | None
    status: str  # "ok" or the reason it scored infinity


@dataclass
class ImportReport:
    """What an import stored (or would store), kept back (an existing entry is faster) and rejected."""

    stored: list[Entry] = field(default_factory=list)
    kept: list[Entry] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (entry label, reason)


_ENTRY_COLS = [f.name for f in fields(Entry)]
_UPSERT = (f"INSERT OR REPLACE INTO results ({', '.join(_ENTRY_COLS)}) "
           f"VALUES ({', '.join('?' for _ in _ENTRY_COLS)})")


def _values(entry: Entry) -> tuple[Any, ...]:
    return tuple(getattr(entry, c) for c in _ENTRY_COLS)


def _label_of(vals: dict[str, Any]) -> str:
    """An entry's name in messages: back-end, layer, variant and device (each cut short)."""
    parts = [printable(str(vals.get(k, "?"))[:80]) for k in ("backend", "spec", "variant", "device")]
    return "{} {} {} on {}".format(*parts)


def printable(text: str) -> str:
    """``text`` with control characters (terminal escapes, line breaks) shown escaped."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class TuningDB:
    """A tuning database at ``path``; one connection shared by the threads of this process.

    ``readonly=True`` never creates, writes, migrates or moves anything: a missing file is
    :class:`NoDatabase`, a schema-1 file is read through its migration into memory."""

    def __init__(self, path: str | os.PathLike[str], readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.not_carried: list[str] = []  # entries an upgrade at this opening could not carry over
        self.skipped: dict[str, str] = {}  # rows read that fail validation: label -> why (each said once)
        self.write_errors: list[str] = []  # writes that failed (a full disk, an I/O error)
        self._columns = list(_ENTRY_COLS)
        self._lock = threading.RLock()
        self.conn = self._open_readonly() if readonly else self._open_writable()

    # -- opening, validation, recovery ----------------------------------------------------
    def _refuse(self, what: str) -> DatabaseError:
        return DatabaseError(f"{self.path} is {what}; convforge leaves it untouched "
                             "(choose another --db / CONVFORGE_DB path)")

    def _open_readonly(self) -> sqlite3.Connection:
        kind = identify(self.path)
        if kind.kind == "missing":
            raise NoDatabase(f"no tuning database at {self.path} (run convforge tune)")
        if kind.kind == "foreign":
            raise self._refuse(kind.what)
        if kind.kind == "ours" and kind.schema > SCHEMA_VERSION:
            raise self._refuse(_newer(kind.schema))
        if kind.kind == "empty":  # nothing to read: no connection to the file at all
            mem = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
            _init(mem)
            return mem
        log = side(self.path, "-wal").exists()
        if not log:  # the main file is all there is: checked before SQLite may create -wal / -shm
            self._check_columns(self._ro_connect(immutable=True), kind.schema)
        conn = self._ro_connect()
        if log:
            self._check_columns(conn, kind.schema, keep=True)
        if kind.schema == SCHEMA_VERSION:
            return conn
        mem = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        conn.backup(mem)  # schema 1: upgraded in memory only, the file stays as it is
        conn.close()
        self.not_carried = migrate_v1(mem, now())
        return mem

    def _ro_connect(self, immutable: bool = False) -> sqlite3.Connection:
        """Read-only. A file or folder this process may not write (no writer to race with) and no
        write-ahead log: immutable, so SQLite creates no ``-wal`` / ``-shm`` beside it."""
        quiet = immutable or not side(self.path, "-wal").exists() and not (
            os.access(self.path, os.W_OK) and os.access(self.path.parent, os.W_OK | os.X_OK))
        try:
            return sqlite3.connect(ro_uri(self.path, immutable=quiet), uri=True, check_same_thread=False,
                                   isolation_level=None)
        except sqlite3.Error as err:
            raise DatabaseError(f"cannot read the tuning database {self.path}: {err}"
                                f"{_path_hint(self.path)}") from None

    def _check_columns(self, conn: sqlite3.Connection, schema: int, keep: bool = False) -> None:
        """:meth:`_check_readable`, then (schema 2) the results table's columns read as
        ``_columns`` says; ``conn`` closed unless ``keep`` and all is well."""
        self._check_readable(conn, keep=True)
        try:
            if schema == SCHEMA_VERSION:
                self._columns = _columns(conn, self.path, writable=False)
        except BaseException:
            conn.close()
            raise
        if not keep:
            conn.close()

    def _check_readable(self, conn: sqlite3.Connection, keep: bool = False) -> None:
        """A read-only opening of a corrupt or truncated file: one DatabaseError saying so (a
        read-write opening moves such a file aside and rebuilds it). ``conn`` is closed unless
        ``keep`` and the file is sound."""
        try:
            check = conn.execute("PRAGMA quick_check(1)").fetchone()
            problem = None if check and check[0] == "ok" else " ".join(
                f"integrity check: {check[0] if check else 'no answer'}".split())
        except sqlite3.DatabaseError as err:
            if not is_damage(err):  # locked, a -shm it may not create, an I/O error: not damage
                conn.close()
                raise DatabaseError(f"cannot read the tuning database {self.path}: {err}{_io_hint(err)}") from None
            problem = str(err)
        if problem or not keep:
            conn.close()
        if problem:
            raise DatabaseError(f"tuning database {self.path} is corrupt or truncated ({problem}); convforge tune "
                                "(or db import / db clear) moves it aside and starts a new one")

    def _open_writable(self) -> sqlite3.Connection:
        from convforge.config import config

        parent = self.path.parent
        try:
            parent_ok = parent.is_dir()
        except OSError as err:  # a folder above may not be entered
            raise DatabaseError(f"cannot reach the folder {parent} of the tuning database {self.path}: "
                                f"{err.strerror or err} (a folder above it may not be entered; set CONVFORGE_DB "
                                "or CONVFORGE_CACHE_DIR to a folder this user may write)") from None
        if not parent_ok:
            if parent.resolve() != config.cache_dir.resolve():
                raise DatabaseError(f"folder {parent} of the tuning database {self.path} does not exist")
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                near = next(p for p in (parent, *parent.parents) if p.exists())
                why = f"{near} is a file, not a folder" if not near.is_dir() else err.strerror
                raise DatabaseError(f"cannot create the folder of the tuning database {self.path}: {why} "
                                    "(CONVFORGE_CACHE_DIR must name a folder, or set CONVFORGE_DB)") from None
        kind = identify(self.path)
        if kind.kind == "foreign":
            raise self._refuse(kind.what)
        if kind.kind == "ours" and kind.schema > SCHEMA_VERSION:
            raise self._refuse(_newer(kind.schema))
        self._check_writable(kind.kind != "missing")
        with _file_lock(self.path):
            return self._open_checked()

    def _check_writable(self, exists: bool) -> None:
        """A database file or folder this process may not write: one DatabaseError before SQLite
        or the lock file touches anything (SQLite keeps ``-wal`` and ``-shm`` beside the file)."""
        if exists and not os.access(self.path, os.R_OK | os.W_OK):
            raise DatabaseError(f"tuning database {self.path} is read-only (no write permission); this command "
                                "writes it: make it writable or choose another --db / CONVFORGE_DB path")
        if not os.access(self.path.parent, os.W_OK | os.X_OK):
            raise DatabaseError(f"folder {self.path.parent} of the tuning database {self.path} is read-only; "
                                "SQLite and convforge keep files beside the database (-wal, -shm, .lock): make "
                                "it writable or choose another --db / CONVFORGE_DB path")

    def _connect(self, path: Path | None = None) -> sqlite3.Connection:
        target = path or self.path
        try:
            conn = sqlite3.connect(target, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        except sqlite3.Error as err:
            raise DatabaseError(f"cannot open the tuning database {self.path}: {err}{_path_hint(target)}") from None
        return conn

    def _open_checked(self) -> sqlite3.Connection:
        """Under the file lock: create a new file whole, check integrity (only a file failing it is
        moved aside; an I/O error or a full disk is a DatabaseError and the file stays as it is),
        upgrade schema 1, add columns an earlier schema-2 file lacks."""
        kind = identify(self.path)  # again: another process may have created or upgraded it meanwhile
        if kind.kind == "foreign":
            raise self._refuse(kind.what)
        if kind.kind == "missing" or (kind.kind == "empty" and self._blank()):
            self._create(blank=kind.kind == "empty")
        conn = self._connect()
        problem = self._damage(conn)
        if problem is None:
            try:
                if kind.kind == "ours" and kind.schema == 1:
                    self._upgrade(conn)
                _init(conn)
                self._columns = _columns(conn, self.path, writable=True)
            except sqlite3.Error as err:
                conn.close()
                raise DatabaseError(self._io_message(err)) from None
            return conn
        conn.close()
        aside = self._move_aside()
        msg = f"tuning database {self.path} is {problem}; moved to {aside.name} and rebuilt"
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
        self._create()
        conn = self._connect()
        self._columns = _columns(conn, self.path, writable=True)
        return conn

    def _blank(self) -> bool:
        """An empty file with nothing beside it: replaced whole by a new database (anything else
        SQLite calls blank is given its tables in place)."""
        return self.path.stat().st_size == 0 and not side(self.path, "-wal").exists()

    def _create(self, blank: bool = False) -> None:
        """A new database with schema 2's tables and identity, written to a temporary file beside
        the path and linked (or, over an empty file, renamed) into place: another process sees no
        file or a whole one, never a half-made schema; a second creator finds the file there and
        uses it. ``blank``: the path holds an empty file, replaced only while it is still empty."""
        import secrets

        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}-{secrets.token_hex(4)}.new")
        try:
            conn = self._connect(tmp)
            try:
                conn.execute("BEGIN IMMEDIATE")
                create_schema(conn)
                conn.execute("COMMIT")
                conn.execute("PRAGMA journal_mode = WAL")  # recorded in the header; no log is left
            finally:
                conn.close()
            if blank:  # an empty file (checked under the file lock again): replaced whole
                if self.path.stat().st_size == 0:
                    os.replace(tmp, self.path)
            else:
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    pass  # created by another process meanwhile: that one is used
                except OSError:  # a file system without hard links: we hold the lock
                    if not self.path.exists():
                        os.replace(tmp, self.path)
        except sqlite3.Error as err:
            raise DatabaseError(f"cannot create the tuning database {self.path}: {err}"
                                f"{_io_hint(err)}; nothing was written there") from None
        except OSError as err:
            raise DatabaseError(f"cannot create the tuning database {self.path}: {err.strerror or err}") from None
        finally:
            for name in (tmp, side(tmp, "-wal"), side(tmp, "-shm"), side(tmp, "-journal")):
                with contextlib.suppress(OSError):
                    name.unlink(missing_ok=True)

    def _damage(self, conn: sqlite3.Connection) -> str | None:
        """None for a sound file; a phrase naming the damage when SQLite's integrity check fails
        or SQLite calls the file corrupt or not a database. Any other error (a full disk, an I/O
        error, a lock, a -shm it may not create) is a DatabaseError: the file is not touched."""
        try:
            check = conn.execute("PRAGMA quick_check(1)").fetchone()
            if check and check[0] == "ok":
                return None
            check = conn.execute("PRAGMA integrity_check(1)").fetchone()  # the full check confirms
            if check and check[0] == "ok":
                return None
            return f"corrupt (integrity check: {check[0] if check else 'no answer'})"
        except sqlite3.DatabaseError as err:
            if is_damage(err):
                return f"unreadable ({err})"
            conn.close()
            raise DatabaseError(self._io_message(err)) from None

    def _io_message(self, err: sqlite3.Error) -> str:
        return (f"cannot use the tuning database {self.path}: {err}{_io_hint(err)}; the file is left as it is "
                "(nothing was moved, truncated or emptied)")

    def _upgrade(self, conn: sqlite3.Connection) -> None:
        """Schema 1 -> 2 in place, after a consistent copy beside the file."""
        stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S%f")
        backup = self.path.with_name(f"{self.path.name}.v1-backup-{stamp}")
        dst = sqlite3.connect(backup)
        try:
            conn.backup(dst)
        finally:
            dst.close()
        self.not_carried = migrate_v1(conn, now())
        msg = (f"tuning database {self.path} upgraded to schema {SCHEMA_VERSION} (copy of the old file: "
               f"{backup.name})")
        if self.not_carried:
            msg += f"; {len(self.not_carried)} entries not carried over: " + "; ".join(self.not_carried)
        log.warning(msg)

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
        """One write transaction, taken at once so concurrent writers queue on the busy timeout; on
        any failure rolled back whole (a full disk leaves the file as it was). A failure of SQLite
        is also kept in ``write_errors`` (the tuner goes on without storing; commands report it)."""
        if self.readonly:
            raise DatabaseError(f"tuning database {self.path} is open read-only")
        with self._lock:
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self.conn
                    self.conn.execute("COMMIT")
                except BaseException:
                    if self.conn.in_transaction:  # SQLite may have rolled back already (SQLITE_FULL)
                        self.conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as err:
                self.write_errors.append(f"{err}{_io_hint(err)}")
                raise

    # -- results --------------------------------------------------------------------------
    def get(self, device: str, backend: str, spec: str, dtype: str, epilogue: str,
            precision: str) -> Entry | None:
        """The entry under the key (``KEY_FIELDS`` order), or None (also when its row fails
        validation: skipped with a warning)."""
        where = " AND ".join(f"{k} = ?" for k in KEY_FIELDS)
        with self._lock, self._reading():
            row = self.conn.execute(f"SELECT {', '.join(self._columns)} FROM results WHERE {where}",
                                    (device, backend, spec, dtype, epilogue, precision)).fetchone()
        return self._entry(row) if row else None

    def _entry(self, row: tuple[Any, ...]) -> Entry | None:
        """The Entry of a results row, or None when a field fails validation (a row no tuner
        writes: another program's, a hand edit, a damaged import), said once per row."""
        from convforge.tune.validate import row_problem

        vals = dict(zip(_ENTRY_COLS, row, strict=True))
        why = row_problem(vals)
        if why is None:
            return Entry(**vals)
        label = _label_of(vals)
        if label not in self.skipped:
            self.skipped[label] = why
            log.warning("tuning database %s: skipped the entry %s: %s", self.path, label, why)
        return None

    def put(self, entry: Entry, only_if_faster: bool = False) -> bool:
        """Store ``entry`` (replacing its key); with ``only_if_faster`` keep a faster existing one."""
        with self._write() as conn:
            if only_if_faster and self._faster_exists(entry):
                return False
            conn.execute(_UPSERT, _values(entry))
        return True

    def _faster_exists(self, entry: Entry) -> bool:
        where = " AND ".join(f"{k} = ?" for k in KEY_FIELDS)
        row = self.conn.execute(f"SELECT time_ms FROM results WHERE {where}", entry.key).fetchone()
        return row is not None and isinstance(row[0], (int, float)) and row[0] <= entry.time_ms

    def entries(self, **match: str) -> list[Entry]:
        """Every entry whose key fields equal the given values (all entries without arguments);
        rows failing validation are skipped, each with a warning (``skipped``)."""
        bad = set(match) - set(KEY_FIELDS) - {"variant", "version"}
        if bad:
            raise ValueError(f"cannot filter on {sorted(bad)}; use {KEY_FIELDS}")
        where = " AND ".join(f"{k} = ?" for k in match) or "1"
        with self._lock, self._reading():
            rows = self.conn.execute(
                f"SELECT {', '.join(self._columns)} FROM results WHERE {where} "
                "ORDER BY device, backend, spec, epilogue, precision", tuple(match.values())).fetchall()
        return [e for e in map(self._entry, rows) if e is not None]

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """A damaged page met by a query: a DatabaseError naming the file, not SQLite's traceback."""
        try:
            yield
        except sqlite3.DatabaseError as err:
            raise DatabaseError(f"cannot read the tuning database {self.path}: {err}") from None

    def not_carried_log(self) -> list[tuple[str, str, str]]:
        """(date, entry, reason) of every entry an upgrade of this database could not carry over."""
        with self._lock, self._reading():
            if not self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'not_carried'").fetchone():
                return []
            return [(str(d), str(e), str(r)) for d, e, r in self.conn.execute(
                "SELECT date, entry, reason FROM not_carried ORDER BY date, entry")]

    def clear(self, **match: str) -> int:
        """Delete matching entries and their measurements; returns the number of entries deleted."""
        bad = set(match) - set(KEY_FIELDS) - {"variant", "version"}
        if bad:
            raise ValueError(f"cannot filter on {sorted(bad)}; use {KEY_FIELDS}")
        where = " AND ".join(f"{k} = ?" for k in match) or "1"
        with self._write() as conn:
            n = conn.execute(f"DELETE FROM results WHERE {where}", tuple(match.values())).rowcount
            if "variant" not in match:
                conn.execute(f"DELETE FROM measurements WHERE {where}", tuple(match.values()))
        return int(n)

    # -- measurements ---------------------------------------------------------------------
    def add_measurements(self, key: tuple[str, ...], items: list[Measurement]) -> None:
        from convforge.version import __version__

        rows = [key + (__version__, m.variant, m.params, _finite(m.time_ms), _finite(m.error), m.status, now())
                for m in items]
        with self._write() as conn:
            conn.executemany("INSERT OR REPLACE INTO measurements VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)

    def measurements(self, key: tuple[str, ...]) -> list[Measurement]:
        where = " AND ".join(f"{k} = ?" for k in KEY_FIELDS)
        with self._lock:
            rows = self.conn.execute(
                f"SELECT variant, params, time_ms, error, status FROM measurements WHERE {where}",
                key).fetchall()
        return [Measurement(*r) for r in rows]

    # -- sharing between machines ---------------------------------------------------------
    def export_json(self, path: str | os.PathLike[str] | None = None, *, force: bool = False,
                    **match: Any) -> dict[str, Any]:
        """The matching entries as a JSON document; written to ``path`` when given. An existing
        file there is refused unless ``force`` (then replaced whole); the database itself, its
        side files and anything that is not a regular file are refused always."""
        if path is not None:
            self._check_export_target(Path(path), force)
        doc = {"format": EXPORT_FORMAT, "schema": SCHEMA_VERSION, "exported": now(),
               "entries": [asdict(e) for e in self.entries(**match)]}
        if path is not None:
            _write_atomic(Path(path), json.dumps(doc, indent=1, sort_keys=True))
        return doc

    def _check_export_target(self, path: Path, force: bool) -> None:
        """FileExistsError / ValueError naming ``path`` when an export must not write there."""
        if path.is_dir():
            raise IsADirectoryError(f"cannot write {path}: it is a folder")
        ours = [self.path] + [side(self.path, x) for x in ("-wal", "-shm", "-journal", ".lock")]
        if any(_same_file(path, p) for p in ours):
            raise DatabaseError(f"cannot export to {path}: it is the tuning database being read "
                                f"({self.path}) or one of its files; choose another file")
        if not (path.exists() or path.is_symlink()):
            return
        try:
            what = not_regular(os.stat(path).st_mode)
        except OSError:
            what = None  # a dangling link: replaced like a file, with --force
        if what:
            raise DatabaseError(f"cannot export to {path}: it is {what}")
        if not force:
            raise FileExistsError(f"{path} exists; convforge leaves it untouched (give --force to replace it, "
                                  "or choose a new file)")

    def import_json(self, source: str | os.PathLike[str] | dict[str, Any], only_if_faster: bool = True,
                    dry_run: bool = False, on_progress: Callable[[int, int], None] | None = None) -> ImportReport:
        """Merge entries from an export (file or document), each validated first (field types and
        ranges, a known variant, parameters that plan for the layer on a nominal device of its
        back-end); rejects are reported, never stored. All is stored in one transaction (nothing
        when it fails: a full disk leaves the database as it was). ``dry_run`` stores nothing;
        ``on_progress(done, total)`` follows the validation."""
        from convforge.tune.validate import load_document

        items = load_document(source)
        return self.merge(items, only_if_faster, dry_run, on_progress, lambda i: _label(i, items[i]))

    def merge(self, items: Sequence[Any], only_if_faster: bool = True, dry_run: bool = False,
              on_progress: Callable[[int, int], None] | None = None,
              label: Callable[[int], str] | None = None) -> ImportReport:
        """Store the valid ones of ``items`` (entry objects, as an export holds them), per key the
        fastest of them, where no faster entry is stored already (any, with
        ``only_if_faster=False``); ``label(i)`` names item i in the report's rejects."""
        from convforge.tune.validate import Verifier

        verify, report = Verifier(), ImportReport()
        best: dict[tuple[str, ...], Entry] = {}
        step = max(1, len(items) // 200)
        for i, item in enumerate(items):
            try:
                entry = verify(item)
            except (ValueError, TypeError) as err:
                report.rejected.append((label(i) if label else _label(i, item), str(err)))
            else:
                prev = best.get(entry.key)
                if prev is None or entry.time_ms < prev.time_ms:
                    best[entry.key] = entry
                    if prev is not None:
                        report.kept.append(prev)
                else:
                    report.kept.append(entry)
            if on_progress is not None and (i % step == 0 or i + 1 == len(items)):
                on_progress(i + 1, len(items))
        if dry_run or not best:
            with self._lock:
                self._choose(best, only_if_faster, report)
            return report
        with self._write() as conn:
            conn.executemany(_UPSERT, [_values(e) for e in self._choose(best, only_if_faster, report)])
        return report

    def _choose(self, best: dict[tuple[str, ...], Entry], only_if_faster: bool, report: ImportReport) -> list[Entry]:
        """The entries of ``best`` to store (in ``report.stored``; the others in ``report.kept``)."""
        stored: dict[tuple[str, ...], float] = {}
        if only_if_faster and best:
            cols = ", ".join(KEY_FIELDS)
            with self._reading():
                for *key, t in self.conn.execute(f"SELECT {cols}, time_ms FROM results"):
                    if isinstance(t, (int, float)):
                        stored[tuple(str(k) for k in key)] = float(t)
        out = []
        for key, entry in best.items():
            t = stored.get(key)
            if t is not None and t <= entry.time_ms:
                report.kept.append(entry)
            else:
                out.append(entry)
                report.stored.append(entry)
        return out


def _write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file beside it, renamed into place; on failure an
    OSError naming ``path`` (never the temporary) and no temporary file left behind."""
    import secrets

    if path.is_dir():
        raise IsADirectoryError(f"cannot write {path}: it is a folder")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: folder {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask's mode, as open() gives
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a power cut never leaves an emptied database
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise type(err)(f"cannot write {path}: {err.strerror or err}") from None
        raise


def _same_file(a: Path, b: Path) -> bool:
    """``a`` and ``b`` name one file (through links, case-insensitive file systems, ...)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _label(i: int, item: object) -> str:
    if isinstance(item, dict):
        what = " ".join(printable(str(item.get(k, "?"))[:80]) for k in ("backend", "spec", "variant"))
        return f"entry {i + 1} ({what})"
    return f"entry {i + 1}"


def _newer(schema: int) -> str:
    return (f"a tuning database of a newer convforge (schema {schema}; this one reads {SCHEMA_VERSION}): "
            "upgrade convforge")


def _finite(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _init(conn: sqlite3.Connection) -> None:
    """Journal settings, and schema 2's tables where any is missing (one transaction; a current
    database is only read, so opening one writes nothing)."""
    if conn.execute("PRAGMA database_list").fetchone()[2]:  # a file, not :memory:
        if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
    have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    ident = (conn.execute("PRAGMA application_id").fetchone()[0], conn.execute("PRAGMA user_version").fetchone()[0])
    if have >= {"results", "measurements", "not_carried"} and ident == (APPLICATION_ID, SCHEMA_VERSION):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        create_schema(conn)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


# SQLite's primary result codes that mean the file itself is damaged (the rest: I/O, full disk,
# locks, permissions, ... leave the file as it is).
SQLITE_CORRUPT, SQLITE_NOTADB, SQLITE_FULL = 11, 26, 13


def is_damage(err: sqlite3.Error) -> bool:
    """Whether SQLite's error says the file is corrupt or not a database (not an I/O problem)."""
    code = getattr(err, "sqlite_errorcode", None)
    if code is None:
        return "malformed" in str(err) or "not a database" in str(err)
    return code & 0xFF in (SQLITE_CORRUPT, SQLITE_NOTADB)


def _io_hint(err: sqlite3.Error) -> str:
    code = getattr(err, "sqlite_errorcode", 0) or 0
    if code & 0xFF == SQLITE_FULL or "disk is full" in str(err):
        return " (the disk or the file system's quota is full: free some space)"
    if "disk I/O error" in str(err):
        return " (an I/O error: is the disk full, or the file system read-only or failing?)"
    return ""


# The longest path SQLite's Unix VFS opens (SQLITE_MAX_PATHNAME's default).
SQLITE_MAX_PATH = 512


def _path_hint(path: Path) -> str:
    n = len(os.path.abspath(path))
    if n > SQLITE_MAX_PATH:
        return (f" (its path has {n} characters; SQLite opens paths of at most {SQLITE_MAX_PATH}: set "
                "CONVFORGE_DB or CONVFORGE_CACHE_DIR to a shorter one)")
    return ""


def _columns(conn: sqlite3.Connection, path: Path, writable: bool) -> list[str]:
    """The SELECT expressions of ``Entry``'s fields in the results table: a column an earlier
    schema-2 file lacks is added (``writable``) or read as its default; a required one missing is
    a DatabaseError naming it."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(results)")}
    if not have:
        return list(_ENTRY_COLS)  # no table yet: a blank read-only database, read in memory
    missing = [c for c in _ENTRY_COLS if c not in have]
    required = [c for c in missing if c not in _ADDABLE]
    if required:
        raise DatabaseError(f"tuning database {path}: its results table lacks the column(s) {', '.join(required)}; "
                            "it is not a convforge database this version can read")
    if missing and writable:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for c in missing:
                conn.execute(f"ALTER TABLE results ADD COLUMN {c} {_ADDABLE[c]}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        log.warning("tuning database %s: added the column(s) %s to its results table", path, ", ".join(missing))
        return list(_ENTRY_COLS)
    return [c if c in have else f"{_ADDABLE[c].split('DEFAULT ')[-1] if 'DEFAULT' in _ADDABLE[c] else 'NULL'} AS {c}"
            for c in _ENTRY_COLS]


# Columns of schema 2 that a file written before they existed may lack: how ALTER TABLE adds them.
_ADDABLE = {"min_error": "REAL", "spec_json": "TEXT NOT NULL DEFAULT '{}'",
            "heuristic_variant": "TEXT NOT NULL DEFAULT ''", "heuristic_params": "TEXT NOT NULL DEFAULT '{}'",
            "heuristic_ms": "REAL", "candidates": "INTEGER NOT NULL DEFAULT 0",
            "seconds": "REAL NOT NULL DEFAULT 0"}


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
