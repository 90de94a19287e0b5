"""The docs the code points to: every `docs/NAME.md, "Section"` pointer in the code and
the docs names a file of docs/ and a heading in it, so a comment that sends a reader to
a measurement finds it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POINTER = re.compile(r'(?:docs/)?([a-z_]+\.md),\s*"([^"]+)"')
SOURCES = ("predd", "kvfsd", "liblip", "gatewayd", "symphony_protocol", "openai_lip",
           "scripts", "docs", "tests")


def _headings(doc: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in doc.read_text().splitlines()
            if line.startswith("#")}


def _pointers() -> list[tuple[str, str, str]]:
    found = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in {".py", ".c", ".h", ".md", ".sh"} or "__pycache__" in path.parts:
                continue
            # a pointer may wrap: join each comment's lines before matching
            text = re.sub(r"\s*\n\s*(?:#|\*|//)?\s*", " ", path.read_text(errors="replace"))
            for name, section in POINTER.findall(text):
                found.append((str(path.relative_to(ROOT)), name, section))
    return found


def test_every_pointer_names_a_heading_of_a_doc():
    pointers = _pointers()
    assert len(pointers) > 30                       # the comments' pointers were read
    missing = [(where, name, section) for where, name, section in pointers
               if not (ROOT / "docs" / name).exists()
               or section not in _headings(ROOT / "docs" / name)]
    assert missing == []
