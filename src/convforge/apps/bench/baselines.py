"""Baselines, one per precision class: cuDNN-best FP32 (PyTorch's pick with TF32 off and every legacy
cuDNN forward algorithm with FMA math) for the fp32 class, cuDNN-best TF32 (PyTorch's pick with TF32
allowed and every legacy algorithm with default math) for the relaxed class; im2col+cuBLAS and PyTorch
FP16 channels-last as labelled context; PyTorch on the CPU (FP32, there is no TF32 there). A layer
stored in half precision (``spec.dtype`` float16 / bfloat16) has one baseline whatever the class:
cuDNN-best of that dtype, the fastest of PyTorch's pick with NCHW and with channels_last and every
legacy algorithm with tensor-op math and the half data type (NCHW and NHWC), its error against
float64 on the same half inputs. ``tensor_core_peaks`` measures the tensor-core GEMM ceilings.

Each in the layer's pass: fprop through ``F.conv2d`` and the legacy forward algorithms, dgrad and wgrad
through ``aten.convolution_backward`` (PyTorch's pick, one gradient asked for) and the legacy backward
data / backward filter algorithms; errors against a float64 run of the same pass.

This module and ``cudnn.py`` are the only bench files that import torch, and only inside functions:
convforge imports and benchmarks without torch, it just reports that no baseline was available.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from convforge.apps.bench.measured import BaselineResult, rel_err, time_cuda
from convforge.apps.bench.timing import Timing, cycle, median
from convforge.spec import ConvSpec

KINDS = ("cudnn", "torch", "numpy", "none")
CLASSES = ("fp32", "relaxed")  # convforge.config.PRECISIONS, in the order they are reported
# plus every "cudnn:<ALGO>": the candidates of cuDNN-best FP32 (the -cl picks: dgrad layers only)
FP32_IMPLS = ("torch-pick", "torch-pick-cl")
TF32_IMPLS = ("torch-tf32", "torch-tf32-cl")  # plus every "cudnn-tf32:<ALGO>": the candidates of cuDNN-best TF32
BEST = {"fp32": "cudnn-best", "relaxed": "cudnn-best-tf32"}  # each class's baseline row
BASELINE_NAMES = {"fp32": "cuDNN-best FP32", "relaxed": "cuDNN-best TF32"}
HALF_TAGS = {"float16": "fp16", "bfloat16": "bf16"}  # a half dtype's rows: precision and impl names
HALF_BEST = {d: f"cudnn-best-{t}" for d, t in HALF_TAGS.items()}  # a half layer's baseline row, any class
HALF_BASELINE_NAMES = {HALF_BEST[d]: f"cuDNN-best {t.upper()}" for d, t in HALF_TAGS.items()}


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def versions() -> dict[str, str]:
    """torch and cuDNN versions when torch is installed (imports it), else empty strings."""
    if not torch_available():
        return {"torch": "", "cudnn": ""}
    import torch

    cudnn = ""
    try:
        v = torch.backends.cudnn.version()
        cudnn = str(v) if v else ""
    except Exception:  # noqa: BLE001 - a CPU-only build has no cuDNN
        cudnn = ""
    return {"torch": str(torch.__version__), "cudnn": cudnn}


def unavailable(kind: str, backend: str) -> str | None:
    """Why baseline ``kind`` cannot run for ``backend`` (None when it can)."""
    if kind == "none":
        return "no baseline requested"
    if kind == "numpy":
        return None
    if not torch_available():
        return "PyTorch is not installed (pip install 'convforge[torch]'): no baseline available"
    if kind == "cudnn":
        import torch

        if not torch.cuda.is_available():
            return "PyTorch sees no CUDA device: no cuDNN baseline"
    return None


def tf32_note(kind: str, classes: tuple[str, ...]) -> str | None:
    """A warning when the relaxed class's TF32 baseline cannot use TF32: NVIDIA_TF32_OVERRIDE=0 turns
    it off in cuDNN and cuBLAS for the whole process (cuDNN-best TF32 would then be an FP32 figure)."""
    if kind == "none" or "relaxed" not in classes or os.environ.get("NVIDIA_TF32_OVERRIDE") != "0":
        return None
    return "NVIDIA_TF32_OVERRIDE=0: the relaxed class's 'TF32' baseline runs without TF32 (FP32 math)"


def run(kind: str, spec: ConvSpec, timing: Timing, on_gpu: bool,
        classes: tuple[str, ...] = ("fp32",)) -> list[BaselineResult]:
    """Every baseline implementation of ``kind`` on ``spec`` that the precision ``classes`` need
    (empty when none is available)."""
    if kind == "numpy":
        return _numpy_baselines(spec, timing)
    if kind == "none" or not torch_available():
        return []
    if not spec.symmetric_pad:
        return [BaselineResult("torch", "-", "fp32", None, status="asymmetric padding: no baseline")]
    import torch

    if kind == "cudnn" or (kind == "torch" and on_gpu):
        if not torch.cuda.is_available():
            return [BaselineResult(kind, "-", "fp32", None, status="PyTorch sees no CUDA device")]
        if spec.dtype != "float32":
            return _half_baselines(spec, timing, kind == "cudnn")
        return _gpu_baselines(spec, timing, kind == "cudnn", classes)
    if spec.dtype != "float32":
        return [BaselineResult("torch-cpu", "-", HALF_TAGS[spec.dtype], None,
                               status=f"no {spec.dtype} baseline on the CPU")]
    return _cpu_baselines(spec, timing)


def _fastest(results: list[BaselineResult], precision: str, impls: tuple[str, ...], prefix: str,
             name: str) -> BaselineResult | None:
    """The fastest timed result among ``impls`` and the ``prefix``-named cuDNN algorithms, renamed
    ``name`` (None unless at least one cuDNN algorithm row is there: no cuDNN, no cuDNN-best)."""
    if not any(r.impl.startswith(prefix) for r in results):
        return None
    cands = [r for r in results if r.time_ms is not None and r.precision == precision
             and (r.impl in impls or r.impl.startswith(prefix)) and plausible(r)]
    if not cands:
        return None
    win = min(cands, key=lambda r: r.time_ms or 0.0)
    algo = win.impl.removeprefix(prefix) if win.impl.startswith(prefix) else win.algo
    return BaselineResult(name, algo, precision, win.time_ms, win.workspace_bytes, win.rel_err)


# A baseline row whose error against float64 exceeds this is a wrong answer, never cuDNN-best: cuDNN's
# FP32 rows measure 1e-7..1.5e-5 (wgrad's pick), its TF32 rows ~3e-4; a legacy algorithm was seen
# returning garbage (error 1.2).
WRONG = {"fp32": 1e-3, "tf32": 1e-2}


def plausible(r: BaselineResult) -> bool:
    """False when ``r`` measured an error (NaN included) no correct implementation of its class has."""
    if r.rel_err is None:
        return True
    return r.rel_err == r.rel_err and r.rel_err <= WRONG.get(r.precision, 1e-2)


def best_fp32(results: list[BaselineResult]) -> BaselineResult | None:
    """cuDNN-best FP32: the fastest of PyTorch's FP32 pick and every cuDNN algorithm with FMA math."""
    return _fastest(results, "fp32", FP32_IMPLS, "cudnn:", BEST["fp32"])


