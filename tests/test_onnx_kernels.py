"""Kernels the ONNX ops brought: the SiLU and HardSwish conv epilogues on every OpenCL variant that
plans fprop (against the float64 reference, output poisoned first), and every new graph-op kernel
compiled for CUDA by nvcc (sm_90a, ptxas -v: no spills); the GPU tier runs the epilogues on every
CUDA variant."""

from __future__ import annotations

import math

import numpy as np
import pytest

from convforge.check import check_plan, hardswish_ref, silu_ref
from convforge.kernels import all_variants
from convforge.plan import Epilogue
from convforge.spec import ConvSpec

SPEC = ConvSpec.make(2, 5, 9, 11, 7, 3, 3, 1, (1, 0, 0, 1))
FC = ConvSpec.make(2, 37, 1, 1, 13, 1, 1)  # a fully connected layer (MobileNet-v3's classifier: linear -> HardSwish)
DW = ConvSpec.make(2, 12, 9, 11, 12, 3, 3, 2, 1, groups=12)  # EfficientNet's depthwise conv -> BN -> SiLU
CASES = [(SPEC, Epilogue(bias=True, silu=True)), (SPEC, Epilogue(residual=True, hardswish=True)),
         (FC, Epilogue(bias=True, hardswish=True)), (DW, Epilogue(bias=True, silu=True))]
IDS = ["bias_silu", "res_hardswish", "fc_bias_hardswish", "depthwise_bias_silu"]


def test_activation_references() -> None:
    """SiLU: 0 at 0, x sigmoid(x); HardSwish: 0 below -3, x above 3, x (x + 3) / 6 between; NaN kept."""
    x = np.array([0.0, 1.0, -2.0, 40.0, -800.0, 4.0, -4.0, np.nan])
    s = silu_ref(x)
    np.testing.assert_allclose(s[:5], [0.0, 1 / (1 + math.exp(-1)), -2 / (1 + math.exp(2)), 40.0, -0.0], atol=1e-12)
    h = hardswish_ref(x)
    np.testing.assert_allclose(h[:7], [0.0, 4 / 6, -2 / 6, 40.0, 0.0, 4.0, 0.0], atol=1e-12)
    assert math.isnan(s[7]) and math.isnan(h[7])


def test_epilogue_names_and_one_activation() -> None:
    assert Epilogue(bias=True, silu=True).tag() == "_bias_silu" and Epilogue(hardswish=True).act == "hardswish"
    assert Epilogue(residual=True, silu=True).plain() == Epilogue(silu=True)
    with pytest.raises(ValueError, match="SiLU and HardSwish together"):
        Epilogue(silu=True, hardswish=True)


def test_mish_epilogue_on_opencl_variants(ocl) -> None:
    """Mish (x tanh(softplus(x))) after bias and after a residual, on the OpenCL variants of a 3x3 layer
    (every other one, in turns), against the float64 reference; its reference: 0 at 0, x for large x."""
    from convforge.check import mish_ref

    assert mish_ref(np.array([0.0]))[0] == 0.0 and mish_ref(np.array([40.0]))[0] == 40.0
    assert np.isnan(mish_ref(np.array([np.nan]))[0]) and abs(mish_ref(np.array([1.0]))[0] - 0.8650983882673103) < 1e-12
    spec, ran = ConvSpec.make(2, 5, 11, 11, 6, 3, 3, 1, 1), []
    for k, v in enumerate(all_variants()):
        epi = Epilogue(bias=k % 2 == 0, residual=k % 2 == 1 and v.residual_ok, mish=True)
        if v.applies(spec, ocl.device) or k % 3:
            continue
        try:
            plan = v.plan(spec, v.default(spec, ocl.device), ocl.device, epi)
        except ValueError as err:
            assert "unsupported epilogue" in str(err), f"{v.name}: {err}"
            continue
        assert "cf_mish" in plan.source("opencl")
        res = check_plan(plan, ocl, seed=5)
        assert res.ok, f"{v.name}: {res}"
        ran.append(v.name)
    assert len(ran) >= 2, ran


