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

from convforge.codegen.dialect import Buf, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs
from convforge.kernels.gemm import too_big
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

_REGS = 160  # a rough cap on the floats a thread holds (taps + row segment + accumulators)


@dataclass(frozen=True)
class NhwcTile:
    """Derived sizes of one parameter set on one layer."""

    spec: ConvSpec
    bc: int  # channels per block (threads along K, fastest)
    bt: int  # pixel tiles per block
    tq: int  # outputs per thread along a row
    tp: int  # output rows per thread

    @classmethod
    def of(cls, spec: ConvSpec, p: Params) -> NhwcTile:
        return cls(spec, p.bc, p.bt, p.tq, p.tp)

    @property
    def threads(self) -> int:
        return self.bc * self.bt

    @property
    def seg(self) -> int:
        """Input columns one thread reads per row."""
        return (self.tq - 1) * self.spec.stride[1] + self.spec.eff_s

    @property
    def rows(self) -> int:
        """Input rows one thread reads."""
        return (self.tp - 1) * self.spec.stride[0] + self.spec.eff_r

    @property
    def grid(self) -> tuple[int, int, int, int, int]:
        """(q tiles, p tiles, pixel-tile blocks, channel blocks, blocks in all)."""
        s = self.spec
        nq, np_ = cdiv(s.q, self.tq), cdiv(s.p, self.tp)
        ntb, ncb = cdiv(s.n * np_ * nq, self.bt), cdiv(s.k, self.bc)
        return nq, np_, ntb, ncb, ntb * ncb

    def problem(self, device: DeviceInfo) -> str | None:
        """None when the generator takes this tile on ``device``, else what is wrong."""
        if min(self.bc, self.bt, self.tq, self.tp) < 1:
            return "bc, bt, tq and tp must be >= 1"
        if not 1 <= self.threads <= device.max_threads:
            return f"bc * bt ({self.threads}) threads must be 1..{device.max_threads}"
        if self.tp * self.tq > 32:
            return f"tp * tq ({self.tp * self.tq}) outputs per thread must be <= 32"
        if self.spec.r * self.spec.s + self.seg + self.tp * self.tq > _REGS:
            return f"taps, row segment and outputs ({self.spec.r * self.spec.s} + {self.seg} + " \
                   f"{self.tp * self.tq}) must fit in {_REGS} registers"
        return None


def nhwc_body(t: NhwcTile, epi: Epilogue) -> str:
    """The kernel body of tile ``t``: one channel and tp x tq outputs per thread."""
    s = t.spec
    (sh, sw), (dh, dw) = s.stride, s.dilation
    nq, np_, ntb, _, _ = t.grid
    m = s.kg  # outputs per input channel
    kt, koff = epi.k_total or s.k, epi.k_offset
    code = Code()
    code("const int tid = LOCAL_ID(0);",
         f"const int lk = tid % {t.bc}, lt = tid / {t.bc};",
         "const int bid = GROUP_ID(0);  // pixel tiles fastest: neighbours share their halo through L2",
         f"const int k = (bid / {ntb}) * {t.bc} + lk, tile = (bid % {ntb}) * {t.bt} + lt;")
    with code.block(f"if (k < {s.k} && tile < {s.n * np_ * nq})"):
        code(f"const int qt = tile % {nq}, pt = (tile / {nq}) % {np_}, n = tile / {nq * np_};",
             f"const int p0 = pt * {t.tp}, q0 = qt * {t.tq};",
             f"const int y0 = p0 * {sh} - {s.pad[0]}, x0 = q0 * {sw} - {s.pad[2]};",
             f"const int xb = n * {s.h * s.w * s.c} + {f'k / {m}' if m > 1 else 'k'};")
        for r, c in itertools.product(range(s.r), range(s.s)):
            code(f"const float f{r}_{c} = LDG(w + k * {s.r * s.s} + {r * s.s + c});")
        accs = [f"acc{i}_{j}" for i, j in itertools.product(range(t.tp), range(t.tq))]
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
                    code(f"const float e{e} = in{e} ? LDG(x + rb + {e * s.c}) : 0.0f;")
                for i, r in users:
                    for jq, c in itertools.product(range(t.tq), range(s.s)):
                        code(f"acc{i}_{jq} = FMA(e{jq * sw + c * dw}, f{r}_{c}, acc{i}_{jq});")
        for i in range(t.tp):
            with code.block(f"if (p0 + {i} < {s.p})"):
                for jq in range(t.tq):
                    idx = f"((n * {s.p} + p0 + {i}) * {s.q} + q0 + {jq}) * {kt} + {koff} + k" if koff else \
                        f"((n * {s.p} + p0 + {i}) * {s.q} + q0 + {jq}) * {kt} + k"
                    val = epi.apply(f"acc{i}_{jq}", "k", idx, offset_done=True)
                    code(f"if (q0 + {jq} < {s.q}) y[{idx}] = {val};")
    return code.text()


