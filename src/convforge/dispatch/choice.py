"""Which variant and parameters run a spec: the one place that decides.

For ``algo="auto"``: the tuning database's entry for the precision class (or, under ``max_error``,
any entry whose *measured* error is within it), else the entry of the same spec and class with a
plainer epilogue (bias + ReLU, bias, none) when that variant plans with the requested epilogue (a
fused residual or ReLU costs the same variant little, and a network's fused layers then use what
``tune --suite`` stored; with ``config.autotune`` on, a layer is tuned with its own epilogue
instead), else autotuning when ``config.autotune`` is on,
else Boda's heuristic over the variants whose *stated* accuracy the class admits. A family name
takes the heuristic within that family; a variant name or explicit parameters always run as named.
Answers are cached per argument set, so a warm call is one dictionary lookup.

With a prologue (``Prologue``: a pre-activation folded into the input load), the choice without
it stands when its variant takes the prologue (``Variant.takes_prologue``) and plans with it;
otherwise that variant's default parameters, else the first ranked variant (same family or
``auto``, class and workspace limit) that takes and plans it. A named variant that takes none is
an error naming why.

Where the caller transforms filters on every call (``filters_per_call``: CuPy arrays, which have no
version counter) and a layer is tiny (at most ``TINY_MACS`` multiply-adds: its kernel costs about
what a launch does), the heuristic prefers the first ranked variant whose plan is one launch, else
one with no filter-only step: the transform's launch would cost as much as the convolution. Database entries are timed
with their transforms (docs/MEASURING.md), so they are kept as they are.

No silent fallback to a slow variant: on half storage (FP16 / BF16) the vendor library runs dense and
grouped convolutions on tensor cores, so a CUDA-core form (``direct*``, ``implicit_gemm*``,
``im2col_gemm``, ``gemm1x1*`` and their dgrad / wgrad adapters) runs such a layer at a fraction of its
speed. :func:`slow_reason` says, for a spec (and optionally the variant chosen for it), why no fast
variant serves it, so that a caller can hand the layer to PyTorch and list it in its report;
:func:`is_fast` is the test it applies to one variant.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from convforge import caches, kernels
from convforge.config import PRECISIONS, config, parse_precision, precision_key
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Prologue, Variant
from convforge.spec import ConvSpec
from convforge.tune.heuristic import epilogue_key

if TYPE_CHECKING:
    from convforge.backends.base import Backend
    from convforge.tune.db import Entry

log = logging.getLogger("convforge.dispatch")
# What makes a variant fast on a half-precision layer: its kernels run on tensor cores (features a
# plan's kernels require), or its family is memory-bound, so that its roof is DRAM bandwidth rather
# than the arithmetic rate the library beats it on (depthwise: R*S FMAs an output; the GEMV stream).
TENSOR_CORE_FEATURES = frozenset({"wgmma", "mma_tf32"})
MEMORY_BOUND_FAMILIES = frozenset({"depthwise"})
MEMORY_BOUND_VARIANTS = frozenset({"gemv_stream"})
HALF_DTYPES = frozenset({"float16", "bfloat16"})
TINY_MACS = 1 << 22
_CHOICES: dict[tuple[Any, ...], Choice] = {}
caches.register(_CHOICES.clear, "dispatch: choices", on=("choices",))


@dataclass(frozen=True)
class Choice:
    """A variant and its parameters, with the error it was admitted on and where it came from."""

    variant: Variant
    params: Params
    error: float | None = None  # measured (database, tuning) or None (stated only)
    source: str = "heuristic"  # "db", "tuned", "heuristic" or "named"


def choose(spec: ConvSpec, backend: Backend, epilogue: Epilogue = Epilogue(), *, algo: str = "auto",
           precision: str | None = None, max_error: float | None = None,
           workspace_limit: int | None = None, params: Params | None = None,
           filters_per_call: bool = False, prologue: Prologue = Prologue(), finite_exact: bool = False) -> Choice:
    """The (variant, params) that runs ``spec`` on ``backend`` (cached per argument set);
    ``filters_per_call``: the caller cannot keep transformed filters between calls; ``prologue``:
    what the plan applies to its input (module docstring); ``finite_exact`` (or ``config.finite_exact``):
    'auto' keeps to the families whose intermediates overflow only where the answer does (:func:`may_overflow`)."""
    if not isinstance(algo, str):
        raise TypeError(f"algo ({algo!r}) must be a string: 'auto', a family ({', '.join(kernels.FAMILIES)}) "
                        "or a variant name")
    prec = parse_precision(precision) if precision is not None else config.precision
    bound = max_error if max_error is not None else config.max_error
    finite_exact = finite_exact or config.finite_exact  # CONVFORGE_FINITE_EXACT: every array kind, every call
    key = (backend, spec, epilogue, algo, prec, bound, workspace_limit, params,
           config.autotune, config.db_path, config.cache_dir, filters_per_call, prologue, finite_exact)
    hit = _CHOICES.get(key)
    if hit is None:
        if prologue.active:
            base = choose(spec, backend, epilogue, algo=algo, precision=prec, max_error=bound,
                          workspace_limit=workspace_limit, params=params, filters_per_call=filters_per_call,
                          finite_exact=finite_exact)
            hit = _with_prologue(base, spec, backend, epilogue, prologue, algo, prec, bound, workspace_limit)
        else:
            hit = _choose_slow(spec, backend, epilogue, algo, prec, bound, workspace_limit, params,
                               filters_per_call, finite_exact and algo == "auto")
        _CHOICES[key] = hit
    return hit


# -- near FP32's range: families whose transforms may overflow before the answer does ---------------
# Winograd combines a whole input tile (B^T d B), the filter (G g G^T) and the products (A^T M A):
# its intermediates reach past the answer's magnitude. With g_i = |G_i|_1 |B^T_i|_1 (row i of each
# transform; the product is unchanged by how the rows are scaled), an intermediate of F(m, r) is at
# most C x max|x| x max|w| x max(max_i g_i^2, max_p (sum_i |A^T_pi| g_i)^2), plus the transforms
# of x and w alone (|B^T_i|_1^2 max|x|, |G_i|_1^2 max|w|). The sums of direct and the GEMM family
# (at most C x R x S x max|x| x max|w|) overflow only where the answer itself may.
# The factors for 3 x 3 filters (growth()), and where 'auto' on NumPy arrays leaves the family for an
# exact one (FLT_MAX / 2 over the factor; direct's factor is 9, the answer's own bound):
#   F(m x m)  products (x C max|x| max|w|)  threshold per channel  input alone (x max|x|)  threshold
#   F(2x2)        64                         2.7e36                  4                       4.3e37
#   F(4x4)        2304                       7.4e34                  100                     1.7e36
#   F(6x6)        4579                       3.7e34                  2500                    6.8e34
#   F(7x7)        74598                      2.3e33                  62500                   2.7e33
# e.g. C = 64 channels: F(2x2) is left where max|x| max|w| >= 4.2e34. Ordinary data never comes close.
OVERFLOW_LIMIT = {"float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38, "float16": 65504.0}


def growth(variant: Variant, spec: ConvSpec) -> tuple[float, float, float] | None:
    """(per-channel product factor, input factor, filter factor) bounding ``variant``'s
    intermediates on ``spec`` (comment above), or None for a family that adds plain products."""
    m = getattr(variant, "m", None)
    if variant.family != "winograd" or not isinstance(m, int):
        return None
    from convforge.kernels.winograd.matrices import winograd

    r = max(spec.r, spec.s)
    t = winograd(r, m) if spec.conv_pass == "wgrad" else winograd(m, r)
    b = [float(sum(abs(v) for v in row)) for row in t.BT]
    g = [float(sum(abs(v) for v in row)) for row in t.G]
    gb = [gi * bi for gi, bi in zip(g, b)]
    out = max(sum(abs(float(a)) * p for a, p in zip(row, gb)) for row in t.AT)
    return max(max(gb) ** 2, out ** 2), max(b) ** 2, max(g) ** 2


def may_overflow(variant: Variant, spec: ConvSpec, xmax: float, wmax: float) -> bool:
    """Whether ``variant``'s intermediates on ``spec`` may pass the dtype's largest value with inputs
    of magnitude up to ``xmax`` and filters up to ``wmax`` (NaN or Inf among them: True) where an
    exact family's could not; half the limit is the margin for rounding."""
    factors = growth(variant, spec)
    if factors is None:
        return False
    prod, fx, fw = factors
    reduce = spec.n * spec.p * spec.q if spec.conv_pass == "wgrad" else max(spec.c, spec.k) // spec.groups
    worst = max(reduce * prod * xmax * wmax, fx * xmax, fw * wmax)
    return not worst < OVERFLOW_LIMIT.get(spec.dtype, OVERFLOW_LIMIT["float32"]) / 2


