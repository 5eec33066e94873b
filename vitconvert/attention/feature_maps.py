"""Hedgehog's learned feature map for kernel attention (the ``feature_map`` option of ``elu`` and ``relu``).

Hedgehog (Zhang et al., ICLR 2024, "The Hedgehog & the Porcupine: Expressive Linear Attentions with Softmax
Mimicry", arXiv:2402.04347) replaces a fixed φ by a small trained one, per head and separately for queries and
keys: φ(x) = [softmax(xW + b), softmax(−(xW + b))] over the feature dimension (2d features from d), W
initialised to the identity and b to zero (here W = 2·I by default: ``init_scale``, measured). Spiky (softmax)
and monotonic (the ± pair) is what the paper found a feature map needs to mimic softmax attention's weights.
LoLCATs (Zhang et al. 2024) trains the same map on an attention-output MSE, which is the loss our distillation
already has; Hedgehog's own loss, the weights' cross-entropy, is ``attn_loss: weight_ce``
(distill/attention_weights.py).

With the q/k projections trained too, as our distillation trains them, xW + b adds no function they could not
give ((x W_q + b_q) W + b is another projection): what it changes is the training. Measured on the digits, the
trained map beat the same softmax pair without it, and the variant's own φ after the same map did not win
reliably (docs/results.md, "Learned feature maps (Hedgehog, issue 38)"); both were dropped.

No fused kernel computes a trained φ: a layer with one runs the eager form (docs/performance.md).
"""

from __future__ import annotations

import torch
from torch import nn

# name -> what it computes (the option's choices, in the order users see them)
FEATURE_MAPS: dict[str, str] = {
    "fixed": "the variant's own φ (elu + 1, relu), no parameters",
    "hedgehog": "Hedgehog's trained map [softmax(xW + b), softmax(−xW − b)] per head, q and k apart, from W = S·I "
                "(init_scale), b = 0",
}
# Hedgehog's start W = S·I. The paper's S = 1 gives near-uniform attention rows on the digits; S = 2 (a softmax
# temperature of ½) won every cell of 2 and 5 epochs, both regimes, 3 seeds (docs/results.md, Hedgehog section)
DEFAULT_INIT_SCALE = 2.0


class HeadwiseLinear(nn.Module):
    """xW_h + b_h for each head h of a (B, H, N, d) tensor; W_h (d×d) starts as ``init_scale`` times the identity,
    b_h at zero."""

    def __init__(self, heads: int, dim: int, init_scale: float = DEFAULT_INIT_SCALE, device=None, dtype=None):
        super().__init__()
        self.init_scale = init_scale
        self.weight = nn.Parameter(torch.empty(heads, dim, dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(heads, dim, device=device, dtype=dtype))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """W = S·I, b = 0: the features the map is given, softmax at temperature 1/S (Hedgehog's init is S = 1; ours
        is 2, whose sharper rows train faster on the digits)."""
        eye = torch.eye(self.weight.shape[-1], dtype=self.weight.dtype) * self.init_scale
        self.weight.copy_(eye.expand_as(self.weight))
        self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight.to(x.dtype)) + self.bias.to(x.dtype)[:, None, :]


def hedgehog_features(y: torch.Tensor) -> torch.Tensor:
    """[softmax(y), softmax(−y)] over the last dimension: d -> 2d non-negative features."""
    return torch.cat((torch.softmax(y, dim=-1), torch.softmax(-y, dim=-1)), dim=-1)

