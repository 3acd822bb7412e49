"""Metacode shared by the Winograd kernels: tile geometry, predicated tile loads, output stores.

Tiles of all images form one index t in [0, N * tiles_h * tiles_w) (Nervana's superblocking: the
GEMM's "N" dimension is spatial tiles of every image together, so a batch of 1 still gives
tiles_h * tiles_w columns of work). Edges are handled by predication: an input outside the image
(padding) reads as 0, an output outside P x Q is not stored; callers never pad.
"""

from __future__ import annotations

from dataclasses import dataclass

from convforge.codegen.meta import Code, cdiv
from convforge.kernels.winograd.matrices import Transform, emit_2d, winograd
from convforge.plan import Epilogue, Prologue
from convforge.spec import ConvSpec


@dataclass(frozen=True)
class Geometry:
    """Tile sizes of F(m x m, r x s) on one spec."""

    spec: ConvSpec
    m: int

    @property
    def th(self) -> Transform:
        return winograd(self.m, self.spec.r)

    @property
    def tw(self) -> Transform:
        return winograd(self.m, self.spec.s)

    @property
    def ah(self) -> int:
        return self.m + self.spec.r - 1

    @property
    def aw(self) -> int:
        return self.m + self.spec.s - 1

    @property
    def a2(self) -> int:
        """alpha^2: the number of element-wise products per tile (the GEMM batch count)."""
        return self.ah * self.aw

    @property
    def tiles_h(self) -> int:
        return cdiv(self.spec.p, self.m)

    @property
    def tiles_w(self) -> int:
        return cdiv(self.spec.q, self.m)

    @property
    def tiles(self) -> int:
        """T = N * tiles_h * tiles_w: the GEMM column count."""
        return self.spec.n * self.tiles_h * self.tiles_w


def emit_tile_origin(code: Code, g: Geometry, t: str, sfx: str = "") -> None:
    """Declare n{sfx}, iy{sfx}, ix{sfx} (input origin) and oy{sfx}, ox{sfx} (output origin) of tile t."""
    per_img = g.tiles_h * g.tiles_w
    code(f"const int n{sfx} = ({t}) / {per_img};",
         f"const int ty{sfx} = (({t}) % {per_img}) / {g.tiles_w};",
         f"const int tx{sfx} = ({t}) % {g.tiles_w};",
         f"const int oy{sfx} = ty{sfx} * {g.m}, ox{sfx} = tx{sfx} * {g.m};",
         f"const int iy{sfx} = oy{sfx} - {g.spec.pad[0]}, ix{sfx} = ox{sfx} - {g.spec.pad[2]};")


def emit_tile_masks(code: Code, g: Geometry, ok: str, sfx: str = "") -> None:
    """Row and column validity bits of the alpha x alpha input window of a tile (0 when not ``ok``)."""
    h, w = g.spec.h, g.spec.w
    rows = " | ".join(f"(((unsigned)(iy{sfx} + {i}) < {h}u) << {i})" for i in range(g.ah))
    cols = " | ".join(f"(((unsigned)(ix{sfx} + {j}) < {w}u) << {j})" for j in range(g.aw))
    code(f"const unsigned rmask{sfx} = ({ok}) ? ({rows}) : 0u;",
         f"const unsigned cmask{sfx} = {cols};")


def emit_tile_load(code: Code, g: Geometry, src: str, base: str, dst: str, sfx: str = "",
                   decl: bool = True, cond: str = "", pro: Prologue = Prologue(), chan: str = "") -> None:
    """Load the tile window into ``dst{i}_{j}``; ``base`` is the offset of (n, c, iy, ix) in ``src``.

    Masked-off elements read 0 (padding, image edges, tiles or channels past the end); the others
    are activated by ``pro`` (at channel ``chan``).
    """
    w = g.spec.w
    for i in range(g.ah):
        for j in range(g.aw):
            pred = f"((rmask{sfx} >> {i}) & (cmask{sfx} >> {j}) & 1u)"
            if cond:
                pred = f"({cond}) && {pred}"
            off = f"{base} + {i * w + j}"
            lhs = f"float {dst}{i}_{j}" if decl else f"{dst}{i}_{j}"
            code(f"{lhs} = {pred} ? {pro.apply(f'{src}[{off}]', chan)} : 0.0f;")


