"""The two models of a distill run: the linear student (a model folder) and its softmax teacher.

The teacher defaults to the source the student was converted from, as recorded in its folder, and gets
the normalisation it was trained with even when the student's data pipeline uses another.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..data import InputConfig, accepts_size, model_input_size, size_text
from ..errors import VitconvertError, param, setting
from ..recipes import Recipe
from .attention_weights import WEIGHT_LOSS


def check_sizes(student: nn.Module, teacher: nn.Module, size: tuple[int, int]) -> None:
    """Both models take the run's (height, width)."""
    for who, model in (("student", student), ("teacher", teacher)):
        if not accepts_size(model, size):
            raise VitconvertError(f"the {who} is built for {size_text(model_input_size(model))} images but the "
                                  f"recipe trains at {size_text(size)}: use "
                                  f"{setting('img_size', model_input_size(model))} or convert at "
                                  f"{param('img_size', size[0])}")


def check_kd(student: nn.Module, teacher: nn.Module, kd_weight: float) -> None:
    """Refuse logit distillation between heads of different classes: the KL of unrelated logits teaches nothing."""
    mine, theirs = getattr(student, "num_classes", None), getattr(teacher, "num_classes", None)
    if kd_weight > 0 and mine != theirs:
        raise VitconvertError(f"logit KD needs the teacher's classes: the teacher has {theirs}, the student "
                              f"{mine}; use {param('kd_weight', 0)} (attention distillation still applies)")


def check_fsdp(recipe: Recipe) -> None:
    """What a sharded run cannot do. FSDP trains every parameter, without EMA. And it frees an attention module's
    gathered weights when its forward ends, to gather them again when the gradient reaches the module's output:
    weight_ce's taps use those weights beside the output (a loss of their own), so their backward may run first
    and find the storage freed (shown in one process: "out of bounds for storage of size 0")."""
    if recipe.optimization.ema or "attn" in recipe.schedule.stage_names() or recipe.schedule.freeze_copied_epochs:
        raise VitconvertError(f"{param('fsdp', True)} trains every parameter without EMA: drop ema, the attn "
                              f"stage and freeze_copied_epochs, or run without {param('fsdp')} (DDP)")
    if recipe.distillation.attn_loss == WEIGHT_LOSS:
        raise VitconvertError(f"{setting('attn_loss', WEIGHT_LOSS)} does not run under {param('fsdp', True)} (the "
                              f"weights' backward needs gathered weights FSDP has freed): use "
                              f"{setting('attn_loss', 'mse')} or run without {param('fsdp')} (DDP)")


def embed_width(model: nn.Module) -> int:
    """The model's token width, which sizes the attention-output loss."""
    return int(getattr(model, "embed_dim", None) or getattr(model, "num_features", 0))


def set_drop_path(model: nn.Module, rate: float) -> None:
    """Stochastic depth, linearly increasing over blocks as timm builds it (loaded models have none)."""
    if rate <= 0:
        return
    from timm.layers import DropPath

    blocks = list(getattr(model, "blocks", []))
    if not blocks:
        raise VitconvertError("drop_path needs a timm ViT with .blocks; set drop_path to 0")
    for block, p in zip(blocks, torch.linspace(0, rate, len(blocks)).tolist(), strict=True):
        for attr in ("drop_path", "drop_path1", "drop_path2"):
            if hasattr(block, attr):
                setattr(block, attr, DropPath(p) if p > 0 else nn.Identity())


def set_recompute(model: nn.Module, recompute: bool) -> None:
    """Whether attention layers that can recompute a step in backward (``recompute_step``: TTT) do. Off, autograd
    keeps the step's activations: more memory, one step forward less per training step, the same gradients."""
    for module in model.modules():
        if hasattr(module, "recompute_step"):
            module.recompute_step = recompute


def attention_param_ids(attention: list[nn.Module]) -> set[int]:
    """The ids of the attention layers' parameters: the set the attention-only stage trains."""
    return {id(p) for m in attention for p in m.parameters()}


def export_config(model: nn.Module, inp: InputConfig) -> None:
    """Record the preprocessing the run used in the model's pretrained_cfg (so eval matches validation)."""
    model.pretrained_cfg = {**getattr(model, "pretrained_cfg", {}), **inp.timm_config()}


def name_classes(model: nn.Module, names: Optional[list[str]]) -> None:
    """Label a student that carries no class names (a re-headed one) by the training data's, so its run folder reads
    as the data's classes in timm, transformers' pipeline and an exported file, not as LABEL_0, LABEL_1, ..."""
    cfg = getattr(model, "pretrained_cfg", {})
    if names and len(names) == model.num_classes and not cfg.get("label_names"):
        model.pretrained_cfg = {**cfg, "label_names": list(names)}
