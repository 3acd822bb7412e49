"""dgrad's exact baseline.

``dgrad_direct`` is the exact baseline of the pass: one thread per input element (n, c, h, w) sums
dy[n, k, p, q] . w[k, c, r, s] over the taps that reach it, for any stride, dilation, padding and
groups. For a tap (r, s), h + pt - r*dh must be a multiple of the stride: p = (h + pt - r*dh) / sh.
It is what the tuner verifies faster dgrad variants against past the reference's slice.
"""

from __future__ import annotations

from convforge.codegen.dialect import Kernel, Storage
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
    """One thread per element of dx; bw x bh threads per block over (w, h), the (n, c) planes along
    the grid's x (N*C passed CUDA's 65535 in z: a fully-connected layer of 4100 inputs at N=20)."""

    name = "dgrad_direct"
    family = "direct"
    passes = frozenset({"dgrad"})
    grouped = True
    exact = True
    tolerance = 1e-5
    # half storage (FP32 sums): a half layer no faster form serves (small grouped, strided and dilated ones)
    # runs on convforge's kernels; a large one is handed to PyTorch (dispatch.slow_reason)
    dtypes = frozenset({"float32", "float16", "bfloat16"})

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
        st = Storage(spec.dtype)
        code = Code()
        tiles_x = cdiv(spec.w, params.bw)
        if tiles_x == 1:
            code("const int nc = GROUP_ID(0);  // (n, c) planes along x: N*C may pass 65535",
                 "const int ix = LOCAL_ID(0);")
        else:
            code(f"const int nc = GROUP_ID(0) / {tiles_x};  // (n, c) planes along x: N*C may pass 65535",
                 f"const int ix = (GROUP_ID(0) % {tiles_x}) * {params.bw} + LOCAL_ID(0);")
        code(f"const int iy = GROUP_ID(1) * {params.bh} + LOCAL_ID(1);",
             f"const int n = nc / {spec.c}, c = nc % {spec.c};",
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
                             f"acc = FMA({st.load('y', f'((n * {spec.k} + k) * {spec.p} + p) * {spec.q} + q')},"
                             f" {st.load('w', f'(k * {cg} + cl) * {rs} + r * {spec.s} + s')}, acc);")
            code(st.store("x", f"((n * {spec.c} + c) * {spec.h} + iy) * {spec.w} + ix", "acc") + ";")
        name = "dgrad_direct"
        block = (params.bw, params.bh, 1)
        kernel = Kernel(name, (st.buf("y"), st.buf("w"), st.buf("x", readonly=False)), code.text(), block,
                        comment=f"dgrad_direct: {params.short()}")
        grid = (tiles_x * spec.n * spec.c, cdiv(spec.h, params.bh), 1)
        return Plan(self.name, self.family, spec, params, (kernel,), (Launch(name, grid, block, ("y", "w", "x")),),
                    tolerance=self.tolerance, epilogue=epilogue)


register(DgradDirect())
