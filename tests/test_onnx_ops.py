"""The ONNX ops of modern CNNs (EfficientNet, MobileNet-v3, YOLO-style detectors, UNets), one small
graph each built with ``onnx.helper`` (odd sizes, N = 2), run through ``convforge.compile`` on PoCL
(the graph passes on) and compared by relative L2 error with ``onnx.reference`` (ONNX's own
semantics) and with the float64 executor of the unoptimised IR (the oracle of the network tests).
"""

from __future__ import annotations

import numpy as np
import pytest

from convforge.graph.build import compile
from convforge.graph.ir import GraphError
from convforge.graph.passes import optimize
from convforge.graph.reference import run_reference
from convforge.reference import rel_l2

onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install 'convforge[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from convforge.graph.from_onnx import SUPPORTED_OPS, load_onnx  # noqa: E402

TOL = 2e-6  # FP32 kernels against float64 (and against onnx.reference's float32) on these small graphs
SHAPE = (2, 3, 13, 11)
RNG = np.random.default_rng(7)


def arr(*shape: int, lo: float | None = None) -> np.ndarray:
    a = RNG.standard_normal(shape)
    return (np.abs(a) + lo if lo is not None else a).astype(np.float32)


def model(nodes: list, inits: dict[str, np.ndarray], shape: tuple[int, ...] = SHAPE, out: str = "y",
          opset: int = 17):  # type: ignore[no-untyped-def]
    """A model of ``nodes`` on input x of ``shape`` with output ``out``."""
    tensors = [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()]
    graph = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], tensors)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def node(op: str, ins: list[str], out: str = "y", **attrs):  # type: ignore[no-untyped-def]
    return helper.make_node(op, ins, [out], name=f"{op.lower()}_{out}", **attrs)


def conv(out: str = "c", src: str = "x", k: int = 6, c: int = 3, w: str = "w") -> tuple[object, dict]:
    """A 3x3 conv (pads 1) with bias: (node, its initializers)."""
    return (helper.make_node("Conv", [src, w, w + "b"], [out], name=f"conv_{out}", pads=[1, 1, 1, 1]),
            {w: arr(k, c, 3, 3), w + "b": arr(k)})


def check(m, shape: tuple[int, ...] = SHAPE, tol: float = TOL, onnx_ref: bool = True):  # type: ignore[no-untyped-def]
    """Our output (PoCL, passes on) against onnx.reference and the float64 executor; returns the
    optimised IR."""
    x = RNG.standard_normal(shape).astype(np.float32)
    g = load_onnx(m)
    ref = run_reference(g, x)["y"]
    net = compile(m, backend="opencl", error_budget=None)
    got = net(x)["y"]
    assert got.shape == ref.shape
    err = rel_l2(got, ref)
    assert err < tol, f"vs float64: relative error {err:.2e}"
    if onnx_ref:
        want = ReferenceEvaluator(m).run(None, {"x": x})[0]
        assert want.shape == ref.shape
        # onnx.reference computes in float32 too: it checks the graph's meaning (a wrong one is off by O(1)),
        # not our rounding, so its own error against float64 is allowed on top (never judged against a less
        # accurate answer: the float64 check above is the judge)
        own = rel_l2(want, ref)
        err = rel_l2(got, want)
        assert err < tol + own, f"vs onnx.reference: relative error {err:.2e} (its own vs float64: {own:.2e})"
    return net.graph


# -- Conv: auto_pad, the bias as a third input ------------------------------------------------------

