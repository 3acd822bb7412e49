"""Metacode shared by the families: the output (and bias) arguments of a plan."""

from __future__ import annotations

from convforge.codegen.dialect import FLOAT32, Arg, Storage
from convforge.plan import Epilogue


def out_args(epi: Epilogue, storage: Storage = FLOAT32) -> tuple[Arg, ...]:
    """The output argument, followed by bias when the epilogue adds one (all stored as ``storage``)."""
    return ((storage.buf("y", readonly=False),) + ((storage.buf("bias"),) if epi.bias else ())
            + ((storage.buf("res"),) if epi.residual else ()))


def out_refs(epi: Epilogue) -> tuple[str, ...]:
    return ("y",) + (("bias",) if epi.bias else ()) + (("res",) if epi.residual else ())