def needs_finite_exact(spec: ConvSpec, backend: Backend, epilogue: Epilogue, x: Any, w: Any, **kw: Any) -> bool:
    """Whether host arrays ``x`` and ``w`` call for ``choose(..., finite_exact=True)``: 'auto' chose
    a family whose intermediates may overflow on them (:func:`may_overflow`, from max|x| and max|w|,
    computed only then) where an exact family's would not."""
    import numpy as np

    if kw.get("algo", "auto") != "auto" or kw.get("params") is not None:
        return False
    ch = choose(spec, backend, epilogue, **kw)
    if growth(ch.variant, spec) is None:
        return False
    xmax = float(np.max(np.abs(x), initial=0.0))
    wmax = float(np.max(np.abs(w), initial=0.0))
    if may_overflow(ch.variant, spec, xmax, wmax):
        log.info("%s on %s: inputs up to %.3g and filters up to %.3g may overflow its transforms; an exact "
                 "family runs it", ch.variant.name, spec.short(), xmax, wmax)
        return True
    return False


def _with_prologue(base: Choice, spec: ConvSpec, backend: Backend, epi: Epilogue, pro: Prologue, algo: str,
                   prec: str, bound: float | None, workspace_limit: int | None) -> Choice:
    """``base`` (the choice without the prologue) when it takes ``pro``; else its variant's default
    parameters; else the first ranked variant that takes and plans it (module docstring)."""
    dev = backend.device
    why = base.variant.takes_prologue(spec, pro)
    if base.source == "named":
        if why:
            raise ValueError(f"{base.variant.name} cannot run {spec.short()} with a prologue: {why}")
        base.variant.plan_for(spec, base.params, dev, epi, pro)  # a parameter set it refuses: the error
        return base
    if why is None:
        for prm in dict.fromkeys((base.params, base.variant.default(spec, dev))):
            if _plans(base.variant, prm, spec, backend, epi, pro):
                return base if prm == base.params else Choice(base.variant, prm, None, "heuristic")
    pool = [v for v in kernels.ranked(algo, spec, dev, workspace_limit, precision=prec, max_error=bound)
            if v.takes_prologue(spec, pro) is None]
    for v in pool:
        prm = v.default(spec, dev)
        if _plans(v, prm, spec, backend, epi, pro):
            log.info("%s takes no prologue on %s (%s); %s runs it", base.variant.name, spec.short(),
                     why or "its parameters", v.name)
            return Choice(v, prm, None, "heuristic")
    raise ValueError(f"no {algo!r} variant runs {spec.short()} with a prologue (pre-activation) in class "
                     f"{prec!r}: {base.variant.name}: {why or 'its parameters refuse it'}")


