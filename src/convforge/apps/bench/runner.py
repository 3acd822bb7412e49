"""Running a suite: for each layer and precision class, the convforge implementations (chosen by
``convforge.dispatch`` within the class, checked against the float64 reference, then timed) and the
baselines, as one Row per layer x class x implementation. Each class is compared with its own
baseline (``baselines.for_class``), error beside error."""

from __future__ import annotations

import importlib.metadata
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from convforge import dispatch
from convforge.apps.bench import baselines
from convforge.apps.bench.ceilings import Ceilings, measure_copy
from convforge.apps.bench.suites import ABLATIONS, Layer
from convforge.apps.bench.timing import Timing, check_slice, cycle, run_timed
from convforge.backends.base import Backend
from convforge.check import check_plan, pass_inputs
from convforge.dtypes import to_storage
from convforge.params import Params
from convforge.plan import DeviceInfo, Variant
from convforge.spec import ConvSpec
from convforge.version import __version__


@dataclass
class Row:
    """One layer x implementation. Convforge rows carry their precision class, their check and the
    class's baseline they beat (or not), with both measured errors and their ratio; baseline rows carry
    their own precision (fp32, tf32, fp16)."""

    layer: str
    index: int
    impl: str
    backend: str
    algo: str
    precision: str
    time_ms: float | None
    tflops: float | None = None
    pct_peak: float | None = None
    workspace_bytes: int | None = None
    rel_err: float | None = None
    ok: bool | None = None
    status: str = "ok"
    baseline_impl: str = ""
    baseline_algo: str = ""
    baseline_ms: float | None = None
    speedup: float | None = None
    baseline_error: float | None = None
    error_ratio: float | None = None
    flops: int = 0
    min_bytes: int = 0
    gbs: float | None = None  # min_bytes / time: achieved bandwidth (memory-bound depthwise and grouped layers)
    pct_copy: float | None = None  # gbs as % of the measured device-copy ceiling
    # gbs as % of a copy of the layer's own bytes, timed as the layer is (one launch, inputs cold in
    # L2): what a launch of this size reaches (grouped and depthwise layers)
    pct_copy_same: float | None = None
    chosen_by: str = ""
    spec: dict[str, Any] = field(default_factory=dict)
    pct_tc: float | None = None  # % of the tensor-core ceiling of the row's math (half, TF32)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BenchConfig:
    """What to run: algorithms, baseline kind, timing overrides, check slice, seed, precision classes."""

    algos: tuple[str, ...] = ("auto",)
    baseline: str = "none"
    warmup: int | None = None
    repeats: int | None = None
    batch_slice: int | None = None
    seed: int = 0
    precisions: tuple[str, ...] = ("fp32",)


def choose(algo: str, spec: ConvSpec, be: Backend, precision: str = "fp32") -> tuple[Variant, Params, str]:
    """(variant, params, how chosen) for ``--algo`` value ``algo`` in ``precision``'s class, as every
    caller gets it (``convforge.dispatch``): 'auto' takes the class's tuned entry, else the heuristic
    within the class; a family keeps to the class; a variant name runs as named."""
    ch = dispatch.choose(spec, be, algo=algo, precision=precision)
    return ch.variant, ch.params, ch.source


def _flops_row(row: Row, spec: ConvSpec, peak: float | None, tc_peak: float | None = None) -> Row:
    if row.time_ms:
        row.tflops = spec.flops / (row.time_ms * 1e-3) / 1e12
        row.pct_peak = 100.0 * row.tflops / peak if peak else None
        row.pct_tc = 100.0 * row.tflops / tc_peak if tc_peak else None
    return row


def _tc_peak(ceil: Ceilings | None, spec: ConvSpec, precision: str) -> float | None:
    """The tensor-core ceiling of a row: its half dtype's, TF32's for a relaxed float32 row."""
    if ceil is None:
        return None
    tag = {"fp16": "float16", "bf16": "bfloat16", "tf32": "tf32"}.get(precision)
    return ceil.tc_tflops.get(tag) if tag else ceil.tc_peak(spec.dtype, precision)


def _input_sets(be: Backend, spec: ConvSpec, timing: Timing, seed: int) -> list[dict[str, Any]]:
    """``timing.sets`` fresh input pairs of the layer's pass (fprop x, w; dgrad dy, w; wgrad x, dy)
    on the device, sharing one output buffer (``spec.output``)."""
    rng = np.random.default_rng(seed + 1)
    out_buf = be.empty(spec.itemsize * int(np.prod(spec.shape_of(spec.output))))
    out = []
    for _ in range(timing.sets):
        bufs = {name: be.upload(to_storage(a, spec.dtype)) for name, a in pass_inputs(spec, rng).items()}
        out.append({**bufs, spec.output: out_buf})
    return out


