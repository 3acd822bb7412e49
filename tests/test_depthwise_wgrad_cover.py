"""depthwise_wgrad's blocked form (items of tp x tq outputs): its index space read from the generated
source and checked in NumPy, no compiler needed, on sampled points of the variant's space on small
layers; then the case that failed on an H200, on PoCL and through nvcc.

The model takes the kernel body as the generator writes it: the block's prelude and the item loop's
header lines are evaluated (C integer arithmetic on non-negative values is Python's), every load of
x or dy is found with its guard and address, and the plan's launches give the grid. It checks that

* every item is walked by exactly one thread of one slice, and the items tile the output plane;
* every dy load that is switched on lands on an output of its own item inside the plane, and every
  output of channel k is read exactly once (no column of the next row, nothing past the buffer);
* every x load that is switched on lands in the input row it names, inside the plane;
* every (slice, channel, tap) of the partial filters is stored exactly once, and the slice sum
  covers the filter and adds every slice.

The bug it was written for: ConvNeXt-T's 28x28 7x7 layer, float32 NCHW, items of 4 x 8 with dy read
as float4. Q = 28 is not a multiple of tq = 8, so the last item of a row has columns 28..31; the
second float4 of each of its dy rows was guarded by the row only and read the next row's columns
0..3 (wrong sums at taps s = 0..2 of every channel), and after the plane's last row, past the dy
buffer (NaN on the GPU, where the poisoned next allocation follows: taps r = 0..3 of channel 191).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from dataclasses import dataclass, field
from types import CodeType

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.codegen.meta import cdiv
from convforge.kernels import get_variant
from convforge.params import Params
from convforge.plan import Plan
from convforge.spec import ConvSpec
from helpers import assert_compiles_clean

V = get_variant("depthwise_wgrad")
_COMMENT = re.compile(r"/\*.*?\*/|//.*$")
_UNSIGNED = re.compile(r"\(unsigned\)\(([^()]*)\) < (\d+)u")
_GUARDED = re.compile(r"= (?P<guard>[^?]*) \? (?P<mac>VLOAD4|VLOAD8|LDG)\w*\(")
_IF_LOAD = re.compile(r"^if \((?P<guard>.*)\) (?P<mac>VLOAD4|VLOAD8)\w*\(")
_ROW_IF = re.compile(r"^if \(\(unsigned\)\(y0 \+ (\d+)\) < (\d+)u\)")
_WIDTH = {"VLOAD4": 4, "VLOAD8": 8, "LDG": 1}


def _py(c: str) -> str:
    """A C integer expression of the generated source as a NumPy one (operands non-negative where
    it divides; ``(unsigned)(e) < n`` is 0 <= e < n)."""
    c = _UNSIGNED.sub(r"((0 <= (\1)) & ((\1) < \2))", c)
    c = " & ".join(f"({part.strip()})" for part in c.split("&&"))
    return c.replace("/", "//").replace("min(", "np.minimum(")


@functools.cache
def _compiled(expr: str) -> CodeType:
    return compile(expr, "<generated>", "eval")


def _ev(expr: str, env: dict):  # type: ignore[no-untyped-def]
    """A Python expression of the model evaluated on ``env`` (NumPy arrays or ints)."""
    return eval(_compiled(expr), {"np": np}, env)


def _assign(line: str, env: dict) -> None:
    """``const int a = e1, b = e2;`` evaluated into ``env`` in order."""
    decl = line.removeprefix("const int ").rstrip(";")
    for name, expr in re.findall(r"(\w+) = (.*?)(?=, \w+ = |$)", decl):
        env[name] = _ev(_py(expr), env)


def _args(line: str, start: int) -> str:
    """The argument text of the call whose '(' is at ``start``."""
    depth = 0
    for i in range(start, len(line)):
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        if depth == 0:
            return line[start + 1:i]
    raise AssertionError(f"unbalanced call: {line}")


@dataclass
class Load:
    buf: str  # "x" or "y"
    width: int
    guard: str  # the Python guard ("True" when none)
    addr: str  # the Python address (elements from the buffer's start)
    row: int  # the input row (x: y0 + row) or item row (dy: p0 + row) the address names
    row_guard: str = "True"  # x: the enclosing `if` on the input row


@dataclass
class Blocked:
    """The blocked kernel's body cut into what the model evaluates."""

    prelude: list[str] = field(default_factory=list)
    header: list[str] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    walk: tuple[str, str] = ("", "")  # the item loop's start and step
    stores: list[tuple[int, str, int, int, str]] = field(default_factory=list)  # a chunk's store loop: j's
    # first sum and thread term (j = j0 + lt), bound and step, the store's index
    store_guard: str = "True"


