"""``convforge bench --model NAME[:BATCH]``: whole torchvision models, random weights, FP32.

Weights: torchvision's own random init is not signal-preserving (GoogLeNet's truncated normal with std
0.01 makes activations vanish, so its output is the classifier bias and every error is the same ~1e-10),
so after building a model every conv and linear weight is re-drawn from a fan-in scaled normal (Kaiming,
ReLU gain: std = sqrt(2 / fan_in)), biases from N(0, 0.01^2), and every batch-norm layer gets weight 1,
bias 0, running mean 0, running variance 1 (the identity in eval mode), from a CPU generator with a
fixed seed (``SEED``); ConvNeXt's per-block layer scale (1e-6 at init, which would make every block an
identity and its depthwise conv's error invisible) is set to 1. One model is built and copied, so the
PyTorch runs, the float64 reference and the converted model all use the SAME weights. Per model the
reference output's spread over inputs is printed (``spread``: how much the float64 output changes
between samples of the batch, or for N=1 against a second random input, relative to its norm), and rows
are flagged when it is tiny (< ``MIN_SPREAD``): an output that does not depend on the input (e.g. only
the classifier bias) makes every relative error small and meaningless. ``err / PyTorch`` is each row's
error over PyTorch FP32's (the issue's target: within 2x).

Per model: the forward time of PyTorch FP32 eager (cudnn.benchmark on, TF32 off), PyTorch FP32
replayed from a CUDA graph, PyTorch TF32, ``torch.compile`` FP32, the model converted by
``convforge.torch.convert`` run eagerly and from a CUDA graph, and the model rewritten by
``convforge.torch.fuse`` (batch norm folded into the filters, bias + residual + ReLU in the conv's
epilogue: ``convforge_fused``) eagerly and from a CUDA graph; each output's relative L2 error
against a float64 run of the same model on the GPU. CUDA events, warm-up first, median of repeats.
The converted figures exclude filter transforms (made once per weight version on the warm-up
call, as an inference runtime does); per-layer suites still time them (docs/MEASURING.md).

Precision classes (``--precision fp32|relaxed|both``): the convforge rows of a class convert with
``precision=`` that class and are compared with the class's baseline, ``pytorch_fp32`` (TF32 off)
for fp32 and ``pytorch_tf32`` for relaxed (docs/MEASURING.md); every row carries ``precision`` and
``baseline``, and ``speedup`` / ``err_vs_pytorch`` are against that baseline row (the PyTorch rows
are run once and shared by both classes). ``--tune`` turns ``config.autotune`` on around each
convforge model's first (warm-up) call, so dispatch tunes every layer with its real epilogue in the
row's class into the database before anything is timed.

``--error-budget R``: before the fused rows are timed, ``convforge.torch.calibrate`` sets the fewest
of the fused model's layers to ``max_error=5e-7`` (``calibrate.TIGHT``) that bring its output error
within 0.95 x R x the class baseline's, measured on a SEPARATE random input (seed ``CAL_SEED``, never the input the rows
report on); the fused rows then carry ``error_budget``, ``tightened`` (how many layers moved),
``budget_met`` and, in the JSON, the whole calibration report. Without it nothing changes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from convforge.config import config
from convforge.error_budget import TIGHT
from convforge.files import csv_text, write_atomic

MODELS = {"resnet18": 224, "resnet50": 224, "vgg16": 224, "googlenet": 224, "alexnet": 224, "inception_v3": 299,
          # modern CNNs: grouped (ResNeXt, RegNet) and depthwise (MobileNet, EfficientNet, ShuffleNet, ConvNeXt)
          # layers, and DenseNet's BN -> ReLU -> conv
          "resnext50_32x4d": 224, "regnet_y_1_6gf": 224, "mobilenet_v2": 224, "mobilenet_v3_large": 224,
          "convnext_tiny": 224, "densenet121": 224, "efficientnet_b0": 224, "shufflenet_v2_x1_0": 224}
FIELDS = ("model", "batch", "impl", "precision", "baseline", "time_ms", "speedup", "rel_err", "err_vs_pytorch",
          "ref_spread", "status", "converted", "left_to_pytorch", "tuned")
BASELINES = {"fp32": "pytorch_fp32", "relaxed": "pytorch_tf32"}  # each class's PyTorch baseline row
PYTORCH_CLASS = {"pytorch_fp32": "fp32", "pytorch_fp32_graph": "fp32", "torch_compile_fp32": "fp32",
                 "pytorch_tf32": "relaxed"}
SEED = 0
CAL_SEED = SEED + 2  # the calibration input's seed (SEED + 1 is the spread's second input)
BUDGET_FIELDS = ("error_budget", "tightened", "budget_met")
MIN_SPREAD = 1e-3
NOTE = ("convforge figures exclude filter transforms (made once per weight version, outside the timed "
        "region); PyTorch runs cudnn.benchmark with TF32 off unless the row says TF32; weights: Kaiming-normal "
        f"(ReLU gain) conv/linear weights, N(0, 0.01^2) biases, identity batch norm, seed {SEED}, the same "
        "weights on every side; rel err is against a float64 run of the same model")
CLASS_NOTE = ("speed-up and err / baseline are against the row's class baseline: pytorch_fp32 (TF32 off) for "
              "the fp32 class, pytorch_tf32 for the relaxed class (convforge converted with precision=relaxed, "
              "its PyTorch ops with TF32)")
TUNED_NOTE = ("convforge figures are TUNED: every layer tuned in its row's precision class into the database "
              "(config.autotune on the warm-up call, each layer with its real epilogue) before timing")
BUDGET_NOTE = ("convforge_fused rows are CALIBRATED (--error-budget {r:g}): the fewest layers set to "
               f"max_error={TIGHT:g} that bring the output error within 0.95 x {{r:g}}x the class baseline's on a "
               "separate "
               f"random input (seed {CAL_SEED}); rel err is measured on the reported input (seed {SEED})")
UNTUNED_NOTE = ("convforge figures are not tuned in this run: each layer uses the tuning database's entry where "
                "it has one (--tune to tune first), else the heuristic")


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
            scale = getattr(m, "layer_scale", None)  # ConvNeXt's blocks: 1e-6 at init would hide the branch
            if isinstance(scale, torch.nn.Parameter):
                scale.fill_(1.0)


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


def bench_model(name: str, batch: int, warmup: int, repeats: int, options: dict[str, Any], *,
                pytorch: bool = True, tune: bool = False, error_budget: float | None = None) -> list[dict[str, Any]]:
    """One row per implementation of one model; ``pytorch=False`` runs only the convforge rows (a
    second precision class sharing the first's PyTorch rows); ``tune``: see :func:`tuning`;
    ``error_budget``: the fused rows are calibrated first (module docstring)."""
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
        *_fused_runs(model, x, warmup, options, reports, error_budget),
    ]
    runs = [run for run in runs if pytorch or run[0].startswith("convforge")]
    # the PyTorch ops a convforge row leaves in the model (linear layers, norms) run in the row's class:
    # TF32 matmuls in the relaxed class, as pytorch_tf32 runs them, FP32 otherwise
    relaxed = (options.get("precision") or config.precision) == "relaxed"
    rows = []
    for impl, make, tf32 in runs:
        _tf32(tf32 or (relaxed and impl.startswith("convforge")))
        row: dict[str, Any] = dict(model=name, batch=batch, impl=impl, status="ok", ref_spread=spread_)
        try:
            with torch.no_grad():
                with tuning(tune and impl.startswith("convforge")):
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
        if error_budget is not None and impl.startswith("convforge_fused"):
            budget_fields(row, error_budget, reports.get("calibration"))
        rows.append(row)
    _tf32(False)
    label(rows, options, tune)
    return compare(rows)


def bench_classes(name: str, batch: int, warmup: int, repeats: int, options: dict[str, Any],
                  classes: tuple[str, ...], tune: bool = False, error_budget: float | None = None,
                  ) -> list[dict[str, Any]]:
    """The PyTorch rows once, then the convforge rows of each precision class, compared."""
    rows: list[dict[str, Any]] = []
    extra = {} if error_budget is None else {"error_budget": error_budget}
    for i, prec in enumerate(classes):
        rows += bench_model(name, batch, warmup, repeats, {**options, "precision": prec}, pytorch=i == 0,
                            tune=tune, **extra)
    return compare(rows)


def budget_fields(row: dict[str, Any], error_budget: float, cal: Any) -> None:
    """A fused row's ``error_budget`` and what its calibration did (``tightened``, ``budget_met``,
    the whole report in ``calibration``); a failed calibration fails the row itself."""
    row["error_budget"] = error_budget
    if cal is None or isinstance(cal, Exception):
        return
    row["tightened"], row["budget_met"], row["calibration"] = len(cal.tightened), cal.met, cal.as_dict()


def label(rows: list[dict[str, Any]], options: dict[str, Any], tuned: bool = False) -> None:
    """Give each row its precision class and baseline: PyTorch rows by their math, convforge rows
    (and any other impl) by the class they converted with."""
    from convforge.config import config

    prec = options.get("precision") or config.precision
    for row in rows:
        cls = PYTORCH_CLASS.get(row["impl"], prec)
        row.setdefault("precision", cls)
        row.setdefault("baseline", BASELINES[cls])
        if row["impl"] not in PYTORCH_CLASS and row["impl"] != "-":
            row.setdefault("tuned", tuned)


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill ``speedup`` (baseline time / row time) and ``err_vs_pytorch`` (row error / baseline
    error) from each row's baseline row of the same model and batch; rows whose baseline did not
    run (or failed) get neither. Returns ``rows``."""
    runs = {(r["model"], r["batch"], r["impl"]): r for r in rows if r["impl"] in PYTORCH_CLASS}
    for row in rows:
        base = runs.get((row["model"], row["batch"], row.get("baseline")))
        if base is None:
            continue
        if row.get("time_ms") and base.get("time_ms"):
            row["speedup"] = base["time_ms"] / row["time_ms"]
        if row.get("rel_err") is not None and base.get("rel_err"):
            row["err_vs_pytorch"] = row["rel_err"] / base["rel_err"]
    return rows


