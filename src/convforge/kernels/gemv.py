"""Weight streams: fully-connected layers at a small batch (a 1x1 convolution of a 1x1 image, or a
filter that covers the whole unpadded input, as AlexNet's fc6) as a GEMV of a handful of columns.

At N <= 8 such a layer reads its K x C weights once and does N multiply-adds per weight: the time is
the weight read. The GEMM tiles (64-256 columns wide, 16-64 rows of reduction a stage) run almost
empty there and stream the weights at a fraction of the DRAM rate (docs/NOTES-gemm.md).

``gemv_stream``: a block owns ``rw`` output channels (rows of the filter matrix); its ``nt``
threads read those rows side by side, 16 bytes a thread (float4 where C % 4 == 0), ``un`` loads of
each row in flight before the first multiply, so every row is one coalesced sweep and the loads in
flight per SM cover DRAM's latency. Each thread keeps ``rw`` x N running sums; the N input columns
(N * C elements, read by every block) come through L1 / L2. The block then adds its threads' sums in
a fixed order (shared memory, two stages of 32 and ``nt`` / 32 terms) and one thread a sum writes
it through the epilogue: deterministic, one launch, no workspace.
"""

from __future__ import annotations

from convforge.codegen.dialect import Kernel, Storage
from convforge.codegen.meta import Code, cdiv
from convforge.kernels import register
from convforge.kernels.common import out_args, out_refs
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Launch, Plan, Variant
from convforge.spec import ConvSpec

STREAM_COLUMNS = 16  # the most columns (N) a block keeps sums for
HALF_COLUMNS = 8  # half storage: first up to this many columns (its loads convert every x element once a row block)
_SUMS = 32  # rw * N: running sums per thread, and the threads of the reduction's second stage
_THREADS = (256, 128, 64)


def full_window(spec: ConvSpec) -> bool:
    """A fully-connected layer: one output pixel whose filter covers the whole unpadded input (a 1x1
    filter on a 1x1 image among them), so x is N rows of C*R*S and w is K rows of C*R*S."""
    return (spec.p == spec.q == 1 and spec.pad == (0, 0, 0, 0) and (spec.r, spec.s) == (spec.h, spec.w)
            and spec.dilation == (1, 1))


class GemvStream(Variant):
    """A fully-connected layer of at most :data:`STREAM_COLUMNS` images as a weight stream (module
    docstring); first on GPUs wherever it applies."""

    name = "gemv_stream"
    family = "gemm1x1"
    exact = True
    specialised = 14  # on GPUs (rank): above gemm_fc / gemm1x1_splitk and the tensor cores
    residual_ok = True
    offset_ok = True
    dtypes = frozenset({"float32", "float16", "bfloat16"})
    layouts = frozenset({"nchw", "nhwc"})  # the same memory on a 1x1 image

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        if not full_window(spec):
            return "not fully connected: the filter does not cover the whole unpadded input"
        if spec.layout == "nhwc" and spec.h * spec.w > 1:
            return "an NHWC input of more than one pixel is not laid out as the filter's rows"
        if spec.n > STREAM_COLUMNS:
            return f"N ({spec.n}) > {STREAM_COLUMNS}: a GEMM tile reuses the weights better"
        return super().applies(spec, device)

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """First on GPUs (half storage: up to :data:`HALF_COLUMNS` images); last on CPUs and wider
        half layers, where the tuner may still time it. On GPUs it streams the weights near the copy
        bandwidth, ahead of the GEMMs on float32 layers of up to 16 images; half layers gain less as
        N grows, hence :data:`HALF_COLUMNS` (docs/NOTES-gemm.md)."""
        if not device.is_gpu or (spec.dtype != "float32" and spec.n > HALF_COLUMNS):
            return 1
        return self.specialised

    @staticmethod
    def _red(spec: ConvSpec) -> int:
        return spec.c * spec.r * spec.s

    @staticmethod
    def _vec(spec: ConvSpec) -> int:
        return 4 if GemvStream._red(spec) % 4 == 0 else 1

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """Rows a block (rw: rw * N <= 32 sums a thread), loads of a row in flight (un) and threads (nt)."""
        units = cdiv(self._red(spec), self._vec(spec))
        threads = [t for t in _THREADS if t <= max(units, _THREADS[-1]) and t <= device.max_threads]
        rows = [r for r in (4, 2, 1, 8) if r * spec.n <= _SUMS and r <= spec.k] or [1]
        loads = (4, 2, 1) if threads and units // threads[0] >= 8 else (2, 4, 1)
        out = [Params(rw=r, un=u, nt=t) for r in rows for u in loads for t in threads
               if u <= cdiv(units, t)]
        return out or [Params(rw=rows[0], un=1, nt=threads[-1] if threads else 64)]

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """The first point: 4 rows a block where 4 * N sums fit (2 at N > 8), 2 loads of each row in
        flight (4 where a row takes 8 passes of the block or more: VGG-16's fc6 at N8 0.185 -> 0.179
        ms, AlexNet's at N5 0.067 -> 0.057), the widest block that gives every thread a load."""
        return self.space(spec, device)[0]

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        rw, un, nt = params.rw, params.un, params.nt
        why = [f"rw * N ({rw} * {spec.n}) must be <= {_SUMS}" if rw * spec.n > _SUMS else "",
               f"nt ({nt}) must be a multiple of 32 from 32 to {device.max_threads}"
               if nt % 32 or not 32 <= nt <= device.max_threads else "",
               f"un ({un}) must be >= 1" if un < 1 else ""]
        if any(why):
            raise ValueError(f"{self.name}: " + "; ".join(w for w in why if w))
        st = Storage(spec.dtype)
        kern = Kernel(self.name, (st.buf("w"), st.buf("x")) + out_args(epilogue, st),
                      _body(spec, rw, un, nt, epilogue, st), (nt, 1, 1),
                      comment=f"{self.name}: {params.short()}, {spec.n} columns of {self._red(spec)}")
        launch = Launch(self.name, (cdiv(spec.k, rw), 1, 1), (nt, 1, 1), ("w", "x") + out_refs(epilogue))
        return Plan(self.name, self.family, spec, params, (kern,), (launch,), (), self.tolerance, epilogue)


