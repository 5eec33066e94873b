"""TTT's closed-form step on the GPU: the Triton kernels of :mod:`.kernels` as one PyTorch custom op.

``vitconvert::ttt_step``  (q, k, v, W, w_q, b_q) -> (o, W')    W: the (3, H, d, d) float32 fast weights [W1, W2, W3]

on the normalised and convolved k (made by the grid op, :mod:`..grid.op`, or torch ops) and q, convolved by
the op itself when its conv's filters w_q, b_q are given (as its tiles load in the read-out and the read-out's
backward: the convolved q never crosses memory; its conv's backward is the grid op's kernel, in this op's). The
inner gradients' d×d sums, the update W' = W − lr·∇L (on d×d matrices, in torch) and the read-out
f_{W'}(q) in two kernels; backward in two (the read-out's backward, the sums' backward; the latter split in two
on GPUs with 99 KB of shared memory a block: :func:`_sums_backward`) from q, k, v and W' (B, H, 3, d, d):
autograd keeps no token-sized intermediate, and TTT's checkpoint keeps not even W' (it is recomputed with the
step, and the recomputation is what backward reads). Registered like the linear-attention
ops (:mod:`.fused`): torch.compile and torch.export see one op, and a plain eager call skips the dispatcher
(:func:`.dispatch.direct`). A backward kernel Triton cannot build in any form turns TTT's kernels off and takes
that step's gradients from the op's eager form.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..calls import _direct_function, _eager_gradients, call_op
from ..dispatch import KernelUnavailable, direct, fits, launch, tile_args, too_big
from ..grid.op import grid_conv_eager, run_grid_conv_backward
from ..launch_plan import linear_launches
from ..layout import _mask_arg, _output_like, _total, unit_rows, valid_keys
from .closed_form import stepped_readout


def _step_size(key_valid: Optional[torch.Tensor], tokens: int, scale: float,
               lr: float) -> Union[float, torch.Tensor]:
    """lr·s/n, so that W' = W + (lr·s/n)·Ĝ: the step −lr times the inner loss's factor −s/n, n the valid keys
    (a float, or (B, 1, 1, 1, 1) with a mask)."""
    if key_valid is None:
        return lr * scale / tokens
    return (lr * scale) / valid_keys(key_valid).view(-1, 1, 1, 1, 1)


def _geometry(q: torch.Tensor) -> tuple[int, ...]:
    """B, H, N, d, the token ranges (count, length) and the block sizes (BLOCK_N, BLOCK_D, warps) of a launch."""
    B, H, N, D = q.shape
    plan = linear_launches(q, B * H, 1, N, False, many_tiles=True)  # (the kernel plan's: ops/launch_plan.py)
    return B, H, N, D, plan.splits, plan.per, plan.block_n, plan.block_d, plan.warps


def _step_args(step: Union[float, torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The kernels' (STEPS, step) of :func:`_step_size`'s value: a (B,) tensor with a mask (``step`` unread), a float
    without one (STEPS a placeholder)."""
    if isinstance(step, float):
        return like, step
    return step.reshape(-1).contiguous(), 0.0


def run_inner_sums(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], weights: torch.Tensor,
                   step: Union[float, torch.Tensor]) -> torch.Tensor:
    """W' = W + step·Ĝ (B, H, 3, d, d) float32, Ĝ = [Ĝ1, Ĝ2, Ĝ3] the inner gradients before their −s/n factor: in
    the kernel's epilogue when one program sums a head's tokens (W' is then the one d×d tensor written), else from
    the programs' partial sums in one torch op."""
    from .kernels import inner_sums_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    k, v = unit_rows(k), unit_rows(v)
    B, H, N, D, splits, per, block_n, block_d, warps = _geometry(k)
    # partial sums (linear/launches._total), or with one range W' itself (the same layout: an output, not a view)
    G = k.new_empty((B * H, 3, splits, D, D) if splits > 1 else (B, H, 3, D, D), dtype=torch.float32)
    mask, s_mb = _mask_arg(key_valid, k)
    steps, scalar = _step_args(step, G)
    launch(inner_sums_kernel, (B * H, splits),
        k, v, mask, weights, G, steps,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), s_mb, scalar,
        H, N, D, splits, per,
        UPDATE=splits == 1, HAS_MASK=key_valid is not None, BLOCK_N=block_n, BLOCK_D=block_d, **tile_args(k),
        num_warps=warps)
    if splits == 1:
        return G
    # W (H, 3, d, d) as W' holds it (each head's three together), into a contiguous W' (the kernels' layout)
    sums, initial, updated = _total(G, B, H), weights.transpose(0, 1), G.new_empty((B, H, 3, D, D))
    if isinstance(step, float):
        return torch.add(initial, sums, alpha=step, out=updated)
    return torch.addcmul(initial, sums, step, out=updated)


