"""The command line: convforge devices | algos | show | bench | tune | db | run."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from convforge import __version__
from convforge.config import MAX_ERROR_HELP, PRECISION_HELP, PRECISIONS, config, max_error_arg
from convforge.params import Params
from convforge.spec import PASSES, ConvSpec, parse_pass

SPEC_HELP = "layer, e.g. 'N=1,C=3,H=13,W=13,K=8,R=3,S=3,stride=1,pad=1' (pad: 1, 1x2 or 0x1x1x0)"
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
             "gradient of the filters); default: the --spec's own (pass=...), else fprop")


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


def add_pass_option(p: argparse.ArgumentParser, allow_all: bool, extra: str = "") -> None:
    """``--pass fprop|dgrad|wgrad`` (and ``all`` where ``allow_all``) on a sub-command."""
    metavar = "|".join(PASSES) + ("|all" if allow_all else "")
    p.add_argument("--pass", dest="conv_pass", type=pass_arg(allow_all), metavar=metavar,
                   help=PASS_HELP + ("; all: each of the three in turn" if allow_all else "") + extra)


def spec_passes(spec: ConvSpec, choice: str | None) -> list[ConvSpec]:
    """``spec`` in the pass(es) ``--pass`` names: None keeps the spec's own, 'all' gives fprop, dgrad, wgrad."""
    if choice is None:
        return [spec]
    if choice == "all":
        return [spec.with_pass(p) for p in PASSES]
    return [spec.with_pass(choice)]


