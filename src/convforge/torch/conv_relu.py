"""conv [+ bias] -> ReLU in training on convforge's kernels, for blocks without batch norm (VGG, AlexNet).

PyTorch runs such a block as the convolution, ``relu`` (a pass over the output) and, backward,
``threshold_backward`` (a pass over the gradient) then the bias sum (another). Here the forward conv
applies bias and ReLU in its epilogue, and backward one kernel (``kernels/wgrad/bias.py`` with
``relu``) masks the gradient by the saved output's sign, writes the masked gradient for the layer's
dgrad and wgrad and sums it for the bias: two passes over the activation fewer, and two launches.
Where both passes are tensor-core plans that transpose the gradient first (``config.grad_rows``), the
kernel writes it straight into their GEMMs' operand layouts instead (``kernels/tensorcore/sm90/gradrows.py``:
:class:`_RowsBackward`), and the passes run without their transposes: three passes fewer again.
Half layers and autocast regions (float16, bfloat16; NCHW or channels_last, which stays so) take the same
node: the forward applies bias and ReLU in its epilogue, the backward masks the gradient and sums it for the
bias in PyTorch's elementwise ops, then runs the half dgrad and wgrad ops; the fused pass-writing kernels are
float32 NCHW only. With ``config.native_conv_relu`` (on by default) a warm call takes native.cpp's
ConvReluNode instead (the same kernels and ops from C++: no Python in its forward or backward): a half layer
once its program is filed, a float32 one (NCHW-contiguous input) once its first backward has filed the form it
chose (:func:`_file_back`: the masking kernel and, for the rows form, both passes' programs). ``FusedConv2d``
(conv -> ReLU, no batch norm, no residual) takes it in training where :func:`takes` says so; anything else
(``torch.compile`` tracing, ``config.train_bn`` off, a half layer handed back to PyTorch, a layer no convforge
variant runs) keeps the unfused path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from convforge import api, caches, dispatch
from convforge.backends import get_backend
from convforge.backends.base import DeviceMemoryError
from convforge.config import config
from convforge.frontends import fast_path
from convforge.spec import ConvSpec

_F32 = torch.float32
_HALF = (torch.float16, torch.bfloat16)
_PROGRAMS: dict[tuple[int, int, int, int], tuple[Any, int, Any]] = {}  # (n, k, pq, device) -> (launcher, slices,
# torch's raw-stream query)


def takes(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, padding_mode: str) -> bool:
    """Whether :func:`conv_relu` may run this training call: CUDA 4-D input and filters (and bias) of one
    dtype (float32, float16 or bfloat16) on one device, or float32 ones in a float16 / bfloat16 autocast
    region (the caller casts them: :func:`convforge.torch.modules.compute_dtype`); zero padding, outside
    torch.compile tracing, ``config.train_bn``."""
    if not (config.train_bn and padding_mode == "zeros" and isinstance(x, torch.Tensor) and x.is_cuda
            and x.dim() == 4 and w.device == x.device and (b is None or b.device == x.device)):
        return False
    if torch.compiler.is_compiling():
        return False
    from convforge.torch.modules import compute_dtype

    dt = compute_dtype(x, w)
    return dt is not None and (b is None or b.dtype == w.dtype)


def conv_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, conv: tuple[Any, ...]) -> torch.Tensor | None:
    """relu(conv2d(x, w, b)) with convforge's backward (module docstring); ``conv``: (stride, padding
    quad, dilation, algo, precision, max_error, groups) as lists and values. None where no convforge
    variant runs the layer with ``algo`` "auto" (the caller then runs its unfused path, whose op
    logs the fallback once); such a layer is remembered and not tried again."""
    tag = (tuple(x.shape), tuple(w.shape), x.device, x.dtype, *map(_frozen, conv))
    if tag in _REFUSED:
        return None
    if x.dtype in _HALF and _handed_back(x, w, conv):
        _REFUSED.add(tag)
        return None
    if config.native_conv_relu and (x.dtype in _HALF or x.is_contiguous()):
        z = _native_node(x, w, b, conv)
        if z is not None:
            return z
    try:
        return _ConvRelu.apply(x, w, b, conv)  # type: ignore[no-any-return]
    except ValueError:
        if conv[3] != "auto":
            raise
        _REFUSED.add(tag)
        return None


_REFUSED: set[tuple[Any, ...]] = set()


def _native_node(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, conv: tuple[Any, ...]) -> Any:
    """The layer through native.cpp's ConvReluNode, or None: the native module is not loaded, or the call is
    not filed yet (the Python node's first forward files it; a float32 layer's first backward files its
    backward) or not one it runs."""
    module = fast_path.TORCH
    if module is None:
        return None
    # the program is filed with KCRS filters (the Python node's w.contiguous()); a channels_last model's
    # weight reaches the node through the same differentiable copy
    return module.conv_relu(*_call(x, w if w.is_contiguous() else w.contiguous(), b, conv))


def _call(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, conv: tuple[Any, ...]) -> tuple[Any, ...]:
    """conv2d's 14 arguments for the layer with bias and ReLU in its epilogue: the key under which the Python
    node's forward files the program and the native node finds it."""
    stride, pad, dil, algo, precision, max_error, groups = conv
    return (x, w, b, tuple(stride), tuple(pad), tuple(dil), algo, None, None, True, None, precision, max_error, groups)


