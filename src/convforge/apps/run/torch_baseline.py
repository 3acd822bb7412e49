"""PyTorch's time on the same graph and weights: ``convforge run``'s baseline (imports torch).

The graph runs through :mod:`convforge.graph.torch_reference` (FP32, TF32 with ``tf32``, or the
weights and input in ``dtype``), eager and replayed from a CUDA graph; peak memory is
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from convforge.graph.ir import Graph
from convforge.graph.torch_reference import forward_fn, set_math


@dataclass
class TorchTimes:
    eager_ms: float
    graph_ms: float
    peak_bytes: int
    output: np.ndarray


def run_torch(graph: Graph, x: np.ndarray, repeats: int = 20, tf32: bool = False,
              dtype: str = "float32") -> TorchTimes:
    """Time ``graph`` (at x's batch) in PyTorch FP32 (``tf32``: TF32 allowed) or with weights and
    input in ``dtype`` (float16, bfloat16), eager and CUDA-graph replayed, on the GPU. The TF32
    switches are restored afterwards."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    set_math(torch, tf32)
    try:
        return _run_torch(torch, graph, x, repeats, dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _run_torch(torch: Any, graph: Graph, x: np.ndarray, repeats: int, dtype: str = "float32") -> TorchTimes:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    forward = forward_fn(graph, x, "cuda", dtype)

    def timed(fn: Any) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / repeats

    eager = timed(forward)
    peak = int(torch.cuda.max_memory_allocated())
    out = forward().float().cpu().numpy()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        forward()
    replay = timed(g.replay)
    return TorchTimes(eager, replay, peak, out)
