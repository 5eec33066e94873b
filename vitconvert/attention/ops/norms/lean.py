"""Norms of MHLA's fused path written out by hand, so that a training forward keeps no more than softmax's.

Under autocast, autograd's own F.rms_norm and F.layer_norm run in float32 and keep float32 copies of their
inputs: N×C tensors that the softmax layer does not hold. Here:

- the RMSNorm of q and k over all heads' channels is applied inside MHLA's ops (``vitconvert::blocked_attention``
  and ``::pairwise_attention``), as their kernels load q and k, both ways, from each token's 1/rms (taken by a
  kernel: ops/linear/norm_parts.py), so autograd keeps only the raw q, k (views of the qkv projection);
  :func:`rms_over_heads` and :func:`rms_over_heads_backward` are the same norm in torch, which the ops' eager
  fallbacks take (:func:`through_rms_pair`);
- the LayerNorm on the layer input and the fused qkv projection after it are one autograd Function
  (:func:`layer_norm_linear`) that keeps x̂ in the projection's input dtype: as many bytes as softmax's qkv
  projection keeps of its input, where autograd's LayerNorm would keep its float32 input on top.

Their backwards are torch's fused norm kernels where torch has them (native_layer_norm_backward; on CUDA
_fused_rms_norm_backward), not the formulas written out: those are a dozen elementwise passes over N×C float32.

TTT's key norm on its fused path (:func:`key_instance_norm`) is written out for the passes rather than the
memory (its step is recomputed in backward anyway): float32 statistics read from bf16 keys, no float32 copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ...tensors import accumulation_dtype
from ..dispatch import current, exporting
from ..ttt.closed_form import normalize_keys

# torch's fused RMSNorm backward (what autograd runs for F.rms_norm on CUDA; torch 2.9 on, no CPU kernel)
FUSED_RMS_BACKWARD = hasattr(torch.ops.aten, "_fused_rms_norm_backward")
HALF = (torch.bfloat16, torch.float16)


def _per_head(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """RMSNorm's (H·d,) weight laid over (B, H, N, d) ``like``, in float32 at least."""
    return weight.to(accumulation_dtype(like.dtype)).view(1, like.shape[1], 1, like.shape[3])


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, 1, N, 1) 1/rms of each token of (B, H, N, d) ``x`` over all heads' channels, in x's dtype."""
    return torch.rsqrt(x.square().mean(dim=(1, 3), keepdim=True) + eps)


def rms_over_heads(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each token of (B, H, N, d) ``t`` over its H·d channels, in float32 at least, back in t's dtype.

    bf16/fp16: on CUDA torch's fused kernel (one pass, float32 inside; :func:`rms_recomputed`), called direct:
    CUDA's autocast runs F.rms_norm in float32 (the CPU's does not), which gave the blocked op float32 q and k, so
    its kernels read float32 tiles and wrote a float32 output where the op's fake (torch.compile) says bf16.
    Elsewhere F.rms_norm over the (B, N, H·d) view of q or k (a view of the qkv projection's output), autocast off.
    The weight is taken in t's dtype: its rounding is one more of the output's own.
    """
    B, H, N, d = t.shape
    if _fused_rms_here(t):
        return _fused_rms(t, weight, eps)[0]
    if t.dtype in HALF:
        with torch.autocast(t.device.type, enabled=False):
            return rms_rows(t, weight, eps)
    x = t.to(accumulation_dtype(t.dtype))
    return (x * _rstd(x, eps) * _per_head(weight, t)).to(t.dtype)


