"""Short names users type for timm models (``deit_small``) and did-you-mean suggestions for unknown ones."""

from __future__ import annotations

import difflib
from functools import lru_cache

import timm

BUNDLED = ("digits",)  # model folders shipped in the package (sources.bundled_folder)

ALIASES: dict[str, str] = {
    "deit_tiny": "deit_tiny_patch16_224",
    "deit_small": "deit_small_patch16_224",
    "deit_base": "deit_base_patch16_224",
    "deit_tiny_distilled": "deit_tiny_distilled_patch16_224",
    "deit_small_distilled": "deit_small_distilled_patch16_224",
    "deit_base_distilled": "deit_base_distilled_patch16_224",
    "deit3_small": "deit3_small_patch16_224",
    "deit3_base": "deit3_base_patch16_224",
    "vit_tiny": "vit_tiny_patch16_224",
    "vit_small": "vit_small_patch16_224",
    "vit_base": "vit_base_patch16_224",
    "vit_large": "vit_large_patch16_224",
    "dinov2_small": "vit_small_patch14_dinov2",
    "dinov2_base": "vit_base_patch14_dinov2",
    "eva02_tiny": "eva02_tiny_patch14_224",
    "eva02_small": "eva02_small_patch14_224",
    "beit_base": "beit_base_patch16_224",
    "clip_base": "vit_base_patch16_clip_224",
    "siglip_base": "vit_base_patch16_siglip_224",
}


@lru_cache(maxsize=1)
def _known_names() -> tuple[str, ...]:
    return tuple(timm.list_models()) + tuple(ALIASES) + BUNDLED


def resolve_alias(name: str) -> str:
    """The timm name behind a short alias (``deit_small``); any other name passes through unchanged."""
    return ALIASES.get(name, name)


def suggest(name: str) -> str:
    """The tail of an unknown-name error: the closest known names, so a typo costs one retry, not a search."""
    close = difflib.get_close_matches(name, _known_names(), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else "; see `vitconvert list` for aliases"
