"""``convforge bench --model NAME[:BATCH] --train --amp [fp16|bf16]``: one mixed-precision training step.

The step users run: ``torch.autocast("cuda", dtype)`` around forward and loss, a ``GradScaler`` (FP16;
BF16 needs none and runs without one), model and input in channels_last, FP32 master weights, SGD with
momentum; cudnn.benchmark on. Rows, each from a fresh copy of ONE model (``models.build``'s weights):

- ``pytorch_amp``: PyTorch itself (the baseline of every AMP figure);
- ``convforge_amp``: ``convforge.torch.convert`` (our convolutions, every pass, in the autocast dtype,
  channels_last through; batch norm and the rest PyTorch's);
- ``convforge_fused_amp``: ``convforge.torch.fuse`` (the fused model's training path under autocast), its
  forward and backward replayed from CUDA graphs after two eager steps (torch/graphs.py, the default);
- ``convforge_fused_eager``: the same fused model with every call eager (``graphs.without_graphs``);
- ``pytorch_amp_graphs``: PyTorch's own model replayed the same way (``graphs.graph_training``): what the
  graphs alone give, so that the fused rows' speed-up over it is the kernels' and the fusion's.

Columns: the step's median time (CUDA events around whole steps after warm-up; the implementations
timed in interleaved rounds, ``training.time_rounds``), images/s, the peak memory of a step (what the
implementation allocated above what was allocated before its model was built, its graphs' pools
included), the first step's wall time in this process (compiling included: run the command twice for
the time with a warm on-disk cache), and a loss curve of ``STEPS`` steps from the same initial weights.
``loss_noise`` is PyTorch AMP's own run-to-run noise: the larger relative deviation, from its curve, of PyTorch AMP with
cudnn.benchmark off (other, equally valid kernels) and of PyTorch FP32; ``within_noise`` says whether
a convforge row's deviation is at most ``NOISE_SLACK`` times that.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from convforge.apps.bench import models, training
from convforge.files import write_atomic

STEPS = 100
NOISE_SLACK = 2.0
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "float16": "float16", "bfloat16": "bfloat16"}


def amp_step_fn(model: Any, x: Any, target: Any, dtype: Any, lr: float = training.LR) -> Callable[[], Any]:
    """One AMP step of ``model`` on (x, target): autocast forward and loss, scaled backward (FP16), SGD."""
    import torch
    import torch.nn.functional as F

    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=training.MOMENTUM)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            loss = F.cross_entropy(model(x), target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return step


def _forms(model: Any, options: dict[str, Any], reports: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    import torch

    import convforge.torch as ct
    from convforge.torch import graphs

    def fresh() -> Any:
        return copy.deepcopy(model).to(memory_format=torch.channels_last)

    def converted() -> Any:
        m = fresh()
        reports["convforge_amp"] = ct.convert(m, **options)
        return m

    def fused() -> Any:
        m, reports["convforge_fused_amp"] = ct.fuse(fresh(), **options)
        return m

    def fused_eager() -> Any:
        m, reports["convforge_fused_eager"] = ct.fuse(fresh(), **options)
        return graphs.without_graphs(m)

    def pytorch_graphs() -> Any:
        return graphs.graph_training(fresh())

    return [("pytorch_amp", fresh), ("pytorch_amp_graphs", pytorch_graphs), ("convforge_amp", converted),
            ("convforge_fused_amp", fused), ("convforge_fused_eager", fused_eager)]


def bench_amp(name: str, batch: int, dtype_name: str, warmup: int, repeats: int, options: dict[str, Any],
              tune: bool = False) -> list[dict[str, Any]]:
    """One row per implementation of one model's AMP step (module docstring)."""
    import torch

    dtype = getattr(torch, DTYPES[dtype_name])
    model = models.build(name)
    if isinstance(model, str):
        return [dict(model=name, batch=batch, impl="-", status=model)]
    x, target = training._batch(name, batch)
    x = x.contiguous(memory_format=torch.channels_last)
    reports: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    live: dict[str, training.Timed] = {}
    makers = dict(_forms(model, options, reports))
    for impl, make in makers.items():
        row: dict[str, Any] = dict(model=name, batch=batch, impl=impl, dtype=DTYPES[dtype_name], status="ok",
                                   baseline="pytorch_amp")
        try:
            live[impl] = (_first_step(row, make, x, target, dtype, tune and impl.startswith("convforge")),
                          lambda: training._flags(False))
        except Exception as err:  # noqa: BLE001 - one failing implementation must not hide the others
            row["status"] = training.failure(err)
        if impl in reports:
            row.update(training.report_fields(reports[impl]))
        rows.append(row)
    times = training.time_rounds(live, warmup, repeats)
    live.clear()  # the timed models go before the curves' fresh copies
    for row in rows:
        t = times.get(row["impl"])
        if isinstance(t, BaseException):
            row["status"] = training.failure(t)
        elif t is not None:
            row["time_ms"], row["images_s"] = t, batch / t * 1e3
            try:
                row["loss_curve"] = training.loss_curve(amp_step_fn(makers[row["impl"]](), x, target, dtype), STEPS)
                row["final_loss"] = row["loss_curve"][-1]
            except Exception as err:  # noqa: BLE001
                row["status"] = training.failure(err)
    for impl, bench, amp in (("pytorch_amp_nobench", False, True), ("pytorch_fp32", True, False)):
        row = dict(model=name, batch=batch, impl=impl, status="ok")
        try:
            training._flags(False, benchmark=bench)
            m = copy.deepcopy(model).to(memory_format=torch.channels_last)
            step = amp_step_fn(m, x, target, dtype) if amp else training.step_fn(m, x, target)
            row["loss_curve"] = training.loss_curve(step, STEPS)
        except Exception as err:  # noqa: BLE001
            row["status"] = f"failed: {type(err).__name__}: {str(err)[:200]}"
        rows.append(row)
    training._flags(False)
    return compare(rows)


