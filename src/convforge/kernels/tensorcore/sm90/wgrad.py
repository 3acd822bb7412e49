"""wgrad (update) on the wgmma generator: the filter gradient as the forward convolution of a
transposed problem, so the generator's own operand iterators serve it unchanged.

    dW[k, c, r, s] = sum over n, p, q of x[n, c, p sh + r dh - pt, q sw + s dw - pl] . dy[n, k, p, q]

Read the images as channels and this is a forward convolution (:func:`geometry`): C "images" x' of
N "channels" (the batch, padded to a 16-byte chunk: Np), H x W each, filtered by K "filters" dy'
of P x Q taps, with the forward's dilation as its stride, the forward's stride as its dilation and
the forward's top / left padding; its "output pixels" are the R x S filter taps. As the implicit
GEMM D (C R S x K) = A . B^T over the reduction (p, q, n):

* A = :class:`~convforge.kernels.tensorcore.sm90.operands.Im2colNhwc` over x' = [C][H][W][Np], rows
  (c, r, s), the chunk at (p, q, n..n+3) reading x' pixel (r dh - pt + p sh, s dw - pl + q sw);
* B = :class:`~convforge.kernels.tensorcore.sm90.operands.DenseRows` over dy' = [K][P Q Np];
* D stored into dW's K C R S layout (the epilogue's strided :class:`Output`: images R S apart,
  columns C R S apart), split-K over the long reduction (N P Q Np / chunk stages) with the
  deterministic reduce; no bias, residual or activation (a gradient has none).

Plan: (1) x NCHW -> x' and (2) dy NCHW -> dy' by one transposing step each
(:func:`~convforge.kernels.tensorcore.sm90.prep.planes_to_rows`: TF32-rounded, 3xTF32 hi / lo, half bits
as they are; each reads and writes its tensor once), (3) the wgmma GEMM, (4) with split-K the reduce.
CUTLASS's sm90 wgrad takes NHWC activations with the reduction strided (MN-major operands), which
wgmma allows for 16-bit types only; TF32 wants both operands K-major, which these transposes give
every dtype alike.

* ``wgrad_tc_implicit_gemm_tf32`` (float32, class "relaxed"): TF32 products, FP32 sums.
* ``wgrad_tc_implicit_gemm_3xtf32`` (float32, class "fp32"): hi + lo parts, three products, the
  tensor core's sums promoted into FP32 registers every ``pi`` stages.
* ``wgrad_tc_implicit_gemm_half`` (float16, bfloat16): half operands, FP32 sums, dW rounded once.
"""

from __future__ import annotations

import dataclasses

from convforge.codegen.dialect import Kernel
from convforge.codegen.meta import cdiv
from convforge.kernels import register
from convforge.kernels.dgrad.baseline import no_epilogue
from convforge.kernels.tensorcore.sm90 import prep, tiles, tma
from convforge.kernels.tensorcore.sm90.epilogue import Output
from convforge.kernels.tensorcore.sm90.isa import Math, device_reason
from convforge.kernels.tensorcore.sm90.operands import DenseRows, Geometry, Im2colNhwc, Operand, PlanarRows
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig
from convforge.kernels.tensorcore.sm90.variants import RANK_SM90, TcVariant, gemm_steps, split_workspace, tolerance
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan
from convforge.spec import ConvSpec

MAX_SPLIT = 64  # slices of the reduction at most (partials: ks x C R S x K floats)


def geometry(spec: ConvSpec, cp: int) -> Geometry:
    """The forward convolution whose output is dW (see the module docstring): images = channels C,
    channels = the batch N (padded to ``cp``), "output pixels" = filter taps R x S, taps = P x Q."""
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    pt, pl = spec.pad[0], spec.pad[2]
    rows = ((spec.r - 1) * dh + (spec.p - 1) * sh - pt, -pt)
    cols = ((spec.s - 1) * dw + (spec.q - 1) * sw - pl, -pl)
    padded = rows[1] < 0 or cols[1] < 0 or rows[0] >= spec.h or cols[0] >= spec.w
    return Geometry(spec.c, spec.h, spec.w, cp, spec.r, spec.s, spec.p, spec.q, (dh, dw), (sh, sw), pt, pl, padded)


