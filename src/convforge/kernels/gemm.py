"""Convolution as GEMM: im2col + our SGEMM, im2col + cuBLAS, implicit GEMM (plain and with a
precomputed (c, r, s) offset table, like cuDNN's PRECOMP variant) and the 1x1 path (Boda's k1conv,
with split-K for small N*P*Q and large C).

Orientation everywhere: M = K (output channels), N = N*P*Q (images x output pixels), reduction
= C*R*S in (c, r, s) order. A is the filter tensor read as a K x CRS row-major matrix; B is the
(real or virtual) im2col matrix CRS x NPQ; C is stored straight into the NCHW output with the
epilogue applied. The SGEMM body comes from :mod:`convforge.kernels.sgemm`.
"""

from __future__ import annotations

import dataclasses

from convforge.codegen.dialect import FLOAT32, Arg, Buf, Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs, pro_args, pro_channel
from convforge.kernels.sgemm import (
    GemmShape,
    Operand,
    Store,
    gemm_block,
    gemm_default,
    gemm_grid,
    gemm_kernel,
    gemm_space,
)
from convforge.params import Params
from convforge.plan import (
    INT32_MAX,
    DeviceInfo,
    Epilogue,
    Gemm,
    Launch,
    Plan,
    Prologue,
    Step,
    Variant,
    index_refusal,
)
from convforge.spec import ConvSpec

_INT_LIMIT = INT32_MAX
_ELT_BLOCK = 256  # threads per block of the element-wise kernels (transforms, reductions)


# -- shared metacode ------------------------------------------------------------------------
def filter_operand(spec: ConvSpec, name: str | None = None, ld: int | None = None,
                   storage: Storage | None = None) -> Operand:
    """A = filters as a K x CRS row-major matrix (row stride ``ld``), float4 loads along CRS
    when rows are 16-byte aligned (8-byte half4 loads for half storage). A grouped layer's GEMM
    ``bz`` reads its group's K/G rows of C/G*R*S (``wg``, set by :func:`group_prelude`).
    ``storage``: how ``name`` is stored (default: the spec's dtype, as the filters are)."""
    name = name or ("wg" if spec.groups > 1 else "w")
    ld = ld or spec.cg * spec.r * spec.s
    st = storage or Storage(spec.dtype)
    vload = None
    if ld % 4 == 0:
        def vload(t: str, k: str, d: str) -> list[str]:
            return [f"{d} = {st.vload4('0', f'{name} + {t}_i * {ld} + {k}')};"]
    return Operand(load=lambda t, k, d: [f"{d} = {st.load(name, f'{t}_i * {ld} + {k}')};"],
                   fast="k", vload=vload)


def nchw_store(spec: ConvSpec, epi: Epilogue, out: str = "y", raw: bool = False) -> Store:
    """C (K x NPQ) into an N x K x P x Q tensor stored as the spec's dtype; ``raw`` skips the
    epilogue (float32 partial sums into a workspace). A grouped layer's GEMM ``bz`` writes channels
    bz*K/G ... (its rows m are channels within the group)."""
    st = FLOAT32 if raw else Storage(spec.dtype)
    pq = spec.p * spec.q
    kpq = (epi.k_total if epi.k_total and not raw else spec.k) * pq  # a channel-offset write: the whole tensor
    base = f" + {epi.k_offset * pq}" if epi.k_offset and not raw else ""
    if spec.groups > 1:
        base += f" + bz * {spec.kg * pq}"
    chan = (lambda m: f"(bz * {spec.kg} + {m})") if spec.groups > 1 else (lambda m: f"({m})")

    def setup(i: str, t: str) -> list[str]:
        return [f"const int {t}_n = {i} / {pq};",
                f"const int {t}_o = {t}_n * {kpq} + ({i} - {t}_n * {pq}){base};"]

    def put(m: str, t: str, v: str) -> list[str]:
        val = v if raw else epi.apply(v, chan(m), f"{t}_o + ({m}) * {pq}", offset_done=True, storage=st)
        return [f"{st.store(out, f'{t}_o + ({m}) * {pq}', val)};"]

    def vput(m: str, t: str, vs: list[str]) -> list[str]:
        vals = ", ".join(v if raw else epi.apply(v, chan(m), f"{t}_o + ({m}) * {pq} + {j}", offset_done=True,
                                                 storage=st)
                         for j, v in enumerate(vs))
        return [f"{st.vstore4(f'MAKE_FLOAT4({vals})', '0', f'{out} + {t}_o + ({m}) * {pq}')};"]

    # 4 consecutive columns (from a multiple of 4) stay in one image and 16-byte aligned
    # when P*Q is a multiple of 4.
    return Store(put=put, setup=setup, vput=vput if pq % 4 == 0 else None)


