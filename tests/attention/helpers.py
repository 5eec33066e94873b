"""What the attention tests share: a seeded softmax source, a variant built from it, random inputs.

``from .helpers import make_module, literal, random_mask`` (tests/helpers.py is the suite-wide one, ``from helpers``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional, Union

import pytest
import torch
from helpers import load_benchmark
from timm.layers import Attention

from vitconvert.attention import VARIANTS, LinearAttention
from vitconvert.attention.ops import dispatch, dispatch_context


@contextlib.contextmanager
def no_warnings():
    """Any warning inside fails the test, except numpy's deprecation of int() on a one-element array, which the
    Triton interpreter torch's floor pins (3.6, with torch 2.10 and 2.11) raises on every scalar index (3.8: none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="Conversion of an array with ndim > 0", category=DeprecationWarning)
        yield


def kernels_device() -> str:
    """Where a fused kernels' test module runs them: the GPU, else the CPU in Triton's interpreter (which
    tests/conftest.py chooses before timm imports triton). Called at module level: skips the module where neither
    can run."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and not dispatch.interpreting():
        pytest.skip("no GPU, and Triton's interpreter was not chosen before triton was imported (tests/conftest.py)",
                    allow_module_level=True)
    return "cuda" if torch.cuda.is_available() else "cpu"


def softmax_source(dim: int = 64, heads: int = 4) -> Attention:
    """timm's softmax Attention (with qkv bias), the same weights on every call."""
    torch.manual_seed(0)
    return Attention(dim=dim, num_heads=heads, qkv_bias=True)


def make_module(variant: Union[str, type[LinearAttention]], num_prefix: int = 1,
                grid: Optional[tuple[int, int]] = (4, 4), dim: int = 8, heads: int = 2,
                dtype: torch.dtype = torch.float64, **options) -> LinearAttention:
    """A ``variant`` (name or class) converted from ``softmax_source(dim, heads)``, in ``dtype``; extra
    parameters at the variant's own init (the tests that need them to matter randomise them)."""
    cls = VARIANTS[variant] if isinstance(variant, str) else variant
    src = softmax_source(dim, heads)
    return cls.from_softmax(src, num_prefix_tokens=num_prefix, grid_size=grid, **options).to(dtype)


def literal(module: LinearAttention, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """``module(x)`` in its slow literal form (``reference``), the module's choice switched for this one call."""
    module.use_reference = True
    try:
        return module(x, **kwargs)
    finally:
        module.use_reference = False


def random_tensors(*shapes, dtype: torch.dtype = torch.float64, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=dtype) for s in shapes]


def random_qkv(batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype = torch.float64):
    """q, k and v of shape (B, H, N, d)."""
    return random_tensors(*[(batch, heads, tokens, head_dim)] * 3, dtype=dtype)


