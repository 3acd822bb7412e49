"""Reading SASS (``cuobjdump -sass`` text) for the one property we check in it: where a kernel's
main loop issues its global loads.

A register prefetch only hides latency if its loads issue early in the loop body; ptxas is free
to sink them towards their use (it did, below every FFMA of the slice, while the prefetch was
guarded by a branch). :func:`main_loop` finds the largest loop of each kernel and reports, for
each LDG in it, how many of the loop's FFMAs come before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_FUNC = re.compile(r"\s+Function : (\S+)")


@dataclass(frozen=True)
class LoopLoads:
    """The largest loop of one kernel: its length, FFMA count and the FFMAs before each LDG."""

    kernel: str
    instructions: int
    ffma: int
    ldg_after: tuple[int, ...]

    def late_loads(self, fraction: float) -> tuple[int, ...]:
        """Positions of the LDGs issued after ``fraction`` of the loop's FFMAs."""
        return tuple(p for p in self.ldg_after if p > fraction * self.ffma)

    def summary(self) -> str:
        after = ", ".join(map(str, self.ldg_after)) or "-"
        return f"loop of {self.instructions} instructions, {self.ffma} FFMA; LDG after FFMA {after}"

    def __str__(self) -> str:
        return f"{self.kernel}: {self.summary()}"


def instructions(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """Per kernel, its instructions as (address, opcode, operands)."""
    out: dict[str, list[tuple[int, str, str]]] = {}
    name = ""
    for line in sass.splitlines():
        m = _FUNC.match(line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = _INS.search(line)
        if m and name:
            out[name].append((int(m.group(1), 16), m.group(2), m.group(3)))
    return out


def main_loop(kernel: str, ins: list[tuple[int, str, str]]) -> LoopLoads | None:
    """The span of the largest backward branch of ``ins`` (None when the kernel has no loop)."""
    best: tuple[int, int] | None = None
    for addr, op, arg in ins:
        m = re.search(r"0x([0-9a-f]+)", arg) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < addr:
            span = (int(m.group(1), 16), addr)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        return None
    ffma, after = 0, []
    body = [op for a, op, _ in ins if best[0] <= a <= best[1]]
    for op in body:
        ffma += op.startswith("FFMA")
        if op.startswith("LDG"):
            after.append(ffma)
    return LoopLoads(kernel, len(body), ffma, tuple(after))


def loop_loads(sass: str) -> dict[str, LoopLoads | None]:
    """:func:`main_loop` of every kernel in a ``cuobjdump -sass`` listing."""
    return {k: main_loop(k, ins) for k, ins in instructions(sass).items()}
