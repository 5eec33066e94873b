"""MHLA (Zhang et al., ICLR 2026, "Restoring Expressivity of Linear Attention via Token-Level Multi-Head").

One global d×d state makes every query of plain kernel attention see the same summary of all keys. MHLA
splits the spatial grid into M blocks ("token-level heads"), keeps one state per block,
S_b = Σ_{j∈b} φ(k_j) v_jᵀ and z_b = Σ_{j∈b} φ(k_j), and lets a query of block a read the mixture
Σ_b W_ab S_b with a learnable M×M matrix W initialised from the distances between block centres:
out_i = φ(q_i)ᵀ Σ_b W_ab S_b / (φ(q_i)ᵀ Σ_b W_ab z_b + ε), φ(x) = relu(x) + ε, plus LePE (a depthwise conv over
V on the grid). Cost O(N·d² + M²·d²). Reference code: DAGroup-PKU/MHLA,
``mhla_image_classification/models/modules/attention/mhla.py``. Its denominator mixes the scalars φ(q)·z_own
across blocks by in-block position (Σ_b W_ab φ(q_{b,i})·z_b, queries of other blocks); we use φ(q_i)ᵀ Σ_b W_ab z_b,
the form under which each query's weights over the keys sum to one.

Choices where the reference (square grids divisible into square blocks, no class token) says nothing:
- blocks: the block counts per axis are fixed at construction (``blocks_per_side``, or ``round(side / block_side)``
  from ``grid_size``, or one block when neither is known), so W keeps its meaning and learned values on any grid;
  a grid of another size is split into the same counts of larger or smaller blocks. Row r goes to block row
  ⌊r·M_h/h⌋ (likewise columns), so non-divisible grids get blocks whose sides differ by at most one token.
  Block centres for the init are (i + ½, j + ½) in block units, as in the reference.
- prefix tokens (class, distillation, registers) form one more, global block: their queries read Σ_b S_b plus the
  prefix state, and every query reads the prefix keys with weight 1 (W extended by a row and column of ones).
- ``grid is None`` (no known grid): one block over all tokens, i.e. relu + ε kernel attention, and no LePE.
- a key mask removes keys from every sum and zeroes their V before LePE, so padding reaches no valid output.
- ``input_norm``: the reference's LayerNorm sits on the layer input before the q/k/v projection, so it is applied
  to x in ``forward`` (mix receives projected q, k, v). With a pretrained source it re-standardises norm1's
  output, so the copied projections no longer see exactly the softmax input; ``input_norm=False`` keeps them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

from .base import Grid, LinearAttention
from .blocks import (  # noqa: F401  (block_layout, block_indices: importable from here too)
    TRANSFORMS,
    block_indices,
    block_layout,
    cached_block_indices,
    distance_weights,
    from_blocks,
    reference_block_of,
    resolve_block_counts,
    segment_index,
    to_blocks,
    token_segments,
)
from .kernel import kernel_attention, with_ones
from .ops import dispatch
from .ops.linear import op as fused
from .ops.linear.reference import kernel_attention_reference
from .ops.norms.lean import layer_norm_linear, rms_rows
from .ops.pairwise import op as fused_pairwise
from .options import Option, choice, count_or_pair, flag, integer, number, positive
from .registry import register_variant
from .tensors import accumulation_dtype, from_grid, full_precision, split_prefix, to_grid

DENOMINATORS = ("consistent", "official")


def at_least_one_token(value: int) -> Optional[str]:
    return None if value >= 1 else "must be at least 1 token"


def not_negative(value: float) -> Optional[str]:  # below 0 no block, not even itself, is near: 0/0 in W
    return None if value >= 0 else "must not be negative"


def odd_or_zero(value: int) -> Optional[str]:
    return None if value == 0 or (value > 0 and value % 2) else "must be odd (or 0 for no LePE)"


def relu_plus(x: torch.Tensor, eps: float) -> torch.Tensor:
    """relu(x) + ε in place (threshold saves its input, so autograd allows it); exported, ONNX's Relu op, which
    ONNX Runtime runs far faster than the Where that threshold becomes."""
    if not torch.jit.is_scripting():  # (nested: TorchScript skips only a branch of is_scripting() alone)
        if torch.onnx.is_in_onnx_export():
            return F.relu(x) + eps
    return F.threshold(x, 0.0, 0.0).add_(eps)


def lepe_reference(v_image: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """The depthwise conv as an explicit sum over the zero-padded shifts of the V image."""
    size = conv.kernel_size[0]
    h, w = v_image.shape[-2:]
    padded = F.pad(v_image, (size // 2,) * 4)
    weight = conv.weight.to(v_image.dtype)
    out = conv.bias.to(v_image.dtype)[None, :, None, None].expand_as(v_image)
    for i in range(size):
        for j in range(size):
            out = out + weight[None, :, 0, i, j, None, None] * padded[:, :, i:i + h, j:j + w]
    return out


def machine_eps(dtype: torch.dtype) -> float:
    """``torch.finfo(dtype).eps`` (F.rms_norm's default ε) in a form TorchScript compiles."""
    if dtype == torch.float64:
        return 2.220446049250313e-16
    if dtype == torch.bfloat16:
        return 0.0078125
    if dtype == torch.float16:
        return 0.0009765625
    return 1.1920928955078125e-07


@register_variant
class MHLAttention(LinearAttention):
    """Multi-head linear attention over token blocks, mixed by a learnable distance-initialised matrix."""

    variant = "mhla"
    paper = 'Zhang et al. 2026, Restoring Expressivity of Linear Attention via Token-Level Multi-Head (ICLR)'
    bibtex = """@inproceedings{zhang2026mhla,
  title     = {Restoring Expressivity of Linear Attention via Token-Level Multi-Head},
  author    = {Zhang and others},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2026}
}"""

    declared_options = (
        Option("blocks_per_side", None, "blocks per axis, an int or [M_h, M_w]; null: from grid_size and "
               "block_side", count_or_pair),
        Option("block_side", 7, "target block side in tokens when blocks_per_side is null (14×14 -> 2×2 blocks)",
               integer, at_least_one_token),
        Option("transform", "cos", "distance -> W init: cos, linear, exp, local (the reference's column-normalised "
               "ones)", choice(*TRANSFORMS)),
        Option("exp_sigma", 3.0, "σ of the exp transform, exp(-distance/σ)", number, positive),
        Option("local_threshold", 1.5, "the local transform's reach in block distances", number, not_negative),
        Option("qk_rmsnorm", True, "the reference's RMSNorm on q and k (on in all its registered models)", flag),
        Option("input_norm", True, "the reference's LayerNorm on the layer input", flag),
        Option("lepe_kernel", 5, "side of the depthwise conv over V on the grid (LePE); 0 turns LePE off", integer,
               odd_or_zero),
        Option("eps", 1e-6, "added to φ = relu + eps and to the normaliser", number, positive),
        Option("denominator", "consistent", "consistent: each query normalised by its own φ(q_i)·Σ_b W_ab z_b, the "
               "sum of its attention weights; official: per-block scalars Σ_b W_ab φ(q_{b,l})·z_b mixed as "
               "DAGroup-PKU/MHLA's code does (docs/variants.md)", choice(*DENOMINATORS)),
    )

    def __init__(self, dim: int, num_heads: int = 8, **kwargs: Any):
        super().__init__(dim, num_heads, **kwargs)
        opts = self.options
        self.block_counts = resolve_block_counts(self.grid_size, opts["blocks_per_side"], opts["block_side"])
        self.eps: float = opts["eps"]
        self.official_denominator: bool = opts["denominator"] == "official"
        factory = {"device": self.proj.weight.device, "dtype": self.proj.weight.dtype}
        blocks = self.block_counts[0] * self.block_counts[1]
        self.block_mix = nn.Parameter(torch.empty(blocks, blocks, **factory))
        in_dim, C = self.qkv_weights()[0].shape[1], self.attn_dim
        self.input_norm = nn.LayerNorm(in_dim, **factory) if opts["input_norm"] else None
        self.q_rmsnorm = nn.RMSNorm(C, **factory) if opts["qk_rmsnorm"] else None
        self.k_rmsnorm = nn.RMSNorm(C, **factory) if opts["qk_rmsnorm"] else None
        size = opts["lepe_kernel"]
        self.lepe = nn.Conv2d(C, C, size, padding=size // 2, groups=C, **factory) if size else None
        self.lepe_padding = size // 2
        if not self.building_on_meta:
            self.reset_extra_parameters()

    @classmethod
    def grid_problem(cls, options: dict[str, Any], grid_size: Grid,
                     given: frozenset[str] = frozenset()) -> Optional[str]:
        """More blocks than tokens along a side (a 4×4 grid in 100×100 blocks: W of 10⁸ entries per layer, blocks
        holding no token), or a LePE kernel reaching further than the grid (taps that never touch a token)."""
        if grid_size is None:
            return None
        h, w = grid_size
        counts = resolve_block_counts(grid_size, options["blocks_per_side"], options["block_side"])
        if given & {"blocks_per_side", "block_side"} and (counts[0] > h or counts[1] > w):
            return (f"mhla's blocks_per_side {options['blocks_per_side']!r} gives more blocks than the {h}×{w} patch "
                    f"grid has tokens per side: a block holds at least one token; at most {[h, w]} here")
        size, widest = options["lepe_kernel"], 2 * min(h, w) - 1
        if "lepe_kernel" in given and size > widest:
            return (f"mhla's lepe_kernel {size} is wider than the {h}×{w} patch grid: its outer taps never touch a "
                    f"token; at most {widest} here (odd, or 0 for no LePE)")
        return None

    def pinned_options(self) -> dict[str, Any]:
        """The block counts chosen from the grid, fixed: W (M×M) keeps its shape when timm rebuilds at another size."""
        return {**self.options, "blocks_per_side": list(self.block_counts)}

    def reset_extra_parameters(self) -> None:
        """W from block distances; PyTorch's defaults for LePE and the norms, as the reference leaves them."""
        opts = self.options
        with torch.no_grad():
            self.block_mix.copy_(distance_weights(self.block_counts, opts["transform"], opts["exp_sigma"],
                                                  opts["local_threshold"]))
        for module in (self.input_norm, self.q_rmsnorm, self.k_rmsnorm, self.lepe):
            if module is not None:
                module.reset_parameters()

    def prepare(self, x: torch.Tensor, key_valid: Optional[torch.Tensor],
                grid: Grid) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The reference normalises the layer input (LayerNorm) before projecting q, k, v: here, or in
        :meth:`fused_qkv` where the projection is one fused qkv linear (and no gate reads the normalised input)."""
        if self.input_norm is not None and (self.qkv is None or self.gate is not None):
            x = self.input_norm(x)
        return x, None

    def fused_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The input LayerNorm, then the fused qkv projection. With the kernels, one autograd Function
        (lean_norms.layer_norm_linear) that keeps x̂ in the projection's dtype instead of autograd's float32 copy of
        the input (the bias-split layout keeps the plain form)."""
        if self.qkv is None:
            return x
        if self.input_norm is not None and self.gate is None:
            if not torch.jit.is_scripting():  # (nested: TorchScript skips only a branch of is_scripting() alone)
                if self.q_bias is None and self._fused_here(x[..., :self.head_dim]):
                    return layer_norm_linear(x, self.input_norm, self.qkv.weight, self.qkv.bias)
            x = self.input_norm(x)
        return self.qkv_linear(x)

    def _fused_here(self, t: torch.Tensor) -> bool:
        """Whether this call runs on the kernels (``t`` with q's last dimension: can_run checks the head dim)."""
        return self.fused_kernels and not self.official_denominator and dispatch.can_run(t, "blocked_attention")

    # -- shared by mix and reference ----------------------------------------------------------------
    def features(self, q: torch.Tensor, k: torch.Tensor, key_valid: Optional[torch.Tensor]):
        """φ(q), φ(k) = relu(·) + ε after the optional RMSNorm; masked keys get φ = 0 (ε would keep them)."""
        eps = self.eps
        if self.q_rmsnorm is not None:
            norm_eps = machine_eps(q.dtype)  # (the reference's RMSNorm(dim): F.rms_norm's default ε)
            q = rms_rows(q, self.q_rmsnorm.weight, norm_eps)  # (full precision here: the eager form)
            k = rms_rows(k, self.k_rmsnorm.weight, norm_eps)
        phi_q, phi_k = relu_plus(q, eps), relu_plus(k, eps)
        if key_valid is not None:
            phi_k = phi_k * key_valid[:, None, :, None].to(phi_k.dtype)
        return phi_q, phi_k

    def _check_grid(self, tokens: int, grid: tuple[int, int]) -> None:
        if torch.jit.is_tracing():  # (a trace is fixed to its input's size: resolve_grid already chose this grid)
            return
        if tokens - self.num_prefix_tokens != grid[0] * grid[1]:
            raise ValueError(f"{tokens} tokens do not form {self.num_prefix_tokens} prefix tokens and a "
                             f"{grid[0]}x{grid[1]} grid")

    def _masked_spatial_v(self, v: torch.Tensor, key_valid: Optional[torch.Tensor]) -> torch.Tensor:
        spatial = split_prefix(v, self.num_prefix_tokens)[1]
        if key_valid is not None:
            spatial = spatial * key_valid[:, None, self.num_prefix_tokens:, None].to(v.dtype)
        return spatial

    # -- the variant ----------------------------------------------------------------------------------
    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
            grid: Grid, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Blocked states, mixed by W, read by each query; reshapes/gathers, no loops; sums in float32 at least."""
        if not torch.jit.is_scripting():  # (nested: TorchScript skips only a branch of is_scripting() alone)
            if self._fused_here(v):
                out = dispatch.attempt("blocked_attention", self._fused_mix, q, k, v, key_valid, grid)
                if out is not None:
                    return out
        dtype = v.dtype
        acc = accumulation_dtype(dtype)
        with full_precision(q):
            q, k, v = q.to(acc), k.to(acc), v.to(acc)
            phi_q, phi_k = self.features(q, k, key_valid)
            if grid is None:
                out = kernel_attention(phi_q, phi_k, v, None, self.eps)
            else:
                self._check_grid(q.shape[2], grid)
                lepe: Optional[torch.Tensor] = None
                if self.lepe is not None:
                    bias = self.lepe.bias
                    lepe = F.conv2d(to_grid(self._masked_spatial_v(v, key_valid), grid), self.lepe.weight.to(acc),
                                    bias.to(acc) if bias is not None else None, padding=self.lepe_padding,
                                    groups=self.lepe.groups)
                    lepe = from_grid(lepe, self.num_heads)
                out = self._blocked_attention(phi_q, phi_k, v, grid, lepe)
        return out.to(dtype)

    def _fused_mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                   grid: Grid) -> torch.Tensor:
        """:meth:`mix` on the Triton kernels: the RMSNorm of q and k, φ and W̃'s weighting in one op (which keeps
        only the raw q, k, v), in its pairwise form (N×N tiles, ops/pairwise/op.py, LePE in its kernels' epilogues)
        or its blocked form (block states mixed by W̃ in the state kernel's last programs, then read, LePE in the
        read-out's epilogue), whichever moves less (:func:`.ops.pairwise.op.pairwise_is_cheaper`). No grid: one block
        of all tokens, the blocked form (one d×d state per head)."""
        q, k, norms = q.to(v.dtype), k.to(v.dtype), self._fused_norm_args(v)
        if grid is None:
            ones = torch.ones(1, 1, dtype=v.dtype, device=v.device)
            return fused.segmented_attention(q, k, v, key_valid, None, ones, fused.RELU_PLUS_EPS, self.eps, self.eps,
                                             *norms)
        self._check_grid(q.shape[2], grid)
        lepe = (None, None) if self.lepe is None else (self.lepe.weight, self.lepe.bias)
        if (fused_pairwise.pairwise_is_cheaper(q.shape[2], self.block_mix.shape[0] + 1, q.shape[3], v.dtype)
                and dispatch.fits("pairwise_attention")):  # (where its kernels cannot build: the blocked form)
            segments = token_segments(grid, self.block_counts, self.num_prefix_tokens, q.device)  # (W as it is, as
            # the blocked op takes it)
            out = dispatch.attempt("pairwise_attention", fused_pairwise.pairwise, q, k, v, key_valid, segments,
                                   self.block_mix, fused.RELU_PLUS_EPS, self.eps, self.eps, *norms, *lepe, grid,
                                   self.num_prefix_tokens)
            if out is not None:
                return out
        index = segment_index(grid, self.block_counts, self.num_prefix_tokens, q.device)  # (W as it is: the kernels
        # give the class token's segment its row and column of ones as they load it)
        return fused.segmented_attention(q, k, v, key_valid, index, self.block_mix, fused.RELU_PLUS_EPS, self.eps,
                                         self.eps, *norms, *lepe, grid, self.num_prefix_tokens)

    def _fused_norm_args(self, v: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
        """(q weight, k weight, ε) of the RMSNorm the blocked op applies; ε as F.rms_norm's: float32's under
        autocast (where F.rms_norm runs in float32), else the input dtype's."""
        if self.q_rmsnorm is None or self.k_rmsnorm is None:
            return None, None, 0.0
        autocast = torch.is_autocast_enabled(v.device.type)
        return self.q_rmsnorm.weight, self.k_rmsnorm.weight, torch.finfo(torch.float32 if autocast else v.dtype).eps

    def _blocked_attention(self, phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                           grid: tuple[int, int], lepe: Optional[torch.Tensor]) -> torch.Tensor:
        """V carries a ones column: each block matmul gives [S_b | z_b], each readout [numerator | denominator]."""
        B, H, _, d = v.shape
        eps, counts = self.eps, self.block_counts
        npt = self.num_prefix_tokens
        v1 = with_ones(v)
        q_pre, q_sp = split_prefix(phi_q, npt)
        k_pre, k_sp = split_prefix(phi_k, npt)
        v_pre, v_sp = split_prefix(v1, npt)
        states = to_blocks(k_sp, grid, counts, False).transpose(-2, -1) @ to_blocks(v_sp, grid, counts, True)
        prefix_state = k_pre.transpose(-2, -1) @ v_pre  # (B, H, d, d+1): the prefix block [S_p | z_p]
        blocks = counts[0] * counts[1]
        mix = self.block_mix.to(v.dtype).expand(B, H, blocks, blocks)  # an explicit bmm: matmul would fold and copy
        mixed = (mix @ states.reshape(B, H, blocks, d * (d + 1))).view_as(states)
        official = self.official_denominator
        q_blocks = to_blocks(q_sp, grid, counts, official)  # official: padding slots add nothing to other blocks
        read = q_blocks @ (mixed + prefix_state[:, :, None])  # (B, H, M, L, d+1)
        if official:  # Σ_b W_ab φ(q_{b,l})·z_b, + φ(q_i)·z_prefix for the prefix block W̃ adds
            own = (q_blocks @ states[..., -1:]).squeeze(-1)  # (B, H, M, L): φ(q_{b,l})·z_b
            prefix_z = q_blocks @ prefix_state[:, :, None, :, -1:]
            read = torch.cat((read[..., :-1], (mix @ own).unsqueeze(-1) + prefix_z), dim=-1)
        spatial = from_blocks(read[..., :-1] / (read[..., -1:] + eps), grid, counts)
        if lepe is not None:
            spatial = spatial + lepe
        prefix = q_pre @ (states.sum(dim=2) + prefix_state)
        prefix = prefix[..., :-1] / (prefix[..., -1:] + eps)
        return torch.cat((prefix, spatial), dim=2)

    def _reference_partners(self, grid: tuple[int, int], block_of: torch.Tensor,
                            blocks: int) -> dict[int, dict[int, int]]:
        """Spatial token i -> {block b: the token of b at i's in-block position} (row-major order in a block)."""
        position, seen = {}, [0] * blocks
        members: dict[int, dict[int, int]] = {b: {} for b in range(blocks)}
        for i, b in enumerate(block_of.tolist()):
            if b < blocks:
                position[i], seen[b] = seen[b], seen[b] + 1
                members[b][position[i]] = i
        return {i: {b: members[b][l] for b in range(blocks) if l in members[b]} for i, l in position.items()}

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                  grid: Grid) -> torch.Tensor:
        """Explicit N×N weights A_ij = φ(q_i)·φ(k_j)·W̃[block(i), block(j)], rows normalised, times V, + LePE.

        W̃ is W with a last row and column of ones for the global prefix block.
        """
        eps = self.eps
        phi_q, phi_k = self.features(q, k, key_valid)
        if grid is None:
            return kernel_attention_reference(phi_q, phi_k, v, None, eps)
        self._check_grid(q.shape[2], grid)
        blocks = self.block_counts[0] * self.block_counts[1]
        extended = torch.ones(blocks + 1, blocks + 1, dtype=v.dtype, device=v.device)
        extended[:blocks, :blocks] = self.block_mix.to(v.dtype)
        block_of = torch.tensor([blocks] * self.num_prefix_tokens + reference_block_of(grid, self.block_counts),
                                device=v.device)
        mask = extended[block_of][:, block_of]
        scores = (phi_q @ phi_k.transpose(-2, -1)) * mask
        norm = scores.sum(dim=-1, keepdim=True)
        if self.official_denominator:  # query i reads its in-block partners' denominators
            dots, npt = phi_q @ phi_k.transpose(-2, -1), self.num_prefix_tokens  # φ(q_r)·φ(k_j)
            norm = norm.clone()
            for i, partner in self._reference_partners(grid, block_of, blocks).items():
                total = dots[:, :, i, :npt].sum(-1)  # the prefix block: weight 1, the query's own φ(q_i)
                for j in range(npt, len(block_of)):
                    if int(block_of[j]) in partner:
                        total = total + mask[i, j] * dots[:, :, partner[int(block_of[j])], j]
                norm[:, :, i, 0] = total
        out = (scores @ v) / (norm + eps)
        if self.lepe is not None:
            lepe = lepe_reference(to_grid(self._masked_spatial_v(v, key_valid), grid), self.lepe)
            out = torch.cat((out[:, :, :self.num_prefix_tokens],
                             out[:, :, self.num_prefix_tokens:] + from_grid(lepe, self.num_heads)), 2)
        return out