@contextmanager
def tuning(on: bool) -> Iterator[None]:
    """``config.autotune`` on inside (when ``on``), restored afterwards: dispatch tunes every layer
    it has no database entry for on first sight, in the caller's precision class, with its real
    epilogue. Cached choices are dropped on the way in and out, so entries are looked up afresh."""
    from convforge.config import config
    from convforge.tune import clear_choices

    if not on:
        yield
        return
    before = config.autotune
    config.autotune = True
    clear_choices()
    try:
        yield
    finally:
        config.autotune = before
        clear_choices()


def _fused_runs(model: Any, x: Any, warmup: int, options: dict[str, Any], reports: dict[str, Any],
                error_budget: float | None = None) -> list[tuple[str, Callable[[], Callable[[], Any]], bool]]:
    """The ``convforge_fused`` rows: ``model`` rewritten by ``convforge.torch.fuse`` (parameters
    shared, ``model`` unchanged), eager and replayed from a CUDA graph; their report in ``reports``.
    With ``error_budget`` the first row's set-up calibrates the fused model (inside the row's
    tuning context, so the fast choices are the ones the row runs), its report in ``reports``."""
    import convforge.torch as ct

    try:
        fused, report = ct.fuse(model, **options)
    except Exception as err:  # noqa: BLE001 - the rows say it failed; the other rows still run
        def fail(err: Exception = err) -> Callable[[], Any]:
            raise err

        return [("convforge_fused", fail, False), ("convforge_fused_graph", fail, False)]
    reports["convforge_fused"] = reports["convforge_fused_graph"] = report
    if error_budget is None:
        return [("convforge_fused", lambda: lambda: fused(x), False),
                ("convforge_fused_graph", lambda: _replay(fused, x, warmup), False)]
    ready = _calibrator(fused, model, x, error_budget, options.get("precision"), reports)
    return [("convforge_fused", lambda: (ready(), lambda: fused(x))[1], False),
            ("convforge_fused_graph", lambda: (ready(), _replay(fused, x, warmup))[1], False)]


