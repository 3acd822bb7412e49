"""What every back-end provides, and the executor that runs a Plan on any of them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from convforge import __version__
from convforge.backends.cache import DiskCache, cache_key
from convforge.codegen.dialect import ConstBuf, Kernel, LocalBuf, Scalar
from convforge.config import config
from convforge.plan import DeviceInfo, Fill, Gemm, Launch, Plan


class CompileError(RuntimeError):
    """A generated source did not compile; the message holds the compiler log."""


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
        key = cache_key(source, " ".join(self.compile_options()), self.compiler_version(),
                        self.device.name, self.device.driver, __version__)
        prog = self._programs.get(key)
        if prog is None:
            blob = self.disk.get(key)
            prog = self.load_binary(blob) if blob is not None else None
            if prog is None:
                prog, blob = self.build(source)
                if blob:
                    self.disk.put(key, blob)
            self._programs[key] = prog
        return prog

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
    def upload(self, array: np.ndarray) -> Any: ...

    @abstractmethod
    def download(self, buf: Any, shape: tuple[int, ...]) -> np.ndarray: ...

    @abstractmethod
    def fill(self, buf: Any, value: float, nbytes: int) -> None: ...

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

    def executable(self, plan: Plan) -> Executable:
        return Executable(self, plan)


class Executable:
    """A Plan compiled for one back-end: call it with a dict of buffers."""

    def __init__(self, backend: Backend, plan: Plan) -> None:
        self.backend, self.plan = backend, plan
        self.program = backend.program(plan.source(backend.name))
        self.kernels = {k.name: k for k in plan.kernels}
        self.functions = {k.name: backend.function(self.program, k) for k in plan.kernels}
        self._workspace: dict[str, Any] | None = None

    def workspace(self) -> dict[str, Any]:
        """Workspace buffers, allocated once per executable."""
        if self._workspace is None:
            self._workspace = {name: self.backend.empty(max(nbytes, 4))
                               for name, nbytes in self.plan.workspace}
        return self._workspace

    def sizes(self) -> dict[str, int]:
        s = self.plan.spec
        out = {"x": 4 * s.n * s.c * s.h * s.w, "w": 4 * s.k * s.c * s.r * s.s,
               "y": 4 * s.n * s.k * s.p * s.q, "bias": 4 * s.k}
        out.update(dict(self.plan.workspace))
        return out

    def __call__(self, buffers: dict[str, Any]) -> None:
        bufs = {**self.workspace(), **buffers}
        sizes = self.sizes()
        for step in self.plan.steps:
            if isinstance(step, Fill):
                self.backend.fill(bufs[step.buffer], step.value, sizes[step.buffer])
                continue
            if isinstance(step, Gemm):
                self.backend.gemm(step, bufs[step.a], bufs[step.b], bufs[step.c])
                continue
            kernel = self.kernels[step.kernel]
            args = []
            for spec_arg, ref in zip(self._value_args(kernel), step.args, strict=True):
                if isinstance(spec_arg, Scalar):
                    dtype = np.float32 if spec_arg.ctype == "float" else np.int32
                    args.append(dtype(ref))
                else:
                    args.append(bufs[str(ref)])
            self.backend.launch(self.program, self.functions[step.kernel], kernel, step, args)

    @staticmethod
    def _value_args(kernel: Kernel) -> list[Any]:
        """Kernel arguments that a Launch supplies (shared buffers are supplied by the back-end)."""
        return [a for a in kernel.args if not isinstance(a, LocalBuf)]


def const_args(kernel: Kernel, args: list[Any]) -> list[tuple[ConstBuf, Any]]:
    """Pairs of constant-memory parameter and the buffer bound to it."""
    vals = [a for a in kernel.args if not isinstance(a, LocalBuf)]
    return [(a, v) for a, v in zip(vals, args) if isinstance(a, ConstBuf)]
