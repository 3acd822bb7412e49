"""ConvNeXt's MLP in training on convforge's kernels: ``fuse()``'s two ``FusedLinear`` chains of a block as
two autograd nodes, in half precision (FP16 / BF16 autocast over float32 master weights, or a ``.half()`` /
``.bfloat16()`` model), channels-last activations throughout.

    A  x (N, H, W, C) -> LayerNorm -> Linear(C, 4C) -> GELU                         FusedLinear "norm+gelu"
    B  g -> Linear(4C, C) -> permute -> * layer scale -> [stochastic depth] -> + res   "permute+scale+...+add"

PyTorch runs a block's MLP under autocast as about 16 operators forward (the casts of x, of the norm's
output and of four parameters, the norm in float32, two addmm, GELU, the scale, stochastic depth's noise and
product, the add) and about 25 autograd nodes backward; ConvNeXt-T's AMP step is host-bound on them
(docs/NOTES-training.md). Here:

A forward: the layer norm kernel (half in, half out, each row's mean and 1/std kept), the GEMM with its bias
(``convforge::conv2d``'s runner on the channels-last view), GELU (PyTorch's op on the half output, as autocast
runs it); backward: ``gelu_backward``, the GEMM's dgrad and wgrad ops, the bias sum, the layer norm's backward
kernel (dgamma and dbeta in the parameters' dtype).

B forward: the GEMM with its bias, then ``res + u * (scale x noise)`` in one ``addcmul`` (float32 where the
scale is, as PyTorch's ``s * y`` promotes); the noise is the model's own StochasticDepth module applied to
ones, so the random stream is the one PyTorch's operations draw. Backward: the scale's gradient, the GEMM's
dgrad and wgrad, the bias sum.

Weights are cast to the half dtype on each call (they change every step) and their gradients returned in the
parameters' dtype. Inf and NaN of an overflowing scaled loss reach every gradient.

The Python nodes run a call shape's first call and file it with native.cpp (``register_mlp``: the GEMM's filed
key, the layer norm's launches); later calls of that shape run native_mlp.inc's C++ nodes, the same ops in the
same order without Python in their forward or backward (the Python nodes where the native module is not
loaded or the GEMM is no longer filed: a configuration change, whose next Python call files it again). On by default
(``config.mlp_train``; ``CONVFORGE_MLP_TRAIN=0``: PyTorch's operations); a call the nodes do not take runs
PyTorch's operations. torch/train_ahead.py compiles the nodes' programs ahead of a model's first step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from convforge import api
from convforge.frontends import fast_path
from convforge.torch import layernorm
from convforge.torch.modules import _AUTOCAST, autocast_dtype

_F32 = torch.float32
_HALF = (torch.float16, torch.bfloat16)
_CL = torch.channels_last
_PASS = ([1, 1], [0, 0, 0, 0], [1, 1], 1, "auto", None, None)  # stride, padding, dilation, groups, algo, ...


# the layer norm's buffers as native_mlp.inc's pointer slots (its MlpSlot)
NORM_SLOTS = {"x": 0, "y": 1, "gamma": 2, "beta": 3, "st": 4, "gy": 5, "gx": 6, "part": 7, "ggamma": 8, "gbeta": 9}
_HANDLES: dict[tuple[Any, ...], int] = {}  # a call shape's register_mlp handle (native.cpp keeps its programs)


def run(m: Any, x: torch.Tensor, res: Any) -> torch.Tensor | None:
    """``m(x, res)`` (a FusedLinear in training) through the nodes, or None where they do not take it: the
    C++ node where the call's shape is filed, else the Python node (which files it)."""
    took = node_of(m, x, res)
    if took is None:
        return None
    node, dt = took
    native = fast_path.TORCH
    key: tuple[Any, ...] = (node, tuple(x.shape), x.dtype, dt, x.device, m.weight.dtype)
    if node == "A":
        norm = m._cf_norm
        key += (None if norm.weight is None else norm.weight.dtype, float(norm.eps))
        handle = _HANDLES.get(key) if native is not None else None
        if handle is not None:
            y = native.mlp_a(x, norm.weight, norm.bias, m.weight, m.bias, handle)
            if y is not None:
                return y  # type: ignore[no-any-return]
        return _NormGelu.apply(x, norm.weight, norm.bias, m.weight, m.bias, (dt, float(norm.eps), key))  # type: ignore[no-any-return]
    s = m.scale()
    noise = _noise(m._cf_drop, x.shape[0], torch.promote_types(s.dtype, dt), x.device)
    handle = _HANDLES.get(key) if native is not None else None
    if handle is not None:
        y = native.mlp_b(x, res, m.weight, m.bias, s, noise, handle)
        if y is not None:
            return y  # type: ignore[no-any-return]
    return _ScaleResidual.apply(x, res, m.weight, m.bias, s, noise, (dt, key))  # type: ignore[no-any-return]


