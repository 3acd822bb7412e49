"""Stride-1 dgrad by any forward variant (Nervana's bprop; DESIGN.md "A problem is (spec, pass, dtype)"),
and strided 1x1 dgrad by any forward 1x1 variant (:class:`DgradSubsampled`).

For stride 1, dx = conv(dy, w') with the forward convolution of the transposed problem

    spec' = (N, K, P, Q -> C, R, S), stride 1, the same dilation,
            padding (eff_r-1-pt, eff_r-1-pb, eff_s-1-pl, eff_s-1-pr),
    w'[g*cg + c, kk, R-1-r, S-1-s] = w[g*kg + kk, c, r, s]   (per group: C and K swapped),

whose output is H x W again. :class:`DgradTransposed` turns one forward variant into a dgrad variant:
its plan is one filter transform (``dgrad_rotate``: reads "w", writes the workspace "w_rot", a
weight step that the torch FilterCache keeps per weight version) followed by the forward plan of
spec' with its buffers renamed on the steps (its "x" reads "y" = dy, its "y" writes "x" = dx, its
"w" reads "w_rot", its workspace is prefixed ``fwd_``); kernel sources are the forward's. Padding
larger than the filter's extent would need negative padding and is refused.

Accuracy is the forward variant's: the same arithmetic on dy and the rotated filters. Measured on
PoCL (relative L2 vs float64, N=1, uniform(-1, 1) dy and w, seed 0, defaults), beside the forward
table of docs/NOTES-winograd.md (N=2), within a few percent of it on every layer:

| dgrad, N=1 | direct | strided_gemm | implicit_gemm | F(2x2) nf / fused | F(4x4) nf / fused | F(6x6) nf | F(7x7) nf |
|---|---|---|---|---|---|---|---|
| C=K=64, 56x56 | 4.28e-07 | 4.28e-07 | 4.28e-07 | 2.71e-07 | 1.78e-06 | 3.41e-06 | 3.26e-05 |
| C=K=128, 28x28 | 5.99e-07 | 5.99e-07 | 5.99e-07 | 3.63e-07 | 2.41e-06 | 4.42e-06 | 4.28e-05 |
| C=K=256, 14x14 | 8.37e-07 | 8.37e-07 | 8.38e-07 | 5.05e-07 | 2.99e-06 | 5.94e-06 | 6.25e-05 |
| C=K=512, 7x7 | 1.14e-06 | 1.14e-06 | 1.14e-06 | 6.84e-07 | 3.43e-06 | 7.96e-06 | 9.38e-05 |

so each adapter states the forward variant's class, tolerance and expected error (F(4x4) fp32, its
3.5e-6 stated; F(6x6) / F(7x7) relaxed).
"""

from __future__ import annotations

import dataclasses

from convforge.codegen.dialect import Buf, Kernel
from convforge.kernels import _REGISTRY, register
from convforge.kernels.dgrad.baseline import no_epilogue
from convforge.kernels.dgrad.interleave import Part, interleave_kernel
from convforge.kernels.gemm import elementwise
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Fill, Gemm, Launch, Plan, Step, Variant
from convforge.spec import ConvSpec

ROTATED = "w_rot"  # the workspace holding w' (C x K/G x R x S)
PREFIX = "fwd_"  # the forward plan's own workspace names get this prefix

