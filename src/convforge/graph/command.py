"""``convforge run --net NAME|FILE --batch N``: run a whole network and report where the time goes."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--net", required=True,
                   help="alexnet, nin, googlenet, vgg16, resnet50, or a .prototxt / .onnx file")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--backend", choices=("cuda", "opencl"), help="default: cuda when present, else opencl")
    p.add_argument("--tune", action="store_true", help="tune the network's convs into the database first")
    p.add_argument("--input-size", type=int, metavar="H", help="square input size (default: the model's)")
    p.add_argument("--weights", type=Path, help="a .caffemodel for a prototxt net (default: random, --seed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and input")
    p.add_argument("--repeats", type=int, default=10, help="timed runs (medians are reported)")
    p.add_argument("--workspace-limit", type=float, metavar="MIB",
                   help="the most scratch workspace one conv may use (MiB; the layers share one arena)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference check")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from convforge.api import default_backend
    from convforge.backends import get_backend
    from convforge.graph.passes import optimize
    from convforge.graph.runtime import Network, load_model

    console = Console()
    if args.batch < 1:
        raise ValueError(f"batch ({args.batch}) must be >= 1")
    graph = load_model(args.net, args.input_size, args.seed, args.weights).with_batch(args.batch)
    last = graph.producer(graph.outputs[0])
    if last is not None and last.op == "softmax":  # softmax flattens errors: also check the logits
        graph.outputs = graph.outputs + [last.inputs[0]]
    backend = get_backend(args.backend or default_backend())
    if args.tune:
        _tune(args, console, backend)
    t0 = time.perf_counter()
    limit = None if args.workspace_limit is None else int(args.workspace_limit * 2**20)
    if limit is not None and limit < 0:
        raise ValueError(f"--workspace-limit ({args.workspace_limit}) must be >= 0 MiB")
    net = Network(optimize(graph), backend, workspace_limit=limit)
    console.print(f"{graph.name}: {len(graph.nodes)} nodes -> {len(net.steps)} steps after the passes, "
                  f"built in {time.perf_counter() - t0:.1f} s on {backend.device.name} ({backend.name})")
    x = np.random.default_rng(args.seed).standard_normal(net.shapes[graph.input].shape).astype(np.float32)
    out = net(x)
    prof = net.profile(max(3, args.repeats // 2))
    total = net.time_ms(args.repeats)
    console.print(_table(prof, graph.name, args.batch))
    mode = "CUDA graph replay" if net.captured else "launches enqueued in order"
    console.print(f"total ({mode}): {total:.3f} ms; {args.batch / total * 1e3:.1f} images/s; "
                  f"peak memory {net.peak_bytes / 2**20:.1f} MiB (activations {net.memory.bytes / 2**20:.1f}, "
                  f"weights {net.weight_bytes / 2**20:.1f}, transformed filters {net.transformed_bytes / 2**20:.1f}, "
                  f"workspaces {net.workspace_bytes / 2**20:.1f}, of which the shared arena "
                  f"{net.arena_bytes / 2**20:.1f})")
    if not args.no_check:
        _check(console, graph, x, out)
    if not args.no_torch and backend.name == "cuda":
        _torch(console, graph, x, total, net.peak_bytes, args.repeats)
    return 0


def _tune(args: argparse.Namespace, console: Any, backend: Any) -> None:
    from convforge.config import config
    from convforge.dispatch import clear_choices, clear_executables
    from convforge.graph.tune import tune_net
    from convforge.tune import clear_choices as clear_tune_choices
    from convforge.tune.command import DEFAULT_BUDGET
    from convforge.tune.db import TuningDB
    from convforge.tune.tuner import Budget

    ns = argparse.Namespace(net=args.net, batch=args.batch, seed=args.seed, workers=None, force=False)
    tune_net(ns, console, backend, TuningDB(config.tuning_db), Budget.parse(DEFAULT_BUDGET))
    clear_choices()
    clear_executables()
    clear_tune_choices()


def _table(prof: list[tuple[Any, float]], name: str, batch: int) -> Any:
    from rich.table import Table

    total = sum(ms for _, ms in prof) or 1.0
    table = Table(title=f"{name}, batch {batch}: per step (each timed alone)")
    for col in ("layer", "op", "variant", "ms", "share", "GFLOP/s"):
        table.add_column(col, justify="right" if col in ("ms", "share", "GFLOP/s") else "left")
    for step, ms in prof:
        gf = f"{step.flops / ms / 1e6:.0f}" if step.flops else ""
        table.add_row(step.node, step.op, step.variant, f"{ms:.3f}", f"{100 * ms / total:.1f}%", gf)
    table.add_row("sum", "", "", f"{total:.3f}", "100%", "")
    return table


def _check(console: Any, graph: Any, x: np.ndarray, out: dict[str, np.ndarray]) -> None:
    """Relative L2 error of image 0 against the float64 reference (run at batch 1)."""
    from convforge.graph.reference import run_reference
    from convforge.reference import rel_l2

    ref = run_reference(graph.with_batch(1), x[:1])
    errs = ", ".join(f"{t} {rel_l2(out[t][:1], ref[t]):.2e}" for t in graph.outputs)
    console.print(f"relative error vs the float64 reference (image 0): {errs}")


def _torch(console: Any, graph: Any, x: np.ndarray, total: float, peak: int, repeats: int) -> None:
    from convforge.graph import torch_baseline

    why = torch_baseline.available()
    if why:
        console.print(f"PyTorch: skipped ({why})")
        return
    t = torch_baseline.run_torch(graph, x, repeats)
    console.print(f"PyTorch FP32: eager {t.eager_ms:.3f} ms ({t.eager_ms / total:.2f}x ours), "
                  f"CUDA graph {t.graph_ms:.3f} ms ({t.graph_ms / total:.2f}x ours), "
                  f"max_memory_allocated {t.peak_bytes / 2**20:.1f} MiB (ours {peak / 2**20:.1f} MiB)")
    from convforge.graph.reference import run_reference
    from convforge.reference import rel_l2

    ref = run_reference(graph.with_batch(1), x[:1])[graph.outputs[0]]
    console.print(f"PyTorch relative error vs the float64 reference (image 0, {graph.outputs[0]}): "
                  f"{rel_l2(t.output[:1], ref):.2e}")
