"""Nothing silently wrong (issue 23): the teacher is the student's own source, a resume continues the same
job, labels follow class names, a folder's layer list matches its weights, and no accuracy of NaN outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from distill.helpers import CLI_FAST, make_teacher, make_workspace
from helpers import assert_one_line_error, invoke
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vitconvert.data import digits_dataset

QUICK = ["--epochs", "1", *CLI_FAST]
RANDOM_SOURCE = ["test_vit", "--no-pretrained", "--img-size", "32"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("results"))


def test_a_random_init_source_is_its_students_teacher(ws, tmp_path, monkeypatch):
    """--no-pretrained (the offline path): compare and distill use the very model the student came from, at the
    size it was converted at — its kept softmax layer matches the teacher's exactly, and distill needs no
    --set img_size."""
    monkeypatch.chdir(tmp_path)
    made = invoke("convert", *RANDOM_SOURCE, "--to", "elu", "--keep-softmax", "0", "--num-classes", "3",
                  "--out", "h")
    assert made.exit_code == 0, made.output
    compared = invoke("compare", "h", "--data", ws / "images", "--batches", "1", "--batch-size", "4", "--json")
    assert compared.exit_code == 0, compared.output
    layer0 = json.loads(compared.stdout)["layers"][0]
    assert layer0["attention"] == "softmax" and layer0["attn_cos"] > 0.9999 and layer0["block_cos"] > 0.9999
    trained = invoke("distill", "h", "--data", ws / "images", *QUICK, "--kd-weight", "0", "--out", "r")
    assert trained.exit_code == 0, trained.output

    config = json.loads((tmp_path / "h" / "config.json").read_text())
    del config["vitconvert"]["source_seed"]  # as an older vitconvert wrote it: that teacher cannot be rebuilt
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    assert_one_line_error(invoke("compare", "h", "--data", ws / "images"), "cannot be rebuilt")


def test_resume_continues_the_same_teacher_and_refuses_another_student(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other = make_teacher(tmp_path / "other-teacher")
    started = invoke("distill", ws / "student-elu", "--teacher", other, "--data", ws / "images", *QUICK,
                     "--out", "r")
    assert started.exit_code == 0, started.output
    # resumed with nothing but the run: the run's teacher, not the student's recorded source
    resumed = invoke("distill", ws / "student-elu", "--data", ws / "images", *QUICK, "--epochs", "2", "--resume",
                     "--force", "--out", "r")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((tmp_path / "r" / "config.json").read_text())["vitconvert"]["teacher"] == str(other)

    hybrid = invoke("convert", ws / "teacher", "--to", "elu", "--keep-softmax", "0", "--out", "hybrid")
    assert hybrid.exit_code == 0, hybrid.output
    before = (tmp_path / "r" / "checkpoint-last" / "model.safetensors").read_bytes()
    wrong = invoke("distill", "hybrid", "--data", ws / "images", *QUICK, "--epochs", "3", "--resume", "--force",
                   "--out", "r")
    assert_one_line_error(wrong, "checkpoint is of another student (layers: [0, 1] -> [1]")
    assert (tmp_path / "r" / "checkpoint-last" / "model.safetensors").read_bytes() == before


def digit_folder(root: Path, per_class: int = 3) -> Path:
    """A val/ image folder of the bundled digits named as the digits teacher's label names ("0" ... "9")."""
    data = digits_dataset("val")
    counts: dict[int, int] = {}
    for i in range(len(data)):
        label = data.targets[i]
        if counts.get(label, 0) < per_class:
            (root / "val" / str(label)).mkdir(parents=True, exist_ok=True)
            data.image(i).save(root / "val" / str(label) / f"{i}.png")
            counts[label] = counts.get(label, 0) + 1
    return root


