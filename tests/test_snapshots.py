"""Generated-source snapshots: a generator change that alters code nobody meant to touch fails here.

Every case is one generated source (a variant on a small spec, pass and back-end, or one of the
kernels outside the variants: training batch norm, bias gradient, gradient rows). The first case of
each family x dtype x pass x back-end keeps its whole text in ``tests/snapshots/CASE.txt``, the diff
a reviewer reads; every other case keeps the sha256 of its text in ``tests/snapshots/hashes.json``.
Either kind fails when the source changes, naming the case, and writes the new source to
``$TMPDIR/convforge-snapshots/`` to read.

After an intended generator change: ``CONVFORGE_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_snapshots.py``
rewrites both (and drops entries of cases that are gone); review ``git diff tests/snapshots``. To see a
hashed case's old text, ``CONVFORGE_SNAPSHOT_DUMP=DIR`` writes every case's source to DIR: run it on
both commits and diff the folders.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import NOMINAL_CUDA, NOMINAL_OPENCL_GPU
from convforge.kernels import all_variants, get_variant
from convforge.plan import DeviceInfo, Epilogue
from convforge.spec import ConvSpec

SNAP = Path(__file__).parent / "snapshots"
HASHES = SNAP / "hashes.json"
UPDATE = bool(os.environ.get("CONVFORGE_UPDATE_SNAPSHOTS"))

SPECS = {"3x3": ConvSpec.make(2, 5, 11, 11, 6, 3, 3, 1, 1), "1x1": ConvSpec.make(2, 8, 7, 7, 6, 1, 1),
         "1x1deep": ConvSpec.make(1, 256, 2, 2, 16, 1, 1), "fc": ConvSpec.make(2, 40, 3, 3, 13, 3, 3),
         # grouped (3 groups of 2 -> 3 channels), grouped 1x1, depthwise with multiplier 2
         "grouped": ConvSpec.make(2, 6, 11, 11, 9, 3, 3, 1, 1, groups=3),
         "1x1g": ConvSpec.make(2, 8, 7, 7, 12, 1, 1, groups=4),
         "grouped8": ConvSpec.make(2, 16, 9, 9, 24, 3, 3, 1, 1, groups=2),  # whole chunks a group: tc_grouped_*
         "depthwise": ConvSpec.make(2, 8, 12, 12, 16, 3, 3, 1, 1, groups=8),
         "dwnhwc": ConvSpec.make(2, 8, 12, 12, 16, 3, 3, 1, 1, groups=8, layout="nhwc"),  # channels-last
         "gnhwc": ConvSpec.make(2, 16, 9, 9, 16, 3, 3, 1, 1, groups=4, layout="nhwc"),  # groups of 4, channels-last
         # a large depthwise filter in FP16, channels-last: depthwise_mma's Toeplitz blocks
         "dwlarge": ConvSpec.make(2, 8, 12, 12, 8, 13, 13, 1, 6, groups=8, dtype="float16", layout="nhwc")}
PASS_ORDER = ("fprop", "dgrad", "wgrad")


@dataclass(frozen=True)
class Case:
    """One generated source: ``key`` names its snapshot, ``group`` (family, dtype, pass, back-end)
    decides whether it is kept whole (the group's first case) or as a hash."""

    key: str
    group: tuple[str, str, str, str]
    make: Callable[[], str]


def _family(name: str) -> str:
    """A variant's family, the sm_90 tensor-core generator's variants apart (their own full texts)."""
    v = get_variant(name)
    return f"{v.family}/tensorcore" if ".tensorcore" in type(v).__module__ else v.family


def _device(backend: str) -> DeviceInfo:
    return NOMINAL_CUDA if backend == "cuda" else NOMINAL_OPENCL_GPU


def _variant_source(name: str, spec: ConvSpec, backend: str, **changes: int) -> Callable[[], str]:
    def make() -> str:
        v = get_variant(name)
        prm = v.default(spec, _device(backend))
        return v.plan(spec, prm.replace(**changes) if changes else prm, _device(backend)).source(backend)
    return make


def _variant_cases() -> Iterator[Case]:
    """Every variant on every snapshot spec it applies to, in every pass it computes, on each back-end."""
    for v in all_variants():
        for tag, base in SPECS.items():
            for backend in sorted(v.backends):
                for conv_pass in PASS_ORDER:
                    spec = base.with_pass(conv_pass)
                    if conv_pass not in v.passes or v.applies(spec, _device(backend)) is not None:
                        continue
                    label = tag if conv_pass == "fprop" else f"{tag}-{conv_pass}"
                    yield Case(f"{v.name}.{label}.{backend}", (_family(v.name), spec.dtype, conv_pass, backend),
                               _variant_source(v.name, spec, backend))


def _half_cases() -> Iterator[Case]:
    """The CUDA-core / OpenCL families' variants that store FP16 and BF16 (half storage, FP32 sums; the
    tensor-core ones are tests/test_tensorcore_gen.py's), with bias, ReLU and, where taken, a residual."""
    specs = {"3x3": ConvSpec.make(2, 5, 11, 11, 6, 3, 3, 1, 1), "1x1": ConvSpec.make(2, 8, 8, 8, 12, 1, 1),
             "1x1deep": ConvSpec.make(1, 256, 2, 2, 16, 1, 1), "fc": ConvSpec.make(2, 40, 3, 3, 13, 3, 3)}
    half = {"float16", "bfloat16"}
    names = sorted(v.name for v in all_variants() if half <= v.dtypes and "float32" in v.dtypes
                   and v.family in ("direct", "im2col", "implicit_gemm", "gemm1x1") and "fprop" in v.passes)
    for name in names:
        v = get_variant(name)
        for tag, base in specs.items():
            for backend in sorted(v.backends):
                for dtype in sorted(half):
                    spec = dataclasses.replace(base, dtype=dtype)
                    if v.applies(spec, _device(backend)) is not None:
                        continue

                    def make(name: str = name, spec: ConvSpec = spec, backend: str = backend) -> str:
                        v, device = get_variant(name), _device(backend)
                        return v.plan(spec, v.default(spec, device), device,
                                      Epilogue(True, True, v.residual_ok)).source(backend)
                    yield Case(f"half/{name}.{tag}.{dtype}.{backend}", (_family(name), dtype, "fprop", backend), make)


def _prologue_cases() -> Iterator[Case]:
    """The 1x1 GEMM with an affine + ReLU prologue (DenseNet's bottleneck): float4 loads activated in
    place, scalar loads inside their bounds test."""
    from convforge.plan import Prologue

    spec = ConvSpec.make(2, 8, 7, 8, 6, 1, 1)
    for backend in ("cuda", "opencl"):
        def make(backend: str = backend) -> str:
            v, device = get_variant("gemm1x1"), _device(backend)
            return v.plan_for(spec, v.default(spec, device), device, Epilogue(bias=True, relu=True),
                              Prologue(affine=True, relu=True)).source(backend)
        yield Case(f"gemm1x1.1x1-prologue.{backend}", ("gemm1x1", "float32", "fprop", backend), make)


def _full_transform_cases() -> Iterator[Case]:
    """F(6x6)/F(7x7) default to split transforms (xi, xo) and, on the 3x3 spec's few tiles, half-transformed
    filters (hf=1); these pin the other paths: the full G g G^T filter transform, the plain GEMM and the
    thread-per-tile transforms with staged stores."""
    for name in ("winograd_nonfused_f6", "winograd_nonfused_f7"):
        for backend in ("cuda", "opencl"):
            yield Case(f"{name}.3x3-hf0.{backend}", (_family(name), "float32", "fprop", backend),
                       _variant_source(name, SPECS["3x3"], backend, hf=0, xi=0, xo=0, so=1, lo=0))


def _strided_dgrad_cases() -> Iterator[Case]:
    """The snapshot specs are stride 1, which the strided dgrads leave to the transposed forward problem:
    a 3x3 stride-2 layer (four phases of 1, 2, 2 and 4 taps, interleaved) and a 1x1 stride-2 one (one
    phase; dgrad_sub_*: the sub-grid GEMM and the interleave)."""
    bases = {"3x3s2": ConvSpec.make(2, 5, 11, 11, 6, 3, 3, 2, 1), "1x1s2": ConvSpec.make(2, 8, 7, 7, 6, 1, 1, 2)}
    for name, backend in [("dgrad_tc_strided_tf32", "cuda"), ("dgrad_tc_strided_half", "cuda"),
                          ("dgrad_sub_gemm1x1", "cuda"), ("dgrad_sub_gemm1x1", "opencl"),
                          ("dgrad_sub_gemm1x1_wgmma_tf32", "cuda")]:
        dtype = "float16" if name.endswith("half") else "float32"
        for tag, base in bases.items():
            spec = ConvSpec.from_dict({**base.to_dict(), "dtype": dtype, "pass": "dgrad"})
            if get_variant(name).applies(spec, _device(backend)) is None:
                yield Case(f"{name}.{tag}-dgrad.{backend}", (_family(name), dtype, "dgrad", backend),
                           _variant_source(name, spec, backend))


def _half_tc_cases() -> Iterator[Case]:
    """Tensor-core variants of half layers no shared spec takes: wgrad_tc_nhwc_half (channels-last, whole
    64-channel boxes: a 3x3 layer of 64 channels, 128-row tiles over two taps, split; a 1x1 stride-2 one),
    dgrad_tc_paired_half (a 2x2/2 up-convolution: both column phases in one GEMM a row phase; NCHW: the
    phases' values of 4 pixels stored as one 16-byte run; dy read in place, MN-major: mn=1),
    dgrad_tc_strided_half's joined column phases (jn=1: DCGAN's 4x4/2, a tile parked in registers),
    tc_grouped_packed_half (groups of 4 channels packed 8 to a GEMM group, block-diagonal filters),
    tc_implicit_gemm_half's channels-last output staged as halves (eh=1: 16-byte stores) and
    depthwise_mma_wgrad (7x7 at stride 1, 5x5 at stride 2: its pair arrays of each phase) and
    wgrad_grouped_mma (groups of 4 at stride 1, of 16 at stride 2 with two images a block: two tile buffers)."""
    cases = {("wgrad_tc_nhwc_half", "3x3c64-nhwc"): "N=2,C=64,H=9,W=9,K=24,R=3,S=3,pad=1,pass=wgrad",
             ("dgrad_tc_paired_half", "2x2s2-nhwc"): "N=2,C=8,H=12,W=12,K=16,R=2,S=2,stride=2,pass=dgrad",
             ("dgrad_tc_paired_half", "2x2s2"): "N=2,C=8,H=16,W=16,K=16,R=2,S=2,stride=2,pass=dgrad,layout=nchw",
             ("dgrad_tc_paired_half", "2x2s2-mn"): "N=1,C=64,H=16,W=16,K=64,R=2,S=2,stride=2,pass=dgrad,layout=nchw",
             ("dgrad_tc_strided_half", "4x4s2-joined"):
                 "N=64,C=64,H=32,W=32,K=128,R=4,S=4,stride=2,pad=1,pass=dgrad,layout=nchw",
             ("wgrad_tc_nhwc_half", "1x1s2c128-nhwc"): "N=2,C=128,H=9,W=9,K=64,R=1,S=1,stride=2,pass=wgrad",
             ("tc_grouped_packed_half", "g16x4-nhwc"): "N=2,C=64,H=9,W=9,K=64,R=3,S=3,pad=1,groups=16",
             ("tc_implicit_gemm_half", "1x1c64-nhwc"): "N=2,C=64,H=9,W=9,K=128,R=1,S=1",
             ("depthwise_mma_wgrad", "dw7x7-nhwc"): "N=2,C=16,H=9,W=9,K=16,R=7,S=7,pad=3,groups=16,pass=wgrad",
             ("depthwise_mma_wgrad", "dw5x5s2-nhwc"):
                 "N=2,C=16,H=11,W=11,K=16,R=5,S=5,stride=2,pad=2,groups=16,pass=wgrad",
             ("wgrad_grouped_mma", "g4-nhwc"): "N=1,C=32,H=9,W=9,K=32,R=3,S=3,pad=1,groups=8,pass=wgrad",
             ("wgrad_grouped_mma", "g16s2-nhwc"): "N=4,C=32,H=10,W=10,K=32,R=3,S=3,stride=2,pad=1,groups=2,pass=wgrad"}
    for (name, tag), text in cases.items():
        spec = ConvSpec.parse(f"{text},dtype=fp16" + ("" if "layout=" in text else ",layout=nhwc"))
        label = tag if spec.conv_pass == "fprop" else f"{tag}-{spec.conv_pass}"
        yield Case(f"{name}.{label}.cuda", (_family(name), spec.dtype, spec.conv_pass, "cuda"),
                   _variant_source(name, spec, "cuda"))


def _stem_cases() -> Iterator[Case]:
    """The direct stems (kernels/tensorcore/sm90/stem.py) apply to no shared spec (3-channel layers): a 7x7/2
    half stem in NHWC and a 3x3 TF32 one in NCHW, both with bias and ReLU."""
    stems = {"tc_stem_direct_half": ("stem7x7s2-nhwc", "N=2,C=3,H=23,W=21,K=16,R=7,S=7,stride=2,pad=3,dtype=fp16,"
                                                       "layout=nhwc"),
             "tc_stem_direct_tf32": ("stem3x3", "N=2,C=3,H=11,W=11,K=8,R=3,S=3,pad=1")}
    for name, (tag, text) in sorted(stems.items()):
        spec = ConvSpec.parse(text)

        def make(name: str = name, spec: ConvSpec = spec) -> str:
            v = get_variant(name)
            return v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA, Epilogue(bias=True, relu=True)) \
                .source("cuda")
        yield Case(f"{name}.{tag}.cuda", (_family(name), spec.dtype, "fprop", "cuda"), make)


