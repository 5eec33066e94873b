"""The three loss terms and how stages weight them."""

from __future__ import annotations

import pytest
import torch
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from vitconvert.distill.losses import DistillLoss, LossWeights, attention_loss, logit_kd, task_criterion
from vitconvert.errors import VitconvertError
from vitconvert.recipes import Recipe, build_recipe

g = torch.Generator().manual_seed(0)
A = [torch.randn(2, 5, 8, generator=g) for _ in range(3)]
B = [torch.randn(2, 5, 8, generator=g) for _ in range(3)]


@pytest.mark.parametrize("kind", ["mse", "cosine", "smooth_l1"])
def test_attention_loss_is_zero_only_for_equal_outputs(kind):
    assert attention_loss(A, A, kind).item() == pytest.approx(0.0, abs=1e-6)
    assert attention_loss(A, B, kind).item() > 0.1


def test_attention_loss_sums_layers_of_mse():
    expected = sum(((a - b) ** 2).mean() for a, b in zip(A, B, strict=True))
    assert attention_loss(A, B, "mse").item() == pytest.approx(expected.item(), rel=1e-6)


def test_attention_loss_refuses_unpaired_layers():
    with pytest.raises(VitconvertError, match="captured 2 student and 3 teacher"):
        attention_loss(A[:2], B)


def test_logit_kd_is_zero_for_equal_logits_and_scales_with_temperature():
    s, t = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    assert logit_kd(s, s).item() == pytest.approx(0.0, abs=1e-6)
    expected = torch.nn.functional.kl_div(s.log_softmax(-1), t.softmax(-1), reduction="batchmean")
    assert logit_kd(s, t).item() == pytest.approx(expected.item(), rel=1e-5)
    assert logit_kd(s, t, temperature=2.0).item() != pytest.approx(logit_kd(s, t).item())


def test_task_criterion_follows_timm_train():
    assert isinstance(task_criterion(Recipe(), mixup_active=True), SoftTargetCrossEntropy)
    assert isinstance(task_criterion(Recipe(), mixup_active=False), LabelSmoothingCrossEntropy)
    plain = task_criterion(build_recipe({"smoothing": 0.0}), mixup_active=False)
    assert type(plain) is torch.nn.CrossEntropyLoss


def test_stage_weights():
    weights = build_recipe({"attn_weight": 0.5, "kd_weight": 0.2}).distillation
    assert LossWeights.for_stage(weights, "attn") == LossWeights(0.0, 0.5, 0.0)
    assert LossWeights.for_stage(weights, "finetune") == LossWeights(1.0, 0.5, 0.2)
    unweighted = build_recipe({"attn_weight": 0.0}).distillation
    assert LossWeights.for_stage(unweighted, "attn").attn == 1.0  # never a stage that trains nothing


def test_distill_loss_reports_the_terms_it_used():
    loss = DistillLoss(build_recipe(dict(smoothing=0.0)), mixup_active=False)
    logits, teacher_logits, targets = torch.randn(2, 10), torch.randn(2, 10), torch.tensor([1, 3])
    total, terms = loss(LossWeights(1.0, 2.0, 0.5), logits, targets, A[:1], B[:1], teacher_logits)
    assert set(terms) == {"task", "attn", "kd"}
    assert total.item() == pytest.approx((terms["task"] + 2 * terms["attn"] + 0.5 * terms["kd"]).item(), rel=1e-6)
    total, terms = loss(LossWeights(0.0, 1.0, 0.0), None, targets, A[:1], B[:1], None)
    assert set(terms) == {"attn"} and total.item() == pytest.approx(terms["attn"].item())
