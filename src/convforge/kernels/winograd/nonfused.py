"""Non-fused Winograd (Lavin & Gray; Nervana's separate-kernel form): four generated kernels.

    filter transform  U[e][c][k] = (G g G^T)[e]          alpha^2 x C x K      (every call)
    input transform   V[e][c][t] = (B^T d B)[e]          alpha^2 x C x T
    batched GEMM      M[e][k][t] = sum_c U[e][c][k] V[e][c][t]   alpha^2 batches
    output transform  y[n][k][tile] = A^T M A

T = N * tiles_h * tiles_w (tiles of every image in one GEMM dimension: superblocking for small N).
Any r x s filter with m + r - 1 <= 8, any N, C, K, H, W and padding; stride and dilation 1.

The batched GEMM comes from one of two generators, chosen by the tuning parameter ``gemm``:
``"own"`` (the parameter absent, as in the default) is the simple tiled kernel below;
``"sgemm"`` is the shared generator of ``kernels/sgemm.py`` (float4 loads, register prefetch,
double-buffered shared memory) with batch = alpha^2.

Other tuning parameters: ``ks`` (GEMM channel slices, summed by the output transform), ``hf``
(half-transformed filters finished by the GEMM's A loads), ``so`` (staged output stores), ``xi``
/ ``xo`` (split transforms, split.py) with ``xt`` (their tiles per block) and ``lo`` (L2 order:
tile-major transforms, the GEMM's blocks last tiles first).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from convforge.codegen.dialect import Buf, Dim3, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs, pro_args
from convforge.kernels.sgemm import (
    GemmShape,
    Operand,
    Store,
    gemm_block,
    gemm_default,
    gemm_grid,
    gemm_kernel,
    gemm_space,
)
from convforge.kernels.winograd.matrices import lincomb, row_select
from convforge.kernels.winograd.split import (
    XT,
    XT_CHOICES,
    split_grid,
    split_input_kernel,
    split_output_kernel,
)
from convforge.kernels.winograd.staged import (
    STATIC_SHARED_LIMIT,
    emit_staged_output,
    staged_bytes,
)
from convforge.kernels.winograd.tiles import (
    STORE2_HELPER,
    Geometry,
    emit_filter_transform,
    emit_input_transform,
    emit_output_store,
    emit_output_transform,
    emit_tile_load,
    emit_tile_masks,
    emit_tile_origin,
)
from convforge.params import Params
from convforge.plan import INT32_MAX, DeviceInfo, Epilogue, Launch, Plan, Prologue, Variant, index_refusal
from convforge.spec import ConvSpec

MAX_ALPHA = 9
GemmGen = Callable[..., Kernel]  # gemm_kernel's signature: (name, shape, p, a, b, c, args, prelude, ...)
# F(7x7) with split transforms (docs/NOTES-winograd.md): 64 x 64 x 16 with 8 x 8 per thread (64 threads)
# is fastest or close on large images; 64 x 96 with 8 x 12 where the GEMM has 96 columns (no idle columns).
_SMALL_TILE = (64, 64, 16, 8, 8)
_N96_TILE = (64, 96, 8, 8, 12)
_TRANSFORM_KEYS = ("so", "xi", "xo", "xt", "lo")  # non-GEMM choices a GPU space point inherits from the default
_INT_LIMIT = INT32_MAX


def tolerance(m: int, r: int, s: int) -> float:
    """Relative L2 tolerance of F(m x m, r x s), from the accuracy table in docs/NOTES-winograd.md."""
    alpha = m + max(r, s) - 1
    tols = {1: 1e-5, 2: 1e-5, 3: 1e-5, 4: 1e-5, 5: 2e-5, 6: 5e-5, 7: 1e-4, 8: 1e-4, 9: 5e-4}
    if alpha not in tols:
        raise ValueError(f"F({m}, {max(r, s)}) has alpha {alpha} > {MAX_ALPHA}: no stated tolerance")
    return tols[alpha]


# Typical relative L2 error per tile size alpha on 3x3 layers (PoCL, ResNet layers, N=2; the upper
# end of docs/NOTES-winograd.md's accuracy table): what the precision rule assumes before a measurement.
_EXPECTED = {4: 7e-7, 5: 2e-6, 6: 3.5e-6, 7: 6e-6, 8: 8e-6, 9: 1e-4}
FP32_MAX_ALPHA = 6  # F(4x4,3x3) and below state FP32-grade accuracy; F(6x6) and F(7x7) are "relaxed"


def expected_error(m: int, r: int, s: int) -> float:
    """Stated typical relative L2 error of F(m x m, r x s)."""
    return _EXPECTED.get(m + max(r, s) - 1, 1e-4)


def precision_class(m: int, r: int = 3) -> str:
    """'fp32' for tile sizes whose error is FP32-grade (alpha <= 6), else 'relaxed'."""
    return "fp32" if m + r - 1 <= FP32_MAX_ALPHA else "relaxed"


def winograd_applies(spec: ConvSpec, m: int, max_alpha: int) -> str | None:
    """Shared restrictions of every Winograd variant (None when ``spec`` is accepted)."""
    if spec.stride != (1, 1):
        return f"Winograd needs stride 1, got {spec.stride}"
    if spec.dilation != (1, 1):
        return f"Winograd needs dilation 1, got {spec.dilation}"
    if m + max(spec.r, spec.s) - 1 > max_alpha:
        return (f"F({m}, {max(spec.r, spec.s)}) has alpha {m + max(spec.r, spec.s) - 1} > "
                f"{max_alpha} (too inaccurate in float32)")
    return None


class WinogradNonFused(Variant):
    """Separate transform kernels around an alpha^2-batched GEMM; workspace U, V and M."""

    family = "winograd"
    residual_ok = True  # its store paths (direct, staged, split) honour Epilogue.residual
    prologue_ok = True  # both input transforms (plain, split) activate the window's in-bounds values
    space_lead = 16  # the default's neighbours (splits, hf, transform choices) lead the space
    gemm_kinds: tuple[str, ...] = ("own", "sgemm")  # values of the ``gemm`` parameter

    def __init__(self, m: int) -> None:
        self.m = m
        self.name = f"winograd_nonfused_f{m}"
        self.specialised = {4: 7, 7: 5}.get(m, 6)
        self.tolerance = tolerance(m, 3, 3)
        self.precision = precision_class(m)

    def expected_error(self, spec: ConvSpec) -> float:
        return expected_error(self.m, spec.r, spec.s)

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """On GPUs, for 3x3 layers of at most 64x64 outputs and N >= 16: F(7x7) first where its
        multiplications (81/49 per output, times the padding to whole tiles) are under 0.8 of
        F(4x4)'s (fewer multiplications, less time); else F(4x4) for outputs of at most 32x32 with
        >= 64 tiles: there its defaults (split GEMM included) beat every fused default; with fewer
        tiles and C >= 128 F(2x2), whose split GEMM fills the GPU where the fused kernel's few blocks
        each run a long channel loop; bigger images stay with fused F(4x4), small ones with few
        channels with fused F(2x2) (docs/NOTES-winograd.md)."""
        if not (device.is_gpu and (spec.r, spec.s) == (3, 3)):
            return self.specialised
        if (self.m == 7 and spec.p * spec.q <= 64 * 64 and spec.n >= 16
                and _work(spec, 7) < 0.8 * _work(spec, 4)):
            return 11
        if spec.p * spec.q <= 32 * 32:
            many = Geometry(spec, 4).tiles >= 64
            if (self.m == 4 and many) or (self.m == 2 and not many and spec.c >= 128):
                return 10
        return self.specialised

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device) or winograd_applies(spec, self.m, MAX_ALPHA)
        if why:
            return why
        if spec.r == spec.s == 1:
            return "1x1 filters: Winograd saves no multiplications"
        g = Geometry(spec, self.m)
        return index_refusal({"transformed input": g.a2 * spec.c * g.tiles,
                              "transformed output": g.a2 * spec.k * g.tiles,
                              "transformed filter": g.a2 * spec.k * spec.c}, _INT_LIMIT)

    # -- parameters -------------------------------------------------------------------------
    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """On GPUs the batched GEMM from the shared generator (``gemm="sgemm"``), which beats the
        family's own kernel on every layer timed. On CPUs the own kernel's small tile, which
        compiles quickly on PoCL. Unsplit GEMMs over >= 128 channels take 16-deep slices (a little
        faster there; slower split or at C=64)."""
        if not device.is_gpu:
            return self._stores(spec, self.own_default(spec, device))
        space = self.sgemm_space(spec, device)
        small = self._small_default(spec, device)
        if small is not None:
            p = small
        else:
            p = self.split_default(spec, device, space[0])
            deep = p.replace(bk=16)
            if p.get("ks", 1) == 1 and spec.c >= 128 and p.bk == 8 and deep in space:
                p = deep
            if self._big_alpha(spec):
                p = p.replace(xi=1, xo=1)
        return self._stores(spec, p.replace(hf=1, lo=1) if self._half_default(spec) else p)

    def _small_default(self, spec: ConvSpec, device: DeviceInfo) -> Params | None:
        """For alpha >= 8 with at least 64 GEMM columns: the 64 x 64 x 16 tile unsplit, or for a
        column count that is a multiple of 96 but not of 64 the 64 x 96 tile in 2 channel slices
        (each tile's splits were slower, except 64 x 96's); with split transforms. None where this
        rule does not apply."""
        t = Geometry(spec, self.m).tiles
        if not self._big_alpha(spec) or t < 64:
            return None
        if t % 96 == 0 and t % 64 and spec.c // 2 >= 32:
            p = self._tile(spec, device, _N96_TILE)
            p = p.replace(ks=2) if p is not None else None
        else:
            p = self._tile(spec, device, _SMALL_TILE)
        return p.replace(xi=1, xo=1) if p is not None else None

    def _big_alpha(self, spec: ConvSpec) -> bool:
        """alpha >= 8 (F(6x6)/F(7x7) with 3x3, F(4x4) with 5x5): where the split transforms,
        hf and the small GEMM tiles were measured to pay."""
        return self.m + max(spec.r, spec.s) - 1 >= 8

    def _tile(self, spec: ConvSpec, device: DeviceInfo, tile: tuple[int, ...]) -> Params | None:
        """The fast sgemm point with (bm, bn, bk, tm, tn) = ``tile``, if the GEMM offers it."""
        keys = ("bm", "bn", "bk", "tm", "tn")
        return next((p for p in self._gemm_tiles(spec, device)
                     if tuple(p[k] for k in keys) == tile), None)

    def _half_default(self, spec: ConvSpec) -> bool:
        """hf=1 (half-transformed filters, :meth:`_half_operand`) by default where U dwarfs the
        GEMM's other operand: alpha >= 8 (H is s/alpha of U) and at most 64 GEMM columns; with more
        columns, or at F(4x4), it is slower. (The same alpha >= 8 defaults take the split
        transforms xi=1, xo=1 of split.py, never slower.) The same layers take lo=1, the L2 order of
        the GEMM's blocks and the transforms' tiles, which loses on layers with more columns
        (docs/NOTES-winograd.md)."""
        return self._big_alpha(spec) and Geometry(spec, self.m).tiles <= 64

    def _stores(self, spec: ConvSpec, p: Params) -> Params:
        """``p`` with so=1 (output tiles stored through shared memory, staged.py) unless each
        tile row is one aligned vector store (m = 2 or 4 and Q a multiple of m), where staging only
        adds shared-memory traffic."""
        if p.get("xo"):
            return p
        return p if self.m in (2, 4) and spec.q % self.m == 0 else p.replace(so=1)

    def split_default(self, spec: ConvSpec, device: DeviceInfo, p: Params) -> Params:
        """``p`` with the channel split ``ks`` (1-4) a wave model prefers, when it saves 15 %.

        Small batches leave the batched GEMM a grid of a wave or two (512@7² N32: 144 blocks of
        128 x 128 for 264 slots); ks splits of the channel loop multiply the blocks, each slice
        writing its own M (read back and summed by the output transform). Model, in SM clocks:
        ceil(blocks * ks / slots) waves of bm*bn*C/ks FMAs at 60 % of 128 FMA/clock shared by
        the resident blocks, plus (ks - 1) extra writes and reads of M at ~15 B/clock per SM."""
        g, shape = Geometry(spec, self.m), self._shape(Geometry(spec, self.m))
        threads = gemm_block(p)[0]
        per_sm = max(1, min(65536 // (threads * 128), 2048 // threads))
        slots = max(device.units, 1) * per_sm
        blocks = gemm_grid(shape, p)[0] * gemm_grid(shape, p)[1] * shape.batch
        m_bytes = 4 * g.a2 * spec.k * g.tiles

        def cost(ks: int) -> float:
            waves = -(-blocks * ks // slots)
            fma = p.bm * p.bn * cdiv(spec.c, ks) * per_sm / (128 * 0.6)
            return waves * fma + (ks - 1) * 2 * m_bytes / (max(device.units, 1) * 15)

        best = min((ks for ks in (1, 2, 3, 4) if ks == 1 or spec.c // ks >= 32), key=cost)
        return p.replace(ks=best) if best > 1 and cost(best) < 0.85 * cost(1) else p

    def own_default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The family's own tiled batched-GEMM kernel (no ``gemm`` key)."""
        if not device.is_gpu:
            return Params(bm=16, bn=16, bk=4, tm=2, tn=2, tb=64)
        bm = 64 if spec.k <= 64 else 128
        return Params(bm=bm, bn=128, bk=8, tm=8, tn=8, tb=128)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """First the default and its neighbours (the tuner times these before sampling the rest):
        the other transform/store choice; on GPUs, for split transforms over at most 128 GEMM
        columns, xt=16 and lo flipped; each channel split (``ks`` 1-4) of the default and, for
        alpha >= 8 with at most 128 GEMM columns, of the default with ``hf`` flipped; the other
        GEMM tiles of :meth:`_alternates`.
        On GPUs the rest is every fast sgemm tile (:meth:`_gemm_tiles`) under the default's
        transform choices, at each split and hf choice, and the own kernel's default; on CPUs
        the own kernel's tiles and every sgemm point."""
        first = self.default(spec, device)
        out = [first, _unset(first.replace(xi=0, xo=0, so=1), "lo", "xt") if first.get("xo") else
               first.replace(so=1 - int(first.get("so", 0)))]
        if device.is_gpu and first.get("xo") and Geometry(spec, self.m).tiles <= 128:
            out += [first.replace(xt=16), _unset(first, "lo") if first.get("lo") else first.replace(lo=1)]
        if not device.is_gpu:
            return list(dict.fromkeys(out + self._cpu_rest(spec, device)))
        splits = [k for k in (1, 2, 3, 4) if k == 1 or spec.c // k >= 32]
        out += [_split(first, k) for k in splits]
        flags = [first]
        if self._big_alpha(spec) and Geometry(spec, self.m).tiles <= 128:
            flags.append(first.replace(hf=1 - int(first.get("hf", 0))))
            out += [_split(flags[1], k) for k in splits]
        if not first.get("xo"):
            out.append(first.replace(xi=1, xo=1))
        out += self._alternates(spec, device, first)
        out.append(self.own_default(spec, device))
        keep = {k: v for k, v in first.items() if k in _TRANSFORM_KEYS}
        for tile, base, k in itertools.product(self._gemm_tiles(spec, device), flags, splits):
            out.append(_split(tile.replace(**{**keep, "hf": base.get("hf", 0)}), k))
        return list(dict.fromkeys(p if p.get("hf") else Params({k: v for k, v in p.items() if k != "hf"})
                                  for p in out))

    def _cpu_rest(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The CPU space after its lead: the own kernel's tiles, then every sgemm point."""
        out = [self.own_default(spec, device)]
        for bm, bn, bk, tm, tn in itertools.product((32, 64, 128), (32, 64, 128), (4, 8, 16),
                                                    (4, 8), (4, 8)):
            threads = (bm // tm) * (bn // tn)
            if 32 <= threads <= min(256, device.max_threads) and bm >= tm and bn >= tn:
                out.append(Params(bm=bm, bn=bn, bk=bk, tm=tm, tn=tn, tb=128))
        return out + self.sgemm_space(spec, device)

    def _alternates(self, spec: ConvSpec, device: DeviceInfo, first: Params) -> list[Params]:
        """Other GEMM tiles worth timing early, unsplit and in 2 channel slices, under the
        default's transform choices: the small tile, the sgemm generator's own choice (128-wide
        for large GEMMs) and, for a multiple of 96 GEMM columns, the 96-wide tile."""
        tiles = [self._tile(spec, device, _SMALL_TILE), self.sgemm_default(spec, device)]
        if Geometry(spec, self.m).tiles % 96 == 0:
            tiles.append(self._tile(spec, device, _N96_TILE))
        keep = {k: v for k, v in first.items() if k in _TRANSFORM_KEYS + ("hf",)}
        return [_split(t.replace(**keep), k) for t in tiles if t is not None
                for k in (1, 2) if k == 1 or spec.c // k >= 32]

    def _gemm_tiles(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The sgemm points worth timing on a GPU: register prefetch with double buffering and the
        widest global loads the operands allow (every other pipeline or load width lost wherever
        it was timed, docs/NOTES-winograd.md)."""
        pts = self.sgemm_space(spec, device)
        va, vb = max(p.va for p in pts), max(p.vb for p in pts)
        return [p for p in pts if p.pf and p.db and p.va == va and p.vb == vb]

    def sgemm_default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The sgemm generator's own choice for this GEMM (first point of :meth:`sgemm_space`)."""
        return self.sgemm_space(spec, device)[0]

    def sgemm_space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """sgemm points for M = K, N = T, K = C; float4 loads where rows are 16-byte aligned."""
        g = Geometry(spec, self.m)
        tb = 128 if device.is_gpu else 64
        mnk = (spec.k, g.tiles, spec.c)
        vec = (spec.k % 4 == 0, g.tiles % 4 == 0)
        pts = [gemm_default(*mnk, device, *vec, a_fast="i", b_fast="i")]
        pts += [p for p in gemm_space(*mnk, device, *vec, a_fast="i", b_fast="i") if p != pts[0]]
        return [p.replace(gemm="sgemm", tb=tb) for p in pts]

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        ws = self._workspace(spec, int(params.get("ks", 1)), bool(params.get("hf", 0)))
        return sum(b for _, b in ws)

    def _workspace(self, spec: ConvSpec, ks: int = 1, hf: bool = False) -> tuple[tuple[str, int], ...]:
        """U (or with ``hf`` the half-transformed H), V and M (ks channel slices of M when the
        GEMM is split)."""
        g = Geometry(spec, self.m)
        per_filter = g.ah * spec.s if hf else g.a2
        return (("wino_u", 4 * per_filter * spec.c * spec.k), ("wino_v", 4 * g.a2 * spec.c * g.tiles),
                ("wino_m", 4 * ks * g.a2 * spec.k * g.tiles))

    # -- plan -------------------------------------------------------------------------------
    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        g = Geometry(spec, self.m)
        p = params
        tb, ks, kind, hf, xi, xo, xt, lo = self._checked(spec, p)
        if tb > device.max_threads:
            raise ValueError(f"{self.name}: tb ({tb}) threads per transform block exceed the device's "
                             f"{device.max_threads}")
        if kind != "own":
            gp = Params({k: v for k, v in p.items()
                         if k not in ("gemm", "tb", "ks", "so", "hf", "xi", "xo", "xt", "lo")})
            gemm, grid, block = self._gemm_stage(g, gp, ks, hf, lo)
        else:
            self._check_own(p, device)
            gemm = self._gemm_kernel(g, p)
            grid, block = (cdiv(g.tiles, p.bn), cdiv(spec.k, p.bm), g.a2), gemm.block
        if xi:
            inp = split_input_kernel(g, f"{self.name}: B^T d B (thread per row/column)", xt, lo, prologue)
        else:
            inp = input_kernel(g, tb, self.name, prologue) if prologue.active else self._input_kernel(g, tb)
        out = split_output_kernel(g, epilogue, ks, f"{self.name}: A^T M A (thread per column/row, "
                                  "staged tiles)", xt, lo) if xo \
            else self._output_kernel(g, tb, epilogue, ks, self._staged(g, p))
        kernels = (self._filter_kernel(g, tb, hf), inp, gemm, out)
        tiles_in, tiles_out = spec.c * g.tiles, spec.k * g.tiles
        steps = (
            Launch(kernels[0].name, (cdiv(spec.k * spec.c, tb), 1, 1), (tb, 1, 1), ("w", "wino_u")),
            Launch(inp.name, split_grid(tiles_in, xt, spec.c * lo) if xi else (cdiv(tiles_in, tb), 1, 1), inp.block,
                   ("x", "wino_v") + prologue.buffers()),
            Launch(kernels[2].name, grid, block, ("wino_u", "wino_v", "wino_m")),
            Launch(out.name, split_grid(tiles_out, xt, spec.k * lo) if xo else (cdiv(tiles_out, tb), 1, 1), out.block,
                   ("wino_m",) + out_refs(epilogue)),
        )
        return Plan(self.name, self.family, spec, params, kernels, steps,
                    workspace=self._workspace(spec, ks, hf),
                    tolerance=tolerance(self.m, spec.r, spec.s), epilogue=epilogue, prologue=prologue)

    def _checked(self, spec: ConvSpec, p: Params) -> tuple[int, int, str, bool, bool, bool, int, bool]:
        """(tb, ks, gemm, hf, xi, xo, xt, lo) of ``p``, or a ValueError naming the bad choice."""
        ks, kind, hf = int(p.get("ks", 1)), p.get("gemm", "own"), bool(p.get("hf", 0))
        xi, xo, xt, lo = (bool(p.get("xi", 0)), bool(p.get("xo", 0)), int(p.get("xt", XT)),
                          bool(p.get("lo", 0)))
        if kind not in self.gemm_kinds:
            raise ValueError(f"{self.name}: gemm={kind!r} (expected {' or '.join(map(repr, self.gemm_kinds))})")
        if ks > 1 and (kind == "own" or not 1 < ks <= spec.c):
            raise ValueError(f"{self.name}: ks={ks} needs gemm='sgemm' and at most C slices")
        if hf and kind == "own":
            raise ValueError(f"{self.name}: hf=1 (half-transformed filters) needs gemm='sgemm'")
        if xt not in XT_CHOICES:
            raise ValueError(f"{self.name}: xt ({xt}) must be one of {XT_CHOICES}")
        if lo and not (xi and xo and kind != "own"):
            raise ValueError(f"{self.name}: lo=1 (L2 order) needs xi=1, xo=1 and gemm='sgemm'")
        return p.tb, ks, kind, hf, xi, xo, xt, lo

    def _check_own(self, p: Params, device: DeviceInfo) -> None:
        """ValueError naming the parameter of the own GEMM kernel that does not fit: its tm x tn
        micro-tiles must tile bm x bn exactly (a remainder would leave outputs unwritten), in at
        most the device's threads."""
        for tile, micro in (("bm", "tm"), ("bn", "tn")):
            if p[tile] % p[micro]:
                raise ValueError(f"{self.name}: {micro} ({p[micro]}) must divide {tile} ({p[tile]})")
        threads = (p.bm // p.tm) * (p.bn // p.tn)
        if threads > device.max_threads:
            raise ValueError(f"{self.name}: (bm/tm) * (bn/tn) ({threads}) threads exceed the device's "
                             f"{device.max_threads}")

    def _staged(self, g: Geometry, p: Params) -> bool:
        so = bool(p.get("so", 0))
        if so and staged_bytes(g, p.tb) > STATIC_SHARED_LIMIT:
            raise ValueError(f"{self.name}: so=1 (staged output) of {p.tb} tiles needs "
                             f"{staged_bytes(g, p.tb)} bytes of shared memory (limit {STATIC_SHARED_LIMIT})")
        return so

    def _filter_kernel(self, g: Geometry, tb: int, half: bool = False) -> Kernel:
        """U = G g G^T per (filter, channel); ``half``: only H = G_h g (alpha_h x s floats
        instead of alpha^2, the GEMM's A loads finish the transform; hf=1)."""
        s = g.spec
        rs, ck = s.r * s.s, s.c * s.k
        code = _per_thread(tb, ck, ("k", s.k), "c", "U[e][c][k]: stores coalesced in k")
        code(f"const GLOBAL_PTR float* wp = w + (k * {s.c} + c) * {rs};")
        for i, j in itertools.product(range(s.r), range(s.s)):
            code(f"const float g{i}_{j} = wp[{i * s.s + j}];")
        if half:
            for i, b in itertools.product(range(g.ah), range(s.s)):
                expr = lincomb(g.th.G[i], [f"g{a}_{b}" for a in range(s.r)])
                code(f"u[{(i * s.s + b) * ck} + idx] = {expr};")
            return Kernel("wino_filter_transform", (Buf("w"), Buf("u", readonly=False)),
                          code.text(), (tb, 1, 1), comment=f"{self.name}: H = G g (half)")
        emit_filter_transform(code, g, "g", "u", "gt")
        for i, j in itertools.product(range(g.ah), range(g.aw)):
            code(f"u[{(i * g.aw + j) * ck} + idx] = u{i}_{j};")
        return Kernel("wino_filter_transform", (Buf("w"), Buf("u", readonly=False)),
                      code.text(), (tb, 1, 1), comment=f"{self.name}: G g G^T")

    def _input_kernel(self, g: Geometry, tb: int) -> Kernel:
        return input_kernel(g, tb, self.name)

    def _output_kernel(self, g: Geometry, tb: int, epi: Epilogue, ks: int = 1,
                       staged: bool = False) -> Kernel:
        """A^T M A per (filter, tile); with a split GEMM M is the sum of its ks channel slices;
        ``staged``: tiles stored by the whole block through shared memory (staged.py)."""
        s = g.spec
        total = s.k * g.tiles
        if staged:
            code = Code()
            code(f"const int lid = LOCAL_ID(0), idx = GROUP_ID(0) * {tb} + lid;",
                 f"const int t = idx % {g.tiles}, k = idx / {g.tiles};",
                 f"const int ri = idx < {total} ? idx : {total - 1};  // rows past the end read the last")
            at = "ri"
        else:
            code = _per_thread(tb, total, ("t", g.tiles), "k")
            at = "idx"
        for i, j in itertools.product(range(g.ah), range(g.aw)):
            terms = " + ".join(f"mw[{(z * g.a2 + i * g.aw + j) * total} + {at}]" for z in range(ks))
            code(f"const float m{i}_{j} = {terms};")
        emit_output_transform(code, g, "m", "o", "mt")
        if staged:
            emit_staged_output(code, g, tb, total, epi, "o", "k", "t", f"idx < {total}")
        else:
            emit_tile_origin(code, g, "t")
            emit_output_store(code, g, epi, "o", "k", "1")
        return Kernel("wino_output_transform", (Buf("mw"),) + out_args(epi), code.text(),
                      (tb, 1, 1), helpers=STORE2_HELPER,
                      comment=f"{self.name}: A^T M A" + (" (staged tiles)" if staged else ""))

    def _gemm_kernel(self, g: Geometry, p: Params) -> Kernel:
        """M[e] = U[e]^T V[e]: bm x bn block tile, tm x tn per thread, bk channels per stage."""
        s = g.spec
        kk, tt, cc = s.k, g.tiles, s.c
        nx, ny = p.bn // p.tn, p.bm // p.tm
        nt = nx * ny
        code = Code()
        code(f"SHARED float As[{p.bk * p.bm}];  // U tile: bk channels x bm filters",
             f"SHARED float Bs[{p.bk * p.bn}];  // V tile: bk channels x bn tiles",
             f"const int t0 = GROUP_ID(0) * {p.bn}, k0 = GROUP_ID(1) * {p.bm}, e = GROUP_ID(2);",
             f"const int tx = LOCAL_ID(0), ty = LOCAL_ID(1), tid = ty * {nx} + tx;",
             f"const GLOBAL_PTR float* ue = u + e * {cc * kk};",
             f"const GLOBAL_PTR float* ve = v + e * {cc * tt};")
        for i, j in itertools.product(range(p.tm), range(p.tn)):
            code(f"float acc{i}_{j} = 0.0f;")
        with code.block(f"for (int c0 = 0; c0 < {cc}; c0 += {p.bk})"):
            self._stage_load(code, "As", "ue", p.bk, p.bm, kk, "k0", nt, cc)
            self._stage_load(code, "Bs", "ve", p.bk, p.bn, tt, "t0", nt, cc)
            code("BARRIER();")
            for c in range(p.bk):
                with code.block(f"/* c = {c} */"):
                    for i in range(p.tm):
                        code(f"const float a{i} = As[{c * p.bm} + ty + {i * ny}];")
                    for j in range(p.tn):
                        code(f"const float b{j} = Bs[{c * p.bn} + tx + {j * nx}];")
                    for i, j in itertools.product(range(p.tm), range(p.tn)):
                        code(f"acc{i}_{j} = FMA(a{i}, b{j}, acc{i}_{j});")
            code("BARRIER();")
        code(f"GLOBAL_PTR float* me = mw + e * {kk * tt};")
        for i, j in itertools.product(range(p.tm), range(p.tn)):
            k, t = f"k0 + ty + {i * ny}", f"t0 + tx + {j * nx}"
            code(f"if ({k} < {kk} && {t} < {tt}) me[({k}) * {tt} + {t}] = acc{i}_{j};")
        return Kernel("wino_batched_gemm",
                      (Buf("u"), Buf("v"), Buf("mw", readonly=False)), code.text(),
                      (nx, ny, 1), comment=f"{self.name}: {g.a2} batched GEMMs {p.short()}")

    def _gemm_stage(self, g: Geometry, gp: Params, ks: int, hf: bool,
                    lo: bool) -> tuple[Kernel, Dim3, Dim3]:
        """The batched GEMM from a shared generator (``gemm`` other than "own"): kernel, grid and
        block. The hook of the tensor-core variants (kernels/tensorcore/sm80/mma_variants.py), which swap the
        generator and keep everything else."""
        return (self._sgemm_kernel(g, gp, ks, hf, lo), gemm_grid(self._shape(g, ks), gp),
                gemm_block(gp))

    @staticmethod
    def _shape(g: Geometry, ks: int = 1) -> GemmShape:
        return GemmShape(g.spec.k, g.tiles, g.spec.c, batch=g.a2, ksplit=ks)

    def _sgemm_kernel(self, g: Geometry, p: Params, ks: int = 1, half: bool = False,
                      l2_order: bool = False, gen: GemmGen = gemm_kernel, label: str = "sgemm") -> Kernel:
        """M[e] = U[e]^T V[e] by the shared generator: A (i = k, c) = U[e][c][k] and
        B (c, i = t) = V[e][c][t] are both contiguous along i, so consecutive threads walk i
        (float4 loads when K resp. T is a multiple of 4); ``bz`` is the batch e. ``half``: A is
        formed from the half-transformed filters (:meth:`_half_operand`). ``l2_order`` (lo=1):
        the last tiles first, every batch of a tile block together (the tile-major input
        transform wrote those last, so they are still in L2; the output transform then starts on
        the first tiles, which this GEMM wrote last)."""
        s = g.spec
        kk, tt, cc = s.k, g.tiles, s.c

        def operand(ptr: str, ld: int) -> Operand:
            def load(t: str, k: str, d: str) -> list[str]:
                return [f"{d} = {ptr}[({k}) * {ld} + {t}_i];"]

            def vload(t: str, k: str, d: str) -> list[str]:
                return [f"{d} = VLOAD4(0, {ptr} + ({k}) * {ld} + {t}_i);"]

            return Operand(load=load, fast="i", vload=vload if ld % 4 == 0 else None)

        def put(m: str, t: str, v: str) -> list[str]:
            return [f"me[({m}) * {tt} + {t}_i] = {v};"]

        def vput(m: str, t: str, vs: list[str]) -> list[str]:
            return [f"VSTORE4(MAKE_FLOAT4({', '.join(vs)}), 0, me + ({m}) * {tt} + {t}_i);"]

        a, prelude = self._half_operand(g) if half else (
            operand("ue", kk), (f"const GLOBAL_PTR float* ue = u + bz * {cc * kk};  // U[e]: C x K",))
        prelude += (f"const GLOBAL_PTR float* ve = v + bz * {cc * tt};  // V[e]: C x T",
                    f"GLOBAL_PTR float* me = mw + (kz * {g.a2} + bz) * {kk * tt};"
                    "  // M[e] (of channel slice kz): K x T")
        return gen("wino_batched_sgemm", self._shape(g, ks), p, a,
                   operand("ve", tt), Store(put=put, vput=vput if tt % 4 == 0 else None),
                   (Buf("u"), Buf("v"), Buf("mw", readonly=False)), prelude,
                   comment=f"{self.name}: {g.a2} batched GEMMs ({label}"
                   + (", A = G_w H" if half else "") + f") {p.short()}"
                   + (f", channels in {ks} slices" if ks > 1 else ""),
                   n_last_first=l2_order)

    @staticmethod
    def _half_operand(g: Geometry) -> tuple[Operand, tuple[str, ...]]:
        """A operand that finishes the filter transform (hf=1): U[i, j] = sum_b G_w[j][b] H[i][b],
        s loads of H and s FMAs per element; the batch's coefficients G_w[j][b] are picked once
        per block. Saves the filter transform writing alpha^2 floats per filter (and the GEMM
        reading them) at the price of s-fold A loads, mostly L2 hits (H is s/alpha_w of U)."""
        s = g.spec
        kk, bs = s.k, range(s.s)

        def load(t: str, k: str, d: str) -> list[str]:
            return [f"{d} = " + " + ".join(f"gj{b} * hp{b}[({k}) * {kk} + {t}_i]" for b in bs) + ";"]

        def vload(t: str, k: str, d: str) -> list[str]:
            lines = [f"const float4 h{b} = VLOAD4(0, hp{b} + ({k}) * {kk} + {t}_i);" for b in bs]
            comps = [" + ".join(f"gj{b} * h{b}.{x}" for b in bs) for x in "xyzw"]
            return ["{", *lines, f"{d} = MAKE_FLOAT4({', '.join(comps)});", "}"]

        prelude = (f"const int hi = bz / {g.aw}, hj = bz % {g.aw};  // batch e = (hi, hj)",
                   *(f"const float gj{b} = {row_select(g.tw.G, b, 'hj')};" for b in bs),
                   *(f"const GLOBAL_PTR float* hp{b} = u + (hi * {s.s} + {b}) * {s.c * kk};"
                     "  // H[i][b]: C x K" for b in bs))
        return Operand(load=load, fast="i", vload=vload if kk % 4 == 0 else None), prelude

    @staticmethod
    def _stage_load(code: Code, dst: str, src: str, bk: int, width: int, ld: int, col0: str,
                    nt: int, rows: int) -> None:
        """Copy a bk x width stage (rows are channels, ``rows`` in all) to shared memory, 0 outside."""
        total = bk * width
        for it in range(cdiv(total, nt)):
            with code.block(f"/* {dst} part {it} */"):
                code(f"const int l = tid + {it * nt};",
                     f"const int rr = l / {width}, cw = l % {width};")
                cond = f"c0 + rr < {rows} && {col0} + cw < {ld}"
                stmt = f"{dst}[l] = ({cond}) ? {src}[(c0 + rr) * {ld} + {col0} + cw] : 0.0f;"
                code(f"if (l < {total}) {stmt}" if total % nt else stmt)


def input_kernel(g: Geometry, tb: int, vname: str, pro: Prologue = Prologue()) -> Kernel:
    """V[e][c][t] = (B^T d B)[e], a thread per (channel, tile); the window's in-bounds values
    activated by ``pro``."""
    s = g.spec
    total = s.c * g.tiles
    code = _per_thread(tb, total, ("t", g.tiles), "c", "V[e][c][t]")
    emit_tile_origin(code, g, "t")
    emit_tile_masks(code, g, "1")
    code(f"const int base = (n * {s.c} + c) * {s.h * s.w} + iy * {s.w} + ix;")
    emit_tile_load(code, g, "x", "base", "d", pro=pro, chan="c")
    emit_input_transform(code, g, "d", "v", "dt")
    for i, j in itertools.product(range(g.ah), range(g.aw)):
        code(f"v[{(i * g.aw + j) * total} + idx] = v{i}_{j};")
    return Kernel("wino_input_transform", (Buf("x"), Buf("v", readonly=False)) + pro_args(pro),
                  code.text(), (tb, 1, 1), comment=f"{vname}: B^T d B")


def _unset(p: Params, *keys: str) -> Params:
    """``p`` without ``keys``."""
    return Params({k: v for k, v in p.items() if k not in keys})


def _split(p: Params, ks: int) -> Params:
    """``p`` with its GEMM cut into ``ks`` channel slices (no ``ks`` key for one)."""
    return p.replace(ks=ks) if ks > 1 else Params({k: v for k, v in p.items() if k != "ks"})


def _work(spec: ConvSpec, m: int) -> float:
    """Element-wise multiplications of F(m x m, 3 x 3) per output, padding to whole tiles included."""
    g = Geometry(spec, m)
    return g.a2 * g.tiles / (spec.n * spec.p * spec.q)


def _per_thread(tb: int, total: int, fast: tuple[str, int], slow: str, note: str = "") -> Code:
    """The transform kernels' prologue: one thread per (slow, fast) pair, ``fast`` varying
    quickest (coalesced), threads past ``total`` leave."""
    name, n = fast
    code = Code()
    code(f"const int idx = GROUP_ID(0) * {tb} + LOCAL_ID(0);",
         f"if (idx >= {total}) return;",
         f"const int {name} = idx % {n}, {slow} = idx / {n};" + (f"  // {note}" if note else ""))
    return code


register(WinogradNonFused(2))
register(WinogradNonFused(4))
register(WinogradNonFused(6))
register(WinogradNonFused(7))
