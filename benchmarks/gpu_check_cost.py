"""gpu_check's cost: the GPU-hours of the shipped recipes from the measured img/s."""

from __future__ import annotations

from typing import Any

from gpu_check_plan import NOT_MEASURED, Plan

from vitconvert.attention import VARIANTS
from vitconvert.bench import SOFTMAX
from vitconvert.recipes import load_recipe

DATASET_IMAGES = {"imagenet1k": 1_281_167, "cifar100": 50_000}  # training images per epoch


def cost(speed: list[dict[str, Any]], plan: Plan, dry_run: bool = True) -> list[dict[str, Any]]:
    """GPU-hours of each recipe: epochs × images × (teacher forward + student training step) per image.

    Both per-image times come from the eager bf16 rows at the recipe's image size (the smallest measured size
    in a dry run); data loading, validation and the optimizer update are left out, so this is a lower bound.
    """
    rows = []
    eager = [r for r in speed if not r["compile"] and not r["fla"]]
    for name, images in DATASET_IMAGES.items():
        recipe, _ = load_recipe(name)
        size = recipe.img_size if recipe.img_size in plan.sizes else plan.sizes[0]
        for source in plan.models:
            at = {(r["model"], r["mode"]): r for r in eager if r["source"] == source and r["img_size"] == size}
            teacher = at.get((SOFTMAX, "infer"))
            for model in [SOFTMAX, *VARIANTS]:
                student = at.get((model, "train"))
                if teacher is None or student is None:
                    continue
                seconds = 1 / teacher["img_per_s"] + 1 / student["img_per_s"]
                rows.append({"recipe": name, "images": images, "epochs": recipe.epochs, "img_size": size,
                             "source": source, "model": model, "img_per_s": 1 / seconds,
                             "gpu_hours": recipe.epochs * images * seconds / 3600})
    softmax = {(r["recipe"], r["source"]): r["gpu_hours"] for r in rows if r["model"] == SOFTMAX}
    for r in rows:  # the target: converting costs no more GPU time than training the softmax student
        limit = softmax.get((r["recipe"], r["source"]))
        r["verdict"] = (NOT_MEASURED if r["model"] == SOFTMAX or limit is None else
                        "dry run" if dry_run else ("pass" if r["gpu_hours"] <= limit else "FAIL"))
    return rows
