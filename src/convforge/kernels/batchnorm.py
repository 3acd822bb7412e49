"""Batch norm in training mode, with the residual add and ReLU that follow it, in three kernels a pass.

conv -> batch norm (batch statistics) [-> + residual] [-> ReLU] is the block of every ResNet. PyTorch runs it
as ``cudnn_batch_norm`` (a statistics pass and a normalising pass), ``add_`` and ``relu_``: five to eight
passes over the activation forward, and ``threshold_backward`` plus batch norm's backward (its reductions
and its elementwise pass), about eight, backward (docs/NOTES-training.md). Here:

With one block per channel (few channels' worth of values, or enough channels to fill the GPU) each pass
is one kernel: the block reduces its channel, thread 0 finalizes, and the block applies, re-reading the
channel (from L2 on a GPU). Otherwise, with a channel split over several blocks:

forward   stats     block (j, c): slice j of channel c's N*H*W values as shifted sums, sum(v - k) and
                    sum((v - k)^2) with k the channel's first value (no cancellation when the mean is
                    large against the spread)
          finalize  thread c: the slices' sums in slice order -> mean, 1 / sqrt(var + eps), scale = gamma
                    * that, and beta (the "st" buffer, 5 x C, the mean kept as k + dm); the running mean
                    and unbiased variance updated with the momentum and the batch counted ("nbt", int64),
                    as ``torch.nn.BatchNorm2d`` does
          apply     z = max((y - mean) * scale + beta [+ res], 0): one read of y [and res], one write;
                    y - mean as (y - k) - dm, exact where y is near the mean (a mean folded into a
                    shift, or rounded to float32, would cancel when it is large against the spread)
backward  reduce    block (j, c): g = dz masked by the ReLU (without a residual the mask is recomputed from
                    y with the forward's own FMA, so z is not read; with one it comes from z and g is
                    written out: it is the residual's gradient), sums of g and g * (y - mean)
          finalize  thread c: dgamma, dbeta ("dg", 2 x C) and dy's coefficients b, d ("cf", 2 x C)
          apply     dy = scale * g + b * (y - mean) + d

3 passes over the activation forward instead of 5 (8 with a residual), 5 (7) backward instead of 8. Every
reduction adds in a fixed order, so runs are bit-identical. Activations are float32 NCHW, viewed as (N, C,
H*W); float4 loads where H*W is a multiple of 4; element offsets in 64 bits past 2^31 - 1 elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from convforge.codegen.dialect import Buf, Kernel
from convforge.codegen.meta import Code, cdiv, fl
from convforge.codegen.render import render
from convforge.plan import DeviceInfo, Launch

NAME = "bn_train"
BLOCK = 256  # threads of the elementwise kernels
_SLICE = 8192  # values per reduction block at least when a channel is split over several


@dataclass(frozen=True)
class BnTrain:
    """One training batch norm: activation (n, c, hw), what follows it, its module's settings."""

    n: int
    c: int
    hw: int
    relu: bool = True
    residual: bool = False
    affine: bool = True  # gamma and beta exist
    track: bool = True  # running statistics exist and are updated
    eps: float = 1e-5
    momentum: float = 0.1

    def __post_init__(self) -> None:
        if min(self.n, self.c, self.hw) < 1:
            raise ValueError(f"{NAME}: activation (N={self.n}, C={self.c}, H*W={self.hw}) must not be empty")
        if self.n * self.hw < 2:
            raise ValueError(f"{NAME}: batch norm in training needs more than 1 value per channel "
                             f"(N*H*W = {self.n * self.hw})")
        if not self.eps > 0 or not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"{NAME}: eps ({self.eps}) must be > 0 and momentum ({self.momentum}) in [0, 1]")

    @property
    def m(self) -> int:
        """Values per channel."""
        return self.n * self.hw

    @property
    def total(self) -> int:
        return self.n * self.c * self.hw

    def tag(self) -> str:
        return ("_relu" if self.relu else "") + ("_res" if self.residual else "")


