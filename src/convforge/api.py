"""Public API: ``conv2d`` on NumPy (OpenCL), CuPy or torch CUDA arrays (CUDA), and ``algorithms``."""

from __future__ import annotations

import functools
import inspect
import logging
import numbers
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from convforge import caches, dispatch, kernels
from convforge.backends import cuda_available, get_backend
from convforge.backends.base import Backend, Executable, output_buffer
from convforge.config import config, parse_precision
from convforge.dispatch import RUNNERS
from convforge.dispatch.choice import needs_finite_exact
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Plan
from convforge.spec import ConvSpec, conv_args

log = logging.getLogger("convforge")


def _kind(a: Any, what: str) -> str:
    """'numpy', 'cupy' or 'torch' — decided without importing either vendor library."""
    mod = type(a).__module__.split(".")[0]
    if isinstance(a, np.ndarray):
        return "numpy"
    if mod == "cupy":
        return "cupy"
    if mod == "torch":
        if getattr(a, "device", None) is None or a.device.type != "cuda":
            raise ValueError(f"{what} is a torch tensor on {a.device}; convforge runs torch CUDA tensors "
                             "(use .numpy() for the OpenCL path)")
        return "torch"
    raise ValueError(f"{what} must be a NumPy array, CuPy array or torch CUDA tensor, got {type(a).__name__}")


_SPECS: dict[tuple[Any, ...], ConvSpec] = {}


def _spec(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: Any, padding: Any,
          dilation: Any, groups: Any = 1, dtype: str = "float32") -> ConvSpec:
    """ConvSpec.from_shapes, remembered for arguments that are plain ints or tuples of them (it
    runs on every call). Only those: True, 1.0 or (True, 0) equal 1 and (1, 0) as keys, so they
    would find a spec without being checked."""
    if not (_plain(stride) and _plain(padding) and _plain(dilation) and type(groups) is int):
        return ConvSpec.from_shapes(x_shape, w_shape, stride, padding, dilation, groups,  # lists, NumPy ints, ...
                                    dtype=dtype)
    key = (x_shape, w_shape, stride, padding, dilation, groups, dtype)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = ConvSpec.from_shapes(x_shape, w_shape, stride, padding, dilation, groups, dtype=dtype)
    return spec


def _plain(v: Any) -> bool:
    """An int or a tuple of ints, exactly (no bool, no subclass)."""
    return type(v) is int or (type(v) is tuple and all(type(e) is int for e in v))


def _options(relu: Any, workspace_limit: Any, precision: Any, max_error: Any) -> tuple[bool, int | None]:
    """Check conv2d's scalar options; ``relu`` and ``workspace_limit`` as bool and int. A
    ValueError names the option and the value: ``relu="no"`` must not switch ReLU on, nor
    ``max_error=True`` read as 1.0."""
    if not isinstance(relu, bool | np.bool_):
        raise ValueError(f"relu ({relu!r}) must be True or False")
    if workspace_limit is not None:
        if isinstance(workspace_limit, bool | np.bool_) or not isinstance(workspace_limit, numbers.Integral):
            raise ValueError(f"workspace_limit ({workspace_limit!r}) must be an int (bytes) or None")
        if workspace_limit < 0:
            raise ValueError(f"workspace_limit ({workspace_limit}) must be >= 0")
        workspace_limit = operator.index(workspace_limit)
    if precision is not None:
        parse_precision(precision)
    if max_error is not None and (isinstance(max_error, bool | np.bool_) or not isinstance(max_error, numbers.Real)
                                  or not float(max_error) > 0):
        raise ValueError(f"max_error ({max_error!r}) must be a number > 0")
    return bool(relu), workspace_limit


# The storage dtypes each kind of array brings (NumPy and CuPy have no bfloat16).
ARRAY_DTYPES = {"numpy": ("float32", "float16"), "cupy": ("float32", "float16"),
                "torch": ("float32", "float16", "bfloat16")}


