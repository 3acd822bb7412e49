"""``convforge.torch.calibrate`` on the CPU (torch present; skipped with a reason otherwise).

The search (``search_prefix``) is tested with injected error functions standing in for the
forward: monotone cases, already met, never met, k minimal, probes counted. The candidate
ordering, the wiring from module choices to candidates and settings (``cf_choice`` replaced by a
stand-in: choosing needs a CUDA device), ``set_max_error`` and the argument errors are tested
too. The whole calibration on a GPU is in tests/test_gpu_calibrate.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: convforge.torch.calibrate tests skipped")
nn = torch.nn

import convforge.torch as ct  # noqa: E402
from convforge.spec import ConvSpec  # noqa: E402
from convforge.torch import model_calibration as cal  # noqa: E402


def _counting(errors: list[float]):
    calls: list[int] = []

    def error_of(k: int) -> float:
        calls.append(k)
        return errors[k]

    return error_of, calls


@pytest.mark.parametrize("n,need", [(1, 1), (2, 1), (2, 2), (7, 3), (8, 1), (8, 8), (50, 17), (64, 63)])
def test_search_finds_the_smallest_meeting_prefix(n, need):
    errors = [10.0 - 9.0 * min(k, need) / need for k in range(n + 1)]  # falls to 1.0 at k = need, flat after
    errors = [e + 1e-9 * (n - k) for k, e in enumerate(errors)]  # strictly decreasing
    error_of, calls = _counting(errors)
    got = cal.search_prefix(list(range(n)), error_of, bound=1.0 + 1e-9 * (n - need))
    assert got.met and got.k == need
    assert got.error == errors[need]
    assert all(errors[k] > 1.0 + 1e-9 * (n - need) for k in range(need))  # every smaller k misses
    assert len(calls) == len(set(calls)) <= 2 + math.ceil(math.log2(max(n, 2)))
    assert got.probes == {k: errors[k] for k in calls}


def test_search_with_a_bound_already_met_probes_once():
    error_of, calls = _counting([0.5, 0.1, 0.0])
    got = cal.search_prefix(["a", "b"], error_of, 1.0)
    assert (got.k, got.met, got.error, calls) == (0, True, 0.5, [0])


def test_search_never_met_leaves_all_tight():
    error_of, calls = _counting([9.0, 8.0, 7.0, 6.5])
    got = cal.search_prefix("abc", error_of, 1.0)
    assert (got.k, got.met, got.error, calls) == (3, False, 6.5, [0, 3])


def test_search_without_candidates_and_a_missed_bound():
    error_of, calls = _counting([3.0])
    got = cal.search_prefix([], error_of, 1.0)
    assert (got.k, got.met, calls) == (0, False, [0])


def test_search_treats_nan_as_a_miss():
    error_of, _ = _counting([math.nan, math.nan, 0.5, 0.4])
    got = cal.search_prefix("abc", error_of, 1.0)
    assert (got.k, got.met) == (2, True)


def test_search_exact_bound_counts_as_met():
    error_of, _ = _counting([2.0, 1.0, 0.5])
    assert cal.search_prefix("ab", error_of, 1.0).k == 1


def _cand(path: str, err: float, flops: int) -> cal.Candidate:
    return cal.Candidate(path, "fast", err, "acc", 1e-7, flops)


def test_order_puts_the_largest_stated_error_first_then_the_cheaper_layer():
    cands = [_cand("a", 1e-6, 10), _cand("b", 4e-6, 50), _cand("c", 4e-6, 20), _cand("d", 2e-6, 1)]
    assert [c.path for c in cal.order(cands)] == ["c", "b", "d", "a"]


# --- the wiring, with cf_choice replaced (choosing needs a CUDA device) ---------------------------------

class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 1)
        self.d = nn.Conv2d(8, 8, 5, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(x))))


def _cf(net: Net) -> Net:
    """``net`` with convforge Conv2d modules (convert() leaves CPU parameters to PyTorch)."""
    for name in "abcd":
        setattr(net, name, ct.Conv2d.from_module(getattr(net, name)))
    return net


FAST = {"a": 4e-6, "b": 4e-6, "c": 5e-7, "d": 2e-6}  # stated; c: the same variant either way
MEASURED: dict[str, float] = {}  # the fast choices' errors measured by the tuning database


def _fake_choice(self, x_shape, device, max_error):
    spec = ConvSpec.from_shapes(tuple(x_shape), tuple(self.weight.shape), (1, 1), ct.modules.padding_quad(self),
                                (1, 1))
    name = self.tag
    err = FAST[name] if max_error is None or max_error >= FAST[name] else 1e-7
    variant = SimpleNamespace(name=f"{name}-{'fast' if err == FAST[name] else 'acc'}", expected_error=lambda s: err)
    measured = MEASURED.get(name) if err == FAST[name] else None
    return spec, SimpleNamespace(variant=variant, params=None, error=measured)


def test_candidates_order_and_apply_follow_the_module_choices(monkeypatch):
    monkeypatch.setattr(ct.Conv2d, "cf_choice", _fake_choice)
    net = _cf(Net())
    mods = {p: m for p, m in net.named_modules() if isinstance(m, ct.Conv2d)}
    for p, m in mods.items():
        m.tag = p
    shapes = {"a": {(2, 3, 9, 9)}, "b": {(2, 8, 9, 9)}, "c": {(2, 8, 9, 9)}, "d": set()}  # d never called
    cands, skipped = cal._candidates(mods, shapes, 0, 1e-6)
    cands = cal.order(cands)
    assert [c.path for c in cands] == ["a", "b"]  # a has fewer FLOPs (C=3) than b at the same stated error
    assert (cands[0].fast, cands[0].accurate, cands[0].fast_error, cands[0].fast_measured) == (
        "a-fast", "a-acc", 4e-6, False)
    assert skipped == {}
    mods["b"]._cf_cache[("stale",)] = object()
    fast = {p: m.max_error for p, m in mods.items()}
    cal._apply(mods, cands, fast, 1e-6, 1)
    assert [mods[p].max_error for p in "abcd"] == [1e-6, None, None, None]
    assert ("stale",) in mods["b"]._cf_cache  # unchanged modules keep their runners
    cal._apply(mods, cands, fast, 1e-6, 2)
    assert mods["b"].max_error == 1e-6 and mods["b"]._cf_cache == {}
    cal._apply(mods, cands, fast, 1e-6, 0)
    assert [mods[p].max_error for p in "abcd"] == [None] * 4


def test_measured_errors_order_before_stated_ones(monkeypatch):
    """A database-measured error (here d's 9e-6 against its stated 2e-6) is the better evidence."""
    monkeypatch.setattr(ct.Conv2d, "cf_choice", _fake_choice)
    monkeypatch.setitem(MEASURED, "d", 9e-6)
    net = _cf(Net())
    mods = {p: m for p, m in net.named_modules() if isinstance(m, ct.Conv2d)}
    for p, m in mods.items():
        m.tag = p
    cands, _ = cal._candidates(mods, {p: {(1, 3 if p == "a" else 8, 5, 5)} for p in mods}, 0, 1e-6)
    got = cal.order(cands)
    assert [(c.path, c.fast_error, c.fast_measured) for c in got] == [
        ("d", 9e-6, True), ("a", 4e-6, False), ("b", 4e-6, False)]
    rep = cal.CalibrationReport(2.0, 1e-6, 1e-7, 2e-7, 9e-7, 1e-7, 3, 3, got[:1])
    assert "d: d-fast (9.0e-06 measured) -> d-acc (1.0e-07)" in str(rep)


def test_a_layer_without_a_tight_variant_is_skipped_with_the_reason(monkeypatch):
    def choice(self, x_shape, device, max_error):
        return None if max_error == 1e-6 and self.tag == "b" else _fake_choice(self, x_shape, device, max_error)

    monkeypatch.setattr(ct.Conv2d, "cf_choice", choice)
    net = _cf(Net())
    mods = {p: m for p, m in net.named_modules() if isinstance(m, ct.Conv2d)}
    for p, m in mods.items():
        m.tag = p
    cands, skipped = cal._candidates(mods, {p: {(1, 3 if p == "a" else 8, 5, 5)} for p in mods}, 0, 1e-6)
    assert [c.path for c in cands] == ["a", "d"]
    assert "max_error=1e-06" in skipped["b"]


def test_set_max_error_validates_and_drops_the_runners():
    m = ct.Conv2d(3, 4, 3)
    m._cf_cache[("x",)] = object()
    m.set_max_error(1e-6)
    assert m.max_error == 1e-6 and m._cf_cache == {}
    m.set_max_error(None)
    assert m.max_error is None
    with pytest.raises(ValueError, match=r"max_error \(-1\) must be > 0"):
        m.set_max_error(-1)


def test_report_text_names_what_moved_and_a_missed_bound():
    rep = cal.CalibrationReport(2.0, 1e-6, 1e-7, 2e-7, 9e-7, 3e-7, 3, 2, [_cand("layer1.0.conv1", 4e-6, 10)],
                                met=False, skipped={"fc": "why"})
    text = str(rep)
    assert "layer1.0.conv1: fast (4.0e-06) -> acc (1.0e-07)" in text
    assert "bound NOT met" in text and "stays all-tight" in text and "fc: not a candidate: why" in text
    assert rep.as_dict()["tightened"][0]["path"] == "layer1.0.conv1"


# --- argument errors ---------------------------------------------------------------------------------

def _pair():
    ref = Net().eval()
    model = Net().eval()
    model.load_state_dict(ref.state_dict())
    return _cf(model), ref


@pytest.mark.parametrize("kw,match", [
    (dict(budget=0), r"budget \(0\) must be a finite number > 0"),
    (dict(budget=-2.0), r"budget \(-2.0\) must be"),
    (dict(budget=math.inf), r"budget \(inf\) must be"),
    (dict(budget="2"), r"budget \('2'\) must be"),
    (dict(tight=0.0), r"tight \(0.0\) must be"),
])
def test_bad_numbers(kw, match):
    model, ref = _pair()
    with pytest.raises(ValueError, match=match):
        ct.calibrate(model, ref, torch.zeros(1, 3, 8, 8), **kw)


def test_bad_models_and_examples():
    model, ref = _pair()
    x = torch.zeros(1, 3, 8, 8)
    with pytest.raises(ValueError, match="no convforge modules"):
        ct.calibrate(Net().eval(), ref, x)
    with pytest.raises(ValueError, match="reference has convforge modules"):
        ct.calibrate(model, model, x)
    with pytest.raises(ValueError, match="model is in training mode"):
        ct.calibrate(model.train(), ref, x)
    model.eval()
    with pytest.raises(ValueError, match="reference must be a torch.nn.Module, not str"):
        ct.calibrate(model, "resnet", x)
    with pytest.raises(ValueError, match="example must be a CUDA float32 tensor, not a cpu float32 tensor"):
        ct.calibrate(model, ref, x)
    with pytest.raises(ValueError, match="not a cpu float64 tensor"):
        ct.calibrate(model, ref, x.double())
    with pytest.raises(ValueError, match="not list"):
        ct.calibrate(model, ref, [x])


def test_loosen_returns_the_layers_the_bound_does_not_need_biggest_first():
    """Layers whose error share is small go back to fast; the order tried is FLOPs descending, and
    the answer's error is the one measured with exactly the kept set."""
    cands = [_cand("a", 4e-6, 10), _cand("b", 3e-6, 1000), _cand("c", 2e-6, 100)]
    share = {0: 5.0, 1: 0.2, 2: 0.3}  # error each layer adds when fast
    tried: list[frozenset[int]] = []

    def error_of(kept: frozenset[int]) -> float:
        tried.append(kept)
        return 1.0 + sum(share[i] for i in range(3) if i not in kept)

    kept, err, probes = cal.loosen(cands, error_of, bound=1.45)
    assert [sorted(set(range(3)) - t) for t in tried] == [[1], [1, 2], [0, 1]]  # b (1000), then c, then a
    assert kept == frozenset({0, 2}) and err == pytest.approx(1.2) and probes == 3


def test_loosen_refusing_everything_keeps_all_and_reports_no_error():
    kept, err, probes = cal.loosen([_cand("a", 1e-6, 1), _cand("b", 1e-6, 2)], lambda kept: 9.0, bound=1.0)
    assert kept == frozenset({0, 1}) and err is None and probes == 2


@pytest.mark.parametrize("headroom", [0, 1.5, -0.1, True, "0.9"])
def test_headroom_outside_0_1_is_refused(headroom):
    model, ref = _pair()
    with pytest.raises(ValueError, match=r"headroom .* must be a number in \(0, 1\]"):
        ct.calibrate(model, ref, torch.zeros(1, 3, 8, 8), headroom=headroom)
