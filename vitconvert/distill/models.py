"""The two models of a distill run: the linear student (a model folder) and its softmax teacher.

The teacher defaults to the source the student was converted from, as recorded in its folder, and gets
the normalisation it was trained with even when the student's data pipeline uses another.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..errors import VitconvertError
from .data import InputConfig, accepts_size, model_input_size


def load_student(spec: str) -> nn.Module:
    """A vitconvert model folder or run folder (linear attention, loaded strictly)."""
    from ..folder import load
    from ..sources import read_config

    path = Path(spec).expanduser()
    if not spec.startswith("hf-hub:"):
        if path.is_file():
            raise VitconvertError(f"{spec} is a file, not a model folder: give the folder `vitconvert convert` "
                                  "wrote")
        if not path.is_dir():
            raise VitconvertError(f"student folder not found: {spec}")
        if "vitconvert" not in read_config(path):
            raise VitconvertError(f"{spec} is not a vitconvert model folder: convert it first "
                                  f"(`vitconvert convert {spec} --to VARIANT`)")
    return load(spec)


def teacher_spec(student: nn.Module, override: Optional[str]) -> str:
    if override:
        return override
    source = getattr(student, "vitconvert_report", {}).get("source")
    if not source:
        raise VitconvertError("the student records no source model: name the softmax teacher with --teacher")
    return str(source)


def load_teacher(spec: str, student: nn.Module, seed: int, recorded: bool) -> nn.Module:
    """The softmax teacher; built under a fixed seed so a random-init teacher is the same on resume."""
    from ..sources import load_source

    pretrained = bool(getattr(student, "vitconvert_report", {}).get("pretrained", True))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            source = load_source(spec, pretrained=pretrained)
        except VitconvertError as e:
            if not recorded:
                raise
            raise VitconvertError(f"cannot load the teacher {spec!r} (the student's recorded source): {e}; "
                                  "name it with --teacher") from None
    if source.vitconvert is not None:
        raise VitconvertError(f"the teacher {spec} is a linear-attention vitconvert model; give a softmax ViT")
    return source.model.eval()


def check_sizes(student: nn.Module, teacher: nn.Module, img_size: int) -> None:
    for who, model in (("student", student), ("teacher", teacher)):
        if not accepts_size(model, img_size):
            raise VitconvertError(f"the {who} is built for {model_input_size(model)} px images but the recipe "
                                  f"trains at {img_size} px: set img_size to {model_input_size(model)} "
                                  f"(--set img_size=...) or convert at --img-size {img_size}")


def check_kd(student: nn.Module, teacher: nn.Module, kd_weight: float) -> None:
    mine, theirs = getattr(student, "num_classes", None), getattr(teacher, "num_classes", None)
    if kd_weight > 0 and mine != theirs:
        raise VitconvertError(f"logit KD needs the teacher's classes: the teacher has {theirs}, the student "
                              f"{mine}; use --kd-weight 0 (attention distillation still applies)")


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


def embed_width(model: nn.Module) -> int:
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


def attention_param_ids(attention: list[nn.Module]) -> set[int]:
    return {id(p) for m in attention for p in m.parameters()}


def export_config(model: nn.Module, inp: InputConfig) -> None:
    """Record the preprocessing the run used in the model's pretrained_cfg (so eval matches validation)."""
    model.pretrained_cfg = {**getattr(model, "pretrained_cfg", {}), "input_size": (3, inp.img_size, inp.img_size),
                            "interpolation": inp.interpolation, "mean": tuple(inp.mean), "std": tuple(inp.std),
                            "crop_pct": inp.crop_pct}
