"""Depthwise convolution (groups == C, K = m*C): MobileNet's, EfficientNet's and ConvNeXt's 3x3 to
7x7 layers, and their data and filter gradients.

Depthwise layers do R*S multiply-adds per output: memory-bound, so the kernels are designed around
DRAM traffic, not FLOPs. A block owns a tile of ``bp*tp`` x ``bq*tq`` outputs of ``bc`` channels of
one image; it reads each input channel's tile plus its halo from DRAM once into shared memory (16-byte
loads where rows are 16-byte aligned: W % 4 == 0 and the tile origin keeps its phase), coalesced,
every load of a thread issued before the first shared store (``fl``: where one tile covers a plane, the
block's consecutive planes are read as one span, coalesced whatever the row width, and scattered into
the zero-filled padded tiles); each thread then keeps its channel's
R*S filter taps in registers and computes ``tp`` x ``tq`` adjacent outputs, reading each input row
segment it needs once from shared memory (as float4 when the segment starts 16-byte aligned) and
reusing it across the output rows and columns it feeds. A channel multiplier m > 1 reuses the tile
for the m outputs of the channel. Blocks are numbered with the output tiles of a plane fastest, so
neighbouring tiles (which share a halo) run together and the halo rows come from L2.

The epilogue (bias, residual, ReLU, a channel offset into a concat) is applied on the store; with
``tq`` = 4 and Q % 4 == 0 the four outputs go out as one 16-byte store.

``depthwise_dgrad`` (stride 1) is the same kernel on dy with the filter rotated by 180 degrees and
padding eff - 1 - pad (negative padding crops); with m > 1 each dx channel sums its m dy planes,
one tile after another. ``depthwise_wgrad`` reduces over N*P*Q per channel: blocks of (channel,
slice of the batch) keep R*S partial sums per thread, reduce them in shared memory in a fixed tree
and write one partial filter per slice; a second kernel adds the slices in order (deterministic:
no atomics).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from convforge.codegen.dialect import Buf, Kernel
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


@dataclass(frozen=True)
class Stencil:
    """A depthwise problem as the generator sees it: ``groups`` base channels, each a plane of
    ``src`` (hi x wi) feeding planes of ``dst`` (ho x wo) through an R x S filter (rotated when
    ``flip``). fprop: src plane c feeds the m dst planes c*m + j; dgrad (``fan_in``): dst plane c
    sums the m src planes c*m + j."""

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

    @property
    def src_planes(self) -> int:
        return self.groups * self.mult if self.fan_in else self.groups

    @property
    def eff_r(self) -> int:
        return (self.r - 1) * self.dilation[0] + 1

    @property
    def eff_s(self) -> int:
        return (self.s - 1) * self.dilation[1] + 1


def fprop_stencil(spec: ConvSpec, epi: Epilogue = Epilogue()) -> Stencil:
    return Stencil(spec.n, spec.groups, spec.kg, False, spec.h, spec.w, spec.p, spec.q, spec.r, spec.s,
                   spec.stride, spec.dilation, spec.pad[0], spec.pad[2], False, "x", "y",
                   epi.k_total or spec.k, epi.k_offset)


def dgrad_stencil(spec: ConvSpec) -> Stencil:
    """dx = dy correlated with the rotated filter at padding eff - 1 - pad (stride 1 only)."""
    return Stencil(spec.n, spec.groups, spec.kg, True, spec.p, spec.q, spec.h, spec.w, spec.r, spec.s,
                   (1, 1), spec.dilation, spec.eff_r - 1 - spec.pad[0], spec.eff_s - 1 - spec.pad[2], True,
                   "y", "x", spec.c)


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

    @classmethod
    def of(cls, st: Stencil, p: Params) -> Tile:
        return cls(st, p.bq, p.bp, p.bc, p.tq, p.tp, bool(p.vec), bool(p.get("fl", 0)))

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
    def vec_ok(self) -> bool:
        """16-byte global loads: rows 16-byte aligned and every tile origin at the same phase."""
        return self.st.wi % 4 == 0 and (self.bq * self.tq * self.st.stride[1]) % 4 == 0

    @property
    def off(self) -> int:
        """Columns between the aligned chunk start and the tile's first input column."""
        return (-self.st.pad_l) % 4

    @property
    def chunks(self) -> int:
        """float4 chunks per shared row (vector loads)."""
        return cdiv(self.off + self.iw, 4)

    @property
    def flat_ok(self) -> bool:
        """Flat loads apply: one tile covers each output plane (so every block's tile origin is the
        plane's, -pad), the block's source planes are consecutive in memory (fprop, or dgrad with
        multiplier 1) and rows are not loaded as float4s (vec=0)."""
        nqt, npt, _, _ = self.grid
        return nqt == 1 and npt == 1 and (not self.st.fan_in or self.st.mult == 1) and not self.vec

    @property
    def flat4(self) -> bool:
        """The flat span of every block starts 16-byte aligned and holds whole float4s."""
        hw = self.st.hi * self.st.wi
        return (self.st.groups * hw) % 4 == 0 and (self.bc * hw) % 4 == 0

    @property
    def smem_bytes(self) -> int:
        return 4 * self.bc * self.ih * self.iw

    @property
    def grid(self) -> tuple[int, int, int, int]:
        """(q tiles, p tiles, channel blocks, blocks in all)."""
        st = self.st
        nqt, npt, ncb = cdiv(st.wo, self.bq * self.tq), cdiv(st.ho, self.bp * self.tp), cdiv(st.groups, self.bc)
        return nqt, npt, ncb, st.n * ncb * npt * nqt

    def problem(self, device: DeviceInfo) -> str | None:
        """None when the generator takes this tile on ``device``, else what is wrong."""
        if not 1 <= self.threads <= device.max_threads:
            return f"bq * bp * bc ({self.threads}) threads must be 1..{device.max_threads}"
        if self.vec and not self.vec_ok:
            return "vec=1 needs W % 4 == 0 and bq * tq * stride a multiple of 4"
        if self.fl and not self.flat_ok:
            return "fl=1 needs one tile per output plane, consecutive source planes (dgrad: multiplier 1) and vec=0"
        if self.smem_bytes > min(device.shared_bytes, _SMEM):
            return f"the input tile ({self.smem_bytes} B) does not fit in shared memory"
        if self.tp * self.tq > 32:
            return f"tp * tq ({self.tp * self.tq}) outputs per thread must be <= 32"
        return None


