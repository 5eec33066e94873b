"""vitconvert's models and attention layers, registered with timm by ``import vitconvert``.

- Model entrypoints ``vitconvert_<variant>`` (arguments: ``architecture`` = the softmax timm model, ``options`` =
  the variant's options, plus that architecture's own arguments): timm builds the softmax architecture, its
  attention is swapped for the variant and, with ``pretrained=True``, the weights that ``pretrained_cfg`` names
  are loaded strictly. A model folder's config.json names one as its ``architecture``, so
  ``timm.create_model("local-dir:F" or "hf-hub:org/name", pretrained=True)`` builds the linear model — and plain
  timm, which does not know the name, refuses with ``Unknown model (vitconvert_elu)`` instead of building softmax
  attention around weights that may fit it silently.
- Attention layer names ``vitconvert_<variant>`` in timm's ViT ``ATTN_LAYERS``, for
  ``timm.create_model("vit_small_patch16_224", attn_layer="vitconvert_elu")`` (a class works as well).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import timm
from timm.layers import register_notrace_module
from timm.models import load_pretrained, model_entrypoint, register_model
from timm.models import vision_transformer as timm_vit
from torch import nn

from .attention import VARIANTS, LinearAttention, on_register
from .errors import VitconvertError
from .hub_io import cached_weights
from .surgery import swap_attention
from .weights_file import check_weights

PREFIX = "vitconvert_"
# model_args keys of ours in a folder's config.json (the rest are the softmax architecture's own)
OWN_ARGS = ("architecture", "options", "layers")

__all__: list[str] = []  # timm's register_model appends the entrypoint names


def architecture_name(variant: str) -> str:
    """timm name of the entrypoint that builds ``variant`` models (also the attn_layer name)."""
    return PREFIX + variant


def is_vitconvert_architecture(name: Optional[str]) -> bool:
    """Whether a config's architecture names one of our timm entrypoints (vitconvert_<variant>)."""
    return isinstance(name, str) and name.startswith(PREFIX) and name[len(PREFIX):] in VARIANTS


def source_architecture(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(softmax timm architecture, its model_args) behind a folder's config.json, in either format.

    Format 1 (vitconvert 0.1) names the softmax architecture itself; format 2 names ``vitconvert_<variant>``
    and keeps the softmax architecture in ``model_args["architecture"]``.
    """
    args = dict(config.get("model_args") or {})
    arch = config.get("architecture", "?")
    if is_vitconvert_architecture(arch):
        arch = args.get("architecture", "?")
        args = {k: v for k, v in args.items() if k not in OWN_ARGS}
    return arch, args


def create_source_model(config: dict[str, Any], **kwargs: Any) -> nn.Module:
    """The softmax architecture behind a vitconvert folder's config.json, timm's random init, its pretrained_cfg."""
    arch, args = source_architecture(config)
    return timm.create_model(arch, pretrained=False, pretrained_cfg=config.get("pretrained_cfg"), **{**args, **kwargs})


def timm_config(config: dict[str, Any], variant: str, options: dict[str, Any],
                layers: Optional[list[int]] = None) -> dict[str, Any]:
    """config.json as ``save_for_hf`` wrote it -> the same naming our entrypoint (so timm needs vitconvert);
    ``layers``: the linear ones of a hybrid (absent: every layer)."""
    arch, args = source_architecture(config)
    args.pop("attn_layer", None)  # a from-scratch linear ViT: the entrypoint swaps softmax attention instead
    # the top-level num_classes says it (timm reads it into pretrained_cfg); transformers passes its own
    # num_classes beside model_args, so a second one there stops it with "multiple values for num_classes"
    args.pop("num_classes", None)
    own = {"architecture": arch, "options": options, **({"layers": layers} if layers is not None else {})}
    labels = (config.get("pretrained_cfg") or {}).get("label_names")
    named = {"label_names": labels} if labels and "label_names" not in config else {}  # transformers' id2label
    return {**config, "architecture": architecture_name(variant), **named, "model_args": {**own, **args}}


def mark_as_linear(model: nn.Module, variant: str, layers: Optional[list[int]] = None) -> None:
    """Make what timm's savers read (pretrained_cfg's architecture, the arguments the factory recorded) name our
    entrypoint, so that ``save_for_hf``/``push_to_hf_hub`` of a model swapped outside it (``convert``, a format-1
    folder) write a folder timm rebuilds as this linear model; ``layers``: a hybrid's linear ones."""
    cfg = getattr(model, "pretrained_cfg", None)
    linear = next((m for m in model.modules() if isinstance(m, LinearAttention)), None)
    if linear is None or not cfg or not cfg.get("architecture") or is_vitconvert_architecture(cfg["architecture"]):
        return  # nothing swapped (every layer kept softmax: the source itself), or already ours
    pinned = linear.pinned_options()
    args = {k: v for k, v in getattr(model, "_model_args", {}).items() if k != "attn_layer"}
    own = {"architecture": cfg["architecture"], "options": pinned, **({"layers": layers} if layers else {})}
    model._model_args = {**own, **args}
    model.pretrained_cfg = model.default_cfg = {**cfg, "architecture": architecture_name(variant)}


