"""The variant registry: one module per family registers its variants here."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from convforge.params import Params
from convforge.plan import DeviceInfo, Variant
from convforge.spec import ConvSpec

FAMILIES = ("direct", "im2col", "implicit_gemm", "im2win", "winograd", "gemm1x1", "depthwise")
_REGISTRY: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    """Add a variant instance under its name."""
    if variant.name in _REGISTRY:
        raise ValueError(f"variant {variant.name} registered twice")
    _REGISTRY[variant.name] = variant
    return variant


# The modules that register variants (each by ``register(...)`` when imported), in the registry's order:
# the one place that order is set. It is part of dispatch (``ranked`` keeps registration order among
# equal ranks) and kept as it was when the families were imported by name. all_variants() lists the
# variants in it whatever was imported first. ``dgrad.transposed`` registers its stride-1 adapters of
# the forward variants (``register_adapters``) after every module is imported, listed at its place.
REGISTRATION_ORDER = (
    "gemm",
    "dgrad.baseline",
    "dgrad.strided",
    "direct",
    "im2win",
    "winograd.nonfused",
    "winograd.fused",
    "tensorcore.sm80.mma_variants",
    "tensorcore.sm80.mma_staged",
    "tensorcore.sm90.variants",
    "tensorcore.sm90.stem",
    "tensorcore.sm90.wgmma_1x1",
    "tensorcore.sm90.winograd",
    "tensorcore.sm90.dgrad",
    "tensorcore.sm90.wgrad",
    "tensorcore.sm90.wgrad_nhwc",
    "tensorcore.sm90.grouped",
    "tensorcore.sm90.dgrad_grouped",
    "tensorcore.sm90.dgrad_paired",
    "dgrad.transposed",
    "depthwise",
    "depthwise_rows",
    "depthwise_nhwc",
    "depthwise_wgrad",
    "tensorcore.sm80.depthwise_mma",
    "tensorcore.sm80.depthwise_mma_wgrad",
    "gemv",
    "wgrad.direct",
    "wgrad.grouped",
    "tensorcore.sm80.grouped_mma_wgrad",
    "wgrad.gemm",
    "wgrad.winograd",
)


def _load() -> None:
    """Import the modules of REGISTRATION_ORDER (which registers their variants), make the dgrad
    adapters of the forward variants, and put the registry in REGISTRATION_ORDER (a module imported
    before the first load registered its variants first; a variant of a module not listed goes last)."""
    import importlib

    for mod in REGISTRATION_ORDER:
        importlib.import_module(f"{__name__}.{mod}")
    from convforge.kernels.dgrad.transposed import register_adapters

    register_adapters()
    place = {f"{__name__}.{mod}": i for i, mod in enumerate(REGISTRATION_ORDER)}
    ordered = sorted(_REGISTRY.values(), key=lambda v: place.get(type(v).__module__, len(place)))
    _REGISTRY.clear()
    _REGISTRY.update((v.name, v) for v in ordered)


_LOADED = False
_LOADING = False
_LOAD_LOCK = threading.RLock()  # re-entrant: a family module's import may ask for the registry


def all_variants() -> list[Variant]:
    """Every registered variant, the family modules imported on the first call. Thread-safe: a
    thread that comes while another imports them waits for the whole registry (prepare() and
    compile_ahead() build layers on several threads at once; a half-filled registry answered
    "no variant applies" and the layer fell back)."""
    global _LOADED, _LOADING
    if not _LOADED:  # a flag, not "registry empty": one family may be imported before the rest
        with _LOAD_LOCK:  # the importing thread holds it: the others wait for the whole registry
            if not (_LOADED or _LOADING):  # _LOADING: a family module asking while it is imported
                _LOADING = True
                try:
                    _load()
                    _LOADED = True
                finally:
                    _LOADING = False
    return list(_REGISTRY.values())


def get_variant(name: str) -> Variant:
    all_variants()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def select(algo: str, spec: ConvSpec, device: DeviceInfo, *, precision: str | None = None,
           max_error: float | None = None) -> list[Variant]:
    """Variants named by ``algo`` (a family, a variant or 'auto') that apply to ``spec``; 'auto' and
    families keep to those whose stated accuracy the precision class (and ``max_error``) admits."""
    variants = [v for v in all_variants() if not v.named_only]  # those only by their name (Variant.named_only)
    if algo == "auto":
        chosen = variants
    elif algo in _REGISTRY and not (algo in FAMILIES and spec.conv_pass not in _REGISTRY[algo].passes):
        chosen = [_REGISTRY[algo]]  # "direct" names the forward variant in fprop, the family in the other passes
    else:
        chosen = [v for v in variants if v.family == algo]
        if not chosen:
            known = sorted(set(FAMILIES) | set(_REGISTRY))
            raise ValueError(f"algo ({algo!r}) is not a family or variant; known: {', '.join(known)}")
    usable = [v for v in chosen if v.applies(spec, device) is None
              and (algo == v.name or accurate_enough(v, spec, precision, max_error) is None)]
    return sorted(usable, key=lambda v: -v.rank(spec, device))  # most specialised first (Boda's rule)


def accurate_enough(variant: Variant, spec: ConvSpec | None = None, precision: str | None = None,
                    max_error: float | None = None) -> str | None:
    """None when ``variant``'s stated accuracy is admitted by the precision class (default
    ``config.precision``) and, when set, ``max_error`` (default ``config.max_error``); else why not.
    Stated figures only: measured errors are the dispatcher's business (convforge.dispatch)."""
    from convforge.config import config

    precision = precision or config.precision
    bound = max_error if max_error is not None else config.max_error
    if bound is None and precision == "fp32" and variant.precision != "fp32":
        return f"precision class {variant.precision!r} is outside 'fp32' (use precision='relaxed')"
    if (bound is None and precision == "relaxed" and spec is not None and not variant.exact
            and spec.dtype in variant.dtypes and spec.conv_pass in variant.passes):
        stated, limit = variant.expected_error(spec), relaxed_limit(spec.dtype)
        if stated > limit:
            return (f"stated error {stated:.1e} > the relaxed class's {limit:.1e} on {spec.dtype} "
                    "(a looser max_error admits it)")
    if bound is not None and spec is not None:
        from convforge.dtypes import HALF_ROUNDING

        stated = max(variant.expected_error(spec), HALF_ROUNDING.get(spec.dtype, 0.0))  # half: its rounding
        if stated > bound:
            return f"stated error {stated:.1e} > max_error {bound:.0e}"
    return None


