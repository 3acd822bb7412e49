"""Squeeze-and-excitation in training: pool, the two 1x1 layers and the gate, and the scale, in 3 kernels
forward and 4 backward.

EfficientNet's, MobileNet-v3's and RegNetY's blocks end with torchvision's ``SqueezeExcitation``:

    s = gate(W2 act(W1 mean_hw(x) + b1) + b2),    y = s * x        (s per sample and channel)

with act ReLU or SiLU and gate sigmoid or hardsigmoid. PyTorch runs it as ~11 operators forward (the pool,
two convs with their autocast casts of weight and bias, the activations, a broadcast multiply) and ~20
backward, each a launch and, under autograd, a node: on a host-bound AMP step (EfficientNet-B0 N128 on an
H200: 38 ms of host work for 19 ms of GPU time) that is a third of the launches. Here, x channels-last
(N, H*W, C) or NCHW (N, C, H*W: the reductions then run along each plane):

forward   pool     block (j, tile, n): slice j of sample n's H*W rows, a tile of channels; sums of x into
                   "part" (slices x N x C, float32)
          mlp      block n: p = the slices' sums in a fixed order / (H*W); u = W1 p + b1; a = W2 act(u) + b2;
                   g = gate(a), each dot product split over the block's threads and summed in a fixed tree;
                   p, u, a and g kept in "sv" for the backward
          scale    y = x * g, 4 channels a thread where C is a multiple of 4
backward  reduce   as pool, with the sums of gy * x (the gradient of g)
          mlp_bwd  block n: ga = that sum * gate'(a); gu = (W2^T ga) * act'(u); gp = (W1^T gu) / (H*W)
                   into "bs"
          wgrad    one thread an output of dW1, db1, dW2, db2: the sum over the batch in sample order,
                   stored in the parameters' dtype (float32 master weights under autocast: no cast either way)
          dx       gx = gy * g + gp

Every sum is in a fixed order (runs are bit-identical); everything between x and y is float32 (PyTorch's
autocast rounds the pooled means, the layers' outputs and the gate to the half dtype; these keep float32,
so they sit closer to the float64 reference). Inf and NaN propagate, as a GradScaler needs.
Storage: x, y, gy, gx float32, float16 or bfloat16; the weights (W1 as S x C, W2 as C x S: the 1x1
convs' (S, C, 1, 1) and (C, S, 1, 1) filters as they lie) float32 or the activations' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from convforge.codegen.dialect import Buf, Kernel, Storage
from convforge.codegen.meta import Code, cdiv, fl, halving_tree
from convforge.codegen.render import render
from convforge.plan import DeviceInfo, Launch

NAME = "se_train"
BLOCK = 256  # threads of the elementwise kernels, the mlp and the wgrad
ACTS = ("relu", "silu")
GATES = ("sigmoid", "hardsigmoid")
DTYPES = ("float32", "float16", "bfloat16")
_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
MAX_C = 4096  # channels (and squeezed channels) the mlp keeps in shared memory: 16 KB of floats each


@dataclass(frozen=True)
class SeTrain:
    """One squeeze-and-excitation: x of N x C x (H*W) channels-last in ``dtype``, S squeezed channels,
    the activation between the layers and the gate; the weights and biases in ``pdtype``."""

    n: int
    c: int
    hw: int
    s: int
    act: str = "relu"
    gate: str = "sigmoid"
    dtype: str = "float32"
    pdtype: str = "float32"
    layout: str = "nhwc"  # or "nchw": x, y, gy and gx as (N, C, H*W)

    def __post_init__(self) -> None:
        if min(self.n, self.c, self.hw, self.s) < 1:
            raise ValueError(f"{NAME}: N ({self.n}), C ({self.c}), H*W ({self.hw}) and S ({self.s}) must be >= 1")
        if self.c > MAX_C or self.s > MAX_C:
            raise ValueError(f"{NAME}: C ({self.c}) and S ({self.s}) must be at most {MAX_C} (shared memory)")
        if self.act not in ACTS or self.gate not in GATES:
            raise ValueError(f"{NAME}: activation ({self.act!r}) must be one of {ACTS} and gate ({self.gate!r}) "
                             f"one of {GATES}")
        if self.layout not in ("nhwc", "nchw"):
            raise ValueError(f"{NAME}: layout ({self.layout!r}) must be 'nhwc' or 'nchw'")
        if self.dtype not in DTYPES or self.pdtype not in ("float32", self.dtype):
            raise ValueError(f"{NAME}: activations' dtype ({self.dtype}) must be one of {', '.join(DTYPES)} and "
                             f"the weights' ({self.pdtype}) float32 or the same")

    @property
    def total(self) -> int:
        return self.n * self.hw * self.c

    @property
    def nhwc(self) -> bool:
        return self.layout == "nhwc"

    @property
    def v(self) -> int:
        """Values a thread of the elementwise and reduction kernels takes at once: 4 channels where C is a
        multiple of 4 (NHWC), 4 pixels of a plane where H*W is (NCHW); else 1."""
        return 4 if (self.c if self.nhwc else self.hw) % 4 == 0 else 1

    @property
    def sv(self) -> int:
        """Floats of "sv": p, u, a and g."""
        return self.n * (3 * self.c + self.s)

    @property
    def bs(self) -> int:
        """Floats of "bs": ga, gu and gp."""
        return self.n * (2 * self.c + self.s)

    def tag(self) -> str:
        p = "" if self.pdtype == "float32" else "p"
        return (f"{self.n}x{self.c}x{self.hw}_s{self.s}_{self.act}_{self.gate}_{_SHORT[self.dtype]}{p}"
                + ("" if self.nhwc else "_nchw"))


@dataclass(frozen=True)
class SeProgram:
    """The kernels and their launches; ``part`` floats of scratch for the slices' sums."""

    kernels: tuple[Kernel, ...]
    forward: tuple[Launch, ...]
    backward: tuple[Launch, ...]
    part: int


