"""Issue 34, case 4: index width is a property of every plan. Each variant either refuses a layer
whose arrays its 32-bit offsets cannot address ("needs 64-bit indexing: ...") or plans it with
64-bit offsets (``Plan.index_bits``); sizes no kernel can hold are refused by ConvSpec itself.
The GPU proof (a layer past 2^31 elements run and checked) is tests/test_gpu_index_width.py."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from conftest import NOMINAL_CUDA, NOMINAL_OPENCL_GPU
from convforge.kernels import all_variants, get_variant
from convforge.plan import DeviceInfo, Plan, Variant
from convforge.spec import ConvSpec
from helpers import run_main

INT32_MAX = 2**31 - 1  # the largest offset of 32-bit index arithmetic
NOMINAL_CPU = DeviceInfo("opencl", "nominal OpenCL CPU", units=16, is_gpu=False)
DEVICES = (NOMINAL_CUDA, NOMINAL_OPENCL_GPU, NOMINAL_CPU)

# Layers with some array past 2^31 - 1 elements, shaped so that each family would otherwise take one.
BIG = {
    "x 3x3 (issue 34)": ConvSpec.make(64, 256, 512, 512, 64, 3, 3, 1, 1),  # x: 4.3e9, auto picked direct_smem
    "y 3x3": ConvSpec.make(32, 8, 512, 512, 320, 3, 3, 1, 1),  # x: 6.7e7, y: 2.7e9
    "x 1x1": ConvSpec.make(64, 256, 512, 512, 64, 1, 1),
    "y 1x1": ConvSpec.make(32, 8, 512, 512, 320, 1, 1),
    "fc": ConvSpec.make(20000, 512, 16, 16, 64, 16, 16),  # x: 2.6e9, a filter covering the input
    "filter": ConvSpec.make(1, 65536, 6, 6, 4096, 3, 3),  # w: 2.4e9
    "fc filter": ConvSpec.make(2, 65536, 6, 6, 1024, 6, 6),  # w: 2.4e9, two images: the weight stream
    "im2col / Winograd workspace": ConvSpec.make(16, 512, 256, 256, 64, 3, 3, 1, 1),  # x: 5.4e8
    "split-K partials": ConvSpec.make(32, 32, 512, 512, 160, 3, 3, 1, 1),  # y: 1.3e9, 2 slices: 2.7e9
    "split-K partials 1x1": ConvSpec.make(32, 32, 512, 512, 160, 1, 1),
    "NHWC copy": ConvSpec.make(2100, 3, 512, 512, 2, 3, 3, 1, 1),  # x: 1.65e9, C padded to 4: 2.2e9
    "stem fold": ConvSpec.make(1100, 3, 512, 512, 64, 7, 7, 2, 3),  # x: 8.7e8; folded [N][H][Q][24]: 3.5e9
}


def _elements(plan: Plan) -> dict[str, int]:
    """Every array a plan indexes: x, w, y and its workspaces."""
    s = plan.spec
    out = {"x": s.n * s.c * s.h * s.w, "w": s.k * s.cg * s.r * s.s, "y": s.n * s.k * s.p * s.q}
    out.update({name: nbytes // s.itemsize for name, nbytes in plan.workspace})
    return out


def _served(v: Variant, spec: ConvSpec) -> ConvSpec:
    """``spec`` in a pass, dtype and layout ``v`` computes (float32 and NCHW where it can), depthwise for
    the depthwise family: each variant meets the big layers in a form it would otherwise take."""
    dtype = "float32" if "float32" in v.dtypes else sorted(v.dtypes)[0]
    layout = "nchw" if "nchw" in v.layouts else sorted(v.layouts)[0]
    spec = dataclasses.replace(spec, conv_pass=sorted(v.passes)[0], dtype=dtype, layout=layout)
    if v.family == "depthwise":
        spec = dataclasses.replace(spec, k=spec.c, groups=spec.c)
    elif ("tc_grouped" in v.name or v.name == "wgrad_grouped") and spec.c % 2 == 0 and spec.k % 2 == 0:
        spec = dataclasses.replace(spec, groups=2)  # grouped layers only
    elif v.name == "wgrad_grouped_mma" and spec.c % 8 == 0:
        spec = dataclasses.replace(spec, k=spec.c, groups=spec.c // 8)  # groups of 8 channels in and out only
    elif v.name.startswith("dgrad_tc_strided_grouped") and spec.c % 2 == 0 and spec.k % 2 == 0:
        spec = dataclasses.replace(spec, groups=2, stride=(2, 2))  # strided grouped layers only
    return spec


def _outcome(v: Variant, spec: ConvSpec, dev: DeviceInfo) -> str:
    """'refused: why' or 'planned 32|64'; a planned layer's arrays must fit its index width, and a
    64-bit plan's source must compute its offsets in 64 bits."""
    spec = _served(v, spec)
    why = v.applies(spec, dev)
    if why:
        return f"refused: {why}"
    plan = v.plan(spec, v.default(spec, dev), dev)
    limit = INT32_MAX if plan.index_bits == 32 else 2**63 - 1
    too_big = {k: n for k, n in _elements(plan).items() if n > limit}
    assert not too_big, f"{v.name} on {dev.name}: {plan.index_bits}-bit plan for arrays {too_big}"
    assert plan.index_bits <= v.index_bits, v.name
    if plan.index_bits == 64:
        src = plan.source(dev.backend)
        assert ("(long long)" if dev.backend == "cuda" else "(long)") in src, v.name
    return f"planned {plan.index_bits}"