def relaxed_limit(dtype: str) -> float:
    """The bound the relaxed class is expected to set on a ``dtype`` layer (the tuner's rule with
    the dtype's own rounding as the most accurate error): a variant stating more is not tried."""
    from convforge.config import FP32_SLACK, PRECISIONS
    from convforge.dtypes import HALF_ROUNDING

    return max(PRECISIONS["relaxed"], FP32_SLACK * HALF_ROUNDING.get(dtype, 0.0))


def ranked(algo: str, spec: ConvSpec, device: DeviceInfo, workspace_limit: int | None = None,
           variants: Sequence[Variant] | None = None, params: Params | None = None, *,
           precision: str | None = None, max_error: float | None = None) -> list[Variant]:
    """Variants named by ``algo`` (within the precision class; or any of ``variants``, the
    caller's own pool) that apply to ``spec`` and whose workspace
    with their default parameters (or ``params``) fits ``workspace_limit``, most specialised first
    (``Variant.rank``); ties keep registration order, so the order is deterministic."""
    if variants is None:
        pool = select(algo, spec, device, precision=precision, max_error=max_error)
    else:
        pool = sorted((v for v in variants if v.applies(spec, device) is None),
                      key=lambda v: -v.rank(spec, device))
    if workspace_limit is None:
        return pool
    out = []
    for v in pool:
        try:
            need = v.workspace_bytes(spec, params if params is not None else v.default(spec, device))
        except Exception:  # noqa: BLE001 - a variant that cannot size itself does not fit
            continue
        if need <= workspace_limit:
            out.append(v)
    return out


def most_specialised(algo: str, spec: ConvSpec, device: DeviceInfo, workspace_limit: int | None = None,
                     params: Params | None = None, variants: Sequence[Variant] | None = None, *,
                     precision: str | None = None, max_error: float | None = None) -> tuple[Variant, Params]:
    """Boda's rule, the one copy of it: the first of :func:`ranked`, with its default parameters
    (or ``params``)."""
    pool = ranked(algo, spec, device, workspace_limit, variants, params, precision=precision,
                  max_error=max_error)
    if pool:
        if params is not None:
            return pool[0], check_params(pool[0], spec, device, params)
        return pool[0], pool[0].default(spec, device)
    why = reasons(algo, spec, device, precision=precision, max_error=max_error)
    detail = "; ".join(f"{k}: {r}" for k, r in why.items()) or "none fits the workspace limit"
    raise ValueError(f"no {algo!r} variant applies to {spec.short()} on {device.backend} ({detail})")


