"""A TF32 tensor-core GEMM generator (CUDA sm_80+), the sibling of :mod:`convforge.kernels.sgemm`.

C (M x N) = A (M x K) . B (K x N), optionally batched (GROUP_ID(2)) and split along K, with the
same pluggable :class:`~convforge.kernels.sgemm.Operand` / :class:`~convforge.kernels.sgemm.Store`
callbacks, so implicit GEMM, the 1x1 path and the Winograd batched GEMM drive it unchanged.

A block of ``wm x wn`` warps computes a ``bm x bn`` tile; each warp a ``bm/wm x bn/wn`` warp tile
of ``fm x fn`` PTX ``mma.sync.m16n8k8`` TF32 fragments with FP32 accumulators in registers.
Operand slices ``bk`` deep go global -> registers (prefetched one slice ahead, the loads of
:class:`~convforge.kernels.sgemm._Loader`) -> double-buffered shared memory, rounded to TF32
(``cvt.rna``, as cuDNN rounds) on the way in; one barrier per slice.

Shared memory: an operand read along k in global memory (``fast == "k"``, the filters) is stored
i-major (``S[i][k]``, row ``bk + 4``): its 16-byte global chunks become one 16-byte store, and a
fragment read ``S[g + ..][t + ..]`` hits bank ``4 g + t``, 32 distinct banks. An operand read along
i (``fast == "i"``: im2col columns, Winograd U and V) is stored k-major (``S[k][i]``, row
``bi + 8``): a fragment read ``S[t + ..][g + ..]`` hits bank ``8 t + g``, again 32 distinct banks.
Fragment reads are single words here. (``ldmatrix`` does serve TF32 for a k-contiguous tile: an
8 x 8 b16 matrix row is 4 consecutive 32-bit words and lane l receives row l / 4, word l % 4, i.e.
the A fragment (g, t) and, rows being n, the B fragment (k = t, n = g); the staged generator
:mod:`convforge.kernels.tensorcore.sm80.mma_pipe` uses it, with cp.async stages.)

``x3`` (3xTF32): the shared tiles keep FP32; each fragment value is split a = hi + lo with
hi = tf32(a), lo = tf32(a - hi), and acc += a_lo b_hi + a_hi b_lo + a_hi b_hi (small terms
first): about FP32 accuracy at three tensor-core products per product.

The fragment index arithmetic is written once, as C expressions of ``g = lane >> 2`` and
``t = lane & 3`` (:data:`A_FRAG`, :data:`B_FRAG`, :data:`C_FRAG`, :func:`frag_addr`); the tests
evaluate these very strings in Python for all 32 lanes against the PTX ISA's documented layouts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from convforge.codegen.dialect import Arg, Dim3, Kernel, LocalBuf
from convforge.codegen.meta import Code, cdiv
from convforge.kernels.sgemm import GemmShape, Operand, Store, _Loader, loads_divide
from convforge.params import Params
from convforge.plan import DeviceInfo

# PTX ISA, mma.m16n8k8 with .tf32 (row.col): (row, col) of each register of a lane, as C
# expressions of g = lane >> 2 (groupID) and t = lane & 3 (threadID_in_group).
A_FRAG = (("g", "t"), ("g + 8", "t"), ("g", "t + 4"), ("g + 8", "t + 4"))  # A: 16 x 8 (m, k)
B_FRAG = (("t", "g"), ("t + 4", "g"))  # B: 8 x 8 (k, n)
C_FRAG = (("g", "2 * t"), ("g", "2 * t + 1"), ("g + 8", "2 * t"), ("g + 8", "2 * t + 1"))  # C: 16 x 8
STATIC_SHARED = 48 * 1024
MAX_SHARED = 227 * 1024  # opt-in limit of sm_90 (sm_80: 163 KB): above 48 KB the tiles are launch-sized
DYN_SHARED = 100 * 1024  # the spaces stop here: two blocks per SM
MAX_ACC = 128  # accumulators per thread: more leaves ptxas no room for fragments and addresses
TC_KEYS = ("bm", "bn", "bk", "wm", "wn", "va", "vb")


@dataclass(frozen=True)
class TcLayout:
    """Derived sizes of one parameter set: warps, warp tile, fragments per warp."""

    bm: int
    bn: int
    bk: int
    wm: int
    wn: int

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def wtm(self) -> int:
        return self.bm // self.wm

    @property
    def wtn(self) -> int:
        return self.bn // self.wn

    @property
    def fm(self) -> int:
        return self.wtm // 16

    @property
    def fn(self) -> int:
        return self.wtn // 8


def smem_ld(fast: str, bi: int, bk: int) -> int:
    """Row length in floats of an operand's shared tile (see the module docstring)."""
    return bk + 4 if fast == "k" else bi + 8


