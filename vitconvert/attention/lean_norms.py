"""Norms of MHLA's fused path written out by hand, so that a training forward keeps no more than softmax's.

Under autocast, autograd's own F.rms_norm and F.layer_norm run in float32 and keep float32 copies of their
inputs: N×C tensors that the softmax layer does not hold. Here:

- the RMSNorm of q and k over all heads' channels is computed inside ``vitconvert::blocked_attention`` (its
  output is a transient of the op), and its backward recomputes the per-token rstd from the raw q, k the op keeps
  anyway (views of the qkv projection): :func:`rms_over_heads` and :func:`rms_over_heads_backward`;
- the LayerNorm on the layer input (:class:`OutputSavingLayerNorm`) keeps its output in the autocast dtype, the
  very tensor the qkv projection keeps, and recovers x̂ = (y − b) / w from it in backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from .tensors import accumulation_dtype


def _per_head(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """RMSNorm's (H·d,) weight laid over (B, H, N, d) ``like``, in float32 at least."""
    return weight.to(accumulation_dtype(like.dtype)).view(1, like.shape[1], 1, like.shape[3])


def rms_rstd(t: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, 1, N, 1) 1/rms of each token over all heads' channels, in float32 at least."""
    x = t.to(accumulation_dtype(t.dtype))
    return torch.rsqrt(x.square().mean(dim=(1, 3), keepdim=True) + eps)


def rms_over_heads(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each token of (B, H, N, d) ``t`` over its H·d channels, in float32 at least, back in t's dtype."""
    return (t.to(accumulation_dtype(t.dtype)) * rms_rstd(t, eps) * _per_head(weight, t)).to(t.dtype)


def rms_over_heads_backward(t: torch.Tensor, weight: torch.Tensor, eps: float,
                            grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dt, dweight) of :func:`rms_over_heads` from the gradient of its output, in float32 at least (rstd
    recomputed)."""
    rstd = rms_rstd(t, eps)
    x, grad = t.to(rstd.dtype), grad.to(rstd.dtype)
    scaled = grad * _per_head(weight, t)
    dt = rstd * (scaled - x * rstd.square() * (scaled * x).mean(dim=(1, 3), keepdim=True))
    dweight = (grad * x * rstd).sum(dim=(0, 2)).reshape(-1)
    return dt.to(t.dtype), dweight.to(weight.dtype)


def rms_pair(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k normalised (when their weights are given), else as they are."""
    if q_weight is None or k_weight is None:
        return q, k
    return rms_over_heads(q, q_weight, eps), rms_over_heads(k, k_weight, eps)
