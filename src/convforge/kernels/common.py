"""Metacode shared by the families: the output (and bias) arguments of a plan, and the prologue's; and the
host side of the training kernels' ``host_run`` (tests, the OpenCL path)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from convforge.codegen.dialect import FLOAT32, Arg, Buf, Kernel, Storage
from convforge.plan import Epilogue, Launch, Prologue
from convforge.spec import ConvSpec


def out_args(epi: Epilogue, storage: Storage = FLOAT32) -> tuple[Arg, ...]:
    """The output argument, followed by bias when the epilogue adds one (all stored as ``storage``)."""
    return ((storage.buf("y", readonly=False),) + ((storage.buf("bias"),) if epi.bias else ())
            + ((storage.buf("res"),) if epi.residual else ()))


def out_refs(epi: Epilogue) -> tuple[str, ...]:
    return ("y",) + (("bias",) if epi.bias else ()) + (("res",) if epi.residual else ())


def pro_args(pro: Prologue) -> tuple[Arg, ...]:
    """The prologue's per-channel scale and shift arguments (when it is affine)."""
    return tuple(Buf(name) for name in pro.buffers())


def pro_channel(spec: ConvSpec, c: str, group: str = "bz") -> str:
    """The input channel of a grouped layer's channel ``c`` within group ``group`` (the prologue
    reads its per-channel scale and shift at it)."""
    return c if spec.groups == 1 else f"({group} * {spec.cg} + {c})"


class ThreadWindow:
    """The input window one thread of a tile reads: ``rows`` x ``seg`` for its ``tp`` x ``tq`` outputs
    (mixed into tile dataclasses that have ``spec``, ``tp`` and ``tq``)."""

    spec: ConvSpec
    tp: int
    tq: int

    @property
    def seg(self) -> int:
        """Input columns one thread reads per row."""
        return (self.tq - 1) * self.spec.stride[1] + self.spec.eff_s

    @property
    def rows(self) -> int:
        """Input rows one thread reads."""
        return (self.tp - 1) * self.spec.stride[0] + self.spec.eff_r


def poisoned(backend: Any, count: int, dtype: str) -> Any:
    """A buffer of ``count`` elements of ``dtype`` on ``backend``, NaN throughout: an output a test reads back
    must have been written."""
    from convforge.dtypes import storage_dtype

    nbytes = count * storage_dtype(dtype).itemsize
    buf = backend.empty(nbytes)
    backend.fill(buf, float("nan"), nbytes, dtype)
    return buf


def launch_all(backend: Any, program: Any, kernels: Iterable[Kernel], launches: Iterable[Launch],
               bufs: dict[str, Any]) -> None:
    """Run ``launches`` of ``program`` in order on ``backend``, buffers by name, then wait for them."""
    by_name = {k.name: k for k in kernels}
    for step in launches:
        kernel = by_name[step.kernel]
        backend.launch(program, backend.function(program, kernel), kernel, step, [bufs[str(a)] for a in step.args])
    backend.synchronize()
