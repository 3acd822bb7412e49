"""Batch norm in training mode [+ residual] [-> ReLU | SiLU | HardSwish] on convforge's kernels
(``kernels/batchnorm.py``).

What ``FusedConv2d`` (conv -> batch norm [-> + residual] [-> ReLU]) and ``PreActivation`` (batch norm [->
ReLU] before convs) run in training mode on CUDA activations, instead of PyTorch's ``cudnn_batch_norm``,
``add_`` and ``relu_`` and their backward ops: three kernels forward (statistics, finalize, normalise + add
+ ReLU) and three backward, fewer passes over the activation, every reduction in a fixed order.

Activations float32, float16 or bfloat16 (statistics and sums in float32), NCHW-contiguous or channels_last;
every output in the activation's dtype and memory format (channels_last stays channels_last, never a layout
copy). The module's parameters and running statistics keep their dtype: float32 master parameters with
half activations (autocast leaves batch norm's inputs alone, as PyTorch's does: half in, half out, float32
gradients of gamma and beta), or the activations' half dtype in a ``.half()`` model. The module's state
changes as ``torch.nn.BatchNorm2d.forward`` changes it: running mean and unbiased variance with the
momentum, ``num_batches_tracked`` + 1, all three inside the finalize kernel (their version counters bumped,
so folds cached by version see the update). Anything else (a momentum of None, other dtypes or strides, a
residual of another dtype or layout, eval mode, ``torch.compile`` tracing, ``config.train_bn`` off) keeps
PyTorch's modules: :func:`takes` says which. Double backward is not supported (``once_differentiable``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from convforge.backends import get_backend
from convforge.config import config
from convforge.frontends import fast_path
from convforge.kernels.batchnorm import BN_SLOTS, BnProgram, BnTrain, bn_program

_F32 = torch.float32
_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_CL = torch.channels_last
_BN = torch.nn.BatchNorm2d
_INFERENCE = torch.is_inference_mode_enabled
_PROGRAMS: dict[tuple[Any, ...], tuple[BnTrain, BnProgram, Any, Any]] = {}  # call key -> (shape, kernels, launcher,
# torch's raw-stream query)
_HANDLES: dict[tuple[Any, ...], int] = {}  # call key -> native.cpp's register_bn handle
_DEVICE = 9  # where a call key (key_of) holds the device index


def layout(t: torch.Tensor) -> str | None:
    """"nchw" for an NCHW-contiguous tensor, "nhwc" for a channels_last one (a tensor that is both, with
    H = W = 1 or C = 1, is NCHW: the same memory), None for any other strides."""
    if t.is_contiguous():
        return "nchw"
    return "nhwc" if t.is_contiguous(memory_format=_CL) else None


def _in_layout(t: torch.Tensor, lay: str) -> bool:
    return t.is_contiguous(memory_format=_CL if lay == "nhwc" else torch.contiguous_format)


def _param_dtype(bn: torch.nn.BatchNorm2d, y: torch.Tensor) -> torch.dtype | None:
    """The dtype of the module's parameters and running statistics when the kernels take them (all one
    dtype, float32 or y's, contiguous on y's device; affine and running statistics all there or all
    absent), else None. The module's tensors are read from its dicts (``getattr`` on a module is slow)."""
    p, b = bn._parameters, bn._buffers
    ts = (p.get("weight"), p.get("bias"), b.get("running_mean"), b.get("running_var"))
    present = [t for t in ts if t is not None]
    dt = present[0].dtype if present else _F32
    if dt != _F32 and dt != y.dtype:
        return None
    for t in present:
        if not (t.device == y.device and t.dtype == dt and t.is_contiguous()):
            return None
    nbt = b.get("num_batches_tracked")
    if not ((ts[0] is None) == (ts[1] is None) and (ts[2] is None) == (ts[3] is None) == (nbt is None)):
        return None
    if nbt is not None and not (nbt.device == y.device and nbt.dtype == torch.int64):
        return None
    return dt


