"""The rolled form of the depthwise wgrad (``depthwise_wgrad`` with ``rb``): NHWC, multiplier 1, any
storage dtype.

The blocked form gives each thread small items of ``tp`` x ``tq`` outputs: an item's input rows are read
again by the item below it, and each item's loads wait behind the previous item's sums. Here an item is a
band of ``rb`` output rows of a column strip of ``tq`` outputs, and its thread walks down the band one
output row a step. It keeps the input rows the step's taps read in a ring of registers (``cv`` channels
of ``seg`` columns a row), so each input row is loaded once a band; and the loads of the input rows and
dy row ``pd`` steps ahead are issued before the current step's FMAs, so a band's loads are in flight
while it sums. The loop body is the ``period`` steps after which the ring's slots repeat (every register
name static). Thread (lane, index) owns ``cv`` adjacent channels (one 4- or 8-byte load of halves a
pixel: consecutive lanes read one run of a pixel's channels); at the end the block's threads meet in the
blocked form's fixed tree and each block writes one partial filter (slice ``GROUP_ID(1)``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from convforge.codegen.dialect import Storage
from convforge.codegen.meta import Code, cdiv
from convforge.params import Params
from convforge.plan import DeviceInfo
from convforge.spec import ConvSpec

_REGS = 128  # a rough cap on the floats a thread holds (sums, ring, dy rows)
_SM_REGISTERS = 64 * 1024  # 32-bit registers of a CUDA compute unit (sm_50 .. sm_90)
_OVERHEAD = 40  # registers ptxas (13.0, sm_90a) takes past the floats: indices, pointers, loads hoisted across steps


class ChannelLanes:
    """A block of ``bc`` channel lanes of ``cv`` channels, each walked by ``bt`` threads over strips of ``tq``
    output columns (mixed into the NHWC parameter sets of the blocked and rolled forms)."""

    spec: ConvSpec
    bc: int
    bt: int
    cv: int
    tq: int

    @property
    def threads(self) -> int:
        return self.bc * self.bt

    @property
    def channels(self) -> int:
        """Output channels a block sums: bc lanes of cv."""
        return self.bc * self.cv

    @property
    def grid_q(self) -> int:
        return cdiv(self.spec.q, self.tq)


@dataclass(frozen=True)
class Roll(ChannelLanes):
    """One parameter set of the rolled form on one layer (module docstring)."""

    spec: ConvSpec
    bc: int  # channel lanes a block
    bt: int  # threads along the items for each lane (a power of two; the parameter bs)
    cv: int  # channels a thread (2 or 4)
    tq: int  # output columns a thread
    rb: int  # output rows an item
    pd: int = 1  # steps the loads run ahead (1 or 2)
    mb: int = 1  # blocks a compute unit the launch bound names

    @classmethod
    def of(cls, spec: ConvSpec, p: Params) -> Roll:
        return cls(spec, p.bc, p.bs, p.cv, p.tq, p.rb, p.get("pd", 1), p.get("mb", 1))

    @property
    def bands(self) -> int:
        return cdiv(self.spec.p, self.rb)

    @property
    def items(self) -> int:
        return self.spec.n * self.bands * self.grid_q

    @property
    def seg(self) -> int:
        """Input columns of a thread's row."""
        return (self.tq - 1) * self.spec.stride[1] + self.spec.eff_s

    @property
    def ring(self) -> int:
        """Input rows the registers hold: a step's and those of the ``pd`` steps whose loads are in flight."""
        return self.pd * self.spec.stride[0] + self.spec.eff_r

    @property
    def period(self) -> int:
        """Steps after which the ring's and the dy rows' slots repeat: the loop body."""
        sh = self.spec.stride[0]
        return next(u for u in itertools.count(1) if (u * sh) % self.ring == 0 and u % (self.pd + 1) == 0)

    @property
    def floats(self) -> int:
        s = self.spec
        return (s.r * s.s + self.ring * self.seg + (self.pd + 1) * self.tq) * self.cv

    def new_rows(self) -> range:
        """Offsets from a step's first input row (step * stride) of the rows it adds to the ring."""
        s = self.spec
        return range(max(s.eff_r - s.stride[0], 0), s.eff_r)

    def problem(self, device: DeviceInfo) -> str | None:
        s = self.spec
        if s.layout != "nhwc" or s.kg != 1:
            return "the rolled form reads NHWC layers of multiplier 1"
        if self.cv not in (2, 4) or s.k % self.cv:
            return f"cv ({self.cv}) must be 2 or 4 and divide K ({s.k})"
        if min(self.bc, self.bt, self.tq, self.rb) < 1 or self.bt & (self.bt - 1):
            return f"bs ({self.bt}) must be a power of two and bc, tq, rb >= 1"
        if self.pd not in (1, 2) or not 1 <= self.mb <= 32:
            return f"pd ({self.pd}) must be 1 or 2 and mb ({self.mb}) 1..32"
        if not 32 <= self.threads <= device.max_threads:
            return f"{self.threads} threads must be 32..{device.max_threads}"
        if self.floats > _REGS or self.period > 32:
            return f"taps, {self.ring} rows of {self.seg} columns and {self.pd + 1} dy rows ({self.floats} floats) " \
                   f"must fit in {_REGS} registers, a period of <= 32 steps"
        return None

    def bound(self) -> int:
        """Blocks a compute unit under the launch bound: as many as the estimated registers allow (<= 8)."""
        return max(1, min(8, _SM_REGISTERS // ((self.floats + _OVERHEAD) * self.threads)))


def roll_params(t: Roll, ns: int) -> Params:
    opt = {k: v for k, v, usual in (("pd", t.pd, 1), ("mb", t.mb, 1)) if v != usual}
    return Params({"bc": t.bc, "bs": t.bt, "cv": t.cv, "tq": t.tq, "rb": t.rb, **opt, "ns": ns})


def roll_slices(t: Roll, device: DeviceInfo) -> int:
    """Slices that fill each compute unit's ``mb`` slots once (at least one item a thread)."""
    if not device.is_gpu:
        return max(1, min(4, t.items // t.bt))
    slots = max(1, device.units) * t.mb
    return max(1, min(slots // cdiv(t.spec.k, t.channels), max(1, t.items // t.bt)))


def _lanes(spec: ConvSpec, cv: int) -> tuple[int, int]:
    """(bc, bs): every channel in one block where blocks of 32 lanes would leave a tenth of their lanes idle
    and the lanes make whole warps of <= 512 threads (MobileNet-v2's K = 144: 72 lanes of 2 channels x 4),
    else 32 lanes (fewer on narrow layers) in blocks of 128 threads."""
    lanes = spec.k // cv
    idle = cdiv(lanes, 32) * 32 - lanes
    whole = next(((lanes, bs) for bs in (4, 2, 8) if lanes * bs % 32 == 0 and lanes * bs <= 512), None)
    if whole is not None and lanes > 32 and 10 * idle >= lanes:
        return whole
    return min(32, lanes), max(1, 128 // min(32, lanes))


def roll_default(spec: ConvSpec, device: DeviceInfo, cv: int = 2, tq: int = 4, pd: int = 1,
                 rb: int = 16) -> Params | None:
    """A point of the form (None where it does not fit): lanes of ``cv`` channels (:func:`_lanes`),
    strips of ``tq`` columns, bands of ``rb`` rows (the plane's where shorter), loads ``pd`` steps ahead,
    the launch bound of :meth:`Roll.bound`, slices for one wave."""
    if spec.layout != "nhwc" or spec.kg != 1 or spec.k % cv:
        return None
    bc, bs = _lanes(spec, cv)
    t = Roll(spec, bc, bs, cv, min(tq, spec.q), min(rb, spec.p), pd)
    t = Roll(spec, bc, bs, cv, t.tq, t.rb, pd, t.bound() if device.is_gpu else 1)
    return roll_params(t, roll_slices(t, device)) if t.problem(device) is None else None


def roll_pick(spec: ConvSpec, device: DeviceInfo) -> Params | None:
    """The rolled form where the H200 A/B of 2026-12-03 (thirty-eighth session, FP16 NHWC, the bench's
    timing: inputs that fit in L2 rotated so they are read cold) measured it faster than the blocked form:
    3x3 filters at stride <= 2 on output planes of <= 14 rows, half storage. Bands of the whole plane,
    lanes of 2 channels in blocks of 128 threads, loads two steps ahead, strips of 4 columns where the
    registers allow (stride 1; float16 only: ptxas spilled 40-48 bytes on bfloat16's 14x14 layers), else 2.
    Against the blocked default there: 192@28/2 0.0191 -> 0.0168 ms,
    384@14 0.0186 -> 0.0137, 576@14 0.0221 -> 0.0190, 576@14/2 0.0183 -> 0.0134, 960@7 0.0159 -> 0.0152.
    On larger planes it lost (192@28 0.0260 -> 0.0294, 144@56 0.0514 -> 0.0703, 96@112/2 0.0705 ->
    0.1122): None there, and on a CPU device. bfloat16, the same A/B: the pick (strips of 2) the fastest of
    four points on all five layers, 1.20-1.33x the blocked default (960@7 0.0163 -> 0.0124 ms)."""
    if (not device.is_gpu or spec.dtype == "float32" or spec.r * spec.s > 9 or spec.p > 14
            or max(spec.stride) > 2):
        return None
    wide = roll_default(spec, device, 2, 4, 2, spec.p) if spec.dtype == "float16" else None
    return wide or roll_default(spec, device, 2, 2, 2, spec.p)


def roll_space(spec: ConvSpec, device: DeviceInfo) -> list[Params]:
    """Points of the rolled form: channels a thread, columns, bands, loads ahead, block sizes."""
    out: list[Params] = []
    for cv, tq, pd, rb in itertools.product((2, 4), (2, 4, 8), (1, 2), (8, 16, spec.p)):
        p = roll_default(spec, device, cv, tq, pd, rb)
        if p is not None:
            out.append(p)
    return list(dict.fromkeys(out))


def _vtype(cv: int) -> str:
    return f"float{cv}"


def _vload(sto: Storage, cv: int, ptr: str) -> str:
    return sto.vload2("0", ptr) if cv == 2 else sto.vload4("0", ptr)


def _comp(name: str, v: int) -> str:
    return f"{name}.{'xyzw'[v]}"


def roll_body(t: Roll, ns: int, store_out: str) -> str:
    """The rolled kernel's body (module docstring); ``store_out`` formats the statement writing float
    ``{v}`` to filter element ``{i}`` of slice ``GROUP_ID(1)`` (or of dw itself)."""
    from convforge.kernels.depthwise_wgrad import sum_chunk, tree_store  # that module imports this one

    s = t.spec
    sto = Storage(s.dtype)
    sh, sw = s.stride
    dh, dw = s.dilation
    rs, cv, z, u_steps = s.r * s.s, t.cv, t.ring, t.period
    per = cdiv(t.items, ns)
    vt = _vtype(cv)
    code = Code()
    chunk = sum_chunk(rs * cv, t.threads)
    code(f"SHARED float part_[{chunk * t.threads}];  // {chunk} of the {rs} taps x {cv} channels x {t.threads} "
         "threads at a time",
         f"const int tid = LOCAL_ID(0), lc = tid % {t.bc}, lt = tid / {t.bc};"
         "  // channels fastest: a warp's loads of one pixel are one run",
         f"const int k = (GROUP_ID(0) * {t.bc} + lc) * {cv}, kk = min(k, {s.k - cv});  // channels k .. k + {cv - 1}",
         f"const int it0 = GROUP_ID(1) * {per}, it1 = min(it0 + {per}, {t.items});",
         f"{vt} zero;",
         *(f"{_comp('zero', v)} = 0.0f;" for v in range(cv)))
    accs = [f"a{r}_{c}_{v}" for r, c, v in itertools.product(range(s.r), range(s.s), range(cv))]
    code(*(f"float {a} = 0.0f;" for a in accs))
    code(f"{vt} " + ", ".join(f"x{i}_{e} = zero" for i in range(z) for e in range(t.seg)) + ";"
         f"  // the ring: {z} input rows x {t.seg} columns",
         f"{vt} " + ", ".join(f"g{i}_{j} = zero" for i in range(t.pd + 1) for j in range(t.tq)) + ";"
         f"  // {t.pd + 1} dy rows x {t.tq} columns")
    with code.block(f"for (int it = it0 + lt; it < it1; it += {t.bt})  /* bands of {t.rb} rows x {t.tq} columns */"):
        code(f"const int qc = it % {t.grid_q}, pb = (it / {t.grid_q}) % {t.bands}, n = it / {t.grid_q * t.bands};",
             f"const int p0 = pb * {t.rb}, q0 = qc * {t.tq}, pn = min({t.rb}, {s.p} - p0);  // the band's rows",
             f"const int y0 = p0 * {sh} - {s.pad[0]}, x0 = q0 * {sw} - {s.pad[2]};",
             f"const int xrows = (pn - 1) * {sh} + {s.eff_r};  // input rows the band reads")
        for m in range(t.pd):  # the first pd steps' rows and dy rows
            offs = range(s.eff_r) if m == 0 else t.new_rows()
            for o in offs:
                _x_row(code, t, sto, m * sh + o, str(m * sh + o))
            _dy_row(code, t, sto, m, str(m))
        with code.block(f"for (int j0 = 0; j0 < pn; j0 += {u_steps})  /* {u_steps} steps: the slots' period */"):
            for u in range(u_steps):
                with code.block(""):
                    if u:
                        code(f"if (j0 + {u} >= pn) break;")
                    m = u + t.pd  # the step whose loads this one issues
                    for o in t.new_rows():
                        _x_row(code, t, sto, m * sh + o, f"(j0 + {m}) * {sh} + {o}")
                    _dy_row(code, t, sto, m, f"j0 + {m}")
                    for r, jq, c, v in itertools.product(range(s.r), range(t.tq), range(s.s), range(cv)):
                        xi = f"x{(u * sh + r * dh) % z}_{jq * sw + c * dw}"
                        gi = f"g{u % (t.pd + 1)}_{jq}"
                        code(f"a{r}_{c}_{v} = FMA({_comp(xi, v)}, {_comp(gi, v)}, a{r}_{c}_{v});")
    kj = f"(k + j % {cv}) * {rs} + j / {cv}"  # sum j: tap j / cv of channel k + j % cv
    dst = f"GROUP_ID(1) * {s.k * rs} + {kj}" if ns > 1 else kj
    tree_store(code, accs, chunk, t.threads, t.bc, t.bt, f"if (k < {s.k})",
               lambda row: store_out.format(i=dst, v=f"part_[{row} * {t.threads} + lc]"))
    return code.text()


def _x_row(code: Code, t: Roll, sto: Storage, i: int, ri: str) -> None:
    """Input row ``ri`` (relative to the band's first, an expression; ``i``: its value modulo the ring's
    period) into its ring slot: zeros outside the plane and past the band's rows."""
    s = t.spec
    z = i % t.ring
    code(f"const bool in{z} = (unsigned)(y0 + {ri}) < {s.h}u && {ri} < xrows;  // input row {ri} -> slot {z}")
    base = f"x + ((n * {s.h} + y0 + {ri}) * {s.w} + x0) * {s.c} + kk"
    for e in range(t.seg):
        load = _vload(sto, t.cv, f"{base} + {e * s.c}")
        code(f"x{z}_{e} = (in{z} && (unsigned)(x0 + {e}) < {s.w}u) ? {load} : zero;")


def _dy_row(code: Code, t: Roll, sto: Storage, m: int, mi: str) -> None:
    """dy row ``mi`` of the band (``m``: its value modulo the period) into its slot: zeros past the band."""
    s = t.spec
    base = f"y + ((n * {s.p} + p0 + {mi}) * {s.q} + q0) * {s.k} + kk"
    for jq in range(t.tq):
        code(f"g{m % (t.pd + 1)}_{jq} = ({mi} < pn && q0 + {jq} < {s.q}) ? "
             f"{_vload(sto, t.cv, f'{base} + {jq * s.k}')} : zero;")
