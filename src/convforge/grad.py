"""The backward passes of a convolution, in PyTorch's convention (``torch.nn.grad``):
``conv2d_input`` (dgrad, bprop: the gradient of the input), ``conv2d_weight`` (wgrad, update: the
gradient of the filters) and ``conv2d_bias`` (the gradient of a per-channel bias).

Each pass is a problem of its own, (spec, pass, dtype, precision class): the spec is the forward
layer with ``conv_pass`` set, and ``convforge.dispatch`` chooses its variant exactly as for fprop
(the tuning database's entry for that pass first, then the heuristic among the variants that
compute it), so whatever variants of a pass exist serve it. NumPy arrays run on OpenCL and come
back as NumPy; CuPy arrays and torch CUDA tensors run on CUDA on the caller's current stream and
come back as the same type on the same device. A warm device call is a dictionary hit and the
launches (the Python fast path: a key of cheap attributes finds a prepared runner in
``dispatch.RUNNERS``); a dgrad plan's filter transform (a forward family serving dgrad through the
rotated filter) runs once per weight tensor and version with torch tensors, as fprop's does.

Arrays take the dtypes ``conv2d`` takes for their kind (all of one dtype; float64 and complex refused,
naming PyTorch's function); dispatch chooses among the variants serving that (pass, dtype). Padding
is as in ``conv2d``: an int, (h, w) or (top, bottom, left, right). The size argument
(``input_size`` / ``weight_size``, as PyTorch's) fixes what ``grad_output`` alone cannot: with a
stride above 1 several input sizes give the same output size.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from convforge import caches, dispatch
from convforge.backends import get_backend
from convforge.dispatch import RUNNERS
from convforge.frontends.checks import check_array, check_layout, check_options, same_dtype
from convforge.frontends.keys import cupy_pass_key, torch_pass_key
from convforge.frontends.kinds import device_index, is_channels_last, kind_of, runner_maker
from convforge.frontends.numpy_run import run_host
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.spec import ConvSpec

__all__ = ["conv2d_input", "conv2d_weight", "conv2d_bias"]

_KEYERS: dict[type, Callable[..., tuple[Any, ...]]] = {}
_SIZE_FORMS = {"input_size": "(N, C, H, W)", "weight_size": "(K, C/groups, R, S)"}


def conv2d_input(input_size: Sequence[int], weight: Any, grad_output: Any, stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1,
                 algo: str = "auto", precision: str | None = None, max_error: float | None = None,
                 backend: str | None = None, workspace_limit: int | None = None,
                 params: Params | dict[str, Any] | None = None) -> Any:
    """The gradient of conv2d's input (dgrad): ``input_size`` (N, C, H, W) of the forward input,
    KCRS ``weight`` and ``grad_output`` (N, K, P, Q) of the forward layer ``stride``, ``padding``,
    ``dilation``, ``groups``; an array of ``input_size`` of the arrays' kind. ``algo``,
    ``precision``, ``max_error``, ``workspace_limit`` and ``params`` choose the dgrad variant as
    they choose conv2d's."""
    keyer = _KEYERS.get(type(grad_output))
    if keyer is not None:
        try:
            run = RUNNERS.get(keyer("dgrad", weight, grad_output, input_size, stride, padding, dilation, groups,
                                    algo, backend, workspace_limit, params, precision, max_error))
        except (TypeError, AttributeError):  # unhashable arguments, or arrays of another kind
            run = None
        if run is not None:
            return run(None, weight, grad_output)
    return _backward("dgrad", input_size, weight, grad_output, stride, padding, dilation, groups, algo,
                     precision, max_error, backend, workspace_limit, params)


def conv2d_weight(input: Any, weight_size: Sequence[int], grad_output: Any, stride: int | Sequence[int] = 1,
                  padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1,
                  algo: str = "auto", precision: str | None = None, max_error: float | None = None,
                  backend: str | None = None, workspace_limit: int | None = None,
                  params: Params | dict[str, Any] | None = None) -> Any:
    """The gradient of conv2d's filters (wgrad): NCHW ``input`` of the forward layer,
    ``weight_size`` (K, C/groups, R, S) and ``grad_output`` (N, K, P, Q); an array of
    ``weight_size`` of the arrays' kind. Options as :func:`conv2d_input`."""
    keyer = _KEYERS.get(type(grad_output))
    if keyer is not None:
        try:
            run = RUNNERS.get(keyer("wgrad", input, grad_output, weight_size, stride, padding, dilation, groups,
                                    algo, backend, workspace_limit, params, precision, max_error))
        except (TypeError, AttributeError):
            run = None
        if run is not None:
            return run(input, None, grad_output)
    return _backward("wgrad", weight_size, input, grad_output, stride, padding, dilation, groups, algo,
                     precision, max_error, backend, workspace_limit, params)


