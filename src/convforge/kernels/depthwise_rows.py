"""Depthwise convolution on NCHW rows held in registers (``depthwise_rows``, ``depthwise_rows_dgrad``):
no shared memory, no barrier.

Each thread owns ``tq`` adjacent outputs of ``tp`` output rows of one plane. For every input row
under them it reads the row's chunk above its outputs (``tq * stride`` columns) as 16-byte vectors
(8 bytes where rows align to 8 only) plus the few halo columns either side as single elements, all
of a thread's loads issued before its first multiply-add, and converts them to float once; each
row's values then serve every output row and column they feed. Threads are numbered chunk along
the row fastest, then row blocks, then planes: a warp's vector loads of one row are one contiguous
run, the halo columns are the neighbouring lanes' (L1), and the rows two row blocks share come from
L1 or L2. A row's ``tq`` outputs go out as one vector store where they align.

Why a second NCHW form beside the shared-memory tile (depthwise.py): on half NCHW planes of 56 x 56
and more that tile ran at 46 % of a copy of the layer's bytes and below cuDNN-best (docs/NOTES-gemm.md),
its load-convert-store-barrier-read path costing more than the halo it saves. Here a thread's
loads are all in flight at once and nothing waits on a barrier.

fprop: output plane k of image n reads input plane k / m (multiplier m = K / C). dgrad (stride 1,
multiplier 1): the same kernel on dy with the filter rotated by 180 degrees at padding eff - 1 - pad
(depthwise.py's ``dgrad_stencil``). The epilogue (bias, residual, an activation, a concat's channel
offset) is applied on the store.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from convforge.codegen.dialect import Arg, Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs
from convforge.kernels.depthwise import (
    ALL_DTYPES,
    Stencil,
    dgrad_stencil,
    filter_taps,
    fprop_stencil,
    load_vector,
    vector_lane,
)
from convforge.kernels.dgrad import no_epilogue
from convforge.kernels.gemm import too_big
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

# The floats a thread may hold (its input window, accumulators and taps): the spaces' largest points
# (194 floats) take 156-168 registers without a spill (ptxas, sm_90a).
_REGS = 200
# ... and the defaults keep to this (a few blocks of 128 threads an SM).
_DEFAULT_REGS = 120
MAX_TAPS = 49  # filters up to 7x7: a thread keeps the taps in registers


@dataclass(frozen=True)
class RowsTile:
    """Derived sizes of one parameter set on one stencil."""

    st: Stencil
    tq: int  # outputs a thread along a row
    tp: int  # output rows a thread
    bt: int  # threads a block

    @classmethod
    def of(cls, st: Stencil, p: Params) -> RowsTile:
        return cls(st, p.tq, p.tp, p.bt)

    @property
    def vw(self) -> int:
        """Elements of one vector load: 16 bytes where the rows and the chunks align to them, else 8
        (4 floats, 8 or 4 halves); 0 where neither aligns."""
        st = self.st
        for vw in ((8, 4) if st.sto.half else (4,)):
            if st.wi % vw == 0 and (self.tq * st.stride[1]) % vw == 0:
                return vw
        return 0

    @property
    def chunk(self) -> int:
        """Input columns of a thread's vector loads a row."""
        return self.tq * self.st.stride[1]

    @property
    def cols(self) -> range:
        """The thread's input columns, relative to its chunk's first (halo columns outside 0..chunk)."""
        st = self.st
        return range(-st.pad_l, (self.tq - 1) * st.stride[1] + st.eff_s - st.pad_l)

    @property
    def rows(self) -> int:
        return (self.tp - 1) * self.st.stride[0] + self.st.eff_r

    @property
    def lanes(self) -> int:
        """Threads along an output row."""
        return cdiv(self.st.wo, self.tq)

    @property
    def planes(self) -> int:
        st = self.st
        return st.n * (st.groups if st.fan_in else st.groups * st.mult)

    @property
    def total(self) -> int:
        """Threads in all (the last block's tail returns at once)."""
        return self.planes * cdiv(self.st.ho, self.tp) * self.lanes

    @property
    def blocks(self) -> int:
        return cdiv(self.total, self.bt)

    @property
    def held(self) -> int:
        """Floats a thread holds: its input window, a row of accumulators and the taps."""
        return self.rows * len(self.cols) + self.tp * self.tq + self.st.r * self.st.s

    def problem(self, device: DeviceInfo, regs: int = _REGS) -> str | None:
        """None when the generator takes this tile on ``device``, else what is wrong."""
        st = self.st
        if st.nhwc:
            return "depthwise_rows reads NCHW rows (NHWC: depthwise_nhwc)"
        if st.phases:
            return "strided dgrad goes by phase (depthwise_dgrad)"
        if st.fan_in and st.mult > 1:
            return "dgrad with a channel multiplier sums several dy planes (depthwise_dgrad)"
        if st.r * st.s > MAX_TAPS:
            return f"filters of more than {MAX_TAPS} taps take the tiled form (depthwise)"
        if min(self.tq, self.tp, self.bt) < 1:
            return "tq, tp and bt must be >= 1"
        if not 1 <= self.bt <= device.max_threads:
            return f"bt ({self.bt}) threads must be 1..{device.max_threads}"
        if self.vw == 0:
            return (f"rows of {st.wi} elements and chunks of tq * stride ({self.chunk}) must align to "
                    f"{'8 or 4' if st.sto.half else '4'} elements (16- or 8-byte vectors)")
        if self.tp * self.tq > 32:
            return f"tp * tq ({self.tp * self.tq}) outputs a thread must be <= 32"
        if self.held > regs:
            return f"a thread's window, accumulators and taps ({self.held} floats) must be <= {regs}"
        return None


