"""Fused Winograd F(2x2, 3x3) and F(4x4, 3x3) in openCNN's design.

One block owns bk filters x bn tiles (tiles of all images: superblocking) and loops over the
channels bc at a time:

* filters are transformed once per call by their own kernel into a blocked layout
  U[k block][c block][e][c][k] (zero-padded), so each stage is one contiguous, float4-loaded chunk;
* the block's bn x bc input windows are loaded (predicated: padding and edges read 0), transformed
  in registers (B^T d B, integer coefficients) and written to shared memory as V[e][c][tile];
* the element-wise stage is alpha^2 small GEMMs: lane group ("warp") w owns E = alpha^2 / groups of
  them; each lane an outer-product micro-tile tk x tn read from shared memory with float4 loads;
* double buffering: the next stage's global loads go to registers before the current stage's
  products, and are transformed and stored into the other buffer after them (one barrier a stage);
* the output goes back through shared memory, a round per k-slice, in a row layout whose padding
  is chosen by simulating the warp's bank accesses (conflict-free stores, after openCNN's optSTS64),
  then each thread runs A^T M A for one (filter, tile) pair at a time and stores whole tile rows
  (float2 / float4 when Q allows), consecutive threads on consecutive tiles: coalesced.

Split-C (tuning parameter ``ks`` > 1, grid z): the output transform is linear, so ``ks`` blocks
per (tile block, filter block) each run a slice of the channel stages and store their partial
output A^T M A (no epilogue) to the workspace ``wino_part[ks][N][K][P][Q]``; a reduce kernel sums
the slices and applies bias/ReLU. More, shorter blocks for small P x Q layers with many channels.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from convforge.codegen.dialect import Arg, Buf, Kernel, LocalBuf
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs, pro_args
from convforge.kernels.gemm import elementwise
from convforge.kernels.winograd.nonfused import expected_error, precision_class, tolerance, winograd_applies
from convforge.kernels.winograd.tiles import (
    STORE2_HELPER,
    Geometry,
    emit_filter_transform,
    emit_input_transform,
    emit_output_store,
    emit_output_transform,
    emit_tile_copy,
    emit_tile_load,
    emit_tile_masks,
    emit_tile_origin,
    emit_window_mask,
)
from convforge.params import Params
from convforge.plan import INT32_MAX, DeviceInfo, Epilogue, Launch, Plan, Prologue, Variant
from convforge.spec import ConvSpec

_BANKS = 32
_SPLITS = (2, 4, 8)
# GPU points that also come split over channels (fl=1), on layers with a small unsplit grid, and
# whether uneven slices (a run-time trip count) are offered: the 255-register F(4x4) 4-warp point
# spills 20 bytes with one (ptxas sm_90), so it is split only where ks divides the stages.
_SPLIT_GPU = {2: [(dict(bk=64, bn=32, bc=8, lk=8, ln=4, groups=8), True),
                  (dict(bk=32, bn=32, bc=8, lk=4, ln=8, groups=8), True)],
              4: [(dict(bk=32, bn=16, bc=8, lk=8, ln=4, groups=4), False),
                  (dict(bk=32, bn=16, bc=4, lk=8, ln=4, groups=6), True)]}


# GPU points that ptxas (sm_90, nvcc 13.0) fits into two blocks' share of the register file without
# spilling, offered with that launch bound (mb=2) after every other point: F(2x2) 256 threads at 128
# registers (16 warps per SM instead of 8), F(4x4) 192 threads at 168 with the input windows staged
# by cp.async (ci). Checked on ResNet layers by tests/test_winograd.py; not yet timed on a GPU.
_TWO_BLOCKS = {2: [dict(bk=32, bn=32, bc=8, lk=4, ln=8, groups=8, fl=1),
                   dict(bk=32, bn=32, bc=8, lk=4, ln=8, groups=8, fl=0),
                   dict(bk=32, bn=32, bc=8, lk=4, ln=8, groups=8, fl=0, ca=1),
                   dict(bk=32, bn=32, bc=8, lk=4, ln=8, groups=8, fl=1, ci=1)],
               4: [dict(bk=32, bn=16, bc=8, lk=8, ln=4, groups=6, fl=1, ci=1),
                   dict(bk=32, bn=16, bc=4, lk=8, ln=4, groups=6, fl=1, ci=1),
                   dict(bk=16, bn=32, bc=4, lk=4, ln=8, groups=6, fl=1, ci=1)]}


@dataclass(frozen=True)
class Layout:
    """Derived sizes of one parameter set (all in floats unless named bytes)."""

    g: Geometry
    bk: int
    bn: int
    bc: int
    lk: int
    ln: int
    groups: int
    fl: int = 0  # 1: raw filters in the workspace, G g G^T inside the main loop
    ks: int = 1  # > 1: channel stages split over ks blocks (grid z), partial outputs reduced
    ca: int = 0  # 1: transformed filters copied global -> shared by COPY4_ASYNC (no registers)
    ci: int = 0  # 1: input windows copied raw to a per-thread shared area by COPY1_ASYNC
    mb: int = 0  # > 0: blocks per SM ptxas must leave room for (registers <= 64K / (mb * threads))

    @property
    def cbn(self) -> int:
        """Channel stages (bc channels each, the last one predicated when bc does not divide C)."""
        return cdiv(self.g.spec.c, self.bc)

    @property
    def lanes(self) -> int:
        return self.lk * self.ln

    @property
    def threads(self) -> int:
        return self.lanes * self.groups

    @property
    def e_per_group(self) -> int:
        return self.g.a2 // self.groups

    @property
    def tk(self) -> int:
        return self.bk // self.lk

    @property
    def tn(self) -> int:
        return self.bn // self.ln

    @property
    def vk(self) -> int:
        return min(4, self.tk)

    @property
    def vn(self) -> int:
        return min(4, self.tn)

    @property
    def u_chunk(self) -> int:
        """Transformed filters of one stage: alpha^2 x bc x bk."""
        return self.g.a2 * self.bc * self.bk

    @property
    def w_chunk(self) -> int:
        """Filters of one stage as read from global memory: transformed, or raw 3x3 (fl)."""
        return 9 * self.bc * self.bk if self.fl else self.u_chunk

    @property
    def fl_per_thread(self) -> int:
        """Raw filters (9 scalars each) a thread loads and transforms per stage (fl)."""
        return cdiv(self.bc * self.bk, self.threads) if self.fl else 0

    @property
    def stage(self) -> int:
        return self.u_chunk + self.g.a2 * self.bc * self.bn

    @property
    def kr(self) -> int:
        """Filters per output round (one float4-group of every lane's k values)."""
        return self.lk * self.vk

    @property
    def row_pad(self) -> int:
        return best_pad(self.lk, self.ln, self.vk, self.vn, self.bn)

    @property
    def staging(self) -> int:
        return self.g.a2 * self.kr * (self.bn + self.row_pad)

    @property
    def raw(self) -> int:
        """ci: the per-thread raw input windows, [window][e][thread], after the two stage buffers."""
        return self.in_per_thread * self.g.a2 * self.threads if self.ci else 0

    @property
    def smem_bytes(self) -> int:
        return 4 * max(2 * self.stage + self.raw, self.staging)

    @property
    def in_pairs(self) -> int:
        """(tile, channel) input windows per stage, and per thread."""
        return self.bn * self.bc

    @property
    def in_per_thread(self) -> int:
        return cdiv(self.in_pairs, self.threads)

    @property
    def f4_per_thread(self) -> int:
        """Float4s of transformed filters a thread moves per stage (through registers unless ca)."""
        return 0 if self.fl else cdiv(self.u_chunk // 4, self.threads)

    def why_invalid(self, max_threads: int) -> str | None:
        if self.g.a2 % self.groups:
            return f"alpha^2 = {self.g.a2} not divisible by {self.groups} lane groups"
        if self.bk % self.lk or self.bn % self.ln or self.bk % 4:
            return "bk, bn must split evenly over lanes and bk be a multiple of 4"
        if self.tk % self.vk or self.tn % self.vn:
            return "micro-tile not a multiple of the vector width"
        if self.threads > max_threads:
            return f"{self.threads} threads > {max_threads}"
        if self.ca and self.fl:
            return "ca copies transformed filters (fl = 0); raw taps need G g G^T in registers"
        if not 1 <= self.ks <= self.cbn:
            return f"ks = {self.ks} channel slices for {self.cbn} stages"
        if self.ks > 1 and self.ks * _out_elements(self.g.spec) > INT32_MAX:
            return f"needs 64-bit indexing: {self.ks} split-C partial outputs of {_out_elements(self.g.spec)} elements"
        return None


@functools.cache
def best_pad(lk: int, ln: int, vk: int, vn: int, bn: int) -> int:
    """Row padding (floats) of the output staging buffer with the fewest shared-memory wavefronts
    for one warp's stores, found by simulating 32 banks; 128-bit stores go 8 lanes per phase
    (remembered: a few dozen tile shapes, asked for on every dispatch of a 3x3 layer)."""
    best, best_cost = 0, None
    for pad in range(0, 32, max(vn, 1)):
        cost = 0
        for v in range(vk):
            addrs = []
            for lane in range(lk * ln):
                lkid, lnid = lane // ln, lane % ln
                addrs.append((lkid * vk + v) * (bn + pad) + lnid * vn)
            per_phase = max(1, 32 // vn) if vn > 1 else 32
            for ph in range(0, len(addrs), per_phase):
                banks: dict[int, set[int]] = {}
                for a in addrs[ph:ph + per_phase]:
                    for w in range(vn):
                        banks.setdefault((a + w) % _BANKS, set()).add(a + w)
                cost += max(len(s) for s in banks.values())
        if best_cost is None or cost < best_cost:
            best, best_cost = pad, cost
    return best


class WinogradFused(Variant):
    """Fused F(m x m, 3 x 3): one filter-transform launch, then one fused kernel."""

    family = "winograd"
    residual_ok = True  # its store path and the split reduce honour Epilogue.residual
    prologue_ok = True  # each input window is activated, under its mask, before its transform
    specialised = 9  # set per tile size in __init__

    def __init__(self, m: int) -> None:
        self.m = m
        self.name = f"winograd_fused_f{m}"
        self.specialised = 8 if m == 4 else 9  # measured: F(2x2) fused wins most ResNet layers
        self.tolerance = tolerance(m, 3, 3)
        self.precision = precision_class(m)

    def expected_error(self, spec: ConvSpec) -> float:
        return expected_error(self.m, spec.r, spec.s)

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """F(4x4) first on GPUs above 32x32 outputs (its default beats fused F(2x2) and non-fused
        F(4x4) defaults there); F(2x2) otherwise, and for one image (faster there too, at a sixth
        of F(4x4)'s error)."""
        if self.m == 4 and device.is_gpu and spec.p * spec.q > 32 * 32 and spec.n > 1:
            return 10
        return self.specialised

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why:
            return why
        if (spec.r, spec.s) != (3, 3):
            return f"the fused Winograd kernel is for 3x3 filters, got {spec.r}x{spec.s}"
        why = winograd_applies(spec, self.m, self.m + 2)
        if why:
            return why
        why = self.index_refusal(spec, {"transformed filter": (self.m + 2) ** 2 * spec.k * spec.c})
        if why:
            return why
        if not self.space(spec, device):
            return "no parameter set fits this device's shared memory and threads"
        return None

    # -- parameters -------------------------------------------------------------------------
    def _candidates(self, device: DeviceInfo) -> list[dict[str, int]]:
        if not device.is_gpu:
            if self.m == 2:
                return [dict(bk=8, bn=8, bc=4, lk=2, ln=2, groups=4, fl=0),
                        dict(bk=8, bn=4, bc=3, lk=2, ln=1, groups=8, fl=1),
                        dict(bk=4, bn=8, bc=2, lk=1, ln=4, groups=2, fl=1),
                        dict(bk=8, bn=8, bc=3, lk=2, ln=4, groups=2, fl=1),
                        dict(bk=8, bn=4, bc=5, lk=2, ln=2, groups=4, fl=0, ca=1, ci=1),
                        dict(bk=4, bn=8, bc=3, lk=2, ln=2, groups=2, fl=1, ci=1)]
            return [dict(bk=4, bn=8, bc=2, lk=2, ln=2, groups=6, fl=0),
                    dict(bk=8, bn=4, bc=2, lk=2, ln=1, groups=12, fl=1),
                    dict(bk=4, bn=4, bc=3, lk=1, ln=2, groups=9, fl=1),
                    dict(bk=8, bn=4, bc=3, lk=4, ln=2, groups=4, fl=1),
                    dict(bk=8, bn=8, bc=3, lk=2, ln=4, groups=4, fl=0, ca=1),
                    dict(bk=4, bn=8, bc=2, lk=2, ln=2, groups=3, fl=1, ci=1)]
        # Each GPU point was checked with ptxas (sm_90): 0 spills, registers in NOTES-winograd.md.
        if self.m == 2:  # openCNN: 64 filters x 32 tiles x 8 channels, 8 warps, 8x8 per lane
            base = [dict(bk=64, bn=32, bc=8, lk=8, ln=4, groups=8),
                    dict(bk=64, bn=32, bc=4, lk=8, ln=4, groups=8),
                    dict(bk=32, bn=64, bc=8, lk=4, ln=8, groups=8),
                    dict(bk=32, bn=32, bc=8, lk=4, ln=8, groups=8),
                    # 4 warps x 4 elements, 4x8 per lane: 2 blocks per SM
                    dict(bk=32, bn=32, bc=8, lk=8, ln=4, groups=4),
                    # 32 KB of shared memory: fits OpenCL GPUs' 48 KB local memory (191 registers)
                    dict(bk=32, bn=32, bc=4, lk=4, ln=8, groups=8)]
        else:
            # Default: 4 warps x 9 elements (144 accumulators, 255 registers), 2 blocks per SM
            # (the fastest F(4x4) point on every ResNet layer measured, ahead of the 6-warp one).
            base = [dict(bk=32, bn=16, bc=8, lk=8, ln=4, groups=4),
                    dict(bk=32, bn=16, bc=4, lk=8, ln=4, groups=4),
                    dict(bk=32, bn=16, bc=4, lk=8, ln=4, groups=6),
                    dict(bk=32, bn=16, bc=8, lk=8, ln=4, groups=6),
                    dict(bk=16, bn=32, bc=4, lk=4, ln=8, groups=6),
                    # 45 KB: fits OpenCL GPUs' 48 KB local memory (255 registers, 64 threads)
                    dict(bk=16, bn=16, bc=4, lk=4, ln=4, groups=4)]
        # Raw filters transformed in the loop (fl=1) first (faster than fl=0: fewer bytes to load);
        # the pre-transformed layout (fl=0) only where it does not spill (the
        # 9-element F(4x4) points need fl's fewer registers).
        # Then cp.async staging (sm_80+; a plain copy elsewhere): ca = the pre-transformed filters
        # (no prefetch registers, no transform in the loop), ci = the raw input windows (no
        # prefetch registers; read back from shared memory to be transformed).
        pts = [dict(c, fl=fl) for fl in (1, 0) for c in base] + \
            [dict(c, **x) for x in (dict(fl=0, ca=1), dict(fl=0, ca=1, ci=1), dict(fl=1, ci=1))
             for c in base]
        pts = [p for p in pts if p["fl"] or p["lk"] * p["ln"] * p["groups"] > 128 or self.m == 2]
        return pts + [dict(c, mb=2) for c in _TWO_BLOCKS[self.m]]

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        g = Geometry(spec, self.m)
        out = []
        for cand in self._candidates(device):
            lay = Layout(g, **cand)
            if lay.why_invalid(device.max_threads) or \
                    max(lay.mb, 1) * lay.smem_bytes > device.shared_optin_bytes:
                continue
            out.append(Params(cand))
        return out + self._split_points(g, device, out)

    def _split_points(self, g: Geometry, device: DeviceInfo, base: list[Params]) -> list[Params]:
        """Split-C points (``ks``), after all unsplit ones so defaults stay as they are: on GPUs
        for a few points whose unsplit grid has fewer than three blocks per compute unit (there a
        split fills the GPU), with
        ks in (2, 4, 8) leaving every slice at least two stages; on CPUs for the first two
        points (there to exercise the path, small tiles fill a CPU anyway)."""
        units = max(device.units, 1)
        picks: list[tuple[Params, bool]] = []
        for p in base:
            if not device.is_gpu:
                picks += [(p, True)] if len(picks) < 2 else []
            elif p.get("fl") == 1 and "ci" not in p and "mb" not in p and \
                    cdiv(g.tiles, p.bn) * cdiv(g.spec.k, p.bk) < 3 * units:
                picks += [(p, uneven) for c, uneven in _SPLIT_GPU[self.m]
                          if all(p[k] == v for k, v in c.items())]
        out = []
        for p, uneven in picks:
            cbn = cdiv(g.spec.c, p.bc)
            out += [p.replace(ks=ks) for ks in _SPLITS
                    if cbn >= 2 * ks and (uneven or cbn % ks == 0)]
        return out

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return self.space(spec, device)[0]

    def _layout(self, spec: ConvSpec, p: Params) -> Layout:
        return Layout(Geometry(spec, self.m), p.bk, p.bn, p.bc, p.lk, p.ln, p.groups,
                      int(p.get("fl", 0)), int(p.get("ks", 1)), int(p.get("ca", 0)),
                      int(p.get("ci", 0)), int(p.get("mb", 0)))

    def _workspace(self, lay: Layout) -> tuple[tuple[str, int], ...]:
        s = lay.g.spec
        ws: tuple[tuple[str, int], ...] = (("wino_u", 4 * cdiv(s.k, lay.bk) * lay.cbn * lay.w_chunk),)
        if lay.ks > 1:  # partial outputs of the channel slices, [ks][N][K][P][Q]
            ws += (("wino_part", 4 * lay.ks * _out_elements(s)),)
        return ws

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return sum(b for _, b in self._workspace(self._layout(spec, params)))

    # -- plan -------------------------------------------------------------------------------
    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        lay = self._layout(spec, params)
        why = lay.why_invalid(device.max_threads)
        if why:
            raise ValueError(f"{self.name}: {params.short()}: {why}")
        g = lay.g
        kpad, cpad = cdiv(spec.k, lay.bk) * lay.bk, cdiv(spec.c, lay.bc) * lay.bc
        ftb = 128 if device.is_gpu else 32
        fk = _filter_kernel(lay, ftb, self.name)
        mk = _main_kernel(lay, epilogue, self.name, prologue)
        grid = (cdiv(g.tiles, lay.bn), cdiv(spec.k, lay.bk), lay.ks)
        out = ("wino_part",) if lay.ks > 1 else out_refs(epilogue)
        kernels: tuple[Kernel, ...] = (fk, mk)
        steps: tuple[Launch, ...] = (
            Launch(fk.name, (cdiv(kpad * cpad, ftb), 1, 1), (ftb, 1, 1), ("w", "wino_u")),
            Launch(mk.name, grid, (lay.threads, 1, 1), ("x", "wino_u") + out + prologue.buffers()))
        if lay.ks > 1:
            rk, rgrid = _reduce_kernel(spec, lay.ks, epilogue)
            kernels += (rk,)
            steps += (Launch(rk.name, rgrid, rk.block, ("wino_part",) + out_refs(epilogue)),)
        return Plan(self.name, self.family, spec, params, kernels, steps,
                    workspace=self._workspace(lay), tolerance=self.tolerance, epilogue=epilogue, prologue=prologue)


def _out_elements(s: ConvSpec) -> int:
    return s.n * s.k * s.p * s.q


def _reduce_kernel(s: ConvSpec, ks: int, epi: Epilogue) -> tuple[Kernel, tuple[int, int, int]]:
    """y = epilogue(sum of the ks partial outputs), one thread per output element."""
    total = _out_elements(s)
    sums = " + ".join(f"part[{j * total} + e]" for j in range(ks))
    body = [f"y[e] = {epi.apply(f'({sums})', f'(e / {s.p * s.q}) % {s.k}', 'e')};"]
    return elementwise("wino_fused_reduce", total, (Buf("part"),) + out_args(epi), body,
                       f"sum of {ks} split-C partial outputs")


def _filter_kernel(lay: Layout, tb: int, vname: str) -> Kernel:
    """U[kb][cb][e][cc][kk] = (G g G^T)[e] of filter kb*bk+kk, channel cb*bc+cc; zero padding.

    With ``fl`` the same blocked layout holds the raw taps (9 instead of alpha^2 floats per
    filter: 1.8x less to read for F(2x2), 4x for F(4x4)); the main loop transforms them.
    """
    g, s = lay.g, lay.g.spec
    kb_n, cb_n = cdiv(s.k, lay.bk), cdiv(s.c, lay.bc)
    kpad, total = kb_n * lay.bk, kb_n * lay.bk * cb_n * lay.bc
    code = Code()
    code(f"const int idx = GROUP_ID(0) * {tb} + LOCAL_ID(0);",
         f"if (idx >= {total}) return;",
         f"const int k = idx % {kpad}, c = idx / {kpad};",
         f"const int kb = k / {lay.bk}, kk = k % {lay.bk}, cb = c / {lay.bc}, cc = c % {lay.bc};",
         f"const bool ok = k < {s.k} && c < {s.c};",
         f"const GLOBAL_PTR float* wp = w + (ok ? (k * {s.c} + c) * 9 : 0);")
    for i, j in itertools.product(range(3), range(3)):
        code(f"const float g{i}_{j} = ok ? wp[{i * 3 + j}] : 0.0f;")
    code(f"GLOBAL_PTR float* up = uw + (kb * {cb_n} + cb) * {lay.w_chunk} + cc * {lay.bk} + kk;")
    if lay.fl:
        for i, j in itertools.product(range(3), range(3)):
            code(f"up[{(i * 3 + j) * lay.bc * lay.bk}] = g{i}_{j};")
        what = "raw taps"
    else:
        emit_filter_transform(code, g, "g", "u", "gt")
        for i, j in itertools.product(range(g.ah), range(g.aw)):
            code(f"up[{(i * g.aw + j) * lay.bc * lay.bk}] = u{i}_{j};")
        what = "G g G^T"
    return Kernel("wino_fused_filter_transform", (Buf("w"), Buf("uw", readonly=False)),
                  code.text(), (tb, 1, 1),
                  comment=f"{vname}: {what}, blocked {lay.bk}x{lay.bc}")


def _main_kernel(lay: Layout, epi: Epilogue, vname: str, pro: Prologue = Prologue()) -> Kernel:
    code = Code()
    _emit_setup(code, lay, pro)
    _emit_main_loop(code, lay, pro)
    if lay.ks > 1:  # a slice stores its raw partial output; the reduce kernel adds the epilogue
        code(f"GLOBAL_PTR float* y = part + kz * {_out_elements(lay.g.spec)};"
             "  // this slice's partial output")
        epi = Epilogue()
        outs: tuple[Arg, ...] = (Buf("part", readonly=False),)
    else:
        outs = out_args(epi)
    _emit_output(code, lay, epi)
    args = (Buf("x"), Buf("uw")) + outs + pro_args(pro) + (LocalBuf("smem", lay.smem_bytes),)
    p = lay
    note = (f"{vname}: bk={p.bk} bn={p.bn} bc={p.bc} lanes {p.lk}x{p.ln} x {p.groups} groups, "
            f"{p.tk}x{p.tn} per lane x {p.e_per_group} elements, smem {p.smem_bytes} B")
    if p.ks > 1:
        note += f", channels split over {p.ks} slices"
    if p.ca or p.ci:
        what = " and ".join(w for w, on in (("filters", p.ca), ("raw inputs", p.ci)) if on)
        note += f", {what} copied to shared memory asynchronously"
    if p.mb:
        note += f", registers capped for {p.mb} blocks per SM"
    return Kernel("wino_fused", args, code.text(), (lay.threads, 1, 1), helpers=STORE2_HELPER,
                  comment=note, min_blocks=lay.mb)


def _emit_setup(code: Code, lay: Layout, pro: Prologue = Prologue()) -> None:
    g, s = lay.g, lay.g.spec
    code("const int tid = LOCAL_ID(0), tb = GROUP_ID(0), kb = GROUP_ID(1);",
         f"const int grp = tid / {lay.lanes}, lane = tid % {lay.lanes};",
         f"const int lkid = lane / {lay.ln}, lnid = lane % {lay.ln};",
         f"const int ua = grp * {lay.e_per_group * lay.bc * lay.bk} + lkid * {lay.vk};"
         "  // this lane's filter operands",
         f"const int va = {lay.u_chunk} + grp * {lay.e_per_group * lay.bc * lay.bn} + "
         f"lnid * {lay.vn};  // and tile operands")
    ub = f"uw + kb * {lay.cbn * lay.w_chunk}"
    if lay.ks > 1:
        _emit_slice(code, lay)
        ub += f" + cb0 * {lay.w_chunk}"
    code(f"const GLOBAL_PTR float* ub = {ub};")
    for i in range(lay.in_per_thread):
        sfx = f"_{i}"
        code(f"const int pr{sfx} = tid + {i * lay.threads};",
             f"const int jt{sfx} = pr{sfx} % {lay.bn}, cc{sfx} = pr{sfx} / {lay.bn};",
             f"const int t{sfx} = tb * {lay.bn} + jt{sfx};")
        emit_tile_origin(code, g, f"t{sfx}", sfx)
        ok = f"t{sfx} < {g.tiles}" + (f" && pr{sfx} < {lay.in_pairs}"
                                      if lay.in_pairs % lay.threads else "")
        emit_tile_masks(code, g, ok, sfx)
        if lay.ci:
            emit_window_mask(code, g, f"win{sfx}", sfx)
        slice_off = f" + cb0 * {lay.bc * s.h * s.w}" if lay.ks > 1 else ""
        code(f"const int xb{sfx} = (n{sfx} * {s.c} + cc{sfx}) * {s.h * s.w} + "
             f"iy{sfx} * {s.w} + ix{sfx}{slice_off};")
        for a, b in itertools.product(range(g.ah) if not lay.ci else (), range(g.aw)):
            code(f"float d{sfx}{a}_{b};")
        if pro.affine:
            code(f"float ps{sfx} = 0.0f, pb{sfx} = 0.0f;  // this window's channel's prologue scale and shift")
    for i in range(0 if lay.ca else lay.f4_per_thread):
        code(f"float4 f{i} = MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f);")
    for i, j in itertools.product(range(lay.fl_per_thread), range(9)):
        code(f"float g_{i}_{j // 3}_{j % 3} = 0.0f;")
    for el, ki, ni in itertools.product(range(lay.e_per_group), range(lay.tk), range(lay.tn)):
        code(f"float acc{el}_{ki}_{ni} = 0.0f;")


def _emit_load_stage(code: Code, lay: Layout, cb: str, buf: str, pro: Prologue = Prologue()) -> None:
    """Global loads of stage ``cb``: filter float4s into registers (or, with ``ca``, copied
    asynchronously straight into shared buffer ``buf``), then input windows into registers (and,
    for an affine ``pro``, their channel's scale and shift: 0 past the last channel)."""
    g, s = lay.g, lay.g.spec
    nf4 = lay.u_chunk // 4
    code(f"const GLOBAL_PTR float* us = ub + ({cb}) * {lay.w_chunk};")
    nfl = lay.bc * lay.bk
    for i in range(lay.fl_per_thread):
        last = (i + 1) * lay.threads > nfl
        loads = [f"g_{i}_{j // 3}_{j % 3} = us[tid + {i * lay.threads + j * nfl}];"
                 for j in range(9)]
        if last:
            with code.block(f"if (tid + {i * lay.threads} < {nfl})"):
                code(*loads)
        else:
            code(*loads)
    for i in range(lay.f4_per_thread):
        j = f"tid + {i * lay.threads}"
        stmt = f"COPY4_ASYNC(smem + {buf} + 4 * ({j}), us + 4 * ({j}));" if lay.ca else \
            f"f{i} = VLOAD4({j}, us);"
        last = (i + 1) * lay.threads > nf4
        code(f"if ({j} < {nf4}) {stmt}" if last else stmt)
    for i in range(lay.in_per_thread):
        sfx = f"_{i}"
        first = "cb0 + " if lay.ks > 1 else ""
        cond = f"({first}{cb}) * {lay.bc} + cc{sfx} < {s.c}" if s.c % lay.bc else ""
        base = f"xb{sfx} + ({cb}) * {lay.bc * s.h * s.w}"
        if lay.ci:
            mask = f"({cond}) ? win{sfx} : (U64)0" if cond else f"win{sfx}"
            emit_tile_copy(code, g, f"x + {base}", f"smem + {_raw_at(lay, i)}", lay.threads,
                           f"({mask})")
        else:
            emit_tile_load(code, g, "x", base, f"d{sfx}", sfx, decl=False, cond=cond)
        if pro.affine:
            ch = f"({first}{cb}) * {lay.bc} + cc{sfx}"
            for nm, arr in ((f"ps{sfx}", "pscale"), (f"pb{sfx}", "pshift")):
                code(f"{nm} = ({cond}) ? {arr}[{ch}] : 0.0f;" if cond else f"{nm} = {arr}[{ch}];")


def _emit_store_stage(code: Code, lay: Layout, buf: str, pro: Prologue = Prologue()) -> None:
    """Registers of a stage into shared buffer ``buf``: filters as is, inputs activated by ``pro``
    (where the window's mask says the element is in the image: padding stays 0) and transformed."""
    g = lay.g
    nf4 = lay.u_chunk // 4
    code(f"LOCAL_PTR float* sb = smem + {buf};")
    nfl = lay.bc * lay.bk
    for i in range(lay.fl_per_thread):
        last = (i + 1) * lay.threads > nfl
        with code.block(f"if (tid + {i * lay.threads} < {nfl})" if last
                        else f"/* filters {i}: G g G^T */"):
            emit_filter_transform(code, g, f"g_{i}_", "u", "gt")
            for a, b in itertools.product(range(g.ah), range(g.aw)):
                code(f"sb[{(a * g.aw + b) * nfl} + tid + {i * lay.threads}] = u{a}_{b};")
    for i in range(0 if lay.ca else lay.f4_per_thread):
        stmt = f"VSTORE4(f{i}, tid + {i * lay.threads}, sb);"
        last = (i + 1) * lay.threads > nf4
        code(f"if (tid + {i * lay.threads} < {nf4}) {stmt}" if last else stmt)
    for i in range(lay.in_per_thread):
        sfx = f"_{i}"
        with code.block(f"/* input window {i} */"):
            for a, b in itertools.product(range(g.ah) if lay.ci else (), range(g.aw)):
                code(f"const float d{sfx}{a}_{b} = smem[{_raw_at(lay, i)} + "
                     f"{(a * g.aw + b) * lay.threads}];")
            src = f"d{sfx}"
            if pro.active:  # the activated window (a masked-off element stays 0)
                src = f"a{sfx}"
                for a, b in itertools.product(range(g.ah), range(g.aw)):
                    val = f"FMA(d{sfx}{a}_{b}, ps{sfx}, pb{sfx})" if pro.affine else f"d{sfx}{a}_{b}"
                    val = f"RELU({val})" if pro.relu else val
                    if pro.affine:  # an affine map takes 0 elsewhere: masked-off elements stay 0
                        val = f"((rmask{sfx} >> {a}) & (cmask{sfx} >> {b}) & 1u) ? {val} : 0.0f"
                    code(f"const float {src}{a}_{b} = {val};")
            emit_input_transform(code, g, src, "v", "dt")
            guard = f"if (pr{sfx} < {lay.in_pairs}) " if lay.in_pairs % lay.threads else ""
            for a, b in itertools.product(range(g.ah), range(g.aw)):
                e = a * g.aw + b
                code(f"{guard}sb[{lay.u_chunk + e * lay.bc * lay.bn} + cc{sfx} * {lay.bn} + "
                     f"jt{sfx}] = v{a}_{b};")


def _raw_at(lay: Layout, i: int) -> str:
    """Offset of this thread's raw input window i (ci), element stride = threads."""
    return f"{2 * lay.stage + i * lay.g.a2 * lay.threads} + tid"


def _operands(code: Code, lay: Layout, name: str, base: str, t: int, v: int, lanes: int) -> None:
    """Declare ``name{i}`` for i < t from shared memory: float4 groups lanes*v apart."""
    for grp in range(t // v):
        off = f"{base} + {grp * lanes * v}"
        if v == 4:
            code(f"const float4 {name}v{grp} = VLOAD4(0, sb + {off});")
            for c, comp in enumerate("xyzw"):
                code(f"const float {name}{grp * 4 + c} = {name}v{grp}.{comp};")
        else:
            for c in range(v):
                code(f"const float {name}{grp * v + c} = sb[{off} + {c}];")


def _emit_products(code: Code, lay: Layout) -> None:
    """The element-wise stage: per channel, per owned element, a tk x tn outer product."""
    for cc in range(lay.bc):
        for el in range(lay.e_per_group):
            with code.block(f"/* channel {cc}, element {el} */"):
                _operands(code, lay, "a", f"ua + {(el * lay.bc + cc) * lay.bk}", lay.tk, lay.vk,
                          lay.lk)
                _operands(code, lay, "b", f"va + {(el * lay.bc + cc) * lay.bn}", lay.tn, lay.vn,
                          lay.ln)
                for ki, ni in itertools.product(range(lay.tk), range(lay.tn)):
                    code(f"acc{el}_{ki}_{ni} = FMA(a{ki}, b{ni}, acc{el}_{ki}_{ni});")


def _emit_slice(code: Code, lay: Layout) -> None:
    """ks > 1: this block's channel stages [cb0, cb0 + nst), balanced over the ks slices (they
    differ by at most one stage); the filter and input bases are offset by cb0, so the loop below
    counts from 0 as without a split (a compile-time trip count when ks divides the stages)."""
    cbn, ks = lay.cbn, lay.ks
    code("const int kz = GROUP_ID(2);  // channel slice")
    if cbn % ks:
        code(f"const int cb0 = kz * {cbn} / {ks}, nst = (kz + 1) * {cbn} / {ks} - cb0;")
    else:
        code(f"const int cb0 = kz * {cbn // ks};  // {cbn // ks} stages a slice")


def _emit_main_loop(code: Code, lay: Layout, pro: Prologue = Prologue()) -> None:
    """Double-buffered loop over this block's channel stages (all of them unless split)."""
    end = "nst" if lay.ks > 1 and lay.cbn % lay.ks else f"{lay.cbn // lay.ks}"
    wait = ("COPY_WAIT();  // this thread's asynchronous copies have landed",) \
        if lay.ca or lay.ci else ()
    with code.block("/* prologue: stage 0 */"):
        _emit_load_stage(code, lay, "0", "0", pro)
        code(*wait)
        _emit_store_stage(code, lay, "0", pro)
    code("BARRIER();")
    with code.block(f"for (int cb = 0; cb < {end}; ++cb)"):
        code(f"const int cur = (cb & 1) * {lay.stage};",
             f"const bool more = cb + 1 < {end};")
        with code.block("if (more)"):
            _emit_load_stage(code, lay, "cb + 1", f"{lay.stage} - cur", pro)
        with code.block(""):
            code("const LOCAL_PTR float* sb = smem + cur;")
            _emit_products(code, lay)
        code(*wait)
        with code.block("if (more)"):
            _emit_store_stage(code, lay, f"{lay.stage} - cur", pro)
        code("BARRIER();")


def _emit_output(code: Code, lay: Layout, epi: Epilogue) -> None:
    """Rounds of: accumulators to shared (conflict-free rows), barrier, A^T M A and stores."""
    g, s = lay.g, lay.g.spec
    rs = lay.bn + lay.row_pad
    pairs = lay.kr * lay.bn
    per = cdiv(pairs, lay.threads)
    for rho in range(lay.tk // lay.vk):
        with code.block(f"/* output round {rho}: filters {rho * lay.kr}..{(rho + 1) * lay.kr - 1}"
                        f" of the block */"):
            for el, v in itertools.product(range(lay.e_per_group), range(lay.vk)):
                row = f"(grp * {lay.e_per_group} + {el}) * {lay.kr * rs} + (lkid * {lay.vk} + {v})" \
                      f" * {rs} + lnid * {lay.vn}"
                ki = rho * lay.vk + v
                for grp_n in range(lay.tn // lay.vn):
                    vals = [f"acc{el}_{ki}_{grp_n * lay.vn + c}" for c in range(lay.vn)]
                    off = f"{row} + {grp_n * lay.ln * lay.vn}"
                    if lay.vn == 4:
                        code(f"VSTORE4(MAKE_FLOAT4({', '.join(vals)}), 0, smem + {off});")
                    else:
                        for c, val in enumerate(vals):
                            code(f"smem[{off} + {c}] = {val};")
            code("BARRIER();")
            for i in range(per):
                with code.block(f"/* pair {i} */"):
                    # Past the last pair (pairs not a multiple of threads) the shared reads are
                    # clamped in bounds and the store is masked.
                    kr_expr = f"pr / {lay.bn}" if not pairs % lay.threads else \
                        f"min(pr / {lay.bn}, {lay.kr - 1})"
                    code(f"const int pr = tid + {i * lay.threads};",
                         f"const int jt = pr % {lay.bn}, kr = {kr_expr};",
                         f"const int t = tb * {lay.bn} + jt;",
                         f"const int k = kb * {lay.bk} + {rho * lay.kr} + kr;")
                    for a, b in itertools.product(range(g.ah), range(g.aw)):
                        code(f"const float m{a}_{b} = smem[{(a * g.aw + b) * lay.kr * rs} + "
                             f"kr * {rs} + jt];")
                    emit_output_transform(code, g, "m", "o", "mt")
                    code(f"const int tc = min(t, {g.tiles - 1});")
                    emit_tile_origin(code, g, "tc")
                    ok = f"t < {g.tiles} && k < {s.k}" + (f" && pr < {pairs}"
                                                          if pairs % lay.threads else "")
                    emit_output_store(code, g, epi, "o", "k", ok)
            code("BARRIER();")


register(WinogradFused(2))
register(WinogradFused(4))