# dtypes PyTorch's CUDA convolutions take that convforge does not run: refused, naming PyTorch's op
REFUSED_DTYPES = ("float64", "complex32", "complex64", "complex128", "chalf", "cfloat", "cdouble")


def _check_array(a: Any, what: str, rank: int, kind: str | None = None,
                 op: str = "torch.nn.functional.conv2d") -> str:
    """The array's dtype name, after checking its rank and that ``kind`` arrays of it run (None:
    float32 only, for callers whose plans are float32: the backward passes of grad.py). float64
    and complex arrays are refused with PyTorch's ``op`` named as the way to run them (never cast)."""
    if isinstance(a, np.ndarray) and a.ndim == rank and a.dtype == np.float32:
        return "float32"  # the common case, quickly
    if len(a.shape) != rank:
        raise ValueError(f"{what} must have rank {rank}, got shape {tuple(a.shape)}")
    dtype = str(a.dtype).replace("torch.", "")
    if dtype in REFUSED_DTYPES:
        raise ValueError(f"{what} dtype ({dtype}) is not run by convforge; use {op}")
    allowed = ARRAY_DTYPES[kind] if kind is not None else ("float32",)
    if dtype not in allowed:
        raise ValueError(f"{what} dtype ({dtype}) must be {'one of ' if len(allowed) > 1 else ''}"
                         f"{', '.join(allowed)}" + (f" for {kind} arrays" if kind else ""))
    return dtype


def _same_dtype(dtype: str, other: str, what: str) -> None:
    if other != dtype:
        raise ValueError(f"{what} dtype ({other}) must equal the input's ({dtype}): input, weights and "
                         "bias share one dtype")


def _channels_last(x: Any) -> bool:
    """A torch tensor in channels_last memory format (strides (H*W*C, 1, W*C, C), as
    ``.to(memory_format=torch.channels_last)`` makes them) that is not also NCHW contiguous (C == 1
    or 1x1 images are both, and stay NCHW). From the strides: api.py imports no vendor library."""
    n, c, h, w = x.shape
    return tuple(x.stride()) == (h * w * c, 1, w * c, c) and not x.is_contiguous()


def _check_layout(a: Any, what: str, rank: int) -> None:
    if isinstance(a, np.ndarray) and a.flags.c_contiguous:
        return
    contiguous = (a.flags["C_CONTIGUOUS"] if hasattr(a, "flags") and not callable(a.flags)
                  else a.is_contiguous())
    if not contiguous:
        layout = "NCHW" if rank == 4 else "1-D"
        strides = a.stride() if callable(getattr(a, "stride", None)) else a.strides  # torch: stride(), in elements
        raise ValueError(f"{what} has an unsupported layout (strides {tuple(strides)}): "
                         f"pass a contiguous {layout} array")


def plan_for(spec: ConvSpec, be: Backend, algo: str = "auto", epilogue: Epilogue = Epilogue(),
             workspace_limit: int | None = None, params: Params | None = None,
             precision: str | None = None, max_error: float | None = None) -> Plan:
    """The Plan ``conv2d`` would run for ``spec`` on back-end ``be``."""
    ch = dispatch.choose(spec, be, epilogue, algo=algo, workspace_limit=workspace_limit, params=params,
                         precision=precision, max_error=max_error)
    return ch.variant.plan(spec, ch.params, be.device, epilogue)


def executable_for(spec: ConvSpec, be: Backend, algo: str = "auto", epilogue: Epilogue = Epilogue(),
                   workspace_limit: int | None = None, params: Params | None = None,
                   precision: str | None = None, max_error: float | None = None,
                   finite_exact: bool = False) -> Executable:
    return dispatch.executable(spec, be, epilogue, algo=algo, workspace_limit=workspace_limit, params=params,
                               precision=precision, max_error=max_error, finite_exact=finite_exact)


