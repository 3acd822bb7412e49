"""Depthwise convolution (groups == C, K = m*C): MobileNet's, EfficientNet's and ConvNeXt's 3x3 to
7x7 layers, RepLKNet's and SLaK's large kernels (13x13 to 31x31, 51x5), and their data gradients,
in float32, float16 and bfloat16 storage (FP32 arithmetic), on NCHW and NHWC activations.

Depthwise layers do R*S multiply-adds per output: memory-bound, so the kernels are designed around
DRAM traffic, not FLOPs. A block owns a tile of ``bp*tp`` x ``bq*tq`` outputs of ``bc`` channels of
one image; it reads each input channel's tile plus its halo from DRAM once into shared memory (as
float, whatever the storage), coalesced, every load of a thread issued before the first shared store.
NCHW rows are read as 16-byte vectors where they align (4 floats, 8 halves: ``vec``); where one tile
covers a plane, the block's consecutive planes are read as one span (``fl``), coalesced whatever the
row width, and scattered into the zero-filled padded tiles. NHWC tiles are read channel-vectorised:
16 bytes of consecutive channels of one pixel a load, where the channel count aligns.
Each thread keeps its channel's R*S filter taps in registers and computes ``tp`` x ``tq`` adjacent
outputs, reading each input row segment it needs once from shared memory (as float4 when the segment
starts 16-byte aligned) and reusing it across the output rows and columns it feeds. A channel
multiplier m > 1 reuses the tile for the m outputs of the channel. Blocks are numbered with the output
tiles of a plane fastest, so neighbouring tiles (which share a halo) run together and the halo rows
come from L2. On NHWC the threads of a block are numbered channel fastest, so a warp's stores of one
pixel are one contiguous run, and each channel's shared plane is padded so those lanes read distinct
banks.

Large filters (more than ``REG_TAPS`` taps: register taps would spill) take the *tiled* form: the
block's filters sit in shared memory too, a run-time loop walks the filter rows, each row's S taps
are read once into registers and serve the tp x tq outputs' row segments (S x tq multiply-adds per
S + seg shared reads). Such layers are compute-bound on CUDA cores (961 FMAs an output for 31x31),
so the form aims at FMAs per shared read, not bytes.

The epilogue (bias, residual, ReLU / GELU / SiLU, a channel offset into a concat) is applied on the
store; NCHW rows of 4 or 8 outputs (``tq``) go out as one 16-byte store where they align (8 bytes for
4 halves).

``depthwise_dgrad``: at stride 1 (small filters) the same kernel on dy with the filter rotated by 180
degrees and padding eff - 1 - pad (negative padding crops). At stride > 1 (and for large filters) by
phase: dx pixel (sh*u + a, sw*v + b) gathers dy(u + d, v + e) * w[r, s] over the taps whose window
covers it (r with (a + pad - r*dh) divisible by sh, d the quotient), so a thread owns tp x tq
"super-pixels" of sh x sw dx pixels, reads one dy tile with a halo (stride 1 in super-pixel units) and
never multiplies a zero-stuffed dy. With m > 1 each dx channel sums its m dy planes, one tile after
another. ``depthwise_wgrad`` is in depthwise_wgrad.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from convforge.codegen.dialect import Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs
from convforge.kernels.dgrad import no_epilogue
from convforge.kernels.gemm import too_big
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

_SMEM = 48 * 1024  # static shared memory a block may declare
_LOAD_BATCH = 8  # global loads held in registers before their shared stores
REG_TAPS = 81  # filters of more taps than this (larger than 9x9) take the tiled form (taps in shared memory)
ALL_DTYPES = frozenset({"float32", "float16", "bfloat16"})
# Depthwise.slow_on: half NCHW forwards of filters of at most this many taps on planes of at least this many
# pixels are measured below cuDNN of the dtype; PyTorch runs them
SLOW_NCHW_TAPS, SLOW_NCHW_PLANE = 9, 56 * 56


@dataclass(frozen=True)
class Phases:
    """Strided dgrad by phase (module docstring): ``rows[a]`` lists (r, dy row offset) of the taps
    dx rows of phase a gather, offsets counted from the least of any phase (``lo``) so that they index
    a dy tile from 0; ``cols[b]`` the same along the width; ``win`` the dy rows and columns one
    super-pixel's taps span; ``h`` x ``w`` the dx plane."""

    sh: int
    sw: int
    rows: tuple[tuple[tuple[int, int], ...], ...]
    cols: tuple[tuple[tuple[int, int], ...], ...]
    lo: tuple[int, int]
    win: tuple[int, int]
    h: int
    w: int