def nhwc_default(spec: ConvSpec, device: DeviceInfo) -> Params:
    """An untuned tile: a warp of consecutive channels (fewer when K is small) per pixel tile, 256
    threads; per thread 4 x 8 outputs for 5x5 and larger filters (a 7x7 row segment of 14 inputs then
    serves 8 outputs of 4 rows: ConvNeXt-T 96@56 0.063 ms against 0.114 for 2 x 4 on an H100), one
    row of 4 at stride 2 (the rows two output rows share are fewer), 2 x 4 otherwise (sweep of the
    grouped suite's depthwise layers, docs/BENCHMARKS.md); small tiles on a CPU, where PoCL runs one
    work-item after another."""
    if not device.is_gpu:
        return Params(bc=min(spec.k, 4), bt=4, tq=2 if spec.q >= 2 else 1, tp=1)
    bc = min(32, spec.k)
    bt = max(1, min(256 // bc, device.max_threads // bc))
    if spec.eff_r * spec.eff_s >= 25:
        tq, tp = min(8, spec.q), min(4, spec.p)
    elif spec.stride[0] > 1:
        tq, tp = min(4, spec.q), 1
    else:
        tq, tp = min(4, spec.q), min(2, spec.p)
    for tq_, tp_ in ((tq, tp), (tq, 1), (min(2, tq), 1), (1, 1)):
        t = NhwcTile(spec, bc, bt, tq_, tp_)
        if t.problem(device) is None:
            return Params(bc=bc, bt=bt, tq=tq_, tp=tp_)
    return Params(bc=bc, bt=bt, tq=1, tp=1)


def nhwc_space(spec: ConvSpec, device: DeviceInfo) -> list[Params]:
    """The default first, then 64..512 threads of 16..128 channels, 1..8 x 1..4 outputs a thread."""
    out = [nhwc_default(spec, device)]
    for bc, threads, tq, tp in itertools.product((16, 32, 64, 128), (64, 128, 256, 512), (1, 2, 4, 8), (1, 2, 4)):
        if bc > max(16, spec.k) or threads < bc or tq > max(1, spec.q) or tp > max(1, spec.p):
            continue
        prm = Params(bc=bc, bt=threads // bc, tq=tq, tp=tp)
        if prm not in out and NhwcTile.of(spec, prm).problem(device) is None:
            out.append(prm)
    return out


class DepthwiseNhwc(Variant):
    """fprop of a depthwise layer (groups == C, any multiplier) on NHWC activations, any stride,
    dilation and padding; bias, residual, ReLU and a concat's channel offset in the epilogue."""

    name = "depthwise_nhwc"
    family = "depthwise"
    grouped = True
    layouts = frozenset({"nhwc"})
    exact = True
    residual_ok = True
    offset_ok = True
    tolerance = 1e-5
    specialised = 20
    space_lead = 1

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if not spec.depthwise:
            return "only depthwise layers (groups == C > 1)"
        why = super().applies(spec, device) or too_big(spec)
        if why is None and NhwcTile(spec, 1, 1, 1, 1).problem(device):
            return f"one output's {spec.r}x{spec.s} taps do not fit in {_REGS} registers"
        return why

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return nhwc_default(spec, device)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return nhwc_space(spec, device)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        t = NhwcTile.of(spec, params)
        why = t.problem(device)
        if why:
            raise ValueError(f"{self.name}: {why}")
        name = "conv_depthwise_nhwc"
        kernel = Kernel(name, (Buf("x"), Buf("w")) + out_args(epilogue), nhwc_body(t, epilogue),
                        (t.threads, 1, 1), comment=f"{self.name}: {params.short()}")
        launch = Launch(name, (t.grid[4], 1, 1), (t.threads, 1, 1), ("x", "w") + out_refs(epilogue))
        return Plan(self.name, self.family, spec, params, (kernel,), (launch,), tolerance=self.tolerance,
                    epilogue=epilogue)


register(DepthwiseNhwc())
