"""Strided dgrad (bprop) on the wgmma generator: one forward implicit GEMM per stride phase, so the
generator's own operand iterators serve it and no zero of a zero-stuffed dy is multiplied; the
phases' GEMMs run in turn in one launch (kernel.jobs_kernel: their tiles dealt round-robin over
persistent blocks, the stage ring running on from one phase to the next).

dx[n, c, h, w] sums dy[n, k, p, q] . w[k, c, r, s] over the taps with h + pt - r dh = p sh (and along
w). The dx rows of one phase ph = h mod sh are reached by the taps r with (ph + pt - r dh) = 0 mod
sh, and row h = ph + sh i reads dy row i + (ph + pt - r dh) / sh (kernels/dgrad/strided.py's
:class:`~convforge.kernels.dgrad.strided.Axis` holds these facts). Ordered by descending r, the taps
of a phase read dy rows i + o + t delta (o: the last tap's offset, delta = dh / gcd(sh, dh)): a
stride-1 forward convolution of dy with dilation delta and padding -o. Per phase (ph, pw):

* A = :class:`~convforge.kernels.tensorcore.sm90.operands.Im2colNhwc` over dy in NHWC (one conversion
  step for every phase: K padded to a 16-byte chunk, TF32-rounded / 3xTF32 hi + lo / half bits);
* B = :class:`~convforge.kernels.tensorcore.sm90.operands.DenseRows` over the phase's filters, packed
  C x (t_h, t_w, Kp) by one weight-only step for all phases (kept per weight version with torch
  tensors);
* D (N Hm Wm x C) stored compact in the phase's own workspace (N x C x Hm x Wm, the epilogue's
  float4 rows), then one pass writes every dx element from its phase's buffer, zeros for the phases
  no tap reaches (``il=1``, the NCHW default, :mod:`convforge.kernels.dgrad.interleave`); or (``il=0``,
  the channels-last default) stored straight on the phase's sub-grid of dx by the epilogue's pixel
  map (rows ph + sh i, columns pw + sw j: of each NCHW plane, or whole NHWC pixels of C channels),
  the phases no tap reaches filled with zeros first. On NCHW the direct stores leave every other
  4-byte word of a sector to another phase: the L2 fills each partial sector from DRAM, several
  times the bytes of dx; on NHWC a row is a pixel's run of channels (docs/NOTES-tensorcore.md);
  or (``jn=1``, the NCHW half default where every phase's tiles fill the GPU) the column phases
  joined in registers: with ``ps=0`` block b takes tile b of phase (ph, 0), holds it as packed
  halves, then tile b of (ph, 1), and stores both as each dx row's pairs (``Output.pairs``): no
  phase buffers, no interleave (:meth:`TcDgradStrided._joined`).

``mn=1`` (NCHW half, by params; GPU tier on 4x2/2 and 3x2/2 layers): A = dy as it lies, each stage
a 4-D tiled TMA box of 64 pixels of one dy row at the stage's tap offset (:class:`MnPlanes`; zeros
outside the plane are the padding), B the filters MN-major: no dy copy step. Only where every phase's
column taps sit at dy column offsets that are multiples of 8 (e.g. 4x2 filters at stride 2): a tile
copy's innermost coordinate must be 16-byte aligned (the H200 faults with an illegal instruction
otherwise), so the one-column shifts of 3x3/2 and 4x4/2 layers' taps cannot be copy offsets.

1x1 filters at stride > 1 have one phase: dgrad_sub_<1x1 forward> (kernels/dgrad/transposed.py)
reads dy in place for it. Stride 1 is DgradTransposed's (kernels/dgrad/transposed.py); groups run dgrad_strided_gemm.

* ``dgrad_tc_strided_tf32`` (relaxed), ``dgrad_tc_strided_3xtf32`` (fp32), ``dgrad_tc_strided_3xf16`` (fp32;
  emulated and compiled, not yet run on a GPU: in the tuner's space only), ``dgrad_tc_strided_half``
  (float16 / bfloat16): the forward variants' math modes and stated errors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from convforge.codegen.dialect import PARAM_BYTES_LIMIT, TENSOR_MAP_BYTES, Buf, Dim3, Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.dgrad.baseline import no_epilogue
from convforge.kernels.dgrad.interleave import Part, interleave_kernel, vector_width
from convforge.kernels.dgrad.strided import Axis, axes
from convforge.kernels.gemm import elementwise
from convforge.kernels.tensorcore.sm90 import prep, tiles, tma
from convforge.kernels.tensorcore.sm90.epilogue import CTYPE, Output
from convforge.kernels.tensorcore.sm90.isa import Math, device_reason
from convforge.kernels.tensorcore.sm90.kernel import jobs_grid, jobs_kernel, launch_refs
from convforge.kernels.tensorcore.sm90.mainloop import Job
from convforge.kernels.tensorcore.sm90.operands import DenseRows, Geometry, Im2colNhwc, MnPlanes, MnRows, Operand
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig
from convforge.kernels.tensorcore.sm90.variants import RANK_SM90, TcVariant, tolerance
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Step
from convforge.spec import ConvSpec


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

    def taps(self) -> list[tuple[int, int]]:
        """The phase's taps (r, s), in the order of its GEMM's reduction."""
        return [(r, s) for r in self.ah.taps for s in self.aw.taps]

    def b_rows(self, spec: ConvSpec) -> list[tuple[str, list[tuple[int, int]]]]:
        """The rows of the packed filters that dx channel ``c`` fills (C expressions of c) and the taps
        each holds: one row, c, with the phase's taps."""
        return [("c", self.taps())]

    def geometry(self, spec: ConvSpec, kp: int) -> Geometry:
        """dy (N x P x Q, Kp channels) read as the forward convolution of this phase."""
        ah, aw = self.ah, self.aw
        last = [a.rows - 1 + a.first + (len(a.taps) - 1) * a.delta for a in (ah, aw)]  # the last dy row, column read
        padded = ah.first < 0 or aw.first < 0 or last[0] >= spec.p or last[1] >= spec.q
        return Geometry(spec.n, spec.p, spec.q, kp, ah.rows, aw.rows, len(ah.taps), len(aw.taps), (1, 1),
                        (ah.delta, aw.delta), -ah.first, -aw.first, padded)

    @property
    def buf(self) -> str:
        """The phase's compact workspace (N x C x Hm x Wm) when the plan interleaves."""
        return f"dph{self.tag}"

    def part(self) -> Part:
        return Part(self.buf, self.ah.ph, self.aw.ph, self.ah.rows, self.aw.rows)

    def compact(self, spec: ConvSpec) -> Output:
        """D (N Hm Wm x C) as NCHW planes of the phase's own buffer (NHWC rows for a channels-last dx)."""
        pq = self.ah.rows * self.aw.rows
        return Output(self.buf, spec.n * pq, spec.c, 1 if spec.layout == "nhwc" else pq, spec.dtype, epi=Epilogue())

    def output(self, spec: ConvSpec) -> Output:
        """D (N Hm Wm x C) on this phase's sub-grid of dx: NCHW planes, or channels-last rows (a pixel's
        C channels contiguous, so the row-major epilogue stores runs of channels)."""
        hw, pq = spec.h * spec.w, self.ah.rows * self.aw.rows
        sh, sw = spec.stride
        base = self.ah.ph * spec.w + self.aw.ph
        if spec.layout == "nhwc":
            c = spec.c
            return Output("x", spec.n * pq, c, pq, spec.dtype, istride=c * hw, kstride=1, pix_q=self.aw.rows,
                          pix_row=sh * spec.w * c, pix_col=sw * c, pix_base=base * c, epi=Epilogue())
        return Output("x", spec.n * pq, spec.c, pq, spec.dtype, istride=spec.c * hw, kstride=hw, pix_q=self.aw.rows,
                      pix_row=sh * spec.w, pix_col=sw, pix_base=base, epi=Epilogue())


