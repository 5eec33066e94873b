"""The model card: Hub metadata that huggingface_hub parses, every section present when its data is."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from helpers import tiny_model
from huggingface_hub import ModelCard, ModelCardData

import vitconvert
from vitconvert.attention import VARIANTS
from vitconvert.card import CARD_MARKER, MIMETIC_BIBTEX, base_model, render_card

RECIPE = {"data": {"dataset": "torch/cifar100", "img_size": 32}, "optim": {"name": "adamw", "lr": 0.002},
          "epochs": 300, "distill": {"loss": "mse", "weight": 1.0}}
METRICS = {"top1": 81.25, "top5": 95.5, "loss": 0.91, "epochs": 300}


def converted_config(variant: str = "elu", **meta) -> dict:
    """config.json of a converted tiny model, as folder.py writes it."""
    import json
    import tempfile
    from pathlib import Path

    student, _ = vitconvert.convert(tiny_model("vit"), variant, source="vit_tiny")
    with tempfile.TemporaryDirectory() as tmp:
        vitconvert.save(student, Path(tmp) / "m", **meta)
        return json.loads((Path(tmp) / "m" / "config.json").read_text())


@pytest.fixture(scope="module")
def config() -> dict:
    return converted_config("mhla", pretrained=True)


def trained(config: dict) -> dict:
    cfg = copy.deepcopy(config)
    cfg["vitconvert"].update(recipe=RECIPE, metrics=METRICS, teacher="deit_small",
                             lineage=[{"step": "distill", "epochs": 300, "teacher": "deit_small"}],
                             compare=[{"layer": 0, "mse": 0.012, "cosine": 0.98}, {"layer": 1, "mse": 0.02}])
    return cfg


def test_metadata_parses_with_huggingface_hub(config):
    text = render_card(config, repo_id="me/x")
    card = ModelCard(text)
    assert isinstance(card.data, ModelCardData)
    data = card.data.to_dict()
    assert data["library_name"] == "timm" and data["pipeline_tag"] == "image-classification"
    assert data["tags"] == ["vitconvert", "linear-attention", "mhla", "image-classification"]
    assert data["license"] == "apache-2.0"  # inherited from the source's pretrained_cfg
    assert data["base_model"] == "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # timm's hf_hub_id of the tag
    assert "model-index" not in data and "datasets" not in data  # nothing measured yet
    assert ModelCardData(**yaml.safe_load(text.split("---")[1]), ignore_metadata_errors=False)


def test_trained_card_has_datasets_and_model_index(config):
    card = ModelCard(render_card(trained(config), repo_id="me/x"))
    assert card.data.datasets == ["uoft-cs/cifar100"]
    assert card.data.model_name == "x"
    results = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert results == {"Top-1 accuracy": 81.25, "Top-5 accuracy": 95.5}
    assert card.data.eval_results[0].dataset_type == "uoft-cs/cifar100"


def test_sections_in_order_and_recipe_verbatim(config):
    text = render_card(trained(config), repo_id="me/x")
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings == ["How to use", "Conversion report", "Per-layer comparison with the teacher",
                        "Training recipe", "Results", "Lineage", "Citation"]
    recipe_block = text.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(recipe_block) == RECIPE
    assert "| top1 | 81.25 |" in text and "| epochs | 300 |" in text
    assert "| 0 | 0.012 | 0.98 |" in text and "| 1 | 0.02 |  |" in text
    lineage = text.split("## Lineage")[1].split("##")[0]
    assert lineage.index("**source**") < lineage.index("**convert**") < lineage.index("**distill**")
    assert lineage.count("**distill**") == 1 and "teacher deit_small" in lineage
    assert "not yet trained" not in text


def test_converted_card_says_untrained_and_reports_groups(config):
    text = render_card(config)
    assert CARD_MARKER in text and "Converted, not yet trained" in text
    assert 'vitconvert.load("hf-hub:ORG/NAME")' in text  # placeholder until push knows the repo
    for row in config["vitconvert"]["groups"]:
        assert f"| {row['group']} | {row['action']} | {row['tensors']} | {row['params']:,} |" in text
    assert "**total**" in text and "## Training recipe" not in text and "## Results" not in text


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_citations_name_the_paper_and_the_variant(variant):
    text = render_card(converted_config(variant))
    assert "Copy the Same, Distill the Difference" in text.split("## Citation")[1]
    bibtex = VARIANTS[variant].bibtex
    assert bibtex and bibtex in text and MIMETIC_BIBTEX in text  # default attention init is mimetic
    assert ModelCard(text).data.tags[2] == variant


def test_mimetic_cited_only_when_used(config):
    cfg = copy.deepcopy(config)
    cfg["vitconvert"]["init"]["attn"] = "copy"
    assert MIMETIC_BIBTEX not in render_card(cfg)


@pytest.mark.parametrize("source,pretrained,expected", [
    ("hf-hub:facebook/deit-small@v2", True, "facebook/deit-small"),
    ("vit_tiny", True, "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"),
    ("vit_tiny", False, None),  # random weights: nothing to derive from
    ("./my_folder", True, None),  # a local folder has no Hub id
    ("weights/model.safetensors", True, None),
    ("digits", True, None),  # a bundled model, not a timm name
    ("hf-hub:not a/valid id", True, None),  # a hand-edited config.json: no base model, and the card still renders
])
def test_base_model(config, source, pretrained, expected):
    cfg = copy.deepcopy(config)
    cfg["vitconvert"].update(source=source, pretrained=pretrained)
    assert base_model(cfg) == expected
    assert ModelCard(render_card(cfg)).data.base_model == expected


def test_hub_dataset_ids_pass_through_and_unknown_names_stay(config):
    cfg = trained(config)
    cfg["vitconvert"]["recipe"] = {"data": {"dataset": "hfds/timm/oxford-iiit-pet"}}
    assert ModelCard(render_card(cfg)).data.datasets == ["timm/oxford-iiit-pet"]
    cfg["vitconvert"]["recipe"] = {"dataset": "my_private_set"}
    assert ModelCard(render_card(cfg)).data.datasets == ["my_private_set"]
    cfg["vitconvert"]["recipe"] = {"dataset": {"data": "hfds/timm/oxford-iiit-pet"}}  # a recipe in sections
    assert ModelCard(render_card(cfg)).data.datasets == ["timm/oxford-iiit-pet"]


def test_card_of_a_distill_run_as_the_trainer_writes_it(config):
    """Flat recipe (``data: <name or path>``), metrics in percent, the teacher's SOURCE, a compare report."""
    cfg = copy.deepcopy(config)
    cfg["vitconvert"].update(
        recipe={"name": "in1k", "data": "/datasets/imagenet/", "epochs": 300, "lr": 0.004},
        metrics={"dataset": "imagenet", "split": "validation", "top1": 72.31, "top5": 91.02, "loss": 1.1,
                 "epochs": 300, "best_top1": 72.4, "best_epoch": 296},
        teacher="deit_tiny",
        compare={"layers": [{"layer": 0, "attn_mse": 0.5, "attn_cos": 0.9, "block_cos": 0.99}],
                 "top1_agreement": 0.93, "logit_kl": None, "images": 64})
    text = render_card(cfg, repo_id="me/deit_tiny-mhla")
    card = ModelCard(text)
    assert card.data.datasets == ["ILSVRC/imagenet-1k"]  # the image folder's name, mapped to the Hub dataset
    assert card.data.eval_results[0].metric_value == 72.31
    assert "| 0 | 0.5 | 0.9 | 0.99 |" in text and "top1 agreement: 0.93" in text and "logit kl" not in text
    assert "**distill**: teacher deit_tiny, epochs 300" in text and "| best_epoch | 296 |" in text


