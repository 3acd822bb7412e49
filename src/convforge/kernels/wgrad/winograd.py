"""Winograd update (Lavin & Gray; Nervana's update kernels): wgrad of 3x3 stride-1 layers by
F(3x3, m x m), m = 2 or 4, alpha = m + 2, in four generated kernels.

In one dimension a tile's contribution dw[j] = sum_{i<m} dy[i] d[i + j] (j < 3) is a correlation
of the alpha inputs d with the m-tap "filter" dy giving 3 outputs: F(3, m). With its matrices
(A^T 3 x alpha, G alpha x m, B^T alpha x alpha) and the sum over tiles moved inside (it is linear):

    dW[k][c] = A^T [ sum over tiles t of (G dY[k,t] G^T) * (B^T X[c,t] B) ] A

    input transform     V[e][c][t] = (B^T d B)[e]                 alpha^2 x C x T
    gradient transform  U[e][k][t] = (G g G^T)[e]   (m x m dy tile) alpha^2 x K x T
    batched GEMM        M[z][e][k][c] = sum over t in slice z of U[e][k][t] V[e][c][t]
    output transform    dW[k][c] = A^T (sum over z of M[z][e][k][c]) A  (3 x 3)

B^T is F(m, 3)'s (the same points and alpha). The rows of G are scaled to coprime integers and
the columns of A^T divided by the same factors (:func:`update_transform`), so the transform run per
(k, tile) has integer coefficients and the fractions are applied once per (k, c). Tiles of every
image form one index t (superblocking); T is padded to a multiple of 4 with zero tiles, so both
GEMM operands are read as float4s along t. The GEMM (kernels/sgemm.py) splits the tile reduction
into ``ks`` slices; the output transform adds the slices in order: deterministic.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from functools import cache

from convforge.codegen.dialect import Buf, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.dgrad import no_epilogue
from convforge.kernels.sgemm import (
    GemmShape,
    Operand,
    Store,
    gemm_block,
    gemm_default,
    gemm_grid,
    gemm_kernel,
    gemm_space,
)
from convforge.kernels.wgrad.common import (
    INT_LIMIT,
    pick_split,
    reduce_kernel,
    slice_len,
    splits,
    sum_tolerance,
)
from convforge.kernels.winograd.matrices import Matrix, emit_2d, winograd
from convforge.kernels.winograd.tiles import Geometry, emit_tile_load, emit_tile_masks, emit_tile_origin
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

# Relative L2 error at the GPU defaults' splits on ResNet layers: what the precision rule states
# before a layer is tuned (both fp32-grade; docs/NOTES-wgrad.md). F(4x4)'s error grows with the tiles
# one running sum adds, so the defaults keep a running sum within _SLICE tiles.
_EXPECTED = {2: 5e-7, 4: 2.5e-6}
_TOLERANCE = {2: 1e-5, 4: 2e-5}
_SLICE = {2: 2048, 4: 400}
# Up to this many slices of M the output transform adds itself; more go through reduce_kernel first
# (one thread per element of M instead of one per (k, c): 128 slices of a 64 x 64 M summed by 4096
# threads kept 16 SMs busy for most of the plan's time).
_INLINE_SLICES = 2


@cache
def update_transform(m: int, r: int = 3) -> tuple[Matrix, Matrix, Matrix]:
    """(A^T, G, B^T) of the update F(r, m): r filter-gradient outputs from an m-tap dy tile,
    alpha = m + r - 1, with G's rows scaled to coprime integers (leading entry positive) and A^T's
    columns divided by the same factors (exact Fractions: the product is unchanged)."""
    t = winograd(r, m)
    scales = []
    for row in t.G:
        nz = [v for v in row if v != 0]
        den = math.lcm(*(v.denominator for v in nz))
        sc = Fraction(den, math.gcd(*(int(v * den) for v in nz)))
        scales.append(sc if nz[0] > 0 else -sc)
    g = tuple(tuple(v * sc for v in row) for row, sc in zip(t.G, scales, strict=True))
    at = tuple(tuple(v / sc for v, sc in zip(row, scales, strict=True)) for row in t.AT)
    return at, g, t.BT


class WgradWinograd(Variant):
    """F(3x3, m x m) update: transforms of input and gradient tiles, alpha^2 batched GEMMs over the
    tiles (split, deterministic), the filter-gradient output transform."""

    family = "winograd"
    passes = frozenset({"wgrad"})
    space_lead = 8

    def __init__(self, m: int) -> None:
        self.m = m
        self.name = f"wgrad_winograd_f{m}"
        self.specialised = 8 if m == 4 else 7
        self.tolerance = _TOLERANCE[m]

    def expected_error(self, spec: ConvSpec) -> float:
        return _EXPECTED[self.m]

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why:
            return why
        if (spec.r, spec.s) != (3, 3):
            return f"the Winograd update F(3x3, {self.m}x{self.m}) takes 3x3 filters only"
        if spec.stride != (1, 1) or spec.dilation != (1, 1):
            return f"the Winograd update needs stride 1 and dilation 1, got {spec.stride}, {spec.dilation}"
        a2 = (self.m + 2) ** 2
        if a2 * max(spec.k, spec.c) * self._t4(spec) > INT_LIMIT:
            return "workspace larger than 2^31 elements (32-bit indexing)"
        return None

    # -- geometry --------------------------------------------------------------------------
    def _geo(self, spec: ConvSpec) -> Geometry:
        return Geometry(spec, self.m)

    def _t4(self, spec: ConvSpec) -> int:
        """Tiles padded to a multiple of 4 (the GEMM reads float4s along them)."""
        return cdiv(self._geo(spec).tiles, 4) * 4

    def _a2(self) -> int:
        return (self.m + 2) ** 2

    # -- parameters ------------------------------------------------------------------------
    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The SGEMM default tile for K x C (128 x 64 where K > 64, a little faster than 128 x 128),
        the tile reduction split by :func:`pick_split` into half a wave (near the best split on
        every layer swept) with running sums within _SLICE tiles; transforms in blocks of 256
        threads (64 on CPUs)."""
        t4 = self._t4(spec)
        prefer = ((128, 64, 8, 8, 8),) if device.is_gpu and spec.k > 64 and spec.c >= 64 else ()
        p = gemm_default(spec.k, spec.c, t4, device, True, True, "k", "k", prefer=prefer)
        tiles = cdiv(spec.k, p.bm) * cdiv(spec.c, p.bn) * self._a2()
        ks = pick_split(tiles, gemm_block(p)[0], t4, device, 4 * self._a2() * spec.k * spec.c, _SLICE[self.m],
                        waves=0.5)
        return p.replace(ks=ks, tb=256 if device.is_gpu else 64)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The default and its other splits, then (GPUs) every SGEMM tile at every split."""
        first = self.default(spec, device)
        t4 = self._t4(spec)
        ks_all = [ks for ks in splits(t4) if ks * 4 * self._a2() * spec.k * spec.c <= 1 << 30]
        out = [first] + [first.replace(ks=ks) for ks in ks_all]
        if device.is_gpu:
            for p in gemm_space(spec.k, spec.c, t4, device, True, True, "k", "k"):
                out += [p.replace(ks=ks, tb=tb) for ks in ks_all for tb in (256, 128)]
        return list(dict.fromkeys(out))

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        t4, a2, ks = self._t4(spec), self._a2(), int(params.get("ks", 1))
        return 4 * a2 * (spec.c * t4 + spec.k * t4 + ks * spec.k * spec.c)

    # -- the plan --------------------------------------------------------------------------
    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        g, t4, a2 = self._geo(spec), self._t4(spec), self._a2()
        ks, tb = int(params.get("ks", 1)), int(params.get("tb", 256))
        if not 1 <= ks <= t4:
            raise ValueError(f"{self.name}: ks ({ks}) must be in 1..{t4} (the padded tile count)")
        if tb < 32 or tb > device.max_threads:
            raise ValueError(f"{self.name}: tb ({tb}) must be in 32..{device.max_threads}")
        if ks * a2 * spec.k * spec.c > INT_LIMIT:
            raise ValueError(f"{self.name}: ks ({ks}) slices of M need 64-bit indexing")
        gp = Params({k: v for k, v in params.items() if k not in ("ks", "tb")})
        shape = GemmShape(spec.k, spec.c, t4, batch=a2, ksplit=ks)
        kin = self._input_kernel(g, t4, tb)
        kgr = self._grad_kernel(g, t4, tb)
        kmm = self._gemm_kernel(g, t4, gp, shape)
        inline = ks if ks <= _INLINE_SLICES else 1  # slices the output transform adds itself
        kout = self._output_kernel(spec, inline, tb)
        steps = [Launch(kin.name, (cdiv(spec.c * t4, tb), 1, 1), kin.block, ("x", "wu_v")),
                 Launch(kgr.name, (cdiv(spec.k * t4, tb), 1, 1), kgr.block, ("y", "wu_u")),
                 Launch(kmm.name, gemm_grid(shape, gp), gemm_block(gp), ("wu_u", "wu_v", "wu_m"))]
        kernels = [kin, kgr, kmm]
        if inline < ks:
            kred, grid, block = reduce_kernel("wgrad_wino_reduce", a2 * spec.k * spec.c, ks, "wu_m", "wu_m")
            kernels.append(kred)
            steps.append(Launch(kred.name, grid, block, ("wu_m",)))
        kernels.append(kout)
        steps.append(Launch(kout.name, (cdiv(spec.k * spec.c, tb), 1, 1), kout.block, ("wu_m", "w")))
        work = (("wu_v", 4 * a2 * spec.c * t4), ("wu_u", 4 * a2 * spec.k * t4), ("wu_m", 4 * ks * a2 * spec.k * spec.c))
        tol = max(self.tolerance, sum_tolerance(slice_len(t4, ks)))
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps), work,
                    tolerance=tol, epilogue=epilogue)

    def _input_kernel(self, g: Geometry, t4: int, tb: int) -> Kernel:
        """V[e][c][t] = (B^T d B)[e] of x's alpha x alpha window at tile t (zeros past T)."""
        s = g.spec
        bt = update_transform(self.m)[2]
        code = _per_thread(tb, s.c * t4, t4, "c")
        emit_tile_origin(code, g, "t")
        emit_tile_masks(code, g, f"t < {g.tiles}")
        code(f"const int base = (n * {s.c} + c) * {s.h * s.w} + iy * {s.w} + ix;")
        emit_tile_load(code, g, "x", "base", "d")
        code(*emit_2d(bt, bt, "d", "v", "dt"))
        for i, j in itertools.product(range(g.ah), range(g.aw)):
            code(f"wu_v[{(i * g.aw + j) * s.c * t4} + idx] = v{i}_{j};")
        return Kernel("wgrad_wino_input", (Buf("x"), Buf("wu_v", readonly=False)), code.text(), (tb, 1, 1),
                      comment=f"{self.name}: V = B^T d B")

    def _grad_kernel(self, g: Geometry, t4: int, tb: int) -> Kernel:
        """U[e][k][t] = (G g G^T)[e] of dy's m x m tile t (zeros outside P x Q and past T)."""
        s, m = g.spec, self.m
        gm = update_transform(m)[1]
        code = _per_thread(tb, s.k * t4, t4, "k")
        emit_tile_origin(code, g, "t")
        code(f"const int base = (n * {s.k} + k) * {s.p * s.q} + oy * {s.q} + ox;",
             f"const bool tok = t < {g.tiles};")
        for i, j in itertools.product(range(m), range(m)):
            conds = ["tok"] + ([f"oy + {i} < {s.p}"] if s.p % m else []) + ([f"ox + {j} < {s.q}"] if s.q % m else [])
            code(f"const float g{i}_{j} = ({' && '.join(conds)}) ? y[base + {i * s.q + j}] : 0.0f;")
        code(*emit_2d(gm, gm, "g", "u", "gt"))
        for i, j in itertools.product(range(g.ah), range(g.aw)):
            code(f"wu_u[{(i * g.aw + j) * s.k * t4} + idx] = u{i}_{j};")
        return Kernel("wgrad_wino_grad", (Buf("y"), Buf("wu_u", readonly=False)), code.text(), (tb, 1, 1),
                      comment=f"{self.name}: U = G dy G^T (integer rows)")

    def _gemm_kernel(self, g: Geometry, t4: int, p: Params, shape: GemmShape) -> Kernel:
        """M[z][e] (K x C) = U[e] (K x T) . V[e]^T over tile slice z; batch e = bz."""
        s = g.spec
        kk, cc = s.k, s.c

        def operand(ptr: str) -> Operand:
            def load(t: str, k: str, d: str) -> list[str]:
                return [f"{d} = {ptr}[{t}_i * {t4} + ({k})];"]

            def vload(t: str, k: str, d: str) -> list[str]:
                return [f"{d} = VLOAD4(0, {ptr} + {t}_i * {t4} + ({k}));"]

            return Operand(load=load, fast="k", vload=vload)

        def put(mm: str, t: str, v: str) -> list[str]:
            return [f"me[({mm}) * {cc} + {t}_i] = {v};"]

        def vput(mm: str, t: str, vs: list[str]) -> list[str]:
            return [f"VSTORE4(MAKE_FLOAT4({', '.join(vs)}), 0, me + ({mm}) * {cc} + {t}_i);"]

        a2 = self._a2()
        prelude = (f"const GLOBAL_PTR float* ue = wu_u + bz * {kk * t4};  // U[e]: K x T",
                   f"const GLOBAL_PTR float* ve = wu_v + bz * {cc * t4};  // V[e]: C x T",
                   f"GLOBAL_PTR float* me = wu_m + (kz * {a2} + bz) * {kk * cc};  // M[z][e]: K x C")
        return gemm_kernel("wgrad_wino_gemm", shape, p, operand("ue"), operand("ve"),
                           Store(put=put, vput=vput if cc % 4 == 0 else None),
                           (Buf("wu_u"), Buf("wu_v"), Buf("wu_m", readonly=False)), prelude,
                           comment=f"{self.name}: {a2} batched GEMMs over tiles {p.short()}, {shape.ksplit} slices")

    def _output_kernel(self, spec: ConvSpec, ks: int, tb: int) -> Kernel:
        """dW[k][c] = A^T (sum of the ks slices of M) A, the slices added in order. Thread idx owns
        (k, c) = idx; the block's 9 x tb results are contiguous in dW, so they go through shared
        memory and out as 9 coalesced rows (stored straight, each thread's 9 floats 36 bytes
        apart, the stores took a quarter of the plan's time)."""
        at = update_transform(self.m)[0]
        a, a2, kc = self.m + 2, self._a2(), spec.k * spec.c
        code = Code()
        code(f"SHARED float st[{9 * tb}];",
             f"const int lid = LOCAL_ID(0), idx = GROUP_ID(0) * {tb} + lid;",
             f"const int at = idx < {kc} ? idx : {kc - 1};  // threads past the end redo the last pair")
        for i, j in itertools.product(range(a), range(a)):
            e = i * a + j
            if ks <= 4:
                terms = " + ".join(f"wu_m[{(z * a2 + e) * kc} + at]" for z in range(ks))
                code(f"const float m{i}_{j} = {terms};")
            else:
                code(f"float m{i}_{j} = wu_m[{e * kc} + at];",
                     f"for (int z = 1; z < {ks}; ++z) m{i}_{j} += wu_m[(z * {a2} + {e}) * {kc} + at];")
        code(*emit_2d(at, at, "m", "o", "ot"))
        for r, s in itertools.product(range(3), range(3)):
            code(f"st[lid * 9 + {r * 3 + s}] = o{r}_{s};")
        code("BARRIER();", f"const int base = GROUP_ID(0) * {9 * tb};")
        for r in range(9):
            code(f"if (base + {r * tb} + lid < {9 * kc}) w[base + {r * tb} + lid] = st[{r * tb} + lid];")
        return Kernel("wgrad_wino_output", (Buf("wu_m"), Buf("w", readonly=False)), code.text(), (tb, 1, 1),
                      comment=f"{self.name}: dW = A^T M A, {ks} slices summed in order")


def _per_thread(tb: int, total: int, fast: int, slow: str) -> Code:
    """One thread per (slow, t), t fastest (coalesced); threads past ``total`` leave."""
    code = Code()
    code(f"const int idx = GROUP_ID(0) * {tb} + LOCAL_ID(0);",
         f"if (idx >= {total}) return;",
         f"const int t = idx % {fast}, {slow} = idx / {fast};")
    return code


register(WgradWinograd(2))
register(WgradWinograd(4))
