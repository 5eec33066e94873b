"""vitconvert: pretrained softmax ViTs -> linear-attention ViTs (copy the same, distill the difference).

``import vitconvert`` registers vitconvert's models with timm (so ``timm.create_model("local-dir:F")`` builds
the linear model) and binds the public API. The ``vitconvert`` command itself skips both, so that ``--help``
and ``--version`` load neither torch nor timm: each command imports what it needs (the library modules that
read folders register with timm themselves), and the API names load on first use.
"""

import sys as _sys


def _is_command_line() -> bool:
    """Whether this process is the ``vitconvert`` command: the console script, or ``python -m vitconvert`` (also
    as torchrun runs it), for which Python imports this package while ``sys.argv[0]`` is still ``-m``."""
    if not _sys.argv:
        return False
    if _sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".exe") == "vitconvert":
        return True
    if _sys.argv[0] != "-m":
        return False
    args = getattr(_sys, "orig_argv", [])
    for i, arg in enumerate(args[1:], 1):
        if arg.startswith("-m"):
            module = arg[2:] or (args[i + 1] if i + 1 < len(args) else "")
            return module in ("vitconvert", "vitconvert.__main__")
    return False


_COMMAND_LINE = _is_command_line()
if _COMMAND_LINE:
    def _interrupted(kind, value, tb):  # Ctrl-C while Python starts the command is one line, not a traceback
        if issubclass(kind, KeyboardInterrupt):
            print("error: interrupted", file=_sys.stderr)
        else:
            _sys.__excepthook__(kind, value, tb)

    _sys.excepthook = _interrupted

import importlib  # noqa: E402
from typing import Any as _Any  # noqa: E402

from .version import __version__  # noqa: E402

__all__ = ["VARIANTS", "convert", "convert_source", "hybrid", "load", "save", "__version__"]


def _public_api() -> dict[str, _Any]:
    from .dependencies import check  # lazy: start-up time
    from .errors import VitconvertError  # lazy: start-up time

    try:  # before anything imports timm: an old timm fails inside the import, not with a message
        check()
    except VitconvertError as e:
        raise ImportError(str(e)) from None
    from . import timm_registry  # noqa: F401  # lazy: start-up time (importing it registers the variants with timm)
    from .attention import VARIANTS  # lazy: start-up time
    from .convert import convert  # lazy: start-up time
    from .convert_job import convert_source  # lazy: start-up time
    from .folder import save  # lazy: start-up time
    from .loading import load  # lazy: start-up time

    # vitconvert.hybrid after `import vitconvert`; import_module, as `from . import hybrid` would ask this
    # module's __getattr__ for it first, which calls back here
    hybrid = importlib.import_module(f"{__name__}.hybrid")
    return {"VARIANTS": VARIANTS, "convert": convert, "convert_source": convert_source, "hybrid": hybrid,
            "load": load, "save": save}


def __getattr__(name: str) -> _Any:
    """The public API in the command's process, loaded on first use (PEP 562)."""
    if name not in __all__:
        raise AttributeError(f"module 'vitconvert' has no attribute {name!r}")
    globals().update(_public_api())
    return globals()[name]


if not _COMMAND_LINE:
    globals().update(_public_api())