def too_big(spec: ConvSpec, extra: int = 0, what: str = "workspace") -> str | None:
    """"needs 64-bit indexing: ..." when the input, the output or ``extra`` elements of a
    workspace (``what``) pass what these kernels' 32-bit offsets address (``Variant.applies``
    checks the filter too)."""
    arrays = {"input": spec.n * spec.c * spec.h * spec.w, "output": spec.n * spec.k * spec.p * spec.q}
    if extra:
        arrays[what] = extra
    return index_refusal(arrays, _INT_LIMIT)


def elementwise(name: str, total: int, args: tuple[Arg, ...], body: list[str],
                comment: str) -> tuple[Kernel, tuple[int, int, int]]:
    """A 1-D kernel where thread ``e`` < ``total`` runs ``body``; returns it and its grid."""
    code = Code()
    code(f"const int e = GROUP_ID(0) * {_ELT_BLOCK} + LOCAL_ID(0);")
    with code.block(f"if (e < {total})"):
        code(*body)
    return (Kernel(name, args, code.text(), (_ELT_BLOCK, 1, 1), comment=comment),
            (cdiv(total, _ELT_BLOCK), 1, 1))


def group_prelude(spec: ConvSpec) -> tuple[str, ...]:
    """Pointers of a grouped layer's GEMM ``bz`` (one per group, in one launch): its filters ``wg``
    and the first of its input channels ``xg``."""
    if spec.groups == 1:
        return ()
    el = Storage(spec.dtype).elem
    return (f"const GLOBAL_PTR {el}* wg = w + bz * {spec.kg * spec.cg * spec.r * spec.s};  // group bz",
            f"const GLOBAL_PTR {el}* xg = x + bz * {spec.cg * spec.h * spec.w};")


def gemm_plan(variant: Variant, spec: ConvSpec, params: Params, epi: Epilogue, b: Operand,
              extra_args: tuple[Arg, ...], extra_refs: tuple[str, ...],
              pre: tuple[tuple[Kernel, Step], ...] = (), workspace: tuple[tuple[str, int], ...] = (),
              a: Operand | None = None, a_ref: str = "w", pro: Prologue = Prologue()) -> Plan:
    """Plan of [pre-kernels] + one SGEMM writing the NCHW output (in the spec's dtype; the default
    A, the filters ``a_ref``, in it too); a grouped layer's G GEMMs (K/G x NPQ x C/G*R*S each) run
    batched in the same launch. ``pro``: the prologue the B operand (or a pre-kernel) applies; the
    SGEMM takes its buffers when ``b`` reads x."""
    shape = GemmShape(spec.kg, spec.n * spec.p * spec.q, spec.cg * spec.r * spec.s, batch=spec.groups)
    name = f"{variant.name}_sgemm"
    st = Storage(spec.dtype)
    in_gemm = "x" in extra_refs
    args = ((st.buf(a_ref) if a is None else Buf(a_ref),) + extra_args + out_args(epi, st)
            + (pro_args(pro) if in_gemm else ()))
    kern = gemm_kernel(name, shape, params, a or filter_operand(spec), b, nchw_store(spec, epi),
                       args, group_prelude(spec), comment=f"{variant.name}: {params.short()}")
    launch = Launch(name, gemm_grid(shape, params), gemm_block(params),
                    (a_ref,) + extra_refs + out_refs(epi) + (pro.buffers() if in_gemm else ()))
    return Plan(variant.name, variant.family, spec, params,
                tuple(k for k, _ in pre) + (kern,), tuple(s for _, s in pre) + (launch,),
                workspace, variant.tolerance, epi, prologue=pro)