def best_tf32(results: list[BaselineResult]) -> BaselineResult | None:
    """cuDNN-best TF32: the fastest of PyTorch's TF32 pick and every cuDNN algorithm with default math."""
    return _fastest(results, "tf32", TF32_IMPLS, "cudnn-tf32:", BEST["relaxed"])


def _timed(results: list[BaselineResult], pred: Callable[[BaselineResult], bool]) -> BaselineResult | None:
    return next((r for r in results if r.time_ms is not None and pred(r)), None)


def for_class(results: list[BaselineResult], precision: str, dtype: str = "float32") -> BaselineResult | None:
    """The baseline the ``precision`` class's speed-ups are against.

    fp32: cuDNN-best FP32, else the first FP32 result with a time (PyTorch's pick, PyTorch on the CPU).
    relaxed: cuDNN-best TF32, else PyTorch's TF32 pick; where no TF32 result exists at all (PyTorch on
    a CPU, which has no TF32 mode) the FP32 baseline, whose precision the row then names.
    A layer stored in ``dtype`` float16 / bfloat16: cuDNN-best of that dtype in every class, else the
    first timed result of that dtype."""
    if precision not in CLASSES:
        raise ValueError(f"precision ({precision!r}) must be one of {', '.join(CLASSES)}")
    if dtype in HALF_TAGS:
        return (_timed(results, lambda r: r.impl == HALF_BEST[dtype])
                or _timed(results, lambda r: r.precision == HALF_TAGS[dtype]))
    best = _timed(results, lambda r: r.impl == BEST[precision])
    if best is not None or precision == "fp32":
        return best or _timed(results, lambda r: r.precision == "fp32")
    tf32 = _timed(results, lambda r: r.impl in TF32_IMPLS)
    if tf32 is not None or any(r.precision == "tf32" for r in results):
        return tf32
    return for_class(results, "fp32")


