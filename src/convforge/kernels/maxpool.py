"""Max pooling for training, in two kernels: the forward writes each window's maximum and where in
the window it lies (one byte), the backward gathers.

PyTorch's ``max_pool2d`` keeps int64 indices into the input plane and scatters the gradient back
through them; on an H200 its channels-last backward took 0.91 ms of a ResNet-50 N128 FP16 step
(``max_pool2d_with_indices_backward``, docs/NOTES-training.md), about ten times the bytes it moves.
Here:

forward   one thread an output element: the maximum over the window's in-image taps, row by row,
          a later tap taking over when it is larger or NaN (PyTorch's rule: the first of equal maxima,
          the last NaN; a window of -inf keeps its first in-image tap, as PyTorch's NCHW kernel does:
          its channels-last kernel names the plane's input (0, 0) instead), and the tap's number in the
          window (``r * kw + s``) as a byte ("ix", the output's shape)
backward  one thread an input element: the sum, in float32 and a fixed order (window rows, then
          columns), of the output gradients of the windows containing it whose byte names it; one
          write, no atomics, no zero fill

Storage: float32, float16 or bfloat16 (:class:`~convforge.codegen.dialect.Storage`), NCHW or
channels-last (NHWC) memory, the output in the input's layout. Dilation 1, windows of at most 255
taps; PyTorch's output size (floor or ceil mode, padding at most half the window). Element offsets in
64 bits past 2^31 - 1 elements.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from convforge.codegen.dialect import Buf, Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.codegen.render import render
from convforge.plan import Launch

THREADS = 256


def pool_out(size: int, k: int, stride: int, pad: int, ceil: bool) -> int:
    """PyTorch's pooled length (``pooling_output_shape``, dilation 1): the last window must start
    inside the image or its left padding in ceil mode."""
    out = (size + 2 * pad - k + (stride - 1 if ceil else 0)) // stride + 1
    if ceil and (out - 1) * stride >= size + pad:
        out -= 1
    return out


@dataclass(frozen=True)
class PoolTrain:
    """One max-pooling layer: input N x C x H x W, window kh x kw, stride, padding (top = bottom,
    left = right, as ``nn.MaxPool2d``), ceil mode, storage dtype and memory layout."""

    n: int
    c: int
    h: int
    w: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int = 0
    pw: int = 0
    ceil: bool = False
    dtype: str = "float32"
    layout: str = "nchw"

    def __post_init__(self) -> None:
        for name in ("n", "c", "h", "w", "kh", "kw", "sh", "sw"):
            if getattr(self, name) < 1:
                raise ValueError(f"max pool: {name} ({getattr(self, name)}) must be >= 1")
        if self.kh * self.kw > 255:
            raise ValueError(f"max pool: a {self.kh}x{self.kw} window has more than 255 taps (one byte each)")
        if not (0 <= self.ph <= self.kh // 2 and 0 <= self.pw <= self.kw // 2):
            raise ValueError(f"max pool: padding ({self.ph}, {self.pw}) must be >= 0 and at most half the "
                             f"window ({self.kh}x{self.kw})")
        if self.layout not in ("nchw", "nhwc"):
            raise ValueError(f"max pool: layout ({self.layout!r}) must be 'nchw' or 'nhwc'")
        Storage(self.dtype)  # refuses another dtype
        if self.p < 1 or self.q < 1:
            raise ValueError(f"max pool: a {self.h}x{self.w} input leaves no {self.kh}x{self.kw} window")

    @property
    def p(self) -> int:
        return pool_out(self.h, self.kh, self.sh, self.ph, self.ceil)

    @property
    def q(self) -> int:
        return pool_out(self.w, self.kw, self.sw, self.pw, self.ceil)

    @property
    def x_size(self) -> int:
        return self.n * self.c * self.h * self.w

    @property
    def y_size(self) -> int:
        return self.n * self.c * self.p * self.q

    def tag(self) -> str:
        return (f"{self.n}x{self.c}x{self.h}x{self.w} {self.kh}x{self.kw}/{self.sh}x{self.sw} pad {self.ph},{self.pw}"
                f"{' ceil' if self.ceil else ''} {self.dtype} {self.layout}")


@dataclass(frozen=True)
class PoolProgram:
    kernels: tuple[Kernel, ...]
    forward: tuple[Launch, ...]
    backward: tuple[Launch, ...]


def _split(pt: PoolTrain, rows: int, cols: int, ix: str) -> list[str]:
    """Lines naming n, c and the row / column ``r``, ``s`` of linear element ``e`` of an N x C x rows x
    cols tensor in the layer's layout."""
    if pt.layout == "nhwc":
        return [f"const int c = (int)(e % {pt.c});", f"const {ix} t = e / {pt.c};",
                f"const int s = (int)(t % {cols}), r = (int)(t / {cols} % {rows});",
                f"const {ix} n = t / {cols * rows};"]
    return [f"const int s = (int)(e % {cols}), r = (int)(e / {cols} % {rows});",
            f"const int c = (int)(e / {cols * rows} % {pt.c});", f"const {ix} n = e / {cols * rows * pt.c};"]


