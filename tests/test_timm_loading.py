"""A model folder as timm reads it: after `import vitconvert`, timm builds the linear model bit for bit as
vitconvert.load does (local-dir: and hf-hub:); without vitconvert, timm refuses and names vitconvert."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from helpers import FAMILIES, assert_one_line_error, image_batch, invoke, place_in_hub_cache, tiny_model

import vitconvert
from vitconvert.attention import VARIANTS, LinearAttention
from vitconvert.errors import VitconvertError


def saved(tmp_path: Path, family: str, variant: str) -> tuple[torch.nn.Module, Path]:
    student, _ = vitconvert.convert(tiny_model(family), variant, attn_init="copy", source=family)
    return student, vitconvert.save(student, tmp_path / f"{family}-{variant}")


def assert_same_model(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [type(m) for m in a.modules()] == [type(m) for m in b.modules()]
    with torch.no_grad():
        assert torch.equal(a.eval()(x), b.eval()(x))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_timm_local_dir_builds_the_linear_model_bit_for_bit(tmp_path, family, variant):
    student, folder = saved(tmp_path, family, variant)
    ours = vitconvert.load(folder)
    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True)
    assert all(isinstance(m.attn, LinearAttention) for m in theirs.modules() if hasattr(m, "attn"))
    assert_same_model(ours, theirs, image_batch(student))
    assert_same_model(student, theirs, image_batch(student))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_timm_keeps_pretrained_cfg_and_data_config(tmp_path, variant):
    student, folder = saved(tmp_path, "vit", variant)
    model = timm.create_model(f"local-dir:{folder}", pretrained=True)
    # the entrypoint that rebuilds it (what timm's save_for_hf writes as the architecture); the rest is the source's
    assert model.pretrained_cfg["architecture"] == f"vitconvert_{variant}"
    assert model.pretrained_cfg["tag"] == student.pretrained_cfg["tag"]
    data = timm.data.resolve_data_config({}, model=model)
    assert data == timm.data.resolve_data_config({}, model=vitconvert.load(folder))
    assert data["input_size"] == (3, 32, 32) and tuple(data["mean"]) == student.pretrained_cfg["mean"]
    timm.data.create_transform(**data)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_folder_builds_on_the_meta_device_then_loads_its_weights(tmp_path, variant):
    """How transformers and low-memory loaders build: under torch.device("meta") no value is computed (MHLA's
    distance init of W included), then to_empty + the folder's weights (+ timm's non-persistent buffers) give
    the saved model bit for bit."""
    from safetensors.torch import load_file
    from timm.models._manipulate import reinit_non_persistent_buffers

    student, folder = saved(tmp_path, "vit", variant)
    with torch.device("meta"):
        model = timm.create_model(f"local-dir:{folder}")
    assert all(t.is_meta for t in model.state_dict().values())
    model.to_empty(device="cpu")
    reinit_non_persistent_buffers(model)
    model.load_state_dict(load_file(folder / "model.safetensors"), strict=True)
    assert_same_model(student, model, image_batch(student))


def test_timm_loading_with_a_new_head_keeps_the_rest(tmp_path):
    """timm's own num_classes override works as for any timm model: everything but the classifier is loaded."""
    student, folder = saved(tmp_path, "vit", "mhla")
    model = timm.create_model(f"local-dir:{folder}", pretrained=True, num_classes=3)
    assert model.head.out_features == 3
    ref = student.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items() if not k.startswith("head."))


@pytest.mark.parametrize("variant", ["elu", "mhla"])
def test_timm_loads_at_another_image_size(tmp_path, variant):
    """timm's img_size override resamples the position embeddings as for any ViT; MHLA keeps its block counts."""
    student, _ = vitconvert.convert(tiny_model("vit", img_size=112), variant, attn_init="copy")  # 14×14 patches
    folder = vitconvert.save(student, tmp_path / "m")
    model = timm.create_model(f"local-dir:{folder}", pretrained=True, img_size=224).eval()
    assert model.pos_embed.shape[1] == 1 + 28 * 28 and model.blocks[0].attn.grid_size == (28, 28)
    if variant == "mhla":
        assert model.blocks[0].attn.block_counts == student.blocks[0].attn.block_counts == (2, 2)
    reference = student.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items() if k != "pos_embed")
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 224, 224))).all()




