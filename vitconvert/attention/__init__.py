"""The linear-attention variants, behind one registry: name -> class (registry.py).

Importing a variant's file registers it; the order of the imports below is the order users see.
"""

# isort: off
from . import kernel  # noqa: F401  (registers elu, relu)
from . import inline  # noqa: F401
from . import mhla  # noqa: F401
from . import ttt  # noqa: F401
# isort: on

from .base import LinearAttention
from .registry import (
    VARIANTS,
    on_register,
    register_variant,
    shown_options,
    unregister_variant,
    variant_class,
    variant_names,
)

__all__ = ["VARIANTS", "LinearAttention", "on_register", "register_variant", "shown_options", "unregister_variant",
           "variant_class", "variant_names"]
