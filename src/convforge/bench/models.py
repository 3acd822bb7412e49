"""``convforge bench --model NAME[:BATCH]``: whole torchvision models, random weights, FP32.

Weights: torchvision's own random init is not signal-preserving (GoogLeNet's truncated normal with
std 0.01 makes activations vanish, so its output is the classifier bias and every error is the same
~1e-10), so after building a model every conv and linear weight is re-drawn from a fan-in scaled
normal (Kaiming, ReLU gain: std = sqrt(2 / fan_in)), biases from N(0, 0.01^2), and every batch-norm
layer gets weight 1, bias 0, running mean 0, running variance 1 (the identity in eval mode), from
a CPU generator with a fixed seed (``SEED``). One model is built and copied, so the PyTorch runs,
the float64 reference and the converted model all use the SAME weights. Per model the reference
output's spread over inputs is printed (``spread``: how much the float64 output changes between
samples of the batch, or for N=1 against a second random input, relative to its norm), and rows are
flagged when it is tiny (< ``MIN_SPREAD``): an output that does not depend on the input (e.g. only
the classifier bias) makes every relative error small and meaningless. ``err / PyTorch`` is each
row's error over PyTorch FP32's (the issue's target: within 2x).

Per model: the forward time of PyTorch FP32 eager (cudnn.benchmark on, TF32 off), PyTorch FP32
replayed from a CUDA graph, PyTorch TF32, ``torch.compile`` FP32, the model converted by
``convforge.torch.convert`` run eagerly and from a CUDA graph, and the model rewritten by
``convforge.torch.fuse`` (batch norm folded into the filters, bias + residual + ReLU in the conv's
epilogue: ``convforge_fused``) eagerly and from a CUDA graph; each output's relative L2 error
against a float64 run of the same model on the GPU. CUDA events, warm-up first, median of repeats.
The converted figures exclude filter transforms (made once per weight version on the warm-up
call, as an inference runtime does); per-layer suites still time them (BENCHMARKING.md).
"""

from __future__ import annotations

import copy
import csv
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

MODELS = {"resnet18": 224, "resnet50": 224, "vgg16": 224, "googlenet": 224, "alexnet": 224, "inception_v3": 299}
FIELDS = ("model", "batch", "impl", "time_ms", "speedup", "rel_err", "err_vs_pytorch", "ref_spread", "status",
          "converted", "left_to_pytorch")
SEED = 0
MIN_SPREAD = 1e-3
NOTE = ("convforge figures exclude filter transforms (made once per weight version, outside the timed "
        "region); PyTorch runs cudnn.benchmark with TF32 off unless the row says TF32; weights: Kaiming-normal "
        f"(ReLU gain) conv/linear weights, N(0, 0.01^2) biases, identity batch norm, seed {SEED}, the same "
        "weights on every side; rel err is against a float64 run of the same model")


def parse_model(text: str) -> tuple[str, int]:
    """'resnet50:32' -> ('resnet50', 32); the batch defaults to 1."""
    name, _, batch = text.partition(":")
    if name not in MODELS:
        raise ValueError(f"model ({name!r}) must be one of {', '.join(MODELS)}")
    try:
        n = int(batch) if batch else 1
    except ValueError:
        raise ValueError(f"batch in --model {text!r} must be an int") from None
    if n <= 0:
        raise ValueError(f"batch in --model {text!r} must be > 0")
    return name, n


def build(name: str) -> Any:
    """A torchvision model with random weights on the GPU in eval mode, or a str saying why not."""
    try:
        import torchvision
    except ImportError:
        return "torchvision is not installed"
    ctor = getattr(torchvision.models, name, None)
    if ctor is None:
        return f"{name} is missing from torchvision {torchvision.__version__}"
    kw: dict[str, Any] = {"weights": None}
    if name in ("googlenet", "inception_v3"):
        kw.update(aux_logits=False, init_weights=True)
    model = ctor(**kw)
    reinit(model, SEED)
    return model.cuda().eval()


