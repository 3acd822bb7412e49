"""GPU tier: the five shipped networks at full size on CUDA (CUDA graph replay) against the float64
graph reference, the ops' CUDA sources, and the profiling pass. Skips without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from convforge import models
from convforge.graph.build import compile
from convforge.graph.caffe import load_shipped
from convforge.graph.reference import run_reference
from convforge.reference import rel_l2

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", models.NAMES)
@pytest.mark.parametrize("batch", [1, 4])
def test_network_full_size_on_cuda(cuda, name: str, batch: int) -> None:
    g = load_shipped(name, seed=11)
    logits = g.producer(g.outputs[0]).inputs[0]
    g.outputs = [logits, g.outputs[0]]
    net = compile(g, batch=batch, backend="cuda")
    assert net.captured, "the launch list was not captured into a CUDA graph (see the warning logged)"
    x = np.random.default_rng(3).standard_normal(net.shapes[g.input].shape).astype(np.float32)
    out = net(x)
    ref = run_reference(g.with_batch(1), x[:1])
    for t in g.outputs:
        err = rel_l2(out[t][:1], ref[t])
        assert err < 1e-4, f"{name} {t}: relative error {err:.2e}"
    again = net(x)  # the replayed CUDA graph gives the same answer on a second call
    assert np.array_equal(again[logits], out[logits])
    prof = net.profile(repeats=2)
    assert len(prof) == len(net.steps) and all(ms > 0 for _, ms in prof)
    assert net.time_ms(3) > 0


def test_op_kernels_compile_for_cuda(nvcc_ok) -> None:
    """Every non-conv kernel of GoogLeNet and ResNet-50 renders and compiles for sm_90."""
    from convforge.codegen.nvcc import ptxas_report
    from convforge.codegen.render import render
    from convforge.graph import ops
    from convforge.graph.ir import Node, Tensor, infer
    from convforge.graph.passes import optimize

    kernels = []
    for name in ("googlenet", "resnet50", "alexnet"):
        g = optimize(load_shipped(name, input_size=64))
        g.nodes.append(type(g.nodes[0])("bn_probe", "scale", [g.nodes[0].output], "bn_probe_out", {},
                                        {}))
        shapes = infer(g)
        for node in g.nodes:
            x = shapes[node.inputs[0]]
            if node.op == "pool":
                kernels.append(ops.pool(node, x, shapes[node.output], "x", "y").kernel)
            elif node.op == "lrn":
                kernels.append(ops.lrn(node, x, "x", "y").kernel)
            elif node.op == "softmax":
                kernels.append(ops.softmax(node, x, "x", "y").kernel)
            elif node.op == "add":
                kernels.append(ops.add(node, x, list(node.inputs), "y", True).kernel)
            elif node.op == "concat":
                kernels.append(ops.copy_into(node, x, 2 * x.shape[1], 0, "x", "y", 0).kernel)
            elif node.op == "scale":
                kernels.append(ops.affine(node, x, "x", "y", "a", "b", True).kernel)
        kernels.append(ops.activation(g.nodes[0], shapes[g.input], "x", "y").kernel)
    for shape in ((3, 1001, 1, 1), (2, 21, 5, 7), (128, 1000, 1, 1)):  # strided, per pixel, float4
        probe = Tensor("x", ("n", "c", "y", "x"), shape)
        node = Node(f"sm{shape[1]}_{shape[2]}", "softmax", ["x"], "y", {}, {})
        kernels.append(ops.softmax(node, probe, "x", "y").kernel)
    for kind, shape in (("max", (3, 5, 16, 12)), ("avg", (2, 3, 17, 19))):  # global pool, a group per row
        probe = Tensor("x", ("n", "c", "y", "x"), shape)
        node = Node(f"gp_{kind}", "pool", ["x"], "y", {"kind": kind, "global": True}, {})
        out = Tensor("y", ("n", "c", "y", "x"), (*shape[:2], 1, 1))
        kernels.append(ops.pool(node, probe, out, "x", "y").kernel)
    unique = list({k.name: k for k in kernels}.values())
    assert ptxas_report(render(unique, "cuda", "graph ops"))


def test_alexnet_n128_peak_memory(cuda) -> None:
    """The peak the network reports is what it holds on the device (CuPy's pool, measured), conv
    workspaces are one shared arena, and the whole is no more than PyTorch's max_memory_allocated
    for the same model and batch (measured where torch with CUDA is installed, else probe 3's
    1635 MiB)."""
    import cupy as cp

    from convforge import dispatch
    from convforge.apps.run import torch_baseline
    from convforge.graph import torch_reference

    dispatch.clear_executables()  # executables of earlier tests may hold workspaces of their own
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    g = load_shipped("alexnet", seed=11)
    net = compile(g, batch=128, backend="cuda")
    held = pool.used_bytes() - before
    assert net.workspace_bytes == net.arena_bytes > 0
    assert abs(held - net.peak_bytes) < 0.02 * net.peak_bytes + (16 << 20), (held, net.peak_bytes)
    why = torch_reference.available()
    if why is None:
        x = np.random.default_rng(3).standard_normal(net.shapes[g.input].shape).astype(np.float32)
        torch_peak = torch_baseline.run_torch(g.with_batch(128), x, repeats=2).peak_bytes
    else:
        torch_peak = 1635 * 2**20  # PyTorch 2.x, H200, AlexNet N128 (gpu-probe-3)
    assert net.peak_bytes <= torch_peak, (f"peak {net.peak_bytes / 2**20:.1f} MiB (arena "
                                          f"{net.arena_bytes / 2**20:.1f}) > PyTorch {torch_peak / 2**20:.1f}")
