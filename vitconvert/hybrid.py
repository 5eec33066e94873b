"""Which layers a hybrid keeps softmax: the K whose linear replacement loses most, measured on data.

Every layer is converted and its attention briefly distilled on its own (teacher-forced: each linear layer
sees the teacher's input to that layer and regresses the teacher's output, so layers do not disturb each
other), then each layer is scored by one of two signals:

- ``attn-gap``: the layer's attention-output MSE against the teacher after that short distillation — what
  is left that the linear form could not learn;
- ``logit-kl``: how much the KL(teacher ‖ student) of the logits drops when that one layer is put back to
  the teacher's softmax (the signal of hybrid-distillation's KL-guided layer selection).

The K highest-scoring layers stay softmax. Deterministic for a seed (fixed image sample, seeded init).
``logit-kl`` is the default: on the digits it chose layers that distilled to equal or higher accuracy than
``attn-gap``'s in all six comparisons, by up to 5 points (docs/results.md, benchmarks/frontier.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

from .attention import LinearAttention
from .capture import DistillStudent, TeacherTap, attention_pairs
from .compare import image_batches
from .conversion import convert
from .errors import BadValue
from .surgery import find_softmax_attention

SIGNALS = ("attn-gap", "logit-kl")


@dataclass
class LayerChoice:
    """The layers to keep softmax, and the evidence: one score per layer (higher: loses more as linear)."""

    keep: list[int]
    scores: list[float]
    signal: str
    steps: int
    images: int

    def to_dict(self) -> dict[str, Any]:
        """The choice as ``convert --json`` prints it."""
        return asdict(self)


def choose_softmax_layers(teacher: nn.Module, variant: str, k: int, data: str, *, signal: str = "logit-kl",
                          options: Optional[dict[str, Any]] = None, steps: int = 30, batches: int = 4,
                          batch_size: int = 32, lr: float = 1e-3, seed: int = 0, data_dir: Optional[str] = None,
                          download: bool = False) -> LayerChoice:
    """The ``k`` attention layers of ``teacher`` to keep softmax when converting it to ``variant``."""
    depth = len(find_softmax_attention(teacher))
    if signal not in SIGNALS:
        raise BadValue("signal", f"unknown signal {signal!r}; valid: {', '.join(SIGNALS)}")
    if not 0 <= k <= depth:
        raise BadValue("keep_softmax", f"auto:{k} asks for more layers than the model has ({depth})")
    if steps < 0:
        raise BadValue("steps", f"must not be negative (got {steps})")
    teacher = teacher.eval()
    loader = image_batches(data, teacher, "train", batches, batch_size, seed=seed, data_dir=data_dir,
                           download=download)
    images = [batch[0] for batch in loader]
    trainable = [p.requires_grad for p in teacher.parameters()]  # the taps freeze the teacher: give it back
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            student, _ = convert(teacher, variant, options=options, seed=seed)
            student.requires_grad_(True)
            distill_layers(teacher, student, images, steps, lr)
            if signal == "attn-gap":
                scores = attention_gaps(teacher, student, images)
            else:
                scores = logit_kl_drops(teacher, student, images)
    finally:
        for p, flag in zip(teacher.parameters(), trainable, strict=True):
            p.requires_grad_(flag)
    ranked = sorted(range(depth), key=lambda i: (-scores[i], i))
    return LayerChoice(sorted(ranked[:k]), scores, signal, steps, sum(len(x) for x in images))


@contextmanager
def forced_layers(teacher: nn.Module, student: nn.Module) -> Iterator[Callable[[torch.Tensor], list[torch.Tensor]]]:
    """``per_layer(x)``: each linear layer's attention-output MSE against the teacher's, the layer run on the
    teacher's own input to it (teacher-forced, so layers do not disturb each other); the taps are removed after."""
    mine, theirs = attention_pairs(student, teacher)
    tap, wrapped = TeacherTap(teacher, theirs, keep_inputs=True), DistillStudent(student, mine)

    def per_layer(x: torch.Tensor) -> list[torch.Tensor]:
        _, t_outs, t_inputs = tap(x)
        _, s_outs = wrapped(None, forced=t_inputs, need_logits=False)
        return [F.mse_loss(s.float(), t.float()) for s, t in zip(s_outs, t_outs, strict=True)]

    try:
        yield per_layer
    finally:
        tap.close()
        wrapped.close()


def distill_layers(teacher: nn.Module, student: nn.Module, images: list[torch.Tensor], steps: int,
                   lr: float) -> None:
    """``steps`` AdamW steps of attention-output MSE per layer, each layer on the teacher's own inputs."""
    params = [p for m in student.modules() if isinstance(m, LinearAttention) for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    student.train()
    try:
        with forced_layers(teacher, student) as per_layer:
            for step in range(steps):
                loss = sum(per_layer(images[step % len(images)]))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    finally:
        student.eval()


@torch.no_grad()
def attention_gaps(teacher: nn.Module, student: nn.Module, images: list[torch.Tensor]) -> list[float]:
    """Per-layer attention-output MSE (teacher-forced) over ``images`` (normalised for the teacher, whose
    preprocessing a converted student shares)."""
    with forced_layers(teacher, student) as per_layer:
        sums: list[float] = []
        for x in images:
            gaps = [gap.item() for gap in per_layer(x)]
            sums = [a + b for a, b in zip(sums, gaps, strict=True)] if sums else gaps
    return [s / len(images) for s in sums]


@torch.no_grad()
def logit_kl_drops(teacher: nn.Module, student: nn.Module, images: list[torch.Tensor]) -> list[float]:
    """For each layer: KL(teacher ‖ all-linear student) − KL(teacher ‖ the student with that layer softmax)."""
    targets = [F.log_softmax(teacher(x).float(), -1) for x in images]

    def kl(model: nn.Module) -> float:
        total = sum(F.kl_div(F.log_softmax(model(x).float(), -1), t, log_target=True, reduction="sum").item()
                    for x, t in zip(images, targets, strict=True))
        return total / sum(len(x) for x in images)

    base = kl(student.eval())
    softmax = [m for _, m in find_softmax_attention(teacher)]
    names = [n for n, m in student.named_modules() if isinstance(m, LinearAttention)]
    drops = []
    for name, original in zip(names, softmax, strict=True):
        restored = copy.deepcopy(student)
        parent, _, attr = name.rpartition(".")
        setattr(restored.get_submodule(parent) if parent else restored, attr, copy.deepcopy(original))
        drops.append(base - kl(restored.eval()))
    return drops
