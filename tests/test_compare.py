"""compare_models: zero gaps against itself, real gaps after convert, smaller gaps after a little distillation."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import image_batch, tiny_model
from torch.nn import functional as F

import vitconvert
from vitconvert.capture import DistillStudent, TeacherTap, attention_pairs
from vitconvert.compare import compare_models, plot_compare
from vitconvert.errors import VitconvertError

pytestmark = pytest.mark.usefixtures("one_thread")


def batches(model: torch.nn.Module, n: int = 2, size: int = 4) -> list[torch.Tensor]:
    return [image_batch(model, size) + 0.1 * i for i in range(n)]


@pytest.mark.parametrize("family", ["vit", "eva02"])
def test_model_against_itself_has_no_gap(family):
    teacher = tiny_model(family)
    report = compare_models(teacher, copy.deepcopy(teacher), batches(teacher))
    assert report.images == 8 and len(report.layers) == 2
    for gap in report.layers:
        assert gap.attn_mse == 0
        assert gap.attn_cos == pytest.approx(1, abs=1e-5) and gap.block_cos == pytest.approx(1, abs=1e-5)
    assert report.top1_agreement == 1 and report.logit_kl == pytest.approx(0, abs=1e-7)


def test_converted_student_has_gaps_and_keeps_its_mode(vit):
    student, _ = vitconvert.convert(vit, to="elu")
    student.train()
    report = compare_models(vit, student, batches(vit))
    assert student.training  # compare runs in eval mode, then gives the mode back
    assert all(gap.attn_mse > 1e-4 and gap.attn_cos < 0.99 for gap in report.layers)
    assert report.logit_kl > 0 and 0 <= report.top1_agreement <= 1
    assert not any(m._forward_hooks for m in student.modules())  # every hook removed
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert set(data) == {"layers", "top1_agreement", "logit_kl", "images"}
    assert set(data["layers"][0]) == {"layer", "attn_mse", "attn_cos", "block_cos", "attention"}
    assert {row["attention"] for row in data["layers"]} == {student.blocks[0].attn.variant}


def attention_mse_steps(teacher: torch.nn.Module, student: torch.nn.Module, steps: int) -> None:
    """The smallest distillation: Adam on the per-layer attention-output MSE, on random images."""
    mine, theirs = attention_pairs(student, teacher)
    tap, wrapped = TeacherTap(teacher, theirs, keep_inputs=False), DistillStudent(student, mine)
    optimizer = torch.optim.Adam([p for m in mine for p in m.parameters()], lr=3e-3)
    student.train()
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        images = torch.randn(8, 3, 32, 32, generator=generator)
        _, targets, _ = tap(images)
        _, outputs = wrapped(images, need_logits=True)
        loss = sum(F.mse_loss(o, t) for o, t in zip(outputs, targets, strict=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tap.close()
    wrapped.close()


def test_gaps_shrink_after_a_few_attention_distillation_steps(vit):
    student, _ = vitconvert.convert(vit, to="relu")
    held_out = batches(vit, n=2, size=8)
    before = compare_models(vit, student, held_out)
    attention_mse_steps(vit, student, steps=60)
    after = compare_models(vit, student, held_out)
    for b, a in zip(before.layers, after.layers, strict=True):
        assert a.attn_mse < 0.7 * b.attn_mse and a.attn_cos > b.attn_cos
    assert after.layers[-1].block_cos > before.layers[-1].block_cos
    assert after.logit_kl < before.logit_kl


def test_teacher_gets_its_own_normalisation(vit):
    """Images normalised for the student are re-normalised for a teacher trained with other mean/std."""
    student = copy.deepcopy(vit)
    student.pretrained_cfg = {**vit.pretrained_cfg, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    vit.pretrained_cfg = {**vit.pretrained_cfg, "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
    assert compare_models(vit, student, batches(vit)).layers[0].attn_mse > 0  # different pixels, different outputs


def test_reheaded_student_reports_no_logit_comparison(vit):
    student, _ = vitconvert.convert(vit, to="elu", num_classes=3)
    report = compare_models(vit, student, batches(vit, n=1))
    assert report.top1_agreement is None and report.logit_kl is None and len(report.layers) == 2


def test_depth_mismatch_is_a_user_error(vit):
    student, _ = vitconvert.convert(tiny_model("vit", depth=3), to="elu")
    with pytest.raises(VitconvertError, match="differ in depth"):
        compare_models(vit, student, batches(vit, n=1))
    with pytest.raises(VitconvertError, match="differ in depth"):
        compare_models(vit, tiny_model("vit", depth=3), batches(vit, n=1))


def test_no_images_is_a_user_error(vit):
    with pytest.raises(VitconvertError, match="no images"):
        compare_models(vit, copy.deepcopy(vit), [])


def test_plot_writes_a_png(vit, tmp_path):
    pytest.importorskip("matplotlib")
    student, _ = vitconvert.convert(vit, to="elu")
    path = plot_compare(compare_models(vit, student, batches(vit, n=1)), tmp_path / "sub" / "gaps.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_clear_error(vit, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    report = compare_models(vit, copy.deepcopy(vit), batches(vit, n=1))
    with pytest.raises(VitconvertError, match=r"pip install 'vitconvert\[plot\]'"):
        plot_compare(report, tmp_path / "gaps.png")