def _batchnorm_cases() -> Iterator[Case]:
    """Training batch norm (kernels/batchnorm.py): one kernel a pass (a block per channel) and three
    (channels split over blocks), float4 and scalar loads, the residual's masked-gradient store, no
    affine / no running statistics."""
    cases = {"bn-alone": dict(n=2, c=3, hw=36, relu=False, affine=False, track=False),
             "bn-relu": dict(n=2, c=3, hw=36), "bn-res-relu": dict(n=2, c=3, hw=35, residual=True),
             "bn-res-relu-split": dict(n=2, c=3, hw=36, residual=True)}  # each channel over 2 blocks
    for backend in ("cuda", "opencl"):
        for tag, kw in cases.items():
            def make(tag: str = tag, kw: dict = kw, backend: str = backend) -> str:
                from convforge.codegen.render import render
                from convforge.kernels.batchnorm import BnTrain, bn_program

                prog = bn_program(BnTrain(**kw), _device(backend), 2 if tag.endswith("split") else None)
                return render(list(prog.kernels), backend, f"batch norm (training) {tag}")
            yield Case(f"batchnorm_train.{tag}.{backend}", ("batchnorm_train", "float32", "train", backend), make)


def _bias_grad_cases() -> Iterator[Case]:
    """The bias gradient (kernels/wgrad/bias.py): the plain sum and the ReLU-masked one that writes the
    masked gradient (float4 and scalar loads), each channel over two slices."""
    cases = {"bias": ((2, 3, 6, 6), False), "bias-relu": ((2, 3, 6, 6), True), "bias-relu-odd": ((2, 3, 5, 7), True)}
    for backend in ("cuda", "opencl"):
        for tag, ((n, k, p, q), relu) in cases.items():
            def make(n: int = n, k: int = k, p: int = p, q: int = q, relu: bool = relu, backend: str = backend) -> str:
                from convforge.kernels.wgrad import bias_grad_plan
                from convforge.params import Params

                spec = ConvSpec.make(n, 1, p, q, k, 1, 1, conv_pass="wgrad")
                return bias_grad_plan(spec, _device(backend), Params(bt=64, sp=2), relu=relu).source(backend)
            yield Case(f"bias_grad.{tag}.{backend}", ("bias_grad", "float32", "wgrad", backend), make)


