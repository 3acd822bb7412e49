"""Public API: ``conv2d`` on NumPy (OpenCL), CuPy or torch CUDA arrays (CUDA), and ``algorithms``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from convforge import dispatch, kernels
from convforge.backends import cuda_available, get_backend
from convforge.backends.base import Backend, Executable
from convforge.dispatch import RUNNERS
from convforge.dispatch.choice import needs_finite_exact
from convforge.frontends import fast_path
from convforge.frontends.checks import check_array, check_layout, check_options, same_dtype
from convforge.frontends.keys import cupy_key, torch_key
from convforge.frontends.kinds import device_index, is_channels_last, kind_of, pad_copy
from convforge.frontends.numpy_run import run_host
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Plan
from convforge.spec import ConvSpec, conv_args

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


# The per-call fast path. A flat key of cheap attributes of a device call (frontends/keys.py)
# finds a prepared runner; the key function is chosen by the input's type, registered the first
# time the slow path validates a call with that type. NumPy (OpenCL) calls have no fast path. The
# configuration's precision settings are part of the key (four attribute reads), so changing
# ``config`` takes effect on the next call.
_KEYERS: dict[type, Callable[..., tuple[Any, ...]]] = {}


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
    native = fast_path.RUN
    if native is not None and padding_mode == "zeros":
        y = native(x, w, bias, stride, padding, dilation, algo, backend, workspace_limit, relu, params, precision,
                   max_error, groups)
        if y is not None:
            return y
    return python_conv2d(x, w, bias, stride, padding, dilation, algo, backend, workspace_limit, relu, params,
                         precision, max_error, groups, padding_mode)


_PYTHON_CONV2D = conv2d  # the Python function (its signature and docstring), before any C entry


def _install(front: Callable[..., Any]) -> None:
    """Make ``front`` (the native fast paths' C entries around :func:`python_conv2d`,
    frontends/fast_path.py) ``convforge.conv2d``."""
    import convforge

    globals()["conv2d"] = convforge.conv2d = functools.update_wrapper(front, _PYTHON_CONV2D)  # type: ignore[attr-defined]


def python_conv2d(x: Any, w: Any, bias: Any = None, stride: int | Sequence[int] = 1,
                  padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, algo: str = "auto",
                  backend: str | None = None, workspace_limit: int | None = None, relu: bool = False,
                  params: Params | dict[str, Any] | None = None, precision: str | None = None,
                  max_error: float | None = None, groups: int = 1, padding_mode: str = "zeros") -> Any:
    """:func:`conv2d` without asking the native fast path: for callers that just asked it and
    missed (native.cpp's C entry and the op's CUDA kernel), so a miss is looked up once. A miss whose
    runner is cached is filed again (:func:`_file`): the native table drops its entries when a setting
    is assigned, the runners stay, and a call only run here would stay off the native path for good."""
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
            y = run(x, w, bias)
            _file(keyer is torch_key, run, (x, w, bias, stride, padding, dilation, algo, backend, workspace_limit,
                                            relu, params, precision, max_error, groups))
            return y
    return _conv2d(x, w, bias, stride, padding, dilation, algo, backend, workspace_limit, relu, params,
                   precision, max_error, groups)


fast_path.serve(python_conv2d, _install)


def _conv2d(x: Any, w: Any, bias: Any, stride: Any, padding: Any, dilation: Any, algo: str,
            backend: str | None, workspace_limit: int | None, relu: bool, params: Any,
            precision: str | None, max_error: float | None, groups: Any = 1) -> Any:
    """The first call of a signature: validate everything, choose, compile, build the runner."""
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"params ({params!r}) must be a dict or Params of parameter names and values")
    kind = kind_of(x, "input")
    if kind_of(w, "weights") != kind:
        raise ValueError("input and weights must be the same kind of array")
    if isinstance(padding, str) or len(x.shape) != 4:  # _dropin names a rank other than 3 or 4
        return _dropin(x, w, bias, stride, padding, dilation, groups, "zeros",
                       (algo, backend, workspace_limit, relu, params, precision, max_error))
    dtype = check_array(x, "input", 4, kind)
    same_dtype(dtype, check_array(w, "weights", 4, kind), "weights")
    spec = _spec(tuple(x.shape), tuple(w.shape), stride, padding, dilation, groups, dtype)
    channels_last = kind == "torch" and is_channels_last(x)  # NHWC plans read it as it lies (dispatch.layout_runner)
    if not channels_last:
        check_layout(x, "input", 4)
    check_layout(w, "weights", 4)
    if bias is not None:
        if kind_of(bias, "bias") != kind:
            raise ValueError("bias must be the same kind of array as the input")
        same_dtype(dtype, check_array(bias, "bias", 1, kind), "bias")
        check_layout(bias, "bias", 1)
        if bias.shape[0] != spec.k:
            raise ValueError(f"bias has {bias.shape[0]} entries, weights have K={spec.k}")
    flag, limit = check_options(relu, workspace_limit, precision, max_error)
    bname = backend or ("opencl" if kind == "numpy" else "cuda")
    if kind != "numpy" and bname != "cuda":
        raise ValueError(f"backend ({bname!r}) cannot run {kind} device arrays; use backend='cuda'")
    dev = device_index(x, kind)
    for other, what in ((w, "weights"), (bias, "bias")):
        if other is not None and kind != "numpy" and device_index(other, kind) != dev:
            raise ValueError(f"input is on CUDA device {dev} but {what} are on device {device_index(other, kind)}")
    be = get_backend(bname, dev)
    prm = params if params is None or isinstance(params, Params) else Params(params)
    epi = Epilogue(bias is not None, flag)
    if kind == "numpy":  # near FP32's range 'auto' keeps to a family that overflows only where the answer does
        exact = needs_finite_exact(spec, be, epi, x, w, algo=algo, workspace_limit=limit, params=prm,
                                   precision=precision, max_error=max_error)
        exe = executable_for(spec, be, algo, epi, limit, prm, precision, max_error, exact)
        return run_host(be, exe, {"x": x, "w": w, "bias": bias})
    _KEYERS.setdefault(type(x), torch_key if kind == "torch" else cupy_key)
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
    _file(kind == "torch", run, call)
    return y


def _file(torch_call: bool, run: Any, call: tuple[Any, ...]) -> None:
    """File a call Python's path just ran (conv2d's 14 arguments) with the native fast path of its kind."""
    if torch_call:
        fast_path.file_native(run, call)
    else:
        fast_path.file_cupy_native(run, call)


def _dropin(x: Any, w: Any, bias: Any, stride: Any, padding: Any, dilation: Any, groups: Any, padding_mode: Any,
            opts: tuple[Any, ...]) -> Any:
    """conv2d of an unbatched input, a string padding or a padding mode (:func:`spec.conv_args`): the
    batched, numerically padded call (after the padded copy a mode needs), through ``conv2d`` itself
    (so a warm call of the normalised form takes the fast path), its output unbatched again."""
    kind = kind_of(x, "input")
    if kind_of(w, "weights") != kind:
        raise ValueError("input and weights must be the same kind of array")
    args = conv_args(tuple(x.shape), tuple(w.shape), stride, padding, dilation, padding_mode)
    xb = x[None] if args.unbatched else x
    if args.copy_pad is not None:
        check_array(xb, "input", 4, kind)  # refuse a dtype before copying it
        xb = pad_copy(xb, args.copy_pad, args.mode, kind)
    algo, backend, workspace_limit, relu, params, precision, max_error = opts
    y = conv2d(xb, w, bias, args.stride, args.pad, args.dilation, algo, backend, workspace_limit, relu, params,
               precision, max_error, groups)
    return y[0] if args.unbatched else y


def default_backend() -> str:
    return "cuda" if cuda_available() else "opencl"


def algorithms(spec: ConvSpec | None = None, backend: str | None = None, **shape: Any) -> list[str]:
    """Names of the variants that apply to ``spec`` (or ``ConvSpec.make(**shape)``) on a back-end."""
    spec = spec or ConvSpec.make(**shape)
    device: DeviceInfo = get_backend(backend or default_backend()).device
    return [v.name for v in kernels.select("auto", spec, device)]
