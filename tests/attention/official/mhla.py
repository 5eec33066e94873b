"""The core of MHLA as the official code computes it, vendored for an equivalence test.

Source: DAGroup-PKU/MHLA, mhla_image_classification/models/modules/attention/mhla.py (commit 93d8043),
``MHLA_Normed_Torch.forward`` and ``_process_qkv_impl`` and ``BlockDistanceConv`` (license: the repository's).
Kept to the lines that define the function: φ = relu + eps on q and k, per-block states kv = φ(K)ᵀV mixed
across blocks by the 1×1 block conv (out[a] = Σ_b W[a, b] in[b]), and the normaliser ``piece_attn(q @ k_sum)
+ eps``, the per-block scalars φ(q_{b,l})·z_b mixed by the same conv. Tensors are blocked, as the official
forward receives them: (batch·heads, blocks, tokens per block, head_dim). LePE, norms and projections are left
out (they do not differ between the two codes).
"""

import torch


def piece_attn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``nn.Conv2d(blocks, blocks, 1, bias=False)`` with ``weight`` (blocks, blocks) on (BH, blocks, a, b)."""
    return torch.nn.functional.conv2d(x, weight[:, :, None, None])


def official_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor,
                  eps: float = 1e-6) -> torch.Tensor:
    k = torch.relu(k) + eps
    q = torch.relu(q) + eps
    k = k.transpose(-2, -1)
    kv = torch.matmul(k, v)  # [B*H, num_pieces, D, D]
    kv = piece_attn(kv, weight)
    k_sum = k.sum(dim=-1, keepdim=True)  # [B*H, num_pieces, D, 1]
    normalizer = piece_attn(torch.matmul(q, k_sum), weight) + eps  # [B*H, num_pieces, window_size, 1]
    return torch.matmul(q, kv) / normalizer
