"""Every global-attention timm ViT family converts to every variant and runs; others are refused."""

from __future__ import annotations

import pytest
import timm
import torch
from helpers import FAMILIES, image_batch, tiny_model

from vitconvert.attention import VARIANTS, LinearAttention
from vitconvert.conversion import convert
from vitconvert.errors import VitconvertError
from vitconvert.surgery import find_softmax_attention, swap_attention


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_converts_and_runs(family, variant):
    model = tiny_model(family)
    x = image_batch(model)
    expected = model(x)
    student, report = convert(model, variant)
    assert not find_softmax_attention(student)
    assert len(report.surgery.replaced) == len(find_softmax_attention(model))
    out = student(x)
    assert out.shape == expected.shape and torch.isfinite(out).all()
    out.float().sum().backward()
    grads = [p.grad for p in student.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


def test_matched_parameter_names_equal_softmax_names():
    model = tiny_model("vit")
    student, _ = convert(model, "mhla")
    softmax_names = {n for n, _ in model.named_parameters()}
    linear_names = {n for n, _ in student.named_parameters()}
    attn = student.blocks[0].attn
    extra = {f"blocks.{i}.attn.{n}" for i in range(2) for n in attn.extra_parameter_names()}
    assert linear_names - extra == softmax_names
    assert attn.num_heads == model.blocks[0].attn.num_heads and attn.head_dim == model.blocks[0].attn.head_dim


def test_logit_biases_are_dropped_and_reported():
    for family, key in (("beit", "relative_position_bias_table"), ("relpos", "rel_pos"), ("srelpos", "shared_rel_pos")):
        student, report = convert(tiny_model(family), "elu")
        assert not any(key in n for n, _ in student.named_parameters()), family
        assert any(key in note for note in report.surgery.notes), family


def test_naflex_padding_mask_drops_padded_keys():
    """With a padding mask, padded patches must not change the valid tokens' outputs."""
    model = tiny_model("naflex")
    student, _ = convert(model, "elu")
    attn = student.blocks[0].attn
    x = torch.randn(1, 9, 32)
    pad = torch.cat([x, torch.randn(1, 3, 32)], dim=1)
    mask = torch.zeros(1, 1, 12, 12)
    mask[..., 9:] = float("-inf")
    torch.testing.assert_close(attn(pad, attn_mask=mask)[:, :9], attn(x), atol=1e-5, rtol=1e-5)


def test_models_without_softmax_attention_are_refused():
    for name, kwargs in (("resnet18", {}), ("swin_tiny_patch4_window7_224", dict(embed_dim=32, depths=(1, 1, 1, 1),
                                                                                 num_heads=(1, 1, 1, 1)))):
        model = timm.create_model(name, pretrained=False, **kwargs)
        with pytest.raises(VitconvertError, match="no global softmax attention"):
            swap_attention(model, "elu")


def test_already_linear_model_is_refused():
    student, _ = convert(tiny_model("vit"), "elu")
    with pytest.raises(VitconvertError, match="already has linear attention"):
        swap_attention(student, "relu")


def test_unknown_variant_lists_valid_ones():
    with pytest.raises(VitconvertError, match="valid: elu, relu"):
        swap_attention(tiny_model("vit"), "performer")


def test_causal_call_is_refused():
    student, _ = convert(tiny_model("vit"), "elu")
    with pytest.raises(ValueError, match="bidirectional"):
        student.blocks[0].attn(torch.randn(1, 17, 32), is_causal=True)


def test_other_resolutions_use_a_square_grid():
    model = tiny_model("vit", dynamic_img_size=True)
    student, _ = convert(model, "mhla")
    assert student(torch.randn(1, 3, 48, 48)).shape == (1, 1000)
    assert all(isinstance(m, LinearAttention) for m in (b.attn for b in student.blocks))