def run_convforge(layer: Layer, index: int, be: Backend, algo: str, cfg: BenchConfig,
                  timing: Timing, peak: float | None,
                  pick: tuple[Variant, Params] | None = None, precision: str = "fp32",
                  tc_peak: float | None = None) -> Row:
    """Check then time one convforge implementation in ``precision``'s class; failures become rows,
    never exceptions. The executable is ``convforge.dispatch``'s, as conv2d runs it.

    ``pick`` fixes the variant and parameters (ablations) instead of choosing by ``algo``."""
    spec = layer.spec
    base: dict[str, Any] = dict(layer=layer.name, index=index, impl=f"convforge:{algo}",
                                backend=be.name, precision=precision, flops=spec.flops, spec=spec.to_dict())
    try:
        if pick:
            variant, params, how = (*pick, "ablation")
            plan = variant.plan(spec, params, be.device)
            exe = be.executable(plan)
        else:
            variant, params, how = choose(algo, spec, be, precision)
            if precision == "fp32" and variant.precision != "fp32":  # a variant named explicitly
                how = f"{how}, {variant.precision}-class variant"
            plan = variant.plan(spec, params, be.device)
            exe = dispatch.executable(spec, be, algo=algo, precision=precision)
    except Exception as err:  # noqa: BLE001 - no variant, or a compile error: report it
        return Row(**base, algo="-", time_ms=None, ok=False, status=f"error: {str(err)[:200]}")
    row = Row(**base, algo=plan.describe(), time_ms=None, workspace_bytes=plan.workspace_bytes,
              chosen_by=how)
    try:
        bs = cfg.batch_slice if cfg.batch_slice is not None else (
            1 if not be.device.is_gpu else check_slice(spec))
        chk = check_plan(plan, be, cfg.seed, exe=exe, batch_slice=bs)
        row.rel_err, row.ok = chk.rel_err, chk.ok
        row.status = "ok" if chk.ok else f"FAIL ({chk})"
        it = cycle(_input_sets(be, spec, timing, cfg.seed))
        row.time_ms = run_timed(lambda: exe.call(next(it)), be.synchronize, be.time_ms, timing)
    except Exception as err:  # noqa: BLE001 - a launch failure is a result too
        row.ok, row.status = False, f"error: {str(err)[:200]}"
    return _flops_row(row, spec, peak, tc_peak)


def baseline_rows(layer: Layer, index: int, results: list[baselines.BaselineResult],
                  peak: float | None, ceil: Ceilings | None = None) -> list[Row]:
    spec = layer.spec
    out = []
    for r in results:
        row = Row(layer.name, index, r.impl, "torch", r.algo, r.precision, r.time_ms,
                  workspace_bytes=r.workspace_bytes, rel_err=r.rel_err, status=r.status,
                  flops=spec.flops, spec=spec.to_dict())
        out.append(_flops_row(row, spec, peak, _tc_peak(ceil, spec, r.precision)))
    return out


def error_ratio(err: float | None, baseline_err: float | None) -> float | None:
    """convforge's relative L2 error over the baseline's (None when either is missing or the baseline's
    is 0: a ratio to an exact result says nothing)."""
    if err is None or baseline_err is None or not baseline_err > 0:
        return None
    return err / baseline_err


def attach_baseline(rows: list[Row], ref: baselines.BaselineResult | None) -> None:
    """Fill the baseline columns, speed-up and error ratio of convforge rows."""
    if ref is None:
        return
    for row in rows:
        row.baseline_impl, row.baseline_algo, row.baseline_ms = ref.impl, ref.algo, ref.time_ms
        row.baseline_error = ref.rel_err
        row.error_ratio = error_ratio(row.rel_err, ref.rel_err)
        if row.time_ms and ref.time_ms:
            row.speedup = ref.time_ms / row.time_ms


def bench_layer(layer: Layer, index: int, bes: list[Backend], cfg: BenchConfig,
                ceilings: dict[str, Ceilings], baseline_on_gpu: bool) -> list[Row]:
    """All rows of one layer: convforge in every precision class on every back-end and algorithm,
    then the baselines (run once for all classes); each class's rows get that class's baseline."""
    from convforge.apps.bench.timing import layer_bytes

    spec = layer.spec
    rows: list[Row] = []
    for precision in cfg.precisions:
        for be in bes:
            timing = Timing.for_layer(spec, be.device, cfg.warmup, cfg.repeats)
            peak = ceilings[be.name].ffma_tflops if be.name in ceilings else None
            tc = _tc_peak(ceilings.get(be.name), spec, precision)
            seen: set[str] = set()
            for algo in cfg.algos:
                row = run_convforge(layer, index, be, algo, cfg, timing, peak, precision=precision, tc_peak=tc)
                if row.algo != "-" and row.algo in seen:
                    continue  # 'auto' and an explicit family picked the same variant
                seen.add(row.algo)
                rows.append(row)
    timing = Timing.for_layer(spec, bes[0].device, cfg.warmup, cfg.repeats)
    peak0 = ceilings[bes[0].name].ffma_tflops if bes[0].name in ceilings else None
    results = baselines.run(cfg.baseline, spec, timing, baseline_on_gpu, cfg.precisions)
    for precision in cfg.precisions:
        attach_baseline([r for r in rows if r.precision == precision],
                        baselines.for_class(results, precision, spec.dtype))
    rows += baseline_rows(layer, index, results, peak0, ceilings.get(bes[0].name))
    same = same_size_copy(spec, bes, cfg) if spec.groups > 1 else {}
    for row in rows:
        row.min_bytes = layer_bytes(spec)
        ceil = ceilings.get(row.backend) or ceilings.get(bes[0].name)
        bandwidth(row, ceil.copy_gbs if ceil else None, same.get(row.backend) or same.get(bes[0].name))
    return rows


