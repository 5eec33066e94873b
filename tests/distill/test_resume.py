"""A run stopped by SIGTERM mid-epoch and resumed ends bitwise where an uninterrupted run ends (CPU, fixed seed)."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from vitconvert.distill import DistillJob, TrainingStopped, run
from vitconvert.recipes import load_recipe

from .helpers import FAST, assert_same_tensors

# Every source of randomness on: RandAugment, random erasing, mixup/cutmix, drop path, EMA, accumulation.
RANDOM = {**FAST, "epochs": 2, "batch_size": 4, "accum_steps": 2, "rand_augment": "rand-m9-mstd0.5-inc1",
          "reprob": 0.25, "color_jitter": 0.4, "mixup": 0.8, "cutmix": 1.0, "drop_path": 0.1, "ema": True,
          "ema_decay": 0.9, "warmup_epochs": 1, "seed": 3}


def job(student, out, data, resume=False, **extra):
    recipe, text = load_recipe(None, {**RANDOM, "data": str(data), **extra})
    return DistillJob(student=str(student), recipe=recipe, out=out, recipe_text=text, resume=resume, show=False)


def records(run_dir):
    timing = ("img_s", "val_seconds")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in lines]


def test_sigterm_mid_epoch_then_resume_is_bitwise(student, images, tmp_path):
    data = images  # 12 images: 3 optimizer steps of 2 micro-batches of 2 per epoch
    straight = run(job(student, tmp_path / "straight", data))
    assert straight.metrics["epochs"] == 2

    def stop_mid_second_epoch(trainer):
        if trainer.pos.step == 4:  # epoch 2, after its first step
            signal.raise_signal(signal.SIGTERM)

    with pytest.raises(TrainingStopped, match="SIGTERM at epoch 2, step 4"):
        run(job(student, tmp_path / "stopped", data), on_step=stop_mid_second_epoch)
    saved = json.loads((tmp_path / "stopped" / "checkpoint-last" / "trainer.json").read_text())
    assert saved["position"]["epoch"] == 1 and saved["position"]["batch"] == 2 and saved["position"]["step"] == 4
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored

    # workers=1 (not part of the result): augmentation depends on (seed, epoch, index), not on worker RNG
    run(job(student, tmp_path / "stopped", data, resume=True, workers=1))

    for name in ("model.safetensors", "checkpoint-last/model.safetensors", "checkpoint-last/ema.safetensors",
                 "checkpoint-last/optimizer.safetensors", "best/model.safetensors"):
        assert_same_tensors(load_file(tmp_path / "straight" / name), load_file(tmp_path / "stopped" / name))
    assert records(tmp_path / "straight") == records(tmp_path / "stopped")


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(student, images, tmp_path):
    def poison_after_first_epoch(trainer):
        if trainer.pos.epoch == 1 and trainer.pos.step == 4:
            with torch.no_grad():
                next(trainer.task.model.parameters()).fill_(float("nan"))

    recipe, text = load_recipe(None, {**FAST, "epochs": 2, "data": str(images)})
    with pytest.raises(Exception, match="NaN or infinite at epoch 2.*last good checkpoint.*after epoch 1"):
        run(DistillJob(str(student), recipe, tmp_path / "run", text, show=False), on_step=poison_after_first_epoch)
    kept = load_file(tmp_path / "run" / "checkpoint-last" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in kept.values())
    assert json.loads((tmp_path / "run" / "checkpoint-last" / "trainer.json").read_text())["position"]["epoch"] == 1