def _grad_rows_cases() -> Iterator[Case]:
    """The masked gradient written in the backward GEMMs' layouts (kernels/tensorcore/sm90/gradrows.py): an odd
    layer (N 3, K 5, P Q 37) into xh of 8 channels and dy' of 4 images, TF32 / 3xTF32 on CUDA, plain floats
    (the layouts PoCL tests) on OpenCL."""
    for tag, (backend, math) in {"tf32": ("cuda", "tf32"), "3xtf32": ("cuda", "3xtf32"),
                                 "float": ("opencl", None)}.items():
        def make(tag: str = tag, backend: str = backend, math: str | None = math) -> str:
            from convforge.codegen.render import render
            from convforge.kernels.tensorcore.sm90.gradrows import Rows, masked_rows
            from convforge.kernels.tensorcore.sm90.isa import MATHS

            m = MATHS[math] if math else None
            kernels, _, _ = masked_rows(3, 5, 37, Rows("fwd_xh", m, 8), Rows("dyt", m, 4))
            return render(list(kernels), backend, f"grad rows {tag}")
        yield Case(f"grad_rows.{tag}.{backend}", ("grad_rows", "float32", "dgrad", backend), make)


def _maxpool_cases() -> Iterator[Case]:
    """Training max pool (kernels/maxpool.py): ResNet's 3x3/2 pool on odd NCHW float32 planes, and a
    channels-last float16 one in ceil mode."""
    from convforge.kernels.maxpool import PoolTrain, source

    cases = {"3x3s2-nchw": PoolTrain(2, 3, 11, 13, 3, 3, 2, 2, 1, 1),
             "3x3s2-ceil-nhwc": PoolTrain(2, 5, 10, 9, 3, 3, 2, 2, 0, 0, True, "float16", "nhwc")}
    for backend in ("cuda", "opencl"):
        for tag, pt in cases.items():
            def make(pt: PoolTrain = pt, backend: str = backend) -> str:
                return source(pt, backend)
            yield Case(f"maxpool_train.{tag}.{backend}", ("maxpool_train", pt.dtype, "train", backend), make)