def parse_blocked(body: str) -> Blocked:
    """The prelude, item-loop header, loads and final store of a blocked kernel body (the FMAs,
    the tree and the declarations are skipped)."""
    out = Blocked()
    lines = [_COMMENT.sub("", raw).strip() for raw in body.splitlines()]
    row_guard, in_loop = "True", False
    for line in lines:
        if line.startswith("a") and "FMA(" in line:  # most of the body: a0_0 = FMA(e0, g0_0, a0_0);
            continue
        if line.startswith("for (int it = "):
            m = re.match(r"for \(int it = (.*); it < it1; it \+= (\d+)\)", line)
            assert m, line
            out.walk, in_loop = (m[1], m[2]), True
        elif line.startswith("const int ") and not in_loop:
            out.prelude.append(line)
        elif line.startswith("const int ") and "= it " in line or line.startswith(("const int p0", "const int y0")):
            out.header.append(line)
        elif m := _ROW_IF.match(line):
            row_guard = _py(f"(unsigned)(y0 + {m[1]}) < {m[2]}u")
        elif m := (_GUARDED.search(line) or _IF_LOAD.match(line)):
            addr = _args(line, m.end() - 1).split(", ")[-1]
            buf, _, rest = addr.partition(" + ")
            row = re.search(r"(?:p0|y0) \+ (\d+)", rest)
            assert buf in ("x", "y") and row, line
            out.loads.append(Load(buf, _WIDTH[m["mac"]], _py(m["guard"]), _py(rest), int(row[1]),
                                  row_guard if buf == "x" else "True"))
        elif line.startswith("if (k < "):
            out.store_guard = _py(line[3:].rstrip(" {").strip("()"))
        elif m := re.match(r"for \(int j = (?:(\d+) \+ )?(\w+); j < (\d+); j \+= (\d+)\)", line):
            out.stores.append((int(m[1] or 0), m[2], int(m[3]), int(m[4]), ""))
        elif out.stores and not out.stores[-1][4] and "part_[" in line:  # part[i] = ..., w[i] = ...
            index = _args(line, line.index("(")).split(", ")[1] if line.startswith("ST_") else \
                line.split("[", 1)[1].split("] =")[0]  # ... or ST_F16(w, i, ...)
            out.stores[-1] = (*out.stores[-1][:4], _py(index))
    assert out.loads and out.stores and all(st[4] for st in out.stores) and out.walk[0], "not the blocked form"
    return out


def _env(b: Blocked, bx, tid, by) -> dict:  # type: ignore[no-untyped-def]
    """The prelude's values for blocks bx, threads tid and slices by (broadcast arrays)."""
    env: dict = {"tid": tid, "bx": bx, "by": by}
    for line in b.prelude:
        _assign(line.replace("LOCAL_ID(0)", "tid").replace("GROUP_ID(0)", "bx").replace("GROUP_ID(1)", "by"), env)
    return env


def gaps(plan: Plan) -> list[str]:
    """What the blocked kernel of ``plan`` gets wrong, as sentences (empty: its index space is whole)."""
    spec, prm = plan.spec, plan.params
    b = parse_blocked(plan.kernels[0].body)
    grid, block = plan.steps[0].grid, plan.steps[0].block
    nhwc = spec.layout == "nhwc"
    tq, tp, rs = prm.tq, prm.tp, spec.r * spec.s
    nq, np_ = cdiv(spec.q, tq), cdiv(spec.p, tp)
    items = spec.n * nq * np_
    found: list[str] = []

    # items: each walked by exactly one (slice, thread)
    env = _env(b, 0, np.arange(block[0])[:, None], np.arange(grid[1])[None, :])
    start, step = _ev(_py(b.walk[0]), env), int(b.walk[1])
    walked = np.zeros(items + 1, np.int64)
    it = np.broadcast_to(start, np.broadcast_shapes(np.shape(start), np.shape(env["it1"]))).copy()
    while (live := it < env["it1"]).any():
        np.add.at(walked, np.minimum(it[live], items), 1)
        it += step
    lanes = prm.get("bc", 1)  # NHWC: each of bc channel lanes walks the items
    if (walked[:items] != lanes).any() or walked[items]:
        found.append(f"items walked other than once a lane: {np.flatnonzero(walked[:items] != lanes)[:8].tolist()}")

    # the items tile the plane
    ienv = {**_env(b, 0, 0, 0), "it": np.arange(items)}
    for line in b.header:
        _assign(line, ienv)
    tiles = set(zip(ienv["n"].tolist(), ienv["p0"].tolist(), ienv["q0"].tolist()))
    if tiles != set(itertools.product(range(spec.n), range(0, np_ * tp, tp), range(0, nq * tq, tq))):
        found.append("the items do not tile the output plane")

    cv = prm.get("cv", 1)  # NHWC: a lane's consecutive channels (a load's lanes)
    found += _load_gaps(spec, b, ienv, nhwc, grid[0] * prm.get("bc", 1) * cv, tq, cv)
    found += _store_gaps(spec, b, grid, block, rs * cv)
    found += _sum_gaps(plan, rs)
    return found


