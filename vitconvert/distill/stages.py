"""What each optimizer step trains, decided once: the recipe's stages and frozen epochs as a few ``Stage`` spans.

``stages: attn:5,finetune`` trains attention outputs only for five epochs (attention parameters only), then
everything; ``attn:300steps,finetune`` does the same for 300 optimizer steps, a switch that may fall inside an
epoch (LoLCATs' attention transfer is a few hundred steps, a small part of one ImageNet epoch).
``freeze_copied_epochs`` holds the copied weights still at the start. Steps are optimizer steps of the global
batch, so accumulation and the number of processes do not move a switch. A stage with nothing to train would
fail in backward(), epochs later: it is refused when the plan is made, before anything runs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate

from torch import nn

from ..errors import VitconvertError
from ..recipes import Recipe


@dataclass(frozen=True)
class Stage:
    """One span's training: the stage's name (its loss terms), whether the copied weights are held still, and
    the ids of the parameters that train. Spans with equal stages need no change between them."""

    name: str
    frozen: bool
    trainable: frozenset[int]


@dataclass(frozen=True)
class StagePlan:
    """The stage of every optimizer step: ``stages[i]`` trains steps ``starts[i]`` up to ``starts[i + 1]``."""

    starts: tuple[int, ...]
    stages: tuple[Stage, ...]

    def at(self, step: int) -> Stage:
        """The stage that trains optimizer step ``step`` (0-based: the steps already taken)."""
        return self.stages[bisect.bisect_right(self.starts, step) - 1]


def plan_stages(recipe: Recipe, model: nn.Module, attention_ids: set[int], frozen_ids: set[int],
                updates_per_epoch: int) -> StagePlan:
    """The StagePlan of ``recipe`` for a run of ``updates_per_epoch`` optimizer steps an epoch."""
    everything = frozenset(id(p) for p in model.parameters())
    schedule = recipe.schedule
    spans = schedule.stage_steps(updates_per_epoch)
    ends = list(accumulate(steps for _, steps in spans))
    thaw = schedule.freeze_copied_epochs * updates_per_epoch
    starts, stages = [], []
    for start in sorted({0, *ends[:-1], *([thaw] if 0 < thaw < ends[-1] else [])}):
        name, frozen = spans[bisect.bisect_right(ends, start)][0], start < thaw
        ids = frozenset(attention_ids) if name == "attn" else everything
        ids = ids - frozen_ids if frozen else ids
        if not ids:
            raise VitconvertError(f"nothing would train in epoch {start // updates_per_epoch + 1} (stage {name}"
                                  + (", copied weights frozen, and every weight of it was copied" if frozen else "")
                                  + "): lower freeze_copied_epochs or change the stages")
        stage = Stage(name, frozen, ids)
        if not stages or stages[-1] != stage:
            starts.append(start)
            stages.append(stage)
    return StagePlan(tuple(starts), tuple(stages))
