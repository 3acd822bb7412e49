"""The documentation's links and the paths it names resolve: Markdown links to files, every
``scripts/...`` the README and the current docs tell a user to run, every raw result they cite; the
README's shape (its first shell block is what .ci/run installs and tests with)."""

from __future__ import annotations

import ast
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
CURRENT = [ROOT / "README.md", *(ROOT / "docs" / name for name in ("BENCHMARKS.md", "DISK.md", "USAGE.md",
                                                                   "MEASURING.md"))]


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
    assert not re.search(r"\bround \d", text, re.IGNORECASE), "today's stand names dates, not rounds"
    assert stand < 3000
    for area in ("Single layers, fp32 class", "Single layers, relaxed class", "Whole networks", "PyTorch models",
                 "Host cost", "Training", "Half precision"):
        assert f"## {area}" in text, area


RESULTS = ROOT / "docs" / "results"
# A raw result's name carries its date (layers-mec-fp32-2026-11-27-r32-h100.json) or at least its call's
# tag (*-r32-h100.*); braces and stars stand for several (half-{resnet,mec}-fp16-*.json).
RESULT = re.compile(r"[\w{},.*-]*20\d\d-\d\d-\d\d[\w{},.*-]*|[\w{},*-]*-r\d+(?:-[a-z0-9]+)?\.[a-z*{},]+")


def _expand(name: str) -> list[str]:
    """Brace alternatives of a cited name, as the shell expands them."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [e for alt in m.group(1).split(",") for e in _expand(name[:m.start()] + alt + name[m.end():])]


def _cited(text: str) -> set[str]:
    """The files of docs/results a text names (a name without its extension names every extension)."""
    names = [p.name for p in RESULTS.iterdir()]
    hits: set[str] = set()
    for token in RESULT.findall(text):
        for pattern in _expand(token.rstrip(".,;:")):
            rx = re.compile(re.escape(pattern).replace(r"\*", ".*") + r"(\..*)?")
            hits.update(n for n in names if rx.fullmatch(n))
    return hits


def test_cited_results_exist() -> None:
    """Every raw result today's figures name is in docs/results (the rest are in git history)."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    named = {tok for tok in re.findall(r"`([\w.-]*20\d\d-\d\d-\d\d[\w.-]*\.(?:json|log|txt|csv))`", text)}
    missing = sorted(n for n in named if not (RESULTS / n).exists())
    assert not missing, f"docs/BENCHMARKS.md cites results not in docs/results: {missing}"


def test_every_kept_result_is_cited() -> None:
    """docs/results holds only what the current docs or the code's comments cite; the rest stays in git history."""
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
               *(p for p in (ROOT / "src").rglob("*") if p.suffix in (".py", ".json", ".cpp", ".h"))]
    cited: set[str] = set()
    for path in sources:
        cited |= _cited(path.read_text(errors="replace"))
    stray = sorted(p.name for p in RESULTS.iterdir() if p.name not in cited)
    assert not stray, f"docs/results files nothing current cites (git rm them; history keeps them): {stray}"


def _readme_shell_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block, "the README has no ```bash block"
    return block.group(1).splitlines()


def test_readme_is_short_and_opens_with_the_ci_commands() -> None:
    """The README's first lines say what convforge is, then exactly the two commands .ci/run checks."""
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 150, f"README.md has {len(readme)} lines (at most 150)"
    lines = _readme_shell_block()
    assert len(lines) == 2, f"the README's first shell block must be the install and the test command: {lines}"
    ci = (ROOT / ".ci" / "run").read_text()
    for line in lines:
        assert f"'{line}'" in ci or f'"{line}"' in ci, f".ci/run does not check the README's {line!r}"


def test_readme_lists_the_onnx_ops_read() -> None:
    """The README's ONNX paragraph names exactly the ops the reader takes (graph/onnx_ops.py), in its order."""
    from convforge.graph.onnx_ops import SUPPORTED_OPS

    text = " ".join((ROOT / "README.md").read_text().split())
    found = re.search(r"ONNX ops \(.*?\): (.*?)\.(?: |$)", text)
    assert found, "the README has no 'ONNX ops (...): A, B, ...' paragraph"
    assert found.group(1).split(", ") == list(SUPPORTED_OPS)


@pytest.mark.parametrize("doc", [ROOT / "README.md", ROOT / "docs" / "USAGE.md"], ids=lambda p: p.name)
def test_python_examples_parse(doc: Path) -> None:
    """Every ```python block of the README and the usage guide is valid Python (the README's NumPy and CLI
    quickstarts are run by hand on PoCL; parsing them here catches a broken paste)."""
    blocks = re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.MULTILINE | re.DOTALL)
    assert blocks
    for block in blocks:
        ast.parse(block)
