"""The offline demo: bundled digits teacher -> convert -> distill -> eval, for each variant, against scratch.

A scratch student has the same linear architecture with every weight at timm's (or its method's) random
init and is trained for the same epochs on the task loss alone; beating it is the least a distilled student
must do, so the quickstart shows both side by side. Each model is a folder under ``out`` that the other
commands read (``vitconvert eval OUT/elu --data digits``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from .errors import VitconvertError
from .threads import torch_threads
from .workers import run_jobs
from .writer import check_container

DATA = "digits"
RECIPE = "quickstart"
DEFAULT_VARIANTS = ("elu", "relu", "inline", "mhla", "ttt")
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
    top5: float
    loss: float
    seconds: float
    folder: str


@dataclass
class Quickstart:
    teacher: Result
    students: list[Result] = field(default_factory=list)
    scratch: list[Result] = field(default_factory=list)
    epochs: int = 0
    seconds: float = 0.0

    def beats_scratch(self) -> dict[str, bool]:
        """variant -> whether its distilled student's top-1 is above its scratch twin's."""
        base = {r.variant: r.top1 for r in self.scratch}
        return {s.variant: s.top1 > base[s.variant] for s in self.students if s.variant in base}  # type: ignore[misc]

    def to_dict(self) -> dict[str, Any]:
        return {"teacher": asdict(self.teacher), "students": [asdict(r) for r in self.students],
                "scratch": [asdict(r) for r in self.scratch], "epochs": self.epochs,
                "seconds": round(self.seconds, 1), "beats_scratch": self.beats_scratch()}


def parse_variants(text: str) -> list[str]:
    """``"elu,relu"`` -> ["elu", "relu"], checked against the registry, duplicates dropped."""
    from .attention import VARIANTS

    names = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not names:
        raise VitconvertError(f"--variants is empty; choose from {', '.join(VARIANTS)}")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise VitconvertError(f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    return names


def check_out(out: Path, force: bool) -> None:
    """Refuse to write into a non-empty folder before any work starts (``--force`` replaces our subfolders)."""
    check_container(out)  # never write into a folder of the user's own files (writer.py)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise VitconvertError(f"{out} already exists and is not empty; use --force to overwrite its runs "
                              "or --out to choose another folder")


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


def train_one(job: Job, out: Path, device: Optional[str], force: bool, progress: Optional[Progress] = None) -> Result:
    """convert (init per ``job.init``) -> save -> distill per the quickstart recipe -> eval of the run folder."""
    from .convert import convert
    from .distill import DistillJob, run
    from .evaluate import evaluate
    from .folder import save
    from .recipes import load_recipe
    from .sources import load_source

    teacher = load_source(DATA).model
    student, _ = convert(teacher, to=job.variant, options=VARIANT_OPTIONS.get(job.variant), source=DATA, **job.init)
    start = save(student, out / "init" / job.name, force=force, pretrained=True)
    recipe, text = load_recipe(RECIPE, job.overrides)

    def on_step(trainer: Any) -> None:
        if progress is not None:
            steps = trainer.feed.updates_per_epoch * recipe.epochs
            progress(Update(job.name, "running", trainer.pos.step, steps, trainer.pos.epoch, recipe.epochs))

    result = run(DistillJob(student=str(start), recipe=recipe, out=out / job.name, recipe_text=text, device=device,
                            force=force, show=False), on_step=on_step)
    metrics = evaluate(str(result.folder), DATA, device=device)
    kind = "scratch" if job.init.get("mlp_init") == "random" else "student"
    return Result(job.name, kind, job.variant, metrics["top1"], metrics["top5"], metrics["loss"], result.seconds,
                  str(result.folder))


def plan_jobs(variants: Sequence[str], seed: int, epochs: Optional[int], scratch: bool) -> list[Job]:
    overrides: dict[str, Any] = {"seed": seed, **({"epochs": epochs} if epochs is not None else {})}
    jobs = []
    for variant in variants:
        jobs.append(Job(variant, variant, overrides, {"seed": seed}))
        if scratch:
            jobs.append(Job(f"{variant}-scratch", variant, {**overrides, **NO_DISTILLATION}, {**SCRATCH, "seed": seed}))
    return jobs


def run_quickstart(variants: Sequence[str] = DEFAULT_VARIANTS, out: Path = Path("runs/quickstart"),
                   epochs: Optional[int] = None, seed: int = 0, scratch: bool = True, device: Optional[str] = None,
                   force: bool = False, jobs: Optional[int] = None, progress: Optional[Progress] = None) -> Quickstart:
    """Distil the bundled teacher into each variant (and train each from scratch), then evaluate them all.

    The trainings are independent, so ``jobs`` worker processes (default: the CPU count) run them side by side,
    each on one CPU thread: these 200k-parameter models gain nothing from more threads, and at a fixed count
    their numbers repeat exactly, whatever the number of workers (``jobs=1`` trains in this process).
    """
    from .evaluate import evaluate
    from .recipes import load_recipe
    from .sources import load_source

    out = Path(out)
    check_out(out, force)
    planned = plan_jobs(variants, seed, epochs, scratch)
    recipe, _ = load_recipe(RECIPE, planned[0].overrides)  # validates --epochs before any work
    started = time.perf_counter()
    with torch_threads(1):
        metrics = evaluate(load_source(DATA).model, DATA, device=device)
    result = Quickstart(Result("teacher (softmax)", "teacher", None, metrics["top1"], metrics["top5"],
                               metrics["loss"], 0.0, "digits"), epochs=recipe.epochs)
    if progress:
        for job in planned:
            progress(Update(job.name, "queued", epochs=recipe.epochs))
    workers = max(1, min(jobs or os.cpu_count() or 1, len(planned)))
    rows = run_jobs(planned, out, device, force, workers, progress)
    for job in planned:
        (result.scratch if rows[job.name].kind == "scratch" else result.students).append(rows[job.name])
    result.seconds = time.perf_counter() - started
    return result
