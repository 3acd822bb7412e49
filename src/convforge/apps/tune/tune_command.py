"""``convforge tune`` and ``convforge db list|show|export|import|clear``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from convforge.config import MAX_ERROR_HELP, PRECISION_HELP, PRECISIONS, config, max_error_arg, precision_key
from convforge.spec import ConvSpec

IMPORT_ERROR: ImportError | None = None  # what running these commands needs and cannot import (cli says so)
try:  # not needed to list the options: `convforge tune -h` works without them
    import sqlite3

    from rich.markup import escape

    from convforge.dispatch import measure_dispatch
    from convforge.plan import Epilogue
    from convforge.tune.db import Entry, NoDatabase, TuningDB
    from convforge.tune.tuner import Budget, Candidate, TuneError, Tuner, TuneResult
except ImportError as _err:
    IMPORT_ERROR = _err

DEFAULT_BUDGET = "5s,16"  # per layer: Boda's 43 layers in well under 10 minutes on a GPU


def _console() -> Any:
    """A rich console; wide when writing to a file or pipe, so table rows stay on one line."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=180)


def _error(msg: str) -> None:
    """One plain ``error: ...`` line on stderr (the CLI's form for bad input)."""
    import sys

    print(f"error: {msg}", file=sys.stderr)


# -- convforge tune -----------------------------------------------------------------------
def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", metavar="NAME|FILE", help=f"a built-in suite ({_suite_names()}) or a JSON suite file")
    from convforge.apps.options import SPEC_HELP

    p.add_argument("--spec", action="append", default=[], metavar="SPEC", help=SPEC_HELP + " (repeatable)")
    p.add_argument("--limit", type=int, help="tune only the first LIMIT layers of --suite / --spec (>= 1)")
    p.add_argument("--budget", default=DEFAULT_BUDGET,
                   help="per layer: seconds ('30s'), candidates ('20') or both ('12s,24'); "
                        f"default {DEFAULT_BUDGET}")
    p.add_argument("--backend", choices=("cuda", "opencl"), help="default: cuda when present, else opencl")
    p.add_argument("--device", help="CUDA device index or OpenCL 'platform:device'")
    try:
        from convforge.apps.tune.parallel import DEVICES_HELP
    except ImportError:
        DEVICES_HELP = "tune on several devices at once, one worker process per device: 'all' or 0,1,..."
    p.add_argument("--devices", metavar="all|0,1,...", help=DEVICES_HELP)
    p.add_argument("--db", type=Path, help=f"tuning database (default {config.tuning_db})")
    p.add_argument("--bias", action="store_true", help="tune with a bias epilogue (fprop only)")
    p.add_argument("--relu", action="store_true", help="tune with a ReLU epilogue (fprop only)")
    from convforge.apps.options import add_pass_option

    add_pass_option(p, allow_all=True, extra=" (--suite / --spec)")
    p.add_argument("--force", action="store_true", help="re-tune layers the database already knows")
    from convforge.apps.options import add_seed_argument, int_arg

    add_seed_argument(p, "seed of the space sample and of the check inputs")
    p.add_argument("--precision", choices=tuple(PRECISIONS), help=PRECISION_HELP)
    p.add_argument("--max-error", type=max_error_arg, metavar="E", help=MAX_ERROR_HELP)
    p.add_argument("--workers", type=int, help="compile threads, >= 1 (default: CPU count, at most 16)")
    p.add_argument("--report", type=Path, metavar="DIR",
                   help="also write Boda's autotuned / heuristic / fixed-parameters comparison to DIR "
                        "(report.json, report.png)")
    p.add_argument("--report-sets", type=int_arg(1), default=3, metavar="N",
                   help="with --report: parameter sets per variant tried as the fixed setting (>= 1, default 3)")
    p.add_argument("--dispatch-overhead", action="store_true",
                   help="measure choose() per call on the first layer afterwards (µs)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every candidate's fate")
    p.add_argument("--net", help="tune every distinct conv of a network (a shipped name, .prototxt or .onnx); "
                   "not with --suite or --spec")
    p.add_argument("--batch", type=int, help="batch size of --net (default 1); only with --net: a --spec or "
                   "--suite layer carries its own N")
    from convforge.apps.options import add_dtype_argument

    add_dtype_argument(p)
    p.add_argument("--model", action="append", metavar="NAME[:BATCH]",
                   help="tune a torchvision model's convs as `bench --model` runs them (repeatable): converted "
                        "(and fused, where convforge.torch.fuse exists), each layer with its real epilogue, in "
                        "the --precision class (CUDA; --budget per layer)")


