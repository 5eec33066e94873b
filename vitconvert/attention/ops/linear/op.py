"""Fused linear attention on the GPU: the Triton kernels of :mod:`.kernel_parts` as PyTorch custom ops.

``vitconvert::linear_attention``   (q, k, v) -> o              (ELU, ReLU, InLine: the whole mixing)
``vitconvert::blocked_attention``  (q, k, v, W̃) -> o, rstd     (MHLA: block states mixed by W̃, then read)
built on the two building blocks of :mod:`.launches`, the per-segment d×d states and the read-out (launches,
not ops of their own).

Each op has a backward op and is registered with ``torch.library``, so autograd, ``torch.compile`` (one opaque
node each, no graph break) and ``torch.export`` see them as ops. A plain eager call skips the custom-op dispatcher
(:func:`..dispatch.direct`): an ``autograd.Function`` runs the same body, saves the same tensors and has the same
backward, and a call autograd does not record runs the body alone (host time: benchmarks/host_overhead.py).

Both keep only q, k, v and o (and W̃) for backward, which recomputes the d×d states (as FlashAttention
recomputes its scores), so a training step holds no more than softmax's; the blocked op can also leave o out
(read out again in backward) and apply MHLA's RMSNorm to q and k itself, in its kernels both ways (each token's
1/rms taken by the forward's kernels as they load q and k, and kept), keeping the raw q and k.

When they run is :mod:`..dispatch`'s (the variants ask it there: ``dispatch.can_run``, ``dispatch.attempt``);
how they are launched (chunk, warps, stages, tiles, one launch or split) is one value per shape bucket,
:mod:`..launch_plan`'s, which the kernel plan prints. A backward kernel Triton cannot build turns that op's kernels
off (as a forward one does) and that step's gradients come from the ops' eager forms (:mod:`.eager`), so training
goes on.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...blocks import extended_block_mix
from ..calls import _direct_function, _eager_gradients, call_op
from ..dispatch import KernelUnavailable, direct, launch
from ..grid.op import grid_conv_eager
from ..launch_plan import linear_launches, tile_kwargs
from ..layout import _mask_arg, _output_like, _strides, lepe_args, unit_rows, valid_keys
from ..norms.lean import through_rms_pair
from . import eager as fused_eager
from .eager import ELU_PLUS_ONE, IDENTITY, RELU, RELU_PLUS_EPS  # noqa: F401  (the kernels' φ codes)
from .launches import (  # noqa: F401  (re-exported: tests and tools call the building blocks from here)
    Norm,
    OnGrid,
    lepe_state_gradients,
    mixed_states,
    norm_pair,
    read_out,
    readers,
    readout_gradients,
    rstd_rows,
    run_readout,
    run_readout_backward,
    segment_states,
    state_gradients,
)


def _reader(S: torch.Tensor, z: torch.Tensor, zv: Optional[torch.Tensor], key_valid: Optional[torch.Tensor],
            tokens: int, scale: float, inline: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R, r, n): what every query reads. Kernel attention: S and z. InLine: A = (s/n)(S − z v̄ᵀ) and v̄ = zv/n,
    n the number of valid keys (B, 1, 1, 1). ``zv``: read by InLine only."""
    if key_valid is None:
        n = S.new_full((1, 1, 1, 1), float(tokens))
    else:
        n = valid_keys(key_valid).view(-1, 1, 1, 1)
    if not inline:
        return S, z, n
    v_mean = zv / n
    return (S - z.unsqueeze(-1) * v_mean.unsqueeze(-2)) * (scale / n).unsqueeze(-1), v_mean, n


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                     feature: int, feature_eps: float, eps: float, scale: float, inline: bool) -> torch.Tensor:
    """Kernel attention (or InLine, ``inline``) of (B, H, N, d) q, k, v: one launch when every head fits one
    program, else the state kernel (its last program per head sums the token ranges and makes R) and the read-out,
    with no torch op between. Autograd keeps q, k, v and o only; backward recomputes."""
    from .head_kernels import attention_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    q, k, v = unit_rows(q), unit_rows(k), unit_rows(v)
    B, H, N, D = q.shape
    plan = linear_launches(q, B * H, 1, N, True)
    if not plan.one_launch:  # two launches: what the queries read, then the read-out
        R, r, _, _ = readers(k, v, key_valid, feature, feature_eps, scale, inline)
        return read_out(q, R, r, None, feature, feature_eps, eps, not inline, True)
    block_n, block_d, warps = plan.block_n, plan.block_d, plan.warps
    o = _output_like(q)
    mask, s_mb = _mask_arg(key_valid, k)
    launch(attention_fwd_kernel, (B * H,),
        q, k, v, mask, o,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), s_mb, o.stride(0), o.stride(1), o.stride(2),
        H, N, D, feature_eps, eps, scale,
        FEATURE=feature, INLINE=inline, HAS_MASK=key_valid is not None, EVEN_D=D == block_d, BLOCK_N=block_n,
        BLOCK_D=block_d, **tile_kwargs(plan.tile), num_warps=warps, num_stages=plan.stages)
    return o