def run_card_snippet(text: str, workdir, monkeypatch) -> dict:
    """Execute the card's "How to use" code as shown, in ``workdir`` with the image.jpg it opens."""
    import numpy as np
    from PIL import Image

    code = text.split("## How to use")[1].split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(workdir)
    pixels = np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    Image.fromarray(pixels).save("image.jpg")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    return scope




@pytest.mark.parametrize("variant", ["elu", "mhla"])
def test_card_snippet_runs_as_shown_and_gives_the_vitconvert_model(tmp_path, hub_cache, monkeypatch, variant):
    import json

    import torch
    from helpers import place_in_hub_cache

    student, _ = vitconvert.convert(tiny_model("vit"), variant, source="vit_tiny")
    folder = vitconvert.save(student, tmp_path / "m")
    place_in_hub_cache(hub_cache, "me/x", folder)
    text = render_card(json.loads((folder / "config.json").read_text()), repo_id="me/x")
    assert "timm.create_model(\"hf-hub:me/x\", pretrained=True)" in text and "import vitconvert" in text
    assert f"Unknown model (vitconvert_{variant})" in text  # what plain timm says (tests/test_timm_loading.py)
    # ... and what transformers says without vitconvert (tests/test_old_folders.py), with the fix beside it
    assert f"The model architecture 'vitconvert_{variant}' is not supported in your version of timm" in text
    assert "`pip install vitconvert` and `import vitconvert`, not a newer timm" in text
    scope = run_card_snippet(text, tmp_path, monkeypatch)
    reference = vitconvert.load("hf-hub:me/x")
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in scope["model"].state_dict().items())
    with torch.no_grad():
        expected = reference(scope["transform"](scope["image"]).unsqueeze(0)).softmax(dim=-1).topk(5)
    assert torch.equal(scope["top5"].indices, expected.indices) and torch.equal(scope["top5"].values, expected.values)


