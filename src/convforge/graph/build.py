"""From a model to a running :class:`~convforge.graph.runtime.Network`: :func:`load_model` reads any network
front-end (a shipped name, Caffe prototxt, ONNX, a torch module), :func:`compile` runs the graph passes, builds
the network and calibrates it against an error budget (``network_calibration``). This module sits above the
runtime, the passes and the calibration, which never import it."""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

from convforge.graph.ir import Graph
from convforge.graph.runtime import Network
from convforge.spec import parse_dtype


def load_model(model: Any, input_size: int | None = None, seed: int = 0,
               weights: str | Path | None = None) -> Graph:
    """A Graph from a Graph, a shipped model name, a .prototxt or .onnx path (or an ONNX
    ModelProto), or a torch module. ``weights`` (a .caffemodel) only go with prototxt nets and
    shipped models: an ONNX file carries its own, a Graph or module holds them already."""
    from convforge import models

    text = str(model) if isinstance(model, (str, Path)) else ""
    if text.endswith((".onnx", ".prototxt")) and not Path(text).is_file():
        raise ValueError(f"model ({text!r}): no such file (a shipped model is one of {', '.join(models.NAMES)})")
    is_onnx = text.endswith(".onnx") or type(model).__name__ == "ModelProto"
    if weights is not None and (is_onnx or not isinstance(model, (str, Path))):
        what = ("an ONNX model carries its own initializers" if is_onnx
                else f"a {type(model).__name__} has its own weights")
        raise ValueError(f"weights ({str(weights)!r}) are for prototxt nets and shipped models only: {what}")
    if is_onnx:
        from convforge.graph.from_onnx import load_onnx

        return load_onnx(model, input_size=input_size)
    if isinstance(model, Graph):
        return model
    if isinstance(model, (str, Path)):
        if text in models.NAMES:
            from convforge.graph.caffe import load_shipped

            return load_shipped(text, seed=seed, input_size=input_size, weights=weights)
        if text.endswith(".prototxt"):
            from convforge.graph.caffe import load_prototxt

            return load_prototxt(Path(text), weights=weights, seed=seed, input_size=input_size)
        raise ValueError(f"model ({text!r}) must be one of {', '.join(models.NAMES)}, a .prototxt or an .onnx file")
    if type(model).__module__.split(".")[0] == "torch" or hasattr(model, "forward"):
        from convforge.graph.fx import from_module

        if input_size is None:
            raise ValueError("a torch module needs input_size (and its input channels come from the first conv)")
        return from_module(model, input_size=input_size)
    raise ValueError(f"model of type {type(model).__name__} is not a Graph, a name, a path, "
                     "an ONNX ModelProto or a torch module")


def compile(model: Any, batch: int | None = None, backend: str | None = None, *, input_size: int | None = None,
            passes: bool = True, seed: int = 0, weights: str | Path | None = None,
            capture: bool = True, workspace_limit: int | None = None, dtype: Any = "float32",
            error_budget: float | None = 2.0) -> Network:
    """A :class:`Network` for ``model`` at ``batch`` (default: the batch its description declares,
    1 for the shipped nets and a symbolic ONNX batch) on ``backend`` ('cuda' or 'opencl'; default CUDA
    when present). ``passes`` runs the graph passes (BN folding, fusion, identity removal).
    ``dtype`` ('float32', 'float16' / 'fp16', 'bfloat16' / 'bf16'): how activations and conv
    weights are stored (FP32 arithmetic).
    ``workspace_limit`` (bytes): the most workspace (scratch and filter transforms) any conv may
    use; the layers share one scratch arena of the largest need (``Network._bind_workspaces``).
    ``error_budget`` (default 2): calibrate at build so the output error stays within that many
    times PyTorch FP32's (a plain float32 evaluation's, without torch; for an ONNX model the smaller of
    that and onnxruntime's where it is installed), tightening the layers that
    need it (``convforge.graph.network_calibration``; the report is ``network.calibration``); 0 or None: no
    calibration, every layer keeps the precision class's choice. Half-precision networks are not
    calibrated (their storage rounding is far above FP32's error)."""
    from convforge.api import default_backend
    from convforge.backends import get_backend
    from convforge.graph.passes import optimize

    if batch is not None and (not isinstance(batch, numbers.Integral) or isinstance(batch, bool) or batch < 1):
        raise ValueError(f"batch ({batch!r}) must be a positive int")
    if workspace_limit is not None and (not isinstance(workspace_limit, numbers.Real) or isinstance(
            workspace_limit, bool) or not math.isfinite(workspace_limit) or workspace_limit < 0):
        raise ValueError(f"workspace_limit ({workspace_limit!r}) must be a finite number >= 0 (bytes)")
    budget = check_budget(error_budget)
    graph = load_model(model, input_size, seed, weights)
    graph = graph.with_batch(graph.input_shape[0] if batch is None else int(batch))
    if passes:
        graph = optimize(graph)
    be = get_backend(backend or default_backend())
    limit = None if workspace_limit is None else int(workspace_limit)
    dt = parse_dtype(dtype)
    if budget is None or dt != "float32":  # the budget is relative to FP32's error: float32 networks only
        return Network(graph, be, capture=capture, workspace_limit=limit, dtype=dt)
    from convforge.graph.network_calibration import calibrate_network

    onnx_model = model if type(model).__name__ == "ModelProto" or (
        isinstance(model, (str, Path)) and str(model).endswith(".onnx")) else None
    cal = calibrate_network(graph, be, budget=budget, seed=seed, workspace_limit=limit, onnx_model=onnx_model)
    net = cal.network if cal.network.graph.outputs == graph.outputs else \
        Network(graph, be, capture=False, workspace_limit=limit, max_errors=cal.max_errors)
    if capture:
        net.capture()
    net.calibration = cal.report
    return net


def check_budget(value: Any, name: str = "error_budget") -> float | None:
    """An error budget as a float, None for 0 / None (no calibration); ValueError naming ``name``
    otherwise."""
    if value is None or (not isinstance(value, bool) and isinstance(value, numbers.Real) and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        raise ValueError(f"{name} ({value!r}) must be a finite number > 0, or 0 / None for no calibration")
    return float(value)
