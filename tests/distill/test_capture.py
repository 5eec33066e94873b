"""Hooks: one teacher forward per batch, each layer's attention output paired with the student's."""

from __future__ import annotations

import pytest
import timm
import torch

import vitconvert
from vitconvert.capture import DistillStudent, TeacherTap, attention_pairs
from vitconvert.errors import VitconvertError

ARGS = dict(img_size=32, patch_size=8, embed_dim=32, num_heads=2, depth=2, num_classes=3)


def pair():
    torch.manual_seed(0)
    teacher = timm.create_model("vit_tiny_patch16_224", pretrained=False, **ARGS).eval()
    student, _ = vitconvert.convert(teacher, "elu", attn_init="copy")
    return student, teacher


def test_outputs_are_captured_once_per_layer_and_match_the_modules():
    student, teacher = pair()
    mine, theirs = attention_pairs(student, teacher)
    calls = []
    teacher.register_forward_hook(lambda *a: calls.append(1))
    tap, wrapped = TeacherTap(teacher, theirs, keep_inputs=True), DistillStudent(student, mine)
    x = torch.randn(2, 3, 32, 32)
    logits, outs, inputs = tap(x)
    assert len(calls) == 1 and len(outs) == len(inputs) == 2 and not outs[0].requires_grad
    assert torch.allclose(logits, teacher(x))
    direct = theirs[1](*inputs[1][0], **inputs[1][1])
    assert torch.allclose(outs[1], direct)
    s_logits, s_outs = wrapped(x)
    assert len(s_outs) == 2 and s_outs[0].requires_grad and s_outs[0].shape == outs[0].shape
    _, forced = wrapped(x, forced=inputs, need_logits=False)
    assert torch.allclose(forced[1], mine[1](inputs[1][0][0]))
    assert not torch.allclose(forced[1], s_outs[1])  # layer 1 sees the teacher's hidden state, not its own
    _, none = wrapped(x, capture=False)
    assert none == []


def test_teacher_forced_layer_zero_equals_own():
    student, teacher = pair()
    mine, theirs = attention_pairs(student, teacher)
    _, _, inputs = TeacherTap(teacher, theirs, keep_inputs=True)(x := torch.randn(2, 3, 32, 32))
    wrapped = DistillStudent(student, mine)
    own, forced = wrapped(x)[1], wrapped(x, forced=inputs)[1]
    assert torch.allclose(own[0], forced[0], atol=1e-6)  # same input to the first block


def test_models_of_different_depth_or_width_are_refused():
    student, _ = pair()
    deeper = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**ARGS, "depth": 3})
    wider = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**ARGS, "embed_dim": 64})
    with pytest.raises(VitconvertError, match="differ in depth: the teacher has 3 attention layers, the student 2"):
        attention_pairs(student, deeper)
    with pytest.raises(VitconvertError, match="differ in width at layer 0: 64 vs 32"):
        attention_pairs(student, wider)
    with pytest.raises(VitconvertError, match="cannot teach"):
        attention_pairs(student, student)
