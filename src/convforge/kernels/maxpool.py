"""Max pooling for training, in two kernels: the forward writes each window's maximum and where in
the window it lies (one byte), the backward gathers.

PyTorch's ``max_pool2d`` keeps int64 indices into the input plane and scatters the gradient back
through them; on an H200 its channels-last backward took 0.91 ms of a ResNet-50 N128 FP16 step
(``max_pool2d_with_indices_backward``, docs/NOTES-training.md), about ten times the bytes it moves.
Here (one thread takes a vector of 8 halves or 4 floats of channels in channels-last layers of whole
vectors, :func:`lanes`; windows of up to 25 taps unrolled, every load issued before the first compare:
the looping form, one 2-byte load in flight a thread, ran at a fifth of the copy bandwidth):

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


UNROLL_TAPS = 25  # windows (forward) or window counts (backward) up to this are unrolled: every load issued first


def lanes(pt: PoolTrain) -> int:
    """Channels one thread takes: channels-last layers of whole vectors take 8 halves (one 16-byte
    load) or 4 floats; 1 otherwise (NCHW, odd C)."""
    if pt.layout != "nhwc":
        return 1
    v = 4 if pt.dtype == "float32" else 8
    return v if pt.c % v == 0 else 4 if pt.c % 4 == 0 else 1


def _split(pt: PoolTrain, rows: int, cols: int, ix: str) -> list[str]:
    """Lines naming n, c and the row / column ``r``, ``s`` of linear element ``e`` of an N x C x rows x
    cols tensor in the layer's layout (channels-last: ``e`` counts vectors of :func:`lanes` channels,
    ``cv`` the vector within the pixel, ``c`` its first channel)."""
    if pt.layout == "nhwc":
        v = lanes(pt)
        return [f"const int cv = (int)(e % {pt.c // v}), c = cv * {v};", f"const {ix} t = e / {pt.c // v};",
                f"const int s = (int)(t % {cols}), r = (int)(t / {cols} % {rows});",
                f"const {ix} n = t / {cols * rows};"]
    return [f"const int s = (int)(e % {cols}), r = (int)(e / {cols} % {rows});",
            f"const int c = (int)(e / {cols * rows} % {pt.c});", f"const {ix} n = e / {cols * rows * pt.c};"]


def _at(pt: PoolTrain, rows: int, cols: int, r: str, s: str) -> str:
    """The offset of element (n, c, r, s) of an N x C x rows x cols tensor in the layer's layout, in
    units of :func:`lanes` elements (the vector of channels c .. c + lanes - 1 where channels-last)."""
    if pt.layout == "nhwc":
        return f"((n * {rows} + ({r})) * {cols} + ({s})) * {pt.c // lanes(pt)} + cv"
    return f"((n * {pt.c} + c) * {rows} + ({r})) * {cols} + ({s})"


def _index_type(pt: PoolTrain) -> str:
    return "I64" if pt.x_size > 2**31 - 1 or pt.y_size > 2**31 - 1 else "int"


@contextmanager
def _each_element(code: Code, pt: PoolTrain, rows: int, cols: int, ix: str) -> Iterator[None]:
    """One thread an element (a vector of :func:`lanes` channels) of an N x C x rows x cols tensor: its
    linear index ``e``, the bound check, and n, c, r, s (:func:`_split`); the body goes inside."""
    code(f"const {ix} e = ({ix})GROUP_ID(0) * {THREADS} + LOCAL_ID(0);")
    with code.block(f"if (e < {pt.n * pt.c * rows * cols // lanes(pt)})"):
        code(*_split(pt, rows, cols, ix))
        yield


def _lanes_of(pt: PoolTrain, name: str) -> list[str]:
    """The float lanes of vector local ``name`` (:func:`_load`): itself, a float4's, or two float4s'."""
    v = lanes(pt)
    if v == 1:
        return [name]
    parts = [name] if v == 4 else [name + "a", name + "b"]
    return [f"{p}.{x}" for p in parts for x in "xyzw"]


def _load(pt: PoolTrain, name: str, buf: str, off: str, ok: str | None = None) -> list[str]:
    """Statements declaring vector local ``name`` = the :func:`lanes` values of ``buf`` at vector offset
    ``off`` (zeros where ``ok`` is false: no load)."""
    st, v = Storage(pt.dtype), lanes(pt)
    if v == 1:
        load = st.load(buf, off)
        return [f"const float {name} = {load if ok is None else f'{ok} ? {load} : 0.0f'};"]
    zero = "MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f)"
    if v == 4:
        load = st.vload4(off, buf)
        return [f"const float4 {name} = {load if ok is None else f'{ok} ? {load} : {zero}'};"]
    head = f"float4 {name}a = {zero}, {name}b = {zero};"
    body = f"{st.vload8(name + 'a', name + 'b', off, buf)};"
    return [head, body if ok is None else f"if ({ok}) {body}"]


def _store(pt: PoolTrain, buf: str, values: list[str]) -> str:
    """The statement storing the lanes ``values`` as vector ``e`` of ``buf``."""
    st, v = Storage(pt.dtype), lanes(pt)
    if v == 1:
        return f"{st.store(buf, 'e', values[0])};"
    quads = [f"MAKE_FLOAT4({', '.join(values[i:i + 4])})" for i in range(0, v, 4)]
    return f"{st.vstore4(quads[0], 'e', buf)};" if v == 4 else f"{st.vstore8(quads[0], quads[1], 'e', buf)};"


def _taps_word(pt: PoolTrain, name: str, off: str, ok: str | None = None) -> list[str]:
    """Statements declaring ``name``: the window-tap bytes of vector ``off`` of ix (one byte; a 32-bit
    word of four lanes' bytes, lane k in byte k; two words for 8 lanes), 0 where ``ok`` is false."""
    v = lanes(pt)
    if v == 1:
        return [f"const int {name} = {'' if ok is None else f'!({ok}) ? 0 : '}(int)ix[{off}];"]
    words = v // 4
    out = []
    for i in range(words):
        load = f"((const GLOBAL_PTR unsigned int*)ix)[({off}) * {words} + {i}]"
        out.append(f"const unsigned int {name}{i} = {load if ok is None else f'{ok} ? {load} : 0u'};")
    return out


def _tap_of(pt: PoolTrain, name: str, lane: int) -> str:
    """Lane ``lane``'s tap byte out of :func:`_taps_word`'s locals."""
    if lanes(pt) == 1:
        return name
    return f"(int)(({name}{lane // 4} >> {8 * (lane % 4)}) & 255u)"


def _forward_taps(code: Code, pt: PoolTrain, v: int) -> None:
    """The window's maximum and its tap per lane into m0.., b0..: every tap's load issued first (windows
    of at most UNROLL_TAPS taps), then the comparisons in tap order."""
    taps = [(i, j) for i in range(pt.kh) for j in range(pt.kw)]
    code(f"const int h0 = r * {pt.sh} - {pt.ph}, w0 = s * {pt.sw} - {pt.pw};")
    for t, (i, j) in enumerate(taps):
        code(f"const bool k{t} = (unsigned)(h0 + {i}) < {pt.h}u && (unsigned)(w0 + {j}) < {pt.w}u;")
        code(*_load(pt, f"v{t}", "x", _at(pt, pt.h, pt.w, f"h0 + {i}", f"w0 + {j}"), f"k{t}"))
    code(f"float {', '.join(f'm{ln} = 0.0f' for ln in range(v))};",
         f"int {', '.join(f'b{ln} = 0' for ln in range(v))};",
         "bool any = false;  // the first in-image tap starts each maximum")
    for t in range(len(taps)):
        vals = _lanes_of(pt, f"v{t}")
        if t == 0:  # nothing before it
            with code.block("if (k0)"):
                code(*(f"m{ln} = {vals[ln]};" for ln in range(v)), "any = true;")
            continue
        with code.block(f"if (k{t})"):
            with code.block("if (!any)"):
                code(*(f"m{ln} = {vals[ln]}; b{ln} = {t};" for ln in range(v)), "any = true;")
            with code.block("else"):
                code("// larger, or NaN: PyTorch's rule")
                code(*(f"if ({vals[ln]} > m{ln} || {vals[ln]} != {vals[ln]}) {{ m{ln} = {vals[ln]}; b{ln} = {t}; }}"
                       for ln in range(v)))


def _forward_loop(code: Code, pt: PoolTrain, v: int) -> None:
    """The same as :func:`_forward_taps` for big windows: the in-image taps row by row."""
    code(f"const int h0 = r * {pt.sh} - {pt.ph}, w0 = s * {pt.sw} - {pt.pw};",
         f"const int hs = max(h0, 0), he = min(h0 + {pt.kh}, {pt.h});",
         f"const int ws = max(w0, 0), we = min(w0 + {pt.kw}, {pt.w});")
    code(*_load(pt, "f", "x", _at(pt, pt.h, pt.w, "hs", "ws")))
    first = _lanes_of(pt, "f")
    code(f"float {', '.join(f'm{ln} = {first[ln]}' for ln in range(v))};",
         f"const int b = (hs - h0) * {pt.kw} + (ws - w0);  // the first in-image tap",
         f"int {', '.join(f'b{ln} = b' for ln in range(v))};")
    with code.block("for (int hh = hs; hh < he; ++hh)"):
        with code.block("for (int ww = ws; ww < we; ++ww)"):
            code(*_load(pt, "u", "x", _at(pt, pt.h, pt.w, "hh", "ww")),
                 f"const int tap = (hh - h0) * {pt.kw} + (ww - w0);", "// larger, or NaN: PyTorch's rule")
            vals = _lanes_of(pt, "u")
            code(*(f"if ({vals[ln]} > m{ln} || {vals[ln]} != {vals[ln]}) {{ m{ln} = {vals[ln]}; b{ln} = tap; }}"
                   for ln in range(v)))


def forward_kernel(pt: PoolTrain, name: str = "maxpool_fwd") -> Kernel:
    """The forward: one thread an output element or channel vector (module docstring)."""
    st, ix, v = Storage(pt.dtype), _index_type(pt), lanes(pt)
    code = Code()
    with _each_element(code, pt, pt.p, pt.q, ix):
        (_forward_taps if pt.kh * pt.kw <= UNROLL_TAPS else _forward_loop)(code, pt, v)
        code(_store(pt, "y", [f"m{ln}" for ln in range(v)]))
        if v == 1:
            code("ix[e] = (unsigned char)b0;")
        for i in range(v // 4):
            word = " | ".join(f"((unsigned int)b{4 * i + k} << {8 * k})" for k in range(4))
            code(f"((GLOBAL_PTR unsigned int*)ix)[e * {v // 4} + {i}] = {word};")
    return Kernel(name, (st.buf("x"), st.buf("y", readonly=False), Buf("ix", "unsigned char", readonly=False)),
                  code.text(), (THREADS, 1, 1), comment=f"max pool forward: y and the window tap of each maximum, "
                  f"{pt.tag()}, {v} channel(s) a thread")


def _windows(pt: PoolTrain) -> tuple[int, int]:
    """The most windows holding one input along rows and columns."""
    return cdiv(pt.kh, pt.sh), cdiv(pt.kw, pt.sw)


def backward_kernel(pt: PoolTrain, name: str = "maxpool_bwd") -> Kernel:
    """The backward: one thread an input element or channel vector, gathering (module docstring)."""
    st, ix, v = Storage(pt.dtype), _index_type(pt), lanes(pt)
    code = Code()
    with _each_element(code, pt, pt.h, pt.w, ix):
        code("// the windows holding (r, s): rows p0..p1, columns q0..q1",
             f"const int ar = r + {pt.ph} - {pt.kh - 1}, as = s + {pt.pw} - {pt.kw - 1};",
             f"const int p0 = ar <= 0 ? 0 : (ar + {pt.sh - 1}) / {pt.sh};",
             f"const int p1 = min((r + {pt.ph}) / {pt.sh}, {pt.p - 1});",
             f"const int q0 = as <= 0 ? 0 : (as + {pt.sw - 1}) / {pt.sw};",
             f"const int q1 = min((s + {pt.pw}) / {pt.sw}, {pt.q - 1});",
             f"float {', '.join(f'g{ln} = 0.0f' for ln in range(v))};")
        nh, nw = _windows(pt)
        tap = f"(r - (pp * {pt.sh} - {pt.ph})) * {pt.kw} + (s - (qq * {pt.sw} - {pt.pw}))"
        if nh * nw <= UNROLL_TAPS:  # every window's loads first, then the sums in the loop's order
            for i, j in ((i, j) for i in range(nh) for j in range(nw)):
                t = i * nw + j
                code(f"const bool k{t} = p0 + {i} <= p1 && q0 + {j} <= q1;  // window {t}")
                o = _at(pt, pt.p, pt.q, f"p0 + {i}", f"q0 + {j}")
                code(*_taps_word(pt, f"w{t}_", o, f"k{t}"), *_load(pt, f"d{t}", "gy", o, f"k{t}"))
            for i, j in ((i, j) for i in range(nh) for j in range(nw)):
                t = i * nw + j
                with code.block(f"if (k{t})"):
                    code(f"const int pp = p0 + {i}, qq = q0 + {j}, tap = {tap};")
                    vals = _lanes_of(pt, f"d{t}")
                    code(*(f"if ({_tap_of(pt, f'w{t}_', ln)} == tap) g{ln} += {vals[ln]};" for ln in range(v)))
        else:
            with code.block("for (int pp = p0; pp <= p1; ++pp)"):
                with code.block("for (int qq = q0; qq <= q1; ++qq)"):
                    o = _at(pt, pt.p, pt.q, "pp", "qq")
                    code(f"const int tap = {tap};", *_taps_word(pt, "w_", o), *_load(pt, "d", "gy", o))
                    vals = _lanes_of(pt, "d")
                    code(*(f"if ({_tap_of(pt, 'w_', ln)} == tap) g{ln} += {vals[ln]};" for ln in range(v)))
        code(_store(pt, "gx", [f"g{ln}" for ln in range(v)]))
    return Kernel(name, (st.buf("gy"), Buf("ix", "unsigned char"), st.buf("gx", readonly=False)), code.text(),
                  (THREADS, 1, 1), comment=f"max pool backward: each input's gradient gathered from its windows, "
                  f"{pt.tag()}, {v} channel(s) a thread")


def pool_program(pt: PoolTrain) -> PoolProgram:
    """The two kernels and their launches (one each)."""
    fk, bk = forward_kernel(pt), backward_kernel(pt)
    v = lanes(pt)
    fwd = Launch(fk.name, (cdiv(pt.y_size // v, THREADS), 1, 1), fk.block, ("x", "y", "ix"))
    bwd = Launch(bk.name, (cdiv(pt.x_size // v, THREADS), 1, 1), bk.block, ("gy", "ix", "gx"))
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