# -- metacode -------------------------------------------------------------------------------------
def _head(code: Code, t: Tile) -> None:
    st = t.st
    nqt, npt, ncb, _ = t.grid
    code("const int tid = LOCAL_ID(0);",
         f"const int lx = tid % {t.bq}, ly = (tid / {t.bq}) % {t.bp}, lc = tid / {t.bq * t.bp};",
         "const int bid = GROUP_ID(0);  // q tiles fastest: neighbours share their halo through L2",
         f"const int qt = bid % {nqt}, pt = (bid / {nqt}) % {npt}, cbn = bid / {nqt * npt};",
         f"const int n = cbn / {ncb}, c0 = (cbn % {ncb}) * {t.bc};",
         f"const int p0 = pt * {t.bp * t.tp}, q0 = qt * {t.bq * t.tq};",
         f"const int y0 = p0 * {st.stride[0]} - {st.pad_t}, x0 = q0 * {st.stride[1]} - {st.pad_l};",
         f"const int c = c0 + lc, cw = min(c, {st.groups - 1});  // cw: clamped, filter reads stay in bounds",
         f"SHARED float4 xs4[{cdiv(t.bc * t.ih * t.iw, 4)}];  // {t.bc} x {t.ih} x {t.iw} input tiles with halo",
         "LOCAL_PTR float* xs = (LOCAL_PTR float*)xs4;")


