"""Steps that put operands into the generator's layouts and number formats.

* :func:`x_nhwc`: activations N C H W (storage dtype) -> N H W Cp (Cp: C padded with zero channels to
  a whole 16-byte chunk), 32 x 32 tiles through shared memory (reads along pixels and writes along
  channels both coalesced). TF32: rounded (cvt.rna); 3xTF32: hi and lo parts; halves: the bits as
  they are.
* :func:`x_from_nhwc`: the same for channels-last activations (N H W C); a half input of whole chunks
  is read in place (:func:`reads_in_place`).
* :func:`w_krsc`: filters K C R S -> K x ld, element (r s Cp + c) with ld the reduction padded with
  zeros to a whole stage: a weight-only step (kept per weight version by the callers that cache
  filter transforms).
* :func:`x_fold` / :func:`w_fold`: a stem's filter columns folded into channels (``TcStemGemm``):
  x' [N][H][Q][S C] with x'[n][h][q][s C + c] = x[n][c][h][q sw + s dw - pl] (zero outside the image
  and past S C), the filters w'[k][r][s C + c] = w[k][c][r][s]: an R x 1 convolution of S C channels,
  stride (sh, 1), that computes the layer.
* :func:`rounded_parts`: the statements that store one float as the math mode's parts (shared by
  the Winograd transforms).
* :func:`amax` (3xFP16 only): the maximum |element| of a source tensor as 128 block maxima
  (``{dst}_m``); each step that splits the tensor reduces them in every warp (:func:`scale_lets`),
  scales by the power of two they give, and block 0 writes the inverse (``{dst}_s``) that the GEMM's
  epilogue multiplies its sums by.
"""

from __future__ import annotations

from math import prod

from convforge.codegen.dialect import Buf, Dim3, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels.tensorcore.sm90.epilogue import CTYPE
from convforge.kernels.tensorcore.sm90.isa import Math
from convforge.plan import Launch
from convforge.spec import ConvSpec

_ELT = 256
AMAX_BLOCKS = 128  # block maxima of the 3xFP16 maximum step (4 a lane of a warp's reduction)
_AMAX_THREADS = 512


def padded_channels(c: int, math: Math) -> int:
    """Channels as the generator reads them: a whole number of 16-byte chunks."""
    return cdiv(c, math.chunk_elems) * math.chunk_elems


def data_buffers(name: str, math: Math) -> tuple[Buf, ...]:
    """The buffers of an operand's parts: ``name`` (hi), ``name_lo``."""
    return tuple(Buf(name if p == "hi" else f"{name}_{p}", math.ctype, readonly=False) for p in math.parts)


def part_buffers(name: str, math: Math) -> tuple[Buf, ...]:
    """What a step that writes operand ``name`` takes after its source: the parts' buffers and, for a
    scaled math mode, the block maxima it reads and the inverse scale it writes."""
    if not math.scaled:
        return data_buffers(name, math)
    return data_buffers(name, math) + (Buf(f"{name}_m", "float"), Buf(f"{name}_s", "float", readonly=False))


def features(math: Math) -> frozenset[str]:
    """The dialect features of a step that writes ``math``'s operands (a scaled one's warp reduction
    shuffles)."""
    return frozenset({"mma_tf32", "wgmma", "shuffle"} if math.scaled else {"mma_tf32", "wgmma"})


def scale_workspace(name: str, math: Math) -> tuple[tuple[str, int], ...]:
    """The workspace of a scaled operand's maximum and inverse scale (none for other math modes)."""
    return ((f"{name}_m", 4 * AMAX_BLOCKS), (f"{name}_s", 4)) if math.scaled else ()