def _frozen(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _handed_back(x: torch.Tensor, w: torch.Tensor, conv: tuple[Any, ...]) -> bool:
    """Whether a half layer's forward goes to PyTorch (``ops.handed_back``: no fast variant serves it)."""
    from convforge.torch.ops import _slow_call, channels_last

    stride, pad, dil, algo, precision, max_error, groups = conv
    return _slow_call("fprop", x.shape, w.shape, stride, pad, dil, groups, x.dtype, channels_last(x),
                      x.device.index or 0, algo, precision, max_error) is not None


def _forward_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, conv: tuple[Any, ...]) -> Any:
    """The conv with bias and ReLU in its epilogue: the native fast path when warm, else Python's."""
    call = _call(x, w, b, conv)
    native = fast_path.RUN
    z = None if native is None else native(*call)
    return api.python_conv2d(*call) if z is None else z


class _ConvRelu(torch.autograd.Function):
    """Saves x, w and the output z (its sign is the ReLU's mask); backward: the masked gradient and
    bias sum in one kernel, then ``convforge::conv2d_input`` / ``conv2d_weight`` on the masked gradient
    (each chosen per layer, pass and class by dispatch, as ``convforge::conv2d``'s own backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,  # type: ignore[override]
                conv: tuple[Any, ...]) -> torch.Tensor:
        from convforge.torch.ops import activation

        xa = x.contiguous() if x.dtype == _F32 else activation(x)  # a half channels_last x stays NHWC
        wc = w.contiguous()
        z = _forward_conv(xa, wc, b, conv)
        ctx.save_for_backward(x, w, z)
        ctx.conv, ctx.has_bias = conv, b is not None
        # a float32 call the C++ node could run: its first backward files the form it takes
        filing = x.dtype == _F32 and xa is x and config.native_conv_relu and fast_path.TORCH is not None
        ctx.filing = _call(x, wc, b, conv) if filing else None
        return z  # type: ignore[no-any-return]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gz: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        from convforge.torch.ops import INPUT_OP, WEIGHT_OP

        x, w, z = ctx.saved_tensors
        stride, pad, dil, algo, precision, max_error, groups = ctx.conv
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        half = z.dtype != _F32
        rows = _rows_backward(x, w, z, ctx.conv, need_x, need_w) if (need_x or need_w) and not half else None
        if ctx.filing is not None:
            _file_back(ctx.filing, rows, z)
            ctx.filing = None
        if rows is not None:
            gx, gw, gb = rows(gz, x, w, z)
            return gx, gw, gb if ctx.has_bias and ctx.needs_input_grad[2] else None, None
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        gm, gb = _masked_grad_half(gz, z, x, need_b) if half else _masked_grad(gz, z)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = INPUT_OP(list(x.shape), w, gm, stride, pad, dil, groups, algo, precision, max_error)
        if ctx.needs_input_grad[1]:
            gw = WEIGHT_OP(x, list(w.shape), gm, stride, pad, dil, groups, algo, precision, max_error)
        return gx, gw, gb if ctx.has_bias and ctx.needs_input_grad[2] else None, None


# the masking kernels' buffers as native.cpp's pointer slots (its ReluSlot); a rows form's workspace buffers after
RELU_SLOTS = {"y": 0, "z": 1, "gm": 2, "bias": 3, "bpart": 4}


def _file_back(call: tuple[Any, ...], rows: _RowsBackward | None, z: torch.Tensor) -> None:
    """File a float32 layer's backward with native.cpp (``register_relu_back``, under the forward ``call``'s
    key): the rows form's masking kernel with its operand buffers and both passes' programs, or the one-kernel
    masked gradient (the ops run on it through the dispatcher). Nothing while a CUDA graph is captured."""
    module = fast_path.TORCH
    if module is None or torch.cuda.is_current_stream_capturing():
        return
    if rows is not None:
        names = sorted(rows.ws)
        slots = {**RELU_SLOTS, **{name: len(RELU_SLOTS) + i for i, name in enumerate(names)}}
        fixed = tuple((slots[name], rows.ws[name]) for name in names)
        passes = [None if e is None else e.native_program() for e in (rows.exe_d, rows.exe_w)]
        module.register_relu_back(*call, True, rows.run.native_program(slots, "backward", "backward"), fixed,
                                  *passes, rows.part // 4)
        return
    n, k, p, q = z.shape
    run, sp, _ = _program(n, k, p * q, z.device.index or 0)
    module.register_relu_back(*call, False, run.native_program(RELU_SLOTS, "backward", "backward"), (), None,
                              None, k * (1 + sp))


def _masked_grad_half(gz: torch.Tensor, z: torch.Tensor, x: torch.Tensor,
                      need_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(gz where z > 0 else 0, in x's memory format; where ``need_bias``, its sum per channel, summed in
    float32, in z's dtype, else None): PyTorch's elementwise ops (the one-kernel form is float32 NCHW)."""
    from convforge.torch.ops import channels_last

    fmt = torch.channels_last if channels_last(x) else torch.contiguous_format
    gm = gz.masked_fill(z <= 0, 0).contiguous(memory_format=fmt)
    return gm, gm.sum((0, 2, 3), dtype=_F32).to(z.dtype) if need_bias else None


