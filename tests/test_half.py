"""Half precision (float16, bfloat16 storage; FP32 arithmetic) on PoCL and nvcc, no GPU needed.

Tolerances (relative L2 against float64 on the same half inputs, dtypes.HALF_TOLERANCE): rounding the
output alone costs about u / sqrt(3) (unit roundoff u = 2^-11 for float16, 2^-8 for bfloat16; measured
2e-4 and 1.6e-3 on these layers), so a plan is checked at 1e-3 (float16) and 8e-3 (bfloat16), about
2u; a network through several rounded layers at twice that.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import NOMINAL_CUDA
from convforge.check import check_plan
from convforge.codegen.dialect import Kernel, Storage
from convforge.codegen.render import render
from convforge.dtypes import HALF_TOLERANCE, from_storage, rounded, to_storage
from convforge.kernels import all_variants
from convforge.plan import Epilogue, Launch
from convforge.spec import ConvSpec
from helpers import ODD_SPECS, ptxas_reports, run_main, sample

HALF = ("float16", "bfloat16")
# Shapes where the generators vectorise (C*R*S, H*W and P*Q multiples of 4): 8-byte half4 loads/stores.
VECTOR_SPECS = [ConvSpec.make(2, 8, 8, 8, 12, 1, 1), ConvSpec.make(1, 4, 9, 12, 8, 3, 3, 1, 1),
                ConvSpec.make(1, 64, 2, 2, 16, 1, 1)]
# Filters covering the whole unpadded input (fully-connected layers: gemm_fc), odd and 4-aligned.
FC_SPECS = [ConvSpec.make(1, 7, 5, 3, 11, 5, 3), ConvSpec.make(2, 40, 3, 3, 13, 3, 3)]
# Grouped layers (the group's channel pointers in the dtype).
GROUPED_SPECS = [ConvSpec.make(2, 6, 9, 11, 9, 3, 3, 2, (1, 0, 1, 1), groups=3),
                 ConvSpec.make(1, 8, 6, 6, 12, 1, 1, groups=4)]


CORE_FAMILIES = ("direct", "im2col", "implicit_gemm", "gemm1x1")  # FP32 arithmetic on CUDA cores / OpenCL


def half_variants(backend: str = "opencl", conv_pass: str = "fprop") -> list[str]:
    """The CUDA-core / OpenCL families' variants of ``conv_pass`` that serve half storage (and float32:
    the tensor-core ones, half only or Winograd, are tests/test_tensorcore_gen.py's)."""
    return [v.name for v in all_variants() if set(HALF) <= v.dtypes and "float32" in v.dtypes
            and v.family in CORE_FAMILIES and backend in v.backends and conv_pass in v.passes]


def _with(spec: ConvSpec, dtype: str) -> ConvSpec:
    return dataclasses.replace(spec, dtype=dtype)


# -- the dialect's storage tokens ------------------------------------------------------------------
def _storage_kernel(st: Storage) -> Kernel:
    """z[i] = x[i] (scalar load and store), y = x through the vector tokens, w[i] = x[i] read through
    the read-only path and a pointer: every half token, on values a test can predict bit for bit."""
    body = "\n".join([
        "const int i = GROUP_ID(0) * 64 + LOCAL_ID(0);",
        f"const GLOBAL_PTR {st.elem}* xp = x + i;",
        f"if (i < 16) {st.vstore4(st.vload4('i', 'x'), 'i', 'y')};",
        f"{st.store('z', 'i', st.load('x', 'i'))};",
        f"{st.store('w', 'i', st.ldg('xp') + ' * 0.5f + ' + st.deref('xp') + ' * 0.5f')};",
        f"{st.store('r', 'i', 'src[i]')};",
    ])
    args = (st.buf("x"), st.buf("y", False), st.buf("z", False), st.buf("w", False), st.buf("r", False),
            Storage().buf("src"))
    return Kernel("storage", args, body, (64, 1, 1))