def _plane(st: Stencil, ch: str, j: str) -> str:
    """Index of the src plane of image n for base channel ``ch`` and multiplier index ``j``."""
    if st.fan_in:
        m = f"({ch}) * {st.mult} + {j}" if st.mult > 1 else ch
        return f"(n * {st.src_planes} + {m})"
    return f"(n * {st.groups} + {ch})"


def _load_flat(code: Code, t: Tile, j: str) -> None:
    """``fl``: the block's bc source planes, consecutive in memory, read as one span (float4s where
    :attr:`Tile.flat4`), coalesced whatever the row width; each value is stored at its place in the
    zero-filled padded tile. The first batch of loads is in flight while the tile is zeroed."""
    st = t.st
    hw, u = st.hi * st.wi, 4 if t.flat4 else 1
    units = cdiv(t.bc * hw, u)
    trips = cdiv(units, t.threads)
    code(f"const int nvalid = min({t.bc}, {st.groups} - c0) * {hw};  // elements of this block's planes",
         f"const GLOBAL_PTR float* span = {st.src} + {_plane(st, 'c0', j)} * {hw};")
    for b0 in range(0, trips, _LOAD_BATCH):
        batch = range(b0, min(trips, b0 + _LOAD_BATCH))
        for it in batch:
            code(f"const int f{it} = (tid + {it * t.threads}) * {u};")
            if u == 4:
                code(f"const float4 v{it} = f{it} < nvalid ? VLOAD4(0, span + f{it}) "
                     ": MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f);")
            else:
                code(f"const float v{it} = f{it} < nvalid ? LDG(span + f{it}) : 0.0f;")
        if b0 == 0:
            with code.block(f"for (int z = tid; z < {cdiv(t.bc * t.ih * t.iw, 4)}; z += {t.threads})"):
                code("xs4[z] = MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f);")
            code("BARRIER();  // the halo is zero before any value lands")
        for it in batch:
            with code.block(f"if (f{it} < nvalid)"):
                for e in range(u):
                    val = f"v{it}.{'xyzw'[e]}" if u == 4 else f"v{it}"
                    code(f"const int ci{it}_{e} = (f{it} + {e}) / {hw}, rem{it}_{e} = (f{it} + {e}) % {hw};",
                         f"const int row{it}_{e} = rem{it}_{e} / {st.wi} + {st.pad_t}, "
                         f"col{it}_{e} = rem{it}_{e} % {st.wi} + {st.pad_l};",
                         f"if ((unsigned)row{it}_{e} < {t.ih}u && (unsigned)col{it}_{e} < {t.iw}u) "
                         f"xs[(ci{it}_{e} * {t.ih} + row{it}_{e}) * {t.iw} + col{it}_{e}] = {val};")


