"""`vitconvert distill` trains with every shipped recipe and with the default one, augmentation as shipped.

Only what cannot fit a test changes: the data (a small image folder instead of the recipe's dataset), one epoch
of a few steps, a small batch, the tiny student's own image size, and a loader with one worker process (the
path that used to crash on Pillow 13). RandAugment, mixup/cutmix, random erasing, smoothing stay the recipe's.
"""

from __future__ import annotations

import json

import pytest
from helpers import runner

from vitconvert.cli import app
from vitconvert.recipes import available_recipes, load_recipe

from .helpers import make_images, make_student

RECIPES = [*available_recipes(), None]  # None: no --recipe


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes-train")
    return make_student(root), make_images(root / "images", per_class=6, val_per_class=2)


@pytest.mark.parametrize("spec", RECIPES, ids=lambda s: s or "default")
def test_distill_trains_with_the_recipe(setup, tmp_path, spec):
    student, images = setup
    shipped, _ = load_recipe(spec)
    batch = 4 * shipped.accum_steps  # an even micro-batch (mixup) whatever the accumulation
    args = ["distill", str(student), "--data", str(images), "--out", str(tmp_path / "run"), "--epochs", "1",
            "--batch-size", str(batch), "--set", "img_size=null", "--set", "workers=1", "--set", "warmup_epochs=0",
            "--set", "compare_batches=1", "--json", *(["--recipe", spec] if spec else [])]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert 0 <= printed["top1"] <= 1 and printed["n"] == 6
    stored, _ = load_recipe(str(tmp_path / "run" / "recipe.yaml"))
    for key in ("rand_augment", "mixup", "cutmix", "reprob", "smoothing", "color_jitter", "hflip", "scale"):
        assert getattr(stored, key) == getattr(shipped, key), key  # trained with the shipped augmentation
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "step" for r in steps) >= 1
