"""One Stage per epoch, decided once from the recipe's stage plan and frozen epochs."""

from __future__ import annotations

import pytest
from helpers import tiny_model

from vitconvert import convert
from vitconvert.distill.models import attention_param_ids
from vitconvert.distill.stages import plan_epochs
from vitconvert.errors import VitconvertError
from vitconvert.recipes import load_recipe


@pytest.fixture(scope="module")
def model():
    student, _ = convert(tiny_model("vit", num_classes=10), "elu", seed=0)
    return student


def attention(model):
    return attention_param_ids([block.attn for block in model.blocks])


def test_every_epoch_has_its_stage_and_equal_epochs_share_one(model):
    recipe, _ = load_recipe(None, {"epochs": 5, "stages": "attn:2,finetune", "warmup_epochs": 0})
    plan = plan_epochs(recipe, model, attention(model), set())
    assert [s.name for s in plan] == ["attn", "attn", "finetune", "finetune", "finetune"]
    assert plan[0] is plan[1] and plan[2] is plan[4] and plan[1] != plan[2]
    assert plan[0].trainable == attention(model) and not plan[0].frozen
    assert plan[2].trainable == {id(p) for p in model.parameters()}


def test_frozen_epochs_hold_the_copied_weights_and_a_stage_with_nothing_to_train_is_refused(model):
    recipe, _ = load_recipe(None, {"epochs": 3, "freeze_copied_epochs": 1, "warmup_epochs": 0})
    head = {id(p) for p in model.head.parameters()}
    plan = plan_epochs(recipe, model, attention(model), {id(p) for p in model.parameters()} - head)
    assert plan[0].frozen and plan[0].trainable == head and not plan[1].frozen
    with pytest.raises(VitconvertError, match="nothing would train in epoch 1"):
        plan_epochs(recipe, model, attention(model), {id(p) for p in model.parameters()})
