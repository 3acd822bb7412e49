"""A training block's filters cast between the float32 master weight and the half copy its conv reads.

Under autocast a conv -> batch norm block (torch/native.cpp ``BlockNode``) runs its conv in FP16 / BF16
from a float32 master weight: the forward needs the weight as KCRS halves, the backward hands the filters'
gradient back in the master's dtype and memory order (KCRS, or channels-last KRSC as
``model.to(memory_format=torch.channels_last)`` leaves 3x3 filters). ``Tensor.to`` does each through the
dispatcher (an allocation, a copy op and, for a channels-last gradient, AccumulateGrad's second copy into the
parameter's layout); these two kernels do it in one launch each on raw pointers:

forward   wh[k, c, r, s] = w[k, c, r, s] rounded to the half dtype: wh in KCRS, w in KCRS or KRSC memory
backward  gw[k, c, r, s] = gwh[k, c, r, s] as float32: gwh in KCRS, gw in w's memory order

One thread an element of the output in its memory order (the writes coalesce); without a permutation
(KCRS master, or 1x1 filters) a thread takes 4 elements where the count divides by 4. Rounding as the
dialect's half stores (round to nearest even), the same bits as ``Tensor.to``; Inf and NaN pass. The kernels
read the filters' sizes from a small int buffer ("dims": :func:`dims`), so one compiled program serves every
filter shape of a dtype and memory order (a network's first step compiles a handful, not one a layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from convforge.codegen.dialect import Buf, Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.codegen.render import render
from convforge.plan import Launch

THREADS = 256
HALVES = ("float16", "bfloat16")


@dataclass(frozen=True)
class WCast:
    """A block's filters: K x C x R x S, the conv's half ``dtype``, the master in channels-last memory
    (``cl``: KRSC) or KCRS."""

    k: int
    c: int
    r: int
    s: int
    dtype: str = "float16"
    cl: bool = False

    def __post_init__(self) -> None:
        if min(self.k, self.c, self.r, self.s) < 1:
            raise ValueError(f"filters ({self.k}, {self.c}, {self.r}, {self.s}) must have every size >= 1")
        if self.dtype not in HALVES:
            raise ValueError(f"dtype ({self.dtype!r}) must be one of {', '.join(HALVES)}")

    @property
    def n(self) -> int:
        return self.k * self.c * self.r * self.s

    @property
    def permutes(self) -> bool:
        """Whether the master's memory order differs from KCRS (1x1 filters read the same either way)."""
        return self.cl and self.r * self.s > 1 and self.c > 1

    @property
    def lanes(self) -> int:
        return 4 if not self.permutes and self.n % 4 == 0 else 1

    def tag(self) -> str:
        return f"{self.k}x{self.c}x{self.r}x{self.s}_{self.form()}"

    def form(self) -> str:
        """What the kernels' source depends on: dtype, permutation, elements a thread."""
        short = {"float16": "f16", "bfloat16": "bf16"}[self.dtype]
        return f"{short}{'_cl' if self.permutes else ''}{'_v4' if self.lanes == 4 else ''}"