linear_attention = torch.library.custom_op("vitconvert::linear_attention", mutates_args=())(run_attention)


@linear_attention.register_fake
def _(q, k, v, key_valid, feature, feature_eps, eps, scale, inline):
    return _output_like(q)


def run_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                              key_valid: Optional[torch.Tensor], feature: int, feature_eps: float, eps: float,
                              scale: float, inline: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of :func:`linear_attention`: the state recomputed, the read-out's backward, then the state's
    (InLine's d×d chain rule in between: dS = (s/n) dA, dz = −dS v̄, dzv = (dv̄ − dSᵀ z) / n); one launch when every
    head fits one program (as the forward's), the d×d matrices in its registers, else three, the partial sums and
    the chain rule in the kernels' last programs."""
    from .head_kernels import attention_bwd_kernel  # lazy: start-up time

    B, H, N, D = q.shape
    plan = linear_launches(q, B * H, 1, N, True)
    if plan.one_launch_backward:
        q, k, v, o, do = (unit_rows(t) for t in (q, k, v, o, do))
        block_n, block_d, warps = plan.one_launch_bwd_block_n, plan.block_d, plan.warps
        dq, dk, dv = _output_like(q), _output_like(k), _output_like(v)
        mask, s_mb = _mask_arg(key_valid, k)
        launch(attention_bwd_kernel, (B * H,),
            q, k, v, mask, o, do, dq, dk, dv,
            *_strides(q, k, v), s_mb, *_strides(o, do, dq, dk, dv),
            H, N, D, feature_eps, eps, scale,
            FEATURE=feature, INLINE=inline, HAS_MASK=key_valid is not None,
            EVEN_D=D == block_d and key_valid is None, BLOCK_N=block_n, BLOCK_D=block_d, **tile_kwargs(plan.tile),
            num_warps=warps, num_stages=plan.stages)
        return dq, dk, dv
    R, r, z, n = readers(k, v, key_valid, feature, feature_eps, scale, inline)  # three launches, no op between
    dq, dS, dz, dzv, _, _ = readout_gradients(q, R, r, o, do, None, feature, feature_eps, eps, not inline,
                                        (z, n, scale) if inline else None, True)
    dk, dv = state_gradients(k, v, key_valid, None, dS, dz, dzv, feature, feature_eps, True)
    return dq, dk, dv


linear_attention_backward = torch.library.custom_op("vitconvert::linear_attention_backward", mutates_args=())(
    run_attention_backward)


@linear_attention_backward.register_fake
def _(q, k, v, o, do, key_valid, feature, feature_eps, eps, scale, inline):
    return tuple(_output_like(t) for t in (q, k, v))


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, key_valid, *args = inputs
    ctx.save_for_backward(q, k, v, output, key_valid)
    ctx.args = args


def _attention_backward(ctx, do):
    q, k, v, o, key_valid = ctx.saved_tensors
    try:
        dq, dk, dv = (run_attention_backward if direct(do) else linear_attention_backward)(q, k, v, o, do,
                                                                                          key_valid, *ctx.args)
    except KernelUnavailable as e:
        dq, dk, dv, _ = _eager_gradients(e, "linear_attention", _attention_eager, (q, k, v, key_valid), (do,),
                                         *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


linear_attention.register_autograd(_attention_backward, setup_context=_attention_setup)
_DirectAttention = _direct_function("DirectAttention", run_attention, _attention_setup, _attention_backward)


def _attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                     feature: int, feature_eps: float, eps: float, scale: float, inline: bool) -> torch.Tensor:
    """:func:`linear_attention` in torch (its backward's fallback)."""
    S, z, zv = fused_eager.state(k, v, key_valid, None, feature, feature_eps)
    R, r, _ = _reader(S, z, zv, key_valid, q.shape[2], scale, inline)
    return fused_eager.readout(q, R, r, None, feature, feature_eps, eps, not inline)


def _on_grid(q: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], index: Optional[torch.Tensor],
             weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], rows: int, cols: int,
             prefix: int) -> Optional[OnGrid]:
    """LePE's launch arguments (None without its weight; it needs the grid's index table)."""
    if weight is None:
        return None
    if index is None:
        raise ValueError("LePE in the blocked op needs the grid's index table")
    return OnGrid(v, key_valid, lepe_args(q, weight, bias, rows, cols, prefix), bias is not None, rows, cols, prefix)