@pytest.mark.parametrize("spec, epi", CASES, ids=IDS)
def test_epilogue_on_every_opencl_variant(ocl, spec: ConvSpec, epi: Epilogue) -> None:
    """bias / residual then the activation, on each variant that plans the layer. On the 3x3 layer
    (test_gelu's) the variants take bias + SiLU and residual + HardSwish in turns by their order: the
    activation is a token in a store path, so each variant runs one of the two, each on half of them,
    and test_gelu runs each with GELU after the other of bias and residual; every plan is checked to
    apply its activation."""
    ran = []
    turn = {"bias_silu": 0, "res_hardswish": 1}.get(IDS[CASES.index((spec, epi))])
    for k, v in enumerate(all_variants()):
        if v.applies(spec, ocl.device) or (epi.residual and not v.residual_ok):
            continue
        try:
            plan = v.plan(spec, v.default(spec, ocl.device), ocl.device, epi)
        except ValueError as err:  # a variant without a store path for this epilogue says so
            assert "unsupported epilogue" in str(err), f"{v.name}: {err}"
            continue
        assert f"cf_{'silu' if epi.silu else 'hswish'}" in plan.source("opencl")
        if turn is not None and k % 2 != turn:
            continue
        res = check_plan(plan, ocl, seed=3)
        assert res.ok, f"{v.name}: {res}"
        ran.append(v.name)
    assert len(ran) >= 3, ran


def _cuda_plans(spec: ConvSpec, epi: Epilogue, device: object) -> list[tuple[str, object]]:
    """(name, plan) of every CUDA variant that plans ``spec`` (in its first dtype when not float32)
    with ``epi``; the others must say "unsupported epilogue"."""
    out = []
    for v in all_variants():
        vs = spec if "float32" in v.dtypes else ConvSpec.from_dict({**spec.to_dict(), "dtype": sorted(v.dtypes)[0]})
        if "nchw" not in v.layouts or v.applies(vs, device) or (epi.residual and not v.residual_ok):
            continue
        try:
            out.append((v.name, v.plan(vs, v.default(vs, device), device, epi)))
        except ValueError as err:
            assert "unsupported epilogue" in str(err), f"{v.name}: {err}"
    return out


@pytest.mark.parametrize("spec, epi", [CASES[0], CASES[2], CASES[3]], ids=[IDS[0], IDS[2], IDS[3]])
def test_epilogue_compiles_for_cuda_in_every_variant(nvcc_ok, spec: ConvSpec, epi: Epilogue) -> None:
    """Every CUDA variant's plan with the activation (tensor-core ones included: their own epilogue
    writer) applies it and compiles for sm_90, spilling no more than the same plan with ReLU or GELU
    (implicit_gemm's defaults spill a few bytes on a depthwise layer with no epilogue or GELU's: the
    register allocator at these tiles, not the activation). A variant's store path is the same for
    every activation (the activation's token differs), so the variants that plan both the 3x3 layer
    (SiLU) and the fully connected one (HardSwish) compile in one of the two, in turns by their order:
    each such variant compiles once, each activation on half of them; the others compile in the case
    they plan."""
    from dataclasses import replace

    from conftest import NOMINAL_CUDA
    from helpers import ptxas_reports

    def spills(plans: list[object]) -> list[int]:  # one nvcc run for all (helpers.ptxas_reports)
        reports = ptxas_reports([plan.source("cuda") for plan in plans])  # type: ignore[attr-defined]
        return [sum(i.spill_stores + i.spill_loads for i in infos) for infos in reports]

    plans = _cuda_plans(spec, epi, NOMINAL_CUDA)
    assert len(plans) >= (4 if spec.groups > 1 else 5), [n for n, _ in plans]
    turn, other = {SPEC: (0, CASES[2]), FC: (1, CASES[0])}.get(spec, (0, None))
    both = {n for n, _ in _cuda_plans(*other, NOMINAL_CUDA)} if other else set()
    order = [v.name for v in all_variants()]
    others = [replace(epi, silu=False, hardswish=False, **{act: True}) for act in ("relu", "gelu")]
    mine = []
    for name, plan in plans:
        assert f"cf_{'silu' if epi.silu else 'hswish'}(" in plan.source("cuda"), name  # type: ignore[attr-defined]
        if name not in both or order.index(name) % 2 == turn:
            mine.append((name, plan))
    spilling = [(name, got) for (name, _), got in zip(mine, spills([plan for _, plan in mine]), strict=True) if got]
    bases = spills([dict(_cuda_plans(spec, e, NOMINAL_CUDA))[name] for name, _ in spilling for e in others])
    for i, (name, got) in enumerate(spilling):
        base = max(bases[len(others) * i:len(others) * (i + 1)])
        assert got <= base, f"{name}: {got} bytes of spills, at most {base} with ReLU / GELU"
    assert len(mine) >= len(plans) // 3, (len(mine), len(plans))


