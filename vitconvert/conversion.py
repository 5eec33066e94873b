"""convert(): a softmax timm ViT -> a linear-attention ViT initialised by a recipe."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import timm
import torch
from torch import nn

from .attention import variant_class
from .attention.options import read_options
from .errors import BadValue, VitconvertError, first_line
from .init import InitRecipe, InitReport, apply_recipe
from .provenance import attach
from .selection import Spec, linear_layers
from .surgery import SurgeryReport, find_softmax_attention, model_geometry, swap_attention
from .timm_registry import mark_as_linear


@dataclass
class ConversionReport:
    """Everything ``convert`` did; saved in config.json's "vitconvert" block and shown by the CLI."""

    surgery: SurgeryReport
    init: InitReport
    recipe: InitRecipe
    source: Optional[str] = None
    num_classes: Optional[int] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The report as config.json's vitconvert block records it (and ``convert --json`` prints it)."""
        return {
            "variant": self.surgery.variant,
            "options": self.surgery.options,
            "source": self.source,
            "init": self.recipe.to_dict(),
            "num_classes": self.num_classes,
            "replaced": len(self.surgery.replaced),
            "source_attention": self.surgery.source_classes,
            "notes": self.surgery.notes,
            "depth": self.surgery.depth,
            "layers": self.surgery.layers,  # the linear ones; the rest kept softmax
            "groups": self.init.to_list(),
            "totals": self.init.totals(),
        }


def fresh_like(model: nn.Module, seed: int, **overrides: Any) -> nn.Module:
    """timm's own random init of ``model``'s architecture (same seed -> same weights)."""
    arch = getattr(model, "pretrained_cfg", {}).get("architecture")
    if not arch or not timm.is_model(arch):
        raise VitconvertError("random init needs a model built by timm.create_model (its architecture is unknown)")
    args = {**getattr(model, "_model_args", {}), **getattr(model, "pretrained_model_args", {}), **overrides}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return timm.create_model(arch, pretrained=False, **args)


def check_request(to: str, num_classes: Optional[int]) -> None:
    """What ``convert`` refuses before touching a model: an unknown variant, a head of no classes."""
    variant_class(to, param="to")
    if num_classes is not None and num_classes < 1:
        raise BadValue("num_classes", f"must be at least 1 (got {num_classes})")


def check_fits_grid(to: str, options: Optional[dict[str, Any]], model: nn.Module) -> None:
    """Options that fit no layer on ``model``'s patch grid (MHLA's blocks, LePE's kernel), refused before any
    layer is built: ``--option`` in one line, not a 1.5 GB folder."""
    cls = variant_class(to)
    problem = cls.grid_problem(read_options(cls.declared_options, options or {}, to), model_geometry(model)[1],
                               frozenset(options or {}))
    if problem:
        raise BadValue("options", problem)


def convert(
    model: nn.Module,
    to: str,
    attn_init: str = "mimetic",
    mlp_init: str = "copy",
    rest_init: str = "copy",
    seed: int = 0,
    num_classes: Optional[int] = None,
    options: Optional[dict[str, Any]] = None,
    source: Optional[str] = None,
    layers: Spec = None,
    keep_softmax: Spec = None,
) -> tuple[nn.Module, ConversionReport]:
    """A linear-attention copy of ``model``; ``model`` itself is left unchanged and stays a valid teacher.

    ``layers`` (e.g. ``"2-11"`` or ``[2, 3]``) swaps only those attention layers, ``keep_softmax`` every layer
    but those; the kept ones keep the source's softmax module and weights (a hybrid student)."""
    check_request(to, num_classes)
    recipe = InitRecipe(attn_init, mlp_init, rest_init, seed)
    attention = [name for name, _ in find_softmax_attention(model)]
    chosen = linear_layers(len(attention), layers, keep_softmax, attention)
    reheaded = num_classes is not None and num_classes != getattr(model, "num_classes", None)
    student = copy.deepcopy(model)
    if reheaded:
        if not hasattr(student, "reset_classifier"):
            raise VitconvertError(f"{type(model).__name__} cannot be re-headed (no reset_classifier)")
        student.reset_classifier(num_classes)
    check_fits_grid(to, options, model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        try:
            student, surgery = swap_attention(student, to, options, inplace=True, layers=chosen)
        except (ValueError, ZeroDivisionError, RuntimeError, TypeError) as e:
            if not options:  # no option of the user's to blame: a bug, shown as one
                raise
            given = ", ".join(f"{k}={v!r}" for k, v in options.items())
            raise BadValue("options", f"{to} cannot be built with {given}: {first_line(e)}") from None
    fresh = None
    if recipe.needs_fresh_model or reheaded:
        fresh = fresh_like(model, recipe.seed, **({"num_classes": num_classes} if reheaded else {}))
    init_report = apply_recipe(student, recipe, fresh, reheaded)
    if reheaded:  # the source's class names name other classes
        labels = ("label_names", "label_descriptions")
        student.pretrained_cfg = {**{k: v for k, v in student.pretrained_cfg.items() if k not in labels},
                                  "num_classes": num_classes}
        student._model_args = {**getattr(student, "_model_args", {}), "num_classes": num_classes}
    mark_as_linear(student, to, surgery.layers if surgery.hybrid else None)
    student.eval() if not model.training else student.train()
    report = ConversionReport(surgery, init_report, recipe, source=source,
                              num_classes=getattr(student, "num_classes", num_classes))
    attach(student, report.to_dict())
    return student, report