def _load_gaps(spec: ConvSpec, b: Blocked, ienv: dict, nhwc: bool, lanes: int, tq: int, cv: int) -> list[str]:
    """Every switched-on load where it means to be; every dy element of a thread's channels k .. k + cv - 1
    read once (k: the first and last thread's, and the last lane's of the first NHWC block)."""
    found: list[str] = []
    ys = (spec.n, spec.p, spec.q, spec.k) if nhwc else (spec.n, spec.k, spec.p, spec.q)
    for k in sorted({0, spec.k - cv, min(lanes, spec.k) - cv}):
        kenv = {**ienv, "k": k, "kk": k, "c": k // spec.kg}
        seen = np.zeros(int(np.prod(ys)) + 1, np.int64)
        for ld in b.loads:
            found += _load_gap(spec, ld, kenv, nhwc, tq, seen, cv)
        plane = seen[:-1].reshape(ys)[:, :, :, k:k + cv] if nhwc else seen[:-1].reshape(ys)[:, k]
        if (plane != 1).any():
            found.append(f"k={k}: {(plane != 1).sum()} dy elements not read exactly once")
    return found


def _unravel(addr: np.ndarray, shape: tuple[int, ...]) -> list[np.ndarray]:
    """The coordinates of flat indices (np.unravel_index, but NumPy 2.4's answers wrong past 8192
    elements of an (n, 1) array)."""
    out = []
    for dim in reversed(shape):
        out.append(addr % dim)
        addr = addr // dim
    return out[::-1]


def _load_gap(spec: ConvSpec, ld: Load, kenv: dict, nhwc: bool, tq: int, seen: np.ndarray, cv: int) -> list[str]:
    """One load over every item: where it is on, all its lanes must land in its own item (dy, each
    counted into ``seen``) or in the input row it names (x); a load of cv NHWC lanes reads channels
    k .. k + cv - 1 of one pixel."""
    k, items = kenv["k"], kenv["it"].shape
    on = np.broadcast_to(_ev(f"({ld.guard}) & ({ld.row_guard})", kenv), items)
    addr = np.broadcast_to(_ev(ld.addr, kenv), items)[on][:, None] + np.arange(ld.width)
    item = {key: kenv[key][on][:, None] for key in ("n", "p0", "q0", "y0")}
    shape = ((spec.n, spec.p, spec.q, spec.k) if nhwc else (spec.n, spec.k, spec.p, spec.q)) if ld.buf == "y" \
        else ((spec.n, spec.h, spec.w, spec.c) if nhwc else (spec.n, spec.c, spec.h, spec.w))
    inside = (addr >= 0) & (addr < np.prod(shape))
    if not inside.all():
        return [f"k={k}: {ld.buf} load of row {ld.row} reads past the buffer in {(~inside).any(1).sum()} items"]
    coord = _unravel(addr, shape)
    n_, ch_, row_, col_ = (coord[0], coord[3], coord[1], coord[2]) if nhwc else coord
    lane = np.arange(ld.width) if nhwc and cv > 1 else 0  # the channel a lane reads past the first
    if nhwc and ld.width != cv:
        return [f"k={k}: {ld.buf} load of row {ld.row} reads {ld.width} channels, the thread sums {cv}"]
    if ld.buf == "y":
        ok = ((n_ == item["n"]) & (ch_ == k + lane) & (row_ == item["p0"] + ld.row)
              & (col_ >= item["q0"]) & (col_ < item["q0"] + tq))
        np.add.at(seen, np.where(ok, addr, seen.size - 1), 1)
    else:
        ok = (n_ == item["n"]) & (ch_ == k // spec.kg + lane) & (row_ == item["y0"] + ld.row)
    if ok.all():
        return []
    i, lane = np.argwhere(~ok)[0]
    return [f"k={k}: {ld.buf} load of row {ld.row} lane {lane} lands outside its item in {(~ok).any(1).sum()} "
            f"items (n={item['n'][i, 0]} p0={item['p0'][i, 0]} q0={item['q0'][i, 0]} reads "
            f"{ld.buf}[{n_[i, lane]}, {ch_[i, lane]}, {row_[i, lane]}, {col_[i, lane]}] in NCHW order)"]


def _store_gaps(spec: ConvSpec, b: Blocked, grid: tuple, block: tuple, rs: int) -> list[str]:
    """Every (slice, channel, tap) of the partial filters (or of dw) stored exactly once; ``rs``: the sums
    a thread holds (taps x its channels)."""
    chunks = [(j0, bound) for j0, _, bound, _, _ in b.stores]
    assert chunks[0][0] == 0 and chunks[-1][1] == rs and all(a[1] == c[0] for a, c in zip(chunks, chunks[1:]))
    written = np.zeros(grid[1] * spec.k * spec.r * spec.s + 1, np.int64)
    for by, (j0, lt, bound, step, index) in itertools.product(range(grid[1]), b.stores):
        env = _env(b, np.arange(grid[0])[:, None], np.arange(block[0])[None, :], by)
        j = j0 + np.broadcast_to(env[lt], (grid[0], block[0])).copy()
        on = np.broadcast_to(_ev(b.store_guard, env), j.shape)
        while (live := on & (j < bound)).any():
            idx = np.broadcast_to(_ev(index.replace("GROUP_ID(1)", "by"), {**env, "j": j}), j.shape)
            np.add.at(written, np.clip(idx[live], 0, written.size - 1), 1)
            j = j + step
    if (written[:-1] != 1).any() or written[-1]:
        return [f"{(written[:-1] != 1).sum()} of {written.size - 1} filter entries not stored exactly once"]
    return []


def _sum_gaps(plan: Plan, rs: int) -> list[str]:
    spec, ns = plan.spec, plan.params.ns
    if ns == 1:
        return []
    body, total = plan.kernels[1].body, spec.k * rs
    # the slice loop and the element of thread t, as written: each (element, slice) term added once
    head = re.search(r"g = t / (\d+), e = GROUP_ID\(0\) \* (\d+) \+ t % (\d+);", body)
    loop = re.search(r"for \(int j = g; j < (\d+); j \+= (\d+)\) acc \+= part\[j \* (\d+) \+ e\];", body)
    if head is None or loop is None or f"if (e < {total})" not in body:
        return ["the slice sum's loop or element index is not where the model reads it"]
    lanes, step = int(head.group(1)), int(loop.group(2))
    seen = np.zeros((total, ns), np.int64)
    for b, t in itertools.product(range(plan.steps[1].grid[0]), range(plan.steps[1].block[0])):
        e = b * int(head.group(2)) + t % int(head.group(3))
        if e < total:
            seen[e, range(t // lanes, int(loop.group(1)), step)] += 1
    if int(loop.group(1)) != ns or int(loop.group(3)) != total or (seen != 1).any():
        return [f"the slice sum does not add {ns} slices over {total} entries"]
    return []


def blocked_points(spec: ConvSpec) -> list[Params]:
    return [prm for prm in V.space(spec, NOMINAL_CUDA) if "tq" in prm and "rb" not in prm]  # not the rolled form


# -- the model -------------------------------------------------------------------------------------------
FAILED = ConvSpec.make(4, 192, 28, 28, 192, 7, 7, 1, 3, groups=192).with_pass("wgrad")  # the H200 failure
SMALL = [ConvSpec.make(1, 3, 12, 12, 3, 3, 3, 1, 1, groups=3),  # Q = 12: tq 8 leaves a half item
         ConvSpec.make(2, 2, 20, 20, 4, 7, 7, 1, 3, groups=2),  # Q = 20, K = 2C
         ConvSpec.make(1, 5, 17, 16, 5, 5, 5, 2, (2, 1, 0, 3), groups=5),  # stride 2, asymmetric pad
         ConvSpec.make(1, 3, 20, 24, 3, 3, 3, 1, 2, 2, groups=3),  # dilation 2
         ConvSpec.make(1, 3, 15, 24, 3, 3, 3, 2, (1, 0, 1, 1), groups=3)]  # stride 2: Q = 12


def _as(spec: ConvSpec, dtype: str, layout: str) -> ConvSpec:
    return ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "layout": layout, "pass": "wgrad"})


def test_model_sees_the_h200_failure() -> None:
    """The failing point: its index space is now whole (before the fix the model named the second
    float4 of each dy row of the items at q0 = 24: the next row's columns 0..3, past the buffer at
    the plane's end)."""
    prm = Params(bt=128, tq=8, tp=4, ns=3)  # the default there when it failed
    assert gaps(V.plan(FAILED, prm, NOMINAL_CUDA)) == []


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_model_sampled_blocked_points_on_small_layers(dtype, layout) -> None:
    """Every 8th blocked point of the space (GPU device) on small odd layers, and in NCHW every
    point of items 8 wide (16-byte dy rows): a few hundred plans, seconds."""
    ran = 0
    for base in SMALL:
        spec = _as(base, dtype, layout)
        for i, prm in enumerate(blocked_points(spec)):
            if i % 8 == 0 or (layout == "nchw" and prm.tq == 8):
                assert gaps(V.plan(spec, prm, NOMINAL_CUDA)) == [], f"[{prm.short()}] {spec.short()}"
                ran += 1
    assert ran > 40


# NHWC layers whose K takes lanes of 4 channels (cv = 4): 8 channels, and 12 with stride 2 and asymmetric pad
CV4 = [ConvSpec.make(2, 8, 13, 11, 8, 3, 3, 1, 1, groups=8),
       ConvSpec.make(1, 12, 17, 16, 12, 3, 3, 2, (2, 1, 0, 3), groups=12),
       ConvSpec.make(1, 8, 9, 12, 8, 2, 3, 1, (0, 1, 1, 0), groups=8)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_model_four_channel_lanes(dtype) -> None:
    """Every 8th cv = 4 point of the space on NHWC layers whose K allows it: each load's four lanes are
    channels k .. k + 3 of one pixel, every sum stored once."""
    ran = 0
    for base in CV4:
        spec = _as(base, dtype, "nhwc")
        for i, prm in enumerate(p for p in blocked_points(spec) if p.get("cv", 1) == 4):
            if i % 8 == 0:
                assert gaps(V.plan(spec, prm, NOMINAL_CUDA)) == [], f"[{prm.short()}] {spec.short()}"
                ran += 1
    assert ran > 20


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_model_load_guarded_rows(layout) -> None:
    """pr = 1 (each input row's guard inside its loads, no branch a row) on every small layer, with and
    without lanes of 4 channels: the same index space as the branch a row."""
    ran = 0
    for base in SMALL + (CV4 if layout == "nhwc" else []):
        spec = _as(base, "float16", layout)
        for i, prm in enumerate(blocked_points(spec)):
            if i % 16 == 0 or prm.get("cv", 1) == 4 and i % 4 == 0:
                prm = Params(**{**dict(prm.items()), "pr": 1})
                assert gaps(V.plan(spec, prm, NOMINAL_CUDA)) == [], f"[{prm.short()}] {spec.short()}"
                ran += 1
    assert ran > 10


def test_model_flags_an_unguarded_vector() -> None:
    """The model is not blind: the same plan with the column guard taken out shows the gap."""
    spec, prm = _as(SMALL[0], "float32", "nchw"), Params(bt=32, tq=8, tp=2, ns=1)
    plan = V.plan(spec, prm, NOMINAL_CUDA)
    body = plan.kernels[0].body.replace(" && q0 + 4 < 12", "")
    assert body != plan.kernels[0].body
    broken = dataclasses.replace(plan, kernels=(dataclasses.replace(plan.kernels[0], body=body), *plan.kernels[1:]))
    found = gaps(broken)
    assert any("y load of row 0 lane 0 lands outside its item" in f for f in found), found


# -- PoCL and nvcc ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, prm", [
    (SMALL[0].with_pass("wgrad"), Params(bt=32, tq=8, tp=2, ns=1)),
    (SMALL[1].with_pass("wgrad"), Params(bt=32, tq=8, tp=4, ns=3)),
    (SMALL[4].with_pass("wgrad"), Params(bt=32, tq=8, tp=2, ns=2)),
], ids=["3x3-q12", "7x7-q20-ns3", "3x3-stride2-q12-ns2"])
def test_ragged_last_item_on_pocl(ocl, spec, prm) -> None:
    """float4 dy rows (tq = 8) on planes whose width is not a multiple of tq, output and workspace
    poisoned: before the column guard rel L2 1e-1 (the next row's dy) and 6e8 (past the buffer)."""
    res = check_plan(V.plan(spec, prm, ocl.device), ocl, seed=3)
    assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", range(len(CV4)))
def test_four_channel_lanes_on_pocl(ocl, case, dtype) -> None:
    """cv = 4 (a load of four channels a pixel, four sums a tap) against float64, output and workspace
    poisoned, with slices (ns > 1: the tree of partial filters) and without."""
    spec = _as(CV4[case], dtype, "nhwc")
    for prm in (Params(bc=2, bs=16, cv=4, tq=4, tp=2, ns=3), Params(bc=1, bs=32, cv=4, tq=2, tp=1, ns=1)):
        res = check_plan(V.plan(spec, prm, ocl.device), ocl, seed=5)
        assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec, prm", [
    (SMALL[1], Params(bc=2, bs=16, tq=4, tp=2, ns=3, pr=1, mb=2)),
    (SMALL[2], Params(bc=1, bs=32, tq=2, tp=2, ns=1, pr=1)),
    (CV4[1], Params(bc=2, bs=16, cv=4, tq=4, tp=2, ns=3, pr=1, mb=4)),
    (SMALL[2], Params(bt=32, tq=8, tp=2, ns=2, pr=1)),
    (SMALL[1], Params(bc=2, bs=64, tq=2, tp=2, ns=2)),
    (CV4[0], Params(bc=2, bs=64, cv=4, tq=2, tp=2, ns=1, pr=1)),
    (SMALL[2], Params(bt=256, tq=4, tp=2, ns=1)),
], ids=["7x7-k2c", "5x5-stride2", "cv4-stride2", "nchw-5x5", "7x7-4-chunks", "cv4-3-chunks", "nchw-4-chunks"])
def test_guarded_rows_and_chunked_tree_on_pocl(ocl, spec, prm, dtype) -> None:
    """pr = 1 (rows guarded load by load; top and bottom rows of the plane outside it), and blocks of 128
    and 256 threads whose slice-end tree takes its sums in chunks of shared memory, against float64,
    output and workspace poisoned."""
    spec = _as(spec, dtype, "nchw" if "bt" in prm else "nhwc")
    res = check_plan(V.plan(spec, prm, ocl.device), ocl, seed=7)
    assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