def _suite_names() -> str:
    """The built-in suites, from the registry (bench/suites.py)."""
    try:
        from convforge.apps.bench.suites import BUILTIN
    except ImportError:  # the bench package is not there: name none rather than a stale list
        return "see convforge bench -h"
    return ", ".join(BUILTIN)


def _layers(args: argparse.Namespace) -> list[tuple[str, ConvSpec]]:
    out: list[tuple[str, ConvSpec]] = []
    if args.suite:
        try:
            from convforge.apps.bench.suites import load_suite
        except ImportError as err:
            raise ValueError("suites need convforge.apps.bench.suites; pass layers with --spec") from err
        for item in load_suite(args.suite):
            pair: Any = item
            name, spec = (pair.name, pair.spec) if hasattr(pair, "spec") else pair
            out.append((str(name), spec))
    for i, text in enumerate(args.spec):
        out.append((f"spec{i + 1}", ConvSpec.parse(text)))
    if getattr(args, "dtype", None):
        from convforge.apps.options import with_dtype

        out = [(name, with_dtype(spec, args.dtype)) for name, spec in out]
    if args.limit is not None:
        out = out[: args.limit]
    if not out:
        raise ValueError("nothing to tune: give --suite NAME|FILE or --spec")
    return with_passes(out, getattr(args, "conv_pass", None))


def with_passes(layers: list[tuple[str, ConvSpec]], choice: str | None) -> list[tuple[str, ConvSpec]]:
    """Each layer in the pass(es) ``--pass`` names (``cli.spec_passes``), named "layer" for fprop
    and "layer:dgrad" / "layer:wgrad" for the others."""
    from convforge.apps.options import spec_passes

    return [(name if s.conv_pass == "fprop" else f"{name}:{s.conv_pass}", s)
            for name, spec in layers for s in spec_passes(spec, choice)]


def _backend(args: argparse.Namespace) -> Any:
    from convforge.backends import cuda_available, get_backend

    name = args.backend or ("cuda" if cuda_available() else "opencl")
    return get_backend(name, args.device)


# Options that apply to some modes only ("layers": --suite / --spec, "net": --net, "model": --model).
_MODES = {"--batch": ("net",), "--limit": ("layers",), "--bias": ("layers",), "--relu": ("layers",),
          "--pass": ("layers",),
          "--report": ("layers",), "--dispatch-overhead": ("layers",), "--workers": ("layers", "net")}
_MODE_FLAGS = {"layers": "--suite / --spec", "net": "--net", "model": "--model"}


def check_tune_args(args: argparse.Namespace) -> Budget:
    """Every number, the budget (answered, parsed), the report folder and the mix of options,
    before anything runs: ValueError naming the option; an option the chosen mode would ignore is
    refused."""
    from convforge.apps.options import check_out_dir

    for flag, value in (("--limit", args.limit), ("--workers", args.workers), ("--batch", args.batch)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} ({value}) must be >= 1")
    budget = Budget.parse(args.budget, "--budget")
    check_out_dir("--report", args.report)
    mode = "model" if getattr(args, "model", None) else "net" if getattr(args, "net", None) else "layers"
    if mode == "net" and (args.suite or args.spec):
        given = ", ".join(f for f, v in (("--suite", args.suite), ("--spec", args.spec)) if v)
        raise ValueError(f"--net cannot be combined with {given} (tune them separately)")
    for flag, modes in _MODES.items():
        value = getattr(args, "conv_pass" if flag == "--pass" else flag[2:].replace("-", "_"), None)
        if value not in (None, False) and mode not in modes:
            where = " or ".join(_MODE_FLAGS[m] for m in modes)
            raise ValueError(f"{flag} applies only with {where}, not with {_MODE_FLAGS[mode]}")
    return budget


def layer_epilogue(spec: ConvSpec, epi: Epilogue) -> Epilogue:
    """The epilogue a layer is tuned with: ``epi`` for fprop, none for the backward passes."""
    return epi if spec.conv_pass == "fprop" else Epilogue()


