"""timm's transforms a batch at a time, for images held in memory as uint8 arrays (the bundled digits).

Why: a quickstart training spent a third of its CPU time transforming 8×8 digits one at a time (seeding and
restoring three RNGs, a PIL image, a crop, a resize, a tensor, ~0.5 ms an image). Here the Compose timm built
is read op by op and each op runs on the whole batch: Pillow's resampling is redone in its own 22-bit fixed
point (a horizontal pass, then a vertical one, each rounded to uint8), and each image's random draws come
from generators seeded with that image's seed in the order its ops draw them, so every image is the one the
per-image path gives (tests/data/test_batched.py compares them). A Compose with any op not in ``batch_ops``
(RandAugment, erasing, colour jitter that jitters, a random interpolation) keeps the per-image path.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Optional, Union

import numpy as np
import torch

PRECISION_BITS = 22  # Pillow's fixed point for 8-bit resampling (Resample.c: 32 - 8 - 2)
Batch = Union[np.ndarray, torch.Tensor]  # uint8 (B, H, W, C) before ToTensor, float32 (B, C, H, W) after


class Unsupported(Exception):
    """The transform (or an image it meets) has no batch form here: the caller keeps the per-image path."""


class SampleDraws:
    """One image's random streams, seeded as ``loaders.sample_rng`` seeds the global ones: python's (timm's
    crops draw from it) and torch's CPU generator (torchvision's flips and jitter), made when first drawn."""

    def __init__(self, seed: int):
        self.seed, self.python = seed, random.Random(seed)
        self._torch: Optional[torch.Generator] = None

    @property
    def torch(self) -> torch.Generator:
        if self._torch is None:
            self._torch = torch.Generator().manual_seed(self.seed)
        return self._torch


BatchOp = Callable[[Batch, Optional[list[SampleDraws]]], Batch]


# -- Pillow's resampling ------------------------------------------------------------------------------------
def _bilinear(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def _bicubic(x: float, a: float = -0.5) -> float:
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    return (((x - 5) * x + 8) * x - 4) * a if x < 2.0 else 0.0


FILTERS: dict[str, tuple[Callable[[float], float], float]] = {"bilinear": (_bilinear, 1.0), "bicubic": (_bicubic, 2.0)}


@lru_cache(maxsize=256)
def coefficients(in_size: int, out_size: int, mode: str) -> np.ndarray:
    """(out_size, in_size) int64 weights of Pillow's resize of ``in_size`` pixels to ``out_size`` (its
    ``precompute_coeffs`` and ``normalize_coeffs_8bpc``): the filter stretched when shrinking, each row
    normalised over the pixels inside the image, then rounded to PRECISION_BITS."""
    kernel, support = FILTERS[mode]
    scale = in_size / out_size
    stretch = max(scale, 1.0)
    support *= stretch
    weights = np.zeros((out_size, in_size), np.int64)
    for out in range(out_size):
        center = (out + 0.5) * scale
        low = max(int(center - support + 0.5), 0)
        high = min(int(center + support + 0.5), in_size)
        row = [kernel((x - center + 0.5) / stretch) for x in range(low, high)]
        total = sum(row)
        for x, w in zip(range(low, high), row, strict=True):
            w = w / total if total != 0.0 else w
            weights[out, x] = int(w * (1 << PRECISION_BITS) + (0.5 if w >= 0 else -0.5))
    return weights


def _clip8(acc: np.ndarray) -> np.ndarray:
    return np.clip((acc + (1 << (PRECISION_BITS - 1))) >> PRECISION_BITS, 0, 255)


def resample(images: np.ndarray, boxes: Sequence[tuple[int, int, int, int]], size: tuple[int, int],
             mode: str) -> np.ndarray:
    """Each image's box (top, left, height, width) resized to ``size`` (height, width) as Pillow's
    ``img.crop(box).resize(size)`` does: weights zero outside the box, a horizontal pass rounded to uint8, then
    a vertical one (a pass whose size does not change has weights of exactly one: the identity it skips)."""
    if mode not in FILTERS:
        raise Unsupported(f"interpolation {mode}")
    count, height, width, _ = images.shape
    cols, rows = np.zeros((count, size[1], width), np.int64), np.zeros((count, size[0], height), np.int64)
    for n, (top, left, h, w) in enumerate(boxes):
        cols[n, :, left:left + w] = coefficients(w, size[1], mode)
        rows[n, :, top:top + h] = coefficients(h, size[0], mode)
    wide = _clip8(np.einsum("bow,bhwc->bhoc", cols, images.astype(np.int64)))
    return _clip8(np.einsum("boh,bhwc->bowc", rows, wide)).astype(np.uint8)


def _mode(interpolation: Any) -> str:
    """A torchvision InterpolationMode (or a string) as FILTERS names it; a random choice has no batch form."""
    if isinstance(interpolation, (list, tuple)):
        raise Unsupported("a random interpolation")
    return str(getattr(interpolation, "value", interpolation))


# -- the ops --------------------------------------------------------------------------------------------------
def crop_box(draw: random.Random, height: int, width: int, scale: Sequence[float],
             ratio: Sequence[float]) -> tuple[int, int, int, int]:
    """timm's ``RandomResizedCropAndInterpolation.get_params`` drawing from ``draw`` (timm draws from the global
    ``random``, which the per-image path seeds with the same seed): (top, left, height, width)."""
    area = width * height
    for _ in range(10):
        target_area = draw.uniform(*scale) * area
        log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        aspect = math.exp(draw.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if w <= width and h <= height:
            top = draw.randint(0, height - h)
            return top, draw.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _draws(draws: Optional[list[SampleDraws]]) -> list[SampleDraws]:
    if draws is None:
        raise Unsupported("a random op without per-image seeds")
    return draws


def random_resized_crop(t: Any) -> BatchOp:
    mode = _mode(t.interpolation)

    def op(batch: Batch, draws: Optional[list[SampleDraws]]) -> Batch:
        height, width = batch.shape[1:3]
        boxes = [crop_box(d.python, height, width, t.scale, t.ratio) for d in _draws(draws)]
        return resample(batch, boxes, t.size, mode)  # type: ignore[arg-type]

    return op


def resize(t: Any) -> BatchOp:
    """torchvision's Resize: an int (or one-item list) is the shorter side, the longer one scaled and floored."""
    if t.max_size is not None:
        raise Unsupported("Resize with max_size")
    size, mode = ([t.size] if isinstance(t.size, int) else list(t.size)), _mode(t.interpolation)

    def op(batch: Batch, draws: Optional[list[SampleDraws]]) -> Batch:
        height, width = batch.shape[1:3]
        if len(size) == 2:
            out = (size[0], size[1])
        else:
            short, long = sorted((height, width))
            new_long = int(size[0] * long / short)
            out = (size[0], new_long) if height <= width else (new_long, size[0])
        if out == (height, width):
            return batch
        return resample(batch, [(0, 0, height, width)] * len(batch), out, mode)  # type: ignore[arg-type]

    return op


