"""ELU and ReLU kernel attention (Katharopoulos et al. 2020, "Transformers are RNNs"), non-causal.

out_i = φ(q_i)ᵀ (Σ_j φ(k_j) v_jᵀ) / (φ(q_i)ᵀ Σ_j φ(k_j) + ε). The d×d state S and the normaliser z are
formed once per head, so the cost is O(N·d²). Same parameters as softmax attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Optional

import torch
from torch.nn import functional as F

from .base import Grid, LinearAttention


def elu_feature(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


def relu_feature(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def kernel_attention(phi_q, phi_k, v, key_valid: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Σ-form of normalised kernel attention on (B, H, N, d) features; sums in float32 at least."""
    dtype = v.dtype
    acc = torch.promote_types(dtype, torch.float32)
    phi_q, phi_k, v = phi_q.to(acc), phi_k.to(acc), v.to(acc)
    if key_valid is not None:
        phi_k = phi_k * key_valid[:, None, :, None].to(acc)
    state = phi_k.transpose(-2, -1) @ v  # (B, H, d, d): Σ_j φ(k_j) v_jᵀ
    z = phi_k.sum(dim=-2, keepdim=True)  # (B, H, 1, d): Σ_j φ(k_j)
    numerator = phi_q @ state
    denominator = (phi_q * z).sum(dim=-1, keepdim=True) + eps
    return (numerator / denominator).to(dtype)


def kernel_attention_reference(phi_q, phi_k, v, key_valid: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """The explicit N×N form: A_ij = φ(q_i)·φ(k_j), rows normalised, times V."""
    scores = phi_q @ phi_k.transpose(-2, -1)
    if key_valid is not None:
        scores = scores * key_valid[:, None, None, :].to(scores.dtype)
    return (scores @ v) / (scores.sum(dim=-1, keepdim=True) + eps)


class KernelAttention(LinearAttention):
    feature: ClassVar[Callable[[torch.Tensor], torch.Tensor]]
    default_options = {"eps": 1e-6}

    def mix(self, q, k, v, key_valid, grid: Grid):
        phi = type(self).feature
        return kernel_attention(phi(q), phi(k), v, key_valid, self.options["eps"])

    def reference(self, q, k, v, key_valid, grid: Grid):
        phi = type(self).feature
        return kernel_attention_reference(phi(q), phi(k), v, key_valid, self.options["eps"])


class EluAttention(KernelAttention):
    """φ(x) = elu(x) + 1: strictly positive features, so the normaliser never vanishes."""

    variant = "elu"
    feature = staticmethod(elu_feature)


class ReluAttention(KernelAttention):
    """φ(x) = relu(x): sparse features; ε keeps rows whose features are all zero finite."""

    variant = "relu"
    feature = staticmethod(relu_feature)
