"""SOURCE string -> a timm softmax ViT, through timm's own loading.

A source is a timm name, a short alias, ``digits`` (the bundled teacher), ``hf-hub:org/name[@revision]``,
``local-dir:PATH`` or a plain folder path (timm ``save_for_hf`` layout), or a weights file used with ``arch``.
Sources are softmax models only: a vitconvert (linear) folder is refused from its config.json, before any
weights are read — ``vitconvert.load`` (loading.py) is the one entry that takes either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import timm
import torch
from torch import nn

from .aliases import ALIASES, resolve_alias, suggest
from .assets import teacher_folder
from .errors import VitconvertError, first_line
from .folder import check_weights_readable, folder_block, read_config
from .hub_io import hub_offline, hub_reachable, hub_snapshot, weights_cached
from .timm_registry import source_architecture

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def bundled_folder(name: str) -> Optional[Path]:
    """Model folders shipped in the package (offline): ``digits`` is the quickstart's softmax teacher."""
    if name == "digits":
        return teacher_folder()
    return None


class LinearSourceError(VitconvertError):
    """A vitconvert folder where a softmax source was expected."""


@dataclass
class Source:
    """A loaded softmax model and where it came from (recorded in the converted folder)."""

    model: nn.Module
    arch: str
    spec: str  # the SOURCE string as the user gave it
    pretrained: bool
    extra: dict[str, Any] = field(default_factory=dict)


