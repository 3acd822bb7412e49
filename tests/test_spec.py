"""ConvSpec validation, shapes and FLOPs; named arrays."""

from __future__ import annotations

import numpy as np
import pytest

from convforge.arrays import ArrayDesc
from convforge.reference import conv2d_ref
from convforge.spec import ConvSpec


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), r"N \(0\) must be a positive int"),
    (dict(c=-3), r"C \(-3\) must be a positive int"),
    (dict(k=0), r"K \(0\) must be a positive int"),
    (dict(padding=-1), r"padding \(-1\) must be >= 0"),
    (dict(padding=(0, 1, -2, 0)), r"padding \(-2\) must be >= 0"),
    (dict(stride=0), r"stride \(\(0, 0\)\) must be positive"),
    (dict(dilation=(1, 0)), r"dilation \(\(1, 0\)\) must be positive"),
    (dict(r=9), r"dilated kernel \(9x3\) is larger than the padded input \(7x7\)"),
    (dict(dilation=4), r"dilated kernel \(9x9\) is larger than the padded input \(7x7\)"),
    (dict(padding=(1, 2, 3)), r"padding .* must be an int, \(h, w\) or"),
    # bools (True would be pasted into the kernel source), floats and None are refused by name
    (dict(padding=True), r"padding \(True\) must be an int, \(h, w\) or .* not a bool"),
    (dict(padding=(True, 0)), r"padding \(\(True, 0\)\) must be .* not a bool"),
    (dict(stride=(True, 2)), r"stride \(\(True, 2\)\) must be an int or a pair of ints, not a bool"),
    (dict(dilation=False), r"dilation \(False\) must be an int or a pair of ints, not a bool"),
    (dict(stride=1.5), r"stride \(1.5\) must be an int or a pair of ints"),
    (dict(stride=None), r"stride \(None\) must be an int or a pair of ints"),
    (dict(padding=1.0), r"padding \(1.0\) must be an int, \(h, w\) or"),
    (dict(padding=None), r"padding \(None\) must be an int, \(h, w\) or"),
    (dict(padding=(1, 2.0)), r"padding \(\(1, 2.0\)\) must be"),
    (dict(dilation="2"), r"dilation \('2'\) must be an int or a pair of ints"),
])
def test_bad_spec_names_field_and_value(kwargs, message):
    base = dict(n=1, c=2, h=7, w=7, k=3, r=3, s=3, stride=1, padding=0, dilation=1)
    base.update(kwargs)
    with pytest.raises(ValueError, match=message):
        ConvSpec.make(**base)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"input must have rank 4"):
        ConvSpec.from_shapes((1, 3, 8), (4, 3, 3, 3))
    with pytest.raises(ValueError, match=r"channel mismatch: input has C=3, weights have C=2"):
        ConvSpec.from_shapes((1, 3, 8, 8), (4, 2, 3, 3))
    with pytest.raises(ValueError, match=r"dtype \('float64'\) must be one of float32, float16, bfloat16"):
        ConvSpec(1, 1, 4, 4, 1, 1, 1, dtype="float64")
    with pytest.raises(ValueError, match=r"channel mismatch: input has C=8, weights have C=2, expected 4"):
        ConvSpec.from_shapes((1, 8, 8, 8), (4, 2, 3, 3), groups=2)
    with pytest.raises(ValueError, match=r"groups \(3\) must divide C \(8\)"):
        ConvSpec.from_shapes((1, 8, 8, 8), (3, 2, 3, 3), groups=3)
    with pytest.raises(ValueError, match=r"groups \(2\) must divide both C \(4\) and K \(3\)"):
        ConvSpec.make(1, 4, 8, 8, 3, 3, 3, groups=2)
    with pytest.raises(ValueError, match=r"groups \(0\) must be a positive int"):
        ConvSpec.make(1, 4, 8, 8, 4, 3, 3, groups=0)
    with pytest.raises(ValueError, match=r"pass \('backward'\) must be one of fprop, dgrad, wgrad"):
        ConvSpec.make(1, 4, 8, 8, 4, 3, 3, conv_pass="backward")


def test_groups_dtype_and_pass_in_shapes_keys_and_text():
    """Grouped filters hold C/groups channels; FLOPs count them; keys, dicts and the parsed text
    carry groups, dtype and pass, and a plain forward float32 key is what it always was."""
    plain = ConvSpec.make(2, 8, 13, 13, 8, 3, 3, padding=1)
    assert plain.key() == "n2c8h13w13k8r3s3_st1x1_pd1.1.1.1_dl1x1_float32"
    g = ConvSpec.make(2, 8, 13, 13, 16, 3, 3, padding=1, groups=4, dtype="fp16", conv_pass="bprop")
    assert (g.w_shape, g.cg, g.kg, g.conv_pass, g.output, g.itemsize) == ((16, 2, 3, 3), 2, 4, "dgrad", "x", 2)
    assert g.flops == 2 * 2 * 16 * 13 * 13 * 2 * 9
    assert g.key().endswith("_float16_g4_dgrad") and g.key() != g.with_pass("wgrad").key()
    assert ConvSpec.from_dict(g.to_dict()) == g
    assert ConvSpec.parse("N=2,C=8,H=13,W=13,K=16,R=3,S=3,pad=1,groups=4,dtype=fp16,pass=dgrad") == g
    assert ConvSpec.make(1, 6, 9, 9, 6, 3, 3, groups=6).depthwise
    assert "g4" in g.short() and "float16" in g.short() and "dgrad" in g.short()