@pytest.mark.parametrize("dtype", HALF)
def test_storage_tokens_round_trip_and_round_to_nearest_even(ocl, dtype: str) -> None:
    """Loads give the stored value exactly; stores of float32 values round to nearest even (ties,
    NaN kept NaN, overflow to infinity) exactly as dtypes.to_storage does on the host."""
    st = _storage_kernel(Storage(dtype))
    src = render([st], "opencl")
    prog = ocl.program(src)
    fn = ocl.function(prog, st)
    rng = np.random.default_rng(3)
    vals = rounded(rng.uniform(-3, 3, 64).astype(np.float32), dtype)
    vals[:4] = rounded(np.array([np.nan, np.inf, -0.0, 65504.0 if dtype == "float16" else 3.0e38], np.float32),
                       dtype)
    one = np.float32(1.0)
    ulp = 2.0 ** (-10 if dtype == "float16" else -7)
    fresh = np.array([one + ulp / 2, one + 3 * ulp / 2, one + ulp / 4, 7e4, 1e-8, np.nan, -2.5e-5, 1 + ulp],
                     np.float32)  # ties to even (both ways), below half an ulp, overflow, underflow
    srcv = np.resize(fresh, 64).astype(np.float32)
    bufs = [ocl.upload(to_storage(vals, dtype))] + [ocl.upload(to_storage(np.zeros(64, np.float32), dtype))
                                                    for _ in range(4)] + [ocl.upload(srcv)]
    ocl.launch(prog, fn, st, Launch("storage", (1, 1, 1), (64, 1, 1), ()), bufs)
    ocl.synchronize()
    y, z, w, r = (ocl.download(b, (64,), dtype) for b in bufs[1:5])
    same = dict(equal_nan=True)
    assert np.array_equal(z, vals, **same) and np.array_equal(w, vals, **same)
    assert np.array_equal(y, vals, **same)
    got, want = (to_storage(a, dtype).view(np.uint16) for a in (r, srcv))
    nan = np.isnan(srcv)
    assert np.array_equal(np.isnan(r), nan) and np.array_equal(got[~nan], want[~nan])  # bit for bit
    assert np.isnan(r[5]) and r[0] == one and r[1] == one + 2 * ulp


@pytest.mark.parametrize("dtype", HALF)
def test_half_sources_need_no_fp16_extension(dtype: str) -> None:
    """OpenCL keeps FP32 arithmetic: half is storage only (vload_half / vstore_half_rte, or ushort
    bits for bfloat16); CUDA uses unsigned short bits and PTX conversions, no header."""
    k = _storage_kernel(Storage(dtype))
    ocl_src, cuda_src = render([k], "opencl"), render([k], "cuda")
    assert "cl_khr_fp16" not in ocl_src and "#include" not in cuda_src
    if dtype == "float16":
        assert "vload_half4(" in ocl_src and "vstore_half_rte(" in ocl_src and "cvt.rn.f16.f32" in cuda_src
    else:
        assert "__global const ushort* restrict x" in ocl_src and "cvt.rn.bf16.f32" in cuda_src
    assert "const unsigned short* __restrict__ x" in cuda_src


def test_storage_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="storage dtype"):
        Storage("float64")


# -- every half-serving variant on PoCL ------------------------------------------------------------
def test_half_serving_variants_are_the_promised_families() -> None:
    names = set(half_variants("opencl"))
    assert {"direct", "direct_smem", "implicit_gemm", "implicit_gemm_precomp", "gemm1x1"} <= names
    assert "direct_shfl" in half_variants("cuda")
    assert not any(v.startswith("winograd") for v in names)  # float32 only (optional for half)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", half_variants("opencl"))
