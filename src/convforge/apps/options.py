"""What the commands share: the options they take alike (--spec, --dtype, --pass, --seed, integer
bounds), the one-line message for a missing optional package, the progress bars of the library's
long phases and the check of an output folder. ``cli.py`` and each command import it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from convforge.spec import PASSES, ConvSpec, parse_pass

SPEC_HELP = ("a layer, e.g. 'N=1,C=3,H=13,W=13,K=8,R=3,S=3,stride=1,pad=1'; N C H W K R S are required; "
             "stride and dilation: 2 or 2x1 (h x w); pad: 1, 1x2 (h x w) or 0x1x1x0 (top x bottom x left x right); "
             "also groups=G (G=C: depthwise), layout=nchw|nhwc, dtype=fp32|fp16|bf16, pass=fprop|dgrad|wgrad")
DTYPE_HELP = ("storage dtype of activations and weights: fp32 (default), fp16 or bf16 (half storage, FP32 "
              "accumulation; errors against float64 on the same half inputs)")
SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def dtype_arg(text: str) -> str:
    """argparse ``type`` of ``--dtype``: the canonical dtype name (fp32, fp16, bf16 and their long names)."""
    from convforge.spec import parse_dtype

    try:
        return parse_dtype(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def with_dtype(spec: ConvSpec, dtype: str | None) -> ConvSpec:
    """``spec`` stored as ``dtype`` (--dtype); a spec text naming another dtype is an error."""
    import dataclasses

    if dtype is None or dtype == spec.dtype:
        return spec
    if spec.dtype != "float32":
        raise ValueError(f"--dtype ({dtype}) contradicts the spec's dtype ({spec.dtype})")
    return dataclasses.replace(spec, dtype=dtype)


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", type=dtype_arg, metavar="{fp32,fp16,bf16}", help=DTYPE_HELP)
PASS_HELP = ("the layer's pass: fprop (forward), dgrad (bprop: the gradient of the input) or wgrad (update: the "
             "gradient of the filters)")
PASS_DEFAULT = "the --spec's own (pass=...), else fprop"


def int_arg(least: int) -> Callable[[str], int]:
    """argparse ``type`` of an integer option that must be ``>= least`` (argparse names the option
    in its error: "argument --seed: must be an integer >= 0, not -1")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, not {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, not {value}")
        return value

    return parse


def add_seed_argument(p: argparse.ArgumentParser, help_text: str) -> None:
    """``--seed N`` (an integer >= 0, default 0) on a sub-command."""
    p.add_argument("--seed", type=int_arg(0), default=0, metavar="N", help=help_text + " (an integer >= 0, default 0)")


def pass_arg(allow_all: bool) -> Callable[[str], str]:
    """argparse ``type`` of ``--pass``: a pass (bprop and update as aliases), or 'all' where allowed."""
    import argparse

    def parse(text: str) -> str:
        if allow_all and text == "all":
            return "all"
        try:
            return parse_pass(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{err}{' (or all)' if allow_all else ''}") from None

    return parse


def add_pass_option(p: argparse.ArgumentParser, allow_all: bool, extra: str = "", default: str = PASS_DEFAULT) -> None:
    """``--pass fprop|dgrad|wgrad`` (and ``all`` where ``allow_all``) on a sub-command; ``default``
    says what the command does without it."""
    metavar = "|".join(PASSES) + ("|all" if allow_all else "")
    p.add_argument("--pass", dest="conv_pass", type=pass_arg(allow_all), metavar=metavar,
                   help=PASS_HELP + ("; all: each of the three in turn" if allow_all else "") + extra
                   + f"; default: {default}")


def spec_passes(spec: ConvSpec, choice: str | None) -> list[ConvSpec]:
    """``spec`` in the pass(es) ``--pass`` names: None keeps the spec's own, 'all' gives fprop, dgrad, wgrad."""
    if choice is None:
        return [spec]
    if choice == "all":
        return [spec.with_pass(p) for p in PASSES]
    return [spec.with_pass(choice)]


# Optional packages a command may need: what to call each, and what to install for it.
OPTIONAL = {"torch": ("PyTorch", "convforge[torch]"), "torchvision": ("torchvision", "convforge[torch]"),
            "cupy": ("CuPy", "convforge[cuda]"), "pyopencl": ("PyOpenCL", "convforge[opencl]"),
            "onnx": ("onnx", "convforge[onnx]"), "matplotlib": ("matplotlib", "convforge[plot]"),
            "rich": ("rich", "rich"), "numpy": ("NumPy", "numpy")}


def missing(what: str, module: str, err: ImportError | None = None) -> str:
    """The one-line message for ``what`` (an option or command) lacking optional ``module``."""
    if module in ("sqlite3", "_sqlite3"):
        return (f"{what} needs Python's sqlite3 module, which this Python lacks: use a Python built with "
                "SQLite (the python.org and distribution builds are)")
    name, install = OPTIONAL.get(module, (module, module))
    if err is not None and not (isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == module):
        return f"{what} needs {name}, which failed to import ({err}); reinstall it: pip install '{install}'"
    return f"{what} needs {name}: pip install '{install}'"


def need(what: str, *modules: str) -> None:
    """ValueError naming ``what`` and the install for the first of ``modules`` that does not
    import (keys of OPTIONAL): the CLI prints it as one ``error:`` line and exits 2."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(missing(what, module, err)) from None


@contextmanager
def phase_bars(console: Any) -> Iterator[None]:
    """While the block runs, show the library's long phases (``convforge.progress``: compiling a
    network's kernels, calibrating, timing) on ``console``: on a terminal a progress bar each, and a
    line when one that ran 2 s or more ends; elsewhere (a pipe, a log file) a line when a phase has
    run 2 s (what it does, how far it is) and one when it ends."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from convforge.progress import EVERY_S, Phase, listen

    live = bool(console.is_terminal)
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True, disable=not live)
    tasks: dict[int, Any] = {}
    said: dict[int, float] = {}  # off a terminal: when each phase last printed a line

    def show(phase: Phase, event: str) -> None:
        if event == "start":
            tasks[id(phase)] = bar.add_task(escape(phase.what), total=phase.total)
            return
        task = tasks.get(id(phase))
        if task is None:
            return
        bar.update(task, completed=phase.done)
        if not live and (event == "slow" or (event == "advance" and phase.slow
                                             and phase.seconds - said.get(id(phase), 0.0) >= 5 * EVERY_S)):
            said[id(phase)] = phase.seconds  # a line at 2 s, then at most one every 10 s
            console.print(f"{phase.status()} ...", markup=False, highlight=False)
        if event == "end":
            said.pop(id(phase), None)
            bar.remove_task(task)
            del tasks[id(phase)]
            if phase.slow:
                done = f"{phase.done} {phase.unit} " if phase.unit and phase.done else ""
                console.print(f"{phase.what}: done, {done}in {phase.seconds:.1f} s", markup=False, highlight=False)

    with bar, listen(show):
        yield


def check_out_dir(flag: str, folder: str | Path | None) -> None:
    """Refuse an output folder that cannot be made, before any work is done: a file at its path,
    an ancestor that is a file, or a nearest existing ancestor that is not writable."""
    if folder is None:
        return
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} ({path}) is a file; it must be a folder (created when missing)")
    near = path
    while not near.exists() and near != near.parent:
        near = near.parent
    if not near.is_dir():
        raise ValueError(f"{flag} ({path}) cannot be created: {near} is a file, not a folder")
    if not os.access(near, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} ({path}) cannot be written: {near} is not writable")
