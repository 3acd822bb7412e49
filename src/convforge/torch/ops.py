"""The ``convforge::conv2d`` operator, defined with ``torch.library.Library`` (``define``/``impl``:
cheaper per call than ``custom_op``'s wrapper), with a fake implementation for torch.compile and
an Autograd kernel of its own (a plain redispatch when no gradient is needed, else an
autograd.Function whose backward runs convforge's own backward kernels through three more ops:
``convforge::conv2d_input`` (dgrad), ``convforge::conv2d_weight`` (wgrad) and
``convforge::conv2d_bias`` (the bias reduction), each with a fake implementation, so torch.compile
traces a whole training step, and capturable in a CUDA graph like the forward op).

Where the native fast path is built (native.py), the CUDA and Autograd kernels of ``conv2d`` are C++
(native.cpp) and a warm call never enters Python; otherwise they are the Python functions here. So
are the CUDA kernels of ``conv2d_input`` and ``conv2d_weight``: the first call of a signature runs
``convforge.grad``'s Python path, which files it with native.cpp and checks the filed program against
its own result (:func:`_file_pass`); later calls run in C++ (the rotated filter of a forward family
serving dgrad cached per weight version, as the forward's filters are). ``conv2d_bias`` and the
autograd node itself stay Python's.

Schemas (padding is (top, bottom, left, right); w is K x C/groups x R x S):
``conv2d(Tensor x, Tensor w, Tensor? bias, int[] stride, int[] padding, int[] dilation, str algo,
str? precision, float? max_error, int groups=1) -> Tensor``;
``conv2d_input(SymInt[] input_size, Tensor w, Tensor grad_output, int[] stride, int[] padding,
int[] dilation, int groups, str algo, str? precision, float? max_error) -> Tensor``;
``conv2d_weight(Tensor x, SymInt[] weight_size, Tensor grad_output, ...same...) -> Tensor``;
``conv2d_bias(Tensor grad_output) -> Tensor``. On CPU tensors, dtypes other than float32 and
layers no convforge variant runs (with ``algo="auto"``), every op is PyTorch's computation.
Eager inference in ``Conv2d`` skips the op and calls the prepared runner directly with filters
transformed once per weight version (modules.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from convforge import grad as cf_grad
from convforge.api import python_conv2d as cf_conv2d  # the op's C kernel asked native.cpp already
from convforge.config import config
from convforge.frontends.fast_path import load_torch
from convforge.frontends.kinds import pad_copy
from convforge.spec import ConvSpec, conv_args, normalize_padding

log = logging.getLogger("convforge")

_LIB = torch.library.Library("convforge", "DEF")  # noqa: TOR901 - kept alive for the process
_LIB.define("conv2d(Tensor x, Tensor w, Tensor? bias, int[] stride, int[] padding, int[] dilation, "
            "str algo, str? precision, float? max_error, int groups=1) -> Tensor")
_LIB.define("conv2d_input(SymInt[] input_size, Tensor w, Tensor grad_output, int[] stride, int[] padding, "
            "int[] dilation, int groups, str algo, str? precision, float? max_error) -> Tensor")
_LIB.define("conv2d_weight(Tensor x, SymInt[] weight_size, Tensor grad_output, int[] stride, int[] padding, "
            "int[] dilation, int groups, str algo, str? precision, float? max_error) -> Tensor")
_LIB.define("conv2d_bias(Tensor grad_output) -> Tensor")
_FELL_BACK: set[tuple[Any, ...]] = set()


def output_shape(x_shape: Sequence[Any], w_shape: Sequence[Any], stride: Sequence[int], padding: Sequence[int],
                 dilation: Sequence[int], groups: int = 1) -> tuple[Any, ...]:
    """(N, K, P, Q) of the op: ConvSpec's answer for concrete sizes, its formula for symbolic ones."""
    if all(isinstance(v, int) for v in (*x_shape, *w_shape)):
        return ConvSpec.from_shapes(tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding),
                                    tuple(dilation), groups).y_shape
    n, _, h, w = x_shape
    k, _, r, s = w_shape
    t, b, left, right = padding
    p = (h + t + b - (r - 1) * dilation[0] - 1) // stride[0] + 1
    q = (w + left + right - (s - 1) * dilation[1] - 1) // stride[1] + 1
    return (n, k, p, q)


