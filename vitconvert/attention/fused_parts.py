"""The two building blocks of the fused ops (:mod:`.fused`): the launches of the per-segment states and of the
read-out, each way.

:func:`segment_states`  (k, v) -> per-segment S, z, zv        (float32, d×d per head and segment)
:func:`run_readout`     (q, R, r) -> o                        (q's dtype, laid out as (B, N, H, d))

They are not ops of their own: ``vitconvert::linear_attention`` and ``vitconvert::blocked_attention`` call them, and
their eager forms are :func:`.fused_eager.state` and :func:`.fused_eager.readout`.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import fused_eager
from .dispatch import KernelUnavailable, block_sizes, disable, launch, pipeline_stages, split_tokens, tile_args


def _segments(index: Optional[torch.Tensor], tokens: int) -> tuple[int, int]:
    """(segments, columns of the index table): one segment of every token without a table."""
    return (1, tokens) if index is None else (index.shape[0], index.shape[1])


def _total(partials: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """(B·H, G, splits, …) partial sums -> (B, H, G, …): summed over the token ranges (a view when there is one)."""
    if partials.shape[2] == 1:  # one view op, not a squeeze and a view (each op costs host time)
        return partials.view(batch, heads, partials.shape[1], *partials.shape[3:])
    return partials.sum(2).view(batch, heads, partials.shape[1], *partials.shape[3:])


def valid_keys(key_valid: torch.Tensor) -> torch.Tensor:
    """(B,) float32: the valid keys of each image, at least 1 (the n that normalises a sum over keys)."""
    return key_valid.sum(dim=-1).clamp(min=1).to(torch.float32)


def _unmasked_chunks(head_dim: int, block_d: int) -> bool:
    """EVEN_D of the backward kernels: whole chunks without masks where the head fills its tile, up to 64 (what the
    unmasked code builds to at 128 for sm_90: benchmarks/kernel_resources.py --arch sm_90)."""
    return head_dim == block_d <= 64


def _mask_arg(key_valid: Optional[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, int]:
    if key_valid is None:
        return like, 0  # never read (HAS_MASK is False)
    return key_valid, key_valid.stride(0)


# -- the ops -------------------------------------------------------------------------------------------------
def segment_states(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                   index: Optional[torch.Tensor], feature: int, feature_eps: float,
                   sum_values: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """S (B, H, G, d, d), z and zv (B, H, G, d), float32, over the G segments of ``index`` (all tokens if None);
    zv None unless ``sum_values`` (InLine reads it, the others do not: the kernel leaves its sums out)."""
    from .split_kernels import state_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    k, v = unit_rows(k), unit_rows(v)
    B, H, N, D = k.shape
    segments, length = _segments(index, N)
    splits, per = split_tokens(B * H, segments, length, k.device)
    block_n, block_d, warps = block_sizes(D)
    S = k.new_empty((B * H, segments, splits, D, D), dtype=torch.float32)
    Z = k.new_empty((B * H, segments, splits, D), dtype=torch.float32)
    ZV = torch.empty_like(Z) if sum_values else Z  # (not written without SUM_V)
    mask, s_mb = _mask_arg(key_valid, k)
    launch(state_fwd_kernel, (B * H, segments, splits),
        k, v, mask, index if index is not None else k, S, Z, ZV,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), s_mb,
        H, length, D, segments, splits, per, feature_eps,
        FEATURE=feature, HAS_MASK=key_valid is not None, HAS_INDEX=index is not None, SUM_V=sum_values,
        EVEN_D=D == block_d, BLOCK_N=block_n, BLOCK_D=block_d, **tile_args(k), num_warps=warps,
        num_stages=pipeline_stages())
    return _total(S, B, H), _total(Z, B, H), (_total(ZV, B, H) if sum_values else None)


def state_gradients(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                    index: Optional[torch.Tensor], dS: torch.Tensor, dz: torch.Tensor, dzv: Optional[torch.Tensor],
                    feature: int, feature_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dk, dv (the dtypes and shapes of k and v, laid out as the output: :func:`_output_like`) from the gradients
    of S, z, zv (None: zero, as for every variant but InLine: no torch op makes the zeros, the kernel adds none)."""
    from .split_kernels import state_bwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    k, v = unit_rows(k), unit_rows(v)
    B, H, N, D = k.shape
    segments, length = _segments(index, N)
    splits, per = split_tokens(B * H, segments, length, k.device)
    block_n, block_d, warps = block_sizes(D)
    dk, dv = _output_like(k), _output_like(v)
    mask, s_mb = _mask_arg(key_valid, k)
    dz = dz.contiguous()
    launch(state_bwd_kernel, (B * H, segments, splits),
        k, v, mask, index if index is not None else k, dS.contiguous(), dz, dz if dzv is None else dzv.contiguous(),
        dk, dv, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), s_mb,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        H, length, D, segments, per, feature_eps,
        FEATURE=feature, HAS_MASK=key_valid is not None, HAS_INDEX=index is not None, HAS_DZV=dzv is not None,
        EVEN_D=_unmasked_chunks(D, block_d), BLOCK_N=block_n, BLOCK_D=block_d, **tile_args(k), num_warps=warps,
        num_stages=pipeline_stages())
    return dk, dv


