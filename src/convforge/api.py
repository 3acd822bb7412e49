"""Public API: ``conv2d`` on NumPy (OpenCL), CuPy or torch CUDA arrays (CUDA), and ``algorithms``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from convforge import dispatch, kernels
from convforge.backends import cuda_available, get_backend
from convforge.backends.base import Backend, Executable
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Plan
from convforge.spec import ConvSpec


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
          dilation: Any) -> ConvSpec:
    """ConvSpec.from_shapes, remembered for hashable arguments (it runs on every call)."""
    try:
        key = (x_shape, w_shape, stride, padding, dilation)
        spec = _SPECS.get(key)
    except TypeError:  # lists: build it every time
        return ConvSpec.from_shapes(x_shape, w_shape, stride, padding, dilation)
    if spec is None:
        spec = _SPECS[key] = ConvSpec.from_shapes(x_shape, w_shape, stride, padding, dilation)
    return spec


def _check_array(a: Any, what: str, rank: int) -> None:
    if isinstance(a, np.ndarray) and a.ndim == rank and a.dtype == np.float32:
        return  # the common case, quickly
    if len(a.shape) != rank:
        raise ValueError(f"{what} must have rank {rank}, got shape {tuple(a.shape)}")
    dtype = str(a.dtype).replace("torch.", "")
    if dtype != "float32":
        raise ValueError(f"{what} dtype ({dtype}) must be float32")


def _check_layout(a: Any, what: str, rank: int) -> None:
    if isinstance(a, np.ndarray) and a.flags.c_contiguous:
        return
    contiguous = (a.flags["C_CONTIGUOUS"] if hasattr(a, "flags") and not callable(a.flags)
                  else a.is_contiguous())
    if not contiguous:
        layout = "NCHW" if rank == 4 else "1-D"
        raise ValueError(f"{what} has an unsupported layout (strides {tuple(a.strides)}): "
                         f"pass a contiguous {layout} array")


def plan_for(spec: ConvSpec, be: Backend, algo: str = "auto", epilogue: Epilogue = Epilogue(),
             workspace_limit: int | None = None, params: Params | None = None) -> Plan:
    """The Plan ``conv2d`` would run for ``spec`` on back-end ``be``."""
    ch = dispatch.choose(spec, be, epilogue, algo=algo, workspace_limit=workspace_limit, params=params)
    return ch.variant.plan(spec, ch.params, be.device, epilogue)


def executable_for(spec: ConvSpec, be: Backend, algo: str = "auto", epilogue: Epilogue = Epilogue(),
                   workspace_limit: int | None = None, params: Params | None = None) -> Executable:
    return dispatch.executable(spec, be, epilogue, algo=algo, workspace_limit=workspace_limit, params=params)


def conv2d(x: Any, w: Any, bias: Any = None, stride: int | Sequence[int] = 1,
           padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, algo: str = "auto",
           backend: str | None = None, workspace_limit: int | None = None, relu: bool = False,
           params: Params | dict[str, Any] | None = None) -> Any:
    """Convolve NCHW ``x`` with KCRS ``w`` (float32). NumPy input runs on OpenCL and returns NumPy;
    CuPy arrays and torch CUDA tensors run on CUDA on the caller's current stream and return the
    same type on the same device. ``algo`` is 'auto', a family or a variant name."""
    kind = _kind(x, "input")
    if _kind(w, "weights") != kind:
        raise ValueError("input and weights must be the same kind of array")
    _check_array(x, "input", 4)
    _check_array(w, "weights", 4)
    spec = _spec(tuple(x.shape), tuple(w.shape), stride, padding, dilation)
    _check_layout(x, "input", 4)
    _check_layout(w, "weights", 4)
    if bias is not None:
        if _kind(bias, "bias") != kind:
            raise ValueError("bias must be the same kind of array as the input")
        _check_array(bias, "bias", 1)
        _check_layout(bias, "bias", 1)
        if bias.shape[0] != spec.k:
            raise ValueError(f"bias has {bias.shape[0]} entries, weights have K={spec.k}")
    if workspace_limit is not None and workspace_limit < 0:
        raise ValueError(f"workspace_limit ({workspace_limit}) must be >= 0")
    bname = backend or ("opencl" if kind == "numpy" else "cuda")
    if kind != "numpy" and bname != "cuda":
        raise ValueError(f"backend ({bname!r}) cannot run {kind} device arrays; use backend='cuda'")
    if kind == "torch" and str(x.device) != str(w.device):
        raise ValueError(f"input is on {x.device} but weights are on {w.device}")
    be = get_backend(bname, _device_index(x, kind))
    prm = Params(params) if isinstance(params, dict) else params
    exe = executable_for(spec, be, algo, Epilogue(bias is not None, relu), workspace_limit, prm)
    if kind == "numpy":
        return _run_host(be, exe, x, w, bias)
    return _run_device(be, exe, x, w, bias)


def _device_index(x: Any, kind: str) -> int | None:
    if kind == "torch":
        return int(x.device.index or 0)
    if kind == "cupy":
        return int(x.device.id)
    return None


def _run_host(be: Backend, exe: Executable, x: Any, w: Any, bias: Any) -> np.ndarray:
    spec = exe.plan.spec
    bufs = {"x": be.upload(x), "w": be.upload(w), "y": be.empty(4 * int(np.prod(spec.y_shape)))}
    if bias is not None:
        bufs["bias"] = be.upload(bias)
    exe(bufs)
    return be.download(bufs["y"], spec.y_shape)


def _run_device(be: Backend, exe: Executable, x: Any, w: Any, bias: Any) -> Any:
    be.use_stream_of(x)  # type: ignore[attr-defined]
    out, yv = be.empty_like_input(x, exe.plan.spec.y_shape)  # type: ignore[attr-defined]
    bufs = {"x": be.wrap(x), "w": be.wrap(w), "y": yv}  # type: ignore[attr-defined]
    if bias is not None:
        bufs["bias"] = be.wrap(bias)  # type: ignore[attr-defined]
    exe(bufs)
    return out


def default_backend() -> str:
    return "cuda" if cuda_available() else "opencl"


def algorithms(spec: ConvSpec | None = None, backend: str | None = None, **shape: Any) -> list[str]:
    """Names of the variants that apply to ``spec`` (or ``ConvSpec.make(**shape)``) on a back-end."""
    spec = spec or ConvSpec.make(**shape)
    device: DeviceInfo = get_backend(backend or default_backend()).device
    return [v.name for v in kernels.select("auto", spec, device)]
