"""No stall (issue 23): commands that compute run a small model on one torch thread unless told otherwise
(--threads, or OMP_NUM_THREADS); torch's default of one thread per core made a 20 s walk-through take 355 s
on a busy two-core machine."""

from __future__ import annotations

import json

import pytest
import torch
from distill.helpers import FAST, make_images, make_student
from helpers import invoke, place_in_hub_cache


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads")
    make_student(root)
    make_images(root / "images")
    return root


@pytest.fixture
def seen(monkeypatch):
    """The torch thread count each job runs under (the tests' own default is 1: start from 2)."""
    import vitconvert.compare
    import vitconvert.distill
    import vitconvert.evaluate

    counts: dict[str, int] = {}
    for module, name in ((vitconvert.evaluate, "eval_sums"), (vitconvert.compare, "compare_models"),
                         (vitconvert.distill, "run")):
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            counts[_name] = torch.get_num_threads()
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield counts
    torch.set_num_threads(previous)


def test_small_models_run_on_one_thread_by_default(ws, seen, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = ["--data", ws / "images"]
    assert invoke("eval", ws / "student-elu", *data).exit_code == 0
    assert invoke("compare", ws / "student-elu", *data, "--batches", "1").exit_code == 0
    sets = [a for k, v in FAST.items() if k not in ("epochs", "batch_size") for a in ("--set", f"{k}={json.dumps(v)}")]
    result = invoke("distill", ws / "student-elu", *data, "--epochs", "1", "--batch-size", "4", *sets,
                    "--set", "compare_batches=0", "--out", "r")
    assert result.exit_code == 0, result.output
    assert seen == {"eval_sums": 1, "compare_models": 1, "run": 1}
    assert torch.get_num_threads() == 2  # the caller's count comes back


def test_threads_and_omp_num_threads_are_obeyed(ws, seen, monkeypatch):
    assert invoke("eval", ws / "student-elu", "--data", ws / "images", "--threads", "2").exit_code == 0
    assert seen["eval_sums"] == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own choice: left as it is
    assert invoke("compare", ws / "student-elu", "--data", ws / "images", "--batches", "1").exit_code == 0
    assert seen["compare_models"] == 2


def test_a_small_model_from_the_hub_cache_runs_on_one_thread_too(ws, seen, tmp_path, monkeypatch):
    # a cached hf-hub: snapshot is counted from the cache (never fetched for it): on a busy 2-core machine a tiny
    # TTT student's eval ran at 6 img/s on torch's two threads against 74 from its local folder
    place_in_hub_cache(tmp_path / "hub", "me/student", ws / "student-elu")
    import huggingface_hub.constants as hub_constants

    for name, value in (("HF_HUB_CACHE", str(tmp_path / "hub")), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
        monkeypatch.setattr(hub_constants, name, value if name == "HF_HUB_CACHE" else True)
    result = invoke("eval", "hf-hub:me/student", "--data", ws / "images")
    assert result.exit_code == 0, result.output
    assert seen["eval_sums"] == 1


def test_the_library_calls_run_on_the_threads_the_commands_run_on(ws, seen, tmp_path, monkeypatch):
    """evaluate, compare_student and export set the threads themselves (loading.model_threads), so a Python caller
    gets what the command line gets: 1 for a small model (a folder, or a model in hand), ``threads=`` when given."""
    import vitconvert
    import vitconvert.export
    from vitconvert.compare import compare_student
    from vitconvert.evaluate import evaluate

    counts, real = [], vitconvert.export.load_for_export

    def spy(*args, **kwargs):
        counts.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(vitconvert.export, "load_for_export", spy)
    student, data = ws / "student-elu", str(ws / "images")
    evaluate(student, data)
    assert seen["eval_sums"] == 1
    evaluate(vitconvert.load(student), data, threads=3)
    assert seen["eval_sums"] == 3
    evaluate(vitconvert.load(student), data)
    assert seen["eval_sums"] == 1
    compare_student(str(student), data, batches=1)
    assert seen["compare_models"] == 1
    vitconvert.export.export(student, "pt2", tmp_path / "m.pt2")
    assert counts == [1] and torch.get_num_threads() == 2  # the caller's count comes back
