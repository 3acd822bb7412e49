"""One tile configuration type for the generator, its resources, and the one pick / space.

A block is 1 producer warpgroup + ``cw`` consumer warpgroups. Consumer c owns rows
[64 wm c, 64 wm (c + 1)) of the ``bm`` x ``bn`` block tile (wm = bm / (64 cw) m64 blocks, each one
wgmma m64n{bn} per k step and product), so it holds wm * bn / 2 f32 accumulators per thread. ``bn`` is a
multiple of 32, or 16 (one pass of the cp.async producer's 16 rows: a narrow grouped wgrad's tile).
A stage holds ``kb`` 128-byte atoms of K (32 TF32 or 64 FP16/BF16 elements per atom), ``st`` stages
ring between producer and consumers. ``ks`` splits the reduction (partials + a deterministic
reduce), ``ps`` = 1 runs a persistent grid of at most one block per SM, ``tm`` = 1 brings the
operands by TMA (tensorcore/sm90/tma.py) instead of cp.async. ``cl`` = 2 (with TMA) runs blocks in
clusters of two that take neighbouring N tiles of one M tile: each brings half of the shared A tile
and multicasts it to both (tma.py), so A crosses from L2 once per pair; a stage is free again once
the consumers of both blocks have released it. ``sa`` = 64 or 32 (with TMA) lays A's tile out in that
swizzle (smem.py): for im2col operands whose channels are 16 or 8 TF32 elements (wgrad's x' at a batch
of 16 mod 32), which a 128-byte box would straddle two taps of. ``pp`` = 1 ("ping-pong", CUTLASS's name):
the two consumers no longer share a tile's rows; each takes whole ``bm`` x ``bn`` tiles, the block's
tiles in turn, so one stores its tile while the other multiplies (the shared schedule leaves the tensor
cores idle during every epilogue).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from convforge.codegen.meta import cdiv
from convforge.kernels.tensorcore.sm90 import epilogue
from convforge.kernels.tensorcore.sm90.isa import Math, n_ok
from convforge.kernels.tensorcore.sm90.smem import MAX_SHARED, StageLayout, Tile
from convforge.params import Params

KEYS = ("bm", "bn", "kb", "st", "cw", "ks", "ps", "pi", "tm", "cl", "sa", "pp", "kr", "mn", "eh", "es", "rs")
WG = 128  # threads of a warpgroup
ACC_LIMIT = 128  # f32 accumulators per consumer thread that leave room for addresses (<= 232 registers)
PRODUCER_REGS, CONSUMER_REGS = 80, 200  # setmaxnreg split of 3 warpgroups (128 * 80 + 256 * 200 <= 64K;
# ptxas: the cp.async producer of 16 rows spilled at 72, a 128-accumulator consumer fits in 200)
TMA_PRODUCER_REGS, KR_CONSUMER_REGS = 40, 232  # kr: three sets of 64 accumulators; a TMA producer is one thread
BN_CHOICES = (64, 128, 256, 96, 192, 32, 160, 224)


@dataclass(frozen=True)
class Problem:
    """The GEMM a plan runs: ``m`` rows (pixels or tiles), ``n`` columns (output channels), a reduction of
    ``kred`` elements, ``batch`` independent GEMMs (Winograd's alpha^2)."""

    m: int
    n: int
    kred: int
    batch: int = 1


@dataclass(frozen=True)
class TileConfig:
    bm: int
    bn: int
    kb: int = 1
    st: int = 4
    cw: int = 2
    ks: int = 1
    ps: int = 1
    pi: int = 0  # 3xTF32: promote the wgmma sums into FP32 registers every pi stages (0: never)
    cl: int = 1  # blocks per cluster (2: A multicast to a pair of N tiles; TMA only)
    tm: int = 0  # 1: the operands come by TMA (one producer thread, tensorcore/sm90/tma.py), 0: by cp.async
    sa: int = 128  # A's swizzle width in bytes (64 or 32, TMA only: channels that are not whole 128-byte rows)
    pp: int = 0  # 1: the two consumers take whole tiles in turn ("ping-pong"), 0: they share each tile
    kr: int = 0  # split modes: 1 restarts the wgmma sums every k step (two register sets in turn, each added
    # into FP32 registers by round-to-nearest), so the tensor core truncates k products' sums, not the running sum
    mn: int = 0  # 1: both operands MN-major (16-bit types, TMA): a stage holds kb x 64 K rows of bm and bn
    # elements (channels-last activations whose reduction runs over pixels: wgrad_nhwc.py)
    eh: int = 1  # 1: a 16-bit row-major output without bias or residual is staged as rounded halves and stored
    # 16 bytes a thread (epilogue.h8_reason), 0: staged in float32 and stored 8 bytes a thread
    es: int = 0  # 1: the half-staged chunks leave by TMA stores (one thread issues each; the consumer goes on
    # while the copy engine reads the staging): outputs of plain rows only (epilogue.es_reason)
    rs: int = 0  # 1: a residual comes into the half-staged chunk by 16-byte loads (the store phase's pattern)
    # before the accumulators are packed, each pair reading its word back from shared memory (epilogue.rs_reason)

    @property
    def groups(self) -> int:
        """Consumer warpgroups sharing one tile's rows: all of them, or one with ping-pong."""
        return 1 if self.pp else self.cw

    @property
    def wm(self) -> int:
        """m64 blocks per consumer warpgroup and tile."""
        return self.bm // (64 * self.groups)

    @property
    def threads(self) -> int:
        return WG * (1 + self.cw)

    @property
    def acc(self) -> int:
        """f32 accumulators per consumer thread (twice as many registers with promotion, three times with kr)."""
        return self.wm * self.bn // 2

    @property
    def sets(self) -> int:
        """Register sets of ``acc`` accumulators: the wgmma sums, the FP32 sums they are promoted into
        (pi), a second wgmma set taking every other k step (kr)."""
        return 3 if self.kr else 2 if self.pi else 1

    @property
    def summed(self) -> str:
        """The prefix of the accumulators the epilogue stores: the FP32 sums where there are any."""
        return "f" if self.sets > 1 else "d"

    def a_tile(self) -> Tile:
        """A's part of a stage: ``kb`` x 128 bytes of K in column blocks of its swizzle width (MN-major:
        ``kb`` x 64 K rows of bm / 64 blocks)."""
        if self.mn:
            return Tile(self.kb * 64, self.bm // 64, major="mn")
        return Tile(self.bm, self.kb * 128 // self.sa, self.sa)

    def b_tile(self) -> Tile:
        if self.mn:
            return Tile(self.kb * 64, self.bn // 64, major="mn")
        return Tile(self.bn, self.kb)

    def stage(self, math: Math) -> StageLayout:
        return StageLayout(self.a_tile(), self.b_tile(), math.parts)

    def shared_bytes(self, math: Math) -> int:
        """Launch-sized shared memory: 1024 bytes of alignment slack, the stages, the consumers'
        epilogue staging, two mbarriers per stage (and the ping-pong consumers' two turn barriers)."""
        return (1024 + self.st * self.stage(math).nbytes + self.cw * epilogue.staging_bytes(self.wm, bool(self.es))
                + 16 * self.st + 16 * self.pp)

    def regs(self) -> tuple[int, int] | None:
        """(producer, consumer) registers for setmaxnreg, None when the launch bound leaves enough."""
        need = self.acc * self.sets
        if self.cw == 2 and need > ACC_LIMIT + 32:
            return TMA_PRODUCER_REGS, KR_CONSUMER_REGS
        if self.cw == 2 and need > 64:
            return PRODUCER_REGS, CONSUMER_REGS
        return None

    def problems(self, math: Math, prob: Problem | None = None, shared_limit: int = MAX_SHARED) -> list[str]:
        """Why this configuration cannot run (empty when it can)."""
        out = []
        if self.cw not in (1, 2) or self.bm % (64 * self.groups) or self.wm not in (1, 2):
            out.append(f"bm ({self.bm}) must be 64 x cw ({self.cw}) x 1 or 2" if not self.pp else
                       f"bm ({self.bm}) must be 64 or 128 with pp=1 (each consumer takes a whole tile)")
        if self.pp not in (0, 1) or (self.pp and (self.cw != 2 or self.cl != 1 or not self.ps)):
            out.append(f"pp ({self.pp}) must be 0, or 1 with cw=2, cl=1 and ps=1 (two consumers taking a "
                       "persistent block's tiles in turn)")
        if not n_ok(self.bn) or (self.bn % 32 and self.bn != 16):
            out.append(f"bn ({self.bn}) must be 16, or a multiple of 32 in 32..256")
        if self.kb not in (1, 2):
            out.append(f"kb ({self.kb}) must be 1 or 2 atoms of 128 bytes")
        if not 2 <= self.st <= 8:
            out.append(f"st ({self.st}) must be 2..8 stages")
        limit = ACC_LIMIT + {1: 0, 2: 32, 3: 64 if self.tm else 0}[self.sets]
        if self.acc * self.sets > limit:
            out.append(f"{self.acc} accumulators per thread (bm {self.bm}, bn {self.bn}) in {self.sets} set(s) "
                       f"exceed {limit}" + (" (kr's 192 need TMA's one-thread producer)" if self.kr else ""))
        if (self.pi or self.kr) and not math.split:
            out.append("pi (promotion) and kr (k-step restart) are settings of the split modes (3xTF32, 3xFP16)")
        if self.kr not in (0, 1) or (self.kr and self.pi):
            out.append(f"kr ({self.kr}) must be 0, or 1 with pi=0 (the restart promotes every k step)")
        if self.pi < 0 or self.ks < 1 or self.ps not in (0, 1) or self.tm not in (0, 1):
            out.append("pi >= 0, ks >= 1, ps 0 or 1, tm 0 or 1")
        if self.eh not in (0, 1) or self.es not in (0, 1) or (self.es and not self.eh):
            out.append(f"eh ({self.eh}) and es ({self.es}) must be 0 or 1, es=1 with eh=1 (TMA stores of half-staged "
                       "chunks)")
        if self.rs not in (0, 1) or (self.rs and not self.eh):
            out.append(f"rs ({self.rs}) must be 0, or 1 with eh=1 (a residual staged into the half-staged chunk)")
        if self.cl not in (1, 2) or (self.cl == 2 and not self.tm):
            out.append(f"cl ({self.cl}) must be 1, or 2 with tm=1 (clusters pay through TMA multicast)")
        mn_bad = self.mn and (self.mn != 1 or math.esize != 2 or math.split or math.scaled or not self.tm or self.cl > 1
                        or self.sa != 128 or self.bn % 64 or self.bm % 64 or self.bn > 256)
        if mn_bad:
            out.append(f"mn ({self.mn}): MN-major operands are 16-bit (FP16, BF16), by TMA, without clusters, in "
                       "whole 64-element blocks of bm and bn (bn at most 256)")
        if self.sa not in (128, 64, 32) or (self.sa != 128 and not self.tm):
            out.append(f"sa ({self.sa}) must be 128, or 64 or 32 with tm=1 (a narrow swizzle serves TMA copies)")
        elif not mn_bad and self.shared_bytes(math) > shared_limit:
            out.append(f"{self.shared_bytes(math)} bytes of shared memory exceed {shared_limit}")
        if prob is not None and self.cl > 1 and cdiv(prob.n, self.bn) % self.cl:
            out.append(f"cl ({self.cl}) needs a whole number of N-tile groups, not {cdiv(prob.n, self.bn)} tiles "
                       "(a block wholly past the matrix would copy a box of nothing but zeros)")
        if prob is not None and self.ks > 1 and (self.ks - 1) * cdiv(self.k_blocks(math, prob), self.ks) \
                >= self.k_blocks(math, prob):
            out.append(f"ks ({self.ks}) leaves a split of {self.k_blocks(math, prob)} k blocks empty")
        return out

    def k_blocks(self, math: Math, prob: Problem) -> int:
        """Stages of K in the whole reduction."""
        return cdiv(prob.kred, math.elems(self.kb))

    def tiles(self, prob: Problem) -> int:
        """Output tiles of the problem, split-K slices and batch included."""
        return cdiv(prob.m, self.bm) * cdiv(prob.n, self.bn) * self.ks * prob.batch

    def work(self, prob: Problem) -> int:
        """Units of work a cluster takes in turn: tiles, or with ``cl`` = 2 pairs of N tiles."""
        if self.cl == 1:
            return self.tiles(prob)
        return cdiv(cdiv(prob.n, self.bn), self.cl) * cdiv(prob.m, self.bm) * self.ks * prob.batch

    def grid(self, prob: Problem, units: int) -> int:
        """Blocks launched: every unit of work (ps=0) or at most one block per SM (ps=1), in whole clusters."""
        if self.ps:
            return self.cl * min(self.work(prob), max(units // self.cl, 1))
        return self.cl * self.work(prob)

    def params(self) -> Params:
        keys = dict(bm=self.bm, bn=self.bn, kb=self.kb, st=self.st, cw=self.cw, ks=self.ks, ps=self.ps)
        return Params({**keys, **({"pi": self.pi} if self.pi else {}), **({"tm": self.tm} if self.tm else {}),
                       **({"cl": self.cl} if self.cl > 1 else {}), **({"sa": self.sa} if self.sa != 128 else {}),
                       **({"pp": self.pp} if self.pp else {}), **({"kr": self.kr} if self.kr else {}),
                       **({"mn": self.mn} if self.mn else {}), **({} if self.eh else {"eh": 0}),
                       **({"es": 1} if self.es else {}), **({"rs": 1} if self.rs else {})})

    @classmethod
    def of(cls, p: Params) -> TileConfig:
        unknown = set(p) - set(KEYS)
        if unknown:
            raise ValueError(f"unknown tensor-core tile parameters {sorted(unknown)} (known: {', '.join(KEYS)})")
        return cls(int(p.bm), int(p.bn), int(p.get("kb", 1)), int(p.get("st", 4)), int(p.get("cw", 2)),
                   int(p.get("ks", 1)), int(p.get("ps", 1)), int(p.get("pi", 0)), int(p.get("cl", 1)),
                   int(p.get("tm", 0)), int(p.get("sa", 128)), int(p.get("pp", 0)), int(p.get("kr", 0)),
                   int(p.get("mn", 0)), int(p.get("eh", 1)), int(p.get("es", 0)), int(p.get("rs", 0)))


# Relative throughput of a block tile's wgmma stream per operand element size (m64nN with both operands in
# shared memory: a narrow N reads more operand bytes per FLOP, and FP16 at twice TF32's rate feels it more;
# fitted to sweeps, docs/NOTES-tensorcore.md).
TILE_EFFICIENCY = {4: {(128, 64): 0.8, (256, 64): 0.9, (128, 128): 1.0},
                   2: {(128, 64): 0.7, (256, 64): 0.85, (128, 128): 1.0, (128, 192): 0.95}}
# Half precision: 128 x 192 (shared tiles, 4 stages) where it takes one wave and 128 x 128 two, as TF32 below;
# two waves of it lose, which the wave model prices.
# TF32 with ping-pong consumers (its default): 128 x 128 above 128 x 64, since fewer, wider tiles need fewer waves
# on deep layers. 3xTF32 keeps the table above.
TF32_EFFICIENCY = {(128, 64): 0.7, (256, 64): 0.9, (128, 128): 1.0, (128, 192): 0.95}
# 128 x 192 (shared tiles: its 192 accumulators a tile are too many for one ping-pong consumer; 4 stages) where
# it takes one wave and 128 x 128 two; two waves of it lose, which the wave model prices.
MAX_STAGES = {(128, 192): 4}


def tile_efficiency(math: Math) -> dict[tuple[int, int], float]:
    """The block-tile efficiencies the wave model uses for ``math``."""
    return TF32_EFFICIENCY if math.name == "tf32" else TILE_EFFICIENCY[math.esize]


def _wave_cost(bm: int, bn: int, math: Math, prob: Problem, units: int) -> float:
    """Time model of a tile shape: whole waves of tiles over the SMs, each tile's work over its
    efficiency (narrow tiles waste less of the last wave; wide ones stream better)."""
    tiles = cdiv(prob.m, bm) * cdiv(prob.n, bn) * prob.batch
    return cdiv(tiles, max(units, 1)) * bm * bn / tile_efficiency(math)[bm, bn]


def split_for(cfg: TileConfig, math: Math, prob: Problem, units: int) -> int:
    """ks: slices of the reduction when the tiles fill less than half the SMs and each slice keeps
    at least 4 stages of K (so the partials' extra traffic buys parallelism, not overhead)."""
    tiles, nk = cfg.tiles(prob), cfg.k_blocks(math, prob)
    if tiles * 2 > units:
        return 1
    ks = min(units // max(tiles, 1), nk // 4, 16)
    while ks > 1 and (ks - 1) * cdiv(nk, ks) >= nk:
        ks -= 1
    return max(ks, 1)


def pick(math: Math, prob: Problem, units: int, shared_limit: int = MAX_SHARED) -> TileConfig:
    """The default: 2 consumer warpgroups, the block tile of :data:`TILE_EFFICIENCY` with the least
    modelled time (:func:`_wave_cost`; 128 wide only for more than 64 channels) where 3 stages fit,
    one atom of K per stage, as many stages as fit (at most 6), 3xTF32 promoted every 2 stages
    (every 4 errs more at the same time, every stage costs time), split-K where the tiles still fill
    less than half the SMs, a persistent grid."""
    cfg = min(shapes(math, prob, shared_limit), key=lambda c: _wave_cost(c.bm, c.bn, math, prob, units))
    cfg = narrow(cfg, math, prob, shared_limit)
    return dataclasses.replace(cfg, ks=split_for(cfg, math, prob, units))


NARROW_N = 16  # a GEMM of at most this many columns takes 16-column tiles (:func:`narrow`)


def narrow(cfg: TileConfig, math: Math, prob: Problem, shared_limit: int = MAX_SHARED) -> TileConfig:
    """``cfg`` 16 columns wide where the GEMM has at most :data:`NARROW_N` (a layer writing 3 RGB channels,
    a segmentation head's classes): a 64-wide tile would spend three quarters or more of its wgmma work
    and B traffic on zero columns. H200, DCGAN's last 4x4/2 transposed layer (64 -> 3 channels, N128):
    0.0756 -> 0.0609 ms in FP16 NCHW, 0.0680 -> 0.0472 in NHWC (``bench --sweep``); 32 columns on 21
    (FCN-8s' head) moved nothing, so wider GEMMs keep the wave model's tile. Plain FP16 / BF16 only: the
    TF32 and split modes were not timed with it (their spaces hold it). Else ``cfg``."""
    if prob.n > NARROW_N or cfg.bn <= 16 or math.esize != 2 or math.split or math.scaled:
        return cfg
    slim = dataclasses.replace(cfg, bn=16)
    return cfg if slim.problems(math, prob, shared_limit) else slim


def restarted(cfg: TileConfig, math: Math, prob: Problem | None = None, shared_limit: int = MAX_SHARED) -> TileConfig:
    """3xFP16's default: ``cfg`` with its wgmma sums restarted every k step (kr=1, pi=0) where the third
    register set fits (128 x 128 needs the one-thread TMA producer), else ``cfg`` as it is. The tensor core
    aligns each instruction's addends to the largest and truncates the rest toward zero; promoted every 2
    stages the running sum is that largest, so every product loses bits toward zero and the error takes the
    output's sign (scripts/tc_sum_model.py: a bias 10-100x an FP32 sum's, 3-5x less restarted each k step),
    which adds up across a network's layers."""
    if not (math.split and math.scaled and X3H_RESTART) or cfg.kr:
        return cfg
    kr = dataclasses.replace(cfg, pi=0, kr=1)
    return cfg if kr.problems(math, prob, shared_limit) else kr


X3H_RESTART = True  # 3xFP16's defaults restart the sums every k step (:func:`restarted`)


def pingpong(cfg: TileConfig, math: Math, prob: Problem | None = None, shared_limit: int = MAX_SHARED,
             units: int | None = None) -> TileConfig:
    """``cfg`` with ping-pong consumers where they run it (bm 64 or 128, two consumers, persistent,
    no cluster; operands by TMA, as timed) in half precision and TF32, else ``cfg``; with ``units``
    (the default's choice) only where the tiles cover every SM once at least: below that, ping-pong
    has no second tile to overlap and loses. 3xTF32 keeps shared tiles (no rule found for it)."""
    if math.split or cfg.pp or not cfg.tm:
        return cfg
    pp = dataclasses.replace(cfg, pp=1)
    if pp.problems(math, prob, shared_limit):
        return cfg
    return cfg if units is not None and prob is not None and pp.work(prob) < units else pp


PP_DEEP_STAGES = 8  # stages of the ping-pong 128 x 64 tile replacing half precision's 256 x 64 (:func:`deep_pingpong`)
PP_DEEP_K_BLOCKS = 16  # at most this many k steps a tile: where an epilogue is a large share of a tile's time


def deep_pingpong(cfg: TileConfig, math: Math, prob: Problem, shared_limit: int = MAX_SHARED,
                  units: int = 0) -> TileConfig:
    """``cfg`` as 128 x 64 ping-pong tiles of :data:`PP_DEEP_STAGES` stages where half precision's wave model
    chose 256 x 64 (which cannot ping-pong), one tile spans every output channel, a tile takes at most
    :data:`PP_DEEP_K_BLOCKS` k steps and the tiles cover the ``units`` SMs: one consumer's epilogue then
    overlaps the other's wgmma, and the deeper ring keeps the producer a tile ahead. With many k steps
    a tile, or several N tiles, the shared tile wins; else ``cfg``."""
    if math.esize != 2 or (cfg.bm, cfg.bn) != (256, 64) or cfg.pp or not cfg.tm or cfg.cl != 1:
        return cfg
    if prob.n > cfg.bn or cfg.k_blocks(math, prob) > PP_DEEP_K_BLOCKS:
        return cfg
    deep = dataclasses.replace(cfg, bm=128, pp=1, st=PP_DEEP_STAGES)
    if deep.problems(math, prob, shared_limit) or deep.work(prob) < units:
        return cfg
    return deep


def narrow_wide(cfg: TileConfig, math: Math, prob: Problem, shared_limit: int = MAX_SHARED) -> TileConfig:
    """``cfg`` as 64 x 256 ping-pong tiles of 4 stages where a half-precision default takes ping-pong, A
    comes in a narrow swizzle (channels that are not whole 128-byte rows: 96, 160) and K is a multiple
    of 256: one tile then spans every output channel, so each A block's im2col rows cross from L2 once,
    not twice. Where K is not a multiple of 256, and in TF32, the tile loses; else ``cfg``."""
    if math.esize != 2 or not cfg.pp or cfg.sa == 128 or prob.n % 256:
        return cfg
    wide = dataclasses.replace(cfg, bm=64, bn=256, st=4)
    return cfg if wide.problems(math, prob, shared_limit) else wide


def shapes(math: Math, prob: Problem, shared_limit: int = MAX_SHARED) -> list[TileConfig]:
    """The candidate default tiles, unsplit: each block tile of :data:`TILE_EFFICIENCY` (128 wide
    only for more than 64 channels) with as many stages as fit (at most 6, at least 3), one atom of
    K per stage, 2 consumers, persistent, 3xTF32 promoted every 2 stages."""
    pi = 2 if math.split else 0

    def stages(bm: int, bn: int) -> int:
        top = MAX_STAGES.get((bm, bn), 6)
        return max((s for s in range(2, top + 1) if not TileConfig(bm, bn, 1, s, 2, 1, 1, pi)
                    .problems(math, shared_limit=shared_limit)), default=0)

    return [TileConfig(bm, bn, 1, stages(bm, bn), 2, 1, 1, pi) for bm, bn in tile_efficiency(math)
            if stages(bm, bn) >= 3 and (bn == 64 or prob.n > 64) and bn <= 2 * max(prob.n, 32)]


def efficiency(cfg: TileConfig, math: Math, table: dict[int, dict[tuple[int, int], float]] | None = None) -> float:
    """The block tile's efficiency (``table``, default :data:`TILE_EFFICIENCY`) relative to 128 x
    64's (0.8 of it for a shape not measured)."""
    eff = (table or TILE_EFFICIENCY)[math.esize]
    return eff.get((cfg.bm, cfg.bn), 0.8 * eff[128, 64]) / eff[128, 64]


def space(math: Math, prob: Problem, units: int, shared_limit: int = MAX_SHARED) -> list[TileConfig]:
    """The default first, then every valid configuration that does not overshoot the channels by
    2x (bn, bm for 1 or 2 consumers, kb, 3-6 stages, the default's split and no split, persistent or
    not, 3xTF32 promotion intervals), the ones sweeps found promising first (persistent grids,
    deeper pipelines, one atom per stage, 2 consumers; shapes by the wave model)."""
    first = pick(math, prob, units, shared_limit)
    splits = sorted({1, first.ks})
    sums = ((2, 0), (4, 0), (1, 0), (0, 1)) if math.split else ((0, 0),)  # (pi, kr)
    out = []
    bns = BN_CHOICES + ((16,) if prob.n <= 2 * NARROW_N else ())  # 16 columns only where they can pay
    for bn, bm, cw, kb, st, ks, ps, (pi, kr) in itertools.product(bns, (128, 256, 64), (2, 1), (1, 2),
                                                                  (6, 5, 4, 3), splits, (1, 0), sums):
        cfg = TileConfig(bm, bn, kb, st, cw, ks, ps, pi, kr=kr)
        if bn > 2 * max(prob.n, 32) or cfg == first or cfg.problems(math, prob, shared_limit):
            continue
        out.append(cfg)

    def order(c: TileConfig) -> tuple[float, ...]:
        eff = TILE_EFFICIENCY[math.esize]
        shape = _wave_cost(c.bm, c.bn, math, prob, units) if (c.bm, c.bn) in eff else float("inf")
        return (c.ps == 0, c.cw == 1, shape, c.pi != first.pi, -c.st, c.kb, c.ks != first.ks)

    return [first] + sorted(out, key=order)
