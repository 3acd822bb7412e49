"""Metacode shared by the families: the output (and bias) arguments of a plan, and the prologue's."""

from __future__ import annotations

from convforge.codegen.dialect import FLOAT32, Arg, Buf, Storage
from convforge.plan import Epilogue, Prologue
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
