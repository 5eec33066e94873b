"""Tiny teachers, converted students and image folders for the distill tests (a few hundred kB, < 1 s each)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import timm
import torch
from PIL import Image

import vitconvert
from vitconvert import capture
from vitconvert.sources import load_source

CLASSES = 3
# Quiet, fast settings: no warmup, no random augmentation except where a test turns it on.
FAST = {"epochs": 1, "batch_size": 4, "warmup_epochs": 0, "workers": 0, "log_interval": 1, "img_size": None,
        "rand_augment": None, "color_jitter": None, "reprob": 0.0, "mixup": 0.0, "cutmix": 0.0, "lr": 1e-3,
        "drop_path": 0.0, "scale": [0.5, 1.0]}


def make_teacher(folder: Path, num_classes: int = CLASSES, **kwargs) -> Path:
    """A softmax ViT (timm save_for_hf folder), 32 px, 2 blocks of width 32."""
    torch.manual_seed(0)
    args = {**dict(img_size=32, patch_size=8, embed_dim=32, num_heads=2, depth=2, num_classes=num_classes), **kwargs}
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **args)
    timm.models.save_for_hf(model, str(folder), safe_serialization=True)
    return folder


def make_student(root: Path, variant: str = "elu", **teacher_kwargs) -> Path:
    teacher = make_teacher(root / "teacher", **teacher_kwargs)
    source = load_source(str(teacher))
    student, _ = vitconvert.convert(source.model, variant, source=str(teacher))
    return vitconvert.save(student, root / f"student-{variant}", pretrained=True)


def make_images(root: Path, per_class: int = 4, val_per_class: int = 2, classes: int = CLASSES,
                size: int = 32) -> Path:
    """train/ and val/ with one colour per class (learnable), PNGs with a little noise."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for c in range(classes):
            (root / split / f"class{c}").mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
                pixels[..., c % 3] += 180
                Image.fromarray(pixels).save(root / split / f"class{c}" / f"{i}.png")
    return root


def make_workspace(root: Path) -> Path:
    """A student (ELU, with its teacher) and an image folder under ``root``: what a distill command test needs."""
    make_student(root)
    make_images(root / "images")
    return root


# `vitconvert distill` flags for a run of seconds: the FAST recipe values (but the epochs), batch 4, no compare
CLI_FAST = ["--batch-size", "4", "--set", "compare_batches=0"] + [
    a for k, v in FAST.items() if k not in ("epochs", "batch_size") for a in ("--set", f"{k}={json.dumps(v)}")]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two state dicts (or safetensors files read back) hold the same names and the same bits."""
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def counting_teacher(monkeypatch) -> list[int]:
    """How often the teacher's tap runs from here on (``calls[0]``): a cache hit is a batch it did not run for."""
    calls = [0]
    forward = capture.TeacherTap.__call__

    def counted(self, images):
        calls[0] += 1
        return forward(self, images)

    monkeypatch.setattr(capture.TeacherTap, "__call__", counted)
    return calls