def reinit(model: Any, seed: int) -> None:
    """Signal-preserving random weights (see the module docstring), drawn on the CPU from ``seed``."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d | torch.nn.Linear):
                fan_in = m.weight[0].numel()
                m.weight.normal_(0.0, math.sqrt(2.0 / fan_in), generator=g)
                if m.bias is not None:
                    m.bias.normal_(0.0, 0.01, generator=g)
            elif isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                if m.weight is not None:
                    m.weight.fill_(1.0)
                    m.bias.fill_(0.0)
                if m.running_mean is not None and m.running_var is not None:
                    m.running_mean.zero_()
                    m.running_var.fill_(1.0)


def spread(model64: Any, x64: Any, y64: Any) -> float:
    """||y - y'|| / ||y|| for outputs of different inputs: near 0 when the output ignores its input.
    Batches compare each sample with the batch mean; N=1 runs a second random input."""
    import torch

    if y64.shape[0] > 1:
        other = y64.mean(0, keepdim=True).expand_as(y64)
    else:
        g = torch.Generator(device=x64.device).manual_seed(SEED + 1)
        other = model64(torch.randn(x64.shape, device=x64.device, generator=g, dtype=torch.float64))
    return float((y64 - other).norm() / (y64.norm() + 1e-300))


def time_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median of CUDA-event times of single calls, after warm-up."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(model: Any, x: Any, warmup: int) -> tuple[Callable[[], Any], Any]:
    """(replay, static output) of ``model(x)`` captured in a CUDA graph after warm-up on a side stream."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 2)):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(x)
    return graph.replay, out


def _tf32(on: bool) -> None:
    import torch

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = on
    torch.backends.cuda.matmul.allow_tf32 = on