def rms_rows(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over each token's H·d channels of (B, H, N, d) ``t``, in t's dtype: the eager form (TorchScript
    compiles it; MHLA's features in full precision) and the half branch of :func:`rms_over_heads`."""
    B, H, N, d = t.shape
    flat = F.rms_norm(t.transpose(1, 2).reshape(B, N, H * d), [H * d], weight.to(t.dtype), eps)
    return flat.view(B, N, H, d).transpose(1, 2)


def _tokens_major(t: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) as (B, N, H·d): a view where t is one of the qkv projection's (tokens-major)."""
    B, H, N, d = t.shape
    return t.transpose(1, 2).reshape(B, N, H * d)


def _fused_rms_here(t: torch.Tensor) -> bool:
    """Whether the RMSNorm of ``t`` takes torch's fused kernels (half inputs on CUDA: the dispatch's
    ``rms_norm_devices``)."""
    return FUSED_RMS_BACKWARD and t.dtype in HALF and t.device.type in current().rms_norm_devices


RmsSaved = Optional[tuple[torch.Tensor, torch.Tensor]]  # (contiguous rows, rstd) on the fused kernels' branch


def _fused_rms(t: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output as (B, H, N, d), contiguous rows, rstd) of ``_fused_rms_norm`` (what F.rms_norm runs on CUDA), which
    no autocast casts."""
    B, H, N, d = t.shape
    rows = _tokens_major(t).contiguous()  # (the kernels' rows: q and k are strided views of the qkv output)
    out, rstd = torch.ops.aten._fused_rms_norm(rows, [H * d], weight.to(t.dtype), eps)
    return out.view(B, N, H, d).transpose(1, 2), rows, rstd


def rms_recomputed(t: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, RmsSaved]:
    """:func:`rms_over_heads` of ``t`` recomputed for backward, and what :func:`rms_over_heads_backward` reads
    again: on CUDA with half inputs, q's or k's rows copied contiguous once and their rstd, both from one
    ``_fused_rms_norm``, so the backward neither copies the rows nor takes their norms a second time; elsewhere
    None."""
    if not _fused_rms_here(t):
        return rms_over_heads(t, weight, eps), None
    out, rows, rstd = _fused_rms(t, weight, eps)
    return out, (rows, rstd)


def rms_over_heads_backward(t: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
                            saved: RmsSaved = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dt, dweight) of :func:`rms_over_heads` from the gradient of its output, in float32 at least (rstd
    recomputed, or ``saved`` by :func:`rms_recomputed`). Half inputs on CUDA: torch's fused backward (one kernel,
    float32 inside, as autograd runs it for F.rms_norm there), where the formula below takes ~13 passes over
    N×C float32."""
    if _fused_rms_here(t):
        B, H, N, d = t.shape
        if saved is None:
            rows = _tokens_major(t).contiguous()  # (the kernel's rows: a copy of q's or k's strided view of qkv)
            norm = torch.linalg.vector_norm(rows, dim=-1, keepdim=True, dtype=torch.float32)
            rstd = torch.rsqrt(norm.square_().div_(H * d).add_(eps))  # (B, N, 1), as _fused_rms_norm returns it
        else:
            rows, rstd = saved
        # (the fused backwards write dq and dk tokens-major: their rows are then a view, not a copy)
        dt, dweight = torch.ops.aten._fused_rms_norm_backward(
            _tokens_major(grad.to(t.dtype)).contiguous(), rows, [H * d], rstd, weight.to(t.dtype), [True, True])
        return dt.view(B, N, H, d).transpose(1, 2), dweight.to(weight.dtype)
    x = t.to(accumulation_dtype(t.dtype))
    rstd, grad = _rstd(x, eps), grad.to(x.dtype)
    scaled = grad * _per_head(weight, t)
    dt = rstd * (scaled - x * rstd.square() * (scaled * x).mean(dim=(1, 3), keepdim=True))
    dweight = (grad * x * rstd).sum(dim=(0, 2)).reshape(-1)
    return dt.to(t.dtype), dweight.to(weight.dtype)


def rms_pair_recomputed(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor],
                        k_weight: Optional[torch.Tensor],
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, tuple[RmsSaved, RmsSaved]]:
    """q and k normalised (when their weights are given, else as they are) for backward (:func:`rms_recomputed`), and
    what their norms' backwards read again."""
    if q_weight is None or k_weight is None:
        return q, k, (None, None)
    (q, q_saved), (k, k_saved) = rms_recomputed(q, q_weight, eps), rms_recomputed(k, k_weight, eps)
    return q, k, (q_saved, k_saved)


def through_rms_pair(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor],
                     k_weight: Optional[torch.Tensor], eps: float, gradients: Callable[..., tuple]) -> tuple:
    """The backward of an op that normalises its raw q and k itself (MHLA's blocked and pairwise ops, where their
    kernels cannot run: :func:`..calls._eager_gradients`): the norm recomputed (:func:`rms_pair_recomputed`),
    ``gradients(q_n, k_n)`` -> (dq_n, dk_n, *rest) of the op on the normalised q and k, then the norm's backward:
    (dq, dk, *rest, dq_weight, dk_weight)."""
    q_in, k_in, saved = rms_pair_recomputed(q, k, q_weight, k_weight, eps)
    dq, dk, *rest = gradients(q_in, k_in)
    dq_weight = dk_weight = None
    if q_weight is not None and k_weight is not None:
        dq, dq_weight = rms_over_heads_backward(q, q_weight, eps, dq, saved[0])
        dk, dk_weight = rms_over_heads_backward(k, k_weight, eps, dk, saved[1])
    return (dq, dk, *rest, dq_weight, dk_weight)


