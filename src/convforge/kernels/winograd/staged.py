"""Block-staged output tiles: the output transform's stores through shared memory.

An output-transform thread owns one tile, so its own stores walk the image with a stride of m
floats between neighbouring threads: for m = 6 or 7, and for m = 2 or 4 when Q is not a multiple
of m (no vector row stores), a warp's store touches ~m times the sectors it needs. Staged, each
thread writes its tile to shared memory (rows at an odd stride: conflict free), then the block
stores all its tiles together, element l = lid + e * tb in (row i, tile, column j) order:
consecutive threads write consecutive columns of consecutive tiles, runs of an output row, which
coalesce. (The same staging of the input transform's loads is not offered: it was slower on every
layer measured, since those loads hit L1 and the extra shared-memory traffic costs.)
"""

from __future__ import annotations

import itertools

from convforge.codegen.meta import Code
from convforge.kernels.winograd.tiles import Geometry, emit_tile_origin
from convforge.plan import Epilogue

STATIC_SHARED_LIMIT = 48 * 1024


def odd_stride(n: int) -> int:
    """n, or n + 1 when n is even: a per-thread row stride that maps 32 threads to 32 banks."""
    return n | 1


def staged_bytes(g: Geometry, tb: int) -> int:
    """Shared memory of the staged output transform at block size tb."""
    return 4 * tb * (odd_stride(g.m * g.m) + 3)


def emit_staged_output(code: Code, g: Geometry, tb: int, total: int, epi: Epilogue, src: str,
                       k: str, t: str, ok: str) -> None:
    """Store the m x m outputs ``src{i}_{j}`` of tile ``t``, filter ``k`` (valid when ``ok``)
    through shared memory: every thread of the block must reach this point."""
    m, st = g.m, odd_stride(g.m * g.m)
    emit_staged_tiles(code, g, tb, epi)
    with code.block(f"if ({ok})"):
        emit_tile_info(code, g, epi, k, t, "lid")
        for i, j in itertools.product(range(m), range(m)):
            code(f"otile[lid * {st} + {i * m + j}] = {src}{i}_{j};")
    code("else olim[lid] = 0;", "BARRIER();")
    emit_staged_stores(code, g, tb, tb, epi)


def emit_staged_tiles(code: Code, g: Geometry, tiles: int, epi: Epilogue) -> None:
    """Declare the shared staging of ``tiles`` output tiles: values, offsets in y, limits."""
    m, st = g.m, odd_stride(g.m * g.m)
    code(f"SHARED float otile[{tiles * st}];  // the block's {tiles} output tiles, {m} x {m}, stride {st}",
         f"SHARED int obase[{tiles}], olim[{tiles}];  // offset in y; valid rows << 4 | valid columns")
    if epi.bias:
        code(f"SHARED int ok_[{tiles}];  // the filter of each tile (bias)")


def emit_tile_info(code: Code, g: Geometry, epi: Epilogue, k: str, t: str, slot: str) -> None:
    """Record tile ``t`` (filter ``k``) in staging slot ``slot``: where it goes, how much fits."""
    s, m = g.spec, g.m
    emit_tile_origin(code, g, t)
    code(f"obase[{slot}] = ((n * {s.k} + ({k})) * {s.p} + oy) * {s.q} + ox;",
         f"olim[{slot}] = ({s.p} - oy < {m} ? {s.p} - oy : {m}) << 4 | "
         f"({s.q} - ox < {m} ? {s.q} - ox : {m});")
    if epi.bias:
        code(f"ok_[{slot}] = {k};")


def emit_staged_stores(code: Code, g: Geometry, tiles: int, threads: int, epi: Epilogue) -> None:
    """All ``threads`` threads (index ``lid``) store the staged tiles, element l in (row i,
    tile, column j) order: consecutive threads write runs of output rows, which coalesce."""
    s, m, st = g.spec, g.m, odd_stride(g.m * g.m)
    count = tiles * m * m
    if threads >= tiles * m:  # a thread per (tile, column), looping over the rows: no index math per element
        code(f"// thread lid < {tiles * m}: tile lid / {m}, column lid % {m}; row i of every tile per step")
        with code.block(f"if (lid < {tiles * m})"):
            code(f"const int lt = lid / {m}, j = lid % {m}, lim = olim[lt], rows = lim >> 4;",
                 "GLOBAL_PTR float* yo = y + obase[lt] + j;")
            with code.block("if (j < (lim & 15))"):
                for i in range(m):
                    v = epi.apply(f"otile[lt * {st} + {i * m} + j]", "ok_[lt]", f"obase[lt] + j + {i * s.q}")
                    code(f"if ({i} < rows) yo[{i * s.q}] = {v};")
        return
    code(f"// element l = lid + e * {threads}: row i, tile lt, column j (j fastest) -> coalesced rows")
    for e in range(-(-count // threads)):
        val = epi.apply(f"otile[lt * {st} + i * {m} + j]", "ok_[lt]", f"obase[lt] + i * {s.q} + j")
        guard = f"l < {count} && " if (e + 1) * threads > count else ""
        code(f"{{ const int l = lid + {e * threads}, i = l / {tiles * m}, lt = (l % {tiles * m}) / {m}, "
             f"j = l % {m}, lim = {'l < ' + str(count) + ' ? ' if guard else ''}olim[lt]"
             f"{' : 0' if guard else ''};",
             f"  if (i < (lim >> 4) && j < (lim & 15)) y[obase[lt] + i * {s.q} + j] = {val}; }}")