def _masked_grad(gz: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gz where z > 0 else 0, its sum per channel): one kernel (two where a channel is split)."""
    if not gz.is_contiguous() or gz.data_ptr() % 16:
        gz = gz.clone(memory_format=torch.contiguous_format)
    n, k, p, q = z.shape
    run, sp, stream_of = _program(n, k, p * q, z.device.index or 0)
    gm = torch.empty_like(z)
    ws = z.new_empty(k * (1 + sp))  # the bias gradient, then the slices' partial sums
    at = ws.data_ptr()
    run("backward", {"y": gz.data_ptr(), "z": z.data_ptr(), "gm": gm.data_ptr(), "bias": at, "bpart": at + 4 * k},
        stream_of(z.device.index or 0))
    return gm, ws[:k]


def _program(n: int, k: int, pq: int, device: int) -> tuple[Any, int, Any]:
    """(launcher on raw pointers, slices per channel, torch's raw-stream query) of the masked bias
    gradient of an (n, k, pq) activation, compiled once per process."""
    hit = _PROGRAMS.get((n, k, pq, device))
    if hit is not None:
        return hit
    from convforge.backends.cuda import RawLaunches
    from convforge.frontends.torch_run import torch_stream_queries
    from convforge.kernels.wgrad import bias_grad_plan
    from convforge.plan import Launch

    be = get_backend("cuda", device)
    plan = bias_grad_plan(ConvSpec.make(n, 1, 1, pq, k, 1, 1, conv_pass="wgrad"), be.device, relu=True)
    steps = tuple(s for s in plan.steps if isinstance(s, Launch))  # the plan has launches only
    run = RawLaunches(be, plan.kernels, {"backward": steps},  # type: ignore[arg-type]
                      f"conv -> ReLU backward {n}x{k}x{pq}")
    hit = _PROGRAMS[(n, k, pq, device)] = (run, int(plan.params.get("sp", 1)), torch_stream_queries()[0])
    return hit


_ROWS: dict[tuple[Any, ...], Any] = {}  # (layer tag, gradients asked) -> _RowsBackward, or None where it does not apply
caches.register(_ROWS.clear, "torch.conv_relu: the rows backward of each layer")  # chosen by dispatch


class _RowsBackward:
    """One layer's backward through ``kernels/tensorcore/sm90/gradrows.py``: the masked gradient and the bias
    partial sums by one kernel that writes dgrad's and wgrad's GEMM operands, then both passes' plans
    without their transposes of the gradient, each on its own executable's workspace, on raw pointers on
    torch's current stream."""

    def __init__(self, run: Any, part: int, exe_d: Any, exe_w: Any, ws: dict[str, int], device: int) -> None:
        from convforge.frontends.torch_run import torch_stream_queries

        self.run, self.part, self.exe_d, self.exe_w, self.ws, self.device = run, part, exe_d, exe_w, ws, device
        self.stream_of = torch_stream_queries()[0]

    def __call__(self, gz: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                 z: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        gz = gz.contiguous()
        stream = self.stream_of(self.device)
        k = z.shape[1]
        gb, part = z.new_empty(k), z.new_empty(self.part // 4)
        self.run("backward", {"y": gz.data_ptr(), "z": z.data_ptr(), "bpart": part.data_ptr(),
                              "bias": gb.data_ptr(), **self.ws}, stream)
        gx = gw = None
        if self.exe_d is not None:
            wc = w.contiguous()
            gx = torch.empty(x.shape, dtype=_F32, device=x.device)
            self.exe_d.launch_raw(gx.data_ptr(), wc.data_ptr(), 0, 0, stream)
        if self.exe_w is not None:
            xc = x.contiguous()
            gw = torch.empty(w.shape, dtype=_F32, device=w.device)
            self.exe_w.launch_raw(xc.data_ptr(), gw.data_ptr(), 0, 0, stream)
        return gx, gw, gb


def _rows_backward(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, conv: tuple[Any, ...], need_x: bool,
                   need_w: bool) -> _RowsBackward | None:
    """The layer's :class:`_RowsBackward`, built on its first backward and remembered; None where it
    does not apply (``config.grad_rows`` off, an ``algo`` other than "auto", a pass whose plan has no
    transpose of the gradient to take over, or workspace that does not fit): the caller's path then."""
    tag = (tuple(x.shape), tuple(w.shape), x.device, *map(_frozen, conv), need_x, need_w)
    if tag in _ROWS:
        return _ROWS[tag]  # type: ignore[no-any-return]
    if torch.cuda.is_current_stream_capturing():
        return None  # nothing may compile or allocate now: the caller's path (not remembered)
    made = None
    if config.grad_rows and conv[3] == "auto" and conv[6] == 1:
        try:
            made = _build_rows(x, w, z, conv, need_x, need_w)
        except DeviceMemoryError:
            made = None
    _ROWS[tag] = made
    return made


def _build_rows(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, conv: tuple[Any, ...], need_x: bool,
                need_w: bool) -> _RowsBackward | None:
    """Both passes chosen as ``convforge.grad`` would choose them (dispatch, the database first), then
    :func:`rows_from_plans`."""
    from convforge.frontends.checks import check_options
    from convforge.grad import _pass_spec
    from convforge.plan import Epilogue

    stride, pad, dil, _, precision, max_error, groups = conv
    dev = x.device.index or 0
    be = get_backend("cuda", dev)
    _, limit = check_options(False, None, precision, max_error)

    def plan(conv_pass: str) -> Any:
        a, size = (w, x.shape) if conv_pass == "dgrad" else (x, w.shape)
        spec = _pass_spec(conv_pass, list(size), a, z, stride, pad, dil, groups)
        ch = dispatch.choose(spec, be, Epilogue(), algo="auto", precision=precision, max_error=max_error,
                             workspace_limit=limit)
        return ch.variant.plan_for(spec, ch.params, be.device, Epilogue())

    return rows_from_plans(plan("dgrad") if need_x else None, plan("wgrad") if need_w else None,
                           tuple(int(v) for v in z.shape), dev)


def rows_from_plans(plan_d: Any, plan_w: Any, shape: tuple[int, ...], dev: int) -> _RowsBackward | None:
    """The :class:`_RowsBackward` of a layer whose output has ``shape`` (N, K, P, Q) from its dgrad and
    wgrad plans (either None: that gradient is not asked), their transposes of the gradient taken out
    (``gradrows.prepared``); None where a plan has none to take."""
    from convforge.backends.cuda import RawLaunches
    from convforge.kernels.tensorcore.sm90 import gradrows

    n, k, p, q = shape
    be: Any = get_backend("cuda", dev)  # a CudaBackend: its executables reserve and launch on raw pointers
    pd = pw = None
    if plan_d is not None and plan_d.spec.conv_pass == "dgrad":  # both steps write [N][P Q][Kp]: stride 1, strided
        pd = (gradrows.prepared(plan_d, "tc_x_nhwc", n * p * q)
              or gradrows.prepared(plan_d, f"{plan_d.variant}_dy", n * p * q))
    if plan_w is not None and plan_w.spec.conv_pass == "wgrad":  # [K][P Q][Np]
        pw = gradrows.prepared(plan_w, f"{plan_w.variant}_dy", k * p * q)
    if (plan_d is not None and pd is None) or (plan_w is not None and pw is None) or not (pd or pw):
        return None
    kernels, launches, part = gradrows.masked_rows(n, k, p * q, pd.rows if pd else None, pw.rows if pw else None)
    run = RawLaunches(be, kernels, {"backward": launches}, f"conv -> ReLU backward rows {n}x{k}x{p}x{q}")
    stream = int(torch.cuda.current_stream(dev).cuda_stream)
    exes, ws = [], {}
    for pr in (pd, pw):
        exe = None
        if pr is not None:
            exe = be.executable(pr.plan)
            exe.reserve(stream)
            ws.update({b.name: int(exe.workspace()[b.name].data.ptr) for b in pr.rows.buffers()})
        exes.append(exe)
    return _RowsBackward(run, part, exes[0], exes[1], ws, dev)
