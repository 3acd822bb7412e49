"""Non-fused Winograd whose alpha^2-batched GEMM runs on the wgmma generator.

    filter transform  U[e][k][c] = (G g G^T)[e]     alpha^2 x K x Cp, weight-only step
    input transform   V[e][t][c] = (B^T d B)[e]     alpha^2 x T x Cp (T: tiles of every image)
    batched GEMM      M[z][e][k][t] = sum_c V[e][t][c] U[e][k][c]      (z: split-K slice)
    output transform  y = A^T (sum_z M[z]) A, with bias, residual, ReLU, channel offset, dtype

Transforms in FP32 (the matrices of kernels/winograd/matrices.py, straight-line code from
kernels/winograd/tiles.py); U and V are stored in the GEMM's math mode (rounded once), both
K-major in C as every wgmma operand; M stays FP32. One thread per (tile, channel) with the channel
fastest, so V and U are written coalesced; the output transform takes one (filter, tile) per thread,
tiles fastest (M read coalesced).

Errors (NumPy emulation of the roundings, tests/test_tensorcore_gen.py; 3x3, C 64 and 256):

    F(2x2): TF32 operands 5.0e-4 on float32 layers (class "relaxed"); float16 layers with FP16
            operands 5.4e-4 (the output's own rounding: 2.1e-4); bfloat16 layers with TF32 operands
            1.7e-3, the output's rounding alone (BF16 operands would give 4.3e-3)
    F(4x4): TF32 operands 3.2e-3 on float32 layers, FP16 operands 3.1e-3 on float16 layers, TF32
            operands 3.5e-3 on bfloat16 layers: 6-7x F(2x2)'s (the output transform's entries up to
            8 amplify the operands' rounding). Registered for every dtype; the class decides: the
            relaxed class's 1e-3 on float32 and float16 layers refuses it by its stated error (a
            looser max_error admits it), on bfloat16 layers the tuner measures it against 2x the
            layer's most accurate candidate. 3xTF32 operands: the FP32 transforms' own error,
            FP32-grade (class "fp32")
    F(2x2) 3xTF32: FP32-grade (class "fp32")
"""

from __future__ import annotations

import itertools

from convforge.codegen.dialect import Buf, Dim3, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.tensorcore.sm90 import prep, tiles
from convforge.kernels.tensorcore.sm90.epilogue import CTYPE, Output, from_float, to_float
from convforge.kernels.tensorcore.sm90.isa import TF32, X3TF32, Math, device_reason, math_for
from convforge.kernels.tensorcore.sm90.kernel import gemm_kernel
from convforge.kernels.tensorcore.sm90.operands import DenseRows
from convforge.kernels.tensorcore.sm90.smem import MAX_SHARED
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig
from convforge.kernels.winograd.nonfused import expected_error as fp32_expected
from convforge.kernels.winograd.nonfused import winograd_applies
from convforge.kernels.winograd.tiles import (
    Geometry,
    emit_filter_transform,
    emit_input_transform,
    emit_output_transform,
    emit_tile_masks,
    emit_tile_origin,
)
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

_TB = 256  # threads of a transform block
_INT_LIMIT = 2**31 - 1
# Stated relative L2 errors per (tile size m, storage dtype) of the single-product variants, from the
# NumPy emulation (module docstring); 3xTF32 adds ~1e-7 to the FP32 transforms' own error.
EXPECTED = {(2, "float32"): 5e-4, (2, "float16"): 5.4e-4, (2, "bfloat16"): 1.7e-3,
            (4, "float32"): 3.2e-3, (4, "float16"): 3.1e-3, (4, "bfloat16"): 3.5e-3}
# The check's bound per (m, dtype): about 3x the stated error, at least the dtype's half tolerance.
TOLERANCE = {(2, "float32"): 1e-3, (2, "float16"): 2e-3, (2, "bfloat16"): 1.6e-2,
             (4, "float32"): 1e-2, (4, "float16"): 1e-2, (4, "bfloat16"): 1.6e-2}
X3_TOLERANCE = 1e-5


