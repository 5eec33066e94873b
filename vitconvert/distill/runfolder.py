"""The run folder: a model folder (the final model at its root) with best/, checkpoint-last/, metrics.jsonl
and recipe.yaml beside it. It is never overwritten unless the user says --resume or --force.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from .. import distributed as D
from ..errors import VitconvertError, param
from ..folder import atomic_folder, write_model_files
from ..recipe_report import recipe_changes
from ..recipes import Recipe
from ..writer import _tag as writer_tag
from ..writer import apply_umask, check_output, is_run_folder, remove_stale_siblings, writable_error
from .checkpoint import CHECKPOINT, Checkpoint, read_checkpoint

RECIPE = "recipe.yaml"


def job_inputs(student: str, teacher: Optional[str], recipe: Recipe) -> list[str]:
    """The local paths a distill run reads: a run folder must never be, hold or sit inside one of them."""
    return [str(p) for p in (student, teacher, recipe.dataset.data) if p]


def resume_defaults(run: Path) -> tuple[Optional[str], Optional[Path]]:
    """What resuming ``run`` needs besides it: its own recipe.yaml, and the student its checkpoint was trained
    from (when recorded and still there); None where the run does not say."""
    recipe = str(run / RECIPE) if (run / RECIPE).is_file() else None
    student = None
    try:
        job = read_checkpoint(run).meta.get("job")
    except VitconvertError:
        job = None
    if isinstance(job, dict) and job.get("student_path") and Path(job["student_path"]).is_dir():
        student = Path(job["student_path"])
    return recipe, student


def failed_start(run: Path) -> bool:
    """A run folder that a failed start left behind: a recipe and nothing to resume or to keep."""
    return is_run_folder(run) and not (run / CHECKPOINT).exists() and not (run / "config.json").exists()


def check_run_folder(run: Path, resume: bool, force: bool, inputs: Iterable[str] = ()) -> None:
    """Every refusal that needs no model or data, so it comes before the minutes of loading."""
    if resume:
        read_checkpoint(run).verify()
        return
    empty = run.is_dir() and not any(run.iterdir())
    check_output(run, force=True, inputs=inputs, replace_ok=True)  # never a folder vitconvert did not write
    if run.exists() and not empty and not force and not failed_start(run):
        raise VitconvertError(f"{run} already exists; use {param('resume', True)} to continue it or "
                              f"{param('force', True)} to start over")


def aside(run: Path) -> Path:
    """Where a run replaced with --force waits until the new run has a checkpoint (writer.py's naming, so a
    killed run's leftover is cleaned like any stale sibling)."""
    return run.with_name(f".{run.name}.old-{writer_tag()}")


def prepare_run_folder(run: Path, recipe: Recipe, recipe_text: str, resume: bool, force: bool,
                       env: D.DistEnv, inputs: Iterable[str] = ()) -> Optional[Checkpoint]:
    """Create (or, resuming, read) the run folder; refuse to overwrite or to resume a changed recipe.

    Nothing is written before every check passed: a resumed run's recipe.yaml is rewritten (--force) only
    once its whole checkpoint has been read (``record_recipe``); a replaced run is moved aside, not deleted,
    until the new run has written its first checkpoint (``RunGuard``)."""
    if resume:
        ckpt = read_checkpoint(run)
        ckpt.verify()
        changes = recipe_changes(ckpt.recipe, recipe)
        epochs = recipe.schedule.epochs
        finished = (run / "config.json").is_file()  # a stop after the last epoch: a resume writes the final model
        if not changes and ckpt.position.epoch >= epochs and finished:
            raise VitconvertError(f"{run} is complete ({ckpt.position.epoch} of {epochs} epochs): nothing "
                                  f"to resume; to train longer, add {param('epochs', 'N')} {param('force', True)}")
        if changes and not force:
            raise VitconvertError(f"{param('resume', True)} with a changed recipe ({'; '.join(changes[:4])}): {run} "
                                  "was trained with its recipe.yaml, which a resume reads by itself; drop the changed "
                                  f"values, or add {param('force', True)} to continue under the new recipe")
        return ckpt
    check_run_folder(run, resume, force, inputs)
    if env.is_main:
        remove_stale_siblings(run)  # what a killed run left: its replaced run, moved aside
    if run.exists() and (not run.is_dir() or any(run.iterdir())):
        D.barrier(env)  # every rank has seen the old folder before rank 0 moves it
        if env.is_main:
            try:
                run.rename(aside(run))
            except OSError as e:
                raise writable_error(run, e) from None
    D.barrier(env)
    if env.is_main:
        try:
            run.mkdir(parents=True, exist_ok=True)
            apply_umask(run)
            (run / RECIPE).write_text(recipe_text)
        except OSError as e:
            raise writable_error(run, e) from None
    D.barrier(env)
    return None


def record_recipe(run: Path, recipe: Recipe, ckpt: Checkpoint, recipe_text: str, env: D.DistEnv) -> None:
    """A --resume --force under a changed recipe: store the new recipe, once the checkpoint has loaded."""
    if env.is_main and recipe_changes(ckpt.recipe, recipe):
        (run / RECIPE).write_text(recipe_text)


class RunGuard:
    """A run that fails before its first checkpoint leaves nothing: its folder is removed and the run it
    replaced (--force) comes back. Once a checkpoint exists, the replaced run is deleted."""

    def __init__(self, run: Path, resume: bool, env: D.DistEnv):
        self.run, self.active = run, env.is_main and not resume
        self.existed = run.exists()
        self.was_empty = run.is_dir() and not any(run.iterdir())

    def done(self, ok: bool) -> None:
        """End the guard: drop the old run after success (or once a checkpoint exists), else put it back."""
        if not self.active:
            return
        old = aside(self.run)
        if ok or (self.run / CHECKPOINT).is_dir():
            shutil.rmtree(old, ignore_errors=True)
            return
        fresh = old.exists() or not self.existed or self.was_empty  # this run created what is in the folder
        if fresh and self.run.is_dir():
            shutil.rmtree(self.run, ignore_errors=True)
            if self.was_empty:
                self.run.mkdir()
        if old.exists() and not self.run.exists():
            old.rename(self.run)


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
        apply_umask(tmp)
        for f in tmp.iterdir():
            os.replace(f, folder / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def card_metrics(recipe: Recipe, record: dict[str, Any], best_top1: float, best_epoch: int) -> dict[str, Any]:
    """The model card's results (percentages, as the Hub shows them) from an epoch record of metrics.jsonl."""
    data = str(recipe.dataset.data)
    dataset = Path(data).name if Path(data).expanduser().exists() else data
    top5 = record["val_top5"]  # None for 5 classes or fewer (top_k.py)
    return {"dataset": dataset, "split": recipe.dataset.val_split, "top1": round(100 * record["val_top1"], 2),
            "top5": None if top5 is None else round(100 * top5, 2), "loss": round(record["val_loss"], 4),
            "epochs": record["epoch"], "best_top1": round(100 * best_top1, 2), "best_epoch": best_epoch}
