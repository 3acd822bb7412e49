"""The streamed form of the depthwise wgrad (``depthwise_wgrad`` with ``sc``): NHWC, multiplier 1, C a
multiple of 8.

The blocked form keeps a small item of outputs and its input window in each thread's registers, so
each thread waits on a chain of loads item after item, and its halo is re-read through L1 once per
item. Here block (channel block, slice) streams whole rows instead: for each output row of its items
(bands of ``sb`` rows of one image) it holds the ``sc`` channels of the input rows the row's taps
read in a ring of shared-memory rows (float32, zero-padded at both ends), and the dy row beside them.
Each step (``sr`` output rows) every thread first issues the 16-byte loads of the next step's new
input rows and dy rows into registers, then sums the current step from shared memory, then stores
what it loaded and meets the others at one barrier: a block's next rows are in flight while it
computes, each input and dy element is read from memory once (band edges aside). Thread (lane,
strip, row group) owns two channels, ``sq`` adjacent output columns and ``ceil(R / sg)`` filter rows:
one partial sum per tap and channel, the ``(sq - 1) * stride + S`` input values of a filter row read
from shared memory once for its ``sq * S`` FMAs. At the end the strips' sums meet in a fixed order
in shared memory and each block writes one partial filter (slice ``GROUP_ID(1)``); the slices are
added by the same fixed-order sum as the blocked form's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from convforge.codegen.dialect import Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels.depthwise import REG_TAPS
from convforge.params import Params
from convforge.plan import DeviceInfo
from convforge.spec import ConvSpec

SMEM_BYTES = 48 * 1024  # static shared memory a block may declare
_CHUNK = 8  # elements of one 16-byte load of halves (two float4 loads of float32)
_MAX_TRIPS = 8  # loads a thread stages a step (registers: 8 floats each)
_REGS = 168  # a rough cap on the floats a thread holds (sums, window, dy, staged loads)
_RESIDENT = 2048  # threads a compute unit keeps resident (sm_80 .. sm_90)
_PAD = 8  # floats (32 bytes) after each strip's columns in a shared row: a warp's strips start on 4 bank offsets


@dataclass(frozen=True)
class Stream:
    """One parameter set of the streamed form on one layer (module docstring)."""

    spec: ConvSpec
    sc: int  # channels a block (a multiple of 8)
    sq: int  # output columns a thread
    sg: int  # filter-row groups (threads split the filter rows)
    sb: int  # output rows an item (a band of one image)
    sr: int  # output rows a step
    sv: int = 2  # channels a thread (one float2 or float4 shared-memory read)

    @classmethod
    def of(cls, spec: ConvSpec, p: Params) -> Stream:
        return cls(spec, p.sc, p.sq, p.get("sg", 1), p.sb, p.get("sr", 1), p.get("sv", 2))

    @property
    def lanes(self) -> int:
        """Threads along the channels (sv channels each)."""
        return self.sc // self.sv

    @property
    def row_floats(self) -> int:
        """Floats of a ring row: ws columns of sc channels, and _PAD after every strip's sq columns (so the
        strips of a warp read different banks)."""
        return self.ws * self.sc + cdiv(self.ws, self.sq) * _PAD

    @property
    def dy_floats(self) -> int:
        """Floats of a dy row in shared memory (padded as the ring's)."""
        return self.qs * self.sc + self.strips * _PAD

    def col(self, c: str) -> str:
        """The offset of column ``c`` (an expression) in a padded row."""
        return f"({c}) * {self.sc} + ({c}) / {self.sq} * {_PAD}"

    @property
    def strips(self) -> int:
        return cdiv(self.spec.q, self.sq)

    @property
    def rpg(self) -> int:
        """Filter rows a thread sums."""
        return cdiv(self.spec.r, self.sg)

    @property
    def threads(self) -> int:
        return self.lanes * self.strips * self.sg

    @property
    def span(self) -> int:
        """Input rows one step reads."""
        s = self.spec
        return (self.sr - 1) * s.stride[0] + s.eff_r

    @property
    def new_rows(self) -> int:
        """Input rows a step adds to the ring (the rest it shares with the step before)."""
        return min(self.sr * self.spec.stride[0], self.span)

    @property
    def slots(self) -> int:
        """Ring rows: one step's and the next one's new rows."""
        return self.span + self.sr * self.spec.stride[0]

    @property
    def ws(self) -> int:
        """Columns of a ring row: every column a strip reads (left padding included)."""
        s = self.spec
        return (self.strips * self.sq - 1) * s.stride[1] + s.eff_s

    @property
    def wl(self) -> int:
        """Image columns loaded into a ring row (the rest stay zero)."""
        return max(0, min(self.spec.w, self.ws - self.spec.pad[2]))

    @property
    def qs(self) -> int:
        """Columns of a dy row in shared memory (past Q: zeros)."""
        return self.strips * self.sq

    @property
    def window(self) -> int:
        """Input values of one filter row a thread reads a step row."""
        return (self.sq - 1) * self.spec.stride[1] + self.spec.eff_s

    @property
    def ring_floats(self) -> int:
        return self.slots * self.row_floats + 2 * self.sr * self.dy_floats

    @property
    def smem_floats(self) -> int:
        """The ring and dy rows, or the end's strip sums (the same memory, reused)."""
        s = self.spec
        return max(self.ring_floats, self.strips * self.sc * s.r * s.s)

    @property
    def bands(self) -> int:
        return cdiv(self.spec.p, self.sb)

    @property
    def items(self) -> int:
        return self.spec.n * self.bands

    @property
    def cblocks(self) -> int:
        return cdiv(self.spec.k, self.sc)

    @property
    def step_chunks(self) -> int:
        """16-byte loads of one step: its new input rows and dy rows."""
        s = self.spec
        return (self.new_rows * self.wl + self.sr * s.q) * (self.sc // _CHUNK)

    @property
    def trips(self) -> int:
        return cdiv(self.step_chunks, self.threads)

    @property
    def registers(self) -> int:
        """Floats a thread holds, roughly: sums, one filter row's window, dy, staged loads."""
        s = self.spec
        return self.sv * (self.rpg * s.s + self.window + self.sr * self.sq) + _CHUNK * self.trips

    def blocks_per_unit(self, device: DeviceInfo) -> int:
        """Blocks a compute unit keeps resident (shared memory and threads)."""
        unit = max(device.shared_optin_bytes, 64 * 1024)  # a unit's shared memory, about its opt-in block's
        by_smem = unit // max(1, 4 * self.smem_floats)
        return max(1, min(32, by_smem, _RESIDENT // max(1, self.threads)))

    def problem(self, device: DeviceInfo) -> str | None:
        s = self.spec
        if s.layout != "nhwc" or s.kg != 1 or s.c % _CHUNK:
            return f"the streamed form reads NHWC channels of a multiplier-1 layer whose C is a multiple of {_CHUNK}"
        if s.r * s.s > REG_TAPS:
            return f"{s.r}x{s.s} filters are the tiled form's (the streamed form keeps up to {REG_TAPS} taps)"
        if self.sc < _CHUNK or self.sc % _CHUNK or min(self.sq, self.sg, self.sb, self.sr) < 1 or self.sv not in (2, 4):
            return f"sc ({self.sc}) must be a multiple of {_CHUNK}, sv ({self.sv}) 2 or 4 and sq, sg, sb, sr >= 1"
        if self.sg > s.r or self.sr > 2 or self.sb < self.sr:
            return f"sg ({self.sg}) must be <= R ({s.r}), sr ({self.sr}) 1 or 2 and sb ({self.sb}) >= sr"
        if self.threads > device.max_threads:
            return f"{self.threads} threads (sc / sv x {self.strips} strips x sg) exceed {device.max_threads}"
        if 4 * self.smem_floats > SMEM_BYTES:
            return f"{4 * self.smem_floats} bytes of ring rows exceed {SMEM_BYTES} bytes of shared memory"
        if self.wl < 1:
            return f"left padding ({s.pad[2]}) covers the ring's {self.ws} columns"
        if self.trips > _MAX_TRIPS or self.registers > _REGS:
            return (f"a step's {self.trips} loads a thread and {self.registers} floats must stay within "
                    f"{_MAX_TRIPS} and {_REGS}")
        return None


def stream_default(spec: ConvSpec, device: DeviceInfo) -> Params | None:
    """The streamed form's parameters where it applies: blocks of 32 channels where K is a multiple of 32
    (16, 8 otherwise), the widest strips (8, 4, 2 columns) that still give a block >= 96 threads, filter
    rows split one a thread past 3x3, bands sized so that about the resident blocks' worth of slices run,
    each block taking ~2 items (bands no shorter than twice their halo rows); None where no set fits."""
    sg = 1 if spec.r <= 3 else spec.r
    sc0 = next(c for c in (32, 16, 8) if spec.k % c == 0 or c == _CHUNK)
    fits = [t for sc in dict.fromkeys((sc0, 16, 8)) for sq in (8, 4, 2)
            if (t := Stream(spec, sc, sq, sg, spec.p, 1)).problem(device) is None]
    if not fits:
        return None
    t = next((t for t in fits if t.threads >= 96), max(fits, key=lambda t: t.threads))
    if not device.is_gpu:
        return _params(t, min(t.items, 4))
    want = max(1, device.units) * t.blocks_per_unit(device) // t.cblocks  # slices that fill the units once
    halo = max(4, 2 * (spec.eff_r - spec.stride[0]))  # shortest band: its halo rows re-read at most half again
    bands = max(1, min(cdiv(2 * want, spec.n), spec.p // halo or 1))
    t = Stream(spec, t.sc, t.sq, sg, cdiv(spec.p, bands), 1)
    return _params(t, max(1, min(t.items, want)))


def stream_pick(spec: ConvSpec, device: DeviceInfo) -> Params | None:
    """The streamed form where the H200 sweep of 2026-11-30 measured it faster than the blocked form, in
    half storage: 7x7 filters on planes of <= 14 rows (ConvNeXt-T's 384@14 0.0247 -> 0.0188 ms, 768@7
    0.0182 -> 0.0152), in blocks of 32 channels, strips of 8 columns, two rows a step, bands of 14 rows,
    32 slices; else None (3x3 and 5x5 layers and larger planes: the blocked form ran 1.05-2x faster)."""
    if not device.is_gpu or spec.dtype == "float32" or spec.r * spec.s <= 25 or spec.p > 14:
        return None
    sc = 32 if spec.k >= 32 else 16
    t = Stream(spec, sc, 8, spec.r, max(2, min(spec.p, 14)), 2)
    return _params(t, max(1, min(t.items, 32))) if t.problem(device) is None else None


def stream_space(spec: ConvSpec, device: DeviceInfo) -> list[Params]:
    """The default, then the default changed along one axis at a time (channels a block, columns a
    thread, channels a thread, rows a step, band length, slices), then the product of the first four."""
    base = stream_default(spec, device)
    if base is None:
        return []
    d = Stream.of(spec, base)
    axes: list[dict[str, int]] = ([{"sc": v} for v in (8, 16, 32, 64)] + [{"sq": v} for v in (2, 4, 8)]
                                  + [{"sv": 4}, {"sr": 2}, {"sv": 4, "sr": 2}]
                                  + [{"sb": v} for v in (spec.p, 2 * d.sb, d.sb // 2)]
                                  + [{"ns": v} for v in (base.ns // 2, 2 * base.ns)])
    axes += [{"sc": sc, "sq": sq, "sv": sv, "sr": sr}
             for sc, sq, sv, sr in itertools.product((8, 16, 32, 64), (2, 4, 8), (2, 4), (1, 2))]
    out = [base]
    for mod in axes:
        f = {"sc": d.sc, "sq": d.sq, "sv": d.sv, "sr": d.sr, "sb": d.sb, "ns": base.ns, **mod}
        t = Stream(spec, f["sc"], f["sq"], d.sg, max(f["sr"], f["sb"]), f["sr"], f["sv"])
        if t.problem(device) is None:
            out.append(_params(t, max(1, min(t.items, f["ns"]))))
    return list(dict.fromkeys(out))


def _params(t: Stream, ns: int) -> Params:
    opt = {k: v for k, v, usual in (("sg", t.sg, 1), ("sr", t.sr, 1), ("sv", t.sv, 2)) if v != usual}
    return Params({"sc": t.sc, "sq": t.sq, "sb": t.sb, **opt, "ns": ns})


def stream_body(t: Stream, sto: Storage, store_out: str) -> str:
    """The streamed kernel's body (module docstring); ``store_out`` formats the statement writing
    float ``{v}`` to filter element ``{i}`` of slice ``GROUP_ID(1)`` (or of dw itself)."""
    s = t.spec
    code = Code()
    code(f"SHARED float4 sm4[{cdiv(t.smem_floats, 4)}];  // ring of {t.slots} input rows x {t.ws} columns x "
         f"{t.sc} channels, then {2 * t.sr} dy rows ({_PAD} floats after every {t.sq} columns)",
         "LOCAL_PTR float* xs = (LOCAL_PTR float*)sm4;",
         f"LOCAL_PTR float* ds = xs + {t.slots * t.row_floats};",
         f"const int tid = LOCAL_ID(0), lp = tid % {t.lanes}, st = (tid / {t.lanes}) % {t.strips}, "
         f"rg = tid / {t.lanes * t.strips};",
         f"const int c0 = GROUP_ID(0) * {t.sc}, q0 = st * {t.sq};")
    code(*(f"float {_acc(i, c, e)} = 0.0f;" for i, c, e in itertools.product(range(t.rpg), range(s.s), _V[t.sv])))
    with code.block(f"for (int z = tid; z < {cdiv(t.smem_floats, 4)}; z += {t.threads})"):
        code("sm4[z] = MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f);  // the ring's padding columns stay zero")
    code("BARRIER();")
    with code.block(f"for (int item = GROUP_ID(1); item < {t.items}; item += NUM_GROUPS(1))"):
        code(f"const int n = item / {t.bands}, pa = (item % {t.bands}) * {t.sb}, pb = min(pa + {t.sb}, {s.p});")
        _prologue(code, t, sto)
        code("BARRIER();")
        with code.block(f"for (int p = pa; p < pb; p += {t.sr})"):
            code(f"const int pn = p + {t.sr};  // the next step's first output row",
                 f"const int y1 = pn * {s.stride[0]} - {s.pad[0]} + {t.span - t.new_rows};  // its first new input row")
            _staged_loads(code, t, sto)
            _compute(code, t)
            _staged_stores(code, t)
            code("BARRIER();")
    _reduce(code, t, store_out)
    return code.text()


_V = {2: "xy", 4: "xyzw"}  # the components of a thread's sv channels


def _acc(i: int, c: int, e: str) -> str:
    return f"a{i}_{c}{e}"


def _x_chunk(t: Stream, i: str, y: str, sto: Storage, v: str) -> tuple[list[str], str]:
    """Chunk ``i`` of the input rows from ``y`` on: statements loading it into float4 ``v``a / ``v``b
    (zeros outside the image and past C) and the ring offset it goes to."""
    s = t.spec
    return _chunk(t, i, y, sto, v, t.wl, f"(unsigned){v}r < {s.h}u",
                  f"x + ((n * {s.h} + {v}r) * {s.w} + {v}x) * {s.c}",
                  f"xs + (({v}r + {s.pad[0]}) % {t.slots}) * {t.row_floats} + {t.col(f'{s.pad[2]} + {v}x')}")


def _dy_chunk(t: Stream, i: str, p: str, sto: Storage, v: str) -> tuple[list[str], str]:
    """Chunk ``i`` of the dy rows from ``p`` on (zeros past the item's band), and its offset."""
    s = t.spec
    return _chunk(t, i, p, sto, v, s.q, f"{v}r < pb", f"y + ((n * {s.p} + {v}r) * {s.q} + {v}x) * {s.k}",
                  f"ds + ({v}r % {2 * t.sr}) * {t.dy_floats} + {t.col(f'{v}x')}")


def _chunk(t: Stream, i: str, row0: str, sto: Storage, v: str, cols: int, ok: str, src: str,
           dst: str) -> tuple[list[str], str]:
    """Chunk ``i`` of rows of ``cols`` pixels from row ``row0`` on (``v``r, ``v``x, ``v``c: its row,
    column and first channel): the statements loading it where ``ok`` (else zeros, and past C) from
    ``src`` + c0 + ``v``c, and its shared offset ``dst`` + ``v``c."""
    cc = t.sc // _CHUNK
    lines = [f"const int {v}r = {row0} + {i} / {cols * cc}, {v}x = ({i} % {cols * cc}) / {cc}, "
             f"{v}c = ({i} % {cc}) * {_CHUNK};",
             f"float4 {v}a = MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f), {v}b = {v}a;",
             f"if ({ok} && c0 + {v}c < {t.spec.c}) " + sto.vload8(f"{v}a", f"{v}b", "0", f"{src} + c0 + {v}c") + ";"]
    return lines, f"{dst} + {v}c"


def _put(v: str, at: str) -> str:
    return f"VSTORE4({v}a, 0, {at}); VSTORE4({v}b, 1, {at});"


def _prologue(code: Code, t: Stream, sto: Storage) -> None:
    """The first step's input rows (all of its span) and dy rows, load then store."""
    s = t.spec
    xc = t.span * t.wl * (t.sc // _CHUNK)
    total = xc + t.sr * s.q * (t.sc // _CHUNK)
    with code.block(f"for (int i = tid; i < {total}; i += {t.threads})"):
        with code.block(f"if (i < {xc})"):
            lines, at = _x_chunk(t, "i", f"pa * {s.stride[0]} - {s.pad[0]}", sto, "v")
            code(*lines, _put("v", at))
        with code.block("else"):
            lines, at = _dy_chunk(t, f"(i - {xc})", "pa", sto, "v")
            code(*lines, _put("v", at))


def _staged_loads(code: Code, t: Stream, sto: Storage) -> None:
    """The next step's new input rows and dy rows into registers (each thread ``trips`` chunks)."""
    xc = t.new_rows * t.wl * (t.sc // _CHUNK)
    for j in range(t.trips):
        i = f"(tid + {j * t.threads})"
        code(f"float4 s{j}a = MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f), s{j}b = s{j}a;")
        with code.block(f"if (pn < pb && {i} < {t.step_chunks})"):
            with code.block(f"if ({i} < {xc})"):
                lines, _ = _x_chunk(t, i, "y1", sto, "v")
                code(*lines, f"s{j}a = va; s{j}b = vb;")
            with code.block("else"):
                lines, _ = _dy_chunk(t, f"({i} - {xc})", "pn", sto, "v")
                code(*lines, f"s{j}a = va; s{j}b = vb;")


def _staged_stores(code: Code, t: Stream) -> None:
    """The staged chunks into the ring and the dy rows (slots the current step does not read)."""
    s = t.spec
    xc = t.new_rows * t.wl * (t.sc // _CHUNK)
    xper, dper, cc = t.wl * (t.sc // _CHUNK), s.q * (t.sc // _CHUNK), t.sc // _CHUNK
    for j in range(t.trips):
        i = f"(tid + {j * t.threads})"
        with code.block(f"if (pn < pb && {i} < {t.step_chunks})"):
            with code.block(f"if ({i} < {xc})"):
                y, x, c = f"(y1 + {i} / {xper})", f"(({i} % {xper}) / {cc})", f"(({i} % {cc}) * {_CHUNK})"
                at = f"xs + (({y} + {s.pad[0]}) % {t.slots}) * {t.row_floats} + {t.col(f'{s.pad[2]} + {x}')} + {c}"
                code(_put(f"s{j}", at))
            with code.block("else"):
                k = f"({i} - {xc})"
                p, x, c = f"(pn + {k} / {dper})", f"(({k} % {dper}) / {cc})", f"(({k} % {cc}) * {_CHUNK})"
                code(_put(f"s{j}", f"ds + (({p}) % {2 * t.sr}) * {t.dy_floats} + {t.col(x)} + {c}"))


def _compute(code: Code, t: Stream) -> None:
    """The current step's sums from shared memory: this thread's dy values of each output row (the loads
    stored zeros past the band), then per input row its window of values (float2 / float4: sv channels) and the FMAs of
    every output row and filter row that meet there (sg > 1: per output row, this thread's filter rows)."""
    s = t.spec
    sh, dh = s.stride[0], s.dilation[0]
    vec = f"float{t.sv}"
    dy0 = f"st * {t.sq * t.sc + _PAD} + {t.sv} * lp"
    for i in range(t.sr):
        code(f"const LOCAL_PTR float* gr{i} = ds + ((p + {i}) % {2 * t.sr}) * {t.dy_floats} + {dy0};",
             *(f"const {vec} g{i}_{j} = {_vload(t, f'gr{i} + {j * t.sc}')};" for j in range(t.sq)))
    if t.sg == 1:
        for ir in range(t.span):
            users = [(i, (ir - i * sh) // dh) for i in range(t.sr)
                     if ir >= i * sh and (ir - i * sh) % dh == 0 and (ir - i * sh) // dh < s.r]
            if users:
                _window(code, t, f"x{ir}", f"(p * {sh} + {ir}) % {t.slots}")
                for i, r in users:
                    _fmas(code, t, f"x{ir}", i, r)
        return
    for i in range(t.sr):
        for ri in range(t.rpg):
            row = f"rg * {t.rpg} + {ri}"
            with code.block(f"if ({row} < {s.r})" if s.r % t.sg else ""):
                _window(code, t, f"x{i}_{ri}", f"((p + {i}) * {sh} + ({row}) * {dh}) % {t.slots}")
                _fmas(code, t, f"x{i}_{ri}", i, ri)


def _vload(t: Stream, at: str) -> str:
    return f"VLOAD{t.sv}(0, {at})"


def _window(code: Code, t: Stream, name: str, slot: str) -> None:
    """``name``_e: the thread's window of one ring row (``slot``), its sv channels at each column."""
    sw = t.spec.stride[1]
    code(f"const LOCAL_PTR float* {name} = xs + ({slot}) * {t.row_floats} + st * {t.sq * sw * t.sc + sw * _PAD} "
         f"+ {t.sv} * lp;",
         *(f"const float{t.sv} {name}_{e} = {_vload(t, f'{name} + {e * t.sc + e // t.sq * _PAD}')};"
           for e in range(t.window)))


def _fmas(code: Code, t: Stream, win: str, i: int, acc_row: int) -> None:
    """sq x S FMAs a channel: output row i's dy values times window ``win`` into the sums of row
    ``acc_row`` (the filter row; with sg > 1 the thread's acc_row-th)."""
    s = t.spec
    sw, dw = s.stride[1], s.dilation[1]
    for j, c in itertools.product(range(t.sq), range(s.s)):
        e = f"{win}_{j * sw + c * dw}"
        code(*(f"{_acc(acc_row, c, v)} = FMA({e}.{v}, g{i}_{j}.{v}, {_acc(acc_row, c, v)});" for v in _V[t.sv]))


def _reduce(code: Code, t: Stream, store_out: str) -> None:
    """The strips' sums in shared memory (the ring's memory, free after the last barrier), then each
    filter element of the block summed over the strips in order and stored."""
    s = t.spec
    rs = s.r * s.s
    ent = t.sc * rs
    for ri in range(t.rpg):
        r = f"(rg * {t.rpg} + {ri})" if t.sg > 1 else f"{ri}"
        with code.block(f"if ({r} < {s.r})" if t.sg > 1 and s.r % t.sg else ""):
            for c, (ch, v) in itertools.product(range(s.s), enumerate(_V[t.sv])):
                code(f"xs[st * {ent} + (({t.sv} * lp + {ch}) * {s.r} + {r}) * {s.s} + {c}] = {_acc(ri, c, v)};")
    code("BARRIER();")
    with code.block(f"for (int e = tid; e < {ent}; e += {t.threads})"):
        with code.block(f"if (c0 + e / {rs} < {s.k})"):
            code("float v = 0.0f;",
                 f"for (int j = 0; j < {t.strips}; ++j) v += xs[j * {ent} + e];",
                 store_out.format(i=f"c0 * {rs} + e", v="v") + ";")