def _calibrator(fused: Any, model: Any, x: Any, budget: float, precision: str | None,
                reports: dict[str, Any]) -> Callable[[], None]:
    """``ready()``: calibrate ``fused`` on its first call, on a random input of ``x``'s shape drawn
    from ``CAL_SEED`` (never ``x`` itself), against the class baseline's error (TF32 for the
    relaxed class); later calls reuse the outcome (a failure is raised again)."""
    import torch

    import convforge.torch as ct
    from convforge.config import config

    def ready() -> None:
        if "calibration" not in reports:
            gen = torch.Generator(device="cuda").manual_seed(CAL_SEED)
            xc = torch.randn(x.shape, device="cuda", generator=gen)
            tf32 = (precision or config.precision) == "relaxed"
            try:
                reports["calibration"] = ct.calibrate(fused, model, xc, budget=budget, tf32=tf32)
            except Exception as err:  # noqa: BLE001 - raised by every row that needs it
                reports["calibration"] = err
        if isinstance(reports["calibration"], Exception):
            raise reports["calibration"]

    return ready


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

    from convforge.version import __version__

    try:
        import torchvision

        tv = torchvision.__version__
    except ImportError:
        tv = ""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "torchvision": tv,
            "cudnn": torch.backends.cudnn.version(), "convforge": __version__}


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("model", "batch", "impl", "class", "time ms", "speed-up", "vs", "rel err", "err / baseline", "status"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["model"], str(r["batch"]), r["impl"], r.get("precision", ""), _f(r.get("time_ms"), ".3f"),
                  _f(r.get("speedup"), ".2f"), r.get("baseline", ""), _f(r.get("rel_err"), ".2e"),
                  _f(r.get("err_vs_pytorch"), ".2f"), r.get("status", ""))
    return t


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per model: the reference's spread and each convforge row's speed-up and error over
    its class baseline's."""
    if not rows or rows[0].get("ref_spread") is None:
        return ""
    sp = rows[0]["ref_spread"]
    parts = [f"reference spread {sp:.2e}" + (" [red](tiny: errors are not meaningful)[/]" if sp < MIN_SPREAD else "")]
    parts += [f"{r['impl']} ({r.get('precision', '?')}) vs {r.get('baseline', '?')}: "
              f"{_f(r.get('speedup'), '.2f')}x, err ratio {_f(r.get('err_vs_pytorch'), '.2f')}" + _budget_text(r)
              for r in rows if r["impl"].startswith("convforge")]
    return "; ".join(parts)


