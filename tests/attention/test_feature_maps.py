"""Hedgehog's feature map on ELU/ReLU attention (``feature_map=hedgehog``): the layer against Hedgehog's formula
written out, the identity init, the gradient reaching the maps, masks, the plan, and the model folder round trip."""

from __future__ import annotations

import pytest
import timm
import torch
from helpers import image_batch, tiny_model

import vitconvert
from vitconvert.attention.plan import GPUS, plan_layer
from vitconvert.errors import BadValue

from .helpers import assert_masked_tokens_reach_no_valid_output, literal, make_module, random_mask, random_tensors

VARIANTS = ["elu", "relu"]  # the same layer under either name: Hedgehog's φ replaces the variant's


def learned_module(variant: str):
    """A converted layer whose maps are moved off the identity, so that a wrong W, b or q/k swap shows."""
    mod = make_module(variant, feature_map="hedgehog")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            if name.startswith("feature_map_"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return mod


def written_out(mod, x: torch.Tensor, key_valid=None) -> torch.Tensor:
    """Zhang et al. 2024 (Hedgehog), token by token from the weights alone: per head h,
    φ_q(q) = [e^{y}/Σe^{y}, e^{−y}/Σe^{−y}] with y = q W_q^h + b_q^h, the same for keys with W_k, b_k;
    out_i = Σ_j φ_q(q_i)·φ_k(k_j) v_j / (Σ_j φ_q(q_i)·φ_k(k_j) + ε), then the output projection."""
    B, N, C = x.shape
    H, d = mod.num_heads, C // mod.num_heads
    q, k, v = ((x @ mod.qkv.weight.T + mod.qkv.bias).reshape(B, N, 3, H, d)).unbind(2)

    def phi(t, lin, h):
        y = t @ lin.weight[h] + lin.bias[h]
        return torch.cat([y.exp() / y.exp().sum(), (-y).exp() / (-y).exp().sum()])

    out = torch.zeros(B, N, H, d, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            keys = [j for j in range(N) if key_valid is None or key_valid[b, j]]
            fk = {j: phi(k[b, j, h], mod.feature_map_k, h) for j in keys}
            for i in range(N):
                fq = phi(q[b, i, h], mod.feature_map_q, h)
                w = [fq @ fk[j] for j in keys]
                out[b, i, h] = sum(wj * v[b, j, h] for wj, j in zip(w, keys, strict=True)) / (sum(w) + mod.eps)
    return out.reshape(B, N, C) @ mod.proj.weight.T + mod.proj.bias


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_equals_the_formula_written_out(variant, masked):
    mod = learned_module(variant)
    (x,) = random_tensors((2, 17, mod.dim))
    key_valid = random_mask(2, 17) if masked else None
    attn_mask = key_valid[:, None, None, :] if masked else None
    want = written_out(mod, x, key_valid)
    torch.testing.assert_close(mod(x, attn_mask=attn_mask), want, atol=1e-12, rtol=0)
    torch.testing.assert_close(literal(mod, x, attn_mask=attn_mask), want, atol=1e-12, rtol=0)


def test_maps_start_at_twice_the_identity_and_train():
    """The default init (W = 2·I, b = 0: init_scale's default, measured); a loss's gradient reaches both maps."""
    mod = make_module("elu", feature_map="hedgehog")
    for lin in (mod.feature_map_q, mod.feature_map_k):
        assert torch.equal(lin.weight, 2 * torch.eye(mod.head_dim, dtype=lin.weight.dtype).expand_as(lin.weight))
        assert not lin.bias.any()
    (x,) = random_tensors((2, 17, mod.dim))
    mod(x).square().sum().backward()
    names = mod.extra_parameter_names()
    assert names == ["feature_map_q.weight", "feature_map_q.bias", "feature_map_k.weight", "feature_map_k.bias"]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in mod.named_parameters() if n in names)


def test_init_scale_starts_the_maps_at_a_multiple_of_the_identity():
    """``init_scale=S``: W = S·I, b = 0, so φ is the softmax pair of S·q (S = 1: Hedgehog's own identity)."""
    mod = make_module("relu", feature_map="hedgehog", init_scale=3.0)
    (q,) = random_tensors((1, mod.num_heads, 5, mod.head_dim))
    for lin in (mod.feature_map_q, mod.feature_map_k):
        assert torch.equal(lin.weight, 3 * torch.eye(mod.head_dim, dtype=lin.weight.dtype).expand_as(lin.weight))
        assert not lin.bias.any()
        torch.testing.assert_close(lin(q), 3 * q, atol=1e-12, rtol=0)
    with pytest.raises(BadValue, match="init_scale must be positive"):
        make_module("relu", feature_map="hedgehog", init_scale=0)


def test_masked_tokens_do_not_reach_valid_outputs():
    assert_masked_tokens_reach_no_valid_output(learned_module("relu"))


def test_the_plan_says_eager_and_a_bad_name_is_one_line():
    reason = plan_layer(make_module("elu", dim=64, feature_map="hedgehog"), GPUS["h100"], torch.bfloat16, 8).reason
    assert reason == "feature_map=hedgehog (no kernels compute a trained φ)"
    with pytest.raises(BadValue, match="feature_map takes one of fixed, hedgehog"):
        make_module("relu", feature_map="softmax")


def test_folder_round_trip_through_timm(tmp_path):
    """convert → save → timm.create_model("local-dir:...") rebuilds the maps from config.json, trained values and
    all: the same logits bit for bit."""
    student, _ = vitconvert.convert(tiny_model("vit"), "elu", options={"feature_map": "hedgehog"})
    with torch.no_grad():
        student.blocks[0].attn.feature_map_k.bias.add_(0.5)  # not the init: the weights must come from the file
    folder = vitconvert.save(student, tmp_path / "m")
    from_timm = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    attn = from_timm.blocks[0].attn
    assert attn.options["feature_map"] == "hedgehog" and attn.feature_map_q is not None
    x = image_batch(student)
    assert torch.equal(student.eval()(x), from_timm(x))
