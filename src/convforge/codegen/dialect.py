"""The kernel dialect: one neutral C subset that renders to CUDA C and OpenCL C.

A kernel body is plain C using these tokens, which each renderer spells its own way:

    GROUP_ID(d) LOCAL_ID(d) GROUP_SIZE(d) NUM_GROUPS(d)   thread and group indices, d in 0..2
    BARRIER()                                             block-wide barrier on shared memory
    SHARED                                                qualifier of a shared-memory declaration
    LOCAL_PTR / GLOBAL_PTR                                address-space qualifier of a pointer
    U64                                                   64-bit unsigned integer type
    I64                                                   64-bit signed integer type (element offsets
                                                          past 2^31 - 1: ArrayDesc.index casts to it)
    VLOAD4(off, p) / VSTORE4(v, off, p)                   float4 at p + 4*off
    VLOAD2(off, p)                                        float2 at p + 2*off (any address space)
    VLOAD2_F16 / VLOAD2_BF16(off, p)                      float2 of the 2 halves at p + 2*off (one
                                                          4-byte load; the other half tokens: Storage)
    MAKE_FLOAT4(a, b, c, d)                               float4 constructor
    FMA(a, b, c)                                          fused a*b + c
    MAX(a, b)                                             float maximum
    RELU(a)                                               max(a, 0) that keeps NaN (fmax would not)
    GELU(a)                                               a / 2 * (1 + erf(a / sqrt 2)): the exact GELU
    SILU(a)                                               a / (1 + exp(-a)): SiLU (Swish), a * sigmoid(a)
    HSWISH(a)                                             a * min(max(a + 3, 0), 6) / 6: HardSwish (NaN kept)
    MISH(a)                                               a * tanh(log1p(exp(a))): Mish (NaN kept)
    DSILU(a), DHSWISH(a)                                  the derivative of SiLU / HardSwish at a (backward)
    LDG(p)                                                read-only load of *p
    LDCG(p)                                               load of *p from the device-wide level (CUDA L2,
                                                          not this SM's L1): values other blocks wrote
                                                          and fenced before a TICKET this block took
    FENCE_DEVICE()                                        device-wide acquire-release fence (CUDA
                                                          fence.acq_rel.gpu, sm_70+): with a barrier
                                                          before it, the block's global writes ordered
                                                          before a TICKET; after one, others' after it
    TICKET(p)                                             atomic increment of the 32-bit unsigned counter
                                                          at float pointer p (its bits: 0.0f is 0),
                                                          returning the old count: the block that draws
                                                          the last ticket finishes what every block began
    SHFL(v, lane)                                         warp shuffle (feature "shuffle", CUDA only)
    TEX(t, i)                                             element i of a TexBuf (feature "texture")
    COPY4_ASYNC(dst, src)                                 4 floats global -> shared, 16-byte aligned;
                                                          CUDA sm_80+: cp.async (no registers, in
                                                          flight until COPY_WAIT); else a plain copy
    COPY1_ASYNC(dst, doff, src, soff, mask, bit)          dst[doff] = src[soff], or 0 (src not read)
                                                          when bit ``bit`` of the 64-bit ``mask`` is
                                                          clear; doff, soff, bit constants; as
                                                          COPY4_ASYNC
    COPY_WAIT()                                           wait for this thread's COPY4_ASYNCs (then
                                                          BARRIER() before others read them)
    CVT_TF32(x)                                           x rounded to TF32 (cvt.rna: nearest, ties
                                                          away), as a float (feature "mma_tf32")
    MMA_TF32_16x8x8(d0, d1, d2, d3, a0, a1, a2, a3, b0, b1)
                                                          warp-wide D += A.B on tensor cores (PTX
                                                          mma.sync m16n8k8 .tf32, FP32 accumulate;
                                                          d* float lvalues, a*/b* TF32-valued floats
                                                          in the PTX fragment layouts, see
                                                          kernels/tensorcore/sm80/mma_sync.py); feature "mma_tf32",
                                                          CUDA sm_80+ only
    MMA_F16_16x8x16 / MMA_BF16_16x8x16(d0, d1, d2, d3, a0, a1, a2, a3, b0, b1)
                                                          the same, m16n8k16 on FP16 / BF16: a*/b*
                                                          unsigned words of two halves (lower index in
                                                          the low bits); feature "mma_tf32"
    SMEM_U32(p)                                           32-bit shared-window address of pointer p
    CP_ASYNC16(sa, src, n) / CP_ASYNC4(sa, src, n)        cp.async of 16 (.cg) / 4 (.ca) bytes from src
                                                          to shared address sa, reading n bytes (0 or
                                                          all) and zero-filling the rest (CP_ASYNC16
                                                          without n: all 16 bytes)
    CP_ASYNC_COMMIT() / CP_ASYNC_WAIT(n)                  close a cp.async group / wait until at most n
                                                          groups are pending (then BARRIER())
    LDMATRIX_X4(d0, d1, d2, d3, sa)                       ldmatrix.x4 .b16: float lvalues d0..d3 get the
                                                          32-bit words lane l holds (row l / 4, word
                                                          l % 4 of matrices 0..3; lanes 8q..8q+7 give
                                                          matrix q's row addresses)
    LDSM_T4(d0, d1, d2, d3, sa) / LDSM_T2(d0, d1, sa)    ldmatrix.x4 / .x2 .trans .b16: unsigned lvalues get
                                                          lane l's word of each matrix transposed (rows
                                                          2 (l % 4), 2 (l % 4) + 1 of column l / 4:
                                                          16-byte rows of k-contiguous halves give the
                                                          mma.sync A / B fragments of their transpose)
    LDS_F4(sa) / LDS_F1(sa)                               float4 / float read at shared address sa
    TF32_RHA(x)                                           x with 0x1000 added to its bits: rounds to
                                                          nearest, ties away, once the tensor core drops
                                                          the low 13 bits (one integer add)
                                                          (all: feature "mma_tf32", CUDA sm_80+ only;
                                                          the OpenCL renderer refuses them with a reason)
    Hopper, feature "wgmma" (CUDA sm_90a only: the source then asks for the arch-specific target;
    its kernels also use SMEM_U32 / CP_ASYNC16 / CP_ASYNC_COMMIT / CP_ASYNC_WAIT above):
    FENCE_PROXY_ASYNC()                                   fence.proxy.async.shared::cta: this thread's
                                                          completed shared writes become visible to
                                                          the async proxy (wgmma operand reads)
    WGMMA_FENCE() / WGMMA_COMMIT()                        wgmma.fence / wgmma.commit_group
    WGMMA_WAIT(n, d...)                                   wgmma.wait_group n; the accumulators d are
                                                          tied to it (read only after it)
    WGMMA_TF32(N, desc_a, desc_b, d0 .. d{N/2-1})         warpgroup D += A.B, m64nNk8 TF32, FP32
                                                          accumulate, A and B K-major in shared memory
                                                          by 64-bit matrix descriptors
                                                          (kernels/tensorcore/sm90/wgmma_1x1.py)
    The tensor-core generator (kernels/tensorcore/sm90/), feature "wgmma" too:
    WGMMA(type, k, N, desc_a, desc_b, d0 .. d{N/2-1})     m64nNk{k}, type tf32 (k 8), f16 or bf16 (k 16), FP32
                                                          accumulate, both operands K-major in shared memory
    WGMMA_Z(type, k, N, desc_a, desc_b, d0 .. d{N/2-1})   the same with D = A.B (scale-d 0: D starts at zero)
    WGMMA_T / WGMMA_TZ(type, k, N, desc_a, desc_b, d...)  WGMMA / WGMMA_Z with both operands MN-major (f16 and
                                                          bf16: the transpose immediates 1)
    WGMMA_RS(type, k, N, scale_d, a0, a1, a2, a3, desc_b, d0 .. d{N/2-1})
                                                          m64nNk{k} with A from registers (four 32-bit words a
                                                          lane, the mma.sync A layout per warp), B in shared
                                                          memory; scale_d 0 starts D at zero
    WGMMA_HOLD(r...)                                      keep registers live and unchanged up to here (a
                                                          wgmma of an earlier group may still read them)
    MBAR_INIT(bar, count) / MBAR_WAIT(bar, parity)        mbarrier at 32-bit shared address bar: init with an
                                                          arrival count / spin until the phase of that
                                                          parity has completed (a fresh barrier: parity 1
                                                          passes at once)
    MBAR_ARRIVE(bar) / CP_ASYNC_MBAR_ARRIVE(bar)          arrive now / arrive once this thread's earlier
                                                          cp.async copies have landed (.noinc: counts as
                                                          one of the expected arrivals)
    SETMAXNREG_INC(n) / SETMAXNREG_DEC(n)                 a warpgroup's register budget (kernel launched with
                                                          a register cap: Kernel.min_blocks = 1)
    BAR_SYNC(id, threads)                                 named barrier id (1..15) over ``threads`` threads
    MBAR_INIT_FENCE()                                     make this thread's mbarrier inits visible to the
                                                          async proxy (the copy engine completes them)
    MBAR_EXPECT_TX(bar, bytes)                            arrive on bar and add ``bytes`` to the transaction
                                                          count its phase waits for (the TMA copies' bytes)
    TMA_PREFETCH(map)                                     prefetch a TensorMap argument's descriptor
    TMA_TILE_2D(sa, map, c0, c1, bar)                     TMA copy of the box at element (c0, c1) (innermost
                                                          first) of a tiled TensorMap to shared address sa,
                                                          completing its bytes on mbarrier bar; out of
                                                          bounds reads zeros
    TMA_TILE_3D(sa, map, c0, c1, c2, bar)                 the same of a 3-D tiled TensorMap (one image's box)
    TMA_TILE_4D(sa, map, c0, c1, c2, c3, bar)             the same of a 4-D one (an NCHW tensor's planes at a
                                                          tap's offset: negative coordinates read zeros)
    TMA_IM2COL_4D(sa, map, c, w, h, n, ow, oh, bar)       TMA copy of an im2col TensorMap's column: pixels from
                                                          (n, h, w) on through its bounding box, each read at
                                                          (h + oh, w + ow), channels c .. c + box; zeros
                                                          outside the tensor
    TMA_TILE_2D_MC(sa, map, c0, c1, bar, mask) /          the same copies multicast: the box lands at shared
    TMA_IM2COL_4D_MC(sa, map, c, w, h, n, ow, oh, bar, mask)  offset sa in every block of the cluster whose
                                                          bit is set in mask, completing the mbarrier at
                                                          offset bar in each
    TMA_STORE_2D(map, sa, c0, c1)                         TMA store of the box at shared address sa to element
                                                          (c0, c1) of a tiled TensorMap (out of bounds: not
                                                          written); FENCE_PROXY_ASYNC and a barrier first
    TMA_STORE_COMMIT() / TMA_STORE_WAIT_READ(n)           close this thread's group of stores / wait until at
                                                          most n groups still read their shared sources
    COMPILER_FENCE()                                      no instruction: the compiler keeps memory accesses on
                                                          their side of it (loads not hoisted above it)
    Thread-block clusters (Kernel.cluster > 1, CUDA sm_90):
    CLUSTER_RANK() / CLUSTER_ID() / NUM_CLUSTERS()        the block's rank in its cluster, the cluster's
                                                          index, the number of clusters (along x)
    CLUSTER_SYNC()                                        every thread of every block of the cluster
                                                          (release / acquire at cluster scope)
    MBAR_ARRIVE_CLUSTER(bar, rank)                        arrive on the mbarrier at offset bar in block
                                                          ``rank`` of the cluster (no fence: what it
                                                          releases was read, not written, by this block)
    TC_F16_TO_F32(h) / TC_BF16_TO_F32(h)                  a stored half (unsigned short bits) as a float
    TC_F32_TO_F16(x) / TC_F32_TO_BF16(x)                  x rounded to nearest even, as unsigned short bits
    TC_PACK_F16X2(lo, hi) / TC_PACK_BF16X2(lo, hi)        two rounded halves in one 32-bit word (lo first)
    TC_X3H_SCALE(m) / TC_X3H_UNSCALE(m)                   3xFP16's power-of-two scale of a tensor whose maximum
                                                          |element| is m (m scaled lies in [2^14, 2^15); 1 for
                                                          a non-finite m), and its reciprocal

Half storage (float16 / bfloat16 buffers; arithmetic stays float32 on every back-end; OpenCL needs no
cl_khr_fp16: float16 is read and written by vload_half / vstore_half_rte, bfloat16 travels as ushort
bits). Generators spell these through :class:`Storage`, never by hand:
    HALF_T / BF16_T                                       element type of a float16 / bfloat16 buffer
    LD_F16(p, i) / LD_BF16(p, i)                          element i of p, as a float
    LDG_F16(p) / LDG_BF16(p)                              *p as a float, read-only path (CUDA __ldg)
    ST_F16(p, i, v) / ST_BF16(p, i, v)                    p[i] = float v rounded to nearest even (NaN
                                                          stays NaN)
    VLOAD4_F16(off, p) / VLOAD4_BF16(off, p)              float4 of the 4 elements at p + 4*off (an
                                                          8-byte load; 8-byte aligned)
    VSTORE4_F16(v, off, p) / VSTORE4_BF16(v, off, p)      float4 v stored as 4 elements at p + 4*off
    VLOAD8_F16(lo, hi, off, p) / VLOAD8_BF16(...)         float4 lvalues lo, hi = the 8 elements at p + 8*off
                                                          (CUDA: one 16-byte read-only load; 16-byte aligned)
    VSTORE8_F16(lo, hi, off, p) / VSTORE8_BF16(...)       float4 lo, hi stored as the 8 elements at p + 8*off
                                                          (CUDA: one 16-byte store)

Parameters are typed objects that write their own declarations, never pasted strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

Dim3 = tuple[int, int, int]


@dataclass(frozen=True)
class Buf:
    """A global-memory pointer argument."""

    name: str
    ctype: str = "float"
    readonly: bool = True


@dataclass(frozen=True)
class ConstBuf:
    """An array in constant memory (CUDA: a module symbol filled before launch; OpenCL: __constant)."""

    name: str
    count: int
    ctype: str = "float"


@dataclass(frozen=True)
class Scalar:
    """A by-value scalar argument."""

    name: str
    ctype: str = "int"


@dataclass(frozen=True)
class LocalBuf:
    """Shared memory sized at launch (CUDA: extern __shared__; OpenCL: a __local argument).

    Needed for more than 48 KB of shared memory on CUDA. The body sees a ``float*`` named ``name``.
    """

    name: str
    nbytes: int


@dataclass(frozen=True)
class TexBuf:
    """A read-only float buffer read through the texture unit (CUDA texture object over linear
    memory, created by the back-end at launch; feature "texture"). Read it with ``TEX(name, i)``."""

    name: str


@dataclass(frozen=True)
class TensorMap:
    """A TMA tensor map over the buffer its Launch names (CUDA sm_90: a 128-byte ``CUtensorMap``
    passed by value as a ``__grid_constant__`` parameter; the back-end encodes it at launch from
    this description and the buffer's address). ``mode`` "tiled" (``box``: the box's extent per
    dimension) or "im2col" (``box`` = (channels per pixel, pixels per column), ``lower`` / ``upper``
    the pixel bounding box's corners, W first, ``traversal`` the pixel strides, W first). Dimensions
    innermost first, in elements; ``strides`` in bytes for dimensions 1 on. The shared tile is
    written with the ``swizzle``-byte swizzle (128, 64 or 32). Read it with ``TMA_TILE_2D`` / ``TMA_IM2COL_4D``."""

    name: str
    mode: str
    dtype: str  # storage dtype: float32, float16, bfloat16
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    lower: tuple[int, ...] = ()
    upper: tuple[int, ...] = ()
    traversal: tuple[int, ...] = ()
    source: str = ""  # the buffer a plan's Launch names for it (for plans that take refs from the args)
    swizzle: int = 128  # the shared tile's swizzle in bytes (128, 64 or 32; the box's inner extent at most)

    def __post_init__(self) -> None:
        rank = len(self.dims)
        if self.mode not in ("tiled", "im2col") or len(self.strides) != rank - 1 or not 1 <= rank <= 5:
            raise ValueError(f"tensor map {self.name}: mode tiled or im2col, rank 1..5 with rank - 1 strides")
        if any(s % 16 for s in self.strides):
            raise ValueError(f"tensor map {self.name}: strides {self.strides} must be multiples of 16 bytes")
        if self.mode == "im2col" and not (rank >= 3 and len(self.box) == 2 and len(self.lower) == len(self.upper)
                                          == len(self.traversal) == rank - 2):
            raise ValueError(f"tensor map {self.name}: im2col needs rank >= 3, a (channels, pixels) box and "
                             "corners and traversal strides per spatial dimension")
        if self.swizzle not in (128, 64, 32):
            raise ValueError(f"tensor map {self.name}: swizzle {self.swizzle} is not 128, 64 or 32 bytes")
        if self.mode == "tiled" and len(self.box) != rank:
            raise ValueError(f"tensor map {self.name}: a tiled box has one extent per dimension")


Arg = Buf | ConstBuf | Scalar | LocalBuf | TexBuf | TensorMap


@dataclass(frozen=True)
class Kernel:
    """One kernel in the dialect: its name, arguments, body, fixed block size and features."""

    name: str
    args: tuple[Arg, ...]
    body: str
    block: Dim3
    requires: frozenset[str] = field(default_factory=frozenset)
    helpers: str = ""  # device functions in the dialect, emitted before the kernel
    comment: str = ""
    min_blocks: int = 0  # > 0: blocks per SM the compiler must leave room for (CUDA launch bound)
    cluster: int = 1  # > 1: blocks per thread-block cluster along x (CUDA sm_90 __cluster_dims__)

    def __post_init__(self) -> None:
        need = param_bytes(self.args)
        if need > PARAM_BYTES_LIMIT:
            raise ValueError(f"kernel {self.name}: its {len(self.args)} parameters take {need} bytes, over the "
                             f"{PARAM_BYTES_LIMIT} a kernel may take (CUDA 12.1+ on sm_70+)")

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def const_bufs(self) -> list[ConstBuf]:
        return [a for a in self.args if isinstance(a, ConstBuf)]

    def local_buf(self) -> LocalBuf | None:
        bufs = [a for a in self.args if isinstance(a, LocalBuf)]
        if len(bufs) > 1:
            raise ValueError(f"{self.name}: at most one launch-sized shared buffer")
        return bufs[0] if bufs else None


PARAM_BYTES_LIMIT = 32764  # the most bytes of parameters a CUDA kernel takes (compilers refuse more)
TENSOR_MAP_BYTES = 128  # a CUtensorMap, 64-byte aligned


def param_bytes(args: tuple[Arg, ...]) -> int:
    """Bytes a kernel's parameter list takes on CUDA: pointers (buffers, texture objects) 8, tensor
    maps 128 at 64-byte alignment, scalars 4 or 8; constant and launch-sized shared buffers none."""
    total = 0
    for a in args:
        if isinstance(a, TensorMap):
            total = -(-total // 64) * 64 + TENSOR_MAP_BYTES
        elif isinstance(a, Buf | TexBuf):
            total = -(-total // 8) * 8 + 8
        elif isinstance(a, Scalar):
            size = 8 if a.ctype in ("long", "size_t", "double", "unsigned long long", "long long") else 4
            total = -(-total // size) * size + size
    return total


def split_call(text: str, start: int) -> tuple[list[str], int]:
    """Split the argument list opening at text[start] == '(' at top-level commas.

    Returns the arguments and the index just past the closing parenthesis.
    """
    depth, args, cur = 0, [], start + 1
    for m in _PUNCT.finditer(text, start):  # only the three characters that matter, found by the regex engine
        ch, i = m.group(), m.start()
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                args.append(text[cur:i].strip())
                return [a for a in args if a != "" or len(args) > 1], i + 1
        elif depth == 1:
            args.append(text[cur:i].strip())
            cur = i + 1
    raise ValueError(f"unbalanced parentheses after {text[max(0, start - 20):start + 20]!r}")


_PUNCT = re.compile(r"[(),]")


# -- half storage ----------------------------------------------------------------------------------
# A buffer's element type in the dialect (Buf.ctype, ConstBuf.ctype): "float", "int", or these two,
# which each renderer spells its own way (CUDA: unsigned short bits; OpenCL: half / ushort).
HALF_CTYPES = {"float16": "half", "bfloat16": "bfloat16"}
_HALF_TAGS = {"float16": "F16", "bfloat16": "BF16"}
HALF_TOKENS = tuple(f"{op}_{tag}" for tag in ("F16", "BF16")
                    for op in ("LD", "LDG", "ST", "VLOAD2", "VLOAD4", "VSTORE4", "VLOAD8", "VSTORE8"))


@dataclass(frozen=True)
class Storage:
    """How a kernel body reads and writes the elements of one storage dtype: loads give a float,
    stores take a float (rounded to nearest even). float32 spells plain C (``p[i]``, ``VLOAD4``), so
    a float32 source is what it was before half storage existed."""

    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype != "float32" and self.dtype not in HALF_CTYPES:
            raise ValueError(f"storage dtype ({self.dtype!r}) must be float32, float16 or bfloat16")

    @property
    def half(self) -> bool:
        return self.dtype != "float32"

    @property
    def ctype(self) -> str:
        """The dialect element type of a buffer of this dtype (``Buf.ctype``)."""
        return HALF_CTYPES.get(self.dtype, "float")

    @property
    def elem(self) -> str:
        """The element type as a kernel body declares pointers to it."""
        return {"float32": "float", "float16": "HALF_T", "bfloat16": "BF16_T"}[self.dtype]

    @property
    def itemsize(self) -> int:
        return 2 if self.half else 4

    def buf(self, name: str, readonly: bool = True) -> Buf:
        return Buf(name, self.ctype, readonly)

    def load(self, ptr: str, idx: str) -> str:
        """Element ``idx`` of ``ptr`` as a float."""
        return f"LD_{_HALF_TAGS[self.dtype]}({ptr}, {idx})" if self.half else f"{ptr}[{idx}]"

    def deref(self, ptr: str) -> str:
        """``*ptr`` as a float."""
        return f"LD_{_HALF_TAGS[self.dtype]}({ptr}, 0)" if self.half else f"*({ptr})"

    def ldg(self, ptr: str) -> str:
        """``*ptr`` as a float through the read-only path."""
        return f"LDG_{_HALF_TAGS[self.dtype]}({ptr})" if self.half else f"LDG({ptr})"

    def store(self, ptr: str, idx: str, value: str) -> str:
        """The statement (without ';') storing float ``value`` as element ``idx`` of ``ptr``."""
        return f"ST_{_HALF_TAGS[self.dtype]}({ptr}, {idx}, {value})" if self.half else f"{ptr}[{idx}] = {value}"

    def vload2(self, off: str, ptr: str) -> str:
        """A float2 of the 2 elements at ``ptr + 2*off`` (4 bytes of half storage in one load)."""
        return f"VLOAD2_{_HALF_TAGS[self.dtype]}({off}, {ptr})" if self.half else f"VLOAD2({off}, {ptr})"

    def vload4(self, off: str, ptr: str) -> str:
        """A float4 of the 4 elements at ``ptr + 4*off``."""
        return f"VLOAD4_{_HALF_TAGS[self.dtype]}({off}, {ptr})" if self.half else f"VLOAD4({off}, {ptr})"

    def vstore4(self, value: str, off: str, ptr: str) -> str:
        """Store float4 ``value`` as the 4 elements at ``ptr + 4*off``."""
        tok = f"VSTORE4_{_HALF_TAGS[self.dtype]}" if self.half else "VSTORE4"
        return f"{tok}({value}, {off}, {ptr})"

    def vload8(self, lo: str, hi: str, off: str, ptr: str) -> str:
        """The expression setting float4 lvalues ``lo``, ``hi`` to the 8 elements at ``ptr + 8*off``:
        16 bytes of half storage in one load (CUDA), two float4 loads of float32."""
        if self.half:
            return f"VLOAD8_{_HALF_TAGS[self.dtype]}({lo}, {hi}, {off}, {ptr})"
        return f"({lo} = VLOAD4(2 * ({off}), {ptr}), {hi} = VLOAD4(2 * ({off}) + 1, {ptr}))"

    def vstore8(self, lo: str, hi: str, off: str, ptr: str) -> str:
        """The expression storing float4 ``lo``, ``hi`` as the 8 elements at ``ptr + 8*off``."""
        if self.half:
            return f"VSTORE8_{_HALF_TAGS[self.dtype]}({lo}, {hi}, {off}, {ptr})"
        return f"(VSTORE4({lo}, 2 * ({off}), {ptr}), VSTORE4({hi}, 2 * ({off}) + 1, {ptr}))"


FLOAT32 = Storage()
