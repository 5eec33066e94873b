"""A TeacherCache shared by runs of one teacher on the same batches: the first run computes the teacher's outputs,
the next reads them, and trains to the same bits as a run that computed them itself (the same forward, once)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from vitconvert import capture
from vitconvert.distill import DistillJob, run
from vitconvert.distill.teacher_cache import TeacherCache
from vitconvert.recipes import load_recipe

from .helpers import FAST, assert_same_tensors

SETTINGS = {**FAST, "compare_batches": 0}  # one epoch, random crops


def job(student, out, data, cache=None, **extra):
    recipe, text = load_recipe(None, {**SETTINGS, "data": str(data), **extra})
    return DistillJob(student=str(student), recipe=recipe, out=out, recipe_text=text, show=False,
                      teacher_cache=cache)


def counting_teacher(monkeypatch) -> list[int]:
    calls = [0]
    forward = capture.TeacherTap.__call__

    def counted(self, images):
        calls[0] += 1
        return forward(self, images)

    monkeypatch.setattr(capture.TeacherTap, "__call__", counted)
    return calls


def test_a_second_run_reads_the_teacher_and_ends_bitwise_where_the_first_did(student, images, tmp_path, monkeypatch):
    calls = counting_teacher(monkeypatch)
    cache = TeacherCache()
    first = run(job(student, tmp_path / "first", images, cache))
    assert calls[0] > 0  # the first run computes the teacher's outputs (and writes them)
    calls[0] = 0
    second = run(job(student, tmp_path / "second", images, cache))
    assert calls[0] == 0  # every batch's teacher outputs came from the cache
    assert_same_tensors(load_file(first.folder / "model.safetensors"), load_file(second.folder / "model.safetensors"))


def test_outputs_are_read_back_only_by_the_key_and_shapes_that_wrote_them():
    cache = TeacherCache(capacity=4 * 2 * 54)  # room for two slots of 54 floats
    logits, outputs = torch.randn(2, 3), [torch.randn(2, 4, 3), torch.randn(2, 4, 3)]
    cache.put("recipe a", 1, logits, outputs)
    assert cache.get("recipe a", 0) is None  # a slot nobody wrote
    assert cache.get("recipe b", 1) is None  # another run's batches
    got_logits, got_outputs = cache.get("recipe a", 1)
    assert torch.equal(got_logits, logits) and all(map(torch.equal, got_outputs, outputs))
    cache.put("recipe a", 2, logits, outputs)  # past the capacity: not kept
    assert cache.get("recipe a", 2) is None
    cache.put("recipe a", 0, logits[:1], [o[:1] for o in outputs])  # another batch shape: not kept
    assert cache.get("recipe a", 0) is None