def tune_main(args: argparse.Namespace) -> int:
    """Tune a suite or layers into the database, with a progress bar and a closing table."""
    from convforge.apps.tune.parallel import how_from_args

    try:
        budget = check_tune_args(args)
        how = how_from_args(args)  # several devices, or this torchrun rank's share; None: one process
    except ValueError as err:
        _error(f"{err}")
        return 2
    console = _console()
    _setup_logging(args.verbose)
    if getattr(args, "model", None):
        return _tune_models(args, console, budget, how)
    if getattr(args, "net", None):
        from convforge.apps.tune.net import tune_net

        if str(args.net).endswith(".onnx"):
            from convforge.apps.options import need

            need("--net FILE.onnx", "onnx")
        # the back-end before the database: a missing back-end leaves nothing on disk
        backend = None if how else _backend(args)
        return tune_net(args, console, backend, TuningDB(args.db or config.tuning_db), budget, how)
    try:
        layers = _layers(args)
        if (args.bias or args.relu) and not any(s.conv_pass == "fprop" for _, s in layers):
            raise ValueError("--bias and --relu are fprop epilogues; dgrad and wgrad write a plain gradient")
    except ValueError as err:
        _error(f"{err}")
        return 2
    # the back-end before the database: a missing back-end leaves nothing on disk (workers make their own)
    backend = None if how is not None else _backend(args)
    try:
        db = TuningDB(args.db or config.tuning_db)
    except ValueError as err:
        _error(f"{err}")
        return 2
    epi = Epilogue(bias=args.bias, relu=args.relu)
    if how is not None:
        return _tune_parallel(args, console, budget, layers, epi, db, how)
    assert backend is not None
    console.print(f"device: {backend.device.name} ({backend.name}, {backend.device.driver}); "
                  f"database: {db.path}; budget: {budget}; precision: {precision_key()}", markup=False)
    results, failed = _run(console, layers, backend, db, budget, epi, args)
    console.print(_table(layers, results, failed, backend.name))
    fresh = sum(not r.from_db for r in results.values())
    console.print(f"{fresh} layer(s) tuned, {len(results) - fresh} from the database, "
                  f"{len(failed)} failed; {_tuner_timings(results)} candidate(s) timed")
    if args.report and results:
        from convforge.apps.tune.report import build_report, write_report
        from convforge.kernels import all_variants

        tuner = Tuner(backend, db, budget, args.seed, workers=args.workers)
        doc = build_report(tuner, layers, results, all_variants(), args.report_sets)
        files = write_report(args.report, doc)
        plot = "" if any(f.suffix == ".png" for f in files) else " (no report.png: pip install 'convforge[plot]')"
        console.print("report: " + ", ".join(str(f) for f in files) + plot, markup=False)
    if args.dispatch_overhead and results:
        from convforge.tune import clear_choices

        clear_choices()
        with _db_config(db.path):
            us = measure_dispatch(layers[0][1], backend, epilogue=layer_epilogue(layers[0][1], epi))
        console.print(f"dispatch overhead of choose() with a warm database: {us:.2f} µs per call")
    if db.write_errors:  # the results stand (printed above); the database stays as it was
        _error(f"could not store {len(db.write_errors)} result(s) in the tuning database {db.path}: "
               f"{db.write_errors[0]}; it keeps what it held before")
        return 1
    return 1 if failed else 0


def _tune_parallel(args: argparse.Namespace, console: Any, budget: Budget, layers: list[tuple[str, ConvSpec]],
                   epi: Epilogue, db: TuningDB, how: Any) -> int:
    """``--suite`` / ``--spec`` on several devices or torchrun ranks (tune/parallel.py): identical
    layers tuned once (the others then come from the database, as in one process), the same
    closing table."""
    from convforge.apps.tune import parallel
    from convforge.kernels import get_variant
    from convforge.params import Params

    groups: dict[tuple[ConvSpec, Epilogue], list[str]] = {}
    for name, spec in layers:
        groups.setdefault((spec, layer_epilogue(spec, epi)), []).append(name)
    tasks = [parallel.Task(i, names[0], float(spec.flops), {"kind": "layer", "spec": spec.to_dict(),
                                                            "epi": dataclasses.asdict(e)})
             for i, ((spec, e), names) in enumerate(groups.items())]
    backend = parallel.backend_name(args, how)
    console.print(f"{len(tasks)} distinct layer(s) on {how.describe()}; database: {db.path}; budget: {budget}; "
                  f"precision: {precision_key()}", markup=False)
    run = parallel.execute(tasks, parallel.base_settings(args, budget, backend, db.path, how), how, console)
    if run.outcomes is None:  # a torchrun rank other than 0: rank 0 prints the table
        return 1 if run.own_failed else 0
    results: dict[str, TuneResult] = {}
    failed: dict[str, str] = {}
    timed = 0
    for task, ((spec, e), names) in zip(tasks, groups.items(), strict=True):
        out = run.outcomes[task.id]
        if not out.ok:
            failed.update(dict.fromkeys(names, out.error))
            continue
        entry = Entry(**out.reply["entry"])
        timed += int(out.reply.get("timed", 0))
        for j, name in enumerate(names):
            results[name] = TuneResult(spec, e, entry, get_variant(entry.variant), Params.from_json(entry.params),
                                       bool(out.reply.get("from_db")) or j > 0)
    console.print(_table(layers, results, failed, backend))
    fresh = sum(not r.from_db for r in results.values())
    console.print(f"{fresh} layer(s) tuned, {len(results) - fresh} from the database, {len(failed)} failed; "
                  f"{timed} candidate(s) timed", markup=False)
    return 1 if failed else 0


