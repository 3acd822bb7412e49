"""The registry's order is set in one place (``kernels.REGISTRATION_ORDER``), not by which module was
imported first: ``ranked`` keeps registration order among equal ranks, so it is part of dispatch. The
dgrad adapters of ``dgrad.transposed`` wrap forward variants whatever was imported before the first load."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import convforge.kernels as K

SRC = str(Path(__file__).resolve().parents[1] / "src")
NAMES = """
import importlib, sys
for mod in sys.argv[1:]:
    importlib.import_module(mod)
from convforge.kernels import all_variants
print(" ".join(v.name for v in all_variants()))
"""


def _names(*first: str) -> list[str]:
    """The registry's names in a fresh interpreter that imports ``first`` before its first use."""
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", NAMES, *first], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_every_registering_module_is_listed() -> None:
    for mod in pkgutil.walk_packages(K.__path__, f"{K.__name__}."):
        importlib.import_module(mod.name)
    listed = {f"{K.__name__}.{m}" for m in K.REGISTRATION_ORDER}
    unlisted = sorted({type(v).__module__ for v in K.all_variants()} - listed)
    assert not unlisted, f"modules that register variants but are not in REGISTRATION_ORDER: {unlisted}"


def test_the_registry_follows_the_list() -> None:
    place = {f"{K.__name__}.{m}": i for i, m in enumerate(K.REGISTRATION_ORDER)}
    where = [place[type(v).__module__] for v in K.all_variants()]
    assert where == sorted(where)
    names = [v.name for v in K.all_variants()]
    assert "dgrad_tc_implicit_gemm_tf32" in names and "dgrad_sub_gemm1x1" in names  # adapters of both kinds


@pytest.mark.parametrize("first", [
    ("convforge.kernels.tensorcore.sm90.wgrad",),  # a training pass before the forward families
    ("convforge.kernels.dgrad", "convforge.kernels.depthwise_wgrad"),
])
def test_import_order_does_not_change_the_registry(first: tuple[str, ...]) -> None:
    assert _names(*first) == _names()