def _budget_text(row: dict[str, Any]) -> str:
    if row.get("error_budget") is None:
        return ""
    if row.get("tightened") is None:
        return f" (error budget {row['error_budget']:g}x: calibration failed)"
    met = "" if row.get("budget_met") else ", NOT met on the calibration input"
    return f" (error budget {row['error_budget']:g}x: {row['tightened']} layer(s) tightened{met})"


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def run(specs: list[str], out: str | None, warmup: int | None, repeats: int | None, console: Console,
        options: dict[str, Any], classes: tuple[str, ...] = ("fp32",), tune: bool = False,
        error_budget: float | None = None) -> int:
    """``convforge bench --model ...`` in float32: exit status 2 on bad input or no GPU, 1 when a run
    failed; ``error_budget``: calibrate the fused rows first (module docstring). A half dtype's rows are
    ``bench.half_models``'."""
    prepared = prepare(specs, console)
    if prepared is None:
        return 2
    models, env = prepared
    notes = [NOTE, CLASS_NOTE, TUNED_NOTE if tune else UNTUNED_NOTE]
    notes += [] if error_budget is None else [BUDGET_NOTE.format(r=error_budget)]
    extra = {} if error_budget is None else {"error_budget": error_budget}
    rows: list[dict[str, Any]] = []
    for name, batch in models:
        rows += bench_classes(name, batch, warmup if warmup is not None else 5, repeats or 20, options, classes,
                              tune, **extra)
        mine = [r for r in rows if r["model"] == name and r["batch"] == batch]
        console.print(table(mine, f"{name} N={batch}: {' and '.join(classes)} class"
                                  f"{'es' if len(classes) > 1 else ''}{', tuned' if tune else ''}"))
        console.print(summary(mine))
    for note in notes:
        console.print(note)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        doc = {"env": env, "notes": notes, "classes": list(classes), "tuned": tune, "rows": rows, **extra}
        write_atomic(folder / "models.json", json.dumps(doc, indent=1))
        write_atomic(folder / "models.csv", csv_text(FIELDS + (BUDGET_FIELDS if extra else ()), rows))
        console.print(f"wrote {folder}/models.json, models.csv")
    return 1 if any(not str(r.get("status", "")).startswith("ok") and r["impl"] != "-" for r in rows) else 0


