"""``convforge algos --matrix``: which family serves which pass, dtype, back-end and architecture.

Everything is read from the variant registry (``kernels.all_variants()``): a variant's ``passes``,
``dtypes`` and ``backends`` are declared, and its architecture is what its ``applies`` accepts.
The architecture is found by asking ``applies`` about a set of probe layers on nominal CUDA
devices that differ only in compute capability: the lowest capability on which some probe layer
runs is the variant's floor. A variant no probe layer fits is marked ``cuda?`` (add a probe)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from convforge.plan import DeviceInfo, Variant
from convforge.spec import DTYPES, PASSES, ConvSpec

# Nominal CUDA devices, least capable first; alike but for the compute capability, so that a
# refusal between them is one of architecture, not of shared memory or unit count.
_KIB = 1024
ARCHS: tuple[tuple[str, DeviceInfo], ...] = tuple(
    (label, DeviceInfo("cuda", f"nominal sm_{cc[0]}{cc[1]}", cc=cc, shared_optin_bytes=227 * _KIB, units=132))
    for label, cc in (("cuda", (7, 0)), ("sm_80+", (8, 0)), ("sm_90", (9, 0)))
)
ARCH_HELP = ("a cell: where the family's variants of that pass and dtype run (how many variants).\n"
             "opencl: the OpenCL back-end; cuda: any CUDA device; sm_80+: compute capability 8.0 or above;\n"
             "sm_90: compute capability 9.0 only (sm_90a); cuda?: no probe layer fits, architecture not found")

# Layers of the kinds the families specialise in: 3x3, 1x1 (plain, strided, 16-byte-aligned rows),
# strided 3x3, stems, fully-connected, depthwise, 5x5, deep layers at batch 1 (split-K).
PROBES = (
    "N=32,C=64,H=56,W=56,K=64,R=3,S=3,pad=1",
    "N=32,C=512,H=7,W=7,K=512,R=3,S=3,pad=1",
    "N=1,C=512,H=7,W=7,K=512,R=3,S=3,pad=1",
    "N=32,C=256,H=14,W=14,K=256,R=1,S=1",
    "N=32,C=256,H=16,W=16,K=256,R=1,S=1",
    "N=32,C=256,H=28,W=28,K=512,R=1,S=1,stride=2",
    "N=1,C=1024,H=14,W=14,K=2048,R=1,S=1,stride=2",
    "N=32,C=128,H=56,W=56,K=128,R=3,S=3,stride=2,pad=1",
    "N=32,C=3,H=224,W=224,K=64,R=7,S=7,stride=2,pad=3",
    "N=32,C=3,H=227,W=227,K=96,R=11,S=11,stride=4",
    "N=128,C=4096,H=1,W=1,K=4096,R=1,S=1",
    "N=5,C=256,H=6,W=6,K=4096,R=6,S=6",
    "N=32,C=96,H=56,W=56,K=96,R=7,S=7,pad=3,groups=96",
    "N=32,C=256,H=14,W=14,K=256,R=3,S=3,pad=1,groups=8",
    "N=32,C=256,H=56,W=56,K=256,R=3,S=3,stride=2,pad=1,groups=32",
    "N=32,C=32,H=28,W=28,K=64,R=5,S=5,pad=2",
)


@dataclass(frozen=True)
class Cell:
    """One family's offer for one pass and dtype: its variants and where they run."""

    variants: tuple[str, ...]
    targets: tuple[str, ...]  # "opencl", then the architecture labels of ARCHS (and "cuda?")

    def text(self) -> str:
        return f"{' '.join(self.targets)} ({len(self.variants)})" if self.variants else "-"


def arch_floor(variant: Variant, conv_pass: str, dtype: str) -> str:
    """The label of the least capable nominal CUDA device on which ``variant`` runs some probe layer
    in ``conv_pass`` and ``dtype``; ``cuda?`` when it runs none."""
    specs = [replace(ConvSpec.parse(p), conv_pass=conv_pass, dtype=dtype, layout=layout)
             for p in PROBES for layout in sorted(variant.layouts)]
    for label, device in ARCHS:
        if any(variant.applies(spec, device) is None for spec in specs):
            return label
    return "cuda?"


def _targets(variant: Variant, conv_pass: str, dtype: str) -> set[str]:
    out = {"opencl"} if "opencl" in variant.backends else set()
    if "cuda" in variant.backends:
        out.add(arch_floor(variant, conv_pass, dtype))
    return out


def matrix(variants: Iterable[Variant]) -> dict[tuple[str, str], dict[str, Cell]]:
    """(family, pass) -> dtype -> :class:`Cell`, for every family and pass some variant serves."""
    found: dict[tuple[str, str, str], tuple[list[str], set[str]]] = {}
    for v in variants:
        for p in v.passes:
            for d in v.dtypes:
                names, targets = found.setdefault((v.family, p, d), ([], set()))
                names.append(v.name)
                targets |= _targets(v, p, d)
    order = ["opencl", *(label for label, _ in ARCHS), "cuda?"]
    table: dict[tuple[str, str], dict[str, Cell]] = {}
    for family in sorted({f for f, _, _ in found}):
        for p in PASSES:
            cells = {d: Cell(tuple(found[family, p, d][0]), tuple(t for t in order if t in found[family, p, d][1]))
                     for d in DTYPES if (family, p, d) in found}
            if cells:
                table[family, p] = {d: cells.get(d, Cell((), ())) for d in DTYPES}
    return table


def format_matrix(table: dict[tuple[str, str], dict[str, Cell]]) -> str:
    """The table as text: a row per family and pass, a column per dtype, each cell the back-ends
    and architectures that serve it and (in brackets) how many variants."""
    rows = [["family", "pass", *DTYPES]]
    rows += [[family, p, *(cells[d].text() for d in DTYPES)] for (family, p), cells in table.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:], "", ARCH_HELP])
