"""Per-call host cost of one conv on a tiny warm layer, side by side (GPU machine).

Rows: ``F.conv2d`` (PyTorch, cuDNN), ``nn.Conv2d`` forward, ``convforge.conv2d`` with torch tensors
and with CuPy arrays, the ``torch.ops.convforge.conv2d`` op (through the dispatcher, autograd kernel
included) and a converted ``convforge.torch.Conv2d`` forward (eager inference: the prepared path).

How: the GPU is first held busy by ``torch.cuda._sleep`` so every call only enqueues work; the
wall time of ``--calls`` calls divided by their number is the host cost per call (median of
``--bursts`` bursts, the queue drained between bursts). The device time of one call (CUDA events,
back to back) is printed for context.

Targets (issue 15): convforge.conv2d <= 5 us with torch tensors or CuPy arrays, the torch op <= 10 us,
against F.conv2d's 19 us (H200, torch 2.11, measured 2026-11-22); the lead records the figures of
this script in docs/BENCHMARKS.md.

    PYTHONPATH=src python scripts/host_cost.py [--spec N=1,C=8,H=8,W=8,K=8,R=3,S=3,pad=1] [--algo auto]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import cupy as cp
import torch
import torch.nn.functional as F

import convforge
import convforge.torch as ct
from convforge.spec import ConvSpec


def host_us(fn: Callable[[], object], calls: int, bursts: int) -> float:
    """Median over bursts of the wall time per call while the GPU is busy (enqueue cost only)."""
    times = []
    for _ in range(bursts):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e7))  # ~25 ms of GPU spin: the calls below only queue work
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def device_us(fn: Callable[[], object], calls: int = 200) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="N=1,C=8,H=8,W=8,K=8,R=3,S=3,pad=1")
    ap.add_argument("--algo", default="auto")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--bursts", type=int, default=15)
    args = ap.parse_args()
    spec = ConvSpec.parse(args.spec)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    x = torch.randn(spec.x_shape, device="cuda")
    layer = torch.nn.Conv2d(spec.c, spec.k, (spec.r, spec.s), spec.stride, (spec.pad[0], spec.pad[2]),
                            spec.dilation).cuda()
    w, b = layer.weight, layer.bias  # parameters that require grad: the case that used to fail
    xc, wc, bc = cp.asarray(x), cp.asarray(w.detach()), cp.asarray(b.detach())
    ours = ct.Conv2d.from_module(torch.nn.Conv2d(spec.c, spec.k, (spec.r, spec.s), spec.stride,
                                                 (spec.pad[0], spec.pad[2]), spec.dilation).cuda(), algo=args.algo)
    st, pd, dl = list(spec.stride), list(spec.pad), list(spec.dilation)
    rows: list[tuple[str, Callable[[], object]]] = [
        ("F.conv2d (cuDNN)", lambda: F.conv2d(x, w, b, spec.stride, (spec.pad[0], spec.pad[2]), spec.dilation)),
        ("nn.Conv2d forward", lambda: layer(x)),
        ("convforge.conv2d, torch tensors", lambda: convforge.conv2d(x, w, b, spec.stride, spec.pad, spec.dilation,
                                                                     algo=args.algo)),
        ("convforge.conv2d, CuPy arrays", lambda: convforge.conv2d(xc, wc, bc, spec.stride, spec.pad, spec.dilation,
                                                                   algo=args.algo)),
        ("torch.ops.convforge.conv2d", lambda: torch.ops.convforge.conv2d(x, w, b, st, pd, dl, args.algo, None, None)),
        ("convforge.torch.Conv2d forward", lambda: ours(x)),
    ]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | cupy {cp.__version__} | "
          f"layer {spec.short()} | algo {args.algo}")
    print(f"{'call':36s} {'no_grad host us':>16s} {'inference host us':>18s} {'device us':>10s}")
    for name, fn in rows:
        with torch.no_grad():
            for _ in range(20):
                fn()  # warm: compile, choose, runners, transformed filters
            ng = host_us(fn, args.calls, args.bursts)
            dev = device_us(fn)
        with torch.inference_mode():
            for _ in range(5):
                fn()
            inf = host_us(fn, args.calls, args.bursts)
        print(f"{name:36s} {ng:16.2f} {inf:18.2f} {dev:10.2f}")


if __name__ == "__main__":
    main()
