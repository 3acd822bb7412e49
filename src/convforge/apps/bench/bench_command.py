"""``convforge bench``: run a suite with convforge and the baselines, print the table, write results.

Wired by cli.py as ``add_arguments(subparser)`` and ``main(args)``; ``python -m convforge.apps.bench.bench_command``
runs it standalone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from convforge.apps.bench import baselines
from convforge.apps.bench.suites import ABLATIONS, BUILTIN, Layer, SuiteError, load_suite
from convforge.config import MAX_ERROR_HELP, config, max_error_arg
from convforge.error_budget import TIGHT

IMPORT_ERROR: ImportError | None = None  # what running a bench needs and cannot import (cli says so)
try:  # not needed to list the options: `convforge bench -h` works without them
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from convforge.apps.bench import ceilings, plots, report, runner, sweep
    from convforge.apps.bench.timing import Timing
except ImportError as _err:
    IMPORT_ERROR = _err

if TYPE_CHECKING:
    from convforge.backends.base import Backend

PRECISION_CHOICES = ("fp32", "relaxed", "both")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Bench's options on the ``bench`` subparser."""
    parser.add_argument("--suite", metavar="NAME|FILE",
                        help=f"built-in suite ({', '.join(BUILTIN)}) or a JSON file of layers "
                        "(required, except with --ablation: mec)")
    parser.add_argument("--limit", type=int, metavar="K", help="only the first K layers")
    parser.add_argument("--algo", action="append", metavar="A",
                        help="family, variant or 'auto' (repeatable; default: auto)")
    parser.add_argument("--backend", choices=("cuda", "opencl"),
                        help="default: cuda when a CUDA device is visible, else opencl")
    parser.add_argument("--baseline", choices=baselines.KINDS,
                        help="cudnn (cuDNN-best: PyTorch's pick and every cuDNN algorithm), torch (PyTorch's pick, "
                        "on the GPU or the CPU), numpy (im2col + NumPy's BLAS matmul, float32, on the CPU) or none; "
                        "default: cudnn on cuda, else torch on opencl when PyTorch is installed, else numpy")
    parser.add_argument("--out", metavar="DIR", help="write results.json, results.csv and PNG plots here")
    parser.add_argument("--compare-backends", action="store_true",
                        help="run convforge through CUDA and OpenCL on the same GPU, side by side")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default 3 on GPUs, 1 on CPUs)")
    parser.add_argument("--repeats", type=int, help="timed calls, median taken (default 25 / 3)")
    parser.add_argument("--batch-slice", type=int, metavar="N",
                        help="check only the first N images against the reference")
    parser.add_argument("--quick-ceilings", action="store_true",
                        help="measure the ceilings with tiny kernels (smoke tests)")
    from convforge.apps.options import add_seed_argument

    add_seed_argument(parser, "seed of the layers' random inputs and filters")
    parser.add_argument("--max-error", type=max_error_arg, metavar="E", help=MAX_ERROR_HELP)
    parser.add_argument("--precision", dest="precision_classes", choices=PRECISION_CHOICES,
                        help="accuracy class(es) to run, each against its own baseline: 'fp32' (error "
                        "<= 5e-6, vs cuDNN-best FP32), 'relaxed' (<= 1e-3, vs cuDNN-best TF32) or 'both' "
                        "(default: fp32, or CONVFORGE_PRECISION); with --model: the convforge rows' class(es), "
                        "against PyTorch FP32 or PyTorch TF32")
    parser.add_argument("--model", action="append", metavar="NAME[:BATCH]",
                        help="whole torchvision model, random weights (repeatable): resnet18, resnet50, vgg16, "
                        "googlenet, alexnet, inception_v3, resnext50_32x4d, regnet_y_1_6gf, mobilenet_v2, "
                        "mobilenet_v3_large, convnext_tiny, densenet121, efficientnet_b0, shufflenet_v2_x1_0; "
                        "PyTorch FP32/TF32/compile vs the converted model")
    parser.add_argument("--tune", action="store_true",
                        help="with --model: tune every convforge layer in its row's precision class into the "
                        "database before timing (config.autotune on the warm-up call)")
    parser.add_argument("--error-budget", type=_budget_arg, metavar="R",
                        help="with --model: calibrate the fused model first (convforge.torch.calibrate): the "
                        f"fewest layers set to max_error={TIGHT:g} that bring its output error within R x PyTorch's, "
                        "on a separate random input")
    parser.add_argument("--dtype", type=_dtype_arg, metavar="{fp32,fp16,bf16}",
                        help="storage dtype of the layers (half: FP32 accumulation; baseline cuDNN-best of that "
                        "dtype, errors against float64 on the same half inputs); with --model: the model in "
                        "that dtype against PyTorch autocast with channels_last")
    parser.add_argument("--layout", choices=("nchw", "nhwc"),
                        help="with --suite: activations in NCHW (default) or NHWC memory on every side (cuDNN gets "
                        "channels_last tensors); NHWC is read by depthwise_nhwc, so depthwise layers only")
    from convforge.apps.options import add_pass_option

    add_pass_option(parser, allow_all=True, extra=" (--suite): each pass against cuDNN-best of that pass",
                    default="fprop, or each suite layer's own pass")
    parser.add_argument("--train", action="store_true",
                        help="with --model: time one training step (forward + cross-entropy + backward + SGD) of "
                        "the converted and the fused model against PyTorch FP32 (TF32 for the relaxed class), "
                        "and a 50-step loss curve of each beside PyTorch's")
    parser.add_argument("--amp", nargs="?", const="fp16", choices=("fp16", "bf16"),
                        help="with --model --train: the mixed-precision step (autocast in that dtype, default fp16, "
                        "GradScaler for fp16, channels_last, SGD momentum) against PyTorch AMP; images/s, peak "
                        "memory, first step and a 100-step loss curve beside PyTorch's (bench/training_amp.py)")
    parser.add_argument("--first-call", action="store_true",
                        help="with --model: the first forward of the fused model (with --train --amp: its first "
                        "AMP training step) in a new process, with an empty cache (cold) and with the cache the "
                        "first process left (warm), in seconds")
    parser.add_argument("--devices", metavar="N|all",
                        help="with --model --train: the step also in DistributedDataParallel on N GPUs (one process "
                        "per GPU through torchrun) against one GPU: images/s, scaling, efficiency (bench/ddp.py)")
    parser.add_argument("--sweep", action="store_true",
                        help="time every point of each --algo variant's tuning space on every layer (checked, "
                        "the tuner's measurement) instead of the baselines; writes sweep.json with --out")
    parser.add_argument("--sweep-limit", type=int, metavar="K", help="with --sweep: the first K points of each space")
    parser.add_argument("--sweep-mods", metavar="'k=v,k=v;k=v'",
                        help="with --sweep: each variant's default and the default changed by each "
                        "';'-separated mod, instead of the space")
    parser.add_argument("--sweep-points", metavar="FILE",
                        help="with --sweep: a JSON object from layer name to a list of 'k=v,k=v' mods; each named "
                        "layer's default and its own changes (per-layer slice counts, say), the others skipped")
    parser.add_argument("--sweep-epilogue", metavar="'bias,residual,relu'",
                        help="with --sweep: every point runs with this epilogue (bias, residual and one of relu, "
                        "gelu, silu, hardswish, mish; checked against float64 with it), as a fused block's layer "
                        "does; default none")
    parser.add_argument("--ablation", choices=sorted(ABLATIONS),
                        help="time one variant in its ablation configurations instead "
                        "(im2win: all on / no prefetch+double buffer / no vector loads / "
                        "no micro-kernel); no baseline unless --baseline is given")


