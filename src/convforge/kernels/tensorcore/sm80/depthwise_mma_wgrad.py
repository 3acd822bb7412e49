"""wgrad of small-filter depthwise layers on tensor cores: ``depthwise_mma_wgrad``, float16 / bfloat16
NHWC, stride 1 or 2, filters up to 7 rows and 8 columns, FP32 sums, deterministic.

Per channel, dw[r][s] = sum over images n and input rows h of sum over q of dy[n, (h - r + pt) / st, q] .
x[n, h, st q + s - pl] (rows where st divides h - r + pt): for one input row a matrix product D[r][s] +=
A[r][q] B[q][s] with M = r (16, the filter's rows in the first 8), N = s (8), K = q (16-column strips of
the output row). One mma.sync m16n8k16 a (channel, input row, strip), summed into the channel's
accumulator fragment; the CUDA-core forms spend R*S FMAs an output instead (49 at 7x7).

* A (dy rows (h + pt - g) / st for lane group g, columns 2t, 2t + 1, 2t + 8, 2t + 9; zero where st does not
  divide): a ring of the last 8 dy rows of each channel in shared memory, each 16-column strip's 8 words
  stored as 0 4 1 5 2 6 3 7 so that a lane's two words are one 8-byte load. A's rows 8..15 are zero
  registers; rows R..7 read whatever the ring holds (their sums, D's rows R..7, are never stored).
* B (x[h][st (16 j + 2t) + g - pl], the next column's, and the pair 8 columns further): the x row of each
  channel as 32-bit pairs in 2 st arrays, one per (phase f < st, shift u < 2), word k = (X[st (2k + u) + f],
  X[st (2k + u + 1) + f]) with X[i] = x[i - pl] (zero off the row); lane group g reads array (g % st,
  g / st % 2), each pair one aligned load, the arrays 32 / (2 st) banks apart (a load meets no bank twice).
* Staging (NHWC): an image is a stream of rows + R - 1 steps (virtual input rows from h0 - R + 1; the first
  R - 1 bring only dy rows). A step's x and dy rows (W and Q pixels of the block's channels, as in memory)
  arrive by cp.async in one of ``ls`` landing stages, one group a step; at step j, after one barrier: the
  copies of step j + ls, the transposition of step j + 1 (16-byte loads of 8 channels a pixel, byte
  permutes) into its E/O buffer (j + 1) & 1 and the ring, and step j's products. dy row j + 1's ring slot is
  the one lane group 7 reads at step j (D's row 7: unused).

Blocks: (channel group of ``cb``, ``ni`` images, band of ``bh`` input rows); warp w owns the block's
channels w, w + wp, ...; each block writes its channels' partial filter (float32) for its slice (images,
band), and ``slice_sum`` adds the slices in a fixed order. A band's first R - 1 dy rows are read again by
the band before.
CUDA only, compute capability 8.0 and above (mma.sync .f16 / .bf16, cp.async).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from convforge.codegen.dialect import FLOAT32, Kernel, LocalBuf, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.depthwise_wgrad import slice_sum
from convforge.kernels.dgrad import no_epilogue
from convforge.kernels.tensorcore.sm80.depthwise_mma import mma_problem
from convforge.kernels.tensorcore.sm90.cexpr import Let, emit_all
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

HALF = frozenset({"float16", "bfloat16"})
_MMA = {"float16": "MMA_F16_16x8x16", "bfloat16": "MMA_BF16_16x8x16"}
_MAX_SMEM = 227 * 1024
_MAX_R, _MAX_S = 7, 8  # A's rows 0..7 (row 7 is the ring's slot being refilled), B's 8 columns


def _up(n: int, ok: tuple[int, ...]) -> int:
    """The least m >= n with m % 32 in ``ok``."""
    while n % 32 not in ok:
        n += 1
    return n


@dataclass(frozen=True)
class Geo:
    """One parameter set on one layer (module docstring): ``cb`` channels, ``wp`` warps and ``bh``
    input rows a block."""

    spec: ConvSpec
    cb: int
    wp: int
    bh: int
    ni: int = 1  # images a block, one after another into the same sums
    ls: int = 4  # landing stages: rows of x and dy in flight (cp.async)

    @classmethod
    def of(cls, spec: ConvSpec, p: Params) -> Geo:
        return cls(spec, p.cb, p.wp, p.bh, p.get("ni", 1), p.get("ls", 4))

    @property
    def st(self) -> int:
        """The stride (1 or 2, both axes)."""
        return self.spec.stride[0]

    @property
    def pt(self) -> int:
        return self.spec.pad[0]

    @property
    def pl(self) -> int:
        return self.spec.pad[2]

    @property
    def tq(self) -> int:
        """16-column strips of an output row."""
        return cdiv(self.spec.q, 16)

    @property
    def xw(self) -> int:
        """Words of an E (or O) row: pairs up to X[16 tq + 6]."""
        return 8 * self.tq + 4

    @property
    def na(self) -> int:
        """Pair arrays of a channel's x row: (phase, shift) for phase < stride, shift 0 or 1."""
        return 2 * self.st

    @property
    def xo(self) -> int:
        """Words from one pair array to the next: 32 / na banks apart (E and O 16, stride 2's four 8)."""
        return _up(self.xw, (32 // self.na,))

    @property
    def xc(self) -> int:
        """Words a channel's x row takes (odd: the channels' rows start on different banks)."""
        return _up((self.na - 1) * self.xo + self.xw, tuple(range(1, 32, 2)))

    @property
    def xbuf(self) -> int:
        return self.cb * self.xc

    @property
    def dr(self) -> int:
        """Words a dy row of the ring takes: 8 or 24 banks apart, so four rows' 8-byte loads meet no bank twice."""
        return _up(8 * self.tq, (8, 24))

    @property
    def dc(self) -> int:
        """Words a channel's ring takes: 8 rows."""
        return 8 * self.dr

    @property
    def xland(self) -> int:
        """Words of a landing stage's x row (W pixels of the block's channels, as in memory)."""
        return self.spec.w * self.cb // 2

    @property
    def stage(self) -> int:
        """Words of a landing stage: the x row, then the dy row (Q pixels)."""
        return self.xland + self.spec.q * self.cb // 2

    @property
    def smem(self) -> int:
        return 4 * (2 * self.xbuf + self.cb * self.dc + self.ls * self.stage)

    @property
    def threads(self) -> int:
        return 32 * self.wp

    @property
    def min_blocks(self) -> int:
        """The launch bound's blocks an SM: as many as the shared memory holds, within 80 registers a thread
        (named, ptxas allots what the bound allows: without a bound it held stride 2's tiles to 72 registers
        and spilled)."""
        return max(1, min(_MAX_SMEM // max(self.smem, 1), 65536 // (self.threads * 80), 16))

    @property
    def cw(self) -> int:
        """Channels a warp owns."""
        return self.cb // self.wp

    @property
    def octets(self) -> int:
        return self.cb // 8

    @property
    def bands(self) -> int:
        return cdiv(self.spec.h, self.bh)

    @property
    def ngroups(self) -> int:
        return cdiv(self.spec.n, self.ni)

    @property
    def slices(self) -> int:
        return self.ngroups * self.bands

    @property
    def blocks(self) -> int:
        return self.spec.c // self.cb * self.slices

    @property
    def x_items(self) -> int:
        return self.octets * self.xw

    @property
    def y_items(self) -> int:
        return self.octets * 8 * self.tq

    def problem(self) -> str | None:
        """None when the generator takes this tiling, else what is wrong."""
        s = self.spec
        if self.cb < 8 or self.cb % 8 or s.c % self.cb:
            return f"cb ({self.cb}) must be a multiple of 8 that divides the channels ({s.c})"
        if not 1 <= self.wp <= 16 or self.cb % self.wp or self.cw > 4:
            return f"wp ({self.wp}) must be 1..16, divide cb ({self.cb}) and leave at most 4 channels a warp"
        if self.bh < 1 or self.ni < 1 or self.ls < 2:
            return f"bh ({self.bh}) and ni ({self.ni}) must be >= 1, ls ({self.ls}) >= 2"
        if self.smem > _MAX_SMEM:
            return f"{self.smem} bytes of shared memory is over {_MAX_SMEM}"
        return None

    # -- index arithmetic (C expressions; tests/test_depthwise_mma_wgrad.py evaluates the same strings) --
    def head_lets(self) -> tuple[Let, ...]:
        """Block bid: band fastest, then image group, then channel group; its rows h0 .. h0 + rows - 1 of
        images n0 .. n0 + ni - 1 (those below N)."""
        b, ng = self.bands, self.ngroups
        return (Let("band", f"bid % {b}"), Let("ng", f"bid / {b} % {ng}"), Let("c0", f"bid / {b * ng} * {self.cb}"),
                Let("h0", f"band * {self.bh}"), Let("rows", f"min({self.bh}, {self.spec.h} - h0)"),
                Let("n0", f"ng * {self.ni}"), Let("slice", f"ng * {b} + band"))

    def step_lets(self) -> tuple[Let, ...]:
        """Step j of an image's stream: virtual input row sv (from h0 - R + 1); it brings x row sv where sx
        (sv >= h0: the rows whose products run) and dy row spy where sy (st divides sv + pt; rows off
        the layer land as zeros: syok false)."""
        st, big = self.st, 16 * self.st
        return (Let("sv", f"h0 - {self.spec.r - 1} + j"), Let("sx", "sv >= h0"),
                Let("sy", f"(sv + {self.pt + big}) % {st} == 0" if st > 1 else "1"),
                Let("spy", f"(sv + {self.pt + big}) / {st} - 16"),
                Let("syok", f"spy >= 0 && spy < {self.spec.p}"))

    def xcopy_lets(self) -> tuple[Let, ...]:
        """x copy e of a step: pixel cv, octet co of the block's channels; from x[csrc], 16 bytes to word cd of
        the stage."""
        s, o = self.spec, self.octets
        return (Let("cv", f"e / {o}"), Let("co", f"e % {o}"),
                Let("csrc", f"((n * {s.h} + sv) * {s.w} + cv) * {s.c} + c0 + 8 * co"),
                Let("cd", f"cv * {self.cb // 2} + 4 * co"))

    def ycopy_lets(self) -> tuple[Let, ...]:
        """dy copy e of a step: column cq, octet co; from dy[csrc] (zeros where not syok) to word cd."""
        s, o = self.spec, self.octets
        return (Let("cq", f"e / {o}"), Let("co", f"e % {o}"),
                Let("csrc", f"((n * {s.p} + spy) * {s.q} + cq) * {s.c} + c0 + 8 * co"),
                Let("cd", f"{self.xland} + cq * {self.cb // 2} + 4 * co"))

    def x_lets(self) -> tuple[Let, ...]:
        """x item e of a step: octet xoc of the block's channels, pair word xk; pixels xv + v, v < 3 st (read
        where in the row, at stage word xl + v cb / 2); its word of array 0 for channel 8 xoc at xd (array a:
        + a xo)."""
        half = self.cb // 2
        return (Let("xoc", f"e % {self.octets}"), Let("xk", f"e / {self.octets}"),
                Let("xv", f"{2 * self.st} * xk - {self.pl}"), Let("xl", f"xv * {half} + 4 * xoc"),
                Let("xd", f"8 * xoc * {self.xc} + xk"))

    def x_ok(self, v: int) -> str:
        """Whether pixel xv + v of the row exists."""
        return f"xv + {v} >= 0 && xv + {v} < {self.spec.w}"

    def y_lets(self) -> tuple[Let, ...]:
        """dy item e of a step: octet yoc, word yw (columns 2 yw, 2 yw + 1 at stage word yl and yl + cb / 2;
        read where yok0 / yok1); its word for channel 8 yoc at yd in the ring (slot spy mod 8, strip order
        0 4 1 5 2 6 3 7)."""
        s = self.spec
        return (Let("yoc", f"e % {self.octets}"), Let("yw", f"e / {self.octets}"),
                Let("yok0", f"2 * yw < {s.q}"), Let("yok1", f"2 * yw + 1 < {s.q}"),
                Let("yl", f"{self.xland} + 2 * yw * {self.cb // 2} + 4 * yoc"),
                Let("yd", f"8 * yoc * {self.dc} + ((spy + 8) & 7) * {self.dr} "
                          "+ yw / 8 * 8 + 2 * (yw % 4) + yw % 8 / 4"))

    def lane_lets(self) -> tuple[Let, ...]:
        """Lane (g, t)'s word offsets for input row h: A (ring slot of dy row (h + pt - g) / st, zero where st
        does not divide it (aok); strip j at + 8 j, its two words one load) and B (array (phase g % st, shift
        g / st % 2); strip j at + 8 j, b1 at + 4)."""
        st = self.st
        return (Let("aok", f"(h + {self.pt + 16} - g) % {st} == 0" if st > 1 else "1"),
                Let("aw", f"((h + {self.pt + 16} - g) / {st} & 7) * {self.dr} + 2 * t"),
                Let("bw", f"((g % {st}) * 2 + g / {st} % 2) * {self.xo} + t + g / {2 * st}"))

    def pair(self, a: int) -> tuple[int, int]:
        """The pixels (offsets from xv) of array a's word: (phase, shift) = (a / 2, a % 2)."""
        lo = self.st * (a % 2) + a // 2
        return lo, lo + self.st

    def store_lets(self) -> tuple[Let, ...]:
        """Lane (g, t)'s sums k (0, 1: D[g][2t + k]) of the warp's channel cl: whether a tap (sok) and its
        element of the slice's partial filter (sd)."""
        s = self.spec
        return (Let("sok", f"g < {s.r} && 2 * t + k < {s.s}"),
                Let("sd", f"((slice * {s.c} + c0 + cl) * {s.r} + g) * {s.s} + 2 * t + k"))


# -- the kernel ------------------------------------------------------------------------------------
def kernel(name: str, geo: Geo) -> Kernel:
    """The block's images one after another (:func:`_image`) into the same sums, then its channels' partial
    filters of the slice."""
    s, sto = geo.spec, Storage(geo.spec.dtype)
    code = Code()
    code("const int tid = LOCAL_ID(0), warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;",
         "const int bid = GROUP_ID(0);")
    emit_all(code, geo.head_lets())
    code("unsigned* const xsm = (unsigned*)cf_smem;", f"unsigned* const ysm = xsm + {2 * geo.xbuf};",
         f"unsigned* const land = ysm + {geo.cb * geo.dc};",
         "const unsigned land_u32 = SMEM_U32(land);",
         f"const int steps = rows + {s.r - 1};  // virtual input rows h0 - R + 1 .. h0 + rows - 1")
    code("float " + ", ".join(f"d{c}_{k} = 0.0f" for c in range(geo.cw) for k in range(4)) + ";")
    with code.block(f"for (int n = n0; n < min(n0 + {geo.ni}, {s.n}); ++n)"):
        _image(code, geo)
    for c in range(geo.cw):
        with code.block(""):
            code(f"const int cl = warp + {geo.wp * c};")
            for k in range(2):
                with code.block(""):
                    code(f"const int k = {k};")
                    emit_all(code, geo.store_lets())
                    code(f"if (sok) part[sd] = d{c}_{k};")
    args = (sto.buf("x"), sto.buf("y"), FLOAT32.buf("part", readonly=False), LocalBuf("cf_smem", geo.smem))
    comment = (f"depthwise_mma_wgrad: {s.short()} cb={geo.cb} wp={geo.wp} bh={geo.bh} ni={geo.ni} ls={geo.ls}; "
               f"{geo.tq} strips a row, {geo.slices} slices, {geo.smem} shared bytes")
    return Kernel(name, args, code.text(), (geo.threads, 1, 1), frozenset({"mma_tf32"}), comment=comment,
                  min_blocks=geo.min_blocks)


def _image(code: Code, geo: Geo) -> None:
    """Image n of the block as a stream of steps (Geo.step_lets): the copies of ls steps in flight
    (cp.async, one group a step), and at step j, after one barrier: the copies of step j + ls, step j + 1
    from its landing stage into the E/O arrays and the ring, step j's products."""
    for k in range(geo.ls):
        with code.block(f"if ({k} < steps)"):
            code(f"const int j = {k};")
            _copies(code, geo, k)
        code("CP_ASYNC_COMMIT();")
    code(f"CP_ASYNC_WAIT({geo.ls - 1});", "BARRIER();")
    with code.block(""):
        code("const int j = 0;")
        _transpose(code, geo, "0")
    with code.block("for (int j = 0; j < steps; ++j)"):
        code(f"CP_ASYNC_WAIT({geo.ls - 2});", "BARRIER();")
        with code.block(f"if (j + {geo.ls} < steps)"):
            with code.block(""):
                code(f"const int j_ = j + {geo.ls};")
                _copies(code, geo, "j_", f"(j_ % {geo.ls})")
        code("CP_ASYNC_COMMIT();")
        with code.block("if (j + 1 < steps)"):
            code("const int j1 = j + 1;")
            _transpose(code, geo, "j1")
        emit_all(code, geo.step_lets())
        with code.block("if (sx)"):
            code("const int h = sv;")
            _products(code, geo, geo.spec.dtype)
    code("BARRIER();  // the next image's copies reuse the stages and arrays")


def _copies(code: Code, geo: Geo, j: int | str, slot: str | None = None) -> None:
    """Step ``j``'s cp.async copies into landing stage ``slot`` (default j): its x row's pixels where sx, its
    dy row's where sy (16 bytes of zeros where the row is off the layer)."""
    s = geo.spec
    base = f"land_u32 + {4 * geo.stage}u * {slot if slot is not None else j}"
    with code.block(""):
        if isinstance(j, str) and j != "j":
            code(f"const int j = {j};")
        emit_all(code, geo.step_lets())
        with code.block("if (sx)"):
            with _items(code, s.w * geo.octets, geo.threads):
                emit_all(code, geo.xcopy_lets())
                code(f"CP_ASYNC16({base} + 4u * cd, (const float*)(x + csrc));")
        with code.block("if (sy)"):
            with _items(code, s.q * geo.octets, geo.threads):
                emit_all(code, geo.ycopy_lets())
                code(f"CP_ASYNC16({base} + 4u * cd, (const float*)(syok ? y + csrc : y), syok ? 16u : 0u);")


@contextmanager
def _items(code: Code, count: int, threads: int) -> Iterator[Code]:
    """A thread's items ``e`` = tid + u * threads of a step's ``count`` (u < ceil(count / threads)), as a loop of
    known trip count that unrolls (a run-time loop over one or two items cost its bookkeeping every step),
    ``e < count`` checked where the threads do not divide the items."""
    trips = cdiv(count, threads)
    if trips > 1:
        code("#pragma unroll")
    with code.block(f"for (int u = 0; u < {trips}; ++u)" if trips > 1 else ""):
        code(f"const int e = tid + u * {threads};" if trips > 1 else "const int e = tid;")
        if count % threads:
            with code.block(f"if (e < {count})"):
                yield code
        else:
            yield code


def _perm(lo: str, hi: str, i: int) -> str:
    """The word (channel i of the 8 in uint4 ``lo``, the same of ``hi``)."""
    word = f".{'xyzw'[i // 2]}"
    return f"__byte_perm({lo}{word}, {hi}{word}, {'0x7632' if i & 1 else '0x5410'})"


def _transpose(code: Code, geo: Geo, j: str) -> None:
    """Step ``j`` from its landing stage: x items into the E/O arrays of buffer j & 1 (where sx), dy items
    into the ring (where sy)."""
    zero = "make_uint4(0u, 0u, 0u, 0u)"
    with code.block(""):
        if j != "j":
            code(f"const int j = {j};")
        emit_all(code, geo.step_lets())
        code(f"const unsigned* const ls_ = land + (j % {geo.ls}) * {geo.stage};",
             f"unsigned* const xb = xsm + (j & 1) * {geo.xbuf};")
        with code.block("if (sx)"):
            with _items(code, geo.x_items, geo.threads):
                emit_all(code, geo.x_lets())
                half = geo.cb // 2
                for v in range(3 * geo.st):
                    code(f"const uint4 xp{v} = ({geo.x_ok(v)}) ? *(const uint4*)(ls_ + xl + {v * half}) : {zero};")
                for i in range(8):
                    for a in range(geo.na):
                        lo, hi = geo.pair(a)
                        code(f"xb[xd + {i * geo.xc + a * geo.xo}] = {_perm(f'xp{lo}', f'xp{hi}', i)};")
        with code.block("if (sy)"):
            with _items(code, geo.y_items, geo.threads):
                emit_all(code, geo.y_lets())
                code(f"const uint4 ya = yok0 ? *(const uint4*)(ls_ + yl) : {zero};",
                     f"const uint4 yb = yok1 ? *(const uint4*)(ls_ + yl + {geo.cb // 2}) : {zero};")
                for i in range(8):
                    code(f"ysm[yd + {i * geo.dc}] = {_perm('ya', 'yb', i)};")


def _products(code: Code, geo: Geo, dtype: str) -> None:
    """Input row h's products (buffer j & 1): for each of the warp's channels and each strip, one mma."""
    emit_all(code, geo.lane_lets())
    code(f"const unsigned* const xr = xsm + (j & 1) * {geo.xbuf} + bw;", "const unsigned* const yr = ysm + aw;")
    for c in range(geo.cw):
        code(f"const int ch{c} = warp + {geo.wp * c};")
        for j in range(geo.tq):
            a = f"a{c}_{j}"
            load = f"*(const uint2*)(yr + ch{c} * {geo.dc} + {8 * j})"
            code(f"const uint2 {a} = {load if geo.st == 1 else f'aok ? {load} : make_uint2(0u, 0u)'};",
                 f"const unsigned b{c}_{j}0 = xr[ch{c} * {geo.xc} + {8 * j}], "
                 f"b{c}_{j}1 = xr[ch{c} * {geo.xc} + {8 * j + 4}];")
            d = ", ".join(f"d{c}_{k}" for k in range(4))
            code(f"{_MMA[dtype]}({d}, {a}.x, 0u, {a}.y, 0u, b{c}_{j}0, b{c}_{j}1);")


# -- parameters ------------------------------------------------------------------------------------
def _candidates(spec: ConvSpec) -> list[Geo]:
    out = []
    for cb in (16, 8, 32):
        for wp in (4, 8, 2):
            for bh in sorted({cdiv(spec.h, k) for k in range(1, 9)}, reverse=True):
                geo = Geo(spec, cb, wp, bh)
                if geo.problem() is None:
                    out.append(geo)
    return out


def default_geo(spec: ConvSpec, device: DeviceInfo) -> Geo | None:
    """16 channels a block (8 where 16 does not divide C, or where 16 do not fit; 32 last) in 4 warps (8 for
    32 channels), 4 landing stages (3, then 2, where shared memory is short: wide planes); whole planes
    a block unless that leaves under 2 blocks an SM, then the longest band that reaches it (a band re-reads
    R - 1 dy rows and runs R - 1 steps without products). The H200 sweep of 2026-12-02 on ConvNeXt's 7x7
    layers at N32: 96@56 37 us in bands of 28 rows (384 blocks), 43 us in 16, 54 us whole (192 blocks);
    192@28 and 384@14 whole planes, as fast as any band. None: nothing fits."""
    bands = sorted({cdiv(spec.h, k) for k in range(1, 9)}, reverse=True)  # even bands, longest first
    want = 2 * max(device.units, 1)
    for ls in (4, 3, 2):
        for cb in (16, 8, 32):
            fit = [g for g in (Geo(spec, cb, max(4, cb // 4), bh, ls=ls) for bh in bands) if g.problem() is None]
            if fit:
                return next((g for g in fit if g.blocks >= want), fit[-1])
    return None


def _params(geo: Geo) -> Params:
    """The parameters naming ``geo`` (ni only where not 1)."""
    return Params({"cb": geo.cb, "wp": geo.wp, "bh": geo.bh, "ls": geo.ls, **({"ni": geo.ni} if geo.ni > 1 else {})})


class DepthwiseMmaWgrad(Variant):
    """wgrad of a depthwise layer with one output channel a channel, stride 1 or 2, no dilation, filters
    up to 7 x 8, float16 / bfloat16 NHWC, C a multiple of 8, on mma.sync tensor cores (module docstring)."""

    name = "depthwise_mma_wgrad"
    family = "depthwise"
    passes = frozenset({"wgrad"})
    backends = frozenset({"cuda"})
    grouped = True
    exact = True
    tolerance = 1e-5
    specialised = 21
    space_lead = 1
    dtypes = HALF
    layouts = frozenset({"nhwc"})
    tensor_cores = True

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why:
            return why
        if spec.stride not in ((1, 1), (2, 2)) or spec.dilation != (1, 1):
            return "stride 1 or 2 (both axes) and no dilation only (x's row in pair arrays of each phase)"
        if spec.r > _MAX_R or spec.s > _MAX_S:
            return f"filters of at most {_MAX_R} rows and {_MAX_S} columns (one mma's rows and columns)"
        if spec.c % 8:
            return f"C ({spec.c}) must be a multiple of 8 (16-byte loads of 8 channels a pixel)"
        why = mma_problem(spec, device)
        if why:
            return why
        if default_geo(spec, device) is None:
            return "no tiling fits in shared memory (the x and dy rows of 8 channels, 2 landing stages)"
        return None

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Above ``depthwise_wgrad`` on 5x5 to 7x7 filters at stride 1 on planes of 14 rows and more
        (H200, FP16 NHWC, 2026-12-02, unrolled staging: ConvNeXt's 7x7 96@56, 192@28, 384@14 1.2-2.3x faster,
        EfficientNet's 5x5 480@14 1.35x, 240@28 and MobileNet-v3's 120@28 within 2 %); below it elsewhere,
        where a step's fixed cost (a barrier, the staging of a row) outweighs its products (3x3, stride 2,
        7-row planes)."""
        return self.specialised if spec.r * spec.s >= 25 and spec.stride == (1, 1) and spec.p >= 14 else 0

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        geo = default_geo(spec, device)
        if geo is None:
            raise ValueError(f"{self.name}: no tiling fits {spec.short()}")
        return _params(geo)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The default; it with 2, 3 and 6 landing stages; then every tiling (channels a block, warps, bands)
        with 1, 2 and 4 images a block."""
        first = self.default(spec, device)
        out = [first]
        out += [first.replace(ls=k) for k in (2, 3, 6)]
        for geo in _candidates(spec):
            for ni in (1, 2, 4):
                p = _params(dataclasses.replace(geo, ni=ni))
                if ni <= spec.n and p not in out:
                    out.append(p)
        return out

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 4 * Geo.of(spec, params).slices * spec.k * spec.r * spec.s

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        geo = Geo.of(spec, params)
        why = geo.problem()
        if why:
            raise ValueError(f"{self.name}: {why}")
        name = "wgrad_depthwise_mma"
        k = kernel(name, geo)
        total, sto = geo.slices * spec.k * spec.r * spec.s, Storage(spec.dtype)
        sum_k, sum_launch = slice_sum(spec, geo.slices, sto)
        steps = (Launch(name, (geo.blocks, 1, 1), k.block, ("x", "y", "part")), sum_launch)
        return Plan(self.name, self.family, spec, params, (k, sum_k), steps, (("part", 4 * total),),
                    tolerance=self.tolerance, epilogue=epilogue)


register(DepthwiseMmaWgrad())