def test_half_variant_on_odd_shapes(ocl, name: str, dtype: str) -> None:
    """Every applicable odd shape with the default parameters (bias + residual + ReLU on every other
    one, where the variant stores them), plus sampled points on the first: NaN-poisoned output, error
    under the dtype's tolerance, every output written. bfloat16 differs from float16 only in its loads
    and stores: both run every vectorised shape, and they take the other shapes in turns (each shape
    runs in one of them; each dtype with both epilogues where the variant has shapes for both)."""
    v = next(v for v in all_variants() if v.name == name)
    shapes = [(i, _with(base, dtype)) for i, base in enumerate(ODD_SPECS + VECTOR_SPECS + FC_SPECS + GROUPED_SPECS)]
    shapes = [(i, spec) for i, spec in shapes if not v.applies(spec, ocl.device)]
    vector = {_with(base, dtype) for base in VECTOR_SPECS}
    others = [s for s in shapes if s[1] not in vector]
    kept = [s for s in shapes if s[1] in vector] + others[HALF.index(dtype)::2]
    kept += [next(s for s in shapes if s[0] % 2 == odd) for odd in (0, 1)  # both epilogues
             if any(i % 2 == odd for i, _ in shapes) and not any(i % 2 == odd for i, _ in kept)]
    shapes = sorted(set(kept), key=lambda s: s[0])
    tried = 0
    for i, spec in shapes:
        epi = Epilogue(True, True, v.residual_ok) if i % 2 else Epilogue()
        points = sample(v, spec, ocl.device, 1, seed=i) if tried == 0 else [v.default(spec, ocl.device)]
        for prm in points:
            res = check_plan(v.plan(spec, prm, ocl.device, epi), ocl, seed=i)
            assert res.ok, f"{name} {spec.short()} [{prm.short()}]{epi.tag()}: {res}"
            assert res.tolerance == HALF_TOLERANCE[dtype]
        tried += 1
    assert tried, f"{name} applies to none of the test shapes"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", half_variants("opencl", "dgrad"))
def test_half_dgrad_through_forward_families(ocl, name: str, dtype: str) -> None:
    """Stride-1 dgrad by a forward family (its filters rotated as raw half bits) in half storage, and
    strided 1x1 dgrad through the sub-grid (dgrad_sub_*: the interleave copies half bits). The two
    dtypes differ only in their loads and stores: both run the vectorised shape and a variant's only
    shape, and they take the others in turns (each shape runs in one of them)."""
    v = next(v for v in all_variants() if v.name == name)
    bases = [ODD_SPECS[0], ODD_SPECS[1], ODD_SPECS[5], VECTOR_SPECS[1], GROUPED_SPECS[1],
             ConvSpec.make(1, 8, 4, 5, 64, 1, 1),  # a 64-long dgrad reduction
             ConvSpec.make(1, 6, 9, 11, 40, 1, 1, 2, (1, 0, 0, 1))]  # 1x1/2, split-K sub-grid
    specs = [(i, dataclasses.replace(base, dtype=dtype, conv_pass="dgrad")) for i, base in enumerate(bases)]
    specs = [(i, spec) for i, spec in specs if not v.applies(spec, ocl.device)]
    tried = 0
    for k, (i, spec) in enumerate(specs):
        if bases[i] is not VECTOR_SPECS[1] and len(specs) > 1 and k % 2 != HALF.index(dtype):
            continue
        res = check_plan(v.plan(spec, v.default(spec, ocl.device), ocl.device), ocl, seed=i)
        assert res.ok, f"{name} {spec.short()}: {res}"
        tried += 1
    assert tried, f"{name} applies to none of the test shapes"


# Grouped layers no tensor-core form takes, strided and dilated as PyTorch's OpInfo samples are: the exact
# baselines run them in half (FP32 sums), so a half layer's backward is ours, not PyTorch's
BASELINE_SPECS = [ConvSpec.make(2, 4, 8, 8, 2, 3, 3, (3, 2), (2, 2, 1, 1), (4, 4), groups=2),
                  ConvSpec.make(1, 4, 6, 5, 6, 3, 2, groups=2),
                  ConvSpec.make(3, 6, 7, 9, 9, 3, 3, 2, (1, 0, 1, 1), groups=3)]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("conv_pass", ["dgrad", "wgrad"])
