"""MHLA's attention in its pairwise form on the GPU: the Triton kernels of :mod:`.kernels` as one op.

``vitconvert::pairwise_attention``  (q, k, v, segments, W̃) -> o

The output of ``vitconvert::blocked_attention`` (:mod:`.fused`), A_ij = φ(q_i)·φ(k_j)·W̃[s(i), s(j)] summed over
the keys tile by tile as FlashAttention sums softmax's, where the blocked form goes through per-segment d×d
states. Which form a call takes is :func:`pairwise_is_cheaper`'s (``VITCONVERT_MHLA_FORM`` forces one). Like the
blocked op it applies MHLA's RMSNorm to q and k itself, as their tiles load (each token's 1/rms of q and k taken by
the forward kernel, which reads every head's tiles: no normalised copy crosses memory, forward or backward; the
norm's backward runs in the one backward kernel's epilogues), and autograd keeps only the raw q, k and v and the
1/rms (no output, no state: backward reads the forward out again), registered like the other ops: torch.compile
and torch.export see one op, and a plain eager call skips the dispatcher (:func:`.dispatch.direct`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..calls import _direct_function, _eager_gradients, call_op
from ..dispatch import KernelUnavailable, direct, launch, launch_settings, triton_next_power_of_2
from ..grid.op import grid_conv_eager
from ..launch_plan import pairwise_launches, tile_kwargs
from ..layout import _mask_arg, _output_like, _strides, lepe_args, lepe_gradients, unit_rows
from ..linear import eager as fused_eager
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


def _block_g(segments: int) -> int:
    """W̃'s side padded to a dot's (the one-hot dots that sum its gradient)."""
    return max(16, triton_next_power_of_2(segments))


def _rstd(q: torch.Tensor, q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor]) -> torch.Tensor:
    """What the forward keeps for backward besides q, k, v: (2·B·N + 2·B,) float32, the 1/rms over all heads of q's
    and of k's tokens, which the forward kernel takes as it reads them, then the backward's two tickets per image
    (int32, zeroed by the forward kernel: :func:`_norm_args`); an empty tensor without the norm."""
    if q_weight is None or k_weight is None:
        return q.new_empty((0,), dtype=torch.float32)
    B, N = q.shape[0], q.shape[2]
    return q.new_empty((2 * B * N + 2 * B,), dtype=torch.float32)


NormArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]


def _norm_args(q: torch.Tensor, k: torch.Tensor, rstd: torch.Tensor, q_weight: Optional[torch.Tensor],
               k_weight: Optional[torch.Tensor]) -> NormArgs:
    """(q's rstd, k's rstd, q's weight, k's weight, the tickets, NORM) of the kernels, views of :func:`_rstd`'s
    tensor: placeholders (q) without the norm."""
    if q_weight is None or k_weight is None:
        return q, q, q, q, q, False
    B, N = q.shape[0], q.shape[2]
    table = rstd[:2 * B * N].view(2, B, N)
    return (table[0], table[1], q_weight.to(torch.float32).contiguous(), k_weight.to(torch.float32).contiguous(),
            rstd[2 * B * N:].view(torch.int32), True)


def run_pairwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                 segments: torch.Tensor, mixing: torch.Tensor, feature: int, feature_eps: float, eps: float,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                 norm_eps: float = 0.0, lepe_weight: Optional[torch.Tensor] = None,
                 lepe_bias: Optional[torch.Tensor] = None, rows: int = 0, cols: int = 0,
                 prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, rstd): o_i = Σ_j A_ij v_j / (Σ_j A_ij + ε), A_ij = φ(q_i)·φ(k_j)·mixing[s(i), s(j)], for (B, H, N, d)
    q, k, v, ``segments`` the (N,) int32 segment of each token and ``mixing`` W̃ (G, G); q and k first get MHLA's
    RMSNorm over heads when their weights are given (applied as the kernel loads them), and rstd, each token's
    1/rms of q and of k and the backward's tickets (:func:`_rstd`; empty without the norm). With
    ``lepe_weight`` (C, 1, KS, KS), o's grid tokens (the last rows × cols after ``prefix``) also get MHLA's LePE,
    the depthwise conv of the (masked) v on the grid, in the kernel's epilogue: no pass of its own."""
    from .kernels import pairwise_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    q, k, v = unit_rows(q), unit_rows(k), unit_rows(v)
    lepe = lepe_args(q, lepe_weight, lepe_bias, rows, cols, prefix)
    rstd = _rstd(q, q_weight, k_weight)
    *norm, normed = _norm_args(q, k, rstd, q_weight, k_weight)
    plan = pairwise_launches(q, normed)  # (decided once per head dim, dtype, norm and settings)
    B, H, N, D = q.shape
    o = _output_like(q)
    mask, s_mb = _mask_arg(key_valid, k)
    launch(pairwise_fwd_kernel, (B if normed else B * H, -(-N // plan.block_m)),  # (with the norm, a program per
        # image's query tile)
        q, k, v, mask, segments, _table(mixing), *norm, lepe.filters, lepe.bias, o,
        *_strides(q, k, v), s_mb, *_strides(o),
        H, N, D, mixing.shape[0], prefix, rows, cols, feature_eps, eps, norm_eps,
        FEATURE=feature, HAS_MASK=key_valid is not None, NORM=normed, LEPE=lepe.on, KS=lepe.size,
        HAS_LBIAS=lepe_bias is not None, BLOCK_M=plan.block_m, BLOCK_N=plan.block_m, BLOCK_D=plan.block_d,
        **tile_kwargs(plan.tile), num_warps=plan.warps)
    return o, rstd


def _table(mixing: torch.Tensor) -> torch.Tensor:
    return mixing.to(torch.float32).contiguous()


pairwise_attention = torch.library.custom_op("vitconvert::pairwise_attention", mutates_args=())(run_pairwise)


@pairwise_attention.register_fake
def _(q, k, v, key_valid, segments, mixing, feature, feature_eps, eps, q_weight=None, k_weight=None, norm_eps=0.0,
      lepe_weight=None, lepe_bias=None, rows=0, cols=0, prefix=0):
    B, _, N, _ = q.shape
    normed = q_weight is not None and k_weight is not None
    return _output_like(q), q.new_empty((2 * B * N + 2 * B,) if normed else (0,), dtype=torch.float32)


def run_pairwise_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                          key_valid: Optional[torch.Tensor], segments: torch.Tensor, mixing: torch.Tensor,
                          feature: int, feature_eps: float, eps: float, q_weight: Optional[torch.Tensor] = None,
                          k_weight: Optional[torch.Tensor] = None, rstd: Optional[torch.Tensor] = None,
                          lepe_weight: Optional[torch.Tensor] = None, rows: int = 0, cols: int = 0, prefix: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                     torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, dW̃, dq_weight, dk_weight, dlepe_weight, dlepe_bias (float32) of :func:`pairwise_attention`: one
    launch, a program per batch·head (:func:`.kernels.pairwise_bwd_kernel`: the query tiles, which read the forward
    out again, then the key tiles, with LePE's backward and each side's norm backward), normalising q and k as they
    load (with the forward's ``rstd``); what is left to torch is summing the weights' gradients over the batch (the
    weights' gradients empty without the norm or LePE)."""
    from .kernels import pairwise_bwd_kernel  # lazy: start-up time

    q, k, v, do = unit_rows(q), unit_rows(k), unit_rows(v), unit_rows(do)
    *norm, normed = _norm_args(q, k, rstd, q_weight, k_weight)
    G = mixing.shape[0]
    B, H, N, D = q.shape
    plan = pairwise_launches(q, normed)
    dq, dk, dv = _output_like(q), _output_like(k), _output_like(v)
    den = q.new_empty((2, B * H, N), dtype=torch.float32)  # each query's 1/den and dden, for the key tiles
    dmixing = q.new_empty((B * H, G, G), dtype=torch.float32)
    dweights = [q.new_empty((B, H * D) if normed else (0,), dtype=torch.float32) for _ in range(2)]  # the norm's
    mask, s_mb = _mask_arg(key_valid, k)
    lepe = lepe_args(q, lepe_weight, None, rows, cols, prefix)
    dlepe = [q.new_empty((B, H * D, lepe.size ** 2) if lepe.on else (0,), dtype=torch.float32),
             q.new_empty((B, H * D) if lepe.on else (0,), dtype=torch.float32)]
    launch(pairwise_bwd_kernel, (B * H,),
        q, k, v, mask, segments, _table(mixing), *norm, lepe.filters, do, dq, dk, dv, den, dmixing,
        *(dlepe if lepe.on else (den, den)), *(dweights if normed else (den, den)),
        *_strides(q, k, v), s_mb, *_strides(do, dq, dk, dv),
        B, H, N, D, G, prefix, rows, cols, feature_eps, eps,
        FEATURE=feature, HAS_MASK=key_valid is not None, NORM=normed, LEPE=lepe.on, KS=lepe.size,
        BLOCK_M=plan.backward_block_m, BLOCK_N=plan.backward_block_n, BLOCK_D=plan.block_d, BLOCK_G=_block_g(G),
        BLOCK_H=triton_next_power_of_2(H), **tile_kwargs(plan.backward_tile), num_warps=plan.backward_warps)
    dmixing = dmixing.sum(0).to(mixing.dtype)
    lepe_grads = lepe_gradients(*dlepe, lepe_weight)
    if not normed:
        return dq, dk, dv, dmixing, q.new_empty((0,)), q.new_empty((0,)), *lepe_grads
    dq_weight, dk_weight = (part.view(-1) if B == 1 else part.sum(0) for part in dweights)  # (each image's, in a
    # fixed order)
    return dq, dk, dv, dmixing, dq_weight.to(q_weight.dtype), dk_weight.to(k_weight.dtype), *lepe_grads


pairwise_attention_backward = torch.library.custom_op("vitconvert::pairwise_attention_backward", mutates_args=())(
    run_pairwise_backward)


@pairwise_attention_backward.register_fake
def _(q, k, v, do, key_valid, segments, mixing, feature, feature_eps, eps, q_weight=None, k_weight=None, rstd=None,
      lepe_weight=None, rows=0, cols=0, prefix=0):
    weights = [q.new_empty((0,)) if w is None or k_weight is None or q_weight is None else torch.empty_like(w)
               for w in (q_weight, k_weight)]
    lepe = ((q.new_empty((0,)),) * 2 if lepe_weight is None else
            (torch.empty_like(lepe_weight, dtype=torch.float32), q.new_empty((lepe_weight.shape[0],),
                                                                            dtype=torch.float32)))
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
    scores = (phi_q @ phi_k.transpose(-2, -1)) * mixing.to(torch.float32)[seg][:, seg]
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