def test_card_of_a_format1_folder_says_vitconvert_load(tmp_path, hub_cache, monkeypatch):
    """A folder written by vitconvert 0.1 names the softmax architecture: its card must not offer timm."""
    import json
    from pathlib import Path

    from helpers import place_in_hub_cache

    folder = Path(__file__).parent / "fixtures" / "format1" / "elu"
    place_in_hub_cache(hub_cache, "me/old", folder)
    text = render_card(json.loads((folder / "config.json").read_text()), repo_id="me/old")
    assert "timm.create_model" not in text.split("## How to use")[1].split("```")[1]
    assert "`vitconvert upgrade FOLDER` rewrites a downloaded copy" in text
    scope = run_card_snippet(text, tmp_path, monkeypatch)
    assert scope["model"].blocks[0].attn.variant == "elu"


def test_card_invents_no_links(config, monkeypatch):
    import importlib.metadata

    from vitconvert import card

    text = render_card(config)
    links = re.findall(r"\]\((https?://[^)]+)\)", text)
    assert all(link.startswith("https://huggingface.co/") for link in links), links
    assert "github.com/vitconvert" not in text and "the `vitconvert` Python package" in text

    class Metadata:
        def get_all(self, name):
            return ["Repository, https://example.org/vitconvert"] if name == "Project-URL" else None

    monkeypatch.setattr(importlib.metadata, "metadata", lambda name: Metadata())
    assert card.package_link() == "[vitconvert](https://example.org/vitconvert)"  # only a declared URL is linked


def test_a_headless_models_card_says_it_is_an_image_encoder(tmp_path, hub_cache, monkeypatch):
    """num_classes 0 (EVA-02's MIM tags): feature extraction, not classification, in the metadata and the snippet,
    which runs as shown and gives vitconvert.load's features; no scores are claimed for it."""
    import json

    import torch
    from helpers import place_in_hub_cache

    student, _ = vitconvert.convert(tiny_model("vit", num_classes=0), "elu", source="vit_tiny")
    folder = vitconvert.save(student, tmp_path / "m")
    place_in_hub_cache(hub_cache, "me/enc", folder)
    config = json.loads((folder / "config.json").read_text())
    config["vitconvert"].update(metrics={"top1": 50.0}, recipe={"data": "torch/cifar10"})
    text = render_card(config, repo_id="me/enc")
    data = ModelCard(text).data
    assert data.pipeline_tag == "image-feature-extraction" and data.tags[-1] == "image-feature-extraction"
    assert data.eval_results is None and "image-classification" not in text
    assert "no classification head" in text and "| classes | none: an image encoder, 32 features out" in text
    assert 'pipeline("image-feature-extraction", model="me/enc", pool=True)' in text
    scope = run_card_snippet(text, tmp_path, monkeypatch)
    reference = vitconvert.load("hf-hub:me/enc")
    with torch.no_grad():
        assert torch.equal(scope["features"], reference(scope["transform"](scope["image"]).unsqueeze(0)))
    assert scope["features"].shape == (1, 32)


def test_a_one_layer_hybrid_counts_one_layer():
    """The card of a model converted with one linear layer says "1 layer", as a sentence does."""
    student, _ = vitconvert.convert(tiny_model("vit"), "elu", source="vit_tiny", layers=[0])
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        folder = vitconvert.save(student, Path(tmp) / "m")
        text = (folder / "README.md").read_text()
        assert json.loads((folder / "config.json").read_text())["vitconvert"]["layers"] == [0]
    assert "linear attention in 1 layer" in text and "1 layers" not in text


def test_the_card_names_local_paths_and_never_shows_them(config):
    """A local source, teacher and data are recorded as paths (the tools need them); the card is read elsewhere, so
    it shows their names, and a Hub-cache snapshot as the repo it is of (its base model, linked)."""
    cfg = trained(config)
    block = cfg["vitconvert"]
    block.update(source="/home/alice/secret-project/src", teacher="/home/alice/secret-project/teacher",
                 recipe={**RECIPE, "data": {"dataset": "/home/alice/secret-project/images"}})
    text = render_card(cfg)
    assert "secret-project" not in text and "/home/alice" not in text
    assert "| source | `src (local)` |" in text and "softmax teacher `teacher (local)`" in text
    assert ModelCard(text).data.datasets == ["images"]
    block["source"] = "/home/alice/.cache/huggingface/hub/models--timm--vit_tiny_patch16_224.augreg_in21k/snapshots/0a1"
    assert base_model(cfg) == "timm/vit_tiny_patch16_224.augreg_in21k"
    assert "(https://huggingface.co/timm/vit_tiny_patch16_224.augreg_in21k)" in render_card(cfg)
