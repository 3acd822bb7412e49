"""``FusedLinear``: a linear layer over the channels of a channels-last activation, run as convforge's
1x1 convolution in NHWC (the tensor-core generator's ``layout="nhwc"`` plans), with what follows it
folded in.

ConvNeXt's blocks (and any MLP over an (N, H, W, C) activation) spend most of their time in two
``nn.Linear`` layers and the element-wise operations around them: ``Linear -> GELU`` and
``Linear -> permute(0, 3, 1, 2) -> layer_scale * . -> stochastic depth -> + input``.
``fuse()`` (fuse.py) turns each chain into one call of this module:

* ``gelu``: the exact GELU in the GEMM's epilogue; the output is (N, H, W, K) contiguous, as
  ``F.linear`` gives it. The ``nn.LayerNorm`` before it, when ``fuse()`` found one used nowhere else
  (``norm``), runs first on convforge's kernel (torch/layernorm.py), writing the dtype the product reads.
* ``nchw`` + ``scale`` + residual: the per-channel layer scale folded into the weights and bias
  (``W' = s W``, ``b' = s b``, cached per version of the three), the block input added in the
  epilogue (read in channels_last memory format; a copy when it is not), the output the (N, K, H, W)
  view in channels_last memory that the permute gave. The stochastic depth module, where one was
  fused, is called as the model called it (it drops paths in training, is the identity in eval): a
  training-mode one with p > 0 sends the call to PyTorch's operations.

Eval inference on CUDA tensors of one dtype (float32, float16, bfloat16) takes this path where a
variant serves the layer (sm_90: ``tc_implicit_gemm_*``; float32 in the fp32 class as 3xTF32, in
the relaxed class as TF32), and so does a float32 model inside a float16 / bfloat16 autocast region: the
product in the region's dtype (x and the parameters cast to it, as autocast casts a linear layer; the
folded weights cached per version), the output in the dtype PyTorch's operations give (a float32 layer
scale makes the block's output float32: the residual is then added after the product, in float32).
In training ConvNeXt's two chains run as autograd nodes on convforge's kernels in half precision
(torch/mlp_train.py, ``config.mlp_train``, on by default); other chains, and float32 ones, PyTorch's operations.
Anything else (torch.compile, ``torch.jit`` tracing (an ONNX export), CPU, other devices) runs the original
operations through PyTorch, as the traced model did.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from convforge import dispatch
from convforge.backends import get_backend
from convforge.config import config, parse_precision
from convforge.plan import Epilogue
from convforge.spec import ConvSpec
from convforge.torch import mlp_train
from convforge.torch.layernorm import norm_rows, usable
from convforge.torch.modules import _AUTOCAST, Conv2d, autocast_dtype

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)
_GEN = [0]  # bumped by every settings change: a call's cached decision (``_cf_ready``) is then made again
config.on_change(lambda: _GEN.__setitem__(0, _GEN[0] + 1))
_CAPTURING = torch.cuda.is_current_stream_capturing


class FusedLinear(torch.nn.Linear):
    """``nn.Linear`` sharing the original's parameters (same state_dict), whose ``forward(x, res=None)``
    applies the chain it was fused with (module docstring)."""

    _cf_gelu: bool = False
    _cf_nchw: bool = False  # the output permuted to (N, K, H, W), as permute(0, 3, 1, 2) after it
    _cf_scale: tuple[torch.nn.Module, str] | None = None  # (owner, attribute) of the layer scale
    _cf_residual: bool = False
    _cf_drop: torch.nn.Module | None = None  # torchvision's StochasticDepth before the residual add
    _cf_norm: torch.nn.Module | None = None  # an nn.LayerNorm over in_features run before the product

    @classmethod
    def from_linear(cls, m: torch.nn.Linear, gelu: bool = False, nchw: bool = False,
                    scale: tuple[torch.nn.Module, str] | None = None, residual: bool = False,
                    drop: torch.nn.Module | None = None, algo: str = "auto", precision: str | None = None,
                    max_error: float | None = None, static_weights: bool = True,
                    norm: torch.nn.Module | None = None) -> FusedLinear:
        """A FusedLinear sharing ``m``'s parameters, buffers and hooks; ``scale`` is referenced (read at
        each call), never registered, as are ``drop`` (the model's own stochastic depth module) and
        ``norm`` (its layer norm in front of the product)."""
        if precision is not None:
            parse_precision(precision)
        if max_error is not None and not max_error > 0:
            raise ValueError(f"max_error ({max_error!r}) must be > 0")
        if gelu and (nchw or scale is not None or residual or drop is not None):
            raise ValueError("FusedLinear folds either GELU or the permute, layer scale and residual add")
        if norm is not None and not (type(norm) is torch.nn.LayerNorm
                                     and tuple(norm.normalized_shape) == (m.in_features,)):
            raise ValueError(f"norm must be an nn.LayerNorm over the linear's {m.in_features} input features")
        new = cls.__new__(cls)
        new.__dict__.update(m.__dict__)
        new.__dict__.update(_cf_gelu=gelu, _cf_nchw=nchw, _cf_scale=scale, _cf_residual=residual, _cf_drop=drop,
                            _cf_norm=norm, algo=algo,
                            precision=precision, max_error=max_error, static_weights=static_weights,
                            _cf_cache={}, _cf_folded=None, _cf_ready={})
        return new

    def fused_ops(self) -> str:
        """What the module applies around the product: "norm+gelu", "gelu" or "permute+scale+add"."""
        ops = [t for t, on in (("norm", self._cf_norm is not None), ("gelu", self._cf_gelu), ("permute", self._cf_nchw),
                               ("scale", self._cf_scale is not None), ("stochastic_depth", self._cf_drop is not None),
                               ("add", self._cf_residual)) if on]
        return "+".join(ops)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fused={self.fused_ops()!r}"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_cf_cache"], state["_cf_folded"], state["_cf_ready"] = {}, None, {}
        return state

    def scale(self) -> torch.Tensor | None:
        if self._cf_scale is None:
            return None
        owner, attr = self._cf_scale
        return getattr(owner, attr)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor, res: Any = None) -> torch.Tensor:  # type: ignore[override]
        if torch.is_grad_enabled() and self._parameters["weight"].requires_grad:  # type: ignore[union-attr]
            if config.mlp_train:  # ConvNeXt's MLP as two autograd nodes (torch/mlp_train.py), half compute
                y = mlp_train.run(self, x, res)
                if y is not None:
                    return y
            return self.unfused(x, res)  # training: PyTorch's operations, no per-call checks first
        drop = self._cf_drop
        key = (x.shape, x.dtype, x.device, None if res is None else (res.dtype, res.device),
               autocast_dtype() if _AUTOCAST() else None, self.training, drop is not None and drop.training, _GEN[0])
        kept = self.__dict__.get("_cf_ready")
        if kept is None:  # a module pickled before this cache existed
            kept = self.__dict__["_cf_ready"] = {}
        ready = kept.get(key)
        if (ready is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and not torch.jit.is_tracing()):
            y = self._go(x, res, *ready)  # this call's kind ran before: its checks hold (``_convforge``)
            if y is not None:
                return y
        dt = self._run_dtype(x, res) if (res is not None) == self._cf_residual else None
        if dt is not None:
            y = self._convforge(x, res, dt, key)
            if y is not None:
                return y
        return self.unfused(x, res)

    def unfused(self, x: torch.Tensor, res: Any = None) -> torch.Tensor:
        """The original operations, through PyTorch."""
        if self._cf_norm is not None:
            x = self._cf_norm(x)
        y = F.linear(x, self.weight, self.bias)
        if self._cf_gelu:
            y = F.gelu(y)
        if self._cf_nchw:
            y = y.permute(0, 3, 1, 2)
        s = self.scale()
        if s is not None:
            y = s * y
        if self._cf_drop is not None:
            y = self._cf_drop(y)
        return y if res is None else y + res

    def _run_dtype(self, x: torch.Tensor, res: Any) -> torch.dtype | None:
        """The dtype convforge runs the call in, or None (PyTorch's operations): in a CUDA autocast region
        its half dtype (x and the parameters float32 or that), else x's when the parameters have it too;
        calls that need no gradient only."""
        w, b, s, norm = self.weight, self.bias, self.scale(), self._cf_norm
        if not (x.is_cuda and x.dim() == 4 and x.dtype in _DTYPES and w.is_cuda) or torch.compiler.is_compiling():
            return None
        if torch.jit.is_tracing():  # an ONNX export records PyTorch's operations, not raw launches
            return None
        dt = autocast_dtype() if _AUTOCAST() else x.dtype
        if dt not in _DTYPES or (_AUTOCAST() and dt not in _HALF):
            return None
        allowed = (torch.float32, dt) if _AUTOCAST() else (dt,)
        nw = () if norm is None else (norm.weight, norm.bias)
        if any(t is not None and t.dtype not in allowed for t in (x, w, b, s, *nw)):
            return None
        if s is not None and (not s.is_cuda or s.numel() != w.shape[0]):
            return None
        if res is not None and not (isinstance(res, torch.Tensor) and res.is_cuda and res.dtype in allowed):
            return None
        if norm is not None and not usable(norm, x.shape[-1]):
            return None
        drop = self._cf_drop
        if drop is not None and drop.training and getattr(drop, "p", 1.0) > 0:
            return None  # it drops paths: PyTorch's operations, the module's own randomness
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, b, s, res, *nw)):
            return None
        return dt

    def _convforge(self, x: torch.Tensor, res: Any, dt: torch.dtype, key: Any) -> torch.Tensor | None:
        """The fused call in ``dt``, or None when no convforge variant runs the layer or the residual's
        shape is not the output's. What it decided is kept under ``key`` (x's shape, dtype and device, the
        residual's dtype and device, the autocast dtype, this module's and the stochastic depth's training
        mode, the settings' generation): a later call of the same kind goes straight to ``_go`` while
        gradients are off."""
        out = dt
        if _AUTOCAST():  # the dtype PyTorch's operations give: a float32 scale or residual promotes
            for t in (self.scale(), res):
                out = out if t is None else torch.promote_types(out, t.dtype)
        inner = res is not None and res.dtype == dt and out == dt  # the residual added in the epilogue
        run = self._runner(tuple(x.shape), dt, x.device, inner)
        if run is None:
            return None
        y = self._go(x, res, dt, out, inner, run)
        if y is not None and not _CAPTURING():
            self.__dict__.setdefault("_cf_ready", {})[key] = (dt, out, inner, run)
        return y

    def _go(self, x: torch.Tensor, res: Any, dt: torch.dtype, out: torch.dtype, inner: bool,
            run: Any) -> torch.Tensor | None:
        """The norm (when folded), the product with its epilogue, and the residual where it is added after."""
        n, h, w_, _ = x.shape
        if res is not None and tuple(res.shape) != (n, self.out_features, h, w_):
            return None  # a broadcasting add: PyTorch's operations do what the model did
        if self._cf_norm is not None:
            x = norm_rows(x.contiguous(), self._cf_norm, dt)  # type: ignore[arg-type]
            if x is None:
                return None
        elif x.dtype != dt or not x.is_contiguous():
            x = x.to(dtype=dt, memory_format=torch.contiguous_format)
        w4, b = self._weights(dt)
        xv = x.permute(0, 3, 1, 2)  # (N, C, H, W) in channels_last memory: what the NHWC plan reads
        filters = run.filters
        packed = None
        if filters is not None and (self.static_weights or not _CAPTURING()):
            packed = filters.get(w4, w4.data_ptr())
        y = run(xv, w4, b, packed, res) if inner else run(xv, w4, b, packed)
        if res is not None and not inner:  # in ``out`` (module docstring): a half residual summed into float32
            y = y + res if res.dtype == out else torch.add(y, res, out=torch.empty_like(y, dtype=out))
        elif y.dtype != out:
            y = y.to(out)
        return y if self._cf_nchw else y.permute(0, 2, 3, 1)  # type: ignore[no-any-return]

    def _runner(self, shape: tuple[int, ...], dt: torch.dtype, device: torch.device, inner: bool) -> Any:
        key = (shape, dt, device, inner, config.precision, config.max_error, config.autotune, config.db_path)
        try:
            return self._cf_cache[key]
        except KeyError:
            run = self._cf_cache[key] = self._make_runner(shape, dt, device, inner)
            return run

    def _make_runner(self, shape: tuple[int, ...], dt: torch.dtype, device: torch.device, inner: bool) -> Any:
        dev = device.index or 0
        try:
            spec = self._spec(shape, dt)
            return dispatch.runner(None, spec, get_backend("cuda", dev), self._epilogue(inner), "torch", dev,
                                   algo=self.algo, precision=self.precision, max_error=self.max_error)
        except ValueError:
            return None

    def _spec(self, x_shape: tuple[int, ...], dtype: torch.dtype) -> ConvSpec:
        n, h, w_, c = x_shape
        return ConvSpec.from_shapes((n, c, h, w_), (self.out_features, c, 1, 1), dtype=dtype, layout="nhwc")

    def _epilogue(self, residual: bool | None = None) -> Epilogue:
        """The product's epilogue; ``residual`` False where the residual is added after it (autocast)."""
        res = self._cf_residual if residual is None else residual
        return Epilogue(bias=self.bias is not None, gelu=self._cf_gelu, residual=res)

    # -- calibration (torch/model_calibration.py): a bound no variant meets runs PyTorch's operations -----
    cf_tight_is_pytorch = True  # at a bound no convforge variant states, forward runs PyTorch's ops

    # Conv2d's: the bound the variant is chosen under, cached runners dropped; here a bound no variant
    # states sends the layer to PyTorch's operations (exact FP32)
    def set_max_error(self, value: float | None) -> None:
        """Conv2d's: the bound changed, the cached runners and the calls' decisions dropped."""
        Conv2d.set_max_error(self, value)  # type: ignore[arg-type]
        self.__dict__["_cf_ready"] = {}

    def cf_choice(self, x_shape: tuple[int, ...], device: int,
                  max_error: float | None) -> tuple[ConvSpec, dispatch.Choice] | None:
        """(spec, choice) for an input of ``x_shape`` under ``max_error``, or None when convforge
        does not run the layer (a 4-D input's last dimension is the channels)."""
        if len(x_shape) != 4:
            return None
        try:
            spec = self._spec(x_shape, self.weight.dtype)
            return spec, dispatch.choose(spec, get_backend("cuda", device), self._epilogue(), algo=self.algo,
                                         precision=self.precision, max_error=max_error)
        except ValueError:
            return None

    def _weights(self, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weights as K x C x 1 x 1, bias) in ``dt`` with the layer scale folded in: views of the
        parameters where they are ``dt`` and there is no scale; else computed once per version of weight,
        bias and scale (per call under a CUDA graph capture that has not seen them, or for inference
        tensors), the product in the parameters' dtype, then rounded to ``dt``."""
        w, b, s = self.weight, self.bias, self.scale()
        if s is None and w.dtype == dt and (b is None or b.dtype == dt):
            return w.detach().view(self.out_features, self.in_features, 1, 1), None if b is None else b.detach()
        try:
            key = (dt, *((t.data_ptr(), t._version) for t in (w, b, s) if t is not None))
        except RuntimeError:  # inference tensors have no version counter
            key = None
        hit = self._cf_folded
        if key is not None and hit is not None and hit[0] == key:
            return hit[1], hit[2]
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor: the filter cache keys its version
            sv = None if s is None else s.reshape(-1, 1)
            w4 = (w if sv is None else w * sv).to(dt).view(self.out_features, self.in_features, 1, 1)
            b2 = None if b is None else (b if sv is None else b * sv.reshape(-1)).to(dt)
        if key is not None and not _CAPTURING():
            self.__dict__["_cf_folded"] = (key, w4, b2)
        return w4, b2
