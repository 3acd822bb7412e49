"""Helpers for tests: sampled tuning points, the nvcc compile check, the CLI run in process."""

from __future__ import annotations

import random

from convforge.cli import main
from convforge.codegen.nvcc import ptxas_report
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


def run_main(argv: list[str], capsys) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """``convforge`` main() in process: (exit status, stdout + stderr); argparse's own errors exit
    with status 2 through SystemExit."""
    try:
        rc = main(argv)
    except SystemExit as ex:
        rc = int(ex.code or 0)
    out = capsys.readouterr()
    return rc, out.out + out.err
