"""The float64 reference of every pass and of grouped layers, checked by identities that do not
use it: grouped fprop equals one ungrouped conv per group, and dgrad and wgrad are the adjoints of
fprop (<conv(x, w), dy> = <x, dgrad(dy, w)> = <w, wgrad(x, dy)>), on odd shapes."""

from __future__ import annotations

import numpy as np
import pytest

from convforge.reference import bias_grad_ref, conv2d_ref, dgrad_ref, wgrad_ref
from convforge.spec import ConvSpec

SPECS = [
    ConvSpec.make(1, 3, 13, 13, 5, 3, 3, padding=1),
    ConvSpec.make(2, 6, 11, 9, 4, 3, 2, stride=(2, 3), padding=(1, 0, 2, 1), dilation=(1, 2), groups=2),
    ConvSpec.make(1, 3, 27, 29, 4, 11, 11, stride=4, padding=(2, 1, 0, 3)),
    ConvSpec.make(3, 5, 17, 19, 5, 5, 5, padding=2, dilation=2, groups=5),
    ConvSpec.make(2, 7, 9, 9, 3, 1, 1),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_dgrad_and_wgrad_are_adjoints_of_fprop(spec):
    rng = np.random.default_rng(1)
    x, w, dy = (rng.standard_normal(spec.shape_of(b)) for b in ("x", "w", "y"))
    y = conv2d_ref(x, w, spec)
    inner = float((y * dy).sum())
    assert float((x * dgrad_ref(dy, w, spec)).sum()) == pytest.approx(inner, rel=1e-10)
    assert float((w * wgrad_ref(x, dy, spec)).sum()) == pytest.approx(inner, rel=1e-10)
    assert np.allclose(bias_grad_ref(dy), dy.sum(axis=(0, 2, 3)))


def test_grouped_fprop_is_one_conv_per_group():
    spec = ConvSpec.make(2, 6, 10, 7, 9, 3, 2, stride=(1, 2), padding=(1, 1, 0, 1), groups=3)
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal(spec.x_shape), rng.standard_normal(spec.w_shape)
    got = conv2d_ref(x, w, spec)
    one = ConvSpec.make(2, 2, 10, 7, 3, 3, 2, stride=(1, 2), padding=(1, 1, 0, 1))
    for g in range(3):
        part = conv2d_ref(x[:, 2 * g:2 * g + 2], w[3 * g:3 * g + 3], one)
        assert np.allclose(got[:, 3 * g:3 * g + 3], part)


def test_reference_refuses_wrong_shapes():
    spec = SPECS[0]
    with pytest.raises(ValueError, match=r"reference: y has shape"):
        dgrad_ref(np.zeros((1, 5, 12, 13)), np.zeros(spec.w_shape), spec)
