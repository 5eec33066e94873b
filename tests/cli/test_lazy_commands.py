"""``vitconvert --help`` and ``--version`` load neither torch nor timm (they took seconds when they did); every
command is still listed with its docstring's summary and still runs and shows its own help."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import runner

from vitconvert import __version__
from vitconvert.cli import COMMANDS, LazyCommand, app

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "timm", "safetensors", "huggingface_hub"}
CONSOLE_SCRIPT = "import sys\nfrom vitconvert.cli import main\nsys.exit(main())\n"  # what pip writes, in short


def imported_modules(command: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime COMMAND`` on this checkout; the top-level packages it imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-X", "importtime", *command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in done.stderr.splitlines()
             if line.startswith("import time:") and line.count("|") == 2}
    return done, names


@pytest.mark.parametrize("flag", ["--version", "--help"])
@pytest.mark.parametrize("entry", ["python -m", "console script"])
def test_version_and_help_import_neither_torch_nor_timm(tmp_path, entry, flag):
    script = tmp_path / "vitconvert"
    script.write_text(CONSOLE_SCRIPT)
    done, names = imported_modules(["-m", "vitconvert", flag] if entry == "python -m" else [str(script), flag])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "vitconvert" in names and "typer" in names  # the probe sees imports at all
    assert not names & HEAVY, f"{entry} {flag} imported {sorted(names & HEAVY)}"
    if flag == "--version":
        assert done.stdout.strip() == f"vitconvert {__version__}"
    else:
        assert all(name in done.stdout for name in COMMANDS)


def test_import_vitconvert_still_registers_the_variants_with_timm():
    """Outside the command, ``import vitconvert`` alone lets timm build the linear models (README's snippet)."""
    done = subprocess.run([sys.executable, "-c", "import vitconvert, timm; print(timm.is_model('vitconvert_elu'), "
                           "callable(vitconvert.convert))"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "True"], done.stderr[-2000:]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_table_summary_is_the_docstring_and_the_command_still_loads(name):
    module, function, summary = COMMANDS[name]
    command = LazyCommand(name, module, function, summary).load()
    assert " ".join(inspect.cleandoc(command.callback.__doc__).split("\n\n")[0].split()) == summary
    shown = runner.invoke(app, [name, "--help"])
    assert shown.exit_code == 0 and f"vitconvert {name} [OPTIONS]" in " ".join(shown.stdout.split())


def test_every_command_module_is_in_the_table():
    modules = {p.stem for p in (ROOT / "vitconvert" / "cli").glob("*.py")} - {"__init__", "common"}
    assert modules == {module for module, _, _ in COMMANDS.values()}