@pytest.mark.parametrize("attrs", [
    {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, {"auto_pad": "SAME_LOWER", "strides": [2, 3]},
    {"auto_pad": "SAME_UPPER", "dilations": [2, 1]}, {"auto_pad": "VALID", "strides": [2, 2]},
    {"auto_pad": "NOTSET", "pads": [0, 2, 1, 0]}, {"pads": [1, 0, 2, 1], "group": 3},
], ids=["same_upper_s2", "same_lower_s23", "same_upper_dil", "valid", "notset_asym", "grouped"])
def test_conv_auto_pad(ocl, attrs) -> None:
    w = arr(6, 3 // attrs.get("group", 1), 4 if "dilations" not in attrs else 3, 3)
    check(model([node("Conv", ["x", "w", "b"], kernel_shape=list(w.shape[2:]), **attrs)], {"w": w, "b": arr(6)}))


def test_conv_bias_from_a_node(ocl) -> None:
    """A bias computed by nodes (a Constant, then Identity and a Mul by a constant): folded at load."""
    bias = numpy_helper.from_array(arr(6), "bv")
    nodes = [helper.make_node("Constant", [], ["b0"], name="k", value=bias),
             helper.make_node("Identity", ["b0"], ["b1"], name="id"),
             helper.make_node("Mul", ["b1", "two"], ["b2"], name="twice"),
             node("Conv", ["x", "w", "b2"], pads=[1, 1, 1, 1])]
    g = check(model(nodes, {"w": arr(6, 3, 3, 3), "two": np.float32(2.0)}))
    assert [n.op for n in g.nodes] == ["conv"] and "bias" in g.nodes[0].weights


def test_conv_bias_that_is_an_activation_is_refused() -> None:
    """Every tensor the runtime computes is per image (N, ...): a bias must come from constants."""
    m = model([node("Conv", ["x", "w", "x"])], {"w": arr(3, 3, 1, 1)})
    with pytest.raises(GraphError, match=r"node 'conv_y' \(Conv\): B \('x'\) must be a constant \(an initializer"):
        load_onnx(m)


# -- activations --------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, ins, attrs, inits", [
    ("Sigmoid", [], {}, {}), ("Tanh", [], {}, {}), ("HardSwish", [], {}, {}),
    ("HardSigmoid", [], {"alpha": 0.3, "beta": 0.4}, {}), ("LeakyRelu", [], {"alpha": 0.07}, {}),
    ("Clip", ["lo", "hi"], {}, {"lo": np.float32(0.0), "hi": np.float32(0.6)}),
    ("Clip", ["lo", "hi"], {}, {"lo": np.float32(-0.4), "hi": np.float32(0.9)}),
    ("Clip", ["", "hi"], {}, {"hi": np.float32(0.5)}),
    ("Clip", ["lo"], {}, {"lo": np.float32(-0.2)}),
], ids=["sigmoid", "tanh", "hardswish", "hardsigmoid", "leaky", "relu6like", "clip", "clip_max", "clip_min"])
def test_activations(ocl, op: str, ins: list[str], attrs: dict, inits: dict) -> None:
    check(model([node(op, ["x", *ins], **attrs)], inits))


@pytest.mark.parametrize("op, act", [("Swish", "silu"), ("Gelu", "gelu"), ("Mish", "mish")])
def test_newer_activation_ops_fuse_into_the_conv(ocl, op: str, act: str) -> None:
    """Swish (opset 24), Gelu (opset 20) and Mish (opset 18) after a conv: its epilogue."""
    c, inits = conv()
    g = check(model([c, node(op, ["c"])], inits, opset=24))
    assert [(n.op, n.attrs.get("act")) for n in g.nodes] == [("conv", act)]


@pytest.mark.parametrize("gate, attrs, want", [("Sigmoid", {}, "silu"),
                                               ("HardSigmoid", {"alpha": 1 / 6, "beta": 0.5}, "hardswish")])
@pytest.mark.parametrize("order", ["xg", "gx"])
def test_gated_activation_fuses_into_the_conv(ocl, gate: str, attrs: dict, want: str, order: str) -> None:
    """conv -> x * gate(x) becomes the conv's SiLU / HardSwish epilogue (one launch)."""
    c, inits = conv()
    mul = node("Mul", ["c", "s"] if order == "xg" else ["s", "c"])
    g = check(model([c, node(gate, ["c"], "s", **attrs), mul], inits))
    assert [(n.op, n.attrs.get("act")) for n in g.nodes] == [("conv", want)]


@pytest.mark.parametrize("order", ["xg", "gx"])
def test_mish_as_older_exports_write_it_fuses_into_the_conv(ocl, order: str) -> None:
    """conv -> x * tanh(softplus(x)) (Mish below opset 18) becomes the conv's Mish epilogue (one launch)."""
    c, inits = conv()
    mul = node("Mul", ["c", "t"] if order == "xg" else ["t", "c"])
    g = check(model([c, node("Softplus", ["c"], "sp"), node("Tanh", ["sp"], "t"), mul], inits))
    assert [(n.op, n.attrs.get("act")) for n in g.nodes] == [("conv", "mish")]


