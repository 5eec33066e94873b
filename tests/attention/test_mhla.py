"""MHLA attention: blocked fast form against the explicit N×N oracle, the distance init, the module contract."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from vitconvert.attention.mhla import (
    MHLAttention,
    block_layout,
    distance_weights,
    reference_block_of,
    resolve_block_counts,
)
from vitconvert.attention.ops.linear.reference import kernel_attention_reference
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

EXTRA = ["block_mix", "input_norm.weight", "input_norm.bias", "q_rmsnorm.weight", "k_rmsnorm.weight",
         "lepe.weight", "lepe.bias"]


def mhla_module(num_prefix: int, grid, dim: int = 8, heads: int = 2, **options) -> MHLAttention:
    """A float64 MHLA module whose extra parameters are random, so that each of them matters."""
    mod = make_module("mhla", num_prefix, grid, dim, heads, **options)
    with torch.no_grad():
        mod.block_mix.uniform_(0.1, 1.0)
        for name, p in mod.named_parameters():
            if name in ("lepe.weight", "lepe.bias", "q_rmsnorm.weight", "k_rmsnorm.weight"):
                p.normal_(std=0.5).add_(1.0 if "rmsnorm" in name else 0.0)
    return mod


# (grid, blocks_per_side, prefix): divisible, uneven, rectangular, more blocks than rows, one block, no grid.
CASES = [((2, 2), 2, 0), ((4, 4), 2, 1), ((6, 6), 2, 5), ((6, 6), 4, 1), ((5, 7), 2, 0), ((5, 7), [3, 2], 5),
         ((2, 3), 3, 1), ((14, 14), None, 1), ((4, 4), 1, 1), (None, 2, 1), (None, None, 0)]


@pytest.mark.parametrize("grid,blocks,num_prefix", CASES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("denominator", ["consistent", "official"])
def test_mix_matches_reference(grid, blocks, num_prefix, masked, denominator):
    mod = mhla_module(num_prefix, grid, blocks_per_side=blocks, denominator=denominator)
    assert_mix_matches_reference(mod, num_prefix, grid, masked)


@pytest.mark.parametrize("options", [{}, {"qk_rmsnorm": False, "lepe_kernel": 3}, {"lepe_kernel": 0}])
def test_mix_matches_reference_with_options(options):
    mod = mhla_module(1, (4, 4), blocks_per_side=2, **options)
    q, k, v = random_qkv(2, mod.num_heads, 17, mod.head_dim)
    torch.testing.assert_close(mod.mix(q, k, v, None, (4, 4)), mod.reference(q, k, v, None, (4, 4)),
                               atol=1e-10, rtol=0)


@pytest.mark.parametrize("grid,blocks,num_prefix", [((4, 4), 2, 1), ((5, 7), 2, 5), ((2, 2), 2, 0)])
def test_gradients_match_reference(grid, blocks, num_prefix):
    mod = mhla_module(num_prefix, grid, blocks_per_side=blocks)
    params = [mod.block_mix, mod.lepe.weight, mod.lepe.bias, mod.q_rmsnorm.weight, mod.k_rmsnorm.weight]
    assert_mix_gradients_match_reference(mod, num_prefix + grid[0] * grid[1], grid, params)


def test_invalid_tokens_do_not_reach_valid_outputs():
    assert_masked_keys_reach_no_valid_output(mhla_module(1, (4, 4), blocks_per_side=2), (4, 4), 17)


def test_no_grid_is_relu_kernel_attention():
    mod = mhla_module(1, None, qk_rmsnorm=False)
    q, k, v = random_qkv(2, mod.num_heads, 7, mod.head_dim)
    expected = kernel_attention_reference(q.relu() + 1e-6, k.relu() + 1e-6, v, None, 1e-6)
    torch.testing.assert_close(mod.mix(q, k, v, None, None), expected, atol=1e-12, rtol=0)


def test_blocks_only_see_their_mixture():
    """With W = I and no prefix, a query's output depends on its own block's keys only."""
    mod = mhla_module(0, (4, 4), blocks_per_side=2, lepe_kernel=0)
    with torch.no_grad():
        mod.block_mix.copy_(torch.eye(4))
    q, k, v = random_qkv(1, mod.num_heads, 16, mod.head_dim)
    block_of = torch.tensor(reference_block_of((4, 4), (2, 2)))
    before = mod.mix(q, k, v, None, (4, 4))
    v2 = v.clone()
    v2[:, :, block_of == 3] += 10.0
    after = mod.mix(q, k, v2, None, (4, 4))
    same = (block_of != 3)[None, None, :, None].expand_as(before)
    torch.testing.assert_close(after[same], before[same])
    assert not torch.allclose(after[~same], before[~same])


def test_distance_init_for_two_by_two_blocks():
    w = distance_weights((2, 2), "cos")
    near, far = math.cos(math.pi / 4 / math.sqrt(2)), math.cos(math.pi / 4)
    column = torch.tensor([1.0, near, near, far], dtype=torch.float64) / (1 + 2 * near + far)
    torch.testing.assert_close(w[:, 0], column)
    torch.testing.assert_close(w, w.T)


@pytest.mark.parametrize("counts", [(1, 1), (2, 2), (3, 3), (2, 4)])
@pytest.mark.parametrize("transform", ["cos", "linear", "exp", "local"])
def test_distance_init_shape(counts, transform):
    w = distance_weights(counts, transform)
    m = counts[0] * counts[1]
    assert w.shape == (m, m) and (w >= 0).all()
    torch.testing.assert_close(w.sum(dim=0), torch.ones(m, dtype=w.dtype))
    assert (w.diagonal() >= w.max(dim=0).values).all()  # each block keeps the largest share of its state
    unnormalised = w * (1 / w.diagonal())[None, :]  # diagonal of the raw transform is f(0) = 1
    torch.testing.assert_close(unnormalised, unnormalised.T)


def test_block_counts_and_uneven_blocks():
    assert resolve_block_counts((14, 14), None, 7) == (2, 2)
    assert resolve_block_counts((24, 16), None, 7) == (3, 2)
    assert resolve_block_counts((4, 4), None, 7) == (1, 1)
    assert resolve_block_counts(None, None, 7) == (1, 1)
    assert resolve_block_counts(None, [2, 3], 7) == (2, 3)
    sizes = torch.bincount(torch.tensor(reference_block_of((5, 7), (2, 2))))
    assert sizes.tolist() == [12, 9, 8, 6]  # rows 3+2, columns 4+3
    gather, slot, length = block_layout((5, 7), (2, 2), torch.device("cpu"))
    assert length == 12 and torch.equal(gather[slot], torch.arange(35))


def test_forward_matches_reference_forward_on_other_grids():
    src = softmax_source()
    mod = MHLAttention.from_softmax(src, num_prefix_tokens=1, grid_size=(4, 4), blocks_per_side=2).double()
    for tokens, attn_mask in ((17, None), (17, last_image_padded()), (37, None)):  # 37: a 6×6 grid, same 2×2 blocks
        assert_forward_matches_literal(mod, torch.randn(2, tokens, 64, dtype=torch.float64), attn_mask)


def test_parameters_extra_and_matched():
    src = softmax_source()
    mod = MHLAttention.from_softmax(src, num_prefix_tokens=1, grid_size=(14, 14))
    assert sorted(mod.extra_parameter_names()) == sorted(EXTRA)
    assert mod.block_mix.shape == (4, 4) and mod.lepe.weight.shape == (64, 1, 5, 5)
    torch.testing.assert_close(mod.block_mix, distance_weights((2, 2)).float())
    assert_softmax_weights_kept(mod, src)
    bare = MHLAttention.from_softmax(src, grid_size=(14, 14), qk_rmsnorm=False, input_norm=False, lepe_kernel=0)
    assert bare.extra_parameter_names() == ["block_mix"]


def test_default_options_are_json_and_validated():
    opts = json.loads(json.dumps(MHLAttention.default_options))
    assert opts == MHLAttention.default_options and opts["transform"] == "cos" and opts["eps"] == 1e-6
    with pytest.raises(BadValue, match="unknown option 'window' for mhla"):
        MHLAttention.from_softmax(softmax_source(), window=4)
    with pytest.raises(BadValue, match="mhla's transform takes one of cos, linear, exp, local, got 'gaussian'"):
        MHLAttention.from_softmax(softmax_source(), transform="gaussian")
    with pytest.raises(BadValue, match="mhla's lepe_kernel must be odd \\(or 0 for no LePE\\), got 4"):
        MHLAttention.from_softmax(softmax_source(), lepe_kernel=4)


def test_reset_extra_parameters_reinitialises():
    mod = MHLAttention.from_softmax(softmax_source(), num_prefix_tokens=1, grid_size=(14, 14))
    assert nonzero_after_reset(mod) == set(EXTRA) - {"input_norm.bias"}
    assert torch.equal(mod.input_norm.weight, torch.ones(64)) and torch.equal(mod.q_rmsnorm.weight, torch.ones(64))


def test_bf16_is_finite_and_close_to_fp32():
    mod = MHLAttention.from_softmax(softmax_source(), num_prefix_tokens=1, grid_size=(4, 4), blocks_per_side=2)
    assert_bf16_close_to_fp32(mod, (4, 4))


@pytest.mark.parametrize("denominator,matches", [("official", True), ("consistent", False)])
def test_official_denominator_equals_the_official_code(denominator, matches):
    """``denominator=official`` is DAGroup-PKU/MHLA's function (vendored in tests/attention/official/mhla.py);
    the default, ``consistent``, is not (it normalises each query by its own attention weights)."""
    from .official.mhla import official_core

    grid, counts = (4, 6), (2, 3)
    mod = mhla_module(0, grid, dim=8, heads=2, blocks_per_side=list(counts), qk_rmsnorm=False, lepe_kernel=0,
                      denominator=denominator)
    q, k, v = random_qkv(2, mod.num_heads, grid[0] * grid[1], mod.head_dim)
    ours = mod.mix(q, k, v, None, grid)

    def blocked(t):  # (B, H, h·w, d) -> (B·H, blocks, tokens per block, d), blocks and tokens row-major
        B, H, _, d = t.shape
        t = t.reshape(B, H, counts[0], grid[0] // counts[0], counts[1], grid[1] // counts[1], d)
        return t.permute(0, 1, 2, 4, 3, 5, 6).reshape(B * H, counts[0] * counts[1], -1, d)

    theirs = official_core(blocked(q), blocked(k), blocked(v), mod.block_mix.detach(), mod.options["eps"])
    relative = (blocked(ours) - theirs).abs().max() / theirs.abs().max()
    assert (relative <= 1e-6) == matches, float(relative)


@pytest.mark.parametrize("options,message", [
    ({"block_side": -3}, "mhla's block_side must be at least 1"),
    ({"block_side": 0}, "mhla's block_side must be at least 1"),
    ({"transform": "exp", "exp_sigma": 0.0}, "mhla's exp_sigma must be positive"),
    ({"transform": "local", "local_threshold": -1.0}, "mhla's local_threshold must not be negative"),
    ({"lepe_kernel": -1}, "mhla's lepe_kernel must be odd"),
])
def test_options_that_would_build_a_nan_or_silently_different_model_are_refused(options, message):
    with pytest.raises(BadValue, match=message):
        MHLAttention(32, 2, grid_size=(4, 4), **options)


@pytest.mark.parametrize("options", [{"transform": "exp", "exp_sigma": 0.5}, {"transform": "local",
                                                                              "local_threshold": 0.0}])
def test_edge_options_build_a_finite_block_mixing(options):
    module = MHLAttention(32, 2, grid_size=(8, 8), block_side=2, **options)
    assert torch.isfinite(module.block_mix).all()
    torch.testing.assert_close(module.block_mix.sum(0), torch.ones(16))


def test_the_blocked_ops_rmsnorm_and_its_backward_are_rmsnorm_over_heads():
    """The RMSNorm the fused path runs inside the blocked op (ops/norms/lean.py) against F.rms_norm over
    all heads' channels (ops/norms/reference.py): values, and its hand-written backward (rstd recomputed) against
    autograd's gradients of input and weight, in float64."""
    from vitconvert.attention.ops.norms.lean import rms_over_heads as lean
    from vitconvert.attention.ops.norms.lean import rms_over_heads_backward
    from vitconvert.attention.ops.norms.reference import rms_norm_over_heads as rms_over_heads

    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 3, 10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (1 + torch.rand(24, generator=g, dtype=torch.float64)).requires_grad_()
    grad = torch.randn(2, 3, 10, 8, generator=g, dtype=torch.float64)
    eps = torch.finfo(torch.float64).eps
    expected = rms_over_heads(t, weight)
    torch.testing.assert_close(lean(t.double(), weight, eps).double(), expected.detach(), atol=1e-6, rtol=1e-6)
    dt, dweight = torch.autograd.grad(expected, (t, weight), grad)
    mine = rms_over_heads_backward(t.detach(), weight.detach(), eps, grad)
    torch.testing.assert_close(mine[0].double(), dt, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(mine[1].double(), dweight, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_layernorm_and_qkv_function_is_layernorm_then_linear_and_keeps_one_input_sized_tensor(bias):
    """lean_norms.layer_norm_linear against F.linear(F.layer_norm(x)): float64 values and the gradients of x, the
    norm's weight and bias and the linear's, exact where a norm weight is 0 (backward never divides by it); under
    bf16 autocast within bf16 rounding of the float32 form, keeping one bf16 N×C tensor (x̂) and nothing in
    float32 beyond per-token rstd."""
    from vitconvert.attention.ops.norms.lean import layer_norm_linear

    g = torch.Generator().manual_seed(0)
    norm = nn.LayerNorm(16, dtype=torch.float64, bias=bias)
    linear = nn.Linear(16, 48, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(-1.5, 1.5, generator=g)
        norm.weight[:3] = 0.0
        if bias:
            norm.bias.uniform_(-2, 2, generator=g)
    x = torch.randn(2, 9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 9, 48, generator=g, dtype=torch.float64)
    params = [x, *norm.parameters(), *linear.parameters()]
    out = layer_norm_linear(x, norm, linear.weight, linear.bias)
    expected = linear(norm(x))
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(expected, params, grad),
                         strict=True):
        torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(lambda t: layer_norm_linear(t, norm, linear.weight, linear.bias), (x,))

    norm, linear, x = norm.float(), linear.float(), x.detach().float().requires_grad_()
    params = [x, *norm.parameters(), *linear.parameters()]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer_norm_linear(x, norm, linear.weight, linear.bias)
    expected = linear(norm(x))
    assert out.dtype == torch.bfloat16
    big = [t for t in saved if t.numel() >= x.numel() and not any(t is p for p in params[1:])]
    assert [(t.shape, t.dtype) for t in big] == [(x.shape, torch.bfloat16)]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach().float() - b.detach()).norm() / b.detach().norm())

    assert rel(out, expected) < 1e-2
    for got, want in zip(torch.autograd.grad(out, params, grad.float().bfloat16()),
                         torch.autograd.grad(expected, params, grad.float()), strict=True):
        assert rel(got, want) < 2e-2
