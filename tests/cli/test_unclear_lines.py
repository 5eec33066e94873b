"""Error lines that were torch's or another command's words, or cut before their reason: each now says the mistake
itself, through the command (typer's runner)."""

from __future__ import annotations

import pytest
import timm
import torch
from distill.helpers import make_student
from helpers import assert_one_line_error, invoke


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("unclear")
    make_student(root)
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              num_heads=2, depth=2, num_classes=3)
    torch.save(model, root / "whole.pth")  # a pickled module: loading it would run code
    state = model.state_dict()
    state["head.weight"] = torch.zeros(7, 32)
    torch.save(state, root / "other-head.pth")
    return root


def test_an_image_smaller_than_a_patch(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke("convert", ws / "teacher", "--to", "elu", "--img-size", "4", "--out", "m"),
                          f"error: --img-size: 4 px is smaller than one patch of {ws / 'teacher'}: the image would "
                          "have no patch grid; give a size of at least one patch")
    assert not (tmp_path / "m").exists()


def test_a_pickled_model_is_named_as_one(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", ws / "whole.pth", "--arch", "vit_tiny_patch16_224", "--to", "elu", "--out", "m")
    assert_one_line_error(result, "whole.pth is a pickle of more than tensors (a whole model or training objects): "
                                  "vitconvert never unpickles a file, as that runs its code; save the model's "
                                  "state_dict() (or use safetensors) and give that")


def test_a_state_dict_mismatch_says_which_weights(ws, tmp_path, monkeypatch):
    """torch's first line ("Error(s) in loading state_dict for VisionTransformer:") was all the line said."""
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", ws / "other-head.pth", "--arch", "vit_tiny_patch16_224", "--to", "elu",
                    "--img-size", "32", "--out", "m")
    assert_one_line_error(result, "do not fit architecture vit_tiny_patch16_224: ")
    assert "Missing key" in result.stderr or "size mismatch" in result.stderr, result.stderr
    assert not result.stderr.rstrip().endswith("VisionTransformer:")


def test_quickstart_out_over_a_model_folder(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke("quickstart", "--out", ws / "student-elu", "--force"),
                          f"error: {ws / 'student-elu'} is a vitconvert model or run folder: this command writes a "
                          "folder of several models and runs, not one; choose another --out")


def test_bench_keep_softmax_auto(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke("bench", ws / "teacher", "--keep-softmax", "auto:1", "--no-pretrained"),
                          "error: --keep-softmax: auto:K picks the layers from data, which bench does not read: give "
                          "the layers to keep (e.g. --keep-softmax 0,1)")
