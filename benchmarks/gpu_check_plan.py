"""What one gpu_check run measures (a Plan: FULL on a GPU, QUICK as the dry run) and what it found (a Check)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

NOT_MEASURED = "—"


Targets = dict[int, "float | dict[str, float]"]  # image size -> least speedup (one for all, or per variant)


@dataclass(frozen=True)
class Plan:
    """What one run measures; FULL fits a few minutes of one H200, QUICK a few seconds of one CPU core."""

    models: tuple[str, ...]
    sizes: tuple[int, ...]
    targets: Targets
    batch: dict[int, int]  # image size -> starting batch of deit_small (tiny doubles it, base halves it)
    repeats: int
    compile_backend: str
    compile_models: tuple[str, ...]
    compile_sizes: tuple[int, ...]  # the most important first
    fla_models: tuple[str, ...]
    precision_size: int
    distill_size: int
    distill_batch: int
    distill_steps: int  # per epoch; two epochs, stopped in the second and resumed
    distill_compile: bool
    workers: int
    threads: Optional[int]
    depth: Optional[int] = None  # blocks of every model; None: the architecture's own (12)
    op_tokens: tuple[int, ...] = (197, 1025, 4097, 16385)  # N of the op section (a class token + a square grid)
    op_shape: tuple[int, int, int] = (16, 6, 64)  # (batch, heads, head dim) of the op section: deit_small's layer
    op_targets: dict[int, dict[str, float]] = field(default_factory=lambda: {4097: {"infer": 8.0, "train": 6.0}})
    op_repeats: int = 10
    parity_size: int = 224  # px of the parity section's model (models[0], 2 blocks or the plan's depth)
    parity_batch: int = 2
    parity_width: Optional[tuple[int, int]] = None  # (embed_dim, heads) of the parity model; None: models[0]'s own


TARGETS_1024 = {"elu": 2.5, "relu": 2.5, "inline": 2.5, "mhla": 2.0, "ttt": 2.0}
FULL = Plan(("deit_small", "deit_tiny", "deit_base"), (224, 512, 1024, 2048),
            {224: 1.0, 1024: TARGETS_1024, 2048: 6.0}, {224: 256, 512: 64, 1024: 16, 2048: 4}, repeats=5,
            compile_backend="inductor", compile_models=("deit_small",), compile_sizes=(1024, 224),
            fla_models=("deit_small",), precision_size=1024, distill_size=224, distill_batch=64, distill_steps=25,
            distill_compile=True, workers=8, threads=None)
# The dry run: the same code on a CPU at toy sizes; dynamo's "eager" backend traces without a C++ build.
QUICK = Plan(("deit_tiny",), (32, 64), {32: 1.0, 64: {**TARGETS_1024}}, {32: 2, 64: 2}, repeats=1,
             compile_backend="eager", compile_models=("deit_tiny",), compile_sizes=(32,), fla_models=("deit_tiny",),
             precision_size=64, distill_size=32, distill_batch=2, distill_steps=2, distill_compile=False, workers=0,
             threads=1, depth=1, op_tokens=(17, 65), op_shape=(2, 2, 16), op_targets={65: {"infer": 8.0, "train": 6.0}},
             op_repeats=1, parity_size=32, parity_batch=1, parity_width=(64, 2))
# parity_width: deit_tiny's 3 heads of 64 cost 26 CPU-s in the interpreter, 2 of 32 cost 19 (the interpreter's
# time is per program, one per head); not 1 head, where TTT's output has size-1 dimensions whose strides its fake
# gives otherwise
MODEL_BATCH_SCALE = {"deit_tiny": 2.0, "deit_small": 1.0, "deit_base": 0.5}
SECTIONS = ("parity", "op", "speed", "precision", "distill", "compiled", "fla", "models")


@dataclass
class Check:
    """Everything one run found; ``skipped`` names sections not run and why, ``errors`` what raised."""

    env: dict[str, Any]
    dry_run: bool
    parity: list[dict[str, Any]] = field(default_factory=list)
    op: list[dict[str, Any]] = field(default_factory=list)
    speed: list[dict[str, Any]] = field(default_factory=list)
    precision: list[dict[str, Any]] = field(default_factory=list)
    distill: dict[str, Any] = field(default_factory=dict)
    cost: list[dict[str, Any]] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)  # the sections asked for
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def with_sizes(plan: Plan, text: str) -> Plan:
    """``plan`` with the speed rows at the comma-separated image sizes of ``text`` (--sizes); a size the plan has no
    batch for starts with 224 px's tokens per batch (FULL: 256 images)."""
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(s <= 0 or s % 16 for s in sizes):
        raise ValueError(f"--sizes {text!r}: give image sizes that are multiples of 16, e.g. 224,1024")
    batch = {s: plan.batch.get(s) or max(1, int(FULL.batch[224] * (224 / s) ** 2)) for s in sizes}
    return replace(plan, sizes=sizes, batch=batch)


def softmax_source(plan: Plan, model: str, size: int, **kwargs: Any) -> torch.nn.Module:
    """The softmax model ``model`` (a timm name or alias) at ``size`` px with random weights."""
    from vitconvert.sources import load_source  # lazy: gpu_check refuses bad arguments before timm loads

    depth = {"depth": plan.depth} if plan.depth else {}
    return load_source(model, pretrained=False, img_size=size, **depth, **kwargs).model