def _load(code: Code, t: Tile, j: str) -> None:
    """The block's bc input tiles into shared memory: every load of a batch issued before its stores."""
    if t.fl:
        _load_flat(code, t, j)
        return
    st = t.st
    per = t.ih * (t.chunks if t.vec else t.iw)
    total = t.bc * per
    trips = cdiv(total, t.threads)
    hw = st.hi * st.wi
    for b0 in range(0, trips, _LOAD_BATCH):
        batch = range(b0, min(trips, b0 + _LOAD_BATCH))
        for it in batch:
            guard = it * t.threads + t.threads > total
            code(f"const int t{it} = tid + {it * t.threads};",
                 f"const int ci{it} = t{it} / {per}, rem{it} = t{it} % {per};")
            if t.vec:
                code(f"const int row{it} = rem{it} / {t.chunks}, col{it} = 4 * (rem{it} % {t.chunks}) - {t.off};",
                     f"const int iy{it} = y0 + row{it}, ix{it} = x0 + col{it};")
                ok = (f"(unsigned)iy{it} < {st.hi}u && (unsigned)ix{it} < {st.wi}u && c0 + ci{it} < {st.groups}"
                      + (f" && t{it} < {total}" if guard else ""))
                src = f"{st.src} + {_plane(st, f'c0 + ci{it}', j)} * {hw} + iy{it} * {st.wi} + ix{it}"
                code(f"const float4 v{it} = ({ok}) ? VLOAD4(0, {src}) : MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f);")
            else:
                code(f"const int iy{it} = y0 + rem{it} / {t.iw}, ix{it} = x0 + rem{it} % {t.iw};")
                ok = (f"(unsigned)iy{it} < {st.hi}u && (unsigned)ix{it} < {st.wi}u && c0 + ci{it} < {st.groups}"
                      + (f" && t{it} < {total}" if guard else ""))
                src = f"{st.src} + {_plane(st, f'c0 + ci{it}', j)} * {hw} + iy{it} * {st.wi} + ix{it}"
                code(f"const float v{it} = ({ok}) ? LDG({src}) : 0.0f;")
        for it in batch:
            guard = it * t.threads + t.threads > total
            if t.vec:
                base = f"(ci{it} * {t.ih} + row{it}) * {t.iw} + col{it}"
                with code.block(f"if (t{it} < {total})" if guard else ""):
                    for e, comp in enumerate("xyzw"):
                        code(f"if ((unsigned)(col{it} + {e}) < {t.iw}u) xs[{base} + {e}] = v{it}.{comp};")
            else:
                when = f"if (t{it} < {total}) " if guard else ""
                code(f"{when}xs[t{it}] = v{it};")


def _filter(code: Code, st: Stencil, k: str) -> None:
    """The R*S taps of filter ``k`` into registers f{r}_{s} (rotated for dgrad)."""
    for r, s in itertools.product(range(st.r), range(st.s)):
        rr, ss = (st.r - 1 - r, st.s - 1 - s) if st.flip else (r, s)
        code(f"const float f{r}_{s} = LDG(w + ({k}) * {st.r * st.s} + {rr * st.s + ss});")


