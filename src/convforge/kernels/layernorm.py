"""Layer norm over the last dimension of rows (inference): ConvNeXt's norm over each pixel's channels.

    y[r, c] = (x[r, c] - mean_r) / sqrt(var_r + eps) * gamma[c] + beta[c]

mean and the biased variance of each row in float32, as PyTorch's layer_norm computes them (two passes:
the deviations from the mean, not E[x^2] - mean^2). x and y may differ in dtype: under autocast PyTorch
runs layer norm in float32 and the next linear layer rounds its output to the half dtype; here the kernel
reads the half activation and writes the half dtype the linear reads, one pass instead of three (the
norm's float32 write, the cast's read and write).

A group of ``g`` threads (a power of 2) takes a row: each holds up to 8 vectors of v values (4 channels
where C is a multiple of 4) in registers, the row's sums go through a fixed shared-memory tree (runs are
bit-identical, OpenCL and CUDA alike). Inf and NaN in a row propagate to the row's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from convforge.codegen.dialect import Buf, Kernel, Storage
from convforge.codegen.meta import Code, cdiv, fl, halving_tree
from convforge.codegen.render import render
from convforge.plan import DeviceInfo, Launch

NAME = "layer_norm"
DTYPES = ("float32", "float16", "bfloat16")
MAX_C = 8192  # channels a row: 8 vectors of 4 (or 32 values) a thread at 256 threads a row
_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _check(rows: int, c: int, most: int, where: str, dtypes: tuple[tuple[str, str], ...]) -> None:
    if rows < 1 or c < 1:
        raise ValueError(f"{NAME}: rows ({rows}) and C ({c}) must be >= 1")
    if c > most:
        raise ValueError(f"{NAME}: C ({c}) must be at most {most}{where} (a row's values sit in registers)")
    for what, dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"{NAME}: {what} dtype ({dt}) must be one of {', '.join(DTYPES)}")


def _vector(c: int) -> int:
    return 4 if c % 4 == 0 else 1


def _group(c: int, per: int) -> int:
    """Threads a row: the power of 2 (at most 256) that leaves each at most ``per`` vectors of 4 values, or
    4 ``per`` single values where C is not a multiple of 4."""
    v = _vector(c)
    return min(256, 1 << (cdiv(c // v, per if v == 4 else 4 * per) - 1).bit_length())


@dataclass(frozen=True)
class LayerNormRows:
    """``rows`` rows of ``c`` contiguous values of ``dtype`` normalised into ``out``; gamma and beta (when
    ``affine``) of ``pdtype``."""

    rows: int
    c: int
    eps: float = 1e-5
    dtype: str = "float32"
    out: str = "float32"
    pdtype: str = "float32"
    affine: bool = True
    stats: bool = False  # also write each row's mean and 1 / sqrt(var + eps) into "st" (training)

    def __post_init__(self) -> None:
        _check(self.rows, self.c, MAX_C, "", (("input", self.dtype), ("output", self.out),
                                               ("parameters", self.pdtype)))
        if not self.eps >= 0:
            raise ValueError(f"{NAME}: eps ({self.eps}) must be >= 0")

    @property
    def v(self) -> int:
        """Values a load: 4 where C is a multiple of 4, else 1."""
        return _vector(self.c)

    @property
    def g(self) -> int:
        """Threads a row: the power of 2 that leaves each at most 8 vectors (32 values where v is 1)."""
        return _group(self.c, 8)

    def tag(self) -> str:
        p = "" if self.pdtype == "float32" else f"_p{_SHORT[self.pdtype]}"
        return (f"{self.rows}x{self.c}_{_SHORT[self.dtype]}_to_{_SHORT[self.out]}{p}"
                + ("" if self.affine else "_plain") + ("_st" if self.stats else ""))


def _block(ln: LayerNormRows, device: DeviceInfo) -> int:
    return max(ln.g, min(256 if device.is_gpu else 64, device.max_threads))


def launch(ln: LayerNormRows, device: DeviceInfo) -> tuple[Kernel, Launch]:
    """The kernel and its launch on ``device``."""
    bt = _block(ln, device)
    k = kernel(ln, bt)
    grid = (cdiv(ln.rows, bt // ln.g), 1, 1)
    return k, Launch(k.name, grid, (bt, 1, 1), tuple(a.name for a in k.args if isinstance(a, Buf)))


def kernel(ln: LayerNormRows, bt: int) -> Kernel:
    """Block of ``bt`` threads, ``bt / g`` rows; thread q of a row's group holds vectors q, q + g, ..."""
    s, o, p, v, g = Storage(ln.dtype), Storage(ln.out), Storage(ln.pdtype), ln.v, ln.g
    cv = ln.c // v
    per = cdiv(cv, g)
    ix = "I64" if ln.rows * ln.c > 2**31 - 1 else "int"
    lanes = (".x", ".y", ".z", ".w") if v == 4 else ("",)
    ft = "float4" if v == 4 else "float"
    code = Code()
    code(f"SHARED float r[{bt}];", f"const int t = LOCAL_ID(0), q = t % {g}, h0 = t - q;",
         f"const {ix} row = ({ix})GROUP_ID(0) * {bt // g} + t / {g};",
         f"const {ix} base = row * {ln.c};", f"const int live = row < {ln.rows};")
    valid = [f"live && q + {g * i} < {cv}" if g * (i + 1) > cv else "live" for i in range(per)]
    for i in range(per):
        at = f"base + (q + {g * i}) * {v}"
        ld = s.vload4("0", f"x + {at}") if v == 4 else s.load("x", at)
        zero = "MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f)" if v == 4 else "0.0f"
        code(f"const {ft} x{i} = ({valid[i]}) ? {ld} : {zero};")
    code("float a = " + " + ".join(f"x{i}{lane}" for i in range(per) for lane in lanes) + ";",
         "r[t] = a;", "BARRIER();")
    halving_tree(code, g, "q", lambda h: f"r[t] += r[t + {h}];")
    code(f"const float mean = r[h0] / {fl(ln.c)};", "BARRIER();", "float d = 0.0f;")
    _guarded(code, valid, lambda i: [f"d = FMA(x{i}{lane} - mean, x{i}{lane} - mean, d);" for lane in lanes])
    code("r[t] = d;", "BARRIER();")
    halving_tree(code, g, "q", lambda h: f"r[t] += r[t + {h}];")
    code(f"const float inv = 1.0f / sqrt(r[h0] / {fl(ln.c)} + {fl(ln.eps)});")
    if ln.stats:
        code("if (live && q == 0) { st[2 * row] = mean; st[2 * row + 1] = inv; }")

    def store(i: int) -> list[str]:
        c0 = f"(q + {g * i}) * {v}"
        outs = []
        for j, lane in enumerate(lanes):
            cj = f"{c0} + {j}" if v == 4 else c0
            val = f"(x{i}{lane} - mean) * inv"
            outs.append(f"FMA({val}, {p.load('gamma', cj)}, {p.load('beta', cj)})" if ln.affine else val)
        if v == 4:
            return [o.vstore4(f"MAKE_FLOAT4({', '.join(outs)})", "0", f"y + base + {c0}") + ";"]
        return [o.store("y", f"base + {c0}", outs[0]) + ";"]

    _guarded(code, valid, store)
    params = (p.buf("gamma"), p.buf("beta")) if ln.affine else ()
    args = (s.buf("x"), *params, o.buf("y", readonly=False), *((Buf("st", readonly=False),) if ln.stats else ()))
    return Kernel(f"{NAME}_{ln.tag()}", args, code.text(), (bt, 1, 1),
                  comment=f"{NAME}: {bt // g} row(s) a block, {g} thread(s) a row, {per} x {v} value(s) a thread")


