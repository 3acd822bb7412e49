"""What every back-end provides, and the executor that runs a Plan on any of them."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from convforge.backends.cache import DiskCache, cache_key
from convforge.codegen.dialect import Buf, Kernel, LocalBuf, Scalar
from convforge.config import config
from convforge.plan import DeviceInfo, Fill, Gemm, Launch, Plan, Step
from convforge.progress import Phase
from convforge.version import __version__

log = logging.getLogger("convforge")


class CompileError(RuntimeError):
    """A generated source did not compile; the message holds the compiler log."""


class DeviceMemoryError(MemoryError):
    """Device memory for a variant's workspace or output could not be had: names what was asked
    for and what the device had free, so the user can pick a smaller algorithm or batch."""

    def __init__(self, what: str, asked: int, free: int) -> None:
        super().__init__(f"{what}: asked for {asked} bytes of device memory, {free} bytes free")
        self.asked, self.free = asked, free


# The buffers a conv Plan is called with (``res``: the residual added in the epilogue, shaped like
# ``y``, named only by plans whose Epilogue has one); everything else a step names is workspace.
CONV_BUFFERS = ("x", "w", "y", "bias", "res")
# The per-input-channel scale and shift a plan with an affine Prologue reads (float32, C each).
PROLOGUE_BUFFERS = ("pscale", "pshift")


def step_buffers(step: Step, kernel: Kernel | None) -> tuple[set[str], set[str]]:
    """(buffers read, buffers written) by one step, by name."""
    if isinstance(step, Fill):
        return set(), {step.buffer}
    if isinstance(step, Gemm):
        return {step.a, step.b}, {step.c}
    assert kernel is not None
    reads: set[str] = set()
    writes: set[str] = set()
    args = [a for a in kernel.args if not isinstance(a, LocalBuf)]
    for arg, ref in zip(args, step.args, strict=True):
        if isinstance(arg, Scalar):
            continue
        (writes if isinstance(arg, Buf) and not arg.readonly else reads).add(str(ref))
    return reads, writes


def output_buffer(plan: Plan) -> str:
    """The conv buffer a plan writes: ``spec.output`` for a pass's plan (y, x or w), "bias" for a
    bias-gradient plan (the one conv buffer among x, w, y, bias that some step writes)."""
    kernels = {k.name: k for k in plan.kernels}
    written: set[str] = set()
    for step in plan.steps:
        written |= step_buffers(step, kernels.get(step.kernel) if isinstance(step, Launch) else None)[1]
    mine = [name for name in CONV_BUFFERS[:4] if name in written]
    return mine[0] if len(mine) == 1 else plan.spec.output


def weight_steps(plan: Plan) -> tuple[frozenset[int], tuple[str, ...]]:
    """Which steps depend on the filters alone (filter transforms, packed weights, constant
    tables), and the workspace buffers only they write ("derived" buffers).

    A step qualifies when it reads only ``w`` or derived buffers, never touches x, y, bias or res,
    and writes only workspace that no other step writes. Their results depend on the weights
    alone, so a caller that keeps them per weight tensor (convforge.torch.Conv2d) runs them only
    when the weights change. Fixed point: a buffer also written elsewhere disqualifies its
    writers, and then every step reading it.
    """
    kernels = {k.name: k for k in plan.kernels}
    io = [step_buffers(s, kernels.get(s.kernel) if isinstance(s, Launch) else None) for s in plan.steps]
    work = {name for name, _ in plan.workspace}
    cand = {i for i, (r, w) in enumerate(io)
            if isinstance(plan.steps[i], Launch) and w and w <= work and not (r & {"x", "y", "bias", "res"})}
    while True:
        derived = set().union(*(io[i][1] for i in cand)) if cand else set()
        derived -= set().union(*(io[i][1] for i in range(len(io)) if i not in cand)) if io else set()
        keep = {i for i in cand if io[i][1] <= derived and io[i][0] <= derived | {"w"}}
        if keep == cand:
            return frozenset(cand), tuple(sorted(derived))
        cand = keep


@dataclass(frozen=True)
class Work:
    """A program to compile before its first use (:meth:`Backend.compile_ahead`), with one run's
    launches and the bytes of every buffer they name, for back-ends that compile each kernel again
    for the launch shape it meets (PoCL)."""

    source: str
    kernels: tuple[Kernel, ...]
    launches: tuple[Launch, ...] = ()
    sizes: tuple[tuple[str, int], ...] = ()


def plan_work(plan: Plan, backend: str, sizes: dict[str, int] | None = None) -> Work:
    """The :class:`Work` of a Plan on ``backend``: its source, its launches, its buffers' sizes
    (``sizes``: the bytes of the buffers a caller binds, where they are larger than the plan's
    own: a concat written in place)."""
    s = plan.spec
    own = {**{name: s.itemsize * int(np.prod(s.shape_of(name))) for name in CONV_BUFFERS},
           **{name: 4 * s.c for name in plan.prologue.buffers()}, **dict(plan.workspace)}
    if plan.epilogue.k_total:  # the output is the concat's whole tensor
        own["y"] = own["y"] // s.k * max(s.k, plan.epilogue.k_total)
    for name, nbytes in (sizes or {}).items():
        own[name] = max(own.get(name, 0), nbytes)
    launches = tuple(step for step in plan.steps if isinstance(step, Launch))
    return Work(plan_source(plan, backend), tuple(plan.kernels), launches, tuple(own.items()))


_SOURCES: dict[tuple[Plan, str], str] = {}  # plan_source's memory (plans are frozen, hashable values)
_SOURCES_KEPT = 256


def plan_source(plan: Plan, backend: str) -> str:
    """``plan.source(backend)``, remembered for the last plans rendered: a program compiled ahead
    (:meth:`Backend.compile_ahead`) and the executable made for it later render it once."""
    key = (plan, backend)
    src = _SOURCES.get(key)
    if src is None:
        if len(_SOURCES) >= _SOURCES_KEPT:
            _SOURCES.clear()
        src = _SOURCES[key] = plan.source(backend)
    return src


_DEFER = threading.local()


class CompileDeferred(BaseException):
    """Raised by :meth:`Backend.program`, inside :func:`deferring_compiles`, for a program no cache
    holds: the caller compiles it later with others, on several threads. A BaseException, so the
    ``except Exception`` of a layer's set-up (which would record "convforge does not run this
    layer") lets it through to the caller that asked for deferral."""

    def __init__(self, backend: Backend, source: str) -> None:
        super().__init__("compile deferred")
        self.backend, self.source = backend, source


