"""Helpers for tests: sampled tuning points, the nvcc compile check, the CLI run in process."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from convforge.cli import main
from convforge.codegen.nvcc import PtxasInfo, ptxas_report, sass_report
from convforge.codegen.render import ARCH_SPECIFIC_MARK
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue, Variant
from convforge.spec import ConvSpec

# Shapes that break lazy indexing: N=1, C=1, K=1, primes, stride 2/4, dilation 2, 11x11, asymmetric pad.
ODD_SPECS = [
    ConvSpec.make(1, 1, 13, 13, 1, 3, 3, 1, 1),
    ConvSpec.make(2, 3, 13, 11, 5, 3, 3, 1, (0, 1, 1, 0)),
    ConvSpec.make(1, 2, 71, 13, 3, 3, 3, 2, 1),
    ConvSpec.make(3, 5, 17, 19, 7, 5, 5, 1, 2, 2),
    ConvSpec.make(1, 3, 27, 29, 4, 11, 11, 4, (2, 1, 0, 3)),
    ConvSpec.make(2, 7, 9, 9, 3, 1, 1, 1, 0),
    ConvSpec.make(1, 4, 15, 15, 6, 3, 1, (1, 2), (1, 1, 0, 0)),
]


def sample(variant: Variant, spec: ConvSpec, device: DeviceInfo, k: int = 2, seed: int = 0) -> list[Params]:
    """The default point plus ``k`` seeded random points of the space."""
    space = variant.space(spec, device)
    pts = [variant.default(spec, device)]
    rng = random.Random(seed)
    for p in rng.sample(space, min(k, len(space))):
        if p not in pts:
            pts.append(p)
    return pts


def covering(points: list[Params], combos: tuple[str, ...] = ()) -> list[Params]:
    """A deterministic subset of ``points`` (in their order) holding every value each parameter
    takes among them (absent counts as a value), the first and last points, and the first point of
    every distinct combination of the ``combos`` parameters' values: what a compile check over a
    whole tuning space exercises, in a fraction of its points."""
    keys = sorted({k for p in points for k in p})
    seen_pairs: set[tuple[str, object]] = set()
    seen_combos: set[tuple[object, ...]] = set()
    out: list[Params] = []
    for i, p in enumerate(points):
        pairs = {(k, p.get(k)) for k in keys}
        combo = tuple(p.get(k) for k in combos)
        if i in (0, len(points) - 1) or not pairs <= seen_pairs or combo not in seen_combos:
            out.append(p)
        seen_pairs |= pairs
        seen_combos.add(combo)
    return out


def assert_compiles_clean(variant: Variant, spec: ConvSpec, params: Params, device: DeviceInfo,
                          epilogue: Epilogue = Epilogue()) -> None:
    """nvcc -arch=sm_90 -cubin -Xptxas -v: no error and no spill in any kernel."""
    src = variant.plan(spec, params, device, epilogue).source("cuda")
    infos = ptxas_report(src)
    assert infos, "ptxas reported no kernel"
    for info in infos:
        assert info.spill_stores == 0 and info.spill_loads == 0, (
            f"{variant.name} [{params.short()}] {info.kernel} spills: {info}")


# A kernel's definition as the renderer writes it: extern "C" __global__ void [__attr__(...)]* name(
_KERNEL = re.compile(r'(extern "C" __global__ void(?:\s+__\w+__\([^()]*\))*\s+)(\w+)(\s*\()')
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)", re.M)
_RENAMED = re.compile(r"(\w+)__cfb(\d+)")


def _batch_groups(sources: Sequence[str], arch: str) -> tuple[list[int], dict[str, list[int]]]:
    """(indices of the sources to compile alone, {target: indices of the sources batched for it}): a
    source with an #include, or with a __global__ the renaming does not match, goes alone."""
    alone: list[int] = []
    groups: dict[str, list[int]] = {}
    for i, src in enumerate(sources):
        if "#include" in src or src.count("__global__") != len(_KERNEL.findall(src)):
            alone.append(i)
        else:
            target = arch + "a" if ARCH_SPECIFIC_MARK in src and not arch.endswith("a") else arch
            groups.setdefault(target, []).append(i)
    return alone, groups


def _batch_unit(sources: Sequence[str], members: Sequence[int]) -> str:
    """One translation unit of ``members``' sources: each in namespace cfbI, its kernels renamed
    name__cfbI, its macros undefined after it."""
    return "".join(f"namespace cfb{i} {{\n"
                   + _KERNEL.sub(lambda m, i=i: f"{m.group(1)}{m.group(2)}__cfb{i}{m.group(3)}", sources[i])
                   + "\n}\n" + "".join(f"#undef {name}\n" for name in dict.fromkeys(_DEFINE.findall(sources[i])))
                   for i in members)


