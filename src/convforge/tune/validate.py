"""Checking tuning entries that come from outside (``convforge db import``) before anything is stored:
field types, a known variant that runs on the entry's back-end, and parameters that plan for the
entry's layer on a nominal device of that back-end kind."""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convforge.plan import DeviceInfo

if TYPE_CHECKING:
    from convforge.tune.entry import Entry

# Devices standing for "a GPU of this back-end" when checking imported parameters.
NOMINAL = {
    "cuda": DeviceInfo("cuda", "nominal sm_90", cc=(9, 0), shared_optin_bytes=227 * 1024, units=132),
    "opencl": DeviceInfo("opencl", "nominal OpenCL GPU", units=132),
}
_TEXT = ("device", "backend", "version", "spec", "dtype", "epilogue", "variant", "date", "spec_json",
         "heuristic_variant", "heuristic_params", "precision")
_NUMBERS = ("time_ms", "error", "heuristic_ms", "seconds", "min_error")
_INTS = ("workspace", "candidates")
_REQUIRED = ("device", "backend", "spec", "dtype", "epilogue", "variant", "params", "time_ms", "error")
# The longest text each field may hold (characters): names and keys are short; JSON fields hold a
# handful of parameters or a layer's description. A 150 MB device name is no measurement's.
TEXT_LIMIT = {"params": 4096, "spec_json": 4096, "heuristic_params": 4096, "spec": 512}
TEXT_DEFAULT_LIMIT = 256
# No kernel call takes an hour; seconds of tuning per layer past a day are no measurement either.
MAX_TIME_MS = 3.6e6
MAX_SECONDS = 86400.0
MAX_WORKSPACE = 1 << 48  # 256 TiB: beyond any device's memory


def read_document(source: str | os.PathLike[str]) -> Any:
    """The JSON document in the regular file ``source``, read up to the bound of a tuning export
    (a FIFO or a device is refused before it is read); ValueError when it is not JSON, or is nested
    deeper than the parser goes."""
    from convforge.files import parse_json, read_bounded

    return parse_json(read_bounded(Path(source), "tuning export"), str(source))


def load_document(source: str | os.PathLike[str] | dict[str, Any]) -> list[Any]:
    """The entries of an export (a file or the document itself); one ValueError when malformed,
    or of a schema newer than this convforge reads."""
    from convforge.tune.dbfile import SCHEMA_VERSION
    from convforge.tune.entry import EXPORT_FORMAT

    doc = source if isinstance(source, dict) else read_document(source)
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        raise ValueError(f"not a convforge tuning export (a JSON object whose format is {EXPORT_FORMAT!r})")
    schema = doc.get("schema", 1)
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise ValueError(f"the export's schema ({schema!r}) must be an int from 1 to {SCHEMA_VERSION}")
    if schema > SCHEMA_VERSION:
        raise ValueError(f"the export's schema ({schema}) is newer than this convforge reads ({SCHEMA_VERSION}): "
                         "upgrade convforge")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise ValueError(f"the export's 'entries' must be a list, got {type(entries).__name__}")
    return entries


def class_bound(precision: str, min_error: float | None) -> float:
    """The largest measured error a precision class admits (the tuner's rule, ``Tuner.bound``):
    ``max_error=E``: E; 'relaxed': 1e-3; 'fp32': 5e-6, or FP32_SLACK x the layer's most accurate
    candidate where even that exceeds 5e-6."""
    from convforge.config import FP32_SLACK, PRECISIONS

    if precision.startswith("max_error="):
        return float(precision.split("=", 1)[1])
    bound = PRECISIONS[precision]
    if precision == "fp32" and min_error is not None:
        bound = max(bound, FP32_SLACK * min_error)
    return bound


