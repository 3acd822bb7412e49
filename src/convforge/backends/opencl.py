"""OpenCL back-end through PyOpenCL: PoCL on CPUs, vendor drivers on GPUs. Only file importing pyopencl."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("convforge")


def _usable_folder(folder: Path) -> bool:
    """Whether ``folder`` exists or can be made, and this process may write and enter it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK | os.X_OK)
    except OSError:
        return False


def _own_temp_folder() -> Path:
    """``convforge-pocl-<uid>`` in the temporary folder (kept between runs), when this user owns it
    and it is no link; else a fresh temporary folder."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = Path(tempfile.gettempdir()) / f"convforge-pocl-{uid}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        if not folder.is_symlink() and folder.stat().st_uid == uid and os.access(folder, os.W_OK | os.X_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="convforge-pocl-"))


def _user_cache() -> Path:
    """The folder PoCL, PyOpenCL and pytools keep caches under: $XDG_CACHE_HOME, else ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))


def _point_caches_at_usable_folders() -> None:
    """PoCL offers no OpenCL device at all where it cannot create or write its kernel cache
    (``POCL_CACHE_DIR``, else ``$XDG_CACHE_HOME/pocl`` or ``~/.cache/pocl``), and PyOpenCL's caches
    (through pytools) fail with a traceback and "Exception ignored" lines: an unwritable or
    untraversable HOME would read as "no OpenCL device found". Before PyOpenCL starts, an unusable
    cache folder is swapped for convforge's cache folder, else ``convforge-pocl-<uid>`` in the
    temporary folder, with one warning naming both."""
    base, pocl = _user_cache(), os.environ.get("POCL_CACHE_DIR")
    bad_base = not _usable_folder(base / "pocl")
    bad_pocl = bool(pocl) and not _usable_folder(Path(str(pocl)))
    if not (bad_base or bad_pocl):
        return
    from convforge.config import ConfigError, config

    try:
        alt: Path | None = config.cache_dir
    except ConfigError:
        alt = None
    if alt is None or not _usable_folder(alt / "pocl"):
        alt = _own_temp_folder()
    was = [f"{base} (XDG_CACHE_HOME or HOME)"] if bad_base else []
    if bad_base:
        os.environ["XDG_CACHE_HOME"] = str(alt)
    if bad_pocl or (bad_base and pocl is None):
        os.environ["POCL_CACHE_DIR"] = str(alt / "pocl")
        was += [f"{pocl} (POCL_CACHE_DIR)"] if bad_pocl else []
    log.warning("cache folder %s cannot be created or written; PoCL and PyOpenCL cache in %s instead "
                "(set XDG_CACHE_HOME or POCL_CACHE_DIR to a writable folder)", " and ".join(was), alt)


_point_caches_at_usable_folders()

import pyopencl as cl  # noqa: E402 - PoCL reads its cache folder when it starts

from convforge.backends.base import Backend, CompileError, Work  # noqa: E402
from convforge.backends.cache import cache_key  # noqa: E402
from convforge.codegen.dialect import Kernel, LocalBuf, Scalar  # noqa: E402
from convforge.config import config  # noqa: E402
from convforge.dtypes import from_storage, host_dtype, storage_dtype, to_storage  # noqa: E402
from convforge.plan import DeviceInfo, Launch  # noqa: E402
from convforge.version import __version__  # noqa: E402

_OPTIONS = ["-cl-std=CL1.2"]


def list_devices() -> list[tuple[int, int, str, str]]:
    """(platform index, device index, platform name, device name) of every OpenCL device."""
    out = []
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        return []
    for pi, plat in enumerate(platforms):
        for di, dev in enumerate(plat.get_devices()):
            out.append((pi, di, plat.name, dev.name))
    return out


_PROBE = "__kernel void convforge_probe(__global float* a) { a[get_global_id(0)] += 1.0f; }"
_HINT = ("PoCL from PyPI bundles an LLVM that may not know a new CPU (AMD Zen 5: 'unknown target CPU "
         "generic'); install the system's PoCL (Debian / Ubuntu: apt-get install pocl-opencl-icd) or name a "
         "working device with CONVFORGE_OPENCL_DEVICE=platform:device (convforge devices lists them)")


def build_refusal(device: cl.Device) -> str | None:
    """None when ``device``'s compiler builds a trivial kernel, else its complaint (the last line of
    the build log that says something)."""
    try:
        cl.Program(cl.Context([device]), _PROBE).build(options=_OPTIONS)
    except cl.Error as err:
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip().startswith(("error", "fatal"))]
        return lines[-1] if lines else str(err).splitlines()[0]
    return None