def _q_conv(q: torch.Tensor, key_valid: Optional[torch.Tensor], q_filter: Optional[torch.Tensor],
            q_bias: Optional[torch.Tensor], grid: tuple[int, int, int]) -> tuple[tuple, dict]:
    """The read-out kernels' arguments of q's conv (filters, bias, mask, its stride, prefix, rows, cols) and their
    settings (CONV, HAS_BIAS, HAS_MASK): placeholders (q) without it."""
    if q_filter is None:
        return (q, q, q, 0, 0, 1, 1), dict(CONV=False, HAS_BIAS=False, HAS_MASK=False)
    mask, s_mb = _mask_arg(key_valid, q)
    rows, cols, prefix = grid
    bias = q if q_bias is None else q_bias.to(torch.float32).contiguous()
    return ((q_filter.reshape(q_filter.shape[0], -1).to(torch.float32).contiguous(), bias, mask, s_mb, prefix, rows,
             cols), dict(CONV=True, HAS_BIAS=q_bias is not None, HAS_MASK=key_valid is not None))


def run_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
            weights: torch.Tensor, scale: float, lr: float, q_filter: Optional[torch.Tensor] = None,
            q_bias: Optional[torch.Tensor] = None, rows: int = 0, cols: int = 0,
            prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, W'): out_i = f_{W'}(q_i) after one inner step on (k, v), for (B, H, N, d) q, k, v and (3, H, d, d)
    float32 W; W' (B, H, 3, d, d) float32 is an output for backward, which reads it instead of summing again
    (under TTT's checkpoint it is not kept but recomputed with the step, as every saved tensor is). With
    ``q_filter`` (the (H·d, 1, 3, 3) depthwise conv, ``q_bias`` its bias) q is first q + conv(q) on the
    rows × cols grid after ``prefix`` tokens, applied as the read-out loads q."""
    from .kernels import swiglu_readout_kernel  # lazy: start-up time

    q = unit_rows(q)
    updated = run_inner_sums(k, v, key_valid, weights, _step_size(key_valid, k.shape[2], scale, lr))
    B, H, N, D, splits, per, block_n, block_d, warps = _geometry(q)
    (filters, bias, mask, s_mb, *geometry), conv = _q_conv(q, key_valid, q_filter, q_bias, (rows, cols, prefix))
    o = _output_like(q)
    launch(swiglu_readout_kernel, (B * H, splits),
        q, filters, bias, mask, updated, o,
        q.stride(0), q.stride(1), q.stride(2), s_mb, o.stride(0), o.stride(1), o.stride(2),
        H, N, D, per, *geometry,
        **conv, BLOCK_N=block_n, BLOCK_D=block_d, **tile_args(q), num_warps=warps)
    return o, updated


ttt_step = torch.library.custom_op("vitconvert::ttt_step", mutates_args=())(run_ttt)


@ttt_step.register_fake
def _(q, k, v, key_valid, weights, scale, lr, q_filter=None, q_bias=None, rows=0, cols=0, prefix=0):
    B, H, _, D = q.shape
    return _output_like(q), q.new_empty((B, H, 3, D, D), dtype=torch.float32)


def run_ttt_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                     key_valid: Optional[torch.Tensor], weights: torch.Tensor, updated: torch.Tensor, scale: float,
                     lr: float, q_filter: Optional[torch.Tensor] = None, q_bias: Optional[torch.Tensor] = None,
                     rows: int = 0, cols: int = 0, prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                              torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, dW, dw_q, db_q of :func:`ttt_step` given its W': the read-out's backward (dq, dW'; q convolved
    as it loads), then the sums' (dĜ = step·dW', dk, dv and the chain's dW); dW = Σ_batch (dW' + the chain's);
    with q's conv, its backward (the grid op's kernel: dq, dw_q, db_q; else the last two empty)."""
    from .kernels import swiglu_readout_bwd_kernel  # lazy: start-up time

    q, k, v, do = unit_rows(q), unit_rows(k), unit_rows(v), unit_rows(do)
    step = _step_size(key_valid, k.shape[2], scale, lr)
    geometry = _geometry(q)
    B, H, N, D, splits, per, block_n, block_d, warps = geometry
    (filters, bias, mask, s_mb, *grid), conv = _q_conv(q, key_valid, q_filter, q_bias, (rows, cols, prefix))
    dq = _output_like(q)  # (tokens-major, as the forward's o: the convs' backward then reads a view of it, no copy)
    d_updated = q.new_empty((B * H, 3, splits, D, D), dtype=torch.float32)
    launch(swiglu_readout_bwd_kernel, (B * H, splits),
        q, filters, bias, mask, updated, do, dq, d_updated,
        q.stride(0), q.stride(1), q.stride(2), s_mb, do.stride(0), do.stride(1), do.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        H, N, D, splits, per, *grid,
        **conv, BLOCK_N=block_n, BLOCK_D=block_d, **tile_args(q, half_tiles=True), num_warps=warps)
    d_updated = _total(d_updated, B, H)
    dk, dv, d_chain = _sums_backward(k, v, key_valid, weights, d_updated, step, geometry)
    dweights = _batch_total(d_chain, B, H).to(weights.dtype)
    if q_filter is None:
        return dq, dk, dv, dweights, q.new_empty((0,)), q.new_empty((0,))
    dq, d_filter, d_bias = run_grid_conv_backward(q, q_filter, key_valid, q.new_empty((0,), dtype=torch.float32),
                                                  dq, rows, cols, prefix, True, False)
    return dq, dk, dv, dweights, d_filter.to(q_filter.dtype), (q.new_empty((0,)) if q_bias is None
                                                                 else d_bias.to(q_bias.dtype))


def _batch_total(partials: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """(3, B·H, splits, d, d) partial sums -> (3, H, d, d), summed over the batch and the token ranges in one op
    (:func:`_partials` made one image's one range (3, H, d, d): itself)."""
    if partials.dim() == 4:
        return partials
    three, _, splits, D, _ = partials.shape
    return partials.view(three, batch, heads, splits, D, D).sum((1, 3))


def _partials(like: torch.Tensor, batch: int, heads: int, splits: int, D: int) -> torch.Tensor:
    """The (3, B·H, splits, d, d) float32 partial sums of dW, laid out as the kernels index them; one image's one
    range as (3, H, d, d), the gradient itself."""
    shape = (3, heads, D, D) if batch == 1 and splits == 1 else (3, batch * heads, splits, D, D)
    return like.new_empty(shape, dtype=torch.float32)


ONE_PASS = "ttt_step: the sums' backward in one kernel"  # (dispatch.fits: where it does not, two kernels)


def _sums_backward(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], weights: torch.Tensor,
                   d_updated: torch.Tensor, step: Union[float, torch.Tensor],
                   geometry: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dk, dv and the partial dW (3, B·H, splits, d, d; with dW' in the first range's part) of the inner sums from
    dW' (B, H, 3, d, d), their gradient dĜ = step·dW' formed as the kernels load it: one kernel, or where its
    twelve d×d operands do not fit the GPU's shared memory (an L40 or RTX 4090 gives a block 99 KB, it needs 106
    at its leanest; benchmarks/kernel_resources.py --arch sm_89), a kernel for dk and dW1, dW2 and one for dv and
    dW3 (ten and six operands), each recomputing the forward's token-sized values.
    ``geometry``: the launch's, as :func:`_geometry` gives it."""
    from .kernels import (  # lazy: start-up time
        inner_sums_bwd_kernel,
        inner_sums_bwd_keys_kernel,
        inner_sums_bwd_values_kernel,
    )

    B, H, N, D, splits, per, block_n, block_d, warps = geometry  # (the backward's: _geometry)
    dk, dv = _output_like(k), _output_like(v)
    d_chain = _partials(k, B, H, splits, D)
    mask, s_mb = _mask_arg(key_valid, k)
    steps, scalar = _step_args(step, d_chain)
    d_sums = (d_updated.contiguous(), steps)
    strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), s_mb, scalar)
    settings = dict(HAS_MASK=key_valid is not None, BLOCK_N=block_n, BLOCK_D=block_d,
                    **tile_args(k, half_tiles=True), num_warps=warps)
    if fits(ONE_PASS):
        try:
            launch(inner_sums_bwd_kernel, (B * H, splits),
                k, v, mask, weights, *d_sums, dk, dv, d_chain,
                *strides, dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
                H, N, D, splits, per,
                **settings)
            return dk, dv, d_chain
        except KernelUnavailable as e:
            if not e.resources:
                raise
            too_big(ONE_PASS, e)
    launch(inner_sums_bwd_keys_kernel, (B * H, splits),
        k, v, mask, weights, *d_sums, dk, d_chain,
        *strides, dk.stride(0), dk.stride(1), dk.stride(2),
        H, N, D, splits, per, **settings)
    launch(inner_sums_bwd_values_kernel, (B * H, splits),
        k, v, mask, weights, *d_sums, dv, d_chain,
        *strides, dv.stride(0), dv.stride(1), dv.stride(2),
        H, N, D, splits, per, **settings)
    return dk, dv, d_chain


