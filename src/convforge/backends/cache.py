"""On-disk cache of compiled programs. Entries are written to a temporary file and renamed into
place, so a crash or two processes never leave a partial entry; a checksum header catches the rest."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

_MAGIC = b"CFC1"


def cache_key(*parts: str) -> str:
    """Hash of everything an entry was built from (source, options, compiler, device, driver, version)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _nearest(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists and can be looked into (a folder above it that
    may not be entered, such as a HOME without search permission, is not an error here: writing an
    entry then says why it cannot)."""
    while path != path.parent:
        try:
            if path.exists():
                return path
        except OSError:  # a folder above may not be entered
            pass
        path = path.parent
    return path


class DiskCache:
    """A folder of ``<key>.bin`` files: 4-byte magic, 32-byte sha256 of the payload, payload."""

    def __init__(self, folder: Path, enabled: bool = True) -> None:
        self.folder = folder
        self.enabled = enabled
        near = _nearest(folder)
        if enabled and not near.is_dir():  # said now: at a compile, the tuner would score it as a failure
            raise NotADirectoryError(self._unusable(f"{near} is a file, not a folder"))

    def _unusable(self, why: str) -> str:
        """Why the folder cannot hold entries, naming the setting that chose it."""
        from convforge.config import config

        return (f"cannot write the compiled-program cache in {self.folder}: {why} (CONVFORGE_CACHE_DIR, now "
                f"{config.cache_dir}, must name a writable folder or where one can be made; "
                "CONVFORGE_DISK_CACHE=0 turns the disk cache off)")

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.bin"

    def has(self, key: str) -> bool:
        """Whether an entry is filed under ``key`` (not read, so not checked: :meth:`get` does that)."""
        return self.enabled and self._path(key).is_file()

    def get(self, key: str) -> bytes | None:
        if not self.enabled:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:  # missing, or a folder that may not be entered: compiled afresh
            return None
        payload = data[36:]
        if data[:4] != _MAGIC or hashlib.sha256(payload).digest() != data[4:36]:
            path.unlink(missing_ok=True)  # corrupt: drop it and rebuild
            return None
        return payload

    def put(self, key: str, payload: bytes) -> None:
        if not self.enabled:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".bin")
        except OSError as err:
            near = _nearest(self.folder)
            why = f"{near} is a file, not a folder" if not near.is_dir() else err.strerror or str(err)
            raise type(err)(self._unusable(why)) from None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