def test_four_channel_default_compiles_clean(nvcc_ok) -> None:
    """The FP16 NHWC 3x3 default (cv = 4) through nvcc: no spill."""
    spec = _as(ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144), "float16", "nhwc")
    prm = V.default(spec, NOMINAL_CUDA)
    assert prm.get("cv") == 4, prm
    assert_compiles_clean(V, spec, prm, NOMINAL_CUDA)


def test_failed_point_compiles_clean(nvcc_ok) -> None:
    assert_compiles_clean(V, FAILED, Params(bt=128, tq=8, tp=4, ns=3), NOMINAL_CUDA)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("base, want", [
    (ConvSpec.make(32, 192, 28, 28, 192, 7, 7, 1, 3, groups=192), dict(pr=1, mb=3, tp=4)),  # 170 registers
    (ConvSpec.make(32, 384, 14, 14, 384, 7, 7, 1, 3, groups=384), dict(pr=1, mb=4, bc=16)),  # 128 registers
    (ConvSpec.make(64, 240, 28, 28, 240, 5, 5, 1, 2, groups=240), dict(pr=1, mb=4, tq=4)),  # 64 registers
    (ConvSpec.make(64, 480, 14, 14, 480, 5, 5, 1, 2, groups=480), dict(pr=1, mb=3)),  # 85 registers
    (ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144), dict(cv=4)),  # branch a row
], ids=["7x7-28", "7x7-14", "5x5-q28", "5x5-q14", "3x3-s1"])
def test_row_load_defaults_compile_clean(nvcc_ok, base, want, dtype) -> None:
    """The blocked form's NHWC half defaults guard rows load by load (pr = 1) past 3x3 with the launch bound
    the H200 sweep chose, and compile through nvcc without a spill (3x3 at stride 1 keeps a branch a row).
    (The variant's default of 7x7 on 14-row planes is the streamed form: tests/test_depthwise_wgrad_stream.py.)"""
    spec = _as(base, dtype, "nhwc")
    prm = V._blocked_default(spec, NOMINAL_CUDA)
    assert {k: prm.get(k, 0) for k in want} == want and prm.get("pr", 0) == want.get("pr", 0), prm
    assert_compiles_clean(V, spec, prm, NOMINAL_CUDA)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec, prm", [
    (CV4[0], Params(bc=2, bs=16, cv=4, tq=4, tp=2, ns=3, pg=2)),
    (CV4[1], Params(bc=2, bs=16, cv=4, tq=2, tp=2, ns=2, pg=3)),
    (SMALL[3], Params(bc=1, bs=32, tq=2, tp=2, ns=1, pg=2)),
    (SMALL[2], Params(bt=32, tq=8, tp=2, ns=2, pg=2)),
    (SMALL[1], Params(bc=2, bs=16, tq=2, tp=2, ns=3, pg=4)),
], ids=["cv4-pairs", "cv4-stride2-threes", "dilation2-pairs", "nchw-5x5-pairs", "7x7-fours"])
def test_row_groups_on_pocl(ocl, spec, prm, dtype) -> None:
    """pg > 1 (the loads of pg input rows under one branch, each guarded, before their FMAs; rows past the
    plane's top and bottom inside a group) against float64, output and workspace poisoned."""
    spec = _as(spec, dtype, "nchw" if "bt" in prm else "nhwc")
    plan = V.plan(spec, prm, ocl.device)
    assert "/* input rows 0, 1" in plan.kernels[0].body
    res = check_plan(plan, ocl, seed=9)
    assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


