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


SLOW = 4.0  # a baseline this many times slower than one already timed for the layer is timed briefly (time_cuda)
BRIEF_REPEATS = 3


def time_cuda(fn: Callable[[], Any], timing: Timing, bound_ms: float | None = None) -> float:
    """Median of ``timing.repeats`` calls after the warm-up, the best of ``timing.PASSES`` passes:
    cuDNN's times were seen 20-60 % slow for a whole layer in single runs
    (docs/history/BENCHMARKS-rounds-1-16.md); convforge's own rows are timed the same way
    (``timing.run_timed``). ``bound_ms``: the fastest baseline already timed for this layer and pass;
    a call over :data:`SLOW` times that (an FFT algorithm at 20 ms beside a 50 us pick) is timed by
    one pass of :data:`BRIEF_REPEATS` calls: more calls cannot make it the fastest, and the suite's
    baselines took minutes on such algorithms. The time stays a median of measured calls."""
    import torch

    best = float("inf")
    repeats, passes = timing.repeats, PASSES
    for done in range(PASSES):
        for _ in range(timing.warmup):
            fn()
        torch.cuda.synchronize()
        if done == 0 and bound_ms is not None and _probe(fn) > SLOW * bound_ms:
            repeats, passes = min(repeats, BRIEF_REPEATS), 1
        # Queued back to back, synchronised once (as convforge's own timer does): host work of
        # one call overlaps the device work of the one before.
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        best = min(best, median([start.elapsed_time(end) for start, end in events]))
        if done + 1 >= passes:
            break
    return best


def _probe(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call of ``fn`` (after its warm-up), by CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end))
