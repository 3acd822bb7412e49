"""Winograd transform matrices computed exactly, and straight-line C emitted from them.

F(m, r) computes m outputs of a correlation with an r-tap filter from alpha = m + r - 1 inputs:

    y = A^T [ (G g) * (B^T d) ]          (1-D)
    Y = A^T [ (G g G^T) * (B^T d B) ] A  (2-D, nested)

Construction (Cook-Toom, as in Lavin & Gray): pick alpha - 1 finite points a_i plus the point at
infinity. Evaluating a polynomial of n coefficients at the points is the alpha x n matrix E_n with
rows [1, a, a^2, ...] (infinity: [0, ..., 0, 1], the leading coefficient). Linear convolution
s = g * h is then s = V^-1 ((E_r g) * (E_m h)) with V = E_alpha, and the correlation we want is
its transpose: y = E_m^T [ (E_r g) * (V^-T d) ]. So A = E_m, G = E_r, B^T = V^-T. Finally each row i
of B^T is scaled to small integers and row i of G divided by the same factor, so the transform run
most often (the input's) has integer coefficients and G, applied once per call, carries fractions.

All arithmetic is in ``fractions.Fraction``: the matrices are exact, and so are the identities
that the tests check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

Matrix = tuple[tuple[Fraction, ...], ...]

# Points in the order they are taken: small magnitudes first, each with its negative, then
# reciprocal pairs. 0, +-1 are exact and cheap; +-2 and +-1/2 keep the Vandermonde condition
# number lowest among the remaining choices (F(4,3) = Lavin's 0, +-1, +-2; F(6,3) adds +-1/2).
POINTS: tuple[Fraction, ...] = tuple(Fraction(v) for v in (
    0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2), 4, -4, Fraction(1, 4), Fraction(-1, 4)))
MAX_ALPHA = len(POINTS) + 1


@dataclass(frozen=True)
class Transform:
    """Exact matrices of F(m, r): AT (m x alpha), G (alpha x r), BT (alpha x alpha)."""

    m: int
    r: int
    points: tuple[Fraction, ...]
    AT: Matrix
    G: Matrix
    BT: Matrix

    @property
    def alpha(self) -> int:
        return self.m + self.r - 1

    def as_float(self, name: str, dtype: str = "float64") -> object:
        """The named matrix ('AT', 'G', 'BT') as a NumPy array of ``dtype``."""
        import numpy as np

        return np.array([[float(v) for v in row] for row in getattr(self, name)], dtype=dtype)


def _eval_matrix(points: tuple[Fraction, ...], n: int) -> list[list[Fraction]]:
    """alpha x n evaluation matrix at the finite points, plus the row of the point at infinity."""
    rows = [[p ** j for j in range(n)] for p in points]
    rows.append([Fraction(0)] * (n - 1) + [Fraction(1)])
    return rows


def _inverse(a: list[list[Fraction]]) -> list[list[Fraction]]:
    """Exact Gauss-Jordan inverse."""
    n = len(a)
    aug = [list(row) + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(a)]
    for col in range(n):
        piv = next(i for i in range(col, n) if aug[i][col] != 0)
        aug[col], aug[piv] = aug[piv], aug[col]
        inv = 1 / aug[col][col]
        aug[col] = [v * inv for v in aug[col]]
        for i in range(n):
            if i != col and aug[i][col] != 0:
                f = aug[i][col]
                aug[i] = [v - f * w for v, w in zip(aug[i], aug[col])]
    return [row[n:] for row in aug]


def _row_scale(row: list[Fraction]) -> Fraction:
    """Factor that turns ``row`` into coprime integers with a positive leading entry."""
    nz = [v for v in row if v != 0]
    den = math.lcm(*(v.denominator for v in nz))
    num = math.gcd(*(int(v * den) for v in nz))
    scale = Fraction(den, num)
    return -scale if nz[0] < 0 else scale


@cache
def winograd(m: int, r: int, points: tuple[Fraction, ...] | None = None) -> Transform:
    """Exact transform matrices of F(m, r) from the first alpha - 1 ``points`` (default POINTS)."""
    if m < 1 or r < 1:
        raise ValueError(f"F({m}, {r}): m and r must be >= 1")
    alpha = m + r - 1
    pts = tuple(Fraction(p) for p in (points if points is not None else POINTS))[:alpha - 1]
    if len(pts) < alpha - 1:
        raise ValueError(f"F({m}, {r}) needs {alpha - 1} finite points, have {len(pts)}")
    if len(set(pts)) != len(pts):
        raise ValueError(f"interpolation points must be distinct: {pts}")
    a_mat = _eval_matrix(pts, m)
    g_mat = _eval_matrix(pts, r)
    v_inv = _inverse(_eval_matrix(pts, alpha))
    bt = [[v_inv[j][i] for j in range(alpha)] for i in range(alpha)]  # V^-T
    for i in range(alpha):
        sc = _row_scale(bt[i])
        bt[i] = [v * sc for v in bt[i]]
        g_mat[i] = [v / sc for v in g_mat[i]]
    at = [[a_mat[j][i] for j in range(alpha)] for i in range(m)]
    return Transform(m, r, pts, _freeze(at), _freeze(g_mat), _freeze(bt))


def _freeze(rows: list[list[Fraction]]) -> Matrix:
    return tuple(tuple(row) for row in rows)


def matmul(a: Matrix, b: Matrix) -> Matrix:
    """Exact product of two Fraction matrices."""
    cols = list(zip(*b))
    return tuple(tuple(sum((x * y for x, y in zip(row, col)), Fraction(0)) for col in cols)
                 for row in a)


def transpose(a: Matrix) -> Matrix:
    return tuple(zip(*a))


def mults(t: Transform) -> tuple[int, int]:
    """(direct, Winograd) multiplications per m x m output tile of a 2-D r x r filter."""
    return t.m * t.m * t.r * t.r, t.alpha * t.alpha


# -- straight-line C ---------------------------------------------------------------------------

def _literal(v: Fraction) -> str:
    f = float(v)
    if f == int(f) and abs(f) < 1e7:
        return f"{f:.1f}f"
    return f"{f!r}f"


def lincomb(coeffs: tuple[Fraction, ...], names: list[str]) -> str:
    """C expression of sum(c * name), skipping zeros and spelling +-1 as a plain add/subtract."""
    terms: list[str] = []
    for c, nm in zip(coeffs, names):
        if c == 0:
            continue
        mag = abs(c)
        body = nm if mag == 1 else f"{_literal(mag)} * {nm}"
        if not terms:
            terms.append(body if c > 0 else f"-{body}")
        else:
            terms.append(("+ " if c > 0 else "- ") + body)
    return " ".join(terms) if terms else "0.0f"


def paired_lincombs(mat: Matrix, names: list[str], tmp: str) -> tuple[list[str], list[str]]:
    """C for every row of ``mat`` applied to ``names``, with column pairs shared: where column c2
    is column c1 times +-1 in every row (A^T's columns at +-p: p^o and (-p)^o), the pair's sum
    and difference are formed once (``{tmp}s{k}``, ``{tmp}d{k}``) and each row takes one term
    for the pair instead of two. Returns (statements to run first, one expression per row)."""
    cols = len(mat[0])
    free, pairs = list(range(cols)), []
    for c1 in range(cols):
        for c2 in range(c1 + 1, cols):
            if c1 in free and c2 in free and any(row[c1] for row in mat) and \
                    all(abs(row[c2]) == abs(row[c1]) for row in mat):
                pairs.append((c1, c2))
                free.remove(c1)
                free.remove(c2)
    used: set[tuple[int, str]] = set()
    exprs = []
    for row in mat:
        coeffs = [row[c] for c in free]
        vars_ = [names[c] for c in free]
        for k, (c1, c2) in enumerate(pairs):
            if row[c1]:
                kind = "s" if row[c2] == row[c1] else "d"
                used.add((k, kind))
                coeffs.append(row[c1])
                vars_.append(f"{tmp}{kind}{k}")
        exprs.append(lincomb(tuple(coeffs), vars_))
    pre = [f"const float {tmp}{kind}{k} = {names[c1]} {'+' if kind == 's' else '-'} {names[c2]};"
           for k, (c1, c2) in enumerate(pairs) for kind in "sd" if (k, kind) in used]
    return pre, exprs


def row_select(mat: Matrix, col: int, index: str) -> str:
    """C expression of mat[index][col] for a run-time row ``index`` (a chain of selects; the
    caller evaluates it once, outside any loop)."""
    vals = [_literal_signed(row[col]) for row in mat]
    return " : ".join(f"{index} == {i} ? {v}" for i, v in enumerate(vals[:-1])) + f" : {vals[-1]}"


def _literal_signed(v: Fraction) -> str:
    return _literal(v) if v >= 0 else f"-{_literal(-v)}"


def emit_2d(left: Matrix, right: Matrix, src: str, dst: str, tmp: str,
            decl: str = "const float") -> list[str]:
    """Lines computing dst = left . src . right^T for named scalars ``src{i}_{j}``.

    ``left`` is (a x b) and ``right`` (c x d): src is b x d, the result a x c. The row pass first
    (tmp = left . src), then the column pass (dst = tmp . right^T); dst declared with ``decl``
    (empty string to assign to existing variables).
    """
    a, b = len(left), len(left[0])
    c, d = len(right), len(right[0])
    out: list[str] = []
    for i in range(a):
        for j in range(d):
            expr = lincomb(left[i], [f"{src}{k}_{j}" for k in range(b)])
            out.append(f"const float {tmp}{i}_{j} = {expr};")
    for i in range(a):
        for j in range(c):
            expr = lincomb(right[j], [f"{tmp}{i}_{k}" for k in range(d)])
            lhs = f"{decl} {dst}{i}_{j}" if decl else f"{dst}{i}_{j}"
            out.append(f"{lhs} = {expr};")
    return out


def describe(t: Transform) -> str:
    """Human-readable matrices, for docs and ``convforge show``."""
    def fmt(mat: Matrix) -> str:
        return "\n".join("  [" + ", ".join(f"{str(v):>6}" for v in row) + "]" for row in mat)

    pts = ", ".join(str(p) for p in t.points) + ", inf"
    return (f"F({t.m},{t.r}) alpha={t.alpha} points: {pts}\n"
            f"AT =\n{fmt(t.AT)}\nG =\n{fmt(t.G)}\nBT =\n{fmt(t.BT)}")