def export_model_args(model: nn.Module) -> dict[str, Any]:
    """Replacements that make a linear model's timm arguments serialisable for ``save_for_hf``."""
    layer = getattr(model, "_model_args", {}).get("attn_layer")
    ours = (isinstance(layer, type) and issubclass(layer, LinearAttention)) or (
        isinstance(layer, str) and is_vitconvert_architecture(layer))
    return {"attn_layer": None} if ours else {}


def create_linear_vit(variant: str, pretrained: bool = False, *, architecture: Optional[str] = None,
                      options: Optional[dict[str, Any]] = None, layers: Optional[list[int]] = None,
                      pretrained_cfg: Any = None,
                      cache_dir: Any = None, pretrained_model_args: Optional[dict[str, Any]] = None,
                      **kwargs: Any) -> nn.Module:
    """timm's ``architecture`` with ``variant`` attention (in ``layers`` only: a hybrid); with ``pretrained``, its
    weights loaded strictly."""
    check_architecture(variant, architecture)
    for name, value in (("attn_drop_rate", kwargs.get("attn_drop_rate")), ("attn_layer", kwargs.get("attn_layer"))):
        if value:  # refused as the attn_layer= route refuses attn_drop, not dropped without a word
            raise VitconvertError(f"{architecture_name(variant)}: {name}={value!r}: {UNHONOURED[name]}")
    check_layer_list(variant, layers)
    features = kwargs.pop("features_only", False)
    feature_cfg = {k: kwargs.pop(k) for k in FEATURE_ARGS if k in kwargs}
    if pretrained_model_args:
        kwargs["pretrained_model_args"] = {k: v for k, v in pretrained_model_args.items() if k not in OWN_ARGS}
    model = timm.create_model(architecture, pretrained=False, pretrained_cfg=pretrained_cfg, cache_dir=cache_dir,
                              **kwargs)
    model, swapped = swap_attention(model, variant, options, inplace=True, layers=layers)
    if pretrained:  # with the family's own filter, as timm loads it (e.g. position embeddings for a new img_size)
        family = sys.modules[model_entrypoint(architecture).__module__]
        load_pretrained(model, pretrained_cfg=model.pretrained_cfg, num_classes=model.num_classes,
                        in_chans=kwargs.get("in_chans", 3), filter_fn=getattr(family, "checkpoint_filter_fn", None),
                        strict=True, cache_dir=cache_dir)
    weights = pretrained_weights(model.pretrained_cfg) if pretrained else transformers_weights()
    for path in weights:
        check_weights(path, variant, swapped.layers, str(path.parent / "config.json"))
    # timm's savers (save_for_hf, push_to_hf_hub) name pretrained_cfg's architecture, beside the arguments the
    # factory recorded (architecture, options, layers): the entrypoint that rebuilds this model, not the softmax one
    model.pretrained_cfg = model.default_cfg = {**model.pretrained_cfg, "architecture": architecture_name(variant)}
    return features_only(model, **feature_cfg) if features else model


def check_layer_list(variant: str, layers: Any) -> None:
    """``layers`` as a folder's config.json must give it: absent, or a non-empty list of layer indices (a string
    such as "1-3" or an empty list would build another model than the weights were saved from)."""
    if layers is None:
        return
    if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                        for i in layers):
        raise VitconvertError(f"{architecture_name(variant)}: its layers must be a list of layer indices (got "
                              f"{layers!r}); restore config.json's model_args as vitconvert wrote them")
    if not layers:
        raise VitconvertError(f"{architecture_name(variant)}: an empty layer list makes no layer linear: that is the "
                              "softmax model, not a vitconvert one; restore config.json's model_args")