def _compute(code: Code, t: Tile) -> None:
    """acc{i}_{j} += taps x input rows: each row segment read once from shared memory, used by every
    output row it feeds."""
    st = t.st
    (sh, sw), (dh, dw) = st.stride, st.dilation
    code(f"const LOCAL_PTR float* xt = xs + lc * {t.ih * t.iw} + ly * {t.tp * sh * t.iw} + lx * {t.tq * sw};")
    for ir in range(t.rows):
        users = [(i, (ir - i * sh) // dh) for i in range(t.tp)
                 if ir >= i * sh and (ir - i * sh) % dh == 0 and (ir - i * sh) // dh < st.r]
        if not users:
            continue
        with code.block(f"/* input row {ir} */"):
            if t.vread:
                for a in range(cdiv(t.seg, 4)):
                    code(f"const float4 u{a} = VLOAD4(0, xt + {ir * t.iw + 4 * a});")
                    for e, comp in enumerate("xyzw"):
                        if 4 * a + e < t.seg:
                            code(f"const float e{4 * a + e} = u{a}.{comp};")
            else:
                for e in range(t.seg):
                    code(f"const float e{e} = xt[{ir * t.iw + e}];")
            for i, r in users:
                for jq, s in itertools.product(range(t.tq), range(st.s)):
                    code(f"acc{i}_{jq} = FMA(e{jq * sw + s * dw}, f{r}_{s}, acc{i}_{jq});")


def _store(code: Code, t: Tile, ch: str, epi: Epilogue) -> None:
    """Guarded stores of dst channel ``ch`` with the epilogue; 16-byte stores where they align."""
    st = t.st
    vstore = t.tq == 4 and st.wo % 4 == 0
    chan = f"{ch} + {st.dst_offset}" if st.dst_offset else ch
    code(f"const int qb = q0 + lx * {t.tq}, pb = p0 + ly * {t.tp};",
         f"const int ob = (n * {st.dst_planes} + {chan}) * {st.ho * st.wo} + qb;")
    with code.block(f"if (c < {st.groups})"):
        for i in range(t.tp):
            idx = f"ob + (pb + {i}) * {st.wo}"
            with code.block(f"if (pb + {i} < {st.ho})"):
                if vstore:
                    vals = ", ".join(epi.apply(f"acc{i}_{e}", ch, f"{idx} + {e}", offset_done=True)
                                     for e in range(4))
                    code(f"if (qb < {st.wo}) VSTORE4(MAKE_FLOAT4({vals}), 0, {st.dst} + {idx});")
                    continue
                for jq in range(t.tq):
                    val = epi.apply(f"acc{i}_{jq}", ch, f"{idx} + {jq}", offset_done=True)
                    code(f"if (qb + {jq} < {st.wo}) {st.dst}[{idx} + {jq}] = {val};")


def stencil_body(t: Tile, epi: Epilogue) -> str:
    """The kernel body of tile ``t`` (fprop fan-out or dgrad fan-in)."""
    st = t.st
    code = Code()
    _head(code, t)
    accs = [f"acc{i}_{jq}" for i, jq in itertools.product(range(t.tp), range(t.tq))]
    if not st.fan_in:
        _load(code, t, "0")
        code("BARRIER();")
        loop = f"for (int j = 0; j < {st.mult}; ++j)" if st.mult > 1 else "/* one filter per channel */"
        with code.block(loop):
            k = f"cw * {st.mult} + j" if st.mult > 1 else "cw"
            kout = f"c * {st.mult} + j" if st.mult > 1 else "c"
            _filter(code, st, k)
            code(*(f"float {a} = 0.0f;" for a in accs))
            _compute(code, t)
            _store(code, t, kout, epi)
        return code.text()
    code(*(f"float {a} = 0.0f;" for a in accs))
    loop = f"for (int j = 0; j < {st.mult}; ++j)" if st.mult > 1 else "/* one dy plane per channel */"
    with code.block(loop):
        j = "j" if st.mult > 1 else "0"
        if st.mult > 1:
            code("if (j > 0) BARRIER();  // the previous plane's tile is read")
        _load(code, t, j)
        code("BARRIER();")
        _filter(code, st, f"cw * {st.mult} + j" if st.mult > 1 else "cw")
        _compute(code, t)
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
# planes. H100, round 35, default against fl=0 in one sweep a layer (`bench --sweep --sweep-mods fl=0` on the 21
# grouped-suite layers it applies to, `sweep-depthwise-flat-*-2026-11-28-r35-h100.json`): fprop 1.10x geomean,
# 5x5 and 7x7 on 7x7 and 14x14 planes 1.08-1.35x (EfficientNet 1152@7 5x5 0.0232 -> 0.0172 ms), 3x3 on 14x14 1.01-1.23x;
# 3x3 on 7x7 planes 0.96-1.06x (960@7, 1152@7: 0.97x, 0.96x), left out; dgrad the same (1.10x).
FLAT_DEFAULT = True


def stencil_default(st: Stencil, device: DeviceInfo) -> Params:
    """An untuned tile for the real layers: 4 adjacent outputs per thread along a row (one 16-byte
    store), 2 rows where the plane has them (a 7x7 filter's rows are then read 8 times for 2 outputs,
    not 14), 4 rows for 7x7 filters on planes of >= 28 rows (H100, round 20: ConvNeXt-T 96@56 0.050
    -> 0.043 ms, 192@28 0.029 -> 0.025; no gain on 5x5 or 7x7 planes), the row's width in threads
    (up to 32), rows up to ~256 threads, and channels per block until a block has >= 128 threads
    (7x7 and 14x14 planes)."""
    if not device.is_gpu:
        prm = Params(bq=_fit(st.wo, 1, 8), bp=_fit(st.ho, 1, 4), bc=1, tq=1, tp=1, vec=False)
        return prm
    tq = 4 if st.wo >= 6 else 2 if st.wo >= 2 else 1
    tp = 4 if st.eff_r >= 7 and st.ho >= 28 else 2 if st.ho >= 6 else 1
    bq = _fit(st.wo, tq, 32)
    bp = _fit(st.ho, tp, max(1, 256 // bq))
    bc = max(1, min(st.groups, cdiv(128, bq * bp)))
    for _ in range(8):
        t = Tile(st, bq, bp, bc, tq, tp, False)
        t = Tile(st, bq, bp, bc, tq, tp, t.vec_ok)
        if t.problem(device) is None:
            if FLAT_DEFAULT and t.flat_ok and not (max(st.eff_r, st.eff_s) <= 3 and st.hi * st.wi <= 49):
                return Params(bq=bq, bp=bp, bc=bc, tq=tq, tp=tp, vec=t.vec, fl=True)
            return Params(bq=bq, bp=bp, bc=bc, tq=tq, tp=tp, vec=t.vec)
        if bc > 1:
            bc = max(1, bc // 2)
        elif bp > 1:
            bp = max(1, bp // 2)
        else:
            bq, tq = max(1, bq // 2), 1
    return Params(bq=8, bp=4, bc=1, tq=1, tp=1, vec=False)


def stencil_space(st: Stencil, device: DeviceInfo) -> list[Params]:
    """The default first, then tiles of 32..1024 threads not far larger than the plane."""
    out = [stencil_default(st, device)]
    for tq, tp, bq, bp, bc in itertools.product((4, 2, 1), (1, 2, 4), (4, 8, 14, 16, 28, 32),
                                                (1, 2, 4, 7, 8, 14, 16), (1, 2, 4, 8, 16)):
        if bq * tq > st.wo + 4 * tq + 3 or bp * tp > st.ho + tp + 7 or bc > st.groups:
            continue
        if bq * bp * bc < 32:
            continue
        for vec in (True, False):
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


# -- variants --------------------------------------------------------------------------------------
class Depthwise(Variant):
    """fprop of a depthwise layer (groups == C, any multiplier m = K / C), any stride, dilation and
    padding; bias, residual, ReLU and a concat's channel offset in the epilogue."""

    name = "depthwise"
    family = "depthwise"
    grouped = True
    exact = True
    residual_ok = True
    offset_ok = True
    tolerance = 1e-5
    specialised = 20
    space_lead = 1
    optional_params = {"fl": frozenset({False, True})}

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if not spec.depthwise:
            return "only depthwise layers (groups == C > 1)"
        why = super().applies(spec, device) or too_big(spec)
        if why is None and Tile(fprop_stencil(spec), 1, 1, 1, 1, 1, False).problem(device):
            return "one output's input window does not fit in shared memory"
        return why

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return stencil_default(fprop_stencil(spec), device)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return stencil_space(fprop_stencil(spec), device)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        t = Tile.of(fprop_stencil(spec, epilogue), params)
        _check_tile(self.name, t, device)
        name = "conv_depthwise"
        kernel = Kernel(name, (Buf("x"), Buf("w")) + out_args(epilogue), stencil_body(t, epilogue),
                        (t.threads, 1, 1), comment=f"{self.name}: {params.short()}")
        launch = Launch(name, (t.grid[3], 1, 1), (t.threads, 1, 1), ("x", "w") + out_refs(epilogue))
        return Plan(self.name, self.family, spec, params, (kernel,), (launch,), tolerance=self.tolerance,
                    epilogue=epilogue)


class DepthwiseDgrad(Variant):
    """dgrad of a stride-1 depthwise layer: the fprop kernel on dy with the rotated filter."""

    name = "depthwise_dgrad"
    family = "depthwise"
    passes = frozenset({"dgrad"})
    grouped = True
    exact = True
    tolerance = 1e-5
    specialised = 20
    space_lead = 1
    optional_params = {"fl": frozenset({False, True})}

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if not spec.depthwise:
            return "only depthwise layers (groups == C > 1)"
        if spec.stride != (1, 1):
            return "stride 1 only (dgrad_direct runs strided layers)"
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
        kernel = Kernel(name, (Buf("y"), Buf("w"), Buf("x", readonly=False)), stencil_body(t, epilogue),
                        (t.threads, 1, 1), comment=f"{self.name}: {params.short()}")
        launch = Launch(name, (t.grid[3], 1, 1), (t.threads, 1, 1), ("y", "w", "x"))
        return Plan(self.name, self.family, spec, params, (kernel,), (launch,), tolerance=self.tolerance,
                    epilogue=epilogue)


def wgrad_splits(spec: ConvSpec, device: DeviceInfo) -> int:
    """Slices of the N*P output rows: enough blocks (K x slices) for ~4 per compute unit."""
    want = cdiv(4 * max(device.units, 1), spec.k) if device.is_gpu else 1
    return max(1, min(spec.n * spec.p, want))


class DepthwiseWgrad(Variant):
    """wgrad of a depthwise layer: a per-channel reduction over N*P*Q. Block (k, slice) of ``bt``
    threads walks its slice of output rows (consecutive threads: consecutive columns, so dy loads
    coalesce), keeps one partial sum per tap in registers, then adds them across the block in a fixed
    shared-memory tree; with ``ns`` > 1 slices a second kernel adds the slices' partial filters in
    order into dw (deterministic: no atomics). Any stride, dilation and padding."""

    name = "depthwise_wgrad"
    family = "depthwise"
    passes = frozenset({"wgrad"})
    grouped = True
    exact = True
    tolerance = 1e-5
    specialised = 20
    space_lead = 1

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if not spec.depthwise:
            return "only depthwise layers (groups == C > 1)"
        why = super().applies(spec, device) or too_big(spec)
        if why is None and 4 * spec.r * spec.s * 32 > min(device.shared_bytes, _SMEM):
            return "the filter's partial sums do not fit in shared memory"
        return why

    def _fits(self, spec: ConvSpec, bt: int, device: DeviceInfo) -> bool:
        return bt <= device.max_threads and 4 * spec.r * spec.s * bt <= min(device.shared_bytes, _SMEM)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        bt = next((b for b in ((256, 128, 64, 32) if device.is_gpu else (32,)) if self._fits(spec, b, device)), 32)
        return Params(bt=bt, ns=wgrad_splits(spec, device))

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        out = [self.default(spec, device)]
        for bt, ns in itertools.product((64, 128, 256), (1, 2, 4, 8, 16, 32, 64)):
            prm = Params(bt=bt, ns=ns)
            if self._fits(spec, bt, device) and ns <= spec.n * spec.p and prm not in out:
                out.append(prm)
        return out

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 4 * params.ns * spec.k * spec.r * spec.s if params.ns > 1 else 0

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        bt, ns = params.bt, params.ns
        if bt & (bt - 1) or not self._fits(spec, bt, device):
            raise ValueError(f"{self.name}: bt ({bt}) must be a power of two whose {spec.r * spec.s} partial "
                             "sums fit in shared memory")
        if not 1 <= ns <= spec.n * spec.p:
            raise ValueError(f"{self.name}: ns ({ns}) must be 1..{spec.n * spec.p} (N*P output rows)")
        rs = spec.r * spec.s
        out = "w" if ns == 1 else "part"
        body = self._reduce_body(spec, bt, ns, out)
        name = "wgrad_depthwise"
        args = (Buf("x"), Buf("y"), Buf(out, readonly=False))
        kernels = [Kernel(name, args, body, (bt, 1, 1), comment=f"{self.name}: {params.short()}")]
        steps = [Launch(name, (spec.k, ns, 1), (bt, 1, 1), ("x", "y", out))]
        workspace: tuple[tuple[str, int], ...] = ()
        if ns > 1:
            total = spec.k * rs
            sums = " + ".join(f"part[{j * total} + e]" for j in range(ns))
            code = Code()
            code("const int e = GROUP_ID(0) * 256 + LOCAL_ID(0);")
            with code.block(f"if (e < {total})"):
                code(f"w[e] = {sums};  // the slices in order: the same sum on every run")
            kernels.append(Kernel("wgrad_depthwise_sum", (Buf("part"), Buf("w", readonly=False)), code.text(),
                                  (256, 1, 1), comment=f"sum of {ns} slices' partial filters"))
            steps.append(Launch("wgrad_depthwise_sum", (cdiv(total, 256), 1, 1), (256, 1, 1), ("part", "w")))
            workspace = (("part", self.workspace_bytes(spec, params)),)
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps), workspace,
                    tolerance=self.tolerance, epilogue=epilogue)

    @staticmethod
    def _reduce_body(spec: ConvSpec, bt: int, ns: int, out: str) -> str:
        """Block (k, slice): R*S partial sums over the slice's outputs, then a fixed tree."""
        (sh, sw), (dh, dw) = spec.stride, spec.dilation
        pt, pl = spec.pad[0], spec.pad[2]
        rs, rows, pq = spec.r * spec.s, spec.n * spec.p, spec.p * spec.q
        per = cdiv(rows, ns)
        code = Code()
        code(f"SHARED float part_[{rs * bt}];  // {rs} taps x {bt} threads",
             "const int t = LOCAL_ID(0), k = GROUP_ID(0);",
             f"const int c = k / {spec.kg};  // the input channel of k",
             f"const int row0 = GROUP_ID(1) * {per}, row1 = min(row0 + {per}, {rows});",
             f"const int count = (row1 - row0) * {spec.q};")
        for r, s_ in itertools.product(range(spec.r), range(spec.s)):
            code(f"float a{r}_{s_} = 0.0f;")
        with code.block(f"for (int e = t; e < count; e += {bt})"):
            code(f"const int row = row0 + e / {spec.q}, q = e % {spec.q};",
                 f"const int n = row / {spec.p}, p = row % {spec.p};",
                 f"const float g = LDG(y + (n * {spec.k} + k) * {pq} + p * {spec.q} + q);",
                 f"const GLOBAL_PTR float* xc = x + (n * {spec.c} + c) * {spec.h * spec.w};",
                 f"const int y0 = p * {sh} - {pt}, x0 = q * {sw} - {pl};")
            for r in range(spec.r):
                with code.block(f"if ((unsigned)(y0 + {r * dh}) < {spec.h}u)"):
                    code(f"const GLOBAL_PTR float* xr = xc + (y0 + {r * dh}) * {spec.w};")
                    for s_ in range(spec.s):
                        code(f"if ((unsigned)(x0 + {s_ * dw}) < {spec.w}u) "
                             f"a{r}_{s_} = FMA(LDG(xr + x0 + {s_ * dw}), g, a{r}_{s_});")
        for r, s_ in itertools.product(range(spec.r), range(spec.s)):
            code(f"part_[{(r * spec.s + s_) * bt} + t] = a{r}_{s_};")
        code("BARRIER();")
        half = bt // 2
        while half >= 1:
            with code.block(f"if (t < {half})"):
                with code.block(f"for (int j = 0; j < {rs}; ++j)"):
                    code(f"part_[j * {bt} + t] += part_[j * {bt} + t + {half}];")
            code("BARRIER();")
            half //= 2
        dst = f"GROUP_ID(1) * {spec.k * rs} + k * {rs} + j" if ns > 1 else f"k * {rs} + j"
        with code.block(f"for (int j = t; j < {rs}; j += {bt})"):
            code(f"{out}[{dst}] = part_[j * {bt}];")
        return code.text()


register(Depthwise())
register(DepthwiseDgrad())
register(DepthwiseWgrad())
