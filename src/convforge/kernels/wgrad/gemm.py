"""wgrad as a GEMM (CUTLASS's wgrad orientation): dW (K x C*R*S) = dY (K x N*P*Q) . im2col(X)^T,
the reduction over N*P*Q, by the shared SGEMM generator (kernels/sgemm.py).

* ``wgrad_implicit_gemm``: any stride, dilation, padding; B (N*P*Q x C*R*S) is gathered from x on
  the fly (per column: the (c, r, s) offset, hoisted; per element: n, p, q from the reduction index).
* ``wgrad_gemm1x1``: stride-1 unpadded 1x1 layers, dW = sum over n of dY[n] (K x HW) . X[n]^T
  (HW x C): no gather, float4 loads of both operands where HW is a multiple of 4.

Both operands run along the reduction (``fast="k"``): consecutive threads read consecutive pixels
of one image row. Grouped layers are one GEMM per group in the same launch (the batch index).
The reduction is split into ``ks`` slices (parameter ``ks``): each writes its partial dW to a
workspace and a reduce kernel adds them in slice order, so the result is bit-identical from run to
run. ``at=1`` (atomicAdd into a zeroed dW instead of the workspace and reduce) is offered by the
spaces, and planned, only when the user turned ``config.deterministic`` off.
"""

from __future__ import annotations

import dataclasses

from convforge.codegen.dialect import Buf, Kernel
from convforge.codegen.meta import cdiv
from convforge.kernels import register
from convforge.kernels.dgrad import no_epilogue
from convforge.kernels.gemm import too_big
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
from convforge.kernels.wgrad.common import (
    ATOMIC_HELPER,
    INT_LIMIT,
    atomic_mode,
    atomic_points,
    pick_split,
    reduce_kernel,
    slice_len,
    splits,
    sum_error,
    sum_tolerance,
    zero_kernel,
)
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec


def _pixel_operand(buf: str, rows: int, image: int) -> Operand:
    """A per-group operand whose fast index k runs over N x ``rows`` pixels of NCHW data: row i of
    the tile starts at ``i * rows``, element k sits at ``buf[(k / rows) * image + i*rows + k % rows]``
    (``image``: one image's stride); float4 along the pixels when ``rows`` is a multiple of 4 (a
    chunk then stays in one image and is 16-byte aligned)."""

    def setup(i: str, t: str) -> list[str]:
        return [f"const int {t}_o = {i} * {rows};"]

    def at(t: str, k: str) -> str:
        return f"(({k}) / {rows}) * {image} + {t}_o + ({k}) % {rows}"

    def load(t: str, k: str, d: str) -> list[str]:
        return [f"{d} = {buf}[{at(t, k)}];"]

    def vload(t: str, k: str, d: str) -> list[str]:
        return [f"{d} = VLOAD4(0, {buf} + {at(t, k)});"]

    return Operand(load=load, fast="k", setup=setup, vload=vload if rows % 4 == 0 else None)


def dy_operand(spec: ConvSpec) -> Operand:
    """A = dY of group ``bz`` as a kg x N*P*Q matrix: row k, column n*PQ + pq at
    yg[n * K*PQ + k * PQ + pq]; float4 along the pixels when P*Q is a multiple of 4."""
    return _pixel_operand("yg", spec.p * spec.q, spec.k * spec.p * spec.q)


def im2col_t_operand(spec: ConvSpec) -> Operand:
    """B = im2col(x)^T of group ``bz``: row n*PQ + p*Q + q, column c*RS + r*S + s is
    xg[n, c, p*sh + r*dh - pt, q*sw + s*dw - pl] (0 outside the image). The column's (c, r, s)
    offsets are hoisted; unpadded layers need no bounds test."""
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    pt, pl = spec.pad[0], spec.pad[2]
    pq, hw, rs, chw = spec.p * spec.q, spec.h * spec.w, spec.r * spec.s, spec.c * spec.h * spec.w
    padded = any(spec.pad)

    def setup(i: str, t: str) -> list[str]:
        return [f"const int {t}_c = {i} / {rs}, {t}_rs = {i} - {t}_c * {rs};",
                f"const int {t}_dy = ({t}_rs / {spec.s}) * {dh} - {pt};",
                f"const int {t}_dx = ({t}_rs % {spec.s}) * {dw} - {pl};",
                f"const int {t}_b = {t}_c * {hw} + {t}_dy * {spec.w} + {t}_dx;"]

    def load(t: str, k: str, d: str) -> list[str]:
        lines = [f"const int n_ = ({k}) / {pq}, pq_ = ({k}) - n_ * {pq};",
                 f"const int p_ = pq_ / {spec.q}, q_ = pq_ - p_ * {spec.q};",
                 f"const int at_ = n_ * {chw} + {t}_b + p_ * {sh * spec.w} + q_ * {sw};"]
        if not padded:
            return lines + [f"{d} = xg[at_];"]
        return lines + [f"if ((unsigned)(p_ * {sh} + {t}_dy) < {spec.h}u && "
                        f"(unsigned)(q_ * {sw} + {t}_dx) < {spec.w}u) {d} = xg[at_];"]

    return Operand(load=load, fast="k", setup=setup)