def test_row_groups_compile_clean_and_refusals(nvcc_ok) -> None:
    """MobileNet-v2's 144@56 FP16 NHWC default with its rows in pairs, through nvcc without a spill; pg
    past the item's rows or past the register budget refused."""
    spec = _as(ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144), "float16", "nhwc")
    prm = next(p for p in V.space(spec, NOMINAL_CUDA) if p.get("pg", 1) == 2)  # the space's pairs point
    assert_compiles_clean(V, spec, prm, NOMINAL_CUDA)
    with pytest.raises(ValueError, match="pg"):
        V.plan(spec, prm.replace(pg=5), NOMINAL_CUDA)


# NHWC half layers whose K would leave a tenth idle in blocks of 32: all K in one block of lanes (of 4 channels
# on stride-1 3x3, of one channel up to 5x5)
WHOLE = [ConvSpec.make(2, 24, 13, 11, 24, 3, 3, 1, 1, groups=24),  # 6 lanes x 16 threads
         ConvSpec.make(1, 144, 9, 7, 144, 3, 3, 1, (0, 1, 1, 0), groups=144),  # 36 lanes x 8, asymmetric pad
         ConvSpec.make(2, 24, 11, 13, 24, 5, 5, 2, 2, groups=24)]  # 5x5 stride 2: 24 lanes of 1 channel x 4


