"""GPU tier: ONNX exports of modern CNNs through ``convforge run``'s path on CUDA.

torchvision's efficientnet_b0 and mobilenet_v3_large (random weights, batch norms given trained-like
statistics) and a tiny UNet (ConvTranspose and bilinear Resize decoders, skip concats) are written
by ``torch.onnx.export`` (the TorchScript exporter, opset 17), then ``convforge run --net
model.onnx --backend cuda`` runs each (passes, calibration to 2x PyTorch FP32's error, CUDA graph,
the PyTorch baseline on the same graph). Its error against the float64 executor must be within 2x
onnxruntime's on the same input (issue 61's target; onnxruntime-gpu's in FP32 where installed, else
its CPU one); its time is printed against onnxruntime-gpu's (CUDA execution provider, inputs and
outputs bound on the device) where that is installed (run with -s to see it).

Needs a CUDA device, torch, torchvision and onnxruntime (onnxruntime-gpu for the timing); each
missing one skips with its reason.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from convforge.reference import rel_l2

pytestmark = pytest.mark.gpu

BATCH = 8
MODELS = {"efficientnet_b0": 224, "mobilenet_v3_large": 224, "unet": 128}


def _unet(torch: Any) -> Any:
    nn = torch.nn

    def block(c: int, k: int) -> Any:
        return nn.Sequential(nn.Conv2d(c, k, 3, padding=1, bias=False), nn.BatchNorm2d(k), nn.ReLU(),
                             nn.Conv2d(k, k, 3, padding=1, bias=False), nn.BatchNorm2d(k), nn.ReLU())

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e1, self.e2, self.e3 = block(3, 32), block(32, 64), block(64, 128)
            self.up2 = nn.ConvTranspose2d(128, 64, 2, stride=2)
            self.d2 = block(128, 64)
            self.up1 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
            self.d1 = block(96, 32)
            self.out = nn.Conv2d(32, 2, 1)

        def forward(self, x: Any) -> Any:
            e1 = self.e1(x)
            e2 = self.e2(nn.functional.max_pool2d(e1, 2))
            e3 = self.e3(nn.functional.max_pool2d(e2, 2))
            d2 = self.d2(torch.cat([self.up2(e3), e2], 1))
            return self.out(self.d1(torch.cat([self.up1(d2), e1], 1)))

    return UNet()


def _export(name: str, tmp_path: Path) -> Path:
    """The model exported by torch.onnx.export (eval mode, random weights, a symbolic batch)."""
    torch = pytest.importorskip("torch", reason="GPU tier: torch is not installed")
    torch.manual_seed(0)
    if name == "unet":
        module = _unet(torch)
    else:
        tv = pytest.importorskip("torchvision", reason="GPU tier: torchvision is not installed")
        module = getattr(tv.models, name)(weights=None)
    for mod in module.modules():  # trained-like statistics (fresh ones are identities)
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.1, 0.1)
            mod.running_var.uniform_(0.8, 1.2)
    module.eval()
    size = MODELS[name]
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(module, (torch.randn(BATCH, 3, size, size),), str(path), opset_version=17, dynamo=False,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return path


def _ort_gpu_session(ort: Any, path: Path) -> Any:
    """onnxruntime's CUDA execution provider in FP32 (TF32 off where the option exists: our class)."""
    try:
        return ort.InferenceSession(str(path), providers=[("CUDAExecutionProvider", {"use_tf32": "0"}),
                                                          "CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - an onnxruntime without the option
        return ort.InferenceSession(str(path), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


def _ort_gpu_ms(ort: Any, sess: Any, x: np.ndarray, repeats: int = 20) -> float:
    """Median ms of one onnxruntime-gpu run with input and output bound on the device."""
    binding = sess.io_binding()
    binding.bind_ortvalue_input(sess.get_inputs()[0].name, ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
    binding.bind_output(sess.get_outputs()[0].name, "cuda")
    for _ in range(3):
        sess.run_with_iobinding(binding)
    times = []
    for _ in range(repeats):
        binding.synchronize_inputs()
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("name", list(MODELS))
def test_exported_model_runs_under_convforge_run(cuda, tmp_path, capsys, name: str) -> None:
    ort = pytest.importorskip("onnxruntime", reason="GPU tier: onnxruntime is not installed (its error is the bar)")
    from convforge.cli import main
    from convforge.graph.from_onnx import load_onnx
    from convforge.graph.network_calibration import CAL_IMAGES
    from convforge.graph.reference import run_reference

    path = _export(name, tmp_path)
    assert main(["run", "--net", str(path), "--backend", "cuda", "--batch", str(BATCH), "--repeats", "20",
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    res = json.loads((tmp_path / f"run-{name}-n{BATCH}-cuda.json").read_text())
    # the input `convforge run` reported on (seed 0) and the float64 answer on its first images
    g = load_onnx(str(path), batch=BATCH)
    x = np.random.default_rng(0).standard_normal(g.input_shape).astype(np.float32)
    k = min(CAL_IMAGES, BATCH)
    out = g.outputs[0]
    ref = run_reference(g.with_batch(k), x[:k])[out]
    cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # the FP32 bar
    err_ort = rel_l2(cpu.run(None, {cpu.get_inputs()[0].name: x[:k]})[0], ref)
    err = res["errors"][out]
    line = f"{name} n{BATCH}: ours {res['ours_ms']:.3f} ms, error {err:.2e}; onnxruntime (CPU, FP32) {err_ort:.2e}"
    if "CUDAExecutionProvider" in ort.get_available_providers():
        sess = _ort_gpu_session(ort, path)
        err_ort = rel_l2(sess.run(None, {sess.get_inputs()[0].name: x})[0][:k], ref)  # the bar: the competitor's
        line += f", onnxruntime-gpu {err_ort:.2e}"
        ort_ms = _ort_gpu_ms(ort, sess, x)
        line += f", onnxruntime-gpu {ort_ms:.3f} ms ({ort_ms / res['ours_ms']:.2f}x ours)"
    else:
        line += "; onnxruntime-gpu not installed: no time comparison"
    if "torch_graph_ms" in res:
        line += f"; PyTorch CUDA graph {res['torch_graph_ms']:.3f} ms"
    print(line)
    assert "relative error vs the float64 reference" in printed
    # 2x onnxruntime's error (onnxruntime-gpu's where installed, else its CPU FP32 one): `run` calibrates
    # an ONNX net to the smaller of PyTorch FP32's error and onnxruntime's (CPU, FP32)
    assert "onnxruntime" in printed and err <= 2 * err_ort, line
