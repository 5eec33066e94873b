"""What the fast forms promise beyond matching their references: no graph breaks, float32 sums under autocast,
the expm1-free ELU feature, and the optional flash-linear-attention state (skipped without CUDA and fla)."""

from __future__ import annotations

import pytest
import torch
from timm.layers import Attention
from torch.nn import functional as F

from vitconvert.attention import VARIANTS
from vitconvert.attention.kernel import EluAttention, elu_feature, fla_installed, kernel_attention

from .helpers import make_module

# (variant, grid, options): MHLA on a grid its 2×2 blocks divide (reshape path) and on one they do not (gather).
COMPILE_CASES = [("elu", (4, 4), {}), ("relu", (4, 4), {}), ("inline", (4, 4), {"local_residual": True}),
                 ("mhla", (4, 4), {"blocks_per_side": 2}), ("mhla", (5, 5), {"blocks_per_side": 2}),
                 ("ttt", (4, 4), {})]


def compiled_matches_eager(name, grid, options, backend: str, masked: bool):
    mod = make_module(name, 1, grid, dim=16, dtype=torch.float32, **options)
    tokens = 1 + grid[0] * grid[1]
    x = torch.randn(2, tokens, 16, requires_grad=True)
    mask = torch.ones(2, 1, 1, tokens, dtype=torch.bool)
    mask[1, ..., tokens // 2:] = False
    attn_mask = mask if masked else None
    compiled = torch.compile(mod, fullgraph=True, backend=backend)  # fullgraph: any graph break is an error
    out = compiled(x, attn_mask=attn_mask)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    expected = mod(x, attn_mask=attn_mask)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad, expected_grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("name,grid,options", COMPILE_CASES, ids=[f"{n}-{g[0]}x{g[1]}" for n, g, _ in COMPILE_CASES])
def test_no_graph_breaks_under_torch_compile(name, grid, options, masked):
    """Dynamo's trace with the eager backend: seconds, and it fails on any graph break just as inductor would."""
    torch._dynamo.reset()
    compiled_matches_eager(name, grid, options, "eager", masked)


@pytest.mark.slow  # inductor compiles C++ for minutes on a CPU
@pytest.mark.parametrize("name,grid,options", COMPILE_CASES, ids=[f"{n}-{g[0]}x{g[1]}" for n, g, _ in COMPILE_CASES])
def test_inductor_compiles_and_matches_eager(name, grid, options):
    torch._dynamo.reset()
    compiled_matches_eager(name, grid, options, "inductor", masked=False)


def test_mhla_trains_after_inference_on_the_same_grid():
    """The block indices are cached: built under inference_mode they must still serve a training step."""
    from vitconvert.attention.mhla import block_indices

    block_indices.cache_clear()
    mod = make_module("mhla", 1, (5, 5), dim=16, dtype=torch.float32, blocks_per_side=2)
    x = torch.randn(1, 26, 16)
    with torch.inference_mode():
        mod(x)
    mod(x.requires_grad_()).sum().backward()
    assert x.grad is not None


def test_elu_feature_is_elu_plus_one_with_its_gradient():
    x = torch.cat((torch.linspace(-30, 30, 601, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)))
    x.requires_grad_()
    (fast,) = torch.autograd.grad(elu_feature(x).sum(), x)
    (literal,) = torch.autograd.grad((F.elu(x) + 1).sum(), x)
    torch.testing.assert_close(elu_feature(x), F.elu(x) + 1, atol=1e-15, rtol=1e-15)
    exact = torch.where(x > 0, x + 1, x.exp())  # elu(x) + 1 loses the digits of tiny exp(x) (1 + expm1(x))
    torch.testing.assert_close(elu_feature(x), exact, atol=0, rtol=1e-13)  # exp2 of x·log2 e: a few ulp
    torch.testing.assert_close(fast, literal, atol=0, rtol=1e-13)
    assert fast[-1] == 1.0  # at 0 too, as elu


@pytest.mark.parametrize("name", list(VARIANTS))
def test_sums_stay_float32_under_autocast(name):
    """Autocast would run the d×d state matmuls in bf16; the fast forms switch it off for their token sums."""
    mod = make_module(name, dim=16, dtype=torch.float32)
    q, k, v = (torch.randn(2, 2, 17, 8) for _ in range(3))
    mix = (lambda *a: mod.mix(*a, local_kernels=None)) if name == "inline" else mod.mix
    exact = mix(q, k, v, None, (4, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = mix(q, k, v, None, (4, 4))
    assert under_autocast.dtype == torch.float32
    torch.testing.assert_close(under_autocast, exact, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available() or not fla_installed(),
                    reason="needs CUDA and flash-linear-attention (extra `fast`)")
def test_fla_state_equals_reference(monkeypatch):
    monkeypatch.setenv("VITCONVERT_FLA", "1")
    mod = EluAttention.from_softmax(Attention(dim=128, num_heads=2, qkv_bias=True)).cuda()
    q, k, v = (torch.randn(2, 2, 197, 64, device="cuda") for _ in range(3))
    key_valid = torch.rand(2, 197, device="cuda") > 0.2
    torch.testing.assert_close(mod.mix(q, k, v, key_valid, None), mod.reference(q, k, v, key_valid, None),
                               atol=1e-4, rtol=1e-4)
    phi = mod.phi
    assert mod.fla  # chosen at construction, from VITCONVERT_FLA
    plain = kernel_attention(phi(q), phi(k), v, key_valid, 1e-6, fla=False)
    torch.testing.assert_close(kernel_attention(phi(q), phi(k), v, key_valid, 1e-6, fla=True), plain, atol=1e-4,
                               rtol=1e-4)
