"""wgrad of a narrow grouped layer (ResNeXt's and RegNet's groups of 2 to 32 channels) on CUDA cores, NHWC:
dw[k, c, r, s] = sum over N*P*Q of x(window of tap r, s; channel c of k's group) * dy[k], in float32,
float16 and bfloat16 storage (FP32 sums), deterministic (fixed trees, an ordered sum of slices).

The tensor-core grouped wgrad runs such groups at 0.33-1.0x cuDNN-best (its tiles are mostly padding), so
a half layer goes to PyTorch there. This form is depthwise_wgrad's blocked form with lanes that sum several
input channels: lane (k, chunk) of a block sums ``cw`` consecutive input channels of k's group (one 8- or
16-byte load of a pixel's channels, ``cw`` sums a tap) against k's dy. Consecutive lanes take the chunks of
one k, then the next k: a warp's x loads of a pixel are one run (the lanes of one group's k read the same
bytes), its dy loads a broadcast per k. Threads ``bs`` along the items (``tp`` x ``tq`` outputs of one
image), each item's input row segments read once and used for every tap and output row they meet; then a
fixed shared-memory tree over each lane's threads, in 8 KiB chunks; with ``ns`` > 1 slices each writes a
partial filter and a second kernel adds them in a fixed order.

Reached by name only (``algo="wgrad_grouped"``, ``named_only``): it ran well below cuDNN-best FP16 on
ResNeXt-50's layers (docs/NOTES-wgrad.md); ``auto`` runs such half layers on the tensor cores instead
(``wgrad_grouped_mma``, kernels/tensorcore/sm80/grouped_mma_wgrad.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from convforge.codegen.dialect import FLOAT32, Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import ThreadWindow
from convforge.kernels.depthwise_wgrad import blocked_splits, slice_sum, sum_chunk, tree_store, vec_load
from convforge.kernels.dgrad import no_epilogue
from convforge.kernels.gemm import too_big
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

_REGS = 160  # a rough cap on the floats a thread holds (sums, a row segment, the item's dy)
_MAX_TAPS = 49  # 7x7: a lane's sums stay in registers under the 128-register bound
_WIDTHS = (8, 4, 2, 1)  # input channels a lane may sum (a 16-, 8-, 4-byte or scalar load of halves)


@dataclass(frozen=True)
class GTile(ThreadWindow):
    """A parameter set on one layer: ``bl`` lanes of ``cw`` input channels x ``bs`` threads along the
    items of ``tp`` x ``tq`` outputs; ``mb`` blocks a compute unit in the launch bound (caps the registers
    that ptxas spends hoisting the loads of every row)."""

    spec: ConvSpec
    cw: int
    bl: int
    bs: int
    tq: int
    tp: int
    mb: int = 1

    @classmethod
    def of(cls, spec: ConvSpec, p: Params) -> GTile:
        return cls(spec, p.cw, p.bl, p.bs, p.tq, p.tp, p.get("mb", 1))

    @property
    def chunks(self) -> int:
        """Lanes an output channel takes: its group's input channels in chunks of cw."""
        return self.spec.cg // self.cw

    @property
    def lanes(self) -> int:
        return self.spec.k * self.chunks

    @property
    def threads(self) -> int:
        return self.bl * self.bs

    @property
    def items(self) -> int:
        s = self.spec
        return s.n * cdiv(s.p, self.tp) * cdiv(s.q, self.tq)


    def problem(self, device: DeviceInfo) -> str | None:
        s = self.spec
        if self.cw not in _WIDTHS or s.cg % self.cw:
            return f"cw ({self.cw}) must be one of {_WIDTHS} and divide the group's {s.cg} input channels"
        if min(self.bl, self.bs, self.tq, self.tp) < 1 or self.bs & (self.bs - 1) or not 1 <= self.mb <= 8:
            return f"bs ({self.bs}) must be a power of two, bl, tq, tp >= 1 and mb ({self.mb}) 1..8"
        if not 1 <= self.threads <= device.max_threads:
            return f"{self.threads} threads must be 1..{device.max_threads}"
        held = (s.r * s.s + self.seg) * self.cw + self.tp * self.tq
        if self.tp * self.tq > 32 or held > _REGS:
            return f"sums, the row segment and the item's dy ({held} floats) must fit in {_REGS} registers"
        return None


