"""What convforge's commands need from ``torch.distributed`` when ``torchrun`` starts them
(``convforge tune`` under torchrun: convforge.apps.tune.parallel): the rank's GPU made current, layers
handed out one at a time from a counter every rank shares, and the ranks' results gathered at rank 0.

:class:`RankGroup` is a gloo process group (CPU objects only: no GPU memory, works across hosts
with the ``MASTER_ADDR`` / ``MASTER_PORT`` torchrun sets, single- or multi-node rendezvous alike),
made on entry when none exists and destroyed on exit, with a long timeout: ranks finish their work
at different times, and the first waits for the last. Its counter lives in the process group's
key-value store (the rendezvous store torchrun's ranks already share): ``store.add`` is atomic, so
each call answers a number no other rank gets, with no scheduler process of ours.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

GATHER_TIMEOUT = datetime.timedelta(hours=24)


def set_device(local_rank: int) -> None:
    """``torch.cuda.set_device(local_rank)`` where torch sees CUDA."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)


class RankGroup:
    """``with RankGroup() as g``: this torchrun rank in a process group (module docstring)."""

    def __init__(self) -> None:
        if not dist.is_available():
            raise ImportError("this torch build has no torch.distributed")
        self.made = False

    def __enter__(self) -> RankGroup:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=GATHER_TIMEOUT)
            self.made = True
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.made:
            dist.destroy_process_group()
            self.made = False

    @property
    def rank(self) -> int:
        return int(dist.get_rank())

    @property
    def world(self) -> int:
        return int(dist.get_world_size())

    def counter(self, name: str) -> Callable[[], int]:
        """``next()`` of a counter shared by every rank: 0, 1, 2, ... across all of them, each
        number answered once (``name`` keys it; ranks that pass different names count apart)."""
        store = dist.distributed_c10d._get_default_store()
        key = f"convforge/{name}"
        return lambda: int(store.add(key, 1)) - 1

    def gather(self, payload: Any) -> list[Any] | None:
        """Every rank's ``payload`` (picklable), in rank order, at rank 0; None on the other ranks."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(payload, out, dst=0)
        return out


def gather_to_zero(payload: Any) -> list[Any] | None:
    """Every rank's ``payload`` (picklable), in rank order, at rank 0; None on the other ranks."""
    with RankGroup() as group:
        return group.gather(payload)
