"""``convforge bench --model NAME[:BATCH] --dtype fp16|bf16``: whole torchvision models in half precision.

One model per name, built as ``bench.models`` builds it (the same random float32 weights, seed
``models.SEED``), run in the dtype by every side; rows:

- ``pytorch_{fp16,bf16}_autocast_cl``: PyTorch autocast (that dtype) on the model and input in
  channels_last — the baseline of every convforge row (docs/MEASURING.md);
- ``pytorch_…_autocast``: the same in NCHW; ``pytorch_…``: the model and input cast to the dtype
  (``.half()`` / ``.bfloat16()``, NCHW), eager; ``pytorch_…_graph``: that replayed from a CUDA graph;
- ``convforge_…``: the cast model converted by ``convforge.torch.convert``; ``convforge_…_fused``:
  fused by ``convforge.torch.fuse`` (batch norm folded in float64, then cast), eager and
  ``_graph`` (CUDA graph replay); ``convforge_autocast_fused``: the float32 model fused and run
  under autocast (filters cast once per weight version), NCHW; ``convforge_autocast_fused_cl``: the
  same with the model and input channels_last, as the baseline runs (what a mixed-precision user does).

Errors: each output against a float64 run of the float32 model on the input rounded to the dtype
(the input every side gets), relative L2; ``err_vs_pytorch`` is a row's over the baseline's.
CUDA events, warm-up first, then the rows timed in interleaved rounds (``training.time_rounds``: eager
forwards are host-bound and the host's speed drifts within a call), median of repeats; converted figures
exclude filter transforms and casts (made once per weight version on the warm-up call).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from rich.console import Console

from convforge.apps.bench import models as M
from convforge.apps.bench.training import time_rounds
from convforge.files import csv_text, write_atomic

TAGS = {"float16": "fp16", "bfloat16": "bf16"}
NOTE = ("half precision: every side gets the same float32 weights (Kaiming-normal, seed {seed}) and the input "
        "rounded to {dtype}; convforge accumulates in FP32; rel err is against a float64 run of the float32 "
        "model on that input; speed-up and err / baseline are against {base} (PyTorch autocast, channels_last)")


def baseline_impl(dtype: str) -> str:
    return f"pytorch_{TAGS[dtype]}_autocast_cl"


def _runs(model: Any, x: Any, dtype: str, warmup: int, options: dict[str, Any],
          reports: dict[str, Any]) -> list[tuple[str, Callable[[], Callable[[], Any]]]]:
    """(impl, make) of every row: ``make()`` sets the run up (conversions, captures) and returns
    the timed call."""
    import torch

    import convforge.torch as ct

    tag, tdt = TAGS[dtype], getattr(torch, dtype)
    cl = torch.channels_last
    model_cl = copy.deepcopy(model).to(memory_format=cl)
    x_cl = x.contiguous(memory_format=cl)
    half = copy.deepcopy(model).to(tdt)
    xh = x.to(tdt)

    def autocast(m: Any, xin: Any) -> Callable[[], Any]:
        def run() -> Any:
            with torch.autocast("cuda", dtype=tdt):
                return m(xin)
        return run

    def converted() -> Callable[[], Any]:
        conv = copy.deepcopy(half)
        reports[f"convforge_{tag}"] = ct.convert(conv, **options)
        return lambda: conv(xh)

    def fused(graph: bool) -> Callable[[], Any]:
        fm, rep = ct.fuse(copy.deepcopy(half), **options)
        reports[f"convforge_{tag}_fused" + ("_graph" if graph else "")] = rep
        return M._replay(fm, xh, warmup) if graph else (lambda: fm(xh))

    def autocast_fused(channels_last: bool) -> Callable[[], Any]:
        fm, rep = ct.fuse(copy.deepcopy(model_cl if channels_last else model), **options)
        reports["convforge_autocast_fused" + ("_cl" if channels_last else "")] = rep
        return autocast(fm, x_cl if channels_last else x)

    return [
        (baseline_impl(dtype), lambda: autocast(model_cl, x_cl)),
        (f"pytorch_{tag}_autocast", lambda: autocast(model, x)),
        (f"pytorch_{tag}", lambda: lambda: half(xh)),
        (f"pytorch_{tag}_graph", lambda: M._replay(half, xh, warmup)),
        (f"convforge_{tag}", converted),
        (f"convforge_{tag}_fused", lambda: fused(False)),
        (f"convforge_{tag}_fused_graph", lambda: fused(True)),
        ("convforge_autocast_fused", lambda: autocast_fused(False)),
        ("convforge_autocast_fused_cl", lambda: autocast_fused(True)),
    ]


def bench_half(name: str, batch: int, warmup: int, repeats: int, options: dict[str, Any], dtype: str,
               tune: bool = False) -> list[dict[str, Any]]:
    """One row per implementation of one model in ``dtype`` (module docstring)."""
    import torch

    model = M.build(name)
    if isinstance(model, str):
        return [dict(model=name, batch=batch, impl="-", status=model)]
    size = M.MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, 3, size, size, device="cuda", generator=gen).to(getattr(torch, dtype)).float()
    with torch.no_grad():
        model64 = copy.deepcopy(model).double()
        want = model64(x.double())
        spread = M.spread(model64, x.double(), want)
        del model64
    flag = f"degenerate: reference spread {spread:.1e} < {M.MIN_SPREAD:g}" if spread < M.MIN_SPREAD else ""
    reports: dict[str, Any] = {}
    rows, timed = [], {}
    M._tf32(False)
    for impl, make in _runs(model, x, dtype, warmup, options, reports):
        row: dict[str, Any] = dict(model=name, batch=batch, impl=impl, status="ok", ref_spread=spread,
                                   precision=TAGS[dtype], baseline=baseline_impl(dtype))
        try:
            with torch.no_grad():
                with M.tuning(tune) if impl.startswith("convforge") else nullcontext():
                    fn = make()
                    y = fn()
                torch.cuda.synchronize()
            row["rel_err"] = float((y.double() - want).norm() / want.norm())
            del y
            timed[impl] = (_no_grad(fn), lambda: None)
            if flag:
                row["status"] = f"ok ({flag})"
        except Exception as err:  # noqa: BLE001 - one failing implementation must not hide the others
            row["status"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rep = reports.get(impl)
        if rep is not None:
            row["converted"] = len(rep.converted)
            row["left_to_pytorch"] = "; ".join(f"{k}: {v}" for k, v in {**rep.left, **rep.unfused}.items())
            row["tuned"] = tune
        rows.append(row)
    times = time_rounds(timed, warmup, repeats)  # interleaved: host-bound forwards drift between moments
    for row in rows:
        t = times.get(row["impl"])
        if isinstance(t, BaseException):
            row["status"] = f"failed: {type(t).__name__}: {str(t).splitlines()[0][:200]}"
        elif t is not None:
            row["time_ms"] = t
    return compare(rows)


def _no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    import torch

    def run() -> Any:
        with torch.no_grad():
            return fn()
    return run


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``speedup`` and ``err_vs_pytorch`` of every row against its model's baseline row."""
    base = {(r["model"], r["batch"]): r for r in rows if r["impl"] == r.get("baseline")}
    for row in rows:
        b = base.get((row["model"], row["batch"]))
        if b is None:
            continue
        if row.get("time_ms") and b.get("time_ms"):
            row["speedup"] = b["time_ms"] / row["time_ms"]
        if row.get("rel_err") is not None and b.get("rel_err"):
            row["err_vs_pytorch"] = row["rel_err"] / b["rel_err"]
    return rows


