"""The checks a recipe passes before anything runs or is written: ranges, and names against timm's registries.

``Recipe.__post_init__`` checks types and the fields vitconvert itself reads; this file checks what timm will
read later (an optimizer name, a scheduler, a clip mode, an augmentation string, probabilities), so a typo
fails in a second with the field's name and its valid values, not minutes later inside timm, and not after a
run folder was created. Names are checked by asking timm itself (its registries, its parsers), so what timm
accepts is what passes.
"""

from __future__ import annotations

import difflib
import math
import re
import warnings
from collections.abc import Callable
from typing import Any, Optional

from .errors import VitconvertError, first_line

STAGES = ("joint", "attn", "finetune")

PROBABILITIES = ("hflip", "reprob", "mixup_prob", "mixup_switch_prob", "momentum", "ema_decay")
NON_NEGATIVE = ("min_lr", "warmup_lr", "color_jitter", "mixup", "cutmix", "weight_decay", "attn_weight", "kd_weight",
                "warmup_epochs", "workers", "seed")
CLIP_MODES = ("norm", "value", "agc")  # timm.utils.dispatch_clip_grad
REMODES = ("pixel", "rand", "const")  # timm.data.RandomErasing


def _fail(field: str, value: Any, rule: str) -> VitconvertError:
    return VitconvertError(f"recipe {field}: {value!r} {rule}")


def _one_of(field: str, value: str, valid: list[str]) -> VitconvertError:
    close = difflib.get_close_matches(value, valid, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return VitconvertError(f"recipe {field}: unknown {value!r}; {hint}valid: {', '.join(valid)}")


def check_numbers(r: Any) -> None:
    """Every number finite, probabilities in [0, 1], the learning rate positive, ranges ordered."""
    check_finite(r)
    check_learning_rate(r)
    check_ranges(r)
    check_shapes(r)


def check_finite(r: Any) -> None:
    for name, value in vars(r).items():
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise _fail(name, value, "is not a finite number")


def check_learning_rate(r: Any) -> None:
    """lr positive, min_lr below it; the seed and name, which name and seed the run."""
    if r.lr <= 0:
        raise _fail("lr", r.lr, "must be a positive number")
    if isinstance(r.seed, int) and r.seed >= 2 ** 63:
        raise _fail("seed", r.seed, "must be below 2**63 (torch's generators take a 64-bit seed)")
    if r.name is not None and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", str(r.name)):
        raise _fail("name", r.name, "must be a plain name (letters, digits, _ . + -; no '/' or '..'): it names "
                                    "the run folder under runs/")
    if r.min_lr > r.lr:
        raise _fail("min_lr", r.min_lr, f"is above the peak lr ({r.lr})")


def check_ranges(r: Any) -> None:
    """Probabilities in [0, 1], the non-negative fields not negative, clipping and cropping positive."""
    for name in PROBABILITIES:
        if not 0 <= getattr(r, name) <= 1:
            raise _fail(name, getattr(r, name), "is a probability: it must be between 0 and 1")
    if not 0 <= r.smoothing < 1:
        raise _fail("smoothing", r.smoothing, "must be in [0, 1) (label smoothing)")
    for name in NON_NEGATIVE:
        value = getattr(r, name)
        if value is not None and value < 0:
            raise _fail(name, value, "must not be negative")
    if r.clip_grad is not None and r.clip_grad <= 0:
        raise _fail("clip_grad", r.clip_grad, "must be positive, or null for no clipping")
    if r.crop_pct is not None and not 0 < r.crop_pct <= 1:
        raise _fail("crop_pct", r.crop_pct, "must be in (0, 1]")


def check_shapes(r: Any) -> None:
    """scale an ordered [min, max]; mean and std one value or one per channel, std positive."""
    if len(r.scale) != 2 or not 0 < r.scale[0] <= r.scale[1]:
        raise _fail("scale", list(r.scale), "must be [min, max] with 0 < min <= max (RandomResizedCrop area range)")
    for name in ("mean", "std"):
        value = getattr(r, name)
        if value is not None and len(value) not in (1, 3):
            raise _fail(name, list(value), "must have 1 or 3 values (one per channel)")
    if r.std is not None and min(r.std) <= 0:
        raise _fail("std", list(r.std), "must be positive")


def check_optimizer(r: Any) -> None:
    import torch
    from timm.optim import create_optimizer_v2, get_optimizer_info, list_optimizers

    try:
        create_optimizer_v2(torch.nn.Linear(1, 1), opt=r.opt, lr=r.lr, weight_decay=r.weight_decay,
                            momentum=r.momentum)
    except ValueError as e:
        if "registry" in str(e) or "not found" in str(e).lower():
            raise _one_of("opt", r.opt, list_optimizers()) from None
        raise _fail("opt", r.opt, f"is refused by timm ({str(e).strip() or type(e).__name__})") from None
    except (AssertionError, ImportError) as e:  # CUDA-only (bitsandbytes, APEX) on a CPU, or not installed
        raise _fail("opt", r.opt, f"cannot run on this machine ({first_line(e)}); choose another, e.g. adamw") from None
    except Exception:  # the name is known and its own checks passed: the toy model above is what failed
        pass
    if get_optimizer_info(r.opt.lower().removeprefix("lookahead_")).second_order:
        raise _fail("opt", r.opt, "is a second-order optimizer: it needs a backward that keeps its graph "
                                  "(create_graph), which distill does not run; choose a first-order one, e.g. adamw")


def check_scheduler(r: Any) -> None:
    import torch
    from timm.scheduler import create_scheduler_v2

    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=r.lr)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            create_scheduler_v2(optimizer, sched=r.sched, num_epochs=r.epochs, min_lr=r.min_lr,
                                warmup_lr=r.warmup_lr, warmup_epochs=r.warmup_epochs)
    except ValueError:
        valid = [s for s in ("cosine", "tanh", "step", "multistep", "poly", "constant", "rsqrt", "wsd")
                 if _scheduler_known(s, optimizer)]
        raise _one_of("sched", r.sched, valid) from None
    if r.sched == "plateau":
        raise _fail("sched", r.sched, "steps on a validation metric once per epoch, which distill's schedule (set "
                                      "from the step count, warm-up first) does not feed; choose cosine, step, "
                                      "multistep, poly or constant")


