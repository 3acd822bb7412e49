"""A per-network error budget: the one calibration rule of ``convforge.torch.calibrate`` (PyTorch
models) and of ``convforge.compile`` / ``convforge run`` (compiled networks). Torch-free: a model
comes in as "the output error with these layers tightened" and the reference error to beat.

Each convforge layer chooses its variant under its own precision class / ``max_error``; over 50-100
layers those per-layer errors compound (a Winograd layer at 2-4e-6 is within the fp32 class, fifty
of them are not within 2x of PyTorch FP32's output error), while a tight bound on every layer
gives away speed that a network needs. The rule, per network:

1. the bound is ``budget`` x the reference error (PyTorch FP32's on the same input, or for a
   network without torch a plain float32 evaluation's: ``convforge.graph.network_calibration``), measured on
   an input that is not the one reported on; calibration aims at ``headroom`` x the bound (default
   0.95): the error on other inputs of the same distribution differs by a few per cent;
2. the model with every layer at its own setting ("fast") gives the starting error; each layer
   whose choice under ``max_error=tight`` ("accurate") differs from its fast one is a candidate;
3. if the error is over the aim, candidates are ordered by the error they are likely to add per
   unit of speed lost (fast choices whose error has one sign first, :data:`ONE_SIGN`; then the fast
   choice's error, descending: measured by the tuning database where it has one, else the
   variant's stated error; ties: fewer FLOPs first) and a binary search
   finds the smallest prefix whose tightening brings the output error within the aim, one forward
   per probe (:func:`search_prefix`, assuming the error falls as the prefix grows);
4. the prefix is thinned (:func:`loosen`): each tightened layer, the most FLOPs first (the most
   time to win back), returns to its fast choice when the error stays within the aim without it,
   one forward per layer. The order is a guess at each layer's share of the error; this pass
   corrects it where the guess was wrong. When even every candidate tight misses the aim, the
   bound is not met (the report says so) and the same pass keeps the all-tight error (within
   ``MISS_SLACK``, 5 %) with the fewest layers tight: a layer whose tightening does not help is not
   made slower for nothing (all of a network's convs tight can move its error by only 2 %).

Forwards: 1 (the fast setting) + at most 1 + ceil(log2(candidates)) for the search + one per
layer the search tightened, + 1 to leave the model in the final setting when the last probe was
another one. :func:`calibrate_layers` runs steps 3 and 4 on any model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# The accurate setting a candidate moves to: what the exact FP32 families (plain sums of products:
# direct, GEMM, im2col) state. Winograd F(2x2) (7e-7) and 3xTF32 (1e-6) sit above it: their error is
# systematic (the filter transform's or the dropped lo x lo product's rounding is the same at every
# pixel), so it does not average out in pooling as PyTorch's does: left fast at a 1e-6 tight bound,
# such layers put a network's logits error several times above PyTorch FP32's.
TIGHT = 5e-7
MISS_SLACK = 0.05  # a missed bound: how far above the all-tight error the thinned setting may land


@dataclass(frozen=True)
class Candidate:
    """A layer whose variant changes under the tight bound: its path (module path or graph node),
    the fast and accurate choices (variant names, '/'-joined when a layer runs several shapes)
    with their relative errors (the largest over its shapes; each the error the tuning database
    measured for the choice where it has one, else the variant's stated error), its FLOPs per
    forward, and whether the fast error is a measured one."""

    path: str
    fast: str
    fast_error: float
    accurate: str
    accurate_error: float
    flops: int
    fast_measured: bool = False


@dataclass
class PrefixSearch:
    """:func:`search_prefix`'s answer: the prefix length ``k``, the error measured with it, whether
    it meets the bound, and every probe's error by k."""

    k: int
    error: float
    met: bool
    probes: dict[int, float]


# Fast choices whose error has one sign: 3xTF32's tensor-core sums truncate, so its errors add up from
# layer to layer where others average out. Tightened first, whatever their stated error: ordered by
# stated error alone, the search tightens the averaging layers (Winograd's) first, many for nothing.
ONE_SIGN = ("3xtf32", "3xf16")


def one_sign(choice: str) -> bool:
    """Whether a fast choice (variant names, '/'-joined) includes a one-sign-error variant."""
    return any(tag in name for name in choice.split("/") for tag in ONE_SIGN)


def order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Most error per unit of speed lost first: one-sign errors (:data:`ONE_SIGN`) first, then fast
    error descending, then cheaper layers."""
    return sorted(candidates, key=lambda c: (not one_sign(c.fast), -c.fast_error, c.flops, c.path))


def search_prefix(candidates: Sequence[Any], error_of: Callable[[int], float], bound: float) -> PrefixSearch:
    """The smallest k (0..len(candidates)) with ``error_of(k) <= bound``, by binary search under the
    assumption that the error does not grow with k; when even k = len(candidates) misses, that k
    with ``met`` False. ``error_of(k)`` is the output error with the first k candidates tightened
    (one forward each; NaN counts as a miss)."""
    probes: dict[int, float] = {}

    def probe(k: int) -> float:
        if k not in probes:
            probes[k] = float(error_of(k))
        return probes[k]

    n = len(candidates)
    if probe(0) <= bound:
        return PrefixSearch(0, probes[0], True, probes)
    if n == 0 or not probe(n) <= bound:
        return PrefixSearch(n, probes[n], False, probes)
    lo, hi = 0, n  # error_of(lo) misses, error_of(hi) meets
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid) <= bound:
            hi = mid
        else:
            lo = mid
    return PrefixSearch(hi, probes[hi], True, probes)


def loosen(tightened: Sequence[Candidate], error_of: Callable[[frozenset[int]], float],
           bound: float) -> tuple[frozenset[int], float | None, int]:
    """Indices of ``tightened`` that stay tight after trying each, most FLOPs first, back at its
    fast choice: ``error_of(kept)`` is the output error with exactly the indices ``kept`` tight (one
    forward); a trial within ``bound`` is accepted. Returns (kept, the error measured with
    ``kept``, or None when every trial was refused, the probes run)."""
    kept = frozenset(range(len(tightened)))
    error: float | None = None
    probes = 0
    for i in sorted(kept, key=lambda j: (-tightened[j].flops, tightened[j].path)):
        trial = kept - {i}
        probes += 1
        err = float(error_of(trial))
        if err <= bound:
            kept, error = trial, err
    return kept, error, probes


@dataclass
class CalibrationReport:
    """What a calibration measured and changed. Errors are relative L2 against float64;
    ``err_pytorch``: the reference error the bound is a multiple of (``reference`` says whose:
    PyTorch FP32's, PyTorch TF32's, or a plain float32 evaluation's); ``forwards``: forwards of the
    model calibrated (the reference's are not counted); ``skipped``: layers that are not candidates
    although their choice might move, and why; ``aim``: headroom x bound, what the search aimed at;
    ``loosened``: tightened by the prefix search, returned to their fast choice by :func:`loosen`."""

    budget: float
    tight: float
    err_pytorch: float
    bound: float
    error_before: float
    error_after: float
    forwards: int
    candidates: int
    tightened: list[Candidate] = field(default_factory=list)
    met: bool = True
    skipped: dict[str, str] = field(default_factory=dict)
    loosened: list[Candidate] = field(default_factory=list)
    aim: float = 0.0  # headroom x bound: what the search aimed at on the example (``met``: within it)
    reference: str = "PyTorch FP32"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        ratio = self.error_after / self.err_pytorch if self.err_pytorch > 0 else math.inf
        lines = [f"calibrate: reference error {self.err_pytorch:.2e} ({self.reference}), bound {self.budget:g}x = "
                 f"{self.bound:.2e} (aimed at {self.aim:.2e}); convforge error {self.error_before:.2e} -> "
                 f"{self.error_after:.2e} ({ratio:.2f}x the reference's), {len(self.tightened)} of "
                 f"{self.candidates} candidate layer(s) set to max_error={self.tight:g} "
                 f"({len(self.loosened)} more tried and returned), {self.forwards} forward(s)"]
        if not self.met:
            kept = ("the model stays all-tight" if not self.loosened else
                    f"{len(self.tightened)} layer(s) kept tight, {len(self.loosened)} returned to their fast "
                    f"choice (all-tight's error within {MISS_SLACK:.0%} without them)")
            lines.append(f"  bound NOT met: even with every candidate at max_error={self.tight:g} the error is "
                         f"{self.error_after:.2e} > {self.aim:.2e}; {kept}")
        lines += [f"  {c.path}: {c.fast} ({c.fast_error:.1e}{' measured' if c.fast_measured else ''}) -> "
                  f"{c.accurate} ({c.accurate_error:.1e})" for c in self.tightened]
        lines += [f"  {path}: not a candidate: {why}" for path, why in self.skipped.items()]
        return "\n".join(lines)


def check_settings(budget: Any, tight: Any, headroom: Any = 1.0) -> None:
    """ValueError naming the first of ``budget``, ``tight`` (finite numbers > 0) and ``headroom``
    (a number in (0, 1]) that is wrong."""
    for name, v in (("budget", budget), ("tight", tight)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not (0 < v < math.inf):
            raise ValueError(f"calibrate: {name} ({v!r}) must be a finite number > 0")
    if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not 0 < headroom <= 1:
        raise ValueError(f"calibrate: headroom ({headroom!r}) must be a number in (0, 1]")


def calibrate_layers(candidates: Sequence[Candidate], error_with: Callable[[frozenset[str]], float], *,
                     error_before: float, err_reference: float, budget: float = 2.0, tight: float = TIGHT,
                     headroom: float = 0.95, skipped: dict[str, str] | None = None,
                     reference: str = "PyTorch FP32") -> CalibrationReport:
    """Steps 3 and 4 of the rule (module docstring) on a model now in its fast setting, whose output
    error is ``error_before`` (that forward counts as the first). ``error_with(paths)`` sets exactly
    the candidates named in ``paths`` tight (the others fast), runs one forward and answers its
    output error. On return the model is in the final setting: the last ``error_with`` call (if
    any) had the final set."""
    check_settings(budget, tight, headroom)
    cands = order(candidates)
    forwards = [1]
    last: list[frozenset[int]] = [frozenset()]  # the tight set of the last forward

    def measure(chosen: int | frozenset[int]) -> float:
        last[0] = frozenset(range(chosen)) if isinstance(chosen, int) else chosen
        forwards[0] += 1
        return float(error_with(frozenset(cands[i].path for i in last[0])))

    aim = headroom * budget * err_reference
    found = search_prefix(cands, lambda k: error_before if k == 0 else measure(k), aim)
    after = found.error
    keep: frozenset[int] = frozenset(range(found.k))
    if found.k and math.isfinite(found.error):  # met: thin within the aim; missed: keep the all-tight error
        keep, err, _ = loosen(cands[:found.k], measure, aim if found.met else found.error * (1 + MISS_SLACK))
        after = found.error if err is None else err
    if last[0] != keep:  # the last forward probed another setting: set the final one and run it
        after = measure(keep)
    tightened = [c for i, c in enumerate(cands) if i in keep]
    loosened = [c for i, c in enumerate(cands[:found.k]) if i not in keep]
    return CalibrationReport(budget, tight, err_reference, budget * err_reference, error_before, after, forwards[0],
                             len(cands), tightened, found.met, dict(skipped or {}), loosened, aim, reference)