@pytest.mark.gpu
@pytest.mark.parametrize("spec, epi", CASES, ids=IDS)
def test_epilogue_on_every_cuda_variant(cuda, spec: ConvSpec, epi: Epilogue) -> None:
    """The same on the GPU: every CUDA variant (tensor-core ones included) that plans the layer."""
    ran = []
    for name, plan in _cuda_plans(spec, epi, cuda.device):
        res = check_plan(plan, cuda, seed=3)  # type: ignore[arg-type]
        assert res.ok, f"{name}: {res}"
        ran.append(name)
    assert len(ran) >= (4 if spec.groups > 1 else 5), ran


def _op_kernels(dtype: str) -> list[object]:
    """Every kernel the ONNX graph ops build (ops.unary, binary, resize, pad), in ``dtype`` storage."""
    from convforge.codegen.dialect import Storage
    from convforge.graph import ops
    from convforge.graph.ir import ACT_FNS, Node, Tensor

    st = Storage(dtype)
    x = Tensor("x", ("n", "c", "y", "x"), (2, 3, 13, 11))
    out = []
    for fn in ACT_FNS:
        attrs = {"fn": fn, "alpha": 0.3, "beta": 0.4, "lo": -1.0, "hi": 2.0}
        out.append(ops.unary(Node(f"act_{fn}", "act", ["x"], "y", attrs), x, "x", "y", st))
    g = Tensor("g", x.dims, (2, 3, 1, 1))
    for i, (fn, b, const, swap) in enumerate([("mul", g.shape, False, False), ("add", x.shape, False, False),
                                              ("div", (1, 3, 1, 11), True, True), ("sub", (1, 1, 1, 1), True, False)]):
        node = Node(f"bin{i}", "binary", ["x"], "y", {"fn": fn, "swap": swap})
        out.append(ops.binary(node, x, b, x, ("x", "b"), "y", const, st))
    for mode in ("nearest", "linear"):
        node = Node(f"rs_{mode}", "resize", ["x"], "y", {"mode": mode, "coord": "half_pixel"})
        out.append(ops.resize(node, x, Tensor("y", x.dims, (2, 3, 26, 17)), "x", "y", "ty", "tx", st))
    for mode in ("constant", "reflect", "edge"):
        node = Node(f"pad_{mode}", "pad", ["x"], "y", {"mode": mode, "pad": (1, 2, 0, 3), "value": 0.5})
        out.append(ops.pad(node, x, Tensor("y", x.dims, (2, 3, 16, 14)), "x", "y", st))
    return [o.kernel for o in out]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_op_kernels_compile_for_cuda(nvcc_ok, dtype: str) -> None:
    """The new graph-op kernels render for CUDA and compile for sm_90a without spills (OpenCL: the
    network tests run them on PoCL)."""
    from convforge.codegen.nvcc import ptxas_report
    from convforge.codegen.render import render

    kernels = _op_kernels(dtype)
    infos = ptxas_report(render(kernels, "cuda", "onnx ops"), arch="sm_90a")  # type: ignore[arg-type]
    assert len(infos) == len(kernels)
    assert all(i.spill_stores == 0 and i.spill_loads == 0 for i in infos), infos


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_op_kernels_render_for_opencl_in_half(ocl, dtype: str) -> None:
    """Half storage: the same kernels build on PoCL (the float32 ones run in the network tests)."""
    from convforge.codegen.render import render

    ocl.program(render(_op_kernels(dtype), "opencl", "onnx ops"))  # type: ignore[arg-type]
