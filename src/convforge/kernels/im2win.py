"""im2win (Lu et al.): the input rearranged in dot-product-window order on the device, then an
implicit-GEMM-like tiled kernel over the window tensor.

Window tensor ``win[n][c][p][xw][r]`` = padded input row ``p*sh + r*dh`` at column ``xw``, for
``xw < Wwin = (Q-1)*sw + (S-1)*dw + 1``. For output (p, q) and channel c, the R x S dot-product
window is the run ``(q*sw + s*dw)*R + r`` of one row: contiguous when dw = 1. Padding is
materialised, so the GEMM needs no padding checks. Size N*C*P*Wwin*R, against im2col's
N*C*R*S*P*Q (about S/sw times smaller).

The reduction runs in (c, s, r) order; filters are reordered to ``K x C x S x R`` (rows padded to a
multiple of 4 so they always allow float4 loads) by a second small transform kernel.
Ablation switches in the tuning space: ``pf``/``db`` (prefetch + double buffer), ``va`` (vectorised
loads) and the micro-kernel (``tm = tn = 1`` turns it off: one output per thread).
"""

from __future__ import annotations

from convforge.codegen.dialect import Buf, Kernel
from convforge.codegen.meta import cdiv
from convforge.kernels import register
from convforge.kernels.gemm import elementwise, filter_operand, gemm_plan, too_big
from convforge.kernels.sgemm import Operand, gemm_default, gemm_space, layout_ok
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec


def win_width(spec: ConvSpec) -> int:
    return (spec.q - 1) * spec.stride[1] + spec.eff_s


def win_elements(spec: ConvSpec) -> int:
    return spec.n * spec.c * spec.p * win_width(spec) * spec.r


def filter_ld(spec: ConvSpec) -> int:
    """Row length of the reordered filters, padded to a multiple of 4."""
    return cdiv(spec.c * spec.r * spec.s, 4) * 4


def window_operand(spec: ConvSpec) -> Operand:
    """B(k = (c, s, r), column = (n, p, q)) read from the window tensor ``win``."""
    ww, r, s, dw, sw = win_width(spec), spec.r, spec.s, spec.dilation[1], spec.stride[1]
    pq, row = spec.p * spec.q, win_width(spec) * spec.r
    plane = spec.p * row

    def setup(i: str, t: str) -> list[str]:
        return [f"const int {t}_n = {i} / {pq}, {t}_pix = {i} - {t}_n * {pq};",
                f"const int {t}_b = {t}_n * {spec.c * plane} + ({t}_pix / {spec.q}) * {row}"
                f" + ({t}_pix % {spec.q}) * {sw * r};"]

    def load(t: str, k: str, d: str) -> list[str]:
        lines = [f"const int c = ({k}) / {s * r}, j = ({k}) - c * {s * r};"]
        if dw == 1:
            return lines + [f"{d} = win[{t}_b + c * {plane} + j];"]
        return lines + [f"{d} = win[{t}_b + c * {plane} + (j / {r}) * {dw * r} + j % {r}];"]

    def kprep(kt: str, k: str) -> list[str]:
        lines = [f"const int {kt}_c = ({k}) / {s * r}, {kt}_j = ({k}) - {kt}_c * {s * r};"]
        if dw == 1:
            return lines + [f"const int {kt}_off = {kt}_c * {plane} + {kt}_j;"]
        return lines + [f"const int {kt}_off = {kt}_c * {plane} + ({kt}_j / {r}) * {dw * r}"
                        f" + {kt}_j % {r};"]

    def kload(t: str, kt: str, d: str) -> list[str]:
        return [f"{d} = win[{t}_b + {kt}_off];"]

    assert ww > 0
    return Operand(load=load, fast="i", setup=setup, kprep=kprep, kload=kload)


class Im2win(Variant):
    """Window transform of input (and filter reorder) on the device, then the tiled GEMM."""

    offset_ok = True  # and Epilogue.k_total / k_offset
    residual_ok = True  # its store paths honour Epilogue.residual

    name = "im2win"
    specialised = 4
    family = "im2win"
    tolerance = 1e-5
    exact = True

    def _mnk(self, spec: ConvSpec) -> tuple[int, int, int]:
        return spec.k, spec.n * spec.p * spec.q, spec.c * spec.r * spec.s

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        return super().applies(spec, device) or too_big(spec, win_elements(spec), "im2win workspace")

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        out = gemm_space(*self._mnk(spec), device, True, False)
        # Ablation point: micro-kernel off (one output per thread, 16 x 16 block).
        for pf, db in ((1, 1), (0, 0)):
            p = Params(bm=16, bn=16, bk=64, tm=1, tn=1, va=4, vb=1, pf=pf, db=db)
            if layout_ok(p, True, False) and p not in out:
                out.append(p)
        return out

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return gemm_default(*self._mnk(spec), device, True, False)

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 4 * (win_elements(spec) + spec.k * filter_ld(spec))

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        xk, xgrid = self._window_kernel(spec)
        wk, wgrid = self._filter_kernel(spec)
        pre = ((xk, Launch(xk.name, xgrid, xk.block, ("x", "win"))),
               (wk, Launch(wk.name, wgrid, wk.block, ("w", "wt"))))
        ws = (("win", 4 * win_elements(spec)), ("wt", 4 * spec.k * filter_ld(spec)))
        return gemm_plan(self, spec, params, epilogue, window_operand(spec), (Buf("win"),),
                         ("win",), pre, ws, a=filter_operand(spec, "wt", filter_ld(spec)),
                         a_ref="wt")

    @staticmethod
    def _window_kernel(spec: ConvSpec) -> tuple[Kernel, tuple[int, int, int]]:
        (sh, _), (dh, _) = spec.stride, spec.dilation
        pt, pl, ww = spec.pad[0], spec.pad[2], win_width(spec)
        body = [f"const int r = e % {spec.r}, xw = (e / {spec.r}) % {ww};",
                f"const int p = (e / {spec.r * ww}) % {spec.p}, nc = e / {spec.r * ww * spec.p};",
                f"const int iy = p * {sh} + r * {dh} - {pt}, ix = xw - {pl};",
                f"win[e] = ((unsigned)iy < {spec.h}u && (unsigned)ix < {spec.w}u)"
                f" ? x[nc * {spec.h * spec.w} + iy * {spec.w} + ix] : 0.0f;"]
        return elementwise("im2win_input", win_elements(spec),
                           (Buf("x"), Buf("win", readonly=False)), body,
                           "im2win: N x C x P x Wwin x R window tensor")

    @staticmethod
    def _filter_kernel(spec: ConvSpec) -> tuple[Kernel, tuple[int, int, int]]:
        ld, crs, rs = filter_ld(spec), spec.c * spec.r * spec.s, spec.r * spec.s
        body = [f"const int k = e / {ld}, j = e % {ld};",
                f"const int c = j / {rs}, s = (j % {rs}) / {spec.r}, r = j % {spec.r};",
                f"wt[e] = j < {crs} ? w[k * {crs} + c * {rs} + r * {spec.s} + s] : 0.0f;"]
        return elementwise("im2win_filter", spec.k * ld, (Buf("w"), Buf("wt", readonly=False)),
                           body, "filters reordered to K x (C x S x R), rows padded to 4")


register(Im2win())