def _choose_slow(spec: ConvSpec, backend: Backend, epi: Epilogue, algo: str, prec: str,
                 bound: float | None, workspace_limit: int | None, params: Params | None,
                 filters_per_call: bool = False, finite_exact: bool = False) -> Choice:
    dev = backend.device
    if params is not None or (algo != "auto" and algo not in kernels.FAMILIES):
        variant, prm = kernels.most_specialised(algo, spec, dev, workspace_limit, params)
        return Choice(variant, prm, None, "named")
    if algo == "auto":
        hit = _from_db(spec, backend, epi, prec, bound, workspace_limit, finite_exact)
        if hit is not None:
            return hit
        if config.autotune and not finite_exact:
            hit = _tune_now(spec, backend, epi, prec, bound, workspace_limit)
            if hit is not None:
                return hit
    pool = None
    if finite_exact:
        pool = [v for v in kernels.select(algo, spec, dev, precision=prec, max_error=bound)
                if growth(v, spec) is None]
    try:
        variant, prm = kernels.most_specialised(algo, spec, dev, workspace_limit, variants=pool, precision=prec,
                                                max_error=bound)
    except ValueError:
        if bound is None or algo != "auto":
            raise
        raise ValueError(_unmeetable(spec, backend, bound)) from None
    if filters_per_call and algo == "auto" and spec.flops // 2 <= TINY_MACS:
        one = _without_filter_steps(spec, backend, epi, workspace_limit, prec, bound)
        if one is not None and not (finite_exact and growth(one[0], spec) is not None):
            return Choice(one[0], _for_epilogue(one[0], spec, one[1], epi), None, "heuristic")
    return Choice(variant, _for_epilogue(variant, spec, prm, epi), None, "heuristic")


