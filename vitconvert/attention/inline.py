"""InLine attention (Han et al., NeurIPS 2024, "Bridging the Divide"; repo LeapLabTHU/InLine).

Injective linear attention: φ = identity, and the weights sum to one by subtraction instead of division,
w_ij = (s/N)·q_i·k_j − (s/N)·q_i·k̄ + 1/N, so that queries differing only in scale still get different
weights (division by Σ_j φ(q_i)·φ(k_j) would cancel the scale). Summed over j:
out_i = (s/N)·q_iᵀ(Σ_j k_j v_jᵀ) + (1 − s·q_i·k̄)·v̄, an O(N·d²) form. Same parameters as softmax attention.

Option ``local_residual`` (off by default: the paper's "identical shapes" claim suggests it is not part of the
core) adds the reference code's local attention residual: a 3×3 depthwise convolution over the spatial
tokens' V, with per-image, per-channel kernels predicted from the mean of the layer input x (all tokens,
class token included, as in the reference's ``x.mean(dim=1)``). Prefix tokens get no residual.

Choices beyond the reference (which has no padding mask and a square grid after one class token):
- with a key mask, N, k̄, v̄, Σ_j k_j v_jᵀ and the mean token go over valid tokens only, and masked tokens'
  V are zeroed before the convolution, so padding reaches no output;
- when the tokens form no known grid (``grid is None``) the residual is skipped.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

from .base import Grid, LinearAttention
from .ops import dispatch
from .ops.linear import op as fused
from .ops.linear.reference import inline_weights
from .options import Option, flag
from .registry import register_variant
from .tensors import accumulation_dtype, flat_heads, from_grid, full_precision, split_prefix, to_grid

KERNEL = 3  # the reference's 3×3 local window


def inline_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """Σ-form of InLine attention on (B, H, N, d) tensors, in their dtype.

    Written as out_i = (s/n)·q_iᵀ Σ_j k_j (v_j − v̄)ᵀ + v̄ (the paper's k̄ term folded into the state), so one
    matmul [k | 1]ᵀ[v | 1] gives Σ k vᵀ, Σ k, Σ v and n together, and one baddbmm reads every query out.
    """
    B, H, N, d = q.shape
    k1, v1 = F.pad(k, (0, 1), value=1.0), F.pad(v, (0, 1), value=1.0)
    if key_valid is not None:
        k1 = k1 * key_valid[:, None, :, None].to(k.dtype)  # masked keys leave every sum, n included
    sums = k1.transpose(-2, -1) @ v1  # (B, H, d+1, d+1): [[Σ k vᵀ, Σ k], [Σ vᵀ, n]]
    n = sums[..., d:, d:].clamp(min=1)  # at least 1, so an all-masked item stays finite
    v_mean = sums[..., d:, :d] / n
    state = (sums[..., :d, :d] - sums[..., :d, d:] @ v_mean) * (scale / n)
    return torch.baddbmm(flat_heads(v_mean), flat_heads(q), flat_heads(state)).view(B, H, N, d)


def local_residual(v: torch.Tensor, kernels: torch.Tensor, grid: tuple[int, int], num_prefix: int,
                   key_valid: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, H, N_spatial, d) depthwise 3×3 conv of the spatial V with per-image kernels (B, C, 3, 3).

    One grouped conv over the batch folded into channels, as the reference does; under torch.export the nine shifts
    summed, since ONNX has no conv whose group count is the (dynamic) batch times the channels.
    """
    if not torch.jit.is_scripting():  # TorchScript skips this branch only when the test stands alone
        if torch.compiler.is_exporting():
            return local_residual_reference(v, kernels, grid, num_prefix, key_valid)
    _, spatial = split_prefix(v, num_prefix)
    if key_valid is not None:
        spatial = spatial * key_valid[:, None, num_prefix:, None].to(v.dtype)
    image = to_grid(spatial, grid)
    B, C, h, w = image.shape
    size = kernels.shape[-1]  # KERNEL (TorchScript reads no module-level ints)
    out = F.conv2d(image.reshape(1, B * C, h, w), kernels.reshape(B * C, 1, size, size),
                   padding=size // 2, groups=B * C)
    return from_grid(out.reshape(B, C, h, w), v.shape[1])


def local_residual_reference(v, kernels, grid: tuple[int, int], num_prefix: int,
                             key_valid: Optional[torch.Tensor]):
    """The same residual as an explicit sum over the nine zero-padded shifts of the V image."""
    _, spatial = split_prefix(v, num_prefix)
    if key_valid is not None:
        spatial = spatial * key_valid[:, None, num_prefix:, None].to(v.dtype)
    image = to_grid(spatial, grid)
    h, w = grid
    padded = F.pad(image, (1, 1, 1, 1))
    out = torch.zeros_like(image)
    for i in range(KERNEL):
        for j in range(KERNEL):
            out = out + kernels[:, :, i, j, None, None] * padded[:, :, i:i + h, j:j + w]
    return from_grid(out, v.shape[1])


def add_to_spatial(out: torch.Tensor, residual: torch.Tensor, num_prefix: int) -> torch.Tensor:
    prefix, spatial = split_prefix(out, num_prefix)
    return torch.cat((prefix, spatial + residual), dim=2)


@register_variant
class InLineAttention(LinearAttention):
    """InLine attention; optionally with the reference code's predicted local 3×3 residual on V."""

    variant = "inline"
    paper = 'Han et al. 2024, Bridging the Divide: Reconsidering Softmax and Linear Attention (NeurIPS)'
    bibtex = """@inproceedings{han2024inline,
  title     = {Bridging the Divide: Reconsidering Softmax and Linear Attention},
  author    = {Han, Dongchen and others},
  booktitle = {Advances in Neural Information Processing Systems (NeurIPS)},
  year      = {2024}
}"""

    declared_options = (
        Option("local_residual", False, "the reference code's predicted 3×3 depthwise residual on V (module "
               "docstring)", flag),
    )

    def __init__(self, dim: int, num_heads: int = 8, **kwargs: Any):
        super().__init__(dim, num_heads, **kwargs)
        self.local_kernel_predictor: Optional[nn.Sequential] = None
        self.local_kernel_size = KERNEL
        if self.options["local_residual"]:
            factory = {"device": self.proj.weight.device, "dtype": self.proj.weight.dtype}
            in_dim, C, H = self.qkv_weights()[0].shape[1], self.attn_dim, self.num_heads
            self.local_kernel_predictor = nn.Sequential(
                nn.Conv1d(in_dim, C, 1, groups=H, **factory),
                nn.GELU(),
                nn.Conv1d(C, KERNEL * KERNEL * C, 1, groups=H, **factory),
            )
        if not self.building_on_meta:
            self.reset_extra_parameters()

    def reset_extra_parameters(self) -> None:
        """PyTorch's default conv init, as the reference leaves it."""
        if self.local_kernel_predictor is not None:
            for layer in self.local_kernel_predictor:
                if isinstance(layer, nn.Conv1d):
                    layer.reset_parameters()

    def predict_local_kernels(self, x: torch.Tensor, key_valid: Optional[torch.Tensor]) -> torch.Tensor:
        """(B, C, 3, 3) depthwise kernels from the mean token of the layer input (valid tokens only)."""
        if key_valid is None:
            mean = x.mean(dim=1)
        else:
            m = key_valid[:, :, None].to(x.dtype)
            mean = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
        size = self.local_kernel_size
        return self.local_kernel_predictor(mean[:, :, None]).reshape(x.shape[0], self.attn_dim, size, size)

    def prepare(self, x: torch.Tensor, key_valid: Optional[torch.Tensor],
                grid: Grid) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """With ``local_residual`` the 3×3 kernels are predicted from the layer input, per call."""
        if self.local_kernel_predictor is None or grid is None:
            return x, None
        else:
            return x, self.predict_local_kernels(x, key_valid)

    def _kernels_for(self, grid: Grid, local_kernels: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.local_kernel_predictor is None or grid is None:
            return None
        if local_kernels is None:
            raise RuntimeError("local_residual predicts its kernels from the layer input: call forward(x) "
                               "or pass local_kernels=predict_local_kernels(x, key_valid)")
        return local_kernels

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], grid: Grid,
            local_kernels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """O(N·d²) InLine attention, sums in float32 at least, plus the local residual if enabled."""
        kernels = self._kernels_for(grid, local_kernels)
        if not torch.jit.is_scripting():  # (nested: TorchScript skips only a branch of is_scripting() alone)
            if self.fused_kernels and dispatch.can_run(v, "linear_attention"):
                out = dispatch.attempt("linear_attention", fused.attention, q.to(v.dtype), k.to(v.dtype), v,
                                    key_valid, fused.IDENTITY, 0.0, 0.0, self.scale, True)
                if out is not None:
                    if kernels is not None and grid is not None:
                        residual = local_residual(v, kernels.to(v.dtype), grid, self.num_prefix_tokens, key_valid)
                        out = add_to_spatial(out, residual.to(out.dtype), self.num_prefix_tokens)
                    return out
        dtype = v.dtype
        acc = accumulation_dtype(dtype)
        with full_precision(q):
            q, k, v = q.to(acc), k.to(acc), v.to(acc)
            out = inline_attention(q, k, v, key_valid, self.scale)
            if kernels is not None and grid is not None:
                residual = local_residual(v, kernels.to(acc), grid, self.num_prefix_tokens, key_valid)
                out = add_to_spatial(out, residual, self.num_prefix_tokens)
        return out.to(dtype)

    def reference(self, q, k, v, key_valid: Optional[torch.Tensor], grid: Grid,
                  local_kernels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Explicit N×N weights times V, plus the residual as a literal shifted sum."""
        out = inline_weights(q, k, key_valid, self.scale) @ v
        kernels = self._kernels_for(grid, local_kernels)
        if kernels is not None:
            residual = local_residual_reference(v, kernels.to(v.dtype), grid, self.num_prefix_tokens, key_valid)
            out = add_to_spatial(out, residual, self.num_prefix_tokens)
        return out
