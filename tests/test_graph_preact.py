"""The pre-activation pass (``passes.fold_preactivation``): BN -> ReLU -> conv folded into the conv's
input load, on an ONNX DenseNet-like block built with ``onnx.helper`` (PoCL): the graph before and
after the passes against the float64 executor, and the compiled network against it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from convforge.graph.build import compile
from convforge.graph.ir import Graph, GraphError, Node, infer
from convforge.graph.passes import fold_preactivation, optimize
from convforge.graph.reference import run_reference
from convforge.graph.runtime import Network, prologue_of
from convforge.plan import Prologue
from convforge.reference import rel_l2


def _densenet_block() -> Any:
    """x (6 ch) -> [BN -> ReLU -> 1x1 (8) -> BN -> ReLU -> 3x3 (4)] -> concat(x, f1) (10 ch) ->
    [BN -> ReLU -> 1x1 (8) -> BN -> ReLU -> 3x3 (4)] -> concat (14 ch) -> transition BN -> ReLU ->
    1x1 (7) -> avg pool; and a pre-activation ResNet unit on the transition's output: BN -> ReLU
    read by a 3x3 stride-2 conv and a 1x1 stride-2 shortcut conv (one ReLU, two convs folding it)."""
    onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install 'convforge[onnx]')")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    inits: list[Any] = []

    def init(name: str, *shape: int, low: float | None = None) -> str:
        arr = rng.uniform(low, 1.5, shape) if low is not None else rng.standard_normal(shape) * 0.5
        inits.append(numpy_helper.from_array(arr.astype(np.float32), name))
        return name

    nodes: list[Any] = []

    def bn_relu(src: str, c: str, ch: int) -> str:
        nodes.append(helper.make_node("BatchNormalization", [src, init(f"{c}g", ch), init(f"{c}b", ch),
                                                             init(f"{c}m", ch), init(f"{c}v", ch, low=0.5)],
                                      [f"{c}o"], name=f"{c}", epsilon=1e-5))
        nodes.append(helper.make_node("Relu", [f"{c}o"], [f"{c}r"], name=f"{c}relu"))
        return f"{c}r"

    def conv(src: str, c: str, cin: int, cout: int, k: int, stride: int = 1) -> str:
        pad = k // 2
        nodes.append(helper.make_node("Conv", [src, init(f"{c}w", cout, cin, k, k)], [f"{c}o"], name=c,
                                      pads=[pad] * 4, strides=[stride] * 2))
        return f"{c}o"

    def layer(src: str, i: int, cin: int) -> str:
        a = conv(bn_relu(src, f"n{i}a", cin), f"c{i}a", cin, 8, 1)
        return conv(bn_relu(a, f"n{i}b", 8), f"c{i}b", 8, 4, 3)

    f1 = layer("x", 1, 6)
    nodes.append(helper.make_node("Concat", ["x", f1], ["cat1"], name="cat1", axis=1))
    f2 = layer("cat1", 2, 10)
    nodes.append(helper.make_node("Concat", ["cat1", f2], ["cat2"], name="cat2", axis=1))
    t = conv(bn_relu("cat2", "nt", 14), "ct", 14, 7, 1)
    nodes.append(helper.make_node("AveragePool", [t], ["pool"], name="pool", kernel_shape=[2, 2], strides=[2, 2]))
    r = bn_relu("pool", "np", 7)
    main = conv(r, "cm", 7, 5, 3, stride=2)
    short = conv(r, "cs", 7, 5, 1, stride=2)
    nodes.append(helper.make_node("Add", [main, short], ["y"], name="add"))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6, 13, 11])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5, 3, 3])
    graph = helper.make_graph(nodes, "preact", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _graph(batch: int = 2) -> Graph:
    from convforge.graph.from_onnx import load_onnx

    return load_onnx(_densenet_block(), batch=batch)


def test_the_pass_folds_every_pre_activation_and_keeps_the_output() -> None:
    g = _graph()
    opt = optimize(g)
    convs = {n.name: n for n in opt.nodes if n.op == "conv"}
    assert not [n for n in opt.nodes if n.op in ("batchnorm", "relu")]  # every BN and ReLU is folded
    # the first 1x1 of each layer, the transition and both convs of the unit read the raw tensor
    for name in ("c1a", "c2a", "ct", "cm", "cs"):
        assert prologue_of(convs[name]) == Prologue(True, True), name
    assert convs["c2a"].inputs[0] == "cat1" and convs["cm"].inputs[0] == convs["cs"].inputs[0] == "pool"
    # the BN -> ReLU after a 1x1 is its epilogue (batch norm folded, ReLU fused), not a prologue
    assert prologue_of(convs["c1b"]) == Prologue() and convs["c1a"].attrs.get("relu")
    x = np.random.default_rng(1).standard_normal(infer(g)[g.input].shape).astype(np.float32)
    before, after = run_reference(g, x), run_reference(opt, x)
    assert rel_l2(after[opt.outputs[0]], before["y"]) < 1e-6  # folded weights rounded to float32


def test_the_compiled_block_matches_the_float64_executor(ocl: Any) -> None:
    g = _graph()
    x = np.random.default_rng(3).standard_normal(infer(g)[g.input].shape).astype(np.float32)
    want = run_reference(g, x)["y"]
    net = compile(g, batch=2, backend="opencl", error_budget=None)
    labels = {s.node: s.variant for s in net.steps}
    assert "_preaffrelu" in labels["c2a"] and "_preaffrelu" in labels["cs"]
    assert rel_l2(net(x)[net.graph.outputs[0]], want) < 1e-5
    # the network without the pass computes the same (the pre-activations as their own kernels)
    plain = compile(g, batch=2, backend="opencl", passes=False, error_budget=None)
    assert rel_l2(plain(x)["y"], want) < 1e-5


def test_caffe_batchnorm_and_scale_compose_and_other_forms_fold(ocl: Any) -> None:
    """Caffe's BatchNorm + Scale (+ ReLU) before a conv become one affine prologue; a ReLU after a
    concat (nothing to fuse it into) a ReLU-only prologue; a batch norm without ReLU an affine-only
    one. The graph before and after against the float64 executor, and the network on PoCL."""
    rng = np.random.default_rng(5)
    w = {"w1": (4, 3, 3, 3), "w2": (5, 6, 1, 1), "w3": (3, 4, 3, 3), "w4": (3, 4, 1, 1), "mean": (3,),
         "gam": (3,), "bet": (3,), "mean4": (4,)}
    weights = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in w.items()}
    weights["var"] = rng.uniform(0.5, 2, 3).astype(np.float32)
    weights["var4"] = rng.uniform(0.5, 2, 4).astype(np.float32)
    nodes = [Node("bn", "batchnorm", ["x"], "b", {"eps": 1e-3}, {"mean": "mean", "var": "var"}),
             Node("sc", "scale", ["b"], "s", {"relu": True}, {"gamma": "gam", "beta": "bet"}),
             Node("c1", "conv", ["s"], "o1", {"k": 4, "kernel": 3, "pad": 1}, {"w": "w1"}),
             Node("cat", "concat", ["x", "x"], "cc"),
             Node("r", "relu", ["cc"], "rc"),
             Node("c2", "conv", ["rc"], "o2", {"k": 5, "kernel": 1, "stride": 2, "pad": 1}, {"w": "w2"}),
             Node("bn2", "batchnorm", ["o1"], "b2", {}, {"mean": "mean4", "var": "var4"}),
             Node("c4", "conv", ["b2"], "o4", {"k": 3, "kernel": 1}, {"w": "w4"}),
             Node("pool", "pool", ["o1"], "p", {"kind": "max", "kernel": 2, "stride": 2}),
             Node("c3", "conv", ["p"], "o3", {"k": 3, "kernel": 3, "pad": 1}, {"w": "w3"})]
    g = Graph("caffe-like", "x", (1, 3, 9, 9), nodes, ["o2", "o3", "o4"], weights)
    opt = fold_preactivation(g)
    names = {n.name: n for n in opt.nodes}
    assert not {"bn", "sc", "r", "bn2"} & set(names)
    assert prologue_of(names["c1"]) == Prologue(True, True) and names["c1"].inputs[0] == "x"
    assert prologue_of(names["c2"]) == Prologue(relu=True) and names["c2"].inputs[0] == "cc"
    assert prologue_of(names["c4"]) == Prologue(affine=True) and names["c4"].inputs[0] == "o1"
    x = rng.standard_normal((1, 3, 9, 9)).astype(np.float32)
    before, after = run_reference(g, x), run_reference(opt, x)
    got = Network(opt, ocl)(x)
    for t in g.outputs:
        assert rel_l2(after[t], before[t]) < 1e-6, t  # scale and shift rounded to float32
        assert rel_l2(got[t], before[t]) < 1e-5, t


def test_a_pre_activation_read_by_something_else_is_not_folded() -> None:
    g = _graph()
    g.outputs.append("n2ar")  # the second layer's activated input is also a graph output
    opt = optimize(g)
    c2a = next(n for n in opt.nodes if n.name == "c2a")
    assert prologue_of(c2a) == Prologue() and c2a.inputs[0] != "cat1"


def test_a_half_given_prologue_is_refused() -> None:
    g = optimize(_graph())
    conv = next(n for n in g.nodes if n.name == "c1a")
    del conv.weights["pshift"]
    with pytest.raises(GraphError, match="pscale and weights.pshift"):
        infer(g)


def test_the_float32_executor_is_float32_and_close() -> None:
    """run_reference(dtype=float32): what calibration compares PyTorch FP32's stand-in with: float32
    outputs within float32 rounding of the float64 answer, but not equal to it."""
    g = _graph()
    x = np.random.default_rng(4).standard_normal(infer(g)[g.input].shape).astype(np.float32)
    ref, f32 = run_reference(g, x)["y"], run_reference(g, x, dtype=np.float32)["y"]
    assert f32.dtype == np.float32
    assert 0 < rel_l2(f32, ref) < 1e-6
    with pytest.raises(ValueError, match="dtype"):
        run_reference(g, x, dtype=np.float16)