def conv2d_bias(grad_output: Any, backend: str | None = None) -> Any:
    """The gradient of a per-channel bias: ``grad_output`` (N, K, P, Q) summed over N, P and Q, K
    values of the array's kind, by a deterministic reduction kernel (``kernels.wgrad.bias_grad_plan``)."""
    keyer = _KEYERS.get(type(grad_output))
    if keyer is not None:
        try:
            run = RUNNERS.get(keyer("bias", grad_output, grad_output, None, 1, 0, 1, 1, "auto", backend, None,
                                    None, None, None))
        except (TypeError, AttributeError):
            run = None
        if run is not None:
            return run(None, None, grad_output)
    return _bias(grad_output, backend)


# -- the first call of a signature: validate, choose, compile, build the runner ------------------

def _size(value: Any, name: str) -> tuple[int, int, int, int]:
    """``value`` as 4 positive ints, else a ValueError naming ``name`` and its form."""
    form = _SIZE_FORMS[name]
    if isinstance(value, str | bytes) or not hasattr(value, "__len__"):
        raise ValueError(f"{name} ({value!r}) must be 4 ints {form}")
    items = tuple(value)
    if len(items) != 4 or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0
                              for v in items):
        raise ValueError(f"{name} ({value!r}) must be 4 positive ints {form}")
    return (int(items[0]), int(items[1]), int(items[2]), int(items[3]))


def _as_channels_last(t: Any) -> Any:
    """A torch tensor in channels_last memory format (itself when it lies so, or is NCHW and NHWC at once)."""
    if is_channels_last(t) or (t.is_contiguous() and (t.shape[1] == 1 or t.shape[2] * t.shape[3] == 1)):
        return t
    import torch

    return t.contiguous(memory_format=torch.channels_last)


def _pass_spec(conv_pass: str, size: Any, a: Any, g: Any, stride: Any, padding: Any, dilation: Any,
               groups: Any, dtype: str = "float32") -> ConvSpec:
    """The forward layer of a backward call with ``conv_pass`` set, every argument checked against
    the others; ValueError naming the argument that does not fit."""
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    if conv_pass == "dgrad":
        sname, aname = "input_size", "weight"
        x_shape, w_shape = _size(size, sname), tuple(int(v) for v in a.shape)
    else:
        sname, aname = "weight_size", "input"
        x_shape, w_shape = tuple(int(v) for v in a.shape), _size(size, sname)
    try:
        spec = ConvSpec.from_shapes(x_shape, w_shape, stride, padding, dilation, groups, dtype, conv_pass)
    except ValueError as err:  # stride, padding, dilation and groups name themselves; shapes do not
        if str(err).startswith(("channel mismatch", "dilated kernel")):
            raise ValueError(f"{sname} {x_shape if sname == 'input_size' else w_shape} and {aname} shape "
                             f"{w_shape if sname == 'input_size' else x_shape}: {err}") from None
        raise
    if tuple(g.shape) != spec.y_shape:
        raise ValueError(f"grad_output has shape {tuple(g.shape)}, but {sname} / {aname} shapes {x_shape} and "
                         f"{w_shape} with stride {spec.stride}, padding {spec.pad}, dilation {spec.dilation} "
                         f"give an output of shape {spec.y_shape}")
    return spec


