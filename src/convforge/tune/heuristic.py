"""Choices without measuring: Boda's rule (most specialised applicable variant, default parameters)
and the cheap resource model that prunes a tuning space before anything is compiled."""

from __future__ import annotations

import re
from collections.abc import Sequence

from convforge import kernels
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Plan, Variant
from convforge.spec import ConvSpec

MAX_REGISTERS = 255  # per thread on every NVIDIA architecture since Kepler
NO_EPILOGUE = Epilogue()
_SHARED_DECL = re.compile(r"SHARED\s+float\s+\w+\s*\[(\d+)\]")
_FLOAT_DECL = re.compile(r"\bfloat\d?\s+(\w+)\s*[=;]")


def applicable(spec: ConvSpec, device: DeviceInfo, workspace_limit: int | None = None,
               variants: Sequence[Variant] | None = None) -> list[Variant]:
    """Variants that run ``spec`` on ``device`` within the workspace limit, most specialised first
    (:func:`convforge.kernels.ranked`)."""
    return kernels.ranked("auto", spec, device, workspace_limit, variants)


def heuristic_choice(spec: ConvSpec, device: DeviceInfo, workspace_limit: int | None = None,
                     variants: Sequence[Variant] | None = None) -> tuple[Variant, Params]:
    """Boda's rule for ``auto`` (:func:`convforge.kernels.most_specialised`)."""
    return kernels.most_specialised("auto", spec, device, workspace_limit, variants=variants)


def shared_bytes(plan: Plan) -> int:
    """Largest shared memory of any kernel: launch-sized buffer plus static SHARED float arrays."""
    most = 0
    for k in plan.kernels:
        lb = k.local_buf()
        static = sum(4 * int(m.group(1)) for m in _SHARED_DECL.finditer(k.body))
        most = max(most, (lb.nbytes if lb else 0) + static)
    return most


def estimated_registers(plan: Plan) -> int:
    """Accumulators + loads: distinct scalar float names declared in the largest kernel body.

    Names in disjoint scopes share registers, so this over-counts; ptxas decides the real figure.
    """
    return max((len(set(_FLOAT_DECL.findall(k.body))) for k in plan.kernels), default=0)


def prune_reason(plan: Plan, device: DeviceInfo, variant: Variant | None = None) -> str | None:
    """Why ``plan`` cannot be worth compiling on ``device`` (None when it passes the cheap model).

    A variant may supply ``registers(spec, params) -> int`` (accumulators + loads per thread);
    otherwise declared names are counted and only a count far past the limit prunes.
    """
    threads = max((k.threads for k in plan.kernels), default=0)
    if threads > device.max_threads:
        return f"{threads} threads per block > device maximum {device.max_threads}"
    smem = shared_bytes(plan)
    if smem > max(device.shared_bytes, device.shared_optin_bytes):
        return f"{smem} B shared memory > {device.shared_optin_bytes} B"
    if device.backend != "cuda":
        return None
    model = getattr(variant, "registers", None)
    if callable(model):
        regs, limit = int(model(plan.spec, plan.params)), MAX_REGISTERS
    else:
        regs, limit = estimated_registers(plan), int(1.5 * MAX_REGISTERS)
    if regs > limit:
        return f"about {regs} registers per thread > {limit}"
    return None


def epilogue_key(epi: Epilogue) -> str:
    """The epilogue as stored in the database: 'none', 'bias', 'relu' or 'bias_relu'."""
    return epi.tag().lstrip("_") or "none"