def _torch_conv(x: Any, w: Any, bias: Any, stride: Sequence[int], padding: Sequence[int],
                dilation: Sequence[int], groups: int = 1) -> Any:
    """PyTorch's convolution with convforge's (top, bottom, left, right) padding, in the inputs' dtype
    (autocast, still on below the op's autograd kernel, would cast float32 inputs to half)."""
    t, b, left, right = padding
    with torch.autocast(x.device.type, enabled=False):
        if t != b or left != right:
            return F.conv2d(F.pad(x, (left, right, t, b)), w, bias, tuple(stride), 0, tuple(dilation), groups)
        return F.conv2d(x, w, bias, tuple(stride), (t, left), tuple(dilation), groups)


def _cuda(x: Any, w: Any, bias: Any, stride: list[int], padding: list[int], dilation: list[int], algo: str,
          precision: str | None, max_error: float | None, groups: int = 1) -> Any:
    """convforge's fast path (a dictionary hit and the launches; filters cached per weight version); a
    half-precision layer no fast variant serves goes to PyTorch (:func:`handed_back`)."""
    if x.dtype in _HALF and _slow_call("fprop", x.shape, w.shape, stride, padding, dilation, groups, x.dtype,
                                       channels_last(x), x.device.index or 0, algo, precision, max_error):
        return _torch_conv(x, w, bias, stride, padding, dilation, groups)
    try:
        return cf_conv2d(activation(x), w.contiguous(), bias, (*stride,), (*padding,), (*dilation,), algo, None,
                         None, False, None, precision, max_error, groups)
    except ValueError as err:  # a layer no convforge variant runs: PyTorch's, logged once
        if algo != "auto":
            raise
        tag = (tuple(x.shape), tuple(w.shape), tuple(stride), tuple(padding), tuple(dilation), groups)
        if tag not in _FELL_BACK:
            _FELL_BACK.add(tag)
            log.warning("convforge: %s; PyTorch runs this layer", err)
        return _torch_conv(x, w, bias, stride, padding, dilation, groups)


_HALF_OR_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)
HANDED_BACK: dict[str, str] = {}  # layer (pass, spec) -> why PyTorch runs it: what convert / fuse reports list
_SLOW: dict[tuple[Any, ...], str | None] = {}
# Below this much work a layer costs about a launch on any kernel, tensor cores or not: it stays ours
HAND_BACK_FLOPS = 100_000_000


def handed_back(spec: ConvSpec, device: int, algo: str, precision: str | None, max_error: float | None) -> str | None:
    """Why a half-precision layer goes to PyTorch rather than to the variant ``auto`` would pick for it
    (``dispatch.slow_reason``: no tensor-core or memory-bound variant serves it, so ours would run far
    below cuDNN), or None; logged once per layer and kept in :data:`HANDED_BACK`. A named ``algo``
    always runs what it names; float32 layers, and layers of under :data:`HAND_BACK_FLOPS` (launch-bound
    on any kernel), always run ours."""
    if algo != "auto" or spec.dtype not in ("float16", "bfloat16") or spec.flops < HAND_BACK_FLOPS:
        return None
    key = (spec, device, precision, max_error, config.precision, config.max_error, config.db_path)
    if key in _SLOW:
        return _SLOW[key]
    from convforge import dispatch
    from convforge.backends import get_backend
    from convforge.plan import Epilogue

    be = get_backend("cuda", device)
    try:
        ch = dispatch.choose(spec, be, Epilogue(), algo="auto", precision=precision, max_error=max_error)
        why = dispatch.slow_reason(spec, be.device, ch.variant, ch.params)
    except ValueError as err:  # no variant at all: the caller's own fallback says so
        why = str(err)
    _SLOW[key] = why
    if why is not None:  # one entry a layer, whichever layout its activations came in
        HANDED_BACK[f"{spec.conv_pass} {dataclasses.replace(spec, layout='nchw').short()}"] = why
        log.warning("convforge: %s; PyTorch runs the %s of this layer", why, spec.conv_pass)
    return why


_CALLS: dict[tuple[Any, ...], str | None] = {}  # a call's cheap signature -> handed_back's answer


