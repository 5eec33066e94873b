"""What a model eats (size, interpolation, normalisation, crop) and timm's transforms and Mixup for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..recipes import Recipe
from .augment import fix_posterize


# -- transforms ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputConfig:
    """What the model eats: size, resize interpolation, normalisation, eval crop."""

    img_size: int
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_pct: float


def model_input_size(model: nn.Module) -> int:
    """The image side a timm model is built for (its patch embedding's, else its pretrained_cfg's)."""
    embed = getattr(model, "patch_embed", None)
    size = getattr(embed, "img_size", None)
    if size:
        return int(size[0] if isinstance(size, (tuple, list)) else size)
    return int(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224))[-1])


def accepts_size(model: nn.Module, size: int) -> bool:
    embed = getattr(model, "patch_embed", None)
    if embed is None or not getattr(embed, "strict_img_size", False) or getattr(embed, "dynamic_img_size", False):
        return True
    return model_input_size(model) == size


def input_config(model: nn.Module, recipe: Optional[Recipe] = None) -> InputConfig:
    """The recipe's input settings where it sets them, else the model's pretrained_cfg (eval of any model)."""
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    return InputConfig(
        img_size=(recipe.img_size if recipe else None) or model_input_size(model),
        interpolation=recipe.interpolation if recipe else cfg.get("interpolation", "bicubic"),
        mean=tuple((recipe.mean if recipe else None) or cfg.get("mean", (0.485, 0.456, 0.406))),
        std=tuple((recipe.std if recipe else None) or cfg.get("std", (0.229, 0.224, 0.225))),
        crop_pct=float((recipe.crop_pct if recipe else None) or cfg.get("crop_pct", 0.875)),
    )


def train_transform(recipe: Recipe, inp: InputConfig) -> Callable[[Any], torch.Tensor]:
    """timm's training transform for the recipe (posterize made safe for every magnitude: see augment.py)."""
    from timm.data import create_transform

    transform = create_transform(inp.img_size, is_training=True, no_aug=recipe.no_aug, scale=tuple(recipe.scale),
                                 hflip=recipe.hflip, color_jitter=recipe.color_jitter or 0.0,
                                 auto_augment=recipe.rand_augment, interpolation=inp.interpolation, mean=inp.mean,
                                 std=inp.std, re_prob=recipe.reprob, re_mode=recipe.remode, re_count=recipe.recount)
    return fix_posterize(transform)


def eval_transform(inp: InputConfig) -> Callable[[Any], torch.Tensor]:
    from timm.data import create_transform

    return create_transform(inp.img_size, is_training=False, interpolation=inp.interpolation, mean=inp.mean,
                            std=inp.std, crop_pct=inp.crop_pct)


def mixup_for(recipe: Recipe, num_classes: int) -> Optional[Callable]:
    """timm's Mixup/CutMix (soft targets with label smoothing), or None when both are off."""
    if recipe.mixup <= 0 and recipe.cutmix <= 0:
        return None
    from timm.data import Mixup

    return Mixup(mixup_alpha=recipe.mixup, cutmix_alpha=recipe.cutmix, prob=recipe.mixup_prob,
                 switch_prob=recipe.mixup_switch_prob, mode=recipe.mixup_mode, label_smoothing=recipe.smoothing,
                 num_classes=num_classes)


def teacher_normalizer(inp: InputConfig, teacher: nn.Module,
                       device: torch.device) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """Map a batch normalised for the student to the teacher's normalisation (None when they agree)."""
    cfg = getattr(teacher, "pretrained_cfg", {}) or {}
    t_mean = torch.tensor(cfg.get("mean", inp.mean), dtype=torch.float32)
    t_std = torch.tensor(cfg.get("std", inp.std), dtype=torch.float32)
    s_mean = torch.tensor(inp.mean, dtype=torch.float32)
    s_std = torch.tensor(inp.std, dtype=torch.float32)
    if t_mean.shape == s_mean.shape and torch.allclose(t_mean, s_mean) and torch.allclose(t_std, s_std):
        return None
    scale = (s_std / t_std).view(1, -1, 1, 1).to(device)
    shift = ((s_mean - t_mean) / t_std).view(1, -1, 1, 1).to(device)
    return lambda x: x * scale.to(x.dtype) + shift.to(x.dtype)
