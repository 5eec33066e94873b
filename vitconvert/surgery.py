"""Find every global softmax attention in a timm ViT family and swap it for a linear variant.

The family adapters are data: which attention classes are global softmax self-attention, and which
model-level softmax-only modules (shared relative-position biases) become unused once attention is linear.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional

from timm.layers import Attention, AttentionRope
from timm.models.beit import Attention as BeitAttention
from timm.models.eva import EvaAttention
from timm.models.vision_transformer_relpos import RelPosAttention
from torch import nn

from .attention import LinearAttention, variant_class
from .errors import VitconvertError

# Global (all-token) softmax self-attention classes of timm's ViT families.
SOFTMAX_ATTENTION: tuple[type[nn.Module], ...] = (Attention, AttentionRope, EvaAttention, BeitAttention,
                                                  RelPosAttention)
# Model-level modules that only produce softmax logit biases.
SHARED_LOGIT_BIAS = ("rel_pos_bias", "shared_rel_pos")


@dataclass
class SurgeryReport:
    """What the swap did, for the conversion report and the model card."""

    variant: str
    options: dict[str, Any]
    replaced: list[str] = field(default_factory=list)
    source_classes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    depth: int = 0  # attention layers of the model
    layers: list[int] = field(default_factory=list)  # the ones made linear (all of them unless a hybrid)

    @property
    def hybrid(self) -> bool:
        """Whether some attention layers stayed softmax."""
        return len(self.layers) != self.depth


def find_softmax_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every global softmax self-attention in ``model``."""
    return [(n, m) for n, m in model.named_modules() if type(m) in SOFTMAX_ATTENTION]


def feature_wrapped(model: nn.Module) -> nn.Module:
    """The ViT inside timm's ``features_only=True`` wrapper (FeatureGetterNet keeps it as ``.model``), else
    ``model``: its prefix tokens, grid and shared biases are the ViT's, not the wrapper's."""
    inner = getattr(model, "model", None)
    return inner if hasattr(model, "feature_info") and isinstance(inner, nn.Module) else model


def model_geometry(model: nn.Module) -> tuple[int, Optional[tuple[int, int]]]:
    """Prefix-token count and patch grid of a timm ViT (the grid is None for NaFlex's packed patches)."""
    model = feature_wrapped(model)
    num_prefix = getattr(model, "num_prefix_tokens", None)
    if num_prefix is None:
        num_prefix = int(getattr(model, "cls_token", None) is not None)
    embeds = getattr(model, "patch_embed", None) or getattr(model, "embeds", None)
    grid = getattr(embeds, "grid_size", None)
    if grid is None and embeds is not None and getattr(embeds, "patch_embed", None) is not None:
        grid = getattr(embeds.patch_embed, "grid_size", None)
    return int(num_prefix), (tuple(int(g) for g in grid) if grid is not None else None)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every attention layer of a converted or softmax model, in order, whichever kind it is now."""
    return [(n, m) for n, m in model.named_modules()
            if type(m) in SOFTMAX_ATTENTION or isinstance(m, LinearAttention)]


def linear_layer_indices(model: nn.Module) -> tuple[list[int], int]:
    """(indices of the linear attention layers, number of attention layers) of a model."""
    layers = attention_modules(model)
    return [i for i, (_, m) in enumerate(layers) if isinstance(m, LinearAttention)], len(layers)


def swap_attention(model: nn.Module, variant: str, options: Optional[dict[str, Any]] = None,
                   inplace: bool = False, layers: Optional[Sequence[int]] = None) -> tuple[nn.Module, SurgeryReport]:
    """Return a copy of ``model`` (the original stays a valid teacher) with linear attention in ``layers``
    (indices in model order; default: every layer); the others keep their softmax module and weights."""
    cls = variant_class(variant, param="variant")
    options = dict(options or {})
    found = find_softmax_attention(model)
    if not found:
        refuse_no_softmax(model)
    target = model if inplace else copy.deepcopy(model)
    num_prefix, grid = model_geometry(target)
    chosen = set(range(len(found)) if layers is None else layers)
    if any(not 0 <= i < len(found) for i in chosen):
        raise VitconvertError(f"layer {max(chosen)} does not exist: the model has {len(found)} attention layers")
    report = SurgeryReport(variant, {**cls.default_options, **options}, depth=len(found), layers=sorted(chosen))
    for index, (name, module) in enumerate(find_softmax_attention(target)):
        if index not in chosen:
            continue
        try:
            new = cls.from_softmax(module, num_prefix_tokens=num_prefix, grid_size=grid, **options)
        except ValueError as e:
            raise VitconvertError(str(e)) from None
        parent, _, attr = name.rpartition(".")
        setattr(target.get_submodule(parent) if parent else target, attr, new)
        report.replaced.append(name)
        if type(module).__name__ not in report.source_classes:
            report.source_classes.append(type(module).__name__)
        report.notes.extend(n for n in dropped_notes(module, new) if n not in report.notes)
    report.notes.extend(model_notes(feature_wrapped(target), grid, drop_shared_biases=not report.hybrid))
    return target, report


def refuse_no_softmax(model: nn.Module) -> NoReturn:
    """Why ``model`` has nothing to convert: it is converted already, or not a ViT family vitconvert knows."""
    if any(isinstance(m, LinearAttention) for m in model.modules()):
        raise VitconvertError("this model already has linear attention (a vitconvert model); "
                              "convert its softmax source instead")
    raise VitconvertError(f"{type(model).__name__} has no global softmax attention to convert "
                          "(only ViT families with all-token self-attention are supported)")


def dropped_notes(module: nn.Module, new: LinearAttention) -> list[str]:
    """What of a softmax layer its linear replacement leaves out: softmax logit biases, attention dropout (a
    training setting of the source; said, not silently lost)."""
    notes = [f"per-layer {d} (a softmax logit bias) dropped: no linear analogue" for d in new.dropped]
    attn_drop = getattr(getattr(module, "attn_drop", None), "p", 0.0)
    if attn_drop:
        notes.append(f"attention dropout (p={attn_drop}) dropped: linear attention forms no attention weights "
                     "to drop")
    return notes


def model_notes(body: nn.Module, grid: Optional[tuple[int, int]], drop_shared_biases: bool) -> list[str]:
    """Model-level changes: shared softmax logit biases dropped (kept while a softmax layer still reads them),
    rope kept, no fixed grid."""
    notes = []
    for attr in SHARED_LOGIT_BIAS if drop_shared_biases else ():
        if getattr(body, attr, None) is not None:
            setattr(body, attr, None)
            notes.append(f"shared {attr} (a softmax logit bias) dropped: no linear analogue")
    if getattr(body, "rope", None) is not None:
        notes.append("rotary position embedding kept: applied to q and k before the feature map")
    if grid is None:
        notes.append("no fixed patch grid: grid-based parts fall back to their grid-free form")
    return notes
