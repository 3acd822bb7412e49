"""TF32 variants on the staged tensor-core GEMM (:mod:`convforge.kernels.tensorcore.sm80.mma_pipe`), class "relaxed".

* ``gemm1x1_pipe_tf32``: 1x1 convolution; the filters (A, K x C) are written TF32-rounded once per
  weight version by a plan step, the activations (B, contiguous along pixels) copied raw and
  rounded at fragment load.
* ``implicit_gemm_nhwc_tf32``: cuDNN's scheme. A plan step transposes x to NHWC (TF32-rounded), a
  weight step repacks the filters to K x (R S C) (rounded); the GEMM then gathers 16-byte chunks
  of 4 channels, one bounds test per (r, s) and pixel, and stores NCHW through the Store callback
  (bias, ReLU, residual, channel offsets).

* ``winograd_nonfused_f2_pipe_tf32``: non-fused F(2x2) with rounded U and V and the staged GEMM.

Faster than the register-staged TF32 variants of the same families on every layer timed
(docs/NOTES-tensorcore.md).

Accuracy as the other TF32 variants (:mod:`convforge.kernels.tensorcore.sm80.mma_variants`): both operands rounded
to nearest, FP32 accumulation: stated 3e-4, checked against 1e-3. CUDA only, sm_80+.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

from convforge.codegen.dialect import Buf, Dim3, Kernel
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs
from convforge.kernels.gemm import elementwise, nchw_store, too_big
from convforge.kernels.sgemm import GemmShape, Store
from convforge.kernels.tensorcore.sm80.mma_pipe import (
    PIPE_KEYS,
    AsyncOperand,
    Kind,
    pipe_block,
    pipe_default,
    pipe_grid,
    pipe_kernel,
    pipe_space,
)
from convforge.kernels.tensorcore.sm80.mma_variants import (
    TF32_EXPECTED,
    TF32_TOLERANCE,
    WinogradNonFusedTC,
    tensor_core_reason,
)
from convforge.kernels.winograd.nonfused import WinogradNonFused
from convforge.kernels.winograd.tiles import Geometry
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Prologue, Variant
from convforge.spec import ConvSpec


def _copy_kernel(name: str, total: int, src: str, dst: str, body: list[str],
                 comment: str, valid: str = "") -> tuple[Kernel, Launch]:
    """An element-wise step ``dst[e] = tf32(src[si])`` (``body`` defines ``si``, the source index),
    0 where ``valid`` is false (padding channels)."""
    val = f"({valid}) ? CVT_TF32({src}[si]) : 0.0f" if valid else f"CVT_TF32({src}[si])"
    kern, grid = elementwise(name, total, (Buf(src), Buf(dst, readonly=False)),
                             body + [f"{dst}[e] = {val};"], comment)
    kern = Kernel(kern.name, kern.args, kern.body, kern.block, requires=frozenset({"mma_tf32"}),
                  comment=kern.comment)
    return kern, Launch(name, grid, kern.block, (src, dst))


def _nhwc_kernel(spec: ConvSpec, cp: int) -> tuple[Kernel, Launch]:
    """xh (N x HW x cp) = tf32(x (N x C x HW)), channels past C zero: 32 x 32 tiles through shared
    memory (a 33-float row: conflict-free both ways), reads and writes coalesced."""
    c, hw = spec.c, spec.h * spec.w
    code = Code()
    code("SHARED float tile[32 * 33];",
         "const int tx = LOCAL_ID(0), ty = LOCAL_ID(1), n = GROUP_ID(2);",
         "const int p0 = GROUP_ID(0) * 32, c0 = GROUP_ID(1) * 32;")
    for j in range(4):
        code(f"{{ const int ci = c0 + ty + {8 * j}, p = p0 + tx;",
             f"  tile[(ty + {8 * j}) * 33 + tx] = (ci < {c} && p < {hw}) ? x[(n * {c} + ci) * {hw} + p] : 0.0f; }}")
    code("BARRIER();")
    for j in range(4):
        code(f"{{ const int p = p0 + ty + {8 * j}, ci = c0 + tx;",
             f"  if (p < {hw} && ci < {cp}) xh[(n * {hw} + p) * {cp} + ci] = "
             f"CVT_TF32(tile[tx * 33 + ty + {8 * j}]); }}")
    kern = Kernel("x_nhwc_tf32", (Buf("x"), Buf("xh", readonly=False)), code.text(), (32, 8, 1),
                  requires=frozenset({"mma_tf32"}), comment="x transposed NCHW -> NHWC (32 x 32 tiles), TF32-rounded")
    return kern, Launch(kern.name, (cdiv(hw, 32), cdiv(cp, 32), spec.n), kern.block, ("x", "xh"))


class _StagedTF32(Variant):
    """Shared parts: M = K, N = N*P*Q, K = C*R*S; NCHW output with every epilogue."""

    backends = frozenset({"cuda"})
    precision = "relaxed"
    tolerance = TF32_TOLERANCE
    exact = False
    residual_ok = True
    offset_ok = True
    space_lead = 4

    def expected_error(self, spec: ConvSpec) -> float:
        return TF32_EXPECTED

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        return super().applies(spec, device) or tensor_core_reason(device) or too_big(spec)

    def _mnk(self, spec: ConvSpec) -> tuple[int, int, int]:
        return spec.k, spec.n * spec.p * spec.q, self._cp(spec) * spec.r * spec.s

    def _cp(self, spec: ConvSpec) -> int:
        """Channels as the GEMM sees them."""
        return spec.c

    def _kinds(self, spec: ConvSpec) -> tuple[Kind, Kind]:
        a, b = self._operands(spec)
        return a.kind, b.kind

    def _operands(self, spec: ConvSpec) -> tuple[AsyncOperand, AsyncOperand]:
        raise NotImplementedError

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        m, n, _ = self._mnk(spec)
        return pipe_space(m, n, device, *self._kinds(spec))

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        m, n, _ = self._mnk(spec)
        return pipe_default(m, n, device, *self._kinds(spec))

    def _pre(self, spec: ConvSpec) -> tuple[list[tuple[Kernel, Launch]], tuple[tuple[str, int], ...]]:
        raise NotImplementedError

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        unknown = set(params) - {"bm", "bn", "bk", "wm", "wn", "st"}
        if unknown:
            raise ValueError(f"{self.name}: unknown parameters {sorted(unknown)}")
        shape = GemmShape(*self._mnk(spec))
        a, b = self._operands(spec)
        pre, ws = self._pre(spec)
        name = f"{self.name}_gemm"
        kern = pipe_kernel(name, shape, params, a, b, nchw_store(spec, epilogue),
                           (Buf("wt"), Buf(self._b_buf)) + out_args(epilogue),
                           comment=f"{self.name}: {params.short()}")
        launch = Launch(name, pipe_grid(shape, params), pipe_block(params),
                        ("wt", self._b_buf) + out_refs(epilogue))
        return Plan(self.name, self.family, spec, params, tuple(k for k, _ in pre) + (kern,),
                    tuple(s for _, s in pre) + (launch,), ws, self.tolerance, epilogue)

    _b_buf = "x"

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return sum(b for _, b in self._pre(spec)[1])


def _filter_operand(spec: ConvSpec, c: int) -> AsyncOperand:
    """A = the packed, rounded filters ``wt`` (K x (c R S) row-major, c channels)."""
    crs = c * spec.r * spec.s
    return AsyncOperand(src=lambda t, k: ([], f"wt + {t}_i * {crs} + {k}", ""), fast="k",
                        vec=4 if crs % 4 == 0 else 1, rounded=True)


class Gemm1x1PipeTF32(_StagedTF32):
    """1x1 convolution (any stride and padding) on the staged tensor-core GEMM."""

    name = "gemm1x1_pipe_tf32"
    family = "gemm1x1"
    specialised = 12

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if spec.r != 1 or spec.s != 1:
            return "only 1x1 filters"
        return super().applies(spec, device)

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Below both wgmma paths on sm_90, which run the same layers in a fraction of its time."""
        return self.specialised - 1 if device.cc == (9, 0) else self.specialised

    def _operands(self, spec: ConvSpec) -> tuple[AsyncOperand, AsyncOperand]:
        (sh, sw), hw, pq = spec.stride, spec.h * spec.w, spec.p * spec.q
        pt, pl = spec.pad[0], spec.pad[2]
        plain = spec.stride == (1, 1) and spec.pad == (0, 0, 0, 0)

        def setup(i: str, t: str) -> list[str]:
            lines = [f"const int {t}_n = {i} / {pq}, {t}_pix = {i} - {t}_n * {pq};"]
            if plain:
                return lines + [f"const int {t}_b = {t}_n * {spec.c * hw} + {t}_pix;"]
            return lines + [f"const int {t}_y = ({t}_pix / {spec.q}) * {sh} - {pt};",
                            f"const int {t}_x = ({t}_pix % {spec.q}) * {sw} - {pl};",
                            f"const bool {t}_ok = (unsigned){t}_y < {spec.h}u && (unsigned){t}_x < {spec.w}u;",
                            f"const int {t}_b = {t}_n * {spec.c * hw} + ({t}_ok ? {t}_y * {spec.w} + {t}_x : 0);"]

        def src(t: str, k: str) -> tuple[list[str], str, str]:
            return [], f"x + {t}_b + ({k}) * {hw}", "" if plain or not any(spec.pad) else f"{t}_ok"

        b = AsyncOperand(src=src, fast="i", setup=setup, vec=4 if plain and hw % 4 == 0 else 1)
        return _filter_operand(spec, spec.c), b

    def _pre(self, spec: ConvSpec) -> tuple[list[tuple[Kernel, Launch]], tuple[tuple[str, int], ...]]:
        n = spec.k * spec.c
        step = _copy_kernel("w_tf32", n, "w", "wt", ["const int si = e;"],
                            "filters rounded to TF32 (once per weight version)")
        return [step], (("wt", 4 * n),)


