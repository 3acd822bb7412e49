"""``convforge tune --net NAME|FILE --batch N``: tune every distinct conv of a network once."""

from __future__ import annotations

import argparse
from typing import Any

from convforge.graph.ir import Graph, infer
from convforge.plan import Epilogue
from convforge.spec import ConvSpec


def net_layers(graph: Graph, dtype: str = "float32") -> list[tuple[str, ConvSpec, Epilogue]]:
    """The (name, spec, epilogue) of every conv and fc the runtime dispatches, after the passes,
    deduplicated (the first node of each distinct shape and epilogue names it), stored as ``dtype``."""
    from convforge.graph.passes import optimize
    from convforge.graph.runtime import conv_spec

    g = optimize(graph)
    shapes = infer(g)
    seen: dict[tuple[ConvSpec, Epilogue], str] = {}
    for node in g.nodes:
        if node.op in ("conv", "fc"):
            spec = conv_spec(node, shapes[node.inputs[0]], dtype)
            epi = Epilogue(bias="bias" in node.weights, relu=bool(node.attrs.get("relu")))
            seen.setdefault((spec, epi), node.name)
    return [(name, spec, epi) for (spec, epi), name in seen.items()]


def tune_net(args: argparse.Namespace, console: Any, backend: Any, db: Any, budget: Any) -> int:
    """Tune the network's distinct convs into ``db`` with a progress bar; 1 if any failed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from convforge.graph.runtime import load_model
    from convforge.tune.tuner import TuneError, Tuner

    batch = 1 if args.batch is None else args.batch
    if batch < 1:
        raise ValueError(f"--batch ({batch}) must be >= 1")
    graph = load_model(args.net).with_batch(batch)
    dtype = getattr(args, "dtype", None) or "float32"
    layers = net_layers(graph, dtype)
    console.print(f"{graph.name} at batch {batch}, {dtype}: {len(layers)} distinct conv/fc layer(s)", markup=False)
    failed = 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("layers", total=len(layers))
        tuner = Tuner(backend, db, budget, args.seed, workers=args.workers)
        for name, spec, epi in layers:
            bar.update(task, description=f"{name} {spec.short()}{epi.tag()}")
            try:
                res = tuner.tune(spec, epi, force=args.force)
                bar.console.print(f"{name}: {res.choice[0].name} {'(database)' if res.from_db else ''}",
                                  markup=False)
            except TuneError as err:
                failed += 1
                bar.console.print(f"{name}: {err}", style="red", markup=False)
            bar.advance(task)
    console.print(f"{len(layers) - failed} layer(s) tuned or known, {failed} failed")
    return 1 if failed else 0
