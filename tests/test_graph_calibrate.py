"""Calibration (``convforge.error_budget``: the one rule; ``convforge.graph.network_calibration``: on networks).

Torch-free unit tests of the rule with injected error functions, then on PoCL a small network whose
fast per-layer choices are forced to Winograd F(4x4) through a temporary tuning database: its
output error exceeds the bound and calibration tightens layers until it is within it; the budget
option of ``compile`` and ``convforge run``; two calibrations choose the same."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from convforge import dispatch, kernels, tune
from convforge.config import config
from convforge.error_budget import CalibrationReport, Candidate, calibrate_layers, loosen, order, search_prefix
from convforge.graph.build import compile
from convforge.graph.ir import Graph, Node
from convforge.graph.network_calibration import calibrate_network, calibration_input, targets
from convforge.graph.passes import optimize
from convforge.graph.reference import run_reference
from convforge.graph.runtime import Network, conv_spec
from convforge.plan import Epilogue
from convforge.reference import rel_l2
from convforge.tune import Tuner
from convforge.tune.db import KEY_FIELDS, Entry, TuningDB, now
from helpers import run_main


def _cand(path: str, err: float, flops: int) -> Candidate:
    return Candidate(path, "fast", err, "acc", 1e-7, flops)


# -- the rule, torch-free -------------------------------------------------------------------------

@pytest.mark.parametrize("n,need", [(1, 1), (2, 2), (7, 3), (8, 8), (50, 17)])
def test_search_finds_the_smallest_meeting_prefix(n: int, need: int) -> None:
    errors = [10.0 - 9.0 * min(k, need) / need + 1e-9 * (n - k) for k in range(n + 1)]
    calls: list[int] = []
    bound = 1.0 + 1e-9 * (n - need)
    got = search_prefix(list(range(n)), lambda k: calls.append(k) or errors[k], bound)
    assert got.met and got.k == need and got.error == errors[need]
    assert len(calls) == len(set(calls)) <= 2 + math.ceil(math.log2(max(n, 2)))


def test_search_edge_cases() -> None:
    assert search_prefix("ab", [0.5, 0.1, 0.0].__getitem__, 1.0).k == 0
    never = search_prefix("abc", [9.0, 8.0, 7.0, 6.5].__getitem__, 1.0)
    assert (never.k, never.met, never.error) == (3, False, 6.5)
    assert search_prefix("abc", [math.nan, math.nan, 0.5, 0.4].__getitem__, 1.0).k == 2


def test_order_and_loosen() -> None:
    cands = [_cand("a", 1e-6, 10), _cand("b", 4e-6, 50), _cand("c", 4e-6, 20), _cand("d", 2e-6, 1)]
    assert [c.path for c in order(cands)] == ["c", "b", "d", "a"]
    share = {0: 5.0, 1: 0.2, 2: 0.3}
    three = [_cand("a", 4e-6, 10), _cand("b", 3e-6, 1000), _cand("c", 2e-6, 100)]
    kept, err, probes = loosen(three, lambda kept: 1.0 + sum(share[i] for i in range(3) if i not in kept), 1.45)
    assert kept == frozenset({0, 2}) and err == pytest.approx(1.2) and probes == 3


def test_calibrate_layers_leaves_the_final_setting_and_counts_forwards() -> None:
    """The model's error is 1 + the error each fast layer adds; the rule tightens the fewest layers
    that bring it within the aim, and its last call to error_with has the final set."""
    share = {"a": 3.0, "b": 0.05, "c": 2.0, "d": 0.01}
    cands = [_cand(p, e, f) for p, e, f in (("a", 4e-6, 10), ("b", 3e-6, 10), ("c", 2e-6, 10), ("d", 1e-6, 10))]
    seen: list[frozenset[str]] = []

    def error_with(paths: frozenset[str]) -> float:
        seen.append(paths)
        return 1.0 + sum(v for p, v in share.items() if p not in paths)

    rep = calibrate_layers(cands, error_with, error_before=1.0 + sum(share.values()), err_reference=1.0,
                           budget=1.2, headroom=1.0, reference="a stand-in")
    assert {c.path for c in rep.tightened} == {"a", "c"} and seen[-1] == {"a", "c"}
    assert rep.met and rep.error_after == pytest.approx(1.06) and rep.forwards == 1 + len(seen)
    assert "reference error 1.00e+00 (a stand-in)" in str(rep) and rep.bound == 1.2
    assert rep.as_dict()["tightened"][0]["path"] in ("a", "c")


def test_a_missed_bound_keeps_only_the_layers_that_help() -> None:
    """Every candidate tight still misses the aim (a floor of 2.0 no layer can lower): the model
    keeps the all-tight error within 5 % with the one layer that matters, not all four."""
    share = {"a": 3.0, "b": 0.01, "c": 0.02, "d": 0.01}
    cands = [_cand(p, e, f) for p, e, f in (("a", 4e-6, 10), ("b", 3e-6, 40), ("c", 2e-6, 30), ("d", 1e-6, 20))]

    def error_with(paths: frozenset[str]) -> float:
        return 2.0 + sum(v for p, v in share.items() if p not in paths)

    rep = calibrate_layers(cands, error_with, error_before=2.0 + sum(share.values()), err_reference=1.0,
                           budget=1.2, headroom=1.0)
    assert not rep.met and [c.path for c in rep.tightened] == ["a"]
    assert sorted(c.path for c in rep.loosened) == ["b", "c", "d"] and rep.error_after <= 2.0 * 1.05
    assert "bound NOT met" in str(rep) and "1 layer(s) kept tight, 3 returned" in str(rep)


def test_report_text_names_a_missed_bound() -> None:
    rep = CalibrationReport(2.0, 1e-6, 1e-7, 2e-7, 9e-7, 3e-7, 3, 2, [_cand("conv1", 4e-6, 10)], met=False,
                            skipped={"fc": "why"})
    text = str(rep)
    assert "conv1: fast (4.0e-06) -> acc (1.0e-07)" in text and "bound NOT met" in text
    assert "fc: not a candidate: why" in text and "PyTorch FP32" in text


@pytest.mark.parametrize("kw,match", [(dict(budget=0), r"budget \(0\) must be"), (dict(tight=-1.0), "tight"),
                                      (dict(headroom=1.5), "headroom")])
def test_bad_settings(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        calibrate_layers([], lambda p: 0.0, error_before=1.0, err_reference=1.0, **kw)


# -- networks on PoCL -----------------------------------------------------------------------------

def _graph() -> Graph:
    """Five 3x3 convs (bias, ReLU but the last) on 16x16: F(4x4) where the database says so."""
    rng = np.random.default_rng(0)
    chans = [3, 24, 32, 32, 24, 16]
    nodes, weights, src = [], {}, "x"
    for i in range(5):
        weights[f"w{i}"] = (rng.standard_normal((chans[i + 1], chans[i], 3, 3)) / np.sqrt(9 * chans[i])).astype(
            np.float32)
        weights[f"b{i}"] = (0.1 * rng.standard_normal(chans[i + 1])).astype(np.float32)
        nodes.append(Node(f"conv{i}", "conv", [src], f"c{i}", {"k": chans[i + 1], "kernel": 3, "pad": 1,
                                                                "relu": i < 4}, {"w": f"w{i}", "bias": f"b{i}"}))
        src = f"c{i}"
    return optimize(Graph("small", "x", (1, 3, 16, 16), nodes, [src], weights))


FAST = "winograd_nonfused_f4"


@pytest.fixture
def forced(ocl: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A temporary database whose fp32 entries give every conv of ``_graph()`` F(4x4) (with a
    measured error of 3e-6); choices forgotten before and after."""
    monkeypatch.setattr(config, "db_path", tmp_path / "forced.sqlite")
    monkeypatch.setattr(config, "autotune", False)
    tune.clear_choices()
    dispatch.clear_choices()
    g = _graph()
    db = TuningDB(config.db_path)
    shapes = Network(g, ocl, capture=False).shapes
    v = kernels.get_variant(FAST)
    for node in g.nodes:
        spec = conv_spec(node, shapes[node.inputs[0]])
        key = dict(zip(KEY_FIELDS, Tuner(ocl, db).key(spec, Epilogue(True, bool(node.attrs.get("relu"))), "fp32"),
                       strict=True))
        db.put(Entry(**key, version="test", variant=FAST, params=v.default(spec, ocl.device).to_json(), time_ms=1.0,
                     workspace=0, error=3e-6, date=now()))
    db.close()
    tune.clear_choices()
    dispatch.clear_choices()
    yield g
    tune.clear_choices()
    dispatch.clear_choices()


