"""The head norms' reference: MHLA's RMSNorm of q or k over all heads' channels as the official code writes it
(``RMSNorm(dim)`` on (B, N, H·d) tokens), which :func:`.lean.rms_over_heads` computes without the copies."""

from __future__ import annotations

import torch


def rms_norm_over_heads(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The official ``RMSNorm(dim)`` on (B, H, N, d) q or k: F.rms_norm of each token over all heads' channels."""
    B, H, N, d = t.shape
    flat = torch.nn.functional.rms_norm(t.transpose(1, 2).reshape(B, N, H * d), (H * d,), weight.to(t.dtype))
    return flat.reshape(B, N, H, d).transpose(1, 2)