def _at(pt: PoolTrain, rows: int, cols: int, r: str, s: str) -> str:
    """The offset of element (n, c, r, s) of an N x C x rows x cols tensor in the layer's layout."""
    if pt.layout == "nhwc":
        return f"((n * {rows} + ({r})) * {cols} + ({s})) * {pt.c} + c"
    return f"((n * {pt.c} + c) * {rows} + ({r})) * {cols} + ({s})"


def _index_type(pt: PoolTrain) -> str:
    return "I64" if pt.x_size > 2**31 - 1 or pt.y_size > 2**31 - 1 else "int"


@contextmanager
def _each_element(code: Code, pt: PoolTrain, rows: int, cols: int, ix: str) -> Iterator[None]:
    """One thread an element of an N x C x rows x cols tensor: its linear index ``e``, the bound check,
    and n, c, r, s (:func:`_split`); the body goes inside."""
    code(f"const {ix} e = ({ix})GROUP_ID(0) * {THREADS} + LOCAL_ID(0);")
    with code.block(f"if (e < {pt.n * pt.c * rows * cols})"):
        code(*_split(pt, rows, cols, ix))
        yield


def forward_kernel(pt: PoolTrain, name: str = "maxpool_fwd") -> Kernel:
    """The forward: one thread an output element (module docstring)."""
    st, ix = Storage(pt.dtype), _index_type(pt)
    code = Code()
    with _each_element(code, pt, pt.p, pt.q, ix):
        code(f"const int h0 = r * {pt.sh} - {pt.ph}, w0 = s * {pt.sw} - {pt.pw};",
             f"const int hs = max(h0, 0), he = min(h0 + {pt.kh}, {pt.h});",
             f"const int ws = max(w0, 0), we = min(w0 + {pt.kw}, {pt.w});",
             f"float m = {st.load('x', _at(pt, pt.h, pt.w, 'hs', 'ws'))};",
             f"int best = (hs - h0) * {pt.kw} + (ws - w0);  // the first in-image tap")
        with code.block("for (int hh = hs; hh < he; ++hh)"):
            with code.block("for (int ww = ws; ww < we; ++ww)"):
                code(f"const float v = {st.load('x', _at(pt, pt.h, pt.w, 'hh', 'ww'))};")
                code("// larger, or NaN: PyTorch's rule")
                with code.block("if (v > m || v != v)"):
                    code("m = v;", f"best = (hh - h0) * {pt.kw} + (ww - w0);")
        code(f"{st.store('y', 'e', 'm')};", "ix[e] = (unsigned char)best;")
    return Kernel(name, (st.buf("x"), st.buf("y", readonly=False), Buf("ix", "unsigned char", readonly=False)),
                  code.text(), (THREADS, 1, 1), comment=f"max pool forward: y and the window tap of each maximum, "
                  f"{pt.tag()}")