def test_mish_and_softplus_alone(ocl) -> None:
    """Mish and Softplus not after a conv: one element-wise kernel each; a softplus read elsewhere stays."""
    g = check(model([node("Mish", ["x"], "m"), node("Softplus", ["m"])], {}, opset=18))
    assert [(n.op, n.attrs.get("fn")) for n in g.nodes] == [("act", "mish"), ("act", "softplus")]
    nodes = [node("Softplus", ["x"], "sp"), node("Tanh", ["sp"], "t"), node("Mul", ["x", "t"], "m"),
             node("Add", ["m", "sp"])]
    g = check(model(nodes, {}))
    assert [(n.op, n.attrs.get("fn")) for n in g.nodes] == [("act", "softplus"), ("act", "mish"), ("add", None)]


def test_silu_not_after_a_conv_is_one_kernel(ocl) -> None:
    g = check(model([node("Sigmoid", ["x"], "s"), node("Mul", ["x", "s"])], {}))
    assert [(n.op, n.attrs.get("fn")) for n in g.nodes] == [("act", "silu")]


def test_a_gate_read_elsewhere_stays(ocl) -> None:
    c, inits = conv()
    nodes = [c, node("Sigmoid", ["c"], "s"), node("Mul", ["c", "s"], "m"), node("Add", ["m", "s"])]
    g = check(model(nodes, inits))
    assert [n.op for n in g.nodes] == ["conv", "act", "act", "add"]


# -- broadcast arithmetic ------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, a, b, inits", [
    ("Mul", "x", "g", {}), ("Mul", "g", "x", {}), ("Add", "x", "k", {"k": arr(3, 1, 1)}),
    ("Sub", "k", "x", {"k": arr(1, 1, 11)}), ("Div", "x", "k", {"k": arr(3, 13, 1, lo=0.5)}),
    ("Mul", "x", "k", {"k": np.float32(1.7)}), ("Sub", "x", "g", {}), ("Div", "g", "d", {}),
], ids=["se_mul", "se_mul_swapped", "add_chan", "sub_const_left", "div_plane", "scalar", "sub_bcast", "div_bcast"])
def test_broadcast_arithmetic(ocl, op: str, a: str, b: str, inits: dict) -> None:
    """x (N, C, H, W) with g (N, C, 1, 1), d = 1 + sigmoid(x) (N, C, H, W) and constants of lower rank."""
    nodes = [node("GlobalAveragePool", ["x"], "g"), node("Sigmoid", ["x"], "s"), node("Add", ["s", "one"], "d"),
             node(op, [a, b])]
    check(model(nodes, {**inits, "one": np.float32(1.0)}))


def test_division_by_a_tensor(ocl) -> None:
    nodes = [node("Sigmoid", ["x"], "s"), node("Add", ["s", "one"], "d"), node("Div", ["x", "d"])]
    check(model(nodes, {"one": np.float32(1.0)}))


def test_residual_add_of_tensors_fuses(ocl) -> None:
    c, inits = conv(k=3)
    g = check(model([c, node("Add", ["c", "x"])], inits))
    assert [n.op for n in g.nodes] == ["conv"] and len(g.nodes[0].inputs) == 2


# -- reductions, linear layers, shapes ------------------------------------------------------------------------

@pytest.mark.parametrize("keepdims", [1, 0])
@pytest.mark.parametrize("opset", [17, 18])
def test_reduce_mean_over_height_and_width(ocl, keepdims: int, opset: int) -> None:
    if opset >= 18:
        nodes, inits = [node("ReduceMean", ["x", "axes"], keepdims=keepdims)], {"axes": np.array([-1, 2], np.int64)}
    else:
        nodes, inits = [node("ReduceMean", ["x"], axes=[2, -1], keepdims=keepdims)], {}
    check(model(nodes, inits, opset=opset))


def test_global_pools(ocl) -> None:
    check(model([node("GlobalAveragePool", ["x"], "a"), node("GlobalMaxPool", ["x"], "m"), node("Add", ["a", "m"])],
                {}))


def test_matmul_and_add_bias_are_one_fc(ocl) -> None:
    nodes = [node("Flatten", ["x"], "f"), node("MatMul", ["f", "w"], "mm"), node("Add", ["mm", "b"], "z"),
             node("Softmax", ["z"], axis=-1)]
    g = check(model(nodes, {"w": arr(3 * 13 * 11, 10), "b": arr(10)}))
    assert [n.op for n in g.nodes] == ["flatten", "fc", "softmax"] and "bias" in g.nodes[1].weights


