"""model.safetensors as vitconvert writes it: a valid safetensors file (safetensors, timm read it), every tensor that
can be starting on a 64-byte boundary of the file (read from the header with struct and json, not our code), the
mark in the metadata, and all of it in one write."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import timm
import torch
from helpers import invoke, tiny_model
from safetensors import safe_open
from safetensors.torch import load_file

import vitconvert
from vitconvert.attention import VARIANTS
from vitconvert.weights_file import read_mark, write_weights


def file_offsets(path: Path) -> dict[str, int]:
    """Each tensor's first byte in the file, as the format defines it: 8 + header length + its data offset."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    return {k: 8 + length + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def test_every_dtype_and_size_reads_back_and_whole_sizes_are_aligned(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"odd.bias": torch.randn(3, generator=g), "w": torch.randn(16, 8, generator=g),
             "odd.weight": torch.randn(3, 5, generator=g), "half": torch.randn(32, generator=g).half(),
             "bf": torch.randn(4, 8, generator=g).bfloat16(), "ids": torch.arange(7), "flag": torch.tensor([True]),
             "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "view": torch.randn(8, 8, generator=g).t()}
    path = tmp_path / "w.safetensors"
    write_weights(path, state, {"note": "x"})
    back = load_file(str(path))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == {"format": "pt", "note": "x"}
    offsets = file_offsets(path)
    whole = [k for k, t in state.items() if t.numel() * t.element_size() % 64 == 0]
    assert all(offsets[k] % 64 == 0 for k in whole)
    assert offsets["odd.weight"] % 64 == 0  # the first tensor of an odd size: matrices go first


@pytest.mark.parametrize("case", [*VARIANTS, "hybrid"])
def test_a_saved_folder_has_every_tensor_aligned_and_marked_in_one_write(tmp_path, case, monkeypatch):
    """A tiny ViT's one tensor of an odd size (the 3-class head bias) goes last: every tensor starts aligned
    (MHLA's 1×1 block mixing at this size is a second odd one, so there every tensor of a whole size is checked);
    timm's own save (safetensors' save_file) is never called: the weights are written once, mark and all."""
    import safetensors.torch

    variant, layers = ("elu", [1]) if case == "hybrid" else (case, None)
    student, _ = vitconvert.convert(tiny_model("vit", num_classes=3), variant, attn_init="copy", layers=layers)

    def second_write(*args, **kwargs):
        raise AssertionError("the weights are written twice")

    monkeypatch.setattr(safetensors.torch, "save_file", second_write)
    folder = vitconvert.save(student, tmp_path / "m")
    path = folder / "model.safetensors"
    state = load_file(str(path))
    offsets = file_offsets(path)
    odd = [k for k, t in state.items() if t.numel() * t.element_size() % 64]
    checked = state.keys() if len(odd) <= 1 else [k for k in state if k not in odd]
    assert [k for k in checked if offsets[k] % 64] == []
    assert all(torch.equal(v, student.state_dict()[k]) for k, v in state.items())
    mark = read_mark(path)
    assert (mark.variant, mark.layers) == (variant, layers or [0, 1])
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(timm.create_model(f"local-dir:{folder}", pretrained=True).eval()(x), student(x))


# -- the mark, checked by every load path ---------------------------------------------------------------------
def relu(config: dict) -> None:
    config["architecture"] = "vitconvert_relu"
    config["vitconvert"]["variant"] = "relu"


def layers(value) -> callable:
    def edit(config: dict) -> None:
        config["model_args"]["layers"] = value
    return edit


def unmark(folder: Path) -> None:
    """Re-save the weights as another program would: the same tensors, no vitconvert metadata."""
    from safetensors.torch import save_file

    save_file(load_file(str(folder / "model.safetensors")), str(folder / "model.safetensors"),
              metadata={"format": "pt"})


# edit -> (config.json change, weights re-saved without the mark, what vitconvert.load says, what timm's route says)
EDITS = {
    "elu to relu": (relu, False, "holds elu attention weights", "hold elu attention in layers [0, 1]"),
    "architecture only to relu": (lambda c: c.update(architecture="vitconvert_relu"), False,
                                  "block names elu attention, its architecture builds relu", "hold elu attention"),
    "layers []": (layers([]), False, "an empty layer list", "an empty layer list"),
    "layers '1-3'": (layers("1-3"), False, "must be a list of layer indices (got '1-3')", "list of layer indices"),
    "a subset": (layers([1]), False, "block makes layers [0, 1] linear, its model_args [1]",
                 "hold elu attention in layers [0, 1]"),
    "a subset, weights unmarked": (layers([1]), True, "its model_args [1]", "vitconvert block says the weights hold "
                                                                           "elu attention in layers [0, 1]"),
    "elu to relu, weights unmarked": (lambda c: c.update(architecture="vitconvert_relu"), True, "builds relu",
                                      "vitconvert block says the weights hold elu"),
}


