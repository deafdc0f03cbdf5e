"""The README and docs/ stay short, linked and complete: the README opens with the two set-up commands and stays
under 200 lines, every relative link points to a file (and heading) that exists, and docs/development.md's map
names every module under lit_rl/. Reads text only: no model, no import of lit_rl."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAP = DOCS / "development.md"

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def fenced_blocks(text: str) -> list[str]:
    return [m.group(1).strip() for m in FENCE.finditer(text)]


def without_code(text: str) -> str:
    """The text with fenced blocks and inline code removed, so a link-like string in an example is not a link."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def test_readme_is_at_most_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into a docs/ page (at most 200)"


def test_readme_has_no_line_over_300_characters():
    lines = README.read_text().splitlines()
    long = [f"line {i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > 300]
    assert not long, "README.md lines over 300 characters: " + "; ".join(long)


def test_readme_opens_with_the_two_set_up_commands():
    text = README.read_text()
    first_heading = re.search(r"^## ", text, re.M)
    opening = text[: first_heading.start()] if first_heading else text
    blocks = fenced_blocks(opening)
    assert len(blocks) >= 2, (
        f"README.md has {len(blocks)} fenced command block(s) before its first '## ' heading; it must open with two: "
        "install + run the main job, then install + run the tests"
    )
    run, tests = blocks[0], blocks[1]
    for name, block in (("first", run), ("second", tests)):
        assert "\n" not in block, f"the README's {name} set-up command is not one line: {block!r}"
        assert block.startswith("pip install "), f"the README's {name} set-up command does not install first: {block!r}"
    assert "lit-rl fit --config configs/" in run, f"the README's first command does not run a config: {run!r}"
    assert run.endswith(".yaml") and (ROOT / run.rsplit(" ", 1)[1]).is_file(), (
        f"the README's first command runs a config that does not exist: {run!r}"
    )
    # the whole suite: pytest with its options (two xdist workers), never a marker filter or a path
    runner = tests.rsplit(" && ", 1)[-1]
    assert re.fullmatch(r"python -m pytest -q( -n \d+)?( --dist \w+)?( --durations=\d+)?", runner), (
        f"the README's second command does not run the whole test suite: {tests!r}"
    )


def test_ci_runs_the_readmes_second_command():
    ci = ROOT / ".ci" / "run"
    if not ci.exists():
        pytest.skip(".ci/run is not in this checkout")
    # .ci/run takes the text inside the second fence (awk counts fence lines); the same block here
    assert "fence == 3" in ci.read_text(), ".ci/run no longer reads the README's second fenced block; update this test"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_something_that_exists(page):
    missing = []
    for target in LINK.findall(without_code(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            missing.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            missing.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not missing, f"{page.relative_to(ROOT)} links to what does not exist: " + "; ".join(missing)


def test_the_development_map_names_every_module():
    text = MAP.read_text()
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "lit_rl").rglob("*.py"))
    unnamed = [m for m in modules if f"`{m}`" not in text]
    assert not unnamed, "docs/development.md's map of the code does not name: " + ", ".join(unnamed)
    named = set(re.findall(r"`(lit_rl/[\w/]+\.py)`", text))
    gone = sorted(n for n in named if not (ROOT / n).exists())
    assert not gone, "docs/development.md names modules that do not exist: " + ", ".join(gone)


def test_docs_pages_open_with_what_the_reader_gets():
    thin = []
    for page in sorted(DOCS.glob("*.md")):
        lines = [line for line in page.read_text().splitlines() if line.strip()]
        if not lines or not lines[0].startswith("# ") or len(lines) < 2 or lines[1].startswith(("#", "|", "```", "!")):
            thin.append(str(page.relative_to(ROOT)))
    assert not thin, "docs pages that do not open with a title and a sentence on what the reader gets: " + ", ".join(
        thin
    )


def test_the_methods_page_lists_every_config():
    table = (ROOT / "docs/methods.md").read_text()
    listed = set(re.findall(r"^\| \[`configs/([\w.]+\.yaml)`\]", table, re.M))
    shipped = {path.name for path in (ROOT / "configs").glob("*.yaml")}
    assert shipped - listed == set(), f"docs/methods.md's config table lacks {sorted(shipped - listed)}"
