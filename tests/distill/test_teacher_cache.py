"""A TeacherCache shared by runs of one teacher on the same batches: the first run computes the teacher's outputs,
the next reads them, and trains to the same bits as a run that computed them itself (the same forward, once)."""

from __future__ import annotations

import multiprocessing
import os
import signal

import torch
from safetensors.torch import load_file

from vitconvert.distill import DistillJob, run
from vitconvert.distill.teacher_cache import TeacherCache
from vitconvert.recipes import load_recipe

from .helpers import FAST, assert_same_tensors, counting_teacher

SETTINGS = {**FAST, "compare_batches": 0}  # one epoch, random crops


def job(student, out, data, cache=None, **extra):
    recipe, text = load_recipe(None, {**SETTINGS, "data": str(data), **extra})
    return DistillJob(student=str(student), recipe=recipe, out=out, recipe_text=text, show=False,
                      teacher_cache=cache)


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


class CountedLock:
    """A process-shared lock that counts the waits for it."""

    def __init__(self, lock):
        self.lock, self.waits = lock, 0

    def acquire(self, timeout=None):
        self.waits += 1
        return self.lock.acquire(timeout=timeout)

    def release(self):
        self.lock.release()


def test_a_worker_killed_holding_the_lock_stalls_the_others_only_once_and_then_not_at_all():
    """A run whose wait for the lock runs out stops using the cache: its reads miss (the run computes the teacher
    itself, the same bits) and its writes keep nothing, and it never waits again."""
    context = multiprocessing.get_context("fork")
    lock = CountedLock(context.Lock())
    cache = TeacherCache(lock, capacity=4 * 54, lock_wait_s=0.2)
    logits, outputs = torch.randn(2, 3), [torch.randn(2, 4, 3), torch.randn(2, 4, 3)]
    cache.put("recipe", 0, logits, outputs)
    assert cache.get("recipe", 0) is not None
    worker = context.Process(target=die_holding, args=(lock.lock,))
    worker.start()
    worker.join()
    assert worker.exitcode == -signal.SIGKILL
    waits = lock.waits
    assert cache.get("recipe", 0) is None and cache.abandoned  # waited 0.2 s, then gave up: a miss
    assert lock.waits == waits + 1
    cache.put("recipe", 0, logits, outputs)
    assert cache.get("recipe", 0) is None and lock.waits == waits + 1  # no second wait


def die_holding(lock) -> None:
    lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)
