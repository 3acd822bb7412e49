"""wgrad of a depthwise layer: dw[k, r, s] = sum over N*P*Q of x(window of tap r, s) * dy[k], a
per-channel reduction, deterministic (fixed trees and an ordered sum of slices; no atomics), in
float32, float16 and bfloat16 storage (FP32 sums; partial filters in float32), NCHW or NHWC.

Four forms, one variant (``depthwise_wgrad``):

* blocked (half storage's default, NCHW and NHWC, up to ``REG_TAPS`` taps): the outputs are cut into
  items of ``tp`` x ``tq`` (rows x columns of one image); block (channel, slice of the items) walks its
  slice, each thread an item at a time (NCHW: consecutive threads take consecutive items along a row,
  so their 16-byte dy and x loads are contiguous; NHWC: ``bc`` consecutive channels of one item, so a
  warp's loads of a pixel are one run). A thread keeps one partial sum per tap, the item's dy values
  and one input row segment in registers: each row segment is read once (16-byte vectors where the
  row aligns) and serves every tap and output row it meets, so the reads through L1 stay near the
  bytes the layer must move. Then a fixed shared-memory tree over the threads of each channel;
* simple (float32 NCHW's default, measured): block (k, slice of the N*P output rows) of ``bt``
  threads, one output a thread at a time, one partial sum per tap, the same tree;
* streamed (``sc``; NHWC, multiplier 1, C a multiple of 8; the half default for 7x7 filters on planes of
  <= 14 rows): rows of input streamed through a ring in shared memory (depthwise_wgrad_stream.py);
* tiled (larger filters, RepLKNet's 13x13 to 31x31): per-tap sums do not fit in registers, so the
  threads of block (k, slice) own the taps instead: thread (r, strip) sums ``ts`` adjacent taps of
  filter row r over the slice's outputs (dy read once a column for ``ts`` FMAs). Compute-bound (R*S
  FMAs an output), so on NHWC the plan first transposes x and dy to NCHW workspaces (two passes over
  the activations against hundreds of FMAs per element).

With ``ns`` > 1 slices each writes a partial filter and a second kernel adds the slices in a fixed tree.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from convforge.codegen.dialect import FLOAT32, Buf, Dim3, Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import ThreadWindow
from convforge.kernels.depthwise import ALL_DTYPES, REG_TAPS
from convforge.kernels.depthwise_wgrad_roll import ChannelLanes, Roll, roll_body, roll_pick, roll_space
from convforge.kernels.depthwise_wgrad_stream import Stream, stream_body, stream_pick, stream_space
from convforge.kernels.dgrad import no_epilogue
from convforge.kernels.gemm import too_big
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Step, Variant
from convforge.spec import ConvSpec

_SMEM = 48 * 1024  # static shared memory a block may declare


def wgrad_splits(spec: ConvSpec, device: DeviceInfo, blocks: int | None = None) -> int:
    """Slices of the N*P output rows: enough blocks (``blocks`` per slice, default K) for ~4 per
    compute unit, at most 64 (the slice sum's terms)."""
    want = cdiv(4 * max(device.units, 1), blocks or spec.k) if device.is_gpu else 1
    return max(1, min(spec.n * spec.p, want, 64))


_MAX_SLICES = 1024  # the blocked form's slices: its partial filters are summed by a parallel fixed tree
_WARPS_PER_UNIT = 32  # warps the blocked form's slices aim to keep resident on each compute unit


def blocked_splits(spec: ConvSpec, threads: int, bc: int, bt: int, items: int, device: DeviceInfo,
                   sums: int = 1, tp: int = 2, lane_blocks: int | None = None) -> int:
    """Slices of the blocked form: enough blocks of ``threads`` over the ceil(K / bc) channel blocks for
    ~32 resident warps a compute unit (a block has few warps, and each thread's loop is a chain of
    dependent loads: occupancy hides them); past 32, only while each of the ``bt`` threads of a channel
    lane keeps an item for every ~6 of its ``sums`` (a slice's partial sums, tree and store cost about
    that: 8 items for 7x7, 6 for 3x3 in lanes of 4 channels, in the H200 sweep of 2026-11-30, for items of
    ``tp`` = 2 rows; items of 4 rows count twice); at most 1024."""
    blocks = lane_blocks or cdiv(spec.k, bc)  # blocks along the channels (wgrad_grouped's lanes: its own count)
    if not device.is_gpu:
        return max(1, min(wgrad_splits(spec, device, blocks), items))
    warps = cdiv(threads, device.warp or 32) * blocks
    want = cdiv(max(device.units, 1) * _WARPS_PER_UNIT, warps)
    each = max(1, max(2, sums // 6) * 2 // max(2, tp))  # items a thread keeps
    return max(1, min(want, max(items // (each * bt), min(32, items)), _MAX_SLICES))


def _tiled(spec: ConvSpec) -> bool:
    """Large filters: the tap-parallel form."""
    return spec.r * spec.s > REG_TAPS


def _strips(spec: ConvSpec, ts: int) -> int:
    return cdiv(spec.s, ts)


def _vw(spec: ConvSpec) -> int:
    """Elements of a 16-byte load: 4 floats, 8 halves."""
    return 4 if spec.dtype == "float32" else 8


@dataclass(frozen=True)
class WTile(ThreadWindow, ChannelLanes):
    """A blocked parameter set on one layer: ``bt`` threads along the items for each of ``bc``
    channel lanes (NHWC; 1 on NCHW), items of ``tp`` x ``tq`` outputs; on NHWC each lane takes ``cv``
    consecutive channels (1, or 4: one 8-byte load of halves a pixel, four sums a tap); ``pr`` 1: input
    rows guarded load by load rather than by a branch a row (ptxas then hoists loads across rows, and
    registers grow); ``mb``: the blocks a compute unit the launch bound names (caps the registers);
    ``pg``: input rows under one branch, all their loads before their FMAs (1: a branch a row; 2 halves an
    item's chain of load latencies on 3x3: 122 registers against 101 on 144@56 FP16, by params and in the
    space, not yet timed)."""

    spec: ConvSpec
    bc: int
    bt: int
    tq: int
    tp: int
    cv: int = 1
    pr: int = 0
    mb: int = 1
    pg: int = 1

    @classmethod
    def of(cls, spec: ConvSpec, p: Params) -> WTile:
        return cls(spec, p.get("bc", 1), p.bt if spec.layout == "nchw" else p.bs, p.tq, p.tp, p.get("cv", 1),
                   p.get("pr", 0), p.get("mb", 1), p.get("pg", 1))

    @property
    def grid_p(self) -> int:
        return cdiv(self.spec.p, self.tp)

    @property
    def items(self) -> int:
        return self.spec.n * self.grid_p * self.grid_q


    @property
    def xv(self) -> int:
        """NCHW input rows as 16-byte vectors (the vector width; 1: scalar): rows and every item's
        first column aligned to it."""
        s, vw = self.spec, _vw(self.spec)
        return vw if s.layout == "nchw" and s.w % vw == 0 and (self.tq * s.stride[1]) % vw == 0 else 1

    @property
    def gv(self) -> int:
        """NCHW dy rows of an item as 16-byte vectors (or 1)."""
        s, vw = self.spec, _vw(self.spec)
        return vw if s.layout == "nchw" and s.q % vw == 0 and self.tq % vw == 0 else 1

    def problem(self, device: DeviceInfo) -> str | None:
        s = self.spec
        rs = s.r * s.s
        cv = self.cv
        if min(self.bc, self.bt, self.tq, self.tp) < 1 or self.bt & (self.bt - 1):
            return f"bt / bs ({self.bt}) must be a power of two and bc, tq, tp >= 1"
        if self.pr not in (0, 1) or not 1 <= self.mb <= 32 or not 1 <= self.pg <= max(1, self.rows):
            return f"pr ({self.pr}) must be 0 or 1, mb ({self.mb}) 1..32 and pg ({self.pg}) 1..{self.rows}"
        if cv not in (1, 4):
            return f"cv ({cv}) must be 1 or 4"
        if cv > 1 and (s.layout != "nhwc" or s.kg != 1 or s.k % cv):
            return f"cv ({cv}) reads NHWC channels of a multiplier-1 layer whose K is a multiple of {cv}"
        if not 1 <= self.threads <= device.max_threads:
            return f"{self.threads} threads must be 1..{device.max_threads}"
        if self.tp * self.tq > 32 or (rs + self.tp * self.tq + self.seg * self.pg) * cv > _REGS:
            return f"taps, tp * tq outputs and pg row segments (({rs} + {self.tp * self.tq} + {self.pg} x " \
                   f"{self.seg}) x {cv} channels) must fit in {_REGS} registers"
        return None


_Form = TypeVar("_Form", WTile, Stream, Roll)  # a parameter set of the blocked or the streamed form
_REGS = 160  # a rough cap on the floats a thread of the blocked form holds
_SM_REGISTERS = 64 * 1024  # 32-bit registers a CUDA compute unit holds (sm_50 .. sm_90): mb's arithmetic


class DepthwiseWgrad(Variant):
    """wgrad of a depthwise layer (module docstring): any stride, dilation, padding and multiplier,
    NCHW or NHWC, float32 or half storage."""

    name = "depthwise_wgrad"
    family = "depthwise"
    passes = frozenset({"wgrad"})
    grouped = True
    exact = True
    tolerance = 1e-5
    specialised = 20
    space_lead = 1
    dtypes = ALL_DTYPES
    layouts = frozenset({"nchw", "nhwc"})

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if not spec.depthwise:
            return "only depthwise layers (groups == C > 1)"
        why = super().applies(spec, device) or too_big(spec)
        if why is None and not _tiled(spec) and not self._fits(spec, 32, device):
            return "the filter's partial sums do not fit in shared memory"
        if why is None and _tiled(spec) and spec.r * _strips(spec, 8) > device.max_threads:
            return f"{spec.r} filter rows of {_strips(spec, 8)} strips exceed {device.max_threads} threads"
        return why

    def _fits(self, spec: ConvSpec, bt: int, device: DeviceInfo) -> bool:
        return bt <= device.max_threads and 4 * spec.r * spec.s * bt <= min(device.shared_bytes, _SMEM)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        if _tiled(spec):
            ts = next((t for t in (8, 4, 2, 1) if spec.r * _strips(spec, t) >= 64), 1)
            ts = max(ts, next(t for t in (1, 2, 4, 8) if spec.r * _strips(spec, t) <= device.max_threads))
            return Params(ts=ts, ns=wgrad_splits(spec, device))
        if spec.layout == "nhwc":
            picked = stream_pick(spec, device) or roll_pick(spec, device)
            if picked is not None:
                return picked
        if spec.layout == "nchw" and spec.dtype == "float32":
            bt = next((b for b in ((256, 128, 64, 32) if device.is_gpu else (32,)) if self._fits(spec, b, device)), 32)
            return Params(bt=bt, ns=wgrad_splits(spec, device))
        return self._blocked_default(spec, device)

    def _blocked_default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """Items of 2 (3x3) or 4 rows of 8 columns on NCHW (one 16-byte load of halves a dy row;
        4 when rows do not align to 8); on NHWC, filters up to 3x3 where K allows: items of 2 x 4, 8 lanes
        of 4 channels (a load of 4 channels a pixel) x 16 threads; else 32 channel lanes, items of 2 x 4
        (2 x 8 past 3x3); threads as many (<= 256) as the partial sums' shared memory takes; slices for
        ~32 warps a compute unit (the H200 sweep of 2026-11-30 chose these among 8 mods). NCHW half
        storage up to 7x7: the threads and bound of :func:`_nchw_lanes`, sliced to one wave."""
        nchw, cv = spec.layout == "nchw", 1
        if not device.is_gpu:
            tq, tp, bc = min(2, spec.q), 1, 1 if nchw else min(4, spec.k)
        elif nchw:
            tq = 8 if spec.q % 8 == 0 or spec.q >= 16 else 4 if spec.q >= 4 else spec.q
            tp, bc = (2 if spec.eff_r <= 3 else 4), 1
            if spec.dtype != "float32":
                t = _nchw_lanes(spec, tq, tp, device)
                if t is not None:
                    return _finished(t, device)
        else:
            rs = spec.r * spec.s
            tq = min(4 if rs <= 9 or rs <= 25 and spec.q >= 28 else 8, spec.q)
            tp, bc = min(2, spec.p), min(32, spec.k)
            if rs > 25:  # 7x7 (H200 sweep, 2026-11-30): items of 4 rows on large planes, 16 lanes on small
                tp, bc = (min(4, spec.p), bc) if spec.p >= 28 else (tp, min(16, spec.k))
            if rs <= 9 and WTile(spec, 8, 16, tq, tp, 4).problem(device) is None:
                bc, cv = 8, 4
            whole = _whole_lanes(spec, cv)
            if whole is not None and spec.dtype != "float32":
                t = WTile(spec, whole[0], whole[1], tq, tp, cv)
                if t.problem(device) is None:
                    return _finished(t, device)
        top = 128 if cv > 1 or spec.r * spec.s > 25 else 256  # the sweeps' block sizes (7x7: 128)
        for tq_, tp_ in ((tq, tp), (tq, 1), (min(tq, 4), 1), (1, 1)):
            for bt in ((top // bc, 128 // bc, 64 // bc, 32 // bc, 1) if device.is_gpu else (32 // bc, 1)):
                t = WTile(spec, bc, max(1, bt), tq_, tp_, cv)
                if t.problem(device) is None:
                    return _finished(t, device)
        return _blocked_params(spec, WTile(spec, 1, 1, 1, 1), 1)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        out = [self.default(spec, device)]
        if not _tiled(spec):  # the blocked form's default (and its rows in pairs) beside the streamed form's sweep
            blocked = self._blocked_default(spec, device)
            t = WTile.of(spec, blocked)  # rows in pairs take ~122 registers: a bound that allows them
            pairs = blocked.replace(pg=2, mb=max(1, min(t.mb, _SM_REGISTERS // (128 * t.threads))))
            out += [blocked] + ([pairs] if not t.pr and t.problem(device) is None else []) + stream_space(spec, device)
            out += roll_space(spec, device)
        rows = spec.n * spec.p
        if _tiled(spec):
            for ts, ns in itertools.product((8, 4, 2), (1, 2, 4, 8, 16, 32, 64)):
                prm = Params(ts=ts, ns=ns)
                if spec.r * _strips(spec, ts) <= device.max_threads and ns <= rows and prm not in out:
                    out.append(prm)
            return out
        if spec.layout == "nchw":
            out.append(self._blocked_default(spec, device))
            for bt, ns in itertools.product((64, 128, 256), (1, 2, 4, 8, 16, 32, 64)):
                prm = Params(bt=bt, ns=ns)
                if self._fits(spec, bt, device) and ns <= rows and prm not in out:
                    out.append(prm)
        lanes = [(1, 1)] if spec.layout == "nchw" else [(1, 8), (1, 16), (1, 32), (1, 64), (4, 2), (4, 4), (4, 8),
                                                         (4, 16)]  # (cv, bc): 8 to 64 channels a block
        for (cv, bc), bt, tq, tp, ns in itertools.product(lanes, (1, 2, 4, 8, 16, 32, 64, 128, 256), (1, 2, 4, 8),
                                                          (1, 2, 4), (1, 4, 16, 64, 256, 1024)):
            t = WTile(spec, bc, bt, tq, tp, cv)
            if (t.channels > max(8, spec.k) or t.threads < 32 or tq > max(1, spec.q) or tp > max(1, spec.p)
                    or ns > t.items or t.problem(device)):
                continue
            for tt in (t, dataclasses.replace(t, pr=1, mb=max(1, min(8, _SM_REGISTERS // (128 * t.threads))))):
                prm = _blocked_params(spec, tt, ns)
                if prm not in out:
                    out.append(prm)
        return [prm for prm in dict.fromkeys(out)]

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        part = 4 * params.ns * spec.k * spec.r * spec.s if params.ns > 1 else 0
        if _tiled(spec) and spec.layout == "nhwc":
            part += spec.itemsize * (spec.n * spec.c * spec.h * spec.w + spec.n * spec.k * spec.p * spec.q)
        return part

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        ns = params.ns
        out = "w" if ns == 1 else "part"
        sto = Storage(spec.dtype)
        wbuf = sto.buf(out, readonly=False) if ns == 1 else FLOAT32.buf(out, readonly=False)
        kernels: list[Kernel] = []
        steps: list[Step] = []
        workspace: list[tuple[str, int]] = []
        src = ("x", "y")
        if _tiled(spec):
            body, block, grid = self._tiled_plan(spec, params, device, out, kernels, steps, workspace)
            src = ("xt", "yt") if spec.layout == "nhwc" else src
        elif "sc" in params:
            st = self._checked(Stream.of(spec, params), ns, device, f"bands of {params.sb} rows of each image")
            store = _store_out(spec, out, f"GROUP_ID(1) * {spec.k * spec.r * spec.s} + {{i}}" if ns > 1 else "{i}",
                               "{v}")
            body, block, grid = stream_body(st, sto, store), (st.threads, 1, 1), (st.cblocks, ns, 1)
        elif "rb" in params:
            rl = self._checked(Roll.of(spec, params), ns, device, "bands of rb rows x tq columns")
            store = _store_out(spec, out, "{i}", "{v}")
            body, block, grid = roll_body(rl, ns, store), (rl.threads, 1, 1), (cdiv(spec.k, rl.channels), ns, 1)
        elif "tq" in params:
            t = self._checked(WTile.of(spec, params), ns, device, "items of tp x tq outputs")
            body, block, grid = _blocked_body(t, ns, out), (t.threads, 1, 1), (cdiv(spec.k, t.channels), ns, 1)
        else:
            bt = params.bt
            if spec.layout != "nchw":
                raise ValueError(f"{self.name}: the simple form (bt, ns) reads NCHW; NHWC takes bc, bs, tq, tp, ns")
            if bt & (bt - 1) or not self._fits(spec, bt, device):
                raise ValueError(f"{self.name}: bt ({bt}) must be a power of two whose {spec.r * spec.s} partial "
                                 "sums fit in shared memory")
            if not 1 <= ns <= spec.n * spec.p:
                raise ValueError(f"{self.name}: ns ({ns}) must be 1..{spec.n * spec.p} (N*P output rows)")
            body, block, grid = _reduce_body(spec, bt, ns, out), (bt, 1, 1), (spec.k, ns, 1)
        name = "wgrad_depthwise"
        args = (sto.buf(src[0]), sto.buf(src[1]), wbuf)
        # the blocked form names a launch bound of mb blocks (default 1): with the thread count alone ptxas
        # (13.0) spilled 16 bytes at 48 registers on float16 3x3 (tp 2, tq 8); with it, 56 and none
        bound = params.get("mb", 1) if ("tq" in params or "rb" in params) and not _tiled(spec) else 0
        kernels.append(Kernel(name, args, body, block, comment=f"{self.name}: {params.short()}", min_blocks=bound))
        steps.append(Launch(name, grid, block, (*src, out)))
        if ns > 1:
            kern, launch = slice_sum(spec, ns, sto)
            kernels.append(kern)
            steps.append(launch)
            workspace.insert(0, ("part", 4 * ns * spec.k * spec.r * spec.s))
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps), tuple(workspace),
                    tolerance=self.tolerance, epilogue=epilogue)

    def _checked(self, t: _Form, ns: int, device: DeviceInfo, items: str) -> _Form:
        """``t`` (a blocked or streamed parameter set) where it fits ``device`` and ``ns`` slices split its
        items (``items``: what they are), else ValueError naming the problem."""
        why = t.problem(device)
        if why:
            raise ValueError(f"{self.name}: {why}")
        if not 1 <= ns <= t.items:
            raise ValueError(f"{self.name}: ns ({ns}) must be 1..{t.items} ({items})")
        return t

    def _tiled_plan(self, spec: ConvSpec, params: Params, device: DeviceInfo, out: str, kernels: list[Kernel],
                    steps: list[Step], workspace: list[tuple[str, int]]) -> tuple[str, Dim3, Dim3]:
        """The tiled form's body, block and grid; on NHWC the transposes of x and dy before it."""
        ts, ns = params.ts, params.ns
        threads = spec.r * _strips(spec, ts)
        if not 1 <= ts <= spec.s or threads > device.max_threads:
            raise ValueError(f"{self.name}: ts ({ts}) must be 1..{spec.s} with R * ceil(S / ts) "
                             f"<= {device.max_threads} threads")
        if not 1 <= ns <= spec.n * spec.p:
            raise ValueError(f"{self.name}: ns ({ns}) must be 1..{spec.n * spec.p} (N*P output rows)")
        src = ("x", "y")
        if spec.layout == "nhwc":
            src = ("xt", "yt")
            sto = Storage(spec.dtype)
            for name, buf, shape in (("to_nchw_x", "x", spec.x_shape), ("to_nchw_y", "y", spec.y_shape)):
                kern, grid = _to_nchw(name, sto, shape)
                kernels.append(kern)
                steps.append(Launch(name, grid, kern.block, (buf, f"{buf}t")))
                workspace.append((f"{buf}t", spec.itemsize * shape[0] * shape[1] * shape[2] * shape[3]))
        return _tiled_body(spec, ts, ns, out, src), (threads, 1, 1), (spec.k, ns, 1)


def _row_loads(t: WTile, device: DeviceInfo) -> WTile:
    """``t`` with rows guarded load by load (pr = 1) where the H200 sweep of 2026-11-30 measured it faster,
    and the launch bound that caps the registers the hoisted loads take: NHWC half storage past 3x3 (128
    registers for 7x7's 49 sums, 170 with items of 4 rows, 85 for 5x5, 64 for 5x5 items 4 wide), and 3x3
    in lanes of 4 channels at
    stride > 1 (128). ptxas spills there on some layers (3x3 stride 2: 8-16 bytes; 5x5 stride 2 items 4
    wide: ~300), measured fastest all the same (72@56/2: 0.040 ms against 0.052 at 128 registers and no
    spill; 3x3 stride 2: 1.2-1.6x, where 170 registers ran 2x slower). Elsewhere the sweep found the
    branch a row as fast or faster (3x3 stride 1: pr alone 2x slower; NCHW: 1.0-1.06x for 7x7 with
    spills, slower for 5x5). 3x3 lanes at stride 1 on planes of <= 14 rows keep the branch a row under a bound
    of 96 registers (101 unbounded: 4 blocks of 128 threads an SM, 5 bounded; H200, thirty-first session:
    384@14 0.0195 -> 0.0177 ms, 576@14 0.0201 -> 0.0169, 960@7 and 192@28 unchanged, 32@112 and 144@56 3-4 %
    slower; 80 registers spill and ran 1.3-1.5x slower)."""
    s = t.spec
    rs = s.r * s.s
    if not device.is_gpu or s.dtype == "float32" or s.layout != "nhwc":
        return t
    if t.cv > 1 and rs == 9 and max(s.stride) == 1:  # the bound names the residency _one_wave fills
        return dataclasses.replace(t, mb=max(1, min(8, _SM_REGISTERS // ((96 if s.h <= 14 else 104) * t.threads))))
    if t.cv > 1:
        target = 128 if max(s.stride) > 1 else 0
    else:
        target = (170 if t.tp >= 4 else 128) if rs > 25 else 64 if t.tq <= 4 else 85 if rs > 9 else 0
    if not target:
        return t
    mb = max(1, min(8, _SM_REGISTERS // (target * t.threads)))
    return dataclasses.replace(t, pr=1, mb=mb)


def _whole_lanes(spec: ConvSpec, cv: int) -> tuple[int, int] | None:
    """(bc, bt): lanes of ``cv`` channels for all of K in one block, where blocks of 32 channels would end
    in a partial block of at least a tenth of K idle (MobileNet-v2's K = 144: the fifth block of 32 had 16
    idle channels; MobileNet-v3's 72: the third, 24 of 32) and the threads make whole warps (<= 512).
    Lanes of 4 channels: stride-1 3x3 only (its 101 registers take 2 blocks of 288 an SM under a bound of
    96; the strided layers' hoisted loads would spill there); lanes of 1: filters up to 5x5 (bounds of 64
    to 85 registers). None: K a multiple of 32, or no fit. H200, thirty-fifth session, FP16 NHWC 144@56
    N64: 0.0580 ms in 105 slices of 8 lanes (one wave) against 0.0515 in 264 slices of 36 x 8 threads
    (one wave); 5x5 72@56/2: 0.0402 -> 0.0285 ms."""
    lanes, idle = spec.k // cv, cdiv(spec.k, 32) * 32 - spec.k
    if 10 * idle < spec.k or spec.k % cv or (max(spec.stride) > 1 if cv > 1 else spec.r * spec.s > 25):
        return None  # K = 120, 240: 6 % idle, where 480-thread blocks spilled under the 5x5 bound (bfloat16)
    return next(((lanes, bt) for bt in (8, 16, 4, 2, 1) if lanes * bt % 32 == 0 and lanes * bt <= 512), None)


_NCHW_REGS = ((9, 56), (25, 96), (49, 128))  # (taps up to, registers the NCHW half launch bound allows)


def _nchw_lanes(spec: ConvSpec, tq: int, tp: int, device: DeviceInfo) -> WTile | None:
    """NCHW half storage, filters up to 7x7: blocks of 128 or 64 threads under a launch bound of as many
    blocks as 56 (3x3), 96 (5x5) or 128 (7x7) registers a thread allow (ptxas takes 44-56, 72-96 and
    105-128 there unbounded), whichever fills the compute units' slots in fewer waves, then more fully
    (128 on a tie); :func:`_one_wave` then slices to one wave. H200, thirty-sixth session, FP16 NCHW
    wgrad, against 256 threads in ~32 warps' slices (grids of 1.03-2.9 waves of 2-5 blocks an SM), the
    A/B's one-wave points (slices counted from ptxas's residency; the defaults name it by the bound):
    MobileNet-v2's 3x3 1.1-1.4x faster (144@56 0.0654 -> 0.0469 ms; the default 0.0486 in the bench),
    576@14 within 4 %; ConvNeXt's 7x7 1.2-1.6x; the 5x5 layers 1.2-1.45x. None: larger filters (their sums
    take more registers). First, :func:`_one_slice`."""
    rs = spec.r * spec.s
    regs = next((r for taps, r in _NCHW_REGS if rs <= taps), None)
    if regs is None:
        return None
    one = _one_slice(spec, tq, tp, regs, device)
    if one is not None:
        return one
    best: tuple[tuple[int, float], WTile] | None = None
    for bt in (128, 64):
        mb = max(1, min(32, _SM_REGISTERS // (regs * bt)))
        t = WTile(spec, 1, bt, tq, tp, mb=mb)
        if t.problem(device) is not None:
            continue
        slots = max(1, device.units) * mb
        blocks = spec.k * max(1, min(slots // spec.k, max(1, t.items // bt)))
        waves = cdiv(blocks, slots)
        score = (waves, -blocks / (waves * slots))
        if best is None or score < best[0]:
            best = (score, t)
    return None if best is None else best[1]


def _one_slice(spec: ConvSpec, tq: int, tp: int, regs: int, device: DeviceInfo) -> WTile | None:
    """3x3 and 5x5 NCHW half: blocks of 256 threads in one slice (no slice sum) where one wave of them under
    the bound holds every channel's block at half its slots or more; else None. H200, FP16 NCHW wgrad, the
    A/B points of this tile against :func:`_nchw_lanes`' pick: MobileNet-v2's 384@14 0.0188 -> 0.0162 ms
    (thirty-sixth and thirty-seventh sessions, the same both times), EfficientNet's 5x5 240@28 0.0598 ->
    0.0549; the other layers of the two suites do not meet the condition (docs/NOTES-gemm.md)."""
    if spec.r * spec.s > 25:
        return None
    mb = max(1, min(32, _SM_REGISTERS // (regs * 256)))
    slots = max(1, device.units) * mb
    t = WTile(spec, 1, 256, tq, tp, mb=mb)
    if not 2 * spec.k >= slots >= spec.k or t.problem(device) is not None:
        return None
    return t


def _one_wave(spec: ConvSpec, t: WTile, device: DeviceInfo) -> int:
    """Slices of the blocked form: where its launch bound names the blocks a compute unit keeps (mb > 1),
    as many as fill every such slot once (units x mb blocks over the channel blocks; at least one item a
    thread), else :func:`blocked_splits`. A grid of 2.01 or 1.48 waves ran its last part on a few compute
    units: H200, thirty-fifth session, FP16 NHWC wgrad, one wave against the old rule's slices:
    32@112 0.0549 -> 0.0468 ms, 96@112/2 0.0847 -> 0.0689, 144@56 0.0639 -> 0.0580, 144@56/2 0.0410 ->
    0.0337, 192@28 0.0231 -> 0.0198; two waves ran slower than one on each of these."""
    if not device.is_gpu or t.mb <= 1:
        return blocked_splits(spec, t.threads, t.channels, t.bt, t.items, device, spec.r * spec.s * t.cv, t.tp)
    slots = max(1, device.units) * t.mb
    return max(1, min(slots // cdiv(spec.k, t.channels), max(1, t.items // t.bt)))


def _finished(t: WTile, device: DeviceInfo) -> Params:
    """The blocked default's parameters for tile ``t``: its row loads and launch bound, then its slices."""
    t = _row_loads(t, device)
    return _blocked_params(t.spec, t, _one_wave(t.spec, t, device))


def _blocked_params(spec: ConvSpec, t: WTile, ns: int) -> Params:
    """The parameters naming ``t`` (cv, pr and mb only where not 1, 0, 1)."""
    opt = {k: v for k, v, usual in (("cv", t.cv, 1), ("pr", t.pr, 0), ("mb", t.mb, 1), ("pg", t.pg, 1)) if v != usual}
    lanes = {"bt": t.bt} if spec.layout == "nchw" else {"bc": t.bc, "bs": t.bt}
    return Params({**lanes, "tq": t.tq, "tp": t.tp, "ns": ns, **opt})


_SUM_LANES, _SUM_GROUPS = 32, 8  # the slice sum's block: 32 filter elements x 8 groups of slices


def slice_sum(spec: ConvSpec, ns: int, sto: Storage) -> tuple[Kernel, Launch]:
    """dw = the ns slices' partial filters added in a fixed order (the same sum on every run): group g of
    a block's 8 sums slices g, g + 8, ... of 32 consecutive filter elements (a warp's reads are one run),
    then a fixed tree over the groups."""
    total = spec.k * spec.cg * spec.r * spec.s  # the filter's elements (depthwise: cg = 1)
    threads = _SUM_LANES * _SUM_GROUPS
    code = Code()
    code(f"SHARED float part_[{threads}];",
         f"const int t = LOCAL_ID(0), g = t / {_SUM_LANES}, e = GROUP_ID(0) * {_SUM_LANES} + t % {_SUM_LANES};",
         "float acc = 0.0f;")
    with code.block(f"if (e < {total})"):
        code(f"for (int j = g; j < {ns}; j += {_SUM_GROUPS}) acc += part[j * {total} + e];")
    code("part_[t] = acc;", "BARRIER();")
    tree(code, "t", threads, 1, _SUM_LANES)
    with code.block(f"if (t < {_SUM_LANES} && e < {total})"):
        code(f"{sto.store('w', 'e', 'part_[t]')};")
    kern = Kernel("wgrad_depthwise_sum", (Buf("part"), sto.buf("w", readonly=False)), code.text(), (threads, 1, 1),
                  comment=f"sum of {ns} slices' partial filters")
    grid = (cdiv(total, _SUM_LANES), 1, 1)
    return kern, Launch("wgrad_depthwise_sum", grid, (threads, 1, 1), ("part", "w"))


def _to_nchw(name: str, sto: Storage, shape: tuple[int, int, int, int]) -> tuple[Kernel, tuple[int, int, int]]:
    """A kernel copying an NHWC tensor of logical ``shape`` into NCHW order (the stored values as
    they are: a half value converts to float and back exactly)."""
    n, c, h, w = shape
    total = n * c * h * w
    code = Code()
    code("const int e = GROUP_ID(0) * 256 + LOCAL_ID(0);  // NCHW element: writes coalesce")
    with code.block(f"if (e < {total})"):
        code(f"const int ww = e % {w}, hh = (e / {w}) % {h}, cc = (e / {w * h}) % {c}, nn = e / {w * h * c};",
             f"{sto.store('dst', 'e', sto.load('src', f'((nn * {h} + hh) * {w} + ww) * {c} + cc'))};")
    kern = Kernel(name, (sto.buf("src"), sto.buf("dst", readonly=False)), code.text(), (256, 1, 1),
                  comment="NHWC -> NCHW for the tiled depthwise wgrad")
    return kern, (cdiv(total, 256), 1, 1)


def tree(code: Code, t: str, bt: int, rs: int, lanes: int = 1) -> None:
    """part_[j * bt + t] for j < rs summed over the threads t (in ``lanes`` interleaved groups: t
    and t + lanes * half) in a fixed tree; the sums land at thread 0 of each group."""
    half = bt // lanes // 2
    while half >= 1:
        with code.block(f"if ({t} < {half * lanes})"):
            with code.block(f"for (int j = 0; j < {rs}; ++j)"):
                code(f"part_[j * {bt} + {t}] += part_[j * {bt} + {t} + {half * lanes}];")
        code("BARRIER();")
        half //= 2


def _reduce_body(spec: ConvSpec, bt: int, ns: int, out: str) -> str:
    """NCHW, block (k, slice): R*S partial sums over the slice's outputs, then a fixed tree."""
    sto = Storage(spec.dtype)
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    pt, pl = spec.pad[0], spec.pad[2]
    rs, rows, pq = spec.r * spec.s, spec.n * spec.p, spec.p * spec.q
    per = cdiv(rows, ns)
    code = Code()
    code(f"SHARED float part_[{rs * bt}];  // {rs} taps x {bt} threads",
         "const int t = LOCAL_ID(0), k = GROUP_ID(0);",
         f"const int c = k / {spec.kg};  // the input channel of k",
         f"const int row0 = GROUP_ID(1) * {per}, row1 = min(row0 + {per}, {rows});",
         f"const int count = (row1 - row0) * {spec.q};")
    for r, s_ in itertools.product(range(spec.r), range(spec.s)):
        code(f"float a{r}_{s_} = 0.0f;")
    with code.block(f"for (int e = t; e < count; e += {bt})"):
        code(f"const int row = row0 + e / {spec.q}, q = e % {spec.q};",
             f"const int n = row / {spec.p}, p = row % {spec.p};",
             f"const float g = {sto.ldg(f'y + (n * {spec.k} + k) * {pq} + p * {spec.q} + q')};",
             f"const GLOBAL_PTR {sto.elem}* xc = x + (n * {spec.c} + c) * {spec.h * spec.w};",
             f"const int y0 = p * {sh} - {pt}, x0 = q * {sw} - {pl};")
        for r in range(spec.r):
            with code.block(f"if ((unsigned)(y0 + {r * dh}) < {spec.h}u)"):
                code(f"const GLOBAL_PTR {sto.elem}* xr = xc + (y0 + {r * dh}) * {spec.w};")
                for s_ in range(spec.s):
                    code(f"if ((unsigned)(x0 + {s_ * dw}) < {spec.w}u) "
                         f"a{r}_{s_} = FMA({sto.ldg(f'xr + x0 + {s_ * dw}')}, g, a{r}_{s_});")
    for r, s_ in itertools.product(range(spec.r), range(spec.s)):
        code(f"part_[{(r * spec.s + s_) * bt} + t] = a{r}_{s_};")
    code("BARRIER();")
    tree(code, "t", bt, rs)
    dst = f"GROUP_ID(1) * {spec.k * rs} + k * {rs} + j" if ns > 1 else f"k * {rs} + j"
    with code.block(f"for (int j = t; j < {rs}; j += {bt})"):
        code(f"{_store_out(spec, out, dst, f'part_[j * {bt}]')};")
    return code.text()


def _store_out(spec: ConvSpec, out: str, idx: str, value: str) -> str:
    """The statement writing ``value`` to dw (the dtype) or to the float32 partial filters."""
    return Storage(spec.dtype).store(out, idx, value) if out == "w" else f"{out}[{idx}] = {value}"


def vec_load(code: Code, sto: Storage, name: str, width: int, ok: str, src: str) -> None:
    """``name`` (float4, or float4 ``name``a / ``name``b for 8 elements) = the ``width`` elements at
    ``src`` where ``ok``, else zeros."""
    zero = "MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f)"
    if width == 4:
        code(f"const float4 {name} = ({ok}) ? {sto.vload4('0', src)} : {zero};")
    else:
        code(f"float4 {name}a = {zero}, {name}b = {zero};",
             f"if ({ok}) {sto.vload8(f'{name}a', f'{name}b', '0', src)};")


def _vec_lane(name: str, width: int, e: int) -> str:
    return f"{name}.{'xyzw'[e]}" if width == 4 else f"{name}{'ab'[e // 4]}.{'xyzw'[e % 4]}"


def _blocked_body(t: WTile, ns: int, out: str) -> str:
    """The blocked form (module docstring): thread lt of channel k walks every bt-th item of its
    block's slice; per item its dy values, then each input row segment once, FMAs into one sum a tap."""
    s = t.spec
    sto = Storage(s.dtype)
    nhwc = s.layout == "nhwc"
    sh, sw = s.stride
    rs, nq, np_, cv = s.r * s.s, t.grid_q, t.grid_p, t.cv
    per = cdiv(t.items, ns)
    code = Code()
    chunk = sum_chunk(rs * cv, t.threads)
    sums = f"{rs} taps x {cv} channels" if cv > 1 else f"{rs} taps"
    code(f"SHARED float part_[{chunk * t.threads}];  // {chunk} of the {sums} x {t.threads} threads at a time")
    if nhwc:
        first = f"(GROUP_ID(0) * {t.bc} + lc) * {cv}" if cv > 1 else f"GROUP_ID(0) * {t.bc} + lc"
        code(f"const int tid = LOCAL_ID(0), lc = tid % {t.bc}, lt = tid / {t.bc};"
             "  // channels fastest: a warp's loads of one pixel are one run",
             f"const int k = {first}, kk = min(k, {s.k - cv});" + ("  // channels k .. k + 3" if cv > 1 else ""))
    else:
        code("const int tid = LOCAL_ID(0), lt = tid, k = GROUP_ID(0), kk = k;")
    code(f"const int c = kk / {s.kg};  // the input channel of k",
         f"const int it0 = GROUP_ID(1) * {per}, it1 = min(it0 + {per}, {t.items});")
    code(*(f"float {_acc(r, c, v, cv)} = 0.0f;" for r, c, v in itertools.product(range(s.r), range(s.s), range(cv))))
    with code.block(f"for (int it = it0 + lt; it < it1; it += {t.bt})  /* items of {t.tp} x {t.tq} outputs */"):
        code(f"const int qc = it % {nq}, pc = (it / {nq}) % {np_}, n = it / {nq * np_};",
             f"const int p0 = pc * {t.tp}, q0 = qc * {t.tq};",
             f"const int y0 = p0 * {sh} - {s.pad[0]}, x0 = q0 * {sw} - {s.pad[2]};")
        _blocked_dy(code, t, sto)
        _blocked_rows(code, t, sto)
    accs = [_acc(r, c, v, cv) for r, c, v in itertools.product(range(s.r), range(s.s), range(cv))]
    kj = f"(k + j % {cv}) * {rs} + j / {cv}" if cv > 1 else f"k * {rs} + j"  # sum j: tap j / cv of channel k + j % cv
    dst = f"GROUP_ID(1) * {s.k * rs} + {kj}" if ns > 1 else kj
    lane = "lc" if nhwc else "0"
    tree_store(code, accs, chunk, t.threads, t.bc, t.bt, f"if (k < {s.k})" if nhwc else "",
               lambda row: _store_out(s, out, dst, f"part_[{row} * {t.threads} + {lane}]"))
    return code.text()


def tree_store(code: Code, accs: list[str], chunk: int, threads: int, lanes: int, bt: int, guard: str,
               store: Callable[[str], str]) -> None:
    """Each thread's sums ``accs`` (sum j: accs[j]) through shared memory ``part_`` ``chunk`` at a time: a
    fixed tree over the ``bt`` threads of each of ``lanes`` interleaved lanes, then, under ``guard``,
    thread lt of a lane stores sums lt, lt + bt, ...: ``store(row)`` is the statement for sum j, whose
    total sits in part_[row * threads + lane]."""
    total = len(accs)
    for j0 in range(0, total, chunk):  # sums j0 .. j0 + chunk - 1: shared memory, a tree, stores
        n = min(chunk, total - j0)
        if j0:
            code("BARRIER();  // the last chunk's stores have read part_")
        code(*(f"part_[{i * threads} + tid] = {accs[j0 + i]};" for i in range(n)))
        code("BARRIER();")
        tree(code, "tid", threads, n, lanes)
        with code.block(guard):
            with code.block(f"for (int j = {f'{j0} + ' if j0 else ''}lt; j < {j0 + n}; j += {bt})"):
                code(f"{store(f'(j - {j0})' if j0 else 'j')};")


_CHUNK_FLOATS = 2048  # shared memory of the blocked form's slice-end tree (8 KiB): the rest stays L1


def sum_chunk(total: int, threads: int) -> int:
    """Sums a thread files into shared memory at a time for the tree at a slice's end: 8 KiB of floats
    (or all of them where they fit), so that shared memory does not take the L1 the x rows need."""
    return max(1, min(total, _CHUNK_FLOATS // threads))


def _acc(r: int, c: int, v: int, cv: int) -> str:
    """The sum of tap (r, c) for the thread's channel v of cv."""
    return f"a{r}_{c}_{v}" if cv > 1 else f"a{r}_{c}"


def _lane(name: str, v: int, cv: int) -> str:
    """Channel v of a value loaded for cv channels (a float4 where cv is 4)."""
    return f"{name}.{'xyzw'[v]}" if cv > 1 else name


def _blocked_dy(code: Code, t: WTile, sto: Storage) -> None:
    """g{i}_{j}: the item's dy values (zero past the plane), 16-byte vectors where rows align."""
    s = t.spec
    for i in range(t.tp):
        row_ok = f"p0 + {i} < {s.p}"
        if s.layout == "nhwc":
            base = f"y + ((n * {s.p} + p0 + {i}) * {s.q} + q0) * {s.k} + kk"
            for jq in range(t.tq):
                ok = f"{row_ok} && q0 + {jq} < {s.q}"
                if t.cv > 1:
                    vec_load(code, sto, f"g{i}_{jq}", 4, ok, f"{base} + {jq * s.k}")
                    continue
                code(f"const float g{i}_{jq} = ({ok}) ? {sto.ldg(f'{base} + {jq * s.k}')} : 0.0f;")
            continue
        base = f"y + ((n * {s.k} + k) * {s.p} + p0 + {i}) * {s.q} + q0"
        if t.gv > 1:
            for a in range(t.tq // t.gv):
                # the last column item of a row shorter than tq * grid_q (Q = 28, tq = 8) holds vectors
                # past Q: a column guard (each vector wholly in or out: gv divides Q and q0), else
                # they read the next row's dy, or past the buffer after the last row
                ok = f"{row_ok} && q0 + {a * t.gv} < {s.q}" if s.q % t.tq and a * t.gv >= s.q % t.tq else row_ok
                vec_load(code, sto, f"gv{i}_{a}", t.gv, ok, f"{base} + {a * t.gv}")
            code(*(f"const float g{i}_{jq} = {_vec_lane(f'gv{i}_{jq // t.gv}', t.gv, jq % t.gv)};"
                   for jq in range(t.tq)))
        else:
            for jq in range(t.tq):
                code(f"const float g{i}_{jq} = ({row_ok} && q0 + {jq} < {s.q}) ? {sto.ldg(f'{base} + {jq}')} : 0.0f;")


def _blocked_rows(code: Code, t: WTile, sto: Storage) -> None:
    """An item's input rows and their FMAs into the sums of every output row and filter row that meet
    there: a branch a row (``pr`` 0, ``pg`` 1), or each load guarded (``pr`` 1: ptxas may hoist every
    row's loads), or ``pg`` rows under one branch, all their loads (each guarded) before their FMAs."""
    s = t.spec
    sh, dh = s.stride[0], s.dilation[0]
    users = {ir: [(i, (ir - i * sh) // dh) for i in range(t.tp)
                  if ir >= i * sh and (ir - i * sh) % dh == 0 and (ir - i * sh) // dh < s.r] for ir in range(t.rows)}
    rows = [ir for ir in range(t.rows) if users[ir]]
    size = 1 if t.pr else t.pg
    for grp in (rows[k:k + size] for k in range(0, len(rows), size)):
        ok = {ir: f"(unsigned)(y0 + {ir}) < {s.h}u" for ir in grp}
        what = f"input row {grp[0]}" if len(grp) == 1 else f"input rows {', '.join(map(str, grp))}"
        head = f"/* {what} */" if t.pr else f"if ({' || '.join(ok.values())})  /* {what} */"
        with code.block(head):
            names = {ir: "e" if len(grp) == 1 else f"e{ir}_" for ir in grp}
            for ir in grp:
                _blocked_row(code, t, sto, ir, ok[ir] if t.pr or len(grp) > 1 else "", names[ir])
            for ir in grp:
                _row_fmas(code, t, names[ir], users[ir])


def _row_fmas(code: Code, t: WTile, name: str, users: list[tuple[int, int]]) -> None:
    """The FMAs of one input row (values ``name``0 ..) for each (output row i, filter row r) in ``users``."""
    s, cv = t.spec, t.cv
    sw, dw = s.stride[1], s.dilation[1]
    for i, r in users:
        for jq, c, v in itertools.product(range(t.tq), range(s.s), range(cv)):
            a = _acc(r, c, v, cv)
            code(f"{a} = FMA({_lane(f'{name}{jq * sw + c * dw}', v, cv)}, {_lane(f'g{i}_{jq}', v, cv)}, {a});")


def _blocked_row(code: Code, t: WTile, sto: Storage, ir: int, row_ok: str = "", name: str = "e") -> None:
    """``name``0 .. ``name``{seg-1}: input row y0 + ir, columns x0 .. (zero outside the plane); on NCHW
    read as aligned 16-byte vectors where the rows allow (each vector wholly in or out of the row).
    ``row_ok``: the row's own guard, folded into each load's (``pr``: no branch a row, so ptxas may hoist
    the loads of later rows above the sums of earlier ones)."""
    s = t.spec
    both = f"{row_ok} && " if row_ok else ""
    xv = "xv" if name == "e" else f"{name}v"
    if s.layout == "nhwc":
        base = f"x + ((n * {s.h} + y0 + {ir}) * {s.w} + x0) * {s.c} + c"
        for e in range(t.seg):
            if t.cv > 1:
                vec_load(code, sto, f"{name}{e}", 4, f"{both}(unsigned)(x0 + {e}) < {s.w}u", f"{base} + {e * s.c}")
                continue
            load = sto.ldg(f"{base} + {e * s.c}")
            code(f"const float {name}{e} = {both}(unsigned)(x0 + {e}) < {s.w}u ? {load} : 0.0f;")
        return
    base = f"x + ((n * {s.c} + c) * {s.h} + y0 + {ir}) * {s.w}"
    if t.xv == 1:
        for e in range(t.seg):
            load = sto.ldg(f"{base} + x0 + {e}")
            code(f"const float {name}{e} = {both}(unsigned)(x0 + {e}) < {s.w}u ? {load} : 0.0f;")
        return
    off = (-s.pad[2]) % t.xv  # x0 - off is a multiple of the vector width
    for a in range(cdiv(off + t.seg, t.xv)):
        col = f"x0 - {off} + {a * t.xv}" if off else f"x0 + {a * t.xv}"
        vec_load(code, sto, f"{xv}{a}", t.xv, f"{both}(unsigned)({col}) < {s.w}u", f"{base} + {col}")
    code(*(f"const float {name}{e} = {_vec_lane(f'{xv}{(e + off) // t.xv}', t.xv, (e + off) % t.xv)};"
           for e in range(t.seg)))


_QCHUNK = 8  # output columns the tiled form takes a trip: ts x 8 FMAs per (ts + 7) * stride input reads


def _tiled_body(spec: ConvSpec, ts: int, ns: int, out: str, src: tuple[str, str]) -> str:
    """Large filters (NCHW operands ``src``), block (k, slice): thread (r, strip) sums taps
    (r, s0 .. s0 + ts - 1) over the slice's outputs, 8 columns a trip (each input column the taps and
    columns share read once); no cross-thread reduction."""
    sto = Storage(spec.dtype)
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    pt, pl = spec.pad[0], spec.pad[2]
    rs, rows, pq, nst = spec.r * spec.s, spec.n * spec.p, spec.p * spec.q, _strips(spec, ts)
    per = cdiv(rows, ns)
    xs, ys = src
    code = Code()
    code("const int t = LOCAL_ID(0), k = GROUP_ID(0);",
         f"const int r = t / {nst}, s0 = (t % {nst}) * {ts};  // this thread's filter row and first tap",
         f"const int c = k / {spec.kg};  // the input channel of k",
         f"const int row0 = GROUP_ID(1) * {per}, row1 = min(row0 + {per}, {rows});",
         f"const GLOBAL_PTR {sto.elem}* xc = {xs} + c * {spec.h * spec.w};")
    code(*(f"float a{j} = 0.0f;" for j in range(ts)))
    with code.block("for (int row = row0; row < row1; ++row)"):
        code(f"const int n = row / {spec.p}, p = row % {spec.p};",
             f"const int iy = p * {sh} - {pt} + r * {dh};")
        with code.block(f"if ((unsigned)iy < {spec.h}u)"):
            code(f"const GLOBAL_PTR {sto.elem}* xr = xc + n * {spec.c * spec.h * spec.w} + iy * {spec.w};",
                 f"const GLOBAL_PTR {sto.elem}* gy = {ys} + (n * {spec.k} + k) * {pq} + p * {spec.q};")
            u = min(_QCHUNK, spec.q)
            with code.block(f"for (int q0 = 0; q0 < {spec.q}; q0 += {u})  /* {u} columns a trip */"):
                for i in range(u):  # one address for the whole block: a broadcast
                    guard = f"q0 + {i} < {spec.q} ? " if spec.q % u else ""
                    code(f"const float g{i} = {guard}{sto.ldg(f'gy + q0 + {i}')}{' : 0.0f' if guard else ''};")
                code(f"const int xq = q0 * {sw} - {pl} + s0 * {dw};")
                for pos in sorted({i * sw + j * dw for i in range(u) for j in range(ts)}):
                    code(f"const float v{pos} = (unsigned)(xq + {pos}) < {spec.w}u ? "
                         f"{sto.ldg(f'xr + xq + {pos}')} : 0.0f;")
                for i, j in itertools.product(range(u), range(ts)):
                    code(f"a{j} = FMA(v{i * sw + j * dw}, g{i}, a{j});")
    base = f"GROUP_ID(1) * {spec.k * rs} + k * {rs}" if ns > 1 else f"k * {rs}"
    with code.block(f"if (r < {spec.r})"):
        for j in range(ts):
            with code.block(f"if (s0 + {j} < {spec.s})" if (spec.s % ts) else ""):
                code(f"{_store_out(spec, out, f'{base} + r * {spec.s} + s0 + {j}', f'a{j}')};")
    return code.text()


register(DepthwiseWgrad())
