"""One quickstart training (a converted student, distilled, or its scratch twin) and what it reports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..attention import VARIANTS
from ..conversion import convert
from ..distill import DistillJob, run
from ..distill.teacher_cache import TeacherCache
from ..folder import save
from ..recipes import load_recipe
from ..sources import load_source

DATA = "digits"
RECIPE = "quickstart"
DEFAULT_VARIANTS = tuple(VARIANTS)
# The teacher sees a 4×4 patch grid; MHLA's default 7-token blocks would make that one block (plain kernel
# attention), so the quickstart asks for 2×2 token-level heads of 2×2 tokens each.
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {"mhla": {"blocks_per_side": 2}}
SCRATCH = {"attn_init": "random", "mlp_init": "random", "rest_init": "random"}
NO_DISTILLATION = {"attn_weight": 0.0, "kd_weight": 0.0}


@dataclass
class Result:
    """One row of the quickstart table: val top-1/top-5 as fractions, training seconds, its folder."""

    name: str
    kind: str  # teacher, student or scratch
    variant: Optional[str]
    top1: float
    top5: Optional[float]  # None for 5 classes or fewer (top_k.py)
    loss: float
    seconds: float
    folder: str


@dataclass(frozen=True)
class Job:
    """One training of the quickstart: a converted student (distilled) or its scratch twin (task loss only)."""

    name: str
    variant: str
    overrides: dict[str, Any]
    init: dict[str, Any]


@dataclass
class Update:
    """What the progress display gets: a job's state (queued, running, done) and where its training is."""

    name: str
    state: str
    step: int = 0
    steps: int = 0
    epoch: int = 0
    epochs: int = 0
    result: Optional[Result] = None


Progress = Callable[[Update], None]


def train_one(job: Job, out: Path, device: Optional[str], force: bool, progress: Optional[Progress] = None,
              teacher_cache: Optional[TeacherCache] = None) -> Result:
    """convert (init per ``job.init``) -> save -> distill per the quickstart recipe. The row is the run's last
    validation: the weights its folder holds, on the same images (``vitconvert eval`` of the folder gives the
    same top-1), so the folder is not read back and evaluated a second time. These models are small enough that
    nothing is recomputed in backward to save memory (``recompute=False``); ``teacher_cache`` holds the teacher's
    outputs for the batches another student's run computed (all of them see the same batches)."""
    if progress is not None:
        progress(Update(job.name, "converting"))
    teacher = load_source(DATA).model
    student, _ = convert(teacher, to=job.variant, options=VARIANT_OPTIONS.get(job.variant), source=DATA, **job.init)
    start = save(student, out / "init" / job.name, force=force, pretrained=True)
    recipe, text = load_recipe(RECIPE, job.overrides)

    def on_step(trainer: Any) -> None:
        if progress is not None:
            steps = trainer.feed.updates_per_epoch * recipe.schedule.epochs
            progress(Update(job.name, "running", trainer.pos.step, steps, trainer.pos.epoch, recipe.schedule.epochs))

    result = run(DistillJob(student=str(start), recipe=recipe, out=out / job.name, recipe_text=text, device=device,
                            force=force, show=False, recompute=False, teacher_cache=teacher_cache), on_step=on_step)
    metrics = result.metrics
    kind = "scratch" if job.init.get("mlp_init") == "random" else "student"
    return Result(job.name, kind, job.variant, metrics["top1"], metrics["top5"], metrics["loss"], result.seconds,
                  str(result.folder))


def plan_jobs(variants: Sequence[str], seed: int, epochs: Optional[int], scratch: bool) -> list[Job]:
    """One job per variant (and its scratch twin when asked), each with its own recipe overrides."""
    overrides: dict[str, Any] = {"seed": seed, **({"epochs": epochs} if epochs is not None else {})}
    jobs = []
    for variant in variants:
        jobs.append(Job(variant, variant, overrides, {"seed": seed}))
        if scratch:
            jobs.append(Job(f"{variant}-scratch", variant, {**overrides, **NO_DISTILLATION}, {**SCRATCH, "seed": seed}))
    return jobs
