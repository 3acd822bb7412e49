"""The generator's epilogue: accumulators -> staged through shared memory -> NCHW-planar stores with
bias, residual, ReLU, channel offset and the storage dtype's rounding; split-K partials (raw FP32) and
their deterministic reduce.

Staging (per consumer warpgroup, 32 columns at a time, its own shared region so the producer keeps
loading the next tile meanwhile): accumulator (row, col) goes to ``st[col * LD + row]`` with
LD = 64 wm + 4. Writes: a warp's lanes (g, t) hit banks (8 t + g + const) % 32, all different
(LD % 32 == 4); reads: each thread takes 4 consecutive rows of one column as a float4 (LD * 4 bytes
is a multiple of 16), a quarter-warp 128 contiguous bytes. Stores: those 4 rows are 4 consecutive
pixels of one output channel, contiguous in an NCHW plane (one 16-byte store for FP32, 8 bytes for
halves) when P*Q is a multiple of 4; else 4 guarded scalar stores. A warp writes 2 (wm = 1) or 1
channel rows of 64 or 128 pixels: coalesced.

Batch-norm statistics (``Output.stats``, NHWC rows, unsplit, no bias / residual / activation): each consumer
warpgroup's tile of rows is one partial j = row0 / 64 wm of :data:`~convforge.kernels.batchnorm.PARTIAL_ROWS`
per column: the sums of y - k and (y - k)^2 over its rows of the stored (rounded) y, k its first row's value,
and the count, into ``bnpart`` [row][j][column] (4 x P x N floats, P = cdiv(M, 64 wm)). A thread keeps one
column quad of a chunk (quads = 8: 128 is a multiple of 8), the four lanes of a warp holding that quad add by
xor shuffles, the four warps through the staging buffer in warp order: a fixed order, bit-identical runs.

Planar layout: element (row m, column k) of slab z (split-K slice x batch) sits at
z * slab + (m / pq * k_total + k_offset + k) * pq + m % pq: NCHW outputs (pq = P*Q, m = n P Q + pix),
Winograd's M[z][e][k][t] (pq = T), split-K partials [z][n][k][pix].
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from convforge.codegen.dialect import Buf, Kernel, TensorMap
from convforge.codegen.meta import Code, cdiv
from convforge.kernels.tensorcore.sm90.cexpr import Let
from convforge.kernels.tensorcore.sm90.isa import ACC
from convforge.plan import Epilogue

COLS = 32  # columns staged at once
_ELT = 256  # threads of the reduce kernel's blocks


def staging_ld(wm: int) -> int:
    """Floats per staged column: the warpgroup's rows + 4 (conflict-free transposed writes)."""
    return 64 * wm + 4


def staging_bytes(wm: int, tma: bool = False) -> int:
    """A consumer's staging: 32 float columns of its rows, or with TMA stores (``es=1``) one half-staged
    chunk exactly (its rows of 128 bytes: whole 1024-byte swizzle atoms, as the copy engine reads them)."""
    return 2 * H8 * 64 * wm if tma else 4 * COLS * staging_ld(wm)


# -- storage dtypes on the device ---------------------------------------------------------------
CTYPE = {"float32": "float", "float16": "unsigned short", "bfloat16": "unsigned short"}


def to_float(dtype: str, expr: str) -> str:
    """A stored value of ``dtype`` as a float expression."""
    return {"float32": expr, "float16": f"TC_F16_TO_F32({expr})", "bfloat16": f"TC_BF16_TO_F32({expr})"}[dtype]


def from_float(dtype: str, expr: str) -> str:
    """A float rounded to ``dtype`` (nearest even), as its storage expression."""
    return {"float32": expr, "float16": f"TC_F32_TO_F16({expr})", "bfloat16": f"TC_F32_TO_BF16({expr})"}[dtype]


def _pack2(dtype: str, a: str, b: str) -> str:
    return f"TC_PACK_{'F16' if dtype == 'float16' else 'BF16'}X2({a}, {b})"


