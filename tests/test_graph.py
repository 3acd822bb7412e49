"""Whole networks on PoCL: IR checks, front-ends, every op and pass, the runtime, three networks.

Every comparison is against the float64 reference executor of the IR (convforge.graph.reference).
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from convforge.apps.run.run_command import SUMMARY_HEADER
from convforge.graph import passes
from convforge.graph.build import compile
from convforge.graph.caffe import load_prototxt, read_caffemodel
from convforge.graph.ir import Graph, GraphError, Node, infer
from convforge.graph.prototxt import PrototxtError, parse
from convforge.graph.reference import run_reference
from convforge.graph.runtime import Network, plan_memory
from convforge.reference import rel_l2

TOL = 2e-5


def _x(graph: Graph, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(graph.input_shape).astype(np.float32)


def _check(net: Network, graph: Graph, x: np.ndarray, tol: float = TOL) -> None:
    ref = run_reference(graph, x)
    out = net(x)
    for t in graph.outputs:
        err = rel_l2(out[t], ref[t])
        assert err < tol, f"{t}: relative error {err:.2e}"


def _same(before: Graph, after: Graph, tol: float = 1e-6) -> None:
    x = _x(before)
    a, b = run_reference(before, x), run_reference(after, x)
    for t in before.outputs:
        assert rel_l2(b[t], a[t]) < tol


# -- prototxt -----------------------------------------------------------------------------------

def test_prototxt_parses_nested_repeated_and_comments() -> None:
    msg = parse('name: "n"  # comment\nlayer { name: "a" dim: 1 dim: 2 p { x: 1.5 e: MAX } }\n'
                'layer < name: \'b\' >\nflag: true list: [1, 2]')
    assert msg["name"] == ["n"]
    assert [layer["name"][0] for layer in msg["layer"]] == ["a", "b"]
    assert msg["layer"][0]["dim"] == [1, 2]
    assert msg["layer"][0]["p"][0] == {"x": [1.5], "e": ["MAX"]}
    assert msg["flag"] == [True] and msg["list"] == [1, 2]


@pytest.mark.parametrize("text, what", [("layer { name: 1", "unclosed"), ("name: }", "no value"),
                                        ("{ x: 1 }", "field name")])
def test_prototxt_errors(text: str, what: str) -> None:
    with pytest.raises(PrototxtError, match=what):
        parse(text)


SMALL = """
name: "small"
input: "data" input_shape { dim: 2 dim: 3 dim: 13 dim: 11 }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
        convolution_param { num_output: 5 kernel_size: 3 pad: 1 stride: 2 } }
