"""A recipe in words: what ``distill`` prints at its start, and what changed when a run resumes under another."""

from __future__ import annotations

from typing import Any

from .errors import plural
from .recipes import Recipe, stored_leaves


def recipe_summary(r: Recipe) -> list[str]:
    """The lines ``distill`` prints at its start: what will run, so a wrong schedule shows before it costs."""
    a, s, o = r.augmentation, r.schedule, r.optimization
    augment = [name for name, on in (("RandAugment " + str(a.rand_augment), bool(a.rand_augment)),
                                     ("mixup", a.mixup > 0), ("cutmix", a.cutmix > 0), ("erasing", a.reprob > 0),
                                     ("colour jitter", bool(a.color_jitter)), ("hflip", a.hflip > 0))
               if on]
    crops = [] if a.no_aug else [f"random crops (area {a.scale[0]:g}-{a.scale[-1]:g})"]
    lines = [f"recipe {r.name or '(default)'}: {plural(s.epochs, 'epoch')}, warm-up {s.warmup_epochs} "
             f"(lr {s.warmup_lr:g} -> peak {s.lr:g}, cosine to {s.min_lr:g}), batch {o.batch_size}"
             + (f" ({o.accum_steps} accumulation steps)" if o.accum_steps > 1 else ""),
             "augmentation: " + (", ".join(crops + augment) if crops + augment else "off")]
    if s.schedule_scaled:
        lines.append(f"scaled with --epochs: {s.schedule_scaled}")
    return lines


def recipe_changes(old: dict[str, Any], new: Recipe) -> list[str]:
    """What differs between a recipe dict a run stored (in sections, or flat as older runs stored it) and
    ``new``, ignoring operational fields: ``key: a -> b``, each key as the field's own name."""
    then, now, defaults = stored_leaves(old), new.leaves(), Recipe().leaves()
    skip = new.operational()
    keys = [k for k in {**now, **then} if k not in skip and then.get(k, defaults.get(k)) != now.get(k)]
    return [f"{short(k)}: {then.get(k)!r} -> {now.get(k)!r}" for k in keys]


def short(path: str) -> str:
    """``schedule.lr`` -> ``lr``, ``optimization.new_params.lr_scale`` -> ``new_params.lr_scale``: field names are
    unique across sections, and the name is what a user writes (flat or in its section)."""
    return path.partition(".")[2] if "." in path else path
