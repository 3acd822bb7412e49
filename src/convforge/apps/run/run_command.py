"""``convforge run --net NAME|FILE --batch N``: run a whole network and report where the time goes."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convforge.config import PRECISIONS, config
from convforge.files import write_atomic

IMPORT_ERROR: ImportError | None = None  # what running a network needs and cannot import (cli says so)
try:  # not needed to list the options: `convforge run -h` works without it
    import numpy as np
except ImportError as _err:
    IMPORT_ERROR = _err

if TYPE_CHECKING:
    from convforge.graph.runtime import Network

REPEATS = {True: 10, False: 3}  # --repeats by default: on a GPU, on a CPU device (PoCL: a forward takes seconds)
PROFILE_MIN = {True: 3, False: 1}  # the fewest timed runs of each step alone
TORCH_MATH = {"fp32": "PyTorch FP32 (cudnn.benchmark, TF32 off)",
              "relaxed": "PyTorch TF32 (cudnn.benchmark, TF32 on for cuDNN and matmul)",
              "float16": "PyTorch FP16 (.half() weights and input, cudnn.benchmark)",
              "bfloat16": "PyTorch BF16 (.bfloat16() weights and input, cudnn.benchmark)"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--net", required=True,
                   help="alexnet, nin, googlenet, vgg16, resnet50, or a .prototxt / .onnx file")
    p.add_argument("--batch", type=int, help="batch size (default: the description's, 1 for the shipped nets "
                   "and an ONNX model's symbolic batch)")
    p.add_argument("--backend", choices=("cuda", "opencl"), help="default: cuda when present, else opencl")
    p.add_argument("--tune", action="store_true", help="tune the network's convs into the database first")
    p.add_argument("--input-size", type=int, metavar="H", help="square input size (default: the model's)")
    p.add_argument("--weights", type=Path, help="a .caffemodel for a prototxt net (default: random, --seed)")
    from convforge.apps.options import add_dtype_argument, add_seed_argument, int_arg

    add_seed_argument(p, "seed of the random weights and input")
    p.add_argument("--repeats", type=int_arg(1), metavar="N",
                   help=f"timed runs of the whole network, medians reported; each step alone N // 2 times (at "
                        f"least {PROFILE_MIN[True]} on GPUs, {PROFILE_MIN[False]} on CPU devices); default "
                        f"{REPEATS[True]} on GPUs, {REPEATS[False]} on CPU devices")
    p.add_argument("--workspace-limit", type=float, metavar="MIB",
                   help="the most workspace one conv may use, filter transforms included (MiB; the layers "
                        "share one scratch arena of the largest need)")
    p.add_argument("--precision", choices=tuple(PRECISIONS),
                   help="precision class of the network's convs: 'fp32' (error <= 5e-6, compared with PyTorch "
                        "FP32, TF32 off) or 'relaxed' (<= 1e-3, compared with PyTorch TF32); default fp32, or "
                        "CONVFORGE_PRECISION")
    p.add_argument("--error-budget", type=float, default=2.0, metavar="R",
                   help="calibrate at build: keep the logits' error within R x PyTorch FP32's (TF32's in the relaxed "
                        "class; on OpenCL, without torch or with --no-torch: a plain float32 evaluation's; for an "
                        ".onnx net the smaller of that and onnxruntime's where it is installed), "
                        "tightening the layers that need it, measured on a separate random input (seed + 2); "
                        "default 2, 0 = no calibration")
    add_dtype_argument(p)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison (CUDA runs)")
    p.add_argument("--no-numpy", action="store_true",
                   help="skip the NumPy comparison (runs on other back-ends than CUDA: the network in plain "
                        "float32 NumPy, each conv as BLAS GEMMs, timed on the CPU)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference check")
    p.add_argument("--out", type=Path, metavar="DIR", help="also write the run (summary, layers) as JSON here")


def main(args: argparse.Namespace) -> int:
    """Build, check and time the network; with --backend opencl nothing here touches CUDA (the
    PyTorch baseline, CUDA only, is then reported as not run: run it with --backend cuda)."""
    from rich.console import Console

    from convforge.api import default_backend
    from convforge.apps.options import check_out_dir, phase_bars
    from convforge.backends import get_backend
    from convforge.dtypes import rounded
    from convforge.graph.build import check_budget, load_model
    from convforge.graph.passes import optimize
    from convforge.graph.runtime import Network

    console = Console()
    prec = config.precision  # cli.main set it from --precision
    dtype = getattr(args, "dtype", None) or "float32"
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"batch ({args.batch}) must be >= 1")
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats ({args.repeats}) must be >= 1")
    if args.workspace_limit is not None and not 0 <= args.workspace_limit < float("inf"):  # NaN fails too
        raise ValueError(f"--workspace-limit ({args.workspace_limit}) must be a finite number >= 0 (MiB)")
    budget = check_budget(args.error_budget, "--error-budget")
    check_out_dir("--out", args.out)
    if str(args.net).endswith(".onnx"):
        from convforge.apps.options import need

        need("--net FILE.onnx", "onnx")
    graph = load_model(args.net, args.input_size, args.seed, args.weights)
    if args.batch is None:  # the description's batch, said when it is not 1
        args.batch = graph.input_shape[0]
        if args.batch != 1:
            console.print(f"{graph.name}: batch {args.batch} (declared by the description; --batch N to change it)",
                          markup=False)
    graph = graph.with_batch(args.batch)
    last = graph.producer(graph.outputs[0])
    if last is not None and last.op == "softmax":  # softmax flattens errors: also check the logits
        graph.outputs = graph.outputs + [last.inputs[0]]
    backend = get_backend(args.backend or default_backend())
    gpu = backend.device.is_gpu
    repeats = args.repeats or REPEATS[gpu]
    if args.tune:
        _tune(args, console, backend)
    limit = None if args.workspace_limit is None else int(args.workspace_limit * 2**20)
    with phase_bars(console):
        t0 = time.perf_counter()
        net = Network(optimize(graph), backend, capture=False, workspace_limit=limit, dtype=dtype)
        console.print(f"{graph.name}: {len(graph.nodes)} nodes -> {len(net.steps)} steps after the passes, "
                      f"built in {time.perf_counter() - t0:.1f} s on {backend.device.name} ({backend.name}; "
                      f"{net.compiled_ahead} program(s) compiled, the others found in the caches)", markup=False)
        if budget is not None and dtype != "float32":
            console.print(f"calibration: not run for {dtype} storage (the budget is relative to FP32's error; "
                          "half storage rounds far above it)", markup=False)
            budget = None
        cal = None if budget is None else _calibrate(
            console, net, budget, args.seed, limit, "float32" if args.no_torch else "auto",
            args.net if str(args.net).endswith(".onnx") else None)
        if cal is not None:
            net = cal.network
        net.capture()
        # the input in the network's dtype: the reference and PyTorch see the same values
        x = rounded(np.random.default_rng(args.seed).standard_normal(net.shapes[graph.input].shape).astype(
            np.float32), dtype)
        out = net(x)
        prof, total = _time(net, repeats, gpu)
        res = _result(args, net, backend, prof, total, prec, dtype, budget, cal)
        _report(console, net, prof, total, args.batch, res)
        ref = None if args.no_check else _check(console, graph, x, out, res)
        _baselines(args, console, graph, x, net, total, repeats, ref, res)
    if res.get("logits_error") is not None:
        console.print(errors_line(res), markup=False, highlight=False, soft_wrap=True)
    for line in (SUMMARY_HEADER, summary_line(res)):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if args.out is not None:
        _write(args.out, res)
    return 0


def _time(net: Network, repeats: int, gpu: bool) -> tuple[list[tuple[Any, float]], float]:
    """Each step alone (``repeats // 2`` times, at least PROFILE_MIN), then the whole network
    (``repeats`` times). A CPU device skips the warm-up runs: the network has just run every step
    (its compiles are done), and each run there takes seconds."""
    from convforge.progress import Phase

    with Phase("timing each step alone", len(net.steps), "steps") as phase:
        prof = net.profile(max(PROFILE_MIN[gpu], repeats // 2), warmup=gpu, on_step=phase.advance)
    with Phase(f"timing the whole network ({repeats} runs)"):
        total = net.time_ms(repeats, warmup=gpu)
    return prof, total


def _result(args: argparse.Namespace, net: Network, backend: Any, prof: list[tuple[Any, float]], total: float,
            prec: str, dtype: str, budget: float | None, cal: Any) -> dict[str, Any]:
    """The run as a dict (``--out``'s JSON, the summary line's source)."""
    res: dict[str, Any] = {
        "net": Path(str(args.net)).stem, "batch": args.batch, "backend": backend.name, "device": backend.device.name,
        "mode": _mode(net), "ours_ms": total, "images_per_s": args.batch / total * 1e3,
        "peak_mib": net.peak_bytes / 2**20, "tuned": bool(args.tune), "precision": prec, "dtype": dtype,
        "peak_parts_mib": {"activations": net.memory.bytes / 2**20, "weights": net.weight_bytes / 2**20,
                           "transformed_filters": net.transformed_bytes / 2**20,
                           "workspaces": net.workspace_bytes / 2**20, "arena": net.arena_bytes / 2**20},
        "layers": [{"layer": st.node, "op": st.op, "variant": st.variant, "ms": ms} for st, ms in prof],
        "error_budget": budget}
    if cal is not None:
        res.update(tightened=[c.path for c in cal.report.tightened], budget_met=cal.report.met,
                   calibration_s=cal.seconds, calibration=cal.report.as_dict())
    return res


def _mode(net: Network) -> str:
    return "CUDA graph replay" if net.captured else "launches enqueued in order"


def _report(console: Any, net: Network, prof: list[tuple[Any, float]], total: float, batch: int,
            res: dict[str, Any]) -> None:
    console.print(_table(prof, net.graph.name, batch, res["precision"]))
    console.print(f"total ({_mode(net)}): {total:.3f} ms; {batch / total * 1e3:.1f} images/s; "
                  f"peak memory {net.peak_bytes / 2**20:.1f} MiB (activations {net.memory.bytes / 2**20:.1f}, "
                  f"weights {net.weight_bytes / 2**20:.1f}, transformed filters {net.transformed_bytes / 2**20:.1f}, "
                  f"workspaces {net.workspace_bytes / 2**20:.1f}, of which the shared arena "
                  f"{net.arena_bytes / 2**20:.1f})")


def _baselines(args: argparse.Namespace, console: Any, graph: Any, x: np.ndarray, net: Network, total: float,
               repeats: int, ref: dict[str, np.ndarray] | None, res: dict[str, Any]) -> None:
    """PyTorch on CUDA runs; elsewhere NumPy (plain float32, BLAS GEMMs) on the CPU, and PyTorch
    reported as not run (with the command that runs it where a CUDA device is visible)."""
    if args.no_torch:
        res["torch"] = "skipped (--no-torch)"
    elif net.backend.name == "cuda":
        _torch(console, graph, x, total, net.peak_bytes, repeats, ref, res)
    else:
        from convforge.backends import cuda_available

        res["torch"] = f"not run: this run is {net.backend.name}; the PyTorch baseline runs on CUDA"
        res["torch"] += (f" (convforge run --net {args.net} --batch {args.batch} --backend cuda)" if cuda_available()
                         else ", and there is no CUDA device here")
        console.print(f"PyTorch: {res['torch']}", soft_wrap=True, markup=False)
    if net.backend.name != "cuda":
        if getattr(args, "no_numpy", False):
            res["numpy"] = "skipped (--no-numpy)"
        else:
            _numpy(console, graph, x, total, min(repeats, 3), ref, res)


def _numpy(console: Any, graph: Any, x: np.ndarray, total: float, repeats: int,
           ref: dict[str, np.ndarray] | None, res: dict[str, Any]) -> None:
    """The network in plain float32 NumPy (``run_reference(..., float32)``: each conv and fully
    connected layer as BLAS GEMMs), timed by wall clock on the CPU (median of ``repeats`` runs;
    NumPy compiles nothing, so the first counts): what a NumPy user gets on this machine, beside
    convforge's time."""
    from convforge.apps.bench.numpy_conv import blas_name
    from convforge.graph.reference import run_reference
    from convforge.progress import Phase
    from convforge.reference import rel_l2

    logits = graph.outputs[-1]
    xs = x.astype(np.float32)
    times = []
    with Phase(f"timing NumPy's float32 run of the network ({repeats} runs)"):
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = run_reference(graph, xs, dtype=np.float32)
            times.append((time.perf_counter() - t0) * 1e3)
    ms = float(np.median(times))
    blas = blas_name()
    res.update(numpy=f"NumPy {np.__version__} float32{', ' + blas if blas else ''} (CPU, wall clock)",
               numpy_ms=ms)
    faster = f"convforge {ms / total:.2f}x faster" if total < ms else f"NumPy {total / ms:.2f}x faster"
    line = f"{res['numpy']}: {ms:.3f} ms ({faster})"
    if ref is not None:
        k = len(ref[logits])
        res["numpy_logits_error"] = rel_l2(out[logits][:k], ref[logits])
        line += f"; relative error vs the float64 reference ({_images(k)}, {logits}): {res['numpy_logits_error']:.2e}"
    console.print(line, markup=False, highlight=False, soft_wrap=True)


SUMMARY_HEADER = ("| net | batch | backend | class | ours ms | PyTorch eager ms | PyTorch graph ms | vs eager | "
                  "vs graph | peak MiB | PyTorch peak MiB | logits error | PyTorch logits error |")


def summary_line(res: dict[str, Any]) -> str:
    """One line for docs/BENCHMARKS.md: net, batch, backend, our time, PyTorch's times and our
    speed-ups, peak memory of both, the logits' error of both (n/a where not measured)."""
    def num(key: str, fmt: str) -> str:
        val = res.get(key)
        return "n/a" if val is None else format(val, fmt)

    ours = res["ours_ms"]
    eager, graph = res.get("torch_eager_ms"), res.get("torch_graph_ms")
    sp_e = "n/a" if eager is None else f"{eager / ours:.2f}x"
    sp_g = "n/a" if graph is None else f"{graph / ours:.2f}x"
    cls = res.get("precision", "fp32") + ("" if res.get("dtype", "float32") == "float32" else f" {res['dtype']}")
    return (f"| {res['net']} | {res['batch']} | {res['backend']} | {cls} | {ours:.3f} | "
            f"{num('torch_eager_ms', '.3f')} | "
            f"{num('torch_graph_ms', '.3f')} | {sp_e} | {sp_g} | {res['peak_mib']:.1f} | "
            f"{num('torch_peak_mib', '.1f')} | {num('logits_error', '.1e')} | {num('torch_logits_error', '.1e')} |")


def errors_line(res: dict[str, Any]) -> str:
    """convforge's logits error beside PyTorch's of the same precision class, and their ratio."""
    prec = res.get("precision", "fp32")
    ours: float = res["logits_error"]
    theirs: float | None = res.get("torch_logits_error")
    dtype = res.get("dtype", "float32")
    what = "PyTorch TF32" if prec == "relaxed" else "PyTorch FP32"
    cls = f"{prec} class"
    if dtype != "float32":
        cls, what = f"{prec} class, {dtype}", f"PyTorch {'FP16' if dtype == 'float16' else 'BF16'}"
    line = f"logits error vs float64 ({cls}): convforge {ours:.2e} | {what} "
    if theirs is None:
        return line + "n/a (not run)"
    if not (math.isfinite(ours) and math.isfinite(theirs)):  # say why, not "ratio nan"
        why = (" (float16 holds magnitudes up to 65504: these weights' activations leave its range; bf16 keeps "
               "float32's range)" if dtype == "float16" else "")
        return line + f"{theirs:.2e} | ratio n/a: the logits are not finite{why}"
    ratio = f"{ours / theirs:.2f}" if theirs else "n/a"
    return line + f"{theirs:.2e} | ratio {ratio}"


def _write(out: Path, res: dict[str, Any]) -> None:
    """The run as JSON in ``out`` (created): run-NET-nBATCH-BACKEND.json (…-relaxed.json in the
    relaxed class, so both classes' runs can share a folder)."""
    import json
    import re

    out.mkdir(parents=True, exist_ok=True)
    cls = ("-relaxed" if res.get("precision") == "relaxed" else "") + (
        "" if res.get("dtype", "float32") == "float32" else f"-{res['dtype']}")
    name = re.sub(r"[^\w.-]", "_", f"run-{res['net']}-n{res['batch']}-{res['backend']}{cls}.json")
    write_atomic(out / name, json.dumps({**res, "summary": summary_line(res)}, indent=1) + "\n")


def _calibrate(console: Any, net: Any, budget: float, seed: int, limit: int | None, reference: str,
               onnx_model: Any = None) -> Any:
    """Calibrate ``net`` (built without bounds) to ``budget`` and print what moved and its cost."""
    from convforge.graph.network_calibration import calibrate_network
    from convforge.progress import Phase

    with Phase(f"calibrating to an error budget of {budget:g}x"):
        cal = calibrate_network(net.graph, net.backend, budget=budget, seed=seed, workspace_limit=limit, fast=net,
                                reference=reference, onnx_model=onnx_model)
    rep = cal.report
    console.print(str(rep), markup=False, highlight=False, soft_wrap=True)
    moved = ", ".join(c.path for c in rep.tightened) or "none"
    console.print(f"calibration (budget {budget:g}x): tightened {len(rep.tightened)} layer(s): {moved}; "
                  f"{rep.forwards} forward(s) of the network, {cal.seconds:.1f} s (of which the float64 and "
                  f"reference runs {cal.reference_seconds:.1f} s)", markup=False, highlight=False,
                  soft_wrap=True)
    return cal


def _tune(args: argparse.Namespace, console: Any, backend: Any) -> None:
    from convforge.apps.tune.net import tune_net
    from convforge.apps.tune.tune_command import DEFAULT_BUDGET
    from convforge.dispatch import clear_choices, clear_executables
    from convforge.tune import clear_choices as clear_tune_choices
    from convforge.tune.db import TuningDB
    from convforge.tune.tuner import Budget

    ns = argparse.Namespace(net=args.net, batch=args.batch, seed=args.seed, workers=None, force=False,
                            dtype=getattr(args, "dtype", None))
    tune_net(ns, console, backend, TuningDB(config.tuning_db), Budget.parse(DEFAULT_BUDGET))
    clear_choices()
    clear_executables()
    clear_tune_choices()


def gflops(value: float) -> str:
    """GFLOP/s with three significant figures (0.412, 12.3, 1234), never a bare 0 or 1."""
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def _table(prof: list[tuple[Any, float]], name: str, batch: int, prec: str = "fp32") -> Any:
    from rich.markup import escape
    from rich.table import Table

    total = sum(ms for _, ms in prof) or 1.0
    table = Table(title=escape(f"{name}, batch {batch}, {prec} class: per step (each timed alone)"))
    for col in ("layer", "op", "variant", "ms", "share", "GFLOP/s"):
        table.add_column(col, justify="right" if col in ("ms", "share", "GFLOP/s") else "left")
    for step, ms in prof:
        gf = gflops(step.flops / ms / 1e6) if step.flops and ms > 0 else ""
        table.add_row(escape(step.node), step.op, escape(step.variant), f"{ms:.3f}", f"{100 * ms / total:.1f}%", gf)
    table.add_row("sum", "", "", f"{total:.3f}", "100%", "")
    return table


def _check(console: Any, graph: Any, x: np.ndarray, out: dict[str, np.ndarray],
           res: dict[str, Any]) -> dict[str, np.ndarray]:
    """Relative L2 error of the first ``CAL_IMAGES`` (4) images against the float64 reference:
    calibration's estimator, on the input calibration never saw (one image's ratio to PyTorch's
    moves by 2x between inputs). Returns the reference's outputs. The logits are the last output
    (main adds them after a softmax)."""
    from convforge.graph.network_calibration import CAL_IMAGES
    from convforge.graph.reference import run_reference
    from convforge.progress import Phase
    from convforge.reference import rel_l2

    k = min(CAL_IMAGES, len(x))
    with Phase(f"checking against the float64 reference ({_images(k)})"):
        ref = run_reference(graph.with_batch(k), x[:k])
    errs = {t: rel_l2(out[t][:k], ref[t]) for t in graph.outputs}
    res["errors"] = errs
    res["logits_error"] = errs[graph.outputs[-1]]
    res["error_images"] = k
    console.print(f"relative error vs the float64 reference ({_images(k)}): "
                  + ", ".join(f"{t} {e:.2e}" for t, e in errs.items()), markup=False)
    return ref


def _images(k: int) -> str:
    return "image 0" if k == 1 else f"images 0-{k - 1}"


def _torch(console: Any, graph: Any, x: np.ndarray, total: float, peak: int, repeats: int,
           ref: dict[str, np.ndarray] | None, res: dict[str, Any]) -> None:
    """PyTorch FP32 on the same graph and weights (CUDA); its output is the logits."""
    from convforge.apps.run import torch_baseline
    from convforge.graph import torch_reference

    why = torch_reference.available()
    if why:
        hint = "; pip install 'convforge[torch]', or --no-torch" if "not installed" in why else ""
        res["torch"] = f"skipped ({why}{hint})"
        console.print(f"PyTorch: {res['torch']}", markup=False)
        return
    logits = graph.outputs[-1]
    tg = graph.copy()
    tg.outputs = [logits]
    prec = res.get("precision", "fp32")
    dtype = res.get("dtype", "float32")
    label = TORCH_MATH[prec if dtype == "float32" else dtype]
    t = torch_baseline.run_torch(tg, x, repeats, tf32=prec == "relaxed", dtype=dtype)
    res.update(torch=label, torch_eager_ms=t.eager_ms,
               torch_graph_ms=t.graph_ms, torch_peak_mib=t.peak_bytes / 2**20)
    console.print(f"{label}: eager {t.eager_ms:.3f} ms ({t.eager_ms / total:.2f}x ours), "
                  f"CUDA graph {t.graph_ms:.3f} ms ({t.graph_ms / total:.2f}x ours), "
                  f"max_memory_allocated {t.peak_bytes / 2**20:.1f} MiB (ours {peak / 2**20:.1f} MiB)")
    if ref is not None:
        from convforge.reference import rel_l2

        k = len(ref[logits])
        res["torch_logits_error"] = rel_l2(t.output[:k], ref[logits])
        kind = {"float16": "FP16", "bfloat16": "BF16"}.get(dtype, "TF32" if prec == "relaxed" else "FP32")
        console.print(f"PyTorch ({kind}) relative error vs the float64 "
                      f"reference ({_images(k)}, {logits}): {res['torch_logits_error']:.2e}", markup=False)