layer { name: "bn" type: "BatchNorm" bottom: "c1" top: "c1" }
layer { name: "sc" type: "Scale" bottom: "c1" top: "c1" scale_param { bias_term: true } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2" convolution_param { num_output: 5 kernel_size: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "c1" bottom: "c2" top: "sum" }
layer { name: "lk" type: "ReLU" bottom: "sum" top: "sum" relu_param { negative_slope: 0.1 } }
layer { name: "n1" type: "LRN" bottom: "sum" top: "n1" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } }
layer { name: "p1" type: "Pooling" bottom: "n1" top: "p1" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "p2" type: "Pooling" bottom: "n1" top: "p2" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "cat" type: "Concat" bottom: "p1" bottom: "p1" top: "cat" }
layer { name: "d" type: "Dropout" bottom: "cat" top: "cat" }
layer { name: "fc" type: "InnerProduct" bottom: "cat" top: "fc" inner_product_param { num_output: 7 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
layer { name: "gp" type: "Pooling" bottom: "p2" top: "gp" pooling_param { pool: AVE global_pooling: true } }
"""


def test_caffe_front_end_shapes() -> None:
    g = load_prototxt(SMALL, seed=3)
    shapes = infer(g)
    assert shapes["c1"].shape == (2, 5, 7, 6)
    assert shapes["p1"].shape == (2, 5, 3, 3)  # Caffe's ceil mode: ceil((7-3)/2)+1, ceil((6-3)/2)+1
    assert shapes["p2"].shape == (2, 5, 4, 4)
    assert shapes["cat"].shape == (2, 10, 3, 3) and shapes["fc"].shape == (2, 7)
    assert shapes["c1"].dims == ("n", "c", "y", "x") and shapes["fc"].dims == ("n", "c")
    assert g.outputs == ["gp"]  # the last unconsumed blob


def test_caffe_small_net_runs_on_opencl(ocl) -> None:
    g = load_prototxt(SMALL, seed=3)
    g.outputs = ["prob", "gp", "fc", "p2"]
    _check(compile(g, batch=2, backend="opencl", passes=False), g, _x(g))
    _check(compile(g, batch=2, backend="opencl"), g, _x(g))


# -- malformed graphs ---------------------------------------------------------------------------

@pytest.mark.parametrize("edit, match", [
    (lambda t: t.replace('"LRN"', '"Magic"'), r"layer 'n1': unknown layer type 'Magic'"),
    (lambda t: t.replace('bottom: "p2" top: "gp"', 'bottom: "nowhere" top: "gp"'), r"'gp'.*'nowhere' is dangling"),
    (lambda t: t.replace('bottom: "p1" bottom: "p1"', 'bottom: "p1" bottom: "p2"'),
     r"node 'cat' \(concat\).*does not match"),
    (lambda t: t.replace("num_output: 5 kernel_size: 1", "num_output: 5 kernel_size: 1 group: 2"),
     r"'c2'.*group \(2\)"),
    (lambda t: t.replace("kernel_size: 3 stride: 2 }", "kernel_size: 30 stride: 2 }"),
     r"node 'p1' \(pool\): kernel \(30x30\)"),
])
def test_malformed_prototxt_is_refused(edit, match) -> None:
    with pytest.raises(GraphError, match=match):
        load_prototxt(edit(SMALL))


def test_malformed_ir_errors_name_node_field_value() -> None:
    g = Graph("g", "x", (1, 2, 5, 5), [Node("c", "conv", ["x"], "y", {"k": 3, "kernel": 3, "pad": -1},
                                              {"w": "cw"})], ["y"], {"cw": np.zeros((3, 2, 3, 3), np.float32)})
    with pytest.raises(GraphError, match=r"node 'c' \(conv\): pad \(-1\) must be >= 0"):
        infer(g)
    g.nodes[0].attrs["pad"] = 1
    g.weights["cw"] = np.zeros((3, 1, 3, 3), np.float32)
    with pytest.raises(GraphError, match=r"weights.w has shape \(3, 1, 3, 3\), expected \(3, 2, 3, 3\)"):
        infer(g)
    g.nodes[0].op = "warp"
    with pytest.raises(GraphError, match="unknown op 'warp'"):
        infer(g)
    g.nodes[0].op = "relu"
    g.outputs = ["z"]
    with pytest.raises(GraphError, match="output 'z' is not produced"):
        infer(g)


# -- caffemodel ---------------------------------------------------------------------------------

def _varint(v: int) -> bytes:
    out = b""
    while True:
        b, v = v & 0x7F, v >> 7
        out += bytes([b | (0x80 if v else 0)])
        if not v:
            return out


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def test_caffemodel_weights_are_read(tmp_path) -> None:
    text = ('input: "data" input_shape { dim: 1 dim: 2 dim: 4 dim: 4 }\n'
            'layer { name: "c" type: "Convolution" bottom: "data" top: "c" '
            'convolution_param { num_output: 3 kernel_size: 1 } }')
    w = np.arange(6, dtype=np.float32)
    b = np.array([1, 2, 3], np.float32)
    blob = lambda a: _ld(7, _ld(5, a.tobytes()))  # noqa: E731 - BlobProto.data, packed
    layer = _ld(1, b"c") + _ld(2, b"Convolution") + blob(w) + blob(b)
    path = tmp_path / "m.caffemodel"
    path.write_bytes(_ld(1, b"net") + _ld(100, layer))
    assert [a.tolist() for a in read_caffemodel(path)["c"]] == [w.tolist(), b.tolist()]
    g = load_prototxt(text, weights=path)
    assert g.weights["c.w"].shape == (3, 2, 1, 1) and g.weights["c.w"].ravel().tolist() == w.tolist()
    x = _x(g)
    want = np.einsum("kc,nchw->nkhw", w.reshape(3, 2), x) + b[None, :, None, None]
    assert np.allclose(run_reference(g, x)["c"], want, atol=1e-5)
    assert struct.calcsize("<f") == 4


# -- each op kernel vs the reference ------------------------------------------------------------

def _one_op(op: str, attrs: dict, shape=(2, 7, 13, 11), weights: dict | None = None,
            n_in: int = 1) -> Graph:
    rng = np.random.default_rng(5)
    nodes = [Node(f"pre{i}", "relu", ["x"], f"t{i}", {"slope": 0.5 + i}) for i in range(n_in)]
    node = Node("op", op, [f"t{i}" for i in range(n_in)], "y", attrs, {})
    g = Graph("one", "x", shape, nodes + [node], ["y"])
    for role, wshape in (weights or {}).items():
        g.weights[role] = (rng.uniform(0.5, 1.5, wshape) if role == "var" else rng.standard_normal(wshape)
                           ).astype(np.float32)
        node.weights[role] = role
    return g


OPS = [
    ("pool", {"kind": "max", "kernel": 3, "stride": 2, "ceil": True}),
    ("pool", {"kind": "max", "kernel": (3, 2), "stride": (1, 3), "pad": (1, 0, 1, 1)}),
    ("pool", {"kind": "avg", "kernel": 3, "stride": 2, "pad": 1, "ceil": True, "count_pad": True}),
    ("pool", {"kind": "avg", "kernel": 5, "stride": 3, "pad": 2, "count_pad": False}),
    ("pool", {"kind": "avg", "global": True}),
    ("pool", {"kind": "max", "global": True}),
    ("lrn", {"size": 5, "alpha": 0.3, "beta": 0.75, "k": 2.0}),
    ("relu", {"slope": 0.1, "clip": 0.7}),
    ("softmax", {}),
]


@pytest.mark.parametrize("op, attrs", OPS, ids=[f"{o}{i}" for i, (o, _) in enumerate(OPS)])
def test_op_kernels(ocl, op: str, attrs: dict) -> None:
    g = _one_op(op, attrs)
    _check(compile(g, backend="opencl", batch=2, passes=False), g, _x(g))


@pytest.mark.parametrize("c, attrs", [
    (1, {"size": 5, "beta": 0.75}), (7, {"size": 3, "alpha": 0.5, "beta": 0.5, "k": 1.5}),
    (8, {"size": 5, "alpha": 0.3, "beta": 0.75, "k": 2.0}), (13, {"size": 7, "alpha": 0.9, "beta": 1.0}),
    (17, {"size": 5, "alpha": 0.4, "beta": 0.6, "k": 0.5})])
def test_lrn_channel_blocks(ocl, c: int, attrs: dict) -> None:
    """LRN by blocks of LRN_CHANNELS channels: channel counts below, at and past a block (the
    window's halo zero outside the channels), each exponent's formula; float32 grade against
    the float64 reference, the output poisoned first."""
    from convforge.graph import ops

    g = _one_op("lrn", attrs, shape=(2, c, 5, 7))
    launch = ops.lrn(g.nodes[1], infer(g)["t0"], "t0", "y")
    assert launch.grid[0] * ops.BLOCK >= 2 * -(-c // ops.LRN_CHANNELS) * 35 and "pow(" not in launch.kernel.body
    net = compile(g, backend="opencl", batch=2, passes=False)
    x = 3 * _x(g)
    net.backend.fill(net.buf("y"), np.nan, net.backend.nbytes(net.buf("y")))
    assert rel_l2(net(x)["y"], run_reference(g, x)["y"]) < 2e-6


@pytest.mark.parametrize("pool", [
    {"kind": "max", "kernel": 3, "stride": 2, "ceil": True},
    {"kind": "avg", "kernel": 3, "stride": 2, "pad": (1, 0, 2, 1), "count_pad": True},
    {"kind": "avg", "kernel": 2, "stride": 1, "count_pad": False}])
def test_fuse_lrn_pool(ocl, pool: dict) -> None:
    """An LRN read only by a pool is folded into it (the normalised tensor is never written);
    the fused graph gives the reference's answer, on PoCL too, with channels past a block."""
    g = _one_op("lrn", {"size": 5, "alpha": 0.4, "beta": 0.75, "k": 1.0}, shape=(2, 11, 13, 12))
    g.nodes.append(Node("p", "pool", ["y"], "z", dict(pool), {}))
    g.outputs = ["z"]
    fused = passes.fuse_lrn_pool(g)
    assert [n.op for n in fused.nodes] == ["relu", "pool"] and fused.nodes[1].inputs == ["t0"]
    assert fused.nodes[1].attrs["lrn"]["alpha"] == 0.4 and "lrn" not in g.nodes[2].attrs
    _same(g, fused, 1e-12)
    x = 3 * _x(g)
    net = compile(g, backend="opencl", batch=2)
    assert [s.op for s in net.steps] == ["relu", "lrn+pool"]
    net.backend.fill(net.buf("z"), np.nan, net.backend.nbytes(net.buf("z")))
    assert rel_l2(net(x)["z"], run_reference(g, x)["z"]) < 2e-6


def test_fuse_lrn_pool_keeps_what_others_read() -> None:
    """An LRN that is a graph output, is read twice, or feeds a global pool stays its own op."""
    base = _one_op("lrn", {"size": 3}, shape=(1, 4, 6, 6))
    for extra, outputs in ((["p"], ["z", "y"]), (["p", "q"], ["z", "w"]), (["g"], ["z"])):
        g = base.copy()
        attrs = {"p": {"kind": "max", "kernel": 2, "stride": 2}, "q": {"kind": "avg", "kernel": 2, "stride": 2},
                 "g": {"kind": "avg", "global": True}}
        for name in extra:
            g.nodes.append(Node(name, "pool", ["y"], "z" if name != "q" else "w", attrs[name], {}))
        g.outputs = outputs
        assert [n.op for n in passes.fuse_lrn_pool(g).nodes].count("lrn") == 1


@pytest.mark.parametrize("shape", [(3, 1000, 1, 1), (2, 1001, 1, 1), (1, 7, 13, 11), (5, 300, 2, 3),
                                   (2, 4, 1, 1), (1, 1, 1, 1), (4, 1028, 1, 1)])
def test_softmax_one_work_group_per_row(ocl, shape) -> None:
    """Parallel max and sum per row in shared memory (float4 when rows are contiguous and a
    multiple of 4), on odd row lengths and strided rows; large logits check the max shift."""
    from convforge.graph import ops

    g = _one_op("softmax", {}, shape=shape)
    g.nodes[0].attrs = {"slope": 1.0}  # identity: keep the large negative logits too
    launch = ops.softmax(g.nodes[1], infer(g)["t0"], "t0", "y")
    rows = shape[0] * shape[2] * shape[3]
    assert launch.grid == (rows, 1, 1) and launch.kernel.block[0] == ops._row_threads(
        shape[1] // 4 if rows == shape[0] and shape[1] % 4 == 0 else shape[1])
    assert ("VLOAD4" in launch.kernel.body) == (shape[1] % 4 == 0 and shape[2] * shape[3] == 1)
    x = 30 * _x(g)
    net = compile(g, backend="opencl", batch=shape[0], passes=False)
    ref = run_reference(g, x)
    assert rel_l2(net(x)["y"], ref["y"]) < 1e-5
    assert np.allclose(net(x)["y"].sum(axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("shape", [(2, 3, 17, 19), (3, 5, 16, 12), (1, 2, 5, 7), (2, 1, 31, 31)])
def test_global_pool_rows(ocl, kind: str, shape) -> None:
    """Global pooling: a work-group per long row (float4 when its length is a multiple of 4),
    one thread per short row; checked against the reference either way."""
    from convforge.graph import ops

    g = _one_op("pool", {"kind": kind, "global": True}, shape=shape)
    shapes = infer(g)
    launch = ops.pool(g.nodes[1], shapes["t0"], shapes["y"], "t0", "y")
    long_rows = shape[2] * shape[3] >= ops.ROW_MIN
    assert (launch.grid == (shape[0] * shape[1], 1, 1)) == long_rows
    assert ("VLOAD4" in launch.kernel.body) == (long_rows and shape[2] * shape[3] % 4 == 0)
    _check(compile(g, backend="opencl", batch=shape[0], passes=False), g, _x(g))


def test_batchnorm_add_concat_kernels(ocl) -> None:
    c = 7
    bn = _one_op("batchnorm", {"eps": 1e-3}, weights={"mean": (c,), "var": (c,), "gamma": (c,), "beta": (c,)})
    _check(compile(bn, backend="opencl", batch=2, passes=False), bn, _x(bn))
    add = _one_op("add", {"relu": True}, n_in=3)
    _check(compile(add, backend="opencl", batch=2, passes=False), add, _x(add))
    cat = _one_op("concat", {}, n_in=3)
    cat.nodes[1].op = "pool"
    cat.nodes[1].attrs = {"kind": "max", "kernel": 1}
    _check(compile(cat, backend="opencl", batch=2, passes=False), cat, _x(cat))


# -- passes -------------------------------------------------------------------------------------

def test_passes_keep_the_output() -> None:
    g = load_prototxt(SMALL, seed=4)
    g.outputs = ["prob", "gp"]
    for p in passes.PASSES:
        after = p(g)
        _same(g, after)
        g = after
    ops = [n.op for n in g.nodes]
    assert "batchnorm" not in ops and "scale" not in ops and "dropout" not in ops
    assert ops.count("relu") == 1  # the leaky one stays; the plain one is fused into c1
    c1 = next(n for n in g.nodes if n.name == "c1")
    assert c1.attrs.get("relu") and c1.weights["bias"] != "c1.bias"


def test_residual_epilogue_on_families(ocl) -> None:
    """conv + bias + residual + ReLU in one store, on every family that states a residual path."""
    from convforge.kernels import all_variants
    from convforge.plan import Epilogue
    from convforge.reference import conv2d_ref
    from convforge.spec import ConvSpec

    epi = Epilogue(bias=True, relu=True, residual=True)
    rng = np.random.default_rng(9)
    tried = set()
    for spec in (ConvSpec.make(2, 5, 9, 7, 6, 3, 3, 1, (1, 0, 1, 1)), ConvSpec.make(1, 16, 5, 5, 8, 1, 1)):
        x, w = rng.standard_normal(spec.x_shape), rng.standard_normal(spec.w_shape)
        b, res = rng.standard_normal(spec.k), rng.standard_normal(spec.y_shape)
        want = np.maximum(conv2d_ref(x, w, spec, b) + res, 0.0)
        for v in all_variants():
            if v.applies(spec, ocl.device) is not None:
                continue
            if not v.residual_ok:
                with pytest.raises(ValueError, match="unsupported epilogue"):
                    v.plan(spec, v.default(spec, ocl.device), ocl.device, epi).source("opencl")
                continue
            if (v.family, spec) in tried:  # one variant per family and shape keeps the compiles few
                continue
            tried.add((v.family, spec))
            exe = ocl.executable(v.plan(spec, v.default(spec, ocl.device), ocl.device, epi))
            y = np.full(spec.y_shape, np.nan, np.float32)
            bufs = {"x": ocl.upload(x), "w": ocl.upload(w), "bias": ocl.upload(b), "res": ocl.upload(res),
                    "y": ocl.upload(y)}
            exe(bufs)
            assert rel_l2(ocl.download(bufs["y"], spec.y_shape), want) < 1e-5, v.name
    assert {"direct", "implicit_gemm", "im2col", "gemm1x1"} <= {f for f, _ in tried}


def test_residual_fusion_and_its_fallback(ocl, monkeypatch) -> None:
    from convforge.kernels import all_variants

    g = load_prototxt(SMALL, seed=6)
    g.outputs = ["prob", "gp"]
    fused = passes.optimize(g)
    c2 = next(n for n in fused.nodes if n.name == "c2")
    assert c2.inputs == ["c1", "c1"] and "add" not in [n.op for n in fused.nodes]
    _same(g, fused)
    net = compile(g, batch=2, backend="opencl")
    _check(net, g, _x(g))
    for v in all_variants():
        monkeypatch.setattr(type(v), "residual_ok", False)
    fallback = compile(g, batch=2, backend="opencl")
    assert any(s.node == "c2+add" for s in fallback.steps)
    _check(fallback, g, _x(g))


INCEPTION = """
input: "data" input_shape { dim: 2 dim: 6 dim: 9 dim: 7 }
layer { name: "a" type: "Convolution" bottom: "data" top: "a" convolution_param { num_output: 5 kernel_size: 1 } }
layer { name: "ra" type: "ReLU" bottom: "a" top: "a" }
layer { name: "b" type: "Convolution" bottom: "data" top: "b"
        convolution_param { num_output: 3 kernel_size: 3 pad: 1 } }
layer { name: "p" type: "Pooling" bottom: "data" top: "p" pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 } }
layer { name: "c" type: "Convolution" bottom: "p" top: "c"
        convolution_param { num_output: 4 kernel_size: 5 pad: 2 bias_term: false } }
layer { name: "cat" type: "Concat" bottom: "a" bottom: "b" bottom: "c" top: "cat" }
layer { name: "gp" type: "Pooling" bottom: "cat" top: "gp" pooling_param { pool: AVE global_pooling: true } }
"""


@pytest.mark.parametrize("algo", ["direct", "implicit_gemm", "im2col"])
def test_concat_in_place(ocl, monkeypatch, algo: str) -> None:
    """Each producer writes at its channel offset (no copy); checked with variants that do."""
    from convforge import dispatch
    from convforge.graph import runtime

    g = load_prototxt(INCEPTION, seed=2)
    g.outputs = ["cat", "gp"]
    marked = passes.optimize(g)
    assert next(n for n in marked.nodes if n.op == "concat").attrs["in_place"]
    _same(g, marked)
    real = dispatch.choose
    monkeypatch.setattr(runtime.dispatch, "choose", lambda spec, be, epi, **kw: real(spec, be, epi, algo=algo))
    net = compile(g, batch=2, backend="opencl")
    assert set(net.into) == {"a", "b", "c"} and not [s for s in net.steps if s.op == "concat"]
    convs = [s for s in net.steps if s.op == "conv"]
    assert len(convs) == 3 and all(s.variant.endswith(f"_at{off}of12") for s, off in zip(convs, (0, 5, 8)))
    _check(net, g, _x(g))


TWIN = """
input: "data" input_shape { dim: 1 dim: 8 dim: 12 dim: 12 }
layer { name: "a" type: "Convolution" bottom: "data" top: "a"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "b" type: "Convolution" bottom: "a" top: "b"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
"""


@pytest.mark.parametrize("algo", ["winograd_fused_f2", "winograd_nonfused_f2", "im2win"])
def test_filter_transforms_run_once_per_layer(ocl, monkeypatch, algo: str) -> None:
    """Two layers of one shape share an executable but keep their own transformed filters."""
    from convforge import dispatch, kernels
    from convforge.graph import runtime

    g = load_prototxt(TWIN, seed=8)
    v = kernels.get_variant(algo)
    spec = runtime.conv_spec(g.nodes[0], infer(g)["data"])
    plan = v.plan(spec, v.default(spec, ocl.device), ocl.device)
    once = sorted(ocl.executable(plan).weight_steps)
    assert len(once) == 1 and "w" in plan.steps[once[0]].args  # the filter transform, nothing else
    real = dispatch.executable
    monkeypatch.setattr(runtime.dispatch, "executable", lambda spec, be, epi, **kw: real(spec, be, epi, algo=algo))
    net = compile(g, backend="opencl", passes=False)
    assert net.transformed_bytes == 2 * sum(b for n, b in plan.workspace if n in plan.steps[once[0]].args)
    _check(net, g, _x(g))
    _check(net, g, _x(g, seed=4))  # a second call: the hoisted transforms are still in place


ARENA = """
input: "data" input_shape { dim: 2 dim: 5 dim: 13 dim: 11 }
layer { name: "a" type: "Convolution" bottom: "data" top: "a"
        convolution_param { num_output: 7 kernel_size: 3 pad: 1 } }
layer { name: "b" type: "Convolution" bottom: "a" top: "b"
        convolution_param { num_output: 6 kernel_size: 5 pad: 2 stride: 2 } }
layer { name: "c" type: "Convolution" bottom: "b" top: "c"
        convolution_param { num_output: 9 kernel_size: 3 pad: 1 } }
layer { name: "d" type: "Convolution" bottom: "c" top: "d"
        convolution_param { num_output: 3 kernel_size: 1 } }
"""


def test_conv_workspaces_share_one_arena(ocl, monkeypatch) -> None:
    """Scratch workspaces do not add up across layers: one arena of the largest need (rank by
    rank) serves them all, no executable allocates its own, filter transforms stay per layer."""
    from convforge import dispatch
    from convforge.graph import runtime

    algos = {3: "winograd_nonfused_f2", 5: "im2col", 1: "im2col"}
    dispatch.clear_executables()  # executables of earlier tests may hold workspaces of their own
    real = dispatch.executable
    monkeypatch.setattr(runtime.dispatch, "executable",
                        lambda spec, be, epi, **kw: real(spec, be, epi, algo=algos[spec.r]))
    g = load_prototxt(ARENA, seed=5)
    net = compile(g, batch=2, backend="opencl", passes=False)
    plans = [e.plan for e in net._execs]
    scratch = [sorted((b for n, b in p.workspace if n not in e.derived), reverse=True)
               for p, e in zip(plans, net._execs, strict=True)]
    assert all(scratch) and sum(map(sum, scratch)) > net.arena_bytes  # it would have added up
    width = max(map(len, scratch))
    want = sum(max((s[i] for s in scratch if len(s) > i), default=0) for i in range(width))
    assert net.arena_bytes == want >= max(map(sum, scratch))
    assert all(e.own_bytes == 0 for e in net._execs) and net.workspace_bytes == net.arena_bytes
    derived = sum(b for p, e in zip(plans, net._execs, strict=True) for n, b in p.workspace if n in e.derived)
    assert net.transformed_bytes == derived > 0
    for seed in (1, 2):  # layers overwrite each other's scratch: the second call must still be right
        _check(net, g, _x(g, seed))


def test_a_network_is_freed_without_the_garbage_collector(ocl) -> None:
    """No reference cycle holds a network (its device memory) once the last reference goes:
    calibration builds probe networks one after another and relies on it."""
    import gc
    import weakref

    g = load_prototxt(ARENA, seed=5)
    net = compile(g, batch=2, backend="opencl", error_budget=0)
    gone = weakref.ref(net)
    was = gc.isenabled()
    gc.disable()
    try:
        del net
        assert gone() is None, "a reference cycle keeps the network alive until the collector runs"
    finally:
        if was:
            gc.enable()


def test_fold_batchnorm_needs_a_sole_reader() -> None:
    g = load_prototxt(SMALL, seed=4)
    g.nodes.insert(1, Node("tap", "relu", ["c1"], "tap", {}))
    g.outputs = ["gp", "tap"]
    after = passes.fold_batchnorm(g)
    assert [n.op for n in after.nodes].count("batchnorm") == 1  # c1 is read twice: not folded
    _same(g, after)


def test_memory_plan_reuses_slots_without_overlap() -> None:
    from convforge.graph.caffe import load_shipped

    g = passes.optimize(load_shipped("googlenet", input_size=64))
    shapes = infer(g)
    mp = plan_memory(g, shapes)
    every = sum(t.nbytes for t in shapes.values())
    assert mp.bytes < every / 3
    live: dict[int, str] = {mp.slot_of[g.input]: g.input}
    last = {t: i for i, n in enumerate(g.nodes) for t in n.inputs}
    for i, node in enumerate(g.nodes):
        slot = mp.slot_of[node.output]
        assert mp.sizes[slot] >= shapes[node.output].nbytes
        other = live.get(slot)
        assert other is None or last.get(other, -1) < i or node.op in ("flatten",), f"{node.name} overwrites {other}"
        assert slot not in {mp.slot_of[t] for t in node.inputs} or node.op == "flatten"
        live[slot] = node.output


# -- whole networks -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, size", [("alexnet", 67), ("nin", 67), ("googlenet", 64)])
def test_network_end_to_end(ocl, name: str, size: int) -> None:
    from convforge.graph.caffe import load_shipped

    g = load_shipped(name, input_size=size, seed=7)
    logits = g.producer(g.outputs[0]).inputs[0]  # softmax flattens errors: check its input too
    g.outputs = [logits, g.outputs[0]]
    net = compile(g, batch=1, backend="opencl", error_budget=0)  # the kernels' own error (calibration: its tests)
    assert net.graph.outputs == g.outputs  # the declared names, through every pass (and in _check's net(x))
    assert len(net.steps) < len(g.nodes)  # the passes fused something
    _check(net, g, _x(g), tol=1e-4)
    assert net.peak_bytes == (net.memory.bytes + net.weight_bytes + net.transformed_bytes
                              + net.workspace_bytes) > 0


def test_compile_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"batch \(0\)"):
        compile("alexnet", batch=0, backend="opencl")
    with pytest.raises(ValueError, match="model .'lenet'. must be one of"):
        compile("lenet", backend="opencl")


# -- ONNX ---------------------------------------------------------------------------------------

def _onnx_model():
    onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install 'convforge[onnx]')")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    init = lambda name, *shape: numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)  # noqa: E731
    var = numpy_helper.from_array(rng.uniform(0.5, 1.5, 6).astype(np.float32), "var")
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 0, 2, 1], strides=[2, 1]),
        helper.make_node("BatchNormalization", ["c1", "g", "be", "m", "var"], ["bn"], name="bn", epsilon=1e-3),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["r", "c2"], ["s"], name="add"),
        helper.make_node("LRN", ["s"], ["n"], name="lrn", size=3, alpha=0.2, beta=0.75, bias=1.5),
        helper.make_node("MaxPool", ["n"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
        helper.make_node("AveragePool", ["n"], ["q"], name="avg", kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1], ceil_mode=1),
        helper.make_node("GlobalAveragePool", ["q"], ["gq"], name="gap"),
        helper.make_node("Concat", ["p", "p"], ["cat"], name="cat", axis=1),
        helper.make_node("Dropout", ["cat"], ["d"], name="drop"),
        helper.make_node("Flatten", ["d"], ["f"], name="flat", axis=1),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["fc"], name="fc", transB=1),
        helper.make_node("Softmax", ["fc"], ["y"], name="softmax", axis=1),
    ]
    inits = [init("w1", 6, 3, 3, 3), init("b1", 6), init("g", 6), init("be", 6), init("m", 6), var,
             init("w2", 6, 6, 3, 3), init("wf", 5, 12 * 5 * 3), init("bf", 5)]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 17, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5]),
                               helper.make_tensor_value_info("gq", TensorProto.FLOAT, ["N", 6, 1, 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def test_onnx_front_end_runs(ocl, tmp_path) -> None:
    from convforge.graph.from_onnx import load_onnx

    model = _onnx_model()
    g = load_onnx(model, batch=2)
    assert infer(g)["c1"].shape == (2, 6, 9, 6)
    assert g.outputs == ["y", "gq"]
    path = tmp_path / "tiny.onnx"
    path.write_bytes(model.SerializeToString())
    net = compile(str(path), batch=2, backend="opencl")
    _check(net, g, _x(g))


def test_onnx_unknown_op_is_refused() -> None:
    from convforge.graph.from_onnx import load_onnx

    model = _onnx_model()
    model.graph.node[5].op_type = "Erf"
    with pytest.raises(GraphError, match=r"node 'lrn' \(Erf\): unknown ONNX op type"):
        load_onnx(model)


# -- torch.fx -----------------------------------------------------------------------------------

def _fx_graph_is_the_module(torch, m, g) -> None:  # type: ignore[no-untyped-def]
    """The traced graph's float64 reference run is the module's output, and its PoCL compile checks."""
    x = _x(g)
    with torch.no_grad():
        want = m(torch.from_numpy(x)).numpy()
    assert rel_l2(run_reference(g, x)[g.outputs[0]], want) < 1e-5
    _check(compile(g, backend="opencl"), g, x)


def test_fx_front_end(ocl) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'convforge[torch]')")
    from convforge.graph.fx import from_module

    nn = torch.nn

    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.pool = nn.MaxPool2d(2)
            self.fc = nn.Linear(8 * 6 * 6, 10)

        def forward(self, x):  # type: ignore[no-untyped-def]
            y = torch.relu(self.bn(self.conv(x)))
            y = self.pool(y) + self.pool(y)
            return torch.softmax(self.fc(torch.flatten(y, 1)), dim=1)

    m = Small().eval()
    with torch.no_grad():
        m.bn.running_var.uniform_(0.5, 1.5)
        m.bn.running_mean.normal_()
    _fx_graph_is_the_module(torch, m, from_module(m, input_size=12, channels=3))


def test_fx_front_end_takes_modern_activations(ocl) -> None:
    """SiLU, Hardswish, GELU, Mish after convs (folded into their epilogues), Sigmoid, Tanh, Hardsigmoid as
    modules and functions: the traced graph runs on PoCL as the module does."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'convforge[torch]')")
    from convforge.graph.fx import from_module

    nn, F = torch.nn, torch.nn.functional

    class Acts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(5))
            self.acts = nn.ModuleList([nn.SiLU(), nn.Hardswish(), nn.GELU(), nn.Mish(), nn.Hardsigmoid()])

        def forward(self, x):  # type: ignore[no-untyped-def]
            for conv, act in zip(self.c, self.acts, strict=True):
                x = act(conv(x))
            return torch.tanh(F.mish(torch.sigmoid(F.silu(x)) + F.hardswish(x)))

    m = Acts().eval()
    _fx_graph_is_the_module(torch, m, from_module(m, input_size=9, channels=4))
    with pytest.raises(GraphError, match="approximate"):
        from_module(nn.Sequential(nn.Conv2d(3, 3, 1), nn.GELU(approximate="tanh")), input_size=4)


@pytest.mark.parametrize("name", ["alexnet", "googlenet", "resnet50"])
def test_torch_baseline_runs_the_same_graph(name: str) -> None:
    """The PyTorch comparison of ``convforge run`` computes the graph the reference computes."""
    pytest.importorskip("torch", reason="torch is not installed (pip install 'convforge[torch]')")
    from convforge.graph.caffe import load_shipped
    from convforge.graph.torch_reference import forward_fn

    g = load_shipped(name, input_size=48 if name != "alexnet" else 67, seed=1)
    g.outputs = [g.producer(g.outputs[0]).inputs[0]]
    x = _x(g)
    got = forward_fn(g, x, "cpu")().numpy()
    assert rel_l2(got, run_reference(g, x)[g.outputs[0]]) < 1e-4


@pytest.mark.parametrize("attrs", [
    {"kind": "max", "kernel": 3, "stride": 2, "pad": (1, 0, 2, 1), "ceil": True},
    {"kind": "avg", "kernel": 3, "stride": 2, "pad": (1, 0, 2, 1), "count_pad": True},
    {"kind": "avg", "kernel": 3, "stride": 2, "pad": 1, "ceil": True, "count_pad": False},
    {"kind": "max", "kernel": 3, "stride": 2, "ceil": True, "lrn": {"size": 5, "alpha": 0.4, "beta": 0.75}}])
def test_torch_baseline_pools(attrs: dict) -> None:
    """PyTorch's pools for the comparison: unequal padding (explicit), a fused LRN, as the
    reference computes them; an average that skips unequal padding is refused by name."""
    pytest.importorskip("torch", reason="torch is not installed (pip install 'convforge[torch]')")
    from convforge.graph.torch_reference import forward_fn

    g = _one_op("pool", attrs, shape=(2, 11, 13, 12))
    x = _x(g)
    assert rel_l2(forward_fn(g, x, "cpu")().numpy(), run_reference(g, x)["y"]) < 1e-6
    g.nodes[1].attrs.update(kind="avg", count_pad=False, pad=(1, 0, 2, 1))
    with pytest.raises(ValueError, match="node 'op': PyTorch has no average pool that skips padding"):
        forward_fn(g, x, "cpu")()


def test_cli_run_and_tune_net(ocl, tmp_path, capsys) -> None:
    from convforge.cli import main

    path = tmp_path / "small.prototxt"
    path.write_text(INCEPTION)
    assert main(["run", "--net", str(path), "--batch", "2", "--backend", "opencl", "--repeats", "2",
                 "--out", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "images/s" in out and "peak memory" in out and "relative error" in out and "gp " in out
    assert "PyTorch: not run: this run is opencl" in out and "shared arena" in out
    res = json.loads((tmp_path / "runs" / "run-small-n2-opencl.json").read_text())
    assert res["summary"] in out and res["summary"].startswith("| small | 2 | opencl | ")
    assert res["summary"].count("|") == SUMMARY_HEADER.count("|") and "n/a" in res["summary"]
    assert res["ours_ms"] > 0 and res["logits_error"] == res["errors"]["gp"] < 1e-4
    assert {"a", "b", "c", "gp"} <= {r["layer"] for r in res["layers"]} and all(r["ms"] > 0 for r in res["layers"])
    db = tmp_path / "tune.db"
    assert main(["tune", "--net", str(path), "--batch", "2", "--backend", "opencl", "--budget", "2",
                 "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "3 distinct conv/fc layer(s)" in out and "3 layer(s) tuned or known, 0 failed" in out
    assert main(["run", "--net", "nosuch", "--backend", "opencl"]) == 2


def test_run_on_opencl_needs_no_cuda(ocl, tmp_path) -> None:
    """`convforge run --backend opencl` (Boda's experiment on a GPU machine) with CuPy and torch
    made unimportable: it still runs, and says the PyTorch baseline was not run and why."""
    import subprocess
    import sys

    path = tmp_path / "small.prototxt"
    path.write_text(SMALL)
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['torch'] = None; "
            "from convforge.cli import main; "
            f"sys.exit(main(['run', '--net', {str(path)!r}, '--backend', 'opencl', '--repeats', '2']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PyTorch: not run: this run is opencl" in done.stdout
    assert "| small | 2 | opencl |" in done.stdout and "batch 2 (declared by the description" in done.stdout
    assert "cupy" not in done.stderr.lower()


def test_random_batchnorm_statistics_keep_the_signal_in_float16_range() -> None:
    """Shipped ResNet-50 with random weights: every batch norm's statistics are measured on random
    images (two at 224 x 224), so it normalises what reaches it (zero mean, unit variance per channel
    on those images); on
    other images every activation stays far inside float16's range (with made-up statistics res5c
    reached 6.7e4, past 65504) and the logits still depend on the input. A caffemodel's statistics
    are its own (not re-measured)."""
    from convforge.graph.caffe import load_shipped
    from convforge.graph.reference import calibrate_batchnorm

    g = load_shipped("resnet50", batch=2, seed=3)
    bn = next(n for n in g.nodes if n.op == "batchnorm")
    probe = g.with_batch(2)  # res5's 7 x 7 planes: 2 images give each statistic >= 64 values
    probe.outputs = [bn.inputs[0]]
    x = np.random.default_rng(3).standard_normal(probe.input_shape).astype(np.float32)
    seen = run_reference(probe, x, np.float32)[bn.inputs[0]]
    assert np.allclose(g.weights[bn.weights["mean"]], seen.mean(axis=(0, 2, 3)), rtol=1e-4, atol=1e-5)
    assert np.allclose(g.weights[bn.weights["var"]], seen.var(axis=(0, 2, 3)), rtol=1e-4, atol=1e-5)
    g.outputs = [n.output for n in g.nodes]
    out = run_reference(g, np.random.default_rng(11).standard_normal(g.input_shape), np.float32)
    assert max(float(np.abs(v).max()) for v in out.values()) < 1e3
    logits = out["fc1000"]
    assert np.linalg.norm(logits[0] - logits[1]) > 0.05 * np.linalg.norm(logits)
    assert calibrate_batchnorm(load_shipped("alexnet", batch=1)) == 0  # no batch norm: nothing to set



def test_random_resnet_is_no_more_sensitive_than_a_trained_one() -> None:
    """The last batch norm of each of ResNet-50's 16 residual branches (not the 4 projection
    shortcuts' beside them) normalises to RESIDUAL_GAIN: at 96 x 96 a 1e-3 change of the input then
    moves the logits by well under 1e-2 (5.8e-3 measured; with unit branches 4e-2: a chaotic net that
    amplifies every implementation's rounding), while other images still give other logits."""
    from convforge.graph.caffe import load_shipped
    from convforge.graph.reference import RESIDUAL_GAIN, calibrate_batchnorm, residual_branch_norms

    g = load_shipped("resnet50", batch=1, input_size=96)
    branch = residual_branch_norms(g)
    assert len(branch) == 16 and all(name.endswith("branch2c") for name in branch), sorted(branch)
    logits = g.producer(g.outputs[0]).inputs[0]
    g.outputs = [logits]
    rng = np.random.default_rng(5)
    x = rng.standard_normal(g.input_shape)

    def sensitivity() -> float:
        a = run_reference(g, x)[logits]
        b = run_reference(g, x * (1 + 1e-3 * rng.standard_normal(x.shape)))[logits]
        other = run_reference(g, rng.standard_normal(x.shape))[logits]
        assert np.linalg.norm(other - a) > 0.1 * np.linalg.norm(a)  # the logits depend on the image
        return float(np.linalg.norm(b - a) / np.linalg.norm(a))

    assert sensitivity() < 1e-2
    assert RESIDUAL_GAIN < 1
    calibrate_batchnorm(g, residual_gain=1.0)
    assert sensitivity() > 2e-2  # unit branches: the chaotic net this guards against
    with pytest.raises(ValueError, match=r"residual_gain \(0\) must be in \(0, 1\]"):
        calibrate_batchnorm(g, residual_gain=0)

def test_caffemodel_statistics_are_kept(tmp_path) -> None:
    """Statistics given by a caffemodel are the network's: fill_weights leaves them as read."""
    from convforge.graph.caffe import fill_weights

    g = load_prototxt(SMALL, seed=4)
    blobs = {n.name: [np.asarray(g.weights[k]).copy() for k in n.weights.values()] for n in g.nodes if n.weights}
    for n in g.nodes:
        if n.op == "batchnorm":
            blobs[n.name] = [np.full_like(blobs[n.name][0], 0.25), np.full_like(blobs[n.name][1], 4.0)] \
                + blobs[n.name][2:]
    fill_weights(g, 0, blobs)
    bn = next(n for n in g.nodes if n.op == "batchnorm")
    assert (g.weights[bn.weights["mean"]] == 0.25).all() and (g.weights[bn.weights["var"]] == 4.0).all()