class _LayerNormLinear(torch.autograd.Function):
    """F.linear(F.layer_norm(x), weight, bias) keeping x̂ = (x − μ)·rstd in the linear's input dtype and the
    per-token rstd: the one N×C tensor a softmax layer's qkv projection keeps (its input) and nothing else
    N-sized. Backward recomputes the linear's input y = x̂·w + b from x̂ (no division by w: exact for any w).

    Precision: x̂ is kept in the dtype y is rounded to for the matmul (bf16 under autocast), so the backward
    reads x̂ and y within one rounding of that dtype (relative 2⁻⁹ in bf16), as the matmul's own gradients
    read y; in float32 it is exact to float32 rounding. The forward is autograd's own LayerNorm and linear.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
                eps: float, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        xf = x.to(accumulation_dtype(x.dtype))
        x_hat, _, rstd = torch.native_layer_norm(xf, xf.shape[-1:], None, None, eps)  # one pass: x̂ and rstd
        y = _affine(x_hat, norm_weight, norm_bias, dtype)
        out = F.linear(y, weight.to(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(x_hat.to(dtype), rstd, norm_weight, norm_bias, weight)
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x_hat, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        y = _affine(x_hat, norm_weight, norm_bias, x_hat.dtype)
        g = grad.to(x_hat.dtype)
        dweight = dbias = dnorm_weight = dnorm_bias = None
        if ctx.needs_input_grad[4]:
            dweight = (g.flatten(0, -2).transpose(0, 1) @ y.flatten(0, -2)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[5]:
            dbias = grad.flatten(0, -2).sum(0, dtype=rstd.dtype).to(weight.dtype)  # one read, float32 sums
        dy = (g @ weight.to(g.dtype)).to(rstd.dtype)
        # torch's own LayerNorm backward (one fused kernel for dx, one for the norm's weight and bias on a GPU,
        # where the formula written out took ~15 passes over N×C float32), given x − μ = x̂ / rstd and μ = 0
        centred = torch.div(x_hat, rstd)
        wanted = [ctx.needs_input_grad[0], norm_weight is not None and ctx.needs_input_grad[1],
                  norm_bias is not None and ctx.needs_input_grad[2]]
        dx, dnorm_weight, dnorm_bias = torch.ops.aten.native_layer_norm_backward(
            dy, centred, centred.shape[-1:], torch.zeros_like(rstd), rstd, _as(norm_weight, rstd.dtype),
            _as(norm_bias, rstd.dtype), wanted)
        dnorm_weight = None if dnorm_weight is None else dnorm_weight.to(norm_weight.dtype)
        dnorm_bias = None if dnorm_bias is None else dnorm_bias.to(norm_bias.dtype)
        return (None if dx is None else dx.to(ctx.x_dtype)), dnorm_weight, dnorm_bias, None, dweight, dbias, None


def _as(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


def _affine(x_hat: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
            dtype: torch.dtype) -> torch.Tensor:
    """x̂·w + b computed in float32 at least and stored in ``dtype``, in one pass when both are given (inside the
    Function: no autograd here, so ``out=`` is allowed)."""
    if weight is not None and bias is not None:
        acc = accumulation_dtype(x_hat.dtype)
        return torch.addcmul(bias.to(acc), x_hat, weight.to(acc), out=x_hat.new_empty(x_hat.shape, dtype=dtype))
    y = x_hat.to(accumulation_dtype(x_hat.dtype))
    y = y if weight is None else y * weight.to(y.dtype)
    return (y if bias is None else y + bias.to(y.dtype)).to(dtype)


def layer_norm_linear(x: torch.Tensor, norm: nn.LayerNorm, weight: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(norm(x), weight, bias)`` keeping only x̂ (in the matmul's dtype: autocast's, else x's) and the
    per-token rstd for backward (:class:`_LayerNormLinear`); without autograd, the plain form."""
    if len(norm.normalized_shape) != 1:
        raise ValueError("layer_norm_linear normalises the last dimension only")
    if not torch.is_grad_enabled() or exporting() or not any(t is not None and t.requires_grad
                                                             for t in (x, norm.weight, norm.bias, weight, bias)):
        # nothing to keep: autograd's own ops (one pass fewer). Under torch.export, which inlines a Function's
        # forward into its graph, too: that graph runs with grad on, where the Function's out= pass is refused
        return F.linear(norm(x), weight, bias)
    autocast = torch.is_autocast_enabled(x.device.type)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    return _LayerNormLinear.apply(x, norm.weight, norm.bias, norm.eps, weight, bias, dtype)


