"""What convforge's commands need from ``torch.distributed`` when ``torchrun`` starts them
(``convforge tune`` under torchrun: convforge.tune.parallel): the rank's GPU made current, and the
ranks' results gathered at rank 0.

The gather uses a gloo process group (CPU objects only: no GPU memory, works across hosts with the
``MASTER_ADDR`` / ``MASTER_PORT`` torchrun sets), made here when none exists and destroyed after,
with a long timeout: ranks finish their shares at different times, and the first waits for the last.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

GATHER_TIMEOUT = datetime.timedelta(hours=24)


def set_device(local_rank: int) -> None:
    """``torch.cuda.set_device(local_rank)`` where torch sees CUDA."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)


def gather_to_zero(payload: Any) -> list[Any] | None:
    """Every rank's ``payload`` (picklable), in rank order, at rank 0; None on the other ranks."""
    if not dist.is_available():
        raise ImportError("this torch build has no torch.distributed")
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", timeout=GATHER_TIMEOUT)
    try:
        rank = dist.get_rank()
        out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(payload, out, dst=0)
        return out
    finally:
        if made:
            dist.destroy_process_group()