def takes(bn: torch.nn.BatchNorm2d, y: torch.Tensor, res: Any = None) -> bool:
    """Whether :func:`bn_act` runs this training batch norm (module docstring; a ``BatchNorm2d`` itself,
    not a subclass, outside inference mode); else the caller runs PyTorch's modules."""
    if not (config.train_bn and bn.training and bn.momentum is not None and type(bn) is _BN
            and isinstance(y, torch.Tensor)) or _INFERENCE():  # a subclass (SyncBatchNorm...) may compute otherwise
        return False
    if not (y.is_cuda and y.dtype in _NAMES and y.dim() == 4 and y.data_ptr() % 16 == 0):
        return False
    lay = layout(y)
    if lay is None or y.shape[1] != bn.num_features or y.shape[0] * y.shape[2] * y.shape[3] < 2:
        return False
    if torch.compiler.is_compiling():
        return False
    if res is not None and not (isinstance(res, torch.Tensor) and res.shape == y.shape and res.dtype == y.dtype
                                and res.device == y.device and _in_layout(res, lay) and res.data_ptr() % 16 == 0):
        return False
    return _param_dtype(bn, y) is not None


def _key(bn: torch.nn.BatchNorm2d, y: torch.Tensor, res: torch.Tensor | None, relu: bool,
         act: str = "") -> tuple[Any, ...]:
    """A call's program key: shape, what follows, the module's settings, dtypes and layout."""
    return key_of(bn, tuple(y.shape), y.dtype, layout(y), res is not None, relu, y.device.index or 0, act)


def key_of(bn: torch.nn.BatchNorm2d, shape: tuple[int, ...], dtype: torch.dtype, lay: str | None, residual: bool,
           relu: bool, device: int, act: str = "") -> tuple[Any, ...]:
    """:func:`_key` from the activation's shape, dtype, layout and device alone (no tensor: what
    torch/train_ahead.py predicts a step will meet)."""
    p, b = bn._parameters, bn._buffers
    n, c, h, w = shape
    gamma, rmean = p.get("weight"), b.get("running_mean")
    like = gamma if gamma is not None else rmean  # the parameters' dtype (takes checked they share one)
    return (n, c, h * w, relu, residual, gamma is not None, rmean is not None, bn.eps, bn.momentum,
            device, _NAMES[dtype], _NAMES[like.dtype if like is not None else _F32], lay, act)


def bn_act(y: torch.Tensor, bn: torch.nn.BatchNorm2d, res: torch.Tensor | None = None,
           relu: bool = True, act: str = "") -> torch.Tensor:
    """[ReLU](batch_norm(y) [+ res]), or ``act`` ("silu", "hardswish": no ReLU, no residual) of
    batch_norm(y), with batch statistics, the module's running statistics and batch count updated;
    differentiable in y, res and the module's weight and bias; in y's dtype and memory format. The
    caller checked :func:`takes`. With the native module loaded the node is native_nodes.inc's ``BnNode``
    (filed here before the shape's first call), else :class:`_BnAct`: the same launches either way."""
    p, b = bn._parameters, bn._buffers
    key = _key(bn, y, res, relu, act)
    args = (y, res, p.get("weight"), p.get("bias"), b.get("running_mean"), b.get("running_var"),
            b.get("num_batches_tracked"))
    module = fast_path.torch_module()
    if module is not None:  # native_nodes.inc's BnNode: the same launches from C++
        handle = _HANDLES.get(key)
        if handle is None:
            handle = native_handle(module, bn, y, res, relu, None, act)
        z = module.bn(*args, handle)
        if z is not None:
            return z  # type: ignore[no-any-return]
    prog = _PROGRAMS.get(key) or _program(key)
    return _BnAct.apply(*args, prog)  # type: ignore[no-any-return]


def block_ok(bn: torch.nn.BatchNorm2d) -> bool:
    """:func:`takes`'s checks of the module and the mode (the tensors' are native.cpp ``block``'s)."""
    return bool(config.train_bn and config.native_block and bn.training and bn.momentum is not None
                and type(bn) is _BN and not _INFERENCE() and not torch.compiler.is_compiling())


