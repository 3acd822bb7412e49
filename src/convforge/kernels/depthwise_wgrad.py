"""wgrad of a depthwise layer: dw[k, r, s] = sum over N*P*Q of x(window of tap r, s) * dy[k], a
per-channel reduction, deterministic (fixed trees and an ordered sum of slices; no atomics), in
float32, float16 and bfloat16 storage (FP32 sums; partial filters in float32), NCHW or NHWC.

Three forms, one variant (``depthwise_wgrad``):

* NCHW, up to ``REG_TAPS`` taps: block (k, slice of the N*P output rows) of ``bt`` threads walks its
  slice (consecutive threads: consecutive columns, so dy loads coalesce), keeps one partial sum per
  tap in registers, then adds them across the block in a fixed shared-memory tree;
* NHWC, up to ``REG_TAPS`` taps: block (``bc`` consecutive channels, slice) of ``bc`` x ``bs``
  threads, channels fastest so a warp's dy and x loads of one pixel are one contiguous run; each
  thread walks every ``bs``-th pixel of the slice with one partial sum per tap, then a fixed tree
  over the ``bs`` threads of each channel;
* larger filters (the tiled form, RepLKNet's 13x13 to 31x31): per-tap sums do not fit in registers,
  so the threads of block (k, slice) own the taps instead: thread (r, strip) sums ``ts`` adjacent taps
  of filter row r over the slice's outputs (dy read once a column for ``ts`` FMAs). Compute-bound
  (R*S FMAs an output), so on NHWC the plan first transposes x and dy to NCHW workspaces (two passes
  over the activations against hundreds of FMAs per element).

With ``ns`` > 1 slices each writes a partial filter and a second kernel adds the slices in order.
"""

from __future__ import annotations

import itertools

from convforge.codegen.dialect import FLOAT32, Buf, Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.depthwise import ALL_DTYPES, REG_TAPS
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


def _form(spec: ConvSpec) -> str:
    """"tiled" (large filters), else "nhwc" or "nchw"."""
    return "tiled" if spec.r * spec.s > REG_TAPS else spec.layout


