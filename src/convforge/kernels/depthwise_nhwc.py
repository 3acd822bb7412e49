"""Depthwise convolution on channels-last (NHWC) activations: ConvNeXt's and MobileNet's layers when
their tensors are in torch's channels_last memory format, without the two copies an NCHW kernel
costs there (one into NCHW before the conv, one back for the permute -> LayerNorm that follows).

In NHWC the channels of one pixel are adjacent, so the natural unit is not a plane tile (as in
``depthwise.py``) but a channel per thread: the ``bc`` threads of a block that share a pixel tile
take ``bc`` consecutive channels, so every input load and output store of a warp touches one
contiguous 128-byte line. Each thread keeps its channel's R*S taps in registers and computes
``tp`` x ``tq`` adjacent outputs; it reads each input row segment it needs once, straight from
global memory (the ``bt`` tiles of a block are neighbours along the row, so the rows they share come
from L1), and uses it for every output row it feeds. Blocks are numbered with the pixel tiles
fastest, so neighbouring tiles (which share a halo) run together and the halo comes from L2.

A channel multiplier m = K / C > 1 reads input channel k / m for output channel k. The epilogue
(bias, residual in the same NHWC layout, ReLU, a concat's channel offset) is applied on the store.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from convforge.codegen.dialect import Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import ThreadWindow, out_args, out_refs
from convforge.kernels.depthwise import ALL_DTYPES
from convforge.kernels.gemm import too_big
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

# The floats a thread holds (taps + row segment + accumulators): ptxas's count follows it within a few
# registers. Any tile up to _REGS compiles without spills; the defaults keep to _DEFAULT_REGS.
_REGS = 240
_DEFAULT_REGS = 160


@dataclass(frozen=True)
class NhwcTile(ThreadWindow):
    """Derived sizes of one parameter set on one layer."""

    spec: ConvSpec
    bc: int  # channel groups per block (threads along K, fastest)
    bt: int  # pixel tiles per block
    tq: int  # outputs per thread along a row
    tp: int  # output rows per thread
    cv: int = 1  # consecutive channels per thread: one 16-byte (8 halves, 4 floats) or 8-byte load a pixel

    @classmethod
    def of(cls, spec: ConvSpec, p: Params) -> NhwcTile:
        return cls(spec, p.bc, p.bt, p.tq, p.tp, p.get("cv", 1))

    @property
    def threads(self) -> int:
        return self.bc * self.bt


    @property
    def grid(self) -> tuple[int, int, int, int, int]:
        """(q tiles, p tiles, pixel-tile blocks, channel blocks, blocks in all)."""
        s = self.spec
        nq, np_ = cdiv(s.q, self.tq), cdiv(s.p, self.tp)
        ntb, ncb = cdiv(s.n * np_ * nq, self.bt), cdiv(s.k, self.bc * self.cv)
        return nq, np_, ntb, ncb, ntb * ncb

    @property
    def vstore(self) -> bool:
        """The cv outputs of a pixel go out as one vector (aligned in the tensor written)."""
        return self.cv > 1

    def problem(self, device: DeviceInfo, epi: Epilogue = Epilogue(), regs: int = _REGS) -> str | None:
        """None when the generator takes this tile on ``device`` (in ``regs`` floats a thread), else what
        is wrong."""
        s = self.spec
        if min(self.bc, self.bt, self.tq, self.tp) < 1:
            return "bc, bt, tq and tp must be >= 1"
        if not 1 <= self.threads <= device.max_threads:
            return f"bc * bt ({self.threads}) threads must be 1..{device.max_threads}"
        if self.tp * self.tq > 32:
            return f"tp * tq ({self.tp * self.tq}) outputs per thread must be <= 32"
        if self.cv not in (1, 4, 8) or (self.cv == 8 and s.dtype == "float32"):
            return f"cv ({self.cv}) must be 1, 4 or (half storage) 8 channels a thread"
        if self.cv > 1 and (s.kg != 1 or s.k % self.cv or (epi.k_total or s.k) % self.cv or epi.k_offset % self.cv):
            return f"cv={self.cv} needs multiplier 1 and channel counts (and a concat's offset) that are " \
                   f"multiples of {self.cv}"
        taps = s.r * s.s
        if self.cv * (taps + self.seg + self.tp * self.tq) > regs:
            return f"taps, row segment and outputs ({self.cv} x ({taps} + {self.seg} + " \
                   f"{self.tp * self.tq})) must fit in {regs} registers"
        return None


def _vec(name: str, cv: int, e: int) -> str:
    """Channel ``e`` of the cv-vector ``name`` (float, float4, or float4 pair ``name``a/b)."""
    if cv == 1:
        return name
    return f"{name}.{'xyzw'[e]}" if cv == 4 else f"{name}{'ab'[e // 4]}.{'xyzw'[e % 4]}"


def _load_vec(sto: Storage, name: str, cv: int, ok: str, src: str) -> str:
    """The statement(s) loading the cv channels at ``src`` into ``name`` where ``ok``, else zeros."""
    zero = "MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f)"
    if cv == 1:
        return f"const float {name} = {ok} ? {sto.ldg(src)} : 0.0f;"
    if cv == 4:
        return f"const float4 {name} = {ok} ? {sto.vload4('0', src)} : {zero};"
    return f"float4 {name}a = {zero}, {name}b = {zero};\nif ({ok}) {sto.vload8(f'{name}a', f'{name}b', '0', src)};"


def nhwc_body(t: NhwcTile, epi: Epilogue) -> str:
    """The kernel body of tile ``t``: cv channels and tp x tq outputs per thread."""
    s = t.spec
    sto = Storage(s.dtype)
    cv = t.cv
    (sh, sw), (dh, dw) = s.stride, s.dilation
    nq, np_, ntb, _, _ = t.grid
    m = s.kg  # outputs per input channel
    kt, koff = epi.k_total or s.k, epi.k_offset
    code = Code()
    kexpr = f"((bid / {ntb}) * {t.bc} + lk) * {cv}" if cv > 1 else f"(bid / {ntb}) * {t.bc} + lk"
    code("const int tid = LOCAL_ID(0);",
         f"const int lk = tid % {t.bc}, lt = tid / {t.bc};",
         "const int bid = GROUP_ID(0);  // pixel tiles fastest: neighbours share their halo through L2",
         f"const int k = {kexpr}, tile = (bid % {ntb}) * {t.bt} + lt;")
    with code.block(f"if (k < {s.k} && tile < {s.n * np_ * nq})"):
        code(f"const int qt = tile % {nq}, pt = (tile / {nq}) % {np_}, n = tile / {nq * np_};",
             f"const int p0 = pt * {t.tp}, q0 = qt * {t.tq};",
             f"const int y0 = p0 * {sh} - {s.pad[0]}, x0 = q0 * {sw} - {s.pad[2]};",
             f"const int xb = n * {s.h * s.w * s.c} + {f'k / {m}' if m > 1 else 'k'};")
        sfx = [f"{e}_" if cv > 1 else "" for e in range(cv)]
        for e, r, c in itertools.product(range(cv), range(s.r), range(s.s)):
            kk = f"(k + {e})" if e else "k"
            code(f"const float f{sfx[e]}{r}_{c} = {sto.ldg(f'w + {kk} * {s.r * s.s} + {r * s.s + c}')};")
        accs = [f"acc{i}_{j}{'_' + str(e) if cv > 1 else ''}"
                for i, j, e in itertools.product(range(t.tp), range(t.tq), range(cv))]
        code(*(f"float {a} = 0.0f;" for a in accs))
        for e in range(t.seg):
            code(f"const bool in{e} = (unsigned)(x0 + {e}) < {s.w}u;")
        for ir in range(t.rows):
            users = [(i, (ir - i * sh) // dh) for i in range(t.tp)
                     if ir >= i * sh and (ir - i * sh) % dh == 0 and (ir - i * sh) // dh < s.r]
            if not users:
                continue
            with code.block(f"if ((unsigned)(y0 + {ir}) < {s.h}u)  /* input row {ir} */"):
                code(f"const int rb = xb + ((y0 + {ir}) * {s.w} + x0) * {s.c};")
                for e in range(t.seg):
                    code(_load_vec(sto, f"e{e}", cv, f"in{e}", f"x + rb + {e * s.c}"))
                for i, r in users:
                    for jq, c, e in itertools.product(range(t.tq), range(s.s), range(cv)):
                        acc = f"acc{i}_{jq}{'_' + str(e) if cv > 1 else ''}"
                        code(f"{acc} = FMA({_vec(f'e{jq * sw + c * dw}', cv, e)}, f{sfx[e]}{r}_{c}, {acc});")
        for i in range(t.tp):
            with code.block(f"if (p0 + {i} < {s.p})"):
                for jq in range(t.tq):
                    idx = f"((n * {s.p} + p0 + {i}) * {s.q} + q0 + {jq}) * {kt} + {koff} + k" if koff else \
                        f"((n * {s.p} + p0 + {i}) * {s.q} + q0 + {jq}) * {kt} + k"
                    if cv == 1:
                        val = epi.apply(f"acc{i}_{jq}", "k", idx, offset_done=True, storage=sto)
                        code(f"if (q0 + {jq} < {s.q}) {sto.store('y', idx, val)};")
                        continue
                    vals = [epi.apply(f"acc{i}_{jq}_{e}", f"k + {e}", f"{idx} + {e}", offset_done=True, storage=sto)
                            for e in range(cv)]
                    lo = f"MAKE_FLOAT4({', '.join(vals[:4])})"
                    st = sto.vstore4(lo, "0", f"y + {idx}") if cv == 4 else \
                        sto.vstore8(lo, f"MAKE_FLOAT4({', '.join(vals[4:])})", "0", f"y + {idx}")
                    code(f"if (q0 + {jq} < {s.q}) {st};")
    return code.text()


def _cv(spec: ConvSpec, tq: int, tp: int, device: DeviceInfo) -> int:
    """Channels a thread on half storage: 16 bytes (8) where the registers allow, else 8 bytes (4),
    else 1; float32 keeps one channel a thread (its measured default)."""
    if spec.dtype == "float32":
        return 1
    fits = (cv for cv in (8, 4) if NhwcTile(spec, 1, 1, tq, tp, cv).problem(device, regs=_DEFAULT_REGS) is None)
    return next(fits, 1)


def _channel_threads(groups: int) -> int:
    """Threads along the channels for ``groups`` cv-channel groups: all of them up to 64, else the largest
    divisor from 16 to 64 (no block of mostly idle threads: 144 channels in blocks of 128 left 44 % idle),
    else 32."""
    if groups <= 64:
        return groups
    return next((d for d in range(64, 15, -1) if groups % d == 0), 32)


def _half_small(spec: ConvSpec, device: DeviceInfo) -> Params | None:
    """Half storage, filters under 5x5: 4 channels a thread, the channel threads dividing K's groups,
    about 160 threads a block, 4 x 4 outputs a thread at stride 1, 1 x 2 strided (faster than 256-thread,
    2 x 4 / 1 x 4 tiles on MobileNet-v2's FP16 NHWC layers: docs/NOTES-gemm.md); None where that tile
    does not fit."""
    if spec.eff_r * spec.eff_s >= 25 or spec.k % 4:
        return None
    bc = _channel_threads(spec.k // 4)
    tq, tp = (min(4, spec.q), min(4, spec.p)) if spec.stride == (1, 1) else (min(2, spec.q), 1)
    prm = Params(bc=bc, bt=max(1, min(160 // bc, device.max_threads // bc)), tq=tq, tp=tp, cv=4)
    return prm if NhwcTile.of(spec, prm).problem(device, regs=_DEFAULT_REGS) is None else None


def nhwc_default(spec: ConvSpec, device: DeviceInfo) -> Params:
    """An untuned tile: a warp of consecutive channels (fewer when K is small) per pixel tile, 256
    threads; per thread 4 x 8 outputs for 5x5 and larger filters (a 7x7 row segment of 14 inputs then
    serves 8 outputs of 4 rows, about twice as fast as 2 x 4), one
    row of 4 at stride 2 (the rows two output rows share are fewer), 2 x 4 otherwise (sweep of the
    grouped suite's depthwise layers, docs/BENCHMARKS.md); small tiles on a CPU, where PoCL runs one
    work-item after another. Half storage: small filters as :func:`_half_small`; larger ones cv channels
    a thread (8: one 16-byte load a pixel) where the registers allow, fewer outputs a thread then."""
    if not device.is_gpu:
        return Params(bc=min(spec.k, 4), bt=4, tq=2 if spec.q >= 2 else 1, tp=1)
    if spec.dtype != "float32" and (small := _half_small(spec, device)) is not None:
        return small
    bc = min(32, spec.k)
    bt = max(1, min(256 // bc, device.max_threads // bc))
    if spec.eff_r * spec.eff_s >= 25:
        tq, tp = min(8, spec.q), min(4, spec.p)
    elif spec.stride[0] > 1:
        tq, tp = min(4, spec.q), 1
    else:
        tq, tp = min(4, spec.q), min(2, spec.p)
    for tq_, tp_ in ((tq, tp), (tq, 1), (min(2, tq), 1), (1, 1)):
        cv = _cv(spec, tq_, tp_, device)
        if cv > 1:
            bc_ = max(1, min(32, spec.k // cv))
            prm = Params(bc=bc_, bt=max(1, min(256 // bc_, device.max_threads // bc_)), tq=tq_, tp=tp_, cv=cv)
            if NhwcTile.of(spec, prm).problem(device, regs=_DEFAULT_REGS) is None:
                return prm
        t = NhwcTile(spec, bc, bt, tq_, tp_)
        if t.problem(device, regs=_DEFAULT_REGS) is None:
            return Params(bc=bc, bt=bt, tq=tq_, tp=tp_)
    return Params(bc=bc, bt=bt, tq=1, tp=1)


def nhwc_space(spec: ConvSpec, device: DeviceInfo) -> list[Params]:
    """The default first, then 64..512 threads of 16..128 channels, 1..8 x 1..4 outputs a thread
    (and, on half storage, 4 or 8 channels a thread)."""
    out = [nhwc_default(spec, device)]
    cvs = (1,) if spec.dtype == "float32" else (1, 4, 8)
    for bc, threads, tq, tp, cv in itertools.product((16, 32, 64, 128), (64, 128, 256, 512), (1, 2, 4, 8), (1, 2, 4),
                                                     cvs):
        if bc * cv > max(16, spec.k) or threads < bc or tq > max(1, spec.q) or tp > max(1, spec.p):
            continue
        prm = Params({"bc": bc, "bt": threads // bc, "tq": tq, "tp": tp, **({"cv": cv} if cv > 1 else {})})
        if prm not in out and NhwcTile.of(spec, prm).problem(device) is None:
            out.append(prm)
    return out


class DepthwiseNhwc(Variant):
    """fprop of a depthwise layer (groups == C, any multiplier) on NHWC activations, any stride,
    dilation and padding, float32 or half storage; bias, residual, ReLU / GELU / SiLU and a concat's
    channel offset in the epilogue."""

    name = "depthwise_nhwc"
    family = "depthwise"
    grouped = True
    layouts = frozenset({"nhwc"})
    dtypes = ALL_DTYPES
    exact = True
    residual_ok = True
    offset_ok = True
    tolerance = 1e-5
    specialised = 20
    space_lead = 1
    optional_params = {"cv": frozenset({1, 4, 8})}

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if not spec.depthwise:
            return "only depthwise layers (groups == C > 1)"
        why = super().applies(spec, device) or too_big(spec)
        if why is None and NhwcTile(spec, 1, 1, 1, 1).problem(device, regs=_DEFAULT_REGS):
            return f"one output's {spec.r}x{spec.s} taps do not fit in {_DEFAULT_REGS} registers"
        return why

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return nhwc_default(spec, device)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return nhwc_space(spec, device)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        t = NhwcTile.of(spec, params)
        why = t.problem(device, epilogue)
        if why:
            raise ValueError(f"{self.name}: {why}")
        name = "conv_depthwise_nhwc"
        sto = Storage(spec.dtype)
        kernel = Kernel(name, (sto.buf("x"), sto.buf("w")) + out_args(epilogue, sto), nhwc_body(t, epilogue),
                        (t.threads, 1, 1), comment=f"{self.name}: {params.short()}")
        launch = Launch(name, (t.grid[4], 1, 1), (t.threads, 1, 1), ("x", "w") + out_refs(epilogue))
        return Plan(self.name, self.family, spec, params, (kernel,), (launch,), tolerance=self.tolerance,
                    epilogue=epilogue)


register(DepthwiseNhwc())
