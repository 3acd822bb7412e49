"""Malformed models are refused at load time with an error naming the node (or file and line).

Only the front-ends and graph construction run here (no kernels), so these tests are fast.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from convforge.graph import build
from convforge.graph.build import compile, load_model
from convforge.graph.caffe import load_prototxt
from convforge.graph.ir import GraphError, infer, pool_out
from convforge.graph.prototxt import PrototxtError
from convforge.graph.reference import run_reference

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


# -- ONNX files and nodes -------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["missing.onnx", "nets/missing.prototxt"])
def test_a_model_file_that_is_not_there_is_named(tmp_path, path) -> None:
    """A missing .onnx / .prototxt is one ValueError naming the path (not an OSError from deep in
    the loader), listing the shipped models in case a name was meant."""
    with pytest.raises(ValueError, match=r"model \('.*missing\.(onnx|prototxt)'\): no such file .*resnet50"):
        load_model(str(tmp_path / path))


def test_onnx_file_that_is_not_a_model(tmp_path) -> None:
    junk, empty = tmp_path / "junk.onnx", tmp_path / "empty.onnx"
    junk.write_bytes(np.random.default_rng(1).bytes(2000))
    empty.write_bytes(b"")
    with pytest.raises(GraphError, match=r"junk\.onnx is not an ONNX model"):
        load_model(str(junk))
    with pytest.raises(GraphError, match=r"empty\.onnx holds no ONNX model"):
        load_model(str(empty))


@pytest.mark.parametrize("node, inits, match", [
    (helper.make_node("Conv", ["x"], ["y"], name="c"), {}, r"node 'c' \(Conv\): inputs \(\['x'\]\) must number 2 to 3"),
    (helper.make_node("Conv", ["x", ""], ["y"], name="c"), {}, r"node 'c' \(Conv\): input 1 is empty"),
    (helper.make_node("MaxPool", ["x"], ["y"], name="mp"), {},
     r"node 'mp' \(MaxPool\): attribute 'kernel_shape' is missing"),
    (helper.make_node("LRN", ["x"], ["y"], name="n"), {}, r"node 'n' \(LRN\): attribute 'size' is missing"),
    (helper.make_node("Conv", ["x", "W"], ["y"], name="c", pads=[1] * 6), {"W": W},
     r"node 'c' \(Conv\): pads \(\[1, 1, 1, 1, 1, 1\]\) must be 4 ints"),
    (helper.make_node("Conv", ["x", "W"], ["y"], name="c", strides=[2]), {"W": W}, r"node 'c' \(Conv\): strides"),
    (helper.make_node("Conv", ["x", "W"], ["y"], name="c"), {"W": W[0]}, r"node 'c' \(Conv\): W .* expected 4-D"),
    (helper.make_node("BatchNormalization", ["x", "g", "b"], ["y"], name="bn"),
     {"g": np.ones(3, np.float32), "b": np.zeros(3, np.float32)},
     r"node 'bn' \(BatchNormalization\): inputs .* must number 5"),
    (helper.make_node("Gemm", ["x", "B"], ["y"], name="fc"), {"B": np.ones(3, np.float32)},
     r"node 'fc' \(Gemm\): B .* expected 2-D"),
    (helper.make_node("Concat", ["x", "x"], ["y"], name="cat"), {}, r"node 'cat' \(Concat\): attribute 'axis'"),
])
def test_onnx_node_missing_inputs_or_attributes(node, inits, match) -> None:
    with pytest.raises(GraphError, match=match):
        load_model(_model(node, inits=inits))


def test_onnx_softmax_only_over_channels() -> None:
    for axis in (None, -1, 3):
        kw = {} if axis is None else {"axis": axis}
        model = _model(_conv(), helper.make_node("Softmax", ["c"], ["y"], name="sm", **kw), inits={"W": W})
        with pytest.raises(GraphError, match=rf"node 'sm' \(Softmax\): axis \({-1 if axis is None else axis}\)"):
            load_model(model)
    g = load_model(_model(_conv(), helper.make_node("Softmax", ["c"], ["y"], name="sm", axis=1), inits={"W": W}))
    assert infer(g)["y"].shape == (1, 4, 8, 8)
    flat = helper.make_node("Flatten", ["c"], ["f"], name="f")
    g = load_model(_model(_conv(), flat, helper.make_node("Softmax", ["f"], ["y"], name="sm"), inits={"W": W}))
    assert infer(g)["y"].shape == (1, 256)  # -1 of a 2-D tensor is the channels


@pytest.mark.parametrize("shape, ok", [([2, -1], False), ([1, 128], False), ([-1, -1], False), ([1, 4, -1], False),
                                       ([1, -1], True), ([0, -1], True), ([-1, 256], True), ([1, 256], True)])
def test_onnx_reshape_only_flattens(shape, ok) -> None:
    model = _model(_conv(), helper.make_node("Reshape", ["c", "s"], ["y"], name="rs"),
                   inits={"W": W, "s": np.array(shape, np.int64)})
    if ok:
        assert infer(g := load_model(model))["y"].shape == (1, 256) and g.outputs == ["y"]
    else:
        with pytest.raises(GraphError, match=r"node 'rs' \(Reshape\): shape .* must flatten .* to \(1, 256\)"):
            load_model(model)


def test_onnx_symbolic_height_needs_input_size() -> None:
    model = _model(_conv(), dims=("N", 3, "H", "W"), out="c", inits={"W": W})
    with pytest.raises(GraphError, match=r"input 'x' \(N, 3, H, W\) has a symbolic height or width.*--input-size"):
        load_model(model)
    g = load_model(model, input_size=9)
    assert infer(g)["c"].shape == (1, 4, 9, 9)


# -- pooling windows -------------------------------------------------------------------------------

def test_pool_pad_must_be_smaller_than_the_kernel() -> None:
    pool = helper.make_node("MaxPool", ["x"], ["y"], name="mp", kernel_shape=[3, 3], pads=[5, 5, 5, 5])
    with pytest.raises(GraphError, match=r"node 'mp' \(pool\): pad \(5, 5, 5, 5\) must be smaller than the kernel"):
        load_model(_model(pool))
    text = ('input: "data" input_shape { dim: 1 dim: 2 dim: 8 dim: 8 }\n'
            'layer { name: "p" type: "Pooling" bottom: "data" top: "p" '
            'pooling_param { pool: MAX kernel_size: 2 pad: 2 } }')
    with pytest.raises(GraphError, match=r"node 'p' \(pool\): pad \(2, 2, 2, 2\) must be smaller"):
        load_prototxt(text)
    assert infer(load_prototxt(text.replace("pad: 2", "pad: 1")))["p"].shape == (1, 2, 9, 9)


def test_ceil_mode_drops_a_last_window_past_the_image() -> None:
    assert pool_out(6, 2, 3, 0, 0, ceil=True) == 2  # Caffe says 3, its last window starting at 6
    text = ('input: "data" input_shape { dim: 1 dim: 2 dim: 6 dim: 6 }\n'
            'layer { name: "p" type: "Pooling" bottom: "data" top: "p" '
            'pooling_param { pool: MAX kernel_size: 2 stride: 3 } }')
    g = load_prototxt(text)
    x = np.random.default_rng(0).standard_normal(g.input_shape)
    assert run_reference(g, x)["p"].shape == (1, 2, 2, 2)


# -- prototxt ---------------------------------------------------------------------------------------

NET = ('input: "data" input_shape { dim: 1 dim: 3 dim: 8 dim: 8 }\n'
       'layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"\n'
       '        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }\n')


@pytest.mark.parametrize("old, new, match", [
    ("kernel_size: 3", "kernel_size: abc", r"layer 'c1' \(Convolution\): kernel_size \('abc'\) must be an int"),
    ("num_output: 4", "num_output: -4", r"layer 'c1' \(Convolution\): num_output \(-4\) must be >= 1"),
    ("num_output: 4", "", r"layer 'c1' \(Convolution\): num_output is missing"),
    ("pad: 1", "pad: 1.5", r"layer 'c1' \(Convolution\): pad \(1.5\) must be an int"),
    ("kernel_size: 3", "kernel_size: 3 kernel_size: 3 kernel_size: 3",
     r"kernel_size \(\[3, 3, 3\]\) must be one or two"),
    ("dim: 3", "dim: three", r"input 'data': dims .* must be positive ints"),
    ("convolution_param {", "convolution_param: 3 foo {", r"layer 'c1' \(Convolution\): convolution_param \(3\)"),
])
def test_prototxt_bad_values_name_the_layer(old, new, match) -> None:
    with pytest.raises(GraphError, match=match):
        load_prototxt(NET.replace(old, new))


def test_prototxt_softmax_axis_is_not_ignored() -> None:
    text = NET + 'layer { name: "sm" type: "Softmax" bottom: "c1" top: "sm" softmax_param { axis: 2 } }'
    with pytest.raises(GraphError, match=r"layer 'sm' \(Softmax\): axis \(2\) must be 1"):
        load_prototxt(text)


def test_prototxt_file_errors_name_the_file_and_line(tmp_path) -> None:
    unclosed = tmp_path / "unclosed.prototxt"
    unclosed.write_text(NET.replace("pad: 1 } }", "pad: 1 }"))
    with pytest.raises(PrototxtError, match=r"unclosed\.prototxt line 2: unclosed message"):
        load_prototxt(unclosed)
    binary = tmp_path / "binary.prototxt"
    binary.write_bytes(b"\xec\xff\x00" * 10)
    with pytest.raises(GraphError, match=r"binary\.prototxt: not UTF-8 text"):
        load_model(str(binary))
    junk = tmp_path / "junk.caffemodel"
    junk.write_bytes(b"\x0c\x0d")
    with pytest.raises(GraphError, match=r"caffemodel .*junk\.caffemodel: not a Caffe NetParameter"):
        load_prototxt(NET, weights=junk)


# -- load_model / compile arguments -------------------------------------------------------------------

@pytest.fixture
def no_network(monkeypatch) -> list:
    """compile() up to the Network, which records its graph instead of building kernels."""
    made: list = []
    monkeypatch.setattr(build, "Network", lambda graph, backend, **kw: made.append((graph, kw)) or graph)
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


def test_compile_arguments(no_network, ocl) -> None:
    model = _model(_conv(), out="c", inits={"W": W})
    compile(model, batch=np.int64(2), backend="opencl", workspace_limit=np.float64(1e6), error_budget=None)
    graph, kw = no_network[-1]
    assert graph.input_shape == (2, 3, 8, 8) and type(graph.input_shape[0]) is int
    assert kw["workspace_limit"] == 1_000_000
    for bad in (math.nan, math.inf, -1, True, "1"):
        with pytest.raises(ValueError, match=r"workspace_limit .* must be a finite number >= 0"):
            compile(model, backend="opencl", workspace_limit=bad)
    for bad in (True, 2.0, 0):
        with pytest.raises(ValueError, match=r"batch .* must be a positive int"):
            compile(model, batch=bad, backend="opencl")


def test_cli_run_bad_net_files(tmp_path, capsys, monkeypatch) -> None:
    """convforge run on such files: one ``error:`` line naming the problem, exit status 2."""
    from convforge.config import config
    from helpers import run_main

    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")
    (tmp_path / "junk.onnx").write_bytes(np.random.default_rng(2).bytes(2000))
    (tmp_path / "m.onnx").write_bytes(_model(_conv(), out="c", inits={"W": W}).SerializeToString())
    (tmp_path / "junk.prototxt").write_bytes(b"\xec\xff\x00" * 10)
    (tmp_path / "junk.bin").write_bytes(b"\x00")
    cases = [(["--net", "junk.onnx"], "onnx: junk.onnx is not an ONNX model"),
             (["--net", "m.onnx", "--weights", "junk.bin"], "error: weights ('junk.bin') are for prototxt nets"),
             (["--net", "junk.prototxt"], "prototxt junk.prototxt: not UTF-8 text")]
    monkeypatch.chdir(tmp_path)
    for args, message in cases:
        rc, out = run_main(["run", *args, "--backend", "opencl", "--no-torch"], capsys)
        assert rc == 2 and "Traceback" not in out and message in out, out