def smem_rows(fast: str, bi: int, bk: int) -> int:
    """Rows of an operand's shared tile: bi (i-major) for fast k, else bk (k-major)."""
    return bi if fast == "k" else bk


def smem_addr(fast: str, ld: int, i: str, k: str) -> str:
    """Offset of element (i, k) in an operand's shared tile: i-major for fast k, else k-major."""
    return f"({i}) * {ld} + ({k})" if fast == "k" else f"({k}) * {ld} + ({i})"


def frag_addr(operand: str, fast: str, ld: int, f: int, r: int, kk: int) -> str:
    """Shared offset of register ``r`` of fragment ``f`` (along the warp tile) of operand 'a' or
    'b' at k step ``kk``, in terms of g, t and the warp tile origin wm0 / wn0."""
    if operand == "a":
        row, col = A_FRAG[r]
        return smem_addr(fast, ld, f"wm0 + {16 * f} + {row}", f"{kk} + {col}")
    krow, ncol = B_FRAG[r]
    return smem_addr(fast, ld, f"wn0 + {8 * f} + {ncol}", f"{kk} + {krow}")


def c_coords(fi: int, fj: int, r: int) -> tuple[str, str]:
    """(row m, column n) in C of accumulator register r of fragment (fi, fj)."""
    row, col = C_FRAG[r]
    return f"m0 + wm0 + {16 * fi} + {row}", f"n0 + wn0 + {8 * fj} + {col}"


def shared_bytes(p: Params, a_fast: str, b_fast: str) -> int:
    """Static shared memory of the generated kernel (two buffers of each operand)."""
    return 4 * 2 * sum(smem_rows(f, bi, p.bk) * smem_ld(f, bi, p.bk)
                       for f, bi in ((a_fast, p.bm), (b_fast, p.bn)))


def registers(p: Params, x3: bool = False) -> int:
    """Register model: accumulators, prefetched loads, one k step's fragments (hi and lo with
    ``x3``) and ~24 for addresses (ptxas, sm_90: 128 x 128 x 16 on 64 x 64 warp tiles 240 (model
    216), 3xTF32 246 (248); 128 x 128 x 32 3xTF32 spills (model 280))."""
    lay = TcLayout(p.bm, p.bn, p.bk, p.wm, p.wn)
    loads = (p.bm + p.bn) * p.bk // lay.threads
    return 4 * lay.fm * lay.fn + loads + (4 * lay.fm + 2 * lay.fn) * (2 if x3 else 1) + 24


def tc_ok(p: Params, va_ok: bool = True, vb_ok: bool = True, a_fast: str = "k",
          b_fast: str = "i", max_threads: int = 1024, shared_limit: int = STATIC_SHARED,
          x3: bool = False) -> bool:
    """Whether a parameter set is valid for the generator (warps tile the block in whole
    fragments, loads spread evenly over the threads, shared memory within ``shared_limit``,
    :func:`registers` within 255)."""
    lay = TcLayout(p.bm, p.bn, p.bk, p.wm, p.wn)
    if p.bm % (16 * p.wm) or p.bn % (8 * p.wn) or p.bk not in (16, 32):
        return False
    if not 64 <= lay.threads <= min(max_threads, 512) or lay.fm * lay.fn * 4 > MAX_ACC:
        return False
    if registers(p, x3) > 255:
        return False
    if p.va not in (1, 4) or p.vb not in (1, 4) or (p.va == 4 and not va_ok) or (p.vb == 4 and not vb_ok):
        return False
    return loads_divide(p, lay.threads, a_fast, b_fast) and shared_bytes(p, a_fast, b_fast) <= shared_limit


