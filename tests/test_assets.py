"""The bundled digits and teacher: shapes, labels, a fixed split, and a teacher that really classifies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from timm.data import create_transform, resolve_data_config

from vitconvert.data import digits_dataset, export_imagefolder
from vitconvert.errors import VitconvertError
from vitconvert.sources import load_source


def test_splits_are_fixed_disjoint_and_cover_every_class():
    train, val = digits_dataset("train"), digits_dataset("val")
    assert (len(train), len(val)) == (1500, 297)
    assert not set(train.indices.tolist()) & set(val.indices.tolist())
    assert sorted(set(train.targets)) == sorted(set(val.targets)) == list(range(10))
    assert np.bincount(val.targets).min() >= 25  # stratified: ~30 per class
    again = digits_dataset("val")
    assert again.targets == val.targets and np.array_equal(again.images, val.images)


def test_items_are_rgb_pil_images_and_int_labels():
    ds = digits_dataset("train")
    img, label = ds[0]
    assert img.mode == "RGB" and img.size == (8, 8) and isinstance(label, int)
    pixels = np.asarray(img)
    assert pixels.dtype == np.uint8 and pixels.min() == 0
    assert ds.images.max() == 255 and len(np.unique(ds.images)) == 17  # 16 gray levels + black, full range
    assert np.array_equal(pixels[..., 0], pixels[..., 2])  # gray in three channels


def test_unknown_split_is_a_user_error():
    with pytest.raises(VitconvertError, match="unknown digits split 'test'"):
        digits_dataset("test")


def test_export_imagefolder_writes_the_layout_distill_reads(tmp_path):
    root = export_imagefolder(tmp_path / "digits")
    assert sorted(p.name for p in root.iterdir()) == ["train", "val"]
    assert sorted(p.name for p in (root / "val").iterdir()) == [str(i) for i in range(10)]
    assert sum(1 for _ in (root / "val").rglob("*.png")) == 297
    with pytest.raises(VitconvertError, match="not empty"):
        export_imagefolder(root)


def test_bundled_teacher_loads_by_name_and_beats_chance_by_far():
    src = load_source("digits")
    model = src.model.eval()
    assert model.num_classes == 10 and all(type(b.attn).__name__ == "Attention" for b in model.blocks)  # softmax
    transform = create_transform(**resolve_data_config(model=model))
    ds = digits_dataset("val", transform=transform)
    x = torch.stack([img for img, _ in ds])
    with torch.no_grad():
        top1 = (model(x).argmax(-1) == torch.tensor(ds.targets)).float().mean().item()
    assert top1 > 0.9  # chance is 0.1; the shipped teacher scores ~0.99 (docs/results.md)
