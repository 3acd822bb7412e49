"""Grouped convolution on the wgmma generator: every group's implicit GEMM in one launch.

A convolution of G groups is G independent forward convolutions of Cg = C / G input and Kg = K / G
output channels each. Here they are the G batches of one batched GEMM (:class:`~convforge.kernels.
tensorcore.sm90.tiles.Problem` ``batch``; the schedule numbers a group's tiles one after another,
so a group's rows of x are read by neighbouring blocks), per group z:

* A = :class:`~convforge.kernels.tensorcore.sm90.operands.Im2colNhwc` over the NHWC activations
  (read in place where C is whole 16-byte chunks, else after the forward's per-element step),
  gathering Cg channels a tap from channel z Cg on, of pixels C channels apart (``Geometry.pitch``,
  ``group_stride``);
* B = :class:`~convforge.kernels.tensorcore.sm90.operands.DenseRows` over the filters packed
  K x (R S Cg) by the forward's weight step (a grouped filter is K x Cg x R x S), group z's Kg rows
  from row z Kg on (``batch_stride``);
* D stored at output channels z Kg .. (slab z of an :class:`~convforge.kernels.tensorcore.sm90.
  epilogue.Output` of K columns), bias read from channel z Kg on (``bias_z``), residual and
  activation as the forward's.

Cg must be whole chunks (8 halves, 4 TF32 values): a chunk never straddles two groups and no padding
channel is read. Operands come by cp.async (TMA boxes of a group's channels are not made yet) and the
reduction is not split (each group's R S Cg is short; the groups fill the GPU instead). Narrow
groups (Cg of 4 in ResNeXt-50's first stage, or fewer than a chunk) and depthwise layers are other
variants' (depthwise, implicit_gemm).

* ``tc_grouped_tf32`` (float32, relaxed), ``tc_grouped_3xtf32`` (float32, fp32 class),
  ``tc_grouped_half`` (float16 / bfloat16): the forward variants' math modes and stated errors.

Stride-1 dgrad is the forward on the transposed problem (``dgrad_tc_grouped_*``, kernels/dgrad/transposed.py).
wgrad (``wgrad_tc_grouped_*``, :class:`TcGroupedWgrad`) is the wgrad generator's transposed problem per group:
group z's filter gradient (Cg R S x Kg) reads images z Cg .. of x' = [C][H][W][Np] (``group_stride``) and
rows z Kg .. of dy' = [K][P Q Np], split over the long reduction with a reduce that knows the groups; any
Cg (the channels are the images there), depthwise layers excepted (their own wgrad family). Groups of at
most 16 output channels take 16-column tiles (:func:`narrow_tiles`), not 32 or more mostly empty ones.

Emulated tile by tile against float64 (tests/test_tensorcore_grouped.py), compiled by nvcc and checked on a
GPU (tests/test_gpu_grouped.py). Timed there the half forwards (docs/BENCHMARKS.md), which ``auto`` takes:
``tc_grouped_packed_half`` wherever groups pack, else ``tc_grouped_half``, whose groups of fewer than
:data:`NARROW` output channels leave most of a 64-column tile empty and ran far below cuDNN
(docs/NOTES-tensorcore.md), so it calls itself slow there (``slow_on``) and a half layer goes to PyTorch.
The others, not yet timed, are reached only by name (``Variant.named_only``: ``algo="tc_grouped_tf32"``,
``bench --algo wgrad_tc_grouped_half``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from convforge.codegen.dialect import Dim3, Kernel
from convforge.kernels import register
from convforge.kernels.tensorcore.sm90 import prep, tiles
from convforge.kernels.tensorcore.sm90.epilogue import Output
from convforge.kernels.tensorcore.sm90.isa import Math
from convforge.kernels.tensorcore.sm90.operands import DenseRows, Geometry, Im2colNhwc
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig
from convforge.kernels.tensorcore.sm90.variants import TcImplicitGemm
from convforge.kernels.tensorcore.sm90.wgrad import TcWgrad, geometry, split_cost
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Plan
from convforge.spec import ConvSpec

TIMED = frozenset({"tc_grouped_half", "tc_grouped_packed_half"})  # timed on a GPU: in 'auto'; others by name
NARROW = 16  # output channels a group below which the forward counts itself slow (slow_on)
# timed on a GPU: in 'auto' (the forward's dgrad as dgrad_<forward>), slow below WIDE channels a group
BACKWARD_TIMED = frozenset({"tc_grouped_half", "tc_grouped_packed_half", "wgrad_tc_grouped_half"})
WIDE = 32
NARROW_BN = 16  # the narrow wgrad tile's columns (narrow_tiles): groups of at most this many output channels


def backward_slow(spec: ConvSpec) -> str | None:
    """Why the grouped dgrad / wgrad count themselves slow on ``spec`` (``slow_on``), or None."""
    if min(spec.cg, spec.kg) < WIDE:
        return (f"groups of {spec.cg} -> {spec.kg} channels: the grouped dgrad and wgrad ran at 0.33-1.0x "
                f"cuDNN-best below {WIDE} (docs/NOTES-tensorcore.md)")
    return None


def wide_wgrad_slow(spec: ConvSpec) -> str | None:
    """Why the grouped wgrad of wide groups counts itself slow on ``spec``, or None: 3x3 groups of 32 channels in
    and out at stride 1 on planes of 14 rows and more (H200, 2026-12-03: ResNeXt-101's 1024g32@14 at N32 ran
    0.54x cuDNN-best FP16 on wgrad_tc_grouped_half and on wgrad_grouped_mma alike, 0.068 ms against 0.037;
    the 7-row and stride-2 layers of 32-channel groups ran 1.05-1.80x; wider groups unmeasured)."""
    if spec.cg == spec.kg == WIDE and spec.stride == (1, 1) and spec.p >= 14 and (spec.r, spec.s) == (3, 3):
        return (f"groups of {spec.cg} channels, 3x3 at stride 1 on {spec.p}-row planes: the grouped wgrads ran "
                "0.54x cuDNN-best there (docs/NOTES-wgrad.md)")
    return None


class TcGrouped(TcImplicitGemm):
    """Grouped convolution as one batched GEMM of its groups (see the module docstring)."""

    grouped = True
    offset_ok = False  # a concat's channel offset: the groups' slabs already place the channels

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.named_only = self.name not in TIMED  # until a GPU has timed it (the module docstring)
        self.dgrad_timed = self.name in BACKWARD_TIMED  # its stride-1 dgrad (kernels/dgrad/transposed.py)

    def dgrad_slow_on(self, spec: ConvSpec) -> str | None:
        """``slow_on`` of this variant's dgrad form on the dgrad layer ``spec``."""
        return backward_slow(spec)

    def slow_on(self, spec: ConvSpec) -> str | None:
        if spec.kg < NARROW:
            return (f"groups of {spec.kg} output channels fill {spec.kg} of a tile's 64 columns (measured far below "
                    "cuDNN: docs/NOTES-tensorcore.md)")
        return None

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """The generator's rank on sm_90 (what it would take once timed: above the CUDA-core grouped GEMMs)."""
        return super().rank(spec, device)

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.groups == 1:
            return f"{self.name} runs grouped layers (groups > 1); tc_implicit_gemm_* runs the others"
        why = super().applies(spec, device)
        if why:
            return why
        chunk = self.math(spec).chunk_elems
        if spec.cg % chunk:
            return (f"groups of {spec.cg} input channels are not whole {chunk}-channel chunks (a chunk would "
                    "straddle two groups)")
        return None

    def _geo(self, spec: ConvSpec) -> Geometry:
        """Cg channels a tap, of pixels of the activation's (padded) C channels, group z from z Cg on."""
        pitch = prep.padded_channels(spec.c, self.math(spec))
        return Geometry(spec.n, spec.h, spec.w, spec.cg, spec.p, spec.q, spec.r, spec.s, spec.stride, spec.dilation,
                        spec.pad[0], spec.pad[2], any(spec.pad), pitch=pitch, group_stride=spec.cg)

    def _prep_steps(self, spec: ConvSpec, math: Math, ld: int) -> list[tuple[Kernel, Dim3, str, str]]:
        """The forward's filter step on K x Cg x R x S (one group's channels a row) and, unless x is
        read in place, its activation step on all C channels."""
        wk, wgrid = prep.w_krsc(dataclasses.replace(spec, c=spec.cg, groups=1), math, spec.cg, ld)
        out = [(wk, wgrid, "w", "wt")]
        if not self._in_place(spec):
            pitch = self._geo(spec).px
            xk, xgrid = (prep.x_from_nhwc(spec, math, pitch) if spec.layout == "nhwc"
                         else prep.x_nhwc(spec, math, pitch))
            out.append((xk, xgrid, "x", "xh"))
        return out

    def problem(self, spec: ConvSpec) -> Problem:
        return Problem(spec.n * spec.p * spec.q, spec.kg, spec.r * spec.s * spec.cg, spec.groups)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The generator's tiles for one group's GEMM, unsplit, by cp.async; the default first."""
        limit, math, prob = self.limit(device), self.math(spec), self.problem(spec)
        out = [self.default(spec, device)]
        out += [dataclasses.replace(c, ks=1).params() for c in tiles.space(math, prob, device.units, limit)
                if not dataclasses.replace(c, ks=1).problems(math, prob, limit)]
        return list(dict.fromkeys(out))

    def tma_reason(self, spec: ConvSpec, cfg: TileConfig) -> str | None:
        return "a grouped layer's operands come by cp.async"

    def _w_in_place(self, spec: ConvSpec) -> bool:
        return False  # each group's filters (block-diagonal where packed) are the filter step's output

    def epilogue_params(self, spec: ConvSpec, params: Params, epilogue: Epilogue) -> Params:
        return params  # the staged residual (rs=1) is not checked on the grouped outputs: their tile as chosen

    def _operands(self, spec: ConvSpec, cfg: TileConfig) -> tuple[Im2colNhwc, DenseRows]:
        math, prob = self.math(spec), self.problem(spec)
        ld = self._ld(spec, cfg)
        a = Im2colNhwc("a", cfg.a_tile(), math, "x" if self._in_place(spec) else "xh", geo=self._geo(spec))
        b = DenseRows("b", cfg.b_tile(), math, "wt", rows=spec.kg, ld=ld, kred=prob.kred, batch_stride=spec.kg * ld,
                      padded=True)
        return a, b

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """tiles.pick's tile for one group's GEMM, unsplit (the groups are the parallelism)."""
        limit, math, prob = self.limit(device), self.math(spec), self.problem(spec)
        cfg = dataclasses.replace(tiles.pick(math, prob, device.units, limit), ks=1)
        return cfg.params()

    def _workspace(self, spec: ConvSpec, cfg: TileConfig) -> tuple[tuple[str, int], ...]:
        math, geo = self.math(spec), self._geo(spec)
        out = tuple((("wt" if p == "hi" else f"wt_{p}"), math.esize * spec.k * self._ld(spec, cfg))
                    for p in math.parts)
        out += prep.scale_workspace("wt", math)
        if not self._in_place(spec):
            out += tuple((("xh" if p == "hi" else f"xh_{p}"), math.esize * geo.n * geo.h * geo.w * geo.px)
                         for p in math.parts)
            out += prep.scale_workspace("xh", math)
        return out

    def output(self, spec: ConvSpec, epilogue: Epilogue = Epilogue()) -> Output:
        """D of group z at output channels z Kg .. (NCHW planes or NHWC rows), its bias from z Kg on."""
        prob = self.problem(spec)
        pq = 1 if spec.layout == "nhwc" else spec.p * spec.q
        return Output("y", prob.m, prob.n, pq, spec.dtype, spec.k, slab=spec.kg * pq, epi=epilogue,
                      bias_z=spec.kg)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        """The forward's plan (prep steps, one GEMM launch) once the point is one this variant runs."""
        cfg = TileConfig.of(params)
        if cfg.ks != 1 or cfg.tm or cfg.cl != 1:
            raise ValueError(f"{self.name}: ks ({cfg.ks}), tm ({cfg.tm}) and cl ({cfg.cl}) must be 1, 0 and 1 "
                             "(each group's reduction whole, its operands by cp.async)")
        if epilogue.k_total:
            raise ValueError(f"{self.name}: unsupported epilogue: a channel offset (the groups place the channels)")
        return super().plan(spec, params, device, epilogue)