def run_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                index: Optional[torch.Tensor], mixing: torch.Tensor, feature: int, feature_eps: float, eps: float,
                q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None, norm_eps: float = 0.0,
                lepe_weight: Optional[torch.Tensor] = None, lepe_bias: Optional[torch.Tensor] = None, rows: int = 0,
                cols: int = 0, prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, rstd): normalised kernel attention where queries of segment a read Σ_s mixing[a, s]·[S_s | z_s] (MHLA): the
    segments' states mixed by W̃ in the state kernel's last program of each batch·head, then the read-out, so autograd
    keeps neither S nor R. ``index`` None: one segment of all tokens. ``mixing``: G × G over the G segments, or (G − 1)
    × (G − 1) with the last segment's row and column ones (:func:`...blocks.extended_block_mix`, made as the kernels
    load it: MHLA's module passes its W as it is). With ``q_weight`` and ``k_weight``, q and k get MHLA's RMSNorm over
    heads (ε ``norm_eps``) as the kernels load them, each token's 1/rms taken there over every head's tile of it
    (:mod:`.norm_parts`; two launches in all), kept for backward (``rstd``: :func:`rstd_rows`; empty without the norm):
    autograd keeps the raw q and k (views of the qkv projection). With ``lepe_weight`` (C, 1, KS, KS), the grid tokens
    (rows × cols after ``prefix``) also get MHLA's LePE, the depthwise conv of the (masked) v, in the read-out's
    epilogue. Autograd keeps no output: the backward's do·o comes from its dot of do and R."""
    rstd = rstd_rows(q, q_weight, k_weight)
    q_norm, k_norm = norm_pair(q_weight, k_weight, rstd)
    on_grid = _on_grid(q, v, key_valid, index, lepe_weight, lepe_bias, rows, cols, prefix)
    R, r, _ = mixed_states(k, v, key_valid, index, mixing, feature, feature_eps, False, k_norm, norm_eps)
    return read_out(q, R, r, index, feature, feature_eps, eps, True, False, on_grid, q_norm, norm_eps), rstd


blocked_attention = torch.library.custom_op("vitconvert::blocked_attention", mutates_args=())(run_blocked)


@blocked_attention.register_fake
def _(q, k, v, key_valid, index, mixing, feature, feature_eps, eps, q_weight=None, k_weight=None, norm_eps=0.0,
      lepe_weight=None, lepe_bias=None, rows=0, cols=0, prefix=0):
    return _output_like(q), rstd_rows(q, q_weight, k_weight)


