"""Renderers: the dialect to CUDA C or OpenCL C. They differ by a handful of spellings."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from convforge.codegen.dialect import (
    HALF_TOKENS,
    Arg,
    Buf,
    ConstBuf,
    Kernel,
    LocalBuf,
    Scalar,
    TensorMap,
    TexBuf,
    split_call,
)

_TOKEN = re.compile(r"\b(GROUP_ID|LOCAL_ID|GROUP_SIZE|NUM_GROUPS|BARRIER|VLOAD4|VSTORE4|VLOAD2|"
                    r"LD_F16|LDG_F16|ST_F16|VLOAD4_F16|VSTORE4_F16|LD_BF16|LDG_BF16|ST_BF16|VLOAD4_BF16|VSTORE4_BF16|"
                    r"VLOAD2_F16|VLOAD2_BF16|"
                    r"VLOAD8_F16|VSTORE8_F16|VLOAD8_BF16|VSTORE8_BF16|"
                    r"MAKE_FLOAT4|FMA|MAX|RELU|GELU|SILU|HSWISH|MISH|DSILU|DHSWISH|LDG|LDCG|FENCE_DEVICE|TICKET|SHFL|TEX|COPY4_ASYNC|COPY1_ASYNC|COPY_WAIT|CVT_TF32|"
                    r"MMA_TF32_16x8x8|MMA_F16_16x8x16|MMA_BF16_16x8x16|SMEM_U32|CP_ASYNC16|CP_ASYNC4|CP_ASYNC_COMMIT|CP_ASYNC_WAIT|LDMATRIX_X4|LDSM_T4|LDSM_T2|LDS_F4|"
                    r"LDS_F1|TF32_RHA|FENCE_PROXY_ASYNC|WGMMA_FENCE|WGMMA_COMMIT|WGMMA_WAIT|WGMMA_TF32|"
                    r"MBAR_INIT|MBAR_WAIT|MBAR_ARRIVE|CP_ASYNC_MBAR_ARRIVE|SETMAXNREG_INC|SETMAXNREG_DEC|"
                    r"BAR_SYNC|WGMMA_RS|WGMMA_HOLD|WGMMA_TZ|WGMMA_T|WGMMA_Z|WGMMA|TC_F16_TO_F32|TC_BF16_TO_F32|TC_F32_TO_F16|TC_F32_TO_BF16|TC_PACK_F16X2|"
                    r"TC_PACK_BF16X2|MBAR_INIT_FENCE|MBAR_EXPECT_TX|TMA_PREFETCH|TMA_TILE_2D|TMA_TILE_3D|TMA_TILE_4D|TMA_IM2COL_4D|"
                    r"TMA_TILE_2D_MC|TMA_IM2COL_4D_MC|CLUSTER_RANK|CLUSTER_ID|NUM_CLUSTERS|CLUSTER_SYNC|"
                    r"MBAR_ARRIVE_CLUSTER|TC_X3H_SCALE|TC_X3H_UNSCALE|TMA_STORE_2D|TMA_STORE_COMMIT|TMA_STORE_WAIT_READ|COMPILER_FENCE)\(")
_WORDS = re.compile(r"\b(SHARED|LOCAL_PTR|GLOBAL_PTR|RESTRICT|DEVICE|U64|I64|HALF_T|BF16_T)\b( ?)")

# -- half storage (float16 / bfloat16 buffers, float32 arithmetic; codegen/dialect.py Storage) -------
# CUDA keeps both as unsigned short bits (no cuda_fp16.h: NVRTC and nvcc alike) converted by PTX cvt
# (cvt.rn.bf16.f32 is sm_80+; older targets round the bits by hand, NaN kept NaN). OpenCL reads and
# writes float16 with vload_half / vstore_half_rte (core OpenCL: no cl_khr_fp16) and bfloat16 as ushort.
_HALF_CTYPES = {"cuda": {"half": "unsigned short", "bfloat16": "unsigned short"},
                "opencl": {"half": "half", "bfloat16": "ushort"}}
_HALF_WORDS = {"cuda": {"HALF_T": "unsigned short", "BF16_T": "unsigned short"},
               "opencl": {"HALF_T": "half", "BF16_T": "ushort"}}
_HALF_USE = re.compile(r"\b(" + "|".join(HALF_TOKENS) + r")\(")


def _cuda_half(token: str, args: list[str]) -> str:
    """CUDA spelling of one half-storage token (helpers: ``_CUDA_HALF``)."""
    op, tag = token.rsplit("_", 1)
    cvt, pack = ("h", "h4") if tag == "F16" else ("bf", "bf4")
    if op == "LD":
        return f"cf_{cvt}2f(({args[0]})[{args[1]}])"
    if op == "LDG":
        return f"cf_{cvt}2f(__ldg({args[0]}))"
    if op == "ST":
        return f"(({args[0]})[{args[1]}] = cf_f2{cvt}({args[2]}))"
    if op == "VLOAD2":  # one 4-byte load; bfloat16's two halves are the word's low and high 16 bits
        word = f"__ldg((const unsigned*)(({args[1]}) + 2 * ({args[0]})))"
        if tag == "F16":
            return f"cf_h2f2({word})"
        return f"make_float2(__uint_as_float({word} << 16), __uint_as_float({word} & 0xffff0000u))"
    if op == "VLOAD4":
        return f"cf_{pack}f(*(const uint2*)(({args[1]}) + 4 * ({args[0]})))"
    if op == "VLOAD8":
        return f"cf_ld8{cvt}(({args[3]}) + 8 * ({args[2]}), {args[0]}, {args[1]})"
    if op == "VSTORE8":
        return f"cf_st8{cvt}(({args[3]}) + 8 * ({args[2]}), {args[0]}, {args[1]})"
    return f"(*(uint2*)(({args[2]}) + 4 * ({args[1]})) = cf_f{pack}({args[0]}))"


def _opencl_half(token: str, args: list[str]) -> str:
    """OpenCL spelling of one half-storage token (bfloat16 helpers: ``_OPENCL_BF16``)."""
    op, tag = token.rsplit("_", 1)
    if op in ("VLOAD8", "VSTORE8"):  # two 8-byte halves: OpenCL has no 16-byte half load without cl_khr_fp16
        lo, hi, off, ptr = args
        four = f"VLOAD4_{tag}" if op == "VLOAD8" else f"VSTORE4_{tag}"
        if op == "VLOAD8":
            return (f"({lo} = {_opencl_half(four, [f'2 * ({off})', ptr])}, "
                    f"{hi} = {_opencl_half(four, [f'2 * ({off}) + 1', ptr])})")
        return (f"({_opencl_half(four, [lo, f'2 * ({off})', ptr])}, "
                f"{_opencl_half(four, [hi, f'2 * ({off}) + 1', ptr])})")
    if tag == "F16":
        return {"LD": lambda: f"vload_half({args[1]}, {args[0]})",
                "LDG": lambda: f"vload_half(0, {args[0]})",
                "ST": lambda: f"vstore_half_rte({args[2]}, {args[1]}, {args[0]})",
                "VLOAD2": lambda: f"vload_half2({args[0]}, {args[1]})",
                "VLOAD4": lambda: f"vload_half4({args[0]}, {args[1]})",
                "VSTORE4": lambda: f"vstore_half4_rte({args[0]}, {args[1]}, {args[2]})"}[op]()
    return {"LD": lambda: f"cf_bf2f(({args[0]})[{args[1]}])",
            "LDG": lambda: f"cf_bf2f(*({args[0]}))",
            "ST": lambda: f"(({args[0]})[{args[1]}] = cf_f2bf({args[2]}))",
            "VLOAD2": lambda: f"as_float2(convert_uint2(vload2({args[0]}, {args[1]})) << 16)",
            "VLOAD4": lambda: f"cf_bf4f(vload4({args[0]}, {args[1]}))",
            "VSTORE4": lambda: f"vstore4(cf_f4bf({args[0]}), {args[1]}, {args[2]})"}[op]()


def _uses_half(kernels: list[Kernel], tag: str = "") -> bool:
    return any(m.group(1).endswith(tag) for k in kernels for t in (k.body, k.helpers)
               if f"{tag or 'F16'}(" in t for m in _HALF_USE.finditer(t))


# float16 -> float32 by PTX cvt.f32.f16 (exact for every half, subnormals included: convforge never compiles
# with -ftz): one instruction an element, where the bit-moving C form took about eight; a 32-bit word's two
# halves are converted in place (cf_h2f2), without shifts to take them apart.
_CUDA_HALF = r"""__device__ __forceinline__ float cf_h2f(unsigned short h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float2 cf_h2f2(unsigned u)
{
    float2 f;
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
        : "=f"(f.x), "=f"(f.y) : "r"(u));
    return f;
}
__device__ __forceinline__ unsigned short cf_f2h(float f)
{
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float cf_bf2f(unsigned short b) { return __uint_as_float((unsigned)b << 16); }
__device__ __forceinline__ unsigned short cf_f2bf(float f)
{
#if __CUDA_ARCH__ >= 800
    unsigned short b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return b;
#else
    const unsigned u = __float_as_uint(f);
    return (unsigned short)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u
                                                            : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}
__device__ __forceinline__ float4 cf_h4f(uint2 u)
{
    const float2 a = cf_h2f2(u.x), b = cf_h2f2(u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ uint2 cf_fh4(float4 v)
{
    return make_uint2(cf_f2h(v.x) | ((unsigned)cf_f2h(v.y) << 16), cf_f2h(v.z) | ((unsigned)cf_f2h(v.w) << 16));
}
__device__ __forceinline__ float4 cf_bf4f(uint2 u)
{
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ uint2 cf_fbf4(float4 v)
{
    return make_uint2(cf_f2bf(v.x) | ((unsigned)cf_f2bf(v.y) << 16), cf_f2bf(v.z) | ((unsigned)cf_f2bf(v.w) << 16));
}"""

# 16-byte half loads and stores (VLOAD8_* / VSTORE8_*), emitted only where a kernel uses them.
_CUDA_HALF8 = r"""__device__ __forceinline__ void cf_ld8h(const unsigned short* p, float4& lo, float4& hi)
{
    const uint4 u = __ldg((const uint4*)p);
    lo = cf_h4f(make_uint2(u.x, u.y));
    hi = cf_h4f(make_uint2(u.z, u.w));
}
__device__ __forceinline__ void cf_ld8bf(const unsigned short* p, float4& lo, float4& hi)
{
    const uint4 u = __ldg((const uint4*)p);
    lo = cf_bf4f(make_uint2(u.x, u.y));
    hi = cf_bf4f(make_uint2(u.z, u.w));
}
__device__ __forceinline__ void cf_st8h(unsigned short* p, float4 lo, float4 hi)
{
    const uint2 a = cf_fh4(lo), b = cf_fh4(hi);
    *(uint4*)p = make_uint4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void cf_st8bf(unsigned short* p, float4 lo, float4 hi)
{
    const uint2 a = cf_fbf4(lo), b = cf_fbf4(hi);
    *(uint4*)p = make_uint4(a.x, a.y, b.x, b.y);
}"""

_OPENCL_BF16 = r"""inline float cf_bf2f(ushort b) { return as_float((uint)b << 16); }
inline ushort cf_f2bf(float f)
{
    const uint u = as_uint(f);
    return (ushort)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float4 cf_bf4f(ushort4 b) { return as_float4(convert_uint4(b) << 16); }
inline ushort4 cf_f4bf(float4 v) { return (ushort4)(cf_f2bf(v.x), cf_f2bf(v.y), cf_f2bf(v.z), cf_f2bf(v.w)); }"""


# Why a back-end may lack a feature (appended to the refusal).
_FEATURE_WHY = {"mma_tf32": "tensor-core MMA_* / CVT_TF32 / CP_ASYNC* / LDMATRIX_X4 are CUDA PTX "
                             "(mma.sync, cp.async, ldmatrix: sm_80+)",
                "wgmma": "warpgroup MMA (WGMMA_*) and proxy fences are CUDA PTX for sm_90a"}

# Features that exist only on an architecture-specific target (sm_90a): a source using them carries
# this line, and the CUDA back-end and the nvcc checker compile it for ``sm_XYa`` instead of ``sm_XY``
# (the source, and so every cache key, differs from plain builds).
ARCH_SPECIFIC = frozenset({"wgmma"})
ARCH_SPECIFIC_MARK = "// convforge: arch-specific target (sm_XYa)"


class Renderer:
    """Base renderer; subclasses give the spellings."""

    name = ""
    erf = "erf"  # the float erf function of the dialect (GELU)
    exp = "exp"  # the float exp function of the dialect (SILU, Mish)
    log1p = "log1p"  # (Mish)
    tanh = "tanh"  # (Mish)
    features: frozenset[str] = frozenset()
    words: dict[str, str] = {}

    def call(self, token: str, args: list[str]) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def param(self, arg: Arg) -> str | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def ctype(self, name: str) -> str:
        """A buffer's element type as this back-end spells it ("half" / "bfloat16": half storage; the
        dialect's integer words U64 / I64)."""
        if name in ("U64", "I64"):
            return self.words[name]
        return _HALF_CTYPES[self.name].get(name, name)

    def kernel_head(self, k: Kernel, params: str) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def file_head(self, kernels: list[Kernel]) -> list[str]:
        return []

    def body_head(self, k: Kernel) -> list[str]:
        return []

    def expand(self, text: str) -> str:
        """Replace dialect tokens, innermost first, so arguments may hold tokens too."""
        # A word that spells as nothing takes its following space with it.
        text = _WORDS.sub(lambda m: self.words[m.group(1)] + (m.group(2) if self.words[m.group(1)] else ""),
                          text)
        return self._tokens(text)

    def _tokens(self, text: str) -> str:
        """``text`` with each token replaced by its call on its own arguments expanded first; the
        pieces are joined once (bodies run to hundreds of kilobytes: no copy per token)."""
        if "(" not in text:  # most arguments: no call in them
            return text
        out, pos = [], 0
        while (m := _TOKEN.search(text, pos)) is not None:
            args, end = split_call(text, m.end() - 1)
            out += [text[pos:m.start()], self.call(m.group(1), [self._tokens(a) for a in args])]
            pos = end
        return text if not out else "".join(out) + text[pos:]

    def render(self, kernels: list[Kernel], title: str = "") -> str:
        """Whole translation unit for these kernels."""
        missing = {f for k in kernels for f in k.requires} - self.features
        if missing:
            why = "".join(f"; {f}: {_FEATURE_WHY[f]}" for f in sorted(missing) if f in _FEATURE_WHY)
            raise ValueError(f"{self.name} back-end lacks features {sorted(missing)}{why}")
        out = [f"// generated by convforge: {title}".rstrip(": ")]
        if any(k.requires & ARCH_SPECIFIC for k in kernels):
            out.append(ARCH_SPECIFIC_MARK)
        out += self.file_head(kernels)
        texts = [k.body + k.helpers for k in kernels]
        for token, helper in (("RELU", _RELU_HELPER), ("GELU", _GELU_HELPER.replace("ERF", self.erf)),
                              ("SILU", _SILU_HELPER.replace("EXP", self.exp)), ("HSWISH", _HSWISH_HELPER),
                              ("MISH", _MISH_HELPER.replace("EXP", self.exp).replace("LOG1P", self.log1p)
                               .replace("TANH", self.tanh)),
                              ("DSILU", _DSILU_HELPER.replace("EXP", self.exp)), ("DHSWISH", _DHSWISH_HELPER)):
            if _uses(token, texts):
                out += [self.expand(helper), ""]
        seen_helpers: set[str] = set()
        for k in kernels:
            if k.helpers and k.helpers not in seen_helpers:
                seen_helpers.add(k.helpers)
                out.append(self.expand(k.helpers).rstrip())
                out.append("")
            params = ",\n    ".join(p for p in (self.param(a) for a in k.args) if p)
            if k.comment:
                out.append("// " + k.comment)
            out.append(self.kernel_head(k, params))
            out.append("{")
            out += self.body_head(k)
            out.append(self.expand(k.body).rstrip())
            out.append("}")
            out.append("")
        return "\n".join(out)


def _uses(token: str, texts: list[str]) -> bool:
    """Whether a body calls ``token(`` as a word (the plain substring test first: bodies run to
    hundreds of kilobytes and most name no activation)."""
    return any(_calls(t, token) for t in texts)


def _calls(text: str, *tokens: str) -> bool:
    """Whether ``text`` calls one of ``tokens`` as a word (a plain substring test first: it is fast,
    a regular expression over a long body is not)."""
    return any(f"{tok}(" in text and re.search(rf"\b{tok}\(", text) for tok in tokens)


# ReLU that keeps NaN (as the float64 reference and PyTorch do; fmax would turn it into 0).
_RELU_HELPER = "DEVICE float cf_relu(const float v) { return v < 0.0f ? 0.0f : v; }"
# The exact GELU as PyTorch's CUDA kernel computes it in float: v / 2 * (1 + erf(v / sqrt 2)).
_GELU_HELPER = "DEVICE float cf_gelu(const float v) { return 0.5f * v * (1.0f + ERF(v * 0.70710678118654752f)); }"
# SiLU (swish) as PyTorch's CUDA kernel computes it in float: v / (1 + exp(-v)) (NaN stays NaN; a large
# negative v gives -0).
_SILU_HELPER = "DEVICE float cf_silu(const float v) { return v / (1.0f + EXP(-v)); }"
# HardSwish as PyTorch computes it: v * min(max(v + 3, 0), 6) / 6, by comparisons so NaN stays NaN.
_HSWISH_HELPER = ("DEVICE float cf_hswish(const float v)\n{\n    const float t = v + 3.0f;\n"
                  "    return v * (t < 0.0f ? 0.0f : t > 6.0f ? 6.0f : t) / 6.0f;\n}")

# The derivatives the batch norm's backward multiplies dz by (kernels/batchnorm.py), as PyTorch's silu_backward
# and hardswish_backward compute them in float: s (1 + v (1 - s)) with s = sigmoid(v); 0 below -3, v / 3 + 1/2 up
# to 3, else 1 (a NaN v passes dz on, as PyTorch's does).
_DSILU_HELPER = ("DEVICE float cf_dsilu(const float v)\n{\n    const float s = 1.0f / (1.0f + EXP(-v));\n"
                 "    return s * (1.0f + v * (1.0f - s));\n}")
_DHSWISH_HELPER = ("DEVICE float cf_dhswish(const float v)\n{\n"
                   "    return v < -3.0f ? 0.0f : v <= 3.0f ? v / 3.0f + 0.5f : 1.0f;\n}")

# Mish as PyTorch's CUDA kernel computes it in float: v * tanh(log1p(exp(v))) (NaN stays NaN; a large v
# gives v, a large negative one -0).
_MISH_HELPER = "DEVICE float cf_mish(const float v) { return v * TANH(LOG1P(EXP(v))); }"


class CudaRenderer(Renderer):
    name = "cuda"
    erf = "erff"
    exp = "expf"
    log1p = "log1pf"
    tanh = "tanhf"
    features = frozenset({"shuffle", "constant", "ldg", "texture", "mma_tf32", "wgmma"})
    words = {"SHARED": "__shared__", "LOCAL_PTR": "", "GLOBAL_PTR": "", "RESTRICT": "__restrict__",
             "DEVICE": "__device__ __forceinline__", "U64": "unsigned long long", "I64": "long long",
             **_HALF_WORDS["cuda"]}
    _dims = "xyz"

    def call(self, token: str, args: list[str]) -> str:
        d = self._dims[int(args[0])] if token in ("GROUP_ID", "LOCAL_ID", "GROUP_SIZE",
                                                  "NUM_GROUPS") else ""
        table: dict[str, Callable[[], str]] = {
            "GROUP_ID": lambda: f"((int)blockIdx.{d})",
            "LOCAL_ID": lambda: f"((int)threadIdx.{d})",
            "GROUP_SIZE": lambda: f"((int)blockDim.{d})",
            "NUM_GROUPS": lambda: f"((int)gridDim.{d})",
            "BARRIER": lambda: "__syncthreads()",
            "VLOAD4": lambda: f"(*(const float4*)(({args[1]}) + 4 * ({args[0]})))",
            "VLOAD2": lambda: f"(*(const float2*)(({args[1]}) + 2 * ({args[0]})))",
            "VSTORE4": lambda: f"(*(float4*)(({args[2]}) + 4 * ({args[1]})) = ({args[0]}))",
            "MAKE_FLOAT4": lambda: f"make_float4({', '.join(args)})",
            "FMA": lambda: f"fmaf({', '.join(args)})",
            "MAX": lambda: f"fmaxf({', '.join(args)})",
            "RELU": lambda: f"cf_relu({args[0]})",
            "GELU": lambda: f"cf_gelu({args[0]})",
            "SILU": lambda: f"cf_silu({args[0]})",
            "HSWISH": lambda: f"cf_hswish({args[0]})",
            "MISH": lambda: f"cf_mish({args[0]})",
            "DSILU": lambda: f"cf_dsilu({args[0]})",
            "DHSWISH": lambda: f"cf_dhswish({args[0]})",
            "LDG": lambda: f"__ldg({args[0]})",
            "LDCG": lambda: f"__ldcg({args[0]})",
            "FENCE_DEVICE": lambda: "cf_fence_gpu()",
            "TICKET": lambda: f"atomicAdd((unsigned int*)({args[0]}), 1u)",
            "SHFL": lambda: f"__shfl_sync(0xffffffffu, {args[0]}, {args[1]})",
            "TEX": lambda: f"tex1Dfetch<float>({args[0]}, {args[1]})",
            "COPY4_ASYNC": lambda: f"cf_copy4_async({args[0]}, {args[1]})",
            "COPY1_ASYNC": lambda: f"cf_copy1_async({', '.join(args)})",
            "COPY_WAIT": lambda: "cf_copy_wait()",
            "CVT_TF32": lambda: f"cf_tf32({args[0]})",
            "MMA_TF32_16x8x8": lambda: f"cf_mma_tf32({', '.join(args)})",
            "MMA_F16_16x8x16": lambda: f"cf_mma_f16({', '.join(args)})",
            "MMA_BF16_16x8x16": lambda: f"cf_mma_bf16({', '.join(args)})",
            "SMEM_U32": lambda: f"((unsigned)__cvta_generic_to_shared({args[0]}))",
            "CP_ASYNC16": lambda: f"cf_cp_async16({', '.join(args + ['16u'] * (len(args) == 2))})",
            "CP_ASYNC4": lambda: f"cf_cp_async4({', '.join(args)})",
            "CP_ASYNC_COMMIT": lambda: 'asm volatile("cp.async.commit_group;" ::: "memory")',
            "CP_ASYNC_WAIT": lambda: f'asm volatile("cp.async.wait_group %0;" :: "n"({args[0]}) : "memory")',
            "LDMATRIX_X4": lambda: f"cf_ldsm4({', '.join(args)})",
            "LDSM_T4": lambda: f"cf_ldsm4t({', '.join(args)})",
            "LDSM_T2": lambda: f"cf_ldsm2t({', '.join(args)})",
            "LDS_F4": lambda: f"cf_lds4({args[0]})",
            "LDS_F1": lambda: f"cf_lds1({args[0]})",
            "TF32_RHA": lambda: f"__uint_as_float(__float_as_uint({args[0]}) + 0x1000u)",
        }
        if token in _WGMMA_TOKENS:
            return _wgmma_call(token, args)
        if token in HALF_TOKENS:
            return _cuda_half(token, args)
        return table[token]()

    def param(self, arg: Arg) -> str | None:
        if isinstance(arg, Buf):
            const = "const " if arg.readonly else ""
            return f"{const}{self.ctype(arg.ctype)}* __restrict__ {arg.name}"
        if isinstance(arg, TexBuf):
            return f"const cudaTextureObject_t {arg.name}"
        if isinstance(arg, TensorMap):
            return f"const __grid_constant__ cf_tmap {arg.name}"
        if isinstance(arg, (ConstBuf, LocalBuf)):
            return None  # a module-level __constant__ symbol / extern __shared__ array
        assert isinstance(arg, Scalar)
        return f"const {arg.ctype} {arg.name}"

    def file_head(self, kernels: list[Kernel]) -> list[str]:
        seen: dict[str, ConstBuf] = {}
        for k in kernels:
            for cb in k.const_bufs():
                seen[cb.name] = cb
        head = [f"__constant__ {self.ctype(cb.ctype)} {cb.name}[{cb.count}];" for cb in seen.values()] + [""]
        if _uses_half(kernels):
            head += _CUDA_HALF.splitlines() + [""]
        if any(_calls(t, "VLOAD8_F16", "VLOAD8_BF16", "VSTORE8_F16", "VSTORE8_BF16")
               for k in kernels for t in (k.body, k.helpers)):
            head += _CUDA_HALF8.splitlines() + [""]
        if any(_calls(k.body, "COPY1_ASYNC", "COPY4_ASYNC") for k in kernels):
            head += _CUDA_COPY_ASYNC.splitlines() + [""]
        if any(_calls(k.body, "FENCE_DEVICE") for k in kernels):
            head += _CUDA_FENCE.splitlines() + [""]
        if any(_calls(t, "MMA_TF32_16x8x8", "CVT_TF32") for k in kernels for t in (k.body, k.helpers)):
            head += _CUDA_MMA_TF32.splitlines() + [""]
        if any(_calls(t, "MMA_F16_16x8x16", "MMA_BF16_16x8x16") for k in kernels for t in (k.body, k.helpers)):
            head += _CUDA_MMA_HALF.splitlines() + [""]
        if any(_calls(k.body, "CP_ASYNC16", "CP_ASYNC4", "LDMATRIX_X4", "LDS_F4", "LDS_F1") for k in kernels):
            head += _CUDA_PIPE.splitlines() + [""]
        if any(_calls(k.body, "LDSM_T4", "LDSM_T2") for k in kernels):
            head += _CUDA_LDSM_T.splitlines() + [""]
        if any(_calls(k.body, *_TC_HEAD) for k in kernels):
            head += _CUDA_TC.splitlines() + [""]
        if any(isinstance(a, TensorMap) for k in kernels for a in k.args):
            head += [_CUDA_TMAP, ""]
        if any(k.cluster > 1 for k in kernels):
            head += _CUDA_CLUSTER.splitlines() + [""]
        return head

    def body_head(self, k: Kernel) -> list[str]:
        lb = k.local_buf()
        return [f"    extern __shared__ __align__(16) float {lb.name}[];"] if lb else []

    def kernel_head(self, k: Kernel, params: str) -> str:
        bounds = f"{k.threads}, {k.min_blocks}" if k.min_blocks else f"{k.threads}"
        cluster = f" __cluster_dims__({k.cluster}, 1, 1)" if k.cluster > 1 else ""
        return (f'extern "C" __global__ void __launch_bounds__({bounds}){cluster}\n'
                f"{k.name}({params})")


# cp.async (sm_80+): the copy goes to shared memory without registers (16 bytes: .cg, L1 bypassed;
# 4 bytes: .ca, zero-filled when the source size is 0); older architectures get a synchronous copy
# with the same meaning.
_CUDA_COPY_ASYNC = r"""__device__ __forceinline__ void cf_copy4_async(float* dst, const float* src)
{
#if __CUDA_ARCH__ >= 800
    unsigned s;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(src) : "memory");
#else
    *(float4*)dst = __ldg((const float4*)src);
#endif
}
#if __CUDA_ARCH__ >= 800
#define cf_copy1_async(dst, doff, src, soff, mask, bit) do { \
    unsigned cf_s_; \
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(cf_s_) : "l"(dst)); \
    asm volatile("{ .reg .pred p; .reg .b64 t; .reg .u32 z; and.b64 t, %2, %3; setp.ne.b64 p, t, 0; " \
                 "selp.u32 z, 4, 0, p; cp.async.ca.shared.global [%0+%4], [%1+%5], 4, z; }" \
                 :: "r"(cf_s_), "l"(src), "l"(mask), "n"(1ull << (bit)), "n"(4 * (doff)), \
                 "n"(4 * (soff)) : "memory"); } while (0)
#else
#define cf_copy1_async(dst, doff, src, soff, mask, bit) \
    ((dst)[doff] = (((mask) >> (bit)) & 1ull) ? __ldg((src) + (soff)) : 0.0f)
#endif
__device__ __forceinline__ void cf_copy_wait()
{
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}"""


# Tensor cores, TF32 (sm_80+): cvt.rna rounds to the nearest TF32 value (ties away from zero), as
# cuDNN rounds its operands; mma.sync m16n8k8 multiplies TF32 fragments with FP32 accumulation in
# place (D = C). Plain asm (not volatile): the compiler may schedule them like arithmetic.
# FENCE_DEVICE: the acquire-release fence where the target has it (sm_70+), else the full one
_CUDA_FENCE = r"""__device__ __forceinline__ void cf_fence_gpu()
{
#if __CUDA_ARCH__ >= 700
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
#else
    __threadfence();
#endif
}"""

_CUDA_MMA_TF32 = r"""__device__ __forceinline__ float cf_tf32(float x)
{
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
}
__device__ __forceinline__ void cf_mma_tf32(float& d0, float& d1, float& d2, float& d3,
                                            float a0, float a1, float a2, float a3, float b0, float b1)
{
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)),
          "r"(__float_as_uint(a3)), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}"""

# Tensor cores, FP16 / BF16 (sm_80+): mma.sync m16n8k16, each A / B word two halves (the lower
# element in the low 16 bits), FP32 accumulation in place (D = C).
_CUDA_MMA_HALF = "\n".join(
    f"""__device__ __forceinline__ void cf_mma_{t}(float& d0, float& d1, float& d2, float& d3, unsigned a0,
                                            unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1)
{{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 "
        "{{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}}""" for t in ("f16", "bf16"))

# Hopper (sm_90a) asynchronous copies and warpgroup MMA, spelled inline (volatile: their order is
# their meaning). The accumulators are "+f" operands of every WGMMA_TF32 and WGMMA_WAIT, so the
# compiler neither reads them before the wait that completes them nor moves them in between.
_WGMMA_TOKENS = frozenset({"FENCE_PROXY_ASYNC", "WGMMA_FENCE", "WGMMA_COMMIT", "WGMMA_WAIT", "WGMMA_TF32"}
                          | {"MBAR_INIT", "MBAR_WAIT", "MBAR_ARRIVE", "CP_ASYNC_MBAR_ARRIVE", "SETMAXNREG_INC",
                             "SETMAXNREG_DEC", "BAR_SYNC", "WGMMA", "WGMMA_Z", "WGMMA_T", "WGMMA_TZ", "WGMMA_RS",
                             "WGMMA_HOLD",
                             "TC_F16_TO_F32", "TC_BF16_TO_F32", "TC_F32_TO_F16", "TC_F32_TO_BF16", "TC_PACK_F16X2",
                             "TC_PACK_BF16X2"}
                          | {"MBAR_INIT_FENCE", "MBAR_EXPECT_TX", "TMA_PREFETCH", "TMA_TILE_2D", "TMA_TILE_3D",
                             "TMA_TILE_4D", "TMA_IM2COL_4D"}
                          | {"TMA_TILE_2D_MC", "TMA_IM2COL_4D_MC", "CLUSTER_RANK", "CLUSTER_ID", "NUM_CLUSTERS",
                             "CLUSTER_SYNC", "MBAR_ARRIVE_CLUSTER", "TC_X3H_SCALE", "TC_X3H_UNSCALE"}
                          | {"TMA_STORE_2D", "TMA_STORE_COMMIT", "TMA_STORE_WAIT_READ", "COMPILER_FENCE"})


def _asm(text: str, outs: Sequence[str] = (), ins: Sequence[str] = ()) -> str:
    return f'asm volatile("{text}" : {", ".join(outs)} : {", ".join(ins)} : "memory")'


def _wgmma_call(token: str, args: list[str]) -> str:
    """CUDA spelling of one sm_90a token (see codegen/dialect.py)."""
    if token in _TC_TOKENS:
        return _TC_TOKENS[token](args)
    if token == "FENCE_PROXY_ASYNC":
        return _asm("fence.proxy.async.shared::cta;")
    if token == "WGMMA_FENCE":
        return _asm("wgmma.fence.sync.aligned;")
    if token == "WGMMA_COMMIT":
        return _asm("wgmma.commit_group.sync.aligned;")
    if token == "WGMMA_WAIT":
        return _asm(f"wgmma.wait_group.sync.aligned {int(args[0])};", [f'"+f"({d})' for d in args[1:]])
    n, da, db, acc = int(args[0]), args[1], args[2], args[3:]
    if len(acc) != n // 2 or n % 8 or not 8 <= n <= 256:
        raise ValueError(f"WGMMA_TF32 m64n{n}k8 takes {n // 2} accumulators, got {len(acc)}")
    regs = ", ".join(f"%{i}" for i in range(len(acc)))
    na = len(acc)
    text = (f"{{ .reg .pred p; setp.ne.b32 p, %{na + 2}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 {{{regs}}}, %{na}, %{na + 1}, p, 1, 1; }}")
    return _asm(text, [f'"+f"({d})' for d in acc], [f'"l"({da})', f'"l"({db})', '"r"(1)'])


# -- the tensor-core generator (kernels/tensorcore/sm90/): mbarrier stage rings, warpgroup roles, wgmma of
# every math mode, storage-dtype conversions of its epilogue. Shared addresses are 32-bit (SMEM_U32).
# mbarrier waits spin on try_wait.parity (labels are local to the braces of each inlined copy);
# cp.async arrivals use .noinc, so a full barrier expects one arrival per producer thread.
_WGMMA_TYPES = {"tf32": 8, "f16": 16, "bf16": 16}


def _wgmma_asm(token: str, typ: str, k: int, n: int, acc: list[str], a: list[str], db: str, scale: str,
               mn: bool = False) -> str:
    """One wgmma.mma_async m64nNk{k} with f32 accumulators ``acc``: A by one descriptor (``a`` of one
    64-bit value, shared memory; .f16/.bf16 then take two transpose immediates: 0 K-major, 1 with
    ``mn``, both operands MN-major) or four 32-bit registers (.f16/.bf16 take B's only), B by descriptor
    ``db``; D scaled by ``scale`` != 0 (0: D starts at zero). .tf32 has no transpose immediates."""
    if _WGMMA_TYPES.get(typ) != k:
        raise ValueError(f"{token} type {typ!r} with k {k}: expected one of {_WGMMA_TYPES}")
    if mn and (typ == "tf32" or len(a) != 1):
        raise ValueError(f"{token}: MN-major operands are 16-bit (f16, bf16) in shared memory, not {typ!r}")
    if len(acc) != n // 2 or n % 8 or not 8 <= n <= 256:
        raise ValueError(f"{token} m64n{n}k{k} takes {n // 2} accumulators, got {len(acc)}")
    na, nin = len(acc), len(a)
    regs = ", ".join(f"%{i}" for i in range(na))
    a_op = f"%{na}" if nin == 1 else "{" + ", ".join(f"%{na + i}" for i in range(nin)) + "}"
    trans = "" if typ == "tf32" else (", 1, 1" if mn else ", 0, 0" if nin == 1 else ", 0")
    text = (f"{{ .reg .pred p; setp.ne.b32 p, %{na + nin + 1}, 0; wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{typ}."
            f"{typ} {{{regs}}}, {a_op}, %{na + nin}, p, 1, 1{trans}; }}")
    ins = [f'"l"({a[0]})'] if nin == 1 else [f'"r"({x})' for x in a]
    return _asm(text, [f'"+f"({d})' for d in acc], ins + [f'"l"({db})', f'"r"({scale})'])


def _wgmma_any(args: list[str]) -> str:
    """WGMMA(type, k, N, desc_a, desc_b, d...): D += A.B, m64nNk{k}, f32 accumulators, both operands
    K-major in shared memory (.f16/.bf16 take the transpose immediates 0, .tf32 has none)."""
    return _wgmma_asm("WGMMA", args[0], int(args[1]), int(args[2]), args[5:], [args[3]], args[4], "1")


def _wgmma_z(args: list[str]) -> str:
    """WGMMA_Z(type, k, N, desc_a, desc_b, d...): D = A.B (scale-d 0: D's old value is not read), as WGMMA."""
    return _wgmma_asm("WGMMA_Z", args[0], int(args[1]), int(args[2]), args[5:], [args[3]], args[4], "0")


def _wgmma_t(args: list[str]) -> str:
    """WGMMA_T(type, k, N, desc_a, desc_b, d...): as WGMMA with both operands MN-major (f16 / bf16)."""
    return _wgmma_asm("WGMMA_T", args[0], int(args[1]), int(args[2]), args[5:], [args[3]], args[4], "1", mn=True)


def _wgmma_tz(args: list[str]) -> str:
    """WGMMA_TZ(...): WGMMA_T starting D at zero (scale-d 0)."""
    return _wgmma_asm("WGMMA_TZ", args[0], int(args[1]), int(args[2]), args[5:], [args[3]], args[4], "0", mn=True)


def _wgmma_rs(args: list[str]) -> str:
    """WGMMA_RS(type, k, N, scale_d, a0, a1, a2, a3, desc_b, d...): D = (scale_d ? D : 0) + A.B,
    m64nNk{k}, A from four 32-bit registers a lane (the mma.sync A layout per warp), B K-major in
    shared memory; f32 accumulators."""
    return _wgmma_asm("WGMMA_RS", args[0], int(args[1]), int(args[2]), args[9:], args[4:8], args[8], args[3])


def _hold(args: list[str]) -> str:
    """WGMMA_HOLD(r...): the registers live and unchanged up to here (a wgmma may still read them)."""
    return f'asm volatile("" : {", ".join(f"{chr(34)}+r{chr(34)}({r})" for r in args)} :: "memory")'


_TC_TOKENS: dict[str, Callable[[list[str]], str]] = {
    "WGMMA_RS": _wgmma_rs,
    "WGMMA_HOLD": _hold,
    "MBAR_INIT": lambda a: _asm("mbarrier.init.shared::cta.b64 [%0], %1;", (), [f'"r"({a[0]})', f'"r"({a[1]})']),
    "MBAR_WAIT": lambda a: f"cf_mbar_wait({a[0]}, {a[1]})",
    "MBAR_ARRIVE": lambda a: _asm("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }", (),
                                  [f'"r"({a[0]})']),
    "CP_ASYNC_MBAR_ARRIVE": lambda a: _asm("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];", (),
                                           [f'"r"({a[0]})']),
    "SETMAXNREG_INC": lambda a: _asm(f"setmaxnreg.inc.sync.aligned.u32 {int(a[0])};"),
    "SETMAXNREG_DEC": lambda a: _asm(f"setmaxnreg.dec.sync.aligned.u32 {int(a[0])};"),
    "BAR_SYNC": lambda a: _asm("bar.sync %0, %1;", (), [f'"r"({a[0]})', f'"r"({a[1]})']),
    "WGMMA": _wgmma_any,
    "WGMMA_Z": _wgmma_z,
    "WGMMA_T": _wgmma_t,
    "WGMMA_TZ": _wgmma_tz,
    "TC_F16_TO_F32": lambda a: f"cf_f16_f32({a[0]})",
    "TC_BF16_TO_F32": lambda a: f"__uint_as_float(((unsigned)({a[0]})) << 16)",
    "TC_F32_TO_F16": lambda a: f"cf_f32_f16({a[0]})",
    "TC_F32_TO_BF16": lambda a: f"cf_f32_bf16({a[0]})",
    "TC_PACK_F16X2": lambda a: f"cf_pack_f16x2({a[0]}, {a[1]})",
    "TC_PACK_BF16X2": lambda a: f"cf_pack_bf16x2({a[0]}, {a[1]})",
    "TC_X3H_SCALE": lambda a: f"cf_x3h_scale({a[0]}, 0)",
    "TC_X3H_UNSCALE": lambda a: f"cf_x3h_scale({a[0]}, 1)",
    "MBAR_INIT_FENCE": lambda a: _asm("fence.mbarrier_init.release.cluster;"),
    "MBAR_EXPECT_TX": lambda a: _asm("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;", (),
                                     [f'"r"({a[0]})', f'"r"({a[1]})']),
    "TMA_PREFETCH": lambda a: _asm("prefetch.tensormap [%0];", (), [_map_addr(a[0])]),
    "TMA_TILE_2D": lambda a: _asm("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                                  "[%0], [%1, {%2, %3}], [%4];", (),
                                  [f'"r"({a[0]})', _map_addr(a[1]), f'"r"({a[2]})', f'"r"({a[3]})', f'"r"({a[4]})']),
    "TMA_TILE_3D": lambda a: _asm("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                                  "[%0], [%1, {%2, %3, %4}], [%5];", (),
                                  [f'"r"({a[0]})', _map_addr(a[1]), *(f'"r"({v})' for v in a[2:5]), f'"r"({a[5]})']),
    "TMA_TILE_4D": lambda a: _asm("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                                  "[%0], [%1, {%2, %3, %4, %5}], [%6];", (),
                                  [f'"r"({a[0]})', _map_addr(a[1]), *(f'"r"({v})' for v in a[2:6]), f'"r"({a[6]})']),
    # 16-bit operands (im2col offsets, multicast masks) go in as 32-bit registers and are narrowed
    # inside the asm: given "h" operands, nvcc 13.0 reused one copy's offset register for the next in
    # a fully unrolled loop (4x4 taps, one tap a stage: {1, 1} where the PTX needed {1, 0})
    "TMA_IM2COL_4D": lambda a: _asm("{ .reg .b16 ow, oh; cvt.u16.u32 ow, %7; cvt.u16.u32 oh, %8; "
                                    "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::"
                                    "bytes [%0], [%1, {%2, %3, %4, %5}], [%6], {ow, oh}; }", (),
                                    [f'"r"({a[0]})', _map_addr(a[1]), *(f'"r"({v})' for v in a[2:6]),
                                     f'"r"({a[8]})', f'"r"({a[6]})', f'"r"({a[7]})']),
    # the same copies multicast: the box lands at the same shared offset in every CTA of the cluster
    # whose bit is set in ``mask``, each completing the mbarrier at the same offset in its own CTA
    "TMA_TILE_2D_MC": lambda a: _asm("{ .reg .b16 mk; cvt.u16.u32 mk, %5; "
                                     "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                                     ".multicast::cluster [%0], [%1, {%2, %3}], [%4], mk; }", (),
                                     [f'"r"({a[0]})', _map_addr(a[1]), f'"r"({a[2]})', f'"r"({a[3]})',
                                      f'"r"({a[4]})', f'"r"({a[5]})']),
    "TMA_IM2COL_4D_MC": lambda a: _asm("{ .reg .b16 ow, oh, mk; cvt.u16.u32 ow, %7; cvt.u16.u32 oh, %8; "
                                       "cvt.u16.u32 mk, %9; "
                                       "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::"
                                       "bytes.multicast::cluster [%0], [%1, {%2, %3, %4, %5}], [%6], {ow, oh}, mk; }",
                                       (), [f'"r"({a[0]})', _map_addr(a[1]), *(f'"r"({v})' for v in a[2:6]),
                                            f'"r"({a[8]})', f'"r"({a[6]})', f'"r"({a[7]})', f'"r"({a[9]})']),
    # shared -> global: the box at shared address sa (written by the generic proxy: FENCE_PROXY_ASYNC and a
    # barrier first) stored at element (c0, c1) of a tiled TensorMap, out-of-bounds elements dropped
    "TMA_STORE_2D": lambda a: _asm("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];", (),
                                   [_map_addr(a[0]), f'"r"({a[2]})', f'"r"({a[3]})', f'"r"({a[1]})']),
    "TMA_STORE_COMMIT": lambda a: _asm("cp.async.bulk.commit_group;"),
    "COMPILER_FENCE": lambda a: 'asm volatile("" ::: "memory")',
    "TMA_STORE_WAIT_READ": lambda a: _asm(f"cp.async.bulk.wait_group.read {int(a[0])};"),
    "CLUSTER_RANK": lambda a: "cf_cluster_reg(0)",
    "CLUSTER_ID": lambda a: "cf_cluster_reg(1)",
    "NUM_CLUSTERS": lambda a: "cf_cluster_reg(2)",
    "CLUSTER_SYNC": lambda a: _asm("barrier.cluster.arrive.release; barrier.cluster.wait.acquire;"),
    "MBAR_ARRIVE_CLUSTER": lambda a: _asm("{ .reg .b32 ra; mapa.shared::cluster.u32 ra, %0, %1; "
                                          "mbarrier.arrive.shared::cluster.b64 _, [ra]; }", (),
                                          [f'"r"({a[0]})', f'"r"({a[1]})']),
}


def _map_addr(name: str) -> str:
    """The generic address of a ``__grid_constant__`` TensorMap parameter, as an asm operand."""
    return f'"l"(reinterpret_cast<unsigned long long>(&{name}))'

# A TensorMap parameter's C type: the driver's opaque 128-byte CUtensorMap (no cuda.h under NVRTC).
_CUDA_TMAP = "struct __align__(64) cf_tmap { unsigned long long opaque[16]; };"
# Thread-block clusters (Kernel.cluster > 1): the block's rank in its cluster, the cluster's index
# and the number of clusters, along x (clusters are 1-D here).
_CUDA_CLUSTER = r"""__device__ __forceinline__ int cf_cluster_reg(int which)
{
    unsigned r;
    if (which == 0) asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    else if (which == 1) asm("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    else asm("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return (int)r;
}"""

# Device functions the tokens above call (emitted once per source that uses any of them).
_CUDA_TC = r"""__device__ __forceinline__ void cf_mbar_wait(unsigned bar, unsigned parity)
{
    asm volatile("{ .reg .pred p; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra WAIT; }"
                 :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ float cf_f16_f32(unsigned short h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short cf_f32_f16(float f)
{
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ unsigned short cf_f32_bf16(float f)
{
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ unsigned cf_pack_f16x2(float lo, float hi)
{
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// 3xFP16's power-of-two scale from a tensor's maximum |a| (m >= 0): 2^(14 - E) for m in [2^E, 2^(E+1)),
// so m times it lies in [2^14, 2^15); at most 2^126; 1 for a non-finite m; ``inverse``: its reciprocal.
__device__ __forceinline__ float cf_x3h_scale(float m, int inverse)
{
    const int e = (__float_as_int(m) >> 23) & 255;
    const int b = e == 255 ? 127 : min(268 - e, 253);
    return __int_as_float((inverse ? 254 - b : b) << 23);
}
__device__ __forceinline__ unsigned cf_pack_bf16x2(float lo, float hi)
{
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}"""
_TC_HEAD = ("MBAR_WAIT", "TC_F16_TO_F32", "TC_F32_TO_F16", "TC_F32_TO_BF16", "TC_PACK_F16X2", "TC_PACK_BF16X2",
            "TC_X3H_SCALE", "TC_X3H_UNSCALE")


# The staged tensor-core GEMM's primitives (sm_80+), on 32-bit shared addresses (SMEM_U32):
# cp.async of 16 bytes (.cg, L1 bypassed) or 4 bytes (.ca), each reading ``n`` bytes (0 or the full
# size) and zero-filling the rest, so a chunk outside the matrix costs no branch; ldmatrix x4 gives
# lane l row l / 4, 32-bit word l % 4 of each of four 8 x 8 b16 matrices whose row addresses lanes
# 8q..8q+7 supply: for a k-contiguous shared tile exactly the TF32 fragments (kernels/tensorcore/sm80/mma_pipe.py).
_CUDA_PIPE = r"""__device__ __forceinline__ void cf_cp_async16(unsigned dst, const float* src, unsigned n)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cf_cp_async4(unsigned dst, const float* src, unsigned n)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(n) : "memory");
}
#define cf_ldsm4(d0, d1, d2, d3, addr) do { unsigned r0_, r1_, r2_, r3_; \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];" \
                 : "=r"(r0_), "=r"(r1_), "=r"(r2_), "=r"(r3_) : "r"(addr)); \
    d0 = __uint_as_float(r0_); d1 = __uint_as_float(r1_); d2 = __uint_as_float(r2_); \
    d3 = __uint_as_float(r3_); } while (0)
__device__ __forceinline__ float4 cf_lds4(unsigned addr)
{
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ float cf_lds1(unsigned addr)
{
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
    return v;
}"""

# ldmatrix .trans into unsigned words (LDSM_T4 / LDSM_T2: 16-bit fragments of k-contiguous rows' transpose).
_CUDA_LDSM_T = r"""#define cf_ldsm4t(d0, d1, d2, d3, addr) \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];" \
                 : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3) : "r"(addr))
#define cf_ldsm2t(d0, d1, addr) \
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(d0), "=r"(d1) : "r"(addr))"""

# Dialect tokens with no OpenCL spelling, and why.
_OPENCL_REFUSED = {
    "MMA_TF32_16x8x8": "tensor-core mma.sync (TF32) is a CUDA PTX instruction with no OpenCL C form",
    "CVT_TF32": "cvt.rna.tf32 rounding is part of the CUDA tensor-core path only",
    "SHFL": "warp shuffles are CUDA only",
    **{t: "Hopper warpgroup MMA and proxy fences are CUDA PTX (sm_90a) with no OpenCL C form"
       for t in _WGMMA_TOKENS},
    "TEX": "texture objects are CUDA only",
    "SMEM_U32": "32-bit shared-window addresses exist only for the CUDA cp.async / ldmatrix path",
    "CP_ASYNC16": "cp.async (asynchronous global->shared copy) is a CUDA PTX instruction (sm_80+)",
    "CP_ASYNC4": "cp.async (asynchronous global->shared copy) is a CUDA PTX instruction (sm_80+)",
    "CP_ASYNC_COMMIT": "cp.async groups are CUDA PTX (sm_80+)",
    "CP_ASYNC_WAIT": "cp.async groups are CUDA PTX (sm_80+)",
    "LDMATRIX_X4": "ldmatrix is a CUDA PTX warp instruction (sm_75+)",
    "LDSM_T4": "ldmatrix is a CUDA PTX warp instruction (sm_75+)",
    "LDSM_T2": "ldmatrix is a CUDA PTX warp instruction (sm_75+)",
    "LDS_F1": "32-bit shared-window addresses exist only for the CUDA cp.async / ldmatrix path",
    "LDS_F4": "32-bit shared-window addresses exist only for the CUDA cp.async / ldmatrix path",
    "TF32_RHA": "TF32 rounding belongs to the CUDA tensor-core path only",
}


class OpenCLRenderer(Renderer):
    name = "opencl"
    features = frozenset({"constant"})
    words = {"SHARED": "__local", "LOCAL_PTR": "__local", "GLOBAL_PTR": "__global",
             "RESTRICT": "restrict", "DEVICE": "inline", "U64": "ulong", "I64": "long", **_HALF_WORDS["opencl"]}

    def call(self, token: str, args: list[str]) -> str:
        table: dict[str, Callable[[], str]] = {
            "GROUP_ID": lambda: f"((int)get_group_id({args[0]}))",
            "LOCAL_ID": lambda: f"((int)get_local_id({args[0]}))",
            "GROUP_SIZE": lambda: f"((int)get_local_size({args[0]}))",
            "NUM_GROUPS": lambda: f"((int)get_num_groups({args[0]}))",
            "BARRIER": lambda: "barrier(CLK_LOCAL_MEM_FENCE)",
            "VLOAD4": lambda: f"vload4({args[0]}, {args[1]})",
            "VLOAD2": lambda: f"vload2({args[0]}, {args[1]})",
            "VSTORE4": lambda: f"vstore4({args[0]}, {args[1]}, {args[2]})",
            "MAKE_FLOAT4": lambda: f"((float4)({', '.join(args)}))",
            "FMA": lambda: f"mad({', '.join(args)})",
            "MAX": lambda: f"fmax({', '.join(args)})",
            "RELU": lambda: f"cf_relu({args[0]})",
            "GELU": lambda: f"cf_gelu({args[0]})",
            "SILU": lambda: f"cf_silu({args[0]})",
            "HSWISH": lambda: f"cf_hswish({args[0]})",
            "MISH": lambda: f"cf_mish({args[0]})",
            "DSILU": lambda: f"cf_dsilu({args[0]})",
            "DHSWISH": lambda: f"cf_dhswish({args[0]})",
            "LDG": lambda: f"(*({args[0]}))",
            "LDCG": lambda: f"(*(volatile __global const float*)({args[0]}))",
            "FENCE_DEVICE": lambda: "mem_fence(CLK_GLOBAL_MEM_FENCE)",
            "TICKET": lambda: f"atomic_inc((volatile __global uint*)({args[0]}))",
            "COPY4_ASYNC": lambda: f"vstore4(vload4(0, {args[1]}), 0, {args[0]})",
            "COPY1_ASYNC": lambda: (f"(({args[0]})[{args[1]}] = ((({args[4]}) >> ({args[5]})) & 1ul) ? "
                                    f"({args[2]})[{args[3]}] : 0.0f)"),
            "COPY_WAIT": lambda: "((void)0)",
        }
        if token in HALF_TOKENS:
            return _opencl_half(token, args)
        if token in _OPENCL_REFUSED and token not in table:
            raise ValueError(f"OpenCL renderer refuses {token}: {_OPENCL_REFUSED[token]}")
        if token not in table:
            raise ValueError(f"OpenCL renderer has no spelling for {token}")
        return table[token]()

    def param(self, arg: Arg) -> str | None:
        if isinstance(arg, Buf):
            const = "const " if arg.readonly else ""
            return f"__global {const}{self.ctype(arg.ctype)}* restrict {arg.name}"
        if isinstance(arg, ConstBuf):
            return f"__constant {self.ctype(arg.ctype)}* restrict {arg.name}"
        if isinstance(arg, LocalBuf):
            return f"__local float* restrict {arg.name}"
        if isinstance(arg, TensorMap):
            raise ValueError(f"OpenCL renderer refuses tensor map {arg.name}: TMA is CUDA sm_90 only")
        assert isinstance(arg, Scalar)
        return f"const {arg.ctype} {arg.name}"

    def file_head(self, kernels: list[Kernel]) -> list[str]:
        return _OPENCL_BF16.splitlines() + [""] if _uses_half(kernels, "BF16") else []

    def kernel_head(self, k: Kernel, params: str) -> str:
        if k.cluster > 1:
            raise ValueError(f"OpenCL renderer refuses {k.name}: thread-block clusters are CUDA sm_90 only")
        b = k.block
        return (f"__kernel __attribute__((reqd_work_group_size({b[0]}, {b[1]}, {b[2]})))\n"
                f"void {k.name}({params})")


RENDERERS: dict[str, Renderer] = {"cuda": CudaRenderer(), "opencl": OpenCLRenderer()}


def render(kernels: list[Kernel], backend: str, title: str = "") -> str:
    """Render kernels for ``backend`` ('cuda' or 'opencl')."""
    try:
        renderer = RENDERERS[backend]
    except KeyError:
        raise ValueError(f"backend ({backend!r}) must be one of {sorted(RENDERERS)}") from None
    return renderer.render(kernels, title)