def scale_lets(math: Math, dst: str) -> list[str]:
    """The start of a step that writes scaled operand ``dst`` (every thread, before any exit): every
    warp reduces the block maxima to the tensor's maximum, ``sc_{dst}`` its scale; the first thread
    of block 0 writes the inverse. Nothing for other math modes."""
    if not math.scaled:
        return []
    ln = "(LOCAL_ID(0) + LOCAL_ID(1) * GROUP_SIZE(0)) & 31"
    return [f"float sc_{dst};",
            "{",
            f"const int ln_ = {ln};",
            f"float m_ = {dst}_m[ln_];",
            *(f"m_ = MAX(m_, {dst}_m[ln_ + {32 * i}]);" for i in range(1, AMAX_BLOCKS // 32)),
            "for (int o_ = 16; o_ > 0; o_ >>= 1) m_ = MAX(m_, SHFL(m_, ln_ ^ o_));",
            f"sc_{dst} = TC_X3H_SCALE(m_);",
            "if (GROUP_ID(0) + GROUP_ID(1) + GROUP_ID(2) + LOCAL_ID(0) + LOCAL_ID(1) == 0) "
            f"{dst}_s[0] = TC_X3H_UNSCALE(m_);",
            "}"]


def amax(name: str, src: str, total: int, dtype: str, dst: str) -> tuple[Kernel, Dim3]:
    """``{dst}_m[b]`` = the largest |element| block b of :data:`AMAX_BLOCKS` sees of the ``total``
    elements of ``src`` (a grid-stride read, 4 loads in flight a thread). NaN and infinite elements
    are skipped: they reach the products through hi as they are, and the others keep their scale."""
    stride = AMAX_BLOCKS * _AMAX_THREADS
    code = Code()
    code(f"SHARED float wmax[{_AMAX_THREADS // 32}];",
         f"int i = GROUP_ID(0) * {_AMAX_THREADS} + LOCAL_ID(0);",
         "float m0 = 0.0f, m1 = 0.0f, m2 = 0.0f, m3 = 0.0f;")
    with code.block(f"for (; i + {3 * stride} < {total}; i += {4 * stride})"):
        code(*(f"m{j} = MAX(m{j}, {_finite_abs(f'{src}[i + {j * stride}]')});" for j in range(4)))
    code(f"for (; i < {total}; i += {stride}) m0 = MAX(m0, {_finite_abs(f'{src}[i]')});",
         "m0 = MAX(MAX(m0, m1), MAX(m2, m3));",
         "for (int o = 16; o > 0; o >>= 1) m0 = MAX(m0, SHFL(m0, (LOCAL_ID(0) & 31) ^ o));",
         "if ((LOCAL_ID(0) & 31) == 0) wmax[LOCAL_ID(0) >> 5] = m0;",
         "BARRIER();")
    with code.block("if (LOCAL_ID(0) == 0)"):
        code("float r = wmax[0];",
             f"for (int j = 1; j < {_AMAX_THREADS // 32}; ++j) r = MAX(r, wmax[j]);",
             f"{dst}_m[GROUP_ID(0)] = r;")
    kern = Kernel(name, (Buf(src, CTYPE[dtype]), Buf(f"{dst}_m", "float", readonly=False)), code.text(),
                  (_AMAX_THREADS, 1, 1), frozenset({"wgmma", "shuffle"}),
                  comment=f"3xFP16: the maximum |{src}| of {total} elements as {AMAX_BLOCKS} block maxima")
    return kern, (AMAX_BLOCKS, 1, 1)


def launches(math: Math, kern: Kernel, grid: Dim3, src: str, dst: str,
             spec: ConvSpec) -> list[tuple[Kernel, Launch]]:
    """The launch of step ``kern`` (conv buffer ``src`` of ``spec`` -> operand ``dst``), after, for a
    scaled math mode, the maximum step over the whole of ``src``."""
    out = []
    if math.scaled:
        ak, agrid = amax_of(spec, src, dst)
        out.append((ak, Launch(ak.name, agrid, ak.block, (src, f"{dst}_m"))))
    return out + [(kern, Launch(kern.name, grid, kern.block, (src,) + tuple(b.name for b in part_buffers(dst, math))))]


def amax_of(spec: ConvSpec, src: str, dst: str) -> tuple[Kernel, Dim3]:
    """:func:`amax` over the whole of conv buffer ``src`` (x, w or y) of ``spec``, into ``{dst}_m``."""
    return amax(f"tc_amax_{dst}", src, prod(spec.shape_of(src)), spec.dtype, dst)


def _finite_abs(value: str) -> str:
    """|value| where it is finite, else 0 (NaN fails the comparison)."""
    return f"(fabsf({value}) <= 3.402823466e38f ? fabsf({value}) : 0.0f)"


def rounded_parts(math: Math, dst: str, index: str, value: str) -> list[str]:
    """Store float ``value`` at ``dst[index]`` (and ``dst_lo``) as ``math`` wants it: TF32-rounded, split
    into hi and lo (3xFP16: of the value scaled by ``sc_{dst}``, :func:`scale_lets`), or rounded to the
    half type."""
    if math.name == "tf32":
        return [f"{dst}[{index}] = CVT_TF32({value});"]
    if math.scaled and not math.split:
        return [f"{dst}[{index}] = TC_F32_TO_F16(({value}) * sc_{dst});"]
    if math.scaled:
        return ["{", f"const float v_ = ({value}) * sc_{dst};", "const unsigned short hi_ = TC_F32_TO_F16(v_);",
                f"{dst}[{index}] = hi_;", f"{dst}_lo[{index}] = TC_F32_TO_F16(v_ - TC_F16_TO_F32(hi_));", "}"]
    if math.split:
        return ["{", f"const float hi_ = CVT_TF32({value});", f"{dst}[{index}] = hi_;",
                f"{dst}_lo[{index}] = CVT_TF32(({value}) - hi_);", "}"]
    conv = "TC_F32_TO_F16" if math.name == "f16" else "TC_F32_TO_BF16"
    return [f"{dst}[{index}] = {conv}({value});"]


def zero(math: Math) -> str:
    """A zero of the math mode's storage type, as a C expression."""
    return "(unsigned short)0" if math.esize == 2 else "0.0f"


def zero_tail(code: Code, math: Math, dst: str, row: str, first: str, ld: int, step: int) -> None:
    """Zeros in row ``row`` (of ``ld`` elements) of every part of ``dst`` from ``first`` on, every
    ``step``-th element: the packing steps' padding past the taps up to a whole stage."""
    with code.block(f"for (int j = {first}; j < {ld}; j += {step})"):
        code(*(f"{b.name}[{row} * {ld} + j] = {zero(math)};" for b in data_buffers(dst, math)))


def store_parts(math: Math, dtype: str, dst: str, index: str, value: str) -> list[str]:
    """As :func:`rounded_parts` for a value already in storage dtype ``dtype``: halves copy their bits."""
    if dtype != "float32":
        return [f"{dst}[{index}] = {value};"]
    return rounded_parts(math, dst, index, value)


def x_nhwc(spec: ConvSpec, math: Math, cp: int, dst: str = "xh") -> tuple[Kernel, Dim3]:
    """The activation conversion step (see the module docstring)."""
    c, hw = spec.c, spec.h * spec.w
    return planes_to_rows("tc_x_nhwc", "x", f"(n * {c} + ci) * {hw} + p", spec.n, c, hw, cp, math, spec.dtype, dst,
                          f"x NCHW -> NHWC ({cp} channels) as {math.name} operands")


def planes_to_rows(name: str, src: str, at: str, count: int, chans: int, plane: int, cp: int, math: Math,
                   dtype: str, dst: str, comment: str) -> tuple[Kernel, Dim3]:
    """``dst[(n * plane + p) * cp + ci] = src[at]`` for n < ``count``, ci < ``cp`` (zero from ``chans``
    on), p < ``plane``, ``at`` a C expression of n, ci and p: planes of ``chans`` channels to rows of
    ``cp`` (NCHW -> NHWC, and wgrad's transposes), 32 x 32 tiles through shared memory (reads along
    p and writes along ci both coalesced), stored in the math mode's parts; 16-bit tensors copied as
    they are (one part, even ``cp``) by :func:`_half_planes_to_rows`."""
    if dtype != "float32" and math.parts == ("hi",) and not math.scaled and cp % 2 == 0:
        return _half_planes_to_rows(name, src, at, count, chans, plane, cp, dtype, dst, comment, math)
    st = CTYPE[dtype]
    code = Code()
    code(*scale_lets(math, dst))
    code(f"SHARED {st} tile[32 * 33];",
         "const int tx = LOCAL_ID(0), ty = LOCAL_ID(1), n = GROUP_ID(2);",
         "const int p0 = GROUP_ID(0) * 32, c0 = GROUP_ID(1) * 32;")
    for j in range(4):
        code(f"{{ const int ci = c0 + ty + {8 * j}, p = p0 + tx;",
             f"  tile[(ty + {8 * j}) * 33 + tx] = (ci < {chans} && p < {plane}) ? {src}[{at}] : 0; }}")
    code("BARRIER();")
    for j in range(4):
        with code.block(f"/* row {j} */"):
            code(f"const int p = p0 + ty + {8 * j}, ci = c0 + tx;")
            with code.block(f"if (p < {plane} && ci < {cp})"):
                code(*store_parts(math, dtype, dst, f"(n * {plane} + p) * {cp} + ci",
                                   f"tile[tx * 33 + ty + {8 * j}]"))
    kern = Kernel(name, (Buf(src, st),) + part_buffers(dst, math), code.text(), (32, 8, 1),
                  features(math), comment=comment)
    return kern, (cdiv(plane, 32), cdiv(cp, 32), count)


def _half_planes_to_rows(name: str, src: str, at: str, count: int, chans: int, plane: int, cp: int, dtype: str,
                         dst: str, comment: str, math: Math) -> tuple[Kernel, Dim3]:
    """:func:`planes_to_rows` of a 16-bit tensor: 64 x 64 tiles, sixteen loads a thread issued before
    any store (enough bytes in flight to stream: the 32 x 32 form held 2.2 TB/s on an H200), each
    warp reading 128 contiguous bytes of a plane and writing two channels a thread as one 32-bit
    word (128 contiguous bytes of a row; ``cp`` even keeps the words aligned)."""
    st = CTYPE[dtype]
    code = Code()
    code(f"SHARED {st} tile[64 * 66];",
         "const int tx = LOCAL_ID(0), ty = LOCAL_ID(1), n = GROUP_ID(2);",
         "const int p0 = GROUP_ID(0) * 64, c0 = GROUP_ID(1) * 64;",
         f"{st} v[16];")
    for j in range(8):
        for h in range(2):
            code(f"{{ const int ci = c0 + ty + {8 * j}, p = p0 + 2 * tx + {h};",
                 f"  v[{2 * j + h}] = (ci < {chans} && p < {plane}) ? {src}[{at}] : 0; }}")
    for j in range(8):
        code(f"tile[(ty + {8 * j}) * 66 + 2 * tx] = v[{2 * j}];",
             f"tile[(ty + {8 * j}) * 66 + 2 * tx + 1] = v[{2 * j + 1}];")
    code("BARRIER();")
    with code.block(f"if (c0 + 2 * tx < {cp})"):
        for j in range(8):
            with code.block(f"/* row {j} */"):
                code(f"const int p = p0 + ty + {8 * j};")
                with code.block(f"if (p < {plane})"):
                    code(f"const unsigned int lo = tile[2 * tx * 66 + ty + {8 * j}], "
                         f"hi = tile[(2 * tx + 1) * 66 + ty + {8 * j}];",
                         f"*(GLOBAL_PTR unsigned int*)({dst} + (n * {plane} + p) * {cp} + c0 + 2 * tx) = "
                         "lo | (hi << 16);")
    kern = Kernel(name, (Buf(src, st),) + part_buffers(dst, math), code.text(), (32, 8, 1),
                  features(math), comment=comment)
    return kern, (cdiv(plane, 64), cdiv(cp, 64), count)


def x_from_nhwc(spec: ConvSpec, math: Math, cp: int, dst: str = "xh") -> tuple[Kernel, Dim3]:
    """The activation step of a channels-last input: N H W C -> N H W Cp in the math mode's parts, one
    thread per element (reads and writes along channels, both coalesced); zero channels past C."""
    return rows_from_nhwc("tc_x_from_nhwc", "x", spec.c, spec.n * spec.h * spec.w, cp, math, spec.dtype, dst)


def rows_from_nhwc(name: str, src: str, chans: int, pixels: int, cp: int, math: Math, dtype: str,
                   dst: str) -> tuple[Kernel, Dim3]:
    """``dst[pix * cp + ci] = src[pix * chans + ci]`` (zero for ci >= ``chans``) over ``pixels`` rows of a
    channels-last tensor, in the math mode's parts: x's step, and a channels-last dy's in dgrad."""
    total = pixels * cp
    zero_ = zero(math)
    code = Code()
    code(*scale_lets(math, dst))
    code(f"const int e = GROUP_ID(0) * {_ELT} + LOCAL_ID(0);")
    with code.block(f"if (e < {total})"):
        code(f"const int pix = e / {cp}, ci = e - pix * {cp};")
        code(*store_parts(math, dtype, dst, "e", f"(ci < {chans} ? {src}[pix * {chans} + ci] : {zero_})"))
    comment = f"{src} NHWC ({chans} channels) -> NHWC ({cp} channels) as {math.name} operands"
    kern = Kernel(name, (Buf(src, CTYPE[dtype]),) + part_buffers(dst, math), code.text(), (_ELT, 1, 1),
                  features(math), comment=comment)
    return kern, (cdiv(total, _ELT), 1, 1)


def nhwc_to_batch_rows(name: str, src: str, count: int, chans: int, plane: int, cp: int, math: Math, dtype: str,
                       dst: str, comment: str) -> tuple[Kernel, Dim3]:
    """``dst[(ch * plane + p) * cp + n] = src[(n * plane + p) * chans + ch]`` for n < ``cp`` (zero from
    ``count`` on): a channels-last tensor (``count`` images of ``plane`` pixels, ``chans`` channels) to
    rows of the batch per (channel, pixel), wgrad's operands of channels-last activations. A tile of
    (image, element e = p chans + ch of an image's run) through shared memory: reads along e and writes
    along the batch both coalesced, every thread busy whatever ``chans`` (a 3-channel stem's x took a
    tile of 32 channels a pixel before, 3 of them real: 0.18 ms for its 38 MB at N128). Halves move as
    32-bit words (:func:`_batch_rows_words`) where the runs allow."""
    if dtype != "float32" and math.parts == ("hi",) and not math.scaled and (plane * chans) % 2 == 0 \
            and cp % 2 == 0:
        return _batch_rows_words(name, src, count, chans, plane, cp, math, dst, comment)
    st, run = CTYPE[dtype], plane * chans
    code = Code()
    code(*scale_lets(math, dst))
    code(f"SHARED {st} tile[32 * 33];",
         "const int tx = LOCAL_ID(0), ty = LOCAL_ID(1);",
         "const int e0 = GROUP_ID(0) * 32, n0 = GROUP_ID(2) * 32;")
    for j in range(4):
        code(f"{{ const int n = n0 + ty + {8 * j}, e = e0 + tx;",
             f"  tile[(ty + {8 * j}) * 33 + tx] = (n < {count} && e < {run}) ? {src}[n * {run} + e] : 0; }}")
    code("BARRIER();")
    for j in range(4):
        with code.block(f"/* row {j} */"):
            code(f"const int e = e0 + ty + {8 * j}, n = n0 + tx;")
            with code.block(f"if (e < {run} && n < {cp})"):
                code(f"const int p = e / {chans}, ch = e % {chans};")
                code(*store_parts(math, dtype, dst, f"(ch * {plane} + p) * {cp} + n",
                                   f"tile[tx * 33 + ty + {8 * j}]"))
    kern = Kernel(name, (Buf(src, st),) + part_buffers(dst, math), code.text(), (32, 8, 1),
                  features(math), comment=comment)
    return kern, (cdiv(run, 32), 1, cdiv(cp, 32))


def _batch_rows_words(name: str, src: str, count: int, chans: int, plane: int, cp: int, math: Math,
                      dst: str, comment: str) -> tuple[Kernel, Dim3]:
    """:func:`nhwc_to_batch_rows` for halves with even runs and batch: a 64 x 64 tile of (image, element),
    each warp reading one image's 64 elements as 32 words (128 contiguous bytes) and writing one
    element's 64 images as 32 words, two halves a word packed from two tile rows. Rows of 33 words:
    the word stores hit 32 banks, the half reads two rows a bank at most."""
    run = plane * chans
    code = Code()
    code("SHARED unsigned int tile[64 * 33];",
         "const int tx = LOCAL_ID(0), ty = LOCAL_ID(1);",
         "const int e0 = GROUP_ID(0) * 64, n0 = GROUP_ID(2) * 64;",
         f"const GLOBAL_PTR unsigned int* xs = (const GLOBAL_PTR unsigned int*){src};",
         f"GLOBAL_PTR unsigned int* ds = (GLOBAL_PTR unsigned int*){dst};",
         "const LOCAL_PTR unsigned short* th = (const LOCAL_PTR unsigned short*)tile;")
    for j in range(8):
        code(f"{{ const int n = n0 + ty + {8 * j}, e = e0 + 2 * tx;",
             f"  tile[(ty + {8 * j}) * 33 + tx] = (n < {count} && e < {run}) ? xs[(n * {run} + e) / 2] : 0u; }}")
    code("BARRIER();")
    for j in range(8):
        with code.block(f"/* element row {j} */"):
            code(f"const int e = e0 + ty + {8 * j}, n = n0 + 2 * tx;")
            with code.block(f"if (e < {run} && n < {cp})"):
                code(f"const int p = e / {chans}, ch = e % {chans};",
                     f"const unsigned int lo = th[(2 * tx) * 66 + ty + {8 * j}], "
                     f"hi = th[(2 * tx + 1) * 66 + ty + {8 * j}];",
                     f"ds[((ch * {plane} + p) * {cp} + n) / 2] = lo | (hi << 16);")
    kern = Kernel(name, (Buf(src, CTYPE["float16"]),) + part_buffers(dst, math), code.text(), (32, 8, 1),
                  features(math), comment=comment)
    return kern, (cdiv(run, 64), 1, cdiv(cp, 64))


def reads_in_place(spec: ConvSpec, math: Math) -> bool:
    """Whether the GEMM reads the input as it lies: a channels-last input of whole 16-byte chunks, in
    half precision (its bits are the operands) or TF32 (the tensor cores read a float's top 19 bits:
    x truncated, not rounded; the filters are still rounded to nearest, so the error stays about
    cuDNN's TF32 error, and the per-element pass that would cost more than the GEMM on linear layers
    is skipped). 3xTF32 splits x into hi and lo first; the scaled modes scale and round it."""
    return spec.layout == "nhwc" and not (math.split or math.scaled) and padded_channels(spec.c, math) == spec.c


def w_krsc(spec: ConvSpec, math: Math, cp: int, ld: int, dst: str = "wt",
           block: tuple[int, int] | None = None) -> tuple[Kernel, Dim3]:
    """The filter packing step (see the module docstring): one thread per (k, c), channels fastest,
    reading its R S contiguous taps (a warp reads one contiguous run) and writing them R S channel
    rows apart (each store coalesced across the warp); channels past C and the row's tail past
    R S Cp get zeros. ``block`` = (kg, cg): filters of ``cg`` channels a row (K x cg x R x S), groups of
    ``kg`` rows, packed block-diagonally into rows of C = P cg channels (P groups a packed group: row k
    holds its cg channels at (k / kg % P) cg, zeros elsewhere)."""
    rs, c, total, tail = spec.r * spec.s, spec.c, spec.k * cp, ld - spec.r * spec.s * cp
    zero_ = zero(math)
    code = Code()
    code(*scale_lets(math, dst))
    code(f"const int e = GROUP_ID(0) * {_ELT} + LOCAL_ID(0);")
    with code.block(f"if (e < {total})"):
        code(f"const int k = e / {cp}, ci = e - k * {cp};")
        if block is None:
            code(f"const bool ok = ci < {c};",
                 f"const {CTYPE[spec.dtype]}* src = w + (k * {c} + (ok ? ci : 0)) * {rs};")
        else:
            kg, cg = block
            if c % cg:
                raise ValueError(f"block-diagonal filters: C ({c}) is not a whole number of groups of {cg}")
            code(f"const int cj = ci - k / {kg} % {c // cg} * {cg};  // the channel within the row's own group",
                 f"const bool ok = (unsigned)cj < {cg}u;",
                 f"const GLOBAL_PTR {CTYPE[spec.dtype]}* src = w + (k * {cg} + (ok ? cj : 0)) * {rs};")
        code(f"const int o = k * {ld} + ci;")
        for i in range(rs):
            value = f"(ok ? src[{i}] : {zero_})"
            code(*store_parts(math, spec.dtype, dst, f"o + {i * cp}", value))
        if tail:
            zero_tail(code, math, dst, "k", f"{rs * cp} + ci", ld, cp)
    kern = Kernel("tc_w_krsc", (Buf("w", CTYPE[spec.dtype]),) + part_buffers(dst, math), code.text(),
                  (_ELT, 1, 1), features(math),
                  comment=f"filters K C R S -> K x (R S {cp}) padded to {ld}, as {math.name} operands")
    return kern, (cdiv(total, _ELT), 1, 1)


def fold_source(spec: ConvSpec, cp: int) -> tuple[list[tuple[str, str]], str, str]:
    """The folded activation element ``e`` of x' = [N][H][Q][cp] (:func:`x_fold`) as C: its bindings
    (name, expression) in order, whether it lies in the image and the layer (``ok``), and its index
    into x (NCHW or NHWC as ``spec.layout``). Kept apart so the tests evaluate the very strings the
    kernel is made of."""
    c, h, w, q = spec.c, spec.h, spec.w, spec.q
    (_, sw), (_, dw), pl = spec.stride, spec.dilation, spec.pad[2]
    lets = [("cj", f"e % {cp}"), ("pix", f"e / {cp}"), ("qq", f"pix % {q}"), ("hh", f"pix / {q} % {h}"),
            ("n", f"pix / {q * h}"), ("s", f"cj / {c}"), ("ci", f"cj - s * {c}"),
            ("ww", f"qq * {sw} + s * {dw} - {pl}")]
    ok = f"(cj < {spec.s * c} && ww >= 0 && ww < {w})"
    if spec.layout == "nchw":
        at = f"((n * {c} + ci) * {h} + hh) * {w} + ww"
    else:
        at = f"((n * {h} + hh) * {w} + ww) * {c} + ci"
    return lets, ok, at


def x_fold(spec: ConvSpec, math: Math, cp: int, dst: str = "xh") -> tuple[Kernel, Dim3]:
    """The stem's activation step (module docstring): one thread per element of x', channels fastest
    (writes coalesced; the reads of a warp fall in a few lines of S C values)."""
    total = spec.n * spec.h * spec.q * cp
    lets, ok, at = fold_source(spec, cp)
    code = Code()
    code(*scale_lets(math, dst))
    code(f"const int e = GROUP_ID(0) * {_ELT} + LOCAL_ID(0);")
    with code.block(f"if (e < {total})"):
        code(*(f"const int {name} = {expr};" for name, expr in lets))
        code(f"const bool ok = {ok};")
        code(*store_parts(math, spec.dtype, dst, "e", f"(ok ? x[{at}] : {zero(math)})"))
    kern = Kernel("tc_x_fold", (Buf("x", CTYPE[spec.dtype]),) + part_buffers(dst, math), code.text(),
                  (_ELT, 1, 1), features(math),
                  comment=f"x {spec.layout.upper()} -> [N][H][Q][{cp}]: the {spec.s} filter columns folded into "
                          f"channels, as {math.name} operands")
    return kern, (cdiv(total, _ELT), 1, 1)


def wfold_source(spec: ConvSpec, cp: int, ld: int) -> list[tuple[str, str]]:
    """The bindings of filter-step thread ``e`` (:func:`w_fold`) as C: its row k, folded channel cj, its
    source tap column s and channel ci, ``ok`` (cj inside S C), ``src`` (the index in w of its first
    tap, tap r at ``src + r S``; s clamped so a padding channel's index stays inside w, though it is
    not read) and ``o`` (its first destination; tap r at ``o + r cp``)."""
    c, s_ = spec.c, spec.s
    return [("k", f"e / {cp}"), ("cj", f"e - k * {cp}"), ("s", f"cj / {c}"), ("ci", f"cj - s * {c}"),
            ("ok", f"(cj < {s_ * c})"), ("src", f"(k * {c} + ci) * {spec.r * s_} + min(s, {s_ - 1})"),
            ("o", f"k * {ld} + cj")]


def w_fold(spec: ConvSpec, math: Math, cp: int, ld: int, dst: str = "wt") -> tuple[Kernel, Dim3]:
    """The stem's filter step: one thread per (k, cj) of the folded channels cj = s C + c, writing its R
    taps R rows of ``cp`` apart (K x ld, the row's tail past R cp zero)."""
    r, s_, total, tail = spec.r, spec.s, spec.k * cp, ld - spec.r * cp
    code = Code()
    code(*scale_lets(math, dst))
    code(f"const int e = GROUP_ID(0) * {_ELT} + LOCAL_ID(0);")
    with code.block(f"if (e < {total})"):
        for name, expr in wfold_source(spec, cp, ld):
            code(f"const {'bool' if name == 'ok' else 'int'} {name} = {expr};")
        for i in range(r):
            value = f"(ok ? w[src + {i * s_}] : {zero(math)})"
            code(*store_parts(math, spec.dtype, dst, f"o + {i * cp}", value))
        if tail:
            zero_tail(code, math, dst, "k", f"{r * cp} + cj", ld, cp)
    kern = Kernel("tc_w_fold", (Buf("w", CTYPE[spec.dtype]),) + part_buffers(dst, math), code.text(),
                  (_ELT, 1, 1), features(math),
                  comment=f"filters K C R S -> K x (R {cp}) padded to {ld}, the S columns folded into channels, "
                          f"as {math.name} operands")
    return kern, (cdiv(total, _ELT), 1, 1)
