"""The generated blocks of the docs: text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``.

A benchmark script renders its block from its results file in benchmarks/results/ and writes it here; the prose
around the markers is left alone. tests/test_doc_tables.py renders every block again from its results file and
compares it with the text between the markers, so a number in a generated table always has a results file behind
it. ``python benchmarks/doc_tables.py`` rewrites them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def read_block(text: str, name: str) -> Optional[str]:
    """The text between ``name``'s markers (without them or the newlines beside them); None if they are absent."""
    begin, end = markers(name)
    if begin not in text or end not in text.split(begin, 1)[1]:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with ``body`` between ``name``'s markers; the markers are appended at the end where absent."""
    begin, end = markers(name)
    if read_block(text, name) is None:
        text = text.rstrip() + f"\n\n{begin}\n{end}\n"
    before, rest = text.split(begin, 1)
    return f"{before}{begin}\n{body.strip(chr(10))}\n{end}{rest.split(end, 1)[1]}"


def write_block(doc: Path, name: str, body: str) -> None:
    """``doc`` (created if missing) with ``body`` between ``name``'s markers."""
    text = doc.read_text() if doc.is_file() else ""
    doc.write_text(replace_block(text, name, body))
    print(f"wrote the {name} block of {doc}")
