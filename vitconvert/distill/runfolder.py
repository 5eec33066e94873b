"""The run folder: a model folder (the final model at its root) with best/, checkpoint-last/, metrics.jsonl
and recipe.yaml beside it. It is never overwritten unless the user says --resume or --force.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..errors import VitconvertError
from ..folder import atomic_folder, write_model_files
from ..recipes import Recipe, recipe_changes
from . import distributed as D
from .checkpoint import Checkpoint, read_checkpoint

RECIPE = "recipe.yaml"


def prepare_run_folder(run: Path, recipe: Recipe, recipe_text: str, resume: bool, force: bool,
                       env: D.DistEnv) -> Optional[Checkpoint]:
    """Create (or, resuming, read) the run folder; refuse to overwrite or to resume a changed recipe."""
    if resume:
        ckpt = read_checkpoint(run)
        changes = recipe_changes(ckpt.recipe, recipe)
        if changes and not force:
            raise VitconvertError(f"--resume with a changed recipe ({'; '.join(changes[:4])}): the run would not "
                                  "match; add --force to continue under the new recipe")
        if changes and env.is_main:
            (run / RECIPE).write_text(recipe_text)
        return ckpt
    if run.exists() and (not run.is_dir() or any(run.iterdir())):
        if not force:
            raise VitconvertError(f"{run} already exists; use --resume to continue it or --force to start over")
        D.barrier(env)  # every rank has seen the old folder before rank 0 removes it
        if env.is_main:
            shutil.rmtree(run) if run.is_dir() else run.unlink()
    D.barrier(env)
    if env.is_main:
        run.mkdir(parents=True, exist_ok=True)
        (run / RECIPE).write_text(recipe_text)
    D.barrier(env)
    return None


def write_model_folder(export: nn.Module, state: dict[str, torch.Tensor], folder: Path, meta: dict[str, Any],
                       in_place: bool = False) -> None:
    """``export`` with ``state`` as a model folder; ``in_place`` replaces the model files of an existing folder
    (the run root) one by one, each by an atomic rename."""
    export.load_state_dict(state)
    if not in_place:
        with atomic_folder(folder, force=True) as tmp:
            write_model_files(export, tmp, meta)
        return
    tmp = Path(tempfile.mkdtemp(prefix=".final-", dir=folder))
    try:
        write_model_files(export, tmp, meta)
        for f in tmp.iterdir():
            os.replace(f, folder / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def card_metrics(recipe: Recipe, record: dict[str, Any], best_top1: float, best_epoch: int) -> dict[str, Any]:
    """The model card's results (percentages, as the Hub shows them) from an epoch record of metrics.jsonl."""
    data = str(recipe.data)
    dataset = Path(data).name if Path(data).expanduser().exists() else data
    return {"dataset": dataset, "split": recipe.val_split, "top1": round(100 * record["val_top1"], 2),
            "top5": round(100 * record["val_top5"], 2), "loss": round(record["val_loss"], 4),
            "epochs": record["epoch"], "best_top1": round(100 * best_top1, 2), "best_epoch": best_epoch}