def _wcast_cases() -> Iterator[Case]:
    """A training block's filter casts (kernels/wcast.py): a channels-last 3x3 master (permuting) and a 1x1
    one (4 elements a thread)."""
    from convforge.kernels.wcast import WCast, source

    cases = {"3x3-cl-f16": WCast(5, 3, 3, 3, "float16", True), "1x1-bf16": WCast(8, 4, 1, 1, "bfloat16")}
    for backend in ("cuda", "opencl"):
        for tag, wc in cases.items():
            def make(wc: WCast = wc, backend: str = backend) -> str:
                return source(wc, backend)
            yield Case(f"wcast.{tag}.{backend}", ("wcast", wc.dtype, "train", backend), make)


def _se_cases() -> Iterator[Case]:
    """Squeeze-and-excitation in training (kernels/se.py): EfficientNet's (SiLU, sigmoid, float16 under
    autocast, float4 channels; NCHW planes) and MobileNet-v3's gate on odd channels in float32."""
    from convforge.kernels.se import SeTrain, source

    cases = {"silu-sigmoid-f16": SeTrain(2, 16, 9, 4, "silu", "sigmoid", "float16"),
             "relu-hardsigmoid-odd": SeTrain(2, 7, 5, 3, "relu", "hardsigmoid"),
             "silu-sigmoid-f16-nchw": SeTrain(2, 6, 36, 3, "silu", "sigmoid", "float16", layout="nchw")}
    for backend in ("cuda", "opencl"):
        for tag, se in cases.items():
            def make(se: SeTrain = se, backend: str = backend) -> str:
                return source(se, backend)
            yield Case(f"se_train.{tag}.{backend}", ("se_train", se.dtype, "train", backend), make)