# The split's cost model: block tiles in waves over the SMs at a measured GEMM rate per SM (TF32 about
# half the dense peak, FP16 twice TF32), plus the partials' round trip (written by the GEMM, read by the
# reduce) and the reduce's launch.
SM_FLOPS = {4: 1.9e12, 2: 3.8e12}
# Block-tile efficiencies of wgrad's GEMM (tiles.TILE_EFFICIENCY's form): narrow TF32 tiles lose more here
# than in the forward pass (wgrad's long reductions), so 128 x 128 leads; half as for the forward pass.
EFFICIENCY = {4: {(128, 64): 0.7, (256, 64): 0.6, (128, 128): 1.0}, 2: tiles.TILE_EFFICIENCY[2]}
PART_BYTES_PER_S = 2.5e12
REDUCE_S = 3e-6


def split_cost(ks: int, cfg: TileConfig, math: Math, prob: Problem, units: int) -> float:
    """Modelled seconds of the GEMM and its reduce with ``ks`` slices (see SM_FLOPS; a block tile's
    rate scaled by its efficiency relative to 128 x 64's, :data:`EFFICIENCY`)."""
    tiles_ = cdiv(prob.m, cfg.bm) * cdiv(prob.n, cfg.bn) * prob.batch
    slice_s = 2.0 * cfg.bm * cfg.bn * prob.kred / ks / (SM_FLOPS[math.esize] * tiles.efficiency(cfg, math, EFFICIENCY))
    waves = cdiv(tiles_ * ks, max(units, 1))
    extra = 8.0 * ks * prob.m * prob.n / PART_BYTES_PER_S + REDUCE_S if ks > 1 else 0.0
    return waves * slice_s + extra