def _for_epilogue(variant: Variant, spec: ConvSpec, prm: Params, epi: Epilogue) -> Params:
    """A heuristic choice's parameters for the epilogue it runs with: the variant's word where it has one
    (``epilogue_params``: the 16-bit tensor-core GEMMs prefetch a residual, ``rs=1``, on a tile with room for
    it; read after the accumulators it cost 3.6-3.9x the plain GEMM on the H200), else ``prm``."""
    adjust = getattr(variant, "epilogue_params", None)
    return prm if adjust is None or not epi.residual else adjust(spec, prm, epi)


def _without_filter_steps(spec: ConvSpec, backend: Backend, epi: Epilogue, workspace_limit: int | None,
                          prec: str, bound: float | None) -> tuple[Variant, Params] | None:
    """The first ranked variant (with its default parameters) whose plan is one step, else the first
    whose plan has no filter-only step."""
    from convforge.backends.base import weight_steps

    dev = backend.device
    found: list[tuple[Variant, Params, int]] = []
    for v in kernels.ranked("auto", spec, dev, workspace_limit, precision=prec, max_error=bound):
        prm = v.default(spec, dev)
        try:
            plan = v.plan(spec, prm, dev, epi)
        except ValueError:  # no store path for this epilogue
            continue
        if not weight_steps(plan)[0]:
            found.append((v, prm, len(plan.steps)))
    found.sort(key=lambda f: f[2] > 1)  # stable: one-step plans first, each in rank order
    return (found[0][0], found[0][1]) if found else None


def _unmeetable(spec: ConvSpec, backend: Backend, bound: float) -> str:
    """The error message of a max_error no variant states it can meet."""
    best = kernels.most_accurate(spec, backend.device)
    what = f"{best.name} states {best.expected_error(spec):.1e}" if best else "no variant applies"
    return (f"max_error ({bound:g}) cannot be met on {spec.short()}: the most accurate variant, {what} "
            "(tune the layer to measure it, or raise max_error)")


def fallback_epilogues(epi: Epilogue, autotune: bool = False) -> list[Epilogue]:
    """The epilogues whose database entries may serve ``epi``, in order: itself, then bias + ReLU,
    bias alone and none (duplicates dropped). Under ``autotune`` only itself and its bias + ReLU
    part (what tuning a residual / offset epilogue stores): a layer is then tuned with its own
    epilogue rather than served by a plainer one's entry."""
    plainer = [epi.plain()]
    if not autotune:
        plainer += [Epilogue(bias=epi.bias), Epilogue()]
    return list(dict.fromkeys([epi, *plainer]))