def _file(key: tuple[Any, ...] | None, call: tuple[Any, ...], norm: tuple[Any, ...] | None) -> None:
    """File a Python node's call shape with native.cpp (``register_mlp``) once its GEMM ``call`` has run:
    node A with ``norm`` (its contiguous input, the norm's weight, eps, the half dtype), node B without.
    Nothing while a CUDA graph is captured (the norm's backward may still have to compile)."""
    module = fast_path.TORCH
    if key is None or key in _HANDLES or module is None or torch.cuda.is_current_stream_capturing():
        return
    prog: tuple[Any, ...] | None = None
    part = 0
    if norm is not None:
        xr, lw, eps, dt = norm
        fwd, bwd, part = layernorm.train_launchers(xr, lw, eps, dt)
        f = fwd.native_program(NORM_SLOTS, "forward", "forward")
        b = bwd.native_program(NORM_SLOTS, "forward", "forward")
        prog = (f[0], b[0], [], (), (), (), 0, f[7], f"{f[8]}; {b[8]}", (fwd, bwd))
    handle = module.register_mlp(0 if norm is not None else 1, *call, prog, part,
                                 norm is not None and norm[1] is not None)
    if handle is not None:
        _HANDLES[key] = int(handle)


def node_of(m: Any, x: torch.Tensor, res: Any) -> tuple[str, torch.dtype] | None:
    """(node "A" or "B", its half dtype) of the call ``m(x, res)`` in training, or None where PyTorch's
    operations run it (also what torch/train_ahead.py predicts the first step's programs from)."""
    dt = _dtype(m, x, res)
    if dt is None:
        return None
    if m._cf_gelu and m._cf_norm is not None:
        return ("A", dt) if layernorm.usable(m._cf_norm, x.shape[-1]) else None
    if m._cf_nchw and m._cf_residual and m._cf_scale is not None and res is not None:
        n, h, w_, _ = x.shape
        s = m.scale()
        if tuple(res.shape) != (n, m.out_features, h, w_) or s is None or s.numel() != m.out_features:
            return None
        return "B", dt
    return None


def _dtype(m: Any, x: torch.Tensor, res: Any) -> torch.dtype | None:
    """The half dtype the nodes run the call in, or None: CUDA 4-D input, widths that are multiples of 8,
    parameters float32 or that dtype in an autocast region (that dtype alone outside one)."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dim() == 4) or torch.compiler.is_compiling():
        return None
    if torch.jit.is_tracing() or m.in_features % 8 or m.out_features % 8 or m.bias is None:
        return None
    dt = autocast_dtype() if _AUTOCAST() else x.dtype
    if dt not in _HALF:
        return None
    allowed = (_F32, dt) if _AUTOCAST() else (dt,)
    norm = m._cf_norm
    params = (m.weight, m.bias, m.scale(), *(() if norm is None else (norm.weight, norm.bias)))
    if any(t is not None and (t.dtype not in allowed or t.device != x.device) for t in (x, *params)):
        return None
    if res is not None and not (isinstance(res, torch.Tensor) and res.device == x.device and res.dtype in allowed):
        return None
    return dt


def _noise(drop: Any, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Stochastic depth's per-sample factor (N, 1, 1, 1) drawn by the model's own module (its random stream),
    or None where it drops nothing (eval, p = 0, no module)."""
    if drop is None or not drop.training or getattr(drop, "p", 0.0) == 0:
        return None
    return drop(torch.ones((n, 1, 1, 1), dtype=dtype, device=device))  # type: ignore[no-any-return]