@pytest.mark.parametrize("variant", list(VARIANTS))
def test_timm_hf_hub_builds_the_linear_model_bit_for_bit(tmp_path, hub_cache, variant):
    student, folder = saved(tmp_path, "eva02", variant)
    place_in_hub_cache(hub_cache, f"me/eva-{variant}", folder)
    theirs = timm.create_model(f"hf-hub:me/eva-{variant}", pretrained=True)
    assert_same_model(vitconvert.load(f"hf-hub:me/eva-{variant}"), theirs, image_batch(student))


PLAIN_TIMM = """
import sys, timm
for spec in sys.argv[1:]:
    try:
        timm.create_model(spec, pretrained=True)
        print("built", file=sys.stderr)
    except Exception as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
assert "vitconvert" not in sys.modules
"""


def plain_timm(specs: list[str], env: dict[str, str]) -> list[str]:
    """What timm.create_model(spec, pretrained=True) ends with, per spec, in an interpreter without vitconvert."""
    result = subprocess.run([sys.executable, "-c", PLAIN_TIMM, *specs], capture_output=True, text=True,
                            timeout=120, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return [line for line in result.stderr.splitlines() if line == "built" or ": " in line][-len(specs):]


def test_plain_timm_refuses_and_names_vitconvert(tmp_path, hub_cache):
    """elu, relu and inline weights fit softmax attention: plain timm would build a wrong model silently.
    The control (a softmax folder saved by timm) shows the refusals are ours, not the subprocess's."""
    from timm.models import save_for_hf

    save_for_hf(tiny_model("vit"), str(tmp_path / "softmax"), safe_serialization=True)
    specs, expected = [f"local-dir:{tmp_path / 'softmax'}"], ["built"]
    for variant in VARIANTS:
        _, folder = saved(tmp_path, "vit", variant)
        place_in_hub_cache(hub_cache, f"me/{variant}", folder)
        specs += [f"local-dir:{folder}", f"hf-hub:me/{variant}"]
        expected += [f"RuntimeError: Unknown model (vitconvert_{variant})"] * 2
    assert plain_timm(specs, {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}) == expected


def test_config_names_our_entrypoint_and_the_softmax_source(tmp_path):
    _, folder = saved(tmp_path, "dinov2", "mhla")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architecture"] == "vitconvert_mhla" and cfg["vitconvert"]["format_version"] == 2
    assert cfg["model_args"]["architecture"] == "vit_small_patch14_reg4_dinov2"
    assert cfg["vitconvert"]["options"] == VARIANTS["mhla"].default_options
    # timm's model_args pin what the grid chose (a 4×4 grid, blocks of ~7 tokens: one block)
    assert cfg["model_args"]["options"] == {**VARIANTS["mhla"].default_options, "blocks_per_side": [1, 1]}
    assert "vitconvert_mhla" in timm.list_models("vitconvert_*")


def test_entrypoint_without_architecture_says_what_it_needs():
    with pytest.raises(VitconvertError, match="and no ViT was named: pass the softmax model it is built on"):
        timm.create_model("vitconvert_elu")


def test_entrypoint_builds_a_linear_model_from_scratch():
    """timm.create_model("vitconvert_<variant>", architecture=...): any supported family, geometry from the model."""
    model = timm.create_model("vitconvert_mhla", architecture="vit_small_patch14_reg4_dinov2", img_size=28,
                              patch_size=7, embed_dim=32, depth=1, num_heads=2, options={"blocks_per_side": 2})
    attn = model.blocks[0].attn
    assert attn.variant == "mhla" and attn.num_prefix_tokens == 5 and attn.grid_size == (4, 4)
    assert attn.block_counts == (2, 2) and torch.isfinite(model(torch.randn(1, 3, 28, 28))).all()


def test_features_only_from_a_folder_gives_the_loaded_models_intermediates(tmp_path):
    """The user path: a saved folder, timm's features_only (pretrained weights, chosen layers)."""
    model, folder = saved(tmp_path, "vit", "elu")
    features = timm.create_model(f"local-dir:{folder}", pretrained=True, features_only=True, out_indices=(0, 1))
    x = image_batch(model)
    want = vitconvert.load(folder).forward_intermediates(x, indices=(0, 1), intermediates_only=True)
    got = features.eval()(x)
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("variant", [*VARIANTS, "hybrid"])
def test_a_student_fine_tuned_and_saved_with_timms_save_for_hf_loads_back(tmp_path, variant):
    """What timm's train.py and push_to_hf_hub do with a loaded student: train it, save_for_hf; timm and
    vitconvert.load then build the same linear model (a softmax one would load elu/relu/inline weights silently)."""
    from timm.models import save_for_hf

    layers = [1] if variant == "hybrid" else None
    student, _ = vitconvert.convert(tiny_model("vit"), "elu" if layers else variant, attn_init="copy", layers=layers)
    model = vitconvert.load(vitconvert.save(student, tmp_path / "student")).train()
    x = image_batch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1])).backward()
        optimizer.step()
    model.eval()
    assert not torch.equal(model.blocks[1].attn.qkv.weight, student.blocks[1].attn.qkv.weight)  # it trained
    save_for_hf(model, str(tmp_path / "tuned"), safe_serialization=True)
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["architecture"].startswith("vitconvert_")
    assert_same_model(model, timm.create_model(f"local-dir:{tmp_path / 'tuned'}", pretrained=True), x)
    assert_same_model(model, vitconvert.load(tmp_path / "tuned"), x)
    convert_it = invoke("convert", tmp_path / "tuned", "--to", "elu", "--out", tmp_path / "again")
    assert_one_line_error(convert_it, "is already a linear-attention vitconvert model")  # not an internal error
    save_for_hf(student, str(tmp_path / "converted"), safe_serialization=True)  # straight from convert, too
    assert_same_model(student, timm.create_model(f"local-dir:{tmp_path / 'converted'}", pretrained=True), x)