def _dtype_arg(text: str) -> str:
    from convforge.apps.options import dtype_arg

    return dtype_arg(text)


def _with_dtype(layers: list[Layer], dtype: str | None) -> list[Layer]:
    """The suite's layers stored as ``--dtype`` (a layer naming another dtype is an error)."""
    import dataclasses

    from convforge.apps.options import with_dtype

    try:
        return [dataclasses.replace(la, spec=with_dtype(la.spec, dtype)) for la in layers]
    except ValueError as err:
        raise SuiteError(str(err)) from None


def _with_layout(layers: list[Layer], layout: str | None, backends: list[Backend]) -> list[Layer]:
    """The layers with activations in ``layout`` memory, without those no variant runs in that layout
    on ``backends`` (NHWC: the depthwise family for depthwise layers in every pass, the tensor-core GEMMs
    of sm_90 for the others), each of them named on stderr; an error when none is left."""
    import dataclasses
    import sys

    from convforge.kernels import all_variants

    if layout in (None, "nchw"):
        return layers
    out = [dataclasses.replace(la, spec=dataclasses.replace(la.spec, layout=layout)) for la in layers]
    names = "/".join(be.name for be in backends)
    kept = [la for la in out if any(v.applies(la.spec, be.device) is None for v in all_variants() for be in backends)]
    for la in out:
        if la not in kept:
            print(f"bench: --layout {layout}: no {names} variant reads layer {la.name} ({la.spec.short()}) in "
                  f"{layout.upper()}: left out", file=sys.stderr)
    if not kept:
        raise SuiteError(f"--layout {layout}: no {names} variant reads any layer of the suite in {layout.upper()} "
                         "(depthwise layers in every pass, and on sm_90 the tensor-core GEMMs, do)")
    return kept


