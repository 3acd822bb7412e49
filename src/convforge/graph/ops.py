"""Non-conv operations in the kernel dialect: pooling, LRN, activations, per-channel affine
(unfolded batch norm / scale), add, softmax and concat copies; broadcast binary ops, resize and
padding (what ONNX exports of modern CNNs bring).

Each builder returns an :class:`OpLaunch`: a kernel specialised to its shapes (sizes are constants,
like the conv families) and its launch, with arguments named by tensor or weight. One thread per
output element, 1-D blocks of 256; a per-row reduction (softmax) is one work-group per row.
Activations are stored as the network's dtype (``st``: float32, float16 or bfloat16; arithmetic in
float32); per-channel parameters (the affine's scale and shift) stay float32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from convforge.codegen.dialect import FLOAT32, Buf, Kernel, Storage
from convforge.graph.ir import Node, Tensor, conv_geometry, lrn_params

BLOCK = 256
ROW_MIN = 64  # a per-row reduction at least this long gets a work-group per row


@dataclass(frozen=True)
class OpLaunch:
    """A kernel and its launch; ``args`` are buffer names (tensors, weights) in kernel order."""

    kernel: Kernel
    grid: tuple[int, int, int]
    args: tuple[str, ...]


def kernel_name(node: Node, suffix: str = "") -> str:
    return "g_" + re.sub(r"\W", "_", node.name) + suffix


def _elementwise(name: str, total: int, bufs: tuple[Buf, ...], refs: tuple[str, ...], body: str,
                 comment: str) -> OpLaunch:
    text = (f"const int e = GROUP_ID(0) * {BLOCK} + LOCAL_ID(0);\n"
            f"if (e >= {total}) return;\n{body}")
    kern = Kernel(name, bufs, text, (BLOCK, 1, 1), comment=comment)
    return OpLaunch(kern, (-(-total // BLOCK), 1, 1), refs)


def _out(st: Storage = FLOAT32) -> Buf:
    return st.buf("y", readonly=False)


def pool(node: Node, x: Tensor, y: Tensor, src: str, dst: str, st: Storage = FLOAT32) -> OpLaunch:
    """Max or average pooling (global too; Caffe's ceil mode; average counts padding when
    ``count_pad``, clipped at the padded edge as Caffe does). A pool with ``attrs["lrn"]`` (the
    graph pass ``fuse_lrn_pool``) normalises its input across channels as it reads it."""
    n, c, h, w = x.shape
    _, _, p, q = y.shape
    is_max = node.attrs.get("kind", "max") == "max"
    if node.attrs.get("global") and h * w >= ROW_MIN and not node.attrs.get("lrn"):
        return _global_pool(node, x, src, dst, is_max, st)
    if node.attrs.get("global"):
        kr, ks, sh, sw, pt, pb, pl, pr = h, w, 1, 1, 0, 0, 0, 0
    else:
        (kr, ks), (sh, sw), (pt, pb, pl, pr), _ = conv_geometry(node)
    count_pad = bool(node.attrs.get("count_pad", True))
    if is_max:
        fin = "{acc}"
    elif count_pad:
        fin = f"{{acc}} / (float)((min(y0 + {kr}, {h + pb}) - y0) * (min(x0 + {ks}, {w + pr}) - x0))"
    else:
        fin = "{acc} / (float)((ye - ys) * (xe - xs))"
    lrn_attrs = node.attrs.get("lrn")
    if lrn_attrs:
        return _lrn_pool(node, x, y, src, dst, st, lrn_attrs, (kr, ks, sh, sw, pt, pl), is_max, fin)
    acc = "acc = MAX(acc, v);" if is_max else "acc += v;"
    body = f"""const int j = e % {q}, i = (e / {q}) % {p}, nc = e / {p * q};
