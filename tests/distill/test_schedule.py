"""A shortened recipe keeps its schedule's shape: warm-up to the peak lr, then the cosine down to min_lr.

The lr is read off the optimizer that the trainer's own ``create_optimization`` builds, stepped the way the
trainer steps it (``step_update`` after every optimizer step), so this is the schedule a run gets.
"""

from __future__ import annotations

import pytest
import timm
from helpers import runner

from vitconvert.cli import app
from vitconvert.distill.param_groups import create_optimization, logged_lrs
from vitconvert.errors import VitconvertError
from vitconvert.recipes import available_recipes, load_recipe

from .helpers import make_images, make_student

RECIPES = [*available_recipes(), None]  # None: the default recipe (no --recipe)
UPDATES_PER_EPOCH = 5


@pytest.fixture(scope="module")
def model():
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, embed_dim=16,
                             depth=2, num_heads=2, num_classes=3)


@pytest.mark.parametrize("spec", RECIPES, ids=lambda s: s or "default")
def test_fifteen_epochs_reach_the_peak_lr_and_end_at_min_lr(model, spec):
    shipped, _ = load_recipe(spec)
    recipe, text = load_recipe(spec, {"epochs": 15})
    kept = round(shipped.schedule.warmup_epochs * 15 / shipped.schedule.epochs)
    assert recipe.schedule.warmup_epochs == kept  # proportion kept
    assert 0 < recipe.schedule.warmup_epochs < 15 or shipped.schedule.warmup_epochs == 0
    optimizer, scheduler = create_optimization(model, recipe, UPDATES_PER_EPOCH)
    lrs = []
    for step in range(1, 15 * UPDATES_PER_EPOCH + 1):
        scheduler.step_update(step)
        lrs.append(logged_lrs(optimizer)["lr"])
    peak_at = recipe.schedule.warmup_epochs * UPDATES_PER_EPOCH
    assert max(lrs) == pytest.approx(recipe.schedule.lr) and lrs[peak_at - 1] == pytest.approx(recipe.schedule.lr)
    assert lrs[:peak_at] == sorted(lrs[:peak_at])  # warming up
    assert lrs[peak_at - 1:] == sorted(lrs[peak_at - 1:], reverse=True)  # then the cosine, all of it
    assert lrs[-1] == pytest.approx(recipe.schedule.min_lr)
    assert "warmup_epochs: " in text and "schedule_scaled:" in text  # recipe.yaml says what was scaled


def test_the_user_s_own_warmup_and_a_pinned_recipe_are_not_scaled(tmp_path):
    recipe, _ = load_recipe("cifar100", {"epochs": 15, "warmup_epochs": 5})
    assert recipe.schedule.warmup_epochs == 5 and recipe.schedule.schedule_scaled is None
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text("epochs: 100\nwarmup_epochs: 10\nscale_schedule: false\n")
    assert load_recipe(str(pinned), {"epochs": 50})[0].schedule.warmup_epochs == 10
    with pytest.raises(VitconvertError, match=r"warmup_epochs \(10\) must be below epochs \(8\)"):
        load_recipe(str(pinned), {"epochs": 8})
    unscaled, _ = load_recipe("quickstart")
    assert unscaled.schedule.schedule_scaled is None  # the recipe's own length: nothing to scale


def test_a_file_that_sets_epochs_scales_the_default_warmup(tmp_path):
    short = tmp_path / "short.yaml"
    short.write_text("epochs: 12\n")  # no warmup_epochs: the default 50 was written for 300 epochs
    recipe, text = load_recipe(str(short))
    assert recipe.schedule.warmup_epochs == 2 and "written for 300 epochs" in recipe.schedule.schedule_scaled
    again = tmp_path / "again.yaml"
    again.write_text(text)
    assert load_recipe(str(again))[0].schedule.warmup_epochs == 2  # recipe.yaml re-reads the same


def test_distill_prints_what_will_run_and_what_was_scaled(tmp_path):
    student = make_student(tmp_path)
    images = make_images(tmp_path / "images")
    result = runner.invoke(app, ["distill", str(student), "--data", str(images), "--out", str(tmp_path / "r"),
                                      "--epochs", "1", "--batch-size", "4", "--set", "img_size=null"])
    assert result.exit_code == 0, result.output
    first, *head = result.stderr.splitlines()[:4]
    assert first.startswith(f"distilling {student} from the teacher "), first  # who, from whom, where to
    assert head[0].startswith("recipe default: 1 epoch, warm-up 0") and "peak 0.002" in head[0], head
    assert head[1].startswith("augmentation: random crops (area 0.08-1), RandAugment rand-m9-mstd0.5-inc1, mixup"), head
    assert head[2] == "scaled with --epochs: to 1 epoch: warmup_epochs 50 -> 0 (written for 300 epochs)", head