def _guarded(code: Code, valid: list[str], body: Any) -> None:
    """``body(i)``'s statements for each vector i, under ``if (valid[i])``: runs of one condition share a block."""
    i = 0
    while i < len(valid):
        j = i
        while j < len(valid) and valid[j] == valid[i]:
            j += 1
        with code.block(f"if ({valid[i]})"):
            for k in range(i, j):
                code(*body(k))
        i = j


MAX_C_GRAD = 4096  # the backward holds 4 vectors (16 values) a thread, x, gy and two column sums each


@dataclass(frozen=True)
class LayerNormGrad:
    """The backward of a :class:`LayerNormRows` run with ``stats``: x (``dtype``) and gy (``gdtype``: the forward's
    output dtype) as rows of C, the forward's "st" and gamma (``pdtype``); gx in ``dtype``, the parameters'
    gradients in ``pdtype`` (float32 master weights under autocast: no cast)."""

    rows: int
    c: int
    dtype: str = "float32"
    gdtype: str = "float32"
    pdtype: str = "float32"
    affine: bool = True

    def __post_init__(self) -> None:
        _check(self.rows, self.c, MAX_C_GRAD, " in the backward", (("input", self.dtype), ("gradient", self.gdtype),
                                                                   ("parameters", self.pdtype)))

    @property
    def v(self) -> int:
        return _vector(self.c)

    @property
    def g(self) -> int:
        """Threads a row: the power of 2 that leaves each at most 4 vectors (16 values where v is 1)."""
        return _group(self.c, 4)

    def tag(self) -> str:
        p = "" if self.pdtype == "float32" else f"_p{_SHORT[self.pdtype]}"
        return (f"{self.rows}x{self.c}_{_SHORT[self.dtype]}_g{_SHORT[self.gdtype]}{p}"
                + ("" if self.affine else "_plain") + "_bwd")


