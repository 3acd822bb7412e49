"""ConvSpec: one 2-D convolution, validated, with its output shape and FLOP count."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Pair = tuple[int, int]
Quad = tuple[int, int, int, int]


def _int(name: str, value: Any, whole: Any) -> int:
    """``value`` as an int when it is an integer (numbers.Integral, NumPy's included) but not a
    bool; otherwise a ValueError naming ``name`` and the whole argument ``whole``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = ", not a bool" if isinstance(value, bool) else ""
        raise ValueError(f"{name} ({whole!r}) must be {_FORMS[name]}{what}")
    return operator.index(value)


_FORMS = {"stride": "an int or a pair of ints", "dilation": "an int or a pair of ints",
          "padding": "an int, (h, w) or (top, bottom, left, right) of ints"}


def _ints(name: str, value: Any) -> tuple[int, ...] | int:
    """An int as a Python int, or a sequence (any iterable but a string) of ints as a tuple of them."""
    if isinstance(value, numbers.Integral) or isinstance(value, str | bytes):
        return _int(name, value, value)
    try:
        items = tuple(value)
    except TypeError:  # None, a float: neither an int nor a sequence
        raise ValueError(f"{name} ({value!r}) must be {_FORMS[name]}") from None
    return tuple(_int(name, v, value) for v in items)


def _pair(name: str, value: int | Sequence[int]) -> Pair:
    """Normalise an int or an (h, w) pair."""
    vals = _ints(name, value)
    if isinstance(vals, int):
        return (vals, vals)
    if len(vals) != 2:
        raise ValueError(f"{name} ({value!r}) must be {_FORMS[name]}")
    return (vals[0], vals[1])


def normalize_padding(padding: int | Sequence[int]) -> Quad:
    """Padding as (top, bottom, left, right) from an int, (ph, pw) or a 4-tuple."""
    vals = _ints("padding", padding)
    if isinstance(vals, int):
        return (vals, vals, vals, vals)
    if len(vals) == 2:
        return (vals[0], vals[0], vals[1], vals[1])
    if len(vals) == 4:
        return (vals[0], vals[1], vals[2], vals[3])
    raise ValueError(f"padding ({padding!r}) must be {_FORMS['padding']}")


_SPEC_TUPLES = ("stride", "pad", "dilation")
_SPEC_KEYS = tuple("NCHWKRS") + _SPEC_TUPLES


def _spec_key(key: str) -> str:
    """The canonical spec key for ``key`` (N..S in either case, stride, pad, dilation), or a ValueError
    suggesting the nearest known one."""
    import difflib

    canon = key.upper() if len(key) == 1 else key.lower()
    if canon in _SPEC_KEYS:
        return canon
    near = difflib.get_close_matches(key.lower(), [k.lower() for k in _SPEC_KEYS], n=1, cutoff=0.5)
    hint = f"; did you mean {near[0] if len(near[0]) > 1 else near[0].upper()!r}?" if near else ""
    raise ValueError(f"unknown spec key {key!r}{hint} (known: {', '.join(_SPEC_KEYS)})")


INT32_MAX = 2**31 - 1  # the largest size or coordinate kernels hold (they take them as 32-bit ints)
MAX_ELEMENTS = 2**62  # the most elements of one tensor (64-bit offsets; far beyond any device's memory)


def _check_extents(spec: ConvSpec) -> None:
    """Sizes a kernel can hold: every field and padded extent within a 32-bit int, every tensor
    within 2^62 elements. Beyond that a layer is refused here, before any variant sees it."""
    fields = {"N": spec.n, "C": spec.c, "H": spec.h, "W": spec.w, "K": spec.k, "R": spec.r, "S": spec.s,
              "stride": max(spec.stride), "padding": max(spec.pad), "dilation": max(spec.dilation),
              "padded H": spec.h + spec.pad[0] + spec.pad[1], "padded W": spec.w + spec.pad[2] + spec.pad[3],
              "dilated R": spec.eff_r, "dilated S": spec.eff_s}
    for name, value in fields.items():
        if value > INT32_MAX:
            raise ValueError(f"{name} ({value}) must be at most 2^31 - 1 = {INT32_MAX}: kernels hold every size "
                             "and coordinate in a 32-bit int")
    for name, shape in (("input", spec.x_shape), ("filter", spec.w_shape), ("output", spec.y_shape)):
        count = shape[0] * shape[1] * shape[2] * shape[3]
        if count > MAX_ELEMENTS:
            raise ValueError(f"the {name} ({' x '.join(map(str, shape))} = {count} elements) must have at most "
                             f"2^62 elements")


@dataclass(frozen=True)
class ConvSpec:
    """A forward 2-D convolution, NCHW input, KCRS filters, NKPQ output, float32."""

    n: int
    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    stride: Pair = (1, 1)
    pad: Quad = (0, 0, 0, 0)
    dilation: Pair = (1, 1)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for field in ("n", "c", "h", "w", "k", "r", "s"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{field.upper()} ({v!r}) must be a positive int")
        for field, vals in (("stride", self.stride), ("dilation", self.dilation)):
            if len(vals) != 2 or any(not isinstance(v, int) or isinstance(v, bool) for v in vals):
                raise ValueError(f"{field} ({vals!r}) must be a pair of ints")
            if any(v <= 0 for v in vals):
                raise ValueError(f"{field} ({vals!r}) must be positive")
        if len(self.pad) != 4:
            raise ValueError(f"padding ({self.pad!r}) must have 4 entries")
        for v in self.pad:
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"padding ({self.pad!r}) must hold ints")
            if v < 0:
                raise ValueError(f"padding ({v!r}) must be >= 0")
        if self.dtype != "float32":
            raise ValueError(f"dtype ({self.dtype!r}) must be float32")
        eff_r, eff_s = self.eff_r, self.eff_s
        hp, wp = self.h + self.pad[0] + self.pad[1], self.w + self.pad[2] + self.pad[3]
        if eff_r > hp or eff_s > wp:
            raise ValueError(
                f"dilated kernel ({eff_r}x{eff_s}) is larger than the padded input ({hp}x{wp})"
            )
        _check_extents(self)

    @classmethod
    def make(
        cls,
        n: int, c: int, h: int, w: int, k: int, r: int, s: int,
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
    ) -> ConvSpec:
        """Build a spec from the loose forms users write (ints or pairs)."""
        return cls(n, c, h, w, k, r, s, _pair("stride", stride), normalize_padding(padding),
                   _pair("dilation", dilation))

    @classmethod
    def from_shapes(
        cls,
        x_shape: Sequence[int],
        w_shape: Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
    ) -> ConvSpec:
        """Spec of conv(x, w) from NCHW and KCRS shapes, checking rank and channels."""
        if len(x_shape) != 4:
            raise ValueError(f"input must have rank 4 (N, C, H, W), got shape {tuple(x_shape)}")
        if len(w_shape) != 4:
            raise ValueError(f"weights must have rank 4 (K, C, R, S), got shape {tuple(w_shape)}")
        n, c, h, w = (int(v) for v in x_shape)
        k, wc, r, s = (int(v) for v in w_shape)
        if wc != c:
            raise ValueError(f"channel mismatch: input has C={c}, weights have C={wc}")
        return cls.make(n, c, h, w, k, r, s, stride, padding, dilation)

    @property
    def eff_r(self) -> int:
        return (self.r - 1) * self.dilation[0] + 1

    @property
    def eff_s(self) -> int:
        return (self.s - 1) * self.dilation[1] + 1

    @property
    def p(self) -> int:
        """Output height."""
        return (self.h + self.pad[0] + self.pad[1] - self.eff_r) // self.stride[0] + 1

    @property
    def q(self) -> int:
        """Output width."""
        return (self.w + self.pad[2] + self.pad[3] - self.eff_s) // self.stride[1] + 1

    @property
    def x_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, self.h, self.w)

    @property
    def w_shape(self) -> tuple[int, int, int, int]:
        return (self.k, self.c, self.r, self.s)

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.k, self.p, self.q)

    @property
    def flops(self) -> int:
        """2·N·K·P·Q·C·R·S: the figure every algorithm is measured by."""
        return 2 * self.n * self.k * self.p * self.q * self.c * self.r * self.s

    @property
    def symmetric_pad(self) -> bool:
        return self.pad[0] == self.pad[1] and self.pad[2] == self.pad[3]

    def key(self) -> str:
        """A stable text key, used in caches and the tuning database."""
        st, pd, dl = self.stride, self.pad, self.dilation
        return (f"n{self.n}c{self.c}h{self.h}w{self.w}k{self.k}r{self.r}s{self.s}"
                f"_st{st[0]}x{st[1]}_pd{pd[0]}.{pd[1]}.{pd[2]}.{pd[3]}_dl{dl[0]}x{dl[1]}_{self.dtype}")

    def short(self) -> str:
        """Human-readable one-liner."""
        return (f"N{self.n} C{self.c} {self.h}x{self.w} -> K{self.k} {self.r}x{self.s}"
                f" /{self.stride[0]}x{self.stride[1]} pad{list(self.pad)} dil{list(self.dilation)}")

    def to_dict(self) -> dict[str, Any]:
        return {"N": self.n, "C": self.c, "H": self.h, "W": self.w, "K": self.k, "R": self.r,
                "S": self.s, "stride": list(self.stride), "pad": list(self.pad),
                "dilation": list(self.dilation)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConvSpec:
        return cls.make(d["N"], d["C"], d["H"], d["W"], d["K"], d["R"], d["S"],
                        d.get("stride", 1), d.get("pad", 0), d.get("dilation", 1))

    @classmethod
    def parse(cls, text: str) -> ConvSpec:
        """Parse 'N=1,C=3,H=13,W=13,K=8,R=3,S=3,stride=1,pad=1,dilation=1' (pad may be 1x1 or 0x1x0x1);
        an unknown, repeated or malformed item is a ValueError naming it (and the nearest known key)."""
        if not isinstance(text, str):
            raise TypeError(f"spec ({text!r}) must be a string such as 'N=1,C=3,H=13,W=13,K=8,R=3,S=3'")
        d: dict[str, Any] = {}
        for item in text.replace(" ", "").split(","):
            if not item:
                continue
            if "=" not in item:
                raise ValueError(f"spec item {item!r} must be KEY=VALUE")
            key, val = item.split("=", 1)
            key = _spec_key(key.strip())
            if key in d:
                raise ValueError(f"spec {text!r} gives {key} twice")
            try:
                parts = [int(v) for v in val.split("x")]
            except ValueError:
                raise ValueError(f"spec item {item!r}: {val!r} must be an integer "
                                 "(or AxB / AxBxCxD for stride, pad and dilation)") from None
            if len(parts) > 1 and key not in _SPEC_TUPLES:
                raise ValueError(f"spec item {item!r}: {key} takes one integer")
            d[key] = parts[0] if len(parts) == 1 else parts
        missing = [f for f in "NCHWKRS" if f not in d]
        if missing:
            raise ValueError(f"spec {text!r} lacks {', '.join(missing)}")
        return cls.from_dict(d)
