"""Strided dgrad with neighbouring column phases in one GEMM (``dgrad_tc_paired_half``): where the column
phases pw0, pw0 + 1, ... of a run read the same dy columns (the same first offset, tap count and
sub-grid width: every column phase of a kernel-equals-stride layer such as UNet's 2x2/2 up-convolutions,
a 1x1 GEMM and a pixel shuffle; 6x6/2 with padding 2; FCN-8s' 16x16/8 in two runs of four), their GEMMs
share A (dy, gathered once) and differ only in B (each phase's taps). One GEMM per (row phase, run) then
takes B's rows for every phase of the run, N = g C columns:

* NCHW dx: column c g + i is channel c of column phase pw0 + i, stored at dx pixel (ph + sh a,
  pw0 + i + sw b) by ``Output.kdiv`` = g, ``ksub`` = 1: the g phases' values of a dx row lie side by side
  and one warp stores them together, so every 32-byte sector is whole when it reaches the L2 (the
  plain form's direct stores leave every other element of a sector to another phase's GEMM, which runs
  later, and the L2 fills the rest from DRAM; it stores through phase buffers and an interleave
  instead, two more passes over dx: tensorcore/sm90/dgrad.py).
* NHWC dx: column i C + c, a run of g C elements of consecutive dx pixels' channels.

No phase buffers, no interleave pass. Emulated against float64 (tests/test_tensorcore_paired.py) and
run against it on the GPU (tests/test_gpu_tensorcore.py); ranked ahead of ``dgrad_tc_strided_half`` where
it applies.

``mn=1`` (NCHW, where each GEMM's A is dy itself: kernel = stride without padding): dy read as it lies,
[N][K][P Q], as MN-major tiles of 64 pixels of one image (3-D tiled TMA copies: ``MnRows.images``) and B
packed MN-major ([K][g C], c fastest), so a call is the filter step and the GEMM, no dy copy: the
default where it applies (four stages), and in the tuner's space beside the copying form (GPU tier:
``test_gpu_tensorcore -k dy_in_place``).
"""

from __future__ import annotations

from dataclasses import dataclass

from convforge.kernels import register
from convforge.kernels.dgrad.strided import axes
from convforge.kernels.tensorcore.sm90.dgrad import Phase, PhaseAxis, TcDgradStrided, phase_axes
from convforge.kernels.tensorcore.sm90.epilogue import Output
from convforge.kernels.tensorcore.sm90.operands import MnRows, Operand
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig
from convforge.kernels.tensorcore.sm90.variants import RANK_SM90
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue
from convforge.spec import ConvSpec


@dataclass(frozen=True)
class PairedPhase(Phase):
    """Row phase ``ah`` with the run ``cols`` of column phases (consecutive, the same dy columns read:
    ``aw`` is the first of them) as one GEMM (the module docstring)."""

    cols: tuple[PhaseAxis, ...] = ()

    @property
    def tag(self) -> str:
        return f"{self.ah.ph}{self.aw.ph}x{len(self.cols)}"

    def problem(self, spec: ConvSpec, kp: int) -> Problem:
        return Problem(spec.n * self.ah.rows * self.aw.rows, len(self.cols) * spec.c,
                       len(self.ah.taps) * len(self.aw.taps) * kp)

    def b_rows(self, spec: ConvSpec) -> list[tuple[str, list[tuple[int, int]]]]:
        """Dx channel c's row of each column phase of the run: c g + i (NCHW) or i C + c (NHWC), the
        phase's own taps (the same count in each)."""
        g = len(self.cols)
        rows = []
        for i, col in enumerate(self.cols):
            row = f"c * {g} + {i}" if spec.layout == "nchw" else (f"{i * spec.c} + c" if i else "c")
            rows.append((row, [(r, s) for r in self.ah.taps for s in col.taps]))
        return rows

    def output(self, spec: ConvSpec) -> Output:
        """D (N Hm Wm x g C) on the run's sub-grids of dx (the module docstring's column order)."""
        g, (sh, sw) = len(self.cols), spec.stride
        hw, pq = spec.h * spec.w, self.ah.rows * self.aw.rows
        base = self.ah.ph * spec.w + self.aw.ph
        if spec.layout == "nhwc":
            c = spec.c
            return Output("x", spec.n * pq, g * c, pq, spec.dtype, istride=c * hw, kstride=1, pix_q=self.aw.rows,
                          pix_row=sh * spec.w * c, pix_col=sw * c, pix_base=base * c, epi=Epilogue())
        return Output("x", spec.n * pq, g * spec.c, pq, spec.dtype, istride=spec.c * hw, kstride=hw,
                      pix_q=self.aw.rows, pix_row=sh * spec.w, pix_col=sw, pix_base=base, kdiv=g, ksub=1,
                      epi=Epilogue())


def runs(cols: list[PhaseAxis]) -> list[tuple[PhaseAxis, ...]]:
    """The column phases with taps, in runs of consecutive phases that read the same dy columns."""
    out: list[tuple[PhaseAxis, ...]] = []
    for col in cols:
        if not col.taps or col.rows <= 0:
            continue
        last = out[-1][-1] if out else None
        if last is not None and last.ph + 1 == col.ph and (last.first, len(last.taps), last.rows) == \
                (col.first, len(col.taps), col.rows):
            out[-1] += (col,)
        else:
            out.append((col,))
    return out