class WgradGrouped(Variant):
    """wgrad of a grouped layer of narrow groups, NHWC, in lanes of input channels (module docstring)."""

    name = "wgrad_grouped"
    family = "direct"
    passes = frozenset({"wgrad"})
    grouped = True
    exact = True
    tolerance = 1e-5
    specialised = 20
    dtypes = frozenset({"float32", "float16", "bfloat16"})
    layouts = frozenset({"nhwc"})
    named_only = True  # timed below cuDNN-best (module docstring)

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.groups == 1 or spec.depthwise:
            return "only grouped layers of more than one input channel a group (depthwise: depthwise_wgrad)"
        why = super().applies(spec, device) or too_big(spec)
        if why is None and spec.r * spec.s > _MAX_TAPS:
            return f"a {spec.r}x{spec.s} filter's sums do not fit in registers (at most {_MAX_TAPS} taps)"
        return why

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """Lanes of 4 channels (8 bytes of halves) where the group allows, else 2 or 1; 32 lanes x 4
        threads under a bound of 128 registers (170 at stride > 1); items of 2 x 4 outputs (2 x 2 at stride > 1;
        fewer where the registers ask);
        slices as depthwise_wgrad's. Unmeasured: depthwise_wgrad's measured 3x3 shape."""
        cw = next(w for w in (4, 2, 1) if spec.cg % w == 0)
        gpu, strided = device.is_gpu, max(spec.stride) > 1
        mb = (3 if strided else 4) if gpu else 1  # 170 / 128 registers: ptxas spilled at 128 on stride 2
        shapes = ((4, 2, cw), (2, 2, cw), (2, 1, cw), (1, 1, 1))  # stride > 1: items 2 wide
        for tq, tp, cw_ in shapes[1:] if strided else shapes:
            t = GTile(spec, cw_, 32 if gpu else 4, 4 if gpu else 8, min(tq, spec.q), min(tp, spec.p), mb)
            if t.problem(device) is None:
                return _params(t, self._splits(t, device))
        return _params(GTile(spec, 1, 1, 1, 1, 1), 1)

    def _splits(self, t: GTile, device: DeviceInfo) -> int:
        s = t.spec
        return blocked_splits(s, t.threads, t.bl, t.bs, t.items, device, s.r * s.s * t.cw, t.tp,
                              lane_blocks=cdiv(t.lanes, t.bl))

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        out = [self.default(spec, device)]
        for cw, bl, bs, tq, tp, ns, mb in itertools.product(_WIDTHS, (8, 16, 32, 64), (1, 2, 4, 8, 16), (1, 2, 4, 8),
                                                           (1, 2, 4), (1, 4, 16, 64, 256), (1, 4)):
            t = GTile(spec, cw, bl, bs, min(tq, spec.q), min(tp, spec.p), mb if bl * bs <= 128 else 1)
            if t.threads < 32 or ns > t.items or t.problem(device):
                continue
            prm = _params(t, ns)
            if prm not in out:
                out.append(prm)
        return out

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 4 * params.ns * spec.k * spec.cg * spec.r * spec.s if params.ns > 1 else 0

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        t = GTile.of(spec, params)
        why = t.problem(device)
        if why:
            raise ValueError(f"{self.name}: {why}")
        ns = params.ns
        if not 1 <= ns <= t.items:
            raise ValueError(f"{self.name}: ns ({ns}) must be 1..{t.items} (items of tp x tq outputs)")
        sto = Storage(spec.dtype)
        out = "w" if ns == 1 else "part"
        wbuf = sto.buf(out, readonly=False) if ns == 1 else FLOAT32.buf(out, readonly=False)
        kern = Kernel("wgrad_grouped", (sto.buf("x"), sto.buf("y"), wbuf), _body(t, ns, out), (t.threads, 1, 1),
                      comment=f"{self.name}: {params.short()}", min_blocks=t.mb)
        kernels, steps = [kern], [Launch("wgrad_grouped", (cdiv(t.lanes, t.bl), ns, 1), (t.threads, 1, 1),
                                         ("x", "y", out))]
        workspace: tuple[tuple[str, int], ...] = ()
        if ns > 1:
            sk, launch = slice_sum(spec, ns, sto)
            kernels.append(sk)
            steps.append(launch)
            workspace = (("part", self.workspace_bytes(spec, params)),)
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps), workspace,
                    tolerance=self.tolerance, epilogue=epilogue)


def _params(t: GTile, ns: int) -> Params:
    extra = {"mb": t.mb} if t.mb != 1 else {}
    return Params({"cw": t.cw, "bl": t.bl, "bs": t.bs, "tq": t.tq, "tp": t.tp, "ns": ns, **extra})