def shared_limit(device: DeviceInfo) -> int:
    """Shared memory the spaces may use on ``device``: launch-sized beyond 48 KB where the device
    opts in to more (up to :data:`DYN_SHARED`)."""
    return max(STATIC_SHARED, min(device.shared_optin_bytes, DYN_SHARED))


# (bm, bn, bk, wm, wn): wide warp tiles first (64 x 64: one shared word read per mma, 32 fragment
# words for 32 mma per k step), then 64 x 32 and 32 x 32. The space adds 128 x 256 / 256 x 128 and
# bk = 32 at 128 x 128 (launch-sized shared memory): fewer global loads per mma, fewer blocks.
_TILES = ((128, 128, 16, 2, 2), (128, 128, 16, 2, 4), (128, 64, 16, 2, 2), (64, 128, 16, 2, 2),
          (128, 64, 16, 4, 2), (64, 128, 16, 2, 4), (64, 64, 32, 2, 2), (64, 64, 16, 2, 2),
          (64, 64, 32, 1, 2), (64, 32, 32, 2, 1), (32, 64, 32, 1, 2), (32, 32, 32, 1, 2),
          (32, 32, 16, 1, 2))


# Tiles the spaces put right after the default (the tuner's ordered lead): the fewest main-loop
# instructions per HMMA in the SASS (sm_90, ResNet 128@28: implicit GEMM 256 x 128 6.1, 128 x 256
# 6.8, 128 x 128 8.0; Winograd F(2x2) GEMM 128 x 256 4.1, 128 x 128 4.7), then bk = 32.
LEAD_TILES = ((256, 128, 16, 4, 2), (128, 256, 16, 2, 4), (128, 128, 32, 2, 2), (128, 128, 16, 2, 2),
              (128, 64, 16, 2, 2), (64, 128, 16, 2, 2))


def tc_space(m: int, n: int, k: int, device: DeviceInfo, va_ok: bool = True, vb_ok: bool = True,
             a_fast: str = "k", b_fast: str = "i", x3: bool = False) -> list[Params]:
    """Every sensible parameter set for an M x N x K GEMM: the default, the :data:`LEAD_TILES`
    that fit, then the rest."""
    out = [tc_default(m, n, k, device, va_ok, vb_ok, a_fast, b_fast, x3=x3)]
    rest = itertools.product((32, 64, 128, 256), (32, 64, 128, 256), (16, 32), (1, 2, 4), (1, 2, 4))
    for bm, bn, bk, wm, wn in itertools.chain(LEAD_TILES, rest):
        if bm > 2 * max(m, 16) or bn > 2 * max(n, 16):
            continue
        # Scalar loads only where float4 ones are impossible: they cost registers (an address per
        # load; 128 x 128 with scalar A spills) and buy nothing.
        for va, vb in itertools.product((4,) if va_ok else (1,), (4,) if vb_ok else (1,)):
            p = Params(bm=bm, bn=bn, bk=bk, wm=wm, wn=wn, va=va, vb=vb)
            if p not in out and tc_ok(p, va_ok, vb_ok, a_fast, b_fast, device.max_threads,
                                      shared_limit(device), x3):
                out.append(p)
    return out


