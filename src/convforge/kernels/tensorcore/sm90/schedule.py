"""Which tile a block works on: persistent loop, raster order, split-K ranges.

Tiles are numbered with the N tile (output channels) fastest, then the M tile (pixels), then the
split-K slice, then the batch: blocks resident at the same time share rows of A, the expensive
gathered operand, which then comes from L2 for all but the first of them. With ``ps`` = 1 the grid
has at most one block per SM and each block walks tiles ``blockIdx.x + i * gridDim.x`` (its
producer runs ahead into the next tile while the consumers store the last); with ``ps`` = 0 each
block takes one tile. Both warpgroup roles decode the same sequence, so their stage rings agree.
With ``cl`` = 2 the unit of work is a pair of neighbouring N tiles of one M tile, taken by a
cluster of two blocks (``crank`` = 0, 1: the block's rank in it): the loop runs over clusters
(``clusterIdx``, ``nclusterId``), both blocks of a cluster through the same units in step.
"""

from __future__ import annotations

from convforge.codegen.meta import cdiv
from convforge.kernels.tensorcore.sm90.cexpr import Let
from convforge.kernels.tensorcore.sm90.isa import Math
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig


def tile_lets(cfg: TileConfig, math: Math, prob: Problem) -> list[Let]:
    """Per tile (variable ``tile``): its N and M tile (nb, mb), split (kz), batch (bz), the first rows of
    A and B (ra0, rb0), its K blocks [kbeg, kend) and output slab z = kz * batch + bz."""
    tn, tm = cdiv(prob.n, cfg.bn), cdiv(prob.m, cfg.bm)
    nk = cfg.k_blocks(math, prob)
    per = cdiv(nk, cfg.ks)
    if cfg.cl > 1:  # a unit is cl neighbouring N tiles (a whole number of them: TileConfig.problems)
        tn = cdiv(tn, cfg.cl)
        out = [Let("nb", f"(tile % {tn} * {cfg.cl} + crank)"), Let("mb", f"(tile / {tn} % {tm})")]
    else:
        out = [Let("nb", f"(tile % {tn})"), Let("mb", f"(tile / {tn} % {tm})")]
    out.append(Let("kz", f"(tile / {tn * tm} % {cfg.ks})" if cfg.ks > 1 else "0"))
    out.append(Let("bz", f"(tile / {tn * tm * cfg.ks})" if prob.batch > 1 else "0"))
    out += [Let("ra0", f"(mb * {cfg.bm})"), Let("rb0", f"(nb * {cfg.bn})"),
            Let("kbeg", f"(kz * {per})"), Let("kend", f"min(kbeg + {per}, {nk})"),
            Let("zs", f"(kz * {prob.batch} + bz)")]
    return out


def job_heads(cfg: TileConfig, probs: list[Problem]) -> list[str]:
    """The persistent loops over a block's tiles, one per GEMM of a kernel running several in turn
    (one GEMM: ``for (tile = blockIdx.x; tile < tiles; tile += gridDim.x)``): their tiles numbered
    one after the other (job j's from offset o_j) and dealt round-robin over the blocks, so block b takes the tiles
    b, b + G, ... of the whole sequence (G = gridDim.x): its first tile of job j is the one with
    o_j + tile = b mod G. No block waits at a job's end while others still have tiles of it."""
    if cfg.cl > 1:
        if len(probs) > 1:
            raise ValueError("clusters run one GEMM a kernel")
        return [f"for (int tile = CLUSTER_ID(); tile < {cfg.work(probs[0])}; tile += NUM_CLUSTERS())"]
    heads, offset = [], 0
    for prob in probs:
        first = "GROUP_ID(0)"
        if offset:
            first = f"((GROUP_ID(0) + NUM_GROUPS(0) - {offset} % NUM_GROUPS(0)) % NUM_GROUPS(0))"
        heads.append(f"for (int tile = {first}; tile < {cfg.tiles(prob)}; tile += NUM_GROUPS(0))")
        offset += cfg.tiles(prob)
    return heads
