"""What one baseline measurement is and how a baseline is timed on CUDA: shared by ``baselines.py`` and
``cudnn.py`` (torch only inside functions, as there)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from convforge.apps.bench.timing import PASSES, Timing, median


@dataclass(frozen=True)
class BaselineResult:
    """One baseline implementation on one layer; ``time_ms`` is None when it could not run."""

    impl: str
    algo: str
    precision: str
    time_ms: float | None
    workspace_bytes: int | None = None
    rel_err: float | None = None
    status: str = "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rel_err(out: Any, ref: Any) -> float:
    """Relative L2 error of ``out`` against ``ref`` (float64), the absolute one where ``ref`` is 0."""
    diff = (out.double() - ref).norm().item()
    den = ref.norm().item()
    return diff / den if den else diff


def time_cuda(fn: Callable[[], Any], timing: Timing) -> float:
    """Median of ``timing.repeats`` calls after the warm-up, the best of ``timing.PASSES`` passes:
    cuDNN's times were seen 20-60 % slow for a whole layer in single runs
    (docs/history/BENCHMARKS-rounds-1-16.md); convforge's own rows are timed the same way
    (``timing.run_timed``)."""
    import torch

    best = float("inf")
    for _ in range(PASSES):
        for _ in range(timing.warmup):
            fn()
        torch.cuda.synchronize()
        # Queued back to back, synchronised once (as convforge's own timer does): host work of
        # one call overlaps the device work of the one before.
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(timing.repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        best = min(best, median([start.elapsed_time(end) for start, end in events]))
    return best
