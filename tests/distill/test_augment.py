"""Every shipped recipe's training transform, as distill builds it, runs every augmentation op at every magnitude."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from helpers import tiny_model
from PIL import Image

from vitconvert import data
from vitconvert.data.augment import augment_ops, posterize
from vitconvert.recipes import available_recipes, load_recipe

RECIPES = [*available_recipes(), None]  # None: the default recipe (distill without --recipe)
# Magnitudes on a 0.05 grid over timm's clip range [0, 10] and beyond it (mstd noise lands anywhere).
MAGNITUDES = [*np.round(np.arange(0, 10.0001, 0.05), 2).tolist(), -1.0, 9.999, 12.0]


def picture(size: int = 24) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def recipe_transform(spec):
    recipe, _ = load_recipe(spec)
    model = tiny_model("vit")
    return recipe, data.train_transform(recipe, data.input_config(model, recipe))


def test_recipes_are_shipped():
    assert {"cifar10", "cifar100", "imagenet1k", "quickstart"} <= set(available_recipes())


@pytest.mark.parametrize("spec", RECIPES, ids=lambda s: s or "default")
def test_every_op_of_the_recipe_runs_at_every_magnitude(spec):
    recipe, transform = recipe_transform(spec)
    ops = augment_ops(transform)
    if not recipe.augmentation.rand_augment:
        assert ops == []
        return
    names = {op.name for op in ops}
    assert len(ops) >= 14 and any(n.startswith("Posterize") for n in names), names
    image = picture()
    for op in ops:
        for magnitude in MAGNITUDES:
            forced = copy.copy(op)  # the recipe's op as built (level function, hparams, fill), always applied
            forced.prob, forced.magnitude, forced.magnitude_std = 1.0, magnitude, 0
            out = forced(image)
            assert out.size == image.size and out.mode == "RGB", (op.name, magnitude)
    for index in range(8):  # and the whole pipeline, seeded as the trainer seeds it
        with data.sample_rng(recipe.seed, 0, index):
            tensor = transform(picture(40))
        assert tuple(tensor.shape[1:]) == (recipe.input.img_size or 32,) * 2


def test_the_top_magnitude_posterizes_to_zero_bits_which_is_black():
    _, transform = recipe_transform(None)
    (op,) = [op for op in augment_ops(transform) if op.name == "PosterizeIncreasing"]
    assert op.level_fn(10, op.hparams) == (0,)  # timm: "keep 4 down to 0 MSB"; the case Pillow 13 refuses
    forced = copy.copy(op)
    forced.prob, forced.magnitude, forced.magnitude_std = 1.0, 10, 0
    assert np.asarray(forced(picture())).max() == 0


@pytest.mark.parametrize("bits", range(0, 9))
def test_posterize_keeps_the_top_bits(bits):
    """x & ~(2**(8 - bits) - 1): the formula of Pillow's posterize and of the TPU reference, 0 bits included."""
    image = picture()
    expected = np.asarray(image) & np.uint8(~(2 ** (8 - bits) - 1) & 0xFF)
    assert np.array_equal(np.asarray(posterize(image, bits)), expected)
