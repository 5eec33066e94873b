"""`vitconvert compare` through typer's CliRunner on a tiny image folder."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import timm
from helpers import assert_one_line_error, runner, tiny_model
from PIL import Image

import vitconvert
from vitconvert.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")
CLASSES = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A softmax teacher folder, its converted student (which records it as source) and val/ images."""
    root = tmp_path_factory.mktemp("compare")
    teacher = tiny_model("vit", num_classes=CLASSES)
    timm.models.save_for_hf(teacher, str(root / "teacher"), safe_serialization=True)
    student, _ = vitconvert.convert(teacher, to="elu", source=str(root / "teacher"))
    vitconvert.save(student, root / "student")
    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
    for c in range(CLASSES):
        folder = root / "data" / "val" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (40, 40), tuple(v + 20 * i for v in colours[c])).save(folder / f"{i}.png")
    return root


def invoke(*args: str):
    return runner.invoke(app, ["compare", *map(str, args)])


def test_json_report(setup):
    result = invoke(setup / "student", "--data", setup / "data", "--batches", 2, "--batch-size", 4, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["images"] == 6 and report["teacher"] == str(setup / "teacher")
    assert [row["layer"] for row in report["layers"]] == [0, 1]
    assert all(row["attn_mse"] > 0 and -1 <= row["attn_cos"] <= 1 for row in report["layers"])
    assert 0 <= report["top1_agreement"] <= 1 and report["logit_kl"] >= 0


def test_table_and_plot(setup, tmp_path):
    result = invoke(setup / "student", "--teacher", setup / "teacher", "--data", setup / "data",
                    "--batches", 1, "--batch-size", 2, "--plot", tmp_path / "gaps.png")
    assert result.exit_code == 0, result.output
    assert "attn cos" in result.output and "top-1 agreement" in result.output and "2 images" in result.output
    assert (tmp_path / "gaps.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_input_is_one_line(setup, tmp_path, monkeypatch):
    student, data = setup / "student", setup / "data"
    assert_one_line_error(invoke(student, "--data", tmp_path / "missing"), "data folder not found")
    assert_one_line_error(invoke(setup / "teacher", "--data", data), "not a vitconvert model folder")
    assert_one_line_error(invoke(tmp_path, "--data", data), "no config.json")
    timm.models.save_for_hf(tiny_model("vit", depth=3, num_classes=CLASSES), str(tmp_path / "deep"))
    assert_one_line_error(invoke(student, "--teacher", tmp_path / "deep", "--data", data), "differ in depth")
    assert_one_line_error(invoke(student, "--data", data, "--batches", 0), "at least 1")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert_one_line_error(invoke(student, "--data", data, "--plot", tmp_path / "x.png"), "needs matplotlib")


def test_moved_teacher_asks_for_teacher_option(setup, tmp_path):
    shutil.copytree(setup / "student", tmp_path / "student")
    config = json.loads((tmp_path / "student" / "config.json").read_text())
    config["vitconvert"]["source"] = str(tmp_path / "gone")
    (tmp_path / "student" / "config.json").write_text(json.dumps(config))
    assert_one_line_error(invoke(tmp_path / "student", "--data", setup / "data"), "--teacher")


def test_timm_dataset_names_take_data_dir(setup, tmp_path):
    """compare reads `torch/...` names as eval and distill do: under --data-dir (download only when asked)."""
    result = invoke(setup / "student", "--data", "torch/image_folder", "--data-dir", setup / "data", "--batches", 2,
                    "--batch-size", 4, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["images"] == 6
    assert_one_line_error(invoke(setup / "student", "--data", "torch/cifar100"), "torch/cifar100 needs --data-dir")
    assert_one_line_error(invoke(setup / "student", "--data", "torch/cifar100", "--data-dir", tmp_path),
                          f"cannot open torch/cifar100 (val) under {tmp_path}")
    assert list(tmp_path.iterdir()) == []  # nothing downloaded without --download


def test_the_library_job_is_what_the_command_reports(setup):
    """`vitconvert compare` is `compare_student` plus a table: the same numbers, the teacher the student records."""
    from vitconvert.compare import compare_student

    result = compare_student(str(setup / "student"), str(setup / "data"), batches=1, batch_size=6)
    assert result.teacher == str(setup / "teacher")
    shown = invoke(setup / "student", "--data", setup / "data", "--batches", "1", "--batch-size", "6", "--json")
    assert shown.exit_code == 0, shown.output
    reported = json.loads(shown.stdout)
    assert reported["teacher"] == result.teacher
    for shown_row, row in zip(reported["layers"], result.report.to_dict()["layers"], strict=True):
        assert shown_row == pytest.approx(row)
    assert reported["top1_agreement"] == pytest.approx(result.report.top1_agreement)