def dims(wc: WCast) -> np.ndarray:
    """The "dims" buffer the kernels read: the outputs (vectors of ``lanes``), C*R*S, R*S and C, int32."""
    return np.array([wc.n // wc.lanes, wc.c * wc.r * wc.s, wc.r * wc.s, wc.c], np.int32)


def _kernel(wc: WCast, backward: bool) -> Kernel:
    half, f32 = Storage(wc.dtype), Storage("float32")
    src_s, dst_s = (half, f32) if backward else (f32, half)
    src, dst = ("gwh", "gw") if backward else ("w", "wh")
    v = wc.lanes
    code = Code()
    code(f"const int e = GROUP_ID(0) * {THREADS} + LOCAL_ID(0);", "if (e >= dims[0]) return;")
    if v == 4:
        code(dst_s.vstore4(src_s.vload4("e", src), "e", dst) + ";")
    elif wc.permutes:
        code("const int crs = dims[1], rs = dims[2], c = dims[3], k = e / crs;")
        if backward:  # e in KRSC order, src in KCRS
            code("const int t = (e % crs) / c, ch = e % c, src = k * crs + ch * rs + t;")
        else:  # e in KCRS order, src in KRSC
            code("const int ch = (e % crs) / rs, t = e % rs, src = k * crs + t * c + ch;")
        code(dst_s.store(dst, "e", src_s.load(src, "src")) + ";")
    else:
        code(dst_s.store(dst, "e", src_s.load(src, "e")) + ";")
    order = "KRSC" if wc.permutes else "KCRS"
    what = (f"the filters' gradient: KCRS {wc.dtype} -> {order} float32" if backward
            else f"the filters: {order} float32 -> KCRS {wc.dtype}")
    return Kernel(f"wcast_{'bwd' if backward else 'fwd'}_{wc.form()}",
                  (src_s.buf(src), dst_s.buf(dst, readonly=False), Buf("dims", "int")), code.text(), (THREADS, 1, 1),
                  comment=f"block filters' cast, {what}, {v} element(s) a thread, sizes from dims")


@dataclass(frozen=True)
class WCastProgram:
    kernels: tuple[Kernel, ...]
    forward: tuple[Launch, ...]
    backward: tuple[Launch, ...]


SLOTS = {"w": 0, "wh": 1, "gwh": 2, "gw": 3, "dims": 4}  # native.cpp's WCastSlot: the forward reads w into wh, ...


def wcast_program(wc: WCast) -> WCastProgram:
    """The two kernels and their launches (one each)."""
    fk, bk = _kernel(wc, False), _kernel(wc, True)
    grid = (cdiv(wc.n // wc.lanes, THREADS), 1, 1)
    return WCastProgram((fk, bk), (Launch(fk.name, grid, fk.block, ("w", "wh", "dims")),),
                        (Launch(bk.name, grid, bk.block, ("gwh", "gw", "dims")),))


def title(wc: WCast) -> str:
    return f"block filters' casts {wc.form()}"


def source(wc: WCast, backend: str) -> str:
    """The program's source for ``backend`` ("cuda" / "opencl"): what ``convforge show`` would print."""
    return render(list(wcast_program(wc).kernels), backend, title(wc))


def host_run(backend: Any, wc: WCast, which: str, src: np.ndarray) -> np.ndarray:
    """Run the ``which`` ("forward" / "backward") launch on ``backend`` (tests, the OpenCL path): ``src``
    in its memory order (forward: float32 w, KRSC where the master is channels-last; backward: gwh, KCRS, in
    the half dtype's storage); the output is poisoned (NaN) first and comes back flat in its memory order, as
    float32 values (forward: the halves' values)."""
    from convforge.dtypes import storage_dtype, to_storage

    prog = wcast_program(wc)
    program = backend.program(source(wc, backend.name))
    launch = (prog.forward if which == "forward" else prog.backward)[0]
    kernel = next(k for k in prog.kernels if k.name == launch.kernel)
    out_dt = "float32" if which == "backward" else wc.dtype
    a = np.ascontiguousarray(src).ravel()
    inp = backend.upload(a if which == "backward" and a.dtype == storage_dtype(wc.dtype) else
                         to_storage(a.astype(np.float32), "float32" if which == "forward" else wc.dtype))
    nbytes = wc.n * storage_dtype(out_dt).itemsize
    out = backend.empty(nbytes)
    backend.fill(out, float("nan"), nbytes, out_dt)
    sizes = backend.upload(dims(wc).view(np.float32))
    backend.launch(program, backend.function(program, kernel), kernel, launch, [inp, out, sizes])
    backend.synchronize()
    return np.asarray(backend.download(out, (wc.n,), out_dt))
