"""Tensor-core (TF32) variants of the GEMM family: implicit GEMM and the 1x1 path on
:mod:`convforge.kernels.tensorcore.sm80.mma_sync`, in two accuracy grades.

* ``*_tf32``: operands rounded to TF32 (10-bit mantissa, unit roundoff u = 2^-11), FP32
  accumulation: class "relaxed". Each product carries two roundings of relative size up to u
  (root mean square about u / sqrt(3) each for mantissas spread over the binade), so a sum of
  many products of either sign has a relative L2 error about sqrt(2/3) u ~ 4e-4 at most, typically
  2-4e-4 (PyTorch's TF32 convolutions measure 2.6e-4 per ResNet layer): stated 3e-4, checked
  against 1e-3.
* ``*_3xtf32``: each operand split a = hi + lo (hi = tf32(a), lo = tf32(a - hi)), three products
  (the dropped lo.lo term and the rounding of lo are ~u^2 ~ 2.4e-7 relative): FP32-grade, stated
  1e-6 like the CUDA-core GEMMs, checked against 1e-5: class "fp32" (the tuner measures the real
  error per layer).

* ``winograd_nonfused_f*_tf32`` / ``_3xtf32``: the non-fused Winograd variants (their transforms,
  splits and stores) with the alpha^2-batched GEMM on tensor cores. Rounding U and V to TF32 is
  amplified by the output transform: a float64 model with only U and V rounded (3x3 filters,
  C 64 and 256, uniform data) gives relative L2 4.7-5.0e-4 for F(2x2), 2.8-3.0e-3 for F(4x4),
  5.8-6.2e-3 for F(6x6) and 5.5-6.0e-2 for F(7x7), against 2.6e-4 for a plain TF32 GEMM. Only F(2x2)
  stays within the relaxed bound (1e-3) with one TF32 product; F(4x4) and F(6x6) need 3xTF32
  (model: 8.6e-7 and 1.7e-6 added to the float32 transforms' own error), so those are the ones
  registered: F(4x4) 3xTF32 in class "fp32" (stated 3.5e-6 + 9e-7 = 4.4e-6, under the class's
  5e-6: the tuner's measurement decides per layer), F(6x6) 3xTF32 "relaxed" like its CUDA-core form
  (8e-6 + 1.8e-6).

CUDA only, compute capability 8.0 and above (mma.sync with .tf32).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from convforge.codegen.dialect import Arg, Buf, Dim3, Kernel
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs
from convforge.kernels.gemm import (
    filter_operand,
    implicit_operand,
    nchw_store,
    offset_table_kernel,
    pointwise_operand,
    too_big,
)
from convforge.kernels.sgemm import GemmShape, Operand
from convforge.kernels.tensorcore.sm80.mma_sync import (
    LEAD_TILES,
    TC_KEYS,
    tc_block,
    tc_default,
    tc_grid,
    tc_kernel,
    tc_space,
)
from convforge.kernels.winograd.nonfused import WinogradNonFused, expected_error
from convforge.kernels.winograd.tiles import Geometry
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Prologue, Variant
from convforge.spec import ConvSpec

TF32_EXPECTED = 3e-4
TF32_TOLERANCE = 1e-3
X3_EXPECTED = 1e-6
X3_TOLERANCE = 1e-5


def tensor_core_reason(device: DeviceInfo) -> str | None:
    """Why ``device`` cannot run mma.sync TF32 (None when it can)."""
    if device.backend != "cuda":
        return "tensor-core TF32 needs the CUDA back-end"
    if device.cc is None:
        return "tensor-core TF32 needs a known compute capability (>= 8.0)"
    if tuple(device.cc) < (8, 0):
        return f"tensor-core TF32 needs compute capability >= 8.0, device has {device.cc[0]}.{device.cc[1]}"
    return None


# The tensor cores' FP32 accumulation loses precision steadily with the reduction length: the 3xTF32
# implicit GEMM's error about doubles with each doubling of the reduction, so it stays FP32-grade only
# on short reductions.
X3_MAX_REDUCTION = 512


class _TensorCoreGemm(Variant):
    """Shared parts: M = K, N = N*P*Q, K = C*R*S from the mma_sync generator, NCHW output."""

    backends = frozenset({"cuda"})
    x3 = False
    space_lead = 7  # the default and mma_sync.LEAD_TILES, timed in order before sampling

    def __init__(self) -> None:
        self.precision = "fp32" if self.x3 else "relaxed"
        self.tolerance = X3_TOLERANCE if self.x3 else TF32_TOLERANCE
        self.exact = False

    def expected_error(self, spec: ConvSpec) -> float:
        return X3_EXPECTED if self.x3 else TF32_EXPECTED

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device) or tensor_core_reason(device) or too_big(spec)
        if why is None and self.x3 and spec.c * spec.r * spec.s > X3_MAX_REDUCTION:
            why = (f"3xTF32 loses FP32-grade accuracy past {X3_MAX_REDUCTION}-term reductions (C*R*S = "
                   f"{spec.c * spec.r * spec.s}; its error grows with the reduction: 8e-6 at 1152 terms)")
        return why

    def _mnk(self, spec: ConvSpec) -> tuple[int, int, int]:
        return spec.k, spec.n * spec.p * spec.q, spec.c * spec.r * spec.s

    def _vec(self, spec: ConvSpec) -> tuple[bool, bool]:
        return (spec.c * spec.r * spec.s) % 4 == 0, False

    def _b(self, spec: ConvSpec) -> Operand:
        raise NotImplementedError

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return tc_space(*self._mnk(spec), device, *self._vec(spec), x3=self.x3)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return tc_default(*self._mnk(spec), device, *self._vec(spec), x3=self.x3)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        shape = GemmShape(*self._mnk(spec))
        name = f"{self.name}_gemm"
        extra = self._extra()
        args: tuple[Arg, ...] = (Buf("w"), Buf("x")) + tuple(Buf(e, "int") for e in extra) + out_args(epilogue)
        kern = tc_kernel(name, shape, params, filter_operand(spec), self._b(spec),
                         nchw_store(spec, epilogue), args, x3=self.x3,
                         comment=f"{self.name}: {params.short()}")
        launch = Launch(name, tc_grid(shape, params), tc_block(params),
                        ("w", "x") + extra + out_refs(epilogue))
        pre, steps, ws = self._pre(spec, params)
        return Plan(self.name, self.family, spec, params, pre + (kern,), steps + (launch,), ws,
                    self.tolerance, epilogue)

    def _extra(self) -> tuple[str, ...]:
        """Names of int workspace buffers the GEMM reads (the offset table)."""
        return ()

    def _pre(self, spec: ConvSpec, params: Params) -> tuple[tuple[Kernel, ...], tuple[Launch, ...],
                                                           tuple[tuple[str, int], ...]]:
        """Kernels launched before the GEMM, their launches and the workspace."""
        return (), (), ()


class ImplicitGemmTF32(_TensorCoreGemm):
    """Implicit GEMM on tensor cores: B gathered from x with (c, r, s) computed per k row."""

    name = "implicit_gemm_tf32"
    family = "implicit_gemm"
    specialised = 6

    def _b(self, spec: ConvSpec) -> Operand:
        return implicit_operand(spec, table=False)


class ImplicitGemm3xTF32(ImplicitGemmTF32):
    """Implicit GEMM with 3xTF32 products: FP32-grade accuracy on tensor cores."""

    name = "implicit_gemm_3xtf32"
    x3 = True
    specialised = 4  # below the CUDA-core GEMMs until the tuner has timed it


class ImplicitGemmPrecompTF32(ImplicitGemmTF32):
    """Implicit GEMM on tensor cores reading (c, r, s) offsets from a table built on the device
    (cuDNN's PRECOMP): one table load per k row instead of two constant divisions, the gather's
    index arithmetic being most of the main loop's instructions besides the HMMAs."""

    name = "implicit_gemm_precomp_tf32"
    specialised = 5

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why is None and (spec.eff_r >= 1 << 15 or spec.eff_s >= 1 << 16):
            why = "filter extent too large for the packed offset table"
        return why

    def _b(self, spec: ConvSpec) -> Operand:
        return implicit_operand(spec, table=True)

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 8 * spec.c * spec.r * spec.s

    def _extra(self) -> tuple[str, ...]:
        return ("tab",)

    def _pre(self, spec: ConvSpec, params: Params) -> tuple[tuple[Kernel, ...], tuple[Launch, ...],
                                                           tuple[tuple[str, int], ...]]:
        tk, grid = offset_table_kernel(spec)
        return ((tk,), (Launch(tk.name, grid, tk.block, ("tab",)),),
                (("tab", self.workspace_bytes(spec, params)),))


class Gemm1x1TF32(_TensorCoreGemm):
    """1x1 convolution (any stride/padding) as a tensor-core GEMM over channels."""

    name = "gemm1x1_tf32"
    family = "gemm1x1"
    specialised = 11

    def _vec(self, spec: ConvSpec) -> tuple[bool, bool]:
        plain = spec.stride == (1, 1) and spec.pad == (0, 0, 0, 0)
        return spec.c % 4 == 0, plain and (spec.h * spec.w) % 4 == 0

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.r != 1 or spec.s != 1:
            return "only 1x1 filters"
        return super().applies(spec, device)

    def _b(self, spec: ConvSpec) -> Operand:
        return pointwise_operand(spec)


class Gemm1x13xTF32(Gemm1x1TF32):
    """1x1 with 3xTF32 products (FP32-grade)."""

    name = "gemm1x1_3xtf32"
    x3 = True
    specialised = 9


# Non-GEMM choices of the CUDA-core default that the tensor-core points keep.
_WINO_KEYS = ("so", "xi", "xo", "xt", "lo", "hf", "ks", "tb")
# Relative L2 error the TF32 (x3: 3xTF32) batched GEMM adds, per alpha (float64 model above).
_WINO_TF32_ADDED = {4: 5e-4, 6: 3e-3, 8: 6e-3, 9: 6e-2}
_WINO_X3_ADDED = {4: 1.3e-7, 6: 9e-7, 8: 1.8e-6, 9: 1.8e-5}


class WinogradNonFusedTC(WinogradNonFused):
    """Non-fused Winograd F(m x m) with the batched GEMM on tensor cores (``gemm="tf32"`` or
    ``"3xtf32"``): the transform kernels, splits (ks), hf and stores of the CUDA-core variant,
    the GEMM from :func:`convforge.kernels.tensorcore.sm80.mma_sync.tc_kernel`."""

    backends = frozenset({"cuda"})
    space_lead = 8

    def __init__(self, m: int, x3: bool, precision: str, tolerance: float) -> None:
        super().__init__(m)
        self.x3 = x3
        self.name = f"winograd_nonfused_f{m}_{'3x' if x3 else ''}tf32"
        self.gemm_kinds = ("3xtf32",) if x3 else ("tf32",)
        self.precision, self.tolerance = precision, tolerance
        self.specialised = 5 if x3 else 6

    def expected_error(self, spec: ConvSpec) -> float:
        alpha = self.m + max(spec.r, spec.s) - 1
        added = (_WINO_X3_ADDED if self.x3 else _WINO_TF32_ADDED).get(alpha, 1e-1)
        return expected_error(self.m, spec.r, spec.s) + added

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = tensor_core_reason(device) or super().applies(spec, device)
        if why is None and not self.x3 and max(spec.r, spec.s) > 3:
            why = "TF32 F(2x2) on filters above 3x3 exceeds the relaxed bound (3.6e-3 measured on 5x5 and 6x6)"
        return why

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        return self.specialised  # no measured standing yet: the tuner decides


    def _tiles(self, spec: ConvSpec, device: DeviceInfo, default: bool = False) -> list[Params]:
        """Tensor-core tiles for M = K, N = T, K = C (both operands contiguous along i)."""
        g = Geometry(spec, self.m)
        args = (spec.k, g.tiles, spec.c, device, spec.k % 4 == 0, g.tiles % 4 == 0, "i", "i")
        return [tc_default(*args, batch=g.a2, x3=self.x3)] if default else tc_space(*args, x3=self.x3)

    def _with_tile(self, base: Params, tile: Params) -> Params:
        keep = {k: v for k, v in base.items() if k in _WINO_KEYS}
        return tile.replace(gemm=self.gemm_kinds[0], **keep)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The CUDA-core default's transform choices and splits with the tensor-core tile."""
        return self._with_tile(super().default(spec, device), self._tiles(spec, device, True)[0])

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The default, the lead tiles of :data:`convforge.kernels.tensorcore.sm80.mma_sync.LEAD_TILES` under its
        choices, its channel splits and hf flipped, then every tensor-core tile under the default's
        transform choices at each split."""
        first = self.default(spec, device)
        splits = [k for k in (1, 2, 3, 4) if k == 1 or spec.c // k >= 32]
        flags = [first, first.replace(hf=1 - int(first.get("hf", 0)))]
        tiles = self._tiles(spec, device)
        out = [first] + [self._with_tile(first, t) for t in tiles[1:len(LEAD_TILES) + 1]
                         if (t.bm, t.bn, t.bk, t.wm, t.wn) in LEAD_TILES]
        for base, k in itertools.product(flags, splits):
            out.append(_split(base, k))
        for tile, base, k in itertools.product(tiles, flags[:1], splits):
            out.append(_split(self._with_tile(base, tile), k))
        return list(dict.fromkeys(p if p.get("hf") else Params({k: v for k, v in p.items() if k != "hf"})
                                  for p in out))

    def _gemm_stage(self, g: Geometry, gp: Params, ks: int, hf: bool,
                    lo: bool) -> tuple[Kernel, Dim3, Dim3]:
        gen = functools.partial(tc_kernel, x3=self.x3)
        kern = self._sgemm_kernel(g, gp, ks, hf, lo, gen=gen, label=self.gemm_kinds[0])
        return kern, tc_grid(self._shape(g, ks), gp), tc_block(gp)

    prologue_ok = True  # the family's own input transforms (WinogradNonFused.plan) apply it

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        unknown = set(params) - set(TC_KEYS) - set(_WINO_KEYS) - {"gemm"}
        if unknown:
            raise ValueError(f"{self.name}: unknown parameters {sorted(unknown)}")
        plan = super().plan(spec, params, device, epilogue, prologue)
        return dataclasses.replace(plan, tolerance=self.tolerance)


def _split(p: Params, ks: int) -> Params:
    """``p`` with its GEMM cut into ``ks`` channel slices (no ``ks`` key for one)."""
    return p.replace(ks=ks) if ks > 1 else Params({k: v for k, v in p.items() if k != "ks"})


register(ImplicitGemmTF32())
register(ImplicitGemm3xTF32())
register(ImplicitGemmPrecompTF32())
register(Gemm1x1TF32())
register(Gemm1x13xTF32())
register(WinogradNonFusedTC(2, False, "relaxed", TF32_TOLERANCE))
register(WinogradNonFusedTC(4, True, "fp32", X3_TOLERANCE))
register(WinogradNonFusedTC(6, True, "relaxed", 5e-5))
