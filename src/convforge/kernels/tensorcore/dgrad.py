"""Strided dgrad (bprop) on the wgmma generator: one forward implicit GEMM per stride phase, so the
generator's own operand iterators serve it and no zero of a zero-stuffed dy is multiplied.

dx[n, c, h, w] sums dy[n, k, p, q] . w[k, c, r, s] over the taps with h + pt - r dh = p sh (and along
w). The dx rows of one phase ph = h mod sh are reached by the taps r with (ph + pt - r dh) = 0 mod
sh, and row h = ph + sh i reads dy row i + (ph + pt - r dh) / sh (kernels/dgrad/strided.py's
:class:`~convforge.kernels.dgrad.strided.Axis` holds these facts). Ordered by descending r, the taps
of a phase read dy rows i + o + t delta (o: the last tap's offset, delta = dh / gcd(sh, dh)): a
stride-1 forward convolution of dy with dilation delta and padding -o. Per phase (ph, pw):

* A = :class:`~convforge.kernels.tensorcore.operands.Im2colNhwc` over dy in NHWC (one conversion
  step for every phase: K padded to a 16-byte chunk, TF32-rounded / 3xTF32 hi + lo / half bits);
* B = :class:`~convforge.kernels.tensorcore.operands.DenseRows` over the phase's filters, packed
  C x (t_h, t_w, Kp) by a weight-only step (kept per weight version with torch tensors);
* D (N Hm Wm x C) stored on the phase's sub-grid of dx (the epilogue's pixel map: rows ph + sh i,
  columns pw + sw j of each NCHW plane).

A phase no tap reaches (a 1x1 filter at stride 2: three of four) is zeros: the plan fills dx first.
Stride 1 is DgradTransposed's (kernels/dgrad/transposed.py); groups run dgrad_strided_gemm.

* ``dgrad_tc_strided_tf32`` (relaxed), ``dgrad_tc_strided_3xtf32`` (fp32), ``dgrad_tc_strided_half``
  (float16 / bfloat16): the forward variants' math modes and stated errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from convforge.codegen.dialect import Buf, Dim3, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.dgrad.baseline import no_epilogue
from convforge.kernels.dgrad.strided import Axis, axes
from convforge.kernels.gemm import elementwise
from convforge.kernels.tensorcore import prep, tiles
from convforge.kernels.tensorcore.epilogue import CTYPE, Output
from convforge.kernels.tensorcore.isa import Math, device_reason, math_for
from convforge.kernels.tensorcore.kernel import gemm_kernel
from convforge.kernels.tensorcore.operands import DenseRows, Geometry, Im2colNhwc
from convforge.kernels.tensorcore.smem import Tile
from convforge.kernels.tensorcore.tiles import Problem, TileConfig
from convforge.kernels.tensorcore.variants import RANK_SM90, TcVariant, tolerance
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Step
from convforge.spec import ConvSpec

_ELT = 256


@dataclass(frozen=True)
class PhaseAxis:
    """One axis of one phase: its dx rows ph + stride i (i < rows), its taps in descending r
    (``taps[t]`` reads dy row i + first + t delta)."""

    ph: int
    rows: int
    taps: tuple[int, ...]
    first: int
    delta: int


def phase_axes(a: Axis) -> list[PhaseAxis]:
    """Every phase of axis ``a`` (phases no tap reaches have no taps)."""
    out = []
    for ph in range(a.stride):
        taps = tuple(reversed(a.taps_of(ph)))
        first = a.offset(ph, taps[0]) if taps else 0
        out.append(PhaseAxis(ph, cdiv(a.size - ph, a.stride), taps, first, a.delta))
    return out


@dataclass(frozen=True)
class Phase:
    """One phase (ph, pw) of a strided dgrad: its GEMM and where it lands."""

    ah: PhaseAxis
    aw: PhaseAxis

    @property
    def tag(self) -> str:
        return f"{self.ah.ph}{self.aw.ph}"

    @property
    def empty(self) -> bool:
        return not (self.ah.taps and self.aw.taps and self.ah.rows > 0 and self.aw.rows > 0)

    def problem(self, spec: ConvSpec, kp: int) -> Problem:
        return Problem(spec.n * self.ah.rows * self.aw.rows, spec.c, len(self.ah.taps) * len(self.aw.taps) * kp)

    def geometry(self, spec: ConvSpec, kp: int) -> Geometry:
        """dy (N x P x Q, Kp channels) read as the forward convolution of this phase."""
        ah, aw = self.ah, self.aw
        last = [a.rows - 1 + a.first + (len(a.taps) - 1) * a.delta for a in (ah, aw)]  # the last dy row, column read
        padded = ah.first < 0 or aw.first < 0 or last[0] >= spec.p or last[1] >= spec.q
        return Geometry(spec.n, spec.p, spec.q, kp, ah.rows, aw.rows, len(ah.taps), len(aw.taps), (1, 1),
                        (ah.delta, aw.delta), -ah.first, -aw.first, padded)

    def output(self, spec: ConvSpec) -> Output:
        """D (N Hm Wm x C) on this phase's sub-grid of dx (NCHW)."""
        hw = spec.h * spec.w
        return Output("x", spec.n * self.ah.rows * self.aw.rows, spec.c, self.ah.rows * self.aw.rows, spec.dtype,
                      istride=spec.c * hw, kstride=hw, pix_q=self.aw.rows, pix_row=spec.stride[0] * spec.w,
                      pix_col=spec.stride[1], pix_base=self.ah.ph * spec.w + self.aw.ph, epi=Epilogue())


