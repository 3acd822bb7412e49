"""Per-call host cost of one conv on a tiny warm layer, side by side, with the machine's floor (GPU).

Run by ``scripts/gpu-final check``: the figures behind the README's host-cost paragraph.

Rows: ``F.conv2d`` (PyTorch, cuDNN), ``nn.Conv2d`` forward, ``convforge.conv2d`` with torch tensors
(through the native fast path when it is built: ``CONVFORGE_NATIVE=0`` measures Python's) and the
native module's ``run`` alone, ``convforge.conv2d`` with CuPy arrays (through the CuPy native fast
path when it is built) and that module's ``run`` alone, the ``torch.ops.convforge.conv2d`` op
(through the dispatcher, its Autograd kernel included under no_grad), a converted
``convforge.torch.Conv2d`` forward (eager inference), the backward passes (``convforge.grad``'s
dgrad, wgrad and bias gradient beside ``aten.convolution_backward``), and a conv -> batch norm -> ReLU (with and
without a residual add) in PyTorch against ``convforge.torch.FusedConv2d`` folded (what
``convforge.torch.fuse`` makes of it).

Floor rows: ``cuLaunchKernel`` from C (a 16-argument empty kernel, built here by nvcc when it is on
PATH: the driver's own cost on this host), ``x.add_(0)`` on a tiny tensor (ONE bare kernel launch
from PyTorch's C++), ``x.new_empty(shape)`` (one output allocation from the caching allocator) and
this layer's own kernel launched with its argument buffer prepared (``launch_raw`` on fixed pointers
and stream, through CuPy's compiled ``launchKernel`` binding, as every convforge call launches: the
cheapest launch Python makes, no allocation, no dispatch), and the same through ctypes for comparison.
Each convforge row states the kernel launches one warm call makes (from its executable's steps: "rest" only when the
filters are cached per weight version, every step for CuPy arrays, whose transform runs per call;
a cuBLAS Gemm or Fill step counts as one launch) and its **overhead above the floor**: its cost
minus (launches x raw launch + one allocation). That is the part convforge controls.

How: before each burst the GPU is held asleep by ``torch.cuda._sleep`` for longer than the burst
(an event recorded after the sleep must still be pending when the burst ends, else the row is
flagged), so every call only enqueues work; bursts are short (``--calls``, default 150) so the
launch queue never fills and blocks the host. Host cost per call = the burst's wall time over its
calls, median of ``--bursts`` bursts, the queue drained between them. The device time of one call
(CUDA events, back to back) is printed for context.

Targets (issue 15): convforge.conv2d <= 5 us with torch tensors or CuPy arrays, the torch op <= 10 us,
against F.conv2d's 19 us. The 5 us assumed a ~3 us kernel launch and left ~2 us for the rest; an
output allocation from Python (``new_empty``) alone costs ~3 us on the H200 host of 2026-11-23, so
the comparable figure is the overhead above launch + allocation.

``--floors`` prints instead the floors under those rows: one launch from C through the driver's
entry points (cuLaunchKernel with an argument array or one packed buffer, cuLaunchKernelEx, the
runtime's cudaLaunchKernel) on a non-blocking and on the legacy default stream, and PyTorch's own
cost of calling an op of ``convforge::conv2d``'s schema whose kernels return at once (built here by
``torch.utils.cpp_extension``), beside a three-tensor schema.

``--parts`` prints instead where one warm ``convforge.conv2d`` call spends its time, with torch
tensors (the fast-path key and lookup, the prepared runner, and the runner's pieces) and with CuPy
arrays (the CuPy native module's pieces).

    PYTHONPATH=src python scripts/host_cost.py [--parts | --floors]
        [--spec N=1,C=8,H=8,W=8,K=8,R=3,S=3,pad=1] [--algo auto]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

if "--parts" in sys.argv:  # native.parts exists in the profiling build only (a library of its own)
    os.environ.setdefault("CONVFORGE_NATIVE_PROFILE", "1")

import cupy as cp
import torch
import torch.nn.functional as F

import convforge
import convforge.torch as ct
from convforge import api
from convforge.backends import native as backend_native
from convforge.dispatch import RUNNERS
from convforge.frontends.keys import torch_key
from convforge.spec import ConvSpec
from convforge.torch import native

SLEEP_CYCLES = int(1e8)  # ~50 ms of GPU spin at ~2 GHz: far longer than a burst of 150 calls


def host_us(fn: Callable[[], object], calls: int, bursts: int) -> tuple[float, bool]:
    """(median over bursts of the wall time per call while the GPU sleeps, whether the GPU woke
    during some burst: then the queue drained and the figure may include waiting)."""
    times, woke = [], False
    for _ in range(bursts):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        asleep = torch.cuda.Event()
        asleep.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        woke |= asleep.query()
    torch.cuda.synchronize()
    return statistics.median(times), woke


def device_us(fn: Callable[[], object], calls: int = 200) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def fused_layers(x: Any, spec: ConvSpec, algo: str) -> tuple[Any, Any, Any, Any]:
    """((conv, batch norm) in eval mode with non-trivial statistics, FusedConv2d bn+relu, FusedConv2d
    bn+add+relu, a residual) for this layer, as ``convforge.torch.fuse`` would make them."""
    conv = torch.nn.Conv2d(spec.c, spec.k, (spec.r, spec.s), spec.stride, (spec.pad[0], spec.pad[2]), spec.dilation,
                           bias=False).cuda()
    bn = torch.nn.BatchNorm2d(spec.k).cuda().eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    fused = ct.FusedConv2d.from_conv(conv, bn, relu=True, algo=algo)
    fused_res = ct.FusedConv2d.from_conv(conv, bn, residual=True, relu=True, algo=algo)
    return (conv, bn), fused, fused_res, torch.randn(spec.y_shape, device="cuda")


def fused_runner(m: Any) -> tuple[Any, bool]:
    """(the runner, whether its plan adds the residual) of a FusedConv2d's one input signature."""
    run, res_in_plan, _ = next(v for k, v in m._cf_cache.items() if k[0] == "fused")
    return run, res_in_plan


