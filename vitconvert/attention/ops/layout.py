"""How every fused op lays out the tensors its launches take and make, whatever its folder: rows the kernels step
through by 1, outputs stored as (B, N, H, d), strides, the mask argument, the valid keys, partial sums and MHLA's
LePE arguments (its pairwise and blocked ops add LePE in their kernels)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


def unit_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (the kernels step through d by 1), else a copy: an
    output gradient expanded from a sum (``out.sum().backward()``: every stride 0) or a caller's transposed view
    read garbage before."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """Batch, head and token strides of (B, H, N, d) tensors whose last dimension is contiguous."""
    return tuple(s for t in tensors for s in t.stride()[:3])


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) output stored as (B, N, H, d): the attention module's transpose-and-reshape is then a view.
    The backwards write dq, dk, dv so too: the layer's q/k/v split stacks them into the qkv projection's
    (B, N, 3, H, d) gradient from contiguous rows, and MHLA's RMSNorm backward reads them as its rows, no copy."""
    B, H, N, D = q.shape
    return q.new_empty((B, N, H, D)).transpose(1, 2)


def _mask_arg(key_valid: Optional[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the mask a kernel takes, its batch stride): ``like`` and 0 without one (never read: HAS_MASK is False)."""
    if key_valid is None:
        return like, 0
    return key_valid, key_valid.stride(0)


def valid_keys(key_valid: torch.Tensor) -> torch.Tensor:
    """(B,) float32: the valid keys of each image, at least 1 (the n that normalises a sum over keys)."""
    return key_valid.sum(dim=-1).clamp(min=1).to(torch.float32)


class Lepe(NamedTuple):
    """LePE's arguments of the kernels: (H·d, KS·KS) filters and the bias in the module's dtype (the kernels convert
    them to float32 as they load them: no cast per call for a model cast to bf16), whether on, KS (placeholders when
    off or without a bias)."""
    filters: torch.Tensor
    bias: torch.Tensor
    on: bool
    size: int


def lepe_args(q: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], rows: int, cols: int,
              prefix: int) -> Lepe:
    """:class:`Lepe` of a (C, 1, KS, KS) weight over the rows × cols grid after ``prefix`` tokens of q."""
    if weight is None:
        return Lepe(q, q, False, 1)
    if q.shape[2] - prefix != rows * cols:  # (the kernels would read the rest as grid tokens off its edge)
        raise ValueError(f"{q.shape[2]} tokens do not form {prefix} prefix tokens and a {rows}x{cols} grid")
    filters = weight.contiguous().view(weight.shape[0], -1)  # (a view of the module's weight: no torch op)
    return Lepe(filters, filters if bias is None else bias.contiguous(), True, weight.shape[-1])
