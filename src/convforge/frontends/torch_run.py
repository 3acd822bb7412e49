"""torch CUDA tensors: a compiled CUDA executable run on them (``run(x, w, bias) -> y`` and the backward
passes' ``run(x, w, y) -> out``), on raw pointers and torch's current stream, the output from torch's
caching allocator; the filter transform kept per weight tensor and version. torch is imported inside
the functions: a torch tensor is here, so torch is loaded already."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from convforge.backends.base import CONV_BUFFERS, FilterCache, output_buffer

if TYPE_CHECKING:
    from convforge.backends.cuda import CudaExecutable


def torch_runner(exe: CudaExecutable, device: int) -> Callable[..., Any]:
    """``run(x, w, bias, derived=None, res=None, pro=None) -> y`` for torch CUDA tensors (x, w, bias
    validated by the caller; ``res``, the residual of a plan whose epilogue adds one, is checked
    here: the output's shape, else ValueError; made contiguous, of x's dtype, on x's device if it is not;
    ``pro``, the (pscale, pshift) of a plan whose prologue is affine: contiguous float32 tensors of
    C values on x's device, the caller's to ensure).

    ``data_ptr()`` works on tensors that require grad and under inference_mode; the stream is
    torch's current one (raw handle through torch's cheap accessor); the output comes from
    torch's caching allocator (``new_empty``, cheaper than ``torch.empty`` with a device), so
    capture by torch.cuda.graph works. Views whose data is not 16-byte aligned (float4 loads) are
    copied first.

    Filter transforms: with ``derived`` given (``Conv2d``'s eager inference) only the "rest" steps
    run on it. Without it, plans with filter-only steps keep their transformed filters per weight
    tensor and version (:class:`FilterCache`): a warm call with unchanged weights launches only
    the "rest" steps; an in-place weight update re-runs the transform on the next call. While the
    stream captures a CUDA graph the whole plan runs (the graph then sees every weight update).
    """
    import torch

    if output_buffer(exe.plan) != "y":  # a backward pass (dgrad, wgrad) or the bias gradient
        return torch_pass_runner(exe, device)
    stream_of, is_capturing = torch_stream_queries()
    exe.reserve(stream_of(device))
    shape, launch = exe.plan.spec.y_shape, exe.launch_raw
    filters = (FilterCache(lambda w, out: _torch_transform(exe, w, out), is_capturing)
               if exe.derived else None)
    lookup = filters.get if filters is not None else None
    needs_res = exe.plan.epilogue.residual
    needs_pro = exe.plan.prologue.affine
    nhwc = exe.plan.spec.layout == "nhwc"  # y (and res) in channels_last memory format, as x is
    stored = (shape[0], shape[2], shape[3], shape[1]) if nhwc else shape

    def run(x: Any, w: Any, bias: Any = None, derived: Any = None, res: Any = None, pro: Any = None) -> Any:
        xp, wp = x.data_ptr(), w.data_ptr()
        if xp & 15:
            x = torch.empty_like(x).copy_(x)
            xp = x.data_ptr()
        if wp & 15:
            w = torch.empty_like(w).copy_(w)
            wp = w.data_ptr()
        elif derived is None and lookup is not None and not is_capturing():
            derived = lookup(w, wp)
        y = x.new_empty(stored).permute(0, 3, 1, 2) if nhwc else x.new_empty(shape)
        if needs_pro:  # (pscale, pshift): float32 CUDA tensors of C contiguous values, the caller's
            if pro is None:
                raise ValueError(f"{exe.plan.describe()} applies an affine prologue: pass pro=(scale, shift)")
            ptrs = (pro[0].data_ptr(), pro[1].data_ptr())
            res = None if res is None and not needs_res else _torch_residual(res, x, shape, needs_res, nhwc)
            launch(xp, wp, y.data_ptr(), 0 if bias is None else bias.data_ptr(), stream_of(device),
                   0 if derived is None else derived.data_ptr(), "all" if derived is None else "rest",
                   0 if res is None else res.data_ptr(), ptrs)
        elif res is not None or needs_res:
            res = _torch_residual(res, x, shape, needs_res, nhwc)
            launch(xp, wp, y.data_ptr(), 0 if bias is None else bias.data_ptr(), stream_of(device),
                   0 if derived is None else derived.data_ptr(), "all" if derived is None else "rest",
                   res.data_ptr())
        elif derived is None:
            launch(xp, wp, y.data_ptr(), 0 if bias is None else bias.data_ptr(), stream_of(device))
        else:
            launch(xp, wp, y.data_ptr(), 0 if bias is None else bias.data_ptr(), stream_of(device),
                   derived.data_ptr(), "rest")
        return y

    run.filters = filters  # type: ignore[attr-defined]  # tests look at it
    return run


def torch_layout_copies(run: Callable[..., Any], conv_pass: str) -> Callable[..., Any]:
    """``run`` (an NCHW plan's torch runner) for channels-last activations where no variant reads them in
    place: the activations copied into NCHW before, the activation it writes (y, dx) into channels_last
    after; dW is the same either way. Two layout copies a call: the price of a layer no NHWC plan serves."""
    import torch

    cl = torch.channels_last

    def nchw(t: Any) -> Any:
        return None if t is None else t.contiguous()

    if conv_pass == "fprop":
        def fprop(x: Any, w: Any, bias: Any = None, derived: Any = None, res: Any = None, pro: Any = None) -> Any:
            return run(nchw(x), w, bias, derived, nchw(res), pro).contiguous(memory_format=cl)

        wrapped: Any = fprop
    else:
        def backward(x: Any, w: Any, y: Any) -> Any:
            out = run(nchw(x), w, nchw(y))
            return out if conv_pass == "wgrad" else out.contiguous(memory_format=cl)

        wrapped = backward
    wrapped.filters = getattr(run, "filters", None)
    wrapped.exe = getattr(run, "exe", None)
    wrapped.copies = True  # not a plan the native fast paths may file
    return wrapped  # type: ignore[no-any-return]


def torch_stream_queries() -> tuple[Callable[[int], int], Callable[[], bool]]:
    """(raw handle of torch's current stream on a device, whether the current stream captures a
    CUDA graph), through torch's cheapest accessors."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    stream_of: Callable[[int], int] = raw if raw is not None else (
        lambda i: int(torch.cuda.current_stream(i).cuda_stream))
    is_capturing: Callable[[], bool] = getattr(torch._C, "_cuda_isCurrentStreamCapturing",
                                               torch.cuda.is_current_stream_capturing)
    return stream_of, is_capturing


def torch_pass_runner(exe: CudaExecutable, device: int) -> Callable[..., Any]:
    """``run(x, w, y) -> out`` for a plan that writes x (dgrad), w (wgrad) or bias (the bias
    gradient) from the others, torch CUDA tensors validated by the caller: the slot of the buffer
    the plan writes is None, the others hold its inputs (dgrad: w and dy in y; wgrad: x and dy;
    bias: dy). The output comes from torch's caching allocator (like the input's dtype and
    device), the stream is torch's current one, misaligned views are copied first, nothing
    synchronises: CUDA-graph capture works as for :func:`torch_runner`.

    A dgrad plan's filter-only steps (the rotated, transposed filter of a forward family serving
    dgrad) are kept per weight tensor and version (:class:`FilterCache`), as fprop's are; under
    capture the whole plan runs. A wgrad plan writes the filters, so nothing is cached for it."""
    import torch

    stream_of, is_capturing = torch_stream_queries()
    exe.reserve(stream_of(device))
    out_name = output_buffer(exe.plan)
    slot, shape, launch = CONV_BUFFERS.index(out_name), exe.plan.spec.shape_of(out_name), exe.launch_raw
    filters = (FilterCache(lambda w, out: _torch_transform(exe, w, out), is_capturing)
               if exe.derived and out_name != "w" else None)
    lookup = filters.get if filters is not None else None
    nhwc = exe.plan.spec.layout == "nhwc" and out_name == "x"  # dx in channels_last memory format, as dy is
    stored = (shape[0], shape[2], shape[3], shape[1]) if nhwc else shape

    def aligned(t: Any) -> tuple[Any, int]:
        p = t.data_ptr()
        if p & 15:
            t = torch.empty_like(t).copy_(t)
            p = t.data_ptr()
        return t, p

    def run(x: Any, w: Any, y: Any) -> Any:
        ptrs = [0, 0, 0, 0]
        like = y
        if x is not None:
            x, ptrs[0] = aligned(x)
            like = x
        if y is not None:
            y, ptrs[2] = aligned(y)
        derived = None
        if w is not None:
            moved = w.data_ptr() & 15
            w, ptrs[1] = aligned(w)
            if lookup is not None and not moved and not is_capturing():
                derived = lookup(w, ptrs[1])
        out = like.new_empty(stored).permute(0, 3, 1, 2) if nhwc else like.new_empty(shape)
        ptrs[slot] = out.data_ptr()
        if derived is None:
            launch(ptrs[0], ptrs[1], ptrs[2], ptrs[3], stream_of(device))
        else:
            launch(ptrs[0], ptrs[1], ptrs[2], ptrs[3], stream_of(device), derived.data_ptr(), "rest")
        return out

    run.filters = filters  # type: ignore[attr-defined]
    run.exe = exe  # type: ignore[attr-defined]  # for the native kernels of the backward ops (ops._file_pass)
    return run


def _torch_residual(res: Any, x: Any, shape: tuple[int, ...], needed: bool, nhwc: bool = False) -> Any:
    """``res`` as the epilogue reads it: contiguous (in channels_last memory format for an NHWC
    plan), of x's dtype, 16-byte aligned, on x's device."""
    import torch

    if not needed:
        raise ValueError("res given to a plan whose epilogue adds no residual (Epilogue(residual=True) "
                         "plans take it)")
    if res is None:
        raise ValueError(f"this plan adds a residual in its epilogue: pass res (a tensor of shape {shape})")
    if tuple(res.shape) != shape:
        raise ValueError(f"res shape {tuple(res.shape)} must equal the output's shape {shape}")
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    if res.dtype != x.dtype or res.device != x.device or not res.is_contiguous(memory_format=fmt):
        res = res.to(device=x.device, dtype=x.dtype).contiguous(memory_format=fmt)  # .to alone keeps a strided self
    if res.data_ptr() & 15:
        res = torch.empty_like(res).copy_(res)
    return res


def torch_transform(exe: CudaExecutable, w: Any, out: Any = None) -> Any:
    """The filter-derived workspace of ``exe`` for weights ``w``, in a packed torch tensor
    (``out`` when given, else a new one; None when the plan has no weight-only steps)."""
    import torch

    if not exe.derived:
        return None
    if w.data_ptr() & 15:
        w = w.contiguous().clone()
    device = w.device.index or 0
    packed = out if out is not None else torch.empty(exe.derived_bytes // 4, dtype=torch.float32,
                                                     device=w.device)
    stream = int(torch.cuda.current_stream(device).cuda_stream)
    exe.reserve(stream)
    exe.launch_raw(0, w.data_ptr(), 0, 0, stream, packed.data_ptr(), "weights")
    return packed


def _torch_transform(exe: CudaExecutable, w: Any, out: Any) -> Any:
    """``torch_transform`` looked up at call time (tests count its calls)."""
    return torch_transform(exe, w, out)
