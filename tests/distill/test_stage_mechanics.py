"""The LoLCATs-style attention transfer stage through real runs: each student attention layer is fed the teacher's
input to that layer, only the attention parameters move, a stage counted in optimizer steps ends at its step (inside
an epoch, whatever the accumulation), and a run stopped inside the stage resumes bitwise."""

from __future__ import annotations

import signal

import pytest
import torch
from safetensors.torch import load_file

import vitconvert
from vitconvert.capture import attention_pairs
from vitconvert.distill import DistillJob, TrainingStopped, run
from vitconvert.recipes import load_recipe

from .helpers import FAST, assert_same_tensors, make_student

# 12 images, batch 4: 3 optimizer steps an epoch; epoch 1 is the teacher-forced attention stage
STAGED = {**FAST, "epochs": 2, "stages": "attn:1,finetune", "attn_target": "teacher-forced", "seed": 5,
          "compare_batches": 0}


@pytest.fixture(scope="module")
def deep_student(tmp_path_factory):
    """Three blocks, so layers 1 and 2 have inputs that differ between teacher and student."""
    return make_student(tmp_path_factory.mktemp("deep"), "mhla", depth=3)


def job(student, out, data, resume=False, **extra):
    recipe, text = load_recipe(None, {**STAGED, "data": str(data), **extra})
    return DistillJob(student=str(student), recipe=recipe, out=out, recipe_text=text, resume=resume, show=False)


@pytest.mark.parametrize("stages,epochs", [("attn", 1), ("attn:3steps,finetune", 2)])
def test_each_student_layer_is_fed_the_teachers_input_to_that_layer(deep_student, images, tmp_path, stages, epochs):
    seen: dict[str, list[list[torch.Tensor]]] = {"teacher": [], "student": []}
    hooks = []

    def tap(trainer):
        if trainer.pos.step == 3:  # steps 2 and 3 recorded; validation (the student alone) is not
            for h in hooks:
                h.remove()
        if trainer.pos.step != 1:
            return
        mine, theirs = attention_pairs(trainer.task.model, trainer.task.softmax_teacher)
        for who, modules in (("teacher", theirs), ("student", mine)):
            for i, module in enumerate(modules):
                def keep(_, args, who=who, i=i):
                    if i == 0:
                        seen[who].append([])
                    seen[who][-1].append(args[0].detach().clone())
                hooks.append(module.register_forward_pre_hook(keep))

    try:
        run(job(deep_student, tmp_path / "run", images, epochs=epochs, stages=stages), on_step=tap)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen["teacher"]) == len(seen["student"]) == 2
    for theirs, mine in zip(seen["teacher"], seen["student"], strict=True):
        assert len(theirs) == len(mine) == 3
        for t, s in zip(theirs, mine, strict=True):
            assert torch.equal(t, s)  # the very tensor the teacher's layer saw, not the student's own hidden state


def test_only_attention_parameters_move_in_the_attention_stage(deep_student, images, tmp_path):
    start = {n: p.detach().clone() for n, p in vitconvert.load(deep_student).named_parameters()}
    attention = {n for n in start if ".attn." in n}
    checked = []

    def check(trainer):
        params = dict(trainer.task.model.named_parameters())
        moved = {n for n in start if not torch.equal(params[n], start[n])}
        if trainer.pos.epoch == 0:  # every step of the attention stage
            assert moved and moved <= attention, sorted(moved - attention)[:3]
            checked.append(trainer.pos.step)

    # 10× on the fresh weights too: the stage's trainable set, not the lr, is what holds the rest still
    run(job(deep_student, tmp_path / "run", images, new_params={"lr_scale": 10}), on_step=check)
    assert checked == [1, 2, 3]
    final = load_file(tmp_path / "run" / "model.safetensors")
    assert {n for n in start if not torch.equal(final[n], start[n])} - attention  # the finetune stage trains all


def test_a_stage_counted_in_steps_switches_at_its_optimizer_step(deep_student, images, tmp_path):
    start = {n: p.detach().clone() for n, p in vitconvert.load(deep_student).named_parameters()}
    attention = {n for n in start if ".attn." in n}
    before, seen = dict(start), []

    def check(trainer):
        params = {n: p.detach().clone() for n, p in trainer.task.model.named_parameters()}
        moved = {n for n in params if not torch.equal(params[n], before[n])}
        seen.append((trainer.pos.epoch, trainer.pos.step, trainer.task.stage, bool(moved - attention)))
        before.update(params)

    # 3 optimizer steps an epoch of 2 accumulated micro-batches: the stage ends at step 2, inside epoch 1
    run(job(deep_student, tmp_path / "run", images, stages="attn:2steps,finetune", accum_steps=2), on_step=check)
    assert seen == [(0, 1, "attn", False), (0, 2, "attn", False), (0, 3, "finetune", True),
                    (1, 4, "finetune", True), (1, 5, "finetune", True), (1, 6, "finetune", True)]


@pytest.mark.parametrize("stages,stop_at", [("attn:1,finetune", 2), ("attn:5steps,finetune", 4)])
def test_a_run_stopped_inside_the_attention_stage_resumes_bitwise(deep_student, images, tmp_path, stages, stop_at):
    run(job(deep_student, tmp_path / "straight", images, stages=stages))

    def stop_in_stage(trainer):
        if trainer.pos.step == stop_at:  # inside the attention stage, between its steps
            signal.raise_signal(signal.SIGTERM)

    epoch = 1 + (stop_at - 1) // 3
    with pytest.raises(TrainingStopped, match=f"SIGTERM at epoch {epoch}, step {stop_at}"):
        run(job(deep_student, tmp_path / "stopped", images, stages=stages), on_step=stop_in_stage)
    run(job(deep_student, tmp_path / "stopped", images, stages=stages, resume=True))
    for name in ("model.safetensors", "checkpoint-last/model.safetensors", "checkpoint-last/optimizer.safetensors"):
        assert_same_tensors(load_file(tmp_path / "straight" / name), load_file(tmp_path / "stopped" / name))
