"""CUDA back-end through CuPy: NVRTC to a cubin for the device's arch, raw launches on the caller's
current stream, CUDA events. The only back-end file that imports cupy; running an executable on torch tensors
and CuPy arrays is the front-ends' (``frontends/torch_run.py``, ``frontends/cupy_run.py``)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np

from convforge.backends.base import (
    CONV_BUFFERS,
    PROLOGUE_BUFFERS,
    Backend,
    CompileError,
    DeviceMemoryError,
    Executable,
)
from convforge.codegen.dialect import Buf, ConstBuf, Kernel, LocalBuf, Scalar, TensorMap, TexBuf
from convforge.codegen.render import ARCH_SPECIFIC_MARK
from convforge.dtypes import from_storage, host_dtype, storage_dtype, to_storage
from convforge.plan import DeviceInfo, Gemm, Launch, Plan

log = logging.getLogger("convforge")


def _driver_version() -> str:
    """The NVIDIA driver's version (e.g. 580.159.04) from NVML, else the CUDA driver API version."""
    try:
        import pynvml

        pynvml.nvmlInit()
        ver = pynvml.nvmlSystemGetDriverVersion()
        return ver.decode() if isinstance(ver, bytes) else str(ver)
    except Exception:  # noqa: BLE001 - NVML absent: fall back to what CUDA itself says
        v = int(cp.cuda.runtime.driverGetVersion())
        return f"CUDA {v // 1000}.{v % 1000 // 10}"


def current_device() -> int:
    """The calling thread's current CUDA device (no context is created)."""
    return int(cp.cuda.runtime.getDevice())


