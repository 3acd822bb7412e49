"""``convforge algos --matrix``: the registry's family x pass x dtype x architecture table, read from
the variants themselves (CPU only: the architectures come from ``applies`` on nominal devices)."""

from __future__ import annotations

import pytest

from convforge import kernels
from convforge.apps.matrix import ARCHS, Cell, matrix
from convforge.spec import DTYPES
from helpers import run_main


@pytest.fixture(scope="module")
def table() -> dict[tuple[str, str], dict[str, Cell]]:
    return matrix(kernels.all_variants())


def test_every_variant_is_in_the_matrix_once_per_pass_and_dtype(table) -> None:  # type: ignore[no-untyped-def]
    seen = {(name, p, d) for (_, p), cells in table.items() for d, cell in cells.items() for name in cell.variants}
    want = {(v.name, p, d) for v in kernels.all_variants() for p in v.passes for d in v.dtypes}
    assert seen == want
    assert {f for f, _ in table} == {v.family for v in kernels.all_variants()}


def test_every_cuda_variant_has_an_architecture(table) -> None:  # type: ignore[no-untyped-def]
    """A variant no probe layer fits shows ``cuda?``: the probes must cover every family's niche."""
    unknown = [(f, p, d) for (f, p), cells in table.items() for d, c in cells.items() if "cuda?" in c.targets]
    assert not unknown, f"add a probe layer to apps/matrix.py PROBES for {unknown}"


def test_known_facts(table) -> None:  # type: ignore[no-untyped-def]
    assert "depthwise_dgrad" in table["depthwise", "dgrad"]["float16"].variants
    assert "opencl" in table["depthwise", "dgrad"]["float16"].targets
    nonfused = {v.name for v in kernels.all_variants() if v.name.startswith("winograd_nonfused_")}
    assert nonfused
    for (_, _), cells in table.items():
        for d in DTYPES:
            if d != "float32":
                assert not nonfused & set(cells[d].variants), (d, cells[d])
    # wgmma variants run only on compute capability 9.0; mma.sync (TF32) from 8.0 on
    sm90, sm80 = ARCHS[-1][0], ARCHS[1][0]
    assert table["implicit_gemm", "wgrad"]["float16"].targets == (sm90,)
    assert sm80 in table["gemm1x1", "fprop"]["float32"].targets


def test_cli_prints_every_family(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(["algos", "--matrix"], capsys)
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[0].split() == ["family", "pass", *DTYPES]
    for family in {v.family for v in kernels.all_variants()}:
        assert any(line.split()[:1] == [family] for line in lines[2:]), family


def test_spec_or_matrix_is_needed(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(["algos"], capsys)
    assert rc == 2 and "one of the arguments --spec --matrix is required" in out, out