def prepare(specs: list[str], console: Console) -> tuple[list[tuple[str, int]], dict[str, Any]] | None:
    """(models, environment) of a ``--model`` run, the environment printed; None on bad input or no GPU
    (said on ``console``)."""
    models = _check_models(specs, console)
    if models is None:
        return None
    env = environment()
    console.print(" | ".join(f"{k} {v}" for k, v in env.items()))
    return models, env


def _check_models(specs: list[str], console: Console) -> list[tuple[str, int]] | None:
    """The parsed ``NAME[:BATCH]`` list, or None after printing why the models cannot run here
    (a bad name or batch, no PyTorch, no CUDA device)."""
    try:
        models = [parse_model(s) for s in specs]
    except ValueError as err:
        console.print(f"[red]error:[/] {escape(str(err))}", soft_wrap=True)  # one line, however long
        return None
    from convforge.apps.options import need

    try:
        need("--model", "torch", "torchvision")
    except ValueError as err:
        console.print(f"[red]error:[/] {escape(str(err))}")
        return None
    import torch

    if not torch.cuda.is_available():
        console.print("[red]error:[/] --model runs on a CUDA device; torch sees none")
        return None
    return models


def tune_models(specs: list[str], console: Console, budget: Any = None, how: Any = None, args: Any = None,
                dtype: str = "float32") -> int:
    """``convforge tune --model NAME[:BATCH]``: run each model once, converted (and fused, when
    ``convforge.torch.fuse`` exists), with ``config.autotune`` on in ``config.precision``'s class, so
    dispatch tunes every conv with its real epilogue into the database; print what each chose.
    ``budget`` (a tuner Budget) replaces the autotune budget meanwhile. 2: bad input or no GPU;
    1: a model could not be built or a layer fell back to the heuristic (its tuning failed).
    ``how`` (tune/parallel.py; ``args``: the command's): the layers are first found
    (:func:`discover`), tuned on several devices or torchrun ranks, then the models run as above,
    which finds them in the database (and tunes whatever the discovery missed). ``dtype``: the
    model cast to float16 / bfloat16 first (its layers tuned in that dtype; one process only)."""
    models = _check_models(specs, console)  # before importing torch: without it, one error line
    if models is None:
        return 2
    if how is not None:
        if dtype != "float32":
            console.print("[red]error:[/] tune --model --dtype runs in one process (no --devices / torchrun)")
            return 2
        return _tune_models_parallel(specs, models, console, budget, how, args)
    import torch

    import convforge.tune as tune_pkg
    from convforge.config import config, precision_key

    console.print(f"device {torch.cuda.get_device_name()}; database {config.tuning_db}; class "
                  f"{precision_key()}; budget per layer {budget or tune_pkg.AUTOTUNE_BUDGET}")
    saved, status = tune_pkg.AUTOTUNE_BUDGET, 0
    tune_pkg.AUTOTUNE_BUDGET = budget or saved
    try:
        for name, batch in models:
            status = max(status, _tune_model(name, batch, console, dtype=dtype))
    finally:
        tune_pkg.AUTOTUNE_BUDGET = saved
    return status


