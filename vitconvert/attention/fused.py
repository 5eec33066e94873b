"""Fused linear attention on the GPU: the Triton kernels of :mod:`.triton_kernels` as two PyTorch custom ops.

``vitconvert::linear_attention`` (q, k, v) -> o                     (ELU, ReLU, InLine: the whole mixing)
``vitconvert::linear_state``  (k, v) -> per-segment S, z, zv        (float32, d×d per head and segment)
``vitconvert::linear_readout`` (q, R, r) -> o                       (q's dtype, laid out as (B, N, H, d))

Each op has a backward op and is registered with ``torch.library``, so autograd, ``torch.compile`` (one opaque
node each, no graph break) and ``torch.export`` see them as ops. ``linear_attention`` keeps only q, k, v and o
for backward, which recomputes the d×d states (as FlashAttention recomputes its scores), so a training step
holds no more than softmax's. MHLA uses the two others: between them, its block mixing W turns states into what
each query reads with d×d torch ops, which autograd differentiates as usual, W included.

When they run and how they are launched is :mod:`.dispatch`'s (re-exported here for the variants). A backward
kernel Triton cannot build turns the kernels off (as a forward one does) and that step's gradients come from
the ops' eager forms (:mod:`.fused_eager`), so training goes on.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import fused_eager
from .dispatch import (  # noqa: F401  (re-exported: the variants and tools reach dispatch through this module)
    CONFIG_ENV,
    ENV,
    TILE_ENV,
    KernelUnavailable,
    attempt,
    block_sizes,
    can_run,
    disable,
    launch,
    split_tokens,
    tile_args,
    use_fused_kernels,
)
from .fused_eager import ELU_PLUS_ONE, IDENTITY, RELU, RELU_PLUS_EPS  # noqa: E402,F401  (the kernels' φ codes)


def _segments(index: Optional[torch.Tensor], tokens: int) -> tuple[int, int]:
    """(segments, columns of the index table): one segment of every token without a table."""
    return (1, tokens) if index is None else (index.shape[0], index.shape[1])


def _total(partials: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """(B·H, G, splits, …) partial sums -> (B, H, G, …): summed over the token ranges (a view when there is one)."""
    total = partials.squeeze(2) if partials.shape[2] == 1 else partials.sum(2)
    return total.view(batch, heads, *total.shape[1:])


def _mask_arg(key_valid: Optional[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, int]:
    if key_valid is None:
        return like, 0  # never read (HAS_MASK is False)
    return key_valid, key_valid.stride(0)


# -- the ops -------------------------------------------------------------------------------------------------
@torch.library.custom_op("vitconvert::linear_state", mutates_args=())
def linear_state(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], index: Optional[torch.Tensor],
                 feature: int, feature_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """S (B, H, G, d, d), z and zv (B, H, G, d), float32, over the G segments of ``index`` (all tokens if None)."""
    from .triton_kernels import state_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    B, H, N, D = k.shape
    segments, length = _segments(index, N)
    splits, per = split_tokens(B * H, segments, length, k.device)
    block_n, block_d, warps = block_sizes(D)
    S = k.new_empty((B * H, segments, splits, D, D), dtype=torch.float32)
    Z = k.new_empty((B * H, segments, splits, D), dtype=torch.float32)
    ZV = torch.empty_like(Z)
    mask, s_mb = _mask_arg(key_valid, k)
    launch(state_fwd_kernel, (B * H, segments, splits),
        k, v, mask, index if index is not None else k, S, Z, ZV,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), s_mb,
        H, length, D, segments, splits, per, feature_eps,
        FEATURE=feature, HAS_MASK=key_valid is not None, HAS_INDEX=index is not None, BLOCK_N=block_n,
        BLOCK_D=block_d, **tile_args(k), num_warps=warps)
    return _total(S, B, H), _total(Z, B, H), _total(ZV, B, H)


@linear_state.register_fake
def _(k, v, key_valid, index, feature, feature_eps):
    B, H, N, D = k.shape
    segments = 1 if index is None else index.shape[0]
    S = k.new_empty((B, H, segments, D, D), dtype=torch.float32)
    return S, k.new_empty((B, H, segments, D), dtype=torch.float32), k.new_empty((B, H, segments, D),
                                                                                  dtype=torch.float32)


@torch.library.custom_op("vitconvert::linear_state_backward", mutates_args=())
def linear_state_backward(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                          index: Optional[torch.Tensor], dS: torch.Tensor, dz: torch.Tensor, dzv: torch.Tensor,
                          feature: int, feature_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dk, dv (the dtypes and shapes of k and v, contiguous) from the gradients of S, z, zv."""
    from .triton_kernels import state_bwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    B, H, N, D = k.shape
    segments, length = _segments(index, N)
    splits, per = split_tokens(B * H, segments, length, k.device)
    block_n, block_d, warps = block_sizes(D)
    dk, dv = torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(
        v, memory_format=torch.contiguous_format)
    mask, s_mb = _mask_arg(key_valid, k)
    launch(state_bwd_kernel, (B * H, segments, splits),
        k, v, mask, index if index is not None else k, dS.contiguous(), dz.contiguous(), dzv.contiguous(), dk, dv,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), s_mb,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        H, length, D, segments, per, feature_eps,
        FEATURE=feature, HAS_MASK=key_valid is not None, HAS_INDEX=index is not None, BLOCK_N=block_n,
        BLOCK_D=block_d, **tile_args(k), num_warps=warps)
    return dk, dv


