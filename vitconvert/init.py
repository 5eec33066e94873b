"""Init recipes: copy what has the same role and shape, Mimetic or random for attention, and a report.

Groups follow the paper: attention parameters that match softmax ones (``--attn-init``), MLPs
(``--mlp-init``), and the rest — embeddings, tokens, norms, head (``--rest-init``). Parameters with no
softmax counterpart always get their method's default init. "random" means timm's own init of the same
architecture (a fresh ``pretrained=False`` model with the same seed), not a hand-written imitation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from torch import nn

from .attention import LinearAttention
from .attention.base import MATCHED_MODULES, MATCHED_PARAMS
from .errors import VitconvertError, param
from .surgery import find_softmax_attention

ATTN_INITS = ("mimetic", "copy", "random")
MLP_INITS = ("copy", "random")
REST_INITS = ("copy", "random")

# Mimetic constants for ViTs (Trockman & Kolter 2023): W_q W_kᵀ ≈ α₁Z₁ + β₁I, W_v W_o ≈ α₂Z₂ − β₂I.
MIMETIC_QK = (0.7, 0.7)
MIMETIC_VO = (0.4, 0.4)
# Attention children that Mimetic does not model: they restart from their default init.
NORM_AND_GATE = ("q_norm", "k_norm", "norm", "gate")


@dataclass(frozen=True)
class InitRecipe:
    attn: str = "mimetic"
    mlp: str = "copy"
    rest: str = "copy"
    seed: int = 0

    def __post_init__(self) -> None:
        for field_name, valid in (("attn", ATTN_INITS), ("mlp", MLP_INITS), ("rest", REST_INITS)):
            value = getattr(self, field_name)
            if value not in valid:
                raise VitconvertError(f"unknown --{field_name}-init {value!r}; valid: {', '.join(valid)}")

    @property
    def needs_fresh_model(self) -> bool:
        """Whether any part is random: then a freshly initialised copy of the source is built to draw from."""
        return "random" in (self.attn, self.mlp, self.rest)

    def to_dict(self) -> dict[str, Any]:
        """The recipe as config.json records it."""
        return asdict(self)


# -- grouping ---------------------------------------------------------------------------------------
EMBEDDING_PREFIXES = ("patch_embed", "pos_embed", "cls_token", "reg_token", "dist_token", "embeds", "mask_token")


def parameter_group(name: str, attention_prefixes: tuple[str, ...], head_names: tuple[str, ...],
                    softmax_prefixes: tuple[str, ...] = ()) -> str:
    """Which report group a parameter of the converted model belongs to."""
    if any(name.startswith(prefix + ".") for prefix in softmax_prefixes):
        return "softmax attention"  # a layer a hybrid keeps: it follows the rest (copied unless --rest-init)
    for prefix in attention_prefixes:
        if name.startswith(prefix + "."):
            local = name[len(prefix) + 1:].split(".")[0]
            return "attention" if local in MATCHED_MODULES + MATCHED_PARAMS else "attention-extra"
    parts = name.split(".")
    if "mlp" in parts:
        return "mlp"
    if parts[0] in head_names:
        return "head"
    if parts[0] in EMBEDDING_PREFIXES:
        return "embeddings"
    if any(p.startswith("norm") or p.startswith("fc_norm") for p in parts):
        return "norms"
    return "other"


def _head_names(model: nn.Module) -> tuple[str, ...]:
    names = ["head", "head_dist"]
    classifier = getattr(model, "pretrained_cfg", {}).get("classifier")
    for c in classifier if isinstance(classifier, (list, tuple)) else [classifier]:
        if c:
            names.append(str(c).split(".")[0])
    return tuple(names)


# -- Mimetic --------------------------------------------------------------------------------------
def mimetic_target(dim: int, alpha: float, beta: float, sign: float, generator: torch.Generator,
                   count: int = 1) -> torch.Tensor:
    """``count`` matrices M = αZ + sign·βI with Z ~ N(0, 1/dim), a fresh Z each."""
    z = torch.randn(count, dim, dim, generator=generator, dtype=torch.float64)
    z.mul_(alpha / dim ** 0.5).diagonal(dim1=-2, dim2=-1).add_(sign * beta)  # in place: 7M values per layer
    return z


def low_rank_factors(target: torch.Tensor, rank: int, generator: torch.Generator,
                     oversample: int = 10, power_iters: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A, B (…, rank, dim) with AᵀB ≈ the best rank-``rank`` approximation of ``target`` (…, dim, dim).

    A randomized SVD (range finder + power iterations, Halko et al. 2011): O(dim²·rank) instead of the
    O(dim³) full SVD per head, which made Mimetic init of DeiT-Base take minutes on a CPU. Its Frobenius
    error is within a few percent of the optimum (tested); at rank = dim the factorisation is exact.
    """
    dim = target.shape[-1]
    if rank + oversample >= dim:
        u, s, vh = torch.linalg.svd(target)
    else:
        probe = torch.randn(*target.shape[:-2], dim, rank + oversample, generator=generator, dtype=target.dtype)
        basis = torch.linalg.qr(target @ probe).Q
        for _ in range(power_iters):
            basis = torch.linalg.qr(target.mT @ basis).Q
            basis = torch.linalg.qr(target @ basis).Q
        small_u, s, vh = torch.linalg.svd(basis.mT @ target, full_matrices=False)
        u = basis @ small_u
    root = s[..., :rank].sqrt()
    a = (u[..., :rank] * root.unsqueeze(-2)).mT
    b = vh[..., :rank, :] * root.unsqueeze(-1)
    return a, b


