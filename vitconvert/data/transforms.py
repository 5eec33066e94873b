"""What a model eats (size, interpolation, normalisation, crop) and timm's transforms and Mixup for it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from ..recipes import Recipe
from .augment import fix_posterize


# -- transforms ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputConfig:
    """What the model eats, in the keys of timm's data config (``timm.data.resolve_model_data_config``), so that
    ``create_transform(**inp.timm_config())`` is the transform timm's own validate.py builds for the model."""

    input_size: tuple[int, int, int]  # (channels, height, width)
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_pct: float
    crop_mode: str = "center"  # timm's: center, squash (resize without keeping the aspect ratio) or border

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the images the model is fed."""
        return self.input_size[1], self.input_size[2]

    def timm_config(self) -> dict[str, Any]:
        """The config as timm's ``create_transform`` takes it."""
        return {"input_size": self.input_size, "interpolation": self.interpolation, "mean": self.mean,
                "std": self.std, "crop_pct": self.crop_pct, "crop_mode": self.crop_mode}


def built_size(model: nn.Module) -> Optional[tuple[int, int]]:
    """(height, width) the model's patch embedding is built for; None for a model of any size (NaFlexViT)."""
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if not size:
        return None
    return (int(size[0]), int(size[-1])) if isinstance(size, (tuple, list)) else (int(size), int(size))


def model_input_size(model: nn.Module) -> int:
    """The image side a timm model is built for (its patch embedding's height, else its pretrained_cfg's)."""
    size = built_size(model)
    return size[0] if size else int(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224))[-2])


def size_text(size: Union[int, Sequence[int]]) -> str:
    """"224 px", or "1024x768 px" for a non-square (height, width)."""
    height, width = (size, size) if isinstance(size, int) else (size[0], size[-1])
    return f"{height} px" if height == width else f"{height}x{width} px"


def accepts_size(model: nn.Module, size: Union[int, Sequence[int]]) -> bool:
    """Whether ``model`` takes images of ``size`` (a side, or (height, width))."""
    embed = getattr(model, "patch_embed", None)
    if embed is None or not getattr(embed, "strict_img_size", False) or getattr(embed, "dynamic_img_size", False):
        return True
    wanted = (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))
    return built_size(model) in (None, wanted)


def input_config(model: nn.Module, recipe: Optional[Recipe] = None) -> InputConfig:
    """timm's data config for ``model`` (``resolve_model_data_config``: its pretrained_cfg's size,
    interpolation, mean, std, crop_pct and crop_mode), with the recipe's input settings where it sets them.

    The size is the one the model is built for where it has one: a model built at another size than its
    pretrained_cfg names (``img_size=``) takes only that one."""
    from timm.data import resolve_model_data_config

    args: dict[str, Any] = {}
    size = built_size(model)
    if size is not None:
        args["input_size"] = (3, *size)
    if recipe is not None:
        given = recipe.input
        if given.img_size:
            args["input_size"] = (3, given.img_size, given.img_size)
        args.update({k: v for k, v in (("interpolation", given.interpolation), ("crop_pct", given.crop_pct),
                                       ("mean", given.mean), ("std", given.std)) if v is not None})
    cfg = resolve_model_data_config(model, args=args)
    return InputConfig(input_size=tuple(int(v) for v in cfg["input_size"]),  # type: ignore[arg-type]
                       interpolation=cfg["interpolation"], mean=tuple(cfg["mean"]), std=tuple(cfg["std"]),
                       crop_pct=float(cfg["crop_pct"]), crop_mode=cfg["crop_mode"])


def train_transform(recipe: Recipe, inp: InputConfig) -> Callable[[Any], torch.Tensor]:
    """timm's training transform for the recipe (posterize made safe for every magnitude: see augment.py)."""
    from timm.data import create_transform

    a = recipe.augmentation
    transform = create_transform(inp.size, is_training=True, no_aug=a.no_aug, scale=tuple(a.scale), hflip=a.hflip,
                                 color_jitter=a.color_jitter or 0.0, auto_augment=a.rand_augment,
                                 interpolation=inp.interpolation, mean=inp.mean, std=inp.std, re_prob=a.reprob,
                                 re_mode=a.remode, re_count=a.recount)
    return fix_posterize(transform)


def eval_transform(inp: InputConfig) -> Callable[[Any], torch.Tensor]:
    """timm's eval transform for the config, as timm's validate.py builds it (resize, crop by crop_mode)."""
    from timm.data import create_transform

    return create_transform(**inp.timm_config(), is_training=False)


def mixup_for(recipe: Recipe, num_classes: int) -> Optional[Callable]:
    """timm's Mixup/CutMix (soft targets with label smoothing), or None when both are off."""
    a = recipe.augmentation
    if a.mixup <= 0 and a.cutmix <= 0:
        return None
    from timm.data import Mixup

    return Mixup(mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, prob=a.mixup_prob, switch_prob=a.mixup_switch_prob,
                 mode=a.mixup_mode, label_smoothing=a.smoothing,
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
