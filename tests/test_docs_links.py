"""The README and docs/ hold together (issue 46 item 5): every relative link in README.md and
docs/**/*.md points at a file of the checkout (and, for a ``#anchor`` into a Markdown file, at one of
its headings, slugged as GitHub does), and the README stays a newcomer's page, under 300 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

README_MAX_LINES = 300
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"`[^`]*`", "``", line)))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[tuple[int, str]]:
    return [(number, m.group(1)) for number, line in _prose(page.read_text()) for m in LINK.finditer(line)]


def test_the_pages_have_links() -> None:
    assert (REPO / "docs" / "families" / "qwen2_5_omni.md").is_file()
    assert (REPO / "docs" / "families" / "qwen3_tts.md").is_file()
    assert (REPO / "docs" / "adding-a-family.md").is_file()
    assert len(_links(REPO / "README.md")) > 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for number, target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif REPO.resolve() not in dest.parents and dest != REPO.resolve():
            broken.append(f"{where} (outside the checkout)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_is_under_300_lines() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < README_MAX_LINES, len(lines)


def test_readme_keeps_the_two_commands() -> None:
    """.ci/run runs the README's test command; the Quickstart's install command is the one users copy."""
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/install.sh && .venv/bin/omni-stress run --arm main --arm pr" in readme
    command = ".venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadscope --no-loadscope-reorder"
    assert command in readme
    assert command in (REPO / ".ci" / "run").read_text()
