"""The offline demo: bundled digits teacher -> convert -> distill -> eval, for each variant, against scratch.

A scratch student has the same linear architecture with every weight at timm's (or its method's) random
init and is trained for the same epochs on the task loss alone; beating it is the least a distilled student
must do, so the quickstart shows both side by side. Each model is a folder under ``out`` that the other
commands read (``vitconvert eval OUT/elu --data digits``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from .errors import VitconvertError
from .threads import torch_threads
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


def train_one(teacher: Any, variant: str, out: Path, name: str, overrides: dict[str, Any], init: dict[str, Any],
              device: Optional[str], force: bool) -> Result:
    """convert (init per ``init``) -> save -> distill per the quickstart recipe -> eval of the run folder."""
    from .convert import convert
    from .distill import distill
    from .evaluate import evaluate
    from .folder import save

    student, _ = convert(teacher, to=variant, options=VARIANT_OPTIONS.get(variant), source=DATA, **init)
    start = save(student, out / "init" / name, force=force, pretrained=True)
    run = distill(start, out / name, recipe=RECIPE, overrides=overrides, device=device, force=force, show=False)
    metrics = evaluate(str(run.folder), DATA, device=device)
    kind = "scratch" if init.get("mlp_init") == "random" else "student"
    return Result(name, kind, variant, metrics["top1"], metrics["top5"], metrics["loss"], run.seconds,
                  str(run.folder))


def run_quickstart(variants: Sequence[str] = DEFAULT_VARIANTS, out: Path = Path("runs/quickstart"),
                   epochs: Optional[int] = None, seed: int = 0, scratch: bool = True, device: Optional[str] = None,
                   force: bool = False, threads: Optional[int] = 1,
                   progress: Optional[Callable[[Result], None]] = None) -> Quickstart:
    """Distil the bundled teacher into each variant (and train each from scratch), then evaluate them all.

    ``threads`` (CPU intra-op threads, None: torch's default) is 1 by default: these 200k-parameter models gain
    nothing from more, run 10× slower when other programs share the cores, and repeat their numbers exactly
    only at a fixed count.
    """

    with torch_threads(threads):
        return _run(variants, Path(out), epochs, seed, scratch, device, force, progress)


def _run(variants: Sequence[str], out: Path, epochs: Optional[int], seed: int, scratch: bool,
         device: Optional[str], force: bool, progress: Optional[Callable[[Result], None]]) -> Quickstart:
    from .evaluate import evaluate
    from .recipes import load_recipe
    from .sources import load_source

    check_out(out, force)
    overrides: dict[str, Any] = {"seed": seed, **({"epochs": epochs} if epochs is not None else {})}
    recipe, _ = load_recipe(RECIPE, overrides)  # validates --epochs before any work
    started = time.perf_counter()
    source = load_source(DATA)
    metrics = evaluate(source.model, DATA, device=device)
    result = Quickstart(Result("teacher (softmax)", "teacher", None, metrics["top1"], metrics["top5"],
                               metrics["loss"], 0.0, "digits"), epochs=recipe.epochs)
    if progress:
        progress(result.teacher)
    for variant in variants:
        row = train_one(source.model, variant, out, variant, overrides, {"seed": seed}, device, force)
        result.students.append(row)
        if progress:
            progress(row)
        if scratch:
            row = train_one(source.model, variant, out, f"{variant}-scratch", {**overrides, **NO_DISTILLATION},
                            {**SCRATCH, "seed": seed}, device, force)
            result.scratch.append(row)
            if progress:
                progress(row)
    result.seconds = time.perf_counter() - started
    return result