class _ConvGemmBase(Variant):
    """Space and default from the SGEMM generator, for M = K, N = NPQ, K = CRS."""

    offset_ok = True  # and Epilogue.k_total / k_offset
    residual_ok = True  # its store paths honour Epilogue.residual

    tolerance = 1e-5
    exact = True
    # half storage: x, w, y (bias, res) float16 or bfloat16, FP32 accumulation; workspaces float32
    dtypes = frozenset({"float32", "float16", "bfloat16"})

    def _b_vec(self, spec: ConvSpec) -> bool:
        return False

    def _a_vec(self, spec: ConvSpec) -> bool:
        return (spec.cg * spec.r * spec.s) % 4 == 0

    def _mnk(self, spec: ConvSpec) -> tuple[int, int, int]:
        return spec.kg, spec.n * spec.p * spec.q, spec.cg * spec.r * spec.s

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        return super().applies(spec, device) or too_big(spec)

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Below the direct family for groups of fewer than 16 output channels (ResNeXt's 4-8):
        a GEMM tile's rows (32 at least) would then be mostly idle."""
        return 1 if spec.groups > 1 and spec.kg < 16 else self.specialised

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return gemm_space(*self._mnk(spec), device, self._a_vec(spec), self._b_vec(spec))

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return gemm_default(*self._mnk(spec), device, self._a_vec(spec), self._b_vec(spec),
                            prefer=self._prefer(spec))

    def _prefer(self, spec: ConvSpec) -> tuple[tuple[int, int, int, int, int], ...]:
        return ()


def implicit_prefer(spec: ConvSpec) -> tuple[tuple[int, int, int, int, int], ...]:
    """Tiles measured best for unpadded layers (docs/NOTES-gemm.md): 128x64x16 above 128x128x8,
    and 96x128x24 when K is a multiple of 96 (no idle rows). Padded layers keep
    per-column bounds state, which pushes these tiles past 128 registers: no preference."""
    if any(spec.pad) or spec.kg < 64 or spec.n * spec.p * spec.q < 64:
        return ()
    if spec.kg % 96 == 0 and spec.kg % 128 and spec.kg <= 192:
        return ((96, 128, 24, 8, 8),)
    return ((128, 64, 16, 8, 8),)


# -- im2col ---------------------------------------------------------------------------------
def im2col_kernel(spec: ConvSpec, per_image: bool, pro: Prologue = Prologue()) -> tuple[Kernel, tuple[int, int, int]]:
    """Write the CRS x NPQ matrix (``per_image``: N blocks of CRS x PQ) into ``col``, each in-bounds
    input activated by ``pro``.

    Thread (crs = GROUP_ID(1), npq) writes one element; writes are coalesced along npq.
    """
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    pt, pl = spec.pad[0], spec.pad[2]
    pq, npq, rs, hw = spec.p * spec.q, spec.n * spec.p * spec.q, spec.r * spec.s, spec.h * spec.w
    crs = spec.c * rs
    st = Storage(spec.dtype)
    code = Code()
    code("const int crs = GROUP_ID(1);",
         f"const int c = crs / {rs}, r = (crs % {rs}) / {spec.s}, s = crs % {spec.s};",
         f"const int i = GROUP_ID(0) * {_ELT_BLOCK} + LOCAL_ID(0);")
    with code.block(f"if (i < {npq})"):
        code(f"const int n = i / {pq}, pix = i % {pq};",
             f"const int iy = (pix / {spec.q}) * {sh} + r * {dh} - {pt};",
             f"const int ix = (pix % {spec.q}) * {sw} + s * {dw} - {pl};",
             f"const float v = ((unsigned)iy < {spec.h}u && (unsigned)ix < {spec.w}u)"
             f" ? {pro.apply(st.load('x', f'n * {spec.c * hw} + c * {hw} + iy * {spec.w} + ix'), 'c')} : 0.0f;")
        dst = f"n * {crs * pq} + crs * {pq} + pix" if per_image else f"crs * {npq} + i"
        code(f"col[{dst}] = v;")
    kern = Kernel("im2col", (st.buf("x"), Buf("col", readonly=False)) + pro_args(pro), code.text(),
                  (_ELT_BLOCK, 1, 1), comment="im2col: " + ("N x CRS x PQ" if per_image else
                                                            "CRS x NPQ"))
    return kern, (cdiv(npq, _ELT_BLOCK), crs, 1)


def col_elements(spec: ConvSpec) -> int:
    return spec.c * spec.r * spec.s * spec.n * spec.p * spec.q


class Im2colGemm(_ConvGemmBase):
    """im2col on the device into a workspace, then our tiled SGEMM."""

    name = "im2col_gemm"
    specialised = 3
    family = "im2col"

    def _b_vec(self, spec: ConvSpec) -> bool:
        return (spec.n * spec.p * spec.q) % 4 == 0

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        return (super().applies(spec, device) or too_big(spec, col_elements(spec), "im2col workspace")
                or (None if spec.c * spec.r * spec.s <= 65535 else "C*R*S above 65535"))

    prologue_ok = True  # the im2col kernel activates what it copies

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 4 * col_elements(spec)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        npq = spec.n * spec.p * spec.q
        pre, grid = im2col_kernel(spec, per_image=False, pro=prologue)

        def vload(t: str, k: str, d: str) -> list[str]:
            return [f"{d} = VLOAD4(0, col + ({k}) * {npq} + {t}_i);"]

        b = Operand(load=lambda t, k, d: [f"{d} = col[({k}) * {npq} + {t}_i];"], fast="i",
                    vload=vload if npq % 4 == 0 else None)
        step = Launch("im2col", grid, pre.block, ("x", "col") + prologue.buffers())
        return gemm_plan(self, spec, params, epilogue, b, (Buf("col"),), ("col",), ((pre, step),),
                         (("col", self.workspace_bytes(spec, params)),), pro=prologue)


class Im2colCublas(Variant):
    """im2col on the device (N x CRS x PQ), then one strided-batched cuBLAS SGEMM per call:
    the library path the im2win paper compares against. CUDA only."""

    residual_ok = True  # its store paths honour Epilogue.residual

    name = "im2col_cublas"
    specialised = 2
    capturable = False  # CuPy refuses cuBLAS calls under stream capture: never an 'auto' choice
    family = "im2col"
    backends = frozenset({"cuda"})
    tolerance = 1e-5
    exact = True

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        return (super().applies(spec, device) or too_big(spec, col_elements(spec), "im2col workspace")
                or (None if spec.c * spec.r * spec.s <= 65535 else "C*R*S above 65535"))

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        return [Params(library="cublas")]

    prologue_ok = True  # the im2col kernel activates what it copies

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 4 * col_elements(spec)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        if epilogue.k_total:
            raise ValueError("unsupported epilogue: the library GEMM cannot write at a channel offset")
        pq, crs = spec.p * spec.q, spec.c * spec.r * spec.s
        kern, grid = im2col_kernel(spec, per_image=True, pro=prologue)
        steps: list[Step] = [Launch("im2col", grid, kern.block, ("x", "col") + prologue.buffers()),
                             Gemm("w", "col", "y", spec.k, pq, crs, lda=crs, ldb=pq, ldc=pq,
                                  batch=spec.n, stride_a=0, stride_b=crs * pq,
                                  stride_c=spec.k * pq)]
        kernels = [kern]
        if epilogue.bias or epilogue.act or epilogue.residual:
            total = spec.n * spec.k * pq
            body = [f"y[e] = {epilogue.apply('y[e]', f'(e / {pq}) % {spec.k}', 'e')};"]
            args = out_args(epilogue)
            epk, egrid = elementwise("im2col_cublas_epilogue", total, args, body,
                                     "bias/ReLU after the library GEMM")
            kernels.append(epk)
            steps.append(Launch(epk.name, egrid, epk.block, out_refs(epilogue)))
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps),
                    (("col", self.workspace_bytes(spec, params)),), self.tolerance, epilogue, prologue=prologue)


