"""DistributedDataParallel and convforge models, checked on the CPU: the order in which a converted or
fused model's backward makes its parameter gradients, and what its backward paths may call.

DDP all-reduces a bucket of gradients while the rest of the backward runs only if the gradients
become ready layer by layer (its reducer hooks each parameter's gradient accumulator) and the
backward never waits for the device. Two guards here:

- A run (torchrun, two processes, gloo on the CPU, tests/ddp_check.py) of the same small model as
  PyTorch has it, converted and fused: the events of its last backward (each parameter's gradient
  hook, each conv's and linear's input gradient) and DDP's rebuilt buckets (one per parameter: the
  order DDP saw them ready) are PyTorch's, group by group, interleaved with the layers' backward as
  PyTorch's are; both ranks end with the same averaged gradients, PyTorch's. What this proves: the
  modules' autograd graph (one node per conv whose edges reach the registered parameters' own
  accumulators, parameters registered where the original model has them, nothing DDP sees that
  gets no gradient, nothing deferred to the end of the backward). What it does not: on CPU tensors
  convforge's ops compute through PyTorch's, so the CUDA nodes (the C++ conv -> batch norm block,
  the batch-norm and conv -> ReLU nodes) are not in this graph; tests/test_gpu_multi.py runs the same
  check on two GPUs, where they are.
- A static check of the code on the CUDA backward paths (native.cpp's nodes and backward kernels,
  the Python nodes' backward, the raw launchers): no device or stream synchronisation, no host read
  of device memory, no allocation outside the caching allocator, no stream but torch's current one.
  The first call of a layer (compiling, tuning with autotune on, filing a backward call with the
  native path, which compares its result once) may synchronise; none of that is on these paths.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src" / "convforge"


# -- the order of the gradients under DDP, on the CPU ---------------------------------------------------------
def _ddp_run(how: str, out: Path) -> dict:
    torch = pytest.importorskip("torch", reason="DDP order on the CPU: torch not installed")
    out.mkdir()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), str(HERE), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(HERE / "ddp_check.py"), "--how", how, "--device", "cpu", "--steps", "3", "--bucket-mb", "1e-6",
            "--out", str(out)]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{how}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return {r: torch.load(out / f"rank{r}.pt") for r in (0, 1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("ddp")
    return {how: _ddp_run(how, base / how) for how in ("torch", "convert", "fuse")}


def test_ddp_sees_gradients_layer_by_layer_as_pytorchs(runs: dict[str, dict]) -> None:
    from ddp_check import canonical

    group = runs["fuse"][0]["groups"]  # parameter -> the conv its fused batch norm belongs to
    assert group["block.bn1.weight"] == "block.conv1" and group["head.weight"] == "head"
    want = canonical(runs["torch"][0]["events"], group)
    kinds = [k for k, _ in want]
    # PyTorch's own backward interleaves: parameters' gradients between the layers' input gradients
    assert kinds.index("x") < len(kinds) - 1 - kinds[::-1].index("p"), want
    for how in ("convert", "fuse"):
        for rank in (0, 1):
            got = runs[how][rank]
            assert canonical(got["events"], group) == want, (how, rank)
            assert len(got["buckets"]) == len(group), got["buckets"]  # every parameter in a bucket of its own
            assert _merged([group[n] for n in got["buckets"]]) == _merged(
                [group[n] for n in runs["torch"][rank]["buckets"]]), how


def _merged(names: list[str]) -> list[str]:
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


def test_ddp_gradients_are_pytorchs_on_both_ranks(runs: dict[str, dict]) -> None:
    torch = pytest.importorskip("torch")
    want = runs["torch"][0]["grads"]
    for how in ("convert", "fuse"):
        for rank in (0, 1):
            for step, (g, w) in enumerate(zip(runs[how][rank]["grads"], want, strict=True)):
                assert g.keys() == w.keys(), (how, rank, step)
                for name in w:
                    err = float((g[name] - w[name]).norm() / w[name].norm().clamp_min(1e-12))
                    assert err < 1e-5 or float((g[name] - w[name]).abs().max()) < 1e-7, (how, rank, step, name, err)
    assert torch.equal(runs["fuse"][0]["params"]["stem.weight"], runs["fuse"][1]["params"]["stem.weight"])


def test_bench_ddp_rows_on_the_cpu(tmp_path: Path) -> None:
    """bench/ddp.py's rank run end to end on two CPU processes (gloo; a tiny model, a wall-clock
    timer): the plain module alone, then in DDP with and without the all-reduce, DDP's own logging,
    the profile (no GPU kernels here: no all-reduce time), every rank's figures gathered at rank 0."""
    pytest.importorskip("torch", reason="torch not installed")
    import json

    import torch.multiprocessing as mp

    from ddp_check import bench_rank_cpu
    from multinode import free_port

    out = tmp_path / "rows.json"
    mp.spawn(bench_rank_cpu, args=(2, free_port(), str(out)), nprocs=2)
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"pytorch_fp32", "convforge_fused"}, rows
    for r in rows.values():
        assert r["status"] == "ok" and r["gpus"] == 2 and len(r["rank_step_ms"]) == 2, r
        assert r["step_ms"] > 0 and r["nosync_ms"] > 0 and r["alone_ms"] > 0, r
        assert r["allreduce_ms"] == 0 and r["overlap"] == 0 and "tail_ms" in r, r
        assert r["images_per_s"] == pytest.approx(2 * 4 / (r["step_ms"] / 1e3))