def tc_default(m: int, n: int, k: int, device: DeviceInfo, va_ok: bool = True, vb_ok: bool = True,
               a_fast: str = "k", b_fast: str = "i", batch: int = 1, x3: bool = False) -> Params:
    """A good untuned tile: the first of :data:`_TILES` (widest loads the operands allow) that
    wastes at most 1/8 of its rows and columns on padding and gives every compute unit a block
    (``batch`` GEMMs side by side); failing that, the valid low-waste tile with the most blocks
    (ResNet 512@7² N32: 64 x 64, 200 blocks, rather than 128 x 128's 52 on 132 SMs)."""
    valid: list[Params] = []
    for (bm, bn, bk, wm, wn), va, vb in itertools.product(_TILES, (4, 1), (4, 1)):
        p = Params(bm=bm, bn=bn, bk=bk, wm=wm, wn=wn, va=va if va_ok else 1, vb=vb if vb_ok else 1)
        if p not in valid and tc_ok(p, va_ok, vb_ok, a_fast, b_fast, device.max_threads,
                                    STATIC_SHARED, x3):
            valid.append(p)
    if not valid:
        raise ValueError(f"no tensor-core GEMM tile fits M={m} N={n} K={k}")
    return pick_tile(valid, m, n, batch, device.units)


def pick_tile(valid: list[Params], m: int, n: int, batch: int, units: int) -> Params:
    """The first of ``valid`` (tiles bm x bn, in preference order) wasting at most 1/8 of its rows
    and columns that gives every compute unit a block; else the low-waste tile with the most blocks."""
    def waste(size: int, tile: int) -> float:
        return (cdiv(size, tile) * tile - size) / (cdiv(size, tile) * tile)

    lean = [p for p in valid if waste(m, p.bm) <= 0.125 and waste(n, p.bn) <= 0.125] or \
        [min(valid, key=lambda p: waste(m, p.bm) + waste(n, p.bn))]
    blocks = {p: cdiv(m, p.bm) * cdiv(n, p.bn) * batch for p in lean}
    return next((p for p in lean if blocks[p] >= max(units, 1)), max(lean, key=lambda p: blocks[p]))


def tc_grid(shape: GemmShape, p: Params) -> Dim3:
    """Grid of blocks: x over N tiles, y over M tiles, z over batch x K splits."""
    return (cdiv(shape.n, p.bn), cdiv(shape.m, p.bm), shape.batch * shape.ksplit)


def tc_block(p: Params) -> Dim3:
    return (TcLayout(p.bm, p.bn, p.bk, p.wm, p.wn).threads, 1, 1)


class _TcLoader(_Loader):
    """The sgemm loader's global -> register traffic, stored in this generator's shared layouts
    (TF32-rounded unless the kernel splits operands itself, ``x3``)."""

    def __init__(self, nm: str, op: Operand, size: int, bi: int, bk: int, v: int, threads: int,
                 origin: str, smem: str, rounded: bool) -> None:
        super().__init__(nm, op, size, bi, bk, v, threads, origin, smem, smem_ld(op.fast, bi, bk))
        self.rounded = rounded
        self.tile = smem_rows(op.fast, bi, bk) * self.ld  # floats of one buffer

    def _cv(self, x: str) -> str:
        return f"CVT_TF32({x})" if self.rounded else x

    def stash(self, code: Code, buf: str) -> None:
        base = f"({self.smem} + {buf} * {self.tile})" if buf != "0" else self.smem
        for s, (i, k) in enumerate(self.pos):
            dst, at = f"{self.nm}r{s}", smem_addr(self.op.fast, self.ld, i, k)
            if self.v == 1:
                code(f"{base}[{at}] = {self._cv(dst)};")
            else:  # 4 consecutive along the fast dimension: contiguous in either layout
                vals = ", ".join(self._cv(f"{dst}.{c}") for c in "xyzw")
                code(f"VSTORE4(MAKE_FLOAT4({vals}), 0, {base} + {at});")


