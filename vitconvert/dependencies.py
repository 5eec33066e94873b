"""The installed dependencies against the versions vitconvert declares (pyproject.toml, read back from the installed
package's metadata, so the floors have one home).

pip checks them when it installs vitconvert, but not in an environment put together otherwise (conda, ``pip install
--no-deps``, a later downgrade). There an older timm or typer does not fail cleanly: timm 1.0.20 stops ``import
vitconvert`` with an AttributeError, timm 1.0.23 saves a folder without the model's arguments (read back, its
weights "do not fit"), and typer 0.12 with click 8.5 prints the version instead of running a command. So vitconvert
says which package is too old, in one line, before anything else runs.
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import Optional

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from .errors import VitconvertError

SKIP_ENV = "VITCONVERT_SKIP_DEPENDENCY_CHECK"  # =1: run anyway (a container whose torch cannot be upgraded)


def declared(distribution: str = "vitconvert") -> list[Requirement]:
    """The run-time requirements of the installed ``distribution`` (no extras); none when it is not installed (a
    source tree on ``sys.path``), where there is nothing pip recorded to check against."""
    try:
        lines = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            found.append(requirement)
    return found


def satisfied(requirement: Requirement, installed: str) -> bool:
    """Whether version ``installed`` meets ``requirement``, judged by its release: a pre-release or local build of a
    version counts as that version (NVIDIA's containers ship torch ``2.6.0a0+ecf3bae``, pytorch.org ``2.6.0+cu124``)."""
    try:
        release = Version(installed).base_version
    except InvalidVersion:
        return True  # a version string packaging cannot read: not ours to refuse
    return requirement.specifier.contains(release, prereleases=True)


def unmet(distribution: str = "vitconvert") -> list[tuple[Requirement, Optional[str]]]:
    """Each requirement the environment does not meet, with the version installed (None: not installed)."""
    problems: list[tuple[Requirement, Optional[str]]] = []
    for requirement in declared(distribution):
        try:
            installed: Optional[str] = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed is None or not satisfied(requirement, installed):
            problems.append((requirement, installed))
    return problems


def check(distribution: str = "vitconvert") -> None:
    """Raise one line naming every dependency that is missing or too old, and the pip command that fixes them:
    ``vitconvert needs timm>=1.0.31 (this environment has timm 1.0.25): pip install -U 'timm>=1.0.31' (or set
    VITCONVERT_SKIP_DEPENDENCY_CHECK=1 ...)``; that variable skips the check."""
    if os.environ.get(SKIP_ENV, "").strip() == "1":
        return
    problems = unmet(distribution)
    if problems:
        needs = ", ".join(str(requirement) for requirement, _ in problems)
        has = ", ".join(f"{requirement.name} {installed}" if installed else f"no {requirement.name}"
                        for requirement, installed in problems)
        fix = " ".join(f"'{requirement}'" for requirement, _ in problems)
        raise VitconvertError(f"{distribution} needs {needs} (this environment has {has}): pip install -U {fix} "
                              f"(or set {SKIP_ENV}=1 to run on these at your own risk)")
