"""Registered variants of the generator: the implicit GEMM convolution per math mode.

Plan: (1) filters packed K x (R S Cp) in the math mode's format (a weight-only step; none for a 16-bit
1x1 layer of whole 16-byte channel chunks, whose K x C filters are read as they lie), (2) x to NHWC
(C padded to a 16-byte chunk), (3) the wgmma GEMM, M = N P Q pixels x N = K channels x R S Cp,
stored NCHW with the epilogue (or FP32 partials when split), (4) with split-K the reduce. A
channels-last layer (``layout="nhwc"``; a linear layer over channels is its 1x1 case) has step (2)
per element for 3xTF32 or channels that are not whole 16-byte chunks, none otherwise (halves and TF32
read x in place: TF32 then truncates x, the filters still rounded to nearest), and y stored NHWC:
rows staged in shared memory, 16-byte runs of channels written.

* ``tc_implicit_gemm_tf32`` (float32, class "relaxed"): TF32 operands rounded to nearest (cvt.rna),
  FP32 accumulation: relative L2 2-4e-4 (stated 3e-4, as the mma.sync TF32 variants; checked 1e-3).
* ``tc_implicit_gemm_3xtf32`` (float32, class "fp32"): operands split hi + lo, three products per
  k step, the tensor core's sums promoted into FP32 registers every ``pi`` stages; stated 1e-6,
  checked 1e-5 (the tuner measures each layer).
* ``tc_implicit_gemm_sf16`` (float32, class "relaxed"): each operand scaled by a power of two into
  FP16 and rounded to nearest (FP16 keeps TF32's 11 significant bits: the same rounding error for
  every element within 2^29 of the tensor's maximum), one product a k step at FP16's rate, FP32
  accumulation, the sums unscaled in the epilogue; stated and checked as TF32.
* ``tc_implicit_gemm_half`` (float16, bfloat16): half operands as given, exact products, FP32
  accumulation, output rounded once at the store: the error of a half convolution is its output
  rounding (NumPy emulation in tests/test_tensorcore_gen.py: relative L2 ~2.1e-4 for float16, ~1.7e-3
  for bfloat16). Its class is "fp32": nothing computes a half layer more accurately.
"""

from __future__ import annotations

import dataclasses

from convforge.codegen.dialect import Dim3, Kernel
from convforge.codegen.meta import cdiv
from convforge.kernels import register
from convforge.kernels.tensorcore.sm90 import prep, tiles, tma
from convforge.kernels.tensorcore.sm90.epilogue import Output, partials, reduce_kernel, rs_reason
from convforge.kernels.tensorcore.sm90.isa import Math, device_reason, few_pixels, math_for
from convforge.kernels.tensorcore.sm90.kernel import gemm_kernel
from convforge.kernels.tensorcore.sm90.operands import DenseRows, Geometry, Im2colNhwc, Operand
from convforge.kernels.tensorcore.sm90.smem import MAX_SHARED
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

TF32_EXPECTED, TF32_TOLERANCE = 3e-4, 1e-3
X3_EXPECTED, X3_TOLERANCE = 1e-6, 1e-5
# Output rounding of a half result (relative L2 of rounding float64 conv outputs, tests): stated, and the
# check's bound with room for the FP32 sums.
HALF_EXPECTED = {"float16": 2.1e-4, "bfloat16": 1.7e-3}
HALF_TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2}
_INT_LIMIT = 2**31 - 1
RANK_SM90 = 13  # above every mma.sync / CUDA-core variant where it applies on an sm_90 device


def expected(math: Math, dtype: str) -> float:
    if dtype in HALF_EXPECTED:
        return HALF_EXPECTED[dtype]
    return X3_EXPECTED if math.split else TF32_EXPECTED


def tolerance(math: Math, dtype: str) -> float:
    if dtype in HALF_TOLERANCE:
        return HALF_TOLERANCE[dtype]
    return X3_TOLERANCE if math.split else TF32_TOLERANCE


def split_workspace(cfg: TileConfig, prob: Problem) -> tuple[tuple[str, int], ...]:
    """The split-K partial slabs ``part`` (raw FP32, ``cfg.ks`` slices of every batch's m x n); none
    when the reduction is whole."""
    return (("part", 4 * cfg.ks * prob.batch * prob.m * prob.n),) if cfg.ks > 1 else ()