@pytest.mark.parametrize("case", range(len(WHOLE)))
def test_whole_lanes_default_index_space(case) -> None:
    """The GPU default on layers whose K takes whole lanes (bc = K / 4, not a power of two): every item
    walked once, every load inside its item's window, every sum stored once."""
    spec = _as(WHOLE[case], "float16", "nhwc")
    prm = V._blocked_default(spec, NOMINAL_CUDA)  # small planes: the rolled form is the default (roll tests)
    assert prm.bc == spec.k // prm.get("cv", 1) and prm.get("cv", 1) == (4 if spec.r == 3 else 1), prm
    assert gaps(V.plan(spec, prm, NOMINAL_CUDA)) == [], f"[{prm.short()}] {spec.short()}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", range(len(WHOLE)))
def test_whole_lanes_default_on_pocl(ocl, case, dtype) -> None:
    """The GPU default's whole lanes (6 or 36 lanes of 4 channels, 24 of one) and its one-wave slices,
    run on PoCL against float64, output and workspace poisoned."""
    spec = _as(WHOLE[case], dtype, "nhwc")
    prm = V._blocked_default(spec, NOMINAL_CUDA)
    res = check_plan(V.plan(spec, prm, ocl.device), ocl, seed=11)
    assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


@pytest.mark.parametrize("base, lanes, threads", [
    (ConvSpec.make(64, 32, 112, 112, 32, 3, 3, 1, 1, groups=32), 8, 128),
    (ConvSpec.make(64, 96, 112, 112, 96, 3, 3, 2, 1, groups=96), 8, 128),
    (ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144), 36, 288),
    (ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 2, 1, groups=144), 8, 128),
    (ConvSpec.make(64, 960, 7, 7, 960, 3, 3, 1, 1, groups=960), 8, 128),
    (ConvSpec.make(64, 240, 28, 28, 240, 5, 5, 1, 2, groups=240), 32, 256),
    (ConvSpec.make(64, 72, 56, 56, 72, 5, 5, 2, 2, groups=72), 72, 288),
    (ConvSpec.make(64, 960, 7, 7, 960, 5, 5, 1, 2, groups=960), 32, 256),
], ids=["32@112", "96@112/2", "144@56", "144@56/2", "960@7", "5x5-240@28", "5x5-72@56/2", "5x5-960@7"])
def test_blocked_default_fills_one_wave(base, lanes, threads) -> None:
    """The NHWC FP16 blocked defaults under a launch bound of mb blocks a compute unit launch one wave:
    at most units x mb blocks, and fewer than one more slice's worth short of it (a grid of 2.01 waves
    ran its last blocks on a few compute units: 144@56 0.064 -> 0.052 ms on the H200)."""
    spec = _as(base, "float16", "nhwc")
    prm = V._blocked_default(spec, NOMINAL_CUDA)
    plan = V.plan(spec, prm, NOMINAL_CUDA)
    step = next(s for s in plan.steps if s.kernel == "wgrad_depthwise")
    blocks, slots = step.grid[0] * step.grid[1], NOMINAL_CUDA.units * prm.mb
    assert prm.bc == lanes and step.block[0] == threads and prm.mb > 1, prm
    assert slots - step.grid[0] < blocks <= slots, (prm.short(), step.grid, slots)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("base, want", [
    (ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144), (36, 8, 2, 264)),
    (ConvSpec.make(64, 72, 56, 56, 72, 5, 5, 2, 2, groups=72), (72, 4, 3, 396)),
], ids=["3x3-144@56", "5x5-72@56/2"])
def test_whole_lanes_default_compiles_clean(nvcc_ok, base, want, dtype) -> None:
    """MobileNet-v2's 144@56 (36 lanes of 4 channels x 8 threads under a bound of 2 blocks: 96 registers)
    and MobileNet-v3's 72@56/2 5x5 (72 lanes x 4 under 3 blocks) half NHWC defaults through nvcc without
    a spill."""
    spec = _as(base, dtype, "nhwc")
    prm = V.default(spec, NOMINAL_CUDA)
    assert (prm.bc, prm.bs, prm.mb, prm.ns) == want, prm
    assert_compiles_clean(V, spec, prm, NOMINAL_CUDA)