class TcWinograd(Variant):
    """Non-fused Winograd F(m x m) with the batched GEMM on the wgmma generator (module docstring)."""

    family = "winograd"
    backends = frozenset({"cuda"})
    exact = False
    residual_ok = True
    offset_ok = True
    space_lead = 6

    def __init__(self, m: int, x3: bool, dtypes: frozenset[str], precision: str, specialised: int) -> None:
        self.m, self.x3, self.dtypes, self.precision, self.specialised = m, x3, dtypes, precision, specialised
        self.name = f"tc_winograd_f{m}" + ("_3xtf32" if x3 else "")
        self.tolerance = X3_TOLERANCE if x3 else TOLERANCE[m, "float32"]

    def math(self, spec: ConvSpec) -> Math:
        """float32: TF32 (3xTF32); float16: FP16; bfloat16: TF32 (BF16 operands would add 2.5x the
        output's own rounding error)."""
        if self.x3:
            return X3TF32
        return TF32 if spec.dtype == "bfloat16" else math_for(spec.dtype)

    def expected_error(self, spec: ConvSpec) -> float:
        if self.x3:
            return fp32_expected(self.m, spec.r, spec.s) + 2e-7
        return EXPECTED.get((self.m, spec.dtype), 1e-2)

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device) or device_reason(device) or winograd_applies(spec, self.m, 6)
        if why:
            return why
        if spec.r == 1 and spec.s == 1:
            return "1x1 filters: Winograd saves no multiplications"
        if not self.x3 and max(spec.r, spec.s) > 3:
            return f"F({self.m}) on filters above 3x3 exceeds the relaxed bound with one TF32/FP16 product"
        g, cp = Geometry(spec, self.m), prep.padded_channels(spec.c, self.math(spec))
        if 4 * g.a2 * max(cp, spec.k) * max(g.tiles, spec.k) > _INT_LIMIT:
            return "workspace larger than 2^31 bytes (32-bit indexing)"
        return None

    # -- parameters ---------------------------------------------------------------------------
    def problem(self, spec: ConvSpec) -> Problem:
        g = Geometry(spec, self.m)
        return Problem(g.tiles, spec.k, prep.padded_channels(spec.c, self.math(spec)), g.a2)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        limit = min(device.shared_optin_bytes, MAX_SHARED)
        return [c.params() for c in tiles.space(self.math(spec), self.problem(spec), device.units, limit)]

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        limit = min(device.shared_optin_bytes, MAX_SHARED)
        return tiles.pick(self.math(spec), self.problem(spec), device.units, limit).params()

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return sum(b for _, b in self._workspace(spec, TileConfig.of(params)))

    def _workspace(self, spec: ConvSpec, cfg: TileConfig) -> tuple[tuple[str, int], ...]:
        math, prob = self.math(spec), self.problem(spec)
        cp, a2 = prob.kred, prob.batch
        out = tuple((_part("wu", p), math.esize * a2 * spec.k * cp) for p in math.parts)
        out += tuple((_part("wv", p), math.esize * a2 * prob.m * cp) for p in math.parts)
        return out + (("wm", 4 * cfg.ks * a2 * spec.k * prob.m),)

    # -- plan ---------------------------------------------------------------------------------
    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        math, prob, cfg = self.math(spec), self.problem(spec), TileConfig.of(params)
        why = cfg.problems(math, prob, min(device.shared_optin_bytes, MAX_SHARED))
        if why:
            raise ValueError(f"{self.name}: {'; '.join(why)}")
        g, cp = Geometry(spec, self.m), prob.kred
        a = DenseRows("a", cfg.a_tile(), math, "wv", rows=g.tiles, ld=cp, kred=cp,
                      batch_stride=g.tiles * cp)
        b = DenseRows("b", cfg.b_tile(), math, "wu", rows=spec.k, ld=cp, kred=cp, batch_stride=spec.k * cp)
        mout = Output("wm", g.tiles, spec.k, g.tiles, slab=spec.k * g.tiles, epi=None)
        gk = gemm_kernel(f"{self.name}_gemm", math, cfg, prob, a, b, mout)
        fk, fgrid = filter_kernel(g, math, cp)
        ik, igrid = input_kernel(g, math, cp)
        ok, ogrid = output_kernel(g, epilogue, cfg.ks)
        names = lambda bufs: tuple(x.name for x in bufs)  # noqa: E731
        steps = (Launch(fk.name, fgrid, fk.block, ("w",) + names(prep.part_buffers("wu", math))),
                 Launch(ik.name, igrid, ik.block, ("x",) + names(prep.part_buffers("wv", math))),
                 Launch(gk.name, (cfg.grid(prob, device.units), 1, 1), gk.block,
                        names(a.args()) + names(b.args()) + ("wm",)),
                 Launch(ok.name, ogrid, ok.block, ("wm",) + _out(spec, epilogue).refs()))
        tol = X3_TOLERANCE if self.x3 else TOLERANCE[self.m, spec.dtype]
        return Plan(self.name, self.family, spec, params, (fk, ik, gk, ok), steps, self._workspace(spec, cfg),
                    tol, epilogue)


def _part(name: str, part: str) -> str:
    return name if part == "hi" else f"{name}_{part}"


def _out(spec: ConvSpec, epi: Epilogue) -> Output:
    pq = spec.p * spec.q
    return Output("y", spec.n * pq, spec.k, pq, spec.dtype, epi.k_total, epi.k_offset, epi=epi)


def _threads(code: Code, total: int, fast: tuple[str, int], slow: str) -> None:
    name, n = fast
    code(f"const int idx = GROUP_ID(0) * {_TB} + LOCAL_ID(0);", f"if (idx >= {total}) return;",
         f"const int {name} = idx % {n}, {slow} = idx / {n};")


