"""MHLA's attention in its pairwise form on the GPU: the Triton kernels of :mod:`.pairwise_kernels` as one op.

``vitconvert::pairwise_attention``  (q, k, v, segments, W̃) -> o

The output of ``vitconvert::blocked_attention`` (:mod:`.fused`), A_ij = φ(q_i)·φ(k_j)·W̃[s(i), s(j)] summed over
the keys tile by tile as FlashAttention sums softmax's, where the blocked form goes through per-segment d×d
states. Which form a call takes is :func:`pairwise_is_cheaper`'s (``VITCONVERT_MHLA_FORM`` forces one). Like the
blocked op it applies MHLA's RMSNorm to q and k itself, and autograd keeps only the raw q, k and v (no output,
no state: backward reads the forward out again), registered like the other ops: torch.compile and torch.export
see one op, and a plain eager call skips the dispatcher (:func:`.dispatch.direct`).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import fused, fused_eager
from .dispatch import (
    KernelUnavailable,
    block_sizes,
    launch,
    launch_settings,
    spill_free_chunk,
    tile_args,
    triton_next_power_of_2,
)
from .fused import _direct_function
from .fused_parts import _eager_gradients, _mask_arg, _output_like, _strides, unit_rows
from .lean_norms import rms_pair, through_rms_pair

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


def _geometry(q: torch.Tensor, segments: int) -> tuple[int, ...]:
    """B, H, N, d, the programs' token tiles (count, BLOCK_M: the forward's key chunk as well), BLOCK_D, warps and
    BLOCK_G (W̃'s side padded to a dot's)."""
    B, H, N, D = q.shape
    block, block_d, warps = block_sizes(D)
    return B, H, N, D, -(-N // block), block, block_d, warps, max(16, triton_next_power_of_2(segments))


def run_pairwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                 segments: torch.Tensor, mixing: torch.Tensor, feature: int, feature_eps: float, eps: float,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                 norm_eps: float = 0.0) -> torch.Tensor:
    """o_i = Σ_j A_ij v_j / (Σ_j A_ij + ε), A_ij = φ(q_i)·φ(k_j)·mixing[s(i), s(j)], for (B, H, N, d) q, k, v,
    ``segments`` the (N,) int32 segment of each token and ``mixing`` W̃ (G, G); q and k first get MHLA's RMSNorm
    over heads when their weights are given (a transient of the op)."""
    from .pairwise_kernels import pairwise_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    q, k = rms_pair(q, k, q_weight, k_weight, norm_eps)
    q, k, v = unit_rows(q), unit_rows(k), unit_rows(v)
    B, H, N, D, tiles, block, block_d, warps, _ = _geometry(q, mixing.shape[0])
    o = _output_like(q)
    mask, s_mb = _mask_arg(key_valid, k)
    launch(pairwise_fwd_kernel, (B * H, tiles),
        q, k, v, mask, segments, _table(mixing), o,
        *_strides(q, k, v), s_mb, *_strides(o),
        H, N, D, mixing.shape[0], feature_eps, eps,
        FEATURE=feature, HAS_MASK=key_valid is not None, BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d,
        **tile_args(q), num_warps=warps)
    return o


def _table(mixing: torch.Tensor) -> torch.Tensor:
    return mixing.to(torch.float32).contiguous()


pairwise_attention = torch.library.custom_op("vitconvert::pairwise_attention", mutates_args=())(run_pairwise)


@pairwise_attention.register_fake
def _(q, k, v, key_valid, segments, mixing, feature, feature_eps, eps, q_weight=None, k_weight=None, norm_eps=0.0):
    return _output_like(q)


def run_pairwise_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                          key_valid: Optional[torch.Tensor], segments: torch.Tensor, mixing: torch.Tensor,
                          feature: int, feature_eps: float,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, dW̃ of :func:`pairwise_attention` on normalised q and k: the dq kernel (which reads the
    forward out again and sums W̃'s gradient per query tile), then the dk/dv kernel."""
    from .pairwise_kernels import (  # lazy: start-up time
        pairwise_bwd_dkv_kernel,
        pairwise_bwd_dq_kernel,
    )

    q, k, v, do = unit_rows(q), unit_rows(k), unit_rows(v), unit_rows(do)
    G = mixing.shape[0]
    B, H, N, D, tiles, block, block_d, warps, block_g = _geometry(q, G)
    table = _table(mixing)
    dq, dk, dv = _output_like(q), _output_like(k), _output_like(v)
    rden = q.new_empty((B * H, N), dtype=torch.float32)
    dden = torch.empty_like(rden)
    dmixing = q.new_empty((B * H, tiles, block_g, block_g), dtype=torch.float32)
    mask, s_mb = _mask_arg(key_valid, k)
    # half the forward's key chunk and 16-bit tiles (as autocast's own backward multiplies them): what both kernels
    # fit sm_90 at head dim 64 with (benchmarks/kernel_resources.py --arch sm_90)
    settings = dict(FEATURE=feature, HAS_MASK=key_valid is not None, BLOCK_M=block, BLOCK_N=max(16, block // 2),
                    BLOCK_D=block_d, **tile_args(q, half_tiles=True), num_warps=warps)
    launch(pairwise_bwd_dq_kernel, (B * H, tiles),
        q, k, v, mask, segments, table, do, dq, rden, dden, dmixing,
        *_strides(q, k, v), s_mb, *_strides(do, dq),
        H, N, D, G, feature_eps, eps,
        BLOCK_G=block_g, **settings)
    launch(pairwise_bwd_dkv_kernel, (B * H, tiles),
        q, k, v, mask, segments, table, do, rden, dden, dk, dv,
        *_strides(q, k, v), s_mb, *_strides(do, dk, dv),
        H, N, D, G, feature_eps,
        **{**settings, "BLOCK_N": spill_free_chunk(settings["BLOCK_N"], block_d)})
    return dq, dk, dv, dmixing.sum((0, 1))[:G, :G].to(mixing.dtype)


pairwise_attention_backward = torch.library.custom_op("vitconvert::pairwise_attention_backward", mutates_args=())(
    run_pairwise_backward)


@pairwise_attention_backward.register_fake
def _(q, k, v, do, key_valid, segments, mixing, feature, feature_eps, eps):
    return (*(_output_like(t) for t in (q, k, v)), torch.empty_like(mixing))


def _setup(ctx, inputs, output) -> None:
    q, k, v, key_valid, segments, mixing, feature, feature_eps, eps, q_weight, k_weight, norm_eps = inputs
    ctx.save_for_backward(q, k, v, key_valid, segments, mixing, q_weight, k_weight)
    ctx.args = (feature, feature_eps, eps)
    ctx.norm_eps = norm_eps


def _backward(ctx, do):
    q, k, v, key_valid, segments, mixing, q_weight, k_weight = ctx.saved_tensors

    def gradients(q_in: torch.Tensor, k_in: torch.Tensor) -> tuple:  # of the op on the normalised q and k
        try:
            grads = run_pairwise_backward if fused.direct(do) else pairwise_attention_backward
            return grads(q_in, k_in, v, do, key_valid, segments, mixing, *ctx.args)
        except KernelUnavailable as e:
            dq, dk, dv, _, _, dmixing = _eager_gradients(e, "pairwise_attention", pairwise_eager,
                                                         (q_in, k_in, v, key_valid, segments, mixing), (do,),
                                                         *ctx.args)
            return dq, dk, dv, dmixing

    dq, dk, dv, dmixing, dq_weight, dk_weight = through_rms_pair(q, k, q_weight, k_weight, ctx.norm_eps, gradients)
    return dq, dk, dv, None, None, dmixing, None, None, None, dq_weight, dk_weight, None


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


def pairwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
             segments: torch.Tensor, mixing: torch.Tensor, feature: int, feature_eps: float, eps: float,
             q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
             norm_eps: float = 0.0) -> torch.Tensor:
    """The op's output, called direct where it may (fused.call_op, looked up per call: fused.fakes_checked)."""
    args = (q, k, v, key_valid, segments, mixing, feature, feature_eps, eps, q_weight, k_weight, norm_eps)
    return fused.call_op(pairwise_attention, _DirectPairwise, run_pairwise, args, (q, k, v, mixing, q_weight,
                                                                                    k_weight))