def _error(net: Network, g: Graph, seed: int = 0) -> float:
    x = calibration_input(g, seed)
    want = run_reference(g.with_batch(1), x[:1])
    out = net(x)
    return rel_l2(np.concatenate([out[t][:1].ravel() for t in targets(g)]),
                  np.concatenate([want[t].ravel() for t in targets(g)]))


def test_fast_f4_layers_exceed_the_bound_and_calibration_tightens_until_within(ocl: Any, forced: Graph) -> None:
    g = forced
    loose = calibrate_network(g, ocl, budget=1e6)  # nothing to do: the fast error and the reference's
    assert not loose.report.tightened and loose.report.forwards == 1
    assert all(s.variant.startswith(FAST) for s in loose.network.steps)
    e_fast, ref = loose.report.error_before, loose.report.err_pytorch
    all_tight = Network(g, ocl, capture=False, max_errors={n.name: 1e-6 for n in g.nodes})
    e_tight = _error(all_tight, g)
    assert e_tight < e_fast / 2 < e_fast and e_fast == _error(loose.network, g)
    budget = (e_fast + e_tight) / 2 / (0.95 * ref)  # F(4x4) everywhere misses it, everything tight meets it
    cal = calibrate_network(g, ocl, budget=budget)
    rep = cal.report
    assert rep.error_before == e_fast > rep.aim and rep.met and rep.error_after <= rep.aim
    assert 1 <= len(rep.tightened) <= 5 and set(cal.max_errors) == {c.path for c in rep.tightened}
    steps = {s.node: s.variant for s in cal.network.steps}
    for c in rep.tightened:
        assert c.fast == FAST and c.fast_measured and not steps[c.path].startswith(FAST), (c, steps)
    assert all(steps[n.name].startswith(FAST) for n in g.nodes if n.name not in cal.max_errors)
    assert _error(cal.network, g) == rep.error_after  # the network returned is the final setting's
    assert rep.forwards <= 2 + 1 + math.ceil(math.log2(5)) + len(rep.tightened) + len(rep.loosened) + 1
    # the same calibration again chooses the same layers and computes the same output
    again = calibrate_network(g, ocl, budget=budget)
    assert [c.path for c in again.report.tightened] == [c.path for c in rep.tightened]
    x = calibration_input(g, 5)
    a, b = cal.network(x), again.network(x)
    assert all(np.array_equal(a[t], b[t]) for t in a)