@pytest.mark.parametrize("base, want", [
    (ConvSpec.make(64, 32, 112, 112, 32, 3, 3, 1, 1, groups=32), (128, 9, 37)),
    (ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144), (128, 9, 8)),
    (ConvSpec.make(64, 960, 7, 7, 960, 3, 3, 1, 1, groups=960), (128, 9, 1)),
    (ConvSpec.make(64, 72, 56, 56, 72, 5, 5, 2, 2, groups=72), (128, 5, 9)),
    (ConvSpec.make(64, 1152, 7, 7, 1152, 5, 5, 1, 2, groups=1152), (64, 10, 1)),
    (ConvSpec.make(32, 96, 56, 56, 96, 7, 7, 1, 3, groups=96), (64, 8, 11)),
    (ConvSpec.make(32, 384, 14, 14, 384, 7, 7, 1, 3, groups=384), (128, 4, 1)),
    (ConvSpec.make(32, 768, 7, 7, 768, 7, 7, 1, 3, groups=768), (64, 8, 1)),
    (ConvSpec.make(64, 384, 14, 14, 384, 3, 3, 1, 1, groups=384), (256, 4, 1)),
    (ConvSpec.make(64, 240, 28, 28, 240, 5, 5, 1, 2, groups=240), (256, 2, 1)),
    (ConvSpec.make(64, 576, 14, 14, 576, 3, 3, 1, 1, groups=576), (128, 9, 2)),
], ids=["32@112", "144@56", "960@7", "5x5-72@56/2", "5x5-1152@7", "7x7-96@56", "7x7-384@14", "7x7-768@7",
        "384@14", "5x5-240@28", "576@14"])
