"""The README, docs/ and examples/ stand alone: no path outside the repository, no internal issue number."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]
OUTSIDE = re.compile(r"shared/")
# "#27" or "issue 27" in prose; "(#4-prompts)" and "page.md#4-x" are anchors of headings, not issues
ISSUE = re.compile(r"(?<![\w/.\-])#\d+(?![\w\-])|\b[Ii]ssues? #?\d+\b")


def offending_lines(text: str) -> list[str]:
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if OUTSIDE.search(line) or ISSUE.search(line)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_outside_the_repository_and_no_issue_number(page):
    assert offending_lines(page.read_text()) == []


def test_what_counts_as_outside_or_an_issue_number():
    assert offending_lines("see ../shared/design/ALGORITHM.md\nissue #27's goals\nas issue 4 says\n(#12)") == [
        "1: see ../shared/design/ALGORITHM.md", "2: issue #27's goals", "3: as issue 4 says", "4: (#12)"]
    assert offending_lines("[x](#4-prompts-in-one-batch) [y](benchmarks.md#4-prompts) C# 3.20x\n") == []