def backward_kernel(pt: PoolTrain, name: str = "maxpool_bwd") -> Kernel:
    """The backward: one thread an input element, gathering (module docstring)."""
    st, ix = Storage(pt.dtype), _index_type(pt)
    code = Code()
    with _each_element(code, pt, pt.h, pt.w, ix):
        code("// the windows holding (r, s): rows p0..p1, columns q0..q1",
             f"const int ar = r + {pt.ph} - {pt.kh - 1}, as = s + {pt.pw} - {pt.kw - 1};",
             f"const int p0 = ar <= 0 ? 0 : (ar + {pt.sh - 1}) / {pt.sh};",
             f"const int p1 = min((r + {pt.ph}) / {pt.sh}, {pt.p - 1});",
             f"const int q0 = as <= 0 ? 0 : (as + {pt.sw - 1}) / {pt.sw};",
             f"const int q1 = min((s + {pt.pw}) / {pt.sw}, {pt.q - 1});",
             "float g = 0.0f;")
        with code.block("for (int pp = p0; pp <= p1; ++pp)"):
            with code.block("for (int qq = q0; qq <= q1; ++qq)"):
                code(f"const {ix} o = {_at(pt, pt.p, pt.q, 'pp', 'qq')};",
                     f"const int tap = (r - (pp * {pt.sh} - {pt.ph})) * {pt.kw} + (s - (qq * {pt.sw} - {pt.pw}));")
                code(f"if ((int)ix[o] == tap) g += {st.load('gy', 'o')};")
        code(f"{st.store('gx', 'e', 'g')};")
    return Kernel(name, (st.buf("gy"), Buf("ix", "unsigned char"), st.buf("gx", readonly=False)), code.text(),
                  (THREADS, 1, 1), comment=f"max pool backward: each input's gradient gathered from its windows, "
                  f"{pt.tag()}")


def pool_program(pt: PoolTrain) -> PoolProgram:
    """The two kernels and their launches (one each)."""
    fk, bk = forward_kernel(pt), backward_kernel(pt)
    fwd = Launch(fk.name, (cdiv(pt.y_size, THREADS), 1, 1), fk.block, ("x", "y", "ix"))
    bwd = Launch(bk.name, (cdiv(pt.x_size, THREADS), 1, 1), bk.block, ("gy", "ix", "gx"))
    return PoolProgram((fk, bk), (fwd,), (bwd,))


def title(pt: PoolTrain) -> str:
    return f"max pool (training) {pt.tag()}"


def source(pt: PoolTrain, backend: str) -> str:
    """The program's source for ``backend`` ("cuda" / "opencl"): what ``convforge show`` would print."""
    return render(list(pool_program(pt).kernels), backend, title(pt))


def host_run(backend: Any, pt: PoolTrain, which: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the ``which`` ("forward" / "backward") launch on ``backend`` with NumPy inputs in the layer's
    memory order (tests, the OpenCL path): x (forward), or gy and ix (backward); the outputs are
    poisoned (NaN, ix 0xff) first and come back as float32 (ix as uint8)."""
    from convforge.dtypes import storage_dtype, to_storage

    prog = pool_program(pt)
    program = backend.program(render(list(prog.kernels), backend.name, title(pt)))
    launch = (prog.forward if which == "forward" else prog.backward)[0]
    kernel = next(k for k in prog.kernels if k.name == launch.kernel)
    sizes = {"x": pt.x_size, "gx": pt.x_size, "y": pt.y_size, "gy": pt.y_size, "ix": pt.y_size}
    bufs: dict[str, Any] = {}
    for name in map(str, launch.args):
        if name == "ix":
            raw = arrays.get("ix", np.full(pt.y_size, 0xFF, np.uint8)).astype(np.uint8).ravel()
            bufs[name] = backend.upload(np.concatenate([raw, np.zeros(-len(raw) % 4, np.uint8)]).view(np.float32))
        elif name in arrays:
            bufs[name] = backend.upload(to_storage(np.ascontiguousarray(arrays[name], np.float32).ravel(), pt.dtype))
        else:
            nbytes = sizes[name] * storage_dtype(pt.dtype).itemsize
            bufs[name] = backend.empty(nbytes)
            backend.fill(bufs[name], float("nan"), nbytes, pt.dtype)
    backend.launch(program, backend.function(program, kernel), kernel, launch, [bufs[str(a)] for a in launch.args])
    backend.synchronize()
    out: dict[str, np.ndarray] = {}
    for name, buf in bufs.items():
        if name == "ix":
            words = backend.download(buf, (cdiv(pt.y_size, 4),))
            out[name] = np.ascontiguousarray(words).view(np.uint8)[:pt.y_size].copy()
        else:
            out[name] = backend.download(buf, (sizes[name],), pt.dtype)
    return out
