"""docs/architecture.md's recipe for a sixth variant, followed to the letter: one class with
``@register_variant`` (in the package it would be ``attention/softplus.py`` plus one import line in
``attention/__init__.py``). Nothing else is edited, yet every layer above picks it up: convert, the model
folder, load, timm's entrypoints and attn_layer names, the CLI's list and convert, the quickstart's plan."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from helpers import image_batch, invoke, tiny_model
from torch.nn import functional as F

import vitconvert
from vitconvert.attention import register_variant, unregister_variant
from vitconvert.attention.base import LinearAttention
from vitconvert.attention.kernel import kernel_attention
from vitconvert.attention.ops.linear.reference import kernel_attention_reference
from vitconvert.attention.options import Option, number, positive
from vitconvert.quickstart import parse_variants


class SoftplusAttention(LinearAttention):
    """φ(x) = softplus(x): a smooth positive kernel (a toy sixth variant)."""

    variant = "softplus"
    paper = "a toy variant of tests/test_new_variant.py"

    declared_options = (Option("eps", 1e-6, "added to the normaliser", number, positive),)

    def __init__(self, dim: int, num_heads: int = 8, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.eps: float = self.options["eps"]

    def mix(self, q, k, v, key_valid, grid, extra=None):
        return kernel_attention(F.softplus(q), F.softplus(k), v, key_valid, self.eps)

    def reference(self, q, k, v, key_valid, grid):
        return kernel_attention_reference(F.softplus(q), F.softplus(k), v, key_valid, self.eps)


@pytest.fixture
def softplus():
    register_variant(SoftplusAttention)
    yield SoftplusAttention
    unregister_variant("softplus")


def test_a_registered_variant_flows_through_every_layer(softplus, tmp_path):
    assert list(vitconvert.VARIANTS)[-1] == "softplus"
    teacher = tiny_model("vit")
    student, report = vitconvert.convert(teacher, "softplus", seed=0)
    x = image_batch(teacher)
    folder = vitconvert.save(student, tmp_path / "m")
    loaded = vitconvert.load(folder)
    assert type(loaded.blocks[0].attn).__name__ == "SoftplusAttention"
    assert torch.equal(loaded(x), student.eval()(x))
    assert torch.equal(timm.create_model(f"local-dir:{folder}", pretrained=True).eval()(x), loaded(x))
    scratch = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                                embed_dim=32, num_heads=2, attn_layer="vitconvert_softplus")
    assert isinstance(scratch.blocks[0].attn, SoftplusAttention)
    listed = json.loads(invoke("list", "--json").stdout)["variants"]
    assert listed["softplus"] == {"eps": 1e-6}
    assert parse_variants("elu,softplus") == ["elu", "softplus"]


def test_the_cli_converts_to_it(softplus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", "digits", "--to", "softplus", "--out", "s", "--option", "eps=1e-5")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["architecture"] == "vitconvert_softplus" and config["vitconvert"]["options"] == {"eps": 1e-5}
    refused = invoke("convert", "digits", "--to", "softplus", "--out", "t", "--option", "eps=0")
    assert refused.exit_code != 0 and "softplus's eps must be positive" in refused.stderr


def test_unregistered_it_is_refused_with_the_valid_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", "digits", "--to", "softplus", "--out", "s")
    assert result.exit_code != 0 and "unknown variant 'softplus'" in result.stderr
    assert ", ".join(vitconvert.VARIANTS) in result.stderr
