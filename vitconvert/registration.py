"""When ``import vitconvert`` registers its models with timm: at once if timm is imported, else the moment it is.

Registering needs timm, and importing timm takes seconds (it imports torch); ``import vitconvert`` should not, as
the ``vitconvert`` command's ``--help`` imports this package too. So the package leaves a finder on
``sys.meta_path`` that lets timm (and vitconvert's variants) import as usual and then imports
:mod:`.timm_registry`, which registers every variant with timm. It does so once both are loaded, from whichever
finishes last: a vitconvert module may import timm while it is half-imported. Either order of
``import vitconvert`` and ``import timm`` then gives the same timm, whoever imports timm first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from types import ModuleType
from typing import Any, Optional

PACKAGE = __name__.rpartition(".")[0]
REGISTRY_MODULE = f"{PACKAGE}.timm_registry"
# the vitconvert modules timm_registry imports that import timm themselves: one of them may be the first to import
# timm, and timm_registry cannot be imported while it is half-imported
PREREQUISITES = (f"{PACKAGE}.attention", f"{PACKAGE}.surgery")
WATCHED = ("timm", *PREREQUISITES)
_loaded: set[str] = set()  # of WATCHED, those whose import has finished in this process


def check_dependencies() -> None:
    """The installed torch, timm, ... against vitconvert's floors, as an ImportError (the library's side of
    :func:`.dependencies.check`, which the command reports as one ``error:`` line)."""
    from .dependencies import check  # lazy: start-up time (reads the installed packages' metadata)
    from .errors import VitconvertError  # lazy: start-up time

    try:
        check()
    except VitconvertError as e:
        raise ImportError(str(e)) from None


def _finished(name: str) -> None:
    """``name`` (timm or a prerequisite) is imported: register once timm is and no prerequisite is half-imported."""
    _loaded.add(name)
    if "timm" not in _loaded or any(m in sys.modules and m not in _loaded for m in PREREQUISITES):
        return  # the last of them to finish registers
    importlib.import_module(REGISTRY_MODULE)  # lazy: start-up time (importing it registers the variants)


class _Loader(importlib.abc.Loader):
    """A watched module's own loader, then :func:`_finished`."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self.loader, self.name = loader, name

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _finished(self.name)

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: the module's own loader answers
        return getattr(self.loader, name)


class _Watch(importlib.abc.MetaPathFinder):
    """Finds timm and the prerequisites as the other finders do, with a loader that calls :func:`_finished` after."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in WATCHED or name in _loaded:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            if name == "timm":
                check_dependencies()  # before timm runs: an old timm fails inside the registration, not in one line
            spec.loader = _Loader(spec.loader, name)
        return spec


def register_with_timm() -> None:
    """Register now if timm is imported, else when it is (once per process, whoever imports it first)."""
    if "timm" in sys.modules:
        check_dependencies()
        importlib.import_module(REGISTRY_MODULE)  # lazy: start-up time
    elif not any(isinstance(finder, _Watch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Watch())
