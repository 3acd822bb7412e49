"""Configuration, read in one place: environment variables and their defaults."""

from __future__ import annotations

import os
from pathlib import Path


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "convforge"


class Config:
    """Process-wide settings; attributes may be changed at run time (``convforge.config.autotune = True``)."""

    def __init__(self) -> None:
        env = os.environ
        self.cache_dir: Path = Path(env["CONVFORGE_CACHE_DIR"]) if env.get(
            "CONVFORGE_CACHE_DIR") else _default_cache_dir()
        self.autotune: bool = env.get("CONVFORGE_AUTOTUNE", "0") not in ("", "0", "false")
        self.opencl_device: str = env.get("CONVFORGE_OPENCL_DEVICE", "")  # "platform:device"
        self.db_path: Path | None = Path(env["CONVFORGE_DB"]) if env.get("CONVFORGE_DB") else None
        self.disk_cache: bool = env.get("CONVFORGE_DISK_CACHE", "1") not in ("0", "false")

    @property
    def tuning_db(self) -> Path:
        return self.db_path or (self.cache_dir / "tuning.sqlite")


config = Config()
