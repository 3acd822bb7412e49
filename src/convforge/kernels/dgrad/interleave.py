"""Strided dgrad's phases brought together: one pass that writes every element of dx (NCHW or NHWC) once,
coalesced, from compact per-phase buffers, zeros where no phase holds a value.

A strided dgrad computes dx phase by phase: the pixels (ph + sh a, pw + sw b) of one phase (ph, pw)
form a dense sub-grid, which a GEMM writes compact into its own buffer (N x C x bh x bw, full
vector stores). Written straight into dx instead, every second column of a row is a partial 32-byte
sector that the L2 must fill from DRAM first, several times the bytes of dx (docs/NOTES-gemm.md,
docs/NOTES-tensorcore.md). This pass reads each
phase buffer once and writes dx once, in order: a thread writes 8 (or 4) consecutive dx elements with
one vector store where a row (NCHW) or a pixel's channels (NHWC) hold whole vectors, so each thread
keeps several loads in flight (one element a thread left the pass at about a third of the copy
bandwidth on the H200: too few bytes in flight).

:class:`Part` maps a phase's dx pixel (ph + sh a, pw + sw b) to buffer row a + oh, column b + ow
(valid below bh, bw): the wgmma strided dgrad's phases have oh = ow = 0 and bh x bw = the phase's
sub-grid; a 1x1 filter at stride s has one phase (the dx rows with (h + pt) % sh == 0) whose buffer
is the stride-1 dgrad of the P x Q grid (oh = (ph + pt) / sh).
"""

from __future__ import annotations

from dataclasses import dataclass

from convforge.codegen.dialect import Kernel, Storage
from convforge.kernels.gemm import elementwise
from convforge.spec import ConvSpec


@dataclass(frozen=True)
class Part:
    """One phase's compact buffer ``buf`` (N x C x bh x bw): dx pixel (ph + sh a, pw + sw b) is its
    element (a + oh, b + ow) where that lies inside bh x bw."""

    buf: str
    ph: int
    pw: int
    bh: int
    bw: int
    oh: int = 0
    ow: int = 0

    def elements(self, spec: ConvSpec) -> int:
        return spec.n * spec.c * self.bh * self.bw

    def at(self, q: str, nhwc: int = 0) -> tuple[str, str]:
        """(bounds, index) of this buffer's element for the thread's row ``a``, buffer column ``q``
        (before ``ow``) and plane ``nc`` (NCHW: N x C x bh x bw) or, with ``nhwc`` = C, its image ``n``
        and channel ``c`` (N x bh x bw x C)."""
        r = f"a + {self.oh}" if self.oh else "a"
        q = f"{q} + {self.ow}" if self.ow else q
        bounds = f"{r} < {self.bh} && {q} < {self.bw}"
        at = (f"((n * {self.bh} + {r}) * {self.bw} + {q}) * {nhwc} + c" if nhwc
              else f"(nc * {self.bh} + {r}) * {self.bw} + {q}")
        return bounds, at


def vector_width(spec: ConvSpec) -> int:
    """dx elements a thread writes: 8 or 4 where a dx row (NCHW) or a pixel's channels (NHWC) hold
    whole vectors (the stores aligned), else 1."""
    run = spec.c if spec.layout == "nhwc" else spec.w
    return next((v for v in (8, 4) if run % v == 0), 1)


def _select(cases: list[tuple[str, str]]) -> list[str]:
    """An if / else-if chain of (condition, statement) pairs."""
    return [f"{'else ' if i else ''}if ({cond}) {{ {line} }}" for i, (cond, line) in enumerate(cases)]


def _take(st: Storage, p: Part, q: str, var: str, nhwc: int = 0) -> str:
    """``var`` = part ``p``'s element at buffer column ``q`` where it lies inside the buffer."""
    bounds, at = p.at(q, nhwc)
    return f"if ({bounds}) {var} = {st.load(p.buf, at)};"


