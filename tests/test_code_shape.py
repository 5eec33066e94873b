"""The code stays readable for the next person (issues 22, 40), in the package, its tests and its benchmarks alike:
no module over 400 lines, no function past radon's grade C (cyclomatic complexity above 20 is grade D: split it),
no line over 120 characters (ruff's line-length, held here so it holds without ruff)."""

from __future__ import annotations

from pathlib import Path

import pytest

import vitconvert

PACKAGE = Path(vitconvert.__file__).parent
MAX_LINES = 400
MAX_COMPLEXITY = 20  # radon's grade C ends here
MAX_LINE = 120  # pyproject.toml's [tool.ruff] line-length
SOURCES = [PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "benchmarks"]


def modules() -> list[Path]:
    """Every Python file of the package, its tests and its benchmarks: the rules hold for all code people read."""
    return [p for root in SOURCES for p in sorted(root.rglob("*.py"))]


def name(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def test_no_module_is_over_400_lines():
    long = {name(p): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concept: {long}"


def test_no_function_is_radon_grade_d_or_worse():
    complexity = pytest.importorskip("radon.complexity")  # in the dev extra
    worst = {}
    for path in modules():
        for block in complexity.cc_visit(path.read_text()):
            for item in [block, *getattr(block, "methods", [])]:
                if item.complexity > MAX_COMPLEXITY:
                    worst[f"{name(path)}:{item.lineno} {item.name}"] = item.complexity
    assert not worst, worst


def test_no_line_is_over_120_characters():
    long = [f"{name(p)}:{i}" for p in modules() for i, line in enumerate(p.read_text().splitlines(), 1)
            if len(line) > MAX_LINE]
    assert not long, f"wrap these lines (not the limit): {long[:20]}"