def _split_infos(infos: list[PtxasInfo], out: dict[int, list[PtxasInfo]]) -> None:
    """The batched unit's ptxas figures, each under its source's index with its kernel's own name."""
    for info in infos:
        m = _RENAMED.fullmatch(info.kernel)
        assert m, f"a kernel of the batched unit was not renamed: {info.kernel}"
        out[int(m.group(2))].append(PtxasInfo(m.group(1), info.registers, info.spill_stores, info.spill_loads,
                                              info.stack, info.shared))


def ptxas_reports(sources: Sequence[str], arch: str = "sm_90") -> list[list[PtxasInfo]]:
    """``ptxas_report`` of each source, from one nvcc run per target (sm_90 / sm_90a) instead of one
    per source. nvcc's fixed cost, preprocessing and parsing the CUDA runtime headers it includes in
    every translation unit, is about 0.5 s of CPU a call, paid here once: the sources go into one unit,
    each in a namespace of its own, its kernels renamed (name__cfbI, then named back) and its macros
    undefined after it. ptxas allocates each kernel's registers on its own, so the figures are those of
    the source's own compile (test_nvcc_batch.test_batched_reports_equal_single_compiles checks that). A
    source the renaming does not fit, and every source of a unit that fails, is compiled alone (the
    error then names its source)."""
    def split(infos: list[PtxasInfo], members: list[int]) -> dict[int, list[PtxasInfo]]:
        per: dict[int, list[PtxasInfo]] = {i: [] for i in members}
        _split_infos(infos, per)
        return per

    return [o if o is not None else [] for o in _batched(sources, arch, ptxas_report, split)]


def _batched(sources: Sequence[str], arch: str, one: Any, split: Any) -> list[Any]:
    """``one(source, target)`` of each source from one run per target of the batched unit, ``split(result,
    members)`` handing each member its share; a source the renaming does not fit, and every member of a
    unit that fails, compiled alone. None where nothing was compiled (no sources)."""
    out: list[Any] = [None] * len(sources)
    alone, groups = _batch_groups(sources, arch)
    for i in alone:
        out[i] = one(sources[i], arch)
    for target, members in groups.items():
        try:
            res = one(_batch_unit(sources, members), target) if len(members) > 1 else None
        except RuntimeError:
            res = None
        if res is None:
            for i in members:
                out[i] = one(sources[i], target)
            continue
        for i, mine in split(res, members).items():
            out[i] = mine
    return out


_FUNCTION = re.compile(r"(?=\n[ \t]+Function : )")


def sass_reports(sources: Sequence[str], arch: str = "sm_90") -> list[tuple[list[PtxasInfo], str]]:
    """``sass_report`` of each source (ptxas figures, SASS text), batched as ``ptxas_reports``: one nvcc
    and one cuobjdump run per target. Each source's SASS text is cuobjdump's header and the sections
    ("Function : name") of its own kernels, in the unit's order, under their own names
    (test_nvcc_batch.test_batched_reports_equal_single_compiles checks the instructions are those of the
    source's own compile)."""
    def split(res: tuple[list[PtxasInfo], str], members: list[int]) -> dict[int, tuple[list[PtxasInfo], str]]:
        per: dict[int, list[PtxasInfo]] = {i: [] for i in members}
        _split_infos(res[0], per)
        head, *sections = _FUNCTION.split(res[1])
        text = {i: head for i in members}
        for section in sections:
            m = re.match(r"\n[ \t]+Function : \w+?__cfb(\d+)\b", section)
            assert m, f"a kernel of the batched unit was not renamed: {section[:80]!r}"
            i = int(m.group(1))
            text[i] += re.sub(rf"\b(\w+)__cfb{i}\b", r"\1", section)
        return {i: (per[i], text[i]) for i in members}

    return [o if o is not None else ([], "") for o in _batched(sources, arch, sass_report, split)]


def assert_sources_compile_clean(sources: Sequence[tuple[str, str]], arch: str = "sm_90") -> list[list[PtxasInfo]]:
    """Each (label, CUDA source) compiles (``ptxas_reports``: one nvcc run for all) with no spill in any
    kernel; their reports, in order."""
    reports = ptxas_reports([src for _, src in sources], arch)
    for (label, _), infos in zip(sources, reports, strict=True):
        assert infos, f"{label}: ptxas reported no kernel"
        for info in infos:
            assert info.spill_stores == 0 and info.spill_loads == 0, f"{label} {info.kernel} spills: {info}"
    return reports


def run_main(argv: list[str], capsys) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """``convforge`` main() in process: (exit status, stdout + stderr); argparse's own errors exit
    with status 2 through SystemExit."""
    try:
        rc = main(argv)
    except SystemExit as ex:
        rc = int(ex.code or 0)
    out = capsys.readouterr()
    return rc, out.out + out.err
