"""Recipes: YAML -> one frozen Recipe of sections, each checked once; overrides; the stored text reloads the same."""

from __future__ import annotations

import dataclasses
import re

import pytest

from vitconvert.errors import VitconvertError
from vitconvert.recipe_report import recipe_changes
from vitconvert.recipes import Recipe, available_recipes, build_recipe, load_recipe

PAPER_DATASETS = ("cifar10", "cifar100", "stl10", "food101", "flowers102", "pets", "imagenet1k")


@pytest.mark.parametrize("name", PAPER_DATASETS)
def test_paper_recipes_follow_xu_et_al(name):
    recipe, text = load_recipe(name)
    o, s, i, a = recipe.optimization, recipe.schedule, recipe.input, recipe.augmentation
    assert recipe.name == name and text.startswith("#")
    assert (o.opt, o.weight_decay, s.min_lr, s.epochs) == ("adamw", 0.05, 1e-6, 300)
    assert (i.img_size, i.interpolation, a.rand_augment) == (224, "bicubic", "rand-m9-mstd0.5-inc1")
    assert (a.color_jitter, a.smoothing, a.reprob) == (0.4, 0.1, 0.25)
    assert (a.mixup, a.cutmix, a.mixup_switch_prob) == (0.8, 1.0, 0.5)
    assert o.resolved_drop_path(192) == 0.0 and o.resolved_drop_path(384) == 0.1
    expected = (4096, 4e-3, 50) if name == "imagenet1k" else (512, 2e-3, 50)
    assert (o.batch_size, s.lr, s.warmup_epochs) == expected


def test_every_shipped_recipe_loads():
    assert set(PAPER_DATASETS) <= set(available_recipes())
    for name in available_recipes():
        assert isinstance(load_recipe(name)[0], Recipe)


def test_recipe_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Recipe().schedule.lr = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Recipe().name = "x"  # type: ignore[misc]


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    (tmp_path / "r.yaml").write_text("epochs: 3\nlearning_rate: 0.1\n")
    with pytest.raises(VitconvertError, match="unknown recipe key 'learning_rate'"):
        load_recipe(str(tmp_path / "r.yaml"))
    with pytest.raises(VitconvertError, match="'warmup_epoch'; did you mean warmup_epochs"):
        load_recipe(None, {"warmup_epoch": 3})


@pytest.mark.parametrize("values,text", [
    ({"epochs": "ten"}, "epochs: expected int"),
    ({"epochs": 0}, "epochs must be at least 1"),
    ({"attn_loss": "l3"}, "not one of mse, cosine, smooth_l1"),
    ({"attn_target": "mine"}, "not one of own, teacher-forced"),
    ({"drop_path": "big"}, "drop_path must be 'auto'"),
    ({"batch_size": 10, "accum_steps": 4}, "not divisible by accum_steps"),
    ({"stages": "attn:5,finetune:5", "epochs": 3}, "do not fit in 3 epochs"),
    ({"stages": "warmup"}, "unknown stage 'warmup'"),
    ({"stages": "attn:0steps,finetune"}, "needs at least one step"),
    ({"stages": "attn:0,finetune"}, "needs at least one epoch"),
    ({"stages": "attn:60stps,finetune"}, "whole number of epochs .attn:5. or of optimizer steps"),
    ({"stages": "attn:10steps,finetune:3", "epochs": 3}, "do not fit in 3 epochs"),
    ({"lr": None}, "lr cannot be null"),
])
def test_bad_values_are_refused(values, text):
    with pytest.raises(VitconvertError, match=text):
        build_recipe(values)


def test_types_are_coerced():
    recipe = build_recipe({"lr": 1, "scale": [0.5, 1], "mean": [0.5, 0.5, 0.5], "img_size": 8})
    s, a, i = recipe.schedule, recipe.augmentation, recipe.input
    assert s.lr == 1.0 and isinstance(s.lr, float) and a.scale == (0.5, 1.0) and i.img_size == 8


@pytest.mark.parametrize("stages,epochs,updates,plan", [
    ("joint", 4, 1, [("joint", 4)]),
    ("attn,finetune", 5, 1, [("attn", 3), ("finetune", 2)]),
    ("attn:1,finetune", 5, 1, [("attn", 1), ("finetune", 4)]),
    ("attn,finetune", 5, 10, [("attn", 30), ("finetune", 20)]),  # whole epochs when every count is in epochs
    ("attn:7steps,finetune", 2, 10, [("attn", 7), ("finetune", 13)]),
    ("attn:1step,finetune", 1, 3, [("attn", 1), ("finetune", 2)]),
    ("attn:5steps,finetune,joint", 2, 10, [("attn", 5), ("finetune", 8), ("joint", 7)]),  # the rest in steps
    ("attn:5steps,finetune:1,joint", 2, 10, [("attn", 5), ("finetune", 10), ("joint", 5)]),
])
def test_stage_plans(stages, epochs, updates, plan):
    schedule = build_recipe({"stages": stages, "epochs": epochs, "warmup_epochs": 0}).schedule
    assert schedule.stage_steps(updates) == tuple(plan)
    assert schedule.stage_names() == tuple(name for name, _ in plan)


@pytest.mark.parametrize("stages,epochs,updates,text", [
    ("attn:25steps,finetune", 2, 10, r"do not fit in 2 epochs of 10 optimizer steps \(20 steps\)"),
    ("attn:20steps,finetune", 2, 10, "do not fit"),  # the finetune stage would have no step
])
def test_a_count_in_steps_is_checked_against_the_runs_steps(stages, epochs, updates, text):
    schedule = build_recipe({"stages": stages, "epochs": epochs, "warmup_epochs": 0}).schedule
    with pytest.raises(VitconvertError, match=text):
        schedule.stage_steps(updates)


