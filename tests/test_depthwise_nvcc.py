"""The depthwise family's CUDA kernels in float16 / bfloat16 (and the new float32 forms) compile for
sm_90a with nvcc (``-cubin -Xptxas -v``), without spills, at the defaults ``auto`` picks for real
layers: MobileNet-v2 3x3 (stride 1 and 2), EfficientNet 5x5 /2, ConvNeXt-T 7x7, RepLKNet-31B 31x31
and 13x13 (the tiled form), SLaK's 51x5; NCHW and NHWC; fprop (bias + SiLU), dgrad and wgrad. No GPU
needed; skipped without nvcc."""

from __future__ import annotations

import itertools

from conftest import NOMINAL_CUDA
from convforge.kernels import select
from convforge.plan import Epilogue
from convforge.spec import ConvSpec
from helpers import ptxas_reports

REAL = [ConvSpec.make(64, 144, 56, 56, 144, 3, 3, 1, 1, groups=144),
        ConvSpec.make(64, 96, 112, 112, 96, 3, 3, 2, 1, groups=96),
        ConvSpec.make(64, 672, 14, 14, 672, 5, 5, 2, 2, groups=672),
        ConvSpec.make(32, 96, 56, 56, 96, 7, 7, 1, 3, groups=96),
        ConvSpec.make(32, 128, 56, 56, 128, 31, 31, 1, 15, groups=128),
        ConvSpec.make(32, 1024, 7, 7, 1024, 13, 13, 1, 6, groups=1024),
        ConvSpec.make(32, 96, 56, 56, 96, 51, 5, 1, (25, 25, 2, 2), groups=96)]


def test_half_defaults_compile_clean_for_sm90a(nvcc_ok) -> None:
    """The auto pick's default on every REAL layer, each pass and layout: float16 and bfloat16
    alternate over the layers (each dtype meets every filter size across the two layouts), to keep the
    compile time of the tier down; all the plans go through one nvcc run (helpers.ptxas_reports)."""
    cases = []
    for conv_pass in ("fprop", "dgrad", "wgrad"):
        for layout in ("nchw", "nhwc"):
            for i, base in enumerate(REAL):
                dtype = ("float16", "bfloat16")[(i + (layout == "nhwc")) % 2]
                spec = ConvSpec.from_dict({**base.to_dict(), "dtype": dtype, "layout": layout, "pass": conv_pass})
                v = select("auto", spec, NOMINAL_CUDA)[0]
                assert v.family == "depthwise", (spec.short(), v.name)
                prm = v.default(spec, NOMINAL_CUDA)
                epi = Epilogue(bias=True, silu=True) if conv_pass == "fprop" else Epilogue()
                cases.append((f"{v.name} [{prm.short()}] {spec.short()}",
                              v.plan(spec, prm, NOMINAL_CUDA, epi).source("cuda")))
    for (label, _), infos in zip(cases, ptxas_reports([src for _, src in cases], arch="sm_90a"), strict=True):
        assert infos
        for info in infos:
            assert info.spill_stores == 0 and info.spill_loads == 0, f"{label}: {info}"


def test_float32_new_forms_compile_clean(nvcc_ok) -> None:
    """float32 through NHWC tiles (dgrad, wgrad), strided dgrad by phase and the tiled form."""
    cases = itertools.product(REAL[1:5], [("nhwc", "dgrad"), ("nhwc", "wgrad"), ("nchw", "dgrad")])
    plans = []
    for i, (base, (layout, conv_pass)) in enumerate(cases):
        if i % 2:
            continue
        spec = ConvSpec.from_dict({**base.to_dict(), "layout": layout, "pass": conv_pass})
        v = select("auto", spec, NOMINAL_CUDA)[0]
        prm = v.default(spec, NOMINAL_CUDA)
        plans.append((f"{v.name} [{prm.short()}] {spec.short()}", v.plan(spec, prm, NOMINAL_CUDA).source("cuda")))
    for (label, _), infos in zip(plans, ptxas_reports([src for _, src in plans], arch="sm_90a"), strict=True):
        for info in infos:
            assert info.spill_stores == 0 and info.spill_loads == 0, f"{label}: {info}"
