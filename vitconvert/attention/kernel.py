"""ELU and ReLU kernel attention (Katharopoulos et al. 2020, "Transformers are RNNs"), non-causal.

out_i = φ(q_i)ᵀ (Σ_j φ(k_j) v_jᵀ) / (φ(q_i)ᵀ Σ_j φ(k_j) + ε). The d×d state S and the normaliser z are
formed once per head, so the cost is O(N·d²). Same parameters as softmax attention.

Speed (see docs/performance.md): V gets a column of ones, so one batched matmul gives [S | z] and one more
gives numerator and denominator together — two passes over the tokens instead of five. φ_elu is computed as
max(x, 0) + 2^(log2 e · min(x, 0)), equal to elu(x) + 1, because ``F.elu`` goes through ``expm1``, which is
12× slower than this on the benchmark CPU.

On CUDA the fused Triton kernels (ops/linear/op.py) take the call: φ, the state and the read-out in two
passes over the tokens, backward by recomputation. The eager form below is the CPU path and their reference.

Optional GPU path, with the fused kernels off (VITCONVERT_FUSED=0): in a module built with VITCONVERT_FLA=1 (read
once, at construction, as ``self.fla``), the state of CUDA calls comes from flash-linear-attention (extra ``fast``).
Off by default: fla has causal kernels only, so just its final state is our formula, and one cuBLAS matmul
computes that state already (docs/performance.md).
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import Any, ClassVar, Optional

import torch
from torch.nn import functional as F

from .base import Grid, LinearAttention
from .feature_maps import DEFAULT_INIT_SCALE, FEATURE_MAPS, HeadwiseLinear, hedgehog_features
from .ops import dispatch
from .ops.linear import op as fused
from .ops.linear.reference import hedgehog_features_literal, kernel_attention_reference
from .options import Option, choice, number, positive
from .registry import register_variant
from .tensors import accumulation_dtype, full_precision

KATHAROPOULOS_BIBTEX = """@inproceedings{katharopoulos2020transformers,
  title     = {Transformers are {RNNs}: Fast Autoregressive Transformers with Linear Attention},
  author    = {Katharopoulos, Angelos and Vyas, Apoorv and Pappas, Nikolaos and Fleuret, Fran{\\c{c}}ois},
  booktitle = {International Conference on Machine Learning (ICML)},
  year      = {2020},
  eprint    = {2006.16236},
  archivePrefix = {arXiv}
}"""


def elu_feature(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 = max(x, 0) + 2^(log2(e)·min(x, 0)), without expm1 or exp, and with two allocations.

    ``F.elu`` goes through expm1 and ``torch.exp`` is the precise (1-ulp) exp; both are several times slower
    on CPUs than ``exp2`` (docs/performance.md), whose extra rounding (from the product by log2 e) is a few
    ulp. min(x, 0) is x − max(x, 0) so that the gradient at 0 is elu's 1 (clamp's would be 0); the in-place
    ops are autograd-safe because threshold saves its input and subtraction and scaling save nothing.
    """
    if not torch.jit.is_scripting():  # (nested: TorchScript skips only a branch of is_scripting() alone)
        if torch.onnx.is_in_onnx_export():  # ONNX has Elu; exp2 would become a slow Pow(2, x) in ONNX Runtime
            return F.elu(x) + 1.0
    pos = F.threshold(x, 0.0, 0.0)
    return pos.add_((x - pos).mul_(1.4426950408889634).exp2_())  # log2(e), inline: TorchScript reads no module floats