def _slow_call(conv_pass: str, x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int],
               padding: Sequence[int], dilation: Sequence[int], groups: int, dtype: Any, nhwc: bool, device: int,
               algo: str, precision: str | None, max_error: float | None) -> str | None:
    """:func:`handed_back` for a half-precision call, by its cheap signature (a dictionary hit once seen)."""
    tag = (conv_pass, tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding), tuple(dilation), groups, dtype,
           nhwc, device, algo, precision, max_error, config.precision, config.max_error, config.db_path)
    try:
        return _CALLS[tag]
    except KeyError:
        pass
    spec = _half_spec(conv_pass, x_shape, w_shape, stride, padding, dilation, groups, dtype, nhwc)
    why = _CALLS[tag] = None if spec is None else handed_back(spec, device, algo, precision, max_error)
    return why


def _half_spec(conv_pass: str, x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int],
               padding: Sequence[int], dilation: Sequence[int], groups: int, dtype: Any,
               nhwc: bool) -> ConvSpec | None:
    """The (pass, layer) spec of a half-precision call, or None for other dtypes and shapes it refuses."""
    if dtype not in _HALF:
        return None
    try:
        return ConvSpec.from_shapes(tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding), tuple(dilation),
                                    groups, dtype=str(dtype).replace("torch.", ""), conv_pass=conv_pass,
                                    layout="nhwc" if nhwc else "nchw")
    except ValueError:
        return None
_CL = torch.channels_last


def channels_last(t: Any) -> bool:
    """A 4-D tensor NHWC plans read as it lies (``frontends.kinds.is_channels_last``'s rule, native.cpp's
    ``nhwc``): channels_last and not also NCHW-contiguous (C == 1 counts as NCHW), or a contiguous batch
    of 1x1 images of several channels (one memory in both layouts)."""
    if t.dim() != 4:
        return False
    if t.shape[2] == 1 and t.shape[3] == 1:
        return bool(t.shape[1] > 1 and t.is_contiguous())
    return not t.is_contiguous() and t.is_contiguous(memory_format=_CL)


def activation(t: Any) -> Any:
    """An activation as convforge's kernels read it: channels_last as it lies (NHWC plans), anything
    else NCHW-contiguous."""
    return t if channels_last(t) else t.contiguous()


def _fake(x: Any, w: Any, bias: Any, stride: list[int], padding: list[int], dilation: list[int], algo: str,
          precision: str | None, max_error: float | None, groups: int = 1) -> Any:
    return x.new_empty(output_shape(x.shape, w.shape, stride, padding, dilation, groups))


def _cpu(x: Any, w: Any, bias: Any, stride: list[int], padding: list[int], dilation: list[int], algo: str,
         precision: str | None, max_error: float | None, groups: int = 1) -> Any:
    """CPU tensors: PyTorch's convolution (convforge runs torch tensors on CUDA only)."""
    return _torch_conv(x, w, bias, stride, padding, dilation, groups)


_LIB.impl("conv2d", _cpu, "CPU")
torch.library.register_fake("convforge::conv2d", _fake, lib=_LIB)


OP = torch.ops.convforge.conv2d.default  # the overload: callers skip the packet's resolution
_OP = OP
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd
_GRAD_ENABLED = torch.is_grad_enabled
_ADIOV = torch._C.DispatchKey.ADInplaceOrView
_DIRECT = {torch._C.DispatchKey.CUDA: _cuda, torch._C.DispatchKey.CPU: _cpu}


def _below(keyset: Any, x: Any, w: Any, bias: Any, stride: list[int], padding: list[int], dilation: list[int],
           algo: str, precision: str | None, max_error: float | None, groups: int = 1) -> Any:
    """The op below autograd. When the next kernel is simply our CUDA (or CPU) one (no fake or
    functional tensors, no Python mode: only ADInplaceOrView, a fallthrough here, lies between),
    it is called directly, saving the dispatcher's second round trip through Python; otherwise
    the dispatcher redispatches."""
    after = keyset & _AFTER_AUTOGRAD
    kernel = _DIRECT.get(after.remove(_ADIOV).highestPriorityTypeId())
    if kernel is not None:
        return kernel(x, w, bias, stride, padding, dilation, algo, precision, max_error, groups)
    with _BELOW_AUTOGRAD():
        return _OP.redispatch(after, x, w, bias, stride, padding, dilation, algo, precision, max_error, groups)