def test_eval_labels_follow_class_names(tmp_path):
    """A val/ missing a class keeps its labels (the model's label names); a renamed class folder and an empty
    one are refused instead of shifting every label after them."""
    images = digit_folder(tmp_path / "d")
    shutil.rmtree(images / "val" / "3")
    result = invoke("eval", "digits", "--data", images, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["top1"] > 0.9 and json.loads(result.stdout)["n"] == 27
    (images / "val" / "4").rename(images / "val" / "four")
    assert_one_line_error(invoke("eval", "digits", "--data", images), "class folders not among the model's label")
    (images / "val" / "four").rename(images / "val" / "4")
    (images / "val" / "3").mkdir()
    assert_one_line_error(invoke("eval", "digits", "--data", images), "class folders without images (3)")


def test_distill_refuses_a_val_split_with_other_classes(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    images = shutil.copytree(ws / "images", tmp_path / "images")
    (images / "val" / "class1").rename(images / "val" / "renamed")
    assert_one_line_error(invoke("distill", ws / "student-elu", "--data", images, *QUICK, "--out", "r"),
                          "class folders not among the train split's classes (renamed)")
    assert list(tmp_path.iterdir()) == [images]


def test_a_hybrid_folder_whose_layer_list_was_edited_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert invoke("convert", "digits", "--to", "elu", "--keep-softmax", "0", "--out", "h").exit_code == 0
    with safe_open("h/model.safetensors", "pt") as fh:
        assert json.loads(fh.metadata()["vitconvert_linear_layers"]) == [1, 2, 3]  # the weights say it
    original = (tmp_path / "h" / "config.json").read_text()
    for layers, text in (([0, 1, 2, 3], "holds linear attention in layers [1, 2, 3]"), ([], "makes no layer linear"),
                         (["0"], "must list layer indices")):
        config = json.loads(original)
        config["vitconvert"]["layers"] = layers
        config["model_args"]["layers"] = layers  # consistently: both lists
        (tmp_path / "h" / "config.json").write_text(json.dumps(config))
        for command in (["info", "h"], ["eval", "h", "--data", "digits"]):
            assert_one_line_error(invoke(*command), text)


def test_eval_refuses_nan_outputs_and_a_headless_model(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    broken = shutil.copytree(ws / "student-elu", tmp_path / "nan")
    weights = broken / "model.safetensors"
    with safe_open(str(weights), "pt") as fh:
        metadata = fh.metadata()
    state = load_file(str(weights))
    state["head.weight"] = torch.full_like(state["head.weight"], float("nan"))
    save_file(state, str(weights), metadata=metadata)
    assert_one_line_error(invoke("eval", broken, "--data", ws / "images"), "outputs are NaN or infinite")
    headless = make_teacher(tmp_path / "headless", num_classes=0)
    assert_one_line_error(invoke("eval", headless, "--data", ws / "images"), "has no classification head")


def test_bench_times_a_hybrid_folder_as_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert invoke("convert", "digits", "--to", "elu", "--keep-softmax", "0", "--out", "h").exit_code == 0
    result = invoke("bench", "h", "--repeats", "1", "--warmup", "0", "--no-memory", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["keep_softmax"] == [0]  # not the all-linear model
    assert_one_line_error(invoke("bench", "digits", "--to", "elu", "--keep-softmax", "0-3", "--repeats", "1"),
                          "keeps all 4 layers softmax")


def test_16_bit_pngs_are_scaled_not_clipped(tmp_path):
    """The same digits as 8-bit and as 16-bit grey PNGs evaluate the same (PIL alone clips 16-bit at 255)."""
    import numpy as np
    from PIL import Image

    eight = digit_folder(tmp_path / "8bit", per_class=2)
    sixteen = shutil.copytree(eight, tmp_path / "16bit")
    for png in sixteen.rglob("*.png"):
        grey = Image.open(png).convert("L")
        grey.save(eight / png.relative_to(sixteen))  # the 8-bit twin, grey as well
        Image.fromarray(np.asarray(grey, dtype=np.uint16) * 257).save(png)
    results = [invoke("eval", "digits", "--data", folder, "--json") for folder in (eight, sixteen)]
    assert all(r.exit_code == 0 for r in results), [r.output for r in results]
    assert Image.open(next(sixteen.rglob("*.png"))).mode.startswith("I")
    loss8, loss16 = (json.loads(r.stdout)["loss"] for r in results)
    assert loss16 == pytest.approx(loss8, rel=1e-6)