def elu_feature_literal(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 exactly as the paper writes it; the reference's feature map."""
    return F.elu(x) + 1.0


def relu_feature(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """(…, N, d) -> (…, N, d+1) with a last column of ones: φ(K)ᵀ[V | 1] = [S | z] in one matmul."""
    return F.pad(v, (0, 1), value=1.0)


def use_fla() -> bool:
    """The flash-linear-attention state kernel, chosen once per module (at construction, like the fused kernels):
    opt-in (VITCONVERT_FLA=1) and installed; it then takes the CUDA calls."""
    return os.environ.get("VITCONVERT_FLA", "0") == "1" and fla_installed()


def fla_enabled(t: torch.Tensor) -> bool:
    """Whether a module built now would take fla's state for ``t``."""
    return t.is_cuda and use_fla()


@lru_cache(maxsize=1)
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def optional_fla_state(phi_k: torch.Tensor, v1: torch.Tensor, fla: bool) -> Optional[torch.Tensor]:
    """:func:`fla_state` when the module chose fla (:func:`use_fla`) and the call is on CUDA, else None (always
    None under TorchScript)."""
    if torch.jit.is_scripting():
        return None
    else:
        return fla_state(phi_k, v1) if fla and v1.is_cuda else None


def fla_state(phi_k: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """[S | z] (B, H, d, d+1) from flash-linear-attention's chunked kernel.

    fla's linear-attention kernels are causal; the final state after all N tokens, Σ_j φ(k_j)[v_j | 1]ᵀ, is
    exactly the non-causal state (fla accumulates it in float32), and its causal outputs are discarded.
    """
    from fla.ops.linear_attn import chunk_linear_attn  # lazy: optional extra `fast`

    tokens_major = [t.transpose(1, 2).contiguous() for t in (phi_k, phi_k, v1)]  # fla takes [B, T, H, K]
    _, state = chunk_linear_attn(*tokens_major, scale=1.0, output_final_state=True, normalize=False)
    return state.to(v1.dtype)


def kernel_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                     eps: float, fla: bool = False) -> torch.Tensor:
    """Σ-form of normalised kernel attention on (B, H, N, d) features; sums in float32 at least (the state from
    flash-linear-attention with ``fla`` on CUDA)."""
    dtype = v.dtype
    acc = accumulation_dtype(dtype)
    with full_precision(v):
        phi_q, phi_k = phi_q.to(acc), phi_k.to(acc)
        v1 = with_ones(v.to(acc))
        if key_valid is not None:
            phi_k = phi_k * key_valid[:, None, :, None].to(acc)
        state = optional_fla_state(phi_k, v1, fla)
        if state is None:
            state = phi_k.transpose(-2, -1) @ v1  # (B, H, d, d+1): [Σ_j φ(k_j) v_jᵀ | Σ_j φ(k_j)]
        out = phi_q @ state  # (B, H, N, d+1): [numerator | denominator]
        out = out[..., :-1] / (out[..., -1:] + eps)
    return out.to(dtype)


class KernelAttention(LinearAttention):
    """Normalised kernel attention with the feature map φ of a subclass (``phi``, ``phi_literal``, ``phi_code``);
    its variants (ELU, ReLU) are both Katharopoulos et al.'s, whose citation is written here once."""

    paper = 'Katharopoulos et al. 2020, Transformers are RNNs (arXiv:2006.16236)'
    bibtex = KATHAROPOULOS_BIBTEX

    declared_options = (
        Option("eps", 1e-6, "added to the normaliser φ(q_i)ᵀ Σ_j φ(k_j) (keeps rows with all-zero features finite)",
               number, positive),
        Option("feature_map", "fixed", "φ: " + "; ".join(f"{k}: {v}" for k, v in FEATURE_MAPS.items()) +
               " (feature_maps.py; hedgehog runs the eager form)", choice(*FEATURE_MAPS)),
        Option("init_scale", DEFAULT_INIT_SCALE, "feature_map=hedgehog's start W = S·I (1: Hedgehog's identity; 2, "
               "sharper, won on the digits; the fixed φ has no W)", number, positive,
               applies=("feature_map", "hedgehog")),
    )
    phi_code: ClassVar[int]  # φ in the fused kernels (ops/linear/op.py)

    def __init__(self, dim: int, num_heads: int = 8, **kwargs: Any):
        super().__init__(dim, num_heads, **kwargs)
        self.eps: float = self.options["eps"]
        self.fla: bool = use_fla()  # the fast choice beside fused_kernels, made once
        # Hedgehog's trained φ (feature_maps.py), one map for the queries and one for the keys, per head; no kernels
        # compute it, so such a layer runs the eager form
        self.feature_map_q = None  # Optional[HeadwiseLinear], unannotated: TorchScript warns on the annotation
        self.feature_map_k = None
        if self.options["feature_map"] == "hedgehog":
            factory = {"device": self.proj.weight.device, "dtype": self.proj.weight.dtype}
            scale = self.options["init_scale"]
            self.feature_map_q = HeadwiseLinear(self.num_heads, self.head_dim, scale, **factory)
            self.feature_map_k = HeadwiseLinear(self.num_heads, self.head_dim, scale, **factory)
            if not self.building_on_meta:
                self.reset_extra_parameters()

    def reset_extra_parameters(self) -> None:
        """Hedgehog's init of its maps: W = S·I (``init_scale``), b = 0."""
        for learned in (self.feature_map_q, self.feature_map_k):
            if learned is not None:
                learned.reset_parameters()

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        """φ, the fast form (a method: TorchScript calls methods, not class attributes)."""
        raise NotImplementedError

    def phi_literal(self, x: torch.Tensor) -> torch.Tensor:
        """φ exactly as the paper writes it: the reference's."""
        return self.phi(x)

    def features(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(φ(q), φ(k)) in the eager form: Hedgehog's learned maps where the layer has them, else the variant's φ
        (also what distill/attention_weights.py forms the layer's N×N weights from)."""
        if self.feature_map_q is not None and self.feature_map_k is not None:
            return hedgehog_features(self.feature_map_q(q)), hedgehog_features(self.feature_map_k(k))
        return self.phi(q), self.phi(k)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], grid: Grid,
            extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        """φ on q and k together: fewer passes, and for batches the stacked copy is the layout bmm needs."""
        if self.feature_map_q is not None and self.feature_map_k is not None:  # Hedgehog's φ: the eager form
            phi_q, phi_k = self.features(q, k)
            return kernel_attention(phi_q, phi_k, v, key_valid, self.eps, self.fla)
        if not torch.jit.is_scripting():  # (nested: TorchScript skips only a branch of is_scripting() alone)
            if self.fused_kernels and dispatch.can_run(v, "linear_attention"):
                out = dispatch.attempt("linear_attention", fused.attention, q.to(v.dtype), k.to(v.dtype), v,
                                    key_valid, self.phi_code, 0.0, self.eps, 1.0, False)
                if out is not None:
                    return out
        # (B, H) views cannot fold into one bmm batch: copy once, here. A trace takes the form valid for any batch.
        if not torch.jit.is_tracing() and q.shape[0] > 1 and q.shape == k.shape:
            phi_q, phi_k = self.phi(torch.stack((q, k))).unbind(0)
        else:  # one image: (1, H, N, d) views of the qkv output fold into (H, N, d) without a copy
            phi_q, phi_k = self.phi(q), self.phi(k)
        return kernel_attention(phi_q, phi_k, v, key_valid, self.eps, self.fla)

    def reference(self, q, k, v, key_valid, grid: Grid):
        if self.feature_map_q is not None and self.feature_map_k is not None:
            phi_q, phi_k = (hedgehog_features_literal(self.feature_map_q(q)),
                            hedgehog_features_literal(self.feature_map_k(k)))
            return kernel_attention_reference(phi_q, phi_k, v, key_valid, self.eps)
        return kernel_attention_reference(self.phi_literal(q), self.phi_literal(k), v, key_valid, self.eps)


@register_variant
class EluAttention(KernelAttention):
    """φ(x) = elu(x) + 1: strictly positive features, so the normaliser never vanishes."""

    variant = "elu"
    phi_code = fused.ELU_PLUS_ONE

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        return elu_feature(x)

    def phi_literal(self, x: torch.Tensor) -> torch.Tensor:
        return elu_feature_literal(x)


@register_variant
class ReluAttention(KernelAttention):
    """φ(x) = relu(x): sparse features; ε keeps rows whose features are all zero finite."""

    variant = "relu"
    phi_code = fused.RELU

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        return relu_feature(x)