def phases(spec: ConvSpec) -> list[Phase]:
    ah, aw = axes(spec)
    return [Phase(h, w) for h in phase_axes(ah) for w in phase_axes(aw)]


def pack_phase(name: str, spec: ConvSpec, ph: Phase, math: Math, kp: int, ld: int, dst: str) -> tuple[Kernel, Dim3]:
    """The phase's filters as the GEMM's B: dst[c * ld + (th * Tw + tw) * kp + k] = w[k, c, r_th, s_tw]
    (zeros for k >= K and past the taps up to ``ld``); one thread per (c, k), k fastest (each store
    coalesced across the warp), a weight-only step."""
    taps = [(r, s) for r in ph.ah.taps for s in ph.aw.taps]
    rs, tail = spec.r * spec.s, ld - len(taps) * kp
    zero = prep.zero(math)
    code = Code()
    code(f"const int e = GROUP_ID(0) * {_ELT} + LOCAL_ID(0);")
    with code.block(f"if (e < {spec.c * kp})"):
        code(f"const int c = e / {kp}, k = e - c * {kp};",
             f"const bool ok = k < {spec.k};",
             f"const {CTYPE[spec.dtype]}* src = w + ((ok ? k : 0) * {spec.c} + c) * {rs};")
        for t, (r, s) in enumerate(taps):
            code(*prep.store_parts(math, spec.dtype, dst, f"c * {ld} + {t * kp} + k",
                                   f"(ok ? src[{r * spec.s + s}] : {zero})"))
        if tail:
            prep.zero_tail(code, math, dst, "c", f"{len(taps) * kp} + k", ld, kp)
    kern = Kernel(name, (Buf("w", CTYPE[spec.dtype]),) + prep.part_buffers(dst, math), code.text(), (_ELT, 1, 1),
                  frozenset({"mma_tf32", "wgmma"}),
                  comment=f"dgrad phase ({ph.ah.ph}, {ph.aw.ph}): {len(taps)} taps of w as C x (taps x {kp})")
    return kern, (cdiv(spec.c * kp, _ELT), 1, 1)


def zero_phases(name: str, spec: ConvSpec) -> tuple[Kernel, Dim3] | None:
    """Zeros on the dx pixels of the phases no tap reaches (one thread per dx element), or None."""
    ah, aw = axes(spec)
    empty_h = [a.ph for a in phase_axes(ah) if not a.taps]
    empty_w = [a.ph for a in phase_axes(aw) if not a.taps]
    if not empty_h and not empty_w:
        return None
    conds = [f"hh % {spec.stride[0]} == {ph}" for ph in empty_h] + [f"ww % {spec.stride[1]} == {pw}" for pw in empty_w]
    zero = prep.zero(math_for(spec.dtype))
    body = [f"const int ww = e % {spec.w}, hh = e / {spec.w} % {spec.h};",
            f"if ({' || '.join(conds)}) x[e] = {zero};"]
    return elementwise(name, spec.n * spec.c * spec.h * spec.w, (Buf("x", CTYPE[spec.dtype], readonly=False),), body,
                       f"dgrad: zeros where no tap reaches (phases h%{spec.stride[0]} in {empty_h}, "
                       f"w%{spec.stride[1]} in {empty_w})")


