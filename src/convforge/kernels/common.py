"""Metacode shared by the families: standard arguments, array descriptors, guarded stores."""

from __future__ import annotations

from convforge.arrays import ArrayDesc
from convforge.codegen.dialect import Arg, Buf
from convforge.plan import Epilogue
from convforge.spec import ConvSpec


def io_arrays(spec: ConvSpec) -> tuple[ArrayDesc, ArrayDesc, ArrayDesc]:
    """Named descriptors of input ``n:c:y:x``, filters ``k:c:r:s`` and output ``n:k:p:q``."""
    return (ArrayDesc.of("x", "n:c:y:x", spec.x_shape),
            ArrayDesc.of("w", "k:c:r:s", spec.w_shape),
            ArrayDesc.of("y", "n:k:p:q", spec.y_shape))


def out_args(epi: Epilogue) -> tuple[Arg, ...]:
    """The output argument, followed by bias when the epilogue adds one."""
    return (Buf("y", readonly=False),) + ((Buf("bias"),) if epi.bias else ())


def out_refs(epi: Epilogue) -> tuple[str, ...]:
    return ("y",) + (("bias",) if epi.bias else ())


def pow2_upto(limit: int, start: int = 1) -> list[int]:
    out, v = [], start
    while v <= limit:
        out.append(v)
        v *= 2
    return out
