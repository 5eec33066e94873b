"""The bundled digits: scikit-learn's copy of the UCI handwritten digits (1797 8×8 images, 16 gray levels, public
domain), stored as uint8 with a fixed stratified split (``benchmarks/make_digits_data.py``). No files, no network.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from ..assets import DIGITS_FILE
from ..errors import VitconvertError

SPLITS = ("train", "val")
CLASSES = tuple(str(i) for i in range(10))
GRAY_LEVELS = 16  # the digits' pixel values are 0..16


@lru_cache(maxsize=1)
def digits_arrays() -> dict[str, np.ndarray]:
    """images (N, 8, 8) uint8 0..255, labels (N,), and the fixed train/val indices."""
    if not DIGITS_FILE.is_file():
        raise VitconvertError(f"the bundled digits data is missing ({DIGITS_FILE}); reinstall vitconvert")
    with np.load(DIGITS_FILE) as f:
        raw = {k: f[k] for k in f.files}
    images = np.round(raw["images"].astype(np.float32) * (255 / GRAY_LEVELS)).astype(np.uint8)
    return {"images": images, "labels": raw["labels"].astype(np.int64),
            "train": raw["train_idx"].astype(np.int64), "val": raw["val_idx"].astype(np.int64)}


class DigitsDataset(Dataset):
    """(PIL RGB 8×8 image, label) pairs; ``transform`` is set by whoever loads it, as with timm's ImageDataset."""

    classes = list(CLASSES)

    def __init__(self, split: str, transform: Optional[Callable[[Image.Image], Any]] = None,
                 target_transform: Optional[Callable[[int], Any]] = None):
        if split not in SPLITS:
            raise VitconvertError(f"unknown digits split {split!r}; valid: {', '.join(SPLITS)}")
        data = digits_arrays()
        self.split = split
        self.indices = data[split]
        self.images = data["images"][self.indices]
        self.targets = [int(t) for t in data["labels"][self.indices]]
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def image(self, i: int) -> Image.Image:
        """Image ``i`` as RGB PIL, the form timm's transforms take."""
        return Image.fromarray(self.images[i]).convert("RGB")

    def uint8_images(self, indices: list[int]) -> tuple[np.ndarray, list[int]]:
        """Images ``indices`` as (B, 8, 8, 3) uint8 RGB (the grey level in each channel, as ``image`` makes them)
        and their labels: what a batch transform takes (data/batched.py)."""
        grey = self.images[indices]
        return np.repeat(grey[..., None], 3, axis=-1), [self.targets[i] for i in indices]

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        img, target = self.image(i), self.targets[i]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target


def digits_dataset(split: str, transform: Optional[Callable[[Image.Image], Any]] = None) -> DigitsDataset:
    """The bundled digits' ``train`` (1500 images) or ``val`` (297) split; no files, no network."""
    return DigitsDataset(split, transform=transform)


def export_imagefolder(root: Union[str, Path], force: bool = False) -> Path:
    """Write the digits as ``root/{train,val}/<class>/<index>.png``, the layout ``--data FOLDER`` reads."""
    root = Path(root)
    if root.exists() and any(root.iterdir()) and not force:
        raise VitconvertError(f"{root} already exists and is not empty; use force=True to write into it")
    for split in SPLITS:
        ds = digits_dataset(split)
        for cls in CLASSES:
            (root / split / cls).mkdir(parents=True, exist_ok=True)
        for i in range(len(ds)):
            ds.image(i).save(root / split / str(ds.targets[i]) / f"{int(ds.indices[i]):04d}.png")
    return root