# The forward variants served as dgrad, by name: the direct family, the GEMM family, im2win, every
# Winograd (F(6x6)/F(7x7) in their relaxed class), the tensor-core TF32 / 3xTF32 / half GEMMs and
# Winograd (CUDA).
# Left out: direct (dgrad_direct is the direct family's own dgrad, one thread per dx element as the
# forward's one per y element, and holds the name), im2col_gemm and im2col_cublas (implicit GEMM does
# the same without the matrix; cuBLAS steps are not capturable) and gemm_fc (a transposed
# fully-connected layer is no full window).
FORWARD = (
    "direct_smem", "direct_shfl",
    "implicit_gemm", "implicit_gemm_precomp", "implicit_gemm_splitk", "im2win",
    "gemm1x1", "gemm1x1_splitk",
    "winograd_fused_f2", "winograd_fused_f4",
    "winograd_nonfused_f2", "winograd_nonfused_f4", "winograd_nonfused_f6", "winograd_nonfused_f7",
    "implicit_gemm_tf32", "implicit_gemm_3xtf32", "implicit_gemm_precomp_tf32", "implicit_gemm_nhwc_tf32",
    "gemm1x1_tf32", "gemm1x1_3xtf32", "gemm1x1_pipe_tf32", "gemm1x1_wgmma_tf32",
    "winograd_nonfused_f2_tf32", "winograd_nonfused_f4_3xtf32", "winograd_nonfused_f6_3xtf32",
    "winograd_nonfused_f2_pipe_tf32",
    "tc_implicit_gemm_tf32", "tc_implicit_gemm_3xtf32", "tc_implicit_gemm_half", "tc_implicit_gemm_3xf16",
    "tc_winograd_f2", "tc_winograd_f2_3xtf32", "tc_winograd_f4_3xtf32", "tc_winograd_f4",
    "tc_grouped_tf32", "tc_grouped_3xtf32", "tc_grouped_half", "tc_grouped_packed_half",
)


def transposed_spec(spec: ConvSpec) -> ConvSpec | str:
    """The forward problem whose output is ``spec``'s dx (stride 1), or why there is none."""
    if spec.stride != (1, 1):
        return (f"stride {spec.stride}: the transposed convolution is stride 1 only "
                "(dgrad_strided_gemm runs strided layers)")
    er, es = spec.eff_r - 1, spec.eff_s - 1
    pt, pb, pl, pr = spec.pad
    pad = (er - pt, er - pb, es - pl, es - pr)
    if min(pad) < 0:
        return (f"padding {list(spec.pad)} exceeds the dilated filter's extent - 1 ({er}, {es}): the "
                "transposed convolution would need negative padding")
    return ConvSpec(spec.n, spec.k, spec.p, spec.q, spec.c, spec.r, spec.s, (1, 1), pad, spec.dilation,
                    spec.dtype, spec.groups, "fprop", spec.layout)


DGRAD_FIRST = 3  # rank raise of a dgrad_first form: past gemm1x1_wgmma_tf32 (12 against 11) and F(4x4) (10 against 8)
# The rank of a 3xFP16 dgrad_first form: past every CUDA-core and 3xTF32 dgrad (dgrad_gemm1x1 10, 3xTF32's
# dgrad_first 11), below the TF32 forms the relaxed class puts first (13 and up), which admits 3xFP16 too.
DGRAD_LEAD = 12


def dgrad_first(fwd: str, spec: ConvSpec) -> bool:
    """Where the dgrad form of forward variant ``fwd`` runs ahead of the one its forward rank puts
    first (float32, timed with the filter rotation; docs/NOTES-gemm.md):

    * ``tc_implicit_gemm_tf32`` over ``gemm1x1_wgmma_tf32`` on 1x1 dgrad where dx has C >= 512
      channels and K >= 512 or N*H*W >= 16384 pixels (behind it wherever C <= 256);
    * ``tc_implicit_gemm_3xtf32`` over Winograd F(4x4) on 3x3 stride-1 dgrad of 14 <= H <= 28 and
      C, K >= 128, at a fifth of its error (behind it at 56² and 7²).
    * ``tc_implicit_gemm_3xf16`` on 3x3 stride-1 dgrad of C, K >= 64 and on 1x1 dgrad where dx has
      C >= 256 channels (behind at C <= 128).
    """
    if spec.conv_pass != "dgrad" or spec.dtype != "float32" or spec.groups != 1 or spec.stride != (1, 1):
        return False
    if fwd == "tc_implicit_gemm_3xf16":
        if spec.dilation != (1, 1):
            return False
        return ((spec.r, spec.s) == (3, 3) and min(spec.c, spec.k) >= 64) or (
            (spec.r, spec.s) == (1, 1) and spec.c >= 256)
    if fwd == "tc_implicit_gemm_tf32":
        return spec.r == spec.s == 1 and spec.c >= 512 and (spec.k >= 512 or spec.n * spec.h * spec.w >= 16384)
    if fwd == "tc_implicit_gemm_3xtf32":
        return (spec.r, spec.s, spec.dilation) == (3, 3, (1, 1)) and 14 <= spec.h <= 28 and min(spec.c, spec.k) >= 128
    return False