def _body(spec: ConvSpec, rw: int, un: int, nt: int, epi: Epilogue, st: Storage) -> str:
    """The kernel body: the row sweep (:func:`_sweep`), then the block's fixed-order sum and store."""
    red, vec, cols, k = GemvStream._red(spec), GemvStream._vec(spec), spec.n, spec.k
    units = red // vec
    parts = nt // 32
    sums = [(r, j) for r in range(rw) for j in range(cols)]
    code = Code()
    code("const int t = LOCAL_ID(0);",
         f"const int k0 = GROUP_ID(0) * {rw};",
         f"SHARED float part[{len(sums) * parts * 33}];  // [sum][warp][33]: lane-major, padded",
         f"SHARED float warp_sums[{len(sums) * parts}];")
    for r in range(rw):  # rows past K read row K - 1 and store nothing
        code(f"const GLOBAL_PTR {st.elem}* w{r} = w + (k0 + {r} < {k} ? k0 + {r} : {k - 1}) * {red};")
    code(*(f"float a{r}_{j} = 0.0f;" for r, j in sums))
    _sweep(code, units, vec, rw, un, nt, cols, red, st)
    code(*(f"part[{v * parts * 33} + (t / 32) * 33 + t % 32] = a{r}_{j};" for v, (r, j) in enumerate(sums)),
         "BARRIER();")
    with code.block(f"if (t < {len(sums) * parts})"):  # stage 1: sum (t / parts), warp (t % parts)
        code("float s = 0.0f;",
             "const int base = t * 33;  // sum t / parts, warp t % parts: (sum * parts + warp) * 33",
             "for (int i = 0; i < 32; ++i) s += part[base + i];",
             "warp_sums[t] = s;")
    code("BARRIER();")
    kt = epi.k_total or k
    with code.block(f"if (t < {len(sums)})"):  # stage 2: sum t = r * N + j over the warps, in order
        code(f"const int r = t / {cols};",
             f"const int j = t - r * {cols};",
             "const int kk = k0 + r;")
        with code.block(f"if (kk < {k})"):
            code("float s = 0.0f;",
                 f"for (int i = 0; i < {parts}; ++i) s += warp_sums[t * {parts} + i];",
                 f"const int o = j * {kt} + {epi.k_offset} + kk;",
                 f"{st.store('y', 'o', epi.apply('s', 'kk', 'o', offset_done=True, storage=st))};")
    return code.text()


def _sweep(code: Code, units: int, vec: int, rw: int, un: int, nt: int, cols: int, red: int, st: Storage) -> None:
    """Each thread's share of the rows: unit ``t + i * nt`` (float4 or element) of every row for i
    below ``units / nt``, ``un`` of them loaded before they are used; a last partial pass guarded."""
    full = units // nt
    rem = full % un
    if full - rem:  # whole passes, un at a time
        with code.block(f"for (int i = 0; i < {full - rem}; i += {un})"):
            _step(code, "i", un, False, units, vec, rw, nt, cols, red, st)
    if rem:
        _step(code, str(full - rem), rem, False, units, vec, rw, nt, cols, red, st)
    if units % nt:  # the last, partial pass
        _step(code, str(full), 1, True, units, vec, rw, nt, cols, red, st)


def _step(code: Code, i: str, n: int, guard: bool, units: int, vec: int, rw: int, nt: int, cols: int,
          red: int, st: Storage) -> None:
    """``n`` units of every row loaded (zeros past the row's end when ``guard``), then multiplied by
    the N columns' units and added to the sums."""
    with code.block(""):
        for u in range(n):
            code(f"const int c{u} = t + ({i} + {u}) * {nt};")
        zero = "MAKE_FLOAT4(0.0f, 0.0f, 0.0f, 0.0f)" if vec == 4 else "0.0f"
        typ = "float4" if vec == 4 else "float"

        def load(ptr: str, u: int) -> str:
            val = st.vload4(f"c{u}", ptr) if vec == 4 else st.load(ptr, f"c{u}")
            return f"(c{u} < {units} ? {val} : {zero})" if guard else val

        for u in range(n):
            code(*(f"const {typ} w{r}_{u} = {load(f'w{r}', u)};" for r in range(rw)))
        for u in range(n):
            for j in range(cols):
                code(f"const {typ} x{j}_{u} = {load(f'(x + {j * red})', u)};")
                for r in range(rw):
                    code(f"a{r}_{j} = {_dot(f'w{r}_{u}', f'x{j}_{u}', f'a{r}_{j}', vec)};")


def _dot(w: str, x: str, acc: str, vec: int) -> str:
    """acc + w . x as fused multiply-adds, in element order."""
    if vec == 1:
        return f"FMA({w}, {x}, {acc})"
    out = acc
    for e in "xyzw":
        out = f"FMA({w}.{e}, {x}.{e}, {out})"
    return out


register(GemvStream())