# The per-call fast path. A flat key of cheap attributes of a device call (see
# dispatch/executables.py) finds a prepared runner; the key function is chosen by the input's
# type, registered the first time the slow path validates a call with that type. NumPy (OpenCL)
# calls have no fast path. The configuration's precision settings are part of the key (four
# attribute reads), so changing ``config`` takes effect on the next call. ``relu`` enters with its
# class unless it is a bool: 1 equals True as a key, and would find a relu=True runner that the
# slow path (which wants a bool) never checked it for.
_KEYERS: dict[type, Callable[..., tuple[Any, ...]]] = {}
# The native fast paths (C++: convforge/torch/native.cpp for torch tensors, backends/cupy_native.cpp
# for CuPy arrays), loaded with the first call of their kind. Each has ``run`` (the output of a call
# the slow path filed with its ``register``, else None) and ``wrap`` (conv2d as a C callable);
# ``convforge.conv2d`` becomes the chain of their wrappers around ``python_conv2d`` (the torch one
# outermost), so a warm call never enters Python and a miss is looked up once in each.
_NATIVE: Any = None  # the torch module, asked by Python's conv2d where its C entry is not installed
_NATIVE_RUN: Callable[..., Any] | None = None
_NATIVE_RUN_RES: Callable[..., Any] | None = None  # a FusedConv2d plan that adds the residual
_NATIVE_TRIED = False
_CUPY_NATIVE: Any = None
_CUPY_TRIED = False
_FRONTS: list[Any] = []  # installed native modules, innermost first


def set_native(module: Any) -> None:
    """Route warm torch calls through ``module`` (native.cpp), from now on."""
    global _NATIVE, _NATIVE_RUN, _NATIVE_RUN_RES
    _NATIVE, _NATIVE_RUN, _NATIVE_RUN_RES = module, module.run, module.run_res


# conv2d's defaults as native_core.h's C entry assumes them (``wrap``), checked before it takes over
NATIVE_DEFAULTS = (None, 1, 0, 1, "auto", None, None, False, None, None, None, 1)


def install_native(module: Any) -> None:
    """Make ``module``'s C entry part of ``convforge.conv2d`` (the torch module outermost, since a
    CuPy call costs it one failed type check) and clear its table whenever the configuration or the
    executables change. Where conv2d's defaults are not the ones the C entry assumes, only Python's
    conv2d asks the torch module (``set_native``) and a warning says so."""
    import convforge

    if module in _FRONTS or caches.is_registered(module.clear):  # installed once: its table registered once
        return
    caches.register(module.clear, f"native fast path: {getattr(module, '__name__', module)}",
                    on=("executables", "settings"))
    params = list(inspect.signature(python_conv2d).parameters.values())[2:2 + len(NATIVE_DEFAULTS)]
    if tuple(p.default for p in params) != NATIVE_DEFAULTS:  # later keywords (padding_mode) go to Python
        log.warning("convforge: conv2d's defaults differ from native_core.h's: its C entry is not installed")
        return
    _FRONTS.append(module)
    _FRONTS.sort(key=lambda m: m is _NATIVE)  # torch's last: outermost
    front: Any = python_conv2d
    for m in _FRONTS:
        front = m.wrap(front)
    globals()["conv2d"] = convforge.conv2d = functools.update_wrapper(front, _PYTHON_CONV2D)  # type: ignore[attr-defined]


def _torch_key(x: Any, w: Any, b: Any, stride: Any, padding: Any, dilation: Any, algo: Any, backend: Any,
               workspace_limit: Any, relu: Any, params: Any, precision: Any, max_error: Any,
               groups: Any = 1) -> tuple[Any, ...]:
    return (type(x), type(w), x.shape, w.shape, x.dtype, w.dtype, x.device, w.device,
            x.is_contiguous() or x.stride(), w.is_contiguous(),  # strides tell channels_last from other views
            b is None or (type(b), b.shape, b.dtype, b.device, b.is_contiguous()),
            stride, padding, dilation, algo, backend, workspace_limit,
            relu if relu.__class__ is bool else (relu.__class__, relu), params, precision, max_error,
            groups if groups.__class__ is int else (groups.__class__, groups),
            config.precision, config.max_error, config.autotune, config.db_path, config.finite_exact)


