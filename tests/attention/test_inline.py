"""InLine attention: the O(N) form against the explicit N×N weights, the local residual, the module contract."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from timm.layers import Attention
from torch.nn import functional as F

from vitconvert.attention.inline import InLineAttention, inline_attention
from vitconvert.attention.ops.linear.reference import inline_weights

from .helpers import (
    assert_forward_matches_literal,
    assert_masked_tokens_reach_no_valid_output,
    literal,
    make_module,
    random_mask,
    random_tensors,
)

EXTRA = ["local_kernel_predictor.0.weight", "local_kernel_predictor.0.bias",
         "local_kernel_predictor.2.weight", "local_kernel_predictor.2.bias"]
# (num_prefix_tokens, grid): class token on several grids, no prefix, and a register-style prefix of 5.
CASES = [(1, (2, 2)), (1, (4, 4)), (1, (7, 7)), (0, (4, 4)), (5, (3, 3)), (1, (2, 5))]
CASE_IDS = [f"prefix{p}-{h}x{w}" for p, (h, w) in CASES]


def inline_module(num_prefix: int, grid, local_residual: bool = False) -> InLineAttention:
    """A float64 module; predictor weights enlarged so the residual is not negligible next to the core."""
    mod = make_module("inline", num_prefix, grid, local_residual=local_residual)
    if local_residual:
        with torch.no_grad():
            for p in mod.local_kernel_predictor.parameters():
                p.normal_(std=0.5)
    return mod


def qkv_and_kernels(mod: InLineAttention, tokens: int, batch: int = 2, dtype=torch.float64):
    shape = (batch, mod.num_heads, tokens, mod.head_dim)
    q, k, v, kernels = random_tensors(shape, shape, shape, (batch, mod.attn_dim, 3, 3), dtype=dtype)
    return q, k, v, kernels


@pytest.mark.parametrize("local_residual", [False, True], ids=["core", "residual"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("num_prefix,grid", CASES, ids=CASE_IDS)
def test_mix_matches_reference_with_gradients(num_prefix, grid, masked, local_residual):
    mod = inline_module(num_prefix, grid, local_residual)
    tokens = num_prefix + grid[0] * grid[1]
    q, k, v, kernels = qkv_and_kernels(mod, tokens)
    key_valid = random_mask(2, tokens) if masked else None
    (upstream,) = random_tensors(q.shape, seed=3)
    results = []
    for mixer in (mod.mix, mod.reference):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, kernels)]
        out = mixer(*inputs[:3], key_valid, grid, local_kernels=inputs[3])
        grads = torch.autograd.grad((out * upstream).sum(), inputs, allow_unused=True)
        results.append((out, grads))
    (fast, fast_grads), (slow, slow_grads) = results
    torch.testing.assert_close(fast, slow, atol=1e-10, rtol=0)
    for name, g_fast, g_slow in zip("qkv", fast_grads[:3], slow_grads[:3], strict=True):
        torch.testing.assert_close(g_fast, g_slow, atol=1e-10, rtol=0, msg=f"grad of {name}")
    if local_residual:
        torch.testing.assert_close(fast_grads[3], slow_grads[3], atol=1e-10, rtol=0)
        assert fast_grads[3].abs().sum() > 0
    else:
        assert fast_grads[3] is None and slow_grads[3] is None


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_weights_sum_to_one_and_skip_masked_keys(masked):
    q, k = random_tensors((3, 2, 11, 4), (3, 2, 11, 4))
    key_valid = random_mask(3, 11) if masked else None
    w = inline_weights(q, k, key_valid, scale=0.5)
    assert w.shape == (3, 2, 11, 11)
    torch.testing.assert_close(w.sum(dim=-1), torch.ones(3, 2, 11, dtype=w.dtype), atol=1e-12, rtol=0)
    assert (w < 0).any(), "weights sum to one by subtraction, so some may be negative"
    if masked:
        assert (w.permute(0, 3, 1, 2)[~key_valid] == 0).all()  # (B, key, H, query)


def test_weights_are_the_written_formula():
    """w_ij = (s/N) q_i·k_j − (s/N) q_i·k̄ + 1/N, checked entry by entry."""
    q, k = random_tensors((1, 1, 5, 3), (1, 1, 5, 3))
    s, n = 0.7, 5
    k_bar = k[0, 0].mean(dim=0)
    w = inline_weights(q, k, None, s)
    for i in range(n):
        for j in range(n):
            expected = s / n * q[0, 0, i] @ k[0, 0, j] - s / n * q[0, 0, i] @ k_bar + 1 / n
            assert abs(w[0, 0, i, j] - expected) < 1e-12


def test_masked_keys_equal_dropping_them():
    """A key mask is the same as removing those tokens: N counts valid keys only."""
    q, k, v = random_tensors(*[(1, 2, 9, 4)] * 3)
    key_valid = random_mask(1, 9)
    keep = key_valid[0]
    masked = inline_attention(q, k, v, key_valid, 0.5)
    dropped = inline_attention(q, k[:, :, keep], v[:, :, keep], None, 0.5)
    torch.testing.assert_close(masked, dropped, atol=1e-12, rtol=0)


@pytest.mark.parametrize("local_residual", [False, True], ids=["core", "residual"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("num_prefix,grid", CASES, ids=CASE_IDS)
def test_forward_matches_reference(num_prefix, grid, masked, local_residual):
    mod = inline_module(num_prefix, grid, local_residual)
    tokens = num_prefix + grid[0] * grid[1]
    (x,) = random_tensors((2, tokens, mod.dim))
    attn_mask = random_mask(2, tokens)[:, None, None, :] if masked else None
    fast = assert_forward_matches_literal(mod, x, attn_mask)
    if local_residual:
        assert not torch.allclose(fast, inline_module(num_prefix, grid)(x, attn_mask=attn_mask))


def test_predictor_gradients_match_reference():
    mod = inline_module(1, (4, 4), local_residual=True)
    (x,) = random_tensors((2, 17, mod.dim))
    grads = []
    for use_reference in (False, True):
        mod.zero_grad()
        mod.use_reference = use_reference
        mod(x).square().sum().backward()
        grads.append([p.grad.clone() for p in mod.local_kernel_predictor.parameters()])
    for g_fast, g_slow in zip(*grads, strict=True):
        torch.testing.assert_close(g_fast, g_slow, atol=1e-10, rtol=1e-10)
        assert g_fast.abs().sum() > 0


def upstream_style_forward(mod: InLineAttention, x: torch.Tensor) -> torch.Tensor:
    """The reference repository's DeiT forward, step by step: one class token, a square grid, no mask.

    Kernels: residual MLP on x.mean over all tokens, laid out (B·C, 1, 3, 3); residual: grouped conv over
    the patch tokens' V in (B, h, w, C) channel order, added after the heads are concatenated.
    """
    b, n, c = x.shape
    side = int(n ** 0.5)
    heads, d = mod.num_heads, c // mod.num_heads
    q, k, v = mod.qkv(x).reshape(b, n, 3, heads, d).permute(2, 0, 3, 1, 4)
    kernels = mod.local_kernel_predictor(x.mean(dim=1)[:, :, None]).reshape(b * c, 1, 3, 3)
    state = (k.transpose(-2, -1) * (mod.scale / n) ** 0.5) @ (v * (mod.scale / n) ** 0.5)
    core = q @ state + (1 - q @ k.mean(dim=2, keepdim=True).transpose(-2, -1) * mod.scale) * v.mean(2, True)
    out = core.transpose(1, 2).reshape(b, n, c)
    image = v[:, :, 1:].transpose(1, 2).reshape(b, side, side, c).permute(0, 3, 1, 2).reshape(1, b * c, side, side)
    residual = F.conv2d(image, kernels, padding=1, groups=b * c).reshape(b, c, n - 1).permute(0, 2, 1)
    out = torch.cat((out[:, :1], out[:, 1:] + residual), dim=1)
    return mod.proj(out)


@pytest.mark.parametrize("side", [2, 4])
def test_module_matches_upstream_layout(side):
    """Kernel channel order, mean token and residual placement agree with the reference repository."""
    mod = inline_module(1, (side, side), local_residual=True)
    (x,) = random_tensors((2, 1 + side * side, mod.dim))
    torch.testing.assert_close(mod(x), upstream_style_forward(mod, x), atol=1e-10, rtol=0)


def test_prefix_tokens_get_no_residual():
    mod = inline_module(5, (3, 3), local_residual=True)
    q, k, v, kernels = qkv_and_kernels(mod, 14)
    with_residual = mod.mix(q, k, v, None, (3, 3), local_kernels=kernels)
    core = inline_attention(q, k, v, None, mod.scale)
    torch.testing.assert_close(with_residual[:, :, :5], core[:, :, :5], atol=1e-12, rtol=0)
    assert not torch.allclose(with_residual[:, :, 5:], core[:, :, 5:])


def test_masked_tokens_do_not_reach_valid_outputs():
    """Padding may hold anything: valid tokens' outputs (core, residual and mean token) ignore it."""
    assert_masked_tokens_reach_no_valid_output(inline_module(1, (4, 4), local_residual=True))