def _tune_models_parallel(specs: list[str], models: list[tuple[str, int]], console: Console, budget: Any, how: Any,
                          args: Any) -> int:
    """``tune --model ... --devices`` (or under torchrun): discover, tune the layers across the
    devices (tune/parallel.py, tasks of kind ``auto``: what dispatch does on first sight), then the
    one-process run of :func:`tune_models` (here; on rank 0 under torchrun) prints the tables and
    tunes what the discovery missed, unless a layer killed two workers (it is not retried here)."""
    import torch

    import convforge.tune as tune_pkg
    from convforge.apps.tune import parallel
    from convforge.config import config

    if how.ranks is not None:
        torch.cuda.set_device(how.ranks.local_rank)
    elif how.slots:
        torch.cuda.set_device(int(how.slots[0].label.partition(":")[2]))
    found = discover(models)
    tasks = [parallel.Task(i, f"{spec.short()}{epi.tag()} ({prec if bound is None else f'max_error={bound:g}'})",
                           float(spec.flops), {"kind": "auto", "spec": spec.to_dict(), "epi": dataclasses.asdict(epi),
                                               "precision": prec, "bound": bound, "workspace_limit": limit})
             for i, (spec, epi, prec, bound, limit) in enumerate(found)]
    console.print(f"{', '.join(specs)}: {len(tasks)} distinct layer(s) to tune on {how.describe()}; database "
                  f"{config.tuning_db}; budget per layer {budget or tune_pkg.AUTOTUNE_BUDGET}", markup=False)
    settings = parallel.base_settings(args, budget or tune_pkg.AUTOTUNE_BUDGET, "cuda", config.tuning_db, how)
    run = parallel.execute(tasks, settings, how, console)
    if run.outcomes is None:  # a torchrun rank other than 0: rank 0 runs the models
        return 1 if run.own_failed else 0
    failed = [t for t in tasks if not run.outcomes[t.id].ok]
    known = sum(1 for o in run.outcomes.values() if o.ok and o.reply.get("from_db"))
    console.print(f"{len(tasks) - len(failed) - known} layer(s) tuned, {known} from the database, {len(failed)} "
                  "failed; the models now run once here to show (and complete) the choices", markup=False)
    killers = [t.name for t in failed if len(t.deaths) >= 2]
    if killers:
        console.print(f"not tuned again here (they killed two workers): {', '.join(killers)}; they run the "
                      "heuristic's choice", style="red", markup=False)
    saved = tune_pkg.AUTOTUNE_BUDGET
    tune_pkg.AUTOTUNE_BUDGET = budget or saved
    status = 0
    try:
        for name, batch in models:
            status = max(status, _tune_model(name, batch, console, autotune=not killers))
    finally:
        tune_pkg.AUTOTUNE_BUDGET = saved
    return max(status, int(bool(failed)))


