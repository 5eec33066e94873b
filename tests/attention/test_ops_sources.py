"""The kernel layer's sources (vitconvert/attention/ops/): measured numbers stay out of them, and the custom ops keep
their names wherever their files move (saved programs, torch.export and torch.compile name ops by them)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

import vitconvert.attention  # noqa: F401  (registers every op)

OPS = Path(vitconvert.attention.__file__).parent / "ops"

# a register or spill count, or a Triton version a build was measured with: numbers that go stale in a comment
# (they live in benchmarks/results/kernel-resources*.json and docs/performance.md's generated tables)
MEASURED = re.compile(r"\b\d+(?:[-–]\d+)?\s+(?:registers?|regs|spill(?:s|ed)?)\b|\bspill(?:s|ed)?\s+\d+"
                      r"|\bTriton\s+\d+\.\d+", re.IGNORECASE)

OP_NAMES = {"linear_attention", "blocked_attention", "pairwise_attention", "ttt_step"}


def test_no_kernel_source_states_a_measured_count():
    found = [f"{path.relative_to(OPS)}:{number}: {line.strip()}"
             for path in sorted(OPS.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if MEASURED.search(line)]
    assert not found, "measured numbers belong in the benchmarks' tables:\n" + "\n".join(found)


def test_the_pattern_finds_what_it_is_for():
    assert MEASURED.search("# (at 128 ELU's forward spilled 478 on sm_90)")
    assert MEASURED.search("255 registers and 6-18 spilled") and MEASURED.search("built with Triton 3.6")
    assert not MEASURED.search("float32 registers only") and not MEASURED.search("Triton before 3.8 builds")


def test_the_custom_ops_keep_their_names():
    for name in OP_NAMES:
        for op in (name, f"{name}_backward"):
            assert hasattr(torch.ops.vitconvert, op), op


def test_each_op_folder_holds_its_kernels_op_and_reference():
    """fla-org/flash-linear-attention's layout: an op's kernels, the op and its slow reference side by side."""
    for folder in ("linear", "pairwise", "grid", "ttt"):
        files = {p.name for p in (OPS / folder).glob("*.py")}
        assert "op.py" in files and any("kernels" in f for f in files), (folder, files)
        assert files & {"reference.py", "closed_form.py"}, (folder, files)


SHARED = {"call_op": "calls.py", "_direct_function": "calls.py", "fakes_checked": "calls.py",
          "_eager_gradients": "calls.py", "eager_gradients": "calls.py", "unit_rows": "layout.py",
          "_output_like": "layout.py", "_strides": "layout.py", "_mask_arg": "layout.py", "valid_keys": "layout.py",
          "decide": "launch_plan.py"}


def test_what_every_op_shares_has_one_home_in_ops():
    """The op machinery every op uses is defined once, in ops/ beside dispatch, and no op's folder reaches into
    another's op or launches for it (the pairwise, grid and TTT ops once imported it from ops/linear/)."""
    for name, home in SHARED.items():
        homes = [p.relative_to(OPS).as_posix() for p in sorted(OPS.rglob("*.py"))
                 if re.search(rf"^def {name}\(", p.read_text(), re.MULTILINE)]
        assert homes == [home], (name, homes)
    for folder in ("pairwise", "grid", "ttt"):
        for path in (OPS / folder).glob("*.py"):
            assert not re.search(r"from \.\.linear(\.op|\.launches)? import (op|launches|_)", path.read_text()), path


ROOT = OPS.parents[2]  # (the repository: vitconvert/, benchmarks/, tests/)
OP_FOLDERS = {"linear", "pairwise", "grid", "ttt"}


def top_level_names(tree: ast.Module) -> set[str]:
    """What a module offers: its definitions and what it imports by name (dispatch offers the settings' too)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def op_module_aliases(tree: ast.Module) -> set[str]:
    """The names a module binds to an op's module (``from ….ops.linear import op as fused``, ``from .linear import
    op``)."""
    return {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").rsplit(".", 1)[-1] in OP_FOLDERS for alias in node.names if alias.name == "op"}


def dispatch_names() -> set[str]:
    names = top_level_names(ast.parse((OPS / "dispatch.py").read_text()))
    assert {"can_run", "attempt", "ENV", "split_tokens"} <= names
    return names


def test_no_op_module_imports_a_dispatch_name_it_does_not_use():
    """can_run, attempt, the settings' names, split_tokens…: what dispatch.py offers is read from dispatch, and no
    module under ops/ re-exports it (ops/linear/op.py once re-exported a dozen for the variants)."""
    for path in sorted(OPS.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and (node.module or "").endswith("dispatch") for alias in node.names}
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert imported <= used, (path.relative_to(OPS).as_posix(), sorted(imported - used))


def reached_through_an_op(path: Path, names: set[str]) -> list[str]:
    """``alias.name`` in ``path`` where ``alias`` is an op's module and ``name`` one of ``names``."""
    text = path.read_text()
    if " import op" not in text:
        return []
    tree = ast.parse(text)
    aliases = op_module_aliases(tree)
    return [f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: {node.value.id}.{node.attr}"
            for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in aliases and node.attr in names]


def test_no_module_reaches_dispatch_through_an_op():
    """The package, the benchmarks and the tests ask dispatch (``dispatch.can_run``), not an op's module
    (``fused.can_run``)."""
    names = dispatch_names()
    reached = [line for folder in ("vitconvert", "benchmarks", "tests")
               for path in sorted((ROOT / folder).rglob("*.py")) for line in reached_through_an_op(path, names)]
    assert not reached, "ask dispatch, not an op's module:\n" + "\n".join(reached)
