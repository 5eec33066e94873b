"""Write vitconvert/assets/digits.npz from scikit-learn's 8×8 digits (public domain, UCI ML repository).

Run once by a maintainer (``python benchmarks/make_digits_data.py``); the package then needs no
scikit-learn at runtime. The file holds the raw 0..16 gray levels as uint8 and a fixed, stratified
train/val split, so every run of every tool sees the same 1500 training and 297 validation images.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "vitconvert" / "assets" / "digits.npz"
VAL_SIZE = 297
SEED = 0


def stratified_split(labels: np.ndarray, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, val) with each class in val in proportion to its share of the data."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    train, val = train_test_split(idx, test_size=val_size, stratify=labels, random_state=seed)
    return np.sort(train), np.sort(val)


def main() -> None:
    from sklearn.datasets import load_digits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    digits = load_digits()
    images = digits.images.astype(np.uint8)  # 0..16 gray levels, exact in uint8
    assert np.array_equal(images, digits.images), "digits are expected to be integer gray levels"
    labels = digits.target.astype(np.uint8)
    train, val = stratified_split(labels, VAL_SIZE, SEED)
    np.savez_compressed(args.out, images=images, labels=labels, train_idx=train.astype(np.int16),
                        val_idx=val.astype(np.int16))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.1f} KiB): {len(train)} train, {len(val)} val")


if __name__ == "__main__":
    main()
