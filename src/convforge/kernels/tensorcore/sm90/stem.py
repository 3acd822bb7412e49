"""Stems on tensor cores without a folded copy of the input: ``tc_stem_direct_half`` / ``_tf32``.

A stem has fewer input channels than a 16-byte chunk holds (3-channel images). The generator's GEMMs
read A by 16-byte chunks, so a stem pays for a padded or a folded copy of x that is larger than x
(``TcStemGemm``'s x' is 155 MB for MEC's cv3, a 40 MB input) and is written and read back before
the GEMM. Here each block reads the input rows of a band of output rows once into shared memory, as
they lie, and the consumer warpgroups build wgmma's A operand in registers straight from them:

* The strip: rows j = 0 .. SR - 1 of image n, input row h = p0 sh - pt + j (SR = (BP - 1) sh +
  (R - 1) dh + 1 for a band of BP output rows from p0), each RS elements long; element e = wc C + c
  holds x[n][c][h][wc - pl] (zero outside the image), rounded to TF32 for the TF32 variant.
* For output row p and pixel q, tap row r, the reduction index k = s C + c (one filter row's S
  columns of C channels) reads strip[(p - p0) sh + r dh][q sw C + k]: k is contiguous in the row.
  So A of a 64-pixel block (q0 .. q0 + 63 of one output row) and tap r is a strided window of the
  strip, and a k step (16 halves, 8 TF32) of it is 4 registers a thread.
* wgmma with A in registers (``wgmma ... {a0, a1, a2, a3}, desc_b``): lane l = 4 g + t of warp w
  holds rows 16 w + g (a0, a2) and 16 w + g + 8 (a1, a3), k = EPR t + {0, KE / 2} (a0 / a1, a2 / a3;
  EPR = elements a register: 2 halves or 1 TF32), the ``mma.m16n8k16`` / ``k8`` A layout per warp.
  A pair of halves is one 32-bit shared load when its first element is even; where sw C is odd
  (a 3x3 stride-1 stem) pixel parity alternates, so the strip is stored twice, the second copy
  one element on (copy2[i] = strip[i + 1]) and odd rows read that one.
* k past S C (the last k step's padding) is masked to zero in the registers (a per-lane constant),
  so a non-finite input never reaches an output outside its window.
* B: each (tap r, k step i) is its own K-major tile of Kn rows x 32 bytes with the 32-byte swizzle
  (``smem.Tile(Kn, 1, 32)``: one k step a tile), loaded once per block from ``wt`` = [ns][R KS][Kn]
  [KE] (the filters' weight-only step; zeros past S C).
* Each tap's k steps are one wgmma group; its registers stay tied until the group after it has
  been waited for (two register sets in turn), so loads of the next tap overlap this one's wgmma.
* Epilogue: bias, ReLU or GELU, rounded to the storage dtype, staged per warpgroup in shared memory,
  then NHWC rows as 16-byte runs (a pixel's Kn channels are contiguous, and so are the block's 64
  pixels) or NCHW planes (64 consecutive pixels of a channel per pass).

Grid: (N x bands, ns); block 128 wg threads. A block loads its strip and its filters once and its
warpgroups take the band's (output row, 64-pixel block) units in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from convforge.codegen.dialect import Buf, Kernel, LocalBuf
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.tensorcore.sm90 import prep
from convforge.kernels.tensorcore.sm90.cexpr import Let, emit_all
from convforge.kernels.tensorcore.sm90.epilogue import CTYPE, from_float, to_float
from convforge.kernels.tensorcore.sm90.isa import ACC, KSTEP_BYTES, M, Math, device_reason
from convforge.kernels.tensorcore.sm90.smem import ALIGN, MAX_SHARED, Tile
from convforge.kernels.tensorcore.sm90.variants import RANK_SM90, TcVariant, tolerance
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan
from convforge.spec import ConvSpec

BWIDTH = KSTEP_BYTES  # bytes of K per B tile row: one k step, the 32-byte swizzle
_WT_THREADS = 256


@dataclass(frozen=True)
class StemGeo:
    """The shapes of one stem plan: band rows ``bp``, warpgroups ``wg``, channel splits ``ns``."""

    spec: ConvSpec
    math: Math
    bp: int
    wg: int
    ns: int

    # -- reduction and pixels ---------------------------------------------------------------
    @property
    def sc(self) -> int:
        """Reduction terms of one tap row: S C."""
        return self.spec.s * self.spec.c

    @property
    def ke(self) -> int:
        """Elements of K in one k step (16 halves, 8 TF32)."""
        return self.math.k

    @property
    def ks(self) -> int:
        """k steps a tap row."""
        return cdiv(self.sc, self.ke)

    @property
    def epr(self) -> int:
        """Elements a 32-bit A register holds."""
        return 4 // self.math.esize

    @property
    def swc(self) -> int:
        """Strip elements between neighbouring output pixels: sw C."""
        return self.spec.stride[1] * self.spec.c

    @property
    def mb(self) -> int:
        """64-pixel blocks of an output row."""
        return cdiv(self.spec.q, M)

    @property
    def bands(self) -> int:
        return cdiv(self.spec.p, self.bp)

    @property
    def sr(self) -> int:
        """Strip rows of a band."""
        (sh, _), (dh, _) = self.spec.stride, self.spec.dilation
        return (self.bp - 1) * sh + (self.spec.r - 1) * dh + 1

    @property
    def row_elems(self) -> int:
        """Strip elements a row must hold: up to the last (masked) k of the last pixel block."""
        return (self.mb * M - 1) * self.swc + self.ks * self.ke

    @property
    def rs(self) -> int:
        """Row stride of the strip in elements (16-byte multiples)."""
        per = 16 // self.math.esize
        return cdiv(self.row_elems, per) * per

    @property
    def dual(self) -> bool:
        """Half pairs that start at odd elements on odd rows: a second copy one element on."""
        return self.math.esize == 2 and self.swc % 2 == 1

    @property
    def kn(self) -> int:
        """Output channels of one block."""
        return self.spec.k // self.ns

    # -- shared memory ----------------------------------------------------------------------
    @property
    def strip_bytes(self) -> int:
        return self.sr * self.rs * self.math.esize

    @property
    def copy2(self) -> int:
        """Byte offset of the strip's second copy (dual)."""
        return self.strip_bytes

    @property
    def woff(self) -> int:
        """Byte offset of the B tiles (1024-aligned)."""
        return cdiv(self.strip_bytes * (2 if self.dual else 1), ALIGN) * ALIGN

    @property
    def btile(self) -> Tile:
        return Tile(self.kn, 1, BWIDTH)

    @property
    def wbytes(self) -> int:
        return self.spec.r * self.ks * self.kn * BWIDTH

    @property
    def oes(self) -> int:
        """Bytes of an output element."""
        return 4 if self.spec.dtype == "float32" else 2

    @property
    def nhwc(self) -> bool:
        return self.spec.layout == "nhwc"

    @property
    def sld(self) -> int:
        """Staging row stride in output elements: NHWC rows of Kn channels, NCHW rows of 64 pixels."""
        if self.nhwc:
            return self.kn + 8
        return M + (4 if self.oes == 4 else 8)

    @property
    def stage_bytes(self) -> int:
        rows = M if self.nhwc else self.kn
        return cdiv(rows * self.sld * self.oes, 16) * 16

    @property
    def stoff(self) -> int:
        return self.woff + self.wbytes

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of a block (1024 bytes of slack for aligning the base)."""
        return self.stoff + self.wg * self.stage_bytes + ALIGN

    @property
    def threads(self) -> int:
        return 128 * self.wg

    def problems(self, limit: int = MAX_SHARED) -> list[str]:
        """Why this shape cannot run, empty when it can."""
        why = []
        if self.bp < 1 or self.wg not in (1, 2) or self.ns < 1:
            why.append(f"bp ({self.bp}) >= 1, wg ({self.wg}) 1 or 2, ns ({self.ns}) >= 1")
        elif self.spec.k % self.ns or self.kn % 8 or not 8 <= self.kn <= 256:
            why.append(f"K ({self.spec.k}) / ns ({self.ns}) must be a multiple of 8 in 8..256")
        elif self.shared_bytes > limit:
            why.append(f"{self.shared_bytes} bytes of shared memory, more than {limit}")
        return why


# -- index arithmetic (C expressions the emulation evaluates too) ---------------------------------
def strip_lets(geo: StemGeo) -> list[Let]:
    """Strip element ``e`` of the band of image ``n`` from output row ``p0``: its row ``j``, column
    ``wc`` (padded) and channel ``c``, input row ``hh`` and column ``ww``, whether it lies in the image
    (``ok``) and its index ``src`` in x (read only where ``ok``)."""
    s = geo.spec
    (sh, _), pt, pl = s.stride, s.pad[0], s.pad[2]
    src = (f"((n * {s.h} + hh) * {s.w} + ww) * {s.c} + c" if geo.nhwc
           else f"((n * {s.c} + c) * {s.h} + hh) * {s.w} + ww")
    return [Let("j", f"e / {geo.rs}"), Let("ce", f"e % {geo.rs}"), Let("wc", f"ce / {s.c}"),
            Let("c", f"ce % {s.c}"), Let("hh", f"p0 * {sh} + j - {pt}"), Let("ww", f"wc - {pl}"),
            Let("ok", f"(hh >= 0 && hh < {s.h} && ww >= 0 && ww < {s.w})"),
            Let("src", src)]


def wt_lets(geo: StemGeo) -> list[Let]:
    """Filter-step element ``e`` of wt = [ns][R KS][Kn][KE]: its source in w (``src``, read only where
    ``ok``) and whether it is a filter tap (``ok``: k < S C)."""
    s = geo.spec
    return [Let("kk", f"e % {geo.ke}"), Let("nn", f"e / {geo.ke} % {geo.kn}"),
            Let("b", f"e / {geo.ke * geo.kn} % {s.r * geo.ks}"), Let("gy", f"e / {geo.ke * geo.kn * s.r * geo.ks}"),
            Let("r", f"b / {geo.ks}"), Let("k", f"b % {geo.ks} * {geo.ke} + kk"),
            Let("ok", f"(k < {geo.sc})"), Let("ko", f"gy * {geo.kn} + nn"),
            Let("src", f"((ko * {s.c} + k % {s.c}) * {s.r} + r) * {s.s} + k / {s.c}")]


def wcopy_lets(geo: StemGeo) -> list[Let]:
    """16-byte chunk ``e`` of a block's filters: from byte ``gsrc`` of wt to byte ``sdst`` of shared."""
    rks, kn = geo.spec.r * geo.ks, geo.kn
    return [Let("b", f"e / {2 * kn}"), Let("nn", f"e / 2 % {kn}"), Let("ch", "e % 2"),
            Let("gsrc", f"((gy * {rks} + b) * {kn} + nn) * {BWIDTH} + ch * 16"),
            Let("sdst", f"{geo.woff} + b * {kn * BWIDTH} + {geo.btile.chunk_offset('nn', 'ch')}")]