def test_residual_skipped_without_grid():
    """Tokens that form no grid (7 patches, no grid_size): the residual is left out, the core remains."""
    with_residual, core = inline_module(1, None, local_residual=True), inline_module(1, None)
    (x,) = random_tensors((2, 8, with_residual.dim))
    torch.testing.assert_close(with_residual(x), core(x), atol=1e-12, rtol=0)
    torch.testing.assert_close(with_residual(x), literal(with_residual, x), atol=1e-10, rtol=0)


def test_mix_without_kernels_is_an_error():
    mod = inline_module(1, (2, 2), local_residual=True)
    q, k, v, _ = qkv_and_kernels(mod, 5)
    with pytest.raises(RuntimeError, match="local_residual"):
        mod.mix(q, k, v, None, (2, 2))


@pytest.mark.parametrize("local_residual", [False, True], ids=["core", "residual"])
def test_state_dict_names_match_softmax(local_residual):
    src = Attention(dim=64, num_heads=4, qkv_bias=True)
    new = InLineAttention.from_softmax(src, num_prefix_tokens=1, grid_size=(4, 4), local_residual=local_residual)
    src_state, new_state = src.state_dict(), new.state_dict()
    extra = EXTRA if local_residual else []
    assert new.extra_parameter_names() == extra
    assert sorted(new_state) == sorted([*src_state, *extra])
    for name, value in src_state.items():
        assert torch.equal(new_state[name], value), name
    if local_residual:
        shapes = [tuple(new_state[n].shape) for n in EXTRA]
        assert shapes == [(64, 16, 1), (64,), (576, 16, 1), (576,)]  # groups=4 heads, 9 kernel taps per channel
    assert new.variant == "inline" and new.options == {"local_residual": local_residual}