def phases(spec: ConvSpec) -> list[Phase]:
    ah, aw = axes(spec)
    return [Phase(h, w) for h in phase_axes(ah) for w in phase_axes(aw)]


_PACK_TILE_BYTES = 24576


def _pack_tiles(spec: ConvSpec) -> tuple[int, int]:
    """(dx channels per block, taps per chunk) of :func:`pack_phases`: a shared tile of c x taps x 33
    elements within 24 KiB, every tap at once where one channel's fit, else the taps in chunks."""
    rs, elt = spec.r * spec.s, 4 if spec.dtype == "float32" else 2
    if rs * 33 * elt > _PACK_TILE_BYTES:
        return 1, _PACK_TILE_BYTES // (33 * elt)
    return max(1, min(spec.c, _PACK_TILE_BYTES // (rs * 33 * elt))), rs


def pack_phases(name: str, spec: ConvSpec, packs: list[tuple[Phase, int, str]], math: Math,
                kp: int, block: tuple[int, int] | None = None, mn: bool = False) -> tuple[Kernel, Dim3]:
    """Every phase's filters as its GEMM's B, in one weight-only step: for each (phase, ld, dst),
    dst[row(c) * ld + (th * Tw + tw) * kp + k] = w[k, c, r_th, s_tw] (zeros for k >= K and past the
    taps up to ``ld``; the rows and taps of :meth:`Phase.b_rows`). A block (32 x 8 threads) holds 32 k
    by ``ct`` dx channels by the taps (in chunks where they are many) in shared memory: it reads each
    k's run of channels and taps whole (w's order), then writes every phase's rows with k fastest, so
    both sides are coalesced and w is read once for all phases (one thread per (c, k) walking w's rows,
    2 bytes of each 32-byte sector, took 19 us on SD-VAE's 512 x 512 4x4 filters).
    ``block`` = (kg, cg): grouped filters (K x cg x R x S, groups of kg rows), P = kp / kg groups packed
    block-diagonally into each GEMM group of P cg columns: column c's row holds, at k, filter row
    c / (P cg) kp + k where k / kg is c's group within the packed one (c / cg % P), zeros elsewhere.
    ``mn``: each B MN-major, [taps x kp][ld] (dst[(t kp + k) ld + row(c)], rows past the phase's
    written left as they are: columns no GEMM column reads into D), written with c fastest."""
    rs = spec.r * spec.s
    ct, tc = _pack_tiles(spec)
    code = Code()
    for _, _, dst in packs:
        code(*prep.scale_lets(math, dst))
    code(f"SHARED {CTYPE[spec.dtype]} tile[{ct * tc * 33}];  // [c][tap][k]: rows of 32 k, padded to 33",
         "const int tx = LOCAL_ID(0), ty = LOCAL_ID(1), k = GROUP_ID(0) * 32 + tx;",
         f"const int k0 = GROUP_ID(0) * 32, c0 = GROUP_ID(1) * {ct};")
    if block is None:
        def ok(kr: str) -> str:
            return f"{kr} < {spec.k} && c < {spec.c}"

        def src(kr: str) -> str:
            return f"{kr} * {spec.c} + c"
    else:
        kg, cg = block
        p = kp // kg  # filter row kr (dy channel) of column c's packed group, on the block diagonal

        def ok(kr: str) -> str:
            return f"{kr} < {kp} && c < {spec.c} && {kr} / {kg} == c / {cg} % {p}"

        def src(kr: str) -> str:
            return f"(c / {p * cg} * {kp} + {kr}) * {cg} + c % {cg}"
    for t0 in range(0, rs, tc):
        t1 = min(rs, t0 + tc)
        if t0:
            code("BARRIER();")
        span = ct * (t1 - t0)
        for j0 in range(0, span, 256):  # 32 independent loads a thread, then their 32 stores
            with code.block(f"/* tile elements {j0} .. {min(span, j0 + 256) - 1} of each k */"):
                code(f"const int j = {j0} + ty * 32 + tx;",
                     f"const int c = c0 + j / {t1 - t0}, t = {t0} + j % {t1 - t0};")
                for kk in range(32):
                    kr = f"(k0 + {kk})"
                    code(f"const {CTYPE[spec.dtype]} v{kk} = (j < {span} && {ok(kr)}) ? w[({src(kr)}) * {rs} + t] : 0;")
                with code.block(f"if (j < {span})"):
                    code(*(f"tile[j * 33 + {kk}] = v{kk};" for kk in range(32)))
        code("BARRIER();")
        if mn:  # lanes along c: each (tap, k) row of B written c fastest
            with code.block("for (int kk = ty; kk < 32; kk += 8)"):
                with code.block(f"for (int cc = tx; cc < {ct}; cc += 32)"):
                    code("const int c = c0 + cc, km = k0 + kk;")
                    with code.block(f"if (c < {spec.c} && km < {kp})"):
                        _pack_stores(code, spec, packs, math, kp, (t0, t1), last=t1 == rs, mn=True)
            continue
        with code.block(f"for (int cc = ty; cc < {ct}; cc += 8)"):
            code("const int c = c0 + cc;")
            with code.block(f"if (c < {spec.c} && k < {kp})"):
                _pack_stores(code, spec, packs, math, kp, (t0, t1), last=t1 == rs)
    bufs = tuple(b for _, _, dst in packs for b in prep.part_buffers(dst, math))
    kern = Kernel(name, (Buf("w", CTYPE[spec.dtype]),) + bufs, code.text(), (32, 8, 1), prep.features(math),
                  comment=f"dgrad: the taps of {len(packs)} phases of w, each as C x (taps x {kp}), "
                  f"through tiles of 32 k x {ct} c x {tc} taps")
    return kern, (cdiv(kp, 32), cdiv(spec.c, ct), 1)


def _pack_stores(code: Code, spec: ConvSpec, packs: list[tuple[Phase, int, str]], math: Math, kp: int,
                 chunk: tuple[int, int], last: bool, mn: bool = False) -> None:
    """:func:`pack_phases`' stores of the taps in ``chunk`` (tap indices r S + s) from the shared tile
    (channel cc, k = k0 + tx; ``mn``: k = km = k0 + kk, B MN-major), and the rows' zero tails after the
    last chunk (K-major B only)."""
    t0, t1 = chunk
    for ph, ld, dst in packs:
        rows = ph.b_rows(spec)
        for row, taps in rows:
            row = row if row.isidentifier() else f"({row})"
            mine = [(t, r * spec.s + s) for t, (r, s) in enumerate(taps) if t0 <= r * spec.s + s < t1]
            which = f", row {row}" if len(rows) > 1 else ""
            if mine:
                code(f"// phase ({ph.ah.ph}, {ph.aw.ph}){which}: {len(mine)} of {len(taps)} taps")
            for t, tap in mine:
                at = f"({t * kp} + km) * {ld} + {row}" if mn else f"{row} * {ld} + {t * kp} + k"
                code(*prep.store_parts(math, spec.dtype, dst, at,
                                       f"tile[(cc * {t1 - t0} + {tap - t0}) * 33 + {'kk' if mn else 'tx'}]"))
            if last and ld - len(taps) * kp and not mn:
                prep.zero_tail(code, math, dst, row, f"{len(taps) * kp} + k", ld, kp)


def zero_phases(name: str, spec: ConvSpec) -> tuple[Kernel, Dim3] | None:
    """Zeros on the dx pixels of the phases no tap reaches, or None where every phase has taps. A
    thread stores ``vector_width`` elements at once (a pixel's channels in NHWC, a run of a row in
    NCHW) where one of them lies in such a phase: it runs before the phases' GEMMs, which write their
    own elements over any zero it leaves on them."""
    ah, aw = axes(spec)
    empty_h = [a.ph for a in phase_axes(ah) if not a.taps]
    empty_w = [a.ph for a in phase_axes(aw) if not a.taps]
    if not empty_h and not empty_w:
        return None
    sh, sw = spec.stride
    vec = vector_width(spec)
    st = Storage(spec.dtype)
    if spec.layout == "nhwc":  # a thread's vec channels share one pixel
        body = [f"const int ww = e * {vec} / {spec.c} % {spec.w}, hh = e * {vec} / {spec.c * spec.w} % {spec.h};"]
        cols = [f"ww % {sw} == {pw}" for pw in empty_w]
    else:  # a thread's vec elements are columns w0 .. w0 + vec - 1 of one row
        body = [f"const int w0 = e * {vec} % {spec.w}, hh = e * {vec} / {spec.w} % {spec.h};"]
        cols = ["true"] if empty_w and vec >= sw else [f"(w0 + {j}) % {sw} == {pw}" for pw in empty_w
                                                        for j in range(vec)]
    conds = [f"hh % {sh} == {ph}" for ph in empty_h] + cols
    zero = "MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f)"
    store = {1: st.store("x", "e", "0.0f"), 4: st.vstore4(zero, "e", "x"), 8: st.vstore8(zero, zero, "e", "x")}[vec]
    body.append(f"if ({' || '.join(conds)}) {store};")
    return elementwise(name, spec.n * spec.c * spec.h * spec.w // vec, (st.buf("x", readonly=False),), body,
                       f"dgrad: zeros where no tap reaches (phases h%{sh} in {empty_h}, w%{sw} in {empty_w}), "
                       f"{vec} element{'s' if vec > 1 else ''} a thread")


class TcDgradStrided(TcVariant):
    """Strided dgrad by the wgmma generator (see the module docstring). Channels-last (``layout="nhwc"``):
    dy is read in place where its channels are whole 16-byte chunks of halves or TF32 (else one
    per-element step pads them); a phase's D rows are whole dx pixels (C contiguous channels), so
    the GEMM stores them on dx's sub-grid (``il=0``, the default) or through the phase buffers and
    the interleave pass (``il=1``)."""

    passes = frozenset({"dgrad"})
    layouts = frozenset({"nchw", "nhwc"})

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """First on sm_90 for TF32 and half layers (far above dgrad_strided_gemm on CUDA cores).
        3xTF32 first in the fp32 class, one below the TF32 form (ahead of dgrad_strided_gemm and
        dgrad_sub_gemm1x1 on strided layers at FP32-grade error); below dgrad_direct where the dx
        channels fill less than half a 32-wide tile (C < 16: a 3-channel stem)."""
        if device_reason(device) is not None or self.x3h:  # 3xFP16: not yet run on a GPU
            return self.specialised
        if self.x3:
            return -1 if spec.c < 16 else RANK_SM90 - 1
        return RANK_SM90

    def _kp(self, spec: ConvSpec) -> int:
        return prep.padded_channels(spec.k, self.math(spec))

    def _phases(self, spec: ConvSpec) -> list[Phase]:
        """The GEMMs of a call, one per stride phase (subclasses: their own grouping of the phases)."""
        return phases(spec)

    def _b_rows(self, spec: ConvSpec, ph: Phase) -> int:
        """Rows of phase ``ph``'s packed filters (every GEMM group's): dx's C channels."""
        return spec.c

    def job_problem(self, spec: ConvSpec, ph: Phase) -> Problem:
        """Phase ``ph``'s GEMM (subclasses: a batch of them)."""
        return ph.problem(spec, self._kp(spec))

    def store(self, spec: ConvSpec, ph: Phase, il: bool, jn: bool = False) -> Output:
        """Where phase ``ph``'s D goes: its compact buffer (``il``), dx's sub-grid, or (``jn``) held
        in registers (column phase 0) until column phase 1 stores both as pairs."""
        if not jn:
            return ph.compact(spec) if il else ph.output(spec)
        if ph.aw.ph == 0:
            return replace(ph.output(spec), park=True)
        hw, pq, (sh, sw) = spec.h * spec.w, ph.ah.rows * ph.aw.rows, spec.stride
        return Output("x", spec.n * pq, 2 * spec.c, pq, spec.dtype, istride=spec.c * hw, kstride=hw,
                      pix_q=ph.aw.rows, pix_row=sh * spec.w, pix_col=sw, pix_base=ph.ah.ph * spec.w, kdiv=2, ksub=1,
                      epi=Epilogue(), joined=True)

    def jn_reason(self, spec: ConvSpec, cfg: TileConfig) -> str | None:
        """Why the column phases cannot be joined in registers (``jn=1``), or None: an NCHW dx of one
        16-bit part at column stride 2, every phase with taps on one sub-grid (every GEMM of one tile
        count: block b takes tile b of each), a ps=0 tile of one 64-row block a consumer (two spilled)
        without clusters, ping-pong or split."""
        math = self.math(spec)
        if spec.layout != "nchw" or math.parts != ("hi",) or math.scaled or spec.dtype == "float32":
            return "joined column phases store an NCHW dx of 16-bit elements"
        if spec.stride[1] != 2:
            return f"column stride {spec.stride[1]}: phases are joined in pairs (stride 2)"
        if cfg.ps or cfg.cl > 1 or cfg.pp or cfg.ks > 1 or cfg.wm != 1:
            return (f"tile {cfg.params().short()}: joining needs ps=0, consumers of one 64-row block (the parked "
                    "tile's registers beside the accumulators), no clusters, ping-pong or split")
        phs = self._phases(spec)
        if any(ph.empty for ph in phs) or len({(ph.ah.rows, ph.aw.rows) for ph in phs}) > 1:
            return "the phases' sub-grids differ (or a phase has no taps): their GEMMs' tiles would not pair"
        return None

    def pack_step(self, spec: ConvSpec, packs: list[tuple[Phase, int, str]],
                  cfg: TileConfig | None = None) -> tuple[Kernel, Dim3]:
        """The weight-only step writing every phase's B (:func:`pack_phases`; MN-major with ``mn=1``)."""
        return pack_phases(f"{self.name}_w", spec, packs, self.math(spec), self._kp(spec),
                           mn=bool(cfg is not None and cfg.mn))

    def _dy_in_place(self, spec: ConvSpec, cfg: TileConfig | None = None) -> bool:
        """A channels-last dy the GEMM reads as it lies (prep.reads_in_place's rule, for dy's K channels),
        or an NCHW one read MN-major (``mn=1``)."""
        if cfg is not None and cfg.mn:
            return True
        math = self.math(spec)
        return spec.layout == "nhwc" and not (math.split or math.scaled) and self._kp(spec) == spec.k

    def mn_reason(self, spec: ConvSpec) -> str | None:
        """Why an NCHW dy cannot be read as it lies (``mn=1``), or None: 16-bit operands of one part, K
        whole 64-channel stages (a stage in one tap), every phase's sub-grid rows whole 64-pixel blocks
        (:class:`MnPlanes`: each block a box of one dy row at the tap's offset, zeros outside)."""
        math = self.math(spec)
        if spec.layout != "nchw":
            return "dy is read in place MN-major in NCHW only (channels-last dy: K-major, already in place)"
        if math.parts != ("hi",) or math.scaled or math.esize != 2:
            return "MN-major operands are 16-bit (FP16, BF16)"
        if spec.k % 64:
            return f"K ({spec.k}) is not whole 64-channel stages (a stage would straddle two taps)"
        for ph in self._phases(spec):
            if ph.empty:
                continue
            if ph.aw.rows % 64:
                return f"phase {ph.tag}'s sub-grid rows of {ph.aw.rows} pixels are not whole 64-pixel blocks"
            offs = [ph.aw.first + t * ph.aw.delta for t in range(len(ph.aw.taps))]
            if any(o % 8 for o in offs):
                # the H200 faults (illegal instruction) on a tile copy whose innermost coordinate is not a
                # multiple of 16 bytes: a tap's one-column shift cannot be the copy's own offset
                return (f"phase {ph.tag}'s column taps read dy at column offsets {offs}: a TMA tile box starts "
                        "on a 16-byte boundary of its innermost dimension (8 halves)")
        return None

    def _dy(self, spec: ConvSpec, cfg: TileConfig | None = None) -> str:
        return "y" if self._dy_in_place(spec, cfg) else "dyh"

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
        probs = [self.job_problem(spec, ph) for ph in self._phases(spec) if not ph.empty]
        return max(probs, key=lambda p: p.m * p.kred, default=Problem(spec.n, spec.c, kp))  # none: dx is zeros

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The column phases joined in registers where that fills the GPU (:meth:`_joined`), else the
        plain default (:meth:`_plain_default`)."""
        plain = self._plain_default(spec, device)
        joined = self._joined(spec, device, plain)
        return joined[0] if joined else plain

    def _plain_default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The generator's pick for the largest phase, the operands by TMA where every phase's can be
        (tensorcore/sm90/tma.py); phases interleaved (il=1) on NCHW, stored straight on a channels-last
        dx (:meth:`_direct_first`)."""
        cfg = tiles.pick(self.math(spec), self._largest(spec), device.units, self.limit(device))
        return self._tile(spec, cfg).params().replace(il=0 if self._direct_first(spec) else 1)

    def _joined(self, spec: ConvSpec, device: DeviceInfo, plain: Params) -> list[Params]:
        """``jn=1`` tiles of 128 rows (two consumers of 64) by 128 or 64 columns (the wider first where C
        fills it), ``plain``'s stages at most, where the layer joins (:meth:`jn_reason`), has 32 dx
        channels or more and one phase's tiles fill three quarters of their waves of blocks (a block
        takes one tile of every phase, ``ps=0``). H200, FP16: 4x4/2 decoder layers 0.078 -> 0.064 ms on
        SD-VAE 512@64, 0.047 -> 0.039 on DCGAN 128@16 (0.97 of their waves); ResNet-50's 3x3/2 dgrad
        0.055 -> 0.040 at 512@7 (0.79); slower where the waves are emptier: DCGAN 512@4 (0.48), ResNet
        256@14 (0.74: 0.038 -> 0.047; 128@28 at 0.74 was faster, 0.049 -> 0.039, and is left plain)."""
        if spec.c < 32 or self.jn_reason(spec, TileConfig(128, 64, 1, 2, 2, ps=0)):
            return []
        math, base = self.math(spec), self._split(plain)[0]
        out = []
        for bn in ((128, 64) if spec.c >= 128 else (64,)):
            cfg = self._tile(spec, TileConfig(128, bn, base.kb, min(base.st, 6), 2, 1, 0, base.pi, kr=base.kr))
            probs = [self.job_problem(spec, ph) for ph in self._phases(spec)]
            tiles = cfg.tiles(probs[0])
            waves = cdiv(tiles, max(device.units, 1)) * max(device.units, 1)
            if self.jn_reason(spec, cfg) or any(cfg.problems(math, p, self.limit(device)) for p in probs) \
                    or 4 * tiles < 3 * waves:
                continue
            out.append(cfg.params().replace(il=0, jn=1))
        return out

    @staticmethod
    def _direct_first(spec: ConvSpec) -> bool:
        """A channels-last dx: a phase's D row is one whole dx pixel (C contiguous channels), so the
        direct stores write runs of a pixel's bytes and the phase buffers and interleave pass (two
        more passes over dx) cost more than they save, even where a pixel is less than a sector
        (docs/NOTES-tensorcore.md). NCHW sub-grids leave every other word of a sector to another
        phase (the module docstring): interleaved there."""
        return spec.layout == "nhwc"

    def _tile(self, spec: ConvSpec, c: TileConfig, tm: bool = True) -> TileConfig:
        """``c`` unsplit, with TMA when asked and every phase's operands allow it."""
        cfg = TileConfig(c.bm, c.bn, c.kb, c.st, c.cw, 1, c.ps, c.pi, kr=c.kr, eh=c.eh)
        return tma.with_tma(cfg, lambda t: self.tma_reason(spec, t)) if tm else cfg

    def tma_reason(self, spec: ConvSpec, cfg: TileConfig) -> str | None:
        """Why some phase's operands cannot come by TMA with tile ``cfg`` (or their tensor maps
        would not fit in the kernel's parameters: stride 8 has 64 phases), or None."""
        busy = sum(not ph.empty for ph in self._phases(spec))
        need = busy * (2 * len(self.math(spec).parts) * TENSOR_MAP_BYTES + 8)
        if need > PARAM_BYTES_LIMIT:
            return (f"{busy} phases' tensor maps take {need} bytes of kernel parameters, over the "
                    f"{PARAM_BYTES_LIMIT} allowed")
        for ph in self._phases(spec):
            if not ph.empty:
                why = tma.pair_reason(*self.operands(spec, ph, cfg), cfg.bm, cfg.bn)
                if why:
                    return f"phase {ph.tag}: {why}"
        return None

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The generator's space for the largest phase, unsplit (every phase's rows fill the GPU),
        interleaved; the joined tiles first where they apply, then the plain default tile with direct
        stores (il=0) and by cp.async."""
        math, prob = self.math(spec), self._largest(spec)
        first = self._plain_default(spec, device)
        plain = self._tile(spec, TileConfig.of(Params({k: v for k, v in first.items() if k != "il"})), tm=False)
        out = list(dict.fromkeys(self._joined(spec, device, first) +
                                 [first, first.replace(il=1 - int(first["il"])), plain.params().replace(il=1)]))
        for c in tiles.space(math, prob, device.units, self.limit(device)):
            for p in (self._tile(spec, c).params().replace(il=1), self._tile(spec, c, False).params().replace(il=1)):
                if p not in out:
                    out.append(p)
        return out

    @staticmethod
    def _split(params: Params) -> tuple[TileConfig, bool]:
        """The tile and whether the phases go through their own buffers (``il``, default 1)."""
        il = int(params.get("il", 1))
        if il not in (0, 1):
            raise ValueError(f"il ({il}) must be 0 (stores on dx's sub-grids) or 1 (phase buffers, interleaved)")
        return TileConfig.of(Params({k: v for k, v in params.items() if k not in ("il", "jn")})), bool(il)

    @staticmethod
    def _jn(params: Params) -> bool:
        """Whether the column phases are joined in registers (``jn``, default 0)."""
        jn = int(params.get("jn", 0))
        if jn not in (0, 1):
            raise ValueError(f"jn ({jn}) must be 0 or 1 (column phases joined in registers, stored as pairs)")
        return bool(jn)

    def _ld(self, spec: ConvSpec, ph: Phase, cfg: TileConfig) -> int:
        """Row length of phase ``ph``'s packed filters: the reduction in whole stages, or (``mn=1``) the
        B columns in whole 16-byte rows."""
        if cfg.mn:
            return cdiv(self._b_rows(spec, ph), 8) * 8
        stage = self.math(spec).elems(cfg.kb)
        return cdiv(self.job_problem(spec, ph).kred, stage) * stage

    def _b_bytes(self, spec: ConvSpec, ph: Phase, cfg: TileConfig) -> int:
        """Bytes of phase ``ph``'s packed filters (each part): B rows x ld, or MN-major kred x ld."""
        rows = self.job_problem(spec, ph).kred if cfg.mn else self._b_rows(spec, ph)
        return self.math(spec).esize * rows * self._ld(spec, ph, cfg)

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return sum(b for _, b in self._workspace(spec, *self._split(params)))

    def _workspace(self, spec: ConvSpec, cfg: TileConfig, il: bool) -> tuple[tuple[str, int], ...]:
        math, kp = self.math(spec), self._kp(spec)
        out: tuple[tuple[str, int], ...] = ()
        if not self._dy_in_place(spec, cfg):
            out = tuple(((f"dyh{'' if p == 'hi' else '_' + p}"), math.esize * spec.n * spec.p * spec.q * kp)
                        for p in math.parts) + prep.scale_workspace("dyh", math)
        for ph in self._phases(spec):
            if not ph.empty:
                nbytes = self._b_bytes(spec, ph, cfg)
                out += tuple((f"wph{ph.tag}{'' if p == 'hi' else '_' + p}", nbytes) for p in math.parts)
                out += prep.scale_workspace(f"wph{ph.tag}", math)
                if il:
                    out += ((ph.buf, spec.itemsize * ph.part().elements(spec)),)
        return out

    # -- plan ---------------------------------------------------------------------------------
    def operands(self, spec: ConvSpec, ph: Phase, cfg: TileConfig) -> tuple[Operand, Operand]:
        """A: dy (NHWC) gathered for the phase's sub-grid; B: its packed filters (:meth:`plain_operands`).
        ``mn=1``: A = the NCHW dy's planes at each tap's offset (:class:`MnPlanes`), B the filters
        MN-major ([taps K][C])."""
        if not cfg.mn:
            return self.plain_operands(spec, ph, cfg)
        why = self.mn_reason(spec)
        if why:
            raise ValueError(f"{self.name}: mn (1): {why}")
        math, ah, aw = self.math(spec), ph.ah, ph.aw
        a = MnPlanes("a", cfg.a_tile(), math, "y", images=spec.n, chans=spec.k, p=spec.p, q=spec.q, ps=ah.rows,
                     qs=aw.rows, first_h=ah.first, first_w=aw.first, delta_h=ah.delta, delta_w=aw.delta,
                     taps_w=len(aw.taps))
        return a, MnRows("b", cfg.b_tile(), math, f"wph{ph.tag}", cols=self._b_rows(spec, ph),
                         ld=self._ld(spec, ph, cfg), kred=self.job_problem(spec, ph).kred)

    def plain_operands(self, spec: ConvSpec, ph: Phase, cfg: TileConfig) -> tuple[Im2colNhwc, DenseRows]:
        """A: dy (NHWC) gathered for the phase's sub-grid; B: its packed filters, K-major."""
        math, kp = self.math(spec), self._kp(spec)
        prob = self.job_problem(spec, ph)
        a = Im2colNhwc("a", cfg.a_tile(), math, self._dy(spec), geo=ph.geometry(spec, kp))
        b = DenseRows("b", cfg.b_tile(), math, f"wph{ph.tag}", rows=self._b_rows(spec, ph), ld=self._ld(spec, ph, cfg),
                      kred=prob.kred, padded=True)
        return a, b

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        math, kp = self.math(spec), self._kp(spec)
        cfg, il = self._split(params)
        jn = self._jn(params)
        if cfg.ks != 1:
            raise ValueError(f"{self.name}: ks ({cfg.ks}) must be 1 (each phase's rows fill the GPU)")
        refused = (self.jn_reason(spec, cfg) or ("il (1): joined phases store dx directly" if il else None)) \
            if jn else None
        if refused:
            raise ValueError(f"{self.name}: jn (1): {refused}")
        refs = lambda bufs: tuple(x.name for x in bufs)  # noqa: E731
        pq = spec.p * spec.q
        if self._dy_in_place(spec, cfg):
            pairs = []
        elif spec.layout == "nhwc":
            yk, ygrid = prep.rows_from_nhwc(f"{self.name}_dy", "y", spec.k, spec.n * pq, kp, math, spec.dtype, "dyh")
            pairs = prep.launches(math, yk, ygrid, "y", "dyh", spec)
        else:
            yk, ygrid = prep.planes_to_rows(f"{self.name}_dy", "y", f"(n * {spec.k} + ci) * {pq} + p", spec.n, spec.k,
                                            pq, kp, math, spec.dtype, "dyh",
                                            f"dy NCHW -> NHWC ({kp} channels) as {math.name} operands")
            pairs = prep.launches(math, yk, ygrid, "y", "dyh", spec)
        kernels: list[Kernel] = [k for k, _ in pairs]
        steps: list[Step] = [launch for _, launch in pairs]
        zk = None if il else zero_phases(f"{self.name}_zero", spec)
        if zk is not None:
            kernels.append(zk[0])
            steps.append(Launch(zk[0].name, zk[1], zk[0].block, ("x",)))
        jobs: list[Job] = []
        packs: list[tuple[Phase, int, str]] = []
        for ph in self._phases(spec):
            if ph.empty:
                continue
            prob = self.job_problem(spec, ph)
            why = cfg.problems(math, prob, self.limit(device))
            if why:
                raise ValueError(f"{self.name}: phase {ph.tag}: {'; '.join(why)}")
            a, b = self.operands(spec, ph, cfg)
            packs.append((ph, self._ld(spec, ph, cfg), b.buffer("hi")))
            jobs.append(Job(prob, [a, b], self.store(spec, ph, il, jn)))
        if jobs:  # none where no tap reaches a dx row (H < stride, the tap's phase past dx): dx is zeros
            wk, wgrid = self.pack_step(spec, packs, cfg)
            gk = jobs_kernel(f"{self.name}_gemm", math, cfg, jobs)
            for _, _, dst in packs if math.scaled else ():  # each phase's maximum of w (weight-only steps)
                ak, agrid = prep.amax_of(spec, "w", dst)
                kernels.append(ak)
                steps.append(Launch(ak.name, agrid, ak.block, ("w", f"{dst}_m")))
            kernels += [wk, gk]
            steps += [Launch(wk.name, wgrid, wk.block, refs(wk.args)),
                      Launch(gk.name, (jobs_grid(cfg, [j.prob for j in jobs], device.units), 1, 1), gk.block,
                             launch_refs(gk))]
        if il:
            parts = [ph.part() for ph in self._phases(spec) if not ph.empty]
            ik, igrid = interleave_kernel(f"{self.name}_interleave", spec, parts)
            kernels.append(ik)
            steps.append(Launch(ik.name, igrid, ik.block, tuple(p.buf for p in parts) + ("x",)))
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps),
                    self._workspace(spec, cfg, il), tolerance(math, spec.dtype), epilogue)


register(TcDgradStrided("dgrad_tc_strided_tf32", frozenset({"float32"}), False, "relaxed", 12))
register(TcDgradStrided("dgrad_tc_strided_3xtf32", frozenset({"float32"}), True, "fp32", 4))
register(TcDgradStrided("dgrad_tc_strided_half", frozenset({"float16", "bfloat16"}), False, "fp32", 12))
register(TcDgradStrided("dgrad_tc_strided_3xf16", frozenset({"float32"}), True, "fp32", -2, x3h=True))