# -- implicit GEMM --------------------------------------------------------------------------
def implicit_operand(spec: ConvSpec, table: bool, pro: Prologue = Prologue()) -> Operand:
    """B = the virtual im2col matrix, each element computed from x on the fly.

    Per column (hoisted): image, output row/col -> the input corner. Per k row (shared by the
    columns a thread loads): (c, r, s) by constant division into an offset (``table`` False) or
    from the precomputed table ``tab`` (offset, packed dy/dx). Without padding every (r, s) of a
    valid output lands inside the image, so the bounds test disappears. ``pro``: the prologue
    applied to every in-bounds value (at its channel).
    """
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    pt, pl = spec.pad[0], spec.pad[2]
    pq, hw, rs = spec.p * spec.q, spec.h * spec.w, spec.r * spec.s
    padded = any(spec.pad)
    st = Storage(spec.dtype)
    x = "xg" if spec.groups > 1 else "x"  # a grouped GEMM reads its group's channels (group_prelude)

    def act(value: str, c: str) -> str:
        return pro.apply(value, pro_channel(spec, c))

    def setup(i: str, t: str) -> list[str]:
        return [f"const int {t}_n = {i} / {pq}, {t}_pix = {i} - {t}_n * {pq};",
                f"const int {t}_y = ({t}_pix / {spec.q}) * {sh} - {pt};",
                f"const int {t}_x = ({t}_pix % {spec.q}) * {sw} - {pl};",
                f"const int {t}_b = {t}_n * {spec.c * hw} + {t}_y * {spec.w} + {t}_x;"]

    def load_div(t: str, k: str, d: str) -> list[str]:
        return [f"const int c = ({k}) / {rs}, rr = ({k}) - c * {rs};",
                f"const int r = rr / {spec.s}, s = rr - r * {spec.s};",
                f"const int iy = {t}_y + r * {dh}, ix = {t}_x + s * {dw};",
                f"if ((unsigned)iy < {spec.h}u && (unsigned)ix < {spec.w}u) "
                f"{d} = {act(st.load(x, f'{t}_b + c * {hw} + r * {dh * spec.w} + s * {dw}'), 'c')};"]

    def load_tab(t: str, k: str, d: str) -> list[str]:
        chan = [f"const int c = ({k}) / {rs};"] if pro.affine else []
        return chan + [f"const int off = tab[2 * ({k})], dyx = tab[2 * ({k}) + 1];",
                       f"const int iy = {t}_y + (dyx >> 16), ix = {t}_x + (dyx & 0xffff);",
                       f"if ((unsigned)iy < {spec.h}u && (unsigned)ix < {spec.w}u) "
                       f"{d} = {act(st.load(x, f'{t}_b + off'), 'c')};"]

    def kprep_div(kt: str, k: str) -> list[str]:
        lines = [f"const int {kt}_c = ({k}) / {rs}, {kt}_rs = ({k}) - {kt}_c * {rs};",
                 f"const int {kt}_r = {kt}_rs / {spec.s}, {kt}_s = {kt}_rs - {kt}_r * {spec.s};",
                 f"const int {kt}_off = {kt}_c * {hw} + {kt}_r * {dh * spec.w} + {kt}_s * {dw};"]
        if padded:
            lines.append(f"const int {kt}_dy = {kt}_r * {dh}, {kt}_dx = {kt}_s * {dw};")
        return lines

    def kprep_tab(kt: str, k: str) -> list[str]:
        lines = [f"const int {kt}_off = tab[2 * ({k})];"]
        if pro.affine:
            lines.append(f"const int {kt}_c = ({k}) / {rs};")
        if padded:
            lines += [f"const int {kt}_dyx = tab[2 * ({k}) + 1];",
                      f"const int {kt}_dy = {kt}_dyx >> 16, {kt}_dx = {kt}_dyx & 0xffff;"]
        return lines

    def kload(t: str, kt: str, d: str) -> list[str]:
        val = act(st.load(x, f"{t}_b + {kt}_off"), f"{kt}_c")
        if not padded:
            return [f"{d} = {val};"]
        return [f"if ((unsigned)({t}_y + {kt}_dy) < {spec.h}u && "
                f"(unsigned)({t}_x + {kt}_dx) < {spec.w}u) {d} = {val};"]

    return Operand(load=load_tab if table else load_div, fast="i", setup=setup,
                   kprep=kprep_tab if table else kprep_div, kload=kload)


