"""``convforge bench --model NAME[:BATCH] --train --devices N``: data-parallel training throughput.

One training step (forward + cross-entropy + backward + SGD, training mode) of a torchvision model,
BATCH images per GPU, timed on ONE GPU without any wrapper (the baseline) and on N GPUs in
``DistributedDataParallel`` (NCCL), one process per GPU started by ``torchrun`` (``python -m
torch.distributed.run --standalone --nproc-per-node K -m convforge.apps.bench.ddp --rank-run ...``; the
parent launches K = 1, then each N asked (``--devices 2,4``), every model and mode in one launch,
and reads rank 0's JSON). Rows per implementation: ``pytorch`` (cudnn.benchmark on), ``convforge``
(``convforge.torch.convert``) and ``convforge_fused`` (``convforge.torch.fuse``, training mode);
per mode: ``fp32`` (PyTorch FP32, TF32 off; convforge's fp32 class), ``relaxed`` (PyTorch TF32;
convforge's relaxed class), ``fp16`` / ``bf16`` (AMP: autocast and a GradScaler on every side;
PyTorch's model and input in channels_last, its fastest form, the baseline of the half rows). Each
rank draws its own random batch (seed ``SEED + rank``); the weights are ``models.build``'s.

Time: CUDA events around each step after warm-up, each rank's median; a DDP step's time is the
slowest rank's (DDP's all-reduce keeps the ranks in step anyway). On N GPUs the same processes also
time the step under ``no_sync()`` (no all-reduce: ``nosync_ms``), so ``comm_ms`` = step - no-sync
step is what the gradients' all-reduce adds that the backward pass did not hide (``comm %`` of the
step), measured without the run-to-run spread between separate launches; and, before wrapping it,
the plain module's step on each rank alone (``alone_ms``): no-sync - alone is what DDP costs besides
the all-reduce (its per-gradient work, the buffers' broadcast at each forward, the ranks waiting for
each other), alone against the one-GPU launch's step what the processes themselves cost (host,
clocks, the spread between launches). ``tail_ms``: DDP's own measure, from
its runtime logging (CUDA events) over a few more steps: from the end of the backward's compute to
the end of its all-reduce, the part no compute hid. ``images/s`` = K x BATCH / step time;
``scaling`` = images/s on N GPUs over images/s on one; ``efficiency`` = scaling / N; ``vs
PyTorch`` = images/s over the PyTorch row's of the same mode and GPUs. ``--tune`` turns
``config.autotune`` on for the warm-up steps (the one-GPU run goes first, so the N-GPU runs find
their layers tuned).

``--profile``: two more synchronised steps of each row on N GPUs under ``torch.profiler`` (CUDA
kernels), each rank's trace read back: ``allreduce_ms`` (NCCL all-reduce kernels' time a step),
``overlap`` (the share of it during which a compute kernel of the same GPU ran), ``overlap_ours_ms``
(the time it ran beside convforge's kernels: dgrad, wgrad, batch norm...; names from the executables
and batch-norm programs the rank built), ``exposed_ms`` (all-reduce with no compute beside it). With
``--out`` the rank 0 traces are kept (``traces/``, chrome://tracing or Perfetto).

The machines this is run on need ``NCCL_NVLS_ENABLE=0`` (set here for the launched ranks when unset,
with ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from convforge.apps.bench import models, training
from convforge.files import csv_text, write_atomic

IMPLS = ("pytorch", "convforge", "convforge_fused")
MODES = ("fp32", "relaxed", "fp16", "bf16")
BASELINES = {"fp32": "pytorch_fp32", "relaxed": "pytorch_tf32", "fp16": "pytorch_fp16_amp_cl",
             "bf16": "pytorch_bf16_amp_cl"}
LABELS = {"fp32": "fp32", "relaxed": "relaxed", "fp16": "AMP fp16", "bf16": "AMP bf16"}
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FIELDS = ("model", "batch", "precision", "impl", "gpus", "step_ms", "nosync_ms", "alone_ms", "comm_ms", "comm_pct",
          "tail_ms", "allreduce_ms", "overlap", "overlap_ours_ms", "exposed_ms", "images_per_s", "images_per_s_per_gpu",
          "scaling", "efficiency", "vs_pytorch", "status")
NOTE = ("one training step (forward + cross-entropy + backward + SGD), BATCH images per GPU, training mode; one GPU: "
        "the plain model; N GPUs: DistributedDataParallel (NCCL), one process per GPU (torchrun); CUDA events, each "
        "rank's median step, the slowest rank's; no-sync: the same N-GPU step without the all-reduce (no_sync()), "
        "comm = step - no-sync; alone: the plain module on each rank without DDP, same processes; tail: DDP's "
        "runtime logging, all-reduce after the backward's compute ended; "
        "scaling = images/s on N GPUs over one GPU's; vs PyTorch: images/s over the PyTorch row of the same mode; "
        "fp32: PyTorch FP32 (TF32 off), relaxed: PyTorch TF32, AMP: autocast + GradScaler everywhere, PyTorch in "
        "channels_last; cudnn.benchmark on")


def parse_impls(text: str | None) -> tuple[str, ...]:
    if not text:
        return IMPLS
    out = tuple("pytorch" if t.strip().startswith("pytorch") else t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in out if t not in IMPLS]
    if bad or not out:
        raise ValueError(f"--impl ({text!r}) must name some of {', '.join(IMPLS)}")
    return out


def parse_modes(text: str | None) -> tuple[str, ...]:
    """``fp32,fp16`` -> ('fp32', 'fp16'): the precision modes of the rows (module docstring)."""
    if not text:
        return ("fp32",)
    out = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [t for t in out if t not in MODES]
    if bad or not out:
        raise ValueError(f"--modes ({text!r}) must name some of {', '.join(MODES)}")
    return out


def modes_of(classes: tuple[str, ...], dtype: str | None) -> tuple[str, ...]:
    """The modes ``convforge bench --train --devices`` asks for: AMP in ``dtype`` (fp16 / bf16 or
    their long names) when it is a half type, else the precision ``classes``."""
    half = {"float16": "fp16", "fp16": "fp16", "bfloat16": "bf16", "bf16": "bf16"}.get(str(dtype or ""))
    return (half,) if half else tuple(classes)


def gpu_counts(devices: int | str | None) -> list[int]:
    """The GPU counts ``--devices`` asks for ('all' or None: every visible one; '2,4': each);
    ValueError when they are not there."""
    import torch

    have = torch.cuda.device_count()
    items = ["all"] if devices is None else [t.strip() for t in str(devices).split(",")]
    out = []
    for item in items:
        try:
            n = have if item == "all" else int(item)
        except ValueError:
            raise ValueError(f"--devices ({devices!r}) must be a number of GPUs, several ('2,4') or 'all'") from None
        if n < 1 or n > have:
            raise ValueError(f"--devices ({devices}) must be between 1 and the {have} CUDA device(s) torch sees")
        out.append(n)
    return sorted(set(out))


def gpu_count(devices: int | str | None) -> int:
    """The largest GPU count ``--devices`` asks for (:func:`gpu_counts`)."""
    return gpu_counts(devices)[-1]


def launch(specs: list[str], devices: int | str | None, console: Console, warmup: int | None = None,
           repeats: int | None = None, out: str | None = None, impls: tuple[str, ...] = IMPLS,
           tune: bool = False, modes: tuple[str, ...] = ("fp32",), profile: bool = False) -> int:
    """The parent: every model and mode on one GPU, then on each N through torchrun; one table
    (and files in ``out``)."""
    parsed = models._check_models(specs, console)
    if parsed is None:
        return 2
    try:
        counts = gpu_counts(devices)
        modes = tuple(parse_modes(",".join(modes)))
    except ValueError as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    rows: list[dict[str, Any]] = []
    traces = str(Path(out) / "traces") if out and profile else None
    with tempfile.TemporaryDirectory(prefix="convforge-ddp-") as tmp:
        for k in sorted({1, *counts}):
            path = Path(tmp) / f"ddp-{k}.json"
            rc = _torchrun(k, parsed, impls, modes, warmup, repeats, tune, path, profile and k > 1, traces)
            if rc != 0 or not path.exists():
                rows += [dict(model=name, batch=batch, precision=mode, impl=_name(i, mode), gpus=k,
                              status=f"failed: torchrun exit {rc}") for name, batch in parsed for mode in modes
                         for i in impls]
                continue
            rows += json.loads(path.read_text())["rows"]
    scale(rows)
    console.print(table(rows, f"data-parallel training, {' and '.join(map(str, counts))} GPU(s) against one"))
    console.print(NOTE)
    if out:
        write(Path(out), rows)
        console.print(f"wrote {out}/ddp.json, ddp.csv")
    return 1 if any(not str(r.get("status", "")).startswith("ok") for r in rows) else 0


def _name(impl: str, mode: str | None) -> str:
    """A row's implementation as the table names it: the PyTorch row by its mode."""
    return BASELINES.get(mode or "fp32", "pytorch") if impl == "pytorch" else impl