def _cupy_key(x: Any, w: Any, b: Any, stride: Any, padding: Any, dilation: Any, algo: Any, backend: Any,
              workspace_limit: Any, relu: Any, params: Any, precision: Any, max_error: Any,
              groups: Any = 1) -> tuple[Any, ...]:
    return (type(x), type(w), x.shape, w.shape, x.dtype, w.dtype, x.data.device_id, w.data.device_id,
            x.flags.c_contiguous, w.flags.c_contiguous,
            b is None or (type(b), b.shape, b.dtype, b.data.device_id, b.flags.c_contiguous),
            stride, padding, dilation, algo, backend, workspace_limit,
            relu if relu.__class__ is bool else (relu.__class__, relu), params, precision, max_error,
            groups if groups.__class__ is int else (groups.__class__, groups),
            config.precision, config.max_error, config.autotune, config.db_path, config.finite_exact)


def conv2d(x: Any, w: Any, bias: Any = None, stride: int | Sequence[int] = 1,
           padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, algo: str = "auto",
           backend: str | None = None, workspace_limit: int | None = None, relu: bool = False,
           params: Params | dict[str, Any] | None = None, precision: str | None = None,
           max_error: float | None = None, groups: int = 1, padding_mode: str = "zeros") -> Any:
    """Convolve NCHW ``x`` with KCRS ``w`` (float32, float16, or bfloat16 torch tensors: x, w and bias
    of one dtype, the output of it too, accumulation in float32; ``groups`` > 1: w is K x C/groups x R
    x S, as PyTorch's, groups == C a depthwise layer). NumPy input runs on OpenCL and returns NumPy;
    CuPy arrays and torch CUDA tensors run on CUDA on the caller's current stream and return the
    same type on the same device. ``algo`` is 'auto', a family or a variant name; ``precision``
    ('fp32' | 'relaxed') and ``max_error`` bound what 'auto' may pick (default: ``config``).

    F.conv2d's contract: an unbatched (C, H, W) input gives a (K, P, Q) output; ``padding`` is an
    int, (h, w), (top, bottom, left, right), 'valid' or 'same' (stride 1; where the dilated kernel
    extent is even the extra row / column goes at the bottom / right, as PyTorch pads);
    ``padding_mode`` is nn.Conv2d's: 'zeros' (folded into every kernel's loads) or 'reflect',
    'replicate', 'circular', which no variant folds into its loads yet: the input is padded into a
    copy on the arrays' device first (F.pad for torch tensors, cupy.pad for CuPy arrays; np.pad on
    the host for NumPy arrays, before the upload) and the conv runs unpadded on it. float64 and
    complex arrays are refused (``torch.nn.functional.conv2d`` runs them), never cast.

    A warm device call is a dictionary hit and the launches: no conversion objects, no
    synchronisation (torch tensors that require grad work; gradients flow only through
    ``convforge.torch``). Filter transforms (Winograd U, packed GEMM weights): with torch tensors
    they run once per weight tensor and version (``w._version``; in-place updates re-run them) and
    a warm call launches only the remaining steps; CuPy arrays have no version counter, so with
    them the transform runs on every call (backends/base.py ``FilterCache``). Each live weight
    tensor then has one transformed copy on the device, freed with the tensor (the native path
    frees it at its next transform after the tensor is gone).

    A warm call runs in C++ where the native fast paths are built (convforge/torch/native.cpp for
    torch tensors, backends/cupy_native.cpp for CuPy arrays; ``CONVFORGE_NATIVE=0`` turns them off):
    the same lookup, allocation and launches, without Python's per-call cost. With CuPy arrays a tiny
    layer gets a one-launch plan, since its filters are transformed on every call."""
    if _NATIVE_RUN is not None and padding_mode == "zeros":
        y = _NATIVE_RUN(x, w, bias, stride, padding, dilation, algo, backend, workspace_limit, relu, params,
                        precision, max_error, groups)
        if y is not None:
            return y
    return python_conv2d(x, w, bias, stride, padding, dilation, algo, backend, workspace_limit, relu, params,
                         precision, max_error, groups, padding_mode)


