"""``convforge bench --model NAME[:BATCH] --train --devices N``: data-parallel training throughput.

One training step (bench/training.py ``step_fn``: forward + cross-entropy + backward + SGD, training
mode) of a torchvision model, BATCH images per GPU, timed on ONE GPU without any wrapper (the
baseline) and on N GPUs in ``DistributedDataParallel`` (NCCL), one process per GPU started by
``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node K -m convforge.bench.ddp
--rank-run ...``; the parent here launches K = 1 then K = N and reads rank 0's JSON). Rows per
implementation: ``pytorch_fp32`` (cudnn.benchmark on, TF32 off), ``convforge``
(``convforge.torch.convert``) and ``convforge_fused`` (``convforge.torch.fuse``, training mode).
Each rank draws its own random batch (seed ``SEED + rank``); the weights are ``models.build``'s.

Time: CUDA events around each step after warm-up, each rank's median; a DDP step's time is the
slowest rank's (DDP's all-reduce keeps the ranks in step anyway). On N GPUs the same processes
also time the step under ``no_sync()`` (no all-reduce: ``nosync_ms``), so ``comm_ms`` = step -
no-sync step is what the gradients' all-reduce adds that the backward pass did not hide, measured
without the run-to-run spread between separate launches (several ms on H100s, round 25); the rest
of a shortfall against one GPU is in the processes themselves (host, clocks, the other rank's
kernels). ``images/s`` = K x BATCH / step
time; ``scaling`` = images/s on N GPUs over images/s on one; ``efficiency`` = scaling / N (the
issue's target on two H200s: scaling >= 1.8 for ResNet-50 at 32 images per GPU). ``--tune`` turns
``config.autotune`` on for the warm-up steps (the one-GPU run goes first, so the N-GPU run finds
its layers tuned; every pass, forward and backward, is tuned on first sight).

The machines this is run on need ``NCCL_NVLS_ENABLE=0`` (set here for the launched ranks when unset).
"""

from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from convforge.bench import models, training

IMPLS = ("pytorch_fp32", "convforge", "convforge_fused")
FIELDS = ("model", "batch", "impl", "gpus", "step_ms", "nosync_ms", "comm_ms", "images_per_s", "images_per_s_per_gpu",
          "scaling", "efficiency", "status")
NOTE = ("one training step (forward + cross-entropy + backward + SGD), BATCH images per GPU, training mode; one GPU: "
        "the plain model; N GPUs: DistributedDataParallel (NCCL), one process per GPU (torchrun); CUDA events, each "
        "rank's median step, the slowest rank's; no-sync: the same N-GPU step without the all-reduce (no_sync()), "
        "comm = step - no-sync; scaling = images/s on N GPUs over one GPU's; PyTorch: cudnn.benchmark on, TF32 off")


def parse_impls(text: str | None) -> tuple[str, ...]:
    if not text:
        return IMPLS
    out = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in out if t not in IMPLS]
    if bad or not out:
        raise ValueError(f"--impl ({text!r}) must name some of {', '.join(IMPLS)}")
    return out


def gpu_count(devices: int | str | None) -> int:
    """How many GPUs ``--devices`` asks for ('all' or None: every visible one); ValueError when
    they are not there."""
    import torch

    have = torch.cuda.device_count()
    if devices in (None, "all"):
        n = have
    else:
        try:
            n = int(str(devices))
        except ValueError:
            raise ValueError(f"--devices ({devices!r}) must be a number of GPUs or 'all'") from None
    if n < 1 or n > have:
        raise ValueError(f"--devices ({devices}) must be between 1 and the {have} CUDA device(s) torch sees")
    return n


def launch(specs: list[str], devices: int | str | None, console: Console, warmup: int | None = None,
           repeats: int | None = None, out: str | None = None, impls: tuple[str, ...] = IMPLS,
           tune: bool = False) -> int:
    """The parent: each model on one GPU, then on N through torchrun; the table (and files in ``out``)."""
    parsed = models._check_models(specs, console)
    if parsed is None:
        return 2
    try:
        n = gpu_count(devices)
    except ValueError as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="convforge-ddp-") as tmp:
        for name, batch in parsed:
            for k in sorted({1, n}):
                path = Path(tmp) / f"{name}-{batch}-{k}.json"
                rc = _torchrun(k, name, batch, impls, warmup, repeats, tune, path)
                if rc != 0 or not path.exists():
                    rows += [dict(model=name, batch=batch, impl=i, gpus=k, status=f"failed: torchrun exit {rc}")
                             for i in impls]
                    continue
                rows += json.loads(path.read_text())["rows"]
    scale(rows)
    console.print(table(rows, f"data-parallel training, {n} GPU(s) against one"))
    console.print(NOTE)
    if out:
        write(Path(out), rows)
        console.print(f"wrote {out}/ddp.json, ddp.csv")
    return 1 if any(not str(r.get("status", "")).startswith("ok") for r in rows) else 0


