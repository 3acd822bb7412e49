"""Host cost of a plan's launches against its device time (GPU machine).

For each layer and point: launches per call, host microseconds to enqueue one call (no sync),
device milliseconds per call as the benchmark times it (events around back-to-back calls), and
device milliseconds per call when the same launches replay from a captured CUDA graph (no host
work between kernels). A benchmark time near the host figure and far above the graph figure
means the call is host-bound.

    PYTHONPATH=src:tests python scripts/launch_cost.py --variant winograd_nonfused_f7 \\
        --layers "res512@7 N32" --mods ";tc=2"
"""

from __future__ import annotations

import argparse
import statistics
import time

import cupy as cp
from gpu_wino_sweep import _bufs, _point, _spec, _split

from convforge.backends import get_backend
from convforge.kernels import get_variant
from convforge.tune.tuner import Tuner


def host_us(exe, bufs, calls: int = 50) -> float:  # type: ignore[no-untyped-def]
    """Median host time to enqueue one call, the queue drained before each burst."""
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        exe(bufs)
        times.append(time.perf_counter() - t)
        cp.cuda.get_current_stream().synchronize()
    return 1e6 * statistics.median(times)


def graph_ms(exe, bufs, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Device time per call replayed from a CUDA graph of ``reps`` calls."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        exe(bufs)
        stream.synchronize()
        stream.begin_capture()
        for _ in range(reps):
            exe(bufs)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return float(cp.cuda.get_elapsed_time(start, end)) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="winograd_nonfused_f7")
    ap.add_argument("--layers", default="res512@7 N32")
    ap.add_argument("--mods", default="", help="';'-separated k=v,... changes of the default ('' = it)")
    args = ap.parse_args()
    be = get_backend("cuda")
    tuner = Tuner(be)
    v = get_variant(args.variant)
    print(f"{'layer':16s} {'launches':>8s} {'host us':>8s} {'bench ms':>9s} {'graph ms':>9s}  point")
    for label in _split(args.layers):
        spec = _spec(label)
        for mod in args.mods.split(";"):
            prm = _point(v, spec, be.device, "default" + (f"+{mod}" if mod else ""))
            plan = v.plan(spec, prm, be.device)
            exe = be.executable(plan)
            bufs = _bufs(be, spec)
            (cand,) = tuner.measure_many(spec, plan.epilogue, [(v, prm)])
            print(f"{label:16s} {len(plan.steps):8d} {host_us(exe, bufs):8.1f} {cand.time_ms:9.4f} "
                  f"{graph_ms(exe, bufs):9.4f}  {prm.short()}", flush=True)


if __name__ == "__main__":
    main()