def _tune_models(args: argparse.Namespace, console: Any, budget: Budget, how: Any = None) -> int:
    """``tune --model``: alone (no --suite, --spec or --net), into ``--db`` when given."""
    clash = [flag for flag, val in (("--suite", args.suite), ("--spec", args.spec), ("--net", args.net)) if val]
    if clash:
        _error(f"--model cannot be combined with {', '.join(clash)} (tune them separately)")
        return 2
    if args.backend == "opencl":
        _error("--model runs the torchvision model on CUDA (convforge.torch); --backend opencl does not apply")
        return 2
    if args.force:
        _error("--model tunes only layers the database does not know (no --force): clear their entries "
               "first (convforge db clear)")
        return 2
    from convforge.apps.bench.models import tune_models
    from convforge.tune import clear_choices

    if args.db is not None:
        config.db_path = args.db
        clear_choices()
    dtype = getattr(args, "dtype", None) or "float32"
    extra = {} if dtype == "float32" else {"dtype": dtype}
    if how is not None:
        return tune_models(args.model, console, budget, how=how, args=args, **extra)
    return tune_models(args.model, console, budget, **extra)


def _setup_logging(verbose: bool) -> None:
    """Candidates' fates on the console with ``-v``; warnings (wrong results, rebuilt database) always."""
    logger = logging.getLogger("convforge.tune")
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    if not logger.handlers:
        from rich.logging import RichHandler

        logger.addHandler(RichHandler(show_path=False, show_time=False))


def _tuner_timings(results: dict[str, TuneResult]) -> int:
    return sum(1 for r in results.values() for c in r.candidates if c.status == "ok")


def _run(console: Any, layers: list[tuple[str, ConvSpec]], backend: Any, db: TuningDB, budget: Budget,
         epi: Epilogue, args: argparse.Namespace) -> tuple[dict[str, TuneResult], dict[str, str]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: dict[str, TuneResult] = {}
    failed: dict[str, str] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        total = bar.add_task("layers", total=len(layers))
        cands = bar.add_task("candidates", total=budget.candidates)

        def tick(c: Candidate) -> None:
            bar.update(cands, advance=1, description=f"  {c.describe()[:60]}")

        tuner = Tuner(backend, db, budget, args.seed, workers=args.workers, on_candidate=tick)
        for name, spec in layers:
            bar.reset(cands, total=budget.candidates, description=f"  {name}")
            try:
                results[name] = tuner.tune(spec, layer_epilogue(spec, epi), force=args.force)
            except TuneError as err:
                failed[name] = str(err)
                console.print(f"{name}: {err}", style="red", markup=False)
            bar.advance(total)
    return results, failed


def _table(layers: list[tuple[str, ConvSpec]], results: dict[str, TuneResult], failed: dict[str, str],
           backend: str) -> Any:
    from rich.table import Table

    table = Table(title=f"tuned on {backend}")
    numeric = ("ms", "GFLOPS", "rel err", "heur. ms", "speed-up")
    for col in ("layer", "variant", "parameters", *numeric[:3], "heuristic", *numeric[3:], "from"):
        table.add_column(col, justify="right" if col in numeric else "left")
    for name, spec in layers:
        if name in failed:
            table.add_row(escape(name), "[red]failed[/red]", "", "", "", "", "", "", "", "")
            continue
        e = results[name].entry
        prm = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in json.loads(e.params).items())
        sp = e.speedup
        heur_ms = "" if e.heuristic_ms is None else f"{e.heuristic_ms:.4f}"
        table.add_row(escape(name), escape(e.variant), escape(prm), f"{e.time_ms:.4f}",
                      f"{spec.flops / e.time_ms / 1e6:.1f}", f"{e.error:.1e}", escape(e.heuristic_variant), heur_ms,
                      "" if sp is None else f"{sp:.2f}×", "db" if results[name].from_db else "tuned")
    return table