def device_count() -> int:
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no driver, no device: CUDA is simply absent
        return 0


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device_id: int | None = None) -> None:
        super().__init__()
        self.device_id = cp.cuda.Device().id if device_id is None else device_id
        rt = cp.cuda.runtime
        props = rt.getDeviceProperties(self.device_id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.arch = f"sm_{props['major']}{props['minor']}"
        self.device = DeviceInfo(
            backend="cuda", name=name, driver=_driver_version(),
            cc=(props["major"], props["minor"]), max_threads=props["maxThreadsPerBlock"],
            shared_bytes=props["sharedMemPerBlock"],
            shared_optin_bytes=props.get("sharedMemPerBlockOptin", props["sharedMemPerBlock"]),
            const_bytes=props["totalConstMem"], warp=props["warpSize"],
            units=props["multiProcessorCount"], l2_bytes=props.get("l2CacheSize", 0))
        self.stream: Any = None  # None = CuPy's current stream at call time
        self._textures: dict[tuple[int, int], Any] = {}
        self._layouts: dict[Kernel, Any] = {}
        self._map_kernels: dict[Kernel, dict[tuple[Any, ...], _Params]] = {}  # kernels with TensorMap arguments

    # -- compiler ---------------------------------------------------------------------------
    def compile_options(self, arch_specific: bool = False) -> list[str]:
        """NVRTC options; ``arch_specific``: the ``sm_XYa`` target that wgmma needs (asked for by
        the source itself, see codegen.render.ARCH_SPECIFIC_MARK)."""
        return [f"--gpu-architecture={self.arch}{'a' if arch_specific else ''}", "--std=c++17"]

    def compiler_version(self) -> str:
        from cupy_backends.cuda.libs import nvrtc

        major, minor = nvrtc.getVersion()
        return f"nvrtc-{major}.{minor}"

    def build(self, source: str) -> tuple[Any, bytes | None]:
        from cupy_backends.cuda.libs import nvrtc

        prog = nvrtc.createProgram(source, "convforge.cu", (), ())
        try:
            try:
                nvrtc.compileProgram(prog, self.compile_options(ARCH_SPECIFIC_MARK in source))
            except nvrtc.NVRTCError:
                log = nvrtc.getProgramLog(prog)
                raise CompileError(f"NVRTC failed for {self.arch}:\n{log}") from None
            cubin = bytes(nvrtc.getCUBIN(prog))
        finally:
            nvrtc.destroyProgram(prog)
        mod = self.load_binary(cubin)
        if mod is None:
            raise CompileError("NVRTC produced a cubin the driver would not load")
        return mod, cubin

    def load_binary(self, blob: bytes) -> Any | None:
        try:
            with cp.cuda.Device(self.device_id):
                mod = cp.cuda.function.Module()
                mod.load(blob)
                return mod
        except Exception:  # noqa: BLE001 - a stale or foreign binary: rebuild
            return None

    def function(self, program: Any, kernel: Kernel) -> Any:
        with self._device():  # the module's context, whichever device the caller has current
            fn = program.get_function(kernel.name)
            lb = kernel.local_buf()
            if lb is not None and lb.nbytes > 48 * 1024:
                cp.cuda.driver.funcSetAttribute(
                    fn.ptr, cp.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, lb.nbytes)
        return fn

    # -- memory -----------------------------------------------------------------------------
    def empty(self, nbytes: int) -> Any:
        with cp.cuda.Device(self.device_id):
            return cp.empty(max(-(-nbytes // 4), 1), dtype=cp.float32)  # rounded up: an odd count of halves fits

    def upload(self, array: np.ndarray) -> Any:
        with cp.cuda.Device(self.device_id):
            return cp.asarray(np.ascontiguousarray(array, dtype=host_dtype(array)))

    def download(self, buf: Any, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
        flat = buf.ravel().view(storage_dtype(dtype))
        with self._device():
            host = cp.asnumpy(flat[: int(np.prod(shape))], stream=self._stream())
            self._stream().synchronize()
        return from_storage(host.reshape(shape), dtype)

    def nbytes(self, buf: Any) -> int:
        return int(buf.nbytes)

    def free_bytes(self) -> int:
        """Device memory a new allocation can get: the driver's free figure plus CuPy's pooled
        free blocks (torch's cached blocks are the caller's and not counted)."""
        with cp.cuda.Device(self.device_id):
            free = int(cp.cuda.runtime.memGetInfo()[0])
            return free + int(cp.get_default_memory_pool().free_bytes())

    def executable(self, plan: Plan) -> CudaExecutable:
        return CudaExecutable(self, plan)

    def fill(self, buf: Any, value: float, nbytes: int, dtype: str = "float32") -> None:
        pattern = to_storage(np.array([value], np.float32), dtype)
        flat = buf.ravel().view(pattern.dtype)
        with self._device(), self._stream():
            flat[: nbytes // pattern.itemsize].fill(pattern[0])

    def _stream(self) -> Any:
        """The stream work of this back-end goes to: ``self.stream`` when set, else the current
        stream of THIS back-end's device (not of whichever device is current)."""
        return self.stream if self.stream is not None else cp.cuda.get_current_stream(self.device_id)

    def _device(self) -> Any:
        """This back-end's device made current for a block (the dict path's launches, fills, events
        and captures run there even when the caller has another device current); nothing to do,
        and nothing paid but one query, when it already is."""
        if cp.cuda.runtime.getDevice() == self.device_id:
            return contextlib.nullcontext()
        return cp.cuda.Device(self.device_id)

    # -- execution --------------------------------------------------------------------------
    def launch(self, program: Any, fn: Any, kernel: Kernel, step: Launch, args: list[Any]) -> None:
        with self._device():
            self._launch(program, fn, kernel, step, args)

    def _launch(self, program: Any, fn: Any, kernel: Kernel, step: Launch, args: list[Any]) -> None:
        stream = self._stream()
        layout = self._layouts.get(kernel)
        if layout is None:  # per kernel, once: which arguments are constants, textures, values
            specs = [x for x in kernel.args if not isinstance(x, LocalBuf)]
            lb = kernel.local_buf()
            if any(isinstance(a, TensorMap) for a in specs):
                self._map_kernels[kernel] = {}
            layout = self._layouts[kernel] = (
                [(i, a) for i, a in enumerate(specs) if isinstance(a, ConstBuf)],
                [(i, isinstance(a, TexBuf)) for i, a in enumerate(specs) if not isinstance(a, ConstBuf)],
                lb.nbytes if lb else 0)
        consts, values, shared = layout
        if kernel in self._map_kernels:  # tensor maps by value: the driver launch on our own parameters
            self._launch_maps(fn, kernel, step, args, shared, stream)
            return
        for i, cbuf in consts:
            src = args[i]
            dst = program.get_global_var(cbuf.name)  # the symbol's device address
            nbytes = min(src.nbytes, 4 * cbuf.count)
            cp.cuda.runtime.memcpyAsync(int(dst), src.data.ptr, nbytes,
                                        cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
        vals = tuple(self._texture(args[i]) if tex else args[i] for i, tex in values)
        fn(step.grid, step.block, vals, shared_mem=shared, stream=stream)

    def _launch_maps(self, fn: Any, kernel: Kernel, step: Launch, args: list[Any], shared: int, stream: Any) -> None:
        """A launch with TensorMap arguments: its parameter array per distinct set of buffer
        addresses and scalars (the maps encoded once for them; a few dozen kept per kernel)."""
        specs = [a for a in kernel.args if not isinstance(a, LocalBuf)]
        values = tuple(_address(v) if isinstance(a, Buf | TensorMap) else v for a, v in zip(specs, args, strict=True))
        cache = self._map_kernels[kernel]
        params = cache.get(values)
        if params is None:
            if len(cache) >= 64:
                cache.clear()
            params = cache[values] = _Params(list(zip(specs, values, strict=True)))
        _driver().launch(int(fn.ptr), *step.grid, *step.block, shared, stream.ptr, params.address, 0)

    def _texture(self, array: Any) -> Any:
        """A linear float texture object over ``array``, made once per (address, size)."""
        key = (int(array.data.ptr), int(array.nbytes))
        tex = self._textures.get(key)
        if tex is None:
            t, rt = cp.cuda.texture, cp.cuda.runtime
            ch = t.ChannelFormatDescriptor(32, 0, 0, 0, rt.cudaChannelFormatKindFloat)
            res = t.ResourceDescriptor(rt.cudaResourceTypeLinear, arr=array, chDesc=ch,
                                       sizeInBytes=array.nbytes)
            desc = t.TextureDescriptor(None, rt.cudaFilterModePoint, rt.cudaReadModeElementType)
            tex = self._textures[key] = t.TextureObject(res, desc)
        return tex

    def gemm(self, step: Gemm, a: Any, b: Any, c: Any) -> None:
        """Strided-batched row-major SGEMM through cuBLAS (CuPy's matmul), on the current stream."""
        av = _matrices(a, step.batch, step.m, step.k, step.lda, step.stride_a)
        bv = _matrices(b, step.batch, step.k, step.n, step.ldb, step.stride_b)
        cv = _matrices(c, step.batch, step.m, step.n, step.ldc, step.stride_c)
        with cp.cuda.Device(self.device_id), self._stream():
            cp.matmul(av, bv, out=cv)

    def synchronize(self) -> None:
        with self._device():
            self._stream().synchronize()

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn``'s launches captured once (on a private stream) into a CUDA graph; the result
        replays it on the current stream (the network runtime's fixed launch list). Run ``fn``
        once before, so nothing allocates or compiles during the capture."""
        with self._device():
            stream = cp.cuda.Stream(non_blocking=True)
        saved, self.stream = self.stream, stream
        try:
            with self._device():
                stream.begin_capture()
                try:
                    fn()
                finally:
                    graph = stream.end_capture()
        finally:
            self.stream = saved

        def replay() -> None:
            with self._device():
                graph.launch(self._stream())

        return replay

    def write(self, buf: Any, array: np.ndarray) -> None:
        arr = np.ascontiguousarray(array, dtype=host_dtype(array)).ravel()
        with self._device():
            buf.ravel().view(arr.dtype)[: arr.size].set(arr, stream=self._stream())

    def time_ms(self, fn: Callable[[], None], repeats: int) -> list[float]:
        # Calls are queued back to back and synchronised once, so host-side launch work overlaps
        # the previous call's device work, as in a real pipeline; each pair of events times one call.
        with self._device():
            stream = self._stream()
            events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeats)]
            for start, end in events:
                start.record(stream)
                fn()
                end.record(stream)
            events[-1][1].synchronize()
            return [float(cp.cuda.get_elapsed_time(start, end)) for start, end in events]


def _address(array: Any) -> int:
    return int(array.data.ptr)


# -- TMA tensor maps ----------------------------------------------------------------------------
# A TensorMap argument (codegen/dialect.py) is encoded by the driver (cuTensorMapEncodeTiled /
# cuTensorMapEncodeIm2col, through ctypes: CuPy does not bind them) from its description and the
# address of the buffer the launch names, once per (map, address), and passed by value (128 bytes).
_TMAP_DTYPES = {"float16": 6, "float32": 7, "bfloat16": 9}  # CUtensorMapDataType
_L2_128B, _OOB_ZERO, _INTERLEAVE_NONE = 2, 0, 0
_SWIZZLES = {128: 3, 64: 2, 32: 1}  # CUtensorMapSwizzle of a swizzle width in bytes
_TMAPS: dict[tuple[TensorMap, int], bytes] = {}
NATIVE_MAX_ARGS, NATIVE_MAX_MAPS = 64, 32  # native_core.h kMaxArgs, kMaxMaps: arguments and maps of a launch
_TMAPS_KEPT = 4096  # encoded maps remembered (one per map and buffer address)


def _map_cell() -> _At:
    """128 bytes at a 64-byte-aligned address (what the driver writes a CUtensorMap into and a
    kernel parameter array points at), kept alive with its ctypes buffer."""
    raw = ctypes.create_string_buffer(128 + 64)
    return _At(raw, (ctypes.addressof(raw) + 63) & ~63)


def map_encoding(tmap: TensorMap) -> tuple[bool, int, tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                             tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """The driver's encode arguments of ``tmap`` but the address: (im2col, CUtensorMapDataType,
    dims, byte strides, box (im2col: channels per pixel, pixels per column), element strides,
    lower and upper pixel corners, CUtensorMapSwizzle): what :func:`tensor_map` passes and the
    native fast paths (native_core.h ``read_map``) pass too."""
    rank = len(tmap.dims)
    im2col = tmap.mode == "im2col"
    elem = (1, *tmap.traversal, *([1] * (rank - 1 - len(tmap.traversal)))) if im2col else (1,) * rank
    return (im2col, _TMAP_DTYPES[tmap.dtype], tuple(tmap.dims), tuple(tmap.strides), tuple(tmap.box), elem,
            tuple(tmap.lower) if im2col else (), tuple(tmap.upper) if im2col else (), _SWIZZLES[tmap.swizzle])


def tensor_map(tmap: TensorMap, address: int) -> bytes:
    """The 128-byte CUtensorMap of ``tmap`` over device memory at ``address`` (cached)."""
    key = (tmap, address)
    hit = _TMAPS.get(key)
    if hit is not None:
        return hit
    lib = _driver().lib
    u64, u32, i32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int
    im2col, dtype, dims_, strides_, box, elem_, lower, upper, swizzle = map_encoding(tmap)
    rank = len(dims_)
    cell = _map_cell()
    at = cell.at
    dims, strides = (u64 * rank)(*dims_), (u64 * max(rank - 1, 1))(*strides_)
    elem = (u32 * rank)(*elem_)
    common = (_INTERLEAVE_NONE, swizzle, _L2_128B, _OOB_ZERO)
    if not im2col:
        err = lib.cuTensorMapEncodeTiled(ctypes.c_void_p(at), dtype, rank, ctypes.c_void_p(address), dims, strides,
                                         (u32 * rank)(*box), elem, *common)
    else:
        spatial = rank - 2
        err = lib.cuTensorMapEncodeIm2col(ctypes.c_void_p(at), dtype, rank, ctypes.c_void_p(address), dims, strides,
                                          (i32 * spatial)(*lower), (i32 * spatial)(*upper), u32(box[0]), u32(box[1]),
                                          elem, *common)
    if err:
        raise RuntimeError(f"cuTensorMapEncode{tmap.mode.capitalize()} refused tensor map {tmap} at {address:#x}: "
                           f"CUresult {err}")
    if len(_TMAPS) >= _TMAPS_KEPT:
        _TMAPS.clear()
    out = _TMAPS[key] = ctypes.string_at(at, 128)
    return out


class _Params:
    """A kernel's parameter array for cuLaunchKernel: pointers and scalars as 8 / 4 bytes, tensor
    maps as 128 bytes at a 64-byte-aligned address."""

    def __init__(self, values: list[tuple[Any, Any]]) -> None:
        self._cells: list[Any] = []
        addrs = []
        for arg, value in values:
            if isinstance(arg, TensorMap):
                mc = _map_cell()
                self._cells.append(mc)
                if value:
                    ctypes.memmove(mc.at, tensor_map(arg, int(value)), 128)
                addrs.append(mc.at)
                continue
            if isinstance(arg, Scalar):
                cell: Any = ctypes.c_float(float(value)) if arg.ctype == "float" else ctypes.c_int32(int(value))
            else:
                cell = ctypes.c_uint64(int(value))
            self._cells.append(cell)
            addrs.append(ctypes.addressof(cell))
        self._array = (ctypes.c_void_p * max(len(addrs), 1))(*addrs)
        self.address = ctypes.addressof(self._array)


def _matrices(buf: Any, batch: int, rows: int, cols: int, ld: int, stride: int) -> Any:
    """A (batch, rows, cols) float32 view of a flat buffer (element strides; 0 = broadcast)."""
    return cp.lib.stride_tricks.as_strided(buf, shape=(batch, rows, cols),
                                           strides=(4 * stride, 4 * ld, 4))


# -- the per-call fast path ---------------------------------------------------------------------
# A warm call of conv2d is: read three device pointers and the current stream handle, allocate the
# output through the caller's allocator, rewrite the pointer slots of kernel-parameter buffers
# built once per executable, and call cuLaunchKernel through CuPy's compiled binding (typed C
# arguments, under a microsecond above a launch from C, where ctypes' argument conversion costs
# several more; scripts/host_cost.py measures both). Nothing synchronises, nothing reads device
# memory, nothing allocates outside the caller's allocator once the workspace exists, so CUDA-graph
# capture works.

class _Driver:
    """The few libcuda entry points the fast path calls: the launch through CuPy's Cython binding
    (``cupy_backends``), context queries through ctypes (loaded once)."""

    def __init__(self) -> None:
        from cupy_backends.cuda.api import driver as cyd

        name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
        lib = self.lib = ctypes.CDLL(name)
        p = ctypes.c_void_p
        self.launch = cyd.launchKernel  # (f, grid xyz, block xyz, smem, stream, params, extra): raises on error
        self.error = cyd.CUDADriverError
        self.ctx_get = lib.cuCtxGetCurrent
        self.ctx_get.argtypes = [ctypes.POINTER(p)]
        self.ctx_push = lib.cuCtxPushCurrent_v2
        self.ctx_push.argtypes = [p]
        self.ctx_pop = lib.cuCtxPopCurrent_v2
        self.ctx_pop.argtypes = [ctypes.POINTER(p)]
        self.ctx_set = lib.cuCtxSetCurrent
        self.ctx_set.argtypes = [p]
        self.multi_gpu = device_count() > 1
        self._thread = threading.local()  # .ready: this thread has had the one GPU's context current

    def current_context(self) -> int:
        ctx = ctypes.c_void_p()
        self.ctx_get(ctypes.byref(ctx))
        return int(ctx.value or 0)

    def needs_push(self, context: int) -> bool:
        """Whether a launch in ``context`` must push it first. Several GPUs: unless it is current. One
        GPU: a thread where no context is current yet (autograd runs backward on its own threads, where
        nothing may have made one current; the launch then fails with CUDA_ERROR_INVALID_CONTEXT) gets
        the device's context set once, as CUDA's runtime API would; checked once per thread."""
        if self.multi_gpu:
            return self.current_context() != context
        if getattr(self._thread, "ready", False):
            return False
        current = self.current_context()
        if current == 0:
            self.ctx_set(ctypes.c_void_p(context))
            current = self.current_context()
        self._thread.ready = current == context
        return current != context


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


def multi_gpu() -> bool:
    """Whether the machine has more than one CUDA device (launches then push the executable's context)."""
    return _driver().multi_gpu


def capturing(stream: int) -> bool:
    """Whether ``stream`` (a raw handle) is capturing a CUDA graph; an error asking (the legacy
    stream while another stream captures globally) counts as capturing: nothing may allocate."""
    try:
        return bool(cp.cuda.runtime.streamIsCapturing(stream))
    except cp.cuda.runtime.CUDARuntimeError:
        return True


class _At:
    """A ctypes buffer kept alive with the aligned address inside it that a parameter array names."""

    def __init__(self, raw: Any, at: int) -> None:
        self.raw, self.at = raw, at


class CudaExecutable(Executable):
    """An Executable with a raw-pointer entry, :meth:`launch_raw`, for conv plans.

    Plans made of kernel launches with plain pointer and scalar arguments (almost all) launch
    through prepared cuLaunchKernel parameter buffers; plans with Fill or cuBLAS Gemm steps, or
    constant-memory or texture arguments, take the dict path on CuPy views of the same pointers
    (slower, correct; textures are cached per address by the back-end, never rebuilt per call).
    The workspace is one per executable and device: calls are ordered on one stream (as a model's
    layers are); concurrent calls of the same layer on two streams would share it.
    """

    backend: CudaBackend

    def __init__(self, backend: CudaBackend, plan: Plan) -> None:
        super().__init__(backend, plan)
        known = set(CONV_BUFFERS) | set(plan.prologue.buffers()) | {name for name, _ in plan.workspace}
        self.fast = all(isinstance(st, Launch) and all(isinstance(r, int | float) or r in known for r in st.args)
                        for st in plan.steps) and not any(
            isinstance(a, ConstBuf | TexBuf) for k in plan.kernels for a in k.args)
        self.context = 0
        self._ptr_slots: list[tuple[Any, int]] = []
        self._ws_slots: list[tuple[Any, str]] = []
        self._ws_derived: tuple[int, ...] = ()
        self._offsets = tuple(self.derived_offsets[n] for n in self.derived)  # packed derived buffer layout
        self._runs: dict[str, list[tuple[tuple[int, ...], int]]] = {"all": [], "rest": [], "weights": []}
        self._keep: list[Any] = []  # ctypes storage the parameter arrays point into
        self._layouts: dict[int, list[tuple[int, Any]]] = {}  # parameter array -> argument layout
        # TensorMap parameters: [cell address, map, pointer slot (-1: workspace), buffer name, encoded for]
        self._maps: list[list[Any]] = []
        if self.fast:
            for i, step in enumerate(plan.steps):
                assert isinstance(step, Launch)
                entry = self._params(step)
                self._runs["all"].append(entry)
                self._runs["weights" if i in self.weight_steps else "rest"].append(entry)

    def _params(self, step: Launch) -> tuple[tuple[int, ...], int]:
        """(launch header, address of the void** parameter array) for one launch, built once."""
        kernel = self.kernels[step.kernel]
        slot_of = {name: i for i, name in enumerate(CONV_BUFFERS)}
        slot_of.update({name: len(CONV_BUFFERS) + j for j, name in enumerate(self.derived)})
        # a prologue's scale and shift after them (never filed with the native fast path)
        slot_of.update({name: len(CONV_BUFFERS) + len(self.derived) + j for j, name in enumerate(PROLOGUE_BUFFERS)})
        storage: list[Any] = []
        layout: list[tuple[int, Any]] = []  # the native fast path's copy (native_program)
        for arg, ref in zip(self._value_args(kernel), step.args, strict=True):
            if isinstance(arg, Scalar):
                value = ctypes.c_float(float(ref)) if arg.ctype == "float" else ctypes.c_int32(int(ref))
                storage.append(value)
                layout.append((2, ctypes.c_uint32.from_buffer_copy(value).value))
                continue
            if isinstance(arg, TensorMap):  # 128 bytes, 64-aligned, encoded per buffer address (launch_raw)
                mc = _map_cell()
                storage.append(mc)
                self._maps.append([mc.at, arg, slot_of.get(str(ref), -1), str(ref), 0])
                layout.append((3, (arg, slot_of.get(str(ref), -1), str(ref))))
                continue
            assert isinstance(arg, Buf)
            cell = ctypes.c_uint64(0)
            storage.append(cell)
            if str(ref) in slot_of:
                self._ptr_slots.append((cell, slot_of[str(ref)]))
                layout.append((0, slot_of[str(ref)]))
            else:
                self._ws_slots.append((cell, str(ref)))
                layout.append((1, str(ref)))
        array = (ctypes.c_void_p * max(len(storage), 1))(*[c.at if isinstance(c, _At) else ctypes.addressof(c)
                                                           for c in storage])
        self._keep += storage + [array]
        lb = kernel.local_buf()
        fn = int(self.functions[step.kernel].ptr)
        head = (fn, *step.grid, *step.block, lb.nbytes if lb else 0)
        self._layouts[ctypes.addressof(array)] = layout
        return head, ctypes.addressof(array)

    @property
    def native(self) -> bool:
        """Whether the native fast paths (torch/native.cpp, backends/cupy_native.cpp) can take this
        executable: a fast one (tensor maps included: native_core.h encodes them per address) whose
        launches fit the core's fixed arrays (a stride-4 strided dgrad in 3xTF32 has 64 maps)."""
        return self.fast and all(len(layout) <= NATIVE_MAX_ARGS and sum(k == 3 for k, _ in layout) <= NATIVE_MAX_MAPS
                                 for layout in self._layouts.values())

    def _refresh_maps(self, vals: tuple[int, ...]) -> None:
        """Re-encode the tensor-map parameters whose buffer moved since the last launch."""
        ws = self._workspace
        for entry in self._maps:
            at, tmap, slot, name, last = entry
            ptr = vals[slot] if slot >= 0 else (int(ws[name].data.ptr) if ws is not None else 0)
            if ptr != last:
                ctypes.memmove(at, tensor_map(tmap, ptr), 128)
                entry[4] = ptr

    def native_program(self) -> tuple[Any, ...]:
        """This executable for the native fast path (torch/native.cpp ``register``): per step list
        ("all", "rest", "weights") the launches as (function, grid, block, shared bytes, arguments),
        each argument (0, pointer slot) | (1, fixed 64-bit value: a workspace pointer) | (2, fixed
        32-bit value: a scalar's bits) | (3, a tensor map: (pointer slot or -1, the workspace
        buffer's address where -1, :func:`map_encoding`)); then the output shape, the own filter-derived buffers,
        their offsets in a packed buffer, its size in floats, the CUDA context, the plan's name and
        this executable (kept alive by the entry). Call after :meth:`reserve`."""
        assert self.fast and self._workspace is not None, "native_program needs a reserved fast executable"
        assert not self.plan.prologue.active, "the native fast path has no slots for a prologue's buffers"
        ws = self._workspace

        def value(kind: int, v: Any) -> Any:
            if kind == 1:
                return int(ws[v].data.ptr)
            if kind == 3:  # (slot, fixed address where no slot: a workspace buffer, the encode arguments)
                tmap, slot, name = v
                return (slot, 0 if slot >= 0 else int(ws[name].data.ptr), *map_encoding(tmap))
            return v

        def launches(steps: str) -> list[tuple[Any, ...]]:
            return [(*head, tuple((kind, value(kind, v)) for kind, v in self._layouts[params]))
                    for head, params in self._runs[steps]]

        return (launches("all"), launches("rest"), launches("weights"), tuple(self.plan.spec.y_shape),
                self._ws_derived, self._offsets, self.derived_bytes // 4, int(self.context), self.plan.describe(),
                self)

    def reserve(self, stream: int = 0) -> None:
        """Allocate the workspace now (first, uncaptured use); refuse under CUDA-graph capture,
        where nothing may allocate; DeviceMemoryError when it does not fit. The parameter slots
        get the workspace's addresses here, also when the dict path allocated it first."""
        if self.context:
            return
        if self._workspace is None and self.plan.workspace and capturing(stream):
            raise RuntimeError(f"{self.plan.describe()} needs {self.plan.workspace_bytes} bytes of workspace, "
                               "first used during CUDA-graph capture: run the layer once before capturing")
        pool = cp.get_default_memory_pool()
        try:
            ws = self.workspace()
        except cp.cuda.memory.OutOfMemoryError:
            pool.free_all_blocks()
            try:
                ws = self.workspace()
            except cp.cuda.memory.OutOfMemoryError:
                raise DeviceMemoryError(f"workspace of {self.plan.describe()} on {self.plan.spec.short()}",
                                        self.plan.workspace_bytes, self.backend.free_bytes()) from None
        with cp.cuda.Device(self.backend.device_id):
            self.context = _driver().current_context()
        for cell, name in self._ws_slots:
            cell.value = int(ws[name].data.ptr)
        self._ws_derived = tuple(int(ws[name].data.ptr) for name in self.derived)

    def call(self, buffers: dict[str, Any]) -> None:
        """A whole call on named CuPy buffers through :meth:`launch_raw` (conv2d's fast path on
        CuPy and torch arrays: every step, the executable's own workspace) where the plan has one,
        else the dict path."""
        if not self.fast:
            self(buffers)
            return
        self.check_buffers(buffers)
        ptr = [int(buffers[n].data.ptr) if n in buffers else 0 for n in CONV_BUFFERS + PROLOGUE_BUFFERS]
        self.reserve()
        x, w, y, bias, res, pscale, pshift = ptr
        self.launch_raw(x, w, y, bias, self.backend._stream().ptr, 0, "all", res, (pscale, pshift))

    def launch_raw(self, x: int, w: int, y: int, bias: int, stream: int, derived: int = 0,
                   steps: str = "all", res: int = 0, pro: tuple[int, int] = (0, 0)) -> None:
        """Run on raw device pointers on raw stream ``stream``. ``derived``: base of a packed
        buffer of the filter-derived workspace (``derived_offsets``), with ``steps`` "rest" (use
        it) or "weights" (fill it); 0 uses the executable's own workspace. ``res``: the residual
        (float32, the output's shape) that a plan whose epilogue has one adds before its ReLU.
        ``pro``: the (pscale, pshift) of a plan whose prologue is affine (float32, C each)."""
        if not self.fast:
            self._launch_views(x, w, y, bias, stream, derived, steps, res, pro)
            return
        if derived:
            vals = (x, w, y, bias, res, *[derived + off for off in self._offsets], *pro)
        else:
            vals = (x, w, y, bias, res, *self._ws_derived, *pro)
        for cell, i in self._ptr_slots:
            cell.value = vals[i]
        if self._maps:
            self._refresh_maps(vals)
        drv = _DRIVER or _driver()
        pushed = drv.needs_push(self.context)
        if pushed:
            drv.ctx_push(self.context)
        try:
            for head, params in self._runs[steps]:
                drv.launch(*head, stream, params, 0)
        except drv.error as err:
            raise RuntimeError(f"cuLaunchKernel failed for {self.plan.describe()}: {err}") from err
        finally:
            if pushed:
                drv.ctx_pop(ctypes.byref(ctypes.c_void_p()))

    def _launch_views(self, x: int, w: int, y: int, bias: int, stream: int, derived: int, steps: str,
                      res: int = 0, pro: tuple[int, int] = (0, 0)) -> None:
        """The dict path on CuPy views of the raw pointers, on the caller's stream."""
        dev = self.backend.device_id
        bufs = {name: _view(ptr, self._sizes[name], dev)
                for name, ptr in zip(CONV_BUFFERS + PROLOGUE_BUFFERS, (x, w, y, bias, res, *pro), strict=True)
                if ptr}
        if derived:
            sizes = dict(self.plan.workspace)
            bufs.update({n: _view(derived + self.derived_offsets[n], sizes[n], dev) for n in self.derived})
        be = self.backend
        saved, be.stream = be.stream, _external_stream(stream, dev)
        try:
            with cp.cuda.Device(dev):
                self(bufs, steps)
        finally:
            be.stream = saved


class RawLaunches:
    """Named launch lists of non-conv kernels run on raw device pointers (convforge.torch's training
    batch norm, kernels/batchnorm.py): one program; per launch a parameter array built once, whose
    pointer cells are filled per call. Every kernel argument is a buffer (sizes are constants). Calls
    on one object are not thread-safe (they share the cells), as a conv executable's are not."""

    def __init__(self, backend: CudaBackend, kernels: tuple[Kernel, ...], lists: dict[str, tuple[Launch, ...]],
                 title: str) -> None:
        from convforge.codegen.render import render

        program = backend.program(render(list(kernels), "cuda", title))
        by_name = {k.name: k for k in kernels}
        with cp.cuda.Device(backend.device_id):
            self.context = _driver().current_context()
        self._keep: list[Any] = []
        self.title = title
        self._lists: dict[str, list[tuple[tuple[int, ...], int, tuple[tuple[Any, str], ...]]]] = {}
        for which, launches in lists.items():
            entries: list[tuple[tuple[int, ...], int, tuple[tuple[Any, str], ...]]] = []
            for step in launches:
                kernel = by_name[step.kernel]
                if not all(isinstance(a, Buf) for a in kernel.args):
                    raise ValueError(f"{kernel.name}: RawLaunches takes buffer arguments only")
                cells = [ctypes.c_uint64(0) for _ in step.args]
                array = (ctypes.c_void_p * max(len(cells), 1))(*[ctypes.addressof(c) for c in cells])
                self._keep += [*cells, array]
                lb = kernel.local_buf()
                head = (int(backend.function(program, kernel).ptr), *step.grid, *step.block, lb.nbytes if lb else 0)
                entries.append((head, ctypes.addressof(array), tuple(zip(cells, map(str, step.args), strict=True))))
            self._lists[which] = entries

    def native_program(self, slots: dict[str, int], first: str, second: str) -> tuple[Any, ...]:
        """Launch lists ``first`` and ``second`` as native_core.h's ``read_program`` reads a program
        (its "all" and "rest" steps), every argument the pointer slot ``slots`` gives its buffer's
        name: what native.cpp's ``register_bn`` files, so C++ launches them without Python."""
        def launches(which: str) -> list[tuple[Any, ...]]:
            return [(*head, tuple((0, slots[name]) for _, name in cells)) for head, _, cells in self._lists[which]]

        return (launches(first), launches(second), [], (), (), (), 0, int(self.context), self.title, self)

    def __call__(self, which: str, ptrs: dict[str, int], stream: int) -> None:
        """Launch list ``which`` on ``stream`` (a raw handle), buffers by name -> device address. The
        context is checked on every call, one GPU or several: autograd runs backward on its own thread,
        where nothing may have made the device's context current yet."""
        drv = _DRIVER or _driver()
        pushed = drv.needs_push(self.context)
        if pushed:
            drv.ctx_push(self.context)
        try:
            for head, params, cells in self._lists[which]:
                for cell, name in cells:
                    cell.value = ptrs[name]
                drv.launch(*head, stream, params, 0)
        except drv.error as err:
            raise RuntimeError(f"cuLaunchKernel failed for {which}: {err}") from err
        finally:
            if pushed:
                drv.ctx_pop(ctypes.byref(ctypes.c_void_p()))


def _external_stream(handle: int, device: int) -> Any:
    """A CuPy stream object over a raw handle: ``Stream.from_external`` where CuPy has it (14
    deprecates ``ExternalStream``), else, or when it refuses a plain handle, ``ExternalStream``."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(handle, device_id=device)
        except (TypeError, ValueError, AttributeError):  # another signature: the older class
            pass
    return cp.cuda.ExternalStream(handle, device)


def _view(ptr: int, nbytes: int, device: int) -> Any:
    """A flat float32 CuPy array over memory someone else owns (no copy, no ownership); its length
    rounded up, so an odd count of half-precision elements is not cut short (the bound checks) —
    the last 2 bytes are never touched, and allocations are whole granules anyway."""
    words = max(-(-nbytes // 4), 1)
    mem = cp.cuda.UnownedMemory(ptr, 4 * words, None, device)
    return cp.ndarray((words,), cp.float32, cp.cuda.MemoryPointer(mem, 0))
