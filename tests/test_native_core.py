"""native_core.h, the part of the native fast paths (torch/native.cpp, backends/cupy_native.cpp)
that launches a program, against the Python fast path (backends/cuda.py ``launch_raw``) on the
same executable. CPU only: ``tests/native/core_probe.cpp`` includes the core, reads a program as
the native paths do (``CudaExecutable.native_program``) and launches it through a recording
driver; the Python path runs on a stub of CuPy with a recording driver too. Both must make the
same launches with the same bytes: pointers, scalars and each TMA tensor map (its encode arguments
and the buffer it is encoded over, again only when that buffer moves). Skips (with the reason)
without a C++ compiler."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from convforge.codegen.dialect import TensorMap
from convforge.kernels import all_variants
from convforge.spec import ConvSpec
from test_torch import _FakeBackend, _stubbed_cuda_module

PROBE = Path(__file__).resolve().parent / "native" / "core_probe.cpp"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    from convforge.backends import native

    try:
        cxx = native.compiler()
    except RuntimeError as err:
        pytest.skip(f"native core probe: {err}")
    out = tmp_path_factory.mktemp("probe") / "core_probe.so"
    cmd = [cxx, *native.base_flags(), str(PROBE), "-o", str(out), "-ldl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return native.import_extension("core_probe", out)


class _Lib:
    """The two encoders of libcuda, recording (address, encode arguments) and writing the map the
    probe's fakes write: the address, then a count."""

    def __init__(self, log):
        self.log, self.count = log, 0

    def _stamp(self, at, address):
        self.count += 1
        ctypes.memset(at.value, 0, 128)
        ctypes.c_uint64.from_address(at.value).value = address.value
        ctypes.c_uint64.from_address(at.value + 8).value = self.count

    def cuTensorMapEncodeTiled(self, at, dtype, rank, address, dims, strides, box, elem, il, sw, l2, oob):  # noqa: N802
        self._stamp(at, address)
        self.log.append(("encode", address.value, dtype, rank, False, tuple(dims), tuple(strides)[:rank - 1],
                         tuple(box), tuple(elem), (), (il, sw, l2, oob)))
        return 0

    def cuTensorMapEncodeIm2col(self, at, dtype, rank, address, dims, strides, lower, upper, cpp, ppc, elem,  # noqa: N802
                                il, sw, l2, oob):
        self._stamp(at, address)
        self.log.append(("encode", address.value, dtype, rank, True, tuple(dims), tuple(strides)[:rank - 1],
                         (cpp.value, ppc.value), tuple(elem), (tuple(lower), tuple(upper)), (il, sw, l2, oob)))
        return 0


def _python_path(mod, calls, exe, slot_lists, steps):
    """The records the Python fast path makes: each launch's arguments (a map's 128 bytes)."""
    log = []
    mod._DRIVER.lib = _Lib(log)
    mod._TMAPS.clear()
    for entry in exe._maps:  # nothing encoded yet, as in the probe's fresh program
        entry[4] = 0
    for slots in slot_lists:
        x, w, y, bias, res, *derived = slots
        calls.clear()
        exe.launch_raw(x, w, y, bias, 77, derived[0] - exe._offsets[0] if steps != "all" else 0, steps, res)
        for fn, gx, gy, gz, bx, by, bz, smem, stream, params, _extra in calls:
            head, args = exe._layouts[params], []
            cells = (ctypes.c_void_p * len(head)).from_address(params)
            for i, (kind, _) in enumerate(head):
                if kind == 3:
                    args.append(("map", ctypes.string_at(cells[i], 128), cells[i] % 64 == 0))
                else:
                    args.append(ctypes.c_uint64.from_address(cells[i]).value if kind != 2
                                else ctypes.c_uint32.from_address(cells[i]).value)
            log.append(("launch", fn, (gx, gy, gz), (bx, by, bz), smem, stream, tuple(args)))
    return log


def _normal(records):
    """Scalars compared by their 32 bits (the probe reads every non-map cell as 64 bits, whose
    upper half is zero for a scalar); encode counts dropped from the maps (each path counts its own)."""
    out = []
    for rec in records:
        if rec[0] == "launch":
            args = tuple(("map", a[1][:8], a[2]) if isinstance(a, tuple) else a & 0xFFFFFFFFFFFFFFFF for a in rec[6])
            out.append((*rec[:6], args))
        else:
            out.append(rec)
    return out


CASES = [("tc_implicit_gemm_tf32", ConvSpec.make(2, 64, 14, 14, 64, 3, 3, 1, 1)),  # NCHW: x converted, a workspace map
         ("tc_implicit_gemm_3xtf32", ConvSpec.make(3, 32, 9, 11, 96, 3, 3, 2, (1, 0, 2, 1))),
         ("tc_implicit_gemm_tf32", ConvSpec.make(1, 64, 7, 7, 128, 1, 1)),
         ("dgrad_tc_strided_tf32", ConvSpec.make(4, 64, 15, 15, 64, 3, 3, 2, 1, conv_pass="dgrad"))]  # 4 phases


