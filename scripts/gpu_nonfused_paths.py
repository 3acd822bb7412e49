"""Check and time the non-fused Winograd GEMM paths (own kernel vs sgemm.py) on a few layers (GPU machine)."""

from __future__ import annotations

import statistics

import numpy as np

from convforge.backends import get_backend
from convforge.check import check_plan, random_inputs
from convforge.kernels import get_variant
from convforge.spec import ConvSpec

LAYERS = [ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec.make(32, 256, 14, 14, 256, 3, 3, 1, 1),
          ConvSpec.make(5, 832, 7, 7, 384, 3, 3, 1, 1)]


def main() -> None:
    be = get_backend("cuda")
    for spec in LAYERS:
        x, w, _ = random_inputs(spec, np.random.default_rng(0))
        bufs = {"x": be.upload(x), "w": be.upload(w), "y": be.empty(4 * spec.n * spec.k * spec.p * spec.q)}
        for name in ("winograd_nonfused_f2", "winograd_nonfused_f4"):
            v = get_variant(name)
            for label, prm in (("own", v.default(spec, be.device)), ("sgemm", v.sgemm_default(spec, be.device))):
                plan = v.plan(spec, prm, be.device)
                exe = be.executable(plan)
                res = check_plan(plan, be, exe=exe, batch_slice=1)
                for _ in range(3):
                    exe(bufs)
                ms = statistics.median(be.time_ms(lambda exe=exe, bufs=bufs: exe(bufs), 25))
                print(f"{spec.short()[:40]:40s} {name:22s} {label:6s} {ms:8.4f} ms "
                      f"{spec.flops / ms / 1e9:6.1f} TFLOPS  {res}")


if __name__ == "__main__":
    main()
