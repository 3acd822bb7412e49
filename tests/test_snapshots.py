"""Generated-source snapshots: a generator change that alters code nobody meant to touch shows up here.

Regenerate deliberately with ``CONVFORGE_UPDATE_SNAPSHOTS=1 pytest tests/test_snapshots.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import NOMINAL_CUDA, NOMINAL_OPENCL_GPU
from convforge.kernels import all_variants
from convforge.spec import ConvSpec

SNAP = Path(__file__).parent / "snapshots"
SPECS = {"3x3": ConvSpec.make(2, 5, 11, 11, 6, 3, 3, 1, 1), "1x1": ConvSpec.make(2, 8, 7, 7, 6, 1, 1),
         "1x1deep": ConvSpec.make(1, 256, 2, 2, 16, 1, 1), "fc": ConvSpec.make(2, 40, 3, 3, 13, 3, 3),
         # grouped (3 groups of 2 -> 3 channels), grouped 1x1, depthwise with multiplier 2
         "grouped": ConvSpec.make(2, 6, 11, 11, 9, 3, 3, 1, 1, groups=3),
         "1x1g": ConvSpec.make(2, 8, 7, 7, 12, 1, 1, groups=4),
         "depthwise": ConvSpec.make(2, 8, 12, 12, 16, 3, 3, 1, 1, groups=8),
         "dwnhwc": ConvSpec.make(2, 8, 12, 12, 16, 3, 3, 1, 1, groups=8, layout="nhwc")}  # channels-last
PASS_ORDER = ("fprop", "dgrad", "wgrad")
# every pass a variant computes; a snapshot of another pass than fprop has the pass in its name
CASES = [(v.name, tag, be, cp) for v in all_variants() for tag in SPECS for be in sorted(v.backends)
         for cp in PASS_ORDER if cp in v.passes]


@pytest.mark.parametrize("name, tag, backend, conv_pass", CASES)
def test_generated_source_snapshot(name, tag, backend, conv_pass):
    variant = next(v for v in all_variants() if v.name == name)
    device = NOMINAL_CUDA if backend == "cuda" else NOMINAL_OPENCL_GPU
    spec = SPECS[tag].with_pass(conv_pass)
    if variant.applies(spec, device):
        pytest.skip(f"{name} does not apply to the {tag} snapshot spec")
    src = variant.plan(spec, variant.default(spec, device), device).source(backend)
    tag = tag if conv_pass == "fprop" else f"{tag}-{conv_pass}"
    path = SNAP / f"{name}.{tag}.{backend}.txt"
    if os.environ.get("CONVFORGE_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(src)
    assert path.exists(), f"no snapshot {path.name}: run with CONVFORGE_UPDATE_SNAPSHOTS=1 and review it"
    assert src == path.read_text(), f"generated source of {name} changed; review and update the snapshot"


@pytest.mark.parametrize("name", ["winograd_nonfused_f6", "winograd_nonfused_f7"])
@pytest.mark.parametrize("backend", ["cuda", "opencl"])
def test_full_filter_transform_snapshot(name, backend):
    """F(6x6)/F(7x7) default to split transforms (xi, xo) and, on the 3x3 snapshot spec's few
    tiles, half-transformed filters (hf=1); this pins the other paths: the full G g G^T filter
    transform, the plain GEMM and the thread-per-tile transforms with staged stores."""
    variant = next(v for v in all_variants() if v.name == name)
    device = NOMINAL_CUDA if backend == "cuda" else NOMINAL_OPENCL_GPU
    spec = SPECS["3x3"]
    prm = variant.default(spec, device)
    assert prm.get("hf") == prm.get("xi") == prm.get("xo") == prm.get("lo") == 1
    src = variant.plan(spec, prm.replace(hf=0, xi=0, xo=0, so=1, lo=0), device).source(backend)
    path = SNAP / f"{name}.3x3-hf0.{backend}.txt"
    if os.environ.get("CONVFORGE_UPDATE_SNAPSHOTS"):
        path.write_text(src)
    assert path.exists(), f"no snapshot {path.name}: run with CONVFORGE_UPDATE_SNAPSHOTS=1 and review it"
    assert src == path.read_text(), f"generated source of {name} (hf=0) changed; review and update"


@pytest.mark.parametrize("name, backend", [("dgrad_tc_strided_tf32", "cuda"), ("dgrad_tc_strided_half", "cuda"),
                                           ("dgrad_sub_gemm1x1", "cuda"), ("dgrad_sub_gemm1x1", "opencl"),
                                           ("dgrad_sub_gemm1x1_wgmma_tf32", "cuda")])
def test_strided_dgrad_snapshot(name, backend):
    """The snapshot specs are stride 1, which the strided dgrads leave to the transposed forward
    problem: a 3x3 stride-2 layer (four phases of 1, 2, 2 and 4 taps, interleaved) and a 1x1
    stride-2 one (one phase; dgrad_sub_*: the sub-grid GEMM and the interleave) pin their sources."""
    variant = next(v for v in all_variants() if v.name == name)
    dtype = "float16" if name.endswith("half") else "float32"
    bases = {"3x3s2": ConvSpec.make(2, 5, 11, 11, 6, 3, 3, 2, 1), "1x1s2": ConvSpec.make(2, 8, 7, 7, 6, 1, 1, 2)}
    device = NOMINAL_CUDA if backend == "cuda" else NOMINAL_OPENCL_GPU
    for tag, base in bases.items():
        spec = ConvSpec.from_dict({**base.to_dict(), "dtype": dtype, "pass": "dgrad"})
        if variant.applies(spec, device) is not None:
            continue
        src = variant.plan(spec, variant.default(spec, device), device).source(backend)
        path = SNAP / f"{name}.{tag}-dgrad.{backend}.txt"
        if os.environ.get("CONVFORGE_UPDATE_SNAPSHOTS"):
            path.write_text(src)
        assert path.exists(), f"no snapshot {path.name}: run with CONVFORGE_UPDATE_SNAPSHOTS=1 and review it"
        assert src == path.read_text(), f"generated source of {name} ({tag}) changed; review and update"


BN_CASES = {"bn-relu": dict(n=2, c=3, hw=36), "bn-res-relu": dict(n=2, c=3, hw=35, residual=True),
            "bn-alone": dict(n=2, c=3, hw=36, relu=False, affine=False, track=False),
            "bn-res-relu-split": dict(n=2, c=3, hw=36, residual=True)}  # each channel over 2 blocks


@pytest.mark.parametrize("tag", sorted(BN_CASES))
@pytest.mark.parametrize("backend", ["cuda", "opencl"])
def test_training_batch_norm_snapshot(tag, backend):
    """The training batch-norm kernels (kernels/batchnorm.py): one a pass (a block per channel) and
    three a pass (channels split over blocks), float4 and scalar loads, the residual's masked-gradient
    store, no affine / no running statistics."""
    from convforge.codegen.render import render
    from convforge.kernels.batchnorm import BnTrain, bn_program

    device = NOMINAL_CUDA if backend == "cuda" else NOMINAL_OPENCL_GPU
    prog = bn_program(BnTrain(**BN_CASES[tag]), device, 2 if tag.endswith("split") else None)
    src = render(list(prog.kernels), backend, f"batch norm (training) {tag}")
    path = SNAP / f"batchnorm_train.{tag}.{backend}.txt"
    if os.environ.get("CONVFORGE_UPDATE_SNAPSHOTS"):
        path.write_text(src)
    assert path.exists(), f"no snapshot {path.name}: run with CONVFORGE_UPDATE_SNAPSHOTS=1 and review it"
    assert src == path.read_text(), "generated batch-norm source changed; review and update the snapshot"


BIAS_CASES = {"bias": ((2, 3, 6, 6), False), "bias-relu": ((2, 3, 6, 6), True), "bias-relu-odd": ((2, 3, 5, 7), True)}


@pytest.mark.parametrize("tag", sorted(BIAS_CASES))
@pytest.mark.parametrize("backend", ["cuda", "opencl"])
def test_bias_gradient_snapshot(tag, backend):
    """The bias-gradient kernels (kernels/wgrad/bias.py): the plain sum and the ReLU-masked one that
    writes the masked gradient (float4 and scalar loads), each channel over two slices."""
    from convforge.kernels.wgrad import bias_grad_plan
    from convforge.params import Params

    (n, k, p, q), relu = BIAS_CASES[tag]
    device = NOMINAL_CUDA if backend == "cuda" else NOMINAL_OPENCL_GPU
    plan = bias_grad_plan(ConvSpec.make(n, 1, p, q, k, 1, 1, conv_pass="wgrad"), device, Params(bt=64, sp=2),
                          relu=relu)
    src = plan.source(backend)
    path = SNAP / f"bias_grad.{tag}.{backend}.txt"
    if os.environ.get("CONVFORGE_UPDATE_SNAPSHOTS"):
        path.write_text(src)
    assert path.exists(), f"no snapshot {path.name}: run with CONVFORGE_UPDATE_SNAPSHOTS=1 and review it"
    assert src == path.read_text(), "generated bias-gradient source changed; review and update the snapshot"


ROWS_CASES = {"tf32": ("cuda", "tf32"), "3xtf32": ("cuda", "3xtf32"), "float": ("opencl", None)}


@pytest.mark.parametrize("tag", sorted(ROWS_CASES))
def test_gradient_rows_snapshot(tag):
    """The masked gradient written in the backward GEMMs' layouts (kernels/tensorcore/gradrows.py): an odd
    layer (N 3, K 5, P Q 37) into xh of 8 channels and dy' of 4 images, TF32 / 3xTF32 on CUDA, plain floats
    (the layouts PoCL tests) on OpenCL."""
    from convforge.codegen.render import render
    from convforge.kernels.tensorcore.gradrows import Rows, masked_rows
    from convforge.kernels.tensorcore.isa import MATHS

    backend, math = ROWS_CASES[tag]
    m = MATHS[math] if math else None
    kernels, _, _ = masked_rows(3, 5, 37, Rows("fwd_xh", m, 8), Rows("dyt", m, 4))
    src = render(list(kernels), backend, f"grad rows {tag}")
    path = SNAP / f"grad_rows.{tag}.{backend}.txt"
    if os.environ.get("CONVFORGE_UPDATE_SNAPSHOTS"):
        path.write_text(src)
    assert path.exists(), f"no snapshot {path.name}: run with CONVFORGE_UPDATE_SNAPSHOTS=1 and review it"
    assert src == path.read_text(), "generated gradient-rows source changed; review and update the snapshot"


STEM_SNAPS = {"tc_stem_direct_half": ("stem7x7s2-nhwc", "N=2,C=3,H=23,W=21,K=16,R=7,S=7,stride=2,pad=3,dtype=fp16,"
                                                        "layout=nhwc"),
              "tc_stem_direct_tf32": ("stem3x3", "N=2,C=3,H=11,W=11,K=8,R=3,S=3,pad=1")}


@pytest.mark.parametrize("name", sorted(STEM_SNAPS))
def test_stem_snapshot(name):
    """The direct stems (kernels/tensorcore/stem.py) apply to no shared snapshot spec (3-channel
    layers): a 7x7/2 half stem in NHWC with bias and ReLU, and a 3x3 TF32 one in NCHW."""
    from convforge.plan import Epilogue

    variant = next(v for v in all_variants() if v.name == name)
    tag, text = STEM_SNAPS[name]
    spec = ConvSpec.parse(text)
    src = variant.plan(spec, variant.default(spec, NOMINAL_CUDA), NOMINAL_CUDA,
                       Epilogue(bias=True, relu=True)).source("cuda")
    path = SNAP / f"{name}.{tag}.cuda.txt"
    if os.environ.get("CONVFORGE_UPDATE_SNAPSHOTS"):
        path.write_text(src)
    assert path.exists(), f"no snapshot {path.name}: run with CONVFORGE_UPDATE_SNAPSHOTS=1 and review it"
    assert src == path.read_text(), f"generated source of {name} changed; review and update the snapshot"