def primary(results: list[BaselineResult]) -> BaselineResult | None:
    """The fp32 class's baseline (kept for callers that know one class)."""
    return for_class(results, "fp32")


# -- torch helpers ------------------------------------------------------------------------------
def _conv_args(spec: ConvSpec) -> dict[str, Any]:
    if not spec.symmetric_pad:
        raise ValueError("PyTorch baselines need symmetric padding")
    return {"stride": spec.stride, "padding": (spec.pad[0], spec.pad[2]), "dilation": spec.dilation,
            "groups": spec.groups}


def pass_fn(spec: ConvSpec) -> Callable[[Any, Any], Any]:
    """PyTorch's computation of ``spec``'s pass from its two inputs (fprop: x, w; dgrad: dy, w;
    wgrad: x, dy): ``F.conv2d``, or ``aten.convolution_backward`` asked for the one gradient (the
    other operand is only a shape to it: an uninitialised tensor of that shape, per dtype and device)."""
    import torch
    import torch.nn.functional as F

    args = _conv_args(spec)
    if spec.conv_pass == "fprop":
        return lambda x, w: F.conv2d(x, w, **args)
    stride, padding, dilation = list(spec.stride), [spec.pad[0], spec.pad[2]], list(spec.dilation)
    shapes: dict[tuple[Any, Any], Any] = {}

    def like(t: Any, shape: tuple[int, ...]) -> Any:
        key = (t.dtype, t.device)
        if key not in shapes:
            shapes[key] = torch.empty(shape, dtype=t.dtype, device=t.device)
        return shapes[key]

    back = torch.ops.aten.convolution_backward.default
    if spec.conv_pass == "dgrad":  # F.conv_transpose2d: a transposed conv's op, cuDNN's backward data as the
        # input gradient's; output_padding restores the input rows a stride > 1 leaves unread
        op = [(spec.h + spec.pad[0] + spec.pad[1] - spec.eff_r) % spec.stride[0],
              (spec.w + spec.pad[2] + spec.pad[3] - spec.eff_s) % spec.stride[1]]
        return lambda dy, w: F.conv_transpose2d(dy, w, None, stride, padding, op, spec.groups, dilation)
    return lambda x, dy: back(dy, x, like(x, spec.w_shape), None, stride, padding, dilation, False, [0, 0],
                              spec.groups, [False, True, False])[1]