@pytest.mark.parametrize("v", all_variants(), ids=lambda v: v.name)
def test_every_variant_refuses_or_indexes_in_64_bits(v: Variant) -> None:
    outcomes = {(name, dev.name): _outcome(v, spec, dev) for name, spec in BIG.items() for dev in DEVICES
                if dev.backend in v.backends}
    # Each variant meets at least one layer it would otherwise take: proof that its width is checked.
    assert any("64-bit" in o or o == "planned 64" for o in outcomes.values()), outcomes
    for key, o in outcomes.items():
        if o.startswith("refused") and "64-bit" in o:
            assert "needs 64-bit" in o and "elements" in o or "coordinates" in o, (key, o)
    assert v.max_offset() == (INT32_MAX if v.index_bits == 32 else 2**63 - 1)


def test_direct_plans_the_issue_layer_in_64_bits() -> None:
    spec = BIG["x 3x3 (issue 34)"]
    for name in ("direct", "direct_smem", "direct_shfl"):
        v = get_variant(name)
        for dev in (NOMINAL_CUDA, NOMINAL_OPENCL_GPU):
            if dev.backend not in v.backends:
                continue
            plan = v.plan(spec, v.default(spec, dev), dev)
            src = plan.source(dev.backend)
            assert plan.index_bits == 64, name
            assert re.search(r"x \+ \(\(long( long)?\)\(n\)\)\*67108864", src), name
            assert not re.search(r"\bn \* 67108864", src) and "(n)*67108864" not in src, name


def test_direct_32_bit_plans_are_unchanged_below_the_limit() -> None:
    spec = ConvSpec.make(31, 256, 512, 512, 64, 3, 3, 1, 1)  # x: 2.08e9 elements, just below
    for name in ("direct", "direct_smem"):
        v = get_variant(name)
        plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
        assert plan.index_bits == 32 and "long" not in plan.source("cuda")


def test_direct_64_bit_source_compiles_clean(nvcc_ok) -> None:
    from helpers import assert_sources_compile_clean

    cases = [(name, BIG["x 3x3 (issue 34)"]) for name in ("direct", "direct_smem", "direct_shfl")]
    cases.append(("direct", BIG["y 3x3"]))
    assert_sources_compile_clean([(f"{name} {spec.short()}",  # one nvcc run
                                   (v := get_variant(name)).plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
                                   .source("cuda")) for name, spec in cases])


@pytest.mark.parametrize("name", ["direct", "direct_smem"])
def test_64_bit_code_path_computes_right_on_pocl(ocl, monkeypatch, name: str) -> None:
    """The 64-bit offsets, forced on a small layer by lowering the limit, give the reference's answer."""
    import convforge.arrays
    import convforge.kernels.direct
    from convforge.check import check_plan
    from convforge.plan import Epilogue

    monkeypatch.setattr(convforge.arrays, "INT32_MAX", 1000)
    monkeypatch.setattr(convforge.kernels.direct, "INT32_MAX", 100)
    spec = ConvSpec.make(3, 5, 17, 19, 7, 3, 3, 1, (1, 0, 2, 1))
    v = get_variant(name)
    for epi in (Epilogue(), Epilogue(bias=True, relu=True)):
        plan = v.plan(spec, v.default(spec, ocl.device), ocl.device, epi)
        src = plan.source("opencl")
        assert plan.index_bits == 64 and "(long)(n)" in src and "(long)kw0" in src
        res = check_plan(plan, ocl, seed=3)
        assert res.ok, res


@pytest.mark.parametrize("field, value", [("H", 10**20), ("N", 2**31), ("W", 2**40), ("C", 10**12)])
def test_absurd_sizes_are_refused_by_the_spec(field: str, value: int) -> None:
    dims = dict(N=1, C=3, H=13, W=13, K=8, R=3, S=3)
    dims[field] = value
    with pytest.raises(ValueError, match=rf"{field} \({value}\) must be at most 2\^31 - 1"):
        ConvSpec.make(*dims.values())
    with pytest.raises(ValueError, match="must be at most 2"):
        ConvSpec.make(1, 3, 13, 13, 8, 3, 3, 1, 2**31)
    with pytest.raises(ValueError, match="at most 2\\^62 elements"):
        ConvSpec.make(2**30, 2**30, 2**20, 1, 1, 1, 1)


