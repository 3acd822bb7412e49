"""``calibrate(model, reference, example)``: a per-network error budget for a converted or fused model.

Each convforge layer chooses its variant under its own ``precision`` / ``max_error``; over 50-100
layers those per-layer errors compound (a Winograd layer at 2-4e-6 is within the fp32 class, fifty
of them are not within 2x of PyTorch FP32's output error), while a tight bound on every layer
gives away speed that a network needs. ``calibrate`` chooses per network:

1. the float64 output of the original model on ``example`` and PyTorch FP32's own error on it
   (TF32 off) give the bound, ``budget`` x PyTorch's error; calibration aims at ``headroom`` x
   the bound (default 0.95): the error on other inputs of the same distribution differs from the
   error on ``example`` by a few per cent (0.5-2 % over six torchvision models on an H200), and
   the bound is meant for those inputs;
2. one forward of ``model`` (every layer at its own setting: "fast") records each convforge
   module's input shape and gives the starting error; each module whose choice at
   ``max_error=tight`` ("accurate") differs from its fast one is a candidate;
3. if the error is over the bound, candidates are ordered by the error they are likely to add per
   unit of speed lost (the fast choice's error, descending: the error the tuning database measured
   for it where it has one, since stated errors do not grow with the reduction length while
   measured ones do, else the variant's stated error; ties: fewer FLOPs first) and a
   binary search finds the smallest prefix whose tightening brings the output error within the
   bound, one no_grad forward per probe (:func:`search_prefix`, assuming the error falls as the
   prefix grows);
4. the prefix is then thinned (:func:`loosen`): each tightened layer, the most FLOPs first (the
   most time to win back), returns to its fast choice when the output error stays within the
   bound without it, one forward per layer. The prefix order is a guess at each layer's share of
   the error; this pass corrects it where the guess was wrong.

The model is left in the final setting (``Conv2d.set_max_error``). Calibrate on an input you do not
report figures on. "Fast" choices come from the tuning database where it has entries (``convforge
tune --model`` fills it), so calibrate after tuning. A module already at ``max_error=tight`` (say,
from an earlier calibration) is not a candidate: its setting at call time is its fast one.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from convforge.dispatch import Choice
from convforge.spec import ConvSpec
from convforge.torch.modules import Conv2d


@dataclass(frozen=True)
class Candidate:
    """A layer whose variant changes under the tight bound: its path, the fast and accurate
    choices (variant names, '/'-joined when the module runs several shapes) with their relative
    errors (the largest over its shapes; each the error the tuning database measured for the
    choice where it has one, else the variant's stated error), its FLOPs per forward, and whether
    the fast error is a measured one."""

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


def order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Most error per unit of speed lost first: fast error descending, then cheaper layers."""
    return sorted(candidates, key=lambda c: (-c.fast_error, c.flops, c.path))


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
    """What ``calibrate`` measured and changed. Errors are relative L2 against float64;
    ``forwards``: forwards of the converted model (the reference's two are not counted);
    ``skipped``: convforge modules that are not candidates although their choice might move,
    and why; ``aim``: headroom x bound, what the search aimed at; ``loosened``: tightened by the
    prefix search, returned to their fast choice by :func:`loosen`."""

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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        ratio = self.error_after / self.err_pytorch if self.err_pytorch > 0 else math.inf
        lines = [f"calibrate: PyTorch FP32 error {self.err_pytorch:.2e}, bound {self.budget:g}x = {self.bound:.2e} "
                 f"(aimed at {self.aim:.2e}); "
                 f"convforge error {self.error_before:.2e} -> {self.error_after:.2e} ({ratio:.2f}x PyTorch's), "
                 f"{len(self.tightened)} of {self.candidates} candidate layer(s) set to max_error={self.tight:g} "
                 f"({len(self.loosened)} more tried and returned), {self.forwards} forward(s)"]
        if not self.met:
            lines.append(f"  bound NOT met: even with every candidate at max_error={self.tight:g} the error is "
                         f"{self.error_after:.2e} > {self.aim:.2e}; the model stays all-tight")
        lines += [f"  {c.path}: {c.fast} ({c.fast_error:.1e}{' measured' if c.fast_measured else ''}) -> "
                  f"{c.accurate} ({c.accurate_error:.1e})" for c in self.tightened]
        lines += [f"  {path}: not a candidate: {why}" for path, why in self.skipped.items()]
        return "\n".join(lines)


def calibrate(model: torch.nn.Module, reference: torch.nn.Module, example: torch.Tensor, *, budget: float = 2.0,
              tight: float = 1e-6, tf32: bool = False, headroom: float = 0.95) -> CalibrationReport:
    """Tighten the fewest convforge layers of ``model`` (to ``max_error=tight``) that bring its output
    error on ``example`` within ``budget`` x PyTorch FP32's (module docstring). ``reference``: the
    original PyTorch model with the same parameters; ``tf32``: measure PyTorch's error with TF32 on
    (the relaxed class's baseline); ``headroom``: the fraction of the bound aimed at on ``example``.
    Both models must be in eval mode."""
    mods = _check(model, reference, example, budget, tight, headroom)
    with torch.no_grad(), _tf32(False):
        want = _reference64(reference, example)
        with _tf32(tf32):
            err_pt = rel_err(reference(example), want)
        shapes, err0 = _record(model, mods, example, want)
        fast = {path: m.max_error for path, m in mods.items()}
        cands, skipped = _candidates(mods, shapes, example.device.index or 0, tight)
        cands = order(cands)
        forwards = [1]
        last: list[frozenset[int]] = [frozenset()]  # the tight set of the last forward

        def measure(chosen: int | frozenset[int]) -> float:
            last[0] = frozenset(range(chosen)) if isinstance(chosen, int) else chosen
            _apply(mods, cands, fast, tight, last[0])
            forwards[0] += 1
            return rel_err(model(example), want)

        aim = headroom * budget * err_pt
        found = search_prefix(cands, lambda k: err0 if k == 0 else measure(k), aim)
        after = found.error
        keep: frozenset[int] = frozenset(range(found.k))
        if found.met and found.k:
            keep, err, _ = loosen(cands[:found.k], measure, aim)
            after = found.error if err is None else err
        if last[0] != keep:  # the last forward probed another setting: set the final one and run it
            after = measure(keep)
    tightened = [c for i, c in enumerate(cands) if i in keep]
    loosened = [c for i, c in enumerate(cands[:found.k]) if i not in keep]
    return CalibrationReport(budget, tight, err_pt, budget * err_pt, err0, after, forwards[0], len(cands),
                             tightened, found.met, skipped, loosened, aim)


def _check(model: Any, reference: Any, example: Any, budget: Any, tight: Any, headroom: Any = 1.0) -> dict[str, Conv2d]:
    """The convforge modules of ``model`` by path; ValueError naming what is wrong with the input."""
    for name, m in (("model", model), ("reference", reference)):
        if not isinstance(m, torch.nn.Module):
            raise ValueError(f"calibrate: {name} must be a torch.nn.Module, not {type(m).__name__}")
        if m.training:
            raise ValueError(f"calibrate: {name} is in training mode; call .eval() first (calibrate runs inference)")
    for name, v in (("budget", budget), ("tight", tight)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not (0 < v < math.inf):
            raise ValueError(f"calibrate: {name} ({v!r}) must be a finite number > 0")
    if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not 0 < headroom <= 1:
        raise ValueError(f"calibrate: headroom ({headroom!r}) must be a number in (0, 1]")
    if any(isinstance(m, Conv2d) for m in reference.modules()):
        raise ValueError("calibrate: reference has convforge modules; pass the original PyTorch model "
                         "(convert() works in place: convert a copy)")
    mods = {path: m for path, m in model.named_modules() if isinstance(m, Conv2d)}
    if not mods:
        raise ValueError("calibrate: model has no convforge modules (Conv2d / FusedConv2d); "
                         "run convforge.torch.convert or fuse on it first")
    if not isinstance(example, torch.Tensor) or not example.is_cuda or example.dtype != torch.float32:
        what = (f"a {example.device.type} {str(example.dtype).replace('torch.', '')} tensor"
                if isinstance(example, torch.Tensor) else type(example).__name__)
        raise ValueError(f"calibrate: example must be a CUDA float32 tensor, not {what}")
    return mods


@contextmanager
def _tf32(on: bool) -> Iterator[None]:
    """cuDNN's and cuBLAS's TF32 switches set to ``on`` inside, restored after."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _flat(out: Any) -> torch.Tensor:
    """A model's output as one flat tensor (a tensor, or a tuple / list of tensors)."""
    if isinstance(out, torch.Tensor):
        return out.reshape(-1)
    if isinstance(out, tuple | list) and out and all(isinstance(t, torch.Tensor) for t in out):
        return torch.cat([t.reshape(-1) for t in out])
    raise ValueError(f"calibrate: a model's output must be a tensor or a tuple of tensors, not {type(out).__name__}")


def rel_err(out: Any, want: torch.Tensor) -> float:
    """||out - want|| / ||want||, in float64."""
    return float((_flat(out).double() - want).norm() / want.norm())


def _reference64(reference: torch.nn.Module, example: torch.Tensor) -> torch.Tensor:
    """The flat float64 output of a float64 copy of ``reference`` (the copy is freed on return)."""
    model64 = copy.deepcopy(reference).double()
    want = _flat(model64(example.double()))
    del model64
    if not want.norm() > 0:
        raise ValueError("calibrate: the reference output is all zeros (or not finite): no relative error")
    return want


def _record(model: torch.nn.Module, mods: dict[str, Conv2d], example: torch.Tensor,
            want: torch.Tensor) -> tuple[dict[str, set[tuple[int, ...]]], float]:
    """Each module's input shapes in one forward (pre-hooks), and that forward's error."""
    shapes: dict[str, set[tuple[int, ...]]] = {path: set() for path in mods}

    def hook_of(path: str) -> Callable[..., None]:
        def hook(_m: Any, args: tuple[Any, ...]) -> None:
            if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
                shapes[path].add(tuple(args[0].shape))
        return hook

    handles = [m.register_forward_pre_hook(hook_of(path)) for path, m in mods.items()]
    try:
        err = rel_err(model(example), want)
    finally:
        for h in handles:
            h.remove()
    return shapes, err


def _candidates(mods: dict[str, Conv2d], shapes: dict[str, set[tuple[int, ...]]], device: int,
                tight: float) -> tuple[list[Candidate], dict[str, str]]:
    """The modules whose choice under ``tight`` differs from their own, and why the others that
    convforge runs are not candidates when that is not simply 'the same choice'."""
    out: list[Candidate] = []
    skipped: dict[str, str] = {}
    for path, m in mods.items():
        pairs = [(m.cf_choice(s, device, m.max_error), m.cf_choice(s, device, tight)) for s in sorted(shapes[path])]
        fast = [f for f, _ in pairs if f is not None]
        acc = [a for _, a in pairs if a is not None]
        if not pairs or len(fast) < len(pairs):
            continue  # not called on the example, or PyTorch runs it
        if len(acc) < len(pairs):
            skipped[path] = f"no variant states max_error={tight:g} on this layer"
            continue
        if all((f.variant.name, f.params) == (a.variant.name, a.params) for (_, f), (_, a) in zip(fast, acc)):
            continue
        out.append(Candidate(path, _names(fast), _error(fast), _names(acc), _error(acc),
                             sum(spec.flops for spec, _ in fast), all(ch.error is not None for _, ch in fast)))
    return out, skipped


def _names(choices: list[tuple[ConvSpec, Choice]]) -> str:
    return "/".join(dict.fromkeys(ch.variant.name for _, ch in choices))


def _error(choices: list[tuple[ConvSpec, Choice]]) -> float:
    """The largest error of the choices: measured (tuning database) where known, else stated."""
    return max(ch.error if ch.error is not None else ch.variant.expected_error(spec) for spec, ch in choices)


def _apply(mods: dict[str, Conv2d], cands: Sequence[Candidate], fast: dict[str, float | None], tight: float,
           chosen: int | frozenset[int]) -> None:
    """The candidates ``chosen`` (indices, or an int k: the first k) at ``tight``, the rest at their
    own setting (only changed modules drop their runners)."""
    tight_set = frozenset(range(chosen)) if isinstance(chosen, int) else chosen
    for i, c in enumerate(cands):
        want = tight if i in tight_set else fast[c.path]
        if mods[c.path].max_error != want:
            mods[c.path].set_max_error(want)
