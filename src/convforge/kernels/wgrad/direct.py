"""wgrad (update): the gradient of a convolution's filters, dw[k, c, r, s] = sum over n, p, q of
x[n, c, p*sh + r*dh - pt, q*sw + s*dw - pl] . dy[n, k, p, q].

``wgrad_direct`` is the exact baseline of the pass: one block per filter element; its threads
stride over the N*P*Q terms, then a fixed tree in shared memory adds their partial sums, so the
result is the same on every run (no atomics). Any stride, dilation, padding and groups.
"""

from __future__ import annotations

from convforge.codegen.dialect import Kernel, Storage
from convforge.codegen.meta import Code, halving_tree
from convforge.kernels import register
from convforge.kernels.dgrad import no_epilogue
from convforge.kernels.gemm import too_big
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec


class WgradDirect(Variant):
    """One block of ``bt`` threads per (k, c, r, s); a deterministic shared-memory reduction."""

    name = "wgrad_direct"
    family = "direct"
    passes = frozenset({"wgrad"})
    grouped = True
    exact = True
    tolerance = 1e-5
    # half storage (FP32 sums and tree): a half layer no faster form serves (small grouped, strided and
    # dilated ones) runs on convforge's kernels; a large one is handed to PyTorch (dispatch.slow_reason)
    dtypes = frozenset({"float32", "float16", "bfloat16"})

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        return super().applies(spec, device) or too_big(spec, spec.k * spec.cg * spec.r * spec.s)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        pts = [Params(bt=bt) for bt in (256, 128, 512) if bt <= device.max_threads]
        return pts if device.is_gpu else [Params(bt=64)] + pts

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        bt = params.bt
        if bt & (bt - 1):
            raise ValueError(f"{self.name}: bt ({bt}) must be a power of two")
        (sh, sw), (dh, dw) = spec.stride, spec.dilation
        pt, pl = spec.pad[0], spec.pad[2]
        cg, kg, pq = spec.cg, spec.kg, spec.p * spec.q
        st = Storage(spec.dtype)
        code = Code()
        code(f"SHARED float part[{bt}];",
             "const int t = LOCAL_ID(0);",
             "const int rs = GROUP_ID(0), cl = GROUP_ID(1), k = GROUP_ID(2);",
             f"const int r = rs / {spec.s}, s = rs % {spec.s};",
             f"const int c = (k / {kg}) * {cg} + cl;  // the input channel of k's group",
             "float acc = 0.0f;")
        with code.block(f"for (int e = t; e < {spec.n * pq}; e += {bt})"):
            code(f"const int n = e / {pq}, pq = e % {pq};",
                 f"const int p = pq / {spec.q}, q = pq % {spec.q};",
                 f"const int iy = p * {sh} + r * {dh} - {pt}, ix = q * {sw} + s * {dw} - {pl};")
            with code.block(f"if ((unsigned)iy < {spec.h}u && (unsigned)ix < {spec.w}u)"):
                code(f"acc = FMA({st.load('x', f'((n * {spec.c} + c) * {spec.h} + iy) * {spec.w} + ix')},"
                     f" {st.load('y', f'(n * {spec.k} + k) * {pq} + pq')}, acc);")
        code("part[t] = acc;", "BARRIER();")
        halving_tree(code, bt, "t", lambda h: f"part[t] += part[t + {h}];")
        code(f"if (t == 0) {st.store('w', f'(k * {cg} + cl) * {spec.r * spec.s} + rs', 'part[0]')};")
        name = "wgrad_direct"
        kernel = Kernel(name, (st.buf("x"), st.buf("y"), st.buf("w", readonly=False)), code.text(), (bt, 1, 1),
                        comment=f"wgrad_direct: {params.short()}")
        grid = (spec.r * spec.s, cg, spec.k)
        return Plan(self.name, self.family, spec, params, (kernel,),
                    (Launch(name, grid, (bt, 1, 1), ("x", "y", "w")),), tolerance=self.tolerance,
                    epilogue=epilogue)


register(WgradDirect())