def load_state_file(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a weights file: safetensors, or a torch file read with weights_only=True (never unpickled)."""
    if not path.is_file():
        raise VitconvertError(f"weights file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors and torch raise many types for truncated/corrupt files
        reason = first_line(e)
        raise VitconvertError(f"cannot read {path}: corrupt, truncated or not a weights file ({reason})") from None
    for key in ("state_dict", "model", "model_ema", "module"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise VitconvertError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _create(name: str, pretrained: bool, spec: str, **kwargs: Any) -> nn.Module:
    if pretrained and not name.startswith("local-dir:"):
        check_weights_reachable(name, spec)
    try:
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    except RuntimeError as e:
        msg = first_line(e)
        if "size mismatch" in str(e) or "Missing key" in str(e) or "Unexpected key" in str(e):
            raise VitconvertError(f"the weights of {spec} do not fit architecture {name}: {msg}") from None
        raise VitconvertError(f"cannot build {spec}: {msg}") from None
    except (OSError, ValueError) as e:
        msg = first_line(e)
        if pretrained and ("offline" in msg.lower() or "connect" in msg.lower() or "resolve" in msg.lower()
                           or "cache" in msg.lower() or "not found" in msg.lower() or "404" in msg):
            raise VitconvertError(
                f"cannot get pretrained weights for {spec} (no network and not in the Hub cache?): {msg}; "
                "use --no-pretrained for a randomly initialised model") from None
        raise VitconvertError(f"cannot load {spec}: {msg}") from None


def check_weights_reachable(name: str, spec: str) -> None:
    """Weights on the Hub that are not in its cache need the Hub: one quick request says whether it answers,
    instead of a minute of huggingface_hub's retry warnings before the same error."""
    try:
        repo_id = timm.models.get_pretrained_cfg(name).hf_hub_id
    except Exception:  # no pretrained config (weights by URL, a custom name): timm says what it can
        return
    if not repo_id or hub_offline() or weights_cached(repo_id) or hub_reachable():
        return
    raise VitconvertError(f"cannot get pretrained weights for {spec}: the Hub (huggingface.co) does not answer and "
                          f"{repo_id} is not in the Hub cache; use --no-pretrained for a randomly initialised model, "
                          "or fill the cache on a machine with a network")


def shadowed_name(spec: str, path: Path) -> bool:
    """A bare name (``digits``, ``deit_small``) that a local non-model folder of the same name would hide:
    the name wins; ``./digits`` still means the folder."""
    bare = os.sep not in spec and not spec.startswith(".") and not spec.endswith(WEIGHT_SUFFIXES)
    if not bare or (path / "config.json").is_file() or path.is_file():
        return False
    return bundled_folder(spec) is not None or spec in ALIASES or timm.is_model(spec)


def load_source(spec: str, pretrained: bool = True, arch: Optional[str] = None, **model_kwargs: Any) -> Source:
    """Resolve any SOURCE string to a loaded timm model."""
    if not spec or not spec.strip():
        raise VitconvertError("empty model source")
    if spec.startswith("hf-hub:"):
        return load_folder(hub_snapshot(spec), spec, **model_kwargs)
    if spec.startswith("local-dir:"):
        return load_folder(Path(spec.split(":", 1)[1]), spec, **model_kwargs)
    path = Path(spec).expanduser()
    looks_like_path = path.exists() or os.sep in spec or spec.endswith(WEIGHT_SUFFIXES) or spec.startswith(".")
    if looks_like_path and shadowed_name(spec, path):
        looks_like_path = False  # `digits` is the bundled teacher even beside a ./digits image folder (as --data)
    if looks_like_path:
        if not path.exists():
            raise VitconvertError(f"path not found: {spec}")
        if path.is_dir():
            return load_folder(path, spec, **model_kwargs)
        return load_weights_file(path, spec, arch, **model_kwargs)
    bundled = bundled_folder(spec)
    if bundled is not None:
        return load_folder(bundled, spec, **model_kwargs)
    name = resolve_alias(spec)
    if not timm.is_model(name):
        raise VitconvertError(f"unknown model {spec!r}{suggest(spec)}")
    model = _create(name, pretrained, spec, **model_kwargs)
    return Source(model, name, spec, pretrained)


def load_folder(folder: Path, spec: str, **model_kwargs: Any) -> Source:
    """A timm ``save_for_hf`` folder; a vitconvert folder is refused before its weights are read."""
    if not folder.is_dir():
        raise VitconvertError(f"folder not found: {folder}")
    cfg = read_config(folder)
    if folder_block(cfg) is not None:  # ours, or saved from one of ours by timm's save_for_hf
        raise LinearSourceError(f"{spec} is already a linear-attention vitconvert model, not a softmax source: give "
                                f"the softmax ViT it was converted from ({source_architecture(cfg)[0]})")
    if "architecture" not in cfg:
        raise VitconvertError(f"{folder}/config.json has no 'architecture': not a timm model folder")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise VitconvertError(f"{folder} has config.json but no weights (model.safetensors)")
    check_weights_readable(folder)
    model = _create(f"local-dir:{folder}", True, spec, **model_kwargs)
    return Source(model, cfg["architecture"], spec, True)


def load_weights_file(path: Path, spec: str, arch: Optional[str], **model_kwargs: Any) -> Source:
    """A bare weights file needs ``--arch``; timm builds the model and its filter adapts the keys."""
    if path.suffix not in WEIGHT_SUFFIXES:
        raise VitconvertError(f"{path.name} is a file, not a model: give a model folder, a timm name, or a weights "
                              f"file ({', '.join(WEIGHT_SUFFIXES)})")
    if arch is None:
        raise VitconvertError(f"{path.name} is a bare weights file with no architecture: `vitconvert convert "
                              f"{path} --arch NAME` reads it; other commands take a model folder")
    name = resolve_alias(arch)
    if not timm.is_model(name):
        raise VitconvertError(f"unknown architecture {arch!r}{suggest(arch)}")
    state = load_state_file(path)  # validates the file in one line before timm reads it
    overlay: dict[str, Any] = {"file": str(path)}
    head = state.get("head.weight")
    if head is not None and head.dim() == 2:
        overlay["num_classes"] = head.shape[0]
        model_kwargs.setdefault("num_classes", head.shape[0])
    model = _create(name, True, spec, pretrained_cfg_overlay=overlay, **model_kwargs)
    return Source(model, name, spec, True)
