"""SASS of the shared SGEMM generator's kernels (nvcc + cuobjdump, no GPU): the register prefetch
of the next k-slice must issue before the bulk of the slice's FFMAs. ptxas once sank it below every
FFMA (a guarded prefetch; docs/NOTES-winograd.md, round 4), which cost 7-37 % on the H200.

Checked on the big-tile defaults (8x8 micro-tiles, ~128 registers, 2 blocks per SM), where the
prefetch is what hides global latency; small tiles (4x4, ~50 registers, 4+ blocks per SM) rely on
occupancy instead and ptxas may schedule their loads late."""

from __future__ import annotations

import os

import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.nvcc import cuobjdump_path
from convforge.codegen.sass import loop_loads
from convforge.kernels import get_variant
from convforge.spec import ConvSpec
from helpers import sass_reports

CASES = [("winograd_nonfused_f4", ConvSpec.make(32, 256, 14, 14, 256, 3, 3, padding=1)),
         ("winograd_nonfused_f4", ConvSpec.make(32, 512, 7, 7, 512, 3, 3, padding=1)),
         ("winograd_nonfused_f2", ConvSpec.make(8, 64, 28, 28, 64, 3, 3, padding=1)),
         ("implicit_gemm", ConvSpec.make(8, 64, 30, 30, 128, 3, 3)),
         ("implicit_gemm_precomp", ConvSpec.make(8, 128, 28, 28, 128, 3, 3, padding=1)),
         ("im2col_gemm", ConvSpec.make(8, 64, 30, 30, 128, 3, 3)),
         ("im2win", ConvSpec.make(8, 64, 30, 30, 128, 3, 3)),
         ("gemm1x1", ConvSpec.make(32, 256, 28, 28, 256, 1, 1))]


@pytest.fixture(scope="module")
def cuobjdump_ok(nvcc_ok):
    if cuobjdump_path() is None:
        if os.environ.get("CI"):
            pytest.fail("cuobjdump/nvdisasm missing on CI: the test extras install their wheels")
        pytest.skip("cuobjdump/nvdisasm not found: SASS checks skipped")
    return True


@pytest.mark.usefixtures("cuobjdump_ok")
def test_prefetch_issues_early() -> None:
    """Each CASES default's SGEMM main loop (one nvcc + cuobjdump run for all, helpers.sass_reports):
    a big-tile loop whose register prefetch (LDG) issues before the last tenth of its FFMAs."""
    sources = [get_variant(name).plan(spec, get_variant(name).default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
               .source("cuda") for name, spec in CASES]
    for (name, _), (_, sass) in zip(CASES, sass_reports(sources), strict=True):
        loops = {k: lp for k, lp in loop_loads(sass).items() if k.endswith("sgemm") and lp}
        assert loops, f"no SGEMM main loop found in {name}'s SASS"
        for loop in loops.values():
            assert loop.ffma >= 512 and loop.ldg_after, f"{name}: not a big-tile main loop: {loop}"
            assert not loop.late_loads(0.9), f"{name}: prefetch sunk below 90 % of the FFMAs: {loop}"
