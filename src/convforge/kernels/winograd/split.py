"""Input and output transforms with one thread per row or column of a tile (params xi, xo).

The plain transform kernels give each tile to one thread: alpha^2 loads and both passes of the
2-D transform in registers. Deep layers at small batches have few tiles (ResNet 512@7² N32 under
F(7x7): C * T = 16384 input tiles, K * T = 16384 output tiles, 128 blocks of 128 threads on 132
SMs), so those kernels are latency-bound at a fraction of the memory bandwidth. Here a block
holds xt tiles (tuning parameter ``xt``, 32 by default) and alpha threads per tile (LOCAL_ID(0)
the tile, so each warp walks consecutive tiles and its loads and stores of U/V/M rows coalesce;
LOCAL_ID(1) the row or column): the first pass runs per row (input) or column (output) of the
tile, the halves meet in shared memory, the second pass runs per column (input) or output row.
Output tiles then leave through the staged stores of staged.py.

Block order (``lo``, :func:`split_grid`): tiles fastest by default; tile-major with ``lo=1``, so
that the GEMM, taking its blocks last tiles first, starts on the V still in L2, and the output
transform on the M the GEMM wrote last.
"""

from __future__ import annotations

from convforge.codegen.dialect import Buf, Dim3, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels.common import out_args, pro_args
from convforge.kernels.winograd.matrices import lincomb, paired_lincombs
from convforge.kernels.winograd.staged import emit_staged_stores, emit_staged_tiles, emit_tile_info, odd_stride
from convforge.kernels.winograd.tiles import Geometry, emit_tile_origin
from convforge.plan import Epilogue, Prologue

XT = 32  # tiles per block by default
XT_CHOICES = (16, 32, 64)


def input_block(g: Geometry, xt: int = XT) -> Dim3:
    return (xt, max(g.ah, g.aw), 1)


def output_block(g: Geometry, xt: int = XT) -> Dim3:
    return (xt, g.aw, 1)


def split_grid(count: int, xt: int = XT, rows: int = 0) -> Dim3:
    """Blocks for ``count`` (row, tile) pairs; ``rows`` > 0: tile-major order (lo=1), one block
    per (group of xt tiles, row) with the row (channel or filter) fastest."""
    return (cdiv(count // rows, xt) * rows if rows else cdiv(count, xt), 1, 1)


def _indices(code: Code, g: Geometry, xt: int, rows: int, row: str, tile_major: bool) -> str:
    """Define ``idx`` (row * T + t), ``t`` and ``{row}``; return the condition of a live tile.
    Default order: idx = block * xt + lt. Tile-major: the block's row fastest, so the kernel
    finishes the first tiles of every row before the next group (what it writes last, the
    next kernel of an lo=1 plan reads first)."""
    tt = g.tiles
    if tile_major:
        code(f"const int {row} = GROUP_ID(0) % {rows}, t = GROUP_ID(0) / {rows} * {xt} + lt;",
             f"const int idx = {row} * {tt} + t;")
        return f"t < {tt}"
    code(f"const int idx = GROUP_ID(0) * {xt} + lt, t = idx % {tt}, {row} = idx / {tt};")
    return f"idx < {rows * tt}"


def split_input_kernel(g: Geometry, comment: str, xt: int = XT, tile_major: bool = False,
                       pro: Prologue = Prologue()) -> Kernel:
    """V[e][c][t] = (B_h^T d B_w)[e]: thread (lt, a) loads window row a (in-bounds values activated
    by ``pro``) and applies B_w; thread (lt, j) then applies B_h^T down column j and stores the
    alpha_h values of that column."""
    s = g.spec
    total, ah, aw = s.c * g.tiles, g.ah, g.aw
    code = Code()
    code(f"SHARED float xin[{aw * ah * xt}];  // d B_w by rows: [j][a][tile]",
         "const int lt = LOCAL_ID(0), a = LOCAL_ID(1);")
    live = _indices(code, g, xt, s.c, "c", tile_major)
    emit_tile_origin(code, g, "t")
    with code.block(f"if (a < {ah})"):
        code(f"const bool row = {live} && (unsigned)(iy + a) < {s.h}u;",
             f"const GLOBAL_PTR float* xr = x + ((n * {s.c} + c) * {s.h} + iy + a) * {s.w} + ix;")
        for b in range(aw):
            code(f"const float d{b} = row && (unsigned)(ix + {b}) < {s.w}u ? {pro.apply(f'xr[{b}]', 'c')} : 0.0f;")
        for j in range(aw):
            code(f"xin[({j} * {ah} + a) * {xt} + lt] = "
                 f"{lincomb(g.tw.BT[j], [f'd{b}' for b in range(aw)])};")
    code("BARRIER();")
    with code.block(f"if (a < {aw} && {live})"):
        code("const int j = a;")
        for r in range(ah):
            code(f"const float r{r} = xin[(j * {ah} + {r}) * {xt} + lt];")
        for i in range(ah):
            code(f"v[({i * aw} + j) * {total} + idx] = {lincomb(g.th.BT[i], [f'r{r}' for r in range(ah)])};")
    return Kernel("wino_input_transform", (Buf("x"), Buf("v", readonly=False)) + pro_args(pro), code.text(),
                  input_block(g, xt), comment=comment)


def split_output_kernel(g: Geometry, epi: Epilogue, ks: int, comment: str, xt: int = XT,
                        tile_major: bool = False) -> Kernel:
    """y = A_h^T M A_w per (filter, tile): thread (lt, j) sums column j of M over the ks channel
    slices and applies A_h^T; thread (lt, o) applies A_w along output row o into the staging."""
    s, m = g.spec, g.m
    total, ah, aw, st = s.k * g.tiles, g.ah, g.aw, odd_stride(m * m)
    code = Code()
    code(f"SHARED float xout[{aw * m * xt}];  // A_h^T M by columns: [j][o][tile]")
    emit_staged_tiles(code, g, xt, epi)
    code(f"const int lt = LOCAL_ID(0), j = LOCAL_ID(1), lid = j * {xt} + lt;")
    live = _indices(code, g, xt, s.k, "k", tile_major)
    code(f"const int ri = {live} ? idx : {total - 1};  // tiles past the end read the last")
    for i in range(ah):
        terms = " + ".join(f"mw[{(z * g.a2 + i * aw) * total} + j * {total} + ri]" for z in range(ks))
        code(f"const float c{i} = {terms};")
    pre, rows = paired_lincombs(g.th.AT, [f"c{i}" for i in range(ah)], "p")
    code(*pre)
    for o in range(m):
        code(f"xout[(j * {m} + {o}) * {xt} + lt] = {rows[o]};")
    with code.block("if (j == 0)"):
        with code.block(f"if ({live})"):
            emit_tile_info(code, g, epi, "k", "t", "lt")
        code("else olim[lt] = 0;")
    code("BARRIER();")
    with code.block(f"if (j < {m})"):
        for jj in range(aw):
            code(f"const float r{jj} = xout[({jj} * {m} + j) * {xt} + lt];")
        pre, rows = paired_lincombs(g.tw.AT, [f"r{jj}" for jj in range(aw)], "q")
        code(*pre)
        for x in range(m):
            code(f"otile[lt * {st} + j * {m} + {x}] = {rows[x]};")
    code("BARRIER();")
    emit_staged_stores(code, g, xt, xt * aw, epi)
    return Kernel("wino_output_transform", (Buf("mw"),) + out_args(epi), code.text(),
                  output_block(g, xt), comment=comment)
