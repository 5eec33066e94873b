"""Folders written by earlier vitconvert versions keep loading, with the outputs they had when written."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vitconvert

FORMAT1 = Path(__file__).parent / "fixtures" / "format1"  # written by vitconvert 0.1.0 (commit 1fc7a41)
EXPECTED = json.loads((FORMAT1 / "expected.json").read_text())


@pytest.mark.parametrize("variant", sorted(EXPECTED["logits"]))
def test_format1_folder_loads_with_its_original_outputs(variant):
    model = vitconvert.load(FORMAT1 / variant)
    assert model.blocks[0].attn.variant == variant
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(x)
    torch.testing.assert_close(logits, torch.tensor(EXPECTED["logits"][variant]), rtol=1e-5, atol=1e-6)


def test_format1_covers_every_variant():
    assert sorted(EXPECTED["logits"]) == sorted(vitconvert.VARIANTS)


FORMAT2 = Path(__file__).parent / "fixtures" / "format2"  # written just before the re-layering (commit 33842a5)
EXPECTED2 = json.loads((FORMAT2 / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED2["logits"]))
def test_folders_written_before_the_relayering_load_bitwise(name):
    """The package moved (data/, loading.py, the registry, attention ``prepare``); its folders did not: every
    stored tensor lands bit for bit, and the logits are those recorded when the folder was written (to an ulp:
    float32 sums are not bitwise the same on another CPU, e.g. AVX-512 against AVX2 kernels)."""
    model = vitconvert.load(FORMAT2 / name)
    assert model.blocks[0].attn.variant == EXPECTED2["variants"][name]
    state = model.state_dict()
    for key, tensor in load_file(FORMAT2 / name / "model.safetensors").items():
        assert torch.equal(state[key], tensor), key
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(x)
    torch.testing.assert_close(logits, torch.tensor(EXPECTED2["logits"][name]), rtol=0, atol=1e-6)


PLAIN = """
import sys, timm
for folder in sys.argv[1:]:
    try:
        timm.create_model(f"local-dir:{folder}", pretrained=True)
        print("timm: built")
    except Exception as e:
        print(f"timm: {type(e).__name__}: {e}")
    try:
        from transformers import AutoModelForImageClassification
    except ImportError:
        continue
    try:
        AutoModelForImageClassification.from_pretrained(folder)
        print("transformers: built")
    except Exception as e:
        print(f"transformers: {type(e).__name__}: {str(e).splitlines()[0]}")
assert "vitconvert" not in sys.modules
"""


def plain_readers(folders: list[Path]) -> list[str]:
    """What timm (and transformers, where installed) end with per folder, in an interpreter without vitconvert."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", PLAIN, *map(str, folders)], capture_output=True, text=True,
                            timeout=180, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def logits_of(folder: Path) -> torch.Tensor:
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return vitconvert.load(folder)(x)


def test_upgrade_makes_format1_folders_refused_by_plain_timm_and_transformers_and_keeps_their_logits(tmp_path):
    """Before: plain timm and transformers build format-1 folders as softmax models without a word (elu, relu,
    inline). After `vitconvert upgrade`: they refuse, and vitconvert.load gives the logits it gave before."""
    import importlib.util

    from helpers import invoke

    from vitconvert.folder import OldFolderWarning

    folders = []
    for variant in sorted(EXPECTED["logits"]):
        shutil.copytree(FORMAT1 / variant, tmp_path / variant)
        folders.append(tmp_path / variant)
    before = {}
    for folder in folders:
        with pytest.warns(OldFolderWarning, match=f"`vitconvert upgrade {folder}` rewrites it in place"):
            before[folder.name] = logits_of(folder)
    assert "vitconvert upgrade" in invoke("info", folders[0], env={"COLUMNS": "400"}).stdout
    with_transformers = importlib.util.find_spec("transformers") is not None
    control = shutil.copytree(FORMAT1 / "elu", tmp_path / "control" / "elu")  # not upgraded

    for folder in folders:
        result = invoke("upgrade", folder)
        assert result.exit_code == 0 and "upgraded" in result.stdout, result.output
    lines = plain_readers([control, *folders])
    assert lines[0] == "timm: built"  # the control: plain timm builds a softmax model around it, silently
    for folder in folders:
        assert f"timm: RuntimeError: Unknown model (vitconvert_{folder.name})" in lines
        if with_transformers:
            assert (f"transformers: ImportError: The model architecture 'vitconvert_{folder.name}' is not supported "
                    "in your version of timm") in " ".join(lines)
        with warnings.catch_warnings():
            warnings.simplefilter("error", OldFolderWarning)  # today's layout: no notice
            assert torch.equal(logits_of(folder), before[folder.name])
        config = json.loads((folder / "config.json").read_text())
        assert config["vitconvert"]["upgraded_from"] == {"format_version": 1, "versions": EXPECTED_VERSIONS}
        assert json.loads(invoke("upgrade", folder, "--json").stdout)["upgraded"] is False


EXPECTED_VERSIONS = {"vitconvert": "0.1.0", "timm": "1.0.31", "torch": "2.14.1", "safetensors": "0.8.0"}


def test_upgrade_of_a_format2_folder_keeps_weights_other_files_and_an_edited_card(tmp_path):
    """A folder written before transformers support (num_classes in model_args): same tensors, same logits; what
    is not ours stays; a card the user took over (no generated-card marker) stays theirs."""
    from safetensors.torch import load_file

    from vitconvert.folder_upgrade import upgrade_folder

    folder = tmp_path / "elu"
    shutil.copytree(FORMAT2 / "elu", folder)
    (folder / "README.md").write_text("# my own card\n")
    (folder / "notes.txt").write_text("mine\n")
    with pytest.warns(UserWarning, match="transformers cannot load it"):
        before = logits_of(folder)
    assert upgrade_folder(folder)["format_version"] == 2
    old, new = load_file(str(FORMAT2 / "elu" / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    assert (folder / "README.md").read_text() == "# my own card\n" and (folder / "notes.txt").read_text() == "mine\n"
    config = json.loads((folder / "config.json").read_text())
    assert "num_classes" not in config["model_args"] and config["num_classes"] == 3
    assert torch.equal(logits_of(folder), before)
    assert upgrade_folder(folder) is None and not list(tmp_path.glob(".elu*"))  # nothing left behind
