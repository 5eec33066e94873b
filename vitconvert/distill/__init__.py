"""Distill-and-finetune: train a converted student against its softmax teacher (``vitconvert distill``).

``run(DistillJob(...))`` is the library entry point; ``distill()`` the short form the CLI and scripts use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from ..recipes import load_recipe
from .runfolder import resume_defaults
from .trainer import DistillJob, RunResult, TrainingStopped, run


def distill(student: Union[str, Path], out: Union[str, Path], recipe: Optional[str] = None,
            overrides: Optional[dict[str, Any]] = None, **job: Any) -> RunResult:
    """Distill the model folder ``student`` into the run folder ``out``.

    ``recipe`` is a YAML path or a name in recipes/; ``overrides`` replace its keys (``{"epochs": 3}``);
    ``job`` takes DistillJob's run options: teacher, resume, force, device, fsdp, compile, show.
    """
    parsed, text = load_recipe(recipe, overrides)
    return run(DistillJob(student=str(student), recipe=parsed, out=Path(out), recipe_text=text, **job))


__all__ = ["DistillJob", "RunResult", "TrainingStopped", "distill", "resume_defaults", "run"]
