"""Direct convolution, after the CUDA_Conv2d study: register-blocked outputs, input tile + halo in
shared memory, filters in constant memory, warp-shuffle reuse of input rows (CUDA), read-only path.

Thread (lx, ly) of a (bq, bp) block computes tp x tq outputs at p = p0 + ly + i*bp, q = q0 + lx + j*bq
(so neighbouring threads touch neighbouring columns) for tk output channels.
"""

from __future__ import annotations

import itertools

from convforge.arrays import ArrayDesc
from convforge.codegen.dialect import Arg, ConstBuf, Kernel, Scalar, Storage, TexBuf
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs, pro_args, pro_channel
from convforge.params import Params
from convforge.plan import INT32_MAX, DeviceInfo, Epilogue, Launch, Plan, Prologue, Variant
from convforge.spec import ConvSpec

_UNROLL_LIMIT = 1024  # fully unroll r and s while R*S*outputs-per-thread stays under this


def _unroll_limit(spec: ConvSpec) -> int:
    """Half storage: half the limit. ptxas hoists the fully unrolled 16-bit loads further and spills
    (11x11/4, tk=4 tp=2 on sm_90: 168 registers and 64 bytes of spills; an r loop: 40, none)."""
    return _UNROLL_LIMIT if spec.dtype == "float32" else _UNROLL_LIMIT // 2
_TEX_LIMIT = 1 << 27  # elements a linear texture object may span
_GRID_YZ = 65535  # CUDA's largest grid in y and z


