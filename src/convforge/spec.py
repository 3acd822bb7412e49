"""ConvSpec: one 2-D convolution, validated, with its output shape and FLOP count."""

from __future__ import annotations

import dataclasses
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
          "output_padding": "an int or a pair of ints",
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


def _int_groups(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"groups ({value!r}) must be a positive int")
    return operator.index(value)


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


# -- F.conv2d's argument forms: string padding, padding modes, unbatched inputs ---------------------
# One place for them, shared by convforge.conv2d, the torch op's wrapper and convforge.torch.Conv2d.

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")  # nn.Conv2d's padding_mode values


def parse_padding_mode(value: Any) -> str:
    """``value`` when it is one of nn.Conv2d's padding modes, else a ValueError naming them."""
    if not isinstance(value, str) or value not in PADDING_MODES:
        raise ValueError(f"padding_mode ({value!r}) must be one of {', '.join(PADDING_MODES)}")
    return value


def conv_padding(padding: Any, kernel: Sequence[int], stride: Any = 1, dilation: Any = 1) -> Quad:
    """(top, bottom, left, right) of a conv: an int, (h, w), a 4-tuple, or PyTorch's strings 'valid'
    (none) and 'same' (the output as large as the input: d*(k-1) in all, the odd one at the
    bottom / right, as PyTorch pads; stride 1 only, as PyTorch requires)."""
    if not isinstance(padding, str):
        return normalize_padding(padding)
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding != "same":
        raise ValueError(f"padding ({padding!r}) must be 'same', 'valid', {_FORMS['padding']}")
    if _pair("stride", stride) != (1, 1):
        raise ValueError(f"padding='same' is not supported for strided convolutions (stride {stride!r}); "
                         "give the padding as numbers")
    dil = _pair("dilation", dilation)
    out: list[int] = []
    for d, k in zip(dil, kernel):
        total = d * (int(k) - 1)
        out += [total // 2, total - total // 2]
    return (out[0], out[1], out[2], out[3])


@dataclass(frozen=True)
class ConvArgs:
    """A conv call's arguments in the forms the kernels take: ``unbatched`` (a (C, H, W) input, run as
    a batch of one), ``pad`` the zero padding the conv itself applies, and ``copy_pad`` the padding a
    padded copy of the input carries first (``mode`` reflect / replicate / circular; None for zeros)."""

    unbatched: bool
    stride: Pair
    pad: Quad
    dilation: Pair
    mode: str = "zeros"
    copy_pad: Quad | None = None


def conv_args(x_shape: Sequence[int], w_shape: Sequence[int], stride: Any = 1, padding: Any = 0,
              dilation: Any = 1, padding_mode: Any = "zeros") -> ConvArgs:
    """F.conv2d's (and nn.Conv2d's) arguments checked and normalised: rank 3 or 4 input, string or
    numeric padding (:func:`conv_padding`), a padding mode of :data:`PADDING_MODES` whose padding
    becomes a padded copy (reflect: each pad smaller than the input's side, circular: at most it,
    as PyTorch requires)."""
    if len(x_shape) not in (3, 4):
        raise ValueError(f"input must have rank 4 (N, C, H, W) or 3 (C, H, W), got shape {tuple(x_shape)}")
    if len(w_shape) != 4:
        raise ValueError(f"weights must have rank 4 (K, C, R, S), got shape {tuple(w_shape)}")
    mode = parse_padding_mode(padding_mode)
    st, dl = _pair("stride", stride), _pair("dilation", dilation)
    pad = conv_padding(padding, tuple(w_shape[2:]), st, dl)
    if any(v < 0 for v in pad):
        raise ValueError(f"padding ({padding!r}) must be >= 0")
    if mode == "zeros" or not any(pad):
        return ConvArgs(len(x_shape) == 3, st, pad, dl)
    h, w = int(x_shape[-2]), int(x_shape[-1])
    for side, size, (before, after) in (("H", h, pad[:2]), ("W", w, pad[2:])):
        worst = max(before, after)
        if mode == "reflect" and worst >= size:
            raise ValueError(f"padding_mode='reflect' needs each padding ({worst}) smaller than the input's "
                             f"{side} ({size})")
        if mode == "circular" and worst > size:
            raise ValueError(f"padding_mode='circular' needs each padding ({worst}) at most the input's "
                             f"{side} ({size})")
    return ConvArgs(len(x_shape) == 3, st, (0, 0, 0, 0), dl, mode, pad)


_TRANSPOSED: dict[tuple[Any, ...], tuple[ConvSpec, int, int]] = {}


def _plain_key(v: Any) -> Any:
    """``v`` itself where it is an int or a tuple of ints (exactly: not a bool), else None."""
    if type(v) is int or (type(v) is tuple and all(type(e) is int for e in v)):
        return v
    return None


def transposed_geometry(x_shape: Sequence[int], w_shape: Sequence[int], stride: Any = 1, padding: Any = 0,
                        output_padding: Any = 0, groups: Any = 1, dilation: Any = 1) -> tuple[ConvSpec, int, int]:
    """:func:`transposed_problem`, remembered for arguments of plain ints and tuples of ints (a warm
    ``conv_transpose2d`` call of a torch module: its validation took most of the call's host time)."""
    args = (x_shape, w_shape, stride, padding, output_padding, groups, dilation)
    key = tuple(_plain_key(tuple(a) if i < 2 and isinstance(a, tuple | list) else a) for i, a in enumerate(args))
    if None in key:
        return transposed_problem(*args)
    hit = _TRANSPOSED.get(key)
    if hit is None:
        hit = transposed_problem(*args)
        if len(_TRANSPOSED) >= 1024:
            _TRANSPOSED.clear()
        _TRANSPOSED[key] = hit
    return hit


def transposed_problem(x_shape: Sequence[int], w_shape: Sequence[int], stride: Any = 1, padding: Any = 0,
                       output_padding: Any = 0, groups: Any = 1, dilation: Any = 1) -> tuple[ConvSpec, int, int]:
    """conv_transpose2d's problem as the dgrad of a forward layer: (spec, extra_h, extra_w). ``x``
    (N, C_in, H, W) is that layer's grad_output, ``w`` (C_in, C_out/groups, R, S) its KCRS filters,
    and its input (N, C_out, H_out, W_out) the transposed conv's output, H_out = (H - 1) * stride -
    top - bottom + dilation * (R - 1) + output_padding + 1 (padding an int, (h, w) or a 4-tuple).
    The forward layer's bottom / right padding is chosen so its output is H x W; where no padding
    >= 0 does that (output_padding - padding >= stride, possible with dilation), the forward output
    is ``extra`` rows / columns larger and ``x`` is read with that many zero rows / columns appended."""
    if len(x_shape) != 4:
        raise ValueError(f"input must have rank 4 (N, C, H, W) or 3 (C, H, W), got shape {tuple(x_shape)}")
    if len(w_shape) != 4:
        raise ValueError(f"weights must have rank 4 (C_in, C_out/groups, R, S), got shape {tuple(w_shape)}")
    st, dl, g = _pair("stride", stride), _pair("dilation", dilation), _int_groups(groups)
    pad = normalize_padding(padding)
    op = _pair("output_padding", output_padding)
    if any(v < 0 for v in pad):
        raise ValueError(f"padding ({padding!r}) must be >= 0")
    for i in (0, 1):
        if op[i] < 0 or (op[i] >= st[i] and op[i] >= dl[i]):
            raise ValueError(f"output_padding ({output_padding!r}) must be >= 0 and smaller than either stride "
                             f"({st[i]}) or dilation ({dl[i]})")
    n, cin, h, w = (int(v) for v in x_shape)
    wk, cout_g, r, s = (int(v) for v in w_shape)
    if wk != cin:
        raise ValueError(f"channel mismatch: input has C={cin}, weights have C_in={wk} (conv_transpose2d's "
                         "weights are C_in x C_out/groups x R x S)")
    if cin % g:
        raise ValueError(f"groups ({g}) must divide C_in ({cin})")
    out, inner, extra = [], [], []
    for size, k, sd, d, (before, after), o in ((h, r, st[0], dl[0], pad[:2], op[0]),
                                                (w, s, st[1], dl[1], pad[2:], op[1])):
        full = (size - 1) * sd + d * (k - 1) + o + 1
        if full - before - after <= 0:
            raise ValueError(f"conv_transpose2d's output would be empty: ({size} - 1) * stride {sd} - padding "
                             f"{before + after} + dilation {d} * ({k} - 1) + output_padding {o} + 1 <= 0")
        lo = after - o  # the forward output is `size` rows for bottom padding in [lo, lo + stride - 1]
        fwd_after = max(lo, 0)
        out.append(full - before - after)
        inner.append((before, fwd_after))
        extra.append((fwd_after - lo) // sd)
    spec = ConvSpec.make(n, cout_g * g, out[0], out[1], cin, r, s, st, (*inner[0], *inner[1]), dl, g,
                         conv_pass="dgrad")
    return spec, extra[0], extra[1]


_SPEC_TUPLES = ("stride", "pad", "dilation")
_SPEC_WORDS = ("groups", "dtype", "pass", "layout")  # optional keys whose value is one word or int
_SPEC_KEYS = tuple("NCHWKRS") + _SPEC_TUPLES + _SPEC_WORDS

# The three passes of a convolution layer, as CUTLASS names them: fprop computes y from x and w;
# dgrad (bprop) the gradient of x from dy and w; wgrad (update) the gradient of w from x and dy.
# Buffers keep their forward names in every pass ("y" holds dy), and each pass writes one of them.
PASSES = ("fprop", "dgrad", "wgrad")
PASS_OUTPUT = {"fprop": "y", "dgrad": "x", "wgrad": "w"}
# Storage dtypes; arithmetic accumulates in float32 whatever the storage.
DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# Memory layouts of the activations (x, y and a residual; filters are always KCRS). Shapes stay
# logical (N, C, H, W) whatever the layout: "nhwc" only says where element (n, c, h, w) lives, as a
# torch tensor in channels_last memory format holds it.
LAYOUTS = ("nchw", "nhwc")


def parse_layout(value: Any) -> str:
    """The layout name for ``value`` ('nchw', 'nhwc'; 'channels_last' as nhwc's alias)."""
    name = {"channels_last": "nhwc", "channels_first": "nchw"}.get(str(value).lower(), str(value).lower())
    if name not in LAYOUTS:
        raise ValueError(f"layout ({value!r}) must be one of {', '.join(LAYOUTS)}")
    return name
_DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def parse_dtype(value: Any) -> str:
    """The canonical dtype name for ``value`` ('fp16', 'float16', numpy.float16, torch.float16, ...)."""
    name = str(getattr(value, "name", None) or value).replace("torch.", "").lower()
    if name == "<class 'numpy.float16'>":
        name = "float16"
    elif name.startswith("<class 'numpy."):
        name = name[len("<class 'numpy."):-2]
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"dtype ({value!r}) must be one of float32, float16, bfloat16 "
                         "(or fp32, fp16, bf16)") from None


def parse_pass(value: Any) -> str:
    """``value`` when it names a pass (fprop, dgrad, wgrad; bprop and update as their aliases)."""
    name = {"bprop": "dgrad", "update": "wgrad", "forward": "fprop"}.get(str(value), str(value))
    if name not in PASSES:
        raise ValueError(f"pass ({value!r}) must be one of {', '.join(PASSES)}")
    return name


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


_DICT_KEYS = frozenset({"N", "C", "H", "W", "K", "R", "S", "stride", "pad", "dilation", "groups", "dtype", "pass",
                        "layout"})


@dataclass(frozen=True)
class ConvSpec:
    """One pass of a 2-D convolution layer: NCHW input, KCRS filters (C/groups channels each), NKPQ
    output, stored as ``dtype``; ``conv_pass`` says which of x, w, y is computed from the other two;
    ``layout`` where the activations' elements live (shapes stay NCHW: LAYOUTS)."""

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
    groups: int = 1
    conv_pass: str = "fprop"
    layout: str = "nchw"

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
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype ({self.dtype!r}) must be one of {', '.join(DTYPES)}")
        if self.conv_pass not in PASSES:
            raise ValueError(f"pass ({self.conv_pass!r}) must be one of {', '.join(PASSES)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout ({self.layout!r}) must be one of {', '.join(LAYOUTS)}")
        g = self.groups
        if not isinstance(g, int) or isinstance(g, bool) or g <= 0:
            raise ValueError(f"groups ({g!r}) must be a positive int")
        if self.c % g or self.k % g:
            raise ValueError(f"groups ({g}) must divide both C ({self.c}) and K ({self.k})")
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
        groups: int = 1,
        dtype: Any = "float32",
        conv_pass: str = "fprop",
        layout: str = "nchw",
    ) -> ConvSpec:
        """Build a spec from the loose forms users write (ints or pairs, dtype and pass aliases)."""
        return cls(n, c, h, w, k, r, s, _pair("stride", stride), normalize_padding(padding),
                   _pair("dilation", dilation), parse_dtype(dtype), _int_groups(groups),
                   parse_pass(conv_pass), parse_layout(layout))

    @classmethod
    def from_shapes(
        cls,
        x_shape: Sequence[int],
        w_shape: Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        dtype: Any = "float32",
        conv_pass: str = "fprop",
        layout: str = "nchw",
    ) -> ConvSpec:
        """Spec of conv(x, w) from NCHW and KCRS shapes, checking rank and channels (the filters
        hold C/groups channels each)."""
        if len(x_shape) != 4:
            raise ValueError(f"input must have rank 4 (N, C, H, W), got shape {tuple(x_shape)}")
        if len(w_shape) != 4:
            raise ValueError(f"weights must have rank 4 (K, C, R, S), got shape {tuple(w_shape)}")
        n, c, h, w = (int(v) for v in x_shape)
        k, wc, r, s = (int(v) for v in w_shape)
        g = _int_groups(groups)
        if wc * g != c:
            per = f" (C/groups with groups={g})" if g > 1 else ""
            hint = f"; a grouped layer needs groups={c // wc}" if g == 1 and wc and c % wc == 0 else ""
            raise ValueError(f"channel mismatch: input has C={c}, weights have C={wc}, expected {c // g}{per}{hint}"
                             if c % g == 0 else f"groups ({g}) must divide C ({c})")
        return cls.make(n, c, h, w, k, r, s, stride, padding, dilation, g, dtype, conv_pass, layout)

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
        return (self.k, self.c // self.groups, self.r, self.s)

    @property
    def cg(self) -> int:
        """Input channels per group (C for an ungrouped layer)."""
        return self.c // self.groups

    @property
    def kg(self) -> int:
        """Output channels per group."""
        return self.k // self.groups

    @property
    def depthwise(self) -> bool:
        """One input channel per group (groups == C): MobileNet's and ConvNeXt's 3x3 to 7x7 layers."""
        return self.groups == self.c and self.groups > 1

    @property
    def itemsize(self) -> int:
        """Bytes per stored element."""
        return ITEMSIZE[self.dtype]

    @property
    def output(self) -> str:
        """The buffer this pass writes: "y" (fprop), "x" (dgrad) or "w" (wgrad)."""
        return PASS_OUTPUT[self.conv_pass]

    def shape_of(self, buffer: str) -> tuple[int, ...]:
        """Shape of a conv buffer by name (x, w, y, bias, res: the pass's output's, y or dgrad's dx)."""
        return {"x": self.x_shape, "w": self.w_shape, "y": self.y_shape, "bias": (self.k,),
                "res": self.x_shape if self.conv_pass == "dgrad" else self.y_shape}[buffer]

    def with_pass(self, conv_pass: str) -> ConvSpec:
        """The same layer, another pass."""
        return dataclasses.replace(self, conv_pass=parse_pass(conv_pass))

    def with_batch(self, n: int) -> ConvSpec:
        """The same problem on ``n`` images."""
        return dataclasses.replace(self, n=n)

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.k, self.p, self.q)

    @property
    def flops(self) -> int:
        """2·N·K·P·Q·(C/groups)·R·S: the figure every algorithm and every pass is measured by."""
        return 2 * self.n * self.k * self.p * self.q * self.cg * self.r * self.s

    @property
    def symmetric_pad(self) -> bool:
        return self.pad[0] == self.pad[1] and self.pad[2] == self.pad[3]

    def key(self) -> str:
        """A stable text key, used in caches and the tuning database."""
        st, pd, dl = self.stride, self.pad, self.dilation
        # groups and pass appear only when they are not the defaults, so forward keys stay as they were
        extra = (f"_g{self.groups}" if self.groups > 1 else "") + (
            f"_{self.conv_pass}" if self.conv_pass != "fprop" else "") + (
            f"_{self.layout}" if self.layout != "nchw" else "")
        return (f"n{self.n}c{self.c}h{self.h}w{self.w}k{self.k}r{self.r}s{self.s}"
                f"_st{st[0]}x{st[1]}_pd{pd[0]}.{pd[1]}.{pd[2]}.{pd[3]}_dl{dl[0]}x{dl[1]}_{self.dtype}{extra}")

    def short(self) -> str:
        """Human-readable one-liner."""
        extra = (f" g{self.groups}" if self.groups > 1 else "") + (
            f" {self.dtype}" if self.dtype != "float32" else "") + (
            f" {self.conv_pass}" if self.conv_pass != "fprop" else "") + (
            f" {self.layout}" if self.layout != "nchw" else "")
        return (f"N{self.n} C{self.c} {self.h}x{self.w} -> K{self.k} {self.r}x{self.s}"
                f" /{self.stride[0]}x{self.stride[1]} pad{list(self.pad)} dil{list(self.dilation)}{extra}")

    def to_dict(self) -> dict[str, Any]:
        """The layer as JSON-ready values; groups, dtype and pass only when not the defaults."""
        d: dict[str, Any] = {"N": self.n, "C": self.c, "H": self.h, "W": self.w, "K": self.k, "R": self.r,
                             "S": self.s, "stride": list(self.stride), "pad": list(self.pad),
                             "dilation": list(self.dilation)}
        if self.groups > 1:
            d["groups"] = self.groups
        if self.dtype != "float32":
            d["dtype"] = self.dtype
        if self.conv_pass != "fprop":
            d["pass"] = self.conv_pass
        if self.layout != "nchw":
            d["layout"] = self.layout
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConvSpec:
        """The spec of :meth:`to_dict`'s form; a key it does not know is a ValueError (a misspelt
        "pass" would otherwise give a forward spec)."""
        unknown = sorted(set(d) - _DICT_KEYS)
        if unknown:
            raise ValueError(f"spec keys {unknown} unknown (known: {', '.join(sorted(_DICT_KEYS))})")
        return cls.make(d["N"], d["C"], d["H"], d["W"], d["K"], d["R"], d["S"],
                        d.get("stride", 1), d.get("pad", 0), d.get("dilation", 1), d.get("groups", 1),
                        d.get("dtype", "float32"), d.get("pass", "fprop"), d.get("layout", "nchw"))

    @classmethod
    def parse(cls, text: str) -> ConvSpec:
        """Parse 'N=1,C=3,H=13,W=13,K=8,R=3,S=3,stride=1,pad=1,dilation=1' (pad may be 1x1 or 0x1x0x1;
        optional groups=G, dtype=fp16|bf16|fp32, pass=fprop|dgrad|wgrad, layout=nchw|nhwc);
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
            if key in ("dtype", "pass", "layout"):
                d[key] = {"dtype": parse_dtype, "pass": parse_pass, "layout": parse_layout}[key](val)
                continue
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