def _layernorm_cases() -> Iterator[Case]:
    """Layer norm over rows (kernels/layernorm.py): ConvNeXt-T's first stage under autocast (half in and out,
    float32 parameters, float4 vectors, a group of 4 threads; with the training statistics) and odd rows in
    float32; the backward of both."""
    from convforge.kernels.layernorm import LayerNormGrad, LayerNormRows, grad_source, source

    cases = {"c96-f16": LayerNormRows(64, 96, 1e-6, "float16", "float16"), "c13-f32": LayerNormRows(5, 13),
             "c96-f16-stats": LayerNormRows(64, 96, 1e-6, "float16", "float16", stats=True)}
    grads = {"c96-f16": LayerNormGrad(640, 96, "float16", "float16"), "c13-f32": LayerNormGrad(1000, 13)}
    for backend in ("cuda", "opencl"):
        for tag, ln in cases.items():
            def make(ln: LayerNormRows = ln, backend: str = backend) -> str:
                return source(ln, backend)
            yield Case(f"layer_norm.{tag}.{backend}", ("layer_norm", ln.dtype, "fprop", backend), make)
        for tag, lg in grads.items():
            def make_grad(lg: LayerNormGrad = lg, backend: str = backend) -> str:
                return grad_source(lg, backend)
            yield Case(f"layer_norm_bwd.{tag}.{backend}", ("layer_norm", lg.dtype, "bwd", backend), make_grad)


