"""Strided dgrad of grouped half layers on the wgmma generator: :mod:`~convforge.kernels.tensorcore.sm90.dgrad`'s
phases, each phase's GEMM batched over the groups as :mod:`~convforge.kernels.tensorcore.sm90.grouped` batches a
forward's (ResNeXt's stride-2 grouped 3x3 layers: 32 groups of 8, 16 or 32 channels).

Group z of a G-group layer maps its Kg dy channels to its Cg dx channels through w[z Kg .., :Cg]. Narrow groups
are packed first (:func:`pack`, as :class:`~convforge.kernels.tensorcore.sm90.grouped.TcGroupedPacked` packs a
forward's): P groups form one GEMM group of P Cg columns and a reduction of P Kg channels a tap, its phase filters
block-diagonal, so a tile's 64 columns and a stage's channels are mostly real. Per phase, GEMM group zp of
G / P (the Problem's ``batch``):

* A = :class:`~convforge.kernels.tensorcore.sm90.operands.Im2colNhwc` over dy (NHWC, read in place or after the
  dense form's conversion step), P Kg channels a tap from channel zp P Kg on, pixels K channels apart
  (``pitch``, ``group_stride``);
* B = :class:`~convforge.kernels.tensorcore.sm90.operands.DenseRows` over the phase filters, dx channel c's row
  at c ld (:func:`~convforge.kernels.tensorcore.sm90.dgrad.pack_phases` with ``block``), group zp's P Cg rows
  from row zp P Cg on (``batch_stride``);
* D = the dense form's destination (dx's sub-grid, or the phase buffer the interleave pass reads) narrowed to
  P Cg columns, slab zp at dx channel zp P Cg.

P Kg must be whole 8-channel chunks (a chunk never straddles two GEMM groups); operands by cp.async (as the
grouped forward's), the reduction unsplit. ``auto`` runs it: it is the only half variant for these layers (timings in
docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses

from convforge.codegen.dialect import Dim3, Kernel
from convforge.kernels import register
from convforge.kernels.tensorcore.sm90.dgrad import Phase, TcDgradStrided, pack_phases
from convforge.kernels.tensorcore.sm90.epilogue import Output
from convforge.kernels.tensorcore.sm90.grouped import pack_factor
from convforge.kernels.tensorcore.sm90.operands import Operand
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig
from convforge.plan import DeviceInfo
from convforge.spec import ConvSpec


def pack(spec: ConvSpec) -> int:
    """Groups packed into one GEMM group: the most P dividing the groups with P Cg <= grouped.PACKED_COLUMNS
    dx channels and P Kg whole 8-channel chunks (1: none): the forward's rule on the transposed problem."""
    return pack_factor(dataclasses.replace(spec, c=spec.k, k=spec.c))


class TcDgradStridedGrouped(TcDgradStrided):
    """Strided dgrad of a grouped layer: every phase's GEMM batched over the (packed) groups (the module
    docstring)."""

    grouped = True
    offset_ok = False

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.groups == 1:
            return f"{self.name} runs grouped layers (groups > 1); dgrad_tc_strided_* runs the others"
        if spec.depthwise:
            return "a depthwise layer's dgrad is the depthwise family's"
        if spec.stride == (1, 1):
            return "stride 1: dgrad_tc_grouped_* (the grouped forward on the transposed problem) runs it"
        why = super().applies(spec, device)
        if why:
            return why
        chunk = self.math(spec).chunk_elems
        if pack(spec) * spec.kg % chunk:
            return (f"groups of {spec.kg} dy channels are not whole {chunk}-channel chunks, packed or not (a chunk "
                    "would straddle two groups)")
        return None

    def tma_reason(self, spec: ConvSpec, cfg: TileConfig) -> str | None:
        return "a grouped layer's operands come by cp.async"

    def _widths(self, spec: ConvSpec) -> tuple[int, int, int]:
        """(GEMM groups, dx columns, dy channels a tap) of one packed group."""
        p = pack(spec)
        return spec.groups // p, p * spec.cg, p * spec.kg

    def job_problem(self, spec: ConvSpec, ph: Phase) -> Problem:
        groups, cols, red = self._widths(spec)
        return Problem(spec.n * ph.ah.rows * ph.aw.rows, cols, len(ph.ah.taps) * len(ph.aw.taps) * red, groups)

    def operands(self, spec: ConvSpec, ph: Phase, cfg: TileConfig) -> tuple[Operand, Operand]:
        """The dense form's operands narrowed to one packed group, offset per group (the module docstring)."""
        if cfg.mn:
            raise ValueError(f"{self.name}: mn (1): grouped phases read dy's packed groups K-major")
        a, b = self.plain_operands(spec, ph, cfg)
        _, cols, red = self._widths(spec)
        assert a.geo is not None
        geo = dataclasses.replace(a.geo, cp=red, pitch=a.geo.cp, group_stride=red)
        return (dataclasses.replace(a, geo=geo),
                dataclasses.replace(b, rows=cols, batch_stride=cols * b.ld))

    def jn_reason(self, spec: ConvSpec, cfg: TileConfig) -> str | None:
        return "grouped phases store slabs of packed groups (jn is the dense form's)"

    def store(self, spec: ConvSpec, ph: Phase, il: bool, jn: bool = False) -> Output:
        """The dense form's destination, P Cg columns a slab, slab zp from dx channel zp P Cg on."""
        out = super().store(spec, ph, il)
        _, cols, _ = self._widths(spec)
        return dataclasses.replace(out, n=cols, k_total=spec.c, slab=cols * out.kst)

    def pack_step(self, spec: ConvSpec, packs: list[tuple[Phase, int, str]],
                  cfg: TileConfig | None = None) -> tuple[Kernel, Dim3]:
        """Every phase's block-diagonal filters (:func:`pack_phases` with ``block``)."""
        _, _, red = self._widths(spec)
        return pack_phases(f"{self.name}_w", spec, packs, self.math(spec), red, block=(spec.kg, spec.cg))


register(TcDgradStridedGrouped("dgrad_tc_strided_grouped_half", frozenset({"float16", "bfloat16"}), False, "fp32",
                               12))
