"""``DistillJob(recompute=False)`` (the quickstart's): TTT keeps its step's activations instead of recomputing
them in backward, and the gradients are the same bits (the same step, run once instead of twice)."""

from __future__ import annotations

import torch

import vitconvert
from tests.helpers import image_batch, tiny_model
from vitconvert.distill.models import set_recompute


def gradients(model: torch.nn.Module, images: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(images).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_without_recompute_ttt_keeps_activations_and_gives_the_same_gradients():
    teacher = tiny_model("vit")
    student, _ = vitconvert.convert(teacher, "ttt")
    student.train()
    steps = [m for m in student.modules() if hasattr(m, "recompute_step")]
    assert steps and all(m.recompute_step for m in steps)  # TTT recomputes by default
    images = image_batch(student)
    recomputed = gradients(student, images)
    set_recompute(student, False)
    assert not any(m.recompute_step for m in steps)
    kept = gradients(student, images)
    assert all(torch.equal(a, b) for a, b in zip(recomputed, kept, strict=True))
