"""`vitconvert distill` through typer's CliRunner: defaults, the run folder, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from distill.helpers import FAST, make_images, make_student, make_teacher
from helpers import assert_one_line_error, runner

import vitconvert
from vitconvert.cli import app

QUICK = ["--epochs", "1", "--batch-size", "4"] + [a for k, v in FAST.items() if k not in ("epochs", "batch_size")
                                                  for a in ("--set", f"{k}={json.dumps(v)}")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-distill")
    return make_student(root), make_images(root / "images"), root


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])




def assert_no_top5_of_3_classes(printed: dict, config: dict, card: str, lines: str, info: str) -> None:
    """3 classes: the top 5 always hold the label; no 100% top-5 in the JSON, the card or its Hub metadata, the
    lines distill prints, or the results line of ``vitconvert info``."""
    assert "top5 n/a (3 classes)" in lines
    assert "top-5 n/a (3 classes)" in info
    assert (printed["top5"], config["metrics"]["top5"]) == (None, None)
    assert "| top5 | n/a (3 classes) |" in card
    assert "top_5_accuracy" not in card and "Top-5" not in card


def test_distill_defaults_to_the_last_convert_and_writes_a_run_folder(setup, tmp_path, monkeypatch):
    _, images, root = setup
    monkeypatch.chdir(tmp_path)
    assert invoke("convert", root / "teacher", "--to", "relu", "--out", "s").exit_code == 0
    result = invoke("distill", "--data", images, *QUICK, "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    run = tmp_path / "runs" / "s-default"
    assert printed["out"] == "runs/s-default" and 0 <= printed["top1"] <= 1 and printed["n"] == 6
    for name in ("config.json", "model.safetensors", "README.md", "recipe.yaml", "metrics.jsonl", "curves.png",
                 "best/config.json", "checkpoint-last/trainer.json"):
        assert (run / name).is_file(), name
    assert type(vitconvert.load(run)).__name__ == "VisionTransformer"
    assert "# overrides from the command line" in (run / "recipe.yaml").read_text()
    card = (run / "README.md").read_text()
    assert "## Training recipe" in card and "## Results" in card and "relu" in card
    config = json.loads((run / "config.json").read_text())["vitconvert"]
    assert config["recipe"]["schedule"]["epochs"] == 1 and config["teacher"] == str(root / "teacher")
    assert config["metrics"]["top1"] == round(100 * printed["top1"], 2)

    evaluated = invoke("eval", run, "--data", images, "--json")
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads(evaluated.stdout)["top1"] == pytest.approx(printed["top1"])  # same preprocessing as validation

    assert_one_line_error(invoke("distill", "--data", images, *QUICK), "already exists; use --resume")
    assert_one_line_error(invoke("distill", "--data", images, *QUICK, "--resume", "--epochs", "2"),
                          "changed recipe (epochs: 1 -> 2)")
    forced = invoke("distill", "--data", images, *QUICK, "--resume", "--epochs", "2", "--force")
    assert forced.exit_code == 0, forced.output
    assert_no_top5_of_3_classes(printed, config, card, forced.output,
                                runner.invoke(app, ["info", str(run)], env={"COLUMNS": "400"}).output)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [1, 2]
    first_of_second = next(r for r in records if r["kind"] == "step" and r["epoch"] == 2)
    assert first_of_second["lr"] > 1e-4  # the new 2-epoch cosine, not the old one that ended at min_lr


@pytest.mark.parametrize("stages,attn_steps", [("attn:1,finetune", 3), ("attn:4steps,finetune", 4)])
def test_stages_train_attention_first(setup, tmp_path, stages, attn_steps):
    student, images, _ = setup
    result = invoke("distill", student, "--data", images, *QUICK, "--epochs", "2", "--stages", stages,
                    "--attn-target", "teacher-forced", "--attn-loss", "cosine", "--kd-weight", "0.5",
                    "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]  # one a step (log_interval 1), 3 steps an epoch
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(set(r) & {"task", "kd"} == set() and "attn" in r for r in steps[:attn_steps])
    assert all({"task", "attn", "kd"} <= set(r) for r in steps[attn_steps:])
    assert [r["stage"] for r in records if r["kind"] == "epoch"] == ["attn", "finetune"]


def test_attention_stage_leaves_everything_else_untouched(setup, tmp_path):
    student, images, _ = setup
    result = invoke("distill", student, "--data", images, *QUICK, "--stages", "attn", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    before, after = vitconvert.load(student).state_dict(), vitconvert.load(tmp_path / "run").state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".attn." in k for k in changed)


def test_bad_input_is_one_line(setup, tmp_path, monkeypatch):
    student, images, root = setup
    monkeypatch.chdir(tmp_path)
    out = ["--out", tmp_path / "run"]
    assert_one_line_error(invoke("distill", "--data", images), "no STUDENT given")
    assert_one_line_error(invoke("distill", student, "--data", tmp_path / "nope", *QUICK, *out),
                          "data folder not found")
    (tmp_path / "empty" / "train" / "a").mkdir(parents=True)
    assert_one_line_error(invoke("distill", student, "--data", tmp_path / "empty", *QUICK, *out), "holds no images")
    two = make_images(tmp_path / "two", classes=2)
    assert_one_line_error(invoke("distill", student, "--data", two, *QUICK, *out),
                          "the data has 2 classes but the student's head has 3")
    deeper = make_teacher(tmp_path / "deeper", depth=3)
    assert_one_line_error(invoke("distill", student, "--data", images, "--teacher", deeper, *QUICK, *out),
                          "differ in depth")
    assert_one_line_error(invoke("distill", student, "--data", images, *QUICK, "--set", "lrr=1", *out),
                          "unknown recipe key 'lrr'; did you mean lr?")
    assert_one_line_error(invoke("distill", student, "--data", images, *QUICK, "--resume", *out),
                          "has no checkpoint-last/")
    assert_one_line_error(invoke("distill", student, "--data", images, *QUICK, "--recipe", "nope", *out),
                          "recipe not found")
    assert_one_line_error(invoke("distill", student, "--data", images, *QUICK, "--set", "mixup=0.8",
                                 "--batch-size", "3", *out), "even batch")
    assert_one_line_error(invoke("distill", root / "teacher", "--data", images, *QUICK, *out),
                          "not a vitconvert model folder")
    assert not (tmp_path / "run").exists()  # nothing was written by a refused run
