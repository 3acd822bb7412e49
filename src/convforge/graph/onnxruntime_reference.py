"""onnxruntime's FP32 answer for an ONNX model file: the second error bar of a calibrated ONNX network
(``convforge.graph.network_calibration``). An ONNX user measures a runtime against onnxruntime, so a
network read from ONNX keeps its error within the budget times the smaller of PyTorch FP32's and
onnxruntime's (CPU execution provider, FP32: its MLAS kernels are plain FP32 sums). onnxruntime is
imported inside the functions; without it the bar is PyTorch's alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def available() -> str | None:
    """None when onnxruntime can be imported, else why not."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as err:
        return f"onnxruntime is not installed ({err})"
    return None


def outputs(model: Any, x: np.ndarray, names: list[str]) -> tuple[dict[str, np.ndarray] | None, str]:
    """(onnxruntime's CPU FP32 values of the tensors ``names`` for the NCHW batch ``x``, "") or (None,
    why not). ``model``: an .onnx path or a ModelProto. A tensor that is not a graph output is added
    as one (a softmax's logits); a model of a fixed batch runs in chunks of that batch, the last one
    padded with zeros."""
    import onnx
    import onnxruntime as ort

    proto = onnx.load(str(model)) if isinstance(model, (str, Path)) else model
    have = {o.name for o in proto.graph.output}
    known = have | {t for n in proto.graph.node for t in n.output}
    missing = [t for t in names if t not in known]
    if missing:
        return None, f"tensors {missing} are not in the ONNX graph (renamed by the passes)"
    if not set(names) <= have:
        proto = onnx.ModelProto.FromString(proto.SerializeToString())
        for t in names:
            if t not in have:
                proto.graph.output.append(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    fixed = inp.shape[0] if isinstance(inp.shape[0], int) and inp.shape[0] > 0 else len(x)
    parts: list[list[np.ndarray]] = []
    for s in range(0, len(x), fixed):
        chunk = x[s:s + fixed]
        if len(chunk) < fixed:
            chunk = np.concatenate([chunk, np.zeros((fixed - len(chunk),) + x.shape[1:], x.dtype)])
        parts.append(sess.run(names, {inp.name: np.ascontiguousarray(chunk, dtype=np.float32)}))
    return {t: np.concatenate([p[i] for p in parts])[:len(x)] for i, t in enumerate(names)}, ""
