"""Explicit parameter sets (``--params``, ``conv2d(params=...)``, database entries) that the
generators cannot take: a ValueError naming the variant, the parameter and what is allowed, before
any source is generated; never a ZeroDivisionError or KeyError from the metacode."""

from __future__ import annotations

import pytest

from conftest import NOMINAL_CUDA
from convforge import kernels
from convforge.params import Params
from convforge.plan import DeviceInfo, Epilogue
from convforge.spec import ConvSpec
from helpers import run_main

NOMINAL_CPU = DeviceInfo("opencl", "nominal OpenCL CPU", is_gpu=False)
SMALL_CPU = DeviceInfo("opencl", "nominal OpenCL CPU of 256 threads a group", is_gpu=False, max_threads=256)
SPECS = [ConvSpec.parse("N=1,C=3,H=13,W=13,K=8,R=3,S=3,pad=1"), ConvSpec.parse("N=1,C=16,H=8,W=8,K=16,R=1,S=1")]


def _size_params() -> list[tuple[str, DeviceInfo, ConvSpec, str]]:
    """(variant, device, spec, parameter) for every integer size parameter of every default (on
    the first spec the variant applies to); a parameter whose declared values include 0 is a
    switch there (the tensor-core generator's ``tm``: TMA off), not a size."""
    out = {}
    for dev in (NOMINAL_CUDA, NOMINAL_CPU):
        for spec in SPECS:
            for v in kernels.all_variants():
                if v.applies(spec, dev) is None:
                    zero = {k for k, vals in v.optional_params.items() if 0 in vals}
                    for k, x in v.default(spec, dev).items():
                        if type(x) is int and k not in kernels.SWITCHES | kernels.ZERO_OK | zero:
                            out.setdefault((v.name, dev.backend, k), (v.name, dev, spec, k))
    return list(out.values())


@pytest.mark.parametrize("name, dev, spec, key", _size_params(),
                         ids=lambda a: a if isinstance(a, str) else getattr(a, "backend", None))
def test_zero_size_refused_by_name(name, dev, spec, key):
    """A tile, thread count or vector width of 0 divided by zero in the generators (256 cases)."""
    v = kernels.get_variant(name)
    bad = v.default(spec, dev).replace(**{key: 0})
    with pytest.raises(ValueError, match=rf"params for {name}: {key} \(0\) must be an int in 1\.\."):
        kernels.check_params(v, spec, dev, bad)


def test_switches_are_zero_or_one():
    v, spec = kernels.get_variant("implicit_gemm"), SPECS[0]
    with pytest.raises(ValueError, match=r"implicit_gemm: pf \(2\) must be an int in 0\.\.1"):
        kernels.check_params(v, spec, NOMINAL_CUDA, v.default(spec, NOMINAL_CUDA).replace(pf=2))
    assert kernels.check_params(v, spec, NOMINAL_CUDA, v.default(spec, NOMINAL_CUDA).replace(pf=0, db=0))


@pytest.mark.parametrize("name, dev, change, message", [
    ("direct_shfl", NOMINAL_CUDA, dict(tq=3), r"direct_shfl: tq \(3\) must be 1"),
    ("direct_shfl", NOMINAL_CUDA, dict(bq=16), r"direct_shfl: bq \(16\) must be 32"),
    ("direct", NOMINAL_CUDA, dict(bq=128, bp=16), r"direct: bq \* bp \(128 x 16\) threads exceed"),
    ("winograd_nonfused_f2", NOMINAL_CPU, dict(tm=63), r"winograd_nonfused_f2: tm \(63\) must divide bm \(16\)"),
    ("winograd_nonfused_f4", NOMINAL_CPU, dict(tn=63), r"winograd_nonfused_f4: tn \(63\) must divide bn \(16\)"),
    ("winograd_nonfused_f6", NOMINAL_CPU, dict(tm=3), r"tm \(3\) must divide bm \(16\)"),
    ("winograd_nonfused_f7", SMALL_CPU, dict(tb=512), r"tb \(512\) threads per transform block exceed"),
    ("implicit_gemm", NOMINAL_CUDA, dict(va=2), r"va \(2\) must be 1"),
    ("gemm1x1", NOMINAL_CUDA, dict(vb=3), r"vb \(3\) must be 1 or 4"),
    ("im2col_gemm", NOMINAL_CUDA, dict(tm=3), r"tm \(3\) must divide bm"),
])
def test_in_range_but_illegal_refused_by_name(name, dev, change, message):
    """Values within check_params' reach that the generator cannot take: plan says which."""
    v = kernels.get_variant(name)
    spec = SPECS[1] if name == "gemm1x1" else SPECS[0]
    prm = kernels.check_params(v, spec, dev, v.default(spec, dev).replace(**change))
    with pytest.raises(ValueError, match=message):
        v.plan(spec, prm, dev, Epilogue()).source(dev.backend)


@pytest.mark.parametrize("text", ["=3", "tp", "tp=2,bq"])
def test_params_text_without_name_or_value(text):
    bad = "=3" if text == "=3" else "tp" if text == "tp" else "bq"
    with pytest.raises(ValueError, match=rf"params item '{bad}' must be NAME=VALUE"):
        Params.parse(text)


@pytest.mark.parametrize("params, message", [
    ("tp=0", r"params for direct: tp \(0\) must be an int in 1\.\.64"),
    ("=3", r"params item '=3' must be NAME=VALUE"),
    ("tp", r"params item 'tp' must be NAME=VALUE"),
])
def test_cli_show_bad_params_one_line(params, message, capsys):
    import re

    rc, out = run_main(["show", "--spec", "N=1,C=3,H=13,W=13,K=8,R=3,S=3", "--variant", "direct",
                        "--backend", "cuda", "--params", params], capsys)
    assert rc == 2 and "Traceback" not in out and re.search(message, out), out
    assert out.count("error:") == 1


def test_cli_show_illegal_in_range(capsys):
    rc, out = run_main(["show", "--spec", "N=1,C=3,H=13,W=13,K=8,R=3,S=3,pad=1", "--variant", "direct_shfl",
                        "--backend", "cuda", "--params", "tq=3"], capsys)
    assert rc == 2 and "Traceback" not in out and "direct_shfl: tq (3) must be 1" in out, out
