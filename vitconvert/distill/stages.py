"""What each epoch trains, decided once: the recipe's stage plan and frozen epochs as one ``Stage`` per epoch.

``stages: attn:5,finetune`` trains attention outputs only for five epochs (attention parameters only), then
everything; ``freeze_copied_epochs`` holds the copied weights still at the start. A stage with nothing to train
would fail in backward(), epochs later: it is refused when the plan is made, before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import VitconvertError
from ..recipes import Recipe


@dataclass(frozen=True)
class Stage:
    """One epoch's training: the stage's name (its loss terms), whether the copied weights are held still, and
    the ids of the parameters that train. Epochs with equal stages need no change between them."""

    name: str
    frozen: bool
    trainable: frozenset[int]


def plan_epochs(recipe: Recipe, model: nn.Module, attention_ids: set[int], frozen_ids: set[int]) -> tuple[Stage, ...]:
    """The Stage of every epoch of ``recipe`` (index = 0-based epoch)."""
    everything = frozenset(id(p) for p in model.parameters())
    plan: list[Stage] = []
    schedule = recipe.schedule
    for epoch in range(schedule.epochs):
        name, frozen = schedule.stage_at(epoch), epoch < schedule.freeze_copied_epochs
        ids = frozenset(attention_ids) if name == "attn" else everything
        ids = ids - frozen_ids if frozen else ids
        if not ids:
            raise VitconvertError(f"nothing would train in epoch {epoch + 1} (stage {name}"
                                  + (", copied weights frozen, and every weight of it was copied" if frozen else "")
                                  + "): lower freeze_copied_epochs or change the stages")
        stage = Stage(name, frozen, ids)
        plan.append(plan[-1] if plan and plan[-1] == stage else stage)
    return tuple(plan)