def _torchrun(k: int, name: str, batch: int, impls: tuple[str, ...], warmup: int | None, repeats: int | None,
              tune: bool, path: Path) -> int:
    import convforge

    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    root = str(Path(convforge.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={k}", "-m",
           "convforge.bench.ddp", "--rank-run", "--model", f"{name}:{batch}", "--impl", ",".join(impls),
           "--json", str(path)]
    cmd += [] if warmup is None else ["--warmup", str(warmup)]
    cmd += [] if repeats is None else ["--repeats", str(repeats)]
    cmd += ["--tune"] if tune else []
    return subprocess.run(cmd, env=env).returncode


def scale(rows: list[dict[str, Any]]) -> None:
    """``scaling`` and ``efficiency`` of each row against the one-GPU row of its model and impl;
    ``comm_ms`` where the row has a no-sync time."""
    one = {(r["model"], r["batch"], r["impl"]): r for r in rows if r.get("gpus") == 1 and r.get("images_per_s")}
    for r in rows:
        base = one.get((r["model"], r["batch"], r["impl"]))
        if base is not None and r.get("images_per_s"):
            r["scaling"] = r["images_per_s"] / base["images_per_s"]
            r["efficiency"] = r["scaling"] / r["gpus"]
        if r.get("step_ms") and r.get("nosync_ms"):
            r["comm_ms"] = r["step_ms"] - r["nosync_ms"]


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("model", "batch/GPU", "impl", "GPUs", "step ms", "no-sync ms", "comm ms", "images/s", "per GPU",
                "scaling", "efficiency", "status"):
        t.add_column(col)
    f = models._f
    for r in rows:
        t.add_row(r["model"], str(r["batch"]), r["impl"], str(r["gpus"]), f(r.get("step_ms"), ".2f"),
                  f(r.get("nosync_ms"), ".2f"), f(r.get("comm_ms"), ".2f"), f(r.get("images_per_s"), ".0f"),
                  f(r.get("images_per_s_per_gpu"), ".0f"), f(r.get("scaling"), ".2f"), f(r.get("efficiency"), ".2f"),
                  r.get("status", ""))
    return t


def write(folder: Path, rows: list[dict[str, Any]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    env = models.environment()
    (folder / "ddp.json").write_text(json.dumps({"env": env, "note": NOTE, "rows": rows}, indent=1))
    with open(folder / "ddp.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# -- one rank (under torchrun) ------------------------------------------------------------------------
def _make(impl: str, model: Any) -> Any:
    import convforge.torch as ct

    m = copy.deepcopy(model)
    if impl == "convforge":
        ct.convert(m)
        return m
    if impl == "convforge_fused":
        return ct.fuse(m)[0]
    return m


def rank_run(name: str, batch: int, impls: tuple[str, ...], warmup: int, repeats: int, tune: bool,
             path: Path) -> None:
    """This rank's steps of every implementation; rank 0 writes the rows to ``path``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    if world > 1:
        dist.init_process_group("nccl")
    model = models.build(name)
    if isinstance(model, str):
        raise RuntimeError(model)
    size = models.MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(training.SEED + rank)
    x = torch.randn(batch, 3, size, size, device="cuda", generator=gen)
    target = torch.randint(0, training.CLASSES, (batch,), device="cuda", generator=gen)
    rows = []
    for impl in impls:
        row: dict[str, Any] = dict(model=name, batch=batch, impl=impl, gpus=world, status="ok")
        try:
            training._flags(False)
            m = _make(impl, model)
            net = DDP(m, device_ids=[local]) if world > 1 else m
            with models.tuning(tune and impl.startswith("convforge")):
                step = training.step_fn(net, x, target)
                for _ in range(max(warmup, 1)):
                    step()
                torch.cuda.synchronize()
            mine = training._time(step, 0, repeats)
            quiet = float("nan")
            if world > 1:  # the same step without the all-reduce, in the same processes
                with net.no_sync():
                    step()
                    quiet = training._time(step, 0, repeats)
            del net, m, step
        except Exception as err:  # noqa: BLE001 - a failing row must not hide the others
            mine = quiet = float("nan")
            row["status"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        every, quiet_all = [mine], [quiet]
        if world > 1:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (mine, quiet))
            every, quiet_all = [float(v[0]) for v in gathered], [float(v[1]) for v in gathered]
        if row["status"] == "ok" and all(v == v for v in every):
            row["step_ms"] = max(every)
            row["rank_step_ms"] = every
            if all(v == v for v in quiet_all):
                row["nosync_ms"] = max(quiet_all)
            row["images_per_s"] = world * batch / (row["step_ms"] / 1e3)
            row["images_per_s_per_gpu"] = batch / (row["step_ms"] / 1e3)
        elif row["status"] == "ok":
            row["status"] = "failed on another rank"
        rows.append(row)
        torch.cuda.empty_cache()
    if rank == 0:
        path.write_text(json.dumps({"env": models.environment(), "rows": rows}))
    if world > 1:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m convforge.bench.ddp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, metavar="NAME[:BATCH]")
    p.add_argument("--devices", help="GPUs of the data-parallel run (default: all)")
    p.add_argument("--impl", help=f"comma-separated, some of {', '.join(IMPLS)} (default: all)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 3)")
    p.add_argument("--repeats", type=int, help="timed steps (default 10)")
    p.add_argument("--tune", action="store_true", help="tune convforge's layers on the warm-up steps")
    p.add_argument("--out", help="write ddp.json and ddp.csv here")
    p.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        impls = parse_impls(args.impl)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.rank_run:
        name, batch = models.parse_model(args.model[0])
        rank_run(name, batch, impls, 3 if args.warmup is None else args.warmup, args.repeats or 10, args.tune,
                 args.json)
        return 0
    return launch(args.model, args.devices, Console(), args.warmup, args.repeats, args.out, impls, args.tune)


__all__ = ["IMPLS", "launch", "main", "parse_impls", "rank_run", "scale"]

if __name__ == "__main__":
    sys.exit(main())
