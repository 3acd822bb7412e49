"""The documentation's links and the paths it names resolve: Markdown links to files, and every
``scripts/...`` the README and the current docs tell a user to run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SCRIPT = re.compile(r"scripts/[\w.-]+")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    missing = [target for target in LINK.findall(doc.read_text())
               if "://" not in target and not (doc.parent / target).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


# What a user reads to run things; the NOTES and the rounds' history are logs of investigations and
# may name scripts that served them and have gone (the history says so at its top).
CURRENT = [ROOT / "README.md", ROOT / "docs" / "BENCHMARKS.md", ROOT / "docs" / "DISK.md"]


@pytest.mark.parametrize("doc", CURRENT, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_scripts_exist(doc: Path) -> None:
    named = {s.rstrip(".") for s in SCRIPT.findall(doc.read_text())} - {"scripts/"}
    gone = sorted(s for s in named if not (ROOT / s).exists())
    assert not gone, f"{doc.relative_to(ROOT)} names scripts that do not exist: {gone}"


def test_benchmarks_leads_with_todays_stand() -> None:
    """The first screen says how fast convforge is today: the stand comes before any round's history."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    stand = text.index("# Today's stand")
    assert "# Round" not in text, "the rounds live in docs/history/"
    assert stand < 3000
    for area in ("Single layers, fp32 class", "Single layers, relaxed class", "Whole networks", "PyTorch models",
                 "Host cost", "Training", "Half precision"):
        assert f"## {area}" in text, area
