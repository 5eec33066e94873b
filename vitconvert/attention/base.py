"""What every linear-attention variant shares.

A variant keeps the softmax module's projections under the same names (``qkv`` or ``q_proj``/``k_proj``/
``v_proj``, ``q_bias``/``v_bias``, ``q_norm``, ``k_norm``, ``norm``, ``gate``, ``proj``) and replaces only
the softmax mixing of tokens by its own O(N) ``mix``. Copying the projections keeps the call signature and
the state-dict names of timm's attention, so the surgery is a module swap and the init recipes can address
matched parameters by name.
"""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar, Optional

import torch
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from torch import nn
from torch.nn import functional as F

# Children of timm's attention modules that have the same role in a linear variant.
MATCHED_MODULES = ("qkv", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "norm", "gate", "proj")
MATCHED_PARAMS = ("q_bias", "v_bias")
# Softmax-only machinery that a linear variant drops (logit biases have no linear analogue).
DROPPED = ("relative_position_bias_table", "rel_pos")

Grid = Optional[tuple[int, int]]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, the dtype itself otherwise: token sums need float32's range and precision."""
    return torch.promote_types(dtype, torch.float32)


def full_precision(like: torch.Tensor) -> torch.autocast:
    """Autocast off on ``like``'s device: inside, matmuls of float32 tensors stay float32.

    Without it, autocast would run the d×d state matmuls (sums over all N tokens) in bf16/fp16.
    """
    return torch.autocast(device_type=like.device.type, enabled=False)


def flat_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, H, …) -> (B·H, …) for bmm/baddbmm; a view when the layout allows it (always for B = 1)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def key_validity(attn_mask: Optional[torch.Tensor], batch: int, tokens: int) -> Optional[torch.Tensor]:
    """(B, N) bool of keys a softmax query may attend to, from timm's additive or boolean mask.

    A linear attention has no logits to mask, so a padding mask becomes "drop these keys from the sums".
    """
    if attn_mask is None:
        return None
    mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    valid = mask.any(dim=-2).all(dim=1)  # over queries, then heads
    return valid.expand(batch, tokens)


