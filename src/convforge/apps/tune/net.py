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
    from convforge.graph.runtime import conv_spec, epilogue_of

    g = optimize(graph)
    shapes = infer(g)
    seen: dict[tuple[ConvSpec, Epilogue], str] = {}
    for node in g.nodes:
        if node.op in ("conv", "fc"):
            spec = conv_spec(node, shapes[node.inputs[0]], dtype)
            epi = epilogue_of(node)
            seen.setdefault((spec, epi), node.name)
    return [(name, spec, epi) for (spec, epi), name in seen.items()]


def tune_net(args: argparse.Namespace, console: Any, backend: Any, db: Any, budget: Any, how: Any = None) -> int:
    """Tune the network's distinct convs into ``db`` with a progress bar; 1 if any failed. ``how``
    (tune/parallel.py): on several devices, or this torchrun rank's share (``backend`` is then None)."""
    from convforge.graph.build import load_model

    if args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch ({args.batch}) must be >= 1")
    graph = load_model(args.net)
    batch = graph.input_shape[0] if args.batch is None else args.batch  # default: the description's
    graph = graph.with_batch(batch)
    dtype = getattr(args, "dtype", None) or "float32"
    layers = net_layers(graph, dtype)
    console.print(f"{graph.name} at batch {batch}, {dtype}: {len(layers)} distinct conv/fc layer(s)", markup=False)
    if how is not None:
        return _tune_parallel(args, console, db, budget, how, layers)
    failed = _tune_here(args, console, backend, db, budget, layers)
    console.print(f"{len(layers) - failed} layer(s) tuned or known, {failed} failed")
    return 1 if failed else 0


def _tune_here(args: argparse.Namespace, console: Any, backend: Any, db: Any, budget: Any,
               layers: list[tuple[str, ConvSpec, Epilogue]]) -> int:
    """One process: the layers in order; the number that failed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from convforge.tune.tuner import TuneError, Tuner

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
    return failed


def _tune_parallel(args: argparse.Namespace, console: Any, db: Any, budget: Any, how: Any,
                   layers: list[tuple[str, ConvSpec, Epilogue]]) -> int:
    """The layers on several devices or torchrun ranks (tune/parallel.py); the exit status (on a
    torchrun rank other than 0: 1 if one of its own layers failed)."""
    from dataclasses import asdict

    from convforge.apps.tune import parallel

    tasks = [parallel.Task(i, name, float(spec.flops), {"kind": "layer", "spec": spec.to_dict(), "epi": asdict(epi)})
             for i, (name, spec, epi) in enumerate(layers)]
    backend = parallel.backend_name(args, how)
    console.print(f"on {how.describe()}; database: {db.path}; budget: {budget}", markup=False)
    run = parallel.execute(tasks, parallel.base_settings(args, budget, backend, db.path, how), how, console)
    if run.outcomes is None:
        return 1 if run.own_failed else 0
    for t in tasks:
        out = run.outcomes[t.id]
        chosen = f"{out.reply['entry']['variant']} {'(database)' if out.reply.get('from_db') else ''}" if out.ok else (
            out.error)
        console.print(f"{t.name}: {chosen}", style=None if out.ok else "red", markup=False)
    failed = sum(not o.ok for o in run.outcomes.values())
    console.print(f"{len(layers) - failed} layer(s) tuned or known, {failed} failed")
    return 1 if failed else 0