def cmd_devices(args: argparse.Namespace) -> int:
    """List the CUDA and OpenCL devices convforge can use."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"convforge {__version__}: devices")
    for col in ("back-end", "index", "platform", "device"):
        table.add_column(col)
    try:
        from convforge.backends.cuda import CudaBackend, device_count

        for i in range(device_count()):
            dev = CudaBackend(i).device
            table.add_row("cuda", str(i), f"driver {dev.driver}", f"{dev.name} (sm_{dev.cc[0]}{dev.cc[1]})"
                          if dev.cc else dev.name)
    except ImportError:
        table.add_row("cuda", "-", r"CuPy not installed (pip install 'convforge\[cuda]')", "")
    try:
        from convforge.backends.opencl import list_devices, refusal_of

        for pi, di, plat, name in list_devices():
            why = refusal_of(pi, di)
            table.add_row("opencl", f"{pi}:{di}", plat, name + (f" [red](cannot build: {why})[/red]" if why else ""))
        if not list_devices():
            table.add_row("opencl", "-", "no OpenCL device (no platform offers one; POCL_DEBUG=1 says why "
                          "PoCL does not)", "")
    except ImportError:
        table.add_row("opencl", "-", r"PyOpenCL not installed (pip install 'convforge\[opencl]')", "")
    Console().print(table)
    return 0


def _device_for(backend: str):  # type: ignore[no-untyped-def]
    """The real device when present, otherwise a nominal one (so sources can be shown anywhere)."""
    from convforge.plan import DeviceInfo

    if backend == "cuda":
        from convforge.backends import cuda_available, get_backend

        if cuda_available():
            return get_backend("cuda").device
        return DeviceInfo("cuda", "nominal sm_90", cc=(9, 0), shared_optin_bytes=227 * 1024, units=132)
    from convforge.backends import get_backend, opencl_available

    if opencl_available():
        return get_backend("opencl").device
    return DeviceInfo("opencl", "nominal OpenCL GPU (no OpenCL device here)", units=132)


def cmd_algos(args: argparse.Namespace) -> int:
    """Variants that apply to a layer in each pass asked for, with their default parameters and space size."""
    dev = _device_for(args.backend)
    for spec in spec_passes(with_dtype(ConvSpec.parse(args.spec), args.dtype), args.conv_pass):
        _print_algos(spec, dev)
    return 0


def _print_algos(spec: ConvSpec, dev) -> None:  # type: ignore[no-untyped-def]
    """One pass of a layer: every variant that computes it, applicable or not (and why), then one
    line per set of variants that compute only other passes."""
    from convforge import kernels

    name = spec.short() + (" fprop" if spec.conv_pass == "fprop" else "")  # short() names the other passes
    print(f"{name}  (P={spec.p}, Q={spec.q}, {spec.flops / 1e9:.3f} GFLOP) on {dev.name}")
    elsewhere: dict[str, list[str]] = {}
    for v in kernels.all_variants():
        if spec.conv_pass not in v.passes:
            elsewhere.setdefault(", ".join(sorted(v.passes)), []).append(v.name)
            continue
        why = v.applies(spec, dev)
        if why:
            print(f"  - {v.name:26s} not applicable: {why}")
            continue
        why = kernels.accurate_enough(v, spec)
        if why:
            print(f"  ~ {v.name:26s} not chosen by 'auto': {why} (runs when named)")
        else:
            print(f"  + {v.name:26s} default [{v.default(spec, dev).short()}], "
                  f"{len(v.space(spec, dev))} points")
    for passes, names in elsewhere.items():
        print(f"  . {len(names)} variant(s) compute only {passes}: {', '.join(names)}")


def cmd_show(args: argparse.Namespace) -> int:
    """Print the generated source of a spec/variant on one or both back-ends."""
    from convforge import kernels
    from convforge.plan import Epilogue

    spec = spec_passes(with_dtype(ConvSpec.parse(args.spec), args.dtype), args.conv_pass)[0]
    variant = kernels.get_variant(args.variant or _show_default(spec))
    backends = ["cuda", "opencl"] if args.backend == "both" else [args.backend]
    for be in backends:
        if be not in variant.backends:
            print(f"// {variant.name} is not offered on {be}", file=sys.stderr)
            continue
        dev = _device_for(be)
        why = variant.applies(spec, dev)
        if why:
            print(f"error: {variant.name} does not apply: {why}", file=sys.stderr)
            return 2
        prm = Params.parse(args.params) if args.params else variant.default(spec, dev)
        if args.params:  # over the default, so naming only what changes is enough
            prm = kernels.check_params(variant, spec, dev, Params(dict(variant.default(spec, dev)), **dict(prm)))
        plan = variant.plan(spec, prm, dev, Epilogue(args.bias, args.relu))
        src = plan.source(be)
        print(f"// ===== {be} =====")
        print(src)
        if args.ptxas and be == "cuda":
            from convforge.codegen.nvcc import ptxas_report

            for info in ptxas_report(src):
                print(f"// ptxas {info.kernel}: {info.registers} registers, {info.spill_stores}+"
                      f"{info.spill_loads} spill bytes, {info.stack} stack, {info.shared} smem")
    return 0


def _show_default(spec: ConvSpec) -> str:
    """``show``'s variant when none is named: direct for fprop, the pass's exact baseline
    (dgrad_direct, wgrad_direct: every layer) else, or the most specialised variant of the direct
    family that computes the pass (the first that computes it at all, if none)."""
    from convforge import kernels

    if spec.conv_pass == "fprop":
        return "direct"
    mine = [v for v in kernels.all_variants() if spec.conv_pass in v.passes]
    if not mine:
        raise ValueError(f"no variant computes {spec.conv_pass}")
    if any(v.name == f"{spec.conv_pass}_direct" for v in mine):
        return f"{spec.conv_pass}_direct"
    direct = [v for v in mine if v.family == "direct"] or mine
    return max(direct, key=lambda v: v.specialised).name


# Optional packages a command may need: what to call each, and what to install for it.
OPTIONAL = {"torch": ("PyTorch", "convforge[torch]"), "torchvision": ("torchvision", "convforge[torch]"),
            "cupy": ("CuPy", "convforge[cuda]"), "pyopencl": ("PyOpenCL", "convforge[opencl]"),
            "onnx": ("onnx", "convforge[onnx]"), "matplotlib": ("matplotlib", "convforge[plot]")}


def missing(what: str, module: str, err: ImportError | None = None) -> str:
    """The one-line message for ``what`` (an option or command) lacking optional ``module``."""
    name, install = OPTIONAL[module]
    if err is not None and not (isinstance(err, ModuleNotFoundError) and err.name == module):
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


def _add_optional(sub: argparse._SubParsersAction, name: str, module: str, add: str, run: str,
                  help_text: str) -> None:
    """Sub-commands owned by other packages; absent ones say so instead of crashing."""
    import importlib

    p = sub.add_parser(name, help=help_text)
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        msg = str(err)
        p.set_defaults(func=lambda a: _unavailable(name, msg))
        return
    getattr(mod, add)(p)
    p.set_defaults(func=getattr(mod, run))


def _unavailable(name: str, why: str) -> int:
    print(f"convforge {name} is not available: {why}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convforge", description=__doc__)
    parser.add_argument("--version", action="version", version=f"convforge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("devices", help="list usable devices and back-ends")
    p.set_defaults(func=cmd_devices)
    p = sub.add_parser("algos", help="list the variants that apply to a layer")
    p.add_argument("--spec", required=True, help=SPEC_HELP)
    p.add_argument("--backend", choices=("cuda", "opencl"), default="cuda")
    p.add_argument("--precision", choices=tuple(PRECISIONS), help=PRECISION_HELP)
    p.add_argument("--max-error", type=max_error_arg, metavar="E", help=MAX_ERROR_HELP)
    add_pass_option(p, allow_all=True)
    add_dtype_argument(p)
    p.set_defaults(func=cmd_algos)
    p = sub.add_parser("show", help="print generated kernel source")
    p.add_argument("--spec", required=True, help=SPEC_HELP)
    p.add_argument("--variant", help="default: direct (fprop), the pass's direct variant (dgrad, wgrad)")
    add_pass_option(p, allow_all=False)
    p.add_argument("--params", default="", help="override default parameters, e.g. 'tp=2,tk=4'")
    p.add_argument("--backend", choices=("cuda", "opencl", "both"), default="both")
    p.add_argument("--bias", action="store_true")
    p.add_argument("--relu", action="store_true")
    p.add_argument("--ptxas", action="store_true", help="also compile with nvcc and print registers/spills")
    add_dtype_argument(p)
    p.set_defaults(func=cmd_show)
    _add_optional(sub, "bench", "convforge.bench.command", "add_arguments", "main",
                  "benchmark suites against cuDNN-best")
    _add_optional(sub, "tune", "convforge.tune.command", "add_tune_arguments", "tune_main",
                  "autotune a suite into the tuning database")
    _add_optional(sub, "db", "convforge.tune.command", "add_db_arguments", "db_main",
                  "inspect, export, import or clear the tuning database")
    _add_optional(sub, "run", "convforge.graph.command", "add_arguments", "main",
                  "run a whole network (alexnet, nin, googlenet, vgg16, resnet50, .prototxt, .onnx)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input of any kind (arguments, environment variables, files at the
    database path) is one ``error: ...`` line and exit status 2, never a traceback; running out of
    device or host memory is one such line and exit status 1."""
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "max_error", None) is not None:
            config.max_error = args.max_error
        if getattr(args, "precision", None) in PRECISIONS:  # tune/algos; bench keeps its own classes
            config.precision = args.precision
        config.validate()
        func: Callable[[argparse.Namespace], int] = args.func
        return int(func(args) or 0)
    except ModuleNotFoundError as err:  # an optional package a path forgot to check with need()
        root = (err.name or "").split(".")[0]
        if root not in OPTIONAL:
            raise
        print(f"error: {missing('this command', root)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left early (`convforge algos | head`): stop quietly, as Unix tools do
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the closed pipe stopped
    except (ValueError, TypeError, OSError) as err:  # TypeError: bad JSON / params shapes from users
        print(f"error: {err}", file=sys.stderr)
        return 2
    except MemoryError as err:  # DeviceMemoryError, CuPy's OutOfMemoryError: a batch or layer too big
        print(f"error: out of memory: {err or 'the host could not allocate'}; try a smaller batch, input size "
              "or --workspace-limit", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at the null device, so the interpreter's last flush meets no closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout replaced by something without a descriptor (tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
