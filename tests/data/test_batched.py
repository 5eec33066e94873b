"""data/batched.py: a batch transformed at once is, image for image, what timm's per-image PIL transforms give
with the same per-image seeds (the oracle is timm + Pillow themselves), and anything without a batch form keeps
the per-image path."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import create_transform
from timm.data.transforms import RandomResizedCropAndInterpolation

from vitconvert.data import TransformedDataset, digits_dataset
from vitconvert.data.batched import batch_transform, coefficients, crop_box, resample

MEAN, STD = (0.3, 0.3, 0.3), (0.32, 0.32, 0.32)


def per_image(ds: TransformedDataset, indices: list[int]) -> torch.Tensor:
    return torch.stack([ds[i][0] for i in indices])


def batched(ds: TransformedDataset, indices: list[int]) -> torch.Tensor:
    assert ds.batched is not None
    return torch.stack([x for x, _ in ds.__getitems__(indices)])


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("hflip", [0.0, 0.5])
def test_a_training_batch_is_the_per_image_transform(interpolation, hflip):
    transform = create_transform(16, is_training=True, scale=(0.5, 1.0), hflip=hflip, color_jitter=0.0,
                                 interpolation=interpolation, mean=MEAN, std=STD)
    ds = TransformedDataset(digits_dataset("train"), transform, seed=3)
    ds.epoch = 2
    indices = [0, 7, 7, 130, 999, 1499]
    got, want = batched(ds, indices), per_image(ds, indices)
    assert got.shape == want.shape == (6, 3, 16, 16)
    assert torch.allclose(got, want, atol=1e-6)  # the same crops, flips and Pillow rounding
    ds.epoch = 3
    assert not torch.allclose(batched(ds, indices), got)  # another epoch, other crops


def test_a_batch_of_one_image_is_the_per_image_transform():
    """An epoch's last batch or an evaluation share can hold a single image."""
    transform = create_transform(16, is_training=True, scale=(0.5, 1.0), color_jitter=0.0, mean=MEAN, std=STD)
    ds = TransformedDataset(digits_dataset("train"), transform, seed=3)
    got, want = batched(ds, [37]), per_image(ds, [37])
    assert got.shape == want.shape == (1, 3, 16, 16)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("size,crop_pct", [(16, 1.0), (12, 0.875), (6, 0.9)])
def test_an_eval_batch_is_the_per_image_transform(size, crop_pct):
    ds = TransformedDataset(digits_dataset("val"), create_transform(size, crop_pct=crop_pct, mean=MEAN, std=STD))
    indices = [-1, 0, 5, 296]  # -1: the padding of an evaluation share, labelled -1
    items = ds.__getitems__(indices)
    assert [t for _, t in items] == [-1] + [ds[i][1] for i in indices[1:]]
    assert torch.allclose(batched(ds, indices), per_image(ds, [0, 0, 5, 296]), atol=1e-6)


def test_resampling_matches_pillow_on_random_images_and_boxes():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (20, 9, 11, 3), dtype=np.uint8)
    for mode, pil in (("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC)):
        boxes = [(int(rng.integers(0, 4)), int(rng.integers(0, 4)), int(rng.integers(2, 6)), int(rng.integers(2, 8)))
                 for _ in images]
        got = resample(images, boxes, (7, 13), mode)
        want = np.stack([np.asarray(Image.fromarray(im).crop((left, top, left + w, top + h)).resize((13, 7), pil))
                         for im, (top, left, h, w) in zip(images, boxes, strict=True)])
        assert np.array_equal(got, want), mode  # integer arithmetic on both sides
    assert coefficients(5, 5, "bilinear").tolist() == (np.eye(5, dtype=np.int64) << 22).tolist()


def test_crop_boxes_are_timms_draws():
    for seed in range(50):
        random.seed(seed)
        want = RandomResizedCropAndInterpolation.get_params(Image.new("RGB", (8, 6)), (0.08, 1.0), (0.5, 2.0))
        assert crop_box(random.Random(seed), 6, 8, (0.08, 1.0), (0.5, 2.0)) == want


def test_ops_without_a_batch_form_keep_the_per_image_path():
    jitter = create_transform(16, is_training=True, color_jitter=0.4, mean=MEAN, std=STD)
    augment = create_transform(16, is_training=True, auto_augment="rand-m9-mstd0.5", mean=MEAN, std=STD)
    erase = create_transform(16, is_training=True, re_prob=0.25, mean=MEAN, std=STD)
    random_interp = create_transform(16, is_training=True, interpolation="random", mean=MEAN, std=STD)
    assert [batch_transform(t) for t in (jitter, augment, erase, random_interp)] == [None] * 4
    ds = TransformedDataset(digits_dataset("val"), jitter, seed=0)
    assert ds.batched is None and len(ds.__getitems__([0, 1])) == 2
