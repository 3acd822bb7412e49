"""The built-in ``unseen`` suite: layers outside resnet/boda/mec for issue 16's relaxed-class target."""

from __future__ import annotations

from typing import Any

import pytest

from convforge import dispatch
from convforge.apps.bench import suites
from convforge.check import check_plan
from convforge.spec import ConvSpec


def test_unseen_suite_loads_and_every_layer_is_what_its_name_says() -> None:
    layers = suites.load_suite("unseen")
    assert "unseen" in suites.BUILTIN and 12 <= len(layers) <= 17
    names = [layer.name for layer in layers]
    assert len(set(names)) == len(names)
    specs = {layer.name: layer.spec for layer in layers}
    assert all(s.n == 32 for s in specs.values())
    s = specs["incv3_1x7_768to192_17x17"]
    assert (s.c, s.k, s.r, s.s, s.pad, s.p, s.q) == (768, 192, 1, 7, (0, 0, 3, 3), 17, 17)
    s = specs["incv3_7x1_768to192_17x17"]
    assert (s.r, s.s, s.pad, s.p, s.q) == (7, 1, (3, 3, 0, 0), 17, 17)
    assert (specs["incv3_3x3s2_288to384_35x35"].p, specs["incv3_3x3s2_192to320_17x17"].q) == (17, 8)
    assert specs["3x3s2_256to256_28x28_pad1"].p == 14
    for d in (2, 4):
        s = specs[f"dilated{d}_3x3_512_28x28"]
        assert (s.dilation, s.p, s.q) == ((d, d), 28, 28)
    s = specs["odd_11x11s4_3to96_227x227"]
    assert (s.c, s.k, s.stride, s.p) == (3, 96, (4, 4), 55)
    s = specs["odd_1x1_1280to320_8x8"]
    assert (s.c, s.k, s.r, s.p) == (1280, 320, 1, 8)
    # outside the three suites: no geometry (ignoring the batch) repeats one of theirs
    def geometry(sp: ConvSpec) -> tuple[Any, ...]:
        return (sp.c, sp.h, sp.w, sp.k, sp.r, sp.s, sp.stride, sp.pad, sp.dilation)

    known = {(geometry(x.spec), x.spec.n) for name in ("resnet", "boda", "mec") for x in suites.load_suite(name)}
    assert not {(geometry(sp), sp.n) for sp in specs.values()} & known


@pytest.mark.parametrize("precision", ["fp32", "relaxed"])
def test_unseen_geometries_run_correctly_on_pocl(ocl: Any, precision: str) -> None:
    """Smoke test: every layer's geometry (kernel, stride, padding, dilation, size) with one image and
    at most 8 channels in and out, through dispatch's choice in each class, against float64."""
    seen = set()
    for layer in suites.load_suite("unseen"):
        s = layer.spec
        small = ConvSpec(1, min(s.c, 8), s.h, s.w, min(s.k, 8), s.r, s.s, s.stride, s.pad, s.dilation)
        ch = dispatch.choose(small, ocl, precision=precision)
        if (small, ch.variant.name) in seen:
            continue
        seen.add((small, ch.variant.name))
        res = check_plan(ch.variant.plan(small, ch.params, ocl.device), ocl, seed=1)
        assert res.ok, f"{layer.name} ({small.short()}) with {ch.variant.name}: {res}"
