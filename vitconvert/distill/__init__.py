"""Distill-and-finetune: train a converted student against its softmax teacher (``vitconvert distill``).

``distill(...)`` is the library call (the CLI is a wrapper around it); ``run(DistillJob(...))`` runs a job
whose recipe is already parsed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from ..errors import VitconvertError
from ..loading import model_threads
from ..recipes import load_recipe
from .job import DistillJob, RunResult
from .runfolder import resume_defaults
from .signals import TrainingStopped
from .trainer import run


def distill(student: Union[str, Path, None] = None, out: Union[str, Path, None] = None, recipe: Optional[str] = None,
            overrides: Optional[dict[str, Any]] = None, threads: Optional[int] = None, **job: Any) -> RunResult:
    """Distill the model folder ``student`` into the run folder ``out``.

    ``recipe`` is a YAML path or a name in recipes/ (default: the built-in recipe); ``overrides`` replace its
    keys (``{"epochs": 3}``); ``job`` takes DistillJob's run options: teacher, pretrained (a named
    teacher's weights), resume, force, device, fsdp, compile, show. Resuming (``resume=True``) needs only
    ``out``: the recipe and the student default to the run's own. ``out`` defaults to ``runs/<student>-<recipe name>``.
    ``threads``: torch's CPU threads during the run, as ``vitconvert distill --threads`` (None: 1 for a small
    student unless OMP_NUM_THREADS is set, else torch's; ``loading.model_threads``); the caller's count comes back.
    """
    if job.get("resume") and out is not None:  # a resume needs the run folder and nothing else
        run_recipe, run_student = resume_defaults(Path(out))
        recipe, student = recipe or run_recipe, student or run_student
    if student is None:
        raise VitconvertError("no student model folder given (a resumed run uses its own when its checkpoint "
                              "records it)")
    parsed, text = load_recipe(recipe, overrides)
    out = Path(out) if out is not None else Path("runs") / f"{Path(student).resolve().name}-{parsed.name}"
    with model_threads(threads, student):
        return run(DistillJob(student=str(student), recipe=parsed, out=out, recipe_text=text, **job))


__all__ = ["DistillJob", "RunResult", "TrainingStopped", "distill", "resume_defaults", "run"]
