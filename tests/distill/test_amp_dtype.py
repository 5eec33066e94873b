"""The recipe's autocast dtype reaches every forward of a run, validation included (fp16 GPUs lack bf16)."""

from __future__ import annotations

from vitconvert import evaluate
from vitconvert.distill import DistillJob, run, task
from vitconvert.recipes import load_recipe

from .helpers import FAST


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