# -- metacode -------------------------------------------------------------------------------------
def _head(code: Code, t: RowsTile) -> None:
    st = t.st
    npt = cdiv(st.ho, t.tp)
    code(f"const int gid = GROUP_ID(0) * {t.bt} + LOCAL_ID(0);",
         f"if (gid >= {t.total}) return;",
         f"const int lx = gid % {t.lanes}, pt = (gid / {t.lanes}) % {npt}, plane = gid / {t.lanes * npt};"
         "  // chunks fastest: a warp's loads of a row are one run")
    if st.fan_in:
        code(f"const int n = plane / {st.groups}, k = plane % {st.groups}, c = k;")
    else:
        code(f"const int n = plane / {st.groups * st.mult}, k = plane % {st.groups * st.mult}, "
             f"c = {f'k / {st.mult}' if st.mult > 1 else 'k'};")
    code(f"const int q0 = lx * {t.tq}, p0 = pt * {t.tp};",
         f"const int xa = q0 * {st.stride[1]}, y0 = p0 * {st.stride[0]} - {st.pad_t};",
         f"const GLOBAL_PTR {st.sto.elem}* src = {st.src} + (n * {st.src_planes} + c) * {st.hi * st.wi} + xa;")


def _name(ir: int, col: int) -> str:
    return f"h{ir}_{'m' if col < 0 else ''}{abs(col)}"