def rotate_kernel(spec: ConvSpec) -> tuple[Kernel, tuple[int, int, int]]:
    """w_rot[g*cg + c, kk, R-1-r, S-1-s] = w[g*kg + kk, c, r, s]: one thread per element of w',
    writes coalesced; a copy of the stored bits, so float16 and bfloat16 filters move as they are."""
    cg, kg, r, s = spec.cg, spec.kg, spec.r, spec.s
    ctype = "float" if spec.dtype == "float32" else "unsigned short"
    rs = r * s
    body = [f"const int ss = e % {s}, rr = (e / {s}) % {r}, kk = (e / {rs}) % {kg}, co = e / {rs * kg};",
            f"const int g = co / {cg}, c = co - g * {cg};",
            f"{ROTATED}[e] = w[((g * {kg} + kk) * {cg} + c) * {rs} + {(r - 1) * s + s - 1} - rr * {s} - ss];"]
    return elementwise("dgrad_rotate", spec.c * kg * rs, (Buf("w", ctype), Buf(ROTATED, ctype, readonly=False)), body,
                       "dgrad: filters rotated by 180 degrees, C and K swapped"
                       + (f" per group ({spec.groups} groups)" if spec.groups > 1 else ""))


def rename_step(step: Step, names: dict[str, str]) -> Step:
    """``step`` with every buffer it names mapped through ``names`` (others kept)."""
    def m(ref: object) -> object:
        return names.get(ref, ref) if isinstance(ref, str) else ref

    if isinstance(step, Launch):
        return dataclasses.replace(step, args=tuple(m(a) for a in step.args))  # type: ignore[misc]
    if isinstance(step, Fill):
        return dataclasses.replace(step, buffer=names.get(step.buffer, step.buffer))
    assert isinstance(step, Gemm)
    return dataclasses.replace(step, a=names.get(step.a, step.a), b=names.get(step.b, step.b),
                               c=names.get(step.c, step.c))