_PYTHON_CONV2D = conv2d  # the Python function (its signature and docstring), before any C entry


def python_conv2d(x: Any, w: Any, bias: Any = None, stride: int | Sequence[int] = 1,
                  padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, algo: str = "auto",
                  backend: str | None = None, workspace_limit: int | None = None, relu: bool = False,
                  params: Params | dict[str, Any] | None = None, precision: str | None = None,
                  max_error: float | None = None, groups: int = 1, padding_mode: str = "zeros") -> Any:
    """:func:`conv2d` without asking the native fast path: for callers that just asked it and
    missed (native.cpp's C entry and the op's CUDA kernel), so a miss is looked up once."""
    if padding_mode != "zeros":  # not in the fast path's key: never the zero-padded layer's runner
        return _dropin(x, w, bias, stride, padding, dilation, groups, padding_mode,
                       (algo, backend, workspace_limit, relu, params, precision, max_error))
    keyer = _KEYERS.get(type(x))
    if keyer is not None:
        try:
            run = RUNNERS.get(keyer(x, w, bias, stride, padding, dilation, algo, backend, workspace_limit, relu,
                                    params, precision, max_error, groups))
        except (TypeError, AttributeError):  # unhashable arguments (a list, a params dict), or weights or bias
            run = None  # of another kind than x (no such attribute): the slow path validates and says so
        if run is not None:
            return run(x, w, bias)
    return _conv2d(x, w, bias, stride, padding, dilation, algo, backend, workspace_limit, relu, params,
                   precision, max_error, groups)


def _conv2d(x: Any, w: Any, bias: Any, stride: Any, padding: Any, dilation: Any, algo: str,
            backend: str | None, workspace_limit: int | None, relu: bool, params: Any,
            precision: str | None, max_error: float | None, groups: Any = 1) -> Any:
    """The first call of a signature: validate everything, choose, compile, build the runner."""
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"params ({params!r}) must be a dict or Params of parameter names and values")
    kind = _kind(x, "input")
    if _kind(w, "weights") != kind:
        raise ValueError("input and weights must be the same kind of array")
    if isinstance(padding, str) or len(x.shape) != 4:  # _dropin names a rank other than 3 or 4
        return _dropin(x, w, bias, stride, padding, dilation, groups, "zeros",
                       (algo, backend, workspace_limit, relu, params, precision, max_error))
    dtype = _check_array(x, "input", 4, kind)
    _same_dtype(dtype, _check_array(w, "weights", 4, kind), "weights")
    spec = _spec(tuple(x.shape), tuple(w.shape), stride, padding, dilation, groups, dtype)
    channels_last = kind == "torch" and _channels_last(x)  # NHWC plans read it as it lies (dispatch.layout_runner)
    if not channels_last:
        _check_layout(x, "input", 4)
    _check_layout(w, "weights", 4)
    if bias is not None:
        if _kind(bias, "bias") != kind:
            raise ValueError("bias must be the same kind of array as the input")
        _same_dtype(dtype, _check_array(bias, "bias", 1, kind), "bias")
        _check_layout(bias, "bias", 1)
        if bias.shape[0] != spec.k:
            raise ValueError(f"bias has {bias.shape[0]} entries, weights have K={spec.k}")
    flag, limit = _options(relu, workspace_limit, precision, max_error)
    bname = backend or ("opencl" if kind == "numpy" else "cuda")
    if kind != "numpy" and bname != "cuda":
        raise ValueError(f"backend ({bname!r}) cannot run {kind} device arrays; use backend='cuda'")
    dev = _device_index(x, kind)
    for other, what in ((w, "weights"), (bias, "bias")):
        if other is not None and kind != "numpy" and _device_index(other, kind) != dev:
            raise ValueError(f"input is on CUDA device {dev} but {what} are on device {_device_index(other, kind)}")
    be = get_backend(bname, dev)
    prm = params if params is None or isinstance(params, Params) else Params(params)
    epi = Epilogue(bias is not None, flag)
    if kind == "numpy":  # near FP32's range 'auto' keeps to a family that overflows only where the answer does
        exact = needs_finite_exact(spec, be, epi, x, w, algo=algo, workspace_limit=limit, params=prm,
                                   precision=precision, max_error=max_error)
        exe = executable_for(spec, be, algo, epi, limit, prm, precision, max_error, exact)
        return run_host(be, exe, {"x": x, "w": w, "bias": bias})
    _KEYERS.setdefault(type(x), _torch_key if kind == "torch" else _cupy_key)
    try:
        key: tuple[Any, ...] | None = _KEYERS[type(x)](x, w, bias, stride, padding, dilation, algo, backend,
                                                      workspace_limit, relu, params, precision, max_error, groups)
        hash(key)
    except (TypeError, AttributeError):
        key = None
    kw: dict[str, Any] = dict(algo=algo, precision=precision, max_error=max_error, workspace_limit=limit, params=prm)
    if channels_last:
        run = dispatch.layout_runner(key, spec, be, epi, dev or 0, **kw)
    else:
        run = dispatch.runner(key, spec, be, epi, kind, dev or 0, **kw)
    y = run(x, w, bias)
    call = (x, w, bias, stride, padding, dilation, algo, backend, workspace_limit, relu, params, precision, max_error,
            groups)
    if kind == "torch":
        file_native(run, call)
    else:
        file_cupy_native(run, call)
    return y


