"""Pieces shared by the wgrad (update) variants: how a reduction over N*P*Q is split, the fixed-order
sum of the splits, the atomicAdd option, and the accuracy a split implies.

A wgrad reduction runs over N*P*Q terms (100k on ResNet layers). Summed one after another in
float32, the relative L2 error of a sum of L products of zero-mean terms is about 0.35-0.5 u sqrt(L)
(u = 2^-24; measured in NumPy: 0.31, 0.34, 0.27, 0.46 for L = 1e2 .. 1e5), so 100k terms in one
running sum cost ~9e-6, past the fp32 class's 5e-6. Splitting the reduction into ``ks`` slices
(each block sums L/ks terms, then a reduce kernel adds the ks partial results in a fixed order)
fills the GPU and divides that error by sqrt(ks): :func:`pick_split` asks for both.
"""

from __future__ import annotations

import math

from convforge.codegen.dialect import Buf, Dim3, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.config import check_deterministic, nondeterministic_allowed
from convforge.kernels.gemm import elementwise
from convforge.params import Params
from convforge.plan import DeviceInfo

UNIT_ROUNDOFF = 2.0 ** -24
INT_LIMIT = 2**31 - 1
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # ks values the spaces offer
MIN_SLICE = 64  # terms per split at least (a shorter slice is all overhead)
ACCURATE_SLICE = 8192  # the defaults keep a running sum at most this long where they can (~2e-6)
WORKSPACE_CAP = 256 << 20  # bytes of partial results a default split may use
_BLOCK = 256  # threads per block of the element-wise kernels

# atomicAdd of a float in both dialects: CUDA's native one; OpenCL 1.2 has no float atomics, so a
# compare-and-swap loop on the bits. The order of the additions, and so the rounding, varies run to run.
ATOMIC_HELPER = """#ifdef __OPENCL_VERSION__
inline void cf_atomic_add(volatile __global float* p, float v)
{
    union { unsigned int u; float f; } old, upd;
    do {
        old.f = *p;
        upd.f = old.f + v;
    } while (atomic_cmpxchg((volatile __global unsigned int*)p, old.u, upd.u) != old.u);
}
#else
#define cf_atomic_add(p, v) atomicAdd((p), (v))
#endif"""


def sum_error(terms: int) -> float:
    """Typical relative L2 error of a float32 running sum of ``terms`` zero-mean products."""
    return 0.5 * UNIT_ROUNDOFF * math.sqrt(max(terms, 1))


def sum_tolerance(terms: int) -> float:
    """The correctness bound of a plan whose longest running sum has ``terms`` products: 1e-5, or
    8x the typical error of such a sum where that is larger (a bug gives errors of order 1)."""
    return max(1e-5, 16 * sum_error(terms))


def slice_len(red: int, ks: int) -> int:
    """Terms per split as the SGEMM generator cuts them (a multiple of 4)."""
    return cdiv(cdiv(red, ks), 4) * 4


def splits(red: int, most: int = SPLITS[-1]) -> list[int]:
    """The split counts worth offering for a reduction of ``red`` terms."""
    return [ks for ks in SPLITS if ks == 1 or (ks <= most and cdiv(red, ks) >= MIN_SLICE)]