def refusal_of(platform: int, device: int) -> str | None:
    """:func:`build_refusal` of the device :func:`list_devices` numbers (platform, device)."""
    return build_refusal(cl.get_platforms()[platform].get_devices()[device])


def _device_index(device: cl.Device) -> str:
    """``device`` as ``_pick`` reads it: "platform:device" indices."""
    for i, p in enumerate(cl.get_platforms()):
        for j, d in enumerate(p.get_devices()):
            if d == device:
                return f"{i}:{j}"
    raise ValueError(f"OpenCL device {device.name.strip()} is not among the platforms' devices")


def warm_worker() -> None:
    """A PoCL warming process (:meth:`OpenCLBackend._compile_all`): the device from argv[1]
    ("platform:device"), a pickled list of Work on stdin (from the parent process, never from a
    file), one line per Work on stdout: "ok I" or "failed I"."""
    import pickle
    import sys

    works = pickle.loads(sys.stdin.buffer.read())  # noqa: S301 - the parent wrote it, through a pipe
    backend = OpenCLBackend(cl_device=_pick(sys.argv[1]))
    for i, w in enumerate(works):
        try:
            backend._warm(w)
            print(f"ok {i}", flush=True)
        except Exception:  # noqa: BLE001 - the parent's run compiles it again and reports the error
            print(f"failed {i}", flush=True)


def _pick(spec: str) -> cl.Device:
    """The device ``spec`` ("platform:device") names, else the first GPU, else the first device,
    skipping devices whose compiler cannot build a trivial kernel (RuntimeError naming each when
    none can)."""
    platforms = cl.get_platforms()
    if spec:
        pi, _, di = spec.partition(":")
        try:
            return platforms[int(pi)].get_devices()[int(di or 0)]
        except (ValueError, IndexError):
            have = ", ".join(f"{i}:{j} {d.name.strip()}" for i, p in enumerate(platforms)
                             for j, d in enumerate(p.get_devices())) or "none"
            raise ValueError(f"OpenCL device ({spec!r}) does not exist; devices: {have}") from None
    devices = [d for p in platforms for d in p.get_devices()]
    if not devices:
        raise RuntimeError("no OpenCL device found (pip install 'convforge[opencl]' for a CPU one: PoCL)")
    gpus = [d for d in devices if d.type & cl.device_type.GPU]
    refused = []
    for dev in gpus + [d for d in devices if d not in gpus]:
        why = build_refusal(dev)
        if why is None:
            return dev
        refused.append(f"{dev.platform.name.strip()} / {dev.name.strip()}: {why}")
    raise RuntimeError("no OpenCL device builds a kernel (" + "; ".join(refused) + "). " + _HINT)


class BufferTooLarge(ValueError):
    """One buffer larger than the device allocates at once (CL_DEVICE_MAX_MEM_ALLOC_SIZE)."""


# PoCL compiles a kernel once more for each launch shape it meets, when the launch runs: specialised
# for the work-group size, a zero global offset and whether every global size is below this
# ("smallgrid"; PoCL 3's CPU devices). A warm-up launch that matches those compiles what the run will use.
_POCL_SMALL_GRID = 65536