class DgradTransposed(Variant):
    """dgrad of a stride-1 layer by the forward variant ``fwd`` on :func:`transposed_spec`; same
    family, precision class, stated error, tolerance and parameters as ``fwd``."""

    passes = frozenset({"dgrad"})

    def __init__(self, fwd: Variant) -> None:
        self.fwd = fwd
        self.name = f"dgrad_{fwd.name}"
        self.family, self.backends, self.precision = fwd.family, fwd.backends, fwd.precision
        self.tolerance, self.exact, self.capturable = fwd.tolerance, fwd.exact, fwd.capturable
        self.tensor_cores = fwd.tensor_cores
        self.specialised, self.space_lead, self.grouped = fwd.specialised, fwd.space_lead, fwd.grouped
        self.dtypes, self.layouts = fwd.dtypes, fwd.layouts  # dy and dx lie as the forward's x and y
        # a forward no GPU has timed makes a dgrad none has either, nor does one whose dgrad form was not timed
        self.named_only = fwd.named_only or not fwd.dgrad_timed

    def slow_on(self, spec: ConvSpec) -> str | None:
        """The forward's word on its dgrad form (``Variant.dgrad_slow_on``)."""
        return self.fwd.dgrad_slow_on(spec)

    problem = staticmethod(transposed_spec)  # the forward problem whose output is dx, or why there is none
    problem_name = "the transposed problem"

    def _t(self, spec: ConvSpec) -> ConvSpec:
        t = self.problem(spec)
        if isinstance(t, str):
            raise ValueError(f"{self.name} does not apply to {spec.short()}: {t}")
        return t

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why:
            return why
        t = self.problem(spec)
        if isinstance(t, str):
            return t
        why = self.fwd.applies(t, device)
        return f"{self.fwd.name} on {self.problem_name} ({t.short()}): {why}" if why else None

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """The forward variant's standing on the transposed problem (its measured rules carry over:
        a stride-1 dgrad costs what the forward of spec' costs, plus the small rotation), raised past
        the forward's first where dgrad was measured apart from the forward (:func:`dgrad_first`)."""
        t = transposed_spec(spec)
        if not isinstance(t, ConvSpec):
            return self.specialised
        rank = self.fwd.rank(t, device)
        if not dgrad_first(self.fwd.name, spec):
            return rank
        return DGRAD_LEAD if self.fwd.name == "tc_implicit_gemm_3xf16" else rank + DGRAD_FIRST

    def expected_error(self, spec: ConvSpec) -> float:
        t = self.problem(spec)
        return self.fwd.expected_error(t if isinstance(t, ConvSpec) else spec.with_pass("fprop"))

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return self.fwd.space(self._t(spec), device)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return self.fwd.default(self._t(spec), device)

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return spec.itemsize * spec.c * spec.kg * spec.r * spec.s + self.fwd.workspace_bytes(self._t(spec), params)

    def epilogue_params(self, spec: ConvSpec, params: Params, epilogue: Epilogue) -> Params:
        """The forward variant's word on ``params`` for a plan with ``epilogue`` (its ``epilogue_params``,
        where it has one: the tensor-core GEMM's tile for a residual), on the transposed problem."""
        fwd = getattr(self.fwd, "epilogue_params", None)
        return params if fwd is None else fwd(self._t(spec), params, epilogue)  # type: ignore[no-any-return]

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        """The rotation, then the forward plan of the transposed problem; ``Epilogue(residual=True)``
        (where the forward variant stores one: ``residual_ok``) adds "res", a tensor shaped and laid out as
        dx, before dx's one rounding: a training block's input gradient summed with the residual
        branch's (torch/fused.py, native.cpp ``BlockNode``). Any other epilogue is refused."""
        if not (epilogue == Epilogue(residual=True) and self.fwd.residual_ok):
            no_epilogue(self.name, epilogue)
        inner = self.fwd.plan(self._t(spec), params, device, epilogue)
        names = {"x": "y", "y": "x", "w": ROTATED, **{n: PREFIX + n for n, _ in inner.workspace}}
        rot, grid = rotate_kernel(spec)
        steps = (Launch(rot.name, grid, rot.block, ("w", ROTATED)),) + tuple(rename_step(s, names) for s in inner.steps)
        workspace = ((ROTATED, spec.itemsize * spec.c * spec.kg * spec.r * spec.s),) + tuple(
            (PREFIX + n, b) for n, b in inner.workspace)
        return Plan(self.name, self.family, spec, params, (rot,) + inner.kernels, steps, workspace,
                    inner.tolerance, epilogue)


# The forward 1x1 variants that serve strided 1x1 dgrad (DgradSubsampled): CUDA-core FP32 (OpenCL too),
# 3xTF32, the wgmma TF32 GEMM that reads dy in place, and the generator's half GEMM.
SUBSAMPLED = ("gemm1x1", "gemm1x1_splitk", "gemm1x1_3xtf32", "gemm1x1_wgmma_tf32", "tc_implicit_gemm_half")
SUBGRID = "dx_sub"  # the workspace holding the stride-1 dgrad of the P x Q grid


