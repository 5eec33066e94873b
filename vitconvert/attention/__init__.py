"""The linear-attention variants, behind one registry: name -> class."""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import LinearAttention
from .inline import InLineAttention
from .kernel import EluAttention, ReluAttention
from .mhla import MHLAttention
from .ttt import TTTAttention

VARIANTS: dict[str, type[LinearAttention]] = {
    "elu": EluAttention,
    "relu": ReluAttention,
    "inline": InLineAttention,
    "mhla": MHLAttention,
    "ttt": TTTAttention,
}


def build(name: str, like: nn.Module, **kwargs: Any) -> LinearAttention:
    """A ``name`` variant shaped like the softmax module ``like``, extra parameters default-initialised."""
    if name not in VARIANTS:
        raise KeyError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}")
    return VARIANTS[name].from_softmax(like, **kwargs)


__all__ = ["VARIANTS", "LinearAttention", "build"]
