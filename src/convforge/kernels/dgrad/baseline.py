"""dgrad's exact baseline.

``dgrad_direct`` is the exact baseline of the pass: one thread per input element (n, c, h, w) sums
dy[n, k, p, q] . w[k, c, r, s] over the taps that reach it, for any stride, dilation, padding and
groups. For a tap (r, s), h + pt - r*dh must be a multiple of the stride: p = (h + pt - r*dh) / sh.
It is what the tuner verifies faster dgrad variants against past the reference's slice.
"""

from __future__ import annotations

from convforge.codegen.dialect import Buf, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.gemm import too_big
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec


def no_epilogue(name: str, epilogue: Epilogue) -> None:
    """Backward passes write a plain gradient: refuse any epilogue by name."""
    if epilogue != Epilogue():
        raise ValueError(f"unsupported epilogue: {name} writes a gradient, not {epilogue.tag()}")


class DgradDirect(Variant):
    """One thread per element of dx; bw x bh threads per block over (w, h), one block row per (n, c)."""

    name = "dgrad_direct"
    family = "direct"
    passes = frozenset({"dgrad"})
    grouped = True
    exact = True
    tolerance = 1e-5

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        return super().applies(spec, device) or too_big(spec, spec.k * spec.cg * spec.r * spec.s)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        pts = [Params(bw=bw, bh=bh) for bw, bh in ((32, 4), (32, 8), (16, 8), (64, 2), (8, 8))
               if bw * bh <= device.max_threads]
        return pts if device.is_gpu else [Params(bw=8, bh=4)] + pts

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        (sh, sw), (dh, dw) = spec.stride, spec.dilation
        pt, pl = spec.pad[0], spec.pad[2]
        cg, kg, rs = spec.cg, spec.kg, spec.r * spec.s
        code = Code()
        code(f"const int ix = GROUP_ID(0) * {params.bw} + LOCAL_ID(0);",
             f"const int iy = GROUP_ID(1) * {params.bh} + LOCAL_ID(1);",
             f"const int n = GROUP_ID(2) / {spec.c}, c = GROUP_ID(2) % {spec.c};",
             f"const int g = c / {cg}, cl = c % {cg};  // group, channel within it",
             "float acc = 0.0f;")
        with code.block(f"if (ix < {spec.w} && iy < {spec.h})"):
            with code.block(f"for (int r = 0; r < {spec.r}; ++r)"):
                code(f"const int ty = iy + {pt} - r * {dh};",
                     f"if (ty < 0 || ty % {sh} != 0 || ty / {sh} >= {spec.p}) continue;",
                     f"const int p = ty / {sh};")
                with code.block(f"for (int s = 0; s < {spec.s}; ++s)"):
                    code(f"const int tx = ix + {pl} - s * {dw};",
                         f"if (tx < 0 || tx % {sw} != 0 || tx / {sw} >= {spec.q}) continue;",
                         f"const int q = tx / {sw};")
                    with code.block(f"for (int kk = 0; kk < {kg}; ++kk)"):
                        code(f"const int k = g * {kg} + kk;",
                             f"acc = FMA(y[((n * {spec.k} + k) * {spec.p} + p) * {spec.q} + q],"
                             f" w[(k * {cg} + cl) * {rs} + r * {spec.s} + s], acc);")
            code(f"x[((n * {spec.c} + c) * {spec.h} + iy) * {spec.w} + ix] = acc;")
        name = "dgrad_direct"
        block = (params.bw, params.bh, 1)
        kernel = Kernel(name, (Buf("y"), Buf("w"), Buf("x", readonly=False)), code.text(), block,
                        comment=f"dgrad_direct: {params.short()}")
        grid = (cdiv(spec.w, params.bw), cdiv(spec.h, params.bh), spec.n * spec.c)
        return Plan(self.name, self.family, spec, params, (kernel,), (Launch(name, grid, block, ("y", "w", "x")),),
                    tolerance=self.tolerance, epilogue=epilogue)


register(DgradDirect())
