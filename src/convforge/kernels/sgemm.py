"""A tiled SGEMM kernel generator in the dialect, shared by every GEMM-shaped variant.

C (M x N) = A (M x K) . B (K x N), optionally batched (GROUP_ID(2)) and split along K.

A block of ``(bm/tm)*(bn/tn)`` threads computes a ``bm x bn`` tile of C; each thread holds a
``tm x tn`` micro-tile of accumulators in registers and runs an outer-product micro-kernel over
``bk``-deep slices of A and B staged in shared memory. Shared memory is k-major (``As[k][m]``,
``Bs[k][n]``) so each thread reads its micro-tile rows and columns as float4s. Options:

* ``va`` / ``vb`` (1 or 4): global loads of A / B as float4 along the operand's fast dimension;
* ``pf``: register prefetch -- the next slice is loaded into registers while this one is computed;
* ``db``: double-buffered shared memory (requires ``pf``), one barrier per slice instead of two.

The operands are pluggable: an :class:`Operand` says how one thread reads element (i, k) of A
(i = row m) or B (i = column n), so an im2col matrix, a virtual im2col matrix (implicit GEMM), a
window tensor (im2win), raw NCHW input (1x1) or a Winograd-transformed batch all drive the same
generator. A :class:`Store` says how an accumulator reaches memory (epilogue included).

Edges are guarded by predication; no size needs to divide a tile. Every loop bound is a
compile-time constant and the micro-kernel is unrolled, so accumulators stay in registers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from convforge.codegen.dialect import Arg, Dim3, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.params import Params
from convforge.plan import DeviceInfo

# (i expression, tag) -> statements run once per thread before the main loop
SetupFn = Callable[[str, str], list[str]]
# (tag, k expression, destination) -> statements assigning dst for an in-bounds element (or float4)
LoadFn = Callable[[str, str, str], list[str]]
# (m expression, tag of column, value) -> statements storing one accumulator (in bounds)
PutFn = Callable[[str, str, str], list[str]]
# (m expression, tag of the first of 4 columns, 4 values) -> statements storing them (in bounds)
VPutFn = Callable[[str, str, list[str]], list[str]]
# (k tag, k expression) -> statements defining per-k values named ``{ktag}_*``
KPrepFn = Callable[[str, str], list[str]]
# (column tag, k tag, destination) -> statements assigning dst from per-column and per-k values
KLoadFn = Callable[[str, str, str], list[str]]


def _default_setup(i: str, tag: str) -> list[str]:
    return []


@dataclass(frozen=True)
class Operand:
    """How a thread reads one GEMM input: A as (i=m, k), B as (k, i=n).

    ``setup(i, tag)`` runs once per distinct fixed index ``i`` a thread loads (hoisted out of the
    K loop: decompose a column into image/row/column, form a base pointer, ...); the index itself
    is the int ``{tag}_i`` and names the callback defines should start with ``tag``.
    ``load(tag, k, dst)`` assigns element (tag, k) to ``dst``; it is only called inside an
    ``i < I && k < K`` guard, so it must handle only what the operand adds (padding).
    ``vload(tag, k, dst)`` assigns a float4 of 4 consecutive elements along ``fast``
    starting at an index that is a multiple of 4; give it only when such a chunk is 16-byte
    aligned and either wholly inside or wholly outside the matrix.

    ``fast`` is the dimension consecutive threads walk ("k" or "i"): choose the one contiguous
    in memory so that global loads coalesce.

    ``kprep``/``kload`` (optional, scalar loads with ``fast == "i"``): split the address of an
    element into a per-column part (``setup``) and a per-k part (``kprep(ktag, k)``, names
    ``{ktag}_*``); the generator then gives each thread several columns at the same k, so the
    per-k part (an im2col (c, r, s) decomposition, say) is computed once per k for all of them.
    """

    load: LoadFn
    fast: str = "k"
    setup: SetupFn = _default_setup
    vload: LoadFn | None = None
    kprep: KPrepFn | None = None
    kload: KLoadFn | None = None

    def __post_init__(self) -> None:
        if self.fast not in ("k", "i"):
            raise ValueError(f"Operand.fast ({self.fast!r}) must be 'k' or 'i'")


@dataclass(frozen=True)
class Store:
    """How a thread writes C: ``setup(n, tag)`` once per column it owns (the column is the int
    ``{tag}_i``), ``put(m, tag, v)`` per accumulator, called only inside ``m < M && n < N``.
    ``vput(m, tag, values)`` (optional) stores 4 consecutive columns starting at ``{tag}_i``
    (a multiple of 4) as one float4; give it only when every such chunk is 16-byte aligned and
    contiguous, with N a multiple of 4."""

    put: PutFn
    setup: SetupFn = _default_setup
    vput: VPutFn | None = None


@dataclass(frozen=True)
class GemmShape:
    """Problem sizes of one GEMM launch; ``batch`` GEMMs side by side, K cut into ``ksplit``."""

    m: int
    n: int
    k: int
    batch: int = 1
    ksplit: int = 1

    @property
    def klen(self) -> int:
        """Reduction length of one K split, a multiple of 4 so float4 chunks never straddle
        two splits (tiles may: loads are guarded by the split's end)."""
        return cdiv(cdiv(self.k, self.ksplit), 4) * 4


@dataclass(frozen=True)
class _Layout:
    """Derived sizes of one parameter set."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    threads: int = field(init=False)
    tx: int = field(init=False)
    ty: int = field(init=False)
    gm: int = field(init=False)
    gn: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tx", self.bn // self.tn)
        object.__setattr__(self, "ty", self.bm // self.tm)
        object.__setattr__(self, "threads", self.tx * self.ty)
        object.__setattr__(self, "gm", 4 if self.tm % 4 == 0 else 1)
        object.__setattr__(self, "gn", 4 if self.tn % 4 == 0 else 1)

    def row(self, i: int) -> str:
        """Tile-relative row of micro-tile row i: groups of gm rows, spread by ty*gm."""
        g = self.gm
        return f"{(i // g) * self.ty * g + i % g} + ty * {g}"

    def col(self, j: int) -> str:
        g = self.gn
        return f"{(j // g) * self.tx * g + j % g} + tx * {g}"


def layout_ok(p: Params, va_ok: bool = True, vb_ok: bool = True,
              a_fast: str = "k", b_fast: str = "i", max_threads: int = 1024,
              shared_bytes: int = 48 * 1024) -> bool:
    """Whether a parameter set is valid for the generator (tiles divide, loads spread evenly)."""
    return layout_problem(p, va_ok, vb_ok, a_fast, b_fast, max_threads, shared_bytes) is None


def layout_problem(p: Params, va_ok: bool = True, vb_ok: bool = True,
                   a_fast: str = "k", b_fast: str = "i", max_threads: int = 1024,
                   shared_bytes: int = 48 * 1024) -> str | None:
    """None when :func:`layout_ok`, else what is wrong, naming the parameters."""
    for tile, micro in (("bm", "tm"), ("bn", "tn")):
        if p[tile] % p[micro]:
            return f"{micro} ({p[micro]}) must divide {tile} ({p[tile]})"
    if p.db and not p.pf:
        return "db=1 (double buffering) needs pf=1"
    kc = p.get("kc", 0)
    if kc and (kc < 0 or kc % p.bk or kc // p.bk < 2):
        return f"kc ({kc}) must be 0 or a multiple of bk ({p.bk}) of at least 2 tiles"
    for key, ok in (("va", va_ok), ("vb", vb_ok)):
        if p[key] not in ((1, 4) if ok else (1,)):
            return f"{key} ({p[key]}) must be {'1 or 4' if ok else '1 for this operand'}"
    lay = _Layout(p.bm, p.bn, p.bk, p.tm, p.tn)
    if not 32 <= lay.threads <= max_threads:
        return f"(bm/tm) * (bn/tn) ({lay.threads}) threads must be 32..{max_threads}"
    if not loads_divide(p, lay.threads, a_fast, b_fast):
        return (f"bm, bn, bk, va, vb ({p.bm}, {p.bn}, {p.bk}, {p.va}, {p.vb}): the tiles' loads must "
                f"spread evenly over the {lay.threads} threads")
    if shared_bytes_of(p) > shared_bytes:
        return (f"bm, bn, bk ({p.bm}, {p.bn}, {p.bk}) need {shared_bytes_of(p)} B of shared memory "
                f"(limit {shared_bytes})")
    return None


def loads_divide(p: Params, threads: int, a_fast: str, b_fast: str) -> bool:
    """Whether every thread loads whole vectors of both tiles: each tile's vectors along its fast
    dimension, and as many of them as a whole number (>= 1) per thread."""
    for bi, v, fast in ((p.bm, p.va, a_fast), (p.bn, p.vb, b_fast)):
        along = p.bk if fast == "k" else bi
        chunks = bi * p.bk // v
        if along % v or chunks % threads or chunks < threads:
            return False
    return True


def shared_bytes_of(p: Params) -> int:
    """Static shared memory of the generated kernel."""
    lda, ldb = p.bm + 4, p.bn + 4
    return 4 * (2 if p.db else 1) * p.bk * (lda + ldb)


KC = 128  # reduction elements per chunk of the two-level sums (``_k_loop``)
KC_MIN = 512  # reductions at least this long sum in chunks by default


def chunked(p: Params, k: int, big: bool = False) -> Params:
    """``p`` with two-level sums (kc = KC) where the reduction ``k`` is long enough to gain and the
    micro-tile small enough that its chunk totals cost few registers (on sm_90 4 x 4: 56 -> 72;
    8 x 4: 71 -> 127, and a bfloat16 point without prefetch spilled; 8 x 8: 126 -> 221, half the
    occupancy), or any micro-tile when ``big`` (the default's twin)."""
    small = p.tm * p.tn <= 16 or big
    return p.replace(kc=KC) if small and k >= KC_MIN and KC % p.bk == 0 and KC // p.bk >= 2 else p


def gemm_space(m: int, n: int, k: int, device: DeviceInfo, va_ok: bool = True,
               vb_ok: bool = True, a_fast: str = "k", b_fast: str = "i") -> list[Params]:
    """Every sensible parameter set for an M x N x K GEMM on ``device`` (default first); on long
    reductions points of small micro-tiles sum in chunks (:func:`chunked`), and the default's twin
    with the other choice comes second."""
    first = gemm_default(m, n, k, device, va_ok, vb_ok, a_fast, b_fast)
    twin = first.replace(kc=0) if "kc" in first else chunked(first, k, big=True)
    out = [first] + ([twin] if twin != first else [])
    seen = set(out)  # (membership in the list was quadratic: a few hundred points, asked on every dispatch)
    for bm, bn, bk, tm, tn, va, vb, pipe in itertools.product(
            (32, 64, 128), (32, 64, 96, 128), (8, 16), (4, 8), (4, 8, 12), (4, 1), (4, 1),
            ((1, 1), (1, 0), (0, 0))):
        if bm > 2 * max(m, 16) or bn > 2 * max(n, 16) or (bn == 96) != (tn == 12):
            continue  # 96 x 12: N = 96 (ResNet 512@7² N96 under F(7x7)) without a 128-wide tile's waste
        p = chunked(Params(bm=bm, bn=bn, bk=bk, tm=tm, tn=tn, va=va, vb=vb, pf=pipe[0], db=pipe[1]), k)
        if p not in seen and layout_ok(p, va_ok, vb_ok, a_fast, b_fast, device.max_threads,
                                       min(device.shared_bytes, 48 * 1024)):
            out.append(p)
            seen.add(p)
    return out


def lean_point(p: Params) -> bool:
    """Whether an SGEMM point over a gathered operand stays clear of spills on sm_90: register
    prefetch on, at least 8 x 8 outputs per thread and 64 threads, at most 8 load slots per operand
    and thread. Every B slot of a gathered operand keeps its column's offsets in registers; past 8
    slots, without prefetch, or with smaller micro-tiles (where ptxas trades a few registers for
    occupancy) nvcc 13 spilled 4-192 bytes on sampled ResNet and odd layers (wgrad's GEMMs; the
    strided dgrad GEMM: 7 of 667 points, every one outside this rule, where forward implicit_gemm
    spills too; its 517 lean points on six layers compile clean)."""
    threads = (p.bm // p.tm) * (p.bn // p.tn)
    slots = max(p.bm * p.bk // p.va, p.bn * p.bk // p.vb) // threads
    return bool(p.pf) and p.tm * p.tn >= 64 and threads >= 64 and slots <= 8


def gemm_default(m: int, n: int, k: int, device: DeviceInfo, va_ok: bool = True,
                 vb_ok: bool = True, a_fast: str = "k", b_fast: str = "i",
                 prefer: tuple[tuple[int, int, int, int, int], ...] = ()) -> Params:
    """A good untuned choice: 128x128x8 / 8x8 / 256 threads for big GEMMs, smaller for small ones;
    a small cheap tile on CPUs. On GPUs the tiles ``prefer`` (bm, bn, bk, tm, tn) come first,
    each taken when valid."""
    if not device.is_gpu:
        cands = [(32, 32, 8, 4, 4)]
    else:
        bm = 128 if m > 64 else 64 if m > 32 else 32
        bn = 128 if n > 64 else 64 if n > 32 else 32
        cands = [(bm, bn, 8, 8 if bm >= 64 else 4, 8 if bn >= 64 else 4), (bm, bn, 16, 4, 4),
                 (32, 32, 8, 4, 4)]
        cands = list(prefer) + cands
    for (bm, bn, bk, tm, tn), va, vb in itertools.product(cands, (4, 1), (4, 1)):
        p = chunked(Params(bm=bm, bn=bn, bk=bk, tm=tm, tn=tn, va=va if va_ok else 1,
                           vb=vb if vb_ok else 1, pf=1, db=1 if device.is_gpu else 0), k)
        if layout_ok(p, va_ok, vb_ok, a_fast, b_fast, device.max_threads,
                     min(device.shared_bytes, 48 * 1024)):
            return p
    raise ValueError(f"no GEMM tile fits M={m} N={n} K={k} on {device.name}")


def gemm_grid(shape: GemmShape, p: Params) -> Dim3:
    """Grid of blocks: x over N tiles, y over M tiles, z over batch x K splits."""
    return (cdiv(shape.n, p.bn), cdiv(shape.m, p.bm), shape.batch * shape.ksplit)


def gemm_block(p: Params) -> Dim3:
    return (_Layout(p.bm, p.bn, p.bk, p.tm, p.tn).threads, 1, 1)


def gemm_kernel(name: str, shape: GemmShape, p: Params, a: Operand, b: Operand, c: Store,
                args: tuple[Arg, ...], prelude: tuple[str, ...] = (),
                comment: str = "", n_last_first: bool = False, head: tuple[str, ...] = (),
                k_of_batch: str | None = None) -> Kernel:
    """Generate the kernel ``name``: C = A.B for ``shape`` with parameters ``p``.

    The body defines, before ``prelude`` runs: ``tid`` (thread in block), ``bz`` (batch index),
    ``kz`` (K-split index), ``m0``/``n0`` (tile origin) and ``kbeg``/``kend`` (this split's K
    range). Operand and store callbacks may use them; ``prelude`` may offset pointers by ``bz``.
    Launch with :func:`gemm_grid` and :func:`gemm_block`. ``n_last_first``: blocks are taken
    in the order (N tile descending, then M tile, then batch and split fastest) instead of the
    grid's, so a GEMM whose B was just written N-column by N-column starts on what is still in L2.
    ``head`` runs right after ``bz`` is known and ``k_of_batch`` (an expression it may define)
    is then batch entry ``bz``'s reduction length, at most ``shape.k``: batched GEMMs of unequal
    depth in one launch (the stride phases of a strided dgrad).
    """
    why = layout_problem(p, a.vload is not None, b.vload is not None, a.fast, b.fast)
    if why:
        raise ValueError(f"GEMM parameters {p.short()} are invalid for this generator: {why}")
    lay = _Layout(p.bm, p.bn, p.bk, p.tm, p.tn)
    code = Code()
    code(f"const int tid = LOCAL_ID(0), tx = tid % {lay.tx}, ty = tid / {lay.tx};")
    if n_last_first:
        gx, gy, gz = gemm_grid(shape, p)
        code(f"const int lin = GROUP_ID(0) + {gx} * (GROUP_ID(1) + {gy} * GROUP_ID(2));",
             f"const int gz_ = lin % {gz}, gy_ = lin / {gz} % {gy}, gx_ = {gx - 1} - lin / {gy * gz};")
        ids = ("gx_", "gy_", "gz_")
    else:
        ids = ("GROUP_ID(0)", "GROUP_ID(1)", "GROUP_ID(2)")
    code(f"const int bz = {ids[2]} / {shape.ksplit}, kz = {ids[2]} % {shape.ksplit};", *head)
    code(f"const int m0 = {ids[1]} * {p.bm}, n0 = {ids[0]} * {p.bn};",
         f"const int kbeg = kz * {shape.klen}, kend = min(kbeg + {shape.klen}, {k_of_batch or shape.k});")
    code(*prelude)
    _shared(code, p)
    ga = _Loader("a", a, shape.m, p.bm, p.bk, p.va, lay.threads, "m0", "As", p.bm + 4)
    gb = _Loader("b", b, shape.n, p.bn, p.bk, p.vb, lay.threads, "n0", "Bs", p.bn + 4)
    ga.setup(code)
    gb.setup(code)
    for i, j in itertools.product(range(p.tm), range(p.tn)):
        code(f"float c{i}_{j} = 0.0f;" + (f" float s{i}_{j} = 0.0f;" if p.get("kc", 0) else ""))
    _main_loop(code, p, lay, ga, gb)
    if p.get("kc", 0):
        code("// the chunk totals are the sums",
             *(f"c{i}_{j} = s{i}_{j};" for i, j in itertools.product(range(p.tm), range(p.tn))))
    _store(code, shape, p, lay, c)
    return Kernel(name, args, code.text(), gemm_block(p), comment=comment or
                  f"sgemm {shape.m}x{shape.n}x{shape.k} batch {shape.batch} split "
                  f"{shape.ksplit}: {p.short()}")


def _shared(code: Code, p: Params) -> None:
    """Shared tiles declared as float4 (16-byte aligned), used through float pointers."""
    nbuf = 2 if p.db else 1
    for nm, ld in (("As", p.bm + 4), ("Bs", p.bn + 4)):
        size = nbuf * p.bk * ld
        code(f"SHARED float4 {nm}4[{size // 4}];  // {nbuf} x {p.bk} x {ld}",
             f"LOCAL_PTR float* {nm} = (LOCAL_PTR float*){nm}4;")


class _Loader:
    """The global->register->shared traffic of one operand tile (bi x bk).

    Each thread loads ``slots`` elements (or float4s) per slice at fixed tile positions. Indices
    along i are clamped into the matrix (a row/column past the edge re-reads the last one; its
    results are never stored), so only the k range needs a guard. Operands with ``kload`` get
    the grouped layout: a thread's slots are ``ni`` columns x ``nk`` k rows, and per-k work is
    done once per k row.
    """

    def __init__(self, nm: str, op: Operand, size: int, bi: int, bk: int, v: int,
                 threads: int, origin: str, smem: str, ld: int) -> None:
        self.nm, self.op, self.size, self.bi, self.bk, self.v = nm, op, size, bi, bk, v
        self.origin, self.smem, self.ld = origin, smem, ld
        self.slots = bi * bk // v // threads
        self.ni = self._columns(threads) if op.kload is not None and v == 1 and op.fast == "i" \
            else 0
        if self.ni:
            lanes, rows = bi // self.ni, threads // (bi // self.ni)
            self.pos = [(f"tid % {lanes}" + (f" + {ji * lanes}" if ji else ""),
                         f"tid / {lanes}" + (f" + {jk * rows}" if jk else ""))
                        for jk in range(self.slots // self.ni) for ji in range(self.ni)]
        else:
            self.pos = [self._pos(s, threads) for s in range(self.slots)]
        self.tags: dict[str, str] = {}
        self.krows: dict[str, int] = {}

    def _columns(self, threads: int) -> int:
        """Columns per thread of the grouped layout: the most that keep >= 32 lanes along i."""
        for ni in range(self.slots, 0, -1):
            lanes = self.bi // ni if self.bi % ni == 0 else 0
            if (self.slots % ni == 0 and lanes and threads % lanes == 0
                    and self.bk % (threads // lanes) == 0 and lanes >= min(32, self.bi)):
                return ni
        return 0

    def _pos(self, s: int, threads: int) -> tuple[str, str]:
        """(i, k) offsets inside the tile of slot s's first element, as C expressions."""
        per = (self.bk if self.op.fast == "k" else self.bi) // self.v  # chunks along fast dim
        if threads % per == 0:
            lane = "0" if per == 1 else f"(tid % {per})" + (f" * {self.v}" if self.v > 1 else "")
            other = f"tid / {per}" + (f" + {s * threads // per}" if s else "")
        else:
            lane = f"((tid + {s * threads}) % {per}) * {self.v}"
            other = f"(tid + {s * threads}) / {per}"
        return (other, lane) if self.op.fast == "k" else (lane, other)

    def setup(self, code: Code) -> None:
        last = self.size - (self.v if self.op.fast == "i" else 1)
        for s, (i, k) in enumerate(self.pos):
            if i not in self.tags:
                tag = f"{self.nm}{len(self.tags)}"
                self.tags[i] = tag
                code(f"const int {tag}_i = min({self.origin} + {i}, {max(last, 0)});")
                code(*self.op.setup(f"{tag}_i", tag))
            if self.ni:
                if k not in self.krows:
                    self.krows[k] = len(self.krows)
                    code(f"const int {self.nm}k{self.krows[k]} = {k};")
            else:
                code(f"const int {self.nm}k{s} = {k};")
        kind = "float4" if self.v == 4 else "float"
        for s in range(self.slots):
            code(f"{kind} {self.nm}r{s};")

    def load(self, code: Code, k0: str, direct: bool = False, buf: str = "0") -> None:
        """Load slice starting at k0 into the registers (and straight to shared when direct)."""
        zero = "MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f)" if self.v == 4 else "0.0f"
        if self.ni:
            self._load_grouped(code, k0, zero)
        for s, (i, _) in enumerate(self.pos if not self.ni else []):
            tag, dst = self.tags[i], f"{self.nm}r{s}"
            with code.block(""):
                code(f"const int kg = {k0} + {self.nm}k{s};", f"{dst} = {zero};")
                with code.block("if (kg < kend)"):
                    fn = self.op.vload if self.v == 4 else self.op.load
                    assert fn is not None
                    code(*fn(tag, "kg", dst))
        if direct:
            self.stash(code, buf)

    def _load_grouped(self, code: Code, k0: str, zero: str) -> None:
        """One block per k row: the per-k part once, then the row's ``ni`` columns."""
        assert self.op.kprep is not None and self.op.kload is not None
        kt = f"{self.nm}t"
        for j in range(self.slots // self.ni):
            with code.block(""):
                code(f"const int kg = {k0} + {self.nm}k{j};", *self.op.kprep(kt, "kg"))
                for s in range(j * self.ni, (j + 1) * self.ni):
                    dst = f"{self.nm}r{s}"
                    code(f"{dst} = {zero};")
                    with code.block("if (kg < kend)"):
                        code(*self.op.kload(self.tags[self.pos[s][0]], kt, dst))

    def stash(self, code: Code, buf: str) -> None:
        """Registers -> shared buffer ``buf`` (k-major, leading dimension ld)."""
        base = f"({self.smem} + {buf} * {self.bk * self.ld})" if buf != "0" else self.smem
        for s, (i, k) in enumerate(self.pos):
            dst = f"{self.nm}r{s}"
            if self.v == 1:
                code(f"{base}[({k}) * {self.ld} + {i}] = {dst};")
            elif self.op.fast == "i":
                code(f"VSTORE4({dst}, 0, {base} + ({k}) * {self.ld} + {i});")
            else:
                for e, comp in enumerate("xyzw"):
                    code(f"{base}[({k} + {e}) * {self.ld} + {i}] = {dst}.{comp};")


def _main_loop(code: Code, p: Params, lay: _Layout, ga: _Loader, gb: _Loader) -> None:
    """The K loop in one of three pipelines: plain, register prefetch, prefetch + double buffer;
    with ``kc`` it runs chunk by chunk (:func:`_k_loop`)."""
    code(f"const int nk = (kend - kbeg + {p.bk - 1}) / {p.bk};")
    if not p.pf:
        with _k_loop(code, p):
            ga.load(code, f"kbeg + kt * {p.bk}", direct=True)
            gb.load(code, f"kbeg + kt * {p.bk}", direct=True)
            code("BARRIER();")
            _micro(code, p, lay, "0")
            code("BARRIER();")
        return
    ga.load(code, "kbeg")
    gb.load(code, "kbeg")
    if p.db:
        ga.stash(code, "0")
        gb.stash(code, "0")
        code("BARRIER();")
        with _k_loop(code, p):
            # Unconditional prefetch (the last slice re-reads itself into the idle buffer): a
            # guarded one lets ptxas sink the loads below the micro-kernel, into the guarded
            # stash, where their latency is no longer hidden.
            code("const int cur = kt & 1;",
                 f"const int knext = kbeg + min(kt + 1, nk - 1) * {p.bk};")
            ga.load(code, "knext")
            gb.load(code, "knext")
            _micro(code, p, lay, "cur")
            ga.stash(code, "(cur ^ 1)")
            gb.stash(code, "(cur ^ 1)")
            code("BARRIER();")
        return
    with _k_loop(code, p):
        ga.stash(code, "0")
        gb.stash(code, "0")
        code("BARRIER();", f"const int knext = kbeg + min(kt + 1, nk - 1) * {p.bk};")
        ga.load(code, "knext")  # unconditional, as above
        gb.load(code, "knext")
        _micro(code, p, lay, "0")
        code("BARRIER();")


@contextmanager
def _k_loop(code: Code, p: Params) -> Iterator[None]:
    """``for kt in 0..nk`` around the body; with two-level sums (``kc`` > 0) an outer loop over
    chunks of kc / bk tiles whose end adds the running sums c into the chunk totals s and
    restarts them, so no FP32 sum runs over more than kc terms. The inner body is the plain loop's:
    a flush branch inside it costs time; nested, the chunked loop times as the plain one. Chunks
    of 128 to 256 terms bring a long reduction's error down to BLAS's blocked sums' (docs/NOTES-gemm.md)."""
    kc = p.get("kc", 0)
    if not kc:
        with code.block("for (int kt = 0; kt < nk; ++kt)"):
            yield
        return
    tiles = kc // p.bk
    code(f"// two-level sums: chunks of {kc} reduction elements")
    with code.block(f"for (int kc0 = 0; kc0 < nk; kc0 += {tiles})"):
        code(f"const int kce = min(kc0 + {tiles}, nk);")
        with code.block("for (int kt = kc0; kt < kce; ++kt)"):
            yield
        code(*(f"s{i}_{j} += c{i}_{j}; c{i}_{j} = 0.0f;"
               for i, j in itertools.product(range(p.tm), range(p.tn))))


def _micro(code: Code, p: Params, lay: _Layout, buf: str) -> None:
    """Outer-product micro-kernel over the bk-deep slice in shared buffer ``buf``."""
    lda, ldb = p.bm + 4, p.bn + 4
    a_base = "As" if buf == "0" else f"(As + {buf} * {p.bk * lda})"
    b_base = "Bs" if buf == "0" else f"(Bs + {buf} * {p.bk * ldb})"
    code("#pragma unroll")
    with code.block(f"for (int kk = 0; kk < {p.bk}; ++kk)"):
        code(f"const LOCAL_PTR float* ap = {a_base} + kk * {lda};",
             f"const LOCAL_PTR float* bp = {b_base} + kk * {ldb};")
        _regs(code, "a", "ap", p.tm, lay.gm, lay.row)
        _regs(code, "b", "bp", p.tn, lay.gn, lay.col)
        for i, j in itertools.product(range(p.tm), range(p.tn)):
            code(f"c{i}_{j} = FMA(a{i}, b{j}, c{i}_{j});")


def _regs(code: Code, nm: str, ptr: str, count: int, g: int, pos: Callable[[int], str]) -> None:
    """Read a micro-tile row/column from shared memory: float4s when the group is 4."""
    for i in range(0, count, g):
        if g == 4:
            code(f"const float4 {nm}v{i // 4} = VLOAD4(0, {ptr} + {pos(i)});")
            for e, comp in enumerate("xyzw"):
                code(f"const float {nm}{i + e} = {nm}v{i // 4}.{comp};")
        else:
            code(f"const float {nm}{i} = {ptr}[{pos(i)}];")


def _store(code: Code, shape: GemmShape, p: Params, lay: _Layout, c: Store) -> None:
    """Guarded stores of the micro-tile through the Store callbacks."""
    for j in range(p.tn):
        code(f"const int cs{j}_i = n0 + {lay.col(j)};")
        code(*c.setup(f"cs{j}_i", f"cs{j}"))
    vec = c.vput is not None and lay.gn == 4 and shape.n % 4 == 0
    for i in range(p.tm):
        code(f"const int cm{i} = m0 + {lay.row(i)};")
        with code.block(f"if (cm{i} < {shape.m})"):
            for j in range(0, p.tn, 4 if vec else 1):
                with code.block(f"if (cs{j}_i < {shape.n})"):
                    if vec:  # 4 consecutive columns, wholly inside or outside (N % 4 == 0)
                        assert c.vput is not None
                        code(*c.vput(f"cm{i}", f"cs{j}", [f"c{i}_{j + e}" for e in range(4)]))
                    else:
                        code(*c.put(f"cm{i}", f"cs{j}", f"c{i}_{j}"))