def _entries(spec: ConvSpec, backend: Backend, epi: Epilogue, prec: str,
             bound: float | None) -> list[Entry]:
    """Database entries that may serve: for each of :func:`fallback_epilogues` in turn, the class's
    own (or the max_error key's), then, under max_error, the classes' entries (their measured error
    is checked by the caller). Whether a fallback's variant takes ``epi`` is checked by planning."""
    from convforge.tune import Tuner, open_db

    db = open_db(write=config.autotune)
    if db is None:
        return []
    tuner = Tuner(backend, db, precision=prec, max_error=bound)
    keys = [precision_key(prec, bound)] + (list(PRECISIONS) if bound is not None else [])
    out: list[Entry] = []
    for e in fallback_epilogues(epi, config.autotune):
        for k in keys:
            try:
                entry = tuner.lookup(spec, e, precision=k)
            except Exception as err:  # noqa: BLE001 - a database problem is a slower choice, never a crash
                log.warning("tuning database lookup failed (%s); using the heuristic", err)
                return out
            if entry is not None:
                out.append(entry)
    return out


def _from_db(spec: ConvSpec, backend: Backend, epi: Epilogue, prec: str, bound: float | None,
             workspace_limit: int | None, finite_exact: bool = False) -> Choice | None:
    """The first stored entry that still applies, fits, plans and (under max_error) measured within
    it (under ``finite_exact``, of a family whose intermediates overflow only where the answer does)."""
    for entry in _entries(spec, backend, epi, prec, bound):
        if bound is not None and not entry.error <= bound:
            continue
        try:
            variant = kernels.get_variant(entry.variant)
        except ValueError:
            continue
        if finite_exact and growth(variant, spec) is not None:
            continue
        if workspace_limit is not None and entry.workspace > workspace_limit:
            continue
        if not variant.capturable:  # an older entry: 'auto' answers must record into CUDA graphs
            continue
        if variant.applies(spec, backend.device) is not None:
            continue
        params = Params.from_json(entry.params)
        try:  # an older generator's entry, or a plainer epilogue's variant that cannot take ``epi``
            variant.plan(spec, params, backend.device, epi)
        except Exception as err:  # noqa: BLE001 - a stale entry is a slower choice, never a crash
            own = entry.epilogue == epilogue_key(epi)
            (log.warning if own else log.info)(
                "stored choice %s [%s]%s does not plan%s (%s); skipped", variant.name, params.short(),
                "" if own else f" of epilogue {entry.epilogue!r}", "" if own else f" with {epilogue_key(epi)!r}", err)
            continue
        return Choice(variant, params, entry.error, "db")
    return None


def _tune_now(spec: ConvSpec, backend: Backend, epi: Epilogue, prec: str, bound: float | None,
              workspace_limit: int | None) -> Choice | None:
    """Autotune on first sight (``config.autotune``) into the database. The tuner checks bias and
    ReLU only, so a residual or channel-offset epilogue is tuned as its bias + ReLU part (stored
    under that key, which the lookup falls back to); when that winner has no store path for ``epi``,
    the fastest admitted candidate that has one is chosen and stored under ``epi``'s own key."""
    from convforge.tune import AUTOTUNE_BUDGET, TuneError, Tuner, open_db

    db = open_db(write=True)
    tuner = Tuner(backend, db, AUTOTUNE_BUDGET, precision=prec, max_error=bound)
    checkable = epi.plain()
    try:
        res = tuner.tune(spec, checkable, workspace_limit, force=True)
        if checkable == epi or _plans(res.variant, res.params, spec, backend, epi):
            return Choice(res.variant, res.params, res.entry.error, "tuned")
        takes = [c for c in res.candidates if c.status == "ok" and _plans(c.variant, c.params, spec, backend, epi)]
        if not takes:
            raise TuneError(f"no tuned candidate has a store path for epilogue {epilogue_key(epi)!r}")
        best = tuner.select(spec, takes)
    except TuneError as err:
        log.warning("autotuning failed, using the heuristic: %s", err)
        return None
    assert best.plan is not None
    if db is not None:
        db.put(dataclasses.replace(res.entry, epilogue=epilogue_key(epi), variant=best.variant.name,
                                   params=best.params.to_json(), time_ms=best.time_ms,
                                   workspace=best.plan.workspace_bytes, error=best.error or 0.0))
    return Choice(best.variant, best.params, best.error, "tuned")


def _plans(variant: Variant, params: Params, spec: ConvSpec, backend: Backend, epi: Epilogue,
           pro: Prologue = Prologue()) -> bool:
    try:
        variant.plan_for(spec, params, backend.device, epi, pro)
    except ValueError:  # "unsupported epilogue": no store path for a residual / channel offset
        return False
    return True


