"""Malformed models are refused at load time with an error naming the node (or file and line).

Only the front-ends and graph construction run here (no kernels), so these tests are fast.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from convforge.graph import runtime
from convforge.graph.runtime import compile, load_model

onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install 'convforge[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

W = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)


def _model(*nodes, inits: dict[str, np.ndarray] | None = None, dims: tuple = (1, 3, 8, 8), out: str = "y"):
    """A tiny opset-13 model: input x of ``dims``, then ``nodes``, output ``out``."""
    tensors = [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()]
    graph = helper.make_graph(list(nodes), "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], tensors)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _conv(out: str = "c", **attrs):
    return helper.make_node("Conv", ["x", "W"], [out], name="conv", pads=[1, 1, 1, 1], **attrs)


# -- load_model / compile arguments -------------------------------------------------------------------

@pytest.fixture
def no_network(monkeypatch) -> list:
    """compile() up to the Network, which records its graph instead of building kernels."""
    made: list = []
    monkeypatch.setattr(runtime, "Network", lambda graph, backend, **kw: made.append((graph, kw)) or graph)
    return made


def test_weights_are_refused_for_onnx(tmp_path, no_network) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(_model(_conv(), out="c", inits={"W": W}).SerializeToString())
    with pytest.raises(ValueError, match=r"weights \('junk.bin'\) are for prototxt nets .* ONNX model carries"):
        load_model(str(path), weights="junk.bin")
    with pytest.raises(ValueError, match="weights"):
        compile(str(path), backend="opencl", weights="junk.bin")
    with pytest.raises(ValueError, match="a Graph has its own weights"):
        load_model(load_model(str(path)), weights="junk.bin")


def test_compile_arguments(no_network) -> None:
    model = _model(_conv(), out="c", inits={"W": W})
    compile(model, batch=np.int64(2), backend="opencl", workspace_limit=np.float64(1e6))
    graph, kw = no_network[-1]
    assert graph.input_shape == (2, 3, 8, 8) and type(graph.input_shape[0]) is int
    assert kw["workspace_limit"] == 1_000_000
    for bad in (math.nan, math.inf, -1, True, "1"):
        with pytest.raises(ValueError, match=r"workspace_limit .* must be a finite number >= 0"):
            compile(model, backend="opencl", workspace_limit=bad)
    for bad in (True, 2.0, 0):
        with pytest.raises(ValueError, match=r"batch .* must be a positive int"):
            compile(model, batch=bad, backend="opencl")