def native_handle(module: Any, bn: torch.nn.BatchNorm2d, y: torch.Tensor, res: torch.Tensor | None,
                  relu: bool, stats: tuple[Any, int, Any] | None = None, act: str = "") -> int:
    """The handle of this call's batch-norm program filed with native.cpp (``register_bn``), for its
    ``block`` (and, without ``stats``, its ``bn``): the kernels :func:`bn_act` launches, by the same call
    key. ``stats``: (the block's conv as a native program whose epilogue writes P partial sums into the
    "res" slot, P, that conv's identity): the forward then finalizes those (``bn_program(partials=P)``)
    and the block runs that conv (:func:`stats_conv_program`). The handle then carries the conv, so it is
    filed by the conv's identity too: two blocks whose batch norms match (a 1x1 and a 3x3 conv into 64
    channels) get one each. ``act``: as :func:`bn_act`'s (the node needs no more: it saves and allocates
    as for a batch norm without ReLU)."""
    key = _key(bn, y, res, relu, act)
    hkey = key if stats is None else (*key, stats[1], stats[2])
    handle = _HANDLES.get(hkey)
    if handle is None:
        if stats is None:
            shape, prog, run, _ = _PROGRAMS.get(key) or _program(key)
        else:
            shape, prog, run, _ = _program(key, stats[1], keep=False)
        handle = _HANDLES[hkey] = int(module.register_bn(run.native_program(BN_SLOTS, "forward", "backward"),
                                                         shape.n, shape.c, shape.hw, shape.relu, shape.residual,
                                                         shape.affine, shape.track, prog.st, prog.part, shape.dtype,
                                                         shape.pdtype, shape.nhwc,
                                                         None if stats is None else stats[0]))
    return handle


def stats_conv_program(backend: Any, plan: Any) -> tuple[Any, ...]:
    """A statistics plan (``TcImplicitGemm.plan_stats``) as native.cpp's ``register_bn`` takes its conv
    (:func:`partials_in_res`)."""
    exe = backend.executable(partials_in_res(plan))
    exe.reserve()
    return exe.native_program()  # type: ignore[no-any-return]


def partials_in_res(plan: Any) -> Any:
    """``plan`` with its "bnpart" buffer named "res": the conv's residual slot, which a plan without a
    residual leaves free, so native.cpp's block passes the batch norm's partial-sum scratch there."""
    import dataclasses

    from convforge.plan import Launch

    if plan.epilogue.residual:
        raise ValueError("a statistics plan with a residual has no free slot for its partial sums")
    steps = tuple(dataclasses.replace(s, args=tuple("res" if a == "bnpart" else a for a in s.args))
                  if isinstance(s, Launch) else s for s in plan.steps)
    return dataclasses.replace(plan, steps=steps)


def _program(key: tuple[Any, ...], partials: int | None = None,
             keep: bool = True) -> tuple[BnTrain, BnProgram, Any, Any]:
    """(shape, kernels, their launcher on raw pointers, torch's raw-stream query) of a call key
    (:func:`_key`), compiled once per process (the CUDA back-end, and CuPy, load on first use); with
    ``partials`` the forward starting from a conv epilogue's partial sums (not kept: its handle is)."""
    from convforge.backends.cuda import RawLaunches
    from convforge.frontends.torch_run import torch_stream_queries

    shape, prog = _shape_program(key, partials)
    be = get_backend("cuda", key[_DEVICE])
    run = RawLaunches(be, prog.kernels, {"forward": prog.forward, "backward": prog.backward},  # type: ignore[arg-type]
                      _title(shape))
    hit = (shape, prog, run, torch_stream_queries()[0])
    if keep:
        _PROGRAMS[key] = hit
    return hit