const int y0 = i * {sh} - {pt}, x0 = j * {sw} - {pl};
const int ys = max(y0, 0), ye = min(y0 + {kr}, {h}), xs = max(x0, 0), xe = min(x0 + {ks}, {w});
const GLOBAL_PTR {st.elem}* in = x + nc * {h * w};
float acc = {_init(is_max)};
for (int yy = ys; yy < ye; ++yy)
    for (int xx = xs; xx < xe; ++xx) {{
        const float v = {st.load("in", f"yy * {w} + xx")};
        {acc}
    }}
{st.store("y", "e", fin.format(acc="acc"))};"""
    return _elementwise(kernel_name(node), n * c * p * q, (st.buf("x"), _out(st)), (src, dst), body,
                        f"{node.name}: pool {'max' if is_max else 'avg'} {kr}x{ks}/{sh}")


def _init(is_max: bool) -> str:
    return "-3.402823466e38f" if is_max else "0.0f"


def _global_pool(node: Node, x: Tensor, src: str, dst: str, is_max: bool, st: Storage = FLOAT32) -> OpLaunch:
    """Global max / average pooling of long rows: one work-group per (image, channel), the
    reduction in parallel in shared memory (float4 when the row is a multiple of 4 long)."""
    n, c, h, w = x.shape
    hw = h * w
    vec = hw % 4 == 0
    threads = _row_threads(hw // 4 if vec else hw)
    op = "MAX" if is_max else "ADD"
    init = "-3.402823466e38f" if is_max else "0.0f"
    if vec:
        fold = ("MAX(MAX(v.x, v.y), MAX(v.z, v.w))" if is_max else "(v.x + v.y) + (v.z + v.w)")
        step = (f"{{ const float4 v = {st.vload4('i', 'in')}; "
                f"acc = {'MAX(acc, ' + fold + ')' if is_max else 'acc + ' + fold}; }}")
        loop = f"for (int i = t; i < {hw // 4}; i += {threads}) {step}"
    else:
        v = st.load("in", "i")
        loop = f"for (int i = t; i < {hw}; i += {threads}) acc = {f'MAX(acc, {v})' if is_max else f'acc + {v}'};"
    body = f"""const int t = LOCAL_ID(0), row = GROUP_ID(0);