def x_operand(spec: ConvSpec) -> Operand:
    """B = X^T of group ``bz`` for a stride-1 unpadded 1x1 layer: row n*HW + pix, column c is
    xg[n * C*HW + c * HW + pix]; float4 along the pixels when H*W is a multiple of 4."""
    return _pixel_operand("xg", spec.h * spec.w, spec.c * spec.h * spec.w)


def dw_store(spec: ConvSpec, mode: str) -> Store:
    """C (kg x cg*R*S of group bz) into dW's rows (K x cg*R*S, row-major): ``mode`` "direct" (ks=1),
    "part" (split kz's own slice of the workspace) or "atomic" (atomicAdd into dW)."""
    ncols = spec.cg * spec.r * spec.s

    def put(m: str, t: str, v: str) -> list[str]:
        if mode == "atomic":
            return [f"cf_atomic_add(wo + ({m}) * {ncols} + {t}_i, {v});"]
        return [f"wo[({m}) * {ncols} + {t}_i] = {v};"]

    def vput(m: str, t: str, vs: list[str]) -> list[str]:
        return [f"VSTORE4(MAKE_FLOAT4({', '.join(vs)}), 0, wo + ({m}) * {ncols} + {t}_i);"]

    return Store(put=put, vput=vput if ncols % 4 == 0 and mode != "atomic" else None)


