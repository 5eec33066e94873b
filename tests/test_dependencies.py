"""The installed dependencies against pyproject's floors: a too-old package is one line naming it (the command) or an
ImportError saying the same (the library), before an import fails somewhere inside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from vitconvert import dependencies
from vitconvert.errors import VitconvertError


def fake_distribution(root: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A ``NAME-VERSION.dist-info`` that importlib.metadata finds first on ``sys.path`` (as pip would leave it)."""
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_unmet_names_what_is_too_old_or_missing_and_skips_extras(tmp_path, monkeypatch):
    fake_distribution(tmp_path, "fakeapp", "1.0", ("oldlib>=2.0", "newlib>=1.0", "absentlib>=1",
                                                   "gpuonly>=9; extra == 'gpu'"))
    fake_distribution(tmp_path, "oldlib", "1.5")
    fake_distribution(tmp_path, "newlib", "1.2")
    fake_distribution(tmp_path, "gpuonly", "1.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [(str(r), v) for r, v in dependencies.unmet("fakeapp")] == [("oldlib>=2.0", "1.5"), ("absentlib>=1", None)]
    with pytest.raises(VitconvertError) as info:
        dependencies.check("fakeapp")
    assert str(info.value) == ("fakeapp needs oldlib>=2.0, absentlib>=1 (this environment has oldlib 1.5, no "
                               "absentlib): pip install -U 'oldlib>=2.0' 'absentlib>=1' (or set "
                               "VITCONVERT_SKIP_DEPENDENCY_CHECK=1 to run on these at your own risk)")
    monkeypatch.setenv(dependencies.SKIP_ENV, "1")
    dependencies.check("fakeapp")  # the user's call: a container whose packages cannot change


@pytest.mark.parametrize("installed, ok", [("2.8.0", True), ("2.8.0+cu128", True), ("2.8.0a0+ecf3bae", True),
                                           ("2.10.1", True), ("2.7.1", False), ("2.7.1+cpu", False)])
def test_builds_and_pre_releases_count_as_their_release(installed, ok):
    """NVIDIA's containers ship torch 2.8.0a0+..., pytorch.org 2.8.0+cu128: both are torch 2.8 to a user."""
    assert dependencies.satisfied(Requirement("torch>=2.8"), installed) is ok


def test_not_installed_means_nothing_to_check():
    assert dependencies.declared("no-such-distribution-here") == []
    dependencies.check("no-such-distribution-here")


def test_this_environment_meets_every_floor():
    """The suite runs against what it declares (CI installs from pyproject; a floor above it would fail here)."""
    assert dependencies.declared(), "vitconvert is not installed (pip install -e .)"
    assert dependencies.unmet() == []


def test_an_old_timm_is_one_line_from_the_command_and_an_import_error_from_the_library(tmp_path):
    """The path a user takes: the console script and ``import vitconvert`` in a fresh process whose metadata says
    timm is older than the floor (timm 1.0.20, say, fails inside ``import vitconvert`` with an AttributeError)."""
    floor = next(r for r in dependencies.declared() if r.name == "timm")
    fake_distribution(tmp_path / "site", "timm", "0.9.16")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    script = Path(sys.executable).with_name("vitconvert")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "vitconvert"]
    expected = (f"vitconvert needs {floor} (this environment has timm 0.9.16): pip install -U '{floor}' (or set "
                f"{dependencies.SKIP_ENV}=1 to run on these at your own risk)")

    run = subprocess.run([*command, "convert", "digits", "--to", "elu", "--out", str(tmp_path / "out")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.strip() == f"error: {expected}", run.stderr
    assert not (tmp_path / "out").exists()

    version = subprocess.run([*command, "--version"], env=env, capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("vitconvert ")  # says what is installed regardless

    # skipped on request, the command runs: here to its own refusal of a model name, which is also the installed
    # console script's way out of an error after torch and timm load (one line, exit 1, no traceback)
    anyway = subprocess.run([*command, "convert", "deit_smal", "--to", "elu"], env={**env, dependencies.SKIP_ENV: "1"},
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert anyway.returncode == 1 and anyway.stderr.count("\n") == 1 and "Traceback" not in anyway.stderr
    assert anyway.stderr.startswith("error: unknown model 'deit_smal'; did you mean deit_small"), anyway.stderr

    for code in ("import vitconvert, timm", "import vitconvert; vitconvert.load"):  # registering, the API
        library = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert library.returncode == 1 and f"ImportError: {expected}" in library.stderr, (code, library.stderr)
