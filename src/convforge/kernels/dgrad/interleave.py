"""Strided dgrad's phases brought together: one pass that writes every element of dx (NCHW or NHWC) once,
coalesced, from compact per-phase buffers, zeros where no phase holds a value.

A strided dgrad computes dx phase by phase: the pixels (ph + sh a, pw + sw b) of one phase (ph, pw)
form a dense sub-grid, which a GEMM writes compact into its own buffer (N x C x bh x bw, full
vector stores). Written straight into dx instead, every second column of a row is a partial 32-byte
sector that the L2 must fill from DRAM first, several times the bytes of dx (docs/NOTES-gemm.md,
docs/NOTES-tensorcore.md). This pass reads each
phase buffer once and writes dx once, in order.

:class:`Part` maps a phase's dx pixel (ph + sh a, pw + sw b) to buffer row a + oh, column b + ow
(valid below bh, bw): the wgmma strided dgrad's phases have oh = ow = 0 and bh x bw = the phase's
sub-grid; a 1x1 filter at stride s has one phase (the dx rows with (h + pt) % sh == 0) whose buffer
is the stride-1 dgrad of the P x Q grid (oh = (ph + pt) / sh).
"""

from __future__ import annotations

from dataclasses import dataclass

from convforge.codegen.dialect import Buf, Kernel
from convforge.kernels.gemm import elementwise
from convforge.spec import ConvSpec

CTYPE = {"float32": "float", "float16": "unsigned short", "bfloat16": "unsigned short"}


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

    def read(self, nhwc: int = 0) -> list[str]:
        """C lines that set ``v`` from this buffer, for the thread's (a, b) and its plane ``nc`` (NCHW:
        N x C x bh x bw) or, with ``nhwc`` = C, its image ``n`` and channel ``c`` (N x bh x bw x C)."""
        r = f"a + {self.oh}" if self.oh else "a"
        q = f"b + {self.ow}" if self.ow else "b"
        bounds = [f"{r} < {self.bh}", f"{q} < {self.bw}"]
        at = (f"((n * {self.bh} + {r}) * {self.bw} + {q}) * {nhwc} + c" if nhwc
              else f"(nc * {self.bh} + {r}) * {self.bw} + {q}")
        return [f"if ({' && '.join(bounds)}) v = {self.buf}[{at}];"]


def interleave_kernel(name: str, spec: ConvSpec, parts: list[Part]) -> tuple[Kernel, tuple[int, int, int]]:
    """Every dx element from its phase's buffer (zero for phases without one): one thread per dx
    element, consecutive threads consecutive columns, so the stores are coalesced and the reads of a
    warp are ``sw`` runs of consecutive buffer elements."""
    sh, sw = spec.stride
    if len({(p.ph, p.pw) for p in parts}) != len(parts):
        raise ValueError(f"{name}: two buffers for one phase")
    for p in parts:
        if not (0 <= p.ph < sh and 0 <= p.pw < sw and p.oh >= 0 and p.ow >= 0):
            raise ValueError(f"{name}: phase ({p.ph}, {p.pw}) offset ({p.oh}, {p.ow}) outside stride {spec.stride}")
    ctype = CTYPE[spec.dtype]
    hw = spec.h * spec.w
    nhwc = spec.c if spec.layout == "nhwc" else 0  # channels-last dx and phase buffers: channels fastest
    if nhwc:
        body = [f"const int c = e % {spec.c}, ww = e / {spec.c} % {spec.w}, hh = e / {spec.c * spec.w} % {spec.h};",
                f"const int n = e / {spec.c * hw};"]
    else:
        body = [f"const int ww = e % {spec.w}, hh = e / {spec.w} % {spec.h}, nc = e / {hw};"]
    body += [f"const int a = hh / {sh}, ph = hh - a * {sh}, b = ww / {sw}, pw = ww - b * {sw};",
             f"{ctype} v = 0;"]
    for i, p in enumerate(parts):
        body.append(f"{'else ' if i else ''}if (ph == {p.ph} && pw == {p.pw}) {{")
        body += ["  " + line for line in p.read(nhwc)]
        body.append("}")
    body.append("x[e] = v;")
    bufs = tuple(Buf(p.buf, ctype) for p in parts) + (Buf("x", ctype, readonly=False),)
    held = ", ".join(f"({p.ph}, {p.pw})" for p in parts)
    return elementwise(name, spec.n * spec.c * hw, bufs, body,
                       f"dgrad: dx from the compact buffers of phases {held}, zeros elsewhere")
