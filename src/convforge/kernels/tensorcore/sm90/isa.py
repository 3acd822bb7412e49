"""wgmma (PTX ISA 8.x, sm_90a) as data: math modes, instruction shapes and the accumulator layout.

Facts encoded here, once (tests/test_tensorcore_gen.py checks each against the PTX ISA's tables):

* ``wgmma.mma_async.sync.aligned.m64nNkK.f32.T.T``: a warpgroup (4 consecutive warps, the first a
  multiple of 4) computes D (64 x N, f32) += A (64 x K) . B (N x K)^T; N a multiple of 8 in 8..256.
  K is 8 for .tf32 and 16 for .f16 / .bf16: 32 bytes of K either way, a quarter of a 128-byte
  swizzle row, so one k step is the same descriptor advance for every math mode.
* .tf32 takes both operands K-major only (no transpose immediates); .f16 / .bf16 take K-major with
  the transpose immediates 0. We keep every operand K-major.
* The f32 accumulator fragment: warp w of the warpgroup holds rows 16 w .. 16 w + 15; lane l =
  4 g + t holds, per n8 chunk j, registers 4 j + r at (row, column) (g, 2 t), (g, 2 t + 1),
  (g + 8, 2 t), (g + 8, 2 t + 1) of that chunk: N / 2 registers per thread per m64 block.
* TF32 operands are FP32 bit patterns whose low 13 mantissa bits the tensor core ignores; rounding
  them first (cvt.rna: nearest, ties away, as cuDNN does) halves the error of truncation.
* 3xTF32 (FP32-grade on tensor cores): a = hi + lo with hi = tf32(a), lo = tf32(a - hi); a.b ~
  lo.hi + hi.lo + hi.hi (the dropped lo.lo and lo's rounding are ~2^-22 relative).
* 3xFP16 (FP32-grade at twice 3xTF32's rate): the same split into FP16 parts of a tensor scaled by a
  power of two, 2^e with max |a| 2^e in [2^14, 2^15) (the prep's maximum step), so that hi keeps 11
  bits of every element the tensor's range leaves in FP16's normal range and lo the next 11; the
  epilogue multiplies the sums by 2^-(ea + eb). Its representation error equals 3xTF32's (NumPy model:
  7.5e-8 both, 4.6k- to 20k-term sums); an element 2^24 below the tensor's maximum keeps fewer bits
  of lo, an absolute error of 2^-39 of the maximum.
* Scaled FP16 (the relaxed class at FP16's rate): hi alone of the same scaled tensor, rounded to nearest.
  FP16 and TF32 both keep 11 significant bits, so each operand's rounding error equals TF32's (cvt.rna)
  wherever the element lies within 2^29 of the tensor's maximum (FP16's normal range after the scale);
  smaller elements keep fewer bits, an absolute error under 2^-40 of the maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

from convforge.plan import DeviceInfo
from convforge.spec import ConvSpec

M = 64  # rows of one wgmma
KSTEP_BYTES = 32  # bytes of K one wgmma consumes, every math mode
ROW_BYTES = 128  # bytes of K per row of a 128-byte-swizzled shared tile ("atom" width)
CHUNK = 16  # bytes of one cp.async / one swizzle unit
N_CHOICES = tuple(range(8, 257, 8))


@dataclass(frozen=True)
class Math:
    """How one dtype's operands enter wgmma: the PTX operand type, the bytes of an operand element,
    K of one instruction, the parts each operand is stored in and the products of a k step."""

    name: str
    ptx: str
    esize: int
    k: int
    parts: tuple[str, ...]
    products: tuple[tuple[str, str], ...]
    ctype: str  # C type of an operand element in global and shared memory
    scale: bool = False  # float32 tensors scaled by a power of two into FP16 (3xFP16, scaled FP16)

    @property
    def split(self) -> bool:
        """Operands stored as hi and lo parts (3xTF32, 3xFP16): FP32-grade, sums promoted to FP32."""
        return len(self.parts) > 1

    @property
    def scaled(self) -> bool:
        """Float32 operands scaled by a power of two per tensor before they are rounded to FP16 (3xFP16,
        scaled FP16): each prep step reads the tensor's maximum and writes the inverse scale the GEMM's
        epilogue applies."""
        return self.scale

    def __post_init__(self) -> None:
        if self.ptx not in ("tf32", "f16", "bf16"):
            raise ValueError(f"wgmma operand type {self.ptx!r} is not modelled")
        if self.k * self.esize != KSTEP_BYTES:
            raise ValueError(f"{self.name}: k {self.k} x {self.esize} bytes must span {KSTEP_BYTES} bytes")
        if (self.ptx == "tf32") != (self.esize == 4 and self.ctype == "float"):
            raise ValueError(f"{self.name}: tf32 operands are 4-byte floats, f16/bf16 2-byte")
        if not self.products or any(a not in self.parts or b not in self.parts for a, b in self.products):
            raise ValueError(f"{self.name}: products {self.products} must multiply stored parts {self.parts}")

    @property
    def chunk_elems(self) -> int:
        """Operand elements in a 16-byte chunk."""
        return CHUNK // self.esize

    def elems(self, atoms: int) -> int:
        """Elements of K in ``atoms`` 128-byte rows."""
        return atoms * ROW_BYTES // self.esize

    @property
    def steps_per_atom(self) -> int:
        return ROW_BYTES // KSTEP_BYTES


TF32 = Math("tf32", "tf32", 4, 8, ("hi",), (("hi", "hi"),), "float")
X3TF32 = Math("3xtf32", "tf32", 4, 8, ("hi", "lo"), (("lo", "hi"), ("hi", "lo"), ("hi", "hi")), "float")
F16 = Math("f16", "f16", 2, 16, ("hi",), (("hi", "hi"),), "unsigned short")
BF16 = Math("bf16", "bf16", 2, 16, ("hi",), (("hi", "hi"),), "unsigned short")
X3F16 = Math("3xf16", "f16", 2, 16, ("hi", "lo"), (("lo", "hi"), ("hi", "lo"), ("hi", "hi")), "unsigned short",
             scale=True)
SF16 = Math("sf16", "f16", 2, 16, ("hi",), (("hi", "hi"),), "unsigned short", scale=True)
MATHS = {m.name: m for m in (TF32, X3TF32, F16, BF16, X3F16, SF16)}
HALF_MATH = {"float16": F16, "bfloat16": BF16}


def math_for(dtype: str, x3: bool = False, half: bool = False) -> Math:
    """The math mode of a storage dtype: float32 -> TF32 (3xTF32 when ``x3``, 3xFP16 when ``x3`` and
    ``half``, scaled FP16 when ``half`` alone), halves -> their own."""
    if dtype == "float32":
        return (X3F16 if half else X3TF32) if x3 else (SF16 if half else TF32)
    if x3:
        raise ValueError(f"3xTF32 is a float32 math mode, not one of {dtype}")
    try:
        return HALF_MATH[dtype]
    except KeyError:
        raise ValueError(f"dtype ({dtype!r}) has no tensor-core math mode") from None


@dataclass(frozen=True)
class AccLayout:
    """The f32 accumulator fragment of one warp for one n8 chunk: register r is at row g + rows[r],
    column 2 t + cols[r] (lane = 4 g + t); warp w adds 16 w rows, chunk j 8 j columns."""

    rows: tuple[int, ...] = (0, 0, 8, 8)
    cols: tuple[int, ...] = (0, 1, 0, 1)

    def __post_init__(self) -> None:
        cells = [(g + self.rows[r], 2 * t + self.cols[r]) for g in range(8) for t in range(4)
                 for r in range(len(self.rows))]
        if sorted(cells) != [(i, j) for i in range(16) for j in range(8)]:
            raise ValueError("accumulator layout must cover a 16 x 8 chunk exactly once")

    @property
    def per_chunk(self) -> int:
        return len(self.rows)

    def coords(self, warp: int, lane: int, i: int) -> tuple[int, int]:
        """(row, column) in a 64 x N block of accumulator register ``i`` of ``warp``, ``lane``."""
        r = i % self.per_chunk
        return 16 * warp + (lane >> 2) + self.rows[r], 8 * (i // self.per_chunk) + 2 * (lane & 3) + self.cols[r]

    def row_expr(self, i: int, warp: str = "wq", g: str = "g") -> str:
        return f"(16 * {warp} + {g} + {self.rows[i % self.per_chunk]})"

    def col_expr(self, i: int, t: str = "t") -> str:
        return f"({8 * (i // self.per_chunk)} + 2 * {t} + {self.cols[i % self.per_chunk]})"


ACC = AccLayout()


def n_ok(n: int) -> bool:
    """A valid N of m64nNk* with f32 accumulators."""
    return n in N_CHOICES


def device_reason(device: DeviceInfo) -> str | None:
    """Why ``device`` cannot run sm_90a (wgmma, setmaxnreg) kernels; None when it can."""
    if device.backend != "cuda":
        return "wgmma needs the CUDA back-end"
    if device.cc != (9, 0):
        have = f"{device.cc[0]}.{device.cc[1]}" if device.cc else "unknown"
        return f"wgmma is compiled for sm_90a, which runs only on compute capability 9.0 (device: {have})"
    return None


FEW_PIXELS = 8  # output pixels (N P Q) at or below which a float32 GEMM is a weight stream, not a tile


def few_pixels(spec: ConvSpec) -> bool:
    """A float32 layer of at most :data:`FEW_PIXELS` output pixels: a fully-connected layer at a small
    batch, whose GEMM streams the weights once for a handful of columns. The wgmma tiles (64-256
    pixels wide) are then almost empty, and the CUDA-core split-K GEMMs (gemm_fc, gemm1x1_splitk)
    stream the weights faster (measured on different GPUs, not side by side: docs/NOTES-tensorcore.md)."""
    return spec.dtype == "float32" and spec.n * spec.p * spec.q <= FEW_PIXELS
