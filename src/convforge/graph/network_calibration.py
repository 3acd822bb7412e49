"""Calibration of compiled networks: ``convforge.error_budget``'s rule (the one shared with
``convforge.torch.calibrate``) on a :class:`~convforge.graph.runtime.Network`.

``convforge.compile(..., error_budget=2)`` and ``convforge run --error-budget 2`` (both the
default) keep a network's output error within ``budget`` x the error PyTorch FP32 gives (TF32 in
the relaxed class), as ``convforge.torch.calibrate`` does for PyTorch models. On a CUDA run where
torch sees the GPU that reference is PyTorch itself (the same graph through torch.nn.functional,
cudnn.benchmark on; ``reference="auto"``). Otherwise (OpenCL, no torch, ``convforge run --no-torch``)
it is the error of a plain float32 evaluation of the same graph (``run_reference(...,
dtype=np.float32)``: every conv and fully connected layer a float32 sum of products through BLAS,
every op's output rounded to float32; in the relaxed class with TF32 operands), the stand-in for
what PyTorch FP32 gives. Errors are relative L2 against the float64 executor over the first
``CAL_IMAGES`` (4) images of a random batch drawn with ``seed`` + 2 (``CAL_SEED_OFFSET``), never the
input a run reports on; a softmax output is compared through its logits (softmax flattens errors).
A network read from ONNX (``onnx_model``) is held to the smaller of that error and onnxruntime's
(CPU, FP32) where onnxruntime is installed, the runtime an ONNX user compares with (fp32 class).
One image's error ratio to PyTorch's moves by up to 2x between inputs (same layers), so the estimate
the rule steers by averages several.

A probe builds the network with the candidates tightened (``Network(max_errors=...)``: dispatch
then chooses those layers under ``max_error=tight``) and runs it once; the network of the final
setting is the one returned (captured into a CUDA graph where the caller wants one). Costs: the
float64 and float32 references of those images, one forward of the fast network, and per probe a
build (programs come from the compile caches after their first use) and a forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from convforge.config import config
from convforge.error_budget import TIGHT, CalibrationReport, Candidate, calibrate_layers, check_settings
from convforge.graph.ir import Graph, conv_spec
from convforge.graph.reference import run_reference
from convforge.graph.runtime import Network
from convforge.reference import rel_l2

CAL_SEED_OFFSET = 2  # the calibration input's seed: the reported input's seed + 2 (bench's rule)
CAL_IMAGES = 4  # images of the calibration batch the errors are measured over (fewer when the batch is smaller)
DEFAULT_BUDGET = 2.0


@dataclass
class Calibrated:
    """A calibration's answer: the network of the final setting (built on ``graph``), the per-node
    bounds it was built with, the report, and the seconds spent (references apart)."""

    network: Network
    max_errors: dict[str, float]
    report: CalibrationReport
    seconds: float
    reference_seconds: float


def targets(graph: Graph) -> list[str]:
    """The tensors calibration compares: the graph's outputs, a softmax output replaced by its input."""
    out = []
    for t in graph.outputs:
        prod = graph.producer(t)
        out.append(prod.inputs[0] if prod is not None and prod.op == "softmax" else t)
    return list(dict.fromkeys(out))


def calibration_input(graph: Graph, seed: int) -> np.ndarray:
    """Standard normal NCHW float32 batch of the graph's input shape, drawn with ``seed`` + 2."""
    return np.random.default_rng(seed + CAL_SEED_OFFSET).standard_normal(graph.input_shape).astype(np.float32)