@pytest.mark.parametrize("route", ["local-dir", "entrypoint", "attn_layer"])
def test_attention_dropout_is_refused_on_every_route(tmp_path, route):
    """Linear attention forms no attention weights to drop: attn_drop_rate is refused, never ignored."""
    _, folder = saved(tmp_path, "vit", "elu")
    name, kwargs = FAMILIES["vit"]
    build = {"local-dir": lambda: timm.create_model(f"local-dir:{folder}", pretrained=True, attn_drop_rate=0.1),
             "entrypoint": lambda: timm.create_model("vitconvert_elu", architecture=name, attn_drop_rate=0.1,
                                                     **kwargs),
             "attn_layer": lambda: timm.create_model(name, attn_layer="vitconvert_elu", attn_drop_rate=0.1,
                                                     **kwargs)}[route]
    with pytest.raises((VitconvertError, ValueError), match=r"attn_drop(_rate)?=0\.1: .*no attention weights"):
        build()
    with pytest.raises(VitconvertError, match="attn_layer='vitconvert_relu': the variant is the attention layer"):
        timm.create_model(f"local-dir:{folder}", pretrained=True, attn_layer="vitconvert_relu")
    # converting a source built with attention dropout says that it is gone
    _, report = vitconvert.convert(tiny_model("vit", attn_drop_rate=0.1), "elu")
    assert "attention dropout (p=0.1) dropped: linear attention forms no attention weights to drop" in (
        report.to_dict()["notes"])


def test_class_names_go_top_level_and_a_new_head_drops_them(tmp_path):
    """config.json repeats pretrained_cfg's label_names at the top, where transformers reads them (id2label);
    a re-headed student has other classes, so the source's names must not follow it."""
    source = tiny_model("vit", num_classes=3)
    source.pretrained_cfg = {**source.pretrained_cfg, "num_classes": 3, "label_names": ["a", "b", "c"]}
    for num_classes, labels in ((None, ["a", "b", "c"]), (2, None)):
        student, _ = vitconvert.convert(source, "elu", num_classes=num_classes)
        cfg = json.loads((vitconvert.save(student, tmp_path / f"m{num_classes}") / "config.json").read_text())
        assert cfg.get("label_names") == cfg["pretrained_cfg"].get("label_names") == labels
        assert "num_classes" not in cfg["model_args"]  # the top-level one; transformers passes its own
