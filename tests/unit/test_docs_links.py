"""The README and docs/: every relative link names a file that exists, and every #anchor a heading there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(FENCE.sub("", page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, "\n".join(broken)
