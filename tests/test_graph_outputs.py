"""Issue 34, case 6: graph outputs keep their declared names through the front-ends, every pass,
``compile`` and ``convforge run``: Conv -> Relu in ONNX and prototxt (in place and not), outputs
behind Identity / Dropout, and each shipped network."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from convforge import models
from convforge.graph import passes
from convforge.graph.build import compile
from convforge.graph.caffe import load_prototxt, load_shipped
from convforge.graph.ir import Graph
from convforge.graph.reference import run_reference
from convforge.reference import rel_l2
from helpers import run_main


def _x(graph: Graph, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(graph.input_shape).astype(np.float32)


def _runs_under_declared_names(graph: Graph, source: object, names: list[str], tol: float = 2e-5) -> None:
    """``compile`` (passes on and off) returns exactly ``names``, each equal to the reference's."""
    assert graph.outputs == names
    for p in passes.PASSES:
        assert p(graph).outputs == names, p.__name__
    assert passes.optimize(graph).outputs == names
    x = _x(graph)
    ref = run_reference(graph, x)
    for use_passes in (True, False):
        out = compile(source, backend="opencl", passes=use_passes)(x)
        assert sorted(out) == sorted(names), (use_passes, sorted(out))
        for t in names:
            assert rel_l2(out[t], ref[t]) < tol, t


# -- ONNX -----------------------------------------------------------------------------------------
def _onnx(nodes: list, outputs: list[str], with_bias: bool = True):  # type: ignore[no-untyped-def]
    onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install 'convforge[onnx]')")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")]
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 9, 9])]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["n", "c", "h", "w"]) for o in outputs]
    model = helper.make_model(helper.make_graph(nodes, "ok", ins, outs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _conv(out: str = "c") -> object:
    from onnx import helper

    return helper.make_node("Conv", ["x", "w", "b"], [out], name="conv", pads=[1, 1, 1, 1])


def _relu(src: str, out: str) -> object:
    from onnx import helper

    return helper.make_node("Relu", [src], [out], name=f"relu_{out}")


def _identity(src: str, out: str, op: str = "Identity") -> object:
    from onnx import helper

    return helper.make_node(op, [src], [out], name=f"{op}_{out}")


def test_onnx_conv_relu_keeps_its_output_name(ocl, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from convforge.graph.from_onnx import load_onnx

    model = _onnx([_conv(), _relu("c", "y")], ["y"])
    path = tmp_path / "ok.onnx"
    path.write_bytes(model.SerializeToString())
    _runs_under_declared_names(load_onnx(model), str(path), ["y"])
    rc, out = run_main(["run", "--net", str(path), "--backend", "opencl", "--no-torch", "--repeats", "1"], capsys)
    assert rc == 0 and "Traceback" not in out, out
    assert re.search(r"relative error vs the float64 reference \(images? 0(-\d)?\): y ", out), out


@pytest.mark.parametrize("case", ["identity", "dropout", "two names", "conv and relu", "input"])
def test_onnx_outputs_behind_identities_keep_their_names(ocl, tmp_path: Path, case: str) -> None:
    from convforge.graph.from_onnx import load_onnx

    nodes, names = {
        "identity": ([_conv(), _relu("c", "r"), _identity("r", "y")], ["y"]),
        "dropout": ([_conv(), _relu("c", "r"), _identity("r", "y", "Dropout")], ["y"]),
        "two names": ([_conv(), _relu("c", "r"), _identity("r", "y"), _identity("r", "z")], ["y", "z"]),
        "conv and relu": ([_conv(), _relu("c", "y"), _identity("c", "conv_out")], ["conv_out", "y"]),
        "input": ([_conv(), _relu("c", "y"), _identity("x", "x_copy")], ["y", "x_copy"]),
    }[case]
    model = _onnx(nodes, names)
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    _runs_under_declared_names(load_onnx(model), str(path), names)


# -- prototxt ----------------------------------------------------------------------------------
CONV_RELU = """name: "cr"
input: "data"
input_shape {{ dim: 2 dim: 3 dim: 9 dim: 9 }}
layer {{ name: "c1" type: "Convolution" bottom: "data" top: "c1"
        convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 }} }}
layer {{ name: "r1" type: "ReLU" bottom: "c1" top: "{top}" }}
"""


@pytest.mark.parametrize("top, name", [("out", "out"), ("c1", "c1")], ids=["not in place", "in place"])
def test_prototxt_conv_relu_keeps_its_output_name(ocl, tmp_path: Path, capsys, top: str, name: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "cr.prototxt"
    path.write_text(CONV_RELU.format(top=top))
    graph = load_prototxt(path)
    _runs_under_declared_names(graph, str(path), [name])
    assert [n.op for n in passes.optimize(graph).nodes] == ["conv"]  # the ReLU is still fused
    rc, out = run_main(["run", "--net", str(path), "--backend", "opencl", "--no-torch", "--repeats", "1"], capsys)
    assert rc == 0 and re.search(rf"\(images? 0(-\d)?\): {name} ", out), out


def test_prototxt_in_place_chain_ends_under_the_blob_name() -> None:
    text = CONV_RELU.format(top="c1") + 'layer { name: "d1" type: "Dropout" bottom: "c1" top: "c1" }\n'
    graph = load_prototxt(text)
    assert graph.outputs == ["c1"] and passes.optimize(graph).outputs == ["c1"]
    x = _x(graph)
    ref, before = run_reference(passes.optimize(graph), x), run_reference(graph, x)
    assert np.array_equal(ref["c1"], before["c1"])


# -- each shipped network ------------------------------------------------------------------------
@pytest.mark.parametrize("name", models.NAMES)
def test_shipped_networks_keep_their_output_names(name: str) -> None:
    graph = load_shipped(name, input_size=64)
    logits = graph.producer(graph.outputs[0]).inputs[0]
    for outputs in (list(graph.outputs), [*graph.outputs, logits]):  # as `convforge run` checks them
        graph.outputs = outputs
        assert passes.optimize(graph).outputs == outputs


@pytest.mark.parametrize("name, size", [("nin", 67), ("resnet50", 32)])
def test_shipped_networks_compile_and_run(ocl, capsys, name: str, size: int) -> None:  # type: ignore[no-untyped-def]
    """Shipped networks compile and run, under their declared output names, one per graph feature the
    others lack: nin through ``convforge run`` (its default calibration; the command adds nothing
    network-specific beyond the logits it finds, test_shipped_networks_keep_their_output_names), resnet50
    through the API (residual adds, bottlenecks, strided 1x1 projections). googlenet (concats) and alexnet
    (4096-wide fc layers) are test_graph.test_network_end_to_end's (the API, names and values); vgg16 is a
    chain of the 3x3 convs, pools and fc layers those cover, its names checked by the test above (a PoCL run
    of it took 20-40 s of the CPU tier's time for nothing new)."""
    graph = load_shipped(name, input_size=size)
    if name == "resnet50":
        net = compile(name, backend="opencl", input_size=size, error_budget=0)  # names, not calibration (own tests)
        assert net.graph.outputs == graph.outputs
        out = net(_x(graph))
        assert sorted(out) == sorted(graph.outputs)
        return
    rc, text = run_main(["run", "--net", name, "--input-size", str(size), "--backend", "opencl", "--no-torch",
                         "--repeats", "1"], capsys)
    assert rc == 0 and "Traceback" not in text and "logits error vs float64" in text, text
