"""The recipe's autocast dtype reaches every forward of a run, validation included (fp16 GPUs lack bf16)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import cuda_autocast_policy

from vitconvert import evaluate
from vitconvert.attention.ops import dispatch
from vitconvert.distill import DistillJob, run, task
from vitconvert.recipes import load_recipe

from .helpers import FAST, make_images, make_student


def test_validation_autocasts_in_the_recipes_dtype(student, images, tmp_path, monkeypatch):
    seen = []
    real = evaluate.autocast_for

    def recording(device, enabled=True, dtype="bfloat16"):
        seen.append(dtype)
        return real(device, enabled, dtype)

    monkeypatch.setattr(evaluate, "autocast_for", recording)
    monkeypatch.setattr(task, "autocast_for", recording)
    recipe, text = load_recipe(None, {**FAST, "data": str(images), "amp_dtype": "float16", "compare_batches": 0})
    run(DistillJob(str(student), recipe, tmp_path / "run", text, show=False))
    assert len(seen) > 3 and set(seen) == {"float16"}  # training steps (teacher, student) and validation


@pytest.mark.parametrize("variant", ["mhla", "ttt"])  # elu: its kernels as in every other test
def test_a_run_trains_on_the_kernels_under_cudas_bf16_autocast(tmp_path, monkeypatch, variant):
    """What a GPU run does that a CPU run (float32) does not: every forward under bf16 autocast, with CUDA's
    casting lists (tests/helpers.py: cuda_autocast_policy) and the fused kernels (Triton's interpreter here).
    The run trains (finite losses, both terms), and writes its model."""
    pytest.importorskip("triton")
    launches = []

    def launch(kernel, grid, *args, **kwargs):
        launches.append(kernel)
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    def bf16_autocast(device, enabled=True, dtype="bfloat16"):
        return torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=enabled)

    student = make_student(tmp_path / "models", variant, depth=1)  # one layer on the kernels: the interpreter is slow
    # one step of 2 images (3 images, the last batch dropped), 3 to validate: the interpreter runs a program per
    # image and head
    images = make_images(tmp_path / "images", per_class=1, val_per_class=1)
    monkeypatch.setattr(evaluate, "autocast_for", bf16_autocast)
    monkeypatch.setattr(task, "autocast_for", bf16_autocast)
    recipe, text = load_recipe(None, {**FAST, "batch_size": 2, "data": str(images), "compare_batches": 0})
    with cuda_autocast_policy(), dispatch.launches_through(launch, "cpu"):
        run(DistillJob(str(student), recipe, tmp_path / "run", text, show=False))
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert steps and all(math.isfinite(s["loss"]) and s["attn"] > 0 and s["task"] > 0 for s in steps), steps
    assert launches, "the student's attention did not run on the kernels"
    assert (tmp_path / "run" / "model.safetensors").is_file()
