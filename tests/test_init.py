"""Init recipes: Mimetic's defining property, bitwise copies, timm's own random init, the report."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from vitconvert.attention import LinearAttention
from vitconvert.conversion import convert
from vitconvert.errors import BadValue, VitconvertError
from vitconvert.init import MIMETIC_QK, MIMETIC_VO, InitRecipe, low_rank_factors, mimetic_target


def _optimal_error(target: torch.Tensor, rank: int) -> float:
    s = torch.linalg.svdvals(target)
    return s[rank:].pow(2).sum().sqrt().item()


@pytest.mark.parametrize("dim,rank", [(32, 8), (64, 16), (96, 32)])
def test_low_rank_factors_near_optimal(dim, rank):
    g = torch.Generator().manual_seed(0)
    target = mimetic_target(dim, *MIMETIC_QK, 1.0, g, count=3)
    a, b = low_rank_factors(target, rank, g)
    for h in range(3):
        err = (a[h].T @ b[h] - target[h]).norm().item()
        assert err <= 1.05 * _optimal_error(target[h], rank)


def test_low_rank_factors_exact_at_full_rank():
    g = torch.Generator().manual_seed(0)
    target = mimetic_target(24, *MIMETIC_VO, -1.0, g)
    a, b = low_rank_factors(target, 24, g)
    torch.testing.assert_close(a[0].T @ b[0], target[0], atol=1e-10, rtol=0)


def test_mimetic_defining_property():
    """Per head W_qᵀW_k ≈ α₁Z₁+β₁I (identity visible on the diagonal); across heads W_vᵀW_projᵀ = α₂Z₂−β₂I."""
    model = tiny_model("vit", embed_dim=64, num_heads=2)
    student, _ = convert(model, "elu", attn_init="mimetic", seed=3)
    attn = next(m for m in student.modules() if isinstance(m, LinearAttention))
    w_q, w_k, w_v = (w.double() for w in attn.qkv_weights())
    d, dim = attn.head_dim, w_q.shape[1]
    g = torch.Generator().manual_seed(3)
    targets = mimetic_target(dim, *MIMETIC_QK, 1.0, g, count=attn.num_heads)
    products = []
    for h in range(attn.num_heads):
        product = w_q[h * d:(h + 1) * d].T @ w_k[h * d:(h + 1) * d]
        products.append(product)
        # the same Z as the init drew (same seed) and a rank-d approximation within 5% of the best one
        err = (product - targets[h]).norm().item()
        assert err <= 1.05 * _optimal_error(targets[h], d)
        # the +β₁I part: the diagonal is clearly positive while off-diagonal entries average out
        assert product.diagonal().mean() > 0.2 * MIMETIC_QK[1]
        assert product.diagonal().mean() > 5 * product.fill_diagonal_(0).abs().mean()
    assert not torch.allclose(products[0], products[1])  # a fresh Z per head
    vo = w_v.T @ attn.proj.weight.double().T
    assert vo.diagonal().mean() < -0.8 * MIMETIC_VO[1]  # −β₂I, exact at full rank
    for bias in attn.qkv_biases() + [attn.proj.bias]:
        assert torch.count_nonzero(bias) == 0


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_copy_recipe_copies_bitwise():
    model = tiny_model("vit")
    student, report = convert(model, "relu", attn_init="copy")
    src, dst = _params(model), _params(student)
    assert src.keys() == dst.keys()
    for name in src:
        assert torch.equal(src[name], dst[name]), name
    assert set(report.init.totals()) == {"copied"}


@pytest.mark.parametrize("family", ["vit", "deit_distilled", "eva02", "beit"])
def test_mimetic_keeps_mlp_and_rest_bitwise(family):
    model = tiny_model(family)
    student, report = convert(model, "elu")
    src, dst = _params(model), _params(student)
    for name, value in dst.items():
        if ".attn." not in name:
            assert torch.equal(value, src[name]), name
        elif name.endswith("qkv.weight") or name.endswith("proj.weight"):
            assert not torch.equal(value, src[name]), name
    groups = {(r["group"], r["action"]) for r in report.init.to_list()}
    assert ("mlp", "copied") in groups and ("attention", "mimetic") in groups


def test_random_recipes_take_timm_init_and_are_seeded():
    model = tiny_model("vit")
    a, report = convert(model, "elu", attn_init="random", mlp_init="random", rest_init="random", seed=7)
    b, _ = convert(model, "elu", attn_init="random", mlp_init="random", rest_init="random", seed=7)
    c, _ = convert(model, "elu", attn_init="random", mlp_init="random", rest_init="random", seed=8)
    pa, pb, pc, src = _params(a), _params(b), _params(c), _params(model)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["blocks.0.mlp.fc1.weight"], pc["blocks.0.mlp.fc1.weight"])
    assert not torch.equal(pa["blocks.0.mlp.fc1.weight"], src["blocks.0.mlp.fc1.weight"])
    # timm's ViT init: trunc-normal(0.02) weights, zero biases
    assert pa["blocks.0.mlp.fc1.weight"].std().item() == pytest.approx(0.02, rel=0.2)
    assert torch.count_nonzero(pa["blocks.0.mlp.fc1.bias"]) == 0
    assert set(report.init.totals()) == {"random"}


def test_reheading_gives_new_random_head_and_keeps_rest():
    model = tiny_model("vit")
    student, report = convert(model, "elu", num_classes=7)
    assert student.head.weight.shape == (7, 32)
    assert student(torch.randn(1, 3, 32, 32)).shape == (1, 7)
    assert ("head", "random") in {(r["group"], r["action"]) for r in report.init.to_list()}
    assert torch.equal(student.blocks[1].mlp.fc2.weight, model.blocks[1].mlp.fc2.weight)


def test_source_model_unchanged_by_convert():
    model = tiny_model("vit")
    before = _params(model)
    convert(model, "ttt", attn_init="random", num_classes=3)
    after = _params(model)
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert not any(isinstance(m, LinearAttention) for m in model.modules())


def test_unmatched_parameters_are_reported_default_init():
    model = tiny_model("vit")
    _, report = convert(model, "ttt")
    groups = {(r["group"], r["action"]): r["params"] for r in report.init.to_list()}
    assert groups[("attention-extra", "default-init")] > 0


@pytest.mark.parametrize("bad", [dict(attn="svd"), dict(mlp="mimetic"), dict(rest="zero")])
def test_unknown_recipe_is_refused(bad):
    with pytest.raises(VitconvertError):
        InitRecipe(**bad)


def test_num_classes_zero_is_refused():
    with pytest.raises(BadValue, match="at least 1") as refused:
        convert(tiny_model("vit"), "elu", num_classes=0)
    assert refused.value.name == "num_classes"  # the CLI shows it as --num-classes


def test_mimetic_products_have_the_papers_statistics():
    """W_qᵀW_k ≈ α₁Z + β₁I and W_vᵀW_projᵀ ≈ α₂Z − β₂I, Z ~ N(0, 1/C): mean diagonal ±β and off-diagonal
    spread α/√C, checked on a one-head layer (rank d = C, so both products are the full targets)."""
    from timm.layers import Attention

    from vitconvert.attention import VARIANTS
    from vitconvert.init import mimetic_init

    dim = 256
    attn = VARIANTS["elu"].from_softmax(Attention(dim, num_heads=1, qkv_bias=True))
    mimetic_init(attn, torch.Generator().manual_seed(0))
    w_q, w_k, w_v = (w.double() for w in attn.qkv_weights())
    off = ~torch.eye(dim, dtype=torch.bool)
    for product, (alpha, beta), sign in ((w_q.T @ w_k, MIMETIC_QK, 1.0),
                                         (w_v.T @ attn.proj.weight.double().T, MIMETIC_VO, -1.0)):
        noise = alpha / dim ** 0.5  # std of αZ's entries
        assert product.diagonal().mean().item() == pytest.approx(sign * beta, abs=4 * noise / dim ** 0.5)
        assert product[off].mean().item() == pytest.approx(0.0, abs=4 * noise / dim)
        assert product[off].std().item() == pytest.approx(noise, rel=0.05)
    assert all(b.abs().max() == 0 for b in attn.qkv_biases())


def test_mimetic_heads_keep_a_positive_diagonal_at_rank_d():
    """With several heads each W_qᵀW_k is the best rank-d part of its target: still identity-leaning."""
    model = tiny_model("vit")
    student, _ = convert(model, "elu", attn_init="mimetic", seed=1)
    attn = next(m for m in student.modules() if isinstance(m, LinearAttention))
    w_q, w_k, _ = attn.qkv_weights()
    d = attn.head_dim
    for h in range(attn.num_heads):
        product = w_q[h * d:(h + 1) * d].T @ w_k[h * d:(h + 1) * d]
        assert 0 < product.diagonal().mean().item() <= MIMETIC_QK[1] * 1.05