def _all_cases() -> list[Case]:
    cases = [*_variant_cases(), *_half_cases(), *_prologue_cases(), *_full_transform_cases(),
             *_strided_dgrad_cases(), *_stem_cases(), *_half_tc_cases(), *_batchnorm_cases(), *_bias_grad_cases(),
             *_grad_rows_cases(), *_maxpool_cases(), *_wcast_cases(), *_se_cases(),
             *_layernorm_cases()]
    keys = [c.key for c in cases]
    assert len(keys) == len(set(keys)), "two snapshot cases share a key"
    return cases


CASES = _all_cases()
FULL = {next(c.key for c in CASES if c.group == g) for g in {c.group for c in CASES}}


def _digest(src: str) -> str:
    return hashlib.sha256(src.encode()).hexdigest()


@contextmanager
def _hash_table() -> Iterator[dict[str, str]]:
    """The hashes, read and (in update mode) written back under a lock: xdist workers share the file."""
    SNAP.mkdir(exist_ok=True)
    with open(Path(tempfile.gettempdir()) / "convforge-snapshots.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = json.loads(HASHES.read_text()) if HASHES.exists() else {}
        before = dict(table)
        yield table
        if table != before:
            tmp = HASHES.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(dict(sorted(table.items())), indent=0) + "\n")
            tmp.replace(HASHES)


def _show(key: str, src: str) -> Path:
    """Write a changed source where the failure message can point to it."""
    out = Path(tempfile.gettempdir()) / "convforge-snapshots" / f"{key}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(src)
    return out


HOW = "if intended, rerun with CONVFORGE_UPDATE_SNAPSHOTS=1 and review `git diff tests/snapshots`"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_generated_source_snapshot(case: Case) -> None:
    src = case.make()
    if dump := os.environ.get("CONVFORGE_SNAPSHOT_DUMP"):
        Path(dump).mkdir(parents=True, exist_ok=True)
        (Path(dump) / f"{case.key}.txt").write_text(src)
    path = SNAP / f"{case.key}.txt"
    if case.key in FULL:
        if UPDATE:
            path.write_text(src)
            with _hash_table() as table:
                table.pop(case.key, None)
        assert path.exists(), f"no snapshot {path.name}: {HOW}"
        assert src == path.read_text(), f"generated source of {case.key} changed (new: {_show(case.key, src)}); {HOW}"
        return
    if UPDATE:
        path.unlink(missing_ok=True)
    with _hash_table() as table:
        if UPDATE:
            table[case.key] = _digest(src)
        old = table.get(case.key)
    assert old is not None, f"no hash for {case.key} in {HASHES.name}: {HOW}"
    assert old == _digest(src), (f"generated source of {case.key} changed: sha256 {old[:12]} -> {_digest(src)[:12]} "
                                 f"(new: {_show(case.key, src)}; the old one: CONVFORGE_SNAPSHOT_DUMP on the commit "
                                 f"before); {HOW}")


def test_no_stale_snapshots() -> None:
    """Every kept text and hash belongs to a current case (update mode removes the others)."""
    keys = {c.key for c in CASES}
    with _hash_table() as table:
        stale_hashes = sorted(set(table) - (keys - FULL))
        if UPDATE:
            for key in stale_hashes:
                del table[key]
    stale_files = sorted(str(p.relative_to(SNAP))[:-4] for p in SNAP.rglob("*.txt"))
    stale_files = [key for key in stale_files if key not in FULL]
    if UPDATE:
        for key in stale_files:
            if key not in keys:  # a case moving between kinds is its own test's to rewrite
                (SNAP / f"{key}.txt").unlink()
        return
    assert not stale_hashes and not stale_files, \
        f"snapshots of no current case: {stale_files + stale_hashes}; rerun with CONVFORGE_UPDATE_SNAPSHOTS=1"
