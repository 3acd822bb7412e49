"""Timing rules shared by convforge and the baselines (docs/MEASURING.md): warm-up outside the timed
region, device events, median of repeats, rotation among input sets for layers that fit in L2."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from convforge.spec import ConvSpec

if TYPE_CHECKING:  # the bench's options are listed without NumPy (cli._add_optional)
    from convforge.plan import DeviceInfo

T = TypeVar("T")

L2_GUESS = 50 << 20  # a GPU's L2 when the back-end cannot say (H100/H200: 50-60 MB)
MAX_SETS = 8
CHECK_FLOPS = 2e9  # above this, correctness is checked on a slice of the batch


@dataclass(frozen=True)
class Timing:
    """How one implementation is timed: warm-up calls, timed repeats, input sets to rotate."""

    warmup: int = 3
    repeats: int = 25
    sets: int = 1

    @classmethod
    def for_layer(cls, spec: ConvSpec, device: DeviceInfo, warmup: int | None = None,
                  repeats: int | None = None) -> Timing:
        """Defaults per device kind (CPU devices: 1 warm-up, 3 repeats) and the rotation count."""
        gpu = device.is_gpu
        w = warmup if warmup is not None else (3 if gpu else 1)
        r = repeats if repeats is not None else (25 if gpu else 3)
        return cls(w, r, rotation_sets(spec, device))


def layer_bytes(spec: ConvSpec) -> int:
    """Bytes of input, filters (K x C/groups x R x S) and output, each moved once: the least a layer
    must move (what a memory-bound depthwise layer's bandwidth is counted from)."""
    n, c, h, w = spec.x_shape
    k, cg, r, s = spec.w_shape
    return spec.itemsize * (n * c * h * w + k * cg * r * s + spec.n * spec.k * spec.p * spec.q)


def rotation_sets(spec: ConvSpec, device: DeviceInfo) -> int:
    """Input sets to cycle through so the timed call does not find its inputs in L2."""
    l2 = device.l2_bytes or (L2_GUESS if device.is_gpu else 0)
    nbytes = layer_bytes(spec)
    if l2 == 0 or nbytes >= l2:
        return 1
    return min(MAX_SETS, -(-2 * l2 // nbytes))


def check_slice(spec: ConvSpec) -> int | None:
    """Images of the batch to compare with the float64 reference (None = all)."""
    per_image = spec.flops / spec.n
    if spec.flops <= CHECK_FLOPS:
        return None
    return max(1, min(spec.n, int(CHECK_FLOPS // per_image)))


def cycle(items: list[T]) -> Iterator[T]:
    return itertools.cycle(items)


def median(times: list[float]) -> float:
    return float(statistics.median(times))


PASSES = 2  # timed passes per implementation, convforge's and every baseline's: the fastest pass's median counts


def run_timed(call: Callable[[], None], sync: Callable[[], None],
              timer: Callable[[Callable[[], None], int], list[float]], timing: Timing) -> float:
    """Median milliseconds of ``call`` timed by ``timer`` after ``timing.warmup`` untimed calls, the
    fastest of :data:`PASSES` passes: the rule the cuDNN baselines are timed by
    (``measured.time_cuda``), so a layer of 20-50 us that the GPU's clocks or a neighbour slowed for
    one whole pass is not charged to either side alone (one pass of the same kernel was seen at
    over twice another's time)."""
    best = float("inf")
    for _ in range(PASSES):
        for _ in range(timing.warmup):
            call()
        sync()
        best = min(best, median(timer(call, timing.repeats)))
    return best
