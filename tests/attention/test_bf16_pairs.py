"""ops/linear/bf16_pairs.py's ELU feature map on bf16 pairs (_elu_plus_one_pairs): the PTX runs only on a GPU
(Triton's interpreter runs none), so the identity it rests on is checked here over every bf16 value (the PTX itself:
benchmarks/gpu_check_parity.py's first check on a GPU)."""

from __future__ import annotations

import torch


def test_max_of_both_sides_rounded_is_elu_plus_one_rounded_for_every_bf16():
    """φ(x) = x + 1 above 0, eˣ below. The PTX makes max(bf16(x + 1), bf16(exp(min(x, 0)))) (eˣ ≥ x + 1, and
    rounding keeps order): the same bf16 as φ made in float32 and rounded once, as the interpreter's form does."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[~torch.isnan(x)]
    wide = x.float()
    reference = torch.where(wide > 0, wide + 1, torch.exp(wide)).to(torch.bfloat16)
    plus_one = (wide + 1).to(torch.bfloat16)  # (fma.rn.bf16x2: x·1 + 1 rounded once)
    exp_side = torch.exp(torch.minimum(x, torch.zeros_like(x)).float()).to(torch.bfloat16)
    pairs = torch.maximum(plus_one, exp_side)
    assert torch.equal(pairs.view(torch.int16), reference.view(torch.int16))