def split(cfg: TileConfig, math: Math, prob: Problem, units: int) -> int:
    """Slices of the reduction with the least modelled time (:func:`split_cost`; wgrad's GEMMs are
    few tiles over reductions of 10^4-10^5 elements), each slice at least 4 stages long, none
    empty, at most MAX_SPLIT."""
    nk = cfg.k_blocks(math, prob)
    best, best_cost = 1, split_cost(1, cfg, math, prob, units)
    for ks in range(2, min(MAX_SPLIT, nk // 4) + 1):
        if (ks - 1) * cdiv(nk, ks) >= nk:
            continue
        cost = split_cost(ks, cfg, math, prob, units)
        if cost < 0.97 * best_cost:  # a split must pay for itself by a margin
            best, best_cost = ks, cost
    return best


def x3h_first(spec: ConvSpec) -> bool:
    """3xFP16 wgrad first on float32 layers where it runs ahead of the fp32 class's picks at FP32-grade
    error (docs/NOTES-wgrad.md):

    * 3x3 of C, K >= 64, strided too;
    * 1x1 of at most 28 x 28 input pixels and C K >= 2^17: deep, small images (on larger images or
      fewer channels wgrad_gemm1x1 stays ahead);
    * 7x7 stems."""
    if spec.dtype != "float32" or spec.groups != 1:
        return False
    if (spec.r, spec.s) == (3, 3):
        return min(spec.c, spec.k) >= 64
    if (spec.r, spec.s) == (1, 1):
        return spec.h * spec.w <= 28 * 28 and spec.c * spec.k >= 2**17
    return (spec.r, spec.s) == (7, 7)


class TcWgrad(TcVariant):
    """wgrad by the wgmma generator (see the module docstring)."""

    passes = frozenset({"wgrad"})
    layouts = frozenset({"nchw", "nhwc"})  # NHWC: the transposing steps read channels-last rows

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """First on sm_90 for TF32 and half layers; 3xFP16 where :func:`x3h_first`; 3xTF32 (and 3xFP16
        elsewhere) at the stated rank (below the CUDA-core wgrad GEMM and Winograd update)."""
        if device_reason(device) is not None:
            return self.specialised
        if self.x3 and self.x3h:
            return RANK_SM90 - 1 if x3h_first(spec) else self.specialised  # below TF32 (the relaxed class)
        if self.x3:
            return self.specialised
        return RANK_SM90

    def _cp(self, spec: ConvSpec) -> int:
        return prep.padded_channels(spec.n, self.math(spec))

    def problem(self, spec: ConvSpec) -> Problem:
        return Problem(spec.c * spec.r * spec.s, spec.k, spec.p * spec.q * self._cp(spec))

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device) or device_reason(device)
        if why:
            return why
        if max(spec.c, spec.k) > 65535:
            return f"{max(spec.c, spec.k)} channels exceed the transposing steps' grid (65535)"
        cp, prob = self._cp(spec), self.problem(spec)
        return self.wide(spec, spec.c * spec.h * spec.w * cp, spec.k * prob.kred, MAX_SPLIT * prob.m * prob.n)

    # -- parameters ---------------------------------------------------------------------------
    def _split(self, cfg: TileConfig, spec: ConvSpec, device: DeviceInfo) -> TileConfig:
        ks = split(dataclasses.replace(cfg, ks=1), self.math(spec), self.problem(spec), device.units)
        return dataclasses.replace(cfg, ks=ks)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The block tile and split with the least modelled time together (:func:`split_cost` over
        tiles.shapes: the split repairs the last wave that steers tiles.pick to narrow tiles, so
        wide ones win here), the operands by TMA where they can be."""
        math, prob = self.math(spec), self.problem(spec)
        split_of = [self._split(c, spec, device) for c in tiles.shapes(math, prob, self.limit(device))]
        cfg = min(split_of, key=lambda c: split_cost(c.ks, c, math, prob, device.units))
        return self._tma(spec, cfg).params()

    def _tma(self, spec: ConvSpec, cfg: TileConfig) -> TileConfig:
        """``cfg`` by TMA where it can be: x' in the 64-byte swizzle where the batch is 16 mod 32
        (TF32; half: 32 mod 64), the 32-byte one where it is 8 mod 16 (TF32; half: 16 mod 32)."""
        return tma.with_tma(cfg, lambda c: self.tma_reason(spec, c))

    def tma_reason(self, spec: ConvSpec, cfg: TileConfig) -> str | None:
        """Why this layer's operands cannot come by TMA with tile ``cfg`` (tensorcore/sm90/tma.py), or None."""
        return tma.pair_reason(*self.operands(spec, cfg), cfg.bm, cfg.bn)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The default (also in clusters of two where it takes TMA), then the generator's space with
        each shape's own split (and unsplit), each by TMA where it can be, and by cp.async."""
        math, prob = self.math(spec), self.problem(spec)
        first = TileConfig.of(self.default(spec, device))
        out = list(dict.fromkeys([first, dataclasses.replace(first, tm=0, sa=128)]))
        pair = dataclasses.replace(first, cl=2)
        if first.tm and not pair.problems(math, prob, self.limit(device)):  # A (x' rows) multicast: unmeasured
            out.insert(1, pair)
        for cfg in tiles.space(math, prob, device.units, self.limit(device)):
            for c in (self._split(cfg, spec, device), dataclasses.replace(cfg, ks=1)):
                for t in (self._tma(spec, c), c):
                    if t not in out and not t.problems(math, prob, self.limit(device)):
                        out.append(t)
        return [c.params() for c in out]

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return sum(b for _, b in self._workspace(spec, TileConfig.of(params)))

    def _workspace(self, spec: ConvSpec, cfg: TileConfig) -> tuple[tuple[str, int], ...]:
        math, prob, cp = self.math(spec), self.problem(spec), self._cp(spec)
        out: tuple[tuple[str, int], ...] = ()
        for name, elems in (("xt", spec.c * spec.h * spec.w * cp), ("dyt", spec.k * prob.kred)):
            out += tuple(((name if p == "hi" else f"{name}_{p}"), math.esize * elems) for p in math.parts)
            out += prep.scale_workspace(name, math)
        return out + split_workspace(cfg, prob)

    # -- plan ---------------------------------------------------------------------------------
    def output(self, spec: ConvSpec) -> Output:
        """dW (K C R S) as the GEMM's D (C R S x K): row (c, r s) of image c, column k."""
        rs = spec.r * spec.s
        return Output("w", spec.c * rs, spec.k, rs, spec.dtype, istride=rs, kstride=spec.c * rs, epi=Epilogue())

    def operands(self, spec: ConvSpec, cfg: TileConfig) -> tuple[Operand, Operand]:
        """A: the im2col rows (c, r, s) of x' = [C][H][W][Np]; B: dy' = [K][P Q Np] rows."""
        math, prob = self.math(spec), self.problem(spec)
        a = Im2colNhwc("a", cfg.a_tile(), math, "xt", geo=geometry(spec, self._cp(spec)))
        b = DenseRows("b", cfg.b_tile(), math, "dyt", rows=spec.k, ld=prob.kred, kred=prob.kred)
        return a, b

    def steps_before(self, spec: ConvSpec) -> tuple[list[Kernel], list[Launch]]:
        """The transposing steps: x -> x' = [C][H][W][Np], dy -> dy' = [K][P Q Np], from NCHW planes
        or from channels-last rows (``layout="nhwc"``: a tile of images x channels per pixel)."""
        math, cp = self.math(spec), self._cp(spec)
        hw, pq, ch = spec.h * spec.w, spec.p * spec.q, spec.c * spec.h * spec.w
        if spec.layout == "nhwc":
            xk, xgrid = prep.nhwc_to_batch_rows(f"{self.name}_x", "x", spec.n, spec.c, hw, cp, math, spec.dtype, "xt",
                                                f"x N H W C -> [C][H][W][{cp}] (images as channels), "
                                                f"{math.name} operands")
            yk, ygrid = prep.nhwc_to_batch_rows(f"{self.name}_dy", "y", spec.n, spec.k, pq, cp, math, spec.dtype,
                                                "dyt", f"dy N P Q K -> [K][P Q {cp}] (the filters of the "
                                                "transposed problem)")
        else:
            xk, xgrid = prep.planes_to_rows(f"{self.name}_x", "x", f"ci * {ch} + n * {hw} + p", spec.c, spec.n, hw,
                                            cp, math, spec.dtype, "xt", f"x N C H W -> [C][H][W][{cp}] (images as "
                                            f"channels), {math.name} operands")
            yk, ygrid = prep.planes_to_rows(f"{self.name}_dy", "y", f"ci * {spec.k * pq} + n * {pq} + p", spec.k,
                                            spec.n, pq, cp, math, spec.dtype, "dyt",
                                            f"dy N K P Q -> [K][P Q {cp}] (the filters of the transposed problem)")
        pairs = prep.launches(math, xk, xgrid, "x", "xt", spec) + prep.launches(math, yk, ygrid, "y", "dyt", spec)
        return [k for k, _ in pairs], [launch for _, launch in pairs]

    def plan_tolerance(self, spec: ConvSpec) -> float:
        return tolerance(self.math(spec), spec.dtype)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        math, prob, cfg = self.math(spec), self.problem(spec), TileConfig.of(params)
        why = cfg.problems(math, prob, self.limit(device))
        if why:
            raise ValueError(f"{self.name}: {'; '.join(why)}")
        a, b = self.operands(spec, cfg)
        kernels, steps = self.steps_before(spec)
        gemm, launches = gemm_steps(self.name, math, cfg, prob, a, b, self.output(spec), device.units)
        kernels += gemm
        steps += launches
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps),
                    self._workspace(spec, cfg), self.plan_tolerance(spec), epilogue)