def emit_tile_copy(code: Code, g: Geometry, src: str, dst: str, stride: int, mask: str) -> None:
    """As ``emit_tile_load``, but each element goes by COPY1_ASYNC to shared memory at
    ``dst + e * stride`` (e = i * alpha_w + j) instead of a register, so the window is in flight
    while the caller computes and costs no registers. ``src`` points at the window's origin and
    ``mask`` (``emit_window_mask``) says which elements exist; the others read as 0."""
    w = g.spec.w
    for i in range(g.ah):
        for j in range(g.aw):
            e = i * g.aw + j
            code(f"COPY1_ASYNC({dst}, {e * stride}, {src}, {i * w + j}, {mask}, {e});")


def emit_window_mask(code: Code, g: Geometry, name: str, sfx: str = "") -> None:
    """``name``: bit i * alpha_w + j set when element (i, j) of the window is inside the image
    (from ``emit_tile_masks``' row and column bits); alpha^2 <= 64."""
    assert g.a2 <= 64
    code(f"U64 {name} = 0;")
    with code.block(f"for (int i = 0; i < {g.ah}; ++i)"):
        code(f"if ((rmask{sfx} >> i) & 1u) {name} |= (U64)cmask{sfx} << (i * {g.aw});")


def emit_input_transform(code: Code, g: Geometry, src: str, dst: str, tmp: str) -> None:
    """dst = B_h^T src B_w as straight-line code (integer coefficients, zeros skipped)."""
    code(*emit_2d(g.th.BT, g.tw.BT, src, dst, tmp))


def emit_filter_transform(code: Code, g: Geometry, src: str, dst: str, tmp: str) -> None:
    """dst = G_h src G_w^T."""
    code(*emit_2d(g.th.G, g.tw.G, src, dst, tmp))


def emit_output_transform(code: Code, g: Geometry, src: str, dst: str, tmp: str) -> None:
    """dst = A_h^T src A_w (m x m outputs)."""
    code(*emit_2d(g.th.AT, g.tw.AT, src, dst, tmp))


def emit_output_store(code: Code, g: Geometry, epi: Epilogue, src: str, k: str, ok: str,
                      sfx: str = "") -> None:
    """Store the m x m outputs ``src{i}_{j}`` of tile (n, oy, ox) for channel k, predicated.

    When Q is a multiple of m (and m is 2 or 4) a full row of the tile is one aligned vector
    store; otherwise each output is stored on its own under its bound.
    """
    s = g.spec
    m = g.m
    code(f"const int ybase{sfx} = ((n{sfx} * {s.k} + ({k})) * {s.p} + oy{sfx}) * {s.q} + ox{sfx};")
    with code.block(f"if ({ok})"):
        for i in range(m):
            row_ok = f"oy{sfx} + {i} < {s.p}" if s.p % m else ""
            vals = [epi.apply(f"{src}{i}_{j}", k, f"ybase{sfx} + {i * s.q + j}") for j in range(m)]
            if m in (2, 4) and s.q % m == 0:
                vec = "float2" if m == 2 else "float4"
                stmt = _vector_store(vec, f"y + ybase{sfx} + {i * s.q}", vals)
                code(f"if ({row_ok}) {stmt}" if row_ok else stmt)
                continue
            for j in range(m):
                conds = [c for c in (row_ok, f"ox{sfx} + {j} < {s.q}" if s.q % m else "") if c]
                stmt = f"y[ybase{sfx} + {i * s.q + j}] = {vals[j]};"
                code(f"if ({' && '.join(conds)}) {stmt}" if conds else stmt)


# The dialect has no float2 token; this helper macro spells an aligned 8-byte store in both C
# dialects (the preprocessor runs in both compilers), so pairs of outputs go out as one STG.64.
STORE2_HELPER = """#ifdef __OPENCL_VERSION__
#define CF_STORE2(p, a, b) vstore2((float2)((a), (b)), 0, (p))
#else
#define CF_STORE2(p, a, b) (*(float2*)(p) = make_float2((a), (b)))
#endif"""


def _vector_store(vec: str, ptr: str, vals: list[str]) -> str:
    """An aligned float2/float4 store (float2 through the CF_STORE2 helper macro)."""
    if vec == "float4":
        return f"VSTORE4(MAKE_FLOAT4({', '.join(vals)}), 0, {ptr});"
    return f"CF_STORE2({ptr}, {vals[0]}, {vals[1]});"
