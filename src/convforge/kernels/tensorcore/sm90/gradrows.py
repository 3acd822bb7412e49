"""The masked gradient of a conv -> ReLU block written once, in the layouts its two backward GEMMs read.

In training, the backward of a conv [+ bias] -> ReLU block (convforge.torch's conv -> ReLU node) masks dy
by the saved output's sign, and then each pass transposes the masked gradient into its GEMM's operand:
dgrad (``DgradTransposed`` over ``tc_implicit_gemm_*``) by ``tc_x_nhwc`` into xh = [N][P Q][Kp] (strided
``TcDgrad`` by ``<variant>_dy`` into the same layout), wgrad (``TcWgrad``) by ``<variant>_dy`` into dy' =
[K][P Q][Np] (prep.planes_to_rows). Each of those steps reads
and writes the activation once more. :func:`masked_rows` is one kernel that reads dy and z once and writes
both operands (TF32-rounded, or 3xTF32 hi and lo, as the preps store them) and the bias gradient's
partial sums; :func:`prepared` finds a plan's own step and gives the plan without it. Five passes over
the activation become two (VGG-16 N16: ~0.87 GB a pass).

Block (x, y, z): 32 pixels x 8 channels x NB images through shared memory. Reads run along pixels (128
bytes a warp), xh's writes along channels (8 floats: one 32-byte sector), dy''s along images (NB floats,
the whole warp's 32 contiguous where Np = NB = 16). Shared strides 1 (pixel), 36 (channel: 4 mod 32) and
288 + 32 / NB (image: 32 / NB mod 32) keep all three phases free of bank conflicts. Bias: each block sums
its channels (a fixed tree) into part[k J + j]; then one block per channel adds its J partials in a
fixed order, so the bias gradient is deterministic. math None stores plain floats (PoCL tests the
layouts with it; the GPU path always names TF32 or 3xTF32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from convforge.codegen.dialect import Buf, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels.tensorcore.sm90 import prep
from convforge.kernels.tensorcore.sm90.isa import MATHS, Math
from convforge.plan import Launch, Plan

_PP, _KK, _THREADS = 32, 8, 256  # pixels and channels of a block's tile; threads (32 x 8)
_KS = 36  # shared stride of a channel row
_RED = 256  # threads of the per-channel reduction


@dataclass(frozen=True)
class Rows:
    """One destination: workspace buffer ``name`` (its parts ``name_lo`` ... as ``math`` stores them;
    None: plain floats) and ``width``, its rows' length (padded channels for xh, padded images for dy')."""

    name: str
    math: Math | None
    width: int

    def buffers(self) -> tuple[Buf, ...]:
        return (Buf(self.name, readonly=False),) if self.math is None else prep.part_buffers(self.name, self.math)

    def store(self, index: str, value: str) -> list[str]:
        if self.math is None:
            return [f"{self.name}[{index}] = {value};"]
        return prep.rounded_parts(self.math, self.name, index, value)


@dataclass(frozen=True)
class Prepared:
    """A backward plan without the step that wrote ``rows`` from "y", and that destination."""

    plan: Plan
    rows: Rows


def prepared(plan: Plan, kernel: str, rows: int) -> Prepared | None:
    """``plan`` without its launch of ``kernel`` on "y" (the gradient's prep step), its destination as
    :class:`Rows` (math from its part names, width from its workspace size over ``rows`` rows of 4-byte
    elements), or None where the plan has no such step, another step still reads "y", or the
    destination is not a float32 TC operand."""
    at = [i for i, s in enumerate(plan.steps) if isinstance(s, Launch) and s.kernel == kernel and s.args[:1] == ("y",)]
    if len(at) != 1:
        return None
    step = plan.steps[at[0]]
    assert isinstance(step, Launch)
    dst = tuple(str(a) for a in step.args[1:])
    maths = [m for m in MATHS.values()
             if m.esize == 4 and dst and tuple(b.name for b in prep.part_buffers(dst[0], m)) == dst]
    size = dict(plan.workspace).get(dst[0] if dst else "", 0)
    if len(maths) != 1 or size % (4 * rows):
        return None
    steps = plan.steps[:at[0]] + plan.steps[at[0] + 1:]
    if any(isinstance(s, Launch) and "y" in s.args for s in steps):
        return None
    used = {s.kernel for s in steps if isinstance(s, Launch)}
    kernels = tuple(k for k in plan.kernels if k.name in used)
    return Prepared(dataclasses.replace(plan, steps=steps, kernels=kernels), Rows(dst[0], maths[0], size // (4 * rows)))


def images_per_block(count: int) -> int:
    """NB: the least power of two at least ``count``, at most 16."""
    nb = 1
    while nb < min(count, 16):
        nb *= 2
    return nb


def masked_rows(n: int, k: int, pq: int, xh: Rows | None, dyt: Rows | None
                ) -> tuple[tuple[Kernel, ...], tuple[Launch, ...], int]:
    """(kernels, launches, bytes of "bpart") that read "y" (dy, N K P Q) and "z" (the block's output
    after its ReLU), and write dy masked by z > 0 as xh = [N][P Q][xh.width] (zero channels past K)
    and / or dy' = [K][P Q][dyt.width] (zero images past N), and its sum per channel to "bias"."""
    if xh is None and dyt is None:
        raise ValueError("masked_rows: no destination (xh or dyt) given")
    if xh is not None and xh.width < k or dyt is not None and dyt.width < n:
        raise ValueError(f"masked_rows: rows narrower than the gradient (xh {xh}, dyt {dyt}; N {n}, K {k})")
    for r in (xh, dyt):
        if r is not None and r.math is not None and r.math.esize != 4:
            raise ValueError(f"masked_rows: {r.math.name} rows: float32 operands only")
    kt, nt = xh.width if xh else k, dyt.width if dyt else n
    nb = images_per_block(nt)
    grid = (cdiv(pq, _PP), cdiv(kt, _KK), cdiv(nt, nb))
    parts = grid[0] * grid[2]
    kern = _rows_kernel(n, k, pq, xh, dyt, nb, grid[0], parts)
    red = _reduce_kernel(k, parts)
    outs = tuple(b.name for r in (xh, dyt) if r is not None for b in r.buffers())
    return ((kern, red), (Launch(kern.name, grid, (_PP, _KK, 1), ("y", "z", *outs, "bpart")),
                          Launch(red.name, (k, 1, 1), (_RED, 1, 1), ("bpart", "bias"))), 4 * k * parts)


def _rows_kernel(n: int, k: int, pq: int, xh: Rows | None, dyt: Rows | None, nb: int, gx: int,
                 parts: int) -> Kernel:
    """Block (pixels, channels, images): load and mask the tile, sum it per channel, store the rows."""
    ns = _KK * _KS + _PP // nb  # shared stride of an image
    big = max(n * k * pq, n * pq * (xh.width if xh else 0), k * pq * (dyt.width if dyt else 0)) > 2**31 - 1
    ix = "I64" if big else "int"
    code = Code()
    code(f"SHARED float tile[{nb * ns}];", f"SHARED float red[{_THREADS}];",
         f"const int tx = LOCAL_ID(0), ty = LOCAL_ID(1), t = ty * {_PP} + tx;",
         f"const int p0 = GROUP_ID(0) * {_PP}, k0 = GROUP_ID(1) * {_KK}, n0 = GROUP_ID(2) * {nb};")
    with code.block(f"for (int i = 0; i < {nb}; ++i)"):
        code("const int nn = n0 + i, kk = k0 + ty, p = p0 + tx;", "float g = 0.0f;")
        with code.block(f"if (nn < {n} && kk < {k} && p < {pq})"):
            code(f"const {ix} at = ({ix})(nn * {k} + kk) * {pq} + p;", "g = z[at] > 0.0f ? y[at] : 0.0f;")
        code(f"tile[i * {ns} + ty * {_KS} + tx] = g;")
    code("BARRIER();")
    _block_sums(code, k, nb, ns, gx, parts)
    if xh is not None:  # e = t + 256 i: channel t % 8, pixel t / 8, image i
        with code.block(f"for (int i = 0; i < {nb}; ++i)"):
            code(f"const int c = t % {_KK}, pp = t / {_KK}, nn = n0 + i, kk = k0 + c, p = p0 + pp;")
            with code.block(f"if (nn < {n} && p < {pq} && kk < {xh.width})"):
                code(*xh.store(f"(({ix})nn * {pq} + p) * {xh.width} + kk", f"tile[i * {ns} + c * {_KS} + pp]"))
    if dyt is not None:  # e = t + 256 i: image e % NB, pixel e / NB % 32, channel e / (32 NB)
        with code.block(f"for (int i = 0; i < {nb}; ++i)"):
            code(f"const int e = t + {_THREADS} * i, b = e % {nb}, pp = e / {nb} % {_PP}, c = e / {_PP * nb};",
                 "const int nn = n0 + b, kk = k0 + c, p = p0 + pp;")
            with code.block(f"if (kk < {k} && p < {pq} && nn < {dyt.width})"):
                code(*dyt.store(f"(({ix})kk * {pq} + p) * {dyt.width} + nn", f"tile[b * {ns} + c * {_KS} + pp]"))
    args = (Buf("y"), Buf("z"), *(b for r in (xh, dyt) if r is not None for b in r.buffers()),
            Buf("bpart", readonly=False))
    maths = {r.math.name for r in (xh, dyt) if r is not None and r.math is not None}
    where = " and ".join(f"{name} [{rows}][{pq}][{r.width}]" for name, rows, r in
                         (("xh", n, xh), ("dy'", k, dyt)) if r is not None)
    return Kernel("grad_rows", args, code.text(), (_PP, _KK, 1), frozenset({"mma_tf32"}) if maths else frozenset(),
                  comment=f"dy masked by z > 0 into {where} ({', '.join(sorted(maths)) or 'float'}), "
                          f"with per-block channel sums; {nb} images a block")


def _block_sums(code: Code, k: int, nb: int, ns: int, gx: int, parts: int) -> None:
    """Thread (pixel tx, channel ty) sums its images, a fixed tree adds the 32 pixels, and lane 0
    stores part[k * parts + j], j = x + gx * z."""
    code("float s = 0.0f;", f"for (int i = 0; i < {nb}; ++i) s += tile[i * {ns} + ty * {_KS} + tx];",
         "red[t] = s;", "BARRIER();")
    half = _PP // 2
    while half:
        code(f"if (tx < {half}) red[t] += red[t + {half}];", "BARRIER();")
        half //= 2
    code(f"if (tx == 0 && k0 + ty < {k}) bpart[(k0 + ty) * {parts} + GROUP_ID(0) + {gx} * GROUP_ID(2)] = red[t];")


def _reduce_kernel(k: int, parts: int) -> Kernel:
    """Block k adds channel k's ``parts`` partial sums: a strided loop per thread, then a fixed tree."""
    code = Code()
    code(f"SHARED float red[{_RED}];", "const int t = LOCAL_ID(0), k = GROUP_ID(0);", "float s = 0.0f;",
         f"for (int j = t; j < {parts}; j += {_RED}) s += bpart[k * {parts} + j];", "red[t] = s;", "BARRIER();")
    half = _RED // 2
    while half:
        code(f"if (t < {half}) red[t] += red[t + {half}];", "BARRIER();")
        half //= 2
    code("if (t == 0) bias[k] = red[0];")
    return Kernel("grad_rows_bias", (Buf("bpart"), Buf("bias", readonly=False)), code.text(), (_RED, 1, 1),
                  comment=f"the bias gradient: {parts} partial sums per channel ({k} channels), in a fixed order")
