"""Parameter groups for new weights: which weights are fresh, their optimizer groups, and freezing the copied ones."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

import vitconvert
from vitconvert.distill import DistillJob, TrainingStopped, run
from vitconvert.distill.param_groups import create_optimization, fresh_parameter_names, parameter_origins
from vitconvert.errors import VitconvertError
from vitconvert.provenance import attach, report_of
from vitconvert.recipes import build_recipe, load_recipe
from vitconvert.sources import load_source

from .helpers import FAST, assert_same_tensors, make_teacher


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return make_teacher(tmp_path_factory.mktemp("teacher"))


def converted(teacher, folder, variant="ttt", **kwargs):
    """A student folder as distill reads it: converted, saved, loaded back (the report comes from config.json)."""
    student, _ = vitconvert.convert(load_source(str(teacher)).model, variant, source=str(teacher), **kwargs)
    return vitconvert.save(student, folder, pretrained=True)


@pytest.mark.parametrize("kwargs,fresh_groups", [
    ({}, {"attention", "attention-extra"}),
    ({"num_classes": 5}, {"attention", "attention-extra", "head"}),  # a new head is random: fresh
    ({"attn_init": "copy"}, {"attention-extra"}),  # copied attention trains with the copied weights
])
def test_fresh_weights_are_exactly_what_the_report_names(teacher, tmp_path, kwargs, fresh_groups):
    model = vitconvert.load(converted(teacher, tmp_path / "s", **kwargs))
    origins = parameter_origins(model)
    fresh = fresh_parameter_names(model)
    assert fresh == {n for n, (group, _) in origins.items() if group in fresh_groups}
    assert {origins[n][1] for n in fresh} <= {"mimetic", "default-init", "random"}
    assert all(action == "copied" for n, (_, action) in origins.items() if n not in fresh)
    recorded = {(r["group"], r["action"]): r["params"] for r in report_of(model)["groups"]}
    assert sum(n for (g, _), n in recorded.items() if g in fresh_groups) == sum(
        p.numel() for n, p in model.named_parameters() if n in fresh)

    optimizer, _ = create_optimization(model, build_recipe({"new_params": {"lr_scale": 10}, "warmup_epochs": 0}), 2)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        members = {names[id(p)] for p in group["params"]}
        assert members <= fresh if group["kind"] == "new" else not members & fresh
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(names)


def test_a_report_that_does_not_add_up_is_refused(teacher, tmp_path):
    model = vitconvert.load(converted(teacher, tmp_path / "s"))
    report = report_of(model)
    report["groups"][0]["params"] += 1
    attach(model, report)
    with pytest.raises(VitconvertError, match="do not match its conversion report"):
        fresh_parameter_names(model)
    attach(model, {})
    with pytest.raises(VitconvertError, match="need the conversion report"):
        fresh_parameter_names(model)


def test_lr_scale_weight_decay_and_layer_decay_reach_the_optimizer(teacher, tmp_path):
    model = vitconvert.load(converted(teacher, tmp_path / "s"))
    recipe = build_recipe(dict(lr=1e-3, weight_decay=0.05, warmup_epochs=0,
                               new_params={"lr_scale": 10, "weight_decay": 0.2}))
    optimizer, _ = create_optimization(model, recipe, 2)
    by_kind = {k: [g for g in optimizer.param_groups if g["kind"] == k] for k in ("copied", "new")}
    assert all(g["lr"] == pytest.approx(1e-2) and g["lr_scale"] == 10 for g in by_kind["new"])
    assert all(g["lr"] == pytest.approx(1e-3) for g in by_kind["copied"])
    assert {g["weight_decay"] for g in by_kind["new"]} == {0.0, 0.2}  # biases and norms are never decayed
    assert {g["weight_decay"] for g in by_kind["copied"]} == {0.0, 0.05}

    layered, _ = create_optimization(model, build_recipe(dict(lr=1e-3, warmup_epochs=0, layer_decay=0.5,
                                                   new_params={"lr_scale": 10})), 2)
    scales = {(g["kind"], g["lr_scale"]) for g in layered.param_groups}
    assert ("copied", 1.0) in scales and ("copied", 0.125) in scales  # head; embeddings 3 layers below it
    assert ("new", 2.5) in scales and ("new", 5.0) in scales  # 10 × the layer scale of blocks 0 and 1
    assert all(g["lr"] == pytest.approx(1e-3 * g["lr_scale"]) for g in layered.param_groups)


def test_a_fresh_head_takes_its_own_lr_scale(teacher, tmp_path):
    model = vitconvert.load(converted(teacher, tmp_path / "s", num_classes=5))  # re-headed: the head is fresh
    head = fresh_parameter_names(model, "head")
    assert head == {n for n, _ in model.named_parameters() if n.startswith("head.")}
    recipe = build_recipe({"lr": 1e-3, "warmup_epochs": 0, "new_params": {"lr_scale": 10, "head_lr_scale": 1}})
    optimizer, _ = create_optimization(model, recipe, 2)
    names = {id(p): n for n, p in model.named_parameters()}
    lr = {names[id(p)]: (g["kind"], g["lr"]) for g in optimizer.param_groups for p in g["params"]}
    fresh = fresh_parameter_names(model)
    assert all(lr[n] == ("new", pytest.approx(1e-3)) for n in head)
    assert all(lr[n] == ("new", pytest.approx(1e-2)) for n in fresh - head) and fresh - head
    assert all(lr[n] == ("copied", pytest.approx(1e-3)) for n in set(lr) - fresh)
    without = build_recipe({"lr": 1e-3, "warmup_epochs": 0, "new_params": {"lr_scale": 10}})
    unset, _ = create_optimization(model, without, 2)
    assert len(unset.param_groups) == len(optimizer.param_groups) - 2  # no groups of its own: as before


def test_fresh_weights_warm_up_on_their_own(teacher, tmp_path):
    model = vitconvert.load(converted(teacher, tmp_path / "s"))
    recipe = build_recipe(dict(lr=1e-3, warmup_lr=0.0, warmup_epochs=0, epochs=10, sched="cosine",
                    new_params={"lr_scale": 2, "warmup_epochs": 2}))
    optimizer, scheduler = create_optimization(model, recipe, updates_per_epoch=4)
    lr = {k: [] for k in ("copied", "new")}
    for step in range(1, 41):
        scheduler.step_update(step)
        for kind in lr:
            lr[kind].append(max(g["lr"] for g in optimizer.param_groups if g["kind"] == kind))
    assert lr["new"][:7] == sorted(lr["new"][:7]) and lr["new"][0] == pytest.approx(2e-3 / 8)  # a ramp of 8 updates
    assert lr["new"][7] == pytest.approx(2e-3)  # then the peak (lr × lr_scale), and a cosine of their own
    assert lr["new"][7:] == sorted(lr["new"][7:], reverse=True)
    assert lr["copied"] == sorted(lr["copied"], reverse=True) and lr["copied"][0] < 1e-3  # no warmup of their own
    assert lr["new"][-1] == pytest.approx(2e-6) and lr["copied"][-1] == pytest.approx(1e-6)  # min_lr × lr_scale
    assert json.dumps(scheduler.state_dict())  # checkpoint-able as JSON


def job(student, out, data, resume=False, force=False, fsdp=False, **extra):
    recipe, text = load_recipe(None, {**FAST, "data": str(data), **extra})
    return DistillJob(student=str(student), recipe=recipe, out=out, recipe_text=text, resume=resume, force=force,
                      fsdp=fsdp, show=False)


# 12 images, batch 4: 3 steps an epoch; the fresh weights warm up over the first epoch, the copied ones not at all
FREEZE = {"epochs": 2, "freeze_copied_epochs": 1, "ema": True, "ema_decay": 0.5, "weight_decay": 0.5,
          "new_params": {"lr_scale": 10, "warmup_epochs": 1}}


def test_copied_weights_do_not_move_while_frozen_and_do_after(teacher, images, tmp_path):
    student = converted(teacher, tmp_path / "s", variant="mhla")
    initial = vitconvert.load(student)
    fresh = fresh_parameter_names(initial)
    start = {n: p.detach().clone() for n, p in initial.named_parameters()}
    seen = []

    def check(trainer):
        if trainer.pos.epoch == 0:  # every step of the frozen epoch: model and EMA
            for model in (trainer.task.model, trainer.task.ema.module):
                params = dict(model.named_parameters())
                assert all(torch.equal(params[n], start[n]) for n in start if n not in fresh)
            seen.append(trainer.pos.step)

    run(job(student, tmp_path / "run", images, **FREEZE), on_step=check)
    assert seen == [1, 2, 3]
    final = load_file(tmp_path / "run" / "model.safetensors")
    moved = {n for n in start if not torch.equal(final[n], start[n])}
    assert fresh <= moved and moved - fresh  # fresh weights trained throughout, copied ones in epoch 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert all(r["lr_new"] < 10 * r["lr"] for r in steps if r["step"] < 3)  # warming up
    peak = load_recipe(None, {**FAST, **FREEZE})[0].lr
    after = [r["lr_new"] for r in steps if r["step"] >= 3]  # then 10 × the peak, down their own cosine
    assert after[0] == pytest.approx(10 * peak) and after == sorted(after, reverse=True)


def test_resume_in_the_middle_of_the_frozen_epochs_is_bitwise(teacher, images, tmp_path):
    student = converted(teacher, tmp_path / "s", variant="mhla")
    run(job(student, tmp_path / "straight", images, **FREEZE))

    def stop_while_frozen(trainer):
        if trainer.pos.step == 2:
            signal.raise_signal(signal.SIGTERM)

    with pytest.raises(TrainingStopped):
        run(job(student, tmp_path / "stopped", images, **FREEZE), on_step=stop_while_frozen)
    run(job(student, tmp_path / "stopped", images, resume=True, **FREEZE))
    for name in ("model.safetensors", "checkpoint-last/ema.safetensors", "checkpoint-last/optimizer.safetensors"):
        assert_same_tensors(load_file(tmp_path / "straight" / name), load_file(tmp_path / "stopped" / name))


def test_unusable_settings_are_refused_before_training(teacher, images, tmp_path):
    all_copied = converted(teacher, tmp_path / "s", variant="elu", attn_init="copy")
    with pytest.raises(VitconvertError, match="nothing would train in epoch 1"):
        run(job(all_copied, tmp_path / "run", images, freeze_copied_epochs=1))
    with pytest.raises(VitconvertError, match="drop ema, the attn stage and freeze_copied_epochs"):
        run(job(all_copied, tmp_path / "run2", images, fsdp=True, freeze_copied_epochs=1))
    student = converted(teacher, tmp_path / "mhla", variant="mhla")
    run(job(student, tmp_path / "run3", images, compare_batches=0))
    with pytest.raises(VitconvertError, match="optimizer has 2 parameter groups, this recipe makes 4"):
        run(job(student, tmp_path / "run3", images, resume=True, force=True, compare_batches=0,
                new_params={"lr_scale": 3}))
    assert not (tmp_path / "run").exists() and not (tmp_path / "run2").exists()