def is_fast(variant: Variant, spec: ConvSpec, device: DeviceInfo, params: Params | None = None) -> bool:
    """Whether ``variant`` runs ``spec`` near the speed of the vendor library's kernels of its dtype.
    Every variant counts on float32 (the library's FP32 kernels are CUDA-core kernels too); on half
    storage, a memory-bound family (MEMORY_BOUND_FAMILIES, MEMORY_BOUND_VARIANTS), a variant whose
    every plan runs on tensor cores (``Variant.tensor_cores``) or a plan (of ``params``, default: the
    variant's default) whose kernels do, unless the variant says it is slow there (``Variant.slow_on``)."""
    if spec.dtype not in HALF_DTYPES:
        return True
    if variant.slow_on(spec):
        return False
    if variant.family in MEMORY_BOUND_FAMILIES or variant.name in MEMORY_BOUND_VARIANTS or variant.tensor_cores:
        return True
    try:
        plan = variant.plan(spec, params if params is not None else variant.default(spec, device), device)
    except Exception as err:  # noqa: BLE001 - a variant that cannot plan is not fast, never a crash
        log.debug("is_fast: %s does not plan %s (%s)", variant.name, spec.short(), err)
        return False
    return bool(plan.requires & TENSOR_CORE_FEATURES)


def slow_reason(spec: ConvSpec, device: DeviceInfo, variant: Variant | None = None, params: Params | None = None, *,
                precision: str | None = None, max_error: float | None = None) -> str | None:
    """None when a fast variant (:func:`is_fast`) serves ``spec`` on ``device``, else one line saying
    why not, for a caller to log once and hand the layer to PyTorch. Judged on CUDA half-precision
    layers only (float32 and other back-ends: None). With ``variant`` (and ``params``): that choice
    (say, what :func:`choose` returned); without: every variant ``auto`` may pick in the precision
    class (``precision``, ``max_error``: as :func:`choose` takes them)."""
    if spec.dtype not in HALF_DTYPES or device.backend != "cuda":
        return None
    what = f"{spec.dtype} layer {spec.short()}"
    if variant is not None:
        if is_fast(variant, spec, device, params):
            return None
        slow = variant.slow_on(spec)
        if slow:
            return f"{variant.name} is slow on the {what}: {slow}"
        return (f"{variant.name} runs the {what} on CUDA cores, far below the library's tensor-core kernels "
                "of that dtype")
    pool = kernels.ranked("auto", spec, device, precision=precision, max_error=max_error)
    if any(is_fast(v, spec, device) for v in pool):
        return None
    if not pool:
        why = kernels.reasons("auto", spec, device, precision=precision, max_error=max_error)
        return f"no variant runs the {what} ({len(why)} refuse it)"
    names = ", ".join(v.name for v in pool[:4]) + (", ..." if len(pool) > 4 else "")
    return (f"no fast variant serves the {what}: only CUDA-core forms apply ({names}), far below the "
            "library's tensor-core kernels of that dtype")


def cached() -> list[tuple[ConvSpec, Epilogue, str, Choice]]:
    """(spec, epilogue, precision class, choice) of every cached ``algo="auto"`` choice, oldest first:
    after :func:`clear_choices`, what the calls since chose (``convforge tune --model`` prints it)."""
    return [(k[1], k[2], k[4], ch) for k, ch in list(_CHOICES.items()) if k[3] == "auto"]


def clear_choices() -> None:
    """Forget cached choices (after the database or the configuration changed)."""
    caches.clear("choices")


def measure_dispatch(spec: ConvSpec, backend: Any, calls: int = 20000, epilogue: Epilogue = Epilogue()) -> float:
    """Microseconds per warm :func:`choose` call (the API's dispatch overhead on a known layer)."""
    import time

    choose(spec, backend, epilogue)
    start = time.perf_counter()
    for _ in range(calls):
        choose(spec, backend, epilogue)
    return (time.perf_counter() - start) / calls * 1e6