def test_half_exact_backward_baselines_on_grouped_strided_layers(ocl, conv_pass: str, dtype: str) -> None:
    """dgrad_direct and wgrad_direct in half storage: NaN-poisoned output, error under the dtype's tolerance
    against float64, on N=1 and prime shapes, stride 3x2, dilation 4, asymmetric padding, groups."""
    v = next(v for v in all_variants() if v.name == f"{conv_pass}_direct")
    for i, base in enumerate(BASELINE_SPECS):
        spec = dataclasses.replace(base, dtype=dtype, conv_pass=conv_pass)
        assert v.applies(spec, ocl.device) is None, spec.short()
        res = check_plan(v.plan(spec, v.default(spec, ocl.device), ocl.device), ocl, seed=i)
        assert res.ok and res.tolerance == HALF_TOLERANCE[dtype], f"{v.name} {spec.short()}: {res}"


def test_plan_tolerance_is_at_least_the_dtype_rounding(ocl) -> None:
    v = next(v for v in all_variants() if v.name == "direct")
    for dtype in ("float32", *HALF):
        spec = _with(ODD_SPECS[1], dtype)
        plan = v.plan(spec, v.default(spec, ocl.device), ocl.device)
        assert plan.tolerance == (v.tolerance if dtype == "float32" else HALF_TOLERANCE[dtype])


def test_float32_only_variants_refuse_half(ocl) -> None:
    spec = _with(ConvSpec.make(1, 4, 12, 12, 8, 3, 3, 1, 1), "float16")
    for name in ("winograd_nonfused_f2", "im2win", "im2col_cublas"):
        v = next(v for v in all_variants() if v.name == name)
        assert "does not take float16" in (v.applies(spec, NOMINAL_CUDA) or "")
    direct = next(v for v in all_variants() if v.name == "direct")
    prm = direct.default(spec, ocl.device).replace(wconst=True)
    with pytest.raises(ValueError, match="float32 only"):
        direct.plan(spec, prm, ocl.device)


# -- nvcc: the half CUDA sources compile for sm_90 without spills ----------------------------------
def _spills(infos) -> int:  # type: ignore[no-untyped-def]
    return sum(i.spill_stores + i.spill_loads for i in infos)


def test_half_cuda_sources_compile_without_spills(nvcc_ok) -> None:
    """nvcc -arch=sm_90, for every half CUDA variant in both half dtypes: the default parameters compile
    without spills; a sampled point (on the first shape each dtype takes) may spill only where its
    float32 twin spills too (half storage adds none). The shapes the variant takes alternate between the
    two half dtypes (which change only the loads, stores and conversions): each shape compiled in one of
    them, each dtype on half the shapes (on the one shape where only one applies). One nvcc run for all
    the defaults and sampled points (helpers.ptxas_reports), another for the twins where a sampled point
    spills."""
    shapes = [ConvSpec.make(2, 64, 28, 28, 64, 3, 3, 1, 1), ConvSpec.make(4, 256, 14, 14, 128, 1, 1),
              ODD_SPECS[4], ConvSpec.make(4, 512, 6, 6, 256, 6, 6)]
    defaults, sampled = [], []  # (label, source); (label, dtype, (variant, float32 spec, point, epilogue), source)
    for name in half_variants("cuda"):
        v = next(v for v in all_variants() if v.name == name)
        epi = Epilogue(True, True, v.residual_ok)
        for dtype in HALF:
            taken = [(i, base) for i, base in enumerate(shapes) if not v.applies(_with(base, dtype), NOMINAL_CUDA)]
            first = True
            for j, (i, base) in enumerate(taken):
                if len(taken) > 1 and j % 2 != HALF.index(dtype):
                    continue
                spec = _with(base, dtype)
                default, *others = sample(v, spec, NOMINAL_CUDA, 1, seed=i)
                defaults.append((f"{name} [{default.short()}] {spec.short()}",
                                 v.plan(spec, default, NOMINAL_CUDA, epi).source("cuda")))
                sampled += [(f"{name} [{prm.short()}] {spec.short()}", dtype, (v, base, prm, epi),
                             v.plan(spec, prm, NOMINAL_CUDA, epi).source("cuda")) for prm in others if first]
                first = False
            assert not first, (name, dtype)
    reports = ptxas_reports([src for _, src in defaults] + [src for *_, src in sampled])
    for (label, _), infos in zip(defaults, reports, strict=False):
        assert infos, f"{label}: ptxas reported no kernel"
        assert not _spills(infos), f"{label} spills: {infos}"
    spilling = [(label, dtype, twin) for (label, dtype, twin, _), infos in zip(sampled, reports[len(defaults):],
                                                                            strict=True) if _spills(infos)]
    twins = ptxas_reports([v.plan(base, prm, NOMINAL_CUDA, epi).source("cuda") for *_, (v, base, prm, epi) in spilling])
    for (label, dtype, _), infos in zip(spilling, twins, strict=True):
        assert _spills(infos), f"{label} spills in {dtype} only"