def _warm_launch(step: Launch) -> Launch:
    """``step`` with as few work-groups as keep PoCL's specialisation: one, or in each dimension
    whose global size reaches :data:`_POCL_SMALL_GRID` as many as reach it (never more than the
    launch had, so every group run is one of the real launch's and stays inside its buffers)."""
    globals_ = [g * b for g, b in zip(step.grid, step.block)]
    if max(globals_) < _POCL_SMALL_GRID:
        return replace(step, grid=(1, 1, 1))
    g0, g1, g2 = (-(-_POCL_SMALL_GRID // b) if g * b >= _POCL_SMALL_GRID else 1 for g, b in zip(step.grid, step.block))
    return replace(step, grid=(g0, g1, g2))


class OpenCLBackend(Backend):
    name = "opencl"

    def __init__(self, device: str | None = None, *, cl_device: cl.Device | None = None) -> None:
        super().__init__()
        self.cl_device = cl_device or _pick(config.opencl_device if device is None else device)
        self.ctx = cl.Context([self.cl_device])
        self.queue = cl.CommandQueue(
            self.ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
        d = self.cl_device
        is_gpu = bool(d.type & cl.device_type.GPU)
        self.device = DeviceInfo(
            backend="opencl", name=d.name.strip(), driver=d.driver_version,
            platform=d.platform.name + " " + d.platform.version,
            max_threads=d.max_work_group_size, shared_bytes=d.local_mem_size,
            shared_optin_bytes=d.local_mem_size, const_bytes=d.max_constant_buffer_size,
            warp=32 if is_gpu else 1, units=d.max_compute_units, is_gpu=is_gpu)
        # PoCL caches what it compiles by source on its own (POCL_CACHE_DIR), and handing out a binary
        # makes it compile every kernel once more for an unknown work-group size: on PoCL, asking for
        # binaries doubled the cold compile time of the test suite and saved nothing.
        self.keeps_binaries = "portable computing language" not in d.platform.name.lower()

    # -- compiler ---------------------------------------------------------------------------
    def compile_options(self) -> list[str]:
        return list(_OPTIONS)

    def compiler_version(self) -> str:
        return self.cl_device.platform.version + "|" + self.cl_device.version

    def build(self, source: str) -> tuple[Any, bytes | None]:
        try:
            prog = cl.Program(self.ctx, source).build(options=_OPTIONS)
        except cl.RuntimeError as err:
            raise CompileError(f"OpenCL build failed on {self.device.name}:\n{err}") from None
        if not self.keeps_binaries:
            return prog, None
        binaries = prog.get_info(cl.program_info.BINARIES)
        return prog, (bytes(binaries[0]) if binaries and binaries[0] else None)

    def _compile_all(self, todo: list[Work], workers: int, phase: Any) -> int:
        """On PoCL: its share built in a context of this process and the rest in ``workers - 1``
        worker processes (PoCL runs one LLVM compile at a time per process, whatever the contexts
        or threads), each launching every kernel once with :func:`_warm_launch` on scratch buffers,
        so PoCL's on-disk kernel cache (POCL_CACHE_DIR, shared by the processes) holds every
        program and work-group function the run's context then loads instead of compiling them one
        by one. Work warmed before (a marker in convforge's disk cache) is skipped. Other drivers:
        threads over one context, as every back-end."""
        if self.keeps_binaries or os.environ.get("POCL_KERNEL_CACHE", "1") == "0":
            return super()._compile_all(todo, workers, phase)
        pending = []
        for w in todo:
            if self.disk.has(self._warm_key(w)):
                phase.advance()
            else:
                pending.append(w)
        n = max(1, min(workers, len(pending)))
        shares: list[list[Work]] = [[] for _ in range(n)]
        loads = [0] * n
        for w in sorted(pending, key=lambda w: -len(w.source)):  # longest first, each to the least loaded
            i = loads.index(min(loads))  # share (a program's length stands for its compile time)
            shares[i].append(w)
            loads[i] += len(w.source)
        readers = [self._warm_in_process(share, phase) for share in shares[1:]]
        side = OpenCLBackend(cl_device=self.cl_device)
        for w in shares[0]:
            try:
                side._warm(w)
                self.disk.put(self._warm_key(w), b"")
            except Exception as err:  # noqa: BLE001 - its first use compiles it again and reports it
                log.debug("convforge: warming a PoCL program failed (%s)", err)
            phase.advance()
        for t in readers:
            t.join()
        return len(pending)

    def _workers_text(self, n: int) -> str:
        if self.keeps_binaries or os.environ.get("POCL_KERNEL_CACHE", "1") == "0":
            return super()._workers_text(n)
        return f"{n} process{'es' if n > 1 else ''}"

    def _warm_in_process(self, works: list[Work], phase: Any) -> threading.Thread:
        """Warm ``works`` in a new Python process on this device (:func:`warm_worker`); a thread
        that follows its progress (the phase, the disk markers) until it ends. A worker that cannot
        start or fails leaves its programs to their first use, which compiles and reports them."""
        import pickle
        import subprocess
        import sys

        where = _device_index(self.cl_device)
        cmd = [sys.executable, "-c", "from convforge.backends.opencl import warm_worker; warm_worker()", where]
        env = {**os.environ, "CONVFORGE_CACHE_DIR": str(config.cache_dir)}

        def follow() -> None:
            done = 0
            try:
                with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      env=env) as proc:
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(pickle.dumps(works))
                    proc.stdin.close()
                    for line in proc.stdout:
                        ok, _, index = line.decode().strip().partition(" ")
                        if ok == "ok" and index.isdigit() and int(index) < len(works):
                            self.disk.put(self._warm_key(works[int(index)]), b"")
                        done += 1
                        phase.advance()
            except OSError as err:
                log.debug("convforge: a PoCL warming process failed to run (%s)", err)
            if done < len(works):
                phase.advance(len(works) - done)

        t = threading.Thread(target=follow, name="convforge-compile-process")
        t.start()
        return t

    def _warm_key(self, w: Work) -> str:
        """Disk-cache key of "PoCL's cache holds ``w``'s program and the launch shapes it runs"."""
        shapes = sorted({(s.kernel, s.block, max(g * b for g, b in zip(s.grid, s.block)) < _POCL_SMALL_GRID)
                         for s in w.launches})
        return cache_key("pocl-warm", w.source, repr(shapes), " ".join(self.compile_options()),
                         self.compiler_version(), self.device.name, self.device.driver, __version__,
                         os.environ.get("POCL_CACHE_DIR", ""))

    def _warm(self, w: Work) -> None:
        """Build ``w``'s program in this context and run each launch once, shrunk (:func:`_warm_launch`)."""
        program = self.program(w.source)
        kernels = {k.name: k for k in w.kernels}
        sizes = dict(w.sizes)
        bufs: dict[str, Any] = {}
        for step in w.launches:
            kernel = kernels[step.kernel]
            values = iter(step.args)
            args: list[Any] = []
            for a in kernel.args:
                if isinstance(a, LocalBuf):
                    continue
                ref = next(values)
                if isinstance(a, Scalar):
                    args.append(ref)
                else:
                    name = str(ref)
                    if name not in bufs:  # zeros: a kernel that reads indices from a buffer (resize's tables)
                        nbytes = max(sizes[name], 4)  # reads element 0, never a garbage address
                        bufs[name] = self.empty(nbytes)  # KeyError above: not warmed
                        self.fill(bufs[name], 0.0, nbytes)
                    args.append(bufs[name])
            self.launch(program, self.function(program, kernel), kernel, _warm_launch(step), args)
        self.queue.finish()

    def load_binary(self, blob: bytes) -> Any | None:
        try:
            return cl.Program(self.ctx, [self.cl_device], [blob]).build(options=_OPTIONS)
        except cl.Error:
            return None

    def function(self, program: Any, kernel: Kernel) -> Any:
        fn = cl.Kernel(program, kernel.name)
        dtypes: list[Any] = []
        for a in kernel.args:
            if isinstance(a, Scalar):
                dtypes.append(np.float32 if a.ctype == "float" else np.int32)
            else:
                dtypes.append(None)
        fn.set_scalar_arg_dtypes(dtypes)
        return fn

    # -- memory -----------------------------------------------------------------------------
    def empty(self, nbytes: int) -> Any:
        limit = int(self.cl_device.max_mem_alloc_size)
        if nbytes > limit:
            raise BufferTooLarge(f"a buffer of {nbytes} bytes ({nbytes / 2**20:.0f} MiB) is larger than "
                                 f"{self.device.name} allows in one buffer, {limit} bytes ({limit / 2**20:.0f} "
                                 "MiB, CL_DEVICE_MAX_MEM_ALLOC_SIZE): use a smaller batch or input size")
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, size=max(nbytes, 4))

    def upload(self, array: np.ndarray) -> Any:
        arr = np.ascontiguousarray(array, dtype=host_dtype(array))
        buf = self.empty(arr.nbytes)
        cl.enqueue_copy(self.queue, buf, arr)
        return buf

    def download(self, buf: Any, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
        out = np.empty(shape, dtype=storage_dtype(dtype))
        cl.enqueue_copy(self.queue, out, buf)
        return from_storage(out, dtype)

    def write(self, buf: Any, array: np.ndarray) -> None:
        cl.enqueue_copy(self.queue, buf, np.ascontiguousarray(array, dtype=host_dtype(array)))

    def nbytes(self, buf: Any) -> int:
        return int(buf.size)

    def fill(self, buf: Any, value: float, nbytes: int, dtype: str = "float32") -> None:
        pattern = to_storage(np.array([value], np.float32), dtype)
        cl.enqueue_fill_buffer(self.queue, buf, pattern, 0, nbytes // pattern.itemsize * pattern.itemsize)

    # -- execution --------------------------------------------------------------------------
    def launch(self, program: Any, fn: Any, kernel: Kernel, step: Launch, args: list[Any]) -> None:
        full: list[Any] = []
        it = iter(args)
        for a in kernel.args:
            full.append(cl.LocalMemory(a.nbytes) if isinstance(a, LocalBuf) else next(it))
        gsize = tuple(g * b for g, b in zip(step.grid, step.block))
        fn(self.queue, gsize, step.block, *full)

    def synchronize(self) -> None:
        self.queue.finish()

    def time_ms(self, fn: Callable[[], None], repeats: int) -> list[float]:
        # Queued back to back and waited for once, like the CUDA back-end.
        marks = []
        for _ in range(repeats):
            start = cl.enqueue_marker(self.queue)
            fn()
            marks.append((start, cl.enqueue_marker(self.queue)))
        marks[-1][1].wait()
        return [(end.profile.end - start.profile.start) * 1e-6 for start, end in marks]


__all__ = ["BufferTooLarge", "OpenCLBackend", "build_refusal", "list_devices", "refusal_of"]
