"""TTT attention: the closed-form step against the autograd oracle, and the module contract."""

from __future__ import annotations

import json

import pytest
import torch
from timm.layers import Attention
from torch import nn
from torch.nn import functional as F

from vitconvert.attention.ttt import TTTAttention, normalize_keys
from vitconvert.errors import BadValue

from .helpers import (
    assert_bf16_close_to_fp32,
    assert_forward_matches_literal,
    assert_masked_keys_reach_no_valid_output,
    assert_mix_gradients_match_reference,
    assert_mix_matches_reference,
    assert_softmax_weights_kept,
    last_image_padded,
    make_module,
    nonzero_after_reset,
    random_qkv,
    softmax_source,
)

EXTRA = ["fast_w1", "fast_w2", "fast_w3", "q_conv.weight", "q_conv.bias", "k_conv.weight", "k_conv.bias"]


def ttt_module(num_prefix: int, grid, dim: int = 8, heads: int = 2, **options) -> TTTAttention:
    """A float64 TTT module with fast weights large enough that the SwiGLU's nonlinearity matters, and the
    reference's step size (the default's, sized for std-0.02 weights, would blow these up)."""
    mod = make_module("ttt", num_prefix, grid, dim, heads, **{"inner_lr": 1.0, **options})
    with torch.no_grad():
        for w in (mod.fast_w1, mod.fast_w2, mod.fast_w3):
            w.normal_(std=0.5)
        for conv in (mod.q_conv, mod.k_conv):
            conv.weight.normal_(std=0.5)
            conv.bias.normal_(std=0.5)
    return mod


CASES = [((2, 2), 0), ((4, 4), 1), ((7, 7), 5), ((4, 4), 0), ((2, 2), 5), ((7, 7), 1), (None, 1)]


