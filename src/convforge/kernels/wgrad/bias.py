"""The bias gradient: db[k] = sum over n, p, q of dy[n, k, p, q], a deterministic reduction.

Not a conv Variant (it computes no pass of a convolution): :func:`bias_grad_plan` gives a Plan
that reads "y" (dy) and writes "bias" (db), which the training path runs beside a layer's wgrad.
With ``relu`` (a conv whose epilogue applied bias and ReLU, in training: convforge.torch's conv ->
ReLU node) it also reads "z", the layer's output after the ReLU, masks dy by z > 0 on the way
(ReLU's backward, as ``threshold_backward`` computes it), writes the masked gradient "gm" (what
the layer's dgrad and wgrad then read) and sums that: one pass instead of ReLU's backward and the
bias sum, and no ReLU pass forward.
Block (j, k) sums slice j of channel k's N*P*Q values: its threads read consecutive pixels of one
image (float4s where P*Q is a multiple of 4), each keeps a running sum, and a fixed tree in shared
memory adds the threads' sums. With ``sp`` > 1 slices per channel (layers with few channels and
many pixels, to fill the GPU) a second kernel adds the ``sp`` partial sums in slice order. Every
addition happens in the same order on every run.
"""

from __future__ import annotations

from convforge.codegen.dialect import Buf, Kernel
from convforge.codegen.meta import Code, cdiv, halving_tree
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


def bias_grad_plan(spec: ConvSpec, device: DeviceInfo, params: Params | None = None,
                   relu: bool = False) -> Plan:
    """Plan of db = dy summed over N, P and Q: reads "y", writes "bias" (float32, groups
    irrelevant); with ``relu`` dy masked by "z" > 0 first, the masked dy written to "gm" (module
    docstring). ``params`` (bt: threads per block, a power of two; sp: slices per channel)
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
    kern = _sum_kernel(spec, bt, sp, out, relu)
    kernels: list[Kernel] = [kern]
    steps = [Launch(kern.name, (sp, spec.k, 1), (bt, 1, 1), (("y", "z", "gm") if relu else ("y",)) + (out,))]
    work: tuple[tuple[str, int], ...] = ()
    if sp > 1:
        body = ["float s = bpart[e];", f"for (int j = 1; j < {sp}; ++j) s += bpart[j * {spec.k} + e];",
                "bias[e] = s;"]
        red, grid = elementwise(f"{NAME}_reduce", spec.k, (Buf("bpart"), Buf("bias", readonly=False)), body,
                                f"sum of {sp} slices per channel, in slice order")
        kernels.append(red)
        steps.append(Launch(red.name, grid, red.block, ("bpart", "bias")))
        work = (("bpart", 4 * sp * spec.k),)
    return Plan(f"{NAME}_relu" if relu else NAME, "direct", spec, p, tuple(kernels), tuple(steps), work,
                tolerance=1e-5)


def _sum_kernel(spec: ConvSpec, bt: int, sp: int, out: str, relu: bool = False) -> Kernel:
    """Block (j, k): slice j of channel k's values (with ``relu`` masked by z > 0 and written to gm)
    into ``out[j * K + k]``. Element offsets in 64 bits where the tensor passes 2^31 - 1 elements."""
    pq, kpq = spec.p * spec.q, spec.k * spec.p * spec.q
    v = 4 if pq % 4 == 0 else 1
    chunks = spec.n * pq // v  # vectors of v values, none straddling two images
    per = cdiv(chunks, sp)
    ix = "I64" if spec.n * kpq > 2**31 - 1 else "int"
    code = Code()
    code(f"SHARED float part[{bt}];",
         "const int t = LOCAL_ID(0), j = GROUP_ID(0), k = GROUP_ID(1);",
         f"const int e0 = j * {per}, e1 = min(e0 + {per}, {chunks});",
         f"const {ix} ko = ({ix})k * {pq};",
         "float acc = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;")

    def value(e: str) -> str:
        at = f"ko + ({ix})(({e}) / {pq // v}) * {kpq} + (({e}) % {pq // v}) * {v}"
        if relu:
            return f"masked{v}(y, z, gm, {at})"
        return f"sum4(VLOAD4(0, y + {at}))" if v == 4 else f"y[{at}]"

    # four loads in flight per thread (four running sums, added in a fixed order at the end)
    code("int e = e0 + t;")
    with code.block(f"for (; e + {3 * bt} < e1; e += {4 * bt})"):
        code(f"acc += {value('e')};", f"acc1 += {value(f'e + {bt}')};",
             f"acc2 += {value(f'e + {2 * bt}')};", f"acc3 += {value(f'e + {3 * bt}')};")
    with code.block(f"for (; e < e1; e += {bt})"):
        code(f"acc += {value('e')};")
    code("acc = (acc + acc1) + (acc2 + acc3);")
    code("part[t] = acc;", "BARRIER();")
    halving_tree(code, bt, "t", lambda h: f"part[t] += part[t + {h}];")
    code(f"if (t == 0) {out}[j * {spec.k} + k] = part[0];")
    args: tuple[Buf, ...]
    if relu:
        args = (Buf("y"), Buf("z"), Buf("gm", readonly=False), Buf(out, readonly=False))
        helpers = _masked(v, ix)
        what = "dy masked by the ReLU (z > 0) into gm, summed over N*P*Q"
    else:
        args, helpers, what = (Buf("y"), Buf(out, readonly=False)), _SUM4 if v == 4 else "", "dy summed over N*P*Q"
    return Kernel(f"{NAME}{'_relu' if relu else ''}_sum", args, code.text(), (bt, 1, 1), helpers=helpers,
                  comment=f"{NAME}: {what}, bt={bt} sp={sp}")


def _masked(v: int, ix: str) -> str:
    """``masked<v>(y, z, gm, i)``: the v values of dy at i kept where z > 0 (else 0), stored to gm,
    their sum returned."""
    head = (f"DEVICE float masked{v}(const GLOBAL_PTR float* y, const GLOBAL_PTR float* z, GLOBAL_PTR float* gm, "
            f"const {ix} i) {{\n")
    if v == 1:
        return head + "  const float g = z[i] > 0.0f ? y[i] : 0.0f;\n  gm[i] = g;\n  return g;\n}"
    lanes = "".join(f"  g.{c} = m.{c} > 0.0f ? g.{c} : 0.0f;\n" for c in "xyzw")
    return (head + "  float4 g = VLOAD4(0, y + i);\n  const float4 m = VLOAD4(0, z + i);\n" + lanes
            + "  VSTORE4(g, 0, gm + i);\n  return (g.x + g.y) + (g.z + g.w);\n}")


_SUM4 = "DEVICE float sum4(const float4 d) { return (d.x + d.y) + (d.z + d.w); }"
