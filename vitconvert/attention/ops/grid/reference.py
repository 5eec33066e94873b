"""The depthwise conv on the patch grid written out token by token and tap by tap (slow): the oracle the tests hold
:func:`.op.grid_conv_eager` and the grid kernels' backward to."""

from __future__ import annotations

from typing import Optional

import torch


def grid_conv_reference(x: torch.Tensor, base: Optional[torch.Tensor], weight: torch.Tensor,
                        bias: Optional[torch.Tensor], key_valid: Optional[torch.Tensor], grid: tuple[int, int],
                        prefix: int, norm_eps: Optional[float]) -> torch.Tensor:
    """The conv's formula token by token and tap by tap: x̂ = x or (x − mean)/√(var + ε) over the valid tokens,
    y_t = base_t (x̂_t without one), + bias + Σ_taps w·x̂ of the valid grid neighbours for grid tokens."""
    B, H, N, d = x.shape
    rows, cols = grid
    size = weight.shape[-1]
    valid = key_valid if key_valid is not None else torch.ones(B, N, dtype=torch.bool, device=x.device)
    if norm_eps is not None:
        normed = []
        for b in range(B):
            kept = x[b][:, valid[b]]
            mean = kept.mean(dim=1, keepdim=True)
            var = ((kept - mean) ** 2).mean(dim=1, keepdim=True)
            normed.append((x[b] - mean) / torch.sqrt(var + norm_eps))
        x = torch.stack(normed)
    w = weight.reshape(H, d, size, size)
    out = []
    for t in range(N):
        total = (x if base is None else base)[:, :, t]
        if t >= prefix:
            r, c = divmod(t - prefix, cols)
            if bias is not None:
                total = total + bias.reshape(H, d)
            for i in range(size):
                for j in range(size):
                    rr, cc = r + i - size // 2, c + j - size // 2
                    if 0 <= rr < rows and 0 <= cc < cols:
                        s = prefix + rr * cols + cc
                        total = total + w[:, :, i, j] * x[:, :, s] * valid[:, s, None, None].to(x.dtype)
        out.append(total)
    return torch.stack(out, dim=2)