def bench_model(name: str, batch: int, warmup: int, repeats: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per implementation of one model."""
    import torch

    import convforge.torch as ct

    model = build(name)
    if isinstance(model, str):
        return [dict(model=name, batch=batch, impl="-", status=model)]
    size = MODELS[name]
    x = torch.randn(batch, 3, size, size, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        model64 = copy.deepcopy(model).double()
        want = model64(x.double())
        spread_ = spread(model64, x.double(), want)
        del model64
    flag = f"degenerate: reference spread {spread_:.1e} < {MIN_SPREAD:g}" if spread_ < MIN_SPREAD else ""
    conv = copy.deepcopy(model)
    report = ct.convert(conv, **options)
    reports: dict[str, Any] = {}
    runs: list[tuple[str, Callable[[], Callable[[], Any]], bool]] = [
        ("pytorch_fp32", lambda: lambda: model(x), False),
        ("pytorch_fp32_graph", lambda: _replay(model, x, warmup), False),
        ("pytorch_tf32", lambda: lambda: model(x), True),
        ("torch_compile_fp32", lambda: _compiled(model, x), False),
        ("convforge", lambda: lambda: conv(x), False),
        ("convforge_graph", lambda: _replay(conv, x, warmup), False),
        *_fused_runs(model, x, warmup, options, reports),
    ]
    rows = []
    for impl, make, tf32 in runs:
        _tf32(tf32)
        row: dict[str, Any] = dict(model=name, batch=batch, impl=impl, status="ok", ref_spread=spread_)
        try:
            with torch.no_grad():
                fn = make()
                y = fn()
                row["time_ms"] = time_ms(fn, warmup, repeats)
                y = fn()
                torch.cuda.synchronize()
            row["rel_err"] = float((y.double() - want).norm() / want.norm())
            if flag:
                row["status"] = f"ok ({flag})"
        except Exception as err:  # noqa: BLE001 - one failing implementation must not hide the others
            row["status"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        if impl.startswith("convforge"):
            rep = reports.get(impl, report)
            row["converted"], row["left_to_pytorch"] = len(rep.converted), "; ".join(
                f"{k}: {v}" for k, v in {**rep.left, **getattr(rep, "unfused", {})}.items())
        rows.append(row)
    _tf32(False)
    base = rows[0]
    for row in rows:
        if row.get("time_ms") and base.get("time_ms"):
            row["speedup"] = base["time_ms"] / row["time_ms"]
        if row.get("rel_err") is not None and base.get("rel_err"):
            row["err_vs_pytorch"] = row["rel_err"] / base["rel_err"]
    return rows


def _fused_runs(model: Any, x: Any, warmup: int, options: dict[str, Any],
                reports: dict[str, Any]) -> list[tuple[str, Callable[[], Callable[[], Any]], bool]]:
    """The ``convforge_fused`` rows: ``model`` rewritten by ``convforge.torch.fuse`` (parameters
    shared, ``model`` unchanged), eager and replayed from a CUDA graph; their report in ``reports``."""
    import convforge.torch as ct

    try:
        fused, report = ct.fuse(model, **options)
    except Exception as err:  # noqa: BLE001 - the rows say it failed; the other rows still run
        def fail(err: Exception = err) -> Callable[[], Any]:
            raise err

        return [("convforge_fused", fail, False), ("convforge_fused_graph", fail, False)]
    reports["convforge_fused"] = reports["convforge_fused_graph"] = report
    return [("convforge_fused", lambda: lambda: fused(x), False),
            ("convforge_fused_graph", lambda: _replay(fused, x, warmup), False)]


def _replay(model: Any, x: Any, warmup: int) -> Callable[[], Any]:
    replay, out = graphed(model, x, warmup)

    def run() -> Any:
        replay()
        return out

    return run


def _compiled(model: Any, x: Any) -> Callable[[], Any]:
    import torch

    compiled = torch.compile(model)
    return lambda: compiled(x)


def environment() -> dict[str, Any]:
    import torch

    from convforge import __version__

    try:
        import torchvision

        tv = torchvision.__version__
    except ImportError:
        tv = ""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "torchvision": tv,
            "cudnn": torch.backends.cudnn.version(), "convforge": __version__}


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("model", "batch", "impl", "time ms", "speed-up", "rel err", "err / PyTorch", "status"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["model"], str(r["batch"]), r["impl"], _f(r.get("time_ms"), ".3f"), _f(r.get("speedup"), ".2f"),
                  _f(r.get("rel_err"), ".2e"), _f(r.get("err_vs_pytorch"), ".2f"), r.get("status", ""))
    return t


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per model: the reference's spread and each convforge row's error over PyTorch FP32's."""
    if not rows or rows[0].get("ref_spread") is None:
        return ""
    sp = rows[0]["ref_spread"]
    parts = [f"reference spread {sp:.2e}" + (" [red](tiny: errors are not meaningful)[/]" if sp < MIN_SPREAD else "")]
    parts += [f"{r['impl']} err / PyTorch FP32 err = {_f(r.get('err_vs_pytorch'), '.2f')}"
              for r in rows if r["impl"].startswith("convforge")]
    return "; ".join(parts)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def run(specs: list[str], out: str | None, warmup: int | None, repeats: int | None, console: Console,
        options: dict[str, Any]) -> int:
    """``convforge bench --model ...``: exit status 2 on bad input or no GPU, 1 when a run failed."""
    try:
        models = [parse_model(s) for s in specs]
    except ValueError as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    try:
        import torch
    except ImportError:
        console.print("[red]error:[/] --model needs PyTorch and torchvision (pip install torch torchvision)")
        return 2
    if not torch.cuda.is_available():
        console.print("[red]error:[/] --model runs on a CUDA device; torch sees none")
        return 2
    env = environment()
    console.print(" | ".join(f"{k} {v}" for k, v in env.items()))
    rows: list[dict[str, Any]] = []
    for name, batch in models:
        rows += bench_model(name, batch, warmup if warmup is not None else 5, repeats or 20, options)
        mine = [r for r in rows if r["model"] == name and r["batch"] == batch]
        console.print(table(mine, f"{name} N={batch}"))
        console.print(summary(mine))
    console.print(NOTE)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "models.json").write_text(json.dumps({"env": env, "notes": [NOTE], "rows": rows}, indent=1))
        with open(folder / "models.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        console.print(f"wrote {folder}/models.json, models.csv")
    return 1 if any(not str(r.get("status", "")).startswith("ok") and r["impl"] != "-" for r in rows) else 0