def gemm_steps(name: str, math: Math, cfg: TileConfig, prob: Problem, a: Operand, b: Operand, final: Output,
               units: int) -> tuple[list[Kernel], list[Launch]]:
    """The GEMM of ``prob`` into ``final`` and its launch. Split (``cfg.ks`` > 1), the GEMM writes the
    raw partial slabs of :func:`split_workspace` and a reduce sums them in slice order into ``final``
    with its epilogue."""
    out = final if cfg.ks == 1 else Output("part", prob.m, prob.n, final.pq, slab=prob.m * prob.n, epi=None)
    gk = gemm_kernel(f"{name}_gemm", math, cfg, prob, a, b, out)
    kernels: list[Kernel] = [gk]
    steps = [Launch(gk.name, (cfg.grid(prob, units), 1, 1), gk.block,
                    tuple(x.name for x in a.args() + b.args()) + out.refs() + ((out.buf,) if cfg.es else ()))]
    if cfg.ks > 1:
        rk, rgrid = reduce_kernel(f"{name}_reduce", final, cfg.ks, prob.batch * prob.m * prob.n, prob.batch)
        kernels.append(rk)
        steps.append(Launch(rk.name, rgrid, rk.block, ("part",) + final.refs()))
    return kernels, steps


FC_RANK = 13  # 3xTF32 on big-batch fully-connected layers: above gemm_fc (12) and gemm1x1_splitk (11)
X3_LEAD_RANK = 11  # 3xTF32 where it measured faster: above Winograd (10 at most)
X3_STEM_RANK = 4  # 3xTF32 below implicit_gemm (5) on layers of fewer than 8 input channels


def x3_rank(spec: ConvSpec) -> int | None:
    """3xTF32's heuristic rank on forward float32 NCHW layers where it was measured against the
    CUDA-core pick, or None (its stated rank then). First:

    * fully-connected, batch >= 128, reduction >= 4096: the GEMM is large enough for the tensor
      cores to beat split-K (at smaller batches split-K wins);
    * 3x3 stride 1 with H >= 56, 64 <= C <= 256 and K >= 128 (VGG's and GoogLeNet's wide early
      layers), where it beats Winograd.

    Not on smaller 3x3 layers, where it is faster than Winograd too: errors of one sign (the tensor
    core's truncating sums) add up across layers, so a network's calibration tightens them back to
    an exact fallback slower than Winograd.
    * 1x1 stride 1 with C >= 256, K >= 256 and N*P*Q <= 32768 (:func:`x3_pointwise`; at gemm1x1's rank,
      below 3xFP16 restarted every k step), its sums promoted every stage: faster than gemm1x1 there;
      promoted less often, or on narrower K, the networks' calibration tightens them back.

    Below implicit GEMM on stems of fewer than 8 input channels: padded to 16-byte chunks and
    converted whole before the GEMM, they lose to it. The measurements: docs/NOTES-tensorcore.md,
    "Measurements behind the code's choices"."""
    if spec.conv_pass != "fprop" or spec.dtype != "float32" or spec.layout != "nchw" or spec.groups != 1:
        return None
    if spec.c < 8:
        return X3_STEM_RANK
    unit = spec.stride == (1, 1) and spec.dilation == (1, 1)
    if spec.r == spec.s == spec.h == spec.w == 1:
        return FC_RANK if spec.n >= 128 and spec.c >= 4096 else None
    if x3_pointwise(spec):
        return X3_LEAD_RANK - 1 if X3H_WIDE else X3_LEAD_RANK
    if spec.r == spec.s == 3 and unit and spec.h >= 56 and 64 <= spec.c <= 256 and spec.k >= 128:
        return X3_LEAD_RANK
    return None


X3H_WIDE = True  # 3xFP16, restarted every k step, also first on 3x3 layers of C != K and deep 1x1 layers
X3H_FLOPS = 2e9  # 3xFP16 over 3xTF32 from this much work: below, its two maximum steps cost more than it saves
X3H_OVER_3XTF32 = 9  # one above 3xTF32's stated rank (8)


