"""The Stage of every optimizer step, decided once from the recipe's stages and frozen epochs."""

from __future__ import annotations

import pytest
from helpers import tiny_model

from vitconvert import convert
from vitconvert.distill.models import attention_param_ids
from vitconvert.distill.stages import plan_stages
from vitconvert.errors import VitconvertError
from vitconvert.recipes import load_recipe


@pytest.fixture(scope="module")
def model():
    student, _ = convert(tiny_model("vit", num_classes=10), "elu", seed=0)
    return student


def attention(model):
    return attention_param_ids([block.attn for block in model.blocks])


def test_every_step_has_its_stage_and_equal_spans_share_one(model):
    recipe, _ = load_recipe(None, {"epochs": 5, "stages": "attn:2,finetune", "warmup_epochs": 0})
    plan = plan_stages(recipe, model, attention(model), set(), 3)
    assert [plan.at(step).name for step in range(15)] == ["attn"] * 6 + ["finetune"] * 9
    assert plan.starts == (0, 6) and plan.at(0) is plan.at(5) and plan.at(6) is plan.at(14)
    assert plan.at(0).trainable == attention(model) and not plan.at(0).frozen
    assert plan.at(6).trainable == {id(p) for p in model.parameters()}


def test_a_stage_counted_in_steps_ends_inside_an_epoch_and_frozen_epochs_cut_it(model):
    recipe, _ = load_recipe(None, {"epochs": 3, "stages": "attn:4steps,finetune", "freeze_copied_epochs": 1,
                                   "warmup_epochs": 0})
    head = {id(p) for p in model.head.parameters()}
    frozen = {id(p) for p in model.parameters()} - head - attention(model)  # copied: neither head nor attention
    plan = plan_stages(recipe, model, attention(model), frozen, 3)
    assert plan.starts == (0, 3, 4)  # epoch 2 starts at step 3 (the copied weights thaw), the attn stage ends at 4
    assert [(s.name, s.frozen) for s in plan.stages] == [("attn", True), ("attn", False), ("finetune", False)]
    assert plan.at(3).trainable == attention(model) and plan.at(4).trainable == {id(p) for p in model.parameters()}


def test_frozen_epochs_hold_the_copied_weights_and_a_stage_with_nothing_to_train_is_refused(model):
    recipe, _ = load_recipe(None, {"epochs": 3, "freeze_copied_epochs": 1, "warmup_epochs": 0})
    head = {id(p) for p in model.head.parameters()}
    plan = plan_stages(recipe, model, attention(model), {id(p) for p in model.parameters()} - head, 2)
    assert plan.at(1).frozen and plan.at(1).trainable == head and not plan.at(2).frozen
    with pytest.raises(VitconvertError, match="nothing would train in epoch 1"):
        plan_stages(recipe, model, attention(model), {id(p) for p in model.parameters()}, 2)
