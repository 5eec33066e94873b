"""What the fused kernels compute, written in torch: the custom ops' eager forms.

Backward runs them when Triton cannot build a backward kernel for the GPU at hand (registers, shared memory):
the forward already ran on the kernels, so autograd differentiates these forms of the same ops instead, and the
step goes on. The same math as :mod:`.kernel_parts` (φ in float32, float32 states, −1 pads in the segment
index table), with O(N) memory: segments are gathered, never expanded to N×G.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IDENTITY, ELU_PLUS_ONE, RELU, RELU_PLUS_EPS = 0, 1, 2, 3  # φ codes, as the kernels number them


def phi(x: torch.Tensor, feature: int, feature_eps: float) -> torch.Tensor:
    """φ(x) in float32 (the kernels' ``_phi``)."""
    x = x.to(torch.float32)
    if feature == ELU_PLUS_ONE:
        return F.elu(x) + 1.0
    if feature == RELU:
        return torch.relu(x)
    if feature == RELU_PLUS_EPS:
        return torch.relu(x) + feature_eps
    return x


def _by_segment(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (B, H, G, L, d): each segment's tokens, zero rows where the table pads with −1."""
    padded = F.pad(t, (0, 0, 0, 1))  # row N is the zero row every −1 points to
    rows = torch.where(index >= 0, index, t.shape[2]).long()
    return padded[:, :, rows]


def state(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], index: Optional[torch.Tensor],
          feature: int, feature_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`.launches.segment_states`: S = Σ φ(k) vᵀ (B, H, G, d, d), z = Σ φ(k) and zv = Σ v (B, H, G, d),
    float32, over the valid keys of each segment."""
    phi_k, v = phi(k, feature, feature_eps), v.to(torch.float32)
    if key_valid is not None:
        valid = key_valid.to(torch.float32)[:, None, :, None]
        phi_k, v = phi_k * valid, v * valid
    if index is None:
        phi_k, v = phi_k.unsqueeze(2), v.unsqueeze(2)
    else:
        phi_k, v = _by_segment(phi_k, index), _by_segment(v, index)
    return phi_k.transpose(-2, -1) @ v, phi_k.sum(-2), v.sum(-2)


def readout(q: torch.Tensor, R: torch.Tensor, r: torch.Tensor, index: Optional[torch.Tensor], feature: int,
            feature_eps: float, eps: float, normalise: bool) -> torch.Tensor:
    """:func:`.launches.run_readout`: o = φ(q) R / (φ(q)·r + ε) (``normalise``) or φ(q) R + r, each query
    reading its segment's R and r; q's dtype."""
    phi_q = phi(q, feature, feature_eps)
    if index is None:
        out = _read(phi_q.unsqueeze(2), R, r, eps, normalise).squeeze(2)
        return out.to(q.dtype)
    per_segment = _read(_by_segment(phi_q, index), R, r, eps, normalise)  # (B, H, G, L, d)
    rows = index.reshape(-1).long()
    keep = rows >= 0
    out = phi_q.new_zeros(phi_q.shape)
    out[:, :, rows[keep]] = per_segment.flatten(2, 3)[:, :, keep]
    return out.to(q.dtype)


def _read(phi_q: torch.Tensor, R: torch.Tensor, r: torch.Tensor, eps: float, normalise: bool) -> torch.Tensor:
    num = phi_q @ R.to(torch.float32)
    if normalise:
        return num / ((phi_q * r.to(torch.float32).unsqueeze(-2)).sum(-1, keepdim=True) + eps)
    return num + r.to(torch.float32).unsqueeze(-2)