# -- conv2d with NumPy float16 -----------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["auto", "direct", "implicit_gemm", "gemm1x1"])
def test_conv2d_numpy_float16_end_to_end(ocl, algo: str) -> None:
    from convforge import conv2d
    from convforge.reference import conv2d_ref, rel_l2

    rng = np.random.default_rng(7)
    r = 1 if algo == "gemm1x1" else 3
    x = rng.uniform(-1, 1, (2, 3, 13, 11)).astype(np.float16)
    w = rng.uniform(-1, 1, (5, 3, r, r)).astype(np.float16)
    b = rng.uniform(-1, 1, 5).astype(np.float16)
    pad = (0, 1, 1, 0) if r == 3 else 0
    y = conv2d(x, w, b, padding=pad, relu=True, algo=algo)
    assert isinstance(y, np.ndarray) and y.dtype == np.float16
    spec = ConvSpec.from_shapes(x.shape, w.shape, 1, pad)
    ref = np.maximum(conv2d_ref(x.astype(np.float64), w.astype(np.float64), spec)
                     + b.astype(np.float64)[None, :, None, None], 0)
    assert y.shape == ref.shape
    assert rel_l2(y.astype(np.float32), ref) < HALF_TOLERANCE["float16"]


@pytest.mark.parametrize("x_dt, w_dt, b_dt, says", [
    (np.float16, np.float32, None, r"weights dtype \(float32\) must equal the input's \(float16\)"),
    (np.float32, np.float16, None, r"weights dtype \(float16\) must equal the input's \(float32\)"),
    (np.float16, np.float16, np.float32, r"bias dtype \(float32\) must equal the input's \(float16\)"),
    (np.float64, np.float64, None, r"input dtype \(float64\) is not run by convforge; use torch.nn.functional"),
    (np.uint16, np.uint16, None, r"input dtype \(uint16\) must be one of float32, float16"),
])
def test_conv2d_dtype_mixes_are_clear_errors(x_dt, w_dt, b_dt, says: str) -> None:
    from convforge import conv2d

    x = np.ones((1, 2, 5, 5), x_dt)
    w = np.ones((3, 2, 3, 3), w_dt)
    b = None if b_dt is None else np.ones(3, b_dt)
    with pytest.raises(ValueError, match=says):
        conv2d(x, w, b)


