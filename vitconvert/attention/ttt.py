"""TTT attention: one test-time gradient step of a per-head SwiGLU inner model (LeapLabTHU, Transformer-to-TTT).

Per head the inner model is f_W(x) = (silu(x W1) ⊙ (x W2)) W3 with learnable initial fast weights W1, W2, W3
(d×d each, one set per head). Keys are instance-normalised over tokens (biased variance, eps 1.0), then q and
k each get a residual 3×3 depthwise conv on the patch grid. One full-batch gradient step on the inner loss

    L = −(s/N) Σ_j ⟨f_W(k_j), v_j⟩,    s = d^{-1/2},  N = number of valid keys,

with learning rate ``inner_lr`` gives W' = W − lr·∇L, and out_i = f_{W'}(q_i). The gradients are closed form
(d×d sums over tokens), so the cost is O(N·d²) and no N×N tensor is ever formed.

Choices beyond the reference (which has no class token, no padding mask and a square grid only):

- Prefix tokens (class, distillation, registers) are not on the grid: they skip the convs, but their keys
  and values take part in the key statistics and the inner loss (every query of softmax attention sees the
  class token; leaving it out would cut it off from the patches), and their queries read the updated model.
- ``grid`` None (no known grid, e.g. packed patches): both convs are skipped.
- ``key_valid``: invalid tokens are left out of the key statistics and the inner loss, and enter the convs
  as zeros (like the grid border), so nothing of an invalid token reaches a valid token's output.
- Full-batch only: neither the reference nor ViT³ has a mini-batch (chunked) form for this non-causal layer.

The closed form's torch functions are in :mod:`.ops.ttt.closed_form`; on CUDA the step is one Triton op
(:mod:`.ops.ttt.op`), the key norm and the convs applied as its kernels load the tiles.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from .base import Grid, LinearAttention
from .ops import dispatch
from .ops.norms.lean import key_instance_norm
from .ops.ttt import op as fused_ttt
from .ops.ttt.closed_form import inner_gradients, inner_model, normalize_keys, stepped_readout, swiglu_readout
from .options import Option, number, number_or_auto, positive
from .registry import register_variant
from .tensors import accumulation_dtype, from_grid, full_precision, split_prefix, to_grid

FastWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# The inner step size at head_dim 32 that trained best in the transfer experiment (docs/results.md, "Why TTT
# failed in transfer"): 30-300 all learned, 1 stayed at chance, 1000 diverged at the first step.
INNER_LR_AT_32 = 100.0


def auto_inner_lr(head_dim: int) -> float:
    """The default step size: INNER_LR_AT_32·(32/d)².

    With the fast weights at their reference init (std 0.02) the step's token mixing, |f_W'(q) − f_W(q)| / |v|,
    is ~1e-6 at lr 1 and grows ~d² with the head size (measured: ×3.5-3.9 per doubling of d). The inner model's
    output is cubic in small fast weights, so at lr 1 the layer mixes almost nothing, a class token sees no
    patch and the student stays at chance. Scaling the lr by (32/d)² holds the measured mixing at the value
    that trained best at d = 32.
    """
    return INNER_LR_AT_32 * (32.0 / head_dim) ** 2


def records_for_backward() -> bool:
    """Whether this forward records a graph for backward that a recomputation can serve: grad on, and no trace for
    export (torch.export, ONNX) or TorchScript, whose graphs take the plain step."""
    return (torch.is_grad_enabled() and not torch.jit.is_tracing() and not torch.onnx.is_in_onnx_export()
            and not dispatch.exporting())


@register_variant
class TTTAttention(LinearAttention):
    """Softmax attention's q/k/v/proj around a test-time-trained SwiGLU inner model per head."""

    variant = "ttt"
    paper = 'Linearizing Vision Transformers with Test-Time Training (ICML 2026)'
    bibtex = """@inproceedings{linearizing_vit_ttt2026,
  title     = {Linearizing Vision Transformers with Test-Time Training},
  booktitle = {International Conference on Machine Learning (ICML)},
  year      = {2026},
  note      = {code: github.com/LeapLabTHU/Transformer-to-TTT}
}"""

    declared_options = (
        Option("inner_lr", None, "step size of the inner gradient step; null: auto_inner_lr(head_dim), "
               "100 at head_dim 32, 25 at 64 (the reference's 1.0 barely mixes tokens at the 0.02 init)",
               number_or_auto),
        Option("key_norm_eps", 1.0, "eps of the keys' instance norm", number, positive),
    )

    def __init__(self, dim: int, num_heads: int = 8, **kwargs: Any):
        super().__init__(dim, num_heads, **kwargs)
        given = self.options["inner_lr"]
        self.inner_lr: float = auto_inner_lr(self.head_dim) if given is None else given
        self.key_norm_eps: float = self.options["key_norm_eps"]
        # Like timm's grad_checkpointing, for the step alone and on by default (a setting of the module, not saved):
        # a training forward keeps q, k, v for backward and recomputes the step there (see mix)
        self.recompute_step: bool = True
        factory = {"device": self.proj.weight.device, "dtype": self.proj.weight.dtype}
        shape = (self.num_heads, self.head_dim, self.head_dim)
        self.fast_w1 = nn.Parameter(torch.empty(shape, **factory))
        self.fast_w2 = nn.Parameter(torch.empty(shape, **factory))
        self.fast_w3 = nn.Parameter(torch.empty(shape, **factory))
        # Channels in head-major order (head * d + c), the layout of both timm's qkv and the reference.
        dim = self.attn_dim
        self.q_conv = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim, **factory)
        self.k_conv = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim, **factory)
        if not self.building_on_meta:
            self.reset_extra_parameters()

    def reset_extra_parameters(self) -> None:
        """Fast weights trunc-normal std 0.02 (as the reference); the convs keep PyTorch's default init."""
        for w in (self.fast_w1, self.fast_w2, self.fast_w3):
            nn.init.trunc_normal_(w, std=0.02)
        self.q_conv.reset_parameters()
        self.k_conv.reset_parameters()

    def fast_weights(self, dtype: torch.dtype) -> FastWeights:
        return self.fast_w1.to(dtype), self.fast_w2.to(dtype), self.fast_w3.to(dtype)

    # -- fast form ---------------------------------------------------------------------------------
    def local_conv(self, t: torch.Tensor, conv_weight: torch.Tensor, conv_bias: Optional[torch.Tensor], grid: Grid,
                   valid: Optional[torch.Tensor]) -> torch.Tensor:
        """t + depthwise conv(t) on the grid's spatial tokens; prefix tokens pass through unchanged.

        Without a mask the residual is folded into the kernel (+1 on the centre tap): one pass, not two. The
        conv comes as its weight and bias (TorchScript passes no modules as arguments); one group per channel. The
        concatenation with the prefix is a pass even with no prefix tokens, and one the matmuls need: it lays the
        tokens out as (B, H, N, d), where the conv's output (token-major) would be copied by each matmul.
        """
        if grid is None:
            return t
        prefix, spatial = split_prefix(t, self.num_prefix_tokens)
        weight = conv_weight.to(t.dtype)
        bias = conv_bias.to(t.dtype) if conv_bias is not None else None
        groups = weight.shape[0]
        if valid is None:
            centre = torch.zeros_like(weight)
            centre[..., 1, 1] = 1.0
            local = F.conv2d(to_grid(spatial, grid), weight + centre, bias, padding=1, groups=groups)
            return torch.cat([prefix, from_grid(local, self.num_heads)], dim=2)
        inp = spatial * valid[:, None, self.num_prefix_tokens:, None].to(t.dtype)
        local = F.conv2d(to_grid(inp, grid), weight, bias, padding=1, groups=groups)
        return torch.cat([prefix, spatial + from_grid(local, self.num_heads)], dim=2)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], grid: Grid,
            extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`step`; when it records for backward (grad enabled, ``recompute_step`` on), recomputed in backward.

        Autograd would keep about 15 N-sized intermediates of the step (the normalised keys, the convs' outputs,
        the inner gradients' chain, the read-out); recomputed, it keeps q, k, v (views of the qkv projection's
        output, which softmax attention keeps too), for one more step forward per training step. Non-reentrant,
        so DDP, FSDP, timm's own block checkpointing and torch.compile take it; the step draws no random numbers,
        so no RNG state is stashed. Tracing for export or TorchScript records the plain step. On the kernels with
        the key norm and the convs in the op (a grid, and ops/grid's kernels buildable), the op itself keeps only
        q, k, v and the keys' statistics and recomputes in its backward: no checkpoint, and no second forward.
        """
        if not torch.jit.is_scripting():  # (nested: TorchScript skips only a branch of is_scripting() alone)
            on_kernels = self.fused_kernels and dispatch.can_run(v, "ttt_step")
            recompute = self.recompute_step and records_for_backward()
            if on_kernels:  # a kernel Triton cannot build: turned off, and the step again from the start
                kernel_convs = grid is not None and dispatch.can_run(v, "grid_conv")
                # (the op on the raw keys keeps only q, k, v and recomputes in its backward: no checkpoint)
                out = dispatch.attempt("ttt_step", self.run_step, q, k, v, key_valid, grid, True,
                                    recompute and not kernel_convs, kernel_convs)
                if out is not None:
                    return out
            return self.run_step(q, k, v, key_valid, grid, False, recompute)
        return self.step(q, k, v, key_valid, grid)

    def run_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                 grid: Grid, on_kernels: bool, recompute: bool, kernel_convs: bool = False) -> torch.Tensor:
        """:meth:`step`, checkpointed when ``recompute``. The path is decided before the checkpoint and passed in,
        so backward's recomputation takes the forward's (a later layer's backward may turn TTT's kernels off first),
        and a forward the kernels fail part-way is run again whole (the checkpoint must see one path's tensors)."""
        if recompute:
            return checkpoint(self.step, q, k, v, key_valid, grid, on_kernels, kernel_convs, use_reentrant=False,
                              preserve_rng_state=False)
        return self.step(q, k, v, key_valid, grid, on_kernels, kernel_convs)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
             grid: Grid, on_kernels: bool = False, kernel_convs: bool = False) -> torch.Tensor:
        """Closed-form step in float32 at least (autocast off: the d×d sums over N tokens need the range); with
        ``on_kernels``, :meth:`fused_step` (the Triton kernels; a failure to build one raises KernelUnavailable;
        ``kernel_convs``: the key norm and the convs on theirs too), else on the GPU with bf16 inputs
        :meth:`bf16_mix`."""
        if not torch.jit.is_scripting():  # the GPU path's devices: the fused kernels' (dispatch.current().devices)
            if on_kernels:
                return self.fused_step(q, k, v, key_valid, grid, kernel_convs)
            if self.fused_kernels and q.device.type in dispatch.current().devices and v.dtype == torch.bfloat16:
                return self.bf16_mix(q, k, v, key_valid, grid)
        dtype = v.dtype
        acc = accumulation_dtype(dtype)
        with full_precision(q):
            q, k, v = q.to(acc), k.to(acc), v.to(acc)
            k = normalize_keys(k, key_valid, self.key_norm_eps, by_var_mean=k.is_cuda)
            q = self.local_conv(q, self.q_conv.weight, self.q_conv.bias, grid, key_valid)
            k = self.local_conv(k, self.k_conv.weight, self.k_conv.bias, grid, key_valid)
            w1, w2, w3 = self.fast_weights(acc)
            out = stepped_readout(q, k, v, key_valid, w1, w2, w3, self.scale, self.inner_lr)
        return out.to(dtype)

    def fused_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                   grid: Grid, kernel_convs: bool = False) -> torch.Tensor:
        """The step on the Triton kernels (ops/ttt/op.py), in v's dtype: with ``kernel_convs`` the op takes the raw
        keys and applies the key norm (float32 statistics) and both convs as its kernels load the tiles, else the
        norm and the convs run as torch ops before it. The inner sums, the update and the read-out are the op's,
        whose token-sized work stays in float32 registers, and the fast weights float32 throughout, read as the
        parameters are."""
        dtype = v.dtype
        weights = (self.fast_w1, self.fast_w2, self.fast_w3)
        if kernel_convs and grid is not None:
            return fused_ttt.call_step(q.to(dtype), k.to(dtype), v, key_valid, weights, self.scale, self.inner_lr,
                                       self.q_conv.weight, self.q_conv.bias, (*grid, self.num_prefix_tokens),
                                       self.k_conv.weight, self.k_conv.bias, self.key_norm_eps)
        k = key_instance_norm(k, key_valid, self.key_norm_eps, dtype)
        q = self.local_conv(q.to(dtype), self.q_conv.weight, self.q_conv.bias, grid, key_valid)
        k = self.local_conv(k, self.k_conv.weight, self.k_conv.bias, grid, key_valid)
        return fused_ttt.call_step(q, k, v, key_valid, weights, self.scale, self.inner_lr)

    def bf16_mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                 grid: Grid) -> torch.Tensor:
        """The same step in torch ops where the kernels cannot run, with the N-sized work in bf16 on tensor cores
        (float32 accumulation inside each matmul): the key statistics and the fast weights (initial and updated)
        stay float32. bf16 only: its float32 exponent range holds the −s/N-scaled gradients, which underflow in
        float16."""
        dtype = v.dtype
        k = normalize_keys(k.float(), key_valid, self.key_norm_eps, by_var_mean=True).to(dtype)
        q = self.local_conv(q, self.q_conv.weight, self.q_conv.bias, grid, key_valid)
        k = self.local_conv(k, self.k_conv.weight, self.k_conv.bias, grid, key_valid)
        w1, w2, w3 = self.fast_weights(torch.float32)
        w12 = torch.cat((w1, w2), dim=-1)
        dw12, dw3 = inner_gradients(k, v, key_valid, w12.to(dtype), w3.to(dtype), self.scale)
        lr = self.inner_lr
        return swiglu_readout(q, (w12 - lr * dw12.float()).to(dtype), (w3 - lr * dw3.float()).to(dtype)).to(dtype)

    # -- literal form (test oracle) ------------------------------------------------------------------
    def reference(self, q, k, v, key_valid: torch.Tensor | None, grid: Grid) -> torch.Tensor:
        """Per (batch, head): literal norm and conv, autograd step on the literal loss, then f_{W'}(q_i)."""
        B, H, N, _ = q.shape
        valid = key_valid if key_valid is not None else torch.ones(B, N, dtype=torch.bool, device=q.device)
        grad_enabled = torch.is_grad_enabled()
        lr = self.inner_lr
        with torch.enable_grad():
            k = self._reference_key_norm(k, valid)
            q = self._reference_conv(q, self.q_conv, grid, valid)
            k = self._reference_conv(k, self.k_conv, grid, valid)
            per_batch = []
            for b in range(B):
                keys = [j for j in range(N) if valid[b, j]]
                per_head = []
                for h in range(H):
                    weights = [w[h] if w.requires_grad else w[h].detach().requires_grad_()
                               for w in (self.fast_w1, self.fast_w2, self.fast_w3)]
                    terms = [torch.dot(inner_model(k[b, h, j][None], *weights)[0], v[b, h, j]) for j in keys]
                    loss = -(self.scale / max(len(keys), 1)) * (sum(terms) if terms else 0.0 * weights[0].sum())
                    grads = torch.autograd.grad(loss, weights, create_graph=True)
                    updated = [w - lr * g for w, g in zip(weights, grads, strict=True)]
                    per_head.append(torch.stack([inner_model(q[b, h, i][None], *updated)[0] for i in range(N)]))
                per_batch.append(torch.stack(per_head))
            out = torch.stack(per_batch)
        return out if grad_enabled else out.detach()

    def _reference_key_norm(self, k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        rows = []
        for b in range(k.shape[0]):
            kv = k[b][:, valid[b]]
            mean = kv.mean(dim=1, keepdim=True) if kv.shape[1] else torch.zeros_like(k[b, :, :1])
            var = ((kv - mean) ** 2).mean(dim=1, keepdim=True) if kv.shape[1] else torch.zeros_like(mean)
            rows.append((k[b] - mean) / torch.sqrt(var + self.key_norm_eps))
        return torch.stack(rows)

    def _reference_conv(self, t: torch.Tensor, conv: nn.Conv2d, grid: Grid, valid: torch.Tensor) -> torch.Tensor:
        """Residual 3×3 depthwise cross-correlation written out tap by tap, zero outside the grid."""
        if grid is None:
            return t
        npt, (rows, cols) = self.num_prefix_tokens, grid
        H, d = t.shape[1], t.shape[3]
        weight = conv.weight.reshape(H, d, 3, 3)
        bias = conv.bias.reshape(H, d) if conv.bias is not None else torch.zeros_like(weight[..., 0, 0])
        out = []
        for i in range(t.shape[2]):
            if i < npt:
                out.append(t[:, :, i])
                continue
            r, c = divmod(i - npt, cols)
            total = t[:, :, i] + bias
            for dr in (-1, 0, 1):
                for dc in (-1, 0, 1):
                    if 0 <= r + dr < rows and 0 <= c + dc < cols:
                        j = npt + (r + dr) * cols + (c + dc)
                        tap = weight[:, :, dr + 1, dc + 1] * t[:, :, j]
                        total = total + tap * valid[:, j, None, None].to(t.dtype)
            out.append(total)
        return torch.stack(out, dim=2)