class _db_config:
    """Point ``config`` at a database for the duration of a block."""

    def __init__(self, path: Path) -> None:
        self.path, self.old = path, config.db_path

    def __enter__(self) -> None:
        config.db_path = self.path

    def __exit__(self, *exc: object) -> None:
        config.db_path = self.old


# -- convforge db -------------------------------------------------------------------------
def add_db_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", type=Path, help=f"tuning database (default {config.tuning_db})")
    sub = p.add_subparsers(dest="db_command", metavar="{list,show,export,import,merge,clear}")
    sub.required = True
    ls = sub.add_parser("list", help="one line per tuned layer")
    show = sub.add_parser("show", help="every field of the entries matching a layer or key fields")
    from convforge.apps.options import add_pass_option

    backends = ("cuda", "opencl")
    for q in (ls, show):
        q.add_argument("--spec", help="only this layer (ConvSpec text)")
        q.add_argument("--backend", choices=backends, help="only this back-end")
        q.add_argument("--variant", help="only this variant")
        add_pass_option(q, allow_all=False, default="every pass")
    exp = sub.add_parser("export", help="write the entries as JSON (to share between machines)")
    exp.add_argument("file", type=Path, help="output JSON file ('-' for stdout); an existing file only with --force")
    exp.add_argument("--backend", choices=backends, help="only this back-end")
    exp.add_argument("--force", action="store_true", help="replace FILE when it exists (never the database itself)")
    imp = sub.add_parser("import", help="merge entries from an exported JSON file")
    imp.add_argument("file", type=Path)
    imp.add_argument("--replace", action="store_true", help="overwrite entries even when they are faster")
    imp.add_argument("--dry-run", action="store_true", help="check the entries and say what would be stored")
    mrg = sub.add_parser("merge", help="merge tuning databases or exports into one: per layer and device, the "
                         "fastest entry that validates (docs/DATABASE.md)")
    mrg.add_argument("inputs", nargs="+", type=Path, metavar="A", help="a tuning database or a JSON export")
    mrg.add_argument("--into", type=Path, required=True, metavar="C",
                     help="the database written (new or existing: its entries take part; one transaction)")
    clr = sub.add_parser("clear", help="delete entries (all without filters)")
    clr.add_argument("--backend", choices=backends, help="only this back-end")
    clr.add_argument("--spec", help="only this layer (ConvSpec text)")


def _match(args: argparse.Namespace) -> dict[str, str]:
    out = {}
    if getattr(args, "backend", None):
        out["backend"] = args.backend
    if getattr(args, "variant", None):
        from convforge.kernels import get_variant

        out["variant"] = get_variant(args.variant).name  # an unknown name is an error, not "0 entries"
    if getattr(args, "spec", None):
        out["spec"] = ConvSpec.parse(args.spec).key()
    return out


def db_main(args: argparse.Namespace) -> int:
    """The database sub-commands: list, show and export open the database read-only."""
    console = _console()
    if args.db_command == "merge":
        return _merge(console, args)
    try:
        match = _match(args)
        path = Path(args.db or config.tuning_db)
        if args.db_command == "clear":
            _check_clear(path)
        if args.db_command == "import":  # read (and refuse) the input before the database is touched
            from convforge.tune.validate import load_document

            try:
                doc = load_document(args.file)
            except (OSError, ValueError) as err:
                raise ValueError(f"cannot import {args.file}: {err}") from None
            args.document = {"format": "convforge-tuning", "entries": doc}
        writes = args.db_command in ("import", "clear") and not getattr(args, "dry_run", False)
        db = TuningDB(path, readonly=not writes)
    except ValueError as err:
        _error(f"{err}")
        return 2
    try:
        return _db_command(console, db, args, match)
    except sqlite3.Error as err:  # a file damaged or locked under us, a full disk: one line, no traceback
        _error(f"tuning database {db.path}: {err}")
        return 2


