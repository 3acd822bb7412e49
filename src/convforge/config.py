"""Configuration, read in one place: environment variables and their defaults."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "convforge"


# Precision classes (docs/MEASURING.md): the relative L2 error each admits. "fp32" also admits, on
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
    """A precision class name; ValueError naming the allowed ones otherwise (a list or another
    unhashable value included: ``in`` would raise TypeError on it)."""
    if not isinstance(text, str) or text not in PRECISIONS:
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


class ConfigError(ValueError):
    """An environment variable convforge reads holds a value it cannot use."""


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(name: str, text: str) -> bool:
    """An on/off environment value; ValueError naming the variable and the allowed spellings."""
    low = text.strip().lower()
    if low in _TRUE or low in _FALSE:
        return low in _TRUE
    raise ValueError(f"{name} ({text!r}) must be {', '.join(_TRUE)} to enable or {', '.join(_FALSE)} to disable")


def parse_opencl_device(text: str) -> str:
    """``"platform"`` or ``"platform:device"`` (indices from ``convforge devices``), or empty."""
    pi, sep, di = text.partition(":")
    if text and not (pi.isdigit() and (not sep or di.isdigit())):
        raise ValueError(f"CONVFORGE_OPENCL_DEVICE ({text!r}) must be 'PLATFORM' or 'PLATFORM:DEVICE' "
                         "indices such as '0:1' (see convforge devices)")
    return text


def _env_settings(env: Mapping[str, str]) -> dict[str, tuple[str, Callable[[], Any]]]:
    """attribute -> (environment variable, parser of its value with the default when unset)."""

    def get(name: str) -> str:
        return env.get(name, "").strip()

    return {
        "cache_dir": ("CONVFORGE_CACHE_DIR",
                      lambda: Path(get("CONVFORGE_CACHE_DIR")) if get("CONVFORGE_CACHE_DIR") else _default_cache_dir()),
        "autotune": ("CONVFORGE_AUTOTUNE",
                     lambda: parse_bool("CONVFORGE_AUTOTUNE", get("CONVFORGE_AUTOTUNE") or "0")),
        "opencl_device": ("CONVFORGE_OPENCL_DEVICE", lambda: parse_opencl_device(get("CONVFORGE_OPENCL_DEVICE"))),
        "db_path": ("CONVFORGE_DB", lambda: Path(get("CONVFORGE_DB")) if get("CONVFORGE_DB") else None),
        # The accuracy class 'auto' and family choices keep to (explicitly named variants always run),
        # and an optional finer bound on the measured (else stated) relative L2 error.
        "precision": ("CONVFORGE_PRECISION",
                      lambda: parse_precision(get("CONVFORGE_PRECISION") or DEFAULT_PRECISION)),
        "max_error": ("CONVFORGE_MAX_ERROR",
                      lambda: parse_max_error(get("CONVFORGE_MAX_ERROR")) if get("CONVFORGE_MAX_ERROR") else None),
        "disk_cache": ("CONVFORGE_DISK_CACHE",
                       lambda: parse_bool("CONVFORGE_DISK_CACHE", get("CONVFORGE_DISK_CACHE") or "1")),
        # torch and CuPy calls through the C++ fast paths (torch/native.cpp, backends/cupy_native.cpp)
        "native": ("CONVFORGE_NATIVE", lambda: parse_bool("CONVFORGE_NATIVE", get("CONVFORGE_NATIVE") or "1")),
        # The torch native module built with its profiling entry point (native.parts: scripts/host_cost.py
        # --parts), a library of its own; off (the default): production builds carry none
        "native_profile": ("CONVFORGE_NATIVE_PROFILE",
                           lambda: parse_bool("CONVFORGE_NATIVE_PROFILE", get("CONVFORGE_NATIVE_PROFILE") or "0")),
        # Run-to-run bit-identical results (the default): reductions split over blocks (wgrad's split-K)
        # are summed in a fixed order; False also admits atomicAdd reductions (check_deterministic).
        "deterministic": ("CONVFORGE_DETERMINISTIC",
                          lambda: parse_bool("CONVFORGE_DETERMINISTIC", get("CONVFORGE_DETERMINISTIC") or "1")),
        # Batch norm in training mode (with the add and ReLU after it) on convforge's kernels in fused
        # models (FusedConv2d, PreActivation: torch/batchnorm.py); off: PyTorch's modules
        "train_bn": ("CONVFORGE_TRAIN_BN", lambda: parse_bool("CONVFORGE_TRAIN_BN", get("CONVFORGE_TRAIN_BN") or "1")),
        # A conv -> ReLU node's backward writes the masked gradient straight into its dgrad and wgrad GEMMs'
        # operand layouts (kernels/tensorcore/sm90/gradrows.py) where both passes are tensor-core plans; off: the
        # masked gradient in NCHW, then the passes' own transposes
        "grad_rows": ("CONVFORGE_GRAD_ROWS",
                      lambda: parse_bool("CONVFORGE_GRAD_ROWS", get("CONVFORGE_GRAD_ROWS") or "1")),
        # A fused conv -> batch norm [-> + residual] [-> ReLU] block in training as one C++ autograd node
        # (torch/native.cpp BlockNode: conv and batch-norm launches from C++); off: the op's node, then the
        # batch norm's own node (native_nodes.inc BnNode), for debugging
        "native_block": ("CONVFORGE_NATIVE_BLOCK",
                         lambda: parse_bool("CONVFORGE_NATIVE_BLOCK", get("CONVFORGE_NATIVE_BLOCK") or "1")),
        # That block's conv writes the batch norm's partial sums in its epilogue (tensor-core NHWC forwards:
        # sm90/epilogue.py), so the batch norm finalizes them and never reads y for its statistics; off: the
        # batch norm's own statistics pass (for debugging)
        "bn_stats": ("CONVFORGE_BN_STATS", lambda: parse_bool("CONVFORGE_BN_STATS", get("CONVFORGE_BN_STATS") or "1")),
        # A fused block's input gradient and a later block's residual gradient of the same tensor (a bottleneck's
        # first and last blocks) summed in the first block's dgrad epilogue (torch/native.cpp PairToken) instead
        # of by autograd's add, where that dgrad prefetches its residual (16-bit layers); on by default (the adds'
        # three passes gone: docs/NOTES-training.md, twenty-fourth session), 0 for debugging (read when the
        # native module loads and at filing; ``set_residual_grad`` on the native module changes it at run time)
        "residual_grad": ("CONVFORGE_RESIDUAL_GRAD",
                          lambda: parse_bool("CONVFORGE_RESIDUAL_GRAD", get("CONVFORGE_RESIDUAL_GRAD") or "1")),
        # A half conv [+ bias] -> ReLU layer in training (FusedConv2d) as one C++ autograd node (torch/native.cpp
        # ConvReluNode: no Python on a warm forward or backward), on by default; 0 keeps Python's
        # conv_relu._ConvRelu (the same kernels and ops in the same order), for debugging
        "native_conv_relu": ("CONVFORGE_NATIVE_CONV_RELU", lambda: parse_bool(
            "CONVFORGE_NATIVE_CONV_RELU", get("CONVFORGE_NATIVE_CONV_RELU") or "1")),
        # ConvNeXt's MLP in training (fuse()'s FusedLinear chains: LayerNorm -> Linear -> GELU and Linear -> layer
        # scale -> stochastic depth -> + input) as two autograd nodes on convforge's kernels (torch/mlp_train.py),
        # half compute only; on by default (ConvNeXt-T's BF16 AMP step 1.38x -> 1.59x PyTorch AMP on the H200,
        # docs/NOTES-training.md), 0 runs PyTorch's operations (for debugging)
        "mlp_train": ("CONVFORGE_MLP_TRAIN",
                      lambda: parse_bool("CONVFORGE_MLP_TRAIN", get("CONVFORGE_MLP_TRAIN") or "1")),
        # A fused model's training forward and backward replayed from CUDA graphs once a call's shapes have
        # run eagerly twice (torch/graphs.py: the host's hundreds of launches a step become two); 0: eager
        "train_graphs": ("CONVFORGE_TRAIN_GRAPHS",
                         lambda: parse_bool("CONVFORGE_TRAIN_GRAPHS", get("CONVFORGE_TRAIN_GRAPHS") or "1")),
        # A fused or converted model's first training forward compiles the step's dgrad and wgrad programs ahead
        # on a pool of threads (torch/train_ahead.py); 0: each program compiles when the backward first reaches it
        "train_ahead": ("CONVFORGE_TRAIN_AHEAD",
                        lambda: parse_bool("CONVFORGE_TRAIN_AHEAD", get("CONVFORGE_TRAIN_AHEAD") or "1")),
        # 'auto' keeps to families whose intermediates overflow only where the answer does (no Winograd) for
        # every array kind: values near FLT_MAX stay finite where the exact answer is (NumPy input is checked
        # per call without it; torch and CuPy arrays are not read on the host, so this is their switch)
        "finite_exact": ("CONVFORGE_FINITE_EXACT",
                         lambda: parse_bool("CONVFORGE_FINITE_EXACT", get("CONVFORGE_FINITE_EXACT") or "0")),
        # The convforge::conv2d op's autograd node in C++ (torch/native.cpp ConvNode) instead of Python's
        # ops._Conv2dFn, on by default (every dtype and layout); 0 keeps Python's node, for debugging
        # (read when the native module loads)
        "native_autograd": ("CONVFORGE_NATIVE_AUTOGRAD",
                            lambda: parse_bool("CONVFORGE_NATIVE_AUTOGRAD", get("CONVFORGE_NATIVE_AUTOGRAD") or "1")),
    }


# Settings read afresh on every call that key no cached choice or program (bn_stats: in a block's filing key, not
# in a conv's): assigning one calls no listener (the native table keeps its entries, so an A/B in one process
# compares warm paths)
_SWITCHES = frozenset({"native_block", "native_conv_relu", "bn_stats", "train_ahead", "residual_grad", "mlp_train",
                       "train_graphs"})


class Config:
    """Process-wide settings; attributes may be changed at run time (``convforge.config.autotune = True``).

    A bad environment value does not fail the import: the setting is left unset, reading it raises
    :class:`ConfigError` naming the variable (so ``conv2d`` reports it), assigning it clears the
    problem, and :meth:`validate` (the CLI calls it first) reports every remaining one."""

    cache_dir: Path
    autotune: bool
    opencl_device: str  # "platform:device"
    db_path: Path | None
    precision: str
    max_error: float | None
    disk_cache: bool
    native: bool
    native_profile: bool
    deterministic: bool
    train_bn: bool
    grad_rows: bool
    native_block: bool
    native_conv_relu: bool
    mlp_train: bool
    bn_stats: bool
    residual_grad: bool
    train_ahead: bool
    train_graphs: bool
    native_autograd: bool
    finite_exact: bool

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._listeners: list[Callable[[], Any]] = []
        self._problems: dict[str, str] = {}
        for attr, (var, parse) in _env_settings(os.environ if env is None else env).items():
            try:
                setattr(self, attr, parse())
            except ValueError as err:
                msg = str(err)
                self._problems[attr] = msg if var in msg else f"{var}: {msg}"

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes that are not set: those whose environment value was bad
        problems = self.__dict__.get("_problems", {})
        if name in problems:
            raise ConfigError(problems[name])
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _SWITCHES:
            return
        for listener in self.__dict__.get("_listeners", ()):
            listener()

    def on_change(self, listener: Callable[[], Any]) -> None:
        """Call ``listener()`` after every assignment of a setting (caches keyed on settings drop
        their entries: the native fast path's table)."""
        self._listeners.append(listener)

    def problems(self) -> list[str]:
        """What is wrong with the environment, for settings not since assigned."""
        return [msg for attr, msg in self._problems.items() if attr not in self.__dict__]

    def validate(self) -> None:
        """ConfigError listing every bad environment value still in force."""
        bad = self.problems()
        if bad:
            raise ConfigError("; ".join(bad))

    @property
    def tuning_db(self) -> Path:
        return self.db_path or (self.cache_dir / "tuning.sqlite")


config = Config()


def nondeterministic_allowed() -> bool:
    """Whether plans whose result may differ from run to run (atomicAdd reductions) may be planned,
    tuned or chosen: only when the user turned ``config.deterministic`` off (``CONVFORGE_DETERMINISTIC=0``).
    The one place that reads the setting."""
    return not config.deterministic


def check_deterministic(what: str) -> None:
    """ValueError naming ``what`` unless :func:`nondeterministic_allowed`."""
    if not nondeterministic_allowed():
        raise ValueError(f"{what} is not run-to-run deterministic: set convforge.config.deterministic = False "
                         "(or CONVFORGE_DETERMINISTIC=0) to allow it")
