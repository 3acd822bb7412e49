"""Host-side dispatch cost of conv2d with a warm tuning database: everything conv2d does before its
launches (array checks, ConvSpec, the database's choice, the compiled executable's lookup).

    python scripts/dispatch_overhead.py [--backend opencl|cuda]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from convforge import api
from convforge.backends import get_backend
from convforge.plan import Epilogue


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="opencl")
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    be = get_backend(args.backend)
    x = np.zeros((1, 8, 13, 13), np.float32)
    w = np.zeros((8, 8, 3, 3), np.float32)

    def dispatch() -> None:
        api._check_array(x, "input", 4)
        api._check_array(w, "weights", 4)
        spec = api._spec(x.shape, w.shape, 1, 1, 1)
        api._check_layout(x, "input", 4)
        api._check_layout(w, "weights", 4)
        api.executable_for(spec, be, "auto", Epilogue())

    dispatch()  # compiles (or loads) once
    t0 = time.perf_counter()
    for _ in range(args.calls):
        dispatch()
    per = (time.perf_counter() - t0) / args.calls * 1e6
    print(f"conv2d dispatch on {be.device.name}: {per:.1f} µs per call (warm database, {args.calls} calls)")


if __name__ == "__main__":
    main()