def _loads(code: Code, t: RowsTile, used: list[int]) -> dict[tuple[int, int], str]:
    """Every input row's vectors and halo columns, loaded (zeros outside the plane); the value of
    each (row, column) by name."""
    st = t.st
    vw = t.vw
    cols = t.cols
    value: dict[tuple[int, int], str] = {}
    for ir in used:
        code(f"const int iy{ir} = y0 + {ir};",
             f"const bool r{ir} = (unsigned)iy{ir} < {st.hi}u;",
             f"const GLOBAL_PTR {st.sto.elem}* s{ir} = src + iy{ir} * {st.wi};")
        for v in range(t.chunk // vw):
            if not any(v * vw <= c < (v + 1) * vw for c in cols):
                continue
            ok = f"r{ir}" if t.lanes * t.chunk <= st.wi else f"r{ir} && xa + {v * vw} < {st.wi}"
            load_vector(code, st, f"v{ir}_{v}", vw, ok, f"s{ir} + {v * vw}")
            for e in range(vw):
                value[(ir, v * vw + e)] = vector_lane(f"v{ir}_{v}", vw, e)
        for col in cols:
            if 0 <= col < t.chunk:
                continue
            name = _name(ir, col)
            code(f"const float {name} = (r{ir} && (unsigned)(xa + {col}) < {st.wi}u) ? "
                 f"{st.sto.ldg(f's{ir} + {col}')} : 0.0f;")
            value[(ir, col)] = name
    return value


def _store_row(code: Code, t: RowsTile, i: int, epi: Epilogue) -> None:
    """Output row p0 + i: its tq accumulators through the epilogue, one vector store where they align."""
    st = t.st
    sto = st.sto
    ow = st.wo
    idx = f"ob + (p0 + {i}) * {ow}"
    with code.block(f"if (p0 + {i} < {st.ho})"):
        if t.tq in (4, 8) and ow % t.tq == 0:
            vals = [epi.apply(f"acc{i}_{e}", "k", f"{idx} + {e}", offset_done=True, storage=sto) for e in range(t.tq)]
            lo = f"MAKE_FLOAT4({', '.join(vals[:4])})"
            if t.tq == 4:
                code(f"{sto.vstore4(lo, '0', f'{st.dst} + {idx}')};")
            else:
                code(f"{sto.vstore8(lo, 'MAKE_FLOAT4(' + ', '.join(vals[4:]) + ')', '0', f'{st.dst} + {idx}')};")
            return
        for e in range(t.tq):
            val = epi.apply(f"acc{i}_{e}", "k", f"{idx} + {e}", offset_done=True, storage=sto)
            code(f"if (q0 + {e} < {ow}) {sto.store(st.dst, f'{idx} + {e}', val)};")


def rows_body(t: RowsTile, epi: Epilogue) -> str:
    """The kernel body of tile ``t`` (fprop, or stride-1 dgrad on the rotated filter)."""
    st = t.st
    (sh, sw), (dh, dw) = st.stride, st.dilation
    code = Code()
    _head(code, t)
    filter_taps(code, st, "k")
    users = {ir: [(i, (ir - i * sh) // dh) for i in range(t.tp)
                  if ir >= i * sh and (ir - i * sh) % dh == 0 and (ir - i * sh) // dh < st.r]
             for ir in range(t.rows)}
    value = _loads(code, t, [ir for ir in range(t.rows) if users[ir]])
    chan = f"k + {st.dst_offset}" if st.dst_offset else "k"
    code(f"const int ob = (n * {st.dst_planes} + {chan}) * {st.ho * st.wo} + q0;")
    for i in range(t.tp):
        with code.block(f"/* output row p0 + {i} */"):
            code(*(f"float acc{i}_{e} = 0.0f;" for e in range(t.tq)))
            for r in range(st.r):
                ir = i * sh + r * dh
                for e, s in itertools.product(range(t.tq), range(st.s)):
                    col = e * sw + s * dw - st.pad_l
                    code(f"acc{i}_{e} = FMA({value[(ir, col)]}, f{r}_{s}, acc{i}_{e});")
            _store_row(code, t, i, epi)
    return code.text()


# -- parameters ----------------------------------------------------------------------------------
def _tqs(st: Stencil) -> list[int]:
    """Outputs a thread along a row whose chunk is one or two vectors (16 bytes, else 8)."""
    out = []
    for vw in ((8, 4) if st.sto.half else (4,)):
        if st.wi % vw:
            continue
        for width in (vw, 2 * vw):
            if width % st.stride[1] == 0 and width // st.stride[1] not in out:
                out.append(width // st.stride[1])
    return out


def rows_default(st: Stencil, device: DeviceInfo) -> Params:
    """One 16-byte vector a row (8 halves: 8 outputs at stride 1, 4 at stride 2; 8 bytes where rows align
    to 8 only), 2 output rows, 128 threads a block: on an H200 (thirty-seventh session, FP16, MobileNet-v2's
    six 3x3 layers on planes of 28 to 112) 2 rows beat 4 by 3-13 % and 8 by 10-50 % (fewer registers, more
    threads in flight), 1 row was 10 % faster on one stride-2 layer and 40 % slower on another; 64 or 256
    threads a block were no faster (docs/NOTES-gemm.md)."""
    tqs = _tqs(st) or [1]
    tq = tqs[0]
    tp = max(1, min(2, st.ho))
    while tp > 1 and RowsTile(st, tq, tp, 128).held > _DEFAULT_REGS:
        tp //= 2
    return Params(tq=tq, tp=tp, bt=128)


def rows_space(st: Stencil, device: DeviceInfo) -> list[Params]:
    """The default first, then one or two vectors a row, 1..16 rows, 64..256 threads."""
    out = [rows_default(st, device)]
    for tq, tp, bt in itertools.product(_tqs(st), (1, 2, 4, 8, 16), (64, 128, 256)):
        prm = Params(tq=tq, tp=tp, bt=bt)
        if tp <= max(1, st.ho) and prm not in out and RowsTile(st, tq, tp, bt).problem(device) is None:
            out.append(prm)
    return out


def rows_rank(spec: ConvSpec, device: DeviceInfo, specialised: int) -> int:
    """Above the shared-memory tile (depthwise.py) for 3x3 filters, and 5x5 at a stride, where the H200
    measured it faster (thirty-seventh session: MobileNet-v2's 3x3 NCHW layers 1.5-2.5x the tile's speed in
    FP16 fprop at 2 rows a thread, 1.1-1.6x in dgrad at 4, 1.1-1.4x in float32 fprop and 1.1-1.3x in dgrad;
    MobileNet-v3's 5x5 72@56/2 1.6x in FP16); below it on stride-1 5x5 (EfficientNet's and MobileNet-v3's on
    28 x 28 planes: 0.94-0.97x in FP16) and on 7x7 (ConvNeXt-T: 0.45-0.73x, one output row a thread within
    the registers). On a CPU device (PoCL runs work-items one after another) the tile's one-output default
    stays first: this form was not timed there."""
    taps = spec.r * spec.s
    fast = taps <= 9 or (taps <= 25 and spec.stride != (1, 1))
    return specialised + 2 if fast and device.is_gpu else specialised


# -- variants --------------------------------------------------------------------------------------
class _Rows(Variant):
    """What the two passes share: the stencil of a pass (``stencil``), its kernel's name and buffers."""

    family = "depthwise"
    grouped = True
    exact = True
    tolerance = 1e-5
    specialised = 19
    space_lead = 1
    dtypes = ALL_DTYPES
    layouts = frozenset({"nchw"})
    kernel = ""

    def stencil(self, spec: ConvSpec, epilogue: Epilogue = Epilogue()) -> Stencil:
        raise NotImplementedError

    def buffers(self, sto: Storage, epilogue: Epilogue) -> tuple[tuple[Arg, ...], tuple[str, ...]]:
        """The kernel's buffers and the launch's argument names."""
        raise NotImplementedError

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device) or too_big(spec)
        if why is None and not spec.depthwise:
            return "only depthwise layers (groups == C > 1)"
        if why is None:
            st = self.stencil(spec)
            why = RowsTile.of(st, rows_default(st, device)).problem(device)
        return why

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        return rows_rank(spec, device, self.specialised)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return rows_default(self.stencil(spec), device)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return rows_space(self.stencil(spec), device)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        t = RowsTile.of(self.stencil(spec, epilogue), params)
        why = t.problem(device)
        if why:
            raise ValueError(f"{self.name}: {why}")
        sto = Storage(spec.dtype)
        bufs, args = self.buffers(sto, epilogue)
        kernel = Kernel(self.kernel, bufs, rows_body(t, epilogue), (t.bt, 1, 1),
                        comment=f"{self.name}: {params.short()}")
        launch = Launch(self.kernel, (t.blocks, 1, 1), (t.bt, 1, 1), args)
        return Plan(self.name, self.family, spec, params, (kernel,), (launch,), tolerance=self.tolerance,
                    epilogue=epilogue)


class DepthwiseRows(_Rows):
    """fprop of a depthwise layer (any multiplier) on NCHW rows that align to 8 or 16 bytes, filters up to
    7x7, any stride, dilation and padding, float32 or half storage; bias, residual, an activation and a
    concat's channel offset in the epilogue."""

    name = "depthwise_rows"
    residual_ok = True
    offset_ok = True
    kernel = "conv_depthwise_rows"

    def stencil(self, spec: ConvSpec, epilogue: Epilogue = Epilogue()) -> Stencil:
        return fprop_stencil(spec, epilogue)

    def buffers(self, sto: Storage, epilogue: Epilogue) -> tuple[tuple[Arg, ...], tuple[str, ...]]:
        return (sto.buf("x"), sto.buf("w")) + out_args(epilogue, sto), ("x", "w") + out_refs(epilogue)


class DepthwiseRowsDgrad(_Rows):
    """dgrad of a stride-1 depthwise layer (multiplier 1) on NCHW rows that align to 8 or 16 bytes, filters
    up to 7x7: the forward kernel on dy with the rotated filter."""

    name = "depthwise_rows_dgrad"
    passes = frozenset({"dgrad"})
    kernel = "dgrad_depthwise_rows"

    def stencil(self, spec: ConvSpec, epilogue: Epilogue = Epilogue()) -> Stencil:
        no_epilogue(self.name, epilogue)
        return dgrad_stencil(spec)

    def buffers(self, sto: Storage, epilogue: Epilogue) -> tuple[tuple[Arg, ...], tuple[str, ...]]:
        return (sto.buf("y"), sto.buf("w"), sto.buf("x", readonly=False)), ("y", "w", "x")


register(DepthwiseRows())
register(DepthwiseRowsDgrad())
