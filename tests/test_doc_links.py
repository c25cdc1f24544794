"""Every relative link of README.md and docs/*.md names a file that exists and, with ``#anchor``, a heading of it
(GitHub's anchors: lower case, punctuation dropped, spaces as hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def broken_links(docs: list[Path]) -> list[str]:
    bad = []
    for doc in docs:
        text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.S | re.M)
        for m in re.finditer(r"\]\(([^)\s#]*)(#[^)\s]+)?\)", text):
            path, anchor = m.group(1), m.group(2)
            if re.match(r"[a-z]+:", path):  # http(s), mailto
                continue
            target = (doc.parent / path) if path else doc
            if not target.exists():
                bad.append(f"{doc.name}: {path} does not exist")
            elif anchor and target.suffix == ".md" and anchor[1:] not in anchors(target):
                bad.append(f"{doc.name}: {path}{anchor} names no heading")
    return bad


def test_doc_links_resolve():
    assert broken_links(DOCS) == []


def test_a_broken_anchor_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title: one (two.md)\n\n[ok](#title-one-twomd) [bad](b.md#nope) [gone](c.md)\n")
    (tmp_path / "b.md").write_text("## Other\n")
    assert broken_links([tmp_path / "a.md"]) == ["a.md: b.md#nope names no heading", "a.md: c.md does not exist"]
