"""A Hopper ``wgmma`` TF32 GEMM for 1x1 convolutions (CUDA, compute capability 9.0, sm_90a).

sm_90a, but outside the generator of this package (:mod:`convforge.kernels.tensorcore.sm90`): its own
cp.async pipeline and copies, and an unswizzled layout (``sw=0``) the generator lacks; the 128-byte
swizzle's descriptor and hardware model (``smem``), the accumulator layout (``isa.ACC``) and the TF32
error figures are the generator's.

The plan has three steps:

1. (weights only, kept per weight version) ``wt[k][c] = tf32(w[k][c])``, C padded with zeros to
   ``cp`` (a multiple of 32): A = W is already K-major (C contiguous).
2. ``xt[n*P*Q + pix][c] = tf32(x[n][c][input pixel of pix])`` (0 for padding and c >= C): B must
   be K-major for .tf32 wgmma (no transposed form), x is not, so a tiled transpose through shared
   memory writes it; stride and padding of the 1x1 filter are resolved here.
3. The GEMM: warpgroup ``i`` of a block of ``wg`` warpgroups (128 threads each) computes rows
   ``m0 + 64 i ..`` x ``bn`` columns of C = wt . xt^T with one ``wgmma.mma_async m64n{bn}k8``
   per k step of 8 (4 per slice of 32), both operands from shared memory through 64-bit matrix
   descriptors. Slices go global -> shared by cp.async (16 bytes) into ``st`` stages; per slice
   one barrier, one wgmma group in flight. C is written NCHW through the Store callback
   (bias, ReLU, channel offset).

``xl=direct`` (stride 1, no padding: B column j is pixel j % HW of image j // HW) drops step 2:
the GEMM loads x itself, 16-byte loads along H*W (4 scalar ones when H*W % 4 != 0), 4 pixels x
4 channels per thread "unit", one slice ahead in registers (loaded while wgmma runs on the slice
before), TF32-rounded (cvt.rna) and stored transposed into the same swizzled B tile; A stays on
cp.async; the loop's barrier and ``fence.proxy.async`` cover both. ``ep=smem`` stages C through
shared memory and writes coalesced float4 runs of NCHW rows (``ep=regs``: from the accumulators,
scalar stores 8 bytes apart). Bank models: see the comment above :func:`direct_coords` and
:func:`_store_staged`.

Shared layouts (``sw``): each operand tile is ``rows x 32`` floats (128 bytes per row), rows
clamped to the matrix (extra rows compute unused results). ``sw=128``: the 128-byte swizzle,
row r at r*128 bytes, its 16-byte chunk c at position c ^ (r % 8) (stage tiles 1024-byte
aligned); ``sw=0``: no swizzle, "core matrices" of 8 rows x 16 bytes stored contiguously, the
chunks of a row 128 bytes apart (LBO) and groups of 8 rows 1024 bytes apart (SBO).

Facts from the PTX ISA (wgmma, sm_90a), encoded once below and checked in a pure-Python model
(tests/test_wgmma.py): the descriptor holds the start address >> 4 (bits 0-13), the leading
dimension byte offset >> 4 (16-29: K-adjacent core matrices), the stride dimension byte offset
>> 4 (32-45: M/N-adjacent core matrices), base offset (49-51, 0 here) and the swizzle mode
(62-63: 0 none, 1 128B, 2 64B, 3 32B); a swizzle permutes 16-byte chunks by address bits
[4:6] ^= [7:9]; the m64nNk8 accumulators of warp w of the warpgroup are rows 16w..16w+15 and,
per n8 chunk j, registers 4j..4j+3 in the mma.m16n8 C layout.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from convforge.codegen.dialect import Buf, Dim3, Kernel, LocalBuf
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs
from convforge.kernels.gemm import elementwise, nchw_store, too_big
from convforge.kernels.sgemm import Store
from convforge.kernels.tensorcore.sm90 import smem
from convforge.kernels.tensorcore.sm90.isa import ACC as ACC_LAYOUT
from convforge.kernels.tensorcore.sm90.isa import KSTEP_BYTES, ROW_BYTES, TF32, device_reason, few_pixels
from convforge.kernels.tensorcore.sm90.smem import ALIGN, MAX_SHARED
from convforge.kernels.tensorcore.sm90.variants import TF32_EXPECTED, TF32_TOLERANCE
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

# The 128-byte row (isa.ROW_BYTES), the 8-row group stride (smem.SBO, both layouts here), the shared
# memory limit and the TF32 error figures are the generator's.
BK = TF32.elems(1)  # floats of K per slice: one 128-byte row per operand row
KSTEP = TF32.k  # k of one wgmma (tf32)
LBO = {0: smem.CORE_LBO, 128: smem.LBO}  # bytes between K-adjacent core matrices (unused by the swizzled mode)
WG_KEYS = ("bn", "wg", "st", "sw", "xl", "ep")
XL = ("direct", "transposed")  # how x reaches the B tiles (see the module docstring)
EP = ("smem", "regs")  # how C leaves: staged through shared memory, or from the accumulators
C_PAD = 8  # floats past each row of the staged C tile (see _store_staged)



def _plus(base: str, k: int) -> str:
    return f"{base} + {k}" if k else base


# Accumulator m64nNk8 .f32 (isa.ACC): (row, column) of register 4j + r of a lane, per n8 chunk j, as C
# expressions of g = lane >> 2 and t = lane & 3 (row offset 16 w for warp w of the warpgroup).
ACC = tuple((_plus("g", r), _plus("2 * t", c)) for r, c in zip(ACC_LAYOUT.rows, ACC_LAYOUT.cols, strict=True))


def chunk_offset(sw: int, r: str, c: str) -> str:
    """Byte offset in an operand tile of 16-byte chunk ``c`` (0..7) of row ``r`` (C expressions). The
    swizzle is smem.swizzled's; the expression is not smem.Tile.chunk_offset's, which adds the column
    block of wider K (one block here, always 0) and would change the generated source."""
    if sw == 128:
        return f"(({r}) * {ROW_BYTES} + ((({c}) ^ (({r}) & 7)) << 4))"
    return smem.interleaved_offset(r, c)


def copy_coords(sw: int, q: str) -> tuple[str, str]:
    """(row, chunk) of the ``q``-th 16-byte copy of a tile: eight consecutive copies fill 128
    contiguous shared bytes (one conflict-free quarter-warp store) in either layout."""
    if sw == 128:
        return f"(({q}) >> 3)", f"(({q}) & 7)"
    return f"((({q}) & 7) + ((({q}) >> 6) << 3))", f"((({q}) >> 3) & 7)"


def desc_high(sw: int) -> int:
    """Descriptor bits above the start address: the 128-byte swizzle's or the interleaved layout's
    (both smem's)."""
    return smem.desc_high(ROW_BYTES) if sw == 128 else smem.desc_high_interleaved()


def k_step_bytes(sw: int, kk: int) -> int:
    """Start-address advance of k step ``kk`` (0..3) inside a slice: chunk 2 kk of row 0, at its
    unswizzled position (the hardware applies the swizzle to the whole address)."""
    return kk * KSTEP_BYTES if sw == 128 else 2 * kk * LBO[0]


def model_address(desc: int, r: int, k: int) -> int:
    """Shared byte address the hardware reads for element (row r, k) (k < 8) of a K-major
    operand described by ``desc``: smem's models of the documented layouts, independent of the above."""
    mode = desc >> 62
    if mode != 0:
        assert mode == smem.MODE_128B, "only the 128-byte swizzle is modelled"
        return smem.model_address(desc, r, 4 * k)
    return smem.model_address_interleaved(desc, r, k)


def acc_coords(w: int, lane: int, i: int) -> tuple[int, int]:
    """(row, column) in the warpgroup's 64 x N tile of accumulator ``i`` of warp ``w``, lane: the
    :data:`ACC` expressions the stores emit, evaluated (tests hold them against the PTX ISA)."""
    env = {"g": lane >> 2, "t": lane & 3}
    row, col = ACC[i % 4]
    return 16 * w + eval(row, {}, env), 8 * (i // 4) + eval(col, {}, env)  # noqa: S307


# -- parameters ---------------------------------------------------------------------------------
def stage_bytes(p: Params) -> int:
    return (64 * p.wg + p.bn) * ROW_BYTES


def shared_bytes(p: Params) -> int:
    """Launch-sized shared memory: the stages plus 1 KB to align them to 1024 bytes."""
    return p.st * stage_bytes(p) + ALIGN


def x_layout(p: Params) -> str:
    """``xl`` of a point; points stored before it existed read the transposed copy."""
    return str(p.get("xl", "transposed"))


def epilogue_path(p: Params) -> str:
    """``ep`` of a point; points stored before it existed store from the accumulators."""
    return str(p.get("ep", "regs"))


def staged_c_bytes(p: Params) -> int:
    """The C tile staged in shared memory (over the stages, free by then): bm x (bn + 8)."""
    return 4 * 64 * p.wg * (p.bn + C_PAD)


def wg_ok(p: Params, shared_limit: int = MAX_SHARED) -> bool:
    """Valid: bn 64..256 in steps of 32 (copies spread evenly), 1 or 2 warpgroups, 3..6 stages,
    swizzle 0 or 128, within ``shared_limit`` and 128 accumulators per thread; the direct x
    path needs the 128-byte swizzle and whole warp units per thread (bn a multiple of 64 wg)."""
    xl = x_layout(p)
    direct_ok = xl == "transposed" or (p.sw == 128 and p.bn % (64 * p.wg) == 0)
    return (p.bn % 32 == 0 and 64 <= p.bn <= 256 and p.wg in (1, 2) and 3 <= p.st <= 6
            and p.sw in (0, 128) and shared_bytes(p) <= shared_limit and 8 * p.bn % (128 * p.wg) == 0
            and xl in XL and direct_ok and epilogue_path(p) in EP and staged_c_bytes(p) <= p.st * stage_bytes(p))


def wg_space(m: int, n: int, shared_limit: int, direct: bool = False, units: int = 0) -> list[Params]:
    """Default first, then every valid point that does not overshoot M or N by 2x, the direct x
    path first where it applies (``direct``: stride 1, no padding). Only the swizzled layout:
    the core-matrix one (sw=0, correct too) takes several times the GEMM time: its wgmma operand
    reads conflict."""
    out = [wg_default(m, n, shared_limit, direct, units)]
    for ep, xl, bn, wg, st in itertools.product(EP, XL if direct else XL[1:], (128, 256, 64, 192, 96, 160),
                                                (1, 2), (4, 3, 5, 6)):
        if ep == "regs" and st != 4:
            continue  # the accumulator stores at 4 stages only: the staged epilogue should win
        p = Params(bn=bn, wg=wg, st=st, sw=128, xl=xl, ep=ep)
        if wg_ok(p, shared_limit) and 64 * wg <= 2 * max(m, 64) and bn <= 2 * max(n, 64) and p not in out:
            out.append(p)
    return out


def wg_default(m: int, n: int, shared_limit: int = MAX_SHARED, direct: bool = False, units: int = 0) -> Params:
    """64 x 128 per warpgroup (cuBLAS's choice for ResNet 1x1 layers), two warpgroups when M
    fills them and their blocks give at least a quarter of the ``units`` SMs one each (fewer,
    larger blocks leave SMs idle on small layers), 4 stages, the
    swizzled layout; x read directly where ``direct`` allows it."""
    bn = 128 if n > 64 else 64
    wide = m >= 128 and 4 * cdiv(n, bn) * cdiv(m, 128) > units
    p = Params(bn=bn, wg=2 if wide else 1, st=4, sw=128, xl="direct" if direct else "transposed", ep="smem")
    if not wg_ok(p, shared_limit):
        p = p.replace(wg=1) if wg_ok(p.replace(wg=1), shared_limit) else p
    return p if wg_ok(p, shared_limit) else p.replace(st=3)


# -- kernels ------------------------------------------------------------------------------------
def padded_c(spec: ConvSpec) -> int:
    return cdiv(spec.c, BK) * BK


def padded_rows(rows: int, tile: int) -> int:
    """Rows of an operand workspace: whole tiles of the block (the copies read every row of a
    tile, unclamped; rows past the matrix hold garbage that only unused results see)."""
    return cdiv(rows, tile) * tile


def round_weights_kernel(spec: ConvSpec, name: str) -> tuple[Kernel, Dim3]:
    """wt (K x cp) = tf32(w), zero past C: depends on the filters only (a weight step)."""
    cp = padded_c(spec)
    body = [f"const int k = e / {cp}, c = e - k * {cp};",
            f"wt[e] = c < {spec.c} ? CVT_TF32(w[k * {spec.c} + c]) : 0.0f;"]
    kern, grid = elementwise(name, spec.k * cp, (Buf("w"), Buf("wt", readonly=False)), body,
                             f"TF32-rounded K-major weights {spec.k} x {cp}")
    return Kernel(kern.name, kern.args, kern.body, kern.block, frozenset({"mma_tf32"}),
                  comment=kern.comment), grid


def transpose_kernel(spec: ConvSpec, name: str) -> tuple[Kernel, Dim3]:
    """xt (N*P*Q x cp) = tf32(x) at each output pixel's input pixel: 32 x 32 tiles through
    shared memory, reads along pixels and writes along channels both coalesced."""
    cp, pq, hw = padded_c(spec), spec.p * spec.q, spec.h * spec.w
    (sh, sw_), pt, pl = spec.stride, spec.pad[0], spec.pad[2]
    code = Code()
    code("SHARED float tile[32][33];",
         "const int tx = LOCAL_ID(0), ty = LOCAL_ID(1), nb = GROUP_ID(2);",
         "const int p0 = GROUP_ID(0) * 32, c0 = GROUP_ID(1) * 32;")
    with code.block("for (int j = 0; j < 32; j += 8)"):
        code("const int c = c0 + ty + j, pix = p0 + tx;", "float v = 0.0f;")
        if spec.stride == (1, 1) and spec.pad == (0, 0, 0, 0):
            code(f"if (c < {spec.c} && pix < {pq}) v = CVT_TF32(x[(nb * {spec.c} + c) * {hw} + pix]);")
        else:
            code(f"const int iy = (pix / {spec.q}) * {sh} - {pt}, ix = (pix % {spec.q}) * {sw_} - {pl};")
            with code.block(f"if (c < {spec.c} && pix < {pq} && (unsigned)iy < {spec.h}u && "
                            f"(unsigned)ix < {spec.w}u)"):
                code(f"v = CVT_TF32(x[(nb * {spec.c} + c) * {hw} + iy * {spec.w} + ix]);")
        code("tile[ty + j][tx] = v;")
    code("BARRIER();")
    with code.block("for (int j = 0; j < 32; j += 8)"):
        code("const int pix = p0 + ty + j;")
        with code.block(f"if (pix < {pq})"):
            code(f"xt[(nb * {pq} + pix) * {cp} + c0 + tx] = tile[tx][ty + j];")
    kern = Kernel(name, (Buf("x"), Buf("xt", readonly=False)), code.text(), (32, 8, 1),
                  frozenset({"mma_tf32"}), comment=f"TF32-rounded K-major activations {spec.n * pq} x {cp}")
    return kern, (cdiv(pq, 32), cp // 32, spec.n)


@dataclass(frozen=True)
class XDirect:
    """x read straight from NCHW by the GEMM (stride 1, no padding): ``c`` channels, ``hw``
    pixels per image, ``npix`` = N * H * W columns."""

    c: int
    hw: int
    npix: int


def gemm_kernel(name: str, m: int, n: int, cp: int, p: Params, c: Store,
                args: tuple[Buf, ...], xd: XDirect | None = None) -> Kernel:
    """C (m x n) = wt (m x cp) . xt (n x cp)^T with wgmma (see the module docstring); with ``xd``
    the B tiles come from x itself through registers (:func:`_direct_plan`)."""
    if not wg_ok(p) or (xd is None) != (x_layout(p) == "transposed"):
        raise ValueError(f"wgmma GEMM parameters {p.short()} are invalid (bn 64..256 step 32, wg 1 or 2, "
                         f"st 3..6, sw 0 or 128, {MAX_SHARED} B shared memory; xl=direct needs sw=128, "
                         f"bn a multiple of 64 wg, stride 1 and no padding)")
    bm, threads, nacc, sb = 64 * p.wg, 128 * p.wg, p.bn // 2, stage_bytes(p)
    code = Code()
    code("const int tid = LOCAL_ID(0), lane = tid & 31, warp = tid >> 5;",
         "const int wgi = warp >> 2, wq = warp & 3, g = lane >> 2, t = lane & 3;",
         f"const int m0 = GROUP_ID(1) * {bm}, n0 = GROUP_ID(0) * {p.bn};",
         "const unsigned sbase = (SMEM_U32(wg_smem) + 1023u) & ~1023u;  // stages 1024-byte aligned")
    copies = _copy_plan(code, "a", "wt", bm, threads, p.sw, cp, "m0", 0)
    direct = _direct_plan(code, xd, p, bm) if xd else None
    if direct is None:
        copies += _copy_plan(code, "b", "xt", p.bn, threads, p.sw, cp, "n0", bm * ROW_BYTES)
    hi = desc_high(p.sw)
    code(f"const U64 da0 = {hi}ull | (U64)((sbase + wgi * {64 * ROW_BYTES}u) >> 4);",
         f"const U64 db0 = {hi}ull | (U64)((sbase + {bm * ROW_BYTES}u) >> 4);")
    acc = [f"d{i}" for i in range(nacc)]
    code(f"float {', '.join(a + ' = 0.0f' for a in acc)};")
    nk = cp // BK
    for s in range(p.st - 2):  # prologue: st - 2 slices in flight
        if s < nk:
            _issue(code, copies, f"{s * sb}u", s * BK)
        code("CP_ASYNC_COMMIT();")
    if direct:  # slice 0 stored, slice 1 in registers
        direct.load(code, "0")
        direct.store(code, "0")
        if nk > 1:
            direct.load(code, "1")
    code("#pragma unroll 1  // a rolled loop: 4 wgmma per slice are plenty, and NVRTC stays quick")
    with code.block(f"for (int kt = 0; kt < {nk}; ++kt)"):
        code(f"CP_ASYNC_WAIT({p.st - 3});  // slice kt landed (this thread's copies)",
             "FENCE_PROXY_ASYNC();  // ... and is visible to wgmma's operand reads",
             "BARRIER();  // every thread's copies; every warpgroup past wgmma group kt - 2")
        with code.block(f"if (kt + {p.st - 2} < {nk})"):
            _issue(code, copies, f"((kt + {p.st - 2}) % {p.st}) * {sb}u", f"(kt + {p.st - 2}) * {BK}")
        code("CP_ASYNC_COMMIT();",
             f"const U64 so = (U64)((kt % {p.st}) * {sb // 16});",
             "WGMMA_FENCE();")
        for kk in range(BK // KSTEP):
            off = k_step_bytes(p.sw, kk) >> 4
            code(f"WGMMA_TF32({p.bn}, da0 + so + {off}, db0 + so + {off}, {', '.join(acc)});")
        code("WGMMA_COMMIT();")
        if direct:  # while wgmma runs on slice kt: store slice kt + 1, load kt + 2
            with code.block(f"if (kt + 1 < {nk})"):
                direct.store(code, f"((kt + 1) % {p.st})")
                with code.block(f"if (kt + 2 < {nk})"):
                    direct.load(code, "(kt + 2)")
        code(f"WGMMA_WAIT(1, {', '.join(acc)});")
    code(f"WGMMA_WAIT(0, {', '.join(acc)});")
    if epilogue_path(p) == "smem":
        _store_staged(code, m, n, p, c)
    else:
        _store(code, m, n, p.bn, c)
    how = "x direct" if direct else "x transposed"
    return Kernel(name, args + (LocalBuf("wg_smem", shared_bytes(p)),), code.text(), (threads, 1, 1),
                  requires=frozenset({"wgmma", "mma_tf32"} if direct else {"wgmma"}), min_blocks=1,
                  comment=f"wgmma TF32 GEMM {m}x{n}x{cp}, {how}: {p.short()}")


# -- the direct x path --------------------------------------------------------------------------
# Bank model: shared memory has 32 banks of 4 bytes; a warp's 16-byte stores (st.shared.v4) are
# served 8 lanes at a time, conflict-free when those 8 lanes cover the 128 bytes of a bank row
# once, i.e. their 16-byte chunk positions (address bits 4-6) differ. A thread's "unit" is 4
# pixels x 4 channels (one float4 along HW per channel: 16-byte loads); lane = 8 qw + 2 cl + pb
# takes pixel quad 8 pbk + 2 qw + pb and channel quad 4 hi + cl (pbk, hi from the warp and the
# unit). So per load instruction a warp reads 4 channels x 32 consecutive pixels (4 whole
# 128-byte lines), and per store (pixel i of the quads) the 8 lanes of a quarter write rows with
# r % 8 = 4 pb + i and chunks 4 hi + cl: swizzled positions (4 (hi ^ pb)) + (cl ^ i), all 8
# different. tests/test_wgmma.py checks both on the generated expressions.
def direct_coords(nwarps: int, it: int, w: str = "warp", lane: str = "lane") -> tuple[str, str]:
    """(B-tile row of the unit's first pixel, chunk = channel quad) of unit ``it`` of a thread,
    as C expressions; the unit's pixel i is row + i."""
    row = f"((((({w}) >> 1) + {it * nwarps // 2}) << 5) + ((({lane}) >> 3) << 3) + ((({lane}) & 1) << 2))"
    return row, f"(((({w}) & 1) << 2) + ((({lane}) >> 1) & 3))"


def x_column(xd: XDirect, col: str, vec: bool) -> str:
    """Offset in x of channel 0 at B column ``col`` (C expression): pixel col % (H W) of image
    col / (H W). Columns past the matrix are clamped to the last valid pixel (or float4, when
    ``vec``): the loads stay inside x, and those columns' results are never stored."""
    j = f"min({col}, {xd.npix - (4 if vec else 1)})"
    return f"(({j}) / {xd.hw} * {xd.c * xd.hw} + ({j}) % {xd.hw})"


def direct_units(p: Params) -> int:
    """Units (4 pixels x 4 channels) per thread and slice: bn * 32 / 16 over 128 wg threads."""
    return p.bn // (64 * p.wg)


@dataclass(frozen=True)
class _Direct:
    """Emits the register-staged B path: ``load`` slice s of x into registers, ``store`` them
    TF32-rounded into the swizzled B tile of a stage."""

    xd: XDirect
    units: int
    vec: bool  # H * W a multiple of 4: one float4 per channel; else 4 scalar loads
    stage_floats: int

    def load(self, code: Code, s: str) -> None:
        c, hw = self.xd.c, self.xd.hw
        for u, j in itertools.product(range(self.units), range(4)):
            ch = f"{s} * {BK} + xc + {j}"
            if self.vec:
                val = f"VLOAD4(0, xp{u} + ({s} * {BK} + {j}) * {hw})"
            else:
                val = "MAKE_FLOAT4({})".format(", ".join(f"x[xo{u}_{i} + ({s} * {BK} + {j}) * {hw}]"
                                                         for i in range(4)))
            if c % BK:
                val = f"({ch} < {c}) ? {val} : MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f)"
            code(f"xr{u}_{j} = {val};")

    def store(self, code: Code, stage: str) -> None:
        code(f"float* const bst = bsm + {stage} * {self.stage_floats};")
        for u, i in itertools.product(range(self.units), range(4)):
            vals = ", ".join(f"CVT_TF32(xr{u}_{j}.{'xyzw'[i]})" for j in range(4))
            code(f"VSTORE4(MAKE_FLOAT4({vals}), 0, bst + bo{u}_{i});")


def _direct_plan(code: Code, xd: XDirect, p: Params, bm: int) -> _Direct:
    """Per-thread setup of the direct path: each unit's pixel offsets into x (columns past
    the matrix clamped to the last valid ones: finite values, results never stored), its
    channel quad, its shared float offsets per pixel; the staging registers."""
    nwarps, units = 4 * p.wg, direct_units(p)
    vec = xd.hw % 4 == 0
    _, cq = direct_coords(nwarps, 0)
    code("float* const bsm = wg_smem + ((sbase - SMEM_U32(wg_smem)) >> 2) + " f"{bm * ROW_BYTES // 4};",
         f"const int xc = {cq} * 4;")
    for u in range(units):
        row, _ = direct_coords(nwarps, u)
        for i in range(1 if vec else 4):
            off = f"{x_column(xd, f'n0 + {row} + {i}', vec)} + xc * {xd.hw}"
            code(f"const float* const xp{u} = x + {off};" if vec else f"const int xo{u}_{i} = {off};")
        for i in range(4):
            code(f"const int bo{u}_{i} = {chunk_offset(128, f'{row} + {i}', cq)} >> 2;")
    code(f"float4 {', '.join(f'xr{u}_{j}' for u in range(units) for j in range(4))};")
    return _Direct(xd, units, vec, stage_bytes(p) // 4)


def _copy_plan(code: Code, nm: str, src: str, rows: int, threads: int, sw: int, cp: int,
               origin: str, base: int) -> list[tuple[str, str]]:
    """Per-thread copies of one operand tile, as (global pointer, shared byte offset) at slice 0:
    copy ``it`` of a thread is row ``row0 + it * threads / 8`` of the same chunk in either layout
    (tests check it), so one pointer and one offset serve all, with constant steps. Rows past
    the matrix read the workspace's padding rows (their results are never stored)."""
    r, ch = copy_coords(sw, "tid")
    code(f"const float* {nm}g = {src} + ({origin} + {r}) * {cp} + {ch} * 4;",
         f"const unsigned {nm}s = sbase + {base}u + {chunk_offset(sw, r, ch)};")
    step = threads // 8
    return [(f"{nm}g + {it * step * cp}", f"{nm}s + {it * step * ROW_BYTES}u")
            for it in range(rows * 8 // threads)]


def _issue(code: Code, copies: list[tuple[str, str]], stage: str, k0: str | int) -> None:
    for g, s in copies:
        code(f"CP_ASYNC16({s} + {stage}, {g} + {k0});")


def _store(code: Code, m: int, n: int, bn: int, c: Store) -> None:
    """Accumulators to C through the Store callback (rows and columns from :data:`ACC`), one n8
    chunk at a time so each chunk's column setups are short-lived."""
    rows = {row: f"rw{i}" for i, row in enumerate(dict.fromkeys(r for r, _ in ACC))}
    code(*(f"const int {v} = m0 + wgi * 64 + wq * 16 + {row};" for row, v in rows.items()))
    cols = {col: f"cc{i}" for i, col in enumerate(dict.fromkeys(cl for _, cl in ACC))}
    for j in range(bn // 8):
        with code.block(f"/* columns {8 * j}.. */"):
            for col, v in cols.items():
                code(f"const int {v}_i = n0 + {8 * j} + {col};", *c.setup(f"{v}_i", v))
            for r, (row, col) in enumerate(ACC):
                with code.block(f"if ({rows[row]} < {m} && {cols[col]}_i < {n})"):
                    code(*c.put(rows[row], cols[col], f"d{4 * j + r}"))


def staged_offset(ld: int, j: int, h: int) -> str:
    """Float offset in the staged C tile (row stride ``ld``) of accumulators 4 j + 2 h and
    4 j + 2 h + 1 of a thread (row g + 8 h of its warp's 16, columns 8 j + 2 t, + 1: :data:`ACC`)."""
    return f"((wgi * 64 + wq * 16 + g + {8 * h}) * {ld} + {8 * j} + 2 * t)"


def _store_staged(code: Code, m: int, n: int, p: Params, c: Store) -> None:
    """C through shared memory (the stages are free once every warpgroup's wgmma is done):
    accumulators as float2 into a bm x (bn + 8) tile (half-warp rows g..g+3 start 8 banks
    apart: conflict-free), then each thread writes float4 runs of a row, a warp 32 consecutive
    columns of one output channel (coalesced NCHW), through the Store callback (vput where
    H*W % 4 == 0, else four guarded scalar puts)."""
    bm, ld, threads = 64 * p.wg, p.bn + C_PAD, 128 * p.wg
    code("CP_ASYNC_WAIT(0);  // (the last groups are empty; cheap insurance before reusing the stages)",
         "BARRIER();  // all warpgroups' wgmma operand reads are done: the stages become the C tile",
         "float* const ct = wg_smem + ((sbase - SMEM_U32(wg_smem)) >> 2);")
    for j, h in itertools.product(range(p.bn // 8), range(2)):
        code(f"*(float2*)(ct + {staged_offset(ld, j, h)}) = make_float2(d{4 * j + 2 * h}, d{4 * j + 2 * h + 1});")
    code("BARRIER();", "#pragma unroll 4")
    with code.block(f"for (int e = tid; e < {bm * p.bn // 4}; e += {threads})"):
        code(f"const int r = e / {p.bn // 4}, q = e - r * {p.bn // 4};",
             "const int row = m0 + r, ce_i = n0 + 4 * q;",
             f"const float4 v = *(const float4*)(ct + r * {ld} + 4 * q);")
        if c.vput is not None:
            with code.block(f"if (row < {m} && ce_i < {n})"):
                code(*c.setup("ce_i", "ce"), *c.vput("row", "ce", ["v.x", "v.y", "v.z", "v.w"]))
        else:
            for u in range(4):
                with code.block(f"if (row < {m} && ce_i + {u} < {n})"):
                    code(f"const int cu{u}_i = ce_i + {u};", *c.setup(f"cu{u}_i", f"cu{u}"),
                         *c.put("row", f"cu{u}", f"v.{'xyzw'[u]}"))


# -- the variant --------------------------------------------------------------------------------
class Gemm1x1WgmmaTF32(Variant):
    """1x1 convolution as a wgmma TF32 GEMM on K-major, TF32-rounded copies of w and x."""

    name = "gemm1x1_wgmma_tf32"
    family = "gemm1x1"
    backends = frozenset({"cuda"})
    precision = "relaxed"
    tolerance = TF32_TOLERANCE
    exact = False
    offset_ok = True  # nchw_store honours Epilogue.k_total / k_offset
    specialised = 12  # above gemm1x1_tf32 (11) where rank() says it wins
    space_lead = 6

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Above gemm1x1_tf32 where x is read in place (stride 1, no padding) or C and K are both
        >= 256; below it elsewhere (with the transpose pass it lost on shallow layers of large
        images). On sm_90 the generator's tc_implicit_gemm_tf32 steps above it on the plain 1x1
        layers where it measured faster (variants.wgmma_1x1_leads; docs/NOTES-wgmma.md). Below
        gemm1x1_splitk on a handful of pixels (isa.few_pixels: a weight stream)."""
        if few_pixels(spec):
            return 10  # below gemm1x1_splitk (11): a weight stream (isa.few_pixels)
        if direct_applies(spec) or (spec.c >= 256 and spec.k >= 256):
            return self.specialised
        return 10

    def expected_error(self, spec: ConvSpec) -> float:
        return TF32_EXPECTED

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.r != 1 or spec.s != 1:
            return "only 1x1 filters"
        ws = padded_rows(spec.n * spec.p * spec.q, 256) * padded_c(spec)  # the largest over the space
        return super().applies(spec, device) or device_reason(device) or too_big(spec, ws, "NHWC workspace")

    def _mn(self, spec: ConvSpec) -> tuple[int, int]:
        return spec.k, spec.n * spec.p * spec.q

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return wg_space(*self._mn(spec), min(device.shared_optin_bytes, MAX_SHARED), direct_applies(spec),
                        device.units)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return wg_default(*self._mn(spec), min(device.shared_optin_bytes, MAX_SHARED), direct_applies(spec),
                          device.units)

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        m, n = self._mn(spec)
        xt = 0 if x_layout(params) == "direct" else padded_rows(n, params.bn)
        return 4 * padded_c(spec) * (padded_rows(m, 64 * params.wg) + xt)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        unknown = set(params) - set(WG_KEYS)
        if unknown:
            raise ValueError(f"{self.name}: unknown parameters {sorted(unknown)}")
        direct = x_layout(params) == "direct"
        if direct and not direct_applies(spec):
            raise ValueError(f"{self.name}: xl=direct needs stride 1 and no padding ({spec.short()})")
        m, n = self._mn(spec)
        cp = padded_c(spec)
        outs = tuple(a for a in out_args(epilogue) if isinstance(a, Buf))
        wk, wgrid = round_weights_kernel(spec, f"{self.name}_wt")
        grid = (cdiv(n, params.bn), cdiv(m, 64 * params.wg), 1)
        ws: tuple[tuple[str, int], ...] = (("wt", 4 * padded_rows(m, 64 * params.wg) * cp),)
        if direct:
            xd = XDirect(spec.c, spec.h * spec.w, n)
            gk = gemm_kernel(f"{self.name}_gemm", m, n, cp, params, nchw_store(spec, epilogue),
                             (Buf("wt"), Buf("x")) + outs, xd)
            steps: tuple[Launch, ...] = (Launch(gk.name, grid, gk.block, ("wt", "x") + out_refs(epilogue)),)
            kernels: tuple[Kernel, ...] = (wk, gk)
        else:
            xk, xgrid = transpose_kernel(spec, f"{self.name}_xt")
            gk = gemm_kernel(f"{self.name}_gemm", m, n, cp, params, nchw_store(spec, epilogue),
                             (Buf("wt"), Buf("xt")) + outs)
            steps = (Launch(xk.name, xgrid, xk.block, ("x", "xt")),
                     Launch(gk.name, grid, gk.block, ("wt", "xt") + out_refs(epilogue)))
            ws += (("xt", 4 * padded_rows(n, params.bn) * cp),)
            kernels = (wk, xk, gk)
        steps = (Launch(wk.name, wgrid, wk.block, ("w", "wt")),) + steps
        return Plan(self.name, self.family, spec, params, kernels, steps, ws, self.tolerance, epilogue)


def direct_applies(spec: ConvSpec) -> bool:
    """The GEMM can read x in place: stride 1 and no padding (a 1x1 filter's pixel is its
    output pixel), so column j of B is pixel j % (H W) of image j // (H W)."""
    return spec.stride == (1, 1) and spec.pad == (0, 0, 0, 0)


register(Gemm1x1WgmmaTF32())