@dataclass(frozen=True)
class LayerNormGradProgram:
    """The backward's kernels and launches; ``part`` floats of scratch (each block's column sums)."""

    kernels: tuple[Kernel, ...]
    launches: tuple[Launch, ...]
    part: int


def grad_program(lg: LayerNormGrad, device: DeviceInfo, blocks: int | None = None) -> LayerNormGradProgram:
    """The backward on ``device``: ``blocks`` blocks (default: four a compute unit on GPUs, at most one a group of
    rows) walk the rows; each leaves its column sums, and one more kernel adds them in block order."""
    bt = max(lg.g, min(256 if device.is_gpu else 64, device.max_threads))
    per_block = bt // lg.g
    most = cdiv(lg.rows, per_block)
    nb = min(most, 4 * max(device.units, 1) if device.is_gpu else 2) if blocks is None else blocks
    if not 1 <= nb <= most:
        raise ValueError(f"{NAME}: blocks ({nb}) must be in 1..{most}")
    k = _grad_kernel(lg, bt, nb)
    kernels, launches = [k], [Launch(k.name, (nb, 1, 1), (bt, 1, 1), tuple(a.name for a in k.args
                                                                          if isinstance(a, Buf)))]
    if lg.affine:
        f = _finalize_kernel(lg, nb)
        kernels.append(f)
        launches.append(Launch(f.name, (cdiv(2 * lg.c, 256), 1, 1), (256, 1, 1),
                               tuple(a.name for a in f.args if isinstance(a, Buf))))
    return LayerNormGradProgram(tuple(kernels), tuple(launches), nb * 2 * lg.c if lg.affine else 0)