def _shape_program(key: tuple[Any, ...], partials: int | None) -> tuple[BnTrain, BnProgram]:
    n, c, hw, relu, residual, affine, track, eps, momentum, device, dtype, pdtype, lay, act = key
    shape = BnTrain(n, c, hw, relu, residual, affine, track, float(eps), float(momentum), dtype, pdtype, lay, act)
    return shape, bn_program(shape, get_backend("cuda", device).device, partials=partials)


def _title(shape: BnTrain) -> str:
    return f"batch norm (training) {shape.n}x{shape.c}x{shape.hw}{shape.tag()}"


def program_work(key: tuple[Any, ...], partials: int | None = None) -> Any:
    """The ``Work`` (source and kernels) of the program :func:`_program` compiles for ``key``: what
    torch/train_ahead.py compiles ahead, on the same source, so the step finds it built."""
    from convforge.backends.base import Work
    from convforge.codegen.render import render

    shape, prog = _shape_program(key, partials)
    return Work(render(list(prog.kernels), "cuda", _title(shape)), tuple(prog.kernels))


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class _BnAct(torch.autograd.Function):
    """The autograd node: saves y, the statistics (kernels/batchnorm.py ``ST``) and, with a residual and a
    ReLU, z (whose sign is the mask); without a residual the mask is recomputed from y. Scratch and
    statistics share one float32 allocation a pass (forward: st, part; backward: dgamma, dbeta, cf, part;
    dgamma and dbeta apart, in the parameters' dtype, when that is a half one)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, res: torch.Tensor | None, gamma: torch.Tensor | None,  # type: ignore[override]
                beta: torch.Tensor | None, rmean: torch.Tensor | None, rvar: torch.Tensor | None,
                nbt: torch.Tensor | None, prog: tuple[BnTrain, BnProgram, Any, Any]) -> torch.Tensor:
        shape, kernels, run, stream_of = prog
        z = torch.empty_like(y)  # y's dtype and strides
        ws = y.new_empty(kernels.st + kernels.part, dtype=_F32)
        st = ws.data_ptr()
        run("forward", {"y": y.data_ptr(), "res": _ptr(res), "z": z.data_ptr(), "gamma": _ptr(gamma),
                        "beta": _ptr(beta), "rmean": _ptr(rmean), "rvar": _ptr(rvar), "nbt": _ptr(nbt), "st": st,
                        "part": st + 4 * kernels.st}, stream_of(y.device.index or 0))
        if rmean is not None and rvar is not None and nbt is not None:
            torch.autograd.graph.increment_version((rmean, rvar, nbt))
        ctx.prog = prog
        ctx.pdtype = gamma.dtype if gamma is not None else _F32
        ctx.save_for_backward(y, z if shape.relu and shape.residual else None, ws)
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gz: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        shape, kernels, run, stream_of = ctx.prog
        y, z, st = ctx.saved_tensors
        if not _in_layout(gz, shape.layout) or gz.data_ptr() % 16:
            gz = gz.clone(memory_format=_CL if shape.nhwc else torch.contiguous_format)
        c = shape.c
        dy = torch.empty_like(y)
        gm = torch.empty_like(y) if shape.relu and shape.residual else None
        ws = y.new_empty(4 * c + kernels.part, dtype=_F32)
        at = ws.data_ptr()
        dg = ws[:2 * c] if ctx.pdtype == _F32 else y.new_empty(2 * c, dtype=ctx.pdtype)
        run("backward", {"gz": gz.data_ptr(), "y": y.data_ptr(), "z": _ptr(z), "st": st.data_ptr(), "gm": _ptr(gm),
                         "dg": dg.data_ptr(), "cf": at + 8 * c, "part": at + 16 * c, "dy": dy.data_ptr()},
            stream_of(y.device.index or 0))
        dres = None
        if shape.residual and ctx.needs_input_grad[1]:
            dres = gm if shape.relu else gz
        dgamma = dg[:c] if shape.affine and ctx.needs_input_grad[2] else None
        dbeta = dg[c:] if shape.affine and ctx.needs_input_grad[3] else None
        return dy, dres, dgamma, dbeta, None, None, None, None
