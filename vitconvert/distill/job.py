"""What a distill run is asked to do (``DistillJob``) and what it hands back (``RunResult``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..recipes import Recipe
from .checkpoint import read_checkpoint
from .teacher_cache import TeacherCache


@dataclass
class DistillJob:
    """One distill run: the student folder, the recipe, where to write, and how to run (not what to learn)."""

    student: str
    recipe: Recipe
    out: Path
    recipe_text: str = ""
    teacher: Optional[str] = None
    pretrained: Optional[bool] = None  # a named teacher's weights (None: as the student's source was built)
    resume: bool = False
    force: bool = False
    device: Optional[str] = None
    fsdp: bool = False
    compile: bool = False
    show: bool = True  # epoch lines, and a progress bar on a terminal, on stderr
    # False: a variant that recomputes part of its forward in backward to save memory (TTT's step) keeps those
    # activations instead; the same gradients, bitwise, for ~25% less of that variant's training CPU time
    recompute: bool = True
    teacher_cache: Optional[TeacherCache] = None  # the teacher's outputs shared with runs of the same batches


@dataclass
class RunResult:
    folder: Path
    metrics: dict[str, Any]  # final validation (fractions), best top-1 and its epoch
    seconds: float


def resumed_teacher(job: DistillJob) -> Optional[str]:
    """Resuming without naming a teacher: the one the run was started with (recorded in its checkpoint)."""
    if not job.resume:
        return None
    saved = read_checkpoint(Path(job.out)).meta.get("job")
    return saved.get("teacher") if isinstance(saved, dict) else None


def job_record(job: DistillJob, report: dict[str, Any], teacher_spec: str) -> dict[str, Any]:
    """What a checkpoint records of who is trained from whom (``report``: the student's conversion report),
    for a resume to check."""
    student = {k: report.get(k) for k in ("variant", "layers", "depth", "source")}
    return {"teacher": teacher_spec, "student": student, "student_path": str(Path(job.student).resolve())}
