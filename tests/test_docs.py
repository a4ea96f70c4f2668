"""The docs stay readable and their links hold: README.md at most 300 lines, docs/benchmarks.md at most 400,
every docs page linked from the README, and every relative link in README.md and docs/*.md pointing at a
file of this repository (and, into a Markdown page, at one of its headings)."""

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text):
    """Return ``text`` without fenced code blocks and inline code, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def relative_links(page):
    """Return the link targets of ``page`` that are neither absolute URLs nor mail addresses."""
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def anchors(page):
    """Return the anchors GitHub gives the headings of ``page``: lower case, punctuation dropped, spaces
    as hyphens, a repeated heading numbered ``-1``, ``-2``, ..."""
    seen = Counter()
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return found


def test_the_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_the_benchmarks_page_is_at_most_400_lines():
    assert len((DOCS / "benchmarks.md").read_text().splitlines()) <= 400


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / unquote(t.partition("#")[0])).resolve() for t in relative_links(README)}
    assert sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in linked) == []


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO_ROOT).as_posix() for p in PAGES])
def test_every_relative_link_points_at_a_file_and_heading_of_this_repository(page):
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / unquote(path)).resolve() if path else page
        if not file.is_relative_to(REPO_ROOT):
            broken.append(f"{target}: outside the repository")
        elif not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no such heading")
    assert broken == []
