"""The offline demo: bundled digits teacher -> convert -> distill -> eval, for each variant, against scratch.

A scratch student has the same linear architecture with every weight at timm's (or its method's) random
init and is trained for the same epochs on the task loss alone; beating it is the least a distilled student
must do, so the quickstart shows both side by side. Each model is a folder under ``out`` that the other
commands read (``vitconvert eval OUT/elu --data digits``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..attention import variant_names
from ..errors import VitconvertError, param
from ..evaluate import evaluate
from ..recipes import load_recipe
from ..sources import load_source
from ..threads import torch_threads
from ..writer import check_container
from .jobs import DATA, DEFAULT_VARIANTS, RECIPE, Job, Progress, Result, Update, plan_jobs, train_one
from .pool import JobPool

__all__ = ["DATA", "DEFAULT_VARIANTS", "RECIPE", "Job", "JobPool", "Progress", "Quickstart", "Result", "Update",
           "check_out", "parse_variants", "plan_jobs", "run_quickstart", "train_one"]


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
        """The result as ``quickstart --json`` prints it."""
        return {"teacher": asdict(self.teacher), "students": [asdict(r) for r in self.students],
                "scratch": [asdict(r) for r in self.scratch], "epochs": self.epochs,
                "seconds": round(self.seconds, 1), "beats_scratch": self.beats_scratch()}


def parse_variants(text: str) -> list[str]:
    """``"a,b,a"`` -> ["a", "b"], checked against the registry, duplicates dropped."""
    return variant_names(text, "variants")


def check_out(out: Path, force: bool) -> None:
    """Refuse to write into a non-empty folder before any work starts (``--force`` replaces our subfolders)."""
    check_container(out)  # never write into a folder of the user's own files (writer.py)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise VitconvertError(f"{out} already exists and is not empty; use {param('force', True)} to overwrite its "
                              f"runs or {param('out')} to choose another folder")


def run_quickstart(variants: Sequence[str] = DEFAULT_VARIANTS, out: Path = Path("runs/quickstart"),
                   epochs: Optional[int] = None, seed: int = 0, scratch: bool = True, device: Optional[str] = None,
                   force: bool = False, jobs: Optional[int] = None, progress: Optional[Progress] = None) -> Quickstart:
    """Distil the bundled teacher into each variant (and train each from scratch), then evaluate them all.

    The trainings are independent, so ``jobs`` worker processes (default: the CPU count) run them side by side,
    each on one CPU thread: these 200k-parameter models gain nothing from more threads, and at a fixed count
    their numbers repeat exactly, whatever the number of workers (``jobs=1`` trains in this process).
    """
    out = Path(out)
    check_out(out, force)
    planned = plan_jobs(variants, seed, epochs, scratch)
    recipe, _ = load_recipe(RECIPE, planned[0].overrides)  # validates --epochs before any work
    started = time.perf_counter()
    workers = max(1, min(jobs or os.cpu_count() or 1, len(planned)))
    with JobPool(planned, out, device, force, workers) as pool:  # first: forked workers need a torch left unused
        if progress:
            for job in planned:
                progress(Update(job.name, "queued", epochs=recipe.schedule.epochs))
        with torch_threads(1):
            metrics = evaluate(load_source(DATA).model, DATA, device=device)
        rows = pool.results(progress)
    result = Quickstart(Result("teacher (softmax)", "teacher", None, metrics["top1"], metrics["top5"],
                               metrics["loss"], 0.0, "digits"), epochs=recipe.schedule.epochs)
    for job in planned:
        (result.scratch if rows[job.name].kind == "scratch" else result.students).append(rows[job.name])
    result.seconds = time.perf_counter() - started
    return result