@dataclass(frozen=True)
class BnProgram:
    """The six kernels and their launches; buffers by name (module docstring), ``part`` floats of
    scratch for the slices' sums."""

    kernels: tuple[Kernel, ...]
    forward: tuple[Launch, ...]
    backward: tuple[Launch, ...]
    part: int


def slices(bn: BnTrain, device: DeviceInfo) -> int:
    """Reduction blocks per channel: on GPUs enough for four blocks per compute unit, each over at least
    8192 values; one on CPUs."""
    if not device.is_gpu:
        return 1
    return max(1, min(cdiv(4 * max(device.units, 1), bn.c), bn.m // _SLICE))


def bn_program(bn: BnTrain, device: DeviceInfo, sp: int | None = None) -> BnProgram:
    """The forward and backward launches of ``bn`` on ``device``: with one slice per channel
    (``slices``, or ``sp`` when given) one kernel a pass, else three (module docstring)."""
    sp = slices(bn, device) if sp is None else sp
    if not 1 <= sp <= bn.m:
        raise ValueError(f"{NAME}: slices per channel ({sp}) must be in 1..{bn.m} (N*H*W)")
    bt = 256 if device.is_gpu else 64
    bt = min(bt, device.max_threads)
    v = 4 if bn.hw % 4 == 0 else 1
    ix = "I64" if bn.total > 2**31 - 1 else "int"
    eblock = (BLOCK, 1, 1)
    if sp == 1:  # a block per channel: statistics, finalize and apply in one kernel a pass
        one = _reduce_kernel(bn, "stats", 1, bt, v, ix, fused=True)
        bone = _reduce_kernel(bn, "bwd_reduce", 1, bt, v, ix, fused=True)
        return BnProgram((one, bone), (Launch(one.name, (1, bn.c, 1), one.block, _names(one)),),
                         (Launch(bone.name, (1, bn.c, 1), bone.block, _names(bone)),), 0)
    stats = _reduce_kernel(bn, "stats", sp, bt, v, ix)
    fin = _finalize_kernel(bn, sp)
    apply = _apply_kernel(bn, v, ix)
    bred = _reduce_kernel(bn, "bwd_reduce", sp, bt, v, ix)
    bfin = _bwd_finalize_kernel(bn, sp)
    bapply = _bwd_apply_kernel(bn, v, ix)
    cgrid = (cdiv(bn.c, BLOCK), 1, 1)
    egrid = (cdiv(bn.total // v, BLOCK), 1, 1)
    fwd = (Launch(stats.name, (sp, bn.c, 1), stats.block, _names(stats)),
           Launch(fin.name, cgrid, eblock, _names(fin)),
           Launch(apply.name, egrid, eblock, _names(apply)))
    bwd = (Launch(bred.name, (sp, bn.c, 1), bred.block, _names(bred)),
           Launch(bfin.name, cgrid, eblock, _names(bfin)),
           Launch(bapply.name, egrid, eblock, _names(bapply)))
    return BnProgram((stats, fin, apply, bred, bfin, bapply), fwd, bwd, 2 * sp * bn.c)


def _names(k: Kernel) -> tuple[str, ...]:
    return tuple(a.name for a in k.args if isinstance(a, Buf))


def _prefix(bn: BnTrain) -> str:
    return f"{NAME}_{bn.n}x{bn.c}x{bn.hw}{bn.tag()}"


def _at(bn: BnTrain, v: int, ix: str, e: str) -> str:
    """Offset, from channel c's first value, of the ``e``-th vector of v values of that channel."""
    hv = bn.hw // v
    return f"({ix})(({e}) / {hv}) * {bn.c * bn.hw} + (({e}) % {hv}) * {v}"


def _lanes(v: int) -> tuple[str, ...]:
    return (".x", ".y", ".z", ".w") if v == 4 else ("",)


ST = ("k0", "dm", "inv", "sc", "sh")  # the "st" buffer's rows, C values each: mean = k0 + dm (module docstring)
# Every buffer a forward or backward kernel takes, numbered: the pointer slots of native.cpp's BlockNode (its enum
# BnSlot lists them in this order), which launches these kernels from C++ (torch/batchnorm.py native_handle)
BN_SLOTS = {name: i for i, name in enumerate(("y", "res", "z", "gamma", "beta", "rmean", "rvar", "nbt", "st",
                                               "part", "gz", "gm", "dg", "cf", "dy"))}


def _st(bn: BnTrain, *names: str) -> str:
    """Loads of channel c's statistics from "st" into locals of their names."""
    return "const float " + ", ".join(f"{n} = st[{ST.index(n) * bn.c} + c]" for n in names) + ";"


def _centred(lane: str) -> str:
    """y - mean as (y - k0) - dm: y - k0 is exact (Sterbenz) where y is near the mean, so a mean large
    against the spread costs no precision (a rounded float32 mean would)."""
    return f"(yv{lane} - k0) - dm"


def _sfx(lane: str) -> str:
    """The suffix of a lane's scalar locals: g0..g3 for a float4's x..w, g alone for a float."""
    return str("xyzw".index(lane[1])) if lane else ""


def _grad_line(bn: BnTrain, lane: str) -> str:
    """g{lane}: the gradient dz (gv) behind the ReLU of the value yv{lane} (backward kernels): masked
    by z > 0 (zv) with a residual, else by the forward's own FMA recomputed (the same bits as z > 0)."""
    if not bn.relu:
        return f"const float g{_sfx(lane)} = gv{lane};"
    if bn.residual:
        return f"const float g{_sfx(lane)} = zv{lane} > 0.0f ? gv{lane} : 0.0f;"
    return f"const float g{_sfx(lane)} = FMA({_centred(lane)}, sc, sh) > 0.0f ? gv{lane} : 0.0f;"


def _reduce_kernel(bn: BnTrain, what: str, sp: int, bt: int, v: int, ix: str, fused: bool = False) -> Kernel:
    """Block (j, c): slice j of channel c. "stats": sums of (y - k) and (y - k)^2, k = y[0, c, 0];
    "bwd_reduce": sums of g and g * (y - mean) (and g written to "gm" with a ReLU and a residual).
    Partial sums land in part[j * C + c] and part[(sp + j) * C + c]; ``fused`` (one slice: the block
    holds the whole channel): thread 0 finalizes instead and the block applies (:func:`_fused_tail`)."""
    chunks = bn.m // v
    per = cdiv(chunks, sp)
    bwd = what == "bwd_reduce"
    writes_gm = bwd and bn.relu and bn.residual
    code = Code()
    code(f"SHARED float r1[{bt}];", f"SHARED float r2[{bt}];",
         "const int t = LOCAL_ID(0), j = GROUP_ID(0), c = GROUP_ID(1);",
         f"const {ix} base = ({ix})c * {bn.hw};",
         f"const int e1 = min((j + 1) * {per}, {chunks});")
    if bwd:
        code(_st(bn, *ST[:2], *ST[3:]))
    else:
        code("const float k0 = y[base];")
    code("float a1 = 0.0f, a2 = 0.0f;")
    ftype = "float4" if v == 4 else "float"
    with code.block(f"for (int e = j * {per} + t; e < e1; e += {bt})"):
        code(f"const {ix} at = base + {_at(bn, v, ix, 'e')};")
        load = (lambda p: f"VLOAD4(0, {p} + at)") if v == 4 else (lambda p: f"{p}[at]")
        code(f"const {ftype} yv = {load('y')};")
        if bwd:
            code(f"const {ftype} gv = {load('gz')};")
            if bn.relu and bn.residual:
                code(f"const {ftype} zv = {load('z')};")
            code(*[_grad_line(bn, lane) for lane in _lanes(v)])
            gs = [f"g{_sfx(lane)}" for lane in _lanes(v)]
            ds = [f"{g} * ({_centred(lane)})" for g, lane in zip(gs, _lanes(v), strict=True)]
            if writes_gm:
                code(f"VSTORE4(MAKE_FLOAT4({', '.join(gs)}), 0, gm + at);" if v == 4 else "gm[at] = g;")
        else:
            code(*[f"const float d{_sfx(lane)} = yv{lane} - k0;" for lane in _lanes(v)])
            gs = [f"d{_sfx(lane)}" for lane in _lanes(v)]
            ds = [f"d{_sfx(lane)} * d{_sfx(lane)}" for lane in _lanes(v)]
        code(f"a1 += {_pairwise(gs)};", f"a2 += {_pairwise(ds)};")
    code("r1[t] = a1;", "r2[t] = a2;", "BARRIER();")
    half = bt // 2
    while half >= 1:
        with code.block(f"if (t < {half})"):
            code(f"r1[t] += r1[t + {half}];", f"r2[t] += r2[t + {half}];")
        code("BARRIER();")
        half //= 2
    what_text = ("sums of the ReLU-masked gradient g and g * (y - mean)" if bwd
                 else "shifted sums of y and y^2")
    if fused:
        return _fused_tail(bn, code, bwd, bt, v, ix, what_text)
    with code.block("if (t == 0)"):
        code(f"part[j * {bn.c} + c] = r1[0];", f"part[({sp} + j) * {bn.c} + c] = r2[0];")
    if bwd:
        args = (Buf("gz"), Buf("y"), *((Buf("z"),) if bn.relu and bn.residual else ()), Buf("st"),
                *((Buf("gm", readonly=False),) if writes_gm else ()), Buf("part", readonly=False))
    else:
        args = (Buf("y"), Buf("part", readonly=False))
    return Kernel(f"{_prefix(bn)}_{what}", args, code.text(), (bt, 1, 1),
                  comment=f"{NAME}: {what_text} per (slice, channel), {sp} slice(s), {bt} threads")


def _fused_tail(bn: BnTrain, code: Code, bwd: bool, bt: int, v: int, ix: str, what_text: str) -> Kernel:
    """One block per channel, after its sums: thread 0 finalizes (forward: :func:`_finalize_lines`;
    backward: dgamma, dbeta, b and d) and hands the block its coefficients through shared memory, then
    every thread applies over the values it reduced (its own gm stores read back)."""
    chunks = bn.m // v
    ftype = "float4" if v == 4 else "float"
    load = (lambda p: f"VLOAD4(0, {p} + at)") if v == 4 else (lambda p: f"{p}[at]")
    lanes = _lanes(v)
    code("SHARED float fin[2];")
    with code.block("if (t == 0)"):
        code("const float s1 = r1[0], s2 = r2[0];")
        if bwd:
            code(*_bwd_finalize_lines(bn), "fin[0] = b;", "fin[1] = d;")
        else:
            code(*_finalize_lines(bn), "fin[0] = dm;", "fin[1] = sc;")
    code("BARRIER();")
    code("const float b = fin[0], d = fin[1];" if bwd else
         f"const float dm = fin[0], sc = fin[1], sh = {'beta[c]' if bn.affine else '0.0f'};")
    with code.block(f"for (int e = t; e < {chunks}; e += {bt})"):
        code(f"const {ix} at = base + {_at(bn, v, ix, 'e')};", f"const {ftype} yv = {load('y')};")
        if bwd:
            src = "gm" if bn.relu and bn.residual else "gz"
            code(f"const {ftype} gv = {load(src)};")
            for lane in lanes:  # with a residual gm is already masked
                code(_grad_line(bn, lane) if bn.relu and not bn.residual else f"const float g{_sfx(lane)} = gv{lane};")
            outs = [f"FMA(sc, g{_sfx(lane)}, FMA(b, {_centred(lane)}, d))" for lane in lanes]
            out = "dy"
        else:
            if bn.residual:
                code(f"const {ftype} rv = {load('res')};")
            outs = [_apply_value(bn, lane) for lane in lanes]
            out = "z"
        code(f"VSTORE4(MAKE_FLOAT4({', '.join(outs)}), 0, {out} + at);" if v == 4 else f"{out}[at] = {outs[0]};")
    if bwd:
        writes_gm = bn.relu and bn.residual
        args: tuple[Buf, ...] = (Buf("gz"), Buf("y"), *((Buf("z"),) if writes_gm else ()), Buf("st"),
                                 *((Buf("gm", readonly=False),) if writes_gm else ()),
                                 *((Buf("dg", readonly=False),) if bn.affine else ()), Buf("dy", readonly=False))
        tail = "dgamma, dbeta and dy"
    else:
        args = (Buf("y"), *((Buf("res"),) if bn.residual else ()), *_finalize_args(bn), Buf("z", readonly=False))
        tail = "statistics, running statistics and z"
    return Kernel(f"{_prefix(bn)}_{'bwd' if bwd else 'fwd'}_one", args, code.text(), (bt, 1, 1),
                  comment=f"{NAME}: {what_text}, then {tail}: one block per channel, {bt} threads")


def _pairwise(terms: list[str]) -> str:
    if len(terms) == 1:
        return terms[0]
    return f"({terms[0]} + {terms[1]}) + ({terms[2]} + {terms[3]})"


def _sum_slices(bn: BnTrain, sp: int) -> list[str]:
    return [f"float s1 = part[c], s2 = part[{sp * bn.c} + c];",
            *([f"for (int j = 1; j < {sp}; ++j) {{ s1 += part[j * {bn.c} + c]; s2 += part[({sp} + j) * {bn.c} + c]; }}"]
              if sp > 1 else [])]


def _finalize_kernel(bn: BnTrain, sp: int) -> Kernel:
    """Thread c: mean, 1/sqrt(var + eps), scale and beta into st; the running statistics updated."""
    code = Code()
    code(f"const int c = GROUP_ID(0) * {BLOCK} + LOCAL_ID(0);", f"if (c >= {bn.c}) return;")
    code(*_sum_slices(bn, sp))
    code(f"const float k0 = y[(I64)c * {bn.hw}];", *_finalize_lines(bn))
    args = (Buf("part"), Buf("y"), *_finalize_args(bn))
    return Kernel(f"{_prefix(bn)}_finalize", args, code.text(), (BLOCK, 1, 1),
                  comment=f"{NAME}: batch statistics, scale and beta per channel"
                          + (f", running statistics (momentum {bn.momentum})" if bn.track else ""))


def _finalize_lines(bn: BnTrain) -> list[str]:
    """Channel c's statistics from its sums s1, s2 of y - k0: st, the running statistics, the count."""
    lines = [f"const float dm = s1 / {fl(bn.m)};",
             "const float mean = k0 + dm;",
             f"const float var = MAX(s2 / {fl(bn.m)} - dm * dm, 0.0f);",
             f"const float inv = 1.0f / sqrt(var + {fl(bn.eps)});",
             f"const float sc = {'gamma[c] * inv' if bn.affine else 'inv'};",
             f"const float sh = {'beta[c]' if bn.affine else '0.0f'};",
             *[f"st[{i * bn.c} + c] = {n};" for i, n in enumerate(ST)]]
    if bn.track:
        mom, keep = bn.momentum, 1.0 - bn.momentum
        lines += [f"rmean[c] = {fl(keep)} * rmean[c] + {fl(mom)} * mean;",
                  f"rvar[c] = {fl(keep)} * rvar[c] + {fl(mom)} * (var * {fl(bn.m / (bn.m - 1))});",
                  "if (c == 0) nbt[0] += 1;  // num_batches_tracked, as the module's forward counts it"]
    return lines


def _finalize_args(bn: BnTrain) -> tuple[Buf, ...]:
    return (*((Buf("gamma"), Buf("beta")) if bn.affine else ()),
            *((Buf("rmean", readonly=False), Buf("rvar", readonly=False), Buf("nbt", "I64", readonly=False))
              if bn.track else ()),
            Buf("st", readonly=False))


def _apply_value(bn: BnTrain, lane: str) -> str:
    """z of one value: [ReLU]((y - mean) * scale + beta [+ res])."""
    val = f"FMA({_centred(lane)}, sc, sh)"
    if bn.residual:
        val = f"{val} + rv{lane}"
    return f"RELU({val})" if bn.relu else val


def _bwd_finalize_lines(bn: BnTrain) -> list[str]:
    """dgamma, dbeta (with an affine) and dy's coefficients b, d from the sums s1 = sum(g) and
    s2 = sum(g * (y - mean)); ``sc`` loaded by the caller."""
    lines = [_st(bn, "inv")]
    if bn.affine:
        lines += ["dg[c] = s2 * inv;", f"dg[{bn.c} + c] = s1;"]
    lines += [f"const float b = -sc * inv * inv * (s2 / {fl(bn.m)});", f"const float d = -sc * (s1 / {fl(bn.m)});"]
    return lines


def _elementwise_head(bn: BnTrain, v: int, ix: str) -> list[str]:
    return [f"const {ix} e = ({ix})GROUP_ID(0) * {BLOCK} + LOCAL_ID(0);",
            f"if (e >= {bn.total // v}) return;",
            f"const int c = (int)((e / {bn.hw // v}) % {bn.c});"]


def _apply_kernel(bn: BnTrain, v: int, ix: str) -> Kernel:
    """z = [ReLU]((y - mean) * scale + beta [+ res]), v values a thread."""
    code = Code()
    code(*_elementwise_head(bn, v, ix))
    code(_st(bn, *ST[:2], *ST[3:]))
    lanes = _lanes(v)
    if v == 4:
        code("const float4 yv = VLOAD4(e, y);")
        if bn.residual:
            code("const float4 rv = VLOAD4(e, res);")
    else:
        code("const float yv = y[e];")
        if bn.residual:
            code("const float rv = res[e];")
    outs = [_apply_value(bn, lane) for lane in lanes]
    code(f"VSTORE4(MAKE_FLOAT4({', '.join(outs)}), e, z);" if v == 4 else f"z[e] = {outs[0]};")
    args = (Buf("y"), *((Buf("res"),) if bn.residual else ()), Buf("st"), Buf("z", readonly=False))
    ops = "(y - mean) * scale + beta" + (" + res" if bn.residual else "")
    return Kernel(f"{_prefix(bn)}_apply", args, code.text(), (BLOCK, 1, 1),
                  comment=f"{NAME}: z = {'ReLU(' + ops + ')' if bn.relu else ops}")


def _bwd_finalize_kernel(bn: BnTrain, sp: int) -> Kernel:
    """Thread c: dgamma = sum(g * xhat), dbeta = sum(g); dy's coefficients b and d (module docstring)."""
    code = Code()
    code(f"const int c = GROUP_ID(0) * {BLOCK} + LOCAL_ID(0);", f"if (c >= {bn.c}) return;")
    code(*_sum_slices(bn, sp))
    code(_st(bn, "sc"), *_bwd_finalize_lines(bn), "cf[c] = b;", f"cf[{bn.c} + c] = d;")
    args = (Buf("part"), Buf("st"), *((Buf("dg", readonly=False),) if bn.affine else ()), Buf("cf", readonly=False))
    return Kernel(f"{_prefix(bn)}_bwd_finalize", args, code.text(), (BLOCK, 1, 1),
                  comment=f"{NAME}: the gradients of gamma and beta, dy's coefficients")


def _bwd_apply_kernel(bn: BnTrain, v: int, ix: str) -> Kernel:
    """dy = scale * g + b * (y - mean) + d, g the masked gradient (read back from gm with a residual)."""
    code = Code()
    code(*_elementwise_head(bn, v, ix))
    code(_st(bn, "k0", "dm", "sc", *(("sh",) if bn.relu and not bn.residual else ())),
         f"const float b = cf[c], d = cf[{bn.c} + c];")
    lanes = _lanes(v)
    src = "gm" if bn.relu and bn.residual else "gz"
    if v == 4:
        code("const float4 yv = VLOAD4(e, y);", f"const float4 gv = VLOAD4(e, {src});")
    else:
        code("const float yv = y[e];", f"const float gv = {src}[e];")
    for lane in lanes:  # with a residual gm is already masked
        code(_grad_line(bn, lane) if bn.relu and not bn.residual else f"const float g{_sfx(lane)} = gv{lane};")
    outs = [f"FMA(sc, g{_sfx(lane)}, FMA(b, {_centred(lane)}, d))" for lane in lanes]
    code(f"VSTORE4(MAKE_FLOAT4({', '.join(outs)}), e, dy);" if v == 4 else f"dy[e] = {outs[0]};")
    args = (Buf(src), Buf("y"), Buf("st"), Buf("cf"), Buf("dy", readonly=False))
    return Kernel(f"{_prefix(bn)}_bwd_apply", args, code.text(), (BLOCK, 1, 1),
                  comment=f"{NAME}: dy = scale * g + b * (y - mean) + d")


def host_run(backend: Any, bn: BnTrain, which: str, arrays: dict[str, np.ndarray],
             prog: BnProgram | None = None) -> dict[str, np.ndarray]:
    """Run the ``which`` ("forward" / "backward") launches on ``backend`` with NumPy inputs (tests, the
    OpenCL path): every buffer the launches name that ``arrays`` lacks is allocated and poisoned with
    NaN first; returns every buffer after the run (the running statistics updated in place), those of
    the activation's size in the shape of ``arrays["y"]``."""
    prog = prog if prog is not None else bn_program(bn, backend.device)
    launches = prog.forward if which == "forward" else prog.backward
    program = backend.program(render(list(prog.kernels), backend.name, f"batch norm (training) {bn.tag()}"))
    kernels = {k.name: k for k in prog.kernels}
    sizes = {"st": len(ST) * bn.c, "part": prog.part, "dg": 2 * bn.c, "cf": 2 * bn.c}
    bufs: dict[str, Any] = {}
    for step in launches:
        for name in map(str, step.args):
            if name in bufs:
                continue
            if name in arrays:  # an int64 array (the batch counter) travels as its bytes
                a = np.ascontiguousarray(arrays[name])
                bufs[name] = backend.upload(a.view(np.float32) if a.dtype == np.int64 else a.astype(np.float32))
            else:
                count = sizes.get(name, bn.total)
                bufs[name] = backend.empty(4 * count)
                backend.fill(bufs[name], float("nan"), 4 * count)
    for step in launches:
        kernel = kernels[step.kernel]
        backend.launch(program, backend.function(program, kernel), kernel, step, [bufs[str(a)] for a in step.args])
    backend.synchronize()
    act = np.shape(arrays["y"])  # activation-sized buffers come back in y's shape
    shapes = {name: np.shape(arrays[name]) if name in arrays else (sizes[name],) if name in sizes else act
              for name in bufs}
    out = {}
    for name, buf in bufs.items():
        if name in arrays and np.asarray(arrays[name]).dtype == np.int64:
            out[name] = backend.download(buf, (2 * np.asarray(arrays[name]).size,)).view(np.int64)
        else:
            out[name] = backend.download(buf, shapes[name]).reshape(shapes[name])
    return out
