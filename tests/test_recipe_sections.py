"""The recipe's sections: each checks itself when built; every form a value arrives in (a file in sections, an old
flat file, a dotted or flat override, an old run's flat dict) reaches the same field through one path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vitconvert.errors import VitconvertError
from vitconvert.recipe_report import recipe_changes
from vitconvert.recipe_sections import Augmentation, Optimization, Schedule
from vitconvert.recipes import FLAT_KEYS, Recipe, available_recipes, build_recipe, load_recipe

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", available_recipes())
def test_every_shipped_recipe_reads_the_same_from_its_old_flat_file(name):
    """tests/fixtures/flat_recipes holds the shipped recipes as they were before sections, byte for byte."""
    old = load_recipe(str(FIXTURES / "flat_recipes" / f"{name}.yaml"))[0]
    assert load_recipe(name)[0] == old


def test_the_flat_keys_are_the_old_flat_recipe_fields():
    stored = json.loads((FIXTURES / "run_v1" / "run" / "checkpoint-last" / "trainer.json").read_text())["recipe"]
    assert set(stored) == set(FLAT_KEYS) | {"name", "seed"}
    assert build_recipe(stored) == load_recipe(str(FIXTURES / "run_v1" / "run" / "recipe.yaml"))[0]


@pytest.mark.parametrize("overrides", [
    {"epochs": 4, "new_params.lr_scale": 10},  # the flat forms of --set
    {"schedule.epochs": 4, "optimization.new_params.lr_scale": 10},
    {"schedule": {"epochs": 4}, "new_params": {"lr_scale": 10}},
    {"schedule.epochs": 4, "optimization": {"new_params": {"lr_scale": 10}}},
])
def test_every_override_form_sets_the_same_field(overrides):
    recipe = load_recipe("quickstart", overrides)[0]
    assert recipe.schedule.epochs == 4 and recipe.optimization.new_params.lr_scale == 10.0
    assert recipe == load_recipe("quickstart", {"epochs": 4, "new_params.lr_scale": 10})[0]


def test_a_sectioned_file_and_its_flat_twin_agree(tmp_path):
    (tmp_path / "s.yaml").write_text("name: x\nschedule:\n  epochs: 10\n  warmup_epochs: 4\noptimization:\n"
                                     "  new_params: {lr_scale: 3}\n")
    (tmp_path / "f.yaml").write_text("name: x\nepochs: 10\nwarmup_epochs: 4\nnew_params: {lr_scale: 3}\n")
    sectioned, text = load_recipe(str(tmp_path / "s.yaml"), {"epochs": 5})
    assert sectioned == load_recipe(str(tmp_path / "f.yaml"), {"schedule.epochs": 5})[0]
    assert sectioned.schedule.warmup_epochs == 2  # scaled with the epochs, as written for 10
    assert "warmup_epochs 4 -> 2 (written for 10 epochs)" in sectioned.schedule.schedule_scaled
    (tmp_path / "stored.yaml").write_text(text)
    again, more = load_recipe(str(tmp_path / "stored.yaml"), {"lr": 0.5})  # a resume with one more override
    assert again.schedule.epochs == 5 and again.schedule.lr == 0.5
    (tmp_path / "stored2.yaml").write_text(more)
    assert load_recipe(str(tmp_path / "stored2.yaml"))[0] == again


@pytest.mark.parametrize("values,overrides,text", [
    ({"epochs": 3, "schedule": {"epochs": 4}}, {}, "recipe key schedule.epochs is given twice"),
    ({}, {"epochs": 3, "schedule.epochs": 4}, "recipe overrides epochs and schedule.epochs both set schedule.epochs"),
    ({"schedule": {"epoch": 3}}, {}, "unknown recipe key schedule.epoch; did you mean epochs?"),
    ({}, {"schedule.epoch": 3}, "unknown recipe key schedule.epoch; did you mean epochs?"),
    ({"schedule": 3}, {}, "recipe schedule: expected a mapping such as {epochs: ...}, got 3"),
    ({}, {"shedule.epochs": 3}, "unknown recipe key 'shedule.epochs'; did you mean schedule?"),
    ({"new_params": {"warmup_epochs": 9}, "epochs": 4, "warmup_epochs": 0}, {},
     "new_params.warmup_epochs (9) must be below epochs (4)"),
])
def test_misplaced_and_doubled_keys_are_refused_in_one_line(values, overrides, text):
    with pytest.raises(VitconvertError, match=re.escape(text)):
        build_recipe(values, overrides)


def test_each_section_checks_itself_once_when_built():
    with pytest.raises(VitconvertError, match="recipe epochs must be at least 1"):
        Schedule(epochs=0)
    with pytest.raises(VitconvertError, match="recipe hflip: 2.0 is a probability"):
        Augmentation(hflip=2)
    with pytest.raises(VitconvertError, match="recipe opt: unknown 'adamm'; did you mean adam"):
        Optimization(opt="adamm")
    assert isinstance(Schedule(lr=1, warmup_epochs=0, epochs=2).lr, float)  # coerced as a YAML value is


def test_no_optimizer_or_scheduler_is_built_to_check_names(monkeypatch):
    import timm.optim
    import timm.scheduler

    def built(*args, **kwargs):
        raise AssertionError("built only to validate")

    monkeypatch.setattr(timm.optim, "create_optimizer_v2", built)
    monkeypatch.setattr(timm.scheduler, "create_scheduler_v2", built)
    assert build_recipe({"opt": "sgd", "sched": "step"}).schedule.sched == "step"
    with pytest.raises(VitconvertError, match="recipe sched: unknown 'cosin'; did you mean cosine"):
        build_recipe({"sched": "cosin"})


def test_flat_names_still_read_for_the_transition():
    recipe = build_recipe({"epochs": 7, "warmup_epochs": 1, "reprob": 0.5})
    for name, path in FLAT_KEYS.items():
        section, _, field = path.partition(".")
        assert getattr(recipe, name) == getattr(getattr(recipe, section), field)
    with pytest.raises(AttributeError):
        recipe.not_a_field  # noqa: B018


def test_changes_between_an_old_flat_dict_and_a_sectioned_recipe_name_the_field():
    stored = json.loads((FIXTURES / "run_v1" / "run" / "checkpoint-last" / "trainer.json").read_text())["recipe"]
    recipe = build_recipe({**stored, "lr": 0.5, "workers": 3})  # workers: operational, not a change
    assert recipe_changes(stored, recipe) == ["lr: 0.001 -> 0.5"]
    assert recipe_changes(recipe.to_dict(), recipe) == [] and isinstance(Recipe().to_dict()["schedule"], dict)