def _grad_kernel(lg: LayerNormGrad, bt: int, nb: int) -> Kernel:
    """Block b takes rows b R + ri, (b + nb) R + ri, ... (R = bt / g rows at a time, thread q of a row's group
    its vectors q, q + g, ...): gx = inv (gamma gy - mean(gamma gy) - xh mean(gamma gy xh)), xh = (x - mean) inv;
    its threads keep the sums of gy xh and gy of their channels, added over the block's groups at the end."""
    s, gs, p, v, g = Storage(lg.dtype), Storage(lg.gdtype), Storage(lg.pdtype), lg.v, lg.g
    c, cv, rr = lg.c, lg.c // v, bt // g
    per = cdiv(cv, g)
    ix = "I64" if lg.rows * lg.c > 2**31 - 1 else "int"
    lanes = (".x", ".y", ".z", ".w") if v == 4 else ("",)
    ft = "float4" if v == 4 else "float"
    zero = "MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f)" if v == 4 else "0.0f"
    vec_ok = [f"q + {g * i} < {cv}" if g * (i + 1) > cv else "" for i in range(per)]
    valid = [f"live && {ok}" if ok else "live" for ok in vec_ok]
    code = Code()
    code(f"SHARED float r1[{bt}];", f"SHARED float r2[{bt}];")
    if lg.affine:
        code(f"SHARED float col[{rr * 2 * c}];")
    code(f"const int t = LOCAL_ID(0), q = t % {g}, ri = t / {g}, h0 = t - q;")
    code(*[f"{ft} ag{i} = {zero}, ab{i} = {zero};" for i in range(per)])
    with code.block(f"for ({ix} b0 = ({ix})GROUP_ID(0) * {rr}; b0 < {lg.rows}; b0 += {nb * rr})"):
        code(f"const {ix} row = b0 + ri;", f"const int live = row < {lg.rows};", f"const {ix} base = row * {c};",
             "const float mean = live ? st[2 * row] : 0.0f, inv = live ? st[2 * row + 1] : 0.0f;",
             "float a1 = 0.0f, a2 = 0.0f;")
        for i in range(per):
            at = f"base + (q + {g * i}) * {v}"
            ldx = s.vload4("0", f"x + {at}") if v == 4 else s.load("x", at)
            ldg = gs.vload4("0", f"gy + {at}") if v == 4 else gs.load("gy", at)
            code(f"{ft} x{i} = ({valid[i]}) ? {ldx} : {zero};", f"{ft} d{i} = ({valid[i]}) ? {ldg} : {zero};")
            for j, lane in enumerate(lanes):
                cj = f"(q + {g * i}) * {v} + {j}" if v == 4 else f"q + {g * i}"
                gam = p.load("gamma", cj) if lg.affine else "1.0f"
                if lg.affine and vec_ok[i]:
                    gam = f"({vec_ok[i]} ? {gam} : 0.0f)"
                code(f"x{i}{lane} = (x{i}{lane} - mean) * inv;  // xh",
                     f"ag{i}{lane} = FMA(d{i}{lane}, x{i}{lane}, ag{i}{lane}); ab{i}{lane} += d{i}{lane};",
                     f"d{i}{lane} *= {gam};  // gamma gy",
                     f"a1 += d{i}{lane}; a2 = FMA(d{i}{lane}, x{i}{lane}, a2);")
        code("r1[t] = a1;", "r2[t] = a2;", "BARRIER();")
        halving_tree(code, g, "q", lambda h: f"{{ r1[t] += r1[t + {h}]; r2[t] += r2[t + {h}]; }}")
        code(f"const float m1 = r1[h0] / {fl(c)}, m2 = r2[h0] / {fl(c)};", "BARRIER();")

        def store(i: int) -> list[str]:
            outs = [f"inv * (d{i}{lane} - m1 - x{i}{lane} * m2)" for lane in lanes]
            at = f"base + (q + {g * i}) * {v}"
            if v == 4:
                return [s.vstore4(f"MAKE_FLOAT4({', '.join(outs)})", "0", f"gx + {at}") + ";"]
            return [s.store("gx", at, outs[0]) + ";"]

        _guarded(code, valid, store)
    if lg.affine:
        def cols(i: int) -> list[str]:
            out = []
            for j, lane in enumerate(lanes):
                cj = f"(q + {g * i}) * {v} + {j}" if v == 4 else f"q + {g * i}"
                out += [f"col[ri * {2 * c} + {cj}] = ag{i}{lane};", f"col[ri * {2 * c} + {c} + {cj}] = ab{i}{lane};"]
            return out

        _guarded(code, [ok or "1" for ok in vec_ok], cols)
        code("BARRIER();")
        with code.block(f"for (int k = t; k < {2 * c}; k += {bt})"):
            code("float a = 0.0f;", f"for (int u = 0; u < {rr}; ++u) a += col[u * {2 * c} + k];",
                 f"part[GROUP_ID(0) * {2 * c} + k] = a;")
    params = (p.buf("gamma"),) if lg.affine else ()
    args = (s.buf("x"), gs.buf("gy"), Buf("st"), *params, s.buf("gx", readonly=False),
            *((Buf("part", readonly=False),) if lg.affine else ()))
    return Kernel(f"{NAME}_{lg.tag()}", args, code.text(), (bt, 1, 1),
                  comment=f"{NAME} backward: {nb} block(s) over the rows, {rr} row(s) at a time, {g} thread(s) a row")


def _finalize_kernel(lg: LayerNormGrad, nb: int) -> Kernel:
    """Thread o < 2C: the blocks' column sums in block order, dgamma (o < C) and dbeta in the parameters' dtype."""
    p, c = Storage(lg.pdtype), lg.c
    code = Code()
    code("const int o = GROUP_ID(0) * 256 + LOCAL_ID(0);", f"if (o >= {2 * c}) return;", "float a = 0.0f;",
         f"for (int b = 0; b < {nb}; ++b) a += part[b * {2 * c} + o];")
    code(f"if (o < {c}) {p.store('ggamma', 'o', 'a')}; else {p.store('gbeta', f'o - {c}', 'a')};")
    args = (Buf("part"), p.buf("ggamma", readonly=False), p.buf("gbeta", readonly=False))
    return Kernel(f"{NAME}_{lg.tag()}_params", args, code.text(), (256, 1, 1),
                  comment=f"{NAME} backward: dgamma and dbeta, {nb} block sums each in order")