def _strips(spec: ConvSpec, ts: int) -> int:
    return cdiv(spec.s, ts)


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
        if why is None and _form(spec) != "tiled" and not self._fits(spec, 32, device):
            return "the filter's partial sums do not fit in shared memory"
        if why is None and _form(spec) == "tiled" and spec.r * _strips(spec, 8) > device.max_threads:
            return f"{spec.r} filter rows of {_strips(spec, 8)} strips exceed {device.max_threads} threads"
        return why

    def _fits(self, spec: ConvSpec, bt: int, device: DeviceInfo) -> bool:
        return bt <= device.max_threads and 4 * spec.r * spec.s * bt <= min(device.shared_bytes, _SMEM)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        form = _form(spec)
        if form == "tiled":
            ts = next((t for t in (8, 4, 2, 1) if spec.r * _strips(spec, t) >= 64), 1)
            ts = max(ts, next(t for t in (1, 2, 4, 8) if spec.r * _strips(spec, t) <= device.max_threads))
            return Params(ts=ts, ns=wgrad_splits(spec, device))
        if form == "nhwc":
            bc = min(32, spec.k) if device.is_gpu else min(4, spec.k)
            bs = next((b for b in ((8, 4, 2) if device.is_gpu else (4, 2)) if self._fits(spec, bc * b, device)), 1)
            return Params(bc=bc, bs=bs, ns=wgrad_splits(spec, device, cdiv(spec.k, bc)))
        bt = next((b for b in ((256, 128, 64, 32) if device.is_gpu else (32,)) if self._fits(spec, b, device)), 32)
        return Params(bt=bt, ns=wgrad_splits(spec, device))

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        out = [self.default(spec, device)]
        form = _form(spec)
        rows = spec.n * spec.p
        if form == "tiled":
            for ts, ns in itertools.product((8, 4, 2), (1, 2, 4, 8, 16, 32, 64)):
                prm = Params(ts=ts, ns=ns)
                if spec.r * _strips(spec, ts) <= device.max_threads and ns <= rows and prm not in out:
                    out.append(prm)
            return out
        if form == "nhwc":
            for bc, bs, ns in itertools.product((8, 16, 32, 64), (1, 2, 4, 8), (1, 2, 4, 8, 16, 32, 64)):
                prm = Params(bc=bc, bs=bs, ns=ns)
                if (bc <= max(8, spec.k) and bc * bs >= 32 and self._fits(spec, bc * bs, device)
                        and ns <= rows and prm not in out):
                    out.append(prm)
            return out
        for bt, ns in itertools.product((64, 128, 256), (1, 2, 4, 8, 16, 32, 64)):
            prm = Params(bt=bt, ns=ns)
            if self._fits(spec, bt, device) and ns <= rows and prm not in out:
                out.append(prm)
        return out

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        part = 4 * params.ns * spec.k * spec.r * spec.s if params.ns > 1 else 0
        if _form(spec) == "tiled" and spec.layout == "nhwc":
            part += spec.itemsize * (spec.n * spec.c * spec.h * spec.w + spec.n * spec.k * spec.p * spec.q)
        return part

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        form, ns = _form(spec), params.ns
        if not 1 <= ns <= spec.n * spec.p:
            raise ValueError(f"{self.name}: ns ({ns}) must be 1..{spec.n * spec.p} (N*P output rows)")
        out = "w" if ns == 1 else "part"
        sto = Storage(spec.dtype)
        wbuf = sto.buf(out, readonly=False) if ns == 1 else FLOAT32.buf(out, readonly=False)
        kernels: list[Kernel] = []
        steps: list[Step] = []
        workspace: list[tuple[str, int]] = []
        src = ("x", "y")
        if form == "tiled":
            ts = params.ts
            threads = spec.r * _strips(spec, ts)
            if not 1 <= ts <= spec.s or threads > device.max_threads:
                raise ValueError(f"{self.name}: ts ({ts}) must be 1..{spec.s} with R * ceil(S / ts) "
                                 f"<= {device.max_threads} threads")
            if spec.layout == "nhwc":
                src = ("xt", "yt")
                for name, buf, shape in (("to_nchw_x", "x", spec.x_shape), ("to_nchw_y", "y", spec.y_shape)):
                    kern, grid = _to_nchw(name, sto, shape)
                    kernels.append(kern)
                    steps.append(Launch(name, grid, kern.block, (buf, f"{buf}t")))
                    workspace.append((f"{buf}t", spec.itemsize * shape[0] * shape[1] * shape[2] * shape[3]))
            body, block, grid = _tiled_body(spec, ts, ns, out, src), (threads, 1, 1), (spec.k, ns, 1)
        elif form == "nhwc":
            bc, bs = params.bc, params.bs
            if bs & (bs - 1) or not 1 <= bc or not self._fits(spec, bc * bs, device):
                raise ValueError(f"{self.name}: bs ({bs}) must be a power of two and bc * bs ({bc * bs}) threads' "
                                 f"{spec.r * spec.s} partial sums must fit in shared memory")
            body, block, grid = _nhwc_body(spec, bc, bs, ns, out), (bc * bs, 1, 1), (cdiv(spec.k, bc), ns, 1)
        else:
            bt = params.bt
            if bt & (bt - 1) or not self._fits(spec, bt, device):
                raise ValueError(f"{self.name}: bt ({bt}) must be a power of two whose {spec.r * spec.s} partial "
                                 "sums fit in shared memory")
            body, block, grid = _reduce_body(spec, bt, ns, out), (bt, 1, 1), (spec.k, ns, 1)
        name = "wgrad_depthwise"
        args = (sto.buf(src[0]), sto.buf(src[1]), wbuf)
        kernels.append(Kernel(name, args, body, block, comment=f"{self.name}: {params.short()}"))
        steps.append(Launch(name, grid, block, (*src, out)))
        if ns > 1:
            kern, launch = _slice_sum(spec, ns, sto)
            kernels.append(kern)
            steps.append(launch)
            workspace.insert(0, ("part", 4 * ns * spec.k * spec.r * spec.s))
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps), tuple(workspace),
                    tolerance=self.tolerance, epilogue=epilogue)


def _slice_sum(spec: ConvSpec, ns: int, sto: Storage) -> tuple[Kernel, Launch]:
    """dw = the ns slices' partial filters added in order (the same sum on every run)."""
    total = spec.k * spec.r * spec.s
    sums = " + ".join(f"part[{j * total} + e]" for j in range(ns))
    code = Code()
    code("const int e = GROUP_ID(0) * 256 + LOCAL_ID(0);")
    with code.block(f"if (e < {total})"):
        code(f"{sto.store('w', 'e', sums)};  // the slices in order: the same sum on every run")
    kern = Kernel("wgrad_depthwise_sum", (Buf("part"), sto.buf("w", readonly=False)), code.text(), (256, 1, 1),
                  comment=f"sum of {ns} slices' partial filters")
    return kern, Launch("wgrad_depthwise_sum", (cdiv(total, 256), 1, 1), (256, 1, 1), ("part", "w"))


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


def _tree(code: Code, t: str, bt: int, rs: int, lanes: int = 1) -> None:
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
    _tree(code, "t", bt, rs)
    dst = f"GROUP_ID(1) * {spec.k * rs} + k * {rs} + j" if ns > 1 else f"k * {rs} + j"
    with code.block(f"for (int j = t; j < {rs}; j += {bt})"):
        code(f"{_store_out(spec, out, dst, f'part_[j * {bt}]')};")
    return code.text()