class DirectBase(Variant):
    """Shared metacode of the three direct variants; subclasses choose how inputs are read."""

    family = "direct"
    residual_ok = True
    offset_ok = True
    tolerance = 1e-5
    exact = True
    # half storage: x, w, y (bias, res) float16 or bfloat16, converted on load, FP32 arithmetic;
    # filters stay in global memory (no constant-memory or texture copy of half data)
    dtypes = frozenset({"float32", "float16", "bfloat16"})
    grouped = True  # a block's tk channels lie in one group; its channel loop runs over that group's
    prologue_ok = True  # every input load is activated (``_act``) where it is in bounds
    index_bits = 64  # offsets switch to 64 bits where an array passes 2^31 - 1 elements (ArrayDesc.index)

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why:
            return why
        (sh, sw), pads = spec.stride, spec.pad
        if max(spec.h + pads[0] + pads[1] + 1024 * sh, spec.w + pads[2] + pads[3] + 1024 * sw) > INT32_MAX:
            return "needs 64-bit coordinates: the padded input plus a block's reach passes 2^31 - 1"
        z = spec.n * spec.groups * cdiv(spec.kg, 16)
        if device.backend == "cuda" and (z > _GRID_YZ or cdiv(spec.p, 32) > _GRID_YZ):
            return f"the grid exceeds CUDA's {_GRID_YZ} blocks in y (P / 32) or z (N * K / 16)"
        return None

    def _fit_grid(self, spec: ConvSpec, device: DeviceInfo, prm: Params) -> Params:
        """``prm`` with tk (then bp * tp) raised until the grid fits CUDA's y and z limits."""
        for tk in (prm.tk, 8, 16):
            for bp, tp in ((prm.bp, prm.tp), (8, 4)):
                out = prm.replace(tk=max(prm.tk, min(tk, 2 * spec.kg)), bp=bp, tp=tp)
                if self._grid_ok(spec, device, out):
                    return out
        return prm

    def wide(self, spec: ConvSpec, epi: Epilogue = Epilogue()) -> bool:
        """Some offset of the plan passes 2^31 - 1: its index arithmetic is 64-bit."""
        xd, yd = self._arrays(spec, Params(), epi)
        return xd.wide or yd.wide or spec.k * spec.cg * spec.r * spec.s > INT32_MAX

    def _grid_ok(self, spec: ConvSpec, device: DeviceInfo, p: Params | dict[str, int]) -> bool:
        """Grid y and z within CUDA's 65535 (OpenCL has no such limit)."""
        return device.backend != "cuda" or (spec.n * spec.groups * cdiv(spec.kg, p["tk"]) <= _GRID_YZ
                                            and cdiv(spec.p, p["bp"] * p["tp"]) <= _GRID_YZ)

    # -- parameters -------------------------------------------------------------------------
    def _grid_points(self, spec: ConvSpec, device: DeviceInfo) -> list[dict[str, int]]:
        pts = []
        for bq, bp, tq, tp, tk in itertools.product((32, 16, 8), (8, 4, 2, 1), (1, 2, 4),
                                                   (1, 2, 4), (1, 2, 4, 8, 16)):
            if bq * bp > device.max_threads or bq * bp < 32 or tq * tp * tk > 64:
                continue
            if bq * tq > 2 * spec.q + 32 or bp * tp > 2 * spec.p + 8 or tk > 2 * spec.kg:
                continue
            if not self._grid_ok(spec, device, dict(bp=bp, tp=tp, tk=tk)):
                continue
            pts.append(dict(bq=bq, bp=bp, tq=tq, tp=tp, tk=tk))
        return pts

    def _wconst_ok(self, spec: ConvSpec, device: DeviceInfo) -> bool:
        if spec.dtype != "float32":
            return False
        nbytes = 4 * spec.k * spec.cg * spec.r * spec.s
        return nbytes <= min(device.const_bytes, 64 * 1024)

    # -- metacode ---------------------------------------------------------------------------
    def _arrays(self, spec: ConvSpec, p: Params, epi: Epilogue = Epilogue()) -> tuple[ArrayDesc, ArrayDesc]:
        """Input and output descriptors; with ``rt`` their strides are run-time arguments. The
        output has ``epi.k_total`` channels when the epilogue writes at a channel offset."""
        rt = bool(p.get("rt", False))
        y_shape = (spec.n, epi.k_total, spec.p, spec.q) if epi.k_total else spec.y_shape
        return (ArrayDesc.of("x", "n:c:y:x", spec.x_shape, runtime=rt),
                ArrayDesc.of("y", "n:k:p:q", y_shape, runtime=rt))

    def _stride_args(self, spec: ConvSpec, p: Params, epi: Epilogue = Epilogue()) -> list[tuple[str, int]]:
        xd, yd = self._arrays(spec, p, epi)
        return xd.stride_args() + yd.stride_args()

    def _args(self, spec: ConvSpec, params: Params, epi: Epilogue, pro: Prologue = Prologue()) -> tuple[Arg, ...]:
        wcount = spec.k * spec.cg * spec.r * spec.s
        st = Storage(spec.dtype)
        warg: Arg = ConstBuf("wc", wcount) if params.wconst else st.buf("w")
        xarg: Arg = TexBuf("x") if params.get("tex", False) else st.buf("x")
        strides = tuple(Scalar(name) for name, _ in self._stride_args(spec, params, epi))
        return (xarg, warg) + out_args(epi, st) + pro_args(pro) + strides

    @staticmethod
    def _act(spec: ConvSpec, pro: Prologue, value: str, c: str) -> str:
        """``value`` (an in-bounds input of the group's channel ``c``) with the prologue applied."""
        return pro.apply(value, pro_channel(spec, c, "g"))

    def _requires(self, params: Params) -> frozenset[str]:
        return frozenset({"texture"}) if params.get("tex", False) else frozenset()

    def _head(self, code: Code, spec: ConvSpec, p: Params) -> None:
        kb = cdiv(spec.kg, p.tk)
        if spec.groups == 1:
            code(f"const int n = GROUP_ID(2) / {kb};",
                 f"const int k0 = (GROUP_ID(2) % {kb}) * {p.tk};")
        else:  # blocks of tk channels within one group g; its channels are g*cg ...
            code(f"const int n = GROUP_ID(2) / {spec.groups * kb}, gk = GROUP_ID(2) % {spec.groups * kb};",
                 f"const int g = gk / {kb}, k0 = g * {spec.kg} + (gk % {kb}) * {p.tk};",
                 f"const int kend = k0 - (gk % {kb}) * {p.tk} + {spec.kg};  // the group's last channel + 1")
        code(f"const int p0 = GROUP_ID(1) * {p.bp * p.tp};",
             f"const int q0 = GROUP_ID(0) * {p.bq * p.tq};",
             "const int ly = LOCAL_ID(1), lx = LOCAL_ID(0);")
        last = f"{spec.k - 1}" if spec.groups == 1 else "kend - 1"
        for kk in range(p.tk):
            code(f"const int kw{kk} = min(k0 + {kk}, {last});  // clamped: loads stay in bounds")
        for kk, i, j in self._outs(p):
            code(f"float acc{kk}_{i}_{j} = 0.0f;")

    @staticmethod
    def _outs(p: Params) -> list[tuple[int, int, int]]:
        return list(itertools.product(range(p.tk), range(p.tp), range(p.tq)))

    def _fmas(self, code: Code, spec: ConvSpec, p: Params, r: str, s: int,
              xval: dict[tuple[int, int], str]) -> None:
        """Load tk weights for (c, r, s) and accumulate them against the tp x tq inputs."""
        wname = "wc" if p.wconst else "w"
        crs = spec.cg * spec.r * spec.s
        st = Storage(spec.dtype)
        with code.block(""):
            wide = "(I64)" if spec.k * crs > INT32_MAX else ""  # filters past 2^31 - 1 elements
            for kk in range(p.tk):
                idx = f"{wide}kw{kk} * {crs} + c * {spec.r * spec.s} + ({r}) * {spec.s} + {s}"
                code(f"const float w{kk} = {st.load(wname, idx)};")
            for kk, i, j in self._outs(p):
                code(f"acc{kk}_{i}_{j} = FMA(w{kk}, {xval[(i, j)]}, acc{kk}_{i}_{j});")

    def _store(self, code: Code, spec: ConvSpec, p: Params, epi: Epilogue) -> None:
        _, yd = self._arrays(spec, p, epi)
        st = Storage(spec.dtype)
        for kk, i, j in self._outs(p):
            k, pp, qq = f"k0 + {kk}", f"p0 + ly + {i * p.bp}", f"q0 + lx + {j * p.bq}"
            cond = f"{k} < {spec.k if spec.groups == 1 else 'kend'} && {pp} < {spec.p} && {qq} < {spec.q}"
            kout = f"{k} + {epi.k_offset}" if epi.k_offset else k
            idx = yd.index(n="n", k=kout, p=pp, q=qq)
            val = epi.apply(f"acc{kk}_{i}_{j}", k, idx, offset_done=True, storage=st)
            code(f"if ({cond}) {st.store('y', idx, val)};")

    def _rs_loops(self, code: Code, spec: ConvSpec, p: Params, body: object) -> None:
        """Emit body(r_expr, s) for every tap, r unrolled when small enough."""
        assert callable(body)
        outs = p.tk * p.tp * p.tq
        if spec.r * spec.s * outs <= _unroll_limit(spec):
            for r in range(spec.r):
                for s in range(spec.s):
                    with code.block(f"/* r={r} s={s} */"):
                        body(str(r), s)
        else:
            with code.block(f"for (int r = 0; r < {spec.r}; ++r)"):
                for s in range(spec.s):
                    with code.block(f"/* s={s} */"):
                        body("r", s)

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue(), prologue: Prologue = Prologue()) -> Plan:
        if spec.dtype != "float32" and (params.get("wconst", False) or params.get("tex", False)):
            raise ValueError(f"{self.name}: wconst and tex (constant-memory filters, texture reads) take "
                             f"float32 only, not {spec.dtype}")
        if params.get("wconst", False) and not self._wconst_ok(spec, device):
            raise ValueError(f"{self.name}: filters ({4 * spec.k * spec.cg * spec.r * spec.s} bytes) do not fit "
                             "in constant memory")
        self._check(params, device)
        wide = self.wide(spec, epilogue)
        if wide and params.get("rt", False) and max(self._arrays(spec, params, epilogue)[0].strides) > INT32_MAX:
            raise ValueError(f"{self.name}: rt passes strides as 32-bit ints; an image of this layer needs more")
        if not self._grid_ok(spec, device, params):
            raise ValueError(f"{self.name}: the grid of tk = {params.tk}, bp * tp = {params.bp * params.tp} "
                             f"exceeds CUDA's {_GRID_YZ} blocks in y or z")
        code = Code()
        self._head(code, spec, params)
        self._main_loop(code, spec, params, prologue)
        self._store(code, spec, params, epilogue)
        name = f"conv_{self.name}"
        block = (params.bq, params.bp, 1)
        kernel = Kernel(name, self._args(spec, params, epilogue, prologue), code.text(), block, self._requires(params),
                        comment=f"{self.name}: {params.short()}")
        grid = (cdiv(spec.q, params.bq * params.tq), cdiv(spec.p, params.bp * params.tp),
                spec.n * spec.groups * cdiv(spec.kg, params.tk))
        strides = tuple(v for _, v in self._stride_args(spec, params, epilogue))
        launch = Launch(name, grid, block, ("x", "w") + out_refs(epilogue) + prologue.buffers() + strides)
        return Plan(self.name, self.family, spec, params, (kernel,), (launch,),
                    tolerance=self.tolerance, epilogue=epilogue, index_bits=64 if wide else 32,
                    prologue=prologue)

    def _main_loop(self, code: Code, spec: ConvSpec, p: Params, pro: Prologue = Prologue()) -> None:
        raise NotImplementedError

    def _check(self, p: Params, device: DeviceInfo) -> None:
        """ValueError naming a parameter the generator cannot take (check_params has kept each
        size >= 1): a block of more threads than the device runs."""
        if p.bq * p.bp > device.max_threads:
            raise ValueError(f"{self.name}: bq * bp ({p.bq} x {p.bp}) threads exceed the device's "
                             f"{device.max_threads}")