def same_size_copy(spec: ConvSpec, bes: list[Backend], cfg: BenchConfig) -> dict[str, float]:
    """GB/s of the copy kernel moving the layer's own bytes (half read, half written) per launch,
    cycling as many buffer sets as the layer's timing does, per back-end: a small layer's ceiling."""
    from convforge.apps.bench.timing import layer_bytes

    out = {}
    for be in bes:
        t = Timing.for_layer(spec, be.device, cfg.warmup, cfg.repeats)
        out[be.name] = measure_copy(be, t.warmup, t.repeats, nbytes=max(1, layer_bytes(spec) // 2), sets=t.sets)[0]
    return out


def bandwidth(row: Row, copy_gbs: float | None, same_gbs: float | None = None) -> Row:
    """Achieved GB/s (input + filters + output, each once, over the time), its share of the measured
    device-copy bandwidth (the figure of merit of memory-bound layers) and of a copy of the same
    bytes timed the same way (``same_gbs``: what a launch of that size reaches)."""
    if row.time_ms and row.min_bytes:
        row.gbs = row.min_bytes / (row.time_ms * 1e-3) / 1e9
        row.pct_copy = 100.0 * row.gbs / copy_gbs if copy_gbs else None
        row.pct_copy_same = 100.0 * row.gbs / same_gbs if same_gbs else None
    return row


def run_suite(layers: list[Layer], bes: list[Backend], cfg: BenchConfig,
              ceilings: dict[str, Ceilings], baseline_on_gpu: bool,
              on_layer: Callable[[int, Layer], None] | None = None) -> list[Row]:
    """Rows of every layer in order; ``on_layer`` is told which layer starts (progress bars)."""
    rows: list[Row] = []
    for i, layer in enumerate(layers):
        if on_layer:
            on_layer(i, layer)
        rows += bench_layer(layer, i + 1, bes, cfg, ceilings, baseline_on_gpu)
    return rows


# -- ablations (bench/suites.py ABLATIONS) -------------------------------------------------
def ablation_points(name: str, spec: ConvSpec, device: DeviceInfo) -> list[tuple[str, Variant, Params]]:
    """(label, variant, params) of each configuration of ablation ``name`` on ``spec``."""
    from convforge.kernels import get_variant

    vname, configs = ABLATIONS[name]
    variant = get_variant(vname)
    default = variant.default(spec, device)
    return [(label, variant, default.replace(**over)) for label, over in configs]


def run_ablation(name: str, layers: list[Layer], be: Backend, cfg: BenchConfig,
                 ceilings: dict[str, Ceilings],
                 on_layer: Callable[[int, Layer], None] | None = None) -> list[Row]:
    """One row per layer x configuration of ablation ``name`` (checked, then timed)."""
    rows: list[Row] = []
    peak = ceilings[be.name].ffma_tflops if be.name in ceilings else None
    for i, layer in enumerate(layers):
        if on_layer:
            on_layer(i, layer)
        timing = Timing.for_layer(layer.spec, be.device, cfg.warmup, cfg.repeats)
        for label, variant, params in ablation_points(name, layer.spec, be.device):
            row = run_convforge(layer, i + 1, be, f"{name}[{label}]", cfg, timing, peak,
                                pick=(variant, params))
            row.algo = f"{label}: {row.algo}" if row.algo != "-" else f"{label}: -"
            rows.append(row)
    return rows


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def environment(bes: list[Backend], baseline: str) -> dict[str, Any]:
    """Device, driver and library versions printed at the top and written with every row."""
    dev = bes[0].device
    env: dict[str, Any] = {
        "device": dev.name, "driver": dev.driver, "platform": dev.platform,
        "backends": ",".join(b.name for b in bes), "convforge": __version__,
        "numpy": np.__version__, "python": platform.python_version(),
        "pyopencl": _dist_version("pyopencl"),
        "cupy": next((v for v in (_dist_version(n) for n in ("cupy-cuda13x", "cupy-cuda12x", "cupy"))
                      if v), ""),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if baseline != "none":
        env.update(baselines.versions())
    else:
        env.update({"torch": _dist_version("torch"), "cudnn": ""})
    for be in bes[1:]:
        env[f"device_{be.name}"] = be.device.name
        env[f"driver_{be.name}"] = be.device.driver
    return env