# -- the tuner and the database keep the dtype -------------------------------------------------------
def test_tuner_tunes_a_half_layer_under_its_own_key(ocl, tmp_path) -> None:
    from convforge.tune.db import TuningDB
    from convforge.tune.tuner import Budget, Tuner

    db = TuningDB(tmp_path / "t.sqlite")
    tuner = Tuner(ocl, db, Budget(None, 4), workers=2)
    spec = _with(ConvSpec.make(1, 3, 13, 13, 5, 3, 3, 1, 1), "bfloat16")
    res = tuner.tune(spec)
    assert not res.from_db and res.entry.dtype == "bfloat16" and "bfloat16" in res.entry.spec
    assert 0 < res.entry.error <= HALF_TOLERANCE["bfloat16"]
    assert tuner.lookup(spec) is not None and tuner.lookup(_with(spec, "float32")) is None


def test_tuner_bound_admits_half_rounding_in_every_class(ocl) -> None:
    """A bfloat16 output's rounding (~2e-3) exceeds the relaxed class's 1e-3: for half storage each
    class also admits FP32_SLACK x the most accurate candidate."""
    from types import SimpleNamespace

    from convforge.tune.tuner import Tuner

    ok = [SimpleNamespace(error=2e-3), SimpleNamespace(error=3e-3)]
    for prec in ("fp32", "relaxed"):
        t = Tuner(ocl, None, precision=prec)
        assert t.bound(ok, "bfloat16") == pytest.approx(4e-3)  # type: ignore[arg-type]
    assert Tuner(ocl, None, precision="relaxed").bound(ok) == 1e-3  # type: ignore[arg-type]


# -- the CLI ----------------------------------------------------------------------------------------
def test_cli_algos_and_show_take_dtype(capsys) -> None:
    spec = "N=1,C=3,H=13,W=13,K=8,R=3,S=3,pad=1"
    rc, out = run_main(["algos", "--spec", spec, "--backend", "cuda", "--dtype", "bf16"], capsys)
    assert rc == 0 and "bfloat16" in out.splitlines()[0]
    assert "winograd_nonfused_f2 " in out and "does not take bfloat16" in out
    assert "+ implicit_gemm " in out
    rc, out = run_main(["show", "--spec", spec, "--variant", "implicit_gemm", "--dtype", "fp16", "--bias",
                        "--backend", "both"], capsys)
    assert rc == 0 and "vload_half(" in out and "cf_h2f(" in out and "__global const half* restrict w" in out
    rc, out = run_main(["show", "--spec", spec + ",dtype=bf16", "--dtype", "fp16"], capsys)
    assert rc == 2 and "--dtype (float16) contradicts the spec's dtype (bfloat16)" in out
    rc, out = run_main(["algos", "--spec", spec, "--dtype", "fp64"], capsys)
    assert rc == 2 and "dtype ('fp64') must be one of" in out


def test_cli_tune_dtype_stores_half_entries(ocl, tmp_path, capsys) -> None:
    from convforge.tune.db import TuningDB

    dbp = tmp_path / "cli.sqlite"
    rc, out = run_main(["tune", "--spec", "N=1,C=3,H=11,W=11,K=4,R=3,S=3,pad=1", "--dtype", "fp16",
                        "--backend", "opencl", "--budget", "2", "--db", str(dbp)], capsys)
    assert rc == 0, out
    entries = TuningDB(dbp).entries()
    assert entries and all(e.dtype == "float16" for e in entries)


SMALL = """
name: "small"
input: "data" input_shape { dim: 2 dim: 3 dim: 13 dim: 11 }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
        convolution_param { num_output: 5 kernel_size: 3 pad: 1 stride: 2 } }
layer { name: "bn" type: "BatchNorm" bottom: "c1" top: "c1" }
layer { name: "sc" type: "Scale" bottom: "c1" top: "c1" scale_param { bias_term: true } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2" convolution_param { num_output: 5 kernel_size: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "c1" bottom: "c2" top: "sum" }
layer { name: "lk" type: "ReLU" bottom: "sum" top: "sum" relu_param { negative_slope: 0.1 } }
layer { name: "n1" type: "LRN" bottom: "sum" top: "n1" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } }
layer { name: "p1" type: "Pooling" bottom: "n1" top: "p1" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "p2" type: "Pooling" bottom: "n1" top: "p2" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "cat" type: "Concat" bottom: "p1" bottom: "p1" top: "cat" }
layer { name: "fc" type: "InnerProduct" bottom: "cat" top: "fc" inner_product_param { num_output: 8 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
layer { name: "gp" type: "Pooling" bottom: "p2" top: "gp" pooling_param { pool: AVE global_pooling: true } }
"""