def _gemm(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """(``a`` (N, H, W, Cin) contiguous times ``w`` (K, Cin) plus ``b``: the 1x1 conv on the channels-last view,
    (N, K, H, W) in channels_last memory; the conv2d call that ran it, for :func:`_file`)."""
    k, c = w.shape
    call = (a.permute(0, 3, 1, 2), w.view(k, c, 1, 1), b, (1, 1), (0, 0, 0, 0), (1, 1), "auto", None, None, False,
            None, None, None, 1)
    native = fast_path.RUN
    y = None if native is None else native(*call)
    return (api.python_conv2d(*call) if y is None else y), call


def _half(t: torch.Tensor | None, dt: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.detach().to(dt)


def _linear_grads(a: torch.Tensor, wh: torch.Tensor, gy: torch.Tensor, b: torch.Tensor, w_dtype: torch.dtype,
                  need: tuple[bool, bool, bool]) -> tuple[Any, Any, Any]:
    """The backward of :func:`_gemm` (``a`` rows (N, H, W, Cin), ``wh`` (K, Cin) as cast, ``gy`` (N, K, H, W)
    channels-last): (a's gradient as rows, w's in ``w_dtype``, b's summed in float32 at least, in b's dtype),
    each where ``need`` asks for it: convforge's dgrad and wgrad ops, PyTorch's sum."""
    from convforge.torch.ops import INPUT_OP, WEIGHT_OP

    n, h, w_, c = a.shape
    k = wh.shape[0]
    ga = gw = gb = None
    if need[0]:
        ga = INPUT_OP([n, c, h, w_], wh.view(k, c, 1, 1), gy, *_PASS).permute(0, 2, 3, 1)
    if need[1]:
        gw = WEIGHT_OP(a.permute(0, 3, 1, 2), [k, c, 1, 1], gy, *_PASS).view(k, c).to(w_dtype)
    if need[2]:
        gb = gy.sum((0, 2, 3), dtype=torch.promote_types(gy.dtype, _F32)).to(b.dtype)
    return ga, gw, gb


class _NormGelu(torch.autograd.Function):
    """Node A (module docstring): saves x, the norm's statistics, its output z, the GEMM's output h and the cast
    weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lw: torch.Tensor | None, lb: torch.Tensor | None,  # type: ignore[override]
                w: torch.Tensor, b: torch.Tensor, meta: tuple[Any, ...]) -> torch.Tensor:
        dt, eps, key = meta
        with torch.autocast("cuda", enabled=False):
            xr = x.contiguous()
            normed = layernorm.train_rows(xr, lw, lb, eps, dt)
            if normed is None:
                raise ValueError("layer norm: the kernel does not take this call")
            z, st = normed
            wh = _half(w, dt)
            h, call = _gemm(z, wh, _half(b, dt))  # type: ignore[arg-type]
            g = F.gelu(h)
        _file(key, call, (xr, lw, eps, dt))
        ctx.save_for_backward(xr, st, z, h, wh, lw, b)
        ctx.w_dtype = w.dtype
        return g.permute(0, 2, 3, 1)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gg: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xr, st, z, h, wh, lw, b = ctx.saved_tensors
        gh = torch.ops.aten.gelu_backward(gg.permute(0, 3, 1, 2).to(h.dtype), h).contiguous(memory_format=_CL)
        gz, gw, gb = _linear_grads(z, wh, gh, b, ctx.w_dtype, (True, *ctx.needs_input_grad[3:5]))
        grads = layernorm.grad_rows(xr, gz.contiguous(), st, lw)
        if grads is None:
            raise RuntimeError("layer norm backward: the kernel refused the forward's own shapes")
        gx, glw, glb = grads
        return gx, glw, glb, gw, gb, None


class _ScaleResidual(torch.autograd.Function):
    """Node B (module docstring): saves g, the GEMM's output u, the cast weight and the per-channel factor."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, res: torch.Tensor, w: torch.Tensor, b: torch.Tensor,  # type: ignore[override]
                s: torch.Tensor, noise: torch.Tensor | None, meta: tuple[Any, ...]) -> torch.Tensor:
        dt, key = meta
        with torch.autocast("cuda", enabled=False):
            gr = g.contiguous()
            wh = _half(w, dt)
            u, call = _gemm(gr, wh, _half(b, dt))  # type: ignore[arg-type]
            f = s.detach().reshape(1, -1, 1, 1)
            f = f if noise is None else f * noise
            out = torch.addcmul(res.detach(), u, f)
        _file(key, call, None)
        ctx.save_for_backward(gr, u, wh, f, noise, b, s)
        ctx.res_dtype, ctx.w_dtype = res.dtype, w.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, go: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        gr, u, wh, f, noise, b, s = ctx.saved_tensors
        n = gr.shape[0]
        gres = go.to(ctx.res_dtype) if ctx.needs_input_grad[1] else None
        gu = (go * f).to(u.dtype).contiguous(memory_format=_CL)
        gs = None
        if ctx.needs_input_grad[4]:
            acc = torch.promote_types(go.dtype, _F32)
            per = (go * u).sum((2, 3), dtype=acc)  # (N, C)
            if noise is not None:
                per = per * noise.reshape(n, 1).to(acc)
            gs = per.sum(0).to(s.dtype).reshape(s.shape)
        gg, gw, gb = _linear_grads(gr, wh, gu, b, ctx.w_dtype, (ctx.needs_input_grad[0], *ctx.needs_input_grad[2:4]))
        return gg, gres, gw, gb, gs, None, None
