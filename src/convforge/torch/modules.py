"""``Conv2d``: a drop-in ``torch.nn.Conv2d`` that runs convforge's kernels, and ``convert``.

Paths of one forward call, cheapest first:
- eager inference of a warm layer where the native fast path is built: C++ (native.cpp: key,
  lookup, output, launches; filters cached per weight version as below), except while a CUDA
  graph is captured with ``static_weights`` (that capture must replay filters made before it);
- eager inference (no grad needed, not compiling): the prepared runner is called directly, with
  the filter-derived workspace (Winograd U, packed GEMM weights, constant tables) built once per
  weight version (``weight._version``, address and tensor: backends/base.py ``FilterCache``), so
  no filter transform runs per call;
- training or torch.compile: the ``convforge::conv2d`` op (autograd formula, fake impl);
- half precision: layers of a ``.half()`` / ``.bfloat16()`` model run in their dtype, and inside a
  CUDA ``torch.autocast`` region (float16 or bfloat16) a float32 layer runs in the autocast dtype
  as PyTorch's would (input, filters and bias cast to it; the cast filters cached per weight
  version in inference), through the same paths (the C++ fast path takes every dtype and both
  layouts); a half layer no convforge variant serves (grouped ones
  whose families take float32 only) falls back to PyTorch through the op, logged once;
- F.conv2d's contract: an unbatched (C, H, W) input runs as a batch of one; padding 'same' /
  'valid' as PyTorch pads; ``padding_mode`` reflect / replicate / circular by a padded copy made
  on the device first (F.pad, differentiable; no variant folds those modes into its loads yet),
  then the conv unpadded on it;
- what convforge does not run (CPU tensors, dtypes other than float32, float16 and bfloat16,
  mixed dtypes): PyTorch's own forward. Grouped and depthwise
  layers run convforge's (the depthwise family, grouped direct and GEMM kernels); an input in
  channels_last memory format is read in place by NHWC plans (the tensor-core GEMMs of every pass,
  depthwise_nhwc) and answered in channels_last; where no NHWC plan serves a layer it is made NCHW
  contiguous first (a copy).

A CUDA graph captured from eager inference replays the filters transformed before capture (the
transform is not in the graph; it is re-run into the same buffer by the next eager call after an
in-place weight update, which the graph then sees): after changing weights in place, run one eager
forward (or capture again) before replaying. Graphs captured with grad enabled (training), and
layers first used under capture, contain the whole plan and see every weight update.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from convforge import dispatch
from convforge.backends import get_backend
from convforge.config import config, parse_precision
from convforge.frontends import fast_path
from convforge.frontends.kinds import is_channels_last, pad_copy
from convforge.plan import Epilogue
from convforge.spec import ConvSpec, conv_args, conv_padding
from convforge.torch.ops import HANDED_BACK, handed_back
from convforge.torch.ops import OP as _OP  # the overload itself: no packet resolution per call
from convforge.torch.transposed import conv_transpose2d

log = logging.getLogger("convforge")
OPTIONS = ("algo", "precision", "max_error", "static_weights")
_F32 = torch.float32
_HALF = (torch.float16, torch.bfloat16)
_HANDED = ("handed back",)  # _cf_cache's mark: a layer of this module went to PyTorch (ops.handed_back)
_CAPTURING = torch.cuda.is_current_stream_capturing


def _autocast_probe() -> Any:
    """``() -> bool``: whether a CUDA autocast region is active (torch >= 2.4 spells the device)."""
    try:
        torch.is_autocast_enabled("cuda")
    except TypeError:  # older torch: the argument-less form answers for CUDA
        return torch.is_autocast_enabled
    return lambda: torch.is_autocast_enabled("cuda")


_AUTOCAST = _autocast_probe()


def autocast_dtype() -> torch.dtype:
    """The dtype of the active CUDA autocast region."""
    get = getattr(torch, "get_autocast_dtype", None)
    return get("cuda") if get is not None else torch.get_autocast_gpu_dtype()


def compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype | None:
    """The dtype convforge runs a conv of ``x`` and ``w`` in, or None (PyTorch's forward runs it):
    inside a CUDA autocast region of float16 or bfloat16 that dtype (as autocast casts
    convolutions); otherwise x's dtype when w has it too (float32, float16, bfloat16)."""
    if _AUTOCAST():
        dt = autocast_dtype()
        return dt if dt in _HALF else None
    return x.dtype if x.dtype == w.dtype and (x.dtype == _F32 or x.dtype in _HALF) else None


def static_reason(m: torch.nn.Conv2d | torch.nn.ConvTranspose2d, on_cuda: bool = True) -> str | None:
    """Why convforge cannot run this layer whatever its input, or None (``on_cuda``: parameters
    off the GPU count as a reason)."""
    if m.weight.dtype != torch.float32 and m.weight.dtype not in _HALF:
        return f"dtype {str(m.weight.dtype).replace('torch.', '')} (convforge runs float32, float16 and bfloat16)"
    if on_cuda and m.weight.device.type != "cuda":
        return f"parameters on {m.weight.device} (convforge runs CUDA tensors: convert after model.cuda())"
    return None


_MISSING = object()


def read_tensor(m: torch.nn.Module, table: str, name: str) -> Any:
    """``getattr(m, name)`` for a parameter (``table`` "_parameters") or buffer ("_buffers"), read
    from the module's own table: nn.Module.__getattr__, which getattr takes for them, costs ~1 us a
    read in Python. A name not in the table (parametrized, or set as a plain attribute) takes getattr."""
    t = m.__dict__[table].get(name, _MISSING)
    return getattr(m, name) if t is _MISSING else t


def padding_quad(m: torch.nn.Conv2d) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of an nn.Conv2d: ints, 'valid', or 'same' (the extra row or
    column at the bottom/right, as PyTorch pads: ``spec.conv_padding``)."""
    return conv_padding(m.padding, m.kernel_size, m.stride, m.dilation)


def kernel_operand(cache: dict[tuple[Any, ...], Any], t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Parameter ``t`` as ``dt`` and, for 4-D filters, KCRS-contiguous (as the kernels read them: a
    channels_last model's filters are not): itself when it already is; a differentiable copy when a
    gradient is needed; else a copy kept in ``cache`` per tensor, address, version and dtype, so a
    channels_last or half-cast model's filters are copied (and their transforms filed) once, not at
    every call (inference tensors and CUDA-graph captures, which record the copy: one per call)."""
    kcrs = t.dim() != 4 or t.is_contiguous()
    if t.dtype == dt and kcrs:
        return t
    fmt = {"memory_format": torch.contiguous_format} if t.dim() == 4 else {}
    if (torch.is_grad_enabled() and t.requires_grad) or torch.compiler.is_compiling():
        return t.to(dt, **fmt)
    key = ("cast", t.data_ptr(), dt)
    try:
        version = t._version
    except RuntimeError:  # an inference tensor has no version counter
        return t.to(dt, **fmt)
    hit = cache.get(key)
    if hit is not None and hit[0] == version and hit[1]() is t and not _CAPTURING():
        return hit[2]  # type: ignore[no-any-return]
    with torch.inference_mode(False), torch.no_grad():  # a normal tensor: an inference tensor has no version
        cast = t.to(dt, **fmt)  # counter, so the filter caches behind it would miss at every call
    if not _CAPTURING():
        cache[key] = (version, weakref.ref(t), cast)
    return cast


class Conv2d(torch.nn.Conv2d):
    """``torch.nn.Conv2d`` with the same constructor, parameters and state_dict, plus the keyword
    options ``algo`` ('auto', a family or a variant), ``precision`` ('fp32' | 'relaxed'),
    ``max_error`` and ``static_weights``; forward runs convforge where it can (module docstring).

    ``static_weights`` (CUDA graphs captured in eager inference, e.g. ``torch.cuda.graph`` around
    ``model(x)`` under no_grad): True (default) keeps the filter transforms out of the graph: a
    replay launches only the remaining steps of each layer, with the filters transformed before
    capture (after an in-place weight update run one eager forward, which re-transforms into the
    same buffers, before replaying). False records each layer's whole plan, transform included,
    so replays see in-place weight updates at the cost of the extra launches per layer. Training
    and torch.compile captures always record the whole plan."""

    def __init__(self, *args: Any, algo: str = "auto", precision: str | None = None,
                 max_error: float | None = None, static_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cf_setup(algo, precision, max_error, static_weights)

    def _cf_setup(self, algo: str, precision: str | None, max_error: float | None, static_weights: bool) -> None:
        if precision is not None:
            parse_precision(precision)
        if max_error is not None and not max_error > 0:
            raise ValueError(f"max_error ({max_error!r}) must be > 0")
        if not isinstance(static_weights, bool):
            raise ValueError(f"static_weights ({static_weights!r}) must be True or False")
        self.algo, self.precision, self.max_error = algo, precision, max_error
        self.static_weights = static_weights
        self._cf_cache: dict[tuple[Any, ...], Any] = {}

    @classmethod
    def from_module(cls, m: torch.nn.Conv2d, algo: str = "auto", precision: str | None = None,
                    max_error: float | None = None, static_weights: bool = True) -> Conv2d:
        """A convforge Conv2d sharing ``m``'s parameters, buffers and hooks (no copy: optimizers
        that hold the parameters keep working)."""
        new = cls.__new__(cls)
        new.__dict__.update(m.__dict__)
        new._cf_setup(algo, precision, max_error, static_weights)
        return new

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_cf_cache"] = {}  # device runners and transformed filters are rebuilt on use
        return state

    def extra_repr(self) -> str:
        extra = f", algo={self.algo!r}" + (f", precision={self.precision!r}" if self.precision else "")
        return super().extra_repr() + extra + (f", max_error={self.max_error:g}" if self.max_error else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = read_tensor(self, "_parameters", "weight"), read_tensor(self, "_parameters", "bias")
        if (not x.is_cuda or x.dtype != _F32 or x.dim() != 4 or not w.is_cuda or w.dtype != _F32
                or self.padding_mode != "zeros" or _AUTOCAST()):  # static_reason's tests, inline
            return self._other_forward(x, w, b)
        return self._forward(x, w if w.is_contiguous() else self._cast(w, _F32), b)  # channels_last: KCRS once

    def _other_forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """Half precision (a half layer, or an autocast region: input, filters and bias cast to its
        dtype), unbatched inputs (a batch of one) and padding modes (a padded copy first) through
        :meth:`_forward`; anything else through PyTorch's forward."""
        if x.dim() == 3 and x.is_cuda:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        dt = compute_dtype(x, w)
        if (dt is None or not x.is_cuda or x.dim() != 4 or not w.is_cuda
                or (b is not None and b.dtype != w.dtype)):
            return super().forward(x)
        if x.dtype != dt:
            x = x.to(dt)
        pad = None
        if self.padding_mode != "zeros":
            args = conv_args(tuple(x.shape), tuple(w.shape), self.stride, self.padding, self.dilation,
                             self.padding_mode)
            x, pad = pad_copy(x, args.copy_pad or (0, 0, 0, 0), args.mode, "torch"), args.pad
        return self._forward(x, self._cast(w, dt), None if b is None else self._cast(b, dt), pad)

    def _cast(self, t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """``t`` (a parameter) as ``dt`` and, for filters, KCRS (:func:`kernel_operand`)."""
        return kernel_operand(self._cf_cache, t, dt)

    def _forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 pad: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """The conv on CUDA tensors of one dtype (float32, float16 or bfloat16) through convforge;
        ``pad``: the zero padding (None: the layer's; a padding mode's copy carries its own)."""
        if pad is None:
            pad = padding_quad(self)
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
                x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))):
            return _OP(x, w, b, list(self.stride), list(pad), list(self.dilation), self.algo, self.precision,
                       self.max_error, self.groups)
        native = fast_path.RUN  # a warm layer: C++ (native.cpp), as the op's CUDA kernel runs it
        call = (x, w, b, self.stride, pad, self.dilation, self.algo, None, None, False, None, self.precision,
                self.max_error, self.groups)  # the op's spelling of this layer's conv2d call: one entry for both
        if native is not None and not (self.static_weights and _CAPTURING()):  # captures: the whole plan
            y = native(*call)
            if y is not None:
                return y
        run = self._prepared(x, pad, "nhwc") if reads_nhwc(self, x) else None
        if run is None and not (self._cf_cache.get(_HANDED) and is_channels_last(x)):
            x = x.contiguous()
            run = self._prepared(x, pad)
        if not w.is_contiguous():
            w = w.contiguous()
        if run is None:  # PyTorch's convolution through the op (a channels_last input handed back stays so)
            return _OP(x, w, b, list(self.stride), list(pad), list(self.dilation), self.algo, self.precision,
                       self.max_error, self.groups)
        filters = run.filters
        if filters is None or (not self.static_weights and _CAPTURING()):
            y = run(x, w, b)  # no filter steps, or a capture that records the whole plan
        else:
            packed = filters.get(w, w.data_ptr())
            y = run(x, w, b) if packed is None else run(x, w, b, packed)
        if native is not None and not _CAPTURING():  # plans without filter steps too (depthwise, NHWC GEMMs)
            fast_path.file_native(run, (x, *call[1:]))
        return y

    def set_max_error(self, value: float | None) -> None:
        """Change the error bound the layer's variant is chosen under (None: the precision class's)
        and drop the cached runners and folded weights, so the next call chooses again (they are
        keyed by the configuration, not by the bound, which is otherwise fixed at construction).
        A CUDA graph captured before keeps replaying the old plans: capture again afterwards."""
        if value is not None and not value > 0:
            raise ValueError(f"max_error ({value!r}) must be > 0")
        self.max_error = value
        self._cf_cache.clear()

    def cf_choice(self, x_shape: tuple[int, ...], device: int,
                  max_error: float | None) -> tuple[ConvSpec, dispatch.Choice] | None:
        """(spec, what ``dispatch.choose`` answers) for this layer on an input of ``x_shape`` under
        ``max_error`` (the module's own algo and precision), or None when no convforge variant
        runs it (PyTorch then does). ``calibrate`` compares two bounds with it."""
        try:
            spec = ConvSpec.from_shapes(tuple(x_shape), tuple(self.weight.shape), tuple(self.stride),
                                        padding_quad(self), tuple(self.dilation), self.groups, dtype=self.weight.dtype)
            return spec, dispatch.choose(spec, get_backend("cuda", device), Epilogue(self.bias is not None),
                                         algo=self.algo, precision=self.precision, max_error=max_error)
        except ValueError:
            return None

    def _prepared(self, x: torch.Tensor, pad: tuple[int, int, int, int], layout: str = "nchw") -> Any:
        """The runner for this input signature (its ``filters`` cache the filter-derived
        workspace per weight version), or None when no convforge variant runs the layer (the op
        then falls back to PyTorch and logs it). ``layout``: "nhwc" for a channels_last input
        of a depthwise layer (``reads_nhwc``), read as it lies."""
        key = (x.shape, x.dtype, x.device, layout, config.precision, config.max_error, config.autotune,
               config.db_path)
        try:
            return self._cf_cache[key]
        except KeyError:
            run = self._cf_cache[key] = self._runner(x, pad, layout)
            return run

    def _runner(self, x: torch.Tensor, pad: tuple[int, int, int, int], layout: str = "nchw") -> Any:
        try:
            spec = ConvSpec.from_shapes(tuple(x.shape), tuple(self.weight.shape), tuple(self.stride), pad,
                                        tuple(self.dilation), self.groups, dtype=x.dtype, layout=layout)
            dev = x.device.index or 0
            if handed_back(spec, dev, self.algo, self.precision, self.max_error):
                self._cf_cache[_HANDED] = True
                return None  # the op runs PyTorch's convolution (logged once)
            return dispatch.runner(None, spec, get_backend("cuda", dev), Epilogue(self.bias is not None), "torch",
                                   dev, algo=self.algo, precision=self.precision, max_error=self.max_error)
        except ValueError:
            return None


def reads_nhwc(conv: torch.nn.Conv2d, x: torch.Tensor) -> bool:
    """Whether the layer gets a channels_last input, which NHWC plans read in place (no copy into
    NCHW, and a channels_last output for the next layer); a layer no NHWC plan serves gets no runner
    for it and the caller copies into NCHW."""
    return is_channels_last(x)


class ConvTranspose2d(torch.nn.ConvTranspose2d):
    """``torch.nn.ConvTranspose2d`` with the same constructor, parameters and state_dict, plus the keyword
    options ``algo``, ``precision`` and ``max_error``: forward runs ``convforge.torch.conv_transpose2d``
    (the dgrad of the forward layer whose input is this layer's output, on convforge's dgrad kernels;
    its gradients through convforge's forward and wgrad ops) for CUDA tensors of float32, float16 or
    bfloat16 (and in a CUDA autocast region, cast to its dtype as PyTorch's would be); anything else
    (CPU tensors, other dtypes) runs PyTorch's forward. ``output_size`` as PyTorch's."""

    def __init__(self, *args: Any, algo: str = "auto", precision: str | None = None,
                 max_error: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cf_setup(algo, precision, max_error)

    def _cf_setup(self, algo: str, precision: str | None, max_error: float | None) -> None:
        if precision is not None:
            parse_precision(precision)
        if max_error is not None and not max_error > 0:
            raise ValueError(f"max_error ({max_error!r}) must be > 0")
        self.algo, self.precision, self.max_error = algo, precision, max_error
        self._cf_cache: dict[tuple[Any, ...], Any] = {}  # filters as the kernels read them (kernel_operand)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_cf_cache"] = {}
        return state

    @classmethod
    def from_module(cls, m: torch.nn.ConvTranspose2d, algo: str = "auto", precision: str | None = None,
                    max_error: float | None = None) -> ConvTranspose2d:
        """A convforge ConvTranspose2d sharing ``m``'s parameters, buffers and hooks (no copy)."""
        new = cls.__new__(cls)
        new.__dict__.update(m.__dict__)
        new._cf_setup(algo, precision, max_error)
        return new

    def extra_repr(self) -> str:
        extra = f", algo={self.algo!r}" + (f", precision={self.precision!r}" if self.precision else "")
        return super().extra_repr() + extra + (f", max_error={self.max_error:g}" if self.max_error else "")

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        w, b = read_tensor(self, "_parameters", "weight"), read_tensor(self, "_parameters", "bias")
        dt = compute_dtype(x, w)
        if (dt is None or not x.is_cuda or not w.is_cuda or x.dim() not in (3, 4) or self.padding_mode != "zeros"
                or (b is not None and b.dtype != w.dtype)):
            return super().forward(x, output_size)
        op = self._output_padding(x, output_size, list(self.stride), list(self.padding),  # type: ignore[arg-type]
                                  list(self.kernel_size), 2, list(self.dilation))
        if x.dtype != dt:
            x = x.to(dt)
        w, b = kernel_operand(self._cf_cache, w, dt), None if b is None else kernel_operand(self._cf_cache, b, dt)
        return conv_transpose2d(x, w, b, self.stride, self.padding, op, self.groups, self.dilation,  # type: ignore[arg-type]
                                self.algo, self.precision, self.max_error)


@dataclass
class ConvertReport:
    """What ``convert`` (or ``fuse``) swapped and what it left to PyTorch, with the reason.

    ``converted``: convs convforge runs; ``left``: convs PyTorch runs, and why; ``fused`` (``fuse``
    only): conv -> what its module also applies ("bn+add+relu"); ``unfused`` (``fuse`` only): why
    the operations after a conv, or the whole model ("" key), stay separate PyTorch operations;
    ``linears`` (``fuse`` only): linear layers over channels-last activations that convforge runs
    (torch/linear.py) -> what they fold ("gelu", "permute+scale+add"); ``pools`` (``fuse`` only): max
    pools convforge runs (torch/pool.py); ``excitations`` (``fuse`` only): squeeze-and-excitation modules
    convforge runs as one node (torch/se.py), by their first conv's path -> "se(activation, gate)";
    ``norms`` (``fuse`` only): functional layer norms over the last dimension (torchvision's ``LayerNorm2d``)
    on convforge's kernel (torch/layernorm.py), by their weight's path (``nn.LayerNorm`` modules in front of a
    linear layer fold into it: ``linears``' "norm+gelu")."""

    converted: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)
    fused: dict[str, str] = field(default_factory=dict)
    unfused: dict[str, str] = field(default_factory=dict)
    linears: dict[str, str] = field(default_factory=dict)
    pools: list[str] = field(default_factory=list)
    excitations: dict[str, str] = field(default_factory=dict)
    norms: list[str] = field(default_factory=list)

    @property
    def handed_back(self) -> dict[str, str]:
        """Layers (pass and shape) handed to PyTorch at run time so far in this process, and why: a
        half-precision layer no fast convforge variant serves (``torch/ops.py`` ``handed_back``)."""
        return dict(HANDED_BACK)

    def __str__(self) -> str:
        lines = [f"convforge: {len(self.converted)} conv layer(s) converted, {len(self.left)} left to PyTorch"
                 + (f", {len(self.fused)} fused with what follows them" if self.fused else "")
                 + (f"; {len(self.linears)} linear layer(s) fused" if self.linears else "")
                 + (f"; {len(self.pools)} max pool(s) on convforge's kernels" if self.pools else "")
                 + (f"; {len(self.excitations)} squeeze-and-excitation(s) as one node each"
                    if self.excitations else "")
                 + (f"; {len(self.norms)} layer norm(s) on convforge's kernel" if self.norms else "")]
        lines += [f"  {name or '<model>'}: {why}" for name, why in self.left.items()]
        lines += [f"  {name or '<model>'}: not fused: {why}" for name, why in self.unfused.items()]
        lines += [f"  handed to PyTorch at run time: {layer}: {why}" for layer, why in self.handed_back.items()]
        return "\n".join(lines)


def swapped(m: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """The convforge module for an ``nn.Conv2d`` or ``nn.ConvTranspose2d``, sharing its parameters."""
    if isinstance(m, torch.nn.ConvTranspose2d):
        return ConvTranspose2d.from_module(m, **{k: v for k, v in options.items() if k != "static_weights"})
    return Conv2d.from_module(m, **options)  # type: ignore[arg-type]


def convert(model: torch.nn.Module, **options: Any) -> ConvertReport:
    """Swap every eligible ``nn.Conv2d`` and ``nn.ConvTranspose2d`` in ``model`` (in place) for a convforge
    ``Conv2d`` / ``ConvTranspose2d`` that shares its parameters. ``options``: ``algo``, ``precision``
    (default ``config.precision``), ``max_error``, ``static_weights`` (Conv2d only; default True: CUDA
    graphs captured in eager inference leave the filter transforms out; False: they record them and
    see in-place weight updates; see ``Conv2d``);
    each layer's variant is chosen through dispatch (the tuning database first) on its first call."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"convert() got unknown option(s) {unknown}; allowed: {', '.join(OPTIONS)}")
    report = ConvertReport()
    for name, m in list(model.named_modules()):
        if not isinstance(m, torch.nn.Conv2d | torch.nn.ConvTranspose2d) or isinstance(m, Conv2d | ConvTranspose2d):
            continue
        base = torch.nn.Conv2d if isinstance(m, torch.nn.Conv2d) else torch.nn.ConvTranspose2d
        if type(m) is not base:
            report.left[name] = f"a subclass of nn.{base.__name__} ({type(m).__name__}) whose forward may differ"
            continue
        why = static_reason(m)
        if why is not None:
            report.left[name] = why
            continue
        new = swapped(m, **options)
        if name:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, new)
        report.converted.append(name)
    if "" in report.converted:
        raise TypeError("convert() swaps layers inside a model; wrap a lone nn.Conv2d with Conv2d.from_module")
    return report
