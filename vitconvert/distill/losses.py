"""The distillation objective: task loss + attn_weight × Σ_layers attention-output loss + kd_weight × logit KD.

The attention term is the paper's "distill the difference": only attention changed in the conversion, so
each student attention module is pulled toward the teacher's output at the same layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import VitconvertError
from ..recipe_sections import Distillation
from ..recipes import Recipe
from .attention_weights import WEIGHT_LOSS, weight_cross_entropy


def task_criterion(recipe: Recipe, mixup_active: bool) -> nn.Module:
    """timm train.py's choice: soft-target CE under mixup/cutmix, else label-smoothing CE, else plain CE."""
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    if mixup_active:
        return SoftTargetCrossEntropy()  # Mixup already smoothed the targets
    if recipe.augmentation.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=recipe.augmentation.smoothing)
    return nn.CrossEntropyLoss()


def _cosine(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return (1 - F.cosine_similarity(student, teacher, dim=-1)).mean()


ATTENTION_DISTANCES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mse": F.mse_loss,
    "cosine": _cosine,
    "smooth_l1": F.smooth_l1_loss,
    WEIGHT_LOSS: weight_cross_entropy,  # on the layers' attention weights, not outputs (attention_weights.py)
}
# the output distances add up over layers (the paper's Σ_layers); Hedgehog's weight cross-entropy is their mean
LAYER_MEANS = (WEIGHT_LOSS,)


def attention_loss(student: list[torch.Tensor], teacher: list[torch.Tensor], kind: str = "mse") -> torch.Tensor:
    """Σ over layers of the distance between student and teacher attention outputs (the mean over layers of the
    weights' cross-entropy), in float32."""
    if len(student) != len(teacher) or not student:
        raise VitconvertError(f"captured {len(student)} student and {len(teacher)} teacher attention outputs")
    distance = ATTENTION_DISTANCES[kind]
    terms = torch.stack([distance(s.float(), t.float()) for s, t in zip(student, teacher, strict=True)])
    return terms.mean() if kind in LAYER_MEANS else terms.sum()


def logit_kd(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Hinton KD: KL(softmax(t/T) ‖ softmax(s/T)) · T², batch mean."""
    t = temperature
    return F.kl_div(F.log_softmax(student.float() / t, -1), F.log_softmax(teacher.float() / t, -1),
                    reduction="batchmean", log_target=True) * t * t


@dataclass(frozen=True)
class LossWeights:
    task: float
    attn: float
    kd: float

    @classmethod
    def for_stage(cls, d: Distillation, stage: str) -> LossWeights:
        """Stage ``attn`` trains attention alone on the attention loss; joint/finetune use the recipe's weights."""
        if stage == "attn":
            return cls(0.0, d.attn_weight or 1.0, 0.0)  # a zero weight would train nothing here
        return cls(1.0, d.attn_weight, d.kd_weight)


class DistillLoss:
    """Combines the three terms; returns the total and each term (detached) for logging."""

    def __init__(self, recipe: Recipe, mixup_active: bool):
        self.task = task_criterion(recipe, mixup_active)
        self.kind = recipe.distillation.attn_loss
        self.temperature = recipe.distillation.kd_temperature

    def __call__(self, weights: LossWeights, logits: Optional[torch.Tensor], targets: torch.Tensor,
                 student_attn: list[torch.Tensor], teacher_attn: list[torch.Tensor],
                 teacher_logits: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        terms: dict[str, torch.Tensor] = {}
        total = torch.zeros((), device=targets.device)
        if weights.task and logits is not None:
            terms["task"] = self.task(logits.float(), targets)
            total = total + weights.task * terms["task"]
        if weights.attn:
            terms["attn"] = attention_loss(student_attn, teacher_attn, self.kind)
            total = total + weights.attn * terms["attn"]
        if weights.kd and logits is not None and teacher_logits is not None:
            terms["kd"] = logit_kd(logits, teacher_logits, self.temperature)
            total = total + weights.kd * terms["kd"]
        return total, {k: v.detach() for k, v in terms.items()}
