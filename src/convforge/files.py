"""Reading the files convforge is given (suites, prototxt, caffemodel, ONNX and its external data,
tuning exports): each must be a regular file, and is read up to a size bound that the error names;
and writing result files whole or not at all (:func:`write_atomic`).

A FIFO, a device (``/dev/zero``), a socket or a folder is refused before a read could block or run
on without end: the file is opened non-blocking and checked by its descriptor, so a path swapped for
a FIFO between the check and the open is caught too. A regular file that reports one size and holds
more (``/proc`` files report 0) is read only to the bound plus one byte.
"""

from __future__ import annotations

import csv
import io
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30

# The most convforge reads of each kind of file (bytes). JSON and text are parsed whole in memory;
# a caffemodel (VGG-16's is 528 MiB) and an ONNX file are protobuf messages, which protobuf limits
# to 2 GiB; external data holds one tensor per read.
LIMITS = {
    "suite": 64 * MiB,
    "prototxt": 64 * MiB,
    "tuning export": 1 * GiB,
    "caffemodel": 2 * GiB,
    "ONNX model": 2 * GiB,
    "ONNX external data": 16 * GiB,
}

_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe), not a regular file"),
                (stat.S_ISSOCK, "a socket, not a regular file"),
                (stat.S_ISCHR, "a character device, not a regular file"),
                (stat.S_ISBLK, "a block device, not a regular file"))


class InputFileError(ValueError):
    """A file convforge was given cannot be read as one: not a regular file, or over its size bound."""


def not_regular(mode: int) -> str | None:
    """A phrase naming what a ``st_mode`` is when it is not a regular file, else None."""
    for test, what in _NOT_REGULAR:
        if test(mode):
            return what
    return None if stat.S_ISREG(mode) else "not a regular file"


def size_text(n: int) -> str:
    """``n`` bytes as ``1.5 GiB`` / ``64 MiB`` / ``100 bytes``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} bytes"


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file ``path`` (the caller closes it). Missing or
    unreadable: OSError naming the path; anything but a regular file: InputFileError. Messages
    start with the path; the caller says what the file was for."""
    p = Path(path)
    try:
        kind = not_regular(os.stat(p).st_mode)
    except OSError as err:
        raise type(err)(f"cannot read {p}: {err.strerror or err}") from None
    if kind:
        raise InputFileError(f"{p} is {kind}")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise type(err)(f"cannot read {p}: {err.strerror or err}") from None
    kind = not_regular(os.fstat(fd).st_mode)  # swapped for a FIFO since the stat above
    if kind:
        os.close(fd)
        raise InputFileError(f"{p} is {kind}")
    return fd


def read_bounded(path: str | os.PathLike[str], what: str, limit: int | None = None,
                 offset: int = 0, length: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``LIMITS[what]`` (``what``: "suite",
    "prototxt", ...; or ``limit``), else InputFileError naming the bound. With ``length``, exactly that many
    bytes from ``offset`` (InputFileError when the file is shorter)."""
    bound = LIMITS.get(what, 64 * MiB) if limit is None else limit
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        want = length if length is not None else max(size - offset, 0)
        if want > bound:
            raise InputFileError(f"{path} is {size_text(want)}; convforge reads at most {size_text(bound)} "
                                 f"of a {what}")
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks, got = [], 0
        cap = (length if length is not None else bound) + (0 if length is not None else 1)
        while got < cap:
            try:
                chunk = os.read(fd, min(cap - got, 16 * MiB))
            except OSError as err:
                raise type(err)(f"cannot read {path}: {err.strerror or err}") from None
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if length is not None and len(data) < length:
        raise InputFileError(f"{path} holds {size_text(offset + len(data))}, too short for {length} bytes "
                             f"at offset {offset}")
    if length is None and len(data) > bound:
        raise InputFileError(f"{path} is larger than {size_text(bound)}, the most convforge reads of a {what}")
    return data


def read_text(path: str | os.PathLike[str], what: str, limit: int | None = None) -> str:
    """:func:`read_bounded` decoded as UTF-8 (InputFileError naming the first bad byte otherwise)."""
    data = read_bounded(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputFileError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); is it a binary "
                             "file?") from None


def parse_json(text: str | bytes, what: str) -> Any:
    """``json.loads`` with its failures as one InputFileError starting with ``what`` (the file, or
    its kind and name): not UTF-8, not JSON (with the line), or nested deeper than the parser goes
    (a RecursionError otherwise)."""
    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except UnicodeDecodeError as err:
        raise InputFileError(f"{what}: not a UTF-8 text file (byte {err.start}: {err.reason})") from None
    except json.JSONDecodeError as err:
        raise InputFileError(f"{what}: not valid JSON (line {err.lineno}: {err.msg})") from None
    except RecursionError:
        raise InputFileError(f"{what}: arrays or objects nested deeper than convforge's JSON reader goes "
                             f"(about {sys.getrecursionlimit()} levels)") from None


__all__ = ["LIMITS", "InputFileError", "not_regular", "open_regular", "parse_json", "read_bounded", "read_text",
           "size_text"]


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder (flushed to
    disk, then renamed into place), so a crash, a full disk or a second writer never leaves it half
    written; the folder is made when missing. Returns the path."""
    return write_atomic_bytes(path, lambda f: f.write(text.encode("utf-8")))


def csv_text(fieldnames: list[str] | tuple[str, ...], rows: list[dict[str, Any]]) -> str:
    """``rows`` as CSV text with a header line (keys outside ``fieldnames`` left out), for
    :func:`write_atomic`."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(fieldnames), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_atomic_bytes(path: str | os.PathLike[str], write: Any) -> Path:
    """:func:`write_atomic` for a writer of bytes: ``write(f)`` fills a temporary binary file in the
    same folder (a plot's ``savefig``), which is then flushed and renamed into place."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