@linear_state_backward.register_fake
def _(k, v, key_valid, index, dS, dz, dzv, feature, feature_eps):
    return torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(
        v, memory_format=torch.contiguous_format)


def _state_setup(ctx, inputs, output) -> None:
    k, v, key_valid, index, feature, feature_eps = inputs
    ctx.save_for_backward(k, v, key_valid, index)
    ctx.feature, ctx.feature_eps = feature, feature_eps


def _state_backward(ctx, dS, dz, dzv):
    k, v, key_valid, index = ctx.saved_tensors
    B, H = k.shape[:2]
    segments, D = (1 if index is None else index.shape[0]), k.shape[-1]
    zeros = k.new_zeros((B, H, segments, D), dtype=torch.float32)
    dS = dS if dS is not None else k.new_zeros((B, H, segments, D, D), dtype=torch.float32)
    dz, dzv = (dz if dz is not None else zeros), (dzv if dzv is not None else zeros)
    try:
        dk, dv = linear_state_backward(k, v, key_valid, index, dS, dz, dzv, ctx.feature, ctx.feature_eps)
    except KernelUnavailable as e:
        dk, dv, _, _ = _eager_gradients(e, fused_eager.state, (k, v, key_valid, index), (dS, dz, dzv),
                                        ctx.feature, ctx.feature_eps)
    return dk, dv, None, None, None, None


linear_state.register_autograd(_state_backward, setup_context=_state_setup)


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) output stored as (B, N, H, d): the attention module's transpose-and-reshape is then a view."""
    B, H, N, D = q.shape
    return q.new_empty((B, N, H, D)).transpose(1, 2)


@torch.library.custom_op("vitconvert::linear_readout", mutates_args=())
def linear_readout(q: torch.Tensor, R: torch.Tensor, r: torch.Tensor, index: Optional[torch.Tensor], feature: int,
                   feature_eps: float, eps: float, normalise: bool) -> torch.Tensor:
    """o of every query from the state R (B, H, G, d, d) and r (B, H, G, d) of its segment (module docstring)."""
    from .triton_kernels import readout_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    B, H, N, D = q.shape
    segments, length = _segments(index, N)
    splits, per = split_tokens(B * H, segments, length, q.device)
    block_n, block_d, warps = block_sizes(D)
    o = _output_like(q)
    launch(readout_fwd_kernel, (B * H, segments, splits),
        q, R.contiguous(), r.contiguous(), o, index if index is not None else q,
        q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2),
        H, length, D, segments, per, feature_eps, eps,
        FEATURE=feature, NORMALISE=normalise, HAS_INDEX=index is not None, BLOCK_N=block_n, BLOCK_D=block_d,
        **tile_args(q), num_warps=warps)
    return o


@linear_readout.register_fake
def _(q, R, r, index, feature, feature_eps, eps, normalise):
    return _output_like(q)


