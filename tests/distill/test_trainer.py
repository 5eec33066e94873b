"""The Trainer's shape: every attribute set in __init__ (builders return what they build), the library call
that the CLI wraps, and a stop that names where the run is."""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from pathlib import Path

import pytest

import vitconvert
from vitconvert.distill import distill, trainer
from vitconvert.distill.final_compare import compare_at_end
from vitconvert.errors import VitconvertError

from .helpers import FAST


def assigned(function: ast.FunctionDef) -> set[str]:
    return {t.attr for node in ast.walk(function) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for t in ast.walk(t) if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


def test_every_trainer_attribute_is_first_set_in_init():
    tree = ast.parse(textwrap.dedent(inspect.getsource(trainer.Trainer)))
    methods = {f.name: f for f in tree.body[0].body if isinstance(f, ast.FunctionDef)}
    in_init = assigned(methods.pop("__init__"))
    later = {name: sorted(assigned(f) - in_init) for name, f in methods.items() if assigned(f) - in_init}
    assert not later, later


def test_the_end_comparison_takes_keywords():
    params = list(inspect.signature(compare_at_end).parameters.values())
    assert params[0].name == "student" and all(p.kind is p.KEYWORD_ONLY for p in params[1:])


def test_distill_names_the_run_folder_itself_and_resumes_from_the_folder_alone(student, images, tmp_path,
                                                                              monkeypatch):
    """... and runs on the threads `vitconvert distill` runs on: one for a small student (torch's one per core only
    wait on each other), ``threads=`` when given, the caller's count back after."""
    import torch

    import vitconvert.distill

    seen, real = [], vitconvert.distill.run

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(vitconvert.distill, "run", spy)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.chdir(tmp_path)
    caller = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = distill(student, overrides={**FAST, "data": str(images), "compare_batches": 0}, show=False)
        assert result.folder == Path("runs") / f"{student.name}-default"  # runs/<student>-<recipe>, as the CLI's
        with pytest.raises(VitconvertError, match="is complete") as done:  # its recipe and student, read from it
            distill(out=result.folder, resume=True, show=False, threads=3)
        assert seen == [1, 3] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(caller)
    assert "epochs=N" in str(done.value) and "--" not in str(done.value)  # a library caller reads arguments
    with pytest.raises(VitconvertError, match="no student model folder given"):
        distill(out=tmp_path / "elsewhere")


def test_a_run_names_its_classes_after_the_data_when_the_student_has_none(student, images, tmp_path):
    # a re-headed student carries no class names; trained on a folder, its run is labelled by that folder's names,
    # so transformers' pipeline and the ONNX file say "class1", not "LABEL_1" (config.json's label_names)
    assert "label_names" not in vitconvert.load(student).pretrained_cfg
    result = distill(student, tmp_path / "run", overrides={**FAST, "data": str(images), "compare_batches": 0},
                     show=False)
    names = sorted(p.name for p in (images / "train").iterdir())
    for folder in (result.folder, result.folder / "best"):
        assert json.loads((folder / "config.json").read_text())["label_names"] == names
        assert vitconvert.load(folder).pretrained_cfg["label_names"] == names
