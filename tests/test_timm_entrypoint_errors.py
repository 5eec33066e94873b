"""The timm entrypoint's errors, through timm.create_model as a timm user calls it: the line names the mistake (no
ViT named, a ViT timm does not know), not only the keyword the entrypoint takes (``architecture=``)."""

from __future__ import annotations

import json
import shutil

import pytest
import timm
from distill.helpers import make_student

import vitconvert  # noqa: F401  (registers the entrypoints)
from vitconvert.errors import VitconvertError


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return make_student(tmp_path_factory.mktemp("entrypoint"))


def edited(student, tmp_path, change):
    folder = shutil.copytree(student, tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    change(config["model_args"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_no_vit_named(student, tmp_path):
    folder = edited(student, tmp_path, lambda args: args.pop("architecture"))
    with pytest.raises(VitconvertError) as e:
        timm.create_model(f"local-dir:{folder}")
    assert str(e.value).startswith("vitconvert_elu is a timm ViT with elu attention, and no ViT was named: pass the "
                                   "softmax model it is built on")
    with pytest.raises(VitconvertError, match="and no ViT was named"):
        timm.create_model("vitconvert_relu")


def test_a_vit_timm_does_not_know(student, tmp_path):
    folder = edited(student, tmp_path, lambda args: args.update(architecture="vit_tiny_patch16_22"))
    with pytest.raises(VitconvertError) as e:
        timm.create_model(f"local-dir:{folder}")
    assert str(e.value) == ("vitconvert_elu: the softmax ViT 'vit_tiny_patch16_22' is not a timm model; did you mean "
                            "vit_tiny_patch16_224?")
