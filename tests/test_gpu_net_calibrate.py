"""GPU tier of network calibration (``convforge.compile(error_budget=)``; skips without a CUDA
device, and without torch, which gives the reference error on CUDA).

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_net_calibrate.py``. The shipped networks
compiled at the default budget (2x PyTorch FP32's error, measured by PyTorch itself on the
calibration input) keep their logits within that bound on a fresh input too (10 % slack: the bound
is aimed at 0.95 of it on another input), checked against the float64 executor.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,batch,size", [("googlenet", 2, 224), ("resnet50", 2, 224), ("vgg16", 1, 112)])
def test_shipped_networks_meet_twice_pytorch_fp32(cuda, name, batch, size):
    pytest.importorskip("torch", reason="the reference error on CUDA is PyTorch's: torch not installed")
    from convforge.graph import torch_reference
    from convforge.graph.build import compile
    from convforge.graph.caffe import load_shipped
    from convforge.graph.network_calibration import targets
    from convforge.graph.reference import run_reference
    from convforge.reference import rel_l2

    if torch_reference.available():
        pytest.skip(torch_reference.available())
    g = load_shipped(name, input_size=size).with_batch(batch)
    logits = targets(g)  # the softmax's input: what calibration compares
    g.outputs = logits
    net = compile(g, batch=batch, backend="cuda")
    rep = net.calibration
    assert rep is not None and rep.reference == "PyTorch FP32" and rep.budget == 2.0
    assert rep.met and rep.error_after <= rep.aim, str(rep)
    x = np.random.default_rng(0).standard_normal(g.input_shape).astype(np.float32)
    want = run_reference(g.with_batch(1), x[:1])
    ours = net(x)
    pt = torch_reference.outputs(g, x)
    ref = np.concatenate([want[t].ravel() for t in logits])
    err = rel_l2(np.concatenate([ours[t][:1].ravel() for t in logits]), ref)
    err_pt = rel_l2(np.concatenate([pt[t][:1].ravel() for t in logits]), ref)
    print(f"{name} N{batch}: logits error {err:.2e}, PyTorch FP32 {err_pt:.2e} ({err / err_pt:.2f}x); {rep}")
    assert err <= 2.2 * err_pt, (err, err_pt, str(rep))