def test_nchw_half_default_takes_the_fewest_waves(base, want) -> None:
    """NCHW half defaults: blocks of 128 or 64 threads under a bound of 9 (3x3), 5 / 10 (5x5) or 4 / 8
    (7x7) blocks, whichever launches fewer waves (then fills more), sliced to one wave (H200 A/B: 144@56
    0.0654 -> 0.0469 ms, 7x7 768@7 0.0328 -> 0.0207); 3x3 and 5x5 one slice of 256 threads where one
    wave of them holds every channel at half its slots or more (384@14 0.0188 -> 0.0162, 240@28 0.0598 ->
    0.0549); 576@14 does not fit one wave of 256."""
    spec = _as(base, "float16", "nchw")
    prm = V.default(spec, NOMINAL_CUDA)
    assert (prm.bt, prm.mb, prm.ns) == want, prm
    step = next(s for s in V.plan(spec, prm, NOMINAL_CUDA).steps if s.kernel == "wgrad_depthwise")
    slots = NOMINAL_CUDA.units * prm.mb
    assert step.grid[0] <= max(slots, spec.k), (prm.short(), step.grid, slots)


def test_nchw_half_default_leaves_float32_and_large_filters() -> None:
    """float32 NCHW keeps the simple form and filters past 7x7 the blocked rule without a bound."""
    big = ConvSpec.make(8, 64, 28, 28, 64, 9, 9, 1, 4, groups=64)
    f32 = V.default(_as(big, "float32", "nchw"), NOMINAL_CUDA)
    assert "tq" not in f32 and "mb" not in f32, f32
    assert "mb" not in V.default(_as(big, "float16", "nchw"), NOMINAL_CUDA)


# NCHW half layers of odd shapes under the GPU default: N = 1, prime channels and planes, stride 2 and 4,
# asymmetric padding, a multiplier of 2
NCHW_HALF = [ConvSpec.make(1, 13, 11, 9, 13, 3, 3, 2, (0, 1, 1, 0), groups=13),  # bt 128 under 9 blocks
             ConvSpec.make(2, 7, 17, 13, 14, 5, 5, 1, 2, groups=7),  # K = 2C, 5x5
             ConvSpec.make(1, 5, 23, 19, 5, 7, 7, 4, (3, 2, 1, 3), groups=5)]  # 7x7 stride 4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", range(len(NCHW_HALF)))
def test_nchw_half_default_on_pocl(ocl, case, dtype) -> None:
    """The NCHW half GPU default (its bound and one-wave slices) run on PoCL against float64, output and
    workspace poisoned."""
    spec = _as(NCHW_HALF[case], dtype, "nchw")
    prm = V.default(spec, NOMINAL_CUDA)
    assert prm.get("mb", 1) > 1, prm
    res = check_plan(V.plan(spec, prm, ocl.device), ocl, seed=13)
    assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


@pytest.mark.parametrize("base", [
    ConvSpec.make(1, 11, 13, 9, 11, 3, 3, 2, (0, 1, 1, 0), groups=11),  # N = 1, prime C, stride 2, asym pad
    ConvSpec.make(2, 4, 17, 13, 8, 5, 5, 1, 2, groups=4),  # K = 2C = 8, 5x5
], ids=["3x3", "5x5"])
def test_nchw_half_one_slice_on_pocl(ocl, base) -> None:
    """The one-slice default (256 threads, no slice sum) on a device of 4 compute units, where one wave
    of such blocks holds every channel at half its slots or more (16 slots at 3x3, 8 at 5x5): checked
    on PoCL against float64, output poisoned."""
    small = dataclasses.replace(NOMINAL_CUDA, units=4)
    for dtype in ("float16", "bfloat16"):
        spec = _as(base, dtype, "nchw")
        prm = V.default(spec, small)
        assert (prm.bt, prm.ns) == (256, 1), prm
        res = check_plan(V.plan(spec, prm, ocl.device), ocl, seed=17)
        assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("base", [
    ConvSpec.make(64, 192, 28, 28, 192, 3, 3, 1, 1, groups=192),  # 56 registers unbounded: the 3x3 bound
    ConvSpec.make(64, 240, 28, 28, 240, 5, 5, 1, 2, groups=240),
    ConvSpec.make(32, 192, 28, 28, 192, 7, 7, 1, 3, groups=192),
    ConvSpec.make(64, 384, 14, 14, 384, 3, 3, 1, 1, groups=384),  # one slice of 256 under 4 blocks: 64
], ids=["3x3-192@28", "5x5-240@28", "7x7-192@28", "3x3-384@14"])
def test_nchw_half_default_compiles_clean(nvcc_ok, base, dtype) -> None:
    """The NCHW half defaults' bounds (56, 96 and 128 registers; one slice of 256 threads: 64 and 128) leave
    ptxas without a spill."""
    spec = _as(base, dtype, "nchw")
    assert_compiles_clean(V, spec, V.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
