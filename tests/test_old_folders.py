"""Folders written by earlier vitconvert versions keep loading, with the outputs they had when written."""

from __future__ import annotations

import json
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