class _WgradGemm(Variant):
    """The GEMM K x CRS x NPQ per group, split-K over N*P*Q. Subclasses give the B operand."""

    family = "implicit_gemm"
    passes = frozenset({"wgrad"})
    grouped = True
    exact = True
    tolerance = 1e-5

    # -- the problem -----------------------------------------------------------------------
    @staticmethod
    def _mnk(spec: ConvSpec) -> tuple[int, int, int]:
        """(M, N, reduction) of one group's GEMM."""
        return spec.kg, spec.cg * spec.r * spec.s, spec.n * spec.p * spec.q

    def _b(self, spec: ConvSpec) -> Operand:
        raise NotImplementedError

    def _vec(self, spec: ConvSpec) -> tuple[bool, bool]:
        return dy_operand(spec).vload is not None, self._b(spec).vload is not None

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        return super().applies(spec, device) or too_big(spec, spec.k * spec.cg * spec.r * spec.s)

    # -- parameters ------------------------------------------------------------------------
    def _tiles(self, spec: ConvSpec, p: Params) -> int:
        m, n, _ = self._mnk(spec)
        return cdiv(m, p.bm) * cdiv(n, p.bn) * spec.groups

    def _part_bytes(self, spec: ConvSpec) -> int:
        return 4 * spec.k * spec.cg * spec.r * spec.s

    def _tile(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        m, n, red = self._mnk(spec)
        va, vb = self._vec(spec)
        return gemm_default(m, n, red, device, va, vb, "k", "k", prefer=self._prefer(spec, device))

    def _prefer(self, spec: ConvSpec, device: DeviceInfo) -> tuple[tuple[int, int, int, int, int], ...]:
        """128 x 64 x 16 tiles (8 x 8 per thread) where M = K/groups exceeds 64, else 64 x 128 x 8:
        split-K (not smaller tiles) fills the GPU; 128 x 64 beats 128 x 128 there, and 16-deep
        slices beat 8-deep ones (docs/NOTES-wgrad.md)."""
        m, n, _ = self._mnk(spec)
        if not device.is_gpu or n < 64:
            return ()
        return ((128, 64, 16, 8, 8),) if m > 64 else ((64, 128, 8, 8, 8),)

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The tile of :meth:`_tile`, split by :func:`pick_split` (two waves, running sums within
        8192 terms)."""
        p = self._tile(spec, device)
        red = self._mnk(spec)[2]
        ks = pick_split(self._tiles(spec, p), gemm_block(p)[0], red, device, self._part_bytes(spec))
        return p.replace(ks=ks)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """The default, its other splits, then every SGEMM tile at every split (CPUs: the default
        tile only); the atomicAdd twins of split points where the user allows them."""
        first = self.default(spec, device)
        m, n, red = self._mnk(spec)
        ks_all = [ks for ks in splits(red) if ks == 1 or ks * self._part_bytes(spec) <= 1 << 30]
        out = [first] + [first.replace(ks=ks) for ks in ks_all]
        if device.is_gpu:
            va, vb = self._vec(spec)
            for p in gemm_space(m, n, red, device, va, vb, "k", "k"):
                if _lean(p):
                    out += [p.replace(ks=ks) for ks in ks_all]
        out = list(dict.fromkeys(out))
        return out + atomic_points(out[:1]) + atomic_points(out[1:])

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        ks = int(params.get("ks", 1))
        return 0 if ks == 1 or params.get("at", 0) else ks * self._part_bytes(spec)

    def expected_error(self, spec: ConvSpec) -> float:
        """The running sums of the CPU default's split (GPU defaults split at least as finely)."""
        red = self._mnk(spec)[2]
        return sum_error(slice_len(red, pick_split(1, 64, red, DeviceInfo("opencl", "cpu", is_gpu=False))))

    # -- the plan --------------------------------------------------------------------------
    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        no_epilogue(self.name, epilogue)
        m, n, red = self._mnk(spec)
        ks = int(params.get("ks", 1))
        if not 1 <= ks <= red:
            raise ValueError(f"{self.name}: ks ({ks}) must be in 1..{red} (the N*P*Q reduction)")
        atomic = atomic_mode(params, self.name) and ks > 1
        total = spec.k * n
        if ks * total > INT_LIMIT:
            raise ValueError(f"{self.name}: ks ({ks}) x K*C*R*S partial results need 64-bit indexing")
        mode = "atomic" if atomic else "part" if ks > 1 else "direct"
        gp = Params({k: v for k, v in params.items() if k not in ("ks", "at")})
        shape = GemmShape(m, n, red, batch=spec.groups, ksplit=ks)
        out = "part" if mode == "part" else "w"
        prelude = (f"const GLOBAL_PTR float* yg = y + bz * {spec.kg * spec.p * spec.q};  // dY of group bz",
                   f"const GLOBAL_PTR float* xg = x + bz * {spec.cg * spec.h * spec.w};  // x of group bz",
                   f"GLOBAL_PTR float* wo = {out} + "
                   + (f"kz * {total} + " if mode == "part" else "") + f"bz * {m * n};  // its dW rows")
        name = f"{self.name}_sgemm"
        kern = gemm_kernel(name, shape, gp, dy_operand(spec), self._b(spec), dw_store(spec, mode),
                           (Buf("x"), Buf("y"), Buf(out, readonly=False)), prelude,
                           comment=f"{self.name}: {params.short()}")
        if atomic:
            kern = _with_helper(kern, ATOMIC_HELPER)
        launch = Launch(name, gemm_grid(shape, gp), gemm_block(gp), ("x", "y", out))
        kernels, steps = [kern], [launch]
        if mode == "part":
            red_k, grid, block = reduce_kernel(f"{self.name}_reduce", total, ks, "w")
            kernels.append(red_k)
            steps.append(Launch(red_k.name, grid, block, ("part", "w")))
        elif atomic:
            zk, grid = zero_kernel(f"{self.name}_zero", total, "w")
            kernels.insert(0, zk)
            steps.insert(0, Launch(zk.name, grid, zk.block, ("w",)))
        work = (("part", self.workspace_bytes(spec, params)),) if mode == "part" else ()
        tol = sum_tolerance(slice_len(red, ks))
        return Plan(self.name, self.family, spec, params, tuple(kernels), tuple(steps), work,
                    tolerance=tol, epilogue=epilogue)


def _lean(p: Params) -> bool:
    """The SGEMM points worth a long reduction that stay clear of spills: register prefetch on, at
    least 8 x 8 outputs per thread and 64 threads, at most 8 load slots per operand and thread. Every B slot of
    the gathered operand keeps its column's offsets in registers; past 8 slots, or with smaller
    micro-tiles (where ptxas trades a few registers for occupancy), nvcc 13 sm_90 spilled 4-192
    bytes on sampled ResNet and odd layers."""
    threads = (p.bm // p.tm) * (p.bn // p.tn)
    slots = max(p.bm * p.bk // p.va, p.bn * p.bk // p.vb) // threads
    return bool(p.pf) and p.tm * p.tn >= 64 and threads >= 64 and slots <= 8


def _with_helper(kern: Kernel, helper: str) -> Kernel:
    return dataclasses.replace(kern, helpers=helper)


class WgradImplicitGemm(_WgradGemm):
    """Any layer: the im2col matrix gathered on the fly, never materialised."""

    name = "wgrad_implicit_gemm"
    specialised = 5

    def _b(self, spec: ConvSpec) -> Operand:
        return im2col_t_operand(spec)

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """Below wgrad_direct for depthwise-like groups (one or two channels per group: a GEMM
        tile of 1-2 rows is mostly idle)."""
        return 0 if min(spec.kg, spec.cg) <= 2 and spec.groups > 1 else self.specialised


class WgradGemm1x1(_WgradGemm):
    """Stride-1 unpadded 1x1 layers: a batched GEMM over the images, reduced over N*H*W."""

    name = "wgrad_gemm1x1"
    family = "gemm1x1"
    specialised = 10

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if (spec.r, spec.s) != (1, 1) or spec.stride != (1, 1) or any(spec.pad):
            return "only stride-1 unpadded 1x1 filters (wgrad_implicit_gemm runs the others)"
        return super().applies(spec, device)

    def _b(self, spec: ConvSpec) -> Operand:
        return x_operand(spec)


register(WgradImplicitGemm())
register(WgradGemm1x1())