def _phase_taps(stride: int, pad: int, taps: int, dil: int) -> tuple[tuple[tuple[tuple[int, int], ...], ...], int, int]:
    """Per phase a < stride, the taps t with (a + pad - t*dil) divisible by stride and their dy
    offsets (a + pad - t*dil) / stride, less the least offset; that least offset and the span."""
    per = [[(t, (a + pad - t * dil) // stride) for t in range(taps) if (a + pad - t * dil) % stride == 0]
           for a in range(stride)]
    ds = [d for ph in per for _, d in ph]
    lo, hi = min(ds), max(ds)
    return tuple(tuple((t, d - lo) for t, d in ph) for ph in per), lo, hi - lo + 1


def phases_of(spec: ConvSpec) -> Phases:
    rows, lo_r, win_r = _phase_taps(spec.stride[0], spec.pad[0], spec.r, spec.dilation[0])
    cols, lo_s, win_s = _phase_taps(spec.stride[1], spec.pad[2], spec.s, spec.dilation[1])
    return Phases(spec.stride[0], spec.stride[1], rows, cols, (lo_r, lo_s), (win_r, win_s), spec.h, spec.w)


@dataclass(frozen=True)
class Stencil:
    """A depthwise problem as the generator sees it: ``groups`` base channels, each a plane of
    ``src`` (hi x wi) feeding planes of ``dst`` (ho x wo) through an R x S filter (rotated when
    ``flip``). fprop: src plane c feeds the m dst planes c*m + j; dgrad (``fan_in``): dst plane c
    sums the m src planes c*m + j. With ``phases`` (strided dgrad) ho x wo count super-pixels of
    the dx plane and the window is the phases' (stride 1, ``pad`` = -lo)."""

    n: int
    groups: int
    mult: int
    fan_in: bool
    hi: int
    wi: int
    ho: int
    wo: int
    r: int
    s: int
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pad_t: int
    pad_l: int
    flip: bool
    src: str
    dst: str
    dst_planes: int  # channels per image of the tensor written (a concat's, at an offset)
    dst_offset: int = 0
    dtype: str = "float32"
    layout: str = "nchw"
    phases: Phases | None = None

    @property
    def src_planes(self) -> int:
        return self.groups * self.mult if self.fan_in else self.groups

    @property
    def eff_r(self) -> int:
        return self.phases.win[0] if self.phases else (self.r - 1) * self.dilation[0] + 1

    @property
    def eff_s(self) -> int:
        return self.phases.win[1] if self.phases else (self.s - 1) * self.dilation[1] + 1

    @property
    def big(self) -> bool:
        """The tiled form: filters in shared memory, a run-time loop over filter rows."""
        return self.r * self.s > REG_TAPS

    @property
    def sto(self) -> Storage:
        return Storage(self.dtype)

    @property
    def nhwc(self) -> bool:
        return self.layout == "nhwc"

    @property
    def out_hw(self) -> tuple[int, int]:
        """The written plane's height and width (dx's for phases, else ho x wo)."""
        return (self.phases.h, self.phases.w) if self.phases else (self.ho, self.wo)

    @property
    def out_step(self) -> tuple[int, int]:
        """Written pixels per output unit along each axis (the phases' strides, else 1)."""
        return (self.phases.sh, self.phases.sw) if self.phases else (1, 1)


def fprop_stencil(spec: ConvSpec, epi: Epilogue = Epilogue()) -> Stencil:
    return Stencil(spec.n, spec.groups, spec.kg, False, spec.h, spec.w, spec.p, spec.q, spec.r, spec.s,
                   spec.stride, spec.dilation, spec.pad[0], spec.pad[2], False, "x", "y",
                   epi.k_total or spec.k, epi.k_offset, spec.dtype, spec.layout)


def dgrad_stencil(spec: ConvSpec) -> Stencil:
    """Stride 1, small filters: dx = dy correlated with the rotated filter at padding eff - 1 - pad.
    Otherwise by phase (:class:`Phases`)."""
    if spec.stride == (1, 1) and spec.r * spec.s <= REG_TAPS:
        return Stencil(spec.n, spec.groups, spec.kg, True, spec.p, spec.q, spec.h, spec.w, spec.r, spec.s,
                       (1, 1), spec.dilation, spec.eff_r - 1 - spec.pad[0], spec.eff_s - 1 - spec.pad[2], True,
                       "y", "x", spec.c, 0, spec.dtype, spec.layout)
    ph = phases_of(spec)
    return Stencil(spec.n, spec.groups, spec.kg, True, spec.p, spec.q, cdiv(spec.h, ph.sh), cdiv(spec.w, ph.sw),
                   spec.r, spec.s, (1, 1), (1, 1), -ph.lo[0], -ph.lo[1], False, "y", "x", spec.c, 0,
                   spec.dtype, spec.layout, ph)


@dataclass(frozen=True)
class Tile:
    """Derived sizes of one parameter set on one stencil."""

    st: Stencil
    bq: int
    bp: int
    bc: int
    tq: int
    tp: int
    vec: bool
    fl: bool = False  # flat loads: the block's whole source planes as one contiguous span (:meth:`flat_ok`)
    cf: bool = False  # NHWC: blocks numbered channel blocks fastest (a pixel's channel chunks read together)

    @classmethod
    def of(cls, st: Stencil, p: Params) -> Tile:
        return cls(st, p.bq, p.bp, p.bc, p.tq, p.tp, bool(p.vec), bool(p.get("fl", 0)), bool(p.get("cf", 0)))

    @property
    def threads(self) -> int:
        return self.bq * self.bp * self.bc

    @property
    def seg(self) -> int:
        """Input columns one thread reads per row."""
        return (self.tq - 1) * self.st.stride[1] + self.st.eff_s

    @property
    def rows(self) -> int:
        """Input rows one thread reads."""
        return (self.tp - 1) * self.st.stride[0] + self.st.eff_r

    @property
    def out_rows(self) -> int:
        """Output rows one thread writes (tp, or tp super-rows of sh dx rows)."""
        return self.tp * self.st.out_step[0]

    @property
    def out_cols(self) -> int:
        return self.tq * self.st.out_step[1]

    @property
    def vread(self) -> bool:
        """Row segments start 16-byte aligned in shared memory: read them as float4."""
        return (self.tq * self.st.stride[1]) % 4 == 0

    @property
    def iw(self) -> int:
        """Shared row length: the block's input columns (rounded to float4s when ``vread``)."""
        seg = -(-self.seg // 4) * 4 if self.vread else self.seg
        return (self.bq - 1) * self.tq * self.st.stride[1] + seg

    @property
    def ih(self) -> int:
        return (self.bp - 1) * self.tp * self.st.stride[0] + self.rows

    @property
    def plane(self) -> int:
        """Floats between two channels' tiles in shared memory: ih * iw on NCHW; on NHWC padded so
        that the lanes of a warp (consecutive channels) read distinct banks: 4 past a multiple of 32
        (float4 reads: 8 lanes a phase) or odd (single floats)."""
        size = self.ih * self.iw
        if not self.st.nhwc:
            return size
        if self.vread:
            return size + (4 - size) % 32
        return size | 1

    @property
    def vw(self) -> int:
        """Elements of one 16-byte NCHW row load: 4 floats, 8 halves (4 where rows of halves align
        to 8 bytes only)."""
        if not self.st.sto.half:
            return 4
        return 8 if self.st.wi % 8 == 0 and (self.bq * self.tq * self.st.stride[1]) % 8 == 0 else 4

    @property
    def vec_ok(self) -> bool:
        """16-byte global loads: rows 16-byte aligned and every tile origin at the same phase."""
        return (not self.st.nhwc and self.st.wi % self.vw == 0
                and (self.bq * self.tq * self.st.stride[1]) % self.vw == 0)

    @property
    def off(self) -> int:
        """Columns between the aligned chunk start and the tile's first input column."""
        return (-self.st.pad_l) % self.vw

    @property
    def chunks(self) -> int:
        """Vector chunks per shared row (vector loads)."""
        return cdiv(self.off + self.iw, self.vw)

    @property
    def flat_ok(self) -> bool:
        """Flat loads apply: one tile covers each output plane (so every block's tile origin is the
        plane's, -pad), the block's source planes are consecutive in memory (NCHW; fprop, or dgrad
        with multiplier 1), rows are not loaded as float4s (vec=0) and the filter is small."""
        nqt, npt, _, _ = self.grid
        return (nqt == 1 and npt == 1 and (not self.st.fan_in or self.st.mult == 1) and not self.vec
                and not self.st.nhwc and not self.st.big)

    @property
    def flat_unit(self) -> int:
        """Elements of one flat load: the widest 16-byte (or 8-byte) vector with which every block's
        span starts aligned and holds whole vectors, else 1."""
        hw = self.st.hi * self.st.wi
        for u in ((8, 4) if self.st.sto.half else (4,)):
            if (self.st.groups * hw) % u == 0 and (self.bc * hw) % u == 0:
                return u
        return 1

    @property
    def cv(self) -> int:
        """Channels of one NHWC tile load: 16 bytes (8 halves, 4 floats) or 4 where the block's and
        the tensor's channel counts align (consecutive source channels: not dgrad with m > 1), else 1."""
        st = self.st
        if not st.nhwc or (st.fan_in and st.mult > 1):
            return 1
        for u in ((8, 4) if st.sto.half else (4,)):
            if st.groups % u == 0 and self.bc % u == 0:
                return u
        return 1

    @property
    def skew(self) -> int:
        """Floats by which each ``cv``-channel chunk's planes are shifted in shared memory (NHWC, 8-channel
        loads): the chunks of one pixel a warp's tile stores write then start in distinct banks (bc=32:
        8, bc=16: 16, bc=64: 4), so the stores are conflict-free (without it 4-, 2- and 8-way); 0 where
        the stores already are, or the shift would break the rows' 16-byte alignment. A read phase of
        8 lanes stays in one chunk, so the float4 reads are unchanged."""
        u = self.cv
        if u != 8:
            return 0
        skew = (32 * u // self.bc) % 32
        return skew if skew % 4 == 0 else 0

    def base(self, ch: str) -> str:
        """The shared-memory offset of channel ``ch``'s (a name or expression) tile."""
        c = ch if ch.isidentifier() else f"({ch})"
        return f"{c} * {self.plane}" + (f" + {c} / {self.cv} * {self.skew}" if self.skew else "")

    @property
    def tile_floats(self) -> int:
        """The input tiles' floats in shared memory, skewed chunks included."""
        return self.bc * self.plane + (self.bc // self.cv) * self.skew

    @property
    def smem_bytes(self) -> int:
        return 4 * (self.tile_floats + (self.bc * self.st.r * self.st.s if self.st.big else 0))

    @property
    def grid(self) -> tuple[int, int, int, int]:
        """(q tiles, p tiles, channel blocks, blocks in all)."""
        st = self.st
        nqt, npt, ncb = cdiv(st.wo, self.bq * self.tq), cdiv(st.ho, self.bp * self.tp), cdiv(st.groups, self.bc)
        return nqt, npt, ncb, st.n * ncb * npt * nqt

    def problem(self, device: DeviceInfo) -> str | None:
        """None when the generator takes this tile on ``device``, else what is wrong."""
        if min(self.bq, self.bp, self.bc, self.tq, self.tp) < 1:
            return "bq, bp, bc, tq and tp must be >= 1"
        if not 1 <= self.threads <= device.max_threads:
            return f"bq * bp * bc ({self.threads}) threads must be 1..{device.max_threads}"
        if self.vec and not self.vec_ok:
            if self.st.nhwc:
                return "vec=1 reads NCHW rows as vectors (NHWC tiles are read channel-vectorised)"
            return f"vec=1 needs W % {self.vw} == 0 and bq * tq * stride a multiple of {self.vw}"
        if self.cf and not self.st.nhwc:
            return "cf=1 numbers NHWC blocks channel blocks fastest (NCHW planes are apart in memory)"
        if self.fl and not self.flat_ok:
            return "fl=1 needs one tile per output plane, consecutive source planes (dgrad: multiplier 1) and vec=0"
        if self.smem_bytes > min(device.shared_bytes, _SMEM):
            return f"the input tile ({self.smem_bytes} B) does not fit in shared memory"
        if self.st.phases and self.out_rows * self.out_cols > 32:
            return f"tp * tq super-pixels of {self.st.out_step[0]} x {self.st.out_step[1]} " \
                   f"({self.out_rows * self.out_cols}) outputs per thread must be <= 32"
        if self.tp * self.tq > 32:
            return f"tp * tq ({self.tp * self.tq}) outputs per thread must be <= 32"
        return None


# -- metacode -------------------------------------------------------------------------------------
def _head(code: Code, t: Tile) -> None:
    st = t.st
    nqt, npt, ncb, _ = t.grid
    code("const int tid = LOCAL_ID(0);")
    if st.nhwc:
        code(f"const int lc = tid % {t.bc}, lx = (tid / {t.bc}) % {t.bq}, ly = tid / {t.bc * t.bq};"
             "  // channels fastest: a warp's stores of one pixel are contiguous")
    else:
        code(f"const int lx = tid % {t.bq}, ly = (tid / {t.bq}) % {t.bp}, lc = tid / {t.bq * t.bp};")
    if t.cf:
        code("const int bid = GROUP_ID(0);  // channel blocks fastest: the chunks of a pixel's channels read together",
             f"const int cb = bid % {ncb}, qt = (bid / {ncb}) % {nqt}, pt = (bid / {ncb * nqt}) % {npt};",
             f"const int n = bid / {ncb * nqt * npt}, c0 = cb * {t.bc};")
    else:
        code("const int bid = GROUP_ID(0);  // q tiles fastest: neighbours share their halo through L2",
             f"const int qt = bid % {nqt}, pt = (bid / {nqt}) % {npt}, cbn = bid / {nqt * npt};",
             f"const int n = cbn / {ncb}, c0 = (cbn % {ncb}) * {t.bc};")
    code(f"const int p0 = pt * {t.bp * t.tp}, q0 = qt * {t.bq * t.tq};",
         f"const int y0 = p0 * {st.stride[0]} - {st.pad_t}, x0 = q0 * {st.stride[1]} - {st.pad_l};",
         f"const int c = c0 + lc, cw = min(c, {st.groups - 1});  // cw: clamped, filter reads stay in bounds")
    what = f"{t.bc} x {t.ih} x {t.iw} input tiles with halo" + (f", {t.plane} floats apart" if st.nhwc else "")
    what += f", chunks of {t.cv} skewed {t.skew}" if t.skew else ""
    code(f"SHARED float4 xs4[{cdiv(t.tile_floats, 4)}];  // {what}",
         "LOCAL_PTR float* xs = (LOCAL_PTR float*)xs4;")
    if st.big:
        code(f"SHARED float ws[{t.bc * st.r * st.s}];  // the block's {st.r}x{st.s} filters")


def _plane(st: Stencil, ch: str, j: str) -> str:
    """Index of the src plane of image n for base channel ``ch`` and multiplier index ``j``."""
    if st.fan_in:
        m = f"({ch}) * {st.mult} + {j}" if st.mult > 1 else ch
        return f"(n * {st.src_planes} + {m})"
    return f"(n * {st.groups} + {ch})"


def _zero4() -> str:
    return "MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f)"


def load_vector(code: Code, st: Stencil, name: str, width: int, ok: str, src: str) -> None:
    """``name`` (float, float4, or float4 ``name``a / ``name``b for 8 elements) = the ``width``
    elements at ``src`` where ``ok``, else zeros."""
    sto = st.sto
    if width == 1:
        code(f"const float {name} = ({ok}) ? {sto.ldg(src)} : 0.0f;")
    elif width == 4:
        code(f"const float4 {name} = ({ok}) ? {sto.vload4('0', src)} : {_zero4()};")
    else:
        code(f"float4 {name}a = {_zero4()}, {name}b = {_zero4()};",
             f"if ({ok}) {sto.vload8(f'{name}a', f'{name}b', '0', src)};")


def vector_lane(name: str, width: int, e: int) -> str:
    """Element ``e`` of a value :func:`_vector` loaded."""
    if width == 1:
        return name
    if width == 4:
        return f"{name}.{'xyzw'[e]}"
    return f"{name}{'ab'[e // 4]}.{'xyzw'[e % 4]}"


def _load_flat(code: Code, t: Tile, j: str) -> None:
    """``fl``: the block's bc source planes, consecutive in memory, read as one span (vectors where
    :attr:`Tile.flat_unit`), coalesced whatever the row width; each value is stored at its place in
    the zero-filled padded tile. The first batch of loads is in flight while the tile is zeroed."""
    st = t.st
    hw, u = st.hi * st.wi, t.flat_unit
    units = cdiv(t.bc * hw, u)
    trips = cdiv(units, t.threads)
    code(f"const int nvalid = min({t.bc}, {st.groups} - c0) * {hw};  // elements of this block's planes",
         f"const GLOBAL_PTR {st.sto.elem}* span = {st.src} + {_plane(st, 'c0', j)} * {hw};")
    for b0 in range(0, trips, _LOAD_BATCH):
        batch = range(b0, min(trips, b0 + _LOAD_BATCH))
        for it in batch:
            code(f"const int f{it} = (tid + {it * t.threads}) * {u};")
            if u == 4:
                code(f"const float4 v{it} = f{it} < nvalid ? {st.sto.vload4('0', f'span + f{it}')} : {_zero4()};")
            elif u == 8:
                code(f"float4 v{it}a = {_zero4()}, v{it}b = {_zero4()};",
                     f"if (f{it} < nvalid) {st.sto.vload8(f'v{it}a', f'v{it}b', '0', f'span + f{it}')};")
            else:
                code(f"const float v{it} = f{it} < nvalid ? {st.sto.ldg(f'span + f{it}')} : 0.0f;")
        if b0 == 0:
            with code.block(f"for (int z = tid; z < {cdiv(t.bc * t.ih * t.iw, 4)}; z += {t.threads})"):
                code(f"xs4[z] = {_zero4()};")
            code("BARRIER();  // the halo is zero before any value lands")
        for it in batch:
            with code.block(f"if (f{it} < nvalid)"):
                for e in range(u):
                    val = vector_lane(f"v{it}", u, e)
                    code(f"const int ci{it}_{e} = (f{it} + {e}) / {hw}, rem{it}_{e} = (f{it} + {e}) % {hw};",
                         f"const int row{it}_{e} = rem{it}_{e} / {st.wi} + {st.pad_t}, "
                         f"col{it}_{e} = rem{it}_{e} % {st.wi} + {st.pad_l};",
                         f"if ((unsigned)row{it}_{e} < {t.ih}u && (unsigned)col{it}_{e} < {t.iw}u) "
                         f"xs[(ci{it}_{e} * {t.ih} + row{it}_{e}) * {t.iw} + col{it}_{e}] = {val};")


def _batches(code: Code, t: Tile, total: int) -> Iterator[tuple[range, Callable[[int], str], Callable[[int], bool]]]:
    """The load trips of ``total`` units in batches of ``_LOAD_BATCH``: (trips, the unit of trip it,
    whether trip it needs a bound check). Unrolled; the tiled form's large halos loop at run time
    over batches (every trip then checked)."""
    trips = cdiv(total, t.threads)
    if t.st.big and trips > 2 * _LOAD_BATCH:
        with code.block(f"for (int b = 0; b < {cdiv(trips, _LOAD_BATCH)}; ++b)  /* {_LOAD_BATCH} loads in flight */"):
            yield range(_LOAD_BATCH), lambda it: f"tid + (b * {_LOAD_BATCH} + {it}) * {t.threads}", lambda it: True
        return
    for b0 in range(0, trips, _LOAD_BATCH):
        yield (range(b0, min(trips, b0 + _LOAD_BATCH)), lambda it: f"tid + {it * t.threads}",
               lambda it: it * t.threads + t.threads > total)


def _load_nhwc(code: Code, t: Tile, j: str) -> None:
    """NHWC: the block's bc channels of each tile pixel, ``cv`` consecutive channels a load (16
    bytes where they align), the channel chunks of a pixel fastest so a warp reads contiguous runs;
    each value lands in its channel's padded plane."""
    st = t.st
    u = t.cv
    nch = t.bc // u
    total = nch * t.ih * t.iw
    for batch, start, guarded in _batches(code, t, total):
        for it in batch:
            guard = guarded(it)
            code(f"const int t{it} = {start(it)};",
                 f"const int ci{it} = (t{it} % {nch}) * {u}, pix{it} = t{it} / {nch};",
                 f"const int row{it} = pix{it} / {t.iw}, col{it} = pix{it} % {t.iw};",
                 f"const int iy{it} = y0 + row{it}, ix{it} = x0 + col{it};")
            ok = (f"(unsigned)iy{it} < {st.hi}u && (unsigned)ix{it} < {st.wi}u && c0 + ci{it} < {st.groups}"
                  + (f" && t{it} < {total}" if guard else ""))
            ch = f"c0 + ci{it}"
            if st.fan_in and st.mult > 1:
                ch = f"(c0 + ci{it}) * {st.mult} + {j}"
            src = f"{st.src} + ((n * {st.hi} + iy{it}) * {st.wi} + ix{it}) * {st.src_planes} + {ch}"
            load_vector(code, st, f"v{it}", u, ok, src)
        for it in batch:
            guard = guarded(it)
            with code.block(f"if (t{it} < {total})" if guard else ""):
                for e in range(u):
                    at = f"{t.base(f'ci{it}')} + {e * t.plane} + row{it} * {t.iw} + col{it}"
                    code(f"xs[{at}] = {vector_lane(f'v{it}', u, e)};")


def _load(code: Code, t: Tile, j: str) -> None:
    """The block's bc input tiles into shared memory: every load of a batch issued before its stores."""
    if t.fl:
        _load_flat(code, t, j)
        return
    if t.st.nhwc:
        _load_nhwc(code, t, j)
        return
    st = t.st
    per = t.ih * (t.chunks if t.vec else t.iw)
    total = t.bc * per
    hw = st.hi * st.wi
    vw = t.vw if t.vec else 1
    for batch, start, guarded in _batches(code, t, total):
        for it in batch:
            guard = guarded(it)
            code(f"const int t{it} = {start(it)};",
                 f"const int ci{it} = t{it} / {per}, rem{it} = t{it} % {per};")
            if t.vec:
                code(f"const int row{it} = rem{it} / {t.chunks}, col{it} = {vw} * (rem{it} % {t.chunks}) - {t.off};",
                     f"const int iy{it} = y0 + row{it}, ix{it} = x0 + col{it};")
            else:
                code(f"const int iy{it} = y0 + rem{it} / {t.iw}, ix{it} = x0 + rem{it} % {t.iw};")
            ok = (f"(unsigned)iy{it} < {st.hi}u && (unsigned)ix{it} < {st.wi}u && c0 + ci{it} < {st.groups}"
                  + (f" && t{it} < {total}" if guard else ""))
            src = f"{st.src} + {_plane(st, f'c0 + ci{it}', j)} * {hw} + iy{it} * {st.wi} + ix{it}"
            if vw == 1:
                code(f"const float v{it} = ({ok}) ? {st.sto.ldg(src)} : 0.0f;")
            else:
                load_vector(code, st, f"v{it}", vw, ok, src)
        for it in batch:
            guard = guarded(it)
            if t.vec:
                base = f"(ci{it} * {t.ih} + row{it}) * {t.iw} + col{it}"
                with code.block(f"if (t{it} < {total})" if guard else ""):
                    for e in range(vw):
                        val = vector_lane(f"v{it}", vw, e)
                        code(f"if ((unsigned)(col{it} + {e}) < {t.iw}u) xs[{base} + {e}] = {val};")
            else:
                when = f"if (t{it} < {total}) " if guard else ""
                code(f"{when}xs[t{it}] = v{it};")


def filter_taps(code: Code, st: Stencil, k: str) -> None:
    """The R*S taps of filter ``k`` into registers f{r}_{s} (rotated for dgrad)."""
    for r, s in itertools.product(range(st.r), range(st.s)):
        rr, ss = (st.r - 1 - r, st.s - 1 - s) if st.flip else (r, s)
        code(f"const float f{r}_{s} = {st.sto.ldg(f'w + ({k}) * {st.r * st.s} + {rr * st.s + ss}')};")


def _filter_smem(code: Code, t: Tile, j: str) -> None:
    """The tiled form: the block's bc filters (of multiplier index ``j``) into shared ``ws``."""
    st = t.st
    rs = st.r * st.s
    k = f"(c0 + z / {rs}) * {st.mult} + {j}" if st.mult > 1 else f"c0 + z / {rs}"
    with code.block(f"for (int z = tid; z < {t.bc * rs}; z += {t.threads})"):
        code(f"ws[z] = c0 + z / {rs} < {st.groups} ? {st.sto.ldg(f'w + ({k}) * {rs} + z % {rs}')} : 0.0f;")


def _row_values(code: Code, t: Tile, row: int | str) -> None:
    """e0 .. e{seg-1}: the thread's input row segment at shared offset ``row`` (a constant or a
    run-time expression; float4 reads where the segment starts 16-byte aligned)."""
    def at(e: int) -> str:
        return str(row + e) if isinstance(row, int) else f"{row} + {e}"

    if t.vread:
        for a in range(cdiv(t.seg, 4)):
            code(f"const float4 u{a} = VLOAD4(0, xt + {at(4 * a)});")
            for e, comp in enumerate("xyzw"):
                if 4 * a + e < t.seg:
                    code(f"const float e{4 * a + e} = u{a}.{comp};")
    else:
        for e in range(t.seg):
            code(f"const float e{e} = xt[{at(e)}];")


def _thread_tile(code: Code, t: Tile) -> None:
    st = t.st
    code(f"const LOCAL_PTR float* xt = xs + {t.base('lc')} + ly * {t.tp * st.stride[0] * t.iw} "
         f"+ lx * {t.tq * st.stride[1]};")


def _compute(code: Code, t: Tile) -> None:
    """acc{i}_{j} += taps x input rows: each row segment read once from shared memory, used by every
    output row it feeds."""
    st = t.st
    (sh, sw), (dh, dw) = st.stride, st.dilation
    _thread_tile(code, t)
    for ir in range(t.rows):
        users = [(i, (ir - i * sh) // dh) for i in range(t.tp)
                 if ir >= i * sh and (ir - i * sh) % dh == 0 and (ir - i * sh) // dh < st.r]
        if not users:
            continue
        with code.block(f"/* input row {ir} */"):
            _row_values(code, t, ir * t.iw)
            for i, r in users:
                for jq, s in itertools.product(range(t.tq), range(st.s)):
                    code(f"acc{i}_{jq} = FMA(e{jq * sw + s * dw}, f{r}_{s}, acc{i}_{jq});")


def _phase_fmas(code: Code, t: Tile, i: int, a: int, r: int, tap: str) -> None:
    """FMAs of dx rows of phase ``a`` in super-row ``i`` with filter row ``r`` (taps ``tap``r_s or
    t_s) and the row segment e*: every column phase b's taps."""
    ph = t.st.phases
    assert ph is not None
    for jq, (b, taps) in itertools.product(range(t.tq), enumerate(ph.cols)):
        acc = f"acc{i * ph.sh + a}_{jq * ph.sw + b}"
        for s, off in taps:
            code(f"{acc} = FMA(e{jq + off}, {tap.format(r=r, s=s)}, {acc});")


def _compute_phases(code: Code, t: Tile) -> None:
    """Strided dgrad, taps in registers: each dy row segment read once, used by every (super-row,
    phase, filter row) it feeds."""
    ph = t.st.phases
    assert ph is not None
    _thread_tile(code, t)
    for ir in range(t.rows):
        users = [(i, a, r) for i in range(t.tp) for a, taps in enumerate(ph.rows) for r, off in taps
                 if i + off == ir]
        if not users:
            continue
        with code.block(f"/* dy row {ir} */"):
            _row_values(code, t, ir * t.iw)
            for i, a, r in users:
                _phase_fmas(code, t, i, a, r, "f{r}_{s}")


def _compute_big(code: Code, t: Tile) -> None:
    """The tiled form: a run-time loop over filter rows r; row r's S taps read once from shared
    memory into registers serve every output row's segment."""
    st = t.st
    (sh, sw), (dh, dw) = st.stride, st.dilation
    _thread_tile(code, t)
    code(f"const LOCAL_PTR float* wt = ws + lc * {st.r * st.s};")
    with code.block(f"for (int r = 0; r < {st.r}; ++r)"):
        code(*(f"const float t{s} = wt[r * {st.s} + {s}];" for s in range(st.s)))
        for i in range(t.tp):
            with code.block(f"/* output row {i} */"):
                _row_values(code, t, f"({i * sh} + r * {dh}) * {t.iw}")
                for jq, s in itertools.product(range(t.tq), range(st.s)):
                    code(f"acc{i}_{jq} = FMA(e{jq * sw + s * dw}, t{s}, acc{i}_{jq});")


def _compute_big_phases(code: Code, t: Tile) -> None:
    """Strided (or large-filter) dgrad in the tiled form: per row phase a, a run-time loop over its
    taps (an arithmetic progression of filter rows r and dy row offsets)."""
    st = t.st
    ph = st.phases
    assert ph is not None
    _thread_tile(code, t)
    code(f"const LOCAL_PTR float* wt = ws + lc * {st.r * st.s};")
    used = sorted({s for taps in ph.cols for s, _ in taps})
    for a, taps in enumerate(ph.rows):
        if not taps:
            continue
        (r0, o0), dr, do = taps[0], (taps[1][0] - taps[0][0] if len(taps) > 1 else 0), \
            (taps[1][1] - taps[0][1] if len(taps) > 1 else 0)
        assert all(tap == (r0 + u * dr, o0 + u * do) for u, tap in enumerate(taps))
        with code.block(f"for (int u = 0; u < {len(taps)}; ++u)  /* row phase {a} */"):
            code(f"const int r = {r0} + u * {dr}, ro = {o0} + u * {do};")
            code(*(f"const float t{s} = wt[r * {st.s} + {s}];" for s in used))
            for i in range(t.tp):
                with code.block(f"/* super-row {i} */"):
                    _row_values(code, t, f"({i} + ro) * {t.iw}")
                    _phase_fmas(code, t, i, a, 0, "t{s}")


def _store(code: Code, t: Tile, ch: str, epi: Epilogue) -> None:
    """Guarded stores of dst channel ``ch`` with the epilogue; 16-byte stores where they align."""
    st = t.st
    sto = st.sto
    (oh, ow), (mh, mw) = st.out_hw, st.out_step
    rows, cols = t.out_rows, t.out_cols
    vstore = not st.nhwc and cols in (4, 8) and ow % cols == 0
    chan = f"{ch} + {st.dst_offset}" if st.dst_offset else ch
    if st.phases:
        code(f"const int qb = (q0 + lx * {t.tq}) * {mw}, pb = (p0 + ly * {t.tp}) * {mh};  // dx pixel of super-pixel")
    else:
        code(f"const int qb = q0 + lx * {t.tq}, pb = p0 + ly * {t.tp};")
    if not st.nhwc:
        code(f"const int ob = (n * {st.dst_planes} + {chan}) * {oh * ow} + qb;")
    with code.block(f"if (c < {st.groups})"):
        for i in range(rows):
            with code.block(f"if (pb + {i} < {oh})"):
                if st.nhwc:
                    for jq in range(cols):
                        idx = f"((n * {oh} + pb + {i}) * {ow} + qb + {jq}) * {st.dst_planes} + {chan}"
                        val = epi.apply(f"acc{i}_{jq}", ch, idx, offset_done=True, storage=sto)
                        code(f"if (qb + {jq} < {ow}) {sto.store(st.dst, idx, val)};")
                    continue
                idx = f"ob + (pb + {i}) * {ow}"
                if vstore:
                    vals = [epi.apply(f"acc{i}_{e}", ch, f"{idx} + {e}", offset_done=True, storage=sto)
                            for e in range(cols)]
                    lo = f"MAKE_FLOAT4({', '.join(vals[:4])})"
                    if cols == 4:
                        code(f"if (qb < {ow}) {sto.vstore4(lo, '0', f'{st.dst} + {idx}')};")
                    else:
                        hi = f"MAKE_FLOAT4({', '.join(vals[4:])})"
                        code(f"if (qb < {ow}) {sto.vstore8(lo, hi, '0', f'{st.dst} + {idx}')};")
                    continue
                for jq in range(cols):
                    val = epi.apply(f"acc{i}_{jq}", ch, f"{idx} + {jq}", offset_done=True, storage=sto)
                    code(f"if (qb + {jq} < {ow}) {sto.store(st.dst, f'{idx} + {jq}', val)};")


def _compute_any(code: Code, t: Tile) -> None:
    st = t.st
    if st.big:
        (_compute_big_phases if st.phases else _compute_big)(code, t)
    else:
        (_compute_phases if st.phases else _compute)(code, t)


def stencil_body(t: Tile, epi: Epilogue) -> str:
    """The kernel body of tile ``t`` (fprop fan-out or dgrad fan-in)."""
    st = t.st
    code = Code()
    _head(code, t)
    accs = [f"acc{i}_{jq}" for i, jq in itertools.product(range(t.out_rows), range(t.out_cols))]
    if not st.fan_in:
        _load(code, t, "0")
        code("BARRIER();")
        loop = f"for (int j = 0; j < {st.mult}; ++j)" if st.mult > 1 else "/* one filter per channel */"
        with code.block(loop):
            k = f"cw * {st.mult} + j" if st.mult > 1 else "cw"
            kout = f"c * {st.mult} + j" if st.mult > 1 else "c"
            if st.big:
                if st.mult > 1:
                    code("if (j > 0) BARRIER();  // the previous filters are read")
                _filter_smem(code, t, "j")
                code("BARRIER();")
            else:
                filter_taps(code, st, k)
            code(*(f"float {a} = 0.0f;" for a in accs))
            _compute_any(code, t)
            _store(code, t, kout, epi)
        return code.text()
    code(*(f"float {a} = 0.0f;" for a in accs))
    loop = f"for (int j = 0; j < {st.mult}; ++j)" if st.mult > 1 else "/* one dy plane per channel */"
    with code.block(loop):
        j = "j" if st.mult > 1 else "0"
        if st.mult > 1:
            code("if (j > 0) BARRIER();  // the previous plane's tile is read")
        _load(code, t, j)
        if st.big:
            _filter_smem(code, t, j)
        code("BARRIER();")
        if not st.big:
            filter_taps(code, st, f"cw * {st.mult} + j" if st.mult > 1 else "cw")
        _compute_any(code, t)
    _store(code, t, "c", epi)
    return code.text()


# -- parameters ----------------------------------------------------------------------------------
def _fit(extent: int, per: int, cap: int) -> int:
    """Threads along one axis: the fewest tiles of at most ``cap`` threads of ``per`` outputs that
    cover ``extent``, split evenly (56 rows, 2 per thread, cap 18: two tiles of 14 threads, not 18
    and 10)."""
    cap = max(1, cap)
    tiles = cdiv(extent, cap * per)
    return max(1, min(cap, cdiv(cdiv(extent, tiles), per)))


# The GPU default takes flat loads (fl) where a tile covers whole planes, except 3x3 filters on 7x7 input
# planes, where the flat loads gain nothing (measured on the grouped suite, docs/NOTES-gemm.md).
FLAT_DEFAULT = True


def _shrink(st: Stencil, device: DeviceInfo, bq: int, bp: int, bc: int, tq: int, tp: int,
            flat: bool) -> Params | None:
    """The first tile, halving bc, then bp, then bq (tq to 1), that the generator takes."""
    for _ in range(8):
        t = Tile(st, bq, bp, bc, tq, tp, False)
        t = Tile(st, bq, bp, bc, tq, tp, t.vec_ok)
        if t.problem(device) is None:
            if flat and t.flat_ok and not (max(st.eff_r, st.eff_s) <= 3 and st.hi * st.wi <= 49):
                return Params(bq=bq, bp=bp, bc=bc, tq=tq, tp=tp, vec=t.vec, fl=True)
            return Params(bq=bq, bp=bp, bc=bc, tq=tq, tp=tp, vec=t.vec)
        if bc > 1:
            bc = max(1, bc // 2)
        elif bp > 1:
            bp = max(1, bp // 2)
        else:
            bq, tq = max(1, bq // 2), 1
    return None


def _special_default(st: Stencil, device: DeviceInfo) -> Params | None:
    """Untuned tiles of the newer forms (None: the plain NCHW rule). Tiled form (large filters): 8 x 4
    outputs a thread (S x 8 FMAs per S + 11 shared reads a filter row), channels a block until it has
    >= 64 threads (one on planes of 28 and more), on NHWC too (a channel's halo'd tile fills shared
    memory; such layers are compute-bound, the strided loads a small share). Phases: tp x tq
    super-pixels making 4 (float32) or 8 (half) dx columns and about 2 dx rows a thread (one 16-byte
    store a row). NHWC: 32 channels (a warp, channel-vectorised loads) by a few pixel tiles, 256
    threads; in half storage 4 output rows a thread at stride 1 on planes of 14 rows and more, and 16
    channels (128 threads) where 32 do not divide the channels or the filter is larger than 3x3, the
    strided dgrad's phases excepted (the FP16 sweep of MobileNet-v2's and ConvNeXt-T's forward layers,
    docs/NOTES-gemm.md; the phases were not in it). NCHW half phases whose super-pixel columns do not
    split into whole tq (rows that take no vectors): 2 a thread (1 under 8 columns): H200, thirty-sixth
    session, FP16 NCHW dgrad, MobileNet-v2's 192@28/2 0.0627 -> 0.0132 ms (tq 4 -> 2), 576@14/2 0.0557
    -> 0.0137 (tq 1): faster than the best of 48 points sampled from each space. NHWC half forwards at stride
    2 on rows of 56 outputs and more: 2 outputs a thread (H200, thirty-seventh session, FP16, the tile's mods:
    MobileNet-v2's 96@112/2 0.0791 -> 0.0739 ms, MobileNet-v3's 64@112/2 0.0551 -> 0.0517; 28-output rows
    no faster)."""
    half = st.sto.half
    if st.phases:
        sh, sw = st.out_step
        tq = max(1, min((8 if half else 4) // sw, st.wo))
        tp = max(1, min(2 // sh, st.ho))
        if half and not st.nhwc and st.wo % tq:
            tq = 2 if st.wo >= 8 else 1  # ragged NCHW rows (scalar loads): see the docstring
    elif st.big:
        tq, tp = min(8, st.wo), min(4, st.ho)
    elif st.nhwc:
        tq = 4 if st.wo >= 6 else 2 if st.wo >= 2 else 1
        tp = 4 if st.eff_r >= 7 and st.ho >= 28 else 2 if st.ho >= 6 else 1
        if half and st.stride == (1, 1) and st.ho >= 14:
            tp = 4
        if half and st.stride[1] == 2 and st.wo >= 56:
            tq = 2  # strided rows of 56 outputs and more: see the docstring
    else:
        return None
    if st.nhwc and not st.big:
        bc = min(32, st.groups)
        bq = _fit(st.wo, tq, max(1, 256 // bc // 2))
        bp = _fit(st.ho, tp, max(1, 256 // (bc * bq)))
        if half and bc == 32 and not st.phases and (st.groups % 32 or st.eff_r > 3):
            bc = 16  # half the channels on the same pixels: no idle half chunk; larger filters' halos fit more blocks
    else:
        bq = _fit(st.wo, tq, 16)
        bp = _fit(st.ho, tp, max(1, 128 // bq))
        bc = max(1, min(st.groups, cdiv(64 if st.big else 128, bq * bp)))
    return _shrink(st, device, bq, bp, bc, tq, tp, FLAT_DEFAULT and not st.big)


def stencil_default(st: Stencil, device: DeviceInfo) -> Params:
    """An untuned tile for the real layers: 4 adjacent outputs per thread along a row (one 16-byte
    store; 8 for half storage where rows align to 8), 2 rows where the plane has them (a 7x7 filter's
    rows are then read 8 times for 2 outputs, not 14), 4 rows for 7x7 filters on planes of >= 28 rows
    (fewer filter-row reads an output; no gain on 5x5 or 7x7 planes), the row's width in threads (up
    to 32), rows up to ~256 threads, and channels per block until a block has >= 128 threads (7x7
    and 14x14 planes); 2 outputs a thread on strided half rows of 32 and more. Phases, large filters and
    NHWC: :func:`_special_default`."""
    if not device.is_gpu:
        prm = Params(bq=_fit(st.wo, 1, 8), bp=_fit(st.ho, 1, 4), bc=1, tq=1, tp=1, vec=False)
        return prm
    special = _special_default(st, device)
    if special is not None:
        return special
    if st.phases or st.big or st.nhwc:
        return Params(bq=1, bp=1, bc=1, tq=1, tp=1, vec=False)
    tq = 4 if st.wo >= 6 else 2 if st.wo >= 2 else 1
    if st.sto.half and st.wo % 8 == 0:
        tq = 8  # 8 halves: one 16-byte store a row
    tp = 4 if st.eff_r >= 7 and st.ho >= 28 else 2 if st.ho >= 6 else 1
    if st.sto.half and min(st.stride) > 1 and st.wo >= 32:
        tq = 2  # strided half rows 8 a thread: a warp's shared reads 16 halves apart, 8-way bank conflicts
    bq = _fit(st.wo, tq, 32)
    bp = _fit(st.ho, tp, max(1, 256 // bq))
    bc = max(1, min(st.groups, cdiv(128, bq * bp)))
    return _shrink(st, device, bq, bp, bc, tq, tp, FLAT_DEFAULT) or Params(bq=8, bp=4, bc=1, tq=1, tp=1, vec=False)


def _space_axes(st: Stencil) -> tuple[tuple[int, ...], ...]:
    """(tq, tp, bq, bp, bc) candidates of the space."""
    if st.big:
        return (8, 4, 2), (4, 2, 1), (4, 7, 8, 14, 16), (4, 7, 8, 14, 16), (1, 2, 4)
    if st.nhwc:
        return (4, 2, 1), (1, 2, 4), (1, 2, 4, 8), (1, 2, 4, 8), (8, 16, 32, 64)
    tq = (8, 4, 2, 1) if st.sto.half or st.phases else (4, 2, 1)
    return tq, (1, 2, 4), (4, 8, 14, 16, 28, 32), (1, 2, 4, 7, 8, 14, 16), (1, 2, 4, 8, 16)


def stencil_space(st: Stencil, device: DeviceInfo) -> list[Params]:
    """The default first, then tiles of 32..1024 threads not far larger than the plane."""
    out = [stencil_default(st, device)]
    for tq, tp, bq, bp, bc in itertools.product(*_space_axes(st)):
        if bq * tq > st.wo + 4 * tq + 3 or bp * tp > st.ho + tp + 7 or bc > st.groups:
            continue
        if bq * bp * bc < 32:
            continue
        for vec in ((False,) if st.nhwc else (True, False)):
            t = Tile(st, bq, bp, bc, tq, tp, vec)
            if t.problem(device) is None:
                points = [Params(bq=bq, bp=bp, bc=bc, tq=tq, tp=tp, vec=vec)]
                if t.flat_ok:
                    points.append(Params(bq=bq, bp=bp, bc=bc, tq=tq, tp=tp, vec=vec, fl=True))
                out += [prm for prm in points if prm not in out]
    return out


def _check_tile(name: str, t: Tile, device: DeviceInfo) -> None:
    why = t.problem(device)
    if why:
        raise ValueError(f"{name}: {why}")


def _nhwc_rank(spec: ConvSpec, specialised: int) -> int:
    """On NHWC float32, depthwise_nhwc (measured) ranks first; on half storage the shared-memory tile
    with 16-byte channel-vectorised loads does, except on 3x3 filters at stride 2 over input planes of
    56 rows and more. There depthwise_nhwc (registers, no shared memory) ran faster in the bench's A/B of
    the two on an H200 (thirty-eighth session, FP16: 96@112/2 0.0736 -> 0.0684 ms, 144@56/2 0.0358 ->
    0.0316, MobileNet-v3's 64@112/2 0.0516 -> 0.0404; its 5x5 strided layers 2.2-2.4x slower, the other
    layers not measured: `depthwise-tile-vs-nhwc-strided-fp16-2026-12-03-h200.log`)."""
    if spec.layout != "nhwc":
        return specialised
    if spec.dtype == "float32" or (spec.r * spec.s <= 9 and max(spec.stride) == 2 and spec.h >= 56):
        return specialised - 1
    return specialised + 1


# -- variants --------------------------------------------------------------------------------------
class Depthwise(Variant):
    """fprop of a depthwise layer (groups == C, any multiplier m = K / C), any stride, dilation and
    padding, NCHW or NHWC, float32 or half storage; bias, residual, ReLU / GELU / SiLU and a concat's
    channel offset in the epilogue."""

    name = "depthwise"
    family = "depthwise"
    grouped = True
    exact = True
    residual_ok = True
    offset_ok = True
    tolerance = 1e-5
    specialised = 20
    space_lead = 1
    dtypes = ALL_DTYPES
    layouts = frozenset({"nchw", "nhwc"})
    optional_params = {"fl": frozenset({False, True}), "cf": frozenset({False, True})}

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if not spec.depthwise:
            return "only depthwise layers (groups == C > 1)"
        why = super().applies(spec, device) or too_big(spec)
        if why is None and Tile(fprop_stencil(spec), 1, 1, 1, 1, 1, False).problem(device):
            return "one output's input window does not fit in shared memory"
        return why

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        return _nhwc_rank(spec, self.specialised)

    def slow_on(self, spec: ConvSpec) -> str | None:
        """Half-precision NCHW filters of up to 3x3 taps on planes of 56 x 56 and more: the tile measured below
        cuDNN of the dtype (docs/NOTES-gemm.md), so such a layer goes to PyTorch when the tile runs it; where the
        rows align, ``depthwise_rows`` ranks first and runs it. Channels-last, larger filters and smaller planes
        stay ours."""
        if (spec.layout == "nchw" and spec.dtype in ("float16", "bfloat16") and spec.r * spec.s <= SLOW_NCHW_TAPS
                and spec.h * spec.w >= SLOW_NCHW_PLANE):
            return (f"{spec.r}x{spec.s} filters on {spec.h}x{spec.w} NCHW half planes ran at 0.31-0.90x cuDNN-best "
                    "(docs/NOTES-gemm.md); channels-last runs them at 1.0-1.3x")
        return None

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return stencil_default(fprop_stencil(spec), device)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return stencil_space(fprop_stencil(spec), device)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        t = Tile.of(fprop_stencil(spec, epilogue), params)
        _check_tile(self.name, t, device)
        name = "conv_depthwise"
        sto = Storage(spec.dtype)
        kernel = Kernel(name, (sto.buf("x"), sto.buf("w")) + out_args(epilogue, sto), stencil_body(t, epilogue),
                        (t.threads, 1, 1), comment=f"{self.name}: {params.short()}")
        launch = Launch(name, (t.grid[3], 1, 1), (t.threads, 1, 1), ("x", "w") + out_refs(epilogue))
        return Plan(self.name, self.family, spec, params, (kernel,), (launch,), tolerance=self.tolerance,
                    epilogue=epilogue)


class DepthwiseDgrad(Variant):
    """dgrad of a depthwise layer, any stride (by phase), dilation and padding, NCHW or NHWC, float32
    or half storage: the fprop stencil on dy (module docstring)."""

    name = "depthwise_dgrad"
    family = "depthwise"
    passes = frozenset({"dgrad"})
    grouped = True
    exact = True
    tolerance = 1e-5
    specialised = 20
    space_lead = 1
    dtypes = ALL_DTYPES
    layouts = frozenset({"nchw", "nhwc"})
    optional_params = {"fl": frozenset({False, True}), "cf": frozenset({False, True})}

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if not spec.depthwise:
            return "only depthwise layers (groups == C > 1)"
        why = super().applies(spec, device) or too_big(spec)
        if why is None and Tile(dgrad_stencil(spec), 1, 1, 1, 1, 1, False).problem(device):
            return "one output's window does not fit in shared memory"
        return why

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return stencil_default(dgrad_stencil(spec), device)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return stencil_space(dgrad_stencil(spec), device)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        t = Tile.of(dgrad_stencil(spec), params)
        _check_tile(self.name, t, device)
        name = "dgrad_depthwise"
        sto = Storage(spec.dtype)
        kernel = Kernel(name, (sto.buf("y"), sto.buf("w"), sto.buf("x", readonly=False)), stencil_body(t, epilogue),
                        (t.threads, 1, 1), comment=f"{self.name}: {params.short()}")
        launch = Launch(name, (t.grid[3], 1, 1), (t.threads, 1, 1), ("y", "w", "x"))
        return Plan(self.name, self.family, spec, params, (kernel,), (launch,), tolerance=self.tolerance,
                    epilogue=epilogue)


register(Depthwise())
register(DepthwiseDgrad())
