"""How many waves each launch of a suite's layers fills on an H100/H200-sized GPU (ptxas, no GPU needed).

    PYTHONPATH=src python scripts/waves.py --suite FILE|NAME [--pass wgrad] [--dtype fp16] [--layout nhwc]
                                           [--algo auto|VARIANT] [--params k=v,...]

For each layer: the variant the algo ranks first, its default parameters, and for each of its kernels the
registers ptxas allots (and any spill), the threads and shared memory of a block, the blocks a compute unit
keeps resident (registers in the register file's four 16K quarters, threads, shared memory, 32 blocks), the
grid's blocks and the waves they make over 132 compute units. A grid of 1.05-1.5 waves runs its last part on a few
compute units (the depthwise wgrad's 144@56: 2.01 waves, 0.064 ms; one wave, 0.052).
"""

from __future__ import annotations

import argparse
import dataclasses

from convforge.apps.bench.suites import load_suite
from convforge.cli import _device_for
from convforge.codegen.dialect import Kernel
from convforge.codegen.meta import cdiv
from convforge.codegen.nvcc import PtxasInfo, ptxas_report
from convforge.kernels import get_variant, ranked
from convforge.params import Params
from convforge.plan import Epilogue, Launch

_UNITS, _QUARTER, _THREADS, _SMEM = 132, 16384, 2048, 227 * 1024
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def resident(kern: Kernel, info: PtxasInfo) -> int:
    """Blocks of ``kern`` a compute unit keeps: registers (allotted 256 a warp at a time, a warp's in one
    of four 16K quarters), threads, static and launch-sized shared memory, 32 blocks."""
    warps = cdiv(kern.threads, 32)
    per_warp = cdiv(max(info.registers, 1) * 32, 256) * 256
    by_regs = 4 * (_QUARTER // per_warp) // warps
    local = kern.local_buf()
    smem = info.shared + (local.nbytes if local else 0)
    by_smem = _SMEM // smem if smem else 32
    return max(0, min(by_regs, _THREADS // kern.threads, by_smem, 32))


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--suite", required=True)
    ap.add_argument("--pass", dest="conv_pass", default="fprop", choices=("fprop", "dgrad", "wgrad"))
    ap.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES))
    ap.add_argument("--layout", default="nchw", choices=("nchw", "nhwc"))
    ap.add_argument("--algo", default="auto")
    ap.add_argument("--params", default="", help="override the default's parameters, e.g. 'ns=64'")
    args = ap.parse_args()
    dev = _device_for("cuda")
    for layer in load_suite(args.suite):
        spec = dataclasses.replace(layer.spec, dtype=_DTYPES[args.dtype], layout=args.layout,
                                   conv_pass=args.conv_pass)
        pool = ranked(args.algo, spec, dev) if args.algo == "auto" else [get_variant(args.algo)]
        if not pool:
            print(f"{layer.name}: no variant")
            continue
        v = pool[0]
        prm = v.default(spec, dev)
        if args.params:
            prm = Params(dict(prm), **dict(Params.parse(args.params)))
        plan = v.plan(spec, prm, dev, Epilogue())
        infos = {i.kernel: i for i in ptxas_report(plan.source("cuda"))}
        parts = []
        for step in plan.steps:
            kern = next((k for k in plan.kernels if isinstance(step, Launch) and k.name == step.kernel), None)
            if kern is None or kern.name not in infos:
                continue
            info, blocks = infos[kern.name], step.grid[0] * step.grid[1] * step.grid[2]
            per_unit = resident(kern, info)
            waves = blocks / (per_unit * _UNITS) if per_unit else float("inf")
            spill = f" (spills {info.spill_stores} B)" if info.spill_stores or info.spill_loads else ""
            parts.append(f"{kern.name} {info.registers} regs{spill} x {kern.threads}: {blocks} blocks, "
                         f"{per_unit} an SM, {waves:.2f} waves")
        print(f"{layer.name} | {v.name} [{prm.short()}] | " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
