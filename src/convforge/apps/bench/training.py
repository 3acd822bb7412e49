"""``convforge bench --model NAME[:BATCH] --train``: one training step of a whole torchvision model.

A step is forward + cross-entropy + backward + an SGD step (momentum 0.9, learning rate ``LR``) on
one fixed batch (random images and labels from seed ``SEED``), the model in training mode (batch
norm on batch statistics, not folded). Rows, each from a fresh copy of ONE model (the same random
weights as ``bench --model``, ``models.build``):

- ``pytorch_fp32``: PyTorch, cudnn.benchmark on, TF32 off (the fp32 class's baseline);
- ``pytorch_tf32``: PyTorch with TF32 convolutions and matmuls (the relaxed class's baseline);
- ``convforge``: ``convforge.torch.convert`` (our conv forward and our dgrad, wgrad and bias
  gradient through the op's autograd; everything else PyTorch's);
- ``convforge_fused``: ``convforge.torch.fuse`` in training mode (our conv, and batch norm with the
  residual add and ReLU after it on our kernels: ``torch/batchnorm.py``).

Time: CUDA events around each step after ``warmup`` steps, the median of ``repeats`` steps, the
implementations timed in interleaved rounds (``time_rounds``: host and GPU speed drift); each step
updates the weights, so filter transforms are redone per step as in real training. An eager step of
ResNet-50 can be host-bound on a fast GPU on both sides (more host work than GPU time), so each timed
row is also captured whole (forward, loss, backward, SGD) in a CUDA graph after warm-up on a side
stream and its replay timed the same way: ``graph_ms`` and ``graph_speedup`` against the class
baseline's replay, the host's cost gone from both sides (``torch.cuda.graphs``: what a user removes
it with). A capture that fails says so in ``graph_status`` and leaves the eager row standing. Loss
curve: ``STEPS`` steps from the initial weights on a fresh copy, the loss of each step. Beside
them, curves only: ``pytorch_fp64`` (the same steps in float64) and ``pytorch_fp32_nobench``
(PyTorch FP32 with cudnn.benchmark off: other, equally valid FP32 algorithms). ``loss_dev`` is a
row's largest relative deviation from PyTorch FP32's curve; ``loss_noise`` the run-to-run noise of
FP32 training, the larger deviation of PyTorch FP32 from float64 and of the no-benchmark run from
PyTorch FP32 (for the relaxed class also PyTorch TF32's from PyTorch FP32); ``within_noise`` says
whether a convforge row's deviation is at most ``NOISE_SLACK`` x its class's noise, or below
``NOISE_FLOOR`` (a relative 1e-4 of the loss: where the PyTorch runs agree to the last bits).
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from convforge.apps.bench import models
from convforge.files import csv_text, write_atomic

SEED = 0
LR = 1e-3
MOMENTUM = 0.9
STEPS = 50
NOISE_SLACK = 4.0
NOISE_FLOOR = 1e-4
CLASSES = 1000
FIELDS = ("model", "batch", "impl", "precision", "baseline", "time_ms", "speedup", "graph_ms", "graph_speedup",
          "graph_status", "final_loss", "loss_dev", "loss_noise", "within_noise", "status", "converted",
          "left_to_pytorch", "tuned")
NOTE = (f"one training step: forward + cross-entropy + backward + SGD (lr {LR:g}, momentum {MOMENTUM:g}) on one "
        f"fixed random batch, training mode (batch norm on batch statistics); CUDA events, median of the timed "
        f"steps; graph: the same step captured whole in a CUDA graph, its replay timed (no host cost on either "
        f"side); loss curves: {STEPS} steps from the same initial weights (seed {SEED}) on every side; "
        "loss_dev: largest relative deviation from PyTorch FP32's curve; loss_noise: the run-to-run noise of FP32 "
        "training (PyTorch FP32 against float64 and against itself with cudnn.benchmark off; TF32's too for "
        "the relaxed class)")


def _batch(name: str, batch: int) -> tuple[Any, Any]:
    """The fixed (images, labels) of every step, from ``SEED``."""
    import torch

    size = models.MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    x = torch.randn(batch, 3, size, size, device="cuda", generator=gen)
    target = torch.randint(0, CLASSES, (batch,), device="cuda", generator=gen)
    return x, target


def step_fn(model: Any, x: Any, target: Any, lr: float = LR) -> Callable[[], Any]:
    """One training step of ``model`` (in training mode) on (x, target); returns the loss tensor."""
    import torch
    import torch.nn.functional as F

    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        return loss

    return step


def loss_curve(step: Callable[[], Any], steps: int | None = None) -> list[float]:
    """The loss of each of ``steps`` steps (default ``STEPS``)."""
    return [float(step().item()) for _ in range(steps or STEPS)]


def deviation(curve: list[float], ref: list[float]) -> float:
    """Largest relative deviation of a loss curve from a reference curve (inf where either is not finite),
    each step's difference over the reference's loss there or 1 % of its first loss, whichever is larger:
    a curve that memorises its batch falls to ~1e-4, where two valid implementations' losses differ by
    more than a percent of themselves (ResNet-18 N4 FP16 AMP, H200: 1.8e-2 of a 1.5e-4 loss) while
    neither strays from the curve."""
    import math

    if len(curve) != len(ref) or not all(math.isfinite(v) for v in curve + ref):
        return math.inf
    floor = max(1e-2 * abs(ref[0]), 1e-12) if ref else 1e-12
    return max(abs(a - b) / max(abs(b), floor) for a, b in zip(curve, ref, strict=True))


def _forms(model: Any, options: dict[str, Any], reports: dict[str, Any]) -> list[tuple[str, Callable[[], Any], bool]]:
    """(impl, make() -> a fresh module with the model's initial weights, TF32) of every row."""
    import convforge.torch as ct

    def converted() -> Any:
        m = copy.deepcopy(model)
        reports["convforge"] = ct.convert(m, **options)
        return m

    def fused() -> Any:
        m, reports["convforge_fused"] = ct.fuse(copy.deepcopy(model), **options)
        return m

    return [("pytorch_fp32", lambda: copy.deepcopy(model), False),
            ("pytorch_tf32", lambda: copy.deepcopy(model), True),
            ("convforge", converted, False), ("convforge_fused", fused, False)]


def _flags(tf32: bool, benchmark: bool = True) -> None:
    import torch

    models._tf32(tf32)
    torch.backends.cudnn.benchmark = benchmark


def _time(step: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median CUDA-event time of single steps after ``warmup`` steps."""
    for _ in range(warmup):
        step()
    return statistics.median(_samples(step, repeats))


def _samples(step: Callable[[], Any], repeats: int) -> list[float]:
    """CUDA-event milliseconds of ``repeats`` single steps, each waited for."""
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


ROUNDS = 5
Timed = tuple[Callable[[], Any], Callable[[], None]]  # (step, setup before each of its turns)


def time_rounds(steps: dict[str, Timed], warmup: int, repeats: int,
                rounds: int = ROUNDS) -> dict[str, float | BaseException]:
    """Each implementation's median step time (``_samples``), timed in ``rounds`` interleaved rounds of
    about ``repeats / rounds`` steps each, the order rotated every round, after ``warmup`` steps each;
    ``steps``: impl -> (step, setup), setup called before each of its turns (TF32 and cudnn flags).

    Host and GPU speed drift within one call and between calls (PyTorch AMP's ConvNeXt-T step: 29.8 ms
    when timed first, 34.4 ms interleaved with ours; host-bound steps move most), so implementations timed
    one after another compare unlike moments. An implementation whose step raises gets its exception
    in place of a time and leaves the rounds."""
    out: dict[str, float | BaseException] = {}
    live = dict(steps)

    def turn(impl: str, n: int, into: list[float] | None) -> None:
        step, setup = live[impl]
        try:
            setup()
            if into is None:
                for _ in range(n):
                    step()
            else:
                into += _samples(step, n)
        except Exception as err:  # noqa: BLE001 - one failing implementation must not stop the others
            out[impl] = err
            del live[impl]

    for impl in list(live):
        turn(impl, warmup, None)
    times: dict[str, list[float]] = {impl: [] for impl in live}
    per = max(1, -(-repeats // rounds))
    for r in range(rounds):
        order = list(live)
        for impl in order[r % len(order):] + order[:r % len(order)] if order else []:
            turn(impl, per, times[impl])
    out.update({impl: statistics.median(times[impl]) for impl in live})
    return out


def _graph_row(row: dict[str, Any], step: Callable[[], Any], repeats: int) -> None:
    """``graph_ms``: the step captured whole in a CUDA graph (three warm-up steps on a side stream
    first: optimizer state, workspaces, runners made outside the capture), the median replay; or
    ``graph_status`` saying why it could not be captured."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        row["graph_ms"] = _time(graph.replay, 2, repeats)
        row["graph_status"] = "ok"
        del graph
    except Exception as err:  # noqa: BLE001 - the eager row stands without it
        row["graph_status"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    torch.cuda.synchronize()


def bench_train(name: str, batch: int, warmup: int, repeats: int, options: dict[str, Any], *,
                pytorch: bool = True, tune: bool = False) -> list[dict[str, Any]]:
    """One row per implementation of one model's training step (module docstring); ``pytorch=False``
    runs only the convforge rows (a second precision class sharing the first's PyTorch rows)."""
    import torch

    model = models.build(name)
    if isinstance(model, str):
        return [dict(model=name, batch=batch, impl="-", status=model)]
    x, target = _batch(name, batch)
    reports: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    live: dict[str, Timed] = {}
    forms = {impl: (make, tf32) for impl, make, tf32 in _forms(model, options, reports)}
    for impl, (make, tf32) in forms.items():
        if not pytorch and not impl.startswith("convforge"):
            continue
        row: dict[str, Any] = dict(model=name, batch=batch, impl=impl, status="ok")
        try:
            _flags(tf32)
            with models.tuning(tune and impl.startswith("convforge")):
                step = step_fn(make(), x, target)
                step()  # first call: choices, compiles, workspace (tuning, with --tune) outside the timing
                torch.cuda.synchronize()
            live[impl] = (step, functools.partial(_flags, tf32))
        except Exception as err:  # noqa: BLE001 - one failing implementation must not hide the others
            row["status"] = failure(err)
        if impl in reports:
            row.update(report_fields(reports[impl]))
        rows.append(row)
    times = time_rounds(live, warmup, repeats)
    for row in rows:
        t = times.get(row["impl"])
        if isinstance(t, BaseException):
            row["status"] = failure(t)
            continue
        if t is None:
            continue
        row["time_ms"] = t
        make, tf32 = forms[row["impl"]]
        try:
            _flags(tf32)
            _graph_row(row, live[row["impl"]][0], repeats)
            row["loss_curve"] = loss_curve(step_fn(make(), x, target))
            row["final_loss"] = row["loss_curve"][-1]
        except Exception as err:  # noqa: BLE001
            row["status"] = failure(err)
    if pytorch:
        rows.append(_curve_row(name, batch, "pytorch_fp32_nobench", lambda: copy.deepcopy(model), x, target, False))
        rows.append(_curve_row(name, batch, "pytorch_fp64", lambda: copy.deepcopy(model).double(), x.double(), target,
                               True))
    _flags(False)
    models.label(rows, options, tune)
    return rows


def failure(err: BaseException) -> str:
    """A row's status for an implementation that raised: the error's type and first line."""
    return f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def report_fields(rep: Any) -> dict[str, Any]:
    """A convert / fuse report as a row's fields: how many convs were converted, what stayed PyTorch's."""
    left = {**rep.left, **getattr(rep, "unfused", {})}
    return {"converted": len(rep.converted), "left_to_pytorch": "; ".join(f"{k}: {v}" for k, v in left.items())}


def _curve_row(name: str, batch: int, impl: str, make: Callable[[], Any], x: Any, target: Any,
               benchmark: bool) -> dict[str, Any]:
    """A PyTorch loss curve, no time: FP32 with cudnn.benchmark off (other FP32 algorithms) or float64."""
    row: dict[str, Any] = dict(model=name, batch=batch, impl=impl, status="ok", precision="fp32",
                               baseline="pytorch_fp32", tuned=None)
    try:
        _flags(False, benchmark=benchmark)
        row["loss_curve"] = loss_curve(step_fn(make(), x, target))
        row["final_loss"] = row["loss_curve"][-1]
    except Exception as err:  # noqa: BLE001
        row["status"] = f"failed: {type(err).__name__}: {str(err)[:200]}"
    return row


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Speed-up against each row's class baseline (``models.compare``), then the loss curves against
    PyTorch FP32's: ``loss_dev``, ``loss_noise`` (the largest deviation of the float64 and
    no-benchmark runs, and for the relaxed class PyTorch TF32's) and, on convforge rows, ``within_noise``."""
    models.compare(rows)
    by = {(r["model"], r["batch"], r["impl"]): r for r in rows}
    for row in rows:
        base = by.get((row["model"], row["batch"], row.get("baseline")), {})
        if row.get("graph_ms") and base.get("graph_ms"):
            row["graph_speedup"] = base["graph_ms"] / row["graph_ms"]
    for row in rows:
        key = (row["model"], row["batch"])
        ref = by.get((*key, "pytorch_fp32"), {}).get("loss_curve")
        if ref is None or "loss_curve" not in row or row["impl"] == "pytorch_fp32":
            continue
        row["loss_dev"] = deviation(row["loss_curve"], ref)
        others = ["pytorch_fp32_nobench", "pytorch_fp64"] + (["pytorch_tf32"] if row.get("precision") == "relaxed"
                                                               else [])
        devs = [deviation(by[(*key, o)]["loss_curve"], ref) for o in others if "loss_curve" in by.get((*key, o), {})]
        if devs:
            row["loss_noise"] = noise = max(devs)
            if row["impl"].startswith("convforge"):
                row["within_noise"] = row["loss_dev"] <= max(NOISE_SLACK * noise, NOISE_FLOOR)
    return rows


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("model", "batch", "impl", "class", "step ms", "speed-up", "graph ms", "graph ×", "vs", "final loss",
                "loss dev", "noise", "status"):
        t.add_column(col)
    for r in rows:
        graph = r.get("graph_status", "")
        t.add_row(r["model"], str(r["batch"]), r["impl"], r.get("precision", ""), models._f(r.get("time_ms"), ".3f"),
                  models._f(r.get("speedup"), ".2f"),
                  models._f(r.get("graph_ms"), ".3f") if graph in ("", "ok") else "failed",
                  models._f(r.get("graph_speedup"), ".2f"), r.get("baseline", ""),
                  models._f(r.get("final_loss"), ".4f"),
                  models._f(r.get("loss_dev"), ".1e"), models._f(r.get("loss_noise"), ".1e"), r.get("status", ""))
    return t


def run(specs: list[str], out: str | None, warmup: int | None, repeats: int | None, console: Console,
        options: dict[str, Any], classes: tuple[str, ...] = ("fp32",), tune: bool = False) -> int:
    """``convforge bench --model ... --train``: 2 on bad input or no GPU, 1 when a row failed or a
    convforge loss curve left the noise."""
    parsed = models._check_models(specs, console)
    if parsed is None:
        return 2
    env = models.environment()
    console.print(" | ".join(f"{k} {v}" for k, v in env.items()))
    rows: list[dict[str, Any]] = []
    for name, batch in parsed:
        mine: list[dict[str, Any]] = []
        for i, prec in enumerate(classes):
            mine += bench_train(name, batch, warmup if warmup is not None else 3, repeats or 10,
                                {**options, "precision": prec}, pytorch=i == 0, tune=tune)
        compare(mine)
        rows += mine
        console.print(table(mine, f"{name} N={batch}: one training step, {' and '.join(classes)} class"
                                  f"{'es' if len(classes) > 1 else ''}{', tuned' if tune else ''}"))
    notes = [NOTE, models.CLASS_NOTE, models.TUNED_NOTE if tune else models.UNTUNED_NOTE]
    for note in notes:
        console.print(note)
    if out:
        write(Path(out), env, notes, classes, tune, rows)
        console.print(f"wrote {out}/train.json, train.csv, train_losses.csv")
    failed = any(not str(r.get("status", "")).startswith("ok") and r["impl"] != "-" for r in rows)
    left = any(r.get("within_noise") is False for r in rows)
    return 1 if failed or left else 0


def write(folder: Path, env: dict[str, Any], notes: list[str], classes: tuple[str, ...], tune: bool,
          rows: list[dict[str, Any]]) -> None:
    """train.json (every row with its loss curve), train.csv (one line per row) and
    train_losses.csv (step, then one column per model, batch, impl and class)."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"env": env, "notes": notes, "classes": list(classes), "tuned": tune, "steps": STEPS, "lr": LR,
           "momentum": MOMENTUM, "rows": rows}
    write_atomic(folder / "train.json", json.dumps(doc, indent=1, default=str))
    write_atomic(folder / "train.csv", csv_text(FIELDS, rows))
    curves = [(f"{r['model']}:{r['batch']}:{r['impl']}:{r.get('precision', '')}", r["loss_curve"])
              for r in rows if r.get("loss_curve")]
    steps = [{"step": i + 1, **{name: c[i] if i < len(c) else "" for name, c in curves}}
             for i in range(max((len(c) for _, c in curves), default=0))]
    write_atomic(folder / "train_losses.csv", csv_text(["step", *(name for name, _ in curves)], steps))
