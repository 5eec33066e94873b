"""The launches of the grid kernels (:mod:`.kernels`) that run on their own, and the depthwise conv on the patch
grid in torch.

TTT's step op calls two where heads split over token ranges (in one program a head, its step kernels take both):
:func:`statistics`, the key norm's statistics in one reading pass, and :func:`run_grid_conv_backward`, the backward
of a residual conv y = x̂ + conv(x̂·m), x̂ = x or TTT's instance norm of the keys (two launches through the norm).
MHLA's LePE is added and differentiated inside its attention kernels (the conv taps of :mod:`.kernels`).
:func:`grid_conv_eager` is the conv in torch: the eager forms of TTT's convs and of LePE, and the fallback of a
backward kernel Triton cannot build.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from ...tensors import from_grid, split_prefix, to_grid
from ..dispatch import launch, tile_args
from ..launch_plan import grid_launches
from ..layout import _mask_arg, _output_like, unit_rows
from ..ttt.closed_form import normalize_keys


def statistics(x: torch.Tensor, key_valid: Optional[torch.Tensor], eps: float,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(2, B, H, d) float32 (into ``out`` where given): the mean and 1/√(var + ε) over the (valid) tokens of (B, H,
    N, d) ``x``, per channel (TTT's key norm: biased variance), in one launch reading x as it is: each program a
    tile's moments, merged in token order by the last of a head's programs, as TTT's step kernel merges them where
    it owns a head (kernels.key_moments_kernel)."""
    from ..linear.launches import tickets  # lazy: start-up time
    from .kernels import key_moments_kernel  # lazy: start-up time

    x = unit_rows(x)
    B, H, N, D, block, tiles, block_d, warps = _geometry(x)
    part = x.new_empty((B * H * tiles, 2 * D + 1), dtype=torch.float32)
    stats = x.new_empty((2, B, H, D), dtype=torch.float32) if out is None else out
    mask, s_mb = _mask_arg(key_valid, x)
    launch(key_moments_kernel, (B * H, tiles),
        x, mask, part, tickets(B * H, x.device), stats, x.stride(0), x.stride(1), x.stride(2), s_mb, B, H, N, D, eps,
        HAS_MASK=key_valid is not None, BLOCK_M=block, BLOCK_D=block_d, BLOCK_N=block, **tile_args(x),
        num_warps=warps)
    return stats


def _filters(weight: torch.Tensor) -> torch.Tensor:
    """The (C, 1, KS, KS) depthwise weight as the kernels read it: (C, KS·KS) in its own dtype, C = H·d head-major
    (a view of the module's weight, no torch op: the kernels convert it to float32 as they load it)."""
    return weight.contiguous().view(weight.shape[0], -1)


def _geometry(x: torch.Tensor) -> tuple[int, ...]:
    """B, H, N, d, BLOCK_M (the programs' token tiles), their count, BLOCK_D and warps, as the kernel plan decides
    them (:func:`..launch_plan.grid_launches`)."""
    B, H, N, D = x.shape
    found = grid_launches(D)
    return B, H, N, D, found.block_m, -(-N // found.block_m), found.block_d, found.warps


def run_grid_conv_backward(x: torch.Tensor, weight: torch.Tensor, key_valid: Optional[torch.Tensor],
                           stats: torch.Tensor, dy: torch.Tensor, rows: int, cols: int, prefix: int,
                           norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx (x's dtype, stored as (B, N, H, d)), dw (the weight's shape) and dbias (the weight's dtype: the kernel
    stores them so, no cast after) of the residual conv y = x̂ +
    bias + conv(x̂·m) of (B, H, N, d) ``x`` whose last rows × cols tokens are the grid (:func:`grid_conv_eager`
    without a base), given dy; ``norm``: x̂ is TTT's instance norm of x, of ``stats`` (:func:`statistics`)."""
    from ..linear.launches import tickets  # lazy: start-up time
    from .kernels import grid_conv_bwd_kernel  # lazy: start-up time

    x, dy = unit_rows(x), unit_rows(dy)
    B, H, N, D, block, tiles, block_d, warps = _geometry(x)
    size = weight.shape[-1]
    dx = _output_like(x)
    dw = x.new_empty((H * B * tiles, size * size, D), dtype=torch.float32)  # (the programs' partials, summed by the
    dbias = x.new_empty((H * B * tiles, D), dtype=torch.float32)  # last of each head's into dweight and dbias_total)
    dweight = x.new_empty(weight.shape, dtype=weight.dtype)
    dbias_total = x.new_empty((H * D,), dtype=weight.dtype)
    sums = x.new_empty((3, B * H * tiles, D), dtype=torch.float32) if norm else dbias
    summed = x.new_empty((3, B * H, D), dtype=torch.float32) if norm else dbias
    mask, s_mb = _mask_arg(key_valid, x)
    filters = _filters(weight)
    geometry = (x.stride(0), x.stride(1), x.stride(2), dy.stride(0), dy.stride(1), dy.stride(2), s_mb,
                dx.stride(0), dx.stride(1), dx.stride(2), B, H, N, D, prefix, rows, cols, tiles)
    settings = dict(KS=size, NORM=norm, HAS_MASK=key_valid is not None, BLOCK_M=block,
                    BLOCK_D=block_d, BLOCK_N=block, **tile_args(x), num_warps=warps)
    stats = stats if norm else dbias
    counters = tickets(B * H + H, x.device)
    launch(grid_conv_bwd_kernel, (B * H, tiles),  # (through the norm dx comes second: a placeholder here)
        x, dy, filters, mask, stats, summed, dbias if norm else dx, dw, dbias, sums, counters, dweight, dbias_total,
        *geometry, SUMS=True, WRITE_DX=not norm, **settings)
    if norm:  # LayerNorm's backward over the tokens needs Σ dx̂ and Σ dx̂·x̂ of every token first
        launch(grid_conv_bwd_kernel, (B * H, tiles),  # (the partials and totals unread: dx in their place)
            x, dy, filters, mask, stats, summed, dx, dx, dx, dx, counters, dx, dx, *geometry,
            SUMS=False, WRITE_DX=True, **settings)
    return dx, dweight, dbias_total


def grid_conv_eager(x: torch.Tensor, base: Optional[torch.Tensor], weight: torch.Tensor,
                    bias: Optional[torch.Tensor], key_valid: Optional[torch.Tensor], rows: int, cols: int,
                    prefix: int, norm_eps: Optional[float] = None) -> torch.Tensor:
    """y = base + bias + conv(x̂·m) on the grid's tokens and base on the prefix tokens (base = x̂ when None; x̂ = x or,
    with ``norm_eps``, TTT's instance norm of x over the valid tokens), in base's dtype (x's without one), summed in
    float32 (grid/reference.py writes it out tap by tap)."""
    dtype = x.dtype if base is None else base.dtype
    acc = torch.promote_types(x.dtype, torch.float32)
    x_hat = x.to(acc)
    if norm_eps is not None:
        x_hat = normalize_keys(x_hat, key_valid, norm_eps)
    spatial = split_prefix(x_hat, prefix)[1]
    if key_valid is not None:
        spatial = spatial * key_valid[:, None, prefix:, None].to(acc)
    conv = F.conv2d(to_grid(spatial, (rows, cols)), weight.to(acc), None if bias is None else bias.to(acc),
                    padding=weight.shape[-1] // 2, groups=weight.shape[0])
    conv = F.pad(from_grid(conv, x.shape[1]), (0, 0, prefix, 0))
    return ((x_hat if base is None else base.to(acc)) + conv).to(dtype)