def offset_table_kernel(spec: ConvSpec) -> tuple[Kernel, tuple[int, int, int]]:
    """tab[2k] = input offset of reduction index k = (c, r, s); tab[2k+1] = (r*dh << 16) | s*dw
    (c counts a group's channels: the same table serves every group)."""
    rs, hw, (dh, dw) = spec.r * spec.s, spec.h * spec.w, spec.dilation
    body = [f"const int c = e / {rs}, r = (e % {rs}) / {spec.s}, s = e % {spec.s};",
            f"tab[2 * e] = c * {hw} + r * {dh * spec.w} + s * {dw};",
            f"tab[2 * e + 1] = ((r * {dh}) << 16) | (s * {dw});"]
    return elementwise("implicit_offsets", spec.cg * rs, (Buf("tab", "int", readonly=False),),
                       body, "(c, r, s) offset table of the PRECOMP implicit GEMM")


class ImplicitGemm(_ConvGemmBase):
    """No materialised matrix: the B tile is gathered from x with on-the-fly (c, r, s) division."""

    name = "implicit_gemm"
    specialised = 5
    family = "implicit_gemm"
    grouped = True  # one GEMM per group, batched in one launch (gemm_plan)

    prologue_ok = True  # its B loads activate what they read

    def _prefer(self, spec: ConvSpec) -> tuple[tuple[int, int, int, int, int], ...]:
        return implicit_prefer(spec)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        return gemm_plan(self, spec, params, epilogue, implicit_operand(spec, False, prologue),
                         (Storage(spec.dtype).buf("x"),), ("x",), pro=prologue)


class ImplicitGemmPrecomp(_ConvGemmBase):
    """Implicit GEMM reading (c, r, s) offsets from a table built on the device (8 B per CRS)."""

    name = "implicit_gemm_precomp"
    specialised = 4
    family = "implicit_gemm"
    grouped = True

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why is None and (spec.eff_r >= 1 << 15 or spec.eff_s >= 1 << 16):
            why = "filter extent too large for the packed offset table"
        return why

    prologue_ok = True

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 8 * spec.cg * spec.r * spec.s

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        tk, grid = offset_table_kernel(spec)
        step = Launch(tk.name, grid, tk.block, ("tab",))
        return gemm_plan(self, spec, params, epilogue, implicit_operand(spec, True, prologue),
                         (Storage(spec.dtype).buf("x"), Buf("tab", "int")), ("x", "tab"), ((tk, step),),
                         (("tab", self.workspace_bytes(spec, params)),), pro=prologue)


