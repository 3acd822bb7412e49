"""Offline CUDA compile check with nvcc: errors, registers, shared memory, spills per kernel.

Used by the CPU test tier (no GPU needed) and ``convforge show --ptxas``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class PtxasInfo:
    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def ptxas_report(source: str, arch: str = "sm_90") -> list[PtxasInfo]:
    """Compile ``source`` to a cubin with ``-Xptxas -v``; raise RuntimeError with the log on error."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.cu")
        with open(src, "w") as f:
            f.write(source)
        proc = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-std=c++17", "-Xptxas", "-v",
                               "-o", os.path.join(tmp, "k.cubin"), src],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{proc.stderr}")
    return parse_ptxas(proc.stderr)


def parse_ptxas(log: str) -> list[PtxasInfo]:
    """Per-kernel figures from ptxas's verbose log."""
    out: list[PtxasInfo] = []
    current, stack, spills = "", 0, (0, 0)
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            stack, spills = int(m.group(1)), (int(m.group(2)), int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            sm = re.search(r"(\d+) bytes smem", line)
            out.append(PtxasInfo(current, int(m.group(1)), spills[0], spills[1], stack,
                                 int(sm.group(1)) if sm else 0))
    return out
