"""A recipe in words: what ``distill`` prints at its start, and what changed when a run resumes under another."""

from __future__ import annotations

from typing import Any

from .errors import plural
from .recipes import OPERATIONAL, Recipe


def recipe_summary(r: Recipe) -> list[str]:
    """The lines ``distill`` prints at its start: what will run, so a wrong schedule shows before it costs."""
    augment = [name for name, on in (("RandAugment " + str(r.rand_augment), bool(r.rand_augment)),
                                     ("mixup", r.mixup > 0), ("cutmix", r.cutmix > 0), ("erasing", r.reprob > 0),
                                     ("colour jitter", bool(r.color_jitter)), ("hflip", r.hflip > 0))
               if on]
    crops = [] if r.no_aug else [f"random crops (area {r.scale[0]:g}-{r.scale[-1]:g})"]
    lines = [f"recipe {r.name or '(default)'}: {plural(r.epochs, 'epoch')}, warm-up {r.warmup_epochs} "
             f"(lr {r.warmup_lr:g} -> peak {r.lr:g}, cosine to {r.min_lr:g}), batch {r.batch_size}"
             + (f" ({r.accum_steps} accumulation steps)" if r.accum_steps > 1 else ""),
             "augmentation: " + (", ".join(crops + augment) if crops + augment else "off")]
    if r.schedule_scaled:
        lines.append(f"scaled with --epochs: {r.schedule_scaled}")
    return lines


def recipe_changes(old: dict[str, Any], new: Recipe) -> list[str]:
    """What differs between a stored recipe dict and ``new``, ignoring operational fields: ``key: a -> b``."""
    current, defaults = new.to_dict(), Recipe().to_dict()

    def stored(k: str) -> Any:  # a mapping stored before it gained a sub-key has that sub-key's default
        value = old.get(k, defaults[k])
        return {**defaults[k], **value} if isinstance(value, dict) and isinstance(defaults[k], dict) else value

    keys = [k for k in current if k not in OPERATIONAL and stored(k) != current[k]]
    return [f"{k}: {old.get(k)!r} -> {current[k]!r}" for k in keys]