def test_gemm_then_hardswish_fuses(ocl) -> None:
    nodes = [node("GlobalAveragePool", ["x"], "g"), node("Flatten", ["g"], "f"),
             node("Gemm", ["f", "w", "b"], "z", transB=1), node("HardSwish", ["z"])]
    g = check(model(nodes, {"w": arr(7, 3), "b": arr(7)}))
    assert [(n.op, n.attrs.get("act")) for n in g.nodes] == [("pool", None), ("flatten", None), ("fc", "hardswish")]


def test_concat_negative_axis_and_views(ocl) -> None:
    """Concat on axis -3, a 4-D Reshape view, Squeeze / Unsqueeze, Identity and Dropout."""
    nodes = [node("Concat", ["x", "x"], "cat", axis=-3), node("Reshape", ["cat", "shape"], "r"),
             node("GlobalAveragePool", ["r"], "g"), node("Squeeze", ["g", "axes"], "sq"),
             node("Identity", ["sq"], "id"), node("Dropout", ["id"], "dr"), node("Unsqueeze", ["dr", "axes"], "un"),
             node("Mul", ["r", "un"])]
    inits = {"shape": np.array([0, 3, 2 * 13, 11], np.int64), "axes": np.array([2, 3], np.int64)}
    check(model(nodes, inits))


# -- resize ---------------------------------------------------------------------------------------------------

RESIZES = [
    ("nearest", "asymmetric", "floor", [1, 1, 2, 2], None),
    ("nearest", "half_pixel", "round_prefer_floor", None, [2, 3, 20, 7]),
    ("nearest", "asymmetric", "round_prefer_ceil", None, [2, 3, 17, 24]),
    ("nearest", "align_corners", "ceil", [1, 1, 1.5, 2.5], None),
    ("linear", "half_pixel", None, [1, 1, 2, 2], None),
    ("linear", "pytorch_half_pixel", None, None, [2, 3, 1, 23]),
    ("linear", "align_corners", None, None, [2, 3, 26, 7]),
    ("linear", "asymmetric", None, [1, 1, 0.5, 3], None),
]


@pytest.mark.parametrize("mode, coord, nearest, scales, sizes", RESIZES,
                         ids=[f"{m}_{c}_{'scales' if s else 'sizes'}" for m, c, _, s, _ in RESIZES])
def test_resize(ocl, mode: str, coord: str, nearest: str | None, scales, sizes) -> None:
    attrs = {"mode": mode, "coordinate_transformation_mode": coord}
    if nearest:
        attrs["nearest_mode"] = nearest
    inits = {"scales": np.array(scales, np.float32)} if scales else {"sizes": np.array(sizes, np.int64)}
    ins = ["x", "", "scales"] if scales else ["x", "", "", "sizes"]
    check(model([node("Resize", ins, **attrs)], inits))


def test_resize_sizes_from_a_shape(ocl) -> None:
    """A UNet's interpolate(x, size=skip.shape[2:]) as exported: Shape -> Slice -> Concat -> Resize."""
    nodes = [node("MaxPool", ["x"], "p", kernel_shape=[2, 2], strides=[2, 2]), node("Shape", ["x"], "s"),
             node("Slice", ["s", "st", "en"], "hw"), node("Concat", ["nc", "hw"], "sz", axis=0),
             node("Resize", ["p", "", "", "sz"], "u", mode="nearest"), node("Concat", ["u", "x"], axis=1)]
    inits = {"st": np.array([2], np.int64), "en": np.array([4], np.int64), "nc": np.array([2, 3], np.int64)}
    check(model(nodes, inits))


def test_upsample(ocl) -> None:
    """The deprecated Upsample (nearest, integer scales: each value repeated)."""
    m = model([node("Upsample", ["x", "scales"], mode="nearest")], {"scales": np.array([1, 1, 2, 3], np.float32)},
              opset=13)
    x = RNG.standard_normal(SHAPE).astype(np.float32)
    out = compile(m, backend="opencl", error_budget=None)(x)["y"]
    assert rel_l2(out, np.repeat(np.repeat(x, 2, axis=2), 3, axis=3)) == 0.0


# -- pooling ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, attrs", [
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ("MaxPool", {"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ("MaxPool", {"kernel_shape": [5, 5], "pads": [2, 2, 2, 2]}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("AveragePool", {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "auto_pad": "SAME_LOWER", "strides": [2, 2]}),
], ids=["max_ceil", "max_same", "sppf", "avg_count_pad", "avg_no_count", "avg_ceil", "avg_same_lower"])
def test_pools(ocl, op: str, attrs: dict) -> None:
    check(model([node(op, ["x"], **attrs)], {}))