# -- 1x1 ------------------------------------------------------------------------------------
def pointwise_operand(spec: ConvSpec, pro: Prologue = Prologue()) -> Operand:
    """B = x read directly as C x (N*P*Q): column -> (image, input pixel), row = channel.

    Padding and stride are resolved once per column (they do not depend on the channel); with
    stride 1 and no padding, float4 loads along the pixels when H*W is a multiple of 4. ``pro``:
    the prologue applied to every in-bounds value (at its channel, the row).
    """
    (sh, sw), pt, pl = spec.stride, spec.pad[0], spec.pad[2]
    pq, hw = spec.p * spec.q, spec.h * spec.w
    plain = spec.stride == (1, 1) and spec.pad == (0, 0, 0, 0)
    st = Storage(spec.dtype)
    x = "xg" if spec.groups > 1 else "x"  # a grouped GEMM reads its group's channels (group_prelude)

    def setup(i: str, t: str) -> list[str]:
        lines = [f"const int {t}_n = {i} / {pq}, {t}_pix = {i} - {t}_n * {pq};"]
        if plain:
            return lines + [f"const int {t}_b = {t}_n * {spec.c * hw} + {t}_pix;",
                            f"const bool {t}_in = true;"]
        return lines + [f"const int {t}_y = ({t}_pix / {spec.q}) * {sh} - {pt};",
                        f"const int {t}_x = ({t}_pix % {spec.q}) * {sw} - {pl};",
                        f"const bool {t}_in = (unsigned){t}_y < {spec.h}u && "
                        f"(unsigned){t}_x < {spec.w}u;",
                        f"const int {t}_b = {t}_n * {spec.c * hw} + {t}_y * {spec.w} + {t}_x;"]

    def load(t: str, k: str, d: str) -> list[str]:
        chan = pro_channel(spec, f"({k})")
        return [f"if ({t}_in) {d} = {pro.apply(st.load(x, f'{t}_b + ({k}) * {hw}'), chan)};"]

    def vload(t: str, k: str, d: str) -> list[str]:  # stride 1, no padding: four in-bounds values
        return [f"{d} = {st.vload4('0', f'{x} + {t}_b + ({k}) * {hw}')};", *pro.apply4(d, pro_channel(spec, f"({k})"))]

    return Operand(load=load, fast="i", setup=setup,
                   vload=vload if plain and hw % 4 == 0 else None)