def tc_kernel(name: str, shape: GemmShape, p: Params, a: Operand, b: Operand, c: Store,
              args: tuple[Arg, ...], prelude: tuple[str, ...] = (), comment: str = "",
              x3: bool = False, n_last_first: bool = False) -> Kernel:
    """Generate the kernel ``name``: C = A.B on tensor cores (TF32, or 3xTF32 with ``x3``).

    The body defines, as :func:`convforge.kernels.sgemm.gemm_kernel` does, ``tid``, ``bz``,
    ``kz``, ``m0``/``n0`` and ``kbeg``/``kend`` before ``prelude``. Launch with :func:`tc_grid`
    and :func:`tc_block`. ``n_last_first``: blocks in the order (N tile descending, then M tile,
    then batch and split), as in the sgemm generator (the Winograd GEMM's L2 order)."""
    if not tc_ok(p, a.vload is not None, b.vload is not None, a.fast, b.fast, 1024, MAX_SHARED, x3):
        raise ValueError(f"tensor-core GEMM parameters {p.short()} are invalid (warps must tile "
                         "the block in 16 x 8 fragments: bm a multiple of 16 wm, bn of 8 wn; bk 16 or 32; "
                         "va and vb 1 or 4, loads spread evenly, "
                         f"at most {MAX_ACC} accumulators, 255 registers by the model, {MAX_SHARED} B "
                         "shared memory)")
    lay = TcLayout(p.bm, p.bn, p.bk, p.wm, p.wn)
    code = Code()
    code("const int tid = LOCAL_ID(0), lane = tid & 31, warp = tid >> 5;",
         "const int g = lane >> 2, t = lane & 3;  // PTX groupID, threadID_in_group",
         f"const int wm0 = (warp / {p.wn}) * {lay.wtm}, wn0 = (warp % {p.wn}) * {lay.wtn};")
    ids = ("GROUP_ID(0)", "GROUP_ID(1)", "GROUP_ID(2)")
    if n_last_first:
        gx, gy, gz = tc_grid(shape, p)
        code(f"const int lin = GROUP_ID(0) + {gx} * (GROUP_ID(1) + {gy} * GROUP_ID(2));",
             f"const int gz_ = lin % {gz}, gy_ = lin / {gz} % {gy}, gx_ = {gx - 1} - lin / {gy * gz};")
        ids = ("gx_", "gy_", "gz_")
    code(f"const int bz = {ids[2]} / {shape.ksplit}, kz = {ids[2]} % {shape.ksplit};",
         f"const int m0 = {ids[1]} * {p.bm}, n0 = {ids[0]} * {p.bn};",
         f"const int kbeg = kz * {shape.klen}, kend = min(kbeg + {shape.klen}, {shape.k});")
    code(*prelude)
    ga = _TcLoader("a", a, shape.m, p.bm, p.bk, p.va, lay.threads, "m0", "As", not x3)
    gb = _TcLoader("b", b, shape.n, p.bn, p.bk, p.vb, lay.threads, "n0", "Bs", not x3)
    nbytes = shared_bytes(p, a.fast, b.fast)
    if nbytes > STATIC_SHARED:  # launch-sized: As then Bs in one buffer
        args = args + (LocalBuf("tc_smem", nbytes),)
        code(f"LOCAL_PTR float* As = tc_smem;  // 2 x {ga.tile // ga.ld} x {ga.ld}",
             f"LOCAL_PTR float* Bs = tc_smem + {2 * ga.tile};  // 2 x {gb.tile // gb.ld} x {gb.ld}")
    for ld_ in (ga, gb) if nbytes <= STATIC_SHARED else ():
        code(f"SHARED float4 {ld_.smem}4[{2 * ld_.tile // 4}];  // 2 x {ld_.tile // ld_.ld} x {ld_.ld}",
             f"LOCAL_PTR float* {ld_.smem} = (LOCAL_PTR float*){ld_.smem}4;")
    ga.setup(code)
    gb.setup(code)
    for i, j, r in itertools.product(range(lay.fm), range(lay.fn), range(4)):
        code(f"float d{i}_{j}_{r} = 0.0f;")
    code(f"const int nk = (kend - kbeg + {p.bk - 1}) / {p.bk};")
    ga.load(code, "kbeg")
    gb.load(code, "kbeg")
    ga.stash(code, "0")
    gb.stash(code, "0")
    code("BARRIER();")
    with code.block("for (int kt = 0; kt < nk; ++kt)"):
        # Unconditional prefetch (the last slice re-reads itself), as in the sgemm generator.
        code("const int cur = kt & 1;", f"const int knext = kbeg + min(kt + 1, nk - 1) * {p.bk};")
        ga.load(code, "knext")
        gb.load(code, "knext")
        code(f"const LOCAL_PTR float* Ab = As + cur * {ga.tile};",
             f"const LOCAL_PTR float* Bb = Bs + cur * {gb.tile};")
        for kk in range(0, p.bk, 8):
            _mma_step(code, lay, ga, gb, kk, x3)
        ga.stash(code, "(cur ^ 1)")
        gb.stash(code, "(cur ^ 1)")
        code("BARRIER();")
    _store(code, shape, lay, c)
    kind = "3xTF32" if x3 else "TF32"
    # A minimum-blocks launch bound (2 up to 128 threads, 1 above: a cap of 255 registers either
    # way): without it ptxas cut the Winograd TF32 GEMM (128 x 128 x 16) to 170 registers for a third
    # block per SM by sinking the register prefetch below every HMMA of the slice (SASS check in
    # tests/test_tensorcore.py); with it 226 registers and the loads issue first.
    return Kernel(name, args, code.text(), tc_block(p), requires=frozenset({"mma_tf32"}),
                  min_blocks=2 if lay.threads <= 128 else 1,
                  comment=comment or f"{kind} tensor-core GEMM {shape.m}x{shape.n}x{shape.k} batch "
                  f"{shape.batch} split {shape.ksplit}: {p.short()}")


