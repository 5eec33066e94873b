"""The variant registry: the one list of linear-attention variants, filled by the variant classes themselves.

A variant file decorates its class with :func:`register_variant`; everything else (the CLI's choices and help,
``vitconvert list``, the quickstart's defaults, timm's entrypoints, the model card's citation, the benchmarks)
reads :data:`VARIANTS`. Layers above that must act on each new variant (timm's model registry) subscribe with
:func:`on_register` instead of being imported from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional, TypeVar

from ..errors import BadValue
from .base import LinearAttention
from .options import in_effect

VARIANTS: dict[str, type[LinearAttention]] = {}
_LISTENERS: list[Callable[[str, type[LinearAttention]], None]] = []
V = TypeVar("V", bound=type[LinearAttention])


def register_variant(cls: V) -> V:
    """Class decorator: add ``cls`` under its ``variant`` name (and tell the listeners)."""
    name = cls.variant
    if not name or not name.isidentifier():
        raise ValueError(f"{cls.__name__}.variant must be a lowercase identifier, got {name!r}")
    if name in VARIANTS and VARIANTS[name] is not cls:
        raise ValueError(f"variant {name!r} is already registered ({VARIANTS[name].__name__})")
    VARIANTS[name] = cls
    for listener in _LISTENERS:
        listener(name, cls)
    return cls


def variant_class(name: str, param: str = "to") -> type[LinearAttention]:
    """The class registered as ``name``; the one place an unknown variant name is refused (``param`` is the
    caller's parameter that gave it, so the CLI names its flag)."""
    cls = VARIANTS.get(name)
    if cls is None:
        raise BadValue(param, f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}")
    return cls


def shown_options(variant: Optional[str], options: Mapping[str, Any]) -> dict[str, Any]:
    """A variant's options as shown to people: without those that do nothing under the others (options.in_effect);
    an unknown variant's as given."""
    cls = VARIANTS.get(variant or "")
    return in_effect(cls.declared_options, options) if cls is not None else dict(options)


def variant_names(text: str, param: str) -> list[str]:
    """A comma-separated list of variants (``"elu,mhla,elu"`` -> ["elu", "mhla"]): each known, each once, at
    least one."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise BadValue(param, f"needs at least one variant, e.g. {','.join(list(VARIANTS)[:2])}")
    for name in names:
        variant_class(name, param)
    return names


def unregister_variant(name: str) -> None:
    """Remove a variant (tests and plugins that register one for a while); listeners are not called."""
    VARIANTS.pop(name, None)


def on_register(listener: Callable[[str, type[LinearAttention]], None]) -> None:
    """Call ``listener(name, cls)`` for every variant registered so far and every later one."""
    _LISTENERS.append(listener)
    for name, cls in list(VARIANTS.items()):
        listener(name, cls)