def test_absurd_sizes_on_the_command_line(capsys) -> None:  # type: ignore[no-untyped-def]
    spec = "N=1,C=3,H=100000000000000000000,W=13,K=8,R=3,S=3,pad=1"
    for argv in (["algos", "--spec", spec], ["show", "--spec", spec, "--variant", "direct"]):
        rc, out = run_main(argv, capsys)
        assert rc == 2 and out.count("error:") == 1 and "must be at most 2^31 - 1" in out, out
        assert "99999999999999999999" not in out and "applicable" not in out


def test_algos_lists_the_big_layer_honestly(capsys) -> None:  # type: ignore[no-untyped-def]
    rc, out = run_main(["algos", "--spec", "N=64,C=256,H=512,W=512,K=64,R=3,S=3,pad=1", "--backend", "cuda"], capsys)
    assert rc == 0, out
    plus = [line.split()[1] for line in out.splitlines() if line.strip().startswith("+")]
    assert set(plus) == {"direct", "direct_smem", "direct_shfl"}, out
    assert out.count("needs 64-bit indexing") >= 10


def test_index_arithmetic_widens_only_where_needed() -> None:
    from convforge.arrays import ArrayDesc

    small = ArrayDesc.of("x", "n:c:y:x", (2, 3, 4, 5))
    assert small.index(n="n", c="c", y="iy", x="ix") == "(n)*60 + (c)*20 + (iy)*5 + (ix)"
    big = ArrayDesc.of("x", "n:c:y:x", (64, 256, 512, 512))
    assert big.wide and not small.wide
    assert big.index(n="n", c="c", y="iy", x="ix") == "((I64)(n))*67108864 + (c)*262144 + (iy)*512 + (ix)"
    assert big.index(c="c", y="iy") == "(c)*262144 + (iy)*512"  # within one image: 32 bits
    huge_image = ArrayDesc.of("x", "n:c:y:x", (2, 40000, 300, 300))  # one image: 3.6e9 elements
    assert huge_image.index(c="c", y="iy") == "((I64)(c))*90000 + (iy)*300"
    assert huge_image.index(n=1) == "(I64)3600000000"
    rt = ArrayDesc.of("x", "n:c:y:x", (64, 256, 512, 512), runtime=True)
    assert rt.index(n="n", x="ix") == "((I64)(n))*x_stride_n + (ix)*x_stride_x"


def test_reference_agrees_on_a_64_bit_spec_slice() -> None:
    """conv2d_ref takes the big spec's images one at a time (what the GPU test does)."""
    from convforge.reference import conv2d_ref

    spec = BIG["x 3x3 (issue 34)"]
    one = ConvSpec.make(1, 2, 9, 9, 3, 3, 3, 1, 1)
    x = np.ones(one.x_shape, np.float32)
    w = np.ones(one.w_shape, np.float32)
    assert conv2d_ref(x, w, one)[0, 0, 4, 4] == 18.0 and spec.n == 64


def test_network_ops_refuse_tensors_past_32_bits(ocl) -> None:
    """Non-conv op kernels index in 32 bits: a ReLU over 2.5e9 elements is refused before any
    buffer is allocated (the conv before it could run in 64 bits)."""
    from convforge.graph.ir import Graph, Node
    from convforge.graph.runtime import Network

    graph = Graph("big", "x", (1, 1, 50000, 50000), [Node("r", "relu", ["x"], "y")], ["y"])
    with pytest.raises(ValueError, match=r"node 'r' \(relu\): needs 64-bit indexing: tensor x\[n=1 c=1 "):
        Network(graph, ocl)


def test_every_default_grid_fits_cuda():
    """Every variant's default plan on a fully-connected layer of 4100 inputs at N=20 (N*C = 82000)
    and on a big-plane layer, in each pass, launches grids within CUDA's limits (x < 2^31, y and
    z <= 65535): dgrad_direct put N*C in z and failed with CUDA_ERROR_INVALID_VALUE."""
    specs = [ConvSpec.make(20, 4100, 1, 1, 37, 1, 1), ConvSpec.make(300, 240, 5, 5, 7, 3, 3, 1, 1)]
    seen = 0
    for base in specs:
        for conv_pass in ("fprop", "dgrad", "wgrad"):
            spec = base.with_pass(conv_pass)
            for v in all_variants():
                if v.applies(spec, NOMINAL_CUDA) is not None:
                    continue
                plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
                for step in plan.steps:
                    grid = getattr(step, "grid", None)
                    if grid is None:
                        continue
                    seen += 1
                    assert grid[0] < 2**31 and grid[1] <= 65535 and grid[2] <= 65535, (v.name, conv_pass, grid)
    assert seen > 50