@torch.no_grad()
def mimetic_init(attn: LinearAttention, generator: torch.Generator) -> None:
    """Per head W_qᵀW_k ≈ α₁Z₁+β₁I (fresh Z per head); across heads W_vᵀW_projᵀ ≈ α₂Z₂−β₂I; biases zero."""
    if attn.num_kv_heads != attn.num_heads:
        raise VitconvertError("Mimetic init pairs each query head with its own key head; this model uses "
                              f"grouped-query attention: use {param('attn_init', 'copy')} or random")
    w_q, w_k, w_v = attn.qkv_weights()
    dim, d, heads = w_q.shape[1], attn.head_dim, attn.num_heads
    # Z is drawn in float64 (the seeded draw of every earlier version) and factored in float32: 2.5× faster
    # on CPUs, and float32 is the precision the weights end up in anyway.
    target = mimetic_target(dim, *MIMETIC_QK, 1.0, generator, count=heads).float()
    a, b = low_rank_factors(target, d, generator)
    w_q.copy_(a.reshape(heads * d, dim))  # head h owns rows h·d:(h+1)·d, as timm's qkv lays them out
    w_k.copy_(b.reshape(heads * d, dim))
    a, b = low_rank_factors(mimetic_target(dim, *MIMETIC_VO, -1.0, generator).float(), attn.attn_dim, generator)
    w_v.copy_(a[0])  # (attn_dim, dim): x -> v
    attn.proj.weight.copy_(b[0].T)  # (dim, attn_dim): v -> out, so W_vᵀ·W_projᵀ = AᵀB
    for bias in attn.qkv_biases() + ([attn.proj.bias] if attn.proj.bias is not None else []):
        bias.zero_()
    for name in NORM_AND_GATE:
        module = getattr(attn, name, None)
        if module is not None and hasattr(module, "reset_parameters"):
            module.reset_parameters()


# -- the recipe --------------------------------------------------------------------------------------
@dataclass
class InitReport:
    """Parameter counts per (group, action); stored in config.json and printed as a table."""

    rows: dict[tuple[str, str], list[int]]

    def add(self, group: str, action: str, numel: int) -> None:
        """Count one tensor of ``numel`` values under its group and action."""
        count = self.rows.setdefault((group, action), [0, 0])
        count[0] += 1
        count[1] += numel

    def to_list(self) -> list[dict[str, Any]]:
        """The rows as config.json records them (group, action, tensors, params), sorted."""
        return [{"group": g, "action": a, "tensors": t, "params": n} for (g, a), (t, n) in sorted(self.rows.items())]

    def totals(self) -> dict[str, int]:
        """Parameters per action (copied, mimetic, ...): the report's bottom line."""
        out: dict[str, int] = {}
        for (_, action), (_, n) in self.rows.items():
            out[action] = out.get(action, 0) + n
        return out


def choose_action(group: str, recipe: InitRecipe, reheaded: bool) -> str:
    """What happens to a parameter group under a recipe: copied, mimetic, default-init or random."""
    if group == "attention-extra":
        return "default-init"
    if group == "attention":
        return {"copy": "copied", "mimetic": "mimetic", "random": "random"}[recipe.attn]
    if group == "head" and reheaded:
        return "random"
    setting = recipe.mlp if group == "mlp" else recipe.rest
    return "copied" if setting == "copy" else "random"


def parameter_actions(model: nn.Module, recipe: InitRecipe, reheaded: bool) -> dict[str, tuple[str, str]]:
    """name -> (group, action) of every parameter of a converted ``model``, as :func:`apply_recipe` assigns
    them; distill recomputes it from the recorded recipe to know which weights started fresh."""
    attention = tuple(n for n, m in model.named_modules() if isinstance(m, LinearAttention))
    softmax = tuple(n for n, _ in find_softmax_attention(model))
    heads = _head_names(model)
    actions = {}
    for name, _ in model.named_parameters():
        group = parameter_group(name, attention, heads, softmax)
        action = choose_action(group, recipe, reheaded)
        if action == "mimetic" and name.split(".")[len(name.split(".")) - 2] in NORM_AND_GATE:
            action = "default-init"  # Mimetic sets only the four projections; their norms/gate restart
        actions[name] = (group, action)
    return actions


@torch.no_grad()
def apply_recipe(student: nn.Module, recipe: InitRecipe, fresh: Optional[nn.Module], reheaded: bool) -> InitReport:
    """Set the student's values per ``recipe``; it holds the source's values (and default extras) on entry."""
    fresh_params = dict(fresh.named_parameters()) if fresh is not None else {}
    report = InitReport({})
    generator = torch.Generator().manual_seed(recipe.seed)
    if recipe.attn == "mimetic":
        for module in student.modules():
            if isinstance(module, LinearAttention):
                mimetic_init(module, generator)
    actions = parameter_actions(student, recipe, reheaded)
    for name, tensor in student.named_parameters():
        group, action = actions[name]
        if action == "random":
            if name not in fresh_params or fresh_params[name].shape != tensor.shape:
                raise VitconvertError(f"cannot random-initialise {name}: no timm parameter of that name and shape")
            tensor.copy_(fresh_params[name])
        report.add(group, action, tensor.numel())
    return report
