"""TTT's closed-form step in torch: the instance norm of the keys, the inner gradients by hand and the SwiGLU
read-out (attention/ttt.py's eager form, and the eager form of the fused op in attention/ops/ttt/op.py)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F


def inner_model(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """f_W(x) = (silu(x W1) ⊙ (x W2)) W3 on (..., N, d) tokens with (..., d, d) weights."""
    return (F.silu(x @ w1) * (x @ w2)) @ w3


def normalize_keys(k: torch.Tensor, valid: torch.Tensor | None, eps: float, by_var_mean: bool = False) -> torch.Tensor:
    """Instance norm of (B, H, N, d) keys over the tokens, per channel, statistics from valid tokens only.

    With no mask this is ``F.instance_norm`` (biased variance, no affine), as the reference applies it. The CPU
    form is written as sums (and the centred keys reused for the output) because ``torch.var_mean`` over the
    token axis is 16× slower on CPUs than these five passes together; on a GPU (``by_var_mean``) it is one
    reduction, and the output one fused pass k·r − mean·r: two passes over the keys.
    """
    if valid is None and by_var_mean:
        var, mean = torch.var_mean(k, dim=-2, correction=0, keepdim=True)
        r = torch.rsqrt(var + eps)
        return torch.addcmul(-mean * r, k, r)
    if valid is None:
        mean = k.sum(dim=-2, keepdim=True) / k.shape[-2]
        centred = k - mean
        var = centred.square().sum(dim=-2, keepdim=True) / k.shape[-2]
    else:
        mean, centred, var = valid_key_moments(k, valid)
    return centred * torch.rsqrt(var + eps)


def valid_key_moments(k: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, k − mean, biased variance) of (B, H, N, d) keys over their valid tokens, (B, H, 1, d) statistics."""
    m = valid[:, None, :, None].to(k.dtype)
    count = m.sum(dim=-2, keepdim=True).clamp(min=1.0)
    mean = (k * m).sum(dim=-2, keepdim=True) / count
    centred = k - mean
    return mean, centred, (centred.square() * m).sum(dim=-2, keepdim=True) / count


def swiglu_readout(x: torch.Tensor, w12: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """f_W(x) with W1 and W2 side by side as one (…, d, 2d) matrix: one matmul for both branches."""
    a, b = (x @ w12).chunk(2, dim=-1)
    return (F.silu(a) * b) @ w3


def inner_gradients(k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, w12: torch.Tensor,
                    w3: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dL/d[W1 | W2] (B, H, d, 2d) and dL/dW3 (B, H, d, d) of L = −(s/N) Σ_j ⟨f_W(k_j), v_j⟩, by hand.

    With a = kW1, b = kW2, h = silu(a)⊙b and g = dL/d f = −(s/N) v: dW3 = hᵀg, dh = gW3ᵀ,
    da = dh⊙b⊙silu'(a), db = dh⊙silu(a), dW1 = kᵀda, dW2 = kᵀdb. Sums over tokens are d×d matmuls.
    Fewest passes over the N tokens: the −s/N factor scales d×d matrices instead of v; a and b come from one
    matmul with W1 and W2 side by side; silu'(a) = σ + silu − σ·silu is one lerp; dW1 and dW2 are two matmuls
    (a concatenation of da and db would be one more pass); v, a strided view of the qkv projection, is made
    contiguous once (each matmul would copy it).
    """
    coef = -scale / k.shape[-2]  # a Python float (one scalar) without a mask, per item with one:
    per_item: Optional[torch.Tensor] = None
    if valid is not None:
        m = valid.to(v.dtype)
        v = v * m[:, None, :, None]
        per_item = (-scale / m.sum(dim=-1).clamp(min=1.0))[:, None, None, None]
    v = v.contiguous()
    a, b = (k @ w12).chunk(2, dim=-1)  # (W1 and W2 side by side; chunk keeps a trace free of shape arithmetic)
    sig = torch.sigmoid(a)
    act = a * sig
    dh = v @ _times(w3.transpose(-2, -1), coef, per_item)  # (B, H, N, d): gW3ᵀ with g = coef·v
    one = torch.ones((), dtype=a.dtype, device=a.device)
    da = dh * b * torch.lerp(act, one, sig)  # silu'(a) = σ(a)(1 + a(1 − σ(a))) = silu + σ(1 − silu)
    kt = k.transpose(-2, -1)
    dw12 = torch.cat((kt @ da, kt @ (dh * act)), dim=-1)
    dw3 = _times((act * b).transpose(-2, -1) @ v, coef, per_item)
    return dw12, dw3


def stepped_readout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, w1: torch.Tensor,
                    w2: torch.Tensor, w3: torch.Tensor, scale: float, lr: float) -> torch.Tensor:
    """f_{W'}(q) after one inner step W' = W − lr·∇L on (k, v): the closed-form step after the key norm and convs."""
    w12 = torch.cat((w1, w2), dim=-1)
    dw12, dw3 = inner_gradients(k, v, valid, w12, w3, scale)
    return swiglu_readout(q, w12 - lr * dw12, w3 - lr * dw3)


def _times(t: torch.Tensor, coef: float, per_item: Optional[torch.Tensor]) -> torch.Tensor:
    """t·coef, or t·per_item when given (one code path for TorchScript, which has no float-or-tensor type)."""
    return t * coef if per_item is None else t * per_item
