"""The documentation cannot rot silently: every link between pages lands on a file and
a heading that exist, every test a page names exists, the README stays the front door
and leads to every page."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # another site
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.name}: {target} (no such heading)")
    return bad


def test_every_link_lands_on_a_page_and_heading_that_exist(tmp_path: Path) -> None:
    assert slug("`[[tiers]]`: secondary tiers") == "tiers-secondary-tiers"
    page = tmp_path / "a.md"
    page.write_text("# Top\n\n[ok](#top) [gone](missing.md) [nowhere](#bottom)\n")
    assert broken_links(page) == [
        "a.md: missing.md (no such file)",
        "a.md: #bottom (no such heading)",
    ]
    assert [bad for p in PAGES for bad in broken_links(p)] == []


def test_every_test_a_page_names_exists() -> None:
    named = 0
    for page in PAGES:
        for path, name in TEST_REF.findall(page.read_text()):
            file = ROOT / path
            assert file.exists(), f"{page.name}: {path} does not exist"
            tree = ast.parse(file.read_text())
            tests = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in tests, f"{page.name}: {path}::{name} does not exist"
            named += 1
    assert named >= 50  # architecture.md names the tests of every invariant


def test_the_readme_is_the_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README grows: move the detail into docs/"
    assert "make run" in readme and "make test" in readme
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"the README does not lead to {page.name}"


def test_the_architecture_page_covers_every_invariant() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    numbered = [int(n) for n in re.findall(r"^(\d+)\. \*\*", text, re.M)]
    assert numbered == list(range(1, 17))
