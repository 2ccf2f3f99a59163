"""The README stays a front door (short, the two commands first) and no page links to a file or
a heading that is not there."""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_pages import README, ROOT, anchors, links, pages, slug

README_MAX_LINES = 150


def test_the_readme_is_at_most_150_lines() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_the_readme_starts_with_make_serve_and_make_test() -> None:
    # A newcomer's first two commands, before any prose.
    first_block = README.read_text().split("```")[1]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert [command for command in commands if command] == ["make serve", "make test"]


def test_the_github_anchor_of_a_heading_drops_code_marks_and_punctuation() -> None:
    assert slug("`modelhost serve` flags") == "modelhost-serve-flags"
    assert slug("What survives a switch, and a restart?") == "what-survives-a-switch-and-a-restart"


@pytest.mark.parametrize("page", pages(), ids=[str(p.relative_to(ROOT)) for p in pages()])
def test_every_relative_link_and_anchor_of_a_page_resolves(page: Path) -> None:
    broken = []
    for line, target in links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{page.name}:{line} {target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{page.name}:{line} {target}: no such heading")
    assert broken == []
