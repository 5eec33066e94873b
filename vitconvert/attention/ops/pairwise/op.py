"""MHLA's attention in its pairwise form on the GPU: the Triton kernels of :mod:`.kernels` as one op.

``vitconvert::pairwise_attention``  (q, k, v, segments, W̃) -> o

The output of ``vitconvert::blocked_attention`` (:mod:`.fused`), A_ij = φ(q_i)·φ(k_j)·W̃[s(i), s(j)] summed over
the keys tile by tile as FlashAttention sums softmax's, where the blocked form goes through per-segment d×d
states. Which form a call takes is :func:`pairwise_is_cheaper`'s (``VITCONVERT_MHLA_FORM`` forces one). Like the
blocked op it applies MHLA's RMSNorm to q and k itself, as their tiles load (each token's 1/rms of q and k taken by
the forward kernel, which reads every head's tiles: no normalised copy crosses memory, forward or backward; the
norm's backward runs in the one backward kernel's epilogues), and autograd keeps only the raw q, k and v and the
1/rms (no output, no state: backward reads the forward out again), registered like the other ops: torch.compile
and torch.export see one op, and a plain eager call skips the dispatcher (:func:`.dispatch.direct`). As the blocked
op, it runs no torch op around its two launches: W̃ and the norm weights are read as given (W̃'s class-token row and
column of ones made as the kernels load it), and the gradients of W̃, the norm weights and LePE come summed over the
batch by the backward's last programs (:func:`..linear.tickets.batch_total`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...blocks import extended_block_mix
from ..calls import _direct_function, _eager_gradients, call_op
from ..dispatch import KernelUnavailable, direct, launch, launch_settings, triton_next_power_of_2
from ..grid.op import grid_conv_eager
from ..launch_plan import pairwise_launches, tile_kwargs
from ..layout import _mask_arg, _output_like, _strides, lepe_args, unit_rows
from ..linear import eager as fused_eager
from ..linear.launches import block_g, norm_launch_args, norm_pair, rstd_rows, tickets
from ..norms.lean import through_rms_pair

MAX_SEGMENTS = 64  # W̃'s gradient is summed through one-hot dots of G padded to a power of two: 64 at most
# Tensor-core FLOPs the pairwise kernels do in the time the blocked form moves one byte of its states: an H200
# gives ~990 bf16 (495 TF32) dense TFLOP/s against 4.8 TB/s, ~100 with TF32 tiles; its kernels reach about half
# (FlashAttention's share). A guess until gpu_check's op section times both forms (`--sections op`: mhla rows).
FLOPS_PER_STATE_BYTE = 64


def pairwise_is_cheaper(tokens: int, segments: int, head_dim: int, dtype: torch.dtype,
                        form: Optional[str] = None) -> bool:
    """Whether MHLA's attention of ``tokens`` tokens in ``segments`` segments on ``dtype`` q, k, v takes the
    pairwise kernels.

    Per head, the pairwise forward does 4·N²·d FLOPs of dots; the blocked one writes G float32 states of
    d·(d+1), mixes them (a read and a write) and reads them in the read-out: 16·G·d·(d+1) bytes on top of the
    q, k, v and o both read and write. At 224 px (197 tokens, 2×2 blocks and the class token, d = 64) the states
    move 3.3× the bytes of q, k, v and o and the pairwise form wins by ~2× on this count; from 384 px (577
    tokens, 10 segments) on the blocked form does. Half inputs only: on float32 ones (TF32 off, as torch's default) the
    dots are not on tensor cores, and the pairwise kernels do not fit sm_90 as well as the blocked form's
    (benchmarks/kernel_resources.py --arch sm_90). ``form`` (the context's ``VITCONVERT_MHLA_FORM`` when None):
    ``pairwise`` or ``blocked`` forces one (the pairwise form only up to :data:`MAX_SEGMENTS` segments)."""
    form = form or launch_settings().form
    if segments > MAX_SEGMENTS or form == "blocked":
        return False
    if form == "pairwise":
        return True
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    return 4 * tokens * tokens * head_dim < FLOPS_PER_STATE_BYTE * 16 * segments * head_dim * (head_dim + 1)


def run_pairwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                 segments: torch.Tensor, mixing: torch.Tensor, feature: int, feature_eps: float, eps: float,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                 norm_eps: float = 0.0, lepe_weight: Optional[torch.Tensor] = None,
                 lepe_bias: Optional[torch.Tensor] = None, rows: int = 0, cols: int = 0,
                 prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, rstd): o_i = Σ_j A_ij v_j / (Σ_j A_ij + ε), A_ij = φ(q_i)·φ(k_j)·W̃[s(i), s(j)], for (B, H, N, d)
    q, k, v, ``segments`` the (N,) int32 segment of each token and ``mixing`` W̃ (G, G), or W (G − 1, G − 1) of
    the first G − 1 segments, the last one's row and column of W̃ ones (MHLA's class token:
    :func:`...blocks.extended_block_mix`, made as the kernels load W); q and k first get MHLA's RMSNorm over heads
    when their weights are given (applied as the kernel loads them), and rstd, each token's 1/rms of q and of k
    (:func:`..linear.launches.rstd_rows`: (2, B, N); empty without the norm). With
    ``lepe_weight`` (C, 1, KS, KS), o's grid tokens (the last rows × cols after ``prefix``) also get MHLA's LePE,
    the depthwise conv of the (masked) v on the grid, in the kernel's epilogue: no pass of its own."""
    from .kernels import pairwise_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    q, k, v = unit_rows(q), unit_rows(k), unit_rows(v)
    lepe = lepe_args(q, lepe_weight, lepe_bias, rows, cols, prefix)
    rstd = rstd_rows(q, q_weight, k_weight)
    q_norm, k_norm = norm_pair(q_weight, k_weight, rstd)
    normed = q_norm is not None
    norm = (q_norm[0], k_norm[0], q_norm[1], k_norm[1]) if normed else (q,) * 4  # (1/rms of q, of k; the weights)
    plan = pairwise_launches(q, normed)  # (decided once per head dim, dtype, norm and settings)
    B, H, N, D = q.shape
    o = _output_like(q)
    mask, s_mb = _mask_arg(key_valid, k)
    launch(pairwise_fwd_kernel, (B if normed else B * H, -(-N // plan.block_m)),  # (with the norm, a program per
        # image's query tile)
        q, k, v, mask, segments, mixing.contiguous(), *norm, lepe.filters, lepe.bias, o,
        *_strides(q, k, v), s_mb, *_strides(o),
        H, N, D, mixing.shape[0], prefix, rows, cols, feature_eps, eps, norm_eps,
        FEATURE=feature, HAS_MASK=key_valid is not None, NORM=normed, LEPE=lepe.on, KS=lepe.size,
        HAS_LBIAS=lepe_bias is not None, BLOCK_M=plan.block_m, BLOCK_N=plan.block_m, BLOCK_D=plan.block_d,
        **tile_kwargs(plan.tile), num_warps=plan.warps)
    return o, rstd


pairwise_attention = torch.library.custom_op("vitconvert::pairwise_attention", mutates_args=())(run_pairwise)


@pairwise_attention.register_fake
def _(q, k, v, key_valid, segments, mixing, feature, feature_eps, eps, q_weight=None, k_weight=None, norm_eps=0.0,
      lepe_weight=None, lepe_bias=None, rows=0, cols=0, prefix=0):
    return _output_like(q), rstd_rows(q, q_weight, k_weight)


def _lepe_rows(q: torch.Tensor, size: int, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows of the filter's gradient (B·H, d, KS·KS), of the bias' (B·H, d), float32, and their sums over the batch
    (H·d, KS·KS), (H·d) in the weight's ``dtype``) of the backward kernel, which sums the rows; with one image and a
    float32 weight its rows are the sums (views: the kernel's sum of one row writes it back where it is, no copy)."""
    B, H, _, D = q.shape
    rows = q.new_empty((B * H, D, size * size), dtype=torch.float32), q.new_empty((B * H, D), dtype=torch.float32)
    if B == 1 and dtype == torch.float32:
        return (*rows, rows[0].view(H * D, size * size), rows[1].view(H * D))
    return (*rows, q.new_empty((H * D, size * size), dtype=dtype), q.new_empty((H * D,), dtype=dtype))


def run_pairwise_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                          key_valid: Optional[torch.Tensor], segments: torch.Tensor, mixing: torch.Tensor,
                          feature: int, feature_eps: float, eps: float, q_weight: Optional[torch.Tensor] = None,
                          k_weight: Optional[torch.Tensor] = None, rstd: Optional[torch.Tensor] = None,
                          lepe_weight: Optional[torch.Tensor] = None, rows: int = 0, cols: int = 0, prefix: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                     torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, dW̃, dq_weight, dk_weight, dlepe_weight, dlepe_bias of :func:`pairwise_attention`: one launch, a
    program per batch·head (:func:`.kernels.pairwise_bwd_kernel`: the query tiles, which read the forward out again,
    then the key tiles, with LePE's backward and each side's norm backward), normalising q and k as they load (with
    the forward's ``rstd``), and no torch op after it: dW̃ and the norm weights' gradients come summed over the batch
    by its last programs in the weights' dtypes, LePE's bias' in its weight's (the weights' gradients empty without
    the norm or LePE)."""
    from .kernels import pairwise_bwd_kernel  # lazy: start-up time

    q, k, v, do = unit_rows(q), unit_rows(k), unit_rows(v), unit_rows(do)
    normed = q_weight is not None and k_weight is not None
    if normed and (rstd is None or rstd.shape != (2, q.shape[0], q.shape[2])):
        raise ValueError("the pairwise op's backward with the RMSNorm needs the forward's rstd (2, B, N)")
    q_norm, k_norm = norm_pair(q_weight, k_weight, rstd)
    GW = mixing.shape[0]
    B, H, N, D = q.shape
    plan = pairwise_launches(q, normed)
    dq, dk, dv = _output_like(q), _output_like(k), _output_like(v)
    den = q.new_empty((2, B * H, N), dtype=torch.float32)  # each query's 1/den and dden, for the key tiles
    mixing_rows = q.new_empty((B * H + B, GW * GW), dtype=torch.float32)  # (each batch·head's dW̃, then each image's)
    dmixing = torch.empty_like(mixing)
    q_args = norm_launch_args(q_norm, den, B, H, D, 1, 0)  # (RSTD, NW, DNW, NCOUNTER, NWG: an image is one range)
    k_args = norm_launch_args(k_norm, den, B, H, D, 1, 2 * B + 1)
    used = 4 * B + 2  # (the two norms' tickets, then B + 1 for dW̃'s sum and one for LePE's)
    mask, s_mb = _mask_arg(key_valid, k)
    lepe = lepe_args(q, lepe_weight, None, rows, cols, prefix)
    dlepe = _lepe_rows(q, lepe.size, lepe.filters.dtype) if lepe.on else (den,) * 4
    launch(pairwise_bwd_kernel, (B * H,),
        q, k, v, mask, segments, mixing.contiguous(), *q_args, *k_args, lepe.filters, do, dq, dk, dv, den,
        mixing_rows, tickets(used + B + 2, q.device)[used:used + B + 2], dmixing, *dlepe,
        *_strides(q, k, v), s_mb, *_strides(do, dq, dk, dv),
        B, H, N, D, GW, prefix, rows, cols, feature_eps, eps,
        FEATURE=feature, HAS_MASK=key_valid is not None, NORM=normed, LEPE=lepe.on, KS=lepe.size,
        BLOCK_M=plan.backward_block_m, BLOCK_N=plan.backward_block_n, BLOCK_D=plan.block_d, BLOCK_G=block_g(GW),
        BLOCK_H=triton_next_power_of_2(H), **tile_kwargs(plan.backward_tile), num_warps=plan.backward_warps)
    dnorm = (q_args[4], k_args[4]) if normed else (q.new_empty((0,)), q.new_empty((0,)))
    if not lepe.on:
        return dq, dk, dv, dmixing, *dnorm, q.new_empty((0,)), q.new_empty((0,))
    return dq, dk, dv, dmixing, *dnorm, dlepe[2].view(lepe_weight.shape), dlepe[3]


pairwise_attention_backward = torch.library.custom_op("vitconvert::pairwise_attention_backward", mutates_args=())(
    run_pairwise_backward)


@pairwise_attention_backward.register_fake
def _(q, k, v, do, key_valid, segments, mixing, feature, feature_eps, eps, q_weight=None, k_weight=None, rstd=None,
      lepe_weight=None, rows=0, cols=0, prefix=0):
    weights = [q.new_empty((0,)) if w is None or k_weight is None or q_weight is None else torch.empty_like(w)
               for w in (q_weight, k_weight)]
    lepe = ((q.new_empty((0,)),) * 2 if lepe_weight is None else
            (torch.empty_like(lepe_weight), q.new_empty((lepe_weight.shape[0],), dtype=lepe_weight.dtype)))
    return (*(_output_like(t) for t in (q, k, v)), torch.empty_like(mixing), *weights, *lepe)


def _setup(ctx, inputs, output) -> None:
    (q, k, v, key_valid, segments, mixing, feature, feature_eps, eps, q_weight, k_weight, norm_eps, lepe_weight,
     lepe_bias, rows, cols, prefix) = inputs
    ctx.save_for_backward(q, k, v, key_valid, segments, mixing, q_weight, k_weight, output[1], lepe_weight)
    ctx.set_materialize_grads(False)  # rstd is for backward only: it gets no gradient
    ctx.args = (feature, feature_eps, eps)
    ctx.grid = (rows, cols, prefix)
    ctx.norm_eps = norm_eps
    ctx.lepe_bias = None if lepe_bias is None else lepe_bias.dtype


def _backward(ctx, do, _):
    if do is None:
        return (None,) * 17
    q, k, v, key_valid, segments, mixing, q_weight, k_weight, rstd, lepe_weight = ctx.saved_tensors
    try:  # the kernels, normalising q and k as they load, then the norm's backward kernel
        grads = run_pairwise_backward if direct(do) else pairwise_attention_backward
        dq, dk, dv, dmixing, dq_weight, dk_weight, dlepe_weight, dlepe_bias = grads(
            q, k, v, do, key_valid, segments, mixing, *ctx.args, q_weight, k_weight, rstd, lepe_weight, *ctx.grid)
        if q_weight is None or k_weight is None:
            dq_weight = dk_weight = None
    except KernelUnavailable as e:  # the eager gradients on the normalised q and k, through the norm in torch
        unavailable = e
        dlepe_bias = None if ctx.lepe_bias is None else v.new_zeros(lepe_weight.shape[0], dtype=ctx.lepe_bias)

        def gradients(q_in: torch.Tensor, k_in: torch.Tensor) -> tuple:  # of the op on the normalised q and k
            return _eager_gradients(unavailable, "pairwise_attention", _eager_with_lepe,
                                    (q_in, k_in, v, key_valid, segments, mixing, lepe_weight, dlepe_bias), (do,),
                                    *ctx.args, *ctx.grid)

        dq, dk, dv, _, _, dmixing, dlepe_weight, dlepe_bias, dq_weight, dk_weight = through_rms_pair(
            q, k, q_weight, k_weight, ctx.norm_eps, gradients)
    if lepe_weight is None:
        dlepe_weight = dlepe_bias = None
    else:
        dlepe_weight = dlepe_weight.to(lepe_weight.dtype)
        dlepe_bias = None if ctx.lepe_bias is None else dlepe_bias.to(ctx.lepe_bias)
    return (dq, dk, dv, None, None, dmixing, None, None, None, dq_weight, dk_weight, None, dlepe_weight, dlepe_bias,
            None, None, None)


pairwise_attention.register_autograd(_backward, setup_context=_setup)
_DirectPairwise = _direct_function("DirectPairwise", run_pairwise, _setup, _backward)


def pairwise_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                   segments: torch.Tensor, mixing: torch.Tensor, feature: int, feature_eps: float,
                   eps: float) -> torch.Tensor:
    """:func:`pairwise_attention` in torch on normalised q and k, in float32 with the N×N weights explicit (its
    backward's fallback: the op only runs where N×N is small)."""
    phi_q, phi_k = fused_eager.phi(q, feature, feature_eps), fused_eager.phi(k, feature, feature_eps)
    if key_valid is not None:
        phi_k = phi_k * key_valid[:, None, :, None].to(phi_k.dtype)
    seg = segments.long()
    table = extended_block_mix(mixing.to(torch.float32))  # (segment G − 1 reads ones where W is (G − 1)², as the
    # kernels make them; an unused row and column where it is G × G)
    scores = (phi_q @ phi_k.transpose(-2, -1)) * table[seg][:, seg]
    return ((scores @ v.to(torch.float32)) / (scores.sum(-1, keepdim=True) + eps)).to(v.dtype)


def _eager_with_lepe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                     segments: torch.Tensor, mixing: torch.Tensor, lepe_weight: Optional[torch.Tensor],
                     lepe_bias: Optional[torch.Tensor], feature: int, feature_eps: float, eps: float, rows: int,
                     cols: int, prefix: int) -> torch.Tensor:
    """:func:`pairwise_eager`, plus LePE (:func:`..grid.op.grid_conv_eager`) where the op adds it."""
    out = pairwise_eager(q, k, v, key_valid, segments, mixing, feature, feature_eps, eps)
    if lepe_weight is None:
        return out
    return grid_conv_eager(v, out, lepe_weight, lepe_bias, key_valid, rows, cols, prefix)


def pairwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
             segments: torch.Tensor, mixing: torch.Tensor, feature: int, feature_eps: float, eps: float,
             q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
             norm_eps: float = 0.0, lepe_weight: Optional[torch.Tensor] = None,
             lepe_bias: Optional[torch.Tensor] = None, grid: tuple[int, int] = (0, 0), prefix: int = 0) -> torch.Tensor:
    """The op's output, called direct where it may (:func:`..calls.call_op`);
    LePE (``lepe_weight``, ``lepe_bias``) over the tokens after ``prefix``, a ``grid``, added where given."""
    args = (q, k, v, key_valid, segments, mixing, feature, feature_eps, eps, q_weight, k_weight, norm_eps,
            lepe_weight, lepe_bias, *grid, prefix)
    return call_op(pairwise_attention, _DirectPairwise, run_pairwise, args, (q, k, v, mixing, q_weight,
                                                                                    k_weight, lepe_weight,
                                                                                    lepe_bias))[0]
