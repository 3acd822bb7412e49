"""GPU tier of ``bench --model --first-call --train --amp``: the child's measurement in this process
(``first_call.measure``) times a fused ResNet-18's first and second AMP training steps and PyTorch
AMP's first step, each a positive number of seconds, the second step far below the first (nothing
left to compile)."""

from __future__ import annotations

import pytest

from convforge.apps.bench import first_call


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_first_amp_step_is_timed(gpu, amp: str) -> None:  # type: ignore[no-untyped-def]
    got = first_call.measure("resnet18", 4, f"train-{amp}", "nhwc")
    for key in ("fuse_s", "first_s", "second_s", "pytorch_first_s", "import_s"):
        assert isinstance(got[key], float) and got[key] > 0, (key, got)
    assert got["second_s"] < got["first_s"], got