@pytest.mark.parametrize(("name", "spec"), CASES, ids=lambda c: c if isinstance(c, str) else c.key())
def test_native_core_launches_tensor_maps_as_the_python_path(monkeypatch, probe, name, spec):
    from conftest import NOMINAL_CUDA

    mod, calls, _ = _stubbed_cuda_module(monkeypatch)
    v = next(v for v in all_variants() if v.name == name)
    plan = v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA)
    assert any(isinstance(a, TensorMap) for k in plan.kernels for a in k.args), "the default takes TMA here"
    exe = mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), plan)
    assert exe.fast and exe.native and exe.derived
    exe.reserve(0)
    program = exe.native_program()
    base = 0x7F0000000000
    first = (0x1000, 0x2000, 0x3000, 0x4000, 0, *[base + off for off in exe._offsets])
    moved = (0x11000, 0x2000, 0x13000, 0x4000, 0, *[base + 0x100000 + off for off in exe._offsets])
    slot_lists = [first, first, moved, first]  # the second call encodes nothing; a moved buffer re-encodes
    own = list(program[4])  # "all" runs on the executable's own filter-derived buffers
    for steps in ("all", "rest", "weights") if exe.derived else ("all",):
        slots = [(*s[:5], *own) for s in slot_lists] if steps == "all" else slot_lists
        got = _normal(probe.run(program, slots, steps))
        want = _normal(_python_path(mod, calls, exe, slots, steps))
        assert [r for r in got if r[0] == "launch"] == [r for r in want if r[0] == "launch"], steps
        # the same encodings (Python encodes every map of the executable before its first launch;
        # the core, those of the launches it makes, before each)
        enc_got, enc_want = ({r for r in recs if r[0] == "encode"} for recs in (got, want))
        assert enc_got <= enc_want and (enc_got == enc_want or steps != "all"), steps
        maps = [a for r in got if r[0] == "launch" for a in r[6] if isinstance(a, tuple)]
        assert (maps or steps == "weights") and all(a for _, _, a in maps), "each map at a 64-byte-aligned address"
    def encodes(*slot_lists):  # the packed filters given by the caller (the filter cache's buffer): "rest"
        return sum(r[0] == "encode" for r in probe.run(program, list(slot_lists), "rest"))

    assert encodes(first) == encodes(first, first) > 0, "an unmoved buffer is not encoded again"
    assert encodes(first, moved) > encodes(first), "a moved one is"


def test_a_program_with_maps_is_refused_when_malformed(probe, monkeypatch):
    """A tensor-map argument the core cannot read makes the program malformed (ValueError), never a
    launch with a map of garbage."""
    from conftest import NOMINAL_CUDA

    mod, _, _ = _stubbed_cuda_module(monkeypatch)
    name, spec = CASES[0]
    v = next(v for v in all_variants() if v.name == name)
    exe = mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA))
    exe.reserve(0)
    program = list(exe.native_program())
    launches = [list(launch) for launch in program[0]]
    for launch in launches:
        launch[8] = tuple((k, v[:9] if k == 3 else v) for k, v in launch[8])  # a map description cut short
    program[0] = [tuple(launch) for launch in launches]
    with pytest.raises(ValueError, match="malformed"):
        probe.run(tuple(program), [(0, 0, 0, 0, 0)], "all")


def test_native_limits_are_the_cores(monkeypatch):
    """CudaExecutable.native admits only launches that fit native_core.h's fixed arrays: the two
    limits are the header's, and an executable over them stays on the Python fast path."""
    import re

    from conftest import NOMINAL_CUDA
    from convforge.backends import native

    core = native.CORE.read_text()
    mod, _, _ = _stubbed_cuda_module(monkeypatch)
    assert int(re.search(r"kMaxArgs = (\d+)", core).group(1)) == mod.NATIVE_MAX_ARGS
    assert int(re.search(r"kMaxMaps = (\d+)", core).group(1)) == mod.NATIVE_MAX_MAPS
    name, spec = CASES[0]
    v = next(v for v in all_variants() if v.name == name)
    exe = mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA))
    assert exe.native
    monkeypatch.setattr(mod, "NATIVE_MAX_MAPS", 1)
    assert not exe.native and exe.fast
    monkeypatch.undo()
    mod, _, _ = _stubbed_cuda_module(monkeypatch)  # 16 phases x 2 operands x 2 parts: 64 maps, 80 arguments
    spec = ConvSpec.make(8, 64, 33, 33, 64, 5, 5, 4, 2, conv_pass="dgrad")
    v = next(v for v in all_variants() if v.name == "dgrad_tc_strided_3xtf32")
    exe = mod.CudaExecutable(_FakeBackend(NOMINAL_CUDA), v.plan(spec, v.default(spec, NOMINAL_CUDA), NOMINAL_CUDA))
    assert exe.fast and not exe.native