def _first_step(row: dict[str, Any], make: Callable[[], Any], x: Any, target: Any, dtype: Any,
                tune: bool) -> Callable[[], Any]:
    """The implementation's step function, after its first step (``first_step_s``: compiling, tuning with
    ``tune``) and one more (``peak_gib``: what a step allocates above what was allocated before its model)."""
    import torch

    training._flags(False)
    before, pools = torch.cuda.memory_allocated(), _graph_pool_bytes()
    with models.tuning(tune):
        step = amp_step_fn(make(), x, target, dtype)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        row["first_step_s"] = time.perf_counter() - t0
    step(), step()  # a graphed model captures its third step
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    row["peak_gib"] = (torch.cuda.max_memory_allocated() - before + _graph_pool_bytes() - pools) / 2**30
    return step


def _graph_pool_bytes() -> int:
    """Bytes the caching allocator holds in CUDA graphs' private pools (a replay's activations live there,
    allocated once at capture, so max_memory_allocated does not see them)."""
    import torch

    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Speed-up against PyTorch AMP; loss deviations against its curve and its run-to-run noise."""
    by = {r["impl"]: r for r in rows}
    base = by.get("pytorch_amp", {})
    ref = base.get("loss_curve")
    others = [training.deviation(by[o]["loss_curve"], ref) for o in ("pytorch_amp_nobench", "pytorch_fp32")
              if ref and "loss_curve" in by.get(o, {})]
    noise = max(others) if others else None
    for row in rows:
        if row.get("time_ms") and base.get("time_ms"):
            row["speedup"] = base["time_ms"] / row["time_ms"]
        if ref and row.get("loss_curve") and row["impl"] != "pytorch_amp":
            row["loss_dev"] = training.deviation(row["loss_curve"], ref)
            if noise is not None and row["impl"] not in ("pytorch_amp_nobench", "pytorch_fp32"):
                row["loss_noise"] = noise
                row["within_noise"] = row["loss_dev"] <= max(NOISE_SLACK * noise, training.NOISE_FLOOR)
    return rows


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("impl", "step ms", "× PyTorch AMP", "images/s", "peak GiB", "first step s", "final loss",
                "loss dev", "noise", "status"):
        t.add_column(col)
    f = models._f
    for r in rows:
        if "time_ms" not in r and "status" in r and r["status"] == "ok":
            continue  # a curve-only row
        t.add_row(r["impl"], f(r.get("time_ms"), ".2f"), f(r.get("speedup"), ".2f"), f(r.get("images_s"), ".0f"),
                  f(r.get("peak_gib"), ".2f"), f(r.get("first_step_s"), ".1f"), f(r.get("final_loss"), ".4f"),
                  f(r.get("loss_dev"), ".1e"), f(r.get("loss_noise"), ".1e"), r.get("status", ""))
    return t


def run(specs: list[str], dtype_name: str, out: str | None, warmup: int | None, repeats: int | None,
        console: Console, options: dict[str, Any], tune: bool = False) -> int:
    """2 on bad input or no GPU; 1 when a row failed or a convforge loss curve left PyTorch AMP's noise."""
    parsed = models._check_models(specs, console)
    if parsed is None:
        return 2
    env = models.environment()
    console.print(" | ".join(f"{k} {v}" for k, v in env.items()))
    rows: list[dict[str, Any]] = []
    for name, batch in parsed:
        mine = bench_amp(name, batch, dtype_name, warmup if warmup is not None else 3, repeats or 10, options, tune)
        rows += mine
        console.print(table(mine, f"{name} N={batch}: one AMP training step ({DTYPES[dtype_name]} autocast, "
                                  "channels_last, SGD momentum) against PyTorch AMP"))
    console.print(__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else "")
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / "train_amp.json", json.dumps({"env": env, "rows": rows}, indent=1, default=str))
        console.print(f"wrote {out}/train_amp.json")
    failed = any(not str(r.get("status", "")).startswith("ok") and r["impl"] != "-" for r in rows)
    return 1 if failed or any(r.get("within_noise") is False for r in rows) else 0