def edited_folder(tmp_path: Path, edit: str) -> Path:
    student, _ = vitconvert.convert(tiny_model("vit", num_classes=3), "elu", attn_init="copy")
    folder = vitconvert.save(student, tmp_path / "m")
    change, unmarked, _, _ = EDITS[edit]
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    if unmarked:
        unmark(folder)
    return folder


@pytest.mark.parametrize("edit", list(EDITS))
def test_load_and_timm_refuse_a_config_that_disagrees_with_the_weights(tmp_path, edit):
    folder = edited_folder(tmp_path, edit)
    _, _, by_load, by_timm = EDITS[edit]
    with pytest.raises(vitconvert.errors.VitconvertError, match=re.escape(by_load)) as e:
        vitconvert.load(folder)
    assert "\n" not in str(e.value)
    with pytest.raises(vitconvert.errors.VitconvertError, match=re.escape(by_timm)) as e:
        timm.create_model(f"local-dir:{folder}", pretrained=True)
    assert "\n" not in str(e.value)


def test_weights_resaved_without_the_mark_still_load_when_the_config_agrees(tmp_path):
    student, _ = vitconvert.convert(tiny_model("vit", num_classes=3), "elu", attn_init="copy", layers=[1])
    folder = vitconvert.save(student, tmp_path / "m")
    unmark(folder)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(vitconvert.load(folder)(x), student(x))
        assert torch.equal(timm.create_model(f"local-dir:{folder}", pretrained=True).eval()(x), student(x))


def test_a_students_weights_are_refused_as_a_softmax_source_and_teacher(tmp_path):
    """`convert WEIGHTS --arch` (typer's runner: the command's own exit code and stderr), a softmax config.json
    beside a student's weights, and compare's teacher: the attention weights fit softmax modules, the mark says
    what they are."""
    student, _ = vitconvert.convert(tiny_model("vit", num_classes=3), "elu", attn_init="copy")
    folder = vitconvert.save(student, tmp_path / "m")
    run = invoke("convert", folder / "model.safetensors", "--arch", "vit_tiny_patch16_224", "--to", "relu", "--out",
                 tmp_path / "o")
    assert run.exit_code == 1 and not (tmp_path / "o").exists()
    assert run.stderr.strip().splitlines() == [f"error: {folder / 'model.safetensors'} holds vitconvert's elu linear "
                                               "attention in layers [0, 1] (a converted model), not a softmax "
                                               "model's weights: give the softmax ViT it was converted from"]
    disguised = tmp_path / "disguised"
    timm.models.save_for_hf(tiny_model("vit", num_classes=3), str(disguised), safe_serialization=True)
    (disguised / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    from vitconvert.loading import load_teacher
    from vitconvert.sources import load_source

    with pytest.raises(vitconvert.errors.VitconvertError, match="holds vitconvert's elu linear attention"):
        load_source(str(disguised))
    with pytest.raises(vitconvert.errors.VitconvertError, match="holds vitconvert's elu linear attention"):
        load_teacher(str(disguised), vitconvert.load(folder), seed=0, recorded=False)


@pytest.mark.parametrize("where", ["local-dir", "hf-hub"])
def test_a_pickled_checkpoint_is_checked_against_the_config_as_unmarked_weights_are(tmp_path, where, monkeypatch):
    """A vitconvert folder whose weights are timm's pickle (pytorch_model.bin, read weights_only: no metadata, so
    no mark): timm loaded it into whatever config.json's architecture said; the vitconvert block beside it says
    what the weights were saved as, locally and from the Hub cache (one lookup: hub_io.cached_weights)."""
    from helpers import place_in_hub_cache

    from vitconvert.hub_io import cached_weights

    student, _ = vitconvert.convert(tiny_model("vit", num_classes=3), "elu", attn_init="copy")
    folder = vitconvert.save(student, tmp_path / "m")
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    spec = f"local-dir:{folder}"
    if where == "hf-hub":
        place_in_hub_cache(tmp_path / "hub", "me/pickled", folder)
        import huggingface_hub.constants as hub_constants

        monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
        assert [p.name for p in cached_weights("hf-hub:me/pickled")] == ["pytorch_model.bin"]
        spec = "hf-hub:me/pickled"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():  # as saved: it loads, the same model, through timm and vitconvert.load
        assert torch.equal(timm.create_model(spec, pretrained=True).eval()(x), student.eval()(x))
        assert torch.equal(vitconvert.load(spec)(x), student(x))
    config = json.loads((folder / "config.json").read_text())
    config["architecture"] = "vitconvert_relu"
    if where == "hf-hub":
        shutil.rmtree(tmp_path / "hub")
        (folder / "config.json").write_text(json.dumps(config))
        place_in_hub_cache(tmp_path / "hub", "me/pickled", folder)
    else:
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(vitconvert.errors.VitconvertError, match="vitconvert block says the weights hold elu") as e:
        timm.create_model(spec, pretrained=True)
    assert "\n" not in str(e.value)
    with pytest.raises(vitconvert.errors.VitconvertError, match="block names elu attention, its architecture builds"):
        vitconvert.load(spec)