def test_reset_extra_parameters_reinitialises_predictor():
    mod = inline_module(1, (2, 2), local_residual=True)
    before = [p.clone() for p in mod.local_kernel_predictor.parameters()]
    mod.reset_extra_parameters()
    after = list(mod.local_kernel_predictor.parameters())
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    # PyTorch's default: kaiming-uniform bound 1/sqrt(fan_in) for a 1×1 conv with fan_in = C/H = 4.
    assert all(p.abs().max() <= 4 ** -0.5 for p in after)


@pytest.mark.parametrize("local_residual", [False, True], ids=["core", "residual"])
def test_bf16_is_finite_and_close_to_float32(local_residual):
    mod = inline_module(1, (4, 4), local_residual).float()
    q, k, v, kernels = qkv_and_kernels(mod, 17, dtype=torch.float32)
    low = [t.bfloat16() for t in (q, k, v, kernels)]
    out = mod.mix(*low[:3], None, (4, 4), local_kernels=low[3])
    exact = mod.mix(*[t.float() for t in low[:3]], None, (4, 4), local_kernels=low[3].float())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), exact, atol=3e-2, rtol=2e-2)


def test_bf16_module_forward_is_finite():
    mod = inline_module(1, (4, 4), local_residual=True).float()
    (x,) = random_tensors((2, 17, mod.dim), dtype=torch.float32)
    out = mod.bfloat16()(x.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), mod.float()(x), atol=0.1, rtol=0.05)


def test_fully_masked_item_stays_finite():
    q, k, v = random_tensors(*[(2, 2, 6, 4)] * 3)
    key_valid: Optional[torch.Tensor] = torch.ones(2, 6, dtype=torch.bool)
    key_valid[1] = False
    out = inline_attention(q, k, v, key_valid, 0.5)
    assert torch.isfinite(out).all() and (out[1] == 0).all()


@pytest.mark.parametrize("local_residual", [True, False])
def test_equals_the_official_module(local_residual):
    """Against LeapLabTHU/InLine's own module (vendored in tests/attention/official/inline.py), same weights,
    float64, a 5×5 grid after a class token: equal with ``local_residual`` (the official code always has it),
    and equal to the official module with its residual branch removed when the option is off."""
    from .official.inline import OfficialInLineAttention

    torch.manual_seed(0)
    dim, heads = 16, 2
    official = OfficialInLineAttention(dim, heads, qkv_bias=True).double()
    source = Attention(dim, heads, qkv_bias=True).double()
    source.load_state_dict({k: v for k, v in official.state_dict().items() if not k.startswith("residual")})
    ours = InLineAttention.from_softmax(source, num_prefix_tokens=1, grid_size=(5, 5),
                                        local_residual=local_residual).double()
    if local_residual:
        ours.local_kernel_predictor.load_state_dict(official.residual.state_dict())
    else:
        with torch.no_grad():  # the official module with its residual branch removed: kernels of zeros
            official.residual[2].weight.zero_()
            official.residual[2].bias.zero_()
    x = torch.randn(2, 26, dim, dtype=torch.float64)
    want = official(x)
    got = ours(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-12