def _body(t: GTile, ns: int, out: str) -> str:
    """Lane (k, chunk) of thread tid walks every bs-th item of its block's slice: the item's dy of k, then
    each input row segment (channels c0 .. c0 + cw - 1 of a pixel in one load) once, FMAs into cw sums a
    tap; then the chunked tree and the store of dw[k, chunk * cw + v, r, s] (or the slice's partial)."""
    s = t.spec
    sto = Storage(s.dtype)
    (sh, sw), (dh, dw) = s.stride, s.dilation
    rs, cw = s.r * s.s, t.cw
    nq, np_ = cdiv(s.q, t.tq), cdiv(s.p, t.tp)
    per = cdiv(t.items, ns)
    chunk = sum_chunk(rs * cw, t.threads)
    code = Code()
    code(f"SHARED float part_[{chunk * t.threads}];  // {chunk} of the {rs} taps x {cw} channels x {t.threads} threads",
         f"const int tid = LOCAL_ID(0), ll = tid % {t.bl}, lt = tid / {t.bl};  // lanes fastest",
         f"const int lane = GROUP_ID(0) * {t.bl} + ll, lk = min(lane, {t.lanes - 1});",
         f"const int k = lk / {t.chunks}, ch = lk % {t.chunks};  // output channel; chunk of its group's inputs",
         f"const int c0 = (k / {s.kg}) * {s.cg} + ch * {cw};  // the chunk's first input channel",
         f"const int it0 = GROUP_ID(1) * {per}, it1 = min(it0 + {per}, {t.items});")
    accs = [f"a{r}_{c}_{v}" for r, c, v in itertools.product(range(s.r), range(s.s), range(cw))]
    code(*(f"float {a} = 0.0f;" for a in accs))
    with code.block(f"for (int it = it0 + lt; it < it1; it += {t.bs})  /* items of {t.tp} x {t.tq} outputs */"):
        code(f"const int qc = it % {nq}, pc = (it / {nq}) % {np_}, n = it / {nq * np_};",
             f"const int p0 = pc * {t.tp}, q0 = qc * {t.tq};",
             f"const int y0 = p0 * {sh} - {s.pad[0]}, x0 = q0 * {sw} - {s.pad[2]};")
        for i, jq in itertools.product(range(t.tp), range(t.tq)):
            ok = f"p0 + {i} < {s.p} && q0 + {jq} < {s.q}"
            idx = f"y + ((n * {s.p} + p0 + {i}) * {s.q} + q0 + {jq}) * {s.k} + k"
            code(f"const float g{i}_{jq} = ({ok}) ? {sto.ldg(idx)} : 0.0f;")
        for ir in range(t.rows):
            users = [(i, (ir - i * sh) // dh) for i in range(t.tp)
                     if ir >= i * sh and (ir - i * sh) % dh == 0 and (ir - i * sh) // dh < s.r]
            if not users:
                continue
            with code.block(f"/* input row {ir} */"):
                _row(code, t, sto, ir)
                for i, r in users:
                    for jq, c, v in itertools.product(range(t.tq), range(s.s), range(cw)):
                        a = f"a{r}_{c}_{v}"
                        code(f"{a} = FMA({_lane(f'e{jq * sw + c * dw}', v, cw)}, g{i}_{jq}, {a});")
    _store(code, t, ns, out, accs, chunk)
    return code.text()


def _row(code: Code, t: GTile, sto: Storage, ir: int) -> None:
    """e0 .. e{seg-1}: channels c0 .. c0 + cw - 1 of input row y0 + ir, columns x0 .. (zero outside the
    plane; the row's guard in each load, so that ptxas may hoist the loads of later rows)."""
    s = t.spec
    base = f"x + ((n * {s.h} + y0 + {ir}) * {s.w} + x0) * {s.c} + c0"
    for e in range(t.seg):
        ok = f"(unsigned)(y0 + {ir}) < {s.h}u && (unsigned)(x0 + {e}) < {s.w}u"
        if t.cw in (4, 8):
            vec_load(code, sto, f"e{e}", t.cw, ok, f"{base} + {e * s.c}")
        elif t.cw == 2:
            code(f"const float e{e}x = ({ok}) ? {sto.ldg(f'{base} + {e * s.c}')} : 0.0f;",
                 f"const float e{e}y = ({ok}) ? {sto.ldg(f'{base} + {e * s.c + 1}')} : 0.0f;")
        else:
            code(f"const float e{e} = ({ok}) ? {sto.ldg(f'{base} + {e * s.c}')} : 0.0f;")


def _lane(name: str, v: int, cw: int) -> str:
    """Channel v of the cw channels loaded as ``name`` (a float4, two float4s, two floats or one)."""
    if cw == 1:
        return name
    if cw == 2:
        return f"{name}{'xy'[v]}"
    if cw == 4:
        return f"{name}.{'xyzw'[v]}"
    return f"{name}{'ab'[v // 4]}.{'xyzw'[v % 4]}"


def _store(code: Code, t: GTile, ns: int, out: str, accs: list[str], chunk: int) -> None:
    """The sums through shared memory ``chunk`` at a time (depthwise_wgrad.tree_store): lane (k, chunk)'s
    sum j (tap j / cw, channel v = j % cw) to dw, or to the slice's partial filter."""
    s = t.spec
    rs, cw = s.r * s.s, t.cw
    kw = f"(k * {s.cg} + ch * {cw} + j % {cw}) * {rs} + j / {cw}"
    dst = f"GROUP_ID(1) * {s.k * s.cg * rs} + {kw}" if ns > 1 else kw
    sto = Storage(s.dtype)

    def store(row: str) -> str:
        value = f"part_[{row} * {t.threads} + ll]"
        return sto.store(out, dst, value) if out == "w" else f"{out}[{dst}] = {value}"
    tree_store(code, accs, chunk, t.threads, t.bl, t.bs, f"if (lane < {t.lanes})", store)


register(WgradGrouped())
