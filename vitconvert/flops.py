"""FLOPs of one forward, as ``torch.utils.flop_counter`` counts the ops it dispatches.

Matmuls, linear layers, convolutions and scaled-dot-product attention (4·N·d FLOPs per token and head for QKᵀ
and AV): a softmax ViT's count is shared qkv/proj/MLP + 4·N²·C per layer and a linear variant's is shared + its
own mixing. Their ratio is the FLOP-bound speedup: what the variant would gain if every model ran at the same
FLOP rate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# torch's counter knows the CUDA attention kernels; the CPU one needs the same formula (4·N·d per token, head).
EXTRA_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}


def flops_per_image(model: nn.Module, x: torch.Tensor) -> float:
    """FLOPs of one inference forward per image, as torch's FLOP counter sees the dispatched ops."""
    model.eval()
    with torch.inference_mode(), FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        model(x)
    return counter.get_total_flops() / x.shape[0]