class _Conv2dFn(torch.autograd.Function):
    """The op's autograd node: forward is the op itself (grad mode is off inside, so it goes below
    autograd), backward is convforge's: the gradient of x through ``convforge::conv2d_input``, of w
    through ``convforge::conv2d_weight``, of the bias through ``convforge::conv2d_bias``, each
    chosen per (layer, pass, precision class) by dispatch, in the forward's precision class and
    max_error (the forward's ``algo`` where it names something that computes the pass, else auto).
    The groups travel with the op (its last argument), so a grouped forward differentiates too."""

    @staticmethod
    def forward(ctx: Any, x: Any, w: Any, bias: Any, stride: list[int], padding: list[int], dilation: list[int],
                algo: str, precision: str | None, max_error: float | None, groups: int = 1) -> Any:
        y = _OP(x, w, bias, stride, padding, dilation, algo, precision, max_error, groups)
        ctx.save_for_backward(x, w)
        ctx.conv = (list(stride), list(padding), list(dilation), bias is not None, algo, precision, max_error,
                    groups)
        return y

    @staticmethod
    def backward(ctx: Any, gy: Any) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        stride, padding, dilation, has_bias, algo, precision, max_error, groups = ctx.conv
        # sum().backward() hands an expanded tensor (zero strides); a channels_last layer's gradient
        # stays channels_last, as its output was
        gy = gy.contiguous(memory_format=_CL) if channels_last(x) else gy.contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = INPUT_OP(list(x.shape), w, gy, stride, padding, dilation, groups, algo, precision, max_error)
        if ctx.needs_input_grad[1]:
            gw = WEIGHT_OP(x, list(w.shape), gy, stride, padding, dilation, groups, algo, precision, max_error)
        if has_bias and ctx.needs_input_grad[2]:
            gb = BIAS_OP(gy)
        return gx, gw, gb, None, None, None, None, None, None, None


def _grad_apply(x: Any, w: Any, bias: Any, stride: list[int], padding: list[int], dilation: list[int], algo: str,
                precision: str | None, max_error: float | None, groups: int = 1) -> Any:
    """The op when a gradient is needed: through its autograd node."""
    return _Conv2dFn.apply(x, w, bias, stride, padding, dilation, algo, precision, max_error, groups)