def discover(models: list[tuple[str, int]]) -> list[tuple[Any, Any, str, float | None, int | None]]:
    """(spec, epilogue, precision class, max_error, workspace limit) of every layer dispatch would
    tune when the models' forms (:func:`forms`) run once with autotuning on, in first-seen order,
    without tuning or compiling anything: the models run with PyTorch's convolutions in place of
    convforge's kernels (:func:`discovering`). Database entries are ignored (the workers check
    them), so every process that discovers the same models finds the same list."""
    import torch

    from convforge.config import config

    found: list[tuple[Any, Any, str, float | None, int | None]] = []
    for name, batch in models:
        model = build(name)
        if isinstance(model, str):
            continue  # said by the run that follows
        size = MODELS[name]
        x = torch.randn(batch, 3, size, size, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
        for _, make in forms():
            m = make(copy.deepcopy(model), precision=config.precision)
            with torch.no_grad(), discovering(found):
                m(x)
            del m
        del model, x
    torch.cuda.empty_cache()
    return list(dict.fromkeys(found))


@contextmanager
def discovering(found: list[tuple[Any, Any, str, float | None, int | None]]) -> Iterator[None]:
    """Inside: autotuning on, but dispatch records each layer it would tune in ``found`` (and
    answers the heuristic's choice) instead of tuning it, no database entry serves, and every
    runner dispatch makes computes with PyTorch (no compile, no launch of ours). Everything is
    restored, and the choices made inside forgotten, on the way out."""
    from convforge import dispatch
    from convforge.dispatch import choice

    def tune_now(spec: Any, backend: Any, epi: Any, prec: str, bound: float | None, limit: int | None) -> None:
        found.append((spec, epi, prec, bound, limit))

    def runner(key: Any, spec: Any, backend: Any, epilogue: Any, kind: str, device: int, **kw: Any) -> Any:
        dispatch.choose(spec, backend, epilogue, filters_per_call=kind == "cupy", **kw)  # records the layer
        return _torch_runner(spec, epilogue)

    saved = choice._tune_now, choice._from_db, dispatch.runner
    choice._tune_now, choice._from_db = tune_now, lambda *a, **k: None  # type: ignore[assignment]
    dispatch.runner = runner  # type: ignore[assignment]
    try:
        with tuning(True):
            yield
    finally:
        choice._tune_now, choice._from_db, dispatch.runner = saved  # type: ignore[assignment]


def _torch_runner(spec: Any, epi: Any) -> Callable[..., Any]:
    """A runner (frontends/torch_run.py ``torch_runner``'s signature) computing the layer with PyTorch."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    top, bottom, left, right = spec.pad

    def run(x: Any, w: Any, bias: Any = None, derived: Any = None, res: Any = None) -> Any:
        y = F.conv2d(F.pad(x, (left, right, top, bottom)), w, bias, spec.stride, 0, spec.dilation, spec.groups)
        if res is not None:
            y = y + res
        return y.relu() if epi.relu else F.gelu(y) if epi.gelu else y

    run.filters = None  # type: ignore[attr-defined]
    run.exe = SimpleNamespace(fast=False, native=False)  # type: ignore[attr-defined]  # no native fast path
    return run


def forms() -> list[tuple[str, Callable[..., Any]]]:
    """(name, make(model, **options) -> module) of each convforge form of a model that can be tuned:
    ``converted`` (convforge.torch.convert, in place) and, when that exists, ``fused``
    (convforge.torch.fuse, which returns (module, report))."""
    import convforge.torch as ct

    def converted(model: Any, **options: Any) -> Any:
        ct.convert(model, **options)
        return model

    out: list[tuple[str, Callable[..., Any]]] = [("converted", converted)]
    fuse = getattr(ct, "fuse", None)
    if fuse is not None:
        out.append(("fused", lambda model, **options: fuse(model, **options)[0]))
    return out


def _tune_model(name: str, batch: int, console: Console, autotune: bool = True, dtype: str = "float32") -> int:
    import torch

    from convforge.config import config
    from convforge.dispatch.choice import cached
    from convforge.tune import clear_choices

    model = build(name)
    if isinstance(model, str):
        console.print(f"[red]{name}: {model}[/]")
        return 1
    size = MODELS[name]
    x = torch.randn(batch, 3, size, size, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    model, x = model.to(getattr(torch, dtype)), x.to(getattr(torch, dtype))
    status = 0
    for form, make in forms():
        m = make(copy.deepcopy(model), precision=config.precision)
        with torch.no_grad(), tuning(autotune):
            if not autotune:
                clear_choices()  # so cached() lists this form's choices only
            m(x)
            torch.cuda.synchronize()
            seen = cached()
        console.print(tuned_table(seen, f"{name} N={batch}, {form}: {len(seen)} distinct conv(s)"))
        status = max(status, int(any(ch.source == "heuristic" for *_, ch in seen)))
        del m
    return status


def tuned_table(seen: list[tuple[Any, Any, str, Any]], title: str) -> Table:
    """What tuning chose per distinct (spec, epilogue): variant, parameters, measured error and
    whether it was tuned now, found in the database, or left to the heuristic (tuning failed)."""
    t = Table(title=title)
    for col in ("layer", "epilogue", "class", "variant", "parameters", "rel err", "from"):
        t.add_column(col)
    for spec, epi, prec, ch in seen:
        t.add_row(spec.short(), epi.tag().lstrip("_") or "none", prec, ch.variant.name, ch.params.short(),
                  _f(ch.error, ".1e"), {"db": "database", "tuned": "tuned now"}.get(ch.source, ch.source))
    return t