def launches(run: Any, cached_filters: bool) -> int | None:
    """Kernel launches of one warm call of a runner: "rest" steps when filters are cached."""
    exe = getattr(run, "exe", None)
    if exe is None:
        return None
    steps = exe.plan.steps
    if cached_filters and exe.derived:
        steps = [s for i, s in enumerate(steps) if i not in exe.weight_steps]
    return len(steps)  # a Launch is one kernel launch; a cuBLAS Gemm or a Fill counts as one too


def runner_of(x: Any, w: Any, b: Any, spec: ConvSpec, algo: str) -> Any:
    """The prepared runner that a warm ``convforge.conv2d(x, w, b, ..., algo=algo)`` call hits."""
    keyer = api._KEYERS.get(type(x))
    if keyer is None:
        return None
    return RUNNERS.get(keyer(x, w, b, spec.stride, spec.pad, spec.dilation, algo, None, None, False, None, None,
                             None))


def raw_launch(x: Any, w: Any, b: Any, spec: ConvSpec, algo: str) -> Callable[[], object]:
    """One call of this layer's prepared launch on fixed pointers and stream: ctypes + the driver alone."""
    convforge.conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, algo=algo)  # build the runner
    exe = runner_of(x, w, b, spec, algo).exe
    y = x.new_empty(spec.y_shape)
    ptrs = (x.data_ptr(), w.data_ptr(), y.data_ptr(), b.data_ptr(), torch.cuda.current_stream().cuda_stream)
    steps = "rest" if exe.derived else "all"
    derived = torch.empty(max(exe.derived_bytes // 4, 1), device="cuda")
    if exe.derived:
        exe.launch_raw(0, ptrs[1], 0, 0, ptrs[4], derived.data_ptr(), "weights")
    dp = derived.data_ptr() if exe.derived else 0

    def call() -> None:
        exe.launch_raw(*ptrs, dp, steps)

    call.exe, call.ptrs, call.dp, call.steps, call.keep = exe, ptrs, dp, steps, (y, derived)  # type: ignore
    return call


C_FLOOR = r"""
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <vector>
extern "C" __global__ void spin(long long n) { long long t = clock64(); while (clock64() - t < n) {} }
extern "C" __global__ void k16(float* a, float* b, float* c, float* d, float* e, int n0, int n1, int n2, int n3,
                               int n4, int n5, int n6, int n7, int n8, int n9, float f) { if (n0 < 0) a[0] = f; }
extern "C" __global__ void k4(float* a, float* b, float* c, float* d) { if (a == b) c[0] = d[0]; }
CUfunction fs;
double burst(int calls, CUstream s, const std::function<void()>& launch) {  // host us per call, median of 15
  long long cyc = 100000000; void* sa[] = {&cyc};
  for (int i = 0; i < 20; i++) launch();
  cuCtxSynchronize();
  std::vector<double> t;
  for (int b = 0; b < 15; b++) {
    cuLaunchKernel(fs, 1, 1, 1, 1, 1, 1, 0, s, sa, 0);  // holds the GPU: every launch below only enqueues
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; i++) launch();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls);
    cuCtxSynchronize();
  }
  std::sort(t.begin(), t.end());
  return t[7];
}
int main(int argc, char** argv) {  // argv: calls [variants]
  int calls = atoi(argv[1]);
  cudaFree(0);
  CUfunction fk, f4;
  cudaGetFuncBySymbol(&fs, (void*)spin); cudaGetFuncBySymbol(&fk, (void*)k16); cudaGetFuncBySymbol(&f4, (void*)k4);
  CUstream s; cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  float* p; cudaMalloc(&p, 1024);
  int n[10] = {0}; float f = 1;
  void* ka[] = {&p, &p, &p, &p, &p, &n[0], &n[1], &n[2], &n[3], &n[4], &n[5], &n[6], &n[7], &n[8], &n[9], &f};
  void* a4[] = {&p, &p, &p, &p};
  if (argc < 3) {
    printf("%.3f\n", burst(calls, s, [&] { cuLaunchKernel(fk, 4, 1, 1, 128, 1, 1, 0, s, ka, 0); }));
    return 0;
  }
  alignas(8) char buf[88] = {0};  // k16's parameters packed: 5 pointers, 10 ints, 1 float
  for (int i = 0; i < 5; i++) memcpy(buf + 8 * i, &p, 8);
  memcpy(buf + 80, &f, 4);
  size_t size = 84;
  void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
  CUlaunchConfig cfg; memset(&cfg, 0, sizeof cfg);
  cfg.gridDimX = 4; cfg.gridDimY = cfg.gridDimZ = 1; cfg.blockDimX = 128; cfg.blockDimY = cfg.blockDimZ = 1;
  auto row = [&](const char* name, CUstream st, const std::function<void()>& go) {
    printf("%-44s %7.3f\n", name, burst(calls, st, go));
  };
  CUstream z = 0;
  row("16 args, non-blocking stream (the floor)", s, [&] { cuLaunchKernel(fk, 4, 1, 1, 128, 1, 1, 0, s, ka, 0); });
  row("16 args, legacy default stream", z, [&] { cuLaunchKernel(fk, 4, 1, 1, 128, 1, 1, 0, z, ka, 0); });
  row("16 args packed in one buffer (extra)", z, [&] { cuLaunchKernel(fk, 4, 1, 1, 128, 1, 1, 0, z, 0, extra); });
  row("16 args, cuLaunchKernelEx", z, [&] { cuLaunchKernelEx(&cfg, fk, ka, 0); });
  row("16 args, cudaLaunchKernel (runtime API)", z, [&] { cudaLaunchKernel((void*)k16, 4, 128, ka, 0, 0); });
  row("4 args, legacy default stream", z, [&] { cuLaunchKernel(f4, 4, 1, 1, 128, 1, 1, 0, z, a4, 0); });
  return 0;
}
"""


def c_floor(calls: int, variants: bool = False) -> str | None:
    """Host us of one cuLaunchKernel from C (nvcc-built probe), or None without nvcc; with
    ``variants``, a table of the same launch through the driver's other entry points and streams."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "floor.cu"), os.path.join(tmp, "floor")
        with open(src, "w") as f:
            f.write(C_FLOOR)
        subprocess.run([nvcc, "-O2", "-o", exe, src, "-lcuda"], check=True, capture_output=True)
        cmd = [exe, str(calls)] + (["variants"] if variants else [])
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


OP_FLOOR = r"""
#include <ATen/core/Tensor.h>
#include <torch/library.h>
at::Tensor conv2d(const at::Tensor& x, const at::Tensor&, const std::optional<at::Tensor>&, c10::IntArrayRef,
                  c10::IntArrayRef, c10::IntArrayRef, c10::string_view, std::optional<c10::string_view>,
                  std::optional<double>) { return x; }
at::Tensor three(const at::Tensor& x, const at::Tensor&, const std::optional<at::Tensor>&) { return x; }
TORCH_LIBRARY(convforge_floor, m) {
  m.def("SCHEMA");
  m.def("three(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(convforge_floor, CUDA, m) { m.impl("conv2d", conv2d); m.impl("three", three); }
TORCH_LIBRARY_IMPL(convforge_floor, Autograd, m) { m.impl("conv2d", conv2d); m.impl("three", three); }
"""


def op_floor(x: Any, w: Any, b: Any, spec: ConvSpec, args: argparse.Namespace) -> None:
    """Print PyTorch's own cost of calling an op of convforge::conv2d's schema whose CUDA and
    Autograd kernels return x at once (no allocation, no launch), and of a three-tensor schema:
    the part of the op row that is PyTorch's argument parsing and dispatch."""
    from torch.utils.cpp_extension import load_inline

    schema = str(torch.ops.convforge.conv2d.default._schema).split("::", 1)[1]
    with tempfile.TemporaryDirectory() as tmp:
        load_inline("convforge_floor", cpp_sources=OP_FLOOR.replace("SCHEMA", schema), is_python_module=False,
                    extra_cflags=["-O2"], build_directory=tmp)
    st, pd, dl = list(spec.stride), list(spec.pad), list(spec.dilation)
    rows = [("the op (convforge::conv2d)", lambda: torch.ops.convforge.conv2d(x, w, b, st, pd, dl, args.algo, None,
                                                                             None)),
            ("its schema, a kernel that returns x", lambda: torch.ops.convforge_floor.conv2d(x, w, b, st, pd, dl,
                                                                                         args.algo, None, None)),
            ("(Tensor x, Tensor w, Tensor? bias), the same", lambda: torch.ops.convforge_floor.three(x, w, b))]
    print(f"PyTorch's dispatch floor for the op, host us per call (no_grad); schema {schema}")
    with torch.no_grad():
        for name, fn in rows:
            for _ in range(20):
                fn()
            print(f"{name:48s} {host_us(fn, args.calls, args.bursts)[0]:7.2f}")


def ctypes_launch(raw: Callable[[], object]) -> Callable[[], object] | None:
    """The same prepared launch as ``raw`` through ctypes (argtypes set): what round 9 called."""
    exe, ptrs, dp, steps = raw.exe, raw.ptrs, raw.dp, raw.steps  # type: ignore[attr-defined]
    exe.launch_raw(*ptrs, dp, steps)  # fills the pointer slots of the prepared buffers
    runs = exe._runs[steps]
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernel
    u, p = ctypes.c_uint, ctypes.c_void_p
    fn.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
    stream = ptrs[4]

    def call() -> None:
        for head, params in runs:
            fn(*head, stream, params, None)

    return call


PIECES = ("call", "parse", "find", "stream", "context", "capture", "filters", "alloc", "wrap", "launch")


def parts(x: Any, w: Any, b: Any, spec: ConvSpec, args: argparse.Namespace) -> None:
    """The pieces of one warm ``convforge.conv2d(x, w, b)`` call with torch tensors, each timed
    alone: in C by the native module's ``parts`` when it is built, else the Python fast path's."""
    conv = (lambda: convforge.conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, algo=args.algo))
    with torch.no_grad():
        conv()  # builds the runner and files the call
    nat = native.load()
    nat = nat if hasattr(nat, "parts") else None  # a production build (CONVFORGE_NATIVE_PROFILE=0) has none
    print(f"{torch.cuda.get_device_name()} | layer {spec.short()} | algo {args.algo} | no_grad, host us per call"
          f" | pieces timed {'in C (native.parts)' if nat is not None else 'from Python (no native.parts)'}")
    if nat is not None:
        call = (x, w, b, spec.stride, spec.pad, spec.dilation, args.algo, None, None, False, None, None, None, 1)
        rows = [("whole conv2d call (from Python)", conv)]
        with torch.no_grad():
            for piece in PIECES:
                nat.parts(*call, piece, 20)
                print(f"{piece:32s} {c_burst_us(lambda n, piece=piece: nat.parts(*call, piece, n), args):7.3f}")
    else:
        rows = python_pieces(x, w, b, spec, args, conv)
    with torch.no_grad():
        for name, fn in rows:
            for _ in range(20):
                fn()
            print(f"{name:32s} {host_us(fn, args.calls, args.bursts)[0]:7.3f}")
    cupy_parts(x, w, b, spec, args)


CUPY_PIECES = ("call", "parse", "find", "device", "stream", "alloc", "launch")


def cupy_parts(x: Any, w: Any, b: Any, spec: ConvSpec, args: argparse.Namespace) -> None:
    """The same for CuPy arrays of the same values, in C by the CuPy native module's ``parts``."""
    xc, wc, bc = cp.asarray(x), cp.asarray(w.detach()), cp.asarray(b.detach())
    call = (xc, wc, bc, spec.stride, spec.pad, spec.dilation, args.algo, None, None, False, None, None, None, 1)
    convforge.conv2d(*call)  # builds the runner, loads the CuPy path and files the call
    cnat = backend_native.load_cupy()
    if cnat is None:
        print("CuPy arrays: native path off, no pieces")
        return
    print("CuPy arrays, pieces timed in C (cupy_native.parts)")
    for piece in CUPY_PIECES:
        cnat.parts(*call, piece, 20)
        print(f"{piece:32s} {c_burst_us(lambda n, piece=piece: cnat.parts(*call, piece, n), args):7.3f}")
    conv = (lambda: convforge.conv2d(*call))
    for _ in range(20):
        conv()
    print(f"{'whole conv2d call (from Python)':32s} {host_us(conv, args.calls, args.bursts)[0]:7.3f}")


def c_burst_us(timed: Callable[[int], float], args: argparse.Namespace) -> float:
    """Median over bursts of the host us per repetition that ``timed(n)`` reports, the GPU asleep."""
    times = []
    for _ in range(args.bursts):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        times.append(timed(args.calls) / args.calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def python_pieces(x: Any, w: Any, b: Any, spec: ConvSpec, args: argparse.Namespace,
                  conv: Callable[[], object]) -> list[tuple[str, Callable[[], object]]]:
    """The Python fast path's pieces (``CONVFORGE_NATIVE=0``)."""
    key = (lambda: torch_key(x, w, b, spec.stride, spec.pad, spec.dilation, args.algo, None, None, False, None,
                              None, None))
    run = runner_of(x, w, b, spec, args.algo)
    wp = w.data_ptr()
    return [
        ("whole conv2d call", conv),
        ("fast-path key + lookup", lambda: RUNNERS.get(key())),
        ("prepared runner run(x, w, b)", lambda: run(x, w, b)),
        ("  three data_ptr()", lambda: (x.data_ptr(), w.data_ptr(), b.data_ptr())),
        ("  capture check", torch._C._cuda_isCurrentStreamCapturing),
        ("  stream handle", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("  filter cache version check", (lambda: run.filters.get(w, wp)) if run.filters is not None else (lambda: 0)),
        ("  output new_empty", lambda: x.new_empty(spec.y_shape)),
    ]


def grad_rows(x: Any, w: Any, spec: ConvSpec) -> list[tuple[str, Callable[[], object], str]]:
    """The backward passes' warm calls (convforge.grad's Python fast path: a key, a dictionary hit,
    the launches) beside PyTorch's ``aten.convolution_backward`` asked for the same gradient."""
    from convforge import grad

    dy = torch.randn(spec.y_shape, device="cuda")
    st, dl, pd = list(spec.stride), list(spec.dilation), [spec.pad[0], spec.pad[2]]
    back = torch.ops.aten.convolution_backward.default
    rows: list[tuple[str, Callable[[], object], str]] = [
        ("grad.conv2d_input (dgrad), torch", lambda: grad.conv2d_input(spec.x_shape, w, dy, spec.stride, spec.pad,
                                                                       spec.dilation), ""),
        ("grad.conv2d_weight (wgrad), torch", lambda: grad.conv2d_weight(x, spec.w_shape, dy, spec.stride, spec.pad,
                                                                         spec.dilation), ""),
        ("grad.conv2d_bias, torch", lambda: grad.conv2d_bias(dy), "")]
    if spec.symmetric_pad:
        rows += [("aten.convolution_backward, dgrad", lambda: back(dy, x, w, None, st, pd, dl, False, [0, 0], 1,
                                                                    [True, False, False]), ""),
                 ("aten.convolution_backward, wgrad", lambda: back(dy, x, w, None, st, pd, dl, False, [0, 0], 1,
                                                                    [False, True, False]), "")]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="N=1,C=8,H=8,W=8,K=8,R=3,S=3,pad=1")
    ap.add_argument("--algo", default="auto")
    ap.add_argument("--calls", type=int, default=150)
    ap.add_argument("--bursts", type=int, default=15)
    ap.add_argument("--parts", action="store_true", help="time the pieces of one conv2d call instead")
    ap.add_argument("--floors", action="store_true",
                    help="time the floors instead: one launch from C by entry point and stream, and PyTorch's own "
                         "dispatch of the op's schema with a kernel that does nothing")
    args = ap.parse_args()
    spec = ConvSpec.parse(args.spec)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    x = torch.randn(spec.x_shape, device="cuda")
    tiny = torch.zeros(8, device="cuda")
    layer = torch.nn.Conv2d(spec.c, spec.k, (spec.r, spec.s), spec.stride, (spec.pad[0], spec.pad[2]),
                            spec.dilation).cuda()
    w, b = layer.weight, layer.bias  # parameters that require grad: the case that used to fail
    if args.parts:
        parts(x, w, b, spec, args)
        return
    if args.floors:
        print(f"{torch.cuda.get_device_name()} | one launch from C, host us per launch, by entry point and stream")
        print(c_floor(args.calls, variants=True) or "n/a (no nvcc)")
        convforge.conv2d(x, w, b, spec.stride, spec.pad, spec.dilation, algo=args.algo)  # builds and files the call
        op_floor(x, w, b, spec, args)
        return
    xc, wc, bc = cp.asarray(x), cp.asarray(w.detach()), cp.asarray(b.detach())
    ours = ct.Conv2d.from_module(torch.nn.Conv2d(spec.c, spec.k, (spec.r, spec.s), spec.stride,
                                                 (spec.pad[0], spec.pad[2]), spec.dilation).cuda(), algo=args.algo)
    st, pd, dl = list(spec.stride), list(spec.pad), list(spec.dilation)
    cbr, fused, fused_res, res = fused_layers(x, spec, args.algo)
    # (name, call, kind): kind "floor_<what>" / "torch" / "cupy" / "module" / "" (PyTorch)
    raw = raw_launch(x, w, b, spec, args.algo)
    nat = native.load()
    convforge.conv2d(xc, wc, bc, spec.stride, spec.pad, spec.dilation, algo=args.algo)  # loads the CuPy path
    cnat = backend_native.load_cupy()
    rows: list[tuple[str, Callable[[], object] | None, str]] = [
        ("floor: x.add_(0), one torch launch", lambda: tiny.add_(0), "floor_torch"),
        ("floor: launch_raw (CuPy binding, prepared)", raw, "floor_launch"),
        ("  the same launch through ctypes", ctypes_launch(raw), "floor_ctypes"),
        ("floor: x.new_empty(y shape)", lambda: x.new_empty(spec.y_shape), "floor_alloc"),
        ("F.conv2d (cuDNN)", lambda: F.conv2d(x, w, b, spec.stride, (spec.pad[0], spec.pad[2]), spec.dilation), ""),
        ("nn.Conv2d forward", lambda: layer(x), ""),
        ("convforge.conv2d, torch tensors", lambda: convforge.conv2d(x, w, b, spec.stride, spec.pad, spec.dilation,
                                                                     algo=args.algo), "torch"),
        ("  native.run alone (no Python wrapper)", (lambda: nat.run(x, w, b, spec.stride, spec.pad, spec.dilation,
                                                                    args.algo, None, None, False, None, None, None, 1))
         if nat is not None else None, "torch"),
        ("convforge.conv2d, CuPy arrays", lambda: convforge.conv2d(xc, wc, bc, spec.stride, spec.pad, spec.dilation,
                                                                   algo=args.algo), "cupy"),
        ("  CuPy native.run alone", (lambda: cnat.run(xc, wc, bc, spec.stride, spec.pad, spec.dilation, args.algo,
                                                      None, None, False, None, None, None, 1))
         if cnat is not None else None, "cupy"),
        ("torch.ops.convforge.conv2d", lambda: torch.ops.convforge.conv2d(x, w, b, st, pd, dl, args.algo, None, None),
         "torch"),
        ("convforge.torch.Conv2d forward", lambda: ours(x), "module"),
        *grad_rows(x, w, spec),
        ("PyTorch conv -> bn -> relu", lambda: torch.relu(cbr[1](cbr[0](x))), ""),
        ("FusedConv2d (bn+relu), folded", lambda: fused(x), "fused"),
        ("PyTorch conv -> bn -> + res -> relu", lambda: torch.relu(cbr[1](cbr[0](x)) + res), ""),
        ("FusedConv2d (bn+add+relu), folded", lambda: fused_res(x, res), "fused_res"),
    ]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | cupy {cp.__version__} | "
          f"layer {spec.short()} | algo {args.algo} | {args.calls} calls x {args.bursts} bursts | native fast path "
          f"{'on' if nat is not None else 'off'} (torch), {'on' if cnat is not None else 'off'} (CuPy)")
    cf = c_floor(args.calls)
    print(f"floor: cuLaunchKernel from C, host us per launch: {'n/a (no nvcc)' if cf is None else cf}")
    print(f"{'call':36s} {'launches':>8s} {'no_grad us':>11s} {'above floor':>11s} {'inference us':>13s} "
          f"{'above floor':>11s} {'device us':>10s}")
    floor = {"launch": [0.0, 0.0], "alloc": [0.0, 0.0], "torch": [0.0, 0.0], "ctypes": [0.0, 0.0]}
    for name, fn, kind in rows:
        if fn is None:
            continue
        with torch.no_grad():
            for _ in range(20):
                fn()  # warm: compile, choose, runners, transformed filters
            ng, woke1 = host_us(fn, args.calls, args.bursts)
            dev = device_us(fn)
        with torch.inference_mode():
            for _ in range(5):
                fn()
            inf, woke2 = host_us(fn, args.calls, args.bursts)
        run = (next(iter(ours._cf_cache.values()), None) if kind == "module"
               else runner_of(x, w, b, spec, args.algo) if kind == "torch"
               else runner_of(xc, wc, bc, spec, args.algo) if kind == "cupy"
               else fused_runner(fused if kind == "fused" else fused_res)[0] if kind.startswith("fused") else None)
        n = launches(run, kind != "cupy") if run is not None else (
            launches(runner_of(x, w, b, spec, args.algo), True) if kind in ("floor_launch", "floor_ctypes")
            else 1 if kind == "floor_torch" else None)
        torch_ops = 2 if kind == "fused_res" and not fused_runner(fused_res)[1] else 0  # add_ and relu_ after
        if kind.startswith("floor_"):
            floor[kind[6:]] = [ng / (n or 1), inf / (n or 1)]  # per launch for the launch rows
        above = ["", ""]
        if kind in ("torch", "cupy", "module", "fused", "fused_res") and n is not None:
            above = [f"{cost - n * floor['launch'][i] - floor['alloc'][i] - torch_ops * floor['torch'][i]:11.2f}"
                     for i, cost in enumerate((ng, inf))]
            n += torch_ops
        flag = "  (GPU woke during a burst: use fewer --calls)" if woke1 or woke2 else ""
        print(f"{name:36s} {'-' if n is None else n:>8} {ng:11.2f} {above[0]:>11s} {inf:13.2f} {above[1]:>11s} "
              f"{dev:10.2f}{flag}")
    print("above floor = cost - launches x (one launch_raw launch) - (one allocation); the issue's 5 us "
          "assumed a ~3 us launch, i.e. ~2 us for the rest")


if __name__ == "__main__":
    main()