LOCAL_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")  # timm's order


def pretrained_weights(cfg: dict[str, Any]) -> list[Path]:
    """The weights file timm just loaded for ``pretrained=True``: a ``local-dir:`` folder's (the first of timm's
    preferred names), or an ``hf-hub:`` repo's in the Hub cache; safetensors or a pickle (read weights_only)."""
    file, repo = cfg.get("file"), cfg.get("hf_hub_id")
    if file:
        path = Path(file)
        if path.is_dir():
            path = next((path / name for name in LOCAL_WEIGHTS if (path / name).is_file()), path / LOCAL_WEIGHTS[0])
        return [path] if path.is_file() else []
    return cached_weights(str(repo)) if repo else []


def transformers_weights() -> list[Path]:
    """The weights files transformers' ``from_pretrained`` will load into the model being built, or none.

    transformers builds the timm model (through this entrypoint, ``pretrained=False``) before it reads the weights,
    and passes only config.json's model_args: the files it resolved are in its ``from_pretrained`` call's
    ``checkpoint_files``, the one place they can be read before the weights go into a model they may not fit."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "from_pretrained" and str(frame.f_globals.get("__name__")).startswith(
                "transformers."):
            files = frame.f_locals.get("checkpoint_files") or []
            return [Path(f) for f in files if Path(f).is_file()]
        frame = frame.f_back
    return []


def check_architecture(variant: str, architecture: Optional[str]) -> None:
    """The softmax ViT the entrypoint builds on: named (a folder's config.json names it in model_args), and one
    timm knows; the line says which mistake it is, not only which keyword the entrypoint takes."""
    name = architecture_name(variant)
    if not architecture:
        raise VitconvertError(f"{name} is a timm ViT with {variant} attention, and no ViT was named: pass the softmax "
                              f"model it is built on (timm.create_model('{name}', architecture='vit_small_patch16_224'"
                              "), or load the vitconvert folder, whose config.json names it in model_args)")
    if not isinstance(architecture, str) or not timm.is_model(architecture):
        import difflib

        close = difflib.get_close_matches(str(architecture), timm.list_models(), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise VitconvertError(f"{name}: the softmax ViT {architecture!r} is not a timm model{hint}")


# timm arguments about softmax attention that a linear variant cannot honour, and why.
UNHONOURED = {"attn_drop_rate": "linear attention forms no attention weights to drop (proj_drop_rate works)",
              "attn_layer": "the variant is the attention layer (build the softmax architecture for another one)"}


# What timm's ViT families pass to their feature wrapper (``features_only=True``): the intermediate-layer getter.
FEATURE_ARGS = ("out_indices", "out_map", "return_dict", "output_fmt", "norm", "prune")


def features_only(model: nn.Module, out_indices: Any = 3, **feature_cfg: Any) -> nn.Module:
    """The linear model wrapped as timm wraps its ViTs for ``features_only=True`` (FeatureGetterNet over
    ``forward_intermediates``), after the swap and the weights: the same feature maps, channels and strides."""
    from timm.models._builder import pretrained_cfg_for_features
    from timm.models._features import FeatureGetterNet

    cfg = model.pretrained_cfg
    wrapped = FeatureGetterNet(model, out_indices=out_indices, **feature_cfg)
    wrapped.pretrained_cfg = wrapped.default_cfg = pretrained_cfg_for_features(cfg)
    return wrapped


def _entrypoint(variant: str) -> Callable[..., nn.Module]:
    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return create_linear_vit(variant, pretrained, **kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = architecture_name(variant)
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = f"A timm ViT (``architecture=``) with {variant} linear attention (vitconvert)."
    return entrypoint


def register(variant: str, cls: type[LinearAttention]) -> None:
    """Make a variant known to timm: a model entrypoint, an attn_layer name, and a leaf module for FX (timm's
    feature extraction traces the model around it; its grid and shape dispatch stay Python, as timm does for
    its own modules with shape-dependent control flow)."""
    if not timm.is_model(architecture_name(variant)):
        register_model(_entrypoint(variant))
    timm_vit.ATTN_LAYERS.setdefault(architecture_name(variant), cls)
    register_notrace_module(cls)


on_register(register)  # every variant registered so far, and each one registered later
