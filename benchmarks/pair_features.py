"""ELU's and ReLU's φ on bf16 pairs (vitconvert/attention/ops/linear/bf16_pairs.py) against the float32 form over
every bf16 value, on a GPU: the inline PTX runs nowhere else (Triton's interpreter runs none), so the probe and
gpu_check's parity section check it before anything else on the next GPU.

Both forms come from the kernels' own ``_phi_tile`` on a bf16 tile: its PTX form (``EMULATE`` off, as the kernels
run on a GPU) and its float32 form rounded to bf16 (``EMULATE`` on: what the interpreter runs and the CPU tests
check against the N×N references). tests/attention/test_bf16_pairs.py checks the identity they rest on in torch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from vitconvert.attention.ops.linear.kernel_parts import _phi_tile

FEATURES = {"elu": 1, "relu": 2}  # (kernel_parts' FEATURE codes: ELU_PLUS_ONE, RELU)
BLOCK = 1024


@triton.jit
def apply_kernel(X, Y, n, FEATURE: tl.constexpr, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < n, other=0.0)
    tl.store(Y + i, _phi_tile(x, FEATURE, 0.0, tl.bfloat16, EMULATE), mask=i < n)


def every_bf16(device: torch.device) -> torch.Tensor:
    """Every bf16 value but NaN's, in bit order (65 282 values)."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return bits[~torch.isnan(bits)].to(device)


def feature_map(x: torch.Tensor, feature: int, emulate: bool) -> torch.Tensor:
    """``_phi_tile`` of the bf16 values ``x`` in one launch: its PTX on pairs, or its float32 form (``emulate``)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    apply_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), FEATURE=feature, EMULATE=emulate, BLOCK=BLOCK)
    return y


def mismatches(device: torch.device) -> dict[str, Optional[int]]:
    """Per feature map, how many bf16 values its PTX form maps to another value than the float32 form rounded (+0
    and −0 the same); None where no PTX runs (not a CUDA device)."""
    if device.type != "cuda":
        return {name: None for name in FEATURES}
    x = every_bf16(device)
    return {name: int((feature_map(x, feature, False) != feature_map(x, feature, True)).sum())
            for name, feature in FEATURES.items()}
