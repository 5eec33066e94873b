"""One version, everywhere it is shown: ``--version``, the installed metadata, config.json, ``info``, the card."""

from __future__ import annotations

import json
from importlib.metadata import version

import timm
from helpers import runner

import vitconvert
from vitconvert.cli import app


def test_version_flag_matches_the_package_metadata():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"vitconvert {vitconvert.__version__}"
    assert version("vitconvert") == vitconvert.__version__  # pyproject reads vitconvert.__version__


def test_folders_info_and_card_carry_the_version(tmp_path):
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, embed_dim=16,
                              depth=1, num_heads=2, num_classes=3)
    folder = vitconvert.save(vitconvert.convert(model, "elu")[0], tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    assert config["vitconvert"]["versions"]["vitconvert"] == vitconvert.__version__
    assert f"vitconvert {vitconvert.__version__}" in (folder / "README.md").read_text()
    shown = runner.invoke(app, ["info", str(folder)])
    assert shown.exit_code == 0 and f"vitconvert {vitconvert.__version__}" in shown.stdout