# TF32 products of operands the tensor cores truncate to 10 mantissa bits (NumPy, uniform and ReLU-like
# data, 20k-term sums: 6.9e-4 and 7.1e-4; cuDNN's TF32 wgrad measures 6.9e-4 on the ResNet layers)
TRUNCATED_EXPECTED, TRUNCATED_TOLERANCE = 7e-4, 2e-3


class TcWgrad1x1(TcWgrad):
    """wgrad of a stride-1 unpadded 1x1 layer with no step before the GEMM: dW^T (C x K) = X . dY^T
    over (n, pixel), both read as they lie (:class:`PlanarRows`: rows = channels of x and of dy, the
    reduction along each image's plane), P Q a whole number of 16-byte chunks. TF32 reads the float
    bits, truncating both operands (about cuDNN's TF32 error, 2.7x the rounded transposed path's);
    halves are exact. The transposed path moves x and dy twice more (a 256 -> 64 @56² N32 layer:
    257 MB of transposes for a 3.3 GFLOP GEMM)."""

    family = "gemm1x1"
    layouts = frozenset({"nchw"})  # channel planes read as they lie

    def __init__(self, name: str, dtypes: frozenset[str], precision: str, specialised: int) -> None:
        super().__init__(name, dtypes, False, precision, specialised)
        self.tolerance = TRUNCATED_TOLERANCE

    def expected_error(self, spec: ConvSpec) -> float:
        return TRUNCATED_EXPECTED if spec.dtype == "float32" else super().expected_error(spec)

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Above the transposed path on sm_90 (no transposing steps)."""
        return self.specialised if device_reason(device) is not None else RANK_SM90 + 1

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if (spec.r, spec.s) != (1, 1) or spec.stride != (1, 1) or any(spec.pad):
            return "only stride-1 unpadded 1x1 layers (wgrad_tc_implicit_gemm_* runs the others)"
        if spec.p * spec.q % self.math(spec).chunk_elems:
            return (f"P*Q ({spec.p * spec.q}) is not a whole number of 16-byte chunks "
                    f"({self.math(spec).chunk_elems} elements): the transposed path runs it")
        return super().applies(spec, device)

    @staticmethod
    def swapped(spec: ConvSpec) -> bool:
        """dW = dY . X^T (K rows) where the filters outnumber the channels: the GEMM's rows are the
        wider side (a 64 -> 256 layer on 128-row tiles of C would leave half of each tile idle)."""
        return spec.k > spec.c

    def problem(self, spec: ConvSpec) -> Problem:
        m, n = (spec.k, spec.c) if self.swapped(spec) else (spec.c, spec.k)
        return Problem(m, n, spec.n * spec.p * spec.q)

    def output(self, spec: ConvSpec) -> Output:
        """dW (K x C) as D: C x K stored strided, or K x C row-major when swapped."""
        if self.swapped(spec):
            return Output("w", spec.k, spec.c, 1, spec.dtype, epi=Epilogue())
        return super().output(spec)

    def _workspace(self, spec: ConvSpec, cfg: TileConfig) -> tuple[tuple[str, int], ...]:
        return split_workspace(cfg, self.problem(spec))

    def operands(self, spec: ConvSpec, cfg: TileConfig) -> tuple[Operand, Operand]:
        """A: x's channel planes, B: dy's (swapped: A dy's, B x's)."""
        math, pq, kred = self.math(spec), spec.p * spec.q, self.problem(spec).kred
        (ra, ca), (rb, cb) = ((spec.k, "y"), (spec.c, "x")) if self.swapped(spec) else ((spec.c, "x"), (spec.k, "y"))
        a = PlanarRows("a", cfg.a_tile(), math, ca, rows=ra, plane=pq, image=ra * pq, kred=kred)
        b = PlanarRows("b", cfg.b_tile(), math, cb, rows=rb, plane=pq, image=rb * pq, kred=kred)
        return a, b

    def steps_before(self, spec: ConvSpec) -> tuple[list[Kernel], list[Launch]]:
        return [], []

    def plan_tolerance(self, spec: ConvSpec) -> float:
        return TRUNCATED_TOLERANCE if spec.dtype == "float32" else super().plan_tolerance(spec)


register(TcWgrad("wgrad_tc_implicit_gemm_tf32", frozenset({"float32"}), False, "relaxed", 12))
register(TcWgrad("wgrad_tc_implicit_gemm_3xtf32", frozenset({"float32"}), True, "fp32", 4))
register(TcWgrad("wgrad_tc_implicit_gemm_half", frozenset({"float16", "bfloat16"}), False, "fp32", 12))
register(TcWgrad("wgrad_tc_implicit_gemm_3xf16", frozenset({"float32"}), True, "fp32", 3, x3h=True))
register(TcWgrad1x1("wgrad_tc_gemm1x1_tf32", frozenset({"float32"}), "relaxed", 12))
register(TcWgrad1x1("wgrad_tc_gemm1x1_half", frozenset({"float16", "bfloat16"}), "fp32", 12))