class LinearAttention(nn.Module):
    """Base of every variant: softmax projections in, a linear token mixer in the middle."""

    variant: ClassVar[str] = ""
    # Default options of the variant; stored in config.json so that load() rebuilds it exactly.
    default_options: ClassVar[dict[str, Any]] = {}

    def __init__(self, like: nn.Module, num_prefix_tokens: int = 1, grid_size: Grid = None, **options: Any):
        super().__init__()
        unknown = set(options) - set(self.default_options)
        if unknown:
            raise ValueError(f"unknown option(s) for {self.variant!r}: {', '.join(sorted(unknown))}; "
                             f"valid: {', '.join(self.default_options) or 'none'}")
        self.options = {**self.default_options, **options}
        self.num_heads: int = like.num_heads
        self.head_dim: int = getattr(like, "head_dim", None) or _infer_head_dim(like)
        self.num_kv_heads: int = getattr(like, "num_kv_heads", None) or self.num_heads  # grouped-query attention
        self.attn_dim = self.num_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.num_prefix_tokens = num_prefix_tokens
        self.grid_size: Grid = tuple(grid_size) if grid_size is not None else None
        self.rotate_half = bool(getattr(like, "rotate_half", False))
        self.source_class = type(like).__name__
        for name in MATCHED_MODULES:
            child = getattr(like, name, None)
            setattr(self, name, copy.deepcopy(child) if child is not None else None)
        if self.q_norm is None:
            self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        if self.norm is None:
            self.norm = nn.Identity()
        for name in MATCHED_PARAMS:
            p = getattr(like, name, None)
            setattr(self, name, nn.Parameter(p.detach().clone()) if p is not None else None)
        k_bias = getattr(like, "k_bias", None)
        self.register_buffer("k_bias", None if k_bias is None else k_bias.detach().clone(), persistent=False)
        self.dropped = [n for n in DROPPED if getattr(like, n, None) is not None]
        self.proj_drop = copy.deepcopy(getattr(like, "proj_drop", nn.Identity()))
        self.dim = self.proj.out_features

    @classmethod
    def from_softmax(cls, module: nn.Module, **kwargs: Any) -> LinearAttention:
        """A variant with ``module``'s projections; extra parameters get the method's default init."""
        new = cls(module, **kwargs)
        new.reset_extra_parameters()
        return new

    # -- the parts a variant provides -------------------------------------------------------------
    def mix(self, q, k, v, key_valid: Optional[torch.Tensor], grid: Grid) -> torch.Tensor:
        """Fast O(N) token mixing: (B, H, N, d) q, k, v -> (B, H, N, d)."""
        raise NotImplementedError

    def reference(self, q, k, v, key_valid: Optional[torch.Tensor], grid: Grid) -> torch.Tensor:
        """Slow, literal form of the variant's formula; the oracle of the tests."""
        raise NotImplementedError

    def reset_extra_parameters(self) -> None:
        """Give the parameters softmax attention does not have their method's default init."""

    # -- shared machinery --------------------------------------------------------------------------
    def extra_parameter_names(self) -> list[str]:
        """Names (relative to this module) of parameters with no softmax counterpart."""
        matched = MATCHED_MODULES + MATCHED_PARAMS
        return [n for n, _ in self.named_parameters() if n.split(".")[0] not in matched]

    def qkv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of W_q, W_k, W_v, each (attn_dim, dim), whatever the projection layout."""
        if self.qkv is not None:
            return tuple(self.qkv.weight.split(self.attn_dim, dim=0))  # type: ignore[return-value]
        return self.q_proj.weight, self.k_proj.weight, self.v_proj.weight

    def qkv_biases(self) -> list[torch.Tensor]:
        """Every bias of the q/k/v projections (to zero them or copy them)."""
        biases = [self.q_bias, self.v_bias]
        for lin in (self.qkv, self.q_proj, self.k_proj, self.v_proj):
            if lin is not None:
                biases.append(lin.bias)
        return [b for b in biases if b is not None]

    def project(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None):
        """q, k, v as (B, H, N, d), computed exactly as the softmax module computed them."""
        B, N, _ = x.shape
        if self.qkv is not None:
            if self.q_bias is not None:
                bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
                qkv = F.linear(x, self.qkv.weight, bias)
                if self.qkv.bias is not None:
                    qkv = qkv + self.qkv.bias
            else:
                qkv = self.qkv(x)
            q, k, v = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q = self.q_proj(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
            k, v = (lin(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
                    for lin in (self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            npt = self.num_prefix_tokens
            q = torch.cat([q[:, :, :npt], apply_rot_embed_cat(q[:, :, npt:], rope, half=self.rotate_half)], 2)
            k = torch.cat([k[:, :, :npt], apply_rot_embed_cat(k[:, :, npt:], rope, half=self.rotate_half)], 2)
            q, k = q.type_as(v), k.type_as(v)
        if self.num_kv_heads != self.num_heads:
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return q, k, v

    def resolve_grid(self, tokens: int) -> Grid:
        """The (H, W) patch grid of this call: the model's grid, or a square one for other image sizes.

        Returns None when the spatial tokens form no known grid (e.g. NaFlex's packed patches); variants
        then use their grid-free form.
        """
        spatial = tokens - self.num_prefix_tokens
        if self.grid_size is not None and self.grid_size[0] * self.grid_size[1] == spatial:
            return self.grid_size
        side = math.isqrt(max(spatial, 0))
        return (side, side) if side > 0 and side * side == spatial else None

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        rope: Optional[torch.Tensor] = None,
        use_reference: bool = False,
        **_softmax_only: Any,  # shared_rel_pos(_bias): logit biases, dropped (see docs/variants.md)
    ) -> torch.Tensor:
        if is_causal:
            raise ValueError(f"{self.variant} attention is bidirectional; is_causal=True is not supported")
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.project(x, rope)
        key_valid = key_validity(attn_mask, B, N)
        mixer = self.reference if use_reference else self.mix
        out = mixer(q, k, v, key_valid, self.resolve_grid(N))
        out = out.transpose(1, 2).reshape(B, N, self.attn_dim)
        out = self.norm(out)
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        head = f"variant={self.variant}, heads={self.num_heads}, head_dim={self.head_dim}"
        return head + (f", {opts}" if opts else "")


def _infer_head_dim(like: nn.Module) -> int:
    out = like.qkv.out_features // 3 if getattr(like, "qkv", None) is not None else like.q_proj.out_features
    return out // like.num_heads


def split_prefix(t: torch.Tensor, num_prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split (B, H, N, d) into prefix tokens (class/dist/registers) and spatial tokens."""
    return t[:, :, :num_prefix], t[:, :, num_prefix:]


def to_grid(t: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(B, H, h*w, d) spatial tokens -> (B, H*d, h, w) image layout for depthwise convolutions."""
    B, H, _, d = t.shape
    return t.permute(0, 1, 3, 2).reshape(B, H * d, grid[0], grid[1])


def from_grid(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`to_grid`."""
    B, C, h, w = t.shape
    return t.reshape(B, heads, C // heads, h * w).permute(0, 1, 3, 2)
