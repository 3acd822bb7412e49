"""Layer norm over the last dimension of a CUDA tensor on convforge's kernel (kernels/layernorm.py), for
inference (no autograd node: a call that needs a gradient runs PyTorch's):

* ``norm_rows``: what ``FusedLinear`` runs before its product when ``fuse()`` folded the ``nn.LayerNorm`` in
  front of it (ConvNeXt's blocks), written in the dtype the product reads;
* ``RowNorm``: what ``fuse()`` puts in place of a functional ``F.layer_norm`` over the last dimension whose
  weight and bias are a module's (torchvision's ``LayerNorm2d``: ConvNeXt's stem, downsampling layers and
  head), written in the dtype PyTorch's gives (float32 inside autocast).
"""

from __future__ import annotations

from typing import Any

import torch

from convforge import caches
from convforge.backends import get_backend
from convforge.kernels.layernorm import MAX_C, LayerNormRows, launch, title
from convforge.torch.modules import _AUTOCAST

_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_PROGRAMS: dict[tuple[Any, ...], tuple[Any, Any, int]] = {}  # by (shape, dtypes, eps, device)
caches.register(_PROGRAMS.clear, "torch.layernorm: the layer-norm launchers of each shape")


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
         out: torch.dtype) -> torch.Tensor | None:
    c = x.shape[-1] if x.dim() else 0
    if (x.dtype not in _NAMES or out not in _NAMES or not x.is_cuda or not x.is_contiguous() or x.numel() == 0
            or x.data_ptr() % 16 or c > MAX_C):
        return None
    if w is not None and (b is None or w.device != x.device or b.device != x.device):
        return None
    key = (x.shape, x.dtype, out, None if w is None else w.dtype, eps, x.device)
    hit = _PROGRAMS.get(key)
    if hit is None:
        from convforge.backends.cuda import RawLaunches
        from convforge.frontends.torch_run import torch_stream_queries

        ln = LayerNormRows(x.numel() // c, c, eps, _NAMES[x.dtype], _NAMES[out],
                           _NAMES[w.dtype] if w is not None else "float32", w is not None)
        dev = x.device.index or 0
        be = get_backend("cuda", dev)
        k, step = launch(ln, be.device)
        run = RawLaunches(be, (k,), {"forward": (step,)}, title(ln))  # type: ignore[arg-type]
        hit = _PROGRAMS[key] = (run, torch_stream_queries()[0], dev)
    run, stream_of, dev = hit
    y = torch.empty(x.shape, dtype=out, device=x.device)
    if w is None or b is None:
        run("forward", {"x": x.data_ptr(), "y": y.data_ptr()}, stream_of(dev))
    else:
        run("forward", {"x": x.data_ptr(), "gamma": w.data_ptr(), "beta": b.data_ptr(), "y": y.data_ptr()},
            stream_of(dev))
    return y


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