def _db_command(console: Any, db: TuningDB, args: argparse.Namespace, match: dict[str, str]) -> int:
    cmd = args.db_command
    if cmd == "list":
        console.print(_list_table(_of_pass(db.entries(**match), args), db.path))
        _print_not_carried(console, db)
    elif cmd == "show":
        for e in _of_pass(db.entries(**match), args):
            console.print_json(json.dumps(_entry_doc(e)))
    elif cmd == "export":
        filters: dict[str, Any] = match
        if str(args.file) == "-":
            print(json.dumps(db.export_json(None, **filters), indent=1))
        else:
            doc = db.export_json(args.file, force=args.force, **filters)
            console.print(f"exported {len(doc['entries'])} entries to {args.file}", markup=False)
    elif cmd == "import":
        return _import(console, db, args)
    elif cmd == "clear":
        console.print(f"deleted {db.clear(**match)} entries from {db.path}", markup=False)
    return 0


def _check_clear(path: Path) -> None:
    """``db clear`` where there is no database: said as ``db list`` says it, and nothing created."""
    if path.exists() or path.is_symlink():
        return
    if not path.parent.is_dir():
        raise NoDatabase(f"no tuning database at {path}: folder {path.parent} does not exist (nothing to clear)")
    raise NoDatabase(f"no tuning database at {path} (nothing to clear)")


def _import(console: Any, db: TuningDB, args: argparse.Namespace) -> int:
    """Validate every entry, store the good ones (unless --dry-run) in one transaction, list the
    rejects with reasons; a progress bar on a terminal for big files."""
    doc = getattr(args, "document", None) or args.file
    total = len(doc["entries"]) if isinstance(doc, dict) and isinstance(doc.get("entries"), list) else 0
    try:
        with _progress(console, total, "checking entries") as tick:
            rep = db.import_json(doc, only_if_faster=not args.replace, dry_run=args.dry_run, on_progress=tick)
    except (OSError, ValueError) as err:
        _error(f"cannot import {args.file}: {err}")
        return 2
    verb = "would store" if args.dry_run else "imported"
    _print_report(console, rep, verb)
    console.print(f"{verb} {len(rep.stored)} entries into {db.path}; {len(rep.kept)} kept (an existing entry "
                  f"is faster), {len(rep.rejected)} rejected", soft_wrap=True, markup=False)
    return 1 if rep.rejected else 0


SHOWN = 20  # entries listed one per line after an import or merge; the rest are counted


def _print_report(console: Any, rep: Any, verb: str) -> None:
    for e in rep.stored[:SHOWN]:
        console.print(f"  {verb}: {e.backend} {e.spec} {e.epilogue} {e.precision} {e.variant}", soft_wrap=True,
                      markup=False)
    if len(rep.stored) > SHOWN:
        console.print(f"  ... and {len(rep.stored) - SHOWN} more", markup=False)
    for label, why in rep.rejected[:SHOWN * 5]:
        console.print(f"  [red]rejected[/red] {escape(label)}: {escape(why)}", soft_wrap=True)
    if len(rep.rejected) > SHOWN * 5:
        console.print(f"  ... and {len(rep.rejected) - SHOWN * 5} more rejected", markup=False)