# -- the backward paths never wait for the device ----------------------------------------------------------
# What may not appear on a backward path: device, stream and event synchronisation, host reads of device
# memory, allocations that bypass the caching allocator (cudaMalloc synchronises), streams of our own.
CPP_BANNED = re.compile(r"[Ss]ynchronize|local_scalar_dense|\.item\s*<|\.item\s*\(|\.cpu\s*\(|kCPU|"
                        r"cu(?:da)?Mem(?:Alloc|cpy(?!Async)|Free)\w*|cudaFree\b|cudaMalloc\b|DtoH|"
                        r"getStreamFromPool|getDefaultCUDAStream|StreamCreate|EventQuery|StreamQuery")
PY_BANNED_ATTRS = {"synchronize", "item", "cpu", "tolist", "numpy", "asnumpy", "elapsed_time", "query",
                   "get_current_stream", "Stream", "ExternalStream", "equal", "allclose", "free_all_blocks"}

# native.cpp: (the function, or "Struct::method"), every one on the path of a warm backward
CPP_PATHS = ["BlockNode::backward", "ConvNode::backward", "ConvReluNode::backward", "once_differentiable",
             "op_input_cuda", "op_weight_cuda", "pass_cuda", "run_pass", "launch_filtered", "filters_for",
             "launch_checked", "launch_bn", "scratch", "relu_back_f32", "NormGeluNode::backward",
             "ScaleResidualNode::backward", "mlp_linear_grads", "launch_norm", "SeNode::backward", "launch_se",
             "PoolNode::backward", "launch_pool", "BnNode::backward", "bn_backward"]
CORE_PATHS = ["launch_all", "capturing"]
# Python: (module file, "Class.method" or function): the nodes' backward and the launchers they use
PY_PATHS = [("torch/ops.py", "_Conv2dFn.backward"), ("torch/batchnorm.py", "_BnAct.backward"),
            ("torch/conv_relu.py", "_ConvRelu.backward"), ("torch/conv_relu.py", "_masked_grad"),
            ("torch/conv_relu.py", "_masked_grad_half"),
            ("torch/conv_relu.py", "_RowsBackward.__call__"), ("backends/cuda.py", "RawLaunches.__call__"),
            ("backends/cuda.py", "CudaExecutable.launch_raw"), ("frontends/torch_run.py", "torch_pass_runner"),
            ("frontends/torch_run.py", "torch_stream_queries")]


def _braced(text: str, start: int) -> str:
    """The text from ``start`` to the brace closing the first ``{`` after it."""
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start:j + 1]
    raise AssertionError("unbalanced braces")


def _cpp_function(text: str, name: str) -> str:
    if "::" in name:
        owner, method = name.split("::")
        at = re.search(rf"struct {owner}\b", text)
        assert at, owner
        sig = re.compile(rf"\b{method}\s*\([^;{{]*\)\s*(?:const\s*)?\{{", re.S).search(text, at.start())
    else:
        sig = re.compile(rf"^[\[\]\w:<>,\s\*&]*\b{name}\s*\([^;{{]*\)\s*(?:const\s*)?\{{", re.S | re.M).search(text)
    assert sig, f"{name} not found: the list of backward paths is out of date"
    return _braced(text, sig.start())


def test_native_backward_paths_never_synchronise_and_use_the_current_stream() -> None:
    parts = [SRC / "torch" / "native.cpp", *sorted((SRC / "torch").glob("native_*.inc"))]  # the file and its includes
    cpp = "\n".join(p.read_text() for p in parts)
    core = (SRC / "backends" / "native_core.h").read_text()
    for text, names in ((cpp, CPP_PATHS), (core, CORE_PATHS)):
        for name in names:
            body = re.sub(r"//[^\n]*", "", _cpp_function(text, name))  # comments may say what is avoided
            bad = CPP_BANNED.findall(body)
            assert not bad, (name, bad)
    streams = re.findall(r"CUstream\s+\w+\s*=\s*([^;]+);", re.sub(r"//[^\n]*", "", cpp))
    assert streams and all("getCurrentCUDAStream" in s for s in streams), streams
    calls = re.findall(r"launch_bn\([^;]*?;", re.sub(r"//[^\n]*", "", cpp), re.S)
    assert calls and all("getCurrentCUDAStream" in c for c in calls if "const BnProg" not in c), calls


def _py_function(tree: ast.Module, name: str) -> ast.AST:
    parts = name.split(".")
    nodes: list[ast.stmt] = list(tree.body)
    found: ast.AST | None = None
    for part in parts:
        found = next((n for n in nodes if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == part), None)
        assert found is not None, f"{name} not found: the list of backward paths is out of date"
        nodes = list(getattr(found, "body", []))
    assert found is not None
    return found


def test_python_backward_paths_never_synchronise_and_use_torchs_stream() -> None:
    for path, name in PY_PATHS:
        tree = ast.parse((SRC / path).read_text())
        fn = _py_function(tree, name)
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                assert called not in PY_BANNED_ATTRS, (path, name, called, node.lineno)
            if isinstance(node, ast.Attribute) and node.attr == "cupy":
                raise AssertionError((path, name, "CuPy on a torch backward path", node.lineno))