def x3h_rank(spec: ConvSpec) -> int | None:
    """3xFP16's rank on forward float32 layers: one above 3xTF32 on the 3x3 layers where :func:`x3_rank`
    puts that first, and first (X3_LEAD_RANK + 1) on 3x3 stride-1 layers of C = K >= 64 (residual blocks' and
    VGG's), where it is faster than the fp32 class's picks and its error (about 5e-7) keeps every such
    layer through a network's calibration. Not on 3x3 / 5x5 layers of C < K (Inception's, NIN's)
    without the restart below: errors of one sign (the tensor core's truncating sums, as 3xTF32's)
    add up there where Winograd's cancel, and calibration tightens them back to something slower.
    One above 3xTF32's stated rank (so where 3xTF32 was the pick) on layers outside Winograd's 3x3
    and 1x1 of at least :data:`X3H_FLOPS` (5x5, 1x7 / 7x1, dilated and strided 3x3); below that
    much work the two maximum steps and their launches outweigh the GEMM's gain. Below 3xTF32 on
    stems and fully-connected layers, and below every TF32 variant (the relaxed class admits 3xFP16 too).

    With :data:`X3H_WIDE` (sums restarted every k step, :func:`x3h_restart`: an error toward zero a
    tenth of what promotion left) also first on 3x3 stride-1 layers of C != K, both >= 64
    (X3_LEAD_RANK + 1), and on deep 1x1 layers (:func:`x3_pointwise`: X3_LEAD_RANK, over 3xTF32, which
    steps down to gemm1x1's 10; below gemm1x1_wgmma_tf32's 12, so the relaxed class keeps it): there
    the networks' calibration keeps them. Measurements: docs/NOTES-tensorcore.md."""
    lead = x3_rank(spec)
    if X3H_WIDE and x3_pointwise(spec):
        return X3_LEAD_RANK
    if lead == X3_LEAD_RANK and not x3_pointwise(spec):
        return lead + 1
    if lead is not None:  # stems, 1x1 and fully-connected layers (3xTF32 measured there): below it
        return min(lead - 1, X3_STEM_RANK)
    if spec.conv_pass != "fprop" or spec.dtype != "float32" or spec.groups != 1:
        return None
    winograd_domain = _unit_3x3(spec)
    if winograd_domain and (spec.c == spec.k >= 64 or (X3H_WIDE and min(spec.c, spec.k) >= 64)):
        return X3_LEAD_RANK + 1
    if not winograd_domain and (spec.r, spec.s) != (1, 1) and spec.c >= 8 and spec.flops >= X3H_FLOPS:
        return X3H_OVER_3XTF32
    return None


SF16_RANK = RANK_SM90 + 1  # scaled FP16 over tc_implicit_gemm_tf32 where that leads the relaxed class
SF16_FLOPS = 7e9  # from this much work its two maximum steps cost less than the FP16 GEMM saves


def sf16_rank(spec: ConvSpec) -> int | None:
    """Scaled FP16's rank (the relaxed class): first, over TF32, on the float32 forward layers of at
    least :data:`SF16_FLOPS` where tc_implicit_gemm_tf32 leads (8 or more input channels, not 1x1
    stride-1 layers, which gemm1x1_wgmma_tf32 reads in place); else None (its stated rank, below
    TF32). At the same error as TF32 it is faster from :data:`SF16_FLOPS` on; below, the two maximum
    steps' reads and launches outweigh the GEMM's gain (docs/NOTES-tensorcore.md)."""
    if spec.conv_pass != "fprop" or spec.dtype != "float32" or spec.groups != 1 or spec.c < 8 or few_pixels(spec):
        return None
    if _plain_1x1(spec):
        return None
    return SF16_RANK if spec.flops >= SF16_FLOPS else None


def x3h_restart(spec: ConvSpec) -> bool:
    """Where 3xFP16's default restarts its sums every k step (``tiles.restarted``): the layers it leads
    on by :data:`X3H_WIDE`, 3x3 stride-1 layers of C != K and deep 1x1 layers (:func:`x3_pointwise`).
    The restart cuts the error toward zero about tenfold, at some time; ResNet's C = K layers, which
    calibration keeps anyway, keep the cheaper promotion (docs/NOTES-tensorcore.md)."""
    return X3H_WIDE and (x3_pointwise(spec) or (_unit_3x3(spec) and spec.c != spec.k))


def _unit_3x3(spec: ConvSpec) -> bool:
    """A 3x3 layer of stride 1 and dilation 1: Winograd's domain."""
    return (spec.r, spec.s, spec.stride, spec.dilation) == (3, 3, (1, 1), (1, 1))


