"""vitconvert: pretrained softmax ViTs -> linear-attention ViTs (copy the same, distill the difference).

The public API below is bound by name on first use (PEP 562), so ``import vitconvert`` costs milliseconds and is
the same in every process: the ``vitconvert`` command imports this package too, and its ``--help`` and
``--version`` must not wait for torch and timm. ``import vitconvert`` also registers vitconvert's models with timm
(``timm.create_model("local-dir:F")`` then builds the linear model): at once if timm is already imported, else the
moment it is (:mod:`.registration`).
"""

from importlib import import_module as _import_module
from typing import Any as _Any

from . import registration as _registration
from .version import __version__

# public name -> (module that defines it, attribute; None for the module itself)
_API: dict[str, tuple[str, _Any]] = {
    "VARIANTS": ("attention", "VARIANTS"),
    "convert": ("conversion", "convert"),
    "convert_source": ("convert_job", "convert_source"),
    "hybrid": ("hybrid", None),
    "load": ("loading", "load"),
    "save": ("folder", "save"),
}
__all__ = [*_API, "__version__"]


def __getattr__(name: str) -> _Any:
    """The public API, imported when first asked for."""
    if name not in _API:
        raise AttributeError(f"module 'vitconvert' has no attribute {name!r}")
    _registration.check_dependencies()  # an old timm is one line, not an error from inside the import
    module, attribute = _API[name]
    value = _import_module(f"{__name__}.{module}")
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


_registration.register_with_timm()
