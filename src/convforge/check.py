"""Checking a Plan: fresh random inputs (a residual too when its epilogue adds one), NaN-poisoned
output and workspace, relative L2 error against the float64 reference, and a count of outputs the
kernels never wrote."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convforge.backends.base import Backend, Executable
from convforge.plan import Plan
from convforge.reference import conv2d_ref, rel_l2
from convforge.spec import ConvSpec


@dataclass(frozen=True)
class CheckResult:
    rel_err: float
    unwritten: int
    total: int
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.unwritten == 0 and bool(np.isfinite(self.rel_err)) and self.rel_err <= self.tolerance

    def __str__(self) -> str:
        state = "ok" if self.ok else "FAIL"
        extra = f", {self.unwritten}/{self.total} outputs never written" if self.unwritten else ""
        return f"{state}: rel L2 {self.rel_err:.2e} (tol {self.tolerance:.0e}){extra}"


def random_inputs(spec: ConvSpec, rng: np.random.Generator,
                  bias: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Uniform(-1, 1) input and weights (never zeros), and bias when asked."""
    x = rng.uniform(-1, 1, spec.x_shape).astype(np.float32)
    w = rng.uniform(-1, 1, spec.w_shape).astype(np.float32)
    b = rng.uniform(-1, 1, (spec.k,)).astype(np.float32) if bias else None
    return x, w, b


def check_plan(plan: Plan, backend: Backend, seed: int | None = None,
               exe: Executable | None = None, batch_slice: int | None = None) -> CheckResult:
    """Run ``plan`` once on fresh random data and compare with the float64 reference.

    ``batch_slice`` compares only the first images of the batch (for big layers).
    """
    spec = plan.spec
    rng = np.random.default_rng(seed)
    x, w, b = random_inputs(spec, rng, plan.epilogue.bias)
    exe = exe or backend.executable(plan)
    for buf, (_, nbytes) in zip(exe.workspace().values(), plan.workspace):
        backend.fill(buf, float("nan"), nbytes)
    bufs = {"x": backend.upload(x), "w": backend.upload(w),
            "y": backend.upload(np.full(spec.y_shape, np.nan, dtype=np.float32))}
    if b is not None:
        bufs["bias"] = backend.upload(b)
    res = rng.uniform(-1, 1, spec.y_shape).astype(np.float32) if plan.epilogue.residual else None
    if res is not None:
        bufs["res"] = backend.upload(res)
    exe(bufs)
    backend.synchronize()
    out = backend.download(bufs["y"], spec.y_shape)
    n = spec.n if batch_slice is None else min(batch_slice, spec.n)
    sub = ConvSpec(n, spec.c, spec.h, spec.w, spec.k, spec.r, spec.s, spec.stride, spec.pad,
                   spec.dilation)
    if res is None:
        ref = conv2d_ref(x[:n], w, sub, b, plan.epilogue.relu)
    else:  # the skip connection is added before the ReLU
        ref = conv2d_ref(x[:n], w, sub, b) + res[:n]
        ref = np.maximum(ref, 0.0) if plan.epilogue.relu else ref
    got = out[:n]
    return CheckResult(rel_l2(got, ref), int(np.isnan(got).sum()), got.size, plan.tolerance)
