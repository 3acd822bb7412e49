"""Depthwise convolutions of large filters on tensor cores: ``depthwise_mma`` (fprop) and
``depthwise_mma_dgrad`` (stride-1 dgrad), float16 / bfloat16 storage, FP32 accumulation, NCHW or NHWC.

RepLKNet's and SLaK's 13x13 to 31x31 (and 51x5) depthwise layers do R*S multiply-adds an output, up to
961: on CUDA cores they are compute-bound (``depthwise``'s tiled form runs them at 25-40 % of the FP32
FMA rate, and cuDNN slower still). Per channel c such a layer is a matrix product: row p of the output
is sum over input rows h of T_r . x[h] (r = h - p + pt), where T_r[q][v] = w[c, r, v - q + pl] is a
Toeplitz matrix of filter row r. Cut q and v into 16-column tiles (q = 16 i + a, v = 16 j + b): the
block (i, j) of T_r depends only on r and d = j - i, and is nonzero only for the few d that S reaches.
So each (output row p, input row h) pair is, for every reachable (i, j), one or more mma.sync
m16n8k16 products: A = the 16 x 16 block of T_r at d (M: output columns, K: input columns), B = 16
input columns x 8 images, D = 16 output columns x 8 images, FP32.

* A in registers from a pair table: lane (g, t) needs A[a][b] = wf[r][16 d + b - a + pl] at
  (a, b) = (g, 2t), (g, 2t+1), (g+8, 2t), ..., i.e. wf[o], wf[o+1], wf[o-8], wf[o-7], wf[o+8], wf[o+9]
  with o = 16 d + pl + 2t - g. The block keeps each filter row as 32-bit words T[o] = (wf[o], wf[o+1])
  (zeros off the filter), so a fragment is three shared loads (a3 = a0) for any d.
* B from the block's strip: input rows of the band, images of the block, 16 j + 2t and + 8 as words
  of rows padded to 16 tv + 8 halves (lanes of a load hit 32 distinct banks).
* The epilogue (bias, residual, activation) is applied to the FP32 sums, rounded to the storage dtype
  and staged in shared memory; a pass then writes NHWC pixels as runs of the block's ``cg`` channels
  (16 bytes at cg = 8) or NCHW rows.

Blocks: (channel group of ``cg``, images of ``nt``, band of ``bp`` output rows); ``wp`` warps take the
(channel, output row) units in turn, each holding tq x nt / 8 accumulator fragments. dgrad at stride 1
is the same correlation on dy with the filter rotated by 180 degrees and padding R - 1 - pt.

Tensor-core multiply-adds per useful one: (16 x 16 x reachable blocks) / S per output row pair, 1.1x
at 31x31 on 56-wide planes, about 3x at 51x5; the variant ranks first on filters of more than
``depthwise.REG_TAPS`` taps (the tiled form's territory).
CUDA only, compute capability 8.0 and above (mma.sync .f16 / .bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from convforge.codegen.dialect import Kernel, LocalBuf, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs
from convforge.kernels.depthwise import REG_TAPS
from convforge.kernels.tensorcore.sm90.cexpr import Let, emit_all
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

HALF = frozenset({"float16", "bfloat16"})
_BUDGET = 110 * 1024  # shared bytes a block: two blocks an SM
_MAX_SMEM = 227 * 1024
_MAX_ACC = 64  # accumulator floats a thread
_WARPS = 8  # the default's warps a block (faster than 4 on every large-kernel layer timed: docs/NOTES-gemm.md)
_TO_HALF = {"float16": "TC_F32_TO_F16", "bfloat16": "TC_F32_TO_BF16"}
_MMA = {"float16": "MMA_F16_16x8x16", "bfloat16": "MMA_BF16_16x8x16"}
_VEC = {8: "uint4", 4: "uint2", 2: "unsigned", 1: "unsigned short"}


def _align(n: int) -> int:
    return -(-n // 16) * 16


@dataclass(frozen=True)
class Geo:
    """One parameter set on one layer: the correlation dst[n, c, p, q] = sum over (r, s) of
    src[n, c, p + r - pt, q + s - pl] . wf[c, r, s] and the block's tiling of it."""

    spec: ConvSpec
    cg: int  # channels a block
    nt: int  # images a block (a multiple of 8: the mma's N)
    bp: int  # output rows a block
    wp: int  # warps a block

    @classmethod
    def of(cls, spec: ConvSpec, p: Params) -> Geo:
        return cls(spec, p.cg, p.nt, p.bp, p.wp)

    @property
    def dgrad(self) -> bool:
        return self.spec.conv_pass == "dgrad"

    @property
    def hi(self) -> int:
        return self.spec.p if self.dgrad else self.spec.h

    @property
    def wi(self) -> int:
        return self.spec.q if self.dgrad else self.spec.w

    @property
    def ho(self) -> int:
        return self.spec.h if self.dgrad else self.spec.p

    @property
    def wo(self) -> int:
        return self.spec.w if self.dgrad else self.spec.q

    @property
    def pt(self) -> int:
        return self.spec.r - 1 - self.spec.pad[0] if self.dgrad else self.spec.pad[0]

    @property
    def pl(self) -> int:
        return self.spec.s - 1 - self.spec.pad[2] if self.dgrad else self.spec.pad[2]

    @property
    def tq(self) -> int:
        """16-column tiles of an output row."""
        return cdiv(self.wo, 16)

    @property
    def tv(self) -> int:
        """16-column tiles of an input row."""
        return cdiv(self.wi, 16)

    @property
    def vp(self) -> int:
        """Halves a strip row takes: 16 tv, plus 8 so that rows start 4 banks apart."""
        return 16 * self.tv + 8

    @cached_property
    def ds(self) -> tuple[int, ...]:
        """The tile offsets d = j - i whose Toeplitz blocks hold a tap (and that some (i, j) has)."""
        lo = max(-((self.pl + 15) // 16), -(self.tq - 1))
        hi = min((self.spec.s + 14 - self.pl) // 16, self.tv - 1)
        return tuple(range(lo, hi + 1))

    @property
    def omin(self) -> int:
        """The first filter column a table row holds (o - 8 of the lowest d at 2t - g = -7)."""
        return 16 * self.ds[0] + self.pl - 15

    @property
    def tl(self) -> int:
        """Words of a table row: every o - 8 .. o + 8 of every d in :attr:`ds`."""
        return 16 * (self.ds[-1] - self.ds[0]) + 30

    @property
    def hb(self) -> int:
        """Input rows a band's strip holds."""
        return min(self.hi, self.bp + self.spec.r - 1)

    @property
    def bands(self) -> int:
        return cdiv(self.ho, self.bp)

    @property
    def ngroups(self) -> int:
        return cdiv(self.spec.n, self.nt)

    @property
    def blocks(self) -> int:
        return self.spec.c // self.cg * self.ngroups * self.bands

    @property
    def threads(self) -> int:
        return 32 * self.wp

    @property
    def xplane(self) -> int:
        """Halves of one channel's strip (+ 8: the channels' strips start 4 banks apart)."""
        return self.hb * self.nt * self.vp + 8

    @property
    def xs_bytes(self) -> int:
        return _align(2 * self.cg * self.xplane)

    @property
    def tab_bytes(self) -> int:
        return _align(4 * self.cg * self.spec.r * self.tl)

    @property
    def ys_bytes(self) -> int:
        return _align(2 * self.cg * self.nt * self.bp * self.wo)

    @property
    def smem(self) -> int:
        return self.xs_bytes + self.tab_bytes + self.ys_bytes

    @property
    def acc(self) -> int:
        return self.tq * self.nt // 8 * 4

    @property
    def nhwc(self) -> bool:
        return self.spec.layout == "nhwc"

    def problem(self) -> str | None:
        """None when the generator takes this tiling, else what is wrong."""
        s = self.spec
        if min(self.cg, self.nt, self.bp, self.wp) < 1 or self.nt % 8 or self.cg not in _VEC:
            return "cg must be 1, 2, 4 or 8, nt a multiple of 8, bp and wp >= 1"
        if s.c % self.cg:
            return f"cg ({self.cg}) must divide the channels ({s.c})"
        if self.wp > 16:
            return f"wp ({self.wp}) warps must be at most 16"
        if not self.ds:
            return "no Toeplitz block holds a tap"
        if self.acc > _MAX_ACC:
            return f"{self.acc} accumulators a thread (tq {self.tq} x nt {self.nt} / 2) is over {_MAX_ACC}"
        if self.smem > _MAX_SMEM:
            return f"{self.smem} bytes of shared memory is over {_MAX_SMEM}"
        return None

    # -- index arithmetic (C expressions; tests/test_depthwise_mma.py evaluates the same strings) --
    def head_lets(self) -> tuple[Let, ...]:
        """Block bid's channel, image and row origins: bands fastest, then image groups."""
        return (Let("band", f"bid % {self.bands}"), Let("ng", f"bid / {self.bands} % {self.ngroups}"),
                Let("cb", f"bid / {self.bands * self.ngroups}"),
                Let("c0", f"cb * {self.cg}"), Let("n0", f"ng * {self.nt}"), Let("p0", f"band * {self.bp}"),
                Let("hlo", f"max(0, p0 - {self.pt})"), Let("pe", f"min({self.bp}, {self.ho} - p0)"))

    def strip_lets(self) -> tuple[Let, ...]:
        """Element e of the block's strips: where it lands (xd, halves) and what it holds (src[xsrc] where
        xok, else zero)."""
        cg, vp, nt, hb, s = self.cg, self.vp, self.nt, self.hb, self.spec
        if self.nhwc:  # channels fastest: a warp reads runs of cg channels of consecutive pixels
            dec = (Let("xc", f"e % {cg}"), Let("xv", f"e / {cg} % {vp}"), Let("xn", f"e / {cg * vp} % {nt}"),
                   Let("xh", f"e / {cg * vp * nt}"))
        else:  # columns fastest: NCHW rows
            dec = (Let("xv", f"e % {vp}"), Let("xn", f"e / {vp} % {nt}"), Let("xh", f"e / {vp * nt} % {hb}"),
                   Let("xc", f"e / {vp * nt * hb}"))
        h, n, c = "(hlo + xh)", "(n0 + xn)", "(c0 + xc)"
        src = (f"(({n} * {self.hi} + {h}) * {self.wi} + xv) * {s.c} + {c}" if self.nhwc
               else f"(({n} * {s.c} + {c}) * {self.hi} + {h}) * {self.wi} + xv")
        return dec + (Let("xok", f"xh < {hb} && {h} < {self.hi} && {n} < {s.n} && xv < {self.wi}"),
                      Let("xsrc", src),
                      Let("xd", f"xc * {self.xplane} + (xh * {nt} + xn) * {vp} + xv"))

    def table_lets(self) -> tuple[Let, ...]:
        """Word e of the tables: channel tc, filter row tr (of the correlated filter wf), columns to
        and to + 1; wlo / whi their offsets in w (K R S), read where tlok / thok."""
        s, tl = self.spec, self.tl
        rows = f"{s.r - 1} - tr" if self.dgrad else "tr"

        def col(o: str) -> str:
            return f"{s.s - 1} - ({o})" if self.dgrad else o

        base = f"((c0 + tc) * {s.r} + {rows}) * {s.s}"
        return (Let("tc", f"e / {s.r * tl}"), Let("tr", f"e / {tl} % {s.r}"), Let("to", f"e % {tl} + {self.omin}"),
                Let("tlok", f"to >= 0 && to < {s.s}"), Let("thok", f"to + 1 >= 0 && to + 1 < {s.s}"),
                Let("wlo", f"{base} + {col('to')}"), Let("whi", f"{base} + {col('to + 1')}"))

    def unit_lets(self) -> tuple[Let, ...]:
        """Unit u of the block (a warp's turn): channel cgi, output row p, its input rows hs .. he - 1."""
        return (Let("cgi", "u / pe"), Let("pp", "u % pe"), Let("p", "p0 + pp"),
                Let("hs", f"max(0, p - {self.pt})"), Let("he", f"min({self.hi}, p - {self.pt} + {self.spec.r})"))

    def row_lets(self) -> tuple[Let, ...]:
        """Input row h of a unit: its filter row's table (trow, words) and its strip row (xrow, halves)."""
        return (Let("trow", f"(cgi * {self.spec.r} + h - p + {self.pt}) * {self.tl}"),
                Let("xrow", f"cgi * {self.xplane} + (h - hlo) * {self.nt * self.vp}"))

    def a_lets(self, d: int) -> tuple[Let, ...]:
        """Lane (g, t)'s A words at offset d: a0 = a3 = trow[ao], a1 = trow[ao - 8], a2 = trow[ao + 8]."""
        return (Let(f"ao{_tag(d)}", f"{16 * d + self.pl - self.omin} + 2 * t - g"),)

    def b_word(self, j: int, nc: int) -> str:
        """Word offset in an input row of the strip of b0 (b1: + 4) for tile j, image chunk nc."""
        return f"({nc * 8} + g) * {self.vp // 2} + {8 * j} + t"

    def c_lets(self, i: int, nc: int) -> tuple[Let, ...]:
        """Accumulator k (a run-time loop) of fragment (i, nc): whether it is an output (cok), its staging
        slot (cy, halves) and its offset in dst (cd: a residual's index). k = 0..3: rows g, g, g + 8,
        g + 8 (output columns), columns 2t, 2t + 1, 2t, 2t + 1 (images)."""
        s = self.spec
        q, nn = f"{16 * i} + (k >> 1) * 8 + g", f"{nc * 8} + (k & 1) + 2 * t"
        ys = (f"((({nn}) * {self.bp} + pp) * {self.wo} + {q}) * {self.cg} + cgi" if self.nhwc
              else f"((cgi * {self.nt} + {nn}) * {self.bp} + pp) * {self.wo} + {q}")
        n, c = f"(n0 + {nn})", "(c0 + cgi)"
        dst = (f"(({n} * {self.ho} + p) * {self.wo} + {q}) * {s.c} + {c}" if self.nhwc
               else f"(({n} * {s.c} + {c}) * {self.ho} + p) * {self.wo} + {q}")
        return (Let("cok", f"{q} < {self.wo} && {n} < {s.n}"), Let("cy", ys), Let("cd", dst))

    def store_lets(self) -> tuple[Let, ...]:
        """Item e of the store pass: the staged run (sy, halves) and where it goes (sd), written where sok."""
        s, wo, cg = self.spec, self.wo, self.cg
        if self.nhwc:  # one item a pixel: cg channels
            dec = (Let("sq", f"e % {wo}"), Let("sp", f"e / {wo} % pe"), Let("sn", f"e / ({wo} * pe)"),
                   Let("sc", "0"))
            sy = f"((sn * {self.bp} + sp) * {wo} + sq) * {cg}"
            dst = f"(((n0 + sn) * {self.ho} + p0 + sp) * {wo} + sq) * {s.c} + c0"
        else:
            dec = (Let("sq", f"e % {wo}"), Let("sp", f"e / {wo} % pe"), Let("sn", f"e / ({wo} * pe) % {self.nt}"),
                   Let("sc", f"e / ({wo} * pe * {self.nt})"))
            sy = f"((sc * {self.nt} + sn) * {self.bp} + sp) * {wo} + sq"
            dst = f"(((n0 + sn) * {s.c} + c0 + sc) * {self.ho} + p0 + sp) * {wo} + sq"
        return dec + (Let("sok", f"sc < {cg} && n0 + sn < {s.n}"), Let("sy", sy), Let("sd", dst))

    @property
    def items(self) -> str:
        """Store-pass items (a C expression of pe)."""
        return f"{self.nt} * pe * {self.wo}" + ("" if self.nhwc else f" * {self.cg}")


def _tag(d: int) -> str:
    return f"m{-d}" if d < 0 else f"p{d}"


# -- the kernel ------------------------------------------------------------------------------------
def kernel(name: str, geo: Geo, epi: Epilogue) -> Kernel:
    """The block's strips and tables, the units' mma products, the staged store (module docstring)."""
    s, sto = geo.spec, Storage(geo.spec.dtype)
    src, dst = ("y", "x") if geo.dgrad else ("x", "y")
    code = Code()
    code("const int tid = LOCAL_ID(0), warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;",
         "const int bid = GROUP_ID(0);")
    emit_all(code, geo.head_lets())
    code("unsigned short* const xs = (unsigned short*)cf_smem;",
         f"unsigned* const tab = (unsigned*)((unsigned char*)cf_smem + {geo.xs_bytes});",
         f"unsigned short* const ys = (unsigned short*)((unsigned char*)cf_smem + {geo.xs_bytes + geo.tab_bytes});")
    with code.block(f"for (int e = tid; e < {geo.cg * geo.hb * geo.nt * geo.vp}; e += {geo.threads})"):
        emit_all(code, geo.strip_lets())
        code(f"xs[xd] = xok ? {src}[xsrc] : (unsigned short)0u;")
    with code.block(f"for (int e = tid; e < {geo.cg * s.r * geo.tl}; e += {geo.threads})"):
        emit_all(code, geo.table_lets())
        code("tab[e] = (tlok ? (unsigned)w[wlo] : 0u) | ((thok ? (unsigned)w[whi] : 0u) << 16);")
    code("BARRIER();")
    _units(code, geo, epi, sto, dst)
    code("BARRIER();")
    with code.block(f"for (int e = tid; e < {geo.items}; e += {geo.threads})"):
        emit_all(code, geo.store_lets())
        vec = _VEC[geo.cg] if geo.nhwc else "unsigned short"
        code(f"if (sok) *({vec}*)({dst} + sd) = *(const {vec}*)(ys + sy);")
    args = ((sto.buf("y"), sto.buf("w"), sto.buf("x", readonly=False)) if geo.dgrad
            else (sto.buf("x"), sto.buf("w")) + out_args(epi, sto))
    comment = (f"depthwise_mma{'_dgrad' if geo.dgrad else ''}: {s.short()} cg={geo.cg} nt={geo.nt} bp={geo.bp} "
               f"wp={geo.wp}; Toeplitz offsets d {list(geo.ds)}, {geo.smem} shared bytes")
    # an explicit launch bound: without one ptxas held some tilings to 48 registers and spilled
    return Kernel(name, args + (LocalBuf("cf_smem", geo.smem),), code.text(), (geo.threads, 1, 1),
                  frozenset({"mma_tf32"}), comment=comment, min_blocks=2 if geo.threads <= 256 else 1)


def _units(code: Code, geo: Geo, epi: Epilogue, sto: Storage, dst: str) -> None:
    """Each warp's (channel, output row) units: the sum over input rows, then the epilogue into ys."""
    s, nc_n = geo.spec, geo.nt // 8
    frags = [(i, nc) for i in range(geo.tq) for nc in range(nc_n)]
    with code.block(f"for (int u = warp; u < {geo.cg} * pe; u += {geo.wp})"):
        emit_all(code, geo.unit_lets())
        code("float " + ", ".join(f"d{i}_{nc}_{k} = 0.0f" for i, nc in frags for k in range(4)) + ";")
        for d in geo.ds:
            emit_all(code, geo.a_lets(d))
        with code.block("for (int h = hs; h < he; ++h)"):
            emit_all(code, geo.row_lets())
            code("const unsigned* const tw = tab + trow;", "const unsigned* const xw = (const unsigned*)(xs + xrow);")
            for d in geo.ds:
                x = _tag(d)
                code(f"const unsigned a0{x} = tw[ao{x}], a1{x} = tw[ao{x} - 8], a2{x} = tw[ao{x} + 8];")
            for j in range(geo.tv):
                tiles = [i for i in range(geo.tq) if j - i in geo.ds]
                if not tiles:
                    continue
                for nc in range(nc_n):
                    code(f"const unsigned b0_{j}_{nc} = xw[{geo.b_word(j, nc)}], "
                         f"b1_{j}_{nc} = xw[{geo.b_word(j, nc)} + 4];")
                    for i in tiles:
                        x, dd = _tag(j - i), ", ".join(f"d{i}_{nc}_{k}" for k in range(4))
                        code(f"{_MMA[s.dtype]}({dd}, a0{x}, a1{x}, a2{x}, a0{x}, b0_{j}_{nc}, b1_{j}_{nc});")
        for i, nc in frags:  # a run-time loop over the fragment's four sums: one epilogue's code each
            code("#pragma unroll 1")
            with code.block("for (int k = 0; k < 4; ++k)"):
                sums = [f"d{i}_{nc}_{k}" for k in range(4)]
                code(f"const float acc = k == 0 ? {sums[0]} : k == 1 ? {sums[1]} : k == 2 ? {sums[2]} : {sums[3]};")
                emit_all(code, geo.c_lets(i, nc))
                value = epi.apply("acc", "(c0 + cgi)", "cd", storage=sto)
                code(f"if (cok) ys[cy] = {_TO_HALF[s.dtype]}({value});")


# -- parameters ------------------------------------------------------------------------------------
def _candidates(spec: ConvSpec) -> list[Geo]:
    """Every tiling the generator takes on ``spec`` (with the default's warps): channels a block (more
    first on NHWC: longer runs a pixel; fewer first on NCHW), then images, then rows."""
    cgs = [c for c in (8, 4, 2, 1) if spec.c % c == 0]
    if spec.layout != "nhwc":
        cgs.reverse()
    nts = [n for n in (32, 16, 8) if n <= max(8, -(-spec.n // 8) * 8)]
    ho = spec.h if spec.conv_pass == "dgrad" else spec.p
    bps = sorted({ho, *(b for b in (32, 16, 8, 4, 2) if b < ho)}, reverse=True)
    out = []
    for cg in cgs:
        for nt in nts:
            for bp in bps:
                geo = Geo(spec, cg, nt, bp, _WARPS)
                if geo.problem() is None:
                    out.append(geo)
    return out


def load_sectors(geo: Geo) -> int:
    """32-byte sectors the blocks' strip loads touch: NHWC, one a pixel (a run of cg <= 8 channels);
    NCHW, a row's runs. The halo rows of bands and the narrow runs of few channels cost here."""
    blocks, rows = geo.blocks, geo.hb * geo.nt
    if geo.nhwc:
        return blocks * rows * geo.wi
    return blocks * geo.cg * rows * cdiv(2 * geo.wi, 32)


def default_geo(spec: ConvSpec, device: DeviceInfo) -> Geo | None:
    """Within two blocks an SM's shared memory and a block for every SM where one can, the candidate
    of the fewest strip sectors, each weighted by the shared loads an mma costs at its images a block
    (3 A words serve nt / 8 products); None: no tiling fits."""
    cands = _candidates(spec)
    fit = [g for g in cands if g.smem <= _BUDGET] or cands
    if not fit:
        return None
    full = [g for g in fit if g.blocks >= max(device.units, 1)] or fit
    return min(full, key=_cost)


def _cost(geo: Geo) -> tuple[float, int]:
    return load_sectors(geo) * (1 + 8 / geo.nt), -geo.bp


def _params(geo: Geo) -> Params:
    return Params(cg=geo.cg, nt=geo.nt, bp=geo.bp, wp=geo.wp)


def mma_problem(spec: ConvSpec, device: DeviceInfo) -> str | None:
    """Why the mma.sync depthwise forms (this module's, depthwise_mma_wgrad's) cannot take ``spec`` on
    ``device`` whatever its shape: one output channel a channel, a CUDA device of sm_80+; or None."""
    if not spec.depthwise or spec.k != spec.c:
        return "only depthwise layers of one output channel a channel (K == groups == C)"
    if device.backend != "cuda" or not device.cc or device.cc < (8, 0):
        return "mma.sync .f16 / .bf16 needs a CUDA device of compute capability 8.0 or above"
    return None


class DepthwiseMma(Variant):
    """fprop (or, ``dgrad``, the stride-1 dgrad) of a depthwise layer with one output channel a
    channel, stride 1, no dilation, float16 / bfloat16, NCHW or NHWC, on mma.sync tensor cores by
    Toeplitz blocks (module docstring); bias, residual and an activation in the forward's epilogue."""

    family = "depthwise"
    backends = frozenset({"cuda"})
    grouped = True
    exact = True
    residual_ok = True
    tolerance = 1e-5
    specialised = 22
    space_lead = 1
    dtypes = HALF
    layouts = frozenset({"nchw", "nhwc"})
    tensor_cores = True

    def __init__(self, dgrad: bool) -> None:
        self.dgrad = dgrad
        self.name = "depthwise_mma_dgrad" if dgrad else "depthwise_mma"
        self.passes = frozenset({"dgrad" if dgrad else "fprop"})

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why:
            return why
        if spec.stride != (1, 1) or spec.dilation != (1, 1):
            return "stride 1 and no dilation only (the Toeplitz blocks of one filter row)"
        why = mma_problem(spec, device)
        if why:
            return why
        if not _candidates(spec):
            return "no tiling fits: a band of the filter's rows does not fit in shared memory"
        return None

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """First on filters of more taps than the register stencils hold (the tiled CUDA-core form's
        layers); below ``depthwise`` on smaller ones, where the layer is memory-bound."""
        return self.specialised if spec.r * spec.s > REG_TAPS else 0

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        geo = default_geo(spec, device)
        if geo is None:
            raise ValueError(f"{self.name}: no tiling fits {spec.short()}")
        return _params(geo)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The default, then the tilings within two blocks an SM in :func:`default_geo`'s order (at most
        12), each with 8, 4 and 16 warps."""
        out = [self.default(spec, device)]
        fit = sorted((g for g in _candidates(spec) if g.smem <= _BUDGET), key=_cost)[:12]
        for geo in fit:
            for wp in (8, 4, 16):
                p = _params(Geo(spec, geo.cg, geo.nt, geo.bp, wp))
                if p not in out:
                    out.append(p)
        return out

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        if self.dgrad and epilogue != Epilogue():
            raise ValueError(f"unsupported epilogue: {self.name} writes the plain data gradient")
        if epilogue.k_total:
            raise ValueError(f"unsupported epilogue: {self.name} cannot write at a channel offset")
        geo = Geo.of(spec, params)
        why = geo.problem()
        if why:
            raise ValueError(f"{self.name}: {why}")
        name = "dgrad_depthwise_mma" if self.dgrad else "conv_depthwise_mma"
        k = kernel(name, geo, epilogue)
        refs = ("y", "w", "x") if self.dgrad else ("x", "w") + out_refs(epilogue)
        launch = Launch(name, (geo.blocks, 1, 1), k.block, refs)
        return Plan(self.name, self.family, spec, params, (k,), (launch,), tolerance=self.tolerance,
                    epilogue=epilogue)


register(DepthwiseMma(False))
register(DepthwiseMma(True))