@dataclass(frozen=True)
class Output:
    """A planar destination of the GEMM's D (see the module docstring). ``epi`` None: raw FP32 partial
    sums (no bias, residual, ReLU, offset)."""

    buf: str
    m: int
    n: int
    pq: int
    dtype: str = "float32"
    k_total: int = 0
    k_offset: int = 0
    slab: int = 0  # elements between slabs (0: one slab)
    epi: Epilogue | None = field(default_factory=Epilogue)
    istride: int = 0  # elements between images (rows m / pq); 0: kt * pq, NCHW (wgrad's KCRS dW: R S)
    kstride: int = 0  # elements between columns; 0: pq, one image's planes adjacent (KCRS dW: C R S)
    # pixel j = m % pq of an image at pix_base + (j / pix_q) * pix_row + (j % pix_q) * pix_col (pix_q 0: at j);
    # strided dgrad's phases: the sub-grid of dx rows ph + sh i, columns pw + sw j
    pix_q: int = 0
    pix_row: int = 0
    pix_col: int = 1
    pix_base: int = 0
    # columns as pairs (k / kdiv, k % kdiv) where kdiv > 1: the first strided by kstride, the second by ksub (the
    # paired strided dgrad's NCHW dx: column c kdiv + pw is channel c of column phase pw, pw elements along a row)
    kdiv: int = 1
    ksub: int = 0
    bias_z: int = 0  # a batched GEMM's slab z reads the bias from z bias_z on (grouped: each group's K)
    stats: bool = False  # also the batch norm's per-channel partial sums into "bnpart" (module docstring)
    # column phases joined in registers (the strided dgrad's ``jn=1``): ``park``, this job's tile is held as
    # packed halves until the next job's epilogue; ``joined``, this job's tile and the parked one are the
    # paired layout's columns 2 c + 1 and 2 c (this Output describes both: n = 2 C, kdiv = 2)
    park: bool = False
    joined: bool = False

    def bias_col(self, k: str, z: str) -> str:
        """The bias index of column ``k`` of slab ``z``."""
        return f"{k} + ({z}) * {self.bias_z}" if self.bias_z else k

    @property
    def kt(self) -> int:
        return self.k_total or self.n

    @property
    def strided(self) -> bool:
        """Image and column strides of their own (not the NCHW planes of the default)."""
        return bool(self.istride or self.kstride or self.pix_q)

    def pixel(self, m: str) -> str:
        """Offset of row ``m``'s pixel in its image plane."""
        j = f"({m}) % {self.pq}"
        if not self.pix_q:
            return j
        base = f"{self.pix_base} + " if self.pix_base else ""
        return f"({base}{j} / {self.pix_q} * {self.pix_row} + {j} % {self.pix_q} * {self.pix_col})"

    @property
    def ist(self) -> int:
        return self.istride or self.kt * self.pq

    @property
    def kst(self) -> int:
        return self.kstride or self.pq

    def offset(self, m: str, k: str, z: str) -> str:
        """Element offset of (row m, column k) of slab z (a C expression, Python-evaluable)."""
        slab = f"({z}) * {self.slab} + " if self.slab else ""
        off = f" + {self.k_offset}" if self.k_offset else ""
        if self.strided:
            col = f"(({k}){off}) * {self.kst}" if self.kdiv == 1 else \
                f"(({k}){off}) / {self.kdiv} * {self.kst} + (({k}){off}) % {self.kdiv} * {self.ksub}"
            return f"({slab}({m}) / {self.pq} * {self.ist} + {col} + {self.pixel(m)})"
        return f"({slab}(({m}) / {self.pq} * {self.kt}{off} + ({k})) * {self.pq} + ({m}) % {self.pq})"

    def args(self) -> tuple[Buf, ...]:
        out: tuple[Buf, ...] = (Buf(self.buf, CTYPE[self.dtype], readonly=False),)
        if self.epi is not None and self.epi.bias:
            out += (Buf("bias", CTYPE[self.dtype]),)
        if self.epi is not None and self.epi.residual:
            out += (Buf("res", CTYPE[self.dtype]),)
        if self.stats:
            out += (Buf("bnpart", "float", readonly=False),)
        return out

    def stats_reason(self) -> str | None:
        """Why this destination cannot also write batch-norm statistics (None: it can)."""
        epi = self.epi or Epilogue()
        if not self.rowmajor or self.strided or self.slab or self.k_total or self.k_offset:
            return "batch-norm statistics need plain NHWC rows (one slab, no channel offset)"
        if epi != Epilogue():
            return f"batch-norm statistics take the conv's plain output (no bias, residual or activation: {epi.tag()})"
        return None

    def refs(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args())

    @property
    def vector(self) -> bool:
        """4 consecutive rows from a multiple of 4 are one aligned run (same plane, contiguous; with
        strides also where images follow each other, ist = pq)."""
        if not self.strided:
            return self.pq % 4 == 0
        if self.pix_q:
            return False
        runs = (self.pq % 4 == 0 and self.ist % 4 == 0) or self.ist == self.pq
        return runs and self.m % 4 == 0 and self.kst % 4 == 0 and self.slab % 4 == 0 \
            and self.k_offset * self.kst % 4 == 0

    def value(self, acc: str, k: str, off: str, bias: str | None = None, res: str | None = None) -> str:
        """The stored float of accumulator ``acc`` for column ``k`` at element ``off`` (``bias``, ``res``:
        float expressions already loaded, instead of reading ``bias[k]`` and ``res[off]``)."""
        if self.epi is None:
            return acc
        v = acc
        if self.epi.bias:
            v = f"{v} + {bias or to_float(self.dtype, f'bias[{k}]')}"
        if self.epi.residual:
            v = f"{v} + {res or to_float(self.dtype, f'res[{off}]')}"
        return f"fmaxf({v}, 0.0f)" if self.epi.relu else self.epi.activate(v)

    @property
    def rowmajor(self) -> bool:
        """A row's columns lie contiguous (an NHWC output, row m = pixel, column k = channel: pq = 1,
        or with strides of its own, such as strided dgrad's pixel map onto a channels-last dx); the
        epilogue then stages rows and stores runs of 4 columns."""
        return self.kst == 1 and (self.pq == 1 or self.strided)

    @property
    def vector_cols(self) -> bool:
        """4 consecutive columns from a multiple of 4 are one aligned run inside the columns written."""
        return self.kt % 4 == 0 and self.k_offset % 4 == 0 and self.n % 4 == 0 and (self.slab % 4 == 0)

    def store4_cols(self, code: Code, m: str, k: str, z: str, vals: list[str]) -> None:
        """Store ``vals`` at columns k .. k + 3 (k a multiple of 4) of row m of slab z (row-major)."""
        with code.block(f"if ({m} < {self.m})"):
            if self.vector_cols:
                code(f"const int oo = {self.offset(m, k, z)};")
                with code.block(f"if ({k} < {self.n})"):
                    f4 = self.dtype == "float32"  # bias and residual quads as float4 loads too
                    epi = self.epi or Epilogue()
                    if f4 and epi.bias:
                        code(f"const float4 bq = *(const float4*)(bias + {self.bias_col(k, z)});")
                    if f4 and epi.residual:
                        code("const float4 rq = *(const float4*)(res + oo);")
                    outs = [self.value(v, self.bias_col(f"{k} + {i}", z), f"oo + {i}",
                                       f"bq.{'xyzw'[i]}" if f4 else None, f"rq.{'xyzw'[i]}" if f4 else None)
                            for i, v in enumerate(vals)]
                    code(*self._vstore("oo", outs))
                return
            self._scalar(code, [(f"{k} + {i} < {self.n}", m, f"{k} + {i}") for i in range(4)], z, vals)

    def store4(self, code: Code, m: str, k: str, z: str, vals: list[str]) -> None:
        """Store ``vals`` at rows m .. m + 3 (m a multiple of 4) of column k (< n) of slab z."""
        if self.vector:
            code(f"const int oo = {self.offset(m, k, z)};")
            with code.block(f"if ({m} < {self.m})"):
                outs = [self.value(v, self.bias_col(k, z), f"oo + {i}") for i, v in enumerate(vals)]
                code(*self._vstore("oo", outs))
            return
        self._scalar(code, [(f"{m} + {i} < {self.m}", f"{m} + {i}", k) for i in range(4)], z, vals)

    def _scalar(self, code: Code, at: list[tuple[str, str, str]], z: str, vals: list[str]) -> None:
        """One guarded scalar store per value: ``at`` gives each its (guard, row, column)."""
        for i, ((guard, m, k), v) in enumerate(zip(at, vals)):
            with code.block(f"if ({guard})"):
                code(f"const int o{i} = {self.offset(m, k, z)};",
                     f"{self.buf}[o{i}] = {from_float(self.dtype, self.value(v, self.bias_col(k, z), f'o{i}'))};")

    @property
    def pairs(self) -> bool:
        """Half columns paired along a row (kdiv > 1, ksub 1: the paired strided dgrad's NCHW dx), no
        bias or residual: the epilogue stores each row's kdiv values, or 4 rows' runs, as vectors."""
        epi = self.epi or Epilogue()
        return self.kdiv > 1 and self.ksub == 1 and self.dtype != "float32" and self.strided \
            and not self.slab and not self.k_offset and not (epi.bias or epi.residual) and self.n % self.kdiv == 0

    def pair_units(self) -> tuple[bool, int]:
        """(4 rows from a multiple of 4 are one contiguous run of 4 kdiv elements, elements per vector
        store): the largest power of two (at most 8: 16 bytes) every offset's terms are multiples of."""
        g = self.kdiv
        run = self.pix_col == g and self.pix_q % 4 == 0 and self.pq % 4 == 0
        terms = [self.ist, self.kst, self.pix_row, self.pix_base, (4 if run else 1) * self.pix_col]
        unit = 8
        while unit > 1 and any(t % unit for t in terms):
            unit //= 2
        return run, min(unit, 4 * g if run else g)

    def store_pairs(self, code: Code, m: str, k: str, z: str, vals: list[list[str]]) -> None:
        """Store rows m .. m + 3 (m a multiple of 4) of columns k .. k + kdiv - 1 (k a multiple of kdiv):
        ``vals[i][j]`` is column k + i of row m + j; row m + j's kdiv values lie side by side."""
        g = self.kdiv
        run, unit = self.pair_units()
        outs = [[self.value(vals[i][j], k, "") for i in range(g)] for j in range(4)]
        if run:
            code(f"const int oo = {self.offset(m, k, z)};")
            with code.block(f"if ({m} < {self.m})"):
                flat = [v for row in outs for v in row]
                for u in range(0, 4 * g, unit):
                    code(self._vstore_n(f"oo + {u}", flat[u:u + unit]))
            return
        for j in range(4):
            with code.block(f"if ({m} + {j} < {self.m})"):
                code(f"const int o{j} = {self.offset(f'{m} + {j}', k, z)};")
                for u in range(0, g, unit):
                    code(self._vstore_n(f"o{j} + {u}", outs[j][u:u + unit]))

    def _vstore_n(self, off: str, vals: list[str]) -> str:
        """One store of 1, 2, 4 or 8 halves at element ``off`` (aligned to their bytes)."""
        if len(vals) == 1:
            return f"{self.buf}[{off}] = {from_float(self.dtype, vals[0])};"
        words = [_pack2(self.dtype, vals[i], vals[i + 1]) for i in range(0, len(vals), 2)]
        kind = {1: "unsigned", 2: "uint2", 4: "uint4"}[len(words)]
        val = words[0] if len(words) == 1 else f"make_{kind}({', '.join(words)})"
        return f"*({kind}*)({self.buf} + {off}) = {val};"

    def _vstore(self, off: str, vals: list[str]) -> list[str]:
        if self.dtype == "float32":
            return [f"*(float4*)({self.buf} + {off}) = make_float4({', '.join(vals)});"]
        lo, hi = _pack2(self.dtype, vals[0], vals[1]), _pack2(self.dtype, vals[2], vals[3])
        return [f"*(uint2*)({self.buf} + {off}) = make_uint2({lo}, {hi});"]