def test_overrides_are_stored_after_the_text_and_reload_to_the_same_recipe(tmp_path):
    recipe, text = load_recipe("cifar100", {"epochs": 600, "data": "/data/c100"})
    assert recipe.schedule.epochs == 600 and recipe.dataset.data == "/data/c100"
    assert text.startswith(load_recipe("cifar100")[1]) and "overrides from the command line" in text
    (tmp_path / "recipe.yaml").write_text(text)
    assert load_recipe(str(tmp_path / "recipe.yaml"))[0] == recipe


def test_the_default_recipe_text_reloads_too(tmp_path):
    recipe, text = load_recipe(None, {"epochs": 2})
    (tmp_path / "default.yaml").write_text(text)
    assert dataclasses.replace(load_recipe(str(tmp_path / "default.yaml"))[0], name="default") == recipe


def test_recipe_changes_ignore_where_and_how_fast():
    old = Recipe().to_dict()
    assert recipe_changes(old, build_recipe({"workers": 8, "data_dir": "/elsewhere", "log_interval": 1})) == []
    assert recipe_changes(old, build_recipe({"lr": 0.1})) == ["lr: 0.002 -> 0.1"]
    before_head_lr_scale = Recipe().to_dict()
    del before_head_lr_scale["optimization"]["new_params"]["head_lr_scale"]
    assert recipe_changes(before_head_lr_scale, Recipe()) == []  # a checkpoint written before the sub-key existed
    assert recipe_changes(before_head_lr_scale, build_recipe({"new_params": {"head_lr_scale": 1}})) != []


def test_missing_recipe_lists_the_shipped_ones():
    with pytest.raises(VitconvertError, match="recipe not found: nope.*cifar100"):
        load_recipe("nope")


@pytest.mark.parametrize("values,text", [
    ({"new_params": {"lr_scal": 10}}, "unknown recipe key new_params.lr_scal; did you mean lr_scale"),
    ({"new_params": {"speed": 2}}, "unknown recipe key new_params.speed; valid: lr_scale, weight_decay, warmup"),
    ({"new_params": {"lr_scale": 0}}, "new_params.lr_scale must be positive"),
    ({"new_params": {"head_lr_scale": -1}}, "new_params.head_lr_scale must be positive"),
    ({"new_params": {"lr_scale": "fast"}}, "new_params.lr_scale: expected float"),
    ({"new_params": {"warmup_epochs": -1}}, "new_params.warmup_epochs must not be negative"),
    ({"new_params": 10}, "expected a mapping such as {lr_scale: 10}"),
    ({"freeze_copied_epochs": 5, "epochs": 3}, "freeze_copied_epochs must be between 0 and epochs"),
    ({"layer_decay": 1.5}, "layer_decay must be in"),
    ({"compare_batches": -1}, "compare_batches must not be negative"),
])
def test_bad_parameter_group_values_are_refused(values, text):
    with pytest.raises(VitconvertError, match=text.replace("{", r"\{").replace("}", r"\}")):
        build_recipe(values)


def test_new_params_overrides_merge_into_the_file_and_reload(tmp_path):
    (tmp_path / "r.yaml").write_text("epochs: 4\nnew_params:\n  lr_scale: 10\n  warmup_epochs: 1\n")
    recipe, text = load_recipe(str(tmp_path / "r.yaml"), {"new_params.weight_decay": 0.1})
    new = recipe.optimization.new_params
    assert new.lr_scale == 10.0 and new.warmup_epochs == 1 and new.weight_decay == 0.1
    (tmp_path / "again.yaml").write_text(text)
    assert dataclasses.replace(load_recipe(str(tmp_path / "again.yaml"))[0], name="r") == recipe
    assert recipe.to_dict()["optimization"]["new_params"] == {"lr_scale": 10.0, "weight_decay": 0.1,
                                                              "warmup_epochs": 1, "head_lr_scale": None}
    assert build_recipe({"new_params": {"lr_scale": 10}}).optimization.new_params == new.__class__(lr_scale=10.0)
    stored = Recipe().to_dict()
    del stored["optimization"]["new_params"]
    assert recipe_changes(stored, Recipe()) == []
    assert recipe_changes(Recipe().to_dict(), build_recipe({"compare_batches": 0})) == []  # operational: no --force


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("lr", -1.0, "must be a positive number"),
    ("lr", 0.0, "must be a positive number"),  # one rule for the lr (it was `< 0` in one place, `<= 0` in the other)
    ("weight_decay", -0.1, "must not be negative"),
    ("attn_weight", -1.0, "must not be negative"),
    ("smoothing", -0.1, "must be in [0, 1)"),
    ("reprob", 1.5, "is a probability"),
])
def test_each_number_rule_has_one_home(field, value, rule):
    with pytest.raises(VitconvertError, match=re.escape(f"recipe {field}: {value!r} {rule}")):
        load_recipe(None, {field: value})


def test_the_stage_plan_is_parsed_once_and_travels_with_the_recipe(monkeypatch):
    import pickle

    from vitconvert import recipe_checks

    recipe = build_recipe({"epochs": 4, "stages": "attn:1,finetune", "warmup_epochs": 0})
    monkeypatch.setattr(recipe_checks, "parse_stages", lambda *args: pytest.fail("parsed again"))
    s = recipe.schedule
    assert s.stage_steps(2) == (("attn", 2), ("finetune", 6)) and s.stage_names() == ("attn", "finetune")
    copy = pickle.loads(pickle.dumps(recipe))  # a worker process gets the plan with the recipe
    assert copy == recipe and copy.schedule.stage_steps(2) == s.stage_steps(2) and "_plan" not in str(recipe.to_dict())
