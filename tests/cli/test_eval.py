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
    # 3 classes: the top 5 always hold the label, so a top-5 (100%) would measure nothing
    assert 0 <= metrics["top1"] <= 1 and metrics["top5"] is None and metrics["classes"] == 3
    table = runner.invoke(app, ["eval", str(teacher), "--data", str(images), "--split", "train"])
    assert table.exit_code == 0 and "top-1" in table.output and "12" in table.output
    assert "n/a (3 classes)" in table.output and "100.00%" not in table.output

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


def test_top5_of_more_than_5_classes_is_the_share_of_labels_among_the_5_highest_scores(tmp_path):
    """Checked against the teacher's own logits, ranked here in float64."""
    import torch

    import vitconvert
    from vitconvert.data import eval_transform, input_config, open_dataset

    teacher = make_teacher(tmp_path / "teacher", num_classes=7)
    images = make_images(tmp_path / "images", classes=7, val_per_class=1)
    result = runner.invoke(app, ["eval", str(teacher), "--data", str(images), "--json"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    model = vitconvert.load(teacher).eval()
    data = open_dataset(str(images), "val", None, False)
    transform = eval_transform(input_config(model))
    with torch.no_grad():
        pairs = [(model(transform(image)[None]).double()[0], label) for image, label in data]
    want = sum(label in logits.topk(5).indices.tolist() for logits, label in pairs) / len(pairs)
    assert metrics["classes"] == 7 and metrics["top5"] == want