def random_mask(batch: int, tokens: int) -> torch.Tensor:
    """Random (B, N) key validity, with every batch item keeping at least its first token."""
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(batch, tokens, generator=gen) > 0.3
    mask[:, 0] = True
    return mask


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def float32_against_literal(module: LinearAttention, x: torch.Tensor,
                            attn_mask: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Relative errors of ``module`` run in float32 (its fast form: on a GPU path, the kernels) against its literal
    form in float64, for the loss Σ out²: "output", "input" (x's gradient) and each parameter's gradient by name.
    The module ends in float32."""
    reference = module.double()
    x64 = x.double().requires_grad_()
    expected = literal(reference, x64, attn_mask=attn_mask)
    expected.square().sum().backward()
    want = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    module = reference.float()
    module.zero_grad()
    x32 = x.float().requires_grad_()
    out = module(x32, attn_mask=attn_mask)
    out.square().sum().backward()
    errors = {"output": rel_error(out, expected), "input": rel_error(x32.grad, x64.grad)}
    return errors | {n: rel_error(p.grad, want[n]) for n, p in module.named_parameters() if n in want}


class Cramped:
    """A GPU with less shared memory than the launch settings were made for, as the context's launcher
    (:func:`cramped`): a launch of one of ``kernels`` whose settings ``fits(settings)`` rejects raises
    OutOfResources, as Triton's launcher does (``refused``: how many, per kernel); every other launch runs."""

    def __init__(self, kernels, fits) -> None:
        self.fits, self.refused = fits, dict.fromkeys(kernels, 0)

    def __call__(self, kernel, grid, *args, **kwargs):
        name = dispatch.kernel_name(kernel)
        if name in self.refused and not self.fits(kwargs):
            self.refused[name] += 1
            kernel = _OutOfResources()
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)


class _OutOfResources:
    """A kernel whose every launch raises what Triton raises when a build needs more than the GPU gives a block."""

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            from triton.runtime.errors import OutOfResources

            raise OutOfResources(232448, 101376, "shared memory")
        return run


def cramped(kernels, fits=lambda settings: False) -> Cramped:
    """The context's launches (a test's :func:`..dispatch.kernels_on`, injected, no kernel rebound) through a
    :class:`Cramped` GPU; by default ``kernels`` fit no settings (Triton cannot build them here at all)."""
    here = dispatch.current()
    assert here is not dispatch_context._PROCESS, "inside a test's kernels_on only: the process's stays as it is"
    gpu = Cramped(kernels, fits)
    here.launcher = gpu
    return gpu


def assert_mix_gradients_match_reference(module: LinearAttention, tokens: int, grid: Optional[tuple[int, int]],
                                         params: list[torch.Tensor]) -> None:
    """The fast mix and the literal ``reference`` give the same gradients of q, k, v and ``params`` (float64, a
    random key mask), none of them all zero."""
    q, k, v = (t.requires_grad_() for t in random_qkv(2, module.num_heads, tokens, module.head_dim))
    key_valid = random_mask(2, tokens)
    probe = torch.randn_like(q)
    grads = []
    for mixer in (module.mix, module.reference):
        out = mixer(q, k, v, key_valid, grid)
        grads.append(torch.autograd.grad((out * probe).sum(), [q, k, v, *params]))
    for fast, slow in zip(*grads, strict=True):
        assert fast.abs().max() > 0
        torch.testing.assert_close(fast, slow, atol=1e-10, rtol=0)


def assert_masked_keys_reach_no_valid_output(module: LinearAttention, grid: Optional[tuple[int, int]],
                                             tokens: int) -> None:
    """Whatever the masked tokens' q, k, v hold, the valid tokens' outputs of the mix do not move."""
    q, k, v = random_qkv(2, module.num_heads, tokens, module.head_dim)
    key_valid = random_mask(2, tokens)
    before = module.mix(q, k, v, key_valid, grid)
    noise = (~key_valid)[:, None, :, None] * 100.0
    after = module.mix(q + noise, k - noise, v + noise, key_valid, grid)
    keep = key_valid[:, None, :, None].expand_as(before)
    torch.testing.assert_close(after[keep], before[keep], atol=1e-10, rtol=0)


def assert_masked_tokens_reach_no_valid_output(module: LinearAttention, tokens: int = 17) -> None:
    """The whole layer under an attention mask: padding may hold anything, valid tokens' outputs ignore it."""
    x, noise = random_tensors((2, tokens, module.dim), (2, tokens, module.dim))
    valid = random_mask(2, tokens)
    attn_mask = valid[:, None, None, :]
    out = module(x, attn_mask=attn_mask)
    changed = module(torch.where(valid[..., None], x, x + 10 * noise), attn_mask=attn_mask)
    torch.testing.assert_close(out[valid], changed[valid], atol=1e-10, rtol=0)


def assert_mix_matches_reference(module: LinearAttention, num_prefix: int, grid: Optional[tuple[int, int]],
                                 masked: bool) -> None:
    """The fast mix equals the literal ``reference`` (float64, 1e-10) on random q, k, v of the grid's tokens (6
    without one) and the prefix, under a random key mask where ``masked``."""
    tokens = num_prefix + (grid[0] * grid[1] if grid else 6)
    q, k, v = random_qkv(2, module.num_heads, tokens, module.head_dim)
    key_valid = random_mask(2, tokens) if masked else None
    fast = module.mix(q, k, v, key_valid, grid)
    assert fast.shape == q.shape
    torch.testing.assert_close(fast, module.reference(q, k, v, key_valid, grid), atol=1e-10, rtol=0)


def last_image_padded(batch: int = 2, tokens: int = 17, valid: int = 9) -> torch.Tensor:
    """A (B, 1, 1, N) attention mask: every token valid but the last image's from ``valid`` on."""
    mask = torch.ones(batch, 1, 1, tokens, dtype=torch.bool)
    mask[-1, ..., valid:] = False
    return mask


def assert_forward_matches_literal(module: LinearAttention, x: torch.Tensor,
                                   attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The whole layer equals its literal form (:func:`literal`; float64, 1e-10) and keeps x's shape; returns the
    fast output."""
    fast = module(x, attn_mask=attn_mask)
    assert fast.shape == x.shape
    torch.testing.assert_close(fast, literal(module, x, attn_mask=attn_mask), atol=1e-10, rtol=0)
    return fast


def assert_softmax_weights_kept(module: LinearAttention, source: Attention) -> None:
    """Every tensor of the softmax ``source``'s state dict is in the converted ``module``'s, unchanged."""
    state = module.state_dict()
    for name, value in source.state_dict().items():
        assert torch.equal(state[name], value), name


def nonzero_after_reset(module: LinearAttention) -> set[str]:
    """The parameters ``reset_extra_parameters`` makes non-zero after every parameter was zeroed."""
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    module.reset_extra_parameters()
    return {name for name, p in module.named_parameters() if p.abs().sum() > 0}


def assert_bf16_close_to_fp32(module: LinearAttention, grid: tuple[int, int], tokens: int = 17) -> None:
    """A float32 module: bf16 q, k, v mix finite and within 3e-2 of float32, and the whole layer under bf16
    autocast finite and within 5% of float32's largest output."""
    x = torch.randn(2, tokens, module.dim)
    ref = module(x)
    q, k, v = random_qkv(2, module.num_heads, tokens, module.head_dim, dtype=torch.float32)
    mixed = module.mix(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, grid)
    assert mixed.dtype == torch.bfloat16 and torch.isfinite(mixed).all()
    torch.testing.assert_close(mixed.float(), module.mix(q, k, v, None, grid), atol=3e-2, rtol=3e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = module(x)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
    assert (low.float() - ref).abs().max() < 0.05 * ref.abs().max()


def fused_rms_backward_on_the_cpu(grad_out, input, normalized_shape, rstd, weight, output_mask):
    """A CPU stand-in for torch's CUDA kernel aten::_fused_rms_norm_backward (the textbook RMSNorm backward in
    float32), checking what that kernel takes: contiguous rows and rstd of shape (…, 1)."""
    assert grad_out.is_contiguous() and input.is_contiguous() and list(normalized_shape) == [input.shape[-1]]
    assert rstd.shape == (*input.shape[:-1], 1) and rstd.dtype == torch.float32 and weight.dtype == input.dtype
    return load_benchmark("op_traffic").rms_norm_backward_on_the_cpu(grad_out, input, normalized_shape, rstd, weight,
                                                                     output_mask)


@contextlib.contextmanager
def cuda_rms_kernel_on_the_cpu():
    """MHLA's RMSNorm takes its CUDA branch on the CPU (torch's _fused_rms_norm, whose backward has no CPU kernel:
    :func:`fused_rms_backward_on_the_cpu` registered for it); yields the list of the backward's calls."""
    calls = []
    with torch.library._scoped_library("aten", "IMPL") as library:
        library.impl("_fused_rms_norm_backward",
                     lambda *a: calls.append(a) or fused_rms_backward_on_the_cpu(*a), "CPU")
        with dispatch.kernels_on(rms_norm_devices=("cpu",)):
            yield calls
