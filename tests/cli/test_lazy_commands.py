"""``vitconvert --help`` and ``--version`` load neither torch nor timm (they took seconds when they did); every
command is still listed with its docstring's summary and still runs and shows its own help."""

from __future__ import annotations

import inspect
import json
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


HELP_PROBE = """
import contextlib, io, json, sys
from vitconvert.cli import main
shown = {{}}
for name in sys.argv[1:]:  # each command's --help in turn, as the console script runs it
    sys.argv, out, code = ["vitconvert", name, "--help"], io.StringIO(), 0
    with contextlib.redirect_stdout(out):
        try:
            main()
        except SystemExit as e:
            code = e.code or 0
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})  # (so far: the first to import one shows)
    shown[name] = {{"code": code, "stdout": out.getvalue(), "heavy": heavy}}
print(json.dumps(shown))
"""


@pytest.fixture(scope="module")
def every_help(tmp_path_factory) -> tuple[dict, set[str]]:
    """Every command's --help in one process: torch and timm, once imported, stay, so none imported them if none
    is there after the last one."""
    script = tmp_path_factory.mktemp("help") / "vitconvert"
    script.write_text(HELP_PROBE.format(heavy=sorted(HEAVY)))
    done, names = imported_modules([str(script), *COMMANDS])
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout), names


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_help_imports_neither_torch_nor_timm(every_help, name):
    """``vitconvert CMD --help`` is as quick as ``vitconvert --help``: it took 10-15 s when it imported torch."""
    shown, names = every_help
    done = shown[name]
    assert done["code"] == 0 and f"vitconvert {name} [OPTIONS]" in " ".join(done["stdout"].split()), done
    assert done["heavy"] == [] and not names & HEAVY, f"{name} --help imported {done['heavy'] or sorted(names & HEAVY)}"


def test_help_names_the_variants_the_registry_holds():
    """--help lists the variants without importing them (SHIPPED_VARIANTS); the registry is the truth."""
    from vitconvert.attention import VARIANTS
    from vitconvert.cli.common import LINEAR_MODEL_HELP, SHIPPED_VARIANTS
    from vitconvert.loading import LINEAR_FORMS

    assert list(SHIPPED_VARIANTS) == list(VARIANTS)
    assert LINEAR_MODEL_HELP == LINEAR_FORMS


ARGV_PROBE = """
import json, sys
sys.argv = {argv!r}
import vitconvert
print(json.dumps({{"dir": dir(vitconvert), "torch": "torch" in sys.modules}}))
"""


def test_import_vitconvert_is_the_same_whatever_the_command_line():
    """``import vitconvert`` binds the same names (lazily, PEP 562) as a library, as the console script and as
    ``python -m vitconvert``: it used to read sys.argv to decide."""
    seen = []
    for argv in (["-c"], ["/usr/bin/vitconvert", "convert"], ["-m", "convert"], []):
        done = subprocess.run([sys.executable, "-c", ARGV_PROBE.format(argv=argv)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        seen.append(json.loads(done.stdout))
    assert all(s == seen[0] for s in seen), seen
    assert not seen[0]["torch"]  # the public names load on first use
    assert {"convert", "convert_source", "load", "save", "hybrid", "VARIANTS", "__version__"} <= set(seen[0]["dir"])
    assert "importlib" not in seen[0]["dir"] and "sys" not in seen[0]["dir"]


ORDER_PROBE = """
import json, os, sys
import torch, torchvision.ops  # what timm and vitconvert both import below them: loaded once, before the forks
assert not {m.split(".")[0] for m in sys.modules} & {"timm", "vitconvert"}, "the orders must start from neither"
shown = {}
for code in json.loads(sys.argv[1]):  # each order in a fresh child: the first import of timm and vitconvert there
    sys.stdout.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 1)
        exec(compile(code, "<order>", "exec"), {"__name__": "__main__"})
        sys.stdout.flush()
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as out:
        printed = out.read()
    shown[code] = {"exit": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), "stdout": printed}
print(json.dumps(shown))
"""
CHECK = ("import timm, vitconvert\nprint(timm.is_model('vitconvert_mhla'), callable(vitconvert.convert), "
         "type(vitconvert.hybrid).__name__)")
FIRSTS = ("import timm, vitconvert", "import vitconvert.surgery, vitconvert.sources",
          "from vitconvert.attention import VARIANTS")
# the first import of a process -> what the process runs
ORDERS = {"import vitconvert, timm": "import vitconvert, timm\nprint(timm.is_model('vitconvert_elu'), "
                                     "callable(vitconvert.convert))",
          **{first: f"{first}\n{CHECK}" for first in FIRSTS}}


@pytest.fixture(scope="module")
def import_orders() -> dict[str, dict]:
    """Each order of ORDERS in a process of its own that imported neither timm nor vitconvert before: one Python
    imports torch and torchvision (seconds, and no part of the order) and forks a child per order."""
    done = subprocess.run([sys.executable, "-c", ORDER_PROBE, json.dumps(list(ORDERS.values()))], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout)
    return {first: {**shown[code], "stderr": done.stderr[-2000:]} for first, code in ORDERS.items()}


def test_import_vitconvert_still_registers_the_variants_with_timm(import_orders):
    """Outside the command, ``import vitconvert`` alone lets timm build the linear models (README's snippet)."""
    done = import_orders["import vitconvert, timm"]
    assert done["exit"] == 0 and done["stdout"].split() == ["True", "True"], done


@pytest.mark.parametrize("first", FIRSTS)
def test_timm_knows_the_variants_whichever_is_imported_first(import_orders, first):
    """``import vitconvert`` registers with timm when timm is imported, whoever imports it first (a vitconvert
    module that imports timm itself included: surgery imports ``timm.layers``, sources ``timm``; one process
    for both, as they reach timm the same way, through vitconvert's import watch), and ``vitconvert.convert`` is
    the function, not a module."""
    done = import_orders[first]
    assert done["exit"] == 0 and done["stdout"].split() == ["True", "True", "module"], done
