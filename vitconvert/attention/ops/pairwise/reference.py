"""MHLA's pairwise op's N×N reference: the blocked attention with its mixing W̃ looked up per pair of tokens."""

from __future__ import annotations

from typing import Optional

import torch

from ...blocks import extended_block_mix
from ..linear.reference import kernel_attention_reference


def pairwise_reference(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                       segments: torch.Tensor, mixing: torch.Tensor, eps: float) -> torch.Tensor:
    """A_ij = φ(q_i)·φ(k_j)·W̃[s(i), s(j)] (``segments``: s, each token's block), masked keys 0, o = A v / (Σ_j A_ij
    + ε): what ``vitconvert::pairwise_attention`` and ``vitconvert::blocked_attention`` compute. ``mixing``: W̃
    (G × G), or W (G − 1 × G − 1) with W̃'s last row and column ones (:func:`...blocks.extended_block_mix`)."""
    seg = segments.long()
    return kernel_attention_reference(phi_q, phi_k, v, key_valid, eps, extended_block_mix(mixing)[seg][:, seg])
