"""The batch in one place: DistillationTask's output for each stage and attention target."""

from __future__ import annotations

import pytest
import torch
from helpers import image_batch, tiny_model

from vitconvert import convert
from vitconvert.distill.models import attention_param_ids
from vitconvert.distill.stages import plan_stages
from vitconvert.distill.task import DistillationTask
from vitconvert.distributed import DistEnv
from vitconvert.recipes import load_recipe


def make_task(**overrides):
    teacher = tiny_model("vit", num_classes=10)
    student, _ = convert(teacher, "elu", seed=0)
    recipe, _ = load_recipe("quickstart", {"kd_weight": 0.5, **overrides})
    return DistillationTask(student, teacher, recipe, torch.device("cpu"), None, mixup_active=False), teacher


def test_joint_stage_returns_every_term_and_the_student_output():
    task, teacher = make_task()
    images, targets = image_batch(teacher, batch=4), torch.tensor([0, 1, 2, 3])
    out = task(images, targets)
    assert set(out) == {"loss", "task", "attn", "kd", "output"}
    assert out["output"].shape == (4, 10) and out["loss"].requires_grad
    weights = task.weights
    total = weights.task * out["task"] + weights.attn * out["attn"] + weights.kd * out["kd"]
    assert out["loss"].item() == pytest.approx(total.item(), rel=1e-6)  # the terms are what the loss sums
    assert out["attn"] > 0  # a Mimetic student's attention outputs are not the teacher's yet
    out["loss"].backward()
    assert all(p.grad is None for p in teacher.parameters())  # the teacher never trains
    assert task.model.blocks[0].attn.qkv.weight.grad is not None


def test_teacher_forced_attention_stage_runs_only_the_attention_calls():
    task, teacher = make_task(attn_target="teacher-forced", stages="attn:1,finetune")
    task.set_stage("attn")
    out = task(image_batch(teacher, batch=2), torch.tensor([0, 1]))
    assert out["output"] is None and set(out) == {"loss", "attn", "output"} and out["attn"] > 0
    assert out["loss"].item() == pytest.approx(task.weights.attn * out["attn"].item(), rel=1e-6)


def test_a_scratch_baseline_never_runs_the_teacher():
    task, teacher = make_task(attn_weight=0.0, kd_weight=0.0)
    calls = []
    teacher.register_forward_hook(lambda *a: calls.append(1))
    out = task(image_batch(teacher, batch=2), torch.tensor([0, 1]))
    assert calls == [] and out["output"] is not None


def test_the_task_owns_the_eval_copy_the_wrapper_and_the_ema():
    task, teacher = make_task()
    assert task.export is not task.model and not task.export.training  # the CPU copy folders are written from
    assert task.softmax_teacher is teacher and task.runner is task.student and task.ema is None
    assert task.evaluated_state().keys() == task.model.state_dict().keys()
    task.keep_ema(0.5)
    with torch.no_grad():
        next(task.model.parameters()).add_(1.0)
    task.update_ema(step=5)  # timm copies the weights outright on its first step
    first = next(iter(task.model.state_dict()))
    trained, averaged = task.trained_state()[first], task.evaluated_state()[first]
    assert not torch.equal(trained, averaged)  # a folder gets the EMA's weights, a checkpoint the trained ones
    assert torch.equal(averaged, task.ema_state()[first])


def test_entering_a_stage_trains_only_its_parameters():
    task, _ = make_task(stages="attn:1,finetune", epochs=2, warmup_epochs=0)
    plan = plan_stages(task.recipe, task.model, attention_param_ids(task.attention), set(), 1).stages
    env = DistEnv(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    task.enter(plan[0], env, sharded=False)
    assert task.current is plan[0] and task.stage == "attn"
    assert {id(p) for p in task.model.parameters() if p.requires_grad} == plan[0].trainable
    task.enter(plan[1], env, sharded=False)
    assert task.stage == "finetune" and all(p.requires_grad for p in task.model.parameters())