def unit_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (the kernels step through d by 1), else a copy: an
    output gradient expanded from a sum (``out.sum().backward()``: every stride 0) or a caller's transposed view
    read garbage before."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """Batch, head and token strides of (B, H, N, d) tensors whose last dimension is contiguous."""
    return tuple(s for t in tensors for s in t.stride()[:3])


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) output stored as (B, N, H, d): the attention module's transpose-and-reshape is then a view.
    The backwards write dq, dk, dv so too: the layer's q/k/v split stacks them into the qkv projection's
    (B, N, 3, H, d) gradient from contiguous rows, and MHLA's RMSNorm backward reads them as its rows, no copy."""
    B, H, N, D = q.shape
    return q.new_empty((B, N, H, D)).transpose(1, 2)


def run_readout(q: torch.Tensor, R: torch.Tensor, r: torch.Tensor, index: Optional[torch.Tensor], feature: int,
                   feature_eps: float, eps: float, normalise: bool) -> torch.Tensor:
    """o of every query from the state R (B, H, G, d, d) and r (B, H, G, d) of its segment (module docstring)."""
    from .split_kernels import readout_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    q = unit_rows(q)
    B, H, N, D = q.shape
    segments, length = _segments(index, N)
    splits, per = split_tokens(B * H, segments, length, q.device)
    block_n, block_d, warps = block_sizes(D)
    o = _output_like(q)
    launch(readout_fwd_kernel, (B * H, segments, splits),
        q, R.contiguous(), r.contiguous(), o, index if index is not None else q,
        q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2),
        H, length, D, segments, per, feature_eps, eps,
        FEATURE=feature, NORMALISE=normalise, HAS_INDEX=index is not None, EVEN_D=D == block_d, BLOCK_N=block_n,
        BLOCK_D=block_d, **tile_args(q), num_warps=warps, num_stages=pipeline_stages())
    return o


def run_readout_backward(q: torch.Tensor, R: torch.Tensor, r: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                            index: Optional[torch.Tensor], feature: int, feature_eps: float, eps: float,
                            normalise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (q's dtype and :func:`_output_like`'s layout), dR and dr (float32) of :func:`run_readout`."""
    from .split_kernels import readout_bwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    q, o, do = unit_rows(q), unit_rows(o), unit_rows(do)
    B, H, N, D = q.shape
    segments, length = _segments(index, N)
    splits, per = split_tokens(B * H, segments, length, q.device)
    block_n, block_d, warps = block_sizes(D)
    dq = _output_like(q)
    dR = q.new_empty((B * H, segments, splits, D, D), dtype=torch.float32)
    dr = q.new_empty((B * H, segments, splits, D), dtype=torch.float32)
    launch(readout_bwd_kernel, (B * H, segments, splits),
        q, R.contiguous(), r.contiguous(), o, do, dq, dR, dr, index if index is not None else q,
        q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2), dq.stride(0), dq.stride(1), dq.stride(2),
        H, length, D, segments, splits, per, feature_eps, eps,
        FEATURE=feature, NORMALISE=normalise, HAS_INDEX=index is not None, EVEN_D=_unmasked_chunks(D, block_d),
        BLOCK_N=block_n, BLOCK_D=block_d, **tile_args(q), num_warps=warps, num_stages=pipeline_stages())
    return dq, _total(dR, B, H), _total(dr, B, H)


def _eager_gradients(error: KernelUnavailable, op: str, form, inputs, grads, *args):
    """A backward kernel that cannot be built here: ``op``'s kernels go off for the process (one warning) and
    this step's gradients come from the op's eager form."""
    disable(error, op)
    return fused_eager.gradients(form, inputs, grads, *args)
