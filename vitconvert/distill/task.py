"""One batch of distillation, in one place: the task owns teacher, student and the taps between them.

In the spirit of timm's ``timm/task`` (``FeatureDistillationTask``): ``task(images, targets)`` runs the softmax
teacher (no grad, its own normalisation) with taps on its attention modules, the student with taps on its
linear attention (or, teacher-forced, only the attention calls on the teacher's inputs), and the loss; it
returns ``{"loss", "task", "attn", "kd", "output"}``.

The task owns everything that runs or holds the student's weights: the student and its taps, the teacher,
the DDP/FSDP wrapper around the student, the EMA copy and the eval model folders are written from. The
trainer around it handles data, accumulation, the optimizer and the run folder, and asks the task for weights.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from .. import distributed as D
from ..capture import DistillStudent, TeacherTap, attention_pairs
from ..evaluate import autocast_for
from ..recipes import Recipe
from .attention_weights import weight_taps
from .losses import DistillLoss, LossWeights
from .stages import Stage
from .teacher_cache import TeacherCache


class DistillationTask:
    """Teacher + student + taps + loss for one recipe; :meth:`set_stage` picks which terms a stage trains.

    ``student`` is copied (on the CPU, before it moves to ``device``) into :attr:`export`, the eval model that
    folders are written from and that never trains."""

    def __init__(self, student: nn.Module, teacher: nn.Module, recipe: Recipe, device: torch.device,
                 to_teacher: Optional[Callable[[torch.Tensor], torch.Tensor]], mixup_active: bool,
                 memory_format: torch.memory_format = torch.preserve_format,
                 teacher_cache: Optional[TeacherCache] = None):
        mine, theirs = attention_pairs(student, teacher)
        self.recipe, self.device = recipe, device
        self.export = copy.deepcopy(student).eval()  # a CPU copy that folders are written from, never trained
        student.to(device, memory_format=memory_format)
        teacher.to(device, memory_format=memory_format)
        self.forced = recipe.distillation.attn_target == "teacher-forced"
        tap_mine, tap_theirs = weight_taps(recipe.distillation.attn_loss, mine, theirs)  # outputs, or the weights
        self.student = DistillStudent(student, mine, tap_mine)  # the trained module: the student + taps on attention
        self.teacher = TeacherTap(teacher, theirs, keep_inputs=self.forced, tap=tap_theirs)
        self.runner: nn.Module = self.student  # what runs the student: itself, or its DDP/FSDP wrapper
        self.ema: Optional[nn.Module] = None  # timm's ModelEmaV3 when the recipe keeps one (keep_ema)
        self.current: Optional[Stage] = None  # the epoch plan's stage being trained (enter)
        self.attention = mine
        self.to_teacher = to_teacher
        self.loss = DistillLoss(recipe, mixup_active=mixup_active)
        # (the cache, this run's key): the teacher's outputs another run with this recipe computed (a caller shares
        # a cache only between runs of one teacher and data set); none where a batch is not the slot's alone (mixup)
        shared = teacher_cache is not None and not self.forced and not mixup_active
        self.teacher_cache = (teacher_cache, json.dumps(recipe.to_dict(), sort_keys=True)) if shared else None
        self.set_stage("joint")

    @property
    def model(self) -> nn.Module:
        """The timm student itself (what is saved)."""
        return self.student.student

    @property
    def softmax_teacher(self) -> nn.Module:
        """The timm teacher itself, without its taps."""
        return self.teacher.teacher

    # -- what runs the student ---------------------------------------------------------------------------------
    def shard(self, env: D.DistEnv) -> None:
        """FSDP2 over the student, each attention and MLP module a unit (before the optimizer is built)."""
        self.runner = D.shard(self.student, env, tuple({type(m) for m in self.attention}))

    def enter(self, stage: Stage, env: D.DistEnv, sharded: bool) -> None:
        """Train ``stage``: its loss terms, and (unsharded) requires_grad on what it trains, so a held weight has
        no gradient, no weight decay and no optimizer state; DDP is rebuilt over what trains. The stage being
        trained already: nothing to do."""
        if stage == self.current:
            return
        self.current = stage
        self.set_stage(stage.name)
        if sharded:
            return
        for p in self.model.parameters():
            p.requires_grad_(id(p) in stage.trainable)
        self.runner = self.student  # drop the old DDP wrapper before building the new one
        self.runner = D.replicate(self.student, env)

    def keep_ema(self, decay: float, saved: Optional[dict[str, torch.Tensor]] = None) -> None:
        """An exponential moving average of the student (timm's ModelEmaV3), from ``saved`` when resuming."""
        from timm.utils import ModelEmaV3

        self.ema = ModelEmaV3(self.model, decay=decay)
        if saved is not None:
            self.ema.module.load_state_dict(saved)

    def update_ema(self, step: int) -> None:
        """Move the EMA (when kept) toward the student after an optimizer step."""
        if self.ema is not None:
            self.ema.update(self.model, step=step)

    # -- the batch -----------------------------------------------------------------------------------------------
    def set_stage(self, stage: str) -> None:
        """``attn`` trains attention outputs only; teacher-forced ``attn`` runs only the attention calls; with
        nothing to distil (attn_weight 0, no KD) the teacher does not run at all (a scratch baseline)."""
        self.stage, self.weights = stage, LossWeights.for_stage(self.recipe.distillation, stage)
        self.run_student = not (stage == "attn" and self.forced)
        self.run_teacher = bool(self.weights.attn or self.weights.kd)

    def __call__(self, images: torch.Tensor, targets: torch.Tensor, slot: Optional[int] = None) -> dict[str, Any]:
        """``slot``: the micro-batch's place in the run (epoch * micro-batches per epoch + batch), for the cache."""
        o = self.recipe.optimization
        t_logits, t_outs, t_inputs = None, [], None
        if self.run_teacher:
            t_logits, t_outs, t_inputs = self.run_teacher_on(images, slot)
        with autocast_for(self.device, o.amp, o.amp_dtype):
            logits, s_outs = self.runner(images, forced=t_inputs if self.forced else None,
                                         need_logits=self.run_student)
        loss, terms = self.loss(self.weights, logits, targets, s_outs, t_outs, t_logits)
        return {"loss": loss, **terms, "output": logits}

    def run_teacher_on(self, images: torch.Tensor, slot: Optional[int]) -> tuple[Any, list[torch.Tensor], Any]:
        """The teacher's logits, attention outputs and (teacher-forced) inputs; from the cache where it has them."""
        cache, key = self.teacher_cache if self.teacher_cache is not None and slot is not None else (None, "")
        cached = cache.get(key, slot) if cache is not None else None
        if cached is not None:
            return cached[0], cached[1], None
        o = self.recipe.optimization
        with autocast_for(self.device, o.amp, o.amp_dtype):
            logits, outputs, inputs = self.teacher(self.to_teacher(images) if self.to_teacher else images)
        if cache is not None:
            cache.put(key, slot, logits, outputs)
        return logits, outputs, inputs

    def gradient_sync(self, sync: bool) -> Any:
        """Skip the gradient all-reduce on accumulation micro-steps."""
        return D.gradient_sync(self.runner, sync)

    # -- weights -------------------------------------------------------------------------------------------------
    def evaluated(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """What validation runs: the EMA when kept, else the student module itself (FSDP shards in place; DDP's
        wrapper would sync buffers on every call)."""
        if self.ema is not None:
            return self.ema.module
        return lambda x: self.student(x, capture=False)[0]

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The student's weights on the CPU, gathered from shards (a collective under FSDP: every rank calls)."""
        state = D.full_model_state(self.runner, self.student)
        return {k.removeprefix("student."): v for k, v in state.items()}

    def evaluated_state(self) -> dict[str, torch.Tensor]:
        """The weights a model folder gets: the EMA's when kept, else the trained ones."""
        if self.ema is not None:
            return {k: v.detach().cpu().clone() for k, v in self.ema.module.state_dict().items()}
        return self.trained_state()

    def ema_state(self) -> Optional[dict[str, torch.Tensor]]:
        """The EMA's weights for the checkpoint (None without an EMA)."""
        return self.ema.module.state_dict() if self.ema is not None else None

    def close(self) -> None:
        """Remove the taps (the end-of-run comparison puts its own hooks on the same modules)."""
        self.teacher.close()
        self.student.close()