def pass_sets(spec: ConvSpec, count: int, device: str = "cuda", seed: int = 0,
              dtype: str = "float32") -> list[tuple[Any, Any]]:
    """``count`` pairs of Uniform(-1, 1) inputs of ``spec``'s pass, in :func:`pass_fn`'s order,
    drawn in float32 and stored as ``dtype``."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {"fprop": (spec.x_shape, spec.w_shape), "dgrad": (spec.y_shape, spec.w_shape),
              "wgrad": (spec.x_shape, spec.y_shape)}[spec.conv_pass]
    tdt = getattr(torch, dtype)
    return [tuple((torch.rand(s, device=device, generator=gen) * 2 - 1).to(tdt) for s in shapes)  # type: ignore[misc]
            for _ in range(count)]


def _peak_extra(fn: Callable[[], Any], out_bytes: int) -> int:
    """Bytes the call allocates beyond its output (workspace seen by torch's allocator)."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - before - out_bytes)


def _torch_variant(name: str, algo: str, precision: str, spec: ConvSpec, sets: list[tuple[Any, Any]],
                   ref: Any, timing: Timing) -> BaselineResult:
    """Time PyTorch's computation of the pass (:func:`pass_fn`) over the rotating input sets under
    the current torch flags."""
    fn = pass_fn(spec)
    it = cycle(sets)
    call = lambda: fn(*next(it))
    try:
        out = fn(*sets[0])
        err = rel_err(out.float(), ref)
        ws = _peak_extra(call, out.numel() * out.element_size())
        ms = time_cuda(call, timing)
    except RuntimeError as exc:
        return BaselineResult(name, algo, precision, None, status=f"failed: {str(exc)[:80]}")
    return BaselineResult(name, algo, precision, ms, ws, err)


def _tf32_switches(torch: Any) -> list[tuple[Any, str, Any, Any]]:
    """(object, attribute, value with TF32 on, value with TF32 off) of cuDNN convolutions' and cuBLAS
    matmuls' TF32 switches: the per-operator ``fp32_precision`` of newer PyTorch where it exists
    (mixing it with the legacy flags raises there), else the legacy ``allow_tf32``."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    mm = torch.backends.cuda.matmul
    if conv is not None and hasattr(conv, "fp32_precision") and hasattr(mm, "fp32_precision"):
        return [(conv, "fp32_precision", "tf32", "ieee"), (mm, "fp32_precision", "tf32", "ieee")]
    return [(torch.backends.cudnn, "allow_tf32", True, False), (mm, "allow_tf32", True, False)]


@contextmanager
def torch_flags() -> Iterator[Callable[..., None]]:
    """A setter of cuDNN's ``enabled`` and ``benchmark`` flags and of TF32 (cuDNN and cuBLAS) for the
    baselines; every flag it may touch is restored on exit, errors included, so a benchmark never
    leaves TF32 or ``cudnn.benchmark`` changed for the rest of the process."""
    import torch

    cudnn = torch.backends.cudnn
    switches = _tf32_switches(torch)
    saved = [(cudnn, "enabled", cudnn.enabled), (cudnn, "benchmark", cudnn.benchmark)]
    saved += [(obj, attr, getattr(obj, attr)) for obj, attr, _on, _off in switches]

    def set_flags(*, tf32: bool, enabled: bool = True, benchmark: bool = True) -> None:
        cudnn.enabled, cudnn.benchmark = enabled, benchmark
        for obj, attr, on, off in switches:
            setattr(obj, attr, on if tf32 else off)

    try:
        yield set_flags
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


def _gpu_baselines(spec: ConvSpec, timing: Timing, with_cudnn: bool,
                   classes: tuple[str, ...]) -> list[BaselineResult]:
    """PyTorch's picks and, ``with_cudnn``, every legacy cuDNN algorithm, in the math each class needs."""
    import torch

    from convforge.apps.bench import cudnn

    sets = pass_sets(spec, timing.sets)
    layout = spec.layout  # an nhwc layer: every baseline gets channels_last tensors, as convforge's kernel does
    if layout == "nhwc":
        sets = [tuple(t.to(memory_format=torch.channels_last) for t in s) for s in sets]  # type: ignore[misc]
    out: list[BaselineResult] = []
    with torch_flags() as set_flags:
        set_flags(tf32=False, benchmark=False)
        ref = pass_fn(spec)(sets[0][0].double(), sets[0][1].double())
        set_flags(tf32=False)
        out.append(_torch_variant("torch-pick", "cudnn.benchmark pick", "fp32", spec, sets, ref, timing))
        cl = _channels_last_sets(spec, sets)
        if cl:
            out.append(_torch_variant("torch-pick-cl", "cudnn.benchmark pick, channels_last", "fp32", spec, cl, ref,
                                      timing))
        if with_cudnn and "fp32" in classes:
            out += cudnn.all_algorithms(spec, sets, ref, timing, math="fma", layout=layout, bound_ms=_fastest_ms(out))
        set_flags(tf32=False, enabled=False)
        out.append(_torch_variant("im2col+cublas", "torch, cuDNN off", "fp32", spec, sets, ref, timing))
        set_flags(tf32=True)
        out.append(_torch_variant("torch-tf32", "cudnn.benchmark pick, TF32", "tf32", spec, sets, ref,
                                  timing))
        if cl:
            out.append(_torch_variant("torch-tf32-cl", "cudnn.benchmark pick, TF32, channels_last", "tf32", spec, cl,
                                      ref, timing))
        if with_cudnn and "relaxed" in classes:
            out += cudnn.all_algorithms(spec, sets, ref, timing, math="default", layout=layout,
                                        bound_ms=_fastest_ms(out, "tf32"))
        set_flags(tf32=False)
        if spec.conv_pass == "fprop":  # half-precision context: the forward pass only
            cl = torch.channels_last
            half = [(x.half().to(memory_format=cl), w.half().to(memory_format=cl)) for x, w in sets]
            out.append(_torch_variant("torch-fp16-cl", "cudnn.benchmark pick, NHWC (context)", "fp16", spec,
                                      half, ref, timing))
    bests = [b for b in (best_fp32(out) if "fp32" in classes else None,
                         best_tf32(out) if "relaxed" in classes else None) if b is not None]
    return bests + out


def _fastest_ms(rows: list[BaselineResult], precision: str | None = None) -> float | None:
    """The fastest time among ``rows`` (of ``precision`` where given) that ran, None where none did: the
    bound below which the cuDNN algorithms that follow are timed in full (``measured.time_cuda``)."""
    times = [r.time_ms for r in rows if r.time_ms is not None and (precision is None or r.precision == precision)]
    return min(times) if times else None


def _channels_last_sets(spec: ConvSpec, sets: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """The input sets in channels_last for a dgrad layer in NCHW (a transposed conv: cuDNN-best of
    ``conv_transpose2d`` is PyTorch's pick in either layout), else none: other passes keep their rows."""
    import torch

    if spec.conv_pass != "dgrad" or spec.layout != "nchw":
        return []
    return [tuple(t.to(memory_format=torch.channels_last) for t in s) for s in sets]  # type: ignore[misc]


def _half_baselines(spec: ConvSpec, timing: Timing, with_cudnn: bool) -> list[BaselineResult]:
    """cuDNN-best of a half dtype in ``spec``'s pass: PyTorch's pick (cudnn.benchmark; F.conv2d or
    aten.convolution_backward) with NCHW and with channels_last tensors and, ``with_cudnn``, every
    legacy algorithm of the pass with tensor-op math on the half data type (NCHW and NHWC); errors
    against float64 on the same half inputs."""
    import torch

    from convforge.apps.bench import cudnn

    tag = HALF_TAGS[spec.dtype]
    sets = pass_sets(spec, timing.sets, dtype=spec.dtype)
    cl = [(a.to(memory_format=torch.channels_last), b.to(memory_format=torch.channels_last)) for a, b in sets]
    out: list[BaselineResult] = []
    with torch_flags() as set_flags:
        set_flags(tf32=False, benchmark=False)
        ref = pass_fn(spec)(sets[0][0].double(), sets[0][1].double())
        set_flags(tf32=False)
        out.append(_torch_variant(f"torch-{tag}", "cudnn.benchmark pick, NCHW", tag, spec, sets, ref, timing))
        out.append(_torch_variant(f"torch-{tag}-cl", "cudnn.benchmark pick, channels_last", tag, spec, cl, ref,
                                  timing))
        if with_cudnn:
            bound = _fastest_ms(out)
            out += cudnn.all_algorithms(spec, sets, ref, timing, math="tensor_op", dtype=spec.dtype, bound_ms=bound)
            out += cudnn.all_algorithms(spec, cl, ref, timing, math="tensor_op", dtype=spec.dtype, layout="nhwc",
                                        bound_ms=bound)
    best = best_half(out, spec.dtype)
    return ([best] if best is not None else []) + out


def best_half(results: list[BaselineResult], dtype: str) -> BaselineResult | None:
    """cuDNN-best of ``dtype``: the fastest timed row of that dtype (PyTorch's picks and the legacy
    algorithms), named ``cudnn-best-fp16`` / ``cudnn-best-bf16``; None without a cuDNN row."""
    tag = HALF_TAGS[dtype]
    if not any(r.impl.startswith(f"cudnn-{tag}") for r in results):
        return None
    cands = [r for r in results if r.time_ms is not None and r.precision == tag]
    if not cands:
        return None
    win = min(cands, key=lambda r: r.time_ms or 0.0)
    algo = win.impl.split(":", 1)[1] + (" (NHWC)" if "-nhwc:" in win.impl else "") if ":" in win.impl else win.algo
    return BaselineResult(HALF_BEST[dtype], algo, tag, win.time_ms, win.workspace_bytes, win.rel_err)


def tensor_core_peaks(quick: bool = False) -> dict[str, float]:
    """Tensor-core GEMM ceilings in TFLOPS: torch.matmul (cuBLAS) of two n x n matrices (n = 8192;
    1024 when ``quick``) in float16, bfloat16 and float32 with TF32, FP32 accumulation, the median of
    10 calls after warm-up; empty where torch sees no GPU. TF32 flags are restored afterwards."""
    if not torch_available():
        return {}
    import torch

    if not torch.cuda.is_available():
        return {}
    n = 1024 if quick else 8192
    out: dict[str, float] = {}
    timing = Timing(warmup=2, repeats=3 if quick else 10, sets=1)
    with torch_flags() as set_flags:
        for key, dt, tf32 in (("float16", torch.float16, False), ("bfloat16", torch.bfloat16, False),
                              ("tf32", torch.float32, True)):
            set_flags(tf32=tf32)
            a, b = (torch.randn(n, n, device="cuda", dtype=dt) for _ in range(2))
            ms = time_cuda(functools.partial(torch.matmul, a, b), timing)
            out[key] = 2.0 * n ** 3 / (ms * 1e-3) / 1e12
            del a, b
    return out


def _cpu_baselines(spec: ConvSpec, timing: Timing) -> list[BaselineResult]:
    """PyTorch on the CPU, timed with a wall clock (there are no events)."""
    import torch

    (a, b), fn = pass_sets(spec, 1, "cpu")[0], pass_fn(spec)
    ref = fn(a.double(), b.double())
    err = rel_err(fn(a, b), ref)
    for _ in range(timing.warmup):
        fn(a, b)
    times = []
    for _ in range(timing.repeats):
        t0 = time.perf_counter()
        fn(a, b)
        times.append((time.perf_counter() - t0) * 1e3)
    res = BaselineResult("torch-cpu", f"torch {torch.__version__} CPU", "fp32", median(times), 0, err)
    return [res]


def _numpy_baselines(spec: ConvSpec, timing: Timing) -> list[BaselineResult]:
    """im2col + NumPy's BLAS matmul in float32 on the CPU (bench/numpy_conv.py), timed with a wall
    clock; its error against float64 on the same inputs."""
    import numpy as np

    from convforge.apps.bench import numpy_conv

    blas = numpy_conv.blas_name()
    algo = f"im2col + np.matmul (NumPy {np.__version__}{', ' + blas if blas else ''})"
    if spec.dtype != "float32":
        return [BaselineResult("numpy", algo, HALF_TAGS[spec.dtype], None, status=f"no {spec.dtype} baseline in NumPy")]
    a, b = numpy_conv.pass_inputs(spec)
    fn = numpy_conv.pass_fn(spec)
    ref = numpy_conv.reference(spec, a, b)
    out = fn(a, b)
    den = float(np.linalg.norm(ref))
    err = float(np.linalg.norm(out.astype(np.float64) - ref)) / den if den else 0.0
    ms = numpy_conv.time_ms(lambda: fn(a, b), timing.warmup, timing.repeats)
    return [BaselineResult("numpy", algo, "fp32", ms, 0, err)]
