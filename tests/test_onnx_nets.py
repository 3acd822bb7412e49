"""Small networks of modern CNNs' ONNX ops, end to end on PoCL: an EfficientNet-like block graph
(conv -> BN -> SiLU -> depthwise conv -> SE block -> conv -> residual add), a MobileNet-v3-like
one (HardSwish, an SE block gated by HardSigmoid, ReLU6), and a tiny UNet (conv, max pool,
ConvTranspose and Resize up, Concat with the skips), each built with ``onnx.helper`` and compared
with ``onnx.reference`` and the float64 executor by relative L2 error; then ``convforge run --net
model.onnx`` on one; then the same kinds of models written by ``torch.onnx.export`` (where torch is
installed) against PyTorch's own output.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from convforge.graph.build import compile
from convforge.graph.reference import run_reference
from convforge.reference import rel_l2

onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install 'convforge[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from convforge.graph.from_onnx import load_onnx  # noqa: E402

TOL = 5e-6  # FP32 kernels on small networks against float64 (and onnx.reference's float32)


class Builder:
    """Nodes and initializers of a model under construction (random weights, seeded)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: dict[str, np.ndarray] = {}
        self.count = 0

    def const(self, value: np.ndarray) -> str:
        self.count += 1
        name = f"k{self.count}"
        self.inits[name] = np.asarray(value)
        return name

    def op(self, kind: str, ins: list[str], **attrs) -> str:  # type: ignore[no-untyped-def]
        self.count += 1
        out = f"{kind.lower()}{self.count}"
        self.nodes.append(helper.make_node(kind, ins, [out], name=out, **attrs))
        return out

    def conv(self, x: str, c: int, k: int, r: int, bias: bool = True, group: int = 1, **attrs) -> str:  # type: ignore[no-untyped-def]
        w = self.rng.standard_normal((k, c // group, r, r)) * np.sqrt(2.0 / (c // group * r * r))
        ins = [x, self.const(w.astype(np.float32))]
        if bias:
            ins.append(self.const((0.1 * self.rng.standard_normal(k)).astype(np.float32)))
        if "pads" not in attrs and "auto_pad" not in attrs:
            attrs["pads"] = [r // 2] * 4
        return self.op("Conv", ins, group=group, **attrs)

    def bn(self, x: str, c: int) -> str:
        vals = [1 + 0.1 * self.rng.standard_normal(c), 0.1 * self.rng.standard_normal(c),
                0.1 * self.rng.standard_normal(c), self.rng.uniform(0.5, 1.5, c)]
        return self.op("BatchNormalization", [x, *(self.const(v.astype(np.float32)) for v in vals)], epsilon=1e-3)

    def silu(self, x: str) -> str:
        return self.op("Mul", [x, self.op("Sigmoid", [x])])

    def model(self, x_shape: tuple[int, ...], out: str, opset: int = 17):  # type: ignore[no-untyped-def]
        self.nodes.append(helper.make_node("Identity", [out], ["y"], name="out"))
        tensors = [numpy_helper.from_array(v, k) for k, v in self.inits.items()]
        graph = helper.make_graph(self.nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], tensors)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def mbconv(b: Builder, x: str, c: int, expand: int, stride: int) -> str:
    """EfficientNet's MBConv: expand 1x1 -> BN -> SiLU -> depthwise 3x3 -> BN -> SiLU -> SE (global
    average pool, 1x1 -> SiLU -> 1x1 -> sigmoid, times the features) -> project 1x1 -> BN (+ x)."""
    e = c * expand
    h = b.silu(b.bn(b.conv(x, c, e, 1, bias=False), e))
    h = b.silu(b.bn(b.conv(h, e, e, 3, bias=False, group=e, strides=[stride] * 2, auto_pad="SAME_UPPER"), e))
    s = b.op("GlobalAveragePool", [h])
    s = b.op("Sigmoid", [b.conv(b.silu(b.conv(s, e, max(1, c // 4), 1)), max(1, c // 4), e, 1)])
    h = b.op("Mul", [h, s])
    h = b.bn(b.conv(h, e, c, 1, bias=False), c)
    return b.op("Add", [h, x]) if stride == 1 else h


def efficientnet_like():  # type: ignore[no-untyped-def]
    b = Builder(11)
    h = b.silu(b.bn(b.conv("x", 3, 8, 3, bias=False, strides=[2, 2], auto_pad="SAME_UPPER"), 8))
    h = mbconv(b, h, 8, 4, 1)
    h = mbconv(b, h, 8, 3, 2)
    h = b.silu(b.bn(b.conv(h, 8, 24, 1, bias=False), 24))
    h = b.op("Flatten", [b.op("GlobalAveragePool", [h])])
    h = b.op("Gemm", [h, b.const(b.rng.standard_normal((10, 24)).astype(np.float32)),
                      b.const(b.rng.standard_normal(10).astype(np.float32))], transB=1)
    return b.model([2, 3, 23, 19], b.op("Softmax", [h], axis=1))


def mobilenet_v3_like():  # type: ignore[no-untyped-def]
    """Conv -> BN -> HardSwish, a depthwise block with an SE gated by HardSigmoid (ReLU inside),
    ReLU6 (Clip), a 1x1 projection; ReduceMean head, MatMul + Add classifier -> HardSwish."""
    b = Builder(12)
    h = b.op("HardSwish", [b.bn(b.conv("x", 3, 8, 3, bias=False, strides=[2, 2]), 8)])
    h = b.op("HardSwish", [b.bn(b.conv(h, 8, 8, 3, bias=False, group=8), 8)])
    s = b.op("ReduceMean", [h], axes=[2, 3], keepdims=1)
    s = b.op("HardSigmoid", [b.conv(b.op("Relu", [b.conv(s, 8, 4, 1)]), 4, 8, 1)], alpha=1 / 6, beta=0.5)
    h = b.op("Mul", [h, s])
    h = b.op("Clip", [b.bn(b.conv(h, 8, 16, 1, bias=False), 16), b.const(np.float32(0)), b.const(np.float32(6))])
    h = b.op("ReduceMean", [h], axes=[2, 3], keepdims=0)
    h = b.op("MatMul", [h, b.const(b.rng.standard_normal((16, 12)).astype(np.float32))])
    h = b.op("Add", [h, b.const(b.rng.standard_normal(12).astype(np.float32))])
    return b.model([2, 3, 17, 21], b.op("HardSwish", [h]))


def tiny_unet():  # type: ignore[no-untyped-def]
    """Two levels down (conv, ReLU, max pool), up by ConvTranspose (output_padding for the odd
    width) and by Resize (nearest), each concatenated with its skip; a 1x1 conv and a sigmoid out."""
    b = Builder(13)
    e1 = b.op("Relu", [b.bn(b.conv("x", 3, 8, 3), 8)])
    e2 = b.op("Relu", [b.conv(b.op("MaxPool", [e1], kernel_shape=[2, 2], strides=[2, 2]), 8, 12, 3)])
    m = b.op("Relu", [b.conv(b.op("MaxPool", [e2], kernel_shape=[2, 2], strides=[2, 2]), 12, 12, 3)])
    w = (b.rng.standard_normal((12, 12, 2, 2)) * 0.3).astype(np.float32)
    u2 = b.op("ConvTranspose", [m, b.const(w), b.const(np.zeros(12, np.float32))], strides=[2, 2],
              output_padding=[0, 1])
    d2 = b.op("Relu", [b.conv(b.op("Concat", [u2, e2], axis=1), 24, 8, 3)])
    pad = b.const(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
    u1 = b.op("Resize", [d2, "", b.const(np.array([1, 1, 2, 2], np.float32))], mode="nearest",
              coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    d1 = b.op("Relu", [b.conv(b.op("Pad", [b.op("Concat", [u1, e1], axis=1), pad]), 16, 8, 3, pads=[0, 0, 0, 0])])
    return b.model([2, 3, 16, 18], b.op("Sigmoid", [b.conv(d1, 8, 2, 1)]))


NETS = {"efficientnet_like": efficientnet_like, "mobilenet_v3_like": mobilenet_v3_like, "tiny_unet": tiny_unet}


@pytest.mark.parametrize("name", NETS)
def test_network_against_onnx_reference(ocl, name: str) -> None:
    m = NETS[name]()
    g = load_onnx(m)
    x = np.random.default_rng(3).standard_normal(g.input_shape).astype(np.float32)
    net = compile(m, backend="opencl", error_budget=None)
    got = net(x)["y"]
    ref = run_reference(g, x)["y"]
    want = ReferenceEvaluator(m).run(None, {"x": x})[0]
    assert rel_l2(want, ref) < TOL, "onnx.reference and the float64 executor disagree"
    assert rel_l2(got, ref) < TOL and rel_l2(got, want) < TOL, (rel_l2(got, ref), rel_l2(got, want))
    ops = [n.op for n in net.graph.nodes]
    if name == "efficientnet_like":  # every SiLU after a conv is in its epilogue; BN folded, residual fused
        assert "batchnorm" not in ops and ops.count("add") == 0  # BN folded, the residual in the conv
        assert [n.attrs["fn"] for n in net.graph.nodes if n.op == "act"] == ["sigmoid", "sigmoid"]  # SE gates
        assert sum(n.attrs.get("act") == "silu" for n in net.graph.nodes) == 8
    if name == "mobilenet_v3_like":
        assert {n.attrs.get("act") for n in net.graph.nodes if n.op in ("conv", "fc")} >= {"hardswish"}
    if name == "tiny_unet":
        assert "pad" not in ops and "deconv" in ops and "resize" in ops


def test_convforge_run_on_an_onnx_file(ocl, tmp_path, capsys) -> None:
    """``convforge run --net model.onnx`` builds, checks against float64, calibrates and times it."""
    from convforge.cli import main

    path = tmp_path / "effnet.onnx"
    path.write_bytes(efficientnet_like().SerializeToString())
    assert main(["run", "--net", str(path), "--backend", "opencl", "--repeats", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "relative error vs the float64 reference" in out and "| effnet | 2 | opencl |" in out
    res = json.loads((tmp_path / "run-effnet-n2-opencl.json").read_text())
    assert res["logits_error"] < 1e-5 and res["errors"]["y"] < 1e-5
    assert any("silu" in r["variant"] for r in res["layers"])


# -- onnxruntime as the calibration's second bar ---------------------------------------------------------

def test_onnxruntime_reference_runs_fixed_batches_and_inner_tensors() -> None:
    """``onnxruntime_reference.outputs``: a model of a fixed batch (2) given 3 images runs in two
    chunks (the last padded); a tensor inside the graph is added as an output; a name the graph does
    not have is refused with the reason."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e '.[dev]')")
    from convforge.graph import onnxruntime_reference as ortref

    m = tiny_unet()
    inner = next(n.output[0] for n in m.graph.node if n.op_type == "Concat")
    x = np.random.default_rng(4).standard_normal((3, 3, 16, 18)).astype(np.float32)
    got, why = ortref.outputs(m, x, ["y", inner])
    assert why == "" and got is not None and got["y"].shape == (3, 2, 16, 18)
    ev = ReferenceEvaluator(m)
    for i in range(3):  # each image against onnx.reference on a batch of two (the image twice)
        pair = np.concatenate([x[i:i + 1]] * 2)
        assert rel_l2(got["y"][i], ev.run(None, {"x": pair})[0][0]) < 1e-6
    assert got[inner].shape[0] == 3 and np.isfinite(got[inner]).all()
    none, why = ortref.outputs(m, x, ["y", "renamed_by_a_pass"])
    assert none is None and "renamed_by_a_pass" in why


def test_calibration_of_an_onnx_net_takes_the_smaller_bar(ocl) -> None:
    """Calibrating a network read from ONNX: the bar is the smaller of the float32 stand-in's error
    and onnxruntime's, and the report says whose; without the model only the stand-in's."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e '.[dev]')")
    from convforge.graph import onnxruntime_reference as ortref
    from convforge.graph.network_calibration import CAL_IMAGES, calibrate_network, calibration_input
    from convforge.graph.passes import optimize

    m = efficientnet_like()
    g = optimize(load_onnx(m))
    plain = calibrate_network(g, ocl, budget=1e6).report
    both = calibrate_network(g, ocl, budget=1e6, onnx_model=m).report
    x = calibration_input(g, 0)[:CAL_IMAGES]
    ref = run_reference(g.with_batch(len(x)), x)["y"]
    got, _ = ortref.outputs(m, x, ["y"])
    assert got is not None
    err_ort = rel_l2(got["y"], ref)
    assert 0 < both.err_pytorch == min(plain.err_pytorch, err_ort)
    assert "onnxruntime" in both.reference and "onnxruntime" not in plain.reference
    assert "stand-in" in plain.reference


# -- torch.onnx.export ------------------------------------------------------------------------------------

def _torch_models():  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'convforge[torch]')")
    nn = torch.nn

    class SE(nn.Module):
        def __init__(self, c: int, gate: nn.Module, act: nn.Module) -> None:
            super().__init__()
            self.f = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c // 4, 1), act, nn.Conv2d(c // 4, c, 1), gate)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return x * self.f(x)

    class MBConv(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.f = nn.Sequential(nn.Conv2d(c, 4 * c, 1, bias=False), nn.BatchNorm2d(4 * c), nn.SiLU(),
                                   nn.Conv2d(4 * c, 4 * c, 3, padding=1, groups=4 * c, bias=False),
                                   nn.BatchNorm2d(4 * c), nn.SiLU(), SE(4 * c, nn.Sigmoid(), nn.SiLU()),
                                   nn.Conv2d(4 * c, c, 1, bias=False), nn.BatchNorm2d(c))

        def forward(self, x):  # type: ignore[no-untyped-def]
            return x + self.f(x)

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            self.e2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
            self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
            self.d1 = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))
            self.up2 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)

        def forward(self, x):  # type: ignore[no-untyped-def]
            e1 = self.e1(x)
            e2 = self.e2(e1)
            d = self.d1(torch.cat([self.up(e2), e1], 1))
            return self.up2(d) + nn.functional.interpolate(d, size=(2 * d.shape[2], 2 * d.shape[3]))

    effnet = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU(),
                           MBConv(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 10))
    mbv3 = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(),
                         nn.Conv2d(16, 16, 3, padding=1, groups=16), SE(16, nn.Hardsigmoid(), nn.ReLU()),
                         nn.Conv2d(16, 24, 1), nn.ReLU6(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(24, 32), nn.Hardswish(), nn.Linear(32, 10))
    return torch, {"effnet": (effnet, (2, 3, 21, 19)), "mbv3": (mbv3, (2, 3, 17, 23)), "unet": (UNet(), (2, 3, 14, 18))}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the TorchScript exporter's notice
@pytest.mark.parametrize("name", ["effnet", "mbv3", "unet"])
@pytest.mark.parametrize("opset", [13, 17])
def test_torch_onnx_export_runs(ocl, tmp_path, name: str, opset: int) -> None:
    """What torch.onnx.export writes (the TorchScript exporter: no onnxscript needed) loads and runs
    on PoCL within TOL of PyTorch's own float32 output and of the float64 executor."""
    torch, models = _torch_models()
    module, shape = models[name]
    torch.manual_seed(0)
    for mod in module.modules():  # trained-like batch norms, not identities
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.2, 0.2)
            mod.running_var.uniform_(0.5, 1.5)
    module.eval()
    x = torch.randn(shape)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(module, (x,), str(path), opset_version=opset, dynamo=False)
    with torch.no_grad():
        want = module(x).numpy()
    g = load_onnx(str(path))
    out = compile(str(path), backend="opencl", error_budget=None)(x.numpy())
    got = out[g.outputs[0]]
    ref = run_reference(g, x.numpy())[g.outputs[0]]
    assert rel_l2(got, ref) < TOL and rel_l2(want, ref) < TOL, (rel_l2(got, ref), rel_l2(want, ref))


@pytest.mark.parametrize("name", NETS)
@pytest.mark.parametrize("passes", [False, True])
def test_torch_baseline_runs_the_onnx_graphs(name: str, passes: bool) -> None:
    """`convforge run`'s PyTorch comparison (and calibration's reference on CUDA) computes the new
    ops (act, broadcast binary, resize, pad, deconv, views) and the fused SiLU / HardSwish epilogues
    as the float64 executor does: here on the CPU."""
    pytest.importorskip("torch", reason="torch is not installed (pip install 'convforge[torch]')")
    from convforge.graph.passes import optimize
    from convforge.graph.torch_reference import forward_fn

    g = load_onnx(NETS[name]())
    g = optimize(g) if passes else g
    x = np.random.default_rng(4).standard_normal(g.input_shape).astype(np.float32)
    got = forward_fn(g, x, "cpu")().numpy()
    assert rel_l2(got, run_reference(g, x)["y"]) < 1e-5