def subsampled_spec(spec: ConvSpec) -> ConvSpec | str:
    """The stride-1 forward problem whose output is the dx sub-grid that a strided 1x1 filter
    reaches, or why there is none: dx rows h with (h + pt) % sh == 0 hold
    sum_k dy[n, k, (h + pt) / sh, .] w[k, c] (the 1x1 dgrad of the P x Q grid), every other row and
    column is zero."""
    if spec.r != 1 or spec.s != 1:
        return "only 1x1 filters (larger strided filters: dgrad_tc_strided_* / dgrad_strided_gemm)"
    if spec.stride == (1, 1):
        return "stride 1: the dgrad_<forward> adapters run it without the interleave pass"
    return ConvSpec(spec.n, spec.k, spec.p, spec.q, spec.c, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), spec.dtype,
                    spec.groups, "fprop", spec.layout)


def subgrid_part(spec: ConvSpec) -> Part:
    """Where the sub-grid lies in dx: the phase (-pt mod sh, -pl mod sw), buffer row a + (ph + pt) / sh."""
    (sh, sw), (pt, _, pl, _) = spec.stride, spec.pad
    ph, pw = -pt % sh, -pl % sw
    return Part(SUBGRID, ph, pw, spec.p, spec.q, (ph + pt) // sh, (pw + pl) // sw)


class DgradSubsampled(DgradTransposed):
    """dgrad of a strided 1x1 layer: the forward 1x1 variant ``fwd`` computes the dx sub-grid the
    filter reaches (:func:`subsampled_spec`, compact in a workspace, dy read as it lies), then one
    pass writes all of dx, zeros between (:mod:`.interleave`). The zero-stuffed rows are never
    multiplied and every dx sector is written whole once (the phase-by-phase stores of
    dgrad_tc_strided_* left three sectors in four partial, so the L2 read several times dx's bytes
    from DRAM to fill them)."""

    problem = staticmethod(subsampled_spec)
    problem_name = "the sub-grid problem"

    def __init__(self, fwd: Variant) -> None:
        super().__init__(fwd)
        self.name = f"dgrad_sub_{fwd.name}"

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """One below the forward variant's standing on the sub-grid problem: above dgrad_strided_gemm
        (faster on strided 1x1 layers), below the wgmma strided dgrads on sm_90, which run the same
        layers in one launch with the phases interleaved as fast or faster."""
        t = subsampled_spec(spec)
        return self.fwd.rank(t, device) - 1 if isinstance(t, ConvSpec) else self.specialised

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return super().workspace_bytes(spec, params) + spec.itemsize * subgrid_part(spec).elements(spec)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        inner = self.fwd.plan(self._t(spec), params, device)
        names = {"x": "y", "y": SUBGRID, "w": ROTATED, **{n: PREFIX + n for n, _ in inner.workspace}}
        rot, grid = rotate_kernel(spec)
        part = subgrid_part(spec)
        il, ilgrid = interleave_kernel("dgrad_sub_interleave", spec, [part])
        steps = ((Launch(rot.name, grid, rot.block, ("w", ROTATED)),)
                 + tuple(rename_step(s, names) for s in inner.steps)
                 + (Launch(il.name, ilgrid, il.block, (SUBGRID, "x")),))
        workspace = ((ROTATED, spec.itemsize * spec.c * spec.kg),
                     (SUBGRID, spec.itemsize * part.elements(spec))) + tuple(
            (PREFIX + n, b) for n, b in inner.workspace)
        return Plan(self.name, self.family, spec, params, (rot,) + inner.kernels + (il,), steps, workspace,
                    inner.tolerance, epilogue)


def register_adapters() -> None:
    """Register the adapters of the forward variants above. The registry's first load
    (``kernels._load``) calls it once every family module is imported; one that another change
    renamed is skipped, and tests/test_dgrad.py names the variants gone missing."""
    for name in FORWARD:
        if name in _REGISTRY:
            register(DgradTransposed(_REGISTRY[name]))
    for name in SUBSAMPLED:
        if name in _REGISTRY:
            register(DgradSubsampled(_REGISTRY[name]))