def _budget_arg(text: str) -> float:
    """argparse ``type`` of ``--error-budget``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--error-budget ({text!r}) must be a number such as 2") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--error-budget ({text}) must be a finite number > 0")
    return value


def _backends(args: argparse.Namespace) -> list[Backend]:
    """The back-ends to run: one, or CUDA then OpenCL. OpenCL (pyopencl) is imported only when asked."""
    from convforge.backends import cuda_available, get_backend

    if args.compare_backends:
        return [get_backend("cuda"), get_backend("opencl")]
    name = args.backend or ("cuda" if cuda_available() else "opencl")
    return [get_backend(name)]


def _baseline_kind(args: argparse.Namespace, bes: list[Backend]) -> str:
    """--baseline, else cuDNN-best on CUDA, PyTorch where it is installed, NumPy (on the CPU) without it."""
    if args.baseline:
        return str(args.baseline)
    if bes[0].name == "cuda":
        return "cudnn"
    return "torch" if baselines.torch_available() else "numpy"


def precisions(choice: str | None) -> tuple[str, ...]:
    """The classes ``--precision`` names, in report order (None: ``config.precision``)."""
    choice = choice or config.precision
    if choice not in PRECISION_CHOICES:
        raise SuiteError(f"--precision ({choice!r}) must be one of {', '.join(PRECISION_CHOICES)}")
    return ("fp32", "relaxed") if choice == "both" else (choice,)


def _run_models(args: argparse.Namespace, console: Console) -> int:
    """``--model``: whole torchvision models in the ``--precision`` class(es), tuned with ``--tune``."""
    from convforge.apps.bench import models

    clash = [flag for flag, val in (("--suite", args.suite), ("--ablation", args.ablation),
                                    ("--compare-backends", args.compare_backends),
                                    ("--limit", args.limit is not None),
                                    ("--pass", getattr(args, "conv_pass", None))) if val]
    if clash:
        raise SuiteError(f"--model cannot be combined with {', '.join(clash)} (run them separately; "
                         "--train times the whole training step)" if "--pass" in clash else
                         f"--model cannot be combined with {', '.join(clash)} (run them separately)")
    opts: dict[str, object] = {}
    if getattr(args, "max_error", None) is not None:
        opts["max_error"] = args.max_error
    budget = getattr(args, "error_budget", None)
    if getattr(args, "devices", None) is not None and not getattr(args, "train", False):
        raise SuiteError("--devices goes with --train: it times data-parallel training (inference runs on one GPU)")
    if getattr(args, "amp", None) is not None and not getattr(args, "train", False):
        raise SuiteError("--amp goes with --train: it times a mixed-precision training step (inference in half "
                         "precision: --dtype fp16|bf16)")
    if getattr(args, "first_call", False):
        train = getattr(args, "train", False)
        if budget is not None or args.tune or getattr(args, "devices", None) is not None:
            raise SuiteError("--first-call times an untuned fused model's first forward (with --train --amp: its "
                             "first AMP step) on one GPU; it does not go with --tune, --error-budget or --devices")
        if train and getattr(args, "amp", None) is None:
            raise SuiteError("--first-call --train times the first mixed-precision step: add --amp fp16|bf16")
        from convforge.apps.bench import first_call

        return first_call.run(args.model, getattr(args, "dtype", None) or "float32", args.layout or "nchw",
                              args.out, console, train=args.amp if train else None)
    if getattr(args, "train", False):
        if budget is not None:
            raise SuiteError("--error-budget calibrates inference; it does not go with --train")
        amp = getattr(args, "amp", None) or {"float16": "fp16", "bfloat16": "bf16"}.get(getattr(args, "dtype", None)
                                                                                       or "float32")
        if amp is not None and getattr(args, "devices", None) is None:
            from convforge.apps.bench import training_amp

            return training_amp.run(args.model, amp, args.out, args.warmup, args.repeats, console, opts,
                                    tune=args.tune)
        if getattr(args, "devices", None) is not None:  # --amp / --dtype fp16|bf16: AMP rows (bench/ddp.py)
            from convforge.apps.bench import ddp

            half = {"fp16": "float16", "bf16": "bfloat16"}.get(amp or "")
            modes = ddp.modes_of(precisions(args.precision_classes), getattr(args, "dtype", None) or half)
            return ddp.launch(args.model, args.devices, console, args.warmup, args.repeats, args.out, tune=args.tune,
                              modes=modes)
        if (getattr(args, "dtype", None) or "float32") != "float32":
            raise SuiteError("--train times float32 training (PyTorch FP32/TF32); it does not go with --dtype")
        from convforge.apps.bench import training

        return training.run(args.model, args.out, args.warmup, args.repeats, console, opts,
                            classes=precisions(args.precision_classes), tune=args.tune)
    dtype = getattr(args, "dtype", None) or "float32"
    if dtype != "float32":
        if budget is not None:
            raise SuiteError("--error-budget calibrates float32 models; it does not go with --dtype")
        from convforge.apps.bench import half_models

        return half_models.run_specs(args.model, args.out, args.warmup, args.repeats, console, opts,
                                     precisions(args.precision_classes)[0], dtype, args.tune)
    extra = {} if budget is None else {"error_budget": budget}
    return models.run(args.model, args.out, args.warmup, args.repeats, console, opts,
                      classes=precisions(args.precision_classes), tune=args.tune, **extra)


def check_numbers(args: argparse.Namespace) -> None:
    """--repeats, --batch-slice (>= 1), --warmup (>= 0), --limit (>= 1) and the --out folder, before
    anything loads or runs: SuiteError naming the option."""
    from convforge.apps.options import check_out_dir

    for flag, value, least in (("--repeats", args.repeats, 1), ("--batch-slice", args.batch_slice, 1),
                               ("--warmup", args.warmup, 0), ("--limit", args.limit, 1)):
        if value is not None and value < least:
            raise SuiteError(f"{flag} ({value}) must be >= {least}")
    try:
        check_out_dir("--out", args.out)
    except ValueError as err:
        raise SuiteError(str(err)) from None


def _run(args: argparse.Namespace, console: Console) -> int:
    check_numbers(args)
    sweep.check_sweep_args(args)
    if args.sweep:
        return _run_sweep(args, console)
    if args.model:
        return _run_models(args, console)
    if args.tune:
        raise SuiteError("--tune goes with --model (to tune a suite: convforge tune --suite NAME)")
    if getattr(args, "first_call", False):
        raise SuiteError("--first-call goes with --model")
    if getattr(args, "train", False):
        raise SuiteError("--train goes with --model (for one pass of a suite's layers: --pass dgrad|wgrad|all)")
    if getattr(args, "error_budget", None) is not None:
        raise SuiteError("--error-budget goes with --model")
    if getattr(args, "devices", None) is not None:
        raise SuiteError("--devices goes with --model --train (to tune on several devices: convforge tune --devices)")
    if args.suite is None:
        if not args.ablation:
            raise SuiteError("--suite is required (a built-in name or a JSON file)")
        args.suite = "mec"
    if args.ablation:
        if getattr(args, "conv_pass", None) not in (None, "fprop"):
            raise SuiteError("--ablation times forward variants; it does not go with --pass")
        return _run_ablation(args, console)
    layers = layer_passes(_with_dtype(load_suite(args.suite, args.limit), getattr(args, "dtype", None)),
                          getattr(args, "conv_pass", None))
    bes = _backends(args)
    layers = _with_layout(layers, getattr(args, "layout", None), bes)
    kind = _baseline_kind(args, bes)
    env = runner.environment(bes, kind)
    report.print_header(console, env, args.suite, len(layers))
    notes = []
    why = baselines.unavailable(kind, bes[0].name)
    if why:
        notes.append(why)
        console.print(f"[yellow]baseline: {escape(why)}[/]")
    classes = precisions(args.precision_classes)
    tf32 = baselines.tf32_note(kind, classes)
    if tf32:
        notes.append(tf32)
        console.print(f"[yellow]baseline: {escape(tf32)}[/]")
    ceil = _ceilings(bes, args.quick_ceilings, console)
    report.print_ceilings(console, ceil)
    cfg = runner.BenchConfig(tuple(args.algo or ["auto"]), kind, args.warmup, args.repeats,
                             args.batch_slice, args.seed, classes)
    on_gpu = bes[0].device.is_gpu
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("layers", total=len(layers))

        def on_layer(i: int, layer: runner.Layer) -> None:
            bar.update(task, completed=i, description=f"layer {i + 1}/{len(layers)}: {layer.name}")

        rows = runner.run_suite(layers, bes, cfg, ceil, on_gpu, on_layer)
        bar.update(task, completed=len(layers))
    for prec in cfg.precisions:
        what = f"{args.suite} on {env['device']}"
        console.print(report.layer_table(rows, report.class_title(prec, rows, what), prec))
    if any(not r.impl.startswith("convforge") for r in rows):
        console.print(report.baseline_table(rows))
    if args.compare_backends:
        console.print(report.compare_table(rows))
    for line in report.summary_lines(rows):
        console.print(line, markup=False)
    failed = [r for r in rows if r.impl.startswith("convforge") and r.ok is False]
    if args.out:
        _write(Path(args.out), env, ceil, args.suite, rows, notes, console)
    if failed:
        console.print(f"[red]{len(failed)} convforge result(s) FAILED the check or did not run[/]")
    return 1 if failed else 0


def layer_passes(layers: list[Layer], choice: str | None) -> list[Layer]:
    """Each layer in the pass(es) ``--pass`` names, named "layer" (fprop) or "layer:dgrad" / "layer:wgrad"."""
    from convforge.apps.options import spec_passes

    return [Layer(layer.name if s.conv_pass == "fprop" else f"{layer.name}:{s.conv_pass}", s)
            for layer in layers for s in spec_passes(layer.spec, choice)]


def _run_sweep(args: argparse.Namespace, console: Console) -> int:
    """``--sweep``: the points of each ``--algo`` variant's space on every layer, in one precision class
    (relaxed when ``--precision`` names it, so families admit their relaxed variants)."""
    be = _backends(args)[0]
    suite = _with_dtype(load_suite(args.suite, args.limit), getattr(args, "dtype", None))
    layers = _with_layout(layer_passes(suite, getattr(args, "conv_pass", None)), getattr(args, "layout", None), [be])
    env = runner.environment([be], "none")
    report.print_header(console, env, args.suite, len(layers))
    prec = "relaxed" if "relaxed" in precisions(args.precision_classes) else "fp32"
    return sweep.run_sweep(args, layers, be, prec, console)


def _run_ablation(args: argparse.Namespace, console: Console) -> int:
    """``--ablation NAME``: every layer of the suite in each configuration, one row each."""
    layers = layer_passes(load_suite(args.suite, args.limit), getattr(args, "conv_pass", None))
    be = _backends(args)[0]
    kind = args.baseline or "none"
    env = runner.environment([be], kind)
    report.print_header(console, env, args.suite, len(layers))
    ceil = _ceilings([be], args.quick_ceilings, console)
    report.print_ceilings(console, ceil)
    cfg = runner.BenchConfig(("auto",), kind, args.warmup, args.repeats, args.batch_slice,
                             args.seed)
    rows = runner.run_ablation(args.ablation, layers, be, cfg, ceil)
    if kind != "none":
        for layer_rows in _by_layer(rows):
            spec = layers[layer_rows[0].index - 1].spec
            timing = Timing.for_layer(spec, be.device, cfg.warmup, cfg.repeats)
            results = baselines.run(kind, spec, timing, be.device.is_gpu)
            runner.attach_baseline(layer_rows, baselines.primary(results))
    console.print(report.layer_table(rows, f"{args.ablation} ablation, {args.suite} on "
                                           f"{env['device']}"))
    if args.out:
        _write(Path(args.out), env, ceil, args.suite, rows, [f"ablation {args.ablation}"],
               console)
    failed = [r for r in rows if r.ok is False]
    if failed:
        console.print(f"[red]{len(failed)} configuration(s) FAILED the check or did not run[/]")
    return 1 if failed else 0


def _ceilings(bes: list[Backend], quick: bool, console: Console) -> dict[str, ceilings.Ceilings]:
    """The measured ceilings of each back-end, with a progress line while they are measured."""
    from convforge.apps.options import phase_bars
    from convforge.progress import Phase

    out = {}
    with phase_bars(console), Phase("measuring the devices' ceilings (FFMA, copy bandwidth)", len(bes),
                                    "back-ends") as phase:
        for be in bes:
            out[be.name] = ceilings.measure(be, quick=quick)
            phase.advance()
    return out


def _by_layer(rows: list[runner.Row]) -> list[list[runner.Row]]:
    groups: dict[int, list[runner.Row]] = {}
    for r in rows:
        groups.setdefault(r.index, []).append(r)
    return list(groups.values())


def _write(out: Path, env: dict[str, object], ceil: dict[str, ceilings.Ceilings], suite: str,
           rows: list[runner.Row], notes: list[str], console: Console) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "results.json", env, ceil, suite, rows, notes)
    report.write_csv(out / "results.csv", env, rows)
    if not plots.available():
        console.print(f"wrote {out}/results.json, results.csv, no plots (pip install 'convforge[plot]')", markup=False)
        return
    pngs = plots.write_plots(out, rows, ceil)
    what = ", ".join([p.name for p in pngs] + plots.skipped(rows, ceil))
    console.print(f"wrote {out}/results.json, results.csv, {what}", markup=False, soft_wrap=True)


def main(args: argparse.Namespace) -> int:
    """Run ``convforge bench`` with parsed arguments; the exit status is 1 when a result failed."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # logs and pipes get the whole table, not an 80-column squeeze
    try:
        return _run(args, console)
    except SuiteError as err:  # one line on stderr, however long, as cli.main prints every other error
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="convforge bench")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
