"""Benchmark suites: the built-in ones (data files in ``suites/``) and user files.

A user file is a JSON list of objects, one per layer::

    [{"name": "my3x3", "N": 8, "C": 64, "H": 56, "W": 56, "K": 64, "R": 3, "S": 3, "stride": 1, "pad": 1},
     {"N": 1, "C": 3, "H": 224, "W": 224, "K": 64, "R": 7, "S": 7, "stride": [2, 2], "pad": [3, 3],
      "dilation": 1}]

Keys ``N C H W K R S stride pad`` are required; ``name``, ``dilation`` and ``groups`` are optional; ``stride``,
``pad`` and ``dilation`` are an int or an ``[h, w]`` pair; ``groups`` an int dividing C and K (C: depthwise).
A row with ``"transposed": true`` is a ``ConvTranspose2d`` in PyTorch's terms (C in and K out channels, H x W
its input, an optional ``output_padding``) and is benchmarked as what ``convforge.conv_transpose2d`` runs:
the dgrad of its forward layer (``spec.transposed_geometry``), against cuDNN's ``conv_transpose2d``.
The built-in files are objects with a ``comment`` and ``layers``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from convforge.spec import ConvSpec, transposed_geometry

BUILTIN = ("resnet", "boda", "mec", "unseen", "batch1", "fc", "grouped", "convnext_mlp", "resnet50", "vgg16", "stems",
           "decoder", "depthwise", "grouped_conv")
REQUIRED = ("N", "C", "H", "W", "K", "R", "S", "stride", "pad")
# ``bench --ablation NAME``: name -> (variant, [(configuration label, parameter overrides of the default)])
ABLATIONS: dict[str, tuple[str, list[tuple[str, dict[str, int]]]]] = {
    "im2win": ("im2win", [
        ("all on", {}),
        ("no prefetch/double buffer", {"pf": 0, "db": 0}),
        ("no vector loads", {"va": 1, "vb": 1}),
        ("no micro-kernel", {"bm": 16, "bn": 16, "bk": 64, "tm": 1, "tn": 1}),
    ]),
}
OPTIONAL = ("name", "dilation", "groups", "transposed", "output_padding")


class SuiteError(ValueError):
    """A suite file could not be read; the message names the file and the bad row."""


@dataclass(frozen=True)
class Layer:
    """One benchmarked convolution and the name it is reported under."""

    name: str
    spec: ConvSpec


def _int_or_pair(where: str, key: str, value: Any) -> int | list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        return list(value)
    raise SuiteError(f"{where}: '{key}' ({value!r}) must be an int or an [h, w] pair of ints")


def parse_row(row: Any, where: str) -> Layer:
    """One suite row to a Layer; ``where`` (file and row number) prefixes every error."""
    if not isinstance(row, dict):
        raise SuiteError(f"{where}: must be a JSON object with keys {' '.join(REQUIRED)}, got {row!r}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise SuiteError(f"{where}: missing key(s) {', '.join(missing)}")
    unknown = sorted(set(row) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise SuiteError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: "
                         f"{' '.join(REQUIRED + OPTIONAL)})")
    for key in "NCHWKRS":
        v = row[key]
        if not isinstance(v, int) or isinstance(v, bool):
            raise SuiteError(f"{where}: '{key}' ({v!r}) must be an int")
    stride = _int_or_pair(where, "stride", row["stride"])
    pad = _int_or_pair(where, "pad", row["pad"])
    dilation = _int_or_pair(where, "dilation", row.get("dilation", 1))
    groups = row.get("groups", 1)
    if not isinstance(groups, int) or isinstance(groups, bool):
        raise SuiteError(f"{where}: 'groups' ({groups!r}) must be an int")
    if not isinstance(row.get("transposed", False), bool):
        raise SuiteError(f"{where}: 'transposed' ({row['transposed']!r}) must be true or false")
    if "output_padding" in row and row.get("transposed") is not True:
        raise SuiteError(f"{where}: 'output_padding' goes with \"transposed\": true")
    try:
        if row.get("transposed", False) is True:
            spec = _transposed(row, stride, pad, dilation, groups, where)
        else:
            spec = ConvSpec.make(row["N"], row["C"], row["H"], row["W"], row["K"], row["R"], row["S"],
                                 stride, pad, dilation, groups)
    except ValueError as err:
        raise SuiteError(f"{where}: {err}") from None
    name = row.get("name", "")
    if not isinstance(name, str):
        raise SuiteError(f"{where}: 'name' ({name!r}) must be a string")
    return Layer(name or where.rsplit(" ", 1)[-1].replace("#", "layer"), spec)


def _transposed(row: dict[str, Any], stride: Any, pad: Any, dilation: Any, groups: int, where: str) -> ConvSpec:
    """The dgrad spec of a ``"transposed": true`` row (a ConvTranspose2d: C in, K out, H x W input)."""
    op = _int_or_pair(where, "output_padding", row.get("output_padding", 0))
    if row["K"] % groups:
        raise SuiteError(f"{where}: groups ({groups}) must divide K ({row['K']})")
    spec, eh, ew = transposed_geometry((row["N"], row["C"], row["H"], row["W"]),
                                       (row["C"], row["K"] // groups, row["R"], row["S"]), stride, pad, op, groups,
                                       dilation)
    if eh or ew:
        raise SuiteError(f"{where}: output_padding ({op}) past padding + stride - 1 is not benchmarked")
    return spec


def parse_suite(data: Any, source: str) -> list[Layer]:
    """Layers from parsed JSON: a list of rows, or an object with a ``layers`` list."""
    rows = data.get("layers") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not rows:
        raise SuiteError(f"{source}: must be a non-empty JSON list of layer objects")
    return [parse_row(row, f"{source} row #{i + 1}") for i, row in enumerate(rows)]


def load_file(path: str | Path) -> list[Layer]:
    """Layers of a user JSON file."""
    from convforge.files import parse_json, read_bounded

    p = Path(path)
    try:
        data = parse_json(read_bounded(p, "suite"), str(p))
    except (OSError, ValueError) as err:
        raise SuiteError(f"{err}; a suite is a JSON file of layers") from None
    return parse_suite(data, str(p))


def builtin(name: str) -> list[Layer]:
    """A built-in suite by name."""
    if name not in BUILTIN:
        raise SuiteError(f"suite ({name!r}) must be one of {', '.join(BUILTIN)} or a JSON file")
    text = resources.files("convforge.apps.bench").joinpath(f"suites/{name}.json").read_text()
    return parse_suite(json.loads(text), f"suite {name}")


def load_suite(name_or_path: str, limit: int | None = None) -> list[Layer]:
    """A built-in suite or a user file, optionally cut to its first ``limit`` layers."""
    layers = builtin(name_or_path) if name_or_path in BUILTIN else load_file(name_or_path)
    if limit is not None:
        if limit <= 0:
            raise SuiteError(f"--limit ({limit}) must be positive")
        layers = layers[:limit]
    return layers
