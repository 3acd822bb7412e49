"""wgrad of channels-last half layers on the wgmma generator, operands as they lie (MN-major).

    dW[k, c, r, s] = sum over n, p, q of x[n, p sh + r dh - pt, q sw + s dw - pl, c] . dy[n, p, q, k]

Per filter tap (r, s) this is a GEMM over the output pixels whose two operands are channels-last rows:
D (R S C x K) = A . B with A[(rs, c), pixel] = the tap's im2col of x and B[pixel, k] = dy. Neither
runs along the reduction in memory, but for 16-bit types wgmma reads MN-major shared tiles (the
transpose immediates), and the TMA copies that bring the forward pass's K-major tiles bring these
unchanged: per stage, ``kb`` x 64 output pixels by 64 channels of x at the tile's tap (an im2col copy,
padding and stride by the copy engine) and of dy (a tiled copy of [N P Q][K]). No transposing step:
the transposed path (wgrad.py) moves x and dy twice more (what that cost: docs/NOTES-training.md).

* A = :class:`~convforge.kernels.tensorcore.sm90.operands.MnIm2col`: rows (rs, c) with c fastest; each
  block of 64 rows lies in one tap (C a multiple of 64), so a 128-row tile of a 64-channel layer takes
  two taps. A stride-1 unpadded 1x1 layer's x is a plain [N H W][C] matrix
  (:class:`~convforge.kernels.tensorcore.sm90.operands.MnRows`), any C of whole 16-byte rows.
* B = :class:`~convforge.kernels.tensorcore.sm90.operands.MnRows` over dy = [N P Q][K].
* D stored into dW's K C R S layout (row (rs, c) at c R S + rs, column k at k C R S), split-K over
  the pixels with the deterministic reduce.

``wgrad_tc_nhwc_half``: float16 and bfloat16, FP32 sums, dW rounded once to the storage dtype.
"""

from __future__ import annotations

import dataclasses

from convforge.kernels import register
from convforge.kernels.dgrad.baseline import no_epilogue
from convforge.kernels.tensorcore.sm90 import tma
from convforge.kernels.tensorcore.sm90.epilogue import Output
from convforge.kernels.tensorcore.sm90.isa import device_reason
from convforge.kernels.tensorcore.sm90.operands import Geometry, MnIm2col, MnRows, Operand
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig
from convforge.kernels.tensorcore.sm90.variants import RANK_SM90, TcVariant, gemm_steps, split_workspace, tolerance
from convforge.kernels.tensorcore.sm90.wgrad import split, split_cost
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Plan
from convforge.spec import ConvSpec

SMALL_IMAGE = 64  # output pixels an image at or below which multi-tap layers rank below the transposed path
# Block tiles (bm x bn, consumers) in the order the default prefers them at equal modelled time.
SHAPES = ((128, 128, 2), (128, 64, 2), (128, 192, 2), (64, 128, 1), (64, 64, 1), (256, 64, 2), (128, 256, 2))


def geometry(spec: ConvSpec) -> Geometry:
    """The forward convolution whose pixels A walks: x itself, C channels a pixel."""
    pt, pl = spec.pad[0], spec.pad[2]
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    padded = (pt > 0 or pl > 0 or (spec.p - 1) * sh + (spec.r - 1) * dh - pt >= spec.h
              or (spec.q - 1) * sw + (spec.s - 1) * dw - pl >= spec.w)
    return Geometry(spec.n, spec.h, spec.w, spec.c, spec.p, spec.q, spec.r, spec.s, (sh, sw), (dh, dw), pt, pl, padded)


def plain_1x1(spec: ConvSpec) -> bool:
    """A stride-1 unpadded 1x1 layer: x is a [N H W][C] matrix, read by tiled copies (any C of whole
    16-byte rows: blocks past C read zeros, and their rows of D are never stored)."""
    return (spec.r, spec.s) == (1, 1) and spec.stride == (1, 1) and not any(spec.pad)


