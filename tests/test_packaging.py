"""What an installed wheel needs: recipes and the embedded default shipped inside the package."""

from __future__ import annotations

from pathlib import Path

import pytest

from vitconvert.recipes import available_recipes, find_recipe

ROOT = Path(__file__).resolve().parents[1]


def test_named_recipes_resolve_from_the_package():
    names = available_recipes()
    for name in ("cifar10", "cifar100", "stl10", "food101", "flowers102", "pets", "imagenet1k", "quickstart"):
        assert name in names
        path = find_recipe(name)
        assert path.parent.name == "recipe_files"
        assert path.read_text() == (ROOT / "recipes" / f"{name}.yaml").read_text()


def test_package_data_covers_recipes_and_assets():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vitconvert"]
    assert "recipe_files/*.yaml" in data and "assets/**/*" in data
    assert (ROOT / "vitconvert" / "recipe_files").resolve() == (ROOT / "recipes").resolve()
