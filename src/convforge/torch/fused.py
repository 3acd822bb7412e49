"""``FusedConv2d``: a convforge ``Conv2d`` that also applies the batch norm, residual add and ReLU
(or, after a batch norm alone, SiLU / HardSwish: ``act``) that followed it in a model
(``convforge.torch.fuse`` puts it there). In training the activation runs inside the batch norm's
kernels (torch/batchnorm.py); in the folded path it follows the plan in place.

Two paths, chosen per call:
- folded (eval inference on CUDA: no gradient needed, the batch norm, if any, in eval mode with
  running statistics, not compiling): the batch norm is folded into the filters and bias
  (w' = w * g / sqrt(var + eps), b' = (b - mean) * g / sqrt(var + eps) + beta, computed in float64
  on the device, then cast to the conv's dtype: float32, or float16 / bfloat16 for a half layer
  and inside a CUDA autocast region, whose input is cast too; a residual of another dtype takes the
  unfused path), cached per (data_ptr, _version) of the conv's weight and
  bias and the batch norm's weight, bias, running mean and running variance, and ONE convforge
  plan runs with the epilogue bias + residual + ReLU (filter transforms cached per version of the
  folded weights: a warm call does no fold and no filter transform). When the chosen variant has
  no residual store path (``Variant.residual_ok``: the tensor-core GEMMs), the plan adds bias only
  and the add and ReLU follow in place on its output. Warm calls run through the native fast path
  (native.cpp): a plan without the residual is ``conv2d``'s plan for the folded weights and bias,
  found by ``run`` as ``Conv2d``'s calls are; a plan that adds it is filed under its own key and
  found by ``run_res``.
- unfused (training, gradients, CPU tensors, torch.compile, anything the folded path does not
  take): exactly conv -> batch norm (running statistics updated as PyTorch does) -> + residual ->
  ReLU, the conv through ``Conv2d.forward`` (the differentiable op on CUDA); a batch norm in
  training mode, with the add and ReLU after it, on convforge's kernels (``torch/batchnorm.py``,
  which says what it takes), else the module itself and PyTorch's ops; conv -> ReLU without batch
  norm in training as one node whose conv applies bias and ReLU, its backward masking the gradient
  and summing the bias in one kernel (``torch/conv_relu.py``).

A pre-activation before the conv (batch norm -> ReLU -> conv: DenseNet, pre-activation ResNets;
``fuse`` puts a :class:`PreActivation` node where the two were): in eval mode with running
statistics that node passes its input through and each conv that reads it folds the batch norm and
ReLU into its input load, a prologue (pscale = g / sqrt(var + eps), pshift = beta - mean * pscale,
float64 then float32, cached per version like the fold above; the plan runs on the raw input, the
padding of the activated tensor stays zero; Python fast path only: the native one has no slots for
them), or, off the folded path, applies them itself (``F.batch_norm`` in eval mode: no statistics
change, however many convs read it) before the unfused path; in training mode (or without running
statistics) the node runs the batch norm module itself, once (running statistics updated as the
model did; on convforge's kernels where ``torch/batchnorm.py`` takes it), and the ReLU, and the
convs take the activated tensor as plain convs.

The batch norms are references to the modules in the model's hierarchy (not registered
submodules: ``state_dict`` keeps its keys where they were). CUDA graphs captured in eager inference
replay the fold and filter transforms made before capture (``static_weights=True``, as for
``Conv2d``): after an in-place weight or statistics update run one eager forward (it re-folds
into the same buffers) before replaying; with ``static_weights=False`` the capture records the
fold and the whole plan, so replays see every update.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from convforge import dispatch
from convforge.backends import get_backend
from convforge.config import config
from convforge.frontends import fast_path
from convforge.kernels.batchnorm import ACTS
from convforge.plan import Epilogue, Prologue
from convforge.spec import ConvSpec
from convforge.torch import batchnorm as bn_train
from convforge.torch import conv_relu, filter_casts, residual_grad
from convforge.torch.modules import Conv2d, compute_dtype, padding_quad, read_tensor, reads_nhwc
from convforge.torch.ops import handed_back

log = logging.getLogger("convforge")

_F32 = torch.float32
_CAPTURING = torch.cuda.is_current_stream_capturing
_GRAD = torch.is_grad_enabled
_FOLD = ("fold",)  # the folded weights' key in the module's _cf_cache
_PRE_FOLD = ("prefold",)  # the prologue's folded scale and shift
_BLOCK = "block"  # a training block's native filing in the module's _cf_cache (FusedConv2d._file_block)


def _block_key(x: torch.Tensor, dt: torch.dtype, res: Any, bn: torch.nn.BatchNorm2d) -> tuple[Any, ...]:
    """A training block's filing key: the conv's input signature (``x`` cast to ``dt`` keeps its shape
    and strides, so the key needs no cast), what the batch norm program depends on beyond the
    tensors native.cpp checks, and ``config.bn_stats`` (an A/B in one process files each form)."""
    return (_BLOCK, x.shape, x.stride(), dt, x.get_device(), res is not None, bn.eps, bn.momentum, config.bn_stats)


class PreActivation(torch.nn.Module):
    """batch norm [-> ReLU] before convs that fold it (``fuse``): in eval mode with running
    statistics it returns its input (each reading ``FusedConv2d`` applies them, module docstring),
    otherwise it runs the batch norm module (once) and the ReLU. The batch norm is referenced, not
    registered: no parameters or buffers of its own, ``state_dict`` unchanged."""

    bn: torch.nn.BatchNorm2d
    relu: bool

    def __init__(self, bn: torch.nn.BatchNorm2d, relu: bool) -> None:
        super().__init__()
        self.__dict__["bn"] = bn
        self.relu = relu

    def passes_through(self) -> bool:
        """Whether the readers get the raw input (eval mode, running statistics present)."""
        bn = self.bn
        return not bn.training and bn.running_mean is not None and bn.running_var is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.passes_through():
            return x
        if bn_train.takes(self.bn, x):  # training: our batch norm (+ ReLU) kernels
            return bn_train.bn_act(x, self.bn, None, self.relu)
        y = self.bn(x)
        return torch.relu(y) if self.relu else y

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        """What the batch norm module and ReLU compute in eval mode (no statistics change)."""
        bn = self.bn
        y = torch.nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
        return torch.relu(y) if self.relu else y

    def prologue(self) -> Prologue:
        return Prologue(affine=True, relu=self.relu)

    def ops(self) -> str:
        return "bn+relu" if self.relu else "bn"

    def extra_repr(self) -> str:
        return f"folds={self.ops()!r} into the convs that read it"


class FusedConv2d(Conv2d):
    """A ``Conv2d`` whose forward is conv [-> batch norm] [-> + residual] [-> ReLU]; ``forward(x,
    res=None)`` takes the residual when the module was fused with an add (module docstring)."""

    _cf_bn: torch.nn.BatchNorm2d | None
    _cf_residual: bool
    _cf_relu: bool
    _cf_act: str = ""  # "silu" / "hardswish" after the batch norm (no ReLU, no residual): EfficientNet, MobileNet-v3
    _cf_pre: PreActivation | None = None  # the pre-activation it folds (set by ``fuse``)

    @classmethod
    def from_conv(cls, m: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d | None = None, residual: bool = False,
                  relu: bool = False, act: str = "", **options: Any) -> FusedConv2d:
        """A FusedConv2d sharing ``m``'s parameters, buffers, hooks and attribute dicts; ``bn`` is
        referenced, not registered. ``act``: SiLU or HardSwish after the batch norm (``ACTS``)."""
        if act not in ACTS or (act and (bn is None or residual or relu)):
            raise ValueError(f"FusedConv2d: act ({act!r}) must be one of {ACTS}, after a batch norm without "
                             "residual or ReLU")
        new = cls.__new__(cls)
        new.__dict__.update(m.__dict__)
        new._cf_setup(**{"algo": "auto", "precision": None, "max_error": None, "static_weights": True, **options})
        new.__dict__["_cf_bn"] = bn  # a plain attribute: not a submodule, not in state_dict
        new._cf_residual, new._cf_relu, new._cf_act = residual, relu, act
        return new

    def fused_ops(self) -> str:
        """What this module applies after the conv, e.g. "bn+add+relu", and before it, e.g.
        "pre(bn+relu)+bn+relu"."""
        after = "+".join(t for t, on in (("bn", self._cf_bn is not None), ("add", self._cf_residual),
                                         ("relu", self._cf_relu), (self._cf_act, bool(self._cf_act))) if on)
        if self._cf_pre is None:
            return after
        return f"pre({self._cf_pre.ops()})" + (f"+{after}" if after else "")

    def set_prologue(self, pre: PreActivation | None) -> None:
        """Fold ``pre`` (the PreActivation node whose output this conv reads) into the input load."""
        self.__dict__["_cf_pre"] = pre  # a reference, never a submodule
        self._cf_cache.clear()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fused={self.fused_ops()!r}"

    def forward(self, x: torch.Tensor, res: Any = None) -> torch.Tensor:  # type: ignore[override]
        pre = self._cf_pre
        if pre is not None and not pre.passes_through():
            return self.unfused(x, res)  # the node ran the batch norm and ReLU: x is activated
        w = _weight_bias(self)[0]
        if _GRAD() and w.requires_grad:  # training: never folded (_folds)
            return self.unfused(x if pre is None else pre.activate(x), res)
        src = _sources(self)
        if self._folds(x, res, src) and (pre is None or _pre_folds(pre)):
            y = self._folded_forward(x, res, src)
            if y is not None:
                return y
        return self.unfused(x if pre is None else pre.activate(x), res)

    def unfused(self, x: torch.Tensor, res: Any = None) -> torch.Tensor:
        """conv -> batch norm -> + res -> ReLU (or -> SiLU / HardSwish), as the original model ran: the
        batch norm in training mode, the add and the activation on convforge's kernels where
        :func:`bn_train.takes` them, else the module itself and PyTorch's ops."""
        bn = self._cf_bn
        if bn is None and res is None and self._cf_relu and not self._cf_residual:
            z = self._conv_relu(x)
            if z is not None:
                return z
        if bn is not None:
            z = self._native_block(x, bn, res)
            if z is not None:
                return z
        y = Conv2d.forward(self, x)
        if bn is not None and bn_train.takes(bn, y, res):
            z = bn_train.bn_act(y, bn, res, self._cf_relu, self._cf_act)
            self._file_block(x, bn, res, y)
            return z
        if bn is not None:
            y = bn(y)
        if res is not None:
            y = y + res
        return torch.relu(y) if self._cf_relu else _activate(y, self._cf_act)

    def _native_block(self, x: torch.Tensor, bn: torch.nn.BatchNorm2d, res: Any) -> torch.Tensor | None:
        """conv -> batch norm [-> + res] [-> ReLU] in training as one C++ autograd node (native.cpp
        ``block``) once :meth:`_file_block` has filed this input signature; None: the Python nodes run
        (not filed, the conv not filed with the native path, a check there failed). A half layer and
        an autocast region run it too, on the operands :meth:`_block_operands` hands it."""
        if (not bn_train.block_ok(bn) or self.padding_mode != "zeros"
                or read_tensor(self, "_parameters", "bias") is not None):  # as filed: what the call passes
            return None
        dt = compute_dtype(x, read_tensor(self, "_parameters", "weight"))
        hit = None if dt is None else self._cf_cache.get(_block_key(x, dt, res, bn))
        if hit is None or dt is None:
            return None
        ops = self._block_operands(x, dt)
        if ops is None:
            return None
        module, handle, call = hit
        p, b = bn._parameters, bn._buffers
        return module.block(*ops, *call, res,  # type: ignore[no-any-return]
                            p.get("weight"), p.get("bias"), b.get("running_mean"), b.get("running_var"),
                            b.get("num_batches_tracked"), handle)

    def _block_operands(self, x: torch.Tensor, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(input, weight) as the block node takes them: the input in ``dt`` (:func:`compute_dtype`: an
        autocast region casts it, keeping channels_last); the module's own weight, which the node copies
        to KCRS in ``dt`` itself (an autocast region's float32 master weight cast in C++, its gradient cast
        back there: no Python cast and no autograd node of its own a block). None when convforge does
        not run the conv."""
        w = read_tensor(self, "_parameters", "weight")
        if x.dim() != 4 or not (x.is_cuda and w.is_cuda):
            return None
        if x.dtype != dt:
            x = x.to(dt)  # keeps channels_last
        if w.dtype not in (dt, torch.float32):  # another half dtype than the region's: cast as Conv2d does
            w = self._cast(w, dt)
        return x, w

    def _file_block(self, x: torch.Tensor, bn: torch.nn.BatchNorm2d, res: Any, y: torch.Tensor) -> None:
        """After a training call the Python nodes ran (its conv filed with native.cpp by then): file its
        signature for :meth:`_native_block`, where the C++ path is built and the conv has no bias. ``x``:
        the module's input (cast here as the conv cast it); ``y``: the conv's output."""
        if (not (config.native_block and _GRAD()) or read_tensor(self, "_parameters", "bias") is not None
                or self.padding_mode != "zeros"):
            return
        module = fast_path.load_torch()
        w = read_tensor(self, "_parameters", "weight")
        dt = compute_dtype(x, w)
        if module is None or dt is None or y.dtype != dt:
            return
        # conv2d's spelling of the call, as the op's CUDA kernel files it (ops._cuda)
        call = (None, tuple(self.stride), tuple(padding_quad(self)), tuple(self.dilation), self.algo, None, None,
                False, None, self.precision, self.max_error, self.groups)
        stats = self._stats_conv(x, w, dt, y)
        handle = bn_train.native_handle(module, bn, y, res, self._cf_relu, stats, self._cf_act)
        self._cf_cache[_block_key(x, dt, res, bn)] = (module, handle, call)
        # a handle with a statistics conv is filed per conv: one residual-adding dgrad fits its every call
        residual_grad.note_block(module, self, x, res, handle, dt, stats is not None)
        filter_casts.attach(module, handle, w, dt)

    def _stats_conv(self, x: torch.Tensor, w: torch.Tensor, dt: torch.dtype,
                    y: torch.Tensor) -> tuple[Any, int, Any] | None:
        """(native program, P, the conv's identity: spec, variant, parameters) of this block's conv with the
        batch norm's P partial sums in its epilogue (``config.bn_stats``; a variant with ``plan_stats``:
        tensor-core NHWC forwards), or None: the batch norm reads y for its statistics. Any failure here only
        costs the speed-up (logged)."""
        if y.dim() != 4 or not self.stats_conv_wanted(y.is_contiguous(memory_format=torch.channels_last)):
            return None
        try:
            found = self.stats_plan(tuple(x.shape), tuple(w.shape), dt, x.device.index or 0)
            if found is None:
                return None
            plan, parts, spec = found
            backend = get_backend("cuda", x.device.index or 0)
            return bn_train.stats_conv_program(backend, plan), parts, (spec, plan.variant, repr(plan.params))
        except (ValueError, RuntimeError) as err:
            log.info("convforge: the batch norm after the conv of %s x %s computes its own statistics (%s)",
                     tuple(x.shape), tuple(w.shape), err)
            return None

    def stats_conv_wanted(self, channels_last: bool) -> bool:
        """Whether this block's conv writes its batch norm's partial sums in training: the C++ block node
        (``config.native_block``) with ``config.bn_stats``, no conv bias, zero padding and a channels-last
        output. The one place :meth:`_file_block` and torch/train_ahead.py read it from."""
        return (config.bn_stats and config.native_block and channels_last and self.padding_mode == "zeros"
                and read_tensor(self, "_parameters", "bias") is None)

    def stats_plan(self, x_shape: tuple[int, ...], w_shape: tuple[int, ...], dt: torch.dtype,
                   device: int) -> tuple[Any, int, ConvSpec] | None:
        """(plan, P, spec) of this block's conv on channels-last ``x_shape`` in ``dt`` with the batch norm's P
        partial sums in its epilogue, or None where its variant has no such plan, its tile is not whole 32-column
        chunks (tiles.narrow) or K is not a multiple of 4
        (the partial sums follow 5 C floats of statistics in the block's scratch: 16-byte aligned); raises
        ValueError where nothing applies. Also what torch/train_ahead.py compiles ahead."""
        if w_shape[0] % 4:
            return None
        spec = ConvSpec.from_shapes(x_shape, w_shape, tuple(self.stride), padding_quad(self), tuple(self.dilation),
                                    self.groups, dtype=dt, layout="nhwc")
        backend = get_backend("cuda", device)
        ch = dispatch.choose(spec, backend, Epilogue(), algo=self.algo, precision=self.precision,
                             max_error=self.max_error)
        make = getattr(ch.variant, "plan_stats", None)
        if make is None or int(ch.params.get("bn", 0)) % 32:  # statistics take whole 32-column chunks: a
            return None  # 16-column tile (tiles.narrow, K <= 16) leaves them to the batch norm's own pass
        plan, parts = make(spec, ch.params, backend.device)
        return plan, parts, spec

    def res_dgrad_plan(self, x_shape: tuple[int, ...], w_shape: tuple[int, ...], dt: torch.dtype,
                       device: int) -> Any | None:
        """The plan of this block's dgrad on channels-last ``x_shape`` in ``dt`` that also adds a residual
        shaped as the input (torch/residual_grad.py): the dgrad ``auto`` picks for the layer, where it is the
        transposed forward of a variant that stores a residual (stride-1 layers on the tensor-core GEMM) and
        prefetches it (``rs=1``: 16-bit tiles that stage halves); None elsewhere, or where the half layer's
        dgrad is handed to PyTorch. Also what
        torch/train_ahead.py compiles ahead."""
        from convforge.frontends.checks import check_options
        from convforge.kernels.dgrad.transposed import DgradTransposed
        from convforge.torch.ops import _slow_call

        geo = (tuple(self.stride), padding_quad(self), tuple(self.dilation))
        if _slow_call("dgrad", x_shape, w_shape, *geo, self.groups, dt, True, device, self.algo, self.precision,
                      self.max_error):
            return None
        spec = ConvSpec.from_shapes(x_shape, w_shape, *geo, self.groups, dtype=dt, conv_pass="dgrad", layout="nhwc")
        backend = get_backend("cuda", device)
        _, limit = check_options(False, None, self.precision, self.max_error)
        ch = dispatch.choose(spec, backend, Epilogue(), algo=self.algo, precision=self.precision,
                             max_error=self.max_error, workspace_limit=limit)
        v, epi = ch.variant, Epilogue(residual=True)
        if type(v) is not DgradTransposed or not v.fwd.residual_ok:
            return None
        prm = v.epilogue_params(spec, ch.params, epi)
        if not prm.get("rs"):  # a residual read after the accumulators costs more than the add it saves
            return None
        return v.plan(spec, prm, backend.device, epi)

    def _conv_relu(self, x: torch.Tensor) -> torch.Tensor | None:
        """conv -> ReLU in training on convforge's kernels (torch/conv_relu.py), or None (the
        unfused path runs: inference, tracing, a layer convforge does not run). In an autocast region
        the input, filters and bias are cast to its dtype first (differentiably, as autocast casts)."""
        w, b = _weight_bias(self)
        if not (_GRAD() and w is not None and w.requires_grad and conv_relu.takes(x, w, b, self.padding_mode)):
            return None
        dt = compute_dtype(x, w)
        if dt is not None and dt != w.dtype:
            x, w, b = x.to(dt), self._cast(w, dt), None if b is None else self._cast(b, dt)
        return conv_relu.conv_relu(x, w, b, (list(self.stride), list(padding_quad(self)), list(self.dilation),
                                             self.algo, self.precision, self.max_error, self.groups))

    def _folds(self, x: torch.Tensor, res: Any, src: tuple[Any, ...]) -> bool:
        """Whether this call may take the folded path (eval inference on CUDA float32); ``src``:
        :func:`_sources`."""
        w, bn = src[0], self._cf_bn
        if not (x.is_cuda and x.dim() == 4 and w.is_cuda):
            return False
        dt = compute_dtype(x, w)  # float32, or half (a half layer, an autocast region)
        if dt is None or (src[1] is not None and src[1].dtype != w.dtype):
            return False
        if bn is not None and (bn.training or src[4] is None or src[5] is None):
            return False
        if (res is not None) != self._cf_residual:  # a residual given to a module fused without one, or
            return False  # missing: the unfused path adds what it is given, as the original did
        if res is not None and not (isinstance(res, torch.Tensor) and res.is_cuda and res.dtype == dt):
            return False
        if torch.compiler.is_compiling():
            return False
        if not torch.is_grad_enabled():
            return True
        return not any(t is not None and t.requires_grad for t in (x, res, *src[:4]))

    def _folded_forward(self, x: torch.Tensor, res: Any, src: tuple[Any, ...]) -> torch.Tensor | None:
        """One plan (and, without a residual store path, an in-place add and ReLU); None when
        convforge cannot run the layer or the residual does not match the output. A plan without
        the residual is conv2d's plan for the folded weights and bias (with the ReLU when no add
        follows), so a warm call runs it through the native fast path, as ``Conv2d`` does."""
        dt = compute_dtype(x, src[0])
        assert dt is not None  # _folds said so
        if x.dtype != dt:
            x = x.to(dt)  # keeps channels_last
        entry = self._fused_runner(x, "nhwc") if reads_nhwc(self, x) else None
        if entry is None:
            x = x.contiguous()
            entry = self._fused_runner(x)
        if entry is None:
            return None
        run, res_in_plan, y_shape = entry
        if res is not None and res.shape != y_shape:
            return None  # a broadcasting add: the unfused path does what PyTorch did
        b: torch.Tensor | None
        if self._cf_bn is not None:
            w, b = self._fold(src, dt)
        else:
            w = self._cast(src[0], dt)
            b = None if src[1] is None else self._cast(src[1], dt)
        skip = self.static_weights and _CAPTURING()
        # conv2d's spelling; relu: the plan's (after the add when the plan adds the residual)
        call = (x, w, b, self.stride, padding_quad(self), self.dilation, self.algo, None, None,
                self._cf_relu and (res is None or res_in_plan), None, self.precision, self.max_error, self.groups)
        if self._cf_pre is not None:  # a prologue: the Python runner (no native slots for its buffers)
            y = self._run_python(run, res_in_plan, call, res, self._pre_fold())
            if res is not None and not res_in_plan:
                y.add_(res)
                if self._cf_relu:
                    y.relu_()
            return _activate(y, self._cf_act, inplace=True)
        if res_in_plan:
            y = None if skip or fast_path.RUN_RES is None else fast_path.RUN_RES(*call, res)
            return self._run_python(run, True, call, res) if y is None else y  # type: ignore[no-any-return]
        y = None if skip or fast_path.RUN is None else fast_path.RUN(*call)
        if y is None:
            y = self._run_python(run, False, call, res)
        if res is not None:
            y.add_(res)
            if self._cf_relu:
                y.relu_()
        return _activate(y, self._cf_act, inplace=True)

    def _run_python(self, run: Any, res_in_plan: bool, call: tuple[Any, ...], res: Any,
                    pro: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The plan through its Python runner, with filters cached per version of the (folded)
        weights; then filed with the native fast path (a plan that adds the residual under its
        own key, for ``run_res``), unless it has a prologue (``pro``: its scale and shift)."""
        x, w, b = call[:3]
        filters = run.filters
        packed = None
        if filters is not None and (self.static_weights or not _CAPTURING()):
            packed = filters.get(w, w.data_ptr())
        if pro is not None:
            return run(x, w, b, packed, res if res_in_plan else None, pro)  # type: ignore[no-any-return]
        y = run(x, w, b, packed, res) if res_in_plan else run(x, w, b, packed)
        if (fast_path.RUN_RES if res_in_plan else fast_path.RUN) is not None and not _CAPTURING():
            fast_path.file_native(run, call, residual=res_in_plan)
        return y  # type: ignore[no-any-return]

    def _fused_runner(self, x: torch.Tensor, layout: str = "nchw") -> tuple[Any, bool, tuple[int, ...]] | None:
        """(runner, whether its plan adds the residual, output shape) per input signature and layout
        ("nhwc": a depthwise layer's channels_last input, read in place)."""
        key = ("fused", x.shape, x.dtype, x.device, layout, config.precision, config.max_error, config.autotune,
               config.db_path)
        try:
            return self._cf_cache[key]  # type: ignore[no-any-return]
        except KeyError:
            entry = self._cf_cache[key] = self._make_fused_runner(x, layout)
            return entry

    def _make_fused_runner(self, x: torch.Tensor, layout: str = "nchw") -> tuple[Any, bool, tuple[int, ...]] | None:
        try:
            spec = ConvSpec.from_shapes(tuple(x.shape), tuple(self.weight.shape), tuple(self.stride),
                                        padding_quad(self), tuple(self.dilation), self.groups, dtype=x.dtype,
                                        layout=layout)
        except ValueError:
            return None
        dev = x.device.index or 0
        if handed_back(spec, dev, self.algo, self.precision, self.max_error):
            return None  # the unfused path: PyTorch's convolution (logged once)
        backend = get_backend("cuda", dev)
        pro = self._prologue()
        kw: dict[str, Any] = dict(algo=self.algo, precision=self.precision, max_error=self.max_error, prologue=pro)
        try:
            ch, epi, res_in_plan = self._fused_choice(spec, backend, self.max_error)
            if res_in_plan:
                run = dispatch.runner(None, spec, backend, epi, "torch", dev, algo=ch.variant.name, params=ch.params,
                                      prologue=pro)
                return run, True, spec.y_shape
            return dispatch.runner(None, spec, backend, epi, "torch", dev, **kw), False, spec.y_shape
        except ValueError:
            return None

    def _fused_choice(self, spec: ConvSpec, backend: Any,
                      max_error: float | None) -> tuple[dispatch.Choice, Epilogue, bool]:
        """(choice, the epilogue the plan runs, whether it adds the residual): with a residual, the
        choice for bias + ReLU when that variant has a residual store path, else the choice for the
        epilogue without the add (the add and ReLU then follow in place)."""
        bias = self._cf_bn is not None or self.bias is not None
        kw: dict[str, Any] = dict(algo=self.algo, precision=self.precision, max_error=max_error,
                                  prologue=self._prologue())
        if self._cf_residual:
            ch = dispatch.choose(spec, backend, Epilogue(bias, self._cf_relu), **kw)
            if ch.variant.residual_ok:
                return ch, Epilogue(bias, self._cf_relu, residual=True), True
        epi = Epilogue(bias, self._cf_relu and not self._cf_residual)
        return dispatch.choose(spec, backend, epi, **kw), epi, False

    def cf_choice(self, x_shape: tuple[int, ...], device: int,
                  max_error: float | None) -> tuple[ConvSpec, dispatch.Choice] | None:
        """(spec, what the folded path chooses) for an input of ``x_shape`` under ``max_error``
        (see ``Conv2d.cf_choice``), or None when convforge cannot run the layer."""
        try:
            spec = ConvSpec.from_shapes(tuple(x_shape), tuple(self.weight.shape), tuple(self.stride),
                                        padding_quad(self), tuple(self.dilation), self.groups, dtype=self.weight.dtype)
            return spec, self._fused_choice(spec, get_backend("cuda", device), max_error)[0]
        except ValueError:
            return None

    def _prologue(self) -> Prologue:
        return Prologue() if self._cf_pre is None else self._cf_pre.prologue()

    def _pre_fold(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prologue's (pscale, pshift) from the pre-activation's batch norm, computed in float64
        and cast to float32, cached per address and version of its four tensors (re-folded into the
        same tensors; under CUDA-graph capture a stale fold is recorded, never cached)."""
        assert self._cf_pre is not None
        bn = self._cf_pre.bn
        src = tuple(read_tensor(bn, t, n) for t, n in (("_parameters", "weight"), ("_parameters", "bias"),
                                                         ("_buffers", "running_mean"), ("_buffers", "running_var")))
        key: tuple[Any, ...] | None
        try:
            key = tuple(None if t is None else (t.data_ptr(), t._version) for t in src) + (bn.eps,)
        except RuntimeError:  # inference tensors: fold per call
            key = None
        hit = self._cf_cache.get(_PRE_FOLD)
        if hit is not None and key is not None and hit[0] == key and (self.static_weights or not _CAPTURING()):
            return hit[1], hit[2]
        scale, shift = fold_affine(bn)
        if key is None or _CAPTURING():
            return scale, shift
        if hit is not None and hit[1].shape == scale.shape and hit[1].device == scale.device:
            with torch.inference_mode(False), torch.no_grad():
                hit[1].copy_(scale)
                hit[2].copy_(shift)
            scale, shift = hit[1], hit[2]
        self._cf_cache[_PRE_FOLD] = (key, scale, shift)
        return scale, shift

    def _fold(self, src: tuple[Any, ...] | None = None,
              dtype: torch.dtype = _F32) -> tuple[torch.Tensor, torch.Tensor]:
        """Folded (weight, bias) as ``dtype``, cached per address and version of the six source
        tensors (``src``, :func:`_sources`; read here when not given) and the dtype; a re-fold writes
        into the cached tensors (same addresses: filter caches and captured graphs keep valid
        pointers). Under CUDA-graph capture a stale or missing fold is recorded into the graph,
        never cached."""
        src = _sources(self) if src is None else src
        key = _fold_key(src, self._cf_bn)
        key = None if key is None else key + (dtype,)
        hit = self._cf_cache.get(_FOLD)
        if hit is not None and key is not None and hit[0] == key and (self.static_weights or not _CAPTURING()):
            return hit[1], hit[2]
        w, b = fold_bn(src[0], src[1], self._cf_bn, dtype)  # type: ignore[arg-type]
        if key is None or _CAPTURING():
            return w, b
        if hit is not None and hit[1].shape == w.shape and hit[1].device == w.device and hit[1].dtype == w.dtype:
            with torch.inference_mode(False), torch.no_grad():
                hit[1].copy_(w)
                hit[2].copy_(b)
            w, b = hit[1], hit[2]
        self._cf_cache[_FOLD] = (key, w, b)
        return w, b


def _activate(y: torch.Tensor, act: str, inplace: bool = False) -> torch.Tensor:
    """SiLU or HardSwish (``act``) of y as PyTorch's modules compute them (in place on a tensor this module
    made), or y itself."""
    if act == "silu":
        return torch.nn.functional.silu(y, inplace=inplace)
    if act == "hardswish":
        return torch.nn.functional.hardswish(y, inplace=inplace)
    return y


def _pre_folds(pre: PreActivation) -> bool:
    """Whether the pre-activation's batch norm may be folded on this call: its parameters need no
    gradient (or grad mode is off) and sit on the GPU in float32 (the caller checked the rest)."""
    bn = pre.bn
    for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var):
        if t is not None and (not t.is_cuda or t.dtype != _F32 or (t.requires_grad and torch.is_grad_enabled())):
            return False
    return True


def fold_affine(bn: torch.nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """An eval-mode batch norm as a per-channel (scale, shift): g / sqrt(var + eps) and
    beta - mean * scale, computed in float64 on its device and cast to float32 (contiguous,
    ordinary tensors even under inference_mode)."""
    assert bn.running_mean is not None and bn.running_var is not None
    with torch.inference_mode(False), torch.no_grad():
        scale = torch.rsqrt(bn.running_var.double() + bn.eps)
        if bn.weight is not None:
            scale = scale * bn.weight.double()
        shift = -bn.running_mean.double() * scale
        if bn.bias is not None:
            shift = shift + bn.bias.double()
        return scale.to(_F32).contiguous(), shift.to(_F32).contiguous()


def _sources(m: FusedConv2d) -> tuple[Any, ...]:
    """(conv weight, conv bias, bn weight, bn bias, running mean, running var), each as getattr
    answers it (the last four None without a batch norm): what a forward checks and folds, read
    once per call."""
    w, b = read_tensor(m, "_parameters", "weight"), read_tensor(m, "_parameters", "bias")
    bn = m._cf_bn
    if bn is None:
        return (w, b, None, None, None, None)
    return (w, b, read_tensor(bn, "_parameters", "weight"), read_tensor(bn, "_parameters", "bias"),
            read_tensor(bn, "_buffers", "running_mean"), read_tensor(bn, "_buffers", "running_var"))


def _fold_key(src: tuple[Any, ...], bn: torch.nn.BatchNorm2d | None) -> tuple[Any, ...] | None:
    """(data_ptr, _version) of every tensor the fold reads (``src``), and eps; None for inference
    tensors."""
    assert bn is not None
    try:
        return tuple(None if t is None else (t.data_ptr(), t._version) for t in src) + (bn.eps,)
    except RuntimeError:  # inference tensors have no version counter: fold per call
        return None


def fold_bn(w: torch.Tensor, b: torch.Tensor | None, bn: torch.nn.BatchNorm2d,
            dtype: torch.dtype = _F32) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode batch norm folded into a conv's filters and bias, computed in float64 on the
    weights' device and cast to ``dtype`` (contiguous, ordinary tensors even under inference_mode)."""
    assert bn.running_mean is not None and bn.running_var is not None
    with torch.inference_mode(False), torch.no_grad():
        scale = torch.rsqrt(bn.running_var.double() + bn.eps)
        if bn.weight is not None:
            scale = scale * bn.weight.double()
        shift = -bn.running_mean.double()
        if b is not None:
            shift = shift + b.double()
        shift = shift * scale
        if bn.bias is not None:
            shift = shift + bn.bias.double()
        wf = (w.double() * scale.view(-1, 1, 1, 1)).to(dtype).contiguous()
        return wf, shift.to(dtype).contiguous()


def _weight_bias(m: torch.nn.Module) -> tuple[Any, Any]:
    """The conv's weight and bias as its forward sees them: the registered parameters (a dictionary
    hit), else the plain attributes a reparametrisation sets before each forward (the hook-based
    weight norm: not in ``_parameters``)."""
    p = m._parameters
    w = p.get("weight")
    b = p.get("bias") if "bias" in p else getattr(m, "bias", None)
    return (m.weight if w is None else w), b
