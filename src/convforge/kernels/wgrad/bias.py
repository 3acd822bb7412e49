"""The bias gradient: db[k] = sum over n, p, q of dy[n, k, p, q], a deterministic reduction.

Not a conv Variant (it computes no pass of a convolution): :func:`bias_grad_plan` gives a Plan
that reads "y" (dy) and writes "bias" (db), which the training path runs beside a layer's wgrad.
Block (j, k) sums slice j of channel k's N*P*Q values: its threads read consecutive pixels of one
image (float4s where P*Q is a multiple of 4), each keeps a running sum, and a fixed tree in shared
memory adds the threads' sums. With ``sp`` > 1 slices per channel (layers with few channels and
many pixels, to fill the GPU) a second kernel adds the ``sp`` partial sums in slice order. Every
addition happens in the same order on every run.
"""

from __future__ import annotations

from convforge.codegen.dialect import Buf, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels.gemm import elementwise
from convforge.params import Params
from convforge.plan import DeviceInfo, Launch, Plan
from convforge.spec import ConvSpec

NAME = "bias_grad"
_SLICE = 8192  # values per block at least when splitting a channel


def bias_grad_default(spec: ConvSpec, device: DeviceInfo) -> Params:
    """256 threads (64 on CPUs); on GPUs enough slices per channel for four blocks per compute
    unit, each over at least 8192 values."""
    if not device.is_gpu:
        return Params(bt=64, sp=1)
    npq = spec.n * spec.p * spec.q
    sp = max(1, min(cdiv(4 * max(device.units, 1), spec.k), npq // _SLICE))
    return Params(bt=256, sp=sp)


def bias_grad_space(spec: ConvSpec, device: DeviceInfo) -> list[Params]:
    """The default, then other block sizes and slice counts."""
    npq = spec.n * spec.p * spec.q
    out = [bias_grad_default(spec, device)]
    for bt in (64, 128, 256, 512):
        for sp in (1, 2, 4, 8, 16, 32):
            if bt <= device.max_threads and (sp == 1 or npq // sp >= 1024):
                out.append(Params(bt=bt, sp=sp))
    return list(dict.fromkeys(out))


def bias_grad_plan(spec: ConvSpec, device: DeviceInfo, params: Params | None = None) -> Plan:
    """Plan of db = dy summed over N, P and Q: reads "y", writes "bias" (float32, groups
    irrelevant). ``params`` (bt: threads per block, a power of two; sp: slices per channel)
    default to :func:`bias_grad_default`."""
    if spec.dtype != "float32":
        raise ValueError(f"{NAME}: only float32 dy (got {spec.dtype})")
    p = params if params is not None else bias_grad_default(spec, device)
    bt, sp = int(p.get("bt", 0)), int(p.get("sp", 1))
    if bt < 1 or bt & (bt - 1) or bt > device.max_threads:
        raise ValueError(f"{NAME}: bt ({bt}) must be a power of two up to {device.max_threads}")
    npq = spec.n * spec.p * spec.q
    if not 1 <= sp <= npq:
        raise ValueError(f"{NAME}: sp ({sp}) must be in 1..{npq} (N*P*Q)")
    out = "bias" if sp == 1 else "bpart"
    kern = _sum_kernel(spec, bt, sp, out)
    kernels: list[Kernel] = [kern]
    steps = [Launch(kern.name, (sp, spec.k, 1), (bt, 1, 1), ("y", out))]
    work: tuple[tuple[str, int], ...] = ()
    if sp > 1:
        body = ["float s = bpart[e];", f"for (int j = 1; j < {sp}; ++j) s += bpart[j * {spec.k} + e];",
                "bias[e] = s;"]
        red, grid = elementwise(f"{NAME}_reduce", spec.k, (Buf("bpart"), Buf("bias", readonly=False)), body,
                                f"sum of {sp} slices per channel, in slice order")
        kernels.append(red)
        steps.append(Launch(red.name, grid, red.block, ("bpart", "bias")))
        work = (("bpart", 4 * sp * spec.k),)
    return Plan(NAME, "direct", spec, p, tuple(kernels), tuple(steps), work, tolerance=1e-5)


def _sum_kernel(spec: ConvSpec, bt: int, sp: int, out: str) -> Kernel:
    """Block (j, k): slice j of channel k's values into ``out[j * K + k]``."""
    pq, kpq = spec.p * spec.q, spec.k * spec.p * spec.q
    v = 4 if pq % 4 == 0 else 1
    chunks = spec.n * pq // v  # vectors of v values, none straddling two images
    per = cdiv(chunks, sp)
    code = Code()
    code(f"SHARED float part[{bt}];",
         "const int t = LOCAL_ID(0), j = GROUP_ID(0), k = GROUP_ID(1);",
         f"const int e0 = j * {per}, e1 = min(e0 + {per}, {chunks});",
         f"const GLOBAL_PTR float* yk = y + k * {pq};",
         "float acc = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;")

    def value(e: str) -> str:
        at = f"(({e}) / {pq // v}) * {kpq} + (({e}) % {pq // v}) * {v}"
        if v == 4:
            return f"sum4(VLOAD4(0, yk + {at}))"
        return f"yk[{at}]"

    # four loads in flight per thread (four running sums, added in a fixed order at the end)
    code("int e = e0 + t;")
    with code.block(f"for (; e + {3 * bt} < e1; e += {4 * bt})"):
        code(f"acc += {value('e')};", f"acc1 += {value(f'e + {bt}')};",
             f"acc2 += {value(f'e + {2 * bt}')};", f"acc3 += {value(f'e + {3 * bt}')};")
    with code.block(f"for (; e < e1; e += {bt})"):
        code(f"acc += {value('e')};")
    code("acc = (acc + acc1) + (acc2 + acc3);")
    code("part[t] = acc;", "BARRIER();")
    half = bt // 2
    while half >= 1:
        code(f"if (t < {half}) part[t] += part[t + {half}];", "BARRIER();")
        half //= 2
    code(f"if (t == 0) {out}[j * {spec.k} + k] = part[0];")
    return Kernel(f"{NAME}_sum", (Buf("y"), Buf(out, readonly=False)), code.text(), (bt, 1, 1),
                  helpers=_SUM4 if v == 4 else "", comment=f"{NAME}: dy summed over N*P*Q, bt={bt} sp={sp}")


_SUM4 = "DEVICE float sum4(const float4 d) { return (d.x + d.y) + (d.z + d.w); }"