PACKED_COLUMNS = 64  # output channels of a packed group at most: one 64-column tile of B


def pack_factor(spec: ConvSpec) -> int:
    """Groups of ``spec`` packed into one GEMM group by :class:`TcGroupedPacked`: the most P dividing the
    groups with P Kg <= :data:`PACKED_COLUMNS` and P Cg a whole number of 8-channel chunks (1: none)."""
    best = 1
    for p in range(2, spec.groups + 1):
        if spec.groups % p == 0 and p * spec.kg <= PACKED_COLUMNS and p * spec.cg % 8 == 0:
            best = p
    return best


class TcGroupedPacked(TcGrouped):
    """Narrow groups packed: P groups of Cg -> Kg channels as one group of P Cg -> P Kg whose filters are
    block-diagonal (the filter step writes each row's Cg channels at its group's place and zeros
    elsewhere). The tensor cores then multiply P times the useful products, as the unpacked form wastes
    (64 - Kg) of a tile's 64 columns, but a tile's reduction is P times longer (R S P Cg: whole stages
    instead of one or two) and its 64 stored columns all real, and groups of 4 channels (ResNeXt's first
    stage, below an 8-channel chunk) become whole chunks. Ranked above the unpacked form wherever it packs:
    faster on every ResNeXt-50 grouped layer timed, its 32-channel groups included (docs/BENCHMARKS.md)."""

    def __init__(self, name: str, dtypes: frozenset[str], x3: bool, precision: str, specialised: int) -> None:
        super().__init__(name, dtypes, x3, precision, specialised)
        self._base = TcGrouped(name, dtypes, x3, precision, specialised)  # the unpacked form, on the packed spec

    @staticmethod
    def packed(spec: ConvSpec) -> ConvSpec:
        """The layer as the GEMM sees it: P times fewer, P times wider groups (P = :func:`pack_factor`)."""
        return dataclasses.replace(spec, groups=spec.groups // pack_factor(spec))

    def slow_on(self, spec: ConvSpec) -> str | None:
        """Groups of 16 to 31 channels at stride 2 on planes of >= 56 rows (H200, 2026-12-03, the grouped_conv
        suite in FP16 NHWC at N32-64: ResNeXt-101's 512g32@56/2 0.79x cuDNN-best, RegNetY-800MF's 64@112/2
        0.77x and 144@56/2 0.75x; the same groups at stride 2 on 28-row planes 1.21-1.42x, groups of 8 at
        stride 2 on 56- and 112-row planes 1.07-1.17x), else None."""
        if NARROW <= min(spec.cg, spec.kg) < WIDE and max(spec.stride) > 1 and spec.h >= 56:
            return (f"groups of {spec.cg} -> {spec.kg} channels at stride {max(spec.stride)} on a {spec.h}-row plane: "
                    "the packed grouped forward ran 0.75-0.79x cuDNN-best there (docs/BENCHMARKS.md)")
        return None

    def dgrad_slow_on(self, spec: ConvSpec) -> str | None:
        """None: the packed dgrad ran at 1.10-1.89x cuDNN-best FP16 on ResNeXt-50's stride-1 grouped layers,
        groups of 4 to 32 channels (docs/BENCHMARKS.md)."""
        return None

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """One above the unpacked form (the class docstring)."""
        return super().rank(spec, device) + 1

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.groups == 1 or spec.depthwise:
            return f"{self.name} packs narrow groups (groups > 1, not depthwise)"
        if pack_factor(spec) < 2:
            return (f"no two of the {spec.groups} groups of {spec.cg} -> {spec.kg} channels pack into "
                    f"{PACKED_COLUMNS} output channels of whole 8-channel chunks (tc_grouped_* runs it)")
        why = TcImplicitGemm.applies(self, spec, device)  # dtype, pass, layout, device, index widths (packed)
        if why:
            return why
        g = self.packed(spec)
        chunk = self.math(spec).chunk_elems
        return None if g.cg % chunk == 0 else f"packed groups of {g.cg} channels are not whole {chunk}-channel chunks"

    def _geo(self, spec: ConvSpec) -> Geometry:
        return self._base._geo(self.packed(spec))

    def problem(self, spec: ConvSpec) -> Problem:
        return self._base.problem(self.packed(spec))

    def _operands(self, spec: ConvSpec, cfg: TileConfig) -> tuple[Im2colNhwc, DenseRows]:
        return self._base._operands(self.packed(spec), cfg)

    def output(self, spec: ConvSpec, epilogue: Epilogue = Epilogue()) -> Output:
        return self._base.output(self.packed(spec), epilogue)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return self._base.default(self.packed(spec), device)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return self._base.space(self.packed(spec), device)

    def _prep_steps(self, spec: ConvSpec, math: Math, ld: int) -> list[tuple[Kernel, Dim3, str, str]]:
        """The block-diagonal filter step, then (unless x is read in place) the unpacked form's x step."""
        g = self.packed(spec)
        wk, wgrid = prep.w_krsc(dataclasses.replace(g, c=g.cg, groups=1), math, g.cg, ld, block=(spec.kg, spec.cg))
        return [(wk, wgrid, "w", "wt")] + self._base._prep_steps(g, math, ld)[1:]


class TcGroupedWgrad(TcWgrad):
    """wgrad of a grouped layer: the wgrad generator's GEMM per group, the groups batched (the module
    docstring)."""

    grouped = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.named_only = self.name not in BACKWARD_TIMED  # until a GPU has run and timed it

    def slow_on(self, spec: ConvSpec) -> str | None:
        return backward_slow(spec) or wide_wgrad_slow(spec)

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.groups == 1:
            return f"{self.name} runs grouped layers (groups > 1); wgrad_tc_implicit_gemm_* runs the others"
        if spec.depthwise:
            return "a depthwise layer's filter gradient is the depthwise family's (depthwise_wgrad)"
        return super().applies(spec, device)

    def problem(self, spec: ConvSpec) -> Problem:
        return Problem(spec.cg * spec.r * spec.s, spec.kg, spec.p * spec.q * self._cp(spec), spec.groups)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """Groups of at most :data:`NARROW_BN` output channels: :func:`narrow_tiles`' tile with the least
        modelled time, split as the wgrad generator splits; wider groups: the generator's default."""
        narrow = self._narrow(spec, device)
        if not narrow:
            return super().default(spec, device)
        math, prob = self.math(spec), self.problem(spec)
        return min(narrow, key=lambda c: split_cost(c.ks, c, math, prob, device.units)).params()

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The narrow tiles (each split and unsplit) first for groups of at most NARROW_BN output channels."""
        narrow = [c for cfg in self._narrow(spec, device) for c in (cfg, dataclasses.replace(cfg, ks=1))]
        out = list(dict.fromkeys(c.params() for c in narrow))
        return out + [p for p in super().space(spec, device) if p not in out]

    def _narrow(self, spec: ConvSpec, device: DeviceInfo) -> list[TileConfig]:
        if spec.kg > NARROW_BN:
            return []
        math, prob, limit = self.math(spec), self.problem(spec), self.limit(device)
        return [self._split(c, spec, device) for c in narrow_tiles(math, prob, limit)]

    def operands(self, spec: ConvSpec, cfg: TileConfig) -> tuple[Im2colNhwc, DenseRows]:
        """A: group z's im2col rows (c, r, s) of x' = [C][H][W][Np], images z Cg ..; B: its dy' rows z Kg .."""
        math, prob, cp = self.math(spec), self.problem(spec), self._cp(spec)
        geo = dataclasses.replace(geometry(dataclasses.replace(spec, c=spec.cg, groups=1), cp),
                                  group_stride=spec.cg * spec.h * spec.w * cp)
        a = Im2colNhwc("a", cfg.a_tile(), math, "xt", geo=geo)
        b = DenseRows("b", cfg.b_tile(), math, "dyt", rows=spec.kg, ld=prob.kred, kred=prob.kred,
                      batch_stride=spec.kg * prob.kred)
        return a, b

    def output(self, spec: ConvSpec) -> Output:
        """dW (K Cg R S) as group z's D (Cg R S x Kg): row (c, r s), column k at ((z Kg + k) Cg + c) R S + r s."""
        rs, prob = spec.r * spec.s, self.problem(spec)
        return Output("w", prob.m, prob.n, rs, spec.dtype, istride=rs, kstride=spec.cg * rs, slab=prob.m * prob.n,
                      epi=Epilogue())


def narrow_tiles(math: Math, prob: Problem, shared_limit: int) -> list[TileConfig]:
    """16-column tiles (wgmma m64n16k16) for a group's few output channels, where a 32-column tile leaves
    most columns empty (4 of 32 at Kg = 4): 64 rows for one consumer warpgroup, 128 for two where the
    group's C R S rows fill more than 64, each with as many stages (at most 6) as fit; cp.async operands
    (a group's channels within wider pixels are no TMA box). Emulated against float64 and compiled
    (tests/test_tensorcore_grouped.py); not yet timed, and ``backward_slow`` keeps ``auto`` off them."""
    out, pi = [], 2 if math.split else 0  # 3xTF32 promoted every 2 stages, as tiles.shapes' tiles
    for bm, cw in ((64, 1), (128, 2)) if prob.m > 64 else ((64, 1),):
        fits = [c for c in (TileConfig(bm, NARROW_BN, 1, st, cw, pi=pi) for st in range(6, 2, -1))
                if not c.problems(math, prob, shared_limit)]
        out += fits[:1]
    return out


register(TcGrouped("tc_grouped_tf32", frozenset({"float32"}), False, "relaxed", 12))
register(TcGrouped("tc_grouped_3xtf32", frozenset({"float32"}), True, "fp32", 8))
register(TcGrouped("tc_grouped_half", frozenset({"float16", "bfloat16"}), False, "fp32", 12))
register(TcGroupedPacked("tc_grouped_packed_half", frozenset({"float16", "bfloat16"}), False, "fp32", 12))
register(TcGroupedWgrad("wgrad_tc_grouped_tf32", frozenset({"float32"}), False, "relaxed", 12))
register(TcGroupedWgrad("wgrad_tc_grouped_3xtf32", frozenset({"float32"}), True, "fp32", 8))
register(TcGroupedWgrad("wgrad_tc_grouped_half", frozenset({"float16", "bfloat16"}), False, "fp32", 12))