def center_crop(t: Any) -> BatchOp:
    size = (t.size, t.size) if isinstance(t.size, int) else tuple(t.size)

    def op(batch: Batch, draws: Optional[list[SampleDraws]]) -> Batch:
        height, width = batch.shape[1:3]
        if size[0] > height or size[1] > width:
            raise Unsupported("a centre crop larger than the image (torchvision pads it)")
        top, left = int(round((height - size[0]) / 2.0)), int(round((width - size[1]) / 2.0))
        return batch[:, top:top + size[0], left:left + size[1]]

    return op


def horizontal_flip(t: Any) -> BatchOp:
    def op(batch: Batch, draws: Optional[list[SampleDraws]]) -> Batch:
        if isinstance(batch, torch.Tensor):
            raise Unsupported("a flip after ToTensor")
        flip = np.array([bool(torch.rand(1, generator=d.torch) < t.p) for d in _draws(draws)])
        out = batch.copy()
        out[flip] = out[flip][:, :, ::-1]
        return out

    return op


def color_jitter(t: Any) -> BatchOp:
    """Only the jitter that changes nothing (timm adds it with every factor None); it still draws the order of
    its four ops from torch's generator, which a later op's draws follow."""
    if any(v is not None for v in (t.brightness, t.contrast, t.saturation, t.hue)):
        raise Unsupported("colour jitter")

    def op(batch: Batch, draws: Optional[list[SampleDraws]]) -> Batch:
        for d in draws or []:
            torch.randperm(4, generator=d.torch)
        return batch

    return op


def to_tensor(t: Any) -> BatchOp:
    def op(batch: Batch, draws: Optional[list[SampleDraws]]) -> Batch:
        return torch.from_numpy(np.ascontiguousarray(batch)).permute(0, 3, 1, 2).contiguous().to(torch.float32).div(255)

    return op


def normalize(t: Any) -> BatchOp:
    from torchvision.transforms import functional as F

    def op(batch: Batch, draws: Optional[list[SampleDraws]]) -> Batch:
        if not isinstance(batch, torch.Tensor):
            raise Unsupported("Normalize before ToTensor")
        return F.normalize(batch, t.mean, t.std, t.inplace)

    return op


@lru_cache(maxsize=1)
def batch_ops() -> dict[type, Callable[[Any], BatchOp]]:
    """transform class -> builder of its batch form (imported when first needed: timm and torchvision)."""
    from timm.data.transforms import MaybeToTensor, RandomResizedCropAndInterpolation
    from torchvision import transforms as T

    return {RandomResizedCropAndInterpolation: random_resized_crop, T.Resize: resize, T.CenterCrop: center_crop,
            T.RandomHorizontalFlip: horizontal_flip, T.ColorJitter: color_jitter, MaybeToTensor: to_tensor,
            T.ToTensor: to_tensor, T.Normalize: normalize}


class BatchTransform:
    """A timm Compose as batch ops: uint8 (B, H, W, C) images and per-image seeds -> float32 (B, C, H, W)."""

    def __init__(self, ops: list[BatchOp]):
        self.ops = ops

    def __call__(self, images: np.ndarray, seeds: Optional[Sequence[int]] = None) -> torch.Tensor:
        draws = [SampleDraws(s) for s in seeds] if seeds is not None else None
        batch: Batch = images
        for op in self.ops:
            batch = op(batch, draws)
        if not isinstance(batch, torch.Tensor):
            raise Unsupported("no ToTensor")
        return batch


def batch_transform(transform: Any) -> Optional[BatchTransform]:
    """The batch form of a torchvision Compose of the ops in ``batch_ops``; None for anything else."""
    ops = []
    for t in getattr(transform, "transforms", [None]):
        build = batch_ops().get(type(t))
        if build is None:
            return None
        try:
            ops.append(build(t))
        except Unsupported:
            return None
    return BatchTransform(ops)
