"""Where the global loads sit in each generated kernel's main loop (SASS, no GPU needed).

    PYTHONPATH=src python scripts/sass_loads.py --spec 'N=...' --variant V [--params k=v,...]

Compiles the plan's CUDA source with nvcc and disassembles it with cuobjdump (CUDA toolkit, or the
``nvidia-cuda-cuobjdump`` wheel). For each kernel's largest loop it prints the number of FFMAs and,
for each LDG, how many of the loop's FFMAs come before it: a prefetch that ptxas sank to the end of
the loop (all FFMAs before it) no longer hides its latency.
"""

from __future__ import annotations

import argparse

from convforge.cli import _device_for
from convforge.codegen.nvcc import sass_report
from convforge.codegen.sass import loop_loads
from convforge.kernels import get_variant
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.spec import ConvSpec


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--params", default="", help="override default parameters, e.g. 'bk=16'")
    args = ap.parse_args()
    spec, v = ConvSpec.parse(args.spec), get_variant(args.variant)
    dev = _device_for("cuda")
    prm = v.default(spec, dev)
    prm = Params(dict(prm), **dict(Params.parse(args.params))) if args.params else prm
    infos, sass = sass_report(v.plan(spec, prm, dev, Epilogue()).source("cuda"))
    regs = {i.kernel: i for i in infos}
    print(f"{v.name} {prm.short()}")
    for name, loop in loop_loads(sass).items():
        r = regs.get(name)
        figures = f"{r.registers} regs, {r.spill_stores} spill bytes" if r else "?"
        print(f"  {name}: {figures}; {loop.summary() if loop else 'no loop'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
