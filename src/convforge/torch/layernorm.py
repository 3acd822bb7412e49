"""Layer norm over the last dimension of a CUDA tensor on convforge's kernels (kernels/layernorm.py). In
inference (no autograd node here: a call that needs a gradient runs PyTorch's):

* ``norm_rows``: what ``FusedLinear`` runs before its product when ``fuse()`` folded the ``nn.LayerNorm`` in
  front of it (ConvNeXt's blocks), written in the dtype the product reads;
* ``RowNorm``: what ``fuse()`` puts in place of a functional ``F.layer_norm`` over the last dimension whose
  weight and bias are a module's (torchvision's ``LayerNorm2d``: ConvNeXt's stem, downsampling layers and
  head), written in the dtype PyTorch's gives (float32 inside autocast).

In training, ``train_rows`` (the forward, each row's statistics kept) and ``grad_rows`` (its backward) are what
the ConvNeXt MLP node runs (torch/mlp_train.py).
"""

from __future__ import annotations

from typing import Any

import torch

from convforge import caches
from convforge.backends import get_backend
from convforge.kernels.layernorm import MAX_C, MAX_C_GRAD, LayerNormGrad, LayerNormRows, grad_program, launch, title
from convforge.torch.modules import _AUTOCAST

_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_PROGRAMS: dict[tuple[Any, ...], tuple[Any, Any, int]] = {}  # by (shape, dtypes, eps, device, stats)
_GRADS: dict[tuple[Any, ...], tuple[Any, Any, int, int]] = {}  # by (shape, dtypes, device): the backward's
caches.register(_PROGRAMS.clear, "torch.layernorm: the layer-norm launchers of each shape")
caches.register(_GRADS.clear, "torch.layernorm: the layer-norm backward's launchers of each shape")


def usable(norm: Any, c: int) -> bool:
    """Whether ``norm`` is a layer norm over the last dimension of ``c`` values this kernel runs."""
    if type(norm) is not torch.nn.LayerNorm or tuple(norm.normalized_shape) != (c,) or c > MAX_C:
        return False
    w, b = norm.weight, norm.bias
    if w is None:
        return b is None
    return b is not None and w.dtype == b.dtype and w.dtype in _NAMES and w.is_contiguous() and b.is_contiguous()


def norm_rows(x: torch.Tensor, norm: torch.nn.LayerNorm, out: torch.dtype) -> torch.Tensor | None:
    """``norm(x)`` in ``out``, x contiguous on a CUDA device with its parameters; None where the kernel
    does not take it (the caller runs PyTorch's)."""
    c = x.shape[-1] if x.dim() else 0
    if not usable(norm, c):
        return None
    return _run(x, norm.weight, norm.bias, float(norm.eps), out)


def _run(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float,
         out: torch.dtype, stats: torch.Tensor | None = None) -> torch.Tensor | None:
    """y in ``out``; with ``stats`` (float32, 2 a row) each row's mean and 1/std written there too."""
    c = x.shape[-1] if x.dim() else 0
    if not _takes(x, w, b, c, MAX_C) or out not in _NAMES:
        return None
    run, stream_of, dev = _forward_hit(x, out, None if w is None else w.dtype, eps, stats is not None)
    y = torch.empty(x.shape, dtype=out, device=x.device)
    ptrs = {"x": x.data_ptr(), "y": y.data_ptr()}
    if w is not None and b is not None:
        ptrs.update(gamma=w.data_ptr(), beta=b.data_ptr())
    if stats is not None:
        ptrs["st"] = stats.data_ptr()
    run("forward", ptrs, stream_of(dev))
    return y