def wgmma_1x1_leads(spec: ConvSpec) -> bool:
    """Where gemm1x1_wgmma_tf32 ran ahead of tc_implicit_gemm_tf32 on a plain float32 1x1 layer
    (:func:`_plain_1x1`): C >= K on images of at least 28 x 28, where the generator's NCHW -> NHWC
    step moves the most bytes for the least GEMM. Elsewhere (K > C, 14 x 14 and 7 x 7) the generator
    was faster; the dgrad forms follow on the transposed problem (docs/NOTES-wgmma.md)."""
    return spec.c >= spec.k and spec.h * spec.w >= 28 * 28


def _plain_1x1(spec: ConvSpec) -> bool:
    """A 1x1 layer of stride 1 without padding: a GEMM over x as it lies (gemm1x1_wgmma_tf32's)."""
    return spec.r == spec.s == 1 and spec.stride == (1, 1) and not any(spec.pad)


def x3_pointwise(spec: ConvSpec) -> bool:
    """A 1x1 stride-1 layer of C >= 256, K >= 256 and N P Q <= 32768, where 3xTF32 ran faster than
    gemm1x1 (x3_rank) and now goes first, its sums promoted every stage (:func:`x3_promotion`)."""
    return (_plain_1x1(spec) and spec.c >= 256
            and spec.k >= 256 and spec.n * spec.p * spec.q <= 32768)


def x3_promotion(spec: ConvSpec, pi: int) -> int:
    """3xTF32's promotion interval on ``spec``: every stage on :func:`x3_pointwise` layers (ConvNeXt's
    384 -> 96 linear: 3.0e-7 against 4.4e-7 every 2 stages at 1.23x the time; errors of one sign
    from the tensor core's truncating sums are what a network's calibration weighs), else ``pi``."""
    return 1 if pi and x3_pointwise(spec) else pi


class TcVariant(Variant):
    """What the generator's GEMM variants share (forward, wgrad, strided dgrad): the math mode of the
    storage dtype (TF32, or 3xTF32 when ``x3``, 3xFP16 with ``x3h`` too, scaled FP16 with ``x3h``
    alone; the half types their own), its stated error and tolerance, CUDA on sm_90a only, the
    shared-memory limit of a device."""

    family = "implicit_gemm"
    backends = frozenset({"cuda"})
    exact = False
    tensor_cores = True  # wgmma (tests/test_tensorcore_grouped.py checks every plan says so)
    space_lead = 6
    # TMA, clusters, A's swizzle width, the split modes' k-step restart, the epilogue's staging in halves and
    # its TMA stores: plan() says where not
    optional_params = {"tm": frozenset({0, 1}), "cl": frozenset({1, 2}), "sa": frozenset({128, 64, 32}),
                       "pp": frozenset({0, 1}), "kr": frozenset({0, 1}), "eh": frozenset({0, 1}),
                       "es": frozenset({0, 1})}

    def __init__(self, name: str, dtypes: frozenset[str], x3: bool, precision: str, specialised: int,
                 x3h: bool = False) -> None:
        self.name, self.dtypes, self.x3, self.x3h = name, dtypes, x3, x3h
        self.precision, self.specialised = precision, specialised
        self.tolerance = X3_TOLERANCE if x3 else TF32_TOLERANCE

    def math(self, spec: ConvSpec) -> Math:
        """TF32, 3xTF32 (``x3``) or 3xFP16 (``x3`` and ``x3h``) for float32; a half dtype its own."""
        return math_for(spec.dtype, self.x3, self.x3h and spec.dtype == "float32")

    def expected_error(self, spec: ConvSpec) -> float:
        return expected(self.math(spec), spec.dtype)

    @staticmethod
    def limit(device: DeviceInfo) -> int:
        """Shared memory a block may take on ``device``."""
        return min(device.shared_optin_bytes, MAX_SHARED)

    def wide(self, spec: ConvSpec, *elements: int) -> str | None:
        """Why arrays of these element counts are past the generator's 32-bit offsets (byte offsets
        of the copies included), or None."""
        big = max(elements)
        if big > _INT_LIMIT // 2 or self.math(spec).esize * big > _INT_LIMIT:
            return f"an array of {big} elements needs 64-bit indexing"
        return None