def test_cli_run_dtype_on_pocl(ocl, tmp_path, capsys) -> None:
    import json

    net = tmp_path / "small.prototxt"
    net.write_text(SMALL)
    rc, out = run_main(["run", "--net", str(net), "--batch", "2", "--backend", "opencl", "--dtype", "bf16",
                        "--repeats", "1", "--out", str(tmp_path / "o")], capsys)
    assert rc == 0, out
    doc = json.loads(next((tmp_path / "o").glob("run-*-bfloat16.json")).read_text())
    assert doc["dtype"] == "bfloat16" and 0 < doc["logits_error"] < 2 * HALF_TOLERANCE["bfloat16"]
    assert "fp32 bfloat16" in doc["summary"]


# -- a network in half precision through compile ---------------------------------------------------
@pytest.mark.parametrize("passes", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_network_in_half_precision_against_the_float64_executor(ocl, dtype: str, passes: bool) -> None:
    """Activations, conv weights and biases stored in the dtype through every op (conv, batch norm /
    scale, ReLU, leaky ReLU, residual add, LRN, max and average pooling, concat, fc, softmax, global
    pooling); the float64 executor runs the float32 weights on the same (rounded) input."""
    from convforge.graph.build import compile
    from convforge.graph.caffe import load_prototxt
    from convforge.graph.reference import run_reference
    from convforge.reference import rel_l2

    g = load_prototxt(SMALL, seed=3)
    g.outputs = ["prob", "gp", "fc", "p2"]
    x = np.random.default_rng(1).standard_normal(g.input_shape).astype(np.float32)
    net = compile(g, batch=2, backend="opencl", passes=passes, dtype=dtype)
    assert net.dtype == dtype and net.memory.bytes <= sum(t.size for t in net.shapes.values()) * 2
    out = net(x)
    ref = run_reference(g, rounded(x, dtype))
    for t in g.outputs:
        err = rel_l2(out[t], ref[t])
        assert err < 2 * HALF_TOLERANCE[dtype], f"{t}: {err:.2e}"
    bits = {t: to_storage(out[t], dtype) for t in g.outputs}  # the outputs hold values of the dtype
    assert all(np.array_equal(from_storage(b, dtype), out[t], equal_nan=True) for t, b in bits.items())


def test_compile_refuses_an_unknown_dtype() -> None:
    from convforge.graph.build import compile

    with pytest.raises(ValueError, match="dtype"):
        compile("alexnet", dtype="int8")


@pytest.mark.parametrize("dtype", HALF)
def test_cuda_half_loads_are_exact_on_every_bit_pattern(cuda, dtype: str) -> None:
    """CUDA's half -> float32 conversions (``cf_h2f``: PTX cvt; the 4-wide load: two halves of a word
    converted in place; bfloat16's shifts) on all 65536 patterns: bit for bit NumPy's conversion
    (subnormals, infinities; NaN stays NaN), in the scalar and in the vector load."""
    st = Storage(dtype)
    body = "\n".join([
        "const int i = GROUP_ID(0) * 64 + LOCAL_ID(0);",
        f"{Storage().store('r', 'i', st.load('x', 'i'))};",
        f"if (i % 4 == 0) {Storage().vstore4(st.vload4('i / 4', 'x'), 'i / 4', 'v')};",
    ])
    k = Kernel("h2f", (st.buf("x"), Storage().buf("r", False), Storage().buf("v", False)), body, (64, 1, 1))
    prog = cuda.program(render([k], "cuda"))
    bits = np.arange(65536, dtype=np.uint16)
    bufs = [cuda.upload(bits)] + [cuda.upload(np.full(65536, np.nan, np.float32)) for _ in range(2)]
    cuda.launch(prog, cuda.function(prog, k), k, Launch("h2f", (1024, 1, 1), (64, 1, 1), ()), bufs)
    cuda.synchronize()
    if dtype == "float16":
        want = bits.view(np.float16).astype(np.float32).view(np.uint32)
    else:
        want = bits.astype(np.uint32) << 16
    nan = np.isnan(want.view(np.float32))  # NaN stays NaN (its payload as the hardware's cvt leaves it)
    for buf in bufs[1:]:
        got = cuda.download(buf, (65536,))
        assert np.array_equal(got.view(np.uint32)[~nan], want[~nan]) and np.isnan(got[nan]).all()


def test_bench_half_baseline_is_chosen_by_the_layers_dtype() -> None:
    """A half layer compares with cuDNN-best of its dtype in every class; a float32 layer's FP16
    context row (PyTorch channels_last) is never its baseline."""
    from convforge.apps.bench.baselines import HALF_BEST, BaselineResult, best_half, for_class

    rows = [BaselineResult("torch-fp16", "pick", "fp16", 0.5, 0, 3e-4),
            BaselineResult("torch-fp16-cl", "pick", "fp16", 0.3, 0, 3e-4),
            BaselineResult("cudnn-fp16:IMPLICIT_GEMM", "IMPLICIT_GEMM", "fp16", 0.6, 0, 2e-4),
            BaselineResult("cudnn-fp16-nhwc:IMPLICIT_PRECOMP_GEMM", "IMPLICIT_PRECOMP_GEMM", "fp16", 0.2, 0, 2e-4),
            BaselineResult("cudnn-fp16:FFT", "FFT", "fp16", None, status="NOT_SUPPORTED")]
    best = best_half(rows, "float16")
    assert best is not None and best.impl == HALF_BEST["float16"] and best.time_ms == 0.2
    assert best.algo == "IMPLICIT_PRECOMP_GEMM (NHWC)"
    assert for_class([best, *rows], "fp32", "float16") == for_class([best, *rows], "relaxed", "float16") == best
    assert best_half(rows[:2], "float16") is None  # no cuDNN row: no cuDNN-best
    fp32 = [BaselineResult("cudnn-best", "WINOGRAD", "fp32", 1.0, 0, 1e-6), rows[1]]
    assert for_class(fp32, "fp32") == fp32[0]


def test_bench_dtype_on_pocl(ocl, tmp_path, capsys) -> None:
    """``bench --dtype bf16``: every layer stored as bfloat16, checked at its tolerance, the table
    naming the dtype; results.csv carries it."""
    import csv
    import json

    from convforge.cli import main

    f = tmp_path / "tiny.json"
    f.write_text(json.dumps([
        {"name": "t3", "N": 2, "C": 3, "H": 13, "W": 11, "K": 5, "R": 3, "S": 3, "stride": 1, "pad": 1},
        {"name": "t1", "N": 1, "C": 8, "H": 6, "W": 6, "K": 12, "R": 1, "S": 1, "stride": 1, "pad": 0}]))
    out = tmp_path / "out"
    rc = main(["bench", "--suite", str(f), "--backend", "opencl", "--baseline", "none", "--dtype", "bf16",
               "--out", str(out), "--quick-ceilings", "--repeats", "2", "--warmup", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "fp32 class, bfloat16" in text
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["spec"]["dtype"] == "bfloat16" and r["ok"] for r in rows)
    assert all(0 < r["rel_err"] < HALF_TOLERANCE["bfloat16"] for r in rows)
    with (out / "results.csv").open() as fh:
        assert {x["dtype"] for x in csv.DictReader(fh)} == {"bfloat16"}
