"""Configuration, read in one place: environment variables and their defaults."""

from __future__ import annotations

import os
from pathlib import Path


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "convforge"


DEFAULT_MAX_ERROR = 1e-3


def parse_max_error(text: str) -> float:
    """A relative-error limit from text; ValueError naming the problem otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"max_error ({text!r}) must be a number such as 1e-5") from None
    if not value > 0:
        raise ValueError(f"max_error ({text}) must be > 0")
    return value


MAX_ERROR_HELP = ("'auto' takes only variants whose relative L2 tolerance is at most E (default "
                  f"{DEFAULT_MAX_ERROR:g}, env CONVFORGE_MAX_ERROR): 5e-5 keeps to Winograd F(4x4) and "
                  "below, 1e-5 to F(2x2), direct and the GEMM family")


def max_error_arg(text: str) -> float:
    """argparse ``type`` of ``--max-error``."""
    import argparse

    try:
        return parse_max_error(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class Config:
    """Process-wide settings; attributes may be changed at run time (``convforge.config.autotune = True``)."""

    def __init__(self) -> None:
        env = os.environ
        self.cache_dir: Path = Path(env["CONVFORGE_CACHE_DIR"]) if env.get(
            "CONVFORGE_CACHE_DIR") else _default_cache_dir()
        self.autotune: bool = env.get("CONVFORGE_AUTOTUNE", "0") not in ("", "0", "false")
        self.opencl_device: str = env.get("CONVFORGE_OPENCL_DEVICE", "")  # "platform:device"
        self.db_path: Path | None = Path(env["CONVFORGE_DB"]) if env.get("CONVFORGE_DB") else None
        # 'auto' and family choices only take variants whose stated relative L2 tolerance is at most
        # this (explicitly named variants always run): 1e-3 admits every variant, F(7x7) Winograd
        # included (measured ~6e-5); 5e-5 keeps to F(4x4) and below (~3e-6), 1e-5 to F(2x2),
        # direct and the GEMM family (~1e-6). See docs/NOTES-winograd.md, "Accuracy".
        self.max_error: float = parse_max_error(env.get("CONVFORGE_MAX_ERROR") or str(DEFAULT_MAX_ERROR))
        self.disk_cache: bool = env.get("CONVFORGE_DISK_CACHE", "1") not in ("0", "false")

    @property
    def tuning_db(self) -> Path:
        return self.db_path or (self.cache_dir / "tuning.sqlite")


config = Config()