class Direct(DirectBase):
    """Inputs read straight from global memory (through the read-only/texture cache when ``ldg``);
    with ``rt`` the input and output strides are run-time kernel arguments."""

    name = "direct"

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        out = [self.default(spec, device)]
        seen = set(out)  # (a list's ``in`` made this space quadratic: 0.3 s on a 3x3 layer)
        wc = [False, True] if self._wconst_ok(spec, device) else [False]
        ldg = [True, False] if device.backend == "cuda" else [False]
        for pt in self._grid_points(spec, device):
            for wconst, use_ldg in itertools.product(wc, ldg):
                prm = Params(pt, wconst=wconst, ldg=use_ldg)
                if prm not in seen:
                    seen.add(prm)
                    out.append(prm)
        # Strides as run-time arguments: one binary serves any strides (a few points suffice).
        base = out[:6]
        # (fewer channels per thread: run-time index arithmetic costs registers)
        if spec.c * spec.h * spec.w <= INT32_MAX and spec.k * spec.p * spec.q <= INT32_MAX:  # 32-bit stride args
            out += [prm.replace(rt=True, tk=min(prm.tk, 4)) for prm in base[:4]]
        if device.backend == "cuda" and spec.n * spec.c * spec.h * spec.w <= _TEX_LIMIT and spec.dtype == "float32":
            out += [prm.replace(tex=True, ldg=False) for prm in base]  # reads through texture objects
        return out

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        if not device.is_gpu:
            return Params(bq=8, bp=4, tq=1, tp=1, tk=1, wconst=False, ldg=False)
        tk = min(8, spec.kg)
        return self._fit_grid(spec, device, Params(bq=32, bp=4, tq=1, tp=2, tk=tk, wconst=False,
                                                   ldg=device.backend == "cuda"))

    def _main_loop(self, code: Code, spec: ConvSpec, p: Params, pro: Prologue = Prologue()) -> None:
        (sh, sw), (dh, dw) = spec.stride, spec.dilation
        pt, pl = spec.pad[0], spec.pad[2]
        xd, _ = self._arrays(spec, p)
        tex = bool(p.get("tex", False))
        st = Storage(spec.dtype)
        at = xd.index(n="n") if spec.groups == 1 else xd.index(n="n", c=f"g * {spec.cg}")  # the group's channels
        if tex:  # integer offsets into the texture instead of pointers
            code(f"const int xn = {at};")
        else:
            code(f"const GLOBAL_PTR {st.elem}* xn = x + {at};")
        with code.block(f"for (int c = 0; c < {spec.cg}; ++c)"):
            code(f"const {'int' if tex else f'GLOBAL_PTR {st.elem}*'} xc = xn + {xd.index(c='c')};")

            def tap(r: str, s: int) -> None:
                xval = {}
                for i in range(p.tp):
                    for j in range(p.tq):
                        iy = f"(p0 + ly + {i * p.bp}) * {sh} + ({r}) * {dh} - {pt}"
                        ix = f"(q0 + lx + {j * p.bq}) * {sw} + {s * dw - pl}"
                        ptr = f"xc + {xd.index(y='iy', x='ix')}"
                        load = f"TEX(x, {ptr})" if tex else st.ldg(ptr) if p.ldg else st.deref(ptr)
                        nm = f"x{i}_{j}"
                        code(f"float {nm};",
                             f"{{ const int iy = {iy}, ix = {ix};",
                             f"  {nm} = ((unsigned)iy < {spec.h}u && (unsigned)ix < {spec.w}u)"
                             f" ? {self._act(spec, pro, load, 'c')} : 0.0f; }}")
                        xval[(i, j)] = nm
                self._fmas(code, spec, p, r, s, xval)

            self._rs_loops(code, spec, p, tap)