const GLOBAL_PTR {st.elem}* in = x + row * {hw};
SHARED float red[{threads}];
float acc = {init};
{loop}
{_block_reduce("acc", op, threads)}
if (t == 0) {st.store("y", "row", "acc" if is_max else f"acc * {1.0 / hw!r}f")};"""
    kern = Kernel(kernel_name(node), (st.buf("x"), _out(st)), body, (threads, 1, 1),
                  comment=f"{node.name}: global {'max' if is_max else 'avg'} pool of {h}x{w}, a work-group per row")
    return OpLaunch(kern, (n * c, 1, 1), (src, dst))


LRN_CHANNELS = 8  # channels a thread normalises: it loads them and the window's halo once


def lrn(node: Node, x: Tensor, src: str, dst: str, st: Storage = FLOAT32) -> OpLaunch:
    """Across-channel LRN: y = x / (k + alpha/size * sum of squares over the window)^beta; a
    thread normalises LRN_CHANNELS channels of one pixel (the fused kernel with a 1x1 window)."""
    return _lrn_pool(node, x, x, src, dst, st, node.attrs, None, True, "{acc}")


def _inv_pow(base: str, beta: float) -> str:
    """``base`` to the power -beta without pow() (tens of instructions on CUDA): rsqrt and sqrt
    for AlexNet's and GoogLeNet's 0.75 (within 3 ulp), else exp2(-beta log2(base))."""
    if beta == 0.75:
        return f"rsqrt({base} * sqrt({base}))"
    if beta == 0.5:
        return f"rsqrt({base})"
    if beta == 1.0:
        return f"(1.0f / {base})"
    return f"exp2({-beta!r}f * log2({base}))"


def _lrn_values(st: Storage, attrs: dict, c: int, hw: int, off: str, use: str) -> str:
    """Load channels c0 - size/2 .. c0 + LRN_CHANNELS - 1 + size/2 at element ``off`` of the
    image's planes (zero outside 0..c-1), and for each channel u of the LRN_CHANNELS set ``r`` to
    its normalised value and run ``use`` (a format string of ``u``)."""
    size, alpha, beta, k = lrn_params(attrs)
    half, ch = size // 2, LRN_CHANNELS
    lines = []
    for i in range(ch + size - 1):
        cc = "c0" + (f" - {half - i}" if i < half else f" + {i - half}" if i > half else "")
        inside = f"{cc} >= 0" if i < half else f"{cc} < {c}"
        lines.append(f"const float v{i} = {inside} ? {st.load('in', f'({cc}) * {hw} + {off}')} : 0.0f;")
        lines.append(f"const float s{i} = v{i} * v{i};")
    for u in range(ch):
        sq = " + ".join(f"s{u + t}" for t in range(size))
        stmt = (f"{{ const float b = {k!r}f + {alpha / size!r}f * ({sq}); "
                f"const float r = v{u + half} * {_inv_pow('b', beta)}; {use.format(u=u)} }}")
        lines.append(stmt if c % ch == 0 else f"if (c0 + {u} < {c}) {stmt}")
    return "\n".join(lines)


def _lrn_pool(node: Node, x: Tensor, y: Tensor, src: str, dst: str, st: Storage, attrs: dict,
              window: tuple[int, int, int, int, int, int] | None, is_max: bool, fin: str) -> OpLaunch:
    """LRN across channels, then (``window``: kr, ks, sh, sw, pt, pl) pooling of the normalised
    values, finished by ``fin`` (``{acc}`` the pooled sum or max): the normalised tensor is never
    written (AlexNet's norm -> pool reads 4x what it writes). A thread: LRN_CHANNELS channels of
    one output pixel."""
    n, c, h, w = x.shape
    _, _, p, q = y.shape
    size = lrn_params(attrs)[0]
    ch, hw = LRN_CHANNELS, h * w
    blocks = -(-c // ch)
    fold = "acc[{u}] = MAX(acc[{u}], r);" if is_max else "acc[{u}] += r;"
    head = (f"const int j = e % {q}, i = (e / {q}) % {p}, c0 = (e / {p * q}) % {blocks} * {ch}, "
            f"nb = e / {p * q * blocks};\n"
            f"const GLOBAL_PTR {st.elem}* in = x + nb * {c * hw};\n")
    out = f"nb * {c * p * q} + (c0 + u) * {p * q} + i * {q} + j"
    store = f"for (int u = 0; u < {ch}; ++u) if (c0 + u < {c}) {st.store('y', out, fin.format(acc='acc[u]'))};"
    if window is None:
        body = (head + f"float acc[{ch}];\n" + _lrn_values(st, attrs, c, hw, f"i * {w} + j", "acc[{u}] = r;")
                + "\n" + store)
        what = f"LRN size {size}"
    else:
        kr, ks, sh, sw, pt, pl = window
        body = head + f"""const int y0 = i * {sh} - {pt}, x0 = j * {sw} - {pl};
const int ys = max(y0, 0), ye = min(y0 + {kr}, {h}), xs = max(x0, 0), xe = min(x0 + {ks}, {w});
float acc[{ch}];
for (int u = 0; u < {ch}; ++u) acc[u] = {_init(is_max)};
for (int yy = ys; yy < ye; ++yy)
    for (int xx = xs; xx < xe; ++xx) {{
{_indent(_lrn_values(st, attrs, c, hw, f"yy * {w} + xx", fold), 8)}
    }}
{store}"""
        what = f"LRN size {size} then pool {'max' if is_max else 'avg'} {kr}x{ks}/{sh}"
    return _elementwise(kernel_name(node), n * blocks * p * q, (st.buf("x"), _out(st)), (src, dst), body,
                        f"{node.name}: {what}, {ch} channels a thread")


def _indent(text: str, spaces: int) -> str:
    return "\n".join(" " * spaces + line for line in text.splitlines())


def activation(node: Node, x: Tensor, src: str, dst: str, st: Storage = FLOAT32) -> OpLaunch:
    """ReLU, leaky ReLU (``slope``) and clipped ReLU (``clip``)."""
    slope = float(node.attrs.get("slope", 0.0))
    clip = node.attrs.get("clip")
    expr = f"(v > 0.0f ? v : v * {slope!r}f)" if slope else "RELU(v)"
    if clip is not None:
        expr = f"({expr} > {float(clip)!r}f ? {float(clip)!r}f : {expr})"  # fmin would turn NaN into the clip
    body = f"const float v = {st.load('x', 'e')};\n{st.store('y', 'e', expr)};"
    return _elementwise(kernel_name(node), x.size, (st.buf("x"), _out(st)), (src, dst), body,
                        f"{node.name}: relu")


def affine(node: Node, x: Tensor, src: str, dst: str, scale: str, shift: str, relu: bool,
           st: Storage = FLOAT32) -> OpLaunch:
    """y = x * scale[c] + shift[c] (unfolded batch norm, Caffe Scale), optional ReLU; scale and
    shift are float32 whatever the activations' storage."""
    c = x.shape[1]
    hw = x.size // (x.shape[0] * c)
    expr = f"FMA({st.load('x', 'e')}, a[ch], b[ch])"
    body = f"const int ch = (e / {hw}) % {c};\n{st.store('y', 'e', f'RELU({expr})' if relu else expr)};"
    return _elementwise(kernel_name(node), x.size, (st.buf("x"), Buf("a"), Buf("b"), _out(st)),
                        (src, scale, shift, dst), body, f"{node.name}: per-channel affine")


def add(node: Node, x: Tensor, srcs: list[str], dst: str, relu: bool, st: Storage = FLOAT32) -> OpLaunch:
    """y = sum of the inputs, optional ReLU."""
    names = [f"x{i}" for i in range(len(srcs))]
    total = " + ".join(st.load(a, "e") for a in names)
    body = f"{st.store('y', 'e', f'RELU({total})' if relu else total)};"
    bufs = tuple(st.buf(a) for a in names) + (_out(st),)
    return _elementwise(kernel_name(node), x.size, bufs, tuple(srcs) + (dst,), body, f"{node.name}: add")


def _row_threads(length: int) -> int:
    """Work-group size for one row of ``length``: a power of two from 32 up to BLOCK."""
    t = 32
    while t < min(length, BLOCK):
        t *= 2
    return t


def _block_reduce(var: str, op: str, threads: int) -> str:
    """Reduce ``var`` over the work-group through the shared array ``red`` (tree, unrolled);
    every thread ends with the result in ``var``. ``op`` is MAX or ADD."""
    comb = "MAX(red[t], red[t + {s}])" if op == "MAX" else "red[t] + red[t + {s}]"
    lines = [f"red[t] = {var};", "BARRIER();"]
    half = threads // 2
    while half:
        lines += [f"if (t < {half}) red[t] = {comb.format(s=half)};", "BARRIER();"]
        half //= 2
    lines += [f"{var} = red[0];", "BARRIER();"]  # all read red[0] before it is written again
    return "\n".join(lines)


def softmax(node: Node, x: Tensor, src: str, dst: str, st: Storage = FLOAT32) -> OpLaunch:
    """Softmax over channels: one work-group per row (image, pixel), the max and the sum
    reduced in parallel in shared memory; float4 loads when the rows are contiguous (one
    pixel) and a multiple of 4 long."""
    n, c = x.shape[0], x.shape[1]
    hw = x.size // (n * c)
    threads = _row_threads(c // 4 if hw == 1 and c % 4 == 0 else c)
    if hw == 1 and c % 4 == 0:
        base = f"const int t = LOCAL_ID(0), row = GROUP_ID(0);\nconst GLOBAL_PTR {st.elem}* in = x + row * {c};\n" \
               f"GLOBAL_PTR {st.elem}* out = y + row * {c};"
        loop = f"for (int i = t; i < {c // 4}; i += {threads})"
        vin = st.vload4("i", "in")
        m_body = f"{{ const float4 v = {vin}; m = MAX(m, MAX(MAX(v.x, v.y), MAX(v.z, v.w))); }}"
        s_body = (f"{{ const float4 v = {vin};\n"
                  "  s += (exp(v.x - m) + exp(v.y - m)) + (exp(v.z - m) + exp(v.w - m)); }")
        vout = st.vstore4("MAKE_FLOAT4(exp(v.x - m) * inv, exp(v.y - m) * inv, exp(v.z - m) * inv, "
                          "exp(v.w - m) * inv)", "i", "out")
        w_body = f"{{ const float4 v = {vin};\n  {vout}; }}"
    else:
        base = (f"const int t = LOCAL_ID(0), row = GROUP_ID(0);\n"
                f"const GLOBAL_PTR {st.elem}* in = x + (row / {hw}) * {c * hw} + row % {hw};\n"
                f"GLOBAL_PTR {st.elem}* out = y + (row / {hw}) * {c * hw} + row % {hw};")
        loop = f"for (int ch = t; ch < {c}; ch += {threads})"
        vin = st.load("in", f"ch * {hw}")
        m_body = f"m = MAX(m, {vin});"
        s_body = f"s += exp({vin} - m);"
        w_body = f"{st.store('out', f'ch * {hw}', f'exp({vin} - m) * inv')};"
    body = f"""{base}
SHARED float red[{threads}];
float m = -3.402823466e38f;
{loop} {m_body}
{_block_reduce("m", "MAX", threads)}
float s = 0.0f;
{loop} {s_body}
{_block_reduce("s", "ADD", threads)}
const float inv = 1.0f / s;
{loop} {w_body}"""
    kern = Kernel(kernel_name(node), (st.buf("x"), _out(st)), body, (threads, 1, 1),
                  comment=f"{node.name}: softmax over {c} channels, a work-group of {threads} per row")
    return OpLaunch(kern, (n * hw, 1, 1), (src, dst))


def copy_into(node: Node, x: Tensor, total_c: int, offset: int, src: str, dst: str, part: int,
              st: Storage = FLOAT32) -> OpLaunch:
    """Concat: copy ``x`` into channels [offset, offset + C) of a ``total_c``-channel tensor (half
    storage through float: exact)."""
    n, c = x.shape[0], x.shape[1]
    chw = x.size // n
    at = f"(e / {chw}) * {total_c * chw // c} + {offset * chw // c} + e % {chw}"
    body = f"{st.store('y', at, st.load('x', 'e'))};"
    return _elementwise(kernel_name(node, f"_{part}"), x.size, (st.buf("x"), _out(st)), (src, dst), body,
                        f"{node.name}: concat input {part} at channel {offset}")


# -- the ops of modern CNNs' ONNX exports (ir.py: act, binary, resize, pad) ------------------------

def act_expr(fn: str, attrs: dict, v: str) -> str:
    """The float expression of activation ``fn`` (ir.ACT_FNS) of ``v``, NaN kept NaN (comparisons
    rather than fmin / fmax, which would turn it into a bound)."""
    if fn == "sigmoid":
        return f"(1.0f / (1.0f + exp(-{v})))"
    if fn == "silu":
        return f"SILU({v})"
    if fn == "hardswish":
        return f"HSWISH({v})"
    if fn == "gelu":
        return f"GELU({v})"
    if fn == "mish":
        return f"MISH({v})"
    if fn == "softplus":
        return f"log1p(exp({v}))"
    if fn == "tanh":
        return f"tanh({v})"
    if fn == "hardsigmoid":
        t = f"({float(attrs.get('alpha', 0.2))!r}f * {v} + {float(attrs.get('beta', 0.5))!r}f)"
        return f"({t} < 0.0f ? 0.0f : {t} > 1.0f ? 1.0f : {t})"
    lo, hi = attrs.get("lo"), attrs.get("hi")
    expr = v
    if hi is not None:
        expr = f"({expr} > {float(hi)!r}f ? {float(hi)!r}f : {expr})"
    if lo is not None:
        expr = f"({v} < {float(lo)!r}f ? {float(lo)!r}f : {expr})"
    return expr


def unary(node: Node, x: Tensor, src: str, dst: str, st: Storage = FLOAT32) -> OpLaunch:
    """y = fn(x) elementwise (an ``act`` node)."""
    fn = node.attrs["fn"]
    body = f"const float v = {st.load('x', 'e')};\n{st.store('y', 'e', act_expr(fn, node.attrs, 'v'))};"
    return _elementwise(kernel_name(node), x.size, (st.buf("x"), _out(st)), (src, dst), body, f"{node.name}: {fn}")


def _offset(shape: tuple[int, ...], out: tuple[int, ...]) -> str:
    """The element offset in a tensor of ``shape`` broadcast to ``out`` (equal ranks) of the output
    element whose coordinates are i0, i1, ...: broadcast dims contribute nothing."""
    if shape == out:
        return "e"
    terms, stride = [], 1
    for d in reversed(range(len(out))):
        if shape[d] != 1:
            terms.append(f"i{d} * {stride}" if stride != 1 else f"i{d}")
        stride *= shape[d]
    return " + ".join(reversed(terms)) or "0"


def binary(node: Node, a: Tensor, b: tuple[int, ...], y: Tensor, srcs: tuple[str, str], dst: str,
           b_const: bool, st: Storage = FLOAT32) -> OpLaunch:
    """y = a fn b (add, sub, mul, div) with NumPy broadcasting; ``b`` (shape ``b``) is the second
    tensor, or a float32 constant (``b_const``; left of the operator with attrs["swap"])."""
    out = y.shape
    coords = []
    div = 1
    for d in reversed(range(len(out))):
        coords.append(f"i{d} = " + (f"(e / {div})" if div > 1 else "e") + (f" % {out[d]}" if d else ""))
        div *= out[d]
    lhs = st.load("a", _offset(a.shape, out))
    rhs = f"b[{_offset(b, out)}]" if b_const else st.load("b", _offset(b, out))
    if node.attrs.get("swap"):
        lhs, rhs = rhs, lhs
    op = {"add": "+", "sub": "-", "mul": "*", "div": "/"}[node.attrs["fn"]]
    need = a.shape != out or b != out
    store = st.store("y", "e", f"{lhs} {op} {rhs}")
    body = (f"const int {', '.join(reversed(coords))};\n" if need else "") + f"{store};"
    bufs = (st.buf("a"), Buf("b") if b_const else st.buf("b"), _out(st))
    return _elementwise(kernel_name(node), y.size, bufs, (*srcs, dst), body,
                        f"{node.name}: {node.attrs['fn']} {a.shape} by {'constant ' if b_const else ''}{b}")


def resize(node: Node, x: Tensor, y: Tensor, src: str, dst: str, rows: str, cols: str,
           st: Storage = FLOAT32) -> OpLaunch:
    """Nearest or bilinear resize by two float32 tables ``rows`` (P x 3) and ``cols`` (Q x 3) of
    (first source, second source, weight of the second), ir.resize_table's, computed on the host in
    float64 so a rounding tie lands where the reference puts it."""
    _, _, h, w = x.shape
    _, _, p, q = y.shape
    head = (f"const int j = e % {q}, i = (e / {q}) % {p}, nc = e / {p * q};\n"
            f"const GLOBAL_PTR {st.elem}* in = x + nc * {h * w};\n"
            f"const int y0 = (int)ty[3 * i], x0 = (int)tx[3 * j];\n")
    if node.attrs["mode"] == "nearest":
        body = head + f"{st.store('y', 'e', st.load('in', f'y0 * {w} + x0'))};"
    else:
        ld = lambda r, c: st.load("in", f"{r} * {w} + {c}")  # noqa: E731
        body = head + f"""const int y1 = (int)ty[3 * i + 1], x1 = (int)tx[3 * j + 1];
const float fy = ty[3 * i + 2], fx = tx[3 * j + 2];
const float top = (1.0f - fx) * {ld('y0', 'x0')} + fx * {ld('y0', 'x1')};
const float bot = (1.0f - fx) * {ld('y1', 'x0')} + fx * {ld('y1', 'x1')};
{st.store('y', 'e', '(1.0f - fy) * top + fy * bot')};"""
    return _elementwise(kernel_name(node), y.size, (st.buf("x"), Buf("ty"), Buf("tx"), _out(st)),
                        (src, rows, cols, dst), body,
                        f"{node.name}: resize {node.attrs['mode']} {h}x{w} -> {p}x{q} ({node.attrs['coord']})")


def pad(node: Node, x: Tensor, y: Tensor, src: str, dst: str, st: Storage = FLOAT32) -> OpLaunch:
    """Constant (``value``), reflect or edge padding of the planes."""
    _, _, h, w = x.shape
    _, _, p, q = y.shape
    pt, _, pl, _ = conv_geometry(node)[2]
    mode = node.attrs.get("mode", "constant")
    body = (f"const int j = e % {q}, i = (e / {q}) % {p}, nc = e / {p * q};\n"
            f"int yy = i - {pt}, xx = j - {pl};\n")
    if mode == "constant":
        value = f"{float(node.attrs.get('value', 0.0))!r}f"
        load = st.load("x", f"nc * {h * w} + yy * {w} + xx")
        body += (f"const bool inside = yy >= 0 && yy < {h} && xx >= 0 && xx < {w};\n"
                 f"{st.store('y', 'e', f'inside ? {load} : {value}')};")
    else:
        if mode == "reflect":
            body += (f"yy = yy < 0 ? -yy : yy >= {h} ? {2 * h - 2} - yy : yy;\n"
                     f"xx = xx < 0 ? -xx : xx >= {w} ? {2 * w - 2} - xx : xx;\n")
        else:
            body += f"yy = min(max(yy, 0), {h - 1});\nxx = min(max(xx, 0), {w - 1});\n"
        body += f"{st.store('y', 'e', st.load('x', f'nc * {h * w} + yy * {w} + xx'))};"
    return _elementwise(kernel_name(node), y.size, (st.buf("x"), _out(st)), (src, dst), body,
                        f"{node.name}: pad {mode} {conv_geometry(node)[2]}")
