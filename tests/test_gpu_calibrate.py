"""GPU tier of ``convforge.torch.calibrate`` and ``bench --model --error-budget`` (skips without a
CUDA device or torch).

Run on the lent GPU: ``python -m pytest -q tests/test_gpu_calibrate.py``. A small ResNet-like model
(64-channel 3x3 convs, where the fp32 class takes Winograd) is fused and calibrated: with budget 2
its output error on a FRESH input is within the bound (with 1.5x slack: the bound is met on the
calibration input, a fresh one may differ a little), the modules the report lists run their
accurate variant and the others their own; a budget below the all-fast error forces layers to
move; the report's error_after is what the model now computes.
"""

from __future__ import annotations

import copy
import math

import pytest

from convforge.error_budget import TIGHT

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="GPU tier of convforge.torch.calibrate: torch not installed")
nn = torch.nn


class Basic(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.c1(x)))
        return torch.relu(self.bn2(self.c2(out)) + x)


def _model(c: int = 64, blocks: int = 4) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), *[Basic(c) for _ in range(blocks)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                m.weight.normal_(0.0, math.sqrt(2.0 / m.weight[0].numel()))
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.0)
                m.bias.normal_(0.0, 0.1)
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.8, 1.5)
    return model.cuda().eval()


def _x(seed: int) -> torch.Tensor:
    return torch.randn(8, 3, 28, 28, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))


def _errors(fused: nn.Module, model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """(convforge's, PyTorch FP32's) relative L2 error against float64 on ``x``, TF32 off."""
    from convforge.torch.model_calibration import _tf32

    with torch.no_grad(), _tf32(False):
        want = copy.deepcopy(model).double()(x.double())
        mine, theirs = fused(x), model(x)
    assert not torch.isnan(mine).any()
    return float((mine.double() - want).norm() / want.norm()), float((theirs.double() - want).norm() / want.norm())


def _runs(m) -> set[str]:
    """The variants of the plans a fused module ran since its caches were last dropped."""
    return {v[0].exe.plan.variant for k, v in m._cf_cache.items() if k[0] == "fused" and v is not None}


def _check_settings(fused: nn.Module, report, tight: float) -> None:
    import convforge.torch as ct

    moved = {c.path: c for c in report.tightened}
    for path, m in fused.named_modules():
        if isinstance(m, ct.Conv2d):
            assert m.max_error == (tight if path in moved else None), path
            if path in moved and isinstance(m, ct.FusedConv2d):
                assert _runs(m) == {moved[path].accurate}, (path, _runs(m), moved[path])


def test_budget_2_is_met_on_a_fresh_input(gpu) -> None:
    import convforge.torch as ct

    model = _model()
    fused, _ = ct.fuse(model)
    torch.backends.cudnn.allow_tf32 = True  # calibrate must turn it off and restore it
    report = ct.calibrate(fused, model, _x(1), budget=2.0)
    assert torch.backends.cudnn.allow_tf32 is True
    torch.backends.cudnn.allow_tf32 = False
    print(report)
    assert report.met, str(report)
    assert report.error_after <= report.aim == pytest.approx(0.95 * report.bound)
    assert report.bound == 2.0 * report.err_pytorch
    mine, theirs = _errors(fused, model, _x(2))  # a fresh input
    assert mine <= 1.5 * 2.0 * theirs, (mine, theirs, str(report))
    _check_settings(fused, report, TIGHT)


def test_a_budget_under_the_fast_error_moves_layers(gpu) -> None:
    import convforge.torch as ct

    model = _model()
    fused, _ = ct.fuse(model)
    x = _x(1)
    loose = ct.calibrate(fused, model, x, budget=1e6)
    assert (loose.forwards, loose.tightened, loose.met) == (1, [], True)
    assert loose.candidates > 0, f"no layer's choice moves under max_error={TIGHT:g}: nothing to calibrate\n{loose}"
    budget = 0.7 * loose.error_before / loose.err_pytorch
    report = ct.calibrate(fused, model, x, budget=budget)
    print(report)
    assert report.error_before == pytest.approx(loose.error_before, rel=1e-3)
    assert report.tightened, str(report)
    assert all(c.accurate != c.fast for c in report.tightened)
    if report.met:
        assert report.error_after <= report.bound
    else:
        assert len(report.tightened) == report.candidates and "NOT met" in str(report)
    assert report.forwards <= 4 + math.ceil(math.log2(report.candidates + 1)) + len(report.tightened) + len(
        report.loosened)  # the prefix search, one trial per layer it tightened, a final forward
    _check_settings(fused, report, TIGHT)
    mine, _ = _errors(fused, model, x)  # the model stays in the final setting
    assert mine == pytest.approx(report.error_after, rel=1e-3)


def test_bench_calibrates_on_a_separate_input(gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    import convforge.torch as ct
    from convforge.apps.bench import models as M

    monkeypatch.setitem(M.MODELS, "tiny", 28)
    monkeypatch.setattr(M, "build", lambda name: _model(16, 2))
    seen = []
    real = ct.calibrate
    monkeypatch.setattr(ct, "calibrate", lambda fused, model, xc, **kw: seen.append(xc.clone()) or real(
        fused, model, xc, **kw))
    rows = M.bench_model("tiny", 4, 1, 2, {"precision": "fp32"}, pytorch=False, error_budget=2.0)
    by = {r["impl"]: r for r in rows}
    assert len(seen) == 1  # once for both fused rows
    x = torch.randn(4, 3, 28, 28, device="cuda", generator=torch.Generator(device="cuda").manual_seed(M.SEED))
    assert not torch.equal(seen[0], x)
    for impl in ("convforge_fused", "convforge_fused_graph"):
        assert by[impl]["status"].startswith("ok") and by[impl]["error_budget"] == 2.0, by[impl]
        assert by[impl]["tightened"] == len(by[impl]["calibration"]["tightened"])
    assert "error_budget" not in by["convforge"]
