"""vitconvert: pretrained softmax ViTs -> linear-attention ViTs (copy the same, distill the difference)."""

import sys as _sys

from .version import __version__

if _sys.argv and _sys.argv[0].rsplit("/", 1)[-1] == "vitconvert":  # the console script: Ctrl-C while torch and
    def _interrupted(kind, value, tb):  # timm import (before any command runs) is one line, not a traceback
        if issubclass(kind, KeyboardInterrupt):
            print("error: interrupted", file=_sys.stderr)
        else:
            _sys.__excepthook__(kind, value, tb)

    _sys.excepthook = _interrupted

from . import hybrid  # noqa: E402  (vitconvert.hybrid.choose_softmax_layers, after `import vitconvert`)
from . import timm_registry as _timm_registry  # noqa: E402,F401  (importing it registers the variants with timm)
from .attention import VARIANTS  # noqa: E402
from .convert import convert  # noqa: E402
from .folder import save  # noqa: E402
from .loading import load  # noqa: E402

__all__ = ["VARIANTS", "convert", "hybrid", "load", "save", "__version__"]