ttt_step_backward = torch.library.custom_op("vitconvert::ttt_step_backward", mutates_args=())(run_ttt_backward)


@ttt_step_backward.register_fake
def _(q, k, v, do, key_valid, weights, updated, scale, lr, q_filter=None, q_bias=None, rows=0, cols=0, prefix=0):
    conv = [q.new_empty((0,)) if t is None or q_filter is None else torch.empty_like(t) for t in (q_filter, q_bias)]
    return (*(_output_like(t) for t in (q, k, v)), torch.empty_like(weights), *conv)


def _setup(ctx, inputs, output) -> None:
    q, k, v, key_valid, weights, scale, lr, q_filter, q_bias, rows, cols, prefix = inputs
    ctx.save_for_backward(q, k, v, key_valid, weights, output[1], q_filter, q_bias)
    ctx.args = (scale, lr)
    ctx.grid = (rows, cols, prefix)
    ctx.set_materialize_grads(False)  # W' gets no gradient: not a (B, H, 3, d, d) float32 zero tensor per step


def _backward(ctx, do, _):  # (W' is for backward only: nothing flows back through it)
    if do is None:
        return (None,) * 12
    q, k, v, key_valid, weights, updated, q_filter, q_bias = ctx.saved_tensors
    try:
        dq, dk, dv, dweights, d_filter, d_bias = (run_ttt_backward if direct(do) else ttt_step_backward)(
            q, k, v, do, key_valid, weights, updated, *ctx.args, q_filter, q_bias, *ctx.grid)
    except KernelUnavailable as e:
        inputs = (q, k, v, key_valid, weights, q_filter, q_bias)
        dq, dk, dv, _, dweights, d_filter, d_bias = _eager_gradients(e, "ttt_step", _ttt_eager_inputs_first, inputs,
                                                                     (do,), *ctx.args, *ctx.grid)
    d_filter = None if q_filter is None else d_filter
    d_bias = None if q_bias is None else d_bias
    return dq, dk, dv, None, dweights, None, None, d_filter, d_bias, None, None, None


