"""The staged TF32 tensor-core GEMM (CUDA sm_80+): cp.async pipeline, ldmatrix fragments.

C (M x N) = A (M x K) . B (K x N), batched (GROUP_ID(2)) and split along K like
:mod:`convforge.kernels.tensorcore.sm80.mma_sync`, whose main loop spent ~12 instructions per HMMA (address
arithmetic of register-staged loads, TF32 rounding on every store to shared memory, one shared
load per fragment word). This one aims at cuDNN's ~3:

* **cp.async** moves every operand chunk global -> shared without registers, ``st`` stages deep
  (``commit_group`` per slice, ``wait_group st - 2`` and one barrier per slice); 16-byte ``.cg``
  copies where the operand's chunks are contiguous and aligned, 4-byte ``.ca`` otherwise; a chunk
  outside the matrix (k past the end, padding) copies 0 bytes and is zero-filled: no branch.
* **ldmatrix.x4** for an operand contiguous along k (filters, NHWC activations), stored i-major
  (``S[i][k]``, row ``bk + 4`` floats: 8 rows of one 8 x 8 b16 matrix fall in 8 distinct 16-byte
  bank groups). An 8 x 8 b16 matrix row is 4 consecutive 32-bit words and lane l receives row
  l / 4, word l % 4: with rows = i and words = k that is the TF32 A fragment (g, t) and the B
  fragment (k = t, n = g). One instruction per A fragment, one per two B fragments.
* An operand contiguous along i (1x1 activations, Winograd U and V) is stored k-major (``S[k][i]``,
  row ``bi + 8``) and read as float4: lane (g, t) holds, at k rows t and t + 4, the values
  i = w0 + 4 g + (j & 3) + 32 (j >> 2), j < V (V = 2 fm for A, fn for B; :func:`lane_i`). The
  MMA does not care which logical row or column a fragment row holds, so the warp tile's rows are
  permuted this way and the accumulator stores undo it (:func:`c_row`, :func:`c_col`); the quarter
  warps of each LDS.128 hit 8 distinct bank groups (row stride = 8 mod 32 words).
* **Rounding out of the loop**: an operand a plan step wrote TF32-rounded (``rounded``) enters the
  MMA as loaded; a raw one is rounded at fragment load by an integer add of 0x1000 to its bits
  (``TF32_RHA``): the tensor core ignores the low 13 bits, so add-then-truncate rounds to nearest,
  ties away from zero, exactly as ``cvt.rna`` (one IADD instead of cvt's several instructions).

The lane arithmetic lives in small functions returning C expressions of ``lane``, ``g``, ``t``,
``wm0``/``wn0``; tests/test_tcpipe.py evaluates those strings for all 32 lanes against the PTX ISA's
mma and ldmatrix layouts and checks the shared-memory bank groups.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from convforge.codegen.dialect import Arg, Dim3, Kernel, LocalBuf
from convforge.codegen.meta import Code
from convforge.kernels.sgemm import GemmShape, SetupFn, Store, _default_setup
from convforge.kernels.tensorcore.sm80.mma_sync import TcLayout, pick_tile, tc_grid
from convforge.params import Params
from convforge.plan import DeviceInfo

# (tag, k expression) -> (statements, pointer expression, extra validity expression or "")
SrcFn = Callable[[str, str], tuple[list[str], str, str]]
PIPE_KEYS = ("bm", "bn", "bk", "wm", "wn", "st")
PIPE_SHARED = 113 * 1024  # two blocks per SM on sm_90 (227 KB)
MAX_ACC = 128


@dataclass(frozen=True)
class AsyncOperand:
    """How the staged GEMM copies one operand, A as (i = m, k) or B as (k, i = n).

    ``setup(i, tag)`` runs once per distinct row/column ``{tag}_i`` a thread copies (clamped into
    the matrix). ``src(tag, k)`` gives statements, a pointer to element (i, k) and an extra
    validity test ("" for none; padding); k < kend is the generator's. ``fast``: the dimension
    contiguous in memory. ``vec`` 4: 16-byte chunks along ``fast``, each 16-byte aligned and wholly
    inside or outside the operand (validity is tested on the chunk's first element); 1: floats.
    ``rounded``: the values are TF32 already (a plan step wrote them so)."""

    src: SrcFn
    fast: str = "k"
    setup: SetupFn = _default_setup
    vec: int = 4
    rounded: bool = False

    @property
    def kind(self) -> tuple[str, int, bool]:
        return self.fast, self.vec, self.rounded

    @property
    def mode(self) -> str:
        return read_mode(self.fast, self.rounded)

    def __post_init__(self) -> None:
        if self.fast not in ("k", "i") or self.vec not in (1, 4):
            raise ValueError(f"AsyncOperand: fast ({self.fast!r}) must be 'k' or 'i', vec ({self.vec}) 1 or 4")


@dataclass(frozen=True)
class PipeLayout(TcLayout):
    """Derived sizes of one parameter set: the mma.sync GEMM's warps and warp tiles, plus stages."""

    st: int


def layout_of(p: Params) -> PipeLayout:
    return PipeLayout(p.bm, p.bn, p.bk, p.wm, p.wn, p.st)


def smem_ld(fast: str, bi: int, bk: int) -> int:
    """Row length in floats: i-major ``bk + 4`` (fast k), k-major ``bi + 8`` (fast i)."""
    return bk + 4 if fast == "k" else bi + 8


def tile_floats(fast: str, bi: int, bk: int) -> int:
    return (bi if fast == "k" else bk) * smem_ld(fast, bi, bk)


def smem_off(fast: str, ld: int, i: str, k: str) -> str:
    """Float offset of element (i, k) in an operand's shared tile."""
    return f"({i}) * {ld} + ({k})" if fast == "k" else f"({k}) * {ld} + ({i})"


def shared_bytes(p: Params, a_fast: str, b_fast: str) -> int:
    """Dynamic shared memory of the kernel: ``st`` stages of both tiles."""
    return 4 * p.st * (tile_floats(a_fast, p.bm, p.bk) + tile_floats(b_fast, p.bn, p.bk))


# -- lane arithmetic (C expressions; evaluated by the tests) ---------------------------------
def lane_i(j: int) -> str:
    """Offset along i, inside a warp tile, of value ``j`` a lane reads from a k-major tile."""
    return f"4 * g + {(j & 3) + 32 * (j >> 2)}"


def ldsm_a_row() -> tuple[str, str]:
    """(i, k) offsets of the row address lane ``lane`` gives ldmatrix.x4 for one A fragment:
    matrix q = lane / 8 is (rows + 8 (q & 1), k + 4 (q >> 1)) -> registers a0..a3."""
    return "(lane & 7) + 8 * ((lane >> 3) & 1)", "4 * (lane >> 4)"


def ldsm_b_row() -> tuple[str, str]:
    """As :func:`ldsm_a_row` for two B fragments f, f + 1: matrix q = (n + 8 (q >> 1), k + 4 (q & 1))
    -> b0, b1 of fragment f, then of fragment f + 1."""
    return "(lane & 7) + 8 * (lane >> 4)", "4 * ((lane >> 3) & 1)"


def read_mode(fast: str, rounded: bool) -> str:
    """How fragments are read from shared memory: "ldsm" (ldmatrix, k-contiguous tiles); for a
    k-major tile "lds4" (float4 reads in the permuted order of :func:`lane_i`, where the rounding
    add writes each fragment register anyway) or, for an operand already rounded, "lds1" (one
    32-bit read straight into each fragment register, rows/columns in plain order: float4 reads
    would cost a register move per fragment word, since an HMMA takes its A quad and B pair in
    consecutive registers and those words come from k rows t and t + 4)."""
    return "ldsm" if fast == "k" else "lds1" if rounded else "lds4"


def lds1_off(op: str, ld: int, f: int, r: int, kk: int) -> str:
    """Float offset (k-major tile, warp origin 0) of register ``r`` of fragment ``f`` ("lds1")."""
    if op == "a":
        return f"({kk + 4 * (r >> 1)} + t) * {ld} + {16 * f + 8 * (r & 1)} + g"
    return f"({kk + 4 * r} + t) * {ld} + {8 * f} + g"


def lds1_const(op: str, ld: int, f: int, r: int, kk: int) -> int:
    """:func:`lds1_off` less its lane part t * ld + g (the per-lane base address)."""
    if op == "a":
        return (kk + 4 * (r >> 1)) * ld + 16 * f + 8 * (r & 1)
    return (kk + 4 * r) * ld + 8 * f


def c_row(mode: str, fi: int, h: int) -> str:
    """Warp-tile row of the accumulators of A fragment ``fi``, half ``h`` (row g, or g + 8)."""
    return lane_i(2 * fi + h) if mode == "lds4" else f"{16 * fi + 8 * h} + g"


def c_col(mode: str, fj: int, e: int) -> str:
    """Warp-tile column of accumulator column 2 t + e of B fragment ``fj``."""
    if mode != "lds4":
        return f"{8 * fj + e} + 2 * t"
    return lane_i(fj).replace("4 * g", f"4 * (2 * t + {e})")


# -- validity, spaces ---------------------------------------------------------------------------
def chunks_divide(bi: int, bk: int, v: int, fast: str, threads: int) -> bool:
    along = bk if fast == "k" else bi
    chunks = bi * bk // v
    return along % v == 0 and chunks % threads == 0 and chunks >= threads


Kind = tuple[str, int, bool]  # an operand's (fast, vec, rounded)


def pipe_ok(p: Params, a: Kind, b: Kind, limit: int = PIPE_SHARED) -> bool:
    """Whether ``p`` is valid for operands of kinds ``a`` and ``b``."""
    if any(k not in p for k in PIPE_KEYS) or p.bk not in (16, 32) or not 2 <= p.st <= 5:
        return False
    if p.bm % (16 * p.wm) or p.bn % (8 * p.wn):
        return False
    lay = layout_of(p)
    if not 128 <= lay.threads <= 256 or lay.fm * lay.fn * 4 > MAX_ACC:  # 4+ warps: see PIPE_TILES
        return False
    perm = [read_mode(f, r) == "lds4" for f, _, r in (a, b)]
    if (perm[0] and 2 * lay.fm not in (4, 8)) or (perm[1] and lay.fn not in (4, 8)):
        return False
    if b[0] == "k" and lay.fn % 2:
        return False
    if not all(chunks_divide(bi, p.bk, v, f, lay.threads) for (f, v, _), bi in ((a, p.bm), (b, p.bn))):
        return False
    return shared_bytes(p, a[0], b[0]) <= limit


# (bm, bn, bk, wm, wn, st): 64 x 64 warp tiles first (cuDNN's 128 x 128 x 16, 2 x 2 warps, 4 stages).
# Blocks of fewer than 4 warps are left out: one gave a wrong result on a GPU (docs/NOTES-tensorcore.md),
# not yet understood, so no 1- or 2-warp block is offered until it is.
PIPE_TILES = ((128, 128, 32, 2, 2, 3), (128, 128, 16, 2, 2, 4), (128, 64, 32, 2, 2, 3),
              (64, 128, 32, 2, 2, 3), (128, 64, 16, 2, 2, 4), (64, 128, 16, 2, 2, 4),
              (128, 128, 32, 2, 2, 2), (128, 128, 16, 2, 2, 3),
              (64, 64, 32, 2, 2, 3), (64, 64, 16, 2, 2, 4),
              (128, 256, 16, 2, 4, 3), (256, 128, 16, 4, 2, 3))


def pipe_space(m: int, n: int, device: DeviceInfo, a: Kind, b: Kind, batch: int = 1) -> list[Params]:
    """The default first, then every :data:`PIPE_TILES` entry that is valid and not far larger
    than the problem."""
    limit = min(PIPE_SHARED, max(device.shared_optin_bytes, 48 * 1024))
    out = [pipe_default(m, n, device, a, b, batch)]
    for bm, bn, bk, wm, wn, st in PIPE_TILES:
        p = Params(bm=bm, bn=bn, bk=bk, wm=wm, wn=wn, st=st)
        if p not in out and bm <= 2 * max(m, 16) and bn <= 2 * max(n, 16) and pipe_ok(p, a, b, limit):
            out.append(p)
    return out


def pipe_default(m: int, n: int, device: DeviceInfo, a: Kind, b: Kind, batch: int = 1) -> Params:
    """The first tile wasting at most 1/8 of its rows and columns that gives every compute unit
    a block; else the valid low-waste tile with the most blocks."""
    limit = min(PIPE_SHARED, max(device.shared_optin_bytes, 48 * 1024))
    valid = [Params(bm=bm, bn=bn, bk=bk, wm=wm, wn=wn, st=st) for bm, bn, bk, wm, wn, st in PIPE_TILES]
    valid = [p for p in valid if pipe_ok(p, a, b, limit)]
    if not valid:
        raise ValueError(f"no staged tensor-core tile fits operands {a} / {b}")
    return pick_tile(valid, m, n, batch, device.units)


pipe_grid = tc_grid  # x over N tiles, y over M tiles, z over batch x K splits


def pipe_block(p: Params) -> Dim3:
    return (layout_of(p).threads, 1, 1)


class _Copier:
    """One operand's cp.async traffic: each thread copies ``slots`` chunks of a bi x bk slice at
    fixed tile positions; rows/columns past the matrix are clamped (their results are never
    stored), k past ``kend`` and the operand's own invalid chunks are zero-filled."""

    def __init__(self, nm: str, op: AsyncOperand, size: int, bi: int, bk: int, threads: int,
                 origin: str, base: int) -> None:
        self.nm, self.op, self.size, self.bi, self.bk = nm, op, size, bi, bk
        self.origin, self.base = origin, base  # base: float offset of this tile in a stage
        self.ld = smem_ld(op.fast, bi, bk)
        self.slots = bi * bk // op.vec // threads
        per = (bk if op.fast == "k" else bi) // op.vec  # chunks along the fast dimension
        # threads is a multiple of per or per of threads (powers of two): slot s of a thread sits
        # a constant (di, dk) away from its slot 0, so one address serves every slot.
        if threads % per == 0:
            along, other = f"(tid % {per}) * {op.vec}", f"tid / {per}"
            steps = [(0, s * threads // per) for s in range(self.slots)]
        else:
            along, other = f"(tid % {per}) * {op.vec}", "0"
            steps = [(s * threads * op.vec, 0) for s in range(self.slots)]
        (self.i0, self.k0) = (other, along) if op.fast == "k" else (along, other)
        # (offset along i, offset along k) of each slot from slot 0
        self.steps = [(o, a) if op.fast == "k" else (a, o) for a, o in steps]

    def setup(self, code: Code) -> None:
        """Per thread: slot 0's row/column, k offset and shared address; rows of other slots."""
        code(f"const int {self.nm}k0 = {self.k0};",
             f"const unsigned {self.nm}d0 = smem0 + 4 * ({self.base} + "
             f"{smem_off(self.op.fast, self.ld, self.i0, self.nm + 'k0')});")
        for di in sorted({di for di, _ in self.steps}):
            tag = f"{self.nm}{di}"
            code(f"const int {tag}_i = {self.origin} + {self.i0} + {di};", *self.op.setup(f"{tag}_i", tag))

    def copy(self, code: Code, k0: str, stage: str) -> None:
        """Issue this thread's copies of the slice starting at k0 into ``stage``'s bytes. Rows or
        columns past the matrix and k past ``kend`` copy 0 bytes (zero-filled, source not read)."""
        v = self.op.vec
        for di, dk in self.steps:
            tag = f"{self.nm}{di}"
            with code.block(""):
                stmts, ptr, ok = self.op.src(tag, "kg")
                code(f"const int kg = {k0} + {self.nm}k0 + {dk};", *stmts)
                conds = ["kg < kend", f"{tag}_i < {self.size}"] + ([ok] if ok else [])
                off = di * self.ld + dk if self.op.fast == "k" else dk * self.ld + di
                dst = f"{self.nm}d0 + {stage} + {4 * off}"
                code(f"CP_ASYNC{4 * v}({dst}, {ptr}, ({' && '.join(conds)}) ? {4 * v}u : 0u);")


def pipe_kernel(name: str, shape: GemmShape, p: Params, a: AsyncOperand, b: AsyncOperand, c: Store,
                args: tuple[Arg, ...], prelude: tuple[str, ...] = (), comment: str = "") -> Kernel:
    """Generate ``name``: C = A.B on tensor cores (TF32) with the staged main loop.

    The body defines ``tid``, ``bz``, ``kz``, ``m0``/``n0``, ``kbeg``/``kend`` before ``prelude``
    (operand callbacks may use them). Launch with :func:`pipe_grid` and :func:`pipe_block`."""
    if not pipe_ok(p, a.kind, b.kind, 227 * 1024):
        raise ValueError(f"staged tensor-core GEMM parameters {p.short()} are invalid for operands "
                         f"A (fast {a.fast}, vec {a.vec}) and B (fast {b.fast}, vec {b.vec}): warps must tile "
                         "the block in 16 x 8 fragments, bk 16 or 32, 2-5 stages, copies spread evenly")
    lay = layout_of(p)
    ta, tb = tile_floats(a.fast, p.bm, p.bk), tile_floats(b.fast, p.bn, p.bk)
    stage = 4 * (ta + tb)
    code = Code()
    code("const int tid = LOCAL_ID(0), lane = tid & 31, warp = tid >> 5;",
         "const int g = lane >> 2, t = lane & 3;  // PTX groupID, threadID_in_group",
         f"const int wm0 = (warp / {p.wn}) * {lay.wtm}, wn0 = (warp % {p.wn}) * {lay.wtn};",
         f"const int bz = GROUP_ID(2) / {shape.ksplit}, kz = GROUP_ID(2) % {shape.ksplit};",
         f"const int m0 = GROUP_ID(1) * {p.bm}, n0 = GROUP_ID(0) * {p.bn};",
         f"const int kbeg = kz * {shape.klen}, kend = min(kbeg + {shape.klen}, {shape.k});")
    code(*prelude)
    code(f"const unsigned smem0 = SMEM_U32(tc_smem);  // {p.st} stages of A {ta} + B {tb} floats")
    ca = _Copier("a", a, shape.m, p.bm, p.bk, lay.threads, "m0", 0)
    cb = _Copier("b", b, shape.n, p.bn, p.bk, lay.threads, "n0", ta)
    ca.setup(code)
    cb.setup(code)
    _fragment_bases(code, a, b, ca, cb)
    for i, j, r in itertools.product(range(lay.fm), range(lay.fn), range(4)):
        code(f"float d{i}_{j}_{r} = 0.0f;")
    code(f"const int nk = (kend - kbeg + {p.bk - 1}) / {p.bk};")
    for s in range(p.st - 1):
        ca.copy(code, f"kbeg + {s * p.bk}", str(s * stage))
        cb.copy(code, f"kbeg + {s * p.bk}", str(s * stage))
        code("CP_ASYNC_COMMIT();")
    code(f"unsigned rd = 0, wr = {(p.st - 1) * stage};  // byte offsets of the stages read and written")
    with code.block("for (int kt = 0; kt < nk; ++kt)"):
        code(f"CP_ASYNC_WAIT({p.st - 2});", "BARRIER();")
        ca.copy(code, f"kbeg + (kt + {p.st - 1}) * {p.bk}", "wr")
        cb.copy(code, f"kbeg + (kt + {p.st - 1}) * {p.bk}", "wr")
        code("CP_ASYNC_COMMIT();")
        for kk in range(0, p.bk, 8):
            _mma_step(code, lay, a, b, ca, cb, kk)
        code(f"rd = rd == {(p.st - 1) * stage} ? 0 : rd + {stage};",
             f"wr = wr == {(p.st - 1) * stage} ? 0 : wr + {stage};")
    code("CP_ASYNC_WAIT(0);")
    _store(code, shape, lay, a.mode, b.mode, c)
    nbytes = p.st * stage
    return Kernel(name, args + (LocalBuf("tc_smem", nbytes),), code.text(), pipe_block(p),
                  requires=frozenset({"mma_tf32"}), min_blocks=1,
                  comment=comment or f"staged TF32 tensor-core GEMM {shape.m}x{shape.n}x{shape.k} batch "
                  f"{shape.batch} split {shape.ksplit}: {p.short()}")


def _fragment_bases(code: Code, a: AsyncOperand, b: AsyncOperand, ca: _Copier, cb: _Copier) -> None:
    """Per-lane shared addresses of the first fragment of each operand (stage 0, k step 0)."""
    for nm, op, cp, w0, row in (("a", a, ca, "wm0", ldsm_a_row()), ("b", b, cb, "wn0", ldsm_b_row())):
        if op.mode == "ldsm":
            off = smem_off("k", cp.ld, f"{w0} + {row[0]}", row[1])
        else:
            off = smem_off("i", cp.ld, f"{w0} + {'4 * g' if op.mode == 'lds4' else 'g'}", "t")
        code(f"const unsigned {nm}f = smem0 + 4 * ({cp.base} + {off});")


def _mma_step(code: Code, lay: PipeLayout, a: AsyncOperand, b: AsyncOperand, ca: _Copier,
              cb: _Copier, kk: int) -> None:
    """One k step of 8: fragments of A and B from the stage at byte offset ``rd``, then MMAs."""
    with code.block(f"/* k step {kk} */"):
        for nm, op, cp, count in (("a", a, ca, lay.fm), ("b", b, cb, lay.fn)):
            regs = 4 if nm == "a" else 2
            code(f"float {', '.join(f'{nm}{f}_{r}' for f in range(count) for r in range(regs))};")
            if op.mode == "ldsm":
                _ldsm(code, nm, cp, count, kk)
            elif op.mode == "lds4":
                _lds128(code, nm, cp, count, kk)
            else:
                for f, r in itertools.product(range(count), range(regs)):
                    code(f"{nm}{f}_{r} = LDS_F1({nm}f + rd + {4 * lds1_const(nm, cp.ld, f, r, kk)});")
            if not op.rounded:
                for f, r in itertools.product(range(count), range(regs)):
                    code(f"{nm}{f}_{r} = TF32_RHA({nm}{f}_{r});")
        for i, j in itertools.product(range(lay.fm), range(lay.fn)):
            d = ", ".join(f"d{i}_{j}_{r}" for r in range(4))
            code(f"MMA_TF32_16x8x8({d}, {', '.join(f'a{i}_{r}' for r in range(4))}, b{j}_0, b{j}_1);")


def _ldsm(code: Code, nm: str, cp: _Copier, count: int, kk: int) -> None:
    """ldmatrix.x4: one per A fragment (16 rows), one per pair of B fragments (16 columns)."""
    if nm == "a":
        for f in range(count):
            code(f"LDMATRIX_X4(a{f}_0, a{f}_1, a{f}_2, a{f}_3, af + rd + {4 * (16 * f * cp.ld + kk)});")
        return
    for f in range(0, count, 2):
        code(f"LDMATRIX_X4(b{f}_0, b{f}_1, b{f + 1}_0, b{f + 1}_1, bf + rd + {4 * (8 * f * cp.ld + kk)});")


def _lds128(code: Code, nm: str, cp: _Copier, count: int, kk: int) -> None:
    """float4 reads of a k-major tile at k rows t and t + 4 (values j of :func:`lane_i`)."""
    per = 2 * count if nm == "a" else count  # values per lane per k row
    for hh, blk in itertools.product((0, 1), range(per // 4)):
        v = f"{nm}v{hh}_{blk}"
        off = 4 * ((kk + 4 * hh) * cp.ld + 32 * blk)
        code(f"const float4 {v} = LDS_F4({nm}f + rd + {off});")
        for e, comp in enumerate("xyzw"):
            j = 4 * blk + e
            reg = f"a{j >> 1}_{(j & 1) + 2 * hh}" if nm == "a" else f"b{j}_{hh}"
            code(f"{reg} = {v}.{comp};")


def _store(code: Code, shape: GemmShape, lay: PipeLayout, a_mode: str, b_mode: str, c: Store) -> None:
    """Guarded stores of the accumulators through the Store callbacks (undoing the permutations)."""
    for j, e in itertools.product(range(lay.fn), (0, 1)):
        tag = f"cs{j}_{e}"
        code(f"const int {tag}_i = n0 + wn0 + {c_col(b_mode, j, e)};", *c.setup(f"{tag}_i", tag))
    for i, h in itertools.product(range(lay.fm), (0, 1)):
        code(f"const int cm{i}_{h} = m0 + wm0 + {c_row(a_mode, i, h)};")
        with code.block(f"if (cm{i}_{h} < {shape.m})"):
            for j, e in itertools.product(range(lay.fn), (0, 1)):
                with code.block(f"if (cs{j}_{e}_i < {shape.n})"):
                    code(*c.put(f"cm{i}_{h}", f"cs{j}_{e}", f"d{i}_{j}_{2 * h + e}"))
