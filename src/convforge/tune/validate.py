"""Checking tuning entries that come from outside (``convforge db import``) before anything is stored:
field types, a known variant that runs on the entry's back-end, and parameters that plan for the
entry's layer on a nominal device of that back-end kind."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convforge.plan import DeviceInfo

if TYPE_CHECKING:
    from convforge.tune.db import Entry

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


def read_document(source: str | os.PathLike[str]) -> Any:
    """The JSON document in the regular file ``source`` (a FIFO or a device is refused before it is
    read: OSError); ValueError when it is not JSON."""
    from convforge.tune.dbfile import read_head

    try:
        return json.loads(read_head(Path(source), None).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{source} is not a JSON document ({err})") from None


def load_document(source: str | os.PathLike[str] | dict[str, Any]) -> list[Any]:
    """The entries of an export (a file or the document itself); one ValueError when malformed,
    or of a schema newer than this convforge reads."""
    from convforge.tune.db import EXPORT_FORMAT
    from convforge.tune.dbfile import SCHEMA_VERSION

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
    """The Entry keyword arguments of an export's object, each field's type checked."""
    from convforge.tune.db import Entry, now
    from convforge.tune.dbfile import v1_precision

    if not isinstance(d, dict):
        raise TypeError(f"an entry must be a JSON object, got {type(d).__name__}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"lacks {', '.join(missing)}")
    names = set(Entry.__dataclass_fields__)
    vals = {k: v for k, v in d.items() if k in names}
    for k in _TEXT:
        if k in vals and not isinstance(vals[k], str):
            raise TypeError(f"{k} ({vals[k]!r}) must be a string")
    for k in _NUMBERS:
        v = vals.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise TypeError(f"{k} ({v!r}) must be a finite number")
    for k in _INTS:
        if k in vals and (isinstance(vals[k], bool) or not isinstance(vals[k], int) or vals[k] < 0):
            raise TypeError(f"{k} ({vals[k]!r}) must be an integer >= 0")
    vals["params"] = _params_json(vals["params"])
    vals.setdefault("version", "")
    vals.setdefault("workspace", 0)
    vals.setdefault("error", 0.0)
    vals.setdefault("date", now())
    if "precision" not in vals:  # a schema-1 export: the epilogue tag or the error names the class
        epi, prec, why = v1_precision(vals["epilogue"], float(vals["error"]))
        if why:
            raise ValueError(f"no precision class: {why}")
        vals["epilogue"], vals["precision"] = epi, prec
    return vals


def _params_json(p: Any) -> str:
    if isinstance(p, str):
        try:
            p = json.loads(p)
        except json.JSONDecodeError:
            raise ValueError(f"params ({p!r}) is not a JSON object") from None
    if not isinstance(p, dict):
        raise TypeError(f"params ({p!r}) must be an object of parameter names and values")
    return json.dumps(p, sort_keys=True)


def validate_entry(d: Any) -> Entry:
    """An Entry from an export's object, checked to be usable; ValueError/TypeError saying why not."""
    from convforge.kernels import check_params, get_variant
    from convforge.params import Params
    from convforge.plan import Epilogue
    from convforge.spec import ConvSpec
    from convforge.tune.db import MIN_TIME_MS, Entry

    entry = Entry(**entry_fields(d))
    if entry.backend not in NOMINAL:
        raise ValueError(f"backend ({entry.backend!r}) must be one of {', '.join(NOMINAL)}")
    if not entry.time_ms >= MIN_TIME_MS:
        raise ValueError(f"time_ms ({entry.time_ms!r}) is implausible (below {MIN_TIME_MS} ms)")
    _check_record(entry)
    try:
        spec = ConvSpec.from_dict(json.loads(entry.spec_json))
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(f"spec_json ({entry.spec_json!r}) does not describe a layer ({err})") from None
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
    return entry


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
