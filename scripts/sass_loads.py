"""Where the global loads sit in each generated kernel's main loop (SASS, no GPU needed).

    PYTHONPATH=src python scripts/sass_loads.py --spec 'N=...' --variant V [--params k=v,...]

Compiles the CUDA source with nvcc and disassembles it with cuobjdump (CUDA toolkit, or the
``nvidia-cuda-cuobjdump`` wheel on PATH). For each kernel's largest loop it prints the number of
FFMAs and, for each LDG, how many of the loop's FFMAs come before it: a prefetch that ptxas sank
to the end of the loop (all FFMAs before it) no longer hides its latency.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

from convforge.cli import _device_for
from convforge.codegen.nvcc import nvcc_path, parse_ptxas
from convforge.kernels import get_variant
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.spec import ConvSpec

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")


def loops(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """Per kernel, its instructions as (address, opcode, operands)."""
    out: dict[str, list[tuple[int, str, str]]] = {}
    name = ""
    for line in sass.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = _INS.search(line)
        if m and name:
            out[name].append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def report(ins: list[tuple[int, str, str]]) -> str:
    """The largest backward branch's body: FFMA count and each LDG's position among them."""
    best: tuple[int, int] | None = None
    for addr, op, arg in ins:
        m = re.search(r"0x([0-9a-f]+)", arg) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < addr:
            span = (int(m.group(1), 16), addr)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        return "no loop"
    body = [(op, arg) for a, op, arg in ins if best[0] <= a <= best[1]]
    ffma, pos = 0, []
    for op, _ in body:
        ffma += op.startswith("FFMA")
        if op.startswith("LDG") or op.startswith("LDGSTS"):
            pos.append(ffma)
    return f"loop of {len(body)} instructions, {ffma} FFMA; LDG after FFMA " + \
        (", ".join(map(str, pos)) or "-")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--params", default="")
    args = ap.parse_args()
    spec, v = ConvSpec.parse(args.spec), get_variant(args.variant)
    dev = _device_for("cuda")
    prm = v.default(spec, dev)
    prm = Params(dict(prm), **dict(Params.parse(args.params))) if args.params else prm
    src = v.plan(spec, prm, dev, Epilogue()).source("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.cubin")
        with open(cu, "w") as f:
            f.write(src)
        log = subprocess.run([nvcc_path() or "nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v",
                              "-o", cubin, cu], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    regs = {i.kernel: i for i in parse_ptxas(log)}
    print(f"{v.name} {prm.short()}")
    for name, ins in loops(sass).items():
        r = regs.get(name)
        print(f"  {name}: {r.registers if r else '?'} regs, "
              f"{r.spill_stores if r else '?'} spill bytes; {report(ins)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