class _progress:
    """A rich progress bar over ``total`` items on a terminal when there are many (the callback
    it yields takes (done, total)); None otherwise."""

    def __init__(self, console: Any, total: int, what: str) -> None:
        self.console, self.total, self.what = console, total, what
        self.bar: Any = None

    def __enter__(self) -> Any:
        if self.total < 2000 or not self.console.is_terminal:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = self.bar = Progress(TextColumn(self.what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  console=self.console, transient=True)
        bar.start()
        task = bar.add_task(self.what, total=self.total)
        return lambda done, total: bar.update(task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _merge(console: Any, args: argparse.Namespace) -> int:
    """``db merge A B ... --into C``: every input read (and refused) before C is opened; then per
    key (device, back-end, layer, dtype, epilogue, precision) the fastest entry that validates is
    stored in C in one transaction, where C holds no faster one."""
    if args.db is not None:
        _error("--db does not apply to db merge: name the database written with --into")
        return 2
    items: list[tuple[str, Any]] = []
    try:
        for src in dict.fromkeys(args.inputs):
            items += _merge_input(Path(src))
        with _progress(console, len(items), "checking entries") as tick:
            db = TuningDB(args.into)
            rep = db.merge([e for _, e in items], only_if_faster=True, on_progress=tick, label=lambda i: items[i][0])
    except sqlite3.Error as err:
        _error(f"tuning database {args.into}: {err}")
        return 2
    except (OSError, ValueError) as err:
        _error(f"{err}")
        return 2
    _print_report(console, rep, "stored")
    console.print(f"merged {len(items)} entries of {len(args.inputs)} input(s) into {db.path}: {len(rep.stored)} "
                  f"stored, {len(rep.kept)} kept (one as fast or faster is there), {len(rep.rejected)} rejected",
                  soft_wrap=True, markup=False)
    return 1 if rep.rejected else 0


def _merge_input(src: Path) -> list[tuple[str, Any]]:
    """(label, entry object) of each entry of a tuning database or a JSON export at ``src``; a
    ValueError naming ``src`` when it is neither, is missing, corrupt or unreadable."""
    from convforge.tune.dbfile import identify
    from convforge.tune.validate import load_document

    kind = identify(src)
    if kind.kind == "missing":
        raise NoDatabase(f"cannot merge {src}: no such file")
    if kind.kind in ("ours", "empty"):
        db = TuningDB(src, readonly=True)
        try:
            entries = db.entries()
        finally:
            db.close()
        return [(f"{src}: {e.backend} {e.spec} {e.variant} on {e.device}", dataclasses.asdict(e)) for e in entries]
    if "text file" not in kind.what:
        raise ValueError(f"cannot merge {src}: it is {kind.what.replace(', not a SQLite database', '')}; db merge "
                         "reads convforge tuning databases and JSON exports")
    try:
        entries = load_document(src)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot merge {src}: {err}") from None
    return [(f"{src}: entry {i + 1}", e) for i, e in enumerate(entries)]


def _print_not_carried(console: Any, db: TuningDB) -> None:
    """Entries an upgrade could not carry over (this opening's in-memory upgrade, or the file's log)."""
    lines = db.not_carried or [f"{entry}: {reason} (upgrade of {date[:19]})"
                               for date, entry, reason in db.not_carried_log()]
    if lines:
        console.print(f"{len(lines)} entries of an older schema were not carried over:")
        for line in lines:
            console.print(f"  {line}", soft_wrap=True, markup=False)


def entry_pass(e: Entry) -> str:
    """The pass an entry was tuned for (its spec_json's; fprop for entries that name none)."""
    try:
        doc = json.loads(e.spec_json)
    except json.JSONDecodeError:
        doc = {}
    return str(doc.get("pass", "fprop")) if isinstance(doc, dict) else "fprop"


def _of_pass(entries: list[Entry], args: argparse.Namespace) -> list[Entry]:
    """The entries of ``--pass`` (all of them without it)."""
    want = getattr(args, "conv_pass", None)
    return entries if want is None else [e for e in entries if entry_pass(e) == want]


def _entry_doc(e: Entry) -> dict[str, Any]:
    from dataclasses import asdict

    doc = asdict(e)
    doc["pass"] = entry_pass(e)
    doc["params"] = json.loads(e.params)
    doc["heuristic_params"] = json.loads(e.heuristic_params)
    doc["spec_json"] = json.loads(e.spec_json)
    return doc


def _list_table(entries: list[Entry], path: Path) -> Any:
    from rich.table import Table

    table = Table(title=escape(f"{path}: {len(entries)} entries"))
    for col in ("device", "back-end", "layer", "pass", "epilogue", "precision", "variant", "parameters", "ms",
                "error", "speed-up", "date"):
        table.add_column(col)
    for e in entries:
        prm = " ".join(f"{k}={v}" for k, v in json.loads(e.params).items())
        sp = e.speedup
        cells = (e.device.split("|")[1] if "|" in e.device else e.device, e.backend, e.spec, entry_pass(e), e.epilogue,
                 e.precision, e.variant, prm, f"{e.time_ms:.4f}", f"{e.error:.1e}",
                 "" if sp is None else f"{sp:.2f}×", e.date[:19])
        table.add_row(*(escape(c) for c in cells))
    return table


__all__ = ["add_tune_arguments", "tune_main", "add_db_arguments", "db_main"]
