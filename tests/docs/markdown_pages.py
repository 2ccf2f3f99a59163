"""What the docs tests read of the Markdown pages: runnable fenced blocks, the tables under a
heading, links and the anchors GitHub makes of headings. A few regular expressions, enough for
the pages of this repository (no Markdown library: the pages are plain)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
# A fence whose info string says `run` after its language is an example the suite runs.
RUN_MARKER = "run"
FENCE = re.compile(r"^(```+)(.*)$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    """Every page a reader may land on: the README, CONTRIBUTING.md, docs/*.md and the
    benchmarks' README."""
    return [README, CONTRIBUTING, *sorted(DOCS.glob("*.md")), ROOT / "benchmarks" / "README.md"]


@dataclass(frozen=True)
class Example:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _lines_outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the text that is not inside a fenced block."""
    kept, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is None:
            kept.append((number, line))
    return kept


def examples(page: Path) -> list[Example]:
    """The fenced blocks of `page` whose info string is `<language> run`."""
    found, lines = [], page.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        fence, words = match.group(1), match.group(2).split()
        end = index + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        if len(words) >= 2 and words[1] == RUN_MARKER:
            code = "\n".join(lines[index + 1 : end]) + "\n"
            found.append(Example(page, index + 1, words[0], code))
        index = end + 1
    return found


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 suffixes for repeated ones."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _lines_outside_fences(page.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            found.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link outside code blocks."""
    return [
        (number, target)
        for number, line in _lines_outside_fences(page.read_text())
        for target in LINK.findall(line)
    ]


def section(page: Path, heading: str) -> list[str]:
    """The lines under the heading whose text is `heading`, up to the next heading of its level
    or above."""
    lines, inside, level = page.read_text().splitlines(), False, 0
    kept: list[str] = []
    for _, line in _lines_outside_fences("\n".join(lines)):
        match = HEADING.match(line)
        if match and inside and len(match.group(1)) <= level:
            break
        if inside:
            kept.append(line)
        elif match and match.group(2) == heading:
            inside, level = True, len(match.group(1))
    if not inside:
        raise AssertionError(f"{page.name} has no heading {heading!r}")
    return kept


def first_cells(lines: list[str]) -> list[str]:
    """The first cell of every table row among `lines`, header and rule rows left out."""
    cells, previous_was_row = [], False
    for line in lines:
        if not line.startswith("|"):
            previous_was_row = False
            continue
        cell = re.split(r"(?<!\\)\|", line)[1].strip()
        is_rule = re.fullmatch(r":?-+:?", cell) is not None
        if previous_was_row and not is_rule:
            cells.append(cell)
        previous_was_row = True
    return cells
