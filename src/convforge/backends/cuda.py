"""CUDA back-end through CuPy: NVRTC to a cubin for the device's arch, raw launches on the caller's
current stream, CUDA events. The only file that imports cupy (and, for interop, torch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np

from convforge.backends.base import Backend, CompileError
from convforge.codegen.dialect import ConstBuf, Kernel, LocalBuf, TexBuf
from convforge.plan import DeviceInfo, Gemm, Launch


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

    # -- compiler ---------------------------------------------------------------------------
    def compile_options(self) -> list[str]:
        return [f"--gpu-architecture={self.arch}", "--std=c++17"]

    def compiler_version(self) -> str:
        from cupy_backends.cuda.libs import nvrtc

        major, minor = nvrtc.getVersion()
        return f"nvrtc-{major}.{minor}"

    def build(self, source: str) -> tuple[Any, bytes | None]:
        from cupy_backends.cuda.libs import nvrtc

        prog = nvrtc.createProgram(source, "convforge.cu", (), ())
        try:
            try:
                nvrtc.compileProgram(prog, self.compile_options())
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
        fn = program.get_function(kernel.name)
        lb = kernel.local_buf()
        if lb is not None and lb.nbytes > 48 * 1024:
            cp.cuda.driver.funcSetAttribute(
                fn.ptr, cp.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, lb.nbytes)
        return fn

    # -- memory -----------------------------------------------------------------------------
    def empty(self, nbytes: int) -> Any:
        with cp.cuda.Device(self.device_id):
            return cp.empty(max(nbytes, 4) // 4, dtype=cp.float32)

    def upload(self, array: np.ndarray) -> Any:
        with cp.cuda.Device(self.device_id):
            return cp.asarray(np.ascontiguousarray(array, dtype=np.float32))

    def download(self, buf: Any, shape: tuple[int, ...]) -> np.ndarray:
        return cp.asnumpy(buf.ravel()[: int(np.prod(shape))]).reshape(shape)

    def nbytes(self, buf: Any) -> int:
        return int(buf.nbytes)

    def fill(self, buf: Any, value: float, nbytes: int) -> None:
        with self._stream():
            buf.ravel()[: nbytes // 4].fill(value)

    def _stream(self) -> Any:
        return self.stream if self.stream is not None else cp.cuda.get_current_stream()

    # -- execution --------------------------------------------------------------------------
    def launch(self, program: Any, fn: Any, kernel: Kernel, step: Launch, args: list[Any]) -> None:
        stream = self._stream()
        layout = self._layouts.get(kernel)
        if layout is None:  # per kernel, once: which arguments are constants, textures, values
            specs = [x for x in kernel.args if not isinstance(x, LocalBuf)]
            lb = kernel.local_buf()
            layout = self._layouts[kernel] = (
                [(i, a) for i, a in enumerate(specs) if isinstance(a, ConstBuf)],
                [(i, isinstance(a, TexBuf)) for i, a in enumerate(specs) if not isinstance(a, ConstBuf)],
                lb.nbytes if lb else 0)
        consts, values, shared = layout
        for i, cbuf in consts:
            src = args[i]
            dst = program.get_global_var(cbuf.name)  # the symbol's device address
            nbytes = min(src.nbytes, 4 * cbuf.count)
            cp.cuda.runtime.memcpyAsync(int(dst), src.data.ptr, nbytes,
                                        cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
        vals = tuple(self._texture(args[i]) if tex else args[i] for i, tex in values)
        fn(step.grid, step.block, vals, shared_mem=shared, stream=stream)

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
        self._stream().synchronize()

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn``'s launches captured once (on a private stream) into a CUDA graph; the result
        replays it on the current stream (the network runtime's fixed launch list). Run ``fn``
        once before, so nothing allocates or compiles during the capture."""
        stream = cp.cuda.Stream(non_blocking=True)
        saved, self.stream = self.stream, stream
        try:
            stream.begin_capture()
            try:
                fn()
            finally:
                graph = stream.end_capture()
        finally:
            self.stream = saved

        def replay() -> None:
            graph.launch(self._stream())

        return replay

    def write(self, buf: Any, array: np.ndarray) -> None:
        arr = np.ascontiguousarray(array, dtype=np.float32).ravel()
        buf.ravel()[: arr.size].set(arr, stream=self._stream())

    def time_ms(self, fn: Callable[[], None], repeats: int) -> list[float]:
        # Calls are queued back to back and synchronised once, so host-side launch work overlaps
        # the previous call's device work, as in a real pipeline; each pair of events times one call.
        stream = self._stream()
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeats)]
        for start, end in events:
            start.record(stream)
            fn()
            end.record(stream)
        events[-1][1].synchronize()
        return [float(cp.cuda.get_elapsed_time(start, end)) for start, end in events]

    # -- interop ----------------------------------------------------------------------------
    def wrap(self, array: Any) -> Any:
        """A CuPy view of a CuPy array or torch CUDA tensor: no copy, unless its data is not
        16-byte aligned (a view at an odd offset), which float4 loads cannot read: then an
        aligned copy."""
        view = array if isinstance(array, cp.ndarray) else cp.asarray(array)
        return view if view.data.ptr % 16 == 0 else view.copy()

    def use_stream_of(self, array: Any) -> None:
        """Run on the stream current for the array's library (torch's or CuPy's)."""
        if type(array).__module__.startswith("torch"):
            import torch

            self.stream = cp.cuda.ExternalStream(torch.cuda.current_stream(array.device).cuda_stream,
                                                 array.device.index or 0)
        else:
            self.stream = None

    def empty_like_input(self, array: Any, shape: tuple[int, ...]) -> tuple[Any, Any]:
        """(user-facing output, CuPy view of it) of the same library and device as ``array``."""
        if type(array).__module__.startswith("torch"):
            import torch

            out = torch.empty(shape, dtype=torch.float32, device=array.device)
            return out, cp.asarray(out)
        with cp.cuda.Device(self.device_id):
            out = cp.empty(shape, dtype=cp.float32)
        return out, out


def _matrices(buf: Any, batch: int, rows: int, cols: int, ld: int, stride: int) -> Any:
    """A (batch, rows, cols) float32 view of a flat buffer (element strides; 0 = broadcast)."""
    return cp.lib.stride_tricks.as_strided(buf, shape=(batch, rows, cols),
                                           strides=(4 * stride, 4 * ld, 4))
