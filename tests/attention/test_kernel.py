"""ELU and ReLU kernel attention: the Σ-form against the explicit N×N weights, masks, and the module contract."""

from __future__ import annotations

import pytest
import torch

from vitconvert.attention.kernel import (
    EluAttention,
    ReluAttention,
    elu_feature,
    kernel_attention,
    relu_feature,
)
from vitconvert.attention.ops.linear.reference import kernel_attention_reference

from .helpers import (
    assert_masked_tokens_reach_no_valid_output,
    assert_softmax_weights_kept,
    literal,
    make_module,
    random_mask,
    random_tensors,
    softmax_source,
)

VARIANTS = [EluAttention, ReluAttention]
VARIANT_IDS = [cls.variant for cls in VARIANTS]
TOKENS = [1, 5, 17, 50]


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("cls", VARIANTS, ids=VARIANT_IDS)
def test_mix_matches_reference_with_gradients(cls, tokens, masked):
    mod = make_module(cls)
    shape = (2, mod.num_heads, tokens, mod.head_dim)
    q, k, v, upstream = random_tensors(shape, shape, shape, shape)
    key_valid = random_mask(2, tokens) if masked else None
    results = []
    for mixer in (mod.mix, mod.reference):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mixer(*inputs, key_valid, None)
        results.append((out, torch.autograd.grad((out * upstream).sum(), inputs)))
    (fast, fast_grads), (slow, slow_grads) = results
    torch.testing.assert_close(fast, slow, atol=1e-10, rtol=0)
    for name, g_fast, g_slow in zip("qkv", fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(g_fast, g_slow, atol=1e-10, rtol=0, msg=f"grad of {name}")


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("cls", VARIANTS, ids=VARIANT_IDS)
def test_forward_matches_reference(cls, masked):
    mod = make_module(cls)
    (x,) = random_tensors((2, 17, mod.dim))
    attn_mask = random_mask(2, 17)[:, None, None, :] if masked else None
    torch.testing.assert_close(mod(x, attn_mask=attn_mask), literal(mod, x, attn_mask=attn_mask),
                               atol=1e-10, rtol=0)


@pytest.mark.parametrize("feature", [elu_feature, relu_feature], ids=VARIANT_IDS)
def test_output_is_a_normalised_average_of_values(feature):
    """Rows of the explicit weights are non-negative and sum to one (ε = 0): constant V passes unchanged."""
    q, k = (t.abs() for t in random_tensors((2, 2, 9, 4), (2, 2, 9, 4)))  # no all-zero ReLU rows
    v = torch.ones(2, 2, 9, 4, dtype=torch.float64)
    out = kernel_attention_reference(feature(q), feature(k), v, None, eps=0.0)
    assert (feature(q) >= 0).all() and (feature(k) >= 0).all()
    torch.testing.assert_close(out, v, atol=1e-12, rtol=0)


@pytest.mark.parametrize("feature", [elu_feature, relu_feature], ids=VARIANT_IDS)
def test_masked_keys_equal_dropping_them(feature):
    q, k, v = random_tensors(*[(1, 2, 9, 4)] * 3)
    key_valid = random_mask(1, 9)
    keep = key_valid[0]
    masked = kernel_attention(feature(q), feature(k), v, key_valid, eps=1e-6)
    dropped = kernel_attention(feature(q), feature(k[:, :, keep]), v[:, :, keep], None, eps=1e-6)
    torch.testing.assert_close(masked, dropped, atol=1e-12, rtol=0)


@pytest.mark.parametrize("cls", VARIANTS, ids=VARIANT_IDS)
def test_masked_tokens_do_not_reach_valid_outputs(cls):
    assert_masked_tokens_reach_no_valid_output(make_module(cls))


@pytest.mark.parametrize("all_zero", ["queries", "keys"])
def test_relu_with_all_zero_features_stays_finite(all_zero):
    """Negative queries (or keys) have zero ReLU features: ε keeps 0/0 away, output and gradients are 0."""
    mod = make_module(ReluAttention)
    q, k, v = (t.requires_grad_() for t in random_tensors(*[(2, 2, 9, 4)] * 3))
    for mixer in (mod.mix, mod.reference):
        q_in = -q.abs() if all_zero == "queries" else q
        k_in = -k.abs() if all_zero == "keys" else k
        out = mixer(q_in, k_in, v, None, None)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert torch.isfinite(out).all() and (out == 0).all()
        assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("cls", VARIANTS, ids=VARIANT_IDS)
def test_state_dict_names_match_softmax(cls):
    src = softmax_source()
    new = cls.from_softmax(src, num_prefix_tokens=1, grid_size=(4, 4))
    assert new.extra_parameter_names() == []
    assert sorted(new.state_dict()) == sorted(src.state_dict())
    assert_softmax_weights_kept(new, src)
    assert new.options == {"eps": 1e-6, "feature_map": "fixed", "init_scale": 2.0}


@pytest.mark.parametrize("cls", VARIANTS, ids=VARIANT_IDS)
def test_bf16_is_finite_and_close_to_float32(cls):
    mod = make_module(cls).float()
    low = [t.bfloat16() for t in random_tensors(*[(2, 2, 17, 4)] * 3, dtype=torch.float32)]
    out = mod.mix(*low, None, None)
    exact = mod.mix(*[t.float() for t in low], None, None)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cls,phi", [(EluAttention, lambda x: torch.nn.functional.elu(x) + 1),
                                     (ReluAttention, torch.relu)], ids=VARIANT_IDS)
def test_module_equals_the_katharopoulos_formula_written_out(cls, phi):
    """Katharopoulos et al. 2020, eq. 4, token by token, with nothing from vitconvert but the weights:
    V'_i = Σ_j φ(Q_i)ᵀφ(K_j) V_j / Σ_j φ(Q_i)ᵀφ(K_j), per head, then the output projection."""
    mod = make_module(cls, num_prefix=1)
    (x,) = random_tensors((2, 17, 8))
    B, N, C = x.shape
    H, d = mod.num_heads, C // mod.num_heads
    qkv = x @ mod.qkv.weight.T + mod.qkv.bias
    q, k, v = (t.reshape(B, N, H, d) for t in qkv.split(C, dim=-1))
    out = torch.zeros(B, N, H, d, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                weights = [phi(q[b, i, h]) @ phi(k[b, j, h]) for j in range(N)]
                out[b, i, h] = sum(w * v[b, j, h] for j, w in enumerate(weights)) / (sum(weights) + 1e-6)
    want = out.reshape(B, N, C) @ mod.proj.weight.T + mod.proj.bias
    torch.testing.assert_close(mod(x), want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("cls", VARIANTS, ids=VARIANT_IDS)
def test_init_scale_is_shown_only_with_hedgehogs_map(cls):
    """init_scale sizes Hedgehog's W: a fixed φ has none, so its repr (as `list`, `info` and the card) leaves the
    option out, while the module still holds it (config.json keeps every option: folders load as before)."""
    plain, learned = cls(16, num_heads=2), cls(16, num_heads=2, feature_map="hedgehog", init_scale=1.5)
    assert plain.options["init_scale"] == 2.0 and "init_scale" not in repr(plain)
    assert "feature_map=hedgehog, init_scale=1.5" in repr(learned)
