"""dispatch: a database lookup for an epilogue without an entry of its own falls back to the entry
of the same spec and class with a plainer epilogue, when that variant plans with the requested one
(PoCL, temporary database)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from convforge import dispatch, kernels, tune
from convforge.check import check_plan
from convforge.config import config
from convforge.params import Params
from convforge.plan import Epilogue
from convforge.spec import ConvSpec
from convforge.tune import Budget, Tuner
from convforge.tune.db import KEY_FIELDS, Entry, TuningDB, now

SPEC = ConvSpec.make(2, 5, 11, 13, 7, 3, 3, padding=(1, 0, 2, 1))  # primes, asymmetric padding
STRIDED = ConvSpec.make(1, 3, 17, 17, 5, 3, 3, stride=2, padding=1)  # no Winograd: a residual store path
PLAIN, BIAS, BIAS_RELU = Epilogue(), Epilogue(bias=True), Epilogue(bias=True, relu=True)


@pytest.fixture
def db(ocl: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An empty temporary database that dispatch reads; choices forgotten before and after."""
    monkeypatch.setattr(config, "db_path", tmp_path / "fallback.sqlite")
    monkeypatch.setattr(config, "autotune", False)
    tune.clear_choices()
    database = TuningDB(tmp_path / "fallback.sqlite")
    yield database
    database.close()
    tune.clear_choices()


def _store(db: TuningDB, backend: Any, epi: Epilogue, variant: str, precision: str = "fp32",
           params: Params | None = None, spec: ConvSpec = SPEC) -> None:
    v = kernels.get_variant(variant)
    prm = params or v.default(spec, backend.device)
    key = dict(zip(KEY_FIELDS, Tuner(backend, db).key(spec, epi, precision), strict=True))
    db.put(Entry(**key, version="test", variant=variant, params=prm.to_json(), time_ms=1.0, workspace=0,
                 error=1e-7, date=now()))


def test_plain_entry_serves_a_fused_epilogue_and_computes_it(ocl: Any, db: TuningDB) -> None:
    heuristic = dispatch.choose(SPEC, ocl, BIAS_RELU).variant.name
    assert heuristic != "direct_smem"  # so a "db" answer below is really the stored entry
    tune.clear_choices()
    _store(db, ocl, PLAIN, "direct_smem")
    ch = dispatch.choose(SPEC, ocl, BIAS_RELU)
    assert (ch.variant.name, ch.source, ch.error) == ("direct_smem", "db", 1e-7)
    res = check_plan(ch.variant.plan(SPEC, ch.params, ocl.device, BIAS_RELU), ocl, seed=3)
    assert res.ok, res


def test_order_own_entry_then_bias_then_plain(ocl: Any, db: TuningDB) -> None:
    _store(db, ocl, PLAIN, "direct")
    _store(db, ocl, BIAS, "im2col_gemm")
    assert dispatch.choose(SPEC, ocl, BIAS_RELU).variant.name == "im2col_gemm"
    assert dispatch.choose(SPEC, ocl, Epilogue(relu=True)).variant.name == "direct"  # no bias: plain
    _store(db, ocl, BIAS_RELU, "implicit_gemm")
    tune.clear_choices()
    assert dispatch.choose(SPEC, ocl, BIAS_RELU).variant.name == "implicit_gemm"


def test_fallback_keeps_to_the_class(ocl: Any, db: TuningDB) -> None:
    _store(db, ocl, PLAIN, "winograd_nonfused_f7", precision="relaxed")
    assert dispatch.choose(SPEC, ocl, BIAS_RELU).source == "heuristic"  # fp32 asks: no relaxed entry
    ch = dispatch.choose(SPEC, ocl, BIAS_RELU, precision="relaxed")
    assert (ch.variant.name, ch.source) == ("winograd_nonfused_f7", "db")


@pytest.fixture
def f4_without_residual(monkeypatch: pytest.MonkeyPatch) -> Any:
    """winograd_nonfused_f4 made a variant with no residual store path, as the tensor-core GEMMs
    are (a stand-in: every variant PoCL runs has one): it refuses a residual epilogue."""
    v = kernels.get_variant("winograd_nonfused_f4")
    real = type(v).plan

    def plan(self: Any, spec: ConvSpec, params: Params, device: Any, epilogue: Epilogue = Epilogue()) -> Any:
        if self is v and epilogue.residual:
            raise ValueError("unsupported epilogue: no residual store path (stand-in)")
        return real(self, spec, params, device, epilogue)

    monkeypatch.setattr(type(v), "plan", plan)
    monkeypatch.setattr(v, "residual_ok", False)
    return v