def title(ln: LayerNormRows) -> str:
    return f"layer norm {ln.tag()}"


def source(ln: LayerNormRows, backend: str) -> str:
    """The program's source for ``backend`` on a GPU of 256-thread blocks (snapshots)."""
    return render([kernel(ln, max(ln.g, 256))], backend, title(ln))


def grad_source(lg: LayerNormGrad, backend: str, blocks: int = 3) -> str:
    """The backward's source for ``backend`` on a GPU of 256-thread blocks, ``blocks`` blocks (snapshots)."""
    prog = grad_program(lg, DeviceInfo(backend, "nominal GPU"), blocks)
    return render(list(prog.kernels), backend, f"layer norm backward {lg.tag()}")


def host_run(backend: Any, ln: LayerNormRows, x: np.ndarray, gamma: np.ndarray | None = None,
             beta: np.ndarray | None = None) -> Any:
    """Run on ``backend`` with NumPy inputs (tests, the OpenCL path): x as (rows, C); y (and "st") poisoned with
    NaN first; y comes back as float32 (rows, C), with ``stats`` as (y, st) and st as (rows, 2)."""
    from convforge.dtypes import to_storage
    from convforge.kernels.common import launch_all, poisoned

    k, step = launch(ln, backend.device)
    program = backend.program(render([k], backend.name, title(ln)))
    bufs: dict[str, Any] = {"x": backend.upload(to_storage(np.ascontiguousarray(x, np.float32).ravel(), ln.dtype))}
    if ln.affine:
        for name, arr in (("gamma", gamma), ("beta", beta)):
            if arr is None:
                raise ValueError(f"{NAME}: an affine layer norm needs {name}")
            bufs[name] = backend.upload(to_storage(np.ascontiguousarray(arr, np.float32).ravel(), ln.pdtype))
    bufs["y"] = poisoned(backend, ln.rows * ln.c, ln.out)
    if ln.stats:
        bufs["st"] = poisoned(backend, 2 * ln.rows, "float32")
    launch_all(backend, program, (k,), (step,), bufs)
    y = np.asarray(backend.download(bufs["y"], (ln.rows * ln.c,), ln.out)).reshape(ln.rows, ln.c)
    if ln.stats:
        return y, np.asarray(backend.download(bufs["st"], (2 * ln.rows,), "float32")).reshape(ln.rows, 2)
    return y


def grad_host_run(backend: Any, lg: LayerNormGrad, x: np.ndarray, gy: np.ndarray, st: np.ndarray,
                  gamma: np.ndarray | None = None, blocks: int | None = None) -> dict[str, np.ndarray]:
    """The backward on ``backend`` with NumPy inputs (tests): every output poisoned with NaN first; gx as (rows, C),
    ggamma and gbeta (affine) flat, all float32."""
    from convforge.dtypes import to_storage
    from convforge.kernels.common import launch_all, poisoned

    prog = grad_program(lg, backend.device, blocks)
    program = backend.program(render(list(prog.kernels), backend.name, f"layer norm backward {lg.tag()}"))

    def up(a: np.ndarray, dtype: str) -> Any:
        return backend.upload(to_storage(np.ascontiguousarray(a, np.float32).ravel(), dtype))

    bufs: dict[str, Any] = {"x": up(x, lg.dtype), "gy": up(gy, lg.gdtype), "st": up(st, "float32"),
                            "gx": poisoned(backend, lg.rows * lg.c, lg.dtype)}
    if lg.affine:
        if gamma is None:
            raise ValueError(f"{NAME}: an affine layer norm's backward needs gamma")
        bufs.update(gamma=up(gamma, lg.pdtype), part=poisoned(backend, prog.part, "float32"),
                    ggamma=poisoned(backend, lg.c, lg.pdtype), gbeta=poisoned(backend, lg.c, lg.pdtype))
    launch_all(backend, program, prog.kernels, prog.launches, bufs)
    out = {"gx": np.asarray(backend.download(bufs["gx"], (lg.rows * lg.c,), lg.dtype)).reshape(lg.rows, lg.c)}
    if lg.affine:
        out.update({k: np.asarray(backend.download(bufs[k], (lg.c,), lg.pdtype)) for k in ("ggamma", "gbeta")})
    return out
