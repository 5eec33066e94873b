"""The CLI through typer's CliRunner (and once through the installed console script)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import timm
from helpers import assert_one_line_error, runner, tiny_model

from vitconvert.attention import VARIANTS
from vitconvert.cli import app

TINY_ARGS = ["--no-pretrained"]


@pytest.fixture
def timm_folder(tmp_path):
    timm.models.save_for_hf(tiny_model("vit"), str(tmp_path / "src"), safe_serialization=True)
    return tmp_path / "src"


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_convert_writes_folder_and_info_reads_it(tmp_path, timm_folder, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", str(timm_folder), "--to", "mhla", "--out", "m")
    assert result.exit_code == 0, result.output
    assert "mimetic" in result.output and "wrote" in result.output
    assert (tmp_path / ".vitconvert" / "last_convert").read_text().strip() == str((tmp_path / "m").resolve())
    result = invoke("info", "m", "--json")
    info = json.loads(result.stdout)
    assert info["variant"] == "mhla" and info["source"] == str(timm_folder)
    assert "conversion report" in invoke("info", "m").output


def test_a_relative_source_is_recorded_so_the_teacher_is_found_from_anywhere(tmp_path, timm_folder, monkeypatch):
    """`convert ./src` recorded "./src": from another directory distill and compare found no teacher, or another
    folder of that name, or a timm model named like the folder (pretrained weights in place of the user's)."""
    import torch
    from safetensors.torch import load_file, save_file

    import vitconvert
    from vitconvert.loading import load_teacher, teacher_spec

    monkeypatch.chdir(tmp_path)
    assert invoke("convert", "./src", "--to", "elu", "--out", "m").exit_code == 0
    assert json.loads(invoke("info", "m", "--json").stdout)["source"] == str(timm_folder)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(timm_folder, elsewhere / "src")  # a same-named folder there: another model
    weights = elsewhere / "src" / "model.safetensors"
    save_file({k: v + 1 for k, v in load_file(weights).items()}, weights)
    monkeypatch.chdir(elsewhere)
    student = vitconvert.load(tmp_path / "m")
    teacher = load_teacher(teacher_spec(student, None), student, seed=0, recorded=True)
    source = timm.create_model(f"local-dir:{timm_folder}", pretrained=True)
    got, want = teacher.state_dict(), source.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_convert_default_out_and_options(tmp_path, timm_folder, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", str(timm_folder), "--to", "inline", "--option", "local_residual=true",
                    "--attn-init", "copy", "--num-classes", "5", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["out"] == "vit_tiny_patch16_224-inline" and report["options"]["local_residual"] is True
    assert report["num_classes"] == 5


def test_list_shows_aliases_and_variants():
    result = invoke("list", "--json")
    data = json.loads(result.stdout)
    assert data["aliases"]["deit_small"] == "deit_small_patch16_224"
    assert list(data["variants"]) == list(VARIANTS) and len(VARIANTS) >= 5
    assert "init_scale" not in data["variants"]["elu"]  # Hedgehog's option: not with the default fixed φ
    assert "deit_small" in invoke("list").output


def test_list_shows_every_declared_option_with_its_default_and_doc():
    """The options table comes from each variant's declaration (attention/options.py), nothing written again."""
    data = json.loads(invoke("list", "--json").stdout)["options"]
    for name, cls in VARIANTS.items():
        assert [o["name"] for o in data[name]] == [o.name for o in cls.declared_options]
        assert [o["default"] for o in data[name]] == [o.default for o in cls.declared_options]
    shown = invoke("list").output  # not a terminal: no column is cut
    for cls in VARIANTS.values():  # every doc whole: Hedgehog's "[softmax(xW + b), ...]" is not taken for markup
        assert all(o.doc in shown for o in cls.declared_options)


def test_list_says_when_an_option_acts_only_under_another():
    """Plain ELU's init_scale does nothing (the variants table leaves it out): the options table keeps its row, a
    reader can still set it with feature_map=hedgehog, and says so under its name; --json says it as data."""
    data = json.loads(invoke("list", "--json").stdout)["options"]
    for name in ("elu", "relu"):
        assert {o["name"]: o["applies"] for o in data[name]} == {
            "eps": None, "feature_map": None, "init_scale": {"feature_map": "hedgehog"}}
    assert all(o["applies"] is None for o in data["mhla"] + data["ttt"])
    lines = invoke("list").output.splitlines()
    notes = [i for i, line in enumerate(lines) if "(only with feature_map=hedgehog)" in line]
    assert ["init_scale" in lines[i - 1] for i in notes] == [True, True]  # elu's and relu's rows, nothing else
    assert [lines[i - 1].split("│")[1].strip() for i in notes] == ["elu", "relu"]


@pytest.mark.parametrize("args,text", [
    (["convert", "deit_smal", "--to", "elu"], "did you mean"),
    (["convert", "deit_tiny", "--to", "softmax2", *TINY_ARGS], "valid: elu, relu, inline, mhla, ttt"),
    (["convert", "./missing", "--to", "elu"], "path not found"),
    (["convert", "hf-hub:bad id!", "--to", "elu"], "invalid Hub id"),
    (["convert", "resnet18", "--to", "elu", *TINY_ARGS], "no global softmax attention"),
    (["convert", "deit_tiny", "--to", "elu", "--num-classes", "0", *TINY_ARGS], "at least 1"),
    (["convert", "deit_tiny", "--to", "elu", "--attn-init", "svd", *TINY_ARGS], "valid: mimetic, copy, random"),
    (["convert", "deit_tiny", "--to", "elu", "--option", "nokey", *TINY_ARGS], "KEY=VALUE"),
    (["convert", "deit_tiny", "--to", "elu", "--option", "colour=red", *TINY_ARGS], "unknown option"),
    (["convert", "deit_tiny", "--to", "elu", "--option", "eps=[1", *TINY_ARGS], "--option eps: cannot read '[1'"),
    (["convert", "deit_tiny", "--to", "ttt", "--option", "x={a: 1", *TINY_ARGS], "--option x: cannot read '{a: 1'"),
    (["bench", "deit_tiny", "--option", "eps=[1"], "--option eps: cannot read '[1'"),
    (["distill", "--set", "lr=[1"], "--set lr: cannot read '[1'"),
    (["info", "./missing"], "not found"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, monkeypatch, args, text):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke(*args), text)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_bad_files(tmp_path, timm_folder, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert_one_line_error(invoke("convert", "empty", "--to", "elu"), "no config.json")
    weights = timm_folder / "model.safetensors"
    shutil.copy(weights, tmp_path / "w.safetensors")
    assert_one_line_error(invoke("convert", "w.safetensors", "--to", "elu", "--arch", "deit_small_patch16_224"),
                          "do not fit")
    weights.write_bytes(weights.read_bytes()[:700])
    assert_one_line_error(invoke("convert", str(timm_folder), "--to", "elu", "--out", "o"), "corrupt or truncated")
    assert not (tmp_path / "o").exists()


def test_existing_output_needs_force(tmp_path, timm_folder, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert invoke("convert", str(timm_folder), "--to", "elu", "--out", "m").exit_code == 0
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    assert_one_line_error(invoke("convert", str(timm_folder), "--to", "relu", "--out", "m"), "--force")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert invoke("convert", str(timm_folder), "--to", "relu", "--out", "m", "--force").exit_code == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vitconvert"]["variant"] == "relu"


def test_converting_a_converted_model_is_refused(tmp_path, timm_folder, monkeypatch):
    monkeypatch.chdir(tmp_path)
    invoke("convert", str(timm_folder), "--to", "elu", "--out", "m")
    assert_one_line_error(invoke("convert", "m", "--to", "relu", "--out", "n"), "already a linear-attention")


@pytest.mark.parametrize("form", ["folder", "timm name"])
def test_arch_with_a_source_that_names_its_own_is_refused(tmp_path, timm_folder, monkeypatch, form):
    """--arch reads a bare weights file; beside a folder or a timm name it was dropped without a word, so the user
    got another architecture than the one they named."""
    monkeypatch.chdir(tmp_path)
    source = str(timm_folder) if form == "folder" else "deit_tiny_patch16_224"
    result = invoke("convert", source, *TINY_ARGS, "--to", "elu", "--arch", "vit_small_patch16_224", "--out", "m")
    what = "a model folder: its config.json names" if form == "folder" else "a timm model name: it is"
    assert_one_line_error(result, f"--arch: names the timm architecture of a bare weights file only; {source} is "
                                  f"{what}")
    assert not (tmp_path / "m").exists()


def test_installed_console_script(tmp_path, timm_folder):
    exe = shutil.which("vitconvert", path=os.path.dirname(sys.executable)) or shutil.which("vitconvert")
    assert exe, "the vitconvert console script is not installed"
    done = subprocess.run([exe, "convert", str(timm_folder), "--to", "elu", "--out", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file()
    # its way out of an error (one line, exit 1, no traceback): tests/test_dependencies.py's run that skips the check


def test_a_failed_convert_keeps_the_record_of_the_last_one_that_finished(tmp_path, timm_folder, monkeypatch):
    """`distill` with no STUDENT takes the last convert that finished here; a convert that failed since is not one
    (it used to wipe the record: `distill` then said no convert had finished, and the README's `--resume` line
    said so too instead of naming the missing checkpoint)."""
    monkeypatch.chdir(tmp_path)
    assert invoke("convert", str(timm_folder), "--to", "elu", "--out", "m").exit_code == 0
    assert_one_line_error(invoke("convert", str(timm_folder), "--to", "elu", "--out", "m2", "--layers", "99"),
                          "--layers")
    assert (tmp_path / ".vitconvert" / "last_convert").read_text().strip() == str((tmp_path / "m").resolve())
    resumed = invoke("distill", "--resume", "--out", "runs/never-started", "--data", "digits")
    assert resumed.exit_code != 0 and "no STUDENT given" not in resumed.output
    assert "checkpoint" in resumed.output, resumed.output


def test_a_weights_file_beside_its_config_is_read_as_that_folder_says(tmp_path, timm_folder, monkeypatch):
    """`convert DIR/model.safetensors` without --arch: the config.json beside it names the architecture (and the
    sizes timm saved), so it converts as `convert DIR` does, and the student's teacher is rebuilt from the file;
    with no config.json beside it the one-line refusal stays."""
    from safetensors.torch import load_file

    from vitconvert import load
    from vitconvert.loading import load_teacher, teacher_spec

    monkeypatch.chdir(tmp_path)
    assert invoke("convert", str(timm_folder / "model.safetensors"), "--to", "elu", "--out", "f").exit_code == 0
    assert invoke("convert", str(timm_folder), "--to", "elu", "--out", "d").exit_code == 0
    from_file, from_folder = load_file("f/model.safetensors"), load_file("d/model.safetensors")
    assert from_file.keys() == from_folder.keys()
    assert all(from_file[k].equal(from_folder[k]) for k in from_folder)
    student = load("f")
    teacher = load_teacher(teacher_spec(student, None), student, seed=0, recorded=True)
    source = load_file(timm_folder / "model.safetensors")
    assert all(teacher.state_dict()[k].equal(source[k]) for k in source)
    (tmp_path / "bare").mkdir()
    shutil.copy(timm_folder / "model.safetensors", tmp_path / "bare" / "model.safetensors")
    assert_one_line_error(invoke("convert", "bare/model.safetensors", "--to", "elu", "--out", "o"),
                          "model.safetensors is a bare weights file with no architecture: name its timm architecture "
                          "with --arch NAME")
    assert_one_line_error(invoke("convert", "f/model.safetensors", "--to", "elu", "--out", "o"),
                          "f/model.safetensors is already a linear-attention vitconvert model")
    assert not (tmp_path / "o").exists()
