"""One batch of distillation, in one place: the task owns teacher, student and the taps between them.

In the spirit of timm's ``timm/task`` (``FeatureDistillationTask``): ``task(images, targets)`` runs the softmax
teacher (no grad, its own normalisation) with taps on its attention modules, the student with taps on its
linear attention (or, teacher-forced, only the attention calls on the teacher's inputs), and the loss; it
returns ``{"loss", "task", "attn", "kd", "output"}``. The trainer around it handles devices, accumulation,
the optimizer and the run folder, and holds no other handle on the models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from ..capture import DistillStudent, TeacherTap, attention_pairs
from ..evaluate import autocast_for
from ..recipes import Recipe
from .losses import DistillLoss, LossWeights


class DistillationTask:
    """Teacher + student + taps + loss for one recipe; :meth:`set_stage` picks which terms a stage trains."""

    def __init__(self, student: nn.Module, teacher: nn.Module, recipe: Recipe, device: torch.device,
                 to_teacher: Optional[Callable[[torch.Tensor], torch.Tensor]], mixup_active: bool):
        mine, theirs = attention_pairs(student, teacher)
        self.recipe, self.device = recipe, device
        self.forced = recipe.attn_target == "teacher-forced"
        self.student = DistillStudent(student, mine)  # the trained module: the timm student + taps on its attention
        self.teacher = TeacherTap(teacher, theirs, keep_inputs=self.forced)
        self.runner: nn.Module = self.student  # what runs the student: itself, or its DDP/FSDP wrapper
        self.attention = mine
        self.to_teacher = to_teacher
        self.loss = DistillLoss(recipe, mixup_active=mixup_active)
        self.set_stage("joint")

    @property
    def model(self) -> nn.Module:
        """The timm student itself (what is saved)."""
        return self.student.student

    def set_stage(self, stage: str) -> None:
        """``attn`` trains attention outputs only; teacher-forced ``attn`` runs only the attention calls; with
        nothing to distil (attn_weight 0, no KD) the teacher does not run at all (a scratch baseline)."""
        self.stage, self.weights = stage, LossWeights.for_stage(self.recipe, stage)
        self.run_student = not (stage == "attn" and self.forced)
        self.run_teacher = bool(self.weights.attn or self.weights.kd)

    def __call__(self, images: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        r = self.recipe
        t_logits, t_outs, t_inputs = None, [], None
        if self.run_teacher:
            with autocast_for(self.device, r.amp, r.amp_dtype):
                t_logits, t_outs, t_inputs = self.teacher(self.to_teacher(images) if self.to_teacher else images)
        with autocast_for(self.device, r.amp, r.amp_dtype):
            logits, s_outs = self.runner(images, forced=t_inputs if self.forced else None,
                                         need_logits=self.run_student)
        loss, terms = self.loss(self.weights, logits, targets, s_outs, t_outs, t_logits)
        return {"loss": loss, **terms, "output": logits}

    def close(self) -> None:
        """Remove the taps (the end-of-run comparison puts its own hooks on the same modules)."""
        self.teacher.close()
        self.student.close()