def _store_out(spec: ConvSpec, out: str, idx: str, value: str) -> str:
    """The statement writing ``value`` to dw (the dtype) or to the float32 partial filters."""
    return Storage(spec.dtype).store(out, idx, value) if out == "w" else f"{out}[{idx}] = {value}"


def _nhwc_body(spec: ConvSpec, bc: int, bs: int, ns: int, out: str) -> str:
    """NHWC, block (bc channels, slice): thread (lc, ls) sums every bs-th pixel of the slice for
    channel k (channels fastest: a warp's loads of one pixel are contiguous), then a fixed tree over
    the bs threads of each channel."""
    sto = Storage(spec.dtype)
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    pt, pl = spec.pad[0], spec.pad[2]
    rs, rows, bt = spec.r * spec.s, spec.n * spec.p, bc * bs
    per = cdiv(rows, ns)
    code = Code()
    code(f"SHARED float part_[{rs * bt}];  // {rs} taps x {bt} threads",
         f"const int t = LOCAL_ID(0), lc = t % {bc}, ls = t / {bc};",
         f"const int k = GROUP_ID(0) * {bc} + lc, kk = min(k, {spec.k - 1});",
         f"const int c = kk / {spec.kg};  // the input channel of k",
         f"const int row0 = GROUP_ID(1) * {per}, row1 = min(row0 + {per}, {rows});",
         f"const int count = (row1 - row0) * {spec.q};")
    for r, s_ in itertools.product(range(spec.r), range(spec.s)):
        code(f"float a{r}_{s_} = 0.0f;")
    with code.block(f"for (int e = ls; e < count; e += {bs})"):
        code(f"const int row = row0 + e / {spec.q}, q = e % {spec.q};",
             f"const int n = row / {spec.p}, p = row % {spec.p};",
             f"const float g = {sto.ldg(f'y + ((n * {spec.p} + p) * {spec.q} + q) * {spec.k} + kk')};",
             f"const GLOBAL_PTR {sto.elem}* xc = x + n * {spec.h * spec.w * spec.c} + c;",
             f"const int y0 = p * {sh} - {pt}, x0 = q * {sw} - {pl};")
        for r in range(spec.r):
            with code.block(f"if ((unsigned)(y0 + {r * dh}) < {spec.h}u)"):
                code(f"const GLOBAL_PTR {sto.elem}* xr = xc + (y0 + {r * dh}) * {spec.w * spec.c};")
                for s_ in range(spec.s):
                    code(f"if ((unsigned)(x0 + {s_ * dw}) < {spec.w}u) "
                         f"a{r}_{s_} = FMA({sto.ldg(f'xr + (x0 + {s_ * dw}) * {spec.c}')}, g, a{r}_{s_});")
    for r, s_ in itertools.product(range(spec.r), range(spec.s)):
        code(f"part_[{(r * spec.s + s_) * bt} + t] = a{r}_{s_};")
    code("BARRIER();")
    _tree(code, "t", bt, rs, bc)
    dst = f"GROUP_ID(1) * {spec.k * rs} + k * {rs} + j" if ns > 1 else f"k * {rs} + j"
    with code.block(f"if (k < {spec.k})"):
        with code.block(f"for (int j = ls; j < {rs}; j += {bs})"):
            code(f"{_store_out(spec, out, dst, f'part_[j * {bt} + lc]')};")
    return code.text()


def _tiled_body(spec: ConvSpec, ts: int, ns: int, out: str, src: tuple[str, str]) -> str:
    """Large filters (NCHW operands ``src``), block (k, slice): thread (r, strip) sums taps
    (r, s0 .. s0 + ts - 1) over the slice's outputs; no cross-thread reduction."""
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
            with code.block(f"for (int q = 0; q < {spec.q}; ++q)"):
                code(f"const float g = {sto.ldg('gy + q')};  // one address for the whole block",
                     f"const int x0 = q * {sw} - {pl} + s0 * {dw};")
                for j in range(ts):
                    load = sto.ldg(f"xr + x0 + {j * dw}")
                    code(f"if ((unsigned)(x0 + {j * dw}) < {spec.w}u) a{j} = FMA({load}, g, a{j});")
    base = f"GROUP_ID(1) * {spec.k * rs} + k * {rs}" if ns > 1 else f"k * {rs}"
    with code.block(f"if (r < {spec.r})"):
        for j in range(ts):
            with code.block(f"if (s0 + {j} < {spec.s})" if (spec.s % ts) else ""):
                code(f"{_store_out(spec, out, f'{base} + r * {spec.s} + s0 + {j}', f'a{j}')};")
    return code.text()


register(DepthwiseWgrad())