class DirectSmem(DirectBase):
    """The block's input tile plus halo staged in shared memory, ``cc`` channels per stage."""

    name = "direct_smem"
    specialised = 2

    def _tile(self, spec: ConvSpec, p: Params) -> tuple[int, int]:
        ih = (p.bp * p.tp - 1) * spec.stride[0] + (spec.r - 1) * spec.dilation[0] + 1
        iw = (p.bq * p.tq - 1) * spec.stride[1] + (spec.s - 1) * spec.dilation[1] + 1
        return ih, iw

    def _fits(self, spec: ConvSpec, p: Params, device: DeviceInfo) -> bool:
        ih, iw = self._tile(spec, p)
        return 4 * p.cc * ih * iw <= min(device.shared_bytes, 48 * 1024)

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        out = [self.default(spec, device)]
        wc = [False, True] if self._wconst_ok(spec, device) else [False]
        for pt in self._grid_points(spec, device):
            for wconst, cc in itertools.product(wc, (1, 2, 4)):
                prm = Params(pt, wconst=wconst, cc=cc)
                if cc <= spec.cg and self._fits(spec, prm, device) and prm not in out:
                    out.append(prm)
        return out

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        prm = Params(bq=32, bp=4, tq=1, tp=2, tk=min(8, spec.kg), wconst=False, cc=1)
        if not device.is_gpu:
            prm = Params(bq=8, bp=4, tq=1, tp=1, tk=1, wconst=False, cc=1)
        if not self._fits(spec, prm, device):
            prm = prm.replace(bq=8, bp=4, tq=1, tp=1)
        return self._fit_grid(spec, device, prm)

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why:
            return why
        smallest = Params(bq=8, bp=4, tq=1, tp=1, tk=1, wconst=False, cc=1)
        if not self._fits(spec, smallest, device):
            return "input tile plus halo does not fit in shared memory"
        return None

    def _main_loop(self, code: Code, spec: ConvSpec, p: Params, pro: Prologue = Prologue()) -> None:
        (sh, sw), (dh, dw) = spec.stride, spec.dilation
        pt, pl = spec.pad[0], spec.pad[2]
        ih, iw = self._tile(spec, p)
        nt = p.bq * p.bp
        tile = p.cc * ih * iw
        st = Storage(spec.dtype)
        xd, _ = self._arrays(spec, p)
        at = xd.index(n="n") if spec.groups == 1 else xd.index(n="n", c=f"g * {spec.cg}")  # the group's channels
        code(f"SHARED float xs[{tile}];  // {p.cc} channel(s) x {ih} x {iw} input tile with halo",
             f"const GLOBAL_PTR {st.elem}* xn = x + {at};",
             f"const int y0 = p0 * {sh} - {pt}, x0 = q0 * {sw} - {pl};",
             f"const int tid = ly * {p.bq} + lx;")
        with code.block(f"for (int cb = 0; cb < {spec.cg}; cb += {p.cc})"):
            with code.block(f"for (int t = tid; t < {tile}; t += {nt})"):
                load = st.load("xn", xd.index(c="cb + ci", y="iy", x="ix"))
                code(f"const int ci = t / {ih * iw}, rem = t % {ih * iw};",
                     f"const int iy = y0 + rem / {iw}, ix = x0 + rem % {iw};",
                     f"xs[t] = (cb + ci < {spec.cg} && (unsigned)iy < {spec.h}u && "
                     f"(unsigned)ix < {spec.w}u) ? {self._act(spec, pro, load, '(cb + ci)')} : 0.0f;")
            code("BARRIER();")
            with code.block(f"for (int ci = 0; ci < {p.cc}; ++ci)"):
                code("const int c = cb + ci;")
                with code.block(f"if (c < {spec.cg})"):
                    def tap(r: str, s: int) -> None:
                        xval = {}
                        for i in range(p.tp):
                            for j in range(p.tq):
                                row = f"(ly + {i * p.bp}) * {sh} + ({r}) * {dh}"
                                col = f"(lx + {j * p.bq}) * {sw} + {s * dw}"
                                xval[(i, j)] = f"xs[ci * {ih * iw} + ({row}) * {iw} + {col}]"
                        self._fmas(code, spec, p, r, s, xval)

                    self._rs_loops(code, spec, p, tap)
            code("BARRIER();")


