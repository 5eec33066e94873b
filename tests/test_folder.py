"""The model folder: atomic save, strict load, bit-exact round trip for every variant, Hub-cache loading."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from helpers import image_batch, place_in_hub_cache, tiny_model

import vitconvert
from vitconvert.attention import VARIANTS
from vitconvert.errors import VitconvertError


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_load_round_trip_bit_exact(tmp_path, variant):
    student, _ = vitconvert.convert(tiny_model("vit"), variant, source="vit_tiny")
    vitconvert.save(student, tmp_path / "m")
    loaded = vitconvert.load(tmp_path / "m")
    a, b = student.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = image_batch(student)
    assert torch.equal(student.eval()(x), loaded(x))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["vitconvert"]["variant"] == variant and cfg["architecture"] == f"vitconvert_{variant}"
    assert cfg["model_args"]["architecture"] == "vit_tiny_patch16_224"  # the softmax source, for our entrypoint
    assert cfg["vitconvert"]["groups"] and cfg["vitconvert"]["versions"]["timm"]
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_variant_options_survive_round_trip(tmp_path):
    student, _ = vitconvert.convert(tiny_model("vit"), "inline", options={"local_residual": True})
    vitconvert.save(student, tmp_path / "m")
    loaded = vitconvert.load(tmp_path / "m")
    assert loaded.blocks[0].attn.options["local_residual"] is True


@pytest.mark.parametrize("family", ["eva02", "beit", "deit_distilled", "naflex"])
def test_round_trip_other_families(tmp_path, family):
    student, _ = vitconvert.convert(tiny_model(family), "elu")
    vitconvert.save(student, tmp_path / family)
    loaded = vitconvert.load(tmp_path / family)
    x = image_batch(student)
    assert torch.equal(student.eval()(x), loaded(x))


def test_save_never_overwrites_without_force(tmp_path):
    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    out = tmp_path / "m"
    vitconvert.save(student, out)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(VitconvertError, match="use force=True"):  # a Python caller reads the argument
        vitconvert.save(student, out)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    vitconvert.save(student, out, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary siblings left


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import vitconvert.folder as folder

    student, _ = vitconvert.convert(tiny_model("vit"), "elu")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(folder, "render_card", broken, raising=False)
    monkeypatch.setattr("vitconvert.folder.render_card", broken)
    with pytest.raises(VitconvertError, match="cannot write .*disk full"):  # one line for the user
        vitconvert.save(student, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_load_refuses_mismatched_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    vitconvert.save(student, tmp_path / "m")
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    state.pop("head.bias")
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(VitconvertError, match="does not fit"):
        vitconvert.load(tmp_path / "m")


def test_load_refuses_truncated_weights(tmp_path):
    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    vitconvert.save(student, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(VitconvertError, match="corrupt or truncated"):
        vitconvert.load(tmp_path / "m")


def test_load_from_offline_hub_cache(tmp_path, monkeypatch):
    student, _ = vitconvert.convert(tiny_model("vit"), "ttt")
    vitconvert.save(student, tmp_path / "m")
    cache = tmp_path / "cache"
    place_in_hub_cache(cache, "me/vit-ttt", tmp_path / "m")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    loaded = vitconvert.load("hf-hub:me/vit-ttt")
    x = image_batch(student)
    assert torch.equal(student.eval()(x), loaded(x))
    with pytest.raises(VitconvertError, match="Hub"):
        vitconvert.load("hf-hub:me/vit-ttt@nope")
    with pytest.raises(VitconvertError, match="invalid Hub id"):
        vitconvert.load("hf-hub:not a/valid//id")


def test_option_values_normalised_by_the_variant_load_back(tmp_path):
    """MHLA stores blocks_per_side=2 as [2, 2]; the folder check must accept what the variant itself wrote."""
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=16,
                              depth=1, num_heads=2, num_classes=3)
    student, _ = vitconvert.convert(model, "mhla", options={"blocks_per_side": 2})
    resaved = vitconvert.save(vitconvert.load(vitconvert.save(student, tmp_path / "m")), tmp_path / "again")
    assert json.loads((resaved / "config.json").read_text())["vitconvert"]["options"]["blocks_per_side"] == [2, 2]
    x = torch.randn(1, 3, 16, 16)
    assert torch.equal(vitconvert.load(resaved).eval()(x), student.eval()(x))