def test_compile_calibrates_by_default_and_the_budget_changes_it(ocl: Any, forced: Graph) -> None:
    g = forced
    net = compile(g, backend="opencl")
    assert net.calibration is not None and net.calibration.budget == 2.0
    assert net.calibration.error_after <= net.calibration.aim or not net.calibration.met
    off = compile(g, backend="opencl", error_budget=0)
    assert off.calibration is None and all(s.variant.startswith(FAST) for s in off.steps)
    assert compile(g, backend="opencl", error_budget=None).calibration is None
    for bad in (-1, math.inf, "2", True):
        with pytest.raises(ValueError, match="error_budget"):
            compile(g, backend="opencl", error_budget=bad)


def test_a_softmax_output_is_calibrated_through_its_logits(ocl: Any) -> None:
    g = _graph()
    g.nodes.append(Node("prob", "softmax", [g.outputs[0]], "prob"))
    g.outputs = ["prob"]
    assert targets(g) == [g.nodes[-2].output]
    net = compile(g, backend="opencl")
    assert net.graph.outputs == ["prob"] and set(net(calibration_input(g, 1))) == {"prob"}


SMALL = """
name: "tiny"
input: "data"
input_dim: 1 input_dim: 3 input_dim: 12 input_dim: 12
layer { name: "a" type: "Convolution" bottom: "data" top: "a"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "ra" type: "ReLU" bottom: "a" top: "a" }
layer { name: "b" type: "Convolution" bottom: "a" top: "b" convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
"""


def test_run_prints_what_calibration_did_and_the_budget_option(ocl: Any, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.prototxt"
    path.write_text(SMALL)
    base = ["run", "--net", str(path), "--backend", "opencl", "--repeats", "1", "--no-torch"]
    rc, out = run_main([*base, "--out", str(tmp_path / "a")], capsys)
    assert rc == 0 and "calibration (budget 2x): tightened" in out and "forward(s) of the network" in out
    res = json.loads((tmp_path / "a" / "run-tiny-n1-opencl.json").read_text())
    assert res["error_budget"] == 2.0 and res["tightened"] == [] and res["calibration"]["budget"] == 2.0
    rc, out = run_main([*base, "--error-budget", "0", "--out", str(tmp_path / "b")], capsys)
    assert rc == 0 and "calibrat" not in out
    res = json.loads((tmp_path / "b" / "run-tiny-n1-opencl.json").read_text())
    assert res["error_budget"] is None and "calibration" not in res
    rc, out = run_main([*base, "--error-budget", "-1"], capsys)
    assert rc == 2 and "--error-budget (-1.0) must be a finite number > 0" in out


def test_one_sign_choices_are_tightened_first():
    """3xTF32's truncating sums give errors of one sign that add up over a network: its layers come
    before a larger stated error that averages out (Winograd), each group by error, then FLOPs."""
    from convforge.error_budget import Candidate, order

    cands = [Candidate("wino", "winograd_nonfused_f4", 3e-6, "implicit_gemm", 5e-7, 10),
             Candidate("x3a", "tc_implicit_gemm_3xtf32", 1e-6, "gemm1x1", 5e-7, 20),
             Candidate("x3b", "gemm1x1/tc_implicit_gemm_3xtf32", 1e-6, "gemm1x1", 5e-7, 5),
             Candidate("w2", "winograd_nonfused_f2", 7e-7, "implicit_gemm", 5e-7, 1)]
    assert [c.path for c in order(cands)] == ["x3b", "x3a", "wino", "w2"]