def key_stats(k: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd) over the tokens of (B, H, N, d) ``k``, float32, (B, H, 1, d): two reading passes in float32
    registers (the mean, and the root of Σk² as a norm), no float32 copy of k."""
    n = k.shape[-2]
    mean = k.mean(dim=-2, keepdim=True, dtype=torch.float32)
    mean_square = torch.linalg.vector_norm(k, dim=-2, keepdim=True, dtype=torch.float32).square() / n
    return mean, torch.rsqrt((mean_square - mean.square()).clamp(min=0.0) + eps)


def _normalised(k: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """(k − mean)·rstd computed in float32 and written in k's dtype: one pass (no autograd here: ``out=``). In
    k's layout (a view of the qkv projection: tokens-major), which the convs' grid view then takes without a copy."""
    return torch.addcmul(-mean * rstd, k, rstd, out=torch.empty_like(k))


class _KeyInstanceNorm(torch.autograd.Function):
    """TTT's instance norm of the keys over the tokens (biased variance, no affine) on the fused path: statistics
    in float32 from k as it is (bf16 under autocast), output in k's dtype; keeps k and the (B, H, 1, d) statistics,
    and backward is LayerNorm's over the token axis: dk = rstd·(g − mean(g) − x̂·mean(g·x̂))."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, eps: float) -> torch.Tensor:
        mean, rstd = key_stats(k, eps)
        ctx.save_for_backward(k, mean, rstd)
        return _normalised(k, mean, rstd)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        k, mean, rstd = ctx.saved_tensors
        # torch's LayerNorm backward over rows of tokens, one row per (b, h, channel): one fused kernel on a GPU
        # where the formula written out takes ~12 passes over float32; the rows are float32 copies on both
        # devices (the CPU's kernel wants its statistics in the input's dtype)
        rows = [t.transpose(-2, -1).to(torch.float32, memory_format=torch.contiguous_format) for t in (grad, k)]
        stats = [t.transpose(-2, -1).contiguous() for t in (mean, rstd)]  # (B, H, d, 1)
        dk, _, _ = torch.ops.aten.native_layer_norm_backward(*rows, rows[1].shape[-1:], *stats, None, None,
                                                             [True, False, False])
        return dk.transpose(-2, -1).to(k.dtype), None


def key_instance_norm(k: torch.Tensor, key_valid: Optional[torch.Tensor], eps: float,
                      dtype: torch.dtype) -> torch.Tensor:
    """TTT's key norm (ops/ttt/closed_form.normalize_keys) with statistics in float32, output in ``dtype``. Without a
    mask, on k in ``dtype``: three reading passes and one write, where the float32 form copies k to float32,
    reduces, writes the float32 output and copies it back. With a mask, under torch.export, or for float32: that
    float32 form."""
    if key_valid is not None:
        return normalize_keys(k.float(), key_valid, eps, by_var_mean=True).to(dtype)
    k = k.to(dtype)
    if dtype == torch.float32 or exporting():
        return normalize_keys(k.float(), None, eps, by_var_mean=True).to(dtype)
    if torch.is_grad_enabled() and k.requires_grad:
        return _KeyInstanceNorm.apply(k, eps)
    return _normalised(k, *key_stats(k, eps))