def _threads(device: DeviceInfo) -> int:
    return min(256 if device.is_gpu else 64, device.max_threads)


def slices(se: SeTrain, device: DeviceInfo) -> int:
    """Row slices a sample's reduction takes: on GPUs enough blocks for four a compute unit, each over 64
    rows at least; one on CPUs."""
    if not device.is_gpu:
        return 1
    tiles = cdiv(se.c // se.v, min(se.c // se.v, 32)) if se.nhwc else cdiv(se.c, _plane_shape(se, _threads(device))[0])
    return max(1, min(cdiv(4 * max(device.units, 1), se.n * tiles), se.hw // 64))


def _plane_shape(se: SeTrain, bt: int) -> tuple[int, int]:
    """NCHW reduction blocks: (channels a block, threads a plane: a power of 2 up to the plane's vectors)."""
    trn = min(bt, 1 << (max(se.hw // se.v, 1) - 1).bit_length())
    return bt // trn, trn


def se_program(se: SeTrain, device: DeviceInfo, sp: int | None = None) -> SeProgram:
    """The forward and backward launches of ``se`` on ``device`` (``sp`` row slices a sample: ``slices``)."""
    sp = slices(se, device) if sp is None else sp
    if not 1 <= sp <= se.hw:
        raise ValueError(f"{NAME}: slices ({sp}) must be in 1..{se.hw} (H*W)")
    bt = _threads(device)
    ix = "I64" if se.total > 2**31 - 1 else "int"
    if se.nhwc:
        cv = se.c // se.v
        tc = min(cv, 32)
        tr = 1 << (max(bt // tc, 1).bit_length() - 1)
        pool, red = _rows_kernel(se, False, sp, tc, tr, ix), _rows_kernel(se, True, sp, tc, tr, ix)
        rgrid, rblock = (sp, cdiv(cv, tc), se.n), (tc * tr, 1, 1)
    else:
        tcn, trn = _plane_shape(se, bt)
        pool, red = _planes_kernel(se, False, sp, tcn, trn, ix), _planes_kernel(se, True, sp, tcn, trn, ix)
        rgrid, rblock = (sp, cdiv(se.c, tcn), se.n), (tcn * trn, 1, 1)
    mlp, mlp_bwd, wgrad = _mlp_kernel(se, sp, bt), _mlp_bwd_kernel(se, sp, bt), _wgrad_kernel(se)
    scale, dx = _elementwise_kernel(se, False, ix), _elementwise_kernel(se, True, ix)
    egrid = (cdiv(se.total // se.v, BLOCK), 1, 1)
    outs = 2 * se.s * se.c + se.s + se.c

    def launch(k: Kernel, grid: tuple[int, int, int], block: tuple[int, int, int]) -> Launch:
        return Launch(k.name, grid, block, tuple(a.name for a in k.args if isinstance(a, Buf)))

    fwd = (launch(pool, rgrid, rblock), launch(mlp, (se.n, 1, 1), (bt, 1, 1)),
           launch(scale, egrid, (BLOCK, 1, 1)))
    bwd = (launch(red, rgrid, rblock), launch(mlp_bwd, (se.n, 1, 1), (bt, 1, 1)),
           launch(wgrad, (cdiv(outs, BLOCK), 1, 1), (BLOCK, 1, 1)), launch(dx, egrid, (BLOCK, 1, 1)))
    return SeProgram((pool, mlp, scale, red, mlp_bwd, wgrad, dx), fwd, bwd, sp * se.n * se.c)


def _prefix(se: SeTrain) -> str:
    return f"{NAME}_{se.tag()}"


def _lanes(v: int) -> tuple[str, ...]:
    return (".x", ".y", ".z", ".w") if v == 4 else ("",)


def _rows_kernel(se: SeTrain, bwd: bool, sp: int, tc: int, tr: int, ix: str) -> Kernel:
    """Block (j, tile, n): thread (tx, ty) adds rows ty, ty + tr, ... of slice j of sample n for its v
    channels (x, or gy * x backward), the tile's rows summed in a fixed tree; into part[(j N + n) C + c]."""
    s, v, w = Storage(se.dtype), se.v, tc * se.v
    cv, per = se.c // v, cdiv(se.hw, sp)
    lanes = _lanes(v)
    load = (lambda p: s.vload4("0", f"{p} + at")) if v == 4 else (lambda p: s.load(p, "at"))
    ft = "float4" if v == 4 else "float"
    code = Code()
    code(f"SHARED float r[{tr * w}];", "const int t = LOCAL_ID(0), j = GROUP_ID(0), n = GROUP_ID(2);",
         f"const int tx = t % {tc}, ty = t / {tc}, cw = GROUP_ID(1) * {tc} + tx;",
         f"const int ok = cw < {cv}, c = ok ? cw * {v} : 0;",
         f"const int e1 = ok ? min((j + 1) * {per}, {se.hw}) : 0;",
         "float " + ", ".join(f"a{i} = 0.0f" for i in range(v)) + ";")
    with code.block(f"for (int q = j * {per} + ty; q < e1; q += {tr})"):
        code(f"const {ix} at = (({ix})n * {se.hw} + q) * {se.c} + c;", f"const {ft} xv = {load('x')};")
        if bwd:
            code(f"const {ft} gv = {load('gy')};")
            code(*[f"a{i} += gv{lane} * xv{lane};" for i, lane in enumerate(lanes)])
        else:
            code(*[f"a{i} += xv{lane};" for i, lane in enumerate(lanes)])
    at = [f"t * {v} + {i}" if v > 1 else "t" for i in range(v)]
    code(*[f"r[{at[i]}] = a{i};" for i in range(v)], "BARRIER();")
    half = tr // 2
    while half >= 1:
        with code.block(f"if (ty < {half})"):
            code(*[f"r[{at[i]}] += r[{at[i]} + {half * w}];" for i in range(v)])
        code("BARRIER();")
        half //= 2
    with code.block("if (ty == 0 && ok)"):
        code(*[f"part[(j * {se.n} + n) * {se.c} + c + {i}] = r[{at[i]}];" for i in range(v)])
    args = (s.buf("x"), *((s.buf("gy"),) if bwd else ()), Buf("part", readonly=False))
    what = "sums of gy * x" if bwd else "sums of x"
    return Kernel(f"{_prefix(se)}_{'reduce' if bwd else 'pool'}", args, code.text(), (tc * tr, 1, 1),
                  comment=f"{NAME}: {what} per (slice of rows, channel tile, sample), {sp} slice(s), "
                          f"{tc} x {tr} threads, {v} channel(s) a thread")


def _planes_kernel(se: SeTrain, bwd: bool, sp: int, tcn: int, trn: int, ix: str) -> Kernel:
    """NCHW, block (j, channel group, n): ``tcn`` channels a block, ``trn`` threads a plane adding its vectors
    of v pixels in slice j (a fixed tree over the trn threads after), into part[(j N + n) C + c]."""
    s, v = Storage(se.dtype), se.v
    vec = se.hw // v
    per = cdiv(vec, sp)
    load = (lambda p: s.vload4("0", f"{p} + at")) if v == 4 else (lambda p: s.load(p, "at"))
    ft = "float4" if v == 4 else "float"
    lanes = _lanes(v)
    code = Code()
    code(f"SHARED float r[{tcn * trn}];", "const int t = LOCAL_ID(0), j = GROUP_ID(0), n = GROUP_ID(2);",
         f"const int ci = t / {trn}, tr = t % {trn}, c = GROUP_ID(1) * {tcn} + ci;",
         f"const int e1 = c < {se.c} ? min((j + 1) * {per}, {vec}) : 0;", "float a = 0.0f;")
    with code.block(f"for (int q = j * {per} + tr; q < e1; q += {trn})"):
        code(f"const {ix} at = (({ix})n * {se.c} + c) * {se.hw} + q * {v};", f"const {ft} xv = {load('x')};")
        if bwd:
            code(f"const {ft} gv = {load('gy')};",
                 "a += " + " + ".join(f"gv{lane} * xv{lane}" for lane in lanes) + ";")
        else:
            code("a += " + " + ".join(f"xv{lane}" for lane in lanes) + ";")
    code("r[t] = a;", "BARRIER();")
    halving_tree(code, trn, "tr", lambda h: f"r[t] += r[t + {h}];")
    code(f"if (tr == 0 && c < {se.c}) part[(j * {se.n} + n) * {se.c} + c] = r[t];")
    args = (s.buf("x"), *((s.buf("gy"),) if bwd else ()), Buf("part", readonly=False))
    what = "sums of gy * x" if bwd else "sums of x"
    return Kernel(f"{_prefix(se)}_{'reduce' if bwd else 'pool'}", args, code.text(), (tcn * trn, 1, 1),
                  comment=f"{NAME}: {what} per (slice of a plane, channel, sample), {sp} slice(s), {tcn} channel(s) "
                          f"x {trn} threads, {v} pixel(s) a thread")


def _act(se: SeTrain, u: str) -> str:
    return f"SILU({u})" if se.act == "silu" else f"RELU({u})"


def _dact(se: SeTrain, u: str, g: str) -> str:
    """The gradient ``g`` behind the activation at ``u``: PyTorch's silu_backward, or ReLU's mask (its
    threshold_backward on the output: zero where act(u) <= 0, NaN u included)."""
    return f"({g}) * DSILU({u})" if se.act == "silu" else f"(({u}) > 0.0f ? ({g}) : 0.0f)"


def _gate(se: SeTrain, a: str) -> str:
    if se.gate == "sigmoid":
        return f"1.0f / (1.0f + exp(-({a})))"
    t = f"RELU(({a}) + 3.0f)"  # NaN kept, as PyTorch's hardsigmoid keeps it
    return f"({t} > 6.0f ? 6.0f : {t}) / 6.0f"


def _dgate(se: SeTrain, a: str, g: str, gs: str) -> str:
    """The gradient ``gs`` behind the gate at ``a`` (``g`` its value): sigmoid's g (1 - g), hardsigmoid's
    1/6 inside (-3, 3), as PyTorch's hardsigmoid_backward."""
    if se.gate == "sigmoid":
        return f"({gs}) * ({g}) * (1.0f - ({g}))"
    return f"(({a}) > -3.0f && ({a}) < 3.0f ? ({gs}) / 6.0f : 0.0f)"


def _dots(code: Code, se: SeTrain, bt: int, rows: int, length: int, term: str, out: str) -> None:
    """``out``(i, sum) for i < ``rows``: sum = the dot product sum over k < ``length`` of ``term``(i, k), split
    over the block: kk = K threads (a power of 2) a row add k = kk, kk + K, ..., then a fixed tree over kk
    through shared memory "rd"; rows in rounds of bt / K."""
    k = max(1, bt // (1 << (rows - 1).bit_length()))
    per = bt // k
    with code.block(f"for (int i0 = 0; i0 < {rows}; i0 += {per})"):
        code(f"const int kk = t % {k}, i = i0 + t / {k};", "float acc = 0.0f;")
        with code.block(f"if (i < {rows})"):
            code(f"for (int k = kk; k < {length}; k += {k}) acc += {term};")
        code("rd[t] = acc;", "BARRIER();")
        halving_tree(code, k, "kk", lambda h: f"rd[t] += rd[t + {h}];")
        with code.block(f"if (kk == 0 && i < {rows})"):
            code(out)
        code("BARRIER();")


def _mlp_kernel(se: SeTrain, sp: int, bt: int) -> Kernel:
    """Block n: p from the slices' sums, u = W1 p + b1, a = W2 act(u) + b2, g = gate(a) (module docstring)."""
    p = Storage(se.pdtype)
    n, c, s = "GROUP_ID(0)", se.c, se.s
    code = Code()
    code(f"SHARED float P[{c}];", f"SHARED float H[{s}];", f"SHARED float rd[{bt}];",
         f"const int t = LOCAL_ID(0), n = {n};")
    with code.block(f"for (int c = t; c < {c}; c += {bt})"):
        code("float a = 0.0f;", f"for (int j = 0; j < {sp}; ++j) a += part[(j * {se.n} + n) * {c} + c];",
             f"P[c] = a / {fl(se.hw)};", f"sv[n * {c} + c] = P[c];")
    code("BARRIER();")
    u_at = f"{se.n * c} + n * {s} + i"
    _dots(code, se, bt, s, c, p.load("w1", "i * " + str(c) + " + k") + " * P[k]",
          f"const float u = rd[t] + {p.load('b1', 'i')}; sv[{u_at}] = u; H[i] = {_act(se, 'u')};")
    with code.block(f"for (int c = t; c < {c}; c += {bt})"):
        code("float a = " + p.load("b2", "c") + ";",
             f"for (int k = 0; k < {s}; ++k) a += {p.load('w2', f'c * {s} + k')} * H[k];",
             f"sv[{se.n * (c + s)} + n * {c} + c] = a;",
             f"sv[{se.n * (2 * c + s)} + n * {c} + c] = {_gate(se, 'a')};")
    args = (Buf("part"), p.buf("w1"), p.buf("b1"), p.buf("w2"), p.buf("b2"), Buf("sv", readonly=False))
    return Kernel(f"{_prefix(se)}_mlp", args, code.text(), (bt, 1, 1),
                  comment=f"{NAME}: the means, the two layers and the gate of a sample, {sp} slice(s), {bt} threads")


def _mlp_bwd_kernel(se: SeTrain, sp: int, bt: int) -> Kernel:
    """Block n: ga = (sum of gy x) gate'(a), gu = (W2^T ga) act'(u), gp = (W1^T gu) / (H*W) into "bs"."""
    p = Storage(se.pdtype)
    c, s, nn = se.c, se.s, se.n
    code = Code()
    code(f"SHARED float GA[{c}];", f"SHARED float GU[{s}];", f"SHARED float rd[{bt}];",
         "const int t = LOCAL_ID(0), n = GROUP_ID(0);")
    with code.block(f"for (int c = t; c < {c}; c += {bt})"):
        code("float gs = 0.0f;", f"for (int j = 0; j < {sp}; ++j) gs += part[(j * {nn} + n) * {c} + c];",
             f"const float a = sv[{nn * (c + s)} + n * {c} + c], g = sv[{nn * (2 * c + s)} + n * {c} + c];",
             f"GA[c] = {_dgate(se, 'a', 'g', 'gs')};", f"bs[n * {c} + c] = GA[c];")
    code("BARRIER();")
    _dots(code, se, bt, s, c, p.load("w2", f"k * {s} + i") + " * GA[k]",
          f"const float u = sv[{nn * c} + n * {s} + i], gu = {_dact(se, 'u', 'rd[t]')}; GU[i] = gu; "
          f"bs[{nn * c} + n * {s} + i] = gu;")
    with code.block(f"for (int c = t; c < {c}; c += {bt})"):
        code("float a = 0.0f;", f"for (int k = 0; k < {s}; ++k) a += {p.load('w1', f'k * {c} + c')} * GU[k];",
             f"bs[{nn * (c + s)} + n * {c} + c] = a / {fl(se.hw)};")
    args = (Buf("part"), p.buf("w1"), p.buf("w2"), Buf("sv"), Buf("bs", readonly=False))
    return Kernel(f"{_prefix(se)}_mlp_bwd", args, code.text(), (bt, 1, 1),
                  comment=f"{NAME}: the gate's, the layers' and the mean's gradients of a sample, {bt} threads")


def _wgrad_kernel(se: SeTrain) -> Kernel:
    """One thread an output: dW1[s, c] = sum_n gu[n, s] p[n, c], db1[s] = sum_n gu[n, s], dW2[c, s] = sum_n
    ga[n, c] act(u[n, s]), db2[c] = sum_n ga[n, c], n in order."""
    p = Storage(se.pdtype)
    c, s, nn = se.c, se.s, se.n
    gu, u = f"bs[{nn * c} + n * {s} + i]", f"sv[{nn * c} + n * {s} + i]"
    code = Code()
    code(f"const int o = GROUP_ID(0) * {BLOCK} + LOCAL_ID(0);", "float a = 0.0f;")
    with code.block(f"if (o < {s * c})"):
        code(f"const int i = o / {c}, k = o % {c};",
             f"for (int n = 0; n < {nn}; ++n) a += {gu} * sv[n * {c} + k];", p.store("gw1", "o", "a") + ";")
    with code.block(f"else if (o < {s * c + s})"):
        code(f"const int i = o - {s * c};", f"for (int n = 0; n < {nn}; ++n) a += {gu};",
             p.store("gb1", "i", "a") + ";")
    with code.block(f"else if (o < {2 * s * c + s})"):
        code(f"const int e = o - {s * c + s}, k = e / {s}, i = e % {s};",
             f"for (int n = 0; n < {nn}; ++n) {{ const float uu = {u}; a += bs[n * {c} + k] * {_act(se, 'uu')}; }}",
             p.store("gw2", "e", "a") + ";")
    with code.block(f"else if (o < {2 * s * c + s + c})"):
        code(f"const int k = o - {2 * s * c + s};", f"for (int n = 0; n < {nn}; ++n) a += bs[n * {c} + k];",
             p.store("gb2", "k", "a") + ";")
    args = (Buf("sv"), Buf("bs"), p.buf("gw1", readonly=False), p.buf("gb1", readonly=False),
            p.buf("gw2", readonly=False), p.buf("gb2", readonly=False))
    return Kernel(f"{_prefix(se)}_wgrad", args, code.text(), (BLOCK, 1, 1),
                  comment=f"{NAME}: the layers' weight and bias gradients, summed over the batch in order")


def _elementwise_kernel(se: SeTrain, bwd: bool, ix: str) -> Kernel:
    """y = x * g (forward) or gx = gy * g + gp (backward), v channels a thread."""
    s, v = Storage(se.dtype), se.v
    cv = se.c // v
    lanes = _lanes(v)
    g_at = f"{se.n * (2 * se.c + se.s)} + nc"
    code = Code()
    code(f"const {ix} e = ({ix})GROUP_ID(0) * {BLOCK} + LOCAL_ID(0);", f"if (e >= {se.total // v}) return;")
    if se.nhwc:
        code(f"const int nc = (int)(e / {se.hw * cv}) * {se.c} + (int)(e % {cv}) * {v};  // n C + c")
    else:
        code(f"const int nc = (int)(e / {se.hw // v});  // n C + c: the plane's")
    ld = (lambda p: s.vload4("e", p)) if v == 4 else (lambda p: s.load(p, "e"))
    ft = "float4" if v == 4 else "float"
    src = "gy" if bwd else "x"
    code(f"const {ft} xv = {ld(src)};")
    outs = []
    for i, lane in enumerate(lanes):
        k = f" + {i}" if se.nhwc else ""  # NHWC: lane i is channel c + i; NCHW: every lane is the plane's channel
        val = f"xv{lane} * sv[{g_at}{k}]"
        outs.append(f"FMA(xv{lane}, sv[{g_at}{k}], bs[{se.n * (se.c + se.s)} + nc{k}])" if bwd else val)
    dst = "gx" if bwd else "y"
    unit = "channel" if se.nhwc else "pixel"
    code(s.vstore4(f"MAKE_FLOAT4({', '.join(outs)})", "e", dst) + ";" if v == 4 else s.store(dst, "e", outs[0]) + ";")
    args = (s.buf(src), Buf("sv"), *((Buf("bs"),) if bwd else ()), s.buf(dst, readonly=False))
    return Kernel(f"{_prefix(se)}_{'dx' if bwd else 'scale'}", args, code.text(), (BLOCK, 1, 1),
                  comment=f"{NAME}: {'gx = gy * g + gp' if bwd else 'y = x * g'}, {v} {unit}(s) a thread")


def title(se: SeTrain) -> str:
    return f"squeeze-and-excitation (training) {se.tag()}"


def source(se: SeTrain, backend: str, sp: int = 2) -> str:
    """The program's source for ``backend`` on a GPU of 256-thread blocks, ``sp`` slices a sample (snapshots)."""
    return render(list(se_program(se, DeviceInfo(backend, "nominal GPU"), sp).kernels), backend, title(se))


_SIZES = {"w1": "sc", "gw1": "sc", "w2": "sc", "gw2": "sc", "b1": "s", "gb1": "s", "b2": "c", "gb2": "c"}
PARAMS = ("w1", "b1", "w2", "b2", "gw1", "gb1", "gw2", "gb2")


def sizes(se: SeTrain, prog: SeProgram) -> dict[str, int]:
    """Elements of every buffer the launches name."""
    per = {"sc": se.s * se.c, "s": se.s, "c": se.c}
    out = {name: per[k] for name, k in _SIZES.items()}
    out.update(x=se.total, y=se.total, gy=se.total, gx=se.total, part=prog.part, sv=se.sv, bs=se.bs)
    return out


def host_run(backend: Any, se: SeTrain, which: str, arrays: dict[str, np.ndarray],
             prog: SeProgram | None = None) -> dict[str, np.ndarray]:
    """Run the ``which`` ("forward" / "backward") launches on ``backend`` with NumPy inputs (tests, the OpenCL
    path): x and gy channels-last (N, H*W, C), the weights as S x C and C x S; every buffer the inputs lack
    is poisoned with NaN first; every buffer comes back as float32, flat."""
    from convforge.dtypes import to_storage
    from convforge.kernels.common import launch_all, poisoned

    prog = prog if prog is not None else se_program(se, backend.device)
    launches = prog.forward if which == "forward" else prog.backward
    program = backend.program(render(list(prog.kernels), backend.name, title(se)))
    count = sizes(se, prog)

    def dtype(name: str) -> str:
        return se.pdtype if name in PARAMS else se.dtype if name in ("x", "y", "gy", "gx") else "float32"

    bufs: dict[str, Any] = {}
    for name in (str(a) for step in launches for a in step.args):
        if name in bufs:
            continue
        if name in arrays:
            bufs[name] = backend.upload(to_storage(np.ascontiguousarray(arrays[name], np.float32).ravel(), dtype(name)))
        else:
            bufs[name] = poisoned(backend, count[name], dtype(name))
    launch_all(backend, program, prog.kernels, launches, bufs)
    return {name: backend.download(buf, (count[name],), dtype(name)) for name, buf in bufs.items()}