class TcDgradStrided(TcVariant):
    """Strided dgrad by the wgmma generator (see the module docstring)."""

    passes = frozenset({"dgrad"})

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """First on sm_90 for TF32 and half layers (above dgrad_strided_gemm on CUDA cores: H200, the
        ResNet-50 N32 strided layers ran 0.18-0.38x cuDNN-best TF32 there); 3xTF32 at its stated rank
        until measured, below dgrad_direct where the dx channels fill less than half a 32-wide tile
        (C < 16: a 3-channel stem)."""
        if device_reason(device) is not None:
            return self.specialised
        if self.x3:
            return -1 if spec.c < 16 else self.specialised
        return RANK_SM90

    def _kp(self, spec: ConvSpec) -> int:
        return prep.padded_channels(spec.k, self.math(spec))

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device) or device_reason(device)
        if why:
            return why
        if spec.stride == (1, 1):
            return "stride 1: dgrad_tc_implicit_gemm_* (the transposed forward problem) runs it"
        kp = self._kp(spec)
        return self.wide(spec, spec.n * spec.p * spec.q * kp, spec.n * spec.c * spec.h * spec.w,
                         spec.c * spec.r * spec.s * kp + 64)

    # -- parameters ---------------------------------------------------------------------------
    def _largest(self, spec: ConvSpec) -> Problem:
        """The biggest phase GEMM: the tile is chosen for it and shared by every phase."""
        kp = self._kp(spec)
        probs = [ph.problem(spec, kp) for ph in phases(spec) if not ph.empty]
        return max(probs, key=lambda p: p.m * p.kred)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        cfg = tiles.pick(self.math(spec), self._largest(spec), device.units, self.limit(device))
        return TileConfig(cfg.bm, cfg.bn, cfg.kb, cfg.st, cfg.cw, 1, cfg.ps, cfg.pi).params()

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The generator's space for the largest phase, unsplit (every phase's rows fill the GPU)."""
        math, prob = self.math(spec), self._largest(spec)
        out = [self.default(spec, device)]
        for c in tiles.space(math, prob, device.units, self.limit(device)):
            p = TileConfig(c.bm, c.bn, c.kb, c.st, c.cw, 1, c.ps, c.pi).params()
            if p not in out:
                out.append(p)
        return out

    def _ld(self, spec: ConvSpec, ph: Phase, cfg: TileConfig) -> int:
        stage = self.math(spec).elems(cfg.kb)
        return cdiv(ph.problem(spec, self._kp(spec)).kred, stage) * stage

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return sum(b for _, b in self._workspace(spec, TileConfig.of(params)))

    def _workspace(self, spec: ConvSpec, cfg: TileConfig) -> tuple[tuple[str, int], ...]:
        math, kp = self.math(spec), self._kp(spec)
        out = tuple(((f"dyh{'' if p == 'hi' else '_' + p}"), math.esize * spec.n * spec.p * spec.q * kp)
                    for p in math.parts)
        for ph in phases(spec):
            if not ph.empty:
                nbytes = math.esize * spec.c * self._ld(spec, ph, cfg)
                out += tuple((f"wph{ph.tag}{'' if p == 'hi' else '_' + p}", nbytes) for p in math.parts)
        return out

    # -- plan ---------------------------------------------------------------------------------
    def operands(self, spec: ConvSpec, ph: Phase, cfg: TileConfig) -> tuple[Im2colNhwc, DenseRows]:
        """A: dy (NHWC) gathered for the phase's sub-grid; B: its packed filters."""
        math, kp = self.math(spec), self._kp(spec)
        prob = ph.problem(spec, kp)
        a = Im2colNhwc("a", Tile(cfg.bm, cfg.kb), math, "dyh", geo=ph.geometry(spec, kp))
        b = DenseRows("b", Tile(cfg.bn, cfg.kb), math, f"wph{ph.tag}", rows=spec.c, ld=self._ld(spec, ph, cfg),
                      kred=prob.kred, padded=True)
        return a, b

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        math, cfg, kp = self.math(spec), TileConfig.of(params), self._kp(spec)
        if cfg.ks != 1:
            raise ValueError(f"{self.name}: ks ({cfg.ks}) must be 1 (each phase's rows fill the GPU)")
        refs = lambda bufs: tuple(x.name for x in bufs)  # noqa: E731
        pq = spec.p * spec.q
        yk, ygrid = prep.planes_to_rows(f"{self.name}_dy", "y", f"(n * {spec.k} + ci) * {pq} + p", spec.n, spec.k, pq,
                                        kp, math, spec.dtype, "dyh",
                                        f"dy NCHW -> NHWC ({kp} channels) as {math.name} operands")
        kernels: list[Kernel] = [yk]
        steps: list[Step] = [Launch(yk.name, ygrid, yk.block, ("y",) + refs(prep.part_buffers("dyh", math)))]
        zk = zero_phases(f"{self.name}_zero", spec)
        if zk is not None:
            kernels.append(zk[0])
            steps.append(Launch(zk[0].name, zk[1], zk[0].block, ("x",)))
        for ph in phases(spec):
            if ph.empty:
                continue
            prob = ph.problem(spec, kp)
            why = cfg.problems(math, prob, self.limit(device))
            if why:
                raise ValueError(f"{self.name}: phase {ph.tag}: {'; '.join(why)}")
            a, b = self.operands(spec, ph, cfg)
            wk, wgrid = pack_phase(f"{self.name}_w{ph.tag}", spec, ph, math, kp, self._ld(spec, ph, cfg), b.buf)
            gk = gemm_kernel(f"{self.name}_gemm{ph.tag}", math, cfg, prob, a, b, ph.output(spec))
            kernels += [wk, gk]
            steps += [Launch(wk.name, wgrid, wk.block, ("w",) + refs(b.args())),
                      Launch(gk.name, (cfg.grid(prob, device.units), 1, 1), gk.block,
                             refs(a.args()) + refs(b.args()) + ph.output(spec).refs())]
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps),
                    self._workspace(spec, cfg), tolerance(math, spec.dtype), epilogue)


register(TcDgradStrided("dgrad_tc_strided_tf32", frozenset({"float32"}), False, "relaxed", 12))
register(TcDgradStrided("dgrad_tc_strided_3xtf32", frozenset({"float32"}), True, "fp32", 4))
register(TcDgradStrided("dgrad_tc_strided_half", frozenset({"float16", "bfloat16"}), False, "fp32", 12))