def _torchrun(k: int, parsed: list[tuple[str, int]], impls: tuple[str, ...], modes: tuple[str, ...],
              warmup: int | None, repeats: int | None, tune: bool, path: Path, profile: bool,
              traces: str | None) -> int:
    import convforge

    env = dict(os.environ)
    for key, value in ENV.items():
        env.setdefault(key, value)
    root = str(Path(convforge.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={k}", "-m",
           "convforge.apps.bench.ddp", "--rank-run", "--impl", ",".join(impls), "--modes", ",".join(modes),
           "--json", str(path)]
    for name, batch in parsed:
        cmd += ["--model", f"{name}:{batch}"]
    cmd += [] if warmup is None else ["--warmup", str(warmup)]
    cmd += [] if repeats is None else ["--repeats", str(repeats)]
    cmd += ["--tune"] if tune else []
    cmd += ["--profile"] if profile else []
    cmd += ["--trace-dir", traces] if profile and traces else []
    return subprocess.run(cmd, env=env).returncode


def scale(rows: list[dict[str, Any]]) -> None:
    """``scaling`` and ``efficiency`` of each row against the one-GPU row of its model, mode and
    impl; ``comm_ms`` and ``comm_pct`` where the row has a no-sync time; ``vs_pytorch`` against the
    PyTorch row of its model, mode and GPU count."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["model"], r["batch"], r.get("precision"), r["impl"]

    one = {key(r): r for r in rows if r.get("gpus") == 1 and r.get("images_per_s")}
    torch_rows = {(r["model"], r["batch"], r.get("precision"), r.get("gpus")): r for r in rows
                  if str(r["impl"]).startswith("pytorch") and r.get("images_per_s")}
    for r in rows:
        base = one.get(key(r))
        if base is not None and r.get("images_per_s"):
            r["scaling"] = r["images_per_s"] / base["images_per_s"]
            r["efficiency"] = r["scaling"] / r["gpus"]
        if r.get("step_ms") and r.get("nosync_ms"):
            r["comm_ms"] = r["step_ms"] - r["nosync_ms"]
            r["comm_pct"] = 100.0 * r["comm_ms"] / r["step_ms"]
        ref = torch_rows.get((r["model"], r["batch"], r.get("precision"), r.get("gpus")))
        if ref is not None and r.get("images_per_s"):
            r["vs_pytorch"] = r["images_per_s"] / ref["images_per_s"]


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("model", "batch/GPU", "class", "impl", "GPUs", "step ms", "no-sync ms", "alone ms", "comm ms", "comm %",
                "tail ms",
                "overlap", "images/s", "per GPU", "scaling", "efficiency", "vs PyTorch", "status"):
        t.add_column(col)
    f = models._f
    for r in rows:
        ov = r.get("overlap")
        t.add_row(r["model"], str(r["batch"]), LABELS.get(r.get("precision") or "fp32", "-"), r["impl"], str(r["gpus"]),
                  f(r.get("step_ms"), ".2f"), f(r.get("nosync_ms"), ".2f"), f(r.get("alone_ms"), ".2f"),
                  f(r.get("comm_ms"), ".2f"),
                  f(r.get("comm_pct"), ".1f"), f(r.get("tail_ms"), ".2f"), "-" if ov is None else f"{100 * ov:.0f}%",
                  f(r.get("images_per_s"), ".0f"), f(r.get("images_per_s_per_gpu"), ".0f"), f(r.get("scaling"), ".2f"),
                  f(r.get("efficiency"), ".2f"), f(r.get("vs_pytorch"), ".2f"), r.get("status", ""))
    return t


def write(folder: Path, rows: list[dict[str, Any]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    env = models.environment()
    write_atomic(folder / "ddp.json", json.dumps({"env": env, "note": NOTE, "rows": rows}, indent=1))
    write_atomic(folder / "ddp.csv", csv_text(FIELDS, rows))


# -- one rank (under torchrun) ------------------------------------------------------------------------
def _make(impl: str, mode: str, model: Any) -> Any:
    """The row's module: a fresh copy of ``model``, converted or fused in the mode's class; PyTorch's
    in channels_last for AMP."""
    import torch

    import convforge.torch as ct

    m = copy.deepcopy(model)
    options = {"precision": mode} if mode in ("fp32", "relaxed") else {}
    if impl == "convforge":
        ct.convert(m, **options)
        return m
    if impl == "convforge_fused":
        return ct.fuse(m, **options)[0]
    return m.to(memory_format=torch.channels_last) if mode in ("fp16", "bf16") else m


def step_fn(net: Any, x: Any, target: Any, mode: str) -> Callable[[], Any]:
    """One training step in ``mode``: training.step_fn's in fp32 and relaxed; with autocast and a
    GradScaler in fp16 / bf16."""
    if mode not in ("fp16", "bf16"):
        return training.step_fn(net, x, target)
    import torch
    import torch.nn.functional as F

    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=training.LR, momentum=training.MOMENTUM)
    scaler = torch.amp.GradScaler("cuda")
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            loss = F.cross_entropy(net(x), target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return step


def rank_run(specs: list[tuple[str, int]], impls: tuple[str, ...], modes: tuple[str, ...], warmup: int,
             repeats: int, tune: bool, path: Path, profile: bool = False, trace_dir: str | None = None,
             cpu: bool = False) -> None:
    """This rank's steps of every model, mode and implementation; rank 0 writes the rows to ``path``.
    ``cpu``: CPU tensors and gloo (the tests' run of this code without a GPU)."""
    import torch
    import torch.distributed as dist

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if not cpu:
        torch.cuda.set_device(local)
    if world > 1:
        dist.init_process_group("gloo" if cpu else "nccl")
    rows = []
    for name, batch in specs:
        model = models.build(name)
        if isinstance(model, str):
            rows += [dict(model=name, batch=batch, precision=m, impl=_name(i, m), gpus=world, status=model)
                     for m in modes for i in impls]
            continue
        for mode in modes:
            for impl in impls:
                rows.append(_row(name, batch, model, impl, mode, world, None if cpu else local, rank, warmup,
                                 repeats, tune, profile, trace_dir))
                if not cpu:
                    torch.cuda.empty_cache()
    if rank == 0:
        write_atomic(path, json.dumps({"env": models.environment(), "rows": rows}))
    if world > 1:
        dist.destroy_process_group()


def _row(name: str, batch: int, model: Any, impl: str, mode: str, world: int, local: int | None, rank: int,
         warmup: int, repeats: int, tune: bool, profile: bool, trace_dir: str | None) -> dict[str, Any]:
    """One row, timed on this rank and gathered from every rank (a failure on any rank fails it);
    ``local`` None: on the CPU."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    row: dict[str, Any] = dict(model=name, batch=batch, precision=mode, impl=_name(impl, mode), gpus=world,
                               status="ok")
    size = models.MODELS[name]
    dev = "cpu" if local is None else "cuda"
    gen = torch.Generator(device=dev).manual_seed(training.SEED + rank)
    x = torch.randn(batch, 3, size, size, device=dev, generator=gen)
    target = torch.randint(0, training.CLASSES, (batch,), device=dev, generator=gen)
    sync = torch.cuda.synchronize if local is not None else (lambda: None)
    mine: dict[str, float] = {}
    try:
        training._flags(mode == "relaxed" and impl == "pytorch")
        m = _make(impl, mode, model)
        xin = x.contiguous(memory_format=torch.channels_last) if impl == "pytorch" and mode in ("fp16", "bf16") else x
        with models.tuning(tune and impl.startswith("convforge")):
            alone = step_fn(m, xin, target, mode)
            for _ in range(max(warmup, 1)):
                alone()
            sync()
        net, step = m, alone
        if world > 1:  # the plain module first, each rank alone in the same processes; then in DDP
            mine["alone_ms"] = training._time(alone, 0, repeats)
            net = DDP(m, device_ids=None if local is None else [local])
            step = step_fn(net, xin, target, mode)
            for _ in range(2):  # DDP's first steps: its buckets rebuilt in the order the gradients came
                step()
            sync()
        mine["step_ms"] = training._time(step, 0, repeats)
        if world > 1:  # the same step without the all-reduce, in the same processes; then DDP's own logging
            with net.no_sync():
                step()
                mine["nosync_ms"] = training._time(step, 0, repeats)
            mine.update(_ddp_stats(net, step))
            if profile:
                mine.update(_profile(step, rank, f"{name}-{batch}-{mode}-{impl}-{world}", trace_dir, local is None))
        del net, m, step, alone
    except Exception as err:  # noqa: BLE001 - a failing row must not hide the others
        mine = {"failed": 1.0}
        row["status"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    every = [mine]
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        every = gathered
    if row["status"] == "ok" and any("failed" in d for d in every):
        row["status"] = "failed on another rank"
    if row["status"] == "ok":
        _fill(row, every, world, batch)
    return row


def _fill(row: dict[str, Any], every: list[dict[str, float]], world: int, batch: int) -> None:
    """The row's times from every rank's: steps the slowest rank's, DDP's and the profile's rank 0's."""
    row["step_ms"] = max(d["step_ms"] for d in every)
    row["rank_step_ms"] = [d["step_ms"] for d in every]
    for k in ("nosync_ms", "alone_ms"):
        if all(k in d for d in every):
            row[k] = max(d[k] for d in every)
    for k in ("tail_ms", "allreduce_ms", "overlap", "overlap_ours_ms", "exposed_ms", "ours_beside"):
        if k in every[0]:
            row[k] = every[0][k]
    row["images_per_s"] = world * batch / (row["step_ms"] / 1e3)
    row["images_per_s_per_gpu"] = batch / (row["step_ms"] / 1e3)


def _ddp_stats(net: Any, step: Callable[[], Any], steps: int = 3) -> dict[str, float]:
    """``tail_ms`` from DDP's runtime logging (CUDA events) over ``steps`` more steps: from the end
    of the backward's compute to the end of its all-reduce, the last step's; {} where this torch's
    DDP does not log it."""
    try:
        net._set_ddp_runtime_logging_sample_rate(1)
        for _ in range(steps):
            step()
        step()  # DDP logs a step's times at the next step's forward
        data = net._get_ddp_logging_data()
        comm, overlap = data.get("backward_comm_time"), data.get("backward_compute_comm_overlap_time")
    except (AttributeError, RuntimeError):
        return {}
    if not comm or overlap is None:
        return {}
    return {"tail_ms": max(0.0, (float(comm) - float(overlap)) / 1e6)}


# -- the profile: all-reduce kernels beside compute kernels -------------------------------------------------
def _profile(step: Callable[[], Any], rank: int, tag: str, trace_dir: str | None, cpu: bool = False,
             steps: int = 2) -> dict[str, float]:
    """Two synchronised steps under torch.profiler; :func:`overlap` of this rank's kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])) as prof:
        for _ in range(steps):
            step()
        if not cpu:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory(prefix="convforge-trace-") as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        doc = json.loads(trace.read_text())
        if trace_dir and rank == 0:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(trace, Path(trace_dir) / f"{tag}-rank{rank}.json")
    return overlap(kernels_of(doc), our_kernels(), steps)


def kernels_of(trace: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel in a chrome trace (torch.profiler's export)."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel":
            start = float(e["ts"])
            out.append((str(e.get("name", "")), start, start + float(e.get("dur", 0.0))))
    return out


def our_kernels() -> set[str]:
    """The names of the kernels this process's convforge built: every executable's (conv passes)
    and every training batch-norm program's."""
    from convforge.dispatch.executables import _EXECUTABLES

    names = {name for exe in _EXECUTABLES.values() for name in getattr(exe, "kernels", {})}
    try:
        from convforge.torch import batchnorm

        names |= {k.name for entry in batchnorm._PROGRAMS.values() for k in entry[1].kernels}
    except ImportError:
        pass
    return names


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _meet(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of intervals (each sorted and disjoint)."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(kernels: list[tuple[str, float, float]], ours: set[str], steps: int = 1) -> dict[str, float]:
    """Per step (ms): ``allreduce_ms`` (NCCL all-reduce kernels' union; every NCCL kernel where none
    is named so), ``overlap`` (the share of it with a non-NCCL kernel running), ``overlap_ours_ms``
    (with one of ``ours`` running), ``exposed_ms`` (with none running); ``ours_beside``: how many of
    our kernels ran beside an all-reduce."""
    nccl = [k for k in kernels if "nccl" in k[0].lower()]
    reduce = [k for k in nccl if "allreduce" in k[0].lower().replace("_", "")] or nccl
    ar = _union([(a, b) for _, a, b in reduce])
    compute = _union([(a, b) for n, a, b in kernels if "nccl" not in n.lower()])
    mine = [(a, b) for n, a, b in kernels if n in ours]
    total = _length(ar)
    beside = sum(1 for a, b in mine if _meet(ar, [(a, b)]) > 0)
    both = _meet(ar, compute)
    return {"allreduce_ms": total / 1e3 / steps, "overlap": both / total if total else 0.0,
            "overlap_ours_ms": _meet(ar, _union(mine)) / 1e3 / steps, "exposed_ms": (total - both) / 1e3 / steps,
            "ours_beside": float(beside) / steps}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m convforge.apps.bench.ddp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, metavar="NAME[:BATCH]")
    p.add_argument("--devices", help="GPUs of the data-parallel runs: N, several (2,4) or all (default: all)")
    p.add_argument("--impl", help=f"comma-separated, some of {', '.join(IMPLS)} (default: all)")
    p.add_argument("--modes", help=f"comma-separated, some of {', '.join(MODES)} (default: fp32)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 3)")
    p.add_argument("--repeats", type=int, help="timed steps (default 10)")
    p.add_argument("--tune", action="store_true", help="tune convforge's layers on the warm-up steps")
    p.add_argument("--profile", action="store_true", help="profile two more steps: all-reduce beside compute")
    p.add_argument("--out", help="write ddp.json and ddp.csv here (and traces/ with --profile)")
    p.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--trace-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        impls, modes = parse_impls(args.impl), parse_modes(args.modes)
        parsed = [models.parse_model(m) for m in args.model] if args.rank_run else []
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.rank_run:
        rank_run(parsed, impls, modes, 3 if args.warmup is None else args.warmup, args.repeats or 10, args.tune,
                 args.json, args.profile, args.trace_dir)
        return 0
    return launch(args.model, args.devices, Console(), args.warmup, args.repeats, args.out, impls, args.tune, modes,
                  args.profile)


__all__ = ["IMPLS", "MODES", "gpu_counts", "kernels_of", "launch", "main", "modes_of", "overlap", "parse_impls",
           "parse_modes", "rank_run", "scale"]

if __name__ == "__main__":
    sys.exit(main())
