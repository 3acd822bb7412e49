"""``compile_training_ahead(model, example)``: compile the backward kernels of a converted or fused
model's first training step on several threads before that step runs.

A training step compiles each layer's forward kernels as the forward reaches the layer and its dgrad
and wgrad kernels as the backward reaches them, one program after another on the caller's thread.
Here the model runs once on the example with PyTorch's convolutions in place of convforge's, batch
norms held in eval mode so that no running statistic moves (only the shapes matter), under the
caller's autocast; each convforge layer records its input's shape, compute dtype and layout. Then
every layer's dgrad (not of the model's own input, which needs none) and wgrad problem is chosen as
``convforge.grad`` chooses it (``dispatch.choose``, the NHWC plans first for channels-last
activations) and the programs are compiled on a pool of threads (``Backend.compile_ahead``); the
step then finds them built. A layer PyTorch runs (a half layer handed back) is skipped; a choice
or compile that fails is left for the step itself to report. The forward's kernels (the fused
blocks' statistics epilogues among them) still compile in the step.

``prepare_on_first_call`` (prepare.py) runs it on a fused or converted model's first forward in
training mode with gradients enabled on CUDA tensors, under ``config.train_ahead``
(``CONVFORGE_TRAIN_AHEAD``, on by default: on an H200 a fused ResNet-50's first BF16 AMP step with
every cache empty took 44 s with it and 87 s without; docs/BENCHMARKS.md, "First call").
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from convforge.torch.modules import Conv2d, compute_dtype, padding_quad

log = logging.getLogger("convforge")


@dataclass(frozen=True)
class LayerCall:
    """One convforge layer's input in the recorded forward: what its backward problems follow from."""

    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    stride: tuple[int, ...]
    pad: tuple[int, int, int, int]
    dilation: tuple[int, ...]
    groups: int
    dtype: torch.dtype
    channels_last: bool
    device: int
    needs_dgrad: bool
    algo: str
    precision: str | None
    max_error: float | None


def compile_training_ahead(model: torch.nn.Module, *example: Any, **example_kwargs: Any) -> int:
    """Compile the dgrad and wgrad programs ``model``'s training step on ``example`` will run (module
    docstring); how many programs were compiled here (not found in a cache). Nothing while
    ``config.autotune`` is on (tuning times candidates one at a time)."""
    from convforge.config import config

    if config.autotune:
        return 0
    calls = record_calls(model, example, example_kwargs)
    work_by_device: dict[int, list[Any]] = {}
    for call in dict.fromkeys(calls):
        for conv_pass in ("dgrad", "wgrad") if call.needs_dgrad else ("wgrad",):
            work = _pass_work(call, conv_pass)
            if work is not None:
                work_by_device.setdefault(call.device, []).append(work)
    from convforge.backends import get_backend

    name = type(model).__name__
    return sum(get_backend("cuda", dev).compile_ahead(work, f"{name}'s backward kernels")
               for dev, work in work_by_device.items())


def record_calls(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[LayerCall]:
    """The convforge layers' inputs when ``model`` runs on ``args`` / ``kwargs`` with PyTorch's
    convolutions (cudnn.benchmark off), no gradients and every training batch norm in eval mode (all
    restored after)."""
    from convforge.torch.prepare import _record

    inputs = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
    calls: list[LayerCall] = []
    held = _training_batch_norms(model)
    benchmark = torch.backends.cudnn.benchmark  # PyTorch's stand-in convolutions need no algorithm search
    try:
        torch.backends.cudnn.benchmark = False
        for bn in held:
            bn.training = False
        _record(model, args, kwargs, lambda m, rec: _visiting(m, rec, calls, inputs))  # its jobs: never run
    finally:
        for bn in held:
            bn.training = True
        torch.backends.cudnn.benchmark = benchmark
    return calls


def _visiting(m: Conv2d, inner: Any, calls: list[LayerCall], inputs: set[int]) -> Any:
    """``inner`` (the layer's recorded forward), noting the layer's input first."""
    def forward(x: torch.Tensor, *rest: Any) -> torch.Tensor:
        call = _layer_call(m, x, id(x) not in inputs)
        if call is not None:
            calls.append(call)
        return inner(x, *rest)  # type: ignore[no-any-return]

    return forward


def _layer_call(m: Conv2d, x: torch.Tensor, needs_dgrad: bool) -> LayerCall | None:
    """The layer's input as its training step would see it, or None where convforge does not run it."""
    w = m.weight
    dt = compute_dtype(x, w)
    if dt is None or not x.is_cuda or x.dim() != 4 or not w.is_cuda or m.padding_mode != "zeros":
        return None
    from convforge.torch.ops import channels_last

    return LayerCall(tuple(x.shape), tuple(w.shape), tuple(m.stride), padding_quad(m), tuple(m.dilation), m.groups,
                     dt, channels_last(x), x.device.index or 0, needs_dgrad, m.algo, m.precision, m.max_error)


def _pass_work(call: LayerCall, conv_pass: str) -> Any:
    """The program ``convforge.grad`` would build for ``call``'s ``conv_pass`` (its ``Work``), or None
    where PyTorch runs that pass or nothing applies."""
    from convforge import dispatch
    from convforge.backends import get_backend
    from convforge.backends.base import plan_work
    from convforge.frontends.checks import check_options
    from convforge.plan import Epilogue
    from convforge.spec import ConvSpec
    from convforge.torch.ops import _slow_call

    if call.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    if call.dtype != torch.float32 and _slow_call(conv_pass, call.x_shape, call.w_shape, call.stride, call.pad,
                                                  call.dilation, call.groups, call.dtype, call.channels_last,
                                                  call.device, call.algo, call.precision, call.max_error):
        return None
    try:
        spec = ConvSpec.from_shapes(call.x_shape, call.w_shape, call.stride, call.pad, call.dilation, call.groups,
                                    str(call.dtype).replace("torch.", ""), conv_pass)
        _, limit = check_options(False, None, call.precision, call.max_error)
    except ValueError:
        return None
    be = get_backend("cuda", call.device)
    layouts = ("nhwc", "nchw") if call.channels_last else ("nchw",)
    for layout in layouts:
        s = dataclasses.replace(spec, layout=layout)
        try:
            ch = dispatch.choose(s, be, Epilogue(), algo=call.algo, precision=call.precision,
                                 max_error=call.max_error, workspace_limit=limit)
            return plan_work(ch.variant.plan_for(s, ch.params, be.device, Epilogue()), be.name)
        except ValueError as err:
            log.debug("convforge: no %s program to compile ahead for %s (%s)", conv_pass, s.short(), err)
    return None


def _training_batch_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every batch norm in training mode that ``model`` runs (its own, or one a fused layer references)."""
    bn_type = torch.nn.modules.batchnorm._BatchNorm
    found: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        pre = getattr(m, "_cf_pre", None)
        for bn in (m, getattr(m, "_cf_bn", None), getattr(m, "bn", None), getattr(pre, "bn", None)):
            if isinstance(bn, bn_type) and bn.training:
                found[id(bn)] = bn
    return list(found.values())