def filter_kernel(g: Geometry, math: Math, cp: int) -> tuple[Kernel, Dim3]:
    """U[e][k][c] = (G g G^T)[e] for c < C, 0 for the padding channels: thread (k, c), c fastest."""
    s = g.spec
    rs, total = s.r * s.s, s.k * cp
    code = Code()
    _threads(code, total, ("c", cp), "k")
    code(f"const bool live = c < {s.c};",
         f"const {CTYPE[s.dtype]}* wp = w + (k * {s.c} + (live ? c : 0)) * {rs};")
    for i, j in itertools.product(range(s.r), range(s.s)):
        code(f"const float g{i}_{j} = live ? {to_float(s.dtype, f'wp[{i * s.s + j}]')} : 0.0f;")
    emit_filter_transform(code, g, "g", "u", "gt")
    for i, j in itertools.product(range(g.ah), range(g.aw)):
        code(*prep.rounded_parts(math, "wu", f"{(i * g.aw + j) * total} + idx", f"u{i}_{j}"))
    kern = Kernel("tc_wino_filter", (Buf("w", CTYPE[s.dtype]),) + prep.part_buffers("wu", math), code.text(),
                  (_TB, 1, 1), frozenset({"mma_tf32", "wgmma"}), comment=f"F({g.m}): U = G g G^T as {math.name}")
    return kern, (cdiv(total, _TB), 1, 1)


def input_kernel(g: Geometry, math: Math, cp: int) -> tuple[Kernel, Dim3]:
    """V[e][t][c] = (B^T d B)[e]: thread (t, c), c fastest; padding and channels past C read 0."""
    s = g.spec
    total = g.tiles * cp
    code = Code()
    _threads(code, total, ("c", cp), "t")
    emit_tile_origin(code, g, "t")
    emit_tile_masks(code, g, f"c < {s.c}")
    code(f"const {CTYPE[s.dtype]}* xp = x + (n * {s.c} + (c < {s.c} ? c : 0)) * {s.h * s.w} + iy * {s.w} + ix;")
    for i, j in itertools.product(range(g.ah), range(g.aw)):
        pred = f"((rmask >> {i}) & (cmask >> {j}) & 1u)"
        code(f"const float d{i}_{j} = {pred} ? {to_float(s.dtype, f'xp[{i * s.w + j}]')} : 0.0f;")
    emit_input_transform(code, g, "d", "v", "dt")
    for i, j in itertools.product(range(g.ah), range(g.aw)):
        code(*prep.rounded_parts(math, "wv", f"{(i * g.aw + j) * total} + idx", f"v{i}_{j}"))
    kern = Kernel("tc_wino_input", (Buf("x", CTYPE[s.dtype]),) + prep.part_buffers("wv", math), code.text(),
                  (_TB, 1, 1), frozenset({"mma_tf32", "wgmma"}), comment=f"F({g.m}): V = B^T d B as {math.name}")
    return kern, (cdiv(total, _TB), 1, 1)


def output_kernel(g: Geometry, epi: Epilogue, ks: int) -> tuple[Kernel, Dim3]:
    """y = A^T (sum of the ks slices of M) A per (filter, tile), tiles fastest, with the epilogue and
    the storage dtype's rounding; outputs past P x Q are not stored."""
    s = g.spec
    total = s.k * g.tiles
    out = _out(s, epi)
    code = Code()
    _threads(code, total, ("t", g.tiles), "k")
    for i, j in itertools.product(range(g.ah), range(g.aw)):
        terms = " + ".join(f"wm[{(z * g.a2 + i * g.aw + j) * total} + idx]" for z in range(ks))
        code(f"const float m{i}_{j} = {terms};")
    emit_output_transform(code, g, "m", "o", "mt")
    emit_tile_origin(code, g, "t")
    pq = s.p * s.q
    for i, j in itertools.product(range(g.m), range(g.m)):
        conds = [c for c in (f"oy + {i} < {s.p}" if s.p % g.m else "", f"ox + {j} < {s.q}" if s.q % g.m else "") if c]
        with code.block(f"if ({' && '.join(conds)})" if conds else "/* in the image */"):
            code(f"const int o = {out.offset(f'n * {pq} + (oy + {i}) * {s.q} + ox + {j}', 'k', '0')};",
                 f"y[o] = {from_float(s.dtype, out.value(f'o{i}_{j}', 'k', 'o'))};")
    kern = Kernel("tc_wino_output", (Buf("wm"),) + out.args(), code.text(), (_TB, 1, 1), frozenset({"wgmma"}),
                  comment=f"F({g.m}): y = A^T M A" + (f", the sum of {ks} split slices" if ks > 1 else ""))
    return kern, (cdiv(total, _TB), 1, 1)


register(TcWinograd(2, False, frozenset({"float32", "float16", "bfloat16"}), "relaxed", 7))
register(TcWinograd(2, True, frozenset({"float32"}), "fp32", 6))
register(TcWinograd(4, True, frozenset({"float32"}), "fp32", 7))
register(TcWinograd(4, False, frozenset({"float32", "float16", "bfloat16"}), "relaxed", 5))
