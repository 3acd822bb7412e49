"""Precision classes and the tuner's verification (issue: accuracy you can trust)."""

from __future__ import annotations

import pytest

from convforge import kernels
from convforge.params import Params
from convforge.spec import ConvSpec
from convforge.tune import Budget, TuneError, Tuner
from convforge.tune import tuner as tuner_mod
from convforge.tune.tuner import Candidate


def _cand(name: str, err: float, ms: float) -> Candidate:
    c = Candidate(kernels.get_variant(name), Params(), time_ms=ms, error=err, status="ok")
    return c


def test_fp32_bound_and_selection() -> None:
    """fp32 admits <= 5e-6; where even the most accurate exceeds it, 2x the most accurate."""
    spec = ConvSpec.make(1, 8, 14, 14, 8, 3, 3, padding=1)
    t = Tuner.__new__(Tuner)
    t.precision, t.max_error = "fp32", None
    ok = [_cand("direct", 1e-6, 3.0), _cand("winograd_nonfused_f4", 4e-6, 2.0),
          _cand("winograd_nonfused_f7", 3e-5, 1.0)]
    assert t.bound(ok) == 5e-6
    assert t.select(spec, ok).variant.name == "winograd_nonfused_f4"
    long = [_cand("direct", 8e-6, 3.0), _cand("winograd_nonfused_f4", 1.5e-5, 2.0),
            _cand("winograd_nonfused_f7", 2e-5, 1.0)]
    assert t.bound(long) == pytest.approx(1.6e-5)
    assert t.select(spec, long).variant.name == "winograd_nonfused_f4"
    t.precision = "relaxed"
    assert t.select(spec, ok).variant.name == "winograd_nonfused_f7"
    t.max_error = 5e-7
    with pytest.raises(TuneError, match=r"most accurate, direct.*measured 1.00e-06"):
        t.select(spec, ok)


def test_tuner_pool_keeps_to_the_class() -> None:
    spec = ConvSpec.make(8, 64, 14, 14, 64, 3, 3, padding=1)
    t = Tuner.__new__(Tuner)
    t.variants, t.precision, t.max_error = None, "fp32", None
    names = {v.name for v in t.pool(spec)}
    assert "winograd_nonfused_f4" in names and "winograd_nonfused_f7" not in names and "direct" in names
    t.precision = "relaxed"
    assert "winograd_nonfused_f7" in {v.name for v in t.pool(spec)}


def test_verification_never_judges_against_a_less_accurate_candidate(ocl, monkeypatch) -> None:
    """The VGG case: a layer past REF_FLOP_LIMIT (only image 0 against float64), F(7x7) tried
    first. The images past the slice are judged against an exact variant's output, so direct
    convolution passes with its own, FP32-grade error instead of F(7x7)'s."""
    spec = ConvSpec.make(3, 128, 14, 14, 128, 3, 3, padding=1)
    monkeypatch.setattr(tuner_mod, "REF_FLOP_LIMIT", spec.flops / spec.n)  # one image of reference
    f7, direct = kernels.get_variant("winograd_nonfused_f7"), kernels.get_variant("direct")
    tuner = Tuner(ocl, None, Budget(None, 2), variants=[f7, direct], precision="relaxed")
    cands = {c.variant.name: c for c in tuner.search(spec)}
    assert list(cands) == ["winograd_nonfused_f7", "direct"]  # F(7x7) ran first
    assert cands["winograd_nonfused_f7"].status == "ok" and cands["winograd_nonfused_f7"].error > 1e-5
    assert cands["direct"].status == "ok", cands["direct"].status
    assert cands["direct"].error < 5e-6


def test_verification_covers_the_whole_batch(ocl, monkeypatch) -> None:
    """Images past the reference's slice are really compared: a wrong verified output fails."""
    import numpy as np

    spec = ConvSpec.make(2, 4, 9, 9, 5, 3, 3, padding=1)
    monkeypatch.setattr(tuner_mod, "REF_FLOP_LIMIT", spec.flops / spec.n)
    monkeypatch.setattr(tuner_mod._Bench, "rest", lambda self: np.zeros((1, 5, 9, 9)))
    tuner = Tuner(ocl, None, Budget(None, 1), variants=[kernels.get_variant("direct")])
    (cand,) = tuner.search(spec)
    assert cand.status.startswith("wrong: rel L2 error")


def _store(db, tuner, spec, variant: str, params, err: float, precision: str) -> None:
    from convforge.plan import Epilogue
    from convforge.tune.db import KEY_FIELDS, Entry, now

    key = dict(zip(KEY_FIELDS, tuner.key(spec, Epilogue(), precision), strict=True))
    db.put(Entry(**key, version="test", variant=variant, params=params.to_json(), time_ms=1.0, workspace=0,
                 error=err, date=now()))


def test_dispatch_uses_the_class_entry_and_measured_errors(ocl, tmp_path, monkeypatch) -> None:
    """The database's entry of the asked class serves; max_error compares measured errors; a
    bound nothing states it meets is a clear error naming the most accurate variant."""
    from convforge import dispatch, tune
    from convforge.config import config
    from convforge.tune.db import TuningDB

    spec = ConvSpec.make(2, 8, 14, 14, 8, 3, 3, padding=1)
    monkeypatch.setattr(config, "db_path", tmp_path / "t.sqlite")
    db = TuningDB(tmp_path / "t.sqlite")
    tuner = Tuner(ocl, db)
    f4, f7 = kernels.get_variant("winograd_nonfused_f4"), kernels.get_variant("winograd_nonfused_f7")
    _store(db, tuner, spec, f4.name, f4.default(spec, ocl.device), 2e-6, "fp32")
    _store(db, tuner, spec, f7.name, f7.default(spec, ocl.device), 4e-5, "relaxed")
    db.close()
    tune.clear_choices()
    try:
        assert dispatch.choose(spec, ocl).variant.name == f4.name
        assert dispatch.choose(spec, ocl).source == "db"
        assert dispatch.choose(spec, ocl, precision="relaxed").variant.name == f7.name
        ch = dispatch.choose(spec, ocl, max_error=5e-5)  # no max_error entry: the classes' within it
        assert ch.source == "db" and ch.error == 2e-6
        assert dispatch.choose(spec, ocl, max_error=1e-6).source == "heuristic"  # 2e-6 measured: too much
        with pytest.raises(ValueError, match=r"max_error \(1e-09\) cannot be met.*most accurate variant"):
            dispatch.choose(spec, ocl, max_error=1e-9)
    finally:
        tune.clear_choices()


def test_fp32_default_never_picks_a_relaxed_variant(ocl) -> None:
    from convforge import dispatch

    spec = ConvSpec.make(32, 64, 56, 56, 64, 3, 3, padding=1)
    from conftest import NOMINAL_CUDA

    assert kernels.most_specialised("auto", spec, NOMINAL_CUDA)[0].precision == "fp32"
    assert dispatch.choose(spec, ocl).variant.precision == "fp32"
