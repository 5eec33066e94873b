"""One home per fact (docs/style.md's habits), checked on the source: a message, an attribute, an environment
variable each written in one module, so changing it is one edit and no copy drifts (issue 40)."""

from __future__ import annotations

from pathlib import Path

import vitconvert

PACKAGE = Path(vitconvert.__file__).parent


def files_saying(text: str) -> list[str]:
    """The package's modules whose source holds ``text``, relative to the package."""
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if text in p.read_text())


def test_the_corrupt_file_line_is_built_in_one_place():
    assert files_saying("corrupt or truncated") == ["errors.py"]
