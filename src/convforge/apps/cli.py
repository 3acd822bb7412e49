"""The command line: convforge devices | algos | show | bench | tune | db | run."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from convforge.apps.options import (
    OPTIONAL,
    SPEC_HELP,
    add_dtype_argument,
    add_pass_option,
    missing,
    spec_passes,
    with_dtype,
)
from convforge.config import MAX_ERROR_HELP, PRECISION_HELP, PRECISIONS, config, max_error_arg
from convforge.params import Params
from convforge.spec import ConvSpec
from convforge.version import __version__

BACKEND_HELP = ("cuda or opencl; default: the one `run` and `bench` use (cuda when a CUDA device is visible, "
                "else opencl)")


def cmd_devices(args: argparse.Namespace) -> int:
    """List the CUDA and OpenCL devices convforge can use, and what each is for: an OpenCL CPU
    device (PoCL) checks kernels without a GPU; it is not a fast back-end."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"convforge {__version__}: devices")
    for col in ("back-end", "index", "platform", "device", "use"):
        table.add_column(col)
    cpu = False
    try:
        from convforge.backends.cuda import CudaBackend, device_count

        for i in range(device_count()):
            dev = CudaBackend(i).device
            table.add_row("cuda", str(i), f"driver {dev.driver}", f"{dev.name} (sm_{dev.cc[0]}{dev.cc[1]})"
                          if dev.cc else dev.name, "speed")
    except ImportError:
        table.add_row("cuda", "-", r"CuPy not installed (pip install 'convforge\[cuda]')", "", "")
    try:
        from convforge.backends.opencl import list_devices, refusal_of

        for pi, di, plat, name in list_devices():
            why = refusal_of(pi, di)
            on_cpu = _cpu_opencl(plat, name)
            cpu = cpu or on_cpu
            table.add_row("opencl", f"{pi}:{di}", plat, name + (f" [red](cannot build: {why})[/red]" if why else ""),
                          "correctness, not speed" if on_cpu else "speed")
        if not list_devices():
            table.add_row("opencl", "-", "no OpenCL device (no platform offers one; POCL_DEBUG=1 says why "
                          "PoCL does not)", "", "")
    except ImportError:
        table.add_row("opencl", "-", r"PyOpenCL not installed (pip install 'convforge\[opencl]')", "", "")
    if cpu:
        table.caption = ("OpenCL on a CPU (PoCL) is a correctness back-end: every kernel runs and is checked without "
                         "a GPU, several times slower than NumPy's BLAS on the same layers; speed is measured on GPUs")
    Console().print(table)
    return 0


def _cpu_opencl(platform: str, name: str) -> bool:
    """Whether an OpenCL device is a CPU (PoCL's, or a vendor's CPU runtime)."""
    text = f"{platform} {name}".lower()
    return "portable computing language" in text or "pthread" in text or " cpu" in text


def _default_backend() -> str:
    """The back-end ``run`` and ``bench`` use when none is named: CUDA when a device is visible."""
    from convforge.backends import cuda_available

    return "cuda" if cuda_available() else "opencl"


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
    """Variants that apply to a layer in each pass asked for, with their default parameters and space
    size; with ``--matrix``, the registry's family x pass x dtype x architecture table instead."""
    if args.matrix:
        from convforge import kernels
        from convforge.apps.matrix import format_matrix, matrix

        print(format_matrix(matrix(kernels.all_variants())))
        return 0
    dev = _device_for(args.backend or _default_backend())
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
    backends = ["cuda", "opencl"] if args.backend == "both" else [args.backend or _default_backend()]
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



def _add_optional(sub: argparse._SubParsersAction, name: str, module: str, add: str, run: str,
                  help_text: str) -> None:
    """A sub-command defined in another module. Its options are there even when a package the
    command needs cannot be imported (the module defers those imports and names the failure in
    ``IMPORT_ERROR``): ``-h`` lists them and says what to install; running it is one error line."""
    import importlib

    p = sub.add_parser(name, help=help_text, description=_sentence(help_text))
    try:
        mod = importlib.import_module(module)
    except ImportError as err:  # the module itself: nothing to list
        p.description = f"{_sentence(help_text)} Not available here: {_install(name, err)}."
        p.add_argument("arguments", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=lambda a, e=err: _unavailable(name, e))
        return
    getattr(mod, add)(p)
    failed: ImportError | None = getattr(mod, "IMPORT_ERROR", None)
    if failed is not None:
        p.description = f"{_sentence(help_text)} Not available here: {_install(name, failed)}."
        p.set_defaults(func=lambda a, e=failed: _unavailable(name, e))
        return
    p.set_defaults(func=getattr(mod, run))


