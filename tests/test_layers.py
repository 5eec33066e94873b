"""The package's layering (docs/architecture.md), checked on the source: every import points down.

Each module of vitconvert/ belongs to one layer. A module may import modules of lower layers, and modules of
its own package (``distill/``, ``data/``, ...) as long as the graph has no cycle. A function-local import of a
vitconvert module is allowed only to save start-up time and must say so (``# lazy: start-up time``);
``if TYPE_CHECKING:`` imports count as ordinary imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vitconvert"
LAZY_MARK = "# lazy: start-up time"

# Bottom to top; the same picture as docs/architecture.md. A key names a module or a whole package.
LAYERS: list[tuple[str, list[str]]] = [
    ("foundations", ["errors", "version", "top_k", "public_names"]),
    ("output rules", ["output_rules"]),
    ("process group", ["rendezvous"]),  # where torchrun's processes meet (distributed.py's launcher uses it)
    ("services", ["dependencies", "threads", "writer", "distributed", "aliases", "assets", "hub_io", "recipe_checks",
                  "selection", "weights_file", "state_file", "provenance"]),
    ("variants", ["attention"]),
    ("recipe sections", ["recipe_sections"]),
    ("recipes and families", ["recipes", "surgery"]),
    ("data and model plumbing", ["data", "init", "timm_registry", "capture", "recipe_report"]),
    ("model card", ["card"]),
    ("model folder", ["folder"]),
    ("folder upgrade", ["folder_upgrade"]),  # `vitconvert upgrade`: older layouts rewritten as folder.py writes
    ("softmax sources", ["sources"]),
    ("any model", ["loading"]),
    ("jobs", ["conversion", "evaluate", "compare", "export", "hub"]),
    ("layer choice", ["hybrid"]),
    ("the convert job", ["convert_job"]),
    ("measuring", ["bench_config", "contention", "flops", "onnx_timing"]),  # what bench.py puts together
    ("composite jobs", ["bench", "distill"]),
    ("the quickstart", ["quickstart"]),
    ("registration with timm", ["registration"]),  # when `import vitconvert` registers: as timm is imported
    ("public API", [""]),  # vitconvert/__init__.py
    ("command line", ["cli"]),
    ("entry point", ["__main__"]),
]
RANK = {name: rank for rank, (_, names) in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def unit(module: str) -> str:
    """The layer key of a module: its top-level module or package under vitconvert/ ("" for the package)."""
    return module.split(".", 1)[0]


def is_package(module: str) -> bool:
    return (PACKAGE / module.replace(".", "/") / "__init__.py").is_file() if module else True


def resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """vitconvert modules an import names (relative to ``module``), with ``from . import x`` as module x."""
    here = module.split(".") if module else []
    if not is_package(module):
        here = here[:-1]
    base = here[:len(here) - (node.level - 1)] if node.level else []
    if not node.level:
        if not (node.module or "").startswith("vitconvert"):
            return []
        base, target = [], node.module.split(".")[1:]
    else:
        target = node.module.split(".") if node.module else []
    parent = ".".join(base + target)
    found = []
    for alias in node.names:
        child = f"{parent}.{alias.name}" if parent else alias.name
        is_module = (PACKAGE / child.replace(".", "/")).with_suffix(".py").is_file() or is_package(child)
        found.append(child if is_module and alias.name != "*" else parent)
    return found


def imports(path: Path) -> list[tuple[str, int, bool, str]]:
    """(imported module, line, function-local, source line) for every vitconvert import in ``path``."""
    module = module_name(path)
    source = path.read_text()
    lines = source.splitlines()
    found = []

    def walk(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                for target in resolve(module, child):
                    found.append((target, child.lineno, local, lines[child.lineno - 1]))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("vitconvert"):
                        found.append((alias.name.split(".", 1)[1] if "." in alias.name else "", child.lineno, local,
                                      lines[child.lineno - 1]))
            walk(child, inner)

    walk(ast.parse(source), False)
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    missing = sorted({unit(module_name(p)) for p in MODULES} - set(RANK))
    assert not missing, f"add these to LAYERS (and docs/architecture.md): {missing}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p) or "vitconvert")
def test_imports_point_down(path):
    module = module_name(path)
    mine = RANK[unit(module)]
    for target, line, local, text in imports(path):
        where = f"{path.relative_to(PACKAGE.parent)}:{line}"
        same_package = unit(target) == unit(module) and unit(module) != ""
        if local:
            assert LAZY_MARK in text, f"{where}: function-local import of {target or 'vitconvert'} " \
                                      f"(move it to the top, or mark it '{LAZY_MARK}' if it only saves start-up)"
        if same_package:
            continue
        assert RANK[unit(target)] < mine, (f"{where}: {module or 'vitconvert'} (layer {LAYERS[mine][0]!r}) imports "
                                           f"{target or 'vitconvert'} (layer {LAYERS[RANK[unit(target)]][0]!r})")


def test_no_import_cycles():
    graph = {module_name(p): {t for t, _, local, _ in imports(p) if not local} for p in MODULES}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt not in graph:
                continue
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(trail + [nxt])
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_checker_catches_an_upward_and_an_unmarked_lazy_import(tmp_path, monkeypatch):
    """The rule is not vacuous: a fake module low in the stack that imports upward, or lazily, is caught."""
    fake = PACKAGE / "writer.py"
    source = fake.read_text() + "\n\nfrom .distill import run  # upward\n\n\ndef f():\n"
    source += "    from .errors import first_line\n"
    copy = tmp_path / "vitconvert" / "writer.py"
    copy.parent.mkdir()
    copy.write_text(source)
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "vitconvert")
    (tmp_path / "vitconvert" / "distill").mkdir()
    (tmp_path / "vitconvert" / "distill" / "__init__.py").write_text("")
    (tmp_path / "vitconvert" / "errors.py").write_text("")
    with pytest.raises(AssertionError, match="function-local import of errors|imports distill"):
        test_imports_point_down(copy)
    found = {(t, local) for t, _, local, _ in imports(copy)}
    assert ("distill", False) in found and ("errors", True) in found


def test_no_test_module_imports_another():
    """Shared test code lives in helpers (tests/helpers.py, tests/<folder>/helpers.py) and fixtures in
    conftest.py, never in a test module that another one imports."""
    found = []
    for path in sorted((PACKAGE.parent / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + ([alias.name for alias in node.names] if not node.module else [])
            else:
                continue
            if any(part.startswith("test_") for name in names for part in name.split(".")):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, f"test modules imported by others: {found}"
