"""The linear ops' N×N references: the output written out as its (B, H, N, N) weights times V, the slow literal
form each kernel and eager path is checked against (the variants' ``reference()``, tests/attention/, benchmarks),
and the literal form of a trained feature map's φ that such a reference takes.
One home, so a test and a benchmark cannot check against two readings of the same formula."""

from __future__ import annotations

from typing import Optional

import torch


def kernel_attention_reference(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                               key_valid: Optional[torch.Tensor], eps: float,
                               mixing: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The explicit N×N form: A_ij = φ(q_i)·φ(k_j) (times ``mixing``'s (N, N) entry where given: MHLA's
    W̃[s(i), s(j)]), masked keys 0, rows normalised, times V."""
    scores = phi_q @ phi_k.transpose(-2, -1)
    if mixing is not None:
        scores = scores * mixing
    if key_valid is not None:
        scores = scores * key_valid[:, None, None, :].to(scores.dtype)
    return (scores @ v) / (scores.sum(dim=-1, keepdim=True) + eps)


def inline_weights(q: torch.Tensor, k: torch.Tensor, key_valid: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """InLine's explicit (B, H, N, N) weights w_ij as the paper writes them; masked keys get weight 0."""
    B, _, N, _ = k.shape
    valid = key_valid if key_valid is not None else torch.ones(B, N, dtype=torch.bool, device=k.device)
    n = valid.sum(dim=-1).clamp(min=1).to(k.dtype)[:, None, None, None]
    k_bar = (k * valid[:, None, :, None].to(k.dtype)).sum(dim=-2, keepdim=True) / n
    w = (scale / n) * (q @ k.transpose(-2, -1)) - (scale / n) * (q @ k_bar.transpose(-2, -1)) + 1 / n
    return w * valid[:, None, None, :].to(w.dtype)


def hedgehog_features_literal(y: torch.Tensor) -> torch.Tensor:
    """Hedgehog's φ, [softmax(y), softmax(−y)] over the last dimension, with each softmax written as exp over its
    sum: the reference's form of feature_maps.hedgehog_features."""
    up, down = torch.exp(y - y.amax(-1, keepdim=True)), torch.exp(-y - (-y).amax(-1, keepdim=True))
    return torch.cat((up / up.sum(-1, keepdim=True), down / down.sum(-1, keepdim=True)), dim=-1)