def check_params(variant: Variant, spec: ConvSpec, device: DeviceInfo, params: Any) -> Params:
    """``params`` as Params when it names exactly ``variant``'s parameters for ``spec`` (those of its
    default) with plausible values: ints within reach of the space's (from 1, or 0 for a switch or
    where 0 means none, up to 4x its largest, so a typo such as tk=100000 never reaches the
    generator), strings and booleans among the space's.
    Otherwise ValueError naming the missing and unknown keys (and the variant's names) or the value
    and what is allowed. Whether the values plan is ``variant.plan``'s to say."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params ({params!r}) must be a dict or Params of parameter names and values")
    bad_keys = [k for k in params if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"params keys ({bad_keys!r}) must be strings")
    prm = params if isinstance(params, Params) else Params(params)
    default = variant.default(spec, device)
    if prm == default:  # the variant's own choice: valid without listing its space (slow for the tile generators)
        return default
    space = variant.space(spec, device)
    names = set(default).union(*(set(pt) for pt in space), variant.optional_params)  # some points only
    required = set(default).intersection(*(set(pt) for pt in space))
    missing, unknown = sorted(required - set(prm)), sorted(set(prm) - names)
    if missing or unknown:
        what = "; ".join(part for part in (
            f"missing {', '.join(missing)}" if missing else "",
            f"unknown {', '.join(unknown)}" if unknown else "") if part)
        raise ValueError(f"params for {variant.name}: {what} ({variant.name} takes "
                         f"{', '.join(sorted(names)) or 'no parameters'}; its default here is "
                         f"{default.short() or '{}'})")
    taken: dict[str, set[Any]] = {k: set(v) for k, v in variant.optional_params.items()}
    for k, v in default.items():
        taken.setdefault(k, set()).add(v)
    for point in space:
        for k, v in point.items():
            taken.setdefault(k, set()).add(v)
    switches = {k for k, vals in taken.items() if all(isinstance(v, bool) for v in vals)}
    if any(k in switches and v in (0, 1) and not isinstance(v, bool) for k, v in prm.items()):
        prm = Params({k: bool(v) if k in switches and v in (0, 1) else v for k, v in prm.items()})  # 1 / 0 as shown
    for k, v in prm.items():
        _check_value(variant.name, k, v, taken[k])
    return prm


# Integer parameters that switch something off (0) or on (1), and those where 0 means "none" (mb:
# no launch bound; sw: no swizzle; pi: no 3xTF32 promotion; kc: one running sum). Every other
# integer parameter is a size or
# a count, >= 1: a tile of 0 threads or outputs divides by zero in the generators. (ps: the tensor-core
# generator's persistent grid.)
SWITCHES = frozenset({"db", "pf", "so", "xi", "xo", "hf", "lo", "fl", "ca", "ci", "ps"})
ZERO_OK = frozenset({"mb", "sw", "pi", "kc"})


def _check_value(variant: str, key: str, value: Any, taken: set[Any]) -> None:
    """ValueError unless ``value`` is of the kind of the values ``taken`` and, for ints, in reach:
    0 or 1 for a switch, else from 1 (0 where it means "none") to 4x the largest taken."""
    ints = [v for v in taken if isinstance(v, int) and not isinstance(v, bool)]
    if ints and len(ints) == len(taken):
        if key in SWITCHES:
            low, high = 0, 1
        else:
            low, high = min(0 if key in ZERO_OK else 1, min(ints)), max(64, 4 * max(ints))
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"params for {variant}: {key} ({value!r}) must be an int in {low}..{high}")
    elif all(isinstance(v, bool) for v in taken):
        if not isinstance(value, bool):
            raise ValueError(f"params for {variant}: {key} ({value!r}) must be true or false (or 1 / 0)")
    elif not (value in taken and type(value) in {type(v) for v in taken}):
        allowed = ", ".join(sorted(repr(v) for v in taken))
        raise ValueError(f"params for {variant}: {key} ({value!r}) must be one of {allowed}")


def most_accurate(spec: ConvSpec, device: DeviceInfo) -> Variant | None:
    """The applicable variant of the smallest stated error (an exact one: direct or GEMM family)."""
    pool = [v for v in all_variants() if v.applies(spec, device) is None]
    return min(pool, key=lambda v: (v.expected_error(spec), not v.exact, -v.rank(spec, device)),
               default=None)


def reasons(algo: str, spec: ConvSpec, device: DeviceInfo, *, precision: str | None = None,
            max_error: float | None = None) -> dict[str, str]:
    """Why each variant named by ``algo`` does not apply (for error messages)."""
    out = {}
    for v in all_variants():
        if algo in ("auto", v.name, v.family):
            why = v.applies(spec, device) or (
                None if algo == v.name else accurate_enough(v, spec, precision, max_error))
            if why:
                out[v.name] = why
    return out
