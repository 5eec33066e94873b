"""vitconvert's eval preprocessing is timm's: for every pretrained tag timm lists whose preprocessing the old
hand-built config got wrong (crop_mode "squash", a non-square input_size), `input_config` equals
`timm.data.resolve_model_data_config` and `eval_transform` turns an image into the tensor timm's
`create_transform` gives. ViT-family tags are built (tiny, `pretrained=False`: their pretrained_cfg is timm's,
no download); the others, which vitconvert does not convert, are a module carrying the tag's pretrained_cfg."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_model_data_config
from timm.models import get_pretrained_cfg
from torch import nn

import vitconvert
from vitconvert.card import facts
from vitconvert.data import eval_transform, input_config
from vitconvert.surgery import find_softmax_attention


def odd_tags() -> list[str]:
    """Every tag whose crop_mode is squash or whose input_size is not square."""
    found = []
    for tag in timm.list_pretrained():
        cfg = get_pretrained_cfg(tag).to_dict()
        if cfg.get("crop_mode") == "squash" or cfg["input_size"][1] != cfg["input_size"][2]:
            found.append(tag)
    return found


TAGS = odd_tags()
VIT_FAMILIES = ("vit", "eva", "deit", "beit")
# small enough to build in a tenth of a second; sapiens2 needs one kv head count per block
TINY = dict(embed_dim=32, num_heads=2, depth=1, mlp_ratio=1)
SAPIENS = dict(num_kv_heads=2)


def model_for(tag: str) -> nn.Module:
    if tag.startswith(VIT_FAMILIES):
        return timm.create_model(tag, pretrained=False, **TINY, **(SAPIENS if "sapiens" in tag else {}))
    stub = nn.Module()
    stub.pretrained_cfg = get_pretrained_cfg(tag).to_dict()
    return stub


def tuples(config: dict) -> dict:
    """timm's config with its lists (a folder's JSON) as tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}


def an_image() -> Image.Image:
    """Not square, so that squash and centre crop give different pixels."""
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 130, 3), dtype=np.uint8))


def test_the_tags_cover_squash_and_non_square_vits():
    assert len(TAGS) > 100  # 131 in timm 1.0.31
    assert any(t.startswith("eva02") for t in TAGS) and any("sapiens" in t for t in TAGS)
    assert any(get_pretrained_cfg(t).input_size[1] != get_pretrained_cfg(t).input_size[2] for t in TAGS)


@pytest.mark.parametrize("tag", TAGS)
def test_eval_preprocessing_is_timms_for_the_tag(tag):
    model = model_for(tag)
    timm_config = resolve_model_data_config(model)
    ours = input_config(model)
    assert ours.timm_config() == tuples(timm_config)
    image = an_image()
    expected = create_transform(**timm_config, is_training=False)(image)
    got = eval_transform(ours)(image)
    assert got.shape == expected.shape == (3, *timm_config["input_size"][1:])
    assert torch.equal(got, expected)


def test_a_converted_squash_model_keeps_its_preprocessing_in_the_folder_and_the_card(tmp_path):
    """eva02 at 448 px squashes; the folder vitconvert writes says so to vitconvert, timm and the card."""
    tag = "eva02_base_patch14_448.mim_in22k_ft_in22k_in1k"
    source = timm.create_model(tag, pretrained=False, **TINY)
    assert source.pretrained_cfg["crop_mode"] == "squash" and find_softmax_attention(source)
    student, _ = vitconvert.convert(source, "elu", attn_init="copy")
    folder = vitconvert.save(student, tmp_path / "m")
    loaded = vitconvert.load(folder)
    assert input_config(loaded).crop_mode == "squash"
    assert input_config(loaded).timm_config() == tuples(resolve_model_data_config(loaded))
    import json

    card_line = next(line for line in facts(json.loads((folder / "config.json").read_text())).splitlines()
                     if "preprocessing" in line)
    assert "squash" in card_line and "crop 1.0" in card_line


def test_the_recipe_overrides_what_it_sets_and_keeps_the_crop_mode():
    from vitconvert.recipes import build_recipe

    model = model_for("eva02_base_patch14_448.mim_in22k_ft_in22k_in1k")
    inp = input_config(model, build_recipe(dict(img_size=224, crop_pct=0.875)))
    assert (inp.input_size, inp.crop_pct, inp.crop_mode, inp.interpolation) == ((3, 224, 224), 0.875, "squash",
                                                                                 "bicubic")
    assert inp.mean == tuple(model.pretrained_cfg["mean"])


def test_a_model_built_at_another_size_is_fed_that_size():
    """timm's config names the pretrained_cfg's 224 px; a model built with img_size=32 takes only 32 px."""
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, **TINY)
    inp = input_config(model)
    assert inp.input_size == (3, 32, 32)
    assert eval_transform(inp)(an_image()).shape == (3, 32, 32)
