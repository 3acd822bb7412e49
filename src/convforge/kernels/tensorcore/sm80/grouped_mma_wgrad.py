"""wgrad of narrow grouped layers on tensor cores: ``wgrad_grouped_mma``, float16 / bfloat16 NHWC, groups
of 2, 4, 8, 16, 24 or 32 channels in and out (ResNeXt's, RegNet's), stride 1 or 2, filters up to 25 taps,
FP32 sums, deterministic.

dw[k, c, r, s] = sum over the output pixels of dy[pixel, k] . x[pixel's input at tap (r, s), c]: a product
with M = (tap, input channel), N = output channel, K = pixels, one mma.sync m16n8k16 a (two taps, 8 input
channels) x (8 output channels) x (16 pixels). Both operands come straight from NHWC tiles by ``ldmatrix
.trans``: a pixel's 8 channels are one 16-byte row, and lanes give any row's address, so the 16 pixels of
a product are any 16 (consecutive in the block's band, wrapping rows) and a tap is a constant offset.

* Tiles: a block's ``cb`` channels as ``cb / 8`` planes of 16-byte pixels (an octet of channels each): x's
  band of input rows with its zero halo (stride 2: each row's even and odd columns apart, so that a warp's
  8 consecutive outputs read 8 consecutive pixels at any tap), dy's band of output pixels (zero past it).
  Planes are 2 units (32 bytes) past a multiple of 128 bytes apart: a cp.async round of 8 lanes (two pixels
  of four octets) meets no bank twice. One 16-byte zero row stands for pixels past the band.
* Products: an octet pair (a of x, b of dy) of one group (groups of 2 to 8: a = b, only the diagonal
  blocks of the 8 x 8 kept; of 8 og channels: the og x og pairs of its og octets); warp w takes pair w % pairs and every
  (wp / pairs)-th 16-pixel chunk; per chunk one ldmatrix.x2.trans of dy (B) and, per two taps, one
  ldmatrix.x4.trans of x (A: matrices (tap 2i, pixels 0..7), (2i + 1, 0..7), (2i, 8..15), (2i + 1, 8..15)).
* Sums: each warp's fragments through shared memory, the warps of a pair added in a fixed order, one
  partial filter a (images, band) slice; ``slice_sum`` adds the slices in a fixed order.

CUDA only, compute capability 8.0 and above (mma.sync .f16 / .bf16, ldmatrix, cp.async).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from convforge.codegen.dialect import FLOAT32, Kernel, LocalBuf, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.depthwise_wgrad import slice_sum
from convforge.kernels.dgrad import no_epilogue
from convforge.kernels.gemm import too_big
from convforge.kernels.tensorcore.sm90.cexpr import Let, emit_all
from convforge.kernels.tensorcore.sm90.grouped import wide_wgrad_slow
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

HALF = frozenset({"float16", "bfloat16"})
_MMA = {"float16": "MMA_F16_16x8x16", "bfloat16": "MMA_BF16_16x8x16"}
_MAX_SMEM = 227 * 1024
_WANT_SMEM = 113 * 1024  # the default's tile buffers: 2 blocks an SM
_GROUPS = (2, 4, 8, 16, 24, 32)  # channels a group (in and out) the octet pairs serve (at most 16 pairs a block)
_MAX_TAPS = 25


def _spread(units: int) -> int:
    """The least m >= units with m % 8 == 2 (16-byte units: planes 32 bytes past a 128-byte multiple)."""
    return units + (2 - units) % 8


@dataclass(frozen=True)
class Geo:
    """One parameter set on one layer (module docstring): ``cb`` channels, ``wp`` warps, ``bp`` output
    rows and ``ni`` images a block."""

    spec: ConvSpec
    cb: int
    wp: int
    bp: int
    ni: int = 1

    @classmethod
    def of(cls, spec: ConvSpec, p: Params) -> Geo:
        return cls(spec, p.cb, p.wp, p.bp, p.get("ni", 1))

    @property
    def st(self) -> int:
        return self.spec.stride[0]

    @property
    def taps(self) -> int:
        return self.spec.r * self.spec.s

    @property
    def tp(self) -> int:
        """Tap pairs: one A fragment (two 8-row halves) each."""
        return cdiv(self.taps, 2)

    @property
    def octets(self) -> int:
        return self.cb // 8

    @property
    def og(self) -> int:
        """Octets a group spans (1 for groups of up to 8 channels, which share an octet)."""
        return max(1, self.spec.cg // 8)

    @property
    def pairs(self) -> int:
        """(x octet, dy octet) pairs of one group's: the octets (groups of 2 to 8), og x og a wider group."""
        return self.octets * self.og

    @property
    def reps(self) -> int:
        """Warps a pair: each takes every reps-th pixel chunk."""
        return self.wp // self.pairs

    @property
    def wt(self) -> int:
        """Input columns of the x tile: the outputs' windows with the halo."""
        return (self.spec.q - 1) * self.st + self.spec.s

    @property
    def hw(self) -> int:
        """Units of one column phase of a tile row (stride 2: even columns, then odd)."""
        return cdiv(self.wt, self.st)

    @property
    def rowlen(self) -> int:
        return self.st * self.hw

    @property
    def ht(self) -> int:
        """Input rows of the x tile."""
        return (self.bp - 1) * self.st + self.spec.r

    @property
    def xplane(self) -> int:
        return _spread(self.ht * self.rowlen)

    @property
    def chunks(self) -> int:
        """16-pixel chunks of a full band."""
        return cdiv(self.bp * self.spec.q, 16)

    @property
    def dplane(self) -> int:
        return _spread(16 * self.chunks)

    @property
    def yoff(self) -> int:
        """Unit of dy's first plane in a tile buffer (after the x planes)."""
        return self.octets * self.xplane

    @property
    def tile(self) -> int:
        """Units of one tile buffer (x's planes, then dy's)."""
        return self.yoff + self.octets * self.dplane

    @property
    def nbuf(self) -> int:
        """Tile buffers: two where a block takes several images (the next one's copies fly during this
        one's products)."""
        return 2 if self.ni > 1 else 1

    @property
    def zrow(self) -> int:
        """Unit of the zero row (after the buffers)."""
        return self.nbuf * self.tile

    @property
    def red(self) -> int:
        """Bytes of the warps' fragments in the fixed-order sum."""
        return 4 * self.wp * self.tp * 4 * 32

    @property
    def smem(self) -> int:
        return max(16 * (self.zrow + 1), self.red)

    @property
    def threads(self) -> int:
        return 32 * self.wp

    @property
    def bands(self) -> int:
        return cdiv(self.spec.p, self.bp)

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
    def partials(self) -> int:
        """Floats of the slices' partial filters (32-bit offsets: ``too_big`` refuses more)."""
        return self.slices * self.spec.k * self.spec.cg * self.taps

    @property
    def min_blocks(self) -> int:
        return max(1, min(_MAX_SMEM // max(self.smem, 1), 65536 // (self.threads * 80), 8))

    def problem(self) -> str | None:
        """None when the generator takes this tiling, else what is wrong."""
        s = self.spec
        step = max(8, s.cg)
        if self.cb < step or self.cb % step or s.c % self.cb:
            return f"cb ({self.cb}) must be a multiple of {step} that divides the channels ({s.c})"
        if not 1 <= self.wp <= 16 or self.wp % self.pairs:
            return f"wp ({self.wp}) must be 1..16 and a multiple of the block's {self.pairs} octet pairs"
        if self.bp < 1 or self.ni < 1:
            return f"bp ({self.bp}) and ni ({self.ni}) must be >= 1"
        if self.smem > _MAX_SMEM:
            return f"{self.smem} bytes of shared memory is over {_MAX_SMEM}"
        return None

    # -- index arithmetic (C expressions; tests/test_grouped_mma_wgrad.py evaluates the same strings) --
    def head_lets(self) -> tuple[Let, ...]:
        """Block bid: band fastest, then image group, then channel block; output rows p0 .. p0 + rows - 1."""
        b, ng = self.bands, self.ngroups
        return (Let("band", f"bid % {b}"), Let("ng", f"bid / {b} % {ng}"), Let("c0", f"bid / {b * ng} * {self.cb}"),
                Let("p0", f"band * {self.bp}"), Let("rows", f"min({self.bp}, {self.spec.p} - p0)"),
                Let("npx", f"rows * {self.spec.q}"), Let("n0", f"ng * {self.ni}"), Let("slice", f"ng * {b} + band"))

    def xcopy_lets(self) -> tuple[Let, ...]:
        """x copy e of image n: tile pixel (xr, xc), octet co; from x[csrc] where cok (else 16 zero bytes) to
        unit cd."""
        s, o = self.spec, self.octets
        return (Let("co", f"e % {o}"), Let("xv", f"e / {o}"), Let("xr", f"xv / {self.wt}"),
                Let("xc", f"xv % {self.wt}"),
                Let("ih", f"p0 * {self.st} - {s.pad[0]} + xr"), Let("iw", f"xc - {s.pad[2]}"),
                Let("cok", f"ih >= 0 && ih < {s.h} && iw >= 0 && iw < {s.w}"),
                Let("csrc", f"cok * (((n * {s.h} + ih) * {s.w} + iw) * {s.c} + c0 + 8 * co)"),
                Let("cd", f"bsel * {self.tile} + co * {self.xplane} + xr * {self.rowlen} + xc % {self.st} * {self.hw} "
                          f"+ xc / {self.st}"))

    @property
    def x_items(self) -> int:
        return self.octets * self.ht * self.wt

    def ycopy_lets(self) -> tuple[Let, ...]:
        """dy copy e: band pixel yv, octet co; from dy[csrc] where yv < npx (else zeros) to unit cd."""
        s, o = self.spec, self.octets
        return (Let("co", f"e % {o}"), Let("yv", f"e / {o}"), Let("cok", "yv < npx"),
                Let("csrc", f"cok * (((n * {s.p} + p0) * {s.q} + yv) * {s.c} + c0 + 8 * co)"),
                Let("cd", f"bsel * {self.tile} + {self.yoff} + co * {self.dplane} + yv"))

    @property
    def y_items(self) -> int:
        return self.octets * 16 * self.chunks

    def warp_lets(self) -> tuple[Let, ...]:
        """Warp w's pair (x octet xa, dy octet yb) and rank wr among the pair's warps; lane's ldmatrix row:
        matrix lm, its row lr, tap parity lpar, pixel offset lk in a chunk (A) and lb (B, lanes 0..15)."""
        og = self.og
        pair = (Let("pi", f"warp % {self.pairs}"), Let("xa", f"pi / {og * og} * {og} + pi / {og} % {og}"),
                Let("yb", f"pi / {og * og} * {og} + pi % {og}"))
        return pair + (Let("wr", f"warp / {self.pairs}"), Let("lm", "lane >> 3"), Let("lr", "lane & 7"),
                       Let("lpar", "lm & 1"), Let("lk", "lr + 8 * (lm >> 1)"), Let("lb", "lr + 8 * (lm & 1)"))

    def tap_unit(self, tap: int) -> int:
        """Units from an output pixel's tile position to its input at tap ``tap``."""
        r, c = divmod(tap, self.spec.s)
        return r * self.rowlen + c % self.st * self.hw + c // self.st

    def tap_lets(self) -> tuple[Let, ...]:
        """Lane's offset (units) of tap pair i: tap 2 i + lpar (the last tap past the filter's end)."""
        last = self.taps - 1
        return tuple(Let(f"to{i}", f"{self.tap_unit(2 * i)} + lpar * "
                                   f"({self.tap_unit(min(2 * i + 1, last)) - self.tap_unit(2 * i)})")
                     for i in range(self.tp))

    def chunk_lets(self) -> tuple[Let, ...]:
        """Chunk kc: the lane's A pixel ak (in the band where kin: output row apr, column aq; its tile unit xb)
        and B unit yu."""
        q, st = self.spec.q, self.st
        return (Let("ak", "kc * 16 + lk"), Let("kin", "ak < npx"), Let("apr", f"ak / {q}"), Let("aq", f"ak % {q}"),
                Let("xb", f"bsel * {self.tile} + xa * {self.xplane} + apr * {st * self.rowlen} + aq"),
                Let("yu", f"bsel * {self.tile} + {self.yoff} + yb * {self.dplane} + kc * 16 + lb"))

    def sum_lets(self) -> tuple[Let, ...]:
        """Sum e of the block (pair spi, tap pair si, fragment word sj, lane sl): its first fragment's float
        (warp spi, rank 0) at rd, later ranks + rs; the element (tap stap, octet channels sm / sn) and
        whether it is kept (sok: a tap, one group) at sd of the slice's partial filter."""
        s, per = self.spec, self.tp * 128
        og = self.og
        pair = (Let("sxa", f"spi / {og * og} * {og} + spi / {og} % {og}"),
                Let("syb", f"spi / {og * og} * {og} + spi % {og}"))
        return (Let("spi", f"e / {per}"), Let("si", f"e / 128 % {self.tp}"), Let("sj", "e / 32 % 4"),
                Let("sl", "e % 32")) + pair + (
            Let("rd", f"((spi * {self.tp} + si) * 4 + sj) * 32 + sl"),
            Let("sm", "(sl >> 2) + 8 * (sj >> 1)"), Let("sn", "2 * (sl & 3) + (sj & 1)"),
            Let("stap", "2 * si + (sm >> 3)"), Let("sc", "8 * sxa + (sm & 7)"), Let("sk", "8 * syb + sn"),
            Let("sok", f"stap < {self.taps} && sc / {s.cg} == sk / {s.cg}"),
            Let("sd", f"((slice * {s.k} + c0 + sk) * {s.cg} + sc % {s.cg}) * {self.taps} + stap"))

    @property
    def rs(self) -> int:
        """Floats from one rank's fragments to the next's."""
        return self.pairs * self.tp * 128


# -- the kernel ------------------------------------------------------------------------------------
def kernel(name: str, geo: Geo) -> Kernel:
    """The block's images one after another (copies, one barrier, products) into the same fragments, then
    the fixed-order sum of the warps of each pair and the slice's partial filter."""
    s, sto = geo.spec, Storage(geo.spec.dtype)
    code = Code()
    code("const int tid = LOCAL_ID(0), warp = tid >> 5, lane = tid & 31;", "const int bid = GROUP_ID(0);")
    emit_all(code, geo.head_lets())
    emit_all(code, geo.warp_lets())
    emit_all(code, geo.tap_lets())
    code("const unsigned sm0 = SMEM_U32(cf_smem);",
         f"if (tid == 0) *(uint4*)((char*)cf_smem + {16 * geo.zrow}) = make_uint4(0u, 0u, 0u, 0u);  // the zero row",
         "float " + ", ".join(f"d{i}_{j} = 0.0f" for i in range(geo.tp) for j in range(4)) + ";")
    code(f"const int nend = min(n0 + {geo.ni}, {s.n});")
    with code.block(""):
        code("const int n = n0, bsel = 0;")
        _copies(code, geo)
    with code.block("for (int n = n0; n < nend; ++n)"):
        code(f"const int bsel = (n - n0) % {geo.nbuf};")
        if geo.nbuf > 1:
            with code.block("if (n + 1 < nend)"):
                with code.block(""):
                    code("const int n_ = n + 1, bsel_ = (n_ - n0) % 2;")
                    with code.block(""):
                        code("const int n = n_, bsel = bsel_;")
                        _copies(code, geo)
                code("CP_ASYNC_WAIT(1);")
            code("else CP_ASYNC_WAIT(0);")
        else:
            code("CP_ASYNC_WAIT(0);")
        code("BARRIER();")
        with code.block(f"for (int kc = wr; kc * 16 < npx; kc += {geo.reps})"):
            _products(code, geo)
        code("BARRIER();  // the next copies (or the sums) reuse this buffer")
        if geo.nbuf == 1:
            with code.block("if (n + 1 < nend)"):
                code("const int n_ = n + 1;")
                with code.block(""):
                    code("const int n = n_;")
                    _copies(code, geo)
    _sums(code, geo)
    args = (sto.buf("x"), sto.buf("y"), FLOAT32.buf("part", readonly=False), LocalBuf("cf_smem", geo.smem))
    comment = (f"wgrad_grouped_mma: {s.short()} cb={geo.cb} wp={geo.wp} bp={geo.bp} ni={geo.ni}; {geo.pairs} "
               f"octet pairs x {geo.reps} warps, {geo.tp} tap pairs, {geo.slices} slices, {geo.smem} shared bytes")
    return Kernel(name, args, code.text(), (geo.threads, 1, 1), frozenset({"mma_tf32"}), comment=comment,
                  min_blocks=geo.min_blocks)


def _copies(code: Code, geo: Geo) -> None:
    """Image n's x and dy tiles into buffer bsel by cp.async, one group."""
    with _items(code, geo.x_items, geo.threads):
        emit_all(code, geo.xcopy_lets())
        code("CP_ASYNC16(sm0 + 16u * cd, (const float*)(x + csrc), cok ? 16u : 0u);")
    with _items(code, geo.y_items, geo.threads):
        emit_all(code, geo.ycopy_lets())
        code("CP_ASYNC16(sm0 + 16u * cd, (const float*)(y + csrc), cok ? 16u : 0u);")
    code("CP_ASYNC_COMMIT();")


@contextmanager
def _items(code: Code, count: int, threads: int) -> Iterator[Code]:
    """A thread's items ``e`` = tid + u * threads of ``count`` in a loop of known trip count."""
    trips = cdiv(count, threads)
    code("#pragma unroll 1" if trips > 4 else "#pragma unroll")
    with code.block(f"for (int u = 0; u < {trips}; ++u)"):
        code(f"const int e = tid + u * {threads};")
        if count % threads:
            with code.block(f"if (e < {count})"):
                yield code
        else:
            yield code


def _products(code: Code, geo: Geo) -> None:
    """Chunk kc of the warp's pair: dy's 16 pixels x 8 channels (B), then per tap pair x's A and one mma."""
    emit_all(code, geo.chunk_lets())
    code("unsigned b0, b1;", "LDSM_T2(b0, b1, sm0 + 16u * yu);")
    mma = _MMA[geo.spec.dtype]
    for i in range(geo.tp):
        code(f"unsigned a{i}_0, a{i}_1, a{i}_2, a{i}_3;",
             f"LDSM_T4(a{i}_0, a{i}_1, a{i}_2, a{i}_3, sm0 + 16u * (kin ? xb + to{i} : {geo.zrow}));")
    for i in range(geo.tp):
        code(f"{mma}(d{i}_0, d{i}_1, d{i}_2, d{i}_3, a{i}_0, a{i}_1, a{i}_2, a{i}_3, b0, b1);")


def _sums(code: Code, geo: Geo) -> None:
    """Every warp's fragments to shared memory (warp w's at w * tp * 128), then each kept element summed
    over the pair's warps in rank order into the slice's partial filter."""
    code("float* const red = (float*)cf_smem;")
    for i in range(geo.tp):
        for j in range(4):
            code(f"red[(warp * {geo.tp * 4} + {4 * i + j}) * 32 + lane] = d{i}_{j};")
    code("BARRIER();")
    with _items(code, geo.rs, geo.threads):
        emit_all(code, geo.sum_lets())
        with code.block("if (sok)"):
            code("float v = red[rd];")
            for r in range(1, geo.reps):
                code(f"v += red[rd + {r * geo.rs}];")
            code("part[sd] = v;")


# -- parameters ------------------------------------------------------------------------------------
def _geo(spec: ConvSpec, cb: int, bp: int, ni: int = 1) -> Geo:
    """cb channels in 8 warps (a warp a pair where a wide group has more: 9 at 24 channels, 16 at 32), bp rows."""
    pairs = cb // 8 * max(1, spec.cg // 8)
    return Geo(spec, cb, max(8, pairs), bp, ni)


def _widths(spec: ConvSpec) -> tuple[int, ...]:
    """Channels a block to try, the default's first: 16, 32, 8 (groups of up to 16), one group of 24 or 32."""
    if spec.cg <= 8:
        return (16, 32, 8)
    return (16, 32) if spec.cg == 16 else (spec.cg,)


def default_geo(spec: ConvSpec, device: DeviceInfo) -> Geo | None:
    """16 channels a block (32, then 8 where 16 do not divide C), 8 warps; the longest band that divides the
    output rows and the most images a block (8, 4, 2) whose two tile buffers take at most 113 KiB (2 blocks an
    SM) and that leave a block for every compute unit; else one image a block, the longest band that fits.
    H200 sweep (ResNeXt-50's 5 narrow layers, N32, FP16): more images a block gained 1.1-1.6x over one (the
    partial filters a slice, the next image's copies overlapped); bands that split the rows unevenly
    (10 of 28, 19 of 56) ran 10-25 % behind; 16 channels a block ahead of 32."""
    even = [b for b in range(spec.p, 0, -1) if spec.p % b == 0]
    for cb in _widths(spec):
        for bp in even:
            for ni in (8, 4, 2):
                g = _geo(spec, cb, bp, ni)
                if ni <= spec.n and g.problem() is None and g.smem <= _WANT_SMEM and g.blocks >= max(device.units, 1):
                    return g
    bands = sorted({cdiv(spec.p, k) for k in range(1, spec.p + 1)}, reverse=True)
    for cb in _widths(spec):
        fit = [g for g in (_geo(spec, cb, bp) for bp in bands) if g.problem() is None]
        if fit:
            return next((g for g in fit if g.smem <= _WANT_SMEM), fit[-1])
    return None


def _params(geo: Geo) -> Params:
    return Params({"cb": geo.cb, "wp": geo.wp, "bp": geo.bp, **({"ni": geo.ni} if geo.ni > 1 else {})})


class WgradGroupedMma(Variant):
    """wgrad of a grouped layer of 2 to 32 channels a group (in and out), stride 1 or 2, float16 / bfloat16
    NHWC, on mma.sync tensor cores from NHWC tiles (module docstring)."""

    name = "wgrad_grouped_mma"
    family = "direct"
    passes = frozenset({"wgrad"})
    backends = frozenset({"cuda"})
    grouped = True
    exact = True
    tolerance = 1e-5
    specialised = 22
    dtypes = HALF
    layouts = frozenset({"nhwc"})
    tensor_cores = True

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.groups == 1 or spec.depthwise:
            return "only grouped layers of more than one channel a group (depthwise: depthwise_mma_wgrad)"
        why = super().applies(spec, device) or too_big(spec)
        if why:
            return why
        if spec.cg != spec.kg or spec.cg not in _GROUPS:
            return f"groups of {'/'.join(map(str, _GROUPS))} channels in and out only (here {spec.cg} -> {spec.kg})"
        if spec.stride not in ((1, 1), (2, 2)) or spec.dilation != (1, 1):
            return "stride 1 or 2 (both axes) and no dilation only"
        if spec.r * spec.s > _MAX_TAPS:
            return f"filters of at most {_MAX_TAPS} taps (the fragments a warp holds)"
        if device.backend != "cuda" or not device.cc or device.cc < (8, 0):
            return "mma.sync .f16 / .bf16 and ldmatrix need a CUDA device of compute capability 8.0 or above"
        geo = default_geo(spec, device)
        if geo is None:
            return "no tiling fits in shared memory (a band of one output row)"
        return too_big(spec, geo.partials, "partial filters")

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """First on groups of 2 to 24 channels (H200, ResNeXt-50's groups of 4, 8, 16: 1.1-2.6x cuDNN-best, where
        wgrad_tc_grouped_half ran 0.33-1.0x); below it on groups of 32, where it ran 0.93-2.70x."""
        return self.specialised if spec.cg < 32 else 0

    def slow_on(self, spec: ConvSpec) -> str | None:
        return wide_wgrad_slow(spec)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        geo = default_geo(spec, device)
        if geo is None:
            raise ValueError(f"{self.name}: no tiling fits {spec.short()}")
        return _params(geo)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The default, then channels a block x bands x images a block."""
        out = [self.default(spec, device)]
        for cb in _widths(spec):
            for k in (1, 2, 4, 3, 6, 8):
                for ni in (2, 4, 1, 8):
                    geo = _geo(spec, cb, cdiv(spec.p, k), ni)
                    if geo.problem() is None and ni <= spec.n and _params(geo) not in out:
                        out.append(_params(geo))
        return out

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 4 * Geo.of(spec, params).partials

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        geo = Geo.of(spec, params)
        why = geo.problem() or too_big(spec, geo.partials, "partial filters")
        if why:
            raise ValueError(f"{self.name}: {why}")
        name = "wgrad_grouped_mma"
        k = kernel(name, geo)
        sum_k, sum_launch = slice_sum(spec, geo.slices, Storage(spec.dtype))
        steps = (Launch(name, (geo.blocks, 1, 1), k.block, ("x", "y", "part")), sum_launch)
        return Plan(self.name, self.family, spec, params, (k, sum_k), steps,
                    (("part", self.workspace_bytes(spec, params)),), tolerance=self.tolerance, epilogue=epilogue)


register(WgradGroupedMma())
