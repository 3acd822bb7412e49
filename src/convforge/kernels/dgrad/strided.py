"""Strided dgrad as an implicit GEMM that never multiplies the zeros of a zero-stuffed dy.

dx[n, c, h, w] sums dy[n, k, p, q] . w[k, c, r, s] over the taps with h + pt - r*dh = p*sh (and the
same along w). Whether tap r reaches row h depends only on h mod sh: the dx rows of one *phase*
ph = h mod sh are reached by the taps r with (ph + pt - r*dh) % sh == 0 (r*dh = ph + pt mod sh), and
for h = ph + i*sh such a tap reads dy row p = i + (ph + pt - r*dh) / sh. Grouping the dx pixels by
phase (ph_h, ph_w) turns the layer into sh*sw dense GEMMs (CUTLASS's strided dgrad), each

    dx_phase (cg x N*Hm*Wm) = w_phase (cg x kg*taps) . dy gathered (kg*taps x N*Hm*Wm),

with Hm = ceil(H / sh) rows per phase (phases with fewer rows mask the extra ones) and taps the
phase's (r, s) pairs; a phase no tap reaches (a 1x1 filter at stride 2, or gcd(dh, sh) > 1) is zeros.
All phases and groups run in one launch (grid z), each with its own reduction length, on the
shared SGEMM generator (kernels/sgemm.py). One weight step prepares it: the filters packed phase
by phase as row-major cg x (taps x kg) matrices (float4 loads along the reduction); the dy offset
of each tap is arithmetic (the taps of a phase are evenly spaced). Stride 1 is the one-phase case:
the implicit GEMM of the transposed problem. Dilation is handled the same way: the taps of one phase
are sh / gcd(sh, dh) apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from convforge.codegen.dialect import Buf, Kernel
from convforge.codegen.meta import cdiv
from convforge.kernels import register
from convforge.kernels.dgrad.baseline import no_epilogue
from convforge.kernels.gemm import elementwise, too_big
from convforge.kernels.sgemm import (
    GemmShape,
    Operand,
    Store,
    gemm_block,
    gemm_default,
    gemm_grid,
    gemm_kernel,
    gemm_space,
    lean_point,
)
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec


@dataclass(frozen=True)
class Axis:
    """One spatial dimension of a dgrad: ``size`` dx rows, ``out`` dy rows, ``taps`` filter taps,
    stride, dilation and leading padding."""

    size: int
    out: int
    taps: int
    stride: int
    dil: int
    pad: int

    @property
    def step(self) -> int:
        """Distance between two taps of one phase."""
        return self.stride // gcd(self.stride, self.dil)

    def phase_of(self, r: int) -> int:
        """The phase (dx row mod stride) that tap ``r`` reaches."""
        return (r * self.dil - self.pad) % self.stride

    def taps_of(self, ph: int) -> list[int]:
        """The taps reaching phase ``ph``, ascending; tap r is the (r // step)-th of them."""
        return [r for r in range(self.taps) if self.phase_of(r) == ph]

    @property
    def counts(self) -> list[int]:
        return [len(self.taps_of(ph)) for ph in range(self.stride)]

    @property
    def firsts(self) -> list[int]:
        """Taps of the phases before each phase (prefix sums of :attr:`counts`)."""
        out, acc = [], 0
        for n in self.counts:
            out.append(acc)
            acc += n
        return out

    def offset(self, ph: int, r: int) -> int:
        """dy row i + offset is read by tap ``r`` for dx row ph + i*stride."""
        return (ph + self.pad - r * self.dil) // self.stride

    @property
    def first_offsets(self) -> list[int]:
        """Per phase, the dy row offset of its first tap (0 for a phase no tap reaches)."""
        return [self.offset(ph, taps[0]) if (taps := self.taps_of(ph)) else 0 for ph in range(self.stride)]

    @property
    def delta(self) -> int:
        """How much the dy row offset drops from one tap of a phase to the next (dil / gcd)."""
        return self.dil // gcd(self.stride, self.dil)

    @property
    def rows(self) -> int:
        """Rows of every phase's grid (phase 0 has the most; others mask the extra row)."""
        return cdiv(self.size, self.stride)


def axes(spec: ConvSpec) -> tuple[Axis, Axis]:
    return (Axis(spec.h, spec.p, spec.r, spec.stride[0], spec.dilation[0], spec.pad[0]),
            Axis(spec.w, spec.q, spec.s, spec.stride[1], spec.dilation[1], spec.pad[2]))


def chain(var: str, values: list[int]) -> str:
    """C expression of values[var] for var in 0..len-1 (a constant when they are all equal)."""
    if len(set(values)) == 1:
        return str(values[0])
    expr = str(values[-1])
    for i in range(len(values) - 2, -1, -1):
        expr = f"{var} == {i} ? {values[i]} : {expr}"
    return f"({expr})"


def phase_lines(ah: Axis, aw: Axis, s: int, h: str, w: str, pre: str = "") -> list[str]:
    """Given phase row ``h`` and column ``w``: {pre}nr, {pre}ns (taps of the phase along each
    axis) and {pre}t0 (taps of all phases before it, in phase order)."""
    return [f"const int {pre}nr = {chain(h, ah.counts)}, {pre}ns = {chain(w, aw.counts)};",
            f"const int {pre}t0 = {chain(h, ah.firsts)} * {s} + {pre}nr * {chain(w, aw.firsts)};"]


def tap_phase(a: Axis, r: str) -> str:
    """C expression of the phase tap ``r`` reaches."""
    if a.stride == 1:
        return "0"
    return f"(({r} * {a.dil} - {a.pad}) % {a.stride} + {a.stride}) % {a.stride}"


def pack_kernel(spec: ConvSpec) -> tuple[Kernel, tuple[int, int, int]]:
    """wph: per group, per phase, the cg x (taps x kg) row-major matrix of w[k, c, r, s] (tap
    index t = (r // step_h) * ns + s // step_w, outer; k inner). One thread per element of w."""
    ah, aw = axes(spec)
    cg, kg, rs = spec.cg, spec.kg, spec.r * spec.s
    body = [f"const int s = e % {spec.s}, r = (e / {spec.s}) % {spec.r}, c = (e / {rs}) % {cg}, kt = e / {rs * cg};",
            f"const int g = kt / {kg}, kk = kt - g * {kg};",
            f"const int phh = {tap_phase(ah, 'r')}, phw = {tap_phase(aw, 's')};",
            *phase_lines(ah, aw, spec.s, "phh", "phw"),
            f"const int t = (r / {ah.step}) * ns + s / {aw.step};",
            f"wph[g * {cg * kg * rs} + {cg * kg} * t0 + c * ({kg} * nr * ns) + t * {kg} + kk] = w[e];"]
    return elementwise("dgrad_sg_pack", spec.k * cg * rs, (Buf("w"), Buf("wph", readonly=False)), body,
                       "strided dgrad: filters packed per group and stride phase, cg x (taps x kg)")


class _Geo:
    """Sizes of the GEMM view of one spec."""

    def __init__(self, spec: ConvSpec) -> None:
        self.ah, self.aw = axes(spec)
        self.phases = spec.stride[0] * spec.stride[1]
        self.hm, self.wm = self.ah.rows, self.aw.rows
        self.cols = spec.n * self.hm * self.wm
        self.kmax = spec.kg * max(self.ah.counts) * max(self.aw.counts)
        self.plain = spec.stride == (1, 1)

    def order(self) -> list[int]:
        """Phases (ph_h * sw + ph_w) by descending taps: blocks start in grid order, so the longest
        reductions start first."""
        sw = self.aw.stride
        taps = [self.ah.counts[ph // sw] * self.aw.counts[ph % sw] for ph in range(self.phases)]
        return sorted(range(self.phases), key=lambda ph: -taps[ph])

    def mnk(self, spec: ConvSpec) -> tuple[int, int, int]:
        return spec.cg, self.cols, max(self.kmax, 1)


def _head(spec: ConvSpec, geo: _Geo) -> list[str]:
    """Per block (batch entry bz = group x phase): the phase, its taps and reduction length, and
    the offsets of its packed filters, its dy channels and its dx channels."""
    sw, nph, g = spec.stride[1], geo.phases, spec.groups > 1
    order = geo.order()
    if nph == 1:
        lines = (["const int ph_g = bz;"] if g else []) + ["const int ph_h = 0, ph_w = 0;"]
    else:
        lines = [f"const int ph_g = bz / {nph}, ph_z = bz - ph_g * {nph};" if g else "const int ph_z = bz;",
                 f"const int ph = {chain('ph_z', order)};  // the phases of most taps first: a short tail",
                 f"const int ph_h = ph / {sw}, ph_w = ph - ph_h * {sw};"]
    lines += [*phase_lines(geo.ah, geo.aw, spec.s, "ph_h", "ph_w", "ph_"),
              f"const int ph_red = {spec.kg} * ph_nr * ph_ns;",
              f"const int ph_dr = {chain('ph_h', geo.ah.first_offsets)}, "
              f"ph_ds = {chain('ph_w', geo.aw.first_offsets)};"]

    def per_group(n: int) -> str:
        return f"ph_g * {n}" if g else "0"

    return lines + [f"const int wa0 = {per_group(spec.cg * spec.kg * spec.r * spec.s)} + {spec.cg * spec.kg} * ph_t0;",
                    f"const int yb0 = {per_group(spec.kg * spec.p * spec.q)}, "
                    f"xb0 = {per_group(spec.cg * spec.h * spec.w)};"]


def filter_rows(spec: ConvSpec) -> Operand:
    """A = this phase's packed filters, cg x ph_red row-major (float4 along the reduction when
    kg % 4 == 0: rows and phase bases are then 16-byte aligned)."""
    def setup(i: str, t: str) -> list[str]:
        return [f"const int {t}_a = wa0 + {i} * ph_red;"]

    def vload(t: str, k: str, d: str) -> list[str]:
        return [f"{d} = VLOAD4(0, wph + {t}_a + {k});"]

    return Operand(load=lambda t, k, d: [f"{d} = wph[{t}_a + {k}];"], fast="k", setup=setup,
                   vload=vload if spec.kg % 4 == 0 else None)


def divide(expr: str, var: str, values: list[int]) -> str:
    """C expression of expr / var where var is one of ``values`` (constant divisions, one per
    distinct nonzero value: a phase of no taps never divides)."""
    vals = sorted({v for v in values if v}, reverse=True) or [1]
    out = f"({expr}) / {vals[-1]}" if vals[-1] > 1 else f"({expr})"
    for v in vals[:-1]:
        out = f"{var} == {v} ? ({expr}) / {v} : {out}"
    return f"({out})" if len(vals) > 1 else out


def gathered_dy(spec: ConvSpec, geo: _Geo) -> Operand:
    """B = dy gathered for this phase: row (tap t, channel k), column (n, i, j) of the phase grid
    reads dy[n, k, i + dr, j + ds], zero outside, where tap t = tr * ns + ts of the phase has
    dr = ph_dr - tr * (dh / gcd(sh, dh)) (and the same along w). The tap's offsets are worked out
    once per k row (shared by the columns a thread loads), by constant divisions only."""
    pq, kpq, kg = spec.p * spec.q, spec.k * spec.p * spec.q, spec.kg
    hwm = geo.hm * geo.wm

    def setup(i: str, t: str) -> list[str]:
        return [f"const int {t}_n = {i} / {hwm}, {t}_p = {i} - {t}_n * {hwm};",
                f"const int {t}_y = {t}_p / {geo.wm}, {t}_x = {t}_p - {t}_y * {geo.wm};",
                f"const int {t}_b = yb0 + {t}_n * {kpq} + {t}_y * {spec.q} + {t}_x;"]

    def kprep(kt: str, k: str) -> list[str]:
        return [f"const int {kt}_j = ({k}) / {kg};",
                f"const int {kt}_r = {divide(f'{kt}_j', 'ph_ns', geo.aw.counts)}, {kt}_s = {kt}_j - {kt}_r * ph_ns;",
                f"const int {kt}_dr = ph_dr - {kt}_r * {geo.ah.delta}, {kt}_ds = ph_ds - {kt}_s * {geo.aw.delta};",
                f"const int {kt}_off = (({k}) - {kt}_j * {kg}) * {pq} + {kt}_dr * {spec.q} + {kt}_ds;"]

    def kload(t: str, kt: str, d: str) -> list[str]:
        return [f"if ((unsigned)({t}_y + {kt}_dr) < {spec.p}u && (unsigned)({t}_x + {kt}_ds) < {spec.q}u) "
                f"{d} = y[{t}_b + {kt}_off];"]

    def load(t: str, k: str, d: str) -> list[str]:
        return kprep(f"{t}q", k) + kload(t, f"{t}q", d)

    return Operand(load=load, fast="i", setup=setup, kprep=kprep, kload=kload)


def phase_store(spec: ConvSpec, geo: _Geo) -> Store:
    """C (cg x phase grid) into dx: column (n, i, j) is pixel (ph_h + i*sh, ph_w + j*sw), skipped
    past the edge; stride 1 stores 4 consecutive pixels as a float4 when H*W % 4 == 0."""
    hw, chw, hwm = spec.h * spec.w, spec.c * spec.h * spec.w, geo.hm * geo.wm
    (sh, sw) = spec.stride

    def setup(i: str, t: str) -> list[str]:
        lines = [f"const int {t}_n = {i} / {hwm}, {t}_p = {i} - {t}_n * {hwm};"]
        if geo.plain:
            return lines + [f"const int {t}_o = xb0 + {t}_n * {chw} + {t}_p;"]
        return lines + [f"const int {t}_h = ph_h + ({t}_p / {geo.wm}) * {sh}, "
                        f"{t}_w = ph_w + ({t}_p % {geo.wm}) * {sw};",
                        f"const bool {t}_ok = {t}_h < {spec.h} && {t}_w < {spec.w};",
                        f"const int {t}_o = xb0 + {t}_n * {chw} + {t}_h * {spec.w} + {t}_w;"]

    def put(m: str, t: str, v: str) -> list[str]:
        guard = "" if geo.plain else f"if ({t}_ok) "
        return [f"{guard}x[{t}_o + ({m}) * {hw}] = {v};"]

    def vput(m: str, t: str, vs: list[str]) -> list[str]:
        return [f"VSTORE4(MAKE_FLOAT4({', '.join(vs)}), 0, x + {t}_o + ({m}) * {hw});"]

    return Store(put=put, setup=setup, vput=vput if geo.plain and hw % 4 == 0 else None)


class DgradStridedGemm(Variant):
    """Strided dgrad (any stride, dilation, padding, groups): one dense GEMM per stride phase and
    group, all in one launch; the filters packed per phase by a weight step."""

    name = "dgrad_strided_gemm"
    family = "implicit_gemm"
    passes = frozenset({"dgrad"})
    grouped = True
    exact = True
    tolerance = 1e-5
    specialised = 4

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        return super().applies(spec, device) or too_big(spec, spec.k * spec.cg * spec.r * spec.s)

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """First for strided layers (the stride-1 adapters refuse them), unless the channels per
        group are too few for a GEMM tile (its rows are the cg channels, 32 at least; depthwise and
        narrow groups go to dgrad_direct / depthwise_dgrad / the direct adapters); below the transposed
        forward variants at stride 1, where the Winograd, 1x1 and implicit GEMM adapters carry the layer."""
        if spec.cg < 16 or spec.kg < 8:
            return -1
        return 8 if spec.stride != (1, 1) else self.specialised

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The shared SGEMM space; on GPUs only its spill-free points (:func:`lean_point`) after the
        default."""
        m, n, k = _Geo(spec).mnk(spec)
        pts = gemm_space(m, n, k, device, spec.kg % 4 == 0, False, "k", "i")
        default = self.default(spec, device)
        if device.is_gpu:
            pts = [default] + [p for p in pts if p != default and lean_point(p)]
        return pts

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        m, n, k = _Geo(spec).mnk(spec)
        return gemm_default(m, n, k, device, spec.kg % 4 == 0, False, "k", "i")

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 4 * spec.k * spec.cg * spec.r * spec.s

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        geo = _Geo(spec)
        m, n, k = geo.mnk(spec)
        shape = GemmShape(m, n, k, batch=spec.groups * geo.phases)
        name = f"{self.name}_sgemm"
        args = (Buf("wph"), Buf("y"), Buf("x", readonly=False))
        kern = gemm_kernel(name, shape, params, filter_rows(spec), gathered_dy(spec, geo), phase_store(spec, geo),
                           args, head=tuple(_head(spec, geo)), k_of_batch="ph_red",
                           comment=f"{self.name}: {geo.phases} phases x {spec.groups} groups, {params.short()}")
        pk, pgrid = pack_kernel(spec)
        steps = (Launch(pk.name, pgrid, pk.block, ("w", "wph")),
                 Launch(name, gemm_grid(shape, params), gemm_block(params), ("wph", "y", "x")))
        workspace = (("wph", self.workspace_bytes(spec, params)),)
        return Plan(self.name, self.family, spec, params, (pk, kern), steps, workspace, self.tolerance, epilogue)


register(DgradStridedGemm())
