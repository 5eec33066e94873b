"""Tensor helpers the variants share: the precision of token sums, and the layouts of heads, prefix tokens and
the patch grid."""

from __future__ import annotations

from typing import Any

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, the dtype itself otherwise: token sums need float32's range and precision."""
    return torch.promote_types(dtype, torch.float32)


class ScriptedAutocastUnchanged:
    """What :func:`full_precision` is under TorchScript, which takes only a constant autocast device and does not
    apply a scripted ``autocast(enabled=False)`` at run time: a no-op (docs/variants.md, timm's model contract)."""

    def __init__(self) -> None:
        pass

    def __enter__(self) -> None:
        pass

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        pass


def full_precision(like: torch.Tensor):  # -> torch.autocast (eager) | ScriptedAutocastUnchanged (TorchScript)
    """Autocast off on ``like``'s device: inside, matmuls of float32 tensors stay float32.

    Without it, autocast would run the d×d state matmuls (sums over all N tokens) in bf16/fp16.
    """
    if torch.jit.is_scripting():
        return ScriptedAutocastUnchanged()
    return torch.autocast(device_type=like.device.type, enabled=False)


def flat_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, H, …) -> (B·H, …) for bmm/baddbmm; a view when the layout allows it (always for B = 1)."""
    return t.flatten(0, 1)


def split_prefix(t: torch.Tensor, num_prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split (B, H, N, d) into prefix tokens (class/dist/registers) and spatial tokens: views, as slices are, but
    one split, whose backward concatenates the two gradients in one pass where two slices' backwards each fill a
    zero tensor of t's size, copy into it, and add the two."""
    parts = torch.split(t, [num_prefix, t.shape[2] - num_prefix], dim=2)
    return parts[0], parts[1]


def to_grid(t: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(B, H, h*w, d) spatial tokens -> (B, H*d, h, w) image layout for depthwise convolutions."""
    B, H, _, d = t.shape
    return t.permute(0, 1, 3, 2).reshape(B, H * d, grid[0], grid[1])


def from_grid(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`to_grid`."""
    B, C, h, w = t.shape
    return t.reshape(B, heads, C // heads, h * w).permute(0, 1, 3, 2)
