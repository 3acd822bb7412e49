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

    def __post_init__(self) -> None:
        if self.rows < 1 or self.c < 1:
            raise ValueError(f"{NAME}: rows ({self.rows}) and C ({self.c}) must be >= 1")
        if self.c > MAX_C:
            raise ValueError(f"{NAME}: C ({self.c}) must be at most {MAX_C} (a row's values sit in registers)")
        if not self.eps >= 0:
            raise ValueError(f"{NAME}: eps ({self.eps}) must be >= 0")
        for what, dt in (("input", self.dtype), ("output", self.out), ("parameters", self.pdtype)):
            if dt not in DTYPES:
                raise ValueError(f"{NAME}: {what} dtype ({dt}) must be one of {', '.join(DTYPES)}")

    @property
    def v(self) -> int:
        """Values a load: 4 where C is a multiple of 4, else 1."""
        return 4 if self.c % 4 == 0 else 1

    @property
    def g(self) -> int:
        """Threads a row: the power of 2 that leaves each at most 8 vectors (32 values where v is 1)."""
        per = 8 if self.v == 4 else 32
        return min(256, 1 << (cdiv(self.c // self.v, per) - 1).bit_length())

    def tag(self) -> str:
        p = "" if self.pdtype == "float32" else f"_p{_SHORT[self.pdtype]}"
        return f"{self.rows}x{self.c}_{_SHORT[self.dtype]}_to_{_SHORT[self.out]}{p}" + ("" if self.affine else "_plain")


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
    args = (s.buf("x"), *params, o.buf("y", readonly=False))
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


def title(ln: LayerNormRows) -> str:
    return f"layer norm {ln.tag()}"


def source(ln: LayerNormRows, backend: str) -> str:
    """The program's source for ``backend`` on a GPU of 256-thread blocks (snapshots, ``convforge show``)."""
    return render([kernel(ln, max(ln.g, 256))], backend, title(ln))


def host_run(backend: Any, ln: LayerNormRows, x: np.ndarray, gamma: np.ndarray | None = None,
             beta: np.ndarray | None = None) -> np.ndarray:
    """Run on ``backend`` with NumPy inputs (tests, the OpenCL path): x as (rows, C); y poisoned with NaN
    first; y comes back as float32 (rows, C)."""
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
    launch_all(backend, program, (k,), (step,), bufs)
    return np.asarray(backend.download(bufs["y"], (ln.rows * ln.c,), ln.out)).reshape(ln.rows, ln.c)
