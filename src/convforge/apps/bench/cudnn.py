"""cuDNN's legacy API through ctypes, on the libcudnn that PyTorch ships: forward, backward data
(dgrad) and backward filter (wgrad).

Every algorithm of the layer's pass is tried with FP32 data, in FMA math (no tensor cores: the
fp32 class's cuDNN-best) or in default math (tensor cores and TF32 permitted, as PyTorch runs cuDNN
with ``allow_tf32``: the relaxed class's cuDNN-best TF32), or with FP16 / BF16 data in tensor-op math
(FP32 accumulation: the compute type stays FLOAT, cuDNN's pseudo-half configuration; NCHW or NHWC
tensors: a half layer's cuDNN-best); NOT_SUPPORTED ones are reported with their status. Buffers and
workspace are torch allocations; times are torch.cuda events on torch's current stream. Imported only
by ``baselines`` when torch and a CUDA device exist.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

from convforge.apps.bench.measured import BaselineResult, rel_err, time_cuda
from convforge.apps.bench.timing import Timing, cycle
from convforge.spec import ConvSpec

ALGOS = ("IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT", "FFT", "FFT_TILING", "WINOGRAD",
         "WINOGRAD_NONFUSED")
# cudnnConvolutionBwdDataAlgo_t and cudnnConvolutionBwdFilterAlgo_t (BWD_FILTER_ALGO_WINOGRAD = 4 is
# not implemented by cuDNN), each pass's algorithms by (row name, enum value)
PASS_ALGOS: dict[str, tuple[tuple[str, int], ...]] = {
    "fprop": tuple((name, i) for i, name in enumerate(ALGOS)),
    "dgrad": (("BWD_DATA_ALGO_0", 0), ("BWD_DATA_ALGO_1", 1), ("BWD_DATA_FFT", 2), ("BWD_DATA_FFT_TILING", 3),
              ("BWD_DATA_WINOGRAD", 4), ("BWD_DATA_WINOGRAD_NONFUSED", 5)),
    "wgrad": (("BWD_FILTER_ALGO_0", 0), ("BWD_FILTER_ALGO_1", 1), ("BWD_FILTER_FFT", 2), ("BWD_FILTER_ALGO_3", 3),
              ("BWD_FILTER_WINOGRAD_NONFUSED", 5), ("BWD_FILTER_FFT_TILING", 6)),
}
# per pass: (workspace-size entry point, run entry point)
_ENTRY = {"fprop": ("cudnnGetConvolutionForwardWorkspaceSize", "cudnnConvolutionForward"),
          "dgrad": ("cudnnGetConvolutionBackwardDataWorkspaceSize", "cudnnConvolutionBackwardData"),
          "wgrad": ("cudnnGetConvolutionBackwardFilterWorkspaceSize", "cudnnConvolutionBackwardFilter")}
_FLOAT, _NCHW, _CROSS_CORRELATION = 0, 0, 1
_NHWC = 1
_DATA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 9}  # cudnnDataType_t FLOAT, HALF, BFLOAT16
# cudnnMathType_t (cuDNN 9 legacy API): DEFAULT 0 (tensor cores, TF32 for FP32 data, permitted),
# TENSOR_OP 1, TENSOR_OP_ALLOW_CONVERSION 2 (FP32 data converted to FP16: not a TF32 figure), FMA 3.
_DEFAULT_MATH, _TENSOR_OP_MATH, _FMA_MATH = 0, 1, 3
MATHS = {"fma": ("cudnn:", "fp32"), "default": ("cudnn-tf32:", "tf32")}  # math -> (impl prefix, precision)
_HALF_TAGS = {"float16": "fp16", "bfloat16": "bf16"}


def _names(math: str, dtype: str, layout: str) -> tuple[str, str]:
    """(impl prefix, precision) of rows in ``math`` on ``dtype`` data in ``layout``: e.g.
    ("cudnn-fp16-nhwc:", "fp16") for tensor-op math on float16."""
    if math == "tensor_op":
        tag = _HALF_TAGS[dtype]
        return f"cudnn-{tag}{'-nhwc' if layout == 'nhwc' else ''}:", tag
    return MATHS[math]
_LIBS = ("libcudnn.so.9", "libcudnn_cnn.so.9", "libcudnn_ops.so.9", "libcudnn_graph.so.9")


def _lib_dirs() -> list[Path]:
    """site-packages/nvidia/cudnn/lib of every path entry (where PyTorch's wheel dependency lives)."""
    out = []
    for entry in sys.path:
        d = Path(entry) / "nvidia" / "cudnn" / "lib"
        if d.is_dir():
            out.append(d)
    return out


class _Api:
    """Symbols looked up across libcudnn and its sub-libraries (cuDNN 9 splits them)."""

    def __init__(self) -> None:
        import torch

        torch.backends.cudnn.version()  # makes torch load its libcudnn first
        self.libs: list[ctypes.CDLL] = []
        for name in _LIBS:
            for cand in [str(d / name) for d in _lib_dirs()] + [name]:
                try:
                    self.libs.append(ctypes.CDLL(cand))
                    break
                except OSError:
                    continue
        if not self.libs:
            raise OSError("libcudnn.so.9 not found (looked in site-packages/nvidia/cudnn/lib)")
        self.fn("cudnnGetErrorString").restype = ctypes.c_char_p

    def fn(self, name: str) -> Any:
        for lib in self.libs:
            try:
                return getattr(lib, name)
            except AttributeError:
                continue
        raise AttributeError(f"cuDNN symbol {name} not found")

    def error(self, status: int) -> str:
        return str(self.fn("cudnnGetErrorString")(status).decode())

    def __call__(self, name: str, *args: Any) -> int:
        return int(self.fn(name)(*args))

    def check(self, name: str, *args: Any) -> None:
        status = self(name, *args)
        if status != 0:
            raise RuntimeError(f"{name}: {self.error(status)}")


_API: _Api | None = None
_HANDLE = ctypes.c_void_p()


def _api() -> _Api:
    global _API
    if _API is None:
        api = _Api()
        api.check("cudnnCreate", ctypes.byref(_HANDLE))
        _API = api
    return _API


def version() -> str:
    try:
        return str(_api().fn("cudnnGetVersion")())
    except (OSError, AttributeError, RuntimeError):
        return ""


class _Descriptors:
    """x, w, y and convolution descriptors of one layer; destroyed on exit."""

    def __init__(self, api: _Api, math: str = "fma", dtype: str = "float32", layout: str = "nchw") -> None:
        self.api = api
        self.x, self.y = ctypes.c_void_p(), ctypes.c_void_p()
        self.w, self.conv = ctypes.c_void_p(), ctypes.c_void_p()
        self.math, self.dtype, self.layout = math, dtype, layout

    def __enter__(self) -> _Descriptors:
        return self

    def build(self, spec: ConvSpec) -> None:
        a, v = self.api, ctypes.c_int
        a.check("cudnnCreateTensorDescriptor", ctypes.byref(self.x))
        a.check("cudnnCreateTensorDescriptor", ctypes.byref(self.y))
        a.check("cudnnCreateFilterDescriptor", ctypes.byref(self.w))
        a.check("cudnnCreateConvolutionDescriptor", ctypes.byref(self.conv))
        data, fmt = v(_DATA_TYPES[self.dtype]), v(_NHWC if self.layout == "nhwc" else _NCHW)
        a.check("cudnnSetTensor4dDescriptor", self.x, fmt, data, *map(v, spec.x_shape))
        a.check("cudnnSetTensor4dDescriptor", self.y, fmt, data, *map(v, spec.y_shape))
        a.check("cudnnSetFilter4dDescriptor", self.w, data, fmt, *map(v, spec.w_shape))
        a.check("cudnnSetConvolution2dDescriptor", self.conv, v(spec.pad[0]), v(spec.pad[2]),
                v(spec.stride[0]), v(spec.stride[1]), v(spec.dilation[0]), v(spec.dilation[1]),
                v(_CROSS_CORRELATION), v(_FLOAT))  # FP32 accumulation for every data type
        if spec.groups > 1:  # filters of C/groups channels, as PyTorch's grouped convolutions call it
            a.check("cudnnSetConvolutionGroupCount", self.conv, v(spec.groups))
        if self.math == "tensor_op":
            a.check("cudnnSetConvolutionMathType", self.conv, v(_TENSOR_OP_MATH))
        elif self.math == "default":
            a.check("cudnnSetConvolutionMathType", self.conv, v(_DEFAULT_MATH))
        elif a("cudnnSetConvolutionMathType", self.conv, v(_FMA_MATH)) != 0:
            a.check("cudnnSetConvolutionMathType", self.conv, v(_DEFAULT_MATH))
            self.math = "fma refused"  # TF32 possible: no longer an FP32 candidate

    def __exit__(self, *exc: object) -> None:
        for name, d in (("cudnnDestroyTensorDescriptor", self.x), ("cudnnDestroyTensorDescriptor", self.y),
                        ("cudnnDestroyFilterDescriptor", self.w),
                        ("cudnnDestroyConvolutionDescriptor", self.conv)):
            if d.value:
                self.api(name, d)


def _descriptors_of(d: _Descriptors, conv_pass: str) -> tuple[tuple[Any, Any, Any], Any]:
    """((first input, second input, output) descriptors, workspace query's order) of a pass: cuDNN
    names dgrad's operands (w, dy -> dx) and wgrad's (x, dy -> dw)."""
    if conv_pass == "dgrad":
        return (d.w, d.y, d.x), (d.w, d.y, d.conv, d.x)
    if conv_pass == "wgrad":
        return (d.x, d.y, d.w), (d.x, d.y, d.conv, d.w)
    return (d.x, d.w, d.y), (d.x, d.w, d.conv, d.y)


def _one(api: _Api, d: _Descriptors, row: str, algo: int, spec: ConvSpec, sets: list[tuple[Any, Any]],
         ref: Any, timing: Timing, bound_ms: float | None = None) -> BaselineResult:
    """One algorithm of ``spec``'s pass: its workspace, one checked call, then the timed calls
    rotating over ``sets`` (the pass's two inputs: x, w for fprop; dy, w for dgrad; x, dy for wgrad)."""
    import torch

    prefix, prec = _names(d.math if d.math in ("default", "tensor_op") else "fma", d.dtype, d.layout)
    name, v = f"{prefix}{row}", ctypes.c_int
    (da, db, dout), query = _descriptors_of(d, spec.conv_pass)
    size_fn, run_fn = _ENTRY[spec.conv_pass]
    ws = ctypes.c_size_t()
    status = api(size_fn, _HANDLE, *query, v(algo), ctypes.byref(ws))
    if status != 0:
        return BaselineResult(name, row, prec, None, status=api.error(status))
    work = torch.empty(max(ws.value, 1), dtype=torch.uint8, device="cuda")
    fmt = torch.channels_last if d.layout == "nhwc" else torch.contiguous_format
    out = torch.empty(spec.shape_of(spec.output), dtype=getattr(torch, d.dtype), device="cuda", memory_format=fmt)
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    swap = spec.conv_pass == "dgrad"  # sets hold (dy, w); cudnnConvolutionBackwardData takes (w, dy)

    def call(a: Any, b: Any) -> int:
        if swap:
            a, b = b, a
        return api(run_fn, _HANDLE, ctypes.byref(alpha), da, ctypes.c_void_p(a.data_ptr()), db,
                   ctypes.c_void_p(b.data_ptr()), d.conv, v(algo), ctypes.c_void_p(work.data_ptr()),
                   ctypes.c_size_t(ws.value), ctypes.byref(beta), dout, ctypes.c_void_p(out.data_ptr()))

    status = call(*sets[0])
    if status != 0:
        return BaselineResult(name, row, prec, None, ws.value, status=api.error(status))
    err = rel_err(out.float(), ref)
    it = cycle(sets)
    ms = time_cuda(lambda: call(*next(it)), timing, bound_ms)
    if d.math == "fma refused":
        return BaselineResult(name, row, "tf32?", ms, ws.value, err,
                              "ok (FMA math refused: default math, TF32 possible; not an FP32 candidate)")
    return BaselineResult(name, row, prec, ms, ws.value, err)


def all_algorithms(spec: ConvSpec, sets: list[tuple[Any, Any]], ref: Any, timing: Timing,
                   math: str = "fma", dtype: str = "float32", layout: str = "nchw",
                   bound_ms: float | None = None) -> list[BaselineResult]:
    """Each legacy algorithm of ``spec``'s pass (8 forward, 6 backward data, 6 backward filter) in
    ``math`` ("fma": FP32 rows ``cudnn:ALGO``; "default": TF32-permitted rows ``cudnn-tf32:ALGO``;
    "tensor_op": ``dtype`` (float16, bfloat16) rows ``cudnn-fp16:ALGO`` / ``cudnn-fp16-nhwc:ALGO`` on
    ``layout`` tensors, ``sets`` of that dtype and memory format), timed, or with the status that
    stopped it. ``sets``: the pass's two inputs, as ``_one`` takes them; ``bound_ms``: the fastest
    baseline of the class already timed for the layer (``measured.time_cuda``: far slower algorithms
    are timed briefly)."""
    import torch

    prefix, prec = _names(math, dtype, layout)
    try:
        api = _api()
    except (OSError, AttributeError, RuntimeError) as err:
        return [BaselineResult(f"{prefix}legacy", "-", prec, None, status=f"unavailable: {err}")]
    api.check("cudnnSetStream", _HANDLE, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    with _Descriptors(api, math, dtype, layout) as d:
        d.build(spec)
        out = []
        for row, algo in PASS_ALGOS[spec.conv_pass]:
            try:
                out.append(_one(api, d, row, algo, spec, sets, ref, timing, bound_ms))
            except RuntimeError as err:  # e.g. out of memory for an FFT workspace
                out.append(BaselineResult(f"{prefix}{row}", row, prec, None, status=f"failed: {str(err)[:80]}"))
        return out
