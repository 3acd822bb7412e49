"""A block's float32 master filters cast to the half copy its conv reads, and the gradient back, in one launch
each (kernels/wcast.py), filed with native.cpp (``attach_wcast``).

Under autocast native.cpp's ``BlockNode`` runs its conv in FP16 / BF16 from the module's float32 weight. Through
``Tensor.to`` each cast is a dispatcher call, an allocation and a copy op (and, for channels-last 3x3 filters,
a second copy by AccumulateGrad into the parameter's layout), about 15 us of host time a step each way on an
H200 host: ResNet-50's 53 blocks spend a millisecond of a host-bound step on them. The first training call that
files a block (``FusedConv2d._file_block``) attaches the casts of its weight's shape, dtype and memory order to
its handle; BlockNode uses them where a call's master matches, ``Tensor.to`` where it does not.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from convforge.backends import get_backend
from convforge.kernels.wcast import SLOTS, WCast, dims, title, wcast_program

log = logging.getLogger("convforge")

_ATTACHED: dict[int, WCast] = {}  # handle -> the casts attached to it last (a filing attaches its own)
_DIMS: dict[tuple[int, WCast], torch.Tensor] = {}  # (device, casts) -> the kernels' sizes on the device, kept for good


def casts_of(w: torch.Tensor, dt: torch.dtype) -> WCast | None:
    """The casts between ``w`` (a float32 master, KCRS or channels-last) and the conv's ``dt`` halves, or None
    for other weights."""
    if w.dtype != torch.float32 or dt not in (torch.float16, torch.bfloat16) or w.dim() != 4 or not w.is_cuda:
        return None
    cl = not w.is_contiguous() and w.is_contiguous(memory_format=torch.channels_last)
    if not (cl or w.is_contiguous()):
        return None
    k, c, r, s = w.shape
    return WCast(k, c, r, s, "float16" if dt == torch.float16 else "bfloat16", cl)


def program_work(wc: WCast) -> Any:
    """The ``Work`` of the program :func:`attach` builds for ``wc`` (the same source): what
    torch/train_ahead.py compiles ahead, so the first step finds it built."""
    from convforge.backends.base import Work
    from convforge.codegen.render import render

    prog = wcast_program(wc)
    return Work(render(list(prog.kernels), "cuda", title(wc)), tuple(prog.kernels))


def attach(module: Any, handle: int, w: torch.Tensor, dt: torch.dtype) -> None:
    """Attach to ``handle`` the casts between ``w`` and the conv's ``dt`` halves (:func:`casts_of`); nothing
    for other weights. Any failure only costs the speed-up (logged)."""
    wc = casts_of(w, dt)
    if wc is None:
        return
    k, c, r, s = w.shape
    if _ATTACHED.get(handle) == wc:
        return
    _ATTACHED[handle] = wc
    try:
        from convforge.backends.cuda import RawLaunches

        prog = wcast_program(wc)
        run = RawLaunches(get_backend("cuda", w.device.index or 0), prog.kernels,  # type: ignore[arg-type]
                          {"forward": prog.forward, "backward": prog.backward}, title(wc))
        device = w.device.index or 0
        sizes = _DIMS.get((device, wc))
        if sizes is None:
            sizes = _DIMS[(device, wc)] = torch.from_numpy(dims(wc)).to(w.device)
        module.attach_wcast(handle, run.native_program(SLOTS, "forward", "backward"), [k, c, r, s], wc.dtype,
                            wc.permutes, sizes.data_ptr())
    except (ValueError, RuntimeError) as err:
        log.info("convforge: the filters of %s are cast by Tensor.to (%s)", tuple(w.shape), err)