class TcImplicitGemm(TcVariant):
    """Implicit GEMM convolution on the wgmma generator (see the module docstring)."""

    residual_ok = True
    offset_ok = True
    layouts = frozenset({"nchw", "nhwc"})  # NHWC: x read in place or after a per-element step, y NHWC

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """First on sm_90 devices for TF32 and half layers (the relaxed class and half dtypes), except
        the float32 1x1 layers of stride 1 without padding where gemm1x1_wgmma_tf32, reading x in place,
        was measured ahead (:func:`wgmma_1x1_leads`), and float32 layers of a handful of pixels
        (:func:`~convforge.kernels.tensorcore.sm90.isa.few_pixels`: fully-connected at a small batch), where
        the CUDA-core split-K GEMMs go first; 3xTF32 by :func:`x3_rank` where measured, else at its
        stated rank (below Winograd and gemm1x1, above implicit GEMM)."""
        if device_reason(device) is not None:
            return self.specialised
        if self.x3 and self.x3h:
            return x3h_rank(spec) or self.specialised
        if self.x3h:
            return sf16_rank(spec) or self.specialised
        if self.x3:
            return x3_rank(spec) or self.specialised
        if few_pixels(spec):
            return RANK_SM90 - 3  # below gemm_fc and gemm1x1_splitk: a weight stream (isa.few_pixels)
        if spec.dtype == "float32" and _plain_1x1(spec):
            return RANK_SM90 - 2 if wgmma_1x1_leads(spec) else RANK_SM90
        return RANK_SM90

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device) or device_reason(device)
        if why:
            return why
        geo = self._geo(spec)
        return self.wide(spec, geo.n * geo.h * geo.w * geo.cp, spec.n * spec.k * spec.p * spec.q,
                         spec.k * cdiv(geo.kred, 64) * 64)

    # -- the A operand's convolution (a subclass may gather another one: TcStemGemm) ------------
    def _geo(self, spec: ConvSpec) -> Geometry:
        """The NHWC convolution the A operand gathers: the layer itself, C padded to whole chunks."""
        cp = prep.padded_channels(spec.c, self.math(spec))
        return Geometry(spec.n, spec.h, spec.w, cp, spec.p, spec.q, spec.r, spec.s, spec.stride, spec.dilation,
                        spec.pad[0], spec.pad[2], any(spec.pad))

    def _in_place(self, spec: ConvSpec) -> bool:
        return prep.reads_in_place(spec, self.math(spec))

    def _w_in_place(self, spec: ConvSpec) -> bool:
        """Whether B is the filters as they lie: a 1x1 layer's K x C filters are K-major rows of the
        reduction when they are 16-bit operands of one part and C fills whole 16-byte chunks (the copies
        zero-fill past C), so no filter step runs (in training it ran every step: the weights change)."""
        math = self.math(spec)
        return ((spec.r, spec.s) == (1, 1) and spec.groups == 1 and math.esize == 2
                and not (math.split or math.scaled) and prep.padded_channels(spec.c, math) == spec.c)

    def _prep_steps(self, spec: ConvSpec, math: Math, ld: int) -> list[tuple[Kernel, Dim3, str, str]]:
        """(kernel, grid, source buffer, destination) of the filter step (none where the GEMM reads the
        filters in place) and, unless x is read in place, the activation step."""
        cp = self._geo(spec).cp
        out = []
        if not self._w_in_place(spec):
            wk, wgrid = prep.w_krsc(spec, math, cp, ld)
            out.append((wk, wgrid, "w", "wt"))
        if not self._in_place(spec):
            xk, xgrid = prep.x_from_nhwc(spec, math, cp) if spec.layout == "nhwc" else prep.x_nhwc(spec, math, cp)
            out.append((xk, xgrid, "x", "xh"))
        return out

    # -- parameters ---------------------------------------------------------------------------
    def problem(self, spec: ConvSpec) -> Problem:
        geo = self._geo(spec)
        return Problem(spec.n * spec.p * spec.q, spec.k, geo.kred)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The tile space; where the operands allow TMA, each of the first points also with TMA
        right after it, and the first few also in clusters of two multicasting A (the tuner decides
        between the producers); in half precision and TF32 each of the first points with TMA also
        with ping-pong consumers (``tiles.pingpong``) right before it; the default first."""
        limit, math, prob = self.limit(device), self.math(spec), self.problem(spec)
        out = [self.default(spec, device)]
        for i, c in enumerate(tiles.space(math, prob, device.units, limit)):
            t = tma.with_tma(c, lambda x: self.tma_reason(spec, x))
            if t.tm:
                if i < CLUSTER_POINTS and tiles.restarted(t, math, prob, limit).kr:
                    out.append(tiles.restarted(t, math, prob, limit).params())
                pp = tiles.pingpong(t, math, prob, limit)
                if pp.pp and i < CLUSTER_POINTS * 2:
                    out.append(pp.params())
                out.append(t.params())
                pair = dataclasses.replace(t, cl=2)
                if i < CLUSTER_POINTS and not pair.problems(math, prob, limit):
                    out.append(pair.params())
                if i >= 8:
                    continue
            out.append(c.params())
        return list(dict.fromkeys(out))

    def tma_reason(self, spec: ConvSpec, cfg: TileConfig) -> str | None:
        """Why this layer's operands cannot come by TMA with tile ``cfg``, or None."""
        return tma.pair_reason(*self._operands(spec, cfg), cfg.bm, cfg.bn)

    def _operands(self, spec: ConvSpec, cfg: TileConfig) -> tuple[Im2colNhwc, DenseRows]:
        math, prob = self.math(spec), self.problem(spec)
        ld = self._ld(spec, cfg)
        a = Im2colNhwc("a", cfg.a_tile(), math, "x" if self._in_place(spec) else "xh", geo=self._geo(spec))
        packed = not self._w_in_place(spec)
        b = DenseRows("b", cfg.b_tile(), math, "wt" if packed else "w", rows=spec.k, ld=ld, kred=prob.kred,
                      padded=packed)
        return a, b

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """tiles.pick's tile, its operands brought by TMA where they can be (never slower than
        cp.async, faster on deep small layers), else by cp.async; in half precision and TF32 with
        ping-pong consumers where the tile allows them and the tiles cover the SMs (``tiles.pingpong``;
        half precision's 256 x 64 as 128 x 64 ping-pong tiles of 8 stages, ``tiles.deep_pingpong``);
        64 x 256 in half precision where A takes a narrow swizzle and K is whole 256s (``tiles.narrow_wide``)."""
        limit, math, prob = self.limit(device), self.math(spec), self.problem(spec)
        cfg = tma.with_tma(tiles.pick(math, prob, device.units, limit), lambda c: self.tma_reason(spec, c))
        cfg = dataclasses.replace(cfg, pi=x3_promotion(spec, cfg.pi))
        if x3h_restart(spec):
            cfg = tiles.restarted(cfg, math, prob, limit)
        cfg = tiles.pingpong(cfg, math, prob, limit, device.units)
        deep = tiles.deep_pingpong(cfg, math, prob, limit, device.units)
        if deep is not cfg and not self.tma_reason(spec, deep):
            cfg = deep
        wide = tiles.narrow_wide(cfg, math, prob, limit)
        return (cfg if self.tma_reason(spec, wide) else wide).params()

    def epilogue_params(self, spec: ConvSpec, params: Params, epilogue: Epilogue) -> Params:
        """``params`` for a plan with ``epilogue`` (what torch/residual_grad.py's dgrads take). A residual read
        after the accumulators, pair by pair or by 16-byte loads into the staging, waits one memory latency a
        chunk with 8 warps a block: ResNet-50's conv1 dgrads with the residual gradient took 3.6-3.9x the
        plain dgrad's time on the H200 (twenty-fourth session). So the residual comes by ``rs=1``: loaded into
        registers at the tile's start, under the main loop's loads (``epilogue.residual_prefetch``), which
        leaves room beside 64 accumulators a thread: the tile as chosen where it takes that, else the same
        tile without ping-pong (two consumers sharing each tile's rows); else ``params``."""
        cfg = TileConfig.of(params)
        if not epilogue.residual or not cfg.eh or cfg.ks != 1:
            return params
        out = self.output(spec, epilogue)
        for c in (cfg, dataclasses.replace(cfg, pp=0)):
            staged = dataclasses.replace(c, rs=1)
            if not rs_reason(out, c.bn, c.wm) and not staged.problems(self.math(spec), self.problem(spec), MAX_SHARED):
                return staged.params()
        return params

    def _ld(self, spec: ConvSpec, cfg: TileConfig) -> int:
        """Row length of the packed filters: the reduction padded to a whole stage (C: the filters read in
        place)."""
        if self._w_in_place(spec):
            return spec.c
        math = self.math(spec)
        return cdiv(self.problem(spec).kred, math.elems(cfg.kb)) * math.elems(cfg.kb)

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return sum(b for _, b in self._workspace(spec, TileConfig.of(params)))

    def _workspace(self, spec: ConvSpec, cfg: TileConfig) -> tuple[tuple[str, int], ...]:
        math, prob, geo = self.math(spec), self.problem(spec), self._geo(spec)
        parts = math.parts
        out: tuple[tuple[str, int], ...] = ()
        if not self._w_in_place(spec):
            out = tuple((("wt" if p == "hi" else f"wt_{p}"), math.esize * spec.k * self._ld(spec, cfg))
                        for p in parts)
            out += prep.scale_workspace("wt", math)
        if not self._in_place(spec):
            out += tuple((("xh" if p == "hi" else f"xh_{p}"), math.esize * geo.n * geo.h * geo.w * geo.cp)
                         for p in parts)
            out += prep.scale_workspace("xh", math)
        return out + split_workspace(cfg, prob)

    # -- plan ---------------------------------------------------------------------------------
    def output(self, spec: ConvSpec, epilogue: Epilogue = Epilogue()) -> Output:
        """D (N P Q x K) as y: NCHW planes, or NHWC rows (row m = pixel, its K channels contiguous)."""
        prob = self.problem(spec)
        pq = 1 if spec.layout == "nhwc" else spec.p * spec.q
        return Output("y", prob.m, prob.n, pq, spec.dtype, epilogue.k_total, epilogue.k_offset, epi=epilogue)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        return self._plan(spec, params, device, epilogue)

    def plan_stats(self, spec: ConvSpec, params: Params, device: DeviceInfo) -> tuple[Plan, int]:
        """(plan, P): the forward whose epilogue also writes the batch norm's per-channel partial sums of the
        stored y into a buffer "bnpart" the caller gives: 4 x P x K floats in kernels/batchnorm.py's
        PARTIAL_ROWS order, what ``bn_program(partials=P)`` finalizes without reading y again
        (sm90/epilogue.py's docstring). Unsplit (``ks`` taken as 1), NHWC, the conv's plain output (no bias,
        residual or activation); ValueError where it cannot."""
        if spec.conv_pass != "fprop" or spec.layout != "nhwc":
            raise ValueError(f"{self.name}: batch-norm statistics in the epilogue need an NHWC forward, not "
                             f"{spec.conv_pass} {spec.layout}")
        params = params.replace(ks=1) if params.get("ks", 1) != 1 else params
        plan = self._plan(spec, params, device, Epilogue(), stats=True)
        return plan, partials(self.problem(spec).m, TileConfig.of(params).wm)

    def _plan(self, spec: ConvSpec, params: Params, device: DeviceInfo, epilogue: Epilogue,
              stats: bool = False) -> Plan:
        math, prob, cfg = self.math(spec), self.problem(spec), TileConfig.of(params)
        why = cfg.problems(math, prob, self.limit(device))
        if why:
            raise ValueError(f"{self.name}: {'; '.join(why)}")
        if cfg.tm and self.tma_reason(spec, cfg):
            raise ValueError(f"{self.name}: tm=1: {self.tma_reason(spec, cfg)}")
        ld = self._ld(spec, cfg)
        a, b = self._operands(spec, cfg)
        kernels: list[Kernel] = []
        steps: list[Launch] = []
        for kern, grid, src, dst in self._prep_steps(spec, math, ld):
            for k, launch in prep.launches(math, kern, grid, src, dst, spec):
                kernels.append(k)
                steps.append(launch)
        out = self.output(spec, epilogue)
        if stats:
            out = dataclasses.replace(out, stats=True)
            if out.stats_reason():
                raise ValueError(f"{self.name}: {out.stats_reason()}")
        gemm, launches = gemm_steps(self.name, math, cfg, prob, a, b, out, device.units)
        kernels += gemm
        steps += launches
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps),
                    self._workspace(spec, cfg), tolerance(math, spec.dtype), epilogue)