def a_lets(geo: StemGeo) -> list[Let]:
    """Lane (warp ``wq``, ``g``, ``t``): ``aoff``, the strip element of its register a0 in the first
    unit's tap 0, and ``abyte``, the shared byte it reads it at (the second copy on odd rows where
    ``dual``)."""
    es = geo.math.esize
    lets = [Let("aoff", f"(16 * wq + g) * {geo.swc} + {geo.epr} * t")]
    if geo.dual:
        return lets + [Let("abyte", f"{es} * aoff + g % 2 * {geo.copy2 - es}")]
    return lets + [Let("abyte", f"{es} * aoff")]


def a_delta(geo: StemGeo, r: int, i: int, x: int) -> int:
    """Strip elements from a0's of the unit to register ``x`` of tap ``r``, k step ``i``."""
    dh = geo.spec.dilation[0]
    return r * dh * geo.rs + i * geo.ke + (x & 1) * 8 * geo.swc + (x >> 1) * (geo.ke // 2)


def unit_lets(geo: StemGeo) -> list[Let]:
    """Unit ``u`` of the band: output row ``p`` (``pr`` rows into the band), pixel block ``qb``, first
    pixel ``q0`` and ``uoff``, its strip elements from the band's first."""
    sh = geo.spec.stride[0]
    return [Let("pr", f"u / {geo.mb}"), Let("p", "p0 + pr"), Let("qb", f"u % {geo.mb}"),
            Let("q0", f"qb * {M}"), Let("uoff", f"pr * {sh * geo.rs} + qb * {M * geo.swc}")]


def mask_expr(geo: StemGeo, half: int) -> str:
    """The lane's mask of registers a{2 half}, a{2 half + 1} in the last k step: its elements past
    S C zeroed (C expression of ``t``)."""
    k0 = f"({(geo.ks - 1) * geo.ke + half * (geo.ke // 2)} + {geo.epr} * t)"
    if geo.epr == 1:
        return f"({k0} < {geo.sc} ? 0xffffffffu : 0u)"
    return f"({k0} + 1 < {geo.sc} ? 0xffffffffu : {k0} < {geo.sc} ? 0xffffu : 0u)"


def masked(geo: StemGeo) -> bool:
    return geo.sc % geo.ke != 0


# -- kernels --------------------------------------------------------------------------------------
def wt_kernel(name: str, geo: StemGeo) -> tuple[Kernel, tuple[int, int, int]]:
    """The filters' step: w (K C R S) -> wt (zeros past S C; TF32-rounded for TF32)."""
    total = geo.ns * geo.spec.r * geo.ks * geo.kn * geo.ke
    code = Code()
    code(f"const int e = GROUP_ID(0) * {_WT_THREADS} + LOCAL_ID(0);")
    with code.block(f"if (e < {total})"):
        emit_all(code, wt_lets(geo))
        if geo.math.ptx == "tf32":
            code("wt[e] = ok ? CVT_TF32(w[src]) : 0.0f;")
        else:
            code("wt[e] = ok ? w[src] : (unsigned short)0u;")
    ct = CTYPE[geo.spec.dtype]
    feats = frozenset({"mma_tf32", "wgmma"})
    kern = Kernel(name, (Buf("w", ct), Buf("wt", geo.math.ctype, readonly=False)), code.text(), (_WT_THREADS, 1, 1),
                  feats, comment=f"filters -> [{geo.ns}][{geo.spec.r} x {geo.ks}][{geo.kn}][{geo.ke}] "
                                 f"{geo.math.name} k steps (zeros past S C = {geo.sc})")
    return kern, (cdiv(total, _WT_THREADS), 1, 1)


def main_kernel(name: str, geo: StemGeo, epi: Epilogue) -> Kernel:
    """The stem: strip and filters into shared memory, then the warpgroups' units (module docstring)."""
    if epi.residual or epi.k_total:
        raise ValueError("unsupported epilogue: the stem kernels store bias and an activation only "
                         "(no residual, no channel offset)")
    s, math = geo.spec, geo.math
    code = Code()
    code("const int tid = LOCAL_ID(0), wg = SHFL(tid >> 7, 0);  // warpgroup, uniform in the warp",
         "const int wq = (tid >> 5) & 3, g = (tid & 31) >> 2, t = tid & 3;",
         "const unsigned sbase = (SMEM_U32(tc_smem) + 1023u) & ~1023u;",
         "unsigned char* const sp = (unsigned char*)tc_smem + (sbase - SMEM_U32(tc_smem));",
         f"const int n = GROUP_ID(0) / {geo.bands}, p0 = GROUP_ID(0) % {geo.bands} * {geo.bp}, gy = GROUP_ID(1);",
         f"const int units = min({geo.bp}, {s.p} - p0) * {geo.mb};")
    _emit_loads(code, geo)
    code("FENCE_PROXY_ASYNC();  // the filters' generic writes, before wgmma reads them", "BARRIER();")
    emit_all(code, a_lets(geo))
    code(f"const unsigned long long bdesc0 = {geo.btile.desc_high}ull | "
         f"(unsigned long long)(((sbase + {geo.woff}u) >> 4) & 0x3FFFu);")
    if masked(geo):
        code(f"const unsigned mk0 = {mask_expr(geo, 0)}, mk1 = {mask_expr(geo, 1)};")
    nacc = geo.kn // 2
    accs = [f"d{i}" for i in range(nacc)]
    code(f"float {', '.join(f'{d} = 0.0f' for d in accs)};")
    regs = [[f"a{b}_{i}_{x}" for i in range(geo.ks) for x in range(4)] for b in range(2)]
    code(f"unsigned {', '.join(regs[0] + regs[1])};")
    stage = f"(sp + {geo.stoff} + wg * {geo.stage_bytes})"
    with code.block(f"for (int u = wg; u < units; u += {geo.wg})"):
        emit_all(code, unit_lets(geo))
        code(f"const unsigned char* const ap = sp + abyte + {math.esize} * uoff;")
        _emit_taps(code, geo, accs, regs)
        _emit_epilogue(code, geo, epi, accs, stage)
    feats = frozenset({"wgmma", "shuffle", "mma_tf32"})
    args: tuple[Buf, ...] = (Buf("x", CTYPE[s.dtype]), Buf("wt", math.ctype), Buf("y", CTYPE[s.dtype], readonly=False))
    if epi.bias:
        args += (Buf("bias", CTYPE[s.dtype]),)
    comment = (f"{math.name} stem {s.short()}: bands of {geo.bp} output rows, {geo.wg} warpgroup(s), "
               f"{geo.ns} channel block(s); A from a strip of {geo.sr} x {geo.rs} in registers")
    return Kernel(name, args + (LocalBuf("tc_smem", geo.shared_bytes),), code.text(), (geo.threads, 1, 1),
                  feats, min_blocks=1, comment=comment)


def _emit_loads(code: Code, geo: StemGeo) -> None:
    """The block's filters (16-byte chunks, swizzled) and its strip (an element a thread, in order)."""
    s, math = geo.spec, geo.math
    chunks = s.r * geo.ks * geo.kn * 2
    with code.block(f"for (int e = tid; e < {chunks}; e += {geo.threads})"):
        emit_all(code, wcopy_lets(geo))
        code("*(uint4*)(sp + sdst) = *(const uint4*)((const unsigned char*)wt + gsrc);")
    total = geo.sr * geo.rs
    ctype, zero = math.ctype, prep.zero(math)
    code("#pragma unroll 4")
    with code.block(f"for (int e = tid; e < {total}; e += {geo.threads})"):
        emit_all(code, strip_lets(geo))
        val = "CVT_TF32(x[src])" if math.ptx == "tf32" else "x[src]"
        code(f"const {ctype} v = ok ? {val} : {zero};",
             f"*({ctype}*)(sp + {math.esize} * e) = v;")
        if geo.dual:
            code(f"if (e > 0) *({ctype}*)(sp + {geo.copy2 - math.esize} + {math.esize} * e) = v;")


def _emit_taps(code: Code, geo: StemGeo, accs: list[str], regs: list[list[str]]) -> None:
    """One wgmma group per tap row: load its k steps' A registers (masked past S C), fence, issue,
    commit; then wait until one group is in flight, holding the other register set's values."""
    r_count, es = geo.spec.r, geo.math.esize
    for r in range(r_count):
        b = r % 2
        for i in range(geo.ks):
            for x in range(4):
                load = f"*(const unsigned*)(ap + {es * a_delta(geo, r, i, x)})"
                if masked(geo) and i == geo.ks - 1:
                    load = f"({load} & mk{x >> 1})"
                code(f"{regs[b][4 * i + x]} = {load};")
        code("WGMMA_FENCE();")
        for i in range(geo.ks):
            scale = 0 if r == 0 and i == 0 else 1
            desc = f"bdesc0 + {(r * geo.ks + i) * geo.kn * BWIDTH >> 4}ull"
            a = ", ".join(regs[b][4 * i:4 * i + 4])
            code(f"WGMMA_RS({geo.math.ptx}, {geo.ke}, {geo.kn}, {scale}, {a}, {desc}, {', '.join(accs)});")
        code("WGMMA_COMMIT();")
        last = r == r_count - 1
        code(f"WGMMA_WAIT({0 if last else 1}, {', '.join(accs)});")
        held = regs[0] + regs[1] if last else regs[1 - b]
        code(f"WGMMA_HOLD({', '.join(held)});")


def _emit_epilogue(code: Code, geo: StemGeo, epi: Epilogue, accs: list[str], stage: str) -> None:
    """Accumulators (+ bias, activation) -> the warpgroup's staging rows -> y."""
    s = geo.spec
    dt = s.dtype
    half = dt != "float32"
    code("BAR_SYNC(1 + wg, 128);  // the warpgroup's last stores have read the staging rows")
    for j in range(geo.kn // 8):
        for pair in (0, 1):  # registers 4 j + 2 pair, + 1: row g + 8 pair, columns 2 t, 2 t + 1
            i0 = 4 * j + 2 * pair
            row, col = ACC.row_expr(i0), ACC.col_expr(i0)
            vals = []
            for d in (0, 1):
                v = accs[i0 + d]
                if epi.bias:
                    v = f"{v} + {to_float(dt, f'bias[gy * {geo.kn} + {col} + {d}]')}"
                vals.append(epi.activate(v))
            if geo.nhwc:
                at = f"{stage} + ({row} * {geo.sld} + {col}) * {geo.oes}"
                if half:
                    pack = f"TC_PACK_{'F16' if dt == 'float16' else 'BF16'}X2({vals[0]}, {vals[1]})"
                    code(f"*(unsigned*)({at}) = {pack};")
                else:
                    code(f"*(float2*)({at}) = make_float2({vals[0]}, {vals[1]});")
            else:
                for d in (0, 1):
                    at = f"{stage} + (({col} + {d}) * {geo.sld} + {row}) * {geo.oes}"
                    code(f"*({CTYPE[dt]}*)({at}) = {from_float(dt, vals[d])};")
    code("BAR_SYNC(1 + wg, 128);")
    tw = "(tid & 127)"
    if geo.nhwc:
        cpr = geo.kn * geo.oes // 16
        with code.block(f"for (int e = {tw}; e < {M * cpr}; e += 128)"):
            code(f"const int row = e / {cpr}, ch = e % {cpr}, q = q0 + row;")
            with code.block(f"if (q < {s.q})"):
                code(f"*(uint4*)((unsigned char*)y + (((n * {s.p} + p) * {s.q} + q) * {s.k} + gy * {geo.kn}) * "
                     f"{geo.oes} + ch * 16) = *(const uint4*)({stage} + row * {geo.sld * geo.oes} + ch * 16);")
    else:
        et = CTYPE[dt]
        with code.block(f"for (int e = {tw}; e < {M * geo.kn}; e += 128)"):
            code(f"const int col = e / {M}, row = e % {M}, q = q0 + row;")
            with code.block(f"if (q < {s.q})"):
                code(f"y[((n * {s.k} + gy * {geo.kn} + col) * {s.p} + p) * {s.q} + q] = "
                     f"*(const {et}*)({stage} + (col * {geo.sld} + row) * {geo.oes});")


def launch_grid(geo: StemGeo) -> tuple[int, int, int]:
    return (geo.spec.n * geo.bands, geo.ns, 1)



# -- the variants ------------------------------------------------------------------------------
MAX_SC = 64  # S C at most: a stem's filter row, not a layer whose windows would be wide rows


class TcStemDirect(TcVariant):
    """A stem with A built in registers from input rows in shared memory (module docstring)."""

    layouts = frozenset({"nchw", "nhwc"})
    optional_params: dict[str, frozenset[int]] = {}

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Above the folded stem (``tc_stem_gemm_*``) and the implicit GEMM, except where the layer has
        fewer output rows (N P) than 4 a SM: each block loads the whole filter bank for a band of
        rows, and with few rows the bands are short (docs/NOTES-tensorcore.md)."""
        if device_reason(device) is not None:
            return self.specialised
        if spec.n * spec.p < 4 * max(device.units, 1):
            return RANK_SM90 - 5
        return RANK_SM90 + 2

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device) or device_reason(device)
        if why:
            return why
        math = self.math(spec)
        if spec.c >= math.chunk_elems:
            return f"a stem reads fewer channels ({spec.c}) than a {math.chunk_elems}-element chunk"
        if spec.dilation[1] != 1:
            return f"the window's columns must be contiguous (dilation {spec.dilation[1]} along W)"
        if spec.s * spec.c > MAX_SC:
            return f"S * C ({spec.s * spec.c}) above {MAX_SC}: not a stem"
        if spec.k % 8:
            return f"K ({spec.k}) must be a multiple of 8"
        if not self.space(spec, device):
            return "no band of output rows fits in shared memory"
        return self.wide(spec, spec.n * spec.c * spec.h * spec.w, spec.n * spec.k * spec.p * spec.q)

    def geo(self, spec: ConvSpec, params: Params) -> StemGeo:
        return StemGeo(spec, self.math(spec), int(params["bp"]), int(params["wg"]), int(params["ns"]))

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """Bands of 1-16 output rows, one or two warpgroups, 1-4 channel blocks: every point that fits;
        the default first."""
        limit = self.limit(device)
        out = []
        for ns in (1, 2, 4):
            for bp in (8, 4, 16, 2, 1):
                for wg in (2, 1):
                    p = Params(bp=min(bp, spec.p), wg=wg, ns=ns)
                    if not self.geo(spec, p).problems(limit):
                        out.append(p)
        out = list(dict.fromkeys(out))
        return ([self._pick(spec, out, device.units)] + out) if out else []

    def _pick(self, spec: ConvSpec, points: list[Params], units: int) -> Params:
        """The fewest channel blocks that let a band of 4 rows fit with two warpgroups (each block
        loads the filters, so more blocks reload them), then the tallest band of at most 8 rows that
        still gives 4 blocks an SM (a band reads (BP - 1) sh + R rows for BP: taller bands read less
        twice, with little gain past 8), two warpgroups where a band has two units."""
        two = [p for p in points if (p["wg"] == 2) == (self.geo(spec, p).bp * self.geo(spec, p).mb >= 2)]
        two = two or points
        ns = min((p["ns"] for p in two if p["bp"] >= min(4, spec.p)), default=min(p["ns"] for p in two))
        cands = sorted((p for p in two if p["ns"] == ns and p["bp"] <= 8), key=lambda p: -p["bp"])
        for p in cands:
            if spec.n * self.geo(spec, p).bands * ns >= 4 * max(units, 1):
                return p
        return cands[-1] if cands else two[0]

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        g = self.geo(spec, params)
        return g.ns * spec.r * g.ks * g.kn * g.ke * g.math.esize

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        geo = self.geo(spec, params)
        why = geo.problems(self.limit(device))
        if why:
            raise ValueError(f"{self.name}: {'; '.join(why)}")
        math = geo.math
        wk, wgrid = wt_kernel(f"{self.name}_w", geo)
        mk = main_kernel(f"{self.name}_main", geo, epilogue)
        outs = ("x", "wt", "y") + (("bias",) if epilogue.bias else ())
        steps = (Launch(wk.name, wgrid, wk.block, ("w", "wt")), Launch(mk.name, launch_grid(geo), mk.block, outs))
        return Plan(self.name, self.family, spec, params, (wk, mk), steps,
                    (("wt", self.workspace_bytes(spec, params)),), tolerance(math, spec.dtype), epilogue)


register(TcStemDirect("tc_stem_direct_tf32", frozenset({"float32"}), False, "relaxed", 11))
register(TcStemDirect("tc_stem_direct_half", frozenset({"float16", "bfloat16"}), False, "fp32", 11))