def _scheduler_known(name: str, optimizer: Any) -> bool:
    from timm.scheduler import create_scheduler_v2

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            create_scheduler_v2(optimizer, sched=name, num_epochs=10)
    except Exception:
        return False
    return True


def check_names(r: Any) -> None:
    """clip_mode, remode, interpolation and the augmentation string, as timm reads them."""
    from timm.data.transforms import _str_to_pil_interpolation

    if r.clip_mode not in CLIP_MODES:
        raise _one_of("clip_mode", r.clip_mode, list(CLIP_MODES))
    if r.remode not in REMODES:
        raise _one_of("remode", r.remode, list(REMODES))
    interpolations = [*_str_to_pil_interpolation, "random"]
    if r.interpolation not in interpolations:
        raise _one_of("interpolation", r.interpolation, interpolations)
    if r.rand_augment:
        check_augment(r.rand_augment)


def check_augment(spec: str) -> None:
    """Build timm's own augmentation from the string (what create_transform does with it)."""
    from timm.data import create_transform

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            create_transform(32, is_training=True, auto_augment=spec)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise VitconvertError(f"recipe rand_augment: timm cannot read {spec!r} ({reason}); valid: rand-m9-mstd0.5-"
                              "inc1 style strings (rand-mN[-nN][-mstdX][-incN]), augmix-mN, original, v0, 3a, or "
                              "null for none") from None


CHECKS: tuple[Callable[[Any], None], ...] = (check_numbers, check_names, check_optimizer, check_scheduler)


def check_recipe(r: Any) -> None:
    """Run every check without moving any random generator (a recipe is built mid-run on --resume)."""
    import random

    import torch

    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            for check in CHECKS:
                check(r)
    finally:
        random.setstate(state)


def _named_stages(stages: str) -> list[tuple[str, Optional[int]]]:
    """"attn:5,finetune" -> [("attn", 5), ("finetune", None)]: each stage with its epochs, None where unsaid."""
    parts = [p.strip() for p in stages.split(",") if p.strip()]
    if not parts:
        raise VitconvertError("recipe stages is empty; use e.g. joint or attn:5,finetune")
    named: list[tuple[str, Optional[int]]] = []
    for part in parts:
        name, sep, count = part.partition(":")
        if name not in STAGES:
            raise VitconvertError(f"unknown stage {name!r} in {stages!r}; valid: {', '.join(STAGES)}")
        try:
            named.append((name, int(count) if sep else None))
        except ValueError:
            raise VitconvertError(f"stage {part!r}: the epoch count must be an integer") from None
    return named


def parse_stages(stages: str, epochs: int) -> tuple[tuple[str, int], ...]:
    """((stage, epochs), ...) summing to ``epochs``; stages without a count share what the others leave."""
    named = _named_stages(stages)
    free = [i for i, (_, e) in enumerate(named) if e is None]
    rest = epochs - sum(e for _, e in named if e is not None)
    if (free and rest < len(free)) or (not free and rest != 0):
        raise VitconvertError(f"stages {stages!r} do not fit in {epochs} epochs")
    plan = [(n, e or 0) for n, e in named]
    for rank, i in enumerate(free):
        plan[i] = (plan[i][0], rest // len(free) + (rank < rest % len(free)))
    if any(e < 1 for _, e in plan):
        raise VitconvertError(f"every stage in {stages!r} needs at least one epoch")
    return tuple(plan)