def calibrate_network(graph: Graph, backend: Any, *, budget: float = DEFAULT_BUDGET, tight: float = TIGHT,
                      headroom: float = 0.95, seed: int = 0, workspace_limit: int | None = None,
                      fast: Network | None = None, reference: str = "auto", onnx_model: Any = None) -> Calibrated:
    """Calibrate the network of ``graph`` (after the passes) on ``backend`` (module docstring).
    ``fast``: that network already built with no bounds (its outputs must include the targets), to
    save a build. ``reference``: "auto" (PyTorch where it can run, else the float32 stand-in) or
    "float32" (the stand-in). ``onnx_model``: the ONNX file (or ModelProto) ``graph`` was read
    from: where onnxruntime is installed the bar is the smaller of that reference's error and
    onnxruntime's (``onnxruntime_reference``). The returned network's outputs are ``graph``'s and
    the targets."""
    check_settings(budget, tight, headroom)
    if reference not in ("auto", "float32"):
        raise ValueError(f"calibrate: reference ({reference!r}) must be 'auto' or 'float32'")
    t0 = time.perf_counter()
    want_t = targets(graph)
    cal = graph.copy()
    cal.outputs = list(dict.fromkeys(graph.outputs + want_t))
    x = calibration_input(cal, seed)
    k = min(CAL_IMAGES, len(x))
    want = _flat(run_reference(cal.with_batch(k), x[:k]), want_t)
    relaxed = config.precision == "relaxed"
    got, what = reference_outputs(cal, x, backend, relaxed, reference, images=k)
    err_ref = rel_l2(_flat(got, want_t), want)
    if onnx_model is not None and not relaxed:  # onnxruntime's is an FP32 bar
        err_ref, what = _onnxruntime_bar(onnx_model, x[:k], want_t, want, err_ref, what)
    t_ref = time.perf_counter() - t0
    if fast is None or not set(want_t) <= set(fast.graph.outputs):
        fast = Network(cal, backend, capture=False, workspace_limit=workspace_limit)
    nets: dict[frozenset[str], Network] = {frozenset(): fast}

    def error_of(net: Network) -> float:
        return rel_l2(_flat({t: v[:k] for t, v in net(x).items()}, want_t), want)

    err0 = error_of(fast)
    cands, skipped = candidates(fast, tight)

    def error_with(paths: frozenset[str]) -> float:
        nets.clear()  # free the probe before building the next (device memory)
        nets[paths] = Network(cal, backend, capture=False, workspace_limit=workspace_limit,
                              max_errors={p: tight for p in paths})
        return error_of(nets[paths])

    report = calibrate_layers(cands, error_with, error_before=err0, err_reference=err_ref, budget=budget,
                              tight=tight, headroom=headroom, skipped=skipped, reference=what)
    chosen = frozenset(c.path for c in report.tightened)
    net = nets.get(chosen)
    if net is None:  # the final setting's network was freed (cannot happen with the rule's last probe)
        net = Network(cal, backend, capture=False, workspace_limit=workspace_limit,
                      max_errors={p: tight for p in chosen})
    return Calibrated(net, {p: tight for p in chosen}, report, time.perf_counter() - t0, t_ref)


def _onnxruntime_bar(model: Any, x: np.ndarray, names: list[str], want: np.ndarray, err_ref: float,
                     what: str) -> tuple[float, str]:
    """(the smaller of ``err_ref`` and onnxruntime's error on ``x``, whose it is) where onnxruntime
    runs the model; else (``err_ref``, ``what`` with the reason onnxruntime's was not measured)."""
    from convforge.graph import onnxruntime_reference as ortref

    why = ortref.available()
    got = None
    if why is None:
        got, why = ortref.outputs(model, x, names)
    if got is None:
        return err_ref, f"{what}; onnxruntime's not measured: {why}"
    err = rel_l2(_flat(got, names), want)
    if err < err_ref:
        return err, f"onnxruntime (CPU, FP32), below {what}'s {err_ref:.2e}"
    return err_ref, f"{what}, below onnxruntime's (CPU, FP32) {err:.2e}"


def reference_outputs(graph: Graph, x: np.ndarray, backend: Any, relaxed: bool,
                      reference: str = "auto", images: int = 1) -> tuple[dict[str, np.ndarray], str]:
    """(the first ``images`` images' outputs of the reference computation, what it is): PyTorch FP32
    (TF32 when ``relaxed``) on the whole batch ``x`` where ``reference`` is "auto", the back-end CUDA
    and torch sees the GPU; else the plain float32 evaluation of those images (module docstring)."""
    if reference == "auto" and backend.name == "cuda":
        from convforge.graph import torch_reference

        if torch_reference.available() is None:
            out = torch_reference.outputs(graph, x, tf32=relaxed)
            return {t: v[:images] for t, v in out.items()}, "PyTorch TF32" if relaxed else "PyTorch FP32"
    what = "PyTorch TF32's stand-in: a float32 evaluation with TF32 products" if relaxed else \
        "PyTorch FP32's stand-in: a plain float32 evaluation"
    return run_reference(graph.with_batch(images), x[:images], dtype=np.float32, tf32=relaxed), what


def candidates(net: Network, tight: float) -> tuple[list[Candidate], dict[str, str]]:
    """The conv / fc nodes whose choice under ``max_error=tight`` differs from their own, and why
    the others that might move are not candidates (no variant states ``tight`` on the layer)."""
    out: list[Candidate] = []
    skipped: dict[str, str] = {}
    for node in net.graph.nodes:
        if node.op not in ("conv", "fc"):
            continue
        spec = conv_spec(node, net.shapes[node.inputs[0]])
        fast = net.choice(node)
        try:
            acc = net.choice(node, max_error=tight)
        except ValueError as err:
            skipped[node.name] = f"no variant states max_error={tight:g} on this layer ({err})"
            continue
        if (fast.variant.name, fast.params) == (acc.variant.name, acc.params):
            continue
        out.append(Candidate(node.name, fast.variant.name, _error(fast, spec), acc.variant.name, _error(acc, spec),
                             spec.flops, fast.error is not None))
    return out, skipped


def _error(choice: Any, spec: Any) -> float:
    return float(choice.error if choice.error is not None else choice.variant.expected_error(spec))


def _flat(outputs: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(outputs[t], np.float64).reshape(-1) for t in names])