def run_blocked_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                         key_valid: Optional[torch.Tensor], index: Optional[torch.Tensor], mixing: torch.Tensor,
                         feature: int, feature_eps: float, eps: float, q_weight: Optional[torch.Tensor] = None,
                         k_weight: Optional[torch.Tensor] = None, norm_eps: float = 0.0,
                         rstd: Optional[torch.Tensor] = None, lepe_weight: Optional[torch.Tensor] = None,
                         rows: int = 0, cols: int = 0, prefix: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor, torch.Tensor]:
    """dq, dk, dv, dW̃, dq_weight, dk_weight, dlepe_weight, dlepe_bias (the weights' dtypes, LePE's bias as its weight;
    empty without the norm or LePE) of :func:`blocked_attention` in three launches, no torch op between: the mixed
    states again (each segment's unmixed one kept), the read-out's backward (its last program of a batch·head: dS_s =
    Σ_a W̃[a, s] dR_a and dW̃), the states' backward (LePE's: dv's taps of do, the filter's gradient summed by its
    last program; the norm's: dq, dk by the last program of each token range's heads: :mod:`.norm_parts`); dW̃ and
    the norm weights' gradients come summed over the batch by the kernels' last programs
    (:func:`.tickets.batch_total`). With the norm, q and k are the raw ones, normalised as they load with the
    forward's ``rstd``, which it then needs."""
    on_grid = _on_grid(q, v, key_valid, index, lepe_weight, None, rows, cols, prefix)
    q_norm, k_norm = norm_pair(q_weight, k_weight, rstd)
    if q_norm is not None and (rstd is None or rstd.shape != (2, q.shape[0], q.shape[2])):
        raise ValueError("the blocked op's backward with the RMSNorm needs the forward's rstd (2, B, N)")
    R, r, states = mixed_states(k, v, key_valid, index, mixing, feature, feature_eps, True, k_norm)
    dq, dS, dz, _, dmixing, dq_weight = readout_gradients(q, R, r, None, do, index, feature, feature_eps, eps, True,
                                                          None, False, (mixing, states), q_norm)
    dk, dv, dlepe, dk_weight = lepe_state_gradients(k, v, key_valid, index, dS, dz, None, feature, feature_eps, False,
                                                    on_grid, do, k_norm)
    dnorm = (dq_weight, dk_weight) if q_norm is not None else (q.new_empty((0,)), q.new_empty((0,)))
    if not dlepe:
        return dq, dk, dv, dmixing, *dnorm, q.new_empty((0,)), q.new_empty((0,))
    return dq, dk, dv, dmixing, *dnorm, dlepe[0].view(lepe_weight.shape), dlepe[1]


blocked_attention_backward = torch.library.custom_op("vitconvert::blocked_attention_backward", mutates_args=())(
    run_blocked_backward)


@blocked_attention_backward.register_fake
def _(q, k, v, do, key_valid, index, mixing, feature, feature_eps, eps, q_weight=None, k_weight=None, norm_eps=0.0,
      rstd=None, lepe_weight=None, rows=0, cols=0, prefix=0):
    norm = ((q.new_empty((0,)),) * 2 if q_weight is None or k_weight is None else
            (torch.empty_like(q_weight), torch.empty_like(k_weight)))
    lepe = ((q.new_empty((0,)),) * 2 if lepe_weight is None else
            (torch.empty_like(lepe_weight), q.new_empty((lepe_weight.shape[0],), dtype=lepe_weight.dtype)))
    return (*(_output_like(t) for t in (q, k, v)), torch.empty_like(mixing), *norm, *lepe)


def _blocked_setup(ctx, inputs, output) -> None:
    (q, k, v, key_valid, index, mixing, feature, feature_eps, eps, q_weight, k_weight, norm_eps, lepe_weight,
     lepe_bias, rows, cols, prefix) = inputs
    ctx.save_for_backward(q, k, v, key_valid, index, mixing, q_weight, k_weight, output[1], lepe_weight)
    ctx.set_materialize_grads(False)  # rstd is for backward only: it gets no gradient
    ctx.args = (feature, feature_eps, eps)
    ctx.grid = (rows, cols, prefix)
    ctx.norm_eps = norm_eps
    ctx.lepe_bias = None if lepe_bias is None else lepe_bias.dtype