def _mma_step(code: Code, lay: TcLayout, ga: _TcLoader, gb: _TcLoader, kk: int, x3: bool) -> None:
    """One k step of 8: every fragment of A and B from shared memory, then fm x fn mma."""
    with code.block(f"/* k step {kk} */"):
        for nm, ld_, count, regs in (("a", ga, lay.fm, 4), ("b", gb, lay.fn, 2)):
            base = "Ab" if nm == "a" else "Bb"
            for f, r in itertools.product(range(count), range(regs)):
                at = frag_addr(nm, ld_.op.fast, ld_.ld, f, r, kk)
                v = f"{nm}{f}_{r}"
                if x3:
                    code(f"const float {v}x = {base}[{at}];",
                         f"const float {v} = CVT_TF32({v}x), {v}l = CVT_TF32({v}x - {v});")
                else:
                    code(f"const float {v} = {base}[{at}];")
        for i, j in itertools.product(range(lay.fm), range(lay.fn)):
            d = ", ".join(f"d{i}_{j}_{r}" for r in range(4))
            av = [f"a{i}_{r}" for r in range(4)]
            bv = [f"b{j}_{r}" for r in range(2)]
            terms = [(av, bv)]
            if x3:  # small terms first
                terms = [([x + "l" for x in av], bv), (av, [x + "l" for x in bv]), (av, bv)]
            for aa, bb in terms:
                code(f"MMA_TF32_16x8x8({d}, {', '.join(aa)}, {', '.join(bb)});")


def _store(code: Code, shape: GemmShape, lay: TcLayout, c: Store) -> None:
    """Guarded stores of the accumulator fragments through the Store callbacks."""
    cols: dict[str, str] = {}
    for j, r in itertools.product(range(lay.fn), (0, 1)):
        n = c_coords(0, j, r)[1]
        tag = f"cs{j}_{r}"
        cols[n] = tag
        code(f"const int {tag}_i = {n};")
        code(*c.setup(f"{tag}_i", tag))
    for i, h in itertools.product(range(lay.fm), (0, 1)):
        m = c_coords(i, 0, 2 * h)[0]
        code(f"const int cm{i}_{h} = {m};")
        with code.block(f"if (cm{i}_{h} < {shape.m})"):
            for j, e in itertools.product(range(lay.fn), (0, 1)):
                r = 2 * h + e
                tag = cols[c_coords(i, j, r)[1]]
                with code.block(f"if ({tag}_i < {shape.n})"):
                    code(*c.put(f"cm{i}_{h}", tag, f"d{i}_{j}_{r}"))