def _dropin(x: Any, w: Any, bias: Any, stride: Any, padding: Any, dilation: Any, groups: Any, padding_mode: Any,
            opts: tuple[Any, ...]) -> Any:
    """conv2d of an unbatched input, a string padding or a padding mode (:func:`spec.conv_args`): the
    batched, numerically padded call (after the padded copy a mode needs), through ``conv2d`` itself
    (so a warm call of the normalised form takes the fast path), its output unbatched again."""
    kind = _kind(x, "input")
    if _kind(w, "weights") != kind:
        raise ValueError("input and weights must be the same kind of array")
    args = conv_args(tuple(x.shape), tuple(w.shape), stride, padding, dilation, padding_mode)
    xb = x[None] if args.unbatched else x
    if args.copy_pad is not None:
        _check_array(xb, "input", 4, kind)  # refuse a dtype before copying it
        xb = pad_copy(xb, args.copy_pad, args.mode, kind)
    algo, backend, workspace_limit, relu, params, precision, max_error = opts
    y = conv2d(xb, w, bias, args.stride, args.pad, args.dilation, algo, backend, workspace_limit, relu, params,
               precision, max_error, groups)
    return y[0] if args.unbatched else y


_NUMPY_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}
_TORCH_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def pad_copy(x: Any, pad: tuple[int, int, int, int], mode: str, kind: str | None = None) -> Any:
    """An NCHW array padded by (top, bottom, left, right) in nn.Conv2d's ``mode`` (zeros, reflect,
    replicate, circular), as a new array of its kind on its device (the pad sizes checked by
    ``spec.conv_args``)."""
    kind = kind or _kind(x, "input")
    t, b, left, right = pad
    if kind == "torch":
        import torch.nn.functional as F  # a torch tensor is here: torch is loaded already

        return F.pad(x, (left, right, t, b), mode=_TORCH_MODES[mode])
    widths = ((0, 0), (0, 0), (t, b), (left, right))
    if kind == "cupy":
        import cupy

        return cupy.pad(x, widths, mode=_NUMPY_MODES[mode])
    return np.pad(x, widths, mode=_NUMPY_MODES[mode])  # type: ignore[call-overload]