@pytest.mark.parametrize("grid,num_prefix", CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_mix_matches_reference(grid, num_prefix, masked):
    assert_mix_matches_reference(ttt_module(num_prefix, grid), num_prefix, grid, masked)


@pytest.mark.parametrize("grid,num_prefix", [((4, 4), 1), ((2, 2), 5), (None, 0)])
def test_gradients_match_reference(grid, num_prefix):
    mod = ttt_module(num_prefix, grid, inner_lr=0.7)
    params = [mod.fast_w1, mod.fast_w2, mod.fast_w3]
    if grid is not None:
        params += [mod.q_conv.weight, mod.k_conv.weight, mod.q_conv.bias, mod.k_conv.bias]
    assert_mix_gradients_match_reference(mod, num_prefix + (grid[0] * grid[1] if grid else 5), grid, params)


def test_invalid_tokens_do_not_reach_valid_outputs():
    assert_masked_keys_reach_no_valid_output(ttt_module(1, (4, 4)), (4, 4), 17)


def test_key_norm_is_instance_norm_with_eps_one():
    k = torch.randn(2, 3, 10, 4, dtype=torch.float64)
    # The reference: F.instance_norm over tokens of each (head, channel), eps=1.0.
    expected = F.instance_norm(k.permute(0, 1, 3, 2).reshape(2, 12, 10), eps=1.0)
    expected = expected.reshape(2, 3, 4, 10).permute(0, 1, 3, 2)
    torch.testing.assert_close(normalize_keys(k, None, 1.0), expected)
    all_valid = torch.ones(2, 10, dtype=torch.bool)
    torch.testing.assert_close(normalize_keys(k, all_valid, 1.0), expected)


def test_inner_lr_zero_is_the_initial_model():
    mod = ttt_module(0, None, inner_lr=0.0)
    q, k, v = random_qkv(1, mod.num_heads, 5, mod.head_dim)
    out = mod.mix(q, k, v, None, None)
    expected = (F.silu(q @ mod.fast_w1) * (q @ mod.fast_w2)) @ mod.fast_w3
    torch.testing.assert_close(out, expected)


def test_forward_matches_reference_forward():
    src = softmax_source()
    mod = TTTAttention.from_softmax(src, num_prefix_tokens=1, grid_size=(4, 4)).double()
    x = torch.randn(2, 17, 64, dtype=torch.float64)
    for attn_mask in (None, last_image_padded()):
        assert_forward_matches_literal(mod, x, attn_mask)


def test_parameters_extra_and_matched():
    src = softmax_source()
    mod = TTTAttention.from_softmax(src, num_prefix_tokens=1, grid_size=(4, 4))
    assert sorted(mod.extra_parameter_names()) == sorted(EXTRA)
    assert mod.fast_w1.shape == (4, 16, 16)
    assert mod.q_conv.weight.shape == (64, 1, 3, 3)
    assert_softmax_weights_kept(mod, src)
    for w in (mod.fast_w1, mod.fast_w2, mod.fast_w3):
        assert 0.01 < w.std() < 0.03 and w.abs().max() <= 2.0


def test_default_options_are_json_and_validated():
    assert json.loads(json.dumps(TTTAttention.default_options)) == {"inner_lr": None, "key_norm_eps": 1.0}
    with pytest.raises(BadValue, match="unknown option 'chunk_size' for ttt; valid: inner_lr, key_norm_eps"):
        TTTAttention.from_softmax(softmax_source(), chunk_size=4)


def mixing(mod: TTTAttention, d: int) -> float:
    """|f_W'(q) − f_W(q)| / |v|: how much of the values the inner step mixes into the queries' outputs."""
    q, k, v = random_qkv(4, mod.num_heads, 65, d)
    lr = mod.inner_lr
    with torch.no_grad():
        stepped = mod.mix(q, k, v, None, None)
        mod.inner_lr = 0.0
        unstepped = mod.mix(q, k, v, None, None)
    mod.inner_lr = lr
    return ((stepped - unstepped).norm() / v.norm()).item()


def test_default_step_mixes_at_every_head_size():
    """The mechanism of the transfer fix: at the reference init (fast weights std 0.02) the step's mixing grows
    ~d² and with step size 1.0 is ~1e-6, so nothing reaches a class token; the default step size scales as
    (32/d)², holding the mixing near its value at d = 32 for heads of 16 to 128, and far above the reference's."""
    torch.manual_seed(0)
    auto = {d: mixing(TTTAttention(2 * d, num_heads=2).double(), d) for d in (16, 32, 64, 128)}
    reference = {d: mixing(TTTAttention(2 * d, num_heads=2, inner_lr=1.0).double(), d) for d in (16, 64)}
    assert TTTAttention(64, num_heads=2).inner_lr == 100.0 and TTTAttention(384, num_heads=6).inner_lr == 25.0
    assert all(0.3 < m / auto[32] < 3 for m in auto.values()), auto
    assert all(m < 0.1 * auto[d] for d, m in reference.items()), (reference, auto)
    assert all(m < 1e-4 for m in reference.values()), reference


def test_reset_extra_parameters_reinitialises():
    mod = TTTAttention.from_softmax(softmax_source(), num_prefix_tokens=1, grid_size=(4, 4))
    assert nonzero_after_reset(mod) == set(EXTRA)


def test_bf16_is_finite_and_close_to_fp32():
    mod = TTTAttention.from_softmax(softmax_source(), num_prefix_tokens=1, grid_size=(4, 4), inner_lr=1.0)
    with torch.no_grad():
        for w in (mod.fast_w1, mod.fast_w2, mod.fast_w3):
            nn.init.normal_(w, std=0.3)
    assert_bf16_close_to_fp32(mod, (4, 4))


def test_equals_the_official_module():
    """Against LeapLabTHU/Transformer-to-TTT's own layer (vendored in tests/attention/official/ttt.py), same
    weights, float64, a 5×5 grid and no class token (the official model has none)."""
    from .official.ttt import OfficialTTTAttention

    torch.manual_seed(0)
    dim, heads = 16, 2
    official = OfficialTTTAttention(dim, heads, qkv_bias=True).double()
    with torch.no_grad():
        for w in (official.w1, official.w2, official.w3):
            w.normal_(std=0.3)  # larger than the 0.02 init, so the inner step changes the output visibly
        for conv in (official.q_conv2d, official.k_conv2d):
            conv.weight.normal_(std=0.3)
    source = Attention(dim, heads, qkv_bias=True).double()
    source.load_state_dict({k: official.state_dict()[k] for k in ("qkv.weight", "qkv.bias", "proj.weight",
                                                                   "proj.bias")})
    ours = TTTAttention.from_softmax(source, num_prefix_tokens=0, grid_size=(5, 5), inner_lr=1.0).double()
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(ours, f"fast_{name}").copy_(getattr(official, name)[0])
        ours.q_conv.load_state_dict(official.q_conv2d.state_dict())
        ours.k_conv.load_state_dict(official.k_conv2d.state_dict())
    x = torch.randn(2, 25, dim, dtype=torch.float64)
    want, got = official(x), ours(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-12
