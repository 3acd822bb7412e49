"""Configuration, read in one place: environment variables and their defaults."""

from __future__ import annotations

import os
from pathlib import Path


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "convforge"


# Precision classes (BENCHMARKING.md): the relative L2 error each admits. "fp32" also admits, on
# layers where even the most accurate variant exceeds its bound (very long reductions), anything
# within FP32_SLACK x that variant's error.
PRECISIONS = {"fp32": 5e-6, "relaxed": 1e-3}
DEFAULT_PRECISION = "fp32"
FP32_SLACK = 2.0
DEFAULT_MAX_ERROR = 1e-3  # the old default bound, kept for readers of old databases


def precision_key(precision: str | None = None, max_error: float | None = None) -> str:
    """The tuning database's precision field: the class name, or ``max_error=E`` under a finer bound
    (defaults: ``config.precision`` and ``config.max_error``)."""
    bound = max_error if max_error is not None else config.max_error
    if bound is not None:
        return f"max_error={bound:g}"
    return precision or config.precision


def parse_precision(text: str) -> str:
    """A precision class name; ValueError naming the allowed ones otherwise."""
    if text not in PRECISIONS:
        raise ValueError(f"precision ({text!r}) must be one of {', '.join(PRECISIONS)}")
    return text


def parse_max_error(text: str) -> float:
    """A relative-error limit from text; ValueError naming the problem otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"max_error ({text!r}) must be a number such as 1e-5") from None
    if not value > 0:
        raise ValueError(f"max_error ({text}) must be > 0")
    return value


MAX_ERROR_HELP = ("finer than --precision: 'auto' takes only variants whose measured relative L2 error "
                  "(stated error where the tuner measured none) is at most E (env CONVFORGE_MAX_ERROR)")
PRECISION_HELP = ("accuracy class: 'fp32' (default; relative L2 error <= 5e-6, FP32-grade) or 'relaxed' "
                  "(<= 1e-3, TF32-grade: Winograd F(6x6)/F(7x7)); env CONVFORGE_PRECISION")


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
        # The accuracy class 'auto' and family choices keep to (explicitly named variants always run),
        # and an optional finer bound on the measured (else stated) relative L2 error.
        self.precision: str = parse_precision(env.get("CONVFORGE_PRECISION") or DEFAULT_PRECISION)
        self.max_error: float | None = (parse_max_error(env["CONVFORGE_MAX_ERROR"])
                                        if env.get("CONVFORGE_MAX_ERROR") else None)
        self.disk_cache: bool = env.get("CONVFORGE_DISK_CACHE", "1") not in ("0", "false")

    @property
    def tuning_db(self) -> Path:
        return self.db_path or (self.cache_dir / "tuning.sqlite")


config = Config()