def pointwise_prefer(m: int, n: int, units: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """1x1 tiles by GEMM shape (M = K channels, N = N*P*Q pixels). Where 128x128 tiles alone
    fill the GPU: 64x128x16 for K <= 512 (no idle rows at K=64, twice the blocks), 128x128x8
    above; 64x64x16 with 4x4 micro-tiles otherwise, or 32x64x16 where even 64x64 tiles give at most
    2.5 blocks per compute unit and K <= 384 (more blocks fill the GPU; at K=512 the narrow tile
    loses); 64x16 for fully-connected shapes (N*P*Q <= 16), where a wide tile would be mostly idle
    columns (docs/NOTES-gemm.md)."""
    if n <= 16:
        return ((64, 16, 16, 4, 4),)
    if m >= 64 and n >= 64:
        if cdiv(m, 128) * cdiv(n, 128) >= units:
            return ((64, 128, 16, 8, 8),) if m <= 512 else ((128, 128, 8, 8, 8),)
        if 2 * cdiv(m, 64) * cdiv(n, 64) <= 5 * units and m <= 384:
            return ((32, 64, 16, 4, 4),)
        return ((64, 64, 16, 4, 4),)
    return ((32, 32, 8, 4, 4),)


class Gemm1x1(_ConvGemmBase):
    """Boda's k1conv: a 1x1 convolution (any stride/padding) as a GEMM over channels, no transform."""

    name = "gemm1x1"
    family = "gemm1x1"
    specialised = 10
    grouped = True

    def _b_vec(self, spec: ConvSpec) -> bool:
        return (spec.stride == (1, 1) and spec.pad == (0, 0, 0, 0)
                and (spec.h * spec.w) % 4 == 0)

    def _a_vec(self, spec: ConvSpec) -> bool:
        return spec.cg % 4 == 0

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.r != 1 or spec.s != 1:
            return "only 1x1 filters"
        return super().applies(spec, device)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        m, n, k = self._mnk(spec)
        return gemm_default(m, n, k, device, self._a_vec(spec), self._b_vec(spec),
                            prefer=pointwise_prefer(m, n, device.units))

    prologue_ok = True  # its B loads activate what they read

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        return gemm_plan(self, spec, params, epilogue, pointwise_operand(spec, prologue),
                         (Storage(spec.dtype).buf("x"),), ("x",), pro=prologue)


THIN_REDUCTION = 4096  # reductions at least this long split K when the plain tiles leave the GPU thin


class _SplitK(_ConvGemmBase):
    """The reduction split over ``ks`` blocks writing partial outputs to a workspace, then summed
    (with the epilogue) by a second kernel: fills the GPU when K and N*P*Q give few output tiles
    and the reduction is long (batch 1-5). Subclasses name their B operand (``_operand``) and the
    un-split tile they cut (``_unsplit``)."""

    red_name = "C*R*S"  # the reduction, as messages name it
    grouped = False  # its reduce pass and tile count assume one GEMM
    prologue_ok = True  # its B operand (``_operand``) activates what it reads

    def _reduction(self, spec: ConvSpec) -> int:
        return spec.c * spec.r * spec.s

    def _operand(self, spec: ConvSpec, pro: Prologue = Prologue()) -> Operand:
        raise NotImplementedError

    def _unsplit(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The tile before splitting: ``pointwise_prefer``'s."""
        m, n, k = self._mnk(spec)
        return gemm_default(m, n, k, device, self._a_vec(spec), self._b_vec(spec),
                            prefer=pointwise_prefer(m, n, device.units))

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        red = self._reduction(spec)
        if why is None and red < 32:
            why = f"split-K needs {self.red_name} >= 32"
        if why is None and not self._splits(spec):
            why = too_big(spec, 2 * spec.n * spec.k * spec.p * spec.q, "split-K partial outputs (2 slices)")
        if why is None and device.is_gpu:
            # the extra reduce pass loses once the plain GEMM has half a block per SM or the
            # reduction is short.
            tiles = self._tiles(spec, device)
            if 2 * tiles >= max(device.units, 1) and not self._thin(spec, device):
                why = f"N*P*Q already gives {tiles} tiles for {device.units} compute units"
            elif red < 256:
                why = f"split-K pays only for {self.red_name} >= 256 on GPUs"
        return why

    def _thin(self, spec: ConvSpec, device: DeviceInfo) -> bool:
        """A long reduction (>= 4096) whose un-split tiles give each compute unit fewer than 256
        threads: fully-connected layers at small batches (VGG-16's fc6 at N=32: 128 blocks of 64
        threads stream 411 MB of weights)."""
        base = self._unsplit(spec, device)
        threads = (base.bm // base.tm) * (base.bn // base.tn)
        return self._reduction(spec) >= THIN_REDUCTION and self._tiles(spec, device) * threads < 256 * device.units

    def _tiles(self, spec: ConvSpec, device: DeviceInfo) -> int:
        base = self._unsplit(spec, device)
        return cdiv(spec.k, base.bm) * cdiv(spec.n * spec.p * spec.q, base.bn)

    def _splits(self, spec: ConvSpec) -> list[int]:
        """Slice counts with 8 or more reduction steps each whose partial outputs 32-bit offsets address."""
        total = spec.n * spec.k * spec.p * spec.q
        return [ks for ks in (2, 4, 8, 16) if cdiv(self._reduction(spec), ks) >= 8 and ks * total <= _INT_LIMIT]

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        out = []
        for ks in self._splits(spec):
            out += [p.replace(ks=ks) for p in super().space(spec, device)]
        default = self.default(spec, device)
        return [default] + [p for p in out if p != default]

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The un-split tile, split into the fewest slices that give every compute unit a block
        (two for fully-connected shapes, which stream weights); more slices than that only add
        traffic. A thin layer (:meth:`_thin`) of N*P*Q > 16 takes 64x32x16 tiles split until the
        GPU holds about 1024 threads per unit: its few tiles alone leave most of it idle."""
        base = self._unsplit(spec, device)
        splits = self._splits(spec)
        m, n, k = self._mnk(spec)
        if device.is_gpu and n > 16 and self._thin(spec, device):  # n <= 16: Boda's batch-5 rule below
            thin = gemm_default(m, n, k, device, self._a_vec(spec), self._b_vec(spec), prefer=((64, 32, 16, 4, 4),))
            threads = cdiv(m, thin.bm) * cdiv(n, thin.bn) * (thin.bm // thin.tm) * (thin.bn // thin.tn)
            return thin.replace(ks=next((s for s in splits if threads * s >= 1024 * device.units), splits[-1]))
        tiles = self._tiles(spec, device)
        units = max(device.units, 1) * (2 if spec.n * spec.p * spec.q <= 16 else 1)
        ks = next((k for k in splits if 4 * tiles * k >= 3 * units), splits[-1])
        return base.replace(ks=ks)

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 4 * params.ks * spec.n * spec.k * spec.p * spec.q

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        total = spec.n * spec.k * spec.p * spec.q
        why = too_big(spec, params.ks * total, f"split-K partial outputs ({params.ks} slices)")
        if why:
            raise ValueError(f"{self.name}: {why}")
        shape = GemmShape(spec.k, spec.n * spec.p * spec.q, self._reduction(spec), ksplit=params.ks)
        gparams = Params({k: v for k, v in params.items() if k != "ks"})
        name = f"{self.name}_sgemm"
        store = nchw_store(spec, epilogue, out=f"(part + kz * {total})", raw=True)
        st = Storage(spec.dtype)
        kern = gemm_kernel(name, shape, gparams, filter_operand(spec), self._operand(spec, prologue),
                           store, (st.buf("w"), st.buf("x"), Buf("part", readonly=False)) + pro_args(prologue),
                           comment=f"{self.name}: {params.short()}")
        sums = " + ".join(f"part[{j * total} + e]" for j in range(params.ks))
        pq = spec.p * spec.q
        kpq = spec.k * pq
        at = "e"
        if epilogue.k_total:  # write at a channel offset of a bigger tensor
            at = f"(e / {kpq}) * {epilogue.k_total * pq} + {epilogue.k_offset * pq} + e % {kpq}"
        val = epilogue.apply(f"({sums})", f"(e / {pq}) % {spec.k}", "e", offset_done=True, storage=st)
        red, rgrid = elementwise(f"{self.name}_reduce", total, (Buf("part"),) + out_args(epilogue, st),
                                 [f"{st.store('y', at, val)};"],
                                 f"sum of {params.ks} split-K partial outputs")
        steps = (Launch(name, gemm_grid(shape, gparams), gemm_block(gparams),
                        ("w", "x", "part") + prologue.buffers()),
                 Launch(red.name, rgrid, red.block, ("part",) + out_refs(epilogue)))
        return Plan(self.name, self.family, spec, params, (kern, red), steps,
                    (("part", self.workspace_bytes(spec, params)),), self.tolerance, epilogue, prologue=prologue)


class Gemm1x1SplitK(_SplitK, Gemm1x1):
    """1x1 with the channel reduction split (GoogLeNet's 7x7x832 layers at batch 5)."""

    name = "gemm1x1_splitk"
    specialised = 11
    red_name = "C"

    def _operand(self, spec: ConvSpec, pro: Prologue = Prologue()) -> Operand:
        return pointwise_operand(spec, pro)


class ImplicitGemmSplitK(_SplitK, ImplicitGemm):
    """Implicit GEMM with the C*R*S reduction split: layers Winograd does not run at batch 1-5
    (stride 2, 5x5, 7x1), whose few output tiles leave most SMs idle (a ResNet-18 stride-2 3x3
    layer at N=1: four 128x128 tiles for a GPU of 132 SMs)."""

    name = "implicit_gemm_splitk"
    specialised = 6

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.r == spec.s == 1:
            return "1x1 filters: gemm1x1_splitk runs them"
        return super().applies(spec, device)

    def _operand(self, spec: ConvSpec, pro: Prologue = Prologue()) -> Operand:
        return implicit_operand(spec, False, pro)


class GemmFullWindow(Variant):
    """A filter that covers the whole unpadded input (a fully-connected layer such as AlexNet's fc6)
    is a 1x1 convolution over C*R*S channels of a 1x1 image, with the very same memory layout of
    x, w and y: run it by the 1x1 path (split-K when that applies) on the rewritten spec."""

    offset_ok = True  # and Epilogue.k_total / k_offset
    residual_ok = True  # its store paths honour Epilogue.residual

    name = "gemm_fc"
    family = "gemm1x1"
    specialised = 12
    exact = True
    dtypes = frozenset({"float32", "float16", "bfloat16"})  # those of the 1x1 path

    def __init__(self) -> None:
        self.plain, self.split = Gemm1x1(), Gemm1x1SplitK()

    @staticmethod
    def pointwise(spec: ConvSpec) -> ConvSpec:
        return ConvSpec(spec.n, spec.c * spec.r * spec.s, 1, 1, spec.k, 1, 1, dtype=spec.dtype)

    def _inner(self, spec: ConvSpec, device: DeviceInfo, params: Params | None = None) -> Variant:
        if params is not None:
            return self.split if "ks" in params else self.plain
        return self.split if self.split.applies(self.pointwise(spec), device) is None else self.plain

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        full = (spec.p == spec.q == 1 and spec.pad == (0, 0, 0, 0) and (spec.r, spec.s) == (spec.h, spec.w)
                and spec.dilation == (1, 1))
        if not full:
            return "the filter does not cover the whole unpadded input"
        if spec.r == spec.s == 1:
            return "already 1x1: gemm1x1 runs it"
        return super().applies(spec, device) or self.plain.applies(self.pointwise(spec), device)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        pw = self.pointwise(spec)
        split = self.split.space(pw, device) if self.split.applies(pw, device) is None else []
        out = [self.default(spec, device)]
        out += [p for p in split + self.plain.space(pw, device) if p not in out]
        return out

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return self._inner(spec, device).default(self.pointwise(spec), device)

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return self._inner(spec, DeviceInfo("", ""), params).workspace_bytes(self.pointwise(spec), params)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        inner = self._inner(spec, device, params).plan(self.pointwise(spec), params, device, epilogue)
        return dataclasses.replace(inner, variant=self.name, spec=spec)


register(Im2colGemm())
register(Im2colCublas())
register(ImplicitGemm())
register(ImplicitGemmPrecomp())
register(Gemm1x1())
register(Gemm1x1SplitK())
register(ImplicitGemmSplitK())
register(GemmFullWindow())