def _install(name: str, err: ImportError) -> str:
    """What a command lacks and what to install, from the ImportError its module met."""
    root = (getattr(err, "name", None) or "").split(".")[0]
    return missing(f"convforge {name}", root, err) if root else f"convforge {name} failed to import ({err})"


def _unavailable(name: str, err: ImportError) -> int:
    print(f"error: {_install(name, err)}", file=sys.stderr)
    return 2


def _sentence(text: str) -> str:
    """A help line as a description sentence: capitalised, ending in a full stop."""
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _finish(parser: argparse.ArgumentParser) -> None:
    """Every sub-command, at any depth, gets its help line as its description (``-h`` says what it
    does); a command with sub-commands (``db``) lends its options to each of them, so they may
    follow the sub-command too (``db list --db FILE`` as ``db --db FILE list``)."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help for a in action._choices_actions}
        shared = [a for a in parser._actions if a.option_strings and type(a) is argparse._StoreAction]
        for name, child in action.choices.items():
            if child.description is None and helps.get(name):
                child.description = _sentence(str(helps[name]))
            mine = {s for a in child._actions for s in a.option_strings}
            for a in shared:
                if not mine & set(a.option_strings):
                    child.add_argument(*a.option_strings, dest=a.dest, type=a.type, metavar=a.metavar,
                                       choices=a.choices, help=a.help, default=argparse.SUPPRESS)
            _finish(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convforge", description=__doc__)
    parser.add_argument("--version", action="version", version=f"convforge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("devices", help="list the CUDA and OpenCL devices convforge can use, and what each is for")
    p.set_defaults(func=cmd_devices)
    p = sub.add_parser("algos", help="list the variants that apply to a layer, with their default parameters, "
                       "or (--matrix) which family serves which pass, dtype and architecture")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--spec", help=SPEC_HELP)
    what.add_argument("--matrix", action="store_true",
                      help="print the registry's table: a row per family and pass, a column per dtype, each cell "
                           "the back-ends and architectures that serve it and how many variants")
    p.add_argument("--backend", choices=("cuda", "opencl"), help=BACKEND_HELP)
    p.add_argument("--precision", choices=tuple(PRECISIONS), help=PRECISION_HELP)
    p.add_argument("--max-error", type=max_error_arg, metavar="E", help=MAX_ERROR_HELP)
    add_pass_option(p, allow_all=True)
    add_dtype_argument(p)
    p.set_defaults(func=cmd_algos)
    p = sub.add_parser("show", help="print the generated kernel source of a layer and variant")
    p.add_argument("--spec", required=True, help=SPEC_HELP)
    p.add_argument("--variant", help="default: direct (fprop), the pass's direct variant (dgrad, wgrad)")
    add_pass_option(p, allow_all=False)
    p.add_argument("--params", default="", help="override default parameters, e.g. 'tp=2,tk=4'")
    p.add_argument("--backend", choices=("cuda", "opencl", "both"),
                   help=BACKEND_HELP + "; both: the CUDA C and the OpenCL C source")
    p.add_argument("--bias", action="store_true", help="with a bias in the epilogue")
    p.add_argument("--relu", action="store_true", help="with a ReLU in the epilogue")
    p.add_argument("--ptxas", action="store_true", help="also compile with nvcc and print registers/spills")
    add_dtype_argument(p)
    p.set_defaults(func=cmd_show)
    _add_optional(sub, "bench", "convforge.apps.bench.bench_command", "add_arguments", "main",
                  "benchmark a suite of layers, or whole torchvision models, against each precision class's "
                  "baseline (cuDNN-best on a GPU; PyTorch or NumPy on a CPU)")
    _add_optional(sub, "tune", "convforge.apps.tune.tune_command", "add_tune_arguments", "tune_main",
                  "autotune a suite, layers, a network or a model into the tuning database")
    _add_optional(sub, "db", "convforge.apps.tune.tune_command", "add_db_arguments", "db_main",
                  "inspect, export, import or clear the tuning database")
    _add_optional(sub, "run", "convforge.apps.run.run_command", "add_arguments", "main",
                  "run a whole network (alexnet, nin, googlenet, vgg16, resnet50, .prototxt, .onnx): build, check "
                  "against float64, time each step")
    _finish(parser)
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
