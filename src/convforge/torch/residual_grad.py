"""A block's input gradient and a later block's residual gradient of the same tensor in one dgrad.

In a bottleneck, x feeds the first block's conv (A: conv -> batch norm -> ReLU) and comes back as the last
block's residual (C: conv -> batch norm -> + x -> ReLU), so x's gradient is A's dgrad plus C's residual
gradient, which autograd adds in a pass of its own (three activation-sized memory passes a bottleneck; 0.69 ms
of ResNet-50 N128's AMP step). With ``config.residual_grad`` (``CONVFORGE_RESIDUAL_GRAD``, on by default) the first
training call that files C (``FusedConv2d._file_block``) finds A by C's residual, plans A's dgrad with the
residual in its epilogue (:meth:`FusedConv2d.res_dgrad_plan`: the transposed forward GEMM, which stores one)
and attaches it to A's C++ block program (native.cpp ``attach_res_dgrad``). At run time native.cpp pairs the two calls
(``PairToken``): C leaves its residual gradient for A's dgrad, which adds it before its one rounding. A
bottleneck with a downsample pairs the same way: its downsample block (D: conv -> batch norm) reads x too, and
leaves its input gradient for A's dgrad (the add autograd ran at each stage's first bottleneck).

Where it pays: the dgrad loads its tile's residual into registers before its main loop (``rs=1``,
``TcImplicitGemm.epilogue_params``), and only such dgrads pair (16-bit layers; elsewhere the add stays
autograd's). Measured on the H200 (docs/NOTES-training.md, twenty-fourth session): ResNet-50 N128's AMP step
17.09 -> 16.65 ms of GPU time (the adds' 0.69 ms gone, the twelve dgrads 0.42 ms more).

Only handles filed per conv take one (blocks whose conv writes its batch norm's statistics: their handle's
key holds the conv), so one attached dgrad fits every call of its handle. The Python nodes (a block's first,
filing call) never pair: they add as autograd does.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from convforge.backends import get_backend
from convforge.config import config

log = logging.getLogger("convforge")

# id(x) -> (x, the block whose input it is, that block's handle, the conv's dtype), while x lives: the
# inputs of blocks filed in this forward, which a later block's residual may be
_INPUTS: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any], int, torch.dtype]] = {}
_TRIED: set[int] = set()  # handles a residual-adding dgrad was planned for (attached or not): once each


def note_block(module: Any, block: Any, x: torch.Tensor, res: Any, handle: int, dt: torch.dtype,
               per_conv: bool) -> None:
    """A training block just filed with native.cpp under ``handle``: where its input ``x`` (as its conv
    reads it: ``dt``, no cast) or its residual ``res`` is an earlier block's input, give that block's handle
    the dgrad that adds this block's gradient of it (:func:`_attach`); else remember x where the handle is
    filed per conv (``per_conv``)."""
    if not config.residual_grad:
        return
    for k in [k for k, v in _INPUTS.items() if v[0]() is None]:
        del _INPUTS[k]
    first = _INPUTS.get(id(x)) if x.dtype == dt else None
    if first is not None and first[0]() is x and first[1]() is not block:
        _pair(module, first, x)  # D: x feeds an earlier block too (a downsample beside a bottleneck's first conv)
    elif per_conv and x.dtype == dt:
        _INPUTS[id(x)] = (weakref.ref(x), weakref.ref(block), handle, dt)
    hit = _INPUTS.get(id(res)) if isinstance(res, torch.Tensor) else None
    if hit is not None and hit[0]() is res:
        _pair(module, hit, res)  # C: res is an earlier block's input


def _pair(module: Any, first: tuple[Any, ...], x: torch.Tensor) -> None:
    """Attach to ``first``'s handle (an ``_INPUTS`` entry) the dgrad adding a gradient of its input ``x``,
    once a handle."""
    if first[2] not in _TRIED:
        _TRIED.add(first[2])
        _attach(module, first[1](), first[2], x, first[3])


def _attach(module: Any, first: Any, handle: int, x: torch.Tensor, dt: torch.dtype) -> None:
    """Compile ``first``'s dgrad adding a residual shaped as its input ``x`` and attach it to ``handle``;
    any failure only costs the speed-up (logged)."""
    if first is None:
        return
    w = first.weight
    try:
        plan = first.res_dgrad_plan(tuple(x.shape), tuple(w.shape), dt, x.device.index or 0)
        if plan is None:
            return
        exe: Any = get_backend("cuda", x.device.index or 0).executable(plan)  # a CUDA one: native_program
        exe.reserve()
        module.attach_res_dgrad(handle, exe.native_program(), list(x.shape))
    except (ValueError, RuntimeError) as err:
        log.info("convforge: the residual gradient of %s is added by autograd (%s)", tuple(x.shape), err)
