#!/usr/bin/env python3
"""The accuracy table of the Winograd variants beside direct and implicit GEMM on the ResNet 3x3 layers.

``python scripts/winograd_accuracy.py [N]`` prints a Markdown table of relative L2 error against the
float64 reference (docs/NOTES-winograd.md holds it). The error is arithmetic (float32 rounding of
the transforms and sums), not a property of the device, so a reduced batch on PoCL gives the
figures the tolerances are derived from.
"""

from __future__ import annotations

import argparse
import sys

from convforge.spec import ConvSpec

LAYERS = ((64, 56), (128, 28), (256, 14), (512, 7))
VARIANTS = ("direct", "implicit_gemm", "winograd_nonfused_f2", "winograd_fused_f2", "winograd_nonfused_f4",
            "winograd_fused_f4", "winograd_nonfused_f6", "winograd_nonfused_f7")


def table(n: int = 1, seed: int = 0) -> str:
    """Markdown table: one row per layer, one column per variant."""
    from convforge.backends import get_backend
    from convforge.check import check_plan
    from convforge.kernels import (
        direct,  # noqa: F401  (registered even when run as __main__)
        get_variant,
    )

    be = get_backend("opencl")
    lines = [f"| layer (N={n}) | " + " | ".join(VARIANTS) + " |",
             "|---" * (len(VARIANTS) + 1) + "|"]
    for c, hw in LAYERS:
        spec = ConvSpec.make(n, c, hw, hw, c, 3, 3, padding=1)
        cells = []
        for name in VARIANTS:
            v = get_variant(name)
            res = check_plan(v.plan(spec, v.default(spec, be.device), be.device), be, seed)
            cells.append(f"{res.rel_err:.2e}")
        lines.append(f"| C=K={c}, {hw}x{hw} | " + " | ".join(cells) + " |")
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("n", nargs="?", type=int, default=1, help="the batch (default 1)")
    print(table(p.parse_args().n))


if __name__ == "__main__":
    main()