@contextmanager
def deferring_compiles() -> Iterator[None]:
    """In this thread, :meth:`Backend.program` raises :class:`CompileDeferred` instead of compiling
    a program that is in no cache (memory or disk); loading a cached one goes on as usual."""
    _DEFER.on = True
    try:
        yield
    finally:
        _DEFER.on = False


def compile_workers() -> int:
    """Threads that compile at once: the CPUs this process may use, at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 4
    return max(1, min(16, cpus))


class Backend(ABC):
    """Compiler, program, allocator and device for one vendor API."""

    name: str = ""
    device: DeviceInfo

    def __init__(self) -> None:
        self._programs: dict[str, Any] = {}
        self.disk = DiskCache(config.cache_dir / "programs", config.disk_cache)

    # -- compiler ---------------------------------------------------------------------------
    def program(self, source: str) -> Any:
        """Compiled program for ``source``, from memory, disk, or the compiler, in that order."""
        key = self._key(source)
        prog = self._programs.get(key)
        if prog is None:
            blob = self.disk.get(key)
            prog = self.load_binary(blob) if blob is not None else None
            if prog is None:
                if getattr(_DEFER, "on", False):
                    raise CompileDeferred(self, source)
                prog, blob = self.build(source)
                if blob:
                    self.disk.put(key, blob)
            self._programs[key] = prog
        return prog

    def program_key(self, source: str) -> str:
        """The key :meth:`program` files ``source``'s compiled program under in the disk cache."""
        return self._key(source)

    def _key(self, source: str) -> str:
        return cache_key(source, " ".join(self.compile_options()), self.compiler_version(),
                         self.device.name, self.device.driver, __version__)

    def compile_ahead(self, work: Sequence[Work], what: str = "kernels", workers: int | None = None) -> int:
        """Compile the programs of ``work`` that are not compiled yet, ``workers`` (default:
        :func:`compile_workers`) at a time, so the first run finds them built; reported as a
        :class:`~convforge.progress.Phase` ("compiling ``what``"). A program that fails to compile is
        left for its first use to report. Returns how many programs were compiled here (not found
        in a cache)."""
        todo = self._pending(work)
        if not todo:
            return 0
        n = max(1, min(workers or compile_workers(), len(todo)))
        with Phase(f"compiling {what} ({self._workers_text(n)})", len(todo), "programs") as phase:
            return self._compile_all(todo, n, phase)

    def _workers_text(self, n: int) -> str:
        """How :meth:`_compile_all` spreads the work, for the phase's line ("4 threads")."""
        return f"{n} thread{'s' if n > 1 else ''}"

    def _pending(self, work: Sequence[Work]) -> list[Work]:
        """The distinct programs of ``work`` this back-end has not compiled in this process."""
        seen: dict[str, Work] = {}
        for w in work:
            if w.source not in seen and self._key(w.source) not in self._programs:
                seen[w.source] = w
        return list(seen.values())

    def _compile_all(self, todo: list[Work], workers: int, phase: Phase) -> int:
        """Compile ``todo`` on ``workers`` threads (the compilers, NVRTC through CuPy and an OpenCL
        driver's through PyOpenCL, release the GIL while they work); how many were compiled."""
        def one(w: Work) -> bool:
            try:
                cached = self.disk.has(self._key(w.source))
                self.program(w.source)
            except Exception as err:  # noqa: BLE001 - its first use compiles it again and reports it
                log.debug("convforge: compiling ahead failed (%s); the first use reports it", err)
                cached = True
            phase.advance()
            return not cached

        with ThreadPoolExecutor(workers, thread_name_prefix="convforge-compile") as pool:
            return sum(pool.map(one, todo))

    @abstractmethod
    def compile_options(self) -> list[str]: ...

    @abstractmethod
    def compiler_version(self) -> str: ...

    @abstractmethod
    def build(self, source: str) -> tuple[Any, bytes | None]:
        """Compile; return the program and a binary worth caching (or None)."""

    @abstractmethod
    def load_binary(self, blob: bytes) -> Any | None:
        """Program from a cached binary, or None if the binary is unusable."""

    @abstractmethod
    def function(self, program: Any, kernel: Kernel) -> Any: ...

    # -- memory -----------------------------------------------------------------------------
    @abstractmethod
    def empty(self, nbytes: int) -> Any: ...

    @abstractmethod
    def upload(self, array: np.ndarray) -> Any:
        """A new device buffer holding ``array``: float16 and uint16 (bfloat16 bits) arrays as they
        are, anything else as float32."""

    @abstractmethod
    def download(self, buf: Any, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
        """The first prod(shape) elements of ``buf``, stored as ``dtype``, as a float32 array."""

    def write(self, buf: Any, array: np.ndarray) -> None:
        """Copy a host array into the start of an existing buffer: float16 and uint16 (bfloat16
        bits) as they are, anything else as float32."""
        raise NotImplementedError(f"the {self.name} back-end cannot write into a buffer")

    @abstractmethod
    def fill(self, buf: Any, value: float, nbytes: int, dtype: str = "float32") -> None:
        """Set the first ``nbytes`` of ``buf`` to ``value`` stored as ``dtype``."""

    @abstractmethod
    def nbytes(self, buf: Any) -> int:
        """Size of a device buffer in bytes."""

    # -- execution --------------------------------------------------------------------------
    @abstractmethod
    def launch(self, program: Any, fn: Any, kernel: Kernel, step: Launch, args: list[Any]) -> None: ...

    def gemm(self, step: Gemm, a: Any, b: Any, c: Any) -> None:
        """Run a library GEMM step on buffers a, b, c (only back-ends with a BLAS provide it)."""
        raise NotImplementedError(f"the {self.name} back-end has no library GEMM")

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def time_ms(self, fn: Callable[[], None], repeats: int) -> list[float]:
        """Device-event time of each of ``repeats`` calls of ``fn`` (warm-up is the caller's)."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """A replayable recording of ``fn``'s launches (CUDA: a CUDA graph); by default ``fn`` itself,
        enqueued in order each time (OpenCL)."""
        return fn

    def executable(self, plan: Plan) -> Executable:
        return Executable(self, plan)


class Executable:
    """A Plan compiled for one back-end: call it with a dict of buffers.

    Everything that does not depend on the buffers (argument order, scalar conversion, sizes,
    workspace) is worked out once here, so a call does little more than the launches.
    """

    def __init__(self, backend: Backend, plan: Plan) -> None:
        self.backend, self.plan = backend, plan
        self.program = backend.program(plan_source(plan, backend.name))
        self.kernels = {k.name: k for k in plan.kernels}
        self.functions = {k.name: backend.function(self.program, k) for k in plan.kernels}
        self._workspace: dict[str, Any] | None = None  # every workspace buffer (workspace())
        self._own: dict[str, Any] = {}  # those allocated for calls that supplied the others
        s = plan.spec
        self._sizes = {**{name: s.itemsize * int(np.prod(s.shape_of(name))) for name in CONV_BUFFERS},
                       **{name: 4 * s.c for name in plan.prologue.buffers()}, **dict(plan.workspace)}
        self._steps = [self._prepare(step) for step in plan.steps]
        self.weight_steps, self.derived = weight_steps(plan)
        self.derived_offsets, self.derived_bytes = _packed(self.derived, dict(plan.workspace))

    def _prepare(self, step: Step) -> tuple[Any, ...]:
        if isinstance(step, Fill):
            return ("fill", step.buffer, step.value, self._sizes[step.buffer])
        if isinstance(step, Gemm):
            return ("gemm", step)
        kernel = self.kernels[step.kernel]
        template: list[tuple[str | None, Any]] = []
        for spec_arg, ref in zip(self._value_args(kernel), step.args, strict=True):
            if isinstance(spec_arg, Scalar):
                dtype = np.float32 if spec_arg.ctype == "float" else np.int32
                template.append((None, dtype(ref)))
            else:
                template.append((str(ref), None))
        return ("launch", kernel, step, self.functions[step.kernel], template)

    def workspace(self) -> dict[str, Any]:
        """Every workspace buffer, in plan order, allocated once per executable."""
        if self._workspace is None:
            self._workspace = {name: self._own[name] if name in self._own else self.backend.empty(max(nbytes, 4))
                               for name, nbytes in self.plan.workspace}
        return self._workspace

    def _unsupplied(self, buffers: dict[str, Any]) -> dict[str, Any]:
        """The workspace a call does not supply, allocated on first need: a caller that brings
        its own (a network's shared arena, per-layer filter transforms) costs no dead copies."""
        if self._workspace is not None:
            return self._workspace
        for name, nbytes in self.plan.workspace:
            if name not in buffers and name not in self._own:
                self._own[name] = self.backend.empty(max(nbytes, 4))
        return self._own

    @property
    def own_bytes(self) -> int:
        """Bytes of workspace this executable holds itself."""
        held = self._workspace if self._workspace is not None else self._own
        return sum(self.backend.nbytes(b) for b in held.values())

    def sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    def check_buffers(self, buffers: dict[str, Any]) -> None:
        """Refuse a bound buffer smaller than its named array (n:c:y:x, k:c:r:s, n:k:p:q, k)."""
        dims = {"x": "n:c:y:x", "w": "k:c:r:s", "y": "n:k:p:q", "bias": "k", "res": "n:k:p:q"}
        for name, layout in dims.items():
            buf = buffers.get(name)
            if buf is not None and self.backend.nbytes(buf) < self._sizes[name]:
                raise ValueError(f"{name} ({layout}) needs {self._sizes[name]} bytes for "
                                 f"{self.plan.spec.short()}, the buffer bound holds {self.backend.nbytes(buf)}")

    def __call__(self, buffers: dict[str, Any], steps: str = "all") -> None:
        """Run the plan on named buffers. ``steps``: "all"; "weights" (only the filter-dependent
        steps, :func:`weight_steps`); "rest" (the others: the caller passes the derived buffers
        its "weights" run filled)."""
        self.check_buffers(buffers)
        bufs = {**self._unsupplied(buffers), **buffers}
        for i, item in enumerate(self._steps):
            if steps != "all" and (i in self.weight_steps) != (steps == "weights"):
                continue
            if item[0] == "fill":
                self.backend.fill(bufs[item[1]], item[2], item[3])
            elif item[0] == "gemm":
                step = item[1]
                self.backend.gemm(step, bufs[step.a], bufs[step.b], bufs[step.c])
            else:
                _, kernel, step, fn, template = item
                args = [val if name is None else bufs[name] for name, val in template]
                self.backend.launch(self.program, fn, kernel, step, args)

    def call(self, buffers: dict[str, Any]) -> None:
        """One whole call on named buffers by the path a user's ``conv2d`` takes on this back-end
        (the bench times this): here the dict path; CUDA's raw-pointer fast path where it has one."""
        self(buffers)

    @staticmethod
    def _value_args(kernel: Kernel) -> list[Any]:
        """Kernel arguments that a Launch supplies (shared buffers are supplied by the back-end)."""
        return [a for a in kernel.args if not isinstance(a, LocalBuf)]


def _packed(names: tuple[str, ...], sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Byte offsets of ``names`` packed into one buffer, each 256-byte aligned, and its size."""
    offsets, total = {}, 0
    for name in names:
        offsets[name] = total
        total += (max(sizes[name], 4) + 255) // 256 * 256
    return offsets, total


class FilterCache:
    """The filter-derived workspace (Winograd U, packed GEMM weights, constant tables: what an
    executable's "weights" steps write) per weight tensor, for device calls with torch tensors.

    An entry is filed under the weight's device address and remembers the tensor (weakly), its
    version counter (``_version``, bumped by every in-place update: optimizer steps,
    ``load_state_dict``, ``copy_``/``mul_`` under no_grad) and the packed buffer. :meth:`get`
    answers the buffer when the address and the version match and the remembered tensor is alive
    and still at that address (``w.data = ...`` moves a tensor without a version bump); otherwise
    it re-runs the transform, into the SAME buffer when the address had one (a CUDA graph that
    captured it keeps a valid pointer and sees the new filters), and files it again. An entry goes
    when its tensor is freed, so a new tensor at a reused address never meets stale filters.
    Misses answer None (the caller runs the whole plan) for inference tensors (no version
    counter), objects without ``_version`` (CuPy arrays: the transform stays per call), and while
    the stream captures a CUDA graph (a transform recorded, not run, must not be remembered).
    Not caught: writes through ``w.data`` (a separate version counter), as for autograd itself.
    The transform runs on the stream of the call that misses; calls on other streams must be
    ordered after it, as for any tensor made on another stream.

    ``transform(w, out) -> packed`` runs the "weights" steps into ``out`` (None: a new buffer);
    ``capturing() -> bool`` says whether the current stream captures a graph.
    """

    __slots__ = ("_entries", "_transform", "_capturing")

    def __init__(self, transform: Callable[[Any, Any], Any], capturing: Callable[[], bool]) -> None:
        self._entries: dict[int, tuple[Any, int, Any]] = {}
        self._transform, self._capturing = transform, capturing

    def get(self, w: Any, address: int) -> Any:
        """The packed filter-derived buffer for weights ``w`` at ``address``, or None."""
        try:
            version = w._version
        except (RuntimeError, AttributeError):  # inference tensors, arrays without a version counter
            return None
        entry = self._entries.get(address)
        if entry is not None and entry[1] == version:
            owner = entry[0]()
            if owner is w or (owner is not None and owner.data_ptr() == address):  # still that memory
                return entry[2]
        return self._miss(w, address, version, entry)

    def _miss(self, w: Any, address: int, version: int, entry: tuple[Any, int, Any] | None) -> Any:
        if self._capturing():
            return None
        try:
            ref = weakref.ref(w, self._dropper(address))
        except TypeError:  # not weakly referable: nothing tells when the address is reused
            return None
        packed = self._transform(w, None if entry is None else entry[2])
        self._entries[address] = (ref, version, packed)
        return packed

    def _dropper(self, address: int) -> Callable[[Any], None]:
        entries = self._entries

        def drop(ref: Any) -> None:
            entry = entries.get(address)
            if entry is not None and entry[0] is ref:
                del entries[address]

        return drop

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, w: Any, address: int) -> tuple[int, Any] | None:
        """(version, packed buffer) filed for ``w`` itself at ``address``, or None: what another
        cache of the same executable (the native fast path's) may start from."""
        entry = self._entries.get(address)
        if entry is None or entry[0]() is not w:
            return None
        return entry[1], entry[2]
