"""Every relative link in README.md and docs/*.md reaches a file, and every ``#anchor`` a heading there.

Anchors follow GitHub's rule for headings: lower case, punctuation other than ``-`` and ``_`` dropped,
spaces to ``-``, a repeated heading gets ``-1``, ``-2``, ... Links inside fenced code are not links.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    for line in FENCE.sub("", markdown).splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            anchor = heading_anchor(match.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
    return {a if n == 0 else f"{a}-{n}" for a, count in seen.items() for n in range(count)}


@cache
def _file_anchors(path: Path) -> frozenset[str]:
    """A file's anchors, read and parsed once however many links point into it."""
    return frozenset(anchors(path.read_text()))


def broken_links(doc: Path) -> list[str]:
    broken = []
    for link in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(f"{link}: no file {target}")
        elif anchor and target.suffix == ".md" and anchor not in _file_anchors(target):
            broken.append(f"{link}: no heading with that anchor in {target.name}")
    return broken


@pytest.mark.parametrize("heading, anchor", [
    ("Training a head: `vllm-dsbd train-drafter`", "training-a-head-vllm-dsbd-train-drafter"),
    ("Depth 0 draws the next forest too, and a hopeful α (2026-11-28, third stop)",
     "depth-0-draws-the-next-forest-too-and-a-hopeful-α-2026-11-28-third-stop"),
    ("The head in vLLM's eagle3, and MJSD against it", "the-head-in-vllms-eagle3-and-mjsd-against-it"),
    ("`draft_in_step`: the first measurements", "draft_in_step-the-first-measurements"),
])
def test_heading_anchors_follow_githubs_rule(heading, anchor):
    assert heading_anchor(heading) == anchor


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## Part\n\n## Part\n\n```\n## Not a heading\n```\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[a](other.md#part) [b](other.md#part-1) [c](#here) [d](https://x.org/#nope)\n\n## Here\n"
                   "[e](other.md#part-2) [f](missing.md) [g](other.md#not-a-heading)\n"
                   "```\n[h](inside-code.md)\n```\n")
    assert broken_links(doc) == [
        "other.md#part-2: no heading with that anchor in other.md",
        f"missing.md: no file {tmp_path / 'missing.md'}",
        "other.md#not-a-heading: no heading with that anchor in other.md",
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_relative_link_in_the_docs_resolves(doc):
    assert broken_links(doc) == []
