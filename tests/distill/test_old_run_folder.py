"""A run folder written before the recipe had sections (tests/fixtures/run_v1, made by its make.py) resumes as is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vitconvert.distill import distill
from vitconvert.recipe_report import recipe_changes
from vitconvert.recipes import load_recipe

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_v1"


def test_a_run_folder_of_the_flat_format_resumes_without_force(tmp_path, monkeypatch):
    shutil.copytree(FIXTURE, tmp_path / "old")
    monkeypatch.chdir(tmp_path / "old")
    saved = json.loads(Path("run/checkpoint-last/trainer.json").read_text())
    recipe = load_recipe("run/recipe.yaml")[0]
    assert recipe_changes(saved["recipe"], recipe) == []  # the flat dict is the same recipe: no --force needed
    s, new = recipe.schedule, recipe.optimization.new_params
    assert (s.epochs, s.warmup_epochs, recipe.seed, new.lr_scale) == (2, 1, 3, 2.0)

    result = distill("student", "run", resume=True, show=False)  # recipe and teacher: the run's own

    assert result.metrics["epochs"] == 2 and result.metrics["best_epoch"] in (1, 2)
    epochs = [json.loads(line) for line in Path("run/metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in epochs if r["kind"] == "epoch"] == [1, 2]
    after = json.loads(Path("run/checkpoint-last/trainer.json").read_text())
    assert after["position"]["epoch"] == 2 and recipe_changes(after["recipe"], recipe) == []
    assert Path("run/recipe.yaml").read_text() == (FIXTURE / "run" / "recipe.yaml").read_text()
