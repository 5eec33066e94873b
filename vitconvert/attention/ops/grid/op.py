"""The depthwise convs on the patch grid on the GPU: the Triton kernels of :mod:`.kernels` as one op.

``vitconvert::grid_conv``  (x, base, w, bias) -> (y, statistics)

y = base + conv(x̂·m) on the grid's tokens and y = base on the prefix tokens, base = x̂ when none is given, x̂ = x
or, with ``norm_eps``, TTT's instance norm of the keys over the tokens (its statistics, (2, B, H, d) float32, are the
second output, for backward). TTT's q conv, its key norm and k conv, and MHLA's LePE (base: the attention's
output) are each one kernel here, where torch runs the norm, the conv, the prefix's concatenation (LePE: a pad and
an add) as passes of their own. Backward is one kernel (two through the norm). Registered like the other ops
(:mod:`.fused`): torch.compile and torch.export see one op, and a plain eager call skips the dispatcher
(:func:`.dispatch.direct`). A kernel Triton cannot build turns the op off (the variants then run their torch
convs); a backward one takes that step's gradients from the op's eager form.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from ...tensors import from_grid, split_prefix, to_grid
from ..calls import _direct_function, _eager_gradients, call_op
from ..dispatch import KernelUnavailable, direct, launch, tile_args
from ..launch_plan import grid_launches
from ..layout import _mask_arg, _output_like, unit_rows, valid_keys
from ..ttt.closed_form import normalize_keys


def statistics(x: torch.Tensor, key_valid: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """(2, B, H, d) float32: the mean and 1/√(var + ε) over the (valid) tokens of (B, H, N, d) ``x``, per channel
    (TTT's key norm: biased variance), in one launch reading x as it is: each program a tile's moments, merged in
    token order by the last of a head's programs, as TTT's step kernel merges them where it owns a head
    (kernels.key_moments_kernel)."""
    from ..linear.launches import tickets  # lazy: start-up time
    from .kernels import key_moments_kernel  # lazy: start-up time

    x = unit_rows(x)
    B, H, N, D, block, tiles, block_d, warps = _geometry(x)
    part = x.new_empty((B * H * tiles, 2 * D + 1), dtype=torch.float32)
    stats = x.new_empty((2, B, H, D), dtype=torch.float32)
    mask, s_mb = _mask_arg(key_valid, x)
    launch(key_moments_kernel, (B * H, tiles),
        x, mask, part, tickets(B * H, x.device), stats, x.stride(0), x.stride(1), x.stride(2), s_mb, B, H, N, D, eps,
        HAS_MASK=key_valid is not None, BLOCK_M=block, BLOCK_D=block_d, BLOCK_N=block, **tile_args(x),
        num_warps=warps)
    return stats


def _count(key_valid: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """(B,) float32: the tokens the statistics are over."""
    if key_valid is None:
        return torch.full((x.shape[0],), float(x.shape[2]), dtype=torch.float32, device=x.device)  # (x unread)
    return valid_keys(key_valid)


def _filters(weight: torch.Tensor) -> torch.Tensor:
    """The (C, 1, KS, KS) depthwise weight as the kernels read it: (C, KS·KS) float32, C = H·d head-major."""
    return weight.reshape(weight.shape[0], -1).to(torch.float32).contiguous()


def _geometry(x: torch.Tensor) -> tuple[int, ...]:
    """B, H, N, d, BLOCK_M (the programs' token tiles), their count, BLOCK_D and warps, as the kernel plan decides
    them (:func:`..launch_plan.grid_launches`)."""
    B, H, N, D = x.shape
    found = grid_launches(D)
    return B, H, N, D, found.block_m, -(-N // found.block_m), found.block_d, found.warps


def run_grid_conv(x: torch.Tensor, base: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
                  key_valid: Optional[torch.Tensor], rows: int, cols: int, prefix: int,
                  norm_eps: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, statistics) of (B, H, N, d) ``x`` whose last rows × cols tokens are the grid (module docstring); y in
    base's dtype (x's without one), laid out as (B, N, H, d); the statistics empty without ``norm_eps``."""
    from .kernels import grid_conv_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    if x.shape[2] - prefix != rows * cols:  # (the kernels would read the rest as grid tokens off its edge)
        raise ValueError(f"{x.shape[2]} tokens do not form {prefix} prefix tokens and a {rows}x{cols} grid")
    x = unit_rows(x)
    base = None if base is None else unit_rows(base)
    B, H, N, D, block, tiles, block_d, warps = _geometry(x)
    stats = (statistics(x, key_valid, norm_eps) if norm_eps is not None
             else x.new_empty((0,), dtype=torch.float32))
    y = _output_like(x if base is None else base)
    lead = base if base is not None else y  # (never read without a base)
    mask, s_mb = _mask_arg(key_valid, x)
    launch(grid_conv_fwd_kernel, (B * H, tiles),
        x, lead, _filters(weight), bias.to(torch.float32) if bias is not None else y, mask,
        stats if norm_eps is not None else y, y,
        x.stride(0), x.stride(1), x.stride(2), lead.stride(0), lead.stride(1), lead.stride(2), s_mb,
        y.stride(0), y.stride(1), y.stride(2),
        B, H, N, D, prefix, rows, cols,
        KS=weight.shape[-1], NORM=norm_eps is not None, HAS_BASE=base is not None, HAS_BIAS=bias is not None,
        HAS_MASK=key_valid is not None, BLOCK_M=block, BLOCK_D=block_d, BLOCK_N=block, **tile_args(x),
        num_warps=warps)
    return y, stats


grid_conv = torch.library.custom_op("vitconvert::grid_conv", mutates_args=())(run_grid_conv)


@grid_conv.register_fake
def _(x, base, weight, bias, key_valid, rows, cols, prefix, norm_eps=None):
    B, H, _, D = x.shape
    stats = (2, B, H, D) if norm_eps is not None else (0,)
    return _output_like(x if base is None else base), x.new_empty(stats, dtype=torch.float32)


def run_grid_conv_backward(x: torch.Tensor, weight: torch.Tensor, key_valid: Optional[torch.Tensor],
                           stats: torch.Tensor, dy: torch.Tensor, rows: int, cols: int, prefix: int, residual: bool,
                           norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx (x's dtype, laid out as the forward's y), dw and dbias (float32) of :func:`grid_conv` given dy; the
    base's gradient is dy itself. ``residual``: the forward had no base (y = x̂ + …); ``norm``: it normalised x."""
    from .kernels import grid_conv_bwd_kernel  # lazy: start-up time

    x, dy = unit_rows(x), unit_rows(dy)
    B, H, N, D, block, tiles, block_d, warps = _geometry(x)
    size = weight.shape[-1]
    dx = _output_like(x)
    dw = x.new_empty((B * H, tiles, size * size, D), dtype=torch.float32)
    dbias = x.new_empty((B * H, tiles, D), dtype=torch.float32)
    sums = x.new_empty((2, B * H, tiles, D), dtype=torch.float32) if norm else dbias
    count = _count(key_valid, x) if norm else dbias
    mask, s_mb = _mask_arg(key_valid, x)
    filters = _filters(weight)
    geometry = (x.stride(0), x.stride(1), x.stride(2), dy.stride(0), dy.stride(1), dy.stride(2), s_mb,
                dx.stride(0), dx.stride(1), dx.stride(2), B, H, N, D, prefix, rows, cols, tiles)
    settings = dict(KS=size, NORM=norm, RESIDUAL=residual, HAS_MASK=key_valid is not None, BLOCK_M=block,
                    BLOCK_D=block_d, BLOCK_N=block, **tile_args(x), num_warps=warps)
    stats = stats if norm else dbias
    launch(grid_conv_bwd_kernel, (B * H, tiles),  # (through the norm dx comes second: a placeholder here)
        x, dy, filters, mask, stats, sums, count, dbias if norm else dx, dw, dbias, sums, *geometry,
        SUMS=True, WRITE_DX=not norm, **settings)
    if norm:  # LayerNorm's backward over the tokens needs Σ dx̂ and Σ dx̂·x̂ of every token first
        summed = sums.view(2, B, H, tiles, D).sum(3).contiguous()
        launch(grid_conv_bwd_kernel, (B * H, tiles),  # (dw, dbias and the partial sums unread: dx in their place)
            x, dy, filters, mask, stats, summed, count, dx, dx, dx, dx, *geometry,
            SUMS=False, WRITE_DX=True, **settings)
    dweight = dw.view(B, H, tiles, size * size, D).sum((0, 2)).transpose(1, 2).reshape(weight.shape)
    return dx, dweight, dbias.view(B, H, tiles, D).sum((0, 2)).reshape(-1)


grid_conv_backward = torch.library.custom_op("vitconvert::grid_conv_backward", mutates_args=())(
    run_grid_conv_backward)


@grid_conv_backward.register_fake
def _(x, weight, key_valid, stats, dy, rows, cols, prefix, residual, norm):
    return _output_like(x), torch.empty_like(weight, dtype=torch.float32), x.new_empty((weight.shape[0],),
                                                                                       dtype=torch.float32)


def _setup(ctx, inputs, output) -> None:
    x, base, weight, bias, key_valid, rows, cols, prefix, norm_eps = inputs
    ctx.save_for_backward(x, weight, key_valid, output[1])
    ctx.args = (rows, cols, prefix, norm_eps)
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
    ctx.has_base = base is not None
    ctx.set_materialize_grads(False)  # the statistics are for backward only: no zero-filled gradient for them


def _backward(ctx, dy, _):
    if dy is None:
        return None, None, None, None, None, None, None, None, None
    x, weight, key_valid, stats = ctx.saved_tensors
    weight_dtype, bias_dtype = ctx.dtypes
    try:
        rows, cols, prefix, norm_eps = ctx.args
        dx, dweight, dbias = (run_grid_conv_backward if direct(dy) else grid_conv_backward)(
            x, weight, key_valid, stats, dy, rows, cols, prefix, not ctx.has_base, norm_eps is not None)
    except KernelUnavailable as e:
        base = dy if ctx.has_base else None  # (any tensor of y's kind: the eager form's base only adds)
        bias = None if bias_dtype is None else weight.new_zeros(weight.shape[0], dtype=bias_dtype)
        dx, _, dweight, dbias, _ = _eager_gradients(e, "grid_conv", grid_conv_eager,
                                                    (x, base, weight, bias, key_valid), (dy,), *ctx.args)
    return (dx, dy if ctx.has_base else None, dweight.to(weight_dtype), None if bias_dtype is None
            else dbias.to(bias_dtype), None, None, None, None, None)


grid_conv.register_autograd(_backward, setup_context=_setup)
_DirectGridConv = _direct_function("DirectGridConv", run_grid_conv, _setup, _backward)


def grid_conv_eager(x: torch.Tensor, base: Optional[torch.Tensor], weight: torch.Tensor,
                    bias: Optional[torch.Tensor], key_valid: Optional[torch.Tensor], rows: int, cols: int,
                    prefix: int, norm_eps: Optional[float] = None) -> torch.Tensor:
    """:func:`grid_conv`'s y in torch, float32 (its backward's fallback and the tests' oracle of the op)."""
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


def conv_on_grid(x: torch.Tensor, base: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
                 key_valid: Optional[torch.Tensor], grid: tuple[int, int], prefix: int,
                 norm_eps: Optional[float] = None) -> torch.Tensor:
    """The op's y, called direct where it may (:func:`..calls.call_op`)."""
    args = (x, base, weight, bias, key_valid, grid[0], grid[1], prefix, norm_eps)
    return call_op(grid_conv, _DirectGridConv, run_grid_conv, args, (x, base, weight, bias))[0]
