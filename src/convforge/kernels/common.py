"""Metacode shared by the families: the output (and bias) arguments of a plan."""

from __future__ import annotations

from convforge.codegen.dialect import Arg, Buf
from convforge.plan import Epilogue


def out_args(epi: Epilogue) -> tuple[Arg, ...]:
    """The output argument, followed by bias when the epilogue adds one."""
    return ((Buf("y", readonly=False),) + ((Buf("bias"),) if epi.bias else ())
            + ((Buf("res"),) if epi.residual else ()))


def out_refs(epi: Epilogue) -> tuple[str, ...]:
    return ("y",) + (("bias",) if epi.bias else ()) + (("res",) if epi.residual else ())