ttt_step.register_autograd(_backward, setup_context=_setup)
_DirectStep = _direct_function("DirectTTTStep", run_ttt, _setup, _backward)


def _ttt_eager_inputs_first(q, k, v, key_valid, weights, q_filter, q_bias, scale, lr, rows, cols, prefix):
    return ttt_eager(q, k, v, key_valid, weights, scale, lr, q_filter, q_bias, rows, cols, prefix)


def ttt_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
              weights: torch.Tensor, scale: float, lr: float, q_filter: Optional[torch.Tensor] = None,
              q_bias: Optional[torch.Tensor] = None, rows: int = 0, cols: int = 0, prefix: int = 0) -> torch.Tensor:
    """:func:`ttt_step` in torch, float32 (its backward's fallback and the tests' oracle of the op)."""
    if q_filter is not None:
        q = grid_conv_eager(q, None, q_filter, q_bias, key_valid, rows, cols, prefix)
    dtype, acc = q.dtype, torch.promote_types(weights.dtype, torch.float32)
    q, k, v, weights = q.to(acc), k.to(acc), v.to(acc), weights.to(acc)
    return stepped_readout(q, k, v, key_valid, weights[0], weights[1], weights[2], scale, lr).to(dtype)


def call_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
              weights: torch.Tensor, scale: float, lr: float, q_filter: Optional[torch.Tensor] = None,
              q_bias: Optional[torch.Tensor] = None, grid: tuple[int, int, int] = (0, 0, 0)) -> torch.Tensor:
    """The op's output, called direct where it may (:func:`..calls.call_op`);
    ``grid`` (rows, cols, prefix tokens) of q's conv when ``q_filter`` is given."""
    args = (q, k, v, key_valid, weights, scale, lr, q_filter, q_bias, *grid)
    return call_op(ttt_step, _DirectStep, run_ttt, args, (q, k, v, weights, q_filter, q_bias))[0]