def run_specs(specs: list[str], out: str | None, warmup: int | None, repeats: int | None, console: Console,
              options: dict[str, Any], precision: str, dtype: str, tune: bool) -> int:
    """``convforge bench --model ... --dtype fp16|bf16``: exit status 2 on bad input or no GPU, else
    :func:`run`'s."""
    prepared = M.prepare(specs, console)
    if prepared is None:
        return 2
    models, env = prepared
    return run(models, out, warmup, repeats, console, options, precision, dtype, tune, env)


def run(models: list[tuple[str, int]], out: str | None, warmup: int | None, repeats: int | None,
        console: Console, options: dict[str, Any], precision: str, dtype: str, tune: bool,
        env: dict[str, Any]) -> int:
    """Every model in ``dtype``: the table, the summary and (``out``) models.json / models.csv; exit
    status 1 when a row failed."""
    opts = {**options, "precision": precision}
    notes = [NOTE.format(seed=M.SEED, dtype=dtype, base=baseline_impl(dtype)),
             M.TUNED_NOTE if tune else M.UNTUNED_NOTE]
    rows: list[dict[str, Any]] = []
    for name, batch in models:
        mine = bench_half(name, batch, warmup if warmup is not None else 5, repeats or 20, opts, dtype, tune)
        rows += mine
        console.print(M.table(mine, f"{name} N={batch}: {dtype} ({precision} class accumulation)"
                                    f"{', tuned' if tune else ''}"))
        console.print(M.summary(mine))
    for note in notes:
        console.print(note)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        doc = {"env": env, "notes": notes, "dtype": dtype, "classes": [precision], "tuned": tune, "rows": rows}
        write_atomic(folder / "models.json", json.dumps(doc, indent=1))
        write_atomic(folder / "models.csv", csv_text(M.FIELDS, rows))
        console.print(f"wrote {folder}/models.json, models.csv")
    return 1 if any(not str(r.get("status", "")).startswith("ok") and r["impl"] != "-" for r in rows) else 0