class TcStemGemm(TcImplicitGemm):
    """A stem (fewer input channels than a 16-byte chunk holds: 3-channel images) on the generator with
    its S filter columns folded into channels (``prep.x_fold`` / ``w_fold``): the layer as an R x 1
    convolution of S C channels over an image Q columns wide, stride (sh, 1). Padding C to a chunk
    wastes most of the reduction (7x7, C = 3 in half precision: 49 taps x 8 channels for 147 real
    terms); folded it is 7 x 24 (168 terms). The folded input is written whole before the GEMM
    (N H Q x S C elements, more than x: the price of the fold), so the tuner weighs the two."""

    MAX_FOLDED = 64  # S C at most: a stem, not a layer whose columns would multiply the input's size

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Half precision: above the plain implicit GEMM, faster on every stem measured. TF32 (not
        measured: its chunk of 4 channels wastes less, and x' is 4-byte) below it, in the tuner's space.
        Both below the direct stems (tensorcore/sm90/stem.py) wherever those apply. 3xFP16 (fp32 class) below
        implicit_gemm: it ties it on most stems, and its one-sign error in the first layer makes a
        network's calibration tighten many later layers (docs/NOTES-tensorcore.md)."""
        if device_reason(device) is not None:
            return self.specialised
        if self.x3h:  # in the tuner's space and --algo only (docstring)
            return self.specialised
        return RANK_SM90 + 1 if spec.dtype in HALF_EXPECTED else RANK_SM90 - 4

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        chunk = self.math(spec).chunk_elems if spec.dtype in self.dtypes else 1
        if spec.s < 2 or spec.c % chunk == 0:
            return f"the fold pays where C ({spec.c}) is not whole {chunk}-element chunks and S ({spec.s}) > 1"
        if spec.s * spec.c > self.MAX_FOLDED:
            return f"S * C ({spec.s * spec.c}) above {self.MAX_FOLDED}: not a stem"
        math = self.math(spec)
        if prep.padded_channels(spec.s * spec.c, math) >= spec.s * prep.padded_channels(spec.c, math):
            return f"folding {spec.s} columns of {spec.c} channels saves no padding in {math.name}"
        return super().applies(spec, device)

    def _geo(self, spec: ConvSpec) -> Geometry:
        """R x 1 over x' = [N][H][Q][S C padded]: stride (sh, 1), dilation (dh, 1), the top and bottom
        padding kept, the left one inside the fold."""
        cp = prep.padded_channels(spec.s * spec.c, self.math(spec))
        return Geometry(spec.n, spec.h, spec.q, cp, spec.p, spec.q, spec.r, 1, (spec.stride[0], 1),
                        (spec.dilation[0], 1), spec.pad[0], 0, spec.pad[0] > 0 or spec.pad[1] > 0)

    def _in_place(self, spec: ConvSpec) -> bool:
        return False

    def _w_in_place(self, spec: ConvSpec) -> bool:
        return False  # the folded filters are a step's output

    def _prep_steps(self, spec: ConvSpec, math: Math, ld: int) -> list[tuple[Kernel, Dim3, str, str]]:
        cp = self._geo(spec).cp
        wk, wgrid = prep.w_fold(spec, math, cp, ld)
        xk, xgrid = prep.x_fold(spec, math, cp)
        return [(wk, wgrid, "w", "wt"), (xk, xgrid, "x", "xh")]


CLUSTER_POINTS = 3  # the first points of the space also tried in clusters of two (tuned, never the default)

register(TcImplicitGemm("tc_implicit_gemm_tf32", frozenset({"float32"}), False, "relaxed", 12))
register(TcImplicitGemm("tc_implicit_gemm_3xtf32", frozenset({"float32"}), True, "fp32", 8))
register(TcImplicitGemm("tc_implicit_gemm_half", frozenset({"float16", "bfloat16"}), False, "fp32", 12))
register(TcImplicitGemm("tc_implicit_gemm_3xf16", frozenset({"float32"}), True, "fp32", 7, x3h=True))
register(TcImplicitGemm("tc_implicit_gemm_sf16", frozenset({"float32"}), False, "relaxed", 10, x3h=True))
register(TcStemGemm("tc_stem_gemm_tf32", frozenset({"float32"}), False, "relaxed", 11))
register(TcStemGemm("tc_stem_gemm_half", frozenset({"float16", "bfloat16"}), False, "fp32", 11))
register(TcStemGemm("tc_stem_gemm_3xf16", frozenset({"float32"}), True, "fp32", 4, x3h=True))