def paired_phases(spec: ConvSpec) -> list[Phase]:
    """Every (row phase, run of column phases) GEMM of ``spec``; row phases without taps are empty
    (their dx rows get the zero step's zeros)."""
    ah, aw = axes(spec)
    cols = runs(phase_axes(aw))
    out: list[Phase] = []
    for row in phase_axes(ah):
        out += [PairedPhase(row, run[0], run) for run in cols]
    return out


class TcDgradPaired(TcDgradStrided):
    """The strided dgrad with each run of column phases in one GEMM (the module docstring); direct
    stores only (``il=0``)."""

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Ahead of dgrad_tc_strided_half where it applies (the GPU tier's cases passed; faster on
        every decoder layer it takes, both layouts: docs/BENCHMARKS.md)."""
        base = super().rank(spec, device)
        return base + 1 if base == RANK_SM90 else base

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why:
            return why
        if spec.groups != 1:
            return "grouped layers: dgrad_tc_strided_grouped_half"
        if all(len(run) == 1 for run in runs(phase_axes(axes(spec)[1]))):
            return "no two neighbouring column phases read the same dy columns: dgrad_tc_strided_* runs it"
        return None

    def _phases(self, spec: ConvSpec) -> list[Phase]:
        return paired_phases(spec)

    def jn_reason(self, spec: ConvSpec, cfg: TileConfig) -> str | None:
        return "the paired GEMM holds its column phases in one tile already (jn is dgrad_tc_strided_half's)"

    # -- dy read in place (mn=1) --------------------------------------------------------------
    def mn_reason(self, spec: ConvSpec) -> str | None:
        """Why an NCHW dy cannot be read as it lies (``mn=1``), or None: every GEMM must read dy's
        pixel (i, j) for its sub-grid pixel (i, j) with one tap (kernel = stride, no padding), so A
        is dy itself, [N][K][P Q] with the reduction over K: MN-major tiles of 64 pixels of one
        image (P Q a multiple of 64), K whole 16-byte rows of B."""
        if spec.layout != "nchw":
            return "dy is read in place MN-major in NCHW only (channels-last dy: K-major, already in place)"
        if spec.k % 8:
            return f"K ({spec.k}) is not whole 16-byte rows"
        if (spec.p * spec.q) % 64:
            return f"P Q ({spec.p * spec.q}) is not whole 64-pixel blocks of an image"
        for ph in self._phases(spec):
            if ph.empty:
                continue
            if any(len(a.taps) != 1 or a.first != 0 or a.rows != n for a, n in
                   [(ph.ah, spec.p)] + [(c, spec.q) for c in getattr(ph, "cols", (ph.aw,))]):
                return f"phase {ph.tag} reads dy with more than one tap or off its own pixel"
        return None

    def operands(self, spec: ConvSpec, ph: Phase, cfg: TileConfig) -> tuple[Operand, Operand]:
        """``mn=1``: A = dy [N][K][P Q] as it lies, B = the run's packed filters [K][g C] (both
        MN-major); else the plain form's."""
        if not cfg.mn:
            return super().operands(spec, ph, cfg)
        why = self.mn_reason(spec)
        if why:
            raise ValueError(f"{self.name}: mn=1: {why}")
        math, pq = self.math(spec), spec.p * spec.q
        a = MnRows("a", cfg.a_tile(), math, "y", cols=pq, ld=pq, kred=spec.k, images=spec.n)
        b = MnRows("b", cfg.b_tile(), math, f"wph{ph.tag}", cols=self._b_rows(spec, ph), ld=self._ld(spec, ph, cfg),
                   kred=spec.k)
        return a, b

    def _b_rows(self, spec: ConvSpec, ph: Phase) -> int:
        return len(ph.cols) * spec.c if isinstance(ph, PairedPhase) else spec.c

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The plain form's default with the direct stores; dy read in place (``mn=1``) where it can be."""
        return self._in_place(spec, device, super().default(spec, device).replace(il=0))

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The plain form's space with the direct stores (the only ones here), each also with dy read
        in place where it can be."""
        plain = [p.replace(il=0) for p in super().space(spec, device)]
        return list(dict.fromkeys(plain + [self._in_place(spec, device, p) for p in plain]))

    def _in_place(self, spec: ConvSpec, device: DeviceInfo, params: Params) -> Params:
        """``params`` with dy read in place (``mn=1``, at most four stages) where :meth:`mn_reason`
        allows it and every phase's tile takes MN-major operands, else unchanged."""
        if self.mn_reason(spec) is not None:
            return params
        mn = params.replace(mn=1, st=min(int(params.get("st", 4)), 4))
        cfg, _ = self._split(mn)
        math = self.math(spec)
        if any(cfg.problems(math, self.job_problem(spec, ph), self.limit(device))
               for ph in self._phases(spec) if not ph.empty):
            return params
        return mn

    @staticmethod
    def _split(params: Params) -> tuple[TileConfig, bool]:
        cfg, il = TcDgradStrided._split(params)
        if il:
            raise ValueError("il (1): the paired strided dgrad stores dx directly (il=0), no phase buffers")
        return cfg, il


register(TcDgradPaired("dgrad_tc_paired_half", frozenset({"float16", "bfloat16"}), False, "fp32", 12))
