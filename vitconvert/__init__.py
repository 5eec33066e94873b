"""vitconvert: pretrained softmax ViTs -> linear-attention ViTs (copy the same, distill the difference)."""

__version__ = "0.1.0"

from .attention import VARIANTS  # noqa: E402
from .convert import convert  # noqa: E402
from .folder import load, save  # noqa: E402
from .timm_registry import register as _register_with_timm  # noqa: E402,F401  (import registers with timm)

__all__ = ["VARIANTS", "convert", "load", "save", "__version__"]