class TcWgradNhwc(TcVariant):
    """wgrad of channels-last half layers by MN-major operands (see the module docstring)."""

    passes = frozenset({"wgrad"})
    layouts = frozenset({"nhwc"})
    optional_params = {**TcVariant.optional_params, "mn": frozenset({1})}

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Above the transposed path on sm_90 (no transposing steps), except filters of several taps on
        output images of at most :data:`SMALL_IMAGE` pixels, where the transposed path ran faster
        (docs/NOTES-tensorcore.md)."""
        if device_reason(device) is not None:
            return self.specialised
        if spec.r * spec.s > 1 and spec.p * spec.q <= SMALL_IMAGE:
            return RANK_SM90 - 1
        return RANK_SM90 + 1

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device) or device_reason(device)
        if why:
            return why
        if spec.groups != 1:
            return "grouped layers: wgrad_tc_grouped_* (or the depthwise wgrad)"
        if spec.k % 8:
            return f"K ({spec.k}) is not a whole number of 16-byte rows of dy"
        if plain_1x1(spec):
            if spec.c % 8:
                return f"C ({spec.c}) is not a whole number of 16-byte rows of x"
        else:
            if spec.c % 64:
                return (f"C ({spec.c}) is not a whole number of 64-channel boxes (a box would straddle two taps; "
                        "the transposed path runs it)")
            tile = TileConfig(64, 64, 1, 2, 1, tm=1, mn=1).a_tile()
            why = tma.reason(MnIm2col("a", tile, self.math(spec), "x", geo=geometry(spec)), 64)
            if why:
                return f"x cannot be walked by an im2col copy: {why}"
        prob = self.problem(spec)
        return self.wide(spec, spec.n * spec.h * spec.w * spec.c, spec.n * spec.p * spec.q * spec.k,
                         64 * prob.m * prob.n)

    def problem(self, spec: ConvSpec) -> Problem:
        return Problem(spec.r * spec.s * spec.c, spec.k, spec.n * spec.p * spec.q)

    # -- parameters ---------------------------------------------------------------------------
    def _shapes(self, spec: ConvSpec, device: DeviceInfo) -> list[TileConfig]:
        """Each block tile of :data:`SHAPES` with as many stages as fit (at most 6), one or two 64-pixel
        blocks a stage, unsplit."""
        math, out = self.math(spec), []
        for (bm, bn, cw), kb in ((s, kb) for kb in (1, 2) for s in SHAPES):
            fits = [c for c in (TileConfig(bm, bn, kb, st, cw, tm=1, mn=1) for st in range(6, 1, -1))
                    if not c.problems(math, self.problem(spec), self.limit(device))]
            if fits and fits[0].st >= 3:
                out.append(fits[0])
        return out

    def _split(self, cfg: TileConfig, spec: ConvSpec, device: DeviceInfo) -> TileConfig:
        return dataclasses.replace(cfg, ks=split(cfg, self.math(spec), self.problem(spec), device.units))

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The block tile and split with the least modelled time (wgrad.split_cost), 64 pixels a stage."""
        math, prob = self.math(spec), self.problem(spec)
        cands = [self._split(c, spec, device) for c in self._shapes(spec, device) if c.kb == 1]
        if not cands:
            raise ValueError(f"{self.name}: no block tile fits {spec.short()}")
        return min(cands, key=lambda c: split_cost(c.ks, c, math, prob, device.units)).params()

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The default first, then every shape with its own split and unsplit."""
        out = [TileConfig.of(self.default(spec, device))]
        for cfg in self._shapes(spec, device):
            for c in (self._split(cfg, spec, device), cfg):
                if c not in out:
                    out.append(c)
        return [c.params() for c in out]

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return sum(b for _, b in self._workspace(spec, TileConfig.of(params)))

    def _workspace(self, spec: ConvSpec, cfg: TileConfig) -> tuple[tuple[str, int], ...]:
        return split_workspace(cfg, self.problem(spec))

    # -- plan ---------------------------------------------------------------------------------
    def output(self, spec: ConvSpec) -> Output:
        """dW (K C R S) as D (R S C x K): row (rs, c) of "image" rs at c R S + rs, column k at k C R S."""
        rs = spec.r * spec.s
        if rs == 1:
            return Output("w", spec.c, spec.k, spec.c, spec.dtype, istride=spec.c, kstride=spec.c, epi=Epilogue())
        return Output("w", rs * spec.c, spec.k, spec.c, spec.dtype, istride=1, kstride=spec.c * rs, pix_q=spec.c,
                      pix_col=rs, epi=Epilogue())

    def operands(self, spec: ConvSpec, cfg: TileConfig) -> tuple[Operand, Operand]:
        """A: the tap's pixels of x (NHWC; a stride-1 unpadded 1x1 layer's x as [N H W][C] rows), B: dy =
        [N P Q][K]."""
        math = self.math(spec)
        if plain_1x1(spec):
            a: Operand = MnRows("a", cfg.a_tile(), math, "x", cols=spec.c, ld=spec.c, kred=spec.n * spec.h * spec.w)
        else:
            a = MnIm2col("a", cfg.a_tile(), math, "x", geo=geometry(spec))
        b = MnRows("b", cfg.b_tile(), math, "y", cols=spec.k, ld=spec.k, kred=spec.n * spec.p * spec.q)
        return a, b

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        math, prob, cfg = self.math(spec), self.problem(spec), TileConfig.of(params)
        why = cfg.problems(math, prob, self.limit(device))
        if not cfg.mn or not cfg.tm:
            why = why + ["the operands are MN-major tiles brought by TMA (mn=1, tm=1)"]
        if why:
            raise ValueError(f"{self.name}: {'; '.join(why)}")
        a, b = self.operands(spec, cfg)
        kernels, steps = gemm_steps(self.name, math, cfg, prob, a, b, self.output(spec), device.units)
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps),
                    self._workspace(spec, cfg), tolerance(math, spec.dtype), epilogue)


register(TcWgradNhwc("wgrad_tc_nhwc_half", frozenset({"float16", "bfloat16"}), False, "fp32", 12))
