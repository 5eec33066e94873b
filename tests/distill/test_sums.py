"""Running loss sums: named terms, summed per image on the device, reduced over ranks, saved as a plain list."""

from __future__ import annotations

import math

import pytest
import torch

from vitconvert.distill.sums import TERMS, RunningSums
from vitconvert.distributed import DistEnv

CPU = torch.device("cpu")


def batch(loss: float, images: int, **terms: float) -> RunningSums:
    out = {"loss": torch.tensor(loss), **{k: torch.tensor(v) for k, v in terms.items()}, "output": None}
    return RunningSums.of_batch(out, images, CPU)


def test_sums_add_up_per_image_and_a_term_not_computed_counts_zero():
    sums = RunningSums(CPU)
    sums.add(batch(2.0, 4, attn=0.5))  # no task or kd term: a stage that does not train them
    sums.add(batch(1.0, 2, attn=0.25))
    assert sums.images == 6 and sums.total("loss") == 10.0 and sums.total("task") == 0.0
    assert sums.mean() == pytest.approx({"loss": 10 / 6, "task": 0.0, "attn": 2.5 / 6, "kd": 0.0})
    assert list(sums.mean()) == list(TERMS)


def test_a_checkpoint_list_round_trips_and_reset_keeps_the_object():
    sums = RunningSums(CPU)
    sums.add(batch(3.0, 2, task=1.0, kd=0.5))
    saved = sums.to_list()
    assert saved == [6.0, 2.0, 0.0, 1.0, 2.0]  # [loss, task, attn, kd] × images, then the image count
    assert RunningSums(CPU, saved).mean() == sums.mean()
    sums.reset()
    assert sums.to_list() == [0.0] * 5 and sums.finite()


def test_all_reduce_in_one_process_is_a_copy_and_a_nan_is_not_finite():
    env = DistEnv(rank=0, world=1, local_rank=0, device=CPU)
    sums = RunningSums(CPU)
    sums.add(batch(float("nan"), 2))
    total = sums.all_reduce(env)
    assert total is not sums and not total.finite() and math.isnan(total.total("loss"))
    sums.reset()
    assert total.images == 2  # the reduced copy does not follow the running object