def _blocked_backward(ctx, do, _):
    if do is None:
        return (None,) * 17
    q, k, v, key_valid, index, mixing, q_weight, k_weight, rstd, lepe_weight = ctx.saved_tensors
    try:  # the kernels, the norm's backward in them
        grads = run_blocked_backward if direct(do) else blocked_attention_backward
        dq, dk, dv, dmixing, dq_weight, dk_weight, dweight, dbias = grads(
            q, k, v, do, key_valid, index, mixing, *ctx.args, q_weight, k_weight, ctx.norm_eps, rstd, lepe_weight,
            *ctx.grid)
        if q_weight is None or k_weight is None:
            dq_weight = dk_weight = None
    except KernelUnavailable as e:  # the eager gradients on the normalised q and k, through the norm in torch
        unavailable = e
        bias = None if ctx.lepe_bias is None else v.new_zeros(lepe_weight.shape[0], dtype=ctx.lepe_bias)  # (a
        # stand-in of zeros: its gradient does not depend on it)

        def gradients(q_in: torch.Tensor, k_in: torch.Tensor) -> tuple:  # of the op on the normalised q and k
            dq, dk, dv, _, _, dmixing, dweight, dbias = _eager_gradients(
                unavailable, "blocked_attention", _blocked_eager,
                (q_in, k_in, v, key_valid, index, mixing, lepe_weight, bias), (do,), *ctx.args, *ctx.grid)
            return dq, dk, dv, dmixing, dweight, dbias

        dq, dk, dv, dmixing, dweight, dbias, dq_weight, dk_weight = through_rms_pair(q, k, q_weight, k_weight,
                                                                                     ctx.norm_eps, gradients)
    if lepe_weight is None:
        dweight = dbias = None
    else:
        dweight = dweight.to(lepe_weight.dtype)
        dbias = None if ctx.lepe_bias is None else dbias.to(ctx.lepe_bias)
    return (dq, dk, dv, None, None, dmixing, None, None, None, dq_weight, dk_weight, None, dweight, dbias, None, None,
            None)


blocked_attention.register_autograd(_blocked_backward, setup_context=_blocked_setup)
_DirectBlocked = _direct_function("DirectBlocked", run_blocked, _blocked_setup, _blocked_backward)


def _blocked_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                   index: Optional[torch.Tensor], mixing: torch.Tensor, lepe_weight: Optional[torch.Tensor],
                   lepe_bias: Optional[torch.Tensor], feature: int, feature_eps: float, eps: float, rows: int,
                   cols: int, prefix: int) -> torch.Tensor:
    """:func:`blocked_attention` in torch, on normalised q and k (its backward's fallback), in float32."""
    S, z, _ = fused_eager.state(k, v, key_valid, index, feature, feature_eps)
    with torch.autocast(S.device.type, enabled=False):  # (autocast would round the states to bf16)
        m = mixing.to(torch.float32)
        if m.shape[0] < S.shape[2]:  # (the last segment's row and column of ones, as the kernels make them)
            m = extended_block_mix(m)
        R, r = torch.matmul(m, S.flatten(-2)).view(S.shape), torch.matmul(m, z)
    out = fused_eager.readout(q, R, r, index, feature, feature_eps, eps, True)
    if lepe_weight is None:
        return out
    return grid_conv_eager(v, out, lepe_weight, lepe_bias, key_valid, rows, cols, prefix)


# -- the variants' forms ------------------------------------------------------------------------------------
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], feature: int,
              feature_eps: float, eps: float, scale: float, inline: bool) -> torch.Tensor:
    """``vitconvert::linear_attention`` on raw (B, H, N, d) q, k, v (φ applied in the kernels): ELU's and ReLU's
    φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)·Σ_j φ(k_j) + ε) (``feature`` the φ code), or with ``inline`` InLine's
    q_iᵀ (s/n)(Σ k vᵀ − (Σ k) v̄ᵀ) + v̄ (φ = identity, ``scale`` s)."""
    return call_op(linear_attention, _DirectAttention, run_attention,
                   (q, k, v, key_valid, feature, feature_eps, eps, scale, inline), (q, k, v))


def segmented_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                        index: Optional[torch.Tensor], mixing: torch.Tensor, feature: int, feature_eps: float,
                        eps: float, q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                        norm_eps: float = 0.0, lepe_weight: Optional[torch.Tensor] = None,
                        lepe_bias: Optional[torch.Tensor] = None, grid: tuple[int, int] = (0, 0),
                        prefix: int = 0) -> torch.Tensor:
    """Normalised kernel attention where queries of segment a read Σ_s mixing[a, s]·[S_s | z_s] (MHLA), after
    the RMSNorm over heads of q and k when their weights are given (computed in the op, recomputed in backward),
    plus LePE (``lepe_weight``, ``lepe_bias``) over the ``grid`` after ``prefix`` tokens where given."""
    args = (q, k, v, key_valid, index, mixing, feature, feature_eps, eps, q_weight, k_weight, norm_eps, lepe_weight,
            lepe_bias, *grid, prefix)
    return call_op(blocked_attention, _DirectBlocked, run_blocked, args, (q, k, v, mixing, q_weight, k_weight,
                                                                          lepe_weight, lepe_bias))[0]