def _forward_hit(x: torch.Tensor, out: torch.dtype, wdtype: torch.dtype | None, eps: float,
                 stats: bool) -> tuple[Any, Any, int]:
    """The forward's (launcher, stream query, device) for x's shape and dtypes, built once."""
    key = (x.shape, x.dtype, out, wdtype, eps, x.device, stats)
    hit = _PROGRAMS.get(key)
    if hit is None:
        c = x.shape[-1]
        ln = _rows(x.numel() // c, c, eps, x.dtype, out, wdtype, stats)
        k, step = launch(ln, get_backend("cuda", x.device.index or 0).device)
        hit = _PROGRAMS[key] = _launcher(x, (k,), (step,), title(ln))
    return hit


def _grad_hit(x: torch.Tensor, gdtype: torch.dtype, wdtype: torch.dtype | None) -> tuple[Any, Any, int, int]:
    """The backward's (launcher, stream query, device, scratch floats) for x's shape and dtypes, built once."""
    key = (x.shape, x.dtype, gdtype, wdtype, x.device)
    hit = _GRADS.get(key)
    if hit is None:
        c = x.shape[-1]
        lg = _grad(x.numel() // c, c, x.dtype, gdtype, wdtype)
        prog = grad_program(lg, get_backend("cuda", x.device.index or 0).device)
        hit = _GRADS[key] = (*_launcher(x, prog.kernels, prog.launches, grad_title(lg)), prog.part)
    return hit


def train_launchers(x: torch.Tensor, w: torch.Tensor | None, eps: float, out: torch.dtype) -> tuple[Any, Any, int]:
    """(forward launcher, backward launcher, the backward's scratch floats) of :func:`train_rows` and
    :func:`grad_rows` on x's shape with a gradient in ``out``: what native.cpp's MLP node files
    (torch/mlp_train.py)."""
    wdtype = None if w is None else w.dtype
    fwd = _forward_hit(x, out, wdtype, eps, True)[0]
    bwd, _, _, part = _grad_hit(x, out, wdtype)
    return fwd, bwd, part


def _takes(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, c: int, most: int) -> bool:
    if (x.dtype not in _NAMES or not x.is_cuda or not x.is_contiguous() or x.numel() == 0 or x.data_ptr() % 16
            or c > most):
        return False
    return w is None or (b is not None and w.device == x.device and b.device == x.device and w.dtype in _NAMES
                         and b.dtype == w.dtype)  # the kernel reads both as one parameter dtype


def _launcher(x: torch.Tensor, kernels: Any, launches: Any, name: str) -> tuple[Any, Any, int]:
    """(RawLaunches of ``launches`` as list "forward", torch's raw-stream query, device) on x's device."""
    from convforge.backends.cuda import RawLaunches
    from convforge.frontends.torch_run import torch_stream_queries

    dev = x.device.index or 0
    run = RawLaunches(get_backend("cuda", dev), tuple(kernels), {"forward": tuple(launches)}, name)  # type: ignore[arg-type]
    return run, torch_stream_queries()[0], dev


def train_rows(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float,
               out: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(y in ``out``, each row's (mean, 1/std) as float32 rows x 2): the training forward, for
    :func:`grad_rows`; None where the kernels do not take it (C past the backward's ``MAX_C_GRAD`` too)."""
    c = x.shape[-1] if x.dim() else 0
    if c > MAX_C_GRAD:
        return None
    st = torch.empty((x.numel() // max(c, 1), 2), dtype=torch.float32, device=x.device)
    y = _run(x, w, b, eps, out, st)
    return None if y is None else (y, st)


def grad_rows(x: torch.Tensor, gy: torch.Tensor, st: torch.Tensor,
              w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """(gx in x's dtype, dgamma, dbeta in w's dtype; None without w) of the layer norm whose training forward
    left ``st``; x and gy contiguous rows of C; None where the kernels do not take it."""
    c = x.shape[-1] if x.dim() else 0
    if not (_takes(x, w, w, c, MAX_C_GRAD) and gy.dtype in _NAMES and gy.is_contiguous() and gy.shape == x.shape
            and gy.data_ptr() % 16 == 0 and gy.device == x.device):
        return None
    run, stream_of, dev, part = _grad_hit(x, gy.dtype, None if w is None else w.dtype)
    gx = torch.empty_like(x)
    ptrs = {"x": x.data_ptr(), "gy": gy.data_ptr(), "st": st.data_ptr(), "gx": gx.data_ptr()}
    gw = gb = None
    if w is not None:
        scratch = torch.empty(part, dtype=torch.float32, device=x.device)
        gw, gb = torch.empty(c, dtype=w.dtype, device=x.device), torch.empty(c, dtype=w.dtype, device=x.device)
        ptrs.update(gamma=w.data_ptr(), part=scratch.data_ptr(), ggamma=gw.data_ptr(), gbeta=gb.data_ptr())
    run("forward", ptrs, stream_of(dev))
    return gx, gw, gb


def _rows(rows: int, c: int, eps: float, dtype: torch.dtype, out: torch.dtype, wdtype: torch.dtype | None,
          stats: bool) -> LayerNormRows:
    return LayerNormRows(rows, c, eps, _NAMES[dtype], _NAMES[out], _NAMES[wdtype] if wdtype is not None else "float32",
                         wdtype is not None, stats)


def _grad(rows: int, c: int, dtype: torch.dtype, gdtype: torch.dtype, wdtype: torch.dtype | None) -> LayerNormGrad:
    return LayerNormGrad(rows, c, _NAMES[dtype], _NAMES[gdtype], _NAMES[wdtype] if wdtype is not None else "float32",
                         wdtype is not None)


def grad_title(lg: LayerNormGrad) -> str:
    return f"layer norm backward {lg.tag()}"


def train_works(rows: int, c: int, eps: float, dtype: torch.dtype, out: torch.dtype, wdtype: torch.dtype | None,
                device: int) -> list[Any]:
    """The ``Work`` of the two programs a :func:`train_rows` call on ``rows`` rows of ``c`` values of ``dtype``
    (written in ``out``) and its :func:`grad_rows` build (the same sources): what torch/train_ahead.py compiles
    ahead for ConvNeXt's MLP node (torch/mlp_train.py)."""
    from convforge.backends.base import Work
    from convforge.codegen.render import render

    dev = get_backend("cuda", device).device
    ln = _rows(rows, c, eps, dtype, out, wdtype, True)
    k, _ = launch(ln, dev)
    lg = _grad(rows, c, dtype, out, wdtype)
    prog = grad_program(lg, dev)
    return [Work(render([k], "cuda", title(ln)), (k,)),
            Work(render(list(prog.kernels), "cuda", grad_title(lg)), tuple(prog.kernels))]


class RowNorm(torch.nn.Module):
    """``F.layer_norm(x, (C,), weight, bias, eps)`` over x's last dimension, weight and bias read from the
    modules that hold them at each call (none of its own: the model's state_dict is unchanged)."""

    def __init__(self, c: int, weight: tuple[torch.nn.Module, str] | None, bias: tuple[torch.nn.Module, str] | None,
                 eps: float) -> None:
        super().__init__()
        if (weight is None) != (bias is None):
            raise ValueError("RowNorm takes both weight and bias, or neither")
        self.c, self.eps = c, float(eps)
        self.__dict__["_cf_params"] = (weight, bias)

    def extra_repr(self) -> str:
        return f"{self.c}, eps={self.eps}, affine={self._cf_params[0] is not None}"

    def params(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return tuple(None if ref is None else getattr(*ref) for ref in self._cf_params)  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.params()
        y = self._convforge(x, w, b) if x.is_cuda and x.dim() >= 1 and x.shape[-1] == self.c else None
        return y if y is not None else torch.nn.functional.layer_norm(x, (self.c,), w, b, self.eps)

    def _convforge(self, x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, b)):
            return None
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return None
        if _AUTOCAST():  # layer norm runs in float32 there, whatever its input
            out = torch.float32
        elif w is not None and (w.dtype != x.dtype or b is None or b.dtype != x.dtype):
            return None
        else:
            out = x.dtype
        if w is not None and (w.dim() != 1 or not w.is_contiguous() or b is None or b.dim() != 1
                              or not b.is_contiguous()):
            return None
        return _run(x.contiguous(), w, b, self.eps, out)