def _nchw_body(spec: ConvSpec, parts: list[Part], vec: int) -> list[str]:
    """A thread's ``vec`` consecutive dx elements of one row of one plane: each from its phase's
    buffer (the column phase fixed per element where ``vec`` is a multiple of sw)."""
    sh, sw = spec.stride
    st = Storage(spec.dtype)
    body = [f"const int e0 = e * {vec};  // the first of the thread's {vec} dx elements (one row)",
            f"const int w0 = e0 % {spec.w}, hh = e0 / {spec.w} % {spec.h}, nc = e0 / {spec.h * spec.w};",
            f"const int a = hh / {sh}, ph = hh - a * {sh};"]
    for j in range(vec):
        body.append(f"float v{j} = 0.0f;")
        if vec % sw == 0:  # w0 is a multiple of sw: element j's column phase is j % sw, its column w0 / sw + j / sw
            q = f"w0 / {sw} + {j // sw}" if j // sw else f"w0 / {sw}"
            body += _select([(f"ph == {p.ph}", _take(st, p, q, f"v{j}")) for p in parts if p.pw == j % sw])
        else:
            body.append(f"const int b{j} = (w0 + {j}) / {sw}, pw{j} = w0 + {j} - b{j} * {sw};")
            body += _select([(f"ph == {p.ph} && pw{j} == {p.pw}", _take(st, p, f"b{j}", f"v{j}")) for p in parts])
    vals = [f"v{j}" for j in range(vec)]
    if vec == 1:
        return body + [st.store("x", "e", "v0") + ";"]
    quad = [f"MAKE_FLOAT4({', '.join(vals[i:i + 4])})" for i in range(0, vec, 4)]
    return body + [(st.vstore8(quad[0], quad[1], "e", "x") if vec == 8 else st.vstore4(quad[0], "e", "x")) + ";"]


def _nhwc_body(spec: ConvSpec, parts: list[Part], vec: int) -> list[str]:
    """A thread's ``vec`` consecutive channels of one dx pixel, from its phase's buffer (one vector load)."""
    sh, sw = spec.stride
    st = Storage(spec.dtype)
    c, hw = spec.c, spec.h * spec.w
    body = [f"const int e0 = e * {vec};  // the first of the thread's {vec} channels of one dx pixel",
            f"const int c = e0 % {c}, ww = e0 / {c} % {spec.w}, hh = e0 / {c * spec.w} % {spec.h};",
            f"const int n = e0 / {c * hw};",
            f"const int a = hh / {sh}, ph = hh - a * {sh}, b = ww / {sw}, pw = ww - b * {sw};"]
    which = [f"ph == {p.ph} && pw == {p.pw}" for p in parts]
    if vec == 1:
        body.append("float v0 = 0.0f;")
        body += _select([(w, _take(st, p, "b", "v0", c)) for w, p in zip(which, parts)])
        return body + [st.store("x", "e", "v0") + ";"]

    def load(p: Part) -> str:
        bounds, at = p.at("b", c)
        off = f"({at}) / {vec}"  # whole vectors: C and c are multiples of vec
        get = st.vload8("lo", "hi", off, p.buf) if vec == 8 else f"lo = {st.vload4(off, p.buf)}"
        return f"if ({bounds}) {get};"

    body.append("float4 lo = MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f), hi = lo;")
    body += _select([(w, load(p)) for w, p in zip(which, parts)])
    return body + [(st.vstore8("lo", "hi", "e", "x") if vec == 8 else st.vstore4("lo", "e", "x")) + ";"]


def interleave_kernel(name: str, spec: ConvSpec, parts: list[Part]) -> tuple[Kernel, tuple[int, int, int]]:
    """Every dx element from its phase's buffer (zero for phases without one): consecutive threads
    write consecutive vectors of dx (:func:`vector_width`), so the stores are coalesced and the
    reads of a warp are runs of consecutive buffer elements."""
    sh, sw = spec.stride
    if len({(p.ph, p.pw) for p in parts}) != len(parts):
        raise ValueError(f"{name}: two buffers for one phase")
    for p in parts:
        if not (0 <= p.ph < sh and 0 <= p.pw < sw and p.oh >= 0 and p.ow >= 0):
            raise ValueError(f"{name}: phase ({p.ph}, {p.pw}) offset ({p.oh}, {p.ow}) outside stride {spec.stride}")
    st = Storage(spec.dtype)
    vec = vector_width(spec)
    body = _nhwc_body(spec, parts, vec) if spec.layout == "nhwc" else _nchw_body(spec, parts, vec)
    bufs = tuple(st.buf(p.buf) for p in parts) + (st.buf("x", readonly=False),)
    held = ", ".join(f"({p.ph}, {p.pw})" for p in parts)
    return elementwise(name, spec.n * spec.c * spec.h * spec.w // vec, bufs, body,
                       f"dgrad: dx from the compact buffers of phases {held}, zeros elsewhere "
                       f"({vec} element{'s' if vec > 1 else ''} a thread)")
