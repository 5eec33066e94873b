"""Hedgehog's attention-weight loss (``distillation.attn_loss: weight_ce``): each layer's normalised linear weights
trained toward the teacher's softmax weights by their cross-entropy.

Hedgehog (Zhang et al., ICLR 2024, arXiv:2402.04347) trains its feature map on −Σ_j a_ij log â_ij, where a_ij =
softmax_j(q_i·k_j / √d) is the teacher's weight and â_ij = φ(q_i)·φ(k_j) / Σ_j' φ(q_i)·φ(k_j') the student's,
averaged over the queries and over the layers (as LoLCATs' attention transfer averages it). Only a normalised
kernel has such weights: ELU and ReLU attention, with their own φ or Hedgehog's map (feature_map=hedgehog).
InLine's weights are normalised by subtraction (they can be negative), MHLA mixes block states and TTT has no
weights at all: those are refused before the run starts.

Neither model forms its N×N weights in its forward (timm's fused attention calls SDPA; the linear forms never
do), so the taps recompute them from each attention call's input: the teacher's q and k from its qkv projection
(no gradient), the student's from its own projection and φ (with gradient).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..attention.kernel import KernelAttention
from ..attention.tensors import accumulation_dtype, full_precision
from ..capture import Tap
from ..errors import VitconvertError, setting

WEIGHT_LOSS = "weight_ce"  # the attn_loss value
# â below this is taken as this in the log: a ReLU pair with disjoint features has weight 0 (log 0 = −∞)
SMALLEST_WEIGHT = 1e-12


def softmax_weights(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, N) softmax(q kᵀ · scale) of timm's ``Attention`` on its input ``x``, as its forward computes them
    (q_norm and k_norm included; no mask: the images of a distill run have none), in float32 at least, also
    under autocast."""
    B, N, _ = x.shape
    qkv = module.qkv(x).reshape(B, N, 3, module.num_heads, module.head_dim).permute(2, 0, 3, 1, 4)
    acc = accumulation_dtype(x.dtype)
    q, k = module.q_norm(qkv[0]).to(acc), module.k_norm(qkv[1]).to(acc)
    with full_precision(x):
        return ((q * module.scale) @ k.transpose(-2, -1)).softmax(dim=-1)


def kernel_weights(module: KernelAttention, x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, N) â_ij = φ(q_i)·φ(k_j) / (Σ_j φ(q_i)·φ(k_j) + ε) of a kernel attention layer on its input, in
    float32 at least (also under autocast), with the gradient to q, k and φ's parameters (the same φ and ε its
    forward uses)."""
    q, k, _ = module.project(module.prepare(x, None, module.resolve_grid(x.shape[1]))[0])
    phi_q, phi_k = module.features(q, k)
    acc = accumulation_dtype(x.dtype)
    with full_precision(x):
        scores = phi_q.to(acc) @ phi_k.to(acc).transpose(-2, -1)
        return scores / (scores.sum(dim=-1, keepdim=True) + module.eps)


def weight_cross_entropy(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """−Σ_j a_ij log â_ij, the mean over batch, heads and queries i: one layer's term."""
    return -(teacher * student.clamp_min(SMALLEST_WEIGHT).log()).sum(dim=-1).mean()


def weight_taps(attn_loss: str, student: list[nn.Module],
                teacher: list[nn.Module]) -> tuple[Optional[Tap], Optional[Tap]]:
    """(student tap, teacher tap) for the recipe's attention loss: None, None for the output distances (the taps
    keep each layer's output); the weights for ``weight_ce``, whose layers are checked first."""
    if attn_loss != WEIGHT_LOSS:
        return None, None
    check_layers(student, teacher)
    return kernel_weights, softmax_weights


def check_layers(student: list[nn.Module], teacher: list[nn.Module]) -> None:
    """One line naming the first layer whose weights the loss cannot form."""
    from timm.layers import Attention

    for i, (mine, theirs) in enumerate(zip(student, teacher, strict=True)):
        if not isinstance(mine, KernelAttention):
            raise VitconvertError(f"{setting('attn_loss', WEIGHT_LOSS)} needs attention weights that are a "
                                  f"normalised kernel (elu, relu, feature_map=hedgehog); the student's layer {i} is "
                                  f"{getattr(mine, 'variant', type(mine).__name__)}: use {setting('attn_loss', 'mse')}")
        if type(theirs) is not Attention:
            raise VitconvertError(f"{setting('attn_loss', WEIGHT_LOSS)} recomputes the teacher's weights from timm's "
                                  f"Attention; the teacher's layer {i} is {type(theirs).__name__}: use "
                                  f"{setting('attn_loss', 'mse')}")