def entry_fields(d: Any) -> dict[str, Any]:
    """The Entry keyword arguments of an export's object, each field's type and range checked
    (:func:`field_problem`)."""
    from convforge.tune.dbfile import v1_precision
    from convforge.tune.entry import Entry, now

    if not isinstance(d, dict):
        raise TypeError(f"an entry must be a JSON object, got {type(d).__name__}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"lacks {', '.join(missing)}")
    names = set(Entry.__dataclass_fields__)
    vals = {k: v for k, v in d.items() if k in names}
    if not isinstance(vals["params"], str):  # an export writes it as a JSON object
        if not isinstance(vals["params"], dict):
            raise TypeError(f"params ({_short(vals['params'])}) must be an object of parameter names and values")
        try:
            vals["params"] = json.dumps(vals["params"], sort_keys=True)
        except (TypeError, ValueError, RecursionError) as err:
            raise ValueError(f"params cannot be written as JSON ({err})") from None
    for k, v in vals.items():
        why = field_problem(k, v)
        if why:
            raise (TypeError if why.endswith(("must be a string", "must be a finite number")) else ValueError)(why)
    vals["params"] = _normal_json(str(vals["params"]))
    vals.setdefault("version", "")
    vals.setdefault("workspace", 0)
    vals.setdefault("error", 0.0)
    if "date" not in vals:
        vals["date"] = now()
    if "precision" not in vals:  # a schema-1 export: the epilogue tag or the error names the class
        epi, prec, why = v1_precision(vals["epilogue"], float(vals["error"]))
        if why:
            raise ValueError(f"no precision class: {why}")
        vals["epilogue"], vals["precision"] = epi, prec
    return vals


def field_problem(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be field ``key`` of a tuning entry (None when it can): text must be a
    printable string within its length (``TEXT_LIMIT``), the JSON fields a JSON object; numbers
    finite and in range (times from 0, below ``MAX_TIME_MS``); counts ints >= 0."""
    kind = _KIND.get(key)
    if kind == "text":
        if type(value) is str and len(value) <= _LIMIT[key] and value.isprintable():
            if key not in _JSON_FIELDS or _json_kind(value) == "dict":
                return None
        return _text_problem(key, value)
    if kind == "number":
        if value is None and key in _OPTIONAL:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{key} ({_short(value)}) must be a finite number"
        if value < 0:
            return f"{key} ({value!r}) must be >= 0"
        if key in ("time_ms", "heuristic_ms") and value > MAX_TIME_MS:
            return f"{key} ({value!r}) is implausible (above {MAX_TIME_MS:g} ms, an hour)"
        if key == "seconds" and value > MAX_SECONDS:
            return f"seconds ({value!r}) is implausible (above {MAX_SECONDS:g}, a day)"
        return None
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WORKSPACE):
        return f"{key} ({_short(value)}) must be an integer >= 0"
    return None


def _text_problem(key: str, value: Any) -> str:
    if not isinstance(value, str):
        return f"{key} ({_short(value)}) must be a string"
    if len(value) > _LIMIT[key]:
        return f"{key} ({_short(value)}, {len(value)} characters) is longer than {_LIMIT[key]} characters"
    if not value.isprintable():
        return f"{key} ({_short(value)}) holds control characters (terminal escapes, line breaks)"
    kind = _json_kind(value)
    return f"{key} ({_short(value)}) " + ("is not JSON" if kind is None else "must be a JSON object")


_KIND = {**dict.fromkeys((*_TEXT, "params"), "text"), **dict.fromkeys(_NUMBERS, "number"),
         **dict.fromkeys(_INTS, "int")}
_LIMIT = {k: TEXT_LIMIT.get(k, TEXT_DEFAULT_LIMIT) for k in (*_TEXT, "params")}
_JSON_FIELDS = frozenset(("params", "spec_json", "heuristic_params"))
_OPTIONAL = frozenset(("heuristic_ms", "min_error"))


@functools.lru_cache(maxsize=4096)
def _json_kind(text: str) -> str | None:
    """The type name of the JSON value ``text`` holds, None when it is not JSON (remembered: a
    fleet's entries repeat their parameters and layers)."""
    try:
        return type(json.loads(text)).__name__
    except (ValueError, RecursionError):
        return None


@functools.lru_cache(maxsize=4096)
def _normal_json(text: str) -> str:
    return json.dumps(json.loads(text), sort_keys=True)


def row_problem(vals: dict[str, Any]) -> str | None:
    """Why a database row's fields cannot be an Entry (None when they can): each field as
    :func:`field_problem` says, and a time of at least ``MIN_TIME_MS``."""
    from convforge.tune.entry import MIN_TIME_MS

    for k, v in vals.items():
        if v is None and k not in ("heuristic_ms", "min_error"):
            return f"{k} is empty"
        why = field_problem(k, v)
        if why:
            return why
    if vals["time_ms"] < MIN_TIME_MS:
        return f"time_ms ({vals['time_ms']!r}) is implausible (below {MIN_TIME_MS} ms)"
    return None


def _short(v: Any, n: int = 60) -> str:
    """``repr(v)`` cut to ``n`` characters (a 150 MB value is not echoed)."""
    text = repr(v) if not isinstance(v, str) or len(v) <= n else repr(v[:n]) + "..."
    return text if len(text) <= n + 5 else text[:n] + "..."


def validate_entry(d: Any) -> Entry:
    """An Entry from an export's object, checked to be usable; ValueError/TypeError saying why not."""
    return Verifier()(d)


class Verifier:
    """:func:`validate_entry` for many entries: each entry's fields and record are checked, and
    whether its parameters plan for its layer (the costly part: the variant's parameter space and
    its generator) once per distinct (variant, layer, back-end, epilogue, parameters), as a fleet's
    entries repeat them across devices."""

    def __init__(self) -> None:
        self._plans: dict[tuple[str, ...], str | None] = {}

    def __call__(self, d: Any) -> Entry:
        from convforge.tune.entry import MIN_TIME_MS, Entry

        entry = Entry(**entry_fields(d))
        if entry.backend not in NOMINAL:
            raise ValueError(f"backend ({entry.backend!r}) must be one of {', '.join(NOMINAL)}")
        if not entry.time_ms >= MIN_TIME_MS:
            raise ValueError(f"time_ms ({entry.time_ms!r}) is implausible (below {MIN_TIME_MS} ms)")
        _check_record(entry)
        key = (entry.variant, entry.spec, entry.spec_json, entry.dtype, entry.backend, entry.epilogue, entry.params)
        if key not in self._plans:
            try:
                _check_plans(entry)
                self._plans[key] = None
            except (ValueError, TypeError) as err:
                self._plans[key] = str(err)
        why = self._plans[key]
        if why is not None:
            raise ValueError(why)
        return entry


def _check_plans(entry: Entry) -> None:
    """The entry's layer, variant and parameters: the spec matches its spec_json, the variant is
    known and applies on a nominal device of the back-end, the parameters are its own and plan."""
    from convforge.kernels import check_params, get_variant
    from convforge.params import Params
    from convforge.plan import Epilogue
    from convforge.spec import ConvSpec

    try:
        spec = ConvSpec.from_dict(json.loads(entry.spec_json))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as err:
        raise ValueError(f"spec_json ({entry.spec_json[:200]!r}) does not describe a layer ({err})") from None
    if spec.key() != entry.spec:
        raise ValueError(f"spec ({entry.spec!r}) does not match its spec_json ({spec.key()!r})")
    if spec.dtype != entry.dtype:
        raise ValueError(f"dtype ({entry.dtype!r}) does not match the layer's ({spec.dtype!r})")
    variant = get_variant(entry.variant)
    device = NOMINAL[entry.backend]
    why = variant.applies(spec, device)
    if why:
        raise ValueError(f"variant {variant.name} does not apply to the layer on {entry.backend}: {why}")
    params = check_params(variant, spec, device, Params.from_json(entry.params))
    epi = Epilogue(bias="bias" in entry.epilogue, relu="relu" in entry.epilogue)
    if entry.epilogue not in ("none", "bias", "relu", "bias_relu"):
        raise ValueError(f"epilogue ({entry.epilogue!r}) must be none, bias, relu or bias_relu")
    try:
        variant.plan(spec, params, device, epi)
    except Exception as err:  # noqa: BLE001 - whatever the generator says, the entry is unusable
        raise ValueError(f"parameters {params.short()} do not plan for the layer: {err}") from None


def _check_record(entry: Entry) -> None:
    """The fields stored as they are: device, date, errors and the precision class's rule."""
    if not entry.device.strip() or not entry.device.isprintable():
        raise ValueError(f"device ({entry.device!r}) must name a device (printable, not blank)")
    head = entry.device.split("|", 1)[0]
    if "|" in entry.device and head != entry.backend:
        raise ValueError(f"device ({entry.device!r}) is a {head} device, but backend is {entry.backend!r}")
    try:
        when = _dt.datetime.fromisoformat(entry.date)
    except ValueError:
        raise ValueError(f"date ({entry.date!r}) must be an ISO 8601 date and time "
                         "(e.g. 2026-11-24T10:00:00+00:00)") from None
    if when.tzinfo is not None and when > _dt.datetime.now(_dt.UTC) + _dt.timedelta(days=1):
        raise ValueError(f"date ({entry.date!r}) lies in the future")
    if entry.error < 0:
        raise ValueError(f"error ({entry.error!r}) must be >= 0")
    if entry.min_error is not None and not 0 <= entry.min_error <= entry.error:
        raise ValueError(f"min_error ({entry.min_error!r}), the layer's most accurate candidate, must be "
                         f"between 0 and the entry's error ({entry.error!r})")
    _check_precision(entry.precision)
    bound = class_bound(entry.precision, entry.min_error)
    if entry.error > bound:
        raise ValueError(f"error ({entry.error:.1e}) exceeds what precision {entry.precision!r} admits "
                         f"({bound:.1e}" + (", 2x the layer's most accurate" if bound > 5e-6 and
                                            entry.precision == "fp32" else "") + ")")


def _check_precision(text: str) -> None:
    from convforge.config import PRECISIONS

    if text in PRECISIONS:
        return
    if text.startswith("max_error="):
        try:
            if float(text.split("=", 1)[1]) > 0:
                return
        except ValueError:
            pass
    raise ValueError(f"precision ({text!r}) must be {', '.join(PRECISIONS)} or max_error=E")