@torch.library.custom_op("vitconvert::linear_readout_backward", mutates_args=())
def linear_readout_backward(q: torch.Tensor, R: torch.Tensor, r: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                            index: Optional[torch.Tensor], feature: int, feature_eps: float, eps: float,
                            normalise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (q's dtype, contiguous), dR and dr (float32) of :func:`linear_readout`."""
    from .triton_kernels import readout_bwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    B, H, N, D = q.shape
    segments, length = _segments(index, N)
    splits, per = split_tokens(B * H, segments, length, q.device)
    block_n, block_d, warps = block_sizes(D)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dR = q.new_empty((B * H, segments, splits, D, D), dtype=torch.float32)
    dr = q.new_empty((B * H, segments, splits, D), dtype=torch.float32)
    launch(readout_bwd_kernel, (B * H, segments, splits),
        q, R.contiguous(), r.contiguous(), o, do, dq, dR, dr, index if index is not None else q,
        q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2), dq.stride(0), dq.stride(1), dq.stride(2),
        H, length, D, segments, splits, per, feature_eps, eps,
        FEATURE=feature, NORMALISE=normalise, HAS_INDEX=index is not None, BLOCK_N=block_n, BLOCK_D=block_d,
        **tile_args(q), num_warps=warps)
    return dq, _total(dR, B, H), _total(dr, B, H)


@linear_readout_backward.register_fake
def _(q, R, r, o, do, index, feature, feature_eps, eps, normalise):
    return (torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(R, dtype=torch.float32),
            torch.empty_like(r, dtype=torch.float32))


def _readout_setup(ctx, inputs, output) -> None:
    q, R, r, index, feature, feature_eps, eps, normalise = inputs
    ctx.save_for_backward(q, R, r, output, index)
    ctx.args = (feature, feature_eps, eps, normalise)


def _readout_backward(ctx, do):
    q, R, r, o, index = ctx.saved_tensors
    try:
        dq, dR, dr = linear_readout_backward(q, R, r, o, do, index, *ctx.args)
    except KernelUnavailable as e:
        dq, dR, dr, _ = _eager_gradients(e, fused_eager.readout, (q, R, r, index), (do,), *ctx.args)
    return dq, dR.to(R.dtype), dr.to(r.dtype), None, None, None, None, None


linear_readout.register_autograd(_readout_backward, setup_context=_readout_setup)


def _reader(S: torch.Tensor, z: torch.Tensor, zv: torch.Tensor, key_valid: Optional[torch.Tensor], tokens: int,
            scale: float, inline: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R, r, n): what every query reads. Kernel attention: S and z. InLine: A = (s/n)(S − z v̄ᵀ) and v̄ = zv/n,
    n the number of valid keys (B, 1, 1, 1)."""
    if key_valid is None:
        n = S.new_full((1, 1, 1, 1), float(tokens))
    else:
        n = key_valid.sum(dim=-1).clamp(min=1).to(torch.float32).view(-1, 1, 1, 1)
    if not inline:
        return S, z, n
    v_mean = zv / n
    return (S - z.unsqueeze(-1) * v_mean.unsqueeze(-2)) * (scale / n).unsqueeze(-1), v_mean, n


@torch.library.custom_op("vitconvert::linear_attention", mutates_args=())
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                     feature: int, feature_eps: float, eps: float, scale: float, inline: bool) -> torch.Tensor:
    """Kernel attention (or InLine, ``inline``) of (B, H, N, d) q, k, v: one launch when every head fits one
    program, else the state and read-out kernels. Autograd keeps q, k, v and o only; backward recomputes."""
    from .triton_kernels import attention_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    B, H, N, D = q.shape
    if split_tokens(B * H, 1, N, q.device)[0] > 1:
        S, z, zv = linear_state(k, v, key_valid, None, feature, feature_eps)
        R, r, _ = _reader(S, z, zv, key_valid, N, scale, inline)
        return linear_readout(q, R, r, None, feature, feature_eps, eps, not inline)
    block_n, block_d, warps = block_sizes(D)
    o = _output_like(q)
    mask, s_mb = _mask_arg(key_valid, k)
    launch(attention_fwd_kernel, (B * H,),
        q, k, v, mask, o,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), s_mb, o.stride(0), o.stride(1), o.stride(2),
        H, N, D, feature_eps, eps, scale,
        FEATURE=feature, INLINE=inline, HAS_MASK=key_valid is not None, BLOCK_N=block_n, BLOCK_D=block_d,
        **tile_args(q), num_warps=warps)
    return o


@linear_attention.register_fake
def _(q, k, v, key_valid, feature, feature_eps, eps, scale, inline):
    return _output_like(q)


@torch.library.custom_op("vitconvert::linear_attention_backward", mutates_args=())
def linear_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                              key_valid: Optional[torch.Tensor], feature: int, feature_eps: float, eps: float,
                              scale: float, inline: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of :func:`linear_attention`: the state recomputed, the read-out's backward, then the state's
    (InLine's d×d chain rule in between: dS = (s/n) dA, dz = −dS v̄, dzv = (dv̄ − dSᵀ z) / n)."""
    S, z, zv = linear_state(k, v, key_valid, None, feature, feature_eps)
    R, r, n = _reader(S, z, zv, key_valid, q.shape[2], scale, inline)
    dq, dR, dr = linear_readout_backward(q, R, r, o, do, None, feature, feature_eps, eps, not inline)
    if inline:
        dS = dR * (scale / n).unsqueeze(-1)
        dz = -(dS @ r.unsqueeze(-1)).squeeze(-1)
        dzv = (dr - (dS.transpose(-2, -1) @ z.unsqueeze(-1)).squeeze(-1)) / n
    else:
        dS, dz, dzv = dR, dr, torch.zeros_like(dr)
    dk, dv = linear_state_backward(k, v, key_valid, None, dS, dz, dzv, feature, feature_eps)
    return dq, dk, dv


@linear_attention_backward.register_fake
def _(q, k, v, o, do, key_valid, feature, feature_eps, eps, scale, inline):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, key_valid, *args = inputs
    ctx.save_for_backward(q, k, v, output, key_valid)
    ctx.args = args


def _attention_backward(ctx, do):
    q, k, v, o, key_valid = ctx.saved_tensors
    try:
        dq, dk, dv = linear_attention_backward(q, k, v, o, do, key_valid, *ctx.args)
    except KernelUnavailable as e:
        dq, dk, dv, _ = _eager_gradients(e, _attention_eager, (q, k, v, key_valid), (do,), *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


linear_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


def _attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                     feature: int, feature_eps: float, eps: float, scale: float, inline: bool) -> torch.Tensor:
    """:func:`linear_attention` in torch (its backward's fallback)."""
    S, z, zv = fused_eager.state(k, v, key_valid, None, feature, feature_eps)
    R, r, _ = _reader(S, z, zv, key_valid, q.shape[2], scale, inline)
    return fused_eager.readout(q, R, r, None, feature, feature_eps, eps, not inline)


def _eager_gradients(error: KernelUnavailable, form, inputs, grads, *args):
    """A backward kernel that cannot be built here: the kernels go off for the process (one warning) and this
    step's gradients come from the op's eager form."""
    disable(error)
    return fused_eager.gradients(form, inputs, grads, *args)


# -- the variants' forms ------------------------------------------------------------------------------------
def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                     feature: int, eps: float, feature_eps: float = 0.0) -> torch.Tensor:
    """φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)·Σ_j φ(k_j) + ε) on raw (B, H, N, d) q, k, v (φ applied in the kernels)."""
    return linear_attention(q, k, v, key_valid, feature, feature_eps, eps, 1.0, False)


def inline_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """InLine's out_i = q_iᵀ (s/n)(Σ k vᵀ − (Σ k) v̄ᵀ) + v̄ (φ = identity)."""
    return linear_attention(q, k, v, key_valid, IDENTITY, 0.0, 0.0, scale, True)


def segmented_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                        index: torch.Tensor, mixing: torch.Tensor, feature: int, feature_eps: float,
                        eps: float) -> torch.Tensor:
    """Normalised kernel attention where queries of segment a read Σ_s mixing[a, s]·[S_s | z_s] (MHLA)."""
    S, z, _ = linear_state(k, v, key_valid, index, feature, feature_eps)
    mixing = mixing.to(torch.float32)
    R = torch.einsum("as,bhsxy->bhaxy", mixing, S)
    r = torch.einsum("as,bhsx->bhax", mixing, z)
    return linear_readout(q, R, r, index, feature, feature_eps, eps, True)
