"""`vitconvert eval`: any model (converted, run folder, softmax source) on a split, JSON for programs."""

from __future__ import annotations

import json

from distill.helpers import make_images, make_teacher
from helpers import runner

from vitconvert.cli import app


def test_eval_a_softmax_source_and_its_errors(tmp_path):
    teacher, images = make_teacher(tmp_path / "teacher"), make_images(tmp_path / "images")
    result = runner.invoke(app, ["eval", str(teacher), "--data", str(images), "--json", "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    assert set(metrics) >= {"top1", "top5", "loss", "n"} and metrics["n"] == 6
    assert 0 <= metrics["top1"] <= metrics["top5"] == 1.0  # 3 classes: the top 5 always holds the label
    table = runner.invoke(app, ["eval", str(teacher), "--data", str(images), "--split", "train"])
    assert table.exit_code == 0 and "top-1" in table.output and "12" in table.output

    missing = runner.invoke(app, ["eval", str(teacher), "--data", str(tmp_path / "nope")])
    assert missing.exit_code != 0 and missing.stderr.startswith("error: data folder not found")
    wrong = runner.invoke(app, ["eval", str(teacher), "--data", str(make_images(tmp_path / "two", classes=2))])
    assert wrong.exit_code != 0 and "2 classes but the model's head has 3" in wrong.stderr
    assert "Traceback" not in missing.output + wrong.output


def test_eval_on_other_classes_than_the_head_says_what_data_to_give_not_to_re_head(tmp_path):
    # a new, random head (distill's fix) would make the measurement meaningless: eval names the data to give
    teacher = make_teacher(tmp_path / "teacher")
    result = runner.invoke(app, ["eval", str(teacher), "--data", str(make_images(tmp_path / "two", classes=2))])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "--num-classes" not in result.stderr and "give data of the 3 classes it was trained on" in result.stderr