# -- pad -------------------------------------------------------------------------------------------------------

def test_zero_pad_folds_into_the_conv(ocl) -> None:
    nodes = [node("Pad", ["x", "pads"], "p"), node("Conv", ["p", "w", "b"], strides=[2, 2])]
    g = check(model(nodes, {"pads": np.array([0, 0, 0, 1, 0, 0, 2, 1], np.int64), "w": arr(4, 3, 3, 3),
                            "b": arr(4)}))
    assert [n.op for n in g.nodes] == ["conv"] and g.nodes[0].attrs["pad"] == (0, 2, 1, 1)


@pytest.mark.parametrize("mode, value", [("constant", 0.5), ("reflect", None), ("edge", None)])
def test_pad_modes(ocl, mode: str, value: float | None) -> None:
    ins, inits = ["x", "pads"], {"pads": np.array([0, 0, 2, 1, 0, 0, 1, 3], np.int64)}
    if value is not None:
        ins, inits = ins + ["v"], {**inits, "v": np.float32(value)}
    check(model([node("Pad", ins, mode=mode)], inits))


# -- ConvTranspose ----------------------------------------------------------------------------------------------

DECONVS = [
    ({"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, 1, (3, 3)),
    ({"strides": [2, 3], "pads": [0, 1, 2, 0]}, 1, (4, 3)),
    ({"strides": [2, 2]}, 1, (2, 2)),
    ({"strides": [2, 1], "dilations": [2, 2], "pads": [1, 0, 1, 2]}, 1, (3, 3)),
    ({"strides": [2, 2], "output_padding": [1, 0], "group": 3}, 3, (3, 3)),
    ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, 1, (3, 3)),
    ({"output_shape": [26, 21], "strides": [2, 2]}, 1, (3, 3)),
]


@pytest.mark.parametrize("attrs, group, kernel", DECONVS,
                         ids=["s2_op1", "asym", "k2s2", "dilated", "grouped", "same_upper", "output_shape"])
def test_conv_transpose(ocl, attrs: dict, group: int, kernel: tuple[int, int]) -> None:
    """ConvTranspose on dispatch's dgrad pass, against onnx.reference (whose grouped form is not
    relied on: the float64 executor, itself checked against a stride-1 conv of the zero-stuffed
    input below, checks that one)."""
    inits = {"w": arr(3, 6 // group, *kernel), "b": arr(6)}
    m = model([node("ConvTranspose", ["x", "w", "b"], **attrs)], inits)
    # onnx.reference derives no pads from output_shape (its col2im then fails): the pads ONNX's rule
    # gives are checked instead (total 1 = 2 * 12 + 3 - 26 with the odd one at the start; 2 = 2 + 0)
    g = check(m, onnx_ref=group == 1 and "output_shape" not in attrs)
    if "output_shape" in attrs:
        assert g.nodes[0].attrs["pad"] == (1, 0, 1, 1)


def test_conv_transpose_then_bn_relu_folds(ocl) -> None:
    """ConvTranspose -> BN -> ReLU (a decoder): BN into the filters and bias, ReLU after the bias."""
    nodes = [node("ConvTranspose", ["x", "w"], "d", strides=[2, 2], group=3),
             node("BatchNormalization", ["d", "g", "be", "m", "v"], "bn"), node("Relu", ["bn"])]
    g = check(model(nodes, {"w": arr(3, 2, 2, 2), "g": arr(6), "be": arr(6), "m": arr(6), "v": arr(6, lo=0.5)}),
              onnx_ref=False)
    assert [(n.op, n.attrs.get("relu")) for n in g.nodes] == [("deconv", True)]


def test_grouped_conv_transpose_is_a_strided_scatter() -> None:
    """The float64 executor's transposed conv against its definition on zero-stuffed input: a
    stride-1 conv of the input spread out by the stride, with the filters flipped and transposed."""
    from convforge.reference import conv2d_ref
    from convforge.spec import ConvSpec

    w = arr(6, 2, 3, 3)
    m = model([node("ConvTranspose", ["x", "w"], strides=[2, 2], pads=[1, 0, 0, 1], group=3)], {"w": w},
              shape=(1, 6, 5, 4))
    x = RNG.standard_normal((1, 6, 5, 4)).astype(np.float32)
    got = run_reference(load_onnx(m), x)["y"]
    z = np.zeros((1, 6, 9, 7))
    z[:, :, ::2, ::2] = x
    wf = np.flip(w.astype(np.float64).reshape(3, 2, 2, 3, 3).transpose(0, 2, 1, 3, 4), (3, 4)).reshape(6, 2, 3, 3)
    spec = ConvSpec.make(1, 6, 9, 7, 6, 3, 3, 1, (2 - 1, 2 - 0, 2 - 0, 2 - 1), groups=3)
    assert rel_l2(got, conv2d_ref(z, wf, spec)) < 1e-12


# -- errors ------------------------------------------------------------------------------------------------------

def test_docs_list_every_supported_op() -> None:
    """docs/ONNX.md's table names each op of SUPPORTED_OPS (the one list in code)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "ONNX.md").read_text()
    rows = {name.strip() for line in text.splitlines() if line.startswith("| ") and not line.startswith("| op")
            for name in line.split("|")[1].split(",")}
    assert set(SUPPORTED_OPS) == rows - {"---"}


def test_unknown_op_names_the_supported_ones() -> None:
    m = model([node("Einsum", ["x", "x"], equation="nchw,nchw->nchw")], {})
    with pytest.raises(GraphError, match=r"node 'einsum_y' \(Einsum\): unknown ONNX op type 'Einsum'; supported: "
                                         r"Add, AveragePool, .*ConvTranspose, .*Resize, .*Upsample"):
        load_onnx(m)
    assert {"Sigmoid", "HardSwish", "ReduceMean", "ConvTranspose", "Resize", "Pad"} <= set(SUPPORTED_OPS)


@pytest.mark.parametrize("nodes, inits, match", [
    ([node("Resize", ["x", "", "s"], mode="cubic")], {"s": np.array([1, 1, 2, 2], np.float32)}, "cubic"),
    ([node("Resize", ["x", "", "s"])], {"s": np.array([1, 2, 2, 2], np.float32)}, r"scales .* must be 1 on the"),
    ([node("Resize", ["x", "", "s"], coordinate_transformation_mode="tf_crop_and_resize")],
     {"s": np.array([1, 1, 2, 2], np.float32)}, "coordinate_transformation_mode"),
    ([node("Pad", ["x", "p"])], {"p": np.array([0, 1, 0, 0, 0, 0, 0, 0], np.int64)}, "pad only the height"),
    ([node("Pad", ["x", "p"], mode="wrap")], {"p": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)}, "mode"),
    ([node("MatMul", ["x", "w"])], {"w": arr(11, 4)}, "only a 2-D tensor"),
    ([node("ConvTranspose", ["x", "w"], strides=[2, 2], output_padding=[2, 0])], {"w": arr(3, 2, 3, 3)},
     r"out_pad \(\(2, 0\)\) must be smaller than the stride"),
    ([node("Conv", ["x", "w"], auto_pad="SAME")], {"w": arr(2, 3, 3, 3)}, "auto_pad .'SAME'. must be"),
    ([node("ReduceMean", ["x"], axes=[1], keepdims=1)], {}, r"axes \(\[1\]\)"),
    ([node("Transpose", ["x"], perm=[0, 2, 3, 1])], {}, "unknown ONNX op type 'Transpose'"),
])
def test_refusals_name_the_node_and_value(nodes, inits, match) -> None:
    with pytest.raises(GraphError, match=match):
        load_onnx(model(nodes, inits))


def test_passes_keep_the_onnx_semantics() -> None:
    """Every pass on a graph of the new ops gives the float64 answer it had before."""
    c, inits = conv()
    nodes = [node("Pad", ["x", "pads"], "p"), helper.make_node("Conv", ["p", "w", "wb"], ["c"], name="cv"),
             node("Add", ["c", "k"], "cb"), node("Sigmoid", ["cb"], "s"), node("Mul", ["s", "cb"], "m"),
             node("ConvTranspose", ["m", "wt"], "d", strides=[2, 2]), node("Relu", ["d"])]
    inits = {**inits, "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "k": arr(6, 1, 1), "wt": arr(6, 2, 2, 2)}
    g = load_onnx(model(nodes, inits))
    x = RNG.standard_normal(SHAPE).astype(np.float32)
    opt = optimize(g)
    assert [n.op for n in opt.nodes] == ["conv", "deconv"]
    assert rel_l2(run_reference(opt, x)["y"], run_reference(g, x)["y"]) < 1e-7  # folded weights are float32
