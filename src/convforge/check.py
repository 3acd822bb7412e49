"""Checking a Plan of any pass and dtype: fresh random inputs (a residual too when its epilogue adds
one, the per-channel scale and shift when its prologue has them), NaN-poisoned output and workspace,
relative L2 error against the float64 reference (on the activated input when the plan has a
prologue), and a count of outputs the kernels never wrote."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from convforge.backends.base import Backend, Executable
from convforge.dtypes import rounded, to_storage
from convforge.plan import Epilogue, Plan, Prologue
from convforge.reference import activate_ref, pass_ref, rel_l2
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
    """Uniform(-1, 1) input and weights (never zeros), and bias when asked, as float32 arrays
    holding values of ``spec.dtype``."""
    x = rounded(rng.uniform(-1, 1, spec.x_shape).astype(np.float32), spec.dtype)
    w = rounded(rng.uniform(-1, 1, spec.w_shape).astype(np.float32), spec.dtype)
    b = rounded(rng.uniform(-1, 1, (spec.k,)).astype(np.float32), spec.dtype) if bias else None
    return x, w, b


def pass_inputs(spec: ConvSpec, rng: np.random.Generator, epilogue: Epilogue = Epilogue(),
                prologue: Prologue = Prologue()) -> dict[str, np.ndarray]:
    """Fresh Uniform(-1, 1) inputs of ``spec``'s pass by buffer name (float32 arrays holding values
    of ``spec.dtype``): fprop x, w (bias, res as its epilogue asks; the prologue's pscale, drawn
    from +-[0.5, 1.5] (a batch norm's scale may be negative), and pshift, Uniform(-0.5, 0.5), as
    an affine prologue asks); dgrad y (dy) and w (res shaped as dx where the epilogue adds one); wgrad x, y."""
    names = {"fprop": ["x", "w"], "dgrad": ["y", "w"], "wgrad": ["x", "y"]}[spec.conv_pass]
    if spec.conv_pass == "fprop":
        names += (["bias"] if epilogue.bias else []) + (["res"] if epilogue.residual else [])
    elif spec.conv_pass == "dgrad" and epilogue.residual:
        names.append("res")
    out = {name: rounded(rng.uniform(-1, 1, spec.shape_of(name)).astype(np.float32), spec.dtype)
           for name in names}
    if spec.conv_pass == "fprop" and prologue.affine:
        scale = rng.uniform(0.5, 1.5, spec.c) * rng.choice([-1.0, 1.0], spec.c)
        out["pscale"] = scale.astype(np.float32)
        out["pshift"] = rng.uniform(-0.5, 0.5, spec.c).astype(np.float32)
    return out


def expected(spec: ConvSpec, inputs: dict[str, np.ndarray], epilogue: Epilogue = Epilogue(),
             n: int | None = None, prologue: Prologue = Prologue()) -> np.ndarray:
    """The float64 answer of ``spec``'s pass on ``inputs`` with ``epilogue`` (the residual is added
    before the ReLU; to dgrad's dx) and ``prologue`` (fprop on the activated input, padding zero); ``n`` limits an
    fprop or dgrad answer to the first images (big layers)."""
    if n is not None and n < spec.n and spec.conv_pass != "wgrad":
        sub = spec.with_batch(n)
        inputs = {k: (v[:n] if k in ("x", "y", "res") else v) for k, v in inputs.items()}
        spec = sub
    if spec.conv_pass == "fprop" and prologue.active:
        inputs = {**inputs, "x": activate_ref(inputs["x"], inputs.get("pscale"), inputs.get("pshift"),
                                              prologue.relu)}
    out = pass_ref(spec, inputs)
    if spec.conv_pass == "dgrad" and "res" in inputs:  # a training block's two gradients of one input
        out = out + inputs["res"]
    if spec.conv_pass == "fprop":
        if "res" in inputs:
            out = out + inputs["res"]
        if epilogue.relu:
            out = np.maximum(out, 0.0)
        if epilogue.gelu:
            out = gelu_ref(out)
        if epilogue.silu:
            out = silu_ref(out)
        if epilogue.hardswish:
            out = hardswish_ref(out)
        if epilogue.mish:
            out = mish_ref(out)
    return out


def gelu_ref(a: np.ndarray) -> np.ndarray:
    """The exact GELU, x * Phi(x) = x/2 * (1 + erf(x / sqrt 2)), in float64 (NaN stays NaN)."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * a * (1.0 + erf(np.asarray(a, np.float64) / math.sqrt(2.0)))


def sigmoid_ref(a: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-a)) in float64 (0 and 1 at the extremes, without overflow warnings)."""
    a = np.asarray(a, np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-a))


def silu_ref(a: np.ndarray) -> np.ndarray:
    """SiLU (Swish), a * sigmoid(a), in float64 (NaN stays NaN)."""
    return np.asarray(a, np.float64) * sigmoid_ref(a)


def hardswish_ref(a: np.ndarray) -> np.ndarray:
    """HardSwish, a * min(max(a + 3, 0), 6) / 6, in float64 (NaN stays NaN)."""
    a = np.asarray(a, np.float64)
    return a * np.clip(a + 3.0, 0.0, 6.0) / 6.0


def mish_ref(a: np.ndarray) -> np.ndarray:
    """Mish, a * tanh(softplus(a)) = a * tanh(log1p(exp(a))), in float64 (NaN stays NaN; a large a gives
    a, without overflow warnings)."""
    a = np.asarray(a, np.float64)
    with np.errstate(over="ignore"):
        return a * np.tanh(np.log1p(np.exp(a)))


_ACTIVATIONS = ("x", "y", "res")  # the buffers a layout rearranges (filters stay KCRS)


def stored_shape(spec: ConvSpec, name: str) -> tuple[int, ...]:
    """The shape of buffer ``name`` in memory: NHWC order for activations of an nhwc spec."""
    shape = spec.shape_of(name)
    if spec.layout == "nhwc" and name in _ACTIVATIONS:
        return (shape[0], shape[2], shape[3], shape[1])
    return shape


def in_layout(spec: ConvSpec, name: str, a: np.ndarray) -> np.ndarray:
    """A logical (N, C, H, W) array as buffer ``name`` of ``spec`` holds it in memory."""
    if spec.layout == "nhwc" and name in _ACTIVATIONS:
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1))
    return a


def from_layout(spec: ConvSpec, name: str, a: np.ndarray) -> np.ndarray:
    """Buffer ``name`` as read from memory (``stored_shape``) back in logical (N, C, H, W) order."""
    if spec.layout == "nhwc" and name in _ACTIVATIONS:
        return np.ascontiguousarray(a.transpose(0, 3, 1, 2))
    return a


def check_plan(plan: Plan, backend: Backend, seed: int | None = None,
               exe: Executable | None = None, batch_slice: int | None = None) -> CheckResult:
    """Run ``plan`` once on fresh random data and compare with the float64 reference.

    Every pass: the output buffer (``spec.output``) and the workspace are poisoned with NaN first.
    ``batch_slice`` compares only the first images of the batch (big fprop and dgrad layers).
    """
    spec = plan.spec
    inputs = pass_inputs(spec, np.random.default_rng(seed), plan.epilogue, plan.prologue)
    exe = exe or backend.executable(plan)
    for buf, (_, nbytes) in zip(exe.workspace().values(), plan.workspace):
        backend.fill(buf, float("nan"), nbytes)
    bufs = {name: backend.upload(a if name in ("pscale", "pshift")
                                 else to_storage(in_layout(spec, name, a), spec.dtype))
            for name, a in inputs.items()}
    shape = spec.shape_of(spec.output)
    bufs[spec.output] = backend.upload(to_storage(np.full(shape, np.nan, np.float32), spec.dtype))
    exe(bufs)
    backend.synchronize()
    out = from_layout(spec, spec.output, backend.download(bufs[spec.output], stored_shape(spec, spec.output),
                                                          spec.dtype))
    n = spec.n if batch_slice is None or spec.conv_pass == "wgrad" else min(batch_slice, spec.n)
    got = out if spec.conv_pass == "wgrad" else out[:n]
    ref = expected(spec, inputs, plan.epilogue, n, plan.prologue)
    return CheckResult(rel_l2(got, ref), int(np.isnan(got).sum()), got.size, plan.tolerance)
