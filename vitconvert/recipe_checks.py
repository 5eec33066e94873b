"""The rules a recipe's values obey, as small functions of values that the sections (recipe_sections.py) call
once, when each is built: ranges, choices, and the names timm reads later (an optimizer, a scheduler, an
interpolation, an augmentation string), checked against timm's registries and known lists so that a typo fails
in a second with the field's name and its valid values, not minutes later inside timm, and not after a run
folder was created. Nothing is built to validate a name: no optimizer over a toy model, no scheduler.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Any, Optional

from .errors import VitconvertError, first_line, plural

STAGES = ("joint", "attn", "finetune")
CLIP_MODES = ("norm", "value", "agc")  # timm.utils.dispatch_clip_grad
REMODES = ("pixel", "rand", "const")  # timm.data.RandomErasing
# timm.scheduler.create_scheduler_v2's names that distill's warm-up-first schedule runs (plateau: see below)
SCHEDULERS = ("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd")


def fail(field: str, value: Any, rule: str) -> VitconvertError:
    return VitconvertError(f"recipe {field}: {value!r} {rule}")


def one_of(field: str, value: str, valid: Sequence[str]) -> VitconvertError:
    close = difflib.get_close_matches(value, valid, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return VitconvertError(f"recipe {field}: unknown {value!r}; {hint}valid: {', '.join(valid)}")


def check_choice(field: str, value: str, valid: Sequence[str]) -> None:
    """A string vitconvert reads itself, against its few valid values."""
    if value not in valid:
        raise VitconvertError(f"recipe {field}: {value!r} is not one of {', '.join(valid)}")


def check_finite(field: str, value: Any) -> None:
    values = value if isinstance(value, tuple) else (value,)
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
        raise fail(field, value, "is not a finite number")


def check_at_least_one(field: str, value: int) -> None:
    if value < 1:
        raise VitconvertError(f"recipe {field} must be at least 1 (got {value})")


def check_probability(field: str, value: float) -> None:
    if not 0 <= value <= 1:
        raise fail(field, value, "is a probability: it must be between 0 and 1")


def check_not_negative(field: str, value: Optional[float]) -> None:
    if value is not None and value < 0:
        raise fail(field, value, "must not be negative")


def check_optimizer(name: str) -> None:
    """``name`` in timm's optimizer registry, importable on this machine, and first-order."""
    from timm.optim import get_optimizer_class, get_optimizer_info, list_optimizers

    base = name.lower().removeprefix("lookahead_")
    try:
        get_optimizer_class(base, bind_defaults=False)
    except ValueError:
        raise one_of("opt", name, list_optimizers()) from None
    except (AssertionError, ImportError) as e:  # CUDA-only (bitsandbytes, APEX) on a CPU, or not installed
        raise fail("opt", name, f"cannot run on this machine ({first_line(e)}); choose another, e.g. adamw") from None
    if get_optimizer_info(base).second_order:
        raise fail("opt", name, "is a second-order optimizer: it needs a backward that keeps its graph "
                                "(create_graph), which distill does not run; choose a first-order one, e.g. adamw")


def check_scheduler(name: str) -> None:
    if name == "plateau":
        raise fail("sched", name, "steps on a validation metric once per epoch, which distill's schedule (set "
                                  "from the step count, warm-up first) does not feed; choose cosine, step, "
                                  "multistep, poly or constant")
    if name not in SCHEDULERS:
        raise one_of("sched", name, SCHEDULERS)


def check_interpolation(name: str) -> None:
    from timm.data.transforms import _str_to_pil_interpolation

    valid = [*_str_to_pil_interpolation, "random"]
    if name not in valid:
        raise one_of("interpolation", name, valid)


def check_augment(spec: str) -> None:
    """Build timm's own augmentation from the string (what create_transform does with it): timm parses these
    strings in the constructors, and keeps no list of them. No random generator moves (a recipe is built mid-run
    on --resume)."""
    import random
    import warnings

    import torch
    from timm.data import create_transform

    state = random.getstate()
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            create_transform(32, is_training=True, auto_augment=spec)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise VitconvertError(f"recipe rand_augment: timm cannot read {spec!r} ({reason}); valid: rand-m9-mstd0.5-"
                              "inc1 style strings (rand-mN[-nN][-mstdX][-incN]), augmix-mN, original, v0, 3a, or "
                              "null for none") from None
    finally:
        random.setstate(state)


StagePart = tuple[str, Optional[int], bool]  # (stage, its count or None where unsaid, counted in optimizer steps)


def _named_stages(stages: str) -> list[StagePart]:
    """"attn:60steps,finetune" -> [("attn", 60, True), ("finetune", None, False)]; a bare count is epochs."""
    parts = [p.strip() for p in stages.split(",") if p.strip()]
    if not parts:
        raise VitconvertError("recipe stages is empty; use e.g. joint, attn:5,finetune or attn:300steps,finetune")
    named: list[StagePart] = []
    for part in parts:
        name, sep, count = part.partition(":")
        if name not in STAGES:
            raise VitconvertError(f"unknown stage {name!r} in {stages!r}; valid: {', '.join(STAGES)}")
        number = count.removesuffix("steps").removesuffix("step")
        try:
            named.append((name, int(number) if sep else None, number != count))
        except ValueError:
            raise VitconvertError(f"stage {part!r}: the count must be a whole number of epochs (attn:5) or of "
                                  "optimizer steps (attn:300steps)") from None
        if sep and named[-1][1] < 1:  # type: ignore[operator]
            raise VitconvertError(f"stage {part!r} needs at least one {'step' if named[-1][2] else 'epoch'}")
    return named


def parse_stages(stages: str, epochs: int) -> tuple[StagePart, ...]:
    """The stages, checked as far as the epochs alone allow: counted in epochs only, they must fill ``epochs``
    exactly (a stage without a count taking at least one); a count in steps is checked against the run's steps
    per epoch when the data is known (:func:`stage_steps`)."""
    named = tuple(_named_stages(stages))
    in_epochs = sum(c for _, c, steps in named if c is not None and not steps)
    if any(steps for *_, steps in named):
        if in_epochs >= epochs:
            raise VitconvertError(f"stages {stages!r} do not fit in {plural(epochs, 'epoch')}")
    else:
        stage_steps(stages, named, epochs, 1)
    return named


def stage_steps(stages: str, named: Sequence[StagePart], epochs: int, updates: int) -> tuple[tuple[str, int], ...]:
    """((stage, optimizer steps), ...) summing to ``epochs`` × ``updates`` (optimizer steps per epoch). Stages
    without a count share what the others leave: in whole epochs when every count is in epochs, else in steps."""
    total, whole = epochs * updates, not any(steps for *_, steps in named)
    unit = updates if whole else 1
    free = [i for i, (_, c, _) in enumerate(named) if c is None]
    rest = (total - sum(c * (1 if steps else updates) for _, c, steps in named if c is not None)) // unit
    where = plural(epochs, "epoch") + ("" if whole else f" of {plural(updates, 'optimizer step')} ({total} steps)")
    if (free and rest < len(free)) or (not free and rest != 0):
        raise VitconvertError(f"stages {stages!r} do not fit in {where}")
    plan = [(n, (c * (1 if steps else updates)) if c is not None else 0) for n, c, steps in named]
    for rank, i in enumerate(free):
        plan[i] = (plan[i][0], (rest // len(free) + (rank < rest % len(free))) * unit)
    return tuple(plan)