def pick_split(tiles: int, threads: int, red: int, device: DeviceInfo, part_bytes: int = 0,
               accurate: int = ACCURATE_SLICE, waves: float = 2.0) -> int:
    """ks for ``tiles`` output blocks of ``threads`` threads over a reduction of ``red`` terms: on
    GPUs the fewest splits that give ``waves`` waves of blocks (a wave: as many blocks per compute
    unit as fit at ~128 registers per thread) and keep each running sum within ``accurate`` terms,
    no split shorter than MIN_SLICE terms and no more than WORKSPACE_CAP of partial results
    (``part_bytes`` per split); on CPUs only the accuracy bound. Long GEMM reductions run fastest
    at 1-2 waves, the Winograd update's short tile reductions at about half a wave (more slices add
    M traffic and per-block overhead; split sweeps in docs/NOTES-wgrad.md)."""
    offered = splits(red)
    if part_bytes:
        offered = [ks for ks in offered if ks == 1 or ks * part_bytes <= WORKSPACE_CAP] or [1]
    want_acc = cdiv(red, accurate)
    if not device.is_gpu:
        return next((ks for ks in offered if ks >= want_acc), offered[-1])
    per_unit = max(1, min(65536 // (threads * 128), 2048 // threads))
    want_occ = math.ceil(waves * max(device.units, 1) * per_unit / max(tiles, 1))
    return next((ks for ks in offered if ks >= max(want_acc, want_occ)), offered[-1])


def atomic_points(points: list[Params]) -> list[Params]:
    """The atomicAdd twins (``at=1``) of the split points, offered only when the user allows
    nondeterministic results (config.deterministic off)."""
    if not nondeterministic_allowed():
        return []
    return [p.replace(at=1) for p in points if p.get("ks", 1) > 1]


def atomic_mode(params: Params, name: str) -> bool:
    """Whether ``params`` ask for atomicAdd split-K; ValueError unless the user allowed it."""
    at = int(params.get("at", 0))
    if at not in (0, 1):
        raise ValueError(f"{name}: at ({at}) must be 0 (fixed-order reduce) or 1 (atomicAdd)")
    if at:
        check_deterministic(f"{name} with at=1 (atomicAdd split-K)")
    return bool(at)


def reduce_kernel(name: str, total: int, ks: int, out: str, part: str = "part") -> tuple[Kernel, Dim3, Dim3]:
    """``out[e] = part[e] + part[total + e] + ...``: the ks partial results of each element summed
    in a fixed order, the same on every run; (kernel, grid, block). ``out`` may be ``part`` itself
    (the sum lands in slice 0). Up to 8 slices a thread sums them alone; beyond that, 32 elements x
    ``g`` groups of threads per block: group j sums its run of slices in order, then the group-0
    thread adds the g runs in order from shared memory (long sums of few elements, such as 128
    slices of a 64 x 576 dW, keep the GPU busy)."""
    g = next((g for g in (8, 4, 2) if ks >= 4 * g), 1)
    args = (Buf(part, readonly=out != part),) + ((Buf(out, readonly=False),) if out != part else ())
    code = Code()
    if g == 1:
        code(f"const int e = GROUP_ID(0) * {_BLOCK} + LOCAL_ID(0);")
        with code.block(f"if (e < {total})"):
            code(f"float s = {part}[e];", f"for (int j = 1; j < {ks}; ++j) s += {part}[j * {total} + e];",
                 f"{out}[e] = s;")
        return (Kernel(name, args, code.text(), (_BLOCK, 1, 1), comment=f"sum of {ks} split results, in split order"),
                (cdiv(total, _BLOCK), 1, 1), (_BLOCK, 1, 1))
    run = cdiv(ks, g)
    code(f"SHARED float runs[{g}][32];",
         "const int i = LOCAL_ID(0), j = LOCAL_ID(1);",
         "const int e = GROUP_ID(0) * 32 + i;",
         f"const int z0 = j * {run}, z1 = min(z0 + {run}, {ks});",
         "float s = 0.0f;")
    with code.block(f"if (e < {total})"):
        code(f"for (int z = z0; z < z1; ++z) s += {part}[z * {total} + e];")
    code("runs[j][i] = s;", "BARRIER();")
    with code.block(f"if (j == 0 && e < {total})"):
        code("float t = runs[0][i];", f"for (int r = 1; r < {g}; ++r) t += runs[r][i];", f"{out}[e] = t;")
    return (Kernel(name, args, code.text(), (32, g, 1),
                   comment=f"sum of {ks} split results: {g} runs of {run} in order, then the runs in order"),
            (cdiv(total, 32), 1, 1), (32, g, 1))


def zero_kernel(name: str, total: int, out: str) -> tuple[Kernel, tuple[int, int, int]]:
    """``out`` = 0 before atomicAdd accumulation (a launch, so plans stay on the raw-launch path)."""
    return elementwise(name, total, (Buf(out, readonly=False),), [f"{out}[e] = 0.0f;"],
                       "zero the output before atomicAdd split-K")
