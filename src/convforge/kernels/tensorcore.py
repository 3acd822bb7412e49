"""Tensor-core (TF32) variants of the GEMM family: implicit GEMM and the 1x1 path on
:mod:`convforge.kernels.tcgemm`, in two accuracy grades.

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

CUDA only, compute capability 8.0 and above (mma.sync with .tf32).
"""

from __future__ import annotations

from convforge.codegen.dialect import Arg, Buf
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs
from convforge.kernels.gemm import (
    filter_operand,
    implicit_operand,
    nchw_store,
    pointwise_operand,
    too_big,
)
from convforge.kernels.sgemm import GemmShape, Operand
from convforge.kernels.tcgemm import tc_block, tc_default, tc_grid, tc_kernel, tc_space
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
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


class _TensorCoreGemm(Variant):
    """Shared parts: M = K, N = N*P*Q, K = C*R*S from the tcgemm generator, NCHW output."""

    backends = frozenset({"cuda"})
    x3 = False

    def __init__(self) -> None:
        self.precision = "fp32" if self.x3 else "relaxed"
        self.tolerance = X3_TOLERANCE if self.x3 else TF32_TOLERANCE
        self.exact = False

    def expected_error(self, spec: ConvSpec) -> float:
        return X3_EXPECTED if self.x3 else TF32_EXPECTED

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        return super().applies(spec, device) or tensor_core_reason(device) or too_big(spec)

    def _mnk(self, spec: ConvSpec) -> tuple[int, int, int]:
        return spec.k, spec.n * spec.p * spec.q, spec.c * spec.r * spec.s

    def _vec(self, spec: ConvSpec) -> tuple[bool, bool]:
        return (spec.c * spec.r * spec.s) % 4 == 0, False

    def _b(self, spec: ConvSpec) -> Operand:
        raise NotImplementedError

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return tc_space(*self._mnk(spec), device, *self._vec(spec))

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return tc_default(*self._mnk(spec), device, *self._vec(spec))

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        shape = GemmShape(*self._mnk(spec))
        name = f"{self.name}_gemm"
        args: tuple[Arg, ...] = (Buf("w"), Buf("x")) + out_args(epilogue)
        kern = tc_kernel(name, shape, params, filter_operand(spec), self._b(spec),
                         nchw_store(spec, epilogue), args, x3=self.x3,
                         comment=f"{self.name}: {params.short()}")
        launch = Launch(name, tc_grid(shape, params), tc_block(params), ("w", "x") + out_refs(epilogue))
        return Plan(self.name, self.family, spec, params, (kern,), (launch,), (), self.tolerance, epilogue)


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


register(ImplicitGemmTF32())
register(ImplicitGemm3xTF32())
register(Gemm1x1TF32())
register(Gemm1x13xTF32())