# -- the consumer's epilogue ---------------------------------------------------------------------
def acc_name(mi: int, i: int, prefix: str = "d") -> str:
    """Accumulator register ``i`` of m64 block ``mi`` of a consumer thread (``prefix`` f: the promoted
    FP32 sums of 3xTF32)."""
    return f"{prefix}{mi}_{i}"


def stage_write(ld: int, mi: int, i: int, ch: int, prefix: str = "d",
                rowmajor: bool = False) -> tuple[str, str] | None:
    """(staging float offset, accumulator) of register ``i`` of block ``mi`` if its n8 chunk lies in
    column chunk ``ch``, else None (C expressions of wq, g, t: warp in warpgroup, lane / 4, lane % 4).
    ``rowmajor``: the staging holds rows of COLS floats, each row's 4-column quads permuted by
    :func:`swizzled` (float4 read-outs along a row, few bank conflicts on the writes)."""
    if 8 * (i // ACC.per_chunk) // COLS != ch:
        return None
    row = f"({64 * mi} + {ACC.row_expr(i)})"
    if rowmajor:
        return swizzled(row, f"({ACC.col_expr(i)} - {COLS * ch})"), acc_name(mi, i, prefix)
    return f"(({ACC.col_expr(i)} - {COLS * ch}) * {ld} + {row})", acc_name(mi, i, prefix)


def swizzled(row: str, col: str) -> str:
    """Row-major staging slot of (row, column in chunk): COLS floats a row, the column's quad XORed
    with the row's low 3 bits, so the 8 rows a warp's lanes stage at once spread over the banks."""
    return f"(({row}) * {COLS} + (({col}) ^ ((({row}) & 7) << 2)))"


def rowmajor_lets(wm: int, item: int, quads: int) -> list[Let]:
    """Item ``item`` of consumer thread ``ct`` in a row-major chunk of ``quads`` column quads: its quad
    ``eq`` and row ``er`` (8 consecutive threads read one row's 32 floats: 128 contiguous bytes)."""
    e = f"(ct + {128 * item})"
    return [Let(f"eq{item}", f"({e} % {quads})"), Let(f"er{item}", f"({e} / {quads})")]


def rowmajor_chunks(wm: int, bn: int) -> list[tuple[int, list[int], int]]:
    """The row-major epilogue's loop: per 32-column chunk, a thread's items (1 row x 4 columns) and
    the chunk's column quads."""
    out = []
    for ch in range(cdiv(bn, COLS)):
        quads = min(COLS, bn - COLS * ch) // 4
        out.append((ch, list(range(cdiv(64 * wm * quads, 128))), quads))
    return out


def readout_lets(wm: int, item: int) -> list[Let]:
    """Item ``item`` of a consumer thread ``ct`` in one chunk: its column in the chunk ``ec`` and
    the first of its 4 rows in the warpgroup's tile ``er``."""
    quads = 16 * wm
    e = f"(ct + {128 * item})"
    return [Let(f"ec{item}", f"({e} / {quads})"), Let(f"er{item}", f"(({e} % {quads}) * 4)")]


def chunks(wm: int, bn: int) -> list[tuple[int, list[int]]]:
    """The epilogue's loop: per 32-column chunk, the items (4 rows x 1 column each) of a thread."""
    return [(ch, list(range(min(COLS, bn - COLS * ch) * 16 * wm // 128))) for ch in range(cdiv(bn, COLS))]


def emit_consumer_epilogue(code: Code, out: Output, wm: int, bn: int, stage: str, bar: str,
                           row0: str, col0: str, z: str, prefix: str = "d", half: bool = False,
                           tma: str = "", res_staged: bool = False) -> None:
    """The tile's accumulators (``prefix``) to ``out`` through the staging buffer at float pointer
    ``stage``; ``bar``: this warpgroup's named barrier; ``row0``: the warpgroup's first row in the
    problem, ``col0`` the tile's first column, ``z`` the slab. ``half`` (the tile's ``eh``): stage
    rounded halves and store 16 bytes a thread where the output allows (:func:`h8_reason`); ``tma``
    (``es=1``): the staging's shared address, each chunk stored by a TMA copy (:func:`es_reason`);
    ``res_staged`` (``rs=1``): the residual comes into the chunk by 16-byte loads first (:func:`rs_reason`)."""
    if res_staged and rs_reason(out, bn, wm):
        raise ValueError(f"epilogue: rs=1: {rs_reason(out, bn, wm)}")
    if tma:
        why = es_reason(out, bn, wm)
        if why:
            raise ValueError(f"epilogue: es=1: {why}")
        _h8_epilogue(code, out, wm, bn, stage, bar, row0, col0, z, prefix, tma, res_staged)
        return
    if res_staged or (half and h8_reason(out, bn, wm) is None):
        _h8_epilogue(code, out, wm, bn, stage, bar, row0, col0, z, prefix, res_staged=res_staged)
        return
    if out.rowmajor:
        _rowmajor_epilogue(code, out, wm, bn, stage, bar, row0, col0, z, prefix)
        return
    ld, paired = staging_ld(wm), out.pairs and COLS % out.kdiv == 0
    for ch, items in chunks(wm, bn):
        if paired:
            items = pair_items(wm, bn, ch, out.kdiv)
        code(f"BAR_SYNC({bar}, 128);  // the last chunk's reads are done")
        for mi in range(wm):
            for i in range(bn // 2):
                w = stage_write(ld, mi, i, ch, prefix)
                if w is not None:
                    code(f"{stage}[{w[0]}] = {w[1]};")
        code(f"BAR_SYNC({bar}, 128);")
        if paired:
            _pair_items(code, out, wm, bn, stage, row0, col0, z, ch, items)
            continue
        for item in items:
            with code.block(f"/* chunk {ch}, item {item} */"):
                for let in readout_lets(wm, item):
                    let.emit(code)
                code(f"const float4 v = *(const float4*)({stage} + ec{item} * {ld} + er{item});",
                     f"const int k = {col0} + {COLS * ch} + ec{item}, m = {row0} + er{item};")
                with code.block(f"if (k < {out.n})"):
                    out.store4(code, "m", "k", z, ["v.x", "v.y", "v.z", "v.w"])


def park_names(wm: int, bn: int) -> list[str]:
    """The registers a parked tile takes: accumulators (i, i + 1) of block mi packed as two halves."""
    return [f"pk{mi}_{i // 2}" for mi in range(wm) for i in range(0, bn // 2, 2)]


def emit_park(code: Code, dtype: str, wm: int, bn: int, prefix: str = "d") -> None:
    """Hold this tile for the next job's :func:`emit_joined_epilogue`: each pair of accumulators of
    one row (columns 2 t, 2 t + 1 of an n8 block) rounded to ``dtype`` and packed in one register."""
    for mi in range(wm):
        for i in range(0, bn // 2, 2):
            code(f"pk{mi}_{i // 2} = {_pack2(dtype, acc_name(mi, i, prefix), acc_name(mi, i + 1, prefix))};")


def joined_write(ld: int, mi: int, i: int, ch: int, phase: int) -> str | None:
    """Staging float offset of accumulator ``i`` of block ``mi`` of column phase ``phase`` in chunk
    ``ch`` of the joined tile (32 paired columns: 16 channels, each channel c's phases at columns
    2 c and 2 c + 1), or None where its channel lies in another chunk."""
    if 8 * (i // ACC.per_chunk) // (COLS // 2) != ch:
        return None
    col = f"(2 * ({ACC.col_expr(i)} - {COLS // 2 * ch}) + {phase})"
    return f"({col} * {ld} + {64 * mi} + {ACC.row_expr(i)})"


def emit_joined_epilogue(code: Code, out: Output, wm: int, bn: int, stage: str, bar: str,
                         row0: str, col0: str, z: str, prefix: str = "d") -> None:
    """The parked tile (column phase 0) and this tile (phase 1) staged side by side in the paired
    layout and stored as each row's pairs (``out``: the paired Output of both, n = 2 C; ``col0``
    the tile's first channel). No accumulator is rounded twice: the parked halves are exact."""
    ld, wide = staging_ld(wm), 2 * bn
    for ch, _ in chunks(wm, wide):
        code(f"BAR_SYNC({bar}, 128);  // the last chunk's reads are done")
        for mi in range(wm):
            for i in range(bn // 2):
                w0, w1 = joined_write(ld, mi, i, ch, 0), joined_write(ld, mi, i, ch, 1)
                if w0 is None or w1 is None:
                    continue
                word = f"pk{mi}_{i // 2}"
                half = f"(unsigned short)({word} & 0xffffu)" if i % 2 == 0 else f"(unsigned short)({word} >> 16)"
                code(f"{stage}[{w0}] = {to_float(out.dtype, half)};", f"{stage}[{w1}] = {acc_name(mi, i, prefix)};")
        code(f"BAR_SYNC({bar}, 128);")
        _pair_items(code, out, wm, wide, stage, row0, f"2 * {col0}", z, ch, pair_items(wm, wide, ch, 2))


def pair_items(wm: int, bn: int, ch: int, g: int) -> list[int]:
    """A thread's items (4 rows x g columns) in chunk ``ch`` of a paired output (:meth:`Output.pairs`)."""
    return list(range(cdiv(min(COLS, bn - COLS * ch) // g * 16 * wm, 128)))


def _pair_items(code: Code, out: Output, wm: int, bn: int, stage: str, row0: str, col0: str, z: str,
                ch: int, items: list[int]) -> None:
    """A paired output's read-out: each item's g staged columns (one dx channel's column phases) for 4
    rows, stored as the rows' runs of g (or 4 g) elements (:meth:`Output.store_pairs`)."""
    g, ld, quads = out.kdiv, staging_ld(wm), 16 * wm
    total = min(COLS, bn - COLS * ch) // g * quads
    for item in items:
        with code.block(f"/* chunk {ch}, item {item}: {g} columns x 4 rows */"):
            e = f"(ct + {128 * item})"
            code(f"const int eg{item} = {e} / {quads}, er{item} = {e} % {quads} * 4;")
            guard = f"{e} < {total} && " if (item + 1) * 128 > total else ""
            code(f"const int k = {col0} + {COLS * ch} + eg{item} * {g}, m = {row0} + er{item};")
            with code.block(f"if ({guard}k < {out.n})"):
                for i in range(g):
                    code(f"const float4 v{i} = *(const float4*)({stage} + (eg{item} * {g} + {i}) * {ld} + er{item});")
                out.store_pairs(code, "m", "k", z, [[f"v{i}.{c}" for c in "xyzw"] for i in range(g)])


def partials(m: int, wm: int) -> int:
    """Batch-norm partial sums per column of an M-row GEMM whose consumer warpgroups take 64 wm rows."""
    return cdiv(m, 64 * wm)


def _rowmajor_epilogue(code: Code, out: Output, wm: int, bn: int, stage: str, bar: str,
                       row0: str, col0: str, z: str, prefix: str) -> None:
    """emit_consumer_epilogue for a row-major ``out`` (NHWC): rows staged, float4 runs of columns stored."""
    if out.stats and (out.stats_reason() or bn % COLS):
        raise ValueError(f"epilogue: {out.stats_reason() or f'statistics need whole {COLS}-column chunks ({bn})'}")
    for ch, items, quads in rowmajor_chunks(wm, bn):
        code(f"BAR_SYNC({bar}, 128);  // the last chunk's reads are done")
        for mi in range(wm):
            for i in range(bn // 2):
                w = stage_write(0, mi, i, ch, prefix, rowmajor=True)
                if w is not None:
                    code(f"{stage}[{w[0]}] = {w[1]};")
        code(f"BAR_SYNC({bar}, 128);")
        if not out.stats:
            _rowmajor_items(code, out, wm, stage, row0, col0, z, ch, items, quads)
            continue
        with code.block(f"/* chunk {ch}: stores and batch-norm statistics */"):
            stats_head(code, out, stage)
            _rowmajor_items(code, out, wm, stage, row0, col0, z, ch, items, quads)
            _stats_store(code, out, wm, stage, bar, row0, f"{col0} + {COLS * ch}")


def _rowmajor_items(code: Code, out: Output, wm: int, stage: str, row0: str, col0: str, z: str, ch: int,
                    items: list[int], quads: int) -> None:
    """A staged chunk's stores, item by item (1 row x 4 columns each); with ``out.stats`` each row into the
    thread's sums."""
    for item in items:
        with code.block(f"/* chunk {ch}, item {item} */"):
            for let in rowmajor_lets(wm, item, quads):
                let.emit(code)
            guard = 64 * wm * quads
            with code.block(f"if (ct + {128 * item} < {guard})" if (item + 1) * 128 > guard else ""):
                code(f"const float4 v = *(const float4*)({stage} + {swizzled(f'er{item}', f'4 * eq{item}')});",
                     f"const int k = {col0} + {COLS * ch} + 4 * eq{item}, m = {row0} + er{item};")
                out.store4_cols(code, "m", "k", z, ["v.x", "v.y", "v.z", "v.w"])
                if out.stats:
                    _stats_add(code, out)


# -- row-major halves staged as halves: 64 columns a chunk, 16-byte stores ------------------------
H8 = 64  # columns of a half-staged chunk: one 128-byte row of halves


H8_RES_ACC = 64  # accumulators a thread above which a residual stays on the float path (ptxas spilled at 128)
RS_REGS = 96  # rs=1: accumulators plus the residual's prefetched registers a thread (64 + 32 on the tile of two
# consumers sharing 128 x 128)


def rs_reason(out: Output, bn: int, wm: int) -> str | None:
    """Why ``out``'s residual cannot be staged into the half-staged chunk (``rs=1``; None: it can): it needs a
    residual and the half-staged epilogue, at any accumulator count (the pairs read the residual from shared
    memory, no global loads beside the accumulators)."""
    if out.epi is None or not out.epi.residual:
        return "rs=1 stages a residual: the output has none"
    if wm * bn // 2 + rs_registers(wm, bn) > RS_REGS:
        return (f"rs=1 holds the tile's residual in {rs_registers(wm, bn)} registers a thread through the main loop: "
                f"beside {wm * bn // 2} accumulators more than {RS_REGS}")
    return h8_reason(out, bn, wm, res_staged=True)


def rs_registers(wm: int, bn: int) -> int:
    """32-bit registers a consumer thread holds the tile's residual in (``rs=1``): 16 bytes an item of each
    64-column chunk."""
    return 4 * h8_items(wm) * (bn // H8)


def h8_reason(out: Output, bn: int, wm: int = 1, res_staged: bool = False) -> str | None:
    """Why ``out`` cannot take the half-staged epilogue (None: it can). It stages each accumulator pair
    rounded to the storage dtype, so only what is applied before that rounding can be fused: a
    bias, a residual (both read a column pair at a time, per accumulator pair; a residual only beside at
    most :data:`H8_RES_ACC` accumulators a thread) and an activation: the same operations in the same order
    as the float path, so the same stored values."""
    if not out.rowmajor or out.dtype == "float32" or out.slab or out.park or out.joined or out.kdiv > 1:
        return "half staging takes one slab of 16-bit row-major (NHWC) output"
    if bn % H8:
        return f"half staging takes whole {H8}-column chunks ({bn})"
    if out.epi is not None and out.epi.residual and not res_staged and wm * bn // 2 > H8_RES_ACC:
        return (f"a residual's loads beside {wm * bn // 2} accumulators a thread spill: it stays on the float path "
                "(which reads it after staging)")
    if out.n % 8 or out.kt % 8 or out.k_offset % 8:
        return "16-byte stores need columns in whole runs of 8"
    if out.strided and (not out.pix_q or any(v % 8 for v in (out.ist, out.pix_row, out.pix_col, out.pix_base))):
        return "16-byte stores need every pixel's row at a multiple of 8 elements"
    return None


def es_reason(out: Output, bn: int, wm: int) -> str | None:
    """Why the half-staged chunks of ``out`` cannot leave by TMA stores (None: they can): the output must be
    one plain matrix of M rows by its own n columns (a box past the last column is then dropped by the copy
    engine, never written into a neighbouring concat's channels)."""
    why = h8_reason(out, bn, wm)
    if why:
        return why
    if out.strided or out.k_offset or out.kt != out.n or out.pq != 1:
        return "TMA stores take a plain M x n row-major output (no pixel map, channel offset or wider rows)"
    return None


def store_map(out: Output, wm: int) -> TensorMap:
    """The tiled tensor map the TMA stores of ``out`` go through: n x M elements (innermost first), boxes of
    one chunk (64 columns x the consumer's 64 wm rows) in the 128-byte swizzle the staging is laid out in."""
    es = 2
    return TensorMap(f"{out.buf}_smap", "tiled", out.dtype, (out.n, out.m), (out.n * es,), (H8, 64 * wm),
                     source=out.buf, swizzle=128)


def h8_slot(mi: int, i: int) -> tuple[str, int] | None:
    """(32-bit word of the half staging, chunk) of the accumulator pair (i, i + 1) of block ``mi``, or None
    for the pair's second register. Rows of 32 words (64 halves); a row's 16-byte octets permuted by
    XOR with the row's low 3 bits (g): a warp's 32 word writes land on 32 banks."""
    if i % 2:
        return None
    assert ACC.cols[i % ACC.per_chunk] == 0 and ACC.cols[(i + 1) % ACC.per_chunk] == 1
    j = i // ACC.per_chunk  # the n8 block
    row = f"({64 * mi} + {ACC.row_expr(i)})"
    return f"({row} * 32 + (({j % 8} ^ g) << 2) + t)", 8 * j // H8


def h8_lets(item: int) -> list[Let]:
    """Item ``item`` of consumer thread ``ct`` in a half-staged chunk: its row ``er`` and octet ``eo``
    (8 consecutive threads read one row's 128 contiguous bytes)."""
    return [Let(f"er{item}", f"((ct + {128 * item}) >> 3)"), Let(f"eo{item}", "(ct & 7)")]


def h8_items(wm: int) -> int:
    """Read-out items of a thread in one chunk: 64 wm rows x 8 octets over 128 threads."""
    return 4 * wm


def _unpack(dtype: str, word: str, hi: bool) -> str:
    half = f"(unsigned short)({word} >> 16)" if hi else f"(unsigned short)({word} & 0xffffu)"
    return to_float(dtype, half)


def _h8_epilogue(code: Code, out: Output, wm: int, bn: int, stage: str, bar: str,
                 row0: str, col0: str, z: str, prefix: str, tma: str = "", res_staged: bool = False) -> None:
    """emit_consumer_epilogue staging rounded halves: per 64-column chunk, each pair of a row's accumulators
    packed into one word, then every thread stores 8 columns of a row as one 16-byte store, or (``tma``, the
    staging's shared address) thread 0 hands the chunk to the copy engine. With ``out.stats`` the same
    sums as the float path in the same order (:func:`_stats_store` with 8 lanes). A residual is read per
    pair from global memory, or (``res_staged``) staged first by :func:`_h8_stage_residual` and read back
    from the pair's own word, which then takes the packed result."""
    if out.stats and out.stats_reason():
        raise ValueError(f"epilogue: {out.stats_reason()}")
    epi = out.epi or Epilogue()
    words = f"((unsigned*){stage})"
    staged = res_staged and epi.residual
    for ch in range(bn // H8):
        if tma:  # the staging is free once the copy engine has read the last chunk out of it
            with code.block("if (ct == 0)"):
                code("TMA_STORE_WAIT_READ(0);")
        code(f"BAR_SYNC({bar}, 128);  // the last chunk's reads are done")
        if staged:
            _h8_stage_residual(code, wm, words, ch)
            code(f"BAR_SYNC({bar}, 128);  // the residual staged")
        with code.block(f"/* chunk {ch}: staged as halves */"):
            if epi.bias or (epi.residual and not staged):
                _h8_columns(code, out, ch, col0, z)
            for mi, rows in itertools.product(range(wm), range(0, ACC.per_chunk, 2)):  # a row of pairs at a time
                if epi.residual and not staged:
                    _h8_residual_row(code, out, f"{row0} + {64 * mi} + {ACC.row_expr(rows)}",
                                     f"{col0} + {H8 * ch} + 2 * t", z, f"{mi}_{rows}")
                for i in range(rows, bn // 2, ACC.per_chunk):
                    w = h8_slot(mi, i)
                    if w is None or w[1] != ch:
                        continue
                    j = i // ACC.per_chunk % 8
                    a, b = (out.value(acc_name(mi, r, prefix), "", "", _unpack(out.dtype, f"hb{j}", h == 1)
                                      if epi.bias else None,
                                      _unpack(out.dtype, "hr", h == 1) if epi.residual else None)
                            for h, r in enumerate((i, i + 1)))
                    with code.block("" if not epi.residual else f"/* block {mi}, pair {i} */"):
                        if staged:  # its word holds the pair's residual, then the pair
                            code(f"const unsigned hr = {words}[{w[0]}];")
                        elif epi.residual:
                            hp = f"hp{mi}_{rows}"
                            code(f"const unsigned hr = hin{mi}_{rows} && hk{j} < {out.n} ? ((unsigned){hp}[{8 * j}]"
                                 f" | ((unsigned){hp}[{8 * j + 1}] << 16)) : 0u;")
                        code(f"{words}[{w[0]}] = {_pack2(out.dtype, a, b)};")
                if epi.residual and not staged:  # the next row's residual loads not hoisted above these (registers)
                    code("COMPILER_FENCE();")
        if tma:
            code("FENCE_PROXY_ASYNC();  // the staged words visible to the copy engine")
        code(f"BAR_SYNC({bar}, 128);")
        if tma:
            with code.block("if (ct == 0)"):
                code(f"TMA_STORE_2D({store_map(out, wm).name}, {tma}, {col0} + {H8 * ch}, {row0});",
                     "TMA_STORE_COMMIT();")
            if not out.stats:
                continue
        stats = " and batch-norm statistics" if out.stats else ""
        what = "batch-norm statistics" if tma else f"16-byte stores{stats}"
        with code.block(f"/* chunk {ch}: {what} */"):
            if out.stats:
                _h8_stats_head(code, out, words)
            for item in range(h8_items(wm)):
                with code.block(f"/* item {item} */"):
                    for let in h8_lets(item):
                        let.emit(code)
                    slot = f"er{item} * 32 + ((eo{item} ^ (er{item} & 7)) << 2)"
                    code(f"const uint4 v = *(const uint4*)({words} + {slot});",
                         f"const int k = {col0} + {H8 * ch} + 8 * eo{item}, m = {row0} + er{item};")
                    if not tma:
                        with code.block(f"if (m < {out.m} && k < {out.n})"):
                            code(f"*(uint4*)({out.buf} + {out.offset('m', 'k', z)}) = v;")
                    if out.stats:
                        _stats_add(code, out, half=True)
            if out.stats:
                _stats_store(code, out, wm, stage, bar, row0, f"{col0} + {H8 * ch}", 8, tma)


def residual_prefetch(code: Code, out: Output, wm: int, bn: int, row0: str, col0: str, z: str) -> None:
    """``rs=1``, at the tile's start (before its main loop): this thread's items of every 64-column chunk of the
    tile's residual into registers ``rv{chunk}_{item}``, as the store phase reads the staging (h8_lets: 8 threads
    a row, 16 contiguous bytes each), so the loads' latency passes under the operands' and the epilogue only
    writes them into the staging (:func:`_h8_stage_residual`). One 16-byte load an item where the residual's
    address is 16-byte aligned (its offsets are whole octets: :func:`h8_reason`), else eight 2-byte loads;
    zeros past M rows and n columns. The residual read after the accumulators (one latency a chunk, 8 warps
    a block) made ResNet-50's conv1 dgrads 3.6-3.9x slower (twenty-fourth session, H200)."""
    why = rs_reason(out, bn, wm)
    if why:  # before any code names ``res``: a parked or joined job never reaches emit_consumer_epilogue's check
        raise ValueError(f"epilogue: rs=1: {why}")
    for ch in range(bn // H8):
        for item in range(h8_items(wm)):
            code(f"uint4 rv{ch}_{item} = make_uint4(0u, 0u, 0u, 0u);")
            with code.block(f"/* the residual: chunk {ch}, item {item} */"):
                for let in h8_lets(item):
                    let.emit(code)
                code(f"const int k = {col0} + {H8 * ch} + 8 * eo{item}, m = {row0} + er{item};")
                with code.block(f"if (m < {out.m} && k < {out.n})"):
                    code(f"const unsigned short* const rp = res + {out.offset('m', 'k', z)};")
                    with code.block("if (((size_t)rp & 15) == 0)"):
                        code(f"rv{ch}_{item} = *(const uint4*)rp;")
                    with code.block("else"):
                        pairs = [f"((unsigned)rp[{2 * q}] | ((unsigned)rp[{2 * q + 1}] << 16))" for q in range(4)]
                        code(f"rv{ch}_{item} = make_uint4({', '.join(pairs)});")


def _h8_stage_residual(code: Code, wm: int, words: str, ch: int) -> None:
    """``rs=1``: chunk ``ch`` of the residual, prefetched into registers (:func:`residual_prefetch`), into the
    staging words, so word :func:`h8_slot` of a pair holds that pair's residual."""
    with code.block(f"/* the residual's chunk {ch}, from registers, staged as the store phase reads */"):
        for item in range(h8_items(wm)):
            with code.block(f"/* item {item} */"):
                for let in h8_lets(item):
                    let.emit(code)
                code(f"*(uint4*)({words} + er{item} * 32 + ((eo{item} ^ (er{item} & 7)) << 2)) = rv{ch}_{item};")


def _h8_columns(code: Code, out: Output, ch: int, col0: str, z: str) -> None:
    """This thread's first column ``hk{j}`` of each n8 block j of chunk ``ch`` (columns 8 j + 2 t and + 1)
    and, with a bias, the pair's bias ``hb{j}``, zero past the last column (runs of 8: a pair is in or out
    together)."""
    for j in range(8):
        code(f"const int hk{j} = {col0} + {H8 * ch + 8 * j} + 2 * t;")
        if out.epi is not None and out.epi.bias:  # the pair as two halves in one register, widened at use
            lo, hi = (f"(unsigned)bias[{out.bias_col(f'hk{j} + {h}', z)}]" for h in (0, 1))
            code(f"const unsigned hb{j} = hk{j} < {out.n} ? ({lo} | ({hi} << 16)) : 0u;")


def _h8_residual_row(code: Code, out: Output, m: str, k: str, z: str, tag: str) -> None:
    """Row ``m``'s residual from this thread's first column ``k`` on (``hp{tag}``; row-major: the pair of
    n8 block j at 8 j, 8 j + 1) and whether the row is in the output (``hin{tag}``). Each pair is read as
    two 2-byte loads into one register (``hr``): no alignment assumed of the residual beyond its dtype's."""
    code(f"const int hm{tag} = {m};", f"const bool hin{tag} = hm{tag} < {out.m};",
         f"const unsigned short* const hp{tag} = res + {out.offset(f'hm{tag}', k, z)};")


def _h8_stats_head(code: Code, out: Output, words: str) -> None:
    """As :func:`stats_head` for 8 columns a thread: octet ``sq``, shifts bk0..7 (row 0's staged values)."""
    code("const int sq = ct & 7;  // this thread's column octet in the chunk (every item's)",
         f"const uint4 bkw = *(const uint4*)({words} + (sq << 2));")
    for i in range(8):
        code(f"const float bk{i} = {_unpack(out.dtype, 'bkw.' + 'xyzw'[i // 2], i % 2 == 1)};")
    code("float " + ", ".join(f"bs1_{i} = 0.0f, bs2_{i} = 0.0f" for i in range(8)) + ";")


def _rounded(out: Output, v: str) -> str:
    """The float value stored for accumulator expression ``v`` (its storage rounding undone)."""
    return v if out.dtype == "float32" else to_float(out.dtype, from_float(out.dtype, v))


def stats_head(code: Code, out: Output, stage: str) -> None:
    """A chunk's statistics registers: this thread's column quad ``sq`` (= ct % 8), the shifts bk0..3 (the
    stored values of the warpgroup's first row, staged), the sums bs1_*, bs2_*."""
    code("const int sq = ct & 7;  // this thread's column quad in the chunk (every item's)",
         f"const float4 bk = *(const float4*)({stage} + {swizzled('0', '4 * sq')});")
    for i, c in enumerate("xyzw"):
        code(f"const float bk{i} = {_rounded(out, f'bk.{c}')};")
    code("float " + ", ".join(f"bs1_{i} = 0.0f, bs2_{i} = 0.0f" for i in range(4)) + ";")


def _stats_add(code: Code, out: Output, half: bool = False) -> None:
    """One item's row into the sums (rows past M add nothing): 4 staged floats, or (``half``) 8 staged halves."""
    with code.block(f"if (m < {out.m})"):
        values = [_unpack(out.dtype, "v." + "xyzw"[i // 2], i % 2 == 1) for i in range(8)] if half else \
            [_rounded(out, f"v.{c}") for c in "xyzw"]
        for i, value in enumerate(values):
            code(f"const float d{i} = {value} - bk{i};", f"bs1_{i} += d{i};", f"bs2_{i} = FMA(d{i}, d{i}, bs2_{i});")


def _stats_store(code: Code, out: Output, wm: int, stage: str, bar: str, row0: str, col: str, lanes: int = 4,
                 tma: str = "") -> None:
    """The chunk's sums (``lanes`` columns a thread: 4 staged floats, 8 staged halves): the lanes of a column
    group by xor shuffles, the warps in order through the staging buffer, then threads 0..8 lanes - 1 (one
    column each) write partial ``row0 / 64 wm``'s four rows (``tma``: the copy engine's read of the chunk
    waited for before the sums overwrite the staging)."""
    p, two = partials(out.m, wm), 2 * lanes
    sums = [f"bs{r}_{i}" for r in (1, 2) for i in range(lanes)]
    for lane in (8, 16):
        code(*(f"{s} += SHFL({s}, (tid & 31) ^ {lane});" for s in sums))
    if tma:
        with code.block("if (ct == 0)"):
            code("TMA_STORE_WAIT_READ(0);")
    code(f"BAR_SYNC({bar}, 128);  // every read of the staged chunk done")
    with code.block("if ((ct & 31) < 8)"):
        code(*(f"{stage}[(wq * 8 + sq) * {two} + {j}] = {s};" for j, s in enumerate(sums)))
    with code.block("if (ct < 8)"):
        code(*(f"{stage}[{64 * lanes} + sq * {lanes} + {i}] = bk{i};" for i in range(lanes)))
    code(f"BAR_SYNC({bar}, 128);")
    with code.block(f"if (ct < {8 * lanes} && {row0} < {out.m})"):
        code(f"const int q = ct >> {lanes.bit_length() - 1}, i = ct & {lanes - 1};",
             f"const int kk = {col} + ct, pj = ({row0}) / {64 * wm}, nrows = min({out.m} - ({row0}), {64 * wm});")
        with code.block(f"if (kk < {out.n})"):
            code(f"float a1 = {stage}[q * {two} + i], a2 = {stage}[q * {two} + {lanes} + i];")
            for w in range(1, 4):
                code(f"a1 += {stage}[({w * 8} + q) * {two} + i];",
                     f"a2 += {stage}[({w * 8} + q) * {two} + {lanes} + i];")
            at = f"pj * {out.n} + kk"
            code(f"bnpart[{at}] = a1;", f"bnpart[{p * out.n} + {at}] = a2;",
                 f"bnpart[{2 * p * out.n} + {at}] = {stage}[{64 * lanes} + ct];",
                 f"bnpart[{3 * p * out.n} + {at}] = (float)nrows;")


def reduce_kernel(name: str, out: Output, ks: int, total: int, batch: int = 1) -> tuple[Kernel, tuple[int, int, int]]:
    """Sum ``ks`` raw FP32 partial slabs (``part``, planar with the conv's own channels) in slice order
    (deterministic), then bias, residual, ReLU, channel offset and dtype into ``out``. A batched GEMM's
    (``batch`` > 1) slabs hold its batches one after another, batch bz's m n partials from bz m n on,
    and batch bz lands in ``out``'s slab bz (``total``: every batch's elements)."""
    if batch > 1:
        return _batched_reduce(name, out, ks, total, batch)
    src = Output("part", out.m, out.n, out.pq, slab=total, epi=None)
    code = Code()
    code(f"const int e = GROUP_ID(0) * {_ELT} + LOCAL_ID(0);")
    with code.block(f"if (e < {total})"):
        code(f"const int m = e / {out.pq * out.n} * {out.pq} + e % {out.pq}, k = e / {out.pq} % {out.n};",
             "float s = part[e];")
        for z in range(1, ks):
            code(f"s += part[{src.offset('m', 'k', str(z))}];")
        code(f"const int o = {out.offset('m', 'k', '0')};",
             f"{out.buf}[o] = {from_float(out.dtype, out.value('s', 'k', 'o'))};")
    kern = Kernel(name, (Buf("part"),) + out.args(), code.text(), (_ELT, 1, 1), frozenset({"wgmma"}),
                  comment=f"sum of {ks} split-K partials, then the epilogue")
    return kern, (cdiv(total, _ELT), 1, 1)


def reduce_lines(out: Output, ks: int, total: int, batch: int) -> list[str]:
    """The batched reduce's body for element ``e`` < ``total`` (kept apart so tests evaluate the very
    strings): its batch bz, its (m, k) within the batch, the slices summed in order, the store."""
    per = out.m * out.n
    lines = [f"const int bz = e / {per}, el = e - bz * {per};",
             f"const int m = el / {out.pq * out.n} * {out.pq} + el % {out.pq}, k = el / {out.pq} % {out.n};",
             "float s = part[e];"]
    lines += [f"s += part[e + {z * total}];" for z in range(1, ks)]
    lines += [f"const int o = {out.offset('m', 'k', 'bz')};",
              f"{out.buf}[o] = {from_float(out.dtype, out.value('s', out.bias_col('k', 'bz'), 'o'))};"]
    return lines


def _batched_reduce(name: str, out: Output, ks: int, total: int, batch: int) -> tuple[Kernel, tuple[int, int, int]]:
    """reduce_kernel of a batched GEMM (a grouped convolution's groups)."""
    code = Code()
    code(f"const int e = GROUP_ID(0) * {_ELT} + LOCAL_ID(0);")
    with code.block(f"if (e < {total})"):
        code(*reduce_lines(out, ks, total, batch))
    kern = Kernel(name, (Buf("part"),) + out.args(), code.text(), (_ELT, 1, 1), frozenset({"wgmma"}),
                  comment=f"sum of {ks} split-K partials of {batch} batches, then the epilogue")
    return kern, (cdiv(total, _ELT), 1, 1)