class DirectShfl(DirectBase):
    """CUDA only: each warp is 32 consecutive output columns; a lane loads two input values per
    row and the neighbours' taps arrive by warp shuffle instead of separate loads."""

    name = "direct_shfl"
    backends = frozenset({"cuda"})
    specialised = 1

    def _requires(self, params: Params) -> frozenset[str]:
        return frozenset({"shuffle"})

    def _check(self, p: Params, device: DeviceInfo) -> None:
        """A block row is one warp of 32 output columns, one column per lane."""
        super()._check(p, device)
        for key, want in (("bq", 32), ("tq", 1)):
            if p[key] != want:
                raise ValueError(f"{self.name}: {key} ({p[key]}) must be {want} (a block row is one warp, "
                                 "one output column per lane)")

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        why = super().applies(spec, device)
        if why:
            return why
        if spec.stride[1] != 1:
            return "warp-shuffle reuse needs horizontal stride 1"
        if (spec.s - 1) * spec.dilation[1] > 31:
            return "filter wider than a warp"
        return None

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        out = [self.default(spec, device)]
        wc = [False, True] if self._wconst_ok(spec, device) else [False]
        for bp, tp, tk, wconst in itertools.product((8, 4, 2, 1), (1, 2, 4), (1, 2, 4, 8, 16), wc):
            prm = Params(bq=32, bp=bp, tq=1, tp=tp, tk=tk, wconst=wconst)
            if (tp * tk <= 64 and bp * tp <= 2 * spec.p + 8 and tk <= 2 * spec.kg and prm not in out
                    and self._grid_ok(spec, device, prm)):
                out.append(prm)
        return out

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        return self._fit_grid(spec, device, Params(bq=32, bp=4, tq=1, tp=2, tk=min(8, spec.kg), wconst=False))

    def _main_loop(self, code: Code, spec: ConvSpec, p: Params, pro: Prologue = Prologue()) -> None:
        (sh, _), (dh, dw) = spec.stride, spec.dilation
        pt, pl = spec.pad[0], spec.pad[2]
        st = Storage(spec.dtype)
        xd, _ = self._arrays(spec, p)
        at = xd.index(n="n") if spec.groups == 1 else xd.index(n="n", c=f"g * {spec.cg}")  # the group's channels
        code(f"const GLOBAL_PTR {st.elem}* xn = x + {at};",
             f"const int xa = q0 + lx - {pl}, xb = xa + 32;")
        with code.block(f"for (int c = 0; c < {spec.cg}; ++c)"):
            code(f"const GLOBAL_PTR {st.elem}* xc = xn + {xd.index(c='c')};")

            def tap_row(r: str) -> None:
                for i in range(p.tp):
                    at_a, at_b = (xd.index(y=f"iy{i}", x=xx) for xx in ("xa", "xb"))
                    code(f"const int iy{i} = (p0 + ly + {i * p.bp}) * {sh} + ({r}) * {dh} - {pt};",
                         f"const bool ok{i} = (unsigned)iy{i} < {spec.h}u;",
                         f"const float a{i} = (ok{i} && (unsigned)xa < {spec.w}u) ? "
                         f"{self._act(spec, pro, st.ldg(f'xc + {at_a}'), 'c')} : 0.0f;",
                         f"const float b{i} = (ok{i} && (unsigned)xb < {spec.w}u) ? "
                         f"{self._act(spec, pro, st.ldg(f'xc + {at_b}'), 'c')} : 0.0f;")
                for s in range(spec.s):
                    off = s * dw
                    xval = {}
                    for i in range(p.tp):
                        if off == 0:
                            xval[(i, 0)] = f"a{i}"
                            continue
                        # Both shuffles run on every lane (a divergent shuffle is undefined).
                        code(f"const float sa{i}_{s} = SHFL(a{i}, (lx + {off}) & 31);",
                             f"const float sb{i}_{s} = SHFL(b{i}, (lx + {off}) & 31);",
                             f"const float s{i}_{s} = (lx + {off} < 32) ? sa{i}_{s} : sb{i}_{s};")
                        xval[(i, 0)] = f"s{i}_{s}"
                    self._fmas(code, spec, p, r, s, xval)

            if spec.r * spec.s * p.tk * p.tp <= _unroll_limit(spec):
                for r in range(spec.r):
                    with code.block(f"/* r={r} */"):
                        tap_row(str(r))
            else:
                with code.block(f"for (int r = 0; r < {spec.r}; ++r)"):
                    tap_row("r")


register(Direct())
register(DirectSmem())
register(DirectShfl())