def file_native(run: Any, call: tuple[Any, ...], residual: bool = False) -> None:
    """File a validated torch call (conv2d's 14 arguments; ``run``, the runner that just ran it)
    with the native fast path (built on the first torch call), with the filters the runner
    transformed for its weights, if any (so the native path does not transform them again: a
    transform during CUDA-graph warm-up would allocate in the graph's pool). ``residual``: the
    plan adds a residual (FusedConv2d), found by ``run_res`` under its own key."""
    global _NATIVE_TRIED
    if not _NATIVE_TRIED:
        _NATIVE_TRIED = True
        from convforge.torch import native

        native.load()
    if _NATIVE is None or getattr(run, "copies", False) or not run.exe.native:
        return  # a runner between layout copies is Python's; the C++ path takes the plans' own layouts
    w = call[1]
    held = run.filters.entry(w, w.data_ptr()) if run.filters is not None else None
    _NATIVE.register(*call, run.exe.native_program(), None if held is None else (w, *held), residual)


def file_native_pass(module: Any, run: Any, args: tuple[Any, ...], out_shape: tuple[int, ...]) -> bool:
    """File a validated backward op's call (native.cpp ``register_pass``'s first 11 arguments;
    ``run``, the pass runner that just ran it) with the native kernel, dgrad with the filters the
    runner transformed for its weights; False where the executable is not one the core launches."""
    exe = getattr(run, "exe", None)
    if module is None or exe is None or not exe.native or getattr(run, "copies", False):
        return False  # a runner between layout copies is Python's: its program reads NCHW
    held = None
    if args[0] == 1 and getattr(run, "filters", None) is not None:
        a = args[2]
        entry = run.filters.entry(a, a.data_ptr())
        held = None if entry is None else (a, *entry)
    return bool(module.register_pass(*args, exe.native_program(), held, out_shape))


def file_cupy_native(run: Any, call: tuple[Any, ...]) -> None:
    """File a validated CuPy call with the CuPy native fast path (built on the first CuPy call)."""
    global _CUPY_TRIED, _CUPY_NATIVE
    if not _CUPY_TRIED:
        _CUPY_TRIED = True
        from convforge.backends import native

        _CUPY_NATIVE = native.load_cupy()
        if _CUPY_NATIVE is not None:
            install_native(_CUPY_NATIVE)  # the loader builds it; the API installs it
    if _CUPY_NATIVE is not None and run.exe.native:
        _CUPY_NATIVE.register(*call, run.exe.native_program())


def _device_index(x: Any, kind: str) -> int | None:
    if kind == "torch":
        return int(x.device.index or 0)
    if kind == "cupy":
        return int(x.data.device_id)
    return None


def run_host(be: Backend, exe: Executable, inputs: dict[str, Any]) -> np.ndarray:
    """Run ``exe`` on host arrays by buffer name (None: absent): upload them, allocate the buffer
    its plan writes (y, x, w or bias), run, download that buffer."""
    spec = exe.plan.spec
    out = output_buffer(exe.plan)
    shape = spec.shape_of(out)
    bufs = {name: be.upload(a) for name, a in inputs.items() if a is not None}
    bufs[out] = be.empty(spec.itemsize * int(np.prod(shape)))
    exe(bufs)
    got = be.download(bufs[out], shape, spec.dtype)
    return got.astype(np.float16) if spec.dtype == "float16" else got  # exact: the kernel stored float16


def default_backend() -> str:
    return "cuda" if cuda_available() else "opencl"


def algorithms(spec: ConvSpec | None = None, backend: str | None = None, **shape: Any) -> list[str]:
    """Names of the variants that apply to ``spec`` (or ``ConvSpec.make(**shape)``) on a back-end."""
    spec = spec or ConvSpec.make(**shape)
    device: DeviceInfo = get_backend(backend or default_backend()).device
    return [v.name for v in kernels.select("auto", spec, device)]