@pytest.mark.parametrize("h, r, stride, pad, dil", [
    (13, 3, 1, (1, 1), 1), (13, 3, 2, (0, 1), 1), (227, 11, 4, (0, 0), 1), (17, 5, 1, (2, 2), 2),
    (8, 1, 3, (0, 0), 1),
])
def test_output_size_matches_reference(h, r, stride, pad, dil):
    spec = ConvSpec.make(1, 1, h, h + 2, 1, r, r, stride, (pad[0], pad[1], pad[1], pad[0]), dil)
    x = np.ones(spec.x_shape, np.float32)
    w = np.ones(spec.w_shape, np.float32)
    assert conv2d_ref(x, w, spec).shape == spec.y_shape
    expected_p = (h + pad[0] + pad[1] - dil * (r - 1) - 1) // stride + 1
    assert spec.p == expected_p


def test_flops_and_keys():
    spec = ConvSpec.make(32, 64, 56, 56, 64, 3, 3, 1, 1)
    assert spec.flops == 2 * 32 * 64 * 56 * 56 * 64 * 9
    assert ConvSpec.parse("N=32,C=64,H=56,W=56,K=64,R=3,S=3,stride=1,pad=1") == spec
    assert ConvSpec.from_dict(spec.to_dict()) == spec
    assert ConvSpec.parse("N=1,C=1,H=5,W=5,K=1,R=3,S=3,pad=0x1x1x0").pad == (0, 1, 1, 0)
    with pytest.raises(ValueError, match="lacks"):
        ConvSpec.parse("N=1,C=1")


def test_reference_against_direct_loops():
    rng = np.random.default_rng(1)
    spec = ConvSpec.make(2, 3, 7, 6, 2, 3, 2, (2, 1), (1, 0, 2, 1), (1, 2))
    x = rng.standard_normal(spec.x_shape)
    w = rng.standard_normal(spec.w_shape)
    out = conv2d_ref(x, w, spec)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 0), (2, 1)))
    for n, k, p, q in [(0, 0, 0, 0), (1, 1, spec.p - 1, spec.q - 1), (1, 0, 1, 2)]:
        acc = 0.0
        for c in range(3):
            for r in range(3):
                for s in range(2):
                    acc += xp[n, c, p * 2 + r, q + 2 * s] * w[k, c, r, s]
        assert out[n, k, p, q] == pytest.approx(acc)


def test_named_arrays_refuse_wrong_binding():
    x = ArrayDesc.of("x", "n:c:y:x", (2, 3, 5, 7))
    assert x.stride("c") == 35 and x.nbytes == 4 * 210
    assert x.index(n="n", c="c", y="iy", x="ix") == "(n)*105 + (c)*35 + (iy)*7 + (ix)"
    x.check("n:c:y:x", (2, 3, 5, 7), (105, 35, 7, 1))
    with pytest.raises(ValueError, match=r"expected dimensions n:c:y:x, got k:c:r:s"):
        x.check("k:c:r:s", (2, 3, 5, 7))
    with pytest.raises(ValueError, match=r"expected shape \(2, 3, 5, 7\)"):
        x.check("n:c:y:x", (2, 3, 5, 8))
    with pytest.raises(ValueError, match="contiguous"):
        x.check("n:c:y:x", (2, 3, 5, 7), (105, 1, 21, 3))
    with pytest.raises(KeyError, match="no dimension"):
        x.index(k="k")
    rt = ArrayDesc.of("w", "k:c:r:s", (4, 3, 3, 3), runtime=True)
    assert rt.index(k="k", s=1) == "(k)*w_stride_k + (1)*w_stride_s"
    assert rt.stride_args()[0] == ("w_stride_k", 27)


def test_bools_refused_by_the_constructor_too():
    with pytest.raises(ValueError, match=r"stride \(\(True, 1\)\) must be a pair of ints"):
        ConvSpec(1, 2, 7, 7, 3, 3, 3, (True, 1))
    with pytest.raises(ValueError, match=r"padding \(\(0, 0, 0, True\)\) must hold ints"):
        ConvSpec(1, 2, 7, 7, 3, 3, 3, (1, 1), (0, 0, 0, True))


def test_numpy_integers_accepted_as_python_ints():
    spec = ConvSpec.make(1, 2, 9, 9, 3, 3, 3, stride=np.int64(2), padding=np.int32(1),
                         dilation=(np.int64(1), 1))
    assert spec == ConvSpec.make(1, 2, 9, 9, 3, 3, 3, stride=2, padding=1)
    assert all(type(v) is int for v in spec.stride + spec.pad + spec.dilation)
    assert ConvSpec.make(1, 2, 9, 9, 3, 3, 3, padding=np.array([1, 2])).pad == (1, 1, 2, 2)