@pytest.mark.usefixtures("f4_without_residual")
def test_fallback_variant_must_plan_with_the_epilogue(ocl: Any, db: TuningDB) -> None:
    """A variant without a residual store path: its plain entry cannot serve a residual."""
    residual = Epilogue(bias=True, residual=True)
    with pytest.raises(ValueError, match="unsupported epilogue"):
        kernels.get_variant("winograd_nonfused_f4").plan(SPEC, kernels.get_variant(
            "winograd_nonfused_f4").default(SPEC, ocl.device), ocl.device, residual)
    _store(db, ocl, BIAS, "winograd_nonfused_f4")
    assert dispatch.choose(SPEC, ocl, residual).source == "heuristic"
    _store(db, ocl, PLAIN, "direct")  # the next fallback does take it
    tune.clear_choices()
    ch = dispatch.choose(SPEC, ocl, residual)
    assert (ch.variant.name, ch.source) == ("direct", "db")
    assert dispatch.choose(SPEC, ocl, BIAS).variant.name == "winograd_nonfused_f4"  # its own key


def test_autotune_of_a_residual_epilogue_stores_its_bias_relu_part(ocl: Any, db: TuningDB,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner checks bias and ReLU only: a residual epilogue is tuned as bias + ReLU, stored under
    that key, and the next lookup (autotune off) finds it through the fallback."""
    monkeypatch.setattr(config, "autotune", True)
    monkeypatch.setattr("convforge.tune.AUTOTUNE_BUDGET", Budget(None, 1))
    fused = Epilogue(bias=True, relu=True, residual=True)
    ch = dispatch.choose(STRIDED, ocl, fused)
    assert ch.source == "tuned" and ch.variant.residual_ok
    assert [e.epilogue for e in db.entries()] == ["bias_relu"]
    monkeypatch.setattr(config, "autotune", False)
    tune.clear_choices()
    again = dispatch.choose(STRIDED, ocl, fused)
    assert (again.variant, again.params, again.source) == (ch.variant, ch.params, "db")


@pytest.mark.usefixtures("f4_without_residual")
def test_autotuned_winner_without_a_residual_path_gives_way(ocl: Any, db: TuningDB,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """When the bias + ReLU winner cannot take the residual, the fastest admitted candidate that can
    is chosen and stored under the residual epilogue's own key."""
    f4, direct = kernels.get_variant("winograd_nonfused_f4"), kernels.get_variant("direct")
    monkeypatch.setattr(config, "autotune", True)
    monkeypatch.setattr("convforge.tune.AUTOTUNE_BUDGET", Budget(None, 2))
    monkeypatch.setattr(Tuner, "pool", lambda self, spec: [f4, direct])
    monkeypatch.setattr(Tuner, "select", lambda self, spec, ok: min(
        ok, key=lambda c: (c.variant is not f4, c.time_ms)))  # the stand-in "wins" whatever PoCL times
    fused = Epilogue(bias=True, relu=True, residual=True)
    ch = dispatch.choose(SPEC, ocl, fused)
    assert (ch.variant.name, ch.source) == ("direct", "tuned")
    stored = {e.epilogue: e.variant for e in db.entries()}
    assert stored == {"bias_relu": "winograd_nonfused_f4", "bias_res_relu": "direct"}


def test_autotune_tunes_the_real_epilogue_instead_of_falling_back(ocl: Any, db: TuningDB,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With config.autotune on (bench --model --tune), a plain entry does not stand in for a bias +
    ReLU layer: the layer is tuned with its own epilogue and stored under it."""
    _store(db, ocl, PLAIN, "direct_smem", spec=STRIDED)
    assert dispatch.choose(STRIDED, ocl, BIAS_RELU).source == "db"  # autotune off: the fallback serves
    monkeypatch.setattr(config, "autotune", True)
    monkeypatch.setattr("convforge.tune.AUTOTUNE_BUDGET", Budget(None, 1))
    assert dispatch.choose(STRIDED, ocl, BIAS_RELU).source == "tuned"
    assert sorted(e.epilogue for e in db.entries(spec=STRIDED.key())) == ["bias_relu", "none"]
    assert dispatch.choose(STRIDED, ocl, BIAS_RELU, precision="relaxed").source == "tuned"  # its class too