class ImplicitGemmNhwcTF32(_StagedTF32):
    """Implicit GEMM over an NHWC, TF32-rounded copy of x with K x (R S C) rounded filters; C is
    padded with zero channels to a multiple of 4 so every copy is a 16-byte chunk (C = 3: 4)."""

    name = "implicit_gemm_nhwc_tf32"
    family = "implicit_gemm"
    specialised = 8
    _b_buf = "xh"

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        cp = self._cp(spec)
        return super().applies(spec, device) or self.index_refusal(spec, {
            "NHWC input copy": spec.n * spec.h * spec.w * cp, "packed filter": spec.k * cp * spec.r * spec.s})

    def _operands(self, spec: ConvSpec) -> tuple[AsyncOperand, AsyncOperand]:
        (sh, sw), (dh, dw) = spec.stride, spec.dilation
        pt, pl, c = spec.pad[0], spec.pad[2], self._cp(spec)
        pq, padded = spec.p * spec.q, any(spec.pad)

        def setup(i: str, t: str) -> list[str]:
            return [f"const int {t}_n = {i} / {pq}, {t}_pix = {i} - {t}_n * {pq};",
                    f"const int {t}_y = ({t}_pix / {spec.q}) * {sh} - {pt};",
                    f"const int {t}_x = ({t}_pix % {spec.q}) * {sw} - {pl};",
                    f"const int {t}_b = {t}_n * {spec.h * spec.w * c};"]

        def src(t: str, k: str) -> tuple[list[str], str, str]:
            kt = f"{t}k"
            lines = [f"const int {kt}_rs = ({k}) / {c}, {kt}_c = ({k}) - {kt}_rs * {c};",
                     f"const int {kt}_r = {kt}_rs / {spec.s}, {kt}_s = {kt}_rs - {kt}_r * {spec.s};",
                     f"const int {kt}_y = {t}_y + {kt}_r * {dh}, {kt}_x = {t}_x + {kt}_s * {dw};"]
            ok = f"(unsigned){kt}_y < {spec.h}u && (unsigned){kt}_x < {spec.w}u" if padded else ""
            return lines, f"xh + {t}_b + ({kt}_y * {spec.w} + {kt}_x) * {c} + {kt}_c", ok

        b = AsyncOperand(src=src, fast="k", setup=setup, vec=4, rounded=True)
        return _filter_operand(spec, c), b

    def _cp(self, spec: ConvSpec) -> int:
        return -(-spec.c // 4) * 4

    def _pre(self, spec: ConvSpec) -> tuple[list[tuple[Kernel, Launch]], tuple[tuple[str, int], ...]]:
        c, cp, rs, hw = spec.c, self._cp(spec), spec.r * spec.s, spec.h * spec.w
        nw, nx = spec.k * cp * rs, spec.n * cp * hw
        pad = f"ci < {c}" if cp != c else ""
        wstep = _copy_kernel("w_krsc_tf32", nw, "w", "wt",
                             [f"const int kk = e / {cp * rs}, rem = e - kk * {cp * rs};",
                              f"const int rsi = rem / {cp}, ci = rem - rsi * {cp};",
                              f"const int si = (kk * {c} + ci) * {rs} + rsi;"],
                             "filters repacked K x (R S C), TF32-rounded (once per weight version)", pad)
        xstep = _nhwc_kernel(spec, cp)
        return [wstep, xstep], (("wt", 4 * nw), ("xh", 4 * nx))


# Transform choices of the CUDA-core default the staged variant keeps (no split transforms, no
# half-transformed filters: their kernels do not round U and V).
_WINO_KEEP = ("so", "tb", "ks")


class WinogradF2PipeTF32(WinogradNonFusedTC):
    """Non-fused Winograd F(2x2) whose filter and input transforms write U and V TF32-rounded
    (cvt.rna, as cuDNN rounds operands) and whose alpha^2-batched GEMM is the staged tensor-core
    GEMM with both operands contiguous along i (float4 fragment reads, nothing rounded in the loop)."""

    def __init__(self) -> None:
        super().__init__(2, False, "relaxed", TF32_TOLERANCE)
        self.name = "winograd_nonfused_f2_pipe_tf32"
        self.specialised = 7

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Above F(7x7) (rank 11) for 3x3 layers of at most 10x10 outputs with N >= 16, where it is
        faster; F(7x7) keeps the bigger images."""
        if device.is_gpu and (spec.r, spec.s) == (3, 3) and spec.p * spec.q <= 100 and spec.n >= 16:
            return 12
        return self.specialised

    def _kinds(self, spec: ConvSpec) -> tuple[Kind, Kind]:
        return ("i", 4 if spec.k % 4 == 0 else 1, True), ("i", 4 if Geometry(spec, 2).tiles % 4 == 0 else 1, True)

    def _pipe_tiles(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        g = Geometry(spec, 2)
        return pipe_space(spec.k, g.tiles, device, *self._kinds(spec), batch=g.a2)

    def _keep(self, base: Params, tile: Params, ks: int | None = None) -> Params:
        keep = {k: v for k, v in base.items() if k in _WINO_KEEP}
        if ks is not None:
            keep["ks"] = ks
        if keep.get("ks", 1) == 1:
            keep.pop("ks", None)
        return tile.replace(gemm="tf32", **keep)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        g = Geometry(spec, 2)
        tile = pipe_default(spec.k, g.tiles, device, *self._kinds(spec), batch=g.a2)
        return self._keep(WinogradNonFusedTC.default(self, spec, device), tile)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The default, its channel splits and the other store choice, then every staged tile
        under the default's transform choices at each split."""
        first = self.default(spec, device)
        splits = [k for k in (1, 2, 3, 4) if k == 1 or spec.c // k >= 32]
        out = [first] + [self._keep(first, first, k) for k in splits]
        out.append(first.replace(so=1 - int(first.get("so", 0))))
        for tile, k in itertools.product(self._pipe_tiles(spec, device), splits):
            out.append(self._keep(first, tile, k))
        return list(dict.fromkeys(out))

    def _filter_kernel(self, g: Geometry, tb: int, half: bool = False) -> Kernel:
        return _rounded(super()._filter_kernel(g, tb, half), "u", g.a2)

    def _input_kernel(self, g: Geometry, tb: int) -> Kernel:
        return _rounded(super()._input_kernel(g, tb), "v", g.a2)

    def _gemm_stage(self, g: Geometry, gp: Params, ks: int, hf: bool,
                    lo: bool) -> tuple[Kernel, Dim3, Dim3]:
        s, shape = g.spec, self._shape(g, ks)
        kk, tt, cc = s.k, g.tiles, s.c
        (_, va, _), (_, vb, _) = self._kinds(s)
        a = AsyncOperand(src=lambda t, k: ([], f"ue + ({k}) * {kk} + {t}_i", ""), fast="i", vec=va, rounded=True)
        b = AsyncOperand(src=lambda t, k: ([], f"ve + ({k}) * {tt} + {t}_i", ""), fast="i", vec=vb, rounded=True)
        store = Store(put=lambda m, t, v: [f"me[({m}) * {tt} + {t}_i] = {v};"])
        prelude = (f"const GLOBAL_PTR float* ue = u + bz * {cc * kk};  // U[e]: C x K",
                   f"const GLOBAL_PTR float* ve = v + bz * {cc * tt};  // V[e]: C x T",
                   f"GLOBAL_PTR float* me = mw + (kz * {g.a2} + bz) * {kk * tt};  // M[e] of slice kz: K x T")
        kern = pipe_kernel("wino_batched_tcgemm", shape, gp, a, b, store,
                           (Buf("u"), Buf("v"), Buf("mw", readonly=False)), prelude,
                           comment=f"{self.name}: {g.a2} batched staged TF32 GEMMs {gp.short()}"
                           + (f", channels in {ks} slices" if ks > 1 else ""))
        return kern, pipe_grid(shape, gp), pipe_block(gp)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        if prologue.active:  # its input transform rounds V (_input_kernel): no prologue path there
            raise ValueError(f"unsupported prologue: {self.name} has no input-load prologue")
        unknown = set(params) - set(PIPE_KEYS) - set(_WINO_KEEP) - {"gemm"}
        if unknown:
            raise ValueError(f"{self.name}: unknown parameters {sorted(unknown)}")
        plan = WinogradNonFused.plan(self, spec, params, device, epilogue)
        return dataclasses.replace(plan, tolerance=self.tolerance)


def _rounded(kern: Kernel, arr: str, count: int) -> Kernel:
    """``kern`` with its ``count`` transform stores ``arr[...] = value;`` rounded to TF32."""
    pat = re.compile(rf"^(\s*{arr}\[[^\]]+\] = )({arr}\d+_\d+);$", re.M)
    body, n = pat.subn(r"\1CVT_TF32(\2);", kern.body)
    if n != count:
        raise AssertionError(f"{kern.name}: expected {count} transform stores to round, found {n}")
    return dataclasses.replace(kern, body=body, requires=kern.requires | {"mma_tf32"})


register(Gemm1x1PipeTF32())
register(ImplicitGemmNhwcTF32())
register(WinogradF2PipeTF32())
