"""Offline CUDA compile check with nvcc: errors, registers, shared memory, spills per kernel.

Used by the CPU test tier (no GPU needed) and ``convforge show --ptxas``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
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
    return parse_ptxas(_compile(source, arch, sass=False)[0])


def tool_path(name: str) -> str | None:
    """A CUDA tool from PATH, else from its ``nvidia-cuda-<name>`` wheel (nvidia/cu*/bin)."""
    found = shutil.which(name)
    if found:
        return found
    for entry in sys.path:
        for cand in sorted(glob.glob(os.path.join(entry, "nvidia", "cu*", "bin", name))):
            if os.access(cand, os.X_OK):
                return cand
    return None


def cuobjdump_path() -> str | None:
    """cuobjdump, when nvdisasm (which ``cuobjdump -sass`` runs) is there too."""
    return tool_path("cuobjdump") if tool_path("nvdisasm") else None


def sass_report(source: str, arch: str = "sm_90") -> tuple[list[PtxasInfo], str]:
    """(ptxas figures, SASS text of the cubin from ``cuobjdump -sass``)."""
    return parse_ptxas((out := _compile(source, arch, sass=True))[0]), out[1]


def _compile(source: str, arch: str, sass: bool) -> tuple[str, str]:
    """(ptxas log, SASS text or "") of ``source``; RuntimeError naming what failed."""
    arch = _arch_for(source, arch)
    dump = cuobjdump_path() if sass else None
    if sass and dump is None:
        raise RuntimeError("cuobjdump / nvdisasm not found (CUDA toolkit, or pip install "
                           "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        # An arch-specific target (sm_90a) through -gencode: the -arch=sm_90a shorthand also runs a
        # plain sm_90 pass on newer nvcc, which rejects wgmma / setmaxnreg (HOPPER.md).
        target = f"-gencode=arch=compute_{arch[3:]},code={arch}" if arch.endswith("a") else f"-arch={arch}"
        log = _nvcc(tmp, source, [target, "-cubin", "-Xptxas", "-v"], cubin)
        if not dump:
            return log, ""
        env = dict(os.environ, NVDISASM_PATH=os.path.dirname(tool_path("nvdisasm") or ""))
        dis = subprocess.run([dump, "-sass", cubin], capture_output=True, text=True, env=env)
        if dis.returncode != 0:
            raise RuntimeError(f"cuobjdump failed:\n{dis.stderr}")
        return log, dis.stdout


def ptx_text(source: str, arch: str = "sm_90") -> str:
    """The PTX nvcc's front end makes of ``source`` (what ptxas is given): for checks of values the
    front end folds, such as the operands of an unrolled loop's inline assembly."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        _nvcc(tmp, source, [f"-arch={_arch_for(source, arch)}", "-ptx"], ptx)
        with open(ptx) as f:
            return f.read()


def _arch_for(source: str, arch: str) -> str:
    """``arch``, made arch-specific (sm_90a) where the source uses wgmma & co., which exist only there."""
    from convforge.codegen.render import ARCH_SPECIFIC_MARK

    return arch + "a" if ARCH_SPECIFIC_MARK in source and not arch.endswith("a") else arch


def _nvcc(tmp: str, source: str, flags: list[str], out: str) -> str:
    """Compile ``source`` (written to ``tmp``) with nvcc ``flags`` into ``out``; its log, or
    RuntimeError with the log when nvcc is missing or fails."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH")
    src = os.path.join(tmp, "k.cu")
    with open(src, "w") as f:
        f.write(source)
    proc = subprocess.run([nvcc, *flags, "-std=c++17", "-o", out, src], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{proc.stderr}")
    return proc.stderr


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
