"""helpers.ptxas_reports / sass_reports: several CUDA sources through one nvcc run give each source the
ptxas figures (registers, spills, stack, shared memory) and the SASS of its own compile, and a source that
does not compile is still named by its own error."""

from __future__ import annotations

import dataclasses
import re

import pytest

from conftest import NOMINAL_CUDA
from convforge.codegen.nvcc import ptxas_report, sass_report
from convforge.codegen.render import ARCH_SPECIFIC_MARK
from convforge.kernels import get_variant
from convforge.plan import Epilogue, Prologue
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, ptxas_reports, sass_reports

RESNET = ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1)


def _sources() -> list[str]:
    """Sources of several families, two of them twice in other forms (the same kernel names and
    macros in two namespaces of the unit), one for sm_90a (wgmma), half storage, a prologue. Small
    filters: what is checked is the batching, and a source's compile time is its unrolled taps' (the
    11x11 direct source alone took 4.7 s of nvcc, a 7x7 depthwise one 2.1 s)."""
    half = dataclasses.replace(ODD_SPECS[1], dtype="float16")
    cases = [("winograd_fused_f2", RESNET, Epilogue(bias=True, relu=True)),
             ("winograd_nonfused_f4", RESNET, Epilogue(bias=True, relu=True, residual=True)),
             ("winograd_nonfused_f4", ConvSpec.make(32, 128, 28, 28, 128, 3, 3, 1, 1), Epilogue()),
             ("direct", half, Epilogue(bias=True, relu=True)),
             ("direct", ODD_SPECS[1], Epilogue()),
             ("depthwise_nhwc", ConvSpec.make(32, 96, 56, 56, 96, 3, 3, 1, 1, groups=96, dtype="bfloat16",
                                              layout="nhwc"), Epilogue(bias=True, silu=True)),
             ("tc_implicit_gemm_tf32", RESNET, Epilogue(bias=True, relu=True)),
             ("gemm1x1_splitk", ConvSpec.make(1, 832, 7, 7, 256, 1, 1), Epilogue(bias=True))]
    out = []
    for name, spec, epi in cases:
        v = get_variant(name)
        assert v.applies(spec, NOMINAL_CUDA) is None, (name, v.applies(spec, NOMINAL_CUDA))
        out.append(v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, epi).source("cuda"))
    v = get_variant("implicit_gemm")
    out.append(v.plan_for(RESNET, v.default(RESNET, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(bias=True),
                          Prologue(True, True)).source("cuda"))
    return out


def _sections(sass: str) -> dict[str, list[str]]:
    """Each kernel's SASS lines, whitespace collapsed (cuobjdump pads its columns to the widest line of
    the cubin), by kernel name, in cuobjdump's order."""
    out = {}
    for section in re.split(r"\n\s+Function : ", sass)[1:]:
        name, _, body = section.partition("\n")
        out[name] = [" ".join(line.split()) for line in body.splitlines() if line.strip()]
    return out


TINY = 'extern "C" __global__ void __launch_bounds__(32) k(float* y)\n{\n    y[threadIdx.x] = 1.0f;\n}\n'


def test_batched_reports_equal_single_compiles(nvcc_ok) -> None:  # type: ignore[no-untyped-def]
    """ptxas_reports' figures of every source are its own compile's; sass_reports' figures and SASS
    (each kernel's instructions, in order, under its own name) of a multi-kernel sm_90 source and a
    multi-kernel sm_90a one, each batched with a one-kernel source of its target, are too."""
    sources = _sources()
    assert any(ARCH_SPECIFIC_MARK in s for s in sources) and not all(ARCH_SPECIFIC_MARK in s for s in sources)
    sm90, sm90a = 7, 6  # gemm1x1_splitk (two kernels), tc_implicit_gemm_tf32 (three)
    assert ARCH_SPECIFIC_MARK in sources[sm90a] and ARCH_SPECIFIC_MARK not in sources[sm90]
    alone_sass = {i: sass_report(sources[i]) for i in (sm90, sm90a)}
    alone = [sorted(alone_sass[i][0] if i in alone_sass else ptxas_report(s), key=lambda i: i.kernel)
             for i, s in enumerate(sources)]
    together = [sorted(r, key=lambda i: i.kernel) for r in ptxas_reports(sources)]
    assert all(alone) and together == alone
    batch = [sources[sm90], TINY, sources[sm90a], ARCH_SPECIFIC_MARK + "\n" + TINY]
    reports = sass_reports(batch)
    for (infos, sass), i in zip(reports[::2], (sm90, sm90a), strict=True):
        assert sorted(infos, key=lambda i: i.kernel) == alone[i]
        own = _sections(alone_sass[i][1])
        assert len(own) >= 2 and _sections(sass) == own
    for infos, sass in reports[1::2]:
        assert [i.kernel for i in infos] == ["k"] and list(_sections(sass)) == ["k"]


def test_a_source_that_fails_is_named_by_its_own_error(nvcc_ok) -> None:  # type: ignore[no-untyped-def]
    good = 'extern "C" __global__ void __launch_bounds__(32) k(float* y)\n{\n    y[threadIdx.x] = 1.0f;\n}\n'
    bad = good.replace("1.0f;", "undeclared_name;")
    with pytest.raises(RuntimeError, match="undeclared_name"):
        ptxas_reports([good, bad])
    assert [i.kernel for i in ptxas_reports([good, good])[1]] == ["k"]