def _backward(conv_pass: str, size: Any, a: Any, g: Any, stride: Any, padding: Any, dilation: Any, groups: Any,
              algo: str, precision: str | None, max_error: float | None, backend: str | None,
              workspace_limit: int | None, params: Any) -> Any:
    """conv2d_input / conv2d_weight's slow path; ``a`` is the weight (dgrad) or the input (wgrad)."""
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"params ({params!r}) must be a dict or Params of parameter names and values")
    aname = "weight" if conv_pass == "dgrad" else "input"
    kind = kind_of(g, "grad_output")
    if kind_of(a, aname) != kind:
        raise ValueError(f"{aname} and grad_output must be the same kind of array")
    torch_op = "torch.nn.grad." + ("conv2d_input" if conv_pass == "dgrad" else "conv2d_weight")
    dtype = check_array(a, aname, 4, kind, torch_op)
    same_dtype(dtype, check_array(g, "grad_output", 4, kind, torch_op), "grad_output")
    spec = _pass_spec(conv_pass, size, a, g, stride, padding, dilation, groups, dtype)
    # channels-last activations (torch): NHWC plans read them as they lie (dispatch.layout_runner)
    channels_last = kind == "torch" and (is_channels_last(g) or (conv_pass == "wgrad" and is_channels_last(a)))
    if channels_last and conv_pass == "wgrad":
        a, g = _as_channels_last(a), _as_channels_last(g)  # one of the two may lie otherwise: one copy
    for t, what in ((a, aname), (g, "grad_output")):
        if not channels_last or (conv_pass == "dgrad" and t is a):
            check_layout(t, what, 4)
    _, limit = check_options(False, workspace_limit, precision, max_error)
    be, dev = _backend(kind, backend, g, a, aname)
    prm = params if params is None or isinstance(params, Params) else Params(params)
    kw: dict[str, Any] = dict(algo=algo, precision=precision, max_error=max_error, workspace_limit=limit,
                              params=prm)
    inputs = (None, a, g) if conv_pass == "dgrad" else (a, None, g)
    if kind == "numpy":
        exe = dispatch.executable(spec, be, Epilogue(), **kw)
        return run_host(be, exe, dict(zip(("x", "w", "y"), inputs)))
    key = _file_key(kind, g, conv_pass, a, size, stride, padding, dilation, groups, algo, backend, workspace_limit,
                    params, precision, max_error)
    if channels_last:
        return dispatch.layout_runner(key, spec, be, Epilogue(), dev, **kw)(*inputs)
    run = dispatch.runner(key, spec, be, Epilogue(), kind, dev, **kw)
    return run(*inputs)


def _bias(g: Any, backend: str | None) -> Any:
    """conv2d_bias's slow path: the bias-gradient plan of a layer of grad_output's shape."""
    kind = kind_of(g, "grad_output")
    check_array(g, "grad_output", 4)
    check_layout(g, "grad_output", 4)
    n, k, p, q = (int(v) for v in g.shape)
    spec = ConvSpec.make(n, 1, p, q, k, 1, 1, conv_pass="wgrad")  # a 1x1 layer whose output is grad_output's shape
    be, dev = _backend(kind, backend, g)
    exe = _bias_executable(be, spec)
    if kind == "numpy":
        return run_host(be, exe, {"y": g})
    run = runner_maker(kind)(exe, dev)
    key = _file_key(kind, g, "bias", g, None, 1, 0, 1, 1, "auto", backend, None, None, None, None)
    if key is not None:
        RUNNERS[key] = run
    return run(None, None, g)


_BIAS_EXES: dict[tuple[Any, ...], Any] = {}
caches.register(_BIAS_EXES.clear, "grad: bias-gradient executables")


def _bias_executable(be: Any, spec: ConvSpec) -> Any:
    """The compiled bias-gradient plan per back-end and shape (forgotten with dispatch's executables)."""
    key = (be, be.device.key(), spec)
    exe = _BIAS_EXES.get(key)
    if exe is None:
        from convforge.kernels.wgrad import bias_grad_plan

        exe = _BIAS_EXES[key] = be.executable(bias_grad_plan(spec, be.device))
    return exe


def _backend(kind: str, backend: str | None, g: Any, a: Any = None, aname: str = "") -> tuple[Any, int]:
    """(back-end, CUDA device index or 0) for arrays of ``kind``, all on one device."""
    bname = backend or ("opencl" if kind == "numpy" else "cuda")
    if kind != "numpy" and bname != "cuda":
        raise ValueError(f"backend ({bname!r}) cannot run {kind} device arrays; use backend='cuda'")
    dev = device_index(g, kind)
    if a is not None and kind != "numpy" and device_index(a, kind) != dev:
        raise ValueError(f"grad_output is on CUDA device {dev} but {aname} is on device {device_index(a, kind)}")
    return get_backend(bname, dev), dev or 0


def _file_key(kind: str, g: Any, *call: Any) -> tuple[Any, ...] | None:
    """The fast path's key of a validated device call (its keyer registered for ``g``'s type), or
    None when an argument is unhashable (the call is then not remembered)."""
    if kind == "numpy":
        return None
    _KEYERS.setdefault(type(g), torch_pass_key if kind == "torch" else cupy_pass_key)
    try:
        key = _KEYERS[type(g)](call[0], call[1], g, *call[2:])
        hash(key)
    except (TypeError, AttributeError):
        return None
    return key