def _autograd(keyset: Any, x: Any, w: Any, bias: Any, stride: list[int], padding: list[int],
              dilation: list[int], algo: str, precision: str | None, max_error: float | None,
              groups: int = 1) -> Any:
    """The op's Autograd kernel, registered directly (cheaper than ``register_autograd``'s generic
    wrapper): without grad mode or without an input that requires grad it goes straight below
    autograd (:func:`_below`), so no_grad calls pay almost nothing for autograd (inference_mode
    skips this kernel entirely)."""
    if _GRAD_ENABLED() and (x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
        return _grad_apply(x, w, bias, stride, padding, dilation, algo, precision, max_error, groups)
    return _below(keyset, x, w, bias, stride, padding, dilation, algo, precision, max_error, groups)


# -- the backward ops ---------------------------------------------------------------------------

def _torch_input(input_size: Sequence[Any], w: Any, gy: Any, stride: Sequence[int], padding: Sequence[int],
                 dilation: Sequence[int], groups: int) -> Any:
    """PyTorch's gradient of the input (``aten.convolution_backward``), with convforge's (top,
    bottom, left, right) padding: the gradient of the padded input, the pad cut off."""
    t, b, left, right = padding
    sym = t == b and left == right
    n, c, h, wd = input_size
    # x's shape and memory format are all that is read: gy's format, so cuDNN copies neither gy nor dx between
    # layouts (an NCHW x beside a channels_last gy cost two activation copies a layer)
    fmt = _CL if channels_last(gy) else torch.contiguous_format
    x = torch.empty((n, c, h, wd) if sym else (n, c, h + t + b, wd + left + right), dtype=gy.dtype, device=gy.device,
                    memory_format=fmt)
    gx = torch.ops.aten.convolution_backward(gy, x, w, None, list(stride), [t, left] if sym else [0, 0],
                                             list(dilation), False, [0, 0], groups, [True, False, False])[0]
    return gx if sym else gx[:, :, t:t + h, left:left + wd].contiguous(memory_format=fmt)


def _torch_weight(x: Any, weight_size: Sequence[Any], gy: Any, stride: Sequence[int], padding: Sequence[int],
                  dilation: Sequence[int], groups: int) -> Any:
    """PyTorch's gradient of the filters, with convforge's padding (applied to x first)."""
    t, b, left, right = padding
    sym = t == b and left == right
    xin = x if sym else F.pad(x, (left, right, t, b))
    w = gy.new_empty(tuple(weight_size))  # its shape is all that is read (no fill kernel)
    return torch.ops.aten.convolution_backward(gy, xin, w, None, list(stride), [t, left] if sym else [0, 0],
                                               list(dilation), False, [0, 0], groups, [False, True, False])[1]


def _ours(conv_pass: str, call: Any, fallback: Any, tag: tuple[Any, ...], algo: str) -> tuple[Any, str | None]:
    """(``call(name)``, name): convforge.grad with ``algo``, or where that names no variant of the pass
    (the forward's variant or family) with 'auto', remembered per layer so a warm call does not
    fail over again; (``fallback()``, None) where no variant of the pass runs the layer (PyTorch's,
    logged once)."""
    why: ValueError | None = None
    first = _RETRIED.get((tag, algo), algo)
    for name in dict.fromkeys((first, algo, "auto")):
        try:
            out = call(name)
        except ValueError as err:
            why = err
            continue
        if name != algo:
            _RETRIED[(tag, algo)] = name
        return out, name
    if tag not in _FELL_BACK:
        _FELL_BACK.add(tag)
        log.warning("convforge: %s; PyTorch computes the %s of this layer", why, conv_pass)
    return fallback(), None


_RETRIED: dict[tuple[Any, ...], str] = {}  # (layer tag, algo asked) -> the algo that computed the pass


def _input_cuda(input_size: list[int], w: Any, gy: Any, stride: list[int], padding: list[int], dilation: list[int],
                groups: int, algo: str, precision: str | None, max_error: float | None) -> Any:
    """convforge's dgrad (``convforge.grad.conv2d_input``'s fast path); the call is filed with the
    native kernel where there is one (:func:`_file_pass`)."""
    if w.dtype not in _HALF_OR_FLOAT or gy.dtype != w.dtype:
        return _torch_input(input_size, w, gy, stride, padding, dilation, groups)
    if w.dtype in _HALF and _slow_call("dgrad", input_size, w.shape, stride, padding, dilation, groups, w.dtype,
                                       channels_last(gy), gy.device.index or 0, algo, precision, max_error):
        return _torch_input(input_size, w, gy, stride, padding, dilation, groups)
    size, st, pad, dl = (*input_size,), (*stride,), (*padding,), (*dilation,)
    wc, gc = w.contiguous(), activation(gy)
    out, used = _ours("dgrad", lambda a: cf_grad.conv2d_input(size, wc, gc, st, pad, dl, groups, a, precision,
                                                              max_error),
                      lambda: _torch_input(input_size, w, gy, stride, padding, dilation, groups),
                      ("dgrad", size, tuple(w.shape), st, pad, dl, groups), algo)
    if _PASS_OPS and not _CHECKING and used is not None and gc is gy and _files(gc):  # native.cpp makes w KCRS too
        _file_guarded(1, size, wc, gc, (st, pad, dl, groups, algo, precision, max_error), out, used)
    return out


def _files(g: Any) -> bool:
    """Whether native.cpp's backward kernels take a call of this gradient (NCHW-contiguous or channels_last)."""
    return g.is_contiguous() or channels_last(g)


def _weight_cuda(x: Any, weight_size: list[int], gy: Any, stride: list[int], padding: list[int],
                 dilation: list[int], groups: int, algo: str, precision: str | None, max_error: float | None) -> Any:
    """convforge's wgrad (``convforge.grad.conv2d_weight``'s fast path); filed as dgrad's."""
    if x.dtype not in _HALF_OR_FLOAT or gy.dtype != x.dtype:
        return _torch_weight(x, weight_size, gy, stride, padding, dilation, groups)
    if x.dtype in _HALF and _slow_call("wgrad", x.shape, weight_size, stride, padding, dilation, groups, x.dtype,
                                       channels_last(x) or channels_last(gy), x.device.index or 0, algo, precision,
                                       max_error):
        return _torch_weight(x, weight_size, gy, stride, padding, dilation, groups)
    size, st, pad, dl = (*weight_size,), (*stride,), (*padding,), (*dilation,)
    xc, gc = activation(x), activation(gy)
    out, used = _ours("wgrad", lambda a: cf_grad.conv2d_weight(xc, size, gc, st, pad, dl, groups, a, precision,
                                                               max_error),
                      lambda: _torch_weight(x, weight_size, gy, stride, padding, dilation, groups),
                      ("wgrad", tuple(x.shape), size, st, pad, dl, groups), algo)
    if _PASS_OPS and not _CHECKING and used is not None and xc is x and gc is gy and _files(gc) and _files(xc):
        _file_guarded(2, size, xc, gc, (st, pad, dl, groups, algo, precision, max_error), out, used)
    return out


_PASS_OPS = False  # True once native.cpp runs the backward ops' CUDA kernels (the end of this module)
_CHECKING = False  # a filed call being checked (a miss then must not file again)


def _file_guarded(kind: int, size: tuple[int, ...], a: Any, g: Any, opts: tuple[Any, ...], out: Any,
                  used: str) -> None:
    """:func:`_file_pass`; filing is only a speed-up, so a failure in it turns filing off (logged)
    and the calls stay on Python's path, which has just given the right answer."""
    global _PASS_OPS
    try:
        _file_pass(kind, size, a, g, opts, out, used)
    except Exception as err:  # noqa: BLE001 - never let the speed-up break a backward pass
        _PASS_OPS = False
        log.warning("convforge: filing backward calls with the native kernels failed (%s: %s); they stay on "
                    "Python's path", type(err).__name__, err)


def _file_pass(kind: int, size: tuple[int, ...], a: Any, g: Any, opts: tuple[Any, ...], out: Any,
               used: str) -> None:
    """File a backward call that Python just ran with native.cpp (``kind`` 1 dgrad, ``a`` the weight; 2
    wgrad, ``a`` the input; ``used`` the algo that ran it, found under its runner, the call filed
    under the op's ``algo``), then check it: the op called again now runs the filed program, and the
    same kernels on the same inputs must give the same values (bit for bit with deterministic
    reductions), else the entry is dropped and the call stays Python's, logged once. Not while a
    CUDA graph is captured, and only for an executable the native core can launch."""
    from convforge.frontends.fast_path import file_native_pass

    st, pad, dl, groups, algo, precision, max_error = opts
    tag = "dgrad" if kind == 1 else "wgrad"
    keyer, nat = cf_grad._KEYERS.get(type(g)), NATIVE
    if keyer is None or nat is None or torch.cuda.is_current_stream_capturing():
        return
    try:
        run = cf_grad.RUNNERS.get(keyer(tag, a, g, size, st, pad, dl, groups, used, None, None, None, precision,
                                        max_error))
    except (TypeError, AttributeError):
        return
    args = (kind, list(size), a, g, list(st), list(pad), list(dl), groups, algo, precision,
            None if max_error is None else float(max_error))
    if run is None or getattr(run, "unfiled", False):
        return
    if not file_native_pass(nat, run, args, tuple(out.shape)):
        run.unfiled = True  # type: ignore[attr-defined]  # not an executable the core launches: not asked again
        return
    global _CHECKING
    op = INPUT_OP if kind == 1 else WEIGHT_OP
    hit = same = False
    try:
        misses = nat.stats()["op_fallbacks"]
        _CHECKING = True
        again = op(list(size), a, g, *args[4:]) if kind == 1 else op(a, list(size), g, *args[4:])
        hit = nat.stats()["op_fallbacks"] == misses  # the filed program ran, not Python's path again
        same = torch.equal(again, out) if config.deterministic else torch.allclose(again, out, rtol=1e-5, atol=1e-7)
    finally:
        _CHECKING = False
        if not (hit and same):  # unchecked or different: never left filed
            nat.forget_pass(*args)
    if not (hit and same):
        run.unfiled = True  # type: ignore[attr-defined]
        if (tag, size) not in _FELL_BACK:
            _FELL_BACK.add((tag, size))
            log.warning("convforge: the native %s of %s %s; it stays on Python's path", tag, size,
                        "gave other values than Python's" if hit else "was not found where it was filed")


def _bias_cuda(gy: Any) -> Any:
    """convforge's bias reduction (``convforge.grad.conv2d_bias``)."""
    if gy.dtype != torch.float32 or gy.dim() != 4:
        return gy.sum(dim=[d for d in range(gy.dim()) if d != 1])
    return cf_grad.conv2d_bias(gy.contiguous())


def _input_cpu(input_size: list[int], w: Any, gy: Any, stride: list[int], padding: list[int], dilation: list[int],
               groups: int, algo: str, precision: str | None, max_error: float | None) -> Any:
    return _torch_input(input_size, w, gy, stride, padding, dilation, groups)


def _weight_cpu(x: Any, weight_size: list[int], gy: Any, stride: list[int], padding: list[int],
                dilation: list[int], groups: int, algo: str, precision: str | None, max_error: float | None) -> Any:
    return _torch_weight(x, weight_size, gy, stride, padding, dilation, groups)


def _bias_cpu(gy: Any) -> Any:
    return gy.sum(dim=[d for d in range(gy.dim()) if d != 1])


def _input_fake(input_size: list[Any], w: Any, gy: Any, *rest: Any) -> Any:
    return gy.new_empty(list(input_size))


def _weight_fake(x: Any, weight_size: list[Any], gy: Any, *rest: Any) -> Any:
    return x.new_empty(list(weight_size))


def _bias_fake(gy: Any) -> Any:
    return gy.new_empty((gy.shape[1],))


for _name, _cuda_fn, _cpu_fn, _fake_fn in (("conv2d_input", _input_cuda, _input_cpu, _input_fake),
                                          ("conv2d_weight", _weight_cuda, _weight_cpu, _weight_fake),
                                          ("conv2d_bias", _bias_cuda, _bias_cpu, _bias_fake)):
    if _name == "conv2d_bias" or load_torch() is None:  # else native.cpp's (the end of this module)
        _LIB.impl(_name, _cuda_fn, "CUDA")
    _LIB.impl(_name, _cpu_fn, "CPU")
    torch.library.register_fake(f"convforge::{_name}", _fake_fn, lib=_LIB)

INPUT_OP = torch.ops.convforge.conv2d_input.default
WEIGHT_OP = torch.ops.convforge.conv2d_weight.default
BIAS_OP = torch.ops.convforge.conv2d_bias.default


# The CUDA and Autograd kernels: C++ where the native fast path is built (native.cpp: a warm call
# never enters Python; a miss calls _cuda, a call needing a gradient _grad_apply), else Python's.
NATIVE = load_torch()
if NATIVE is not None:
    NATIVE.register_op(_cuda, _grad_apply)
    NATIVE.register_pass_ops(_input_cuda, _weight_cuda)  # misses come back to them, which file the call
    _PASS_OPS = True
else:
    _LIB.impl("conv2d", _cuda, "CUDA")
    _LIB.impl("conv2d", _autograd, "Autograd", with_keyset=True)


def conv2d(x: Any, w: Any, bias: Any = None, stride: int | Sequence[int] = 1,
           padding: int | str | Sequence[int] = 0, dilation: int | Sequence[int] = 1, algo: str = "auto",
           precision: str | None = None, max_error: float | None = None, groups: int = 1,
           padding_mode: str = "zeros") -> Any:
    """``torch.ops.convforge.conv2d`` with the loose argument forms of ``convforge.conv2d``:
    differentiable, traceable by torch.compile, capturable in CUDA graphs. F.conv2d's contract as
    ``convforge.conv2d``'s (unbatched inputs, 'same' / 'valid', padding modes: :func:`_dropin`)."""
    if padding_mode != "zeros" or isinstance(padding, str) or x.dim() == 3:
        return _dropin(x, w, bias, stride, padding, dilation, algo, precision, max_error, groups, padding_mode)
    st = (stride, stride) if isinstance(stride, int) else tuple(stride)
    dl = (dilation, dilation) if isinstance(dilation, int) else tuple(dilation)
    return _OP(x, w, bias, list(st), list(normalize_padding(padding)), list(dl), algo, precision, max_error, groups)


def _dropin(x: Any, w: Any, bias: Any, stride: Any, padding: Any, dilation: Any, algo: str, precision: str | None,
            max_error: float | None, groups: int, padding_mode: str) -> Any:
    """The op on a batch of one for an unbatched input, with numeric padding for 'same' / 'valid',
    after a padded copy (F.pad, differentiable) for a padding mode (``spec.conv_args``)."""
    args = conv_args(tuple(x.shape), tuple(w.shape), stride, padding, dilation, padding_mode)
    xb = x.unsqueeze(0) if args.unbatched else x
    if args.copy_pad is not None:
        xb = pad_copy(xb, args.copy_pad, args.mode, "torch")
    y = _OP(xb, w, bias, list(args.stride), list(args.pad), list(args.dilation), algo, precision, max_error, groups)
    return y.squeeze(0) if args.unbatched else y
