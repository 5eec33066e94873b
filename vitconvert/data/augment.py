"""timm's RandAugment/AutoAugment/AugMix with posterize defined for every magnitude on every Pillow.

timm maps the top posterize magnitude to 0 bits ("keep 4 down to 0 MSB", as the TPU/UDA reference code does),
and on Pillow < 13 ``ImageOps.posterize(img, 0)`` masked every value with ``~255``: an all-black image, as the
reference's ``(x >> 8) << 8`` on uint8 gives. Pillow 13 refuses 0 bits with a ValueError, so about 1 in 400
augmented images crashed training. The ops, their probabilities and magnitudes stay timm's; only the 0-bit case
is computed here (the same black image) instead of being passed to Pillow, so no Pillow version can break it.
"""

from __future__ import annotations

from typing import Any

from PIL import Image


def posterize(img: Image.Image, bits_to_keep: int, **kwargs: Any) -> Image.Image:
    """timm's posterize; 0 (or fewer) bits kept is every channel value & ~255 == 0: black, as before Pillow 13."""
    from timm.data import auto_augment

    if bits_to_keep >= 1:
        return auto_augment.posterize(img, bits_to_keep, **kwargs)
    return img.point(lambda _: 0)


def augment_ops(transform: Any) -> list[Any]:
    """Every timm ``AugmentOp`` inside a transform (Compose, RandAugment, AutoAugment policies, AugMix)."""
    from timm.data.auto_augment import AugmentOp

    found: list[Any] = []
    stack = [transform]
    while stack:
        item = stack.pop()
        if isinstance(item, AugmentOp):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            stack.extend(getattr(item, attr) for attr in ("transforms", "ops", "policy") if hasattr(item, attr))
    return found


def fix_posterize(transform: Any) -> Any:
    """Point the transform's posterize ops at ``posterize`` above (in place; returns the transform)."""
    from timm.data import auto_augment

    for op in augment_ops(transform):
        if op.aug_fn is auto_augment.posterize:
            op.aug_fn = posterize
    return transform
