"""``calibrate(model, reference, example)``: a per-network error budget for a converted or fused model.

The rule and its search are ``convforge.error_budget``'s (the one calibration module, shared with
``convforge.compile`` and ``convforge run``); this module supplies a PyTorch model's parts: the
float64 output of the original model on ``example`` and PyTorch FP32's own error on it (TF32 off,
or on with ``tf32``: the relaxed class's baseline) give the bound; one forward of ``model`` records
each convforge module's input shape and the starting error; a candidate is each module whose
choice at ``max_error=tight`` differs from its own (``Conv2d.cf_choice``), and each ``FusedLinear``
(a linear layer no variant runs at the tight bound: tightened, it runs PyTorch's FP32 operations);
a probe sets modules' ``max_error`` (``set_max_error``) and runs one no_grad forward.

The model is left in the final setting (``Conv2d.set_max_error``). Calibrate on an input you do not
report figures on. "Fast" choices come from the tuning database where it has entries (``convforge
tune --model`` fills it), so calibrate after tuning. A module already at ``max_error=tight`` (say,
from an earlier calibration) is not a candidate: its setting at call time is its fast one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from convforge.dispatch import Choice
from convforge.error_budget import (  # noqa: F401 - the shared module's names, as this module always had them
    TIGHT,
    CalibrationReport,
    Candidate,
    PrefixSearch,
    calibrate_layers,
    check_settings,
    loosen,
    order,
    search_prefix,
)
from convforge.spec import ConvSpec
from convforge.torch.linear import FusedLinear
from convforge.torch.modules import Conv2d


def calibrate(model: torch.nn.Module, reference: torch.nn.Module, example: torch.Tensor, *, budget: float = 2.0,
              tight: float = TIGHT, tf32: bool = False, headroom: float = 0.95) -> CalibrationReport:
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

        def error_with(paths: frozenset[str]) -> float:
            _apply(mods, cands, fast, tight, frozenset(i for i, c in enumerate(cands) if c.path in paths))
            return rel_err(model(example), want)

        return calibrate_layers(cands, error_with, error_before=err0, err_reference=err_pt, budget=budget,
                                tight=tight, headroom=headroom, skipped=skipped,
                                reference="PyTorch TF32" if tf32 else "PyTorch FP32")


def _check(model: Any, reference: Any, example: Any, budget: Any, tight: Any,
           headroom: Any = 1.0) -> dict[str, Conv2d | FusedLinear]:
    """The convforge modules of ``model`` by path; ValueError naming what is wrong with the input."""
    for name, m in (("model", model), ("reference", reference)):
        if not isinstance(m, torch.nn.Module):
            raise ValueError(f"calibrate: {name} must be a torch.nn.Module, not {type(m).__name__}")
        if m.training:
            raise ValueError(f"calibrate: {name} is in training mode; call .eval() first (calibrate runs inference)")
    check_settings(budget, tight, headroom)
    if any(isinstance(m, Conv2d) for m in reference.modules()):
        raise ValueError("calibrate: reference has convforge modules; pass the original PyTorch model "
                         "(convert() works in place: convert a copy)")
    mods = {path: m for path, m in model.named_modules() if isinstance(m, Conv2d | FusedLinear)}
    if not any(isinstance(m, Conv2d) for m in mods.values()):
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


def _record(model: torch.nn.Module, mods: dict[str, Conv2d | FusedLinear], example: torch.Tensor,
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


def _candidates(mods: dict[str, Conv2d | FusedLinear], shapes: dict[str, set[tuple[int, ...]]], device: int,
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
        if len(acc) < len(pairs) and getattr(m, "cf_tight_is_pytorch", False):
            out.append(Candidate(path, _names(fast), _error(fast), "pytorch", TIGHT,
                                 sum(spec.flops for spec, _ in fast), all(ch.error is not None for _, ch in fast)))
            continue  # a FusedLinear at the tight bound runs PyTorch's FP32 operations
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


def _apply(mods: dict[str, Conv2d | FusedLinear], cands: Sequence[Candidate], fast: dict[str, float | None],
           tight: float, chosen: int | frozenset[int]) -> None:
    """The candidates ``chosen`` (indices, or an int k: the first k) at ``tight``, the rest at their
    own setting (only changed modules drop their runners)."""
    tight_set = frozenset(range(chosen)) if isinstance(chosen, int) else chosen
    for i, c in enumerate(cands):
        want = tight if i in tight_set else fast[c.path]
        if mods[c.path].max_error != want:
            mods[c.path].set_max_error(want)
