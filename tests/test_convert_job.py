"""convert_source: the `vitconvert convert` job as one library call (SOURCE string -> model folder)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import timm
import torch
from helpers import runner, tiny_model
from safetensors.torch import load_file

import vitconvert
from vitconvert import convert_job
from vitconvert.cli import app
from vitconvert.convert_job import convert_source
from vitconvert.errors import BadValue, VitconvertError


@pytest.fixture
def timm_folder(tmp_path):
    timm.models.save_for_hf(tiny_model("vit"), str(tmp_path / "src"), safe_serialization=True)
    return tmp_path / "src"


class Stages:
    """A ``progress`` that records the stages the job went through."""

    def __init__(self):
        self.seen: list[str] = []

    @contextmanager
    def __call__(self, what: str):
        self.seen.append(what)
        yield


def test_the_library_call_writes_what_the_command_writes(tmp_path, timm_folder, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stages = Stages()
    result = convert_source(str(timm_folder), "mhla", "lib", attn_init="copy", seed=3, num_classes=5,
                            options={"blocks_per_side": 2}, progress=stages)
    cli = runner.invoke(app, ["convert", str(timm_folder), "--to", "mhla", "--out", "cli", "--attn-init", "copy",
                              "--seed", "3", "--num-classes", "5", "--option", "blocks_per_side=2", "--json"])
    assert cli.exit_code == 0, cli.output
    ours, theirs = (load_file(tmp_path / name / "model.safetensors") for name in ("lib", "cli"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (tmp_path / "lib" / "config.json").read_text() == (tmp_path / "cli" / "config.json").read_text()
    shown = json.loads(cli.stdout)
    assert {k: v for k, v in result.to_dict().items() if k not in ("out", "seconds")} == \
           {k: v for k, v in shown.items() if k not in ("out", "seconds")}
    assert result.out.resolve() == (tmp_path / "lib").resolve()
    assert result.arch == "vit_tiny_patch16_224" and result.report.num_classes == 5 and result.selection is None
    assert [s.split()[0] for s in stages.seen] == ["loading", "converting", "writing"]
    assert vitconvert.convert_source is convert_source  # the public API


def test_default_out_is_arch_and_variant_and_a_random_source_records_its_seed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = convert_source("vit_tiny_patch16_224", "elu", pretrained=False, seed=7, img_size=32)
    assert result.out.name == "vit_tiny_patch16_224-elu" and (tmp_path / result.out).is_dir()
    block = json.loads((tmp_path / result.out / "config.json").read_text())["vitconvert"]
    assert block["source_seed"] == 7 and block["source_img_size"] == 32 and block["pretrained"] is False


def test_hybrid_auto_k_on_digits_is_chosen_and_recorded(tmp_path):
    stages = Stages()
    result = convert_source("digits", "elu", tmp_path / "s", keep_softmax="auto:1", data="digits", progress=stages)
    assert len(result.selection["keep"]) == 1 and result.selection["data"] == "digits"
    assert result.report.surgery.layers == [i for i in range(4) if i not in result.selection["keep"]]
    block = json.loads((tmp_path / "s" / "config.json").read_text())["vitconvert"]
    assert block["selection"] == result.selection and block["layers"] == result.report.surgery.layers
    assert [s.split()[0] for s in stages.seen] == ["loading", "measuring", "converting", "writing"]


def refuse_to_load(*args, **kwargs):
    raise AssertionError("the source was loaded although the arguments were refusable without it")


def test_the_output_is_refused_before_the_source_is_loaded(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_job, "load_source", refuse_to_load)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    with pytest.raises(VitconvertError, match="not written by vitconvert") as refused:
        convert_source("digits", "elu", tmp_path / "user", force=True)
    assert "--" not in str(refused.value) and "force=True" in str(refused.value)
    assert (tmp_path / "user" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("kwargs, name", [
    ({"to": "nosuch"}, "to"),
    ({"num_classes": 0}, "num_classes"),
    ({"img_size": 0}, "img_size"),
    ({"keep_softmax": "auto:1"}, "data"),
    ({"data": "digits"}, "data"),
    ({"keep_softmax": "auto:x", "data": "digits"}, "keep_softmax"),
])
def test_bad_values_are_refused_once_by_parameter_name_before_the_work(tmp_path, monkeypatch, kwargs, name):
    monkeypatch.setattr(convert_job, "load_source", refuse_to_load)
    with pytest.raises(BadValue) as refused:
        convert_source("digits", **{"to": "elu", "out": tmp_path / "s", **kwargs})
    assert refused.value.name == name and "--" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []


def test_keeping_every_layer_softmax_is_refused_and_writes_nothing(tmp_path):
    with pytest.raises(BadValue, match="the source model itself") as refused:
        convert_source("digits", "elu", tmp_path / "s", keep_softmax="0-3")
    assert refused.value.name == "keep_softmax" and list(tmp_path.iterdir()) == []


def test_a_student_of_a_bare_weights_file_finds_its_teacher(tmp_path):
    """`convert WEIGHTS --arch A`: compare and distill rebuilt the recorded source without A and refused it ("a bare
    weights file with no architecture"); the folder records A, so the teacher is the file read as convert read it."""
    from safetensors.torch import save_file

    from vitconvert.loading import load_teacher, teacher_spec

    source = timm.create_model("test_vit", pretrained=False, num_classes=3)  # timm's own tiny test ViT
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    convert_source(str(tmp_path / "w.safetensors"), "elu", tmp_path / "s", arch="test_vit")
    student = vitconvert.load(tmp_path / "s")
    teacher = load_teacher(teacher_spec(student, None), student, seed=0, recorded=True)
    got, want = teacher.state_dict(), source.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_library_call_runs_on_the_threads_the_command_runs_on(tmp_path, timm_folder, monkeypatch):
    """One torch thread for a small source (torch's one per core only wait on each other), ``threads=`` when given,
    the caller's count back after: as `vitconvert convert` (tests/cli/test_threads.py)."""
    seen, real = [], convert_job.convert

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_job, "convert", spy)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    caller = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        convert_source(str(timm_folder), "elu", tmp_path / "a")
        convert_source(str(timm_folder), "elu", tmp_path / "b", threads=3)
        assert seen == [1, 3] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(caller)
